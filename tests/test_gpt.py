"""The GPT: names and shapes, a float64 gradient check of every parameter, causality, tying,
the fused attention against the composed ops, dropout, and state_dict round trips."""

import math

import numpy
import pytest

import minipar
import minipar.functional as F
from minipar import Tensor
from minipar.autograd import no_grad
from minipar.gradcheck import gradcheck
from minipar.models import GPT, GPTConfig

TINY = dict(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=11)


def batch(config, B=2, T=None, seed=0):
    rng = numpy.random.default_rng(seed)
    T = T or config.block_size
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


def test_parameter_names_follow_gpt2():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4))
    names = [n for n, _ in model.named_parameters()]
    per_layer = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                 "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                 "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
    expected = ["transformer.wte.weight", "transformer.wpe.weight"]
    expected += [f"transformer.h.{i}.{n}" for i in range(2) for n in per_layer]
    expected += ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert names == expected
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (24, 8)  # (out, in)
    assert shapes["transformer.h.1.mlp.c_fc.weight"] == (32, 8)
    assert shapes["transformer.wte.weight"] == (256, 8)


def test_gpt2_initialisation():
    minipar.manual_seed(0)
    config = GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=64)
    p = dict(GPT(config).named_parameters())
    assert p["transformer.h.0.mlp.c_fc.weight"].data.std() == pytest.approx(0.02, rel=0.02)
    for proj in ("transformer.h.3.attn.c_proj.weight", "transformer.h.5.mlp.c_proj.weight"):
        assert p[proj].data.std() == pytest.approx(0.02 / math.sqrt(16), rel=0.03)
    for emb in ("transformer.wte.weight", "transformer.wpe.weight"):
        assert p[emb].data.std() == pytest.approx(0.02, rel=0.05)
    for name, value in p.items():
        if name.endswith(".bias"):
            assert not value.data.any(), name
        if ".ln_" in name and name.endswith(".weight"):
            assert (value.data == 1).all(), name


def test_every_parameter_passes_a_float64_gradient_check(float64):
    minipar.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    idx, targets = batch(model.config)
    names, params = zip(*model.named_parameters())
    reports = gradcheck(lambda *_: model(idx, targets)[1], list(params), names=list(names))
    assert len(reports) == len(params) == 28
    for r in reports:
        assert r.ok, r


def test_gradient_check_without_biases(float64):
    minipar.manual_seed(0)
    model = GPT(GPTConfig(**TINY, bias=False))
    assert not any(n.endswith(".bias") for n, _ in model.named_parameters())
    idx, targets = batch(model.config)
    names, params = zip(*model.named_parameters())
    for r in gradcheck(lambda *_: model(idx, targets)[1], list(params), names=list(names)):
        assert r.ok, r


def test_gradient_check_with_dropout(float64):
    minipar.manual_seed(0)
    model = GPT(GPTConfig(**TINY, dropout=0.2))
    idx, targets = batch(model.config)
    names, params = zip(*model.named_parameters())

    start = model.rng.state()

    def loss(*_):
        model.rng.set_state(start)  # the same masks on every evaluation
        return model(idx, targets)[1]

    for r in gradcheck(loss, list(params), names=list(names), max_entries=40):
        assert r.ok, r


def test_causal_future_tokens_do_not_change_past_logits():
    model = GPT(GPTConfig(**TINY))
    idx, _ = batch(model.config)
    changed = idx.copy()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    a, _ = model(idx)
    b, _ = model(changed)
    numpy.testing.assert_array_equal(a.data[:, :-1], b.data[:, :-1])
    assert not numpy.allclose(a.data[:, -1], b.data[:, -1])


def test_tied_head_gradient_is_the_sum_of_both_uses(float64):
    model = GPT(GPTConfig(**TINY))
    idx, targets = batch(model.config)
    _, loss = model(idx, targets)
    loss.backward()
    total = model.transformer.wte.weight.grad.copy()
    # the embedding-only part: rows of ids that never occur get gradient from the head only
    unused = numpy.setdiff1d(numpy.arange(model.config.vocab_size), idx)
    assert unused.size and numpy.abs(total[unused]).sum() > 0
    # recompute with the head weight as a separate copy: head grad + embedding grad = tied grad
    head = Tensor(model.transformer.wte.weight.data.copy(), requires_grad=True)
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(numpy.arange(idx.shape[1]))
    for block in tr.h:
        x = block(x)
    model.zero_grad()
    F.cross_entropy(F.linear(tr.ln_f(x), head), targets).backward()
    numpy.testing.assert_allclose(total, head.grad + tr.wte.weight.grad, rtol=1e-10, atol=1e-14)


def composed_attention(qkv, n_head):
    """Causal attention from the basic ops: the reference the fused op must equal."""
    B, T, C3 = qkv.shape
    C, H = C3 // 3, n_head
    q, k, v = (t.reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for t in F.split(qkv, 3, axis=-1))
    att = F.matmul(q, k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(C // H))
    att = F.softmax(F.masked_fill(att, numpy.triu(numpy.ones((T, T), bool), k=1), float("-inf")))
    return F.matmul(att, v).transpose(0, 2, 1, 3).reshape(B, T, C)


@pytest.mark.parametrize("dtype,tol", [(numpy.float64, 1e-12), (numpy.float32, 2e-6)])
@pytest.mark.parametrize("T,query_block", [(7, 64), (7, 3), (130, 64)])
def test_fused_attention_equals_composed_ops(dtype, tol, T, query_block):
    rng = numpy.random.default_rng(0)
    data = rng.standard_normal((3, T, 3 * 12)).astype(dtype)
    grad = rng.standard_normal((3, T, 12)).astype(dtype)
    results = []
    for attention in (lambda t: F.causal_attention(t, 3, query_block=query_block),
                      lambda t: composed_attention(t, 3)):
        qkv = Tensor(data, requires_grad=True, dtype=dtype)
        out = attention(qkv)
        out.backward(grad)
        assert out.dtype == dtype and qkv.grad.dtype == dtype
        results.append((out.data, qkv.grad))
    numpy.testing.assert_allclose(results[0][0], results[1][0], rtol=tol, atol=tol)
    numpy.testing.assert_allclose(results[0][1], results[1][1], rtol=tol, atol=tol)


def test_dropout_is_seeded_and_off_in_eval():
    model = GPT(GPTConfig(**TINY, dropout=0.3))
    idx, targets = batch(model.config)
    start, losses = model.rng.state(), []
    for _ in range(2):
        model.rng.set_state(start)
        losses.append(model(idx, targets)[1].item())
    assert losses[0] == losses[1]
    assert model(idx, targets)[1].item() == losses[0]  # masks depend on the iteration, not on a count
    model.rng.iteration = 1
    assert model(idx, targets)[1].item() != losses[0]  # the next iteration has other masks
    minipar.manual_seed(0)
    again = GPT(GPTConfig(**TINY, dropout=0.3))  # same seed, same weights, same dropout keys
    minipar.manual_seed(0)
    twin = GPT(GPTConfig(**TINY, dropout=0.3))
    assert again(idx, targets)[1].item() == twin(idx, targets)[1].item()
    model.eval()
    assert model(idx, targets)[1].item() == model(idx, targets)[1].item()
    model.train()
    assert model.transformer.h[0].mlp.dropout.training


def test_state_dict_round_trip_and_errors():
    a, b = GPT(GPTConfig(**TINY)), GPT(GPTConfig(**TINY))
    state = a.state_dict()
    assert "lm_head.weight" not in state  # tied: it is transformer.wte.weight
    b.load_state_dict(state)
    idx, _ = batch(a.config)
    numpy.testing.assert_array_equal(a(idx)[0].data, b(idx)[0].data)
    state["transformer.wte.weight"] += 1.0  # a copy: the model is unchanged
    assert not numpy.array_equal(a.transformer.wte.weight.data, state["transformer.wte.weight"])

    broken = dict(a.state_dict())
    broken.pop("transformer.ln_f.bias")
    broken["transformer.h.0.ln_1.weight"] = numpy.ones(9, numpy.float32)
    broken["transformer.h.1.mlp.c_fc.bias"] = broken["transformer.h.1.mlp.c_fc.bias"].astype(numpy.float64)
    broken["lm_head.weight"] = numpy.zeros((11, 8), numpy.float32)
    with pytest.raises(ValueError) as info:
        b.load_state_dict(broken)
    message = str(info.value)
    for expected in ("missing: transformer.ln_f.bias", "unexpected: lm_head.weight",
                     "transformer.h.0.ln_1.weight: shape (9,)", "transformer.h.1.mlp.c_fc.bias: dtype float64"):
        assert expected in message


def test_config_and_input_errors():
    with pytest.raises(ValueError, match="not divisible by n_head"):
        GPTConfig(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="positive integer"):
        GPTConfig(n_layer=0)
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(numpy.zeros((1, 5), numpy.int64))
    with pytest.raises(IndexError, match=r"\[0, 11\)"):
        model(numpy.full((1, 3), 11))


def test_float32_model_stays_float32():
    model = GPT(GPTConfig(**TINY))
    idx, targets = batch(model.config)
    logits, loss = model(idx, targets)
    assert logits.dtype == loss.dtype == numpy.float32
    loss.backward()
    assert all(p.grad.dtype == numpy.float32 for p in model.parameters())


def test_generate_extends_the_prompt():
    model = GPT(GPTConfig(**TINY))
    out = model.generate(numpy.array([[1, 2]]), 6, generator=numpy.random.default_rng(0))
    assert out.shape == (1, 8) and (out[:, :2] == [[1, 2]]).all() and out.max() < 11


def test_generate_at_a_near_zero_temperature_is_greedy_over_the_last_block(float64):
    """Logits divided by the temperature: as it goes to 0, sampling becomes the argmax. Each step
    sees the last block_size tokens of a prompt longer than the block."""
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    prompt = numpy.random.default_rng(0).integers(0, 32, size=(2, 11))
    out = model.generate(prompt, 6, temperature=1e-4, generator=numpy.random.default_rng(1))
    idx = prompt
    with no_grad():
        for _ in range(6):
            logits = model(idx[:, -8:])[0].numpy()
            idx = numpy.concatenate([idx, logits[:, -1].argmax(-1)[:, None]], axis=1)
    numpy.testing.assert_array_equal(out, idx)
