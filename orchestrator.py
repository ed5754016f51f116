"""
The multi-task rollout orchestrator of asynchronous RL (GLM-5 report, arXiv 2602.15763, its agentic RL
infrastructure: rollouts of many task types run concurrently with per-task concurrency caps, each rollout
pinned to one inference replica by DP-aware routing, a crashing or hanging environment isolated and its
samples marked as failures). rl_async.py's training loop drives it.

Groups of group_size rollouts (one task, one training-split seed; held-out seeds by envs.split_of stay for
evaluation), the task drawn from the configured mix, are played by rollout.rollout through the TITO gateway
(with a sampling seed per request) on one thread pool per task, whose size is that task's cap. rl.route
pins each rollout id to a replica; a replica that refuses connections leaves the ring and its rollouts
start over elsewhere; a dead one is revived (restarted or probed) and rejoins with the last pushed weights.

Run it: through rl_async.py. Tests: python -m pytest -q tests/test_rl_async.py
Honest limits: a timed-out rollout's thread cannot be killed (it holds its pool's worker until its HTTP
timeout or its environment returns); the timeout counts from a rollout's submission, its wait for a worker
included; the router balances live rollouts per replica, not their tokens.
"""

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests

import envs
import rollout
from replicas import answers, load_weights, weight_version
from rl import build_ring, hash64, release, remove_replica, route
from rollout import Trajectory

# -----------------------------------------------------------------------------
# The task mix


def parse_tasks(spec):
    """ "math:0:1,search:0:2" -> [(name, difficulty, weight)], checked against envs.ENVS."""
    out = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        try:
            good = len(parts) == 3 and parts[0] in envs.ENVS and int(parts[1]) >= 0 and float(parts[2]) > 0
        except ValueError:
            good = False
        if not good:
            raise SystemExit(
                f"task {item!r}: write name:difficulty:weight (a name from {', '.join(envs.ENVS)}, a "
                "difficulty 0 to 5, a weight above 0)"
            )
        out.append((parts[0], int(parts[1]), float(parts[2])))
    return out


def parse_eval_tasks(spec):
    """ "math:0,search:0" -> [(name, difficulty)]; empty -> []."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 2 or parts[0] not in envs.ENVS or not parts[1].isdigit():
            names = ", ".join(envs.ENVS)
            raise SystemExit(f"eval task {item!r}: write name:difficulty with a name from {names}")
        out.append((parts[0], int(parts[1])))
    return out


# -----------------------------------------------------------------------------
# The orchestrator: groups of rollouts over the task mix, on thread pools, through the router


class SeededGateway(rollout.Gateway):
    """rollout.Gateway with a sampling seed in every request, derived from the rollout id and the turn: a
    rollout replayed with the same id on the same weights samples the same tokens (the sync/async test)."""

    def request_seed(self):
        return hash64(f"{self.rollout_id}/{len(self.requests)}") >> 1  # in [0, 2**63)


class ReplicaGone(Exception):
    """Every replica is dead and none can be brought back: nothing is left to generate with."""


class Orchestrator:
    """Runs groups of rollouts: a group is group_size rollouts of one task on one seed, its task drawn by
    the mix's weights. Each task has its own thread pool of task_concurrency workers (its concurrency cap).
    A rollout's id picks its replica through the DP-aware router; a replica that refuses connections is
    removed from the ring and the rollout starts over on another (its partial record is thrown away, so
    nothing is trained twice). A rollout whose environment raises, whose policy raises, or that runs past
    rollout_timeout gives one failed Trajectory: group_filter drops it.

    submit() starts the next group; ready(n) waits for n finished groups and returns their trajectories,
    lowest group index first. revive(url), if given, restarts a dead replica (True once it answers); a dead
    replica that answers again gets the last pushed weights (`latest`) and rejoins the ring."""

    # the rollout.Gateway subclass each rollout talks through (a benchmark swaps it)
    gateway_class = SeededGateway

    def __init__(self, urls, tok, cfg, revive=None):
        self.tok = tok
        self.cfg = cfg
        self.mix = parse_tasks(cfg["tasks"])
        self.rng = random.Random(cfg["seed"])
        tasks = [(name, d) for name, d, _ in self.mix] + parse_eval_tasks(cfg["eval_tasks"])
        self.pools = {
            task: ThreadPoolExecutor(cfg["task_concurrency"], thread_name_prefix=f"{task[0]}{task[1]}")
            for task in dict.fromkeys(tasks)
        }
        self.next_seed = {(name, d): cfg["seed"] for name, d, _ in self.mix}
        self.urls = list(urls)
        self.ring = build_ring(self.urls)
        self.where = {}
        self.loads = dict.fromkeys(self.urls, 0)
        self.lock = threading.Lock()  # the router's state, shared by every worker
        self.groups = {}  # group index -> [(future, rollout id), ...], submitted and not yet collected
        self.spec = {}  # group index -> (name, difficulty, task seed), until the trainer has used it
        self.submitted = 0
        self.dead = []  # replicas out of the ring
        self.revive = revive
        self.revived = 0
        self.joined = {}  # url -> when it last rejoined the ring
        self.tried = {}  # url -> when revive last tried it
        self.latest = None  # (directory, version) of the last push: what a replica rejoins with
        self.failures = Counter()  # failed rollouts by cause, for the log
        self.started = {}  # rollout id -> when it was submitted
        self.closed = False  # set by close(): a rollout waiting for a replica gives up

    # the state a checkpoint keeps, so a resumed run draws the same tasks and seeds
    def state(self):
        return {
            "rng": self.rng.getstate(),
            "next_seed": [[name, d, s] for (name, d), s in self.next_seed.items()],
            "submitted": self.submitted,
            "pending": sorted(self.spec.items()),
            "failures": dict(self.failures),
        }

    def restore(self, state):
        """Take a checkpoint's state and play its untrained groups again, same ids, same seeds."""
        self.rng.setstate(state["rng"])
        for name, d, s in state["next_seed"]:
            self.next_seed[name, d] = s
        self.submitted = state["submitted"]
        self.failures.update(state["failures"])
        for g, (name, d, task_seed) in state["pending"]:
            self.launch(g, name, d, task_seed)

    def train_seed(self, name, d):
        """The next seed of this task whose prompt is in the training split (never a held-out task)."""
        s = envs.seeds(envs.ENVS[name](d), "train", 1, start=self.next_seed[name, d])[0]
        self.next_seed[name, d] = s + 1
        return s

    def submit(self):
        name, d, _ = self.rng.choices(self.mix, weights=[w for *_, w in self.mix])[0]
        g = self.submitted
        self.submitted += 1
        self.launch(g, name, d, self.train_seed(name, d))

    def launch(self, g, name, d, task_seed):
        self.spec[g] = (name, d, task_seed)
        pool = self.pools[name, d]
        rids = [f"g{g}-{k}" for k in range(self.cfg["group_size"])]
        for rid in rids:
            self.started[rid] = time.time()  # the timeout counts from here, its wait in the queue included
        self.groups[g] = [(pool.submit(self.play, name, d, task_seed, rid, g), rid) for rid in rids]

    def task_of(self, g):
        name, d, _ = self.spec[g]
        return f"{name}:{d}"

    def used(self, groups):
        """The trainer is done with these groups (trained or dropped): a checkpoint no longer replays them."""
        for g in groups:
            self.spec.pop(g, None)

    def in_flight(self):
        return len(self.groups)

    def pick(self, rid):
        """The replica for this rollout, or None when no replica is live (checked under the lock)."""
        with self.lock:
            if not self.loads:
                return None
            return route(rid, self.ring, self.where, self.loads)

    def live_urls(self):
        with self.lock:
            return list(self.urls)

    def count_failure(self, cause):
        with self.lock:
            self.failures[cause] += 1

    def drop_replica(self, url, since=None):
        """Take a replica out of the ring. since: when the caller picked it; a replica that rejoined after
        that is left alone (the refused connection was its old process's)."""
        with self.lock:
            if since is not None and self.joined.get(url, 0.0) > since:
                return
            if url in self.loads:
                self.ring = remove_replica(url, self.ring, self.where, self.loads)[0]
                self.urls.remove(url)
                self.dead.append(url)

    def add_replica(self, url):
        """A replica back in the ring: new rollouts may land on it; live ones stay where they are."""
        with self.lock:
            self.joined[url] = time.time()
            if url in self.dead:
                self.dead.remove(url)
            self.urls.append(url)
            self.loads[url] = 0
            self.ring = build_ring(self.urls)

    def revive_dead(self, every=2.0):
        """Try to bring each dead replica back (restart it if it is ours, else see if it answers), at most
        once per `every` seconds each; one that answers loads the last pushed weights and rejoins."""
        for url in list(self.dead):
            if time.time() - self.tried.get(url, 0.0) < every:
                continue
            self.tried[url] = time.time()
            if not (self.revive and self.revive(url)) and not answers(url):
                continue
            has = weight_version(url)
            if self.latest and has != self.latest[1] and not load_weights(url, *self.latest):
                continue
            self.add_replica(url)
            self.revived += 1

    def play(self, name, d, task_seed, rid, g):
        """One rollout on one replica -> its Trajectory records (one failed one when it crashed)."""
        deadline = self.started.get(rid, time.time()) + self.cfg["rollout_timeout"]
        while True:
            picked = time.time()
            url = self.pick(rid)
            if url is None:
                if self.revive is None:
                    raise ReplicaGone("every rollout replica is dead and none was started here to restart")
                if self.closed or time.time() > deadline:
                    self.count_failure("no replica")
                    return [failed_trajectory(g, rid)]
                time.sleep(0.2)  # the trainer's thread is restarting them
                continue
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
                self.drop_replica(url, since=picked)  # routed around: the rollout starts over elsewhere
                continue
            except Exception as e:  # the policy or the agent loop raised: isolated, marked failed
                self.count_failure(type(e).__name__)
                return [failed_trajectory(g, rid)]
            finally:
                with self.lock:
                    if rid in self.where:
                        release(rid, self.where, self.loads)
            if episode["crashed"] or not gw.segments:
                self.count_failure("environment")
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
                self.count_failure("timeout")
                out.append(failed_trajectory(g, rid))
                continue
            e = f.exception()
            if isinstance(e, ReplicaGone):
                raise e
            if e is None:
                out += f.result()
            else:  # raised outside the rollout (a TITO mismatch, say): isolated as well
                self.count_failure(type(e).__name__)
                out.append(failed_trajectory(g, rid))
        return out

    def ready(self, n):
        """Wait until n groups are finished -> (their group indices, their trajectories, the seconds spent
        waiting). Dead replicas are revived while it waits."""
        t0 = time.time()
        while sum(self.group_done(g) for g in self.groups) < n:
            if self.dead:
                self.revive_dead()
            time.sleep(0.01)
        done = sorted(g for g in self.groups if self.group_done(g))[:n]
        return done, [t for g in done for t in self.collect(g)], time.time() - t0

    def evaluate(self, episodes, step=0):
        """Mean reward per task (the mix's and eval_tasks) over `episodes` held-out seeds, one sample each at
        the training temperature, on the replicas' current weights (a failed episode counts 0)."""
        out = {}
        for name, d in self.pools:
            held = envs.seeds(envs.ENVS[name](d), "heldout", episodes)
            pool = self.pools[name, d]
            futures = []
            for i, s in enumerate(held):
                futures.append(pool.submit(self.play, name, d, s, f"eval{step}-{name}{d}-{i}", -1))
            rounds = 1 + len(futures) / self.cfg["task_concurrency"]
            deadline = time.time() + self.cfg["rollout_timeout"] * rounds
            while not all(f.done() for f in futures) and time.time() < deadline:
                if self.dead:
                    self.revive_dead()
                time.sleep(0.05)
            rewards = []
            for f in futures:
                ok = f.done() and f.exception() is None and not f.result()[0].failed
                rewards.append(f.result()[0].reward if ok else 0.0)  # hung or failed: 0
            out[f"{name}:{d}"] = sum(rewards) / len(rewards)
        return out

    def close(self):
        self.closed = True
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


def failed_trajectory(g, rid):
    return Trajectory(group=g, ids=[], mask=[], logprobs=[], versions=[], failed=True, rollout_id=rid)
