"""
The tokenizer: our own byte-level BPE, trained by this project, encoded and decoded through tiktoken.

GLM-5 ships a 154,880-token BPE; the toy model has vocab_size = 4096, so we train a small BPE of the
same kind on our own corpus (the Python standard library, data.py) instead of borrowing one:

    text -> regex pre-tokenizer (GPT-4 style split) -> chunks -> bytes -> BPE merges -> token ids

The special tokens are those of GLM-5's chat format (chat.py; GLM-5 report, its post-training sections).
from_tokenizer_json reads a published tokenizer.json (GLM-5's own) into the same Tokenizer, for serving a
released checkpoint. Training, encoding, the special tokens and the cache are described at their sections.

Run it:
    python tokenizer.py            # train the toy (4096) tokenizer, print time, compression, a round trip,
                                   # then tokenize the corpus into data/stdlib with it (data.prepare)
    python tokenizer.py 8192       # another vocab size
Tests: python -m pytest -q tests/test_tokenizer.py
Honest limits: training is pure Python (fine for a few MB and a few thousand merges, not for a 150k vocab
on gigabytes); the pre-tokenizer is the GPT-4 regex with numbers split into 1-2 digits, not GLM's own.
from_tokenizer_json reads byte-level BPE files only (no normalizer, no Unigram or WordPiece); tiktoken may
merge a pair that no listed merge names when two merges spell the same bytes (never seen in real files).
"""

import argparse
import base64
import collections
import hashlib
import heapq
import json
import os
import sys
import time

import regex
import tiktoken

import data

# -----------------------------------------------------------------------------
# Pre-tokenizer and special tokens

# GPT-4 (cl100k) split pattern, with numbers in groups of at most two digits (a small vocab wastes fewer
# tokens on 3-digit numbers). The same string is tiktoken's pat_str, so training and encoding agree.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# The chat format's special tokens (chat.py), in the order of GLM-5's tokenizer.json; ids follow the mergeable
# ranks. [gMASK]<sop> opens every prompt (a GLM pretraining mark kept by its chat template).
# They cover the GLM-5 report's post-training format: the system, user, assistant and observation roles,
# <think> blocks, tool calls with their <arg_key>/<arg_value> tags, <tool_response> results, the [gMASK]<sop>
# prefix.
CHAT_TOKENS = [
    "<|endoftext|>",  # end of a document in pretraining, end of a conversation in chat
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",  # tool results
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]

# -----------------------------------------------------------------------------
# BPE training
#
# train_bpe: the 256 single bytes get ranks 0..255, then the most frequent adjacent pair (counted over unique
# chunks weighted by frequency) is merged again and again; pair counts are updated incrementally and ties go
# to the smallest pair of ids, so training is deterministic and takes seconds.


def train_bpe(text, vocab_size, pattern=SPLIT_PATTERN):
    """Learn byte-level BPE merges; returns tiktoken's mergeable_ranks {token bytes: rank}, len == vocab_size.

    text: a string or an iterable of strings (documents; chunks never cross a document boundary).
    """
    assert vocab_size >= 256, "vocab_size must be at least 256 (the single bytes)"
    texts = [text] if isinstance(text, str) else text
    split = regex.compile(pattern)
    chunk_counts = collections.Counter()
    for t in texts:
        chunk_counts.update(split.findall(t))
    # Unique chunks as lists of token ids with their frequencies; sorted so the order is deterministic.
    words = [list(c.encode("utf-8")) for c in sorted(chunk_counts)]
    freqs = [chunk_counts[c] for c in sorted(chunk_counts)]

    vocab = [bytes([i]) for i in range(256)]  # id -> bytes; the id is the rank
    ranks = {b: i for i, b in enumerate(vocab)}
    pair_counts = collections.defaultdict(int)  # (a, b) -> weighted count
    where = collections.defaultdict(set)  # (a, b) -> indices of words that may contain it
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += f
            where[pair].add(wi)
    # Max-heap of (-count, pair) with lazy deletion: an entry is live only if its count is still current.
    # The pair tuple breaks ties, so equal counts always pick the smallest (a, b).
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg or neg == 0:
            continue  # stale entry
        a, b = pair
        merged = vocab[a] + vocab[b]
        # Two different pairs could spell the same bytes (ab+c, a+bc); tiktoken keys tokens by bytes, so a
        # second one would reuse the existing id and cost no rank (never seen on real text; kept for safety).
        new = ranks.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            ranks[merged] = new
        delta = collections.defaultdict(int)
        for wi in sorted(where.pop(pair)):
            w, f = words[wi], freqs[wi]
            out, i, changed = [], 0, False
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                    changed = True
                else:
                    out.append(w[i])
                    i += 1
            if not changed:
                continue  # `where` is a superset: the pair was merged away earlier in this word
            for p in zip(w, w[1:]):
                delta[p] -= f
            for p in zip(out, out[1:]):
                delta[p] += f
                where[p].add(wi)
            words[wi] = out
        for p, d in delta.items():
            if d:
                pair_counts[p] += d
                heapq.heappush(heap, (-pair_counts[p], p))
        pair_counts.pop(pair, None)
    return ranks


# -----------------------------------------------------------------------------
# The Tokenizer: tiktoken does the encoding, we keep the ranks
#
# The result of training is tiktoken's `mergeable_ranks` (token bytes -> rank): tiktoken encodes by
# repeatedly merging the adjacent pair whose concatenation has the lowest rank, which replays our merges in
# order.


class Tokenizer:
    def __init__(self, mergeable_ranks, pattern=SPLIT_PATTERN, special_tokens=CHAT_TOKENS, name="nanoglm"):
        self.mergeable_ranks = dict(mergeable_ranks)
        self.pattern = pattern
        n = len(self.mergeable_ranks)
        if isinstance(special_tokens, dict):  # ids given (a tokenizer.json's), else right after the ranks
            self.special_tokens = dict(special_tokens)
        else:
            self.special_tokens = {s: n + i for i, s in enumerate(special_tokens)}
        self.enc = tiktoken.Encoding(
            name=f"{name}_{n + len(special_tokens)}",
            pat_str=pattern,
            mergeable_ranks=self.mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = self.enc.n_vocab
        self.eot_id = self.special_tokens["<|endoftext|>"]

    def encode(self, text, allowed_special=()):
        """Text -> ids. Special-token strings are plain text unless named in allowed_special ("all" for
        all)."""
        allowed = allowed_special if allowed_special == "all" else set(allowed_special)
        return self.enc.encode(text, allowed_special=allowed, disallowed_special=())

    def encode_ordinary(self, text):
        return self.enc.encode_ordinary(text)

    def encode_ordinary_batch(self, texts, num_threads=8):
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def encode_chat_token(self, name):
        """The id of one special token, e.g. encode_chat_token("<|assistant|>")."""
        if name not in self.special_tokens:
            raise KeyError(
                f"{name!r} is not a special token; the chat tokens are {list(self.special_tokens)}."
            )
        return self.special_tokens[name]

    @property
    def hash(self):
        """A short fingerprint of everything that decides the ids (data.py stores it in its meta)."""
        return hashlib.sha256(self._payload().encode()).hexdigest()[:16]

    # --- persistence: one small JSON file, ranks as base64 in rank order (like tiktoken's .tiktoken files)

    def _payload(self):
        by_rank = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        assert [r for _, r in by_rank] == list(range(len(by_rank))), "ranks must be 0..n-1"
        return json.dumps(
            {
                "format": "nanoglm-bpe-1",
                "pattern": self.pattern,
                "special_tokens": self.special_tokens,  # name -> id
                "ranks": [base64.b64encode(b).decode("ascii") for b, _ in by_rank],
            }
        )

    def save(self, path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(self._payload())
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one

    @classmethod
    def load(cls, path):
        try:
            with open(path) as f:
                d = json.load(f)
            assert d["format"] == "nanoglm-bpe-1"
            ranks = {base64.b64decode(s, validate=True): i for i, s in enumerate(d["ranks"])}
            assert len(ranks) == len(d["ranks"])
            return cls(ranks, pattern=d["pattern"], special_tokens=d["special_tokens"])
        except FileNotFoundError:
            raise FileNotFoundError(
                f"No tokenizer file at {path}; train one with get_tokenizer() or `python tokenizer.py`."
            ) from None
        except Exception as e:
            raise ValueError(
                f"Tokenizer file {path} is corrupt or not ours ({type(e).__name__}); "
                f"delete it and it will be retrained."
            ) from None


# -----------------------------------------------------------------------------
# A published tokenizer.json (GLM-5's own), read into the same wrapper
#
# GLM-5's is byte-level BPE, 154,880 ids. from_tokenizer_json makes the same Tokenizer from it: ranks from its
# merges, special tokens from its added tokens, its own ids; serving a released checkpoint uses it instead of
# ours.


def bytes_to_unicode():
    """GPT-2's table from the 256 bytes to printable characters, which byte-level BPE files spell tokens
    in: printable Latin-1 bytes stand for themselves, the other 68 get the characters from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# GPT-2's pre-tokenizer, what a ByteLevel pre-tokenizer with use_regex=true splits with
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def split_pattern(pre):
    """The regex of a tokenizer.json pre_tokenizer: a Split(Regex) (in a Sequence with a ByteLevel that
    does not split again), or a lone ByteLevel that splits with GPT-2's pattern."""
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits = [p["pattern"]["Regex"] for p in steps if p.get("type") == "Split" and "Regex" in p["pattern"]]
    byte_level = [p for p in steps if p.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or len(splits) + byte_level[0].get("use_regex", True) != 1:
        raise ValueError("expected one Split regex and a ByteLevel step, or a ByteLevel step with use_regex")
    if byte_level[0].get("add_prefix_space"):
        raise ValueError("add_prefix_space is not supported")
    return splits[0] if splits else GPT2_PATTERN


def from_tokenizer_json(path):
    """A Hugging Face tokenizer.json (byte-level BPE: vocab, merges, added tokens) -> our Tokenizer, with the
    file's own ids.

    tiktoken merges the adjacent pair whose result has the lowest rank, and uses the rank as the id; Hugging
    Face merges the pair listed first in `merges`. The two agree when the ids grow in merge order (checked
    here: byte-level BPE trainers assign them that way), so the ranks are the vocab ids of the 256 bytes and
    of each merge's result. Every added token becomes a special token with its own id.
    """
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"No tokenizer.json at {path}.") from None
    try:
        model = d["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"its model is {model.get('type')!r}, not byte-level BPE")
        if d.get("normalizer"):
            raise ValueError("it has a normalizer, which tiktoken does not run")
        pattern = split_pattern(d.get("pre_tokenizer") or {})
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        vocab = model["vocab"]

        def raw(token):
            return bytes(byte_of[c] for c in token)

        ranks = {raw(c): vocab[c] for c in byte_of}  # the 256 single bytes
        last = -1
        for m in model["merges"]:
            a, b = m.split(" ") if isinstance(m, str) else m
            rank = vocab[a + b]
            if rank <= last:
                raise ValueError(f"merge {a!r} + {b!r} has id {rank}, below an earlier merge's")
            ranks[raw(a + b)] = last = rank
        specials = {t["content"]: t["id"] for t in d.get("added_tokens", [])}
        if "<|endoftext|>" not in specials:
            raise ValueError("it has no <|endoftext|> added token")
        return Tokenizer(ranks, pattern=pattern, special_tokens=specials, name="tokenizer_json")
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(
            f"{path} is not a byte-level BPE tokenizer.json this reader supports ({type(e).__name__}: {e})."
        ) from None


# -----------------------------------------------------------------------------
# Train once, cache
#
# get_tokenizer trains once on a sample of the corpus (data.corpus_sample) and caches a small JSON file;
# re-runs load it (and retrain when the special tokens changed).


def vocab_size_argument(ap):
    """The optional VOCAB_SIZE argument of the scripts that build or read the project tokenizer
    (tokenizer.py, sft_data.py, rollout.py) -> ap."""
    what = "the tokenizer's vocab size (default: %(default)s)"
    ap.add_argument("vocab_size", nargs="?", type=int, default=4096, help=what)
    return ap


def get_tokenizer(vocab_size=4096, cache_dir="data", sample_bytes=4_000_000, text=None, verbose=True):
    """The project tokenizer with `vocab_size` ids in total (merges + specials), trained once and cached.

    Trained on about `sample_bytes` of the default corpus (data.py), or on `text` if given.
    """
    path = os.path.join(cache_dir, f"tokenizer_{vocab_size}.json")
    n = vocab_size - len(CHAT_TOKENS)
    want_specials = {s: n + i for i, s in enumerate(CHAT_TOKENS)}
    if os.path.exists(path):
        tok = Tokenizer.load(path)
        assert tok.vocab_size == vocab_size, f"{path} holds {tok.vocab_size} ids, not {vocab_size}"
        if tok.special_tokens == want_specials:
            return tok
        # a cache from before the chat format gained tokens: its merges and ids are stale
        print(f"{path} has other special tokens than tokenizer.CHAT_TOKENS: retraining", file=sys.stderr)
    if text is None:
        text = data.corpus_sample(sample_bytes)
    t0 = time.time()
    tok = Tokenizer(train_bpe(text, n))
    if verbose:
        chars = len(text) if isinstance(text, str) else sum(map(len, text))
        print(
            f"trained BPE: {vocab_size} ids on {chars / 1e6:.1f}M characters in {time.time() - t0:.1f}s "
            f"-> {path}",
            file=sys.stderr,
        )
    tok.save(path)
    return tok


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description="The tokenizer: train our byte-level BPE on a sample of the corpus, print its time, "
        "compression and a round trip, then tokenize the corpus into data/stdlib with it (data.prepare).",
        epilog="example: python tokenizer.py 8192",
    )
    vocab_size = vocab_size_argument(ap).parse_args().vocab_size
    sample = data.corpus_sample(4_000_000)
    n_bytes = sum(len(t.encode()) for t in sample)
    t0 = time.time()
    ranks = train_bpe(sample, vocab_size - len(CHAT_TOKENS))
    dt = time.time() - t0
    tok = Tokenizer(ranks)
    n_tok = sum(len(ids) for ids in tok.encode_ordinary_batch(sample))
    print(
        f"train_bpe: {len(ranks)} ranks + {len(CHAT_TOKENS)} specials = {tok.vocab_size} ids, "
        f"{n_bytes / 1e6:.2f} MB sample, {dt:.1f}s"
    )
    print(f"compression on the training sample: {n_bytes / n_tok:.2f} bytes/token")
    s = "def hello(name):\n    return f'hi {name} 👋'\n"
    ids = tok.encode(s)
    print(f"{len(ids)} tokens: {[tok.decode([i]) for i in ids]}")
    assert tok.decode(ids) == s
    path = os.path.join("data", f"tokenizer_{vocab_size}.json")
    if not os.path.exists(path):
        tok.save(path)  # what get_tokenizer would train: the same sample gives the same merges
    tok = Tokenizer.load(path)  # the cached one, which train.py uses
    t0 = time.time()
    meta = data.prepare(vocab_size, out_dir="data/stdlib", tokenizer=tok)
    print(
        f"{meta['n_files']} files ({meta['n_val_files']} val) -> train {meta['tokens']['train']:,} tokens, "
        f"val {meta['tokens']['val']:,} tokens, vocab {meta['vocab_size']}, in {time.time() - t0:.1f}s "
        f"(tokenizing took {meta['seconds']}s when built)"
    )
