"""
The paged latent cache with prefix caching: the serving engine's memory (engine.py drives it).

What it implements:
- MLA's latent cache (GLM-5 report, section 2; DeepSeek-V2 report, section 2.1): per layer (the main
  layers, then the MTP block) and per token only the latent [c_kv | k_pe] (512 + 64 = 576 values at full
  size) and the DSA indexer's 128-d key (DeepSeek-V3.2 report). PagedCache.attend is the cache call
  mla.MLA.forward makes; it runs absorbed MLA, the indexer over the cached keys, top-k and sparse attention
  over the pages through paged_attention.py.
- Paging (vLLM's PagedAttention paper, Kwon et al. 2023, https://arxiv.org/abs/2309.06180): the pool is
  cut into pages of page_size tokens; a request holds a list of page ids (its page table), so requests of
  any length share one pool without fragmentation. Pages are reference-counted.
- Prefix caching (vLLM's automatic prefix caching; nano-vllm's block_manager.py): a full page is keyed by
  the hash chain of its prefix, so a repeated prefix (the next chat turn, an agent's next step) is shared,
  not prefilled again; unreferenced cached pages are evicted least recently used first.
How attention reads it (in place, row by row, or gathered) is described at PagedCache.point.

Run it through engine.py (python bench/bench_serve.py; python -m pytest -q tests/test_engine.py).

Honest limits: the page bookkeeping (free list, reference counts, hashes) is Python on the host; a row
whose pages are scattered is copied; read in place, a row's dense attention multiplies the other rows of the
pool (or of its stretch) by a probability of exactly 0, so a non-finite latent there (none arises from
finite weights) would reach it, where a gathered row reads only its own; a prefix hash covers token ids
only, so a cache must be flushed when the weights change (flush()).
"""

import collections
import hashlib
import json

import torch

import dsa
import paged_attention


def pool_rows(tables, S, P):
    """Page tables (B, n) -> each row's positions 0..S-1 as rows of the flat pool (pages x P slots):
    (B, S), the position's page times P plus its slot."""
    s = torch.arange(S, device=tables.device)
    return tables[:, s // P] * P + s % P


# A decode step on a CPU reads each row's stretch of the pool alone (PagedCache.span) once some row's
# history holds this many bytes in a layer (latents and index keys): below it, one batched gather costs
# less than a Python loop over the rows. Measured on one layer, 8 rows, fp32 (bench/bench_serve.py part 3's
# machine): at GLM-5's shapes (2.8 KB a token) row by row took 38.5 ms against 40.4 gathered at 1K tokens
# (2.8 MB a row) and 45.9 against 87.7 at 2K; at the toy's (320 bytes a token) 3.2 against 1.7 ms at 2K
# (0.6 MB a row).
# Not on a GPU: there a row's copy takes microseconds and the loop's kernel launches would cost more.
SPAN_MIN_BYTES = 2 * 2**20


class PagedCache:
    """Pages of `page_size` tokens, per layer (main layers, then MTP): the latent [c_kv | k_pe] and the
    indexer key. Before each forward the engine points it at the rows' pages (point); attend() then stores
    each row's new tokens at their positions and attends over each row's history (model.KVCache.attend's
    API)."""

    def __init__(self, cfg, num_pages, page_size, device, dtype, in_place=True):
        L = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch = num_pages  # one extra page, never handed out: padded rows write their padding here
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.kv = torch.zeros(L, num_pages + 1, page_size, latent, device=device, dtype=dtype)
        # the indexer key: index_head_dim floats, or with index_quant "int8" its int8 values and scale
        width, index_dtype = dsa.index_cache_layout(cfg.index_quant, cfg.index_head_dim, dtype)
        self.index_k = torch.zeros(L, num_pages + 1, page_size, width, device=device, dtype=index_dtype)
        self.free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id first
        self.ref = [0] * num_pages  # how many requests use each page
        self.cached = collections.OrderedDict()  # prefix hash -> page id, least recently used first
        self.page_hash = [None] * num_pages
        self.tables = None
        self.length = None  # the furthest position of this forward + 1, set on the host with `tables`
        self.in_place = in_place  # False: always gather each row's history (the reference path)
        self.rows = None
        self.spans = None  # (first, last + 1, rows) per row: a decode step reading each row alone (point)
        # buffers decode steps reuse for the pool's index products and gathers (paged_attention.reused)
        self.work = {}

    # How attention reads the cache: when the pool is at most twice the longest history (one long request, a
    # full server), attention reads the pool in place: DSA scores the index keys in the pool and reads only
    # the selected latent rows, dense attention scores every pool row under a mask; no history is copied. When
    # several long requests share a larger pool, a decode step reads each row alone over its own stretch of
    # the pool, in place the same way (a request's pages are reserved at admission and handed out in ascending
    # order, so they lie together unless the free pages are scattered or a cached prefix sits elsewhere; such
    # a row is gathered). Otherwise (a large pool, short rows) gather() copies each row's history into a
    # (B, S, 576) tensor per layer, which is also the reference path (PagedCache(in_place=False)) the tests
    # hold the in-place one to.
    def point(self, tables, length, ends=None):
        """Before a forward: tables (B, n) page ids per row, length = the furthest position + 1 (a host
        int, so no layer reads positions back from the device). When the pool is at most twice the
        longest history (one long request; a full server), attention reads the pool in place through
        `rows` (B, S), each position's pool row: the pool's scores cost at most twice the rows' own, and
        nothing is copied. Otherwise (a large pool, short rows) gather() copies each row's history.

        ends: each row's history length after this forward (host ints), given for an eager decode step
        (or an MTP draft or verify step, a few tokens a row).
        On a CPU, when the whole pool is too large to read for every row and some row's history reaches
        SPAN_MIN_BYTES (several long requests in one pool), each row is read alone instead, through
        `spans`: a row whose pages lie within a stretch of the pool at most twice its own pages reads
        that stretch in place (its positions' rows relative to the stretch's start); any other row has
        its own history gathered. tables must then be on the host (the engine builds them there)."""
        P = self.page_size
        self.tables = tables.to(self.kv.device)
        self.length = length
        self.rows = None
        self.spans = None
        if self.in_place and self.kv.shape[1] * P <= 2 * length:
            self.rows = pool_rows(self.tables, length, P)  # (B, S)
        elif self.in_place and ends is not None and self.kv.device.type == "cpu":
            token_bytes = self.kv.shape[-1] * self.kv.element_size()
            token_bytes += self.index_k.shape[-1] * self.index_k.element_size()
            if max(ends) * token_bytes >= SPAN_MIN_BYTES:
                self.spans = [self.span(tables[b], end) for b, end in enumerate(ends)]  # the host tables

    def span(self, table, end):
        """One row's page table (n,) on the host and its history length -> (first pool row, last pool row
        + 1, rows (1, end)): its positions' pool rows relative to that first row, when its used pages lie
        within twice their number of consecutive pages (read in place); else (None, None, rows) with the
        absolute pool rows (the row's history is gathered)."""
        P = self.page_size
        used = table[: -(-end // P)]  # (pages,) the pages holding positions 0..end-1
        first, last = int(used.min()), int(used.max())
        rows = pool_rows(used[None].to(self.kv.device), end, P)  # (1, end)
        if last - first + 1 > 2 * len(used):
            return None, None, rows
        return first * P, (last + 1) * P, rows - first * P

    def history_rows(self):
        """Each row's positions 0..length-1 as pool rows (B, S): what gather() copies."""
        return pool_rows(self.tables, self.length, self.page_size)

    def attend(self, mla, q, latent, index_k, positions, form=None, want_kl=False):
        """The one call mla.MLA.forward makes of a cache (model.KVCache.attend's): store this step's latents
        (B, T, C + R) and index keys (B, T, Di) at positions (B, T), then attention over each row's history
        -> (o (B, T, H, v), indexer KL or None). Serving's absorbed form reads the pool as point() chose,
        through paged_attention.py: in place for all rows, row by row, or each history gathered. The naive
        form and the indexer KL run the model's own mla.MLA.attend over the gathered history."""
        layer = mla.layer_id
        dsa.check_cached_keys(self.index_k, mla.cfg.index_quant)
        self.write(layer, positions, latent, index_k)
        kv_pool = self.kv[layer].view(-1, self.kv.shape[-1])  # (N, C + R), N = (pages + 1) x page_size
        index_pool = self.index_k[layer].view(-1, self.index_k.shape[-1])  # (N, Ki)
        if form == "naive" or want_kl:
            rows = self.history_rows()  # (B, S)
            return mla.attend(q, kv_pool[rows], index_pool[rows], positions, form or "absorb", want_kl)
        work = self.work if positions.shape[1] == 1 else None  # decode steps reuse their buffers
        if self.spans is not None:
            o = paged_attention.attend_each_row(mla, q, kv_pool, index_pool, self.spans, positions, work)
        elif self.rows is not None:
            o = paged_attention.attend(mla, q, kv_pool, index_pool, self.rows, positions, work)
        else:
            latent_all, index_k_all = self.gather(layer)  # (B, S, ...)
            o = paged_attention.attend(mla, q, latent_all, index_k_all, None, positions, work)
        return o, None

    def write(self, layer_id, positions, latent, index_k):
        """Store this step's latent (B, T, C + R) and index_k (B, T, index_head_dim) at positions (B, T) of
        each row's pages, as the cache's index key width Ki: index_head_dim, or index_head_dim + 4 packed
        int8 bytes. Each new token's pool place is its row's page at positions // P, slot positions % P,
        written with one index_put_ on the whole pool (layer, page, slot). Written through a view of one
        layer instead, a compiled step copied the whole pool back each step (functionalization)."""
        P = self.page_size
        pages = self.tables.gather(1, positions // P)  # (B, T)
        slots = positions % P  # (B, T)
        layer = pages.new_full((), layer_id)  # broadcast over (B, T)
        self.kv.index_put_((layer, pages, slots), latent.to(self.kv.dtype))
        index_k = dsa.to_index_cache(index_k, self.index_k.dtype)  # (B, T, Ki)
        self.index_k.index_put_((layer, pages, slots), index_k)

    def gather(self, layer_id):
        """Every row's history in this layer, copied out of its pages: (B, S, C + R) and (B, S, Ki)."""
        P = self.page_size
        C, Ki = self.kv.shape[-1], self.index_k.shape[-1]
        S = self.length
        t = self.tables[:, : (S + P - 1) // P]  # (B, n pages)
        B = t.shape[0]
        # compiled, inductor turns the page indexing into its own loop; index_select there made the
        # compiled decode step 1.5x slower (batch 32, bench/bench_serve.py part 0)
        if torch.compiler.is_compiling():
            rows = pool_rows(t, S, P)  # (B, S)
            kv = self.kv[layer_id].view(-1, C)[rows]  # (B, S, C + R)
            index_k = self.index_k[layer_id].view(-1, Ki)[rows]  # (B, S, Ki)
        else:
            kv = self.kv[layer_id].index_select(0, t.flatten()).view(B, -1, C)[:, :S]  # (B, S, C + R)
            index_k = self.index_k[layer_id].index_select(0, t.flatten()).view(B, -1, Ki)[:, :S]  # (B, S, Ki)
        return kv, index_k

    def available(self):
        return len(self.free) + sum(1 for p in self.cached.values() if self.ref[p] == 0)

    def alloc(self, n):
        """n fresh pages (ref 1), evicting unreferenced cached pages LRU-first if the free list is short."""
        assert n <= self.available(), "alloc beyond available(); the engine checks first"
        out = []
        while len(out) < n:
            if not self.free:
                h = next(h for h, p in self.cached.items() if self.ref[p] == 0)  # least recently used
                p = self.cached.pop(h)
                self.page_hash[p] = None
                self.free.append(p)
            p = self.free.pop()
            self.ref[p] = 1
            out.append(p)
        # ascending: a request's pages then lie as one stretch of the pool wherever the free pages do, so a
        # decode step can read it in place (point's spans); the stack alone hands a freed run back reversed
        return sorted(out)

    def release(self, pages):
        for p in pages:
            self.ref[p] -= 1
            if self.ref[p] == 0 and self.page_hash[p] is None:  # a cached page stays until evicted
                self.free.append(p)

    def chain(self, tokens):
        """Hash of each full page of `tokens`, each chained on the one before (a page's key is its prefix)."""
        P = self.page_size
        h = b""
        out = []
        for i in range(len(tokens) // P):
            h = hashlib.sha256(h + json.dumps(tokens[i * P : (i + 1) * P]).encode()).digest()
            out.append(h)
        return out

    def lookup(self, tokens, max_pages):
        """Pages holding the longest cached prefix of `tokens` (at most max_pages), references taken."""
        pages = []
        for h in self.chain(tokens)[:max_pages]:
            p = self.cached.get(h)
            if p is None:
                break
            self.cached.move_to_end(h)
            self.ref[p] += 1
            pages.append(p)
        return pages

    def flush(self):
        """Forget every cached prefix (after a weight update its latents are stale): pages no request
        holds are free at once, the others when their request releases them."""
        for p in self.cached.values():
            self.page_hash[p] = None
            if self.ref[p] == 0:
                self.free.append(p)
        self.cached.clear()

    def register(self, tokens, pages):
        """Make the full pages of `tokens` (whose latents are written in `pages`) findable by lookup()."""
        for h, p in zip(self.chain(tokens), pages):
            if h not in self.cached and self.page_hash[p] is None:
                self.cached[h] = p
                self.page_hash[p] = h

