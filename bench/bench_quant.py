"""
What W4A8 costs and buys on the trained toy model (GLM-5 report, arXiv 2602.15763, its deployment section),
all in one run, side by side: checkpoint bytes per scheme; val loss and perplexity of BF16, W8A8, W4A8 without
rotation, W4A8 with QuaRot and group-wise W4A8; greedy agreement with BF16 over a fixed prompt set; decode
tokens/s and the weight bandwidth it implies (gpt-fast's GB/s: the bytes of the weights one token reads,
times tokens/s), quantized vs BF16.

    python bench/bench_quant.py                      # out_sparse/ckpt.pt (else out/ckpt.pt), this CPU
    python bench/bench_quant.py --ckpt out/ckpt.pt --group_size 32 --batches 8 --new_tokens 32

For scale: 4-bit round-to-nearest usually costs a few percent of perplexity on small models (QuaRot,
arXiv 2404.00456, tables 1 and 9); much more means a packing or scale bug.

Honest limits: the toy model has no outlier channels to speak of (the calibration table of quantize.py
shows kurtosis near a Gaussian's 3), so rotation has little to remove here; on a CPU the quantized matmuls
run kernels_quant's torch reference (unpack the INT4 words, quantize the activations, torch._int_mm), so
quantized decoding is slower than BF16 here, not faster. This script does not run kernels_quant's Triton
kernels (it times the CPU); on an H100 those were slower than a bf16 matmul as well, at every shape
bench_kernels.py times but one (README: Benchmarks), so the saving is memory. Decode timing is
batch 1, greedy, the model's own KV cache (model.generate), one run.
"""

import argparse
import math
import os
import platform
import subprocess
import sys
import time

import torch

# run as python bench/bench_quant.py: the project's modules are in the folder above
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data
import engine
import quantize
import quantized
import weights
from quantize import bytes_per_token
from train import val_loss

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument(
    "--ckpt", default=None, help="train.py checkpoint (default out_sparse/ckpt.pt, else out/ckpt.pt)"
)
ap.add_argument("--data_dir", default="data/stdlib")
ap.add_argument("--group_size", type=int, default=32, help="the group-wise row (the toy's 64-wide experts)")
ap.add_argument("--batches", type=int, default=8, help="val batches of 4 x 256 tokens")
ap.add_argument("--prompts", type=int, default=8, help="greedy prompts (val windows of 32 tokens)")
ap.add_argument("--new_tokens", type=int, default=32)
ap.add_argument("--out", default="/tmp/bench_quant", help="where the quantized checkpoints are written")
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args([])  # the defaults on import; main() parses


def pick_ckpt():
    for p in [args.ckpt] if args.ckpt else ["out_sparse/ckpt.pt", "out/ckpt.pt"]:
        if os.path.isfile(p):
            return p
    sys.exit("bench_quant.py: no trained checkpoint; train one (README: Training) or pass --ckpt")


@torch.no_grad()
def greedy(m, prompts):
    return [m.generate(p[None], args.new_tokens, temperature=0.0)[0, p.numel() :].tolist() for p in prompts]


def agreement(outs, ref):
    """Fraction of generated tokens equal to the reference's at the same position (free-running)."""
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
    return same / sum(len(r) for r in ref)


@torch.no_grad()
def decode_speed(m, prompt):
    m.generate(prompt[None], 4, temperature=0.0)  # warm-up
    t0 = time.perf_counter()
    m.generate(prompt[None], args.new_tokens, temperature=0.0)
    return args.new_tokens / (time.perf_counter() - t0)


def main():
    global args
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = pick_ckpt()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{args.threads}; uptime: {load}"
    )
    print(f"checkpoint: {src}")
    ref = engine.load_model(src, dtype=torch.float32)
    cfg = ref.config
    bf16 = engine.load_model(src, dtype=torch.bfloat16).float().eval()  # BF16 weights, fp32 compute
    loader = data.DataLoader(args.data_dir)
    g = torch.Generator().manual_seed(0)
    batches = [loader.get_batch("val", 4, 256, generator=g) for _ in range(args.batches)]
    prompts = [loader.get_batch("val", 1, 32, generator=g)[0][0] for _ in range(args.prompts)]

    schemes = [
        ("W8A8", dict(scheme="w8a8")),
        ("W4A8", dict(scheme="w4a8")),
        ("W4A8 + rotation", dict(scheme="w4a8", rotate=True)),
        (f"W4A8 group {args.group_size}", dict(scheme="w4a8", group_size=args.group_size)),
        (f"W4A8 group {args.group_size} + rot", dict(scheme="w4a8", group_size=args.group_size, rotate=True)),
    ]
    models = [("FP32 (trained)", ref, None), ("BF16", bf16, None)]
    bf16_dir = os.path.join(args.out, "bf16")
    weights.save_pretrained(ref, bf16_dir, dtype=torch.bfloat16)
    for label, kw in schemes:
        d = os.path.join(
            args.out, label.split()[0].lower() + "_" + "_".join(label.split()[1:]).replace("+", "")
        )
        quantize.quantize_checkpoint(src, d, log=lambda *a: None, **kw)
        models.append((label, quantized.from_pretrained(d, dtype=torch.float32).eval(), d))

    ref_out = greedy(bf16, prompts)
    bf16_speed = None
    print(
        f"\n{len(batches)} val batches of 4 x 256 tokens; {len(prompts)} prompts x {args.new_tokens} greedy "
        f"tokens; decode batch 1"
    )
    head = (
        f"{'model':26s} {'bytes MiB':>9s} {'experts':>8s} {'val loss':>9s} {'ppl':>7s} {'d ppl':>7s} "
        f"{'agree':>6s} {'tok/s':>7s} {'GB/s':>6s} {'vs BF16':>7s}"
    )
    print(head)
    ppl_bf16 = None
    for label, m, d in models:
        directory = d or bf16_dir
        files = weights.open_checkpoint(directory)
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in files)
        tens = {}
        for fname, names in files.items():
            f = weights.SafeFile(os.path.join(directory, fname))
            tens.update({n: f.get(n) for n in names if ".mlp.experts." in n})
        experts = sum(t.numel() * t.element_size() for t in tens.values())
        loss = val_loss(m, batches)
        ppl = math.exp(loss)
        ppl_bf16 = ppl_bf16 or (ppl if label == "BF16" else None)
        agree = agreement(greedy(m, prompts), ref_out)
        speed = decode_speed(m, prompts[0])
        bf16_speed = bf16_speed or (speed if label == "BF16" else None)
        fp32 = label.startswith("FP32")  # not written to disk: its bytes are the fp32 model's own
        gbs = bytes_per_token(m if fp32 else directory, cfg) * speed / 1e9
        d_ppl = f"{100 * (ppl / ppl_bf16 - 1):+6.2f}%" if ppl_bf16 else ""
        ratio = f"{speed / bf16_speed:6.2f}x" if bf16_speed else ""
        print(
            f"{label:26s} {'-' if fp32 else f'{size / 2**20:.2f}':>9s} "
            f"{'-' if fp32 else f'{experts / 2**20:.2f}':>8s} {loss:9.4f} {ppl:7.3f} {d_ppl:>7s} "
            f"{agree:6.3f} {speed:7.1f} {gbs:6.3f} {ratio:>7s}"
        )
    print(
        "\nbytes: the checkpoint on disk (experts: the routed experts' tensors, scales and shapes included; "
        "a rotated checkpoint also holds the MTP block's own head, quantize.py says why); "
        "agree: greedy tokens equal to BF16's at the same position; GB/s: weight bytes one token reads "
        "(active experts only) x tok/s"
    )
    if torch.cuda.is_available():
        print(
            "a GPU is present: rerun with the models moved to it to time the Triton kernels (not done here)"
        )


if __name__ == "__main__":
    main()
