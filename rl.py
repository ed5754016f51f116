"""
GLM-5's RL post-training, the math of it (GLM-5 report, arXiv 2602.15763, its post-training sections):
- reasoning RL, the report's Eq. 1: GRPO's clipped ratio with DAPO's asymmetric band (Yu et al. 2025), times
  IcePop's mask of tokens whose training/inference ratio leaves [1/2, 2] (Ling Team, arXiv 2510.18855),
  advantages normalised by the group's std, averaged per response then over the group; entirely on-policy;
- agentic RL: direct double-sided importance sampling against the rollout engine's own logprobs, a token
  outside the trust band masked, advantages r - mean(r) of the group;
- on-policy cross-stage distillation: the advantage sg[log pi_teacher - log pi_student] through Eq. 1;
- a rollout folded into several records (keep-recent-k, discard-all) as one group member; the staleness
  and group filters over rollouts; the trainer's step (rl_step, with the indexers and router bias frozen,
  micro-batches, FSDP2 ranks, the shared-prefix forward); the optimizer reset after each push;
- the DP-aware router: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018).
rl_async.py runs them in the asynchronous loop over serve.py replicas.

Run it:
    python rl.py        # each piece on made-up numbers
Tests: python -m pytest -q tests/test_rl.py
Honest limits: agentic_loss's eps band is not published (we take the reasoning band, 0.2 / 0.28); the RL
learning rates are placeholders; rl_step takes one optimizer step per batch, the report's "entirely
on-policy" reasoning RL, so pi_old is the trainer's own logprob before the step (rho = 1: the clip is in the
formula and bites only when a batch is split into several steps, not done here) and IcePop's k measures the
engines' mismatch alone; the MTP block keeps its SFT weights; the router balances live rollouts, not tokens.
"""

import argparse
import bisect
import dataclasses
import hashlib
import math
from collections import Counter

import torch
import torch.distributed as dist

import muon
import parallel
from dsa import upcast
from rollout import Trajectory  # one rollout's exact token record, kept where TITO lives
from shared_prefix import group_micro_batches, shared_token_logprobs

# -----------------------------------------------------------------------------
# Group-relative advantages (GRPO)


# The report's advantage for each loss: reasoning RL's Eq. 1 normalises by the group's std (GRPO); the
# agentic objective (and general RL, which trains with it here) uses r - mean(r) of the group alone
# (Dr. GRPO's choice too, Liu et al. 2025: no up-weighting of groups that are nearly all right or all
# wrong); distillation's advantage is per token, no group.
SCALE_BY_STD = {"reasoning": True, "agentic": False}
ON_POLICY = ("reasoning", "distill")  # the report runs both entirely on-policy (check_on_policy)


def group_advantages(rewards, scale_by_std=True, eps=1e-6):
    """The group-relative advantage: each sample's reward against the other samples of its group (the same
    prompt), with no value network: A = (r - mean) / (std + eps) with scale_by_std (GRPO, DeepSeekMath,
    section 4.1; with 0/1 rewards it keeps the step size the same whether a group solved 1 of 8 or 7 of 8),
    A = r - mean without (SCALE_BY_STD says which objective takes which).

    rewards: (G, n) float, G groups of n samples. Returns (G, n). A group whose rewards are all equal
    teaches nothing: its advantages are set to exactly zero (a float mean of equal numbers may be off by one
    ulp).
    """
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)  # (G, 1)
    adv = rewards - mean
    if scale_by_std:
        std = rewards.std(dim=1, keepdim=True, correction=0)  # population std: defined for n = 1 too
        adv = adv / (std + eps)
    same = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)  # (G, 1)
    return torch.where(same, torch.zeros_like(adv), adv)


# -----------------------------------------------------------------------------
# The policy losses, from per-token tensors
#
# Every loss takes the trainer's logprobs of the sampled tokens, logp_new (N, T) with grad, the rollout
# engine's logprobs of the same tokens, logp_rollout (N, T), as the TITO gateway recorded them (never
# recomputed from text), advantages (N,) per trajectory or (N, T) per token, and the loss mask (N, T):
# True for the tokens the model sampled, False for the prompt and the environment's tokens.
# Each returns (loss, stats): stats are the floats the step's log line prints.


def masked_mean(x, mask):
    """Mean of x over the True entries of mask (a statistic for the log line); 0 when mask is empty."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)


def denominator(mask, n_tokens=None):
    """What a loss divides its sum by: the loss-mask tokens of the batch (at least 1), or n_tokens."""
    if n_tokens is None:
        return mask.sum().clamp(min=1)
    return max(n_tokens, 1)


def finite_outside(mask, *tensors):
    """The tensors with zeros where mask is False: an environment token's logprob may be missing (NaN, -inf)
    and exp() of it in a ratio would turn the zero gradient torch.where gives a masked token into 0 * inf."""
    return [torch.where(mask, x, torch.zeros_like(x)) for x in tensors]


def per_token(advantages, like):
    """Advantages (N,) for every token of their trajectory, or (N, T) as given: (N, T) either way."""
    if advantages.dim() == 1:
        return advantages[:, None].expand_as(like)
    return advantages


def agentic_loss(logp_new, logp_rollout, advantages, mask, eps_low=0.2, eps_high=0.28, n_tokens=None):
    """Direct double-sided importance sampling with token masking (GLM-5 report, agentic RL):

        L = -E_t[ f(r_t) * A_t * log pi_theta(a_t) ],  r_t = pi_theta(a_t) / pi_rollout(a_t),
        f(r) = r inside (1 - eps_low, 1 + eps_high), else 0.

    pi_rollout is the engine that sampled the token, so one ratio covers both the policy's staleness (the
    rollout ran on older weights) and the engine's numerical mismatch; no pi_old is recomputed. f(r_t) is a
    weight, not a path for the gradient (it is detached), so the gradient on log pi_theta is exactly
    r_t * A_t inside the band and exactly zero outside, where the token is masked. With equal logprobs
    (r = 1) this is on-policy REINFORCE, -E_t[A_t log pi_theta], value and gradient.

    logp_new: (N, T) with grad; logp_rollout: (N, T); advantages: (N,) or (N, T); mask: (N, T) bool.
    The mean is over the loss-mask tokens, masked-by-the-band ones included, so masking a token removes its
    term without scaling up the others. n_tokens: divide by this count instead (the whole batch's, when
    this is one rank's share of it).
    """
    mask = mask.bool()
    adv = per_token(advantages, logp_new)  # (N, T)
    logp_new, logp_rollout, adv = finite_outside(mask, logp_new, logp_rollout, adv)
    ratio = torch.exp(logp_new.detach() - logp_rollout)  # (N, T), r_t, no grad
    keep = mask & (ratio > 1 - eps_low) & (ratio < 1 + eps_high)  # (N, T), inside the trust band
    weight = torch.where(keep, ratio, torch.zeros_like(ratio))  # f(r_t), zero where masked
    loss = -(weight * adv * logp_new).sum() / denominator(mask, n_tokens)
    stats = {
        "tokens": int(mask.sum()),
        "masked_frac": float((mask & ~keep).sum() / mask.sum().clamp(min=1)),
        "abs_r_minus_1": float(masked_mean((ratio - 1).abs(), mask)),
    }
    return loss, stats


def reasoning_loss(
    logp_new,
    logp_old,
    logp_rollout,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.28,
    icepop=(0.5, 2.0),
    weights=None,
):
    """GRPO + IcePop, the GLM-5 report's Eq. 1 (Reasoning RL): PPO's clipped objective on rho = pi_theta /
    pi_old (clip [1 - 0.2, 1 + 0.28], DAPO's clip-higher), with IcePop's calibration of the
    training/inference mismatch k = pi_old / pi_rollout, both measured on the same weights, averaged per
    response and then over the group:

        L = -1/G sum_i 1/|y_i| sum_t M(k_t) * min(rho_t * A_t, clip(rho_t, 1 - eps_l, 1 + eps_h) * A_t),
        M(k) = k inside [icepop[0], icepop[1]], else 0 (the token is masked),

    with eps_l, eps_h = clip_low, clip_high.

    A 2-token response weighs as much as a 200-token one. pi_old is the trainer's own logprob of the batch
    before this step's updates (logp_old, no grad), so rho measures the optimizer's steps and k only the
    engine's numerics (MoE routing, kernels, precision); IcePop drops the tokens where the two engines
    disagree by more than a factor of two either way. On-policy (the report's reasoning RL), with one
    optimizer step per batch, logp_old = logp_new.detach(): rho is 1 and the gradient is
    M(k_t) * A_t * grad log pi_theta / (G |y_i|).

    logp_new: (N, T) with grad; logp_old, logp_rollout: (N, T); advantages: (N,) or (N, T); mask: (N, T).
    weights: (N,), what each row's token sum is multiplied by: 1 / (G |y_i|) averaged over the batch's
    groups (response_weights, which counts a folded rollout's records as one response); None: each row one
    response, 1 / (N |y_i|).
    """
    mask = mask.bool()
    adv = per_token(advantages, logp_new)  # (N, T)
    logp_new, logp_old, logp_rollout, adv = finite_outside(mask, logp_new, logp_old, logp_rollout, adv)
    rho = torch.exp(logp_new - logp_old.detach())  # (N, T), with grad through logp_new
    k = torch.exp(logp_old - logp_rollout).detach()  # (N, T), training / inference probability
    keep = mask & (k >= icepop[0]) & (k <= icepop[1])  # (N, T)
    clipped = torch.clamp(rho, 1 - clip_low, 1 + clip_high)  # no gradient outside the clip range
    surrogate = torch.minimum(rho * adv, clipped * adv)  # (N, T)
    weight = torch.where(keep, k, torch.zeros_like(k))  # M(k_t), zero where masked
    if weights is None:
        weights = 1.0 / (mask.sum(dim=1).clamp(min=1).to(surrogate.dtype) * mask.shape[0])  # (N,)
    loss = -((weight * surrogate).sum(dim=1) * weights.to(surrogate.dtype)).sum()
    is_clipped = rho.detach() != clipped.detach()
    stats = {
        "tokens": int(mask.sum()),
        "masked_frac": float((mask & ~keep).sum() / mask.sum().clamp(min=1)),
        "abs_r_minus_1": float(masked_mean((k - 1).abs(), mask)),  # here r is k, what IcePop watches
        "clip_frac": float(masked_mean(is_clipped.float(), keep)),
    }
    return loss, stats


def distill_advantages(logp_teacher, logp_student):
    """On-policy cross-stage distillation (GLM-5 report): on the student's own samples, each token's
    advantage is sg[log pi_teacher - log pi_student], group size 1 (no group baseline).

    Positive where the teacher likes the sampled token more than the student does, so the policy gradient
    raises it; the expectation of the sum over a sample is minus the reverse KL(student || teacher). Each
    token gets its own term only, no sum over the tokens after it. Shapes: (N, T) in and out; the report
    substitutes it into Eq. 1, so pass it to reasoning_loss as its per-token advantages.
    """
    return (logp_teacher - logp_student).detach()


# -----------------------------------------------------------------------------
# A rollout is one group member
#
# Folding a rollout's old tool results (rollout.py's keep-recent-k and discard-all) rewrites its context, so
# one rollout reaches the trainer as several Trajectory records (segments) with one rollout_id. It is still
# one sample of its group (GLM-5 report, context management of search agents; its agentic RL): one reward,
# one advantage, one validity and staleness verdict, inherited by each of its records, and its response
# length |y_i| counts the sampled tokens of all of them.


def rollouts(trajs):
    """{rollout: [record indices]} in order of first appearance. A record's rollout is its rollout_id; a
    record with none (a test's, a hand-made one) is a rollout of its own."""
    out = {}
    for i, t in enumerate(trajs):
        key = t.rollout_id if t.rollout_id else ("record", i)
        out.setdefault(key, []).append(i)
    return out


def group_rollouts(trajs):
    """{group: [[record indices of one rollout], ...]}, groups and rollouts in order of first appearance.
    The records of one rollout must carry one reward and one group (a ValueError names the rollout)."""
    groups = {}
    for key, idx in rollouts(trajs).items():
        first = trajs[idx[0]]
        for i in idx[1:]:
            if trajs[i].group != first.group or float(trajs[i].reward) != float(first.reward):
                raise ValueError(
                    f"rollout {key}'s records carry different groups or rewards ({first.group}, "
                    f"{first.reward} against {trajs[i].group}, {trajs[i].reward}); every segment of a "
                    "folded rollout must carry the rollout's own (rollout.trajectories does)"
                )
        groups.setdefault(first.group, []).append(idx)
    return groups


def trajectory_advantages(trajs, scale_by_std=True):
    """group_advantages over the batch's groups, one advantage per rollout (not per record), inherited by
    each of its records. -> (N,) float, one advantage per record."""
    adv = torch.zeros(len(trajs))
    for members in group_rollouts(trajs).values():
        rewards = torch.tensor([[float(trajs[idx[0]].reward) for idx in members]])  # (1, G)
        for idx, a in zip(members, group_advantages(rewards, scale_by_std)[0]):
            adv[idx] = a
    return adv


def response_weights(trajs):
    """Eq. 1's aggregation, 1/G sum_i 1/|y_i| sum_t, averaged over the batch's groups: each record's weight
    on its token sum, 1 / (n_groups * G * |y_i|), with G the group's rollouts and |y_i| the sampled tokens
    of the record's whole rollout (all its segments). -> (N,) float64."""
    w = torch.zeros(len(trajs), dtype=torch.float64)
    groups = group_rollouts(trajs)
    for members in groups.values():
        for idx in members:
            length = sum(sum(trajs[i].mask) for i in idx)
            w[idx] = 1.0 / (len(groups) * len(members) * max(length, 1))
    return w


# -----------------------------------------------------------------------------
# The buffer's two filters, over rollouts (GLM-5 report, agentic RL infrastructure)


def staleness(traj, newest):
    """How many policy versions behind the newest its oldest sampled token is (0 with no sampled token)."""
    sampled = [v for v, m in zip(traj.versions, traj.mask) if m]
    if not sampled:
        return 0
    return newest - min(sampled)


def staleness_filter(trajs, newest, tau):
    """Drop a rollout whose oldest sampled token (in any of its records) is more than tau versions older
    than the newest policy: the policy that sampled it is far from the one being trained, so its importance
    ratios say little and most of its tokens would be masked anyway. A rollout is kept or dropped whole.
    Returns (kept records, stats): stats counts the dropped rollouts ("stale") and holds the staleness
    histogram of the rollouts seen, failed ones left out ({versions behind: count}), for the log line."""
    keep = set()
    seen = Counter()
    stale = 0
    for idx in rollouts(trajs).values():
        age = max(staleness(trajs[i], newest) for i in idx)
        if age <= tau:
            keep.update(idx)
        else:
            stale += 1
        if not any(trajs[i].failed for i in idx):  # a failed one sampled nothing
            seen[age] += 1
    kept = [t for i, t in enumerate(trajs) if i in keep]
    return kept, {"stale": stale, "staleness": dict(sorted(seen.items()))}


def group_filter(trajs, group_size):
    """The group rule for samples from crashed environments, counted in rollouts: drop the failed ones; a
    group with more than half of group_size valid rollouts is padded back to group_size by repeating its
    valid rollouts in order (each copy a rollout of its own, under a new rollout_id), so the group still
    compares group_size samples; a group with half or fewer valid is dropped whole.

    Groups keep the order they first appear in; a group's missing rollouts (dropped as stale, say) count as
    invalid. Returns (kept records, stats) with the counts, in rollouts, "failed", "padded" (copies added)
    and "dropped_groups"."""
    kept = []
    stats = {"failed": 0, "padded": 0, "dropped_groups": 0}
    for members in group_rollouts(trajs).values():
        valid = [idx for idx in members if not any(trajs[i].failed for i in idx)]
        stats["failed"] += len(members) - len(valid)
        if 2 * len(valid) <= group_size:
            stats["dropped_groups"] += 1
            continue
        for idx in valid:
            kept += [trajs[i] for i in idx]
        pad = max(0, group_size - len(valid))
        for k in range(pad):
            idx = valid[k % len(valid)]
            copy_id = f"{trajs[idx[0]].rollout_id or idx[0]}~pad{k}"
            kept += [dataclasses.replace(trajs[i], rollout_id=copy_id) for i in idx]
        stats["padded"] += pad
    return kept, stats


def filter_buffer(trajs, newest, tau, group_size):
    """The buffer's two filters in order: staleness first, then the group rule on what is left (a stale
    rollout is missing from its group, like a failed one). Returns (kept, stats of both)."""
    fresh, stale_stats = staleness_filter(trajs, newest, tau)
    kept, group_stats = group_filter(fresh, group_size)
    return kept, {**stale_stats, **group_stats}


def check_on_policy(trajs, version):
    """Reasoning RL and distillation are on-policy (GLM-5 report): every sampled token must come from the
    trainer's current policy version, so that pi_old (the trainer's own logprob before the step) is the
    policy that sampled the batch and IcePop's k measures only the engines' mismatch. A ValueError names the
    first record off it and the fix."""
    for i, t in enumerate(trajs):
        other = sorted({v for v, m in zip(t.versions, t.mask) if m and v != version})
        if other:
            raise ValueError(
                f"trajectory {i} (rollout {t.rollout_id or i}) holds tokens sampled by policy version "
                f"{other[0]}, not the trainer's {version}; reasoning RL and distillation are on-policy: "
                "sample each batch with the current weights (rl_async.py: mode=sync, tau=0, push_every=1)"
            )


# -----------------------------------------------------------------------------
# The trainer's step: the policy's logprobs on the exact token ids, the loss, one optimizer step
#
# GLM-5 trains RL with the indexer and the MoE router's correction bias frozen and without the balance loss
# (GLM-5 report, RL sections): the sparse attention pattern and the expert load the rollout engine saw stay
# the ones the trainer sees, so a token's two logprobs come from the same routing. Here the indexers get
# requires_grad False (param_groups then leaves them out of the optimizers), update_router_bias is never
# called, and the forward runs without targets: no balance loss, no MTP loss, no indexer KL. The MTP block
# gets no gradient, so the optimizers skip it and it keeps its SFT weights.


def freeze_for_rl(m):
    """The indexers stop training: requires_grad False on every `.indexer.` parameter. Returns m."""
    for name, p in m.named_parameters():
        if ".indexer." in name:
            p.requires_grad_(False)
    return m


def build_optimizers(m, lr_muon=2e-3, lr_adamw=3e-4, weight_decay=0.1, ns_dtype=torch.float32):
    """train.py's optimizers for RL: muon.build_optimizers (Muon Split for the block matrices, AdamW for
    the embeddings, lm_head, router and norms) over what RL trains, the indexers frozen first. The learning
    rates are placeholders (GLM-5 does not publish its RL ones): a tenth of train.py's peaks, constant.
    -> [Muon, AdamW]."""
    freeze_for_rl(m)
    return list(
        muon.build_optimizers(
            m, lr_muon=lr_muon, lr_adamw=lr_adamw, weight_decay=weight_decay, ns_dtype=ns_dtype
        )
    )


def reset_optimizers(optimizers):
    """The reset after each weight push (GLM-5 report, agentic RL: the optimizer is reset after each update
    of the rollout engines' weights): forget every moment (Muon's momentum, AdamW's m, v and step count), so
    the next step starts as a fresh optimizer would; the learning rates stay. The moments gathered on
    samples of the older policy then do not carry into the steps on the new one."""
    for o in optimizers:
        o.state.clear()


def collate(trajs, device="cpu"):
    """Right-pad a batch of Trajectory records: ids (N, T) long (pad 0), mask (N, T) bool and the rollout
    logprobs (N, T) float64 (pad: mask False, logprob 0), T the longest trajectory. The attention is causal
    and the MoE routes each token alone, so a trajectory's padding changes none of its own logprobs."""
    for i, t in enumerate(trajs):
        if not len(t.ids) == len(t.mask) == len(t.logprobs):
            raise ValueError(
                f"trajectory {i} has {len(t.ids)} ids, {len(t.mask)} mask entries and {len(t.logprobs)} "
                "logprobs; the TITO record must give one of each per token"
            )
        if t.mask[0]:
            raise ValueError(
                f"trajectory {i} marks its first token as sampled, but nothing predicts a sequence's first "
                "token; the record must start with the prompt"
            )
    T = max(len(t.ids) for t in trajs)
    ids = torch.zeros(len(trajs), T, dtype=torch.long)
    mask = torch.zeros(len(trajs), T, dtype=torch.bool)
    logprobs = torch.zeros(len(trajs), T, dtype=torch.float64)
    for i, t in enumerate(trajs):
        n = len(t.ids)
        ids[i, :n] = torch.tensor(t.ids)
        mask[i, :n] = torch.tensor(t.mask).bool()
        logprobs[i, :n] = torch.tensor(t.logprobs, dtype=torch.float64)
    return ids.to(device), mask.to(device), logprobs.to(device)


def token_logprobs(m, ids, temperature=1.0):
    """log pi(ids[:, t + 1] | ids[:, :t + 1]) for every t: one teacher-forced forward of the model on
    ids[:, :-1], log_softmax gathered at ids[:, 1:]. The temperature must be the one the rollout sampled at,
    or the ratio against the engine's logprobs is off by it. ids (N, T) -> (N, T - 1)."""
    logits = m(ids[:, :-1])  # (N, T - 1, V): no targets, so no MTP, balance or indexer-KL loss
    logp = torch.log_softmax(upcast(logits) / temperature, dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]  # (N, T - 1)


def teacher_logprobs(teacher, ids, temperature=1.0):
    """token_logprobs under the teacher: one model for every row, or a list of one model per row (each
    task distilled from its own earlier stage), each model run once on its rows. ids (N, T) -> (N, T - 1)."""
    if isinstance(teacher, torch.nn.Module):
        return token_logprobs(teacher, ids, temperature)
    if len(teacher) != ids.shape[0]:
        raise ValueError(f"{len(teacher)} teachers for {ids.shape[0]} trajectories: give one per trajectory")
    out = None
    for t in {id(t): t for t in teacher}.values():
        rows = torch.tensor([i for i, x in enumerate(teacher) if x is t], device=ids.device)
        logp = token_logprobs(t, ids[rows], temperature)  # (n, T - 1)
        if out is None:
            out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=logp.dtype, device=ids.device)
        out[rows] = logp
    return out


def policy_loss(
    m,
    trajs,
    kind="agentic",
    teacher=None,
    temperature=1.0,
    scale_by_std=None,
    advantages=None,
    shared_prefix=False,
    n_tokens=None,
    weights=None,
    **band,
):
    """The RL loss of a batch of Trajectory records, from the exact token ids the engine saw:

    kind "agentic":   agentic_loss, advantages r - mean(r) per group, ratio against the rollout logprobs;
    kind "reasoning": reasoning_loss (Eq. 1: GRPO + IcePop, per-response averaging), advantages normalised
                      by the group's std, pi_old = the trainer's logprob before the step (on-policy);
    kind "distill":   reasoning_loss with distill_advantages from the teacher's logprobs of the same ids
                      (on-policy cross-stage distillation through Eq. 1, group size 1: rewards are not
                      used); teacher is a model or a list of one model per trajectory (teacher_logprobs).
    scale_by_std: None takes the kind's (SCALE_BY_STD). advantages: (N,) to use instead of the batch's own
    group advantages, and weights: (N,) instead of its response_weights (a rank's or a micro-batch's rows of
    a batch whose groups it does not hold whole); n_tokens: agentic_loss's denominator, likewise. band: the
    loss's own keywords (eps_low / eps_high; clip_low / clip_high / icepop). shared_prefix: each group's
    prompt encoded once (shared_prefix.shared_token_logprobs: the same logprobs, about a third of the tokens
    on the toy run); False: one padded forward over the rows (token_logprobs, the reference).
    -> (loss, stats)."""
    if kind not in ("agentic", "reasoning", "distill"):
        raise ValueError(f"kind must be 'agentic', 'reasoning' or 'distill', got {kind!r}")
    if kind == "distill" and teacher is None:
        raise ValueError("kind 'distill' needs the teacher model (the earlier stage's checkpoint)")
    ids, mask, logp_rollout = collate(trajs, next(m.parameters()).device)
    if shared_prefix:
        rows = [list(t.ids) for t in trajs]
        logp = shared_token_logprobs(m, rows, [t.group for t in trajs], temperature)  # (N, T - 1)
    else:
        logp = token_logprobs(m, ids, temperature)  # (N, T - 1), the tokens ids[:, 1:]
    mask = mask[:, 1:]  # (N, T - 1), aligned with the tokens logp scores
    logp_rollout = logp_rollout[:, 1:]
    if kind == "distill":
        with torch.no_grad():
            logp_teacher = teacher_logprobs(teacher, ids, temperature)  # (N, T - 1)
        adv = distill_advantages(logp_teacher, logp)  # (N, T - 1)
    else:
        adv = advantages
        if adv is None:
            if scale_by_std is None:
                scale_by_std = SCALE_BY_STD[kind]
            adv = trajectory_advantages(trajs, scale_by_std)
        adv = adv.to(logp.device)  # (N,)
    if kind == "agentic":
        return agentic_loss(logp, logp_rollout, adv, mask, n_tokens=n_tokens, **band)
    if weights is None:
        weights = response_weights(trajs)
    weights = weights.to(logp.device)
    return reasoning_loss(logp, logp.detach(), logp_rollout, adv, mask, weights=weights, **band)


def micro_batches(lengths, max_tokens):
    """Gradient accumulation's split of a batch: row indices sorted by length, so rows of like length pad
    together, cut so that each micro-batch holds at most max_tokens padded tokens (its rows times its
    longest row; a row longer than that goes alone). A mix of short chat replies and long tool episodes
    then costs its tokens, not its rows times the longest episode, and memory is bounded by max_tokens.
    max_tokens 0: one micro-batch. lengths: the rows' token counts -> a list of lists of row indices."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if not order:
        return []
    if max_tokens <= 0:
        return [order]
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:  # sorted: row i is the longest yet
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def backward_batch(
    m, trajs, kind, teacher, temperature, world=1, rank=0, micro_tokens=0, shared_prefix=False, **band
):
    """policy_loss of a batch, backward, by micro-batches (micro_batches: gradient accumulation, exact up to
    float rounding: the group advantages, the agentic loss's token count and Eq. 1's response weights all
    come from the whole batch). Under torchrun every rank holds the whole batch and trains rows rank, rank +
    world, ...; its loss is scaled by world because FSDP2 averages the gradients over the ranks, so the
    ranks' gradients add up to the one-process gradient. Every rank runs as many micro-batches as the rank
    with the most (FSDP's collectives run per forward and backward); a rank short of rows runs its first
    (or the batch's first) row with weight 0. shared_prefix: micro-batches (and ranks) take whole groups,
    whose prompts are encoded once (policy_loss). -> the step's statistics over the whole batch (every
    rank the same), "loss" the whole batch's."""
    n_tokens = sum(sum(t.mask) for t in trajs)  # the first token is never sampled (collate checks it)
    adv = None
    if kind != "distill":
        adv = trajectory_advantages(trajs, SCALE_BY_STD[kind])  # (N,), from the whole batch's groups
    weights = None
    if kind != "agentic":
        weights = response_weights(trajs)  # (N,), Eq. 1's 1 / (n_groups G |y_i|) over the whole batch
    lengths = [len(t.ids) for t in trajs]

    def split(r):  # rank r's micro-batches, as indices into trajs
        if shared_prefix:  # whole groups: rank r takes groups r, r + world, ... in order of first row
            members = {}
            for i, t in enumerate(trajs):
                members.setdefault(t.group, []).append(i)
            rows = [i for idx in list(members.values())[r::world] for i in idx]
            ids = [list(trajs[i].ids) for i in rows]
            parts = group_micro_batches(ids, [trajs[i].group for i in rows], micro_tokens)
            return [[rows[j] for j in mb] for mb in parts]
        rows = list(range(r, len(trajs), world))
        return [[rows[j] for j in mb] for mb in micro_batches([lengths[i] for i in rows], micro_tokens)]

    mine = [(rows, 1.0) for rows in split(rank)]  # (row indices, weight)
    if world > 1:  # the batch is the same on every rank, so each can count every rank's micro-batches
        most = max(len(split(r)) for r in range(world))
        filler = [0]  # the batch's first row, when this rank has none
        if mine:
            filler = mine[0][0][:1]
        mine += [(filler, 0.0)] * (most - len(mine))
    total = 0.0  # the whole batch's loss
    sums = Counter()  # tokens, and each statistic times its tokens
    for rows, weight in mine:
        part_teacher = teacher
        if teacher is not None and not isinstance(teacher, torch.nn.Module):
            part_teacher = [teacher[i] for i in rows]
        part_adv = None
        if adv is not None:
            part_adv = adv[rows]
        part_weights = None
        if weights is not None:
            part_weights = weights[rows]
        loss, stats = policy_loss(
            m,
            [trajs[i] for i in rows],
            kind,
            part_teacher,
            temperature,
            advantages=part_adv,
            shared_prefix=shared_prefix,
            n_tokens=n_tokens,
            weights=part_weights,
            **band,
        )
        (loss * (weight * world)).backward()
        total += loss.item() * weight
        n = stats["tokens"] * weight
        sums["tokens"] += n
        for k in stats:
            if k != "tokens":
                sums[k] += stats[k] * n
    keys = sorted(k for k in sums if k != "tokens")
    if world > 1:  # the whole batch's statistics: token-weighted sums over the ranks
        vec = torch.tensor([total, sums["tokens"]] + [sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vec)
        total = float(vec[0])
        sums = Counter({"tokens": float(vec[1])})
        sums.update({k: float(vec[2 + i]) for i, k in enumerate(keys)})
    out = {"tokens": int(sums["tokens"]), "loss": total}
    for k in keys:
        out[k] = sums[k] / max(sums["tokens"], 1.0)
    return out


def rl_step(
    m,
    optimizers,
    trajs,
    kind="agentic",
    teacher=None,
    grad_clip=1.0,
    temperature=1.0,
    world=1,
    rank=0,
    micro_tokens=0,
    shared_prefix=False,
    version=None,
    **band,
):
    """One RL update on a batch of Trajectory records (after filter_buffer): policy_loss and backward by
    micro-batches of at most micro_tokens padded tokens (backward_batch; 0: the batch at once), the global
    gradient norm clipped to grad_clip (0: off), a step of every optimizer. The indexers must be frozen
    (build_optimizers does it); the router bias is not touched. version: the trainer's policy version; the
    on-policy kinds (reasoning, distill) then refuse a batch holding a token of any other (check_on_policy).
    Under torchrun (world > 1, the model sharded by train.py's FSDP2, parallel.shard_model) every rank
    calls it with the same whole batch and trains its rows. -> the step's log statistics."""
    if any(p.requires_grad for n, p in m.named_parameters() if ".indexer." in n):
        raise ValueError(
            "RL trains with the indexers frozen; build the optimizers with rl.build_optimizers"
        )
    if kind in ON_POLICY and version is not None:
        check_on_policy(trajs, version)
    m.train()
    trainable = [p for p in m.parameters() if p.requires_grad]
    stats = backward_batch(
        m, trajs, kind, teacher, temperature, world, rank, micro_tokens, shared_prefix, **band
    )
    if world > 1:
        grad_norm = parallel.clip_grad_norm_(trainable, grad_clip if grad_clip > 0 else math.inf)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip if grad_clip > 0 else math.inf)
    for o in optimizers:
        o.step()
        o.zero_grad(set_to_none=True)
    rewards = [float(trajs[idx[0]].reward) for idx in rollouts(trajs).values()]  # one per rollout
    groups = [[float(trajs[idx[0]].reward) for idx in g] for g in group_rollouts(trajs).values()]
    stats.update(
        grad_norm=float(grad_norm),
        reward=sum(rewards) / len(rewards),
        trajectories=len(trajs),
        rollouts=len(rewards),
        mixed_groups=sum(len(set(g)) > 1 for g in groups) / len(groups),  # the groups GRPO learns from
    )
    return stats


# -----------------------------------------------------------------------------
# The DP-aware router: consistent hashing with virtual nodes and bounded loads
#
# A multi-turn rollout sends each turn's prompt, which extends the last one; on the replica that served
# the last turn that prefix is already in the KV cache. So a rollout id is pinned to one replica (route
# remembers it in `where`), chosen by consistent hashing: each replica owns vnodes points on a ring of
# 64-bit hashes, and an id goes to the first replica clockwise from its own hash. Mirrokni et al.'s
# bound keeps that balanced: a replica already holding ceil((1 + eps) * m / n) of the m live rollouts is
# skipped, and the walk goes on to the next point. The hash is blake2b, not Python's hash(), so every
# process and every restart maps an id to the same place.


def hash64(key):
    return int.from_bytes(hashlib.blake2b(str(key).encode(), digest_size=8).digest(), "big")


def build_ring(replicas, vnodes=64):
    """The hash ring: a sorted list of (point, replica), vnodes points per replica."""
    return sorted((hash64(f"{r}#{i}"), r) for r in replicas for i in range(vnodes))


def capacity(live, n_replicas, eps):
    """(1 + eps) times the mean load when `live` rollouts are placed. A replica below it takes one more, so
    none ever holds more than ceil((1 + eps) * live / n_replicas); eps=inf leaves it unbounded."""
    return (1 + eps) * live / n_replicas


def route(rollout_id, ring, where, loads, eps=0.25):
    """The replica for a rollout's next turn. A rollout already placed keeps its replica (its prefix is
    cached there); a new one walks the ring clockwise from its hash to the first replica under the bound.

    where: {rollout_id: replica}, loads: {replica: live rollouts}; both are updated in place, and
    release() undoes them when the rollout ends. eps=float("inf") is plain consistent hashing.
    """
    if rollout_id in where:
        return where[rollout_id]
    if not loads:
        raise ValueError("no rollout replica is left to route to: start one, or pass its URL")
    cap = capacity(sum(loads.values()) + 1, len(loads), eps)
    start = bisect.bisect(ring, hash64(rollout_id), key=lambda point: point[0])
    # the loads sum to live - 1, less than len(loads) * cap = (1 + eps) * live: some replica is below cap
    for i in range(len(ring)):
        replica = ring[(start + i) % len(ring)][1]
        if loads[replica] < cap:
            break
    where[rollout_id] = replica
    loads[replica] += 1
    return replica


def release(rollout_id, where, loads):
    """A rollout ended: its replica's load drops by one."""
    loads[where.pop(rollout_id)] -= 1


def remove_replica(replica, ring, where, loads, eps=0.25):
    """A replica died or was taken out: its rollouts are routed again over the others, every other rollout
    stays where it is. Returns the new ring and {rollout_id: new replica} for those that moved (none when
    it was the last replica: its rollouts are left unplaced)."""
    ring = [(p, r) for p, r in ring if r != replica]
    orphans = [i for i, r in where.items() if r == replica]
    for i in orphans:
        del where[i]
    del loads[replica]
    if not loads:  # the last one: nowhere to move its rollouts, they are unplaced
        return ring, {}
    return ring, {i: route(i, ring, where, loads, eps) for i in orphans}


# -----------------------------------------------------------------------------
# A look at each piece on made-up numbers


def rounded(stats):
    return {k: round(v, 3) for k, v in stats.items()}


def demo():
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # (G=2, n=4)
    adv = group_advantages(rewards).flatten()  # (N=8,)
    print("group advantages:", [round(a, 3) for a in adv.tolist()])

    logp_rollout = -torch.rand(8, 16, generator=g) * 3  # (N, T)
    logp_new = (logp_rollout + 0.2 * torch.randn(8, 16, generator=g)).requires_grad_()
    mask = torch.rand(8, 16, generator=g) > 0.3
    loss, stats = agentic_loss(logp_new, logp_rollout, adv, mask)
    print(f"agentic loss {loss.item():.4f}", rounded(stats))
    loss, stats = reasoning_loss(logp_new, logp_new.detach(), logp_rollout, adv, mask)
    print(f"reasoning loss {loss.item():.4f}", rounded(stats))
    teacher = logp_rollout + 0.5
    distill = distill_advantages(teacher, logp_new)  # (N, T), into Eq. 1
    loss, stats = reasoning_loss(logp_new, logp_new.detach(), logp_rollout, distill, mask)
    print(f"distillation loss {loss.item():.4f}", rounded(stats))

    # a group of 4 whose winner was folded into 3 records: still one member of 4, advantage +1.73
    folded = [Trajectory(0, [1, 2], [0, 1], [0.0, -1.0], [-1, 0], 1.0, rollout_id="win") for _ in range(3)]
    losers = [
        Trajectory(0, [1, 2], [0, 1], [0.0, -1.0], [-1, 0], 0.0, rollout_id=f"lose{i}") for i in range(3)
    ]
    adv = trajectory_advantages(folded + losers, SCALE_BY_STD["reasoning"])
    print("advantages of a folded winner's 3 records and 3 losers:", [round(a, 2) for a in adv.tolist()])

    trajs = []
    for i in range(12):
        v = i % 5  # every fifth trajectory was sampled 4 versions ago, one more than tau allows
        failed = i in (1, 2, 3, 6)  # crashed environments: group 0 loses three of its four
        trajs.append(Trajectory(i // 4, [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, v, v], 1.0, failed))
    kept, stats = filter_buffer(trajs, newest=4, tau=3, group_size=4)
    print(f"buffer: {len(trajs)} in, {len(kept)} out,", stats)

    replicas = [f"replica{i}" for i in range(4)]
    ring = build_ring(replicas)
    where = {}
    loads = dict.fromkeys(replicas, 0)
    for i in range(1000):
        route(f"rollout-{i}", ring, where, loads)
    print("router loads over 1000 rollouts (eps 0.25):", loads)
    ring, moved = remove_replica("replica0", ring, where, loads)
    print(f"replica0 removed: {len(moved)} rollouts moved, loads now", loads)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description="GLM-5's RL post-training, the math of it: run each piece (group advantages, the "
        "agentic and reasoning losses, distillation, the filters, the router) on made-up numbers.",
        epilog="example: python rl.py",
    )
    ap.parse_args()
    demo()
