"""
Rollout replicas for RL: serve.py processes started, stopped and restarted here, or servers given as URLs,
and the weight push that keeps them on the trainer's policy (GLM-5 report, arXiv 2602.15763, its agentic RL
infrastructure: inference engines decoupled from the trainer, weights synchronized to them as training
goes). rl_async.py uses them; serve.py's POST /update_weights_from_disk is the other end of a push.

At scale the replicas are other machines' serve.py (or SGLang / vLLM) servers given as URLs, and a push
writes the weights to storage every replica reads (a shared filesystem); a torch.distributed broadcast group
from the trainer's ranks to the replicas' would skip the disk and is not built. What runs here is the
shared-storage push: save_pretrained, then the HTTP call to each replica.

Run it: through rl_async.py (python rl_async.py configs/rl_toy.py starts two replicas).
Tests: python -m pytest -q tests/test_rl_async.py
Honest limits: replicas run on the CPU with one thread each when started here (a GPU replica is a URL);
a restart relaunches the process on its port with the initial weights, then the caller pushes the current
ones; a hung replica that still holds its port is not killed.
"""

import os
import socket
import subprocess
import sys
import time

import requests
import torch

import weights

# -----------------------------------------------------------------------------
# Starting, watching and stopping serve.py processes


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_replica(ckpt, port):
    """One `python serve.py --ckpt ckpt --port port` process (CPU, one thread: replicas share the cores)."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "serve.py"), "--ckpt", os.path.abspath(ckpt)]
    cmd += ["--port", str(port), "--device", "cpu"]
    # run in the repository, where serve.py finds the project's tokenizer (data/), wherever we were started
    return subprocess.Popen(cmd, cwd=here, env=os.environ | {"OMP_NUM_THREADS": "1"})


def wait_healthy(url, proc, deadline):
    """Wait until url answers GET /health -> None, or a sentence saying why it never will."""
    while True:
        if proc is not None and proc.poll() is not None:
            return f"the replica for {url} exited with code {proc.returncode}; see its error above"
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return None
        except requests.RequestException:
            pass
        if time.time() > deadline:
            return f"the replica at {url} did not answer /health in time"
        time.sleep(0.5)


def start_replicas(ckpt, n, wait=300.0):
    """n serve.py processes of ckpt on free loopback ports -> (urls, {url: process}), once each answers
    GET /health. The caller stops them (stop_replicas; main registers it at exit)."""
    procs = {}
    for _ in range(n):
        procs[f"http://127.0.0.1:{free_port()}"] = None
    for url in procs:
        procs[url] = launch_replica(ckpt, int(url.rsplit(":", 1)[1]))
    deadline = time.time() + wait
    for url, p in procs.items():
        why = wait_healthy(url, p, deadline)
        if why:
            stop_replicas(procs)
            raise SystemExit(why)
    return list(procs), procs


def stop_replicas(procs):
    """Stop the serve.py processes of {url: process} (or a list of processes)."""
    procs = list(procs.values()) if isinstance(procs, dict) else list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def process_restarter(procs, ckpt, wait=120.0):
    """-> restart(url): relaunch a dead serve.py process of procs on its own port (from ckpt, the initial
    weights; the caller then pushes the current ones) and wait for it; True once it answers."""

    def restart(url):
        p = procs.get(url)
        if p is None or p.poll() is None:
            return False  # not ours, or still running (a hung one is not killed here)
        procs[url] = launch_replica(ckpt, int(url.rsplit(":", 1)[1]))
        return wait_healthy(url, procs[url], time.time() + wait) is None

    return restart


# -----------------------------------------------------------------------------
# Talking to a replica: its version, new weights


def load_weights(url, directory, version):
    """POST /update_weights_from_disk: the replica loads the save_pretrained directory as `version`.
    -> True, or False if it does not answer (raises if it answers with an error)."""
    body = {"model_path": os.path.abspath(directory), "weight_version": version}
    try:
        resp = requests.post(url + "/update_weights_from_disk", json=body, timeout=600)
    except requests.ConnectionError:
        return False
    if resp.status_code != 200:
        raise RuntimeError(f"the replica at {url} refused the weights: {resp.text[:300]}")
    return True


def push_weights(m, urls, directory, version, dtype=torch.float32, state=None):
    """Save the trainer's weights (m's own, or `state`, the whole tensors of a sharded m) and have every
    replica load them as `version`. -> the URLs that did not answer (dead replicas, for the router to
    drop)."""
    weights.save_pretrained(m, directory, dtype=dtype, state=state)
    return [url for url in urls if not load_weights(url, directory, version)]


def answers(url):
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def weight_version(url):
    """The policy version a replica serves (its /health), or None if it does not answer."""
    try:
        return requests.get(url + "/health", timeout=2).json().get("weight_version")
    except (requests.RequestException, ValueError):
        return None
