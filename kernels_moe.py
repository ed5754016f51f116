"""
Triton kernels for the MoE experts, each beside the plain torch reference it must equal (the GLM-5
report's section 2 on the MoE; their W4A8 form for serving a quantized checkpoint is kernels_quant.py's
w4a8_experts):

    moe_experts         routed experts over tokens grouped by expert: one launch for every expert's
                        SwiGLU gate/up, one for every expert's down projection (empty experts are free)

The switch (NANOGLM_KERNELS, kernels.use_triton) and Triton itself (or the stand-ins that let these
definitions parse without it) come from kernels.py, which sets Triton's interpreter flag before any kernel
is defined. The grouped SwiGLU pair is experts.run_experts' path on a GPU when no gradient is needed
(serving); training takes torch's grouped GEMM, which has a backward. Each launcher dispatches itself, to
the `*_ref` beside it off the GPU.

Run:
    python -m pytest -q tests/test_kernels.py  # every kernel vs its reference: interpreter on CPU, GPU if any
    python bench/bench_kernels.py --only=moe   # GLM-5 shapes on a GPU (add --interpret on a CPU)

Honest limits:
- Forward only: no backward kernel (training uses torch's grouped GEMM).
- Tile sizes are fixed and untuned, chosen without a GPU at hand. On one H100 (bench/bench_kernels.py, bf16,
  64 experts of GLM-5's shape, top-8) the grouped SwiGLU runs 3.3x torch's grouped GEMM path at 256 tokens
  and 0.73x at 4,096 (182 TFLOP/s, 24% of the bf16 matmul rate); its tests passed natively there.
- fp32 inputs get exact fp32 dots (no tensor cores: slow, for tests), changed after that run (it used tf32);
  bf16 and fp16 are unchanged.
"""

import torch
import torch.nn.functional as F

from kernels import cdiv, tl, triton, use_triton

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
            # (BLOCK_K, BLOCK_N) tiles; exact fp32 dots for fp32 inputs (no tf32), as kernels.py's
            w1 = tl.load(W1 + w_off + k[:, None], mask=w_mask, other=0.0)
            acc1 = tl.dot(x, w1, acc1, input_precision="ieee")
            if SWIGLU:
                w2 = tl.load(W2 + w_off + k[:, None], mask=w_mask, other=0.0)
                acc2 = tl.dot(x, w2, acc2, input_precision="ieee")
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
