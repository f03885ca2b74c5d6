#!/usr/bin/env bash
# One command for the day a machine with a CUDA GPU is available: the CUDA tests and the
# real-time figures of the shapes and diffusers engines (SANA-WM steered by a camera
# and LTX-2 with its sound included), what batching buys on a GPU (the shapes engine's and
# the diffusers engine's), in at most 13 minutes (the steps' limits add up to 780 s).
#
#     bash bench/gpu_check.sh            # results in bench/results/gpu-<time>/
#
# Every step has its own time limit and the script goes on after a failed step, so one
# run brings back everything that can be measured; the exit status is the number of
# failed steps (0: all passed). It needs the project installed with its test and
# diffusers extras (what `tox -e test` installs) and a CUDA build of torch.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
out=${OUT:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is false)" >&2
    exit 2
fi
mkdir -p "$out"
failed=0

step() {  # step NAME SECONDS COMMAND...: run one step with a time limit, log it, go on
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local began=$SECONDS
    if timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1; then
        echo "   ok in $((SECONDS - began)) s"
    else
        echo "   FAILED (status $?) after $((SECONDS - began)) s; see $out/$name.log"
        failed=$((failed + 1))
    fi
    tail -n 3 "$out/$name.log" | sed 's/^/   | /'
}

{ nvidia-smi || true; "$python" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'; } \
    >"$out/machine.txt" 2>&1

# The tests that skip without CUDA, marked `gpu` wherever they live: the shapes engine
# on the GPU, the diffusers engine's memory back at its baseline after a session.
step cuda-tests 120 "$python" -m pytest -q -p no:cacheprovider -m gpu tests/
# The shapes model's bars through a server on the GPU (fewer prompts than the CPU run:
# speed is what this machine is for).
step shapes-eval 150 "$python" bench/evaluate_shapes.py --count 24 --interaction-trials 8 \
    --server-arg=--device=cuda
# The server's overhead on a GPU-sized random Wan pipeline, against direct calls.
step diffusers-bench 150 "$python" bench/run.py --scenario diffusers --diffusers-preset gpu \
    --repeat 1 --output "$out/diffusers.json"
# Batching on the GPU: the shapes engine with max_batch 32 against 1, at 1 to 64
# sessions (the gpu preset: --device=cuda, --max-sessions 64, longer videos).
step batching-bench 90 "$python" bench/run.py --scenario batching --batching-preset gpu \
    --repeat 1 --output "$out/batching.json"
# SANA-WM on the diffusers engine, steered by a camera velocity between segments: a
# random model built in code (nothing downloaded) at half the released transformer's
# width, with the real VAE compression, 704x1280, 33-frame segments, 20 steps with
# guidance: first chunk, real-time factor, peak memory.
step sana-wm 90 "$python" bench/sana_wm_check.py --preset gpu --device cuda --segments 3 \
    --output "$out/sana_wm.json"
# LTX-2 with its soundtrack on a random GPU-sized pipeline (built in code: no weights to
# download), 768x512, 33-frame segments: the first chunk, the real-time factor, peak
# memory; fails if any chunk's audio is not exactly its frames' samples.
step ltx2-bench 60 "$python" bench/ltx2_check.py --device cuda --segments 2 \
    --json "$out/ltx2.json"
# Batching the diffusers engine (issue 24): random SkyReels-V2 DF 1.3B- and Wan 1.3B-sized
# pipelines at 480p (built in code), max_batch 16 against 1 at 1/4/8/16 sessions: aggregate
# fps, per-session real-time factor, peak memory. Wan's segments batch their calls'
# forwards; the JSON is written after each preset, so SkyReels' table survives a timeout.
step diffusers-batching 120 "$python" bench/diffusers_batching.py --preset gpu-skyreels \
    --preset gpu-wan --output "$out/diffusers_batching.json"

echo "gpu_check: $failed failed step(s); results in $out"
exit "$failed"
