"""
The speedrun's training settings, stage by stage, for the toy GLM-5 (configs/toy.py, architecture unchanged)
on a 2-core CPU in about 25 minutes of training (issue 19: pretrain, DSA warm-up, sparse stage, SFT). Not a
train.py config file: a speedrun reads STAGES and passes each stage's entries as --key=value after
configs/toy.py, with --init_from the previous stage's ckpt.pt and an out_dir of its own:

    python train.py configs/toy.py --out_dir=RUN/pretrain --max_iters=1200 --lr_muon=0.04 ...
    python train.py configs/toy.py --stage=dsa_warmup --init_from=RUN/pretrain/ckpt.pt ...

What buys the better model (measured with `python bench_train.py --configs=configs/toy.py --stages` and
train.py runs side by side on this machine, 1 torch thread, load 3-5):
- MTP off for the first 85% of pretraining: the MTP block's three passes and their three 4,096-way lm_head
  calls are more than half of a pretraining step (2.2x the step without them); its weight comes on for the
  last 15%, so the serving stack's MTP head is trained. In the sparse stage the MTP passes are 2.2x too
  (sparse attention and its KL on three more block passes): off there, on for SFT's last 30%.
- Muon 0.04 / AdamW 6e-3 (twice train.py's defaults) over 1,200 steps of 8 x 256 tokens (2.46M tokens,
  0.7 epoch of the stdlib corpus): val lm 3.787, against 4.679 for the README's 200-step main job. The
  WSD decay (last 20%) is where most of the last gain comes: 4.133 at step 1000, 3.787 at 1200.
- One torch thread when anything else runs on the two cores: two threads under contention fell to about
  250 tokens/s (8 s steps), one thread kept 1,200-2,400.
- Not taken: torch.compile (train.py's compile=True fails on a CPU: the fake of torch's grouped GEMM asks for
  bf16 in training, experts.py's custom op covers inference only); block_size 512 (fewer tokens/s, the
  attention's T^2); synthetic copy rows (train.py's copy_frac): they cost val loss and did not make the
  toy model copy within the budget (the copy probe, train.copy_probe).

Wall times in WALL_S are per stage with these settings at load about 1-2 with one thread, estimated from
the measured CPU time of the runs (see the SETTINGS.md of the toy helper's report for the raw figures).
"""

STAGES = {
    "pretrain": dict(
        max_iters=1200,
        warmup_iters=20,
        lr_muon=0.04,
        lr_adamw=6e-3,
        mtp_weight_early=0.0,
        mtp_weight_late=0.1,
        mtp_switch_frac=0.85,
        eval_interval=100,
        log_interval=10,
    ),
    "dsa_warmup": dict(
        stage="dsa_warmup",
        max_iters=60,
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
        mtp_weight_early=0.0,
        mtp_weight_late=0.0,
        eval_interval=150,
        log_interval=10,
    ),
    "sft": dict(
        stage="sft",
        max_iters=200,
        warmup_iters=10,
        mtp_weight_early=0.0,
        mtp_weight_late=0.1,
        mtp_switch_frac=0.7,
        eval_interval=200,
        log_interval=10,
    ),
}

# seconds per stage at load about 1-2, one torch thread (filled from the measured runs)
WALL_S = {"pretrain": 850, "dsa_warmup": 60, "dsa_sparse": 170, "sft": 300}
