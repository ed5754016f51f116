"""dsa.py: selection, sparse (gathered, absorbed form) vs dense-masked (naive form) attention, the
dense limit, and indexer KL training (DeepSeek-V3.2 report; GLM-5 report, section 2 "DSA").
Run: python -m pytest -q tests/test_dsa.py (add -m "not slow" for the fast tier)."""

import pytest
import torch

import dsa
import model
from conftest import randomize, tiny_config


def f64_model(**kw):
    return randomize(model.GLM5(tiny_config(**kw)).double()).eval()


def causal(T, S=None):
    S = S or T
    return (torch.arange(S) <= torch.arange(S - T, S)[:, None])[None]  # (1, T, S)


def test_no_token_selects_the_future():
    B, T, k = 3, 40, 7
    scores = torch.randn(B, T, T)
    scores[:, :, -5:] += 100.0  # the future looks very attractive
    idx, valid = dsa.topk_select(scores, causal(T), k)
    t = torch.arange(T)[None, :, None]
    assert (idx[valid] <= t.expand_as(idx)[valid]).all()
    assert torch.equal(valid.sum(-1), torch.clamp(torch.arange(T) + 1, max=k).expand(B, T))
    # the selected set is the top-k of the visible scores
    vis = scores.masked_fill(~causal(T), float("-inf"))
    assert torch.equal(
        torch.sort(idx[:, -1], dim=-1).values, torch.sort(vis[:, -1].topk(k).indices, dim=-1).values
    )


def test_selection_is_deterministic_under_ties():
    T, k = 64, 10
    scores = torch.randint(0, 3, (2, T, T)).float()  # many exact ties
    first = dsa.topk_select(scores, causal(T), k)
    for _ in range(5):
        again = dsa.topk_select(scores.clone(), causal(T), k)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    # ties break toward the lower position
    flat = torch.zeros(1, 1, T)
    idx, _ = dsa.topk_select(flat, torch.ones(1, 1, T, dtype=torch.bool), k)
    assert idx[0, 0].tolist() == list(range(k))


def test_topk_with_packed_keys_equals_the_stable_sort_under_ties():
    """The fast selection (torch.topk over the score's bits and the position packed into one int64)
    equals the reference stable sort exactly, order included, under heavy ties: the toy indexer scores
    exactly 0 often (every ReLU head off), as +0.0 or -0.0 (a negative head weight), and the mask's -inf."""
    g = torch.Generator().manual_seed(0)
    B, T, S, k = 3, 17, 300, 64
    scores = torch.randint(-2, 3, (B, T, S), generator=g).float() / 4  # 5 values: ties everywhere
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
    scores[0, :, :100] = 0.0  # a query whose top-k is nearly all zeros
    scores[1] = torch.randn(T, S, generator=g)  # and one without ties
    visible = torch.rand(B, T, S, generator=g) < 0.7
    for kk in (k, S):
        fast = dsa.topk_select(scores, visible, kk)
        ref = dsa.topk_select(scores, visible, kk, exact_sort=True)
        assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
    keys = dsa.tie_broken_keys(torch.tensor([-1.5, -0.0, 0.0, 1e-30, 2.0, float("-inf"), 0.0]))
    assert keys.argsort(descending=True).tolist() == [4, 3, 1, 2, 6, 0, 5]


def test_int8_index_keys_pack_their_scale_exactly():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 5, 16, generator=g) * torch.rand(3, 5, 1, generator=g)
    packed = dsa.pack_index_keys(k)
    assert packed.dtype == torch.int8 and packed.shape == (3, 5, 16 + dsa.SCALE_BYTES)
    k_int, scale = dsa.unpack_index_keys(packed)
    assert torch.equal(scale, k.abs().amax(-1) / 127)  # the fp32 scale's bits survive the int8 bytes
    assert k_int.abs().max() == 127
    err = (dsa.dequantize_index_keys(packed) - k).abs()
    assert (err <= scale[..., None] / 2 + 1e-7).all()  # rounding to the nearest step of the scale
    with pytest.raises(ValueError, match="divisible by 4"):  # the scale must sit in the row's last word
        dsa.pack_index_keys(torch.randn(3, 10))


def test_int8_index_scores_are_exact_integers_near_the_float_scores():
    """The int8 scores equal a float64 sum by hand (the dot products are exact integers), stay near the
    float scores, and the selection from them keeps the causal mask."""
    g = torch.Generator().manual_seed(2)
    B, T, Hi, D, S = 2, 3, 4, 32, 40
    keys = torch.randn(B, S, D, generator=g)
    q, w = torch.randn(B, T, Hi, D, generator=g), torch.randn(B, T, Hi, generator=g)
    packed = dsa.pack_index_keys(keys)  # (B, S, D + 4)
    got = dsa.quantized_index_scores(q, w, packed, 0.3)  # (B, T, S)
    q_int, q_scale = dsa.quantize_int8(q)
    k_int, k_scale = dsa.unpack_index_keys(packed)
    dots = torch.einsum("bthd,bsd->bths", q_int.double(), k_int.double()).relu()
    by_hand = torch.einsum("bths,bth->bts", dots, (w * q_scale * 0.3).double()) * k_scale.double()[:, None]
    torch.testing.assert_close(got.double(), by_hand, rtol=1e-6, atol=0)
    exact = dsa.index_scores(q, w, keys, 0.3)
    assert (got - exact).abs().max() < 0.03 * exact.abs().max()
    last = torch.tensor([[20, 30, 39], [5, 6, 7]])
    idx, valid = dsa.index_topk(q, w, packed, last, 6, 0.3)
    assert (idx <= last[..., None]).all()  # the causal mask holds for quantized scores too


def test_gather_rows_equals_indexing_per_row():
    # index_select over flattened rows against the reference (two index tensors)
    B, S, T, K, F = 3, 11, 2, 5, 7
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(B, S, F, generator=g)
    idx = torch.randint(0, S, (B, T, K), generator=g)
    ref = latent[torch.arange(B)[:, None, None], idx]
    assert torch.equal(dsa.gather_rows(latent, idx), ref)
    cut = latent[:, : S - 2]  # a non-contiguous slice of the rows, as a cache's history can be
    ref = cut[torch.arange(B)[:, None, None], idx.clamp(max=S - 3)]
    assert torch.equal(dsa.gather_rows(cut, idx.clamp(max=S - 3)), ref)


def test_selected_index_scores_are_the_full_scores_gathered():
    B, T, S, Hi, Di, k = 2, 6, 30, 3, 16, 9
    q, w, keys = (
        torch.randn(B, T, Hi, Di, dtype=torch.float64),
        torch.randn(B, T, Hi, dtype=torch.float64),
        torch.randn(B, S, Di),
    )
    q.requires_grad_()
    idx, _ = dsa.topk_select(torch.randn(B, T, S), torch.ones(1, 1, S, dtype=torch.bool), k)
    full = dsa.index_scores(q, w, keys, 0.25).gather(-1, idx)  # (B, T, k)
    sel = dsa.selected_index_scores(q, w, keys, idx, 0.25)
    assert sel.shape == (B, T, k) and torch.allclose(sel, full, rtol=1e-12, atol=1e-12)
    g = torch.randn(B, T, k, dtype=torch.float64)
    assert torch.allclose(
        torch.autograd.grad(sel, q, g)[0], torch.autograd.grad(full, q, g)[0], rtol=1e-12, atol=1e-12
    )


def test_sparse_attention_with_every_key_selected_equals_dense():
    """With index_topk >= length the selection is everything visible, and gathered sparse MLA is dense MLA."""
    m = f64_model()
    attn = m.model.layers[1].self_attn
    B, T, H, C, R = 2, 9, 3, 16, 8
    q_nope = torch.randn(B, T, H, 12, dtype=torch.float64)
    q_pe = torch.randn(B, T, H, R, dtype=torch.float64)
    latent = torch.randn(B, T, C + R, dtype=torch.float64)
    idx, valid = dsa.topk_select(torch.randn(B, T, T, dtype=torch.float64), causal(T), T)
    assert torch.equal(dsa.selection_mask(idx, valid, T), causal(T).expand(B, T, T))
    w_uk, w_uv = attn.w_uk_uv()
    o_lat, _ = dsa.sparse_mla(
        torch.einsum("bthd,hdc->bthc", q_nope, w_uk), q_pe, latent, idx, valid, attn.softmax_scale
    )
    sparse = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)
    dense, _ = attn.naive_attention(q_nope, q_pe, latent, causal(T), need_probs=True)
    assert (sparse - dense).abs().max() < 1e-12


def test_model_dsa_equals_dense_when_topk_covers_the_sequence():
    m = f64_model(index_topk=32)
    x = torch.randint(0, 97, (2, 20))
    sparse = m(x)
    m.config.dsa_mode = "dense"
    assert (sparse - m(x)).abs().max() < 1e-12
    # and with a short index_topk the outputs really differ: sparsity is not a no-op
    m.config.dsa_mode, m.config.index_topk = "sparse", 4
    assert (sparse - m(x)).abs().max() > 1e-6


def test_gather_path_equals_dense_masked_path():
    """The absorbed form reads only the selected latents; the naive form is the dense reference with the
    same selection as a mask. Logits, the sparse-stage KL and every gradient agree."""
    m = f64_model(index_topk=5)
    x = torch.randint(0, 97, (2, 24))
    y = torch.randint(0, 97, (2, 24))
    out = {}
    for form in ("absorb", "naive"):
        m.zero_grad()
        logits, losses = m(x, y, form=form, indexer_kl=True)
        (losses["lm"] + losses["indexer_kl"]).backward()
        out[form] = (
            logits,
            losses["indexer_kl"],
            [p.grad.clone() for p in m.parameters() if p.grad is not None],
        )
    (lg, kg, gg), (lm_, km, gm) = out["absorb"], out["naive"]
    assert (lg - lm_).abs().max() < 1e-10 and abs(kg.item() - km.item()) < 1e-10 and kg > 0
    assert len(gg) == len(gm) and all((a - b).abs().max() < 1e-9 for a, b in zip(gg, gm))


def test_indexer_kl_is_zero_when_distributions_match():
    p = torch.softmax(torch.randn(2, 5, 9, dtype=torch.float64), -1)
    mask = torch.ones(2, 5, 9, dtype=torch.bool)
    assert dsa.indexer_kl(p, p.log(), mask).abs() < 1e-12
    assert dsa.indexer_kl(p, torch.randn(2, 5, 9, dtype=torch.float64), mask) > 0
    # masked keys neither count in p nor in the indexer's softmax
    mask[..., -3:] = False
    p2 = torch.softmax(torch.randn(2, 5, 6, dtype=torch.float64), -1)
    padded = torch.cat([p2, torch.zeros(2, 5, 3, dtype=torch.float64)], -1)
    junk = torch.cat([p2.log(), torch.full((2, 5, 3), 50.0, dtype=torch.float64)], -1)
    assert dsa.indexer_kl(padded, junk, mask).abs() < 1e-12


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_learns_only_from_its_kl_and_the_model_only_from_lm(mode):
    m = model.GLM5(tiny_config(dsa_mode=mode, index_topk=5)).train()
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    _, losses = m(x, y, indexer_kl=True)
    losses["indexer_kl"].backward(retain_graph=True)
    for name, p in m.named_parameters():
        got = p.grad is not None and p.grad.abs().sum() > 0
        assert got == (".indexer." in name), name  # KL reaches the indexers (MTP's too) and nothing else
        p.grad = None
    losses["lm"].backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in m.named_parameters() if ".indexer." in n)


def test_dense_warmup_trains_the_indexer_toward_attention():
    torch.manual_seed(torch.seed() % 2**31)
    m = model.GLM5(tiny_config(dsa_mode="dense")).train()
    for n, p in m.named_parameters():
        p.requires_grad_(".indexer." in n)  # warm-up: everything frozen but the indexers
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 97, (4, 32))
    kls = []
    for _ in range(40):
        _, losses = m(x, x, indexer_kl=True, mtp_weight=0)
        opt.zero_grad()
        losses["indexer_kl"].backward()
        opt.step()
        kls.append(losses["indexer_kl"].item())
    assert kls[-1] < 0.5 * kls[0], kls
