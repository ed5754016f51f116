"""kernels_quant.py: the INT4 packing against compressed-tensors' order on hand-made words, the activation
quantizer against vLLM's rule, the integer references against dequantize-then-matmul in float64, and every
Triton kernel against the integer reference, on fresh random inputs with ragged sizes (M = 1, K not a
multiple of 8, empty experts).

The references run in this process. The kernels run under Triton's CPU interpreter, which must be switched
on before triton is first imported (other test modules import it without): test_kernels_under_the_interpreter
runs this file again in a fresh process with TRITON_INTERPRET=1 NANOGLM_KERNELS=triton (marked slow: ~15 s
on an idle machine, minutes on a busy one). To see those tests
one by one:
    TRITON_INTERPRET=1 NANOGLM_KERNELS=triton python -m pytest -q tests/test_kernels_quant.py
With a CUDA GPU the kernel tests also run natively (bf16 included). Every buffer a launcher allocates with
torch.empty is poisoned first (NaN; -128 for int8, a value no kernel writes), so an element a kernel forgets
to write fails the comparison.
"""

import pytest
import torch

import kernels
import kernels_quant as kq
from conftest import poisoned, rel_err, run_under_interpreter

INTERPRETED = kernels.INTERPRET and kernels.MODE == "triton"  # this process is the interpreter run
if INTERPRETED:
    CASES = [("cpu", torch.float32), ("cpu", torch.float16)]  # the interpreter mishandles bf16 dots
elif kernels.HAVE_TRITON and torch.cuda.is_available() and kernels.use_triton(torch.zeros(1, device="cuda")):
    CASES = [("cuda", torch.float32), ("cuda", torch.float16), ("cuda", torch.bfloat16)]
else:
    CASES = []  # nothing native to run here: the kernels run in the interpreter process


def quantize_weight(w, bits, group_size=None):
    """Round-to-nearest symmetric weights, the way quantize.py stores them: w (N, K) -> w_q (N, K) int8 in
    [-2^(b-1), 2^(b-1) - 1], scale (N, ceil(K / g)) fp32."""
    N, K = w.shape
    g = group_size or K
    qmax = 2 ** (bits - 1) - 1
    groups = torch.nn.functional.pad(w.float(), (0, kq.cdiv(K, g) * g - K)).view(N, -1, g)
    scale = groups.abs().amax(-1).clamp_min(1e-12) / qmax  # (N, G)
    w_q = torch.round(groups / scale[..., None]).clamp(-qmax - 1, qmax).view(N, -1)[:, :K]
    return w_q.to(torch.int8), scale


# -----------------------------------------------------------------------------
# 1. INT4 packing: compressed-tensors' pack_to_int32 order


def test_pack_int4_puts_the_first_value_in_the_lowest_nibble():
    q = torch.arange(-8, 8)[None]  # (1, 16): stored values 0 .. 15
    # word 0 holds stored 0..7 -> 0x76543210; word 1 stored 8..15 -> 0xFEDCBA98, as int32 bits
    assert kq.pack_int4(q).tolist() == [[0x76543210, 0xFEDCBA98 - 2**32]]
    # K = 9: the second word holds one value and zero padding (stored 0, which would read back as -8)
    q = torch.tensor([[3, -8, 7, 0, -1, 2, -3, 4, -1]])
    words = [sum((v + 8) << (4 * i) for i, v in enumerate(q[0, j : j + 8].tolist())) for j in (0, 8)]
    words = [w - 2**32 if w >= 2**31 else w for w in words]
    assert kq.pack_int4(q).tolist() == [words] and words[1] == 7
    assert kq.unpack_int4(kq.pack_int4(q), 9).tolist() == q.tolist()


@pytest.mark.parametrize("K", [1, 8, 13, 64])
def test_int4_round_trip(K):
    q = torch.randint(-8, 8, (5, K))
    packed = kq.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, kq.cdiv(K, 8))
    back = kq.unpack_int4(packed, K)
    assert back.dtype == torch.int8 and torch.equal(back.long(), q)


def test_int4_packing_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        kq.pack_int4(torch.tensor([[8]]))
    with pytest.raises(ValueError, match="integer"):
        kq.pack_int4(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="ceil"):
        kq.unpack_int4(torch.zeros(2, 2, dtype=torch.int32), 17)


# -----------------------------------------------------------------------------
# 2. The activation quantizer


def test_quantize_activations_is_vllms_dynamic_per_token_rule():
    x = torch.randn(6, 50) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0  # an all-zero token: q = 0 and scale 0, no division by zero
    x[3, :4] = torch.tensor([127.0, 0.5, 2.5, -1.5])  # absmax 127: scale 1, x * 127 / absmax = x, ties
    x[3, 4:] = x[3, 4:].clamp(-100, 100)
    x_q, x_scale = kq.quantize_activations(x)
    assert x_q.dtype == torch.int8 and x_scale.dtype == torch.float32 and x_scale.shape == (6, 1)
    assert x_q.abs().max() == 127 and x_q.min() >= -127
    assert torch.equal(x_scale[:, 0], x.abs().amax(-1) / 127)
    assert x_q[3, :4].tolist() == [127, 0, 2, -2]  # half to even
    assert x_scale[2].item() == 0 and x_q[2].eq(0).all()
    # within half a step of the input
    assert ((x_q.float() * x_scale - x).abs() <= x_scale * (0.5 + 1e-5)).all()
    # 127 / absmax correctly rounded to fp32 (as CUDA divides), then x times it rounded half to even
    x = torch.randn(2000, 64).half().float()  # fp16 inputs land near halves often
    inv = (127 / x.abs().amax(-1, keepdim=True).double()).float()
    assert torch.equal(kq.quantize_activations(x)[0], torch.round(x * inv).to(torch.int8))


# -----------------------------------------------------------------------------
# 3. The integer references equal dequantize-then-matmul in float64


def random_int4(N, K, group_size):
    w = torch.randn(N, K)
    w_q, scale = quantize_weight(w, 4, group_size)
    return w, kq.pack_int4(w_q), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, K, N, group_size", [(1, 13, 7, None), (9, 96, 40, 32), (5, 100, 24, 32)])
def test_w4a8_reference_is_dequantize_then_matmul(dtype, M, K, N, group_size):
    w, packed, scale = random_int4(N, K, group_size)
    x = torch.randn(2, M, K).to(dtype)
    y = kq.w4a8_linear(x, packed, scale, K, group_size)
    assert y.dtype == dtype and y.shape == (2, M, N)
    exact = kq.w4a8_linear_fp64(x.view(-1, K), packed, scale, K, group_size)
    y32 = kq.w4a8_linear_ref(x.float(), packed, scale, K, group_size).view(-1, N)
    assert rel_err(y32, exact) < 1e-6  # the integer path is exact up to fp32 scaling
    assert rel_err(y.view(-1, N), exact) < (1e-6 if dtype == torch.float32 else 2e-3)
    # and it approximates the float matmul as 4-bit weights should (a packing bug gives ~100%)
    ref = x.view(-1, K).double() @ w.double().T
    assert (y.view(-1, N).double() - ref).norm() / ref.norm() < 0.2


def test_w8a8_reference_is_dequantize_then_matmul():
    w = torch.randn(24, 70)
    w_q, scale = quantize_weight(w, 8)
    x = torch.randn(3, 11, 70)
    y = kq.w8a8_linear(x, w_q, scale)
    assert y.shape == (3, 11, 24)
    assert rel_err(y.view(-1, 24), kq.w8a8_linear_fp64(x.view(-1, 70), w_q, scale)) < 1e-6
    ref = x.double() @ w.double().T
    assert (y.double() - ref).norm() / ref.norm() < 0.02


@pytest.mark.parametrize("group_size", [None, 32])
def test_w4a8_experts_reference(group_size):
    E, N, K = 5, 24, 72
    counts = torch.tensor([3, 0, 1, 0, 6])  # empty experts, a single-row expert
    x = torch.randn(int(counts.sum()), K)
    ws = [random_int4(N, K, group_size) for _ in range(E)]
    packed = torch.stack([p for _, p, _ in ws])  # (E, N, ceil(K / 8))
    scale = torch.stack([s for _, _, s in ws])  # (E, N, G)
    y = kq.w4a8_experts(x, counts, packed, scale, K, group_size)
    assert rel_err(y, kq.w4a8_experts_fp64(x, counts, packed, scale, K, group_size)) < 1e-6
    a = 0
    for e, n in enumerate(counts.tolist()):  # each expert's rows equal that expert's linear
        assert torch.equal(y[a : a + n], kq.w4a8_linear(x[a : a + n], packed[e], scale[e], K, group_size))
        a += n


def test_bad_shapes_get_a_sentence():
    _, packed, scale = random_int4(8, 64, 32)
    with pytest.raises(ValueError, match="must agree"):
        kq.w4a8_linear(torch.randn(2, 63), packed, scale, 64)
    with pytest.raises(ValueError, match="needs 1"):
        kq.w4a8_linear(torch.randn(2, 64), packed, scale, 64, group_size=64)
    with pytest.raises(ValueError, match="pass group_size"):
        kq.w4a8_linear(torch.randn(2, 64), packed, torch.cat([scale, scale[:, :1]], 1), 64)
    with pytest.raises(ValueError, match="sums to"):
        packed2, scale2 = packed.expand(2, -1, -1), scale.expand(2, -1, -1)
        kq.w4a8_experts_ref(torch.randn(3, 64), torch.tensor([1, 1]), packed2, scale2, 64)


def test_triton_group_sizes():
    assert kq.k_tile(100, 100, 128) == 128  # per channel: any K
    assert kq.k_tile(256, 128, 128) == 128 and kq.k_tile(256, 32, 128) == 32 and kq.k_tile(192, 96, 128) == 32
    with pytest.raises(ValueError, match="multiples of 32"):
        kq.k_tile(96, 48, 128)


# -----------------------------------------------------------------------------
# 4. The Triton kernels against the integer references (interpreter on a CPU, natively on a GPU)


@pytest.mark.slow
def test_kernels_under_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is the interpreter run")
    status, passed, log = run_under_interpreter(__file__)
    assert status == 0, log
    assert passed >= 44, log  # every kernel case of this file ran there (44 on this tree)
    assert "no Triton device in this process" not in log, log  # none skipped for want of a device


@pytest.fixture(
    params=CASES or [pytest.param(None, marks=pytest.mark.skip("no Triton device in this process"))],
    ids=lambda c: f"{c[0]}-{str(c[1])[6:]}" if c else "none",
)
def case(request):
    return request.param


def close(got, ref, dtype):
    """The kernels do the reference's integer sums and its fp32 scaling in the same order: equal up to an
    ulp of the fp32 result, then rounding to the output dtype."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert rel_err(got, ref) <= (1e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("M, K", [(1, 13), (7, 300)])
def test_quantize_kernel(case, M, K):
    dev, dtype = case
    x = (torch.randn(M, K) * torch.logspace(-2, 2, M)[:, None]).to(dev, dtype)
    if M > 1:
        x[1] = 0  # an all-zero token
        x[2, :3] = torch.tensor([64.0, 0.5, -2.5])  # absmax 127 * 0.5039...: not a tie; the next row is
        x[3, :4] = torch.tensor([127.0, 0.5, 2.5, -1.5])  # absmax 127: scale 1, exact ties
        x[3, 4:] = x[3, 4:].clamp(-100, 100)
    assert kernels.use_triton(x)
    with poisoned():
        x_q, x_scale = kq.quantize_activations_triton(
            x, block_k=128
        )  # 300 = two full blocks and a ragged one
    r_q, r_scale = kq.quantize_activations_ref(x)
    assert torch.equal(x_q, r_q) and torch.equal(x_scale, r_scale)


@pytest.mark.parametrize("M, K, N", [(1, 50, 40), (70, 130, 70)])
def test_w8a8_kernel(case, M, K, N):
    dev, dtype = case
    w_q, scale = quantize_weight(torch.randn(N, K), 8)
    x = torch.randn(M, K).to(dev, dtype)
    w_q, scale = w_q.to(dev), scale.to(dev)
    assert kernels.use_triton(x)  # the kernel runs, not the reference it is compared with
    with poisoned():
        y = kq.w8a8_linear(x, w_q, scale)
    close(y, kq.w8a8_linear_ref(x, w_q, scale), dtype)


# (M, K, N, group_size): M = 1 decode, K not a multiple of 8, groups of one tile, of several tiles, a
# ragged last group
W4A8_CASES = [(1, 13, 7, None), (19, 100, 40, None), (5, 96, 70, 32), (17, 200, 33, 64), (3, 256, 16, 128)]


@pytest.mark.parametrize("M, K, N, group_size", W4A8_CASES)
def test_w4a8_kernel(case, M, K, N, group_size):
    dev, dtype = case
    _, packed, scale = random_int4(N, K, group_size)
    x = torch.randn(2, M, K).to(dev, dtype)
    packed, scale = packed.to(dev), scale.to(dev, dtype)  # scales stored in the weights' dtype
    assert kernels.use_triton(x)  # the kernel runs, not the reference it is compared with
    with poisoned():
        y = kq.w4a8_linear(x, packed, scale, K, group_size)
    close(y, kq.w4a8_linear_ref(x, packed, scale, K, group_size), dtype)


@pytest.mark.parametrize(
    "counts, K, group_size",
    [
        ([3, 0, 1, 0, 20], 72, None),
        ([3, 0, 1, 0, 20], 72, 32),
        ([0, 0, 1, 0, 0], 13, None),
        ([0] * 5, 64, None),
    ],
)
def test_w4a8_experts_kernel(case, counts, K, group_size):
    dev, dtype = case
    E, N = 5, 40
    counts = torch.tensor(counts, device=dev)
    x = torch.randn(int(counts.sum()), K).to(dev, dtype)
    ws = [random_int4(N, K, group_size) for _ in range(E)]
    packed = torch.stack([p for _, p, _ in ws]).to(dev)
    scale = torch.stack([s for _, _, s in ws]).to(dev)
    assert kernels.use_triton(x)  # the kernel runs, not the reference it is compared with
    with poisoned():
        y = kq.w4a8_experts(x, counts, packed, scale, K, group_size)
    ref = kq.w4a8_experts_ref(x, counts, packed, scale, K, group_size)
    if ref.numel():
        close(y, ref, dtype)
    assert y.shape == ref.shape
