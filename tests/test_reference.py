"""
model.py (with mla.py, dsa.py and experts.py) against reference.py, GLM-5's forward as plain float64
functions written from the reports and the released config.json alone: the same logits (sparse and dense,
both MLA forms) and the same MTP loss over three steps, at 1e-9.

reference.py reads a flat {checkpoint name: tensor} dict (names exactly as released; the MTP block is
`model.layers.{num_hidden_layers}.*`) and uses nothing from the project. Every weight here is random, norms,
LayerNorm bias and the router's e_score_correction_bias included, with a fresh seed per run; the seed is in
every assert message so a failure can be replayed by setting SEED below.

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
from reference import forward as reference  # noqa: E402

SEED = None  # set to an int to replay a failing run; None draws a fresh seed for each test
F64 = torch.float64

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
