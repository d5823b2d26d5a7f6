"""Dropout keyed by position (minipar/rng.py): any subset of tokens draws exactly the single-device
masks, different keys give different masks, and the decisions look like fair independent coins."""

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar import rng
from minipar.nn import Dropout
from minipar.parallel.recompute import checkpoint
from minipar.rng import DropoutRNG, keep, part, rows_of

KEY = (1234, 5, 2, 1)  # seed, iteration, layer, site
B, H, T, C = 8, 4, 16, 12


def attention_mask(key=KEY, rows=range(B), heads=range(H), queries=range(T), keys=range(T), p=0.3):
    return keep(key, p, numpy.array(rows), numpy.array(heads), numpy.array(queries), numpy.array(keys))


def residual_mask(key=KEY, rows=range(B), positions=range(T), features=range(C), p=0.3):
    return keep(key, p, numpy.array(rows), numpy.array(positions), numpy.array(features))


def balanced_chunks(n_chunks, rank, length):
    """Context parallelism's load-balanced order: rank r holds chunks r and n-1-r of the sequence."""
    size = length // n_chunks
    return numpy.concatenate([numpy.arange(c * size, (c + 1) * size) for c in (rank, n_chunks - 1 - rank)])


def test_any_subset_of_tokens_draws_the_single_device_masks_bit_for_bit():
    full, attn = residual_mask(), attention_mask()
    assert full.shape == (B, T, C) and attn.shape == (B, H, T, T)
    subsets = {
        "a data-parallel slice of rows": (rows_of(B, replica=(1, 4)), slice(None)),
        "micro-batch 1 of 2 on replica 1 of 2": (rows_of(B, (1, 2), (1, 2)), slice(None)),
        "rows in any order": (numpy.array([7, 0, 3]), slice(None)),
        "a sequence shard": (numpy.arange(B), part(numpy.arange(T), 4, 2)),
    }
    for r in range(4):  # chunks [0,7], [1,6], [2,5], [3,4] of 8
        subsets[f"load-balanced chunks of rank {r}"] = (numpy.arange(B), balanced_chunks(8, r, T))
    for what, (rows, positions) in subsets.items():
        positions = numpy.arange(T)[positions]
        numpy.testing.assert_array_equal(residual_mask(rows=rows, positions=positions),
                                         full[numpy.ix_(rows, positions)], err_msg=what)
        numpy.testing.assert_array_equal(attention_mask(rows=rows, queries=positions, keys=positions),
                                         attn[numpy.ix_(rows, range(H), positions, positions)], err_msg=what)
    assert numpy.array_equal(rows_of(B, (1, 2), (1, 2)), [6, 7])  # micro-batch-major, then the replica
    heads = numpy.array([3, 1])  # a subset of heads, in any order
    numpy.testing.assert_array_equal(attention_mask(heads=heads), attn[:, heads])
    columns = part(numpy.arange(C), 3, 1)  # a tensor-parallel slice of the features
    numpy.testing.assert_array_equal(residual_mask(features=columns), full[..., columns])


def test_the_dropout_module_and_attention_use_the_global_places_they_are_told():
    """What a model's layers draw for a subset of its tokens equals the whole batch's."""
    p, x = 0.4, numpy.ones((B, T, C), numpy.float32)
    drop = Dropout(p, DropoutRNG(seed=9), layer=3, site=2)
    drop.rng.iteration = 4
    whole = drop(minipar.Tensor(x)).data
    assert set(numpy.unique(whole)) == {0.0, numpy.float32(1 / (1 - p))}
    rows, positions = numpy.array([5, 2]), balanced_chunks(4, 1, T)
    with drop.rng.at(rows=rows, positions=positions):
        mine = drop(minipar.Tensor(x[: len(rows), : len(positions)])).data
    numpy.testing.assert_array_equal(mine, whole[numpy.ix_(rows, positions)])
    with pytest.raises(ValueError, match="told of 2 rows"), drop.rng.at(rows=rows):
        drop(minipar.Tensor(x))
    # attention: sequences 5 and 2 alone, told their rows, equal those sequences of the whole batch
    qkv = numpy.random.default_rng(0).standard_normal((B, T, 3 * C)).astype(numpy.float32)
    out = F.causal_attention(qkv, H, p, key=KEY).data
    some = F.causal_attention(qkv[rows], H, p, key=KEY, rows=rows).data
    numpy.testing.assert_array_equal(some, out[rows])
    assert not numpy.array_equal(F.causal_attention(qkv[rows], H, p, key=KEY).data, out[rows])


@pytest.mark.parametrize("field", range(4))
def test_every_field_of_the_key_changes_the_mask(field):
    base = residual_mask(p=0.5)
    other = list(KEY)
    other[field] += 1  # seed, iteration, layer, site
    changed = residual_mask(key=tuple(other), p=0.5)
    assert 0.4 < (changed != base).mean() < 0.6  # independent fair coins disagree half the time


def test_each_dropout_of_a_model_has_a_key_of_its_own():
    """A model's dropout at (layer, site) is keyed by exactly (seed, iteration, layer, site): two
    places that fold those together (layer 1 site 0 and layer 0 site 1) would drop the same
    elements, and a key without the iteration would drop them again every step."""
    dropout = DropoutRNG(seed=9)
    dropout.iteration = 4
    assert dropout.key(3, 2) == (9, 4, 3, 2)
    keys = {dropout.key(layer, site) for layer in range(6) for site in range(4)}
    assert len(keys) == 24
    masks = {keep(k, 0.5, numpy.arange(4), numpy.arange(64)).tobytes() for k in keys}
    assert len(masks) == 24


def _splitmix64(z):
    """Stafford's Mix13, on Python integers: the reference the array code must equal."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def _fmix32(z):
    z = ((z ^ (z >> 16)) * 0x85EBCA6B) % 2**32
    z = ((z ^ (z >> 13)) * 0xC2B2AE35) % 2**32
    return z ^ (z >> 16)


def test_the_hash_is_the_documented_one_element_by_element():
    """The decisions are pinned, not only fair: a checkpoint resumes bit for bit only if the next
    version draws the same masks. SplitMix64 seeded 0 starts with 0xE220A8397B1DCDAF (Steele, Lea
    & Flood's generator, Java's SplittableRandom), which is the stream of the key (0,); then every
    element of a mask equals the module docstring's recipe, worked out one element at a time."""
    golden = 0x9E3779B97F4A7C15
    assert rng.stream((0,)) == 0xE220A8397B1DCDAF
    coords = [numpy.array([3, 0, 7]), numpy.array([5, 1]), numpy.array([2, 11, 4, 9])]
    p = 0.3
    got = keep(KEY, p, *coords)
    for i, a in enumerate(coords[0]):
        for j, b in enumerate(coords[1]):
            for k, c in enumerate(coords[2]):
                h = 0
                for part_ in KEY:  # the key, each integer + 1 (so a 0 still moves the state)
                    h = _splitmix64((h + (part_ + 1) * golden) % 2**64)
                for outer in (a, b):  # the outer coordinates
                    h = _splitmix64((h + int(outer) * golden) % 2**64)
                z = ((h % 2**32) + int(c) * 0x9E3779B9) % 2**32 ^ (h >> 32)  # the innermost, 32-bit
                assert got[i, j, k] == (_fmix32(z) >= int(p * 2**32)), (a, b, c)
    assert 0 < got.sum() < got.size  # both outcomes occur among these 24


def test_every_coordinate_changes_the_mask():
    base = residual_mask(p=0.5)
    for moved in (residual_mask(rows=range(1, B + 1), p=0.5), residual_mask(positions=range(1, T + 1), p=0.5),
                  residual_mask(features=range(1, C + 1), p=0.5)):
        assert 0.4 < (moved != base).mean() < 0.6
    attn = attention_mask(p=0.5)
    for moved in (attention_mask(rows=range(1, B + 1), p=0.5), attention_mask(heads=range(1, H + 1), p=0.5),
                  attention_mask(queries=range(1, T + 1), p=0.5), attention_mask(keys=range(1, T + 1), p=0.5)):
        assert 0.4 < (moved != attn).mean() < 0.6


def test_the_keep_rate_is_one_minus_p_within_a_binomial_bound():
    for p in (0.1, 0.5, 0.9):
        survive = residual_mask(rows=range(16), positions=range(256), features=range(256), p=p)
        n = survive.size  # ~1e6 draws
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(survive.mean() - (1 - p)) < 5 * sigma, (p, survive.mean())
    assert residual_mask(p=0.0).all()


def test_neighbouring_decisions_are_not_correlated():
    """The correlation of each decision with its neighbour along every axis, and with the same
    element one iteration, layer or site on, is 0 within 5 standard errors (1/sqrt(n))."""
    p, shape = 0.5, (16, 256, 256)
    survive = residual_mask(rows=range(shape[0]), positions=range(shape[1]), features=range(shape[2]), p=p)
    survive = survive.astype(numpy.float64)

    def corr(a, b):
        a, b = a.ravel() - a.mean(), b.ravel() - b.mean()
        return (a @ b) / numpy.sqrt((a @ a) * (b @ b)), a.size

    pairs = {f"axis {axis}": (numpy.take(survive, range(survive.shape[axis] - 1), axis),
                              numpy.take(survive, range(1, survive.shape[axis]), axis)) for axis in range(3)}
    for field, name in ((1, "iteration"), (2, "layer"), (3, "site")):
        other = list(KEY)
        other[field] += 1
        pairs[name] = (survive, residual_mask(tuple(other), range(shape[0]), range(shape[1]), range(shape[2]), p))
    attn = attention_mask(rows=range(4), heads=range(8), queries=range(128), keys=range(256), p=p).astype(float)
    pairs["heads"] = (attn[:, :-1], attn[:, 1:])
    for what, (a, b) in pairs.items():
        r, n = corr(a, b.astype(numpy.float64))
        assert abs(r) < 5 / n**0.5, (what, r)
    # the 16 patterns of 4 neighbours (separate windows along the features, then the positions)
    # are equally frequent: chi-square (15 degrees of freedom) below its 0.1% point, 37.7
    for along in (survive, survive.transpose(0, 2, 1)):
        windows = along.reshape(-1, 4) @ numpy.array([8, 4, 2, 1])
        counts = numpy.bincount(windows.astype(int), minlength=16)
        expected = windows.size / 16
        assert ((counts - expected) ** 2 / expected).sum() < 37.7, counts


def test_recomputation_redraws_the_masks_of_the_tokens_it_held():
    """A recomputed block runs again in backward, when the forward's ``at`` has ended and another
    iteration may be current: it must draw the masks of the iteration, rows and positions it held
    then, and leave the current ones as they were."""
    from minipar.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16, dropout=0.3), None)
    block = model.transformer.h[0]
    x = numpy.random.default_rng(0).standard_normal((2, 8, 8)).astype(numpy.float32)
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        inp = minipar.Tensor(x, requires_grad=True)
        model.rng.iteration = 3
        with model.rng.at(rows=[4, 5], positions=range(8, 16)):  # a later part of a longer sequence
            out = checkpoint(block, inp, block.parameters(), rng=model.rng) if recompute else block(inp)
        model.rng.iteration = 4  # a later forward's (the next micro-batch's, or step's) is current now
        (out * out).sum().backward()  # outside the forward's rows
        grads.append([inp.grad] + [p.grad.copy() for p in block.parameters()])
        # and stays current: the recomputation put back what it found
        assert model.rng.iteration == 4 and model.rng.rows is None and model.rng.positions is None
    for a, b in zip(*grads):
        numpy.testing.assert_array_equal(a, b)


def test_bad_parts_and_cuts_are_refused():
    with pytest.raises(ValueError, match="no such part"):
        part(numpy.arange(10), 4, 1)
    with pytest.raises(ValueError, match="does not cut into 3 micro-batches x 2 replicas"):
        rows_of(8, (0, 3), (0, 2))
    with pytest.raises(ValueError, match="rows .* and positions"):
        F.causal_attention(numpy.zeros((2, 4, 6)), 1, 0.5, rows=[0])
    with pytest.raises(ValueError, match="split the positions"):
        Dropout(0.1, DropoutRNG(), shards=[(0, object())])


def test_masks_on_the_gpu_equal_those_on_the_cpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no GPU")
    from minipar import backend

    cpu = attention_mask()
    backend.use_device("cuda")
    try:
        gpu = rng.keep(KEY, 0.3, *(cupy.arange(n) for n in (B, H, T, T)))
        assert isinstance(gpu, cupy.ndarray)
        numpy.testing.assert_array_equal(cupy.asnumpy(gpu), cpu)
    finally:
        backend.use_device("cpu")
