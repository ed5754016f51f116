#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one go: the Triton kernels' tests run natively (bf16 included, which
# the CPU interpreter cannot check), the workshop pipeline's plumbing on the GPU, the toy trained on the GPU,
# the kernels timed at GLM-5 shapes, and the engine against transformers' generate on the same weights.
#
# Run it:  bash check_gpu.sh                      # every step, in this order (about 8 minutes on an H100)
#          bash check_gpu.sh tests kernels         # some of them
# Steps:   machine tests kernels speedrun train serve dsa
# Logs go to $OUT (default out_gpu/), one file per step; each step has its own time limit, and a step
# that fails or runs out of time is reported and the next one runs.
# Needs: a CUDA build of torch, triton, pytest-xdist for the tests step (-n 8: the kernels compile in 8
# processes at once), transformers for the serve step's side-by-side rows (without it that part says so),
# bubblewrap for the pipeline's environment stages.
# Honest limits: the limits are sized for one H100 in a 15-minute lease; the benchmarks run with fewer
# repetitions and contexts than their defaults.

set -u
cd "$(dirname "$0")"
OUT=${OUT:-out_gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
steps=("$@")
if [ ${#steps[@]} -eq 0 ]; then
    steps=(machine tests kernels speedrun train serve dsa)
fi

step() {  # step NAME LIMIT_S COMMAND...: run it with a limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s (limit $limit s); last lines:"
    tail -n 25 "$OUT/$name.log"
}

for s in "${steps[@]}"; do
    case $s in
    machine)
        step machine 30 bash -c "nvidia-smi; uptime; $PY -c 'import torch, triton; \
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'"
        ;;
    tests)  # the kernel tests natively, several processes compiling at once; the interpreter re-run is CI's
        step tests 150 $PY -m pytest -q -rs -n 8 -p no:cacheprovider -k "not under_the_interpreter" \
            tests/test_kernels.py tests/test_kernels_quant.py
        ;;
    speedrun)  # every stage of the workshop run, a few steps each, on the GPU
        if ! command -v bwrap >/dev/null; then
            echo "no bwrap here: the environment stages will stop (apt-get install bubblewrap)"
        fi
        rm -rf runs/tiny_cuda
        step speedrun 180 $PY workshop/speedrun.py --preset tiny --run tiny_cuda --device cuda --quiet
        cp runs/tiny_cuda/report.md "$OUT/speedrun_report.md" 2>/dev/null
        echo "== the last stage's log:"
        tail -n 15 "$(ls -t runs/tiny_cuda/*/log.txt | head -1)"
        ;;
    train)  # the README's main job on the GPU: out/ckpt.pt for the serving benchmark
        step train 60 $PY train.py configs/toy.py --device=cuda
        ;;
    serve)  # issue 17's side-by-side rows on the GPU, and MTP
        step serve 180 $PY bench/bench_serve.py --device=cuda --parts=transformers,mtp --reps=3
        ;;
    kernels)
        step kernels 120 $PY bench/bench_kernels.py --contexts=8192,65536
        ;;
    dsa)
        step dsa 40 $PY bench/bench_serve.py --device=cuda --parts=dsa --contexts=16384,65536
        ;;
    *)
        echo "unknown step $s; choose from machine tests speedrun train serve kernels dsa"
        exit 2
        ;;
    esac
done
