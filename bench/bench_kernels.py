"""
kernels.py's Triton kernels against their torch references (dsa.py's torch paths, kernels.py's *_ref)
at GLM-5 shapes (GLM-5 report, section 2 and its W4A8 deployment; DeepSeek-V3.2 report):
64 heads over 576-d latents (512 + 64) with top-k 2048, a 32 x 128 lightning indexer, experts of
6144 -> 2048 -> 6144 with 8 of them per token, and W4A8 expert matmuls; contexts 8K to 128K. The `quant`
rows time kernels_quant.py against the bf16 matmuls they replace (see its section). Printed per row,
measured side by side in this run: the reference's time, the kernel's, their ratio, TFLOP/s and GB/s
against this device's measured peaks, and the error (defined at row() below).

Run it:
    python bench/bench_kernels.py                            # on a CUDA GPU: everything
    python bench/bench_kernels.py --only=mla,quant --contexts=8192  # a subset
    python bench/bench_kernels.py --interpret  # tiny shapes under Triton's CPU interpreter: every path runs
                                             # and agrees; times nothing
    python bench/bench_kernels.py --cpu      # no GPU needed: kernels_quant's torch integer path vs an
                                             # fp32 matmul of the dequantized weight, on this CPU
Without a GPU (and without --interpret or --cpu) it says so and exits 0.

Honest limits: one run, mean times from triton.testing.do_bench (L2 flushed between runs); random top-k
positions and uniform random routing, not a trained model's. The sparse MLA training rows compare forward +
backward (Triton's backward kernel vs the reference's autograd) in time and in peak memory above the inputs.
"""

import argparse
import os
import platform
import sys
import time

import torch

ap = argparse.ArgumentParser(description="kernels.py vs its torch references at GLM-5 shapes")
ap.add_argument(
    "--only", default="indexer,mla,moe,quant", help="comma list of: indexer, mla, moe, quant"
)
ap.add_argument(
    "--contexts", default="8192,32768,131072", help="context lengths for the indexer and sparse MLA"
)
ap.add_argument(
    "--experts",
    type=int,
    default=64,
    help="routed experts in the MoE rows (GLM-5 has 256; 64 keeps memory modest)",
)
ap.add_argument(
    "--interpret", action="store_true", help="tiny shapes through Triton's CPU interpreter (a smoke test)"
)
ap.add_argument(
    "--cpu",
    action="store_true",
    help="time kernels_quant's torch references on this CPU (integer path vs fp32 dequantized matmul)",
)
args = ap.parse_args()
parts = [p for p in args.only.split(",") if p]
unknown = set(parts) - {"indexer", "mla", "moe", "quant"}
if unknown:
    sys.exit(f"--only: unknown part(s) {sorted(unknown)}; choose from indexer, mla, moe, quant")
contexts = [int(c) for c in args.contexts.split(",") if c]

if args.interpret:
    os.environ["NANOGLM_KERNELS"] = "triton"  # kernels.py then defines its kernels under the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
elif not torch.cuda.is_available() and not args.cpu:
    print(
        "bench_kernels.py needs a CUDA GPU to time the Triton kernels (this machine has none); "
        "run with --interpret for a tiny-shape smoke test on the CPU, or with --cpu to time kernels_quant's "
        "integer references against fp32 on this CPU"
    )
    sys.exit(0)

# run as python bench/bench_kernels.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsa  # noqa: E402
import kernels  # noqa: E402
import kernels_moe  # noqa: E402
import kernels_quant  # noqa: E402

DEV = "cpu" if args.interpret or args.cpu else "cuda"
DT = torch.float32 if DEV == "cpu" else torch.bfloat16  # the interpreter mishandles bf16 dot products

# -----------------------------------------------------------------------------
# The machine, its peaks, and one timed row
#
# Printed per row, measured side by side in this run: the reference's time, the kernel's time, the ratio
# (reference / kernel), and what the kernel achieves: TFLOP/s against this device's bf16 matmul peak and GB/s
# against its copy bandwidth, both measured at the start (8192^3 matmul; a 1 GiB device copy), and err = max
# |kernel - reference| / max |reference| (for the bf16 baseline row: W4A8's quantization error). FLOPs count
# the useful work (the indexer counts every visible key, sparse MLA 2 (2C + R) per head and selected key);
# bytes count the data a perfect kernel must move once (caches and weights read, outputs written). The
# anchors: FlashMLA's sparse decode reaches about 410 TFLOP/s on an H800; Marlin-style INT4 matmuls come close
# to 4x over bf16 at small batch.


def describe_machine():
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else "no GPU (Triton interpreter)"
    if args.cpu:
        gpu = f"CPU only, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}"
    return (
        f"machine: {platform.node()}, {gpu}, torch {torch.__version__}, triton {kernels.triton.__version__}"
    )


def time_ms(fn):
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def peaks():
    if DEV == "cpu":
        return None, None
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    flops = 2 * 8192**3 / (time_ms(lambda: a @ a) * 1e-3)
    src = torch.empty(2**30, device=DEV, dtype=torch.uint8)
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() / (time_ms(lambda: dst.copy_(src)) * 1e-3)  # read + write
    del a, src, dst
    return flops, gbs


def rel_err(got, ref):
    """max |got - ref| / max |ref| over the finite entries; inf if they disagree on which are finite."""
    got, ref = [(o[0] if isinstance(o, (tuple, list)) else o).float() for o in (got, ref)]
    fin = ref.isfinite()
    if not torch.equal(fin, got.isfinite()):
        return float("inf")
    return ((got - ref)[fin].abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item() if fin.any() else 0.0


def row(name, shape, ref_fn, fast_fn, flops, nbytes, check=True):
    """Time the reference and the kernel; print both, the ratio and the kernel's achieved rates."""
    try:
        err = f"{rel_err(fast_fn(), ref_fn()):.1e}" if check else "-"
        t_ref, t_fast = time_ms(ref_fn), time_ms(fast_fn)
    except torch.cuda.OutOfMemoryError:
        print(f"{name:24s} {shape:44s} skipped: out of GPU memory")
        torch.cuda.empty_cache()
        return
    rates = ""
    if PEAK_FLOPS:
        tf, gb = flops / (t_fast * 1e-3), nbytes / (t_fast * 1e-3)
        rates = (
            f" {tf / 1e12:7.1f} TFLOP/s ({100 * tf / PEAK_FLOPS:4.1f}%) {gb / 1e9:7.0f} GB/s "
            f"({100 * gb / PEAK_GBS:4.1f}%)"
        )
    print(
        f"{name:24s} {shape:44s} ref {t_ref:9.3f} ms  triton {t_fast:9.3f} ms  "
        f"x{t_ref / t_fast:6.2f}{rates}  "
        f"err {err}",
        flush=True,
    )
    if DEV == "cuda":
        torch.cuda.empty_cache()


def randn(*shape, dtype=None, scale=1.0):
    return torch.randn(*shape, device=DEV, dtype=dtype or DT) * scale


# -----------------------------------------------------------------------------
# The four kernels


def bench_indexer(Hi, Di, topk, S_list, cases):
    for S in S_list:
        for (
            B,
            T,
        ) in cases:  # decode (T = 1 per sequence) and a block of prefill queries at the end of the context
            q, w, k = (
                randn(B, T, Hi, Di, dtype=torch.float32),
                randn(B, T, Hi, dtype=torch.float32),
                randn(B, S, Di),
            )
            last = (torch.arange(S - T, S, device=DEV)).expand(B, T).contiguous()
            scale = Di**-0.5
            flops = 2 * B * T * S * Hi * Di
            nbytes = B * S * Di * k.element_size() + q.numel() * 4 + B * T * S * 4
            shape = f"B={B} T={T} S={S} {Hi}x{Di}"
            row(
                "indexer scores",
                shape,
                lambda: dsa.causal_index_scores(q, w, k, last, scale),
                lambda: kernels.index_scores(q, w, k, last, scale),
                flops,
                nbytes,
            )
            visible = torch.arange(S, device=DEV) <= last[..., None]
            n = min(topk, S)
            row(
                "indexer + top-k",
                shape + f" k={topk}",
                lambda: dsa.topk_select(dsa.causal_index_scores(q, w, k, last, scale), visible, n)[0],
                lambda: dsa.topk_select(kernels.index_scores(q, w, k, last, scale), visible, n)[0],
                flops,
                nbytes,
                check=False,
            )
            del q, w, k


def bench_sparse_mla(H, C, R, topk, S_list, cases, train_T):
    scale = (192 + 64) ** -0.5
    for S in S_list:
        for B, T in cases:
            q_abs, q_pe, latent = randn(B, T, H, C), randn(B, T, H, R), randn(B, S, C + R)
            idx = torch.randint(0, S, (B, T, topk), device=DEV)  # random positions: the gather's worst case
            valid = torch.ones(B, T, topk, dtype=torch.bool, device=DEV)
            flops = B * T * H * topk * 2 * (2 * C + R)
            nbytes = B * T * topk * (C + R) * latent.element_size() + 2 * q_abs.numel() * q_abs.element_size()
            row(
                "sparse MLA fwd",
                f"B={B} T={T} S={S} H={H} k={topk}",
                lambda: dsa.sparse_mla_torch(q_abs, q_pe, latent, idx, valid, scale),
                lambda: kernels.sparse_mla(q_abs, q_pe, latent, idx, valid, scale),
                flops,
                nbytes,
            )
            del q_abs, q_pe, latent, idx, valid
    # training: forward + backward, each side's own autograd (the kernel path: sparse_mla_bwd_kernel)
    B, T, S = 1, train_T, S_list[0]
    leaves = [randn(*s).requires_grad_() for s in ((B, T, H, C), (B, T, H, R), (B, S, C + R))]
    idx = torch.sort(torch.randint(0, S, (B, T, topk), device=DEV), dim=-1).values
    valid = torch.ones(B, T, topk, dtype=torch.bool, device=DEV)
    g = randn(B, T, H, C)

    def fwd_bwd(fn):
        o, _ = fn(*leaves, idx, valid, scale)
        # err covers every gradient
        return torch.cat([d.flatten() for d in torch.autograd.grad(o, leaves, g)])

    flops = 3.5 * B * T * H * topk * 2 * (2 * C + R)  # forward 1x, backward 2.5x (the scores are recomputed)
    shape = f"B={B} T={T} S={S} H={H} k={topk}"
    row(
        "sparse MLA fwd+bwd",
        shape,
        lambda: fwd_bwd(dsa.sparse_mla_torch),
        lambda: fwd_bwd(kernels.sparse_mla),
        flops,
        3 * B * T * topk * (C + R) * leaves[2].element_size(),
    )
    with torch.no_grad():  # the sparse stage's KL target, from the forward's lse
        q_abs, q_pe, latent = leaves
        _, lse = kernels.sparse_mla(q_abs, q_pe, latent, idx, valid, scale)
        row(
            "sparse MLA KL target",
            shape,
            lambda: dsa.sparse_mla_target_torch(q_abs, q_pe, latent, idx, valid, lse, scale),
            lambda: kernels.sparse_mla_target(q_abs, q_pe, latent, idx, valid, lse, scale),
            B * T * H * topk * 2 * (C + R),
            B * T * topk * ((C + R) * latent.element_size() + 4),
        )
    if (
        DEV == "cuda"
    ):  # the memory side of the claim: the reference keeps the (B, T, K, C + R) gather for backward
        mib = {}
        for name, fn in (("ref", dsa.sparse_mla_torch), ("triton", kernels.sparse_mla)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd(fn)
            torch.cuda.synchronize()
            mib[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(
            f"{'sparse MLA fwd+bwd mem':24s} {shape:44s} ref {mib['ref']:9.1f} MiB  triton "
            f"{mib['triton']:9.1f} MiB  "
            f"x{mib['ref'] / mib['triton']:6.2f} less peak memory above the inputs",
            flush=True,
        )


def bench_moe(E, D, F_, k, token_counts):
    w_gate, w_up, w_down = (
        randn(E, F_, D, scale=0.02),
        randn(E, F_, D, scale=0.02),
        randn(E, D, F_, scale=0.02),
    )
    for N in token_counts:
        x = randn(N, D)
        ids = torch.rand(N, E, device=DEV).topk(k, dim=-1).indices  # uniform routing
        w = torch.rand(N, k, device=DEV)
        used = ids.unique().numel()
        flops = 2 * N * k * D * F_ * 3
        nbytes = used * 3 * D * F_ * w_gate.element_size() + 2 * N * D * x.element_size()

        def run(mode):
            saved, kernels.MODE = kernels.MODE, mode
            try:
                return kernels_moe.moe_experts(x, ids, w, w_gate, w_up, w_down)
            finally:
                kernels.MODE = saved

        row(
            "MoE experts (grouped)",
            f"N={N} E={E} top-{k} {D}->{F_}->{D}",
            lambda: run("torch"),
            lambda: run("triton"),
            flops,
            nbytes,
        )


# -----------------------------------------------------------------------------
# kernels_quant: W8A8 and W4A8 in the compressed-tensors layout, against the bf16 matmuls they replace
#
# The compressed-tensors W8A8 / W4A8 layers quantize.py writes, timed against the bf16 matmuls they replace:
# W8A8 at the attention's q_b_proj and o_proj, W4A8 at one expert's gate/up and down (per channel and in
# groups of 128), and the grouped W4A8 experts against torch's bf16 grouped GEMM.


def quantize_weight(w, bits, group_size=None):
    """Round-to-nearest symmetric weights (what quantize.py writes): w (N, K) -> w_q int8, scale (N, G)."""
    N, K = w.shape
    g = group_size or K
    qmax = 2 ** (bits - 1) - 1
    groups = torch.nn.functional.pad(w.float(), (0, kernels.cdiv(K, g) * g - K)).view(N, -1, g)
    scale = groups.abs().amax(-1).clamp_min(1e-12) / qmax  # (N, G)
    w_q = torch.round(groups / scale[..., None]).clamp(-qmax - 1, qmax).view(N, -1)[:, :K]
    return w_q.to(torch.int8), scale.to(w.dtype)


def bench_quant(w8_shapes, w4_shapes, Ms, E, k, token_counts):
    kq = kernels_quant
    for N, K in w8_shapes:
        w = randn(N, K, scale=0.02)
        w_q, w_s = quantize_weight(w, 8)
        for M in Ms:
            x = randn(M, K)
            row(
                "W8A8 vs bf16 matmul",
                f"M={M} N={N} K={K} per-channel",
                lambda: x @ w.T,
                lambda: kq.w8a8_linear(x, w_q, w_s),
                2 * M * N * K,
                N * K + M * K * x.element_size() + M * N * x.element_size(),
            )
    for N, K in w4_shapes:
        w = randn(N, K, scale=0.02)
        for g in (None, 128):
            w_q, w_s = quantize_weight(w, 4, g)
            packed = kq.pack_int4(w_q)
            name = f"g{g}" if g else "per-channel"
            for M in Ms:
                x = randn(M, K)
                row(
                    "W4A8 vs bf16 matmul",
                    f"M={M} N={N} K={K} {name}",
                    lambda: x @ w.T,
                    lambda: kq.w4a8_linear(x, packed, w_s, K),
                    2 * M * N * K,
                    N * K // 2 + w_s.numel() * 2 + M * K * x.element_size() + M * N * x.element_size(),
                )
            row(  # correctness on the device: the kernel against the integer reference
                "W4A8 vs torch int ref",
                f"M={Ms[0]} N={N} K={K} {name}",
                lambda: kq.w4a8_linear_ref(x[: Ms[0]], packed, w_s, K),
                lambda: kq.w4a8_linear(x[: Ms[0]], packed, w_s, K),
                2 * Ms[0] * N * K,
                N * K // 2,
            )
    # the routed experts' gate/up projection: E experts of (N, K), tokens routed uniformly to k of them
    N, K = w4_shapes[0]
    w = randn(E, N, K, scale=0.02)
    packed, w_s = zip(*[(kq.pack_int4(q), s) for q, s in (quantize_weight(w[e], 4) for e in range(E))])
    packed, w_s = torch.stack(packed), torch.stack(w_s)  # (E, N, K / 8), (E, N, 1)
    for T in token_counts:
        ids = torch.rand(T, E, device=DEV).topk(k, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=E)
        x = randn(T * k, K)
        offs = counts.cumsum(0).to(torch.int32)
        used = int((counts > 0).sum())
        row(
            "W4A8 experts vs bf16",
            f"T={T} E={E} top-{k} {K}->{N}",
            lambda: torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=offs),
            lambda: kq.w4a8_experts(x, counts, packed, w_s, K),
            2 * T * k * N * K,
            used * N * K // 2 + 2 * x.numel() * x.element_size(),
            check=hasattr(torch.nn.functional, "grouped_mm"),
        )


def bench_quant_cpu(w8_shapes, w4_shapes, Ms, reps=5):
    """The torch references on this CPU: the integer path (torch._int_mm per group, INT4 unpacked each call)
    against an fp32 matmul of the dequantized weight (what a CPU does without integer kernels). Median of
    reps; weight GB/s counts the bytes each stores (int8, packed int4 + scales, fp32)."""
    kq = kernels_quant

    def median_ms(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[reps // 2]

    def cpu_row(name, shape, w_fp32, fast_fn, w_bytes):
        x = randn(M, w_fp32.shape[1])
        t_ref, t_int = median_ms(lambda: x @ w_fp32.T), median_ms(lambda: fast_fn(x))
        err = rel_err(fast_fn(x), x.double() @ w_fp32.double().T)
        print(
            f"{name:24s} {shape:34s} fp32 {t_ref:8.2f} ms  int {t_int:8.2f} ms  x{t_ref / t_int:5.2f}  "
            f"weight GB/s fp32 {w_fp32.numel() * 4 / t_ref / 1e6:6.2f} int {w_bytes / t_int / 1e6:6.2f}  "
            f"err vs dequantized {err:.1e}",
            flush=True,
        )

    for N, K in w8_shapes:
        w_q, w_s = quantize_weight(randn(N, K, scale=0.02), 8)
        w_fp32 = (w_q.double() * w_s.double()).float()
        for M in Ms:
            cpu_row(
                "W8A8 int ref vs fp32",
                f"M={M} N={N} K={K}",
                w_fp32,
                lambda x: kq.w8a8_linear_ref(x, w_q, w_s),
                N * K,
            )
    for N, K in w4_shapes:
        for g in (None, 128):
            w_q, w_s = quantize_weight(randn(N, K, scale=0.02), 4, g)
            packed = kq.pack_int4(w_q)
            w_fp32 = kq.dequantize(w_q, w_s, g or K).float()
            name = f"g{g}" if g else "per-channel"
            for M in Ms:
                cpu_row(
                    "W4A8 int ref vs fp32",
                    f"M={M} N={N} K={K} {name}",
                    w_fp32,
                    lambda x: kq.w4a8_linear_ref(x, packed, w_s, K),
                    N * K // 2 + w_s.numel() * 4,
                )


# -----------------------------------------------------------------------------

torch.manual_seed(0)
print(describe_machine())
PEAK_FLOPS, PEAK_GBS = peaks()
if PEAK_FLOPS:
    print(
        f"measured peaks: bf16 matmul {PEAK_FLOPS / 1e12:.0f} TFLOP/s, device copy {PEAK_GBS / 1e9:.0f} GB/s"
    )
elif args.cpu:
    print(
        "CPU: kernels_quant's torch references only (the Triton rows need a GPU: run without --cpu there); "
        "err = max |int - x @ W_deq| / max |x @ W_deq| (in fp64: the activations' INT8 error)"
    )
else:
    print(
        "interpreter smoke test: tiny shapes, times are the interpreter's, not a GPU's; err = max |kernel "
        "- ref| / max |ref|"
    )
if args.cpu:  # GLM-5's q_b_proj (W8A8) and one routed expert's gate/up and down (W4A8)
    bench_quant_cpu([(16384, 2048)], [(4096, 6144), (6144, 2048)], [1, 16, 128])
elif args.interpret:  # tiny versions of every row
    if "indexer" in parts:
        bench_indexer(2, 32, 8, [40], [(2, 1), (1, 4)])
    if "mla" in parts:
        bench_sparse_mla(4, 32, 16, 8, [40], [(2, 1), (1, 3)], train_T=2)
    if "moe" in parts:
        bench_moe(4, 32, 32, 2, [5])
    if "quant" in parts:
        bench_quant([(40, 72)], [(40, 256)], [3], 4, 2, [5])
else:  # GLM-5: 64 heads, C = 512, R = 64, top-k 2048; indexer 32 x 128; experts 6144 -> 2048
    if "indexer" in parts:
        bench_indexer(32, 128, 2048, contexts, [(32, 1), (1, 128)])
    if "mla" in parts:
        bench_sparse_mla(64, 512, 64, 2048, contexts, [(64, 1), (1, 1024)], train_T=256)
    if "moe" in parts:
        bench_moe(args.experts, 6144, 2048, 8, [256, 4096])
    if "quant" in parts:  # W8A8: q_b_proj, o_proj; W4A8: an expert's gate/up (both halves) and down
        bench_quant(
            [(16384, 2048), (6144, 16384)],
            [(4096, 6144), (6144, 2048)],
            [1, 16, 128, 1024],
            args.experts,
            8,
            [256, 4096],
        )
print("done")
