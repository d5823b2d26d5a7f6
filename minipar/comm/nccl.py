"""The Communicator over NCCL (``cupy.cuda.nccl``): collectives on GPU memory, GPU to GPU.

Every NCCL group stands on an MPI group of the same ranks (``mpi``), which does three things:
* it carries NCCL's unique id: rank 0 of the group creates it and broadcasts it, then every rank
  joins (``ncclCommInitRank``); ``split`` makes the MPI sub-group first, then its NCCL group;
* it moves what NCCL should not: host (NumPy) arrays, such as a loss to print or a count to agree
  on, and point-to-point messages. The pipeline's messages are matched by tag and may be posted in
  a different order on the two sides; NCCL matches sends to receives only by order, and a send
  waits on its stream until the receive is posted, so they stay on MPI (CUDA-aware, or staged);
* the byte account: NCCL's traffic and MPI's are charged to the same ``stats``.

NCCL's operations run on a stream of their own. Each one first waits for the work queued so far on
the compute stream (the kernels that produced its input), and the compute stream waits for it when
the Request completes, so communication overlaps computation just as the MPI requests do.

NCCL refuses two ranks on one GPU. ``world`` checks for that first (every rank names its host and
its GPU's PCI bus id) and then uses MPI for everything, saying so once.
"""

import socket
import sys

import numpy

from minipar.comm.base import Communicator, Request, all_to_all_v_plan, chunk_shape

_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def _nccl():
    from cupy.cuda import nccl

    return nccl


def unique_id_bytes(uid):
    """NCCL's unique id as 128 bytes, from what ``get_unique_id`` returns: ``bytes`` in CuPy 14, a
    tuple of 128 signed chars (-128..127) in CuPy 13 and before."""
    if isinstance(uid, (bytes, bytearray)):
        raw = bytes(uid)
    else:
        raw = numpy.array(uid, numpy.int64).astype(numpy.int8).tobytes()
    if len(raw) != _ID_BYTES:
        raise ValueError(f"an NCCL unique id has {_ID_BYTES} bytes, got {len(raw)}")
    return raw


def communicator(nccl, size, raw, rank):
    """``nccl.NcclCommunicator`` from the id's bytes, in the form this CuPy takes: ``bytes`` (CuPy
    14) or the tuple of signed chars (CuPy 13); each refuses the other's with a TypeError."""
    try:
        return nccl.NcclCommunicator(size, raw, rank)
    except TypeError:
        return nccl.NcclCommunicator(size, tuple(int(b) for b in numpy.frombuffer(raw, numpy.int8)), rank)


# NCCL's type of each dtype it moves, by the name of cupy.cuda.nccl's constant. The 16-bit ones
# came later (ncclBfloat16 needs NCCL 2.10 and a CuPy that exports it): a binding without them must
# still run float32, so the table is read once, lazily, and a missing constant is an error only when
# an array of its dtype is sent.
_CONSTANTS = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "float16": "NCCL_FLOAT16",
              "bfloat16": "NCCL_BFLOAT16", "int64": "NCCL_INT64", "int32": "NCCL_INT32", "int8": "NCCL_INT8",
              "uint8": "NCCL_UINT8"}
_types = None  # {dtype name: NCCL's constant, or None where this binding lacks it}


def _dtype(x):
    global _types
    if _types is None:
        nccl = _nccl()
        _types = {name: getattr(nccl, constant, None) for name, constant in _CONSTANTS.items()}
    name = x.dtype.name
    if name not in _types:
        raise TypeError(f"NCCL moves {', '.join(_CONSTANTS)} arrays, got {x.dtype}")
    if _types[name] is None:
        raise TypeError(f"this CuPy's NCCL binding has no {_CONSTANTS[name]}, so {name} arrays cannot go "
                        f"through NCCL (a 16-bit model sends its weights, activations and gradients in it): "
                        f"use a newer CuPy (and NCCL >= 2.10 for bfloat16), or train in float32")
    return _types[name]


def _op(op):
    nccl = _nccl()
    table = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}
    if op not in table:
        raise ValueError(f"reduction op must be one of {sorted(table)}, got {op!r}")
    return table[op]


def _contiguous(x, what):
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: NCCL needs a C-contiguous array; pass xp.ascontiguousarray(x)")
    return x


class NCCLCommunicator(Communicator):
    def __init__(self, mpi, name):
        import cupy

        self.mpi, self.name, self.rank, self.size = mpi, name, mpi.rank, mpi.size
        self.stats = mpi.stats
        uid = numpy.zeros(_ID_BYTES, numpy.uint8)
        if self.rank == 0:
            uid[:] = numpy.frombuffer(unique_id_bytes(_nccl().get_unique_id()), numpy.uint8)
        mpi.broadcast(uid, root=0)
        self.comm = communicator(_nccl(), self.size, uid.tobytes(), self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _on_host(self, x):
        return isinstance(x, numpy.ndarray)

    def _launch(self, op, nbytes, result, call, keep, wait, root=None, charged=None):
        """Run ``call(stream)`` on the communication stream after the compute stream's queued work,
        charge ``op`` once NCCL has taken it (the ring model's bytes, or ``charged``: (sent,
        received)), as the MPI paths do, and return a Request (or, if ``wait``, its result)."""
        import cupy

        compute = cupy.cuda.get_current_stream()
        self.stream.wait_event(compute.record())
        call(self.stream.ptr)
        self._charge(op, nbytes, root, charged)
        done = self.stream.record()
        if wait:  # the compute stream waits for the result on the GPU; the host need not
            compute.wait_event(done)
            return result
        return Request(lambda: done.done, result, keep=keep, then=lambda: compute.wait_event(done))

    def _out(self, out, shape, x, what):
        if out is None:
            import cupy

            return cupy.empty(shape, x.dtype)
        if out.shape != shape or out.dtype != x.dtype:
            raise ValueError(f"{what}: out must be {shape} {x.dtype}, got {out.shape} {out.dtype}")
        return _contiguous(out, what)

    # The checks of a collective of a GPU array, one place for its plain and its planned form:
    # (the output array, checked or made,) NCCL's dtype (and NCCL's op).
    def _all_reduce_checked(self, x, op):
        _contiguous(x, "all_reduce")
        return _dtype(x), _op(op)

    def _reduce_scatter_checked(self, x, op, out):
        _contiguous(x, "reduce_scatter")
        return self._out(out, chunk_shape(x, self.size, "reduce_scatter"), x, "reduce_scatter"), _dtype(x), _op(op)

    def _all_gather_checked(self, x, out):
        _contiguous(x, "all_gather")
        return self._out(out, (self.size,) + x.shape, x, "all_gather"), _dtype(x)

    # ---- collectives: GPU arrays through NCCL, host arrays through MPI ---------------------------
    def _all_reduce(self, x, op, wait):
        if self._on_host(x):
            return self.mpi._all_reduce(x, op, wait)
        dtype, nccl_op = self._all_reduce_checked(x, op)
        return self._launch("all_reduce", x.nbytes, x,
                            lambda s: self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, dtype, nccl_op, s),
                            x, wait)

    def _reduce_scatter(self, x, op, out, wait):
        if self._on_host(x):
            return self.mpi._reduce_scatter(x, op, out, wait)
        out, dtype, nccl_op = self._reduce_scatter_checked(x, op, out)
        return self._launch("reduce_scatter", x.nbytes, out,
                            lambda s: self.comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, dtype, nccl_op, s),
                            (x, out), wait)

    def _all_gather(self, x, out, wait):
        if self._on_host(x):
            return self.mpi._all_gather(x, out, wait)
        out, dtype = self._all_gather_checked(x, out)
        return self._launch("all_gather", out.nbytes, out,
                            lambda s: self.comm.allGather(x.data.ptr, out.data.ptr, x.size, dtype, s),
                            (x, out), wait)

    def _all_to_all(self, x, out, wait):
        """NCCL has no all-to-all primitive: it is one send and one receive per peer (itself
        included), fused into a single operation by ncclGroupStart/End so that none waits for
        another (NCCL's documented recipe)."""
        if self._on_host(x):
            return self.mpi._all_to_all(x, out, wait)
        _contiguous(x, "all_to_all")
        chunk_shape(x, self.size, "all_to_all")
        out = self._out(out, x.shape, x, "all_to_all")
        nccl, dtype, count = _nccl(), _dtype(x), x.size // self.size
        step = count * x.itemsize  # bytes per chunk

        def call(stream):
            nccl.groupStart()
            for peer in range(self.size):
                self.comm.send(x.data.ptr + peer * step, count, dtype, peer, stream)
                self.comm.recv(out.data.ptr + peer * step, count, dtype, peer, stream)
            nccl.groupEnd()

        return self._launch("all_to_all", x.nbytes, out, call, (x, out), wait)

    def _all_to_all_v(self, x, send_counts, recv_counts, wait):
        """As ``_all_to_all``, with each peer's own count and offset. A peer with nothing to
        send or receive is left out of the group on both sides (rank j's receive count from i is
        rank i's send count to j, so the two sides agree)."""
        if self._on_host(x):
            return self.mpi._all_to_all_v(x, send_counts, recv_counts, wait)
        _contiguous(x, "all_to_all_v")
        (sc, sd, rc, rd), shape, charged = all_to_all_v_plan(x, send_counts, recv_counts, self.rank, self.size)
        out = self._out(None, shape, x, "all_to_all_v")
        nccl, dtype, item = _nccl(), _dtype(x), x.itemsize

        def call(stream):
            nccl.groupStart()
            for peer in range(self.size):
                if sc[peer]:
                    self.comm.send(x.data.ptr + int(sd[peer]) * item, int(sc[peer]), dtype, peer, stream)
                if rc[peer]:
                    self.comm.recv(out.data.ptr + int(rd[peer]) * item, int(rc[peer]), dtype, peer, stream)
            nccl.groupEnd()

        return self._launch("all_to_all_v", x.nbytes, out, call, (x, out), wait, charged=charged)

    def _broadcast(self, x, root, wait):
        if self._on_host(x):
            return self.mpi._broadcast(x, root, wait)
        _contiguous(x, "broadcast")
        dtype = _dtype(x)
        return self._launch("broadcast", x.nbytes, x,
                            lambda s: self.comm.bcast(x.data.ptr, x.size, dtype, root, s), x, wait, root=root)

    # planned collectives (``base.Persistent``): host arrays planned in MPI; GPU arrays checked
    # once, here, then launched on NCCL at each start (NCCL has no persistent collectives)
    def all_reduce_init(self, x, op="sum"):
        if self._on_host(x):
            return self.mpi.all_reduce_init(x, op)
        self._all_reduce_checked(x, op)
        return super().all_reduce_init(x, op)

    def reduce_scatter_init(self, x, op="sum", out=None):
        if self._on_host(x):
            return self.mpi.reduce_scatter_init(x, op, out)
        return super().reduce_scatter_init(x, op, self._reduce_scatter_checked(x, op, out)[0])

    def all_gather_init(self, x, out=None):
        if self._on_host(x):
            return self.mpi.all_gather_init(x, out)
        return super().all_gather_init(x, self._all_gather_checked(x, out)[0])

    # ---- the rest through MPI --------------------------------------------------------------------
    def barrier(self):
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        self.stream.synchronize()
        self.mpi.barrier()

    def ibarrier(self):
        return self.mpi.ibarrier()

    def isend(self, x, dest, tag=0):
        return self.mpi.isend(x, dest, tag)

    def irecv(self, out, source, tag=0):
        return self.mpi.irecv(out, source, tag)

    def split(self, color, key, name):
        sub = self.mpi.split(color, key, name)
        return None if sub is None else NCCLCommunicator(sub, name)

    def abort(self, code=1):
        self.mpi.abort(code)


def _gpu_names(mpi):
    """Every rank's "host/PCI bus id" of its current GPU, in rank order."""
    import cupy

    bus_id = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.Device().id)
    mine = f"{socket.gethostname()}/{bus_id}".encode()[:255]
    padded = numpy.zeros(256, numpy.uint8)
    padded[: len(mine)] = numpy.frombuffer(mine, numpy.uint8)
    every = mpi.all_gather(padded)
    return [bytes(row).rstrip(b"\0").decode() for row in every]


def world(mpi):
    """The world on GPUs: NCCL when every rank has a GPU of its own, else MPI (said once)."""
    if mpi.size == 1:
        return mpi
    names = _gpu_names(mpi)
    shared = {n for n in names if names.count(n) > 1}
    if shared:
        if mpi.rank == 0:
            ranks = [r for r, n in enumerate(names) if n in shared]
            print(f"minipar: ranks {ranks} share a GPU ({sorted(shared)[0]} ...), which NCCL refuses: "
                  "collectives go through MPI instead, staged through host memory unless MPI is "
                  "CUDA-aware", file=sys.stderr, flush=True)
        return mpi
    return NCCLCommunicator(mpi, mpi.name)
