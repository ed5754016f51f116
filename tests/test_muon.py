"""muon.py: Newton-Schulz against its spectral reference, Muon Split against a per-head loop, two Muon steps
against a hand computation, the parameter groups, a short training run, and the DTensor path and FSDP2
on 2 CPU ranks over gloo."""

import io
import math

import pytest
import torch

import model
import muon
from conftest import on_two_gloo_ranks, tiny_config

A, B, C = 3.4445, -4.7750, 2.0315


def with_spectrum(m, n, s, batch=(), dtype=torch.float64):
    """Random U diag(s) V^T of shape (*batch, m, n) with the given singular values; also returns U, V."""
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(*batch, m, k, dtype=dtype)).Q
    V = torch.linalg.qr(torch.randn(*batch, n, k, dtype=dtype)).Q
    return U @ torch.diag_embed(s.to(dtype).expand(*batch, k)) @ V.mT, U, V


def spectral_reference(M, steps=5):
    """What five quintic steps do, computed on the singular values themselves: U phi(s / |M|_F) V^T (fp64)."""
    U, s, Vh = torch.linalg.svd(M.double(), full_matrices=False)
    s = s / (s.pow(2).sum(-1, keepdim=True).sqrt() + 1e-7)
    for _ in range(steps):
        s = A * s + B * s**3 + C * s**5
    return U @ torch.diag_embed(s) @ Vh


# -----------------------------------------------------------------------------
# Newton-Schulz


@pytest.mark.parametrize("shape", [(32, 80), (80, 32), (4, 24, 40), (3, 40, 24)])
def test_newton_schulz_matches_its_spectral_reference(shape):
    G = torch.randn(shape, dtype=torch.float64)
    out = muon.zeropower_via_newtonschulz(G, dtype=torch.float64)
    assert out.dtype == G.dtype and out.shape == G.shape
    torch.testing.assert_close(out, spectral_reference(G), rtol=0, atol=1e-10)
    # the fp32 default agrees to fp32 accuracy
    torch.testing.assert_close(
        muon.zeropower_via_newtonschulz(G.float()).double(), spectral_reference(G), rtol=0, atol=2e-5
    )


@pytest.mark.parametrize("shape,batch", [((32, 80), ()), ((80, 32), ()), ((64, 64), ()), ((24, 40), (5,))])
def test_newton_schulz_squeezes_a_wide_spectrum_into_a_band_around_one(shape, batch):
    m, n = shape
    k = min(m, n)
    s = torch.logspace(0, -math.log10(300), k)  # condition number 300
    G, U, V = with_spectrum(m, n, s, batch)
    sv_in = torch.linalg.svdvals(G)
    assert (sv_in.max(-1).values / sv_in.min(-1).values > 250).all()
    out = muon.zeropower_via_newtonschulz(G.float())
    sv = torch.linalg.svdvals(out.double())
    assert sv.min() > 0.5 and sv.max() < 1.5, (sv.min().item(), sv.max().item())
    # the singular vectors are kept: U^T O V is diagonal
    core = U.mT @ out.double() @ V
    off = core - torch.diag_embed(torch.diagonal(core, dim1=-2, dim2=-1))
    assert off.abs().max() < 1e-4
    # condition number 1e3: five steps leave the smallest ~1e-3 of the Frobenius scale partly lifted,
    # but the spread still collapses from 1000x to under 10x
    G3, _, _ = with_spectrum(m, n, torch.logspace(0, -3, k), batch)
    sv3 = torch.linalg.svdvals(muon.zeropower_via_newtonschulz(G3.float()).double())
    assert sv3.max() < 1.5 and (sv3.max(-1).values / sv3.min(-1).values < 10).all()


def test_newton_schulz_in_bf16_is_still_near_orthogonal():
    G = torch.randn(48, 96)
    sv = torch.linalg.svdvals(muon.zeropower_via_newtonschulz(G, dtype=torch.bfloat16).double())
    assert sv.min() > 0.4 and sv.max() < 1.6


# -----------------------------------------------------------------------------
# Muon Split


def per_head_loop(u, sizes):
    """The plain reference: a Python loop over heads and over each head's blocks."""
    rows, cols = u.shape
    out, r = torch.empty_like(u), 0
    while r < rows:
        for s in sizes:
            out[r : r + s] = muon.zeropower_via_newtonschulz(u[r : r + s]) * 0.2 * math.sqrt(max(s, cols))
            r += s
    return out


@pytest.mark.parametrize("proj", ["q_b_proj", "kv_b_proj"])
def test_muon_split_equals_newton_schulz_per_head(proj):
    c = tiny_config()
    H = c.num_attention_heads
    if proj == "q_b_proj":
        sizes, cols = (c.qk_head_dim,), c.q_lora_rank  # W_UQ^h (20, 24)
    else:
        # W_UK^h (12, 16), W_UV^h (20, 16): tall
        sizes, cols = (c.qk_nope_head_dim, c.v_head_dim), c.kv_lora_rank
    u = torch.randn(H * sum(sizes), cols)
    u[: sum(sizes)] *= 50.0  # one loud head: a whole-matrix update would drown the others
    split = muon.orthogonalized_update(u, sizes)
    torch.testing.assert_close(split, per_head_loop(u, sizes), rtol=0, atol=2e-6)
    whole = muon.orthogonalized_update(u, None)
    torch.testing.assert_close(whole, per_head_loop(u, (u.shape[0],)), rtol=0, atol=2e-6)
    assert (split - whole).abs().max() > 0.05
    # every block of the split update has RMS about 0.2, the quiet heads included
    r = 0
    for _ in range(H):
        for s in sizes:
            assert 0.13 < split[r : r + s].pow(2).mean().sqrt() < 0.27
            r += s
    # the whole-matrix update moves the quiet heads far less than the loud one (split: equally)
    quiet, loud = whole[sum(sizes) :], whole[: sum(sizes)]
    assert quiet.pow(2).mean().sqrt() < 0.6 * loud.pow(2).mean().sqrt()


def test_muon_split_rejects_a_split_that_does_not_tile():
    with pytest.raises(ValueError, match="does not tile"):
        muon.orthogonalized_update(torch.randn(50, 16), (12, 20))


# -----------------------------------------------------------------------------
# One Muon step, by hand


def test_two_muon_steps_match_a_hand_computation():
    lr, wd, beta = 0.05, 0.1, 0.95
    W0 = torch.randn(6, 10, dtype=torch.float64)
    Wq0 = torch.randn(3 * 20, 24, dtype=torch.float64)  # q_b_proj-shaped, split per head
    g1, g2 = torch.randn(6, 10, dtype=torch.float64), torch.randn(6, 10, dtype=torch.float64)
    h1, h2 = torch.randn(60, 24, dtype=torch.float64), torch.randn(60, 24, dtype=torch.float64)
    p, q = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(Wq0.clone())
    opt = muon.Muon(
        [{"params": [p]}, {"params": [q], "split": (20,)}], lr=lr, weight_decay=wd, ns_dtype=torch.float64
    )

    def by_hand(W, grads, block_rows, carry=True):
        buf = torch.zeros_like(W)
        for g in grads:
            buf = beta * buf * carry + g
            u = g + beta * buf  # Nesterov
            blocks = u.view(-1, block_rows, u.shape[1])
            O = spectral_reference(blocks).view_as(u) * 0.2 * math.sqrt(max(block_rows, u.shape[1]))
            W = W * (1 - lr * wd) - lr * O
        return W

    for k, (g, h) in enumerate([(g1, h1), (g2, h2)]):
        p.grad, q.grad = g.clone(), h.clone()
        opt.step()
        torch.testing.assert_close(p.data, by_hand(W0, [g1, g2][: k + 1], 6), rtol=0, atol=1e-10)
        torch.testing.assert_close(q.data, by_hand(Wq0, [h1, h2][: k + 1], 20), rtol=0, atol=1e-10)
    assert (p.data - by_hand(W0, [g1, g2], 6, carry=False)).abs().max() > 1e-3  # the momentum mattered
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], beta * g1 + g2)


def test_stacked_experts_get_the_update_of_one_parameter_per_expert():
    """Muon on experts.Experts' stacked tensors (E, 2F, D) and (E, D, F) == Muon on each expert's gate, up
    and down matrix as its own parameter (the layout before stacking), over three steps of momentum."""
    m = model.GLM5(tiny_config())
    experts = m.model.layers[1].mlp.experts
    E, F = experts.down_proj.shape[0], experts.down_proj.shape[-1]
    where = group_of(muon.param_groups(m))
    stacked = [experts.gate_up_proj, experts.down_proj]
    opt = muon.Muon(
        [{"params": [p], "split": where[f"model.layers.1.mlp.experts.{n}"]["split"]} for p, n in
         zip(stacked, ("gate_up_proj", "down_proj"))],
        lr=0.05,
    )
    gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
    down = experts.down_proj.detach()
    alone = [torch.nn.Parameter(t[e].clone()) for e in range(E) for t in (gate, up, down)]
    opt_alone = muon.Muon(alone, lr=0.05)
    for _ in range(3):
        g_gu, g_d = torch.randn(E, 2 * F, 48), torch.randn(E, 48, F)
        experts.gate_up_proj.grad, experts.down_proj.grad = g_gu, g_d
        for e in range(E):
            alone[3 * e].grad, alone[3 * e + 1].grad = g_gu[e, :F].clone(), g_gu[e, F:].clone()
            alone[3 * e + 2].grad = g_d[e].clone()
        opt.step()
        opt_alone.step()
    for e in range(E):
        torch.testing.assert_close(experts.gate_up_proj.data[e, :F], alone[3 * e].data, rtol=0, atol=1e-6)
        torch.testing.assert_close(experts.gate_up_proj.data[e, F:], alone[3 * e + 1].data, rtol=0, atol=1e-6)
        torch.testing.assert_close(experts.down_proj.data[e], alone[3 * e + 2].data, rtol=0, atol=1e-6)


def test_muon_refuses_vectors():
    with pytest.raises(ValueError, match="2-D"):
        muon.Muon([torch.nn.Parameter(torch.ones(8))])


# -----------------------------------------------------------------------------
# Parameter groups


def group_of(groups):
    return {n: g for g in groups for n in g["names"]}


def test_param_groups_cover_every_parameter_once():
    m = model.GLM5(tiny_config())
    groups = muon.param_groups(m)
    where = group_of(groups)
    names = [n for n, _ in m.named_parameters()]
    assert sorted(where) == sorted(names)
    assert sum(len(g["params"]) for g in groups) == len(names)
    for n, p in m.named_parameters():
        g = where[n]
        assert any(p is q for q in g["params"])
        if n in ("model.embed_tokens.weight", "lm_head.weight") or n.endswith("mlp.gate.weight"):
            assert not g["use_muon"] and g["weight_decay"] == 0.1, n
        elif p.ndim == 1:  # RMSNorm weights, the indexer's LayerNorm weight and bias
            assert not g["use_muon"] and g["weight_decay"] == 0.0, n
        else:
            assert g["use_muon"] and g["weight_decay"] == 0.1, n
            want = {"q_b_proj.weight": (20,), "kv_b_proj.weight": (12, 20)}.get(n.split("self_attn.")[-1])
            if n.endswith("experts.gate_up_proj"):  # each expert's gate and up, (16, 48) each
                want = (16, 16)
            assert g["split"] == want, n
    assert where["mtp_layers.0.eh_proj.weight"]["use_muon"]
    assert where["model.layers.1.self_attn.indexer.weights_proj.weight"]["use_muon"]
    # without Muon Split the up-projections are whole matrices
    where = group_of(muon.param_groups(m, muon_split=False))
    assert where["model.layers.0.self_attn.kv_b_proj.weight"]["split"] is None


def test_frozen_parameters_are_skipped_and_tampering_is_caught():
    m = model.GLM5(tiny_config())
    for p in m.model.layers[1].self_attn.indexer.parameters():  # the indexer is frozen in RL
        p.requires_grad_(False)
    groups = muon.param_groups(m)
    assert not any(".1.self_attn.indexer." in n for n in group_of(groups))
    assert "model.layers.2.self_attn.indexer.wk.weight" in group_of(groups)

    muon_group = next(g for g in groups if g["use_muon"] and g["split"] is None)
    i = muon_group["names"].index("model.layers.0.mlp.down_proj.weight")
    dropped = [
        dict(g, params=[p for j, p in enumerate(g["params"]) if not (g is muon_group and j == i)])
        for g in groups
    ]
    with pytest.raises(AssertionError, match="model.layers.0.mlp.down_proj.weight"):
        muon.check_groups(m, dropped)
    twice = groups + [dict(params=[m.lm_head.weight])]
    with pytest.raises(AssertionError, match="lm_head.weight is in two"):
        muon.check_groups(m, twice)
    frozen = groups + [dict(params=[m.model.layers[1].self_attn.indexer.wk.weight])]
    with pytest.raises(AssertionError, match="not a trainable parameter"):
        muon.check_groups(m, frozen)


def test_unknown_parameters_get_a_clear_error():
    m = model.GLM5(tiny_config())
    m.extra = torch.nn.Linear(4, 4)  # a matrix outside the decoder blocks: no rule says where it goes
    with pytest.raises(ValueError, match="extra.weight"):
        muon.param_groups(m)


# -----------------------------------------------------------------------------
# A short training run


@pytest.mark.slow
def test_muon_and_adamw_reduce_the_loss_on_a_fixed_batch():
    torch.seed()  # fresh weights and batch every run
    m = model.GLM5(tiny_config()).train()
    x = torch.randint(0, 97, (4, 17))
    opt_muon, opt_adamw = muon.build_optimizers(m, lr_muon=0.02, lr_adamw=0.01)
    assert isinstance(opt_muon, muon.Muon) and isinstance(opt_adamw, torch.optim.AdamW)
    w_kv = m.model.layers[0].self_attn.kv_b_proj.weight
    losses = []
    for _ in range(8):
        _, l = m(x[:, :-1], x[:, 1:])
        l["loss"].backward()
        opt_muon.step()
        opt_adamw.step()
        opt_muon.zero_grad(set_to_none=True)
        opt_adamw.zero_grad(set_to_none=True)
        model.update_router_bias(m)
        losses.append(l["lm"].item())
    assert torch.isfinite(torch.tensor(losses)).all()
    assert losses[-1] < 0.6 * losses[0], losses
    assert "momentum_buffer" in opt_muon.state[w_kv] and w_kv not in opt_adamw.state
    # both survive a checkpoint round trip (torch.load's default weights_only=True), split specs included
    fresh = muon.build_optimizers(m)
    for old, new in zip((opt_muon, opt_adamw), fresh):
        f = io.BytesIO()
        torch.save(old.state_dict(), f)
        f.seek(0)
        new.load_state_dict(torch.load(f))
        assert [g["lr"] for g in new.param_groups] == [g["lr"] for g in old.param_groups]
    assert [g["split"] for g in fresh[0].param_groups] == [g["split"] for g in opt_muon.param_groups]
    assert torch.equal(fresh[0].state[w_kv]["momentum_buffer"], opt_muon.state[w_kv]["momentum_buffer"])


# -----------------------------------------------------------------------------
# DTensor / FSDP2: two CPU ranks over gloo, sharded parameters against the same steps on whole tensors


def _dtensor_check(rank, world, mesh, seed):
    """Muon on DTensor shards (rows, columns, stacked experts) against the same steps on whole tensors, then
    _fsdp2_check."""
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)  # the same tensors on both ranks
    shapes = [((96, 16), (12, 20), Shard(0)), ((7, 10), None, Shard(0)), ((60, 24), (20,), Shard(1))]
    # stacked experts sharded on the expert dimension: each rank orthogonalises its own, no gather
    shapes += [((4, 24, 10), (12, 12), Shard(0)), ((4, 10, 12), None, Shard(0))]
    plain, sharded, groups_plain, groups_sharded = [], [], [], []
    for shape, split, placement in shapes:
        w = torch.randn(shape, generator=gen)
        a = torch.nn.Parameter(w.clone())
        b = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [placement]))
        plain.append(a)
        sharded.append(b)
        groups_plain.append({"params": [a], "split": split})
        groups_sharded.append({"params": [b], "split": split})
    opt_a, opt_b = muon.Muon(groups_plain, lr=0.05), muon.Muon(groups_sharded, lr=0.05)
    for _ in range(2):
        for a, b in zip(plain, sharded):
            g = torch.randn(a.shape, generator=gen)
            a.grad = g.clone()
            b.grad = distribute_tensor(g.clone(), mesh, b.placements)
        opt_a.step()
        opt_b.step()
    for a, b in zip(plain, sharded):
        assert b.to_local().shape != a.shape  # really sharded
        torch.testing.assert_close(b.full_tensor(), a.data, rtol=0, atol=1e-6)
    _fsdp2_check(rank, world, mesh, seed)


def _fsdp2_check(rank, world, mesh, seed):
    """fully_shard on every decoder block, each rank a different half of the batch, against one process
    on the whole batch: Muon and AdamW through build_optimizers must land on the same weights (fp64).
    The real setting: sparse DSA, top-2 of 8 experts (some idle on a rank), the balance loss on, and the
    MTP block wrapped too."""
    import copy

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    ref = model.GLM5(tiny_config(num_hidden_layers=2)).double().train()
    m = copy.deepcopy(ref)
    for blk in list(m.model.layers) + list(m.mtp_layers):
        fully_shard(blk, mesh=mesh)
    fully_shard(m, mesh=mesh)
    # Newton-Schulz in fp64 too (its default is fp32), so nothing in this fp64 comparison rounds to fp32:
    # a last-bit difference between the whole-batch and the two-halves gradients that happened to cross an
    # fp32 rounding boundary would move a weight by ~1e-9, far past the 1e-12 bound
    kw = dict(lr_muon=0.02, lr_adamw=0.01, ns_dtype=torch.float64)
    opts = muon.build_optimizers(ref, **kw) + muon.build_optimizers(m, **kw)
    x = torch.randint(0, 97, (2 * world, 9), generator=torch.Generator().manual_seed(seed))
    mine = x[2 * rank : 2 * rank + 2]
    for _ in range(2):
        ref(x[:, :-1], x[:, 1:], balance_weight=0.1)[1]["loss"].backward()
        m(mine[:, :-1], mine[:, 1:], balance_weight=0.1)[1]["loss"].backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    n_sharded = 0
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        n_sharded += q.to_local().numel() < p.numel()
        torch.testing.assert_close(q.full_tensor(), p.data, rtol=0, atol=1e-12, msg=name)
    assert n_sharded > 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_dtensor_and_fsdp2_steps_equal_the_whole_matrix_steps():
    # the assertions run in both ranks (on_two_gloo_ranks); an AssertionError in either fails this test
    on_two_gloo_ranks(_dtensor_check, torch.seed() % 2**31)
