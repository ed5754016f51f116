"""
Copying from context, measured and trained: the copy probe train.py logs at every evaluation, and the
synthetic copy rows it can mix into training batches (`copy_frac`).

GLM-5's DSA is built to keep long-context retrieval while attending to only index_topk tokens (GLM-5
report, section 2 "DSA"); the simplest retrieval there is copying a sequence seen earlier in the context,
which transformers do with induction heads (Olsson et al. 2022, "In-context learning and induction heads").

- copy_probe(m, ids): random sequences shown twice; the loss and top-1 accuracy on the second copy
  against the loss on the first. A copying model has second << first.
- frequent_ids(loader, n, k): the corpus' k most frequent ids, for a probe (or copy rows) drawn from the
  ids the model has actually learnt.
- copy_rows(n, T, ids, g): training rows that only copying predicts (or corpus text, repeated), drawn from
  the data generator so resume stays exact.

Run it: python train.py configs/toy.py (the probe is in every evaluation line);
    python bench/bench_train.py --copy_probe=out/ckpt.pt,out_sft/ckpt.pt  # a checkpoint, probed alone
    python bench/bench_copy.py                                          # does the toy learn to copy?
Tests: python -m pytest -q tests/test_copy_probe.py
Honest limits: the probe copies random ids, the plainest retrieval, not a fact buried in natural text
(workshop/speedrun_eval.py's passkey probe does that); the toy model trained on its CPU budget does not copy
(configs/speedrun_stages.py, bench/bench_copy.py).
"""

import numpy as np
import torch
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# The copy probe: can the model copy from its context (induction heads)?


@torch.no_grad()
def copy_probe(m, n_ids, length=64, rows=16, seed=0):
    """Induction, measured (Olsson et al. 2022, "In-context learning and induction heads"): `rows` random
    sequences of `length` ids drawn uniformly from [0, n_ids) (or from the ids in n_ids, a 1-D tensor: say
    the corpus' most frequent), each shown twice in a row. Nothing predicts the first copy (its loss is
    about ln n_ids for a model that learnt the corpus' unigrams away); a model that copies from its context
    predicts the second copy, token after token. The first token of the second copy follows r[-1], which
    never preceded r[0], so it is left out of both.
    m: a model mapping ids (B, T) to logits (B, T, V) (train.py's GLM5 without targets).
    -> {"first": mean loss on the first copy, "second": on the second, "acc_second": top-1 accuracy on
    the second copy}. A copying model has second << first and acc_second near 1; a model that cannot copy
    has second about first."""
    pool = n_ids if torch.is_tensor(n_ids) else None
    n = len(pool) if pool is not None else n_ids
    if n < 2 or length < 2:
        raise ValueError(f"copy_probe needs at least 2 ids and length >= 2, got {n} ids, length={length}")
    p = next(m.parameters())
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, n, (rows, length), generator=g)
    if pool is not None:
        r = pool[r]
    x = torch.cat([r, r], dim=1).to(p.device)  # (rows, 2 * length)
    was_training = m.training
    m.eval()
    logits = m(x[:, :-1]).float()  # (rows, 2 * length - 1, V): position t predicts x[:, t + 1]
    m.train(was_training)
    nll = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # (rows, 2 * length - 1)
    first = nll[:, : length - 1]  # targets x[1 .. length - 1]
    second = nll[:, length:]  # targets x[length + 1 .. 2 * length - 1]
    hits = logits[:, length:].argmax(-1) == x[:, length + 1 :]
    return {
        "first": first.mean().item(),
        "second": second.mean().item(),
        "acc_second": hits.float().mean().item(),
    }


# -----------------------------------------------------------------------------
# Copy rows: training data that rewards copying


def frequent_ids(loader, n_ids, k):
    """The k most frequent ids below n_ids in the training split (1-D tensor), counted over its shards."""
    counts = np.zeros(n_ids, dtype=np.int64)
    for shard in loader.shards["train"]:
        counts += np.bincount(np.asarray(shard), minlength=n_ids)[:n_ids]
    return torch.from_numpy(np.argsort(-counts, kind="stable")[:k].copy())


def copy_rows(n, T, n_ids, g, text=None):
    """n synthetic rows that copying predicts: each a sequence of L ids, L drawn from [8, T // 2], repeated
    to fill T + 1 tokens. The sequence is random ids from [0, n_ids), or from the ids of n_ids when it is a
    1-D tensor (copy_source "random" and "frequent": only copying
    predicts the repeats, and the targets inside the first occurrence are -1, ignored), or the first L
    tokens of a corpus window from `text` (n, T + 1) ("text": the first occurrence is ordinary language
    modelling, the repeats reward copying). Drawn from the data generator g, so resume stays exact.
    -> x, y (n, T)."""
    rows, targets = [], []
    for i in range(n):
        L = int(torch.randint(8, max(9, T // 2 + 1), (), generator=g))
        if text is None and torch.is_tensor(n_ids):
            seq = n_ids[torch.randint(0, len(n_ids), (L,), generator=g)]
        elif text is None:
            seq = torch.randint(0, n_ids, (L,), generator=g)
        else:
            seq = text[i, :L]
        xy = seq.repeat(T // L + 2)[: T + 1]  # (T + 1,)
        y = xy[1:].clone()
        if text is None:
            y[:L] = -1  # the first occurrence and the second's first id (r[-1] never preceded r[0])
        rows.append(xy[:-1])
        targets.append(y)
    return torch.stack(rows), torch.stack(targets)
