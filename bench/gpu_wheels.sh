#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels a lent GPU machine lacks, into .gpu_wheels/:
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]       (default 3.12: the lent machine's python3)
# The lent machine has no network and no MPI library (its image has mpi4py but no libmpi). So the
# MPI library (the mpich wheel: libmpi and mpiexec) and an mpi4py built for that Python travel with
# the checkout (the device tool's `carry: [".gpu_wheels"]`); bench/gpu_check.sh unpacks them into a
# scratch folder, leaving the machine's own Python untouched. About 15 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
python=${PYTHON:-python3}
rm -rf .gpu_wheels
"$python" -m pip download --quiet --no-deps --only-binary=:all: --dest .gpu_wheels \
    --python-version "$version" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "mpich>=4" "mpi4py>=4"
ls -l .gpu_wheels
