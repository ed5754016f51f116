"""parallel.py through train.py: the memory plan and --dry_run on the 744B config, and two CPU processes
under torchrun (gloo) with FSDP2, and with FSDP2 + expert parallelism, against one process on the same
global batch: per-step losses, final weights, optimizer state, and checkpoints that move between world
sizes (a 2-rank checkpoint resumed by one process continues like the 1-process run).

Equivalence tested: 2 ranks at batch_size 2 draw, row for row, the 4 sequences one process draws at
batch_size 4 (train.py draws the global batch on every rank and keeps its rows). The math is then the
same; only float32 summation order differs (each rank averages its half, FSDP averages the halves), so
losses agree to rtol 1e-5 and weights to 2e-5 after 4 Muon + AdamW steps (observed: ~1e-7 and ~1e-6).
A missing gradient average, a wrong expert owner or a dropped token moves the loss by far more than that."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from test_train import TINY, step_losses  # noqa: E402

import model  # noqa: E402
import muon  # noqa: E402
import parallel  # noqa: E402
from conftest import tiny_config  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
STEPS, MORE = 4, 6  # steps in the first run, and after resuming
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)


def train(out, *args, ranks=1, batch=4, check=True):
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        if ranks > 1
        else [sys.executable]
    )
    argv = launch + [
        "train.py",
        *TINY,
        f"--batch_size={batch}",
        f"--out_dir={out}",
        "--eval_interval=2",
        *args,
    ]
    r = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def ckpt(out):
    return torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)


def assert_same_run(a_dir, b_dir, after_last_resume=False):
    a = step_losses(os.path.join(a_dir, "metrics.jsonl"), after_last_resume)
    b = step_losses(os.path.join(b_dir, "metrics.jsonl"), after_last_resume)
    assert sorted(a) == sorted(b) and a
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=1e-5, abs=1e-7), f"step {s}: {a[s]} vs {b[s]}"
    wa, wb = ckpt(a_dir), ckpt(b_dir)
    assert set(wa["model"]) == set(wb["model"])  # global names: experts included, whatever the sharding
    for n in wa["model"]:
        torch.testing.assert_close(wb["model"][n], wa["model"][n], rtol=0, atol=2e-5, msg=n)
    for opt in ("muon", "adamw"):
        sa, sb = wa[opt]["state"], wb[opt]["state"]
        assert set(sa) == set(sb), f"{opt}: states for different parameters"
        assert [sorted(g["params"]) for g in wa[opt]["param_groups"]] == [
            sorted(g["params"]) for g in wb[opt]["param_groups"]
        ]
        for n in sa:
            for k in sa[n]:
                torch.testing.assert_close(sb[n][k], sa[n][k], rtol=0, atol=2e-5, msg=f"{opt} {n} {k}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process at batch_size 4 for STEPS steps, and its continuation to MORE steps."""
    out = tmp_path_factory.mktemp("single")
    train(out, f"--max_iters={STEPS}")
    more = tmp_path_factory.mktemp("single_more")
    shutil.copytree(out, more, dirs_exist_ok=True)
    train(more, f"--max_iters={MORE}", "--resume=True")
    return out, more


# -----------------------------------------------------------------------------
# The plan


def test_plan_counts_from_the_skeleton_equal_the_whole_model():
    cfg = model.ModelConfig(
        **dict(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=80,
            moe_intermediate_size=16,
            num_hidden_layers=5,
            first_k_dense_replace=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=20,
            n_routed_experts=8,
            num_experts_per_tok=3,
            index_head_dim=12,
            index_n_heads=2,
        )
    )
    c = parallel.plan_counts(cfg)
    with torch.device("meta"):
        whole = model.param_counts(model.GLM5(cfg))
    assert c["total"] == whole["total (with MTP)"] and c["without mtp"] == whole["total without MTP"]
    assert c["activated"] == whole["activated per token (without MTP)"]


@pytest.mark.slow
def test_dry_run_prints_the_full_plan_and_exits_0():
    base = [sys.executable, "train.py", "configs/full.py", "--dry_run=True", "--device=cpu"]
    r = subprocess.run(base, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "plan for 1 rank(s)" in r.stdout and "753.9B total (743.9B without the MTP layer)" in r.stdout, (
        r.stdout
    )
    assert "(39.9B without embeddings)" in r.stdout
    assert "Muon momentum" in r.stdout and "AdamW moments" in r.stdout
    # the plan does not fit one rank here: the dry run says so in the sentence a real run stops with
    verdict = r.stdout.strip().splitlines()[-1]
    assert verdict.startswith("this config needs about") and "GiB per rank on 1 rank(s)" in verdict, verdict
    r = subprocess.run(
        base + ["--plan_world_size=64", "--expert_parallel=True"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "plan for 64 rank(s), FSDP2, expert parallel: 4 of 256 experts per rank" in r.stdout, r.stdout
    weights = next(line for line in r.stdout.splitlines() if line.strip().startswith("weights (fp32)"))
    assert f"{753.9 / 64:.1f}B" in weights, weights  # 753.9B sharded 64 ways


@pytest.mark.slow
def test_too_big_config_exits_with_one_sentence():
    r = subprocess.run(
        [sys.executable, "train.py", "configs/full.py", "--device=cpu"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    msg = r.stderr.strip().splitlines()[-1]
    assert msg.startswith("this config needs about") and "GiB per rank" in msg and "smaller config" in msg, (
        msg
    )
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *TINY,
            "--expert_parallel=True",
            "--plan_world_size=3",
            "--dry_run=True",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "divisible" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# -----------------------------------------------------------------------------
# Two ranks against one process


@pytest.mark.slow
def test_fsdp2_two_ranks_match_one_process_and_resume(single, tmp_path):
    ref, ref_more = single
    r = train(tmp_path, f"--max_iters={STEPS}", ranks=2, batch=2)
    assert "plan for 2 rank(s), FSDP2\n" in r.stdout and r.stdout.count("step 1 | loss") == 1  # rank 0 prints
    assert_same_run(ref, tmp_path)
    assert len(ckpt(tmp_path)["rng"]) == 2
    # the sharded optimizer comes back
    train(tmp_path, f"--max_iters={MORE}", "--resume=True", ranks=2, batch=2)
    assert_same_run(ref_more, tmp_path, after_last_resume=True)


@pytest.mark.slow
def test_expert_parallel_two_ranks_match_one_process_and_load_without_ep(single, tmp_path):
    ref, ref_more = single
    r = train(tmp_path, f"--max_iters={STEPS}", "--expert_parallel=True", ranks=2, batch=2)
    assert "expert parallel: 2 of 4 experts per rank" in r.stdout, r.stdout[-3000:]
    assert_same_run(ref, tmp_path)
    names = ckpt(tmp_path)["model"]
    # the stacked experts come back whole (all 4, gathered from both ranks' halves) under their own names
    assert names["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 4
    assert names["mtp_layers.0.mlp.experts.down_proj"].shape[0] == 4
    train(tmp_path, f"--max_iters={MORE}", "--resume=True")  # one process, no EP, continues the EP run
    assert_same_run(ref_more, tmp_path, after_last_resume=True)
    assert json.loads(open(tmp_path / "metrics.jsonl").readline())["world_size"] == 2


# -----------------------------------------------------------------------------
# An older checkpoint (one parameter per expert) resumes with the stacked experts


def test_per_expert_optimizer_state_of_an_older_checkpoint_is_stacked_on_resume():
    """train.py --resume on a ckpt.pt written before the experts were stacked: Muon's per-expert momentum
    entries (and their old groups) load into the stacked parameters, each expert's rows where its weights
    went; the other states load as before."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    cfg = tiny_config()
    m = model.GLM5(cfg)
    opts = muon.build_optimizers(m)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    for o in opts:
        o.step()
    osds = [get_optimizer_state_dict(m, o, options=StateDictOptions(**parallel.FULL)) for o in opts]
    old = {"state": {}, "param_groups": []}  # osds[0] as an older train.py wrote it
    for n, s in osds[0]["state"].items():
        if n.endswith("experts.gate_up_proj"):
            gate, up = s["momentum_buffer"].chunk(2, dim=1)
            for e in range(gate.shape[0]):
                for proj, t in (("gate_proj", gate[e]), ("up_proj", up[e])):
                    old["state"][n.replace("gate_up_proj", f"{e}.{proj}.weight")] = {"momentum_buffer": t}
        elif n.endswith("experts.down_proj"):
            for e, t in enumerate(s["momentum_buffer"]):
                old["state"][n.replace("down_proj", f"{e}.down_proj.weight")] = {"momentum_buffer": t}
        else:
            old["state"][n] = s
    for g in osds[0]["param_groups"]:
        names = [x for x in g["params"] if ".experts." not in x]
        if g["split"] is None:  # the unsplit Muon group held every expert matrix
            names += [x for x in old["state"] if ".experts." in x]
        old["param_groups"].append(dict(g, params=names, names=names))
    fresh = model.GLM5(cfg)
    fresh_opts = muon.build_optimizers(fresh)
    parallel.load_optimizer_states(fresh, fresh_opts, [old, osds[1]])
    got = [get_optimizer_state_dict(fresh, o, options=StateDictOptions(**parallel.FULL)) for o in fresh_opts]
    for want, have in zip(osds, got):
        assert set(want["state"]) == set(have["state"])
        for n in want["state"]:
            for k, v in want["state"][n].items():
                assert torch.equal(have["state"][n][k], v), (n, k)
    def splits(o):  # the load hands tuples back as lists; Muon reads either
        return [g["split"] and tuple(g["split"]) for g in o.param_groups]

    assert splits(fresh_opts[0]) == splits(opts[0])
