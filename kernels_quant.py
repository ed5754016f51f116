"""
W4A8 and W8A8 matmuls for serving a quantized GLM-5 (the GLM-5 report's deployment section: INT4 MoE experts
with INT8 activations, INT8 attention and dense MLPs), in the checkpoint format vLLM, SGLang and transformers
read, compressed-tensors. Each Triton kernel sits beside the torch reference it must equal (the formats, the
math and what runs where are described at their sections below):

    pack_int4 / unpack_int4   signed INT4 in [-8, 7] <-> int32 words, compressed-tensors' `pack-quantized`
    quantize_activations      dynamic per-token symmetric INT8, vLLM's rule
    w8a8_linear / w4a8_linear x (..., K) float and an INT8 or packed INT4 weight with its scales -> (..., N)
    w4a8_experts              the routed experts' W4A8 matmul over tokens sorted by expert, one launch

    python -m pytest -q tests/test_kernels_quant.py   # the references (the interpreter run is marked slow)
    TRITON_INTERPRET=1 NANOGLM_KERNELS=triton python -m pytest -q tests/test_kernels_quant.py  # kernels too
    python bench/bench_kernels.py --only=quant        # GLM-5 shapes on a GPU (--interpret: a smoke test)
    python bench/bench_kernels.py --cpu               # the integer reference vs an fp32 matmul, this CPU

Honest limits: run natively once, on an H100, where every test passed (bf16 included) after two fixes and
these kernels saved memory, not time: slower than a bf16 matmul of the same shape (docs/design-notes.md).
Tile sizes are fixed and untuned (no autotuning, no Hopper-specific TMA or warp specialisation, no split-K
for decode, no Marlin-style weight reordering): expect them well short of vLLM's CUTLASS W8A8 or
Machete/Marlin kernels. The INT4 nibbles are unpacked in registers tile by tile; the activations are
quantized in a separate launch (not fused into the norm or the previous matmul's epilogue). The torch
reference unpacks the INT4 weight on every call and loops over groups: on a CPU it is slower than an fp32
matmul of a dequantized weight kept in memory (a CPU server could keep the unpacked int8 weight). The Triton
W4A8 path takes group sizes that are multiples of 32, the reference any; the grouped experts kernel trusts
that counts sums to T (the reference checks). Activation scales are per token and dynamic only: no static
scales, no zero points (asymmetric schemes), no FP8.
"""

import sys

import torch
import torch.nn.functional as F

from kernels import cdiv, tl, triton, use_triton
from kernels_moe import expert_tiles

# -----------------------------------------------------------------------------
# 1. The INT4 storage format (compressed-tensors `pack-quantized`, num_bits 4): q (N, K) in [-8, 7] ->
#    int32 words (N, ceil(K / 8)); word j of row n holds q[n, 8j + i] + 8 in bits 4i .. 4i + 3.
#
# Each value is stored as value + 8, eight per word along the input dimension K, the first value in the lowest
# 4 bits, K zero-padded to a multiple of 8: pack_to_int32 / unpack_from_int32 in
# src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py
# (https://github.com/vllm-project/compressed-tensors).

PACK = 8  # INT4 values per int32 word


def pack_int4(q):
    """q (N, K) integers in [-8, 7] -> int32 (N, ceil(K / 8)). A value 7 in the top nibble sets the sign bit:
    the words are stored as int32 all the same (their bits are what count)."""
    if q.dtype.is_floating_point or q.dtype == torch.bool or q.dim() != 2:
        raise ValueError(
            f"pack_int4 takes a 2-D integer tensor (N, K) of INT4 values; got {q.dtype} of shape "
            f"{tuple(q.shape)} (quantize the weight first)"
        )
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"pack_int4: values must lie in [-8, 7]; got [{q.min().item()}, {q.max().item()}]")
    N, K = q.shape
    u = F.pad(q.to(torch.int64) + 8, (0, cdiv(K, PACK) * PACK - K))  # (N, K8) in 0..15; padding stores 0
    shifts = torch.arange(PACK, device=q.device) * 4
    words = (u.view(N, -1, PACK) << shifts).sum(-1)  # (N, K8 / 8) in [0, 2^32): the word's bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, as int32


def unpack_int4(packed, K):
    """int32 (N, ceil(K / 8)) -> int8 (N, K) in [-8, 7]; the padding past K is dropped."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != cdiv(K, PACK):
        raise ValueError(
            f"unpack_int4 wants int32 words of shape (N, ceil(K / 8)) = (N, {cdiv(K, PACK)}) for K={K}; got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    if sys.byteorder == "little":  # byte i of a row holds values 2i (low nibble) and 2i + 1: 4x less traffic
        b = packed.contiguous().view(torch.uint8)  # (N, K8 / 2)
        nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(1)  # (N, K8) in 0..15
        return nibbles[:, :K].to(torch.int8) - 8
    shifts = torch.arange(PACK, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed[..., None] >> shifts) & 0xF  # (N, K8 / 8, 8): arithmetic shift, then the low 4 bits
    return (nibbles.flatten(1)[:, :K] - 8).to(torch.int8)


def dequantize(w_q, w_scale, group_size):
    """w_q (N, K) integers, w_scale (N, ceil(K / g)) -> the float64 weight (N, K) they stand for."""
    K = w_q.shape[1]
    scale = w_scale.double().repeat_interleave(group_size, dim=1)[:, :K]  # each group's scale, per input
    return w_q.double() * scale


# -----------------------------------------------------------------------------
# 2. Activations: dynamic per-token symmetric INT8, one fp32 scale per token (vLLM's rule)
#
# vLLM's rule, dynamic_scaled_int8_quant in https://github.com/vllm-project/vllm,
# csrc/quantization/w8a8/int8/scaled_quant.cu: scale = absmax / 127, x_q = round-half-even(x * (127 /
# absmax)), 0 for an all-zero token (its scale is 0 too). The one native H100 run found two fixes here: the
# reference's division (below) and the Triton quantizer's FMA contraction (quantize_activations_triton).


def quantize_activations_ref(x):
    """x (..., K) float -> x_q (..., K) int8 in [-127, 127], x_scale (..., 1) fp32 = absmax / 127."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)  # (..., 1)
    # 127 / absmax, correctly rounded as CUDA's division is (torch's `127 / t` is t.reciprocal() * 127, which
    # differs in the last bit a quarter of the time and moves values that sit near a half across it)
    inv = torch.full_like(amax, 127.0) / amax
    inv = torch.where(amax > 0, inv, torch.zeros_like(amax))  # an all-zero token: q = 0, scale 0
    x_q = torch.round(x * inv).clamp(-127, 127).to(torch.int8)  # torch.round: half to even, as cvt.rni
    # absmax / 127 correctly rounded too: a CUDA tensor divided by a Python number is multiplied by its
    # reciprocal, a last-bit difference from the kernel's IEEE division (seen on an H100)
    return x_q, amax / torch.full_like(amax, 127.0)


# -----------------------------------------------------------------------------
# 3. The integer references: int8 x int8 -> int32 per group of inputs, then the scales in fp32
#
# The math, for a token m and an output channel n, with one weight scale per group G of inputs:
#     y[m, n] = x_scale[m] * sum_G w_scale[n, G] * sum_{k in G} x_q[m, k] * w_q[n, k]
# the inner sums are integers, exact in int32 (|x_q w_q| <= 127 * 8 for INT4, 127 * 128 for INT8, so K up
# to ~130K inputs for W8A8); the scales are applied in fp32 in that order, and the result cast to x's dtype.
# The reference does the integer math for real: int8 x int8 -> int32 with torch._int_mm on a CPU (an exact
# float64 matmul on other devices, whose _int_mm wants M > 16 and K, N multiples of 8), group by group, then
# the scales. It unpacks the INT4 weight on every call: a CPU server that cares could keep the unpacked int8
# weight (twice the packed bytes, a quarter of fp32). A second, plainer reference (`*_fp64`) dequantizes the
# weights and the activations and multiplies in float64: the tests check the integer path equals it to fp32
# rounding, and each kernel equals the integer path.
#
# Shapes: w8a8_linear takes x (..., K) float, weight int8 (N, K), weight_scale (N, 1) -> (..., N);
# w4a8_linear x (..., K), weight_packed int32 (N, ceil(K / 8)), weight_scale (N, 1) per channel or
# (N, ceil(K / g)) per group of g inputs -> (..., N); w4a8_experts works over tokens sorted by expert
# (experts.py's grouped layout): x (T, K), counts (E,), weight_packed (E, N, ceil(K / 8)),
# weight_scale (E, N, 1 or ceil(K / g)) -> (T, N), one launch for every expert.


def int_matmul(a, b):
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exactly."""
    if a.device.type == "cpu" and hasattr(torch, "_int_mm"):
        return torch._int_mm(a, b)
    # a GPU's _int_mm wants M > 16 and K, N multiples of 8: float64 holds these sums exactly (< 2^53)
    return (a.double() @ b.double()).to(torch.int32)


def group_size_of(K, weight_scale, group_size=None):
    """The number of inputs each scale column covers: K for one column (per channel), else group_size, or
    K / columns when that divides. Checks the columns are ceil(K / g)."""
    G = weight_scale.shape[-1]
    if group_size is None:
        if G == 1:
            return K
        if K % G:
            raise ValueError(
                f"weight_scale has {G} groups, which do not divide K={K}; pass group_size (the "
                f"checkpoint's quantization_config group_size)"
            )
        group_size = K // G
    if group_size < 1 or cdiv(K, group_size) != G:
        raise ValueError(
            f"weight_scale has {G} columns but K={K} in groups of {group_size} needs {cdiv(K, group_size)}"
        )
    return group_size


def scaled_int_matmul(x_q, x_scale, w_q, w_scale, group_size):
    """x_q (M, K) int8, x_scale (M, 1), w_q (N, K) int8, w_scale (N, G) -> (M, N) fp32:
    x_scale * sum over groups of w_scale[:, g] * (exact int32 dot of the group), in the kernels' order."""
    M, K = x_q.shape
    acc = torch.zeros(M, w_q.shape[0], device=x_q.device, dtype=torch.float32)
    w_scale = w_scale.float()
    for g, k0 in enumerate(range(0, K, group_size)):
        k1 = min(k0 + group_size, K)
        acc += int_matmul(x_q[:, k0:k1], w_q[:, k0:k1].T).float() * w_scale[:, g]  # (M, N)
    return acc * x_scale.float()


def check_linear(x, weight, weight_scale, K, what):
    if x.shape[-1] != K or weight_scale.dim() != 2 or weight_scale.shape[0] != weight.shape[0]:
        raise ValueError(
            f"{what}: x (..., {K}), weight ({weight.shape[0]}, ...) and weight_scale ({weight.shape[0]}, "
            f"groups) must agree; got x {tuple(x.shape)}, weight {tuple(weight.shape)}, weight_scale "
            f"{tuple(weight_scale.shape)}"
        )


def w8a8_linear_ref(x, weight, weight_scale):
    """The W8A8 linear in torch integer math: per-token INT8 x, per-channel INT8 weight."""
    N, K = weight.shape
    check_linear(x, weight, weight_scale, K, "w8a8_linear")
    x_q, x_scale = quantize_activations_ref(x.reshape(-1, K))
    y = scaled_int_matmul(x_q, x_scale, weight, weight_scale, K)  # (M, N)
    return y.to(x.dtype).view(*x.shape[:-1], N)


def w4a8_linear_ref(x, weight_packed, weight_scale, K, group_size=None):
    """The W4A8 linear in torch integer math: the INT4 weight unpacked to int8, then as W8A8 group by
    group."""
    N = weight_packed.shape[0]
    check_linear(x, weight_packed, weight_scale, K, "w4a8_linear")
    g = group_size_of(K, weight_scale, group_size)
    x_q, x_scale = quantize_activations_ref(x.reshape(-1, K))
    y = scaled_int_matmul(x_q, x_scale, unpack_int4(weight_packed, K), weight_scale, g)
    return y.to(x.dtype).view(*x.shape[:-1], N)


def check_experts(x, counts, weight_packed, weight_scale, K):
    E, N = weight_packed.shape[:2]
    if x.dim() != 2 or x.shape[1] != K or counts.shape != (E,) or weight_scale.shape[:2] != (E, N):
        raise ValueError(
            f"w4a8_experts: x (T, {K}), counts ({E},) and weight_scale ({E}, {N}, groups) must match "
            f"weight_packed {tuple(weight_packed.shape)}; got x {tuple(x.shape)}, counts "
            f"{tuple(counts.shape)}, weight_scale {tuple(weight_scale.shape)}"
        )


def w4a8_experts_ref(x, counts, weight_packed, weight_scale, K, group_size=None):
    """Each expert's rows through its own W4A8 weight, one expert after the other (a host sync on counts)."""
    check_experts(x, counts, weight_packed, weight_scale, K)
    if int(counts.sum()) != x.shape[0]:
        raise ValueError(f"w4a8_experts: counts sums to {int(counts.sum())} but x has {x.shape[0]} rows")
    g = group_size_of(K, weight_scale, group_size)
    x_q, x_scale = quantize_activations_ref(x)  # per token: the same whichever expert reads it
    y = torch.empty(x.shape[0], weight_packed.shape[1], device=x.device, dtype=x.dtype)
    a = 0
    for e, n in enumerate(counts.tolist()):
        w_q = unpack_int4(weight_packed[e], K)
        y[a : a + n] = scaled_int_matmul(x_q[a : a + n], x_scale[a : a + n], w_q, weight_scale[e], g)
        a += n
    return y


# The plainer references: dequantize weights and activations, multiply in float64 (tests compare to these)


def w8a8_linear_fp64(x, weight, weight_scale):
    x_q, x_scale = quantize_activations_ref(x)
    return (x_q.double() * x_scale.double()) @ dequantize(weight, weight_scale, weight.shape[1]).T


def w4a8_linear_fp64(x, weight_packed, weight_scale, K, group_size=None):
    x_q, x_scale = quantize_activations_ref(x)
    w = dequantize(unpack_int4(weight_packed, K), weight_scale, group_size_of(K, weight_scale, group_size))
    return (x_q.double() * x_scale.double()) @ w.T


def w4a8_experts_fp64(x, counts, weight_packed, weight_scale, K, group_size=None):
    outs = []
    for e, x_e in enumerate(x.split(counts.tolist())):
        outs.append(w4a8_linear_fp64(x_e, weight_packed[e], weight_scale[e], K, group_size))
    return torch.cat(outs)


# -----------------------------------------------------------------------------
# 4. The Triton kernels. Tiles: BLOCK_M tokens x BLOCK_N output channels, K walked BLOCK_K at a time
#    (BLOCK_K >= 32: the least depth of an int8 tl.dot on NVIDIA GPUs); int8 x int8 dots accumulate in
#    int32, the scales are applied in fp32 after each group's integer sum, as scaled_int_matmul does.
#    So the W4A8 path takes group sizes that are multiples of 32: a K tile must not straddle two groups.
#    The INT4 nibbles are unpacked in registers tile by tile (shifts, a mask, a reshape). The grouped
#    experts kernel trusts that counts sums to T: checking it would cost a host sync (the reference checks).


@triton.jit
def round_half_even(v):
    # rint without libdevice (the interpreter has none): floor, then up past a half, or at a half when odd
    f = tl.floor(v)
    frac = v - f  # exact: in [0, 1)
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return f + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


@triton.jit
def quantize_kernel(X, XQ, XS, K, sx, sq, BLOCK_K: tl.constexpr):
    # one program per token: pass 1 finds the absmax, pass 2 writes round-half-even(x * 127 / absmax)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(X + row * sx + k, mask=k < K, other=0.0).to(tl.float32)))
    amax_row = tl.max(amax)
    inv = tl.where(amax_row > 0, tl.div_rn(127.0, tl.maximum(amax_row, 1e-30)), 0.0)  # IEEE, as torch's
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + row * sx + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(round_half_even(x * inv), -127.0), 127.0)
        tl.store(XQ + row * sq + k, q.to(tl.int8), mask=k < K)
    tl.store(XS + row, tl.div_rn(amax_row, 127.0))


def quantize_activations_triton(x, block_k=1024):
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()  # (M, K)
    M = x2.shape[0]
    x_q = torch.empty(M, K, device=x.device, dtype=torch.int8)
    x_scale = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    if M:
        block_k = min(block_k, max(16, 1 << (K - 1).bit_length()))
        # enable_fp_fusion=False: with fusion on, the compiler folds x * inv into the `v - floor(v)` of
        # round_half_even as one fused multiply-add, which sees the exact product instead of the rounded v and
        # rounds a tie (frequent with bf16 / fp16 inputs) away from even (seen on an H100: other x_q than
        # torch's). The interpreter ignores the option.
        quantize_kernel[(M,)](
            x2, x_q, x_scale, K, x2.stride(0), x_q.stride(0), BLOCK_K=block_k, enable_fp_fusion=False
        )
    return x_q.view(x.shape), x_scale.view(*x.shape[:-1], 1)


@triton.jit
def w8a8_matmul_kernel(
    XQ,
    XS,
    W,
    WS,
    Y,
    M,
    N,
    K,
    sx,
    sw,
    sy,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        # (BLOCK_M, BLOCK_K) activations and (BLOCK_K, BLOCK_N) weights (row n of W is column n of W^T)
        x_mask = (m[:, None] < M) & (k[None, :] < K)
        x = tl.load(XQ + m[:, None].to(tl.int64) * sx + k[None, :], mask=x_mask, other=0)
        w_mask = (n[None, :] < N) & (k[:, None] < K)
        w = tl.load(W + n[None, :].to(tl.int64) * sw + k[:, None], mask=w_mask, other=0)
        acc = tl.dot(x, w, acc, out_dtype=tl.int32)  # int8 x int8 -> int32: exact
    # the epilogue: per-channel weight scale, then per-token activation scale, in fp32
    w_scale = tl.load(WS + n, mask=n < N, other=0.0).to(tl.float32)
    x_scale = tl.load(XS + m, mask=m < M, other=0.0)
    y = acc.to(tl.float32) * w_scale[None, :] * x_scale[:, None]
    tl.store(
        Y + m[:, None].to(tl.int64) * sy + n[None, :],
        y.to(Y.dtype.element_ty),
        mask=(m[:, None] < M) & (n[None, :] < N),
    )


def block_m_for(M):
    """Token tile: 16 rows for decode-sized batches (fewer wasted rows), 64 for prefill."""
    return 16 if M <= 16 else 64


def w8a8_linear_triton(x, weight, weight_scale, block_n=64, block_k=64):
    N, K = weight.shape
    check_linear(x, weight, weight_scale, K, "w8a8_linear")
    x_q, x_scale = quantize_activations_triton(x.reshape(-1, K))
    M = x_q.shape[0]
    weight = weight.contiguous()
    w_scale = weight_scale.reshape(N).contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_m = block_m_for(M)
    w8a8_matmul_kernel[(cdiv(M, block_m), cdiv(N, block_n))](
        x_q,
        x_scale,
        weight,
        w_scale,
        y,
        M,
        N,
        K,
        x_q.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    return y.view(*x.shape[:-1], N)


@triton.jit
def w4a8_tile(
    XQ,
    WP,
    WS,
    rows,
    row_ok,
    n,
    N,
    K,
    GROUP,
    sx,
    sw,
    sws,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # (BLOCK_M, BLOCK_N) fp32 = sum over groups of w_scale[n, g] * (int32 dot of the group), for the tokens
    # `rows` and the channels n of one weight (WP: its int32 words, WS: its scales). Shared by the dense
    # and the grouped kernel; a group is a whole number of K tiles (GROUP = K per channel)
    kk = tl.arange(0, BLOCK_K)
    jj = tl.arange(0, BLOCK_K // 8)  # the tile's int32 words along K
    shifts = tl.arange(0, 8) * 4  # nibble i of a word: bits 4i .. 4i + 3
    n_words = (K + 7) // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for g0 in range(0, K, GROUP):
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)  # this group's exact integer sum
        for k0 in range(g0, tl.minimum(g0 + GROUP, K), BLOCK_K):
            k = k0 + kk
            x_mask = row_ok[:, None] & (k[None, :] < K)
            x = tl.load(XQ + rows[:, None].to(tl.int64) * sx + k[None, :], mask=x_mask, other=0)
            j = k0 // 8 + jj
            w_mask = (n[None, :] < N) & (j[:, None] < n_words)
            # (BLOCK_K // 8, BLOCK_N) int32 words
            words = tl.load(WP + n[None, :].to(tl.int64) * sw + j[:, None], mask=w_mask, other=0)
            nib = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # (BLOCK_K // 8, 8, BLOCK_N), 0..15
            # row 8j + i of the (BLOCK_K, BLOCK_N) tile is nibble i of word j; past K the padding (and the
            # masked words) read as -8, against activations loaded as 0
            w = tl.reshape(nib - 8, (BLOCK_K, BLOCK_N)).to(tl.int8)
            acc_g = tl.dot(x, w, acc_g, out_dtype=tl.int32)
        w_scale = tl.load(WS + n * sws + g0 // GROUP, mask=n < N, other=0.0).to(tl.float32)
        acc += acc_g.to(tl.float32) * w_scale[None, :]
    return acc


@triton.jit
def w4a8_matmul_kernel(
    XQ,
    XS,
    WP,
    WS,
    Y,
    M,
    N,
    K,
    GROUP,
    sx,
    sw,
    sws,
    sy,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = w4a8_tile(XQ, WP, WS, m, m < M, n, N, K, GROUP, sx, sw, sws, BLOCK_M, BLOCK_N, BLOCK_K)
    y = acc * tl.load(XS + m, mask=m < M, other=0.0)[:, None]
    tl.store(
        Y + m[:, None].to(tl.int64) * sy + n[None, :],
        y.to(Y.dtype.element_ty),
        mask=(m[:, None] < M) & (n[None, :] < N),
    )


def k_tile(K, group_size, block_k):
    """The K tile: block_k, or the largest power of two dividing the group (a tile never straddles two)."""
    if group_size == K:
        return block_k
    if group_size % 32:
        raise ValueError(
            f"the Triton W4A8 kernels take group sizes that are multiples of 32 (got {group_size}); "
            f"use NANOGLM_KERNELS=torch for this checkpoint"
        )
    return min(block_k, group_size & -group_size)


def w4a8_linear_triton(x, weight_packed, weight_scale, K, group_size=None, block_n=64, block_k=128):
    N = weight_packed.shape[0]
    check_linear(x, weight_packed, weight_scale, K, "w4a8_linear")
    g = group_size_of(K, weight_scale, group_size)
    block_k = k_tile(K, g, block_k)
    x_q, x_scale = quantize_activations_triton(x.reshape(-1, K))
    M = x_q.shape[0]
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_m = block_m_for(M)
    w4a8_matmul_kernel[(cdiv(M, block_m), cdiv(N, block_n))](
        x_q,
        x_scale,
        weight_packed,
        weight_scale,
        y,
        M,
        N,
        K,
        g,
        x_q.stride(0),
        weight_packed.stride(0),
        weight_scale.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    return y.view(*x.shape[:-1], N)


@triton.jit
def w4a8_experts_kernel(
    XQ,
    XS,
    WP,
    WS,
    Y,
    OFFS,
    TILE_E,
    TILE_ROW,
    E,
    N,
    K,
    GROUP,
    sx,
    sw_e,
    sw,
    sws_e,
    sws,
    sy,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_M rows of one expert (kernels_moe.expert_tiles' schedule) x BLOCK_N channels
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(TILE_E + tile)
    if e < E:  # spare tiles at the end of the grid do nothing
        rows = tl.load(TILE_ROW + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(OFFS + e + 1)  # this expert's last row
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        e64 = e.to(tl.int64)
        acc = w4a8_tile(
            XQ,
            WP + e64 * sw_e,
            WS + e64 * sws_e,
            rows,
            row_ok,
            n,
            N,
            K,
            GROUP,
            sx,
            sw,
            sws,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        y = acc * tl.load(XS + rows, mask=row_ok, other=0.0)[:, None]
        tl.store(
            Y + rows[:, None].to(tl.int64) * sy + n[None, :],
            y.to(Y.dtype.element_ty),
            mask=row_ok[:, None] & (n[None, :] < N),
        )


def w4a8_experts_triton(x, counts, weight_packed, weight_scale, K, group_size=None, block_n=64, block_k=128):
    check_experts(x, counts, weight_packed, weight_scale, K)
    E, N = weight_packed.shape[:2]
    g = group_size_of(K, weight_scale, group_size)
    block_k = k_tile(K, g, block_k)
    x_q, x_scale = quantize_activations_triton(x)
    T = x.shape[0]
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()
    y = torch.empty(T, N, device=x.device, dtype=x.dtype)
    block_m = block_m_for(T)
    offsets = F.pad(counts.cumsum(0), (1, 0))  # (E + 1,): expert e's rows are offsets[e] .. offsets[e + 1]
    tile_e, tile_row = expert_tiles(offsets, T, block_m)  # on the device: no host sync
    w4a8_experts_kernel[(tile_e.numel(), cdiv(N, block_n))](
        x_q,
        x_scale,
        weight_packed,
        weight_scale,
        y,
        offsets,
        tile_e,
        tile_row,
        E,
        N,
        K,
        g,
        x_q.stride(0),
        weight_packed.stride(0),
        weight_packed.stride(1),
        weight_scale.stride(0),
        weight_scale.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    return y


# -----------------------------------------------------------------------------
# The public functions: Triton on a CUDA tensor (when the switch allows), the reference otherwise
#
# Each public function asks kernels.use_triton (the NANOGLM_KERNELS switch: auto, torch, triton) and runs the
# Triton kernel on a CUDA tensor, its torch reference (`*_ref`) otherwise.


def quantize_activations(x):
    """x (..., K) float -> x_q (..., K) int8, x_scale (..., 1) fp32, with x ~ x_q * x_scale per token."""
    if use_triton(x):
        return quantize_activations_triton(x)
    return quantize_activations_ref(x)


def w8a8_linear(x, weight, weight_scale):
    """F.linear(x, weight * weight_scale) through INT8 activations: x (..., K) -> (..., N) in x's dtype."""
    if use_triton(x):
        return w8a8_linear_triton(x, weight, weight_scale)
    return w8a8_linear_ref(x, weight, weight_scale)


def w4a8_linear(x, weight_packed, weight_scale, K, group_size=None):
    """F.linear(x, W) with W stored as INT4 words and scales: x (..., K) -> (..., N) in x's dtype."""
    if use_triton(x):
        return w4a8_linear_triton(x, weight_packed, weight_scale, K, group_size)
    return w4a8_linear_ref(x, weight_packed, weight_scale, K, group_size)


def w4a8_experts(x, counts, weight_packed, weight_scale, K, group_size=None):
    """x (T, K) sorted by expert, counts (E,) rows per expert -> (T, N): row r through its expert's W4A8
    weight."""
    if use_triton(x):
        return w4a8_experts_triton(x, counts, weight_packed, weight_scale, K, group_size)
    return w4a8_experts_ref(x, counts, weight_packed, weight_scale, K, group_size)
