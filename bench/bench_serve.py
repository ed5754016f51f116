"""
Serving benchmarks for engine.py, each measured side by side in one run on the same model and prompts.

Five parts, each described in a comment at its code below: 0. the engine (eager and compiled) against
transformers' GlmMoeDsaForCausalLM.generate on the same weights, at batch 1, 8 and 32 and on a mixed
workload of requests arriving over time; 1. throughput: engine.Engine (paged latent cache, continuous
batching) against a naive loop with no cache and no batching; 2. MTP speculative decoding (GLM-5 report,
section 2): the accept length and the speedup for 1..4 drafted tokens; 3. DSA: one decode step of one GLM-5
layer with the published attention shapes (GLM-5 report, section 2; DeepSeek-V3.2 report) at 16K and 64K
cached tokens, against dense attention and the bytes the step must read; 4. memory: the cache bytes per
token against a dense multi-head K/V cache.

Run it:
    python train.py configs/toy.py          # first: the trained toy checkpoint (out/ckpt.pt), parts 1-2
    python bench/bench_serve.py             # every part
    python bench/bench_serve.py --parts=transformers --threads=1  # on a busy machine: one thread each
    python bench/bench_serve.py --parts=dsa --contexts=16384,65536,131072
    python bench/bench_serve.py --device=cuda  # on a GPU (the DSA part then runs the Triton kernels)

Honest limits: on a CPU the toy model's decode step is dominated by per-layer Python and small-matmul
overhead, so batching gains are larger and MTP gains smaller than on a GPU serving a big model; the DSA
part times one layer, not the 78-layer model with its MoE (which DSA does not change), over random latents
(the step's cost does not depend on the values); without a trained checkpoint parts 1 and 2 say so and
part 1 uses random weights (an untrained MTP block drafts noise); without transformers part 0 says so.
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch

# run as python bench/bench_serve.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsa
import engine
import linear
import model as glm
import paged_cache
import sampling
import weights
from bench_train import describe_machine
from train import pick_device, sync
from data import DataLoader
from tokenizer import get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: configs/, data/


def prompts_from(loader, n, length, vocab_size, seed):
    """n prompts of `length` tokens: held-out windows of the default corpus, else random ids."""
    g = torch.Generator().manual_seed(seed)
    if loader is not None:
        x, _ = loader.get_batch("val", n, length, generator=g)
        return x.tolist()
    return torch.randint(3, vocab_size, (n, length), generator=g).tolist()


def naive_generate(m, prompt, n_new):
    """Greedy, the full forward over prompt + everything so far for each new token; no cache."""
    ids = torch.tensor([prompt], device=next(m.parameters()).device)
    for _ in range(n_new):
        nxt = m(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :].tolist()


def timed(fn, dev):
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


# Part 1, throughput: engine.Engine (paged latent cache, continuous batching) at batch 1, 8 and 32 against a
# naive loop that re-runs the full forward over the whole sequence for every new token, one request at a time
# (no cache, no batching). Greedy; the engine's tokens are checked against the naive loop's. tokens/s =
# generated tokens / wall time, prefill included.
def bench_throughput(m, tok, prompts, n_new, batches, n_naive, dev):
    greedy = sampling.SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    pages = -(-(len(prompts[0]) + n_new) // 16) * max(batches) + 8

    def make_engine(batch):
        return engine.Engine(m, tok, num_pages=pages, page_size=16, max_batch=batch, prefix_cache=False)

    warm_up = sampling.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    make_engine(1).generate(prompts[:1], warm_up)
    naive, t_naive = timed(lambda: [naive_generate(m, p, n_new) for p in prompts[:n_naive]], dev)
    naive_tps = n_naive * n_new / t_naive
    print(
        f"naive loop (full forward per token, one request at a time): {n_naive} requests x {n_new} tokens "
        f"in {t_naive:.1f}s = {naive_tps:.1f} tok/s"
    )
    rows = []
    for b in batches:
        eng = make_engine(b)
        rs, t = timed(lambda: eng.generate(prompts[:b], greedy), dev)
        same = sum(r.out == ref for r, ref in zip(rs, naive))
        tps = b * n_new / t
        rows.append((b, tps, tps / naive_tps, same, min(b, n_naive)))
        print(
            f"engine batch {b:>2}: {b} x {n_new} tokens in {t:.2f}s = {tps:.1f} tok/s, "
            f"{tps / naive_tps:.1f}x the naive loop; "
            f"{same}/{min(b, n_naive)} outputs identical to it",
            flush=True,
        )
    return rows


# Part 2, MTP: speculative decoding with the MTP block (GLM-5 report, section 2: accept length 2.76 with 4
# drafted tokens), batch 1, greedy: the accept length (tokens appended per verify forward, the bonus token
# included, as the report counts it) for 1..4 drafted tokens, how often each draft position is accepted, and
# the wall-clock speedup over plain decoding with the same engine; the cost of a step, an MTP forward and a
# verify forward, the accept length at which drafting breaks even here, and the speedup the measured accept
# length projects to at GLM-5's size (the MTP block is one layer of 78 there, a far larger share of a step in
# the toy: docs/design-notes.md). Needs a trained checkpoint (an untrained MTP block drafts noise): train.py's
# out/ckpt.pt.
def bench_mtp(m, tok, prompts, n_new, drafts, dev):
    greedy = sampling.SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    pages = -(-(len(prompts[0]) + n_new + 8) // 16) + 4

    def run(n):  # batch 1: one request after another
        eng = engine.Engine(
            m, tok, num_pages=pages, page_size=16, max_batch=1, spec_tokens=n, prefix_cache=False
        )
        warm_up = sampling.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        eng.generate(prompts[:1], warm_up)
        rs, t = timed(lambda: [eng.generate([p], greedy)[0] for p in prompts], dev)
        return rs, t

    plain, t_plain = run(0)
    print(
        f"plain decoding, batch 1: {len(prompts)} x {n_new} tokens in {t_plain:.2f}s "
        f"({len(prompts) * n_new / t_plain:.1f} tok/s)"
    )
    c_step, c_mtp, c_verify = step_costs(m, tok, prompts[0], max(drafts), dev)
    print(
        f"step costs at batch 1: a decode step {c_step * 1e3:.1f} ms, one MTP block forward (a full MoE "
        f"layer + lm_head) {c_mtp * 1e3:.1f} ms = {c_mtp / c_step:.2f} step, a verify forward over "
        f"{max(drafts) + 1} tokens {c_verify * 1e3:.1f} ms"
    )
    rows = []
    for n in drafts:
        rs, t = run(n)
        steps = sum(len(r.accepted) for r in rs)
        # tokens per verify forward (capped by max_tokens at the end)
        accept = sum(sum(r.accepted) for r in rs) / steps
        # draft i is accepted when a step appends more than i tokens (the bonus or correction is the last)
        per_draft = [sum(a > i for r in rs for a in r.accepted) / steps for i in range(1, n + 1)]
        same = sum(r.out == p.out for r, p in zip(rs, plain))
        # a speculative step: n MTP forwards (n - 1 drafts + the catch-up) and one verify forward
        even = (c_verify + n * c_mtp) / c_step
        glm5 = accept / (1 + n / 78)  # GLM-5: the MTP block is 1 of 78 layers; verify ~ one decode step
        rows.append((n, accept, t_plain / t, same))
        print(
            f"MTP {n} draft(s): accept length {accept:.2f} (each draft accepted: "
            f"{', '.join(f'{p:.0%}' for p in per_draft)}), {t:.2f}s, speedup {t_plain / t:.2f}x; break-even "
            f"accept length here {even:.2f} (forwards only); at GLM-5's size this accept length projects "
            f"to {glm5:.2f}x; {same}/{len(rs)} outputs identical to plain greedy",
            flush=True,
        )
    return rows


def step_costs(m, tok, prompt, n, dev, reps=5):
    """Median seconds, batch 1, of a decode step, one MTP block forward and a verify forward over n + 1
    tokens, each through the engine's own paged forward (the cost model behind the break-even length)."""
    eng = engine.Engine(m, tok, num_pages=64, page_size=16, max_batch=1, spec_tokens=n, prefix_cache=False)
    r = eng.submit(prompt, sampling.SamplingParams(max_tokens=n + 8, temperature=0, ignore_eos=True))
    eng.step()  # prefilled, one token decoded
    base = [len(r.tokens) - 1]
    one = torch.tensor([[r.tokens[-1]]], device=dev)
    more = torch.tensor([[r.tokens[-1]] * (n + 1)], device=dev)
    h = torch.zeros(1, 1, m.config.hidden_size, device=dev, dtype=next(m.parameters()).dtype)

    def med(fn):
        with torch.no_grad():
            fn()
            return statistics.median(timed(fn, dev)[1] for _ in range(reps))

    step = med(lambda: eng.logits(eng.forward(one, base, [r])[:, -1]))
    mtp = med(lambda: eng.mtp(h, one, base, [r]))
    verify = med(lambda: eng.logits(eng.forward(more, base, [r])))
    eng.finish(r, "abort")
    return step, mtp, verify


def glm5_layer_config(max_positions, **overrides):
    """One GLM-5 layer: the released attention shapes (configs/full.py), a small dense FFN and vocabulary,
    no MTP block; overrides replace any field."""
    full, _ = glm.load_config_file(os.path.join(ROOT, "configs/full.py"))
    one_layer = {
        "num_hidden_layers": 1,
        "first_k_dense_replace": 1,
        "intermediate_size": 256,
        "vocab_size": 1024,
        "num_nextn_predict_layers": 0,
        "eos_token_id": [0],
        "max_position_embeddings": max_positions,
    }
    return glm.ModelConfig(**{**full.__dict__, **one_layer, **overrides})


# Part 3, DSA: one decode step of one GLM-5 layer with the published attention shapes (64 heads, a 512 + 64
# latent, the indexer's 32 heads x 128, top-2048; GLM-5 report, section 2; DeepSeek-V3.2 report), at 16K and
# 64K cached tokens, for one row and for a batch of --rows rows (8), each its own history: DSA (indexer over
# all keys, attention over 2048 selected latents) against dense attention over all of them, with model.KVCache
# (contiguous; one row only), paged_cache.PagedCache read in place (as the engine runs: the index keys scored
# in the pool, only the selected latent rows read; a batch's rows each over their own stretch of the pool) and
# PagedCache gathering each history (the reference path), and PagedCache with index_quant "int8" (the index
# keys in int8 with a scale per key, scored by one int8 GEMM: dsa.py, DeepSeek-V3.2's FP8 indexer). A batch
# reads the layer's weights once for all its rows, so its ratio shows more of what DSA saves per row than one
# row's does. Next to each time: the least the step must read (the weights, the index keys and the selected
# latents; dense: every latent) and the bound that sets at the copy bandwidth measured in the same rounds (a
# 256 MiB copy after each round's two steps), the indexer's scores timed alone (one matmul, arithmetic the
# byte bound does not count), and dense attention's two products timed alone: on a CPU dense decode is
# arithmetic (9.7 GFLOP at 64K), so those products, not its bytes, set its floor. DSA, dense and the copy run
# in turn, --reps rounds, and the medians are printed. The cache is filled with random latents: prefilling 64K
# tokens densely on a CPU takes too long, and the step's cost does not depend on the values. Then, for issue
# 17's two goals (dense / DSA >= 4x; DSA within 1.5x of its bound), a straight line through the 1-row and the
# --rows step (a fixed cost, the weights, and a cost per row) says at which batches each goal holds, and
# whether both ever hold at once.
def bench_dsa(contexts, rows, reps, dev, dtype):
    """One GLM-5 layer (published attention shapes, small FFN and vocab), decode step at each context."""
    cfg = glm5_layer_config(max(contexts) + 16)
    torch.manual_seed(0)
    with torch.device(dev):
        m = glm.GLM5(cfg).to(dtype).eval()
    linear.use_onednn(m)  # the projections as the engine runs them (engine.Engine does the same)
    assert m.model.layers[0].self_attn.cfg is m.config  # dsa_mode is read from the shared config at each step
    bw, bw_low, bw_high = copy_bandwidth(dev)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "embed" not in n)
    C, R, Di, K = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.index_topk
    size = torch.finfo(dtype).bits // 8
    print(
        f"memory bandwidth (the median of 5 copies of 256 MiB): {bw / 1e9:.1f} GB/s (they ranged "
        f"{bw_low / 1e9:.1f}-{bw_high / 1e9:.1f}); the layer's weights read per step "
        f"{weight_bytes / 1e6:.0f} MB = {weight_bytes / bw * 1e3:.1f} ms, the floor under every row below"
    )
    # the bound of each step below takes the copies timed in its own rounds: this shared machine's copies
    # have run anywhere from 33 to 70 GB/s within minutes, so one reading at the start can be far off
    src = torch.ones(64 * 2**20, device=dev, dtype=torch.float32)  # 256 MiB, as copy_bandwidth
    dst = torch.empty_like(src)
    copy_bytes = 2 * src.numel() * src.element_size()  # read + write
    steps = {}  # (S, B, cache) -> DSA's time (s), dense's, the bytes DSA must read, the copy's time (s)
    for S in contexts:
        for B in sorted({1, rows}):
            for name, cache, index_quant in dsa_caches(cfg, S, B, dev, dtype):
                m.config.index_quant = index_quant
                fill_cache(cache, S, B, Di, dev, dtype)
                t = dsa_and_dense(m, cache, S, B, reps, dev, lambda: dst.copy_(src))
                bw_here = copy_bytes / t["copy"]
                # the least a step must read beyond the weights, per row: DSA the index keys and the K
                # selected latents, dense every latent
                index_bytes = cache.index_k.shape[-1] * cache.index_k.element_size()
                need = {
                    "sparse": B * (S * index_bytes + K * (C + R) * size),
                    "dense": B * S * (C + R) * size,
                }
                bound = {k: (weight_bytes + v) / bw_here for k, v in need.items()}
                steps[S, B, name] = (t["sparse"], t["dense"], weight_bytes + need["sparse"], t["copy"])
                ms = {k: v * 1e3 for k, v in t.items()}
                rows_named = f"{B} row " if B == 1 else f"{B} rows"
                print(
                    f"{S:>7} tokens x {rows_named}, {name:<22}: DSA {ms['sparse']:7.1f} ms (reads >= "
                    f"{need['sparse'] / 1e6:5.1f} MB + weights: bound {bound['sparse'] * 1e3:5.1f} ms, "
                    f"{t['sparse'] / bound['sparse']:.2f}x it), dense {ms['dense']:7.1f} ms (>= "
                    f"{need['dense'] / 1e6:6.1f} MB + weights, {t['dense'] / bound['dense']:.2f}x its "
                    f"bound); dense / DSA = {t['dense'] / t['sparse']:.2f}x; copies in these rounds "
                    f"{bw_here / 1e9:.1f} GB/s",
                    flush=True,
                )
        for name in ("PagedCache", "PagedCache, int8 index"):  # read in place, both index layouts
            if rows > 1:
                one, many = steps[S, 1, name], steps[S, rows, name]
                bw_both = copy_bytes / statistics.mean([one[3], many[3]])  # one bandwidth for both bounds
                one = (one[0], one[1], one[2] / bw_both)
                many = (many[0], many[1], many[2] / bw_both)
                print_where_goals_hold(S, name, one, many, rows, bw_both)
        # the byte bound leaves out arithmetic: the indexer's scores are one (heads x Di) x (Di x S) product
        # over every index key, which on a CPU thread costs more than reading those keys; timed as the step
        # runs it (linear.linear, the keys as the rows: oneDNN's GEMM on a CPU)
        q = torch.randn(cfg.index_n_heads, Di, device=dev, dtype=dtype)
        keys = torch.randn(S, Di, device=dev, dtype=dtype)
        with torch.no_grad():
            score = statistics.median(timed(lambda: linear.linear(keys, q), dev)[1] for _ in range(reps))
        flops = 2 * cfg.index_n_heads * Di * S
        print(
            f"{S:>7} tokens: the indexer's scores alone ({flops / 1e9:.2f} GFLOP, one matmul) take "
            f"{score * 1e3:.1f} ms; weights + scores = {(weight_bytes / bw + score) * 1e3:.1f} ms, a floor "
            "the byte bound does not count",
            flush=True,
        )
        if dev == "cpu":  # the same matmul as index_quant "int8" runs it: one int8 GEMM, int32 out
            q8, k8 = dsa.quantize_int8(q)[0], dsa.quantize_int8(keys)[0]
            score8 = statistics.median(timed(lambda: torch._int_mm(q8, k8.T), dev)[1] for _ in range(reps))
            print(
                f"{S:>7} tokens: in int8 the scores take {score8 * 1e3:.1f} ms; weights + scores = "
                f"{(weight_bytes / bw + score8) * 1e3:.1f} ms",
                flush=True,
            )
        # dense attention is arithmetic too, and more of it: paged_attention.decode_attention's two
        # products over all S latents, [q_abs | q_pe] (H x (C + R)) against them and the probabilities back
        # through them
        H = cfg.num_attention_heads
        q_cat = torch.randn(H, C + R, device=dev, dtype=dtype)
        latents = torch.randn(S, C + R, device=dev, dtype=dtype)
        probs = torch.rand(H, S, device=dev, dtype=dtype)
        with torch.no_grad():
            products = statistics.median(
                timed(lambda: linear.linear(q_cat, latents), dev)[1]
                + timed(lambda: linear.linear(probs, latents.t()), dev)[1]
                for _ in range(reps)
            )
        flops = 2 * 2 * H * (C + R) * S
        print(
            f"{S:>7} tokens: dense attention's two products alone ({flops / 1e9:.1f} GFLOP) take "
            f"{products * 1e3:.1f} ms ({flops / products / 1e9:.0f} GFLOP/s); weights + products = "
            f"{(weight_bytes / bw + products) * 1e3:.1f} ms, dense's floor on this machine",
            flush=True,
        )
    m.config.dsa_mode = "sparse"
    m.config.index_quant = "none"


def batches_where(a, c):
    """The batches n >= 1 with n a >= c, as (first, last) (last may be math.inf), or None if there are
    none."""
    if a == 0:
        return (1, math.inf) if c <= 0 else None
    if a > 0:
        return (max(1, math.ceil(c / a)), math.inf)
    last = math.floor(c / a)  # a < 0: n <= c / a
    return (1, last) if last >= 1 else None


def where_goals_hold(one, many, B):
    """Issue 17's two goals for DSA, dense / DSA >= 4x and DSA within 1.5x of its byte bound, as a function
    of the batch n, from a straight line through the 1-row and the B-row step: each time = fixed + n x per
    row (the weights are read once a step, each row's attention adds its own). one, many: (DSA, dense,
    DSA's bound) in seconds -> (lines {"dsa", "dense", "bound"}: (fixed, per row), the batches where 4x
    holds, those where 1.5x holds: each (first, last) or None, batches_where's)."""
    lines = {}
    for i, name in enumerate(("dsa", "dense", "bound")):
        per_row = (many[i] - one[i]) / (B - 1)
        lines[name] = (one[i] - per_row, per_row)
    w_s, s = lines["dsa"]
    w_d, d = lines["dense"]
    w_b, b = lines["bound"]
    four = batches_where(d - 4 * s, 4 * w_s - w_d)  # w_d + n d >= 4 (w_s + n s)
    near = batches_where(1.5 * b - s, w_s - 1.5 * w_b)  # w_s + n s <= 1.5 (w_b + n b)
    return lines, four, near


def print_where_goals_hold(S, name, one, many, B, bw):
    """where_goals_hold's answer, one line: at which batches each goal holds, and whether both ever do (the
    bounds in `one` and `many` taken at one copy bandwidth, bw bytes/s)."""
    lines, four, near = where_goals_hold(one, many, B)
    ms = {k: (v[0] * 1e3, v[1] * 1e3) for k, v in lines.items()}

    def said(r):
        if r is None:
            return "no batch"
        if r == (1, math.inf):
            return "every batch"
        if r[1] == math.inf:
            return f"{r[0]} rows and up"
        if r[0] == r[1]:
            return f"{r[0]} row" if r[0] == 1 else f"{r[0]} rows"
        return f"{r[0]} to {r[1]} rows"

    both = None
    if four is not None and near is not None and max(four[0], near[0]) <= min(four[1], near[1]):
        both = (max(four[0], near[0]), min(four[1], near[1]))
    print(
        f"{S:>7} tokens, {name}, a line through 1 and {B} rows: DSA {ms['dsa'][0]:.1f} ms + "
        f"{ms['dsa'][1]:.2f} ms a row, dense {ms['dense'][0]:.1f} + {ms['dense'][1]:.2f}, DSA's bound "
        f"{ms['bound'][0]:.1f} + {ms['bound'][1]:.2f} (copies at {bw / 1e9:.1f} GB/s): dense / DSA >= 4x "
        f"at {said(four)}, DSA within 1.5x of its bound at {said(near)}; both at once at {said(both)}",
        flush=True,
    )


def fill_cache(cache, S, B, Di, dev, dtype):
    """Random latents and index keys in every row's S cached tokens (and the slots after them): a decode
    step's cost does not depend on the values, and prefilling 64K tokens densely on a CPU takes too long."""
    g = torch.Generator(device=dev).manual_seed(S)
    n = B * (S + 1) if isinstance(cache, glm.KVCache) else cache.num_pages * cache.page_size
    kv = cache.kv[0].view(-1, cache.kv.shape[-1])[:n]  # every row's tokens, as one run of the layer's cache
    ik = cache.index_k[0].view(-1, cache.index_k.shape[-1])[:n]
    kv.copy_(torch.randn(kv.shape, generator=g, device=dev, dtype=dtype))
    keys = torch.randn(n, Di, generator=g, device=dev, dtype=dtype)
    ik.copy_(dsa.to_index_cache(keys, ik.dtype))


def dsa_and_dense(m, cache, S, B, reps, dev, copy):
    """One decode step of B rows at position S, DSA and dense in turn, then `copy` (a large copy, for the
    byte bound), for `reps` rounds (a slow spell of a shared machine hits all three)
    -> {"sparse": median s, "dense": median s, "copy": median s}."""
    ids = torch.full((B, 1), 5, device=dev)
    times = {"sparse": [], "dense": [], "copy": []}
    for r in range(reps + 1):
        for mode in ("sparse", "dense"):
            m.config.dsa_mode = mode
            with torch.no_grad():
                took = timed(lambda: m(ids, cache=cache, start_pos=S), dev)[1]
            if r > 0:  # round 0 warms both up
                times[mode].append(took)
        took = timed(copy, dev)[1]
        if r > 0:
            times["copy"].append(took)
    return {mode: statistics.median(v) for mode, v in times.items()}


def dsa_caches(cfg, S, B, dev, dtype):
    """The caches part 3 times, for B rows of S cached tokens each, one at a time (at 8 rows of 192K tokens
    each takes 4.3 GB) -> (name, cache, index_quant). Paged caches hold each row's S tokens (and the next
    one) in its own consecutive pages. One row: model.KVCache, PagedCache read in place (the pool is the
    row's), PagedCache gathering the history (the reference path), PagedCache with int8 index keys.
    B rows: the paged ones, read row by row in place (PagedCache.point's stretches) or gathered; KVCache is
    left out (B contiguous histories run the batched einsums, not a decode step's path)."""
    pages = -(-(S + 1) // 64)  # per row
    tables = torch.arange(B * pages).view(B, pages)
    ends = None
    if B > 1:
        ends = [S + 1] * B  # what the engine passes for an eager decode step

    def paged(in_place, index_quant):
        cfg.index_quant = index_quant  # each cache takes its index key layout from the config
        cache = paged_cache.PagedCache(cfg, B * pages, 64, dev, dtype, in_place=in_place)
        cache.point(tables, S + 1, ends)
        return cache

    if B == 1:
        cfg.index_quant = "none"
        yield "KVCache", glm.KVCache(cfg, 1, S + 1, device=dev, dtype=dtype), "none"
    yield "PagedCache", paged(True, "none"), "none"
    yield "paged, gathered", paged(False, "none"), "none"  # the reference: each history copied per step
    yield "PagedCache, int8 index", paged(True, "int8"), "int8"  # the index keys in int8 + a scale


# Part 4, memory: the engine's cache bytes per token (the latent and the indexer key, every layer) against a
# dense multi-head K/V cache of the same attention, toy and full size, fp32 and bf16.
def bench_memory():
    """The engine's cache bytes per token (every layer, MTP included), read off a PagedCache as the engine
    allocates it, against the dense multi-head K and V cache the same attention would need without MLA
    (each head's full key, qk_head_dim values, and value, v_head_dim values, per token per layer), for the
    toy and GLM-5's published shapes, fp32 and bf16, the indexer key in float and in int8."""
    rows = []
    for name in ("toy", "full"):
        cfg, _ = glm.load_config_file(os.path.join(ROOT, f"configs/{name}.py"))
        for dtype in (torch.float32, torch.bfloat16):
            for index_quant in ("none", "int8"):
                cfg.index_quant = index_quant
                cache = paged_cache.PagedCache(cfg, 1, 1, "cpu", dtype)  # one page of one token
                L = cache.kv.shape[0]
                ours = sum(t[:, 0].numel() * t.element_size() for t in (cache.kv, cache.index_k))  # 1 token
                size = torch.finfo(dtype).bits // 8
                mha = L * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * size
                rows.append((name, dtype, index_quant, ours, mha))
                print(
                    f"{name:>4}, {str(dtype)[6:]:>8}, indexer key {index_quant:>4}: {ours / 1e3:8.1f} KB per "
                    f"token ({L} layers: the latent [c_kv | k_pe] and the index key); a dense MHA cache "
                    f"{mha / 1e3:9.1f} KB: {mha / ours:.1f}x smaller",
                    flush=True,
                )
        cfg.index_quant = "none"
    return rows


def copy_bandwidth(dev, reps=5):
    """Bytes per second of one large copy (read + write): the memory bound's speed, and the range seen.
    The median of `reps` copies, as the steps it bounds are medians: on a shared 2-core machine the best
    of three once read 75 GB/s where copies around it ran 40-44 and the steps were no faster."""
    x = torch.ones(64 * 2**20, device=dev)  # 256 MiB of fp32
    y = torch.empty_like(x)
    y.copy_(x)
    rates = [2 * x.numel() * x.element_size() / timed(lambda: y.copy_(x), dev)[1] for _ in range(reps)]
    return statistics.median(rates), min(rates), max(rates)


# -----------------------------------------------------------------------------
# Part 0: the engine against transformers' GlmMoeDsaForCausalLM.generate on the same weights
#
# engine.Engine against the peer a user would pick: transformers' GlmMoeDsaForCausalLM.generate on the same
# weights (our checkpoint converted in memory: the names are the released ones, transformers stacks the
# experts), sparse attention, greedy, at batch 1, 8 and 32 (one batch, all prompts of one length), and a mixed
# workload: requests of 16-128 prompt and 8-96 output tokens arriving over time (a mean gap of 50 ms, bound by
# the arrivals, and of 5 ms, where requests queue up), which the engine batches continuously and generate
# serves as left-padded batches of what has arrived. The engine runs twice: eager, and compiled (compile=True:
# torch.compile of the prefill and decode forwards, decode batches padded to powers of two; the graphs built
# first, their time printed, not counted; --no_compile leaves it out). The batches run --rounds interleaved
# rounds (transformers, eager, compiled; medians, each ratio's range over the rounds printed); the mixed
# workload runs once. Outputs are compared token for token. transformers is optional: without it this part
# says so.


def to_transformers(m):
    """Our GLM5 -> transformers' GlmMoeDsaForCausalLM holding the same weights, or None (with the reason
    printed) when transformers or its GLM-5 model is absent. Both stack each layer's experts into
    gate_up_proj (E, 2I, D) and down_proj (E, D, I); transformers has no MTP block (the released
    checkpoint's layer L, which it ignores on load)."""
    try:
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    except ImportError as e:
        print(f"skipped: transformers with GlmMoeDsaForCausalLM is not installed ({e}); pip install it")
        return None
    c = m.config
    ours_only = ("num_mtp_steps", "dsa_mode", "architectures", "model_type")
    d = {k: v for k, v in weights.config_to_json(c).items() if k not in ours_only}
    hf = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**d))
    # experts.Experts stacks each layer's experts as transformers does (gate rows first in gate_up_proj, as
    # its chunk(2) reads them): the state dicts share every name but the MTP block's
    sd = {n: t for n, t in m.state_dict().items() if not n.startswith("mtp_layers.")}
    hf.load_state_dict(sd, strict=True)
    p = next(m.parameters())
    hf = hf.to(device=p.device, dtype=p.dtype).eval()
    hf.generation_config.eos_token_id = None  # every request runs to its max_tokens, as ignore_eos does
    hf.generation_config.pad_token_id = 0
    return hf


def hf_generate(hf, prompts, n_new):
    """Greedy generate over one left-padded batch -> each row's n_new new token ids."""
    T = max(len(p) for p in prompts)
    dev = hf.device
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=dev)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False)
    return out[:, T:].tolist()


def bench_vs_transformers(m, tok, prompts, n_new, batches, dev, compiled=True, rounds=3):
    """Same prompts, greedy, whole batches: the engine (one request per row, continuous batching), eager and
    compiled (compile=True: torch.compile, decode batches padded to powers of two), against
    transformers' generate (the batch at once). Outputs are compared token for token. The compiled engine
    is warmed up at every batch first (its graphs compiled: the time is printed, not counted). Each batch
    runs `rounds` rounds of transformers then each engine, interleaved, so a slow spell on a shared machine
    falls on every side alike; the rates are the medians, and each ratio's range over the rounds is
    printed beside it."""
    hf = to_transformers(m)
    if hf is None:
        return []
    greedy = sampling.SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    pages = -(-(len(prompts[0]) + n_new) // 16) * max(batches) + 8

    def make_engine(b, compiled):
        return engine.Engine(
            m, tok, num_pages=pages, max_batch=b, prefix_cache=False, compile=compiled
        )

    hf_generate(hf, prompts[:1], 4)  # warm-up, both
    make_engine(1, False).generate(prompts[:1], greedy)
    engines = {b: {"eager": make_engine(b, False)} for b in batches}
    if compiled:
        t0 = time.perf_counter()
        try:
            for b in batches:
                engines[b]["compiled"] = make_engine(b, True)
                engines[b]["compiled"].warm_up()  # the graphs serving needs, built before any request
            print(f"compiled engine: graphs for batches {batches} built in {time.perf_counter() - t0:.0f}s")
        except Exception as e:  # no C++ compiler for inductor, an unsupported platform
            print(f"compiled engine skipped: torch.compile failed ({type(e).__name__}: {str(e)[-600:]})")
            engines = {b: {"eager": e["eager"]} for b, e in engines.items()}
    rows = []
    for b in batches:
        times = {"transformers": []}  # seconds per round
        outs = {}
        for _ in range(rounds):
            ref, t = timed(lambda: hf_generate(hf, prompts[:b], n_new), dev)
            times["transformers"].append(t)
            for name, eng in engines[b].items():
                rs, t = timed(lambda: eng.generate(prompts[:b], greedy), dev)
                times.setdefault(name, []).append(t)
                outs[name] = [r.out for r in rs]
        t_hf = statistics.median(times["transformers"])
        line = f"batch {b:>2}: transformers generate {b * n_new / t_hf:7.1f} tok/s"
        for name in engines[b]:
            t = statistics.median(times[name])
            per_round = [h / e for h, e in zip(times["transformers"], times[name])]
            same = sum(o == r for o, r in zip(outs[name], ref))
            rows.append((b, name, t_hf / t, same))
            line += (
                f"; engine {name} {b * n_new / t:7.1f} tok/s = {t_hf / t:.2f}x "
                f"(rounds {min(per_round):.2f}-{max(per_round):.2f}x; {same}/{b} identical)"
            )
        print(line, flush=True)
    return rows


def mixed_workload(n, vocab_size, loader, seed):
    """n requests with prompt lengths 16..128 and output lengths 8..96, arriving as a Poisson process:
    -> [(arrival offset in s, prompt, max_tokens)] in arrival order. The mean gap is set by the caller."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 129, (n,), generator=g).tolist()
    outs = torch.randint(8, 97, (n,), generator=g).tolist()
    gaps = torch.empty(n).exponential_(generator=g).tolist()
    reqs = []
    t = 0.0
    for L, k, gap in zip(lens, outs, gaps):
        reqs.append((t, prompts_from(loader, 1, L, vocab_size, seed=seed + len(reqs))[0], k))
        t += gap
    return reqs


def bench_mixed(m, tok, n, mean_gaps, max_batch, dev, loader, compiled=True):
    """Requests arriving over time, at each mean gap between arrivals (a long gap: a lightly loaded server,
    bound by the arrivals; a short one: requests queue up). The engine admits each one at the first step
    after it arrives and finishes each at its own length (continuous batching), eager and compiled (its
    graphs built first by Engine.warm_up, not timed); transformers' generate serves what has
    arrived as one left-padded batch, up to max_batch, and the next batch waits for it (static batching,
    the way generate is used behind a queue), each batch running to its longest request. Throughput counts
    only the tokens requested; latency is arrival to last token."""
    hf = to_transformers(m)
    if hf is None:
        return None
    rows = []
    for mean_gap in mean_gaps:
        rows.append(mixed_once(m, tok, hf, n, mean_gap, max_batch, loader, compiled))
    return rows


def mixed_once(m, tok, hf, n, mean_gap, max_batch, loader, compiled):
    reqs = [(t * mean_gap, p, k) for t, p, k in mixed_workload(n, m.config.vocab_size, loader, seed=7)]
    useful = sum(k for _, _, k in reqs)

    def run_engine(eng):
        """-> [(output, latency)] in request order, and the wall time."""
        done = {}
        pending = [(t, i, p, k) for i, (t, p, k) in enumerate(reqs)]  # (arrival, index, prompt, max_tokens)
        live = []
        t0 = time.perf_counter()
        while pending or live:
            now = time.perf_counter() - t0
            while pending and pending[0][0] <= now:
                t, i, p, k = pending.pop(0)
                sp = sampling.SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
                live.append((i, t, eng.submit(p, sp)))
            if not live:  # idle until the next arrival
                time.sleep(max(0.0, pending[0][0] - now))
                continue
            eng.step()
            now = time.perf_counter() - t0
            for i, t, r in [x for x in live if x[2].finish is not None]:
                done[i] = (r.out, now - t)
            live = [x for x in live if x[2].finish is None]
        return [done[i] for i in range(len(reqs))], time.perf_counter() - t0

    def run_hf():
        outs = []
        pending = list(reqs)
        t0 = time.perf_counter()
        while pending:
            now = time.perf_counter() - t0
            if pending[0][0] > now:  # idle until the next arrival
                time.sleep(pending[0][0] - now)
                now = pending[0][0]
            batch = [x for x in pending if x[0] <= now][:max_batch]
            pending = pending[len(batch) :]
            got = hf_generate(hf, [p for _, p, _ in batch], max(k for _, _, k in batch))
            end = time.perf_counter() - t0
            outs += [(o[:k], end - t) for (t, _, k), o in zip(batch, got)]
        return outs, time.perf_counter() - t0

    hf_out, t_hf = run_hf()
    lat_h = statistics.mean(x[1] for x in hf_out)
    line = (
        f"mixed workload, {n} requests (prompts 16-128, outputs 8-96 tokens, mean gap {mean_gap * 1e3:.0f} "
        f"ms): transformers {useful / t_hf:.1f} tok/s, mean latency {lat_h:.2f}s"
    )
    result = {"gap": mean_gap, "transformers": (useful / t_hf, lat_h)}
    names = ["eager"]
    if compiled:
        names.append("compiled")
    for name in names:
        eng = engine.Engine(
            m, tok, num_pages=n * 16, max_batch=max_batch, prefix_cache=True, compile=name == "compiled"
        )
        eng.warm_up()  # compiled: builds its graphs before the first request (as serve.py --compile does)
        eng_out, t_eng = run_engine(eng)
        same = sum(a[0] == b[0] for a, b in zip(eng_out, hf_out))
        lat_e = statistics.mean(x[1] for x in eng_out)
        result[name] = (useful / t_eng, lat_e)
        line += (
            f"; engine {name} {useful / t_eng:.1f} tok/s, mean latency {lat_e:.2f}s = {t_hf / t_eng:.2f}x "
            f"throughput, {lat_h / lat_e:.1f}x lower latency ({same}/{n} outputs identical)"
        )
    print(line, flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ckpt", default=os.path.join(ROOT, "out/ckpt.pt"), help="train.py checkpoint or save_pretrained dir"
    )
    ap.add_argument("--parts", default="transformers,throughput,mtp,dsa,memory")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--naive_requests", type=int, default=4, help="requests the naive loop runs (its rate is per request)"
    )
    ap.add_argument("--mtp_prompts", type=int, default=8)
    ap.add_argument("--drafts", default="1,2,3,4")
    ap.add_argument("--contexts", default="16384,65536")
    ap.add_argument(
        "--rows", type=int, default=8, help="part 3: also a batch of this many rows, each its own history"
    )
    ap.add_argument("--mixed_requests", type=int, default=48, help="requests in the mixed-length workload")
    ap.add_argument(
        "--mixed_gaps", default="0.05,0.005", help="mean gaps between their arrivals, in s, one run each"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--rounds", type=int, default=3, help="part 0: interleaved rounds per batch (the medians are printed)"
    )
    ap.add_argument("--no_compile", action="store_true", help="part 0 without the compiled engine")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: torch's default); 1 on a busy machine"
    )
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    known = {"transformers", "throughput", "mtp", "dsa", "memory"}
    if parts - known:
        raise SystemExit(f"unknown part(s) {sorted(parts - known)}; choose from {', '.join(sorted(known))}")
    dev = pick_device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(describe_machine(dev), flush=True)

    trained = os.path.exists(a.ckpt)
    if parts & {"transformers", "throughput", "mtp"}:
        if trained:
            m = engine.load_model(a.ckpt, device=dev)
            print(f"model: {a.ckpt}")
        else:
            cfg, _ = glm.load_config_file(os.path.join(ROOT, "configs/toy.py"))
            m = glm.GLM5(cfg).to(dev).eval()
            print(
                f"model: no checkpoint at {a.ckpt} (run python train.py configs/toy.py); random toy weights"
            )
        tok = get_tokenizer(m.config.vocab_size)
        ddir = os.path.join(ROOT, "data/stdlib")
        loader = DataLoader(ddir) if os.path.isdir(ddir) else None
        batches = [int(b) for b in a.batches.split(",")]
        prompts = prompts_from(
            loader, max(batches + [a.mtp_prompts]), a.prompt_len, m.config.vocab_size, seed=1
        )
    if "transformers" in parts:
        print(
            f"\n== 0. against transformers' GlmMoeDsaForCausalLM.generate, same weights, sparse attention "
            f"(DSA top-{m.config.index_topk}): prompts of {a.prompt_len} tokens, {a.new_tokens} new tokens "
            f"each, greedy; batches: the medians of {a.rounds} interleaved rounds =="
        )
        mode = m.config.dsa_mode
        m.config.dsa_mode = "sparse"  # transformers' model always selects; the toy pretrains dense
        bench_vs_transformers(m, tok, prompts, a.new_tokens, batches, dev, not a.no_compile, a.rounds)
        gaps = [float(g) for g in a.mixed_gaps.split(",")]
        bench_mixed(m, tok, a.mixed_requests, gaps, max(batches), dev, loader, not a.no_compile)
        m.config.dsa_mode = mode
    if "throughput" in parts:
        print(
            f"\n== 1. throughput: prompts of {a.prompt_len} tokens, {a.new_tokens} new tokens each, greedy =="
        )
        bench_throughput(m, tok, prompts, a.new_tokens, batches, a.naive_requests, dev)
    if "mtp" in parts:
        print(
            f"\n== 2. MTP speculative decoding, batch 1, {a.mtp_prompts} prompts x {a.new_tokens} tokens, "
            "greedy =="
        )
        if not trained:
            print(
                "skipped: needs a trained checkpoint (an untrained MTP block drafts noise); "
                "run python train.py configs/toy.py"
            )
        else:
            bench_mtp(
                m, tok, prompts[: a.mtp_prompts], a.new_tokens, [int(n) for n in a.drafts.split(",")], dev
            )
    if "dsa" in parts:
        dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
        print(
            f"\n== 3. one GLM-5 layer's decode step, 1 and {a.rows} rows, {dtype}: DSA (top-2048) vs dense "
            "attention =="
        )
        bench_dsa([int(s) for s in a.contexts.split(",")], a.rows, a.reps, dev, dtype)
    if "memory" in parts:
        print("\n== 4. cache bytes per token: the engine's paged latent cache against a dense MHA K/V one ==")
        bench_memory()


if __name__ == "__main__":
    main()
