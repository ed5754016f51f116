"""
The workshop run's report card: runs/<run>/report.md and its plots, rewritten by speedrun.py after every
stage from what the run directory holds (each stage's done.json, metrics.jsonl, log.txt, and the eval
stages' result.json). Each section sets our number beside the GLM-5 report's own figure for that stage
(GLM-5 report, arXiv 2602.15763, cited by section); a stage not run yet says so.

Plots (PNG beside the report: every train stage's loss curve, the RL reward curve, DSA against dense) need
matplotlib, an optional dependency imported here only; without it the report says "plots skipped".

Run it: python workshop/speedrun.py --report_only [--run NAME]    (rewrites runs/NAME/report.md)
Tests: python -m pytest -q tests/test_speedrun.py
Honest limits: the tokens of a train stage are its steps x batch x block x grad_accum from the settings the
stage logged (SFT rows are packed conversations, so some are padding); the report quotes the samples the
stages printed, it does not sample again.
"""

import json
import os
import platform

# train.py's, in pipeline order (sft_episodes is its SFT stage again, on the environment episodes alone)
TRAIN_STAGES = ("copy_warmup", "pretrain", "dsa_warmup", "dsa_sparse", "sft", "sft_episodes")
GLM5 = "GLM-5 report (arXiv 2602.15763)"
FIGURES = {  # what the report says for each stage, cited by section
    "pretrain": f"{GLM5}, pre-training section: 28.5T tokens of pre-training (no loss value published)",
    "dsa": (
        f"{GLM5}, DSA section: a dense warm-up of the indexer alone (1000 steps, lr 5e-3 -> 2e-4, as "
        "DeepSeek-V3.2), then a sparse stage of 20B tokens; DSA keeps long-context quality (nearly lossless "
        "against dense attention), where sliding-window attention of the same budget lost about 30 points on "
        "RULER at 128K in its ablation"
    ),
    "sft": (
        f"{GLM5}, post-training section: SFT on chat, reasoning and agentic data in the three thinking "
        "modes (interleaved, preserved, turn-level thinking); no loss value published"
    ),
    "rl": (
        f"{GLM5}, its asynchronous agentic RL: rollouts decoupled from the trainer, trajectories more "
        "than tau "
        "versions stale dropped, tokens outside the importance-sampling band masked (direct double-sided "
        "importance sampling); results are given as benchmark scores, not per-task rewards"
    ),
    "quant": (
        f"{GLM5}, deployment section: W4A8 (INT4 experts, W8A8 elsewhere) with rotation against activation "
        "outliers; for scale, QuaRot (arXiv 2404.00456) reports 4-bit weights costing a few percent of "
        "perplexity on 7B models"
    ),
    "serve": (
        f"{GLM5}, MTP section: accept length 2.76 with 4 speculative steps (2.55 for DeepSeek-V3.2); RL "
        "infrastructure section: DP-aware routing pins a rollout to one replica so its turns reuse the "
        "prefix cache"
    ),
}


# -----------------------------------------------------------------------------
# Reading the run directory


def finished(run_dir, name):
    """A stage finished when speedrun.py wrote its done.json."""
    return os.path.isfile(os.path.join(run_dir, name, "done.json"))


def read_json(path):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_metrics(path):
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
    return out


def read_log(path):
    if not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def logged_train_config(log):
    """train.py's 'train config: {...}' line, the last one in the log (a resumed stage logs it again)."""
    cfg = {}
    for line in log.splitlines():
        if line.startswith("train config: "):
            cfg = json.loads(line[len("train config: ") :])
    return cfg


def pretrain_sample(log):
    """The text train.py sampled at the end of pretraining, or None."""
    if "sample (" not in log:
        return None
    text = log[log.rindex("sample (") :].split("\n", 1)[1]
    return text.split("\n(a pretrain checkpoint")[0].strip("\n")


def train_summary(run_dir, name):
    """-> {"steps", "tokens", "last" (the last step's record), "val" (last val_lm), "curve", "val_curve"}."""
    d = os.path.join(run_dir, name)
    recs = read_metrics(os.path.join(d, "metrics.jsonl"))
    steps = [r for r in recs if "loss" in r]
    vals = [r for r in recs if "val_lm" in r]
    cfg = logged_train_config(read_log(os.path.join(d, "log.txt")))
    n = steps[-1]["step"] if steps else 0
    per_step = cfg.get("batch_size", 0) * cfg.get("block_size", 0) * cfg.get("grad_accum", 1)
    return {
        "steps": n,
        "tokens": n * per_step,
        "last": steps[-1] if steps else {},
        "val": vals[-1]["val_lm"] if vals else None,
        "curve": [(r["step"], r["lm"], r.get("indexer_kl", 0.0)) for r in steps],
        "val_curve": [(r["step"], r["val_lm"]) for r in vals],
        "tokens_per_s": sum(r["tokens_per_s"] for r in steps) / len(steps) if steps else 0.0,
    }


def last_copy_probe(run_dir, name):
    """train.py's last copy probe of a stage ({"first", "second", "acc_second"}), or None."""
    recs = [r for r in read_metrics(os.path.join(run_dir, name, "metrics.jsonl")) if "copy" in r]
    return recs[-1]["copy"] if recs and finished(run_dir, name) else None


def rl_summary(run_dir):
    recs = read_metrics(os.path.join(run_dir, "rl", "metrics.jsonl"))
    evals = [r for r in recs if "heldout_reward" in r]
    steps = [r for r in recs if r.get("trained") is not None or "reward" in r]
    hist = {}
    for r in steps:
        for k, v in (r.get("staleness") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + v
    trajectories = sum(hist.values())
    return {
        "before": evals[0] if evals else None,
        "after": evals[-1] if len(evals) > 1 else None,
        "steps": len(steps),
        "tokens": sum(r.get("tokens", 0) for r in steps),
        "masked_frac": sum(r.get("masked_frac", 0.0) for r in steps) / max(len(steps), 1),
        "stale_frac": sum(v for k, v in hist.items() if k > 0) / max(trajectories, 1),
        "staleness": dict(sorted(hist.items())),
        "dropped_stale": sum(r.get("stale", 0) for r in steps),
        "reward_curve": [(r["step"], r["reward"]) for r in steps if "reward" in r],
        "eval_curve": [(r["step"], r["heldout_reward"]) for r in evals],
    }


# -----------------------------------------------------------------------------
# Writing it


def fmt(x, spec=".4f"):
    return "n/a" if x is None else format(x, spec)


def skipped(name, failed):
    if failed == name:
        return f"stage {name} failed: see {name}/log.txt (this section has no number yet)\n"
    return f"stage {name} not run yet (skipped): no number yet\n"


def section_pretrain(run_dir, failed):
    out = ["## Pretraining (dense; after the copy warm-up)\n"]
    if not finished(run_dir, "pretrain"):
        return out + [skipped("pretrain", failed)]
    s = train_summary(run_dir, "pretrain")
    out.append(
        f"- ours: {s['steps']} steps, {s['tokens']:,} tokens at {s['tokens_per_s']:,.0f} tokens/s; "
        f"final train lm loss {fmt(s['last'].get('lm'))}, MTP loss {fmt(s['last'].get('mtp'))}; "
        f"val loss **{fmt(s['val'])}**\n"
    )
    for name in ("copy_warmup", "pretrain"):
        probe = last_copy_probe(run_dir, name)
        if probe:
            out.append(
                f"- copy probe after {name} (train.py: 64 random ids, then the same 64 again): top-1 "
                f"**{probe['acc_second']:.0%}** on the second copy, {probe['second']:.2f} nats against "
                f"{probe['first']:.2f} on the first\n"
            )
    out.append(f"- GLM-5: {FIGURES['pretrain']}\n")
    sample = pretrain_sample(read_log(os.path.join(run_dir, "pretrain", "log.txt")))
    if sample:
        out.append(f"\nA sample (train.py's, temperature 0.8):\n\n```python\n{sample}\n```\n")
    return out


def section_dsa(run_dir, failed):
    out = ["## DSA: warm-up, sparse stage, long-context probe\n"]
    if not finished(run_dir, "dsa_warmup"):
        return out + [skipped("dsa_warmup", failed)]
    w = train_summary(run_dir, "dsa_warmup")
    first = w["curve"][0][2] if w["curve"] else None
    out.append(
        f"- warm-up: {w['steps']} steps, {w['tokens']:,} tokens; indexer KL {fmt(first)} at step 1 -> "
        f"**{fmt(w['last'].get('indexer_kl'))}** at the end (the indexer alone learns; the model is frozen)\n"
    )
    sparse_steps = 0
    if finished(run_dir, "dsa_sparse"):
        s = train_summary(run_dir, "dsa_sparse")
        sparse_steps = s["steps"]
        out.append(
            f"- sparse stage: {s['steps']} steps, {s['tokens']:,} tokens; "
            f"final train lm {fmt(s['last'].get('lm'))}, "
            f"indexer KL {fmt(s['last'].get('indexer_kl'))}, val loss {fmt(s['val'])}\n"
        )
    else:
        out.append(skipped("dsa_sparse", failed))
    r = read_json(os.path.join(run_dir, "eval_dsa", "result.json"))
    if r is None:
        out.append(skipped("eval_dsa", failed))
    else:
        k = r["index_topk"]
        out.append(
            f"- the same {r['val_tokens']:,} held-out tokens (windows of {r['val_block']}, "
            f"index_topk {k}): dense "
            f"(pretrain) **{r['val_dense']:.4f}**; the warm-up model attending sparsely "
            f"{r['val_warmup_sparse']:.4f}; the sparse model **{r['val_sparse']:.4f}** "
            f"({r['val_sparse'] - r['val_dense']:+.4f} vs dense, after {sparse_steps} more steps "
            f"of training; the same sparse weights with dense attention {r['val_sparse_as_dense']:.4f}, "
            f"so the "
            f"top-k selection itself costs {r['val_sparse'] - r['val_sparse_as_dense']:+.4f}); "
            f"the sparse model with a {k}-token sliding window "
            f"in place of top-k {r['val_sparse_window']:.4f}"
        )
        if "val_sparse_int8_index" in r:  # runs before the int8 indexer lack it
            out.append(
                f"; the sparse model selecting from int8 index scores (index_quant, the CPU's analogue of "
                f"DeepSeek-V3.2's FP8 indexer) {r['val_sparse_int8_index']:.4f}"
            )
        out.append("\n")
        p = r["probe"]
        reach = "cannot see the passkey at all"
        if p["window_reach"] >= p["passkey_distance"]:
            reach = "could reach the passkey only hop by hop"
        out.append(
            f"\nLong-context probe: {p['n']} contexts of {p['length']} tokens, a `PASSKEY = <4 digits>` line "
            f"first, asked for again {p['passkey_distance']} tokens later; each query keeps {k} keys (a "
            f"window reaches {p['window_reach']} tokens back through the layers, so it {reach}). "
            "gain: the answer's log-prob minus that of a control whose first line holds another number (what "
            "the model took from the passkey); kept: how often the selection at the answer holds the "
            f"passkey's tokens, in every layer (a random choice of {k} keys: {p['kept_by_chance']:.0%}).\n\n"
            "| model, selection | answer log-prob | accuracy | gain over control | passkey kept |\n"
            "|---|---|---|---|---|\n"
        )
        for label, v in p.items():
            if isinstance(v, dict):
                kept = "all (no selection)" if v["passkey_kept"] is None else f"{v['passkey_kept']:.0%}"
                out.append(
                    f"| {label} | {v['answer_logprob']:.3f} | {v['accuracy']:.0%} | "
                    f"{v['gain_over_control']:+.3f} | {kept} |\n"
                )
    out.append(f"\n- GLM-5: {FIGURES['dsa']}\n")
    return out


def section_sft(run_dir, failed):
    out = ["## SFT (stdlib conversations + environment episodes)\n"]
    if not finished(run_dir, "sft"):
        return out + [skipped("sft", failed)]
    s = train_summary(run_dir, "sft")
    eps = os.path.join(run_dir, "episodes", "episodes.jsonl")
    n_eps = 0
    if os.path.isfile(eps):
        with open(eps) as f:
            n_eps = sum(1 for _ in f)
    out.append(
        f"- ours: {s['steps']} steps, {s['tokens']:,} tokens (with {n_eps} solved environment episodes); "
        f"final train loss {fmt(s['last'].get('lm'))}; "
        f"masked val loss **{fmt(s['val'])}** (assistant tokens only)\n"
    )
    if finished(run_dir, "sft_episodes"):
        e = train_summary(run_dir, "sft_episodes")
        out.append(
            f"- then on the episodes alone (the policy the RL stage starts from): {e['steps']} steps, "
            f"{e['tokens']:,} tokens; final train loss {fmt(e['last'].get('lm'))}; masked val loss "
            f"**{fmt(e['val'])}**\n"
        )
    out.append(f"- GLM-5: {FIGURES['sft']}\n")
    serve = read_json(os.path.join(run_dir, "eval_serve", "result.json"))
    shown = False
    for stage, who in (("sft", "The SFT model"), ("sft_episodes", "After the episodes alone, the model")):
        chat = serve and serve["stages"].get(stage, {}).get("chat")
        for mode, reply in (chat or {}).items():
            shown = True
            out.append(f"\n{who}, {mode} (greedy, through the engine):\n\n```\n{reply['rendered']}\n```\n")
    if not shown:
        out.append("\n(replies in each thinking mode come with the eval_serve stage: not run yet)\n")
    return out


def section_rl(run_dir, failed):
    out = ["## RL (rl_async.py, asynchronous, toy-level tasks)\n"]
    if not finished(run_dir, "rl"):
        return out + [skipped("rl", failed)]
    s = rl_summary(run_dir)
    out.append(
        f"- ours: {s['steps']} trainer steps, {s['tokens']:,} trained tokens; masked-token fraction "
        f"**{s['masked_frac']:.2%}**; trajectories sampled by an older policy **{s['stale_frac']:.0%}** "
        f"(staleness histogram {s['staleness']}), {s['dropped_stale']} dropped as too stale\n"
    )
    if s["before"] and s["after"]:
        out.append("\n| task (held-out seeds) | reward before | reward after |\n|---|---|---|\n")
        for task, before in s["before"]["heldout_reward"].items():
            after = s["after"]["heldout_reward"].get(task)
            out.append(f"| {task} | {before:.3f} | {fmt(after, '.3f')} |\n")
    out.append(f"\n- GLM-5: {FIGURES['rl']}\n")
    serve = read_json(os.path.join(run_dir, "eval_serve", "result.json"))
    chat = serve and serve["stages"].get("rl", {}).get("chat")
    if chat:
        reply = json.dumps(chat["thinking on"]["parsed"], ensure_ascii=False)
        out.append(
            f"\nThe RL model's reply to the same question, thinking on, parsed (chat.parse_reply):\n\n"
            f"```json\n{reply}\n```\n"
        )
    return out


def section_quant(run_dir, failed):
    out = ["## Quantization\n"]
    r = read_json(os.path.join(run_dir, "eval_quant", "result.json"))
    if r is None:
        if finished(run_dir, "quantize"):
            return out + [skipped("eval_quant", failed)]
        return out + [skipped("quantize", failed)]
    out.append(
        f"Of {r['source']}, on {r['val_tokens']:,} held-out tokens ({r.get('text', 'stdlib')}):\n\n"
        "| scheme | bytes on disk | weight bytes per token | val loss | ppl | d ppl vs BF16 |\n"
        "|---|---|---|---|---|---|\n"
    )
    for label, v in r["schemes"].items():
        out.append(
            f"| {label} | {v['bytes'] / 2**20:.2f} MiB | {v['bytes_per_token'] / 2**20:.2f} MiB | "
            f"{v['val_loss']:.4f} | {v['ppl']:.3f} | {100 * v['d_ppl']:+.2f}% |\n"
        )
    w4 = r["schemes"]["w4a8_rot"]
    bf16 = r["schemes"]["BF16"]
    out.append(
        f"\nW4A8 with rotation: **{100 * w4['d_ppl']:+.2f}%** perplexity against BF16, "
        f"{w4['bytes'] / bf16['bytes']:.2f}x its bytes on disk, "
        f"{w4['bytes_per_token'] / bf16['bytes_per_token']:.2f}x its weight bytes per token.\n"
    )
    out.append(
        "\nbytes per token: the weights one decoded token reads (the active experts only). The rotated "
        "checkpoint also holds the MTP block's own head (quantize.py says why), so it can be larger on disk "
        "than W8A8 at this size, where the experts are a small part of the model.\n"
    )
    out.append(f"\n- GLM-5: {FIGURES['quant']}\n")
    return out


def section_serve(run_dir, failed):
    out = ["## Serving (engine.py, every checkpoint)\n"]
    r = read_json(os.path.join(run_dir, "eval_serve", "result.json"))
    if r is None:
        return out + [skipped("eval_serve", failed)]
    out.append(
        f"Greedy, one engine batch of {r['batch']} prompts x {r['new_tokens']} tokens:\n\n"
        "| checkpoint | tokens/s | sample (prompt's tail \\|> continuation) |\n|---|---|---|\n"
    )
    for name, v in r["stages"].items():
        sample = v["sample"].replace("\n", "\\n").replace("|", "\\|")[:120]
        out.append(f"| {name} | {v['tokens_per_s']:.1f} | `{sample}` |\n")
    out.append(
        "\n(w4a8_rot runs kernels_quant's CPU reference here: slower than BF16 on a CPU. The saving is "
        "memory, not time: on an H100 the Triton W4A8 kernels were slower than a bf16 matmul too, at every "
        "shape timed (README: Benchmarks).)\n"
    )
    m = r["mtp"]
    out.append(
        f"\n- MTP speculative decoding with {m['drafts']} drafts: "
        f"accept length **{m['accept_length']:.2f}**, {m['speedup']:.2f}x plain decoding on this CPU, "
        f"{m['identical']}/{m['of']} outputs identical to greedy\n"
    )
    c = r["prefix_cache"]
    if c["router"].get("turns", 2) < 2:
        out.append(
            "- (no rollout below reached a second turn: the model ended every episode in its first reply, "
            "so only the shared system prompt could hit the cache)\n"
        )
    out.append(
        f"- prefix cache, {c['rollouts']} multi-turn rollouts on {c['replicas']} replicas: hit rate "
        f"**{c['router']['hit_rate']:.1%}** with the DP-aware router vs {c['round-robin']['hit_rate']:.1%} "
        f"round-robin (later turns {c['router']['later_turns']:.1%} "
        f"vs {c['round-robin']['later_turns']:.1%})\n"
    )
    out.append(f"- GLM-5: {FIGURES['serve']}\n")
    return out


def stage_table(run_dir, stages, failed):
    """One row per stage of `stages` (speedrun.py's names, in order): wall time, tokens, losses, status."""
    rows = ["| stage | wall time | tokens | final losses | status |\n|---|---|---|---|---|\n"]
    total = 0.0
    for name in stages:
        done = read_json(os.path.join(run_dir, name, "done.json"))
        tokens = ""
        losses = ""
        if name in TRAIN_STAGES and done:
            s = train_summary(run_dir, name)
            tokens = f"{s['tokens']:,}"
            losses = f"lm {fmt(s['last'].get('lm'))}, val {fmt(s['val'])}"
            if name == "copy_warmup":  # its val loss on code means nothing: its figure is the copy probe
                probe = last_copy_probe(run_dir, name) or {}
                losses = f"lm {fmt(s['last'].get('lm'))}, copy top-1 {fmt(probe.get('acc_second'), '.0%')}"
            elif name != "pretrain":
                losses += f", kl {fmt(s['last'].get('indexer_kl'))}"
        if name == "rl" and done:
            s = rl_summary(run_dir)
            tokens = f"{s['tokens']:,}"
            losses = f"reward (last step) {s['reward_curve'][-1][1]:.3f}" if s["reward_curve"] else ""
        status = "not run"
        if done:
            status = "done"
        elif failed == name:
            status = "FAILED"
        wall = ""
        if done:
            wall = f"{done['wall_s']:.0f}s"
            total += done["wall_s"]
        rows.append(f"| {name} | {wall} | {tokens} | {losses} | {status} |\n")
    rows.append(f"| total | {total / 60:.1f} min | | | |\n")
    return rows


def write_report(run_dir, stages, args, failed=None):
    """Write run_dir/report.md and the plots from what the run directory holds. stages: speedrun.py's stage
    names in order; args: its command-line settings; failed: the stage that failed, if one did."""
    plots = draw_plots(run_dir)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"# nanoGLM workshop run: {os.path.basename(run_dir)}\n\n",
        f"`python workshop/speedrun.py --preset {args.get('preset')} --config {args.get('config')} --device "
        f"{args.get('device')}{''.join(' --set ' + x for x in args.get('set') or [])}` on "
        f"{platform.machine()}, {os.cpu_count()} cores, load average {load} when this was written.",
        f" **Stopped: stage {failed} failed.**\n\n" if failed else "\n\n",
    ]
    lines += stage_table(run_dir, stages, failed)
    lines.append("\n")
    for section in (section_pretrain, section_dsa, section_sft, section_rl, section_quant, section_serve):
        lines += section(run_dir, failed)
        lines.append("\n")
    lines.append("## Plots\n")
    if isinstance(plots, str):
        lines.append(plots + "\n")
    else:
        for p in plots:
            lines.append(f"![{p}]({p})\n")
    tmp = os.path.join(run_dir, "report.md.tmp")
    with open(tmp, "w") as f:
        f.write("".join(lines))
    os.replace(tmp, os.path.join(run_dir, "report.md"))


# -----------------------------------------------------------------------------
# Plots (matplotlib, optional)


def draw_plots(run_dir):
    """-> the PNG names written beside the report, or a sentence saying why there are none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib not installed (pip install matplotlib)"
    written = []
    stages = [n for n in TRAIN_STAGES if os.path.isdir(os.path.join(run_dir, n))]
    if stages:
        fig, axes = plt.subplots(1, len(stages), figsize=(4 * len(stages), 3.2), squeeze=False)
        for ax, name in zip(axes[0], stages):
            s = train_summary(run_dir, name)
            key = 2 if name == "dsa_warmup" else 1  # the warm-up trains on the KL alone
            ax.plot([c[0] for c in s["curve"]], [c[key] for c in s["curve"]], label="train")
            if s["val_curve"] and key == 1 and name != "copy_warmup":  # code val after copy rows only
                ax.plot(*zip(*s["val_curve"]), "o-", label="val")
            ax.set_title(f"{name}: {'indexer KL' if key == 2 else 'lm loss'}")
            ax.set_xlabel("step")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(run_dir, "loss_curves.png"), dpi=90)
        plt.close(fig)
        written.append("loss_curves.png")
    rl = rl_summary(run_dir)
    if rl["reward_curve"]:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(*zip(*rl["reward_curve"]), label="training groups")
        tasks = rl["eval_curve"][0][1].keys() if rl["eval_curve"] else []
        for task in tasks:
            ax.plot(
                [e[0] for e in rl["eval_curve"]],
                [e[1][task] for e in rl["eval_curve"]],
                "o--",
                label=f"held-out {task}",
            )
        ax.set_xlabel("trainer step")
        ax.set_ylabel("reward")
        ax.set_title("RL reward")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")  # beside the curves
        fig.tight_layout()
        fig.savefig(os.path.join(run_dir, "rl_reward.png"), dpi=90)
        plt.close(fig)
        written.append("rl_reward.png")
    r = read_json(os.path.join(run_dir, "eval_dsa", "result.json"))
    if r:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4))
        labels = ["dense\n(pretrain)", "warm-up\nsparse", "sparse model\ndense attn", "DSA", "window"]
        vals = [r["val_dense"], r["val_warmup_sparse"], r["val_sparse_as_dense"], r["val_sparse"]]
        vals.append(r["val_sparse_window"])
        a1.bar(labels, vals, color=["grey", "tab:orange", "silver", "tab:blue", "tab:red"])
        a1.set_ylim(min(vals) - 0.1, max(vals) + 0.05)
        a1.set_title("held-out loss, same tokens")
        probe = {k.split(" (")[0]: v for k, v in r["probe"].items() if isinstance(v, dict)}  # "DSA, int8 ..."
        a2.bar(
            [label.replace(", ", "\n") for label in probe],
            [v["gain_over_control"] for v in probe.values()],
            color=["grey", "tab:blue", "tab:red", "tab:cyan"][: len(probe)],
        )
        a2.set_title("passkey probe: log-prob gain over control")
        fig.tight_layout()
        fig.savefig(os.path.join(run_dir, "dsa_vs_dense.png"), dpi=90)
        plt.close(fig)
        written.append("dsa_vs_dense.png")
    return written
