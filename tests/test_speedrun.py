"""The workshop run (workshop/speedrun.py): its plumbing at tiny size. A stage's failure stops the run with
the stage and its log named and the earlier checkpoints kept; a re-run skips the finished stages; the whole
tiny pipeline writes a report whose every section has a number (slow: about a minute and a half on 2
cores); the probe's sliding window keeps exactly the last index_topk positions, as DSA keeps index_topk.
Run: python -m pytest -q tests/test_speedrun.py   (add -m "not slow" for the fast part)
"""

import argparse
import os
import re
import sys

import pytest
import torch

import dsa
import speedrun
import speedrun_eval
import speedrun_report


def tiny(runs_dir, *more):
    return ["--preset", "tiny", "--run", "t", "--runs_dir", str(runs_dir), "--quiet", *more]


def sections(report):
    """report.md -> {section title: its text}."""
    parts = re.split(r"^## ", report, flags=re.M)[1:]
    return {p.split("\n", 1)[0]: p.split("\n", 1)[1] for p in parts}


def test_settings_overrides_and_their_errors():
    table = speedrun.stage_settings("tiny", ["pretrain.max_iters=7", "rl.tasks=math:0:1"])
    assert table["pretrain"]["max_iters"] == 7
    assert table["rl"]["tasks"] == "math:0:1"
    assert speedrun.PRESETS["tiny"]["pretrain"]["max_iters"] == 3  # the table itself is untouched
    for bad, word in [("pretrain=3", "stage.key=value"), ("nope.x=1", "no stage 'nope'")]:
        with pytest.raises(SystemExit, match=word):
            speedrun.stage_settings("tiny", [bad])
    with pytest.raises(SystemExit, match="unknown preset"):
        speedrun.stage_settings("laptop", [])
    for preset in speedrun.PRESETS.values():  # every preset sets every stage that takes settings
        stages = {"copy_warmup", "pretrain", "dsa_warmup", "dsa_sparse", "episodes", "sft", "sft_episodes"}
        stages |= {"rl", "eval"}
        assert set(preset) == stages


def test_report_of_an_empty_run_says_every_stage_is_not_run(tmp_path):
    speedrun_report.write_report(str(tmp_path), speedrun.STAGE_NAMES, {"preset": "tiny"})
    report = open(tmp_path / "report.md").read()
    secs = sections(report)
    assert len(secs) == 7  # six stages' sections and the plots
    for title, text in secs.items():
        if title != "Plots":
            assert "not run yet" in text, title
    assert report.count("| not run |") == len(speedrun.STAGES)


def test_a_failed_stage_is_named_keeps_earlier_checkpoints_and_a_rerun_skips_them(tmp_path, capsys):
    bad = tiny(tmp_path, "--set", "dsa_warmup.no_such_key=1")
    with pytest.raises(SystemExit) as e:
        speedrun.main(bad)
    run = tmp_path / "t"
    msg = str(e.value)
    assert "stage dsa_warmup failed" in msg and str(run / "dsa_warmup" / "log.txt") in msg
    assert "unknown config key 'no_such_key'" in open(run / "dsa_warmup" / "log.txt").read()
    ckpt = run / "pretrain" / "ckpt.pt"
    assert ckpt.is_file() and (run / "pretrain" / "done.json").is_file()
    assert not (run / "dsa_warmup" / "done.json").exists()
    report = open(run / "report.md").read()
    assert "| dsa_warmup |" in report and "FAILED" in report and "val loss" in report
    before = os.path.getmtime(ckpt)
    capsys.readouterr()
    speedrun.main(tiny(tmp_path, "--stop_after", "pretrain"))
    out = capsys.readouterr().out
    assert "stage data already done" in out and "stage pretrain already done" in out
    assert os.path.getmtime(ckpt) == before  # skipped, not retrained


def test_window_selection_keeps_the_last_k_positions_and_is_undone():
    B, T, Hi, Di, K = 2, 10, 2, 4, 3
    q, k = torch.randn(B, T, Hi, Di), torch.randn(B, T, Di)
    w = torch.randn(B, T, Hi)
    last = torch.arange(T)[None]
    idx, valid = speedrun_eval.window_topk(q, w, k, last, K, 0.5)
    for t in range(T):
        kept = sorted(idx[0, t][valid[0, t]].tolist())
        assert kept == list(range(max(0, t - K + 1), t + 1))
    orig = dsa.index_topk
    with speedrun_eval.Selection("window") as sel:
        assert dsa.index_topk is not orig
        dsa.index_topk(q, w, k, last, K, 0.5)
    assert dsa.index_topk is orig and len(sel.seen) == 1
    # DSA keeps the same number of keys, chosen by score: the budget is the only thing held equal
    idx_dsa, valid_dsa = orig(q, w, k, last, K, 0.5)
    assert torch.equal(valid_dsa.sum(-1), valid.sum(-1))


@pytest.mark.slow
def test_tiny_pipeline_end_to_end_every_section_has_a_number(tmp_path, capsys):
    run = speedrun.main(tiny(tmp_path))
    report = open(os.path.join(run, "report.md")).read()
    assert "not run" not in report and "FAILED" not in report
    for title, text in sections(report).items():
        if title != "Plots":
            assert re.search(r"\*\*[-+]?\d+(\.\d+)?%?\*\*", text), f"section {title!r} has no number in bold"
    assert "plots skipped" in report or "loss_curves.png" in report
    capsys.readouterr()
    speedrun.main(tiny(tmp_path))  # the re-run: every stage skipped
    out = capsys.readouterr().out
    assert out.count("already done") == len(speedrun.STAGES)


def test_report_without_matplotlib_says_plots_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    speedrun_report.write_report(str(tmp_path), speedrun.STAGE_NAMES, {"preset": "tiny"})
    assert "plots skipped: matplotlib not installed" in open(tmp_path / "report.md").read()


def test_a_stage_stopped_midway_resumes_from_its_own_checkpoint(tmp_path):
    args = argparse.Namespace(device="cpu", config="configs/toy.py")
    table = speedrun.stage_settings("tiny", [])
    run = str(tmp_path)
    for name in ("pretrain", "rl"):
        cmds, outputs = speedrun.stage_commands(name, run, table, args)
        assert "--resume=True" not in cmds[0] and outputs == [os.path.join(run, name, "ckpt.pt")]
        os.makedirs(os.path.join(run, name))
        open(os.path.join(run, name, "ckpt.pt"), "w").close()  # a checkpoint, and no done.json
        cmds, _ = speedrun.stage_commands(name, run, table, args)
        assert "--resume=True" in cmds[0]
    cmds, _ = speedrun.stage_commands("sft", run, table, args)
    assert f"--init_from={os.path.join(run, 'dsa_sparse', 'ckpt.pt')}" in cmds[0]
    # the copy warm-up is train.py's pretraining on copy rows alone, and pretraining continues from it
    cmds, _ = speedrun.stage_commands("copy_warmup", run, table, args)
    assert "--stage=pretrain" in cmds[0] and "--copy_frac=1.0" in cmds[0]
    assert not any(c.startswith("--init_from=") for c in cmds[0])
    cmds, _ = speedrun.stage_commands("pretrain", run, table, args)
    assert f"--init_from={os.path.join(run, 'copy_warmup', 'ckpt.pt')}" in cmds[0]
    # the episodes-only SFT continues the mixed one, and RL starts from it
    cmds, _ = speedrun.stage_commands("sft_episodes", run, table, args)
    assert f"--init_from={os.path.join(run, 'sft', 'ckpt.pt')}" in cmds[0] and "--sft_stdlib=False" in cmds[0]
    assert "--stage=sft" in cmds[0]
    cmds, _ = speedrun.stage_commands("rl", run, table, args)
    assert f"--init_from={os.path.join(run, 'sft_episodes', 'ckpt.pt')}" in cmds[0]
