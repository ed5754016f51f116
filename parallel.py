"""
Training GLM-5 on many devices, the pieces train.py calls under torchrun (the GLM-5 report's training
infrastructure; the model of its section 2, Muon Split of its optimizer section; PyTorch's FSDP2
`fully_shard` and torch.distributed.checkpoint docs): the memory plan, FSDP2 sharding, expert parallelism,
gradient clipping across shards, and checkpoints that gather the shards into one file. Each is described at
its section below, the whole step at the FSDP2 section.

    python train.py configs/full.py --dry_run=True                      # the plan for one rank, exit 0
    python train.py configs/full.py --dry_run=True --plan_world_size=256 --expert_parallel=True
    torchrun --standalone --nproc_per_node=2 train.py configs/toy.py --device=cpu       # FSDP2, gloo
    torchrun --standalone --nproc_per_node=2 train.py configs/toy.py --device=cpu --expert_parallel=True
Tests: python -m pytest -q tests/test_parallel.py

Honest limits: one-dimensional: FSDP and expert parallelism share one mesh of all ranks; no tensor or
pipeline parallelism, no hybrid (replicate x shard) mesh, no context parallelism for long sequences. The
model is built whole on every rank's host (same seed, same weights) and then sharded; a model larger than
host memory would need a meta-device build with sharded initialisation, which is not here. The all-to-all
is synchronous (split sizes go through the host) and not overlapped with compute. Tested on 2 CPU
processes over gloo; NCCL on GPUs is the same code, untested here. The plan is arithmetic, not a
measurement: activations assume flash-style attention (no T x T probabilities kept) and no recomputation;
allocator fragmentation and communication buffers are not counted. Checkpoints gather everything on rank 0
(full state dict, on the CPU) and every rank reads the whole file on resume: right for a readable script,
not for 744B parameters (that wants sharded torch.distributed.checkpoint files).
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

import experts
import model
import muon


GiB = 2**30

# -----------------------------------------------------------------------------
# The plan: parameters and bytes per rank, from a skeleton on the meta device
#
# Parameters, bytes per rank for weights, gradients, optimizer states and a rough activation estimate, counted
# on the meta device from a skeleton (the dense layers and one MoE layer, the MoE layer multiplied), so the
# 744B model is planned in about a second.


def plan_counts(cfg):
    """{kind: parameters} for the whole model, counted on a meta skeleton: the dense layers, ONE MoE layer
    (counted n_moe times), the MTP block, embeddings and head. Kinds: muon / adamw, each split into
    expert (routed experts) and rest; plus totals, the activated count and the largest block."""
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    skel = dataclasses.replace(cfg, num_hidden_layers=cfg.first_k_dense_replace + min(n_moe, 1))
    with torch.device("meta"):
        m = model.GLM5(skel)
    moe_prefix = f"model.layers.{cfg.first_k_dense_replace}."
    c = dict.fromkeys(("muon expert", "muon rest", "adamw", "mtp", "expert main"), 0)
    blocks = {}  # block name -> parameters (one MoE block stands for all)
    for g in muon.param_groups(m):
        for name, p in zip(g["names"], g["params"]):
            times = n_moe if name.startswith(moe_prefix) else 1
            expert = ".mlp.experts." in name
            key = "adamw" if not g["use_muon"] else "muon expert" if expert else "muon rest"
            c[key] += p.numel() * times
            c["mtp"] += p.numel() * name.startswith("mtp_layers.")
            c["expert main"] += p.numel() * times * (expert and not name.startswith("mtp_layers."))
            if name.startswith(("model.layers.", "mtp_layers.")):
                blk = ".".join(name.split(".")[: 3 if name.startswith("model.") else 2])
                blocks.setdefault(blk, [0, 0])[expert] += p.numel()
    # + the router's correction bias: a buffer, but in the checkpoint
    saved = m.state_dict()
    params = dict(m.named_parameters())
    c["buffers"] = sum(
        t.numel() * (n_moe if n.startswith(moe_prefix) else 1) for n, t in saved.items() if n not in params
    )
    c["mtp"] += sum(
        t.numel() for n, t in saved.items() if n.startswith("mtp_layers.") and "correction_bias" in n
    )
    c["total"] = c["muon expert"] + c["muon rest"] + c["adamw"] + c["buffers"]
    c["without mtp"] = c["total"] - c["mtp"]
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    c["activated"] = c["without mtp"] - c["expert main"] * (E - k) // E
    c["block"], c["block experts"] = max(blocks.values(), key=sum) if blocks else (0, 0)  # (rest, experts)
    c["embeddings"] = m.model.embed_tokens.weight.numel() + m.lm_head.weight.numel()
    c["root"] = sum(
        p.numel() for n, p in m.named_parameters() if not n.startswith(("model.layers.", "mtp_layers."))
    )
    return c


def activation_bytes(cfg, tokens, act_bytes):
    """Rough bytes of the tensors backward keeps for `tokens` tokens: counted from each layer's shapes."""
    D, H, T = cfg.hidden_size, cfg.num_attention_heads, tokens
    attn = (
        3 * D
        + cfg.q_lora_rank
        + cfg.kv_lora_rank
        + cfg.qk_rope_head_dim
        + 2 * H * cfg.qk_head_dim
        + 2 * H * cfg.v_head_dim
        + cfg.index_n_heads * cfg.index_head_dim
        + cfg.index_head_dim
    )
    moe = (
        cfg.n_routed_experts
        + cfg.num_experts_per_tok * (2 * D + 3 * cfg.moe_intermediate_size)
        + 3 * cfg.moe_intermediate_size * cfg.n_shared_experts
        + D
    )
    dense = 3 * cfg.intermediate_size + D
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    mtp = cfg.num_mtp_steps * bool(cfg.num_nextn_predict_layers)
    per_token = cfg.first_k_dense_replace * (attn + dense) + (n_moe + mtp) * (attn + moe + 2 * D)
    logits = (1 + mtp) * 2 * cfg.vocab_size * 4  # fp32 logits and their softmax, main head and each MTP step
    return T * (per_token * act_bytes + logits)


def memory_plan(cfg, world, expert_parallel, batch_size, block_size, act_bytes, counts=None):
    """-> (rows [(what, parameters or "", bytes)], counts). Per rank, fp32 master weights and gradients."""
    c = counts or plan_counts(cfg)
    muon_n, adamw_n = c["muon expert"] + c["muon rest"], c["adamw"]
    per_rank = c["total"] / world  # FSDP shards every tensor; with EP the experts split by rank instead
    muon_rank, adamw_rank = muon_n / world, adamw_n / world
    rows = [
        ("weights (fp32)", per_rank, 4 * per_rank),
        ("gradients (fp32)", per_rank, 4 * per_rank),
        ("Muon momentum (1 x fp32)", muon_rank, 4 * muon_rank),
        ("AdamW moments (2 x fp32)", adamw_rank, 8 * adamw_rank),
    ]
    # FSDP gathers the root (embeddings, head) for the step and one block at a time (+1 prefetched), with
    # its gradient during backward; under EP a block's experts are not gathered (each rank has its own)
    blk = c["block"] + (c["block experts"] / world if expert_parallel else c["block experts"])
    gathered = c["root"] * (world > 1) + 2 * blk * (world > 1)
    rows.append(("unsharded during the step (root + 2 blocks)", gathered, 8 * gathered))
    activations = activation_bytes(cfg, batch_size * block_size, act_bytes)
    rows.append(
        (f"activations ({batch_size} x {block_size} tokens, {act_bytes}-byte), rough", "", activations)
    )
    rows.append(("total per rank", "", sum(r[2] for r in rows)))
    return rows, c


def format_plan(cfg, rows, c, world, expert_parallel, capacity, where):
    def b(n):  # a parameter count in billions or millions
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    ep = ""
    if expert_parallel:
        ep = f", expert parallel: {cfg.n_routed_experts // world} of {cfg.n_routed_experts} experts per rank"
    out = [
        f"plan for {world} rank(s), FSDP2{ep}",
        f"parameters: {b(c['total'])} total ({b(c['without mtp'])} without the MTP layer), "
        f"{b(c['activated'])} activated per token without MTP "
        f"({b(c['activated'] - c['embeddings'])} without embeddings)",
        f"  {'per rank':<48s} {'params':>9s} {'GiB':>10s}",
    ]
    out += [f"  {what:<48s} {b(n) if n else '':>9s} {nbytes / GiB:10.2f}" for what, n, nbytes in rows]
    out.append(f"  {'available: ' + where:<48s} {'':>9s} {capacity / GiB:10.2f}")
    return "\n".join(out)


def ranks_needed(cfg, expert_parallel, batch_size, block_size, act_bytes, capacity, counts, largest=2**16):
    """The smallest power-of-two world size whose per-rank total fits `capacity`, or None."""
    w = 1
    while w <= largest:
        ok_ep = not expert_parallel or cfg.n_routed_experts % w == 0
        plan = memory_plan(cfg, w, expert_parallel, batch_size, block_size, act_bytes, counts)[0]
        if ok_ep and plan[-1][2] <= capacity:
            return w
        w *= 2
    return None


# -----------------------------------------------------------------------------
# Expert parallelism: all-to-all, differentiable
#
# `expert_parallel = True`: each rank owns n_routed_experts / world experts, whole, outside FSDP: the layer's
# stacked expert tensors (experts.Experts) become DTensors sharded on the expert dimension. After routing,
# every (token, expert) pair is sent to the owning rank with torch.distributed.all_to_all_single (the counts
# go first), the owner runs its experts over everything it received (one grouped GEMM, experts.run_experts),
# and the results travel back the same way. The owner's expert gradient sums the contributions of every rank's
# tokens, so it is divided by the world size to equal FSDP's mean. The names stay
# `model.layers.3.mlp.experts.gate_up_proj` (the whole tensor in a checkpoint), so checkpoints do not depend
# on it.


class _AllToAll(torch.autograd.Function):
    """x (sum(in_splits), ...) -> (sum(out_splits), ...): rows x[in_splits[r] block] go to rank r. The
    backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x, out_splits, in_splits, group):
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelMoE(model.MoE):
    """model.MoE whose stacked experts (experts.Experts) are DTensors sharded on the expert dimension: rank r
    holds experts [r * n_local, (r + 1) * n_local), whole. The names stay `mlp.experts.gate_up_proj` and
    `mlp.experts.down_proj`, and torch.distributed.checkpoint gathers the shards into whole tensors, so
    checkpoints do not depend on it. Routing, the shared expert, the load counts and the balance loss are
    model.MoE's; only the routed experts' computation crosses ranks."""

    def __init__(self, moe, group):
        nn.Module.__init__(self)
        self.cfg, self.group = moe.cfg, group
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.n_local = moe.cfg.n_routed_experts // self.world
        self.first = rank * self.n_local
        self.gate, self.shared_experts, self.experts = moe.gate, moe.shared_experts, moe.experts
        # imported here, not at the top: torch.distributed.tensor costs every start of train.py half a second
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        dev = moe.experts.down_proj.device.type
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, dev)
        for name in ("gate_up_proj", "down_proj"):  # keep this rank's slice of each stacked tensor
            full = getattr(self.experts, name)
            mine = full.detach()[self.first : self.first + self.n_local].clone()  # (n_local, ...)
            local = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            setattr(self.experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
        self.register_buffer("tokens_per_expert", moe.tokens_per_expert, persistent=False)

    def forward(self, x, want_balance=False):
        B, T, D = x.shape
        E, k, W, El = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok, self.world, self.n_local
        flat = x.reshape(-1, D)
        ids, w, scores = self.gate(flat)  # (N, k), (N, k), (N, E)
        counts = experts.expert_counts(ids, E)  # pairs this rank sends to each expert
        if self.training and torch.is_grad_enabled():
            self.tokens_per_expert += counts  # update_router_bias sums these over ranks
        order = ids.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert = by owner rank
        # 1. counts first: recv[src, j] = pairs rank src sends to my j-th expert
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        recv = recv.view(W, El)
        send_splits, recv_splits = counts.view(W, El).sum(1).tolist(), recv.sum(1).tolist()
        # 2. tokens to their experts' ranks; they arrive grouped by (source rank, expert)
        sent = flat.index_select(0, order // k)  # (N * k, D)
        got = all_to_all(sent, recv_splits, send_splits, self.group)  # (sum recv, D)
        # 3. regroup by expert and run the local experts over everything they received, as model.MoE
        # does (an expert that received nothing still gets a zero gradient on every rank)
        expert_of = torch.arange(El, device=x.device).repeat(W).repeat_interleave(recv.flatten())
        perm = expert_of.argsort(stable=True)
        gate_up, down = self.experts.gate_up_proj.to_local(), self.experts.down_proj.to_local()
        out = experts.run_experts(got[perm], recv.sum(0), gate_up, down)[perm.argsort()]  # arrival order
        # 4. results back to the tokens' ranks, in the order they were sent
        back = all_to_all(out, send_splits, recv_splits, self.group)  # (N * k, D)
        y = experts.combine_experts(back, order, w, flat.dtype)  # (N, D)
        balance = (
            experts.sequence_balance_loss(scores.view(B, T, E), ids.view(B, T, k), E)
            if want_balance
            else None
        )
        return (y + self.shared_experts(flat)).view(B, T, D), balance


def shard_experts(m, group=None):
    """Replace every MoE (main stack and MTP block) by an ExpertParallelMoE holding this rank's experts.
    -> the local expert parameters (to keep out of FSDP). Their gradients are divided by the world size
    as they arrive, so they equal the data-parallel mean that FSDP gives every other parameter."""
    world = dist.get_world_size(group)
    E = m.config.n_routed_experts
    if E % world:
        raise SystemExit(
            f"expert_parallel needs n_routed_experts ({E}) divisible by the number of ranks ({world}); "
            f"use a world size that divides {E} or --expert_parallel=False"
        )
    local = []
    for blk in list(m.model.layers) + list(m.mtp_layers):
        if isinstance(blk.mlp, model.MoE):
            blk.mlp = ExpertParallelMoE(blk.mlp, group)
            local += list(blk.mlp.experts.parameters())
    for p in local:
        p.register_hook(lambda g: g / world)
    return local


# -----------------------------------------------------------------------------
# FSDP2, clipping, and averaging across ranks
#
# The whole step under torchrun:
#
#     memory plan (meta device) -> init_process_group -> [expert parallel: keep E / world experts per rank]
#         -> fully_shard(each block, the MTP block, then the root; local experts left out)
#         -> train.py's loop: forward (FSDP all-gathers a block; MoE tokens go to their expert's rank with
#            all-to-all and come back the same way) -> backward (FSDP reduce-scatters the mean gradient)
#         -> clip_grad_norm_ across shards -> Muon + AdamW on the shards -> router bias from summed loads
#
# FSDP2 (`torch.distributed.fsdp.fully_shard`): every parameter is a DTensor sharded on dim 0 over the ranks;
# a block's weights exist whole only while it runs. Muon gathers each matrix for Newton-Schulz (muon.py). Each
# rank trains on its own slice of the global batch and FSDP averages the gradients.


def shard_model(m, mesh, ignored=()):
    """fully_shard each decoder block and the MTP block, then the root (embeddings, final norm, lm_head).
    `ignored`: parameters FSDP must leave alone (the local experts under expert parallelism)."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(ignored)
    for blk in list(m.model.layers) + list(m.mtp_layers):
        fully_shard(blk, mesh=mesh, ignored_params=ignored & set(blk.parameters()) or None)
    fully_shard(m, mesh=mesh, ignored_params=ignored or None)
    return m


@torch.no_grad()
def clip_grad_norm_(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ for a mix of FSDP DTensor shards and whole local experts: every
    gradient element lives on exactly one rank, so the squared norm is a sum of local sums over ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if muon.is_dtensor(g) else g for g in grads]
    sq = torch.stack([l.float().pow(2).sum() for l in local]).sum() if local else torch.zeros(())
    dist.all_reduce(sq)
    norm = sq.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for l in local:
        l.mul_(scale.to(l.device, l.dtype))
    return norm


def mean_over_ranks(values, device):
    """{name: float} -> the same names averaged over ranks (every rank gets the result)."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(values, (t / dist.get_world_size()).tolist()))


# -----------------------------------------------------------------------------
# Checkpoints: whole tensors by parameter name, so any world size (with or without EP) can load them

FULL = dict(full_state_dict=True, cpu_offload=True)


def full_state(m, optimizers):
    """-> (model state dict, [optimizer state dicts]), whole tensors on the CPU keyed by parameter name;
    complete on rank 0 (torch.distributed.checkpoint gathers the FSDP shards and the expert-parallel
    experts' DTensor shards alike). Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(**FULL)
    msd = get_model_state_dict(m, options=opts)
    osds = [get_optimizer_state_dict(m, o, options=opts) for o in optimizers]
    return msd, osds


def stack_expert_states(osd, optimizer):
    """An optimizer state dict from before the experts were stacked (a ckpt.pt of an older train.py: one
    entry per expert matrix, `...mlp.experts.{e}.gate_proj.weight`) -> one for experts.Experts' stacked
    parameters: each state tensor stacked as the weights are (gate rows on up rows, expert by expert), and
    the groups of `optimizer` as they are now (the old groups list parameters that no longer exist; the
    schedule sets the learning rates again at the next step). Any other state dict comes back as it is."""
    state = osd["state"]
    if not any(".mlp.experts." in n and n.endswith("_proj.weight") for n in state):
        return osd
    state = dict(state)
    for g in optimizer.param_groups:
        for name in g["names"]:
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")) or name in state:
                continue
            prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            rows, e = [], 0
            while f"{prefix}.{e}.{parts[0]}.weight" in state:
                rows.append([state.pop(f"{prefix}.{e}.{p}.weight") for p in parts])
                e += 1
            if rows:  # {key: (E, rows, cols)}, e.g. Muon's momentum_buffer
                state[name] = {
                    k: torch.stack([torch.cat([r[k] for r in row]) for row in rows]) for k in rows[0][0]
                }
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params"} | {"params": list(g["names"])})
    return {"state": state, "param_groups": groups}


def load_optimizer_states(m, optimizers, osds):
    """The optimizer half of full_state's inverse, on every rank after sharding: each rank takes the
    slices of its shards and the states of its own experts (the model's weights are loaded whole, before
    sharding). A checkpoint from before the experts were stacked is converted first (stack_expert_states),
    as experts.Experts converts its weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    here = {n for n, _ in m.named_parameters()}
    for o, osd in zip(optimizers, osds):
        osd = stack_expert_states(osd, o)
        groups = [dict(g, params=[n for n in g["params"] if n in here]) for g in osd["param_groups"]]
        state = {n: s for n, s in osd["state"].items() if n in here}
        # strict=False: parameters that never had a gradient (the indexer in pretraining) have no state
        set_optimizer_state_dict(
            m, o, {"state": state, "param_groups": groups}, options=StateDictOptions(**FULL, strict=False)
        )
        # set_optimizer_state_dict first gives every parameter a state, by a step at lr 0 on zero gradients
        # (torch's _init_optim_state): AdamW's step count would then start at 1 for a parameter that had no
        # state (the MTP block while its loss weight is 0), and its first real update would differ from the
        # uninterrupted run's. Such a parameter gets its state at its first gradient, as before the save.
        for g in o.param_groups:
            for name, p in zip(g["names"], g["params"]):
                if name not in state:
                    o.state.pop(p, None)
