"""The NCCL binding (``comm/nccl.py``) checked on the CPU against fakes of cupy.cuda.nccl: the
unique id in both of CuPy's forms, NCCL's dtypes with and without the 16-bit ones, and its
reduction ops."""

import numpy
import pytest


class FakeNCCL:
    """cupy.cuda.nccl as CuPy 14 (``bytes`` ids) or CuPy 13 (tuples of signed chars) has it."""

    def __init__(self, takes):
        self.takes, self.made = takes, []
        outer = self

        class NcclCommunicator:
            def __init__(self, size, uid, rank):
                if not isinstance(uid, outer.takes):
                    raise TypeError(f"Argument 'commId' has incorrect type (expected {outer.takes.__name__})")
                outer.made.append((size, uid, rank))

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        raw = bytes(range(100, 228))  # crosses 127: signed and unsigned chars differ
        return raw if self.takes is bytes else tuple(int(b) for b in numpy.frombuffer(raw, numpy.int8))


@pytest.mark.parametrize("takes", [bytes, tuple])
def test_the_nccl_unique_id_round_trips_through_both_cupy_forms(takes):
    from minipar.comm import nccl

    fake = FakeNCCL(takes)
    raw = nccl.unique_id_bytes(fake.get_unique_id())
    assert raw == bytes(range(100, 228))
    shipped = numpy.frombuffer(raw, numpy.uint8).copy()  # what the broadcast carries
    nccl.communicator(fake, 2, shipped.tobytes(), 1)
    (size, uid, rank), = fake.made
    assert (size, rank) == (2, 1) and uid == fake.get_unique_id()
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.unique_id_bytes(b"short")


class FakeNCCLTypes:
    """cupy.cuda.nccl's dtype constants, with or without the 16-bit ones, and two of its reduction
    ops (NCCL's enum values)."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64, NCCL_FLOAT32, NCCL_FLOAT64 = 0, 1, 2, 4, 7, 8
    NCCL_SUM, NCCL_MAX = 0, 2  # ncclRedOp_t

    def __init__(self, sixteen):
        self.lookups = 0
        if sixteen:
            self.NCCL_FLOAT16, self.NCCL_BFLOAT16 = 6, 9

    def __getattribute__(self, name):
        if name.startswith("NCCL_"):
            object.__setattr__(self, "lookups", object.__getattribute__(self, "lookups") + 1)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("sixteen", [True, False])
def test_nccl_types_16_bit_arrays_and_a_binding_without_them_still_runs_float32(monkeypatch, sixteen):
    from minipar.comm import nccl
    from minipar.dtypes import bfloat16

    fake = FakeNCCLTypes(sixteen)
    monkeypatch.setattr(nccl, "_nccl", lambda: fake)
    monkeypatch.setattr(nccl, "_types", None)
    assert nccl._dtype(numpy.zeros(2, numpy.float32)) == 7
    looked_up = fake.lookups
    assert nccl._dtype(numpy.zeros(2, numpy.float64)) == 8 and fake.lookups == looked_up  # read once
    for dtype, value in ((numpy.float16, 6), (bfloat16, 9)):
        x = numpy.zeros(2, dtype)
        if sixteen:
            assert nccl._dtype(x) == value
        else:
            with pytest.raises(TypeError, match=f"no NCCL_{'BFLOAT16' if value == 9 else 'FLOAT16'}"):
                nccl._dtype(x)
    with pytest.raises(TypeError, match="NCCL moves"):
        nccl._dtype(numpy.zeros(2, numpy.complex64))


def test_nccl_reduces_by_the_op_asked_for(monkeypatch):
    """A max all-reduce (the vocab-parallel loss's row maxima, fp16's overflow flag) must not run as
    a sum on GPUs: a sum of maxima is no maximum."""
    from minipar.comm import nccl

    monkeypatch.setattr(nccl, "_nccl", lambda: FakeNCCLTypes(True))
    assert nccl._op("sum") == 0 and nccl._op("max") == 2
    with pytest.raises(ValueError, match="reduction op must be one of"):
        nccl._op("min")
