"""rl.py's algorithmic core: the importance ratio's identity with on-policy REINFORCE, exact zero
gradient outside the trust band and r * A * grad log pi inside, GRPO's group advantages, IcePop's mask
and the PPO clip, distillation's sign, the buffer's staleness and group rules with their counts, and the
DP-aware router's stability, balance and removal (tiny tensors, milliseconds each); then the trainer's step
on a tiny GLM-5 in float64: on-policy it is REINFORCE (gradient and update), mask-0 tokens and right padding
change nothing, the indexers, router bias and MTP block stay bit-identical, identical rewards give a zero
gradient, distillation's gradient, and the optimizer reset (a second or so each)."""

import math

import pytest
import torch
from conftest import on_two_gloo_ranks, randomize, tiny_config

import model
import parallel
import rl
import shared_prefix
from rl import Trajectory


def token_logprobs(seed, N=4, T=6, V=11):
    """A tiny policy: free logits (N, T, V) as the parameters, the log pi of random sampled tokens (N, T)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (N, T), generator=g)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[..., None])[..., 0]  # (N, T)
    mask = torch.rand(N, T, generator=g) < 0.7
    mask[:, 0] = True  # every trajectory has at least one sampled token
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    return logits, logp, mask, adv, g


def leaf(x):
    return x.detach().clone().requires_grad_()


# -----------------------------------------------------------------------------
# The policy losses


def test_equal_logprobs_are_on_policy_reinforce():
    logits, logp, mask, adv, _ = token_logprobs(0)
    loss, stats = rl.agentic_loss(logp, logp.detach().clone(), adv, mask)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    reinforce = -(adv[:, None] * logp * mask).sum() / mask.sum()
    (grad_ref,) = torch.autograd.grad(reinforce, logits, retain_graph=True)
    torch.testing.assert_close(loss, reinforce, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
    assert stats["masked_frac"] == 0.0 and stats["abs_r_minus_1"] == 0.0
    assert stats["tokens"] == int(mask.sum())

    # GRPO + IcePop with pi_theta = pi_old = pi_rollout: REINFORCE averaged per response (Eq. 1's
    # 1/G sum_i 1/|y_i| sum_t; its value is -E[A] instead)
    loss, stats = rl.reasoning_loss(logp, logp.detach(), logp.detach(), adv, mask)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    per_response = -((adv[:, None] * logp * mask).sum(dim=1) / mask.sum(dim=1)).mean()
    (grad_ref,) = torch.autograd.grad(per_response, logits)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
    assert stats["masked_frac"] == 0.0 and stats["clip_frac"] == 0.0


def test_eq1_gives_a_2_token_response_the_weight_of_a_200_token_one():
    """The report's Eq. 1 averages per response, then over the group: each response's tokens share one
    response's weight, so the gradient on the sum of a response's logprobs is A_i / G whatever its length
    (a token-level mean would give the 200-token response 100 times the 2-token one's)."""
    T = 201
    logp = torch.full((2, T), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, 1:3] = True  # 2 sampled tokens
    mask[1, 1:201] = True  # 200 sampled tokens
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = rl.reasoning_loss(logp, logp.detach(), logp.detach(), adv, mask)
    loss.backward()
    per_response = (logp.grad * mask).sum(dim=1)  # (2,)
    torch.testing.assert_close(per_response, -adv / 2, rtol=1e-12, atol=0)
    # through the trainer's weights too (response_weights: 1 / (n_groups G |y_i|)), one group of two
    short = Trajectory("g", [1] * 3, [0, 1, 1], [0.0] * 3, [-1, 0, 0], 1.0, rollout_id="short")
    long_ = Trajectory("g", [1] * 201, [0] + [1] * 200, [0.0] * 201, [-1] + [0] * 200, 0.0)
    long_.rollout_id = "long"
    w = rl.response_weights([short, long_])
    torch.testing.assert_close(w, torch.tensor([1 / (2 * 2), 1 / (2 * 200)], dtype=torch.float64))


def test_trust_band_zero_gradient_outside_r_times_a_inside():
    logits, logp, mask, adv, g = token_logprobs(1, N=8, T=16)
    logp_rollout = logp.detach() + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    x = leaf(logp)
    loss, stats = rl.agentic_loss(x, logp_rollout, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    r = torch.exp(logp.detach() - logp_rollout)
    inside = mask & (r > 0.8) & (r < 1.28)
    outside = ~inside
    assert inside.any() and (mask & outside).any(), "the noise should put tokens on both sides of the band"
    assert torch.equal(x.grad[outside], torch.zeros_like(x.grad[outside]))  # exactly zero, not small
    expected = -(r * adv[:, None].expand_as(r)) / mask.sum()
    torch.testing.assert_close(x.grad[inside], expected[inside], rtol=1e-12, atol=0)
    assert stats["masked_frac"] == pytest.approx(float((mask & outside).sum() / mask.sum()))
    assert stats["abs_r_minus_1"] == pytest.approx(float((r - 1).abs()[mask].mean()))

    # through the parameters: a masked token's logits get exactly no gradient, a kept one r * A * grad log pi
    loss, _ = rl.agentic_loss(logp, logp_rollout, adv, mask)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    assert torch.equal(grad[outside], torch.zeros_like(grad[outside]))
    n, t = inside.nonzero()[0].tolist()
    (grad_logp,) = torch.autograd.grad(logp[n, t], logits, retain_graph=True)
    torch.testing.assert_close(grad[n, t], expected[n, t] * grad_logp[n, t], rtol=1e-12, atol=1e-15)


def test_environment_tokens_with_no_logprob_stay_out():
    _, logp, mask, adv, _ = token_logprobs(2)
    logp_new = logp.detach().clone()
    logp_new[~mask] = -math.inf
    logp_rollout = logp.detach().clone()
    logp_rollout[~mask] = math.nan
    for kind in ("agentic", "reasoning"):
        x = leaf(logp_new)
        if kind == "agentic":
            loss, stats = rl.agentic_loss(x, logp_rollout, adv, mask)
        else:
            loss, stats = rl.reasoning_loss(x, logp_new, logp_rollout, adv, mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), kind
        assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask])), kind
        assert math.isfinite(stats["abs_r_minus_1"]) and stats["masked_frac"] == 0.0, kind


def test_group_advantages():
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(5, 8, generator=g)
    rewards[2] = 0.1  # all equal: a float mean of 0.1s is not exactly 0.1
    rewards[3] = (torch.rand(8, generator=g) > 0.5).float()
    rewards[3, :2] = torch.tensor([0.0, 1.0])  # a 0/1 group with both outcomes
    adv = rl.group_advantages(rewards)
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(5), rtol=0, atol=1e-5)
    assert torch.equal(adv[2], torch.zeros(8))
    torch.testing.assert_close(adv[[0, 1, 3, 4]].std(dim=1, correction=0), torch.ones(4), rtol=1e-4, atol=0)
    plain = rl.group_advantages(rewards, scale_by_std=False)
    torch.testing.assert_close(plain[0], rewards[0] - rewards[0].mean())
    assert torch.equal(plain[2], torch.zeros(8))
    assert torch.equal(rl.group_advantages(torch.tensor([[0.7]])), torch.zeros(1, 1))  # group of one

    # identical rewards give no gradient at all, through either loss
    logits, logp, mask, _, _ = token_logprobs(4, N=8)
    adv = rl.group_advantages(torch.full((1, 8), 1.0)).flatten()  # (N,)
    for loss, _ in (
        rl.agentic_loss(logp, logp.detach(), adv, mask),
        rl.reasoning_loss(logp, logp.detach(), logp.detach(), adv, mask),
    ):
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert torch.equal(grad, torch.zeros_like(grad))


def test_icepop_mask_and_ppo_clip():
    # five tokens whose training/inference ratio k is e^-1, e^-0.5, 1, e^0.5, e^1: IcePop keeps [1/2, 2]
    logp_old = torch.full((1, 5), -1.0, dtype=torch.float64)
    logp_rollout = logp_old - torch.tensor([[-1.0, -0.5, 0.0, 0.5, 1.0]], dtype=torch.float64)
    k = torch.exp(logp_old - logp_rollout)
    mask = torch.ones(1, 5, dtype=torch.bool)
    adv = torch.tensor([2.0], dtype=torch.float64)
    x = leaf(logp_old)
    loss, stats = rl.reasoning_loss(x, logp_old, logp_rollout, adv, mask)
    loss.backward()
    kept = torch.tensor([[False, True, True, True, False]])
    assert stats["masked_frac"] == pytest.approx(2 / 5)
    assert torch.equal(x.grad[~kept], torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(x.grad[kept], -(k * 2.0)[kept] / 5, rtol=1e-12, atol=0)  # rho = 1: M(k) * A

    # PPO's clip, 1 + 0.28 above and 1 - 0.2 below: no gradient where the ratio has moved past the band
    # in the advantage's direction, the full gradient where it moved against it
    logp_new = logp_old + torch.tensor(
        [[0.3, 0.3, -0.3, -0.3, 0.1]], dtype=torch.float64
    )  # rho 1.35, .74, 1.1
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)  # per-token advantages (N, T)
    x = leaf(logp_new)
    loss, stats = rl.reasoning_loss(x, logp_old, logp_old, adv, mask)
    loss.backward()
    rho = torch.exp(logp_new - logp_old)
    assert x.grad[0, 0] == 0 and x.grad[0, 2] == 0  # pushed further out: clipped
    torch.testing.assert_close(x.grad[0, [1, 3, 4]], -(rho * adv)[0, [1, 3, 4]] / 5, rtol=1e-12, atol=0)
    assert stats["clip_frac"] == pytest.approx(4 / 5) and stats["masked_frac"] == 0.0


def test_distillation_advantage_sign():
    _, logp, mask, _, g = token_logprobs(5)
    logp_teacher = logp.detach() + torch.randn(logp.shape, generator=g, dtype=torch.float64)
    adv = rl.distill_advantages(logp_teacher, logp)
    assert not adv.requires_grad  # stop-gradient: only the policy-gradient path trains the student
    assert torch.equal(adv > 0, logp_teacher > logp.detach())  # student below teacher: positive
    x = leaf(logp)
    loss, _ = rl.agentic_loss(x, logp.detach(), adv, mask)
    loss.backward()
    # a descent step raises log pi_student where the teacher is above it, lowers it where below
    assert torch.equal((x.grad < 0)[mask], (adv > 0)[mask])


# -----------------------------------------------------------------------------
# The buffer's filters


def traj(group, version=0, failed=False, reward=1.0):
    # prompt token (mask 0, version -1), two sampled tokens, an environment token, one more sampled token
    return Trajectory(
        group,
        ids=[5, 6, 7, 8, 9],
        mask=[0, 1, 1, 0, 1],
        logprobs=[0.0, -0.5, -0.1, 0.0, -0.2],
        versions=[-1, version, version + 1, -1, version + 1],
        reward=reward,
        failed=failed,
    )


def test_group_rule_pads_or_drops_with_counts():
    a = [traj("a") for _ in range(4)]  # all valid: kept as is
    b = [traj("b"), traj("b", failed=True), traj("b"), traj("b")]  # 3 of 4 valid: padded
    c = [traj("c"), traj("c", failed=True), traj("c", failed=True), traj("c")]  # exactly half: dropped
    d = [traj("d"), traj("d"), traj("d")]  # one missing (dropped as stale, say), 3 of 4: padded
    e = [traj("e", failed=True)]  # nothing valid: dropped
    kept, stats = rl.group_filter(a + b + c + d + e, group_size=4)
    assert stats == {"failed": 4, "padded": 2, "dropped_groups": 2}
    assert [t.group for t in kept] == ["a"] * 4 + ["b"] * 4 + ["d"] * 4
    assert not any(t.failed for t in kept)
    assert kept[:4] == a
    assert kept[4:7] == [b[0], b[2], b[3]] and kept[8:11] == d  # the valid ones, then a repeat of the first
    for copy, original in ((kept[7], b[0]), (kept[11], d[0])):  # the same record as a rollout of its own
        assert copy.ids == original.ids and copy.reward == original.reward and copy.rollout_id != ""
    assert len(rl.rollouts(kept)) == 12  # twelve group members, copies included


def folded(group, rid, reward, segments=3, version=0, failed=False):
    """One rollout folded into `segments` records (rollout.py's keep-recent-k), sharing its id and reward."""
    return [
        Trajectory(
            group, [5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.1], [-1, version, version], reward, failed, rid
        )
        for _ in range(segments)
    ]


def test_a_folded_rollout_is_one_group_member():
    # rewards [1, 0, 0, 0], the winner folded into 3 records: its advantage is the unfolded rollout's
    for scale in (True, False):
        unfolded = [folded("g", f"r{i}", r, segments=1) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
        want = rl.trajectory_advantages([t for ts in unfolded for t in ts], scale)  # (4,)
        batch = folded("g", "r0", 1.0, segments=3) + [t for ts in unfolded[1:] for t in ts]
        got = rl.trajectory_advantages(batch, scale)  # (6,): three records of r0, then r1..r3
        torch.testing.assert_close(got, torch.cat([want[:1].repeat(3), want[1:]]))
    assert abs(got[0] - 0.75) < 1e-6 and abs(want[0] - 0.75) < 1e-6  # r - mean, mean-only
    assert abs(rl.trajectory_advantages(batch, True)[0] - 3**0.5) < 1e-4  # +1.73 normalised, not +-1
    # group repair counts rollouts: a group of 4 with 2 valid rollouts in 2 records each is dropped
    g = folded("h", "a", 1.0, 2) + folded("h", "b", 0.0, 2) + folded("h", "c", 0.0, 1, failed=True)
    kept, stats = rl.group_filter(g, group_size=4)
    assert kept == [] and stats == {"failed": 1, "padded": 0, "dropped_groups": 1}
    # 3 valid of 4 (one folded): kept, padded by one whole rollout (both records of "a")
    g = folded("h", "a", 1.0, 2) + folded("h", "b", 0.0, 1) + folded("h", "c", 0.0, 1)
    kept, stats = rl.group_filter(g, group_size=4)
    assert stats["padded"] == 1 and len(kept) == 6 and len(rl.rollouts(kept)) == 4
    # staleness: a rollout with one stale record is dropped whole, not trained in part
    g = folded("s", "old", 1.0, 1, version=0) + folded("s", "old", 1.0, 1, version=5)
    g += folded("s", "new", 0.0, 2, version=5)
    kept, stats = rl.staleness_filter(g, newest=6, tau=3)
    assert [t.rollout_id for t in kept] == ["new", "new"] and stats["stale"] == 1
    assert stats["staleness"] == {1: 1, 6: 1}  # one verdict per rollout: its oldest token's age
    # a rollout's records must agree on the reward
    with pytest.raises(ValueError, match="different groups or rewards"):
        rl.trajectory_advantages(folded("g", "x", 1.0, 1) + folded("g", "x", 0.0, 1))


def test_staleness_filter_and_the_buffer_order():
    trajs = [traj("g", version=v) for v in range(6)]  # oldest sampled token at versions 0..5
    kept, stats = rl.staleness_filter(trajs, newest=6, tau=3)
    assert [t.versions[1] for t in kept] == [3, 4, 5]  # 6 - 3 = 3 behind is allowed, 4 behind is not
    assert stats == {"stale": 3, "staleness": {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1}}
    # environment and prompt tokens (version -1, mask 0) are not "sampled by version -1"
    assert rl.staleness(traj("g", version=6), newest=6) == 0
    empty = Trajectory("g", ids=[1], mask=[0], logprobs=[0.0], versions=[-1])
    assert rl.staleness(empty, newest=9) == 0

    # staleness first: two stale of four leave half a group, which the group rule drops
    trajs = [traj("x", version=0), traj("x", version=0), traj("x", version=5), traj("x", version=5)]
    trajs += [traj("y", version=5) for _ in range(3)] + [traj("y", version=0)]
    kept, stats = rl.filter_buffer(trajs, newest=6, tau=3, group_size=4)
    assert stats["stale"] == 3 and stats["dropped_groups"] == 1 and stats["padded"] == 1
    assert [t.group for t in kept] == ["y"] * 4


# -----------------------------------------------------------------------------
# The DP-aware router


def place(ids, replicas, eps):
    ring = rl.build_ring(replicas)
    where = {}
    loads = dict.fromkeys(replicas, 0)
    for i in ids:
        rl.route(i, ring, where, loads, eps)
    return ring, where, loads


def test_router_same_id_same_replica():
    ids = [f"rollout-{i}" for i in range(300)]
    ring, where, loads = place(ids, ["r0", "r1", "r2"], eps=0.25)
    snapshot = dict(where)
    for i in ids[::7]:  # later turns of live rollouts: pinned, loads unchanged
        assert rl.route(i, ring, where, loads) == snapshot[i]
    assert sum(loads.values()) == 300
    _, again, _ = place(ids, ["r0", "r1", "r2"], eps=0.25)  # a restarted router: the same map
    assert again == snapshot
    rl.release(ids[0], where, loads)
    assert ids[0] not in where and sum(loads.values()) == 299


@pytest.mark.parametrize("n, eps", [(4, 0.25), (7, 0.1)])
def test_router_balance_within_the_bound(n, eps):
    replicas = [f"replica{i}" for i in range(n)]
    m = 2000
    _, _, loads = place([f"id{i}" for i in range(m)], replicas, eps)
    assert sum(loads.values()) == m
    assert max(loads.values()) <= math.ceil((1 + eps) * m / n), loads
    _, _, free = place([f"id{i}" for i in range(m)], replicas, eps=math.inf)
    assert max(free.values()) > max(loads.values()), "the bound should have had something to do"


def test_removing_a_replica_moves_only_its_keys():
    replicas = [f"replica{i}" for i in range(5)]
    ids = [f"id{i}" for i in range(1000)]
    # under the bound (plain consistent hashing): a fresh map without replica2 differs only on its keys
    _, before, _ = place(ids, replicas, eps=math.inf)
    _, after, _ = place(ids, [r for r in replicas if r != "replica2"], eps=math.inf)
    moved = {i for i in ids if before[i] != after[i]}
    assert moved == {i for i in ids if before[i] == "replica2"} and moved

    # bounded and live: remove_replica re-routes exactly the removed replica's rollouts, within the bound
    eps = 0.25
    ring, where, loads = place(ids, replicas, eps)
    old = dict(where)
    ring, moved = rl.remove_replica("replica2", ring, where, loads, eps)
    assert set(moved) == {i for i in ids if old[i] == "replica2"}
    assert all(where[i] == old[i] for i in ids if i not in moved)
    assert "replica2" not in where.values() and all(r != "replica2" for _, r in ring)
    assert max(loads.values()) <= math.ceil((1 + eps) * len(ids) / 4)
    assert loads == {r: sum(1 for v in where.values() if v == r) for r in loads}

    # the last replica: its rollouts are left unplaced, nothing raises
    ring, where, loads = place(ids[:5], ["only"], eps)
    ring, moved = rl.remove_replica("only", ring, where, loads, eps)
    assert (ring, moved, where, loads) == ([], {}, {}, {})


# -----------------------------------------------------------------------------
# The trainer's step on a tiny GLM-5 (float64, so the comparisons can be tight)


def tiny_policy(seed=0):
    m = model.GLM5(tiny_config()).double()
    randomize(m, seed)  # the router bias too: it must survive a step unchanged, so it should not be zero
    return m


def own_logprobs(m, ids):
    """The model's log pi of ids[1:] given the prefix, one unpadded sequence at a time: (len(ids),),
    0.0 at the first token (nothing predicts it)."""
    with torch.no_grad():
        logp = rl.token_logprobs(m, torch.tensor([ids]))[0]
    return [0.0] + logp.tolist()


def on_policy_batch(m, seed, groups=2, n=3, rewards=None):
    """Ragged trajectories (lengths 6 to 12): a 3-token prompt, then sampled tokens with an environment
    token now and then; the rollout logprobs are the model's own, so every ratio is 1."""
    g = torch.Generator().manual_seed(seed)
    V = m.config.vocab_size
    trajs = []
    for k in range(groups * n):
        T = int(torch.randint(6, 13, (1,), generator=g))
        ids = torch.randint(0, V, (T,), generator=g).tolist()
        mask = [0, 0, 0] + [int(x) for x in (torch.rand(T - 3, generator=g) < 0.75).tolist()]
        mask[3] = 1
        logp = own_logprobs(m, ids)
        logp = [lp if s else 0.0 for lp, s in zip(logp, mask)]
        versions = [0 if s else -1 for s in mask]
        reward = float(torch.rand((), generator=g)) if rewards is None else rewards[k // n]
        trajs.append(Trajectory(k // n, ids, mask, logp, versions, reward, rollout_id=f"r{k}"))
    return trajs


def grads(m):
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def reinforce_loss(m, trajs, adv):
    """On-policy REINFORCE by hand: -sum_i A_i sum_t mask * log pi / (number of sampled tokens), each
    trajectory through the model alone, unpadded."""
    total = 0.0
    for a, t in zip(adv, trajs):
        logp = rl.token_logprobs(m, torch.tensor([t.ids]))[0]  # (T - 1,)
        total = total + a * (logp * torch.tensor(t.mask[1:], dtype=logp.dtype)).sum()
    return -total / sum(sum(t.mask) for t in trajs)


def reinforce_per_response(m, trajs, adv):
    """Eq. 1 on-policy by hand: -1/n_groups sum_g 1/G sum_i A_i / |y_i| sum_t mask * log pi, each
    trajectory (one rollout) through the model alone, unpadded."""
    groups = {}
    for a, t in zip(adv, trajs):
        logp = rl.token_logprobs(m, torch.tensor([t.ids]))[0]  # (T - 1,)
        mask = torch.tensor(t.mask[1:], dtype=logp.dtype)
        groups.setdefault(t.group, []).append(a * (logp * mask).sum() / mask.sum())
    return -sum(sum(terms) / len(terms) for terms in groups.values()) / len(groups)


def test_trainer_step_is_on_policy_reinforce():
    import copy

    m = tiny_policy(0)
    trajs = on_policy_batch(m, 0)
    # the agentic objective's advantages: r - mean(r) of the group, no std division; they sum to zero
    adv = rl.trajectory_advantages(trajs, scale_by_std=False).double()
    torch.testing.assert_close(
        adv.view(2, 3).sum(dim=1), torch.zeros(2, dtype=torch.float64), atol=1e-6, rtol=0
    )
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64).view(2, 3)
    torch.testing.assert_close(adv.view(2, 3), rewards - rewards.mean(dim=1, keepdim=True), rtol=0, atol=1e-6)
    std_adv = rl.trajectory_advantages(trajs, scale_by_std=True).double()
    assert (std_adv - adv).abs().max() > 0.1  # the two differ on this batch: the test can tell them apart

    a = rl.freeze_for_rl(copy.deepcopy(m))
    loss, stats = rl.policy_loss(a, trajs)
    loss.backward()
    assert stats["masked_frac"] == 0.0 and stats["abs_r_minus_1"] < 1e-12
    assert stats["tokens"] == sum(sum(t.mask) for t in trajs)
    b = copy.deepcopy(m)
    opt_b = rl.build_optimizers(b, ns_dtype=torch.float64)
    ref = reinforce_loss(b, trajs, adv)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    got, want = grads(a), grads(b)
    assert [n for n, g in got.items() if g is None] == [n for n, g in want.items() if g is None]
    assert any(g is not None and g.abs().max() > 0 for g in want.values())
    for n in want:
        if want[n] is not None:
            torch.testing.assert_close(got[n], want[n], rtol=1e-8, atol=1e-12, msg=n)

    # the whole step: rl_step from the same weights equals clip + step on the hand-computed gradient
    c = copy.deepcopy(m)
    opt_c = rl.build_optimizers(c, ns_dtype=torch.float64)
    stats = rl.rl_step(c, opt_c, trajs, grad_clip=0.5)
    torch.nn.utils.clip_grad_norm_([p for p in b.parameters() if p.requires_grad], 0.5)
    for o in opt_b:
        o.step()
    for (n, p), q in zip(b.named_parameters(), c.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-8, atol=1e-10, msg=n)
    assert stats["grad_norm"] > 0.5, "the clip should have had something to do"
    assert any(not torch.equal(p, q) for p, q in zip(m.parameters(), c.parameters()))

    # GRPO + IcePop on the same on-policy batch: Eq. 1, std-normalised advantages averaged per response
    d = copy.deepcopy(m)
    rl.freeze_for_rl(d)
    loss, stats = rl.policy_loss(d, trajs, kind="reasoning")
    loss.backward()
    assert stats["masked_frac"] == 0.0 and stats["clip_frac"] == 0.0
    e = rl.freeze_for_rl(copy.deepcopy(m))
    reinforce_per_response(e, trajs, std_adv).backward()
    want = grads(e)
    for n, g in grads(d).items():
        if want[n] is not None:
            torch.testing.assert_close(g, want[n], rtol=1e-8, atol=1e-12, msg=n)


def test_masked_tokens_have_no_influence():
    m = rl.freeze_for_rl(tiny_policy(1))
    trajs = on_policy_batch(m, 1)
    loss, _ = rl.policy_loss(m, trajs)
    loss.backward()
    want = grads(m)
    m.zero_grad(set_to_none=True)

    # garbage rollout logprobs (NaN, -inf) on the prompt and environment tokens: bit for bit the same
    changed = []
    for t in trajs:
        logprobs = list(t.logprobs)
        for i, sampled in enumerate(t.mask):
            if not sampled:
                logprobs[i] = math.nan if i % 2 else -math.inf
        changed.append(Trajectory(t.group, t.ids, t.mask, logprobs, t.versions, t.reward))
    loss, _ = rl.policy_loss(m, changed)
    loss.backward()
    for n, g in grads(m).items():
        assert (g is None and want[n] is None) or torch.equal(g, want[n]), n
    m.zero_grad(set_to_none=True)

    # other ids for the environment tokens after the last sampled one, and two more mask-0 tokens (more
    # right padding): the same gradient up to rounding (the experts see other token counts)
    V = m.config.vocab_size
    changed = []
    for t in trajs:
        last = max(i for i, s in enumerate(t.mask) if s)
        ids = t.ids[: last + 1] + [(i * 7 + 3) % V for i in t.ids[last + 1 :]] + [1, 2]  # new tail, 2 more
        mask = t.mask + [0, 0]
        changed.append(
            Trajectory(t.group, ids, mask, t.logprobs + [0.0, 0.0], t.versions + [-1, -1], t.reward)
        )
    loss, _ = rl.policy_loss(m, changed)
    loss.backward()
    for n, g in grads(m).items():
        if want[n] is not None:
            torch.testing.assert_close(g, want[n], rtol=1e-9, atol=1e-13, msg=n)


def test_indexer_and_router_bias_frozen_over_a_step():
    m = tiny_policy(2)
    optimizers = rl.build_optimizers(m)
    frozen = {
        n: t.clone() for n, t in m.state_dict().items() if ".indexer." in n or "e_score_correction_bias" in n
    }
    mtp = {n: p.clone() for n, p in m.named_parameters() if n.startswith("mtp_layers.")}
    before = {n: p.clone() for n, p in m.named_parameters()}
    in_groups = {n for o in optimizers for grp in o.param_groups for n in grp["names"]}
    assert in_groups and not any(".indexer." in n for n in in_groups)
    assert any(".indexer." in n for n in frozen) and any("e_score_correction_bias" in n for n in frozen)
    rl.rl_step(m, optimizers, on_policy_batch(m, 2))
    state = m.state_dict()
    for n, t in frozen.items():
        assert torch.equal(state[n], t), n
    for n, p in mtp.items():  # no MTP loss: the MTP block gets no gradient and keeps its weights
        assert torch.equal(state[n], p), n
    assert not torch.equal(state["lm_head.weight"], before["lm_head.weight"])
    assert sum(not torch.equal(state[n], p) for n, p in before.items()) > len(before) // 2

    # an indexer that still trains is refused, with the fix in the sentence
    m.model.layers[0].self_attn.indexer.wk.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="rl.build_optimizers"):
        rl.rl_step(m, optimizers, on_policy_batch(m, 3))


def test_identical_rewards_give_zero_gradient():
    m = rl.freeze_for_rl(tiny_policy(3))
    trajs = on_policy_batch(m, 4, groups=3, rewards=[1.0, 0.0, 0.3])  # each group's rewards all equal
    for kind in ("agentic", "reasoning"):
        loss, _ = rl.policy_loss(m, trajs, kind=kind)
        loss.backward()
        got = [g for g in grads(m).values() if g is not None]
        assert got and all(torch.equal(g, torch.zeros_like(g)) for g in got), kind
        m.zero_grad(set_to_none=True)


def test_distillation_step_and_the_kinds():
    import copy

    m = rl.freeze_for_rl(tiny_policy(4))
    teacher = tiny_policy(5)
    trajs = on_policy_batch(m, 5)
    loss, stats = rl.policy_loss(m, trajs, kind="distill", teacher=teacher)
    loss.backward()
    ref_model = copy.deepcopy(m)
    ref_model.zero_grad(set_to_none=True)
    ids, mask, _ = rl.collate(trajs)
    logp = rl.token_logprobs(ref_model, ids)
    with torch.no_grad():
        adv = rl.token_logprobs(teacher, ids) - logp
    mask = mask[:, 1:]
    ref = -((adv * logp * mask).sum(dim=1) / mask.sum(dim=1)).mean()  # Eq. 1, group size 1: per response
    ref.backward()
    assert stats["masked_frac"] == 0.0
    for (n, p), q in zip(m.named_parameters(), ref_model.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-8, atol=1e-12, msg=n)
    with pytest.raises(ValueError, match="teacher"):
        rl.policy_loss(m, trajs, kind="distill")
    with pytest.raises(ValueError, match="kind"):
        rl.policy_loss(m, trajs, kind="ppo")
    bad = Trajectory(0, [1, 2, 3], [1, 1, 0], [0.0, -1.0, 0.0], [0, 0, -1])
    with pytest.raises(ValueError, match="first token"):
        rl.collate([bad])
    bad = Trajectory(0, [1, 2, 3], [0, 1], [0.0, -1.0, 0.0], [-1, 0, -1])
    with pytest.raises(ValueError, match="one of each"):
        rl.collate([bad])


def test_distillation_goes_through_the_icepop_band_and_on_policy_stages_refuse_stale_samples():
    """Distillation substitutes its advantage into Eq. 1: a token whose trainer/engine ratio k is 1.5 (inside
    IcePop's [1/2, 2], outside the agentic band's 1.28) keeps its gradient, k * A; one at k = 3 gets none."""
    m = rl.freeze_for_rl(tiny_policy(4))
    teacher = tiny_policy(5)
    trajs = on_policy_batch(m, 5)
    for t in trajs:  # the engine's logprobs: k = 1.5 on even positions, 3 on odd ones
        shifted = []
        for i, (lp, sampled) in enumerate(zip(t.logprobs, t.mask)):
            k = 1.5 if i % 2 == 0 else 3.0
            shifted.append(lp - math.log(k) if sampled else 0.0)
        t.logprobs = shifted
    ids, mask, logp_rollout = rl.collate(trajs)
    logp = rl.token_logprobs(m, ids)  # (N, T - 1)
    x = logp.detach().clone().requires_grad_()
    with torch.no_grad():
        adv = rl.token_logprobs(teacher, ids) - logp
    mask, logp_rollout = mask[:, 1:], logp_rollout[:, 1:]
    weights = rl.response_weights(trajs)  # (N,)
    loss, stats = rl.reasoning_loss(x, x.detach(), logp_rollout, adv, mask, weights=weights)
    loss.backward()
    k = torch.exp(logp.detach() - logp_rollout)
    even = mask & (torch.arange(1, mask.shape[1] + 1) % 2 == 0)  # token t + 1 at column t
    odd = mask & ~even
    assert even.any() and odd.any()
    assert torch.equal(x.grad[odd], torch.zeros_like(x.grad[odd]))  # k = 3: masked
    w = weights[:, None].expand_as(k)
    torch.testing.assert_close(x.grad[even], -(k * adv * w)[even], rtol=1e-9, atol=0)  # k = 1.5: kept
    # and policy_loss's distill kind is exactly that loss
    got, got_stats = rl.policy_loss(m, trajs, kind="distill", teacher=teacher)
    torch.testing.assert_close(got, loss, rtol=1e-10, atol=1e-12)
    assert got_stats["masked_frac"] == stats["masked_frac"] > 0.3

    # the on-policy kinds refuse a batch holding a token of another version than the trainer's
    optimizers = rl.build_optimizers(m)
    batch = on_policy_batch(m, 6)  # every sampled token by version 0
    before = {n: p.clone() for n, p in m.named_parameters()}
    for kind in ("reasoning", "distill"):
        with pytest.raises(ValueError, match="sampled by policy version 0, not the trainer's 1.*on-policy"):
            rl.rl_step(m, optimizers, batch, kind, teacher=teacher, version=1)
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())  # refused before any change
    rl.rl_step(m, optimizers, batch, "reasoning", version=0)  # the current version: trained
    rl.rl_step(m, optimizers, batch, "agentic", version=1)  # the agentic loss takes stale samples


def test_per_trajectory_teachers_score_each_row_with_its_own():
    """Cross-stage distillation with one teacher per task: each row's teacher logprobs are its own
    teacher's, as if that teacher scored the whole batch."""
    m = tiny_policy(4)
    a, b = tiny_policy(5), tiny_policy(6)
    ids = rl.collate(on_policy_batch(m, 5))[0]  # (6, T)
    which = [a, b, b, a, b, a]
    with torch.no_grad():
        got = rl.teacher_logprobs(which, ids)
        full = {id(a): rl.token_logprobs(a, ids), id(b): rl.token_logprobs(b, ids)}
    for i, t in enumerate(which):
        torch.testing.assert_close(got[i], full[id(t)][i], rtol=1e-10, atol=1e-12)
    assert not torch.allclose(full[id(a)], full[id(b)])  # the two teachers really differ
    with pytest.raises(ValueError, match="one per trajectory"):
        rl.teacher_logprobs([a, b], ids)


def test_micro_batches_sort_by_length_and_bound_the_padded_tokens():
    lengths = [9, 3, 12, 3, 7, 40, 5, 12]
    parts = rl.micro_batches(lengths, 24)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # every row once
    flat = [lengths[i] for p in parts for i in p]
    assert flat == sorted(flat)  # like lengths together
    for p in parts:
        assert len(p) * max(lengths[i] for i in p) <= 24 or len(p) == 1  # a 40-token row goes alone
    assert [lengths[i] for i in parts[-1]] == [40]
    assert rl.micro_batches(lengths, 0) == [sorted(range(8), key=lambda i: (lengths[i], i))]
    assert rl.micro_batches([], 24) == [] and rl.micro_batches([], 0) == []


@pytest.mark.parametrize("kind", ["agentic", "reasoning", "distill"])
def test_micro_batched_step_equals_the_whole_batch_step(kind):
    """Gradient accumulation over like-length micro-batches lands on the weights and statistics of one
    forward over the whole padded batch (every term divides by the whole batch's tokens, the advantages
    come from its groups), with one teacher per row for distillation."""
    import copy

    ref = tiny_policy(7)
    trajs = on_policy_batch(ref, 7, groups=3, n=3)
    for t in trajs:  # off-policy rollout logprobs, so the band masks some tokens
        shifted = []
        for i, (lp, sampled) in enumerate(zip(t.logprobs, t.mask)):
            shifted.append(lp - 0.8 * (i % 3 - 1) if sampled else 0.0)
        t.logprobs = shifted
    teacher = None
    if kind == "distill":
        a, b = tiny_policy(8), tiny_policy(9)
        teacher = [a if i % 3 else b for i in range(len(trajs))]
    rl.freeze_for_rl(ref)
    m = copy.deepcopy(ref)
    kw = dict(lr_muon=0.02, lr_adamw=0.01, ns_dtype=torch.float64)
    opt_ref, opt_m = rl.build_optimizers(ref, **kw), rl.build_optimizers(m, **kw)
    want = rl.rl_step(ref, opt_ref, trajs, kind, teacher=teacher, grad_clip=0.5)
    assert len(rl.micro_batches([len(t.ids) for t in trajs], 30)) >= 3
    got = rl.rl_step(m, opt_m, trajs, kind, teacher=teacher, grad_clip=0.5, micro_tokens=30)
    assert got.keys() == want.keys()
    for k in want:  # the fractions are float32 sums in the loss functions: equal to ~1e-7
        assert abs(got[k] - want[k]) < 1e-6, (k, got[k], want[k])
    assert 0 < want["masked_frac"] < 1
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-12, msg=name)


def test_optimizer_reset_is_a_fresh_optimizer():
    import copy

    m = tiny_policy(6)
    optimizers = rl.build_optimizers(m)
    rl.rl_step(m, optimizers, on_policy_batch(m, 6))
    assert all(len(o.state) > 0 for o in optimizers)
    fresh_model = copy.deepcopy(m)
    fresh = rl.build_optimizers(fresh_model)
    rl.reset_optimizers(optimizers)
    assert all(len(o.state) == 0 for o in optimizers)
    trajs = on_policy_batch(m, 7)
    rl.rl_step(m, optimizers, trajs)
    rl.rl_step(fresh_model, fresh, trajs)
    for (n, p), q in zip(m.named_parameters(), fresh_model.parameters()):
        assert torch.equal(p, q), n




# -----------------------------------------------------------------------------
# The trainer under torchrun: two CPU ranks over gloo, FSDP2 as train.py shards, against one process


def _rank_step_check(rank, world, mesh, seed):
    """One rl_step on this rank's rows against rl_step on the whole batch in one process (the same seed on
    both ranks, so both build the same reference): weights and statistics equal."""
    cases = [("agentic", 5, 0, False), ("reasoning", 5, 0, False), ("agentic", 1, 0, False)]
    cases += [("agentic", 5, 11, False)]
    cases += [("agentic", 10, 0, True), ("agentic", 10, 40, True)]  # grouped_batch, each prompt once
    for kind, n_trajs, micro, shared in cases:  # micro: the micro-batches' padded tokens (0: rows at once)
        ref = tiny_policy(seed)
        m = tiny_policy(seed)
        if shared:
            trajs = grouped_batch(ref, seed)
        else:
            trajs = on_policy_batch(ref, seed, groups=3, n=2)[:n_trajs]
        for t in trajs:  # off-policy rollout logprobs: some ratios leave the band and are masked
            shifted = []
            for i, (lp, sampled) in enumerate(zip(t.logprobs, t.mask)):
                shifted.append(lp - 0.8 * (i % 3 - 1) if sampled else 0.0)
            t.logprobs = shifted
        rl.freeze_for_rl(m)
        parallel.shard_model(m, mesh)
        kw = dict(lr_muon=0.02, lr_adamw=0.01, ns_dtype=torch.float64)
        opt_ref = rl.build_optimizers(ref, **kw)
        opt_m = rl.build_optimizers(m, **kw)
        # against the one-process step of the same kind (shared == plain: test_shared_prefix_step_...)
        want = rl.rl_step(ref, opt_ref, trajs, kind, grad_clip=0.5, shared_prefix=shared)
        got = rl.rl_step(
            m,
            opt_m,
            trajs,
            kind,
            grad_clip=0.5,
            world=world,
            rank=rank,
            micro_tokens=micro,
            shared_prefix=shared,
        )
        if micro and not shared:  # every row alone (lengths 6 to 12): rank 0 runs 3 micro-batches, rank 1 two
            lengths = [len(t.ids) for t in trajs]
            counts = [len(rl.micro_batches([lengths[i] for i in range(r, 5, 2)], micro)) for r in range(2)]
            assert counts[0] != counts[1], counts
        if micro and shared:  # groups 0, 2 on rank 0 and 1, 3 on rank 1: 2 micro-batches against 1 (filler)
            counts = []
            for r in range(2):
                mine = [t for t in trajs if t.group % 2 == r]
                ids, groups = [t.ids for t in mine], [t.group for t in mine]
                counts.append(len(shared_prefix.group_micro_batches(ids, groups, micro)))
            assert counts[0] != counts[1], counts
        # the statistics' fractions are float32 sums in the loss functions: equal to ~1e-7
        for k in ("tokens", "masked_frac", "abs_r_minus_1", "loss", "grad_norm", "reward"):
            assert abs(got[k] - want[k]) < 1e-6, (kind, n_trajs, k, got[k], want[k])
        assert 0 < want["masked_frac"] < 1
        n_sharded = 0
        for (name, p), q in zip(ref.named_parameters(), m.parameters()):
            n_sharded += q.to_local().numel() < p.numel()
            # shared: a prefix's gradient is summed over its rows in another order per rank (1.3e-10 seen)
            tol = 1e-9 if shared else 1e-10
            torch.testing.assert_close(q.full_tensor(), p.data, rtol=0, atol=tol, msg=name)
        assert n_sharded > 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_the_sharded_step_under_fsdp2_equals_the_one_process_step():
    """Two ranks, each training its rows of the same batch (odd sizes, one trajectory for two ranks, and
    micro-batches, a different number on each rank), land on the one-process weights and statistics: the
    whole batch's advantages and token count."""
    on_two_gloo_ranks(_rank_step_check, 3)  # the assertions run in both ranks; either one failing fails this


# -----------------------------------------------------------------------------
# The shared-prefix forward (shared_prefix.py): each group's prompt encoded once, the same numbers


def grouped_batch(m, seed, sizes=(3, 1, 4, 2)):
    """Groups whose samples share a prompt (2 to 9 tokens), then 1 to 8 tokens of their own, with an
    environment token now and then; the rollout logprobs are the model's own. One group's samples also
    share their first sampled tokens, one sample is its prompt + a single token, and one group's prompts
    differ from their first token on (nothing shared: that group runs as a plain padded batch)."""
    g = torch.Generator().manual_seed(seed)
    V = m.config.vocab_size
    trajs = []
    for k, n in enumerate(sizes):
        P = int(torch.randint(2, 10, (1,), generator=g))
        prompt = torch.randint(0, V, (P,), generator=g).tolist()
        common = torch.randint(0, V, (3,), generator=g).tolist() if k == 0 else []
        for j in range(n):
            own = torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            if k == 2 and j == 0:
                own = own[:1]
            ids = prompt + common + own
            if k == 3:  # nothing shared: another first token for each sample
                ids = [j % V] + ids
            mask = [0] * (len(ids) - len(common) - len(own))
            mask += [int(x) for x in (torch.rand(len(common) + len(own), generator=g) < 0.8).tolist()]
            mask[-len(own)] = 1
            logp = [lp if s else 0.0 for lp, s in zip(own_logprobs(m, ids), mask)]
            versions = [0 if s else -1 for s in mask]
            reward = float(torch.rand((), generator=g))
            trajs.append(Trajectory(k, ids, mask, logp, versions, reward, rollout_id=f"r{k}-{j}"))
    return trajs


def padded_ids(trajs):
    T = max(len(t.ids) for t in trajs)
    ids = torch.zeros(len(trajs), T, dtype=torch.long)
    for i, t in enumerate(trajs):
        ids[i, : len(t.ids)] = torch.tensor(t.ids)
    return ids


@pytest.mark.parametrize(
    "index_quant, dsa_mode, temperature",
    [("none", "sparse", 1.0), ("int8", "sparse", 1.0), ("none", "dense", 0.7)],
)
def test_shared_prefix_logprobs_and_gradient_equal_the_plain_forward(index_quant, dsa_mode, temperature):
    """shared_token_logprobs gives every row's logprobs as the padded forward does (DSA selecting: the
    rows are longer than index_topk; dense: the absorbed form against the plain path's fused attention), at
    the sampling temperature, and backward gives the same gradient."""
    m = model.GLM5(tiny_config(index_quant=index_quant, dsa_mode=dsa_mode)).double()
    randomize(m, 3)
    trajs = grouped_batch(m, 3)
    assert max(len(t.ids) for t in trajs) > m.config.index_topk
    rows = [t.ids for t in trajs]
    assert shared_prefix.common_prefix_length([t.ids for t in trajs if t.group == 3]) == 0
    got = shared_prefix.shared_token_logprobs(m, rows, [t.group for t in trajs], temperature)
    want = rl.token_logprobs(m, padded_ids(trajs), temperature)
    assert got.shape == want.shape
    for i, t in enumerate(trajs):  # the positions past a row's end are padding, dropped by the mask
        n = len(t.ids) - 1
        torch.testing.assert_close(got[i, :n], want[i, :n], rtol=0, atol=1e-10)
        assert torch.all(got[i, n:] == 0)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for i, t in enumerate(trajs):
        weights[i, len(t.ids) - 1 :] = 0
    (got * weights).sum().backward()
    shared_grads = grads(m)
    m.zero_grad()
    (want * weights).sum().backward()
    for name, gr in grads(m).items():
        if gr is None:
            assert shared_grads[name] is None, name
        else:
            torch.testing.assert_close(shared_grads[name], gr, rtol=0, atol=1e-10, msg=name)


def test_prefix_units_and_micro_batches_of_whole_groups():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [7, 8], [9, 9, 9], [4, 4, 4, 4, 4, 4, 4]]
    groups = ["a", "a", "b", "b", "c"]
    # a: 3 tokens shared; b: nothing shared, a unit per row; c: alone, all but its last token
    assert shared_prefix.prefix_units(rows, groups) == [(3, [0, 1]), (1, [2]), (2, [3]), (6, [4])]
    parts = shared_prefix.group_micro_batches(rows, groups, 10)
    assert sorted(i for p in parts for i in p) == list(range(5))
    for p in parts:
        assert {groups[i] for i in p} in ({"a"}, {"b"}, {"c"})  # 10 padded tokens hold one group at a time
    # b (6 padded tokens alone) and a (5) run 13 together: within 1.25x; c's 6-token prefix would pad
    # the others' to 29 tokens for 18 alone, so it goes on its own, cap or none
    assert shared_prefix.group_micro_batches(rows, groups, 15) == [[2, 3, 0, 1], [4]]
    assert shared_prefix.group_micro_batches(rows, groups, 0) == [[2, 3, 0, 1], [4]]
    assert shared_prefix.group_micro_batches(rows, groups, 0, slack=10) == [[2, 3, 0, 1, 4]]
    assert shared_prefix.group_micro_batches([], [], 8) == []
    with pytest.raises(ValueError, match="at least two tokens"):
        shared_prefix.prefix_units([[1]], [0])


@pytest.mark.parametrize("kind", ["agentic", "reasoning", "distill"])
def test_shared_prefix_step_equals_the_plain_step(kind):
    """rl_step with each group's prompt encoded once, in micro-batches of whole groups, lands on the weights
    and statistics of the plain step."""
    import copy

    ref = tiny_policy(11)
    trajs = grouped_batch(ref, 11)
    for t in trajs:  # off-policy rollout logprobs, so the band masks some tokens
        shifted = []
        for i, (lp, sampled) in enumerate(zip(t.logprobs, t.mask)):
            shifted.append(lp - 0.8 * (i % 3 - 1) if sampled else 0.0)
        t.logprobs = shifted
    teacher = tiny_policy(12) if kind == "distill" else None
    rl.freeze_for_rl(ref)
    m = copy.deepcopy(ref)
    kw = dict(lr_muon=0.02, lr_adamw=0.01, ns_dtype=torch.float64)
    opt_ref, opt_m = rl.build_optimizers(ref, **kw), rl.build_optimizers(m, **kw)
    want = rl.rl_step(ref, opt_ref, trajs, kind, teacher=teacher, grad_clip=0.5)
    rows = [t.ids for t in trajs]
    assert len(shared_prefix.group_micro_batches(rows, [t.group for t in trajs], 40)) >= 2
    got = rl.rl_step(
        m, opt_m, trajs, kind, teacher=teacher, grad_clip=0.5, micro_tokens=40, shared_prefix=True
    )
    assert got.keys() == want.keys()
    for k in want:
        assert abs(got[k] - want[k]) < 1e-6, (k, got[k], want[k])
    assert 0 < want["masked_frac"] < 1
    for (name, p), q in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-10, msg=name)
