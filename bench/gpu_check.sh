#!/usr/bin/env bash
# Every GPU check and benchmark in one run, made for the lent GPU machine (one try, no network):
#   bash bench/gpu_check.sh [OUT_DIR]           (default: $OUT if set, else gpu_results)
#
# It installs nothing into the machine's Python. minipar is imported from this checkout
# (PYTHONPATH); what the machine lacks comes as wheels in .gpu_wheels/ (fetched beforehand by
# bench/gpu_wheels.sh and carried with the checkout) and is unpacked into a scratch folder. The
# interpreter is $PYTHON (default python3), for every step, the MPI ranks too.
#
# Steps, each with its own time limit, cut to what is left of $GPU_CHECK_BUDGET seconds (default
# 420) so the whole run ends in time; each result is printed, and appended to OUT_DIR/results.md,
# as soon as it is known. The first step is a preflight that stops everything within seconds,
# with one line saying what is missing, rather than letting every later step fail on it.
# CPU-only checks (the emulator's tests) stay off the GPU machine: CI runs them.
# docs/benchmarks.md says what each step does and how long it takes.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-${OUT:-gpu_results}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
budget=${GPU_CHECK_BUDGET:-420}
export PYTHON=${PYTHON:-python3}
export CUPY_TF32=0  # cuBLAS, the baseline, in full FP32 as our kernel computes (CuPy's default, pinned)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
results=$out/results.md
started=$SECONDS
status=0

say() { echo "$@" | tee -a "$results"; }

wheel_dir=${GPU_WHEELS:-.gpu_wheels}
if ls "$wheel_dir"/*.whl >/dev/null 2>&1; then  # carried wheels: unpacked beside, never into, the image
    carried=$(mktemp -d)/carried
    if "$PYTHON" -m pip install --quiet --no-index --no-deps --no-warn-script-location --prefix "$carried" \
            "$wheel_dir"/*.whl >"$out/wheels.log" 2>&1; then
        site=$("$PYTHON" -c 'import sys, sysconfig; print(sysconfig.get_path("platlib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$carried")
        export PYTHONPATH="$root:$site${PYTHONPATH#"$root"}"
        export PATH="$carried/bin:$PATH"
        export LD_LIBRARY_PATH="$carried/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        wheels="unpacked $(cd "$wheel_dir" && echo *.whl)"
    else
        wheels="FAILED to unpack $wheel_dir (see wheels.log)"
    fi
else
    wheels="none carried (bench/gpu_wheels.sh fetches them)"
fi

step() {  # step NAME LIMIT LOG COMMAND...: one check, its own time limit, its log kept
    local name=$1 limit=$2 log=$out/$3
    shift 3
    local left=$((budget - (SECONDS - started)))
    if [ "$left" -lt 10 ]; then
        say "| $name | NOT RUN: the budget of $budget s is spent | - |"
        status=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS code
    timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
    code=$?
    if [ "$code" -eq 0 ]; then
        say "| $name | ok | $((SECONDS - start)) s |"
    elif [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        say "| $name | TIMED OUT after $limit s (see $(basename "$log")) | $((SECONDS - start)) s |"
        status=1
    else
        say "| $name | FAILED, exit $code: $(grep -m1 -E 'FAILED|Error|error' "$log" | cut -c1-150) | $((SECONDS - start)) s |"
        status=1
    fi
    [ "$code" -ne 0 ] && tail -n 20 "$log" | sed 's/^/    /'  # why, in the output itself
}

: >"$results"
# The device tool copies the working tree, but its .git can be older than the tree: the caller
# names the commit it sent (GPU_CHECK_COMMIT), else we say which .git HEAD was found.
commit=${GPU_CHECK_COMMIT:-"$(git rev-parse --short HEAD 2>/dev/null || echo '?') (HEAD of the .git that travelled)"}
say "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit"
say ""
say "python: $PYTHON ($(command -v "$PYTHON")); wheels: $wheels; budget: $budget s"
say ""
"$PYTHON" bench/gpu_preflight.py 2>&1 | tee "$out/preflight.log"
preflight=${PIPESTATUS[0]}
sed 's/^preflight: /    /' "$out/preflight.log" >>"$results"
if [ "$preflight" -ne 0 ]; then
    say ""
    say "stopped at the preflight after $((SECONDS - started)) s: nothing else was run"
    exit 3
fi
say ""
say "| check | result | time |"
say "| --- | --- | --- |"
step "GPU tests: kernel vs float64, GPU step vs CPU step, dropout masks, NCCL on one rank, two ranks on one GPU" 150 tests.log \
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_rng.py::test_masks_on_the_gpu_equal_those_on_the_cpu
step "GEMM: ours vs cuBLAS vs naive" 120 gemm.log "$PYTHON" bench/gemm.py --markdown "$out/gemm.md"
step "lesson 07 with the GPU section" 90 lesson07.log "$PYTHON" lessons/07_gemm_kernel.py --device cuda
step "GPT-2-small step: our kernel vs cuBLAS" 150 step.log \
    "$PYTHON" bench/gpu_step.py --rounds 2 --steps 2 --markdown "$out/step.md"
step "training, 1 GPU, 50 steps" 90 train.log \
    "$PYTHON" -m minipar.train --device cuda --max-iters 50 --sample 0 --plot ""
step "training, 2 ranks, TP=2 on one GPU (MPI) or two (NCCL)" 90 train2.log \
    ./run_mpi.sh -n 2 -m minipar.train --device cuda --tp 2 --max-iters 20 --sample 0 --plot ""
step "lesson 08, context parallelism, 2 ranks on one GPU" 90 lesson08.log \
    ./run_mpi.sh -n 2 lessons/08_context_parallel.py --device cuda
step "training, 2 ranks, CP=2 ring attention on one GPU" 90 train_cp.log \
    ./run_mpi.sh -n 2 -m minipar.train --device cuda --cp 2 --max-iters 20 --sample 0 --plot ""
step "training, 1 GPU, bf16 with fp32 master weights (CuPy with ml_dtypes' bfloat16)" 90 train_bf16.log \
    "$PYTHON" -m minipar.train --device cuda --bf16 --max-iters 20 --sample 0 --plot ""
step "training, 2 ranks, 4 experts over EP=2 on one GPU" 90 train_ep.log \
    ./run_mpi.sh -n 2 -m minipar.train --device cuda --num-experts 4 --ep 2 --moe-aux-loss-coeff 0.01 \
    --max-iters 20 --sample 0 --plot ""
say ""
for part in gemm.md step.md; do
    [ -f "$out/$part" ] && cat "$out/$part" >>"$results" && echo >>"$results"
done
{
    echo '```'
    tail -n 3 "$out/train.log" "$out/train2.log" "$out/train_cp.log" "$out/train_ep.log" "$out/train_bf16.log" 2>/dev/null
    echo '```'
    echo
    echo '```'
    tail -n 32 "$out/lesson08.log" 2>/dev/null
    echo '```'
    echo
    echo "total: $((SECONDS - started)) s"
} >>"$results"
for part in gemm.md step.md; do [ -f "$out/$part" ] && cat "$out/$part"; done
echo "total: $((SECONDS - started)) s; results in $results"
exit $status
