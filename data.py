"""
The training data: an embedded default corpus, tokenized once into uint16 shards, read by random windows.

GLM-5 pretrained on 28.5T tokens (GLM-5 report, arXiv 2602.15763, its pre-training section); nanoGLM needs
a corpus that is on every machine and needs no network, so the default is the source of the Python standard
library of the running interpreter (about 10 MB of real, varied text: code, docstrings, comments):

    stdlib *.py (sorted; tests and generated tables skipped) -> each file + <|endoftext|> -> Tokenizer
        -> data/stdlib/train_000.bin, val_000.bin

The train/val split is by file; prepare() is cached and atomic; DataLoader's torch.Generator is the data
position, so training resumes exactly; download() optionally fetches a larger public corpus. Each is
described at its section below.

Run it (the tokenizer comes first, so the command lives in tokenizer.py; train.py also calls prepare):
    python tokenizer.py            # train the 4096-token tokenizer, then tokenize the stdlib into data/stdlib
    python tokenizer.py 8192       # another vocab size
Tests: python -m pytest -q tests/test_data.py
Honest limits: the stdlib is small (a few million tokens) and all Python, so a model trained on it writes
Python-flavoured text; the stdlib differs a little between Python versions, and the cache notices that
(the source listing hash changes) and re-tokenizes.
"""

import hashlib
import json
import os
import re
import sys
import sysconfig
import time

import numpy as np
import torch

# -----------------------------------------------------------------------------
# The default corpus: the standard library's own source
#
# The train/val split is by FILE, decided by a hash of the relative path, so it never depends on file order,
# machine, or which other files are present. corpus_sample() is the text tokenizer.py trains its BPE on;
# prepare() takes that tokenizer as an argument, so this file does not import tokenizer.py (tokenizer.py
# imports this one).

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
VAL_FRACTION = 0.02  # of files (by path hash); about 16 files, ~35k tokens at vocab 4096
# Tables, not code a person wrote, are left out by their first lines: every character-map codec (the 72
# encodings/ files that say "Character Mapping Codec", most "generated ... with gencodec.py", 256 lines of
# `'\x80'  # 0x80 -> EURO SIGN` each), and any file saying a tool generated it (pydoc's topics, one 750 KB
# string; stringprep's and re's tables; token.py; the build's _sysconfigdata); and html/entities.py, a
# table kept by hand. On Python 3.11 they are 18% of the stdlib's bytes (more of its tokens) and taught the
# toy that "def " leads into a hex table.
GENERATED = re.compile(
    r"auto-?generated|generated (from|by|and used|on)|do not edit|character mapping codec", re.IGNORECASE
)
TABLES = {"html/entities.py"}


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def is_generated(path):
    """True if one of the file's first three lines says a tool generated it or it is a codec's table."""
    with open(path, "rb") as f:
        head = b"".join(f.readline() for _ in range(3)).decode("utf-8", errors="replace")
    return GENERATED.search(head) is not None


def stdlib_files(root=None):
    """Relative paths of every *.py under the stdlib, sorted: test directories, site-packages and tables
    (is_generated, TABLES) skipped."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for fn in filenames:
            rel = os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/")
            if fn.endswith(".py") and rel not in TABLES and not is_generated(os.path.join(dirpath, fn)):
                out.append(rel)
    return sorted(out)


def read_file(root, rel):
    with open(os.path.join(root, rel), "rb") as f:
        return f.read().decode("utf-8", errors="replace")  # a few old files are not UTF-8: keep going


def path_hash(rel):
    """A number in [0, 1) fixed by the relative path alone (same on every machine and Python)."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2**64


def split_files(files, val_fraction):
    """(train, val) by file: a path goes to val if its hash is below val_fraction. Both are kept non-empty
    (for tiny subsets) by moving the smallest- or largest-hash file, which again depends only on the set."""
    val = [f for f in files if path_hash(f) < val_fraction]
    train = [f for f in files if path_hash(f) >= val_fraction]
    if not val and len(train) > 1:
        val = [min(train, key=path_hash)]
        train.remove(val[0])
    if not train and len(val) > 1:
        train = [max(val, key=path_hash)]
        val.remove(train[0])
    return train, val


def corpus_sample(n_bytes, root=None):
    """About n_bytes of stdlib files for tokenizer training: train-split files in hash order (a spread over
    the whole library, not just the modules starting with 'a'), as a list of documents."""
    root = root or stdlib_root()
    train, _ = split_files(stdlib_files(root), VAL_FRACTION)  # never train the tokenizer on val
    docs, total = [], 0
    for rel in sorted(train, key=path_hash):
        if total >= n_bytes:
            break
        docs.append(read_file(root, rel))
        total += len(docs[-1].encode())
    return docs


# -----------------------------------------------------------------------------
# prepare: tokenize into uint16 shards (cached, atomic)
#
# prepare() writes uint16 shards and meta.json atomically and is cached: a second call with the same vocab,
# tokenizer and source listing returns at once.


def listing_hash(root, files):
    """Which files, in which split, with which sizes: changes when the corpus does."""
    h = hashlib.sha256()
    for rel in files:
        h.update(f"{rel}\0{os.path.getsize(os.path.join(root, rel))}\n".encode())
    return h.hexdigest()[:16]


def write_atomic(path, data):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def progress(done, total, t0, what):
    print(
        f"\r{what}: {100 * done / max(total, 1):5.1f}% ({done}/{total} files, {time.time() - t0:.1f}s)",
        end="\n" if done == total else "",
        file=sys.stderr,
        flush=True,
    )


def prepare(
    vocab_size=None,
    out_dir="data/stdlib",
    val_fraction=VAL_FRACTION,
    files=None,
    max_files=None,
    root=None,
    tokenizer=None,
    shard_tokens=2**27,
    verbose=True,
):
    """Tokenize the corpus into out_dir/{train,val}_NNN.bin (uint16) + meta.json; returns the meta dict.

    tokenizer: the Tokenizer whose ids are written (tokenizer.get_tokenizer(vocab_size); tests use a tiny
    one); vocab_size, if given, must be its size. files / max_files pick a subset (tests). Cached: if
    meta.json matches the tokenizer and the source listing, nothing is rewritten.
    """
    root = root or stdlib_root()
    files = sorted(files if files is not None else stdlib_files(root))
    if max_files is not None:
        files = files[:max_files]
    if not files:
        raise ValueError(f"No source files to tokenize under {root}.")
    if tokenizer is None:
        raise ValueError("data.prepare needs tokenizer=: the one from tokenizer.get_tokenizer(vocab_size).")
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is not the tokenizer's ({tokenizer.vocab_size}).")
    tok = tokenizer
    assert tok.vocab_size <= 2**16, "uint16 shards need vocab_size <= 65536"
    train, val = split_files(files, val_fraction)
    want = {
        "vocab_size": tok.vocab_size,
        "tokenizer_hash": tok.hash,
        "listing_hash": listing_hash(root, files),
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "n_files": len(files),
        "n_val_files": len(val),
    }

    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if all(meta.get(k) == v for k, v in want.items()) and all(
                os.path.getsize(os.path.join(out_dir, s["name"])) == 2 * s["tokens"] for s in meta["shards"]
            ):
                return meta  # cache hit
        except (OSError, ValueError, KeyError):
            pass  # unreadable or incomplete: rebuild
        os.remove(meta_path)  # stale: a crash below must not leave old meta beside new shards

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    meta = dict(want, shards=[], tokens={}, val_files=val)
    done, total = 0, len(files)
    for split, names in (("train", train), ("val", val)):
        shard, n_shard, n_split = [], 0, 0
        buf_len = 0

        def flush():
            nonlocal shard, n_shard, buf_len
            arr = np.concatenate(shard).astype(np.uint16) if shard else np.zeros(0, np.uint16)
            name = f"{split}_{n_shard:03d}.bin"
            write_atomic(os.path.join(out_dir, name), arr.tobytes())
            meta["shards"].append({"name": name, "split": split, "tokens": int(arr.size)})
            shard, n_shard, buf_len = [], n_shard + 1, 0

        for i in range(0, len(names), 64):  # batches of files: tiktoken encodes a batch in threads
            batch = names[i : i + 64]
            for ids in tok.encode_ordinary_batch([read_file(root, rel) for rel in batch]):
                ids = np.array(ids + [tok.eot_id], dtype=np.uint16)
                n_split += ids.size
                while ids.size:  # documents may straddle shards; windows never cross a shard
                    take = ids[: shard_tokens - buf_len]
                    shard.append(take)
                    buf_len += take.size
                    ids = ids[take.size :]
                    if buf_len == shard_tokens:
                        flush()
            done += len(batch)
            if verbose:
                progress(done, total, t0, f"tokenizing into {out_dir}")
        if shard or n_shard == 0:
            flush()
        meta["tokens"][split] = n_split
    meta["seconds"] = round(time.time() - t0, 2)
    write_atomic(meta_path, json.dumps(meta, indent=1).encode())  # written last: it marks completeness
    return meta


# -----------------------------------------------------------------------------
# Batches: random windows from memory-mapped shards
#
# DataLoader.get_batch() takes random windows from memory-mapped shards with offsets from a torch.Generator,
# so the generator state *is* the data position: save it in the checkpoint and training resumes exactly.


class DataLoader:
    """nanoGPT-style random windows. All randomness comes from the caller's torch.Generator."""

    def __init__(self, data_dir="data/stdlib"):
        meta_path = os.path.join(data_dir, "meta.json")
        if not os.path.exists(meta_path):
            raise FileNotFoundError(
                f"No prepared data in {data_dir}; run `python tokenizer.py` first (it tokenizes the corpus)."
            )
        with open(meta_path) as f:
            self.meta = json.load(f)
        self.data_dir = data_dir
        self.shards = {}  # split -> list of np.memmap
        for s in self.meta["shards"]:
            if s["tokens"]:
                mm = np.memmap(os.path.join(data_dir, s["name"]), dtype=np.uint16, mode="r")
                self.shards.setdefault(s["split"], []).append(mm)

    def get_batch(self, split, batch_size, block_size, generator=None, device="cpu"):
        """(x, y): int64 (batch_size, block_size) with y[:, t] = x[:, t + 1] in the corpus."""
        shards = self.shards.get(split, [])
        # A window of block_size + 1 tokens can start at len - block_size places in each shard; draw uniformly
        # over all of them (not shard-then-offset, which would favour small shards).
        starts = torch.tensor([max(len(s) - block_size, 0) for s in shards], dtype=torch.int64)
        if starts.sum() == 0:
            raise ValueError(
                f"The {split} split has no window of {block_size + 1} tokens; use a smaller "
                f"block_size or more data."
            )
        cum = torch.cumsum(starts, 0)
        pos = torch.randint(int(cum[-1]), (batch_size,), generator=generator)
        which = torch.searchsorted(cum, pos, right=True)
        offs = pos - (cum[which] - starts[which])
        rows = [
            torch.from_numpy(shards[w][o : o + block_size + 1].astype(np.int64))
            for w, o in zip(which.tolist(), offs.tolist())
        ]
        xy = torch.stack(rows)  # (B, T + 1)
        x, y = xy[:, :-1], xy[:, 1:]
        return x.contiguous().to(device), y.contiguous().to(device)


# -----------------------------------------------------------------------------
# Optional: a larger public corpus, only when asked for

# TinyStories (Eldan & Li 2023, CDLA-Sharing-1.0): short stories in simple English, plain text, stories
# separated by "<|endoftext|>". The valid file is ~19 MB, the train file ~2.2 GB.
TINYSTORIES = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/"
DOWNLOADS = {
    "tinystories-valid": TINYSTORIES + "TinyStoriesV2-GPT4-valid.txt",
    "tinystories": TINYSTORIES + "TinyStoriesV2-GPT4-train.txt",
}


def download(name, out_dir="data/download"):
    """Fetch DOWNLOADS[name] to out_dir (streamed, atomic) and return the file path. Never called by default.

    To train on it, split the text into documents (on "<|endoftext|>"), write them as files under a folder
    and call prepare(files=..., root=that folder).
    """
    import requests

    if name not in DOWNLOADS:
        raise ValueError(f"Unknown corpus {name!r}; choose one of {sorted(DOWNLOADS)}.")
    url = DOWNLOADS[name]
    path = os.path.join(out_dir, url.rsplit("/", 1)[-1])
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with requests.get(url, stream=True, timeout=30) as r:
            r.raise_for_status()
            total, got, t0 = int(r.headers.get("content-length", 0)), 0, time.time()
            with open(tmp, "wb") as f:
                for chunk in r.iter_content(1 << 20):
                    f.write(chunk)
                    got += len(chunk)
                    print(
                        f"\r{name}: {got / 1e6:.0f}/{total / 1e6:.0f} MB", end="", file=sys.stderr, flush=True
                    )
            print(f" in {time.time() - t0:.0f}s", file=sys.stderr)
    except requests.RequestException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise RuntimeError(
            f"Could not download {url} ({type(e).__name__}); check the network, or use the "
            f"default stdlib corpus, which needs none."
        ) from None
    os.replace(tmp, path)
    return path
