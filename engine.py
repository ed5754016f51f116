"""
The inference engine: continuous batching over a paged latent cache, with MTP speculative decoding (a very
small vLLM; Orca, Yu et al. 2022). serve.py puts the OpenAI-compatible server on top; paged_cache.py holds
the memory (the MLA latent and index key per token, prefix caching); sampling.py turns logits into tokens.
- MLA and DSA at inference (GLM-5 report, section 2; DeepSeek-V3.2 report): absorbed MLA, the indexer over
  the cached keys, top-k and sparse attention, over the page pool.
- Speculative decoding with the MTP block (GLM-5 report, section 2; DeepSeek-V3 report, section 2.2): the
  block drafts N tokens, one forward verifies them, sampling.accept_drafts keeps a prefix, so the output is
  distributed exactly as without drafts; the block reads the main stack's output after model.norm and
  carries its own after shared_head.norm, the contract of the released weights (model.MTPBlock).
- Weight updates for RL rollouts (the report's asynchronous RL infrastructure; SGLang's
  update_weights_from_disk; AReaL's interruptible rollouts): between two steps, under the step lock; requests
  in flight recompute their cache on the new weights and tag every token with the version that sampled it.

Run it:
    python serve.py --ckpt out/ckpt.pt --spec 3     # the server, with 3 drafted tokens per step
    python bench/bench_serve.py                      # throughput, MTP accept length, DSA vs dense
Tests: python -m pytest -q tests/test_engine.py
Honest limits: a long prompt's chunks all run in the step that admits it (vLLM interleaves them); pages for
prompt + max_tokens are reserved at admission (no preemption); one process, one device; compile=True leaves
the MTP drafts and the sampling eager, and equals the eager path token for token, not bit for bit; drafts
2..N reuse the MTP block's cache slots at the next positions (fewer accepted, never another output); a
weight update holds two copies of the weights while it loads and comes from disk only.
"""

import collections
import dataclasses
import hashlib
import os
import queue
import sys
import threading
import time
import uuid

import torch

import chat
import linear
import model as glm
import sampling
import weights
from paged_cache import PagedCache

# -----------------------------------------------------------------------------
# Loading: a train.py checkpoint (out/ckpt.pt) or a save_pretrained / GLM-5 directory


def load_model(path, device="cpu", dtype=None):
    """-> GLM5 in eval mode. A file is read as train.py's checkpoint dict (our own files only: torch.load
    with weights_only=False); a directory as config.json + safetensors, through quantized.py when its
    config.json has a quantization_config (quantize.py's W4A8 / W8A8 checkpoints)."""
    import quantized  # here, not at the top: only load_model needs it

    if os.path.isdir(path) and quantized.is_quantized(path):  # quantize.py's W4A8 / W8A8 checkpoints
        m = quantized.from_pretrained(path, dtype=dtype, device=device)
    elif os.path.isdir(path):
        m = weights.from_pretrained(path, dtype=dtype, device=device)
    elif os.path.isfile(path):
        ck = torch.load(path, map_location="cpu", weights_only=False)
        if not (isinstance(ck, dict) and "model" in ck and "config" in ck):
            raise ValueError(
                f"{path} is not a train.py checkpoint (no 'model' and 'config'); "
                "pass ckpt.pt or a save_pretrained directory"
            )
        m = glm.GLM5(glm.ModelConfig(**ck["config"]["model"]))
        m.load_state_dict(ck["model"])
        stage = ck["config"].get("train", {}).get("stage")
        chat_trained = stage == "sft" or str(stage).startswith("rl_")  # SFT, or RL after it (rl_async.py)
        if stage and not chat_trained:  # a newcomer's first try is to chat with the pretrained toy
            print(
                f"note: {path} is a {stage} checkpoint: it continues text and never learned the chat format, "
                "so chat replies will not be answers; chat with a stage sft checkpoint (README: the stages)",
                file=sys.stderr,
            )
        m = m.to(device=device, dtype=dtype or torch.float32)
    else:
        raise FileNotFoundError(
            f"no checkpoint at {path}; pass out/ckpt.pt (train.py) or a save_pretrained directory"
        )
    return m.eval()


# -----------------------------------------------------------------------------
# Scheduling: which admitted rows prefill together


def module_guards_filter(entries):
    """torch.compile's guard filter for the engine's graphs: drop the guards on the model's modules (their
    parameters' ids, shapes and strides, their int attributes; ~1,400 checks, 0.35 ms of a 3.5 ms
    batch-32 step on a CPU) except the ones that change what the graph computes: the config's fields
    (dsa_mode, index_quant, ...) and `training`. The weights may change in place (update_weights copies
    into them), never their shapes within an Engine; the graphs are shared by every Engine in the process
    (they belong to the code), so Engine.layers reads Engine.signature, its model's parameter names, shapes
    and dtypes, and that guard keeps a graph of one model from running another's weights."""
    keep = []
    for e in entries:
        on_module = e.orig_guard.source.is_unspecialized_nn_module()
        keep.append(not on_module or ".cfg" in e.name or ".config" in e.name or ".training" in e.name)
    return keep


def weights_signature(model):
    """A short digest of what the dropped module guards checked: every parameter's and buffer's name, shape,
    dtype and device (quantized weights live in buffers), each module's class, and the config (eps,
    scales and sizes come from it). Taken when the Engine is built: a model changed after that (cast,
    quantized) needs a new Engine."""
    parts = [f"{n}:{tuple(t.shape)}:{t.dtype}:{t.device}" for n, t in model.state_dict().items()]
    parts += [f"{n}:{type(mod).__name__}" for n, mod in model.named_modules()]
    parts.append(repr(model.config))
    return hashlib.sha1(";".join(parts).encode()).hexdigest()[:16]


def decode_bucket(n, max_batch):
    """A compiled decode step's batch size for n rows: the next power of two, at most max_batch. Padding a
    step of n rows up to it keeps the graphs to about log2(max_batch) (1, 2, 4, .., 32)."""
    return min(1 << (n - 1).bit_length(), max(max_batch, n))


def similar_lengths(rows, lengths, chunk, waste=0.25):
    """Split rows into groups to prefill together, longest first: a row joins the current group while
    the group's right padding stays within `waste` of its real tokens (lengths capped at `chunk`, the
    most one forward takes per row). Equal lengths make one group; 16 and 128 tokens do not."""
    order = sorted(range(len(rows)), key=lambda i: -min(lengths[i], chunk))
    groups = []
    for i in order:
        n = min(lengths[i], chunk)
        if groups:
            g, longest, real = groups[-1]
            if (len(g) + 1) * longest <= (1 + waste) * (real + n):
                groups[-1] = (g + [rows[i]], longest, real + n)
                continue
        groups.append(([rows[i]], n, n))
    return [g for g, _, _ in groups]


# -----------------------------------------------------------------------------
# Requests


class EngineFull(Exception):
    pass


class VersionConflict(ValueError):
    """A weight update whose version is not above the current one (the server answers 409)."""


class Request:
    """One prompt's life in the engine. Handler threads read it while the engine thread writes it:
    `events` says when (("tokens", n) per step, then ("done", n)); `text` is only ever assigned whole."""

    def __init__(self, prompt, sp, stop_ids):
        self.id = uuid.uuid4().hex[:12]
        self.prompt = list(prompt)
        self.sp = sp
        self.stop_ids = stop_ids
        self.out = []  # generated ids
        self.logprobs = []  # their logprobs
        self.versions = []  # per token: the policy version of the weights that sampled it
        self.top = []  # per token: the top sp.logprobs alternatives as (id, logprob)
        self.pages = []
        self.n_cached = 0  # prompt tokens found in the prefix cache
        self.finish = None  # "stop", "length", "abort" or "error"
        self.error = None
        self.aborted = False  # set by the client's thread; the engine finishes it at the next step
        self.stop_str = None  # the stop string that ended it, if one did
        self.text = ""  # the decoded output so far, cut at a stop string
        self.events = queue.Queue()
        seed = self.sp.seed if sp.seed is not None else int.from_bytes(os.urandom(6), "little")
        self.gen = torch.Generator().manual_seed(seed)
        self.accepted = []  # tokens appended per speculative step
        self.h_mtp = None  # MTP state: the block's last output after shared_head.norm (D,) ...
        self.draft_logits = None  # ... and the logits (V,) of the next first draft

    @property
    def tokens(self):
        return self.prompt + self.out


# -----------------------------------------------------------------------------
# The engine


# How a step runs. submit() -> waiting queue -> [admit: prefix-cache lookup, reserve pages, prefill] ->
# running batch -> one batched decode step per iteration (or MTP drafts + one verify forward) -> finished.
# Prefill is batched: every request admitted in a step is prefilled in that step, rows of similar length
# right-padded into one forward (the padding writes to a scratch page), prompts longer than prefill_chunk in
# chunks. Sampling is batched over the rows (one host sync per step); the model's forward itself never reads
# a value back (the cache's length is set on the host).
#
# Engine(compile=True) (serve.py --compile) runs the forwards through torch.compile (Ansel et al. 2024):
# the plain decode step with the batch padded up to a power of two (decode_bucket; padding rows write to the
# scratch page), so one graph per bucket serves every batch, the history's length a dynamic dimension; and
# the main stack of the prefill and verify forwards, whose batch and length turn dynamic at the first new
# shape (the page tables padded to a fixed width). The graphs keep the guards on the config (dsa_mode,
# index_quant) and drop those on the weights (module_guards_filter). The cache is written with index_put_
# on the whole pool, which inductor does in place (through a view of one layer's pages each compiled step
# copied the whole pool back). warm_up builds the graphs (about ten: one row and several, histories on both
# sides of index_topk); on a CPU the decode graphs compute the routed experts per (token, expert) pair
# (experts.experts_pairs) up to 4 rows per expert on average, and a larger bucket takes the grouped GEMM in
# a graph warm_up does not build.
#
# Weight updates: update_weights() reads a save_pretrained directory on the side, then between two steps
# copies it in, makes the new version current and flushes the prefix cache (its pages hold latents of the
# old weights). Versions only increase; step() and the swap share one lock. Requests in flight continue on
# the new weights, as AReaL's interruptible rollouts and SGLang's pause_generation(mode="retract") do: their
# cache is recomputed with one prefill (SGLang can also keep the stale cache or abort).


class Engine:
    """Continuous batching over a PagedCache. submit() from any thread; step() from one thread."""

    def __init__(
        self,
        model,
        tok,
        num_pages=512,
        page_size=16,
        max_batch=32,
        max_model_len=None,
        spec_tokens=0,
        prefix_cache=True,
        max_waiting=256,
        default_max_tokens=1024,
        version=0,
        prefill_chunk=512,
        in_place=True,
        compile=False,
    ):
        self.model = linear.use_onednn(model)  # its projections through oneDNN on a CPU (linear.py)
        self.tok = tok
        self.cfg = model.config
        p = next(model.parameters())
        self.device = p.device
        self.cache = PagedCache(self.cfg, num_pages, page_size, p.device, p.dtype, in_place)
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.default_max_tokens = default_max_tokens  # chat without max_tokens (pages are reserved up front)
        limit = self.cfg.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        if spec_tokens and not model.mtp_layers:
            raise ValueError("--spec needs a checkpoint with an MTP block (num_nextn_predict_layers >= 1)")
        self.spec = spec_tokens
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk  # prompt tokens per row per prefill forward (longer: chunks)
        eos = [i for i in self.cfg.eos_token_id if i < self.cfg.vocab_size]
        eos += [tok.special_tokens[s] for s in chat.STOP_TOKENS if s in tok.special_tokens]
        self.stop_ids = set(eos)
        self.waiting = collections.deque()
        self.running = []
        self.cond = threading.Condition()
        self.stats = collections.Counter()  # prefill_tokens, cached_tokens, decode_steps, recomputed_tokens
        self.version = version  # the policy version of the weights in use; it only increases
        self.step_lock = threading.Lock()  # held by step(); a weight update swaps between two steps
        # compile: decode_hidden and layers (the prefill's and verify's forward) through torch.compile
        # (inductor), else None and both run eager
        self.compiled = None
        self.compiled_layers = None
        self.signature = weights_signature(model)
        # a compiled forward's page tables are this wide (a row's most pages, drafts included), so the
        # page count never recompiles a graph
        self.table_width = -(-(self.max_model_len + 1 + self.spec) // self.cache.page_size)
        if compile:
            # decode: one graph per batch bucket; the history's length is a dynamic dimension, not a
            # recompile. Prefill: its batch and length turn dynamic at the first new shape.
            # On a CPU, cpp_wrapper makes inductor call its kernels from generated C++ instead of Python:
            # a toy step is ~140 small ops, and that took batch 1 from 4.3 to 3.1-3.5 ms a step
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            self.compiled = torch.compile(self.decode_hidden, dynamic=None, options=self.compile_options())
            # a fresh dict each: torch.compile pops guard_filter_fn out of the one it is given
            self.compiled_layers = torch.compile(self.layers, dynamic=None, options=self.compile_options())

    def compile_options(self):
        """torch.compile's options for the engine's graphs (a new dict per call)."""
        options = {"guard_filter_fn": module_guards_filter}
        if self.device.type == "cpu":
            options["cpp_wrapper"] = True
        return options

    # --- submission ---------------------------------------------------------------------

    def check(self, prompt, sp):
        """A ValueError naming the problem, for a request that can never run."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.cfg.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but this model's context is {self.max_model_len}; "
                "shorten it"
            )
        if self.pages_needed(len(prompt), sp) > self.cache.num_pages:
            raise ValueError(
                f"prompt + max_tokens need more cache pages than the server has ({self.cache.num_pages}); "
                "lower max_tokens"
            )

    def pages_needed(self, n_prompt, sp):
        n = min(n_prompt + sp.max_tokens, self.max_model_len)
        if self.spec:
            n += self.spec + 1  # a verify forward writes the drafts past the last kept token
        return -(-n // self.cache.page_size)

    def submit(self, prompt, sp):
        self.check(prompt, sp)
        r = Request(prompt, sp, set() if sp.ignore_eos else self.stop_ids)
        with self.cond:
            if len(self.waiting) >= self.max_waiting:
                raise EngineFull(f"the server is full ({len(self.waiting)} requests waiting); retry later")
            self.waiting.append(r)
            self.cond.notify()
        return r

    # --- one iteration ------------------------------------------------------------------

    @torch.no_grad()
    def step(self):
        """Schedule (drop aborted requests, admit and prefill waiting ones while the batch and the cache
        allow), run one decode step for every running request (plain, or MTP drafts and one verify
        forward), and append its tokens. -> the number of requests still in the engine."""
        with self.step_lock:
            self.drop_aborted()
            self.admit_waiting()
            rows = list(self.running)  # a copy: finish() edits self.running
            if rows and self.spec:
                self.spec_step(rows)
            elif rows:
                self.decode_step(rows)
            return len(self.running) + len(self.waiting)

    # --- scheduling ---------------------------------------------------------------------

    def drop_aborted(self):
        """Clients that hung up leave now, waiting ones too (else they fill the queue: 503s)."""
        with self.cond:
            gone = [r for r in list(self.waiting) + self.running if r.aborted]
            self.waiting = collections.deque(r for r in self.waiting if not r.aborted)
        for r in gone:
            self.finish(r, "abort")

    def admit_waiting(self):
        """Reserve pages for waiting requests in order, stopping at the first one the free pages cannot
        hold yet, then prefill every admitted prompt together (prefill())."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            with self.cond:
                r = self.waiting.popleft()
            if not self.reserve(r):  # it waits, first in line, for running requests to finish
                with self.cond:
                    self.waiting.appendleft(r)
                break
            admitted.append(r)
        if admitted:
            self.prefill(admitted)

    def reserve(self, r):
        """Reserve r's pages, reusing cached prefix pages. -> False, holding nothing, if too few are free."""
        cache = self.cache
        P = cache.page_size
        need = self.pages_needed(len(r.prompt), r.sp)
        hit = []
        if self.prefix_cache:  # a hit must leave at least one prompt token to prefill: its logits
            hit = cache.lookup(r.prompt, (len(r.prompt) - 1) // P)
        if need - len(hit) > cache.available():
            cache.release(hit)
            return False
        r.pages = hit + cache.alloc(need - len(hit))
        r.n_cached = len(hit) * P
        self.running.append(r)
        self.stats["cached_tokens"] += r.n_cached
        self.stats["prefill_tokens"] += len(r.prompt) - r.n_cached
        return True

    def prefill(self, rows):
        """Prefill these requests' prompts (past their cached prefix) and sample each one's first token.
        Batched: rows of similar length share a right-padded forward; a prompt longer than prefill_chunk
        goes in chunks, one forward per chunk. If a batched forward fails, each of its rows is retried
        alone, so a prompt that cannot be prefilled fails alone and the others go on."""
        done = set()
        try:
            self.prefill_rows(rows, done)
        except Exception as e:
            if len(rows) == 1:
                return self.fail(rows[0], e)
            for r in rows:
                if r.finish is None and id(r) not in done and r.out:  # it failed past its first token
                    self.fail(r, e)
                elif r.finish is None and id(r) not in done:
                    try:
                        self.prefill_rows([r], done)
                    except Exception as e1:
                        self.fail(r, e1)

    def prefill_rows(self, rows, done):
        """The batched prefill, reference-equal to prefilling each row alone (tests/test_engine.py)."""
        todo = {id(r): r.n_cached for r in rows}  # each row's next prompt position to prefill
        while todo:
            live = [r for r in rows if id(r) in todo]
            for group in similar_lengths(
                live, [len(r.prompt) - todo[id(r)] for r in live], self.prefill_chunk
            ):
                starts = [todo[id(r)] for r in group]
                n = [min(len(r.prompt) - s, self.prefill_chunk) for r, s in zip(group, starts)]
                T = max(n)
                ids = [r.prompt[s : s + k] + [0] * (T - k) for r, s, k in zip(group, starts, n)]
                ids = torch.tensor(ids, device=self.device)  # (B, T), right-padded
                last = [k - 1 for k in n]
                final = [s + k == len(r.prompt) for r, s, k in zip(group, starts, n)]
                h = self.forward(ids, starts, group)  # (B, T, D)
                logits = self.logits(h, last)  # (B, V): each row's last real position only
                ended = [r for r, f in zip(group, final) if f]
                if ended:
                    keep = [i for i, f in enumerate(final) if f]
                    if self.prefix_cache:
                        for r in ended:
                            self.cache.register(r.prompt, r.pages)
                    self.sample_append(ended, logits[keep])
                if self.spec:  # the chunk through the MTP block: its cache and, at the end, the first draft
                    mtp_rows = [i for i, r in enumerate(group) if r.finish is None]
                    if mtp_rows:
                        nxt = [
                            (group[i].tokens[starts[i] + 1 : starts[i] + n[i] + 1] + [0] * T)[:T]
                            for i in mtp_rows
                        ]
                        nxt = torch.tensor(nxt, device=self.device)
                        lg, h2 = self.mtp(
                            h[mtp_rows], nxt, [starts[i] for i in mtp_rows], [group[i] for i in mtp_rows]
                        )
                        for j, i in enumerate(mtp_rows):
                            group[i].draft_logits = lg[j, n[i] - 1]
                            group[i].h_mtp = h2[j, n[i] - 1]
                for r, s, k, f in zip(group, starts, n, final):
                    if f:
                        del todo[id(r)]
                        done.add(id(r))
                    else:
                        todo[id(r)] = s + k

    # --- the model, run over pages ------------------------------------------------------

    def place(self, rows, starts, T, pad=0, width=0):
        """Point the cache at these rows' pages. starts: each row's first position (host ints) ->
        positions (B, T). A row's positions past its own pages (right padding)
        land on the scratch page; so do `pad` extra rows at position 0 (a compiled step's batch bucket).
        width: the page tables' least width (a compiled step's is fixed, so no page count recompiles).
        An eager decode step (or an MTP draft or verify step) also gives the cache each row's length, so
        long rows can each read their own stretch of the pool in place (PagedCache.point)."""
        P = self.cache.page_size
        scratch = self.cache.scratch
        n = max(max(len(r.pages) for r in rows), -(-(max(starts) + T) // P))  # pages the rows use
        # only the used pages go through Python; the rest of a compiled step's fixed width (hundreds of
        # pages) and the padding rows are one fill: a (32, 257) list of ints cost 0.8 ms a step
        tables = torch.full((len(rows) + pad, max(n, width)), scratch, dtype=torch.long)  # (B, n)
        tables[: len(rows), :n] = torch.tensor([r.pages + [scratch] * (n - len(r.pages)) for r in rows])
        ends = None
        if T <= 1 + self.spec and pad == 0 and width == 0:  # eager decode, MTP draft or verify: long rows
            ends = [s + T for s in starts]  # may each read their own stretch of the pool
        self.cache.point(tables, max(starts) + T, ends)  # the host tables; point moves them to the device
        start = torch.tensor(starts + [0] * pad, device=self.device)
        return start.view(-1, 1) + torch.arange(T, device=self.device)  # (B, T)

    def forward(self, ids, starts, rows):
        """ids (B, T), starts: each row's first position -> h (B, T, D), the main stack's output after
        model.norm (GLM5.hidden_states over the pages): what lm_head reads (logits() at the positions wanted)
        and what the MTP block takes as its first hidden state."""
        if self.compiled_layers is None or ids.shape[1] == 1:
            # one token (a prompt whose prefix was cached but its last token): eager, as torch.compile
            # would build separate graphs for a length of 1; a decode step goes through decode_step
            return self.layers(ids, self.place(rows, starts, ids.shape[1]))
        # compiled: the page tables at their fixed width, as in decode_step, so no page count recompiles
        return self.compiled_layers(ids, self.place(rows, starts, ids.shape[1], width=self.table_width))

    def layers(self, ids, positions):
        """The model's own decoder stack (GLM5.hidden_states) over the pages the cache points at: ids (B, T)
        -> h (B, T, D) after model.norm. What compile=True compiles for the prefill (and verify) forwards."""
        if not self.signature:  # read here so that each graph guards on it (module_guards_filter)
            raise RuntimeError("an Engine without its model's weights_signature")
        return self.model.hidden_states(ids, positions, self.cache)[0]

    def decode_hidden(self, ids, positions):
        """One decode step's forward up to the head: ids (B, 1) -> the final norm's output (B, D). What
        compile=True compiles for decode. The head runs after it, eager, on the real rows only (not the
        bucket's padding): through linear.py that is oneDNN's GEMM on a CPU, which ran the toy's 4,096-wide
        head at batch 32 in 178 against MKL's 340 us (inductor's graph calls MKL); the argmax stays out too
        (inductor's CPU argmax over 4,096 logits made a batch-32 step slower)."""
        return self.layers(ids, positions)[:, -1]

    def decode_logits(self, ids, positions):
        """One decode step's forward, eager: ids (B, 1) -> logits (B, V)."""
        return self.model.lm_head(self.decode_hidden(ids, positions))

    def logits(self, h, last=None):
        """h (B, T, D) after model.norm (forward's) -> logits (B, T, V), or (B, V) at one position per row:
        last[i] for row i."""
        if last is not None:
            h = h[torch.arange(h.shape[0], device=h.device), torch.tensor(last, device=h.device)]
        return self.model.lm_head(h)

    def mtp(self, h, next_ids, starts, rows):
        """The MTP block at positions starts.. with inputs (h_i, embed(t_{i+1})) -> (logits, h'). h: the
        main stack's output after model.norm (forward's), or the block's own last h'; h' is its output
        after shared_head.norm, which lm_head reads and the next MTP step takes as its h (model.MTPBlock:
        the released weights' contract)."""
        m = self.model
        positions = self.place(rows, starts, h.shape[1])
        cos, sin = m.rope(positions)
        emb = m.model.embed_tokens(next_ids)
        h2, _, _ = m.mtp_layers[0](h, emb, cos, sin, positions, self.cache)
        return m.lm_head(h2), h2

    # --- decoding: plain, or speculative with the MTP block -----------------------------

    def decode_step(self, rows):
        """One token for every running row. Compiled (compile=True), the batch is padded up to its
        bucket (decode_bucket) with rows on the scratch page, so a few graphs cover every batch size."""
        ids = [[r.tokens[-1]] for r in rows]
        pad = width = 0
        if self.compiled is not None:
            pad = decode_bucket(len(rows), self.max_batch) - len(rows)
            width = self.table_width
        positions = self.place(rows, [len(r.tokens) - 1 for r in rows], 1, pad, width)
        ids = torch.tensor(ids + [[0]] * pad, device=self.device)  # (B + pad, 1)
        if self.compiled is None:
            logits = self.decode_logits(ids, positions)
        else:
            logits = self.model.lm_head(self.compiled(ids, positions)[: len(rows)])  # (B, V)
        self.stats["decode_steps"] += 1
        self.sample_append(rows, logits)

    def spec_step(self, rows):
        """MTP drafts N tokens per row, one forward verifies [last token, drafts], the acceptance rule
        keeps a prefix of them, and the kept positions go through the MTP block for the next drafts."""
        base = [len(r.tokens) - 1 for r in rows]  # each row's last token
        drafts, qs = self.draft(rows, base)  # (B, N) ids, (B, N, V) the distributions they came from
        ids = torch.tensor([[r.tokens[-1]] + d for r, d in zip(rows, drafts)], device=self.device)
        h = self.forward(ids, base, rows)  # (B, N + 1, D)
        logits = self.logits(h)  # (B, N + 1, V)
        self.stats["decode_steps"] += 1
        n_new = [self.verify(r, logits[i], qs[i], drafts[i]) for i, r in enumerate(rows)]
        self.catch_up_mtp(rows, h, n_new, base)

    def draft(self, rows, base):
        """N draft tokens per row: the first from the logits the MTP block left at the last step, each
        next one from the block fed its own output state and the token it just drafted."""
        logits = torch.stack([r.draft_logits for r in rows])  # (B, V)
        h = torch.stack([r.h_mtp for r in rows])[:, None]  # (B, 1, D)
        drafts = [[] for _ in rows]
        qs = [[] for _ in rows]
        for k in range(self.spec):
            for i, r in enumerate(rows):
                penalized = sampling.penalize(logits[i], r.out + drafts[i], r.sp)[None]  # (1, V)
                q = sampling.sampling_probs(penalized, r.sp)[0]  # (V,)
                d = int(q.argmax()) if r.sp.temperature == 0 else sampling.draw(q, r.gen)
                drafts[i].append(d)
                qs[i].append(q)
            if k + 1 < self.spec:
                last = torch.tensor([d[-1] for d in drafts], device=self.device)[:, None]  # (B, 1)
                logits, h = self.mtp(h, last, [b + k for b in base], rows)
                logits = logits[:, -1]
        return drafts, [torch.stack(q) for q in qs]

    def verify(self, r, logits, q, drafts):
        """Apply the acceptance rule to one row; append what it keeps. -> the number of tokens appended."""
        # position j is penalized for the tokens generated before it: r.out and the first j drafts
        penalized = [sampling.penalize(logits[j], r.out + drafts[:j], r.sp) for j in range(len(logits))]
        p = sampling.sampling_probs(torch.stack(penalized), r.sp)  # (N + 1, V)
        new = sampling.accept_drafts(p, q, drafts, r.gen, r.sp.temperature == 0)
        r.accepted.append(len(new))
        before = len(r.out)
        for j, t in enumerate(new):
            self.sample_append([r], logits[j][None], [t])
            if r.finish is not None:
                break
        return len(r.out) - before

    def catch_up_mtp(self, rows, h, n_new, base):
        """The newly kept positions through the MTP block, for the rows still running: it writes their
        cache slots and leaves the next first draft. Rows are padded to the longest; the padding's slots
        are overwritten later."""
        live = [i for i, r in enumerate(rows) if r.finish is None]
        if not live:
            return
        T = max(n_new[i] for i in live)
        hs = torch.stack([h[i, :T] for i in live])  # (B', T, D)
        nxt = [(rows[i].tokens[-n_new[i] :] + [0] * T)[:T] for i in live]
        nxt = torch.tensor(nxt, device=self.device)
        logits, h2 = self.mtp(hs, nxt, [base[i] for i in live], [rows[i] for i in live])
        for j, i in enumerate(live):
            rows[i].draft_logits = logits[j, n_new[i] - 1]
            rows[i].h_mtp = h2[j, n_new[i] - 1]

    # --- appending a token: logprobs, text, stop conditions -----------------------------

    def sample_append(self, rows, logits, tokens=None):
        """logits (B, V), one row per request -> sample each row's next token (unless `tokens` are
        given), record it with its logprobs and check the stop conditions. Batched over the rows: the
        greedy rows in one argmax, the logprobs in one log_softmax, one host sync for all; a sampled row
        draws with its own generator. A row whose sampling fails fails alone."""
        if tokens is None:
            tokens = sampling.sample(rows, logits)
        logprobs = sampling.logprobs(rows, logits, tokens)
        for i, r in enumerate(rows):
            if isinstance(tokens[i], Exception):
                self.fail(r, tokens[i])
            else:
                self.append(r, tokens[i], *logprobs.get(i, (None, None)))

    def append(self, r, token, logprob=None, top=None):
        """Record a sampled token (and its logprob and alternatives) and check the stop conditions."""
        sp = r.sp
        r.out.append(token)
        r.versions.append(self.version)
        if logprob is not None:
            r.logprobs.append(logprob)
        if top is not None:
            r.top.append(top)
        if token in r.stop_ids:
            return self.finish(r, "stop")
        text = self.tok.decode(r.out)
        found = [(text.index(s), s) for s in sp.stop if s in text]
        if found:  # the stop string that appears first, whichever of them the client listed first
            cut, r.stop_str = min(found)
            r.text = text[:cut]
            return self.finish(r, "stop")
        r.text = text
        if len(r.out) >= sp.max_tokens or len(r.tokens) >= self.max_model_len:
            return self.finish(r, "length")
        r.events.put(("tokens", len(r.out)))  # the count: its token, logprob and text are all recorded

    def finish(self, r, reason):
        r.finish = reason
        if self.prefix_cache and reason != "error":  # the written full pages (the last token was never fed)
            self.cache.register(r.tokens[: len(r.tokens) - 1], r.pages)
        self.cache.release(r.pages)
        r.pages = []
        if r in self.running:
            self.running.remove(r)
        r.events.put(("done", len(r.out)))

    def fail(self, r, e):
        print(f"engine error: {type(e).__name__}: {e}", file=sys.stderr)
        r.error = f"internal error: {type(e).__name__}: {e}"
        self.finish(r, "error")

    # --- weight updates: a new policy version between two steps ------------------------

    def check_version(self, version):
        if not isinstance(version, int) or isinstance(version, bool) or version <= self.version:
            raise VersionConflict(
                f"weight_version {version!r} is not above the current version {self.version}; "
                "versions only increase, so send a larger integer"
            )

    def update_weights(self, directory, version):
        """Load a save_pretrained directory's weights and make them policy version `version`. The tensors
        are read on the side while the engine keeps stepping; then, holding the step lock (no step runs,
        nothing is admitted), they are copied in, the prefix cache is flushed and every running request's
        cache is recomputed with them. -> the number of running requests that continue on the new weights.
        Raises VersionConflict for a version not above the current one, ValueError for a directory that
        is missing, unreadable, of other shapes or holding a non-finite value; the served weights are then
        untouched. Only safetensors directories are taken: a pickled ckpt.pt named by a client could run
        code."""
        self.check_version(version)
        # here, as in load_model: only quantized serving needs it
        from quantized import QuantExperts, QuantLinear

        if any(isinstance(mod, (QuantLinear, QuantExperts)) for mod in self.model.modules()):
            raise ValueError(
                "this replica serves a quantized (W4A8 / W8A8) checkpoint, which takes no weight updates; "
                "serve the BF16 checkpoint to push weights to it"
            )
        if not os.path.isdir(directory):
            raise ValueError(
                f"no save_pretrained directory at {directory}; pass one written by save_pretrained"
            )
        dtype = self.model.lm_head.weight.dtype
        try:
            new = weights.from_pretrained(directory, dtype=dtype, device=self.device).state_dict()
        except (OSError, ValueError, TypeError) as e:  # weights.CheckpointError is a ValueError
            raise ValueError(f"cannot load {directory}: {e}") from None
        served = self.model.state_dict()
        extra = sorted(set(new) - set(served))
        if extra:  # checked here: load_state_dict would copy the rest before it complained
            raise ValueError(
                f"{directory} does not fit the served model: it holds {extra[0]} (and "
                f"{len(extra) - 1} more) that the served model lacks; push a checkpoint of the same config"
            )
        # a diverged run's weights would poison every request, and the cache pages they leave behind
        for name, t in new.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"{directory} holds a non-finite value (nan or inf) in {name}; push a checkpoint from "
                    "before the training run diverged"
                )
        for name, t in served.items():
            if name not in new or new[name].shape != t.shape:
                got = tuple(new[name].shape) if name in new else "nothing"
                raise ValueError(
                    f"{directory} does not fit the served model: {name} is {tuple(t.shape)} here but "
                    f"{got} there; push a checkpoint of the same config"
                )
        with self.step_lock:
            self.check_version(version)  # another update may have won the race while this one loaded
            self.model.load_state_dict(new)
            self.cache.flush()
            for r in list(self.running):  # a copy: fail() edits self.running
                try:
                    self.recompute(r)
                except Exception as e:  # it fails alone; the weights are swapped whole either way
                    self.fail(r, e)
            # last: whoever sees the new version (/health, a thread polling it) sees the swap complete
            self.version = version
        return len(self.running)

    @torch.no_grad()
    def recompute(self, r):
        """Rewrite r's cache with the current weights: every token but the last (the next step feeds it),
        and with MTP the block's cache and next draft, as admit() does for a prompt."""
        ids = torch.tensor([r.tokens[:-1]], device=self.device)  # (1, T)
        h = self.forward(ids, [0], [r])
        if self.spec:
            nxt = torch.tensor([r.tokens[1:]], device=self.device)  # (1, T): each position's next token
            logits, h2 = self.mtp(h, nxt, [0], [r])
            r.draft_logits = logits[0, -1]
            r.h_mtp = h2[0, -1]
        self.stats["recomputed_tokens"] += ids.shape[1]

    # --- driving it ---------------------------------------------------------------------

    def warm_up(self):
        """compile=True: build the graphs serving needs before the first request arrives, as vLLM
        captures its CUDA graphs at start-up, so no request waits seconds for a compile. torch.compile
        makes one graph for a first shape, a dynamic one at the next, and treats a size of 1 apart; DSA
        selects only once a history is longer than index_topk. So: one row, then two (every larger
        bucket reuses the two-row graph), each prefilling two short prompt lengths and one past
        index_topk, the short ones decoding past index_topk and a page boundary. What does not fit the
        pool or max_model_len is left out (compiled on first use), and so is reading a small pool in place
        (PagedCache.point: a pool at most twice the longest history), which builds its own graphs the first
        time a long request meets a small pool. Returns the seconds taken; 0 without compile. Call it before
        serving: it empties the prefix cache; the stats are left as they were."""
        if self.compiled is None:
            return 0.0
        t0 = time.perf_counter()
        stats = self.stats.copy()
        k = self.cfg.index_topk
        P = self.cache.page_size
        V = self.cfg.vocab_size
        short = max(2, k // 2)
        # (prompt length, max_tokens); the second short length is the dynamic graph's (short - 1 was a
        # one-token prefill at a small index_topk, which runs eager and built no graph)
        runs = [(short, k + P + 2 - short), (short + 1, 2), (k + P + 1, 2)]
        for n in (1, 2):
            for length, max_tokens in runs:
                sp = sampling.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                fits = length + max_tokens <= self.max_model_len and n <= self.max_batch
                if not fits or n * self.pages_needed(length, sp) > self.cache.available():
                    continue
                prompts = [[(7 * j + i) % V for j in range(length)] for i in range(n)]
                self.cache.flush()  # no prompt may find an earlier one's prefix: each row prefills whole
                self.generate(prompts, sp)
        self.cache.flush()  # the warm-up's prompts are not worth caching
        self.stats = stats
        return time.perf_counter() - t0

    def flush_prefix_cache(self):
        """Forget every cached prefix between two steps (serve.py's POST /flush_cache, as a benchmark does
        between runs). Pages running requests hold stay theirs. -> the number of pages the cache held."""
        with self.step_lock:
            n = len(self.cache.cached)
            self.cache.flush()
        return n

    def generate(self, prompts, sp):
        """Synchronous helper (tests, benchmarks): run all prompts to completion, return the Requests."""
        rs = [self.submit(p, dataclasses.replace(sp)) for p in prompts]
        while any(r.finish is None for r in rs):
            self.step()
        return rs

    def loop(self, stop_event):
        """The server's engine thread: step while there is work, sleep on the condition otherwise."""
        while not stop_event.is_set():
            with self.cond:
                if not self.waiting and not self.running:
                    self.cond.wait(0.1)
                    continue
            try:
                self.step()
            except Exception as e:  # never let one bad batch kill the server: fail its requests
                for r in list(self.running):
                    self.fail(r, e)
