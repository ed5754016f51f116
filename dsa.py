"""
DeepSeek Sparse Attention (DSA) as GLM-5 uses it (GLM-5 report, section 2 "DSA"; DeepSeek-V3.2 report,
section 2): the lightning indexer, deterministic top-k selection, sparse attention over the selected
latents, and the two indexer KL losses (dense warm-up and sparse stage).

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s] * 128^-0.5)           (index score, fp32)
    selected(t) = top-k_s I[t, s]  over visible s,  k = min(index_topk, visible)
    attention(t) = MLA restricted to selected(t)

mla.py (the attention layer) calls into this file; nothing here knows about the rest of the model.
The absorbed form runs the real sparse computation (sparse_mla reads only the selected latents); the
naive form is its reference, dense attention with everything but the selection masked (selection_mask).

Three operations have a Triton kernel in kernels.py: the index scores (index_topk), sparse_mla and the
sparse stage's KL target (sparse_mla_target). Each function here picks the kernel where
kernels.use_triton says so (data on a CUDA GPU; NANOGLM_KERNELS=torch keeps torch everywhere) and
otherwise runs its torch path, the `*_torch` function beside it, which tests/test_kernels.py compares
the kernels against.

Honest limits: the torch paths materialise a (B, T, index_n_heads, S) fp32 intermediate for the index
scores and a (B, T, K, 576) gather for sparse MLA, so their memory grows with T*S*index_n_heads;
the kernels avoid both. The sparse stage's KL input, I at the selected keys, is always torch
(selected_index_scores, a (B, T, K, 128) gather); the dense warm-up's KL needs dense attention's
probabilities and runs in torch.
Run its tests with `python -m pytest -q tests/test_dsa.py tests/test_kernels.py`.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels


def upcast(t):
    """Scores, softmax and norms run in fp32 at least (fp64 stays fp64, for exact reference tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def no_autocast(device_type):
    """torch.autocast(enabled=False) where autocast is on (train.py's bf16 on a GPU), else nothing: the
    scores and the router run in fp32 either way, and a graph without an autocast region stays cacheable
    (torch.compile's AOTAutograd cache refuses any graph holding one, so the engine's graphs would be
    rebuilt from scratch in every process)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def linear_fp32(x, weight):
    """F.linear in fp32 at least, also under autocast (which would run it in bf16): the indexer's head
    weights and the MoE router are fp32 on purpose, as released (DeepSeek-V3.2 report; DeepSeek-V3 report)."""
    with no_autocast(x.device.type):
        return F.linear(upcast(x), weight.to(upcast(x).dtype))


# -----------------------------------------------------------------------------
# The lightning indexer (checkpoint names: wq_b, wk, k_norm, weights_proj)


class Indexer(nn.Module):
    """Scores every visible key for every query with a few cheap ReLU heads and one shared 128-d key.

    q = wq_b(q_lat) as index_n_heads x index_head_dim (q_lat: MLA's normalised query latent);
    k = LayerNorm(wk(x)), one key per token shared by all index heads (this is what the cache stores);
    RoPE on the first qk_rope_head_dim dims of q and k; w = weights_proj(x) * n_heads^-0.5 in fp32.
    """

    def __init__(self, hidden_size, q_lora_rank, index_n_heads, index_head_dim, rope_dim):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = index_n_heads, index_head_dim, rope_dim
        self.wq_b = nn.Linear(q_lora_rank, index_n_heads * index_head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)  # LayerNorm with weight and bias, as released
        self.weights_proj = nn.Linear(hidden_size, index_n_heads, bias=False)
        self.softmax_scale = index_head_dim**-0.5

    def _rope_first(self, t, rope):
        # RoPE on the first rope_dim dims only; the rest passes through
        t_pe, t_nope = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([rope(t_pe), t_nope], dim=-1)

    def forward(self, x, q_lat, rope):
        """x (B, T, D), q_lat (B, T, q_lora_rank), rope: a function applying this batch's RoPE.
        Returns q (B, T, Hi, Di), k (B, T, Di) and w (B, T, Hi) in fp32."""
        B, T, _ = x.shape
        q = self.wq_b(q_lat).view(B, T, self.n_heads, self.head_dim)
        q = self._rope_first(q, rope)
        k = self._rope_first(self.k_norm(self.wk(x)).unsqueeze(2), rope).squeeze(2)  # (B, T, Di)
        w = linear_fp32(x, self.weights_proj.weight) * self.n_heads**-0.5  # (B, T, Hi) in fp32
        return upcast(q), k, w

    def score(self, q, w, k_all):
        """q (B, T, Hi, Di), w (B, T, Hi), k_all (B, S, Di) -> I (B, T, S) in fp32."""
        return index_scores(q, w, k_all, self.softmax_scale)


def index_scores(q, w, k_all, softmax_scale):
    """The lightning indexer: I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s] * scale) -> (B, T, S) fp32,
    no mask (causal_index_scores adds the causal one). q (B, T, Hi, Di), w (B, T, Hi), k_all (B, S, Di).
    The scale > 0 goes on the head weights: w_j ReLU(s x) = (s w_j) ReLU(x), one pass less over the
    (B, T, Hi, S) products."""
    with no_autocast(q.device.type):  # fp32 scores, also under autocast
        dots = torch.einsum("bthd,bsd->bths", q, upcast(k_all).to(q.dtype))  # (B, T, Hi, S)
        return torch.einsum("bths,bth->bts", relu(dots), w * softmax_scale)


# -----------------------------------------------------------------------------
# The indexer in 8 bits. DeepSeek-V3.2's report (section 2.1) notes the indexer "can be implemented in FP8",
# and its released inference code quantizes q and k in blocks of 128 with one scale each, folding q's scale
# into the head weights and applying k's after the head sum. ModelConfig.index_quant = "int8" does the same
# with int8 (a CPU has int8 matrix instructions, not FP8 ones): the selection (index_topk) in every path
# scores quantized q and k, and a cache stores each key as 128 int8 values and its fp32 scale's 4 bytes, the
# layout vLLM's DSA indexer cache uses for its FP8 keys. The indexer KL still trains on the float scores
# (training runs without a cache). On a GPU the int8 keys run this torch path, not kernels.py's fused index
# kernel (which takes float keys): fine for decode, but a long prefill materialises (B, T, Hi, S) scores.
# Not done here: the later release also rotates q and k by a Hadamard transform before quantizing them
# (dot products unchanged, outliers spread); on the toy the int8 selection costs no measurable loss
# (docs/choices.md).

SCALE_BYTES = 4  # a packed key ends with its fp32 scale, as 4 int8 bytes


def quantize_int8(t):
    """(..., Di) float -> (..., Di) int8 and (...) fp32 scale, t ~= int8 * scale: symmetric, one absmax scale
    per row of Di values (Di = 128 at full size: DeepSeek-V3.2's block of 128)."""
    t = t.float()
    scale = t.abs().amax(-1).clamp_min(1e-12) / 127
    return torch.round(t / scale[..., None]).to(torch.int8), scale


def pack_index_keys(k):
    """(..., Di) float keys -> (..., Di + 4) int8: each key's int8 values, then its scale's 4 bytes."""
    index_cache_layout("int8", k.shape[-1], k.dtype)  # Di must be a multiple of 4
    k_int, scale = quantize_int8(k)
    return torch.cat([k_int, scale[..., None].view(torch.int8)], dim=-1)


def unpack_index_keys(packed):
    """(..., Di + 4) int8 -> the keys' (..., Di) int8 values and their (...) fp32 scales, both views: with
    Di a multiple of 4 (index_cache_layout checks) each row is whole 4-byte words, the scale the last."""
    return packed[..., :-SCALE_BYTES], packed.view(torch.float32)[..., -1]


def dequantize_index_keys(packed):
    """(..., Di + 4) packed keys -> (..., Di) fp32 keys as the quantized scores see them (for the KL)."""
    k_int, scale = unpack_index_keys(packed)
    return k_int.float() * scale[..., None]


def index_cache_layout(index_quant, index_head_dim, dtype):
    """What a cache stores per token for the indexer key: (width, dtype)."""
    if index_quant == "int8":
        if index_head_dim % SCALE_BYTES:
            raise ValueError(
                f"index_quant 'int8' packs each key with its 4-byte scale and needs index_head_dim divisible "
                f"by 4, got {index_head_dim}; use index_quant 'none'"
            )
        if 127 * 127 * index_head_dim >= 2**24:
            raise ValueError(
                f"index_quant 'int8' keeps the dot products exact in fp32 only up to index_head_dim 1040, "
                f"got {index_head_dim}; use index_quant 'none'"
            )
        return index_head_dim + SCALE_BYTES, torch.int8
    return index_head_dim, dtype


def check_cached_keys(keys, index_quant):
    """A clear error for a cache whose index keys (int8 or float) do not match config.index_quant."""
    if (keys.dtype == torch.int8) != (index_quant == "int8"):
        raise ValueError(
            f"the cache holds {keys.dtype} index keys but config.index_quant is {index_quant!r}; set "
            "index_quant before building the cache (or the Engine)"
        )


def to_index_cache(index_k, cache_dtype):
    """This step's (..., Di) float keys in a cache's format: packed int8 or the cache's float dtype."""
    if cache_dtype == torch.int8:
        return pack_index_keys(index_k)
    return index_k.to(cache_dtype)


def quantized_index_scores(q, w, packed_k, softmax_scale):
    """index_scores from int8 q and k -> (B, T, S) fp32; packed_k (B, S, Di + 4).

        I[t, s] = k_scale[s] * sum_j (w[t, j] q_scale[t, j] scale) ReLU(q_int[t, j] . k_int[s])

    (the scales are > 0, so they move out of the ReLU). Each dot product is an exact integer
    (|.| <= 127^2 x Di < 2^24, so fp32 holds every partial sum exactly), so any int8 GEMM (the serving
    engine's over its page pool, paged_attention.py) gives the same dot products as this fp32 einsum,
    whatever the batch or the order of the sum. The head-weighted sum after them is fp32, as in
    index_scores, so its last bits may depend on the shape it runs at, as the float path's do."""
    k_int, k_scale = unpack_index_keys(packed_k)  # (B, S, Di), (B, S)
    q_int, q_scale = quantize_int8(q)  # (B, T, Hi, Di), (B, T, Hi)
    with no_autocast(q.device.type):
        dots = torch.einsum("bthd,bsd->bths", q_int.float(), k_int.float()).relu_()  # (B, T, Hi, S)
        I = torch.einsum("bths,bth->bts", dots, w.float() * q_scale * softmax_scale)
        return I * k_scale.unsqueeze(-2)  # (B, T, S)


def relu(dots):
    """ReLU of the indexer's dot products, in place when no gradient is taken: the (B, T, Hi, S) products
    are the indexer's largest tensor (8 MB a query at 64K keys), and a second copy of them is not needed."""
    if torch.is_grad_enabled() and dots.requires_grad:
        return F.relu(dots)
    return dots.relu_()


def selected_index_scores(q, w, k_all, idx, softmax_scale):
    """index_scores at the selected keys only -> (B, T, K) fp32, equal to index_scores(...).gather(-1, idx):
    all the sparse stage's KL needs, without the (B, T, Hi, S) intermediate (mla.py's kernel path)."""
    k_sel = gather_rows(k_all, idx)  # (B, T, K, Di)
    with no_autocast(q.device.type):
        dots = torch.einsum("bthd,btkd->bthk", q, upcast(k_sel).to(q.dtype))  # (B, T, Hi, K)
        return torch.einsum("bthk,bth->btk", relu(dots), w * softmax_scale)


# -----------------------------------------------------------------------------
# Selection


def topk_select(index_scores, visible, k, exact_sort=False):
    """Deterministic top-k of I[t, :] over visible keys only (the causal/padding mask is applied first).

    index_scores (B, T, S) fp32, visible (B, T, S) or broadcastable bool, k = min(index_topk, S).
    Returns idx (B, T, k) long and valid (B, T, k) bool; rows with fewer than k visible keys get
    invalid tail entries, so the effective k is min(index_topk, visible tokens) per row.
    Ties break toward the lower index, so the same scores always give the same set: the report found
    non-deterministic top-k collapsed RL. The reference is a stable sort of all S scores (exact_sort, and
    fp64); the fast path runs torch.topk, whose order among equal values is unspecified, over keys made
    distinct: the score's bits and the position packed into one int64 (tie_broken_keys). Both give the
    same idx, in the same order (tests/test_dsa.py)."""
    visible = visible.expand_as(index_scores)
    masked = index_scores.masked_fill(~visible, float("-inf"))
    if exact_sort or masked.dtype == torch.float64:
        idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]  # (B, T, k)
    else:
        idx = torch.topk(tie_broken_keys(masked), k, dim=-1).indices  # (B, T, k), sorted
    return idx, visible.gather(-1, idx)


def tie_broken_keys(scores):
    """fp32 (or narrower) scores (..., S) -> int64 keys, all distinct, ordered as (score descending, then
    position ascending): the float's bits mapped to an int of the same order (flip the magnitude bits of
    negatives), shifted up 32 bits, minus the position (S < 2^32, so a score's keys never reach the next
    score's). -0.0 counts as 0.0 (a ReLU score times a negative head weight is -0.0, and the stable sort
    treats the two as one value)."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float: a < b <=> ordered(a) < ordered(b)
    pos = torch.arange(scores.shape[-1], device=scores.device)
    # minus pos, not + (2^32 - 1 - pos): the same order, and inductor (torch 2.11, CUDA) put that constant
    # into an int32 index expression and failed to compile the decode step
    return ordered.long() * 2**32 - pos


def causal_index_scores(q, w, k_all, last, softmax_scale):
    """index_scores with every key past a query's `last` visible position at -inf: -> I (B, T, S) fp32.
    The torch path of kernels.index_scores, which fuses both."""
    I = index_scores(q, w, k_all, softmax_scale)
    visible = torch.arange(k_all.shape[1], device=k_all.device) <= last[..., None]  # (B, T, S)
    return I.masked_fill(~visible, float("-inf"))


def index_topk(q, w, k_all, last, topk, softmax_scale):
    """The DSA selection: each query's min(topk, S) best keys among positions 0..last.

    q (B, T, Hi, Di), w (B, T, Hi), k_all (B, S, Di) the (cached) index keys, last (B, T) or (1, T): the
    last key position each query may see. Returns idx, valid (B, T, min(topk, S)), as topk_select.
    k_all may be packed int8 keys (B, S, Di + 4) (ModelConfig.index_quant "int8"): then the scores are
    quantized_index_scores, in torch on every device. Otherwise the scores run as a Triton kernel where
    kernels.use_triton says so, else in torch. The selection is discrete, so no gradient flows through it
    (the KL trains the indexer, from selected_index_scores)."""
    B, T = q.shape[:2]
    last = last.expand(B, T)
    S = k_all.shape[1]
    with torch.no_grad():
        if k_all.dtype == torch.int8:
            I = quantized_index_scores(q, w, k_all, softmax_scale)  # (B, T, S); topk_select masks the future
        elif kernels.use_triton(q):
            I = kernels.index_scores(q, w, k_all, last, softmax_scale)  # (B, T, S), fused causal mask
        else:
            I = causal_index_scores(q, w, k_all, last, softmax_scale)
    visible = torch.arange(S, device=q.device) <= last[..., None]  # (B, T, S)
    return topk_select(I, visible, min(topk, S))


def selection_mask(idx, valid, S):
    """Scatter a selection back to a dense (B, T, S) bool mask (for the dense-masked reference)."""
    mask = torch.zeros(*idx.shape[:-1], S, dtype=torch.bool, device=idx.device)
    return mask.scatter_(-1, idx, valid)


# -----------------------------------------------------------------------------
# Sparse MLA over the selected latents (absorbed / MQA form, prefill and decode alike)


def gather_rows(latent, idx):
    """latent (B, S, F), idx (B, T, K) positions in each row -> latent[b, idx[b, t, k]] (B, T, K, F), as
    whole-row copies (index_select over the flattened rows: several times faster on a CPU than indexing
    with two index tensors)."""
    B, S, F = latent.shape
    flat = idx + (torch.arange(B, device=idx.device) * S)[:, None, None]  # (B, T, K) rows of (B * S, F)
    return latent.reshape(B * S, F).index_select(0, flat.flatten()).view(*idx.shape, F)


def sparse_scores(q_abs, q_pe, latent, idx, valid, softmax_scale, gather=gather_rows):
    """Gather each query's selected latents and score them: -> scores (B, T, H, K) in fp32, -inf where
    invalid, and the gathered rows sel (B, T, K, C + R). gather: gather_rows, or the serving engine's
    (paged_attention.gather_rows, which also reads a page pool shared by every row)."""
    C = q_abs.shape[-1]
    sel = gather(latent, idx)  # (B, T, K, C + R)
    c_sel, pe_sel = sel.split([C, sel.shape[-1] - C], dim=-1)
    scores = torch.einsum("bthc,btkc->bthk", q_abs, c_sel) + torch.einsum("bthr,btkr->bthk", q_pe, pe_sel)
    scores = (upcast(scores) * softmax_scale).masked_fill(~valid[:, :, None, :], float("-inf"))
    return scores, sel


def sparse_mla_torch(q_abs, q_pe, latent, idx, valid, softmax_scale, gather=gather_rows):
    """The torch path of sparse_mla: a (B, T, K, C + R) gather (see sparse_scores), then softmax attention
    over it."""
    C = q_abs.shape[-1]
    scores, sel = sparse_scores(q_abs, q_pe, latent, idx, valid, softmax_scale, gather)  # (B, T, H, K)
    probs = scores.softmax(dim=-1).to(sel.dtype)  # (B, T, H, K)
    o_lat = torch.einsum("bthk,btkc->bthc", probs, sel[..., :C])
    return o_lat, scores.logsumexp(dim=-1)


def sparse_mla(q_abs, q_pe, latent, idx, valid, softmax_scale):
    """Attention of each query over only its selected cached latents.

    q_abs (B, T, H, C): query with W_UK folded in (C = kv_lora_rank);  q_pe (B, T, H, R) roped;
    latent (B, S, C + R): [c_kv | k_pe] per token;  idx, valid (B, T, K).
    Returns o_lat (B, T, H, C) (the caller folds in W_UV) and the log-sum-exp lse (B, T, H) fp32, which
    is all the indexer KL's target needs. Differentiable; Triton (forward and backward) where
    kernels.use_triton says so, else sparse_mla_torch.
    """
    if kernels.use_triton(q_abs):
        return kernels.sparse_mla(q_abs, q_pe, latent, idx, valid, softmax_scale)
    return sparse_mla_torch(q_abs, q_pe, latent, idx, valid, softmax_scale)


# -----------------------------------------------------------------------------
# Indexer training losses (GLM-5 report, section 2 "DSA"; DeepSeek-V3.2 report, section 2.1.1).
# The target is the main attention's distribution, summed over heads and L1-normalised, always
# detached; the caller detaches the indexer's inputs in the sparse stage.


def attention_target(probs, head_dim):
    """probs: main attention probabilities with a head axis at `head_dim` -> p (…, keys) summing to 1."""
    p = upcast(probs.detach()).sum(dim=head_dim)
    return p / p.sum(dim=-1, keepdim=True).clamp_min(1e-12)


def indexer_kl(p, index_scores, mask):
    """Mean over query tokens of KL(p || softmax(I)) over the keys where mask is True.

    Dense warm-up: keys = all visible tokens (mask = causal), p from dense attention.
    Sparse stage:  keys = the selected set (mask = valid selection), p from sparse attention.
    p, index_scores, mask: (B, T, N) with N = S or K.
    """
    log_q = upcast(index_scores).masked_fill(~mask, float("-inf")).log_softmax(dim=-1)
    p = p.masked_fill(~mask, 0.0)
    kl = torch.where(mask, torch.xlogy(p, p) - p * log_q.masked_fill(~mask, 0.0), 0.0)
    return kl.sum(dim=-1).mean()


def sparse_mla_target_torch(q_abs, q_pe, latent, idx, valid, lse, softmax_scale):
    """The torch path of sparse_mla_target: the scores again, exp(scores - lse), then attention_target."""
    detached = (t.detach() for t in (q_abs, q_pe, latent))
    scores, _ = sparse_scores(*detached, idx, valid, softmax_scale)  # (B, T, H, K)
    return attention_target(torch.exp(scores - lse.detach()[..., None]), 2)


def sparse_mla_target(q_abs, q_pe, latent, idx, valid, lse, softmax_scale):
    """The sparse stage's KL target from sparse_mla's lse: the main attention's probabilities over each
    query's selection, summed over heads and L1-normalised -> p (B, T, K) fp32, detached. Rebuilt from
    the lse so that no (B, T, H, K) probabilities are kept; Triton where kernels.use_triton says so."""
    if kernels.use_triton(q_abs):
        return kernels.sparse_mla_target(q_abs, q_pe, latent, idx, valid, lse, softmax_scale)
    return sparse_mla_target_torch(q_abs, q_pe, latent, idx, valid, lse, softmax_scale)
