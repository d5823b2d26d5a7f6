"""Lesson 0: the ring all-reduce, built by hand from send and receive.

    ./run_mpi.sh -n 4 lessons/00_collectives.py               # any number of ranks
    ./run_mpi.sh -n 4 lessons/00_collectives.py --plant-bug   # skip one step: must fail

Data parallelism ends every step with an all-reduce: each rank holds a gradient of S bytes and all
must end with the sum. Sending everything to one rank and back makes that rank receive (N-1) S
bytes and send (N-1) S bytes back. The ring does better. Cut the buffer into N chunks and put the ranks on a ring (rank r sends
to r+1 and receives from r-1):

  1. reduce-scatter, N-1 steps: at step s, rank r sends chunk (r - s) and adds the chunk it
     receives into its own copy of chunk (r - s - 1). After N-1 steps, rank r holds the complete
     sum of chunk (r + 1).
  2. all-gather, N-1 steps: the finished chunks travel once around the ring, each rank forwarding
     the chunk it received last.

Every rank sends 2 (N-1) chunks of S/N bytes: 2 (N-1)/N S in total, which no algorithm can beat
(Patarasuk & Yuan 2009). It is nearly constant in N: S at 2 ranks, 1.5 S at 4, 1.999 S at 2000,
never above 2 S, while the root of all-to-one-and-back sends (N-1) S. This lesson runs the ring,
checks its result against MPI's own all-reduce, and counts the bytes each rank sends.

What to look at: the "bytes sent per rank" table. The ring's row must equal 2 (N-1)/N x S exactly,
and the error row must be rounding (about 1e-15 in float64); the last row is what a root would send.

Exercises (predict first, then run the command and read the row named):
1. Predict what each rank sends on 8 ranks for the default S = 8,388,608 bytes, and what the root
   of all-to-one-and-back sends: ./run_mpi.sh -n 8 lessons/00_collectives.py ("the hand-made ring",
   "all-to-one-and-back" rows).
2. At 2 ranks the ring has nothing to gain. Predict the ring's row and the root's row for
   ./run_mpi.sh -n 2 lessons/00_collectives.py --size 1000 (1,000 float64 elements).
3. --plant-bug leaves out the last step of the all-gather. Predict by how many bytes the ring's row
   falls short at 4 ranks, and whether the error row can still look like rounding:
   ./run_mpi.sh -n 4 lessons/00_collectives.py --plant-bug
4. 10 elements do not cut into 3 equal chunks. Predict what the lesson does with them and the
   ring's bytes: ./run_mpi.sh -n 3 lessons/00_collectives.py --size 10
"""


import numpy as np

import lesson
from minipar import backend
from minipar.comm import wait_all


def ring_all_reduce(comm, x, plant_bug=False):
    """Sum ``x`` over all ranks with 2 (N-1) neighbour exchanges; returns a new array."""
    N, r = comm.size, comm.rank
    work = x.copy()
    chunks = np.array_split(work, N)  # views into work: chunk i is rows i*S/N .. (i+1)*S/N
    right, left = (r + 1) % N, (r - 1) % N
    for s in range(N - 1):  # reduce-scatter
        send, recv = (r - s) % N, (r - s - 1) % N
        incoming = np.empty_like(chunks[recv])
        wait_all([comm.isend(chunks[send], right, tag=s), comm.irecv(incoming, left, tag=s)])
        chunks[recv] += incoming
    steps = N - 2 if plant_bug else N - 1
    for s in range(steps):  # all-gather: forward the chunk completed or received last
        send, recv = (r + 1 - s) % N, (r - s) % N
        wait_all([comm.isend(chunks[send], right, tag=N + s), comm.irecv(chunks[recv], left, tag=N + s)])
    return work


def check(args, ranks):
    if args.size < 1:
        return [f"--size must be >= 1, got {args.size}"]
    if args.plant_bug and ranks < 2:  # a ring of one rank has no step to skip: the bug could not show
        return ["--plant-bug skips the ring's last all-gather step, and one rank's ring has no steps: "
                "run it on 2 or more ranks (./run_mpi.sh -n 4)"]
    free = backend.free_memory()  # every rank holds its vector, the ring's sum and MPI's: 3 x 8 bytes an element
    return lesson.too_big(free[1] * 24 * args.size, free, "each rank holds its vector, the ring's sum and MPI's, "
                          "in float64", ["a smaller --size"]) if free else []


def main():
    args, comm = lesson.start(
        "A ring all-reduce from send/recv, checked against MPI.",
        lambda p: p.add_argument("--size", type=int, default=1 << 20, help="float64 elements per rank"),
        check,
        plant_bug="skip the last all-gather step", training=False)
    N, r = comm.size, comm.rank
    size = max(N, args.size - args.size % N)  # N equal chunks, so the byte count is exact
    x = np.random.default_rng(r).standard_normal(size)  # each rank has its own "gradient"

    comm.stats.reset()
    ours = ring_all_reduce(comm, x, args.plant_bug)
    sent_by_ring = comm.stats.by_op["send"].bytes_sent
    comm.stats.reset()
    reference = comm.all_reduce(x.copy())
    model = comm.stats.by_op["all_reduce"].bytes_sent

    error = float(np.abs(ours - reference).max())
    S = x.nbytes
    formula = 2 * (N - 1) * S // N
    close = error <= 1e-9 * max(1.0, float(np.abs(reference).max()))  # only rounding differs
    wrong = (["the ring's sum differs from MPI's all-reduce by more than rounding"] * (not close)
             + [f"the ring sent {sent_by_ring:,} bytes, not 2 (N-1)/N x S = {formula:,}"] * (sent_by_ring != formula))

    def report():
        way = "down" if size < args.size else "up"  # up: a --size below N, one element per chunk
        rounded = f", --size rounded {way} to a multiple of {N}" if size != args.size else ""
        print(f"{N} ranks, {S:,} bytes each ({size:,} float64{rounded})\n")
        why = "  (rounding: sums in another order)" if close else "  (more than rounding: wrong)"
        print(f"  max |ring - MPI all-reduce|        {error:.2e}{why}")
        print("\n  bytes sent per rank")
        print(f"  the hand-made ring                {sent_by_ring:>14,}")
        print(f"  2 (N-1)/N x S                     {formula:>14,}")
        print(f"  MPI all-reduce, ring model        {model:>14,}")
        print(f"  all-to-one-and-back, root: (N-1)S {(N - 1) * S:>14,}  (and it receives as much)")

    return lesson.finish(comm, wrong, report,
                         "The hand-made ring equals MPI's all-reduce and sends exactly 2 (N-1)/N x S "
                         "bytes per rank.")


if __name__ == "__main__":
    lesson.end(main())
