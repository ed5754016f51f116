"""
Triton kernels for DSA, GLM-5's sparse attention, each checked against the plain torch path in dsa.py
(the GLM-5 report's section 2 on DSA and MLA; the DeepSeek-V3.2 report's lightning indexer and sparse MLA):

    index_scores        the lightning indexer: I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s] * Di^-0.5),
                        causal mask -> -inf, for a block of queries against the cached index keys
    sparse_mla          MLA in the absorbed form over each query's top-k gathered latents [c_kv | k_pe],
                        online softmax, prefill and decode shapes; a FlashAttention-2 style backward
    sparse_mla_target   the sparse-stage indexer KL's target, from the main attention's lse

The MoE experts' grouped SwiGLU kernels are in kernels_moe.py, the W8A8 / W4A8 ones of quantized serving in
kernels_quant.py; all share this file's switch, NANOGLM_KERNELS (auto, torch, triton: see its section).

    python -m pytest -q tests/test_kernels.py  # every kernel vs its reference: interpreter on CPU, GPU if any
    python bench/bench_kernels.py              # GLM-5 shapes on a GPU: time, ratio, TFLOP/s and GB/s vs peak
    python bench/bench_kernels.py --interpret  # tiny shapes through the interpreter on a CPU: a smoke test

Honest limits: tile sizes are fixed and untuned (no autotuning; chosen without a GPU at hand), written to be
read first and far below DeepSeek's FlashMLA (figures: docs/design-notes.md). top-k after the index kernel
is the reference's full stable sort over the (B, T, S) fp32 scores, materialised (feed long prefills in
blocks of queries). With a bf16 cache the index kernel's dots are bf16 (the reference's fp32), so near-tied
keys can swap in the top-k; fp32 inputs get exact fp32 dots (input_precision="ieee", no tensor cores: slow,
for tests), since tf32 dots put a training step's indexer gradients 5% off the torch path's on an H100.
sparse_mla's backward adds into d_latent with fp32 atomics: its last bits vary run to run on a GPU (dq does
not). The sparse stage's KL input and the dense warm-up's KL stay in torch. Under torch.compile the torch
paths run (inductor failed on these kernels), so a compiled GPU training step loses sparse MLA's memory
saving. Only one H100 lease ran them natively; the exact fp32 dots came after it (interpreter and CPU only).
"""

import functools
import os

import torch
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# The switch and the one dispatch rule
#
# One switch, one rule (use_triton below), set by the environment variable NANOGLM_KERNELS:
#     auto    (default) Triton when the data is on a CUDA GPU, the torch reference otherwise, and the torch
#             reference inside torch.compile (serve.py --compile, train.py --compile=True), where inductor
#             fuses it: this file's kernels, kernels_moe.py's and kernels_quant.py's alike
#     torch   the torch reference everywhere (the switch to compare against, on a GPU too)
#     triton  Triton everywhere; on a machine without CUDA that is Triton's CPU interpreter
#             (TRITON_INTERPRET=1, which this file sets before defining the kernels): slow, for tests
# The DSA kernels (index_scores, sparse_mla, sparse_mla_target) are launchers only: dsa.py asks use_triton and
# calls them or its own torch path (dsa.causal_index_scores, dsa.sparse_mla_torch,
# dsa.sparse_mla_target_torch), so mla.py's sparse path trains through them on a GPU and this file needs
# nothing from dsa.py.

MODE = os.environ.get("NANOGLM_KERNELS", "auto")  # "auto" | "torch" | "triton"
if MODE not in ("auto", "torch", "triton"):
    raise ValueError(
        f"NANOGLM_KERNELS={MODE!r} is not a kernel mode; use auto (Triton on CUDA), torch or triton"
    )
if MODE == "triton" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read by @triton.jit when the kernels below are defined

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # e.g. macOS has no Triton wheel: the references still run; stand-ins let the defs parse
    HAVE_TRITON = False

    class triton:  # noqa: N801
        jit = staticmethod(lambda fn: fn)

    class tl:  # noqa: N801
        constexpr = None


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the state the kernels were defined in


def use_triton(x):
    """Triton or torch for data like `x`: Triton on CUDA (MODE auto, outside torch.compile) or always (MODE
    triton); else torch."""
    if MODE == "torch" or (MODE == "auto" and not (x.is_cuda and HAVE_TRITON)):
        return False
    if MODE == "auto" and torch.compiler.is_compiling():
        # under torch.compile the torch paths run and inductor writes fused kernels for them: inductor
        # (torch 2.11, H100) failed to compile these kernels as user-defined Triton kernels
        return False
    if not HAVE_TRITON:
        raise RuntimeError(
            "NANOGLM_KERNELS=triton but Triton is not installed; pip install triton, or use "
            "NANOGLM_KERNELS=auto"
        )
    if not x.is_cuda and not INTERPRET:
        raise RuntimeError(
            "NANOGLM_KERNELS=triton with CPU tensors needs Triton's interpreter, which was off when "
            "kernels.py was imported; set TRITON_INTERPRET=1 before importing it"
        )
    return True


def pow2(n, least=16):
    """Tile width covering n: a power of two (tl.arange needs one), at least 16 (tl.dot needs that)."""
    return max(least, 1 << (max(1, n) - 1).bit_length())


def cdiv(a, b):
    return -(-a // b)


def same_dtype(*ts):
    """Cast to the one dtype tl.dot needs: autocast's when it is on (what torch's einsum would use), else the
    widest. Under bf16 autocast the model's queries are bf16 but its normed latent is fp32."""
    dev = ts[0].device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
    else:
        dt = functools.reduce(torch.promote_types, [t.dtype for t in ts])
    return tuple(t.to(dt) for t in ts)


LOG2E = 1.4426950408889634  # the kernels' softmax uses exp2: exp(x) = exp2(x * log2(e))

# -----------------------------------------------------------------------------
# 1. The lightning indexer (dsa.Indexer.score, fused): q (B, T, Hi, Di) fp32, w (B, T, Hi) fp32,
#    k (B, S, Di) the cached index keys, last (B, T): the last key position each query may see.
#    Causal positions get -inf; dsa.index_topk then takes the deterministic top-k of these scores.


@triton.jit
def index_score_kernel(
    Q,
    W,
    K,
    LAST,
    I,
    T,
    S,
    HI,
    DI,
    scale,
    sq_b,
    sq_t,
    sq_h,
    sw_b,
    sw_t,
    sk_b,
    sk_s,
    sl_b,
    si_b,
    si_t,
    BLOCK_T: tl.constexpr,
    HP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program: BLOCK_T queries x BLOCK_S keys of one sequence. The q tile's rows are (query, head)
    # pairs, so one tl.dot scores every index head of every query in the block against the key tile.
    pid_s, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) queries
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) keys
    r = tl.arange(0, BLOCK_T * HP)
    rt, rh = pid_t * BLOCK_T + r // HP, r % HP  # each row's query and index head
    d = tl.arange(0, BLOCK_D)
    last = tl.load(LAST + b * sl_b + t, mask=t < T, other=-1)  # (BLOCK_T,)
    out = tl.full((BLOCK_T, BLOCK_S), float("-inf"), tl.float32)
    if pid_s * BLOCK_S <= tl.max(last):  # a tile wholly in every query's future stays -inf (causal: half)
        row_ok = (rt < T) & (rh < HI)  # padded heads load q = 0 and w = 0
        # (BLOCK_T * HP, BLOCK_D)
        q = tl.load(
            Q + b * sq_b + rt[:, None] * sq_t + rh[:, None] * sq_h + d[None, :],
            mask=row_ok[:, None] & (d[None, :] < DI),
            other=0.0,
        )
        # (BLOCK_D, BLOCK_S), transposed
        k = tl.load(
            K + b * sk_b + s[None, :] * sk_s + d[:, None],
            mask=(s[None, :] < S) & (d[:, None] < DI),
            other=0.0,
        )
        # (BLOCK_T * HP, BLOCK_S), fp32 accumulation
        dots = tl.dot(q.to(k.dtype), k, input_precision="ieee") * scale
        w = tl.load(W + b * sw_b + rt * sw_t + rh, mask=row_ok, other=0.0)
        per_head = tl.maximum(dots, 0.0) * w[:, None]  # ReLU, then the query's weight for this head
        score = tl.sum(tl.reshape(per_head, (BLOCK_T, HP, BLOCK_S)), axis=1)  # sum over heads
        out = tl.where(s[None, :] <= last[:, None], score, float("-inf"))
    tl.store(
        I + b * si_b + t[:, None].to(tl.int64) * si_t + s[None, :],
        out,
        mask=(t[:, None] < T) & (s[None, :] < S),
    )


def index_scores(q, w, k, last, softmax_scale, block_t=None, block_s=128):
    """I (B, T, S) fp32: index scores of q's queries against keys k, -inf past each query's `last` key
    (dsa.causal_index_scores in one kernel)."""
    B, T, Hi, Di = q.shape
    S = k.shape[1]
    q, w, last = q.contiguous(), w.contiguous(), last.contiguous()
    assert k.stride(-1) == 1, "index keys must be contiguous in their last dim"
    HP = pow2(Hi, least=1)
    block_t = block_t or min(pow2(T, least=1), max(1, 128 // HP))
    block_t = max(block_t, 16 // HP)  # tl.dot needs >= 16 rows
    I = torch.empty(B, T, S, device=q.device, dtype=torch.float32)
    grid = (cdiv(S, block_s), cdiv(T, block_t), B)
    index_score_kernel[grid](
        q,
        w,
        k,
        last,
        I,
        T,
        S,
        Hi,
        Di,
        softmax_scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        w.stride(0),
        w.stride(1),
        k.stride(0),
        k.stride(1),
        last.stride(0),
        I.stride(0),
        I.stride(1),
        BLOCK_T=block_t,
        HP=HP,
        BLOCK_S=block_s,
        BLOCK_D=pow2(Di),
        num_warps=8,
    )
    return I


# -----------------------------------------------------------------------------
# 2. Sparse MLA, absorbed form (dsa.sparse_mla): q_abs (B, T, H, C), q_pe (B, T, H, R),
#    latent (B, S, C + R) = [c_kv | k_pe], idx / valid (B, T, K) from the indexer's top-k.
#    Online softmax, -> o_lat and the log-sum-exp. The backward is FlashAttention-2 style: scores
#    recomputed, row gradients added into the latent with fp32 atomics. It keeps one (B, T, H, C) output
#    and the lse for backward, not the (B, T, K, 576) gather that the torch path's autograd keeps.


@triton.jit
def sparse_mla_kernel(
    QA,
    QP,
    LAT,
    IDX,
    VALID,
    O,
    LSE,
    T,
    H,
    K,
    C,
    R,
    K_SPLIT,
    scale_log2,
    sl_b,
    sl_s,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # one program: one query token (b, t), BLOCK_H of its heads (all heads share the token's selection, so
    # each gathered latent row is loaded once for BLOCK_H heads: MQA), and one split of its K selected keys
    bt, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    b = bt // T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c, r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    q_abs = tl.load(
        QA + (bt * H + h[:, None]) * C + c[None, :], mask=(h[:, None] < H) & (c[None, :] < C), other=0.0
    )
    q_pe = tl.load(
        QP + (bt * H + h[:, None]) * R + r[None, :], mask=(h[:, None] < H) & (r[None, :] < R), other=0.0
    )
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l = tl.zeros((BLOCK_H,), tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)  # running sum of exp2(score - m) * c_kv
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        ok = tl.load(VALID + bt * K + kk, mask=kk < k_hi, other=0) != 0  # (BLOCK_K,) invalid or past the end
        pos = tl.load(IDX + bt * K + kk, mask=ok, other=0)  # token positions to gather
        row = LAT + b * sl_b + pos.to(tl.int64) * sl_s  # (BLOCK_K,) pointers to the latent rows
        # (BLOCK_K, BLOCK_C)
        c_kv = tl.load(row[:, None] + c[None, :], mask=ok[:, None] & (c[None, :] < C), other=0.0)
        k_pe = tl.load(row[:, None] + C + r[None, :], mask=ok[:, None] & (r[None, :] < R), other=0.0)
        s = tl.dot(q_abs, tl.trans(c_kv), input_precision="ieee") + tl.dot(
            q_pe, tl.trans(k_pe), input_precision="ieee"
        )  # (BLOCK_H, BLOCK_K) fp32
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        # online softmax: rescale what was summed so far to the new running max
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: keep exp2 away from NaN
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision="ieee")
        m = m_new
    l_safe = tl.where(l > 0, l, 1.0)  # a split with no valid key writes o = 0 (acc is 0) and lse = -inf
    o = acc / l_safe[:, None]
    lse = tl.where(l > 0, (m + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    n_split = tl.num_programs(2)
    out_row = (bt * n_split + split) * H + h  # O is (B*T, n_split, H, C), LSE (B*T, n_split, H)
    tl.store(
        O + out_row[:, None] * C + c[None, :],
        o.to(O.dtype.element_ty),
        mask=(h[:, None] < H) & (c[None, :] < C),
    )
    tl.store(LSE + out_row, lse, mask=h < H)


def sparse_mla_fwd(q_abs, q_pe, latent, idx, valid, softmax_scale, num_splits=None, block_h=16, block_k=32):
    B, T, H, C = q_abs.shape
    R, K = q_pe.shape[-1], idx.shape[-1]
    q_abs, q_pe, idx = q_abs.contiguous(), q_pe.contiguous(), idx.contiguous()
    valid = valid.contiguous().view(torch.uint8)  # bytes: plain int8 loads in the kernel
    assert latent.stride(-1) == 1, "the latent cache must be contiguous in its last dim"
    programs = B * T * cdiv(H, block_h)
    if (
        num_splits is None
    ):  # decode has few (token, head block) programs: split K across more (flash-decoding)
        sms = torch.cuda.get_device_properties(q_abs.device).multi_processor_count if q_abs.is_cuda else 1
        num_splits = max(1, min(cdiv(2 * sms, programs), cdiv(K, 8 * block_k)))
    k_split = cdiv(cdiv(K, num_splits), block_k) * block_k  # each split a whole number of key blocks
    n_split = max(1, cdiv(K, k_split))
    # one split writes the output directly; several write fp32 partials that are merged below
    o = torch.empty(
        B * T, n_split, H, C, device=q_abs.device, dtype=q_abs.dtype if n_split == 1 else torch.float32
    )
    lse = torch.empty(B * T, n_split, H, device=q_abs.device, dtype=torch.float32)
    sparse_mla_kernel[(B * T, cdiv(H, block_h), n_split)](
        q_abs,
        q_pe,
        latent,
        idx,
        valid,
        o,
        lse,
        T,
        H,
        K,
        C,
        R,
        k_split,
        softmax_scale * LOG2E,
        latent.stride(0),
        latent.stride(1),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        BLOCK_C=pow2(C),
        BLOCK_R=pow2(R),
        num_warps=4,
        num_stages=2,
    )
    if n_split > 1:  # merge the splits: softmax over the union = lse-weighted average of the parts
        total = torch.logsumexp(lse, dim=1, keepdim=True)  # (B*T, 1, H)
        part = torch.exp(lse - total).nan_to_num(0.0)  # a row with nothing valid anywhere: weights 0
        o, lse = (o * part[..., None]).sum(1, keepdim=True).to(q_abs.dtype), total
    return o.view(B, T, H, C), lse.view(B, T, H)


@triton.jit
def sparse_mla_bwd_kernel(
    QA,
    QP,
    LAT,
    IDX,
    VALID,
    O,
    DO,
    LSE,
    DLSE,
    DQA,
    DQP,
    DLAT,
    T,
    H,
    K,
    C,
    R,
    scale,
    scale_log2,
    sl_b,
    sl_s,
    sd_b,
    sd_s,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # one program: one query token (b, t) and BLOCK_H of its heads, over all K of its selected keys.
    # With s = scale * (q_abs . c_kv + q_pe . k_pe), p = exp(s - lse), delta = rowsum(dO * o) - dlse:
    #   dp = dO . c_kv,  ds = p * (dp - delta)      (FlashAttention-2's backward, plus the lse term)
    #   dq_abs = scale * ds @ c_kv,  dq_pe = scale * ds @ k_pe
    #   dc_kv = p^T @ dO + scale * ds^T @ q_abs,  dk_pe = scale * ds^T @ q_pe  -> into the gathered rows
    # Many queries select the same latent row, so the row gradients go in with fp32 atomic adds
    # (in no fixed order).
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c, r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    hc, hr = (h[:, None] < H) & (c[None, :] < C), (h[:, None] < H) & (r[None, :] < R)
    q_abs = tl.load(QA + (bt * H + h[:, None]) * C + c[None, :], mask=hc, other=0.0)  # (BLOCK_H, BLOCK_C)
    q_pe = tl.load(QP + (bt * H + h[:, None]) * R + r[None, :], mask=hr, other=0.0)  # (BLOCK_H, BLOCK_R)
    d_o = tl.load(DO + (bt * H + h[:, None]) * C + c[None, :], mask=hc, other=0.0)  # (BLOCK_H, BLOCK_C)
    # log2 units, like the forward
    lse2 = tl.load(LSE + bt * H + h, mask=h < H, other=0.0) * 1.4426950408889634
    o = tl.load(O + (bt * H + h[:, None]) * C + c[None, :], mask=hc, other=0.0).to(tl.float32)
    # (BLOCK_H,)
    delta = tl.sum(d_o.to(tl.float32) * o, axis=1) - tl.load(DLSE + bt * H + h, mask=h < H, other=0.0)
    dq_abs = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    dq_pe = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        ok = tl.load(VALID + bt * K + kk, mask=kk < K, other=0) != 0  # (BLOCK_K,)
        pos = tl.load(IDX + bt * K + kk, mask=ok, other=0).to(tl.int64)
        row = LAT + b * sl_b + pos * sl_s  # (BLOCK_K,) pointers to the latent rows
        # (BLOCK_K, BLOCK_C)
        c_kv = tl.load(row[:, None] + c[None, :], mask=ok[:, None] & (c[None, :] < C), other=0.0)
        # (BLOCK_K, BLOCK_R)
        k_pe = tl.load(row[:, None] + C + r[None, :], mask=ok[:, None] & (r[None, :] < R), other=0.0)
        s = tl.dot(q_abs, tl.trans(c_kv), input_precision="ieee") + tl.dot(
            q_pe, tl.trans(k_pe), input_precision="ieee"
        )  # (BLOCK_H, BLOCK_K) fp32, unscaled
        # p as the forward left it; where(), not a multiply, so that exp2(+inf) of a masked slot never enters
        p = tl.where(ok[None, :] & (h[:, None] < H), tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        dp = tl.dot(d_o, tl.trans(c_kv), input_precision="ieee")  # (BLOCK_H, BLOCK_K)
        ds = p * (dp - delta[:, None]) * scale  # gradient of the unscaled dot products
        dq_abs += tl.dot(ds.to(c_kv.dtype), c_kv, input_precision="ieee")
        dq_pe += tl.dot(ds.to(k_pe.dtype), k_pe, input_precision="ieee")
        # (BLOCK_K, BLOCK_C)
        d_c = tl.dot(tl.trans(p.to(d_o.dtype)), d_o, input_precision="ieee") + tl.dot(
            tl.trans(ds.to(q_abs.dtype)), q_abs, input_precision="ieee"
        )
        d_pe = tl.dot(tl.trans(ds.to(q_pe.dtype)), q_pe, input_precision="ieee")  # (BLOCK_K, BLOCK_R)
        d_row = DLAT + b * sd_b + pos * sd_s
        tl.atomic_add(d_row[:, None] + c[None, :], d_c, mask=ok[:, None] & (c[None, :] < C), sem="relaxed")
        tl.atomic_add(
            d_row[:, None] + C + r[None, :], d_pe, mask=ok[:, None] & (r[None, :] < R), sem="relaxed"
        )
    tl.store(DQA + (bt * H + h[:, None]) * C + c[None, :], dq_abs.to(DQA.dtype.element_ty), mask=hc)
    tl.store(DQP + (bt * H + h[:, None]) * R + r[None, :], dq_pe.to(DQP.dtype.element_ty), mask=hr)


def sparse_mla_bwd(
    q_abs, q_pe, latent, idx, valid, o, lse, d_o, d_lse, softmax_scale, block_h=16, block_k=16
):
    """Gradients of sparse_mla_fwd's (o, lse) -> d_q_abs, d_q_pe, d_latent (each in its input's dtype)."""
    B, T, H, C = q_abs.shape
    R, K = q_pe.shape[-1], idx.shape[-1]
    q_abs, q_pe, idx, d_o = q_abs.contiguous(), q_pe.contiguous(), idx.contiguous(), d_o.contiguous()
    valid = valid.contiguous().view(torch.uint8)
    assert latent.stride(-1) == 1, "the latent cache must be contiguous in its last dim"
    d_q_abs = torch.empty(q_abs.shape, device=q_abs.device, dtype=q_abs.dtype)
    d_q_pe = torch.empty(q_pe.shape, device=q_pe.device, dtype=q_pe.dtype)
    # (B, S, C + R), atomics add here
    d_lat = torch.zeros(latent.shape, device=latent.device, dtype=torch.float32)
    sparse_mla_bwd_kernel[(B * T, cdiv(H, block_h))](
        q_abs,
        q_pe,
        latent,
        idx,
        valid,
        o.contiguous(),
        d_o,
        lse.contiguous(),
        d_lse.float().contiguous(),
        d_q_abs,
        d_q_pe,
        d_lat,
        T,
        H,
        K,
        C,
        R,
        softmax_scale,
        softmax_scale * LOG2E,
        latent.stride(0),
        latent.stride(1),
        d_lat.stride(0),
        d_lat.stride(1),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        BLOCK_C=pow2(C),
        BLOCK_R=pow2(R),
        num_warps=8,
        num_stages=1,
    )
    return d_q_abs, d_q_pe, d_lat.to(latent.dtype)


class SparseMLA(torch.autograd.Function):
    """Triton forward and backward. The forward's (o, lse) are saved instead of the probabilities, and the
    backward recomputes each score from the gathered rows: no (B, T, H, K) or (B, T, K, C + R) tensor is
    kept."""

    @staticmethod
    def forward(ctx, q_abs, q_pe, latent, idx, valid, softmax_scale, num_splits):
        o, lse = sparse_mla_fwd(q_abs, q_pe, latent, idx, valid, softmax_scale, num_splits)
        ctx.save_for_backward(q_abs, q_pe, latent, idx, valid, o, lse)
        ctx.softmax_scale = softmax_scale
        return o, lse

    @staticmethod
    def backward(ctx, d_o, d_lse):
        q_abs, q_pe, latent, idx, valid, o, lse = ctx.saved_tensors
        grads = sparse_mla_bwd(q_abs, q_pe, latent, idx, valid, o, lse, d_o, d_lse, ctx.softmax_scale)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad)) + (None,) * 4


def sparse_mla(q_abs, q_pe, latent, idx, valid, softmax_scale, num_splits=None):
    """Each query's attention over only its selected latents -> o_lat (B, T, H, C), lse (B, T, H) fp32.
    Differentiable. num_splits: pieces the K keys of each query are cut into (None: chosen for the GPU)."""
    return SparseMLA.apply(*same_dtype(q_abs, q_pe, latent), idx, valid, softmax_scale, num_splits)


# The sparse-stage indexer KL's target from the lse: the main attention's probabilities over the selection,
# summed over heads, normalised. The KL's other input, I at the selected keys, is plain torch
# (dsa.selected_index_scores, a (B, T, K, 128) gather); the dense warm-up's KL needs dense attention's
# probabilities and stays in torch.
@triton.jit
def sparse_mla_target_kernel(
    QA,
    QP,
    LAT,
    IDX,
    VALID,
    LSE,
    P,
    T,
    H,
    K,
    C,
    R,
    scale_log2,
    sl_b,
    sl_s,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # one program: one query token and BLOCK_K of its selected keys, loaded once; the heads are looped over
    # and their probabilities exp(s - lse) summed, so the (H, K) probabilities are never stored
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    c, r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    ok = tl.load(VALID + bt * K + kk, mask=kk < K, other=0) != 0  # (BLOCK_K,)
    row = LAT + b * sl_b + tl.load(IDX + bt * K + kk, mask=ok, other=0).to(tl.int64) * sl_s
    # (BLOCK_K, BLOCK_C)
    c_kv = tl.load(row[:, None] + c[None, :], mask=ok[:, None] & (c[None, :] < C), other=0.0)
    # (BLOCK_K, BLOCK_R)
    k_pe = tl.load(row[:, None] + C + r[None, :], mask=ok[:, None] & (r[None, :] < R), other=0.0)
    total = tl.zeros((BLOCK_K,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        q_abs = tl.load(
            QA + (bt * H + h[:, None]) * C + c[None, :], mask=(h[:, None] < H) & (c[None, :] < C), other=0.0
        )
        q_pe = tl.load(
            QP + (bt * H + h[:, None]) * R + r[None, :], mask=(h[:, None] < H) & (r[None, :] < R), other=0.0
        )
        lse2 = tl.load(LSE + bt * H + h, mask=h < H, other=0.0) * 1.4426950408889634
        s = tl.dot(q_abs, tl.trans(c_kv), input_precision="ieee") + tl.dot(
            q_pe, tl.trans(k_pe), input_precision="ieee"
        )  # (BLOCK_H, BLOCK_K)
        p = tl.where(ok[None, :] & (h[:, None] < H), tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        total += tl.sum(p, axis=0)
    # each head's probabilities sum to 1, so attention_target's L1 normalisation is a division by H
    tl.store(P + bt * K + kk, total / H, mask=kk < K)


def sparse_mla_target(q_abs, q_pe, latent, idx, valid, lse, softmax_scale, block_h=16, block_k=32):
    """The sparse-stage indexer KL's target from sparse_mla's lse: the main attention's probabilities over the
    selection, summed over heads and L1-normalised -> p (B, T, K) fp32, detached (dsa.attention_target)."""
    B, T, H, C = q_abs.shape
    R, K = q_pe.shape[-1], idx.shape[-1]
    q_abs, q_pe, latent = same_dtype(q_abs, q_pe, latent)
    assert latent.stride(-1) == 1, "the latent cache must be contiguous in its last dim"
    p = torch.empty(B, T, K, device=q_abs.device, dtype=torch.float32)
    sparse_mla_target_kernel[(B * T, cdiv(K, block_k))](
        q_abs.detach().contiguous(),
        q_pe.detach().contiguous(),
        latent.detach(),
        idx.contiguous(),
        valid.contiguous().view(torch.uint8),
        lse.detach().contiguous(),
        p,
        T,
        H,
        K,
        C,
        R,
        softmax_scale * LOG2E,
        latent.stride(0),
        latent.stride(1),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        BLOCK_C=pow2(C),
        BLOCK_R=pow2(R),
        num_warps=4,
        num_stages=1,
    )
    return p
