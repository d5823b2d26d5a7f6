"""minipar.dtypes: what the engine asks of every input's dtype, remembered where it cannot change,
and ml_dtypes (bfloat16) imported only when asked for."""

import numpy as np


def test_dtype_answers_are_remembered_per_dtype_object_not_per_name():
    """Every op asks is_16bit / is_float of its inputs: the answers are kept per dtype (about a
    sixth of the cost), but not per name, and not for a void dtype while bfloat16 (kind "V") is
    unknown."""
    from minipar import dtypes

    assert not dtypes.is_16bit(np.dtype(np.float32)) and np.dtype(np.float32) in dtypes._16BIT_ANSWERS
    assert dtypes.is_16bit(np.float16) and dtypes._16BIT_ANSWERS[np.float16] is True
    assert not dtypes.is_float(np.dtype(np.int64)) and dtypes._FLOAT_ANSWERS[np.dtype(np.int64)] is False
    assert dtypes.is_16bit("float16") and "float16" not in dtypes._16BIT_ANSWERS
    void = np.dtype("V2")
    assert not dtypes.is_16bit(void)
    assert (void in dtypes._16BIT_ANSWERS) == (dtypes._loaded_bfloat16() is not None)


def test_dtype_answers_are_not_remembered_for_holders_or_unhashable_specs():
    """Anything with a .dtype (a tensor whose .data is replaced) can change its answer: it is asked
    afresh, and never becomes a key that keeps it alive. A structured dtype's spec (a list)
    cannot be a key at all and is still answered."""
    from minipar import dtypes

    class Holder:
        dtype = np.dtype(np.float16)

    for held in (Holder(), Holder):  # an instance, and the class itself: NumPy reads either's
        assert dtypes.is_16bit(held) and dtypes.is_float(held)
        held.dtype = np.dtype(np.int32)
        assert not dtypes.is_16bit(held) and not dtypes.is_float(held)
        assert all(key is not held for key in (*dtypes._16BIT_ANSWERS, *dtypes._FLOAT_ANSWERS))
        Holder.dtype = np.dtype(np.float16)
    assert dtypes.is_float(float) and float in dtypes._FLOAT_ANSWERS  # Python's float is float64
    dtypes.as_dtype("bfloat16")  # ml_dtypes loaded: void dtypes are remembered from now on
    assert not dtypes.is_16bit([("a", "f4")]) and not dtypes.is_float([("a", "f4")])


def test_ml_dtypes_is_imported_only_once_bfloat16_is_asked_for():
    """ml_dtypes 0.7 takes ~1 s to import, in every rank of every launch: a float32 step, the
    communicators and the checkpoints never import it; asking for bfloat16 does."""
    import subprocess
    import sys

    script = """
import sys
import numpy as np
import minipar.checkpoint, minipar.comm, minipar.train
from minipar.dtypes import as_dtype, is_16bit, is_bfloat16, is_float
from minipar.models import GPT, GPTConfig
model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=16))
ids = np.arange(16).reshape(2, 8) % 16
model(ids, ids)[1].backward()
assert is_float("float32") and not is_16bit("float32") and not is_bfloat16("float64") and is_16bit("float16")
assert not is_16bit(np.dtype("V2")) and not is_float(np.dtype("V2"))  # bfloat16's kind, asked before it exists
print("before:", "ml_dtypes" in sys.modules)
bf16 = as_dtype("bfloat16")
assert is_bfloat16(bf16) and is_16bit(bf16) and is_float(bf16)
print("after:", "ml_dtypes" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["before:", "False", "after:", "True"], out.stdout
    for by_name in ("from minipar.dtypes import is_16bit, is_float; "
                    "assert is_16bit('bfloat16') and is_float('bfloat16')",
                    "from minipar.autograd import Tensor; from minipar.dtypes import is_16bit; "
                    "assert is_16bit(Tensor([1.0], dtype='bfloat16').data.dtype)"):
        out = subprocess.run([sys.executable, "-c", by_name], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
