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
(absorbed == naive, cached decoding == the full forward, the dense decode GEMMs == the einsums, RoPE and
RMSNorm against their written-out references, and the whole model against an independent implementation).
Honest limits: plain torch (SDPA for the naive form without the KL) except DSA's selection and sparse
attention, which dsa.py runs as Triton kernels on a GPU; attend_each_row is a Python loop over the
rows, taken on a CPU only (paged_cache.SPAN_MIN_BYTES).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import dsa
import linear
from dsa import upcast

# -----------------------------------------------------------------------------
# Linear, norms and RoPE


class Linear(linear.Linear):
    """nn.Linear (through linear.py's CPU inference path) minus its own initialisation: GLM5.init_weights
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
#   attention over the latents themselves (MLA.over_latents, MLA.absorbed_attention); a dense decode step as
#   two GEMMs over the latents (MLA.decode_attention).
#
# With DSA selecting (config.dsa_mode "sparse"), MLA.select takes each query's index_topk keys from the
# indexer's scores; the absorbed form then reads only those latents (dsa.sparse_mla) and the naive form masks
# the rest to -inf (its dense reference). MLA.attend also builds the indexer KL of the dense warm-up and the
# sparse stage from the attention that ran.
#
# MLA.forward runs the projections and the cache write; MLA.attend the attention over the keys. Over
# paged_cache.py's page pool the keys are read in place, for all rows at once or, for a batch of long rows,
# each row alone over its own stretch of the pool (MLA.attend_each_row).


class MLA(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
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

    def forward(self, x, cos, sin, positions, cache=None, layer_id=0, form=None, want_kl=False):
        """x (B, T, D); positions (B, T). With a cache, this step's latents are written at `positions`
        and attention runs over everything cached so far.

        form: "naive" (MHA: expand every latent into per-head keys and values) or "absorb" (MQA: fold
        W_UK into the query and W_UV into the output, attend over the latents). With DSA selecting, the
        absorbed form reads only each query's selected latents (the real sparse computation) and the naive
        form masks everything else to -inf (its dense reference). Default: absorbed with a cache or a
        selection, naive otherwise (dense training). want_kl: also return the indexer's KL to this
        attention (else None). Returns (out (B, T, D), kl)."""
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

        # the indexer; when its KL is trained its inputs are detached, so only that loss reaches it
        sparse = c.dsa_mode == "sparse"
        iq = iw = index_k = None
        if sparse or want_kl or cache is not None:
            ix, iq_lat = (x.detach(), q_lat.detach()) if want_kl else (x, q_lat)
            iq, index_k, iw = self.indexer(ix, iq_lat, rope)  # (B, T, Hi, Di), (B, T, Di), (B, T, Hi)

        # the keys: this step's, or everything cached so far; query t sees key positions 0..last[t]
        rows = None  # a paged cache read in place: (B, S) pool row of each row's positions
        if cache is None:
            last = torch.arange(T, device=x.device)[None]  # (1, T)
            o, kl = self.attend(q_nope, q_pe, iq, iw, latent, index_k, rows, last, form, want_kl, False)
            return self.o_proj(o.reshape(B, T, H * c.v_head_dim)), kl
        latent_all, index_k_all = cache.write(layer_id, positions, latent, index_k)  # (B, S, ...)
        rows = getattr(cache, "rows", None)  # set: latent_all (N, C + R), index_k_all (N, Ki) pools
        spans = getattr(cache, "spans", None)  # set: the same pools, each row read alone
        if (index_k_all.dtype == torch.int8) != (c.index_quant == "int8"):
            raise ValueError(
                f"the cache holds {index_k_all.dtype} index keys but config.index_quant is "
                f"{c.index_quant!r}; set index_quant before building the cache (or the Engine)"
            )
        needs_history = want_kl or (form or "absorb") == "naive"
        if needs_history and spans is not None:
            rows = cache.history_rows()  # (B, S) each position's pool row
            spans = None
        if needs_history and rows is not None:  # these read every row's history, gathered as one batch
            latent_all, index_k_all, rows = latent_all[rows], index_k_all[rows], None
        work = None
        if T == 1:  # decode: a paged cache's buffers, reused across steps (dsa.reused)
            work = getattr(cache, "work", None)
        if spans is None:
            o, kl = self.attend(
                q_nope, q_pe, iq, iw, latent_all, index_k_all, rows, positions, form, want_kl, True, work
            )
            return self.o_proj(o.reshape(B, T, H * c.v_head_dim)), kl
        o = self.attend_each_row(q_nope, q_pe, iq, iw, latent_all, index_k_all, spans, positions, work)
        return self.o_proj(o.reshape(B, T, H * c.v_head_dim)), None

    def attend(
        self, q_nope, q_pe, iq, iw, latent_all, index_k_all, rows, last, form, want_kl, cached, work=None
    ):
        """Attention over the keys, after the projections: q_nope (B, T, H, nope), q_pe (B, T, H, R) roped,
        the indexer's iq (B, T, Hi, Di) and iw (B, T, Hi) (None when it does not run); latent_all and
        index_k_all (B, S, ...) the keys, or with rows (B, S) set a page pool (N, ...) read in place;
        query t sees key positions 0..last[t], last (B or 1, T). cached: the keys come from a cache (the
        absorbed form is then the default). work: a paged cache's reused buffers (dsa.reused).
        Returns o (B, T, H, v) before o_proj, and the indexer KL (want_kl) or None."""
        B, T, H, _ = q_nope.shape
        S = latent_all.shape[1] if rows is None else rows.shape[1]
        visible, idx, valid = self.select(iq, iw, index_k_all, rows, last, S, work)  # idx None: dense
        selecting = idx is not None
        form = form or ("absorb" if selecting or cached else "naive")
        if form not in ("naive", "absorb"):
            raise ValueError(f"MLA form must be 'naive' or 'absorb', got {form!r}")

        if form == "naive":
            mask = dsa.selection_mask(idx, valid, S) if selecting else visible  # (B or 1, T, S)
            o, probs = self.naive_attention(q_nope, q_pe, latent_all, mask, need_probs=want_kl)
        else:
            w_uk, w_uv = self.w_uk_uv()
            q_abs = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)  # (B, T, H, C)
            o_lat, lse, probs, mask = self.over_latents(
                q_abs, q_pe, latent_all, rows, idx, valid, visible, work
            )
            o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)  # fold W_UV into the output: (B, T, H, v)
        if not want_kl:
            return o, None

        # the indexer KL: the main attention's distribution (summed over heads) against the indexer's,
        # over the keys this attention saw (dense warm-up: every visible key; sparse stage: the selection)
        if index_k_all.dtype == torch.int8:  # an int8 cache's history: the keys as the selection saw them
            index_k_all = dsa.dequantize_index_keys(index_k_all)  # (no gradient; training runs uncached)
        if selecting and form == "absorb":  # over the K selected keys, target rebuilt from the lse
            target = dsa.sparse_mla_target(q_abs, q_pe, latent_all, idx, valid, lse, self.softmax_scale)
            scores = dsa.selected_index_scores(iq, iw, index_k_all, idx, self.indexer.softmax_scale)
            keys = valid  # (B, T, K)
        else:  # over all S keys, the mask keeping the visible (or selected) ones
            target = dsa.attention_target(probs, 1)
            scores = self.indexer.score(iq, iw, index_k_all)
            keys = mask.expand(B, T, S)
        return o, dsa.indexer_kl(target, scores, keys)

    def attend_each_row(self, q_nope, q_pe, iq, iw, latent_all, index_k_all, spans, positions, work):
        """A decode (or MTP verify) step over several long rows of a page pool (PagedCache.point's spans):
        each row attends alone, over its own stretch of the pool read in place (first..stop) or, where its
        pages are scattered, over its gathered history. W_UK and W_UV are applied to every row at once, so
        each weight is still read once a step. q_nope (B, T, H, nope), positions (B, T) -> o (B, T, H, v)."""
        w_uk, w_uv = self.w_uk_uv()
        q_abs = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)  # (B, T, H, C)
        o_lat = []
        for b, (first, stop, rows_b) in enumerate(spans):
            one = slice(b, b + 1)
            S_b = rows_b.shape[1]  # this row's history length
            if first is None:  # its pages scattered: its history gathered, (1, S_b, ...)
                lat_b, key_b, rows_b = latent_all[rows_b], index_k_all[rows_b], None
            else:
                lat_b, key_b = latent_all[first:stop], index_k_all[first:stop]  # views of the pool
            visible, idx, valid = self.select(iq[one], iw[one], key_b, rows_b, positions[one], S_b, work)
            o_b = self.over_latents(q_abs[one], q_pe[one], lat_b, rows_b, idx, valid, visible, work)[0]
            o_lat.append(o_b)  # (1, T, H, C)
        return torch.einsum("bthc,hvc->bthv", torch.cat(o_lat), w_uv)  # (B, T, H, v)

    def select(self, iq, iw, index_k_all, rows, last, S, work=None):
        """The keys each query attends to: positions 0..last (B or 1, T) of S are visible, and with DSA
        selecting, its index_topk best among them, scored over the index keys (B, S, Ki), or with rows
        (B, S) set over a pool's (N, Ki) in place -> visible (B or 1, T, S), and idx, valid (B, T, K)
        (positions, or pool rows when reading a pool in place), or None, None for dense attention."""
        c = self.cfg
        visible = torch.arange(S, device=last.device) <= last[..., None]  # (B or 1, T, S)
        # DSA: with no more visible keys than index_topk, top-k would keep them all: sparse == dense
        if c.dsa_mode != "sparse" or S <= c.index_topk:
            return visible, None, None
        keys = index_k_all
        if c.index_quant == "int8" and keys.dtype != torch.int8:  # fresh keys: packed as a cache packs
            keys = dsa.pack_index_keys(keys)  # (B, S, Di + 4) int8
        idx, valid = dsa.index_topk(iq, iw, keys, last, c.index_topk, self.indexer.softmax_scale, rows, work)
        return visible, idx, valid

    def over_latents(self, q_abs, q_pe, latent_all, rows, idx, valid, visible, work=None):
        """The absorbed form's attention, W_UK already folded into q_abs (B, T, H, C): over each query's
        selected latents (idx, valid from select) or, idx None, over every visible one (visible (B or 1,
        T, S)), of latent_all (B, S, C + R) or, with rows (B, S) set, of a pool (N, C + R) read in place.
        -> o_lat (B, T, H, C) before W_UV, and for the indexer KL: lse (B, T, H) when selecting, else
        probs (B, H, T, S or N) and the mask they were taken under."""
        B, T = q_abs.shape[:2]
        if idx is not None:  # each query reads only its K selected latents (Triton on a GPU)
            pool = latent_all if rows is None else latent_all[None].expand(B, -1, -1)  # a view
            o_lat, lse = dsa.sparse_mla(q_abs, q_pe, pool, idx, valid, self.softmax_scale, work)
            return o_lat, lse, None, None
        mask = visible
        if rows is not None:  # the visible positions marked at their pool rows: (B, T, N)
            N = latent_all.shape[0]
            where = rows[:, None, :].expand(B, T, rows.shape[1])
            mask = torch.zeros(B, T, N, dtype=torch.bool, device=q_abs.device).scatter_(-1, where, visible)
        o_lat, probs = self.absorbed_attention(q_abs, q_pe, latent_all, mask)
        return o_lat, None, probs, mask

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
        """MQA form over all the latents (B, S, C + R) under `mask` (B or 1, T, S); or over a page pool
        (N, C + R) shared by the rows, read in place, under a (B, T, N) mask of each row's pool rows.
        q_abs (B, T, H, C) already holds W_UK. Returns o_lat (B, T, H, C), before W_UV, and probs.
        A decode step with no gradient (one query per row, one row or a shared pool) takes
        decode_attention."""
        B, T = q_abs.shape[:2]
        if T == 1 and (B == 1 or latent.dim() == 2) and not torch.is_grad_enabled():
            return self.decode_attention(q_abs, q_pe, latent, mask)
        c_kv, k_pe = latent.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        kv = "bsc" if latent.dim() == 3 else "sc"
        kr = "bsr" if latent.dim() == 3 else "sr"
        scores = torch.einsum(f"bthc,{kv}->bhts", q_abs, c_kv) + torch.einsum(f"bthr,{kr}->bhts", q_pe, k_pe)
        scores = (upcast(scores) * self.softmax_scale).masked_fill(~mask[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)  # (B, H, T, S or N)
        return torch.einsum(f"bhts,{kv}->bthc", probs.to(c_kv.dtype), c_kv), probs

    def decode_attention(self, q_abs, q_pe, latent, mask):
        """absorbed_attention for one query per row (T = 1) over one row's latents (B = 1) or over a pool
        every row shares, no gradient: the scores are one GEMM of every row's [q_abs | q_pe] (B H, C + R)
        against the latents as a weight's rows, the output one GEMM of the probabilities back through them
        (all C + R columns, then the first C), both through linear.linear (oneDNN on a CPU), as
        dsa.sparse_scores does for DSA's selected rows; scale, mask and softmax go in place. On a CPU dense
        decode is arithmetic: 2 x 64 heads x (576 + 576) flops per cached latent at GLM-5's shapes. One
        layer's step at 64K (bench_serve.py part 3's layer, interleaved rounds, two runs): 111-125 ms
        through the einsums (MKL's products, the RoPE part apart, five fresh (H, S) temporaries) against
        72-76 ms through this with a fresh softmax output; in the second run 63-71 ms with that fresh output
        (it page-faults in) against 57-61 ms with the softmax in place, as here. Four rows sharing that
        history's pages: 361 ms through the einsums, 179 ms through this. Same results as the einsums to
        fp32 rounding (tests/test_model.py)."""
        B, _, H, C = q_abs.shape
        rows = latent.reshape(-1, latent.shape[-1])  # (S, C + R), or the pool's (N, C + R)
        q = torch.cat([q_abs[:, 0], q_pe[:, 0]], dim=-1).reshape(B * H, -1)  # (B H, C + R)
        scores = upcast(linear.linear(q, rows)).view(B, H, -1)  # (B, H, S or N)
        scores.mul_(self.softmax_scale).masked_fill_(~mask.reshape(mask.shape[0], 1, -1), float("-inf"))
        scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # the softmax, in place
        probs = scores.div_(scores.sum(dim=-1, keepdim=True))  # (B, H, S or N)
        o_lat = linear.linear(probs.view(B * H, -1).to(rows.dtype), rows.t())[:, :C]  # (B H, C)
        return o_lat.view(B, 1, H, C), probs.view(B, H, 1, -1)
