"""
The GLM-5 checkpoint format, end to end: config.json <-> ModelConfig, our parameter names <-> the
released ones, and the `*.safetensors` shards plus `model.safetensors.index.json`, read and written by
hand with no dependency beyond torch and numpy. The names and the config.json keys are those of the
released checkpoint (zai-org/GLM-5 on Hugging Face, model_type "glm_moe_dsa"); the architecture they
describe is the GLM-5 report's section 2 (arXiv 2602.15763).

    model = weights.from_pretrained("path/to/GLM-5", dtype=torch.bfloat16)   # shard by shard
    weights.save_pretrained(model, "out/ckpt")                                # the same format back

Reading is memory-mapped, shard by shard; every way a file can be wrong raises CheckpointError naming the
file or tensor; writing is atomic (the file format: at "One file" below). The stacked experts and the MTP
block are mapped to the released names at "The model's state_dict <-> the released tensor names".

Run its tests with `python -m pytest -q tests/test_checkpoint.py`.
Honest limits: BF16/FP32 checkpoints, and the compressed-tensors W4A8/W8A8 ones quantize.py writes (a
quantization_config is read by quantized.from_pretrained; the FP8 release's is rejected); the
whole model is allocated on `device` before the shards are copied in, so it must fit there (no
tensor-parallel or offloaded loading); the MTP block's repeated copies of the embedding and head are
skipped on load and not written on save. A nanoGLM checkpoint written before the MTP post-norm contract was
adopted (29 Nov 2026) holds an MTP block trained on pre-norm hidden states: it still serves losslessly, with
fewer drafts accepted.
"""

import dataclasses
import difflib
import json
import os
import struct

import numpy as np
import torch

from experts import per_expert_state
from model import GLM5, ModelConfig, MoE

# safetensors dtype strings <-> torch dtypes
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, truncated or does not match the model."""


# -----------------------------------------------------------------------------
# One file
#
# A safetensors file is: 8 bytes little-endian u64 = N, then N bytes of JSON header
#     {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
# then the raw little-endian tensor bytes, offsets relative to the end of the header.
#
# Reading is memory-mapped (np.memmap, copy-on-write): opening a 5 GB shard costs nothing until a tensor is
# touched, so from_pretrained loads a big checkpoint shard by shard. Every way a file can be wrong (missing,
# truncated, bad header, unknown dtype, offsets out of range, a tensor config.json does not describe) raises
# CheckpointError naming the file or tensor. Writing goes to a temporary file that is renamed into place, so a
# crash never leaves a half-written shard under the real name.


def read_header(path):
    """-> (header dict without __metadata__, metadata dict, byte offset where the data starts)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist; check the directory or the index json")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path} is truncated: its header claims {n} bytes but the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (a JSON object was expected)")
    meta = header.pop("__metadata__", {}) or {}
    data_len = size - 8 - n
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{path}: the header entry for {name} lacks dtype, shape or data_offsets")
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        nbytes = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name} has offsets {begin}..{end} that do not fit its "
                f"shape {info['shape']} and dtype {info['dtype']}"
            )
        if end > data_len:
            raise CheckpointError(
                f"{path} is truncated: tensor {name} ends at byte {end} of the data "
                f"but only {data_len} data bytes are present"
            )
    return header, meta, 8 + n


class SafeFile:
    """A memory-mapped safetensors file: `f.keys()`, `f.get(name) -> torch.Tensor` (lazy, no copy)."""

    def __init__(self, path):
        self.path = path
        self.header, self.metadata, self.data_start = read_header(path)
        self._map = None

    def keys(self):
        return list(self.header)

    def get(self, name):
        info = self.header[name]
        if self._map is None:
            # copy-on-write so torch gets a writable view; pages are read only when touched
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        begin, end = info["data_offsets"]
        raw = self._map[self.data_start + begin : self.data_start + end]
        dtype = DTYPES[info["dtype"]]
        if end == begin:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.from_numpy(raw).view(dtype).reshape(info["shape"])


def save_file(tensors, path, metadata=None):
    """Write {name: tensor} to `path` atomically (temporary file, fsync, rename)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"cannot store tensor {name} of dtype {t.dtype} in safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad so the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy())  # raw little-endian bytes, no copy
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# A sharded checkpoint directory


def save_sharded(tensors, directory, max_shard_bytes=5 * 2**30):
    """Write tensors as model-0000i-of-0000n.safetensors shards plus the index json (written last)."""
    os.makedirs(directory, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    tmp = os.path.join(directory, INDEX_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=2)
    os.replace(tmp, os.path.join(directory, INDEX_NAME))


def open_checkpoint(directory):
    """-> {file name: [tensor names]} in file order, checked against the index json when there is one.

    Accepts a directory with model.safetensors.index.json (sharded) or with *.safetensors files and no index.
    """
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index ({e!r})") from None
        files = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        for fname, names in files.items():
            present = set(read_header(os.path.join(directory, fname))[0])
            missing, unlisted = sorted(set(names) - present), sorted(present - set(names))
            if missing:
                raise CheckpointError(
                    f"{os.path.join(directory, fname)} lacks tensor {missing[0]} "
                    f"that {INDEX_NAME} places there"
                )
            if unlisted:
                raise CheckpointError(
                    f"{os.path.join(directory, fname)} holds tensor {unlisted[0]} "
                    f"that {INDEX_NAME} does not list; the index and the shards disagree"
                )
        return dict(sorted(files.items()))
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    fnames = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not fnames:
        raise CheckpointError(
            f"{directory} holds no *.safetensors files; pass a directory written by "
            f"save_pretrained or a downloaded GLM-5 checkpoint"
        )
    files, seen = {}, {}
    for fname in fnames:
        files[fname] = list(read_header(os.path.join(directory, fname))[0])
        for name in files[fname]:
            if name in seen:
                raise CheckpointError(
                    f"tensor {name} is in both {seen[name]} and {fname} in {directory}; remove the stale "
                    "shard"
                )
            seen[name] = fname
    return files


# -----------------------------------------------------------------------------
# config.json <-> ModelConfig

# keys a published config.json may hold whose value we must check rather than ignore
REQUIRED_VALUES = {
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "moe_layer_freq": 1,
    "attention_bias": False,
    "rope_interleave": True,
    "indexer_rope_interleave": True,
}


def config_from_json(d, source="config"):
    """A published config.json dict -> ModelConfig: RoPE from rope_parameters, unsupported values rejected
    with one sentence naming `source`, bookkeeping keys (architectures, dtype, transformers_version, ...)
    ignored."""
    d = dict(d)
    for k, want in REQUIRED_VALUES.items():
        if k in d and d[k] != want:
            raise ValueError(f"{source}: {k} = {d[k]!r} is not supported (GLM-5 uses {want!r})")
    for key in ("rope_scaling", "rope_parameters"):  # the newer rope_parameters wins (applied last)
        rope = d.pop(key, None) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))  # older files say "type"
        if kind != "default":
            raise ValueError(
                f"{source}: {key} has rope type {kind!r}, which is not supported; "
                f"GLM-5 uses plain RoPE ('default', no YaRN)"
            )
        if "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
    if any(t != "full" for t in d.get("indexer_types") or []) or (d.get("index_topk_freq") or 1) > 1:
        raise ValueError(
            f"{source}: cross-layer indexer sharing (indexer_types / index_topk_freq) is not part of GLM-5 "
            f"and not supported; every layer needs its own indexer"
        )
    qc = d.pop("quantization_config", None)  # compressed-tensors W4A8/W8A8: quantized.py reads those
    if qc and not (isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"):
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(
            f"{source}: quantization_config.quant_method = {method!r} is not supported (the FP8 release's "
            f"'fp8' included); use the BF16 release, or a compressed-tensors checkpoint from quantize.py"
        )
    if d.get("q_lora_rank", 1) is None:
        raise ValueError(
            f"{source}: q_lora_rank is null (no query compression); GLM-5 compresses queries, give "
            "q_lora_rank"
        )
    if isinstance(d.get("eos_token_id"), int):
        d["eos_token_id"] = [d["eos_token_id"]]
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: v for k, v in d.items() if k in names}
    if isinstance(kw.get("rope_theta"), int):
        kw["rope_theta"] = float(kw["rope_theta"])
    return ModelConfig(**kw)


def config_to_json(cfg):
    """ModelConfig -> a config.json dict in the published layout (rope_theta inside rope_parameters)."""
    d = dataclasses.asdict(cfg)
    d["rope_parameters"] = {"rope_theta": d.pop("rope_theta"), "rope_type": "default"}
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        **REQUIRED_VALUES,
        **d,
    }


# -----------------------------------------------------------------------------
# The model's state_dict <-> the released tensor names
#
# The MTP block is stored after the decoder layers, as model.layers.{num_hidden_layers}, and reads the hidden
# state the released weights were trained with: the main stack's output after model.norm, then its own output
# after shared_head.norm (model.MTPBlock; the contract vLLM's and SGLang's GLM-5 MTP code follow; older
# nanoGLM checkpoints: see the module docstring's limits).
#
# The model stacks each layer's routed experts into two tensors (experts.Experts); the files keep the released
# one-tensor-per-expert names (`model.layers.{L}.mlp.experts.{e}.gate_proj.weight`, ...), mapped both ways by
# checkpoint_tensors, so a file written here loads in any GLM-5 reader and the release loads here.


def checkpoint_name(name, num_hidden_layers):
    """Our state_dict name -> the released name: MTP block j is stored as model.layers.{L + j}, after the
    L decoder layers; every other name is already the released one."""
    if name.startswith("mtp_layers."):
        j, rest = name[len("mtp_layers.") :].split(".", 1)
        return f"model.layers.{num_hidden_layers + int(j)}.{rest}"
    return name


def checkpoint_tensors(state_dict, num_hidden_layers):
    """Our state_dict -> {released name: tensor}: the MTP renaming above, and each layer's stacked experts
    (experts.Experts) as one tensor per expert and projection (experts.per_expert_state), views that share
    the stacked storage, so copying into them on load fills the model."""
    return {checkpoint_name(n, num_hidden_layers): t for n, t in per_expert_state(state_dict).items()}


def save_pretrained(model, directory, dtype=torch.bfloat16, max_shard_bytes=5 * 2**30, state=None):
    """Write config.json + sharded safetensors + the index json; the router bias stays fp32. state: the
    model's state dict in whole tensors, for a model whose own are FSDP2 shards (gathered to this rank)."""
    os.makedirs(directory, exist_ok=True)
    L = model.config.num_hidden_layers
    if state is None:
        state = model.state_dict()
    tensors = {}
    for name, t in checkpoint_tensors(state, L).items():
        keep_fp32 = name.endswith("e_score_correction_bias")
        tensors[name] = t.detach().to("cpu", torch.float32 if keep_fp32 else dtype)
    save_sharded(tensors, directory, max_shard_bytes)
    cfg = config_to_json(model.config)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    tmp = os.path.join(directory, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, os.path.join(directory, "config.json"))


def read_config(directory, overrides):
    """-> (ModelConfig from directory/config.json with `overrides` applied, the raw dict, its path)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no config.json in {directory}; pass a directory written by save_pretrained or a GLM-5 "
            "checkpoint"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    for k in overrides:
        if k not in names:
            hint = difflib.get_close_matches(k, names, n=1)
            raise TypeError(
                f"from_pretrained got unknown config override {k!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
            )
    return dataclasses.replace(config_from_json(raw, source=path), **overrides), raw, path


def from_pretrained(directory, dtype=None, device="cpu", **overrides):
    """Load config.json + safetensors (ours or the public GLM-5 release) shard by shard, memory-mapped.
    dtype: parameter dtype (default: config.json's "dtype"/"torch_dtype", else fp32);
    overrides: ModelConfig fields to change (e.g. dsa_mode="dense")."""
    cfg, raw, path = read_config(directory, overrides)
    if raw.get("quantization_config"):
        raise ValueError(
            f"{path} describes a quantized checkpoint (quantization_config); load it with "
            "quantized.from_pretrained, as engine.load_model and serve.py do"
        )
    if dtype is None:
        stored = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        dtype = getattr(torch, str(stored), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path}: unknown dtype {stored!r}; pass dtype= to from_pretrained")
    with torch.device("meta"):
        model = GLM5(cfg).to(dtype)  # parameters only change dtype; the router bias stays fp32
    model.to_empty(device=device)
    L = cfg.num_hidden_layers
    expected = checkpoint_tensors(model.state_dict(keep_vars=True), L)  # released name -> tensor or view
    # the release may repeat the shared embedding/head inside the MTP layer; ours are the same tensors
    redundant = tuple(
        f"model.layers.{L + j}.{s}"
        for j in range(cfg.num_nextn_predict_layers)
        for s in ("embed_tokens.weight", "shared_head.head.weight")
    )
    loaded = set()
    for fname, names in open_checkpoint(directory).items():
        f = SafeFile(os.path.join(directory, fname))
        for name in names:
            if name.startswith(redundant) or name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in expected:
                raise CheckpointError(
                    f"{fname} holds tensor {name}, which config.json does not describe; "
                    f"the checkpoint and config.json disagree"
                )
            src, dst = f.get(name), expected[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise CheckpointError(
                    f"tensor {name} in {fname} has shape {tuple(src.shape)} "
                    f"but config.json implies {tuple(dst.shape)}"
                )
            with torch.no_grad():
                dst.copy_(src)
            loaded.add(name)
    missing = [n for n in expected if n not in loaded]
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} lacks tensor {missing[0]} (and {len(missing) - 1} more) "
            f"that config.json implies"
        )
    for m in model.modules():
        if isinstance(m, MoE):
            m.tokens_per_expert.zero_()  # load statistics are not part of a checkpoint
    return model
