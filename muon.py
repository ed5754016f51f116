"""
Muon and Muon Split, the optimizer GLM-5 trains with (the GLM-5 report's optimizer section, "Muon
Split"; Muon itself from Keller Jordan's "Muon: An optimizer for hidden layers in neural networks", 2024,
whose quintic Newton-Schulz coefficients these are; the RMS matching and decoupled weight decay from
Moonshot's "Muon is Scalable for LLM Training", arXiv 2502.16982):

    buf    <- 0.95 * buf + g                          momentum
    u      <- g + 0.95 * buf                          Nesterov
    O      <- NewtonSchulz5(u)                        orthogonalise: every singular value pushed towards 1
    O      <- O * 0.2 * sqrt(max(rows, cols))         update RMS 0.2, about AdamW's: AdamW's lr carries over
    W      <- W * (1 - lr * wd) - lr * O              decoupled weight decay 0.1

Muon Split orthogonalises the MLA up-projections per attention head (see its section below); AdamW takes
what Muon should not, and param_groups() is the one place that decides.

Tests (CPU): python -m pytest -q tests/test_muon.py
Use it (a training loop):
    muon, adamw = build_optimizers(model, lr_muon=3e-4, lr_adamw=3e-4)
    ... loss.backward(); muon.step(); adamw.step(); model.update_router_bias(m); zero both grads

Honest limits: Newton-Schulz runs in fp32 by default (`ns_dtype`), right on a CPU; on a GPU people run it
in bf16 (about twice as fast, the iteration tolerates it): pass ns_dtype=torch.bfloat16 there. Under FSDP2
every rank all-gathers the full momentum-updated matrix, runs the full Newton-Schulz itself and keeps its
own shard: correct, but the work is repeated on every rank and the full matrix briefly materialised (no
sharded or rank-assigned Newton-Schulz; stacked experts, sharded whole, need no gather). Tested on 2 CPU
ranks over gloo (bare DTensors and fully_shard), not on GPUs over NCCL. GLM-5's learning rates and
schedule are not published: the defaults are placeholders. No QK-clip / MuonClip: the report says Muon
Split keeps the logits stable without it.
"""

import functools
import math
import sys

import torch
import torch.nn as nn

from experts import Experts, Router
from mla import MLA, RMSNorm

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic's a, b, c
UPDATE_RMS = 0.2


def is_dtensor(t):
    """t is a DTensor (an FSDP2 shard). Asked without importing torch.distributed.tensor, which costs half a
    second at every start of train.py: a DTensor exists only once something imported that module."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# -----------------------------------------------------------------------------
# Newton-Schulz: an approximate U V^T of G = U S V^T without an SVD, matmuls only


def zeropower_via_newtonschulz(G, steps=5, dtype=torch.float32, eps=1e-7):
    """G (..., m, n) -> about U V^T per matrix, returned in G's dtype.

    Each step maps X to a X + b (X X^T) X + c (X X^T)^2 X, i.e. every singular value s to
    a s + b s^3 + c s^5. After Frobenius normalisation all s are in (0, 1]; the coefficients are tuned so
    that five steps pull them all into a band around 1 (roughly 0.7 to 1.2, not exactly 1: speed over
    precision); directions below about 1e-3 of the Frobenius norm are only partly lifted.
    dtype: the arithmetic's dtype, fp32 here; bf16 is the usual choice on a GPU.
    """
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    wide = X.size(-2) <= X.size(-1)
    if not wide:  # iterate on the smaller Gram matrix: X X^T is (min, min)
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)  # per matrix of the batch
    for _ in range(steps):
        gram = X @ X.mT  # (..., min, min)
        X = a * X + (b * gram + c * gram @ gram) @ X
    if not wide:
        X = X.mT
    return X.to(G.dtype)


# -----------------------------------------------------------------------------
# Muon Split: orthogonalise a batch of per-head blocks instead of the whole matrix
#
# The MLA up-projections W_UQ (q_b_proj), W_UK and W_UV (both inside kv_b_proj) are not orthogonalised as
# whole matrices but per attention head, each head's block on its own (and scaled by its own block shape), so
# heads can move at different scales. The report credits it with MLA matching GQA-8 and with attention logits
# staying stable without clipping.
#
# A split is a tuple of row counts that repeats once per head. nn.Linear stores (out, in), so a head is a
# run of rows:   q_b_proj (H * (nope + rope), q_lora_rank):  split (nope + rope,)  -> W_UQ^h
#               kv_b_proj (H * (nope + v), kv_lora_rank):   split (nope, v)       -> W_UK^h, W_UV^h
# None means the whole matrix (one "head" of all its rows). A tuple rather than a function, so that it
# survives optimizer.state_dict() and torch.save.


def orthogonalized_update(u, split=None, steps=5, dtype=torch.float32):
    """u (rows, cols) -> Newton-Schulz of each block, each scaled to RMS 0.2 by its own block shape.
    u (n, rows, cols), a stack of matrices (experts.Experts): the split applies to each matrix of the stack;
    the blocks of all n matrices go through one batched call."""
    rows, cols = u.shape[-2:]
    sizes = tuple(split) if split is not None else (rows,)
    per_head = sum(sizes)
    if rows % per_head:
        raise ValueError(
            f"Muon split {sizes} does not tile a matrix of {rows} rows (per-head rows {per_head}); "
            "give the per-head row counts of this projection"
        )
    blocks = u.reshape(-1, per_head, cols).split(sizes, dim=1)  # each (n * H, s, cols)
    # one batched Newton-Schulz call per kind of block (all heads at once), not one per head
    out = [
        zeropower_via_newtonschulz(blk, steps, dtype) * (UPDATE_RMS * math.sqrt(max(s, cols)))
        for blk, s in zip(blocks, sizes)
    ]
    return torch.cat(out, dim=1).view(u.shape)


# -----------------------------------------------------------------------------
# The optimizer
#
# One Newton-Schulz call per parameter (a batch of blocks under Muon Split). A layer's routed experts are
# stacked (experts.Experts), so its 256 experts' gate, up and down matrices are three batched calls, each
# expert's matrix orthogonalised on its own, exactly as if each were a separate parameter.


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weight matrices and stacks of them (3-D, one matrix per expert). Group keys: lr,
    momentum (0.95), nesterov, weight_decay (0.1, decoupled), ns_steps (5), ns_dtype ("float32", stored by
    name; a torch dtype is accepted), split (None or per-head row counts, see above)."""

    def __init__(
        self,
        params,
        lr=3e-4,
        momentum=0.95,
        nesterov=True,
        weight_decay=0.1,
        ns_steps=5,
        ns_dtype=torch.float32,
        split=None,
    ):
        # the dtype is kept by name: optimizer state dicts then hold plain data (torch.distributed.checkpoint)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_dtype=str(ns_dtype).removeprefix("torch."),
            split=split,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon got a parameter of shape {tuple(p.shape)}; Muon is for 2-D matrices (or a "
                        "3-D stack of them), put vectors (norms, biases) in AdamW (see param_groups)"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            ns_dtype = getattr(torch, str(group["ns_dtype"]).removeprefix("torch."))  # a name or a dtype
            orth = functools.partial(
                orthogonalized_update, split=group["split"], steps=group["ns_steps"], dtype=ns_dtype
            )
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)  # a DTensor stays sharded like g
                buf = state["momentum_buffer"]
                buf.mul_(beta).add_(g)
                u = g.add(buf, alpha=beta) if group["nesterov"] else buf
                if is_dtensor(u) and whole_matrices(u):
                    w = p.to_local()  # this rank's experts, each matrix whole: no gather needed
                    w.mul_(1 - lr * wd)
                    w.add_(orth(u.to_local()).to(w.dtype), alpha=-lr)
                elif is_dtensor(u):
                    _apply_sharded(p, u, orth, lr, wd)
                else:
                    p.mul_(1 - lr * wd)
                    p.add_(orth(u).to(p.dtype), alpha=-lr)
        return loss


# -----------------------------------------------------------------------------
# FSDP2 / DTensor: gather, orthogonalise the full matrix, keep the local shard
#
# Every rank all-gathers the full momentum-updated matrix, runs the full Newton-Schulz itself, and keeps only
# its own shard of the result. Correct, but the work is repeated on every rank and the full matrix is briefly
# materialised; there is no sharded or rank-assigned Newton-Schulz here. Stacked experts are the exception: a
# shard along the expert dimension holds whole experts, so each rank orthogonalises its own experts, with no
# gather.


def whole_matrices(u):
    """A DTensor stack of matrices (n, rows, cols) sharded only along n: every rank holds whole ones."""
    return u.ndim == 3 and all(pl.is_shard(0) or pl.is_replicate() for pl in u.placements)


def _apply_sharded(p, u, orth, lr, wd):
    """p, u: DTensors. Newton-Schulz needs the whole matrix, so every rank gathers it (all-gather),
    computes the same full update, and applies the slice its own shard holds. src_data_rank=None: each
    rank cuts its shard from its own copy, no second collective."""
    from torch.distributed.tensor import distribute_tensor  # imported by whoever made the DTensors

    full = orth(u.full_tensor())  # (rows, cols) on every rank
    local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    w = p.to_local()  # aliases p's storage under no_grad
    w.mul_(1 - lr * wd)
    w.add_(local.to(w.dtype), alpha=-lr)


# -----------------------------------------------------------------------------
# Parameter groups: the one place that decides who trains with what
#
# AdamW takes what Muon should not: embeddings, lm_head, the MoE router, norms and biases. param_groups()
# asserts that every trainable parameter lands in exactly one group.


def param_groups(model, lr_muon=3e-4, lr_adamw=3e-4, weight_decay=0.1, muon_split=True):
    """Every trainable parameter of a model.GLM5 in exactly one group (frozen ones are skipped).

    Muon: the 2-D weights of Linear layers inside the decoder blocks and the MTP block (attention,
    indexer wq_b / wk / weights_proj, dense MLPs, experts, shared experts, eh_proj); with muon_split,
    q_b_proj and kv_b_proj get their per-head split. The stacked routed experts (experts.Experts) are Muon
    too, each expert's gate, up and down matrix orthogonalised on its own (split (F, F) cuts gate_up_proj's
    rows into gate and up), with or without muon_split: the same update as one parameter per expert.
    AdamW (weight decay): model.embed_tokens, lm_head (a lookup table and a classifier, not linear maps
    between hidden states: the Muon literature keeps them on AdamW), and the MoE router mlp.gate.weight.
    The router is a matrix, but GLM-5 does not say how it was trained *(not published)*; we keep it on
    AdamW as DeepSeek-style MoE training does: each row is one expert's scoring vector, a token's gradient
    touches mostly the experts it was routed to, and orthogonalising would lift the rarely chosen experts'
    directions to the same size as the busy ones', fighting the aux-loss-free bias that balances the load.
    It is 1.57M of a 40B-activated model, so Muon's efficiency there is worth nothing.
    AdamW (no weight decay): RMSNorm weights, the indexer's LayerNorm weight and bias, any bias.
    Each group carries "names" (for logs and errors) and "use_muon"."""
    mla_splits = {}  # id(weight) -> per-head row counts
    for m in model.modules():
        if isinstance(m, MLA):
            c = m.cfg
            mla_splits[id(m.q_b_proj.weight)] = (c.qk_head_dim,)  # W_UQ^h
            mla_splits[id(m.kv_b_proj.weight)] = (c.qk_nope_head_dim, c.v_head_dim)  # W_UK^h, W_UV^h
    embedding_and_head = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}

    groups = {}  # key -> group dict, in first-seen order

    def add(key, name, p, **opts):
        g = groups.setdefault(key, dict(params=[], names=[], **opts))
        g["params"].append(p)
        g["names"].append(name)

    for mod_name, mod in model.named_modules():
        for short, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            name = f"{mod_name}.{short}" if mod_name else short
            in_blocks = name.startswith(("model.layers.", "mtp_layers."))
            if id(p) in embedding_and_head or isinstance(mod, Router):
                add("adamw", name, p, use_muon=False, lr=lr_adamw, weight_decay=weight_decay)
            elif isinstance(mod, (RMSNorm, nn.LayerNorm)) or p.ndim < 2:
                add("adamw_no_decay", name, p, use_muon=False, lr=lr_adamw, weight_decay=0.0)
            elif in_blocks and (isinstance(mod, Experts) or (isinstance(mod, nn.Linear) and p.ndim == 2)):
                if isinstance(mod, Experts):  # per expert: gate, up | down
                    hidden = mod.down_proj.shape[-1]
                    split = (hidden, hidden) if short == "gate_up_proj" else None
                else:
                    split = mla_splits.get(id(p)) if muon_split else None
                add(
                    ("muon", split),
                    name,
                    p,
                    use_muon=True,
                    lr=lr_muon,
                    weight_decay=weight_decay,
                    split=split,
                )
            else:
                raise ValueError(
                    f"param_groups has no rule for parameter {name} {tuple(p.shape)} "
                    f"({type(mod).__name__}); add one to muon.param_groups"
                )
    out = sorted(groups.values(), key=lambda g: not g["use_muon"])  # Muon groups first
    check_groups(model, out)
    return out


def check_groups(model, groups):
    """Raise AssertionError unless every trainable parameter is in exactly one group and nothing else is."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen = {}
    for g in groups:
        for p in g["params"]:
            if id(p) not in names:
                raise AssertionError(
                    f"an optimizer group holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                    "parameter of the model"
                )
            if id(p) in seen:
                raise AssertionError(f"parameter {names[id(p)]} is in two optimizer groups")
            seen[id(p)] = g
    missing = [n for i, n in names.items() if i not in seen]
    if missing:
        raise AssertionError(
            f"parameter {missing[0]} (and {len(missing) - 1} more) is trainable but in no optimizer group"
        )


def build_optimizers(
    model, lr_muon=3e-4, lr_adamw=3e-4, weight_decay=0.1, muon_split=True, ns_dtype=torch.float32, fused=None
):
    """-> (Muon, AdamW) over param_groups(model, ...); step both every iteration, save both."""
    groups = param_groups(model, lr_muon, lr_adamw, weight_decay, muon_split)
    muon = Muon(
        [g for g in groups if g["use_muon"]], lr=lr_muon, weight_decay=weight_decay, ns_dtype=ns_dtype
    )
    adamw = torch.optim.AdamW(
        [g for g in groups if not g["use_muon"]],
        lr=lr_adamw,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=weight_decay,
        fused=fused,
    )
    return muon, adamw
