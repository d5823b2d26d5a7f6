"""Megatron's placement rule, measured: TP inside the hosts against TP across them, over a slow link.

    sudo python bench/two_hosts.py                       # 200 Mbit/s, the default model, 3 rounds
    sudo python bench/two_hosts.py --n-embd 256 --rate 100mbit

Builds two hosts on this machine (bench/two_hosts_rig.py: network namespaces joined by a veth
pair whose both directions a token bucket, ``tc ... tbf``, holds to ``--rate``) and runs, through
``run_mpi.sh --hostfile``:

* the collectives' bus bandwidth between 2 ranks on one host (shared memory) and between 2 ranks
  on the two hosts (TCP over the link), bench/collectives.py;
* the same TP2 x PP2 x DP2 training, 8 ranks, 4 per host, twice per round: with the hostfile's
  slots filled in rank order (TP groups, ranks 2k and 2k+1, inside a host; the PP groups cross) and
  with one slot per host, so that the ranks go round the hosts (every TP group crosses).

A step's time is the median over the steps after the first, from --log-json. The two placements
alternate in each round so that a slow spell of a shared machine hits both. Root only; the rig's
namespaces are removed at the end, also on an error or Ctrl-C.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from two_hosts_rig import TwoHosts, missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "run_mpi.sh")


def launch(rig, per_host, argv, timeout):
    env = dict(os.environ, PYTHON=sys.executable)
    code, out = rig.run([LAUNCHER, "--hostfile", rig.hostfile(per_host), *argv], timeout=timeout, env=env, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} across the two hosts " + ("timed out" if code is None else f"exited {code}")
                         + f":\n{out}")
    return out


def bandwidth(rig, args):
    """{(placement, op): [(size, busbw MB/s)]} from bench/collectives.py's times on 2 ranks
    (busbw = S / t times 1 for all-reduce, 1/2 for reduce-scatter and all-gather at N = 2)."""
    rows = {}
    for placement, per_host in (("one host", 2), ("across", 1)):
        out = launch(rig, per_host, ["-n", "2", os.path.join(ROOT, "bench", "collectives.py"), "--min-size",
                                     args.min_size, "--max-size", args.max_size, "--rounds", "3"], timeout=600)
        for line in out.splitlines():
            words = line.split()
            if len(words) == 6 and words[0] in ("all_reduce", "reduce_scatter", "all_gather"):
                nbytes = int(words[1][:-1]) << (10 if words[1][-1] == "K" else 20)
                busbw = nbytes / (float(words[2]) * 1e-6) * (1 if words[0] == "all_reduce" else 0.5) / 1e6
                rows.setdefault((placement, words[0]), []).append((words[1], busbw))
    return rows


def step_ms(rig, per_host, args, log):
    argv = ["-n", "8", "-m", "minipar.train", "--tp", "2", "--pp", "2", "--max-iters", str(args.steps),
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
            "--eval-interval", "100000", "--plot", "", "--sample", "0", "--log-json", log]
    launch(rig, per_host, argv, timeout=600)
    with open(log) as f:
        ms = [json.loads(line)["ms"] for line in f]
    return statistics.median(ms[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="200mbit", help="the link's rate, tc's units ('' for the full speed)")
    p.add_argument("--rounds", type=int, default=3, help="trainings per placement, alternating")
    p.add_argument("--steps", type=int, default=8, help="training steps per run (the first is not counted)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--min-size", default="64K", help="smallest collective buffer")
    p.add_argument("--max-size", default="4M", help="largest collective buffer")
    p.add_argument("--no-collectives", action="store_true", help="time the trainings only")
    args = p.parse_args()
    why = missing()
    if why:
        print(f"two_hosts: {why}; nothing measured")
        return 2
    with TwoHosts(rate=args.rate or None) as rig, tempfile.TemporaryDirectory() as tmp:
        print(f"two hosts {rig.hosts[0]} and {rig.hosts[1]}, link {args.rate or 'at full speed'}; "
              f"{os.cpu_count()} cores on the machine (shared by both hosts); load average "
              + " ".join(f"{x:.1f}" for x in os.getloadavg()))
        if not args.no_collectives:
            print("\nbus bandwidth between 2 ranks, MB/s, by buffer size (bench/collectives.py, median of 3)")
            for (placement, op), sizes in bandwidth(rig, args).items():
                print(f"  {placement:<9} {op:<15}" + "  ".join(f"{s} {bw:7.1f}" for s, bw in sizes))
        print(f"\nTP2 x PP2 x DP2, {args.n_layer} layers, {args.n_embd} hidden: ms per step (median of steps 2-{args.steps})")
        times = {"TP inside hosts": [], "TP across hosts": []}
        start = time.monotonic()
        for r in range(args.rounds):
            for name, per_host in (("TP inside hosts", 4), ("TP across hosts", 1)):
                times[name].append(step_ms(rig, per_host, args, os.path.join(tmp, f"{r}{per_host}.jsonl")))
        for name, ms in times.items():
            print(f"  {name}: " + ", ".join(f"{t:.0f}" for t in ms) + f"  (median {statistics.median(ms):.0f})")
        print(f"({time.monotonic() - start:.0f} s of training runs; load average at the end "
              + " ".join(f"{x:.1f}" for x in os.getloadavg()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
