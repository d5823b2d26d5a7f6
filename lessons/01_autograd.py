"""Lesson 1: the autograd engine, and how we know its gradients are right.

    python lessons/01_autograd.py               # every op, then the whole GPT: all must pass
    python lessons/01_autograd.py --plant-bug   # GELU's backward made subtly wrong: must fail

Every later lesson compares a parallel run with this single-device engine, so the engine itself is
checked against the definition of a derivative. For an op f with output y, pick a random upstream
gradient G and look at the scalar L = sum(y * G). Backward gives dL/dx for every input entry at once;
the central difference (L(x + eps) - L(x - eps)) / 2 eps gives it one entry at a time. In float64
with eps = 1e-6 the two agree to ~1e-9 when backward is right, and differ by 1e-3 or more when a
factor is missing, as the planted bug shows. (Why a random G and not y.sum()? A backward that
ignores its incoming gradient is right for G = 1 and wrong for everything else.)

Read next: minipar/autograd.py (Function.apply, then backward), minipar/functional/, docs/autograd.md.

What to look at: the two columns of every row (the worst entry's error and the error relative to
the input's largest numeric derivative) and the last line, which counts the checks that passed.
The control row breaks GELU on purpose in every run: it must say FAIL, or the check is blind.

Exercises (predict first, then run the command):
1. Without --plant-bug the control row still says FAIL. Predict the exit status:
   python lessons/01_autograd.py; echo $?
2. --plant-bug breaks GELU's backward everywhere, also inside the GPT. Predict which of the GPT's
   parameter rows must still be "ok": those with no GELU between them and the loss.
   python lessons/01_autograd.py --plant-bug   (section 2, the rows of transformer.h.1 and ln_f)
3. The planted bug drops a factor 1 - tanh^2, which lies between 0 and 1. Predict the order of
   the gelu row's "rel err" under --plant-bug: near 1e-9 like the others, or near 1?
"""


import numpy

import lesson
import minipar
from minipar.backend import add_device_flag
from minipar.cli import Parser, device_problems
from minipar.functional.gelu import GELU
from minipar.gradcheck import gradcheck, op_cases
from minipar.models import GPT, GPTConfig

# the pass rule, entry by entry: |analytic - numeric| <= ATOL + noise + RTOL |numeric|, with the numeric
# derivative a central difference of step EPS and noise its rounding, 4 ulp x sum|y G| / EPS (gradcheck
# adds it: 2.7e-10 for the GPT's loss). Passed to every gradcheck below, so it is the rule used (gradcheck's
# defaults). ATOL is a margin above the rounding: the GPT's LayerNorm gradients are ~5e-5, the planted
# bug puts errors of ~8e-10 in them, and an ATOL of 1e-8 let those pass; at 1e-10 they fail by about
# twice the tolerance (4e-10), a thin margin: the planted bug's smallest trace the differences can see
RULE = dict(eps=1e-6, rtol=1e-6, atol=1e-10)


def forgetful_gelu_backward(ctx, grad):
    """GELU's backward with d tanh(z)/dz taken as 1 instead of 1 - tanh(z)^2 (GELU's forward keeps
    s = sigmoid(2z), and tanh(z) = 2s - 1)."""
    x, t = ctx.x, 2 * ctx.s - 1
    c, a = (2.0 / numpy.pi) ** 0.5, 0.044715
    return (grad.reshape(-1) * (0.5 * (1 + t) + 0.5 * x * c * (1 + 3 * a * x * x))).reshape(grad.shape)


def row(name, reports):
    worst = max(reports, key=lambda r: r.rel_err)
    ok = all(r.ok for r in reports)
    entries = sum(r.checked for r in reports)
    print(f"  {name:<42} {worst.max_abs_err:>10.1e} {worst.rel_err:>10.1e} {entries:>8}  "
          f"{'ok' if ok else 'FAIL'}")
    return ok


def main():
    p = Parser(description="Gradient checks of every op and of the whole GPT.")
    p.add_argument("--plant-bug", action="store_true", help="break GELU's backward to see a failure")
    add_device_flag(p)  # on cuda every check runs on the GPU, matrix products in minipar's kernel
    # a bad flag (or no GPU, or several ranks) is one line and exit 2, as in the MPI lessons
    args = lesson.parse_one_process(p, device_problems)
    if args.plant_bug:
        GELU.backward = staticmethod(forgetful_gelu_backward)
        print("planted: GELU.backward now forgets the factor 1 - tanh^2\n")

    header = f"  {'':<42} {'max |err|':>10} {'rel err':>10} {'entries':>8}"
    print(f"An input passes when every entry has |analytic - numeric| <= {RULE['atol']:g} + noise + "
          f"{RULE['rtol']:g} |numeric|,\nnumeric: the central difference with eps = {RULE['eps']:g}, noise: its "
          "rounding, 4 ulp x sum|y G| / eps.\nColumns: the worst entry's |err|, and max |err| / max |numeric| over "
          "the input.\n")
    print("1. Every op: analytic backward vs central differences, float64, random upstream gradient")
    print(header)
    results = [row(name, gradcheck(fn, inputs, **RULE)) for name, fn, inputs in op_cases()]

    print("\n2. The whole GPT (2 layers, 2 heads, hidden 8, vocab 11): every entry of every parameter")
    print(header)
    minipar.set_default_dtype("float64")
    minipar.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=11))
    rng = numpy.random.default_rng(0)
    idx, targets = rng.integers(0, 11, (2, 4)), rng.integers(0, 11, (2, 4))
    names, params = zip(*model.named_parameters())
    reports = gradcheck(lambda *_: model(idx, targets)[1], list(params), names=list(names), **RULE)
    results += [row(r.name, [r]) for r in reports]

    print("\n3. The checker itself must catch a wrong backward (a negative control)")
    print(header)
    x = minipar.Tensor(rng.standard_normal((4, 5)), requires_grad=True, dtype=numpy.float64)
    saved, GELU.backward = GELU.backward, staticmethod(forgetful_gelu_backward)
    control = gradcheck(GELU.apply, [x], **RULE)
    GELU.backward = saved
    caught = not control[0].ok
    row("GELU with 1 - tanh^2 dropped (must FAIL)", control)

    passed = sum(results)
    print(f"\n{passed}/{len(results)} checks passed; the planted control was "
          f"{'caught' if caught else 'NOT caught'}.")
    if passed == len(results) and caught:
        print("The engine's gradients equal the derivatives: later lessons can trust it as the reference.")
        return 0
    print("MISMATCH: a backward disagrees with the central differences (see FAIL rows).")
    return 1


if __name__ == "__main__":
    lesson.end(main())
