"""
Benchmarks of the asynchronous agentic RL loop (rl_async.py; GLM-5 report, arXiv 2602.15763, its agentic RL
infrastructure: rollouts decoupled from training so long agent trajectories never leave the trainer idle,
and DP-aware routing so a multi-turn rollout keeps hitting one replica's prefix cache). Three parts, each
measured side by side in one run and described at its section below: 1. async vs sync on a long-tail
workload; 2. the prefix-cache hit rate of multi-turn rollouts, DP-aware router vs round-robin; 3. the
trainer's step with each group's prompt encoded once (shared_prefix.py) vs one forward per row.

    python bench/bench_rl.py               # all three parts, a fresh toy model
    python bench/bench_rl.py --parts step --ckpt runs/cpu/sft_episodes/ckpt.pt  # part 3 on the toy policy
    python bench/bench_rl.py --quick       # a small run: checks that it all works
    python bench/bench_rl.py --ckpt out_sft/ckpt.pt --steps 12  # a train.py checkpoint or save_pretrained dir
    python bench/bench_rl.py --parts async --ahead 2 --tau 2  # the in-flight depth and the staleness bound
Needs the tokenizer (data/tokenizer_4096.json, which `python train.py configs/toy.py` builds first).

Honest limits: an untrained model never ends a turn by itself nor writes tool calls, so the bench's gateway
closes a reply cut at max_tokens with an <|endoftext|> recorded as template glue (loss mask 0; the TITO
record stays exact) and the wrapper environment reads a reply without tool calls as a search query until the
last, graded turn (a trained checkpoint's tool calls run as they are). The long tail is injected tool
latency, not model time: on a 2-core CPU replicas and trainer share the cores, so only overlapping the waits
gains, and async's trainer steps slower than sync's, sharing cores and interpreter with the replicas and the
rollout threads; with compute-bound rollouts on a GPU cluster the ratio depends on how devices are split,
which this machine cannot show. The policy barely moves in a few steps, so staleness costs little here
(|r - 1| stays small; in a real run it costs more: that is why tau exists). Short runs: the first step fills
the pipeline (the headline is over steps 2 to N, the all-steps figures beside it); timings on a shared
machine are noisy (the load is printed first).
"""

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

# run as python bench/bench_rl.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import engine
import envs
import model
import orchestrator
import rl
import replicas
import rl_async
import rollout
import serve
import weights
from bench_train import describe_machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: configs/, data/


# -----------------------------------------------------------------------------
# The long-tail workload: search at difficulty 0, more turns, a heavy-tailed tool latency per call


class LongTailSearch(envs.Env):
    """envs.SearchEnv behind a fixed number of turns and a seeded Pareto tool latency. A reply with tool
    calls runs them (the real search tool); a reply without, before the last turn, is read as a search
    query (an untrained model writes no tool calls); the last turn is graded by the search task. Each
    non-final turn then waits scale * Pareto(alpha) seconds, at most cap. The latencies of the k-th
    rollout that resets a given task seed come from the seed and k, so the groups of two runs that play the
    same seeds draw the same latencies. Settings are class attributes the bench sets per part; `stop` ends
    every episode at its next step (the runs' leftover rollouts finish fast)."""

    name = "longtail"
    keep_recent = 0  # no folding and no discard-all: every turn extends the last, as part 2 needs
    context_threshold = 0
    turns = 4
    alpha, scale, cap = 1.2, 0.3, 15.0  # Pareto shape, its minimum in seconds, the largest wait
    stop = threading.Event()
    resets = Counter()  # task seed -> rollouts that reset it so far
    lock = threading.Lock()

    def __init__(self, difficulty=0, max_turns=None):
        super().__init__(difficulty, max_turns)
        self.inner = envs.SearchEnv(difficulty)

    def reset(self, seed=None):
        task, tools = self.inner.reset(seed)
        with self.lock:
            k = self.resets[seed]
            self.resets[seed] += 1
        self.latency_rng = random.Random(f"longtail/{seed}/{k}")
        self.turn = 0
        self.stopped = self.stop  # this run's event, even after the bench makes the next run's
        return task, tools

    def latency(self):
        if self.scale <= 0:
            return 0.0
        return min(self.scale * self.latency_rng.paretovariate(self.alpha), self.cap)

    def step(self, action):
        msg = {"role": "assistant", "content": action} if isinstance(action, str) else action
        self.turn += 1
        if self.stopped.is_set():
            return [], 0.0, True, "the benchmark run is over"
        if self.turn >= self.turns:
            reward, reason = self.inner.grade(msg.get("content") or "")
            return [], reward, True, reason
        if msg.get("tool_calls"):
            out = self.inner.step(msg)
        else:
            query = (msg.get("content") or msg.get("reasoning_content") or "")[:200]
            out = ([self.inner.run_tool("search", {"query": query})], 0.0, False, "tool")
        self.stopped.wait(self.latency())  # the tool's latency; a stopped run wakes at once
        return out

    def close(self):
        self.inner.close()


# -----------------------------------------------------------------------------
# The bench's gateways: a turn cut at max_tokens is closed, every request's usage is tallied
#
# An untrained model never ends a turn by itself (a stop token is 3 ids of 4,096) nor writes tool calls. So
# the bench's gateway ends a reply cut at max_tokens with an <|endoftext|> it records as template glue (loss
# mask 0, like an observation token; the TITO record stays exact), and the wrapper environment reads a reply
# without tool calls as a query for the search tool until the last turn, which is graded.


class Tally:
    """Prompt and cached tokens per turn index, summed over every request of a run (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt = Counter()
        self.cached = Counter()
        self.requests = Counter()

    def add(self, turn, prompt, cached):
        with self.lock:
            self.prompt[turn] += prompt
            self.cached[turn] += cached
            self.requests[turn] += 1

    def rate(self, turns):
        p = sum(self.prompt[t] for t in turns)
        return sum(self.cached[t] for t in turns) / p if p else 0.0

    def summary(self):
        """The hit rate over every turn and over the turns after the first, the prompt tokens, and the most
        turns a rollout reached (what --json writes)."""
        turns = sorted(self.prompt)
        return {
            "hit_rate": self.rate(turns),
            "later_turns": self.rate(turns[1:]),
            "prompt_tokens": sum(self.prompt.values()),
            "turns": len(turns),
        }


class BenchGateway(orchestrator.SeededGateway):
    """rl_async's gateway (seeded sampling) that ends a reply cut at max_tokens with <|endoftext|>, recorded
    as template glue (mask 0, logprob 0.0, version -1), and adds every response's usage to `tally`."""

    tally = None  # the run's Tally, set by the bench
    eos = None  # the <|endoftext|> id

    def generate(self, prompt):
        p0, c0 = self.prompt_tokens, self.cached_tokens
        out = super().generate(prompt)
        if self.tally is not None:
            self.tally.add(len(self.requests) + 1, self.prompt_tokens - p0, self.cached_tokens - c0)
        return out

    def __call__(self, prompt):
        ids, lps = super().__call__(prompt)
        if self.requests[-1]["finish"] != "length":
            return ids, lps
        seg = self.segments[-1]  # the glue extends the record, so the next prompt still extends it
        seg["ids"].append(self.eos)
        seg["mask"].append(0)
        seg["logprobs"].append(0.0)
        seg["versions"].append(-1)
        return ids + [self.eos], lps + [0.0]


class RoundRobinGateway(BenchGateway):
    """Each request to the next replica in turn, whatever rollout it belongs to (a plain load balancer);
    the replica the router picked is ignored."""

    urls = []
    counter = itertools.count()
    lock = threading.Lock()

    def generate(self, prompt):
        with self.lock:
            self.url = self.urls[next(self.counter) % len(self.urls)].rstrip("/") + "/v1/completions"
        return super().generate(prompt)


class swapped:
    """Set class attributes for a block, and put the old values back after (the bench's only hooks into
    rl_async: Orchestrator.gateway_class, which it offers for this)."""

    def __init__(self, cls, **values):
        self.cls, self.values = cls, values

    def __enter__(self):
        self.old = {k: getattr(self.cls, k) for k in self.values}
        for k, v in self.values.items():
            setattr(self.cls, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.cls, k, v)


# -----------------------------------------------------------------------------
# The model and the replicas
#
# The model: by default a freshly initialized toy GLM-5 (configs/toy.py sizes, seed 0) saved with
# weights.save_pretrained; rewards do not matter for throughput. Replicas are serve.py processes (separate
# interpreters, as real replicas are), one torch thread each; the trainer runs in this process with --threads
# torch threads (1 by default: on a loaded 2-core CPU two threads made the toy's RL step slower, see
# docs/design-notes.md). The bench runs from the repository's root, where serve.py finds data/. The bench's
# hooks into rl_async are Orchestrator.gateway_class (swapped for the run) and envs.ENVS (the wrapper added);
# rl_async.py itself is unchanged.


def fresh_checkpoint(directory, seed=0):
    """A freshly initialized toy GLM-5 (configs/toy.py sizes) saved with save_pretrained -> its directory."""
    cfg, _ = model.load_config_file(os.path.join(ROOT, "configs", "toy.py"))
    torch.manual_seed(seed)
    weights.save_pretrained(model.GLM5(cfg), directory, dtype=torch.float32)
    return directory


PER_STEP, GROUP = 2, 4  # a batch: groups_per_step groups of group_size rollouts, B = 8


def run_settings(args, mode, concurrency, out_dir):
    """rl_async's settings for one run of part 1 (resolve_config checks every value)."""
    overrides = dict(
        init_from=args.ckpt,
        out_dir=out_dir,
        mode=mode,
        tasks="longtail:0:1",
        task_concurrency=concurrency,
        group_size=GROUP,
        groups_per_step=PER_STEP,
        ahead=args.ahead,
        tau=args.tau,
        push_every=1,
        max_steps=args.steps,
        max_tokens=args.max_tokens,
        rollout_timeout=600.0,  # no timeouts: the cap and the turns bound a rollout well below this
        eval_every=0,
        ckpt_every=args.steps,  # once, at the end, in every run
    )
    return rl_async.resolve_config([f"--{k}={v!r}" for k, v in overrides.items()])


# -----------------------------------------------------------------------------
# Part 1: async vs sync, the same run, the same settings but the mode
#
# rl_async.train runs `--steps` trainer steps in mode "sync", then in mode "async" with every other setting
# the same, each run on fresh serve.py replica processes (replicas.start_replicas) of the same weights and
# with a fresh trainer copy of them; a third run is async at sync's concurrency (below). The workload,
# "longtail", wraps the search environment at difficulty 0 and is registered in envs.ENVS in this process
# only: every rollout takes `--turns` turns, and each non-final turn runs the real search tool, then waits a
# tool latency drawn from a seeded Pareto distribution (a slow sandbox, a web request), so a few rollouts take
# many times the median. Printed per run: trajectories per second (those the trainer received, and the
# distinct ones it trained on after the staleness and group filters), the trainer's idle fraction (its time in
# Orchestrator.ready over the step time), the ratio to sync, and each async run's staleness histogram: the
# price of the speed.
#
# The choices, and why part 1 is fair. A batch is 2 groups of 4 rollouts (B = 8), weights are pushed after
# every step in every run (sync pays a push per step as async does). The concurrency cap task_concurrency is
# (1 + ahead) * B in the sync run and the first async run: sync keeps exactly one batch in flight, so all B of
# its rollouts run at once (it gets the full concurrency per batch; with the cap B it runs the same), and
# async keeps up to (1 + ahead) batches in flight under the same cap. The third run, async with the cap B,
# runs no more rollouts at once than sync: its gain is not waiting for the slowest rollout of a batch alone,
# the first run's adds the deeper concurrency async can use. ahead = 3 lets the trainer take the first two
# finished groups of up to eight; tau = ahead + 1 keeps a group that later batches overtook by one step and
# drops older stragglers (counted in the histogram).


def run_mode(args, tok, mode, concurrency, work):
    """rl_async.train in one mode on fresh replicas and a fresh trainer -> a summary dict."""
    cfg = run_settings(args, mode, concurrency, os.path.join(work, f"{mode}{concurrency}"))
    m = engine.load_model(args.ckpt)
    urls, procs = replicas.start_replicas(args.ckpt, args.replicas)
    LongTailSearch.stop = threading.Event()  # after the start: the last run's rollouts have ended by now
    LongTailSearch.resets.clear()
    try:
        with swapped(orchestrator.Orchestrator, gateway_class=BenchGateway):
            records = rl_async.train(m, tok, urls, cfg, log=lambda line: print(f"  {mode} {line}"))
    finally:
        LongTailSearch.stop.set()  # the rollouts still in flight end at their next step
        replicas.stop_replicas(procs)
    return summarize(records)


def summarize(records):
    """Per-step records -> throughput and idle fraction over steps 2..N ("steady") and over all steps."""

    def over(rs):
        n = [sum(r["staleness"].values()) for r in rs]  # the batch: every trajectory ready() returned
        dt = [k / r["traj_per_s"] for k, r in zip(n, rs)]  # the step's seconds
        trained = sum(r["trajectories"] - r["padded"] for r in rs)  # distinct ones, padding copies out
        idle = sum(r["idle_frac"] * t for r, t in zip(rs, dt))
        return {"received": sum(n) / sum(dt), "trained": trained / sum(dt), "idle": idle / sum(dt)}

    stale = Counter()
    for r in records:
        stale.update({int(k): v for k, v in r["staleness"].items()})
    return {
        "all": over(records),
        "steady": over(records[1:] or records),
        "staleness": dict(sorted(stale.items())),
        "dropped": sum(r["stale"] for r in records),
        "seen": sum(stale.values()),
    }


def part_async(args, tok, work):
    """sync and async at the cap (1 + ahead) * B, then async at the cap B. -> {run name: summary}."""
    B = PER_STEP * GROUP
    cap = (1 + args.ahead) * B
    print(
        f"\n== part 1: async vs sync, {args.steps} trainer steps per run, batch {PER_STEP} groups x {GROUP} "
        f"(B = {B}), push every step, ahead {args.ahead}, tau {args.tau}, {args.replicas} replicas; "
        f"{LongTailSearch.turns} turns of <= {args.max_tokens} tokens per rollout, tool latency "
        f"{LongTailSearch.scale} s x Pareto({LongTailSearch.alpha}), at most {LongTailSearch.cap} s"
    )
    runs = {
        f"sync (cap {cap})": ("sync", cap),  # one batch in flight: the cap B would run the same
        f"async (cap {cap})": ("async", cap),
        f"async (cap {B})": ("async", B),  # as many rollouts at once as sync (the same run when ahead = 0)
    }
    out = {name: run_mode(args, tok, mode, c, work) for name, (mode, c) in runs.items()}
    base = out[f"sync (cap {cap})"]
    print(f"{'run':>15}  trained/s  received/s  idle   ratio  | all steps: trained/s  idle  ratio")
    for name, s in out.items():
        st, al = s["steady"], s["all"]
        print(
            f"{name:>15}  {st['trained']:9.2f}  {st['received']:10.2f}  {st['idle']:4.0%}  "
            f"{st['trained'] / base['steady']['trained']:5.2f}x |            {al['trained']:9.2f}  "
            f"{al['idle']:4.0%}  {al['trained'] / base['all']['trained']:4.2f}x"
        )
    print("(steps 2 to N; the first step fills the pipeline in every run; ratio: trained/s over sync's)")
    for name, s in out.items():
        if name.startswith("async"):
            print(
                f"{name}: staleness (versions behind: trajectories) {s['staleness']}, dropped as stale "
                f"{s['dropped']} of {s['seen']} ({s['dropped'] / max(s['seen'], 1):.0%})"
            )
    return {name: s["steady"]["trained"] / base["steady"]["trained"] for name, s in out.items()}, out


# -----------------------------------------------------------------------------
# Part 2: prefix-cache hits, the DP-aware router vs round-robin
#
# The same rollouts (the same wrapper, no latency, two more turns, sampling seeded by rollout id and turn) are
# played twice by rollout.rollout, 8 at a time, on the same replicas with the prefix cache on (2, then 4 of
# them), each run from caches emptied by POST /flush_cache: with rl_async's router (rl.route pins a rollout to
# one replica, as orchestrator.Orchestrator does) and with round-robin (each request to the next replica, as
# a plain load balancer does). Hit rate = cached
# prompt tokens / prompt tokens, summed over every request (each response's
# usage.prompt_tokens_details.cached_tokens, which rollout.Gateway counts), also split into first turns (only
# the shared system prompt and task can hit) and later turns, and the ratio of prefilled (missed) tokens, the
# compute a hit saves. Every rollout shares a long system prompt with the tool list, which round-robin hits as
# well; the router's edge is the rollout's own growing context, and it grows with the number of replicas.


def play(args, tok, gateway_class, urls):
    """args.groups groups of 4 rollouts of the same seeds, 8 at a time, on the replicas at urls with their
    prefix caches emptied first (POST /flush_cache), each rollout's replica picked by rl_async's router
    (rl.route: pinned for the whole rollout, bounded loads) -> the Tally of every request and the failed
    rollouts. RoundRobinGateway then sends each request elsewhere, so both runs share every line but the
    replica a request goes to."""
    tally = Tally()
    for url in urls:
        requests.post(url + "/flush_cache", timeout=60).raise_for_status()
    LongTailSearch.stop = threading.Event()
    LongTailSearch.resets.clear()
    ring = rl.build_ring(urls)
    where = {}  # the router's state, as orchestrator.Orchestrator keeps it
    loads = dict.fromkeys(urls, 0)
    lock = threading.Lock()

    def one(rid, seed):
        with lock:
            url = rl.route(rid, ring, where, loads)
        gw = gateway_class(url, rid, temperature=1.0, max_tokens=args.max_tokens, timeout=600.0)
        try:
            return rollout.rollout(LongTailSearch(0), gw, tok, seed, thinking=False)["crashed"]
        finally:
            with lock:
                rl.release(rid, where, loads)

    try:
        rr = swapped(RoundRobinGateway, urls=urls, counter=itertools.count())
        with swapped(BenchGateway, tally=tally), rr, ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(one, f"g{g}-{k}", g) for g in range(args.groups) for k in range(4)]
            failed = sum(1 for j in jobs if j.exception() is not None or j.result())
    finally:
        LongTailSearch.stop.set()
    return tally, failed


def print_tally(n, name, tally, failed):
    turns = sorted(tally.prompt)
    prompt, sent = sum(tally.prompt.values()), sum(tally.requests.values())
    print(
        f"{n} replicas, {name:>11}: hit rate {tally.rate(turns):.1%} of {prompt} prompt tokens in "
        f"{sent} requests; first turns {tally.rate([1]):.1%}, later turns "
        f"{tally.rate(turns[1:]):.1%}; {failed} failed rollouts"
    )


def part_cache(args, tok):
    """Router and round-robin on each replica count of --cache_replicas. -> {n: {name: Tally}}."""
    counts = [int(n) for n in args.cache_replicas.split(",")]
    print(
        f"\n== part 2: prefix-cache hit rate, {args.groups} groups x 4 rollouts of up to "
        f"{LongTailSearch.turns} turns, 8 rollouts at once, on {' and then '.join(map(str, counts))} replicas"
    )
    out = {}
    for n in counts:
        out[n] = {}
        urls, procs = replicas.start_replicas(args.ckpt, n)  # both runs on them, each from empty caches
        try:
            for name, cls in (("router", BenchGateway), ("round-robin", RoundRobinGateway)):
                out[n][name], failed = play(args, tok, cls, urls)
                print_tally(n, name, out[n][name], failed)
        finally:
            replicas.stop_replicas(procs)
        hit = {name: t.rate(sorted(t.prompt)) for name, t in out[n].items()}
        cached = hit["router"] / max(hit["round-robin"], 1e-9)
        prefilled = (1 - hit["router"]) / max(1 - hit["round-robin"], 1e-9)
        print(
            f"{n} replicas, router / round-robin: {cached:.2f}x cached tokens, {prefilled:.2f}x prefilled "
            "tokens (the compute a hit saves)"
        )
    return out


# -----------------------------------------------------------------------------
# Part 3: the trainer's step, each group's prompt encoded once vs one forward per row
#
# One batch of configs/rl_toy.py's mix (general, search, terminal at the toy level; 16 groups of 8, 48 tokens
# a turn) is played on one replica of the model, then rl.rl_step runs on it both ways, alternating, each from
# the same weights with fresh optimizers: the step times, the tokens each way, and how far apart the two
# updated models are (rounding only). With the default fresh model every reply runs to 48 tokens and ends the
# episode; pass the toy policy (--ckpt runs/cpu/sft_episodes/ckpt.pt) for the run's real shapes.

STEP_TASKS = (("general", 0), ("search", 0), ("terminal", 0))  # configs/rl_toy.py's mix


def toy_batch(args, tok):
    """One trainer batch of configs/rl_toy.py's mix as rl_async plays it: args.step_groups groups of 8
    rollouts (temperature 1, 48 tokens a turn, thinking on), the tasks in turn, on one fresh replica.
    -> Trajectory records (crashed rollouts left out)."""
    urls, procs = replicas.start_replicas(args.ckpt, 1)

    def one(name, d, seed, rid, g):
        gw = rollout.Gateway(urls[0], rid, temperature=1.0, max_tokens=48, timeout=600.0)
        episode = rollout.rollout(envs.ENVS[name](d), gw, tok, seed, thinking=True)
        if episode["crashed"]:
            return []
        return rollout.trajectories(gw, episode, g)

    jobs = []
    try:
        with ThreadPoolExecutor(16) as pool:
            for g in range(args.step_groups):
                name, d = STEP_TASKS[g % len(STEP_TASKS)]
                seed = envs.seeds(envs.ENVS[name](d), "train", 1, start=1000 + g)[0]
                for k in range(8):
                    jobs.append(pool.submit(one, name, d, seed, f"step{g}-{k}", g))
            batch = [t for j in jobs for t in j.result()]
    finally:
        replicas.stop_replicas(procs)
    return batch


def part_step(args, tok):
    """rl.rl_step on one batch of the toy mix, plain (one forward per row, in like-length micro-batches)
    and shared (shared_prefix.py), alternating, each from the same weights and fresh optimizers.
    -> {"plain": [s], "shared": [s], "tokens", "shared_tokens", "max_diff"}."""
    import copy

    import shared_prefix

    print(
        f"\n== part 3: the trainer's step, {args.step_groups} groups x 8 rollouts of configs/rl_toy.py's mix "
        "(general, search, terminal), each prompt encoded once vs one forward per row"
    )
    batch = toy_batch(args, tok)
    rows = [t.ids for t in batch]
    groups = [t.group for t in batch]
    units = shared_prefix.prefix_units(rows, groups)
    tokens = sum(len(r) for r in rows)
    shared_tokens = tokens - sum(P * (len(idx) - 1) for P, idx in units)  # each prefix once
    lengths = sorted(len(r) for r in rows)
    print(
        f"{len(batch)} trajectories, {tokens} tokens (median {lengths[len(lengths) // 2]}, longest "
        f"{lengths[-1]}), {sum(sum(t.mask) for t in batch)} sampled; each prompt once: {shared_tokens} tokens"
    )
    base = engine.load_model(args.ckpt)
    rl.freeze_for_rl(base)
    out = {"plain": [], "shared": [], "tokens": tokens, "shared_tokens": shared_tokens}
    after = {}
    for rep in range(args.step_reps):
        for name in ("plain", "shared"):
            m = copy.deepcopy(base)
            optimizers = rl.build_optimizers(m, lr_muon=1.5e-3, lr_adamw=5e-4)
            t0 = time.perf_counter()
            rl.rl_step(m, optimizers, batch, micro_tokens=8192, shared_prefix=name == "shared")
            out[name].append(time.perf_counter() - t0)
            after[name] = m
    diff = 0.0
    for p, q in zip(after["plain"].parameters(), after["shared"].parameters()):
        diff = max(diff, float((p - q).detach().abs().max()))
    out["max_diff"] = diff
    plain, shared = min(out["plain"]), min(out["shared"])
    print(
        f"step: plain {plain:.2f} s, shared {shared:.2f} s (best of {args.step_reps}; all: "
        f"{', '.join(f'{x:.2f}' for x in out['plain'])} / {', '.join(f'{x:.2f}' for x in out['shared'])}); "
        f"{plain / shared:.2f}x; the weights after the two steps differ by at most {diff:.1e}"
    )
    return out


# -----------------------------------------------------------------------------
# python bench/bench_rl.py


def main(argv=None):
    """Run the parts -> {"async": {run: summary}, "cache": {replicas: {"router" / "round-robin": Tally}},
    "step": part_step's timings}."""
    ap = argparse.ArgumentParser(description="async vs sync RL throughput; prefix-cache hits, router vs RR")
    ap.add_argument("--steps", type=int, default=8, help="trainer steps per mode in part 1")
    ap.add_argument("--ckpt", default=None, help="train.py ckpt.pt or a save_pretrained dir (default: fresh)")
    ap.add_argument(
        "--quick", action="store_true", help="a small run: 3 steps, 1 replica, short latencies, 2 groups"
    )
    ap.add_argument("--parts", default="async,cache,step", help="comma list of: async, cache, step")
    ap.add_argument("--replicas", type=int, default=2, help="part 1: serve.py replica processes")
    ap.add_argument("--cache_replicas", default="2,4", help="part 2: replica counts, comma-separated")
    ap.add_argument("--ahead", type=int, default=3, help="async: batches in flight beyond the one trained")
    ap.add_argument("--tau", type=int, default=None, help="staleness bound (default: ahead + 1)")
    ap.add_argument("--turns", type=int, default=4, help="turns per rollout in part 1 (part 2: 2 more)")
    ap.add_argument("--scale", type=float, default=0.3, help="tool latency: Pareto minimum, seconds")
    ap.add_argument("--alpha", type=float, default=1.2, help="tool latency: Pareto shape (smaller: heavier)")
    ap.add_argument("--cap", type=float, default=15.0, help="tool latency: the largest wait, seconds")
    ap.add_argument("--max_tokens", type=int, default=16, help="tokens per turn")
    ap.add_argument("--groups", type=int, default=6, help="part 2: groups of 4 rollouts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (this process)")
    ap.add_argument("--step_groups", type=int, default=16, help="part 3: groups of 8 rollouts in the batch")
    ap.add_argument("--step_reps", type=int, default=2, help="part 3: timed steps of each kind")
    ap.add_argument("--json", default=None, help="also write the results to this file (part 2: summaries)")
    args = ap.parse_args(argv)
    if args.quick:  # part 1 on one replica: three fewer serve.py processes to start
        args.steps, args.groups, args.scale, args.cap, args.cache_replicas = 3, 2, 0.1, 2.0, "2"
        args.replicas = 1
        args.step_groups, args.step_reps = 3, 1
    args.tau = args.ahead + 1 if args.tau is None else args.tau
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    threads, cwd = torch.get_num_threads(), os.getcwd()
    torch.set_num_threads(args.threads)
    print(describe_machine())
    if args.ckpt is not None:
        args.ckpt = os.path.abspath(args.ckpt)
    if args.json is not None:
        args.json = os.path.abspath(args.json)
    os.chdir(ROOT)  # serve.py finds the tokenizer in data/
    work = tempfile.mkdtemp(prefix="bench_rl_")
    results = {}
    try:
        if args.ckpt is None:
            args.ckpt = fresh_checkpoint(os.path.join(work, "init"))
            print(f"model: a freshly initialized toy GLM-5 (configs/toy.py, seed 0), saved to {args.ckpt}")
        else:
            print(f"model: {args.ckpt}")
        tok = serve.load_tokenizer(None, args.ckpt, engine.load_model(args.ckpt).config.vocab_size)
        BenchGateway.eos = tok.encode_chat_token("<|endoftext|>")
        envs.ENVS["longtail"] = LongTailSearch  # registered in this process only, for the run
        parts = args.parts.split(",")
        summary = []
        if "async" in parts:
            latency = dict(alpha=args.alpha, scale=args.scale, cap=args.cap)
            with swapped(LongTailSearch, turns=args.turns, **latency):
                ratios, results["async"] = part_async(args, tok, work)
            B = PER_STEP * GROUP
            full = ratios[f"async (cap {(1 + args.ahead) * B})"]
            equal = ratios[f"async (cap {B})"]
            idle = [f"{name} {s['steady']['idle']:.0%}" for name, s in results["async"].items()]
            summary.append(
                f"async/sync {full:.2f}x trained traj/s ({equal:.2f}x at sync's concurrency); trainer idle: "
                f"{', '.join(idle)}"
            )
        if "cache" in parts:
            with swapped(LongTailSearch, turns=args.turns + 2, scale=0.0):
                results["cache"] = part_cache(args, tok)
            for n, tallies in results["cache"].items():
                hit = {name: t.rate(sorted(t.prompt)) for name, t in tallies.items()}
                summary.append(
                    f"prefix-cache hits {hit['router']:.0%} router vs {hit['round-robin']:.0%} round-robin "
                    f"on {n} replicas"
                )
        if "step" in parts:
            results["step"] = part_step(args, tok)
            st = results["step"]
            speedup = min(st["plain"]) / min(st["shared"])
            summary.append(
                f"trainer step {speedup:.2f}x faster with each prompt encoded once "
                f"({st['shared_tokens'] / st['tokens']:.0%} of the tokens)"
            )
        load = os.getloadavg()[0]
        print(f"\nsummary: {'; '.join(summary)} (load {load:.1f} at the end, {os.cpu_count()} cores)")
        if args.json is not None:
            written = dict(results)
            if "cache" in written:
                cache = written["cache"]
                written["cache"] = {n: {k: t.summary() for k, t in gw.items()} for n, gw in cache.items()}
            with open(args.json, "w") as f:
                json.dump(written, f, indent=1, default=str)
    finally:
        envs.ENVS.pop("longtail", None)
        shutil.rmtree(work, ignore_errors=True)
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
