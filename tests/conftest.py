import contextlib
import functools
import os
import random
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the project's modules, and the workshop run's in workshop/ (test_speedrun.py, test_rl_async.py)
sys.path[:0] = [ROOT, os.path.join(ROOT, "workshop")]
torch.set_num_threads(min(2, os.cpu_count() or 1))

import experts  # noqa: E402
import model  # noqa: E402


# The core tier: the model's math and the algorithms the report describes, each against its reference
# (reference.py, dense-masked DSA, naive MLA, per-matrix Muon, the RL losses by hand, the kernels under
# Triton's interpreter), no server, sandbox or training run: python -m pytest -q -m core tests
CORE_FILES = (
    "test_reference.py",
    "test_dsa.py",
    "test_model.py",
    "test_muon.py",
    "test_rl.py",
    "test_kernels.py",
)


def pytest_configure(config):
    # the fast tier a reader runs while editing: python -m pytest -q -m "not slow" tests bench/tests
    config.addinivalue_line("markers", "slow: over ~5 s on 2 cores; left out of the fast tier")
    config.addinivalue_line("markers", "core: the model's math and the report's algorithms (CORE_FILES)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in CORE_FILES and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.core)


def _gloo_rank(rank, world, init_file, check, args):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    # a collective that never completes (ranks disagreeing) fails after 60 s instead of hanging CI
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        check(rank, world, init_device_mesh("cpu", (world,)), *args)
        dist.barrier()  # neither rank tears its connections down while the other still uses them
    finally:
        dist.destroy_process_group()
    # The check passed. Leave without the interpreter's shutdown: gloo's threads can still be winding down
    # there and abort the process now and then ("terminate called without an active exception", SIGABRT),
    # a failure of the teardown, not of anything checked. An assertion in check still fails the test: the
    # exception propagates and the process exits nonzero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def on_two_gloo_ranks(check, *args):
    """Run check(rank, world, mesh, *args) on two CPU ranks over gloo (a module-level function of the test
    file). An AssertionError, or a 60 s collective timeout, in either rank makes mp.spawn raise, which
    fails the calling test."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_gloo_rank, args=(2, os.path.join(d, "init"), check, args), nprocs=2, join=True)


@functools.cache
def tiny_chat_tokenizer():
    """A 320-id BPE with GLM-5's chat tokens, trained in about a second on 20 seeded standard-library files:
    the tokenizer of the agent-loop and RL tests, built once per session."""
    import data
    from tokenizer import CHAT_TOKENS, Tokenizer, train_bpe

    root = data.stdlib_root()
    files = random.Random(0).sample(data.stdlib_files(root), 20)
    return Tokenizer(train_bpe([data.read_file(root, f)[:3000] for f in files], 320 - len(CHAT_TOKENS)))


def tiny_config(**kw):
    """A GLM-5 small enough for float64 checks: every part present, v_head_dim != qk head dim on purpose."""
    base = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=20,
        n_routed_experts=8,
        num_experts_per_tok=2,
        index_topk=5,
        index_n_heads=2,
        index_head_dim=12,
        rope_theta=1e4,
        max_position_embeddings=512,
        num_nextn_predict_layers=1,
        num_mtp_steps=3,
    )
    base.update(kw)
    return model.ModelConfig(**base)


def expert_weight(moe, e, proj):
    """Expert e's `proj` ("gate_proj", "up_proj" or "down_proj") weight as the checkpoint names it: a view
    of the MoE's stacked expert tensors."""
    views = experts.per_expert_state({f"experts.{n}": t for n, t in moe.experts.named_parameters()})
    return views[f"experts.{e}.{proj}.weight"]


def randomize(m, seed=None):
    """Fresh random values for everything a checkpoint could hold, norms and router bias included; by
    released name (each expert's matrices on their own), so a seed gives the same model as it did before
    the experts were stacked."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    with torch.no_grad():
        for name, t in experts.per_expert_state(m.state_dict()).items():
            if t.is_floating_point():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g, dtype=torch.float64))
                else:
                    scale = 0.3 if "e_score_correction_bias" in name or name.endswith(".bias") else 0.1
                    t.copy_(scale * torch.randn(t.shape, generator=g, dtype=torch.float64))
    return m


@pytest.fixture
def tiny():
    return tiny_config


# -----------------------------------------------------------------------------
# Kernel tests (test_kernels.py, test_kernels_quant.py): the interpreter re-run, poisoned outputs, errors


def run_under_interpreter(test_file):
    """Run test_file again in a fresh process with Triton's CPU interpreter on (it must be switched on
    before triton is first imported, which other test modules do without it) and NANOGLM_KERNELS=triton.
    Returns (exit status, cases passed, the output's tail): the caller asserts on them, so that a child that
    failed, ran fewer cases than it should, or skipped its kernel cases for want of a device is caught."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", NANOGLM_KERNELS="triton")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", os.path.abspath(test_file)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = re.search(r"(\d+) passed", r.stdout)
    passed = 0
    if found:
        passed = int(found.group(1))
    log = r.stdout[-6000:] + r.stderr[-2000:]
    return r.returncode, passed, log


@contextlib.contextmanager
def poisoned():
    """torch.empty fills what it returns with NaN (floats) or -128 / 0 (ints): an output element a kernel
    never writes shows up in the comparison instead of passing by luck."""
    real = torch.empty

    def empty(*shape, **kw):
        t = real(*shape, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -128 if t.dtype == torch.int8 else 0)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def rel_err(got, ref):
    """max |got - ref| / max |ref| over the finite entries; the -inf entries (masked scores) must match."""
    got, ref = got.double(), ref.double()
    assert not got.isnan().any(), "the kernel left elements unwritten (NaN poison survived)"
    fin = ref.isfinite()
    assert torch.equal(fin, got.isfinite()) and torch.equal(got[~fin], ref[~fin])  # the same -inf entries
    return ((got - ref)[fin].abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def onednn_calls(monkeypatch):
    """Every answer linear.uses_onednn gives while the test runs, in order (True: oneDNN's GEMM was taken)."""
    import linear

    calls = []
    real = linear.uses_onednn

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(linear, "uses_onednn", spy)
    return calls
