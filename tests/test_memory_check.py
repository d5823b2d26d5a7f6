"""The start-up memory check's arithmetic (``parallel/memory.py``): parameters counted as the model
has them, ZeRO's and PipeDream-2BW's state bytes, the batch's floor, and on a GPU the free
memory shared by the ranks on it. The refusals it leads to are in test_cli_errors.py."""

import sys
from dataclasses import replace

import pytest


@pytest.mark.parametrize("n_layer,n_embd,block_size", [(1, 16, 16), (3, 24, 8)])
def test_the_parameter_count_is_the_models(n_layer, n_embd, block_size):
    from minipar.models import GPT, GPTConfig
    from minipar.parallel.memory import parameter_count

    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size))
    assert parameter_count(n_layer, n_embd, block_size) == sum(p.data.size for p in model.parameters())


def test_the_parameter_count_of_a_mixture_of_experts_is_the_models():
    from minipar.models import GPT, GPTConfig
    from minipar.parallel.memory import mlp_parameters, state_bytes, total_parameters
    from minipar.parallel.validate import RunConfig

    config = GPTConfig(n_layer=3, n_head=4, n_embd=16, block_size=16, num_experts=4, moe_layer_freq=2)
    run = RunConfig(n_layer=3, n_embd=16, block_size=16, vocab_size=256, num_experts=4, moe_layer_freq=2)
    assert total_parameters(run) == sum(p.data.size for p in GPT(config).parameters())
    # EP = 2 over DP = 4, ZeRO-1: each rank holds half the experts, their moments over DP / EP = 2 ranks
    experts = 2 * 4 * mlp_parameters(16)
    sharded = replace(run, dp=4, ep=2, zero_stage=1, dtype="float64")
    dense = total_parameters(run) - experts
    assert state_bytes(sharded) == pytest.approx((dense * (2 + 2 / 4) + experts / 2 * (2 + 2 / 2)) * 8)


def test_zero_shards_the_moments_then_the_gradients_then_the_parameters():
    from minipar.parallel.memory import parameter_count, state_bytes
    from minipar.parallel.validate import RunConfig

    n = parameter_count(4, 64, 32)
    run = RunConfig(tp=2, pp=2, dp=4, n_layer=4, n_embd=64, block_size=32, dtype="float64")
    for stage, arrays in [(0, 4), (1, 2 + 2 / 4), (2, 1 + 3 / 4), (3, 4 / 4)]:
        assert state_bytes(replace(run, zero_stage=stage)) == pytest.approx(n / 4 * arrays * 8)
    # PipeDream-2BW's stash: the weights again and a batch's gradients (its WeightStash.stash_bytes)
    assert state_bytes(replace(run, schedule="pipedream-2bw")) == pytest.approx(n / 4 * 6 * 8)


def test_the_batch_floor_counts_one_micro_batchs_logits_on_its_cp_and_tp_share():
    from minipar.parallel.memory import batch_bytes
    from minipar.parallel.validate import RunConfig

    run = RunConfig(tp=2, cp=2, dp=2, global_batch=8, micro_batches=2, block_size=16, vocab_size=255,
                    dtype="bfloat16")
    ids = 2 * 8 * 8 * 16  # inputs and targets of the whole batch, int64
    # 2 rows, 16 / CP positions, the vocabulary padded to 256 / TP columns, 2 bytes each
    assert batch_bytes(run, logits=False) == ids and batch_bytes(run) == ids + 2 * 2 * 8 * 128


def test_on_a_gpu_the_free_memory_is_shared_by_the_ranks_on_it(monkeypatch):
    """The CUDA branch on the CPU: a stand-in CuPy with two GPUs of 80 GB free, five ranks here."""
    import types

    from minipar import backend

    runtime = types.SimpleNamespace(memGetInfo=lambda: (80e9, 141e9), getDeviceCount=lambda: 2,
                                    getDeviceProperties=lambda i: {"name": b"NVIDIA H200"})
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=lambda: types.SimpleNamespace(id=0)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(backend, "DEVICE", "cuda")
    monkeypatch.setenv("MPI_LOCALNRANKS", "5")
    assert backend.free_memory() == (80e9, 3, "free memory of the NVIDIA H200")


def test_the_trainer_counts_the_fullest_stages_state_not_the_average(monkeypatch):
    """PP 3 over 6 blocks with experts in blocks 0 and 4: stages 0 and 2 hold an MoE block each
    (8 experts, 1.0 GB of float32 state), stage 1 none. The model's average over the stages, 1.03
    GB a rank, would let a run through that the first stage's 1.3 GB (the embedding too) does not fit."""
    from minipar import backend
    from minipar.cli import FlagError
    from minipar.parallel.memory import state_bytes
    from minipar.parallel.validate import RunConfig
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    flags = ["--n-layer", "6", "--n-embd", "1024", "--num-experts", "8", "--moe-layer-freq", "4", "--pp", "3",
             "--micro-batch-size", "4"]
    average = state_bytes(RunConfig(pp=3, dp=1, n_layer=6, n_embd=1024, block_size=64, vocab_size=256, num_experts=8,
                                    moe_layer_freq=4))
    assert 1.0e9 < average < 1.1e9
    monkeypatch.setattr(backend, "free_memory", lambda host=False: (1.6e9, 1, "test memory"))  # the average fits
    with pytest.raises(FlagError) as refusal:
        check_args(build_parser().parse_args(flags), 3)
    (line,) = refusal.value.lines
    assert line.startswith("this run needs about 1.8 GB on each rank: 1.3 GB for a model of 193,501,184 parameters")


@pytest.mark.parametrize("flags", [["--n-layer", str(10**29)], ["--num-experts", str(10**8)]])
def test_a_model_far_too_large_is_refused_by_arithmetic_before_it_is_planned(monkeypatch, flags):
    """The planner's count lists every layer and expert: 10^29 layers took all the memory there is
    before it said anything. The average stage's state, counted by arithmetic alone, says it first."""
    from minipar import backend
    from minipar.cli import FlagError
    from minipar.plan import state
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    monkeypatch.setattr(backend, "free_memory", lambda host=False: (16e9, 1, "test memory"))
    monkeypatch.setattr(state, "stage_peak_bytes", lambda *a: pytest.fail("planned layer by layer"))
    with pytest.raises(FlagError) as refusal:
        check_args(build_parser().parse_args(flags + ["--max-iters", "1"]), 1)
    (line,) = refusal.value.lines
    assert line.startswith("this run needs about ") and "16.0 GB is available to each" in line, line
    # where the memory is not known (no /proc/meminfo) there is nothing to refuse, and it is not planned either
    monkeypatch.setattr(backend, "free_memory", lambda host=False: None)
    check_args(build_parser().parse_args(flags + ["--max-iters", "1"]), 1)


def test_a_refusal_names_the_memory_dead_mpi_jobs_left_in_dev_shm(monkeypatch):
    """Segments that aborted MPI jobs leave in /dev/shm count against MemAvailable until removed:
    a refusal says how much they hold and how to free it, and says nothing of them on a GPU."""
    from minipar.comm import shm_orphans
    from minipar.parallel.memory import problem
    from minipar.parallel.validate import RunConfig

    run = RunConfig(n_layer=2, n_embd=64, block_size=32, vocab_size=256, global_batch=8, dtype="float32")
    monkeypatch.setattr(shm_orphans, "orphans", lambda: [("/dev/shm/mpich_shm_1_0", 3e9), ("/dev/shm/mpich_shm_2_0", 1e9)])
    host = problem(run, (1e5, 1, "MemAvailable"), {})
    assert "free the 4.000 GB that MPI jobs which died left in /dev/shm (2 segments)" in host, host
    assert "shm_orphans.py --remove" in host
    gpu = problem(run, (1e5, 1, "free memory of the NVIDIA H200"), {})
    assert gpu and "/dev/shm" not in gpu
    monkeypatch.setattr(shm_orphans, "orphans", lambda: [])
    assert "/dev/shm" not in problem(run, (1e5, 1, "MemAvailable"), {})


def test_a_refusal_prints_the_need_above_what_is_available():
    """It said "needs about 4.0 GB ... but 4.0 GB is available": as many decimals as tell them apart."""
    import re

    from minipar.parallel.memory import batch_bytes, problem, state_bytes
    from minipar.parallel.validate import RunConfig

    run = RunConfig(n_layer=24, n_embd=1024, block_size=1024, vocab_size=50257, global_batch=8, dtype="float32")
    need = state_bytes(run) + batch_bytes(run)
    for short in (1e8, 1e6, 1e3):
        line = problem(run, (need - short, 1, "MemAvailable"), {})
        printed = [float(x) for x in re.findall(r"needs about ([\d.]+) GB.*?but ([\d.]+) GB is available", line)[0]]
        assert printed[0] > printed[1], line


def test_the_trainer_refuses_no_layout_the_planner_says_fits(monkeypatch):
    """The trainer added the most activations of any stage to the fullest state of any stage, and
    the first need not be the second's: layouts the planner fitted in a GPU's memory (its count: the
    fullest stage's state and activations together) were refused. Given the planner's count and
    the batch's token ids (which the planner does not count), every pipelined plan here starts."""
    from minipar import backend
    from minipar.plan import activations, state
    from minipar.plan.commands import train_flags
    from minipar.plan.cost import memory_bytes
    from minipar.plan.enumerate import plan
    from minipar.plan.shapes import Machine, Model, micro_batches
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    model, batch = Model(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=4096), 16
    layouts = [layout for layout, _ in plan(model, Machine(gpus=4, gpus_per_node=4), batch).plans
               if layout.pp > 1 and layout.vpp == 1][:40]
    split_apart = 0
    for layout in layouts:
        m = micro_batches(layout, batch)
        planned = memory_bytes(model, layout, batch)
        apart = activations.peak_bytes(model, layout, m, 4) + max(
            state.stage_peak_bytes(model, layout, s, "float32", m) for s in range(layout.pp))
        split_apart += apart > planned  # the old count: above the planner's
        layers = layout.pipeline_layers or [model.num_layers // layout.pp] * layout.pp  # (a balanced split)
        args = build_parser().parse_args(train_flags(model, layout, batch, layers).split() + ["--plot", "", "--sample", "0"])
        ids = 16 * batch * model.seq_length  # the batch's int64 inputs and targets
        monkeypatch.setattr(backend, "free_memory", lambda host=False, room=planned + ids: (room * 4, 4, "MemAvailable"))
        check_args(args, layout.world_size)  # raises FlagError on a refusal
    assert split_apart, "no layout here where the two counts differ: the test checks nothing"
