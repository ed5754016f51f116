"""
weights.py, the public checkpoint format (as the released zai-org/GLM-5 files): config.json + sharded
safetensors + index json. Run: python -m pytest -q tests/test_checkpoint.py

- save_pretrained -> from_pretrained round trips exactly (fp32 and bf16, several shards).
- The files are real safetensors, parsed here by hand, with the released tensor names.
- A checkpoint laid out like the public GLM-5 release (78 layers + the MTP block at model.layers.78),
  written by an independent writer in this file, loads into the right places and runs.
- Every kind of broken checkpoint fails with an error naming the file, tensor or config key.
- weights.SafeFile is memory-mapped.

Weights are fresh random values every run (no fixed seed), router bias included.
"""

import copy
import json
import os
import re
import struct

import pytest
import torch

import model
import weights
from conftest import expert_weight

# -----------------------------------------------------------------------------
# helpers

TINY = dict(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    intermediate_size=48,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=4,
    rope_theta=1e4,
    max_position_embeddings=256,
    num_nextn_predict_layers=1,
)


def randomize(m):
    """Fresh random values (unseeded) for every tensor a checkpoint holds, router bias included."""
    with torch.no_grad():
        for name, t in m.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape, dtype=torch.float64))  # fp64 -> fp32: full mantissa used
            else:
                t.copy_(0.2 * torch.randn(t.shape))
    return m


def tiny_model(**kw):
    m = randomize(model.GLM5(model.ModelConfig(**{**TINY, **kw}))).eval()
    # a bias whose fp32 value is not representable in bf16, so any bf16 trip through the file shows
    for moe in (x for x in m.modules() if isinstance(x, model.MoE)):
        b = moe.gate.e_score_correction_bias
        assert not torch.equal(b, b.to(torch.bfloat16).float())
    return m


def ids(vocab, T=7, B=2):
    return torch.randint(0, vocab, (B, T))


def shard_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


# --- an independent safetensors reader/writer (struct + json, nothing from weights.py) ---

ST_DTYPE = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
ST_NAME = {v: k for k, v in ST_DTYPE.items()}


def st_read_raw(path):
    """-> (header dict incl. __metadata__, header length n, whole file bytes)."""
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n].decode("utf-8")), n, blob


def st_tensor(path, name):
    header, n, blob = st_read_raw(path)
    info = header[name]
    b, e = info["data_offsets"]
    raw = bytearray(blob[8 + n + b : 8 + n + e])
    return (
        torch.frombuffer(raw, dtype=ST_DTYPE[info["dtype"]]).reshape(info["shape"])
        if raw
        else torch.empty(info["shape"], dtype=ST_DTYPE[info["dtype"]])
    )


def st_tensor_bytes(t):
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()  # little-endian on every machine torch runs here
    return t.numpy().tobytes()


def st_write(path, tensors, metadata=None, pad=True):
    """Write {name: tensor} as safetensors: u64 LE header length, JSON header, packed raw data."""
    header, chunks, off = {}, [], 0
    for name, t in tensors.items():
        data = st_tensor_bytes(t)
        header[name] = {
            "dtype": ST_NAME[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [off, off + len(data)],
        }
        chunks.append(data)
        off += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode("utf-8")
    if pad:
        h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)


def st_read_all(path):
    header, _, _ = st_read_raw(path)
    return {k: st_tensor(path, k).clone() for k in header if k != "__metadata__"}


def write_index(d, weight_map):
    total = 0
    for fname in set(weight_map.values()):
        header, _, _ = st_read_raw(os.path.join(d, fname))
        total += sum(
            v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"
        )
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def load_index(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)


def edit_shard(d, name_in_shard, fn, index_fn=None):
    """Rewrite the shard holding `name_in_shard` as fn(tensors dict) -> new dict (independent writer);
    index_fn(weight_map, fname) may edit the index too."""
    idx = load_index(d)
    fname = idx["weight_map"][name_in_shard]
    path = os.path.join(d, fname)
    tensors = fn(st_read_all(path))
    st_write(path, tensors, metadata={"format": "pt"})
    if index_fn is not None:
        index_fn(idx["weight_map"], fname)
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(idx, f)
    return fname


# --- the released names and shapes, generated from the released names alone ---


def spec_tensors(c):
    """{name: shape} for a GLM-5 checkpoint with config dict c (the MTP block at model.layers.{L + j})."""
    D, H, V = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    qr, kr = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    Hi, Di = c["index_n_heads"], c["index_head_dim"]
    E, mI, dI = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    L, K = c["num_hidden_layers"], c["first_k_dense_replace"]
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}

    def swiglu(p, inner):
        out.update(
            {
                f"{p}.gate_proj.weight": (inner, D),
                f"{p}.up_proj.weight": (inner, D),
                f"{p}.down_proj.weight": (D, inner),
            }
        )

    for i in range(L + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}"
        out.update(
            {
                f"{p}.input_layernorm.weight": (D,),
                f"{p}.post_attention_layernorm.weight": (D,),
                f"{p}.self_attn.q_a_proj.weight": (qr, D),
                f"{p}.self_attn.q_a_layernorm.weight": (qr,),
                f"{p}.self_attn.q_b_proj.weight": (H * (nope + rope), qr),
                f"{p}.self_attn.kv_a_proj_with_mqa.weight": (kr + rope, D),
                f"{p}.self_attn.kv_a_layernorm.weight": (kr,),
                f"{p}.self_attn.kv_b_proj.weight": (H * (nope + vd), kr),
                f"{p}.self_attn.o_proj.weight": (D, H * vd),
                f"{p}.self_attn.indexer.wq_b.weight": (Hi * Di, qr),
                f"{p}.self_attn.indexer.wk.weight": (Di, D),
                f"{p}.self_attn.indexer.k_norm.weight": (Di,),
                f"{p}.self_attn.indexer.k_norm.bias": (Di,),
                f"{p}.self_attn.indexer.weights_proj.weight": (Hi, D),
            }
        )
        if i < K:
            swiglu(f"{p}.mlp", dI)
        else:
            out[f"{p}.mlp.gate.weight"] = (E, D)
            out[f"{p}.mlp.gate.e_score_correction_bias"] = (E,)
            for e in range(E):
                swiglu(f"{p}.mlp.experts.{e}", mI)
            swiglu(f"{p}.mlp.shared_experts", mI * c.get("n_shared_experts", 1))
        if i >= L:  # the MTP block
            out.update(
                {
                    f"{p}.enorm.weight": (D,),
                    f"{p}.hnorm.weight": (D,),
                    f"{p}.eh_proj.weight": (D, 2 * D),
                    f"{p}.shared_head.norm.weight": (D,),
                }
            )
    return out


# -----------------------------------------------------------------------------
# 1. round trips


def test_roundtrip_float32_sharded_gives_identical_logits(tmp_path):
    m = tiny_model()
    x = ids(m.config.vocab_size)
    with torch.no_grad():
        want = m(x)
    d = str(tmp_path / "ckpt")
    total = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    weights.save_pretrained(m, d, dtype=torch.float32, max_shard_bytes=total // 5)
    files = shard_files(d)
    assert len(files) >= 3, files
    assert not [f for f in os.listdir(d) if f.endswith(".tmp")], "temporary files left behind"
    idx = load_index(d)
    assert set(idx["weight_map"].values()) == set(files)
    assert idx["metadata"]["total_size"] == total
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files), files

    loaded = weights.from_pretrained(d).eval()
    assert loaded.config == m.config
    sd, sd2 = m.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert sd2[k].dtype == sd[k].dtype and torch.equal(sd2[k], sd[k]), k
    with torch.no_grad():
        got = loaded(x)
    assert torch.equal(got, want)
    # the MTP block round trips too (its loss uses enorm/hnorm/eh_proj/shared_head)
    x2 = ids(m.config.vocab_size, T=9)
    with torch.no_grad():
        l1 = m(x2[:, :-1], x2[:, 1:])[1]["mtp"]
        l2 = loaded(x2[:, :-1], x2[:, 1:])[1]["mtp"]
    assert torch.equal(l1, l2)


def test_config_dict_roundtrip():
    cfg = model.ModelConfig(**{**TINY, "rope_theta": 12345.0, "dsa_mode": "dense", "num_mtp_steps": 2})
    d = weights.config_to_json(cfg)
    assert d["rope_parameters"] == {"rope_theta": 12345.0, "rope_type": "default"}
    assert "rope_theta" not in d
    assert weights.config_from_json(json.loads(json.dumps(d))) == cfg
    with pytest.raises(ValueError, match="scoring_func"):
        weights.config_from_json({**d, "scoring_func": "softmax"})


def test_roundtrip_bfloat16(tmp_path):
    m = tiny_model()
    d = str(tmp_path / "bf16")
    weights.save_pretrained(m, d, dtype=torch.bfloat16, max_shard_bytes=4000)
    assert len(shard_files(d)) >= 3
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"

    # in the files: everything BF16 except the router bias, which stays F32 with its exact fp32 value
    seen_bias = 0
    for fname in shard_files(d):
        header, _, _ = st_read_raw(os.path.join(d, fname))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name.endswith("e_score_correction_bias"):
                assert info["dtype"] == "F32", name
                seen_bias += 1
            else:
                assert info["dtype"] == "BF16", (name, info["dtype"])
    assert (
        seen_bias
        == m.config.num_hidden_layers - m.config.first_k_dense_replace + m.config.num_nextn_predict_layers
    )
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    path = os.path.join(d, load_index(d)["weight_map"][bias_name])
    assert torch.equal(st_tensor(path, bias_name), m.model.layers[1].mlp.gate.e_score_correction_bias)

    # the reference: the original with bf16 parameters, the router bias left fp32 as the file keeps it
    ref = copy.deepcopy(m)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    loaded = weights.from_pretrained(d, dtype=torch.bfloat16).eval()
    for (n, a), (n2, b) in zip(ref.state_dict().items(), loaded.state_dict().items()):
        assert n == n2 and a.dtype == b.dtype and torch.equal(a, b), n
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    x = ids(m.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(x), ref(x))

    # loading the bf16 file as fp32 gives the bf16 values exactly (and the fp32 bias untouched)
    as32 = weights.from_pretrained(d, dtype=torch.float32)
    for (n, a), b in zip(ref.state_dict().items(), as32.state_dict().values()):
        assert b.dtype == torch.float32 and torch.equal(a.float(), b), n


def test_from_pretrained_default_dtype_is_as_stored(tmp_path):
    """from_pretrained's docstring: dtype 'default: as stored'. A bf16 file loads as bf16 parameters."""
    m = tiny_model()
    d = str(tmp_path / "bf16")
    weights.save_pretrained(m, d, dtype=torch.bfloat16)
    loaded = weights.from_pretrained(d)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


# -----------------------------------------------------------------------------
# 2. the files are real safetensors with the released names


def test_files_are_safetensors_with_released_names(tmp_path):
    m = tiny_model()
    c = m.config
    d = str(tmp_path / "ckpt")
    weights.save_pretrained(m, d, dtype=torch.float32, max_shard_bytes=6000)
    files = shard_files(d)
    assert len(files) >= 3

    names = {}
    for fname in files:
        header, n, blob = st_read_raw(os.path.join(d, fname))
        assert blob[8:9] == b"{", "header must be a JSON object"
        assert (8 + n) % 8 == 0, "data should start 8-byte aligned, as the safetensors library writes it"
        meta = header.pop("__metadata__", {})
        assert all(isinstance(v, str) for v in meta.values())  # safetensors metadata is str -> str
        # offsets: packed, in order, covering the data region exactly
        spans = sorted(v["data_offsets"] for v in header.values())
        assert spans[0][0] == 0 and spans[-1][1] == len(blob) - 8 - n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for k, v in header.items():
            assert v["dtype"] in ST_DTYPE, (k, v)
            numel = 1
            for s in v["shape"]:
                numel *= s
            assert v["data_offsets"][1] - v["data_offsets"][0] == numel * ST_DTYPE[v["dtype"]].itemsize
            assert k not in names, f"{k} in two shards"
            names[k] = fname
    assert load_index(d)["weight_map"] == names

    # the names are exactly the released ones, shapes included
    spec = spec_tensors(weights.config_to_json(c))
    assert set(names) == set(spec), set(names) ^ set(spec)
    for k, fname in names.items():
        header, _, _ = st_read_raw(os.path.join(d, fname))
        assert tuple(header[k]["shape"]) == spec[k], k
    assert not [k for k in names if k.startswith("mtp_layers.")]
    for k in [
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.0.self_attn.indexer.k_norm.bias",
        "model.layers.3.enorm.weight",
        "model.layers.3.hnorm.weight",
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.norm.weight",
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
    ]:
        assert k in names, k

    # bytes in the file == the model's tensors, by hand parsing
    checks = {
        "model.layers.1.mlp.experts.3.down_proj.weight": expert_weight(m.model.layers[1].mlp, 3, "down_proj"),
        "model.layers.1.mlp.gate.e_score_correction_bias": m.model.layers[1].mlp.gate.e_score_correction_bias,
        "model.layers.0.self_attn.indexer.k_norm.bias": m.model.layers[0].self_attn.indexer.k_norm.bias,
        "model.layers.3.eh_proj.weight": m.mtp_layers[0].eh_proj.weight,
        "model.layers.3.shared_head.norm.weight": m.mtp_layers[0].shared_head.norm.weight,
        "model.layers.2.self_attn.kv_b_proj.weight": m.model.layers[2].self_attn.kv_b_proj.weight,
    }
    for k, t in checks.items():
        header, n, blob = st_read_raw(os.path.join(d, names[k]))
        b, e = header[k]["data_offsets"]
        assert blob[8 + n + b : 8 + n + e] == t.detach().contiguous().numpy().tobytes(), k

    with open(os.path.join(d, "config.json")) as f:
        cj = json.load(f)
    assert cj["rope_parameters"] == {"rope_theta": c.rope_theta, "rope_type": "default"}
    assert cj["num_nextn_predict_layers"] == 1
    assert cj["model_type"] == "glm_moe_dsa"
    assert cj["num_hidden_layers"] == 3 and cj["n_routed_experts"] == 4


def test_no_mtp_block(tmp_path):
    m = tiny_model(num_nextn_predict_layers=0)
    d = str(tmp_path / "nomtp")
    weights.save_pretrained(m, d, dtype=torch.float32)
    names = set(load_index(d)["weight_map"])
    assert not [k for k in names if k.startswith("model.layers.3.")]
    assert names == set(spec_tensors(weights.config_to_json(m.config)))
    loaded = weights.from_pretrained(d)
    assert len(loaded.mtp_layers) == 0
    x = ids(m.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(x), m(x))


# -----------------------------------------------------------------------------
# 3. a checkpoint laid out like the public GLM-5 release


PUBLIC = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "pad_token_id": 154820,
    "eos_token_id": [154820, 154827, 154829],
    "dtype": "bfloat16",
    "transformers_version": "5.0.0.dev0",
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "ep_size": 1,
    "use_cache": True,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 202752,
    "num_nextn_predict_layers": 1,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    # the real widths are 6144 / 64 heads / 256 experts; tiny ones here, the layer count as released
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "vocab_size": 211,
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "n_routed_experts": 3,
    "num_experts_per_tok": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4,
    "v_head_dim": 10,
    "head_dim": 4,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 3,
}


def write_public_checkpoint(d, cfg=PUBLIC):
    """The release's layout: config.json, bf16 tensors (fp32 router bias) in 2 shards + index json,
    the MTP block at model.layers.{L} with its redundant copies of the embedding and head."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    L = cfg["num_hidden_layers"]
    tensors = {}
    for name, shape in spec_tensors(cfg).items():
        if name.endswith("e_score_correction_bias"):
            t = 0.3 * torch.randn(shape, dtype=torch.float64).float()
        elif name.endswith("norm.weight"):
            t = (1 + 0.1 * torch.randn(shape)).to(torch.bfloat16)
        else:
            t = (0.1 * torch.randn(shape)).to(torch.bfloat16)
        tensors[name] = t
    if cfg["num_nextn_predict_layers"]:
        tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    names = list(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for fname, part in shards.items():
        st_write(os.path.join(d, fname), {k: tensors[k] for k in part}, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    write_index(d, weight_map)
    return tensors


def test_load_public_release_layout(tmp_path):
    d = str(tmp_path / "glm5")
    w = write_public_checkpoint(d)
    L = PUBLIC["num_hidden_layers"]
    assert f"model.layers.{L}.enorm.weight" in w and f"model.layers.{L}.mlp.experts.2.up_proj.weight" in w

    m = weights.from_pretrained(d, dtype=torch.float32).eval()
    c = m.config
    assert m.lm_head.weight.dtype == torch.float32
    assert c.num_hidden_layers == 78 and c.first_k_dense_replace == 3 and c.num_nextn_predict_layers == 1
    assert c.rope_theta == 1e6 and isinstance(c.rope_theta, float)
    assert c.eos_token_id == [154820, 154827, 154829]
    assert len(m.model.layers) == 78 and len(m.mtp_layers) == 1

    def same(param, name):
        assert torch.equal(param.detach().float(), w[name].float()), name

    same(m.mtp_layers[0].enorm.weight, f"model.layers.{L}.enorm.weight")
    same(m.mtp_layers[0].hnorm.weight, f"model.layers.{L}.hnorm.weight")
    same(m.mtp_layers[0].eh_proj.weight, f"model.layers.{L}.eh_proj.weight")
    same(m.mtp_layers[0].shared_head.norm.weight, f"model.layers.{L}.shared_head.norm.weight")
    mtp_moe = m.mtp_layers[0].mlp
    same(expert_weight(mtp_moe, 1, "down_proj"), f"model.layers.{L}.mlp.experts.1.down_proj.weight")
    same(m.mtp_layers[0].self_attn.kv_b_proj.weight, f"model.layers.{L}.self_attn.kv_b_proj.weight")
    same(expert_weight(m.model.layers[77].mlp, 2, "up_proj"), "model.layers.77.mlp.experts.2.up_proj.weight")
    same(
        m.model.layers[40].mlp.shared_experts.gate_proj.weight,
        "model.layers.40.mlp.shared_experts.gate_proj.weight",
    )
    same(m.model.layers[3].mlp.gate.weight, "model.layers.3.mlp.gate.weight")
    same(m.model.layers[2].mlp.down_proj.weight, "model.layers.2.mlp.down_proj.weight")
    same(m.model.layers[50].self_attn.kv_b_proj.weight, "model.layers.50.self_attn.kv_b_proj.weight")
    same(m.model.layers[0].self_attn.q_b_proj.weight, "model.layers.0.self_attn.q_b_proj.weight")
    same(m.model.layers[10].self_attn.indexer.k_norm.bias, "model.layers.10.self_attn.indexer.k_norm.bias")
    same(m.model.layers[10].self_attn.indexer.wq_b.weight, "model.layers.10.self_attn.indexer.wq_b.weight")
    same(m.model.embed_tokens.weight, "model.embed_tokens.weight")
    same(m.lm_head.weight, "lm_head.weight")
    same(m.model.norm.weight, "model.norm.weight")
    bias = m.model.layers[60].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(
        bias, w["model.layers.60.mlp.gate.e_score_correction_bias"]
    )
    assert torch.equal(
        m.mtp_layers[0].mlp.gate.e_score_correction_bias,
        w[f"model.layers.{L}.mlp.gate.e_score_correction_bias"],
    )
    # every tensor of the file landed (no parameter left as uninitialised memory)
    for n, t in weights.checkpoint_tensors(m.state_dict(), m.config.num_hidden_layers).items():
        assert torch.equal(t.float(), w[n].float()), n

    x = ids(c.vocab_size, T=6, B=1)
    with torch.no_grad():
        logits = m(x)
    assert logits.shape == (1, 6, c.vocab_size) and torch.isfinite(logits).all()

    # by default it loads in the stored dtype (config.json "dtype": "bfloat16"), values bit for bit, the
    # router bias fp32 (the bf16 forward is covered on the small model: on a CPU it is slow for 79 layers)
    mb = weights.from_pretrained(d, dsa_mode="dense")
    assert mb.config.dsa_mode == "dense"
    assert (
        mb.lm_head.weight.dtype == torch.bfloat16
        and mb.model.layers[77].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    )
    assert torch.equal(
        mb.model.layers[5].self_attn.kv_b_proj.weight, w["model.layers.5.self_attn.kv_b_proj.weight"]
    )
    assert mb.model.layers[5].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_public_layout_unpadded_header_loads(tmp_path):
    """Other writers may not pad the header to 8 bytes: data then starts at any byte offset."""
    cfg = {**PUBLIC, "num_hidden_layers": 2, "first_k_dense_replace": 1}
    d = str(tmp_path / "unpadded")
    w = write_public_checkpoint(d, cfg)
    for fname in shard_files(d):
        path = os.path.join(d, fname)
        tensors = st_read_all(path)
        for k in range(8):  # choose the metadata length so the header length is odd: bf16 data misaligned
            st_write(path, tensors, metadata={"format": "pt", "x": "y" * k}, pad=False)
            if st_read_raw(path)[1] % 2:
                break
        assert st_read_raw(path)[1] % 2 == 1
    m = weights.from_pretrained(d)
    for n, t in weights.checkpoint_tensors(m.state_dict(), m.config.num_hidden_layers).items():
        assert torch.equal(t.float(), w[n].float()), n


def test_old_config_with_top_level_rope_theta(tmp_path):
    m = tiny_model()
    d = str(tmp_path / "old")
    weights.save_pretrained(m, d, dtype=torch.float32)
    with open(os.path.join(d, "config.json")) as f:
        cj = json.load(f)
    del cj["rope_parameters"]
    cj["rope_theta"] = 54321
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cj, f)
    loaded = weights.from_pretrained(d).eval()
    assert loaded.config.rope_theta == 54321.0
    x = ids(m.config.vocab_size, T=9)
    with torch.no_grad():
        # theta reaches the forward: differs from the saved model's theta 1e4, equals a model with theta 54321
        assert not torch.allclose(loaded(x), m(x))
        m.config.rope_theta = 54321.0
        assert torch.equal(loaded(x), m(x))


def test_rope_parameters_wins_and_overrides_apply(tmp_path):
    m = tiny_model()
    d = str(tmp_path / "ck")
    weights.save_pretrained(m, d, dtype=torch.float32)
    assert weights.from_pretrained(d).config.rope_theta == 1e4
    assert weights.from_pretrained(d, rope_theta=500.0).config.rope_theta == 500.0
    assert weights.from_pretrained(d, dsa_mode="dense").config.dsa_mode == "dense"


# -----------------------------------------------------------------------------
# 4. broken checkpoints fail clearly


@pytest.fixture
def saved(tmp_path):
    m = tiny_model()
    d = str(tmp_path / "ckpt")
    weights.save_pretrained(m, d, dtype=torch.float32, max_shard_bytes=6000)
    assert len(shard_files(d)) >= 3
    return d


def set_config(d, **kv):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cj = json.load(f)
    cj.update(kv)
    with open(path, "w") as f:
        json.dump(cj, f)


def test_missing_config(saved):
    os.remove(os.path.join(saved, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        weights.from_pretrained(saved)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        weights.from_pretrained(str(tmp_path / "nowhere"))


def test_invalid_json_config(saved):
    with open(os.path.join(saved, "config.json"), "w") as f:
        f.write('{"vocab_size": 101, "hidden_size": ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        weights.from_pretrained(saved)


@pytest.mark.parametrize("where", ["data", "header", "length"])
def test_truncated_shard(saved, where):
    fname = shard_files(saved)[1]
    path = os.path.join(saved, fname)
    _, n, blob = st_read_raw(path)
    cut = {"data": len(blob) - 3, "header": 8 + n // 2, "length": 5}[where]
    with open(path, "wb") as f:
        f.write(blob[:cut])
    with pytest.raises(weights.CheckpointError, match=rf"{re.escape(fname)}.* is truncated"):
        weights.from_pretrained(saved)


def test_corrupt_header_json(saved):
    fname = shard_files(saved)[0]
    path = os.path.join(saved, fname)
    _, n, blob = st_read_raw(path)
    with open(path, "wb") as f:
        f.write(blob[:8] + b"#" + blob[9:])
    with pytest.raises(
        weights.CheckpointError, match=rf"{re.escape(fname)} has a corrupt safetensors header"
    ):
        weights.from_pretrained(saved)


def test_unsupported_dtype_and_bad_offsets(saved):
    name = "model.layers.2.self_attn.o_proj.weight"
    fname = load_index(saved)["weight_map"][name]
    path = os.path.join(saved, fname)
    header, n, blob = st_read_raw(path)

    def rewrite(h):
        hb = json.dumps(h, separators=(",", ":")).encode()
        hb += b" " * (n - len(hb))  # same length: the data stays where it was
        assert len(hb) == n
        with open(path, "wb") as f:
            f.write(blob[:8] + hb + blob[8 + n :])

    bad = copy.deepcopy(header)
    bad[name]["dtype"] = "Q4"
    rewrite(bad)
    with pytest.raises(weights.CheckpointError, match=rf"{re.escape(name)} has unsupported dtype 'Q4'"):
        weights.from_pretrained(saved)
    bad = copy.deepcopy(header)
    bad[name]["data_offsets"][1] -= 4
    rewrite(bad)
    with pytest.raises(
        weights.CheckpointError, match=rf"{re.escape(name)} has offsets .* do not fit its shape"
    ):
        weights.from_pretrained(saved)


def test_missing_tensor_still_in_index(saved):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    fname = edit_shard(saved, name, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(weights.CheckpointError, match=rf"{re.escape(fname)} lacks tensor {re.escape(name)}"):
        weights.from_pretrained(saved)


def test_missing_tensor_removed_from_index(saved):
    name = "model.layers.3.eh_proj.weight"
    edit_shard(
        saved, name, lambda t: {k: v for k, v in t.items() if k != name}, index_fn=lambda wm, f: wm.pop(name)
    )
    with pytest.raises(weights.CheckpointError, match=rf"lacks tensor {re.escape(name)} "):
        weights.from_pretrained(saved)


def test_missing_tensor_no_index(saved):
    """A directory of *.safetensors without an index json: the missing tensor is still named."""
    os.remove(os.path.join(saved, "model.safetensors.index.json"))
    assert weights.from_pretrained(saved) is not None  # loads without the index
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    path = None
    for f in shard_files(saved):
        if name in st_read_raw(os.path.join(saved, f))[0]:
            path = os.path.join(saved, f)
    t = st_read_all(path)
    del t[name]
    st_write(path, t)
    with pytest.raises(weights.CheckpointError, match=rf"lacks tensor {re.escape(name)} "):
        weights.from_pretrained(saved)


def test_wrong_shape(saved):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    fname = edit_shard(saved, name, lambda t: {k: (v[:-2] if k == name else v) for k, v in t.items()})
    want = (2 * (8 + 8), 8)
    got = (want[0] - 2, want[1])
    with pytest.raises(
        weights.CheckpointError,
        match=rf"{re.escape(name)} in {re.escape(fname)} has shape {re.escape(str(got))} "
        rf".*{re.escape(str(want))}",
    ):
        weights.from_pretrained(saved)


def test_wrong_shape_transposed(saved):
    name = "model.layers.1.mlp.experts.0.down_proj.weight"  # (32, 8) stored as (8, 32)
    edit_shard(saved, name, lambda t: {k: (v.t().contiguous() if k == name else v) for k, v in t.items()})
    with pytest.raises(weights.CheckpointError, match=rf"{re.escape(name)} .*\(8, 32\).*\(32, 8\)"):
        weights.from_pretrained(saved)


def test_extra_tensor(saved):
    extra = "model.layers.1.mlp.experts.4.up_proj.weight"  # an expert the config (4 experts) does not have
    anchor = "model.layers.1.mlp.experts.3.up_proj.weight"
    edit_shard(
        saved,
        anchor,
        lambda t: {**t, extra: t[anchor].clone()},
        index_fn=lambda wm, f: wm.__setitem__(extra, f),
    )
    with pytest.raises(
        weights.CheckpointError, match=rf"tensor {re.escape(extra)}, which config.json does not describe"
    ):
        weights.from_pretrained(saved)


def test_extra_tensor_in_shard_but_not_in_index(saved):
    """A shard holding a tensor its index json does not list is an inconsistent checkpoint: it must not be
    silently ignored (the loader docstring: checked against the index json)."""
    extra = "model.layers.9.mlp.gate.weight"
    anchor = "model.layers.1.mlp.gate.weight"
    edit_shard(saved, anchor, lambda t: {**t, extra: t[anchor].clone()})
    with pytest.raises(weights.CheckpointError, match=re.escape(extra)):
        weights.from_pretrained(saved)


def test_more_experts_in_config_than_in_files(saved):
    set_config(saved, n_routed_experts=5)
    with pytest.raises(weights.CheckpointError, match=r"mlp\.(gate|experts)"):
        weights.from_pretrained(saved)


def test_index_points_at_missing_shard(saved):
    fname = shard_files(saved)[-1]
    os.remove(os.path.join(saved, fname))
    with pytest.raises(weights.CheckpointError, match=rf"{re.escape(fname)} does not exist"):
        weights.from_pretrained(saved)


def test_invalid_index_json(saved):
    with open(os.path.join(saved, "model.safetensors.index.json"), "w") as f:
        f.write('{"metadata": {}, "weight_map": {')
    with pytest.raises(weights.CheckpointError, match="not a valid safetensors index"):
        weights.from_pretrained(saved)


def test_no_safetensors_at_all(saved):
    for f in os.listdir(saved):
        if f != "config.json":
            os.remove(os.path.join(saved, f))
    with pytest.raises(weights.CheckpointError, match=r"no \*\.safetensors files"):
        weights.from_pretrained(saved)


@pytest.mark.parametrize(
    "key,value",
    [
        ("scoring_func", "softmax"),
        ("topk_method", "greedy"),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("moe_layer_freq", 2),
    ],
)
def test_unsupported_config_values(saved, key, value):
    set_config(saved, **{key: value})
    with pytest.raises(ValueError, match=rf"{key} = {re.escape(repr(value))} is not supported"):
        weights.from_pretrained(saved)


def test_yarn_rope_rejected(saved):
    set_config(saved, rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope type 'yarn'.*not supported"):
        weights.from_pretrained(saved)


def test_legacy_yarn_rope_scaling_rejected(saved):
    """Older configs (DeepSeek-V3 style) write rope_scaling with the legacy key "type" instead of "rope_type";
    transformers reads "type" as the rope type. YaRN in that spelling must not load as plain RoPE."""
    with open(os.path.join(saved, "config.json")) as f:
        cj = json.load(f)
    del cj["rope_parameters"]
    cj["rope_theta"] = 10000.0
    cj["rope_scaling"] = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    with open(os.path.join(saved, "config.json"), "w") as f:
        json.dump(cj, f)
    with pytest.raises(ValueError, match=r"yarn"):
        weights.from_pretrained(saved)


def test_null_q_lora_rank_rejected(saved):
    set_config(saved, q_lora_rank=None)
    with pytest.raises(ValueError, match="q_lora_rank"):
        weights.from_pretrained(saved)


# -----------------------------------------------------------------------------
# 5. SafeFile: memory-mapped, and strict about garbage


def test_safefile_get(tmp_path):
    path = str(tmp_path / "a.safetensors")
    ts = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.randint(-9, 9, (2, 2)),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }
    st_write(path, ts, metadata={"format": "pt"}, pad=False)
    f = weights.SafeFile(path)
    assert sorted(f.keys()) == sorted(ts)
    assert f.metadata == {"format": "pt"}
    for k, t in ts.items():
        g = f.get(k)
        assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t), k

    # the round trip of weights.save_file through the independent reader
    path2 = str(tmp_path / "b.safetensors")
    weights.save_file(ts, path2, metadata={"k": 1})
    assert st_read_raw(path2)[0]["__metadata__"] == {"k": "1"}
    for k, t in ts.items():
        assert torch.equal(st_tensor(path2, k), t), k


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc to see the mapping")
def test_safefile_is_memory_mapped(tmp_path):
    """A tensor from SafeFile.get lives in a mapping of the file (not a copy), only the touched pages are
    read, and writing to it does not change the file (copy-on-write)."""
    path = str(tmp_path / "big.safetensors")
    big = 1 << 30  # a 1 GiB tensor, written as a sparse file: nothing is actually stored
    small = torch.randn(4, 4)
    header = {
        "small": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
        "big": {"dtype": "F32", "shape": [big // 4], "data_offsets": [64, 64 + big]},
    }
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + st_tensor_bytes(small))
        fh.truncate(8 + len(h) + 64 + big)

    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    f = weights.SafeFile(path)
    got = f.get("small")
    assert torch.equal(got, small)
    b = f.get("big")
    assert b.shape == (big // 4,) and b[:1000].abs().sum() == 0 and b[-10:].abs().sum() == 0
    assert rss() - before < 200 * 2**20, "SafeFile read far more than the touched pages"

    # the tensor's memory is inside a mapping of this file
    ptr = got.data_ptr()
    real = os.path.realpath(path)
    inside = False
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                inside |= lo <= ptr < hi
    assert inside, "SafeFile.get did not return a view into a memory map of the file"

    # copy-on-write: writing into the returned tensor leaves the file alone
    got.mul_(0).add_(7)
    assert torch.equal(weights.SafeFile(path).get("small"), small)
    del f, got, b


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00" * 3,
        b"\xff" * 8,
        b"garbage!",
        struct.pack("<Q", 0),
        struct.pack("<Q", 4) + b"nope",
        struct.pack("<Q", 2) + b"[]",
    ],
)
def test_safefile_garbage(tmp_path, content):
    path = str(tmp_path / "bad.safetensors")
    with open(path, "wb") as fh:
        fh.write(content)
    with pytest.raises(weights.CheckpointError, match=re.escape(path)):
        weights.SafeFile(path)


def test_safefile_missing(tmp_path):
    path = str(tmp_path / "none.safetensors")
    with pytest.raises(weights.CheckpointError, match="does not exist"):
        weights.SafeFile(path)


def test_misspelled_override_is_an_error(saved):
    with pytest.raises(TypeError, match=r"unknown config override 'dsa_mod'; did you mean 'dsa_mode'"):
        weights.from_pretrained(saved, dsa_mod="dense")


def test_same_tensor_in_two_unindexed_shards_is_an_error(tmp_path):
    d = str(tmp_path / "dup")
    os.makedirs(d)
    t = torch.randn(3)
    weights.save_file({"a": t, "b": t}, os.path.join(d, "one.safetensors"))
    weights.save_file({"b": t}, os.path.join(d, "two.safetensors"))
    with pytest.raises(
        weights.CheckpointError, match=r"tensor b is in both one.safetensors and two.safetensors"
    ):
        weights.open_checkpoint(d)
