"""copy_probe.py, the induction measure (can a model copy a random sequence it has seen once?): a model
built by hand to copy from its context scores a low loss and near-perfect accuracy on the second copy, a
randomly initialised GLM-5 does not; and a training run logs the probe with every evaluation."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import copy_probe  # noqa: E402
import model  # noqa: E402

V = 4096


class Copier(nn.Module):
    """An induction head written out: at position t, find the latest earlier position j holding the same
    id as t and predict the id that followed it (logit 20); with no earlier match, every id alike."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))  # copy_probe reads the device from the parameters

    def forward(self, ids):
        B, T = ids.shape
        logits = torch.zeros(B, T, V)
        for b in range(B):
            last = {}  # id -> the latest position it was seen at
            for t in range(T):
                i = ids[b, t].item()
                if i in last:
                    logits[b, t, ids[b, last[i] + 1]] = 20.0
                last[i] = t
        return logits


def test_a_copying_model_scores_low_on_the_second_copy():
    r = copy_probe.copy_probe(Copier(), 4079, length=32, rows=4)
    assert r["second"] < 0.1, r
    assert r["acc_second"] > 0.95, r
    assert r["first"] > 5.0, r  # nothing predicts the first copy: about ln 4079 = 8.3


def test_a_random_model_does_not_copy():
    torch.manual_seed(0)
    cfg, _ = model.load_config_file(os.path.join(ROOT, "configs/toy.py"))
    m = model.GLM5(cfg)
    r = copy_probe.copy_probe(m, 4079, length=32, rows=4)
    assert abs(r["second"] - r["first"]) < 0.5, r
    assert r["acc_second"] < 0.05, r
    assert m.training, "the probe puts the model back in training mode"


def test_the_probe_draws_from_a_pool_of_ids():
    pool = torch.tensor([5, 9, 17, 4000])
    seen = set()

    class Spy(Copier):
        def forward(self, ids):
            seen.update(ids.flatten().tolist())
            return super().forward(ids)

    copy_probe.copy_probe(Spy(), pool, length=16, rows=2)
    assert seen <= set(pool.tolist()), seen


def test_bad_probe_sizes_are_refused():
    with pytest.raises(ValueError, match="length"):
        copy_probe.copy_probe(Copier(), 4079, length=1)


def test_copy_rows_repeat_and_mask_the_first_occurrence():
    g = torch.Generator().manual_seed(0)
    x, y = copy_probe.copy_rows(3, 40, 4079, g)
    assert x.shape == y.shape == (3, 40)
    for row, target in zip(x, y):
        L = int((target == -1).sum())  # the first occurrence and the second's first id are ignored
        assert 8 <= L <= 20
        assert torch.equal(row[L:], row[: 40 - L])  # period L
        assert torch.equal(target[L:-1], row[L + 1 :])
    pool = torch.tensor([3, 30, 300])
    x, y = copy_probe.copy_rows(2, 40, pool, g)
    assert set(x.flatten().tolist()) <= {3, 30, 300}
    text = torch.arange(41).repeat(2, 1)
    x, y = copy_probe.copy_rows(2, 40, 4079, g, text)
    assert (y >= 0).all()  # a text window's first occurrence is ordinary language modelling
    assert x[0, 0] == 0 and x[0, 1] == 1


@pytest.mark.slow
def test_training_logs_the_probe_at_every_evaluation(tmp_path):
    tiny = ["--hidden_size=32", "--intermediate_size=64", "--moe_intermediate_size=16"]
    tiny += ["--num_hidden_layers=2"]
    tiny += ["--q_lora_rank=16", "--kv_lora_rank=16", "--block_size=32", "--batch_size=2", "--eval_iters=1"]
    args = ["configs/toy.py", *tiny, "--max_iters=4", "--eval_interval=2", "--sample_tokens=0"]
    args += [f"--out_dir={tmp_path}", "--copy_probe_len=16", "--device=cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = [x for x in recs if "val_lm" in x]
    assert [x["step"] for x in evals] == [2, 4]
    assert all(set(x["copy"]) == {"first", "second", "acc_second"} for x in evals), evals
    assert all(set(x["copy_frequent"]) == {"first", "second", "acc_second"} for x in evals), evals
    assert "copy probe: loss" in r.stdout
