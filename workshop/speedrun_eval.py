"""
The workshop run's measurements (speedrun.py's eval stages), each one part run as its own process and written
as one JSON file the report card reads (speedrun_report.py), each described at its section below:

- dsa: the sparse model's val loss against the dense model's on the same held-out batches (the GLM-5
  report's DSA section: the sparse adaptation is nearly lossless), and a passkey probe at long context, the
  report's RULER ablation of DSA against sliding-window attention in miniature.
- quant: checkpoint bytes and val perplexity of BF16, W8A8 and W4A8 with rotation.
- serve: every stage's checkpoint through engine.Engine, the MTP accept length and the prefix-cache hit rate
  of multi-turn rollouts, DP-aware router vs round-robin.

Run it (speedrun.py does, after the stages it reads):
    python workshop/speedrun_eval.py dsa --run_dir runs/cpu --settings '{"probes": 32, "probe_len": 256}' \
        --out r.json
Tests: python -m pytest -q tests/test_speedrun.py

Honest limits: at toy scale every context fits a few index_topk budgets, and a few-million-parameter model
trained for minutes copies little from its context (README: the RL section), so the probe measures a
log-prob gain, not RULER's accuracy; one run, one seed, no error bars; tokens/s here is one batch on a
shared CPU, not bench/bench_serve.py's side-by-side comparison.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

# run as python workshop/speedrun_eval.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import chat
import data
import dsa
import engine
import rollout
import sampling
import sft_data
import weights
from quantize import bytes_per_token
from speedrun import final_ckpt
from tokenizer import get_tokenizer
from train import val_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: data/, bench/
STAGE_CKPTS = [  # (the report's name, the path under the run directory), in pipeline order
    ("pretrain", "pretrain/ckpt.pt"),
    ("dsa_warmup", "dsa_warmup/ckpt.pt"),
    ("dsa_sparse", "dsa_sparse/ckpt.pt"),
    ("sft", "sft/ckpt.pt"),
    ("sft_episodes", "sft_episodes/ckpt.pt"),
    ("rl", "rl/ckpt.pt"),
    ("w4a8_rot", "quantize/w4a8_rot"),
]
CHAT_STAGES = ("sft", "sft_episodes", "rl", "w4a8_rot")
# a toy-level math task as the environment episodes pose it (envs.env_math's wording, rollout.SYSTEM)
CHAT_QUESTION = "Compute 7 - 2. Give the exact answer (an integer or a fraction) in \\boxed{}."


def need(path):
    if not os.path.exists(path):
        raise SystemExit(
            f"speedrun_eval: no {path}; run the stage that writes it first (python workshop/speedrun.py)"
        )
    return path


def val_batches(n, block, dev, seed=0):
    """n held-out batches of 4 x block tokens, the same for every model measured."""
    loader = data.DataLoader(os.path.join(ROOT, "data", "stdlib"))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, y = loader.get_batch("val", 4, block, generator=g)
        out.append((x.to(dev), y.to(dev)))
    return out


def set_dsa_mode(m, mode):
    """Serve a checkpoint with dense or sparse attention: every MLA layer reads the model's one config."""
    m.config.dsa_mode = mode
    return m


# -----------------------------------------------------------------------------
# dsa: sparse vs dense val loss, and the long-context probe
#
# The sparse model's val loss against the dense model's on the same held-out batches (the GLM-5 report's DSA
# section: the sparse adaptation is nearly lossless), and a long-context probe, the report's RULER ablation of
# DSA against sliding-window attention in miniature: a passkey line at the start of a context of held-out
# code, asked for again at its end. The same sparse model scores the answer twice with the same budget of
# index_topk keys per query: once with the indexer's top-k (DSA), once with the last index_topk positions (a
# sliding window, which cannot see the passkey). Reported: the answer's log-prob, greedy accuracy, the
# log-prob gain over a control whose passkey line holds another number (what the model took from the passkey
# at all), and how often the indexer's top-k holds the passkey's positions. Both again with the selection
# scored in int8 (ModelConfig.index_quant, the serving engine's option).


def window_topk(q, w, k_all, last, topk, softmax_scale):
    """A sliding window in dsa.index_topk's place: each query's last min(topk, S) positions, whatever the
    indexer scores. Same signature, shapes and budget as the DSA selection: -> idx, valid (B, T, K)."""
    B, T = q.shape[:2]
    last = last.expand(B, T)
    K = min(topk, k_all.shape[1])
    idx = last[..., None] - torch.arange(K, device=q.device)  # (B, T, K): last, last - 1, ...
    valid = idx >= 0
    return idx.clamp(min=0), valid


class Selection:
    """`with Selection("window"):` swaps dsa.index_topk for the sliding window; "dsa" keeps the indexer.
    Either way the selections of the last forward are kept in .seen, one (idx, valid) per layer call."""

    def __init__(self, kind):
        self.kind = kind
        self.seen = []

    def __enter__(self):
        self.orig = dsa.index_topk
        pick = window_topk if self.kind == "window" else self.orig

        def recorded(*a, **kw):
            idx, valid = pick(*a, **kw)
            self.seen.append((idx, valid))
            return idx, valid

        dsa.index_topk = recorded
        return self

    def __exit__(self, *exc):
        dsa.index_topk = self.orig


def make_probes(tok, n, length, seed=0):
    """n passkey contexts of `length` tokens: "PASSKEY = <number>" first, held-out code in between, and
    "PASSKEY =" again at the end, then the answer. -> [(ids, answer start, answer ids, key positions,
    control ids)], the control the same context with another number in the first line."""
    loader = data.DataLoader(os.path.join(ROOT, "data", "stdlib"))
    g = torch.Generator().manual_seed(seed)
    newline = tok.encode("\n")
    probes = []
    pre = tok.encode("PASSKEY =")
    query = newline + pre
    for _ in range(n):
        value = int(torch.randint(1000, 10000, (1,), generator=g))
        full = tok.encode(f"PASSKEY = {value}")
        assert full[: len(pre)] == pre, "the prefix must tokenize the same with the number after it"
        answer = full[len(pre) :]
        wrong = full
        while wrong == full or len(wrong) != len(full):  # same length: every later token keeps its position
            other = int(torch.randint(1000, 10000, (1,), generator=g))
            wrong = tok.encode(f"PASSKEY = {other}")
        n_fill = length - len(full) - len(newline) - len(query) - len(answer)
        x, _ = loader.get_batch("val", 1, n_fill, generator=g)
        filler = x[0].tolist()
        ids = full + newline + filler + query + answer
        control = wrong + newline + filler + query + answer
        assert len(ids) == len(control) == length
        keys = list(range(len(pre), len(full)))
        probes.append((ids, len(ids) - len(answer), answer, keys, control))
    return probes


@torch.no_grad()
def answer_logprob(m, ids, start, answer, dev):
    """-> (sum of log p(answer token | everything before), True when greedy picks every answer token)."""
    x = torch.tensor([ids], device=dev)
    logp = m(x).float().log_softmax(-1)[0]  # (T, V)
    lp = 0.0
    hit = True
    for k, a in enumerate(answer):
        row = logp[start - 1 + k]
        lp += row[a].item()
        hit = hit and int(row.argmax()) == a
    return lp, hit


def run_probe(m, probes, kind, dev):
    """Mean answer log-prob, accuracy, log-prob gain over the control, and (for DSA) the fraction of
    (layer, passkey token) pairs the indexer's top-k keeps at the query's first answer position."""
    lps, hits, gains, kept = [], [], [], []
    for ids, start, answer, keys, control in probes:
        with Selection(kind) as sel:
            lp, hit = answer_logprob(m, ids, start, answer, dev)
        for idx, valid in sel.seen:
            if idx.shape[1] != len(ids):  # the MTP block's shorter calls are not part of the answer
                continue
            chosen = set(idx[0, start - 1][valid[0, start - 1]].tolist())
            kept.append(sum(k in chosen for k in keys) / len(keys))
        with Selection(kind):
            lp_control, _ = answer_logprob(m, control, start, answer, dev)
        lps.append(lp)
        hits.append(hit)
        gains.append(lp - lp_control)
    n = len(probes)
    return {
        "answer_logprob": sum(lps) / n,
        "accuracy": sum(hits) / n,
        "gain_over_control": sum(gains) / n,
        "passkey_kept": sum(kept) / len(kept) if kept else None,  # None: no selection (dense attention)
    }


def part_dsa(run_dir, s, dev):
    dense = set_dsa_mode(engine.load_model(need(os.path.join(run_dir, "pretrain/ckpt.pt")), dev), "dense")
    warm = set_dsa_mode(engine.load_model(need(os.path.join(run_dir, "dsa_warmup/ckpt.pt")), dev), "sparse")
    sparse = set_dsa_mode(engine.load_model(need(os.path.join(run_dir, "dsa_sparse/ckpt.pt")), dev), "sparse")
    topk = sparse.config.index_topk
    batches = val_batches(s["val_batches"], s["val_block"], dev)
    out = {"index_topk": topk, "val_block": s["val_block"], "val_tokens": sum(x.numel() for x, _ in batches)}
    with torch.no_grad():
        out["val_dense"] = val_loss(dense, batches)
        with Selection("dsa"):
            out["val_warmup_sparse"] = val_loss(warm, batches)
            out["val_sparse"] = val_loss(sparse, batches)
        # the same sparse weights with dense attention: what the top-k selection itself costs
        out["val_sparse_as_dense"] = val_loss(set_dsa_mode(sparse, "dense"), batches)
        set_dsa_mode(sparse, "sparse")
        with Selection("window"):
            out["val_sparse_window"] = val_loss(sparse, batches)
    tok = get_tokenizer(4096, cache_dir=os.path.join(ROOT, "data"), verbose=False)
    probes = make_probes(tok, s["probes"], s["probe_len"])
    out["probe"] = {
        "n": len(probes),
        "length": s["probe_len"],
        "passkey_distance": probes[0][1] - probes[0][3][0],
        # what a window of K keys per layer reaches through the stack, hop by hop (K - 1 back per layer)
        "window_reach": sparse.config.num_hidden_layers * (topk - 1),
        # a selection of K of the answer position's visible keys, drawn at random, holds a key this often
        "kept_by_chance": topk / probes[0][1],
        "dense (pretrain, full attention)": run_probe(dense, probes, "dsa", dev),
        "DSA (sparse model, indexer top-k)": run_probe(sparse, probes, "dsa", dev),
        "window (sparse model, last-k)": run_probe(sparse, probes, "window", dev),
    }
    sparse.config.index_quant = "int8"  # the selection from int8 q and k, as serving can run it
    with torch.no_grad():
        out["val_sparse_int8_index"] = val_loss(sparse, batches)
    out["probe"]["DSA, int8 indexer (sparse model, index_quant)"] = run_probe(sparse, probes, "dsa", dev)
    sparse.config.index_quant = "none"
    return out


# -----------------------------------------------------------------------------
# quant: bytes and perplexity per scheme
#
# Checkpoint bytes and val perplexity of BF16, W8A8 and W4A8 with rotation (train.val_loss and
# quantize.bytes_per_token, as bench/bench_quant.py measures them, on quantize.py's checkpoints from the run).


def dir_bytes(directory):
    return sum(os.path.getsize(os.path.join(directory, f)) for f in weights.open_checkpoint(directory))


def part_quant(run_dir, s, out_path):
    """On the CPU whatever --device says: the quantized checkpoints run kernels_quant's torch reference."""
    import quantized

    src = need(final_ckpt(run_dir))
    bf16 = engine.load_model(src, dtype=torch.bfloat16)
    cfg = bf16.config
    bf16_dir = os.path.join(os.path.dirname(out_path), "bf16")
    weights.save_pretrained(bf16, bf16_dir, dtype=torch.bfloat16)
    batches, text = quant_batches(run_dir, s["quant_batches"], 256)
    rows = {}
    models = [("BF16", bf16.float().eval(), bf16_dir)]
    for scheme in ("w8a8", "w4a8_rot"):
        d = need(os.path.join(run_dir, "quantize", scheme))
        models.append((scheme, quantized.from_pretrained(d, dtype=torch.float32).eval(), d))
    with torch.no_grad():
        for label, m, d in models:
            loss = val_loss(m, batches)
            rows[label] = {
                "bytes": dir_bytes(d),
                "bytes_per_token": bytes_per_token(d, cfg),
                "val_loss": loss,
                "ppl": math.exp(loss),
            }
    for label in rows:
        rows[label]["d_ppl"] = rows[label]["ppl"] / rows["BF16"]["ppl"] - 1
    return {
        "source": os.path.relpath(src, run_dir),
        "val_tokens": sum(int((y != -1).sum()) for _, y in batches),  # the targets scored (SFT masks most)
        "text": text,
        "schemes": rows,
    }


def quant_batches(run_dir, n, block):
    """-> (n batches of 4 x block tokens, what they are). The final policy is measured on the held-out
    conversations of the episodes SFT (assistant tokens only): after that stage it no longer models the
    stdlib's code (its loss there was 10.4, a perplexity of 33,000, where a scheme's change means nothing).
    A run without that stage's data, or with no held-out conversation in it (a tiny run), falls back on the
    stdlib's val split."""
    d = os.path.join(run_dir, "sft_episodes", "data")
    loader = None
    if os.path.isfile(os.path.join(d, "meta.json")):
        loader = sft_data.SFTLoader(d)
    if loader is None or not loader.meta["conversations"]["val"]:
        return val_batches(n, block, "cpu"), "the stdlib's held-out files"
    g = torch.Generator().manual_seed(0)
    batches = [loader.get_batch("val", 4, block, generator=g) for _ in range(n)]
    return batches, "the episodes' held-out conversations, assistant tokens only"


# -----------------------------------------------------------------------------
# serve: every checkpoint through the engine, MTP accept length, prefix-cache hits
#
# Every stage's checkpoint through engine.Engine (greedy tokens/s at one batch, a sample; the chat checkpoints
# answer once in each thinking mode); the MTP accept length (bench/bench_serve.py's part 2 at one draft
# count) and the prefix-cache hit rate of multi-turn rollouts on two serve.py replicas, DP-aware router vs
# round-robin (bench/bench_rl.py's part 2, run as its own process).


def greedy_tps(m, tok, prompts, n_new):
    """tokens/s of one engine batch of every prompt, greedy, n_new tokens each (after a warm-up)."""
    sp = sampling.SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    pages = -(-(len(prompts[0]) + n_new) // 16) * len(prompts) + 8
    eng = engine.Engine(m, tok, num_pages=pages, page_size=16, max_batch=len(prompts), prefix_cache=False)
    eng.generate(prompts[:1], sampling.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    rs = eng.generate(prompts, sp)
    dt = time.perf_counter() - t0
    return len(prompts) * n_new / dt, rs


def chat_replies(m, tok, n_new):
    """One greedy reply to CHAT_QUESTION in each thinking mode -> {mode: {"rendered", "parsed"}}."""
    out = {}
    eng = engine.Engine(m, tok, num_pages=64, page_size=16, max_batch=1, prefix_cache=False)
    for thinking in (True, False):
        messages = [{"role": "system", "content": rollout.SYSTEM}, {"role": "user", "content": CHAT_QUESTION}]
        prompt = chat.render(messages, tok, enable_thinking=thinking, add_generation_prompt=True)[0]
        sp = sampling.SamplingParams(max_tokens=n_new, temperature=0)
        r = eng.generate([prompt], sp)[0]
        opened = prompt[-1] == tok.encode_chat_token("<think>")
        out["thinking on" if thinking else "thinking off"] = {
            "rendered": tok.decode(prompt + r.out),
            "parsed": chat.parse_reply(r.out, tok, thinking=opened),
        }
    return out


def mtp_accept(m, tok, prompts, n_new, drafts):
    """MTP speculative decoding with `drafts` drafted tokens against plain decoding, batch 1, greedy, one
    request after another -> (accept length: tokens appended per verify forward, the bonus token included, as
    the report counts it; wall-clock speedup; outputs identical to plain greedy). bench/bench_serve.py's
    part 2 does the same for 1..4 drafts, with the step costs beside it."""
    greedy = sampling.SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    pages = -(-(len(prompts[0]) + n_new + 8) // 16) + 4

    def run(n):
        eng = engine.Engine(
            m, tok, num_pages=pages, page_size=16, max_batch=1, spec_tokens=n, prefix_cache=False
        )
        eng.generate(prompts[:1], sampling.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        rs = [eng.generate([p], greedy)[0] for p in prompts]
        return rs, time.perf_counter() - t0

    plain, t_plain = run(0)
    rs, t = run(drafts)
    accept = sum(sum(r.accepted) for r in rs) / sum(len(r.accepted) for r in rs)
    return accept, t_plain / t, sum(r.out == p.out for r, p in zip(rs, plain))


def prefix_cache_hits(ckpt, s):
    """bench/bench_rl.py's part 2 on two replicas, as its own process (it starts serve.py replicas and
    registers its environment for its run) -> {"router" / "round-robin": hit rates and prompt tokens}."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench_rl.json")
        cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_rl.py"), "--parts", "cache", "--ckpt", ckpt]
        cmd += ["--cache_replicas", "2", "--groups", str(s["cache_groups"]), "--turns", "2"]
        cmd += ["--max_tokens", str(s["cache_max_tokens"]), "--json", path]
        subprocess.run(cmd, check=True)
        with open(path) as f:
            return json.load(f)["cache"]["2"]


def part_serve(run_dir, s, dev):
    tok = get_tokenizer(4096, cache_dir=os.path.join(ROOT, "data"), verbose=False)
    loader = data.DataLoader(os.path.join(ROOT, "data", "stdlib"))
    g = torch.Generator().manual_seed(0)
    prompts = loader.get_batch("val", s["serve_prompts"], 32, generator=g)[0].tolist()  # held-out windows
    out = {"stages": {}, "batch": len(prompts), "new_tokens": s["new_tokens"]}
    for name, rel in STAGE_CKPTS:
        path = os.path.join(run_dir, rel)
        if not os.path.exists(path):
            continue
        m = engine.load_model(path, device=dev)
        tps, rs = greedy_tps(m, tok, prompts, s["new_tokens"])
        row = {"tokens_per_s": tps, "sample": tok.decode(prompts[0][-12:]) + " |> " + tok.decode(rs[0].out)}
        if name in CHAT_STAGES:
            row["chat"] = chat_replies(m, tok, 2 * s["new_tokens"])
        out["stages"][name] = row
        print(f"{name}: {tps:.1f} tok/s at batch {len(prompts)}", flush=True)
    final = need(final_ckpt(run_dir))
    m = engine.load_model(final, device=dev)
    accept, speedup, same = mtp_accept(m, tok, prompts, s["new_tokens"], s["mtp_drafts"])
    out["mtp"] = {
        "drafts": s["mtp_drafts"],
        "accept_length": accept,
        "speedup": speedup,
        "identical": same,
        "of": len(prompts),
    }
    out["prefix_cache"] = {"replicas": 2, "groups": s["cache_groups"], "rollouts": 4 * s["cache_groups"]}
    out["prefix_cache"].update(prefix_cache_hits(final, s))
    return out


# -----------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description="the workshop run's measurements, one part per process")
    ap.add_argument("part", choices=["dsa", "quant", "serve"])
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--settings", default="{}", help="JSON: speedrun.py's eval table")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    a = ap.parse_args(argv)
    s = json.loads(a.settings)
    run_dir = os.path.abspath(a.run_dir)
    t0 = time.time()
    torch.manual_seed(0)
    if a.part == "dsa":
        result = part_dsa(run_dir, s, a.device)
    elif a.part == "quant":
        result = part_quant(run_dir, s, a.out)
    else:
        result = part_serve(run_dir, s, a.device)
    result["wall_s"] = time.time() - t0
    result["load"] = os.getloadavg()
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, a.out)
    print(json.dumps(result, indent=1)[:4000])


if __name__ == "__main__":
    main()
