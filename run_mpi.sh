#!/usr/bin/env bash
# Launch a minipar script or module on N MPI ranks.
#
#   ./run_mpi.sh -n 8 lessons/03_tensor_parallel.py [args]
#   ./run_mpi.sh -n 4 -m minipar.train [args]
#   ./run_mpi.sh --hostfile hosts -n 16 -m minipar.train [args]   # ranks on the hosts listed
#
# What it takes care of:
# - the mpiexec that belongs to the MPI library mpi4py uses, found from the active Python (the
#   mpich wheel puts it next to python; a system MPI is found through mpi4py's build config);
# - `python -m mpi4py`, so an uncaught exception on one rank aborts every rank instead of leaving
#   the others waiting forever;
# - one BLAS/OpenMP thread per rank (unless you set those variables yourself): 8 ranks on 2 cores
#   with 2 BLAS threads each would fight over the cores;
# - what earlier jobs that died left on this host (shared memory in /dev/shm, the launcher's
#   files in /tmp), removed first, silently, as a scheduler cleans up between jobs;
# - Open MPI's refusals to run as root or with more ranks than cores (MPICH has neither);
# - --hostfile FILE given to MPICH as -f, to Open MPI as --hostfile (docs/multi_node.md). The
#   launcher's own variables (HYDRA_LAUNCHER, HYDRA_LAUNCHER_EXEC, OMPI_MCA_*) pass through as set.
# The ranks run $PYTHON if it is set (a machine whose Python is only `python3`, or a particular
# interpreter), else the `python` on PATH, else `python3`.
set -euo pipefail

usage() {
    echo "usage: $0 [--hostfile FILE] -n RANKS (SCRIPT.py | -m MODULE) [ARGS...]" >&2
    exit 2
}

ranks=""
hostfile=""
while [ $# -gt 0 ]; do
    case "$1" in
        -n|-np) [ $# -ge 2 ] || usage; ranks="$2"; shift 2 ;;
        -f|--hostfile) [ $# -ge 2 ] || usage; hostfile="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;  # the header
        *) break ;;
    esac
done
[ -n "$ranks" ] && [ $# -ge 1 ] || usage
# Bash arithmetic wraps silently past 2^63 (-n 99999999999999999999 became 7.8e18 ranks), so the
# number is checked as text before any arithmetic. A million ranks is far beyond what one
# launch here can start: MPICH's launcher forks every local rank on this machine.
max_ranks=1000000
digits=${ranks#"${ranks%%[!0]*}"}  # without leading zeros: 0000008 is 8
case "$ranks" in ''|*[!0-9]*) ranks_ok=0 ;; *) [ -n "$digits" ] && ranks_ok=1 || ranks_ok=0 ;; esac
if [ "$ranks_ok" = 0 ]; then
    echo "$0: -n needs a positive number of ranks, got '$ranks'" >&2
    exit 2
fi
if [ "${#digits}" -gt 7 ] || [ "$digits" -gt "$max_ranks" ]; then
    echo "$0: -n $ranks: at most $max_ranks ranks; give the number of processes to start" >&2
    exit 2
fi
ranks=$digits
if [ -n "$hostfile" ]; then
    if [ ! -f "$hostfile" ]; then
        echo "$0: --hostfile $hostfile: no such file; list one host per line (MPICH: host:slots, Open MPI: host slots=N)" >&2
        exit 2
    fi
    if ! grep -q '^[[:space:]]*[^#[:space:]]' "$hostfile"; then
        echo "$0: --hostfile $hostfile names no host; list one host per line (MPICH: host:slots, Open MPI: host slots=N)" >&2
        exit 2
    fi
fi
if [ "$1" = "-m" ]; then
    [ $# -ge 2 ] || usage
elif [ ! -f "$1" ]; then
    echo "$0: no such script: $1" >&2
    exit 2
fi

python=${PYTHON:-$(command -v python || command -v python3 || true)}
if [ -z "$python" ] || ! command -v "$python" >/dev/null; then
    echo "$0: no python${PYTHON:+ at PYTHON=$PYTHON}; activate the project's environment (. .venv/bin/activate)" >&2
    exit 2
fi

# MPI jobs that died (an abort, a kill) leave their shared-memory segments in /dev/shm, memory
# that no one frees until reboot, and the launcher's topology file in /tmp; remove those of
# earlier jobs on this host before starting (minipar/comm/shm_orphans.py says how a live job's
# files are told apart).
# A Ctrl-C that lands while it runs must stop the launch, not read as the clean-up failing.
here=$(dirname "$(readlink -f "$0")")  # the project's folder, also when run through a link
if [ -f "$here/minipar/comm/shm_orphans.py" ]; then
    trap 'exit 130' INT
    "$python" "$here/minipar/comm/shm_orphans.py" --remove --quiet \
        || echo "$0: could not look for what dead jobs left in /dev/shm and /tmp; starting anyway" >&2
    trap - INT
fi

# Ask the Python that will run the ranks which MPI it links and where that MPI's mpiexec is.
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
if ! info=$("$python" - <<'EOF' 2>"$errors"
import os, sysconfig
from mpi4py import MPI
import mpi4py
candidates = [os.path.join(sysconfig.get_path("scripts"), "mpiexec")]
mpicc = mpi4py.get_config().get("mpicc")
if mpicc:
    candidates.append(os.path.join(os.path.dirname(mpicc), "mpiexec"))
found = next((c for c in candidates if os.access(c, os.X_OK)), "")
flavour = "openmpi" if "Open MPI" in MPI.Get_library_version() else "mpich"
print(flavour, found)
EOF
); then
    echo "$0: $python cannot load mpi4py and its MPI library: $(tail -n 1 "$errors")" >&2
    echo "$0: install the project into this environment first: pip install -e \".[dev]\"" >&2
    exit 2
fi
read -r flavour mpiexec <<<"$info"
if [ -z "$mpiexec" ]; then
    mpiexec=$(command -v mpiexec || true)
    if [ -z "$mpiexec" ]; then
        echo "$0: mpi4py uses $flavour but no mpiexec was found; pip install mpich (or your MPI's launcher)" >&2
        exit 2
    fi
fi

extra=()
if [ "$flavour" = "openmpi" ]; then
    extra+=(--oversubscribe)
    [ "$(id -u)" = "0" ] && extra+=(--allow-run-as-root)
    [ -n "$hostfile" ] && extra+=(--hostfile "$hostfile")
    # Open MPI gives remote ranks only the variables named with -x (MPICH's hydra passes them all).
    extra+=(-x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS -x MKL_NUM_THREADS)
    [ -n "${PYTHONPATH:-}" ] && extra+=(-x PYTHONPATH)
elif [ -n "$hostfile" ]; then
    extra+=(-f "$hostfile")
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
rm -f "$errors"
trap - EXIT
exec "$mpiexec" "${extra[@]}" -n "$ranks" "$python" -m mpi4py "$@"
