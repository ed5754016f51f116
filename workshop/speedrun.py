"""
The workshop run: every stage of GLM-5 (GLM-5 report, arXiv 2602.15763: pre-training, the two DSA adaptation
stages, post-training SFT with thinking modes, asynchronous agentic RL, W4A8 deployment, serving) at toy size,
in one command, with a report card.

    tokenizer + data -> copy warm-up -> pretrain (dense) -> DSA warm-up -> sparse stage -> environment
        episodes -> SFT -> SFT on the episodes alone -> RL (rl_async.py, async) -> quantize (W4A8 + rotation,
        W8A8) -> evaluations -> report.md + PNGs

The copy warm-up is the toy's aid, not a stage of the report (why: at the stage settings below). Each stage
is a subprocess of the project's own scripts writing to runs/<run>/<stage>/; a finished stage is skipped and
a stopped one resumes, so a re-run continues where the last one stopped (see "The stages" below).

Run it:
    python workshop/speedrun.py                           # the workshop run, 2-core CPU (--preset cpu)
    python workshop/speedrun.py --preset tiny --run tiny  # a few steps per stage: the plumbing only
    python workshop/speedrun.py --device cuda --config configs/small.py --preset gpu --run small
    python workshop/speedrun.py --set pretrain.max_iters=300 --set rl.max_steps=10   # any stage setting
    python workshop/speedrun.py --report_only             # rewrite report.md from what runs/<run>/ holds
Each stage runs from the repository's root (the folder above this one), whatever the current directory.
Tests: python -m pytest -q tests/test_speedrun.py

Honest limits: the stages and their order follow the report; their lengths are what fits 45 minutes on two
cores, thousands of times less than GLM-5's (the report card sets each figure beside the report's own). The
RL stage starts serve.py replicas on loopback ports (configs/rl_toy.py's two), so on a 2-core CPU the
trainer and the replicas share the cores. A stage's settings are checked by the script that runs them (an
unknown key is that script's one-sentence error, which the stage's failure line points to). The gpu preset
has not been run; its numbers are a starting point (run records: docs/design-notes.md).
"""

import argparse
import ast
import json
import os
import runpy
import shutil
import subprocess
import sys
import time

import speedrun_report
from speedrun_report import TRAIN_STAGES, finished

# the repository: configs/, data/, runs/, and the scripts each stage runs (from there, as its working dir)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_stages_tuned():
    """configs/speedrun_stages.py's STAGES -> {stage: train.py settings}, less the stage name (the speedrun
    passes --stage itself), with a sample at the end of pretraining and none after the others."""
    tuned = runpy.run_path(os.path.join(ROOT, "configs", "speedrun_stages.py"))["STAGES"]
    out = {}
    for name, settings in tuned.items():
        kept = {k: v for k, v in settings.items() if k != "stage"}
        kept["sample_tokens"] = 64 if name == "pretrain" else 0
        out[name] = kept
    return out


# -----------------------------------------------------------------------------
# The stage settings, one table per preset. Train stages take train.py's keys, rl takes rl_async.py's,
# episodes the solved conversations per environment, eval the sizes of speedrun_eval.py's measurements.
#
# The copy warm-up is not a stage of the report: it is the toy's aid. Induction heads, the attention that
# copies a token from where it occurred before, form early in a large model's pretraining (Olsson et al. 2022,
# arXiv 2209.11895); the toy's few million tokens of code do not form them, and without them the toy cannot
# carry a name from a prompt into a tool call. A few minutes of copy rows first do (README: the RL section).

PRESETS = {
    # the test's: a few steps per stage, only the plumbing (its numbers are noise)
    "tiny": {
        "copy_warmup": dict(max_iters=3, batch_size=2, block_size=64, warmup_iters=1, eval_interval=3,
                            eval_iters=1, sample_tokens=0, copy_frac=1.0),
        "pretrain": dict(max_iters=3, batch_size=2, block_size=128, warmup_iters=1, eval_interval=3,
                         eval_iters=1, sample_tokens=16),
        "dsa_warmup": dict(max_iters=2, batch_size=2, block_size=128, warmup_iters=1, eval_interval=2,
                           eval_iters=1, sample_tokens=0),
        "dsa_sparse": dict(max_iters=2, batch_size=2, block_size=128, warmup_iters=1, eval_interval=2,
                           eval_iters=1, sample_tokens=0),
        "episodes": dict(per_env=2),
        # the episodes only: rendering the stdlib conversations takes longer than the rest of the stage
        "sft": dict(max_iters=2, batch_size=2, block_size=256, warmup_iters=1, eval_interval=2,
                    eval_iters=1, sample_tokens=0, sft_stdlib=False),
        "sft_episodes": dict(max_iters=2, batch_size=2, block_size=256, warmup_iters=1, eval_interval=2,
                             eval_iters=1, sample_tokens=0),
        "rl": dict(max_steps=1, num_replicas=1, group_size=2, groups_per_step=1, task_concurrency=2,
                   eval_every=1, eval_episodes=2, ckpt_every=1, max_tokens=8),
        "eval": dict(val_batches=1, val_block=128, probes=2, probe_len=128, serve_prompts=2, new_tokens=8,
                     mtp_drafts=2, cache_groups=1, cache_max_tokens=4, quant_batches=1),
    },
    # the workshop run: 37 minutes on a quiet 2-core CPU, 14 of them RL. The train stages' settings
    # are the toy tuning's, read from configs/speedrun_stages.py (its docstring says what was measured): the
    # copy warm-up, Muon at 0.005, the WSD decay over the last third, and the MTP loss off for most of
    # pretraining and the sparse stage, where its three extra block passes cost a third to a half of a step
    # (back for the last 15%)
    "cpu": {
        **train_stages_tuned(),
        "episodes": dict(per_env=400),
        # the episodes alone after the mixed SFT: the mixed stage reads about a fifth of its 2M tokens and
        # solves few toy tasks; 150 steps on the episodes (Muon 0.005, as the mixed SFT) took held-out
        # general:0 to 0.63-0.72 and terminal:0 to 0.50, 4 min on 2 cores
        "sft_episodes": dict(
            max_iters=150, block_size=512, lr_muon=0.005, eval_interval=150, log_interval=25, sample_tokens=0,
            # train.py's defaults, written out: configs/toy.py's main-job recipe sets others
            lr_adamw=3e-3, mtp_weight_early=0.3, mtp_weight_late=0.1, mtp_switch_frac=0.5,
        ),
        # configs/rl_toy.py as it is: 50 steps of general:0, search:0 and terminal:0, held-out reward every
        # 10 (README: the RL section has this run's curve)
        "rl": dict(max_steps=90, eval_every=10, eval_episodes=64, ckpt_every=10),
        # probe_len 384: the passkey sits farther back than a 64-key window reaches through 4 layers (252);
        # mtp_drafts 4: the report's accept length is measured with 4 speculative steps
        "eval": dict(val_batches=8, val_block=256, probes=32, probe_len=384, serve_prompts=8, new_tokens=32,
                     mtp_drafts=4, cache_groups=8, cache_max_tokens=16, quant_batches=8),
    },
    # a GPU and configs/small.py:
    # python workshop/speedrun.py --device cuda --config configs/small.py --preset gpu
    "gpu": {
        # not measured on small.py (a larger model may form induction from the corpus alone): the toy's
        # warm-up as measured, at the rates at which it forms (at train.py's 0.02 the toy's does not)
        "copy_warmup": train_stages_tuned()["copy_warmup"],
        "pretrain": dict(max_iters=5000, batch_size=16, copy_frac=0.125, eval_interval=500, eval_iters=20,
                         sample_tokens=64),
        "dsa_warmup": dict(max_iters=500, batch_size=16, lr_adamw=5e-3, warmup_iters=20, eval_interval=250,
                           eval_iters=20, sample_tokens=0),
        "dsa_sparse": dict(max_iters=1000, batch_size=16, eval_interval=500, eval_iters=20, sample_tokens=0),
        "episodes": dict(per_env=1000),
        "sft": dict(max_iters=1000, batch_size=16, eval_interval=250, eval_iters=20, sample_tokens=0),
        "sft_episodes": dict(max_iters=400, batch_size=16, block_size=512, eval_interval=200, eval_iters=20,
                             sample_tokens=0),
        "rl": dict(max_steps=100, eval_every=25, eval_episodes=48, ckpt_every=25),
        # probe_len 4096: past what small.py's 256-key window reaches through its 12 layers (3060)
        "eval": dict(val_batches=16, val_block=2048, probes=64, probe_len=4096, serve_prompts=16,
                     new_tokens=64, mtp_drafts=4, cache_groups=4, cache_max_tokens=16, quant_batches=16),
    },
}

STAGES = [  # (name, what it does), in pipeline order; the report has one section per row
    ("data", "tokenizer and data: the BPE and the tokenized stdlib (tokenizer.py)"),
    ("copy_warmup", "induction warm-up: copy rows only, attention learns to copy (train.py --copy_frac=1.0)"),
    ("pretrain", "pretraining, dense attention (train.py --stage=pretrain)"),
    ("dsa_warmup", "DSA warm-up: only the indexers learn, from the KL (train.py --stage=dsa_warmup)"),
    ("dsa_sparse", "sparse stage: top-k attention, everything trains (train.py --stage=dsa_sparse)"),
    ("episodes", "solved toy-level environment episodes for SFT (episodes.py)"),
    ("sft", "SFT: stdlib conversations + environment episodes (train.py --stage=sft)"),
    ("sft_episodes", "SFT on the environment episodes alone (train.py --stage=sft --sft_stdlib=False)"),
    ("rl", "asynchronous agentic RL on toy-level tasks (rl_async.py configs/rl_toy.py)"),
    ("quantize", "W4A8 with rotation, and W8A8 (quantize.py)"),
    ("eval_dsa", "DSA vs dense val loss and the long-context probe (speedrun_eval.py dsa)"),
    ("eval_quant", "bytes and perplexity per scheme (speedrun_eval.py quant)"),
    ("eval_serve", "every checkpoint through the serving engine (speedrun_eval.py serve)"),
]
STAGE_NAMES = [name for name, _ in STAGES]
INIT_FROM = {
    "pretrain": "copy_warmup",
    "dsa_warmup": "pretrain",
    "dsa_sparse": "dsa_warmup",
    "sft": "dsa_sparse",
    "sft_episodes": "sft",
}
# the data stage: the BPE and the tokenized corpus, each trained or written once and cached in data/
DATA_SNIPPET = (
    "import data, tokenizer; "
    "data.prepare(4096, out_dir='data/stdlib', tokenizer=tokenizer.get_tokenizer(4096, cache_dir='data'))"
)
QUANT_SCHEMES = {"w4a8_rot": ["--scheme", "w4a8", "--rotate"], "w8a8": ["--scheme", "w8a8"]}


class StageFailed(Exception):
    pass


# -----------------------------------------------------------------------------
# Settings: the preset's table, then --set stage.key=value


def stage_settings(preset, overrides):
    """The preset's table with --set stage.key=value applied -> {stage: {key: value}} (a copy).
    One sentence on an unknown preset, stage or a malformed override."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; pick one of {', '.join(PRESETS)}")
    table = {stage: dict(kv) for stage, kv in PRESETS[preset].items()}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise SystemExit(f"--set {item!r}: write --set stage.key=value, e.g. --set pretrain.max_iters=50")
        lhs, text = item.split("=", 1)
        stage, key = lhs.split(".", 1)
        if stage not in table:
            raise SystemExit(f"--set {item!r}: no stage {stage!r} takes settings; one of {', '.join(table)}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word is a string
        table[stage][key] = value
    return table


def as_flags(settings):
    """{key: value} -> ["--key=value", ...], as train.py and rl_async.py read them."""
    return [f"--{k}={v}" for k, v in settings.items()]


# -----------------------------------------------------------------------------
# The stages: what each one runs, and where it writes
#
# Each stage is a subprocess of the project's own scripts (train.py, sft_data.py, rl_async.py, quantize.py,
# speedrun_eval.py), so a failure stays in its process, is named in one sentence with its log file, and leaves
# the earlier stages' checkpoints as they are. Everything a run writes goes to runs/<run>/<stage>/ (ckpt.pt,
# metrics.jsonl, log.txt, and done.json once the stage finished); a stage whose done.json is there is skipped,
# and a stage that was stopped midway resumes from its own last checkpoint (train.py's and rl_async.py's
# --resume=True), so a re-run continues where the last one stopped. runs/<run>/report.md (speedrun_report.py)
# is rewritten after every stage. The tokenized corpus is the one shared cache outside the run (data/, as
# README's two commands make it).


def stage_dir(run_dir, name):
    return os.path.join(run_dir, name)


def final_ckpt(run_dir):
    """The last trained policy: RL's if that stage finished, else the episodes SFT's, else SFT's."""
    for name in ("rl", "sft_episodes"):
        if os.path.isfile(os.path.join(run_dir, name, "done.json")):
            return os.path.join(run_dir, name, "ckpt.pt")
    return os.path.join(run_dir, "sft", "ckpt.pt")


def stage_commands(name, run_dir, table, args):
    """-> (the commands this stage runs, each an argv list, in order; the files that must exist after).
    A partly-written stage (a checkpoint and no done.json) resumes from its checkpoint."""
    py = sys.executable
    d = stage_dir(run_dir, name)
    ckpt = os.path.join(d, "ckpt.pt")
    device = [f"--device={args.device}"]
    if name == "data":
        return [[py, "-c", DATA_SNIPPET]], [os.path.join(ROOT, "data", "stdlib", "meta.json")]
    if name in TRAIN_STAGES:
        # sft_episodes is train.py's SFT stage again, and the copy warm-up its pretraining on copy rows
        stage = {"sft_episodes": "sft", "copy_warmup": "pretrain"}.get(name, name)
        cmd = [py, "train.py", args.config, f"--stage={stage}", f"--out_dir={d}"] + device
        if name in INIT_FROM:
            cmd.append(f"--init_from={os.path.join(run_dir, INIT_FROM[name], 'ckpt.pt')}")
        if stage == "sft":  # the solved episodes join the data (sft_episodes: they are all of it)
            episodes = os.path.join(run_dir, "episodes", "episodes.jsonl")
            cmd += [f"--sft_extra={episodes}", f"--sft_data_dir={os.path.join(d, 'data')}"]
        if name == "sft_episodes":
            cmd.append("--sft_stdlib=False")
        if os.path.isfile(ckpt):
            cmd.append("--resume=True")
        return [cmd + as_flags(table[name])], [ckpt]
    if name == "episodes":
        out = os.path.join(d, "episodes.jsonl")
        n = str(table["episodes"]["per_env"])
        envs = table["episodes"].get("envs", "math,search,terminal,general")
        # a file left by a stopped run is written again whole: the stage counts as done only by done.json
        return [[py, "episodes.py", n, out, "--difficulty", "0", "--env", envs]], [out]
    if name == "rl":
        cmd = [
            py,
            "rl_async.py",
            "configs/rl_toy.py",
            f"--init_from={os.path.join(run_dir, 'sft_episodes', 'ckpt.pt')}",
        ]
        cmd += [f"--out_dir={d}"] + device
        if os.path.isfile(ckpt):
            cmd.append("--resume=True")
        return [cmd + as_flags(table["rl"])], [ckpt]
    if name == "quantize":
        src = final_ckpt(run_dir)
        cmds = []
        for scheme, flags in QUANT_SCHEMES.items():
            cmds.append([py, "quantize.py", "--ckpt", src, "--out", os.path.join(d, scheme)] + flags)
        return cmds, [os.path.join(d, s, "config.json") for s in QUANT_SCHEMES]
    if name.startswith("eval_"):
        part = name[len("eval_") :]
        cmd = [py, os.path.join("workshop", "speedrun_eval.py"), part, "--run_dir", run_dir]
        cmd += ["--device", args.device]
        cmd += ["--settings", json.dumps(table["eval"]), "--out", os.path.join(d, "result.json")]
        return [cmd], [os.path.join(d, "result.json")]
    raise ValueError(f"no stage {name!r}")


def run_stage(name, run_dir, table, args, log=print):
    """Run one stage's commands as subprocesses, their output into <stage>/log.txt (and the console unless
    --quiet); on success write <stage>/done.json. Raises StageFailed with one sentence on a failure."""
    d = stage_dir(run_dir, name)
    os.makedirs(d, exist_ok=True)
    if name == "quantize":  # a half-written quantized directory is rewritten whole
        for scheme in QUANT_SCHEMES:
            shutil.rmtree(os.path.join(d, scheme), ignore_errors=True)
    cmds, outputs = stage_commands(name, run_dir, table, args)
    log_path = os.path.join(d, "log.txt")
    t0 = time.time()
    with open(log_path, "a") as f:
        for cmd in cmds:
            f.write(f"==> python {' '.join(cmd[1:])}\n")
            f.flush()
            env = dict(os.environ, PYTHONUNBUFFERED="1")  # its lines as they come, not when a buffer fills
            p = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for line in p.stdout:
                f.write(line)
                if not args.quiet:
                    print(f"[{name}] {line}", end="", flush=True)
            rc = p.wait()
            if rc != 0:
                f.write(f"==> exit status {rc}\n")
                raise StageFailed(
                    f"speedrun: stage {name} failed (exit status {rc}): see {log_path}; the earlier stages' "
                    f"checkpoints in {run_dir} are kept, and a re-run resumes at {name}"
                )
    missing = [o for o in outputs if not os.path.exists(o)]
    if missing:
        raise StageFailed(f"speedrun: stage {name} exited 0 but did not write {missing[0]}: see {log_path}")
    wall = time.time() - t0
    done = {
        "stage": name,
        "wall_s": wall,
        "commands": cmds,
        "load": os.getloadavg(),
        "settings": table.get(name, {}),
    }
    with open(os.path.join(d, "done.json"), "w") as f:
        json.dump(done, f, indent=1)
    log(f"speedrun: stage {name} done in {wall:.1f}s")
    return wall


# -----------------------------------------------------------------------------
# The run


def write_report(run_dir, args, failed=None):
    """report.md (and the plots) from what the run directory holds; a failure here never stops the run."""
    try:
        speedrun_report.write_report(run_dir, STAGE_NAMES, vars(args), failed=failed)
    except Exception as e:  # the report is a view of the run: a bug in it must not lose a finished stage
        print(f"speedrun: report.md not written ({type(e).__name__}: {e})", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description="GLM-5's pipeline in one command, with a report card")
    ap.add_argument("--preset", default="cpu", help=f"stage settings: {', '.join(PRESETS)}")
    ap.add_argument("--run", default=None, help="run name: runs/<run>/ (default: the preset's name)")
    ap.add_argument("--runs_dir", default=os.path.join(ROOT, "runs"), help="where run directories live")
    ap.add_argument("--config", default="configs/toy.py", help="the model config of every train stage")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (train stages, RL trainer, evals)")
    ap.add_argument("--set", action="append", default=[], help="stage.key=value over the preset's table")
    ap.add_argument("--stop_after", default=None, help="stop after this stage")
    ap.add_argument("--quiet", action="store_true", help="only one line per stage on the console")
    ap.add_argument("--report_only", action="store_true", help="rewrite report.md and stop")
    args = ap.parse_args(argv)
    table = stage_settings(args.preset, args.set)
    if args.stop_after is not None and args.stop_after not in STAGE_NAMES:
        raise SystemExit(f"--stop_after {args.stop_after!r}: no such stage; one of {', '.join(STAGE_NAMES)}")
    if not os.path.isfile(os.path.join(ROOT, args.config)) and not os.path.isfile(args.config):
        raise SystemExit(f"--config {args.config}: no such file; pass configs/toy.py or configs/small.py")
    run_dir = os.path.abspath(os.path.join(args.runs_dir, args.run or args.preset))
    os.makedirs(run_dir, exist_ok=True)
    saved = os.path.join(run_dir, "settings.json")
    if args.report_only:  # the report names the settings the run was made with, not this command's
        if os.path.isfile(saved):
            with open(saved) as f:
                args = argparse.Namespace(**json.load(f)["args"])
        write_report(run_dir, args)
        print(f"speedrun: wrote {os.path.join(run_dir, 'report.md')}")
        return run_dir
    with open(saved, "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)
    print(f"speedrun: run directory {run_dir}, preset {args.preset}, {args.config} on {args.device}")
    t0 = time.time()
    for name, what in STAGES:
        if finished(run_dir, name):
            print(f"speedrun: stage {name} already done (its done.json is there): skipped")
        else:
            print(f"speedrun: stage {name}: {what}", flush=True)
            try:
                run_stage(name, run_dir, table, args)
            except StageFailed as e:
                write_report(run_dir, args, failed=name)
                raise SystemExit(str(e)) from None
            except KeyboardInterrupt:  # Ctrl-C reached the stage's process too
                write_report(run_dir, args)
                raise SystemExit(
                    f"speedrun: stopped during stage {name}; the same command resumes it from its last "
                    "checkpoint"
                ) from None
            write_report(run_dir, args)
        if name == args.stop_after:
            break
    write_report(run_dir, args)
    print(
        f"speedrun: finished in {time.time() - t0:.0f}s; "
        f"the report card is {os.path.join(run_dir, 'report.md')}"
    )
    return run_dir


if __name__ == "__main__":
    main()
