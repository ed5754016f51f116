"""paged_attention.py, the serving engine's reads of its page pool, each against the model's own path:
the selection over a pool in place against dsa.index_topk over the gathered history (float and int8 keys),
the index products in reused buffers against fresh ones, the GEMM paths (oneDNN on a CPU) against the
einsums of dsa.py and mla.MLA.absorbed_attention. The engine as a whole against the gathered reference:
tests/test_engine.py. Run: python -m pytest -q tests/test_paged_attention.py"""

import pytest
import torch

import dsa
import kernels
import linear
import mla
import paged_attention
from conftest import tiny_config


def pool_and_rows(g, B, S, P, D, pages=16):
    """A pool of `pages` pages of P keys (D wide) and each of B rows' S positions as pool rows, its pages in
    random order -> pool (pages P, D), rows (B, S)."""
    pool = torch.randn(pages * P, D, generator=g)
    table = torch.stack([torch.randperm(pages, generator=g)[: S // P] for _ in range(B)])  # (B, S / P)
    s = torch.arange(S)
    return pool, table[:, s // P] * P + s % P


@pytest.mark.parametrize("packed", [False, True])
def test_selection_over_a_pool_in_place_equals_the_gathered_history(packed):
    """Keys read in place from a pool (pages out of order) select the same keys, returned as pool rows, as
    dsa.index_topk over each row's gathered keys; with int8 keys the pool's scores (one int8 GEMM on a CPU)
    equal the gathered ones bit for bit: the dot products are exact integers."""
    g = torch.Generator().manual_seed(1)
    B, T, Hi, D, S, P = 2, 3, 4, 32, 40, 4
    pool, rows = pool_and_rows(g, B, S, P, D)
    keys = dsa.pack_index_keys(pool) if packed else pool  # (64, D + 4) or (64, D)
    q, w = torch.randn(B, T, Hi, D, generator=g), torch.randn(B, T, Hi, generator=g)
    last = torch.tensor([[20, 30, 39], [5, 6, 7]])
    idx, valid = dsa.index_topk(q, w, keys[rows], last, 6, 0.3)
    pidx, pvalid = paged_attention.index_topk_in_pool(q, w, keys, rows, last, 6, 0.3)
    assert torch.equal(pvalid, valid) and torch.equal(pidx, rows.gather(1, idx.flatten(1)).view_as(idx))
    if packed:
        in_pool = paged_attention.pool_index_scores(q, w, keys, 0.3)  # (B, T, 64)
        in_pool = in_pool.gather(-1, rows[:, None, :].expand(B, T, S))  # (B, T, S) in position order
        assert torch.equal(in_pool, dsa.quantized_index_scores(q, w, keys[rows], 0.3))


@pytest.mark.parametrize("packed", [False, True])
def test_pool_scores_with_reused_buffers_equal_fresh_ones_step_after_step(packed):
    """The index products over a pool written into a work dict's buffers (PagedCache.work): the same
    selections as fresh buffers, the buffers reused from the second call on (same memory), and grown when
    a longer pool needs more."""
    g = torch.Generator().manual_seed(3)
    B, T, Hi, D, S, P = 2, 1, 4, 32, 40, 4
    pool, rows = pool_and_rows(g, B, S, P, D)
    keys = dsa.pack_index_keys(pool) if packed else pool
    last = torch.tensor([[39], [30]])
    work = {}
    seen = []
    for step in range(3):
        q, w = torch.randn(B, T, Hi, D, generator=g), torch.randn(B, T, Hi, generator=g)
        fresh = paged_attention.index_topk_in_pool(q, w, keys, rows, last, 6, 0.3)
        reused = paged_attention.index_topk_in_pool(q, w, keys, rows, last, 6, 0.3, work)
        assert torch.equal(fresh[0], reused[0]) and torch.equal(fresh[1], reused[1])
        seen.append({k: v.data_ptr() for k, v in work.items()})
    assert seen[0] and seen[0] == seen[1] == seen[2]
    small = paged_attention.WORK_MAX_BYTES
    paged_attention.WORK_MAX_BYTES = 16  # a product past the cap (a long prefill's) stays a temporary
    try:
        kept = dict(work)
        paged_attention.index_topk_in_pool(q, w, keys, rows, last, 6, 0.3, work)
        assert {k: v.data_ptr() for k, v in work.items()} == {k: v.data_ptr() for k, v in kept.items()}
    finally:
        paged_attention.WORK_MAX_BYTES = small
    longer = torch.cat([keys, keys])  # a pool twice as long: the buffers grow
    q, w = torch.randn(B, T, Hi, D, generator=g), torch.randn(B, T, Hi, generator=g)
    want = paged_attention.index_topk_in_pool(q, w, longer, rows, last, 6, 0.3)
    got = paged_attention.index_topk_in_pool(q, w, longer, rows, last, 6, 0.3, work)
    assert torch.equal(want[0], got[0]) and max(v.numel() for v in work.values()) == B * T * Hi * 128


def test_pool_scores_through_onednn_equal_the_per_row_einsum():
    """Float keys in a pool long enough for linear.py's rule are scored by oneDNN with the keys as the rows
    (linear.uses_onednn, on a CPU): the same scores as dsa.index_scores over the same keys, to fp32
    rounding, for two rows of two queries each."""
    g = torch.Generator().manual_seed(5)
    B, T, Hi, D, N = 2, 2, 4, 128, 4096
    pool = torch.randn(N, D, generator=g)
    q, w = torch.randn(B, T, Hi, D, generator=g), torch.randn(B, T, Hi, generator=g)
    with torch.no_grad():
        if torch.backends.mkldnn.is_available() and kernels.MODE != "torch":
            assert linear.uses_onednn(pool, q.reshape(-1, D))
        got = paged_attention.pool_index_scores(q, w, pool, 0.3)  # (B, T, N)
        want = dsa.index_scores(q, w, pool[None].expand(B, -1, -1), 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_one_query_sparse_attention_equals_the_model_path(onednn_calls):
    """A decode step of one row runs sparse MLA as two linear.linear GEMMs over its gathered rows (oneDNN on a
    CPU, in a reused buffer; the second reads them transposed): the same output as dsa.sparse_mla_torch's
    einsums to fp32 rounding, at GLM-5's 576-value latent; a batch of two, one pool, takes the einsums."""
    g = torch.Generator().manual_seed(4)
    H, C, R, N, K = 16, 512, 64, 300, 128  # 16 x 576 x 128 multiply-adds: linear.py's rule takes oneDNN
    pool = torch.randn(N, C + R, generator=g)
    q_abs, q_pe = torch.randn(1, 1, H, C, generator=g), torch.randn(1, 1, H, R, generator=g)
    idx = torch.randperm(N, generator=g)[:K].view(1, 1, K)
    valid = torch.rand(1, 1, K, generator=g) < 0.8
    work = {}
    with torch.no_grad():
        one = paged_attention.sparse_mla(q_abs, q_pe, pool[None], idx, valid, 0.05, work)
    if torch.backends.mkldnn.is_available() and kernels.MODE != "torch":
        assert onednn_calls == [True, True]  # the scores and the weighted sum, through oneDNN
    with torch.no_grad():
        assert work["selected"].shape == (K * (C + R),)  # the gather went into the reused buffer
        want = dsa.sparse_mla_torch(q_abs, q_pe, pool[None], idx, valid, 0.05)[0]
        two = paged_attention.sparse_mla(
            q_abs.expand(2, -1, -1, -1), q_pe.expand(2, -1, -1, -1), pool[None].expand(2, -1, -1),
            idx.expand(2, -1, -1), valid.expand(2, -1, -1), 0.05,
        )
    torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two, want.expand(2, -1, -1, -1), rtol=1e-5, atol=1e-5)


def test_gather_rows_from_a_shared_pool_equals_indexing_per_row():
    B, S, T, K, F = 3, 11, 2, 5, 7
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, S, (B, T, K), generator=g)
    pool = torch.randn(S, F, generator=g)[None].expand(B, -1, -1)  # one pool for every row: batch stride 0
    ref = pool[torch.arange(B)[:, None, None], idx]
    assert torch.equal(paged_attention.gather_rows(pool, idx, {}), ref)
    assert torch.equal(paged_attention.gather_rows(pool.contiguous(), idx), ref)


@pytest.mark.parametrize("pool,B", [(True, 1), (True, 3), (False, 1)])
def test_decode_dense_attention_equals_the_model_einsums(onednn_calls, pool, B):
    """A dense decode step (one query per row) runs paged_attention.decode_attention: two linear.linear
    GEMMs over the latents (oneDNN on a CPU), over a page pool every row shares (read in place, a (B, 1, N)
    mask of each row's pool rows) or over one row's contiguous latents: the same output as
    mla.MLA.absorbed_attention's einsums over each row's latents to fp32 rounding, at GLM-5's 576-value
    latent, and exactly 0 weight on every masked latent."""
    heads = dict(num_attention_heads=16, num_key_value_heads=16)
    cfg = tiny_config(**heads, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=64)
    attn = mla.MLA(cfg)
    g = torch.Generator().manual_seed(6)
    H, C, R, N = 16, 512, 64, 300  # 16 x 576 x 300 multiply-adds: linear.py's rule takes oneDNN
    latent = torch.randn(N, C + R, generator=g)
    mask = torch.rand(B, 1, N, generator=g) < 0.7  # each row sees its own pool rows
    q_abs, q_pe = torch.randn(B, 1, H, C, generator=g), torch.randn(B, 1, H, R, generator=g)
    with torch.no_grad():
        got = paged_attention.decode_attention(q_abs, q_pe, latent if pool else latent[None], mask, 0.05)
        if torch.backends.mkldnn.is_available() and kernels.MODE != "torch":
            assert onednn_calls == [True, True]  # the scores and the weighted sum, through oneDNN
        attn.softmax_scale = 0.05
        want, probs = attn.absorbed_attention(q_abs, q_pe, latent[None].expand(B, -1, -1), mask)
    assert got.shape == (B, 1, H, C)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.std() > 0.01
    for b in range(B):  # a masked latent changes nothing
        moved = latent.clone()
        moved[~mask[b, 0]] = 1e3
        with torch.no_grad():
            one = slice(b, b + 1)
            again = paged_attention.decode_attention(q_abs[one], q_pe[one], moved, mask[one], 0.05)
        torch.testing.assert_close(again, got[one], rtol=1e-5, atol=1e-5)
