"""bench_rl.py: its long-tail environment draws the same latencies for the same seed and rollout; its gateway
closes a reply cut at max_tokens with glue the TITO record masks, tallies every response's usage, and
round-robin sends each request to the next replica (a fake replica in place of HTTP, so these are fast);
and `--quick` end to end over real serve.py replica processes (slow: a minute or more on 2 loaded cores)."""

import json

import pytest

import bench_rl
import envs
import orchestrator
import rollout


@pytest.fixture
def longtail(monkeypatch):
    """The wrapper's class settings restored after the test, its reset counts cleared before."""
    for key in ("turns", "alpha", "scale", "cap", "stop"):
        monkeypatch.setattr(bench_rl.LongTailSearch, key, getattr(bench_rl.LongTailSearch, key))
    bench_rl.LongTailSearch.resets.clear()
    return bench_rl.LongTailSearch


def test_latencies_are_seeded_by_task_seed_and_rollout(longtail):
    longtail.scale, longtail.alpha, longtail.cap = 0.5, 1.2, 4.0

    def draws(seed):
        env = longtail(0)
        env.reset(seed)
        return [env.latency() for _ in range(50)]

    first, second, other = draws(3), draws(3), draws(4)
    assert first != second and first != other  # the group's next rollout, another task: other waits
    assert all(0.5 <= x <= 4.0 for x in first + second + other) and 4.0 in first + second + other
    longtail.resets.clear()  # a new run plays the same seeds: the same waits, rollout by rollout
    assert draws(3) == first and draws(3) == second


class FakeReplica:
    """requests.post in place of serve.py: `n` ordinary ids per reply, cut at max_tokens (finish "length"),
    and usage saying the first `cached` prompt tokens were in the prefix cache. Records the URLs asked."""

    def __init__(self, tok, n=5, cached=16):
        self.ids = tok.encode_ordinary("fox jumps over the lazy dog again")[:n]
        self.cached, self.urls = cached, []

    def __call__(self, url, json, headers, timeout):
        self.urls.append(url)
        ids = self.ids[: json["max_tokens"]]
        body = {
            "prompt_token_ids": json["prompt"],
            "choices": [
                {
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": [-1.0] * len(ids)},
                    "token_versions": [0] * len(ids),
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(json["prompt"]),
                "prompt_tokens_details": {"cached_tokens": self.cached},
            },
        }
        return type("Response", (), {"status_code": 200, "json": lambda self: body, "text": ""})()


def play(tok, longtail, gateway_class, fake, monkeypatch, turns=3):
    monkeypatch.setattr(rollout.requests, "post", fake)
    monkeypatch.setattr(bench_rl.BenchGateway, "eos", tok.encode_chat_token("<|endoftext|>"))
    tally = bench_rl.Tally()
    monkeypatch.setattr(bench_rl.BenchGateway, "tally", tally)
    longtail.turns, longtail.scale = turns, 0.0
    gw = gateway_class("http://replica-a", "g0-0", max_tokens=4)
    episode = rollout.rollout(longtail(0), gw, tok, seed=1, thinking=False)
    return gw, episode, tally


def test_the_gateway_closes_cut_replies_and_keeps_the_record_exact(tok, longtail, monkeypatch):
    fake = FakeReplica(tok)
    gw, episode, tally = play(tok, longtail, bench_rl.BenchGateway, fake, monkeypatch)
    eos = tok.encode_chat_token("<|endoftext|>")
    assert episode["turns"] == 3 and not episode["crashed"] and episode["reason"].startswith("wrong")
    [traj] = rollout.trajectories(gw, episode, group=0)  # the episode's ids are the record's
    sampled = [i for i, m in zip(traj.ids, traj.mask) if m]
    assert sampled == fake.ids[:4] * 3  # every sampled token trained once, the glue never
    glue = [k for k, i in enumerate(traj.ids) if i == eos]
    assert len(glue) == 3 and all(traj.mask[k] == 0 and traj.versions[k] == -1 for k in glue)
    assert all(traj.ids[k - 1] == fake.ids[3] for k in glue)  # right after each cut reply
    # the next prompt extends the last prompt + completion + glue: the gateway's TITO check passed
    for a, b in zip(gw.requests, gw.requests[1:]):
        assert b["prompt"][: len(a["prompt"]) + 5] == a["prompt"] + a["completion"] + [eos]
    # the tally: every request's usage, by turn
    assert dict(tally.requests) == {1: 1, 2: 1, 3: 1}
    assert [tally.prompt[t] for t in (1, 2, 3)] == [len(r["prompt"]) for r in gw.requests]
    assert gw.cached_tokens == sum(tally.cached.values()) == 3 * 16
    assert tally.rate([1, 2, 3]) == 48 / sum(len(r["prompt"]) for r in gw.requests)
    assert tally.summary() == {  # what --json writes for a run
        "hit_rate": tally.rate([1, 2, 3]),
        "later_turns": tally.rate([2, 3]),
        "prompt_tokens": sum(len(r["prompt"]) for r in gw.requests),
        "turns": 3,
    }
    assert set(fake.urls) == {"http://replica-a/v1/completions"}  # pinned: the router's replica


def test_round_robin_sends_each_request_to_the_next_replica(tok, longtail, monkeypatch):
    fake = FakeReplica(tok)
    urls = ["http://a", "http://b", "http://c"]
    monkeypatch.setattr(bench_rl.RoundRobinGateway, "urls", urls)
    monkeypatch.setattr(bench_rl.RoundRobinGateway, "counter", bench_rl.itertools.count())
    gw, episode, _ = play(tok, longtail, bench_rl.RoundRobinGateway, fake, monkeypatch, turns=5)
    assert episode["turns"] == 5
    assert fake.urls == [f"{u}/v1/completions" for u in urls + urls[:2]]


def test_the_wrapper_is_registered_for_the_run_only():
    assert "longtail" not in envs.ENVS  # bench_rl imported: nothing added to the project's tasks
    assert orchestrator.Orchestrator.gateway_class is orchestrator.SeededGateway


@pytest.mark.slow
def test_quick_run_end_to_end(monkeypatch, capsys, tmp_path):
    cwd = bench_rl.os.getcwd()
    results = bench_rl.main(["--quick", "--json", str(tmp_path / "results.json")])
    out = capsys.readouterr().out
    assert out.startswith("load:") and "summary: async/sync" in out and "prefix-cache hits" in out
    assert bench_rl.os.getcwd() == cwd and "longtail" not in envs.ENVS
    assert orchestrator.Orchestrator.gateway_class is orchestrator.SeededGateway
    assert (bench_rl.LongTailSearch.turns, bench_rl.LongTailSearch.scale) == (4, 0.3)  # put back
    runs = results["async"]
    assert list(runs) == ["sync (cap 32)", "async (cap 32)", "async (cap 8)"]
    assert runs["sync (cap 32)"]["staleness"] == {0: 3 * 8}  # sync: every token by the trainer's version
    for s in runs.values():
        assert s["seen"] == 3 * 8 and s["steady"]["trained"] > 0 and 0 <= s["all"]["idle"] <= 1
    router, rr = results["cache"][2]["router"], results["cache"][2]["round-robin"]
    later = sorted(router.prompt)[1:]
    assert later and router.rate(later) > rr.rate(later) > 0  # pinned rollouts find their own context
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["cache"]["2"] == {"router": router.summary(), "round-robin": rr.summary()}
    step = results["step"]  # 3 groups of the toy mix: the same update, each prompt once
    assert len(step["plain"]) == len(step["shared"]) == 1 and step["shared_tokens"] < step["tokens"]
    assert step["max_diff"] < 1e-5
