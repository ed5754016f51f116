"""envs/: every environment solved and failed, reward forging, math answer equivalence, the general
environment's rules (each check, and the grader against the test's own reading of the prompt), determinism of
every generator. The agent loop is tested in test_rollout.py, the SFT export in test_sft_data.py; the sandbox
itself is attacked in test_sandbox.py, and the code and terminal tests here need it too (CI has bwrap)."""

import ast
import json
import math
import operator
import os
import random
import re
import subprocess
import sys
import unicodedata
from fractions import Fraction

import pytest

import chat
import data
import envs
import episodes
import rollout
from envs import CodeEnv, GeneralEnv, MathEnv, SearchEnv, TerminalEnv, env_general, env_math, sandbox
from tokenizer import get_tokenizer

ROOT = data.stdlib_root()
SEEDS = range(6)
LEVELS = (0, 1, 3, 5)  # 0 is the toy level


def solve(env, seed):
    """Play env's own solution; returns (reward, reason)."""
    return episodes.play_solution(env, seed)[2:]


def play(env, seed, messages):
    """Play these assistant messages (or texts) in order; returns (all observations, reward, reason)."""
    env.reset(seed)
    seen = []
    for m in messages:
        obs, reward, done, reason = env.step(m)
        seen += obs
        if done:
            break
    env.close()
    return seen, reward, reason


def tool(name, **args):
    return {"role": "assistant", "content": "", "tool_calls": [envs.call(name, **args)]}


# -----------------------------------------------------------------------------
# Math: equivalence without eval, answers checked independently of the generator

EQUAL = [
    ("0.5", "1/2"),
    ("1/2", "1/2"),
    ("\\boxed{1/2}", "1/2"),
    ("\\frac{1}{2}", "1/2"),
    ("\\dfrac12", "1/2"),
    ("$\\frac{1}{2}$", "1/2"),
    (".5", "1/2"),
    ("0.50", "1/2"),
    ("2/4", "1/2"),
    ("\\boxed{\\frac{2}{4}}", "1/2"),
    ("-0.5", "-1/2"),
    ("\\boxed{-\\frac{1}{2}}", "-1/2"),
    ("\\frac{-1}{2}", "-1/2"),
    ("1,000", "1000"),
    ("x = 3", "3"),
    ("The answer is 3.", "3"),
    ("so it is \\boxed{7} apples", "7"),
    ("\\boxed{ 12 }", "12"),
    ("\\boxed{1{,}000}", "1000"),
    ("we get 1/3 + 1/6 = 1/2", "1/2"),
    ("3.0", "3"),
    ("\\boxed{3}\\boxed{3.0}", "3"),
]
UNEQUAL = [
    ("0.333", "1/3"),
    ("\\boxed{1/2} or \\boxed{1/3}", "1/2"),
    ("2+2", "4"),
    ("1/0", "0"),
    ("", "0"),
    ("\\boxed{}", "0"),
    ("four", "4"),
    ("\\boxed{x}", "0"),
    ("\\frac{1}{0}", "0"),
    ("0.5", "-1/2"),
    ("1e999999999", "0"),
    ("9" * 200, "0"),
]


@pytest.mark.parametrize("text,value", EQUAL)
def test_math_answers_that_are_equal(text, value):
    assert envs.extract_answer(text) == Fraction(value), (text, envs.extract_answer(text))


@pytest.mark.parametrize("text,value", UNEQUAL)
def test_math_answers_that_are_not(text, value, monkeypatch):
    def checked(*args):
        # a giant exponent or a 200-digit number is refused by the parser, never handed to Fraction to
        # compute (fails here, before computing, instead of hanging)
        assert all(len(str(a)) <= 60 and "e" not in str(a).lower() for a in args), args
        return Fraction(*args)

    # the parser lives in envs/env_math.py (envs re-exports it)
    monkeypatch.setattr(env_math, "Fraction", checked)
    got = envs.extract_answer(text)
    assert got != Fraction(value), (text, got)


def test_math_text_is_never_evaluated(tmp_path):
    canary = tmp_path / "pwned"
    for text in [
        f"__import__('pathlib').Path('{canary}').touch() or 1",
        f"\\boxed{{open('{canary}', 'w')}}",
        f"\\boxed{{(lambda: __import__('os').system('touch {canary}'))()}}",
    ]:
        assert envs.extract_answer(text) in (None, 1)
    assert not canary.exists()


def binop(node):
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    return ops[type(node.op)](binop(node.left), binop(node.right))


@pytest.mark.parametrize("d", LEVELS[1:])  # envs.MATH is levels 1 to 5; the toy level is tested below
def test_math_answers_hold_independently(d):
    """Re-derive each answer from the question text alone (our own generated text, parsed by the test)."""
    rng, checked = random.Random(d), 0
    for f in envs.MATH:
        for _ in range(10):
            q, a, _ = f(rng, d)
            n = [int(x) for x in re.findall(r"-?\d+", q)]
            if f is envs.math_arithmetic:
                assert binop(ast.parse(q[len("Compute ") : -1], mode="eval").body) == a
            elif f is envs.math_linear:
                k1, m1, k2, m2 = [
                    int(x.replace(" ", ""))
                    for x in re.findall(r"(-?\d+)x ([+-] \d+) = (-?\d+)x ([+-] \d+)", q)[0]
                ]
                assert k1 * a + m1 == k2 * a + m2
            elif f is envs.math_series:
                assert a == sum(n[1] + i * (n[2] - n[1]) for i in range(n[0]))
            elif f is envs.math_gcd_lcm:
                assert a == (math.gcd if "greatest" in q else math.lcm)(*n)
            elif f is envs.math_modpow:
                assert a == pow(n[0], n[1], n[2])
            else:
                assert a == Fraction(n[0] * n[1] * (100 - n[2]), 100)
            checked += 1
    assert checked == 60


@pytest.mark.parametrize("d", LEVELS)
def test_math_env_right_wrong_and_hedged(d):
    for seed in SEEDS:
        env = MathEnv(d)
        assert solve(env, seed) == (1.0, "correct")
        a = env.task["answer"]
        for wrong in [
            f"\\boxed{{{envs.fmt(a + 1)}}}",
            f"\\boxed{{{envs.fmt(a)}}} or \\boxed{{{envs.fmt(a + 1)}}}",
            "I do not know.",
            f"{envs.fmt(a)} " + " ".join(str(i) for i in range(20)),
        ]:
            assert play(env, seed, [wrong])[1] == 0.0, wrong


# -----------------------------------------------------------------------------
# Code: right and wrong solutions, and reward forging


@pytest.mark.parametrize("d", LEVELS)
def test_code_env_right_and_wrong(d):
    for seed in SEEDS[:3]:
        env = CodeEnv(d)
        env.limits = sandbox.Limits(cpu_s=1, wall_s=2)  # for the infinite loop below
        assert solve(env, seed) == (1.0, "10/10 hidden tests passed")
        sol, expected = env.task["solution"], env.task["expected"]
        assert len({json.dumps(e) for e in expected}) > 1  # a constant answer cannot pass
        off = "def solve(xs):\n    r = _solve(xs)\n    return r + 1 if isinstance(r, int) else r + [0]\n"
        wrong = [
            sol.replace("def solve", "def _solve") + off,
            "def solve(xs):\n    return 0\n",
            "def solve(xs) return 0",
            "no code here",
        ]
        wrong += ["def solve(xs):\n    while True: pass\n"] * (seed == 0)
        for w in wrong:
            text = w if w == "no code here" else f"```python\n{w}```"
            reward, reason = play(env, seed, [text])[1:]
            assert reward == 0.0, (w, reason)


def test_code_reward_forging():
    env = CodeEnv(2)
    env.limits = sandbox.Limits(cpu_s=2, wall_s=4)
    env.reset(0)
    n = len(env.task["tests"])
    forgeries = [
        # prints what a naive grader would look for, plants result files, returns nonsense
        f"import json, os\nprint('PASSED\\n' * {n} + 'OK: all tests passed')\n"
        f"json.dump({{'passed': {n}, 'failed': 0}}, open('/work/results.json', 'w'))\n"
        f"open('/work/.pytest_result', 'w').write('PASSED')\n"
        f"def solve(xs):\n    print('PASSED')\n    return -12345\n",
        # reads the runner to learn its nonce, forges a full result line, exits before the real one
        "import os, re, json\ndef solve(xs):\n    return 0\nsrc = open('/sandbox/run_tests.py').read()\n"
        "nonce = re.search(r'print\\(\"([0-9a-f]{32})\"', src).group(1)\n"
        "ins = json.load(open('/sandbox/inputs.json'))\n"
        "print(); print(nonce + json.dumps([['ok', 0] for _ in ins]), flush=True); os._exit(0)\n",
        # an object equal to everything, and a json.dumps that lies
        "import json\nclass E:\n    def __eq__(self, o): return True\n"
        "json.dumps = lambda *a, **k: '\"PASSED\"'\n"
        "def solve(xs):\n    return E()\n",
        # tries to rewrite the hidden tests and the expected values
        "import glob\nfor p in glob.glob('/sandbox/*'):\n    try:\n        open(p, 'w').write('[]')\n"
        "    except OSError:\n        pass\ndef solve(xs):\n    return 0\n",
    ]
    reasons = []
    for code in forgeries:
        reward, reason = play(env, 0, [f"```python\n{code}```"])[1:]
        assert reward == 0.0, (code, reason)
        reasons.append(reason)
    assert reasons[1].endswith("hidden tests passed"), reasons  # the forged line did reach the grader
    # no false alarm: a right solution that also prints PASSED and writes files keeps its reward
    right = env.task["solution"] + "print('PASSED')\nopen('/work/results.json', 'w').write('{}')\n"
    assert play(env, 0, [f"```python\n{right}```"])[1] == 1.0


def test_code_hidden_tests_are_out_of_reach_while_the_model_works():
    """Before grading no test input exists anywhere the model's code can look; a daemon left waiting for
    them dies with its run."""
    env = CodeEnv(1)
    env.reset(0)
    obs, _, _, _ = env.step(
        tool(
            "run_python",
            code=(
                "import os, subprocess\nprint(os.path.exists('/sandbox/inputs.json'), os.listdir('/work'))\n"
                "subprocess.Popen(['bash', '-c', 'while sleep 0.05; do "
                "cat /sandbox/inputs.json >> /work/stolen 2>/dev/null; done'],"
                " start_new_session=True)"
            ),
        )
    )
    assert obs[0].startswith("False []"), obs
    reward, reason = env.step(f"```python\n{env.task['solution']}```")[1:3]
    assert reward == 1.0 and env.sb.read("stolen") is None, reason
    env.close()


# -----------------------------------------------------------------------------
# Terminal


@pytest.mark.parametrize("d", LEVELS)
def test_terminal_env_right_and_wrong(d):
    for seed in SEEDS[:3]:
        env = TerminalEnv(d)
        assert solve(env, seed) == (1.0, "the final state is right")
        parts = env.task["parts"]
        assert play(env, seed, ["Done."])[1] == 0.0  # nothing done
        if len(parts) > 1:  # only the first part done
            assert play(env, seed, [tool("shell", command=parts[0][2][0]), "Done."])[1] == 0.0


def test_terminal_shell_keeps_files_not_the_shell():
    env = TerminalEnv(1)
    obs, _, _ = play(
        env,
        0,
        [
            tool("shell", command="echo hi > a.txt; cd /tmp; X=1"),
            tool("shell", command="cat a.txt; pwd; echo x${X}x"),
        ],
    )
    assert obs[1] == "hi\n/work\nxx\n[exit 0]", obs


def test_terminal_reward_forging():
    """The verifier reads the state itself: claims, symlinks to a right answer and FIFOs earn nothing."""
    for seed in range(40):  # find a counting task
        env = TerminalEnv(1)
        env.reset(seed)
        if env.task["parts"][0][0].startswith("count"):
            break
    cmd = env.task["parts"][0][2][0]
    attacks = [
        tool("shell", command="echo PASSED > count.txt; echo 'all checks passed'; exit 0"),
        tool("shell", command=cmd.replace("count.txt", "/tmp/c") + "; cp /tmp/c real; ln -s real count.txt"),
        tool("shell", command=cmd.replace("count.txt", "real") + "; ln -s /work/real count.txt"),
        tool("shell", command="mkfifo count.txt"),
    ]
    # the FIFO does not hang the verifier: the host-side read refuses it (test_sandbox.py tests that read)
    for attack in attacks:
        assert play(env, seed, [attack, "All tests passed. Done."])[1] == 0.0, attack
    assert play(env, seed, [tool("shell", command=cmd), "Done."])[1] == 1.0


# -----------------------------------------------------------------------------
# Search


def answer_from_question(world, question):
    """Invert the question's phrases back to the start entity, then walk forward: one answer, no search."""
    phrase, rels = question[len("What is ") : question.index("?")], []
    table = [(r[3].format(""), r[0]) for r in envs.RELATIONS] + [
        (p.format(""), a) for a, p, _ in envs.ATTRIBUTES.values()
    ]
    while True:
        hit = next(((p, r) for p, r in table if phrase.startswith(p)), None)
        if not hit:
            break
        rels.append(hit[1])
        phrase = phrase[len(hit[0]) :]
    x = phrase
    assert x in world, x
    for rel in reversed(rels):
        x = world[x][rel]
    return str(x)


@pytest.mark.parametrize("d", LEVELS)
def test_search_env_right_wrong_and_unique(d):
    for seed in SEEDS:
        env = SearchEnv(d)
        assert solve(env, seed) == (1.0, "correct")
        assert answer_from_question(env.world, env.task["prompt"]) == env.task["answer"]
        assert len(env.task["path"]) == min(d, 4) + 1 and len(set(env.task["path"])) == len(env.task["path"])
        names = [n for n in env.world if n != env.task["answer"]]
        assert play(env, seed, [f"\\boxed{{{names[0]}}}"])[1] == 0.0
        assert play(env, seed, [f"\\boxed{{{names[0]}}} \\boxed{{{env.task['answer']}}}"])[1] == 0.0
        assert play(env, seed, [", ".join(list(env.world) + [env.task["answer"]])])[1] == 0.0
        assert play(env, seed, [f"Answer: {env.task['answer'].upper()}."])[1] == 1.0


def test_search_tools_and_their_errors():
    env = SearchEnv(2)
    env.reset(1)
    start = env.task["path"][0]
    obs, _, _, _ = env.step(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                envs.call("find", pattern="x"),
                envs.call("search", query=start),
                envs.call("open", title=start.lower()),
                envs.call("find", pattern=env.task["path"][1]),
                envs.call("open", title="Nowhere"),
                envs.call("fly", to="moon"),
                {"function": {"name": "open", "arguments": "{not json"}},
                {"function": {"name": "open", "arguments": {"title": 3}}},
            ],
        }
    )
    assert obs[0].startswith("error: no page is open")
    assert obs[1].splitlines()[0].startswith(start + ":")
    assert obs[2].startswith(f"# {start}\n1: ")
    assert env.task["path"][1] in obs[3] and "no line" not in obs[3]
    assert obs[4].startswith("no page titled") and obs[5].startswith("error: unknown tool")
    assert obs[6].startswith("error: open takes") and obs[7].startswith("error: open takes")


# -----------------------------------------------------------------------------
# General: rule-based rewards, each rule a pure check; the grader against the test's own reading of the prompt

RULE_CASES = [
    ("mention", "Mira", "Hello Mira!", True),
    ("mention", "Mira", "HELLO MIRA", True),
    ("mention", "Mira", "Mira's book", True),
    ("mention", "José", "hello jose", True),
    ("mention", "Mira", "Hello Miranda", False),
    ("mention", "José", "Hello Jos", False),
    ("mention", "Mira", "", False),
    ("bullets", 2, "- tea\n- rain", True),
    ("bullets", 2, "Here:\n* tea\n  * rain", True),
    ("bullets", 2, "- tea\n- rain\n- snow", False),
    ("bullets", 2, "-tea\n-rain", False),
    ("bullets", 2, "- tea\n- !", False),
    ("bullets", 2, "tea, rain", False),
    ("end", "!", "Hello Mira!", True),
    ("end", "!", "Hello Mira!  \n", True),
    ("end", "!", "Hello Mira.", False),
    ("end", "!", "", False),
    ("end_word", "today", "See you today", True),
    ("end_word", "today", "SEE YOU TODAY", True),
    ("end_word", "today", "today", True),
    ("end_word", "today", "See you today.", False),
    ("end_word", "today", "yesterday", False),
    ("end_word", "today", "", False),
    ("boxed", "Mira", "Hi \\boxed{Mira}.", True),
    ("boxed", "Mira", "hi \\boxed{ mira }", True),
    ("boxed", "José", "\\boxed{Jose}", True),
    ("boxed", "Mira", "Hi Mira", False),
    ("boxed", "Mira", "\\boxed{Miranda}", False),
    ("boxed", "Mira", "\\boxed{Mira} \\boxed{Mira}", False),
    ("boxed", "Mira", "\\boxed{Mira} or \\boxed{Theo}", False),
    ("max_words", 4, "Hello Mira!", True),
    ("max_words", 2, "tea - ! rain", True),  # a dash or a mark alone is no word
    ("max_words", 2, "one two three", False),
    ("exact_words", 3, "one  two\nthree", True),
    ("exact_words", 2, "don't stop", True),
    ("exact_words", 3, "one two", False),
    ("exact_words", 1, "", False),
    ("lowercase", None, "hello mira, héllo!", True),
    ("lowercase", None, "hello Mira", False),
    ("lowercase", None, "hÉllo", False),
    ("uppercase", None, "HELLO ZOË!", True),
    ("uppercase", None, "HELLO MiRA", False),
    ("uppercase", None, "ZOë", False),
    ("no_digits", None, "three apples", True),
    ("no_digits", None, "3 apples", False),
    ("no_digits", None, "\u0663 apples", False),  # ARABIC-INDIC DIGIT THREE is a digit too
    ("ascii", None, "Hello Jose!", True),
    ("ascii", None, "Hello José", False),
    ("ascii", None, "Привет", False),
]


@pytest.mark.parametrize("rule,arg,text,holds", RULE_CASES)
def test_general_each_rule(rule, arg, text, holds):
    check = env_general.RULES[rule][0]
    assert check(text, arg) is holds, (rule, arg, text)


def test_general_every_rule_has_cases_both_ways():
    assert {(r, h) for r, _, _, h in RULE_CASES} == {(r, h) for r in env_general.RULES for h in (True, False)}


def fold(text):
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()


def rules_hold(prompt, text):
    """The test's own reading of the prompt's rules and its own checks (not the env's tables): True when
    text keeps every rule the prompt states."""
    subject = re.match(
        r"(?:Greet|Describe|Thank) (\S+?)(?: for the (\w+))?(?:,| in | as | with| ending| all)", prompt
    )
    assert subject, prompt
    count = len([w for w in text.split() if re.search(r"[^\W_]", w)])
    bullet_lines = [ln for ln in text.splitlines() if re.match(r"\s*[-*] ", ln)]
    ok = all(re.search(rf"(?<!\w){fold(s)}(?!\w)", fold(text)) for s in subject.groups() if s)
    if m := re.search(r"at most (\d+) words", prompt):
        ok &= count <= int(m[1])
    if m := re.search(r"exactly (\d+) words", prompt):
        ok &= count == int(m[1])
    if m := re.search(r"exactly (\d+) items", prompt):
        ok &= len(bullet_lines) == int(m[1]) and all(re.search(r"[^\W_]", ln) for ln in bullet_lines)
    if m := re.search(r"ending with the word (\w+)", prompt):
        ok &= re.search(rf"(?<![^\W_]){m[1]}\s*$", text, re.I) is not None
    elif "ending with !" in prompt:
        ok &= text.rstrip().endswith("!")
    if "\\boxed{}" in prompt:
        ok &= [fold(b).strip() for b in re.findall(r"\\boxed\{([^{}]*)\}", text)] == [fold(subject[1])]
    if "lowercase" in prompt:
        ok &= text == text.lower()
    if "capital letters" in prompt:
        ok &= text == text.upper()
    if "digits" in prompt:
        ok &= not re.search(r"\d", text)
    if "ASCII" in prompt:
        ok &= all(ord(c) < 128 for c in text)
    return bool(ok)


@pytest.mark.parametrize("d", range(6))
def test_general_env_solved_and_graded_as_the_prompt_says(d):
    """solve() earns 1 on every seed; the empty reply and the rules said back earn 0; and on the reply and
    twenty edits of it the grader agrees with the test's own reading of the prompt."""
    env, verdicts = GeneralEnv(d), {True: 0, False: 0}
    for seed in range(40):
        prompt, tools = env.reset(seed)
        assert tools == [] and solve(env, seed) == (1.0, "every rule holds"), (prompt, env.task)
        env.reset(seed)
        reply, said = env.task["reply"], env.task["mentions"]
        echo = ", ".join(env_general.RULES[r][1].format(a) for r, a in env.task["rules"][len(said) :])
        assert env.grade("") == (0.0, f"broke the rule: mention {said[0]}")
        assert env.grade(echo)[0] == 0.0 and env.grade(echo)[1].startswith("broke the rule: mention"), echo
        unnamed = reply
        for s in said:
            for form in (s, env_general.unaccent(s)):
                unnamed = re.sub(re.escape(form), "someone", unnamed, flags=re.I)
        edits = [
            reply,
            unnamed,
            reply + " and a few more words here",
            " ".join(reply.split()[:-1]),
            reply + " " + reply,
            reply.upper(),
            reply.lower(),
            reply.title(),
            reply + " 7",
            "7 " + reply,
            reply[:-1],
            reply.rstrip("!.") + ".",
            reply + " café",
            reply.replace("- ", ""),
            reply + "\n- one more",
            reply.replace("\\boxed{", "").replace("}", ""),
            reply + " \\boxed{x}",
            reply + " today",
            env_general.unaccent(reply),
            prompt,
            echo,
        ]
        for text in edits:
            reward, reason = env.grade(text)
            assert (reward == 1.0) == rules_hold(prompt, text), (prompt, text, reason)
            verdicts[reward == 1.0] += 1
    assert verdicts[True] > 40 and verdicts[False] > 40 * 8, verdicts  # edits that keep the rules, and not


def test_general_toy_level_is_short_regular_and_split():
    """The toy level: one short instruction of four shapes over eight names and eight topics, a two- or
    three-word reply, 128 distinct prompts; the prompt said back fails; held-out tasks are disjoint by text
    and never exported for SFT."""
    tok = get_tokenizer(4096, cache_dir=os.path.join(os.path.dirname(os.path.dirname(__file__)), "data"))
    env, prompts = GeneralEnv(0), set()
    for seed in range(300):
        prompt, _ = env.reset(seed)
        assert re.fullmatch(
            r"(Greet|Describe) \w+ in at most \d words, "
            r"(ending with !|with the name in \\boxed\{\}|all in (lowercase|capital) letters)",
            prompt,
        ), prompt
        subject = prompt.split()[1]
        assert subject in env_general.TOY_NAMES + env_general.TOY_TOPICS, prompt
        assert 2 <= len(env_general.words(env.task["reply"])) <= 3 and env.grade(prompt)[0] == 0.0, prompt
        prompts.add(prompt)
    assert len(prompts) > 100, len(prompts)
    messages, tools, reward, _ = episodes.play_solution(env, 0)
    ids, head = chat.render(messages, tok, tools=tools)[0], chat.render(messages[:2], tok, tools=tools)[0]
    assert reward == 1.0 and len(ids) - len(head) + len(tok.encode_ordinary(messages[1]["content"])) < 80
    train, heldout = envs.seeds(env, "train", 60), envs.seeds(env, "heldout", 15)
    assert not {env.reset(s)[0] for s in train} & {env.reset(s)[0] for s in heldout}
    convs = episodes.sft_conversations("general", 40, seed=3, difficulties=(0,))
    assert json.dumps(convs) == json.dumps(
        episodes.sft_conversations("general", 40, seed=3, difficulties=(0,))
    )
    assert all(envs.split_of(c["messages"][1]["content"]) == "train" for c in convs)
    assert not {c["messages"][1]["content"] for c in convs} & {env.reset(s)[0] for s in heldout}


@pytest.mark.parametrize("d", (0, 3, 5))
def test_general_reply_survives_the_chat_template(d):
    """The oracle's reply, rendered to ids and parsed back by the agent loop (bullets' newlines, \\boxed{},
    accents), still earns 1; a tool call (there are no tools) ends the episode with 0."""
    tok = get_tokenizer(4096, cache_dir=os.path.join(os.path.dirname(os.path.dirname(__file__)), "data"))
    for seed in range(6):
        env = GeneralEnv(d)
        r = rollout.rollout(env, rollout.oracle_policy(env, tok), tok, seed=seed)
        assert (r["reward"], r["turns"]) == (1.0, 1), (env.task, r["reason"])
    env.reset(0)
    assert env.step(tool("search", query="x"))[1:] == (0.0, True, "out of turns (1)")


# -----------------------------------------------------------------------------
# Determinism of every generator, across processes with different hash seeds

DIGEST = """
import hashlib, json, envs
out = []
for name, cls in envs.ENVS.items():
    for d in (0, 1, 3, 5):
        for seed in range(3):
            env = cls(d)
            prompt, tools = env.reset(seed)
            t = {k: v if k != "parts" else [p[:3] for p in v] for k, v in env.task.items()}
            out.append(json.dumps([prompt, tools, repr(t), repr(getattr(env, "pages", None))]))
            env.close()
print(hashlib.sha256("".join(out).encode()).hexdigest(), len(set(out)))
"""


def test_every_generator_is_deterministic_given_a_seed():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = {}
    exec(DIGEST.replace("print(", "here['out'] = ("), {"here": here})
    there = subprocess.run(
        [sys.executable, "-c", DIGEST],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONHASHSEED": str(hash("x") % 1000 + 1)},  # another hash seed
    )
    assert there.returncode == 0, there.stderr[-2000:]
    assert there.stdout.split() == [here["out"][0], str(here["out"][1])]
    # and different seeds or difficulties give different tasks
    assert here["out"][1] == len(envs.ENVS) * 4 * 3


def test_terminal_files_differ_by_seed_and_match_the_generator():
    env = TerminalEnv(3)
    env.reset(0)
    files = {p: c for part in env.task["parts"] for p, c in part[1].items()}
    assert files and all(env.sb.read(p) == c.encode() for p, c in files.items())
    env.close()


# -----------------------------------------------------------------------------
# The toy level (difficulty 0): short, solvable, graded by the real environment, split for held-out seeds


def test_toy_level_is_short_solved_and_graded():
    """Every toy episode: the solution earns 1, a wrong answer 0; the tokens past the constant system block
    (tool list and system prompt) stay under 200 with the project tokenizer; term_read takes two calls."""
    tok = get_tokenizer(4096, cache_dir=os.path.join(os.path.dirname(os.path.dirname(__file__)), "data"))
    seen = set()
    for cls in (MathEnv, SearchEnv, TerminalEnv):
        for seed in range(12):
            env = cls(0)
            messages, tools, reward, reason = episodes.play_solution(env, seed)
            assert reward == 1.0, (cls.name, seed, reason)
            head = chat.render(messages[:2], tok, tools=tools)[0]
            ids = chat.render(messages, tok, tools=tools)[0]
            assert len(ids) - len(head) + len(tok.encode_ordinary(messages[1]["content"])) < 200
            calls = sum(len(m.get("tool_calls") or []) for m in messages)
            seen.add((cls.name, calls))
            answer = envs.boxed(messages[-1]["content"])
            if answer:  # a wrong number in its place
                wrong = str(int(answer[0]) + 1)
                moves = [m for m in messages[2:-1] if m["role"] == "assistant"]
                assert play(env, seed, moves + [f"\\boxed{{{wrong}}}"])[1] == 0.0
    assert seen >= {("math", 0), ("search", 1), ("terminal", 1), ("terminal", 2)}, seen


def test_toy_terminal_words_are_fresh_so_held_out_tasks_need_copying():
    """The word to write and the file to count are made up per task: many distinct ones, each family in both
    splits, and no held-out word among the training tasks' (a policy must copy, not recall)."""
    from envs import env_terminal

    rng = random.Random(0)
    for family in (env_terminal.term_write, env_terminal.term_lines):
        prompts = [family(rng, 0)[0] for _ in range(200)]
        words = {re.search(r"(?:word|of) (\w+)", p).group(1) for p in prompts}
        assert len(words) > 150, len(words)
        splits = {p: envs.split_of(p) for p in prompts}
        assert set(splits.values()) == {"train", "heldout"}
    rng = random.Random(1)
    train, held = set(), set()
    for _ in range(300):
        instruction = env_terminal.term_write(rng, 0)[0]
        word = instruction.split()[3]  # "write the word <word> into out.txt"
        prompt = "You are in /work. Please " + instruction + ". Say when you are done."  # as make_task writes
        if envs.split_of(prompt) == "heldout":
            held.add(word)
        else:
            train.add(word)
    assert held and len(held - train) > 0.8 * len(held)


def test_toy_math_answers_hold_independently():
    rng = random.Random(0)
    for _ in range(50):
        q, a, _ = envs.math_digits(rng, 0)
        assert re.fullmatch(r"Compute \d [+*-] \d\.", q)
        assert binop(ast.parse(q[len("Compute ") : -1], mode="eval").body) == a


def test_seed_split_is_deterministic_and_disjoint():
    env = MathEnv(0)
    train, heldout = envs.seeds(env, "train", 60), envs.seeds(env, "heldout", 15)
    assert train == envs.seeds(env, "train", 60) and not set(train) & set(heldout)
    prompts = {s: env.reset(s)[0] for s in train + heldout}
    assert not {prompts[s] for s in train} & {prompts[s] for s in heldout}  # tasks, not just seeds
    assert all(envs.split_of(prompts[s]) == "heldout" for s in heldout)
