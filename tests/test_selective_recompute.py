"""Selective recomputation (attention's T x T part rebuilt in backward) and activation memory
counted exactly: the op, the GPT and the CLI equal the run that keeps everything, bit for bit; one
layer's measured bytes equal minipar's formula (bench/activation_memory.py)."""

import importlib.util
import os

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar.autograd import Tensor
from minipar.models import GPT, GPTConfig
from test_train import TINY, losses, train

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "activation_memory.py")


def _bench():
    spec = importlib.util.spec_from_file_location("activation_memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("T,query_block", [(5, 64), (64, 64), (130, 64), (7, 3)])
def test_recomputed_attention_equals_the_kept_one_bit_for_bit(T, query_block):
    """float64, dropout on, T a multiple of the block or not: values and gradients identical, and
    the recomputing op holds no probabilities or mask."""
    rng = numpy.random.default_rng(T)
    data, upstream = rng.standard_normal((2, T, 18)), rng.standard_normal((2, T, 6))
    results = []
    for recompute in (False, True):
        qkv = Tensor(data, requires_grad=True, dtype=numpy.float64)
        y = F.causal_attention(qkv, 3, 0.2, key=(4, 1), rows=[5, 2], query_block=query_block, recompute=recompute)
        held = y._node.ctx.probs_t + y._node.ctx.keep_t
        y.backward(upstream)
        results.append((y.data, qkv.grad))
        assert (held == []) == recompute
    assert numpy.array_equal(results[0][0], results[1][0])
    assert numpy.array_equal(results[0][1], results[1][1])


def test_the_gpu_branch_recomputes_bit_for_bit_too(monkeypatch):
    """On a GPU the op takes all sequences at once and one block of T queries, on contiguous
    copies of the heads: those branches, on NumPy arrays (the GPU's kernel replaced by NumPy's)."""
    from minipar import backend
    from minipar.kernels import gemm

    monkeypatch.setattr(backend, "DEVICE", "cuda")
    monkeypatch.setattr(gemm, "matmul", lambda a, b, out=None: numpy.matmul(a, b, out=out))
    test_recomputed_attention_equals_the_kept_one_bit_for_bit(70, 64)


def test_gpt_with_selective_recompute_equals_the_default_bit_for_bit():
    minipar.set_default_dtype("float64")
    try:
        config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=80, vocab_size=32, dropout=0.1)
        idx = numpy.random.default_rng(0).integers(0, 32, (2, 70))  # two query blocks, the second partial
        runs = []
        for granularity in (None, "selective"):
            minipar.manual_seed(3)
            model = GPT(config, recompute_granularity=granularity)
            model.train()
            model.rng.iteration = 5
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            runs.append((loss.item(), [p.grad for p in model.parameters()]))
        assert runs[0][0] == runs[1][0]
        assert all(numpy.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    finally:
        minipar.set_default_dtype("float32")


def test_cli_selective_recompute_repeats_the_losses(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    logs = []
    for name, extra in (("keep", []), ("selective", ["--recompute-granularity", "selective"])):
        log = str(tmp_path / f"{name}.jsonl")
        run = train(*TINY, "--data", str(corpus), "--max-iters", "2", "--dtype", "float64", "--dropout", "0.1",
                    "--log-json", log, *extra)
        assert run.returncode == 0, run.stderr
        assert ("selective recompute" in run.stdout) == bool(extra)
        logs.append(losses(log))
    assert len(logs[0]) == 2 and logs[0] == logs[1]
    run = train(*TINY, "--data", str(corpus), "--recompute", "--recompute-granularity", "selective")
    assert run.returncode == 2 and "give one of them" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("dtype,dropout", [("float32", 0.1), ("float64", 0.0)])
def test_one_layer_holds_exactly_the_formula_and_selective_drops_the_t_by_t_term(dtype, dropout):
    bench = _bench()
    s, b, h, a, d = 70, 2, 16, 2, numpy.dtype(dtype).itemsize  # two query blocks of 64, the second partial
    totals = {}
    for granularity in bench.GRANULARITIES:
        formula = sum(bench.formula(s, b, h, a, d, dropout > 0, granularity).values())
        graph, traced = bench.measure(s, b, h, a, dtype, dropout, granularity)
        assert graph == traced == formula, granularity
        totals[granularity] = formula
    pairs = 64 * 64 + 70 * 6  # K(s): queries 0..63 over keys 0..63, queries 64..69 over keys 0..69
    t_by_t = d * a * b * pairs * (2 if dropout else 1)  # P, and R with dropout
    coordinates = 8 * (b + a + s) if dropout else 0  # what selective keeps to draw R again
    assert totals[None] - totals["selective"] == t_by_t - coordinates
    assert totals["full"] == d * s * b * h + 1
