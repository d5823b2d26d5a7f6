"""The planner's overhead terms (minipar/plan/overhead.py): launches per layer pass, a cost per
communication call, cores shared by ranks. Their counts against real runs: tests/mpi/plan_counts.py
(calls per group, exactly) and lesson 11 (every layout's calls, and the ranking of step times)."""

import pytest

from minipar.plan import cost, overhead, traffic
from minipar.plan.shapes import Layout, Machine, Model

MODEL = Model(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32)


def test_the_overheads_default_to_nothing():
    layout = Layout(tp=2, dp=4, sequence_parallel=True, micro_batch_size=2)
    bare = cost.predict(MODEL, layout, Machine(gpus=8), 16)
    zeros = cost.predict(MODEL, layout, Machine(gpus=8, layer_overhead_us=0, call_overhead_us=0, cores_per_node=0), 16)
    assert bare == zeros


def test_one_rank_pays_each_layer_and_edge_pass():
    # 1 rank, 16 sequences in micro-batches of 4: m = 4 passes of 4 layers, and of the embedding and head
    layout = Layout(micro_batch_size=4)
    assert overhead.layer_passes(MODEL, layout, 16, 0) == (16, 8)
    bare = cost.predict(MODEL, layout, Machine(gpus=1), 16)
    paid = cost.predict(MODEL, layout, Machine(gpus=1, layer_overhead_us=1000, edge_overhead_us=10), 16)
    assert paid.step_time_s - bare.step_time_s == pytest.approx(16 * 1e-3 + 8 * 1e-5)


def test_recomputation_runs_each_forward_again_and_zero3_does_not():
    full, zero3 = Layout(micro_batch_size=4, recompute=True), Layout(dp=2, zero_stage=3, micro_batch_size=4)
    assert overhead.layer_passes(MODEL, full, 16, 0) == (16 * 4 / 3, 8)
    assert overhead.layer_passes(MODEL, zero3, 16, 0) == (8, 4)


def test_ring_attention_makes_cp_passes_where_one_device_makes_one():
    # CP4 ring, m = 2 (4 rows per DP rank in micro-batches of 2), 4 layers: 3 passes more per
    # attention forward and backward; with recomputation a second forward; Ulysses none
    ring = Layout(cp=4, dp=2, micro_batch_size=2)
    assert overhead.ring_passes(MODEL, ring, 8, 0) == 2 * 4 * 3 * 2
    assert overhead.ring_passes(MODEL, Layout(cp=4, dp=2, micro_batch_size=2, recompute=True), 8, 0) == 2 * 4 * 3 * 3
    assert overhead.ring_passes(MODEL, Layout(cp=4, dp=2, micro_batch_size=2, cp_comm_type="a2a"), 8, 0) == 0
    bare = overhead.launch_seconds(MODEL, ring, Machine(gpus=8), 8, 0)
    assert overhead.launch_seconds(MODEL, ring, Machine(gpus=8, ring_pass_overhead_us=100), 8, 0) - bare == \
        pytest.approx(48 * 1e-4)


def test_zero3_calls_once_per_parameter_group_of_each_unit():
    # L + 3 groups (wte, wpe, each block, ln_f) per micro-batch: L + 4 gathers for the forwards (wte
    # for the embeddings and the head), L + 2 for the backwards (not wpe: a lookup's backward reads
    # no table), L + 3 reduce-scatters; and the gradient norm's all-reduce
    layout = Layout(dp=4, zero_stage=3, micro_batch_size=1)
    assert traffic.group_calls(MODEL, layout, 8, 0) == {"dp": 2 * (8 + 6 + 7) + 1}


def test_a_pipeline_message_is_a_send_and_a_receive():
    layout = Layout(pp=2, micro_batch_size=1)  # m = 4: stage 0 sends 4 activations, receives 4 gradients
    assert traffic.group_calls(MODEL, layout, 4, 0)["pp"] == 2 * 4 + 1


@pytest.mark.parametrize("ranks,cores,share", [(8, 2, 4.0), (4, 2, 2.0), (2, 2, 1.0), (8, 0, 1.0)])
def test_ranks_beyond_the_cores_take_turns(ranks, cores, share):
    layout = Layout(dp=ranks, micro_batch_size=1)
    machine = Machine(gpus=ranks, gpus_per_node=ranks, cores_per_node=cores, layer_overhead_us=100)
    assert overhead.core_share(layout, machine) == share
    p = cost.predict(MODEL, layout, machine, 16)
    assert p.step_time_s >= share * p.compute_s


def test_sharing_cores_hides_the_bubble():
    # PP 4 on 4 ranks: with a core each the bubble stretches the compute; on 1 core the ranks take
    # turns and the step is 4 x one rank's busy time, bubble or not
    layout, args = Layout(pp=4, micro_batch_size=1), dict(gpus=4, gpus_per_node=4, layer_overhead_us=1000)
    own, shared = cost.predict(MODEL, layout, Machine(**args), 8), cost.predict(MODEL, layout, Machine(cores_per_node=1, **args), 8)
    def rest(p):  # the messages between stages wait on the pipeline; the embedding's sum after it
        return p.comm_s["pp"] / (1 - p.bubble) + p.comm_s["embedding"]
    assert set(own.comm_s) == {"pp", "embedding"} and own.bubble > 0.2
    assert own.step_time_s == pytest.approx(own.compute_s / (1 - own.bubble) + rest(own))
    assert shared.step_time_s == pytest.approx(4 * shared.compute_s + rest(shared))


def test_ranks_share_the_cores_of_their_own_node_only():
    """16 ranks on 2 nodes of 8, each node 2 cores: a node's 8 ranks take turns on its 2 cores, 4 to
    a core; the other node's cores are not theirs to wait for (the whole job's 16 would make it 8)."""
    layout = Layout(dp=16, micro_batch_size=1)
    machine = Machine(gpus=16, gpus_per_node=8, cores_per_node=2, layer_overhead_us=100)
    assert overhead.core_share(layout, machine) == 4.0
    p = cost.predict(MODEL, layout, machine, 16)
    assert p.step_time_s == pytest.approx(4 * p.compute_s + sum(p.comm_s.values()))
