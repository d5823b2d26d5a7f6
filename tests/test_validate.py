"""One validation of a run (minipar/parallel/validate.py): every problem, from plain numbers, no MPI."""

from dataclasses import replace

import pytest

from minipar.parallel import validate
from minipar.parallel.pipeline import schedules
from minipar.parallel.validate import RunConfig, check, problems, resolve

GOOD = RunConfig(world_size=8, tp=2, pp=2, global_batch=16, n_layer=4, n_head=4, n_embd=32, block_size=16,
                 vocab_size=256, dropout=0.1, schedule="1f1b", sequence_parallel=True, zero_stage=1, recompute=True)
FLAGS = {"tp": "--tp", "pp": "--pp", "micro_batch_size": "--micro-batch-size", "n_head": "--n-head",
         "schedule": "--schedule", "virtual_stages": "--num-virtual-stages", "zero_stage": "--zero-stage",
         "sequence_parallel": "--sequence-parallel"}


def test_a_good_run_has_no_problem_and_its_sizes_are_derived():
    resolved, found = resolve(GOOD)
    assert found == [] and problems(GOOD) == []
    assert (resolved.dp, resolved.micro_batches, resolved.micro_batch_size) == (2, 2, 4)  # m = PP by default
    assert resolve(RunConfig(world_size=4, global_batch=16, micro_batch_size=2))[0].micro_batches == 2
    assert resolve(RunConfig(world_size=4, global_batch=16, micro_batches=2))[0].micro_batch_size == 2
    assert check(RunConfig()) == RunConfig()  # nothing asked, nothing wrong


@pytest.mark.parametrize("changes,message", [
    (dict(tp=0), "TP must be a positive integer, got 0"),
    (dict(n_layer=2.5), "n_layer must be a positive integer, got 2.5"),
    (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
    (dict(schedule="zb"), "is not a pipeline schedule: choose one of gpipe, 1f1b, 1f1b-slack, interleaved"),
    (dict(dtype="int8"), "choose float32 or float64 or bfloat16 or float16"),
    (dict(dropout=1.0), "dropout must be a number in [0, 1)"),
    (dict(tp=3, n_head=6, n_embd=48, block_size=18), "8 ranks do not split into TP x PP = 3 x 2 groups: launch a multiple of 6 ranks"),
    (dict(dp=3), "TP x PP x DP = 2 x 2 x 3 = 12 ranks, but the job has 8: launch with -n 12"),
    (dict(n_head=5, tp=1, world_size=4, sequence_parallel=False), "n_embd=32 is not divisible by n_head=5"),
    (dict(n_head=6, n_embd=48, tp=4, pp=1), "n_head=6 is not divisible by TP=4: each TP rank needs whole heads"),
    (dict(n_layer=6, virtual_stages=2, schedule="interleaved", global_batch=32), "n_layer=6 is not divisible by PP x virtual_stages = 2 x 2"),
    (dict(n_layer=3, virtual_stages=2, schedule="interleaved", global_batch=32),
     "n_layer=3 is fewer than PP x virtual_stages = 2 x 2: every pipeline chunk needs a layer"),  # no split can help
    (dict(virtual_stages=2), "virtual_stages=2 needs schedule='interleaved'"),
    (dict(global_batch=9), "global_batch=9 does not split over DP=2 ranks: use a multiple of 2"),
    (dict(global_batch=6), "3 sequences per data-parallel rank do not split into micro-batches of the default size"),
    (dict(micro_batch_size=3), "8 sequences per data-parallel rank do not split into micro-batches of 3"),
    (dict(micro_batches=3), "global_batch=16 does not split into micro_batches=3 equal micro-batches"),
    (dict(micro_batches=3, micro_batch_size=4), "micro_batches=3 x micro_batch_size=4 is not the 8 sequences"),
    (dict(schedule="interleaved", virtual_stages=2, micro_batches=1, global_batch=2), "micro_batches=1 is not divisible by PP=2"),
    (dict(schedule="interleaved"), "schedule='interleaved' takes turns between each rank's chunks: with virtual_stages=1 it is 1F1B"),
    (dict(micro_batch_size=1, global_batch=40000), "need 80000 message tags, more than MPI promises (32767)"),
    (dict(world_size=4, virtual_stages=8192, schedule="interleaved", n_layer=16384, global_batch=2),
     "2 micro-batches (global_batch=2 / (DP=1 x 1 (rows / PP, the default))) x 16384 pipeline chunks need 65536 message "
     "tags, more than MPI promises (32767): use a larger micro_batch_size or fewer pipeline chunks (PP x virtual_stages)"),
    (dict(block_size=15), "sequence_parallel splits the sequence: block_size=15 is not divisible by TP=2"),
    (dict(tp=1, world_size=4), "sequence_parallel splits along the tensor-parallel group: it needs TP > 1"),
    (dict(ep=0), "EP must be a positive integer, got 0"),
    (dict(zero_stage=True), "zero_stage must be 0, 1, 2 or 3, got True"),
    (dict(cp_comm_type="ring"), "cp_comm_type='ring' is not a context-parallel communication: choose one of p2p, a2a"),
    (dict(cp=2, cp_comm_type="a2a", n_head=6, n_embd=48), "n_head=6 is not divisible by TP x CP = 4"),
    (dict(cp=2, tp=4, pp=1, block_size=12), "each context-parallel rank's 6 positions over TP=4: choose block_size a multiple of 8"),
])
def test_each_kind_of_problem_is_one_line_naming_the_field_and_the_fix(changes, message):
    found = problems(replace(GOOD, **changes))
    assert len(found) == 1 and message in found[0], found
    assert "\n" not in found[0]


def test_every_problem_is_reported_at_once():
    bad = RunConfig(world_size=4, tp=3, pp=2, n_layer=3, n_head=3, n_embd=10, virtual_stages=2,
                    schedule="gpipe", sequence_parallel=True, zero_stage=3, dropout=-0.5, cp_comm_type="ring")
    found = problems(bad)
    assert len(found) == 7, found
    for message in ("dropout", "do not split into TP x PP", "n_embd=10 is not divisible by n_head=3",
                    "n_embd=10 is not divisible by TP=3", "n_layer=3", "virtual_stages=2 needs",
                    "cp_comm_type='ring' is not a context-parallel communication"):
        assert sum(message in f for f in found) >= 1, (message, found)
    with pytest.raises(ValueError, match=r"^GPT: .*; .*; "):
        check(bad, what="GPT")


def test_a_bad_value_is_reported_once_and_skips_the_rules_that_would_divide_by_it():
    assert problems(RunConfig(world_size=4, tp=0, n_head=4, n_embd=8, sequence_parallel=True,
                              global_batch=8)) == ["TP must be a positive integer, got 0"]


def test_messages_name_the_callers_flags():
    found = problems(RunConfig(world_size=2, pp=1, tp=2, n_head=3, n_embd=6, virtual_stages=2, schedule="1f1b", zero_stage=3,
                               sequence_parallel=True), FLAGS)
    assert "--n-head 3 is not divisible by --tp 2: each TP rank needs whole heads; choose --tp among the divisors of --n-head" in found
    assert "--num-virtual-stages 2 needs --pp > 1 and --schedule interleaved or zb-v" in found
    # a size set through the batch says which flag sets it
    found = problems(RunConfig(world_size=4, pp=2, virtual_stages=2, schedule="interleaved", global_batch=8,
                               micro_batch_size=4), FLAGS)
    assert found == ["the interleaved schedule runs micro-batches in groups of --pp: 1 micro-batches "
                     "(global_batch=8 / (DP=2 x --micro-batch-size 4)) is not divisible by --pp 2; set "
                     "--micro-batch-size so that the micro-batches are a multiple of 2"]
    # a fix names only what the caller can change
    assert "or change --pp" in problems(RunConfig(world_size=2, pp=3), {"pp": "--pp"})[0]


def test_virtual_stages_without_a_pipeline_are_a_schedule_but_not_a_run():
    assert problems(RunConfig(pp=1, virtual_stages=2, schedule="interleaved")) == []  # one rank, chunks in turn
    assert problems(RunConfig(world_size=1, virtual_stages=2)) == ["virtual_stages=2 needs PP > 1"]


def test_the_schedules_validate_knows_are_the_ones_built():
    assert tuple(schedules.SCHEDULES) == validate.SCHEDULES


def test_zero_2_and_3_run_with_sequence_and_pipeline_parallelism_and_a_split_backward():
    """ZeRO-2 and 3 hold back what the model sums after backward (SP's partial sums, the tied
    embedding's parts) and send from W's hooks."""
    base = dict(world_size=8, tp=2, pp=2, n_layer=4, n_head=4, n_embd=8, global_batch=8)
    for stage in (2, 3):
        assert problems(RunConfig(**base, zero_stage=stage, sequence_parallel=True, schedule="1f1b")) == []
        assert problems(RunConfig(**base, zero_stage=stage, schedule="zb-h1")) == []
        assert problems(RunConfig(**base, zero_stage=stage, schedule="1f1b", defer_embedding_wgrad=True)) == []
