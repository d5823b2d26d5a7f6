"""Megatron-LM's deferred embedding wgrad (``schedules.defer_head_weight``): where the head's W's
go in each schedule, what they buy on paper (the stages' FLOPs replayed), what is refused, and the
trainer's replay of a step that ran them; with them, the last linear layers' (``--defer-wgrad-linears``).
Against one device under MPI: tests/mpi/pipeline.py."""

from fractions import Fraction

import pytest

import minipar
from minipar.mfu import flops_per_token
from minipar.models import GPT, GPTConfig
from minipar.parallel import validate
from minipar.parallel.pipeline import schedules as S
from minipar.parallel.pipeline import stage_times
from minipar.parallel.pipeline.simulate import simulate
from test_stage_times import table_of


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 2, 3, 1), ("1f1b", 4, 6, 1), ("1f1b-slack", 3, 5, 1),
                                        ("interleaved", 2, 4, 2)])
def test_the_last_chunk_defers_one_head_w_per_micro_batch_to_just_before_the_step(name, p, m, v):
    plain, deferred = S.build(name, p, m, v), S.build(name, p, m, v, defer_head=True)
    rank, chunk = S.Pipeline(p, m, v).place(p * v - 1)
    assert all(deferred[r] == plain[r] for r in range(p) if r != rank)
    order = deferred[rank]
    heads = [i for i in order if i.op == S.HEAD_WEIGHT]
    backwards = [i.mb for i in order if i.op == S.BACKWARD and i.chunk == chunk]
    assert [i.mb for i in heads] == backwards and {i.chunk for i in heads} == {chunk}
    assert order[-len(heads) - 1:] == heads + [S.Instruction(S.STEP)]  # all at the flush
    assert [i for i in order if i.op != S.HEAD_WEIGHT] == plain[rank]
    simulate(deferred, m, v)  # runs to the end: every head W after its backward, none left over


def flops_costs(p, m, v=1, n_layer=4, n_embd=128, vocab=256):
    """(forward, backward, head W) per chunk: each chunk's training FLOPs per token (its blocks',
    the last chunk's head too), a third forward, two thirds backward; the head's W a third of its."""
    block, head = flops_per_token(1, n_embd, 128, 0), flops_per_token(0, n_embd, 128, vocab)
    pipe = S.Pipeline(p, m, v)
    last = {(r, c): pipe.global_chunk(r, c) == p * v - 1 for r in range(p) for c in range(v)}
    cost = {k: Fraction(n_layer, p * v) * block + head * is_last for k, is_last in last.items()}
    return ({k: x / 3 for k, x in cost.items()}, {k: 2 * x / 3 for k, x in cost.items()},
            {k: head / 3 * is_last for k, is_last in last.items()})


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 8, 1), ("gpipe", 2, 8, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved", 2, 8, 2)])
def test_the_flush_hides_the_head_ws_and_shortens_the_step(name, p, m, v):
    """The head gives the last stage more work than the others: its W's moved to the flush come
    off the critical path (1F1B p 2, m 8: the bubble of the stages' FLOPs 0.134 -> 0.117, the
    equal-stage formula 0.111). Costing nothing, they change nothing."""
    forward, backward, head = flops_costs(p, m, v)
    before = simulate(S.build(name, p, m, v), m, v, forward=forward, backward=backward, head=head)
    after = simulate(S.build(name, p, m, v, defer_head=True), m, v, forward=forward, backward=backward, head=head)
    assert after.makespan < before.makespan
    assert sum(after.busy.values()) == sum(before.busy.values())  # the same work, moved
    if (name, p, m) == ("1f1b", 2, 8):
        assert round(float(sum(before.bubble.values()) / p), 3) == 0.134
        assert round(float(sum(after.bubble.values()) / p), 3) == 0.117
    free = simulate(S.build(name, p, m, v, defer_head=True), m, v, forward=forward, backward=backward)
    assert free.makespan == before.makespan


def test_the_simulator_checks_the_head_ws():
    plans = S.build("1f1b", 2, 4, defer_head=True)
    order = plans[1]
    early = [i for i in order if i.op == S.HEAD_WEIGHT][:1]
    broken = early + [i for i in order if i not in early]  # H0 before its forward and backward
    with pytest.raises(RuntimeError, match="before its backward"):
        simulate({**plans, 1: broken}, 4)
    dropped = [i for i in order if not (i.op == S.HEAD_WEIGHT and i.mb == 2)]
    with pytest.raises(RuntimeError, match="W never ran|every micro-batch"):
        simulate({**plans, 1: dropped}, 4)
    with pytest.raises(ValueError, match="cannot cost more than the backward"):
        simulate(plans, 4, head=3)


@pytest.mark.parametrize("cfg,message", [
    (dict(pp=1, schedule="1f1b"), "flush, while the last stage waits for the first: it needs PP > 1"),
    (dict(pp=2, schedule="zb-h1"), "already runs every weight gradient apart (W), the head's among them"),
    (dict(pp=2, schedule="zb-v", virtual_stages=2), "already runs every weight gradient apart"),
    (dict(pp=2, schedule="pipedream-2bw"), "never flushes, so nothing hides the head's weight gradients"),
])
def test_what_cannot_defer_the_head_is_refused(cfg, message):
    problems = validate.problems(validate.RunConfig(defer_embedding_wgrad=True, **cfg),
                                 names={"defer_embedding_wgrad": "--defer-embedding-wgrad-compute"})
    assert len(problems) == 1 and message in problems[0] and "--defer-embedding-wgrad-compute" in problems[0]
    assert not validate.problems(validate.RunConfig(**cfg))


LINEAR_FLAGS = {"defer_embedding_wgrad": "--defer-embedding-wgrad-compute", "defer_wgrad_linears": "--defer-wgrad-linears",
                "num_experts": "--num-experts", "schedule": "--schedule", "pp": "--pp", "moe_layer_freq": "--moe-layer-freq"}


@pytest.mark.parametrize("cfg,message", [
    (dict(defer_embedding_wgrad=False), "beside the head's, which go to the flush first: add --defer-embedding-wgrad-compute"),
    # a block with experts has no MLP products: the dense blocks that end the last chunk, if any
    (dict(num_experts=4), "parks the linear layers of dense blocks, and block 3 has experts (every "
                          "--moe-layer-freq-th block from the first, 1): drop it"),
    (dict(num_experts=4, moe_layer_freq=2, defer_wgrad_linears=5), "block 2 has experts (every --moe-layer-freq-th "
                                                                   "block from the first, 2): park at most 4"),
    (dict(num_experts=4, defer_wgrad_linears="balanced"), "block 3 has experts"),
    # where the head's deferral cannot be, the fix is to drop this one, not to add that one
    (dict(defer_embedding_wgrad=False, schedule="zb-h1"), "flushes with whole backwards (gpipe, 1f1b, "
                                                          "1f1b-slack, interleaved; --pp > 1), not --schedule zb-h1: drop it"),
    (dict(defer_embedding_wgrad=False, pp=1), "not --pp 1: drop it"),
    (dict(schedule="pipedream-2bw"), "--defer-embedding-wgrad-compute (and --defer-wgrad-linears) needs one of gpipe"),
    (dict(defer_wgrad_linears=9), "is more than the last pipeline chunk's 8 linear layers (4 per block): park at most 8"),
    (dict(defer_wgrad_linears=5, pipeline_layers=(3, 1)), "the last pipeline chunk's 4 linear layers (4 per block)"),
    # interleaved: the last chunk is one of pp x v, 8 layers giving it 2 blocks
    (dict(schedule="interleaved", virtual_stages=2, n_layer=8, micro_batches=4, defer_wgrad_linears=9),
     "the last pipeline chunk's 8 linear layers (4 per block): park at most 8"),
    (dict(defer_wgrad_linears=-1), "must be a whole number of linear layers, 0 or more, got -1"),
    (dict(defer_wgrad_linears=True), "must be a whole number of linear layers, 0 or more, got True"),
])
def test_what_cannot_defer_the_last_linear_layers_is_refused(cfg, message):
    run = dict(pp=2, schedule="1f1b", n_layer=4, defer_embedding_wgrad=True, defer_wgrad_linears=3)
    problems = validate.problems(validate.RunConfig(**{**run, **cfg}), names=LINEAR_FLAGS)
    assert len(problems) == 1 and message in problems[0] and "--defer-wgrad-linears" in problems[0], problems
    for fine in (dict(defer_wgrad_linears=8, zero_stage=3), dict(defer_wgrad_linears=4, pipeline_layers=(3, 1)),
                 dict(defer_wgrad_linears=4, num_experts=4, moe_layer_freq=2), dict(defer_wgrad_linears="balanced")):
        assert not validate.problems(validate.RunConfig(**{**run, **fine}))


def test_the_last_linear_layers_are_those_backward_reaches_first():
    """The head's neighbours, from the last block's MLP output projection back through its block
    and on into the block before; on a pipeline, the last stage's last chunk."""
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=16))
    names = {id(p): n for n, p in model.named_parameters()}
    order = ["mlp.c_proj", "mlp.c_fc", "attn.c_proj", "attn.c_attn"]
    assert [names[id(w)] for w in model.last_linear_weights(6)] == (
        [f"transformer.h.1.{n}.weight" for n in order] + [f"transformer.h.0.{n}.weight" for n in order[:2]])
    assert model.last_linear_weights(0) == [] and len(model.last_linear_weights(99)) == 8
    # with experts in every second block from the first, the last block is dense: its four
    moe = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=16, num_experts=2, moe_layer_freq=2))
    names = {id(p): n for n, p in moe.named_parameters()}
    assert [names[id(w)] for w in moe.last_linear_weights(4)] == [f"transformer.h.1.{n}.weight" for n in order]


def test_the_replay_of_a_step_with_the_head_ws_gives_it_back():
    """The trainer's expected bubble: the measured durations (the head's W in the W slot) replayed
    on the deferring schedule give the step back; replayed on the plain one they would not."""
    p, m = 2, 8
    forward, backward, head = flops_costs(p, m)
    sim = simulate(S.build("1f1b", p, m, defer_head=True), m, forward=forward, backward=backward, head=head)
    table = table_of(sim, p, 1, m)
    assert stage_times.costs_ms(table, 1, m)["weight"][1] == [round(float(head[1, 0]) * 1e3, 3)]
    measured = stage_times.bubble(table)
    assert stage_times.expected("1f1b", 1, m, table, defer_head=True) == pytest.approx(measured, rel=1e-6)
    assert stage_times.expected("1f1b", 1, m, table) != pytest.approx(measured, rel=1e-3)
    # and the trainer's --log-json row replays it so, the flag read from the run's arguments
    from types import SimpleNamespace

    from minipar.train import build_parser
    from minipar.train_report import Reports

    args = build_parser().parse_args(["--pp", "2", "--defer-embedding-wgrad-compute", "--log-json", "log.jsonl"])
    args.micro_batches = m
    trainer = SimpleNamespace(args=args, v=1, stages=table, opt=SimpleNamespace(policy=None), routing=None,
                              rates={0: 1e-3})
    row = Reports._record(trainer, 0, 1.0, 1.0, measured, 1.0, 0.5)
    assert row["bubble_expected"] == pytest.approx(measured, rel=1e-6)


def test_the_balanced_count_of_linear_layers_idles_least_on_paper():
    """``--defer-wgrad-linears balanced``: the K whose FLOPs replay idles least. For
    bench/scaling.py's model (the head 1/14 of the last stage) one MLP product's W fills the drain
    (0.079 against the head's alone 0.117 there); a GPT-2 head (4.5 blocks) keeps the last stage the
    pace-setter whatever moves, so none (its fix is --pipeline-layers balanced); at m = 2, where the
    drain is most of the step, all 8."""
    from minipar.plan import hetero
    from minipar.plan.shapes import Model

    bench, gpt2 = Model(4, 128, 4, 128, 256), Model(12, 768, 12, 1024, 50257)
    assert hetero.balanced_linears(bench, 2, 8) == 1
    assert hetero.balanced_linears(gpt2, 2, 8) == 0 and hetero.balanced_linears(gpt2, 2, 8, layers=(8, 4)) == 0
    assert hetero.balanced_linears(bench, 2, 2) == 8
    # a recomputed block's forward runs again in backward: the last stage longer, more to move
    assert hetero.balanced_linears(bench, 2, 4) == 4 and hetero.balanced_linears(bench, 2, 4, recompute=True) == 6
    # experts in every second block from the first: the last block is dense, its 4 the most to park
    assert hetero.balanced_linears(Model(4, 128, 4, 128, 256, num_experts=4, moe_layer_freq=2), 2, 2) == 4
    with pytest.raises(ValueError, match="already runs every weight gradient apart"):
        hetero.balanced_linears(bench, 2, 8, "zb-h1")
