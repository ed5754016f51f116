"""
An independent float64 reference of the GLM-5 forward pass, written from the GLM-5 report (section 2),
the DeepSeek-V3/V3.2 reports and the released config.json alone, and the checks that the project's
model (model.py + mla.py + dsa.py) computes the same logits and MTP loss.

The reference reads a flat {checkpoint name: tensor} dict (names exactly as released; the MTP block
is `model.layers.{num_hidden_layers}.*`) and uses nothing from the project but its public API
(ModelConfig, GLM5, forward, weights.checkpoint_tensors). Every weight is random, norms, LayerNorm bias
and the router's e_score_correction_bias included, with a fresh seed per run; the seed is in every
assert message so a failure can be replayed by setting SEED below.

    python -m pytest -q tests/test_reference.py
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402
import weights  # noqa: E402

SEED = None  # set to an int to replay a failing run; None draws a fresh seed for each test
F64 = torch.float64
# q_a_layernorm / kv_a_layernorm (the published reference); the other RMSNorms use rms_norm_eps
LAT_EPS = 1e-6
LN_EPS = 1e-6  # indexer k_norm (LayerNorm with weight and bias)

# -----------------------------------------------------------------------------
# The reference: plain float64 functions over a checkpoint-name dict


def lin(W, name, x):
    return x @ W[name + ".weight"].T


def rms_norm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rope(x, theta, style="interleaved"):
    """x (B, T, ..., d): rotate pair i of position t by t * theta^(-2i/d). 'interleaved' pairs
    (x[2i], x[2i+1]) (GLM-5); 'half' pairs (x[i], x[i + d/2]) exists only for the adversarial test."""
    T, d = x.shape[1], x.shape[-1]
    ang = torch.arange(T, dtype=F64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=F64) / d)  # (T, d/2)
    ang = ang.view(T, *([1] * (x.dim() - 3)), d // 2)
    cos, sin = ang.cos(), ang.sin()
    if style == "interleaved":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


def indexer_selection(W, p, c, x, q_lat, opt):
    """DSA (DeepSeek-V3.2 report): boolean (B, T, S), True where query t keeps key s: the top
    min(index_topk, t+1) causal keys by the lightning-indexer score, ties broken towards the lower key
    index."""
    B, T, _ = x.shape
    nh, hd, dr = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
    q = lin(W, p + "wq_b", q_lat).view(B, T, nh, hd)
    q = torch.cat([rope(q[..., :dr], c.rope_theta, opt["rope"]), q[..., dr:]], dim=-1)
    k = layer_norm(lin(W, p + "wk", x), W[p + "k_norm.weight"], W[p + "k_norm.bias"], LN_EPS)
    k = torch.cat([rope(k[..., :dr], c.rope_theta, opt["rope"]), k[..., dr:]], dim=-1)  # (B, S, hd)
    w = lin(W, p + "weights_proj", x) * nh**-0.5  # (B, T, nh)
    dots = torch.relu(torch.einsum("btjd,bsd->btjs", q, k) * hd**-0.5)
    I = (w[..., None] * dots).sum(dim=2)  # (B, T, S)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    I = I.masked_fill(~causal, float("-inf"))
    if opt["ties"] == "low":  # stable sort: equal scores (ReLU makes exact zeros common) keep index order
        order = torch.sort(I, dim=-1, descending=True, stable=True).indices
    else:  # "high": the wrong tie-break, for the adversarial test
        order = T - 1 - torch.sort(I.flip(-1), dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T).expand_as(order))
    k_t = torch.clamp(torch.arange(T) + 1, max=c.index_topk)  # min(index_topk, visible)
    return (rank < k_t[:, None]) & causal


def mla(W, p, c, x, sparse, opt):
    """MLA in its MHA form, with the DSA selection when sparse."""
    B, T, _ = x.shape
    H, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q_lat = rms_norm(lin(W, p + "q_a_proj", x), W[p + "q_a_layernorm.weight"], opt["lat_eps"])
    q_nope, q_pe = lin(W, p + "q_b_proj", q_lat).view(B, T, H, dn + dr).split([dn, dr], dim=-1)
    q_pe = rope(q_pe, c.rope_theta, opt["rope"])
    c_kv, k_pe = lin(W, p + "kv_a_proj_with_mqa", x).split([c.kv_lora_rank, dr], dim=-1)
    c_kv = rms_norm(c_kv, W[p + "kv_a_layernorm.weight"], opt["lat_eps"])
    k_pe = rope(k_pe, c.rope_theta, opt["rope"])  # (B, S, dr), one key shared by all heads
    k_nope, v = lin(W, p + "kv_b_proj", c_kv).view(B, T, H, dn + dv).split([dn, dv], dim=-1)
    scores = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
    scores = scores * (dn + dr) ** -0.5
    keep = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if sparse:
        keep = keep & indexer_selection(W, p + "indexer.", c, x, q_lat, opt)
    probs = scores.masked_fill(~keep[:, None], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * dv)
    return lin(W, p + "o_proj", out)


def swiglu(W, p, x):
    return lin(W, p + "down_proj", F.silu(lin(W, p + "gate_proj", x)) * lin(W, p + "up_proj", x))


def moe(W, p, c, x):
    """MoE (DeepSeek-V3 report, section 2.1.2): sigmoid scores, bias for selection only, normalised
    top-k weights x routed_scaling_factor."""
    s = torch.sigmoid(x @ W[p + "gate.weight"].T)  # (B, T, E)
    chosen = (s + W[p + "gate.e_score_correction_bias"]).topk(c.num_experts_per_tok, dim=-1).indices
    wts = s.gather(-1, chosen)
    wts = wts / wts.sum(-1, keepdim=True) * c.routed_scaling_factor
    every = torch.stack([swiglu(W, f"{p}experts.{e}.", x) for e in range(c.n_routed_experts)], dim=-2)
    picked = every.gather(-2, chosen[..., None].expand(*chosen.shape, x.shape[-1]))  # (B, T, k, D)
    return (wts[..., None] * picked).sum(-2) + swiglu(W, p + "shared_experts.", x)


def decoder_layer(W, i, c, x, sparse, opt):
    p, eps = f"model.layers.{i}.", c.rms_norm_eps
    x = x + mla(W, p + "self_attn.", c, rms_norm(x, W[p + "input_layernorm.weight"], eps), sparse, opt)
    h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
    return x + (swiglu(W, p + "mlp.", h) if i < c.first_k_dense_replace else moe(W, p + "mlp.", c, h))


def reference(W, c, ids, sparse=True, mtp=0, **overrides):
    """-> logits (B, T, V), and with mtp=k also the logits of MTP steps 1..k, a list of (B, T-j, V) (step j
    at position i predicts t_{i+j+1}).

    The MTP hidden-state contract of the released weights (vLLM PR #47448 and its GLM-5 MTP code): step 1
    reads the main stack's output after model.norm, the tensor lm_head reads; step j+1 reads step j's output
    after shared_head.norm, again the tensor lm_head reads. All steps run the one MTP block."""
    opt = dict(rope="interleaved", lat_eps=LAT_EPS, ties="low") | overrides
    W = {k: v.to(F64) for k, v in W.items()}
    L, eps = c.num_hidden_layers, c.rms_norm_eps
    T = ids.shape[1]
    h = W["model.embed_tokens.weight"][ids]
    for i in range(L):
        h = decoder_layer(W, i, c, h, sparse, opt)
    h = rms_norm(h, W["model.norm.weight"], eps)  # (B, T, D): lm_head's input, MTP step 1's hidden
    logits = lin(W, "lm_head", h)
    if not mtp:
        return logits
    p = f"model.layers.{L}."
    steps = []
    for j in range(1, mtp + 1):
        e = rms_norm(W["model.embed_tokens.weight"][ids[:, j:]], W[p + "enorm.weight"], eps)  # embed(t_{i+j})
        g = lin(W, p + "eh_proj", torch.cat([e, rms_norm(h[:, : T - j], W[p + "hnorm.weight"], eps)], dim=-1))
        g = decoder_layer(W, L, c, g, sparse, opt)
        h = rms_norm(g, W[p + "shared_head.norm.weight"], eps)  # lm_head's input, step j+1's hidden
        steps.append(lin(W, "lm_head", h))
    return logits, steps


# -----------------------------------------------------------------------------
# The harness: a tiny config, a randomised float64 model, and its weights under checkpoint names


def tiny_config(**kw):
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=5,
        rope_theta=1e4,
        num_nextn_predict_layers=1,
        num_mtp_steps=1,
        dsa_mode="sparse",
    )
    return model.ModelConfig(**(base | kw))


def build(seed, B=2, T=24, **cfg_kw):
    """-> (model in float64, eval mode, every tensor random; {checkpoint name: tensor}; ids (B, T+1))."""
    torch.manual_seed(seed)
    cfg = tiny_config(**cfg_kw)
    m = model.GLM5(cfg).double().eval()
    g = torch.Generator().manual_seed(seed)
    L = cfg.num_hidden_layers
    # by released name: each expert's matrix on its own (views of the model's stacked experts)
    with torch.no_grad():
        for name, t in weights.checkpoint_tensors(m.state_dict(), L).items():  # sharing the module's storage
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape, generator=g, dtype=F64))
            elif t.dim() == 1 and name.endswith("bias"):  # LayerNorm bias
                t.copy_(0.3 * torch.randn(t.shape, generator=g, dtype=F64))
            elif t.dim() == 1:  # RMSNorm / LayerNorm weights
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=g, dtype=F64))
            elif name == "model.embed_tokens.weight":
                t.copy_(torch.randn(t.shape, generator=g, dtype=F64))
            else:  # Linear (out, in): unit-variance outputs
                t.copy_(torch.randn(t.shape, generator=g, dtype=F64) * t.shape[1] ** -0.5)
    W = {k: v.detach().clone() for k, v in weights.checkpoint_tensors(m.state_dict(), L).items()}
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    return m, W, ids


def fresh_seed():
    return SEED if SEED is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item()


# -----------------------------------------------------------------------------
# Tests


def test_weight_names_match_spec():
    m, W, _ = build(fresh_seed())
    L = m.config.num_hidden_layers
    for name in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.self_attn.indexer.k_norm.bias",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        f"model.layers.{L}.eh_proj.weight",
        f"model.layers.{L}.shared_head.norm.weight",
        f"model.layers.{L}.self_attn.indexer.wq_b.weight",
        f"model.layers.{L}.mlp.experts.7.down_proj.weight",
    ]:
        assert name in W, name


@pytest.mark.parametrize("form", ["absorb", "naive"])  # gathered sparse MLA; its dense-masked reference
def test_logits_match_reference_sparse(form):
    seed = fresh_seed()
    m, W, ids = build(seed, dsa_mode="sparse")
    x = ids[:, :-1]
    assert x.shape[1] > m.config.index_topk  # sparsity is real
    ref = reference(W, m.config, x, sparse=True)
    with torch.no_grad():
        got = m(x, form=form)
    assert got.dtype == F64
    d = maxdiff(got, ref)
    assert d < 1e-9, f"seed={seed} form={form}: max |model - reference| = {d:.3e}"
    # the top-k really drops keys: the dense reference is far from the sparse one
    assert maxdiff(reference(W, m.config, x, sparse=False), ref) > 1e-3, f"seed={seed}"


def test_logits_match_reference_dense():
    seed = fresh_seed()
    m, W, ids = build(seed, dsa_mode="dense")
    x = ids[:, :-1]
    with torch.no_grad():
        got = m(x)
    d = maxdiff(got, reference(W, m.config, x, sparse=False))
    assert d < 1e-9, f"seed={seed}: dense mode, max |model - reference| = {d:.3e}"


def test_mtp_steps_match_reference():
    """Three MTP steps through the one block, each against the reference's hand-written step: the
    released weights' contract (post-norm hiddens in and between steps). The norm weights are random, so a
    block fed the pre-norm hidden (this project's contract before) misses by far more than the bound."""
    seed = fresh_seed()
    m, W, ids = build(seed, dsa_mode="sparse", num_mtp_steps=3)
    x, targets = ids[:, :-1], ids[:, 1:]  # targets[:, t] = token t+1
    ref_logits, ref_steps = reference(W, m.config, x, sparse=True, mtp=3)
    with torch.no_grad():
        got, losses = m(x, targets)
    d = maxdiff(got, ref_logits)
    assert d < 1e-9, f"seed={seed}: logits, max |model - reference| = {d:.3e}"
    # MTP step j at position i predicts t_{i+j+1} = targets[:, i+j]; the MTP loss is the mean over steps
    ref_mtp_loss = sum(
        F.cross_entropy(s.flatten(0, 1), targets[:, j:].flatten()) for j, s in enumerate(ref_steps, 1)
    ) / len(ref_steps)
    ref_lm_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    for key, ref in [("mtp", ref_mtp_loss), ("lm", ref_lm_loss)]:
        assert losses[key].dtype == F64, f"{key} loss computed in {losses[key].dtype} for a float64 model"
        d = abs(losses[key] - ref).item()
        assert d < 1e-9, (
            f"seed={seed}: {key} loss {losses[key].item():.15f} vs reference {ref.item():.15f} ({d:.3e})"
        )
    # the MTP loss is not the LM loss in disguise. Both losses sit near ln(vocab) for random weights,
    # so their gap can be small (3.8e-4 for seed 1724829602, where a 1e-3 bound failed); what must hold
    # is that the gap dwarfs the 1e-9 tolerance above, and that the logits behind them differ outright
    # (their max difference was 5.07-5.2 over seeds 0-39).
    assert abs(ref_mtp_loss - ref_lm_loss).item() > 1e-6, f"seed={seed}"
    assert maxdiff(ref_steps[0], ref_logits[:, 1:]) > 1e-1, f"seed={seed}"
