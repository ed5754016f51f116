"""
Solved environment episodes for SFT: each task's own solution played against the real environment through
the agent loop's system prompt and tool list, checked to earn reward 1, written as JSONL conversations in
GLM-5's chat format (GLM-5 report, arXiv 2602.15763, its post-training sections: SFT on agentic data before
RL). train.py's `sft_extra` mixes such a file into the SFT set (sft_data.py renders it); the workshop run's
episodes stage writes one of toy-level tasks.

Run it:
    python episodes.py 50 out.jsonl                                 # 50 solved conversations per environment
    python episodes.py 200 toy.jsonl --env math --difficulty 0      # the toy level of one environment
    python episodes.py 400 toy.jsonl --env math,search --difficulty 0   # of several
Tests: python -m pytest -q tests/test_sft_data.py tests/test_envs.py
Honest limits: the reasoning in these episodes is the task generator's template, not a model's own thought;
tasks of the held-out split (envs.split_of) are skipped, so RL's held-out reward is on tasks SFT never showed.
"""

import argparse
import json

import envs
import rollout

# -----------------------------------------------------------------------------
# Solved environment episodes: the task's own solution, observations from the real environment
#
# Each task's own solution is played against the real environment through rollout.py's system prompt, checked
# to earn reward 1, written as JSONL (`--sft`), and mixed in with train.py's `sft_extra`.


def play_solution(env, seed):
    """Play the task's own solution against the real environment.

    Returns (messages in chat.py's format, the tool list in OpenAI's shape, reward, reason)."""
    task, tools = env.reset(seed)
    messages = [
        {"role": "system", "content": rollout.SYSTEM},
        {"role": "user", "content": task},
    ]
    gen = env.solve()
    msg = next(gen)
    while True:
        obs, reward, done, reason = env.step(msg)
        messages.append(msg)
        if done:
            break
        messages += [{"role": "observation", "content": o} for o in obs]
        msg = gen.send(obs)
    env.close()
    return messages, rollout.tool_specs(tools), reward, reason


def solved_conversation(env, seed):
    """One conversation in the SFT format, solved by the task's own solution and checked: reward 1."""
    messages, tools, reward, reason = play_solution(env, seed)
    assert reward == 1.0, f"the {env.name} solution of seed {seed} failed: {reason}"
    return {"kind": f"env_{env.name}", "messages": messages, "tools": tools, "preserve_thinking": True}


def sft_conversations(name, n, seed=0, difficulties=(1, 2, 3)):
    """n solved conversations of environment `name`, difficulties cycled (0 is the toy level). Tasks of
    the held-out split (envs.split_of) are skipped, so RL's held-out reward is on tasks SFT never showed."""
    out, i = [], 0
    while len(out) < n:
        env = envs.ENVS[name](difficulties[len(out) % len(difficulties)])
        conv = solved_conversation(env, f"sft/{seed}/{i}")
        i += 1
        if envs.split_of(conv["messages"][1]["content"]) == "train":
            out.append(conv)
    return out


def write_env_conversations(n, path, names=tuple(envs.ENVS), difficulties=(1, 2, 3)):
    """`python episodes.py N PATH [--env NAME] [--difficulty D]`: n solved conversations per environment,
    one JSON per line."""
    with open(path, "w") as f:
        for name in names:
            for conv in sft_conversations(name, n, difficulties=difficulties):
                f.write(json.dumps(conv) + "\n")
    print(f"wrote {n} solved conversations per environment ({', '.join(names)}) to {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description="Solved environment episodes for SFT: each task's own solution played through the agent "
        "loop, kept when it earns reward 1, written as JSONL conversations in GLM-5's chat format.",
        epilog="example: python episodes.py 200 toy.jsonl --env math,search --difficulty 0",
    )
    ap.add_argument("n", metavar="N", type=int, help="solved conversations per environment")
    ap.add_argument(
        "path",
        metavar="PATH",
        nargs="?",
        default="data/sft_envs.jsonl",
        help="the JSONL file to write (default: %(default)s)",
    )
    ap.add_argument(
        "--env",
        metavar="NAME[,NAME]",
        default=",".join(envs.ENVS),
        help="an environment, or several with commas (default: all, %(default)s)",
    )
    ap.add_argument(
        "--difficulty", metavar="D", type=int, help="one level, 0 the toy level (default: levels 1, 2 and 3)"
    )
    args = ap.parse_args()
    if args.n < 0:
        ap.error(f"N is a count of conversations per environment: 0 or more, not {args.n}")
    names = tuple(args.env.split(","))
    unknown = [name for name in names if name not in envs.ENVS]
    if unknown:
        ap.error(f"--env {unknown[0]!r}: choose from {', '.join(envs.ENVS)}")
    difficulties = (1, 2, 3)
    if args.difficulty is not None:
        difficulties = (args.difficulty,)
    write_env_conversations(args.n, args.path, names, difficulties)
