"""sft_data.py: the stdlib conversations are real functions and deterministic, prepare_sft stores exactly
the rendered conversations and caches them, SFTLoader's packed rows, solved environment episodes mixed in."""

import ast
import json
import os
import random

import numpy as np
import pytest
import torch

import chat
import data
import envs
import episodes
import sft_data
from tokenizer import CHAT_TOKENS, Tokenizer, train_bpe

ROOT = data.stdlib_root()


@pytest.fixture(scope="module")
def tok():
    files = random.sample(data.stdlib_files(ROOT), 20)
    return Tokenizer(train_bpe([data.read_file(ROOT, f)[:3000] for f in files], 320 - len(CHAT_TOKENS)))


@pytest.fixture(scope="module")
def sft_files():
    """A handful of small stdlib files that hold SFT functions, plus two that hold every kind. Seeded: an
    unseeded draw sometimes held no conversation that preserves thinking, and the test below failed at
    random."""
    small = [f for f in data.stdlib_files(ROOT) if os.path.getsize(os.path.join(ROOT, f)) < 15_000]
    picked = [
        f for f in random.Random(0).sample(small, 40) if sft_data.functions_in(data.read_file(ROOT, f), f)
    ][:10]
    return sorted(set(picked + ["textwrap.py", "shlex.py"]))


# -----------------------------------------------------------------------------
# The stdlib SFT set


def test_conversations_are_real_and_deterministic(sft_files):
    convs = sft_data.conversations(sft_files, ROOT)
    assert convs == sft_data.conversations(sft_files, ROOT) and convs != sft_data.conversations(
        sft_files, ROOT, seed=4
    )
    assert {c["kind"] for c in convs} == {"write", "tool", "two_turns"}
    assert any(c["preserve_thinking"] for c in convs)
    assert any(m.get("thinking") is False for c in convs for m in c["messages"])
    assert any("reasoning_content" in m for c in convs for m in c["messages"])
    for c in convs:
        # a help call's tool is declared in the tool list's system block, as GLM-5's template writes it
        assert c.get("tools") == ([sft_data.HELP_TOOL] if c["kind"] == "tool" else None)
        if c["kind"] == "tool":
            assert '# Tools' in chat.render_text(c["messages"], tools=c["tools"])
        src = data.read_file(ROOT, c["file"])
        code = next(m["content"] for m in c["messages"] if m["role"] == "assistant" and m["content"])
        assert code.startswith("```python\n") and code.endswith("\n```")
        # the answer is the function itself: it parses, is named in the ask, and every line is in the file
        f = ast.parse(code[10:-4]).body[0]
        ask = next(m["content"] for m in c["messages"] if m["role"] == "user")
        assert f"{f.name}(" in ask and sft_data.summary_of(ast.get_docstring(f), f.name) in ask
        assert all(line.strip() in src for line in code[10:-4].splitlines())
        if c["kind"] == "tool":
            call = c["messages"][2]["tool_calls"][0]["function"]
            qual = json.loads(call["arguments"])["name"].removeprefix(sft_data.module_name(c["file"]) + ".")
            helper = next(h for h in sft_data.functions_in(src, c["file"]) if h["qualname"] == qual)
            assert c["messages"][3]["content"].endswith(helper["doc"][:800]) and helper["name"] in code[10:-4]


def test_prepare_sft_and_batches(tok, sft_files, tmp_path, monkeypatch):
    out = str(tmp_path / "sft")
    meta = sft_data.prepare_sft(out_dir=out, files=sft_files, tokenizer=tok, val_fraction=0.3, verbose=False)
    train, val = data.split_files(sft_files, 0.3)
    loader = sft_data.SFTLoader(out)
    for split, names in (("train", train), ("val", val)):
        ids, mask, starts, _ = loader.splits[split]
        want_ids, want_mask, want_starts = [], [], []
        # the stored stream is the rendered conversations, in order
        for c in sft_data.conversations(names, ROOT):
            assert c["file"] in names
            i, m = chat.render(
                c["messages"], tok, tools=c.get("tools"), preserve_thinking=c["preserve_thinking"]
            )
            want_starts.append(len(want_ids))
            want_ids += i
            want_mask += m
        assert ids.tolist() == want_ids and mask.tolist() == want_mask and starts.tolist() == want_starts
        assert meta["tokens"][split] == len(want_ids) and meta["trained_tokens"][split] == sum(want_mask)

    for block_size in (12, 600):  # 12: prompts overflow the row, so rows start just before the reply
        g = torch.Generator().manual_seed(0)
        x, y = loader.get_batch("train", 16, block_size, generator=g)
        x2, y2 = loader.get_batch("train", 16, block_size, generator=torch.Generator().manual_seed(0))
        x3, _ = loader.get_batch("train", 16, block_size, generator=torch.Generator().manual_seed(1))
        assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, x3)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16, block_size)
        assert ((y >= 0).sum(1) > 0).all()  # every row has targets
        ids, mask, starts, _ = loader.splits["train"]
        first = [int(np.flatnonzero(mask[s:])[0]) + s for s in starts]  # each conversation's first target
        # a row starts at a conversation, or block_size // 2 before its reply when the prompt fills the row
        candidates = set(starts.tolist()) | {
            f - block_size // 2 for s, f in zip(starts, first) if f - s > block_size
        }
        fell_back = 0
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            match = []
            for s in sorted(candidates):  # the row is a window of the stream; its targets follow the mask
                idx = (s + np.arange(block_size + 1)) % len(ids)
                targets = np.where(mask[idx[1:]], ids[idx[1:]].astype(np.int64), -1)
                if ids[idx[:-1]].tolist() == row_x and row_y == targets.tolist():
                    match.append(s)
            assert match
            fell_back += all(s not in starts for s in match)
            assert all(t == -1 or t == nxt for t, nxt in zip(row_y[:-1], row_x[1:]))  # shifted by one
        if block_size == 12:  # a 320-token BPE makes long prompts: some rows fall back
            assert fell_back > 0
        else:
            assert fell_back < len(x)

    # cached: a second call re-renders nothing and rewrites nothing; a damaged file rebuilds
    mtimes = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in os.listdir(out)}
    real = sft_data.render_conversation
    monkeypatch.setattr(sft_data, "render_conversation", lambda *a: pytest.fail("re-rendered a cached set"))
    assert (
        sft_data.prepare_sft(out_dir=out, files=sft_files, tokenizer=tok, val_fraction=0.3, verbose=False)
        == meta
    )
    assert mtimes == {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in os.listdir(out)}
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
    monkeypatch.setattr(sft_data, "render_conversation", real)
    with open(os.path.join(out, "train_mask.bin"), "r+b") as f:
        f.truncate(3)
    sft_data.prepare_sft(out_dir=out, files=sft_files, tokenizer=tok, val_fraction=0.3, verbose=False)
    assert os.path.getsize(os.path.join(out, "train_mask.bin")) == meta["tokens"]["train"]
    with pytest.raises(FileNotFoundError, match="No SFT data"):
        sft_data.SFTLoader(str(tmp_path / "nothing"))


def test_prepare_sft_mixes_in_env_conversations(tok, sft_files, tmp_path):
    """extra=: solved environment episodes join the SFT set (split by content), rendered and masked like the
    rest; a malformed line is an error naming the line."""
    convs = episodes.sft_conversations("math", 6)
    path = tmp_path / "envs.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    base = sft_data.prepare_sft(
        out_dir=str(tmp_path / "a"), files=sft_files, tokenizer=tok, val_fraction=0.3, verbose=False
    )
    meta = sft_data.prepare_sft(
        out_dir=str(tmp_path / "b"),
        files=sft_files,
        tokenizer=tok,
        val_fraction=0.3,
        verbose=False,
        extra=str(path),
    )
    assert (
        meta["kinds"]["env_math"] == 6
        and sum(meta["conversations"].values()) == sum(base["conversations"].values()) + 6
    )
    rendered = [chat.render(c["messages"], tok, tools=c["tools"], preserve_thinking=True) for c in convs]
    assert sum(meta["trained_tokens"].values()) == sum(base["trained_tokens"].values()) + sum(
        sum(m) for _, m in rendered
    )
    ids = sft_data.SFTLoader(str(tmp_path / "b")).splits["train"][0].tolist()
    val_ids = sft_data.SFTLoader(str(tmp_path / "b")).splits["val"][0].tolist()

    def within(seq, stream):
        return any(stream[k : k + len(seq)] == seq for k in range(len(stream) - len(seq) + 1))

    assert all(within(i, ids) != within(i, val_ids) for i, _ in rendered)  # each lands in exactly one split
    # adding a conversation moves none of the others between train and val
    path.write_text(
        "".join(json.dumps(c) + "\n" for c in episodes.sft_conversations("math", 1, seed=9) + convs)
    )
    sft_data.prepare_sft(
        out_dir=str(tmp_path / "d"),
        files=sft_files,
        tokenizer=tok,
        val_fraction=0.3,
        verbose=False,
        extra=str(path),
    )
    ids2 = sft_data.SFTLoader(str(tmp_path / "d")).splits["train"][0].tolist()
    assert all(within(i, ids) == within(i, ids2) for i, _ in rendered)
    path.write_text(
        json.dumps(convs[0]) + "\n" + json.dumps({"messages": [{"role": "wizard", "content": "x"}]}) + "\n"
    )
    with pytest.raises(ValueError, match="line 2"):
        sft_data.prepare_sft(
            out_dir=str(tmp_path / "c"), files=sft_files, tokenizer=tok, verbose=False, extra=str(path)
        )


# -----------------------------------------------------------------------------
# Solved environment episodes


def test_sft_conversations_are_solved_renderable_and_deterministic(tok):
    for name in envs.ENVS:
        convs = episodes.sft_conversations(name, 3, seed=7)
        assert json.dumps(convs) == json.dumps(episodes.sft_conversations(name, 3, seed=7))
        for conv in convs:
            assert conv["kind"] == f"env_{name}"
            ids, mask = sft_data.render_conversation(conv, tok)
            assert 0 < sum(mask) < len(ids)
            assistants = [m for m in conv["messages"] if m["role"] == "assistant"]
            assert all(m.get("reasoning_content") for m in assistants)
            assert (name in ("math", "general")) == (len(assistants) == 1)
            if name == "search":  # the answer was read, not known: it appears in what the tools returned
                seen = " ".join(m["content"] for m in conv["messages"] if m["role"] == "observation")
                assert envs.boxed(assistants[-1]["content"])[0] in seen


def test_sft_export_of_the_toy_level_skips_held_out_tasks():
    """The export takes an environment and a difficulty, and never writes a held-out task."""
    for name in ("math", "search", "terminal"):
        convs = episodes.sft_conversations(name, 8, seed=3, difficulties=(0,))
        assert len(convs) == 8 and json.dumps(convs) == json.dumps(
            episodes.sft_conversations(name, 8, seed=3, difficulties=(0,))
        )
        assert all(envs.split_of(c["messages"][1]["content"]) == "train" for c in convs)
    # math's toy level has 300 questions: enough of them for held-out ones to turn up and be skipped
    prompts = [
        c["messages"][1]["content"] for c in episodes.sft_conversations("math", 100, difficulties=(0,))
    ]
    env = envs.MathEnv(0)
    heldout = {env.reset(s)[0] for s in envs.seeds(env, "heldout", 20)}
    assert heldout and not heldout & set(prompts)
