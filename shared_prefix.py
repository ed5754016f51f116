"""
The shared-prefix forward of the RL trainer: the samples of a GRPO group answer one prompt, so the trainer
encodes that prompt once and runs only each sample's own tokens against it (Prefix Grouper, Liu et al.,
"Efficient GRPO Training through Shared-Prefix Forward", arXiv 2506.05433). It is a speed-up of the
trainer's forward for GRPO's groups (GLM-5 report: its RL sections compare the samples of one prompt), not
a change of the algorithm: the logprobs and the gradients equal one forward per sample, up to float
rounding. The prefix's latents are computed once with autograd on, every sample's suffix attends to them,
and backward adds each sample's gradient into the one copy (how, with model.GLM5 unchanged: at
PrefixCache). The saving on the toy RL run is measured by bench/bench_rl.py part 3 (docs/design-notes.md).

Run it:  python shared_prefix.py      # a random tiny GLM-5: shared vs one forward per sample
Tests:   python -m pytest -q tests/test_rl.py -k "shared or units"
Honest limits: one prefix per group, the longest one all its samples share (folded episodes share less);
a group's samples run as one padded batch, so a group with one much longer sample pads the others;
micro_tokens counts the two forwards' padded tokens, not the per-row copies of the prefix keys nor the
attention probabilities (rows x heads x suffix x keys) the absorbed form keeps for backward, which the
plain path's fused attention does not; on a GPU index_select's backward adds with atomics, so the prefix's
gradient is not bitwise reproducible run to run; the cache's recording flag is state, so the forward
cannot be recomputed under activation checkpointing as it is.
"""

import argparse

import torch

import dsa
from dsa import upcast

# -----------------------------------------------------------------------------
# Prefix units: the rows that share a prompt, and how long it is


def common_prefix_length(rows):
    """The number of leading tokens every id list in rows shares."""
    first = rows[0]
    n = min(len(r) for r in rows)
    for r in rows[1:]:
        i = 0
        while i < n and r[i] == first[i]:
            i += 1
        n = i
    return n


def prefix_units(rows, groups):
    """-> [(P, row indices)]: the rows of each group and the P tokens they all share, at most each row's
    length - 1 (every row keeps a token to predict). A group whose rows share nothing (rollouts always
    share the chat template's first tokens; this is for any other input) gives one unit per row."""
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    units = []
    for idx in members.values():
        if any(len(rows[i]) < 2 for i in idx):
            raise ValueError("a trajectory needs at least two tokens: a prompt token and one to score")
        P = min(common_prefix_length([rows[i] for i in idx]), min(len(rows[i]) for i in idx) - 1)
        if P > 0:
            units.append((P, idx))
        else:
            units += [(len(rows[i]) - 1, [i]) for i in idx]
    return units


# -----------------------------------------------------------------------------
# A cache that holds the prefixes, with autograd
#
# How, with model.GLM5 unchanged: its forward takes a cache, whose attend(mla, ...) stores a step's latents
# and runs mla.MLA.attend over every key a query may see (model.KVCache.attend). PrefixCache is such a cache,
# built for training, whose write(layer, positions, latent, index_k) returns those keys:
# - the prefix pass (one row per group, right-padded, positions 0..P-1) keeps each layer's latents and index
#   keys and returns them;
# - the suffix pass (one row per sample, positions P..) returns, per row, its group's P prefix keys followed
#   by its own, gathered out of place (index_select: a copy per row, kept for backward) so that autograd sees
#   one graph.
#
# MLA then attends exactly as over a decode cache (query at position p sees keys 0..p), and DSA's indexer
# selects among the same keys at the same positions as in the sample's own forward. Every micro-batch is these
# two forwards, whatever it holds, so ranks under FSDP2 run the same collectives.


class PrefixCache:
    """model.KVCache's cache API over the prefixes of a batch (see the comment above).
    The prefix pass runs one row per unit, (U, Pmax) right-padded, and the cache keeps each layer's latents
    and index keys. The suffix pass runs one row per sample, starting at its unit's P; each row's keys are
    its unit's P prefix keys, then its own, then zeros (beyond the row's last position: never visible),
    gathered out of place so that backward adds every row's gradient into its prefix's one copy.
    unit (N,) long: each sample's unit; P (N,) long: its prefix length."""

    def __init__(self, cfg, unit, P):
        self.cfg = cfg
        self.unit = unit
        self.P = P
        self.prefix = {}  # layer id -> (latents (U, Pmax, C + R), index keys (U, Pmax, Di or Di + 4))
        self.recording = True  # the prefix pass; False: the suffix pass
        self.length = None  # set by GLM5.forward, as for any cache

    def slots(self, Pmax, S, U):
        """(N, Pmax + S) rows of the flat [prefix rows; suffix rows; one zero row] for each row's keys."""
        N = self.unit.shape[0]
        j = torch.arange(Pmax + S, device=self.unit.device)[None]  # (1, Pmax + S) key slots
        P = self.P[:, None]  # (N, 1)
        from_prefix = self.unit[:, None] * Pmax + j  # (N, Pmax + S)
        rows = torch.arange(N, device=self.unit.device)[:, None]
        from_suffix = U * Pmax + rows * S + (j - P)
        zero = torch.full_like(from_prefix, U * Pmax + N * S)
        return torch.where(j < P, from_prefix, torch.where(j < P + S, from_suffix, zero))

    def write(self, layer_id, positions, latent, index_k):
        """latent (B, T, C + R), index_k (B, T, Di) of this pass -> every key a query may see: (B, S, ...)."""
        if self.cfg.index_quant == "int8":
            index_k = dsa.to_index_cache(index_k, torch.int8)  # (B, T, Di + 4)
        if self.recording:
            self.prefix[layer_id] = (latent, index_k)
            return latent, index_k
        lat_p, idx_p = self.prefix[layer_id]
        U, Pmax = lat_p.shape[:2]
        N, S = latent.shape[:2]
        where = self.slots(Pmax, S, U).flatten()  # (N * (Pmax + S),)
        out = []
        for pre, own in ((lat_p, latent), (idx_p, index_k)):
            flat = torch.cat([pre.flatten(0, 1), own.flatten(0, 1), own.new_zeros(1, own.shape[-1])])
            out.append(flat.index_select(0, where).view(N, Pmax + S, -1))
        return out[0], out[1]  # (N, Pmax + S, C + R), (N, Pmax + S, ...)

    def attend(self, mla, q, latent, index_k, positions, form=None, want_kl=False):
        """The cache call of mla.MLA.forward, as model.KVCache.attend: MLA.attend over write()'s keys."""
        latent_all, index_k_all = self.write(mla.layer_id, positions, latent, index_k)
        return mla.attend(q, latent_all, index_k_all, positions, form or "absorb", want_kl)


# -----------------------------------------------------------------------------
# A batch's logprobs, each prefix encoded once


def shared_token_logprobs(m, rows, groups, temperature=1.0):
    """rl.token_logprobs of a batch, each group's prefix encoded once: rows (lists of token ids), groups
    (each row's group key; rows of one group share their prompt). Two forwards whatever the batch (the
    prefixes, then the rows' own tokens), so ranks under FSDP2 run the same collectives.
    -> (N, T - 1) with grad, T the longest row, zeros past each row's end (as the padded batch's positions
    there, which the loss mask drops)."""
    device = next(m.parameters()).device
    units = prefix_units(rows, groups)
    N, U = len(rows), len(units)
    Pmax = max(P for P, _ in units)
    unit_of = [0] * N  # on the host: the loops below need no device sync
    P_of = [0] * N
    prefix = torch.zeros(U, Pmax, dtype=torch.long)  # (U, Pmax) right-padded with id 0
    for u, (p, idx) in enumerate(units):
        prefix[u, :p] = torch.tensor(rows[idx[0]][:p])
        for i in idx:
            unit_of[i] = u
            P_of[i] = p
    unit = torch.tensor(unit_of, device=device)  # (N,)
    P = torch.tensor(P_of, device=device)  # (N,)
    prefix = prefix.to(device)
    cache = PrefixCache(m.config, unit, P)

    # the prefix pass: each unit's own tokens, and the logits at its last token, which predict token P
    logits = m(prefix, cache=cache, start_pos=0)  # (U, Pmax, V)
    logp = torch.log_softmax(upcast(logits) / temperature, dim=-1)
    own_p = logp[:, :-1].gather(-1, prefix[:, 1:, None])[..., 0]  # (U, Pmax - 1)
    first_id = torch.tensor([r[p] for r, p in zip(rows, P_of)], device=device)  # (N,)
    last = logp[unit, P - 1]  # (N, V)
    first = last.gather(-1, first_id[:, None])[:, 0]  # (N,)

    # the suffix pass: each row's tokens after its prefix, at positions P.., right-padded
    S = max(1, max(len(r) - 1 - p for r, p in zip(rows, P_of)))
    ids = torch.zeros(N, S + 1, dtype=torch.long)
    for i, (r, p) in enumerate(zip(rows, P_of)):
        ids[i, : len(r) - p] = torch.tensor(r[p:])
    ids = ids.to(device)
    cache.recording = False
    logits = m(ids[:, :-1], cache=cache, start_pos=P)  # (N, S, V)
    logp = torch.log_softmax(upcast(logits) / temperature, dim=-1)
    own_s = logp.gather(-1, ids[:, 1:, None])[..., 0]  # (N, S): token P + 1 + j of each row

    T = max(len(r) for r in rows)
    out = []
    for i, (r, p) in enumerate(zip(rows, P_of)):
        parts = [own_p[unit_of[i], : p - 1], first[i : i + 1], own_s[i, : len(r) - 1 - p]]
        row = torch.cat(parts)  # (len(r) - 1,)
        out.append(torch.nn.functional.pad(row, (0, T - 1 - row.shape[0])))
    return torch.stack(out)  # (N, T - 1)


def group_micro_batches(rows, groups, max_tokens, slack=1.25):
    """micro-batches of whole groups (their samples' prefix is encoded once, in the same forward), sorted by
    prefix and suffix length so like pads with like. A micro-batch's two forwards run units x its longest
    prefix + rows x its longest suffix padded tokens; a group joins the current micro-batch while that
    stays at most max_tokens and at most `slack` times what its groups would run alone (a 47-token chat
    prompt does not pad to a 280-token tool prompt); a group larger than max_tokens goes alone. max_tokens
    0: no cap. -> a list of lists of row indices."""
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    shapes = []  # per group: (longest prefix, longest suffix, units, rows), its rows
    for idx in members.values():
        units = prefix_units([rows[i] for i in idx], [0] * len(idx))
        Pg = max(P for P, _ in units)
        Sg = max(len(rows[idx[k]]) - 1 - P for P, ks in units for k in ks)
        shapes.append(((Pg, max(1, Sg), len(units), len(idx)), idx))
    shapes.sort(key=lambda x: (x[0][0], x[0][1], x[1][0]))
    out, cur = [], []
    Pm = Sm = n_units = n_rows = alone = 0
    for (Pg, Sg, ug, ng), idx in shapes:
        cost = (n_units + ug) * max(Pm, Pg) + (n_rows + ng) * max(Sm, Sg)
        own = ug * Pg + ng * Sg
        too_big = max_tokens > 0 and cost > max_tokens
        if cur and (too_big or cost > slack * (alone + own)):
            out.append(cur)
            cur = []
            Pm = Sm = n_units = n_rows = alone = 0
        cur += idx
        Pm, Sm = max(Pm, Pg), max(Sm, Sg)
        n_units += ug
        n_rows += ng
        alone += own
    if cur:
        out.append(cur)
    return out


def demo():
    import time

    import model

    torch.manual_seed(0)
    cfg = model.ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        index_topk=16,
        index_n_heads=2,
        index_head_dim=16,
        dsa_mode="sparse",
    )
    m = model.GLM5(cfg)
    prompt = torch.randint(0, 256, (200,)).tolist()
    rows = []
    for _ in range(8):  # the prompt, then 10 to 39 tokens of the sample's own
        own = int(torch.randint(10, 40, ()))
        rows.append(prompt + torch.randint(0, 256, (own,)).tolist())
    groups = [0] * len(rows)

    def one_each():  # one forward per sample, as rl.token_logprobs runs them
        want = []
        for r in rows:
            logp = m(torch.tensor([r[:-1]]))[0].log_softmax(-1)  # (len(r) - 1, V)
            want.append(logp.gather(-1, torch.tensor(r[1:])[:, None])[:, 0])
        return want

    with torch.no_grad():
        got = shared_token_logprobs(m, rows, groups)
        want = one_each()
        err = max(float((got[i, : len(r) - 1] - want[i]).abs().max()) for i, r in enumerate(rows))
        times = {"shared": [], "one forward each": []}
        for _ in range(3):  # alternating, after the warm-up above
            t0 = time.perf_counter()
            shared_token_logprobs(m, rows, groups)
            times["shared"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            one_each()
            times["one forward each"].append(time.perf_counter() - t0)
    print(f"8 samples of a 200-token prompt: max |shared - one forward each| = {err:.2e}")
    best = {k: min(v) * 1e3 for k, v in times.items()}
    each = best["one forward each"]
    print(f"forward, best of 3: shared {best['shared']:.0f} ms, one forward each {each:.0f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description="The shared-prefix forward of the RL trainer: on a random tiny GLM-5, compare the "
        "logprobs and the time of one shared-prefix forward against one forward per sample.",
        epilog="example: python shared_prefix.py",
    )
    ap.parse_args()
    demo()
