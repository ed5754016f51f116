"""
The SFT data: conversations in GLM-5's chat format (chat.py), generated offline, tokenized once and read
in packed rows (GLM-5 report, arXiv 2602.15763, its post-training sections: SFT with the three thinking
modes, before RL).

Two sources, one format (the OpenAI-style messages that chat.render takes), each described at its section:
the standard library's documented functions (data.py's corpus, the same by-file train/val split), written
by the assistant with reasoning read off their code, and solved episodes of the environments (envs/)
(episodes.py writes them; train.py's `sft_extra` mixes them in). prepare_sft() renders every conversation
into one packed stream of ids with a loss mask and caches it; SFTLoader draws rows that start at a
conversation.

Run it:
    python sft_data.py                        # one rendered example per thinking mode (trained spans in
                                              # ⟦ ⟧), then build the SFT set and print its statistics
Tests: python -m pytest -q tests/test_sft_data.py
Honest limits: the "assistant" only ever writes standard-library functions and answers questions about
them, and all its reasoning (here and in the environment episodes) is a template filled from the code or
from the task's own solution, not a model's own thought; a model trained on it learns the format and the
masking, not to reason.
"""

import argparse
import ast
import hashlib
import json
import os
import random
import textwrap
import time

import numpy as np
import torch

import chat
import data
from chat import render, render_text
from tokenizer import get_tokenizer, vocab_size_argument

# -----------------------------------------------------------------------------
# Facts about a function, read off its code with ast


def module_name(rel):
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def summary_of(doc, name):
    """The docstring's first paragraph on one line, at most about 300 characters (an old-style
    "name(args) -> x" first line is skipped)."""
    paras = [" ".join(p.split()) for p in doc.strip().split("\n\n") if p.strip()]
    s = paras[1] if paras[0].startswith(name + "(") and len(paras) > 1 else paras[0]
    if len(s) > 300:
        cut = s.rfind(". ", 0, 300)
        s = s[: cut + 1] if cut > 80 else s[:297] + "..."
    return s if s.endswith((".", "!", "?", ":")) else s + "."


def functions_in(src, rel, max_lines=40, max_chars=2000):
    """Top-level functions and methods with a docstring, small enough to write in one reply."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []  # a few files are Python 2 or deliberately broken: skip them
    lines = src.splitlines()
    found = []
    for node in tree.body:
        inner = node.body if isinstance(node, ast.ClassDef) else [node]
        for f in inner:
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(f):
                continue
            first = min([f.lineno] + [d.lineno for d in f.decorator_list])
            source = textwrap.dedent("\n".join(lines[first - 1 : f.end_lineno]))
            if (
                f.end_lineno - first + 1 > max_lines
                or len(source) > max_chars
                or source.startswith((" ", "\t"))
            ):
                continue
            fn = facts(f, source, rel, node.name if node is not f else None)
            if len(fn["summary"].split()) >= 3 and not fn["summary"].startswith(f.name + "("):
                found.append(fn)
    return found


def own_nodes(f):
    """f's body in source order, without descending into nested functions and classes (their returns are
    not f's)."""
    todo = list(reversed(f.body))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo += reversed(list(ast.iter_child_nodes(n)))


def facts(f, source, rel, cls):
    """What the reasoning may say about f: its signature, parameters, returns, raises, calls, length."""
    a = f.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + a.defaults
    params = [
        f"`{p.arg}`" + (f" (default `{ast.unparse(d)}`)" if d is not None else "")
        for p, d in zip(pos, defaults)
    ]
    params += [f"`*{a.vararg.arg}`"] if a.vararg else []
    params += [f"keyword-only `{k.arg}`" for k in a.kwonlyargs]
    params += [f"`**{a.kwarg.arg}`"] if a.kwarg else []
    if cls and pos and pos[0].arg in ("self", "cls"):
        params = params[1:]
    walk = list(own_nodes(f))
    returns, raises, calls = [], [], []
    for n in walk:
        if isinstance(n, ast.Return) and n.value is not None and ast.unparse(n.value) not in returns:
            returns.append(ast.unparse(n.value))
        if isinstance(n, ast.Raise) and n.exc is not None:
            e = n.exc.func if isinstance(n.exc, ast.Call) else n.exc
            if ast.unparse(e) not in raises:
                raises.append(ast.unparse(e))
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute)):
            calls += [ast.unparse(n.func)] if ast.unparse(n.func) not in calls else []
    doc = ast.get_docstring(f)
    return {
        "name": f.name,
        "qualname": f"{cls}.{f.name}" if cls else f.name,
        "module": module_name(rel),
        "file": rel,
        "sig": f"{f.name}({ast.unparse(a)})",
        "doc": doc,
        "summary": summary_of(doc, f.name),
        "source": source,
        "params": params,
        "returns": returns,
        "raises": raises,
        "calls": calls,
        "lines": source.count("\n") + 1,
        "generator": any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in walk),
        "async": isinstance(f, ast.AsyncFunctionDef),
    }


def short(code, n=60):
    return code if len(code) <= n else code[: n - 3] + "..."


def and_list(items):
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def args_sentence(fn):
    if fn["params"]:
        return f"It takes {and_list(fn['params'])}."
    if "." in fn["qualname"]:  # a method
        return "It takes no arguments besides `self`."
    return "It takes no arguments."


def returns_sentence(fn):
    if fn["generator"]:
        return "It is a generator: it yields its results instead of returning one value."
    if fn["returns"]:
        return f"It returns {and_list([f'`{short(r)}`' for r in fn['returns'][:3]])}" + (
            " on different paths." if len(fn["returns"]) > 1 else "."
        )
    return "It returns nothing, so callers get None."


def raises_sentence(fn):
    if fn["raises"]:
        return f"It raises {and_list([f'`{short(r, 40)}`' for r in fn['raises'][:3]])} itself."
    return "It raises no exception itself (what it calls may still raise)."


def reasoning_for(fn):
    """A plan read off the code: arguments, result, errors, what it calls, how long it is."""
    parts = [f"The docstring summary: \"{fn['summary']}\"", args_sentence(fn), returns_sentence(fn)]
    parts += [raises_sentence(fn)] if fn["raises"] else []
    if fn["calls"]:
        parts.append(f"It relies on {and_list([f'`{c}`' for c in fn['calls'][:4]])}.")
    parts.append(
        f"{fn['lines']} lines with the docstring" + (", written as an async def." if fn["async"] else ".")
    )
    return " ".join(parts)


# -----------------------------------------------------------------------------
# Conversations: write a function, look up a helper with a tool, answer a follow-up question
#
# The standard library (data.py's corpus, the same by-file train/val split): every top-level function and
# method with a docstring becomes a conversation. The user asks for it by its signature and docstring summary;
# the assistant writes it, with reasoning read off its code by `ast` (arguments, returns, raises, calls,
# length). Some conversations call a `help` tool on a helper the function uses and get the helper's real
# docstring back (interleaved thinking); some go on with a second turn that asks about the function, with
# thinking switched on or off for that turn (turn-level thinking) and sometimes kept across turns (preserved
# thinking).

SYSTEM = "You are a careful Python programmer who writes standard-library style code."
# The tool of the "tool" conversations, in OpenAI's request shape: chat.render writes it into the tool list's
# system block, as GLM-5's template does.
HELP_TOOL = {
    "type": "function",
    "function": {
        "name": "help",
        "description": "The docstring of a standard-library function.",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "a dotted name, e.g. os.path.join"}},
            "required": ["name"],
        },
    },
}
ASKS = [
    "Write a Python function `{sig}` for the module `{module}`: {summary}",
    "Implement `{sig}` ({module}). Its docstring starts: \"{summary}\"",
    "In `{module}`, how would you write `{sig}`? It should do this: {summary}",
]
# A second turn: (question, answer, reasoning), each read off the function's code.
FOLLOW_UPS = [
    (
        "What does `{name}` return?",
        returns_sentence,
        lambda fn: f"Return statements with a value: {len(fn['returns'])}; a generator: {fn['generator']}.",
    ),
    (
        "Which exceptions does `{name}` raise?",
        raises_sentence,
        lambda fn: f"Its raise statements name {len(fn['raises'])} exception(s).",
    ),
    ("Which arguments does `{name}` take?", args_sentence, lambda fn: f"Its signature is `{fn['sig']}`."),
    (
        "Sum up `{name}` in one sentence.",
        lambda fn: fn["summary"],
        lambda fn: "The first paragraph of its docstring says it.",
    ),
]


def ask(fn, rng):
    sig = fn["sig"] if "." not in fn["qualname"] else f"{fn['qualname'].split('.')[0]}.{fn['sig']}"
    return rng.choice(ASKS).format(sig=sig, module=fn["module"], summary=fn["summary"])


def user(text, thinking):
    return {"role": "user", "content": text} | ({} if thinking else {"thinking": False})


def answer(fn, thinking, reasoning):
    return {"role": "assistant", "content": f"```python\n{fn['source']}\n```"} | (
        {"reasoning_content": reasoning} if thinking else {}
    )


def conversation(fn, helpers, rng):
    """One conversation about fn; helpers: {qualname: facts} of the functions in the same module."""
    cls = fn["qualname"].rpartition(".")[0]
    quals = [cls + c[4:] if cls and c.startswith("self.") else c for c in fn["calls"]]  # self.f -> Class.f
    used = [(c, helpers[q]) for c, q in zip(fn["calls"], quals) if q in helpers and q != fn["qualname"]]
    kind = rng.choices(["write", "tool", "two_turns"], [2, 2 if used else 0, 1])[0]
    on = rng.random() < 0.7  # thinking in the first turn
    conv = {"kind": kind, "file": fn["file"], "preserve_thinking": False}
    if kind == "tool":  # interleaved: think, call help, read the helper's real docstring, think again, answer
        call, h = used[0]
        args = json.dumps({"name": f"{h['module']}.{h['qualname']}"})
        step = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "help", "arguments": args}}],
        }
        if on:
            step["reasoning_content"] = (
                f"It calls `{call}` from the same module; I will read its docstring first."
            )
        args_text = h["sig"][len(h["name"]) :]
        help_text = f"Help on {h['qualname']}{args_text} in module {h['module']}:\n\n{h['doc'][:800]}"
        conv["tools"] = [HELP_TOOL]
        conv["messages"] = [
            {"role": "system", "content": SYSTEM},
            user(ask(fn, rng), on),
            step,
            {"role": "observation", "content": help_text},
            answer(fn, on, f"help says `{call}`: {h['summary']} " + reasoning_for(fn)),
        ]
        return conv
    system = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    conv["messages"] = system + [user(ask(fn, rng), on), answer(fn, on, reasoning_for(fn))]
    if kind == "two_turns":  # turn-level: the second turn switches thinking, both ways
        on2 = rng.random() < 0.5 if on else rng.random() < 0.8
        question, reply, why = rng.choice(FOLLOW_UPS)
        second = {"role": "assistant", "content": reply(fn)} | ({"reasoning_content": why(fn)} if on2 else {})
        conv["messages"] += [user(question.format(name=fn["name"]), on2), second]
        conv["preserve_thinking"] = on and rng.random() < 0.5  # an agentic session keeps its earlier thinking
    return conv


def conversations(files, root=None, seed=1337):
    """All SFT conversations from these files, in file order. Each has its own RNG seeded by (seed, file,
    function), so a conversation never changes when other files come or go."""
    root = root or data.stdlib_root()
    out = []
    for rel in files:
        fns = functions_in(data.read_file(root, rel), rel)
        helpers = {fn["qualname"]: fn for fn in fns}
        for fn in fns:
            out.append(conversation(fn, helpers, random.Random(f"{seed}/{rel}/{fn['qualname']}")))
    return out


def render_conversation(conv, tok):
    return render(conv["messages"], tok, tools=conv.get("tools"), preserve_thinking=conv["preserve_thinking"])


# -----------------------------------------------------------------------------
# prepare_sft: tokenize once into a packed stream + mask (cached, atomic)


def source_hash(*paths):
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


# The cached set depends on the template (chat.py) and on the generator (this file): an edit to either one
# rebuilds it.
TEMPLATE_HASH = source_hash(chat.__file__, __file__)
SPLIT_FILES = ("ids", np.uint16), ("mask", np.uint8), ("starts", np.int64)


def load_extra(path):
    """Conversations from a JSONL file, one {"messages", "tools"?, "preserve_thinking"?, "kind"?} per line
    (what `python episodes.py N FILE` writes); -> (list, sha256 of the file)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no SFT conversations at {path}; write them with python episodes.py 50 {path}"
        )
    raw = open(path, "rb").read()
    convs = []
    for n, line in enumerate(raw.decode().splitlines(), 1):
        try:
            conv = {"kind": "extra", "preserve_thinking": False, **json.loads(line)}
            # checks that it renders
            render_text(
                conv["messages"], tools=conv.get("tools"), preserve_thinking=conv["preserve_thinking"]
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{path} line {n} is not a conversation ({type(e).__name__}: {e}); each line is "
                f'{{"messages": [...]}} in the chat message format'
            ) from None
        convs.append(conv)
    return convs, hashlib.sha256(raw).hexdigest()[:16]


def prepare_sft(
    vocab_size=4096,
    out_dir="data/sft",
    seed=1337,
    val_fraction=data.VAL_FRACTION,
    files=None,
    max_files=None,
    root=None,
    tokenizer=None,
    verbose=True,
    extra=None,
):
    """Write out_dir/{train,val}_{ids,mask,starts}.bin + meta.json; returns the meta dict.

    Cached like data.prepare: if meta.json matches the tokenizer, the corpus listing, the seed, the extra
    file and the sources of the template and the generator, nothing is redone. extra: a JSONL of more
    conversations (solved environment episodes), split by content like files by path."""
    root = root or data.stdlib_root()
    files = sorted(files if files is not None else data.stdlib_files(root))[:max_files]
    tok = tokenizer or get_tokenizer(vocab_size, cache_dir=os.path.dirname(out_dir.rstrip("/")) or ".")
    assert tok.vocab_size <= 2**16, "uint16 ids need vocab_size <= 65536"
    train, val = data.split_files(files, val_fraction)
    extra_convs, extra_hash = load_extra(extra) if extra else ([], None)
    # each extra conversation is keyed by its own content, so adding lines never moves the others between
    # splits
    keys = {
        "extra:" + hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:16]: c
        for c in extra_convs
    }
    extra_train, extra_val = data.split_files([k for k in keys], val_fraction)
    want = {
        "vocab_size": tok.vocab_size,
        "tokenizer_hash": tok.hash,
        "listing_hash": data.listing_hash(root, files),
        "seed": seed,
        "val_fraction": val_fraction,
        "template_hash": TEMPLATE_HASH,
        "extra_hash": extra_hash,
    }
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if all(meta.get(k) == v for k, v in want.items()) and all(
                os.path.getsize(os.path.join(out_dir, f"{s}_{name}.bin")) == meta["sizes"][s][name]
                for s in ("train", "val")
                for name, _ in SPLIT_FILES
            ):
                return meta  # cache hit
        except (OSError, ValueError, KeyError):
            pass
        os.remove(meta_path)  # stale: never leave old meta beside new files
    os.makedirs(out_dir, exist_ok=True)
    t0, done = time.time(), 0
    meta = dict(want, sizes={}, conversations={}, tokens={}, trained_tokens={}, kinds={})
    for split, names, extras in (("train", train, extra_train), ("val", val, extra_val)):
        ids, mask, starts = [], [], []
        for rel in names + extras:
            convs = [keys[rel]] if rel in keys else conversations([rel], root, seed)
            for conv in convs:
                i, m = render_conversation(conv, tok)
                assert any(m), "every SFT conversation has assistant tokens"
                starts.append(len(ids))
                ids += i
                mask += m
                meta["kinds"][conv["kind"]] = meta["kinds"].get(conv["kind"], 0) + 1
            done += 1
            total = len(files) + len(extra_convs)
            if verbose and (done % 100 == 0 or done == total):
                data.progress(done, total, t0, f"building SFT conversations into {out_dir}")
        meta["sizes"][split] = {}
        for name, dtype in SPLIT_FILES:
            arr = np.array({"ids": ids, "mask": mask, "starts": starts}[name], dtype=dtype)
            data.write_atomic(os.path.join(out_dir, f"{split}_{name}.bin"), arr.tobytes())
            meta["sizes"][split][name] = arr.nbytes
        meta["conversations"][split] = len(starts)
        meta["tokens"][split] = len(ids)
        meta["trained_tokens"][split] = sum(mask)
    meta["seconds"] = round(time.time() - t0, 2)
    data.write_atomic(meta_path, json.dumps(meta, indent=1).encode())  # last: it marks completeness
    return meta


# -----------------------------------------------------------------------------
# Batches: rows that start at a conversation, packed with the ones after it


class SFTLoader:
    """Like data.DataLoader, but for SFT: y = -1 wherever the target token is not the model's own.

    Packing, not padding: a row starts at the first token of a randomly drawn conversation and runs on into
    the conversations after it in the stream (wrapping around at its end), so no compute goes to padding;
    attention crosses the <|endoftext|> between conversations, as in pretraining. If a conversation's prompt
    alone fills the row, the row starts block_size // 2 tokens before its first assistant token instead, so
    every row has targets and the loss is never an empty mean."""

    def __init__(self, data_dir="data/sft"):
        meta_path = os.path.join(data_dir, "meta.json")
        if not os.path.exists(meta_path):
            raise FileNotFoundError(
                f"No SFT data in {data_dir}; run `python sft_data.py` (or sft_data.prepare_sft) first."
            )
        with open(meta_path) as f:
            self.meta = json.load(f)
        self.splits = {}
        for split in ("train", "val"):
            ids, mask, starts = (
                np.fromfile(os.path.join(data_dir, f"{split}_{name}.bin"), dtype=dtype)
                for name, dtype in SPLIT_FILES
            )
            trained = np.flatnonzero(mask)
            # the first trained (assistant) token of each conversation
            first = trained[np.searchsorted(trained, starts)] if len(starts) else starts
            self.splits[split] = (ids, mask.astype(bool), starts, first)

    def get_batch(self, split, batch_size, block_size, generator=None, device="cpu"):
        """(x, y): int64 (batch_size, block_size); y[:, t] = x[:, t + 1] where that token is trained,
        else -1."""
        ids, mask, starts, first = self.splits[split]
        if not len(starts):
            raise ValueError(f"The {split} split has no SFT conversations; use more files.")
        pick = torch.randint(len(starts), (batch_size,), generator=generator).numpy()
        s = np.where(first[pick] - starts[pick] <= block_size, starts[pick], first[pick] - block_size // 2)
        idx = (s[:, None] + np.arange(block_size + 1)[None]) % len(ids)  # (B, T + 1)
        toks = torch.from_numpy(ids[idx].astype(np.int64))
        y = toks[:, 1:].masked_fill(~torch.from_numpy(mask[idx[:, 1:]]), -1)
        return toks[:, :-1].contiguous().to(device), y.contiguous().to(device)


# -----------------------------------------------------------------------------
# python sft_data.py: one example per thinking mode, then the SFT set


def show_examples(tok):
    """Render one stdlib conversation per thinking mode, trained spans in ⟦ ⟧."""
    root = data.stdlib_root()
    # one stream over the files: the tool example comes first, the two-turn one from where it left off
    convs = (
        c for rel in ["textwrap.py", "os.py"] + data.stdlib_files(root) for c in conversations([rel], root)
    )
    tool = next(c for c in convs if c["kind"] == "tool")["messages"]
    # a two-turn conversation with thinking on in both turns
    two = next(
        c["messages"]
        for c in convs
        if c["kind"] == "two_turns" and all("thinking" not in m for m in c["messages"])
    )
    second_reply = {k: v for k, v in two[-1].items() if k != "reasoning_content"}
    off = two[:-2] + [two[-2] | {"thinking": False}, second_reply]
    examples = [
        ("interleaved thinking: a tool call, then the answer, each with its own think block", tool, {}),
        ("two turns, default: the first turn's thinking is dropped, so it is context only", two, {}),
        (
            "two turns, preserve_thinking=True: the first turn's thinking is kept and trained",
            two,
            {"preserve_thinking": True},
        ),
        ("turn-level: the second user turn switches thinking off", off, {}),
        (
            "the prompt serve.py sends for that turn (add_generation_prompt=True)",
            off[:-1],
            {"add_generation_prompt": True},
        ),
    ]
    for title, msgs, kw in examples:
        ids, mask = render(msgs, tok, **kw)
        print(f"==== {title}: {len(ids)} tokens, {sum(mask)} trained (in ⟦ ⟧)")
        print(chat.show(ids, mask, tok), end="\n\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description="The SFT data: print one rendered conversation per thinking mode (trained spans in ⟦ ⟧), "
        "then build the packed SFT set in data/sft and print its statistics and one batch's shape.",
        epilog="example: python sft_data.py",
    )
    vocab_size = vocab_size_argument(ap).parse_args().vocab_size
    tok = get_tokenizer(vocab_size, cache_dir="data")
    show_examples(tok)
    meta = prepare_sft(vocab_size, out_dir="data/sft")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(meta["kinds"].items()))
    print(
        f"SFT set: {meta['conversations']['train']:,} train / {meta['conversations']['val']:,} val "
        f"conversations ({kinds}); train {meta['tokens']['train']:,} tokens, "
        f"{meta['trained_tokens']['train'] / meta['tokens']['train']:.0%} of them trained; "
        f"val {meta['tokens']['val']:,} tokens (built in {meta['seconds']}s)"
    )
    x, y = SFTLoader("data/sft").get_batch("train", 4, 256, torch.Generator().manual_seed(0))
    print(
        f"a batch: x {tuple(x.shape)}, y {tuple(y.shape)}, {(y >= 0).float().mean():.0%} of targets trained"
    )
