"""The planner's step-time, MFU and memory model (minipar/plan/cost.py) against the rules its
docstring states: data parallelism's all-reduce hides behind the backward (2/3 of the compute),
ring attention's passes behind attention's FLOPs (12 L T h of each token's), MFU counts model FLOPs
only, and a layout's memory is its fuller stage's, each stage with its own micro-batches in flight."""

from dataclasses import replace

import pytest

from minipar.plan import activations, bubble, cost, state, traffic
from minipar.plan.shapes import Layout, Machine, Model

SMALL = Model(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=16)


def _bandwidth_for(nbytes, seconds):
    """The link speed (Gbit/s) that moves ``nbytes`` in ``seconds``."""
    return nbytes * 8 / 1e9 / seconds


def test_data_parallels_all_reduce_shows_only_beyond_the_backward():
    """DP's buckets are reduced while backward runs (2/3 of the compute: a backward is two forwards'
    FLOPs): an all-reduce of half the compute's time is hidden, one of the whole compute's time
    shows its last third."""
    layout, batch = Layout(dp=2, micro_batch_size=4), 8
    _, hardware = cost.flops_per_iteration(SMALL, batch)
    machine = Machine(gpus=2, intra_node_latency_us=0.0)
    compute = hardware / 2 / (machine.peak_tflops * 1e12 * machine.efficiency)
    nbytes = traffic.group_bytes(SMALL, layout, batch)["dp"]
    for share, shows in ((0.5, 0.0), (1.0, 1 / 3)):
        p = cost.predict(SMALL, layout, Machine(gpus=2, intra_node_latency_us=0.0,
                                                intra_node_gbps=_bandwidth_for(nbytes, share * compute)), batch)
        assert p.compute_s == pytest.approx(compute, rel=1e-12)
        assert p.comm_s["dp"] == pytest.approx(shows * compute, rel=1e-9, abs=0.0), share
        assert p.step_time_s == pytest.approx((1 + shows) * compute, rel=1e-9), share


def test_ring_attentions_passes_hide_behind_attentions_flops():
    """A ring pass sends the next K,V block while this one's attention runs: 12 L T h FLOPs per
    token (q k^T and P v, forward and backward; Narayanan et al. 2021). Passes taking 3/4 of that
    time are hidden; passes taking 3/2 of it show the excess half."""
    model, layout, batch = Model(4, 64, 4, 256), Layout(cp=2, micro_batch_size=1), 1
    L, h, T = model.num_layers, model.hidden_size, model.seq_length
    machine = Machine(gpus=2, intra_node_latency_us=0.0)
    attention = batch * T * 12 * L * T * h / 2 / (machine.peak_tflops * 1e12 * machine.efficiency)
    nbytes = traffic.group_bytes(model, layout, batch)["cp"]
    for share, shows in ((0.75, 0.0), (1.5, 0.5)):
        p = cost.predict(model, layout, Machine(gpus=2, intra_node_latency_us=0.0,
                                                intra_node_gbps=_bandwidth_for(nbytes, share * attention)), batch)
        assert p.comm_s["cp"] == pytest.approx(shows * attention, rel=1e-9, abs=0.0), share


def test_mfu_counts_the_models_flops_not_recomputations():
    """One rank, nothing to communicate: the step is all compute at the peak x efficiency, so MFU is
    the efficiency. Full recomputation runs the blocks' forward again: a longer step doing the same
    model FLOPs, so MFU falls by model / hardware FLOPs (Narayanan et al.'s 3/4 for large h)."""
    machine = Machine(gpus=1)
    plain = cost.predict(SMALL, Layout(micro_batch_size=4), machine, 8)
    again = cost.predict(SMALL, Layout(micro_batch_size=4, recompute=True), machine, 8)
    model_flops, hardware = cost.flops_per_iteration(SMALL, 8, recompute=True)
    assert plain.mfu == pytest.approx(machine.efficiency, rel=1e-12)
    assert again.mfu == pytest.approx(machine.efficiency * model_flops / hardware, rel=1e-12)
    assert 0.75 < model_flops / hardware < 0.8


@pytest.mark.parametrize("vocab,fuller", [(50257, "last"), (256, "first")])
def test_memory_is_the_fuller_stages_with_its_own_micro_batches_in_flight(vocab, fuller):
    """Each stage holds its own state and activations: 1F1B keeps p = 2 micro-batches in flight on
    the first stage and 1 on the last, which also holds the tied embedding's copy and the logits.
    With GPT-2's vocabulary the last stage is the fuller, with 256 bytes the first; the plan's
    memory is the fuller one's."""
    model, layout = Model(4, 16, 4, 16, vocab_size=vocab), Layout(pp=2, micro_batch_size=1)
    held = {}
    for name, stage, in_flight in (("first", 0, 2), ("last", 1, 1)):
        states = sum(state.state_bytes(model, layout, stage).values())
        acts = activations.rank_bytes(model, layout, stage, ((in_flight, 1),), 4)  # (1: its newest output unsent)
        held[name] = states + acts
    assert max(held, key=held.get) == fuller
    assert cost.predict(model, layout, Machine(gpus=2), 8).memory_gb == held[fuller] / 1e9


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_deferred_head_weights_add_their_parked_bytes_at_the_last_ranks_peak(tp, sp):
    """--defer-embedding-wgrad-compute: 1F1B's last rank (PP 2, m 4) peaks with one micro-batch in
    flight and three head W's parked, each the head's input (whole under SP) and the logits'
    gradient, d b s (h + V/t); the first rank parks none. The plan's memory counts them."""
    plain = Layout(tp=tp, pp=2, micro_batch_size=2, sequence_parallel=sp)
    deferred, parked = replace(plain, defer_embedding_wgrad=True), 4 * 2 * 16 * (16 + 256 // tp)
    peaks = bubble.in_flight("1f1b", 2, 4, 1, 1, defer_head=True)
    last = activations.rank_bytes(SMALL, deferred, 1, peaks, 4)
    assert last == activations.rank_bytes(SMALL, plain, 1, ((1, 1),), 4) + 3 * parked
    first = activations.rank_bytes(SMALL, plain, 0, ((2, 1),), 4)
    assert activations.rank_bytes(SMALL, deferred, 0, bubble.in_flight("1f1b", 2, 4, 1, 0, True), 4) == first
    assert activations.peak_bytes(SMALL, deferred, 4, 4) == max(first, last)
    held = [sum(state.state_bytes(SMALL, deferred, s).values()) + acts for s, acts in ((0, first), (1, last))]
    assert cost.predict(SMALL, deferred, Machine(gpus=2 * tp), 8).memory_gb == max(held) / 1e9


def test_a_pipelines_busiest_link_is_a_middle_stages():
    """A middle stage sends activations on and gradients back, twice an edge stage's pipeline
    bytes: the prediction of PP >= 3 takes the busiest stage's, not the edges'."""
    from minipar.plan.traffic import group_bytes

    model, layout = Model(8, 16, 4, 16), Layout(pp=4, micro_batch_size=1)
    per_stage = [group_bytes(model, layout, 8, s)["pp"] for s in range(4)]
    assert per_stage[1] == per_stage[2] > per_stage[0] == per_stage[3]
    assert cost.predict(model, layout, Machine(4), 8).bytes_per_group["pp"] == per_stage[1]


def test_a_group_that_crosses_a_nodes_edge_is_inter_node_though_it_fits_in_one():
    """TP 4 on nodes of 6 GPUs: ranks 4-7 form a TP group across nodes 0 and 1; TP 3 tiles them."""
    machine = Machine(12, gpus_per_node=6)
    assert cost.link(Layout(tp=4, dp=3, micro_batch_size=1), machine, "tp") == "inter"
    assert cost.link(Layout(tp=3, dp=4, micro_batch_size=1), machine, "tp") == "intra"
    assert cost.link(Layout(tp=2, dp=6, micro_batch_size=1), machine, "dp") == "inter"
    assert cost.link(Layout(tp=2, dp=1, micro_batch_size=1), Machine(2, gpus_per_node=8), "tp") == "intra"
