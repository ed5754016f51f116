"""
Training throughput and MFU of the GLM-5 configs on this machine (MFU as nanoGPT reports it, but against
the device's measured peak). For each config: measure the matmul peak in the training dtype in this same
run, then time `--steps` full training steps (forward + backward of train.py's pretraining objective with
MTP and the balance loss, gradient clipping, Muon + AdamW step, router bias update) after `--warmup`
untimed ones. Printed per config: ms/step, tokens/s, memory and three MFUs (defined at print_table); the
MoE experts run both ways in the same run, per-expert loop vs grouped GEMM (see "One config").

Run it:
    python bench/bench_train.py                             # toy and small on the best device here
    python bench/bench_train.py --configs=configs/toy.py --steps=20 --batch_size=16
    python bench/bench_train.py --device=cuda               # small in bf16 autocast on one GPU
    python bench/bench_train.py --configs=configs/small.py --layers=2 --block_size=512
    python bench/bench_train.py --configs=configs/toy.py --experts=grouped   # one path only (half the memory)
    python bench/bench_train.py --configs=configs/toy.py --experts=grouped --mtp_weight=0   # no MTP passes
    python bench/bench_train.py --configs=configs/toy.py --stages --steps=3   # each pipeline stage's step
    python bench/bench_train.py --copy_probe=out/ckpt.pt,out_sft/ckpt.pt     # can they copy from context?

Honest limits: configs/small.py is 1.37B parameters; training it in fp32 needs about 12-16 bytes per
parameter plus activations. When the estimate exceeds half the memory available now (--mem_frac), the
script keeps the layer shapes and cuts num_hidden_layers (it says so), or skips the config with the reason;
it never allocates first and hopes. The estimate is rough: check it before raising --mem_frac. A shallower
model spends a larger share of its time in the embeddings, lm_head and MTP: its tokens/s and MFU are not
the 12-layer model's. On a shared CPU every timing is noisy; the peak is the best of several matmuls, so
contention during the steps lowers MFU (GPU timings need a quiet GPU too). The table times the dense
pretraining stage only: DSA's sparse path and the indexer KL are not timed there. torch's FLOP counter does
not count grouped GEMMs, so the counted step runs the loop (same FLOPs). --experts=both keeps two models in
memory (the estimate counts both).
"""

import argparse
import dataclasses
import os
import platform
import resource
import sys
import time
from contextlib import nullcontext

import torch
from torch.utils.flop_counter import FlopCounterMode

# run as python bench/bench_train.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import experts
import model
import muon
from train import measure_peak_flops, pick_device, sync  # one definition of device, sync and peak

# -----------------------------------------------------------------------------
# The machine: named in every benchmark's output


def mem_available():
    """Bytes of memory available now: MemAvailable from /proc/meminfo, else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def describe_machine(dev="cpu"):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    gpu = f", GPU {torch.cuda.get_device_name(dev)}" if dev.startswith("cuda") else ", no GPU used"
    return (
        f"machine: {cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads){load}, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
        f"torch {torch.__version__}{gpu}"
    )


# -----------------------------------------------------------------------------
# Memory: estimate before allocating


def estimate_bytes(cfg, B, T, dev):
    """Rough bytes to train: fp32 weights + grads + optimizer state (Muon: one momentum per matrix, AdamW:
    two moments; taken as 12 + 8 * adamw share) plus saved activations per token per layer and per lm_head
    call (counted in floats, 4 bytes on a CPU, about 2.5 under bf16 autocast, x1.5 for temporaries)."""
    with torch.device("meta"):
        m = model.GLM5(cfg)
    c = model.param_counts(m)
    total, adamw = c["total (with MTP)"], c["embeddings + lm_head"]
    states = 12 * total + 8 * adamw
    S = cfg.num_mtp_steps if cfg.num_nextn_predict_layers and args.mtp_weight else 0
    H, D = cfg.num_attention_heads, cfg.hidden_size
    per_layer = (
        6 * D
        + 3 * cfg.q_lora_rank
        + 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        + 4 * H * (cfg.qk_head_dim + cfg.v_head_dim)
        + (cfg.num_experts_per_tok + cfg.n_shared_experts) * (2 * D + 4 * cfg.moe_intermediate_size)
        + 3 * cfg.n_routed_experts
    )
    floats = B * T * ((cfg.num_hidden_layers + S) * per_layer + (1 + S) * 3 * cfg.vocab_size)
    bytes_per = 2.5 if dev.startswith("cuda") else 4
    return states + 1.5 * bytes_per * floats, c


def attention_flops_per_token(cfg, T, layers):
    return 6 * layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * T


# -----------------------------------------------------------------------------
# One config
#
# The MoE experts run both ways in the same run (--experts=both, the default): the per-expert loop
# (experts.experts_loop, the reference) and the grouped GEMM (experts.experts_grouped, the model's path), two
# models with the same weights stepped in alternation, so both see the same machine load; the table's row is
# the grouped path's and the line under it gives both step times and their ratio.


def bench_config(path, args, dev, dtype, peak):
    """One config: fit it in memory, time its training steps, count its FLOPs. -> the row of the table,
    or None when it does not fit (it says why)."""
    try:
        cfg, rest = model.load_config_file(path)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e))
    cfg = dataclasses.replace(cfg, dsa_mode="dense")  # the pretraining stage
    name = os.path.splitext(os.path.basename(path))[0]
    T = args.block_size or int(rest.get("block_size", 256))
    B = args.batch_size or max(1, (8192 if dev.startswith("cuda") else 2048) // T)
    if T > cfg.max_position_embeddings:
        raise SystemExit(
            f"--block_size {T} exceeds {path}'s max_position_embeddings {cfg.max_position_embeddings}"
        )
    full_layers = cfg.num_hidden_layers
    cfg, counts = fit_in_memory(cfg, name, path, B, T, args, dev)
    if cfg is None:
        return None
    dts, mem, counted, seen_attention = time_steps(cfg, B, T, args, dev, dtype)
    dt = dts.get("grouped", dts.get("loop"))  # the row is the model's own path
    n_active = counts["activated per token (without MTP)"]
    tok_s = B * T / dt
    flops_6n = 6 * n_active
    flops_attn = flops_6n + attention_flops_per_token(cfg, T, cfg.num_hidden_layers)
    return {
        "config": name,
        "layers": f"{cfg.num_hidden_layers}/{full_layers}",
        "B": B,
        "T": T,
        "ms_per_step": 1000 * dt,
        "tokens_per_s": tok_s,
        "mem_gib": mem / 2**30,
        "mfu_6n": flops_6n * tok_s / peak,
        "mfu_6n_attn": flops_attn * tok_s / peak,
        "mfu_counted": counted / dt / peak,
        "counted_per_token": counted / (B * T),
        "counted_attention": "counter" if seen_attention else "analytic",
        "experts_ms": {impl: 1000 * t for impl, t in dts.items()},
    }


def fit_in_memory(cfg, name, path, B, T, args, dev):
    """Fewer layers (same shapes) rather than an OOM: --layers if given, else the config's, cut one at a
    time while the estimate exceeds --mem_frac of the memory available now. -> (the config to run, its
    parameter counts), or (None, None) after saying why it was skipped."""
    full_layers = cfg.num_hidden_layers
    if args.layers:
        if not 1 <= args.layers <= full_layers:
            raise SystemExit(f"--layers must be between 1 and {full_layers} for {path}")
        cfg = dataclasses.replace(
            cfg,
            num_hidden_layers=args.layers,
            first_k_dense_replace=min(cfg.first_k_dense_replace, args.layers),
        )
    have = torch.cuda.mem_get_info(dev)[0] if dev.startswith("cuda") else mem_available()
    budget = args.mem_frac * have
    copies = 2 if args.experts == "both" else 1  # both expert paths keep a model each

    def estimate(c):
        need, counts = estimate_bytes(c, B, T, dev)
        return copies * need, counts

    need, counts = estimate(cfg)
    min_layers = min(cfg.num_hidden_layers, cfg.first_k_dense_replace + 1)  # keep one MoE layer
    while need > budget and not args.layers and cfg.num_hidden_layers > min_layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers - 1)
        need, counts = estimate(cfg)
    if need > budget:
        print(
            f"{name}: skipped: {cfg.num_hidden_layers} layers at {B} x {T} need about "
            f"{need / 2**30:.1f} GiB, "
            f"more than {args.mem_frac:.0%} of the {have / 2**30:.1f} GiB available; lower --batch_size, "
            f"--block_size or --layers, or raise --mem_frac if you know better"
        )
        return None, None
    note = ""
    if args.layers and args.layers != full_layers:
        note = f" of {full_layers} (--layers)"
    elif cfg.num_hidden_layers != full_layers:
        note = (
            f" (cut from {full_layers} layers: all {full_layers} would need more than "
            f"{args.mem_frac:.0%} of the {have / 2**30:.1f} GiB available)"
        )
    print(
        f"{name}: {cfg.num_hidden_layers} layers{note}, {B} x {T} tokens per step, "
        f"about {need / 2**30:.1f} GiB estimated, {counts['total (with MTP)'] / 1e6:,.1f}M parameters, "
        f"{counts['activated per token (without MTP)'] / 1e6:,.1f}M activated per token",
        flush=True,
    )
    return cfg, counts


def time_steps(cfg, B, T, args, dev, dtype):
    """Build the model and step it as train.py does, once per expert path (--experts): --warmup untimed
    steps each, then --steps timed ones, the paths taking turns step by step; then one more forward +
    backward under the FLOP counter, not timed (the optimizer's FLOPs are not model FLOPs).
    -> ({path: median seconds per step}, peak memory in bytes, FLOPs counted per step, whether the counter
    saw the attention kernel)."""
    impls = ["loop", "grouped"] if args.experts == "both" else [args.experts]
    autocast = nullcontext()
    if dev.startswith("cuda") and dtype != torch.float32:
        autocast = torch.autocast("cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen)  # throughput does not need real text
    x = x.to(dev)
    runs = {}
    for impl in impls:
        torch.manual_seed(0)  # the same weights for every path
        m = model.GLM5(cfg).to(dev)
        ns_dtype = dtype if dev.startswith("cuda") else torch.float32
        runs[impl] = (m, muon.build_optimizers(m, lr_muon=0.02, lr_adamw=3e-3, ns_dtype=ns_dtype))

    def forward_backward(m):
        with autocast:
            _, losses = m(x[:, :-1], x[:, 1:], mtp_weight=args.mtp_weight, balance_weight=1e-4)
        losses["loss"].backward()

    def step(impl):
        m, opts = runs[impl]
        experts.EXPERTS_IMPL = impl  # the module's switch, read by every MoE layer
        forward_backward(m)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        model.update_router_bias(m, 1e-3)

    for _ in range(args.warmup):
        for impl in impls:
            step(impl)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(dev)
    times = {impl: [] for impl in impls}
    for _ in range(args.steps):
        for impl in impls:  # alternate, so a burst of load from other processes hits both paths
            sync(dev)
            t0 = time.perf_counter()
            step(impl)
            sync(dev)
            times[impl].append(time.perf_counter() - t0)
    dt = {impl: sorted(t)[len(t) // 2] for impl, t in times.items()}  # the median step: robust to a stray one
    if dev.startswith("cuda"):
        mem = torch.cuda.max_memory_allocated(dev)
    else:
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak RSS so far (KiB)

    # the counter does not count grouped GEMMs: count a step of the loop, the same FLOPs
    m, opts = runs[impls[-1]]
    experts.EXPERTS_IMPL = "loop"
    fc = FlopCounterMode(display=False)
    with fc:
        forward_backward(m)
    experts.EXPERTS_IMPL = "grouped"
    for o in opts:
        o.zero_grad(set_to_none=True)
    counted = fc.get_total_flops()
    seen_attention = any("attention" in str(op) for op in fc.get_flop_counts()["Global"])
    S = cfg.num_mtp_steps if cfg.num_nextn_predict_layers and args.mtp_weight else 0
    if not seen_attention:
        counted += B * T * attention_flops_per_token(cfg, T, cfg.num_hidden_layers + S)
    return dt, mem, counted, seen_attention


# -----------------------------------------------------------------------------
# --stages: one step of each pipeline stage's objective, side by side (the speedrun's budget per stage)

# stage label -> (dsa_mode, MTP weight, indexer KL on, loss backpropagated, only the indexers train)
STAGE_STEPS = {
    "pretrain, MTP 0.3": ("dense", 0.3, False, "loss", False),
    "pretrain, MTP off": ("dense", 0.0, False, "loss", False),
    "dsa_warmup, MTP 0.1": ("dense", 0.1, True, "indexer_kl", True),
    "dsa_warmup, MTP off": ("dense", 0.0, True, "indexer_kl", True),
    "dsa_sparse/sft, MTP 0.3": ("sparse", 0.3, True, "loss", False),
    "dsa_sparse/sft, MTP off": ("sparse", 0.0, True, "loss", False),
}


def time_stages(path, args):
    """Time one optimizer step of every entry of STAGE_STEPS on one model of config `path` on the CPU, the
    entries taking turns step by step (so load from other processes hits them alike); the SFT step costs
    what the sparse stage's does (same mode, same shapes; only the loss mask differs). Prints ms/step,
    tokens/s and the ratio to the plain pretraining step."""
    cfg, rest = model.load_config_file(path)
    T = args.block_size or int(rest.get("block_size", 256))
    B = args.batch_size or max(1, 2048 // T)
    torch.manual_seed(0)
    m = model.GLM5(cfg)
    opts = muon.build_optimizers(m, lr_muon=0.02, lr_adamw=3e-3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen)
    times = {k: [] for k in STAGE_STEPS}
    for i in range(args.warmup + args.steps):
        for label, (mode, w_mtp, kl, key, indexers_only) in STAGE_STEPS.items():
            m.config.dsa_mode = mode
            for n, p in m.named_parameters():
                p.requires_grad_(".indexer." in n or not indexers_only)
            t0 = time.perf_counter()
            _, losses = m(x[:, :-1], x[:, 1:], mtp_weight=w_mtp, balance_weight=1e-4, indexer_kl=kl)
            losses[key].backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            model.update_router_bias(m, 0.0 if indexers_only else 1e-3)
            if i >= args.warmup:
                times[label].append(time.perf_counter() - t0)
    print(f"\n{describe_machine('cpu')}\nconfig {path}, B x T = {B} x {T}, median of {args.steps} steps")
    base = sorted(times["pretrain, MTP off"])[args.steps // 2]
    for label, t in times.items():
        dt = sorted(t)[args.steps // 2]
        print(f"{label:<26} {1000 * dt:>8.0f} ms/step {B * T / dt:>8,.0f} tok/s {dt / base:>6.2f}x")


# -----------------------------------------------------------------------------
# --copy_probe: can a checkpoint copy from its context?


def probe_checkpoints(paths, args):
    """copy_probe.copy_probe on each train.py checkpoint in `paths`, with ids drawn from the whole vocabulary
    (but the special tokens) and from the --probe_top most frequent ids of the pretraining corpus (names,
    digits and keywords: what an RL task asks a policy to copy). Prints first/second-copy losses and
    the top-1 accuracy on the second copy per checkpoint."""
    import numpy as np

    import data
    from copy_probe import copy_probe
    from tokenizer import get_tokenizer
    from train import load_checkpoint

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tok = get_tokenizer(4096, cache_dir=os.path.join(root, "data"))
    loader = data.DataLoader(os.path.join(root, "data/stdlib"))
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    for shard in loader.shards["train"]:
        counts += np.bincount(np.asarray(shard), minlength=tok.vocab_size)[: tok.vocab_size]
    counts[tok.eot_id :] = 0  # no special tokens
    frequent = torch.from_numpy(np.argsort(-counts)[: args.probe_top].copy())
    print(f"copy probe: 16 rows of 2 x {args.probe_len} ids; loss on the first copy / on the second, top-1")
    for path in paths:
        ck = load_checkpoint(path, "--copy_probe")
        m = model.GLM5(model.ModelConfig(**ck["config"]["model"]))
        m.load_state_dict(ck["model"])
        where = f"{path} (step {ck['step']}, {ck['config']['train']['stage']})"
        cells = []
        for name, ids in ((f"all {tok.eot_id} ids", tok.eot_id), (f"top {args.probe_top} ids", frequent)):
            r = copy_probe(m, ids, args.probe_len)
            cells.append(f"{name}: {r['first']:.2f} / {r['second']:.2f}, {100 * r['acc_second']:.0f}%")
        print(f"{where}\n    " + " | ".join(cells))


# -----------------------------------------------------------------------------
# Main


# Printed per config: ms/step, tokens/s, memory, and three MFUs, each (FLOPs per step / step time) / peak:
#     MFU 6N        6 x activated parameters per token (without MTP), as train.py's log line counts it
#     MFU 6N+attn   plus attention's T^2 term, 6 x layers x heads x (qk_head_dim + v_head_dim) x T per token
#                   (dense causal attention of the pretraining stage, counted over the full T x T square as
#                   PaLM's appendix does, not halved for the causal mask)
#     MFU counted   the FLOPs torch.utils.flop_counter counts in one real step (every matmul, the MTP block's
#                   three passes and their lm_head calls included, experts as actually routed), plus the
#                   analytic attention term for the main and MTP layers when the counter cannot see the
#                   attention kernel (CPU SDPA)
def print_table(results, args, dev, peak, dname):
    """The table, with the machine named again under it (one row per config that fit)."""
    print(
        f"\n{describe_machine(dev)}\npeak {peak / 1e12:.3f} TFLOP/s {dname}; "
        f"dense pretraining step with MTP weight {args.mtp_weight}, Muon + AdamW; "
        f"median of {args.steps} steps after {args.warmup} warmup"
    )
    head = (
        f"{'config':<8} {'layers':>6} {'B x T':>10} {'ms/step':>9} {'tokens/s':>10} {'MFU 6N':>7} "
        f"{'MFU 6N+attn':>11} {'MFU counted':>11} {'FLOP/token':>11} {'mem GiB':>8}"
    )
    print(head + "\n" + "-" * len(head))
    for r in results:
        bt = f"{r['B']} x {r['T']}"
        print(
            f"{r['config']:<8} {r['layers']:>6} {bt:>10} {r['ms_per_step']:>9.0f} "
            f"{r['tokens_per_s']:>10,.0f} {100 * r['mfu_6n']:>6.2f}% {100 * r['mfu_6n_attn']:>10.2f}% "
            f"{100 * r['mfu_counted']:>10.2f}% {r['counted_per_token'] / 1e6:>10.1f}M {r['mem_gib']:>8.2f}"
        )
    for r in results:
        ms = r["experts_ms"]
        if len(ms) == 2:
            print(
                f"{r['config']}: MoE experts as a per-expert loop {ms['loop']:.0f} ms/step, as grouped GEMMs "
                f"{ms['grouped']:.0f} ms/step: grouped is {ms['loop'] / ms['grouped']:.2f}x the loop's speed "
                "(same weights, steps alternated)"
            )
    if any(r["counted_attention"] == "analytic" for r in results):
        print(
            "MFU counted: attention added analytically "
            "(the FLOP counter does not see this device's SDPA kernel)"
        )
    if not dev.startswith("cuda"):
        print("mem GiB on a CPU: the process's peak RSS so far (cumulative across configs), not per config")


def main():
    ap = argparse.ArgumentParser(description="training tokens/s and MFU of GLM-5 configs on this machine")
    ap.add_argument(
        "--configs", default="configs/toy.py,configs/small.py", help="comma-separated config files"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per config (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument(
        "--batch_size", type=int, default=0, help="0: 2048 tokens per step on a CPU, 8192 on a GPU"
    )
    ap.add_argument("--block_size", type=int, default=0, help="0: the config's block_size")
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="num_hidden_layers to run (0: the config's, cut if it does not fit)",
    )
    ap.add_argument(
        "--mtp_weight",
        type=float,
        default=0.3,
        help="MTP loss weight of the timed step; 0 skips the MTP block's passes (train.py's early phase)",
    )
    ap.add_argument(
        "--stages",
        action="store_true",
        help="time each pipeline stage's step side by side (CPU, first config only), not the table",
    )
    ap.add_argument("--copy_probe", default="", help="comma-separated ckpt.pt files: their copy probe only")
    ap.add_argument("--probe_len", type=int, default=64, help="--copy_probe: ids in each copy")
    ap.add_argument("--probe_top", type=int, default=512, help="--copy_probe: the frequent-id pool's size")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument(
        "--experts",
        default="both",
        choices=["both", "grouped", "loop"],
        help="MoE expert path(s) to time: both side by side (default), or one",
    )
    ap.add_argument(
        "--mem_frac", type=float, default=0.5, help="use at most this fraction of the memory available now"
    )
    args = ap.parse_args()
    if (
        args.steps < 1
        or args.warmup < 0
        or args.batch_size < 0
        or args.block_size < 0
        or args.block_size == 1
    ):
        raise SystemExit(
            "--steps must be >= 1, --warmup, --batch_size and --block_size >= 0 (block_size 0 or >= 2)"
        )
    if not 0 < args.mem_frac <= 0.9:
        raise SystemExit("--mem_frac must be in (0, 0.9]; leave the rest to the system and other processes")
    if args.copy_probe:
        probe_checkpoints(args.copy_probe.split(","), args)
        return
    if args.stages:
        time_stages(args.configs.split(",")[0], args)
        return
    dev = pick_device(args.device)
    dtype = torch.bfloat16 if dev.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    print(describe_machine(dev))
    n = 8192 if dev.startswith("cuda") else 2048
    peak = measure_peak_flops(dev, dtype, n, reps=10)
    dname = str(dtype).replace("torch.", "")
    print(
        f"matmul peak: {peak / 1e12:.3f} TFLOP/s ({dname}, {n} x {n} x {n}, best of 10, measured now)",
        flush=True,
    )

    results = []
    for path in args.configs.split(","):
        if path.strip():
            r = bench_config(path.strip(), args, dev, dtype, peak)
            if r:
                results.append(r)
    print_table(results, args, dev, peak, dname)


if __name__ == "__main__":
    main()
