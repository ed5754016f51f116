"""The benchmark scripts' tests: the repository's root and bench/ on sys.path (the scripts import the
project's modules and each other by name: bench_serve imports bench_train), the slow marker of the fast
tier, and tok, tests/conftest.py's tiny chat tokenizer.
Run: python -m pytest -q bench/tests       (the whole suite: python -m pytest -q tests bench/tests)
"""

import importlib.util
import os
import sys

import pytest
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    # the fast tier: python -m pytest -q -m "not slow" tests bench/tests (tests/conftest.py says it too)
    if not any(line.startswith("slow:") for line in config.getini("markers")):
        config.addinivalue_line("markers", "slow: over ~5 s on 2 cores; left out of the fast tier")


def core_conftest():
    """tests/conftest.py as a module of its own name: `conftest` is the name tests/'s files import it by."""
    if "tests_conftest" not in sys.modules:
        path = os.path.join(ROOT, "tests", "conftest.py")
        spec = importlib.util.spec_from_file_location("tests_conftest", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["tests_conftest"] = module
    return sys.modules["tests_conftest"]


@pytest.fixture(scope="session")
def tok():
    """A 320-id BPE with GLM-5's chat tokens (tests/conftest.py's tiny_chat_tokenizer), built once."""
    return core_conftest().tiny_chat_tokenizer()
