#!/usr/bin/env bash
# Every GPU check and benchmark in one run, for a machine with a GPU (about 5 minutes on one):
#   bench/gpu_check.sh [OUT_DIR]          (default: gpu_results)
# Needs the GPU install first: pip install -e ".[dev,gpu]" (cupy-cuda13x on CUDA 13).
# Writes OUT_DIR/results.md (the table for docs/benchmarks.md) and one log per step; a failing
# step is reported in the table and makes the script exit non-zero, the others still run.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu_results}
mkdir -p "$out"
status=0
summary=()

step() {  # step NAME LOG COMMAND...: run one check with a time limit, keep its log
    local name=$1 log=$out/$2
    shift 2
    local start=$SECONDS
    if timeout 240 "$@" >"$log" 2>&1; then
        summary+=("| $name | ok | $((SECONDS - start)) s |")
    else
        summary+=("| $name | FAILED (see $log) | $((SECONDS - start)) s |")
        status=1
    fi
}

python - >"$out/device.txt" 2>&1 <<'PY'
import cupy
p = cupy.cuda.runtime.getDeviceProperties(0)
print(p["name"].decode(), "| compute capability", f"{p['major']}.{p['minor']}", "| CUDA runtime",
      cupy.cuda.runtime.runtimeGetVersion(), "| CuPy", cupy.__version__, "| GPUs", cupy.cuda.runtime.getDeviceCount())
PY
step "GPU tests (kernel vs float64, GPU step vs CPU step, communicators)" tests.log \
    python -m pytest -q tests/test_gpu.py tests/test_gemm_kernel.py tests/test_gpu_paths.py
step "GEMM: ours vs cuBLAS" gemm.log python bench/gemm.py --markdown "$out/gemm.md"
step "GPT step: our kernel vs cuBLAS" step.log python bench/gpu_step.py --markdown "$out/step.md"
step "lesson 07 on the GPU" lesson07.log python lessons/07_gemm_kernel.py --device cuda
step "training, 1 GPU, 50 steps" train.log python -m minipar.train --device cuda --max-iters 50 --sample 0 --plot ""
step "training, 2 ranks (NCCL, or MPI on one GPU)" train2.log \
    ./run_mpi.sh -n 2 -m minipar.train --device cuda --tp 2 --max-iters 20 --sample 0 --plot ""

{
    echo "# GPU check: $(cat "$out/device.txt")"
    echo
    echo "| check | result | time |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${summary[@]}"
    echo
    for part in gemm.md step.md; do [ -f "$out/$part" ] && cat "$out/$part" && echo; done
    echo '```'
    tail -n 3 "$out/train.log" "$out/train2.log"
    echo '```'
} >"$out/results.md"
cat "$out/results.md"
exit $status
