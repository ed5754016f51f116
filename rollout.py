"""
The agent loop and the TITO gateway (GLM-5 report, arXiv 2602.15763, its agentic RL sections: only the
tokens the model generated carry loss; the sampled ids, their logprobs and the policy version of each are
kept as the inference engine returned them, never re-tokenized; samples from crashed environments dropped;
the context management of search agents, keep-recent-k and discard-all).

rollout() renders the conversation with chat.py's template, asks the policy for ids, runs the tool calls in
the environment and records per token whether the model sampled it (mask True) or not:
    prompt ids (False) | model ids + logprobs (True) | observation ids (False) | model ids (True) | ...
Folding old tool results or discarding every tool round rewrites the prefix, so a rollout is a list of
segments, each model token trained once; the segments share the rollout's id and reward (one group member
in rl.py). Gateway samples from a serve.py replica and keeps the token record; a turn whose prompt does not
extend the record exactly raises TITOMismatch before anything is sent.

Run it:
    python rollout.py          # one episode per environment, played by the task's own solution (oracle)
    gw = rollout.Gateway("http://127.0.0.1:8000", rollout_id="r0")   # against `python serve.py --ckpt ...`
    episode = rollout.rollout(envs.MathEnv(0), gw, tok)
    records = rollout.trajectories(gw, episode, group=0)
Tests: python -m pytest -q tests/test_rollout.py
Honest limits: one request at a time per rollout, n = 1, no retry (a replica that fails raises, and the
rollout with it); a reply with no reasoning while thinking is on is sampled as <think></think> but the
template re-renders a bare </think>: the segment keeps what was sampled; the discard-all threshold is ours
(the report does not publish it): the env's context_threshold.
"""

import argparse
from dataclasses import dataclass

import requests

import chat
import envs
from tokenizer import get_tokenizer, vocab_size_argument

# -----------------------------------------------------------------------------
# The agent loop: template in, ids out, tool calls run, a loss mask per token

SYSTEM = "You are a careful agent. Think before every step."


def tool_specs(tools):
    """An environment's tools (envs/: name, description, string arguments) in OpenAI's request shape,
    which chat.render writes into the tool list's system block."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": {
                    "type": "object",
                    "properties": {
                        k: {"type": "string", "description": v} for k, v in t["arguments"].items()
                    },
                    "required": list(t["arguments"]),
                },
            },
        }
        for t in tools
    ]


def observation_ids(tok, observations, thinking=True):
    """The environment's tokens after a tool-calling turn, exactly as chat.render writes them: the model's own
    <|observation|> stop token opens them; each result in <tool_response>...</tool_response>, then the next
    generation prompt."""
    special = tok.encode_chat_token
    ids = []
    for obs in observations:
        ids += [special("<tool_response>")] + tok.encode_ordinary(obs) + [special("</tool_response>")]
    return ids + [special("<|assistant|>"), special("<think>" if thinking else "</think>")]


def tool_rounds(messages):
    """The tool-calling rounds of a conversation: [(i, [j, ...])] for each assistant message i that called
    tools, with the indices j of the observations that answered it."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append((i, []))
        elif m["role"] == "observation" and out:
            out[-1][1].append(i)
    return out


def fold(messages, keep):
    """Keep-recent-k (GLM-5 report, context management of search agents, k = 5): the tool results of all
    but the last `keep` rounds replaced by a one-line stub. The calls themselves stay (a few tokens each),
    so the agent still sees what it asked for; the long results go."""
    old = set()
    for _, answers in tool_rounds(messages)[: -keep if keep else None]:
        old.update(answers)
    return [
        {"role": "observation", "content": f"[folded: {len(m['content'])} characters]"}
        if i in old and not m["content"].startswith("[folded")
        else m
        for i, m in enumerate(messages)
    ]


def discard_all(messages):
    """Discard-all (GLM-5 report, context management of search agents; the DeepSeek-V3.2 report names the
    same strategy): once the context passes a threshold, every tool round so far (the calls and their
    results) is removed, and the agent goes on from its system prompt and task alone."""
    gone = set()
    for i, answers in tool_rounds(messages):
        gone.add(i)
        gone.update(answers)
    return [m for i, m in enumerate(messages) if i not in gone]


def rollout(
    env, policy, tok, seed=None, thinking=True, keep_recent=None, context_threshold=None, max_tokens=16384
):
    """Run one episode. policy(prompt ids) -> generated ids, or (ids, logprobs). keep_recent: fold the tool
    results of all but the last k rounds (default: the env's own, 5 for search; 0 = never). context_threshold:
    past this many tokens of context, discard every tool round (default: the env's own; 0 = never). Returns
    a dict with messages, tools (the tool list the prompt holds, for chat.render), segments [{"ids", "mask",
    "logprobs"}], reward, reason, turns and crashed (drop the sample). A Gateway policy keeps the token record
    itself and is told when folding or discarding opens a new segment."""
    keep = env.keep_recent if keep_recent is None else keep_recent
    threshold = env.context_threshold if context_threshold is None else context_threshold
    stop_ids = {tok.encode_chat_token(s) for s in chat.STOP_TOKENS}
    obs_id = tok.encode_chat_token("<|observation|>")
    out = {
        "messages": [],
        "tools": [],
        "segments": [],
        "reward": 0.0,
        "reason": "",
        "turns": 0,
        "crashed": False,
    }
    try:
        task, tools = env.reset(seed)
    except Exception as e:  # no sandbox here, say: a crashed environment, not a bad sample
        return out | {"reason": f"env crashed: {type(e).__name__}: {e}", "crashed": True}
    specs = tool_specs(tools)
    out["tools"] = specs
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task} | ({} if thinking else {"thinking": False}),
    ]
    ids = chat.render(messages, tok, tools=specs, add_generation_prompt=True)[0]
    mask, logps = [False] * len(ids), [0.0] * len(ids)
    try:  # the policy may raise: the sandbox is closed anyway
        while True:
            got = policy(list(ids))
            new, lp = (list(got[0]), list(got[1])) if isinstance(got, tuple) else (list(got), None)
            assert lp is None or len(lp) == len(new), (
                "the policy returned a different number of logprobs than ids"
            )
            end = next((i + 1 for i, t in enumerate(new) if t in stop_ids), None)
            new, lp = new[:end], (lp or [0.0] * len(new))[:end]
            ids, mask, logps = ids + new, mask + [True] * len(new), logps + lp
            msg = chat.parse_reply(new, tok, thinking=thinking, tools=specs)
            out["turns"] += 1
            if end is None:
                out["reason"] = "truncated: no stop token"
                break
            if new[-1] != obs_id:
                msg.pop("tool_calls", None)  # it ended its turn: any tool call in it is not run
            elif not msg.get("tool_calls"):
                out["reason"] = "format: <|observation|> without a tool call"
                break
            # a reply the template cannot render back (empty, non-JSON arguments, thinking when off) ends it
            try:
                chat.render_text([{"role": "user", "content": ".", "thinking": thinking}, msg])
            except (ValueError, RecursionError) as e:
                out["reason"] = f"format: {e}"
                break
            try:
                obs, reward, done, reason = env.step(msg)
            except Exception as e:
                out |= {"reason": f"env crashed: {type(e).__name__}: {e}", "crashed": True}
                break
            messages.append(msg)
            out["reward"], out["reason"] = reward, reason
            if done:
                break
            messages += [{"role": "observation", "content": o} for o in obs]
            if len(ids) > max_tokens:
                out["reason"] = "context full"
                break
            folded = messages
            if keep:
                folded = fold(messages, keep)
            env_ids = observation_ids(tok, obs, thinking)
            if threshold:
                length = len(ids) + len(env_ids)
                if folded != messages:
                    length = len(chat.render(folded, tok, tools=specs, add_generation_prompt=True)[0])
                if length > threshold:
                    folded = discard_all(folded)
            if folded != messages:  # the prefix changed: close this segment, start anew
                out["segments"].append({"ids": ids, "mask": mask, "logprobs": logps})
                if isinstance(policy, Gateway):
                    policy.new_segment()  # the re-rendered prompt will not extend the record
                messages = folded
                ids = chat.render(messages, tok, tools=specs, add_generation_prompt=True)[0]
                mask, logps = [False] * len(ids), [0.0] * len(ids)
            else:
                ids, mask, logps = ids + env_ids, mask + [False] * len(env_ids), logps + [0.0] * len(env_ids)
    finally:
        env.close()
    out["segments"].append({"ids": ids, "mask": mask, "logprobs": logps})
    out["messages"] = messages
    return out


def assistant_ids(tok, msg, thinking=True):
    """The ids a model writes for msg after the generation prompt (<|assistant|><think> with thinking on,
    <|assistant|></think> with it off), as the template renders them."""
    reasoning = (msg.get("reasoning_content") or "").strip()
    if thinking and reasoning:  # reasoning, </think>, content, tool calls, the stop token
        ids, mask = chat.render([{"role": "user", "content": "."}, msg], tok)
        return [i for i, m in zip(ids, mask) if m]
    # no reasoning: the content follows </think> at once (the model writes that </think> when the prompt
    # opened <think>)
    msg = {k: v for k, v in msg.items() if k != "reasoning_content"}
    ids, mask = chat.render([{"role": "user", "content": ".", "thinking": False}, msg], tok)
    reply = [i for i, m in zip(ids, mask) if m]
    if thinking:
        return [tok.encode_chat_token("</think>")] + reply
    return reply


def scripted_policy(tok, replies, thinking=True):
    """A policy that answers with these messages (or texts) in order, whatever it is shown."""
    it = ({"role": "assistant", "content": r} if isinstance(r, str) else r for r in replies)
    return lambda ids: assistant_ids(tok, next(it), thinking)


def oracle_policy(env, tok, thinking=True):
    """A policy that solves env's current task (its generator's own solution), reading real observations."""
    solution = None  # the solution generator, started at the first call (after rollout's reset)

    def policy(ids):
        nonlocal solution
        if solution is None:
            solution = env.solve()
            return assistant_ids(tok, next(solution), thinking)
        return assistant_ids(tok, solution.send(env.last_obs), thinking)  # it reads what its calls returned

    return policy


# -----------------------------------------------------------------------------
# The TITO gateway: every generation request of a rollout, its exact ids, logprobs and versions


class TITOMismatch(ValueError):
    """A turn's prompt does not extend the previous turn's prompt + completion token for token (or the
    replica saw other ids than were sent): training on it would attach logprobs to tokens the model never
    sampled in that context."""


class Gateway:
    """A policy (prompt ids -> (completion ids, logprobs)) that samples from a serve.py replica and keeps
    the rollout's token record. One Gateway per rollout.

    Each call is one POST /v1/completions with the prompt as token ids, "return_token_ids" and "logprobs"
    on, so the reply carries the completion's ids, each sampled token's logprob and the policy version that
    sampled it ("token_versions"). The replica stops at the chat stop tokens (<|observation|>, <|user|>,
    <|endoftext|>) by itself: it is never sent ignore_eos. The rollout id travels in the X-Rollout-Id header
    (the completions route refuses unknown body fields) for a router to keep a rollout on one replica.

    The record (self.segments) holds, per token, ids, mask (1: the model sampled it, 0: prompt, observation
    or template glue), logprobs and versions (0.0 and -1 where mask is 0). A turn's prompt must start with
    the segment so far (the previous prompt + completion): its new tail is the environment's tokens. A
    prompt that does not raises TITOMismatch before anything is sent: we raise rather than mask the turn,
    because a rollout whose context silently changed is a bug in the agent loop, not a sample to keep.
    rollout() says when folding legitimately rewrites the context (new_segment): the next prompt then opens
    a new segment. self.requests keeps every request as sent and answered.

    self.prompt_tokens and self.cached_tokens sum each response's usage over the rollout: the prompt tokens
    the replica was sent, and how many of them its prefix cache already held (usage.prompt_tokens_details.
    cached_tokens, OpenAI's field), so cached_tokens / prompt_tokens is the rollout's prefix-cache hit rate
    (bench/bench_rl.py compares it under the DP-aware router and round-robin)."""

    def __init__(self, url, rollout_id, temperature=1.0, max_tokens=256, timeout=120.0):
        self.url = url.rstrip("/") + "/v1/completions"
        self.rollout_id = str(rollout_id)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.requests = []  # per request: prompt, completion, logprobs, versions, finish_reason
        self.segments = []  # the record: {"ids", "mask", "logprobs", "versions"}, aligned per token
        self.fresh = True  # the next prompt opens a segment (the first, or the one after a fold)
        self.prompt_tokens = 0  # summed over the responses' usage: prompt tokens sent
        self.cached_tokens = 0  # of which the replica's prefix cache held (not prefilled again)

    def new_segment(self):
        """Folding re-rendered the context: the next prompt is checked against nothing and starts anew."""
        self.fresh = True

    def request_seed(self):
        """The sampling seed of the next request: None here (the replica draws one); a subclass that wants
        replayable rollouts derives one from the rollout id and the turn."""
        return None

    def generate(self, prompt):
        """One request to the replica -> (completion ids, logprobs, versions, finish_reason)."""
        body = {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "logprobs": 0,  # the sampled token's own logprob, no alternatives
            "return_token_ids": True,
        }
        seed = self.request_seed()
        if seed is not None:
            body["seed"] = seed
        headers = {"X-Rollout-Id": self.rollout_id}
        resp = requests.post(self.url, json=body, headers=headers, timeout=self.timeout)
        if resp.status_code != 200:
            raise RuntimeError(f"the replica at {self.url} answered {resp.status_code}: {resp.text[:300]}")
        out = resp.json()
        usage = out.get("usage") or {}  # a server that reports no usage counts as no cache hit
        self.prompt_tokens += usage.get("prompt_tokens", len(prompt))
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if out["prompt_token_ids"] != prompt:
            raise TITOMismatch(f"the replica at {self.url} saw other prompt ids than were sent")
        choice = out["choices"][0]
        lps = choice["logprobs"]["token_logprobs"]
        return choice["token_ids"], lps, choice["token_versions"], choice["finish_reason"]

    def __call__(self, prompt):
        prompt = list(prompt)
        if self.fresh:
            self.segments.append({"ids": [], "mask": [], "logprobs": [], "versions": []})
            self.fresh = False
        seg = self.segments[-1]
        n = len(seg["ids"])
        if prompt[:n] != seg["ids"]:
            at = next((i for i, (a, b) in enumerate(zip(prompt, seg["ids"])) if a != b), min(len(prompt), n))
            raise TITOMismatch(
                f"turn {len(self.requests) + 1} of rollout {self.rollout_id}: its prompt differs from the "
                f"previous prompt + completion at token {at} of {n}; build each prompt by appending to "
                "the last one (never re-tokenize text), or call new_segment() where the context is rewritten"
            )
        ids, lps, versions, finish = self.generate(prompt)
        if not len(ids) == len(lps) == len(versions):
            raise TITOMismatch(
                f"the replica returned {len(ids)} ids, {len(lps)} logprobs and {len(versions)} versions"
            )
        self.requests.append(
            {"prompt": prompt, "completion": ids, "logprobs": lps, "versions": versions, "finish": finish}
        )
        env = prompt[n:]  # the environment's tokens since the last completion (all of the first prompt)
        seg["ids"] += env + ids
        seg["mask"] += [0] * len(env) + [1] * len(ids)
        seg["logprobs"] += [0.0] * len(env) + lps
        seg["versions"] += [-1] * len(env) + versions
        return ids, lps


@dataclass
class Trajectory:
    """One rollout as the TITO gateway records it: exact token ids, never re-tokenized text."""

    group: object  # the prompt it answers: GRPO compares the samples of one group
    ids: list  # prompt, completion and environment token ids, as the engine saw and sampled them
    mask: list  # 1 where the model sampled the token (it carries loss), 0 for prompt and environment
    logprobs: list  # the engine's logprob of each sampled token (0.0 where mask is 0)
    versions: list  # the policy version that sampled each token (-1 where mask is 0)
    reward: float = 0.0
    failed: bool = False  # the environment crashed or hung: the reward means nothing
    rollout_id: str = ""  # the router's key: every turn of one rollout goes to one replica


def trajectories(gateway, episode, group):
    """The gateway's record of one rollout() episode as Trajectory records for the trainer, one
    per segment (a folded episode has several; they share its rollout_id and reward, and the trainer counts
    them as one rollout). The episode's own ids must equal the
    record's: the agent loop and the gateway agree on every token, or TITOMismatch."""
    if [s["ids"] for s in episode["segments"]] != [s["ids"] for s in gateway.segments]:
        raise TITOMismatch(f"rollout {gateway.rollout_id}: the episode's token ids differ from the record")
    return [
        Trajectory(
            group=group,
            ids=list(s["ids"]),
            mask=list(s["mask"]),
            logprobs=list(s["logprobs"]),
            versions=list(s["versions"]),
            reward=episode["reward"],
            failed=episode["crashed"],
            rollout_id=gateway.rollout_id,
        )
        for s in gateway.segments
    ]


# -----------------------------------------------------------------------------
# python rollout.py

if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description="The agent loop: one episode per environment at difficulty 2, played by the task's own "
        "solution (the oracle policy); prints each last segment with the model's tokens in ⟦ ⟧.",
        epilog="example: python rollout.py",
    )
    vocab_size = vocab_size_argument(ap).parse_args().vocab_size
    tok = get_tokenizer(vocab_size, cache_dir="data")
    for name, cls in envs.ENVS.items():
        env = cls(difficulty=2)
        r = rollout(env, oracle_policy(env, tok), tok, seed=0)
        seg = r["segments"][-1]
        print(
            f"==== {name}: reward {r['reward']} ({r['reason']}), {r['turns']} turns, "
            f"{len(r['segments'])} segment(s), last one {len(seg['ids'])} tokens, "
            f"{sum(seg['mask'])} from the model (in ⟦ ⟧)"
        )
        print(chat.show(seg["ids"], seg["mask"], tok), end="\n\n")
