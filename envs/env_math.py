"""
Math: procedural problems with exact answers (GLM-5 report, arXiv 2602.15763, its reasoning RL: math whose
answers are verified), one of the environments of envs/ (the API is env_base.py's).

Levels 1 to 5: arithmetic over fractions, linear equations, series, gcd/lcm, modular powers, a word
problem, each with the worked steps its solution reasons through. Toy level (0): one operation on two
single digits (3 * 7), 300 questions in all. Answers are parsed (\\boxed{1/2}, \\frac{1}{2}, 0.5, 2/4 are
equal) and compared as exact Fractions, never evaluated.

Run: python -m envs (one task per environment; python rollout.py plays them through the agent loop)
Tests: python -m pytest -q tests/test_envs.py
Honest limits: six small generators, not competition math; the grader reads one number (the boxed one,
else the last one written), so an expression, a set of answers or a unit is no answer.
"""

import re
from fractions import Fraction
from math import gcd, lcm

from envs.env_base import Env, boxed

# -----------------------------------------------------------------------------
# Math: procedural problems with exact answers, and answers compared without eval


def fmt(q):
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
CANDIDATE = re.compile(
    r"[+-]?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|[+-]?\\[dt]?frac\d\d|[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|"
    + NUM
    + r"(?:/\d+)?"
)


def parse_number(s):
    """One written number -> Fraction, or None. Accepts 3, -0.5, .5, 1,000, 3/4, \\frac{3}{4}, \\dfrac34,
    $...$. Never evaluates anything: only digits, one sign, a point and a fraction bar are read."""
    s = (
        s.strip()
        .strip("$")
        .replace("\\!", "")
        .replace("{,}", ",")
        .replace("\\,", "")
        .replace(" ", "")
        .rstrip(".")
    )
    if not s or len(s) > 60:
        return None
    s = s.replace(",", "") if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    if m := re.fullmatch(r"([+-]?)\\[dt]?frac(?:\{([^{}]+)\}\{([^{}]+)\}|(\d)(\d))", s):
        num, den = parse_number(m[2] or m[4]), parse_number(m[3] or m[5])
        return None if num is None or not den else (-1 if m[1] == "-" else 1) * num / den
    a, bar, b = s.partition("/")
    if bar:
        num, den = parse_number(a), parse_number(b)
        return None if num is None or not den or "/" in b else num / den
    return Fraction(s) if re.fullmatch(NUM, s) else None


def extract_answer(text):
    """The answer in a reply: its \\boxed{} values if any (they must agree), else its last number."""
    if boxes := boxed(text):
        values = {parse_number(b) for b in boxes}
        return values.pop() if len(values) == 1 else None  # a hedge over two answers is no answer
    found = CANDIDATE.findall(text)
    return parse_number(found[-1]) if found else None


def math_digits(rng, d):
    """The toy level: one operation on two single digits."""
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Compute {a} {op} {b}.", Fraction(value), [f"{a} {op} {b} = {value}."]


def math_arithmetic(rng, d):
    steps = []

    def build(depth):  # -> (text, value, is_leaf)
        if depth == 0:
            v = rng.randint(1, 6 + 4 * d)
            return str(v), Fraction(v), True
        (lt, lv, ll), (rt, rv, rl) = build(depth - 1), build(rng.randint(0, depth - 1))
        op = rng.choice("+-*/") if rv else rng.choice("+-*")
        v = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else 0}[op]
        steps.append(f"{fmt(lv)} {op} {fmt(rv)} = {fmt(v)}")
        return f"{lt if ll else f'({lt})'} {op} {rt if rl else f'({rt})'}", v, False

    text, value, _ = build(min(d, 4))
    return f"Compute {text}.", value, ["Work from the innermost operations outward."] + steps


def math_linear(rng, d):
    r = 3 + 2 * d
    a, c = rng.sample([i for i in range(-r, r + 1) if i], 2)
    b, e = rng.randint(-5 * r, 5 * r), rng.randint(-5 * r, 5 * r)

    def side(k, m):
        return f"{k}x {'+' if m >= 0 else '-'} {abs(m)}"

    x = Fraction(e - b, a - c)
    return (
        f"Solve for x: {side(a, b)} = {side(c, e)}.",
        x,
        [f"Collect x on the left: ({a} - ({c}))x = {e} - ({b}), so {a - c}x = {e - b}.", f"x = {fmt(x)}."],
    )


def math_series(rng, d):
    a, k, n = rng.randint(-10, 20), rng.randint(1, 3 + d), rng.randint(5, 10 * d + 5)
    last = a + (n - 1) * k
    s = Fraction(n * (a + last), 2)
    return (
        f"What is the sum of the first {n} terms of the arithmetic sequence {a}, {a + k}, {a + 2 * k}, ...?",
        s,
        [
            f"The difference is {k}; the last term is {a} + {n - 1}*{k} = {last}.",
            f"The sum is {n}*({a} + {last})/2 = {fmt(s)}.",
        ],
    )


def math_gcd_lcm(rng, d):
    xs = [rng.randint(2, 10 * d + 20) for _ in range(2 + d // 2)]
    kind, f = rng.choice([("greatest common divisor", gcd), ("least common multiple", lcm)])
    steps, acc = [], xs[0]
    for x in xs[1:]:
        steps.append(f"{f.__name__}({acc}, {x}) = {f(acc, x)}")
        acc = f(acc, x)
    return f"What is the {kind} of {', '.join(map(str, xs))}?", Fraction(acc), steps


def math_modpow(rng, d):
    a, b, m = rng.randint(2, 9 + d), rng.randint(5, 20 * d), rng.randint(5, 20 + 10 * d)
    steps, sq, i = [f"{b} in binary is {b:b}; square repeatedly mod {m}:"], a % m, 0
    while 1 << i <= b:
        steps.append(f"{a}^{1 << i} = {sq} (mod {m})")
        sq, i = sq * sq % m, i + 1
    steps.append(f"Multiplying the powers for the set bits gives {pow(a, b, m)}.")
    return f"What is the remainder when {a}^{b} is divided by {m}?", Fraction(pow(a, b, m)), steps


def math_discount(rng, d):
    n, p, q = (
        rng.randint(2, 5 * d + 5),
        rng.randint(3, 20 * d + 10),
        rng.choice([5, 10, 15, 20, 25, 30, 40, 50]),
    )
    total, pay = n * p, Fraction(n * p * (100 - q), 100)
    return (
        f"A shop sells {n} notebooks at {p} cents each and takes {q}% off the total. How many cents does "
        f"the buyer pay?",
        pay,
        [
            f"The total is {n}*{p} = {total} cents.",
            f"{q}% off leaves {100 - q}%: {total}*{100 - q}/100 = {fmt(pay)}.",
        ],
    )


MATH = [math_arithmetic, math_linear, math_series, math_gcd_lcm, math_modpow, math_discount]


class MathEnv(Env):
    name, max_turns = "math", 2

    def make_task(self, rng, d):
        family = rng.choice(MATH) if d else math_digits
        question, answer, steps = family(rng, d)
        return {
            "prompt": question + " Give the exact answer (an integer or a fraction) in \\boxed{}.",
            "answer": answer,
            "steps": steps,
        }

    def grade(self, text):
        got = extract_answer(text)
        if got is None:
            return 0.0, "no answer found"
        return (1.0, "correct") if got == self.task["answer"] else (0.0, f"wrong: {fmt(got)}")

    def solve(self):
        yield {
            "role": "assistant",
            "reasoning_content": " ".join(self.task["steps"]),
            "content": f"The answer is \\boxed{{{fmt(self.task['answer'])}}}.",
        }
