"""
W4A8 quantization, offline (GLM-5 report, arXiv 2602.15763, its deployment section: INT4 MoE experts with
INT8 activations, INT8 attention and dense MLPs, a few sensitive matrices kept in BF16, and a Hadamard
rotation that removes activation outliers first). As gpt-fast does it: read a checkpoint, write a quantized
one whose config.json says the scheme; quantized.py is the runtime that loads and runs it. The checkpoint is
written by hand in the compressed-tensors layout (the one vLLM, SGLang and transformers read) and the
rotation is QuaRot's (arXiv 2404.00456); both are explained at their sections below, the QuaRot section
also saying where in MLA / DSA / MoE / MTP the rotation cannot be fused, and why the MTP block gets its own
head.

    python quantize.py --ckpt out_sparse/ckpt.pt --out /tmp/q/w4a8 --rotate          # the report's scheme
    python quantize.py --ckpt out_sparse/ckpt.pt --out /tmp/q/w4a8g --group_size 32  # group-wise INT4
    python quantize.py --ckpt path/to/GLM-5 --out path/to/GLM-5-W4A8 --scheme w4a8   # the release, streamed
    python quantize.py --ckpt configs/full.py --dry_run                              # bytes per scheme
    python serve.py --ckpt /tmp/q/w4a8                                                # serve what it wrote
    python -m pytest -q tests/test_quantize.py

Honest limits: round-to-nearest only (no GPTQ/AWQ: the report does not say its calibration method); no
online Hadamards, so the INT8 inputs of o_proj and every down_proj keep their outliers (see the QuaRot
section); activations are quantized dynamically at run time, so no activation scales are stored; the KV
cache is not quantized; --dry_run counts bytes from the shapes, it does not read a checkpoint. The rotation
is a dense float64 D x D matmul per matrix (no fast Walsh-Hadamard transform): seconds for the toy, on the
order of 1e16 flops for the 744B release. Loading a rotated checkpoint solves a least-squares problem over
two (V, D) float64 heads for the MTP block (quantized.MTPHeadNorm): about 15 GB of memory for GLM-5's
154,880 x 6,144 head.
"""

import argparse
import json
import math
import os
import pickle
import re
import sys
import time

import torch

import quantized
import weights
from model import GLM5, ModelConfig, load_config_file

# -----------------------------------------------------------------------------
# The scheme: which module gets which format (module names as the checkpoint names them)
#
# What goes where (--scheme w4a8; w8a8 makes the experts INT8 too):
#     routed experts (gate/up/down_proj)               INT4 weights, symmetric, per channel (or --group_size)
#     q_b_proj, o_proj, indexer wq_b, dense MLP,       INT8 weights, symmetric, per output channel
#     shared expert
#     q_a_proj, kv_a_proj_with_mqa, kv_b_proj,         kept in BF16 (the report's list), and MTP's eh_proj
#     indexer wk / weights_proj, router, lm_head,
#     embeddings, norms
#     activations of every INT8/INT4 layer             INT8, per token, dynamic, symmetric (at run time)
#
# The config follows compressed-tensors' public source (github.com/neuralmagic/compressed-tensors, now
# vllm-project/compressed-tensors: quantization/quant_args.py, quant_scheme.py, quant_config.py and
# config/base.py's CompressionFormat), written by hand since the library is not a dependency:
# quantization_config = {quant_method "compressed-tensors", format "mixed-precision" when the groups differ
# (else the one format), quantization_status "compressed", config_groups {group_i: {targets, weights,
# input_activations, output_activations, format}}, ignore, kv_cache_scheme}; strategy "channel" / "group"
# (with group_size) for weights, "token" with dynamic true for activations; targets are module names, "re:"
# regexes matched from the start of the name, or class names; `ignore` lists modules kept as they are.
# llm-compressor's MoE examples (github.com/vllm-project/llm-compressor, examples/) ignore lm_head and the
# router ("re:.*mlp.gate$") as here; they target "Linear", where the targets here are regexes that name
# exactly the quantized modules (so a reader that does not apply `ignore` still finds the right ones).

EXPERT_TARGETS = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
INT8_TARGETS = [
    r"re:.*self_attn\.(q_b_proj|o_proj)$",
    r"re:.*self_attn\.indexer\.wq_b$",
    r"re:.*mlp\.(gate|up|down)_proj$",  # the dense layers' MLP (the experts' names have more in between)
    r"re:.*mlp\.shared_experts\.(gate|up|down)_proj$",
]
WEIGHT_ARGS = dict(
    num_bits=8,
    type="int",
    symmetric=True,
    group_size=None,
    strategy="channel",
    block_structure=None,
    dynamic=False,
    actorder=None,
    observer="minmax",
    observer_kwargs={},
)
# INT8 per token, dynamic, symmetric: the scale is taken from each token's row at run time
ACTIVATION_ARGS = dict(
    num_bits=8,
    type="int",
    symmetric=True,
    group_size=None,
    strategy="token",
    block_structure=None,
    dynamic=True,
    actorder=None,
    observer=None,
    observer_kwargs={},
)


def config_groups(scheme, group_size):
    """-> the config_groups dict for --scheme w4a8 / w8a8 (one group per format)."""
    int8 = dict(
        targets=list(INT8_TARGETS),
        weights=dict(WEIGHT_ARGS),
        input_activations=dict(ACTIVATION_ARGS),
        output_activations=None,
        format="int-quantized",
    )
    if scheme == "w8a8":
        int8["targets"] += EXPERT_TARGETS
        return {"group_0": int8}
    strategy = "group" if group_size else "channel"
    int4 = dict(
        targets=list(EXPERT_TARGETS),
        weights=dict(WEIGHT_ARGS, num_bits=4, strategy=strategy, group_size=group_size or None),
        input_activations=dict(ACTIVATION_ARGS),
        output_activations=None,
        format="pack-quantized",
    )
    return {"group_0": int4, "group_1": int8}


def group_of(module, groups):
    """The config group (name, dict) whose targets match `module`, or (None, None)."""
    for gname, g in groups.items():
        if any(quantized.matches(t, module) for t in g["targets"]):
            return gname, g
    return None, None


def quantization_config(groups, ignore):
    formats = sorted({g["format"] for g in groups.values()})
    return {
        "quant_method": "compressed-tensors",
        "format": formats[0] if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


# -----------------------------------------------------------------------------
# Weight quantization: the compressed-tensors scale rule, round to nearest
#
# From compressed-tensors' quantization/utils/helpers.py calculate_qparams: symmetric
# scale = max|w| / ((q_max - q_min) / 2), that is max|w| / 7.5 for INT4 and / 127.5 for INT8, clamped to fp32
# eps; quantize = round(w / scale) clamped to [q_min, q_max]. The scale is stored in the weights' dtype; here
# it is rounded to that dtype first (up, when the cast would lower it: then max|w| / scale <= 7.5 still and
# the clamp costs at most half a step) and the weights are quantized with the rounded scale in fp32, so every
# dequantized value is within half a step of the original (tests/test_quantize.py).
# The stored tensors, from compressors/quantized_compressors/pack_quantized.py (pack_to_int32,
# compression_param_names): INT4 as `weight_packed` int32 [out, ceil(in/8)], 8 values per word along the
# input dimension, each stored as value + 8, the first in the lowest 4 bits, the row zero-padded;
# `weight_shape` [out, in] (torch.tensor of the shape: int64); `weight_scale`; no zero point when symmetric.
# INT8 ("int-quantized", the naive compressor): `weight` int8 [out, in] and `weight_scale`.


def round_scale(scale, dtype):
    """Cast the fp32 scales to their stored dtype, rounding up where the cast went down (one ulp), so
    max|w| / stored scale never exceeds (q_max - q_min) / 2 and the clamp stays within half a step."""
    stored = scale.to(dtype)
    low = stored.to(scale.dtype) < scale
    if not low.any():
        return stored
    if dtype in (torch.bfloat16, torch.float16):  # positive floats: the next bit pattern is the next value
        up = (stored.view(torch.int16) + 1).view(dtype)
    else:
        up = torch.nextafter(stored, torch.tensor(math.inf, dtype=dtype))
    return torch.where(low, up, stored)


def quantize_weight(w, num_bits, group_size=None, scale_dtype=torch.bfloat16):
    """w (N, K) float -> q int8 (N, K) in [-2^(b-1), 2^(b-1) - 1] and scale (N, 1) per channel or
    (N, K / group_size) per group, in scale_dtype. w ~= q * scale (dequantize)."""
    N, K = w.shape
    if group_size and K % group_size:
        raise ValueError(
            f"--group_size {group_size} does not divide the input size {K}; pick a divisor (128 for GLM-5)"
        )
    qmin, qmax = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    wf = w.to(torch.promote_types(w.dtype, torch.float32))
    groups = wf.view(N, K // group_size, group_size) if group_size else wf.view(N, 1, K)  # (N, G, g)
    absmax = groups.abs().amax(-1)  # (N, G)
    scale = (absmax / ((qmax - qmin) / 2)).clamp(min=torch.finfo(torch.float32).eps)
    scale = round_scale(scale, scale_dtype)
    q = (groups / scale.to(wf.dtype)[..., None]).round().clamp(qmin, qmax)
    return q.to(torch.int8).view(N, K), scale


def quantized_tensors(module, w, num_bits, group_size, scale_dtype):
    """One weight (N, K) -> its compressed tensors by checkpoint name (pack-quantized for 4 bits,
    int-quantized for 8)."""
    import kernels_quant

    q, scale = quantize_weight(w, num_bits, group_size, scale_dtype)
    if num_bits == 8:
        return {f"{module}.weight": q, f"{module}.weight_scale": scale}
    return {
        f"{module}.weight_packed": kernels_quant.pack_int4(q),  # (N, ceil(K / 8)) int32
        f"{module}.weight_scale": scale,
        f"{module}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


# -----------------------------------------------------------------------------
# QuaRot: a randomized Hadamard on the residual stream, fused into the weights
#
# QuaRot (Ashkboos et al. 2024, arXiv 2404.00456, section 4): RMSNorm(h) * w followed by a linear W equals
# RMSNorm(h) followed by W diag(w) (fold the norm's weight into the readers), and RMSNorm commutes with an
# orthogonal Q (it only divides by the row's RMS, which Q keeps): so the residual stream can carry h Q instead
# of h when every reader's weight becomes W diag(w) Q, every writer's becomes Q^T W and the embedding E Q. The
# model computes the same function (tests: float64 logits equal), but the activations the INT8 quantizer sees
# are h Q, whose outliers a random Hadamard Q spreads over all channels. Q = diag(random signs) H / sqrt(D); H
# is Sylvester's for D = 2^k and Paley's 12 x 12 (q = 11) Kronecker Sylvester's for D = 12 * 2^k (GLM-5's 6144
# = 12 * 512, the toy test's 48 = 12 * 4); any other D gets a random orthogonal matrix (QR of a Gaussian),
# exact as well, only denser to apply.


def sylvester(n):
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def paley(q):
    """Paley's construction I: a (q + 1) x (q + 1) Hadamard matrix for a prime q = 3 mod 4 (q = 11: 12)."""
    squares = {(i * i) % q for i in range(1, q)}

    def chi(a):
        a %= q
        return 0 if a == 0 else (1 if a in squares else -1)

    S = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    for i in range(q):
        for j in range(q):
            S[i + 1, j + 1] = chi(j - i)
    return S + torch.eye(q + 1, dtype=torch.float64)


def hadamard(n):
    """An n x n matrix of +-1 with H H^T = n I, for n = 2^k or 12 * 2^k; None for any other n."""
    if n & (n - 1) == 0:
        return sylvester(n)
    if n % 12 == 0 and (n // 12) & (n // 12 - 1) == 0:
        return torch.kron(paley(11), sylvester(n // 12))
    return None


def rotation(dim, seed=0):
    """The randomized Hadamard Q (dim, dim) float64, orthogonal: diag(random signs) H / sqrt(dim); a random
    orthogonal matrix where no Hadamard of that size is built here."""
    g = torch.Generator().manual_seed(seed)
    H = hadamard(dim)
    if H is None:
        A = torch.randn(dim, dim, generator=g, dtype=torch.float64)
        Qr, R = torch.linalg.qr(A)
        return Qr * torch.sign(torch.diagonal(R))
    signs = torch.randint(0, 2, (dim,), generator=g).to(torch.float64) * 2 - 1
    return signs[:, None] * H / math.sqrt(dim)


# Readers of the residual stream here: q_a_proj, kv_a_proj_with_mqa and the indexer's wk / weights_proj (after
# input_layernorm); the dense MLP's, the shared expert's and every routed expert's gate/up and the router
# (after post_attention_layernorm); lm_head (after model.norm); MTP's eh_proj (after enorm of the rotated
# embedding and hnorm of the rotated main stream). Writers: o_proj, every down_proj, eh_proj.
#
# residual-stream norms (their weights are folded into the readers, then set to 1), by name within a layer
RESIDUAL_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "enorm.weight",
    "hnorm.weight",
    "shared_head.norm.weight",
)
READS_INPUT_NORM = re.compile(
    r"self_attn\.(q_a_proj|kv_a_proj_with_mqa|indexer\.wk|indexer\.weights_proj)\.weight"
)
READS_POST_NORM = re.compile(
    r"mlp\.((shared_experts\.|experts\.\d+\.)?(gate|up)_proj|gate)\.weight"  # the router is mlp.gate
)
WRITES = re.compile(r"(self_attn\.o_proj|mlp\.((shared_experts\.|experts\.\d+\.)?down_proj))\.weight")
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def is_residual_norm(name):
    return name == "model.norm.weight" or any(name.endswith("." + n) for n in RESIDUAL_NORMS)


# Where a rotation cannot be fused, and what is done instead:
# - inside MLA the latents (q_a_layernorm, kv_a_layernorm, the [c_kv | k_pe] cache) and the indexer's
#   LayerNorm'd key are not on the residual stream: they stay unrotated (QuaRot's online Hadamards on values
#   and keys are not done; the cache stays BF16, so nothing there is quantized);
# - the inputs of o_proj and of every down_proj come from inside the block (attention output, SwiGLU product):
#   QuaRot rotates them with an online Hadamard before the matmul; not done here, so those INT8 activations
#   keep their outliers (the calibration report shows only the two residual readers);
# - the MTP block reads model.norm's output with its weight (the released weights' contract, model.MTPBlock),
#   w ⊙ n(h), which no diagonal weight in the rotated basis gives: hnorm gets a D x D map before it,
#   `model.layers.{L}.hnorm.input_map` = Q^T diag(w) Q (quantized.MTPInputNorm; a reader that does not know
#   the name must skip it, and its MTP drafts are then off the contract, never its outputs);
# - lm_head is shared by the main stack (after model.norm) and the MTP block (after shared_head.norm), whose
#   norm weights differ, and one matrix can absorb only one: lm_head takes model.norm's, and the MTP block
#   gets its own head `model.layers.{L}.shared_head.head.weight` (the name the release already uses and vLLM's
#   MTP loader reads) with shared_head.norm's folded in. nanoGLM's engine calls the one lm_head after
#   shared_head.norm, so quantized.py maps the MTP head onto it with a D x D matrix found at load
#   (quantized.MTPHeadNorm), exact while lm_head's columns are independent (vocab > hidden).
# - the router and the MoE: nothing needed; the router reads the rotated stream (its fp32 matmul takes the
#   rotated weight), every expert's gate/up are readers and its down_proj a writer, each rotated per expert.
def rotate_tensor(name, t, norms, Q):
    """One checkpoint tensor -> its rotated form (in Q's dtype), with the residual norms folded in.
    norms: {name: the original weight} of every residual-stream norm. Anything off the residual stream
    comes back unchanged. A rotated MTP block's hnorm.input_map is made here from model.norm's weight (t
    is not read)."""
    m = LAYER.fullmatch(name)
    prefix, rest = (f"model.layers.{m.group(1)}.", m.group(2)) if m else ("", name)
    if rest == "hnorm.input_map":  # (D, D): model.norm's weight in the rotated basis (MTPInputNorm)
        w = norms["model.norm.weight"].to(Q.dtype)
        return Q.T @ (w[:, None] * Q)
    f = t.to(Q.dtype)

    def reader(W, norm_name):  # W (out, D): W diag(w) Q
        return (W * norms[norm_name].to(Q.dtype)) @ Q

    if rest == "embed_tokens.weight" or name == "model.embed_tokens.weight":  # (V, D) rows on the stream
        return f @ Q
    if is_residual_norm(name):
        return torch.ones_like(f)
    if name == "lm_head.weight":
        return reader(f, "model.norm.weight")
    if rest == "shared_head.head.weight":
        return reader(f, prefix + "shared_head.norm.weight")
    if READS_INPUT_NORM.fullmatch(rest):
        return reader(f, prefix + "input_layernorm.weight")
    if READS_POST_NORM.fullmatch(rest):
        return reader(f, prefix + "post_attention_layernorm.weight")
    if WRITES.fullmatch(rest):
        return Q.T @ f
    if rest == "eh_proj.weight":  # (D, 2D): reads [enorm(emb) ; hnorm(h)], writes the MTP block's stream
        D = Q.shape[0]
        left = reader(f[:, :D], prefix + "enorm.weight")
        right = reader(f[:, D:], prefix + "hnorm.weight")
        return Q.T @ torch.cat([left, right], dim=1)
    return t


def mtp_head_name(cfg):
    return f"model.layers.{cfg.num_hidden_layers}.shared_head.head.weight"


def mtp_input_map_name(j, cfg):
    return f"model.layers.{cfg.num_hidden_layers + j}.hnorm.input_map"


def rotate_model(model, seed=0):
    """A copy of `model` with QuaRot applied to its weights (in float64 when the model is, else fp32), and
    the MTP block's own head mapped onto lm_head (quantized.MTPHeadNorm). Same function, rotated stream."""
    import copy

    cfg = model.config
    L = cfg.num_hidden_layers
    dt = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    Q = rotation(cfg.hidden_size, seed).to(dt)
    rotated = copy.deepcopy(model)
    state = weights.checkpoint_tensors(rotated.state_dict(), L)
    norms = {n: t.clone() for n, t in state.items() if is_residual_norm(n)}
    with torch.no_grad():
        for name, t in state.items():
            new = rotate_tensor(name, t, norms, Q)
            if new is not t:
                t.copy_(new)
        if rotated.mtp_layers:
            head = rotate_tensor(mtp_head_name(cfg), model.lm_head.weight, norms, Q)
            for j, block in enumerate(rotated.mtp_layers):
                block.shared_head.norm = quantized.MTPHeadNorm.from_heads(
                    block.shared_head.norm, rotated.lm_head.weight, head
                )
                input_map = rotate_tensor(mtp_input_map_name(j, cfg), None, norms, Q)
                block.hnorm = quantized.MTPInputNorm.from_norm(block.hnorm, input_map)
    return rotated


# -----------------------------------------------------------------------------
# Calibration: how outlier-heavy are the activations the INT8 quantizer sees?


@torch.no_grad()
def outlier_stats(model, batches):
    """Per layer, the outputs of input_layernorm and post_attention_layernorm (what q_a_proj... and the
    MLP/experts read, the activations quantized to INT8 per token) over `batches` (a list of (B, T) ids):
    -> {layer name: {"attn_in": (max/RMS, kurtosis), "mlp_in": (...)}}. max/RMS: the largest |x| over the
    RMS of all values; kurtosis: E[x^4] / E[x^2]^2 over a token's channels, averaged over tokens (3 for a
    Gaussian; outlier channels drive it up)."""
    sums = {}
    hooks = []
    blocks = [(f"layer {i}", b) for i, b in enumerate(model.model.layers)]
    blocks += [(f"mtp {j}", b) for j, b in enumerate(model.mtp_layers)]
    for lname, block in blocks:
        for key, norm in (("attn_in", block.input_layernorm), ("mlp_in", block.post_attention_layernorm)):

            def hook(mod, inp, out, k=(lname, key)):
                x = out.double().flatten(0, -2)  # (tokens, D)
                sq = x.pow(2)
                s = sums.setdefault(k, [0.0, 0.0, 0.0, 0])  # max |x|, sum x^2, sum kurtosis, tokens
                s[0] = max(s[0], x.abs().max().item())
                s[1] += sq.sum().item()
                s[2] += (sq.pow(2).mean(-1) / sq.mean(-1).pow(2)).sum().item()
                s[3] += x.shape[0]

            hooks.append(norm.register_forward_hook(hook))
    try:
        for x in batches:
            model(x, targets=x, mtp_weight=1.0)  # targets: the MTP block runs too
    finally:
        for h in hooks:
            h.remove()
    D = model.config.hidden_size
    out = {}
    for (lname, key), (mx, ss, kurt, n) in sums.items():
        out.setdefault(lname, {})[key] = (mx / math.sqrt(ss / (n * D)), kurt / n)
    return out


def print_outlier_table(before, after, log=print):
    log(f"{'':8s} {'input':8s} {'max/RMS before':>15s} {'after':>7s} {'kurtosis before':>16s} {'after':>7s}")
    for lname in before:
        for key in before[lname]:
            b, a = before[lname][key], after[lname][key]
            log(f"{lname:8s} {key:8s} {b[0]:15.1f} {a[0]:7.1f} {b[1]:16.1f} {a[1]:7.1f}")


# -----------------------------------------------------------------------------
# The source checkpoint, one shard at a time
#
# Streaming: tensors are read one shard at a time, memory-mapped (weights.SafeFile), and each input shard
# becomes one output shard written before the next is opened, so the 744B release is quantized with about one
# shard of memory. --rotate first reads the residual-stream norm vectors (a few KB each) from every shard.


def open_source(path):
    """train.py's ckpt.pt or a checkpoint directory -> (ModelConfig, [shard loaders]); each loader returns
    (a short label, {checkpoint name: tensor}) with the tensors memory-mapped, read only when touched."""
    if os.path.isdir(path):
        cfg, raw, cpath = weights.read_config(path, {})
        if raw.get("quantization_config"):
            raise ValueError(
                f"{cpath} already has a quantization_config; quantize the BF16 checkpoint instead"
            )

        def loader(fname, names):
            def load():
                f = weights.SafeFile(os.path.join(path, fname))
                return fname, {n: f.get(n) for n in names if not n.endswith("rotary_emb.inv_freq")}

            return load

        return cfg, [loader(fname, names) for fname, names in weights.open_checkpoint(path).items()]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; pass train.py's ckpt.pt or a checkpoint directory")
    ck = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not (isinstance(ck, dict) and "model" in ck and "config" in ck):
        raise ValueError(f"{path} is not a train.py checkpoint (no 'model' and 'config'); pass ckpt.pt")
    cfg = ModelConfig(**ck["config"]["model"])

    def load():
        return os.path.basename(path), weights.checkpoint_tensors(ck["model"], cfg.num_hidden_layers)

    return cfg, [load]


# -----------------------------------------------------------------------------
# quantize: source checkpoint -> compressed-tensors directory


def quantize_checkpoint(
    src, out, scheme="w4a8", group_size=None, rotate=False, seed=0, dtype=torch.bfloat16, log=print
):
    """Write the quantized checkpoint of `src` to directory `out`; -> a summary dict (bytes per kind of
    tensor, the most bytes held at once). dtype: of the kept tensors and the scales."""
    if scheme not in ("w4a8", "w8a8"):
        raise ValueError(f"--scheme {scheme!r} is not a scheme; use w4a8 or w8a8")
    if group_size is not None and group_size < 0:
        raise ValueError(f"--group_size {group_size} is negative; give 0 (per channel) or a group size")
    if group_size and scheme == "w8a8":
        raise ValueError(
            "--group_size applies to INT4 experts only; drop it with --scheme w8a8 (per channel)"
        )
    source_dir = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    if os.path.realpath(out) == os.path.realpath(source_dir):
        raise ValueError(f"--out {out} is where the source checkpoint is; write the quantized one elsewhere")
    cfg, shards = open_source(src)
    groups = config_groups(scheme, group_size)
    Q, norms, has_mtp_head = None, {}, False
    if rotate:  # the residual norms first: each reader needs its norm's weight, wherever it is stored
        Q = rotation(cfg.hidden_size, seed)
        for load in shards:
            _, tensors = load()
            norms.update({n: t.double().clone() for n, t in tensors.items() if is_residual_norm(n)})
            has_mtp_head = has_mtp_head or mtp_head_name(cfg) in tensors
            del tensors
    os.makedirs(out, exist_ok=True)
    weight_map, ignore = {}, set()
    summary = {"quantized_bytes": 0, "kept_bytes": 0, "peak_bytes": 0}
    for i, load in enumerate(shards):
        label, tensors = load()
        todo = dict(tensors)
        if rotate and cfg.num_nextn_predict_layers and "lm_head.weight" in todo and not has_mtp_head:
            todo[mtp_head_name(cfg)] = todo["lm_head.weight"]  # the MTP block gets its own head (see above)
        for j in range(cfg.num_nextn_predict_layers if rotate else 0):
            if f"model.layers.{cfg.num_hidden_layers + j}.hnorm.weight" in todo:  # in the shard of its hnorm
                todo[mtp_input_map_name(j, cfg)] = None  # rotate_tensor makes it from model.norm's weight
        written = {}
        for name, t in todo.items():
            if rotate:
                t = rotate_tensor(name, t, norms, Q)
            module = name[: -len(".weight")] if name.endswith(".weight") and t.dim() == 2 else None
            g = group_of(module, groups)[1] if module else None
            if g is not None:
                w = g["weights"]
                parts = quantized_tensors(module, t, w["num_bits"], w["group_size"], dtype)
                summary["quantized_bytes"] += sum(p.numel() * p.element_size() for p in parts.values())
                written.update(parts)
                continue
            if module:
                ignore.add(module)  # a matrix kept as it is: embeddings, lm_head, the report's BF16 list
            if not t.is_floating_point():
                keep = t.dtype
            elif name.endswith("e_score_correction_bias"):
                keep = torch.float32  # the router's correction bias stays fp32 (as weights.save_pretrained)
            else:
                keep = dtype
            written[name] = t.to(keep).contiguous()
            summary["kept_bytes"] += written[name].numel() * written[name].element_size()
        del tensors, todo
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        weights.save_file(written, os.path.join(out, fname), metadata={"format": "pt"})
        held = sum(t.numel() * t.element_size() for t in written.values())
        summary["peak_bytes"] = max(summary["peak_bytes"], held)
        weight_map.update({name: fname for name in written})
        log(f"  {label}: {len(written)} tensors, {held / 2**20:.1f} MiB -> {fname}")
        del written
    summary["total_bytes"] = summary["quantized_bytes"] + summary["kept_bytes"]
    index = {"metadata": {"total_size": summary["total_bytes"]}, "weight_map": weight_map}
    with open(os.path.join(out, weights.INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2)
    config = weights.config_to_json(cfg)
    config["dtype"] = str(dtype).replace("torch.", "")
    config["quantization_config"] = quantization_config(groups, ignore)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return summary


# -----------------------------------------------------------------------------
# --dry_run: bytes per scheme from the shapes alone (configs/full.py: the 744B model, on the meta device), and
# the bytes one decoded token reads


def planned_bytes(cfg, scheme, group_size=None, dtype_bytes=2):
    """-> (total bytes, routed-expert bytes) of the checkpoint quantize_checkpoint would write; scheme None:
    the BF16 checkpoint."""
    with torch.device("meta"):
        m = GLM5(cfg)
    groups = config_groups(scheme, group_size) if scheme else {}
    total = experts = 0
    for name, t in weights.checkpoint_tensors(m.state_dict(), cfg.num_hidden_layers).items():
        module = name[: -len(".weight")] if name.endswith(".weight") and t.dim() == 2 else None
        _, g = group_of(module, groups) if module else (None, None)
        if g is None:
            size = 4 if name.endswith("e_score_correction_bias") else dtype_bytes
            b = t.numel() * size
        else:
            N, K = t.shape
            bits, gs = g["weights"]["num_bits"], g["weights"]["group_size"]
            G = K // gs if gs else 1
            b = N * G * dtype_bytes + (N * K if bits == 8 else N * math.ceil(K / 8) * 4 + 16)
        total += b
        if ".mlp.experts." in name:
            experts += b
    return total, experts


def bytes_per_token(directory_or_model, cfg):
    """Weight bytes one decoded token reads, from a checkpoint directory or a model: everything but the
    routed experts, plus the k of E experts each MoE layer picks (k / E of their bytes), the embedding row
    only (not the whole table), and not the MTP block (decoding without drafts never runs it).
    bench/bench_quant.py's GB/s and the workshop run's quantization section read it."""
    if isinstance(directory_or_model, str):
        tensors = {}
        for fname, names in weights.open_checkpoint(directory_or_model).items():
            f = weights.SafeFile(os.path.join(directory_or_model, fname))
            tensors.update({n: f.get(n) for n in names})
    else:
        tensors = weights.checkpoint_tensors(directory_or_model.state_dict(), cfg.num_hidden_layers)
    frac = cfg.num_experts_per_tok / cfg.n_routed_experts
    mtp = f"model.layers.{cfg.num_hidden_layers}."  # the MTP block: model.generate does not run it
    total = 0.0
    for n, t in tensors.items():
        if n.startswith(mtp):
            continue
        b = t.numel() * t.element_size()
        if "embed_tokens" in n:
            b = b / t.shape[0]
        elif ".mlp.experts." in n:
            b = b * frac
        total += b
    return total


def dry_run(cfg, group_size=128, log=print):
    """Print the checkpoint bytes of BF16, W8A8, W4A8 (per channel and group-wise) and whether each fits
    one node of 8 x 80 GB GPUs (640 GB, before the KV cache and activations)."""
    node = 8 * 80e9
    log(
        f"{'scheme':28s} {'total GB':>9s} {'experts GB':>11s} {'fits 8 x 80 GB':>15s} "
        f"{'left for KV, GB':>16s}"
    )
    for label, scheme, gs in (
        ("BF16", None, None),
        ("W8A8 (INT8 everywhere)", "w8a8", None),
        ("W4A8 per channel (report)", "w4a8", None),
        (f"W4A8 group {group_size}", "w4a8", group_size),
    ):
        total, experts = planned_bytes(cfg, scheme, gs)
        fits = "yes" if total < node else "no"
        log(f"{label:28s} {total / 1e9:9.1f} {experts / 1e9:11.1f} {fits:>15s} {(node - total) / 1e9:16.1f}")


# -----------------------------------------------------------------------------
# CLI


def calibrate(src, rotate_seed, data_dir, n_batches, log=print):
    """The outlier table before/after rotation on n_batches val batches of data_dir; skipped with a message
    when the model or the data is not at hand."""
    import data
    import engine

    try:
        loader = data.DataLoader(data_dir)
    except FileNotFoundError as e:
        log(f"calibration skipped: {e}")
        return
    model = engine.load_model(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    T = min(256, model.config.max_position_embeddings)
    batches = [loader.get_batch("val", 4, T, generator=g)[0] for _ in range(n_batches)]
    if int(max(b.max() for b in batches)) >= model.config.vocab_size:
        log(f"calibration skipped: {data_dir} holds token ids past this model's vocab_size")
        return
    before = outlier_stats(model, batches)
    after = outlier_stats(rotate_model(model, rotate_seed), batches)
    log(f"calibration: {n_batches} val batches of 4 x {T} tokens from {data_dir}")
    print_outlier_table(before, after, log)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Quantize a GLM-5 checkpoint to W4A8 / W8A8 (compressed-tensors)."
    )
    arg = ap.add_argument
    arg(
        "--ckpt",
        required=True,
        help="train.py's ckpt.pt, a checkpoint directory, or configs/*.py with --dry_run",
    )
    arg("--out", help="the directory to write")
    arg("--scheme", default="w4a8", choices=["w4a8", "w8a8"])
    arg(
        "--group_size", type=int, default=0, help="INT4 group size (0: per channel, as the report; vLLM: 128)"
    )
    arg("--rotate", action="store_true", help="QuaRot: fold the norms, rotate the residual stream")
    arg("--seed", type=int, default=0, help="the rotation's random signs")
    arg(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="kept tensors, scales"
    )
    arg("--calib_batches", type=int, default=4, help="val batches for the outlier report (--rotate; 0: none)")
    arg("--data_dir", default="data/stdlib", help="the corpus of the calibration batches")
    arg("--dry_run", action="store_true", help="print bytes per scheme and whether GLM-5 fits one node")
    a = ap.parse_args(argv)
    try:
        if a.dry_run:
            if a.ckpt.endswith(".py"):
                cfg, _ = load_config_file(a.ckpt)
            else:
                cfg = open_source(a.ckpt)[0]
            return dry_run(cfg, a.group_size or 128)
        if not a.out:
            sys.exit("quantize.py: give --out DIR, the directory to write the quantized checkpoint to")
        t0 = time.time()
        s = quantize_checkpoint(
            a.ckpt, a.out, a.scheme, a.group_size or None, a.rotate, a.seed, getattr(torch, a.dtype)
        )
    except (OSError, ValueError) as e:  # missing, unreadable or unwritable files; bad settings
        sys.exit(f"quantize.py: {e}")
    except (RuntimeError, pickle.UnpicklingError) as e:  # torch.load of a file that is no checkpoint
        sys.exit(
            f"quantize.py: {a.ckpt} could not be read as a checkpoint ({e}); give a ckpt.pt or a directory"
        )
    print(
        f"wrote {a.out} in {time.time() - t0:.1f}s: {s['total_bytes'] / 2**20:.1f} MiB "
        f"({s['quantized_bytes'] / 2**20:.1f} quantized, {s['kept_bytes'] / 2**20:.1f} kept), "
        f"at most {s['peak_bytes'] / 2**20:.1f} MiB held at once"
    )
    if a.rotate and a.calib_batches > 0:
        if os.path.isfile(a.ckpt) or s["total_bytes"] < 2**31:
            calibrate(a.ckpt, a.seed, a.data_dir, a.calib_batches)
        else:
            print("calibration skipped: it runs the model, which does not fit this machine")


if __name__ == "__main__":
    main()
