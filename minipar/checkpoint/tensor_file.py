"""A safetensors file as a list of buffers: its header, then each array's own bytes, not a copy.

``safetensors.numpy.save`` returns the whole file as one ``bytes``: a second copy of every tensor
held while it is written, the size of the gathered model on the rank that exports it. The format
is simple enough to write as it stands (reading stays with the library, which checks it):

    8 bytes: N, little-endian | N bytes: a JSON header | the tensors' bytes, back to back

The header maps each name to {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}
(offsets into the bytes after the header, which cover them with no gap) and "__metadata__" to
string pairs. It is padded with spaces so the data starts at a multiple of 8, and the tensors go
in order of falling item size, so each one starts at a multiple of its own: a reader may map the
file and use the arrays where they lie.
"""

import json

import numpy

# safetensors' names for NumPy's dtypes (and ml_dtypes' bfloat16, which NumPy knows by name)
DTYPE_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
               "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
               "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}


def _raw(array):
    """The array's bytes in place, as a flat uint8 view (a memoryview would refuse bfloat16)."""
    return array.reshape(-1).view(numpy.uint8)


def as_stored(array):
    """``array`` as a file holds it: C-contiguous and little-endian, copied only if it is not. A
    checksum is taken of this (of a big-endian array's own bytes, it failed against the file's)."""
    array = numpy.asarray(array, order="C")  # ascontiguousarray would make a 0-d array 1-d
    little = array.dtype.newbyteorder("<")  # a 1-byte dtype has no order: itself
    return array if array.dtype == little else array.astype(little)


def tensor_file(tensors, metadata=None):
    """``[header, bytes of each array]`` of the safetensors file holding ``{name: array}``: write
    them one after the other (``files.write_file``). Arrays that are not C-contiguous little-endian
    are copied; the others are not."""
    if "__metadata__" in tensors:
        raise ValueError("a tensor cannot be named __metadata__: the header keeps that key for the metadata")
    if metadata and not all(isinstance(v, str) and isinstance(k, str) for k, v in metadata.items()):
        raise TypeError(f"safetensors metadata maps strings to strings, got {metadata!r}")
    arrays = {}
    for name, array in tensors.items():
        array = as_stored(array)
        if array.dtype.name not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: safetensors has no dtype for {array.dtype}")
        arrays[name] = array
    order = sorted(arrays, key=lambda name: (-arrays[name].dtype.itemsize, name))
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": DTYPE_NAMES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return [len(text).to_bytes(8, "little") + text] + [_raw(arrays[name]) for name in order]
