"""GPT-2 as Hugging Face's transformers stores it, in and out: a snapshot directory of
``config.json`` and ``model.safetensors``.

minipar's GPT already uses GPT-2's names; the layout differs in four ways, all handled here only:

* Conv1D: transformers keeps ``c_attn``, ``c_fc`` and both ``c_proj`` weights as (in, out), since
  its Conv1D computes ``x @ W + b``; minipar's linear layers hold (out, in) and compute ``x W^T + b``.
  So those four weights are transposed at the border, every other tensor is taken as it is.
* key prefixes: ``GPT2LMHeadModel`` writes ``transformer.h.0...``, a bare ``GPT2Model`` (the file
  of the original ``gpt2`` snapshot) writes ``h.0...``. Both are read; ``transformer.`` is written.
  A key of neither (a task model's head, ``score.weight``) keeps its own name, as the file has it.
* the output head: ``lm_head.weight`` is ``wte`` (tied). A file may carry it; it must then equal
  ``wte``, since minipar has no separate head. It is not written: safetensors files hold a tied
  tensor once, and ``from_pretrained`` ties it again.
* ``attn.bias`` and ``attn.masked_bias`` are buffers (the causal mask and its fill value), not
  weights: ignored on load, not written (recent transformers no longer saves them either).

The vocabulary is the model's own (GPT-2's 50257): a tensor-parallel run pads it only in memory,
and the whole weights gathered from any layout are unpadded.
"""

import json
import os
import shutil
import tempfile

import numpy
from safetensors import SafetensorError, safe_open

from minipar.checkpoint.files import folder_problem, fsync_dir, umask, write_file
from minipar.checkpoint.tensor_file import tensor_file
from minipar.checkpoint.weights import check_dtypes, check_regular

CONFIG, WEIGHTS = "config.json", "model.safetensors"
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BUFFERS = (".attn.bias", ".attn.masked_bias")  # the dot: not c_attn.bias
PREFIX = "transformer."
# GPT2Model's own modules, the keys a bare GPT2Model file holds without PREFIX; any other key (a
# GPT2ForSequenceClassification's score.weight) keeps the file's name, so an error names what is there
BODY = ("wte.", "wpe.", "h.", "ln_f.")
# the classes whose files hold GPT-2's body and at most its tied head, which is all minipar's GPT has
READ = ("GPT2LMHeadModel", "GPT2Model")
# what minipar computes, in config.json's terms: GELU's tanh form ("gelu_new"), LayerNorm's
# epsilon 1e-5, scores scaled by 1/sqrt(head size) only, the head tied to the embedding
_SAME = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
         "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
         "reorder_and_upcast_attn": (False,), "tie_word_embeddings": (True,), "add_cross_attention": (False,)}
# config.json's names for minipar's model flags
FIELDS = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "block_size": "n_positions",
          "vocab_size": "vocab_size"}


def is_conv1d(name):
    return name.endswith(CONV1D) and ".h." in f".{name}"


def from_hf(tensors):
    """minipar's state ({GPT-2 name: (out, in) array}) from a transformers file's tensors."""
    state, head, keys = {}, None, {}
    for key, value in tensors.items():
        name = PREFIX + key if key.startswith(BODY) else key
        if key == "lm_head.weight":
            head = value
        elif not name.endswith(BUFFERS):
            if name in keys:  # h.0... and transformer.h.0... are one tensor: which would be meant?
                bare, prefixed = sorted((keys[name], key), key=len)
                raise ValueError(f"the file holds both {bare} and {prefixed}, one tensor under both of "
                                 "transformers' key prefixes: keep one")
            keys[name] = key
            state[name] = value.T.copy() if is_conv1d(name) else value
    wte = state.get(PREFIX + "wte.weight")
    if head is not None and wte is not None:  # (no wte: the caller names it missing)
        if head.shape != wte.shape:
            raise ValueError(f"lm_head.weight has shape {tuple(head.shape)} and transformer.wte.weight "
                             f"{tuple(wte.shape)}: minipar's GPT ties its output head to the token embedding")
        # equal_nan: a NaN in both is refused later as not finite; NaN != NaN called them untied
        if not numpy.array_equal(head, wte, equal_nan=True):
            raise ValueError("lm_head.weight differs from transformer.wte.weight: minipar's GPT ties its "
                             "output head to the token embedding, and this model's are untied")
    return state


def to_hf(state):
    """A transformers file's tensors from minipar's state: Conv1D weights (in, out), no tied head."""
    return {name: numpy.ascontiguousarray(value.T if is_conv1d(name) else value) for name, value in state.items()}


def is_hf_layout(tensors):
    """Whether a file's tensors are in transformers' layout. The names alone cannot tell (both use
    GPT-2's); the first block's ``c_attn`` can: (C, 3C) is Conv1D's (in, out), (3C, C) minipar's."""
    for key, value in tensors.items():
        if key.endswith("h.0.attn.c_attn.weight") and value.ndim == 2:
            return value.shape[1] == 3 * value.shape[0]
    return False


def read_config(directory):
    """config.json's model as minipar's flags ({n_layer, n_head, n_embd, block_size, vocab_size}),
    plus its bos/eos ids; raises ValueError, one line, for a model minipar does not compute."""
    return _settings(_config(directory))


def _settings(config):
    flags = {flag: config[key] for flag, key in FIELDS.items()}
    return flags, {key: config.get(key) for key in ("bos_token_id", "eos_token_id")}


def _config(directory):
    """config.json of ``directory`` as a dict, checked to describe a model minipar computes."""
    path = os.path.join(directory, CONFIG)
    if not os.path.lexists(path):
        raise ValueError(f"{directory} has no {CONFIG}: a Hugging Face GPT-2 snapshot holds {CONFIG} and "
                         "model.safetensors; give that folder, or a .safetensors file of minipar's")
    check_regular(path)
    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, ValueError, RecursionError) as exc:  # (RecursionError: nested too deep to parse)
        raise ValueError(f"{path}: not a readable JSON file ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON {type(config).__name__}, not an object of a model's settings")
    if config.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type is {config.get('model_type')!r}, not 'gpt2': minipar reads GPT-2 models only")
    missing = [key for key in FIELDS.values() if type(config.get(key)) is not int]
    if missing:
        raise ValueError(f"{path}: no whole number {', '.join(missing)}")
    small = [f"{key} {config[key]}" for key in FIELDS.values() if config[key] < 1]
    if small:
        raise ValueError(f"{path}: {', '.join(small)}: a model's sizes are whole numbers >= 1")
    if config["n_embd"] % config["n_head"]:
        raise ValueError(f"{path}: n_embd {config['n_embd']} is not divisible by n_head {config['n_head']}: "
                         "every head needs n_embd / n_head dimensions")
    for key, allowed in _SAME.items():
        if key in config and config[key] not in allowed:
            raise ValueError(f"{path}: {key} is {config[key]!r}; minipar computes {allowed[0]!r} only")
    inner = config.get("n_inner")
    if inner is not None and inner != 4 * config["n_embd"]:
        raise ValueError(f"{path}: n_inner is {inner}; minipar's MLP is 4 x n_embd = {4 * config['n_embd']} wide")
    if config.get("n_ctx", config["n_positions"]) != config["n_positions"]:
        raise ValueError(f"{path}: n_ctx {config['n_ctx']} differs from n_positions {config['n_positions']}")
    for key in ("bos_token_id", "eos_token_id"):  # carried to checkpoints and exports as they are
        if not token_id(config.get(key)):
            raise ValueError(f"{path}: {key} is {json.dumps(config[key])[:40]}, not a token id (a whole number "
                             ">= 0), a list of them, or null")
    return config


def token_id(value):
    """Whether ``value`` is what config.json may give as a bos or eos token: an id, a list of ids
    (transformers' several end tokens), or None."""
    ids = value if isinstance(value, list) else [value]
    return value is None or all(type(v) is int and v >= 0 for v in ids)


def hf_config(config, dropout=0.0, token_ids=None, dtype="float32"):
    """The config.json of minipar's ``GPTConfig``, as transformers' GPT2Config writes it, for
    weights of ``dtype``."""
    ids = token_ids or {}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.block_size, "n_ctx": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": "gelu_new", "resid_pdrop": dropout, "embd_pdrop": dropout,
            "attn_pdrop": dropout, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "use_cache": True, "tie_word_embeddings": True,
            "bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id"),
            "torch_dtype": numpy.dtype(dtype).name}  # "float32" for ">f4" too: the file is little-endian


def read_tensors(path):
    """{name: array} of a safetensors file, refusing dtypes a run would have to convert."""
    check_regular(path)
    try:
        with safe_open(path, framework="numpy") as fh:
            check_dtypes({name: fh.get_slice(name).get_dtype() for name in fh.keys()
                          if not name.endswith(BUFFERS)})
            return {name: fh.get_tensor(name) for name in fh.keys() if not name.endswith(BUFFERS)}
    except SafetensorError as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from exc


def load_snapshot(directory):
    """(minipar state, model flags, token ids) of a transformers snapshot directory."""
    config = _config(directory)
    path = os.path.join(directory, WEIGHTS)
    check_regular(path)  # a FIFO, a folder or a broken link under that name is there, not missing
    if not os.path.isfile(path):
        raise ValueError(f"{directory} has no {WEIGHTS}{_missing_hint(directory)}")
    state = from_hf(read_tensors(path))
    heads = sorted(name for name in state if not name.startswith(PREFIX))  # (lm_head: from_hf took it)
    classes = config.get("architectures")
    if heads and isinstance(classes, list) and classes and not any(c in READ for c in classes):
        # a task model (GPT2ForSequenceClassification, GPT2DoubleHeadsModel): its body is GPT-2's
        more = f" and {len(heads) - 2} more" if len(heads) > 2 else ""
        raise ValueError(f"{directory} is a {', '.join(map(str, classes))} ({CONFIG}'s architectures): its {WEIGHTS} "
                         f"holds heads GPT2LMHeadModel has not ({', '.join(heads[:2])}{more}), and minipar reads "
                         "GPT2LMHeadModel / GPT2Model snapshots: save the GPT-2 body alone, "
                         "model.transformer.save_pretrained(DIR)")
    return (state, *_settings(config))


def _missing_hint(directory):
    """Why a snapshot without model.safetensors has none, from the weights it holds instead."""
    if os.path.lexists(os.path.join(directory, WEIGHTS + ".index.json")):
        return " (a sharded model.safetensors.index.json is not read: save it whole)"
    pickles = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")
               if os.path.lexists(os.path.join(directory, name))]
    if pickles:  # transformers' format before safetensors: torch.load runs whatever code the file names
        return (f": it holds {pickles[0]} (a pickle, which minipar never loads): re-save it with "
                "save_pretrained(..., safe_serialization=True)")
    return ""


def save_snapshot(state, config, directory, dropout=0.0, token_ids=None, extra_files=()):
    """Write ``directory`` as a snapshot ``GPT2LMHeadModel.from_pretrained`` loads: a temporary
    directory beside it, filled, flushed, then renamed into place, so a crash leaves the previous
    export or none, never half of one. ``extra_files`` (a tokenizer's) are copied in."""
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp, old = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent), None
    try:
        # from_pretrained asks for "format": "pt"
        write_file(os.path.join(tmp, WEIGHTS), tensor_file(to_hf(state), metadata={"format": "pt"}))
        with open(os.path.join(tmp, CONFIG), "w") as fh:
            json.dump(hf_config(config, dropout, token_ids, next(iter(state.values())).dtype), fh, indent=2)
            fh.write("\n")
        for path in extra_files:
            shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb+") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private; an export is not
        fsync_dir(tmp)  # the files' names in it, not only their bytes, before the rename shows it
        if os.path.exists(directory):  # a previous export (check_export_dir allowed it): moved aside
            old = tempfile.mkdtemp(prefix=".old-hf-", dir=parent)
            os.replace(directory, os.path.join(old, "x"))
        os.replace(tmp, directory)
        fsync_dir(parent)  # the rename is on disk before the previous export goes
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old:  # the previous export was moved aside: back into place if the new one never took it
            try:
                if not os.path.lexists(directory):
                    os.replace(os.path.join(old, "x"), directory)
                shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass  # it stays whole in the .old-hf-* folder beside it
        if isinstance(exc, OSError) and (exc.filename is None or str(exc.filename).startswith(tmp)):
            exc.filename = directory  # a write into the export, which names no file or our temporary
        raise


def export_dir_problem(directory):
    """Why ``directory`` cannot take an export (None if it can): it must be new, empty, or a
    previous export (only a config.json, model.safetensors and tokenizer files)."""
    why = folder_problem(os.path.dirname(os.path.abspath(directory)))  # the export is written beside it, then renamed
    if why is not None:
        return why
    if os.path.islink(directory):  # the rename would replace the link, not fill the folder it names
        return f"is a link (to {os.readlink(directory)}): give the folder itself"
    if not os.path.exists(directory):
        return None
    if not os.path.isdir(directory):
        return "exists and is not a directory"
    known = {CONFIG, WEIGHTS, "tokenizer.json", "vocab.json", "merges.txt"}
    others = sorted(set(os.listdir(directory)) - known)
    if others:
        return f"holds files an export would delete ({', '.join(others[:3])}): give a new or empty directory"
    return None

