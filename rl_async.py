"""
GLM-5's asynchronous agentic RL loop (GLM-5 report, arXiv 2602.15763, its post-training sections: the
agentic RL infrastructure that decouples rollouts from training, with the TITO gateway, DP-aware routing,
the multi-task rollout orchestrator and the dropping of stale and failed samples; the RL stages, Reasoning
RL, Agentic RL and General RL, with on-policy cross-stage distillation). The math it runs (advantages,
losses, filters, the trainer's step, the router) is rl.py's.

The loop, one code path with a `mode` switch:
- replicas: serve.py servers given as URLs (a cluster's) or started here as `serve.py` processes on free
  loopback ports and stopped at exit; each rollout id is pinned to one by rl.route, and a replica that
  refuses connections leaves the ring, its rollouts starting over on the others.
- the orchestrator: groups of group_size rollouts (one task, one training-split seed; held-out seeds by
  envs.split_of stay for evaluation), the task drawn from the configured mix, run by rollout.rollout through
  the TITO gateway on one thread pool per task (its concurrency cap). A rollout that raises or outlives
  rollout_timeout gives a failed sample; the group rule drops it.
- the trainer: wait for groups_per_step finished groups, rl.filter_buffer against its own version, rl.rl_step,
  and every push_every steps save_pretrained + POST /update_weights_from_disk to every replica. mode "sync"
  keeps exactly one batch of groups in flight; mode "async" (the default) keeps up to (1 + ahead) batches.

Run it:
    python rl_async.py configs/rl_toy.py        # the loop: 2 serve.py replicas of the toy SFT checkpoint
    python rl_async.py configs/rl_toy.py --mode=sync --max_steps=5   # any setting as --key=value
Tests: python -m pytest -q tests/test_rl_async.py
"""

import ast
import atexit
import difflib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

import engine
import envs
import rl
import rollout
import serve
import weights
from rl import build_ring, filter_buffer, hash64, release, remove_replica, route
from rollout import Trajectory


# -----------------------------------------------------------------------------
# The training loop: settings
#
# Plain globals, as train.py has them; a configs/*.py file (plain assignments), then --key=value, override
# them. configs/rl_toy.py sets the toy run.

init_from = "out_sft/ckpt.pt"  # the policy to start from: train.py's ckpt.pt or a save_pretrained directory
out_dir = "out_rl"  # metrics.jsonl and the pushed weights (out_dir/push/v<step>) go here
mode = "async"  # "async": rollouts run on while the trainer steps; "sync": generate a batch, then train
replicas = ""  # comma-separated replica URLs (a cluster's); empty: start num_replicas serve.py processes
num_replicas = 2  # serve.py processes rl_async.py starts on free loopback ports (and stops at exit)
tasks = "math:0:1"  # the task mix: env name (envs.ENVS):difficulty:weight, comma-separated
task_concurrency = 4  # at most this many rollouts of one task run at once (its thread pool's size)
group_size = 4  # G: rollouts per prompt (same env, same seed), compared by group_advantages
groups_per_step = 4  # groups in one trainer batch
ahead = 1  # async: keep up to (1 + ahead) * groups_per_step groups in flight or buffered
tau = 1  # staleness: drop a trajectory sampled more than tau versions before the trainer's current one
push_every = 1  # K: save and push the weights to every replica every K steps (version = step)
reset_on_push = False  # the optional optimizer reset after a push
loss_kind = "agentic"  # "agentic" (double-sided importance sampling) or "reasoning" (GRPO + IcePop)
max_steps = 20  # trainer steps
lr_muon = 2e-3  # placeholders: GLM-5 does not publish its RL learning rates
lr_adamw = 3e-4
grad_clip = 1.0
temperature = 1.0  # the replicas sample at it, and token_logprobs divides by it
max_tokens = 96  # per generation request
thinking = False  # rollouts open the reply with <think> (True) or </think> (False)
rollout_timeout = 120.0  # seconds: a rollout still running then is abandoned and marked failed
eval_every = 5  # held-out reward every this many steps (0: never), and at step 0 and the end
eval_episodes = 16  # per task, on held-out seeds (envs.split_of), one sample each
push_dtype = "float32"  # the dtype the pushed safetensors are written in
seed = 0  # the first training seed of every task; sampling seeds derive from the rollout id

LOOP_DEFAULTS = {
    k: v
    for k, v in list(globals().items())
    if not k.startswith("_") and k.islower() and isinstance(v, (bool, int, float, str))
}


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
            items, where = {key: value}, "command line"
        else:
            if not os.path.isfile(arg):
                raise SystemExit(f"no config file {arg}")
            items, where = {}, arg
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
    if cfg["mode"] not in ("async", "sync"):
        raise SystemExit(f"mode must be 'async' or 'sync', got {cfg['mode']!r}")
    parse_tasks(cfg["tasks"])
    return cfg


def parse_tasks(spec):
    """ "math:0:1,search:0:2" -> [(name, difficulty, weight)], checked against envs.ENVS."""
    out = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[0] not in envs.ENVS:
            raise SystemExit(
                f"task {item!r}: write name:difficulty:weight with a name from {', '.join(envs.ENVS)}"
            )
        out.append((parts[0], int(parts[1]), float(parts[2])))
    return out


# -----------------------------------------------------------------------------
# Rollout replicas: serve.py processes, or URLs
#
# At scale the replicas are other machines' serve.py (or SGLang / vLLM) servers given as URLs, and a push
# writes the weights to storage every replica reads (a shared filesystem); a torch.distributed broadcast
# group from the trainer's ranks to the replicas' would skip the disk. Here the push is the shared-storage
# one: save_pretrained to out_dir, then POST /update_weights_from_disk to each replica.


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replicas(ckpt, n, wait=300.0):
    """n `python serve.py --ckpt ckpt` processes on free loopback ports -> (urls, processes), once each
    answers GET /health. The caller stops them (stop_replicas; main registers it at exit)."""
    here = os.path.dirname(os.path.abspath(__file__))
    urls, procs = [], []
    for _ in range(n):
        port = free_port()
        cmd = [sys.executable, os.path.join(here, "serve.py"), "--ckpt", ckpt, "--port", str(port)]
        cmd += ["--device", "cpu"]
        procs.append(subprocess.Popen(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.time() + wait
    for url, p in zip(urls, procs):
        while True:
            if p.poll() is not None:
                stop_replicas(procs)
                raise SystemExit(
                    f"the replica for {url} exited with code {p.returncode}; see its error above"
                )
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                stop_replicas(procs)
                raise SystemExit(f"the replica at {url} did not answer /health within {wait:.0f} s")
            time.sleep(0.5)
    return urls, procs


def stop_replicas(procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def push_weights(m, urls, directory, version, dtype=torch.float32):
    """Save the trainer's weights and have every replica load them as `version`. -> the URLs that did not
    answer (dead replicas, for the router to drop)."""
    weights.save_pretrained(m, directory, dtype=dtype)
    dead = []
    for url in urls:
        body = {"model_path": os.path.abspath(directory), "weight_version": version}
        try:
            resp = requests.post(url + "/update_weights_from_disk", json=body, timeout=600)
        except requests.ConnectionError:
            dead.append(url)
            continue
        if resp.status_code != 200:
            raise RuntimeError(f"the replica at {url} refused the weights: {resp.text[:300]}")
    return dead


# -----------------------------------------------------------------------------
# The orchestrator: groups of rollouts over the task mix, on thread pools, through the router


class SeededGateway(rollout.Gateway):
    """rollout.Gateway with a sampling seed in every request, derived from the rollout id and the turn: a
    rollout replayed with the same id on the same weights samples the same tokens (the sync/async test)."""

    def request_seed(self):
        return hash64(f"{self.rollout_id}/{len(self.requests)}") >> 1  # in [0, 2**63)


class ReplicaGone(Exception):
    """Every replica is dead: nothing is left to generate with."""


class Orchestrator:
    """Runs groups of rollouts: a group is group_size rollouts of one task on one seed, its task drawn by
    the mix's weights. Each task has its own thread pool of task_concurrency workers (its concurrency cap).
    A rollout's id picks its replica through the DP-aware router; a replica that refuses connections is
    removed from the ring and the rollout starts over on another (its partial record is thrown away, so
    nothing is trained twice). A rollout whose environment raises, whose policy raises, or that runs past
    rollout_timeout gives one failed Trajectory: group_filter drops it.

    submit() starts the next group; ready(n) waits for n finished groups and returns their trajectories,
    lowest group index first."""

    gateway_class = SeededGateway  # the rollout.Gateway subclass each rollout talks through (a bench swaps it)

    def __init__(self, urls, tok, cfg):
        self.tok = tok
        self.cfg = cfg
        self.mix = parse_tasks(cfg["tasks"])
        self.rng = random.Random(cfg["seed"])
        self.pools = {
            (name, d): ThreadPoolExecutor(cfg["task_concurrency"], thread_name_prefix=f"{name}{d}")
            for name, d, _ in self.mix
        }
        self.next_seed = {(name, d): cfg["seed"] for name, d, _ in self.mix}
        self.urls = list(urls)
        self.ring = build_ring(self.urls)
        self.where = {}
        self.loads = dict.fromkeys(self.urls, 0)
        self.lock = threading.Lock()  # the router's state, shared by every worker
        self.groups = {}  # group index -> [(future, started), ...]
        self.submitted = 0
        self.dead = []  # replicas dropped from the ring
        self.failures = Counter()  # failed rollouts by cause, for the log
        self.started = {}  # rollout id -> when it was submitted

    def train_seed(self, name, d):
        """The next seed of this task whose prompt is in the training split (never a held-out task)."""
        s = envs.seeds(envs.ENVS[name](d), "train", 1, start=self.next_seed[name, d])[0]
        self.next_seed[name, d] = s + 1
        return s

    def submit(self):
        name, d, _ = self.rng.choices(self.mix, weights=[w for *_, w in self.mix])[0]
        task_seed = self.train_seed(name, d)
        g = self.submitted
        self.submitted += 1
        pool = self.pools[name, d]
        rids = [f"g{g}-{k}" for k in range(self.cfg["group_size"])]
        for rid in rids:
            self.started[rid] = time.time()  # the timeout counts from here, its wait in the queue included
        self.groups[g] = [(pool.submit(self.play, name, d, task_seed, rid, g), rid) for rid in rids]

    def in_flight(self):
        return len(self.groups)

    def pick(self, rid):
        with self.lock:
            return route(rid, self.ring, self.where, self.loads)

    def drop_replica(self, url):
        with self.lock:
            if url in self.loads:
                self.ring = remove_replica(url, self.ring, self.where, self.loads)[0]
                self.urls.remove(url)
                self.dead.append(url)

    def play(self, name, d, task_seed, rid, g):
        """One rollout on one replica -> its Trajectory records (one failed one when it crashed)."""
        while True:
            if not self.loads:
                raise ReplicaGone("every rollout replica is dead")
            url = self.pick(rid)
            gw = self.gateway_class(
                url,
                rid,
                temperature=self.cfg["temperature"],
                max_tokens=self.cfg["max_tokens"],
                timeout=self.cfg["rollout_timeout"],
            )
            try:
                episode = rollout.rollout(envs.ENVS[name](d), gw, self.tok, task_seed, self.cfg["thinking"])
            except requests.ConnectionError:
                self.drop_replica(url)  # routed around: the rollout starts over elsewhere
                continue
            except Exception as e:  # the policy or the agent loop raised: isolated, marked failed
                self.failures[type(e).__name__] += 1
                return [failed_trajectory(g, rid)]
            finally:
                with self.lock:
                    if rid in self.where:
                        release(rid, self.where, self.loads)
            if episode["crashed"] or not gw.segments:
                self.failures["environment"] += 1
                return [failed_trajectory(g, rid)]
            return rollout.trajectories(gw, episode, g)

    def group_done(self, g):
        now = time.time()
        timeout = self.cfg["rollout_timeout"]
        return all(f.done() or now - self.started[rid] > timeout for f, rid in self.groups[g])

    def collect(self, g):
        out = []
        for f, rid in self.groups.pop(g):
            self.started.pop(rid, None)
            if not f.done():  # hung past the timeout: abandoned (its thread cannot be killed)
                self.failures["timeout"] += 1
                out.append(failed_trajectory(g, rid))
                continue
            e = f.exception()
            if isinstance(e, ReplicaGone):
                raise e
            if e is None:
                out += f.result()
            else:  # raised outside the rollout (a TITO mismatch, say): isolated as well
                self.failures[type(e).__name__] += 1
                out.append(failed_trajectory(g, rid))
        return out

    def ready(self, n):
        """Wait until n groups are finished -> their trajectories and the seconds spent waiting."""
        t0 = time.time()
        while sum(self.group_done(g) for g in self.groups) < n:
            time.sleep(0.01)
        done = sorted(g for g in self.groups if self.group_done(g))[:n]
        return [t for g in done for t in self.collect(g)], time.time() - t0

    def evaluate(self, episodes, step=0):
        """Mean reward per task over `episodes` held-out seeds, one sample each at the training temperature,
        on the replicas' current weights (a failed episode counts 0)."""
        out = {}
        for name, d, _ in self.mix:
            held = envs.seeds(envs.ENVS[name](d), "heldout", episodes)
            pool = self.pools[name, d]
            futures = [
                pool.submit(self.play, name, d, s, f"eval{step}-{name}-{i}", -1) for i, s in enumerate(held)
            ]
            rewards = []
            for f in futures:
                trajs = f.result()
                rewards.append(0.0 if trajs[0].failed else trajs[0].reward)
            out[f"{name}:{d}"] = sum(rewards) / len(rewards)
        return out

    def close(self):
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


def failed_trajectory(g, rid):
    return Trajectory(group=g, ids=[], mask=[], logprobs=[], versions=[], failed=True, rollout_id=rid)


# -----------------------------------------------------------------------------
# The loop: generate, filter, train, push, log; async and sync are one path


def train(m, tok, urls, cfg, log=print):
    """The RL loop over the replicas at urls. Each step: keep groups in flight (sync: exactly one batch,
    generated before the step trains; async: up to (1 + ahead) batches, generated while it trains), wait
    for groups_per_step finished groups, filter_buffer against the trainer's version, rl_step, push every
    push_every steps, one log line and one JSONL record. -> the list of records."""
    os.makedirs(cfg["out_dir"], exist_ok=True)
    metrics = os.path.join(cfg["out_dir"], "metrics.jsonl")
    optimizers = rl.build_optimizers(m, lr_muon=cfg["lr_muon"], lr_adamw=cfg["lr_adamw"])
    orch = Orchestrator(urls, tok, cfg)
    per_step = cfg["groups_per_step"]
    target = per_step if cfg["mode"] == "sync" else per_step * (1 + cfg["ahead"])
    version = 0  # the trainer's policy version: the steps taken; the replicas have the last pushed one
    records = []
    try:
        if cfg["eval_every"]:
            log(f"step 0: held-out reward {orch.evaluate(cfg['eval_episodes'], 0)}")
        for step in range(1, cfg["max_steps"] + 1):
            t0 = time.time()
            while orch.in_flight() < target:
                orch.submit()
            batch, waited = orch.ready(per_step)
            kept, fstats = filter_buffer(batch, version, cfg["tau"], cfg["group_size"])
            record = {"step": step, "version": version, "mode": cfg["mode"]}
            if kept:
                stats = rl.rl_step(
                    m,
                    optimizers,
                    kept,
                    cfg["loss_kind"],
                    grad_clip=cfg["grad_clip"],
                    temperature=cfg["temperature"],
                )
                version += 1
                record.update(stats)
            record.update(reward=mean([t.reward for t in batch if not t.failed]), **fstats)
            record["staleness"] = {str(k): n for k, n in fstats["staleness"].items()}  # JSON's keys
            record.update(trained=bool(kept), trajectories=len(kept))
            if kept and version % cfg["push_every"] == 0:
                path = os.path.join(cfg["out_dir"], "push", f"v{version}")
                for url in push_weights(m, orch.urls, path, version, getattr(torch, cfg["push_dtype"])):
                    orch.drop_replica(url)
                if cfg["reset_on_push"]:
                    rl.reset_optimizers(optimizers)
            dt = time.time() - t0
            record.update(traj_per_s=len(batch) / dt, idle_frac=waited / dt, dead_replicas=list(orch.dead))
            record["failures"] = dict(orch.failures)  # since the start, by cause
            if cfg["eval_every"] and (step % cfg["eval_every"] == 0 or step == cfg["max_steps"]):
                record["heldout_reward"] = orch.evaluate(cfg["eval_episodes"], step)
            log_line(record, log)
            with open(metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
            records.append(record)
    finally:
        orch.close()
    return records


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def log_line(r, log):
    line = (
        f"step {r['step']}: reward {r['reward']:.3f}, masked {r.get('masked_frac', 0.0):.3f}, "
        f"|r-1| {r.get('abs_r_minus_1', 0.0):.4f}, staleness {r['staleness']}, dropped "
        f"{r['stale']} stale + {r['failed']} failed + {r['dropped_groups']} groups, padded {r['padded']}, "
        f"{r['traj_per_s']:.2f} traj/s, idle {r['idle_frac']:.0%}"
    )
    if "heldout_reward" in r:
        line += f", held-out {r['heldout_reward']}"
    log(line)


def main(argv):
    cfg = resolve_config(argv)
    print("settings:", json.dumps(cfg))
    torch.manual_seed(cfg["seed"])
    m = engine.load_model(cfg["init_from"])
    tok = serve.load_tokenizer(None, cfg["init_from"], m.config.vocab_size)
    procs = []
    urls = [u.strip() for u in cfg["replicas"].split(",") if u.strip()]
    if not urls:
        urls, procs = start_replicas(cfg["init_from"], cfg["num_replicas"])
        atexit.register(stop_replicas, procs)
    print(f"replicas: {', '.join(urls)}")
    try:
        train(m, tok, urls, cfg)
    finally:
        stop_replicas(procs)


if __name__ == "__main__":
    main(sys.argv[1:])
