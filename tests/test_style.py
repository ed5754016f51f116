"""The codebase reads plainly: lines within 110 columns, public citations only, no import cycles, no file
that shadows a standard-library module.

These checks are what the reader sees before any number: a file squeezed past 110 columns, a citation of a
document the reader does not have, or two modules that import each other make the code harder to read next
to the GLM-5 report (arXiv 2602.15763). They read source files only (no imports), so they take milliseconds.
Run: python -m pytest -q tests/test_style.py
"""

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_files(suffixes=(".py",)):
    """Every file git tracks (or would track) in the project, by relative path."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(p for p in out if p.endswith(suffixes) and os.path.isfile(os.path.join(ROOT, p)))


def test_no_file_has_more_than_two_percent_long_lines():
    bad = []
    for rel in project_files():
        lines = open(os.path.join(ROOT, rel), encoding="utf-8").read().splitlines()
        long = [i + 1 for i, line in enumerate(lines) if len(line) > 110]
        if lines and len(long) > 0.02 * len(lines):
            bad.append(f"{rel}: {len(long)} of {len(lines)} lines over 110 columns (first at {long[0]})")
    assert not bad, "\n".join(bad)


def test_no_citation_of_a_file_readers_do_not_have():
    # the developers' notes file is not in the repo; cite the GLM-5 report and public sources by section
    word = re.compile("S" + "PEC")  # case-sensitive, as git grep reads; split so this file does not match
    hits = []
    for rel in project_files((".py", ".md", ".txt", ".toml", ".cfg", ".ini")):
        for i, line in enumerate(open(os.path.join(ROOT, rel), encoding="utf-8"), 1):
            if word.search(line):
                hits.append(f"{rel}:{i}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits)


# -----------------------------------------------------------------------------
# Import cycles. The project's modules by the name they are imported as: the top-level files (train,
# model...), the packages' files (envs, envs.env_base...) and the script folders' files by their bare names
# (bench/ and workshop/ hold scripts that run with their own folder on sys.path: bench/bench_serve.py
# imports bench_train). Tests, configs and docs are not modules.

SCRIPT_DIRS = ("bench", "workshop")


def module_names(files):
    """Relative .py paths -> {module name: path}."""
    out = {}
    for rel in files:
        parts = rel[: -len(".py")].split("/")
        if "tests" in parts or parts[0] in ("configs", "docs"):
            continue
        if len(parts) == 1 or parts[0] in SCRIPT_DIRS and len(parts) == 2:
            name = parts[-1]
        else:  # a package's file: its dotted path, the package's own name for its __init__.py
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        assert name not in out, f"{rel} and {out[name]} are both imported as {name}"
        out[name] = rel
    return out


def imported_modules(path, name, modules):
    """The project modules that the file at `path`, module `name`, imports anywhere (lazy imports count too).
    `import a.b` and `from a.b import c` need a.b and the package a (its __init__.py runs first), except the
    packages `name` itself belongs to, which are already running; `from a import b` needs a.b when that is a
    module; a relative import is read from the importer's package."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and name != prefix and not name.startswith(prefix + "."):
                    found.add(prefix)
    return found


def import_graph(root, files):
    """{module: the project modules it imports} over the relative paths `files` under root."""
    modules = module_names(files)
    return {m: imported_modules(os.path.join(root, rel), m, modules) for m, rel in modules.items()}


def on_cycles(graph):
    """The modules from which the imports lead back to themselves, sorted."""

    def reaches(start, goal, seen):
        for nxt in graph[start]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                if reaches(nxt, goal, seen):
                    return True
        return False

    return sorted(m for m in graph if reaches(m, m, set()))


def test_no_import_cycles_between_project_modules():
    graph = import_graph(ROOT, project_files())
    cycles = on_cycles(graph)
    assert not cycles, f"modules on an import cycle: {cycles}; edges: " + str(
        {m: sorted(graph[m]) for m in cycles}
    )


def test_training_does_not_import_the_sandbox():
    """train.py, and everything it imports, lazily or not, never reaches the environments or their sandbox:
    training a model needs neither bubblewrap nor the RL environments."""
    graph = import_graph(ROOT, project_files())
    reached, todo = set(), ["train"]
    while todo:
        for nxt in graph[todo.pop()] - reached:
            reached.add(nxt)
            todo.append(nxt)
    assert not {m for m in reached if m == "envs" or m.startswith("envs.")}, sorted(reached)


def test_no_file_is_named_like_a_standard_library_module():
    """A script runs with its own folder first on sys.path (python train.py, python bench/bench_serve.py,
    python envs/sandbox.py, pytest's tests/): a file there named like a standard-library module (math.py)
    would replace that module for everything the script imports."""
    bad = [rel for rel in project_files() if os.path.basename(rel)[:-3] in sys.stdlib_module_names]
    assert not bad, bad


def test_the_cycle_check_sees_through_packages_and_script_folders(tmp_path):
    """A cycle that runs through a script folder and a package is found; a package's files importing each
    other, and its __init__.py importing them, is not a cycle."""
    files = {
        "a.py": "import bench_b\n",
        "bench/bench_b.py": "from pkg import thing\n",
        "pkg/__init__.py": "from pkg.y import thing\nfrom . import w\n",
        "pkg/y.py": "from .w import x\n\n\ndef thing():\n    import a\n",
        "pkg/w.py": "x = 1\n",
        "tests/test_a.py": "import a\n",
    }
    for rel, text in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path, sorted(files))
    assert graph == {
        "a": {"bench_b"},
        "bench_b": {"pkg"},
        "pkg": {"pkg.y", "pkg.w"},
        "pkg.y": {"pkg.w", "a"},
        "pkg.w": set(),
    }
    assert on_cycles(graph) == ["a", "bench_b", "pkg", "pkg.y"]
    (tmp_path / "pkg/y.py").write_text("from pkg.w import x\n")
    assert on_cycles(import_graph(tmp_path, sorted(files))) == []
