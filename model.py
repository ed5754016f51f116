"""
GLM-5, the model (GLM-5 report, arXiv 2602.15763, section 2; names and sizes as in the released
config.json): the decoder stack here, its attention in mla.py. reference.py is the same math as plain
functions, the yardstick this file is tested against.

    embed -> 78 x [RMSNorm -> MLA (+ DSA indexer) -> RMSNorm -> dense SwiGLU (layers 0-2) | MoE (3-77)]
          -> RMSNorm -> lm_head          + one MTP block applied 3 times with shared weights

- MLA (mla.py; DeepSeek-V2 report, section 2.1) in both forms, with DeepSeek Sparse Attention's indexer,
  top-k, sparse attention and indexer KL from dsa.py (DeepSeek-V3.2 report).
- MoE (DeepSeek-V3 report, section 2.1.2): fp32 sigmoid router, e_score_correction_bias for selection only,
  normalised top-k weights x routed_scaling_factor, one shared expert (experts.py); the aux-loss-free bias
  update here, the sequence balance loss there.
- MTP (GLM-5 report, section 2): enorm/hnorm/eh_proj -> a full decoder layer -> shared_head.norm -> the
  shared lm_head, one block applied num_mtp_steps times; it reads the main stack's output after model.norm
  and carries its own output after shared_head.norm, as the released weights expect.
- Decoding over a cache of only [c_kv | k_pe] (512 + 64 values) and the 128-d indexer key per token per
  layer: KVCache here, paged_cache.py's page pool for the engine.

Run it:
    python model.py configs/toy.py     # build, forward, backward, parameter table (seconds on a CPU)
    python model.py configs/full.py    # the 744B parameter table, in seconds, on the meta device
Tests: python -m pytest -q tests/test_model.py tests/test_dsa.py tests/test_reference.py
Honest limits: attention is plain torch (SDPA when dense) except DSA's selection and sparse MLA, which run
as Triton kernels on a GPU; the experts run Triton kernels on a GPU only without gradients; token ids are
range-checked on a CPU only (on a GPU the check would cost a host sync per step).
"""

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import dsa
import experts
from dsa import upcast
from mla import MLA, Linear, RMSNorm, rope_cos_sin

# -----------------------------------------------------------------------------
# Config: field names follow the published config.json (model_type "glm_moe_dsa")


@dataclass
class ModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288  # dense SwiGLU layers
    moe_intermediate_size: int = 2048  # each routed and shared expert
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64  # MLA: every head has its own k/v after kv_b_proj
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6  # config.json: rope_parameters.rope_theta (older files: top-level rope_theta)
    max_position_embeddings: int = 202752
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    num_nextn_predict_layers: int = 1  # MTP blocks stored in the checkpoint (0: none)
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    eos_token_id: list = field(default_factory=lambda: [154820, 154827, 154829])
    # --- nanoGLM knobs, not in the published config.json ---
    num_mtp_steps: int = 3  # times the MTP block is applied in training (shared weights)
    dsa_mode: str = "sparse"  # "sparse": DSA top-k attention; "dense": full causal attention (pretraining)
    # "int8": the DSA selection scores int8 q and k, and caches store the index keys in int8 with a scale
    # (dsa.py: the indexer in 8 bits, DeepSeek-V3.2's FP8 indexer on integer hardware); "none": float
    index_quant: str = "none"

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"ModelConfig: {msg}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type is float:
                need(
                    isinstance(v, (int, float)) and not isinstance(v, bool),
                    f"{f.name} must be a number, got {v!r}",
                )
            if f.type is int:
                need(isinstance(v, int) and not isinstance(v, bool), f"{f.name} must be an int, got {v!r}")
            if f.type is int and f.name not in (
                "first_k_dense_replace",
                "num_nextn_predict_layers",
                "num_mtp_steps",
            ):
                need(v > 0, f"{f.name} must be positive, got {v}")
        need(
            self.first_k_dense_replace >= 0
            and self.num_nextn_predict_layers >= 0
            and self.num_mtp_steps >= 0,
            "first_k_dense_replace, num_nextn_predict_layers and num_mtp_steps must be >= 0",
        )
        need(
            self.first_k_dense_replace <= self.num_hidden_layers,
            f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds num_hidden_layers "
            f"({self.num_hidden_layers})",
        )
        need(
            self.num_key_value_heads == self.num_attention_heads,
            "MLA needs num_key_value_heads == num_attention_heads (each head gets its own k/v from "
            "kv_b_proj)",
        )
        need(
            self.qk_rope_head_dim % 2 == 0,
            f"qk_rope_head_dim must be even for RoPE pairs, got {self.qk_rope_head_dim}",
        )
        need(
            self.index_head_dim >= self.qk_rope_head_dim,
            f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
            f"({self.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim dims",
        )
        need(
            self.num_experts_per_tok <= self.n_routed_experts,
            f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
            f"({self.n_routed_experts})",
        )
        need(
            self.n_group == 1 and self.topk_group == 1,
            "group-limited routing (n_group/topk_group > 1) is not used by GLM-5 and not implemented; set "
            "both to 1",
        )
        need(
            self.rms_norm_eps > 0 and self.rope_theta > 0 and self.routed_scaling_factor > 0,
            "rms_norm_eps, rope_theta and routed_scaling_factor must be positive",
        )
        need(not self.tie_word_embeddings, "GLM-5 does not tie embeddings; set tie_word_embeddings = False")
        need(
            self.dsa_mode in ("sparse", "dense"),
            f"dsa_mode must be 'sparse' or 'dense', got {self.dsa_mode!r}",
        )
        need(
            self.index_quant in ("none", "int8"),
            f"index_quant must be 'none' or 'int8', got {self.index_quant!r}",
        )
        if self.index_quant == "int8":
            dsa.index_cache_layout(self.index_quant, self.index_head_dim, None)  # raises for a bad head dim

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# -----------------------------------------------------------------------------
# Feed-forward: dense SwiGLU and the sigmoid-routed MoE (its router and routed experts: experts.py)


class MLP(nn.Module):  # SwiGLU: the dense layers and the shared expert
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = experts.Router(cfg)
        self.experts = experts.Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        # tokens routed to each expert since the last bias update (the load statistics)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.n_routed_experts, dtype=torch.long), persistent=False
        )

    def forward(self, x, want_balance=False):
        """x (B, T, D) -> (y (B, T, D), the sequence balance loss or None)."""
        B, T, D = x.shape
        E, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        flat = x.reshape(-1, D)
        ids, w, scores = self.gate(flat)  # (N, k), (N, k), (N, E)
        counts = experts.expert_counts(ids, E)  # (E,)
        if self.training and torch.is_grad_enabled():  # training steps only, not sampling mid-training
            self.tokens_per_expert += counts
        # group the (token, slot) pairs by expert, then run every expert over its tokens
        order = ids.flatten().argsort(stable=True)  # (N * k,) pair indices, expert-major
        xs = flat.index_select(0, order // k)  # (N * k, D) the tokens, grouped by expert
        y = experts.combine_experts(self.experts(xs, counts, decode=T == 1), order, w, flat.dtype)  # (N, D)
        balance = None
        if want_balance:
            balance = experts.sequence_balance_loss(scores.view(B, T, E), ids.view(B, T, k), E)
        return (y + self.shared_experts(flat)).view(B, T, D), balance


@torch.no_grad()
def update_router_bias(model, rate=1e-3):
    """Aux-loss-free balancing, once per optimizer step: bias_i += rate * sign(mean_load - load_i) per MoE
    layer, from the loads counted since the last call (summed over ranks when distributed); resets them."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        load = moe.tokens_per_expert
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)
        load = load.double()
        moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load).float()
        moe.tokens_per_expert.zero_()


# -----------------------------------------------------------------------------
# Decoder layer, MTP block, latent cache


class Block(nn.Module):
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = layer_id < cfg.first_k_dense_replace
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if dense else MoE(cfg)

    def forward(self, x, cos, sin, positions, cache=None, form=None, want_balance=False, want_kl=False):
        """-> (x, balance loss or None, indexer KL or None). The aux losses are returned, not collected
        in a shared container, so they survive FSDP2's wrapping of each block."""
        a, kl = self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, form, want_kl)
        x = x + a
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            m, balance = self.mlp(h, want_balance)
            return x + m, balance, kl
        return x + self.mlp(h), None, kl


class SharedHead(nn.Module):  # checkpoint: model.layers.{L}.shared_head.norm (the head itself is lm_head)
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPBlock(Block):
    """x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) -> a full decoder layer -> h' = shared_head.norm(x);
    stored as layer L. The hidden-state contract of the released weights (the one vLLM's and SGLang's GLM-5
    MTP code follow, vLLM PR #47448): the first step's h_i is the main stack's output after model.norm, and
    each step hands the next the same h' the shared lm_head reads, after shared_head.norm."""

    def __init__(self, cfg, layer_id):
        super().__init__(cfg, layer_id)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, h, emb, cos, sin, positions, cache=None, form=None, want_balance=False, want_kl=False):
        """h (B, T, D) post-norm, emb (B, T, D) -> (h' (B, T, D): the input of the shared lm_head and of the
        next MTP step, balance, kl)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        x, balance, kl = super().forward(x, cos, sin, positions, cache, form, want_balance, want_kl)
        return self.shared_head.norm(x), balance, kl


class KVCache:
    """Decode state: per layer (main layers, then MTP) the [c_kv | k_pe] latent (kv_lora_rank +
    qk_rope_head_dim = 576 values at full size) and the index_head_dim = 128 indexer key, per token (with
    index_quant "int8": its 128 int8 values and its scale's 4 bytes, dsa.index_cache_layout)."""

    def __init__(self, cfg, batch_size, max_seq_len, device="cpu", dtype=torch.float32):
        L = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        self.max_seq_len = max_seq_len
        self.kv = torch.zeros(
            L, batch_size, max_seq_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=device, dtype=dtype
        )
        width, index_dtype = dsa.index_cache_layout(cfg.index_quant, cfg.index_head_dim, dtype)
        self.index_k = torch.zeros(L, batch_size, max_seq_len, width, device=device, dtype=index_dtype)
        self.length = None  # the furthest position of this forward + 1

    def write(self, layer_id, positions, latent, index_k):
        """positions (B, T), rows may differ -> each row's (B, S, ...) latents and index keys
        (paged_cache.PagedCache has the same API)."""
        S = self.length  # GLM5.forward sets it from start_pos on the host: no sync per layer
        if S > self.max_seq_len:
            raise ValueError(
                f"position {S - 1} is past the cache's max_seq_len {self.max_seq_len}; allocate a longer "
                "KVCache"
            )
        if positions.shape[0] > self.kv.shape[1]:
            raise ValueError(
                f"a batch of {positions.shape[0]} rows does not fit a KVCache built for "
                f"{self.kv.shape[1]}; build it with batch_size >= the batch"
            )
        if (latent.dtype, latent.device) != (self.kv.dtype, self.kv.device):
            raise ValueError(
                f"KVCache holds {self.kv.dtype} on {self.kv.device} but the model computes {latent.dtype} "
                f"on {latent.device}; pass the model's device and dtype to KVCache"
            )
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.kv[layer_id][rows, positions] = latent.to(self.kv.dtype)
        self.index_k[layer_id][rows, positions] = dsa.to_index_cache(index_k, self.index_k.dtype)
        return self.kv[layer_id][: len(rows), :S], self.index_k[layer_id][: len(rows), :S]

    def attend(self, mla, q, latent, index_k, positions, form=None, want_kl=False):
        """The one call mla.MLA.forward makes of a cache: store this step's latents (B, T, C + R) and index
        keys (B, T, Di) at positions (B, T), then MLA.attend over each row's history, query t seeing
        positions 0..positions[t], in the absorbed form unless `form` says otherwise."""
        dsa.check_cached_keys(self.index_k, mla.cfg.index_quant)
        latent_all, index_k_all = self.write(mla.layer_id, positions, latent, index_k)  # (B, S, ...)
        return mla.attend(q, latent_all, index_k_all, positions, form or "absorb", want_kl)


# -----------------------------------------------------------------------------
# The model


def check_token_ids(input_ids, vocab_size):
    """One clear sentence for ids outside the vocabulary (nn.Embedding would say "index out of range")."""
    if ((input_ids < 0) | (input_ids >= vocab_size)).any():
        raise ValueError(
            f"input_ids must lie in [0, {vocab_size}) for this model's vocab_size; "
            f"got values from {int(input_ids.min())} to {int(input_ids.max())}"
        )


class GLM5(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        L = cfg.num_hidden_layers
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                layers=nn.ModuleList(Block(cfg, i) for i in range(L)),
                norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            )
        )
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the checkpoint names these model.layers.{L + j}; see weights.checkpoint_name
        self.mtp_layers = nn.ModuleList(MTPBlock(cfg, L + j) for j in range(cfg.num_nextn_predict_layers))
        self.init_weights()

    def init_weights(self):
        """All initialisation in one place: N(0, initializer_range) matrices and embeddings, unit norms,
        zero biases (LayerNorm) and zero router correction bias."""
        if self.lm_head.weight.is_meta:  # nothing to initialise on the meta device (parameter counting)
            return
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding, experts.Router)):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, experts.Experts):
                m.init_weights(std)
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, MoE):
                m.gate.e_score_correction_bias.zero_()
                m.tokens_per_expert.zero_()

    def forward(
        self,
        input_ids,
        targets=None,
        cache=None,
        start_pos=0,
        form=None,
        mtp_weight=0.3,
        balance_weight=1e-4,
        indexer_kl_weight=1.0,
        indexer_kl=False,
    ):
        """input_ids (B, T) -> logits (B, T, V); with targets (B, T) (ignore_index -1) -> (logits, losses)
        where losses = {"loss": total to backprop, "lm", "mtp", "balance", "indexer_kl"}.

        cache/start_pos: incremental decoding; start_pos is an int or a (B,) tensor of per-row offsets.
        indexer_kl: also compute the indexer's KL to the main attention (dense warm-up when
        config.dsa_mode == "dense", sparse stage when "sparse")."""
        c = self.config
        B, T = input_ids.shape
        if input_ids.device.type == "cpu":  # on a GPU this check would cost a host sync every decode step
            check_token_ids(input_ids, c.vocab_size)
        positions = torch.arange(T, device=input_ids.device)[None] + torch.as_tensor(
            start_pos, device=input_ids.device
        ).view(-1, 1)
        positions = positions.expand(B, T)  # (B, T)
        if cache is not None:  # the cache's visible length, on the host once (a sync only for a tensor)
            cache.length = (
                start_pos if isinstance(start_pos, int) else int(torch.as_tensor(start_pos).max())
            ) + T
        want_balance = targets is not None and self.training
        want_kl = targets is not None and indexer_kl
        h, balances, kls = self.hidden_states(input_ids, positions, cache, form, want_balance, want_kl)
        logits = self.lm_head(h)
        if targets is None:
            return logits

        zero = logits.new_zeros((), dtype=torch.float32)
        losses = {"lm": F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), ignore_index=-1)}
        losses["mtp"] = zero
        if mtp_weight:
            losses["mtp"] = self.mtp_loss(
                h, input_ids, targets, positions, want_balance, want_kl, balances, kls
            )
        balances, kls = [b for b in balances if b is not None], [k for k in kls if k is not None]
        losses["balance"] = torch.stack(balances).sum() if balances else zero
        losses["indexer_kl"] = torch.stack(kls).mean() if kls else zero
        losses["loss"] = (
            losses["lm"]
            + mtp_weight * losses["mtp"]
            + balance_weight * losses["balance"]
            + indexer_kl_weight * losses["indexer_kl"]
        )
        return logits, losses

    def rope(self, positions):
        """positions (B, T) -> RoPE's cos, sin (B, T, qk_rope_head_dim / 2), fp32 (fp64 for a fp64 model)."""
        c = self.config
        return rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, upcast(self.lm_head.weight).dtype)

    def hidden_states(self, input_ids, positions, cache=None, form=None, want_balance=False, want_kl=False):
        """The decoder stack: input_ids (B, T) at positions (B, T) -> h (B, T, D) after model.norm (what
        lm_head reads and the MTP block takes as its first input), and each layer's balance loss and indexer
        KL (None where not asked). The serving engine runs this same loop over its page pool."""
        cos, sin = self.rope(positions)
        balances, kls = [], []  # per-layer aux losses, returned by each block
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h, balance, kl = layer(h, cos, sin, positions, cache, form, want_balance, want_kl)
            balances.append(balance)
            kls.append(kl)
        return self.model.norm(h), balances, kls

    def mtp_loss(
        self,
        h,
        input_ids,
        targets,
        positions,
        want_balance=False,
        want_kl=False,
        balances=None,
        kls=None,
    ):
        """Mean over num_mtp_steps of the cross-entropy of MTP step k predicting token t_{i+k+1}.
        Step k at position i sees h^{k-1}_i and embed(t_{i+k}): h^0 is the main stack's output after
        model.norm (h here), h^k the block's output after shared_head.norm, which lm_head also reads (the
        released weights' contract, MTPBlock). All steps share one block's weights (GLM-5: 1 block, 3
        steps). The block's aux losses are appended to `balances` / `kls`."""
        c = self.config
        T = input_ids.shape[1]
        steps = min(c.num_mtp_steps, T - 1) if self.mtp_layers else 0
        if steps <= 0:
            return h.new_zeros((), dtype=torch.float32)
        cos, sin = self.rope(positions)
        total = 0.0
        for k in range(1, steps + 1):
            block = self.mtp_layers[min(k - 1, len(self.mtp_layers) - 1)]
            n = T - k
            emb = self.model.embed_tokens(input_ids[:, k:])  # embed(t_{i+k}), (B, n, D)
            h, balance, kl = block(
                h[:, :n],
                emb,
                cos[:, :n],
                sin[:, :n],
                positions[:, :n],
                want_balance=want_balance,
                want_kl=want_kl,
            )
            if balances is not None:
                balances.append(balance)
                kls.append(kl)
            logits = self.lm_head(h)
            total = total + F.cross_entropy(
                upcast(logits).flatten(0, 1), targets[:, k:].flatten(), ignore_index=-1
            )
        return total / steps

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, temperature=1.0, top_k=None, form=None):
        """Prefill the prompt into a latent cache, then decode one token at a time."""
        B, T = input_ids.shape
        p = next(self.parameters())
        cache = KVCache(self.config, B, T + max_new_tokens, p.device, p.dtype)
        logits = self(input_ids, cache=cache, start_pos=0, form=form)[:, -1]
        out = [input_ids]
        for i in range(max_new_tokens):
            logits = logits.float() / max(temperature, 1e-6)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
                logits[logits < v[:, [-1]]] = -float("inf")
            if temperature > 0:
                nxt = torch.multinomial(logits.softmax(-1), 1)  # (B, 1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = self(nxt, cache=cache, start_pos=T + i, form=form)[:, -1]
        return torch.cat(out, dim=1)


# -----------------------------------------------------------------------------
# Parameter accounting


def param_counts(model):
    """Totals as the report counts them. 'emb' = embed_tokens + lm_head; activated = per token
    (all but the routed experts each MoE layer does not pick); the MTP layer shares embed and head."""
    c = model.config
    sizes = {n: t.numel() for n, t in model.state_dict().items()}
    total = sum(sizes.values())
    emb = sizes["model.embed_tokens.weight"] + sizes["lm_head.weight"]
    mtp = sum(v for n, v in sizes.items() if n.startswith("mtp_layers."))
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    idle = (c.n_routed_experts - c.num_experts_per_tok) * expert
    main = total - mtp
    return {
        "total (with MTP)": total,
        "total without MTP": main,
        "total without MTP, without embeddings": main - emb,
        "activated per token (without MTP)": main - n_moe * idle,
        "activated per token, without embeddings": main - n_moe * idle - emb,
        "MTP layer (shares embeddings and head)": mtp,
        "MTP layer activated per token": mtp - len(model.mtp_layers) * idle,
        "embeddings + lm_head": emb,
    }


def param_table(model):
    c = model.config

    def fmt(v):
        return f"{v / 1e9:9.3f}B" if v >= 1e9 else f"{v / 1e6:9.3f}M"

    rows = [f"{k:<44s} {fmt(v)}  ({v:,})" for k, v in param_counts(model).items()]
    attn = sum(
        p.numel()
        for n, p in model.model.layers[-1].self_attn.named_parameters()
        if not n.startswith("indexer")
    )
    idx = sum(p.numel() for p in model.model.layers[-1].self_attn.indexer.parameters())
    rows.append(
        f"per layer: attention {attn / 1e6:.2f}M, indexer {idx / 1e6:.2f}M, expert "
        f"{3 * c.hidden_size * c.moe_intermediate_size / 1e6:.2f}M, router "
        f"{c.n_routed_experts * c.hidden_size / 1e6:.2f}M"
    )
    per_tok = c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim
    rows.append(
        f"KV cache per token per layer: {c.kv_lora_rank}+{c.qk_rope_head_dim} latent + {c.index_head_dim} "
        f"indexer key = {per_tok} values ({per_tok * 2 * c.num_hidden_layers / 2**10:.1f} KiB/token in bf16)"
    )
    return "\n".join(rows)


# -----------------------------------------------------------------------------
# python model.py configs/<name>.py : build, forward, backward, parameter table


def load_config_file(path):
    """Execute a configs/*.py file; -> (ModelConfig from the keys that name its fields, the other keys).
    The other keys are left for train.py to check; only near-misses of model fields are caught here."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"config file {path} not found; try one of configs/toy.py, configs/small.py, configs/full.py"
        )
    scope = {}
    exec(open(path).read(), scope)
    keys = {
        k: v
        for k, v in scope.items()
        if not k.startswith("_") and not callable(v) and not isinstance(v, type(sys))
    }
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    rest = {k: v for k, v in keys.items() if k not in names}
    for k in rest:  # a near-miss of a model field is a typo, not a training key
        hint = difflib.get_close_matches(k, names, n=1, cutoff=0.85)
        if hint:
            raise ValueError(f"{path}: unknown key {k!r}; did you mean {hint[0]!r}?")
    return ModelConfig(**{k: v for k, v in keys.items() if k in names}), rest


if __name__ == "__main__":
    import time

    ap = argparse.ArgumentParser(
        description="GLM-5, the model: build a config's decoder stack, print its parameter table and, when "
        "it fits in memory, run one forward and backward on a CPU-sized batch and sample a few tokens.",
        epilog="example: python model.py configs/toy.py",
    )
    ap.add_argument("config", help="a model config file: configs/toy.py, configs/small.py, configs/full.py")
    args = ap.parse_args()
    cfg, rest = load_config_file(args.config)
    print(f"config {args.config}: {json.dumps(dataclasses.asdict(cfg))}")
    if rest:
        print(f"keys for train.py, not the model: {', '.join(sorted(rest))}")
    t0 = time.time()
    with torch.device("meta"):
        meta_model = GLM5(cfg)
    print(f"built on the meta device in {time.time() - t0:.1f}s\n{param_table(meta_model)}")
    n = param_counts(meta_model)["total (with MTP)"]
    if n * 4 > 8 * 2**30:  # more than ~8 GiB of fp32 weights: too big to instantiate here
        print(
            f"{n / 1e9:.1f}B parameters need {n * 2 / 2**30:.0f} GiB in bf16: not materialised; training "
            "it is train.py's job under torchrun"
        )
        sys.exit(0)
    torch.manual_seed(0)
    model = GLM5(cfg)
    T = min(int(rest.get("block_size", 256)), 256, cfg.max_position_embeddings)  # a CPU-sized demo batch
    x = torch.randint(0, cfg.vocab_size, (2, T + 1))
    t0 = time.time()
    model.train()
    logits, losses = model(x[:, :-1], x[:, 1:])
    losses["loss"].backward()
    print(
        f"forward+backward on (2, {T}) in {time.time() - t0:.2f}s: "
        + ", ".join(f"{k} {v.item():.4f}" for k, v in losses.items())
        + f" (ln V = {math.log(cfg.vocab_size):.4f})"
    )
    model.eval()
    print("sample token ids:", model.generate(x[:1, :8], 8, temperature=0.0)[0].tolist())
