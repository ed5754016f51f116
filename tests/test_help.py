"""Every runnable script answers --help: it prints its usage and exits 0, without doing any work.

A script is a file that runs something when started: it has an `if __name__ == "__main__":` block, or it
parses its arguments at import (bench/bench_kernels.py). Each runs here in this process (runpy, as
`python X.py --help` would run it: its own folder first on sys.path, the repository as the working
directory; envs/__main__.py as `python -m envs`), not in a subprocess, so the whole check takes seconds.
Run: python -m pytest -q tests/test_help.py
"""

import ast
import os
import runpy
import sys

from test_style import ROOT, project_files


def is_main_test(node):
    """node is the test `__name__ == "__main__"`."""
    if not isinstance(node, ast.Compare) or not isinstance(node.left, ast.Name):
        return False
    right = node.comparators[0]
    return node.left.id == "__name__" and isinstance(right, ast.Constant) and right.value == "__main__"


def parses_arguments(node):
    """node, a statement of the module's own body, calls parse_args."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
            if sub.func.attr == "parse_args":
                return True
    return False


def is_script(rel):
    tree = ast.parse(open(os.path.join(ROOT, rel), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.If) and is_main_test(node.test):
            return True
        definition = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if not definition and parses_arguments(node):
            return True
    return False


def scripts():
    """The project's scripts, by relative path: tests and their helpers are not scripts."""
    return [rel for rel in project_files() if "tests" not in rel.split("/") and is_script(rel)]


def test_every_script_answers_help(monkeypatch, capsys):
    found = scripts()
    assert "model.py" in found and "envs/__main__.py" in found and "bench/bench_kernels.py" in found
    monkeypatch.chdir(ROOT)
    base_path = list(sys.path)
    bad = []
    for rel in found:
        path = os.path.join(ROOT, rel)
        as_module = os.path.basename(rel) == "__main__.py"  # python -m envs, from the repository's folder
        first = os.path.dirname(path)
        if as_module:
            first = ROOT
        monkeypatch.setattr(sys, "argv", [path, "--help"])
        monkeypatch.setattr(sys, "path", [first] + base_path)
        code = None  # a script that returns (train.py's own --help) exits 0
        try:
            if as_module:
                runpy.run_module(os.path.dirname(rel).replace("/", "."), run_name="__main__")
            else:
                runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
        except Exception as e:  # a traceback: int('--help'), say
            code = repr(e)
        out = capsys.readouterr().out
        if code not in (0, None) or "usage" not in out.lower():
            bad.append(f"{rel}: exit {code!r}, stdout starts {out[:200]!r}")
    assert not bad, "\n".join(bad)
