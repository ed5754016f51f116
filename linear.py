"""
The inference linear layer on a CPU: x @ W.T through oneDNN's GEMM instead of torch's default one.

The model's projections are plain nn.Linear; the serving engine gives them this file's forward (use_onednn:
mla.py's attention, model.py's dense and shared-expert MLPs, the MTP block's, the head, the indexer's wq_b
and wk; not the router, the routed experts or the indexer's fp32 head weights). On a GPU, in training,
under autocast and under torch.compile it is exactly F.linear. On a CPU, with no gradient to take and fp32
data, it calls oneDNN (torch.ops.mkldnn._linear_pointwise, the op inductor's CPU backend uses for linears
once it has frozen a model's weights), because torch's own fp32 matmul there calls MKL's sgemm, which was
much slower on the machine this was measured on (an AMD EPYC, 2 cores, AVX-512; the figures:
docs/design-notes.md). A decode step reads every weight once, so its time follows these rates. Nothing in
the weights changes: they stay plain tensors, read by oneDNN as they are (no prepacking, so loading, saving
and weight updates from RL see the same parameters). Small GEMMs and other dtypes take F.linear (see
ONEDNN_MIN_MACS).

Reference and switch: F.linear is the reference; NANOGLM_KERNELS=torch (kernels.py's switch) takes it
everywhere. Run: python -m pytest -q tests/test_linear.py (the two agree, and when each is taken).

Honest limits: the two differ in the last bits of fp32 (a different order of summation, ~1e-6 relative),
as MKL itself does between batch sizes, so CPU greedy outputs can differ from before this file existed
where two tokens' logits were that close. On an Intel CPU MKL may well be as fast; the choice was not
measured there. Inside torch.compile the graphs keep F.linear (inductor lowers the oneDNN op only for
frozen weights), so the compiled engine does not get this speed-up.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

# oneDNN's call costs about 10 us more than MKL's (it looks up its compiled primitive), which the toy model's
# 128-wide layers would pay on every call, so the fast path is taken from 2^20 multiply-adds up (measured on
# the same machine: below that the two are within a few us, or MKL wins). Rows and weights of other dtypes
# (fp64 in the exact tests; bf16, not measured here) take F.linear.
ONEDNN_MIN_MACS = 2**20  # rows x in x out below which oneDNN's ~10 us call overhead is not repaid


def uses_onednn(x, weight, bias=None):
    """True where linear() takes oneDNN's GEMM: a CPU, fp32 rows and weight (and bias), no gradient to take,
    no CPU autocast, not inside torch.compile, oneDNN present and enabled, contiguous rows (and bias) of the
    weight's width, a weight that is contiguous or the transpose of a contiguous one, and at least
    ONEDNN_MIN_MACS multiply-adds."""
    if kernels.MODE == "torch" or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return False  # a strided bias: oneDNN read it as contiguous, silently wrong
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the oneDNN op has no backward
    if bias is not None and torch.is_grad_enabled() and bias.requires_grad:
        return False
    if torch.is_autocast_enabled("cpu"):
        return False  # F.linear runs in the autocast dtype; so must every projection
    if torch.compiler.is_compiling():
        return False
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False  # F.linear names the shape mismatch; oneDNN's error does not
    if not x.is_contiguous() or not (weight.is_contiguous() or weight.t().is_contiguous()):
        return False  # oneDNN's unpacked path took 640 ms for a 0.4 ms GEMM on a weight with strided rows
    out_features, in_features = weight.shape
    rows = x.numel() // max(in_features, 1)
    return rows * in_features * out_features >= ONEDNN_MIN_MACS


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias): x (..., in) -> (..., out), through oneDNN where uses_onednn says so."""
    if uses_onednn(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward is linear() above: the same parameters, names and state_dict."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def use_onednn(model):
    """Give every nn.Linear of `model` (the projections, the indexer's wq_b and wk, the head) this file's
    forward, in place: the class of each module becomes Linear, its parameters untouched. The serving
    engine calls it (engine.Engine); a model built for training keeps F.linear. -> model."""
    for m in model.modules():
        if type(m) is not Linear and isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
            m.__class__ = Linear
    return model
