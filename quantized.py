"""
The runtime of a quantized GLM-5 (GLM-5 report, arXiv 2602.15763, its deployment section: W4A8 experts,
W8A8 attention and dense MLPs): the quantized modules and the loader that swaps them in by the checkpoint's
quantization_config, as gpt-fast's loader swaps modules by the scheme's name. quantize.py writes these
checkpoints (the layout and the compressed-tensors sources it follows are at its scheme and weight
sections). The modules (QuantLinear, QuantExperts, MTPHeadNorm, MTPInputNorm) and from_pretrained are
described at their sections below.

    python serve.py --ckpt /tmp/q/w4a8          # weights.from_pretrained sends a quantized directory here
    python -m pytest -q tests/test_quantize.py

Which matmul runs where is kernels_quant.py's: Triton on a GPU, its torch reference (integer matmuls with
torch._int_mm on a CPU) otherwise, behind kernels.py's NANOGLM_KERNELS switch.

Honest limits: only what quantize.py writes and llm-compressor's equivalent W4A8 / W8A8 recipes are read:
symmetric INT weights (4 bits packed, 8 bits plain) per channel or group, INT8 dynamic per-token activations;
no zero points, static activation scales, FP8, activation ordering or KV-cache quantization. A quantized
model serves; it does not train (the weights are buffers) and it does not take weight updates.
"""

import json
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import experts
import kernels_quant
import weights
from mla import RMSNorm
from model import GLM5, MoE

# -----------------------------------------------------------------------------
# The quantized modules
#
# - QuantLinear: an INT8 weight (int-quantized) or INT4 words (pack-quantized) with per-channel or per-group
#   scales; its input quantized to INT8 per token at run time, an integer matmul, the scales after.
# - QuantExperts: one MoE layer's routed experts, stacked as experts.Experts stacks them (gate_up (E, 2F, .),
#   down (E, D, .)), run by kernels_quant.w4a8_experts (INT4) or expert by expert through w8a8_linear (INT8).
# - MTPHeadNorm: the MTP block's shared_head.norm when the checkpoint carries its own MTP head (a rotated
#   checkpoint does, quantize.py says why): the norm followed by the D x D map that makes the shared lm_head
#   compute the MTP head's logits. MTPInputNorm: a rotated checkpoint's hnorm, which maps its input back to
#   the post-norm hidden state the released MTP contract hands the block.


class QuantLinear(nn.Module):
    """y = x W^T with W (out, in) stored as INT8 `weight` or INT4 `weight_packed`, and `weight_scale`
    (out, 1) per channel or (out, in / group) per group."""

    def __init__(self, in_features, out_features, num_bits, groups, scale_dtype):
        super().__init__()
        self.in_features, self.out_features, self.num_bits = in_features, out_features, num_bits
        if num_bits == 8:
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        else:
            words = -(-in_features // 8)
            self.register_buffer("weight_packed", torch.empty(out_features, words, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=scale_dtype))

    def forward(self, x):
        if self.num_bits == 8:
            return kernels_quant.w8a8_linear(x, self.weight, self.weight_scale)
        return kernels_quant.w4a8_linear(x, self.weight_packed, self.weight_scale, self.in_features)


class QuantExperts(nn.Module):
    """experts.Experts with quantized weights: gate_up (E, 2F, D) and down (E, D, F) as INT4 words
    (`*_packed`, the last dim / 8) or INT8 (`*_weight`), scales `*_scale` (E, rows, groups).
    forward(x, counts): x (rows, D) sorted by expert, counts (E,) -> (rows, D); impl and decode are
    experts.Experts.forward's, which the quantized kernels do not need."""

    def __init__(self, n, dim, hidden, num_bits, group_size, scale_dtype):
        super().__init__()
        self.n, self.dim, self.hidden, self.num_bits = n, dim, hidden, num_bits
        for name, rows, cols in (("gate_up", 2 * hidden, dim), ("down", dim, hidden)):
            G = cols // group_size if group_size else 1
            if num_bits == 8:
                self.register_buffer(f"{name}_weight", torch.empty(n, rows, cols, dtype=torch.int8))
            else:
                self.register_buffer(f"{name}_packed", torch.empty(n, rows, -(-cols // 8), dtype=torch.int32))
            self.register_buffer(f"{name}_scale", torch.empty(n, rows, G, dtype=scale_dtype))

    def forward(self, x, counts, impl=None, decode=False):
        if self.num_bits == 4:
            h = kernels_quant.w4a8_experts(x, counts, self.gate_up_packed, self.gate_up_scale, self.dim)
            g, u = h.chunk(2, dim=-1)  # (rows, F) each
            return kernels_quant.w4a8_experts(
                F.silu(g) * u, counts, self.down_packed, self.down_scale, self.hidden
            )
        outs = []  # INT8 experts (--scheme w8a8): the reference loop, one W8A8 matmul per expert
        for e, x_e in enumerate(x.split(counts.tolist())):
            g, u = kernels_quant.w8a8_linear(x_e, self.gate_up_weight[e], self.gate_up_scale[e]).chunk(2, -1)
            outs.append(kernels_quant.w8a8_linear(F.silu(g) * u, self.down_weight[e], self.down_scale[e]))
        return torch.cat(outs)

    def per_expert_state(self, prefix):
        """The released per-expert names -> views of the stacked buffers: `{prefix}{e}.gate_proj.
        weight_packed` = gate_up_packed[e, :F], ... (copying into them fills the module)."""
        F_ = self.hidden
        kind = "weight_packed" if self.num_bits == 4 else "weight"
        stored = "packed" if self.num_bits == 4 else "weight"
        out = {}
        for e in range(self.n):
            gate_up = {s: getattr(self, f"gate_up_{s}")[e] for s in (stored, "scale")}
            down = {s: getattr(self, f"down_{s}")[e] for s in (stored, "scale")}
            for proj, src in (("gate_proj", slice(0, F_)), ("up_proj", slice(F_, 2 * F_))):
                out[f"{prefix}{e}.{proj}.{kind}"] = gate_up[stored][src]
                out[f"{prefix}{e}.{proj}.weight_scale"] = gate_up["scale"][src]
            out[f"{prefix}{e}.down_proj.{kind}"] = down[stored]
            out[f"{prefix}{e}.down_proj.weight_scale"] = down["scale"]
        return out


class MTPHeadNorm(RMSNorm):
    """shared_head.norm for an MTP block with its own head H_mtp, in a model whose lm_head H is shared:
    RMSNorm(x) M^T with M (D, D) solving H M = H_mtp (least squares; exact when H's columns are
    independent), so lm_head(this) = H_mtp RMSNorm(x)."""

    def __init__(self, dim, eps):
        super().__init__(dim, eps)
        self.register_buffer("to_main", torch.zeros(dim, dim))

    @classmethod
    def from_heads(cls, norm, main_head, mtp_head):
        m = cls(norm.weight.shape[0], norm.eps).to(norm.weight.device, norm.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(norm.weight)
            m.set_heads(main_head, mtp_head)
        return m

    def set_heads(self, main_head, mtp_head):
        """main_head H, mtp_head H_mtp (V, D) -> to_main = M^T (D, D), M solving H M = H_mtp in float64."""
        M = torch.linalg.lstsq(main_head.double().cpu(), mtp_head.double().cpu()).solution  # (D, D)
        self.to_main.copy_(M.T.to(self.to_main.dtype))

    def forward(self, x):
        y = super().forward(x)
        return y @ self.to_main.to(y.dtype)  # y M^T: lm_head of it is y M^T H^T = y H_mtp^T


class MTPInputNorm(RMSNorm):
    """hnorm for the MTP block of a rotated checkpoint: RMSNorm(y A) * weight, A = input_map (D, D).

    The released weights' contract hands the MTP block model.norm's output, w ⊙ n(h) (n: RMSNorm without
    its weight), and each later step the block's own shared_head.norm output. In a rotated model model.norm's
    weight is folded into lm_head, so the stream gives n(h) Q, and w ⊙ n(h) in the rotated basis is
    n(h) Q (Q^T diag(w) Q): quantize.py writes A = Q^T diag(w) Q as model.layers.{L}.hnorm.input_map. A later
    step's input comes from MTPHeadNorm, n(x) Q M with M = Q^T diag(w_s / w) Q, and the same A turns it into
    (w_s ⊙ n(x)) Q: one map serves every step, and RMSNorm sees the RMS the unrotated model sees."""

    def __init__(self, dim, eps):
        super().__init__(dim, eps)
        self.register_buffer("input_map", torch.eye(dim))

    @classmethod
    def from_norm(cls, norm, input_map):
        m = cls(norm.weight.shape[0], norm.eps).to(norm.weight.device, norm.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(norm.weight)
            m.input_map.copy_(input_map.to(m.input_map.dtype))
        return m

    def forward(self, y):
        # the hidden the unrotated block would read, in the rotated basis
        return super().forward(y @ self.input_map.to(y.dtype))


# -----------------------------------------------------------------------------
# quantization_config: what is read, checked field by field


def fail(path, field, value, fix):
    raise ValueError(f"{path}: quantization_config.{field} = {value!r} is not supported; {fix}")


def parse_config(qc, path):
    """config.json's quantization_config -> (groups {name: (targets, num_bits, group_size)}, ignore).
    Anything quantize.py does not write, and the runtime cannot run, is refused naming its field."""
    if not isinstance(qc, dict):
        fail(path, "", qc, "it must be a JSON object as compressed-tensors writes it")
    if qc.get("quant_method") != "compressed-tensors":
        fail(path, "quant_method", qc.get("quant_method"), "nanoGLM reads 'compressed-tensors' checkpoints")
    if qc.get("quantization_status", "compressed") != "compressed":
        fail(path, "quantization_status", qc.get("quantization_status"), "only 'compressed' weights are read")
    if qc.get("format") not in ("mixed-precision", "pack-quantized", "int-quantized"):
        fail(path, "format", qc.get("format"), "use 'mixed-precision', 'pack-quantized' or 'int-quantized'")
    if qc.get("kv_cache_scheme") is not None:
        fail(path, "kv_cache_scheme", qc["kv_cache_scheme"], "the KV cache is not quantized here; set null")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        fail(path, "ignore", ignore, "it must be a list of module names or 're:' patterns")
    config_groups = qc.get("config_groups")
    if not isinstance(config_groups, dict) or not config_groups:
        fail(path, "config_groups", config_groups, "give at least one group of targets and weight arguments")
    groups = {}
    for gname, g in config_groups.items():
        at = f"config_groups.{gname}"
        if not isinstance(g, dict):
            fail(path, at, g, "each group is an object with targets, weights and input_activations")
        fmt = g.get("format", qc.get("format"))
        if fmt not in ("pack-quantized", "int-quantized"):
            fail(path, f"{at}.format", fmt, "use 'pack-quantized' (INT4) or 'int-quantized' (INT8)")
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            fail(path, f"{at}.targets", targets, "give a list of module names or 're:' patterns")
        w = g.get("weights")
        if not isinstance(w, dict):
            fail(path, f"{at}.weights", w, "give the weights' quantization arguments")
        bits = 4 if fmt == "pack-quantized" else 8
        if w.get("num_bits") != bits:
            fail(path, f"{at}.weights.num_bits", w.get("num_bits"), f"format {fmt} needs {bits}")
        if w.get("type", "int") != "int":
            fail(path, f"{at}.weights.type", w.get("type"), "only 'int' weights are read")
        if w.get("symmetric", True) is not True:
            fail(
                path, f"{at}.weights.symmetric", w.get("symmetric"), "only symmetric weights (no zero points)"
            )
        if w.get("dynamic", False):
            fail(path, f"{at}.weights.dynamic", w.get("dynamic"), "weights are quantized offline (false)")
        if w.get("actorder"):
            fail(
                path, f"{at}.weights.actorder", w.get("actorder"), "activation ordering is not read; use null"
            )
        strategy, gs = w.get("strategy"), w.get("group_size")
        if strategy not in ("channel", "group"):
            fail(path, f"{at}.weights.strategy", strategy, "use 'channel' or 'group'")
        if strategy == "group" and bits == 8:
            fail(path, f"{at}.weights.strategy", strategy, "INT8 weights are read per channel only")
        if strategy == "group" and not (isinstance(gs, int) and gs > 0):
            fail(path, f"{at}.weights.group_size", gs, "strategy 'group' needs a positive group_size")
        a = g.get("input_activations")
        want = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        if not isinstance(a, dict):
            fail(path, f"{at}.input_activations", a, "give INT8 dynamic per-token activations (W4A8/W8A8)")
        for k, v in want.items():
            if a.get(k) != v:
                fail(path, f"{at}.input_activations.{k}", a.get(k), f"W4A8/W8A8 activations need {v!r}")
        if g.get("output_activations") is not None:
            fail(path, f"{at}.output_activations", g["output_activations"], "output quantization is not read")
        groups[gname] = (targets, bits, gs if strategy == "group" else None)
    return groups, ignore


def matches(pattern, module, is_linear=True):
    """compressed-tensors' target / ignore rule: "re:<regex>" matched from the start of the name, else the
    module's exact name, or its class name ("Linear")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module or (pattern == "Linear" and is_linear)


def scheme_of(module, groups, ignore):
    """-> (num_bits, group_size) for a checkpoint module name, or None when it stays as it is."""
    if any(matches(p, module) for p in ignore):
        return None
    hits = [(gname, g) for gname, g in groups.items() if any(matches(t, module) for t in g[0])]
    if len(hits) > 1:
        raise ValueError(
            f"quantization_config: module {module} is targeted by both {hits[0][0]} and {hits[1][0]}; "
            "each module belongs to one config group"
        )
    return hits[0][1][1:] if hits else None


# -----------------------------------------------------------------------------
# Build the quantized model and load a checkpoint into it
#
# from_pretrained(directory): config.json's quantization_config checked (one sentence naming the field for
# anything not supported), the model built on the meta device, every targeted module swapped, then the shards
# copied in one by one, as weights.from_pretrained does for BF16 checkpoints (which calls this).


def set_module(root, dotted, new):
    parent, _, leaf = dotted.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


# tensors a quantized module's checkpoint entry holds besides its weight (weight_shape is checked, not kept)
WEIGHT_SHAPE = ".weight_shape"


def build(cfg, groups, ignore, dtype, path):
    """The GLM5 on the meta device with every targeted module swapped for its quantized form."""
    L = cfg.num_hidden_layers
    with torch.device("meta"):
        model = GLM5(cfg).to(dtype)
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, (nn.Linear, experts.Experts)):
                continue
            released = weights.checkpoint_name(name, L)
            if isinstance(mod, nn.Linear) and mod is not model.lm_head:
                s = scheme_of(released, groups, ignore)
                if s is not None:
                    bits, gs = s
                    check_group(gs, mod.in_features, released, path)
                    G = mod.in_features // gs if gs else 1
                    set_module(model, name, QuantLinear(mod.in_features, mod.out_features, bits, G, dtype))
            elif isinstance(mod, experts.Experts):
                E, twoF, D = mod.gate_up_proj.shape
                names = [
                    f"{released}.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")
                ]
                schemes = {scheme_of(n, groups, ignore) for n in names}
                if len(schemes) > 1:
                    raise ValueError(
                        f"{path}: the routed experts of {released} fall under different quantization_config "
                        "groups (or some are ignored); give all of a layer's experts one scheme"
                    )
                s = schemes.pop()
                if s is not None:
                    bits, gs = s
                    check_group(gs, D, released, path)
                    check_group(gs, twoF // 2, released, path)
                    set_module(model, name, QuantExperts(E, D, twoF // 2, bits, gs, dtype))
    return model


def check_group(gs, K, module, path):
    if gs and K % gs:
        raise ValueError(
            f"{path}: quantization_config group_size {gs} does not divide {module}'s input size {K}; "
            "quantize it again with a divisor"
        )


def expected_tensors(model, L):
    """Checkpoint name -> the model's tensor (or a view of it) to copy into."""
    state = model.state_dict(keep_vars=True)
    out = {}
    quant_experts = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantExperts):
            quant_experts[name] = mod
    for name, t in state.items():
        owner = name.rsplit(".", 1)[0]
        if owner in quant_experts:
            continue
        out[weights.checkpoint_name(name, L)] = t
    out = experts.per_expert_state(out)
    for name, mod in quant_experts.items():
        out.update(mod.per_expert_state(weights.checkpoint_name(name + ".", L)))
    return out


def from_pretrained(directory, dtype=None, device="cpu", **overrides):
    """Load a compressed-tensors checkpoint (quantize.py's, or an llm-compressor W4A8/W8A8 one with GLM-5's
    names) -> GLM5 with quantized modules. dtype: the kept tensors' and scales' (default config.json's)."""
    cfg, raw, path = weights.read_config(directory, overrides)
    groups, ignore = parse_config(raw.get("quantization_config"), path)
    if dtype is None:
        dtype = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path}: unknown dtype {raw.get('dtype')!r}; pass dtype= to from_pretrained")
    model = build(cfg, groups, ignore, dtype, path)
    model.to_empty(device=device)
    L = cfg.num_hidden_layers
    expected = expected_tensors(model, L)
    mtp_embed = tuple(
        f"model.layers.{L + j}.embed_tokens.weight" for j in range(cfg.num_nextn_predict_layers)
    )
    mtp_heads = {
        f"model.layers.{L + j}.shared_head.head.weight": j for j in range(cfg.num_nextn_predict_layers)
    }
    mtp_maps = {f"model.layers.{L + j}.hnorm.input_map": j for j in range(cfg.num_nextn_predict_layers)}
    loaded, heads, maps = set(), {}, {}
    for fname, names in weights.open_checkpoint(directory).items():
        f = weights.SafeFile(os.path.join(directory, fname))
        for name in names:
            if name.startswith(mtp_embed) or name.endswith("rotary_emb.inv_freq"):
                continue
            src = f.get(name)
            if name in mtp_heads:  # the MTP block's own head: mapped onto lm_head after loading
                heads[mtp_heads[name]] = src
                continue
            if name in mtp_maps:  # a rotated checkpoint's map before hnorm (MTPInputNorm)
                maps[mtp_maps[name]] = src
                continue
            if name.endswith(WEIGHT_SHAPE):
                check_shape(name, src, expected, fname)
                continue
            if name not in expected:
                raise weights.CheckpointError(
                    f"{fname} holds tensor {name}, which config.json and its quantization_config do not "
                    "describe; the checkpoint and config.json disagree"
                )
            dst = expected[name]
            if tuple(src.shape) != tuple(dst.shape) or (src.is_floating_point() != dst.is_floating_point()):
                raise weights.CheckpointError(
                    f"tensor {name} in {fname} is {src.dtype} {tuple(src.shape)} but the quantization_config "
                    f"implies {dst.dtype} {tuple(dst.shape)}"
                )
            if not dst.is_floating_point() and src.dtype != dst.dtype:
                raise weights.CheckpointError(
                    f"tensor {name} in {fname} is {src.dtype}; it must be {dst.dtype}"
                )
            with torch.no_grad():
                dst.copy_(src)
            loaded.add(name)
    missing = [n for n in expected if n not in loaded]
    if missing:
        raise weights.CheckpointError(
            f"checkpoint {directory} lacks tensor {missing[0]} (and {len(missing) - 1} more) that "
            "config.json and its quantization_config imply"
        )
    for j, input_map in maps.items():
        block = model.mtp_layers[j]
        block.hnorm = MTPInputNorm.from_norm(block.hnorm, input_map)
    for j, head in heads.items():
        block = model.mtp_layers[j]
        if not torch.equal(head.to(model.lm_head.weight.dtype), model.lm_head.weight.detach()):
            block.shared_head.norm = MTPHeadNorm.from_heads(
                block.shared_head.norm, model.lm_head.weight, head
            )
    for m in model.modules():
        if isinstance(m, MoE):
            m.tokens_per_expert.zero_()
    return model


def check_shape(name, src, expected, fname):
    """`<module>.weight_shape` must be int64-like [out, in] and agree with the module's packed weight."""
    packed = expected.get(name[: -len(WEIGHT_SHAPE)] + ".weight_packed")
    shape = src.tolist() if not src.is_floating_point() else None
    if packed is None or shape is None or len(shape) != 2:
        raise weights.CheckpointError(f"{fname}: {name} does not belong to an INT4 module of this model")
    if shape[0] != packed.shape[0] or -(-shape[1] // 8) != packed.shape[1]:
        raise weights.CheckpointError(
            f"{fname}: {name} = {shape} does not match the model's {tuple(packed.shape)} packed weight"
        )


def is_quantized(directory):
    """Whether a checkpoint directory's config.json carries a quantization_config."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return bool(json.load(f).get("quantization_config"))
    except (json.JSONDecodeError, AttributeError):
        return False  # weights.read_config reports a broken config.json with its own sentence
