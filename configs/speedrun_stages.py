"""
The speedrun's training settings, stage by stage, for the toy GLM-5 (configs/toy.py, architecture unchanged)
on a 2-core CPU in about 23 minutes of training (copy warm-up, pretrain, DSA warm-up, sparse stage, SFT),
measured with nothing else running. Not a train.py config file: a speedrun reads STAGES and passes each
stage's entries as --key=value after configs/toy.py, with --init_from the previous stage's ckpt.pt and an
out_dir of its own:

    python train.py configs/toy.py --out_dir=RUN/pretrain --max_iters=2400 --lr_muon=0.005 ...
    python train.py configs/toy.py --stage=dsa_warmup --init_from=RUN/pretrain/ckpt.pt ...

What buys the better model (measured with `python bench_train.py --configs=configs/toy.py --stages` and
train.py runs side by side on this machine, 1 torch thread, load 3-5; the items before the last two at
Muon 0.04, the rate these runs used then):
- MTP off for the first 85% of pretraining: the MTP block's three passes and their three 4,096-way lm_head
  calls are more than half of a pretraining step (2.22x the step without them); its weight comes on for
  the last 15%, so the serving stack's MTP head is trained. Per step MTP helps a little (val 5.21 with it,
  5.33 without at step 100, 4.72 / 4.80 at step 200, lr 0.02), per second it loses. In the sparse stage the
  MTP passes cost as much again (3.94x against 1.82x a dense step): off there, on for SFT's last 30%.
- The sparse stage at pretraining's final lr (Muon 0.004, AdamW 6e-4), not its peak: from the 2,400-step
  model (val 3.498) the sparse model's val loss is 3.515 at the low lr and 3.680 at the peak (0.04 / 6e-3),
  where the same sparse weights attending densely score 3.689: the loss came from the lr, not the top-k.
- WSD with the decay over the last third: 3.722 at step 1200 against 3.787 with the last 20%.
- 2,400 steps (4.9M tokens, 1.4 epochs of the stdlib corpus): val lm 3.498, 13.4 min at load about 1 with
  two threads (speedrun.py, the whole run 20 min); 1,200 steps gave 3.724 in 6.8 min. The measurements
  below were taken at 1,200 steps.
- 1,200 steps of 8 x 256 tokens (2.46M tokens, 0.7 epoch of the stdlib corpus): val lm 3.72-3.79,
  against 4.679 for the README's 200-step main job; samples have def, self, return and indentation.
- Against train.py's defaults at about the same compute (820 steps, lr 0.02, MTP on: val 3.732 in 925 s of
  CPU): 3.787 (decay 20%) and 3.722 (decay a third) in about 718 s. Per second a gain of about a fifth,
  not the 2.2x of the step time: per step the defaults learn more (4.104 against 4.359 at step 500).
- One torch thread when anything else runs on the two cores: two threads under contention fell to about
  250 tokens/s (8 s steps), one thread kept 1,200-2,400.
- Muon at 0.005, not the 0.04 the figures above used (AdamW 6e-3 in both): the same 2,400 steps, seed and
  data end at val 2.92 instead of 3.50 (3.65 against 4.17 at step 1,000). The lower rate is also the one at
  which the toy forms induction heads on copy data (bench_copy.py: by step 1,300 at 0.005, not in 3,000 at
  0.02). The sparse stage follows at pretraining's final lr (0.0005): val 2.89. SFT at 0.005 too: masked
  val loss 1.58 against 1.87 at train.py's 0.02 from the same sparse model, and the episodes policy it
  leads to starts RL at 0.69 held-out on general:0 against 0.58 (README: the RL section).
- The copy warm-up: 1,600 steps of copy rows alone (5 min on a quiet machine) form induction heads (the
  copy probe's second copy at 68-70% top-1), and pretraining from there with one row in eight a copy row
  keeps them (96-97% top-1 at step 2,400) for val 2.98-3.00 against 2.92 without; its sample is shaped like
  Python, and its SFT'd policy copies names into its search calls (held-out search:0 0.25-0.55 against
  0.16; README: the RL section).
- Not taken: torch.compile (train.py's compile=True fails on a CPU: the fake of torch's grouped GEMM asks
  for bf16 in training, experts.py's custom op covers inference only); block_size 512 (fewer tokens/s,
  the attention's T^2); synthetic copy rows (train.py's copy_frac): a quarter of each batch as copy rows
  over all ids at Muon 0.005 cost val loss (3.11 against 2.92) and did not make the toy copy by content
  (copy_probe.copy_probe: 8.28 nats on the second copy against 8.68 on the first, chance 8.32).

"""

STAGES = {
    # induction heads first (Olsson et al. 2022, arXiv 2209.11895): copy rows only, a span of 8 to 32 random
    # ids repeated to 64 tokens, at the rate at which the toy forms them (bench_copy.py); 2.6M tokens
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
        mtp_weight_early=0.0,
        mtp_weight_late=0.1,
        mtp_switch_frac=0.7,
        eval_interval=200,
        log_interval=10,
    ),
}
