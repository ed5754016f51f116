"""
Terminal: an instruction over a prepared work dir, the tool shell (bash in the sandbox, files persist
between calls), a verifier of the final state (GLM-5 report, arXiv 2602.15763, its agentic RL sections:
terminal environments), one of the environments of envs/.

The verifier reads the final state (and the answer, where the task asks for one) from the host without
following planted links, so claims, symlinks and FIFOs earn nothing. Levels 1 to 5: one to three of six
families (count log lines, write a note, rename, sort, clean a cache, find a key), over more files as d
grows. Toy level (0): one command (write a word into a file; count the lines of a file and answer), or
two, the multi-turn family: list notes/, then read the one file there. The word to write and the file to
count are made-up words new in almost every task, so a policy must copy them from the prompt.

Run: python -m envs (one task per environment; python rollout.py plays them through the agent loop)
Tests: python -m pytest -q tests/test_envs.py tests/test_sandbox.py
Honest limits: small file chores, not Terminal-Bench; it needs bubblewrap (envs/sandbox.py) and refuses to run
without it.
"""

from envs.env_base import Env, boxed, call, made_up_word, show
from envs.sandbox import Limits

# -----------------------------------------------------------------------------
# Terminal: an instruction, a prepared work dir, a shell, a verifier of the final state.
# A family returns (instruction, {path: content}, the commands that do it, check(sandbox, answer text)).

WORDS = "alpha bravo cedar delta ember fjord gamma harbor iris jasper koala lumen maple nova orbit".split()


def term_count(rng, d):
    word = rng.choice(["ERROR", "WARN", "TIMEOUT"])
    lines = [f"{i:04d} {rng.choice([word, 'INFO', 'DEBUG'])} {rng.choice(WORDS)}" for i in range(8 + 12 * d)]
    n = sum(word in ln.split() for ln in lines)
    return (
        f"count the lines of logs/app.log that contain {word} and write the number to count.txt",
        {"logs/app.log": "\n".join(lines) + "\n"},
        [f"grep -c {word} logs/app.log > count.txt"],
        lambda sb, answer: (sb.read("count.txt") or b"").strip() == str(n).encode(),
    )


def term_note(rng, d):
    name, text = rng.choice(WORDS) + str(rng.randint(1, 99)), " ".join(rng.sample(WORDS, 2 + d))
    return (
        f"create the directory out/{name} and write the line '{text}' into out/{name}/note.txt",
        {},
        [f"mkdir -p out/{name} && echo '{text}' > out/{name}/note.txt"],
        lambda sb, answer: (sb.read(f"out/{name}/note.txt") or b"").strip() == text.encode(),
    )


def term_rename(rng, d):
    names = rng.sample(WORDS, 2 + d)
    files = {f"docs/{n}.{'txt' if i % 3 else 'log'}": f"{n} {i}\n" for i, n in enumerate(names)}
    want = {p.split("/")[1].replace(".txt", ".md"): c.encode() for p, c in files.items()}
    return (
        "rename every .txt file in docs/ to the same name ending in .md (leave other files alone)",
        files,
        ["cd docs && for f in *.txt; do mv \"$f\" \"${f%.txt}.md\"; done"],
        lambda sb, answer: (
            sb.listdir("docs") == sorted(want) and all(sb.read(f"docs/{n}") == c for n, c in want.items())
        ),
    )


def term_sort(rng, d):
    xs = [rng.randint(-500, 500) for _ in range(5 + 5 * d)]
    want = "\n".join(map(str, sorted(xs))).encode()
    return (
        "write the numbers of nums.txt sorted from smallest to largest, one per line, into sorted.txt",
        {"nums.txt": "\n".join(map(str, xs)) + "\n"},
        ["sort -n nums.txt > sorted.txt"],
        lambda sb, answer: (sb.read("sorted.txt") or b"").strip() == want,
    )


def term_clean(rng, d):
    files = {
        f"cache/{n}.{'tmp' if rng.random() < 0.5 else 'dat'}": n + "\n" for n in rng.sample(WORDS, 3 + d)
    }
    files.setdefault("cache/zz.tmp", "zz\n")
    keep = sorted(p.split("/")[1] for p in files if not p.endswith(".tmp"))
    return (
        "delete every file in cache/ whose name ends in .tmp and keep the others",
        files,
        ["find cache -name '*.tmp' -delete"],
        lambda sb, answer: sb.listdir("cache") == keep,
    )


def term_find(rng, d):
    key = f"KEY-{rng.randint(1000, 9999)}"
    paths = [f"data/{rng.choice(WORDS)}/{w}.txt" for w in rng.sample(WORDS, 3 + 2 * d)]
    files = {p: f"{' '.join(rng.sample(WORDS, 4))}\n" for p in paths}
    target = rng.choice(paths)
    files[target] += f"the {key} is here\n"
    return (
        f"find the file under data/ that contains {key} and write its path (like data/x/y.txt) to path.txt",
        files,
        [f"grep -rl {key} data > path.txt"],
        lambda sb, answer: (sb.read("path.txt") or b"").strip().removeprefix(b"./") == target.encode(),
    )


TERMINAL = [term_count, term_note, term_rename, term_sort, term_clean, term_find]


def term_write(rng, d):
    """Toy level, one command whose effect the verifier checks."""
    word = made_up_word(rng)  # new in almost every task: copied, not recalled
    return (
        f"write the word {word} into out.txt",
        {},
        [f"echo {word} > out.txt"],
        lambda sb, answer: (sb.read("out.txt") or b"").strip() == word.encode(),
    )


def term_lines(rng, d):
    """Toy level, one command whose output is the answer."""
    n = rng.randint(2, 9)
    name = made_up_word(rng)
    return (
        f"count the lines of {name}.txt and give the number in \\boxed{{}}",
        {f"{name}.txt": "".join(w + "\n" for w in rng.sample(WORDS, n))},
        [f"wc -l < {name}.txt"],
        lambda sb, answer: [b.strip() for b in boxed(answer)] == [str(n)],
    )


def term_read(rng, d):
    """Toy level, multi-turn: the second command needs what the first one showed (the file's name)."""
    name, key = rng.choice(WORDS), str(rng.randint(100, 999))
    return (
        "read the one file in notes/ and give the number in it in \\boxed{}",
        {f"notes/{name}.txt": key + "\n"},
        ["ls notes", f"cat notes/{name}.txt"],
        lambda sb, answer: [b.strip() for b in boxed(answer)] == [key],
    )


TERMINAL_TOY = [term_write, term_lines, term_read]


class TerminalEnv(Env):
    name, max_turns, limits = "terminal", 10, Limits(cpu_s=5, wall_s=10)
    tools = [
        {
            "name": "shell",
            "arguments": {"command": "a bash command line"},
            "description": "run a bash command in /work (a sandbox without network); files persist between "
            "calls, the shell itself does not (each call starts in /work)",
        }
    ]

    def make_task(self, rng, d):
        families = TERMINAL if d else TERMINAL_TOY
        parts = [f(rng, d) for f in rng.sample(families, 1 + (d >= 3) + (d >= 5))]
        for path, content in {p: c for part in parts for p, c in part[1].items()}.items():
            self.sb.write(path, content)
        prompt = "You are in /work. Please " + ", and ".join(p[0] for p in parts) + ". Say when you are done."
        return {"prompt": prompt, "parts": parts}

    def run_tool(self, name, args):
        return show(self.sb.shell(args["command"]))

    def grade(self, text):
        failed = [p[0] for p in self.task["parts"] if not p[3](self.sb, text)]
        return (0.0, "not done: " + "; ".join(failed)) if failed else (1.0, "the final state is right")

    def solve(self):
        if self.difficulty:  # toy tasks say where to look, so the toy model learns one command, not two
            yield {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("shell", command="ls -R")],
                "reasoning_content": "First I look at what is in the work dir.",
            }
        for p in self.task["parts"]:
            for command in p[2]:
                obs = yield {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("shell", command=command)],
                    "reasoning_content": f"To {p[0]}, I run: {command}" if self.difficulty else command,
                }
        if "\\boxed" not in self.task["prompt"]:
            yield {
                "role": "assistant",
                "content": "Done.",
                "reasoning_content": "Every command succeeded, so the task is done.",
            }
            return
        # a toy task that asks for an answer: the last command printed it on its first line
        answer = obs[0].splitlines()[0].strip()
        yield {
            "role": "assistant",
            "content": f"\\boxed{{{answer}}}",
            "reasoning_content": f"The command printed {answer}, the answer.",
        }
