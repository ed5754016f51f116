"""
GLM-5's asynchronous RL loop (GLM-5 report, arXiv 2602.15763, its post-training sections: the agentic RL
infrastructure that decouples rollouts from training, with the TITO gateway, DP-aware routing, the multi-task
rollout orchestrator and the dropping of stale and failed samples; the stages reasoning, agentic and general
RL, then on-policy cross-stage distillation). Rollouts run on serve.py replicas (replicas.py), played by
orchestrator.py through rollout.py's agent loop; the trainer takes finished groups, filters them, takes one
rl.py step and pushes the weights to every replica. mode "sync" generates a batch, then trains it; "async"
keeps more batches in flight while the trainer steps, tau bounding how stale a sample may be. The on-policy
stages (reasoning, distill) run sync with tau 0 and a push every step, and nothing else is accepted.

Run it:
    python rl_async.py configs/rl_toy.py        # the workshop run's RL stage: 2 replicas of the toy SFT model
    python rl_async.py configs/rl_reasoning.py  # the report's stages in order: then rl_agentic, rl_general,
                                                # rl_distill (each from the last one's checkpoint)
    python rl_async.py configs/rl_toy.py --mode=sync --max_steps=5   # any setting as --key=value
    python rl_async.py configs/rl_toy.py --resume=True                # continue a killed run exactly
    torchrun --nproc_per_node=2 rl_async.py configs/rl_toy.py        # the trainer on two ranks (FSDP2)
Tests: python -m pytest -q tests/test_rl.py tests/test_rl_async.py
Honest limits: the learning rates, eps bands, K and tau are ours (GLM-5 does not publish its RL ones); the
trainer computes in fp32 and under torchrun has run on CPU ranks only, not GPUs; a push goes to the replicas
one after another (each token is tagged with the version that sampled it); a timed-out rollout's thread
cannot be killed; the async/sync equality and exact resume hold with the replicas' prefix cache off and one
rollout at a time per task (a cache hit moves a logprob by a few ulps). Measured runs: docs/rl.md.
"""

import ast
import atexit
import dataclasses
import datetime
import difflib
import json
import os
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import engine
import parallel
import rl
import serve
from orchestrator import Orchestrator, parse_eval_tasks, parse_tasks
from replicas import process_restarter, push_weights, start_replicas, stop_replicas, weight_version
from rl import filter_buffer
from train import pick_device, print_settings_help, quiet, save_checkpoint, wants_help

# -----------------------------------------------------------------------------
# How the loop works
#
# - replicas: serve.py servers given as URLs (a cluster's) or started here on free loopback ports and stopped
#   at exit. Each rollout id is pinned to one replica by rl.route. A replica that refuses connections leaves
#   the ring and its rollouts start over on the others (the partial record is thrown away, so nothing is
#   trained twice); one this script started is restarted, one given as a URL is probed; once it answers it
#   gets the trainer's last pushed weights and rejoins the ring.
# - the orchestrator: groups of group_size rollouts (one task, one training-split seed; held-out seeds stay
#   for evaluation), the task drawn from the mix, on one thread pool per task (its concurrency cap). A rollout
#   that raises or outlives rollout_timeout gives a failed sample; the group rule drops it.
# - the trainer: wait for groups_per_step finished groups, rl.filter_buffer against its own version,
#   rl.rl_step, and every push_every steps save_pretrained + POST /update_weights_from_disk to every replica
#   (version = step), then the optimizer reset the report does after each push (reset_on_push).
# - the stages, in the report's order: "reasoning" (Eq. 1, rl.reasoning_loss, on math, entirely
#   on-policy), "agentic" (direct double-sided importance sampling, rl.agentic_loss, asynchronous),
#   "general" (the agentic loss on rule-based rewards; the report does not spell out its objective), then
#   "distill" last (each token's advantage sg[log pi_teacher - log pi_student] through Eq. 1, the teacher
#   of each task the final checkpoint of the stage that trained it, `teachers`). A distill run after every
#   stage is the option one summary of the report describes. eval_tasks adds the earlier stages' tasks to
#   the held-out evaluation, so forgetting shows in the log.
# - checkpoints: out_dir/ckpt.pt, atomic, every ckpt_every steps: the model, both optimizers, the step, the
#   orchestrator's state and the settings. --resume=True gives the replicas its weights, plays its untrained
#   groups again with the same ids and seeds and cuts metrics.jsonl back; the sampling settings must be the
#   same (RESUME_SAME) and the replicas not past its version. A sync run resumed equals the one never killed;
#   an async one samples the groups in flight at the save again (as slime throws partial rollouts away).
# - at scale the trainer runs under torchrun with train.py's sharding (FSDP2, optional expert parallelism):
#   rank 0 runs the loop and broadcasts each step's batch; every rank trains its rows (rl.backward_batch); a
#   push or a checkpoint gathers the shards to rank 0. A push goes through storage every replica reads; a
#   torch.distributed broadcast from the trainer's ranks to the replicas' would skip the disk, and is not
#   built.


# -----------------------------------------------------------------------------
# The training loop: settings
#
# Plain globals, as train.py has them; a configs/*.py file (plain assignments), then --key=value, override
# them. configs/rl_toy.py sets the toy run.

init_from = "runs/cpu/sft_episodes/ckpt.pt"  # the policy to start from: a ckpt.pt or a directory
out_dir = "out_rl"  # ckpt.pt, metrics.jsonl and the pushed weights (out_dir/push/v<step>) go here
stage = "agentic"  # "reasoning", "agentic", "general" or "distill": picks the loss (see STAGE_LOSS)
teachers = ""  # distill: each task's teacher, "math:0=out_rl_reasoning/ckpt.pt,search:0=..."
resume = False  # continue from out_dir/ckpt.pt: weights, optimizers, step, the orchestrator's state
ckpt_every = 5  # write out_dir/ckpt.pt every this many steps (and at the end)
mode = "async"  # "async": rollouts run on while the trainer steps; "sync": generate a batch, then train
replicas = ""  # comma-separated replica URLs (a cluster's); empty: start num_replicas serve.py processes
num_replicas = 2  # serve.py processes rl_async.py starts on free loopback ports (and stops at exit)
tasks = "math:0:1"  # the task mix: env name (envs.ENVS):difficulty:weight, comma-separated
eval_tasks = ""  # more tasks ("name:difficulty", comma-separated) to evaluate on: earlier stages' tasks
task_concurrency = 4  # at most this many rollouts of one task run at once (its thread pool's size)
group_size = 4  # G: rollouts per prompt (same env, same seed), compared by group_advantages
groups_per_step = 4  # groups in one trainer batch
ahead = 1  # async: keep up to (1 + ahead) * groups_per_step groups in flight or buffered
tau = 1  # staleness: drop a trajectory sampled more than tau versions before the trainer's current one
push_every = 1  # K: save and push the weights to every replica every K steps (version = step)
reset_on_push = True  # reset the optimizers after each push, as the report's agentic RL does (rl.py)
max_steps = 20  # trainer steps
lr_muon = 2e-3  # placeholders: GLM-5 does not publish its RL learning rates
lr_adamw = 3e-4
grad_clip = 1.0
micro_tokens = 8192  # gradient accumulation: at most this many padded tokens per forward (rl.micro_batches)
shared_prefix = True  # the trainer encodes each group's prompt once (shared_prefix.py); False: every row
temperature = 1.0  # the replicas sample at it, and token_logprobs divides by it
max_tokens = 96  # per generation request
thinking = False  # rollouts open the reply with <think> (True) or </think> (False)
rollout_timeout = 120.0  # seconds: a rollout still running then is abandoned and marked failed
eval_every = 5  # held-out reward every this many steps (0: never), and at step 0 and the end
eval_episodes = 16  # per task, on held-out seeds (envs.split_of), one sample each
push_dtype = "float32"  # the dtype the pushed safetensors are written in
device = "auto"  # the trainer's: "auto" (cuda > mps > cpu), "cpu", "cuda"; under torchrun cuda:LOCAL_RANK
expert_parallel = False  # under torchrun: each rank holds n_routed_experts / world experts (train.py's)
seed = 0  # the first training seed of every task; sampling seeds derive from the rollout id

LOOP_DEFAULTS = {
    k: v
    for k, v in list(globals().items())
    if not k.startswith("_") and k.islower() and isinstance(v, (bool, int, float, str))
}

# what a resumed run must keep: the task draws, the groups and their sampling replay with these
RESUME_SAME = (
    "stage",
    "tasks",
    "group_size",
    "groups_per_step",
    "seed",
    "temperature",
    "max_tokens",
    "thinking",
)

STAGE_LOSS = {"reasoning": "reasoning", "agentic": "agentic", "general": "agentic", "distill": "distill"}


def resolve_config(argv):
    """argv (without the script name) -> the settings dict: LOOP_DEFAULTS, then each config file's plain
    assignments, then --key=value, type-checked (an int is accepted for a float). One sentence on a bad
    key or value."""
    cfg = dict(LOOP_DEFAULTS)
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise SystemExit(f"override {arg!r} needs a value: write --key=value")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare word is a string
            items = {key: value}
            where = "command line"
        else:
            if not os.path.isfile(arg):
                raise SystemExit(f"no config file {arg}")
            items = {}
            where = arg
            with open(arg) as f:
                exec(f.read(), {}, items)
        for key, value in items.items():
            if key.startswith("_"):
                continue
            if key not in LOOP_DEFAULTS:
                hint = difflib.get_close_matches(key, LOOP_DEFAULTS, n=1)
                maybe = f"; did you mean {hint[0]!r}?" if hint else "; see the globals in rl_async.py"
                raise SystemExit(f"{where}: unknown setting {key!r}{maybe}")
            like = LOOP_DEFAULTS[key]
            if isinstance(like, float) and type(value) is int:
                value = float(value)
            if type(value) is not type(like):
                raise SystemExit(f"{where}: {key} must be {type(like).__name__} like {like!r}, got {value!r}")
            cfg[key] = value
    check_config(cfg)
    return cfg


def check_config(cfg):
    """One sentence for a setting that cannot work together with the others."""
    if cfg["mode"] not in ("async", "sync"):
        raise SystemExit(f"mode must be 'async' or 'sync', got {cfg['mode']!r}")
    if cfg["stage"] not in STAGE_LOSS:
        raise SystemExit(f"stage must be one of {', '.join(STAGE_LOSS)}, got {cfg['stage']!r}")
    mix = parse_tasks(cfg["tasks"])
    parse_eval_tasks(cfg["eval_tasks"])
    teachers = parse_teachers(cfg["teachers"])
    if cfg["stage"] == "distill":
        if cfg["group_size"] != 1:
            raise SystemExit(
                "stage distill samples one rollout per prompt (its advantage needs no group): "
                "set group_size=1"
            )
        missing = [f"{n}:{d}" for n, d, _ in mix if f"{n}:{d}" not in teachers]
        if missing:
            raise SystemExit(
                f"stage distill needs a teacher for every task; none for {', '.join(missing)}: add "
                f"--teachers={missing[0]}=PATH (an earlier stage's ckpt.pt)"
            )
    elif teachers:
        raise SystemExit(f"teachers are for stage distill; this is stage {cfg['stage']}: drop --teachers")
    if cfg["stage"] in rl.ON_POLICY:
        need = (("mode", "sync"), ("tau", 0), ("push_every", 1))
        off = [f"{k}={cfg[k]!r}" for k, want in need if cfg[k] != want]
        if off:
            raise SystemExit(
                f"stage {cfg['stage']} is on-policy (GLM-5 report: every batch sampled by the weights it "
                f"trains), but {', '.join(off)} would train on older samples: set --mode=sync --tau=0 "
                "--push_every=1"
            )
    for key in ("group_size", "groups_per_step", "max_steps", "push_every", "ckpt_every", "task_concurrency"):
        if cfg[key] < 1:
            raise SystemExit(f"{key} must be at least 1, got {cfg[key]}")
    for key in ("tau", "ahead"):
        if cfg[key] < 0:
            raise SystemExit(f"{key} must be 0 or more, got {cfg[key]}")
    if cfg["tau"] < cfg["push_every"] - 1:
        raise SystemExit(
            f"tau={cfg['tau']} with push_every={cfg['push_every']}: the samples of a step after a skipped "
            f"push are {cfg['push_every'] - 1} versions behind and would all be dropped; "
            "set tau >= push_every - 1"
        )
    if cfg["eval_every"] and cfg["eval_episodes"] < 1:
        raise SystemExit("eval_episodes must be at least 1 when eval_every is on (or set eval_every=0)")
    if not isinstance(getattr(torch, cfg["push_dtype"], None), torch.dtype):
        raise SystemExit(f"push_dtype {cfg['push_dtype']!r} is not a torch dtype; use float32 or bfloat16")


def parse_teachers(spec):
    """ "math:0=out_a/ckpt.pt,search:0=out_b" -> {"math:0": "out_a/ckpt.pt", "search:0": "out_b"}."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise SystemExit(f"teacher {item!r}: write task=path, e.g. math:0=out_rl_reasoning/ckpt.pt")
        task, path = item.split("=", 1)
        out[task.strip()] = path.strip()
    return out


# -----------------------------------------------------------------------------
# Checkpoints of the trainer


def save_rl_checkpoint(m, optimizers, step, version, orch, cfg):
    """out_dir/ckpt.pt, atomically, in train.py's layout (engine.load_model and serve.py read it; whole
    tensors keyed by name, parallel.full_state, so any world size resumes it) plus what the loop needs to
    resume: the orchestrator's state. Under torchrun every rank must call it (the shards are gathered);
    rank 0 writes."""
    model_state, (muon_state, adamw_state) = parallel.full_state(m, optimizers)
    if orch is None:
        return  # a rank other than 0: its shards are gathered, rank 0 writes
    ckpt = {
        "model": model_state,
        "muon": muon_state,
        "adamw": adamw_state,
        "step": step,
        "version": version,
        "config": {"model": dataclasses.asdict(m.config), "train": {"stage": f"rl_{cfg['stage']}"}},
        "rl": {"settings": cfg, "orchestrator": orch.state()},
    }
    save_checkpoint(ckpt, cfg["out_dir"])


def load_teachers(cfg):
    """{task: model} for stage distill, each teacher loaded once however many tasks share it."""
    loaded = {}
    out = {}
    for task, path in parse_teachers(cfg["teachers"]).items():
        if path not in loaded:
            loaded[path] = engine.load_model(path)
            loaded[path].requires_grad_(False)
        out[task] = loaded[path]
    return out


def forget_pushes(out_dir, keep, now):
    """Delete the pushed weights but the last two (`keep`, the one before, and `now`): a push a step would
    otherwise leave a model copy per step on disk."""
    root = os.path.join(out_dir, "push")
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if path not in (keep, now):
            shutil.rmtree(path, ignore_errors=True)


def cut_metrics(path, step):
    """Keep the records of steps up to `step` (a resumed run writes the later ones again)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError):
                continue  # a line half-written when the run was killed
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------
# The loop: generate, filter, train, push, log; async and sync are one path


def train(m, tok, urls, cfg, log=print, revive=None, world=1, rank=0):
    """The RL loop over the replicas at urls. Each step: keep groups in flight (sync: exactly one batch,
    generated before the step trains; async: up to (1 + ahead) batches, generated while it trains), wait
    for groups_per_step finished groups, filter_buffer against the trainer's version, rl_step, push every
    push_every steps, checkpoint every ckpt_every steps, one log line and one JSONL record. revive(url):
    restarts a dead replica (see Orchestrator). Under torchrun (world > 1, m sharded by FSDP2) rank 0 runs
    the loop and the orchestrator and tells the other ranks each collective to join (follow). -> the list
    of records of this run (rank 0's)."""
    optimizers = rl.build_optimizers(m, lr_muon=cfg["lr_muon"], lr_adamw=cfg["lr_adamw"])
    teacher_of_task = load_teachers(cfg) if cfg["stage"] == "distill" else None
    ck = None
    if cfg["resume"]:
        path, ck = load_resumable(cfg)
        load_trainer_state(m, optimizers, ck)  # every rank: its shards of the weights and moments
    if rank != 0:
        follow(m, optimizers, cfg, teacher_of_task, world, rank)
        return []
    os.makedirs(cfg["out_dir"], exist_ok=True)
    metrics = os.path.join(cfg["out_dir"], "metrics.jsonl")
    if not cfg["resume"] and os.path.exists(metrics):
        os.remove(metrics)  # a fresh run: its records alone (resume cuts the old ones back instead)
    orch = Orchestrator(urls, tok, cfg, revive)
    per_step = cfg["groups_per_step"]
    target = per_step if cfg["mode"] == "sync" else per_step * (1 + cfg["ahead"])
    version = 0  # the trainer's policy version: the steps taken; the replicas have the last pushed one
    records = []
    try:
        first = 1
        if cfg["resume"]:
            done, version = resume_from(m, ck, path, orch, cfg, log, world)
            first = done + 1
        elif cfg["eval_every"]:
            record = {"step": 0, "version": 0, "mode": cfg["mode"], "stage": cfg["stage"]}
            record["heldout_reward"] = orch.evaluate(cfg["eval_episodes"], 0)
            log(f"step 0: held-out reward {record['heldout_reward']}")
            with open(metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
            records.append(record)
        for step in range(first, cfg["max_steps"] + 1):
            t0 = time.time()
            while orch.in_flight() < target:
                orch.submit()
            groups, batch, waited = orch.ready(per_step)
            kept, fstats = filter_buffer(batch, version, cfg["tau"], cfg["group_size"])
            record = {"step": step, "version": version, "mode": cfg["mode"], "stage": cfg["stage"]}
            record["groups"] = groups  # the groups this step took from the buffer, trained or dropped
            if kept:
                # distill: each trajectory's teacher is its task's
                tasks = [orch.task_of(t.group) for t in kept]
                tell(world, "step", kept, tasks, version)
                stats = train_step(m, optimizers, kept, tasks, teacher_of_task, cfg, world, rank, version)
                version += 1
                record.update(stats)
            # the training reward, over this step's valid rollouts (a folded one counts once), and per task
            valid = [batch[idx[0]] for idx in rl.rollouts(batch).values() if not batch[idx[0]].failed]
            by_task = {}
            for t in valid:
                by_task.setdefault(orch.task_of(t.group), []).append(t.reward)
            record["task_reward"] = {k: mean(v) for k, v in sorted(by_task.items())}
            orch.used(groups)
            record.update(reward=mean([t.reward for t in valid]), **fstats)
            record["staleness"] = {str(k): n for k, n in fstats["staleness"].items()}  # JSON's keys
            record.update(trained=bool(kept), trajectories=len(kept))
            save = step % cfg["ckpt_every"] == 0 or step == cfg["max_steps"]
            pushed = orch.latest[1] if orch.latest else 0
            # a push every push_every steps, and before a checkpoint, so that a resumed run's replicas (which
            # get the checkpoint's weights) hold what the uninterrupted run's hold
            if version != pushed and (version % cfg["push_every"] == 0 or save):
                push(m, orch, version, cfg, world)
                if cfg["reset_on_push"]:
                    rl.reset_optimizers(optimizers)
            dt = time.time() - t0
            record.update(traj_per_s=len(batch) / dt, idle_frac=waited / dt, dead_replicas=list(orch.dead))
            record.update(failures=dict(orch.failures), revived=orch.revived)  # since the start
            if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or step == cfg["max_steps"]):
                record["heldout_reward"] = orch.evaluate(cfg["eval_episodes"], step)
            log_line(record, log)
            with open(metrics, "a") as f:  # the record first: a kill during the save loses no record
                f.write(json.dumps(record) + "\n")
            records.append(record)
            if save:
                tell(world, "save", step, version)
                save_rl_checkpoint(m, optimizers, step, version, orch, cfg)
    finally:
        orch.close()
        tell(world, "stop")
    return records


def train_step(m, optimizers, kept, tasks, teacher_of_task, cfg, world, rank, version):
    """rl.rl_step with this stage's loss at the trainer's policy version; distill gives each trajectory its
    task's teacher."""
    teacher = None
    if teacher_of_task is not None:
        teacher = [teacher_of_task[task] for task in tasks]
    return rl.rl_step(
        m,
        optimizers,
        kept,
        STAGE_LOSS[cfg["stage"]],
        teacher=teacher,
        grad_clip=cfg["grad_clip"],
        temperature=cfg["temperature"],
        micro_tokens=cfg["micro_tokens"],
        shared_prefix=cfg["shared_prefix"],
        world=world,
        rank=rank,
        version=version,
    )


# -----------------------------------------------------------------------------
# The trainer under torchrun: rank 0 runs the loop; every collective it starts, the others join
#
# Rank 0 alone talks to the replicas, plays the rollouts and logs. Before each collective it broadcasts
# what comes (the step's whole batch, a push, a checkpoint, the end); follow() on the other ranks runs the
# same call. Each rank trains its rows of the batch (rl.backward_batch); FSDP2 reduces the gradients; a
# push or a checkpoint gathers the shards to rank 0, which writes them.


def tell(world, *order):
    """Rank 0: broadcast the next collective to the other ranks (nothing with one process)."""
    if world > 1:
        dist.broadcast_object_list([order], src=0)


def follow(m, optimizers, cfg, teacher_of_task, world, rank):
    """The loop of a rank other than 0: join each collective rank 0 announces until it says stop."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        order = box[0]
        if order[0] == "step":
            train_step(m, optimizers, order[1], order[2], teacher_of_task, cfg, world, rank, order[3])
        elif order[0] == "push":
            whole_state(m, world)
        elif order[0] == "save":
            save_rl_checkpoint(m, optimizers, order[1], order[2], None, cfg)
        elif order[0] == "stop":
            return


def whole_state(m, world):
    """The model's state dict in whole CPU tensors (under torchrun the shards gathered to rank 0; every
    rank must call it)."""
    if world == 1:
        return m.state_dict()
    return parallel.full_state(m, [])[0]


def load_trainer_state(m, optimizers, ck):
    """A checkpoint's weights and optimizer moments into the trainer, sharded or not (every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(m, ck["model"], options=StateDictOptions(full_state_dict=True))
    parallel.load_optimizer_states(m, optimizers, [ck["muon"], ck["adamw"]])


def push(m, orch, version, cfg, world=1):
    """Save the trainer's weights to out_dir/push/v<version>, have every live replica load them, drop the
    ones that do not answer, delete the older pushes."""
    path = os.path.join(cfg["out_dir"], "push", f"v{version}")
    tell(world, "push")
    state = whole_state(m, world)
    dtype = getattr(torch, cfg["push_dtype"])
    for url in push_weights(m, orch.live_urls(), path, version, dtype, state=state):
        orch.drop_replica(url)
    forget_pushes(cfg["out_dir"], keep=orch.latest[0] if orch.latest else None, now=path)
    orch.latest = (path, version)


def load_resumable(cfg):
    """out_dir/ckpt.pt, checked: an rl_async.py checkpoint whose sampling settings are the ones given now.
    -> (its path, the checkpoint dict). One sentence for what is wrong."""
    path = os.path.join(cfg["out_dir"], "ckpt.pt")
    if not os.path.isfile(path):
        raise SystemExit(f"resume: no checkpoint at {path}; run without --resume=True first, or fix out_dir")
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if "rl" not in ck:
        raise SystemExit(f"resume: {path} is not an rl_async.py checkpoint; pass it as --init_from instead")
    saved = ck["rl"]["settings"]
    changed = [k for k in RESUME_SAME if saved.get(k) != cfg[k]]
    if changed:
        k = changed[0]
        raise SystemExit(
            f"resume: {k} was {saved.get(k)!r} in the run being resumed and is {cfg[k]!r} now; a resumed run "
            f"replays the same tasks and groups, so pass --{k}={saved.get(k)!r} (or start a new out_dir)"
        )
    return path, ck


def resume_from(m, ck, path, orch, cfg, log, world=1):
    """Rank 0's half of a resume (the trainer's state is already loaded, load_trainer_state): give the
    checkpoint's weights to the replicas as its version, replay its untrained groups, cut metrics.jsonl back
    to its step. -> (its step, its version)."""
    step = ck["step"]
    version = ck["version"]
    ahead_of_us = [u for u in orch.live_urls() if (weight_version(u) or 0) > version]
    if ahead_of_us:
        raise SystemExit(
            f"resume: the replica at {ahead_of_us[0]} serves version {weight_version(ahead_of_us[0])}, past "
            f"the checkpoint's {version}, and versions only increase; restart the replicas, then resume"
        )
    if version > 0:
        push(m, orch, version, cfg, world)
    orch.restore(ck["rl"]["orchestrator"])
    cut_metrics(os.path.join(cfg["out_dir"], "metrics.jsonl"), step)
    pending = len(ck["rl"]["orchestrator"]["pending"])
    log(f"resumed from {path} at step {step} (version {version}); {pending} untrained groups played again")
    return step, version


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def log_line(r, log):
    line = (
        f"step {r['step']}: reward {r['reward']:.3f}, mixed groups {r.get('mixed_groups', 0.0):.2f}, "
        f"masked {r.get('masked_frac', 0.0):.3f}, "
        f"|r-1| {r.get('abs_r_minus_1', 0.0):.4f}, staleness {r['staleness']}, dropped "
        f"{r['stale']} stale + {r['failed']} failed + {r['dropped_groups']} groups, padded {r['padded']}, "
        f"{r['traj_per_s']:.2f} traj/s, idle {r['idle_frac']:.0%}"
    )
    if len(r.get("task_reward", {})) > 1:
        line += ", by task {" + ", ".join(f"{k}: {v:.2f}" for k, v in r["task_reward"].items()) + "}"
    if "heldout_reward" in r:
        line += f", held-out {r['heldout_reward']}"
    log(line)


# -----------------------------------------------------------------------------
# The entry point: the policy, the replicas, the loop
#
# The toy run starts from a policy that can solve toy-level tasks sometimes (GRPO learns nothing from groups
# whose rewards are all equal): the workshop run's policy, workshop/speedrun.py's stages up to sft_episodes
# (pretraining, the two DSA stages, SFT, then SFT on solved toy-level episodes alone). When
# configs/rl_toy.py's init_from is missing, main runs them first and says so; workshop/speedrun.py skips
# every stage already done, so an interrupted first run continues where it stopped.

TOY_POLICY = "runs/cpu/sft_episodes/ckpt.pt"
TOY_RECIPE = "workshop/speedrun.py --preset cpu --run cpu --stop_after sft_episodes"


def ensure_toy_policy(here=None):
    """Make TOY_POLICY with the workshop run's stages if it is missing (workshop/speedrun.py skips finished
    ones)."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(here, TOY_POLICY)):
        return
    print(
        f"no toy SFT policy at {TOY_POLICY}: making it first with the workshop run's stages up to SFT on "
        f"solved toy-level episodes (about 22 minutes on a quiet 2-core CPU, once): python {TOY_RECIPE}",
        flush=True,
    )
    done = subprocess.run([sys.executable] + TOY_RECIPE.split(), cwd=here)
    if done.returncode != 0:
        raise SystemExit(f"making the toy policy stopped at `python {TOY_RECIPE}`; see its error above")


def main(argv):
    if wants_help(argv):
        print_settings_help(
            __file__,
            __doc__,
            LOOP_DEFAULTS,
            "python rl_async.py [configs/NAME.py ...] [--key=value ...]",
            "python rl_async.py configs/rl_toy.py --mode=sync --max_steps=5",
        )
        return
    cfg = resolve_config(argv)
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE: one trainer process per device, rank 0 drives the loop
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    log = print if rank == 0 else quiet
    log("settings:", json.dumps(cfg))
    if cfg["init_from"] == TOY_POLICY:  # the workshop run's, under the repo root whatever the cwd
        cfg["init_from"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), TOY_POLICY)
        if not os.path.exists(cfg["init_from"]):
            if world > 1:
                raise SystemExit(
                    f"no toy policy at {TOY_POLICY}: make it first with one process (no torchrun)"
                )
            ensure_toy_policy()
    if not os.path.exists(cfg["init_from"]):
        raise SystemExit(
            f"no policy at {cfg['init_from']}; train one (README: the RL stages) or pass --init_from=PATH"
        )
    if cfg["resume"]:
        load_resumable(cfg)  # before anything starts: a refused resume costs nothing
    dev = pick_device(cfg["device"])
    if world > 1 and dev.startswith("cuda"):
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if world > 1:
        if dev == "mps":
            raise SystemExit(
                "torchrun with mps is not supported; use --device=cpu (gloo) or cuda GPUs (nccl)"
            )
        # rank 0 evaluates and waits for rollouts while the others wait in a broadcast: a long timeout
        dist.init_process_group(
            "nccl" if dev.startswith("cuda") else "gloo", timeout=datetime.timedelta(hours=2)
        )
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
    torch.manual_seed(cfg["seed"])
    m = engine.load_model(cfg["init_from"], device=dev)
    rl.freeze_for_rl(m)
    if world > 1:  # train.py's sharding: FSDP2 over every block and the root, the experts split by EP
        mesh = torch.distributed.device_mesh.init_device_mesh(dev.split(":")[0], (world,))
        experts = parallel.shard_experts(m) if cfg["expert_parallel"] else ()
        parallel.shard_model(m, mesh, ignored=experts)
    tok = serve.load_tokenizer(None, cfg["init_from"], m.config.vocab_size)
    procs = {}
    revive = None
    urls = [u.strip() for u in cfg["replicas"].split(",") if u.strip()]
    if not urls and rank == 0:
        urls, procs = start_replicas(cfg["init_from"], cfg["num_replicas"])
        atexit.register(stop_replicas, procs)
        revive = process_restarter(procs, cfg["init_from"])
    if procs and dev == "cpu":
        # the replicas take a core each: a trainer with more threads than the cores left thrashes (5-10x
        # slower steps on a 2-core machine)
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - cfg["num_replicas"]) // world))
    log(f"replicas: {', '.join(urls)}; trainer on {dev} x {world}")
    try:
        records = train(m, tok, urls, cfg, log=log, revive=revive, world=world, rank=rank)
        if world > 1:
            dist.barrier()  # no rank tears its connections down while another still finishes
    finally:
        stop_replicas(procs)
        if world > 1:
            dist.destroy_process_group()
    if rank == 0:
        print_curve(records, cfg)


def print_curve(records, cfg):
    """The learning curve: held-out reward per task at every evaluation (step 0 is in the log above)."""
    evals = [r for r in records if "heldout_reward" in r]
    if not evals:
        return
    print(f"learning curve ({cfg['mode']}, held-out reward, {cfg['eval_episodes']} episodes per task):")
    for r in evals:
        cells = ", ".join(f"{task} {v:.3f}" for task, v in r["heldout_reward"].items())
        print(f"  step {r['step']:4d}: {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
