"""The pipeline executor on one process (no MPI): on a 1-stage grid it equals plain gradient
accumulation, a stage builds only its chunks and refuses what needs the whole model, 1F1B's memory
does not grow with the micro-batches, and a schedule the executor cannot run is refused first.
Against one device on many ranks: tests/mpi/pipeline.py."""

import tracemalloc

import numpy as np
import pytest

import minipar
from minipar.models import GPT, GPTConfig
from minipar.nn import Linear, ModuleList
from minipar.parallel import ProcessGrid
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline.executor import PipelineExecutor


@pytest.mark.parametrize("schedule,recompute", [("gpipe", False), ("1f1b", True)])
def test_executor_on_one_stage_equals_the_whole_batch(schedule, recompute):
    """PP = 1: the schedule is plain gradient accumulation over micro-batches, with loss shares
    by token count (micro-batches of unequal counts, the first with every target ignored) and
    dropout masks of the whole batch."""
    minipar.set_default_dtype("float64")
    try:
        config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.2)
        rng = np.random.default_rng(1)
        x, y = rng.integers(0, 32, (6, 8)), rng.integers(0, 32, (6, 8))
        y[:2], y[2, :5] = -1, -1
        minipar.manual_seed(0)
        serial = GPT(config)
        _, loss = serial(x, y)
        loss.backward()
        minipar.manual_seed(0)
        model = GPT(config, ProcessGrid(1, 1))
        run = PipelineExecutor(model, ProcessGrid(1, 1), schedule, micro_batches=3, recompute=recompute)
        record = run.step(x, y)
        assert abs(record.loss - loss.item()) < 1e-12
        for (n, p), q in zip(model.named_parameters(), serial.parameters()):
            np.testing.assert_allclose(p.grad, q.grad, rtol=1e-10, atol=1e-13, err_msg=n)
        assert record.peak_alive == (3 if schedule == "gpipe" else 1)
        serial.eval(), model.eval()
        with minipar.no_grad():
            assert abs(run.evaluate(x, y).loss - serial(x, y)[1].item()) < 1e-12
        bad_targets = y.copy()
        bad_targets[1, 1] = 32
        for xb, yb, message in ((x[:4], y[:4], "does not split into micro_batches=3"),
                                (x + 32, y, r"token ids must lie in \[0, 32\)"),
                                (x, bad_targets, "or be -1"),
                                (x, np.full_like(y, -1), r"every target is -1 \(ignored\)"),
                                (np.zeros((3, 9), np.int64), np.zeros((3, 9), np.int64), "exceeds block_size")):
            with pytest.raises(ValueError, match=message):
                run.step(xb, yb)
    finally:
        minipar.set_default_dtype("float32")


def test_an_instruction_without_a_method_is_refused_before_any_message(monkeypatch):
    """The executor dispatches by instruction kind, one method each: a schedule naming a kind it
    has no method for (a kind a schedule might add before its method exists) is refused at construction."""
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32), ProcessGrid(1, 1))
    plain = S.build("1f1b", 1, 2)
    ahead = {0: plain[0][:-1] + [S.Instruction("forward_backward", 1, 0), plain[0][-1]]}
    monkeypatch.setattr(S, "build", lambda *args: ahead)
    with pytest.raises(ValueError, match=r"instructions \['forward_backward'\] that the executor has no method"):
        PipelineExecutor(model, ProcessGrid(1, 1), "1f1b", micro_batches=2)


class FakeGrid:
    """One stage of a pipeline as GPT and the executor see it at construction (no communicator:
    no embedding group, so nothing is broadcast)."""

    tp_group = cp_group = dp_group = embedding_group = None
    pp_group = object()
    tp = cp = dp = ep = 1
    tp_rank = cp_rank = dp_rank = 0

    def __init__(self, pp, pp_rank):
        self.pp, self.pp_rank, self.layout = pp, pp_rank, minipar.parallel.Layout(1, pp, 1)


def test_stages_hold_their_chunks_round_robin():
    config = GPTConfig(n_layer=16, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1)
    held = {}
    for r in range(4):
        model = GPT(config, FakeGrid(4, r), virtual_stages=2)
        held[r] = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".h." in n})
        if r == 0:  # chunk 1 of rank 0 is global chunk 4: blocks 8, 9, which key their masks so
            assert [b.attn.layer for b in model.transformer.h] == [0, 1, 8, 9]
            assert "transformer.wpe.weight" in dict(model.named_parameters())
    assert held == {0: [0, 1, 8, 9], 1: [2, 3, 10, 11], 2: [4, 5, 12, 13], 3: [6, 7, 14, 15]}
    with pytest.raises(ValueError, match="message tags"):
        PipelineExecutor(model, FakeGrid(4, 3), "interleaved", micro_batches=4096)


def test_a_model_of_another_shape_or_stage_is_refused():
    """On 3 stages rank 1 holds chunks 1 and 4 both round-robin and in ZB-V's V: it must refuse a
    round-robin model for zb-v as ranks 0 and 2 do, or they would wait for it forever."""
    config = GPTConfig(n_layer=6, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    for r in range(3):
        model = GPT(config, FakeGrid(3, r), virtual_stages=2)
        with pytest.raises(ValueError, match="places a rank's chunks v, the model was built round-robin: build the GPT with pipeline_shape='v'"):
            PipelineExecutor(model, FakeGrid(3, r), "zb-v", micro_batches=6)
        shaped = GPT(config, FakeGrid(3, r), virtual_stages=2, pipeline_shape="v")
        with pytest.raises(ValueError, match="places a rank's chunks round-robin, the model was built v"):
            PipelineExecutor(shaped, FakeGrid(3, r), "interleaved", micro_batches=6)
    other_stage = GPT(config, FakeGrid(3, 1), virtual_stages=2)  # a model built for another stage or grid
    with pytest.raises(ValueError, match=r"places chunks \[2, 5\] on pipeline rank 2, the model holds \[1, 4\]"):
        PipelineExecutor(other_stage, FakeGrid(3, 2), "interleaved", micro_batches=6)


def test_one_f_one_b_memory_does_not_grow_with_the_micro_batches():
    """1F1B on one stage holds one micro-batch at a time: quadrupling m (micro-batches of the same
    size) must not grow the step's peak memory, dropout masks included (each micro-batch draws
    only its own rows)."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=64, dropout=0.1)
    peaks = []
    for m in (2, 8):
        minipar.manual_seed(0)
        model = GPT(config, ProcessGrid(1, 1))
        for p in model.parameters():
            p.grad = np.zeros_like(p.data)
        x = np.random.default_rng(0).integers(0, 64, (2 * m, 32))
        run = PipelineExecutor(model, ProcessGrid(1, 1), "1f1b", micro_batches=m)
        tracemalloc.start()
        run.step(x, x)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.2 * peaks[0], f"peak bytes {peaks[0]:,} at m=2, {peaks[1]:,} at m=8"


def test_a_pipelined_model_refuses_whole_model_calls():
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32), FakeGrid(2, 1))
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.h.2.attn.c_attn.weight" in names and not any(".h.0." in n for n in names)
    assert "transformer.wte.weight" in names and "transformer.wpe.weight" not in names  # the tied head
    with pytest.raises(RuntimeError, match="pipeline stages"):
        model(np.zeros((1, 8), np.int64))
    with pytest.raises(ValueError, match="not divisible by PP x virtual_stages"):
        GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16), FakeGrid(2, 1))


def test_module_list_names_are_distinct():
    with pytest.raises(ValueError, match="distinct name"):
        ModuleList([Linear(2, 2), Linear(2, 2)], names=[8, 8])
