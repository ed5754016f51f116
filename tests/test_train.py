"""train.py on a CPU: config errors and the stage guards (in-process, through the functions main() calls
first), kill -9 and exact resume, atomic checkpoints, the DSA warm-up stage freezing everything but the
indexers, the sparse and SFT stages. Each training run is a subprocess with a tiny GLM-5 (seconds each;
those tests are marked slow)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = [
    "configs/toy.py",
    "--hidden_size=32",
    "--intermediate_size=64",
    "--moe_intermediate_size=16",
    "--num_hidden_layers=2",
    "--num_attention_heads=2",
    "--num_key_value_heads=2",
    "--q_lora_rank=16",
    "--kv_lora_rank=16",
    "--qk_nope_head_dim=8",
    "--qk_rope_head_dim=8",
    "--v_head_dim=8",
    "--n_routed_experts=4",
    "--num_experts_per_tok=2",
    "--index_topk=8",
    "--index_n_heads=2",
    "--index_head_dim=8",
    "--block_size=32",
    "--batch_size=2",
    "--eval_iters=1",
    "--sample_tokens=4",
    "--warmup_iters=2",
    "--device=cpu",
    # the MTP loss joins at the last step (toy.py's recipe, written out): a checkpoint before it holds no
    # optimizer state for the MTP block, and a resumed run must not invent one (AdamW's step count)
    "--mtp_weight_early=0.0",
    "--mtp_switch_frac=0.85",
]
N, K = 12, 3  # steps in a run, checkpoint interval
ENV = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")


def cmd(*args):
    return [sys.executable, "train.py", *TINY, *args]


def run(*args, check=True):
    r = subprocess.run(cmd(*args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def step_losses(path, after_last_resume=False):
    """{step: (loss, lm, mtp, balance, indexer_kl)} from metrics.jsonl (train records only)."""
    recs = [json.loads(line) for line in open(path)]
    if after_last_resume:
        last = max(i for i, r in enumerate(recs) if r.get("event") == "resume")
        recs = recs[last + 1 :]
    return {
        r["step"]: tuple(r[k] for k in ("loss", "lm", "mtp", "balance", "indexer_kl"))
        for r in recs
        if "loss" in r
    }


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One uninterrupted pretraining run of N steps: its metrics and its final checkpoint."""
    out = tmp_path_factory.mktemp("a")
    run(f"--out_dir={out}", f"--max_iters={N}", f"--eval_interval={K}")
    return out


# -----------------------------------------------------------------------------
# Config errors: one clear sentence, nonzero exit. train.resolve_config is what main() calls first, so
# these run in-process; one run of the script checks that the sentence reaches the terminal alone.


def config_error(argv):
    """The sentence train.resolve_config stops with for argv."""
    import train

    with pytest.raises(SystemExit) as e:
        train.resolve_config(argv)
    return str(e.value)


def test_unknown_key_on_command_line():
    msg = config_error([*TINY, "--max_iter=5"])
    assert "'max_iter'" in msg and "did you mean 'max_iters'" in msg, msg


@pytest.mark.slow
def test_a_config_error_reaches_the_terminal_as_one_sentence():
    msg = config_error([*TINY, "--max_iter=5"])
    r = run("--max_iter=5", check=False)  # the script: exit 1, the sentence, no traceback
    assert r.returncode == 1 and r.stderr.strip() == msg, r.stderr


def test_sft_without_the_stdlib_needs_extra_conversations():
    msg = config_error([*TINY, "--stage=sft", "--sft_stdlib=False"])
    assert "--sft_extra" in msg, msg


def test_unknown_key_in_config_file(tmp_path):
    cfg = tmp_path / "bad.py"
    cfg.write_text("batch_size = 2\ngrad_acum = 2\n")
    msg = config_error([str(cfg)])
    assert "'grad_acum'" in msg and "did you mean 'grad_accum'" in msg, msg
    cfg.write_text("hiden_size = 64\n")  # a near-miss of a model field
    msg = config_error([str(cfg)])
    assert "'hiden_size'" in msg and "'hidden_size'" in msg, msg


def test_wrong_type_and_bad_values():
    import train

    for arg, words in (
        ("--max_iters=abc", ["max_iters", "int"]),
        ("--lr_muon=True", ["lr_muon", "float"]),
        ("--hidden_size=3.5", ["hidden_size", "int"]),
        ("--stage=rl", ["stage", "sft"]),
    ):
        msg = config_error([*TINY, arg])
        assert all(w in msg for w in words), (arg, msg)
    with pytest.raises(SystemExit, match="'tpu' is not supported"):
        train.pick_device("tpu")
    assert train.resolve_config(TINY)[0] == train.resolve_config(TINY)[0]  # resolving changes no default


def test_resume_without_checkpoint(tmp_path):
    import train

    with pytest.raises(SystemExit, match="no checkpoint at"):
        train.check_stage_start("pretrain", str(tmp_path), "", resume=True)


def test_toy_eos_ids_are_our_tokenizers_stop_tokens():
    import chat
    import train
    from tokenizer import get_tokenizer

    train_cfg, cfg = train.resolve_config(["configs/toy.py"])
    tok = get_tokenizer(train_cfg["tokenizer_vocab_size"], cache_dir=os.path.join(ROOT, "data"))
    assert cfg.eos_token_id == [
        tok.special_tokens[s] for s in ("<|endoftext|>", "<|user|>", "<|observation|>")
    ]
    assert set(cfg.eos_token_id) == {tok.special_tokens[s] for s in chat.STOP_TOKENS}
    assert max(cfg.eos_token_id) < cfg.vocab_size
    _, small = train.resolve_config(["configs/small.py"])
    assert small.eos_token_id == cfg.eos_token_id  # small also tokenizes with the 4,096-token BPE


# -----------------------------------------------------------------------------
# A stage after pretrain needs the stage before it, and a run keeps other stages' checkpoints


def test_a_later_stage_without_init_from_stops(tmp_path):
    import train

    with pytest.raises(SystemExit) as e:
        train.check_stage_start("sft", str(tmp_path), "", resume=False)
    assert "--init_from=out_sparse/ckpt.pt" in str(e.value) and "--from_scratch=True" in str(e.value)
    with pytest.raises(SystemExit, match="--init_from=out/ckpt.pt"):
        train.check_stage_start("dsa_warmup", str(tmp_path), "", resume=False)
    train.check_stage_start("sft", str(tmp_path), "", resume=False, from_scratch=True)  # allowed
    train.check_stage_start("pretrain", str(tmp_path), "", resume=False)
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_another_stages_checkpoint_is_not_replaced(pretrained, tmp_path):
    """The newcomer's command: --stage=sft with out_dir holding the pretrained checkpoint. It must stop
    before touching ckpt.pt or metrics.jsonl."""
    import train

    ckpt, metrics = pretrained / "ckpt.pt", pretrained / "metrics.jsonl"
    before = (ckpt.read_bytes(), metrics.read_bytes())
    init = f"--init_from={tmp_path / 'x.pt'}"  # never read: the run stops first
    r = run(f"--out_dir={pretrained}", "--stage=sft", init, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    msg = r.stderr.strip().splitlines()[-1]
    assert "holds a pretrain checkpoint" in msg and "--out_dir=out_sft" in msg and "--overwrite=True" in msg
    assert (ckpt.read_bytes(), metrics.read_bytes()) == before
    with pytest.raises(SystemExit, match="holds a pretrain checkpoint"):
        train.check_stage_start("dsa_warmup", str(pretrained), "a.pt", resume=False)
    train.check_stage_start("dsa_warmup", str(pretrained), "a.pt", resume=False, overwrite=True)
    train.check_stage_start("pretrain", str(pretrained), "", resume=False)  # its own stage: a fresh run
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="unreadable"):
        train.check_stage_start("pretrain", str(tmp_path), "", resume=False)


# -----------------------------------------------------------------------------
# Kill -9 after a checkpoint, resume, and get exactly the uninterrupted losses


@pytest.mark.slow
def test_kill_and_resume_is_exact(pretrained, tmp_path):
    a = step_losses(pretrained / "metrics.jsonl")
    assert sorted(a) == list(range(1, N + 1))
    p = subprocess.Popen(
        cmd(f"--out_dir={tmp_path}", f"--max_iters={N}", f"--eval_interval={K}"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in p.stdout:
        if line.startswith(f"saved checkpoint step {K} "):
            os.kill(p.pid, signal.SIGKILL)
            break
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    k = torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"]
    assert K <= k < N
    b_before = step_losses(tmp_path / "metrics.jsonl")
    assert all(b_before[s] == a[s] for s in range(1, k + 1))
    r = run(f"--out_dir={tmp_path}", f"--max_iters={N}", f"--eval_interval={K}", "--resume=True")
    assert f"resumed from {tmp_path / 'ckpt.pt'} at step {k}" in r.stdout
    b = step_losses(tmp_path / "metrics.jsonl", after_last_resume=True)
    assert sorted(b) == list(range(k + 1, N + 1))
    for s in b:
        assert b[s] == a[s], f"step {s}: resumed {b[s]} != uninterrupted {a[s]}"
    # and the final weights agree bit for bit
    wa = torch.load(pretrained / "ckpt.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


# -----------------------------------------------------------------------------
# Atomic checkpoints


def test_interrupted_write_keeps_the_good_checkpoint(tmp_path, monkeypatch):
    import train

    good = {"step": 3, "w": torch.arange(10)}
    train.save_checkpoint(good, str(tmp_path))
    assert not (tmp_path / "ckpt.pt.tmp").exists()

    real_save = torch.save

    def dies_halfway(obj, f):  # write part of the new checkpoint, then "crash"
        real_save({"step": 6, "w": torch.zeros(100000)}, f)
        f.truncate(f.tell() // 2)
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint({"step": 6}, str(tmp_path))
    monkeypatch.setattr(torch, "save", real_save)
    assert (tmp_path / "ckpt.pt.tmp").exists()  # the torn file is left aside, never renamed
    back = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert back["step"] == 3 and torch.equal(back["w"], good["w"])


@pytest.mark.slow
def test_resume_ignores_stale_tmp(pretrained, tmp_path):
    import shutil

    shutil.copy(pretrained / "ckpt.pt", tmp_path / "ckpt.pt")
    (tmp_path / "ckpt.pt.tmp").write_bytes(b"torn half of a checkpoint")
    (tmp_path / "metrics.jsonl").write_text("")
    r = run(f"--out_dir={tmp_path}", f"--max_iters={N + 1}", f"--eval_interval={K}", "--resume=True")
    assert f"at step {N}" in r.stdout and f"step {N + 1} | loss" in r.stdout
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == N + 1


# -----------------------------------------------------------------------------
# Stages


@pytest.mark.slow
def test_dsa_warmup_trains_only_the_indexers(pretrained, tmp_path):
    start = torch.load(pretrained / "ckpt.pt", weights_only=False)["model"]
    r = run(
        f"--out_dir={tmp_path}",
        "--stage=dsa_warmup",
        f"--init_from={pretrained / 'ckpt.pt'}",
        "--max_iters=3",
        "--eval_interval=3",
        "--lr_muon=5e-3",
        "--lr_adamw=5e-3",
    )
    kl = [v[4] for v in step_losses(tmp_path / "metrics.jsonl").values()]
    assert all(x > 0 for x in kl), r.stdout
    end = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert end["config"]["model"]["dsa_mode"] == "dense"
    end = end["model"]
    indexer = [n for n in start if ".indexer." in n]
    assert indexer and len(indexer) < len(start)
    n_trainable = sum(start[n].numel() for n in indexer)
    assert f"{n_trainable:,} trainable in stage dsa_warmup" in r.stdout, r.stdout[:3000]
    for n in start:
        if ".indexer." in n:
            assert not torch.equal(start[n], end[n]), f"indexer tensor {n} did not train"
        else:
            assert torch.equal(start[n], end[n]), f"frozen tensor {n} changed"


@pytest.mark.slow
def test_dsa_sparse_stage_runs(pretrained, tmp_path):
    r = run(
        f"--out_dir={tmp_path}",
        "--stage=dsa_sparse",
        f"--init_from={pretrained / 'ckpt.pt'}",
        "--max_iters=2",
        "--eval_interval=2",
    )
    recs = step_losses(tmp_path / "metrics.jsonl")
    assert all(v[4] > 0 for v in recs.values()), r.stdout  # the KL is on
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ck["config"]["model"]["dsa_mode"] == "sparse"


@pytest.mark.slow
def test_sft_stage_trains_on_the_assistant_tokens_only(pretrained, tmp_path):
    import model
    import sft_data

    prompt = "Write `add(a, b)`: Return a + b."
    r = run(
        f"--out_dir={tmp_path}",
        "--stage=sft",
        f"--init_from={pretrained / 'ckpt.pt'}",
        "--max_iters=2",
        "--eval_interval=2",
        "--sample_tokens=6",
        f"--sample_prompt={prompt}",
    )
    assert "SFT attends sparsely" in r.stdout  # a pretrain checkpoint: the untrained indexer is pointed out
    assert all(v[4] > 0 for v in step_losses(tmp_path / "metrics.jsonl").values()), r.stdout  # the KL is on
    reply = json.loads(r.stdout[r.stdout.index(f"sample reply to {prompt!r}") :].split("\n", 1)[1])
    assert reply["role"] == "assistant" and isinstance(reply["content"], str)
    # the logged val loss is the masked one: recompute it from the checkpoint on the same val batch
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ck["config"]["model"]["dsa_mode"] == "sparse" and ck["config"]["train"]["stage"] == "sft"
    m = model.GLM5(model.ModelConfig(**ck["config"]["model"]))
    m.load_state_dict(ck["model"])
    m.eval()
    loader = sft_data.SFTLoader(os.path.join(ROOT, ck["config"]["train"]["sft_data_dir"]))
    x, y = loader.get_batch(
        "val", 2, 32, generator=torch.Generator().manual_seed(ck["config"]["train"]["seed"] + 1)
    )
    assert (y == -1).any() and (y >= 0).any()
    val = [json.loads(line)["val_lm"] for line in open(tmp_path / "metrics.jsonl") if "val_lm" in line][-1]
    with torch.no_grad():
        logits, losses = m(x, y, mtp_weight=0.0, balance_weight=0.0)
        unmasked = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert losses["lm"].item() == pytest.approx(val, rel=1e-5)
    assert unmasked.item() != pytest.approx(val, rel=1e-3)  # the mask changes what is counted


# -----------------------------------------------------------------------------
# Schedules and gradient accumulation


def test_lr_schedules(monkeypatch):
    import train

    monkeypatch.setattr(train, "max_iters", 100)
    monkeypatch.setattr(train, "warmup_iters", 10)
    monkeypatch.setattr(train, "decay_frac", 0.2)
    monkeypatch.setattr(train, "min_lr_frac", 0.1)
    monkeypatch.setattr(train, "schedule", "wsd")
    wsd = [train.lr_mult(s) for s in range(100)]
    assert wsd[0] == 0.1 and wsd[9] == 1.0 and all(v == 1.0 for v in wsd[9:80])
    assert all(a > b for a, b in zip(wsd[80:], wsd[81:])) and wsd[-1] == pytest.approx(0.1 + 0.9 / 20)
    monkeypatch.setattr(train, "schedule", "cosine")
    cos = [train.lr_mult(s) for s in range(100)]
    assert cos[10] == 1.0 and all(a >= b for a, b in zip(cos[10:], cos[11:])) and cos[-1] > 0.1
    monkeypatch.setattr(train, "mtp_switch_frac", 0.5)
    assert (
        train.mtp_weight_at(49) == train.mtp_weight_early and train.mtp_weight_at(50) == train.mtp_weight_late
    )


@pytest.mark.slow
def test_grad_accum_and_cosine_run(tmp_path):
    r = run(
        f"--out_dir={tmp_path}", "--max_iters=2", "--eval_interval=2", "--grad_accum=2", "--schedule=cosine"
    )
    assert "step 2 | loss" in r.stdout and "sample (4 tokens)" in r.stdout
    assert sorted(step_losses(tmp_path / "metrics.jsonl")) == [1, 2]


def test_help_lists_every_setting_with_its_default_and_meaning(monkeypatch, capsys):
    """train.py --help and rl_async.py --help: usage, what the script does, every setting with its default
    and the comment beside it in the source (or the block just above it), an example; exit 0, nothing run.
    A bare --key without a value still gets its one sentence."""
    import rl_async
    import train

    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    train.main()
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py") and "example: python train.py configs/toy.py" in out
    assert "--max_iters=200" in out and "optimizer steps" in out
    assert "--sft_extra=''" in out and "solved environment episodes" in out  # the comment block above it
    assert all(f"--{k}=" in out for k in train.DEFAULTS) and "model.ModelConfig" in out
    rl_async.main(["-h"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python rl_async.py")
    assert all(f"--{k}=" in out for k in rl_async.LOOP_DEFAULTS)
    assert "staleness: drop a trajectory" in out
    with pytest.raises(SystemExit, match="needs a value"):
        train.resolve_config(["--max_iters"])
