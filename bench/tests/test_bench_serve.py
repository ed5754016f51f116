"""bench_serve.py's arithmetic: its memory part reads the engine's own cache at GLM-5's shapes, and its
reading of issue 17's two DSA goals off a line through a 1-row and a B-row step matches checking each batch
by hand."""

import math

import pytest
import torch

import bench_serve


def test_bench_serve_cache_bytes_per_token():
    """bench_serve's memory part reads the engine's own cache: at GLM-5's shapes in bf16, 78 + 1 layers x
    (512 + 64 latent values + a 128-value index key) x 2 bytes, against 64 heads x (256 + 256) x 2 bytes a
    layer for dense MHA; the int8 index key is 128 bytes + a 4-byte scale."""
    rows = {(n, d, q): (ours, mha) for n, d, q, ours, mha in bench_serve.bench_memory()}
    assert rows[("full", torch.bfloat16, "none")] == (79 * 704 * 2, 79 * 64 * 512 * 2)
    assert rows[("full", torch.bfloat16, "int8")][0] == 79 * (576 * 2 + 132)
    assert rows[("toy", torch.float32, "none")][0] == 5 * (48 + 32) * 4


def test_bench_serve_where_goals_hold_matches_every_batch_checked_one_by_one():
    """bench_serve.where_goals_hold reads issue 17's two DSA goals off a line through a 1-row and a B-row
    step. For random lines (fixed costs, per-row costs, some negative: a line may fall) its answer must
    equal checking each batch n from 1 to 400 by hand."""
    def inside(n, r):
        return r is not None and r[0] <= n <= r[1]

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    for case in range(300):
        fixed = (torch.rand(3, generator=g, dtype=torch.float64) * 30 + 1).tolist()  # DSA, dense, bound
        per_row = (torch.rand(3, generator=g, dtype=torch.float64) * 40 - 4).tolist()
        if case == 0:  # this CPU's figures at 64K: no batch meets both
            fixed, per_row = [18.0, 18.0, 17.7], [6.6, 37.0, 0.3]
        B = int(torch.randint(2, 17, (), generator=g))

        def at(n):
            return [f + n * p for f, p in zip(fixed, per_row)]

        lines, four, near = bench_serve.where_goals_hold(at(1), at(B), B)
        for i, name in enumerate(("dsa", "dense", "bound")):
            assert lines[name] == pytest.approx((fixed[i], per_row[i]), rel=1e-9, abs=1e-9)
        for n in range(1, 401):
            dsa_t, dense_t, bound_t = at(n)
            if abs(dense_t - 4 * dsa_t) > 1e-9:  # away from the boundary, where rounding could tip it
                assert (dense_t >= 4 * dsa_t) == inside(n, four), (case, n, fixed, per_row, four)
            if abs(dsa_t - 1.5 * bound_t) > 1e-9:
                assert (dsa_t <= 1.5 * bound_t) == inside(n, near), (case, n, fixed, per_row, near)
        if case == 0:
            assert four == (6, math.inf) and near == (1, 1)
