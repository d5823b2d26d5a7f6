"""Weights and checkpoints on disk: safetensors only (no pickle), written atomically, verified.

    weights.py   single-device weights with GPT-2's names (``--init-weights``, ``--export-weights``)
    boxes.py     where a rank's piece of a tensor lies in the whole tensor
    pieces.py    what a rank holds of the training state (parameters, AdamW moments)
    sharded.py   checkpoints every rank writes its pieces of (the save)
    reshard.py   such a checkpoint read back onto any layout, every box verified
    failures.py  a failed read or write ends every rank together, said by one
    files.py     a checkpoint's files written whole, through exclusive temporaries, never via links
    index.py     what a checkpoint on disk says (``latest``, the index, its file names), checked
    retention.py a save directory kept tidy: stale partial saves removed, old checkpoints pruned
    lock.py      one run at a time writes a save directory (flock)
    tensor_file.py  a safetensors file written from the arrays where they lie
    full.py      the whole weights gathered from any layout, or spread onto it
    hf.py        GPT-2 as Hugging Face's transformers stores it (a snapshot directory), in and out
"""

from minipar.checkpoint.weights import load_weights, save_weights

__all__ = ["load_weights", "save_weights"]
