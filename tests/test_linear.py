"""linear.py: the CPU inference linear (oneDNN's GEMM) against its reference, F.linear, and the rule that
picks between them (fp32, no gradient, outside torch.compile, big enough).
Run: python -m pytest -q tests/test_linear.py"""

import pytest
import torch
import torch.nn.functional as F

import kernels
import linear
import model
from conftest import tiny_config

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or kernels.MODE == "torch",
    reason="oneDNN is not in this torch build (or NANOGLM_KERNELS=torch): linear is F.linear",
)


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 2048), (3, 5, 2048), (32, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_path_equals_f_linear(shape, bias):
    """oneDNN's product equals F.linear to fp32 rounding, for 2-d and 3-d rows, with and without a bias,
    and with a weight that is a transposed view (dsa.sparse_mla_torch reads its gathered rows that way)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(1024, 2048, generator=g)
    b = torch.randn(1024, generator=g) if bias else None
    with torch.no_grad():
        assert linear.uses_onednn(x, w, b)
        got = linear.linear(x, w, b)
        wt = w.t().contiguous().t()  # the same values, column-major
        got_t = linear.linear(x, wt, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == want.shape == (*shape[:-1], 1024)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)  # sums of 2048 terms ~45
    torch.testing.assert_close(got_t, want, rtol=1e-5, atol=1e-3)


@needs_onednn
def test_the_rule_takes_f_linear_where_onednn_cannot_or_should_not_run():
    x = torch.randn(4, 2048)
    w = torch.randn(1024, 2048)
    with torch.no_grad():
        assert linear.uses_onednn(x, w)
        assert not linear.uses_onednn(x.double(), w.double())  # exact tests run fp64
        assert not linear.uses_onednn(x.bfloat16(), w.bfloat16())  # bf16: left to torch's own dispatch
        assert not linear.uses_onednn(torch.randn(1, 128), torch.randn(128, 128))  # below ONEDNN_MIN_MACS
        assert not linear.uses_onednn(torch.randn(4, 4096)[:, ::2], w)  # strided rows
        assert not linear.uses_onednn(x, w, torch.randn(2048)[::2])  # a strided bias: oneDNN got it wrong
        assert not linear.uses_onednn(torch.randn(4, 1024), w)  # a width mismatch: F.linear's error
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not linear.uses_onednn(x, w)  # autocast: F.linear in bf16, as every other product
            assert linear.linear(x, w).dtype == torch.bfloat16
        torch._C._set_mkldnn_enabled(False)  # torch.backends.mkldnn.enabled = False
        try:
            assert not linear.uses_onednn(x, w)
        finally:
            torch._C._set_mkldnn_enabled(True)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        with torch.no_grad():
            linear.linear(torch.randn(4, 1024), w)
    w.requires_grad_(True)
    assert not linear.uses_onednn(x, w)  # training: the oneDNN op has no backward
    with torch.no_grad():
        assert linear.uses_onednn(x, w)


def test_gradients_flow_through_linear_as_through_f_linear():
    """With a gradient to take, linear is F.linear itself: same output and same gradients, bit for bit."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2048, generator=g, requires_grad=True)
    w = torch.randn(1024, 2048, generator=g, requires_grad=True)
    linear.linear(x, w).square().sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    F.linear(x, w).square().sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def test_compiled_linear_is_f_linear():
    """Inside torch.compile the rule says no (inductor lowers oneDNN's op only for frozen weights): the
    graph compiles and equals eager."""
    x = torch.randn(4, 2048)
    w = torch.randn(1024, 2048)
    seen = []

    def f(x, w):
        seen.append(linear.uses_onednn(x, w))
        return linear.linear(x, w).relu()

    with torch.no_grad():
        torch._dynamo.reset()
        got = torch.compile(f, backend="eager")(x, w)
    assert seen == [False]
    torch.testing.assert_close(got, F.linear(x, w).relu(), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_the_engines_swap_takes_the_fast_path_and_matches_fp64(onednn_calls):
    """A model as built runs F.linear (no oneDNN call); after use_onednn (what engine.Engine does) its
    forward in fp32 with wide enough layers goes through oneDNN (counted), keeps its parameters and names,
    and equals the same model in fp64 (every linear F.linear) to fp32 rounding."""
    # 48 rows x 256 x 512: the lm_head clears ONEDNN_MIN_MACS; dense attention, so no near-tied index
    # scores can select differently in fp32 and fp64
    cfg = tiny_config(vocab_size=512, hidden_size=256, dsa_mode="dense")
    torch.manual_seed(0)
    m = model.GLM5(cfg).eval()
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        plain = m(ids)
    assert onednn_calls == []
    names = {n: p.data_ptr() for n, p in m.named_parameters()}
    assert linear.use_onednn(m) is m
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == names
    assert isinstance(m.lm_head, linear.Linear)
    assert isinstance(m.model.layers[0].self_attn.q_b_proj, linear.Linear)
    with torch.no_grad():
        got = m(ids)
    assert any(onednn_calls)
    with torch.no_grad():
        want = m.double()(ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain.double(), want, rtol=1e-4, atol=1e-4)
