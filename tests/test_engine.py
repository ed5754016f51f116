"""engine.py: the paged engine against the model's own forward, prefix caching, continuous batching,
failures and aborts, sampling, MTP speculation (lossless, and drafts accepted once the MTP head has
learned), the rejection sampler's distribution, and weight updates between steps (in-flight requests
continue on the new weights, each token tagged with its policy version; refusals change nothing). The HTTP
layer is tested in test_serve.py.
Run: python -m pytest -q tests/test_engine.py"""

import dataclasses
import os

import pytest
import torch

import dsa
import engine
import model
import paged_cache
import sampling
import weights
from conftest import randomize, tiny_config
from tokenizer import CHAT_TOKENS, Tokenizer, train_bpe

TEXT = "def hello(name):\n    return 'hi ' + name  # the quick brown fox jumps over the lazy dog\n" * 30


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random GLM-5 in float64 (exact comparisons), written by save_pretrained, and a tokenizer.
    index_topk=5 is far below the test contexts, so decoding really runs DSA's top-k selection."""
    torch.manual_seed(0)
    m = randomize(model.GLM5(tiny_config(vocab_size=300)).double(), seed=1)
    d = tmp_path_factory.mktemp("ckpt")
    weights.save_pretrained(m, d, dtype=torch.float64)
    return str(d), Tokenizer(train_bpe(TEXT, 300 - len(CHAT_TOKENS)))


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead (and spin on a busy machine)
    yield
    torch.set_num_threads(n)


def make_engine(ckpt, index_quant="none", **kw):
    m = engine.load_model(ckpt[0])
    m.config.index_quant = index_quant  # before the Engine: its PagedCache takes the index key layout from it
    return engine.Engine(m, ckpt[1], **{"num_pages": 64, "page_size": 4, **kw})


def record_points(eng):
    """Wrap eng.cache.point -> a list that gets the cache's (rows, spans) after each point(): how each
    forward was told to read the pool (whole in place, row by row, or neither: gathered)."""
    steps = []
    real = eng.cache.point

    def point(tables, length, ends=None):
        real(tables, length, ends)
        steps.append((eng.cache.rows, eng.cache.spans))

    eng.cache.point = point
    return steps


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(40, 58)), [200, 3, 3, 3, 9, 100, 42]]
GREEDY = sampling.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("index_quant", ["none", "int8"])
def test_batched_equals_alone_equals_full_forward(ckpt, one_thread, index_quant):
    """With index_quant "int8" the cache stores packed int8 index keys and the full forward packs its fresh
    keys the same way: the selections, and so the tokens, still agree."""
    eng = make_engine(ckpt, index_quant)
    if index_quant == "int8":
        assert eng.cache.index_k.dtype == torch.int8 and eng.cache.index_k.shape[-1] == 12 + 4
    alone = [eng.generate([p], GREEDY)[0].out for p in PROMPTS]
    batched = eng.generate(PROMPTS, GREEDY)
    assert [r.out for r in batched] == alone
    m = eng.model
    for p, r in zip(PROMPTS, batched):  # cached paged decoding == the full forward, token by token
        logits = m(torch.tensor([p + r.out]))[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == r.out
    assert eng.cache.available() == eng.cache.num_pages and not eng.running  # every page came back


def alone(ckpt, prompts, sp, **kw):
    """The engine's unbatched path: each prompt by itself in a fresh engine, prefilled in one forward."""
    return [make_engine(ckpt, prefix_cache=False, **kw).generate([p], sp)[0].out for p in prompts]


@pytest.mark.parametrize("spec", [0, 2])
def test_batched_chunked_prefill_with_prefix_hits_equals_alone(ckpt, one_thread, spec):
    """Every waiting request is prefilled in the same step: mixed lengths right-padded together,
    prompts longer than prefill_chunk in chunks, some starting past a cached prefix; the greedy outputs
    (and logprobs) equal each prompt run alone, with and without MTP drafts."""
    sp = dataclasses.replace(GREEDY, logprobs=2)
    shared = list(range(60, 81))  # 21 tokens: 5 full pages of 4 cached by the first request
    prompts = [shared + [3, 9], PROMPTS[0], shared + [5], PROMPTS[1], list(range(100, 131))]
    eng = make_engine(ckpt, prefill_chunk=5, spec_tokens=spec)
    first = eng.generate([shared], sp)[0]
    before = eng.stats["decode_steps"]
    rs = [eng.submit(p, sp) for p in prompts]
    eng.step()  # one step prefills all five (and decodes one token for each)
    assert all(r.out for r in rs) and (spec or all(len(r.out) == 2 for r in rs))
    assert eng.stats["decode_steps"] == before + 1
    while eng.step():
        pass
    assert [r.n_cached for r in rs] == [20, 0, 20, 0, 0]
    want = alone(ckpt, [shared] + prompts, sp)
    assert [first.out] + [r.out for r in rs] == want
    ref = make_engine(ckpt, prefix_cache=False).generate(prompts, sp)  # logprobs: to rounding
    for r, w in zip(rs, ref):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-9)
        assert [[i for i, _ in t] for t in r.top] == [[i for i, _ in t] for t in w.top]
    assert eng.cache.available() == eng.cache.num_pages


@pytest.mark.parametrize("mode,index_quant", [("sparse", "none"), ("dense", "none"), ("sparse", "int8")])
def test_attention_over_the_page_pool_in_place_equals_the_gathered_history(
    ckpt, one_thread, mode, index_quant
):
    """A pool at most twice the history is read in place (each position's pool row, pages scattered over
    the pool and in descending order, as prefix-cache hits can leave a table) instead of gathered per row:
    DSA's index keys and selected latents, and dense attention's every latent. Greedy outputs and
    logprobs equal the gathering reference path."""
    sp = dataclasses.replace(GREEDY, max_tokens=14, logprobs=1)
    prompts = [list(range(30, 60)), list(range(100, 118))]  # 11 + 8 pages of 4 for prompt + max_tokens
    out = {}
    for in_place in (True, False):
        # 19 pages + the scratch page = 80 slots: gathered while the longest history is under 40 tokens
        eng = make_engine(ckpt, index_quant, num_pages=19, in_place=in_place, prefix_cache=False)
        eng.model.config.dsa_mode = mode
        eng.cache.free = [5, 17, 2, 11, 0, 8, 14, 3, 9, 15, 1, 6, 12, 18, 4, 10, 16, 7, 13]  # scattered
        real_alloc = eng.cache.alloc

        def alloc(n):
            return real_alloc(n)[::-1]  # alloc hands pages out ascending: reversed, the table is out of order

        eng.cache.alloc = alloc
        steps = record_points(eng)
        out[in_place] = eng.generate(prompts, sp)
        seen = [rows is not None for rows, _ in steps]
        assert seen[-1] == in_place and not seen[0]  # the last steps in place, the prefill gathered
    for a, b in zip(out[True], out[False]):
        assert a.out == b.out
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-9)


@pytest.mark.parametrize("mode,index_quant", [("sparse", "none"), ("dense", "none"), ("sparse", "int8")])
def test_long_rows_read_their_own_stretch_of_a_large_pool(ckpt, one_thread, monkeypatch, mode, index_quant):
    """In a pool too large to read for every row, a decode step whose rows are long (SPAN_MIN_BYTES,
    lowered here) reads each row alone: a row whose pages lie together reads its stretch of the pool in
    place, a row whose pages are scattered has its history gathered. Greedy outputs and logprobs equal
    the gathering reference path, with both kinds of row seen, and MTP drafting through the same steps."""
    monkeypatch.setattr(paged_cache, "SPAN_MIN_BYTES", 1)
    sp = dataclasses.replace(GREEDY, max_tokens=14, logprobs=1)
    prompts = [list(range(30, 60)), list(range(100, 118))]  # 11 + 8 pages of 4 for prompt + max_tokens
    out = {}
    for in_place in (True, False):
        for spec in (0, 2):
            eng = make_engine(ckpt, index_quant, in_place=in_place, prefix_cache=False, spec_tokens=spec)
            eng.model.config.dsa_mode = mode
            n0, n1 = [eng.pages_needed(len(p), sp) for p in prompts]  # 11 and 8 pages (12 and 9 with MTP)
            scattered = list(range(0, 3 * n0, 3))  # the first request's pages, two others between each
            together = list(range(40, 40 + n1))  # the second's
            others = [p for p in range(64) if p not in scattered + together]
            eng.cache.free = list(reversed(scattered + together + others))  # a stack: popped from the end
            steps = record_points(eng)
            out[in_place, spec] = eng.generate(prompts, sp)
            assert all(rows is None for rows, _ in steps)  # 64 pages: never read whole for these rows
            seen = [[first is not None for first, _, _ in spans] for _, spans in steps if spans is not None]
            if in_place:
                assert [False, True] in seen  # the scattered row gathered, the other read in place
            else:
                assert not seen  # the reference: every history gathered
    for key in out:
        for a, b in zip(out[key], out[False, 0]):
            assert a.out == b.out, key
            if key[1] == 0:
                torch.testing.assert_close(
                    torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-9
                )


@pytest.mark.slow
def test_row_by_row_decode_at_glm5_attention_shapes_equals_the_gathered_history(ckpt, monkeypatch):
    """At GLM-5's attention shapes in fp32 (one layer: 64 heads, the 576-value latent, the indexer's 32 x 128;
    a top-256 selection), where the CPU's fast paths run (oneDNN's GEMMs for one row's dense attention,
    its selected latents and its index scores over a pool), four requests of 300-411 tokens (0.9-1.2 MB a row
    a layer, past a SPAN_MIN_BYTES lowered to 0.5 MB, so the test prefills less) decode row by row over their
    stretches of the pool: the same tokens as the gathering reference, which runs the batched einsums, and
    logprobs within fp32 rounding."""
    monkeypatch.setattr(paged_cache, "SPAN_MIN_BYTES", 2**19)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full, _ = model.load_config_file(os.path.join(root, "configs", "full.py"))
    one_small_layer = dict(  # the released attention shapes, one layer with a small FFN and vocabulary
        num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=0, eos_token_id=[0],
        intermediate_size=64, vocab_size=300, index_topk=256, max_position_embeddings=1024,
    )
    cfg = model.ModelConfig(**{**full.__dict__, **one_small_layer})
    torch.manual_seed(0)
    m = model.GLM5(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 300, (300 + 37 * i,), generator=g).tolist() for i in range(4)]
    sp = dataclasses.replace(GREEDY, max_tokens=4, logprobs=1)
    out = {}
    for in_place in (True, False):
        eng = engine.Engine(m, ckpt[1], num_pages=240, page_size=16, prefix_cache=False, in_place=in_place)
        steps = record_points(eng)
        out[in_place] = eng.generate(prompts, sp)
        # the decode steps row by row, in place; the reference never
        assert any(spans is not None for _, spans in steps) == in_place
    for a, b in zip(out[True], out[False]):
        assert a.out == b.out
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def inductor_or_skip():
    """torch.compile's CPU backend (inductor) needs a working C++ compiler: skip, saying so, without one."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as e:  # no compiler, an unsupported platform: the engine's eager path is tested anyway
        pytest.skip(f"torch.compile (inductor) is unavailable here: {type(e).__name__}: {e}")


def compiled_model(hidden_size=48):
    """The compiled tests' model, in fp32 as served: one layer, an MoE one (MLA, DSA's indexer, the routed
    and shared experts), so each graph inductor builds is small, as a fresh machine compiles every one of them
    in C++ (about 15 s each here)."""
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=300, num_hidden_layers=1, first_k_dense_replace=0, hidden_size=hidden_size)
    return randomize(model.GLM5(cfg), seed=1).eval()


def run_both(m, tok, prompts, sps, **kw):
    """The same requests through an eager and a compiled Engine(**kw), submitted at once; asserts the greedy
    outputs are equal and the logprobs agree to fp32 rounding. -> the compiled forwards' (rows in the step,
    read the pool in place)."""
    out = {}
    seen = set()
    for compiled in (False, True):
        e = engine.Engine(m, tok, page_size=4, compile=compiled, **kw)
        point = e.cache.point

        def spy(tables, length, ends=None, cache=e.cache, point=point):
            point(tables, length, ends)
            seen.add((tables.shape[0], cache.rows is not None))

        if compiled:
            e.cache.point = spy
        out[compiled] = [e.submit(p, sp) for p, sp in zip(prompts, sps)]
        while e.step():
            pass
        assert e.cache.available() == e.cache.num_pages
    for a, b in zip(out[False], out[True]):
        assert a.out == b.out
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    return seen


@pytest.mark.slow
def test_compiled_engine_warms_up_and_equals_eager(ckpt, one_thread, monkeypatch):
    """compile=True: the prefill and decode forwards through torch.compile, the decode batch padded to its
    bucket with the padding on the scratch page, the history's length dynamic; the decode graphs' experts by
    pairs, the prefill's by the grouped GEMM. Few graphs, as each costs a fresh machine ~15 s of C++:
    1. Engine.warm_up (serve.py --compile calls it at start-up) of a one-row engine builds its graphs (every
       one through module_guards_filter, the prefill's too); afterwards short and long prompts, a prompt
       whose prefix is cached (a one-token prefill) and decoding past index_topk compile nothing more, and
       the outputs equal the eager engine's (logprobs to fp32 rounding).
    2. Two rows in one bucket over a pool of just the pages they reserve: the histories gathered, then read
       in place once the pool is at most twice the longest (new graphs); equal to eager.
    3. A second model of other shapes in the same process gets its own graph (Engine.signature)."""
    inductor_or_skip()
    m = compiled_model()
    tok = ckpt[1]
    assert engine.Engine(m, tok, num_pages=64, page_size=4).warm_up() == 0.0  # eager: nothing to do
    calls = []
    module_guards_filter = engine.module_guards_filter

    def counted(entries):  # the filter reaches every graph, the prefill's too (not only decode's)
        calls.append(len(entries))
        return module_guards_filter(entries)

    monkeypatch.setattr(engine, "module_guards_filter", counted)
    torch._dynamo.reset()  # no graph left from an earlier test: warm_up builds every one it needs
    graphs = torch._dynamo.utils.counters["stats"]
    first = graphs["unique_graphs"]
    eng = engine.Engine(m, tok, num_pages=64, page_size=4, max_batch=1, compile=True)
    eng.warm_up()
    assert len(calls) == graphs["unique_graphs"] - first > 0
    assert eng.stats["decode_steps"] == 0 and eng.cache.available() == eng.cache.num_pages
    before = graphs["unique_graphs"]
    eager = engine.Engine(m, tok, num_pages=64, page_size=4, max_batch=1)
    # prompt 1 finds prompt 0's first 16 tokens cached and prefills its last one alone
    prompts = [list(range(30, 47)), list(range(30, 46)) + [99], PROMPTS[1], list(range(100, 103)), PROMPTS[3]]
    sps = [dataclasses.replace(GREEDY, max_tokens=n, logprobs=1) for n in (6, 3, 12, 2, 9)]
    outs = {}
    for name, e in (("eager", eager), ("compiled", eng)):
        outs[name] = [e.generate([p], sp)[0] for p, sp in zip(prompts, sps)]
        assert outs[name][1].n_cached == 16
        assert (e.cache.rows is None) and e.cache.available() == e.cache.num_pages  # gathered histories
    assert graphs["unique_graphs"] == before
    for a, b in zip(outs["eager"], outs["compiled"]):
        assert a.out == b.out
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)

    prompts = [list(range(30, 45)), list(range(100, 106))]  # 15 + 34 and 6 + 34 tokens: 13 + 10 pages
    sps = [dataclasses.replace(GREEDY, max_tokens=34, logprobs=1) for _ in prompts]
    before = graphs["unique_graphs"]
    seen = run_both(m, tok, prompts, sps, num_pages=23, max_batch=2)
    assert graphs["unique_graphs"] > before  # new graphs: a silent fall back to eager would pass the rest
    assert {(2, False), (2, True)} <= seen  # both rows, gathered and then in place
    assert engine.decode_bucket(3, 32) == 4 and engine.decode_bucket(17, 24) == 24
    assert engine.decode_bucket(1, 32) == 1 and engine.decode_bucket(33, 32) == 33

    before = graphs["unique_graphs"]
    other = compiled_model(hidden_size=64)
    # one token: the prefill's graph alone (each graph costs a fresh machine ~15 s)
    run_both(other, tok, PROMPTS[:1], [dataclasses.replace(GREEDY, max_tokens=1, logprobs=1)], num_pages=16)
    assert graphs["unique_graphs"] > before


@pytest.mark.slow
def test_compiled_graphs_follow_the_config_and_the_weights(one_thread):
    """module_guards_filter drops torch.compile's guards on a model's modules, but not on its config or
    `training`: a graph traced in one dsa_mode is not reused in another, and a weight copied in place
    (update_weights) is read, not baked in."""
    inductor_or_skip()

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = tiny_config(vocab_size=300)
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            if self.cfg.dsa_mode == "sparse":
                return x * self.w
            return x + self.w

    toy = Toy().eval()
    f = torch.compile(toy.forward, options={"guard_filter_fn": engine.module_guards_filter})
    # (the weights are graph inputs whatever the filter: the last check guards against freezing them)
    x = torch.full((3,), 2.0)
    toy.cfg.dsa_mode = "sparse"
    assert f(x).tolist() == [2.0, 2.0, 2.0]
    toy.cfg.dsa_mode = "dense"
    assert f(x).tolist() == [3.0, 3.0, 3.0]
    with torch.no_grad():
        toy.w.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert f(x).tolist() == [3.0, 4.0, 5.0]


@pytest.mark.parametrize("index_quant", ["none", "int8"])
def test_cache_write_touches_only_its_rows(index_quant, monkeypatch):
    """PagedCache.write puts each token at (layer, its row's page, slot) with one index_put_ on the whole
    pool: every other layer, page and slot keeps its value (int8: the packed key dsa.to_index_cache makes).
    The history gather() copies equals the one the compiled path indexes (pool rows, not gathered pages)."""
    cfg = tiny_config(vocab_size=300, index_quant=index_quant)
    cache = engine.PagedCache(cfg, num_pages=6, page_size=4, device="cpu", dtype=torch.float64)
    cache.kv.normal_()
    cache.index_k.copy_(torch.randint(-100, 100, cache.index_k.shape))
    kv = cache.kv.clone()
    ik = cache.index_k.clone()
    cache.point(torch.tensor([[3, 1], [0, 5]]), 8)
    positions = torch.tensor([[5, 6], [2, 3]])  # row 0: page 1, slots 1, 2; row 1: page 0, slots 2, 3
    latent = torch.randn(2, 2, cache.kv.shape[-1], dtype=torch.float64)
    index_k = torch.randn(2, 2, cfg.index_head_dim, dtype=torch.float64)
    cache.write(1, positions, latent, index_k)
    history = cache.gather(1)
    packed = dsa.to_index_cache(index_k, cache.index_k.dtype)
    for (b, t), (page, slot) in {(0, 0): (1, 1), (0, 1): (1, 2), (1, 0): (0, 2), (1, 1): (0, 3)}.items():
        kv[1, page, slot] = latent[b, t]
        ik[1, page, slot] = packed[b, t]
    assert torch.equal(cache.kv, kv)
    assert torch.equal(cache.index_k, ik)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the form inductor traces
    compiled = cache.gather(1)
    assert torch.equal(compiled[0], history[0])
    assert torch.equal(compiled[1], history[1])


def test_prefill_groups_rows_of_similar_length():
    rows = list("abcde")
    assert engine.similar_lengths(rows, [8, 8, 8, 8, 8], 512) == [rows]
    groups = engine.similar_lengths(rows, [100, 3, 90, 4, 95], 512)
    assert groups == [["a", "e", "c"], ["d", "b"]]  # 100 and 3 in one forward would pad 97 tokens
    assert engine.similar_lengths(rows, [900, 600, 3, 3, 3], 512) == [["a", "b"], ["c", "d", "e"]]


def test_cached_logprobs_match_full_forward(ckpt, one_thread):
    eng = make_engine(ckpt, prefix_cache=False)
    sp = sampling.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    r = eng.generate([PROMPTS[2]], sp)[0]
    full = torch.log_softmax(eng.model(torch.tensor([PROMPTS[2] + r.out]))[0, len(PROMPTS[2]) - 1 : -1], -1)
    want = full.gather(-1, torch.tensor(r.out)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-9)
    assert [t[0][0] for t in r.top] == r.out and len(r.top[0]) == 3


def test_int8_indexer_logprobs_match_the_int8_full_forward_not_the_float_one(ckpt, one_thread):
    """index_quant "int8" really changes the selection: the engine's logprobs equal the full forward's with
    int8 selection (1e-9) and differ from the float selection's; a request to an Engine whose index_quant
    changed after its cache was built fails with the reason rather than mix float and int8 keys."""
    eng = make_engine(ckpt, "int8", prefix_cache=False)
    sp = sampling.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompt = list(range(40, 70))  # 30 tokens: well past index_topk = 5
    r = eng.generate([prompt], sp)[0]
    ids = torch.tensor([prompt + r.out])
    got = torch.tensor(r.logprobs, dtype=torch.float64)
    want = {}
    for index_quant in ("int8", "none"):
        eng.model.config.index_quant = index_quant
        full = torch.log_softmax(eng.model(ids)[0, len(prompt) - 1 : -1], -1)
        want[index_quant] = full.gather(-1, torch.tensor(r.out)[:, None])[:, 0]
    torch.testing.assert_close(got, want["int8"], rtol=0, atol=1e-9)
    assert (got - want["none"]).abs().max() > 1e-6
    bad = eng.generate([prompt], sp)[0]  # the config now says "none", the Engine's cache holds int8 keys
    assert bad.finish == "error" and "set index_quant before building the cache" in bad.error
    with pytest.raises(ValueError, match="divisible by 4"):
        tiny_config(index_quant="int8", index_head_dim=10)


def test_continuous_batching_join_midway(ckpt, one_thread):
    eng = make_engine(ckpt)
    longer = sampling.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a = eng.submit(PROMPTS[0], longer)
    for _ in range(4):
        eng.step()
    b = eng.submit(PROMPTS[2], GREEDY)  # joins a batch already decoding
    while a.finish is None or b.finish is None:
        eng.step()
    ref = make_engine(ckpt, prefix_cache=False)
    assert a.out == ref.generate([PROMPTS[0]], longer)[0].out
    assert b.out == ref.generate([PROMPTS[2]], GREEDY)[0].out
    assert a.finish == b.finish == "length"


def test_prefix_cache_hit_prefills_only_new_tokens(ckpt, one_thread):
    eng, cold = make_engine(ckpt), make_engine(ckpt, prefix_cache=False)
    first = list(range(20, 45))  # 25 tokens: 6 full pages of 4
    eng.generate([first], GREEDY)
    second = first + [7, 8, 9]
    before = dict(eng.stats)
    r = eng.generate([second], GREEDY)[0]
    assert r.n_cached == 24 and eng.stats["prefill_tokens"] - before["prefill_tokens"] == len(second) - 24
    assert r.out == cold.generate([second], GREEDY)[0].out
    # a prompt that is exactly cached full pages still prefills its last page (its logits start decoding)
    again = eng.generate([first[:24]], GREEDY)[0]
    assert again.n_cached == 20 and again.out == cold.generate([first[:24]], GREEDY)[0].out
    # the cached pages are shared, not copied, and survive until evicted
    assert eng.cache.available() == eng.cache.num_pages and len(eng.cache.cached) >= 6


def test_prefix_cache_evicts_lru_when_full(ckpt, one_thread):
    eng = make_engine(ckpt, num_pages=12)
    eng.generate([list(range(10, 30))], GREEDY)  # fills the cache with registered pages
    r = eng.generate([list(range(100, 125))], GREEDY)[0]  # needs 9 pages: must evict
    assert r.finish == "length" and eng.cache.available() == 12


def test_stop_conditions(ckpt, one_thread):
    eng = make_engine(ckpt)
    r = eng.generate([PROMPTS[0]], GREEDY)[0]
    eng.stop_ids = {r.out[3]}
    s = eng.generate([PROMPTS[0]], sampling.SamplingParams(max_tokens=10, temperature=0))[0]
    assert s.finish == "stop" and s.out == r.out[: r.out.index(r.out[3]) + 1]
    text = ckpt[1].decode(r.out)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    t = eng.generate(
        [PROMPTS[0]], sampling.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert t.finish == "stop" and stop not in t.text and text.startswith(t.text)
    with pytest.raises(ValueError, match="context"):
        eng.submit(list(range(1, 10)) * 60, GREEDY)


def test_a_request_that_fails_alone_leaves_the_engine_serving(ckpt, one_thread):
    """A prefill that raises (here: a nan temperature makes the probabilities nan, which the HTTP layer
    refuses) fails that request only: the one behind it runs, every page comes back, and the failed
    prompt's half-written pages never enter the prefix cache."""
    eng = make_engine(ckpt)
    bad = eng.submit(
        PROMPTS[2], sampling.SamplingParams(max_tokens=4, temperature=float("nan"), ignore_eos=True)
    )
    good = eng.submit(PROMPTS[0], GREEDY)
    while eng.step():
        pass
    assert bad.finish == "error" and "internal error" in bad.error and good.finish == "length"
    assert good.out == make_engine(ckpt).generate([PROMPTS[0]], GREEDY)[0].out
    assert eng.cache.available() == eng.cache.num_pages
    layer, calls = eng.model.model.layers[2], []  # now a prefill that dies half-way through the layers
    real = layer.forward

    def dies_the_first_time(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("a layer dies mid-prefill")
        return real(*a, **k)

    layer.forward = dies_the_first_time
    other = list(range(60, 81))
    assert eng.generate([other], GREEDY)[0].finish == "error"
    del layer.forward
    want = make_engine(ckpt).generate([other, PROMPTS[2]], GREEDY)
    again = eng.generate([other, PROMPTS[2]], GREEDY)  # no page of the failed prefill was cached as valid
    assert [r.out for r in again] == [r.out for r in want] and again[0].n_cached == 0


def test_aborted_waiting_requests_leave_the_queue(ckpt, one_thread):
    """Clients that hang up while queued (the batch is full) are dropped at the next step, so they
    neither fill the waiting queue (EngineFull, a 503) nor hold anyone up."""
    eng = make_engine(ckpt, max_batch=1, max_waiting=2)
    busy = eng.submit(PROMPTS[0], GREEDY)
    eng.step()  # busy runs; the batch is full
    gone = [eng.submit(p, GREEDY) for p in PROMPTS[1:3]]
    with pytest.raises(engine.EngineFull):
        eng.submit(PROMPTS[3], GREEDY)
    for r in gone:
        r.aborted = True
    eng.step()
    assert [r.finish for r in gone] == ["abort", "abort"] and not eng.waiting and busy.finish is None
    late = eng.submit(PROMPTS[3], GREEDY)  # room again
    while eng.step():
        pass
    assert busy.finish == late.finish == "length" and eng.cache.available() == eng.cache.num_pages


def test_seeded_sampling_is_reproducible(ckpt, one_thread):
    eng = make_engine(ckpt)
    sp = sampling.SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = eng.generate([PROMPTS[1], PROMPTS[1]], sp)
    c = eng.generate(
        [PROMPTS[1]],
        sampling.SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, top_k=50, seed=8, ignore_eos=True),
    )[0]
    assert a.out == b.out != c.out


def test_sampling_probs_top_k_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = sampling.sampling_probs(logits, sampling.SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    p = sampling.sampling_probs(logits, sampling.SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]


def test_mtp_speculative_greedy_equals_plain(ckpt, one_thread):
    """On random weights the drafts are mostly wrong: greedy output must still equal plain decoding."""
    plain = [r.out for r in make_engine(ckpt).generate(PROMPTS, GREEDY)]
    for n in (1, 3):
        eng = make_engine(ckpt, spec_tokens=n)
        rs = eng.generate(PROMPTS, GREEDY)
        assert [r.out for r in rs] == plain
        assert all(1 <= sum(r.accepted) / len(r.accepted) <= n + 1 for r in rs)
        assert eng.cache.available() == eng.cache.num_pages


def test_mtp_drafts_follow_the_released_weights_contract(ckpt, one_thread):
    """The engine's first draft after a prefill equals the float64 reference's MTP step 1 (test_reference:
    the block reads the main stack's output after model.norm) at the prompt's last position, with the
    sampled token as its next token; and the hidden it carries to the next draft is the block's output after
    shared_head.norm, the tensor lm_head reads (lm_head(h_mtp) is the draft's logits). The norm weights are
    random, so a pre-norm hidden in either place misses by far more than the bound."""
    from reference import forward as reference

    m = engine.load_model(ckpt[0])
    W = {k: v.detach().clone() for k, v in weights.checkpoint_tensors(m.state_dict(), 3).items()}
    sp = sampling.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        eng = engine.Engine(m, ckpt[1], num_pages=64, page_size=4, spec_tokens=3)
        r = eng.submit(prompt, sp)
        with torch.no_grad():
            eng.admit_waiting()  # the prefill: the first token, the MTP block's pass, the first draft
        ids = torch.tensor([prompt + [r.out[0]]])  # the prompt and the token the main model sampled
        _, steps = reference(W, m.config, ids, sparse=True, mtp=1)
        d = (r.draft_logits - steps[0][0, len(prompt) - 1]).abs().max().item()
        assert d < 1e-9, f"first draft's logits against the reference's MTP step 1: {d:.3e}"
        d = (m.lm_head(r.h_mtp) - r.draft_logits).abs().max().item()
        assert d < 1e-12, f"the carried hidden is not the one lm_head reads: {d:.3e}"


@pytest.fixture(scope="module")
def learned_mtp(ckpt):
    """A tiny GLM-5 trained for 15 AdamW steps on a repeating 11-token cycle, the MTP loss at full
    weight: the main model and the MTP head both learn it (each next token follows from the last), so
    a correct engine accepts nearly every draft and a broken one (drafts from the wrong position or
    the wrong state) accepts almost none."""
    torch.manual_seed(0)
    m = model.GLM5(tiny_config(vocab_size=300, dsa_mode="dense"))
    g = torch.Generator().manual_seed(0)
    cycle = torch.randperm(300, generator=g)[:11]
    seq = cycle.repeat(4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(15):
        starts = torch.randint(0, 11, (4,), generator=g)
        x = torch.stack([seq[s : s + 17] for s in starts])  # (4, 17)
        _, losses = m(x[:, :-1], targets=x[:, 1:], mtp_weight=1.0)
        opt.zero_grad()
        losses["loss"].backward()
        opt.step()
    torch.set_num_threads(n)
    m.config.dsa_mode = "sparse"  # decoding runs DSA's top-k (index_topk=5) as the engine serves it
    prompts = [seq[i : i + 6].tolist() for i in (0, 3, 5)]
    return m.eval(), ckpt[1], prompts


def test_mtp_drafts_are_accepted_once_the_head_has_learned(learned_mtp, one_thread):
    m, tok, prompts = learned_mtp
    sp = sampling.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = engine.Engine(m, tok, num_pages=64, page_size=4).generate(prompts, sp)
    eng = engine.Engine(m, tok, num_pages=64, page_size=4, spec_tokens=3)
    rs = eng.generate(prompts, sp)
    assert [r.out for r in rs] == [r.out for r in plain]  # still lossless
    accept = sum(sum(r.accepted) for r in rs) / sum(len(r.accepted) for r in rs)
    assert accept > 3.0, accept  # tokens per verify forward, at most 4; 1: no draft ever kept
    sampled = sampling.SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    rs = eng.generate(prompts, sampled)  # the rejection rule keeps drafts the target agrees with
    assert sum(sum(r.accepted) for r in rs) / sum(len(r.accepted) for r in rs) > 2.0
    assert eng.cache.available() == eng.cache.num_pages


def test_rejection_sampler_matches_target():
    """Whatever the draft distribution q, the first token out of accept_drafts is distributed as p."""
    g = torch.Generator().manual_seed(0)
    V, n = 6, 20000
    p = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.07, 0.03], [1 / 6] * 6])
    q = torch.tensor([[0.05, 0.05, 0.1, 0.2, 0.3, 0.3]])
    counts = torch.zeros(V)
    for _ in range(n):
        d = sampling.draw(q[0], g)
        counts[sampling.accept_drafts(p, q, [d], g, greedy=False)[0]] += 1
    freq = counts / n
    assert (freq - p[0]).abs().max() < 0.015, (freq, p[0])  # q itself is off by 0.35


def test_penalties_are_subtracted_as_openai_specifies(ckpt):
    """OpenAI's presence and frequency penalties on a 5-token vocabulary, by hand:
    logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0), count over the tokens
    generated so far (not the prompt), before temperature."""
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    sp = sampling.SamplingParams(presence_penalty=0.25, frequency_penalty=0.5, temperature=0.5)
    # token 1 generated twice: 2 - 2 * 0.5 - 0.25 = 0.75; token 3 once: 4 - 0.5 - 0.25 = 3.25
    want = torch.tensor([1.0, 0.75, 3.0, 3.25, 5.0])
    assert sampling.penalize(logits, [1, 3, 1], sp).tolist() == want.tolist()
    p = sampling.sampling_probs(sampling.penalize(logits, [1, 3, 1], sp)[None], sp)[0]
    torch.testing.assert_close(p, (want / 0.5).softmax(-1))
    negative = sampling.SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0)  # encourage repeats
    assert sampling.penalize(logits, [4], negative).tolist() == [1.0, 2.0, 3.0, 4.0, 8.0]
    # the engine samples through them: greedy picks 4 while 5 - 0.75 * count(4) stays above 4
    eng = make_engine(ckpt)
    logits = torch.full((300,), -10.0, dtype=torch.float64)
    logits[3] = 4.0
    logits[4] = 5.0
    r = engine.Request([4, 4, 4], sampling.SamplingParams(temperature=0, frequency_penalty=0.75), set())
    for _ in range(3):
        eng.sample_append([r], logits[None])
    assert r.out == [4, 4, 3]  # 5, then 4.25, then 3.5 < 4: the prompt's three 4s do not count


def test_penalized_decoding_matches_the_full_forward_with_penalties_by_hand(ckpt, one_thread):
    """Paged decoding under penalties, plain and with MTP drafts, equals the full forward with the
    penalties applied by hand, greedy, token by token."""
    penalties = {"presence_penalty": 0.7, "frequency_penalty": 1.3}
    sp = sampling.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **penalties)
    eng = make_engine(ckpt)
    prompt = PROMPTS[1]
    out = []
    for _ in range(12):
        logits = eng.model(torch.tensor([prompt + out]))[0, -1]
        count = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1])
        out.append(int((logits - 1.3 * count - 0.7 * (count > 0)).argmax()))
    assert eng.generate([prompt], sp)[0].out == out
    assert make_engine(ckpt, spec_tokens=3).generate([prompt], sp)[0].out == out
    unpenalized = sampling.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert eng.generate([prompt], unpenalized)[0].out != out  # the penalties did change the reply


# -----------------------------------------------------------------------------
# Weight updates: a new policy version between two engine steps


@pytest.fixture(scope="module")
def ckpt_v1(ckpt, tmp_path_factory):
    """The same config with other random weights: the policy a trainer pushes as version 1."""
    m = randomize(model.GLM5(tiny_config(vocab_size=300)).double(), seed=2)
    d = tmp_path_factory.mktemp("ckpt_v1")
    weights.save_pretrained(m, d, dtype=torch.float64)
    return str(d), ckpt[1]


@pytest.mark.parametrize("spec", [0, 2])
def test_in_flight_requests_continue_on_the_new_weights(ckpt, ckpt_v1, one_thread, spec):
    """Tokens sampled before the swap carry version 0, after it version 1; what follows the swap is the new
    model's own greedy continuation (its cache was recomputed, not mixed), a request admitted after the
    swap equals an engine built on the new weights, and the prefix cache was emptied."""
    sp = sampling.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eng = make_engine(ckpt, spec_tokens=spec)
    eng.generate([PROMPTS[3]], sp)  # leaves its pages in the prefix cache
    assert eng.cache.cached
    rs = [eng.submit(p, sp) for p in PROMPTS[:2]]
    eng.step()
    eng.step()
    before = [len(r.out) for r in rs]
    assert all(0 < n < 12 for n in before)
    assert eng.update_weights(ckpt_v1[0], 1) == 2
    assert eng.version == 1 and not eng.cache.cached and eng.stats["recomputed_tokens"] > 0
    late = eng.submit(PROMPTS[2], sp)
    while eng.step():
        pass
    ref = make_engine(ckpt_v1, spec_tokens=spec)
    for r, n in zip(rs, before):
        assert r.versions == [0] * n + [1] * (12 - n)
        rest = ref.generate([r.prompt + r.out[:n]], dataclasses.replace(sp, max_tokens=12 - n))[0]
        assert r.out[n:] == rest.out
    assert late.versions == [1] * 12
    assert late.out == ref.generate([PROMPTS[2]], sp)[0].out
    assert eng.cache.available() == eng.cache.num_pages  # the flushed pages all came back


def test_refused_weight_updates_change_nothing(ckpt, ckpt_v1, tmp_path, one_thread):
    """A version not above the current one, a missing or empty directory, a checkpoint of other shapes and
    one holding a nan are refused with one sentence each; the weights stay bit for bit, and so do the
    version and cache."""
    eng = make_engine(ckpt)
    first = eng.generate([PROMPTS[0]], GREEDY)[0].out
    served = {k: v.clone() for k, v in eng.model.state_dict().items()}
    cached = dict(eng.cache.cached)
    other = tmp_path / "other"
    weights.save_pretrained(model.GLM5(tiny_config(vocab_size=280)), other, dtype=torch.float64)
    deeper = tmp_path / "deeper"  # every served tensor fits, and one more layer besides
    weights.save_pretrained(
        model.GLM5(tiny_config(vocab_size=300, num_hidden_layers=4)), deeper, dtype=torch.float64
    )
    (tmp_path / "empty").mkdir()
    diverged = tmp_path / "diverged"  # a run that blew up: one nan among the right shapes
    broken = model.GLM5(tiny_config(vocab_size=300)).double()
    with torch.no_grad():
        broken.model.layers[1].self_attn.kv_b_proj.weight[3, 5] = float("nan")
    weights.save_pretrained(broken, diverged, dtype=torch.float64)
    refusals = [
        (ckpt_v1[0], 0, engine.VersionConflict, "not above"),
        (ckpt_v1[0], -3, engine.VersionConflict, "not above"),
        (ckpt_v1[0], "1", engine.VersionConflict, "not above"),
        (str(tmp_path / "nope"), 1, ValueError, "no save_pretrained directory"),
        (str(tmp_path / "empty"), 1, ValueError, "cannot load"),
        (str(other), 1, ValueError, "does not fit"),
        (str(deeper), 1, ValueError, "lacks"),
        (str(diverged), 1, ValueError, "non-finite value .* in model.layers.1.self_attn.kv_b_proj.weight"),
    ]
    for path, version, error, says in refusals:
        with pytest.raises(error, match=says):
            eng.update_weights(path, version)
        assert eng.version == 0 and eng.cache.cached == cached
        assert all(torch.equal(v, served[k]) for k, v in eng.model.state_dict().items())
    assert eng.generate([PROMPTS[0]], GREEDY)[0].out == first
    eng.update_weights(ckpt_v1[0], 5)
    for version in (5, 4):  # versions only increase
        with pytest.raises(engine.VersionConflict):
            eng.update_weights(ckpt[0], version)
    assert eng.version == 5
