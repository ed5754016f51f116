"""
The API every environment of envs/ shares (GLM-5 report, arXiv 2602.15763, its agentic RL sections:
verifiable environments whose rewards the environment itself checks).

    task, tools = env.reset(seed)       # the task text and the tool list (seed None: a random task)
    observations, reward, done, reason = env.step(message)  # an assistant message (or its text)

A message with tool calls runs them (one observation string per call); one without ends the episode and is
graded (reward 1.0 or 0.0, reason says why). Every task generator is seeded and has a difficulty knob from
0 (the toy level) to 5. Each environment also has solve(), a generator of the messages that solve its task
(reading the real observations): the oracle policy of rollout.py and the SFT episodes of sft_data.py.

Held-out tasks: split_of(prompt) puts one task in five in "heldout" by a hash of its text, so a question
trained on by SFT never comes back as a held-out one (the toy math level has only 300 questions, so a
split by seed would not do that); seeds(env, split, n) lists the seeds of a split.

Also here, the helpers two or more families use: call (a tool call), show (a sandbox result as an
observation), boxed (the contents of \\boxed{}).

Run: nothing here runs alone; `python -m envs` shows one task per environment.
Tests: python -m pytest -q tests/test_envs.py
Honest limits: rewards are 1.0 or 0.0, never partial credit; the split holds tasks apart by their exact
text, so two wordings of one question are two tasks.
"""

import json
import random
import zlib

from envs.sandbox import Sandbox

# -----------------------------------------------------------------------------
# The API every environment shares


class Env:
    """Subclasses give make_task(rng, difficulty) -> {"prompt", ...}, grade(text) -> (reward, reason),
    run_tool(name, args) -> str, and solve(), a generator of the messages that solve the task (for SFT)."""

    name, tools, max_turns, keep_recent, limits = "env", [], 10, None, None
    context_threshold = None  # rollout.py's discard-all: past this many tokens of context (None: never)

    def __init__(self, difficulty=1, max_turns=None):
        assert 0 <= difficulty <= 5, "difficulty runs from 0 (the toy level) to 5"
        self.difficulty, self.max_turns = difficulty, max_turns or self.max_turns
        self.sb, self.done = None, True

    def reset(self, seed=None):
        """A fresh task from the seed -> (task, tools). The same seed and difficulty give the same task;
        seed None gives a random one."""
        self.close()
        if seed is None:  # a random task, not one fixed "None" task for every episode
            seed = random.randrange(1 << 62)
        # str seeds hash the same in every process
        self.rng = random.Random(f"{self.name}/{self.difficulty}/{seed}")
        self.turns, self.done, self.last_obs = 0, False, []
        if self.limits:
            # raises SandboxUnavailable (with the reason) where bwrap is missing
            self.sb = Sandbox(self.limits)
        self.task = self.make_task(self.rng, self.difficulty)
        return self.task["prompt"], self.tools

    def step(self, action):
        msg = {"role": "assistant", "content": action} if isinstance(action, str) else action
        if self.done:
            raise RuntimeError("this episode is over; call reset() first.")
        self.turns += 1
        calls = msg.get("tool_calls") or []
        # an answer is graded; a call past the last turn is not run
        if not calls or self.turns >= self.max_turns:
            self.done = True
            reward, reason = (
                (0.0, f"out of turns ({self.max_turns})") if calls else self.grade(msg.get("content") or "")
            )
            return [], reward, True, reason
        self.last_obs = [self.call(c) for c in calls]
        return self.last_obs, 0.0, False, "tool"

    def call(self, c):
        """One tool call -> its observation; mistakes the model can make become error observations."""
        f, tools = c.get("function", c), {t["name"]: t for t in self.tools}
        if f.get("name") not in tools:
            return f"error: unknown tool {f.get('name')!r}; the tools are {', '.join(tools) or 'none'}."
        args, want = f.get("arguments") or {}, tools[f["name"]]["arguments"]
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except (ValueError, RecursionError):  # "[[[[..." nests past Python's recursion limit
            args = None
        if (
            not isinstance(args, dict)
            or set(args) != set(want)
            or not all(isinstance(v, str) for v in args.values())
        ):
            return f"error: {f['name']} takes a JSON object with the string arguments {sorted(want)}."
        return self.run_tool(f["name"], args)

    def close(self):
        if self.sb:
            self.sb.close()
            self.sb = None


def split_of(prompt):
    """ "heldout" for one task in five, "train" for the rest: by a hash of the task's text, the same in every
    process, so the same question always lands in the same split."""
    return "heldout" if zlib.crc32(prompt.encode()) % 5 == 0 else "train"


def seeds(env, split, n, start=0):
    """The first n integer seeds from `start` whose tasks (at env's difficulty) fall in `split`."""
    out, seed = [], start
    while len(out) < n:
        prompt, _ = env.reset(seed)
        env.close()
        if split_of(prompt) == split:
            out.append(seed)
        seed += 1
    return out


# -----------------------------------------------------------------------------
# Helpers two or more families use


def show(result, cap=2000):
    """A sandbox Result as an observation: output (cut), then the exit status or the limit that hit."""
    sep = "\n" if result.stdout and result.stderr and not result.stdout.endswith("\n") else ""
    text = result.stdout + sep + result.stderr
    text = text[:cap] + f"\n[... {len(text) - cap} more characters cut]" if len(text) > cap else text
    end = f"[killed: {result.killed} limit]" if result.killed else f"[exit {result.returncode}]"
    return (text.rstrip() + "\n" + end).lstrip()


SYLLABLES = "ka lo mi ra ve tu zen dor bel sha ni qu fa ro li ta mon gri sel vok".split()


def made_up_word(rng):
    """Two or three syllables ("velomi"): a word no corpus holds, so a policy that writes it back copied it
    from its context (the search world's names, the toy terminal tasks' words and files)."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def boxed(text):
    """The contents of every \\boxed{...}, braces matched."""
    out, i = [], text.find("\\boxed{")
    while i >= 0:
        j, depth = i + 7, 1
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        out.append(text[i + 7 : j - 1])
        i = text.find("\\boxed{", j)
    return out
