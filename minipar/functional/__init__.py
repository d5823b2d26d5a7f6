"""Differentiable ops, the public functional API (``import minipar.functional as F``).

Each op is a ``Function`` (see ``minipar.autograd``) in one of these files:

* ``elementwise``: add, sub, mul, div, neg, pow, exp, log, tanh, masked_fill, dropout
* ``gelu``: gelu (GPT-2's tanh approximation, its ufunc chains run in cache)
* ``reduction``: sum, mean, softmax, log_softmax, layer_norm
* ``shape``: reshape, transpose, getitem, split, concat
* ``linalg``: matmul, linear, embedding
* ``loss``: cross_entropy
* ``attention``: causal_attention (one op for mask, softmax, dropout and both products)
* ``routing``: permute, unpermute (token-slots to their experts and back, combined by the router's
  weights), with sort_by_expert, the order they use
* ``router_losses``: load_balancing_loss, z_loss, attach_loss (a mixture of experts' router)
* ``blockwise``: blockwise_attention (the same, one block of keys at a time, merged by the online
  softmax: the arithmetic of ring attention)
"""

from minipar.functional.attention import causal_attention
from minipar.functional.blockwise import blockwise_attention
from minipar.functional.elementwise import (
    add,
    apply_mask,
    div,
    dropout,
    exp,
    fresh_key,
    log,
    masked_fill,
    mul,
    neg,
    pow,
    sub,
    tanh,
)
from minipar.functional.gelu import gelu
from minipar.functional.linalg import embedding, linear, matmul
from minipar.functional.loss import cross_entropy
from minipar.functional.reduction import layer_norm, log_softmax, mean, softmax, sum
from minipar.functional.router_losses import attach_loss, load_balancing_loss, z_loss
from minipar.functional.routing import permute, sort_by_expert, unpermute
from minipar.functional.shape import concat, getitem, reshape, split, transpose
from minipar.functional.widen import cast

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "tanh", "gelu", "masked_fill",
    "dropout", "sum", "mean", "softmax", "log_softmax", "layer_norm", "reshape", "transpose",
    "getitem", "split", "concat", "matmul", "linear", "embedding", "cross_entropy",
    "causal_attention", "blockwise_attention", "apply_mask", "fresh_key", "permute", "unpermute",
    "sort_by_expert", "load_balancing_loss", "z_loss", "attach_loss", "cast",
]
