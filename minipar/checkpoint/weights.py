"""Weights on disk: safetensors files with GPT-2 names, written atomically and verified on load.

``save_weights`` writes to a temporary file in the target directory, flushes it to disk and renames
it over the target (``files.write_file``), so a crash leaves either the old file or the new one,
never half of one. A SHA-256 of every tensor's bytes goes into the file's metadata and is checked
by ``load_weights``.
No pickle anywhere: safetensors holds raw arrays and a JSON header only.
"""

import hashlib
import os

import numpy
from safetensors import SafetensorError, safe_open

from minipar.backend import to_numpy
from minipar.checkpoint.files import fsync_dir, write_file
from minipar.checkpoint.tensor_file import as_stored, tensor_file

_DIGEST_KEY = "minipar.sha256"
_FLOAT_DTYPES = ("F32", "F64")  # safetensors' names for the dtypes a run takes (--dtype)


def digest(tensors):
    """SHA-256 of ``{name: array}``: names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        array = numpy.ascontiguousarray(to_numpy(tensors[name]))
        h.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        h.update(array.reshape(-1).view(numpy.uint8))  # the bytes in place, no copy
    return h.hexdigest()


def save_weights(state, path):
    """Write ``{name: array}`` to ``path`` (.safetensors) atomically; an OSError (a full disk)
    names ``path`` and leaves no temporary file behind."""
    tensors = {name: as_stored(to_numpy(a)) for name, a in state.items()}  # the bytes the digest covers
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    write_file(path, tensor_file(tensors, metadata={_DIGEST_KEY: digest(tensors)}))
    fsync_dir(directory)  # the rename itself reaches the disk


def check_regular(path):
    """Refuse, before reading it, a path that is not a plain file (or a link to one): a FIFO would
    block the read forever, a device such as /dev/zero never end it; a link to nothing (a hub
    cache's link whose blob never arrived) is named as such, not as a file missing."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{path} is a link to {os.readlink(path)}, which does not exist")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path}: not a regular file")


def load_weights(path):
    """``{name: numpy array}`` from a .safetensors file of float32 or float64 tensors; raises
    ValueError if it is damaged or holds another dtype.

    Files written by ``save_weights`` carry a checksum that is verified; files from elsewhere (GPT-2
    weights exported by another tool) have none, and get only safetensors' own header checks.
    transformers' ``attn.bias`` / ``attn.masked_bias`` buffers (bool or uint8 in files of
    transformers 4.27-4.30) are no weights: skipped by name before the dtype check, as a snapshot's are."""
    from minipar.checkpoint.hf import BUFFERS  # (here: hf.py imports this module)

    check_regular(path)
    try:
        with safe_open(path, framework="numpy") as fh:
            metadata = fh.metadata() or {}
            names = [name for name in fh.keys() if not name.endswith(BUFFERS)]
            check_dtypes({name: fh.get_slice(name).get_dtype() for name in names})
            tensors = {name: fh.get_tensor(name) for name in names}
    except SafetensorError as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from exc
    expected = metadata.get(_DIGEST_KEY)
    if expected is not None and expected != digest(tensors):
        raise ValueError(f"{path} is damaged: its tensors do not match the checksum written with them")
    return tensors


def check_dtypes(dtypes):
    """Refuse, from the header alone, what a run would have to convert: NumPy has no bfloat16
    (safetensors cannot even load it), and integers cast to floats would start a run from
    weights nobody trained."""
    wrong = {name: dtype for name, dtype in dtypes.items() if dtype not in _FLOAT_DTYPES}
    if wrong:
        name, dtype = next(iter(wrong.items()))
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        hint = {"BF16": "; convert bf16 weights to float32 first",
                "F16": "; convert float16 weights to float32 first"}.get(dtype, "")
        raise ValueError(f"tensor {name} is {dtype}{more}: weights must be float32 or float64 (F32, F64){hint}")
