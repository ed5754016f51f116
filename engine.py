"""
The inference engine: a paged latent cache, continuous batching, sampling and MTP speculative decoding
(a very small vLLM). serve.py puts the OpenAI-compatible HTTP server and the terminal chat on top of it;
tests and benchmarks drive it directly.

What it implements:
- MLA decoding over the cached latents and DSA at inference (GLM-5 report, section 2; DeepSeek-V3.2
  report): the cache holds per layer only the MLA latent [c_kv | k_pe] (512 + 64 = 576 values per token
  at full size) and the indexer's 128-d key, so the model's own cache path (absorbed MLA, the indexer
  over the cached keys, top-k, sparse attention) runs unchanged over it.
- Paging (vLLM's PagedAttention paper, Kwon et al. 2023): the cache is cut into pages; a request holds
  a list of page ids, so requests of any length share one pool without fragmentation. Full pages are
  keyed by the hash chain of their prefix, so a repeated prefix (the next chat turn, an agent's next
  step) is shared, not prefilled again; unreferenced cached pages are evicted least recently used first.
- Sampling: greedy, temperature, top-k, top-p, and OpenAI's presence and frequency penalties over the
  tokens a request has generated (OpenAI's API reference; vLLM's SamplingParams), each request with its
  own seeded generator.
- Speculative decoding with the MTP block (GLM-5 report, section 2: one MTP block whose weights are
  shared across 3 steps, accept length 2.76 with 4 drafted tokens; DeepSeek-V3 report, section 2.2 on
  MTP): the block drafts N tokens, one forward of the main model verifies them all, and drafts are
  accepted by the rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023): greedy while
  draft == argmax, else with probability min(1, p/q) and a resample from normalize(max(0, p - q)) at the
  first rejection, so the output is distributed exactly as without drafts.
- Weight updates for RL rollouts (the GLM-5 report's asynchronous agentic RL infrastructure: rollout engines
  serve while the trainer pushes new weights; SGLang's update_weights_from_disk; AReaL's interruptible
  rollouts, Fu et al. 2025): update_weights() reads a save_pretrained directory on the side, then between
  two engine steps copies it in, makes the new policy version current and flushes the prefix cache (its
  pages hold latents of the old weights). Versions only increase; step() and the swap share one lock, so no
  step ever runs on half-copied weights. Requests in flight continue on the new weights, as AReaL's
  interruptible rollouts and SGLang's pause_generation(mode="retract") do: their cache is recomputed with
  the new weights (the old latents are not mixed in), and every sampled token records the version that
  sampled it (Request.versions), so a trainer can weigh each token against the policy that produced it.

    submit() -> waiting queue -> [admit: prefix-cache lookup, reserve pages, prefill] -> running batch
             -> one batched decode step per iteration (or MTP drafts + one verify forward) -> finished

Run it through serve.py, or drive it directly (as the tests and bench_serve.py do):
    python serve.py --ckpt out/ckpt.pt --spec 3     # the server, with 3 drafted tokens per step
    python bench_serve.py                            # throughput, MTP accept length, DSA vs dense
    curl localhost:8000/update_weights_from_disk -d '{"model_path": "out_rl/step_10", "weight_version": 10}'
    >>> import engine; from tokenizer import get_tokenizer
    >>> m = engine.load_model("out/ckpt.pt")
    >>> eng = engine.Engine(m, get_tokenizer(m.config.vocab_size), spec_tokens=3)
    >>> eng.generate([[1, 2, 3]], engine.SamplingParams(max_tokens=8, temperature=0))[0].out
Tests: python -m pytest -q tests/test_engine.py

Prefill is batched: every request admitted in a step is prefilled in that step, rows of similar length
right-padded into one forward (the padding writes to a scratch page), prompts longer than prefill_chunk in
chunks; then the step decodes every running row, the new ones included. Sampling is batched over the rows:
one argmax for the greedy rows, one log_softmax for the logprobs, one host sync per step; the model's
forward itself never reads a value back (the cache's length is set on the host).
Attention reads the page pool in place when the pool is at most twice the longest history (one long
request, a full server): DSA scores the index keys in the pool and reads only the selected latent rows,
dense attention scores every pool row under a mask; no history is copied. Otherwise (a large pool, short
rows) each row's history is gathered into a (B, S, 576) tensor per layer, which is also the reference
path (PagedCache(in_place=False)) the tests hold the in-place one to.

Honest limits: a long prompt's chunks all run in the step that admits it (vLLM interleaves them with
other rows' decode steps, which keeps decode latency flat); rows of very different lengths prefill in
separate forwards. Pages for prompt + max_tokens are reserved at admission (no preemption). In place,
the pool's scores cost up to twice the rows' own (a paged attention kernel reads each row's pages only;
on a GPU the Triton index kernel still gets gathered keys); one process, one device. The MTP block's
drafts 2..N reuse its cache slots at the next positions, an approximation that lowers the accept rate
but never changes the output. Penalties count a row's tokens
from its Python list at every step (vLLM keeps the counts on the device). A weight update holds two
copies of the weights while it loads, and recomputes each running request's cache with one prefill
(AReaL's choice; SGLang can also keep the stale cache or abort); weights come from disk only (no
torch.distributed broadcast from the trainer).
"""

import collections
import dataclasses
import hashlib
import json
import os
import queue
import sys
import threading
import uuid

import torch
import torch.nn.functional as F

import chat
import model as glm
import weights
from dsa import upcast

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
# The paged latent cache, with a prefix cache over its full pages


class PagedCache:
    """Pages of `page_size` tokens, per layer (main layers, then MTP): the latent [c_kv | k_pe] and the
    indexer key. Before each forward the engine sets `tables` (B, max pages) of page ids; write() then
    stores each row's new tokens at their positions and returns each row's history gathered into
    (B, S, ...), the same API as model.KVCache.write."""

    def __init__(self, cfg, num_pages, page_size, device, dtype, in_place=True):
        L = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch = num_pages  # one extra page, never handed out: padded rows write their padding here
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.kv = torch.zeros(L, num_pages + 1, page_size, latent, device=device, dtype=dtype)
        self.index_k = torch.zeros(
            L, num_pages + 1, page_size, cfg.index_head_dim, device=device, dtype=dtype
        )
        self.free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id first
        self.ref = [0] * num_pages  # how many requests use each page
        self.cached = collections.OrderedDict()  # prefix hash -> page id, least recently used first
        self.page_hash = [None] * num_pages
        self.tables = None
        self.length = None  # the furthest position of this forward + 1, set on the host with `tables`
        self.in_place = in_place  # False: always gather each row's history (the reference path)
        self.rows = None

    def point(self, tables, length):
        """Before a forward: tables (B, n) page ids per row, length = the furthest position + 1 (a host
        int, so no layer reads positions back from the device). When the pool is at most twice the
        longest history (one long request; a full server), attention reads the pool in place through
        `rows` (B, S), each position's pool row: the pool's scores cost at most twice the rows' own, and
        nothing is copied. Otherwise (a large pool, short rows) write() gathers each row's history."""
        self.tables = tables
        self.length = length
        P = self.page_size
        self.rows = None
        if self.in_place and self.kv.shape[1] * P <= 2 * length:
            s = torch.arange(length, device=tables.device)
            self.rows = tables[:, s // P] * P + s % P  # (B, S)

    def write(self, layer_id, positions, latent, index_k):
        """positions (B, T); latent (B, T, C + R); index_k (B, T, index_head_dim) -> every row's
        history (B, S, C + R) and (B, S, index_head_dim) (the model.KVCache.write API), or with
        self.rows set the layer's pools (N, C + R) and (N, index_head_dim), N = pages x page_size, read
        in place (model.MLA.forward)."""
        P = self.page_size
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        pages = self.tables[rows, positions // P]  # (B, T)
        slots = positions % P  # (B, T)
        self.kv[layer_id][pages, slots] = latent.to(self.kv.dtype)
        self.index_k[layer_id][pages, slots] = index_k.to(self.index_k.dtype)
        if self.rows is not None:
            return self.kv[layer_id].view(-1, self.kv.shape[-1]), self.index_k[layer_id].view(
                -1, self.index_k.shape[-1]
            )
        S = self.length
        t = self.tables[:, : (S + P - 1) // P]  # (B, n pages)
        B = t.shape[0]
        kv = self.kv[layer_id][t].view(B, -1, self.kv.shape[-1])[:, :S]
        index_k = self.index_k[layer_id][t].view(B, -1, self.index_k.shape[-1])[:, :S]
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
        return out

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


# -----------------------------------------------------------------------------
# Sampling, and the speculative acceptance rule


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = None
    stop: list = dataclasses.field(default_factory=list)  # stop strings
    logprobs: int = None  # None: no logprobs; n >= 0: the sampled token's logprob and n alternatives
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already generated (-2..2)
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated (-2..2)


def penalize(logits, generated, sp):
    """logits (V,) -> logits less OpenAI's presence and frequency penalties over the tokens this request
    has generated so far (the prompt does not count), before temperature, as OpenAI's API reference and
    vLLM define them: logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0).
    The logprobs a request reports stay the model's own, before penalties."""
    logits = upcast(logits)
    if not generated or not (sp.presence_penalty or sp.frequency_penalty):
        return logits
    count = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1]).to(logits)  # (V,)
    return logits - sp.frequency_penalty * count - sp.presence_penalty * (count > 0).to(logits)


def sampling_probs(logits, sp):
    """logits (N, V) -> the distribution (N, V) fp32 that `sp` samples from; one-hot argmax when greedy."""
    logits = upcast(logits)
    if sp.temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        srt, order = logits.sort(-1, descending=True)
        p = srt.softmax(-1)
        drop = (p.cumsum(-1) - p) > sp.top_p  # keep the smallest head whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def penalized(sp):
    return bool(sp.presence_penalty or sp.frequency_penalty)


def draw(probs, gen):
    """One token from probs (V,) with the request's own generator (reproducible per seed)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def accept_drafts(p, q, drafts, gen, greedy):
    """Speculative sampling's acceptance rule. p (N + 1, V): the target distributions at the N draft
    positions and one after; q (N, V): the draft distributions; drafts (N,). -> the tokens to append:
    the accepted drafts, then either the correction (at the first rejection) or a bonus token from p[N].
    The output is distributed exactly as p."""
    out = []
    for i, d in enumerate(drafts):
        if greedy:
            if d != int(p[i].argmax()):
                return out + [int(p[i].argmax())]
        elif torch.rand((), generator=gen) >= min(1.0, float(p[i, d] / q[i, d])):
            residual = (p[i] - q[i]).clamp(min=0)
            return out + [draw(residual / residual.sum(), gen)]
        out.append(d)
    if greedy:
        return out + [int(p[-1].argmax())]
    return out + [draw(p[-1], gen)]


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
        self.h_mtp = None  # MTP state: the block's last output hidden state (D,) ...
        self.draft_logits = None  # ... and the logits (V,) of the next first draft

    @property
    def tokens(self):
        return self.prompt + self.out


# -----------------------------------------------------------------------------
# The engine


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
    ):
        self.model = model
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

    def place(self, rows, starts, T):
        """Point the cache at these rows' pages. starts: each row's first position (host ints) ->
        positions (B, T) and their RoPE cos, sin. A row's positions past its own pages (right padding)
        land on the scratch page."""
        P = self.cache.page_size
        n = max(max(len(r.pages) for r in rows), -(-(max(starts) + T) // P))
        tables = [r.pages + [self.cache.scratch] * (n - len(r.pages)) for r in rows]
        self.cache.point(torch.tensor(tables, device=self.device), max(starts) + T)  # tables (B, n)
        start = torch.tensor(starts, device=self.device)
        positions = start.view(-1, 1) + torch.arange(T, device=self.device)  # (B, T)
        c = self.cfg
        dtype = upcast(self.model.lm_head.weight).dtype
        cos, sin = glm.rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, dtype)
        return positions, cos, sin

    def forward(self, ids, starts, rows):
        """ids (B, T), starts: each row's first position -> h (B, T, D), the main stack's last hidden
        state (GLM5.forward's, over the pages); logits() puts the head on the positions wanted."""
        m = self.model
        positions, cos, sin = self.place(rows, starts, ids.shape[1])
        h = m.model.embed_tokens(ids)
        for layer in m.model.layers:
            h, _, _ = layer(h, cos, sin, positions, self.cache)
        return h

    def logits(self, h, last=None):
        """h (B, T, D) -> logits (B, T, V), or (B, V) at one position per row: last[i] for row i."""
        m = self.model
        if last is not None:
            h = h[torch.arange(h.shape[0], device=h.device), torch.tensor(last, device=h.device)]
        return m.lm_head(m.model.norm(h))

    def mtp(self, h, next_ids, starts, rows):
        """The MTP block at positions starts.. with inputs (h_i, embed(t_{i+1})) -> (logits, h'): its
        logits and its output hidden state, which the next MTP step takes as its h."""
        m = self.model
        positions, cos, sin = self.place(rows, starts, h.shape[1])
        emb = m.model.embed_tokens(next_ids)
        h2, h_norm, _, _ = m.mtp_layers[0](h, emb, cos, sin, positions, self.cache)
        return m.lm_head(h_norm), h2

    # --- decoding: plain, or speculative with the MTP block -----------------------------

    def decode_step(self, rows):
        ids = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)  # (B, 1)
        h = self.forward(ids, [len(r.tokens) - 1 for r in rows], rows)
        self.stats["decode_steps"] += 1
        self.sample_append(rows, self.logits(h[:, -1]))

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
                q = sampling_probs(penalize(logits[i], r.out + drafts[i], r.sp)[None], r.sp)[0]  # (V,)
                d = int(q.argmax()) if r.sp.temperature == 0 else draw(q, r.gen)
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
        penalized = [penalize(logits[j], r.out + drafts[:j], r.sp) for j in range(len(logits))]
        p = sampling_probs(torch.stack(penalized), r.sp)  # (N + 1, V)
        new = accept_drafts(p, q, drafts, r.gen, r.sp.temperature == 0)
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
            tokens = self.sample(rows, logits)
        logprobs = self.logprobs(rows, logits, tokens)
        for i, r in enumerate(rows):
            if isinstance(tokens[i], Exception):
                self.fail(r, tokens[i])
            else:
                self.append(r, tokens[i], *logprobs.get(i, (None, None)))

    def sample(self, rows, logits):
        """-> each row's token: the plain greedy rows (no penalties) by one batched argmax, the others as
        sampling_probs says (an exception in place of the token if that fails)."""
        plain = [i for i, r in enumerate(rows) if r.sp.temperature == 0 and not penalized(r.sp)]
        tokens = [None] * len(rows)
        if plain:
            picked = logits if len(plain) == len(rows) else logits[plain]
            for i, t in zip(plain, picked.argmax(-1).tolist()):
                tokens[i] = t
        for i, r in enumerate(rows):
            if tokens[i] is not None:
                continue
            try:
                probs = sampling_probs(penalize(logits[i], r.out, r.sp)[None], r.sp)[0]
                tokens[i] = int(probs.argmax()) if r.sp.temperature == 0 else draw(probs, r.gen)
            except Exception as e:  # e.g. a nan temperature: this request fails, not the batch
                tokens[i] = e
        return tokens

    def logprobs(self, rows, logits, tokens):
        """-> {row: (the token's logprob, its top sp.logprobs alternatives as (id, logprob) or None)} for
        the rows that asked, at their temperature and before penalties, all rows in one pass."""
        want = [i for i, r in enumerate(rows) if r.sp.logprobs is not None and isinstance(tokens[i], int)]
        if not want:
            return {}
        temps = torch.tensor([rows[i].sp.temperature or 1.0 for i in want], device=logits.device)
        lp = torch.log_softmax(upcast(logits[want]) / temps.to(upcast(logits).dtype)[:, None], -1)  # (W, V)
        chosen = lp.gather(-1, torch.tensor([[tokens[i]] for i in want], device=lp.device))[:, 0].tolist()
        n = min(max(rows[i].sp.logprobs for i in want), lp.shape[-1])
        top_v, top_ix = torch.topk(lp, n) if n else (lp[:, :0], lp[:, :0].long())
        top_v, top_ix = top_v.tolist(), top_ix.tolist()
        out = {}
        for j, i in enumerate(want):
            k = rows[i].sp.logprobs
            out[i] = (chosen[j], list(zip(top_ix[j][:k], top_v[j][:k])) if k > 0 else None)
        return out

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
        is missing, unreadable or of other shapes; the served weights are then untouched. Only
        safetensors directories are taken: a pickled ckpt.pt named by a client could run code."""
        self.check_version(version)
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
