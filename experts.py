"""
The routed experts of GLM-5's MoE layers and the router that picks them (GLM-5 report, arXiv 2602.15763,
section 2; the MoE is DeepSeek-V3's, its report section 2.1.2): model.MoE composes them with the shared
expert. Here:

- Router: the fp32 sigmoid router; e_score_correction_bias (aux-loss-free balancing) moves the choice of
  experts, not their weights; the top-k weights are normalised and scaled by routed_scaling_factor.
- Experts: one layer's routed experts stacked as two tensors (the layout grouped GEMMs want), with the
  released per-expert names kept by per_expert_state (weights.py writes and reads safetensors through it)
  and an older per-expert state dict stacked on load.
- run_experts, the one dispatch over four paths that must agree: experts_loop (each expert once, the
  reference), experts_grouped (one torch grouped GEMM per projection, no host sync), experts_triton
  (kernels_moe.py's grouped SwiGLU, on a GPU without gradients) and experts_pairs (a compiled CPU decode
  step: one product per (token, expert) pair, fused by inductor); EXPERTS_IMPL switches loop / grouped.
- combine_experts (the routing weights applied, back in token order) and sequence_balance_loss.

Run it: python model.py configs/toy.py (the model that uses them)
Tests: python -m pytest -q tests/test_model.py tests/test_muon.py tests/test_kernels.py
Honest limits: torch's grouped GEMM takes fp32/bf16/fp16 on a CPU and bf16 on sm80+ GPUs with 16-byte row
strides; anything else (fp64 tests, odd sizes) runs the loop, which syncs the host once per layer; on a
CPU the grouped GEMM is itself a loop of matmuls, so it does not make training faster there.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import dsa
import kernels
import kernels_moe

# -----------------------------------------------------------------------------
# The router


class Router(nn.Module):
    """Checkpoint name `mlp.gate`: weight (E, D) and the fp32 e_score_correction_bias (E,)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # moved by update_router_bias, never by gradients; used for choosing experts, not for weighting
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
        )

    def _apply(self, fn, recurse=True):
        # the correction bias stays fp32 whatever the model is cast to: its 1e-3 steps vanish in bf16
        before = self.e_score_correction_bias
        super()._apply(fn, recurse)
        after = self.e_score_correction_bias
        if after.dtype not in (torch.float32, torch.float64):  # put the exact fp32 values back, moved only
            self.e_score_correction_bias = before.to(device=after.device, dtype=torch.float32)
        return self

    def forward(self, x):
        """x (N, D) -> expert ids (N, k), weights (N, k) and scores (N, E), both in fp32 or wider."""
        c = self.cfg
        scores = dsa.linear_fp32(
            x, self.weight
        ).sigmoid()  # fp32 router, under autocast too (fp64 in fp64 tests)
        dt = scores.dtype
        ids = torch.topk(scores + self.e_score_correction_bias.to(dt), c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(-1, ids)  # the bias picks the experts but does not weight them
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor, scores


# -----------------------------------------------------------------------------
# The routed experts, stacked
#
# The routed experts of a layer are stacked, as one tensor each (the layout grouped GEMMs want):
#   gate_up_proj (E, 2F, D): expert e's gate_proj.weight (F, D) on top of its up_proj.weight (F, D)
#   down_proj    (E, D, F):  expert e's down_proj.weight
# The released checkpoint keeps one SwiGLU per expert (mlp.experts.{e}.gate_proj.weight, ...):
# per_expert_state names the per-expert views of a stacked tensor (weights.py reads and writes
# safetensors through them) and Experts._load_from_state_dict stacks a per-expert state dict (an older
# ckpt.pt) on load.

# Compiled CPU graphs compute the experts per (token, expert) pair (experts_pairs) up to this many rows
# per expert on average. Measured on experts of 1024 -> 512 -> 1024, one thread: 4 rows each (128 over 32
# experts) took 12 ms by pairs against the grouped op's 19; 16 rows each (256 over 16) took 18 against 15,
# as pairs read an expert's weights once per row where the grouped GEMM reads them once
PAIRS_MAX_ROWS_PER_EXPERT = 4
EXPERTS_IMPL = "grouped"  # "grouped": one grouped GEMM per projection; "loop": one expert at a time


def per_expert_state(state_dict):
    """A state dict -> the same tensors by released name: each stacked expert tensor becomes per-expert
    views (`...experts.gate_up_proj` (E, 2F, D) and `...experts.down_proj` (E, D, F) -> for e = 0, 1, ...:
    `...experts.{e}.gate_proj.weight` (F, D), `.up_proj.weight` (F, D), `.down_proj.weight` (D, F), the
    order one module per expert had); every other entry as it is. The views share the stacked storage:
    copying into them writes the model."""
    out = {}
    for name, t in state_dict.items():
        if name.endswith("experts.down_proj"):
            continue  # placed beside gate_up_proj, expert by expert
        if not name.endswith("experts.gate_up_proj"):
            out[name] = t
            continue
        prefix = name[: -len("gate_up_proj")]
        gate, up = t.chunk(2, dim=1)  # (E, F, D) each
        down = state_dict[prefix + "down_proj"]  # (E, D, F)
        for e in range(t.shape[0]):
            out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
            out[f"{prefix}{e}.up_proj.weight"] = up[e]
            out[f"{prefix}{e}.down_proj.weight"] = down[e]
    return out


class Experts(nn.Module):
    """The n routed experts of one MoE layer, stacked (see above). forward(x, counts): x (rows, D) sorted
    by expert, counts (n,) rows per expert -> (rows, D), row r through its own expert's SwiGLU."""

    def __init__(self, n, dim, hidden):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, hidden))

    def init_weights(self, std):
        # expert by expert, gate then up then down: the same draws as one nn.Linear per expert, in order
        gate, up = self.gate_up_proj.detach().chunk(2, dim=1)
        for e in range(self.down_proj.shape[0]):
            for w in (gate[e], up[e], self.down_proj.detach()[e]):
                nn.init.normal_(w, std=std)

    def forward(self, x, counts, impl=None, decode=False):
        return run_experts(x, counts, self.gate_up_proj, self.down_proj, impl, decode)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a state dict from before the experts were stacked (a ckpt.pt of an older train.py) holds
        # {prefix}{e}.gate_proj.weight, ...: stack them into this module's two tensors, then load as usual
        n = self.down_proj.shape[0]
        old = [f"{prefix}{e}.{p}.weight" for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")]
        if f"{prefix}gate_up_proj" not in state_dict and all(k in state_dict for k in old):
            gate_up, down = [], []
            for e in range(n):
                g = state_dict.pop(f"{prefix}{e}.gate_proj.weight")
                u = state_dict.pop(f"{prefix}{e}.up_proj.weight")
                gate_up.append(torch.cat([g, u], dim=0))  # (2F, D)
                down.append(state_dict.pop(f"{prefix}{e}.down_proj.weight"))  # (D, F)
            state_dict[f"{prefix}gate_up_proj"] = torch.stack(gate_up)  # (n, 2F, D)
            state_dict[f"{prefix}down_proj"] = torch.stack(down)  # (n, D, F)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def experts_loop(x, counts, gate_up, down):
    """The reference: each expert once over its rows, one after the other. The split sizes cost a host
    sync (counts.tolist()). An expert with no rows still runs, on an empty batch, so its gradient is zeros
    and not None: FSDP2 ranks must agree on which gradients exist."""
    outs = []
    for e, x_e in enumerate(x.split(counts.tolist())):
        g, u = F.linear(x_e, gate_up[e]).chunk(2, dim=-1)  # (n_e, F) each
        outs.append(F.linear(F.silu(g) * u, down[e]))  # (n_e, D)
    return torch.cat(outs)


def grouped_mm_ok(x, gate_up, down):
    """torch's grouped GEMM (F.grouped_mm) takes fp32/bf16/fp16 on a CPU and bf16 on a GPU (sm80 or newer),
    with every row stride a multiple of 16 bytes (its backward too); otherwise the loop runs (fp64 tests,
    odd sizes)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    dtypes = (torch.bfloat16,) if x.device.type == "cuda" else (torch.float32, torch.bfloat16, torch.float16)
    size = x.element_size()
    return x.dtype in dtypes and all((n * size) % 16 == 0 for n in (x.shape[-1], down.shape[-1]))


def experts_grouped(x, counts, gate_up, down):
    """Every expert in one grouped GEMM per projection: expert e's rows end at offs[e], a cumulative sum
    computed on the device, so nothing waits for the host. The gradient reaches every expert (zeros where
    an expert had no rows), as in the loop."""
    offs = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's rows
    h = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)  # (rows, 2F)
    g, u = h.chunk(2, dim=-1)
    return F.grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)  # (rows, D)


# torch.compile (engine.py's compiled forwards) traces with fake tensors, and on a CPU the fake of torch's
# grouped GEMM asks for bf16 where the real one takes fp32 too: compiled, experts_grouped runs as one opaque
# op whose output shape is declared here, so the same kernel runs and the graph does not break.
@torch.library.custom_op("nanoglm::experts_grouped", mutates_args=())
def experts_grouped_op(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return experts_grouped(x, counts, gate_up, down)


@experts_grouped_op.register_fake
def _(x, counts, gate_up, down):
    return x.new_empty(x.shape[0], down.shape[1])  # (rows, D)


def experts_pairs(x, counts, gate_up, down):
    """Each row through its own expert as a product per (token, expert) pair, written as a multiply and a
    sum over the weights gathered by expert so that inductor fuses the gather into its reduction loop:
    nothing of the gathered weights' size (rows x 2F x D) is made. Compiled graphs only (run_experts):
    eager, gate_up[eid] would be that tensor. On a CPU decode step each expert has a few rows and torch's
    grouped GEMM is a loop of tiny matmuls, one call per expert; this is one loop nest for all of them
    (toy shapes, 64 rows over 16 experts, compiled, one thread: 61 against the grouped op's 166 us)."""
    rows = torch.arange(x.shape[0], device=x.device)
    eid = torch.searchsorted(counts.cumsum(0), rows, right=True)  # (rows,) each row's expert
    h = (x[:, None, :] * gate_up[eid]).sum(-1)  # (rows, 2F)
    g, u = h.chunk(2, dim=-1)
    return ((F.silu(g) * u)[:, None, :] * down[eid]).sum(-1)  # (rows, D)


def experts_triton(x, counts, gate_up, down):
    """kernels_moe's grouped SwiGLU and down projection (one launch each, empty experts free); forward
    only, so a GPU uses it when no gradient is needed (serving, sampling)."""
    offsets = F.pad(counts.cumsum(0), (1, 0))  # (E + 1,)
    w_gate, w_up = gate_up.chunk(2, dim=1)  # (E, F, D) views, no copy
    h = kernels_moe.grouped_swiglu(x, offsets, w_gate, w_up)  # (rows, F)
    ones = torch.ones(x.shape[0], device=x.device)  # the routing weights are applied by combine_experts
    return kernels_moe.grouped_down(h, offsets, down, ones)


def run_experts(x, counts, gate_up, down, impl=None, decode=False):
    """The one dispatch: x (rows, D) sorted by expert, counts (E,) -> (rows, D). impl None reads
    EXPERTS_IMPL; "grouped" runs Triton on a GPU without gradients, torch's grouped GEMM where it can
    (under autocast in the autocast dtype, as nn.Linear would) and the loop otherwise. decode (one new
    token per row): a compiled CPU graph with at most PAIRS_MAX_ROWS_PER_EXPERT rows per expert takes
    experts_pairs instead of the grouped GEMM."""
    impl = impl or EXPERTS_IMPL
    if impl not in ("grouped", "loop"):
        raise ValueError(f"experts impl must be 'grouped' or 'loop', got {impl!r}")
    if impl == "loop":
        return experts_loop(x, counts, gate_up, down)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad)
    if kernels.use_triton(x) and not needs_grad:
        return experts_triton(x, counts, gate_up, down)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, gate_up, down = x.to(dt), gate_up.to(dt), down.to(dt)
    if decode and torch.compiler.is_compiling() and not needs_grad and dev == "cpu":
        # rows is the batch times k: a guard on the graph's batch size, so larger buckets get their own graph
        if x.shape[0] <= PAIRS_MAX_ROWS_PER_EXPERT * gate_up.shape[0]:
            return experts_pairs(x, counts, gate_up, down)
    if grouped_mm_ok(x, gate_up, down) and torch.compiler.is_compiling() and not needs_grad:
        return experts_grouped_op(x, counts, gate_up, down)
    if grouped_mm_ok(x, gate_up, down):
        return experts_grouped(x, counts, gate_up, down)
    return experts_loop(x, counts, gate_up, down)


def expert_counts(ids, E):
    """ids (N, k) -> rows per expert (E,), long. A scatter-add, not torch.bincount: on a GPU bincount
    reads the largest id back to the host first."""
    flat = ids.flatten()
    return torch.zeros(E, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


# -----------------------------------------------------------------------------
# Their outputs back to the tokens, and the balance loss


def combine_experts(out_sorted, order, w, dtype):
    """out_sorted (N * k, D) expert outputs of the (token, slot) pairs in expert order `order`, w (N, k) fp32
    -> y (N, D) = sum over slots of w * out, in fp32, returned in `dtype` (the residual stream's). One
    index_copy back to (token, slot) order and a sum over the k slots: no scatter-add (slow on CPUs)."""
    N, k = w.shape
    slots = torch.zeros_like(out_sorted).index_copy(0, order, out_sorted)  # (N * k, D), (token, slot) order
    return (slots.view(N, k, -1) * w[..., None]).sum(1).to(dtype)


def sequence_balance_loss(scores, ids, E):
    """DeepSeek-V3's sequence-wise balance loss sum_i f_i * P_i, averaged over sequences.
    f_i = E / (k T) * (tokens of the sequence sent to expert i); P_i = mean over the sequence of the
    scores normalised over experts. Equals 1 when perfectly balanced. scores (B, T, E), ids (B, T, k)."""
    B, T, k = ids.shape
    f = torch.zeros(B, E, device=ids.device).scatter_add_(
        1, ids.view(B, -1), torch.ones(B, T * k, device=ids.device)
    )
    f = f * E / (k * T)
    P = (scores / scores.sum(-1, keepdim=True)).mean(dim=1)
    return (f * P).sum(-1).mean()
