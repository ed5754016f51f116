"""quantize.py and quantized.py: the INT4 words on a hand-made example, quantize/dequantize within half a
step, the Hadamard rotation exact in float64 (logits and MTP loss of the rotated model equal the original's),
the quantized Linear and Experts equal to dequantize-then-matmul, a written checkpoint's names, dtypes,
shapes and quantization_config, the load -> serve round trip over HTTP, streaming that holds one shard at a
time, and one sentence naming the field for every unsupported or corrupt config.
Run: python -m pytest -q tests/test_quantize.py"""

import copy
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import requests
import torch
import torch.nn.functional as F

import engine
import kernels_quant
import model
import quantize
import quantized
import serve
import weights
from conftest import randomize, tiny_config
from test_engine import ckpt  # noqa: F401 (a fixture: a tiny float64 checkpoint and its tokenizer)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return randomize(model.GLM5(tiny_config()).double(), seed=1).eval()


@pytest.fixture(scope="module")
def source(tiny_model, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("src"))
    weights.save_pretrained(tiny_model, d, dtype=torch.float32)
    return d


def written(source, tmp_path_factory, **kw):
    out = str(tmp_path_factory.mktemp("q"))
    summary = quantize.quantize_checkpoint(source, out, log=lambda *a: None, **kw)
    return out, summary


def read_all(directory):
    tensors = {}
    for fname, names in weights.open_checkpoint(directory).items():
        f = weights.SafeFile(os.path.join(directory, fname))
        tensors.update({n: f.get(n) for n in names})
    with open(os.path.join(directory, "config.json")) as f:
        return tensors, json.load(f)


def dequantize(q, scale):
    """q (N, K), scale (N, G) -> the float64 weight: kernels_quant's, with the group size the scale
    implies."""
    return kernels_quant.dequantize(q, scale, q.shape[1] // scale.shape[-1])


# -----------------------------------------------------------------------------
# Weights: packing order, half a step


def test_int4_words_on_a_hand_made_row():
    # scale 1.875 / 7.5 = 0.25 exactly; -1.875 / 0.25 = -7.5 rounds (half to even) to -8, the INT4 minimum
    w = torch.tensor([[-1.875, -1.5, 0.0, 0.25, 0.5, 1.75, -0.25, 0.75, 1.25, -0.75]])  # K = 10: one pad word
    out = quantize.quantized_tensors("m", w, 4, None, torch.bfloat16)
    q = [-8, -6, 0, 1, 2, 7, -1, 3, 5, -3]
    nibbles = [v + 8 for v in q] + [0] * 6  # stored as value + 8, the row zero-padded to 16
    words = []
    for j in range(2):
        v = sum(nibbles[8 * j + i] << (4 * i) for i in range(8))  # the first value in the lowest 4 bits
        words.append(v - 2**32 if v >= 2**31 else v)
    assert out["m.weight_packed"].dtype == torch.int32 and out["m.weight_packed"].tolist() == [words]
    assert out["m.weight_scale"].dtype == torch.bfloat16 and out["m.weight_scale"].tolist() == [[0.25]]
    assert out["m.weight_shape"].dtype == torch.int64 and out["m.weight_shape"].tolist() == [1, 10]
    assert kernels_quant.unpack_int4(out["m.weight_packed"], 10).tolist() == [q]
    assert set(out) == {"m.weight_packed", "m.weight_scale", "m.weight_shape"}  # no zero point


@pytest.mark.parametrize("bits,group_size", [(4, None), (4, 16), (8, None), (8, 32)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantized_within_half_a_step(bits, group_size, scale_dtype):
    torch.manual_seed(0)  # the draw was the global RNG's: another test file before it once made it fail
    w = torch.randn(48, 96, dtype=torch.float64) * torch.rand(48, 1, dtype=torch.float64)
    w[3, 5] = 40.0  # an outlier sets its row's (or group's) scale
    w[7] = 0.0  # an all-zero row: the eps floor, no division by zero
    q, scale = quantize.quantize_weight(w, bits, group_size, scale_dtype)
    assert q.dtype == torch.int8 and scale.dtype == scale_dtype
    assert scale.shape == (48, 96 // group_size if group_size else 1)
    assert q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    step = scale.double().repeat_interleave(96 // scale.shape[1], dim=1)  # (48, 96) each value's step
    err = (dequantize(q, scale).double() - w).abs()
    assert (err <= step / 2 + 1e-6 * w.abs()).all(), (err / step).max()  # (+ the fp32 product's rounding)
    # the rule: max|w| / 7.5 (or / 127.5), rounded to the stored dtype (up by one ulp at most; a scale
    # below the dtype's smallest normal, as a row's scale of 2e-6 is in fp16, has the subnormals' fixed ulp)
    rule = w.abs().view(48, scale.shape[1], -1).amax(-1) / ((2**bits - 1) / 2)
    assert (scale.double() >= rule.clamp_min(torch.finfo(torch.float32).eps) * (1 - 1e-7)).all()
    info = torch.finfo(scale_dtype)
    subnormal_ulp = info.tiny * info.eps
    floored = rule.clamp_min(torch.finfo(torch.float32).eps)
    assert torch.allclose(scale.double(), floored, rtol=2**-7, atol=subnormal_ulp)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="--group_size 7 does not divide the input size 96"):
        quantize.quantize_weight(torch.randn(4, 96), 4, 7)


# -----------------------------------------------------------------------------
# QuaRot: exact before quantization


@pytest.mark.parametrize("n", [16, 48, 384, 20])  # 384 = 12 * 32, the form of GLM-5's 6144
def test_rotation_is_orthogonal(n):
    Q = quantize.rotation(n, seed=3)
    assert torch.allclose(Q @ Q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    if n != 20:  # a Hadamard: every entry +-1/sqrt(n), spreading each channel over all of them
        assert torch.allclose(Q.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


def test_rotated_model_computes_the_same_function_in_float64(tiny_model):
    x = torch.randint(0, 97, (2, 14))
    rotated = quantize.rotate_model(tiny_model, seed=5)
    a, b = tiny_model(x), rotated(x)
    assert (a - b).abs().max() < 1e-10
    _, la = tiny_model(x, targets=x, mtp_weight=1.0)
    _, lb = rotated(x, targets=x, mtp_weight=1.0)
    assert abs(la["mtp"].item() - lb["mtp"].item()) < 1e-10  # the MTP head too (MTPHeadNorm)
    # it did rotate: the embeddings and every reader changed, the residual norms became 1
    assert not torch.allclose(rotated.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)
    assert torch.equal(rotated.model.layers[1].input_layernorm.weight, torch.ones(48, dtype=torch.float64))
    # the outlier statistics run on both
    stats = quantize.outlier_stats(rotated, [x])
    assert set(stats) == {"layer 0", "layer 1", "layer 2", "mtp 0"} and stats["layer 1"]["mlp_in"][1] > 0


def test_rotated_checkpoint_streams_the_same_rotation(tiny_model, source, tmp_path_factory):
    """quantize_checkpoint rotates tensor by tensor; loaded with W8A8 on every weight, the rotated model's
    loss stays close to the original's (exactness itself is the test above)."""
    x = torch.randint(0, 97, (2, 14))
    out, _ = written(source, tmp_path_factory, scheme="w8a8", rotate=True, dtype=torch.float32)
    q = quantized.from_pretrained(out, dtype=torch.float64)
    _, la = tiny_model(x, targets=x, mtp_weight=1.0)
    _, lb = q(x, targets=x, mtp_weight=1.0)
    assert abs(la["lm"].item() - lb["lm"].item()) < 0.1 and abs(la["mtp"].item() - lb["mtp"].item()) < 0.1
    assert isinstance(q.mtp_layers[0].shared_head.norm, quantized.MTPHeadNorm)


# -----------------------------------------------------------------------------
# The quantized modules equal dequantize-then-matmul


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, None), (4, 16)])
def test_quant_linear_is_dequantize_then_matmul(bits, group_size):
    K, N = 64, 24
    w = torch.randn(N, K)
    x = torch.randn(3, 5, K)
    q, scale = quantize.quantize_weight(w, bits, group_size, torch.float32)
    lin = quantized.QuantLinear(K, N, bits, scale.shape[1], torch.float32)
    parts = quantize.quantized_tensors("m", w, bits, group_size, torch.float32)
    lin.load_state_dict({k[2:]: v for k, v in parts.items() if not k.endswith("weight_shape")})
    xq, xs = kernels_quant.quantize_activations(x)
    ref = F.linear(xq.double() * xs.double(), dequantize(q, scale).double())
    assert torch.allclose(lin(x).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,group_size", [(4, None), (4, 8), (8, None)])
def test_quant_experts_are_dequantize_then_matmul(bits, group_size):
    E, D, Fh = 4, 32, 16
    ref_experts = model.experts.Experts(E, D, Fh)
    ref_experts.init_weights(0.1)
    qe = quantized.QuantExperts(E, D, Fh, bits, group_size, torch.float32)
    views = qe.per_expert_state("x.experts.")
    deq = {}
    stacked = dict(ref_experts.named_parameters(prefix="x.experts"))
    for name, w in model.experts.per_expert_state(stacked).items():
        module = name[: -len(".weight")]
        for k, v in quantize.quantized_tensors(module, w.detach(), bits, group_size, torch.float32).items():
            if not k.endswith("weight_shape"):
                views[k].copy_(v)
        deq[module] = dequantize(
            *quantize.quantize_weight(w.detach(), bits, group_size, torch.float32)
        )
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, D)
    outs = []
    for e, x_e in enumerate(x.split(counts.tolist())):  # dequantized weights, fake-quantized activations
        xq, xs = kernels_quant.quantize_activations(x_e)
        gate = F.linear(xq.double() * xs.double(), deq[f"x.experts.{e}.gate_proj"].double())
        up = F.linear(xq.double() * xs.double(), deq[f"x.experts.{e}.up_proj"].double())
        h = (F.silu(gate) * up).float()
        hq, hs = kernels_quant.quantize_activations(h)
        outs.append(F.linear(hq.double() * hs.double(), deq[f"x.experts.{e}.down_proj"].double()))
    assert torch.allclose(qe(x, counts).double(), torch.cat(outs), rtol=1e-4, atol=1e-5)


# -----------------------------------------------------------------------------
# The checkpoint on disk


@pytest.mark.parametrize("group_size", [None, 16])
def test_written_checkpoint_follows_compressed_tensors(source, tmp_path_factory, group_size):
    out, _ = written(source, tmp_path_factory, group_size=group_size)
    t, config = read_all(out)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    assert qc["quantization_status"] == "compressed" and qc["kv_cache_scheme"] is None
    int4, int8 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    assert int4["format"] == "pack-quantized" and int8["format"] == "int-quantized"
    w4 = int4["weights"]
    assert (w4["num_bits"], w4["type"], w4["symmetric"], w4["dynamic"]) == (4, "int", True, False)
    assert (w4["strategy"], w4["group_size"]) == (("group", 16) if group_size else ("channel", None))
    assert (int8["weights"]["num_bits"], int8["weights"]["strategy"]) == (8, "channel")
    for g in (int4, int8):
        a = g["input_activations"]
        assert (a["num_bits"], a["type"], a["symmetric"], a["strategy"], a["dynamic"]) == (
            8,
            "int",
            True,
            "token",
            True,
        )
        assert g["output_activations"] is None
    # the experts of every MoE layer, the MTP layer (layer 3) included, match the INT4 regex
    mtp_expert = "model.layers.3.mlp.experts.7.down_proj"
    assert any(quantized.matches(p, mtp_expert) for p in int4["targets"])
    assert not any(quantized.matches(p, mtp_expert) for p in int8["targets"])
    assert all(p.startswith("re:") for p in int4["targets"] + int8["targets"])
    for kept in (
        "lm_head",
        "model.embed_tokens",
        "model.layers.1.mlp.gate",
        "model.layers.2.self_attn.q_a_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.self_attn.kv_b_proj",
        "model.layers.3.self_attn.indexer.wk",
        "model.layers.3.self_attn.indexer.weights_proj",
    ):
        assert kept in qc["ignore"]
        assert t[kept + ".weight"].dtype == torch.bfloat16
    # INT4 experts: packed words, scales in the weights' dtype, the shape; no zero points, no input scales
    e = "model.layers.3.mlp.experts.5.gate_proj"
    assert t[e + ".weight_packed"].dtype == torch.int32 and t[e + ".weight_packed"].shape == (16, 6)
    assert t[e + ".weight_scale"].dtype == torch.bfloat16
    assert t[e + ".weight_scale"].shape == ((16, 3) if group_size else (16, 1))
    assert t[e + ".weight_shape"].dtype == torch.int64 and t[e + ".weight_shape"].tolist() == [16, 48]
    assert not any(re.search(r"zero_point|input_scale|g_idx", n) for n in t)
    # INT8: weight int8 [out, in] and a per-channel scale
    o = "model.layers.1.self_attn.o_proj"
    assert t[o + ".weight"].dtype == torch.int8 and t[o + ".weight"].shape == (48, 60)
    assert t[o + ".weight_scale"].shape == (48, 1) and t[o + ".weight_scale"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # the words decode to the quantized weight of the source
    src, _ = read_all(source)
    q, _ = quantize.quantize_weight(src[e + ".weight"], 4, group_size, torch.bfloat16)
    assert torch.equal(kernels_quant.unpack_int4(t[e + ".weight_packed"], 48), q)


def test_dry_run_counts_a_quarter_for_int4_experts(capsys):
    cfg = tiny_config()
    bf16, experts_bf16 = quantize.planned_bytes(cfg, None)
    w4, experts_w4 = quantize.planned_bytes(cfg, "w4a8")
    assert experts_bf16 / 4 < experts_w4 < experts_bf16 / 4 * 1.3  # a quarter plus scales and shapes
    assert w4 < quantize.planned_bytes(cfg, "w8a8")[0] < bf16
    quantize.dry_run(cfg, 16)
    assert "W4A8 group 16" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# Save, load, serve


def test_quantized_checkpoint_serves_over_http(ckpt, tmp_path_factory):  # noqa: F811 (the fixture)
    out, _ = written(ckpt[0], tmp_path_factory, rotate=True)  # test_engine's tiny model and tokenizer
    m = engine.load_model(out, dtype=torch.float64)  # the path serve.py --ckpt takes
    assert any(isinstance(x, quantized.QuantExperts) for x in m.modules())
    eng = engine.Engine(m, ckpt[1], num_pages=32, page_size=4)
    srv, stop = serve.make_server(eng, port=0, model_name="w4a8")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        r = requests.post(
            url + "/v1/completions",
            json={
                "prompt": [5, 6, 7, 8],
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        ).json()
        got = r["choices"][0]["token_ids"]
    finally:
        stop.set()
        srv.shutdown()
    ids = [5, 6, 7, 8]
    with torch.no_grad():  # greedy over the full forward of the same quantized model
        for _ in range(6):
            ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[4:]
    # an RL weight push to a quantized replica is refused before anything is read, the weights untouched
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="quantized .* takes no weight updates"):
        eng.update_weights(str(tmp_path_factory.mktemp("push")), 1)
    assert eng.version == 0 and all(torch.equal(before[k], v) for k, v in m.state_dict().items())


# -----------------------------------------------------------------------------
# Streaming


def test_streaming_holds_one_shard(tmp_path):
    """A checkpoint in many shards: each output shard is written before the next input is read, so what is
    held at once is one shard's worth (the summary counts it; a subprocess's peak RSS checks it)."""
    torch.manual_seed(0)
    cfg = tiny_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=16, num_hidden_layers=3)
    m = model.GLM5(cfg)
    src = str(tmp_path / "src")
    weights.save_pretrained(m, src, dtype=torch.float32, max_shard_bytes=4 * 2**20)
    shards = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    total = sum(os.path.getsize(os.path.join(src, f)) for f in shards)
    assert len(shards) >= 8
    code = (
        "import resource, sys, torch, quantize;"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
        "s = quantize.quantize_checkpoint(sys.argv[1], sys.argv[2], dtype=torch.float32, "
        "log=lambda *a: None);"
        "print(s['peak_bytes'], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, src, str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr
    peak_held, rss_growth = map(int, res.stdout.split())
    assert peak_held <= 5 * 2**20  # one output shard at most (quantized: smaller than its input)
    assert rss_growth < total / 2, (rss_growth, total)  # far from the whole checkpoint in memory


# -----------------------------------------------------------------------------
# Bad configs: one sentence naming the field


def mutate(qc, field, value):
    qc = copy.deepcopy(qc)
    keys = field.split(".")
    d = qc
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value
    return qc


BAD = [
    ("quant_method", "gptq", "quantization_config.quant_method = 'gptq'"),
    ("format", "nvfp4-pack-quantized", "quantization_config.format"),
    ("quantization_status", "frozen", "quantization_config.quantization_status"),
    ("kv_cache_scheme", {"num_bits": 8}, "quantization_config.kv_cache_scheme"),
    ("config_groups", {}, "quantization_config.config_groups"),
    ("ignore", "lm_head", "quantization_config.ignore"),
    ("config_groups.group_0.format", "marlin-24", "config_groups.group_0.format"),
    ("config_groups.group_0.targets", "Linear", "config_groups.group_0.targets"),
    ("config_groups.group_0.weights.num_bits", 8, "config_groups.group_0.weights.num_bits"),
    ("config_groups.group_0.weights.symmetric", False, "config_groups.group_0.weights.symmetric"),
    ("config_groups.group_0.weights.strategy", "tensor", "config_groups.group_0.weights.strategy"),
    ("config_groups.group_0.weights.type", "float", "config_groups.group_0.weights.type"),
    ("config_groups.group_1.weights.strategy", "group", "config_groups.group_1.weights.strategy"),
    ("config_groups.group_1.input_activations", None, "config_groups.group_1.input_activations"),
    ("config_groups.group_1.input_activations.dynamic", False, "input_activations.dynamic"),
    ("config_groups.group_1.input_activations.strategy", "tensor", "input_activations.strategy"),
    ("config_groups.group_1.output_activations", {"num_bits": 8}, "group_1.output_activations"),
]


@pytest.mark.parametrize("field,value,message", BAD)
def test_unsupported_config_names_the_field(source, tmp_path_factory, field, value, message):
    out, _ = written(source, tmp_path_factory)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = mutate(config["quantization_config"], field, value)
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        engine.load_model(out)
    assert str(e.value).count("\n") == 0 and str(e.value).startswith(path)


def test_corrupt_tensors_and_wrong_loaders_get_a_sentence(source, tmp_path_factory):
    out, _ = written(source, tmp_path_factory, group_size=16)
    with pytest.raises(ValueError, match="quantized.from_pretrained"):
        weights.from_pretrained(out)  # the BF16 loader points to the quantized one
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    bad = mutate(config["quantization_config"], "config_groups.group_0.weights.group_size", 5)
    with open(cfg_path, "w") as f:
        json.dump({**config, "quantization_config": bad}, f)
    with pytest.raises(ValueError, match="group_size 5 does not divide"):
        quantized.from_pretrained(out)
    with open(cfg_path, "w") as f:
        json.dump(config, f)
    # a packed weight stored with the wrong dtype
    t, _ = read_all(out)
    fname = os.path.join(out, "model-00001-of-00001.safetensors")
    t = {n: v.clone() for n, v in t.items()}
    t["model.layers.1.mlp.experts.0.up_proj.weight_packed"] = t[
        "model.layers.1.mlp.experts.0.up_proj.weight_packed"
    ].to(torch.int64)
    weights.save_file(t, fname)
    with pytest.raises(
        weights.CheckpointError, match="experts.0.up_proj.weight_packed .* must be torch.int32"
    ):
        quantized.from_pretrained(out)
    del t["model.layers.1.mlp.experts.0.up_proj.weight_packed"]
    weights.save_file(t, fname)
    with pytest.raises(weights.CheckpointError):  # the index and the shard disagree, or it is missing
        quantized.from_pretrained(out)
    # the FP8 release's config is refused by the BF16 loader's config reader, naming quant_method
    with pytest.raises(ValueError, match="quant_method = 'fp8'"):
        weights.config_from_json({**config, "quantization_config": {"quant_method": "fp8"}})


def test_mtp_head_norm_maps_any_head_onto_lm_head():
    # a release's own MTP head, H_mtp = H A with A not symmetric (quantize.py's rotations give a symmetric
    # A, which would hide a transposed map): lm_head(MTPHeadNorm(x)) must equal H_mtp RMSNorm(x)
    torch.manual_seed(0)
    V, D = 40, 8
    H = torch.randn(V, D, dtype=torch.float64)
    A = torch.randn(D, D, dtype=torch.float64)
    assert (A - A.T).abs().max() > 0.1
    norm = torch.nn.RMSNorm(D, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, dtype=torch.float64) + 0.5)
    m = quantized.MTPHeadNorm.from_heads(norm, H, H @ A)
    x = torch.randn(3, D, dtype=torch.float64)
    want = norm(x) @ (H @ A).T
    assert torch.allclose(m(x) @ H.T, want, atol=1e-10)
