"""bench_copy.py: its fixed-period batches count exactly the targets a copy can predict, and its
attention-only reference is causal at any depth (what the induction probe's conclusions rest on)."""

import pytest
import torch

import bench_copy


def test_fixed_batch_counts_only_the_copyable_targets():
    g = torch.Generator().manual_seed(0)
    span, offset = 8, 5
    x, y = bench_copy.fixed_batch(64, span, g, batch=4, offset=offset)
    assert x.shape == y.shape == (4, offset + 2 * span - 1)
    counted = (y != -1).nonzero()
    # exactly the second copy less its first id: span - 1 targets per row
    assert len(counted) == 4 * (span - 1)
    for b, t in counted.tolist():
        # target t is the id at position t + 1, which the first copy showed span positions earlier,
        # right after the id that the input shows at t - span (so a copy by content can predict it)
        assert y[b, t] == x[b, t + 1 - span]
        assert x[b, t] == x[b, t - span]


@pytest.mark.parametrize("positions,layers", [("learned", 2), ("rope", 2), ("learned", 4)])
def test_attention_only_reference_is_causal(positions, layers):
    torch.manual_seed(0)
    ref = bench_copy.AttentionOnly(vocab_size=32, max_len=16, positions=positions, layers=layers).eval()
    assert len(ref.attn) == len(ref.norms) == layers
    x = torch.randint(0, 32, (2, 16))
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 32
    with torch.no_grad():
        a, b = ref(x), ref(changed)
    assert a.shape == (2, 16, 32)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_reference_rope_scores_depend_on_the_offset_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    T = 12
    qs = bench_copy.rope(q.expand(1, 1, T, 8).contiguous())  # the same query at every position
    ks = bench_copy.rope(k.expand(1, 1, T, 8).contiguous())
    torch.testing.assert_close(qs.norm(dim=-1), q.norm(dim=-1).expand(1, 1, T))
    dots = (qs[0, 0, :, None] * ks[0, 0, None, :]).sum(-1)  # (T, T): query at i, key at j
    torch.testing.assert_close(dots[5, 2], dots[9, 6])  # both 3 apart
    assert not torch.allclose(dots[5, 2], dots[5, 3])
