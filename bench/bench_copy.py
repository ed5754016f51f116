"""
Can the toy GLM-5 copy by content? The induction probe behind the README's RL section (issues 16 and 19).

Most toy agent tasks need the model to copy a word from its context that it never learnt (the name to greet,
the number in a tool result, the file to `cat`). A transformer does this with an induction head (Olsson et
al. 2022, "In-context learning and induction heads"): find the earlier occurrence of the current token and
predict what followed it. This script trains models from scratch on synthetic copy data and prints the
loss on the repeats, where chance is ln(ids). Three runs, described at main(): fixed (the toy GLM-5 on one
copy distance, tested at others), rows (the toy on train.py's copy rows, whose period varies) and reference
(an attention-only transformer on the same rows, the textbook setting in which induction heads form).

    python bench/bench_copy.py                                  # all three runs
    python bench/bench_copy.py --runs=fixed                     # one of them: fixed, rows, reference
    python bench/bench_copy.py --runs=reference --reference_layers=4      # the toy's depth
    python bench/bench_copy.py --runs=rows --dense_layers=2 --optimizer=adamw   # the reference's depth, rate

What it found is in the README's RL section and docs/design-notes.md.

Limits: one seed per run, a batch of 32, one thread; the step at which induction forms moves with the seed,
the depth and the rates. The script answers "does it form within N steps here", not "can it ever".
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# run as python bench/bench_copy.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import copy_probe
import mla
import model as glm
import muon


def toy_config():
    """configs/toy.py's ModelConfig."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg, _ = glm.load_config_file(os.path.join(root, "configs", "toy.py"))
    return cfg


def toy_glm5(kv_lora_rank=0, dense_layers=0, optimizer="muon", init_std=0.0, lr_muon=0.02):
    """configs/toy.py's GLM-5 with dense attention (the copy must not depend on the indexer's choice).
    kv_lora_rank: the MLA latent's width (0: the toy's); dense_layers: that many layers, all with a dense
    MLP (0: the toy's 1 dense + 3 MoE); optimizer: "muon" (train.py's Muon at lr_muon + AdamW at train.py's
    3e-3) or "adamw" (AdamW at 1e-3 on every weight, as the reference); init_std: the config's
    initializer_range (0: the toy's). -> (model, optimizers)."""
    cfg = toy_config()
    cfg.dsa_mode = "dense"
    if init_std:
        cfg.initializer_range = init_std
    if kv_lora_rank:
        cfg.kv_lora_rank = kv_lora_rank
    if dense_layers:
        cfg.num_hidden_layers = dense_layers
        cfg.first_k_dense_replace = dense_layers
    m = glm.GLM5(cfg)
    if optimizer == "adamw":
        return m, [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)]
    return m, list(muon.build_optimizers(m, lr_muon=lr_muon, lr_adamw=3e-3, weight_decay=0.1))


def rope(x, theta=1e4):
    """GLM-5's own RoPE (mla.rope_cos_sin and apply_rope: adjacent pairs rotated by position) over the
    whole last dim of x (B, H, T, hd)."""
    T, hd = x.shape[2], x.shape[3]
    cos, sin = mla.rope_cos_sin(torch.arange(T, device=x.device)[None], hd, theta)  # (1, T, hd / 2)
    return mla.apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)  # rotated as (B, T, H, hd)


class CausalAttention(nn.Module):
    """Multi-head causal self-attention; positions="rope" rotates q and k, else they come in the input."""

    def __init__(self, d, heads, positions):
        super().__init__()
        self.heads, self.positions = heads, positions
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        if self.positions == "rope":
            q, k = rope(q), rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.o(y.transpose(1, 2).reshape(B, T, d))


class AttentionOnly(nn.Module):
    """`layers` pre-norm causal self-attention layers, no MLP; positions "learned" (absolute embeddings
    added to the input) or "rope". x (B, T) -> logits (B, T, V)."""

    def __init__(self, vocab_size, max_len, d=128, heads=4, positions="learned", layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)
        self.pos = nn.Embedding(max_len, d) if positions == "learned" else None
        self.attn = nn.ModuleList([CausalAttention(d, heads, positions) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(d) for _ in range(layers)])
        self.final_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, x):
        h = self.emb(x)  # (B, T, d)
        if self.pos is not None:
            h = h + self.pos(torch.arange(x.shape[1], device=x.device))
        for attn, norm in zip(self.attn, self.norms):
            h = h + attn(norm(h))
        return self.head(self.final_norm(h))


def repeat_loss(m, x, y):
    """Mean cross-entropy over the targets that are not -1 (the repeats)."""
    logits = m(x)  # (B, T, V): GLM5 without targets and AttentionOnly both return the logits alone
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1)


def fixed_batch(n_ids, span, g, batch=32, offset=0):
    """`offset` random ids, then `span` random ids, then the same `span` again.
    -> x, y (B, offset + 2 span - 1); only the second copy's targets count, less its first id (what precedes
    it never preceded it)."""
    pad = torch.randint(0, n_ids, (batch, offset), generator=g)
    r = torch.randint(0, n_ids, (batch, span), generator=g)
    ids = torch.cat([pad, r, r], dim=1)
    y = ids[:, 1:].clone()
    y[:, : offset + span] = -1  # the padding, the first copy, and the second copy's first id
    return ids[:, :-1], y


def train_loop(name, m, opts, batches, steps, log_every=100):
    """Train on batches(g) for `steps` steps (grad clip 1.0); print the repeats' loss every log_every."""
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for step in range(steps + 1):
        x, y = batches(g)
        loss = repeat_loss(m, x, y)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        for opt in opts:
            opt.step()
        if step % log_every == 0:
            seconds = time.time() - t0
            print(f"  {name} step {step:5d}: repeats' loss {loss.item():.2f} ({seconds:.0f} s)", flush=True)


# The runs:
# - fixed: the toy GLM-5 (configs/toy.py, dense attention, train.py's Muon + AdamW) on `span` random ids
#   followed by the same ids, then tested on copies at other distances. A model that learnt "attend `span`
#   positions back" solves the training copy and fails the others (its loss goes past chance).
# - rows: the toy GLM-5 on train.py's copy rows (copy_probe.copy_rows: a span of 8 to `span` ids, repeated to
#   2 * `span` tokens). The period varies, so only the content tells where to copy from.
# - reference: an attention-only transformer (2 layers by default, learned positions, d 128, 4 heads, AdamW
#   1e-3) on the same rows, the textbook setting in which induction heads form (--reference_positions=rope:
#   with RoPE on its queries and keys instead, as GLM-5 has). Its vocabulary is the toy's (4,096), so both
#   models spread their first guesses over the same ids.
#
# The ids are drawn from the whole vocabulary by default. Drawing them from fewer (--ids=512) makes the task
# harder, not easier: the ids never seen must first be pushed down, and induction forms later
# (docs/design-notes.md has the steps).
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--runs", default="fixed,rows,reference", help="any of fixed, rows, reference")
    ap.add_argument("--ids", type=int, default=0, help="the copied ids are drawn from this many (0: all)")
    ap.add_argument("--span", type=int, default=32, help="fixed: the copied length; rows: its maximum")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--fixed_steps", type=int, default=200)
    ap.add_argument("--kv_lora_rank", type=int, default=0, help="0: the toy's; the MLA latent's width")
    ap.add_argument("--dense_layers", type=int, default=0, help="0: the toy's layers; N: N dense layers")
    ap.add_argument("--init_std", type=float, default=0.0, help="0: the toy's initializer_range (0.02)")
    ap.add_argument("--lr_muon", type=float, default=0.02, help="Muon's rate (train.py's default 0.02)")
    ap.add_argument("--optimizer", default="muon", help="the toy's: muon (train.py's) or adamw (1e-3)")
    ap.add_argument("--reference_positions", default="learned", help="the reference's: learned or rope")
    ap.add_argument("--reference_layers", type=int, default=2, help="the reference's attention layers")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    runs = [r for r in a.runs.split(",") if r]
    unknown = [r for r in runs if r not in ("fixed", "rows", "reference")]
    if unknown:
        raise SystemExit(f"unknown run {unknown[0]!r}; pick from fixed, rows, reference")
    if a.optimizer not in ("muon", "adamw"):
        raise SystemExit(f"unknown --optimizer {a.optimizer!r}; pick muon or adamw")
    if a.reference_positions not in ("learned", "rope"):
        raise SystemExit(f"unknown --reference_positions {a.reference_positions!r}; pick learned or rope")
    vocab_size = toy_config().vocab_size
    a.ids = a.ids or vocab_size
    if not 2 <= a.ids <= vocab_size or a.span < 8:
        raise SystemExit(
            f"--ids must lie in [2, {vocab_size}] (the toy's vocabulary) and --span be >= 8, "
            f"got {a.ids} and {a.span}"
        )
    if a.lr_muon <= 0:
        raise SystemExit(f"--lr_muon must be positive, got {a.lr_muon}")
    if a.reference_layers < 1:
        raise SystemExit(f"--reference_layers must be >= 1, got {a.reference_layers}")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"chance on the repeats: ln({a.ids}) = {math.log(a.ids):.2f} nats")

    if "fixed" in runs:
        print(f"== fixed: the toy GLM-5 on {a.span} ids then the same {a.span}, {a.fixed_steps} steps")
        m, opts = toy_glm5(a.kv_lora_rank, a.dense_layers, a.optimizer, a.init_std, a.lr_muon)
        train_loop("fixed", m, opts, lambda g: fixed_batch(a.ids, a.span, g), a.fixed_steps, log_every=50)
        g = torch.Generator().manual_seed(1)
        m.eval()
        with torch.no_grad():
            tests = [(a.span, 0), (a.span, a.span // 2), (a.span * 3 // 4, 0), (a.span * 5 // 4, 0)]
            for span, offset in tests:
                loss = repeat_loss(m, *fixed_batch(a.ids, span, g, offset=offset)).item()
                print(f"  test: copy {span} ids back, after {offset} others: repeats' loss {loss:.2f}")
        print("  (copying by content scores low at every distance; a positional lookup at one only)")

    def rows(g):
        return copy_probe.copy_rows(32, 2 * a.span, a.ids, g)

    if "rows" in runs:
        print(f"== rows: the toy GLM-5 on copy rows (periods 8..{a.span}), {a.steps} steps")
        m, opts = toy_glm5(a.kv_lora_rank, a.dense_layers, a.optimizer, a.init_std, a.lr_muon)
        train_loop("rows", m, opts, rows, a.steps)
    if "reference" in runs:
        L = a.reference_layers
        print(f"== reference: a {L}-layer attention-only transformer on the same rows, {a.steps} steps")
        torch.manual_seed(0)
        ref = AttentionOnly(vocab_size, 2 * a.span, positions=a.reference_positions, layers=L)
        opts = [torch.optim.AdamW(ref.parameters(), lr=1e-3)]
        train_loop("reference", ref, opts, rows, a.steps)


if __name__ == "__main__":
    main()
