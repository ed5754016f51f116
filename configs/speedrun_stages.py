"""
The speedrun's training settings, stage by stage, for the toy GLM-5 (configs/toy.py, architecture unchanged)
on a 2-core CPU in about 23 minutes of training (copy warm-up, pretrain, DSA warm-up, sparse stage, SFT).
Not a train.py config file: a speedrun reads STAGES and passes each stage's entries as --key=value after
configs/toy.py, with --init_from the previous stage's ckpt.pt and an out_dir of its own:

    python train.py configs/toy.py --out_dir=RUN/pretrain --max_iters=2400 --lr_muon=0.005 ...
    python train.py configs/toy.py --stage=dsa_warmup --init_from=RUN/pretrain/ckpt.pt ...

The choices, in short: a copy warm-up first (induction heads, Olsson et al. 2022), Muon at 0.005, WSD with
the decay over the last third, the sparse stage at pretraining's final rate, and the MTP loss off for most of
pretraining and the sparse stage (its three block passes cost more per second than they give). What each
choice measured, with the commands: docs/workshop-run.md, "How the speedrun's stages were tuned".
"""

STAGES = {
    # induction heads first (Olsson et al. 2022, arXiv 2209.11895): copy rows only, a span of 8 to 32 random
    # ids repeated to 64 tokens, at the rate at which the toy forms them (bench/bench_copy.py); 2.6M tokens
    "copy_warmup": dict(
        copy_frac=1.0,
        batch_size=32,
        block_size=64,
        max_iters=1600,
        warmup_iters=20,
        lr_muon=0.005,
        lr_adamw=6e-3,
        decay_frac=0.0,  # constant after the warm-up: pretraining goes on at the same rate
        mtp_weight_early=0.0,
        mtp_weight_late=0.0,
        eval_interval=200,
        log_interval=50,
    ),
    "pretrain": dict(
        copy_frac=0.125,  # one row in eight stays a copy row, so the induction heads are kept
        max_iters=2400,
        warmup_iters=20,
        lr_muon=0.005,
        lr_adamw=6e-3,
        decay_frac=0.334,  # WSD decay over the last third (from step 1598)
        mtp_weight_early=0.0,
        mtp_weight_late=0.1,
        mtp_switch_frac=0.85,
        eval_interval=100,
        log_interval=10,
    ),
    "dsa_warmup": dict(
        stage="dsa_warmup",
        max_iters=60,
        lr_muon=0.02,  # train.py's defaults, written out: configs/toy.py's main-job recipe sets others
        lr_adamw=3e-3,
        warmup_iters=5,
        mtp_weight_early=0.1,  # the MTP block's indexer warms up too (its KL joins the loss)
        mtp_weight_late=0.1,
        eval_interval=60,
        eval_iters=4,
        log_interval=10,
        sample_tokens=0,
    ),
    "dsa_sparse": dict(
        stage="dsa_sparse",
        max_iters=150,
        warmup_iters=10,
        lr_muon=0.0005,  # pretraining's final lr (at the 0.04 schedule its peak lr lost 0.19 of val loss)
        lr_adamw=6e-4,
        mtp_weight_early=0.0,
        mtp_weight_late=0.0,
        eval_interval=150,
        log_interval=10,
    ),
    "sft": dict(
        stage="sft",
        max_iters=200,
        warmup_iters=10,
        lr_muon=0.005,  # masked val loss 1.58 against 1.87 at train.py's 0.02 (from the same sparse model)
        lr_adamw=3e-3,
        mtp_weight_early=0.0,
        mtp_weight_late=0.1,
        mtp_switch_frac=0.7,
        eval_interval=200,
        log_interval=10,
    ),
}
