"""SGD, AdamW and gradient clipping, all updating parameters in place.

AdamW (Loshchilov & Hutter 2019) for a parameter p with gradient g, at step t:

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    p = p - lr wd p                  (decoupled weight decay, matrices only)
    p = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Every line is an in-place ufunc on the parameter's own buffers, run block by block so that the
chain stays in cache; the only temporary is one block-sized scratch array.
"""

import math

from minipar.backend import blocks, sum_of_squares, xp


class Optimizer:
    def __init__(self, params, lr):
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        check_hyperparameters(lr)
        self.lr = float(lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class SGD(Optimizer):
    """p = p - lr d with d = g + wd p, or with momentum b = mu b + d and p = p - lr b, in place."""

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr)
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.buffers = [xp.zeros(p.shape, p.dtype) if self.momentum else None for p in self.params]

    def step(self):
        for p, buf in zip(self.params, self.buffers):
            if p.grad is None:
                continue
            d = xp.multiply(p.data, self.weight_decay) if self.weight_decay else p.grad.copy()
            if self.weight_decay:
                d += p.grad
            if buf is not None:
                buf *= self.momentum
                buf += d
                xp.copyto(d, buf)
            d *= self.lr
            p.data -= d


def check_hyperparameters(lr, betas=(0.0, 0.0)):
    if lr < 0:
        raise ValueError(f"learning rate must be >= 0, got {lr}")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must lie in [0, 1), got {betas}")


class AdamW(Optimizer):
    """Adam with decoupled weight decay, applied to parameters with ndim >= 2 only (weights and
    embeddings; biases and LayerNorm gains are not decayed, as in GPT-2 and nanoGPT). ``decay``
    (one bool per parameter) overrides that rule: ZeRO passes flat pieces of parameters, whose
    own ndim says nothing.

    Mixed precision (``minipar.precision``): the parameters given are then fp32 master weights, and
    ``copies`` (one array or None per parameter) the model's 16-bit weights, into which each block
    of a master is rounded as soon as it is updated. A gradient may be of another dtype than its
    parameter (16-bit): each block is widened as it is read, times ``step(grad_scale)`` (the loss
    scale's inverse and the clipping factor, applied in the master's precision)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decay=None, copies=None):
        super().__init__(params, lr)
        self.copies = [None] * len(self.params) if copies is None else list(copies)
        if len(self.copies) != len(self.params) or any(
                c is not None and (c.shape != p.shape or not c.flags.c_contiguous) for c, p in zip(self.copies, self.params)):
            raise ValueError("copies: one C-contiguous array of each parameter's shape (or None) per parameter")
        self.decay = [p.ndim >= 2 for p in self.params] if decay is None else [bool(d) for d in decay]
        if len(self.decay) != len(self.params):
            raise ValueError(f"decay has {len(self.decay)} flags for {len(self.params)} parameters")
        check_hyperparameters(lr, betas)
        b1, b2 = betas
        self.b1, self.b2, self.eps, self.weight_decay = float(b1), float(b2), float(eps), float(weight_decay)
        self.step_count = 0
        for p in self.params:
            if not p.data.flags.c_contiguous:
                raise ValueError(
                    "AdamW updates parameters through flat views, which needs C-contiguous arrays: "
                    "use nn.Parameter (always C order) or numpy.ascontiguousarray"
                )
        self.m = [xp.zeros(p.shape, p.dtype) for p in self.params]
        self.v = [xp.zeros(p.shape, p.dtype) for p in self.params]

    def step(self, grad_scale=1.0):
        self.step_count += 1
        t, b1, b2 = self.step_count, self.b1, self.b2
        step_size = self.lr / (1.0 - b1**t)
        rsqrt_bc2 = 1.0 / math.sqrt(1.0 - b2**t)
        scratch = {}

        def scratch_of(key, n, dtype):
            tmp = scratch.get(key)
            if tmp is None or tmp.size < n:
                tmp = scratch[key] = xp.empty(n, dtype)
            return tmp[:n]

        for p, m, v, decays, copy in zip(self.params, self.m, self.v, self.decay, self.copies):
            if p.grad is None:
                continue
            decay = 1.0 - self.lr * self.weight_decay if decays else 1.0
            flat = (p.data.reshape(-1), p.grad.reshape(-1), m.reshape(-1), v.reshape(-1))
            for s in blocks(p.size):  # each block's ~14 passes run in cache
                n = s.stop - s.start
                pb, gb, mb, vb = (a[s] for a in flat)
                if gb.dtype != p.dtype or grad_scale != 1.0:  # widened (and unscaled) as it is read
                    wide = scratch_of("grad", n, p.dtype)
                    wide[...] = gb
                    if grad_scale != 1.0:
                        wide *= grad_scale
                    gb = wide
                self._update(pb, gb, mb, vb, scratch_of(p.dtype, n, p.dtype), b1, b2, decay, step_size, rsqrt_bc2)
                if copy is not None:
                    copy.reshape(-1)[s] = pb  # the master's block, rounded into the model's weight

    def _update(self, p, g, m, v, tmp, b1, b2, decay, step_size, rsqrt_bc2):
        # m = b1 m + (1 - b1) g, written as m = b1 (m - g) + g to need no temporary
        m -= g
        m *= b1
        m += g
        xp.multiply(g, g, out=tmp)
        v -= tmp
        v *= b2
        v += tmp
        if decay != 1.0:
            p *= decay
        # p -= step_size m / (sqrt(v) r + eps), r = 1 / sqrt(1 - b2^t), taken as
        # p -= (step_size / r) m / (sqrt(v) + eps / r): one pass fewer over the block
        xp.sqrt(v, out=tmp)
        tmp += self.eps / rsqrt_bc2
        xp.divide(m, tmp, out=tmp)
        tmp *= step_size / rsqrt_bc2
        p -= tmp


def adamw_reference(p, g, m, v, t, lr, betas, eps, weight_decay, decays):
    """Step ``t`` of AdamW for one parameter as Loshchilov & Hutter write it (decoupled decay, then
    the bias-corrected Adam step), a temporary per operation: what ``AdamW._update``'s in-place,
    cache-blocked chain must equal. Returns the new (p, m, v)."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    if decays:
        p = p - lr * weight_decay * p
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return p - lr * m_hat / (xp.sqrt(v_hat) + eps), m, v


def clip_grad_norm(params, max_norm):
    """Scale all gradients by min(1, max_norm / ||g||), ||g|| the L2 norm over every parameter;
    returns ||g|| before clipping. One device's: a parallel optimizer's ``clip_grad_norm`` takes
    the norm across its ranks (minipar.parallel.grad_norm)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = math.sqrt(sum_of_squares(grads))
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g *= scale
    return total
