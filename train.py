"""
Training GLM-5 (GLM-5 report, section 2: pre-training, mid-training and the two DSA adaptation stages;
its post-training SFT; DeepSeek-V3.2 report for the indexer's KL stages): pretraining, the two DSA stages
and SFT, with Muon (Muon Split) + AdamW, an MTP loss, aux-loss-free MoE balancing, and checkpoints that
resume exactly. The stages are described at STAGES below, the step, evaluation and parallel plan at the run.

    python train.py configs/toy.py                      # a few-million-parameter GLM-5 on a laptop CPU
    python train.py configs/toy.py --max_iters=20 --batch_size=4
    python train.py configs/toy.py --resume=True        # continue from out_dir/ckpt.pt, exactly
    python train.py configs/toy.py --stage=dsa_warmup --init_from=out/ckpt.pt --out_dir=out_warmup
    python train.py configs/toy.py --stage=dsa_sparse --init_from=out_warmup/ckpt.pt --out_dir=out_sparse
    python train.py configs/toy.py --stage=sft --init_from=out_sparse/ckpt.pt --out_dir=out_sft
    python train.py configs/full.py --dry_run=True      # the 744B plan in seconds
    python train.py configs/full.py --dry_run=True --plan_world_size=256 --expert_parallel=True
    torchrun --standalone --nproc_per_node=2 train.py configs/toy.py --device=cpu [--expert_parallel=True]
Tests: python -m pytest -q tests/test_train.py tests/test_parallel.py

Honest limits: data parallel (FSDP2) and expert parallel over one mesh of all ranks; no tensor, pipeline or
context parallelism, no activation recomputation, no mixed-precision FSDP policy (fp32 weights, bf16
autocast on cuda); tested on 2 CPU processes over gloo, the nccl path is untested. The model is built whole
on every rank and checkpoints hold the whole unsharded state on rank 0: fine up to one host's RAM, not for
the real 744B (parallel.py). Under FSDP, grad_accum > 1 reduce-scatters after every micro-batch (no
no_sync). SFT is single-format (chat.py's template); no RL here. MFU counts 6 x activated parameters per
token (MTP and attention's T^2 left out) against a peak measured at start, not a datasheet number. Exact
resume is tested on CPU in one process (across rank counts: float tolerance; on a GPU: close, not
bit-identical). Checkpoints are this script's own torch.save dict (weights_only=False: load only your own;
the public format is weights.py's safetensors). GLM-5's learning rates, batch sizes and schedule lengths
are not published: the defaults are placeholders.
"""

import ast
import dataclasses
import difflib
import io
import json
import math
import os
import random
import sys
import time
import tokenize
from contextlib import nullcontext

import numpy as np
import torch

import chat
import copy_probe
import data
import model
import muon
import parallel
import sft_data
from tokenizer import get_tokenizer

# -----------------------------------------------------------------------------
# Defaults: plain globals; a configs/*.py file, then --key=value, override them (and the ModelConfig fields)

out_dir = "out"  # checkpoint ckpt.pt and metrics.jsonl go here
stage = "pretrain"  # "pretrain" | "dsa_warmup" | "dsa_sparse" | "sft"
init_from = ""  # a ckpt.pt to take the model weights from (a stage starting from another's result)
from_scratch = False  # let a stage after pretrain start from random weights (no --init_from)
overwrite = False  # let this run replace another stage's ckpt.pt in out_dir
resume = False  # continue from out_dir/ckpt.pt: model, optimizers, step, RNGs, data position
data_dir = "data/stdlib"  # tokenized corpus (data.py), relative to this file's folder
sft_data_dir = "data/sft"  # tokenized SFT conversations and loss masks (sft_data.py), stage "sft"
# a JSONL of more SFT conversations, e.g. solved environment episodes:
# python episodes.py 50 data/sft_envs.jsonl
sft_extra = ""
sft_stdlib = True  # stage sft: include the standard-library conversations (False: sft_extra's only)
tokenizer_vocab_size = 4096  # the BPE the data is tokenized with; must be <= the model's vocab_size
batch_size = 8  # sequences per micro-batch
block_size = 256  # training sequence length
grad_accum = 1  # micro-batches per optimizer step
max_iters = 200  # optimizer steps
eval_interval = 50  # evaluate and checkpoint every this many steps (and at the end)
eval_iters = 10  # val batches per evaluation
log_interval = 1  # print a log line every this many steps
lr_muon = 0.02  # Muon's peak lr (matrices in the blocks)
lr_adamw = 3e-3  # AdamW's peak lr (embeddings, lm_head, router, norms)
weight_decay = 0.1  # decoupled, both optimizers (not on norms and biases)
schedule = "wsd"  # "wsd": warmup, stable, linear decay; "cosine": warmup, cosine decay
warmup_iters = 10  # linear warmup steps
decay_frac = 0.2  # wsd: the last fraction of max_iters decays linearly
min_lr_frac = 0.1  # the lr at the end, as a fraction of the peak
grad_clip = 1.0  # clip the global gradient norm (0: off)
mtp_weight_early = 0.3  # MTP loss weight early in training (GLM-4.5)
mtp_weight_late = 0.1  # ... and after mtp_switch_frac of max_iters
mtp_switch_frac = 0.5
balance_weight = 1e-4  # sequence-level balance loss
bias_update_rate = 1e-3  # aux-loss-free balancing: router bias step per optimizer step
indexer_kl_weight = 1.0  # KL coefficient in dsa_sparse (not published)
seed = 1337  # model init, data order
device = "auto"  # "auto" (cuda > mps > cpu), "cpu", "cuda", "cuda:N", "mps"
dtype = "auto"  # "auto" (bfloat16 on a cuda GPU that has it, else float32), "float32", "bfloat16"
compile = False  # torch.compile the model (on a GPU the Triton kernels then give way to inductor: kernels.py)
expert_parallel = False  # under torchrun: each rank holds n_routed_experts / world experts (all-to-all)
dry_run = False  # print the parameter and memory plan, then exit before allocating anything
plan_world_size = 0  # plan for this many ranks (0: torchrun's WORLD_SIZE, 1 without torchrun)
sample_tokens = 64  # tokens sampled from the prompt at the end (0: none)
sample_prompt = "def "  # for stage "sft" it is the user message, rendered with chat.py's template
copy_frac = 0.0  # pretraining and DSA stages: this fraction of each batch's rows are synthetic copy rows
copy_source = "random"  # copy rows repeat "random" ids, the corpus' copy_top "frequent" ids, or "text"
copy_top = 256  # copy_source "frequent": draw from the corpus' most frequent ids
copy_probe_len = 64  # at each evaluation, the copy probe on random sequences of this length, twice (0: off)

# Stages (`stage`):
# - "pretrain": dsa_mode "dense", everything trains on lm + MTP + balance.
# - "dsa_warmup": dsa_mode "dense", everything frozen except the indexers (`.indexer.` in the name); the loss
#   is the indexer KL only (GLM-5: 1000 steps, lr 5e-3 -> 2e-4).
# - "dsa_sparse": dsa_mode "sparse", everything trains; the model detaches the indexer's inputs, so the
#   indexer learns only from the KL and the rest only from the LM loss.
# - "sft": dsa_mode "sparse" with the indexer KL, as dsa_sparse (GLM-5 post-trains the sparse model), on
#   sft_data.py's conversations: the loss counts only the assistant's own tokens (its thinking, answers, tool
#   calls, end of turn); rows are packed conversations.
#
# The pipeline is pretrain -> dsa_warmup -> dsa_sparse -> sft, each stage --init_from the one before (model
# weights only). A later stage without --init_from, or an out_dir holding another stage's checkpoint, stops
# with one sentence (--from_scratch=True and --overwrite=True allow them).
STAGES = ("pretrain", "dsa_warmup", "dsa_sparse", "sft")  # in pipeline order
STAGE_DIRS = {"pretrain": "out", "dsa_warmup": "out_warmup", "dsa_sparse": "out_sparse", "sft": "out_sft"}
DEFAULTS = {
    k: v
    for k, v in list(globals().items())
    if not k.startswith("_") and k.islower() and isinstance(v, (bool, int, float, str))
}
TRAIN_KEYS = list(DEFAULTS)

# -----------------------------------------------------------------------------
# Config: a configs/*.py file over the defaults, then --key=value over both


def cast_value(key, value, like, where):
    """value, type-checked against the default `like` (an int is accepted where a float is expected)."""
    if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(like):
        raise SystemExit(
            f"{where}: {key} must be {type(like).__name__} like its default {like!r}, got {value!r}"
        )
    return value


def unknown_key(key, where, known):
    hint = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if hint:
        return SystemExit(f"{where}: unknown config key {key!r}; did you mean {hint[0]!r}?")
    return SystemExit(
        f"{where}: unknown config key {key!r}; see the globals at the top of train.py and model.ModelConfig"
    )


def setting_comments(path, keys):
    """{key: the comment beside `key = value` in the source at path, or the comment lines just above it}
    for the module-level settings `keys`: what --help prints beside each default."""
    source = open(path, encoding="utf-8").read()
    comments = {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        name = getattr(node.targets[0], "id", None)
        if name not in keys or name in out:
            continue
        text = comments.get(node.lineno, "")
        if not text:  # the comment block just above the assignment, if any
            above = node.lineno - 1
            block = []
            while above >= 1 and lines[above - 1].lstrip().startswith("#"):
                block.insert(0, comments.get(above, ""))
                above -= 1
            text = " ".join(c for c in block if c)
        out[name] = text
    return out


def print_settings_help(path, doc, defaults, usage, example, more=""):
    """The --help of a script whose settings are its module's globals: usage, its docstring's first
    paragraph, every setting with its default and the comment beside it in the source, an example."""
    print(f"usage: {usage}\n")
    print(doc.strip().split("\n\n")[0] + "\n")
    print("settings (--key=value; a config file's plain assignments set the same keys), default and meaning:")
    comments = setting_comments(path, defaults)
    width = max(len(f"--{k}={v!r}") for k, v in defaults.items())
    for k, v in defaults.items():
        print(f"  {f'--{k}={v!r}':<{width}}  {comments.get(k, '')}".rstrip())
    if more:
        print(f"\n{more}")
    print(f"\nexample: {example}")


def wants_help(argv):
    return any(a in ("-h", "--help") for a in argv)


def resolve_config(argv):
    """argv (without the script name) -> (train settings dict, ModelConfig), or SystemExit with one
    sentence naming the bad key or value. Pure: main() copies the settings into this module's globals."""
    model_defaults = model.ModelConfig()
    model_keys = [f.name for f in dataclasses.fields(model.ModelConfig)]
    known = TRAIN_KEYS + model_keys
    train_cfg = dict(DEFAULTS)
    model_kw = {}
    for arg in argv:
        if not arg.startswith("--"):  # a config file: plain Python assignments
            try:
                file_cfg, rest = model.load_config_file(arg)
            except (ValueError, FileNotFoundError) as e:
                raise SystemExit(str(e))
            for f in dataclasses.fields(file_cfg):
                if getattr(file_cfg, f.name) != getattr(model_defaults, f.name):
                    model_kw[f.name] = getattr(file_cfg, f.name)
            for k, v in rest.items():
                if k not in TRAIN_KEYS:
                    raise unknown_key(k, arg, known)
                train_cfg[k] = cast_value(k, v, DEFAULTS[k], arg)
            continue
        if "=" not in arg:
            raise SystemExit(f"override {arg!r} needs a value: write --key=value")
        k, s = arg[2:].split("=", 1)
        if k not in known:
            raise unknown_key(k, "command line", known)
        try:
            v = ast.literal_eval(s)
        except (ValueError, SyntaxError):
            v = s  # a bare word is a string
        if k in TRAIN_KEYS:
            train_cfg[k] = cast_value(k, v, DEFAULTS[k], "command line")
        else:
            like = model_kw.get(k, getattr(model_defaults, k))
            model_kw[k] = cast_value(k, v, like, "command line")
    stage = train_cfg["stage"]
    if stage not in STAGES:
        raise SystemExit(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    model_kw["dsa_mode"] = "sparse" if stage in ("dsa_sparse", "sft") else "dense"
    try:
        cfg = model.ModelConfig(**model_kw)
    except ValueError as e:
        raise SystemExit(str(e))
    minimum = dict(
        batch_size=1, block_size=2, grad_accum=1, max_iters=1, eval_interval=1, eval_iters=1, log_interval=1
    )
    for k, need in minimum.items():
        if train_cfg[k] < need:
            raise SystemExit(f"{k} must be >= {need}, got {train_cfg[k]}")
    if train_cfg["copy_source"] not in ("random", "frequent", "text"):
        raise SystemExit(
            f"unknown copy_source {train_cfg['copy_source']!r}; choose 'random', 'frequent' or 'text'"
        )
    if not 0.0 <= train_cfg["copy_frac"] <= 1.0:
        raise SystemExit(f"copy_frac must lie in [0, 1], got {train_cfg['copy_frac']}")
    if train_cfg["schedule"] not in ("wsd", "cosine"):
        raise SystemExit(f"unknown schedule {train_cfg['schedule']!r}; choose 'wsd' or 'cosine'")
    if stage == "sft" and not train_cfg["sft_stdlib"] and not train_cfg["sft_extra"]:
        raise SystemExit("stage sft: sft_stdlib=False leaves no data; pass --sft_extra=FILE.jsonl too")
    return train_cfg, cfg


def check_stage_start(stage, out_dir, init_from, resume, from_scratch=False, overwrite=False):
    """Stop with one sentence before a run starts from the wrong weights or writes over another stage's
    checkpoint (a newcomer's `--stage=sft` without --init_from trained from random weights and replaced
    the pretrained out/ckpt.pt). Called before anything is allocated; a dry run skips it."""
    path = os.path.join(out_dir, "ckpt.pt")
    if resume:
        if not os.path.isfile(path):
            raise SystemExit(f"resume: no checkpoint at {path}; train one first, or fix the path")
        return
    i = STAGES.index(stage)
    if i > 0 and not init_from and not from_scratch:
        before = STAGES[i - 1]
        raise SystemExit(
            f"stage {stage} continues from stage {before}: pass --init_from={STAGE_DIRS[before]}/ckpt.pt "
            f"(or wherever {before} saved it), or --from_scratch=True to start from random weights"
        )
    if os.path.isfile(path) and not overwrite:
        found = checkpoint_stage(path)
        if found != stage:
            raise SystemExit(
                f"{path} holds a {found} checkpoint that this {stage} run would replace (and its "
                f"metrics.jsonl); pass --out_dir={STAGE_DIRS[stage]}, or --overwrite=True to replace it"
            )


def checkpoint_stage(path):
    """The stage a train.py checkpoint was written by (its tensors are memory-mapped, not read)."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        return ck["config"]["train"]["stage"]
    except Exception:
        return "unreadable (not train.py's)"


# -----------------------------------------------------------------------------
# Device, dtype and the measured peak


def pick_device(name):
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() else "cpu"
    kind = name.split(":")[0]
    ok = {
        "cpu": True,
        "cuda": torch.cuda.is_available(),
        "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
    }
    if kind not in ok:
        raise SystemExit(f"device {name!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    if not ok[kind]:
        raise SystemExit(
            f"device {name!r} is not available on this machine; use --device=auto or --device=cpu"
        )
    return name


def pick_dtype(name, dev):
    cuda = dev.startswith("cuda")
    if name == "auto":
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        if not (cuda and torch.cuda.is_bf16_supported()):
            raise SystemExit(
                "dtype bfloat16 needs a cuda GPU with bf16 (autocast is used on cuda only); "
                "use --dtype=float32"
            )
        return torch.bfloat16
    raise SystemExit(f"dtype {name!r} is not supported; use auto, float32 or bfloat16")


def sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    elif dev == "mps":
        torch.mps.synchronize()


def measure_peak_flops(dev, dt, n, reps=5):
    """FLOP/s of the fastest of `reps` n x n matmuls (after two untimed) on this device in this dtype: the
    denominator of MFU, here and in bench/bench_train.py."""
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        a @ b
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


# -----------------------------------------------------------------------------
# Schedules


def lr_mult(step):
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if step < warmup_iters:
        return (step + 1) / warmup_iters
    if schedule == "wsd":
        decay_start = max(warmup_iters, int(max_iters * (1 - decay_frac)))
        if step < decay_start:
            return 1.0
        frac = (step - decay_start) / max(1, max_iters - decay_start)
        return 1.0 - (1.0 - min_lr_frac) * frac
    frac = (step - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def mtp_weight_at(step):
    """The MTP loss weight at this step. In dsa_warmup the loss is the indexers' KL alone, so the weight only
    decides whether the MTP block runs: it always does there, so that its indexer warms up with the others
    (a recipe with the MTP loss off early, configs/toy.py's, would otherwise leave it cold)."""
    if stage == "dsa_warmup":
        return max(mtp_weight_early, mtp_weight_late, 0.1)
    return mtp_weight_early if step < mtp_switch_frac * max_iters else mtp_weight_late


# -----------------------------------------------------------------------------
# Checkpoints: one dict, written atomically


def save_checkpoint(ckpt, directory):
    """torch.save to ckpt.pt.tmp, fsync, then rename over ckpt.pt: a crash mid-write leaves the old one."""
    path = os.path.join(directory, "ckpt.pt")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def load_checkpoint(path, what):
    if not os.path.isfile(path):
        raise SystemExit(f"{what}: no checkpoint at {path}; train one first, or fix the path")
    try:
        # our own file: it holds numpy RNG state, which weights_only=True refuses
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise SystemExit(
            f"{what}: {path} could not be read ({type(e).__name__}: {e}); it is not a train.py checkpoint"
        )


def load_model_weights(m, state, path):
    try:
        m.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[1] if len(str(e).splitlines()) > 1 else str(e)
        raise SystemExit(
            f"the weights in {path} do not fit this model config ({first.strip()}); "
            f"use the same model keys as the run that wrote it"
        )


# -----------------------------------------------------------------------------
# The run
#
# One optimizer step:
#
#     batch (torch.Generator = data position) -> GLM5 forward -> lm + w_mtp * mtp + 1e-4 * balance (+ KL)
#         -> backward (x grad_accum) -> clip -> Muon + AdamW step at lr(step) -> update_router_bias
#
# Every evaluation logs the val loss and the copy probe (copy_probe.py): the loss on the second copy of a
# random sequence shown twice against the first, on all ids and on the corpus' 512 most frequent; a model with
# induction heads copies, the toy model after its CPU budget does not (configs/speedrun_stages.py). copy_frac
# > 0 puts synthetic copy rows (copy_probe.copy_rows) in the training batches of the non-SFT stages.
#
# Before allocating anything it prints the parameter and memory plan for the world size (parallel.py) and says
# in one sentence if a rank cannot hold it (a real run stops there, --dry_run=True exits 0). Under torchrun
# (detected from its environment, like nanoGPT's DDP) each block, the MTP block and the root are FSDP2-sharded
# (gloo on CPU, nccl on GPUs); `expert_parallel=True` splits the routed experts across ranks and exchanges
# tokens with all-to-all. Every rank draws the same global batch of world x batch_size windows and keeps its
# rows, so N ranks at batch_size b train on exactly what one process trains on at batch_size N * b.


def plan_run(cfg, world, dev, ptdtype, log):
    """Print the parameter and memory plan per rank (parallel.py, on the meta device, before anything is
    allocated). -> (parameter counts, expert parallel on?, None if a rank holds it, else the sentence
    saying why not and what to do)."""
    plan_world = plan_world_size or world
    if plan_world_size and plan_world_size != world and not dry_run:
        raise SystemExit(
            f"plan_world_size={plan_world_size} is for planning only; add --dry_run=True, or launch "
            f"{plan_world_size} ranks with torchrun and leave plan_world_size at 0"
        )
    ep = expert_parallel and plan_world > 1
    if ep and cfg.n_routed_experts % plan_world:
        raise SystemExit(
            f"expert_parallel needs n_routed_experts ({cfg.n_routed_experts}) divisible by the number "
            f"of ranks ({plan_world}); use a world size that divides it or --expert_parallel=False"
        )
    act_bytes = 2 if ptdtype == torch.bfloat16 else 4
    if dev.startswith("cuda"):
        capacity = torch.cuda.get_device_properties(dev).total_memory
        where = f"{dev} memory"
    else:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_ranks
        where = "host RAM" if local_ranks == 1 else f"host RAM / {local_ranks} local ranks"
    rows, counts = parallel.memory_plan(cfg, plan_world, ep, batch_size, block_size, act_bytes)
    log(parallel.format_plan(cfg, rows, counts, plan_world, ep, capacity, where))
    need = rows[-1][2]
    if need <= capacity:
        return counts, ep, None
    gib = parallel.GiB
    size = f"ranks of {capacity / gib:.0f} GiB each"
    k = parallel.ranks_needed(cfg, ep, batch_size, block_size, act_bytes, capacity, counts)
    k_ep = None
    if not ep:
        k_ep = parallel.ranks_needed(cfg, True, batch_size, block_size, act_bytes, capacity, counts)
    if k:
        how = f"run on at least {k} {size}"
    elif k_ep:
        how = f"run on at least {k_ep} {size} with --expert_parallel=True"
    else:
        how = "no number of ranks of this size holds it (lower batch_size or block_size)"
    verdict = (
        f"this config needs about {need / gib:,.0f} GiB per rank on {plan_world} rank(s) but {where} "
        f"here is {capacity / gib:.0f} GiB; {how}, or use a smaller config"
    )
    return counts, ep, verdict


def main():
    if wants_help(sys.argv[1:]):
        print_settings_help(
            __file__,
            __doc__,
            DEFAULTS,
            "python train.py [configs/NAME.py ...] [--key=value ...]",
            "python train.py configs/toy.py --max_iters=50 --batch_size=4",
            more="model settings: every field of model.ModelConfig (the config.json names, e.g. "
            "--num_hidden_layers=2 --hidden_size=128), set in a config file or as --key=value",
        )
        return
    train_cfg, cfg = resolve_config(sys.argv[1:])
    globals().update(train_cfg)  # nanoGPT style: the settings are this module's globals from here on
    # ---- ranks: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE (one process per device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    distributed = world > 1
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    master = rank == 0
    log = print if master else quiet
    dev = pick_device(device)
    if distributed and dev.startswith("cuda"):
        dev = f"cuda:{local_rank}"
    if distributed and dev == "mps":
        raise SystemExit("torchrun with mps is not supported; use --device=cpu (gloo) or cuda GPUs (nccl)")
    ptdtype = pick_dtype(dtype, dev)
    log(f"train config: {json.dumps(train_cfg)}")
    log(f"model config: {json.dumps(dataclasses.asdict(cfg))}")
    counts, ep, too_big = plan_run(cfg, world, dev, ptdtype, log)
    if dry_run:
        if too_big:
            log(too_big)  # the same verdict as a real run, which would stop here
        return
    if too_big:
        raise SystemExit(f"{too_big} (--dry_run=True prints the plan)")
    check_stage_start(stage, out_dir, init_from, resume, from_scratch, overwrite)
    if not distributed:
        run(train_cfg, cfg, dev, ptdtype, counts, ep, world=1, rank=0)
        return
    torch.distributed.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    try:
        run(train_cfg, cfg, dev, ptdtype, counts, ep, world, rank)
        # Every rank meets here, so none tears its connections down while a peer is still finishing (rank 0
        # prints the sample after the last collective); then each destroys the group before exit, even
        # after an error, instead of leaving gloo's threads to the interpreter's shutdown.
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def quiet(*args, **kwargs):
    """The log of ranks other than 0: only rank 0 prints."""


def run(train_cfg, cfg, dev, ptdtype, counts, ep, world, rank):
    """The run itself, on every rank (the process group is up when world > 1): setup, the data, the model
    and its optimizers, then the loop. Each piece it calls is a function below, in the order it calls
    them."""
    distributed = world > 1
    master = rank == 0
    log = print if master else quiet
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)  # the same on every rank: identical initial weights before sharding
    random.seed(seed)
    np.random.seed(seed)
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = nullcontext()
    if dev.startswith("cuda") and ptdtype != torch.float32:
        autocast = torch.autocast("cuda", dtype=ptdtype)

    # ---- data: the corpus for pretraining and the DSA stages, the chat conversations for SFT
    tok, loader = prepare_data(cfg, master, distributed)
    gen = torch.Generator().manual_seed(seed)  # its state is the data position (the same on every rank)

    probe_pool = None  # the copy probe also runs on the corpus' 512 most frequent ids (not in SFT)
    if copy_probe_len > 0 and stage != "sft":
        probe_pool = copy_probe.frequent_ids(loader, tok.eot_id, 512)
    copy_ids = tok.eot_id  # copy rows draw from every id but the special tokens ...
    if copy_source == "frequent" and stage != "sft":  # ... or from the corpus' most frequent ones
        copy_ids = copy_probe.frequent_ids(loader, tok.eot_id, copy_top)

    def get_batch(split, g):
        return rank_rows(loader, split, g, world, rank, dev, copy_ids)

    # ---- the model and what this stage freezes; then sharding; then the optimizers (they hold the shards)
    config_dump = {"train": train_cfg, "model": dataclasses.asdict(cfg)}
    m, ck = build_model(cfg, config_dump, log)
    n_trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    m = m.to(dev)
    if distributed:
        mesh = torch.distributed.device_mesh.init_device_mesh(dev.split(":")[0], (world,))
        experts = parallel.shard_experts(m) if ep else ()
        parallel.shard_model(m, mesh, ignored=experts)
    trainable = [p for p in m.parameters() if p.requires_grad]
    optimizers = build_optimizers(m)
    log(
        f"parameters: {counts['total']:,} total, {counts['activated']:,} activated per token, "
        f"{n_trainable:,} trainable in stage {stage}"
    )
    step = 0  # finished optimizer steps, so checkpoints sit on step boundaries
    if ck is not None:
        step = restore_training_state(ck, m, optimizers, gen, rank, dev)
        log(f"resumed from {os.path.join(out_dir, 'ckpt.pt')} at step {step}")
        ck = None  # let the checkpoint's tensors go before training
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if master:
        event = {"event": "resume" if resume else "start", "step": step, "world_size": world}
        append_metrics(metrics_path, event, mode="a" if resume else "w")
    raw = m  # the module that holds the weights, for the router bias update, checkpoints and the sample
    if compile:
        m = torch.compile(m)
    peak = measure_peak_flops(dev, ptdtype, 2048 if dev.startswith("cuda") else 1024)  # per device, for MFU
    log(
        f"device {dev} x {world}, dtype {str(ptdtype).replace('torch.', '')}, "
        f"measured matmul peak {peak / 1e12:.3f} TFLOP/s per device"
    )

    # ---- the loop
    tokens_per_step = world * batch_size * block_size * grad_accum
    m.train()
    ema_dt = None
    while step < max_iters:
        t0 = time.perf_counter()
        mult = lr_mult(step)
        mtp_w = mtp_weight_at(step)
        sums = optimizer_step(m, optimizers, trainable, get_batch, gen, mult, mtp_w, autocast, world, dev)
        # aux-loss-free balancing: the loads are summed over ranks inside, so every rank moves its bias copy
        # the same way; the frozen model in dsa_warmup keeps its router bias (rate 0 only resets the loads)
        model.update_router_bias(raw, 0.0 if stage == "dsa_warmup" else bias_update_rate)
        sync(dev)
        dt = time.perf_counter() - t0
        step += 1
        if ema_dt is None or step <= 2:
            ema_dt = dt
        else:
            ema_dt = 0.9 * ema_dt + 0.1 * dt
        if master and (step % log_interval == 0 or step == max_iters):
            tps = tokens_per_step / dt
            mfu = 6 * counts["activated"] * tps / (peak * world)  # nanoGPT's 6N, against the measured peak
            eta = ema_dt * (max_iters - step)
            log_step(metrics_path, step, sums, mult, mtp_w, dt, tps, mfu, eta, dev)
        if step % eval_interval == 0 or step == max_iters:
            val = evaluate(m, get_batch, autocast, world, dev)
            record = {"step": step, "val_lm": val, "tokens": step * tokens_per_step}
            line = f"step {step} | val lm {val:.4f}"
            if copy_probe_len > 0:
                with autocast:
                    probe = copy_probe.copy_probe(m, tok.eot_id, copy_probe_len)
                record["copy"] = probe
                line += (
                    f" | copy probe: loss {probe['first']:.2f} on the first copy, {probe['second']:.2f} on "
                    f"the second, top-1 {100 * probe['acc_second']:.0f}%"
                )
                if probe_pool is not None:
                    with autocast:
                        frequent = copy_probe.copy_probe(m, probe_pool, copy_probe_len)
                    record["copy_frequent"] = frequent
                    line += (
                        f" (top-512 ids: {frequent['first']:.2f}, {frequent['second']:.2f}, "
                        f"{100 * frequent['acc_second']:.0f}%)"
                    )
            log(line, flush=True)
            if master:
                append_metrics(metrics_path, record)
            checkpoint(raw, optimizers, step, gen, config_dump, world, rank, dev)

    # ---- a short sample (every rank decodes the same tokens: the sharded forward needs them all)
    if sample_tokens > 0:
        log(sample(raw, tok, dev, autocast))


# -----------------------------------------------------------------------------
# The pieces of the run, in the order run() calls them


def prepare_data(cfg, master, distributed):
    """-> (tokenizer, loader). Rank 0 tokenizes the corpus, or for SFT renders the conversations (once,
    then cached in the data folder); the other ranks wait for it."""
    here = os.path.dirname(os.path.abspath(__file__))
    ddir = os.path.join(here, data_dir)
    tok = get_tokenizer(tokenizer_vocab_size, cache_dir=os.path.dirname(ddir.rstrip("/")))
    if cfg.vocab_size < tok.vocab_size:
        raise SystemExit(
            f"the model's vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's "
            f"({tok.vocab_size}); raise vocab_size or lower tokenizer_vocab_size"
        )
    sdir = os.path.join(here, sft_data_dir)
    if master and stage != "sft":
        data.prepare(tokenizer_vocab_size, out_dir=ddir, tokenizer=tok)
    elif master:
        try:
            sft_data.prepare_sft(
                tokenizer_vocab_size,
                out_dir=sdir,
                tokenizer=tok,
                extra=sft_extra and os.path.join(here, sft_extra),
                files=None if sft_stdlib else [],
            )
        except (FileNotFoundError, ValueError) as e:  # a missing or malformed sft_extra file
            raise SystemExit(f"stage sft: {e}") from None
    if distributed:
        torch.distributed.barrier()  # rank 0 wrote the data before the others read it
    if stage == "sft":
        return tok, sft_data.SFTLoader(sdir)
    return tok, data.DataLoader(ddir)


def rank_rows(loader, split, g, world, rank, dev, n_ids):
    """This rank's rows of a batch. Every rank draws the same global batch of world x batch_size windows
    and keeps its rows, so N ranks at batch_size b see exactly what one process sees at batch_size N * b.
    In training batches outside SFT, the last copy_frac of the global rows are copy rows
    (copy_probe.copy_rows).
    -> x, y, each (batch_size, block_size) on dev."""
    x, y = loader.get_batch(split, world * batch_size, block_size, generator=g)
    n_copy = round(copy_frac * world * batch_size)
    if split == "train" and stage != "sft" and n_copy > 0:
        text = None
        if copy_source == "text":
            text = torch.cat([x[-n_copy:], y[-n_copy:, -1:]], dim=1)  # the windows the copy rows replace
        cx, cy = copy_probe.copy_rows(n_copy, block_size, n_ids, g, text)
        x = torch.cat([x[: len(x) - n_copy], cx])
        y = torch.cat([y[: len(y) - n_copy], cy])
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    return x[mine].to(dev), y[mine].to(dev)


def build_model(cfg, config_dump, log):
    """The model for this stage: random weights (seeded), or init_from's weights, or on resume the
    checkpoint's; then in dsa_warmup everything but the indexers is frozen. -> (model on the CPU, the
    resume checkpoint or None), its optimizer states and RNGs still to restore."""
    m = model.GLM5(cfg)
    ck = None
    if init_from:
        init = load_checkpoint(init_from, "init_from")
        load_model_weights(m, init["model"], init_from)
        from_stage = init.get("config", {}).get("train", {}).get("stage")
        log(f"model weights from {init_from} (step {init.get('step')}, stage {from_stage})")
        if stage == "sft" and from_stage in ("pretrain", None):
            log(
                "note: SFT attends sparsely through the indexer, which a pretrain checkpoint has not "
                "trained; run dsa_warmup (and dsa_sparse) first for a faithful pipeline"
            )
    if resume:
        ckpt_path = os.path.join(out_dir, "ckpt.pt")
        ck = load_checkpoint(ckpt_path, "resume")
        saved_model = ck["config"]["model"]
        saved_stage = ck["config"]["train"]["stage"]
        if saved_model != config_dump["model"] or saved_stage != stage:
            diff = [k for k in config_dump["model"] if saved_model.get(k) != config_dump["model"][k]]
            raise SystemExit(
                f"resume: {ckpt_path} was written with a different model config or stage "
                f"({', '.join(diff) or 'stage ' + repr(saved_stage)}); use the same settings"
            )
        load_model_weights(m, ck["model"], ckpt_path)
    if stage == "dsa_warmup":  # the dense warm-up of DeepSeek-V3.2, which GLM-5 follows: indexers only
        for n, p in m.named_parameters():
            p.requires_grad_(".indexer." in n)
    return m, ck


def build_optimizers(m):
    """Muon (Muon Split) for the block matrices, AdamW for the rest (muon.py); each parameter group
    remembers its peak lr, which the schedule scales at every step."""
    optimizers = list(muon.build_optimizers(m, lr_muon=lr_muon, lr_adamw=lr_adamw, weight_decay=weight_decay))
    for o in optimizers:
        for grp in o.param_groups:
            grp["peak_lr"] = grp["lr"]
    return optimizers


def restore_training_state(ck, m, optimizers, gen, rank, dev):
    """Resume: the optimizers (by parameter name), every RNG and the data position, from the checkpoint
    the model weights came from. -> the step to continue at."""
    parallel.load_optimizer_states(m, optimizers, [ck["muon"], ck["adamw"]])
    rng = ck["rng"][rank] if rank < len(ck["rng"]) else ck["rng"][0]
    torch.set_rng_state(rng["torch"])
    if dev.startswith("cuda") and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"], dev)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    gen.set_state(ck["data_generator"])
    return ck["step"]


def optimizer_step(m, optimizers, trainable, get_batch, gen, mult, mtp_w, autocast, world, dev):
    """One optimizer step: grad_accum micro-batches, the gradient clipped, Muon + AdamW at mult x their
    peak lr. -> the step's losses, averaged over the micro-batches and the ranks."""
    for o in optimizers:
        for grp in o.param_groups:
            grp["lr"] = grp["peak_lr"] * mult
    kl_on = stage != "pretrain"  # the indexer keeps learning from the KL in every sparse stage
    sums = dict.fromkeys(("loss", "lm", "mtp", "balance", "indexer_kl"), 0.0)
    for _ in range(grad_accum):
        x, y = get_batch("train", gen)
        with autocast:
            _, losses = m(
                x,
                y,
                mtp_weight=mtp_w,
                balance_weight=balance_weight,
                indexer_kl_weight=indexer_kl_weight,
                indexer_kl=kl_on,
            )
        loss = losses["indexer_kl"] if stage == "dsa_warmup" else losses["loss"]
        (loss / grad_accum).backward()  # FSDP: each rank's mean loss; gradients are averaged over ranks
        for k in sums:
            sums[k] += (loss if k == "loss" else losses[k]).item() / grad_accum
    if world > 1:
        sums = parallel.mean_over_ranks(sums, dev)  # equal rows per rank: the mean of means is the mean
    if grad_clip > 0:
        if world > 1:
            parallel.clip_grad_norm_(trainable, grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
    for o in optimizers:
        o.step()
        o.zero_grad(set_to_none=True)
    return sums


def log_step(metrics_path, step, sums, mult, mtp_w, dt, tps, mfu, eta, dev):
    """The step's log line (nanoGPT's, with the parts of the loss, tokens/s, MFU and memory) and its record
    in metrics.jsonl."""
    mem = ""
    if dev.startswith("cuda"):
        mem = f" | mem {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB"
    print(
        f"step {step} | loss {sums['loss']:.4f} (lm {sums['lm']:.4f}, mtp {sums['mtp']:.4f}, "
        f"bal {sums['balance']:.4f}, kl {sums['indexer_kl']:.4f}) | lr {mult * lr_muon:.2e} | "
        f"{tps:,.0f} tok/s | mfu {100 * mfu:.2f}% | {1000 * dt:.0f} ms/step | eta {eta:.0f}s{mem}",
        flush=True,
    )
    record = {
        "step": step,
        **sums,
        "lr_mult": mult,
        "mtp_weight": mtp_w,
        "tokens_per_s": tps,
        "mfu": mfu,
        "ms_per_step": 1000 * dt,
    }
    append_metrics(metrics_path, record)


def append_metrics(path, record, mode="a"):
    """One JSON line in metrics.jsonl (mode "w" starts the file afresh)."""
    with open(path, mode) as f:
        f.write(json.dumps(record) + "\n")


@torch.no_grad()
def evaluate(m, get_batch, autocast, world, dev):
    """The mean next-token loss over eval_iters val batches, the same batches at every evaluation (and on
    every rank count: the global batch is drawn whole)."""
    m.eval()
    g = torch.Generator().manual_seed(seed + 1)
    total = 0.0
    for _ in range(eval_iters):
        x, y = get_batch("val", g)
        with autocast:
            _, losses = m(x, y, mtp_weight=0.0, balance_weight=0.0)
        total += losses["lm"].item()
    m.train()
    val = {"val_lm": total / eval_iters}
    if world > 1:
        val = parallel.mean_over_ranks(val, dev)
    return val["val_lm"]


@torch.no_grad()
def val_loss(m, batches):
    """The mean next-token loss over fixed (x, y) batches, the MTP loss off: evaluate's measure for a model
    outside a training run (bench/bench_quant.py and the workshop run's evaluations compare checkpoints,
    quantized ones included, on the same batches with it)."""
    return sum(m(x, y, mtp_weight=0.0)[1]["lm"].item() for x, y in batches) / len(batches)


def checkpoint(raw, optimizers, step, gen, config_dump, world, rank, dev):
    """One dict, as nanoGPT's: model, optimizers, step, config, and what exact resume needs besides (every
    rank's RNG states, the data position). Every rank takes part in gathering the unsharded state; rank 0
    writes it."""
    model_state, (muon_state, adamw_state) = parallel.full_state(raw, optimizers)
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state(dev) if dev.startswith("cuda") else None,
    }
    if world > 1:
        rngs = [None] * world if rank == 0 else None
        torch.distributed.gather_object(rng, rngs, dst=0)
    else:
        rngs = [rng]
    if rank == 0:
        ckpt = {
            "model": model_state,
            "muon": muon_state,
            "adamw": adamw_state,
            "step": step,
            "data_generator": gen.get_state(),
            "config": config_dump,
            "world_size": world,
            "rng": rngs,
        }
        path = save_checkpoint(ckpt, out_dir)
        print(f"saved checkpoint step {step} -> {path}", flush=True)


def sample(m, tok, dev, autocast):
    """-> a few sampled tokens after sample_prompt, and what this stage's checkpoint is good for. For SFT
    the prompt is a chat turn (the template's generation prompt) and the reply is parsed up to a stop."""
    m.eval()
    if stage == "sft":
        user = [{"role": "user", "content": sample_prompt}]
        prompt = chat.render(user, tok, add_generation_prompt=True)[0]
    else:
        prompt = tok.encode(sample_prompt)
    ids = torch.tensor([prompt], device=dev)  # (1, T)
    with autocast:
        out = m.generate(ids, sample_tokens, temperature=0.8, top_k=50)
    new = [i for i in out[0, len(prompt) :].tolist() if i < tok.vocab_size]
    if stage == "sft":
        thinking = prompt[-1] == tok.encode_chat_token("<think>")  # the prompt opened a thinking block
        reply = json.dumps(chat.parse_reply(new, tok, thinking=thinking), indent=1)
        return f"sample reply to {sample_prompt!r} ({sample_tokens} tokens at most):\n{reply}"
    return (
        f"sample ({sample_tokens} tokens):\n{sample_prompt}{tok.decode(new)}\n"
        f"(a {stage} checkpoint continues text; it does not follow the chat template: to chat with "
        f"serve.py, take the pipeline to stage sft)"
    )


if __name__ == "__main__":
    main()
