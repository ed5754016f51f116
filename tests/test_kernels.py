"""kernels.py and kernels_moe.py: every Triton kernel against its torch reference, on fresh random inputs
with ragged sizes.

On a CPU the kernels run under Triton's interpreter, in fp32 and fp16 (the interpreter mishandles bf16 dot
products); with a CUDA GPU the same tests also run natively, bf16 included. Triton's interpreter must be
switched on before triton is first imported, and the other test modules import it (through model.py)
without it, so `test_kernels_under_the_interpreter` runs this file again in a fresh process with
TRITON_INTERPRET=1 NANOGLM_KERNELS=triton; to see its tests one by one, run that yourself:
    TRITON_INTERPRET=1 NANOGLM_KERNELS=triton python -m pytest -q tests/test_kernels.py
Every buffer a kernel wrapper allocates with torch.empty is poisoned first (NaN; -128 for int8, a value no
kernel writes), so an element a kernel forgets to write fails the comparison.
"""

import functools

import pytest
import torch

import dsa
import kernels
import experts
import kernels_moe
import model
from conftest import poisoned, randomize, rel_err, run_under_interpreter, tiny_config

pytest.importorskip("triton")

INTERPRETED = kernels.INTERPRET and kernels.MODE == "triton"  # this process is the interpreter run
if INTERPRETED:
    CASES = [("cpu", torch.float32), ("cpu", torch.float16)]
elif torch.cuda.is_available() and kernels.use_triton(torch.zeros(1, device="cuda")):
    CASES = [("cuda", torch.float32), ("cuda", torch.float16), ("cuda", torch.bfloat16)]
else:
    CASES = []  # nothing native to run here: the kernels run in the interpreter process
# max |kernel - reference| / max |reference|; for fp32 inputs the kernels do exact fp32 dots (kernels.py's
# docstring says why), but the bound stays the tf32 one they were first run natively with
TOL = {("cpu", torch.float32): 2e-6, ("cuda", torch.float32): 5e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.mark.slow
def test_kernels_under_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is the interpreter run")
    status, passed, log = run_under_interpreter(__file__)
    assert status == 0, log
    assert passed >= 27, log  # every kernel case of this file ran there (27 on this tree)
    assert "no Triton device in this process" not in log, log  # none skipped for want of a device


@pytest.fixture(
    params=CASES or [pytest.param(None, marks=pytest.mark.skip("no Triton device in this process"))],
    ids=lambda c: f"{c[0]}-{str(c[1])[6:]}" if c else "none",
)
def case(request):
    dev, dtype = request.param
    return kernels, dev, dtype, TOL.get((dev, dtype), TOL.get(dtype))


def randn(*shape, dev, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, dtype=torch.float64)).to(dev, dtype)


# -----------------------------------------------------------------------------
# 1. The lightning indexer


@pytest.mark.parametrize("B, T, S, topk", [(2, 7, 45, 9), (3, 1, 37, 50)])  # a prefill block; decode, k > S
def test_index_scores_and_topk(case, B, T, S, topk):
    K, dev, dtype, tol = case
    Hi, Di = 3, 24  # not powers of two: padded heads and dims must not count
    ind = dsa.Indexer(40, 16, Hi, Di, 8).to(dev)  # the model's own scoring code is the reference
    q, w = randn(B, T, Hi, Di, dev=dev), randn(B, T, Hi, dev=dev)
    k = randn(B, S, Di, dev=dev, dtype=dtype)
    last = torch.randint(0, S, (B, T), device=dev)  # a query sees keys 0..last: ragged visible prefixes
    last[0, 0] = 2  # fewer visible keys than topk: invalid tail
    visible = torch.arange(S, device=dev) <= last[..., None]
    ref = ind.score(q, w, k.float()).masked_fill(~visible, float("-inf"))
    assert K.use_triton(q)
    with poisoned():
        got = K.index_scores(q, w, k, last, ind.softmax_scale, block_s=16)
    assert rel_err(got, ref) < tol
    idx, valid = dsa.index_topk(q, w, k, last, topk, ind.softmax_scale)  # through the kernel here
    ridx, rvalid = dsa.topk_select(ref, visible, min(topk, S))
    assert torch.equal(valid, rvalid) and not valid[0, 0, 3:].any()
    # the chosen keys are the best ones under the reference scores (near-ties may swap in bf16)
    picked = ref.gather(-1, idx).masked_fill(~valid, 0).sort(-1).values
    best = ref.gather(-1, ridx).masked_fill(~rvalid, 0).sort(-1).values
    assert (picked - best).abs().max() <= 2 * tol * ref[visible.expand_as(ref)].abs().max()


# -----------------------------------------------------------------------------
# 2. Sparse MLA


# prefill; decode, K split (in 2: 32 + 5)
@pytest.mark.parametrize("B, T, num_splits", [(2, 5, 1), (3, 1, 3)])
def test_sparse_mla(case, B, T, num_splits):
    K, dev, dtype, tol = case
    H, C, R, S, Ksel = 19, 20, 8, 40, 37  # 19 heads: two head blocks, the second ragged; 37 = 32 + 5 keys
    q_abs, q_pe = randn(B, T, H, C, dev=dev, dtype=dtype), randn(B, T, H, R, dev=dev, dtype=dtype)
    latent = randn(B, S, C + R, dev=dev, dtype=dtype)
    last = torch.randint(Ksel // 2, S, (B, T), device=dev)
    last[0, 0] = 3  # 4 visible keys, 37 selected slots: most are invalid
    visible = torch.arange(S, device=dev) <= last[..., None]
    idx, valid = dsa.topk_select(torch.randn(B, T, S, device=dev), visible, Ksel)
    scale = 0.3
    ref_o, ref_lse = dsa.sparse_mla_torch(q_abs.float(), q_pe.float(), latent.float(), idx, valid, scale)
    assert K.use_triton(q_abs)
    with poisoned():
        o, lse = K.sparse_mla(q_abs, q_pe, latent, idx, valid, scale, num_splits=num_splits)
    assert o.dtype == dtype and o.shape == (B, T, H, C) and lse.shape == (B, T, H)
    assert rel_err(o, ref_o) < tol and rel_err(lse, ref_lse) < tol


@pytest.mark.parametrize("B, T, H, Ksel, num_splits", [(2, 6, 19, 37, 1), (3, 1, 4, 5, 1), (2, 1, 4, 37, 3)])
def test_sparse_mla_backward_kernel_is_the_references_gradient(case, B, T, H, Ksel, num_splits):
    """Ragged heads and key blocks; decode; decode after a split-K forward (its merged o and lse are
    saved)."""
    K, dev, dtype, tol = case
    C, R, S = 20, 8, 40
    leaves = [
        randn(*s, dev=dev, dtype=dtype).requires_grad_() for s in ((B, T, H, C), (B, T, H, R), (B, S, C + R))
    ]
    # the last row is never visible: never selected
    last = torch.randint(Ksel // 2, S - 1, (B, T), device=dev)
    last[0, 0] = (
        2  # 3 visible keys, Ksel slots: the rest invalid. Queries share most rows: the atomics add up
    )
    visible = torch.arange(S, device=dev) <= last[..., None]
    idx, valid = dsa.topk_select(torch.randn(B, T, S, device=dev), visible, Ksel)
    g_o, g_lse = randn(B, T, H, C, dev=dev, dtype=dtype), randn(B, T, H, dev=dev)
    grads = []
    for fn in (functools.partial(K.sparse_mla, num_splits=num_splits), dsa.sparse_mla_torch):
        x = (
            leaves
            if fn is not dsa.sparse_mla_torch
            else [t.detach().double().requires_grad_() for t in leaves]
        )
        o, lse = fn(*x, idx, valid, 0.3)
        loss = (o.double() * g_o.double()).sum() + (lse.double() * g_lse.double()).sum()
        with poisoned():
            grads.append(torch.autograd.grad(loss, x))
    assert K.use_triton(leaves[0])
    for got, ref in zip(*grads):
        assert got.dtype == dtype
        assert rel_err(got, ref) < (2 * tol if dtype == torch.float16 else tol)
    chosen = torch.zeros(B, S, dtype=torch.bool, device=dev)
    chosen[torch.arange(B, device=dev)[:, None, None].expand_as(idx)[valid], idx[valid]] = True
    # a latent row no query selected gets exactly 0
    assert not chosen.all() and not grads[0][2][~chosen].any()


@pytest.mark.parametrize("B, T, H, Ksel", [(2, 5, 19, 37), (3, 1, 4, 5)])
def test_sparse_mla_target_is_the_attention_target(case, B, T, H, Ksel):
    """The sparse-stage KL target from the kernel's lse == dsa.attention_target of the probabilities."""
    K, dev, dtype, tol = case
    C, R, S = 20, 8, 40
    q_abs, q_pe, latent = (
        randn(*s, dev=dev, dtype=dtype) for s in ((B, T, H, C), (B, T, H, R), (B, S, C + R))
    )
    last = torch.randint(Ksel // 2, S, (B, T), device=dev)
    last[0, 0] = 2  # invalid slots get 0
    idx, valid = dsa.topk_select(
        torch.randn(B, T, S, device=dev), torch.arange(S, device=dev) <= last[..., None], Ksel
    )
    scores, _ = dsa.sparse_scores(q_abs.double(), q_pe.double(), latent.double(), idx, valid, 0.3)
    ref = dsa.attention_target(scores.softmax(-1), 2)  # (B, T, K), from the probabilities themselves
    _, lse = K.sparse_mla(q_abs, q_pe, latent, idx, valid, 0.3)
    with poisoned():
        got = K.sparse_mla_target(q_abs, q_pe, latent, idx, valid, lse, 0.3)
    assert got.dtype == torch.float32 and not got[~valid].any() and rel_err(got, ref) < tol


# -----------------------------------------------------------------------------
# 3. Grouped expert matmuls


@pytest.mark.parametrize("N", [1, 13])  # one token; a ragged batch
def test_grouped_expert_kernels(case, N):
    K, dev, dtype, tol = case
    E, D, Fh, k = 6, 40, 24, 2
    used = torch.tensor([0, 2, 4, 5])  # experts 1 and 3 get no tokens
    ids = used[torch.stack([torch.randperm(4)[:k] for _ in range(N)])].to(dev)  # (N, k)
    offsets = torch.nn.functional.pad(torch.bincount(ids.flatten(), minlength=E).cumsum(0), (1, 0))
    x = randn(N * k, D, dev=dev, dtype=dtype)
    w_gate, w_up = (
        randn(E, Fh, D, dev=dev, dtype=dtype, scale=0.3),
        randn(E, Fh, D, dev=dev, dtype=dtype, scale=0.3),
    )
    w_down, row_w = randn(E, D, Fh, dev=dev, dtype=dtype, scale=0.3), torch.rand(N * k, device=dev)
    assert K.use_triton(x) and (offsets[1:] == offsets[:-1]).any()
    blocks = dict(block_m=16, block_n=16, block_k=16)
    with poisoned():
        h = kernels_moe.grouped_swiglu(x, offsets, w_gate, w_up, **blocks)
        y = kernels_moe.grouped_down(h, offsets, w_down, row_w, **blocks)
    assert rel_err(h, kernels_moe.grouped_swiglu_ref(x.float(), offsets, w_gate.float(), w_up.float())) < tol
    assert rel_err(y, kernels_moe.grouped_down_ref(h.float(), offsets, w_down.float(), row_w)) < tol


def test_moe_experts_equals_the_model_moe(case, monkeypatch):
    """kernels_moe.moe_experts and the model's own MoE on its Triton path (no gradients: serving) against
    the MoE's per-expert loop in fp32."""
    K, dev, dtype, tol = case
    cfg = tiny_config(n_routed_experts=8, num_experts_per_tok=2)
    moe = randomize(model.MoE(cfg)).to(dev, dtype).eval()
    x = randn(2, 9, cfg.hidden_size, dev=dev, dtype=dtype)
    with torch.no_grad():
        monkeypatch.setattr(experts, "EXPERTS_IMPL", "loop")
        ref, _ = moe.float()(x.float())
        monkeypatch.setattr(experts, "EXPERTS_IMPL", "grouped")
        moe.to(dtype)
        flat = x.view(-1, cfg.hidden_size)
        ids, w, _ = moe.gate(flat)
        stacked = kernels_moe.stack_experts(moe)
        got = kernels_moe.moe_experts(flat, ids, w, *stacked) + moe.shared_experts(flat)
        with poisoned():
            own, _ = moe(x)  # experts.run_experts -> experts_triton
    assert rel_err(got.view_as(ref), ref) < 3 * tol
    assert rel_err(own, ref) < 3 * tol


# -----------------------------------------------------------------------------
# The dispatch rule and the model wiring


def test_dispatch_rule(monkeypatch):
    x = torch.zeros(2)
    for mode in ("auto", "torch"):
        monkeypatch.setattr(kernels, "MODE", mode)
        assert not kernels.use_triton(x)  # CPU data: the torch reference
    monkeypatch.setattr(kernels, "MODE", "triton")
    monkeypatch.setattr(kernels, "INTERPRET", True)
    assert kernels.use_triton(x)  # forced: Triton's interpreter
    monkeypatch.setattr(kernels, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.use_triton(x)


def test_model_runs_the_kernels_in_its_sparse_path(case, monkeypatch):
    """The tiny model with selection on (index_topk < length): the kernel path gives the torch path's logits,
    in a forward and in cached decoding; and a sparse-stage training step (the loss with its indexer KL) gives
    the torch path's losses and every parameter's gradient, through the backward and KL-target kernels."""
    K, dev, dtype, tol = case
    if dtype != torch.float32:
        pytest.skip("fp32 is enough: the kernels' dtypes are tested above")
    m = randomize(model.GLM5(tiny_config(index_topk=4))).to(dev).eval()
    x = torch.randint(0, 97, (2, 9), device=dev)

    def run():
        cache = model.KVCache(m.config, 2, 12, device=dev)
        return m(x), m(x[:, :7], cache=cache), m(x[:, 7:8], cache=cache, start_pos=7)

    def train_step():
        m.zero_grad()
        _, losses = m(x, x, indexer_kl=True)
        losses["loss"].backward()
        return [losses[k].detach() for k in ("lm", "mtp", "indexer_kl")] + [
            p.grad.clone() for p in m.parameters()
        ]

    calls = []
    for name in ("index_scores", "sparse_mla", "sparse_mla_bwd", "sparse_mla_target"):
        real = getattr(K, name)
        monkeypatch.setattr(
            K, name, lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw)
        )
    mode = K.MODE
    monkeypatch.setattr(K, "MODE", "torch")
    with torch.no_grad():
        ref = run()
    ref_train = train_step()
    monkeypatch.setattr(K, "MODE", mode)
    calls.clear()
    with torch.no_grad():
        got = run()
    n = 3 * m.config.num_hidden_layers  # 3 forwards, every layer selects (length > index_topk)
    assert calls.count("sparse_mla") == n and calls.count("index_scores") == n
    assert all((a - b).abs().max() < 10 * tol for a, b in zip(got, ref))
    calls.clear()
    got_train = train_step()
    layers = m.config.num_hidden_layers + m.config.num_mtp_steps  # the MTP block's layer runs once per step
    assert all(calls.count(f) == layers for f in ("sparse_mla", "sparse_mla_bwd", "sparse_mla_target")), calls
    attn = [
        g for (n, _), g in zip(m.named_parameters(), ref_train[3:]) if "self_attn" in n
    ]  # indexer's included
    # a KL, and attention gradients to compare
    assert ref_train[2] > 0 and all(g.abs().sum() > 0 for g in attn)
    bound = 1e-4 if dev == "cpu" else tol
    for a, b in zip(got_train, ref_train):
        assert (a - b).abs().max() <= bound * b.abs().max().clamp_min(1e-3)


def test_model_sparse_stage_under_autocast(case, monkeypatch):
    """train.py trains under autocast, where the queries are half precision but the normed latent is fp32:
    the kernels compute in autocast's dtype as torch would, so the kernel step is as close to an fp32 step
    as the torch step is (each gradient's error at most twice torch's, plus tol).
    Measured against the fp32 step rather than against each other: the indexer's gradients come through
    the KL, whose gradient (the indexer's distribution minus the attention's) is small, so half-precision
    rounding moves them by a large fraction in either path (on an H100 in bf16 the two paths' indexer
    gradients differed by 30%). Every run replays the torch run's selections: in half precision the index
    scores round differently and near-tied keys swap (2 of 6 selections did there); the index kernel's
    scores are compared on their own above."""
    K, dev, dtype, tol = case
    if dtype == torch.float32:
        pytest.skip("autocast to a half-precision dtype")
    m = randomize(model.GLM5(tiny_config(index_topk=4)), seed=0).to(dev).train()
    x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0)).to(dev)
    mode = K.MODE
    runs = {}
    real_topk = dsa.index_topk
    picked = []  # the torch run's selections, in call order
    queue = []  # what a replaying run has still to take

    def record(*args, **kw):  # the torch run: keep each selection
        picked.append(real_topk(*args, **kw))
        return picked[-1]

    def replay(*args, **kw):  # the other runs: their own selection runs (the index kernel's too), unused
        real_topk(*args, **kw)
        return queue.pop(0)

    calls = []  # the kernel launchers each run went through: the kernel run must really use them
    for launcher in ("sparse_mla", "sparse_mla_bwd", "sparse_mla_target"):
        real = getattr(K, launcher)
        monkeypatch.setattr(
            K, launcher, lambda *a, _real=real, _n=launcher, **kw: calls.append(_n) or _real(*a, **kw)
        )

    for name, kmode, topk, half in (
        ("torch", "torch", record, True),
        ("kernels", mode, replay, True),
        ("fp32", "torch", replay, False),
    ):
        queue[:] = picked
        calls.clear()
        monkeypatch.setattr(K, "MODE", kmode)
        monkeypatch.setattr(dsa, "index_topk", topk)
        m.zero_grad()
        with torch.autocast(dev, dtype=dtype, enabled=half):
            _, losses = m(x, x, indexer_kl=True)
        losses["loss"].backward()
        assert not queue  # a replaying run took every selection the torch run made
        if name == "kernels":
            assert set(calls) == {"sparse_mla", "sparse_mla_bwd", "sparse_mla_target"}, calls
        else:
            assert not calls, calls
        runs[name] = {"lm": losses["lm"].detach(), "indexer_kl": losses["indexer_kl"].detach()}
        for n, p in m.named_parameters():
            if "self_attn" in n:  # the indexer's included
                runs[name][n] = p.grad.clone()
    for n, exact in runs["fp32"].items():
        err_torch = float((runs["torch"][n] - exact).abs().max())
        err_kernels = float((runs["kernels"][n] - exact).abs().max())
        slack = (1e-2 if exact.dim() == 0 else tol) * float(exact.abs().max())  # the losses: 1% of the value
        assert err_kernels <= 2 * err_torch + slack, (n, err_kernels, err_torch, slack)


def test_compiled_decode_equals_eager_on_the_gpu(case):
    """serve.py --compile on a GPU: the prefill and decode forwards through torch.compile, where
    kernels.use_triton hands every kernel's work to inductor, gives the greedy tokens and logprobs of the
    eager engine, whose decode runs the Triton kernels (in fp32 both do exact fp32 dots, so a near-tied
    token of this random model cannot flip on tf32 rounding)."""
    import engine
    import sampling
    from conftest import tiny_chat_tokenizer

    K, dev, dtype, tol = case
    if dev != "cuda" or dtype != torch.float32:
        pytest.skip("the compiled engine on a GPU, once, in fp32")
    tok = tiny_chat_tokenizer()
    m = randomize(model.GLM5(tiny_config(vocab_size=320)), seed=1).to(dev).eval()
    sp = sampling.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [list(range(30, 70)), [5, 6, 7], list(range(100, 110))]  # DSA selects: 40 > index_topk
    graphs = torch._dynamo.utils.counters["stats"]
    out = {}
    for compiled in (False, True):
        before = graphs["unique_graphs"]
        eng = engine.Engine(m, tok, num_pages=64, page_size=4, compile=compiled)
        out[compiled] = eng.generate(prompts, sp)
        if compiled:  # graphs were really built: a silent fall back to eager would pass the rest
            assert graphs["unique_graphs"] > before
    for a, b in zip(out[False], out[True]):
        assert a.out == b.out
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-3)
