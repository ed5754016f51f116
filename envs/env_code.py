"""
Code: write `solve(xs)` from a spec, with the tool run_python (GLM-5 report, arXiv 2602.15763, its agentic
RL sections: coding environments with rewards from executed tests), one of the environments of envs/.

Grading runs a runner that imports the solution and calls it on hidden inputs, which exist in the sandbox
only during that run (read-only in-memory files), never during tool calls. The expected outputs never
enter it: the host compares what the runner printed, so "PASSED" lines, fake result files or a forged
result line earn nothing unless the outputs are right. Levels 1 to 5: a pipeline of 1 to d list
operations, then a last step that returns; toy level (0): the last step alone (return their sum, say).

Run: python -m envs (one task per environment; python rollout.py plays them through the agent loop)
Tests: python -m pytest -q tests/test_envs.py tests/test_sandbox.py
Honest limits: one small family (list pipelines), not SWE-bench; it needs bubblewrap (envs/sandbox.py) and
refuses to run without it.
"""

import json
import re
import uuid
from math import prod

from envs.env_base import Env, call, show
from envs.sandbox import Limits

# -----------------------------------------------------------------------------
# Code: write solve(xs); hidden tests reach the sandbox only after the solution ran


def code_ops(rng, d):
    """A pipeline of list operations: [(english, python line, host function)], the last one returns."""
    ops = []
    for _ in range(rng.randint(min(d, 1), d)):  # none at the toy level: the last step alone
        kind = rng.choice(["mod", "gt", "lin", "abs", "sq", "rev"])
        k, t, a, b = rng.randint(2, 5), rng.randint(-5, 10), rng.randint(2, 5), rng.randint(-9, 9)
        r = rng.randrange(k)
        ops.append(
            {
                "mod": (
                    f"keep only the numbers whose remainder modulo {k} is {r}",
                    f"xs = [x for x in xs if x % {k} == {r}]",
                    lambda xs, k=k, r=r: [x for x in xs if x % k == r],
                ),
                "gt": (
                    f"keep only the numbers greater than {t}",
                    f"xs = [x for x in xs if x > {t}]",
                    lambda xs, t=t: [x for x in xs if x > t],
                ),
                "lin": (
                    f"replace each number x by {a}*x {'+' if b >= 0 else '-'} {abs(b)}",
                    f"xs = [{a} * x + {b} for x in xs]",
                    lambda xs, a=a, b=b: [a * x + b for x in xs],
                ),
                "abs": (
                    "replace each number by its absolute value",
                    "xs = [abs(x) for x in xs]",
                    lambda xs: [abs(x) for x in xs],
                ),
                "sq": (
                    "replace each number by its square",
                    "xs = [x * x for x in xs]",
                    lambda xs: [x * x for x in xs],
                ),
                "rev": ("reverse the order of the list", "xs = xs[::-1]", lambda xs: xs[::-1]),
            }[kind]
        )
    m = rng.randint(7, 97)
    ops.append(
        rng.choice(
            [
                ("return their sum", "return sum(xs)", sum),
                (
                    "return the largest of them, or 0 if none are left",
                    "return max(xs, default=0)",
                    lambda xs: max(xs, default=0),
                ),
                ("return how many are left", "return len(xs)", len),
                (
                    "return them sorted from largest to smallest",
                    "return sorted(xs, reverse=True)",
                    lambda xs: sorted(xs, reverse=True),
                ),
                (
                    "return the distinct values in order of first appearance",
                    "return list(dict.fromkeys(xs))",
                    lambda xs: list(dict.fromkeys(xs)),
                ),
                (
                    f"return their product modulo {m} (1 % {m} for no numbers)",
                    f"p = 1\n    for x in xs:\n        p = p * x % {m}\n    return p",
                    lambda xs, m=m: prod(xs) % m,
                ),
            ]
        )
    )
    return ops


RUNNER = """import json, sys
sys.path.insert(0, "/work")
inputs = json.load(open("/sandbox/inputs.json"))
try:
    from solution import solve
    err = None
except BaseException as e:
    err = type(e).__name__
out = []
for args in inputs:
    try:
        out.append(["error", err] if err else ["ok", solve(*args)])
    except BaseException as e:
        out.append(["error", type(e).__name__])
print()
print("{nonce}" + json.dumps(out))
"""


class CodeEnv(Env):
    name, max_turns, limits = "code", 6, Limits(cpu_s=5, wall_s=10)
    tools = [
        {
            "name": "run_python",
            "arguments": {"code": "Python source"},
            "description": "run Python code in a sandbox (cwd /work, no network) and see its output",
        }
    ]

    def make_task(self, rng, d):
        ops = code_ops(rng, d)

        def f(xs):  # the reference, on the host: its outputs never enter the sandbox
            for op in ops:
                xs = op[2](xs)
            return xs

        tests = [[[]]] + [
            [[rng.randint(-20, 20) for _ in range(rng.randint(1, 5 + 3 * d))]] for _ in range(9)
        ]
        example = [rng.randint(-9, 9) for _ in range(6)]
        steps = "; ".join(f"{i + 1}) {op[0]}" for i, op in enumerate(ops[:-1]))
        prompt = (
            f"Write a Python function `solve(xs)` that takes a list of integers xs and does this: "
            f"{steps}{'; finally, ' if steps else ''}{ops[-1][0]}. "
            f"Example: solve({example}) == {f(example)!r}. Reply with the function in a ```python block."
        )
        code = "def solve(xs):\n" + "".join(f"    {op[1]}\n" for op in ops)
        return {
            "prompt": prompt,
            "tests": tests,
            "expected": [f(*t) for t in tests],
            "solution": code,
            "example": example,
            "plan": [op[0] for op in ops],
        }

    def run_tool(self, name, args):
        return show(self.sb.run_python(args["code"]))

    def grade(self, text):
        blocks = re.findall(r"```(?:python|py)?\n(.*?)```", text, re.S)
        if not blocks:
            return 0.0, "no ```python block in the answer"
        try:
            self.sb.write("solution.py", blocks[-1])
        except OSError as e:  # the model made solution.py a directory, say
            return 0.0, f"could not write solution.py: {e.strerror}"
        nonce = uuid.uuid4().hex  # marks the runner's line; forging it gains nothing without right outputs
        r = self.sb.run(
            [self.sb.python, "-I", "/sandbox/run_tests.py"],
            files={
                "/sandbox/run_tests.py": RUNNER.replace("{nonce}", nonce),
                "/sandbox/inputs.json": json.dumps(self.task["tests"]),
            },
        )
        lines = [ln[len(nonce) :] for ln in r.stdout.splitlines() if ln.startswith(nonce)]
        want = [json.dumps(["ok", e]) for e in self.task["expected"]]
        try:  # the solution can forge this line: "[[[[..." must be a wrong answer, not a crashed grader
            got = json.loads(lines[-1]) if lines else None
            got = [json.dumps(g) for g in got] if isinstance(got, list) else None
        except (ValueError, RecursionError):
            got = None
        if got is None or len(got) != len(want):
            return (
                0.0,
                f"the tests did not finish ({r.killed + ' limit' if r.killed else f'exit {r.returncode}'})",
            )
        passed = sum(g == w for g, w in zip(got, want))
        return float(passed == len(want)), f"{passed}/{len(want)} hidden tests passed"

    def solve(self):
        t = self.task
        obs = yield {
            "role": "assistant",
            "content": "",
            "reasoning_content": f"The steps: {'; '.join(t['plan'])}. Each becomes one line over xs. "
            "Let me check the example.",
            "tool_calls": [call("run_python", code=t["solution"] + f"\nprint(solve({t['example']}))")],
        }
        yield {
            "role": "assistant",
            "content": f"```python\n{t['solution']}```",
            "reasoning_content": f"It printed {obs[0].splitlines()[0]}, as the example says. The empty list "
            f"goes through every step unchanged, so it is handled too.",
        }
