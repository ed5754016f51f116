"""
Muon vs Muon Split vs AdamW on the toy GLM-5 (the GLM-5 report's optimizer section, Muon Split; Moonshot's
"Muon is Scalable for LLM Training", arXiv 2502.16982, whose Moonlight model found Muon about 2x as
token-efficient as AdamW). Three runs from the same initial weights, over the same batches in the same
order, with the same token budget, lr schedule and training objective (train.py's, see "One training run");
only the optimizer differs:

    muon_split   Muon (muon.build_optimizers, muon_split=True): q_b_proj / kv_b_proj orthogonalised per head
    muon         Muon on whole matrices (muon_split=False)
    adamw        AdamW for every parameter (betas 0.9/0.95, wd 0.1 except norms and biases, as the rest of
                 the project uses)

Run it:
    python bench/bench_muon.py               # 200 steps x 8 x 256 tokens per run
    python bench/bench_muon.py --quick       # 20 steps, a smoke test
    python bench/bench_muon.py --adamw_lrs=1e-3,3e-3,1e-2   # sweep AdamW's lr; the best final loss: reference
    python bench/bench_muon.py --steps=1000 --lr_muon=0.01 --device=cuda

Honest limits: one seed, one small model, one short budget on a tiny corpus: a difference of a few
hundredths in val loss is within what another seed would give, and Moonlight's 2x comes from scaling-law
fits over many compute-optimal runs (this is one point, not a fit). The lrs are train.py's defaults (Muon
0.02 on the block matrices, AdamW 3e-3 on the rest), not tuned here; AdamW-only gets 3e-3 unless
--adamw_lrs sweeps it; Muon's lr is not swept. "Tokens to reach AdamW's final loss" compares a Muon run
part-way through its schedule (before its lr decay) with AdamW at the end of its decay, which favours
AdamW: the ratio is conservative. Wall time on a shared CPU is noisy; Newton-Schulz runs in fp32 on a CPU.
Attention-logit stability (the report's other claim for Muon Split) is not measured here.
"""

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from contextlib import nullcontext

import torch

# run as python bench/bench_muon.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data
import model
import muon
import train
from bench_train import describe_machine
from train import pick_device, sync
from tokenizer import get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: configs/, data/

# train.py's objective and WSD schedule, read from its defaults (not copied), fixed for every optimizer
MTP_WEIGHT_EARLY, MTP_WEIGHT_LATE = train.mtp_weight_early, train.mtp_weight_late  # switch at half the run
BALANCE_WEIGHT, BIAS_UPDATE_RATE = train.balance_weight, train.bias_update_rate
GRAD_CLIP, WEIGHT_DECAY = train.grad_clip, train.weight_decay
WARMUP, DECAY_FRAC, MIN_LR_FRAC = train.warmup_iters, train.decay_frac, train.min_lr_frac


def lr_mult(step, steps):
    """train.lr_mult's WSD for a run of `steps`, except that warmup is at most a tenth of the run (a --quick
    run of 20 steps warms up for 2)."""
    warmup = min(WARMUP, max(1, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    decay_start = max(warmup, int(steps * (1 - DECAY_FRAC)))
    if step < decay_start:
        return 1.0
    return 1.0 - (1.0 - MIN_LR_FRAC) * (step - decay_start) / max(1, steps - decay_start)


# -----------------------------------------------------------------------------
# The three optimizer set-ups


def make_optimizers(m, kind, lr_muon, lr_adamw, ns_dtype):
    if kind in ("muon_split", "muon"):
        return list(
            muon.build_optimizers(
                m,
                lr_muon=lr_muon,
                lr_adamw=lr_adamw,
                weight_decay=WEIGHT_DECAY,
                muon_split=kind == "muon_split",
                ns_dtype=ns_dtype,
            )
        )
    # AdamW everywhere: muon.param_groups still decides decay (matrices) vs no decay (norms, biases)
    groups = muon.param_groups(m, lr_muon=lr_adamw, lr_adamw=lr_adamw, weight_decay=WEIGHT_DECAY)
    groups = [{"params": g["params"], "lr": lr_adamw, "weight_decay": g["weight_decay"]} for g in groups]
    return [torch.optim.AdamW(groups, lr=lr_adamw, betas=(0.9, 0.95), eps=1e-8)]


# -----------------------------------------------------------------------------
# One training run
#
# The objective is train.py's pretraining objective: lm + w_mtp * MTP (0.3, then 0.1 after half the run) +
# 1e-4 * sequence balance loss, gradient clipping at 1.0, and the aux-loss-free router bias update after every
# optimizer step. The val loss is the plain next-token loss on the same fixed val windows at every evaluation.
# Printed (print_table): final val loss, the tokens each run needs to reach AdamW's final val loss (linear
# interpolation between evaluations), the ratio AdamW's tokens / those tokens (Moonlight: about 2), and wall
# time. The curves go to a JSON file (--out).


def run(name, kind, lr_muon, lr_adamw, init_state, cfg, train_batches, val_batches, args, dev):
    torch.manual_seed(args.seed)
    m = model.GLM5(cfg).to(dev)
    m.load_state_dict(init_state)  # the same weights (and router buffers) for every run
    opts = make_optimizers(
        m, kind, lr_muon, lr_adamw, torch.bfloat16 if dev.startswith("cuda") else torch.float32
    )
    for o in opts:
        for g in o.param_groups:
            g["peak_lr"] = g["lr"]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.startswith("cuda") else nullcontext()
    tokens_per_step = args.batch_size * args.block_size

    @torch.no_grad()
    def evaluate():
        m.eval()
        total = 0.0
        for x, y in val_batches:
            with autocast:
                _, losses = m(x.to(dev), y.to(dev), mtp_weight=0.0, balance_weight=0.0)
            total += losses["lm"].item()
        m.train()
        return total / len(val_batches)

    curve = [(0, evaluate())]  # (tokens seen, val loss)
    train_loss, train_seconds = [], 0.0
    print(f"{name}: step 0 val {curve[0][1]:.4f}", flush=True)
    m.train()
    for step in range(args.steps):
        sync(dev)
        t0 = time.perf_counter()
        mult = lr_mult(step, args.steps)
        for o in opts:
            for g in o.param_groups:
                g["lr"] = g["peak_lr"] * mult
        x, y = train_batches[step]
        mtp_w = MTP_WEIGHT_EARLY if step < args.steps / 2 else MTP_WEIGHT_LATE
        with autocast:
            _, losses = m(x.to(dev), y.to(dev), mtp_weight=mtp_w, balance_weight=BALANCE_WEIGHT)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), GRAD_CLIP)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        model.update_router_bias(m, BIAS_UPDATE_RATE)
        sync(dev)
        train_seconds += time.perf_counter() - t0
        train_loss.append(losses["lm"].item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append(((step + 1) * tokens_per_step, evaluate()))
            print(
                f"{name}: step {step + 1} train lm {train_loss[-1]:.4f} val {curve[-1][1]:.4f} "
                f"({1000 * train_seconds / (step + 1):.0f} ms/step)",
                flush=True,
            )
    return {
        "name": name,
        "kind": kind,
        "lr_muon": lr_muon if kind != "adamw" else None,
        "lr_adamw": lr_adamw,
        "val_curve": curve,
        "train_lm": train_loss,
        "final_val": curve[-1][1],
        "train_seconds": train_seconds,
        "ms_per_step": 1000 * train_seconds / args.steps,
    }


def tokens_to_reach(curve, target):
    """First crossing of `target` by the val curve, linearly interpolated in tokens; None if never reached."""
    for i, (tok, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return 0.0
            t0, l0 = curve[i - 1]
            return t0 + (tok - t0) * (l0 - target) / (l0 - loss)
    return None


# -----------------------------------------------------------------------------
# Main: the arguments, the same batches for every run, the runs, the table


def parse_args():
    ap = argparse.ArgumentParser(
        description="Muon vs Muon Split vs AdamW on the toy GLM-5 (same data, same budget)"
    )
    ap.add_argument("--config", default="configs/toy.py")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per run (the token budget)")
    ap.add_argument("--quick", action="store_true", help="20 steps, 4 val batches: check that it runs")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=256)
    ap.add_argument("--eval_every", type=int, default=0, help="steps between evaluations (0: steps / 10)")
    ap.add_argument("--val_batches", type=int, default=8, help="fixed val batches per evaluation")
    ap.add_argument("--lr_muon", type=float, default=0.02, help="Muon's peak lr (train.py's default)")
    ap.add_argument(
        "--lr_adamw", type=float, default=3e-3, help="AdamW's peak lr for the non-Muon parameters"
    )
    ap.add_argument("--adamw_lrs", default="3e-3", help="comma-separated peak lrs for the AdamW-only run(s)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="out/bench_muon.json")
    args = ap.parse_args()
    if args.quick:
        args.steps = 20
        args.val_batches = 4
    if args.steps < 1 or args.batch_size < 1 or args.block_size < 2 or args.val_batches < 1:
        raise SystemExit("--steps, --batch_size and --val_batches must be >= 1 and --block_size >= 2")
    args.eval_every = args.eval_every or max(1, args.steps // 10)
    try:
        adamw_lrs = [float(s) for s in args.adamw_lrs.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(
            f"--adamw_lrs must be comma-separated numbers like 1e-3,3e-3, got {args.adamw_lrs!r}"
        )
    return args, adamw_lrs


def fixed_batches(args):
    """The same data for every run: the train batches drawn once, in order, and the fixed val batches."""
    ddir = os.path.join(ROOT, "data/stdlib")
    tok = get_tokenizer(4096, cache_dir=os.path.join(ROOT, "data"))
    data.prepare(4096, out_dir=ddir, tokenizer=tok)
    loader = data.DataLoader(ddir)
    gen = torch.Generator().manual_seed(args.seed)
    train_batches = [
        loader.get_batch("train", args.batch_size, args.block_size, generator=gen) for _ in range(args.steps)
    ]
    gen_val = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [
        loader.get_batch("val", args.batch_size, args.block_size, generator=gen_val)
        for _ in range(args.val_batches)
    ]
    return train_batches, val_batches


def print_table(results, budget):
    """Every run against the best AdamW-only run (the reference): the tokens it needs to reach the
    reference's final val loss, and the ratio of the reference's tokens to those. -> the reference."""
    ref = min((r for r in results if r["kind"] == "adamw"), key=lambda r: r["final_val"])
    target = ref["final_val"]
    print(f"reference: {ref['name']} (lr {ref['lr_adamw']:g}) final val {target:.4f} after {budget:,} tokens")
    head = (
        f"{'optimizer':<14} {'lr matrices/rest':>16} {'final val':>10} {'tokens to AdamW final':>22} "
        f"{'AdamW tok / tok':>16} {'ms/step':>8} {'wall s':>7}"
    )
    print(head + "\n" + "-" * len(head))
    for r in results:
        reach = tokens_to_reach(r["val_curve"], target)
        if r is ref:
            reach = budget  # the reference reaches its own final loss at the end of its budget, by definition
        r["tokens_to_adamw_final"] = reach
        r["token_ratio"] = budget / reach if reach else None
        if r["lr_muon"]:
            lrs = f"{r['lr_muon']:g}/{r['lr_adamw']:g}"
        else:
            lrs = f"{r['lr_adamw']:g}/{r['lr_adamw']:g}"
        reach_s = f"{reach:,.0f}" if reach is not None else "not reached"
        ratio_s = f"{r['token_ratio']:.2f}x" if r["token_ratio"] else "-"
        print(
            f"{r['name']:<14} {lrs:>16} {r['final_val']:>10.4f} {reach_s:>22} {ratio_s:>16} "
            f"{r['ms_per_step']:>8.0f} {r['wall_seconds']:>7.0f}"
        )
    split = results[0]["final_val"]
    plain = results[1]["final_val"]
    print(
        f"Muon Split - Muon final val: {split - plain:+.4f} (negative: split is better); "
        f"Muon Split - {ref['name']}: {split - target:+.4f}"
    )
    return ref


def main():
    args, adamw_lrs = parse_args()
    dev = pick_device(args.device)
    try:
        cfg, _ = model.load_config_file(args.config)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e))
    cfg = dataclasses.replace(cfg, dsa_mode="dense")  # the pretraining stage
    if cfg.vocab_size < 4096:
        raise SystemExit(
            f"{args.config} has vocab_size {cfg.vocab_size}; the stdlib data uses the 4096-token tokenizer"
        )
    print(describe_machine(dev))
    train_batches, val_batches = fixed_batches(args)
    torch.manual_seed(args.seed)
    init_state = copy.deepcopy(model.GLM5(cfg).state_dict())  # the same initial weights for every run
    counts = model.param_counts(model.GLM5(cfg))
    budget = args.steps * args.batch_size * args.block_size
    print(
        f"{args.config}: {counts['total (with MTP)']:,} parameters, "
        f"{counts['activated per token (without MTP)']:,} activated per token; "
        f"{args.steps} steps x {args.batch_size} x {args.block_size} = {budget:,} tokens per run; "
        f"val: {args.val_batches} x {args.batch_size} x {args.block_size} tokens "
        f"every {args.eval_every} steps"
    )
    print(
        f"lrs: Muon {args.lr_muon} (block matrices) + AdamW {args.lr_adamw} "
        "(embeddings, lm_head, router, norms); "
        f"AdamW-only {', '.join(map(str, adamw_lrs))}; warmup {min(WARMUP, max(1, args.steps // 10))}, "
        f"flat, linear decay to {MIN_LR_FRAC}x over the last {DECAY_FRAC:.0%}",
        flush=True,
    )

    # ---- the runs: only the optimizer differs (name, kind, lr of the block matrices, lr of the rest)
    runs = [
        ("muon_split", "muon_split", args.lr_muon, args.lr_adamw),
        ("muon", "muon", args.lr_muon, args.lr_adamw),
    ]
    for lr in adamw_lrs:
        runs.append(("adamw" if len(adamw_lrs) == 1 else f"adamw@{lr:g}", "adamw", None, lr))
    results = []
    for name, kind, lr_m, lr_a in runs:
        t0 = time.perf_counter()
        r = run(name, kind, lr_m, lr_a, init_state, cfg, train_batches, val_batches, args, dev)
        r["wall_seconds"] = time.perf_counter() - t0
        results.append(r)

    print(f"\n{describe_machine(dev)}")
    ref = print_table(results, budget)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        record = {
            "machine": describe_machine(dev),
            "config": args.config,
            "args": vars(args),
            "model": dataclasses.asdict(cfg),
            "tokens_per_run": budget,
            "reference": ref["name"],
            "runs": results,
        }
        json.dump(record, f, indent=1)
    print(f"curves -> {args.out}")


if __name__ == "__main__":
    main()
