"""A parameter's placement (no MPI): splits cut and join back, placements refuse what cannot be,
and the one rule that counts each copy once holds on every rank of a pure Layout, for the norm
(once per DP replica) and for the checkpoint (once in the world)."""

import itertools

import numpy as np
import pytest

import minipar
from minipar.models import GPT, GPTConfig
from minipar.nn import Linear, Parameter
from minipar.parallel import Layout, ProcessGrid
from minipar.parallel.zero3 import ZeRO3
from minipar.placement import REPLICATED, Placement, Split, is_primary, split_over


@pytest.mark.parametrize("shape,axis,chunks,padded", [((12, 5), 0, 3, None), ((6, 8), 1, 1, None),
                                                      ((10, 4), 0, 1, 12), ((7,), 0, 1, 8)])
def test_a_split_cuts_equal_parts_that_join_into_the_whole(shape, axis, chunks, padded):
    whole = np.arange(np.prod(shape), dtype=float).reshape(shape)
    split = Split("tp", axis, shape[axis], chunks, padded)
    for n in (1, 2, 4):
        if split.padded % (chunks * n):
            with pytest.raises(ValueError, match=f"do not divide among {n} ranks of 'tp'"):
                split.shard(whole, 0, n)
            continue
        parts = [split.shard(whole, i, n) for i in range(n)]
        assert all(p.shape == parts[0].shape for p in parts)
        assert parts[0].shape[axis] == split.part_length(n) * chunks
        assert split.whole_shape(parts[0].shape) == shape
        np.testing.assert_array_equal(split.unshard(parts), whole)


def test_the_vocabulary_is_padded_to_the_next_multiple_of_tp_and_no_further():
    from minipar.parallel.tensor import padded_vocab

    assert [padded_vocab(50257, tp) for tp in (1, 2, 8)] == [50257, 50258, 50264]
    assert padded_vocab(256, 4) == 256 and padded_vocab(10, 4) == 12


def test_a_split_of_the_fused_qkv_gives_each_rank_its_heads_of_q_k_and_v():
    q, k, v = np.zeros((4, 2)), np.ones((4, 2)), np.full((4, 2), 2.0)
    part = Split("tp", 0, 12, chunks=3).shard(np.concatenate([q, k, v]), 1, 2)
    np.testing.assert_array_equal(part[:, 0], [0, 0, 1, 1, 2, 2])


def test_placements_refuse_what_cannot_be():
    with pytest.raises(ValueError, match="drop 'tp' from copies"):
        Placement(Split("tp", 0, 4), copies=("tp", "dp"))
    with pytest.raises(ValueError, match="group names"):
        Placement(grad_sum=("dp", 3))
    with pytest.raises(ValueError, match="do not form 3 equal blocks"):
        Split("tp", 0, 10, chunks=3)
    with pytest.raises(ValueError, match="padded >= size"):
        Split("tp", 0, 10, padded=8)
    with pytest.raises(ValueError, match="do not divide among 6 ranks"):  # 6 ranks, 3 blocks of 2 each
        Split("tp", 0, 6, chunks=3).part_length(6)
    with pytest.raises(AttributeError):
        REPLICATED.copies = ()  # frozen: one shared default for every parameter


def test_placement_defaults_and_additions():
    assert Parameter(np.ones(3)).placement == REPLICATED == Placement(None, ("tp", "cp", "dp"), ("dp",))
    assert Linear(2, 3).weight.placement.split is None
    tied = split_over("tp", 0, 32, padded=32).also(copies="embedding", grad_sum=("embedding", "dp"))
    assert tied.copies == ("cp", "dp", "embedding") and tied.grad_sum == ("dp", "embedding")
    assert REPLICATED.also(grad_sum="tp").grad_sum == ("dp", "tp")


def test_layout_names_each_rank_in_its_groups():
    lay = Layout(tp=2, pp=3, dp=2, cp=2)
    for r in range(lay.world_size):
        ranks = lay.ranks(r)
        for kind in ("tp", "cp", "dp", "pp", "dp_cp"):
            assert getattr(lay, f"{kind}_group")(r)[ranks[kind]] == r
        assert ("embedding" in ranks) == (ranks["pp"] in (0, 2))
        if "embedding" in ranks:
            assert ranks["embedding"] == (ranks["pp"] == 2)


def _gpt_on(lay, sequence_parallel):
    """What every rank of a GPT on ``lay`` holds: {rank: [(name, placement)]}, declared as the
    layers declare it (tensor.py, layers.py, gpt.py)."""
    tied = split_over("tp", 0, 13, padded=-(-13 // lay.tp) * lay.tp) if lay.tp > 1 else REPLICATED
    if lay.pp > 1:
        tied = tied.also(copies="embedding", grad_sum="embedding")
    partial = REPLICATED.also(grad_sum="tp") if sequence_parallel else REPLICATED
    column = split_over("tp", 0, 24, chunks=3) if lay.tp > 1 else REPLICATED
    row = split_over("tp", 1, 8) if lay.tp > 1 else REPLICATED
    held = {}
    for r in range(lay.world_size):
        stage = lay.coords(r).pp
        mine = [(f"h.{stage}.{n}", p) for n, p in (("ln_1", partial), ("c_attn", column), ("c_proj", row),
                                                  ("c_proj.bias", partial))]
        if stage in (0, lay.pp - 1):
            mine.append(("wte", tied))
        if stage == 0:
            mine.append(("wpe", partial))
        if stage == lay.pp - 1:
            mine.append(("ln_f", partial))
        held[r] = mine
    return held


@pytest.mark.parametrize("tp,pp,dp,sp", [(2, 2, 2, True), (1, 4, 2, False), (4, 1, 2, True), (2, 3, 1, False),
                                         (1, 1, 1, False)])
def test_each_element_is_counted_once_per_replica_and_written_once(tp, pp, dp, sp):
    lay = Layout(tp=tp, pp=pp, dp=dp)
    norm, written = {}, {}
    for r, params in _gpt_on(lay, sp).items():
        ranks = lay.ranks(r)
        for name, placement in params:
            part = ranks["tp"] if placement.split is not None else None
            if is_primary(placement, dict(ranks, dp=0)):  # the norm: every DP replica adds up its own
                norm.setdefault((ranks["dp"], name, part), []).append(r)
            if is_primary(placement, ranks):  # the checkpoint: each element once in the world
                written.setdefault((name, part), []).append(r)
    every = {(name, ranks["tp"] if p.split is not None else None)
             for r, params in _gpt_on(lay, sp).items() for name, p in params for ranks in [lay.ranks(r)]}
    assert set(written) == every and all(len(rs) == 1 for rs in written.values())
    assert set(norm) == {(d, *e) for d, e in itertools.product(range(dp), every)}
    assert all(len(rs) == 1 for rs in norm.values())
    if pp > 1:  # the tied embedding: the first stage's copy, never the last stage's
        assert all(lay.coords(rs[0]).pp == 0 for (name, _), rs in written.items() if name == "wte")


def test_zero3_holds_the_parameters_and_the_model_still_counts_them():
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=11), ProcessGrid(1, 1))
    before = model.num_parameters()
    opt = ZeRO3(model, ProcessGrid(1, 1).dp_group)
    assert all(p.held_by is opt and p.data.size == 0 for p in model.parameters())
    assert model.num_parameters() == before
    with pytest.raises(RuntimeError, match="use ZeRO3.full_state_dict"):
        model.state_dict()
    group = opt.groups[0]
    opt.gather_parameters([group])
    with pytest.raises(RuntimeError, match="gathered twice"):
        opt.gather_parameters([group])
    opt.release_parameters([group])
    opt.gather_parameters([group])  # released: it may be gathered again
