"""Modules: parameters with names, and the layers a GPT is built from.

A Module finds its parameters and sub-modules by walking its attributes in the order they were set,
so names come out as the attribute path (``transformer.h.0.attn.c_attn.weight``), the same as in
PyTorch, nanoGPT and GPT-2 checkpoints. A parameter reachable under two names (a tied weight) is
listed once, under the first name.
"""

import numpy

import minipar.functional as F
from minipar import rng
from minipar.autograd import Tensor
from minipar.backend import xp
from minipar.dtypes import get_default_dtype
from minipar.placement import REPLICATED
from minipar.random import default_generator


class Parameter(Tensor):
    """A Tensor that is a model weight: it always requires grad.

    ``placement`` says how it is cut, copied and summed across ranks (``minipar.placement``; by
    default every rank that holds it holds it whole). ``held_by`` is None, or the ZeRO-3 optimizer
    that keeps this parameter's values in shards: ``data`` is then empty except while that
    optimizer has gathered it, and ``held_by.numel(p)`` is its size. ``accumulate_dtype``: None, or
    the dtype a backward's gradient is widened to when it starts ``grad`` (ZeRO-2's and ZeRO-3's fp32
    gradients of a 16-bit model, where no gradient buffer is there yet: a weight used twice in one
    backward, the tied embedding, then sums its two parts in fp32 too)."""

    def __init__(self, data, placement=REPLICATED):
        super().__init__(data, requires_grad=True)
        # C order, so that flat views (the optimizer's, a ZeRO shard's) alias the weight itself
        self.data = xp.ascontiguousarray(self.data)
        self.placement = placement
        self.held_by = None
        self.accumulate_dtype = None


def normal_(shape, std, generator=None):
    """Normal(0, std) values drawn in float64 on the host and cast to the default dtype, so that
    float32 and float64 runs (and CPU and GPU runs) start from the same weights up to rounding."""
    values = (generator or default_generator()).standard_normal(shape) * std
    return xp.asarray(values.astype(get_default_dtype()))


class Module:
    training = True
    grid = None  # the ProcessGrid whose groups its parameters' placements name (None: one device)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):  # pragma: no cover - interface
        raise NotImplementedError

    def named_children(self):
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self):
        seen = set()
        for module_name, module in self.named_modules():
            for name, value in vars(module).items():
                if isinstance(value, Parameter) and id(value) not in seen:
                    seen.add(id(value))
                    yield (f"{module_name}.{name}" if module_name else name), value

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def num_parameters(self):
        return sum(p.size if p.held_by is None else p.held_by.numel(p) for p in self.parameters())

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def finalize_grads(self):
        """Finish the gradients after the last backward of a step, before the optimizer (the step
        protocol calls it). A model whose gradients are complete after backward has nothing to do;
        a model split over ranks overrides it (the GPT: sequence-parallel sums, tied embedding)."""

    def train(self, mode=True):
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self):
        """``{name: array}``: copies, so later training does not change a saved state."""
        if any(p.held_by is not None for p in self.parameters()):
            raise RuntimeError("ZeRO-3 holds this model's parameters in shards: use ZeRO3.full_state_dict()")
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state):
        """Copy ``state`` into the parameters in place, after checking that the names, shapes and
        dtypes all match; every difference is listed in one error."""
        params = dict(self.named_parameters())
        problems = [f"missing: {n}" for n in params if n not in state]
        problems += [f"unexpected: {n}" for n in state if n not in params]
        for name, p in params.items():
            if name not in state:
                continue
            value = state[name]
            value = value.data if isinstance(value, Tensor) else value
            if tuple(value.shape) != p.shape:
                problems.append(f"{name}: shape {tuple(value.shape)}, model has {p.shape}")
            elif numpy.dtype(value.dtype) != p.dtype:
                problems.append(f"{name}: dtype {value.dtype}, model has {p.dtype}")
        if problems:
            raise ValueError("load_state_dict: state does not fit the model:\n  " + "\n  ".join(problems))
        for name, p in params.items():
            value = state[name]
            p.data[...] = value.data if isinstance(value, Tensor) else xp.asarray(value)


class ModuleList(Module):
    """Sub-modules named by their position: ``h.0``, ``h.1``, ... or, given ``names``, by those
    (a pipeline stage holds blocks 8 and 9 of a GPT under their names in the whole model).
    Indexing and iteration go by position either way."""

    def __init__(self, modules, names=None):
        self._items = list(modules)
        self._names = [str(n) for n in (names if names is not None else range(len(self._items)))]
        if len(self._names) != len(self._items) or len(set(self._names)) != len(self._names):
            raise ValueError(f"ModuleList needs one distinct name per module, got {self._names} "
                             f"for {len(self._items)} modules")

    def named_children(self):
        yield from zip(self._names, self._items)

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __getitem__(self, i):
        return self._items[i]


class ModuleDict(Module):
    """Sub-modules named by keyword, e.g. GPT's ``transformer.wte``, ``transformer.h``."""

    def __init__(self, **modules):
        for name, module in modules.items():
            setattr(self, name, module)


class Linear(Module):
    """y = x W^T + b, W of shape (out_features, in_features), initialised N(0, std)."""

    def __init__(self, in_features, out_features, bias=True, std=0.02):
        self.weight = Parameter(normal_((out_features, in_features), std))
        self.bias = Parameter(xp.zeros(out_features, get_default_dtype())) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    def __init__(self, n, bias=True, eps=1e-5):
        dtype = get_default_dtype()
        self.weight = Parameter(xp.ones(n, dtype))
        self.bias = Parameter(xp.zeros(n, dtype)) if bias else None
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(Module):
    def __init__(self, num_embeddings, dim, std=0.02):
        self.weight = Parameter(normal_((num_embeddings, dim), std))

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class Dropout(Module):
    """Dropout that is active in training mode only.

    ``rng`` (a ``minipar.rng.DropoutRNG``, shared by a model) says which iteration this is and
    where the tokens are; with ``layer`` and ``site`` (which dropout of the model this is) that
    keys every element's decision by its position (see ``minipar.rng``). The input is (batch,
    positions, features). ``shards`` lists the (axis, communicator) pairs along which this rank
    holds only a part: axis 1 (a sequence-parallel rank's positions) or 2 (a slice of the
    features); the rank decides exactly its elements, as one device would. Without ``rng`` the
    process-wide generator picks the mask's key.
    """

    def __init__(self, p, rng=None, layer=0, site=0, shards=()):
        if shards and rng is None:
            raise ValueError("a sharded Dropout needs the model's DropoutRNG: without it each rank "
                             "would draw its own mask")
        if any(axis not in (1, 2) for axis, _ in shards):
            raise ValueError("Dropout shards split the positions (axis 1) or the features (axis 2); the rows "
                             "a rank holds are told with rng.at(rows=...)")
        self.p, self.rng, self.layer, self.site, self.shards = p, rng, layer, site, tuple(shards)

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if self.rng is None:
            return F.dropout(x, self.p)
        if x.ndim != 3:
            raise ValueError(f"a model's Dropout takes (batch, positions, features), got shape {x.shape}")
        full = list(x.shape)  # the whole sequence and feature axes, of which this rank has parts
        for axis, comm in self.shards:
            full[axis] *= comm.size
        coords = [*self.rng.where(full[0], full[1]), xp.arange(full[2])]
        for axis, comm in self.shards:  # in order: nested cuts
            coords[axis] = rng.part(coords[axis], comm.size, comm.rank)
        keep = rng.keep(self.rng.key(self.layer, self.site), self.p, *coords)
        return F.apply_mask(x, keep, self.p)


def describe(module):
    """One line per parameter: name, shape, count. For printing a model."""
    rows = [f"{n:<44} {str(p.shape):<14} {p.size:>10,}" for n, p in module.named_parameters()]
    rows.append(f"{'total':<44} {'':<14} {module.num_parameters():>10,}")
    return "\n".join(rows)


__all__ = ["Parameter", "Module", "ModuleList", "ModuleDict", "Linear", "LayerNorm", "Embedding",
           "Dropout", "normal_", "describe"]
