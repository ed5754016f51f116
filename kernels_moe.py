"""
Triton kernels for the MoE experts and their W4A8 form, each beside the plain torch reference it must equal
(the GLM-5 report's section 2 on the MoE, and its deployment section on W4A8: INT4 expert weights with
INT8 per-token activations):

    moe_experts         routed experts over tokens grouped by expert: one launch for every expert's
                        SwiGLU gate/up, one for every expert's down projection (empty experts are free)
    w4a8_linear         INT4 weights (two per byte, per-channel or per-group scales) x INT8 per-token
                        activations, integer accumulation, scaled output; quantize_act and pack_int4

The switch (NANOGLM_KERNELS, kernels.use_triton) and Triton itself (or the stand-ins that let these
definitions parse without it) come from kernels.py, which sets Triton's interpreter flag before any kernel
is defined. The grouped SwiGLU pair is experts.run_experts' path on a GPU when no gradient is needed (serving);
training takes torch's grouped GEMM, which has a backward. Each launcher dispatches itself, to the `*_ref`
beside it off the GPU.

Run:
    python -m pytest -q tests/test_kernels.py  # every kernel vs its reference: interpreter on CPU, GPU if any
    python bench_kernels.py --only=moe,w4a8    # GLM-5 shapes on a GPU (add --interpret on a CPU)

Honest limits:
- Forward only: no backward kernel (training uses torch's grouped GEMM). W4A8 covers the MoE experts'
  format only (not W8A8 attention, not QuaRot), and the model does not call it yet.
- The activation quantizer rounds half up (floor(v + 0.5)), in the reference too, so both agree exactly.
- Tile sizes are fixed and untuned, chosen without a GPU at hand (Marlin reaches ~4x over BF16 with INT4;
  expect these well short of it). Tested under Triton's interpreter; not yet run natively on a GPU.
"""

import torch
import torch.nn.functional as F

from kernels import cdiv, pow2, tl, triton, use_triton

# -----------------------------------------------------------------------------
# 3. Grouped expert matmuls (model.MoE's experts): rows of x sorted by expert; offsets (E + 1,) with
#    expert e's rows at offsets[e]:offsets[e + 1]; weights stacked as w_gate, w_up (E, F, D) and
#    w_down (E, D, F).


def stack_experts(moe):
    """model.MoE's stacked experts -> w_gate, w_up (E, F, D), w_down (E, D, F): views of gate_up_proj
    (gate rows on top of up rows per expert) and down_proj, no copy."""
    w_gate, w_up = moe.experts.gate_up_proj.chunk(2, dim=1)
    return w_gate, w_up, moe.experts.down_proj


def grouped_swiglu_ref(x, offsets, w_gate, w_up):
    h = x.new_empty(x.shape[0], w_gate.shape[1])
    for e, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        h[a:b] = F.silu(x[a:b] @ w_gate[e].T) * (x[a:b] @ w_up[e].T)
    return h


def grouped_down_ref(h, offsets, w_down, row_weight):
    out = h.new_empty(h.shape[0], w_down.shape[1])
    for e, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        out[a:b] = (h[a:b] @ w_down[e].T) * row_weight[a:b, None]
    return out


def expert_tiles(offsets, n_rows, block_m):
    """The launch schedule, without a host sync: tile i covers rows row[i]:row[i] + block_m of expert e[i].
    The grid is an upper bound on the tile count, cdiv(n_rows, block_m) + E; spare tiles get e = E and
    idle."""
    E = offsets.numel() - 1
    tiles = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m  # (E,) tiles per expert, 0 if it is empty
    ends = tiles.cumsum(0)  # expert e owns tiles ends[e] - tiles[e] .. ends[e] - 1
    i = torch.arange(cdiv(n_rows, block_m) + E, device=offsets.device)
    e = torch.searchsorted(ends, i, right=True)  # (n_tiles,)
    e_ = e.clamp(max=E - 1)
    row = offsets[e_] + (i - ends[e_] + tiles[e_]) * block_m
    return e.to(torch.int32), row.to(torch.int32)


@triton.jit
def grouped_matmul_kernel(
    X,
    W1,
    W2,
    ROW_W,
    Y,
    OFFS,
    TILE_E,
    TILE_ROW,
    E,
    N_OUT,
    K_IN,
    sx,
    sw_e,
    sw_n,
    sy,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_M rows of one expert x BLOCK_N output columns. SWIGLU: y = silu(x W1^T) * (x W2^T)
    # (gate and up in one pass over x); else y = (x W1^T) * row weight (down, with the routing weight)
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(TILE_E + tile)
    if e < E:  # spare tiles at the end of the grid do nothing
        row0 = tl.load(TILE_ROW + tile)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(OFFS + e + 1)  # this expert's last row
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        w_off = e.to(tl.int64) * sw_e + n[None, :] * sw_n  # (1, BLOCK_N): column n of W^T is row n of W
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K_IN, BLOCK_K):
            k = k0 + kk
            x = tl.load(
                X + rows[:, None].to(tl.int64) * sx + k[None, :],
                mask=row_ok[:, None] & (k[None, :] < K_IN),
                other=0.0,
            )
            w_mask = (k[:, None] < K_IN) & (n[None, :] < N_OUT)
            # (BLOCK_K, BLOCK_N) tiles
            acc1 = tl.dot(x, tl.load(W1 + w_off + k[:, None], mask=w_mask, other=0.0), acc1)
            if SWIGLU:
                acc2 = tl.dot(x, tl.load(W2 + w_off + k[:, None], mask=w_mask, other=0.0), acc2)
        if SWIGLU:
            y = acc1 * tl.sigmoid(acc1) * acc2
        else:
            y = acc1 * tl.load(ROW_W + rows, mask=row_ok, other=0.0)[:, None]
        tl.store(
            Y + rows[:, None].to(tl.int64) * sy + n[None, :],
            y.to(Y.dtype.element_ty),
            mask=row_ok[:, None] & (n[None, :] < N_OUT),
        )


def grouped_matmul(x, offsets, w1, w2, row_weight, swiglu, block_m=64, block_n=64, block_k=64):
    N, K_in = x.shape
    E, N_out = w1.shape[0], w1.shape[1]
    x = x.contiguous()
    # the kernel wants unit stride along K and one stride layout for both weights; the gate and up halves
    # of experts.Experts.gate_up_proj are such views already (no copy of the experts' weights per call)
    if w1.stride(-1) != 1 or w2.stride() != w1.stride():
        w1, w2 = w1.contiguous(), w2.contiguous()
    y = torch.empty(N, N_out, device=x.device, dtype=x.dtype)
    tile_e, tile_row = expert_tiles(offsets, N, block_m)
    grid = (tile_e.numel(), cdiv(N_out, block_n))
    grouped_matmul_kernel[grid](
        x,
        w1,
        w2,
        row_weight,
        y,
        offsets,
        tile_e,
        tile_row,
        E,
        N_out,
        K_in,
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        y.stride(0),
        SWIGLU=swiglu,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    return y


def grouped_swiglu(x, offsets, w_gate, w_up, **blocks):
    """x (N, D) grouped by expert -> h (N, F) = silu(x W_gate[e]^T) * (x W_up[e]^T), every expert in one
    launch."""
    if not use_triton(x):
        return grouped_swiglu_ref(x, offsets, w_gate, w_up)
    return grouped_matmul(x, offsets, w_gate, w_up, None, True, **blocks)


def grouped_down(h, offsets, w_down, row_weight, **blocks):
    """h (N, F) grouped by expert -> (N, D) = (h W_down[e]^T) * row_weight, every expert in one launch."""
    if not use_triton(h):
        return grouped_down_ref(h, offsets, w_down, row_weight)
    return grouped_matmul(h, offsets, w_down, w_down, row_weight.float().contiguous(), False, **blocks)


def moe_experts(x, ids, weights, w_gate, w_up, w_down):
    """The routed part of model.MoE.forward: x (N, D), the router's ids and weights (N, k) ->
    y (N, D) = sum over slots of weights * Expert_ids(x). Sort the (token, slot) pairs by expert, run
    the two grouped launches, add each pair's result back onto its token."""
    N, k = ids.shape
    E = w_gate.shape[0]
    order = ids.flatten().argsort(stable=True)  # (N * k,) pairs, grouped by expert
    token_of = order // k
    offsets = F.pad(torch.bincount(ids.flatten(), minlength=E).cumsum(0), (1, 0))  # (E + 1,)
    h = grouped_swiglu(x[token_of], offsets, w_gate, w_up)  # (N * k, F)
    out = grouped_down(h, offsets, w_down, weights.flatten()[order])  # (N * k, D), routing weight applied
    return torch.zeros_like(x).index_add_(0, token_of, out.to(x.dtype))


# -----------------------------------------------------------------------------
# 4. W4A8 (the GLM-5 report's deployment): weights as signed INT4 in [-8, 7], two per byte along K
#    (low nibble = even k), with scales per output channel (group_size None) or per group of group_size
#    inputs; activations as INT8 in [-127, 127] with one scale per token.
#    y = x_scale[m] * sum_g w_scale[n, g] * sum_{k in g} xq[m, k] wq[n, k]


def pack_int4(w, group_size=None):
    """w (N, K) float -> packed (N, K // 2) int8 and scales (N, K // group_size) fp32 (symmetric,
    absmax / 7)."""
    N, K = w.shape
    g = group_size or K
    if K % 2 or K % g:
        raise ValueError(
            f"pack_int4 needs an even K divisible by group_size; got K={K}, group_size={group_size}"
        )
    wg = w.float().view(N, K // g, g)
    scale = wg.abs().amax(-1).clamp_min(1e-12) / 7  # (N, G)
    q = torch.round(wg / scale[..., None]).clamp(-8, 7).to(torch.int32).view(N, K)
    packed = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)  # (N, K // 2) in 0..255
    return packed.to(torch.uint8).view(torch.int8), scale


def unpack_int4(packed):
    """(N, K // 2) int8 -> (N, K) int8 in [-8, 7]: the low nibble sign-extended, then the high one."""
    p = packed.to(torch.int32)
    lo, hi = ((p & 0xF) ^ 8) - 8, p >> 4  # arithmetic shift: the high nibble keeps the byte's sign
    return torch.stack([lo, hi], dim=-1).flatten(-2).to(torch.int8)


def quantize_act_ref(x):
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(1e-12) / 127  # (M,)
    return torch.floor(x / scale[:, None] + 0.5).clamp(-127, 127).to(torch.int8), scale


@triton.jit
def quantize_act_kernel(X, XQ, SCALE, K, sx, sq, BLOCK_K: tl.constexpr):
    # one program per token row: pass 1 finds the absmax, pass 2 writes round-half-up(x / scale)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(X + row * sx + k, mask=k < K, other=0.0).to(tl.float32)))
    scale = tl.div_rn(tl.maximum(tl.max(amax), 1e-12), 127.0)  # IEEE division, as torch's
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + row * sx + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.floor(tl.div_rn(x, scale) + 0.5), -127.0), 127.0)
        tl.store(XQ + row * sq + k, q.to(tl.int8), mask=k < K)
    tl.store(SCALE + row, scale)


def quantize_act(x, block_k=1024):
    """Per-token dynamic symmetric INT8: x (M, K) -> x_q (M, K) int8, scale (M,) fp32; x ~ x_q * scale."""
    if not use_triton(x):
        return quantize_act_ref(x)
    M, K = x.shape
    x = x.contiguous()
    xq = torch.empty(M, K, device=x.device, dtype=torch.int8)
    scale = torch.empty(M, device=x.device, dtype=torch.float32)
    quantize_act_kernel[(M,)](x, xq, scale, K, x.stride(0), xq.stride(0), BLOCK_K=min(block_k, pow2(K)))
    return xq, scale


def w4a8_matmul_ref(xq, x_scale, packed, w_scale, out_dtype=torch.float32):
    """The same integer math in torch. The group sums are integers below 2^24 (|xq wq| <= 127 * 8, so for
    groups up to 16K inputs), which fp32 holds exactly: an fp32 matmul gives exact integer sums."""
    M, K = xq.shape
    N, G = w_scale.shape
    wq = unpack_int4(packed)
    # (M, N, G)
    acc = torch.einsum("mgk,ngk->mng", xq.view(M, G, K // G).float(), wq.view(N, G, K // G).float())
    return ((acc * w_scale[None]).sum(-1) * x_scale[:, None]).to(out_dtype)


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
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for g0 in range(0, K, GROUP):  # one scale group at a time (per-channel: one group, GROUP = K)
        acc_i = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)  # exact integer sum within the group
        for k0 in range(g0, tl.minimum(g0 + GROUP, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                XQ + m[:, None].to(tl.int64) * sx + k[None, :],
                mask=(m[:, None] < M) & (k[None, :] < K),
                other=0,
            )
            kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # packed bytes: two weights each
            p = tl.load(
                WP + n[:, None].to(tl.int64) * sw + kp[None, :],
                mask=(n[:, None] < N) & (kp[None, :] < K // 2),
                other=0,
            )
            lo = (p << 4) >> 4  # int8 shifts: the low nibble, sign-extended
            hi = p >> 4  # the high nibble (arithmetic shift keeps the sign)
            w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # interleave back: k = 2j (lo), 2j + 1 (hi)
            acc_i += tl.dot(x, tl.trans(w), out_dtype=tl.int32)  # int8 x int8 -> int32 tensor cores
        w_scale = tl.load(WS + n * sws + g0 // GROUP, mask=n < N, other=0.0)
        acc += acc_i.to(tl.float32) * w_scale[None, :]
    y = acc * tl.load(XS + m, mask=m < M, other=0.0)[:, None]
    tl.store(
        Y + m[:, None].to(tl.int64) * sy + n[None, :],
        y.to(Y.dtype.element_ty),
        mask=(m[:, None] < M) & (n[None, :] < N),
    )


def w4a8_matmul(xq, x_scale, packed, w_scale, out_dtype=torch.float32, block_m=32, block_n=64, block_k=128):
    """xq (M, K) int8, x_scale (M,), packed (N, K // 2) int8, w_scale (N, G) -> y (M, N) in out_dtype."""
    if not use_triton(xq):
        return w4a8_matmul_ref(xq, x_scale, packed, w_scale, out_dtype)
    M, K = xq.shape
    N, G = w_scale.shape
    group = K // G
    block_k = min(block_k, group) if G > 1 else block_k  # a group is a whole number of K tiles
    if G > 1 and (group % block_k or block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"w4a8_matmul needs group_size a power of two >= 16, got {group}")
    xq, packed, w_scale = xq.contiguous(), packed.contiguous(), w_scale.contiguous()
    y = torch.empty(M, N, device=xq.device, dtype=out_dtype)
    w4a8_matmul_kernel[(cdiv(M, block_m), cdiv(N, block_n))](
        xq,
        x_scale,
        packed,
        w_scale,
        y,
        M,
        N,
        K,
        group,
        xq.stride(0),
        packed.stride(0),
        w_scale.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
    )
    return y


def w4a8_linear(x, packed, w_scale):
    """F.linear(x, W) with W stored by pack_int4: x (..., K) -> (..., N) in x's dtype, through INT8
    activations."""
    xq, x_scale = quantize_act(x.reshape(-1, x.shape[-1]))
    y = w4a8_matmul(xq, x_scale, packed, w_scale, out_dtype=x.dtype)
    return y.view(*x.shape[:-1], -1)
