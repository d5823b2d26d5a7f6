"""The planner's heterogeneous pipelines (``plan/hetero.py``): layers per stage balanced to the
stages' speeds, which the nodes each stage sits on decide, and what balancing saves."""

import itertools
from fractions import Fraction

import pytest

from minipar.parallel.pipeline.simulate import theoretical_bubble
from minipar.plan import hetero
from minipar.plan.shapes import Layout
from test_plan_cli import run_plan

def test_balance_minimises_the_slowest_stage():
    for L, speeds in ((8, [1, 1, 0.5]), (12, [2, 1, 1, 0.5]), (6, [1, 1])):
        layers = hetero.balance(L, speeds)
        assert sum(layers) == L and min(layers) >= 1
        best = min(max(Fraction(n) / Fraction(s) for n, s in zip(split, speeds))
                   for split in itertools.product(range(1, L + 1), repeat=len(speeds)) if sum(split) == L)
        assert max(Fraction(n) / Fraction(s) for n, s in zip(layers, speeds)) == best
    assert hetero.balance(8, [1, 1, 1, 1]) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="needs a layer"):
        hetero.balance(2, [1, 1, 1])


def test_balancing_a_slow_stage_shortens_the_step_and_the_bubble():
    out = hetero.compare(16, [1, 1, 1, 0.5], 8)
    (even, t_even, b_even), (balanced, t_bal, b_bal) = out["even"], out["balanced"]
    assert even == [4, 4, 4, 4] and balanced == [5, 5, 4, 2] and t_bal < t_even and b_bal < b_even
    same = hetero.compare(16, [1, 1, 1, 1], 8)  # equal speeds: nothing to gain, the textbook bubble
    assert same["even"][1:] == same["balanced"][1:] and same["even"][2] == theoretical_bubble(4, 8)


def test_stage_speeds_follow_the_nodes_each_stage_sits_on():
    assert hetero.stage_speeds(Layout(tp=8, pp=2), 8, [1.0, 0.5]) == [1.0, 0.5]
    assert hetero.stage_speeds(Layout(tp=4, pp=2), 8, [0.5]) == [0.5, 0.5]
    with pytest.raises(ValueError, match="node speeds"):
        hetero.stage_speeds(Layout(tp=8, pp=2), 8, [1.0])


def test_the_slowest_node_paces_a_stage_that_spans_nodes():
    """A stage of 16 ranks spans two nodes of 8; its ranks finish each micro-batch together, so a
    half-speed node makes the whole stage run at half speed."""
    assert hetero.stage_speeds(Layout(tp=4, pp=2, dp=4), 8, [1.0, 0.5, 1.0, 1.0]) == [0.5, 1.0]
    assert hetero.stage_speeds(Layout(tp=4, pp=2, dp=4), 8, [1.0, 1.0, 0.25, 1.0]) == [1.0, 0.25]


def test_the_command_line_shows_the_balancing_win():
    run = run_plan("--preset", "gpt2", "--gpus", "16", "--top", "1", "--gpu-memory-gb", "2", "--node-speeds", "1,0.5")
    assert run.returncode == 0, run.stderr
    # the half-speed stage also runs GPT-2's head, 4.46 blocks: it keeps one layer, 11 + 0 against (1 + 4.46) / 0.5
    assert "balanced  layers per stage [11, 1]" in run.stdout and "balancing saves" in run.stdout


def test_the_balanced_plans_command_is_one_the_trainer_takes(monkeypatch):
    """The printed command carries the plan's whole layout (its schedule too: a ZB-H1 plan balanced
    and simulated as 1F1B, run as 1F1B, was not the plan), and the trainer accepts it as given."""
    from minipar import backend
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    run = run_plan("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                   "--global-batch-size", "16", "--gpus", "16", "--node-speeds", "1,0.5")
    assert run.returncode == 0, run.stderr
    (line,) = [l for l in run.stdout.splitlines() if "to run it on" in l]
    ranks, command = line.split("to run it on ")[1].split(" ranks: ./run_mpi.sh -n ")
    n, command = command.split(" -m minipar.train ")
    assert n == ranks
    args = build_parser().parse_args(command.split())
    assert args.pipeline_layers and args.schedule in run.stdout.split("heterogeneous GPUs:")[1]
    monkeypatch.setattr(backend, "free_memory", lambda host=False: None)  # this machine's memory is not the plan's
    check_args(args, int(ranks))


def test_the_head_counts_as_the_blocks_its_flops_make():
    """GPT-2's head (V 50257, h 768, T 1024) is 4.46 blocks' training FLOPs: its stage takes fewer
    layers, optimally (every split tried), and the simulator says the step is shorter for it."""
    from minipar.plan.shapes import PRESETS

    head = hetero.head_in_blocks(PRESETS["gpt2"][0])
    assert round(float(head), 2) == 4.46
    assert hetero.head_in_blocks(PRESETS["gpt2"][0], recompute=True) == head * Fraction(3, 4)
    for L, speeds in ((12, [1, 1]), (12, [1, 1, 1, 1]), (9, [1, 0.5, 1])):
        layers = hetero.balance(L, speeds, head)
        cost = lambda split: max((n + head * (i == len(split) - 1)) / Fraction(s)  # noqa: E731
                                 for i, (n, s) in enumerate(zip(split, speeds)))
        best = min(cost(split) for split in itertools.product(range(1, L + 1), repeat=len(speeds)) if sum(split) == L)
        assert sum(layers) == L and cost(layers) == best
    assert hetero.balance(12, [1, 1], head) == [8, 4] and hetero.balance(12, [1] * 4, head) == [4, 4, 3, 1]
    assert hetero.chunk_layers(12, 2, 1, head) == [8, 4] and hetero.chunk_layers(12, 2, 2, head) == [4, 3, 4, 1]
    out = hetero.compare(12, [1, 1], 8, last=head)
    assert out["balanced"][0] == [8, 4] and out["balanced"][1] < out["even"][1] and out["balanced"][2] < out["even"][2]


@pytest.mark.parametrize("flags,layers", [
    ("--pp 2 --n-layer 12 --vocab-size 4096", (8, 4)),  # the head 4.9 blocks, about GPT-2's 4.5
    # each rank's share first (8 and 4 + the head), then over its chunks: the head's chunk the smaller
    ("--pp 2 --vpp 2 --schedule interleaved --n-layer 12 --vocab-size 4096", (4, 3, 4, 1)),
    ("--pp 2 --vpp 2 --schedule zb-v --n-layer 12 --vocab-size 4096", (3, 4, 4, 1)),  # the V: rank 0 holds chunks 0 and 3
    ("--pp 2 --n-layer 7", (4, 3)),  # a small head: as even as 7 layers allow (an even split is refused)
])
def test_the_trainer_runs_the_balanced_split(monkeypatch, flags, layers):
    from minipar import backend
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    monkeypatch.setattr(backend, "free_memory", lambda host=False: None)
    args = build_parser().parse_args(f"{flags} --n-embd 64 --block-size 32 --pipeline-layers balanced".split())
    check_args(args, 2)
    assert args.pipeline_layers == layers


def test_a_balanced_split_needs_a_pipeline():
    from minipar.cli import FlagError
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    with pytest.raises(FlagError) as refusal:
        check_args(build_parser().parse_args(["--pipeline-layers", "balanced"]), 1)
    assert refusal.value.lines == ["--pipeline-layers balanced splits the layers between pipeline chunks, and "
                                   "--pp x --vpp is 1: give --pp > 1, or drop it"]


def test_a_balanced_zb_v_of_other_than_two_chunks_a_rank_gets_validates_line():
    """The balancer runs before the layout is checked: a V of 3 chunks a rank, where no rank's last
    chunk is the head's, raised StopIteration on every rank, not validate's line."""
    from minipar.cli import FlagError
    from minipar.plan import hetero
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    with pytest.raises(FlagError) as refusal:
        check_args(build_parser().parse_args("--pp 2 --vpp 3 --schedule zb-v --n-layer 6 --pipeline-layers balanced".split()), 2)
    assert any("zb-v places two chunks per rank in a V: it needs" in line for line in refusal.value.lines), refusal.value.lines
    with pytest.raises(ValueError, match="no rank's last chunk is the head's"):
        hetero.chunk_layers(6, 2, 3, shape="v")


def test_the_planner_prices_the_heads_stage_and_plans_its_balanced_split():
    """A pipeline runs at its busiest rank's pace: GPT-2's head (4.46 blocks) on the last of two
    stages of 6 makes it 1.27x the mean, the balanced 8, 4 1.03x; the enumerator tries both splits."""
    from minipar.plan.cost import stage_imbalance
    from minipar.plan.enumerate import balanced
    from minipar.plan.shapes import PRESETS

    model = PRESETS["gpt2"][0]
    even, split = Layout(pp=2, dp=8), Layout(pp=2, dp=8, pipeline_layers=(8, 4))
    assert stage_imbalance(model, Layout(dp=16)) == 1.0
    assert round(stage_imbalance(model, even), 3) == round(2 * (6 + 4.4617) / (12 + 4.4617), 3) == 1.271
    assert round(stage_imbalance(model, split), 3) == 1.028
    assert balanced(model, even) == (8, 4) and balanced(model, Layout(pp=2, vpp=2, dp=8, schedule="zb-v")) == (3, 4, 4, 1)
    assert balanced(model, Layout(pp=3, dp=4)) == (6, 5, 1) and balanced(model, Layout(pp=5, dp=2)) is None  # 12 % 5
    run = run_plan("--preset", "gpt2", "--gpus", "16", "--top", "3", "--gpu-memory-gb", "2")
    assert run.returncode == 0 and "--pipeline-layers 3,4,4,1" in run.stdout.split("why the rest fail")[0], run.stdout
