"""
The serving engine's attention: absorbed MLA with DSA's selection (GLM-5 report, section 2; DeepSeek-V3.2
report, section 2) over paged_cache.py's page pool, the same math as mla.MLA.attend, read the fast way.

This file is the engine's side of the seam between model and engine. mla.MLA.forward makes one call of its
cache, cache.attend(mla, q, latent, index_k, positions, form, want_kl); PagedCache.attend stores the step's
latents in the pages and calls attend() or attend_each_row() here, which take the layer's weights from the
MLA module passed in. What exists only for serving speed lives here, not in the model:
- reading the pool in place (no copy of any row's history) for all rows at once (rows (B, S): each
  position's pool row), or each row alone over its own stretch of the pool (PagedCache.point's spans);
- the pool's index scores as one GEMM with the keys as its rows (oneDNN on a CPU; int8 through
  torch._int_mm for index_quant "int8"), their products in buffers reused across decode steps (reused);
- a decode step's attention as GEMMs through linear.linear (oneDNN on a CPU), dense and sparse;
- the forms inductor compiles well (the engine's compile=True graphs).

Run it through the engine: python -m pytest -q tests/test_engine.py tests/test_paged_attention.py (in place,
row by row and gathered all equal mla.MLA.attend over each row's gathered history; the GEMM paths equal
the einsums to fp32 rounding). Honest limits: the absorbed form only and no indexer KL (the naive form and
the KL run mla.MLA.attend over the gathered history, PagedCache.attend); in place, the pool's scores cost up
to twice the rows' own (a paged attention kernel would read each row's pages only); attend_each_row is a
Python loop over the rows, taken on a CPU only (paged_cache.SPAN_MIN_BYTES).
"""

import functools
import math

import torch

import dsa
import kernels
import linear
from dsa import upcast


def attend(mla, q, latent_all, index_k_all, rows, last, work=None):
    """The absorbed form of mla.MLA.attend: q (mla.Query), the keys latent_all (B, S, C + R) and index_k_all
    (B, S, Ki), or with rows (B, S) set a pool's (N, ...) read in place; query t sees key positions
    0..last[t] (last (B, T)) and, with DSA selecting, its index_topk best among them. work: a paged cache's
    reused buffers (decode steps). -> o (B, T, H, v) before o_proj."""
    S = latent_all.shape[1] if rows is None else rows.shape[1]
    visible = torch.arange(S, device=last.device) <= last[..., None]  # (B, T, S)
    idx, valid = select(mla, q, index_k_all, rows, last, work)  # (B, T, K), or None: dense
    w_uk, w_uv = mla.w_uk_uv()
    q_abs = torch.einsum("bthd,hdc->bthc", q.nope, w_uk)  # (B, T, H, C)
    o_lat = over_latents(mla, q_abs, q.pe, latent_all, rows, idx, valid, visible, work)
    return torch.einsum("bthc,hvc->bthv", o_lat, w_uv)  # (B, T, H, v)


def attend_each_row(mla, q, latent_pool, index_pool, spans, positions, work=None):
    """A decode (or MTP verify) step over several long rows of a page pool (PagedCache.point's spans): each
    row attends alone, over its own stretch of the pool read in place (first..stop) or, where its pages are
    scattered, over its gathered history. W_UK and W_UV are applied to every row at once, so each weight is
    still read once a step. positions (B, T) -> o (B, T, H, v)."""
    w_uk, w_uv = mla.w_uk_uv()
    q_abs = torch.einsum("bthd,hdc->bthc", q.nope, w_uk)  # (B, T, H, C)
    o_lat = []
    for b, (first, stop, rows_b) in enumerate(spans):
        one = slice(b, b + 1)
        S_b = rows_b.shape[1]  # this row's history length
        if first is None:  # its pages scattered: its history gathered, (1, S_b, ...)
            lat_b, key_b, rows_b = latent_pool[rows_b], index_pool[rows_b], None
        else:
            lat_b, key_b = latent_pool[first:stop], index_pool[first:stop]  # views of the pool
        q_b = q._replace(nope=q.nope[one], pe=q.pe[one], index=q.index[one], index_w=q.index_w[one])
        visible = torch.arange(S_b, device=positions.device) <= positions[one, :, None]  # (1, T, S_b)
        idx, valid = select(mla, q_b, key_b, rows_b, positions[one], work)
        o_lat.append(over_latents(mla, q_abs[one], q.pe[one], lat_b, rows_b, idx, valid, visible, work))
    return torch.einsum("bthc,hvc->bthv", torch.cat(o_lat), w_uv)  # (B, T, H, v)


def select(mla, q, index_k_all, rows, last, work=None):
    """mla.MLA.select over the keys (B, S, Ki) or, with rows (B, S) set, a pool's (N, Ki) read in place
    -> idx, valid (B, T, K) (positions, or pool rows when reading in place), or None, None: dense."""
    if rows is None:
        return mla.select(q, index_k_all, last)  # the model's own selection
    if not mla.selects(rows.shape[1]):
        return None, None
    c = mla.cfg
    scale = mla.indexer.softmax_scale
    return index_topk_in_pool(q.index, q.index_w, index_k_all, rows, last, c.index_topk, scale, work)


def index_topk_in_pool(q, w, k_pool, rows, last, topk, softmax_scale, work=None):
    """dsa.index_topk with the keys in a page pool, k_pool (N, Di or Di + 4), position s of row b at pool
    row rows[b, s] (rows (B, S)): the scores are taken over the pool in place (no copy of any row's keys),
    put back in position order (S floats per query, for the tie-breaking), and idx is returned as pool rows.
    On a GPU with float keys the Triton kernel takes each row's keys gathered."""
    B, T = q.shape[:2]
    S = rows.shape[1]
    if kernels.use_triton(q) and k_pool.dtype != torch.int8:  # the kernel takes one key row per position
        idx, valid = dsa.index_topk(q, w, k_pool[rows], last, topk, softmax_scale)
    else:
        with torch.no_grad():
            I = pool_index_scores(q, w, k_pool, softmax_scale, work)  # (B, T, N)
            I = I.gather(-1, rows[:, None, :].expand(B, T, S))  # (B, T, S) in position order
        visible = torch.arange(S, device=I.device) <= last.expand(B, T)[..., None]  # (B, T, S)
        idx, valid = dsa.topk_select(I, visible, min(topk, S))
    return rows.gather(1, idx.flatten(1)).view_as(idx), valid  # positions -> pool rows


def pool_index_scores(q, w, k_pool, softmax_scale, work=None):
    """dsa.index_scores (or quantized_index_scores, for packed int8 keys) over keys (N, Di or Di + 4) every
    row shares, a page pool read in place -> I (B, T, N) fp32. On a CPU one GEMM with the keys as its rows:
    oneDNN's for float keys (linear.py's rule), torch._int_mm for int8 (VNNI / AMX where the CPU has them),
    its products in buffers of `work` reused across steps (see reused); elsewhere one matmul."""
    B, T, Hi, Di = q.shape
    q2 = q.reshape(-1, Di)  # (B T Hi, Di)
    if torch.compiler.is_compiling():  # the graph allocates its own buffers
        work = None
    with dsa.no_autocast(q.device.type):
        if k_pool.dtype == torch.int8:
            k_int, k_scale = dsa.unpack_index_keys(k_pool)  # (N, Di), (N,)
            q_int, q_scale = dsa.quantize_int8(q)  # (B, T, Hi, Di), (B, T, Hi)
            shape = (B * T * Hi, k_int.shape[0])
            if q.device.type == "cpu":  # exact integer dot products, as the einsum's (dsa)
                dots_int = reused(work, "dots_int", shape, torch.int32, q.device)
                torch._int_mm(q_int.reshape(-1, Di), k_int.t(), out=dots_int)
                dots = reused(work, "dots", shape, torch.float32, q.device)
                dots.copy_(dots_int.relu_())
            else:
                dots = (q_int.reshape(-1, Di).float() @ k_int.float().t()).relu_()
            I = torch.einsum("bths,bth->bts", dots.view(B, T, Hi, -1), w.float() * q_scale * softmax_scale)
            return I * k_scale  # (B, T, N)
        k = upcast(k_pool).to(q.dtype)  # (N, Di)
        if linear.uses_onednn(k, q2):  # oneDNN, the keys as the rows
            dots = linear.linear(k, q2).relu_().view(-1, B * T, Hi)  # (N, B T, Hi)
            return torch.einsum("nrh,rh->rn", dots, (w * softmax_scale).reshape(B * T, Hi)).view(B, T, -1)
        if work is None:
            dots = q2 @ k.t()  # (B T Hi, N)
        else:  # one matmul into the reused buffer
            dots = reused(work, "dots", (B * T * Hi, k.shape[0]), q.dtype, q.device)
            torch.matmul(q2, k.t(), out=dots)
        return torch.einsum("bths,bth->bts", dots.view(B, T, Hi, -1).relu_(), w * softmax_scale)


def over_latents(mla, q_abs, q_pe, latent_all, rows, idx, valid, visible, work=None):
    """The absorbed form's attention, W_UK already folded into q_abs (B, T, H, C): over each query's
    selected latents (idx, valid from select) or, idx None, over every visible one (visible (B, T, S)), of
    latent_all (B, S, C + R) or, with rows (B, S) set, of a pool (N, C + R) read in place -> o_lat (B, T, H,
    C) before W_UV."""
    B, T = q_abs.shape[:2]
    if idx is not None:  # each query reads only its K selected latents (Triton on a GPU)
        pool = latent_all if rows is None else latent_all[None].expand(B, -1, -1)  # a view
        return sparse_mla(q_abs, q_pe, pool, idx, valid, mla.softmax_scale, work)
    mask = visible
    if rows is not None:  # the visible positions marked at their pool rows: (B, T, N)
        N = latent_all.shape[0]
        where = rows[:, None, :].expand(B, T, rows.shape[1])
        mask = torch.zeros(B, T, N, dtype=torch.bool, device=q_abs.device).scatter_(-1, where, visible)
    decode = T == 1 and (B == 1 or rows is not None)  # one query a row over one row's latents or a pool
    if decode and not torch.is_grad_enabled():
        return decode_attention(q_abs, q_pe, latent_all, mask, mla.softmax_scale)
    if rows is None:
        return mla.absorbed_attention(q_abs, q_pe, latent_all, mask)[0]
    c_kv, k_pe = latent_all.split([q_abs.shape[-1], q_pe.shape[-1]], dim=-1)  # (N, C), (N, R)
    scores = torch.einsum("bthc,nc->bhtn", q_abs, c_kv) + torch.einsum("bthr,nr->bhtn", q_pe, k_pe)
    scores = (upcast(scores) * mla.softmax_scale).masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhtn,nc->bthc", scores.softmax(dim=-1).to(c_kv.dtype), c_kv)  # (B, T, H, C)


def decode_attention(q_abs, q_pe, latent, mask, softmax_scale):
    """mla.MLA.absorbed_attention for one query per row (T = 1) over one row's latents (B = 1) or over a
    pool every row shares: the scores are one GEMM of every row's [q_abs | q_pe] (B H, C + R) against the
    latents as a weight's rows, the output one GEMM of the probabilities back through them (all C + R
    columns, then the first C), both through linear.linear (oneDNN on a CPU), the softmax in place. On a CPU
    dense decode is arithmetic (2 x 64 heads x (576 + 576) flops per cached latent at GLM-5's shapes), and
    this took about half the einsums' time at 64K tokens (docs/design-notes.md). -> o_lat (B, 1, H, C)."""
    B, _, H, C = q_abs.shape
    rows = latent.reshape(-1, latent.shape[-1])  # (S, C + R), or the pool's (N, C + R)
    q = torch.cat([q_abs[:, 0], q_pe[:, 0]], dim=-1).reshape(B * H, -1)  # (B H, C + R)
    scores = upcast(linear.linear(q, rows)).view(B, H, -1)  # (B, H, S or N)
    scores.mul_(softmax_scale).masked_fill_(~mask.reshape(mask.shape[0], 1, -1), float("-inf"))
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # the softmax, in place
    probs = scores.div_(scores.sum(dim=-1, keepdim=True))  # (B, H, S or N)
    o_lat = linear.linear(probs.view(B * H, -1).to(rows.dtype), rows.t())[:, :C]  # (B H, C)
    return o_lat.view(B, 1, H, C)


def sparse_mla(q_abs, q_pe, latent, idx, valid, softmax_scale, work=None):
    """dsa.sparse_mla's output, o_lat (B, T, H, C), with no gradient and no lse: the Triton kernel on a GPU;
    on a CPU the selected rows gathered (into a buffer of `work`), and one query (a decode step of one row)
    scored and read back as two linear.linear GEMMs against them (oneDNN: about half the einsums' time at
    GLM-5's 64 heads x 2,048 selected rows). latent (B, S, C + R) or an expanded pool (batch stride 0)."""
    if kernels.use_triton(q_abs):
        return dsa.sparse_mla(q_abs, q_pe, latent, idx, valid, softmax_scale)[0]
    B, T, H, C = q_abs.shape
    gather = functools.partial(gather_rows, work=work)
    if B * T > 1:  # dsa's einsums over the rows this file's gather selects
        return dsa.sparse_mla_torch(q_abs, q_pe, latent, idx, valid, softmax_scale, gather)[0]
    sel = gather(latent, idx)  # (1, 1, K, C + R)
    q = torch.cat([q_abs[0, 0], q_pe[0, 0]], dim=-1)  # (H, C + R)
    scores = upcast(linear.linear(q, sel[0, 0])) * softmax_scale  # (H, K)
    probs = scores.masked_fill(~valid[0, 0], float("-inf")).softmax(dim=-1).to(sel.dtype)  # (H, K)
    return linear.linear(probs, sel[0, 0].t())[None, None, :, :C]  # all C + R columns, then C: (1, 1, H, C)


def gather_rows(latent, idx, work=None):
    """dsa.gather_rows for serving: latent (B, S, F), idx (B, T, K) -> (B, T, K, F). A page pool shared by
    every row (an expanded view, batch stride 0; idx are pool rows) or a single row is selected from
    directly, into a buffer of `work` when one is given; inside torch.compile, indexing with two index
    tensors, for which inductor writes its own loop (index_select there made a compiled decode step slower,
    as in PagedCache.gather)."""
    B, S, F = latent.shape
    if torch.compiler.is_compiling():
        return latent[torch.arange(B, device=idx.device)[:, None, None], idx]
    if latent.stride(0) == 0 or B == 1:
        out = reused(work, "selected", (idx.numel(), F), latent.dtype, latent.device)
        return torch.index_select(latent[0], 0, idx.flatten(), out=out).view(*idx.shape, F)
    return dsa.gather_rows(latent, idx)


WORK_MAX_BYTES = 64 * 2**20  # a reused buffer's most: bigger ones (wide batches) stay temporaries


def reused(work, name, shape, dtype, device):
    """An uninitialised `shape` tensor: the buffer `work[name]` (grown when too small, kept) where `work` is a
    dict and the tensor at most WORK_MAX_BYTES, a fresh tensor otherwise. A paged cache holds one such dict
    (PagedCache.work) for its decode steps, which write their (Hi, N) index products (8 MB per row at 64K
    tokens in int8) and their 2,048 gathered latents into the same memory every layer and step: a fresh
    tensor that size costs more than the product filling it, as glibc maps large blocks from the OS and hands
    them back on free, so each step page-faults them in again (docs/design-notes.md)."""
    n = math.prod(shape)
    if work is None or n * dtype.itemsize > WORK_MAX_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = work.get(name)
    if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
        buf = torch.empty(n, dtype=dtype, device=device)
        work[name] = buf
    return buf[:n].view(shape)
