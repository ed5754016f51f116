"""
MLA, multi-head latent attention, as GLM-5 runs it (GLM-5 report, section 2; MLA itself: DeepSeek-V2
report, section 2.1), with the hooks DeepSeek Sparse Attention (dsa.py) plugs into; and the pieces it is
built from, which model.py's decoder stack uses too: the Linear every projection is, RMSNorm and the
interleaved RoPE.

    x -> q_a_proj -> q_a_layernorm -> q_b_proj -> per head [q_nope | q_pe]       (q_pe roped)
    x -> kv_a_proj_with_mqa -> [c_kv | k_pe] -> [kv_a_layernorm(c_kv) | rope(k_pe)] = the latent,
         576 values a token at full size: all a cache holds (with the indexer's 128-value key)

Both forms of the attention over the latents, "naive" (MHA; training and prefill) and "absorb" (MQA; decode
over the latent cache), sit behind one switch `form`, with DSA's selection on either; they are described at
the MLA section below.

Run it: python -m pytest -q tests/test_model.py tests/test_dsa.py tests/test_reference.py
(absorbed == naive, cached decoding == the full forward, RoPE and RMSNorm against their written-out
references, and the whole model against reference.py and an independent implementation).
Honest limits: plain torch (SDPA for the naive form without the KL) except DSA's selection and sparse
attention, which dsa.py runs as Triton kernels on a GPU. Serving's faster reads of its page pool (in place,
row by row, decode steps as GEMMs) are paged_attention.py's, not this file's.
"""

from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import dsa
from dsa import upcast

# -----------------------------------------------------------------------------
# Linear, norms and RoPE


class Linear(nn.Linear):
    """nn.Linear minus its own initialisation: GLM5.init_weights
    initialises every weight in one place (and building the 744B model on the meta device stays fast)."""

    def reset_parameters(self):
        pass


MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps (as released)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, cast back, then scale (the released implementation's order); F.rms_norm is
        # one fused op for rms_norm_ref's three
        xf = upcast(x)
        return self.weight * F.rms_norm(xf, (xf.shape[-1],), eps=self.eps).to(x.dtype)


def rms_norm_ref(x, weight, eps):
    """RMSNorm.forward written out: the reference F.rms_norm is tested against."""
    xf = upcast(x)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_cos_sin(positions, dim, theta, dtype=torch.float32):
    """positions (B, T) long -> cos, sin (B, T, dim/2) for pair i at frequency theta^(-2i/dim), in fp32
    as released (fp64 only for float64 reference runs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device).to(dtype) / dim))
    angles = positions.to(dtype)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Interleaved RoPE: rotate adjacent pairs (x[2i], x[2i+1]) by angle i (GPT-J layout, as GLM-5).
    x (B, T, ..., dim); cos/sin (B, T, dim/2) broadcast over the middle axes. Each pair is a complex number
    x[2i] + j x[2i+1] multiplied by cos + j sin: one complex multiply, no stack of the two halves
    (apply_rope_ref is the rotation written out). Under torch.compile it is apply_rope_ref: inductor
    generates no code for complex numbers, and the real form fuses with the ops around it."""
    if torch.compiler.is_compiling():
        return apply_rope_ref(x, cos, sin)
    shape = (cos.shape[0], cos.shape[1]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
    rot = torch.complex(cos, sin).view(shape)  # (B, T, 1.., dim/2)
    xc = torch.view_as_complex(x.to(cos.dtype).contiguous().unflatten(-1, (-1, 2)))  # (B, T, .., dim/2)
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


def apply_rope_ref(x, cos, sin):
    shape = (cos.shape[0], cos.shape[1]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


# -----------------------------------------------------------------------------
# MLA: multi-head latent attention with the DSA indexer
#
# Both forms of the attention over the latents, behind one switch `form`:
# - "naive" (MHA; training and prefill): kv_b_proj expands every latent into per-head keys and values
#   (MLA.naive_attention).
# - "absorb" (MQA; decode over the latent cache): W_UK folded into the query, W_UV into the output, the
#   attention over the latents themselves (MLA.absorbed_attention; dsa.sparse_mla over a selection).
#
# With DSA selecting (config.dsa_mode "sparse"), MLA.select takes each query's index_topk keys from the
# indexer's scores; the absorbed form then reads only those latents (dsa.sparse_mla) and the naive form masks
# the rest to -inf (its dense reference). MLA.attend also builds the indexer KL of the dense warm-up and the
# sparse stage from the attention that ran.
#
# A cache is one call, cache.attend(mla, q, latent, index_k, positions, form, want_kl): model.KVCache stores
# this step's latents and runs MLA.attend over each row's history; the serving engine's paged cache
# (paged_cache.py) runs its own reads of the page pool (paged_attention.py), held equal to MLA.attend by
# tests/test_engine.py. The same seam as vLLM's attention backends (layer, queries, keys, metadata).


class Query(NamedTuple):
    """One step's queries: MLA's, per head, and the lightning indexer's (None where it did not run)."""

    nope: torch.Tensor  # (B, T, H, qk_nope_head_dim)
    pe: torch.Tensor  # (B, T, H, qk_rope_head_dim), roped
    index: Optional[torch.Tensor]  # (B, T, index_n_heads, index_head_dim), the indexer's query
    index_w: Optional[torch.Tensor]  # (B, T, index_n_heads) fp32, its head weights


class MLA(nn.Module):
    def __init__(self, cfg, layer_id=0):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id  # the cache's layer index (main layers, then the MTP block)
        H, D = cfg.num_attention_heads, cfg.hidden_size
        self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_NORM_EPS)
        self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)  # per head [nope | rope]
        # [c_kv | k_pe]: the compressed latent and the decoupled RoPE key shared by all heads
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, MLA_NORM_EPS)
        # per head [k_nope | v]: W_UK and W_UV stacked, the blocks Muon Split orthogonalises one by one
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(H * cfg.v_head_dim, D, bias=False)
        self.indexer = dsa.Indexer(
            D, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        )
        self.softmax_scale = cfg.qk_head_dim**-0.5  # 256^-0.5, no YaRN

    def w_uk_uv(self):
        """kv_b_proj split per head: W_UK (H, nope, C) and W_UV (H, v, C), used by the absorbed form."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(
            c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        return w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)

    def forward(self, x, cos, sin, positions, cache=None, form=None, want_kl=False):
        """x (B, T, D); positions (B, T); cos, sin: their RoPE. Without a cache, query t sees keys 0..t of
        this sequence; with one, this step's latents are stored at `positions` and the queries see
        everything cached so far. form: "naive" or "absorb" (see MLA.attend). want_kl: also return the
        indexer's KL to this attention (else None). Returns (out (B, T, D), kl)."""
        c = self.cfg
        B, T, _ = x.shape
        H, C, R = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim

        def rope(t):
            return apply_rope(t, cos, sin)

        # queries: q_lat = RMSNorm(q_a_proj(x)); q = q_b_proj(q_lat) per head [nope | rope]
        q_lat = self.q_a_layernorm(self.q_a_proj(x))  # (B, T, q_lora_rank)
        q = self.q_b_proj(q_lat).view(B, T, H, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, R], dim=-1)
        q_pe = rope(q_pe)  # (B, T, H, R)
        # the latent: [c_kv | k_pe], one per token, shared by all heads; this is all the cache holds
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([C, R], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), rope(k_pe)], dim=-1)  # (B, T, C + R)

        # the lightning indexer: its query heads and their weights, and one key per token (cached with the
        # latent); when its KL is trained its inputs are detached, so only that loss reaches it
        iq = iw = index_k = None
        if c.dsa_mode == "sparse" or want_kl or cache is not None:
            ix, iq_lat = (x.detach(), q_lat.detach()) if want_kl else (x, q_lat)
            iq, index_k, iw = self.indexer(ix, iq_lat, rope)  # (B, T, Hi, Di), (B, T, Di), (B, T, Hi)
        q = Query(q_nope, q_pe, iq, iw)

        if cache is None:  # one whole sequence (training, scoring): query t sees key positions 0..t
            last = torch.arange(T, device=x.device)[None]  # (1, T)
            o, kl = self.attend(q, latent, index_k, last, form, want_kl)
        else:  # decoding: the cache stores this step's latents and attends over all it holds
            o, kl = cache.attend(self, q, latent, index_k, positions, form, want_kl)
        return self.o_proj(o.reshape(B, T, H * c.v_head_dim)), kl

    def attend(self, q, latent, index_k, last, form=None, want_kl=False):
        """Attention over the keys: latent (B, S, C + R) and index_k (B, S, Ki), query t seeing positions
        0..last[t] (last (B or 1, T)) and, with DSA selecting, only its index_topk best among them.
        form: "naive" (MHA: expand every latent into per-head keys and values) or "absorb" (MQA: fold
        W_UK into the query and W_UV into the output, attend over the latents). With a selection, the
        absorbed form reads only each query's selected latents (the real sparse computation) and the naive
        form masks everything else to -inf (its dense reference). Default: absorbed with a selection, naive
        otherwise (a cache passes "absorb"). Returns o (B, T, H, v) before o_proj, and the indexer KL
        (want_kl) or None."""
        B, T = q.nope.shape[:2]
        S = latent.shape[1]
        visible = torch.arange(S, device=last.device) <= last[..., None]  # (B or 1, T, S)
        idx, valid = self.select(q, index_k, last)  # (B, T, K), or None: dense
        form = form or ("naive" if idx is None else "absorb")
        if form not in ("naive", "absorb"):
            raise ValueError(f"MLA form must be 'naive' or 'absorb', got {form!r}")

        if form == "naive":
            mask = visible if idx is None else dsa.selection_mask(idx, valid, S)  # (B or 1, T, S)
            o, probs = self.naive_attention(q.nope, q.pe, latent, mask, need_probs=want_kl)
        else:
            w_uk, w_uv = self.w_uk_uv()
            q_abs = torch.einsum("bthd,hdc->bthc", q.nope, w_uk)  # fold W_UK into the query: (B, T, H, C)
            if idx is None:
                mask = visible
                o_lat, probs = self.absorbed_attention(q_abs, q.pe, latent, mask)
            else:  # each query reads only its K selected latents (Triton on a GPU)
                o_lat, lse = dsa.sparse_mla(q_abs, q.pe, latent, idx, valid, self.softmax_scale)
            o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)  # fold W_UV into the output: (B, T, H, v)
        if not want_kl:
            return o, None

        # the indexer KL: the main attention's distribution (summed over heads) against the indexer's,
        # over the keys this attention saw (dense warm-up: every visible key; sparse stage: the selection)
        if index_k.dtype == torch.int8:  # an int8 cache's history: the keys as the selection saw them
            index_k = dsa.dequantize_index_keys(index_k)  # (no gradient; training runs uncached)
        if idx is not None and form == "absorb":  # over the K selected keys, target rebuilt from the lse
            target = dsa.sparse_mla_target(q_abs, q.pe, latent, idx, valid, lse, self.softmax_scale)
            scores = dsa.selected_index_scores(q.index, q.index_w, index_k, idx, self.indexer.softmax_scale)
            keys = valid  # (B, T, K)
        else:  # over all S keys, the mask keeping the visible (or selected) ones
            target = dsa.attention_target(probs, 1)
            scores = self.indexer.score(q.index, q.index_w, index_k)
            keys = mask.expand(B, T, S)
        return o, dsa.indexer_kl(target, scores, keys)

    def select(self, q, index_k, last):
        """DSA's selection: each query's index_topk best keys among its visible positions 0..last (B or 1,
        T), scored by the indexer over index_k (B, S, Ki) -> idx, valid (B, T, K); or None, None for dense
        attention (dsa_mode "dense", or no more keys than index_topk: top-k would keep them all)."""
        c = self.cfg
        if index_k is None or not self.selects(index_k.shape[1]):  # None: the indexer did not run (dense)
            return None, None
        if c.index_quant == "int8" and index_k.dtype != torch.int8:  # fresh keys: packed as a cache packs
            index_k = dsa.pack_index_keys(index_k)  # (B, S, Di + 4) int8
        return dsa.index_topk(q.index, q.index_w, index_k, last, c.index_topk, self.indexer.softmax_scale)

    def selects(self, S):
        """Whether DSA selects among S keys: the sparse mode and more keys than index_topk (with no more,
        top-k would keep them all: sparse == dense)."""
        return self.cfg.dsa_mode == "sparse" and S > self.cfg.index_topk

    def naive_attention(self, q_nope, q_pe, latent, mask, need_probs):
        """MHA form: expand the latents (B, S, C + R) into per-head keys and values with kv_b_proj and
        attend under `mask` (B or 1, T, S). Returns o (B, T, H, v) and, if asked, probs (B, H, T, S)."""
        c = self.cfg
        B, T, H, _ = q_nope.shape
        c_kv, k_pe = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, -1, H, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # (B, S, H, *)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, H, -1)], dim=-1)  # (B, S, H, qk_head_dim)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, T, H, qk_head_dim)
        if not need_probs:  # the fused kernel; the KL needs the probabilities, so it takes the einsums
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask[:, None],
                scale=self.softmax_scale,
            )
            return o.transpose(1, 2), None
        scores = torch.einsum("bthd,bshd->bhts", q, k)
        scores = (upcast(scores) * self.softmax_scale).masked_fill(~mask[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)  # (B, H, T, S)
        return torch.einsum("bhts,bshv->bthv", probs.to(v.dtype), v), probs

    def absorbed_attention(self, q_abs, q_pe, latent, mask):
        """MQA form over all the latents (B, S, C + R) under `mask` (B or 1, T, S): every head scores the
        same latents, [q_abs | q_pe] . [c_kv | k_pe], and reads back c_kv. q_abs (B, T, H, C) already holds
        W_UK. Returns o_lat (B, T, H, C), before W_UV, and probs (B, H, T, S)."""
        c_kv, k_pe = latent.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        scores = torch.einsum("bthc,bsc->bhts", q_abs, c_kv) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
        scores = (upcast(scores) * self.softmax_scale).masked_fill(~mask[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)  # (B, H, T, S)
        return torch.einsum("bhts,bsc->bthc", probs.to(c_kv.dtype), c_kv), probs
