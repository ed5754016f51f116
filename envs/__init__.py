"""
Verifiable environments for RL (GLM-5 report, arXiv 2602.15763, its RL sections: verifiable environments
for coding, terminal work, search and reasoning, with rewards checked by the environment, and the general
RL stage's rule-based rewards).

This package's __init__.py is the table of them (ENVS: math, code, terminal, search, general, each
described at the table) and the one import for their users: rollout.py, episodes.py and orchestrator.py
write envs.ENVS, envs.split_of, envs.MathEnv... Each family lives in its own file of envs/, one concept
each (sandbox.py runs what the code and terminal families execute), on the API of env_base.py:
    task, tools = env.reset(seed)       # the task text and the tool list (seed None: a random task)
    observations, reward, done, reason = env.step(message)  # an assistant message (or its text)
Difficulty runs from 0 to 5. Difficulty 0 is the toy level, tasks a 3M-parameter model learns by
imitation, so that GRPO finds groups with different rewards before RL (rl_async.py); 1 to 5 get longer and
deeper. Held-out tasks: split_of(prompt) (one task in five, by a hash of its text); seeds(env, split, n).

Run it (envs/__main__.py):
    python -m envs            # one task per environment (python rollout.py plays them through the loop)
    python -m envs --bench    # the sandbox's per-execution overhead
Tests: python -m pytest -q tests/test_envs.py tests/test_sandbox.py
Honest limits: the tasks are small procedural families (one code family: list pipelines), not SWE-bench or
the web; code and terminal need bubblewrap (envs/sandbox.py) and refuse to run without it; the search
engine is word overlap, not BM25; general's rules check form, not meaning, and no reward model scores the
rest.
"""

from envs.env_base import Env, boxed, call, seeds, show, split_of
from envs.env_code import CodeEnv
from envs.env_general import GeneralEnv
from envs.env_math import (
    MATH,
    MathEnv,
    extract_answer,
    fmt,
    math_arithmetic,
    math_digits,
    math_discount,
    math_gcd_lcm,
    math_linear,
    math_modpow,
    math_series,
    parse_number,
)
from envs.env_search import ATTRIBUTES, RELATIONS, SearchEnv
from envs.env_terminal import TerminalEnv

# the shared API and the names other files use, under envs. as before the families moved to their own files
__all__ = [
    "ATTRIBUTES",
    "ENVS",
    "MATH",
    "RELATIONS",
    "CodeEnv",
    "Env",
    "GeneralEnv",
    "MathEnv",
    "SearchEnv",
    "TerminalEnv",
    "boxed",
    "call",
    "extract_answer",
    "fmt",
    "math_arithmetic",
    "math_digits",
    "math_discount",
    "math_gcd_lcm",
    "math_linear",
    "math_modpow",
    "math_series",
    "parse_number",
    "seeds",
    "show",
    "split_of",
]

# -----------------------------------------------------------------------------
# The table of environments
#
# - math (env_math.py): arithmetic, equations, series, gcd/lcm, modular powers, a word problem; answers
#   compared as exact Fractions, never evaluated. Toy level: one operation on two single digits.
# - code (env_code.py): write solve(xs) from a spec; tool run_python; hidden tests reach the sandbox only
#   after the solution ran. Toy level: the last step alone (return their sum, say).
# - terminal (env_terminal.py): an instruction over a prepared work dir; tool shell; a verifier of the final
#   state. Toy level: one command, or two (list notes/, then read the one file there).
# - search (env_search.py): an offline knowledge graph; tools search/open/find; multi-hop questions with
#   unique answers. Toy level: a number copied from the hit of one search call.
# - general (env_general.py): one reply, no tools, a rule-based reward: format, length and language rules
#   mixed (a bulleted list of N items, at most N words, all lowercase...), and the name or topic mentioned.
#   Toy level: "Greet Mira in at most 4 words, ending with !".

ENVS = {
    "math": MathEnv,
    "code": CodeEnv,
    "terminal": TerminalEnv,
    "search": SearchEnv,
    "general": GeneralEnv,
}
