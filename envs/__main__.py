"""
python -m envs: one task per environment at difficulty 2, as each family poses it (python rollout.py plays
them through the agent loop); python -m envs --bench: the sandbox's per-execution overhead, sandboxed vs
plain (what python envs/sandbox.py prints).
"""

import argparse
import sys

from envs import ENVS
from envs.sandbox import report


def main(argv):
    ap = argparse.ArgumentParser(
        prog="python -m envs",
        description="Print one task per environment at difficulty 2, as each family poses it "
        "(python rollout.py plays them through the agent loop).",
        epilog="example: python -m envs --bench",
    )
    ap.add_argument(
        "--bench",
        action="store_true",
        help="instead, time the sandbox's per-execution overhead, sandboxed vs plain (as envs/sandbox.py)",
    )
    if ap.parse_args(argv).bench:
        report()
        return
    for name, cls in ENVS.items():
        env = cls(difficulty=2)
        task, tools = env.reset(0)
        print(f"==== {name} (tools: {', '.join(t['name'] for t in tools) or 'none'})\n{task}\n")
        env.close()


if __name__ == "__main__":
    main(sys.argv[1:])
