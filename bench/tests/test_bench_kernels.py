"""bench_kernels.py on a machine without a CUDA GPU (and without --interpret or --cpu): it says it needs one
and exits 0, instead of failing or timing nothing."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_says_it_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run for real")
    r = subprocess.run(
        [sys.executable, "bench/bench_kernels.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "needs a CUDA GPU" in r.stdout, r.stdout + r.stderr
