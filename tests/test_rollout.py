"""rollout.py: the agent loop's tokens and loss mask against chat.render, the policy's own ids and logprobs
kept (TITO), keep-recent-k folding into segments, every way an episode ends, a crashed environment marked;
the TITO gateway against a real serve.py replica over a loopback socket (a tiny random model: the record's
invariants hold whatever it samples), its mismatch check, folding into segments, and its Trajectory records.
Run: python -m pytest -q tests/test_rollout.py"""

import random
import threading

import pytest
import torch
from conftest import randomize, tiny_chat_tokenizer, tiny_config

import chat
import data
import engine
import envs
import model
import rl
import rollout
import serve
import weights
from envs import CodeEnv, MathEnv, SearchEnv, TerminalEnv, sandbox

ROOT = data.stdlib_root()


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


def tool(name, **args):
    return {"role": "assistant", "content": "", "tool_calls": [envs.call(name, **args)]}


# -----------------------------------------------------------------------------
# The agent loop: ids and mask against chat.render, TITO, folding, endings


def test_rollout_tokens_and_mask_are_the_templates(tok):
    for thinking in (True, False):
        env = CodeEnv(1)
        r = rollout.rollout(env, rollout.oracle_policy(env, tok, thinking), tok, seed=3, thinking=thinking)
        assert r["reward"] == 1.0 and len(r["segments"]) == 1, r["reason"]
        ids, mask = chat.render(r["messages"], tok, tools=r["tools"])
        seg = r["segments"][0]
        assert seg["ids"] == ids and seg["mask"] == mask
        obs = [m["content"] for m in r["messages"] if m["role"] == "observation"]
        untrained = tok.decode([i for i, m in zip(ids, mask) if not m])
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        assert obs and all(o in untrained and o not in trained for o in obs)
        # thinking on: the model writes its reasoning and </think> (the <think> is the prompt's); off: the
        # prompt ends with </think>
        assert ("</think>" in trained) == thinking and "<think>" not in trained


def test_rollout_keeps_the_policys_own_ids_and_logprobs(tok):
    """TITO: ids the template would never produce (one token per character) come back exactly as sampled."""
    env = MathEnv(1)
    prompt, _ = env.reset(0)
    answer = envs.fmt(env.task["answer"])
    # the prompt ends with <think>: the reply closes its (empty) think block, then answers
    odd = [tok.encode_chat_token("</think>")]
    odd += [t for ch in f"\\boxed{{{answer}}}" for t in tok.encode_ordinary(ch)]
    odd += [tok.encode_chat_token("<|endoftext|>")]
    lp = [-0.1 * (i + 1) for i in range(len(odd))]
    seen = []
    r = rollout.rollout(
        env, lambda ids: (seen.append(ids), (odd + [5, 6, 7], lp + [0.0] * 3))[1], tok, seed=0
    )
    seg = r["segments"][0]
    assert r["reward"] == 1.0 and seg["ids"] == seen[0] + odd  # cut after the stop token
    assert seg["logprobs"][len(seen[0]) :] == lp and seg["mask"] == [False] * len(seen[0]) + [True] * len(odd)


def test_rollout_folds_old_observations_into_segments(tok):
    env = SearchEnv(3)
    r = rollout.rollout(env, rollout.oracle_policy(env, tok), tok, seed=2, keep_recent=2)
    assert r["reward"] == 1.0 and len(r["segments"]) > 1
    generated = sum(sum(s["mask"]) for s in r["segments"])
    env.reset(2)
    gen, total, obs = env.solve(), 0, None
    while True:
        msg = gen.send(obs) if obs is not None else next(gen)
        total += len(rollout.assistant_ids(tok, msg))
        obs, _, done, _ = env.step(msg)
        if done:
            break
    assert generated == total  # every model token is trained exactly once, in the segment that sampled it
    last = r["segments"][-1]
    assert (
        tok.decode(last["ids"]).count("[folded:")
        == sum(m["role"] == "observation" for m in r["messages"]) - 2
    )
    prompt = chat.render(r["messages"][:2], tok, tools=r["tools"], add_generation_prompt=True)[0]
    assert r["segments"][0]["ids"][: len(prompt)] == prompt
    for s in r["segments"][1:]:  # each later segment opens with a re-rendered, folded context, untrained
        first = s["mask"].index(True)
        assert "[folded:" in tok.decode(s["ids"][:first])
    env = SearchEnv(3)
    assert (
        len(rollout.rollout(env, rollout.oracle_policy(env, tok), tok, seed=2, keep_recent=0)["segments"])
        == 1
    )


def test_keep_recent_counts_tool_rounds_and_discard_all_restarts_the_context(tok):
    """Keep-recent-k keeps the results of the last k tool rounds (a round: one assistant turn's calls and
    all their results), not the last k result messages; discard-all past a threshold removes every round."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for r in range(3):  # three rounds of two results each
        msgs.append(call)
        msgs += [{"role": "observation", "content": f"{x}{r}"} for x in "ab"]
    kept = rollout.fold(msgs, 2)
    contents = [m["content"] for m in kept if m["role"] == "observation"]
    assert contents == ["[folded: 2 characters]"] * 2 + ["a1", "b1", "a2", "b2"]
    assert rollout.discard_all(msgs) == msgs[:2]
    # in the agent loop: past the threshold every round goes, the agent goes on from its task, the oracle
    # still solves it, and each later segment opens with the bare task (no tool result in its context)
    env = SearchEnv(3)
    policy = rollout.oracle_policy(env, tok)
    r = rollout.rollout(env, policy, tok, seed=2, keep_recent=0, context_threshold=300)
    assert r["reward"] == 1.0 and len(r["segments"]) > 1
    task = chat.render(r["messages"][:2], tok, tools=r["tools"], add_generation_prompt=True)[0]
    for s in r["segments"][1:]:
        first = s["mask"].index(True)
        assert s["ids"][:first] == task
    assert not any(m["role"] == "observation" for m in r["messages"][:-2])  # at most the last round left


def test_rollout_endings(tok):
    eot, obs_id = tok.encode_chat_token("<|endoftext|>"), tok.encode_chat_token("<|observation|>")
    r = rollout.rollout(MathEnv(), lambda ids: tok.encode_ordinary("no stop token"), tok, seed=0)
    assert r["reason"].startswith("truncated") and r["reward"] == 0.0
    r = rollout.rollout(MathEnv(), lambda ids: tok.encode_ordinary("hm") + [obs_id], tok, seed=0)
    assert r["reason"].startswith("format")
    env = TerminalEnv(1)  # tool calls in a turn that ends with <|endoftext|> are not run
    msg = tool("shell", command="touch ran")
    r = rollout.rollout(env, lambda ids: rollout.assistant_ids(tok, msg)[:-1] + [eot], tok, seed=0)
    # an empty reply, no call
    assert r["turns"] == 1 and r["reward"] == 0.0 and r["reason"].startswith("format")
    special = tok.encode_chat_token
    # a value without its <arg_key>: the call is malformed
    bad = (
        [special("</think>"), special("<tool_call>")]
        + tok.encode_ordinary("search")
        + [special("<arg_value>")]
        + tok.encode_ordinary("fox")
        + [special("</arg_value>"), special("</tool_call>"), obs_id]
    )
    r = rollout.rollout(SearchEnv(1), lambda _: bad, tok, seed=0)
    assert r["reason"].startswith("format") and r["reward"] == 0.0 and not r["crashed"]
    r = rollout.rollout(MathEnv(1), lambda _: [eot], tok, seed=0)  # an empty reply
    assert r["reason"].startswith("format") and r["reward"] == 0.0
    two = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two echoes.",
        "tool_calls": [envs.call("shell", command="echo a"), envs.call("shell", command="echo b")],
    }
    done = {"role": "assistant", "content": "Done.", "reasoning_content": "Both ran."}
    env = TerminalEnv(1)
    r = rollout.rollout(env, rollout.scripted_policy(tok, [two, done]), tok, seed=0)
    assert [m["content"] for m in r["messages"] if m["role"] == "observation"] == [
        "a\n[exit 0]",
        "b\n[exit 0]",
    ]
    assert r["segments"][0]["ids"] == chat.render(r["messages"], tok, tools=r["tools"])[0]
    # TITO: a reply without reasoning is sampled as <think></think> after the prompt's <think>; the template
    # writes it back as a bare </think>, and the segment keeps what was sampled
    env = TerminalEnv(1)
    r = rollout.rollout(env, rollout.scripted_policy(tok, [two, "Done."]), tok, seed=0)
    sampled = r["segments"][0]["ids"]
    assert tok.decode(sampled).endswith("<|assistant|><think></think>Done.<|endoftext|>")
    assert chat.render_text(r["messages"], tools=r["tools"]).endswith(
        "<|assistant|></think>Done.<|endoftext|>"
    )


def test_rollout_marks_a_crashed_environment(tok, monkeypatch):
    monkeypatch.setattr(sandbox, "_PROBE", (False, "bwrap not found (test)"))
    r = rollout.rollout(CodeEnv(1), rollout.scripted_policy(tok, ["x"]), tok, seed=0)
    assert r["crashed"] and "bwrap not found" in r["reason"]
    assert (
        rollout.rollout(MathEnv(1), rollout.scripted_policy(tok, ["\\boxed{0}"]), tok, seed=0)["crashed"]
        is False
    )


# -----------------------------------------------------------------------------
# The TITO gateway: a real replica over a loopback socket, and its bookkeeping alone


@pytest.fixture(scope="module")
def replica(tok, tmp_path_factory):
    """A serve.py server on a free loopback port over a tiny random GLM-5 that shares tok's vocabulary, and
    a save_pretrained directory of other random weights to push to it as a new policy version."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead
    cfg = tiny_config(vocab_size=tok.vocab_size, max_position_embeddings=1024)
    eng = engine.Engine(randomize(model.GLM5(cfg), seed=1), tok, num_pages=128, page_size=16)
    new = tmp_path_factory.mktemp("policy_v1")
    weights.save_pretrained(randomize(model.GLM5(cfg), seed=2), new, dtype=torch.float32)
    srv, stop = serve.make_server(eng, port=0, model_name="tiny")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", eng, str(new)
    stop.set()
    srv.shutdown()
    torch.set_num_threads(threads)


def check_record(gw):
    """The invariants of every segment: aligned lists, sampled tokens masked 1 with a logprob and a
    version, environment tokens masked 0 with neither, and the segment the concatenation of its turns."""
    for seg in gw.segments:
        n = len(seg["ids"])
        assert len(seg["mask"]) == len(seg["logprobs"]) == len(seg["versions"]) == n
        for m, lp, v in zip(seg["mask"], seg["logprobs"], seg["versions"]):
            assert (m == 1 and lp <= 0.0 and v >= 0) or (m == 0 and lp == 0.0 and v == -1)
    ids, mask = [], []
    for req in gw.requests:  # one segment: each prompt extends the last prompt + completion
        assert req["prompt"][: len(ids)] == ids and len(req["logprobs"]) == len(req["completion"])
        mask += [0] * (len(req["prompt"]) - len(ids)) + [1] * len(req["completion"])
        ids = req["prompt"] + req["completion"]
    return ids, mask


def test_gateway_records_a_multi_turn_episode(tok, replica):
    """Three turns of a scripted tool environment (its observations whatever the model said), a new policy
    version pushed between the first and second turn: per-token versions, masks and logprobs as sampled."""
    url, eng, new_weights = replica
    gw = rollout.Gateway(url, rollout_id="multi-0", max_tokens=6)
    messages = [{"role": "system", "content": rollout.SYSTEM}, {"role": "user", "content": "List the files."}]
    prompt = chat.render(messages, tok, add_generation_prompt=True)[0]
    v0 = eng.version
    observations = []
    for turn in range(3):
        ids, lps = gw(prompt)
        assert len(lps) == len(ids) > 0  # the logprob count equals the sampled token count
        observations.append(rollout.observation_ids(tok, [f"file_{turn}.txt"]))
        prompt = prompt + ids + observations[-1]
        if turn == 0:
            eng.update_weights(new_weights, v0 + 1)
    assert len(gw.segments) == 1 and len(gw.requests) == 3
    seg = gw.segments[0]
    ids, mask = check_record(gw)
    assert seg["ids"] == ids and seg["mask"] == mask  # the record is the concatenation of its turns
    assert (
        sum(seg["mask"])
        == sum(len(r["completion"]) for r in gw.requests)
        == sum(len(r["logprobs"]) for r in gw.requests)
    )
    sampled = [(v, lp) for m, v, lp in zip(seg["mask"], seg["versions"], seg["logprobs"]) if m]
    assert [lp for _, lp in sampled] == [lp for r in gw.requests for lp in r["logprobs"]]
    # versions: the first turn's tokens by the old policy, the later turns' by the pushed one
    assert [v for v, _ in sampled] == [v0] * len(gw.requests[0]["completion"]) + [v0 + 1] * (
        len(sampled) - len(gw.requests[0]["completion"])
    )
    # environment tokens: each observation sits in the record exactly where it was appended, masked 0
    for turn in (1, 2):
        req = gw.requests[turn]
        start = len(gw.requests[turn - 1]["prompt"]) + len(gw.requests[turn - 1]["completion"])
        assert req["prompt"][start:] == observations[turn - 1]
        assert seg["mask"][start : len(req["prompt"])] == [0] * len(observations[turn - 1])

    # a turn whose prompt does not extend the record is refused before anything is sent, the record left as
    # it was: the conversation's text re-tokenized (its special tokens come back as plain text), the last
    # sampled token changed, or dropped
    retokenized = tok.encode(tok.decode(prompt))
    changed = list(prompt)
    last = len(seg["ids"]) - 1  # the last sampled token
    changed[last] = (changed[last] + 1) % tok.vocab_size
    before = [{k: list(v) for k, v in s.items()} for s in gw.segments]
    for bad in (retokenized, changed, seg["ids"][:-1]):
        with pytest.raises(rollout.TITOMismatch, match="differs from the previous prompt"):
            gw(bad)
    assert len(gw.requests) == 3 and gw.segments == before


def test_rollout_through_the_gateway_gives_trajectories(tok, replica):
    """rollout() with the gateway as its policy: the episode's segments are the gateway's record, and
    trajectories() hands the trainer exactly that, with the reward and the rollout id."""
    url, eng, _ = replica
    gw = rollout.Gateway(url, rollout_id="math-0", max_tokens=8)
    episode = rollout.rollout(MathEnv(0), gw, tok, seed=0)
    assert episode["turns"] == len(gw.requests) >= 1 and not episode["crashed"]
    check_record(gw)
    [seg] = episode["segments"]
    assert seg["ids"] == gw.segments[0]["ids"] and seg["logprobs"] == gw.segments[0]["logprobs"]
    assert [int(m) for m in seg["mask"]] == gw.segments[0]["mask"]
    [traj] = rollout.trajectories(gw, episode, group=("math", 0))
    assert isinstance(traj, rl.Trajectory)
    assert (traj.ids, traj.mask, traj.logprobs, traj.versions) == tuple(
        gw.segments[0][k] for k in ("ids", "mask", "logprobs", "versions")
    )
    assert traj.rollout_id == "math-0" and traj.reward == episode["reward"] and traj.group == ("math", 0)
    assert rl.staleness(traj, eng.version) == 0
    episode["segments"][0]["ids"] = episode["segments"][0]["ids"][:-1]
    with pytest.raises(rollout.TITOMismatch):
        rollout.trajectories(gw, episode, group=("math", 0))


def test_gateway_counts_prompt_and_cached_tokens(tok, replica):
    """The usage of every response summed per rollout: prompt tokens as sent, and cached tokens exactly the
    full pages the previous turn wrote (its prompt and completion but the last sampled token, which the
    engine never fed), as the engine itself counts them."""
    url, eng, _ = replica
    P = eng.cache.page_size
    before = dict(eng.stats)
    gw = rollout.Gateway(url, rollout_id="count-0", max_tokens=6)
    words = " ".join(random.Random().choice(["fox", "owl", "elm", "oak", "bee"]) for _ in range(12))
    messages = [{"role": "system", "content": rollout.SYSTEM}, {"role": "user", "content": f"Say {words}."}]
    prompt = chat.render(messages, tok, add_generation_prompt=True)[0]
    sent, cached, written = [], [], []
    for turn in range(3):
        p0, c0 = gw.prompt_tokens, gw.cached_tokens
        ids, _ = gw(prompt)
        sent.append(gw.prompt_tokens - p0)
        cached.append(gw.cached_tokens - c0)
        written.append(len(prompt) + len(ids) - 1)
        prompt = prompt + ids + rollout.observation_ids(tok, [f"{words} {turn}"])
    assert sent == [len(r["prompt"]) for r in gw.requests] and gw.prompt_tokens == sum(sent)
    assert all(c % P == 0 for c in cached)
    assert cached[1:] == [w // P * P for w in written[:-1]] and cached[2] > cached[1] > 0
    assert gw.cached_tokens == eng.stats["cached_tokens"] - before.get("cached_tokens", 0)
    prefilled = eng.stats["prefill_tokens"] - before.get("prefill_tokens", 0)
    assert prefilled == gw.prompt_tokens - gw.cached_tokens


class OracleGateway(rollout.Gateway):
    """The gateway's bookkeeping with the task's own solution in place of the replica (no server)."""

    def __init__(self, env, tok):
        super().__init__("http://unused", rollout_id="oracle")
        self.oracle = rollout.oracle_policy(env, tok)

    def generate(self, prompt):
        ids = self.oracle(prompt)
        return ids, [-0.5] * len(ids), [7] * len(ids), "stop"


def test_gateway_folding_opens_segments(tok):
    """Keep-recent-k folding rewrites the context: rollout() tells the gateway, which opens a new segment
    instead of raising, and every model token is in exactly one segment, as in the episode."""
    env = SearchEnv(3)
    gw = OracleGateway(env, tok)
    episode = rollout.rollout(env, gw, tok, seed=2, keep_recent=2)
    assert episode["reward"] == 1.0 and len(gw.segments) == len(episode["segments"]) > 1
    trajs = rollout.trajectories(gw, episode, group="search")
    assert len(trajs) == len(gw.segments)
    for t, s in zip(trajs, episode["segments"]):
        assert t.ids == s["ids"] and t.mask == [int(m) for m in s["mask"]]
        assert all((v == 7) == bool(m) for v, m in zip(t.versions, t.mask))
    assert sum(sum(t.mask) for t in trajs) == sum(len(r["completion"]) for r in gw.requests)
    # without the rollout loop's word, the same re-rendered prompt is a mismatch
    env = SearchEnv(3)
    gw = OracleGateway(env, tok)
    gw.new_segment = lambda: None
    with pytest.raises(rollout.TITOMismatch):
        rollout.rollout(env, gw, tok, seed=2, keep_recent=2)
