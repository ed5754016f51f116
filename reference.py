"""
GLM-5's forward pass on two screens: plain float64 functions over a {checkpoint name: tensor} dict, written
from the GLM-5 report (arXiv 2602.15763, section 2), the DeepSeek-V2/V3/V3.2 reports and the released
config.json alone. No caches, no kernels, no batching tricks: the math each of model.py, mla.py, dsa.py and
experts.py computes fast, and the yardstick they are tested against (tests/test_reference.py holds model.py's
logits and MTP loss to these at 1e-9, with every weight random).

    embed -> L x [RMSNorm -> MLA (+ DSA's indexer and top-k) -> RMSNorm -> SwiGLU | sigmoid MoE]
          -> RMSNorm -> lm_head;   MTP: [enorm(embed(t_{i+j})) ; hnorm(h)] -> eh_proj -> a decoder layer
          -> shared_head.norm -> lm_head, the one block applied j = 1..k times

Names are the released checkpoint's (model.layers.{i}.self_attn.q_a_proj.weight, ...; the MTP block is
model.layers.{num_hidden_layers}); weights.checkpoint_tensors turns a model.GLM5 into such a dict.

Run it:  python reference.py       # a tiny random GLM-5: these logits against model.py's, in float64
Honest limits: MLA runs in its naive (MHA) form only and DSA as a dense mask (model.py has the absorbed
form and the gathered sparse kernels); every routed expert runs on every token; float64 on a CPU: a few
layers of toy width, not the 744B model.
"""

import argparse

import torch
import torch.nn.functional as F

F64 = torch.float64
LAT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (the published reference); the other RMSNorms: rms_norm_eps
LN_EPS = 1e-6  # the indexer's k_norm, a LayerNorm with weight and bias

# -----------------------------------------------------------------------------
# The pieces


def lin(W, name, x):
    return x @ W[name + ".weight"].T


def rms_norm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rope(x, theta):
    """x (B, T, ..., d): rotate the interleaved pair (x[2i], x[2i+1]) of position t by t * theta^(-2i/d)."""
    T, d = x.shape[1], x.shape[-1]
    ang = torch.arange(T, dtype=F64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=F64) / d)  # (T, d/2)
    ang = ang.view(T, *([1] * (x.dim() - 3)), d // 2)
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


# -----------------------------------------------------------------------------
# DSA (DeepSeek-V3.2 report, section 2.1): the lightning indexer and its top-k


def indexer_selection(W, p, c, x, q_lat):
    """-> keep (B, T, S) bool: query t keeps the top min(index_topk, t + 1) causal keys by the indexer's
    score I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s]), ties broken towards the lower key index (the
    report: a non-deterministic top-k collapsed RL)."""
    B, T, _ = x.shape
    nh, hd, dr = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
    q = lin(W, p + "wq_b", q_lat).view(B, T, nh, hd)  # from MLA's query latent
    q = torch.cat([rope(q[..., :dr], c.rope_theta), q[..., dr:]], dim=-1)
    k = layer_norm(lin(W, p + "wk", x), W[p + "k_norm.weight"], W[p + "k_norm.bias"], LN_EPS)
    k = torch.cat([rope(k[..., :dr], c.rope_theta), k[..., dr:]], dim=-1)  # (B, S, hd): one key per token
    w = lin(W, p + "weights_proj", x) * nh**-0.5  # (B, T, nh)
    dots = torch.relu(torch.einsum("btjd,bsd->btjs", q, k) * hd**-0.5)
    I = (w[..., None] * dots).sum(dim=2)  # (B, T, S)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    I = I.masked_fill(~causal, float("-inf"))
    order = torch.sort(I, dim=-1, descending=True, stable=True).indices  # stable: equal scores keep order
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T).expand_as(order))
    k_t = torch.clamp(torch.arange(T) + 1, max=c.index_topk)  # min(index_topk, visible)
    return (rank < k_t[:, None]) & causal


# -----------------------------------------------------------------------------
# MLA (DeepSeek-V2 report, section 2.1), its MHA form, with DSA's selection as a mask


def mla(W, p, c, x, sparse):
    B, T, _ = x.shape
    H, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q_lat = rms_norm(lin(W, p + "q_a_proj", x), W[p + "q_a_layernorm.weight"], LAT_EPS)
    q_nope, q_pe = lin(W, p + "q_b_proj", q_lat).view(B, T, H, dn + dr).split([dn, dr], dim=-1)
    q_pe = rope(q_pe, c.rope_theta)
    c_kv, k_pe = lin(W, p + "kv_a_proj_with_mqa", x).split([c.kv_lora_rank, dr], dim=-1)  # the cached latent
    c_kv = rms_norm(c_kv, W[p + "kv_a_layernorm.weight"], LAT_EPS)
    k_pe = rope(k_pe, c.rope_theta)  # (B, S, dr), one key shared by all heads
    k_nope, v = lin(W, p + "kv_b_proj", c_kv).view(B, T, H, dn + dv).split([dn, dv], dim=-1)
    scores = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
    scores = scores * (dn + dr) ** -0.5
    keep = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if sparse:
        keep = keep & indexer_selection(W, p + "indexer.", c, x, q_lat)
    probs = scores.masked_fill(~keep[:, None], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * dv)
    return lin(W, p + "o_proj", out)


# -----------------------------------------------------------------------------
# The feed-forward: SwiGLU, and the MoE (DeepSeek-V3 report, section 2.1.2)


def swiglu(W, p, x):
    return lin(W, p + "down_proj", F.silu(lin(W, p + "gate_proj", x)) * lin(W, p + "up_proj", x))


def moe(W, p, c, x):
    """Sigmoid scores; the correction bias picks the experts but does not weigh them; the chosen scores
    normalised and times routed_scaling_factor; plus the shared expert."""
    s = torch.sigmoid(x @ W[p + "gate.weight"].T)  # (B, T, E)
    chosen = (s + W[p + "gate.e_score_correction_bias"]).topk(c.num_experts_per_tok, dim=-1).indices
    wts = s.gather(-1, chosen)
    wts = wts / wts.sum(-1, keepdim=True) * c.routed_scaling_factor
    every = torch.stack([swiglu(W, f"{p}experts.{e}.", x) for e in range(c.n_routed_experts)], dim=-2)
    picked = every.gather(-2, chosen[..., None].expand(*chosen.shape, x.shape[-1]))  # (B, T, k, D)
    return (wts[..., None] * picked).sum(-2) + swiglu(W, p + "shared_experts.", x)


def decoder_layer(W, i, c, x, sparse):
    p, eps = f"model.layers.{i}.", c.rms_norm_eps
    x = x + mla(W, p + "self_attn.", c, rms_norm(x, W[p + "input_layernorm.weight"], eps), sparse)
    h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
    if i < c.first_k_dense_replace:
        return x + swiglu(W, p + "mlp.", h)
    return x + moe(W, p + "mlp.", c, h)


# -----------------------------------------------------------------------------
# The whole model, and the MTP block (GLM-5 report, section 2)


def forward(W, c, ids, sparse=True, mtp=0):
    """ids (B, T) -> logits (B, T, V); with mtp=k also the logits of MTP steps 1..k, a list of (B, T-j, V)
    (step j at position i predicts t_{i+j+1}).

    The MTP hidden-state contract of the released weights (vLLM PR #47448): step 1 reads the main stack's
    output after model.norm, the tensor lm_head reads; step j+1 reads step j's output after
    shared_head.norm, again the tensor lm_head reads. Every step runs the one block."""
    W = {k: v.to(F64) for k, v in W.items()}
    L, eps = c.num_hidden_layers, c.rms_norm_eps
    T = ids.shape[1]
    h = W["model.embed_tokens.weight"][ids]
    for i in range(L):
        h = decoder_layer(W, i, c, h, sparse)
    h = rms_norm(h, W["model.norm.weight"], eps)  # (B, T, D): lm_head's input, MTP step 1's hidden
    logits = lin(W, "lm_head", h)
    if not mtp:
        return logits
    p = f"model.layers.{L}."
    steps = []
    for j in range(1, mtp + 1):
        e = rms_norm(W["model.embed_tokens.weight"][ids[:, j:]], W[p + "enorm.weight"], eps)  # embed(t_{i+j})
        x = torch.cat([e, rms_norm(h[:, : T - j], W[p + "hnorm.weight"], eps)], dim=-1)
        g = decoder_layer(W, L, c, lin(W, p + "eh_proj", x), sparse)
        h = rms_norm(g, W[p + "shared_head.norm.weight"], eps)  # lm_head's input, step j+1's hidden
        steps.append(lin(W, "lm_head", h))
    return logits, steps


# -----------------------------------------------------------------------------
# python reference.py: a tiny random GLM-5, these logits against model.py's

if __name__ == "__main__":
    import dataclasses

    import model
    import weights

    ap = argparse.ArgumentParser(
        description="GLM-5's forward pass as plain float64 functions: build a tiny random GLM-5 "
        "(configs/toy.py, index_topk 8) and print how far model.py's logits are from these.",
        epilog="example: python reference.py",
    )
    ap.parse_args()
    torch.manual_seed(0)
    cfg, _ = model.load_config_file("configs/toy.py")
    cfg = dataclasses.replace(cfg, index_topk=8)  # below the 32 tokens: the top-k really drops keys
    m = model.GLM5(cfg).double().eval()
    W = weights.checkpoint_tensors(m.state_dict(), cfg.num_hidden_layers)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.no_grad():
        got = m(ids)
    ref = forward(W, cfg, ids)
    diff = (got - ref).abs().max().item()
    print(f"configs/toy.py, index_topk 8 of up to 32 keys: max |model.py - reference.py| = {diff:.2e}")
