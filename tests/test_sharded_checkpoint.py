"""Sharded checkpoints on one rank: the box arithmetic against brute force, exact resume for every
optimizer, loading across optimizers, and every kind of damaged checkpoint refused by name."""

import os
import shutil

import numpy as np
import pytest

import minipar
from minipar.checkpoint import full, sharded
from minipar.checkpoint.boxes import flat_boxes, intersect, region, to_global
from minipar.models import GPT, GPTConfig
from minipar.parallel import ProcessGrid
from minipar.parallel.optimizers import make_optimizer
from minipar.placement import Split


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (4, 1, 3)])
def test_flat_boxes_cover_every_flat_range_in_order(shape):
    n = int(np.prod(shape))
    array = np.arange(n).reshape(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            boxes = flat_boxes(shape, a, b)
            values = [array[region(s, e)].ravel() for s, e in boxes]
            assert list(np.concatenate(values) if values else []) == list(range(a, b))


def _shard(whole, axis, size, padded, chunks, ranks, rank):
    """The TP shard the way Split.shard cuts it, padding marked -1."""
    pad = [(0, 0)] * whole.ndim
    pad[axis] = (0, padded - size)
    blocks = np.split(np.pad(whole, pad, constant_values=-1), chunks, axis=axis)
    return np.concatenate([np.split(b, ranks, axis=axis)[rank] for b in blocks], axis=axis)


@pytest.mark.parametrize("shape,axis,chunks,padded", [((12, 5), 0, 3, 12), ((6, 8), 1, 1, 8),
                                                      ((10, 4), 0, 1, 12), ((7, 3), 0, 1, 8)])
def test_local_boxes_map_onto_the_whole_tensor(shape, axis, chunks, padded):
    whole = np.arange(np.prod(shape)).reshape(shape)
    rng = np.random.default_rng(0)
    for ranks in (1, 2, 4):
        if padded % (chunks * ranks):
            continue
        for rank in range(ranks):
            local = _shard(whole, axis, shape[axis], padded, chunks, ranks, rank)
            split = Split("tp", axis, shape[axis], chunks, padded)
            mine = split.shard(whole, rank, ranks)  # the parameter's own cut: padded with zeros
            np.testing.assert_array_equal(np.where(local >= 0, mine, -1), local)
            for _ in range(30):
                s = [int(rng.integers(0, d)) for d in local.shape]
                e = [int(rng.integers(a + 1, d + 1)) for a, d in zip(s, local.shape)]
                covered = np.zeros(local.shape, bool)
                for gs, ge, ls, le in to_global(split, rank, ranks, s, e):
                    np.testing.assert_array_equal(local[region(ls, le)], whole[region(gs, ge)])
                    covered[region(ls, le)] = True
                inside = np.zeros(local.shape, bool)
                inside[region(s, e)] = True
                assert (local[inside & ~covered] == -1).all()  # only padding is left out


CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, dropout=0.1)


def _make(kind):
    minipar.manual_seed(0)
    grid = ProcessGrid(1, 1)
    model = GPT(CONFIG, grid)
    opt = make_optimizer(model, grid, {"adamw": 0, "zero1": 1, "zero3": 3}[kind], lr=1e-2, bucket_bytes=3000)
    return model, opt, grid


def _train(model, opt, steps, start=0):
    x = np.random.default_rng(1).integers(0, 32, (4, 8))
    out = []
    for it in range(start, start + steps):
        model.rng.iteration = it  # dropout masks are keyed by the iteration
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


pytestmark = pytest.mark.usefixtures("float64")  # (tests/conftest.py's)


def test_boxes_intersect_as_brute_force_says_and_a_region_is_relative_to_its_origin():
    """Resharding reads each saved box's overlap with the box a rank needs, at that box's offset:
    against a brute-force count of the cells two boxes share (boxes that only touch share none),
    and a region taken from an array that starts at ``origin``."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        a0, b0 = rng.integers(0, 5, 2), rng.integers(0, 5, 2)
        a1, b1 = a0 + rng.integers(1, 4, 2), b0 + rng.integers(1, 4, 2)
        cells = np.zeros((9, 9), int)
        cells[region(a0, a1)] += 1
        cells[region(b0, b1)] += 1
        both = intersect(tuple(a0), tuple(a1), tuple(b0), tuple(b1))
        assert (both is None) == (cells.max() < 2)
        if both is not None:
            assert cells[region(*both)].min() == 2 and (cells == 2).sum() == np.prod(np.subtract(both[1], both[0]))
    assert intersect((0, 0), (2, 3), (2, 0), (4, 3)) is None  # rows 0-1 and 2-3 touch, share no cell
    whole = np.arange(30).reshape(5, 6)
    part = whole[2:5, 1:6]  # an array holding rows 2-4 and columns 1-5 of the whole
    np.testing.assert_array_equal(part[region((3, 2), (5, 4), origin=(2, 1))], whole[3:5, 2:4])


@pytest.mark.parametrize("kind", ["adamw", "zero1", "zero3"])
def test_resume_is_exact_for_every_optimizer(kind, tmp_path):
    model, opt, grid = _make(kind)
    _train(model, opt, 2)
    sharded.save(str(tmp_path), 2, model, opt, grid, {"iteration": 2})
    again, opt2, _ = _make(kind)
    state = sharded.load(str(tmp_path), again, opt2, grid)
    assert state == {"iteration": 2, "optimizer_steps": 2} and again.rng.seed == model.rng.seed
    assert _train(model, opt, 3, start=2) == _train(again, opt2, 3, start=state["iteration"])  # bit for bit
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest"]


def test_a_checkpoint_loads_into_another_optimizer_and_gathers_whole(tmp_path):
    model, opt, grid = _make("zero1")
    _train(model, opt, 2)
    sharded.save(str(tmp_path), 2, model, opt, grid, {})
    other, opt2, _ = _make("zero3")
    sharded.load(str(tmp_path), other, opt2, grid)
    whole = full.gather_full_state(other, opt2, grid)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(whole[name], value)


def test_whole_weights_of_another_shape_are_refused_not_loaded_in_part(tmp_path):
    """load_full_state compares every tensor's whole shape with the model's: an embedding with more
    rows (or columns) is a different model, though the model's part of it would fill every piece."""
    model, opt, grid = _make("adamw")
    state = full.gather_full_state(model, opt, grid)
    for shape in ((64, 16), (32, 32)):
        wrong = dict(state, **{"transformer.wte.weight": np.ones(shape)})
        with pytest.raises(ValueError, match=rf"do not fit the model:\n  transformer.wte.weight: shape "
                           rf"\({shape[0]}, {shape[1]}\), model has \(32, 16\)"):
            full.load_full_state(model, opt, wrong, grid)
    np.testing.assert_array_equal(model.transformer.wte.weight.data, state["transformer.wte.weight"])  # untouched


def _damage(path, how):
    step = os.path.join(path, "iter_0000001")
    shard = os.path.join(step, "rank_00000.safetensors")
    if how == "flipped":
        raw = bytearray(open(shard, "rb").read())
        raw[-5] ^= 0xFF
        open(shard, "wb").write(bytes(raw))
    elif how == "truncated":
        os.truncate(shard, os.path.getsize(shard) - 64)
    elif how == "missing":
        os.remove(shard)
    elif how == "no index":
        os.remove(os.path.join(step, "index.json"))
    elif how == "bad index":
        open(os.path.join(step, "index.json"), "w").write("{not json")


@pytest.mark.parametrize("how,message", [
    ("flipped", "rank_00000.safetensors is damaged: .* does not match its checksum"),
    ("truncated", "rank_00000.safetensors is truncated or damaged"),
    ("missing", "rank_00000.safetensors is missing"),
    ("no index", "has no index.json: the checkpoint is incomplete"),
    ("bad index", "index.json is not readable JSON"),
])
def test_damaged_checkpoints_are_refused_by_name(how, message, tmp_path):
    model, opt, grid = _make("adamw")
    sharded.save(str(tmp_path), 1, model, opt, grid, {})
    _damage(str(tmp_path), how)
    with pytest.raises(sharded.CheckpointError, match=message):
        sharded.load(str(tmp_path), *_make("adamw"))


def test_another_model_and_an_unfinished_save_are_refused(tmp_path):
    model, opt, grid = _make("adamw")
    sharded.save(str(tmp_path), 1, model, opt, grid, {})
    minipar.manual_seed(0)
    bigger = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=32), grid)
    with pytest.raises(sharded.CheckpointError, match="different model: n_layer 2 .flags: 3."):
        sharded.load(str(tmp_path), bigger, make_optimizer(bigger, grid), grid)
    # a save that died half-way leaves its .partial directory; the last good one still loads
    shutil.copytree(os.path.join(tmp_path, "iter_0000001"), os.path.join(tmp_path, "iter_0000002.partial"))
    os.remove(os.path.join(tmp_path, "iter_0000002.partial", "index.json"))
    assert sharded.find(str(tmp_path)).endswith("iter_0000001")
    with pytest.raises(sharded.CheckpointError, match="no checkpoint here"):
        sharded.find(str(tmp_path / "iter_0000002.partial"))


def test_a_flat_piece_across_several_boxes_is_its_flat_array_in_order():
    """A ZeRO piece is a range of the flattened parameter: elements 1 to 6 of a 3 x 4 array are two
    boxes (the rest of row 0, the first three of row 1), each its own stretch of the piece."""
    from minipar.checkpoint.pieces import Piece

    flat = np.arange(6.0)
    views = Piece("param", "w", flat, (3, 4), flat=(1, 7)).views()
    assert [(start, stop) for start, stop, _ in views] == [((0, 1), (1, 4)), ((1, 0), (2, 3))]
    np.testing.assert_array_equal(np.concatenate([view.ravel() for _, _, view in views]), flat)
    assert all(np.shares_memory(view, flat) for _, _, view in views)
