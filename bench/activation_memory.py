"""Activation memory of one transformer layer: measured, beside minipar's formula and Korthikanti's.

    python bench/activation_memory.py                          # s = 64, 128, 256, 512; b 4, h 128, a 4
    python bench/activation_memory.py --seq 1024 --dtype float64 --dropout 0
    python bench/activation_memory.py --time                   # and what each recomputation costs
    python bench/activation_memory.py --dtype bfloat16         # half the float32 bytes, but 1/sigma

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count
per layer, with 2-byte activations and 1-byte dropout masks,

    s b h (34 + 5 a s / h) bytes      (s sequence, b batch, h hidden, a heads)

of which 5 a s^2 b is attention's T x T part: the softmax output (2), its dropout mask (1) and the
dropout's output (2). Selective recomputation keeps everything else (34 s b h); full
recomputation keeps the layer's input (2 s b h).

minipar's own count, in d-byte values (d = 4 in float32; the two dropouts' masks are booleans, one
byte each, as the paper's), is what its ops keep, term by term (``formula``, in ``minipar/plan/activations.py``):

    what backward needs (the ops' contexts)                      20 s b h + 2 s b + masks  (20 without dropout)
      LayerNorms: xhat and 1/sigma                                2 s b h + 2 s b  (1/sigma: float32
                                                                                    in a 16-bit model)
      LayerNorm outputs, the qkv and c_fc inputs                  2 s b h
      q, k, v                                                     3 s b h
      the attention output, c_proj's input                          s b h
      GELU's input and its tanh                                   8 s b h
      GELU's output, the MLP c_proj's input                       4 s b h
      two dropout masks, 1 byte an element                        2 s b h bytes
    what the engine also holds: a node keeps its input tensors     6 s b h  (4 without dropout)
      the residual stream: the layer's output and x + attn        2 s b h
      both c_proj outputs (the dropout's inputs)                  2 s b h
      both dropouts' outputs (the residual adds' inputs)          2 s b h
    attention's T x T part: P, and R with dropout                 a b K(s) each
    selective, with dropout: the mask's coordinates (int64)       8 (b + a + s) bytes
    full: the layer's output, and checkpoint's empty anchor         s b h, + 1 byte

so s b h (26 d + 2) + 2 d s b + 2 d a b K(s) bytes with dropout (in bfloat16 and float16, d = 2 but for the
LayerNorms' 2 s b values of 1/sigma, which stay float32: ``functional/widen.py``). K(s) = sum over the query blocks of q1 (q1 - q0)
is what the fused op holds per sequence and head: s^2 for one block (s <= 64, or a GPU), about
s^2/2 for many, because the blocks skip the masked keys. Selective recomputation drops the T x T
part and full keeps one s b h, the layer's output (the next one's input; its input is the
previous layer's), and one byte: NumPy allocates a byte for the empty array that anchors a
checkpoint in the graph (``recompute.checkpoint``).

Measured two ways, both on one layer run forward with its graph kept: ``graph_bytes`` walks the
graph from the output and adds every distinct array its nodes keep (contexts and input tensors,
parameters and the layer's input left out); ``traced_bytes`` asks tracemalloc how many bytes of
NumPy arrays were allocated and are still alive after the forward. Both must equal the formula.
"""

import gc
import sys
import time
import tracemalloc

import numpy

import minipar
from minipar.autograd import Tensor
from minipar.dtypes import as_dtype
from minipar.models import GPT, GPTConfig
from minipar.nn import Parameter
from minipar.parallel.recompute import checkpoint
from minipar.plan.activations import formula, korthikanti  # the formula lives in minipar (the planner uses it)

GRANULARITIES = (None, "selective", "full")


def _root(array):
    """The array that owns the memory a view looks into (two views of one buffer count once)."""
    while isinstance(array.base, numpy.ndarray):
        array = array.base
    return array


def _arrays(value):
    """The arrays inside a context attribute: arrays, tensors (not parameters), and lists, tuples
    and dicts of them (other objects not opened)."""
    if isinstance(value, numpy.ndarray):
        yield value
    elif isinstance(value, Tensor) and not isinstance(value, Parameter):
        yield value.data
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _arrays(v)


def held_buffers(outputs):
    """{id: buffer} of the distinct buffers the graphs of the tensors ``outputs`` keep for their
    backward, the outputs' own included: each node's context and its inputs."""
    held, nodes, seen = {}, [], set()
    for out in outputs:
        held[id(_root(out.data))] = _root(out.data)
        nodes.append(out._node)
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found = [a for value in vars(node.ctx).values() for a in _arrays(value)]
        found += [t.data for t in node.inputs if t is not None]
        for array in found:
            held[id(_root(array))] = _root(array)
        nodes += [t._node for t in node.inputs if t is not None]
    return held


def graph_bytes(out, inp, params):
    """Bytes of the distinct arrays the graph of ``out`` keeps, and ``out`` itself, less the
    parameters and the layer's input ``inp`` (the previous layer's)."""
    skip = {id(_root(p.data)) for p in params} | {id(_root(inp.data))}
    held = held_buffers([out])
    return sum(max(a.nbytes, 1) for key, a in held.items() if key not in skip)  # NumPy allocates 1 byte for none


def _numpy_bytes():
    snapshot = tracemalloc.take_snapshot()
    snapshot = snapshot.filter_traces([tracemalloc.DomainFilter(True, numpy.lib.tracemalloc_domain)])
    return sum(trace.size for trace in snapshot.traces)


def measure(s, b, h, a, dtype="float32", dropout=0.1, granularity=None, seed=0):
    """(graph_bytes, traced_bytes) of one layer's forward on a (b, s, h) input."""
    minipar.set_default_dtype(dtype)
    minipar.manual_seed(seed)
    config = GPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, dropout=dropout)
    model = GPT(config, recompute_granularity=granularity)
    model.train()
    block = model.transformer.h[0]
    x = Tensor(numpy.random.default_rng(seed).standard_normal((b, s, h)), requires_grad=True)
    gc.collect()
    tracemalloc.start()
    try:
        before = _numpy_bytes()
        out = checkpoint(block, x, block.parameters(), rng=model.rng) if granularity == "full" else block(x)
        traced = _numpy_bytes() - before
    finally:
        tracemalloc.stop()
    return graph_bytes(out, x, block.parameters()), traced


def step_ms(s, b, h, a, granularity, repeats=5):
    """Milliseconds of one layer's forward and backward (the best of ``repeats``): what selective
    recomputation costs, one more S = q k^T and softmax per query block in backward."""
    minipar.set_default_dtype("float32")
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=a, n_embd=h, block_size=s, dropout=0.1), recompute_granularity=granularity)
    model.train()
    block, best = model.transformer.h[0], float("inf")
    x = Tensor(numpy.random.default_rng(0).standard_normal((b, s, h)), requires_grad=True)
    for _ in range(repeats):
        start = time.perf_counter()
        out = checkpoint(block, x, block.parameters(), rng=model.rng) if granularity == "full" else block(x)
        out.backward(numpy.ones(out.shape, out.dtype))
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main(argv=None):
    # a script beside this one; imported here, so that tests can load this file as a module alone
    from minipar.cli import Parser, parse, positive_int
    from flags import probability, run_problems

    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=positive_int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--dropout", type=probability, default=0.1)
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default="float32")
    p.add_argument("--time", action="store_true", help="also time a layer's forward and backward")
    args = parse(p, None, lambda a: run_problems({"n_embd": "--n-embd", "n_head": "--n-head"}, n_layer=1,
                                                 n_head=a.n_head, n_embd=a.n_embd, block_size=max(a.seq)), argv)
    b, h, a, d = args.batch, args.n_embd, args.n_head, as_dtype(args.dtype).itemsize
    print(f"one layer: b={b}, h={h}, a={a}, {args.dtype} (d={d}), dropout {args.dropout}; "
          "bytes per layer, in MB (1e6)")
    print(f"{'s':>6} {'recompute':<10}{'Korthikanti':>12}{'minipar':>10}{'measured':>10}{'traced':>10}"
          f"{'T x T':>9}{'5as/h':>7}")
    ok = True
    for s in args.seq:
        for g in GRANULARITIES:
            terms = formula(s, b, h, a, d, args.dropout > 0, g)
            total = sum(terms.values())
            graph, traced = measure(s, b, h, a, args.dtype, args.dropout, g)
            ok &= graph == traced == total
            tt = sum(v for k, v in terms.items() if k.startswith("T x T"))
            print(f"{s:>6} {g or 'none':<10}{korthikanti(s, b, h, a, g) / 1e6:>12.3f}{total / 1e6:>10.3f}"
                  f"{graph / 1e6:>10.3f}{traced / 1e6:>10.3f}{tt / 1e6:>9.3f}{5 * a * s / h:>7.1f}"
                  + ("" if graph == traced == total else "   MISMATCH"))
    s = args.seq[0]
    print(f"\nminipar's terms at s={s} (bytes):")
    for name, value in formula(s, b, h, a, d, args.dropout > 0).items():
        print(f"  {name:<40}{value:>12,}")
    if args.time:
        print(f"\none layer's forward + backward, float32, dropout 0.1, b={b} (ms, best of 5):")
        print(f"{'s':>6}" + "".join(f"{g or 'none':>11}" for g in GRANULARITIES))
        for s in args.seq:
            print(f"{s:>6}" + "".join(f"{step_ms(s, b, h, a, g):>11.1f}" for g in GRANULARITIES))
    print("measured = traced = formula in every row" if ok else "MISMATCH: a measurement differs from the formula")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
