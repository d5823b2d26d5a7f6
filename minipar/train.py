"""Train the GPT: ``python -m minipar.train --help``.

On one device this is nanoGPT's loop: sample a batch, forward, backward, clip, AdamW, with a
warm-up and cosine learning-rate schedule, a validation estimate every ``--eval-interval`` steps, a
progress line, an optional JSON log and a loss-curve picture at the end. A run is a pure function of
its flags: the same seed and flags give the same losses, bit for bit.
"""

import argparse
import json
import math
import os
import sys
import time

DEFAULTS = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=16, max_iters=600,
                lr=3e-3, min_lr=3e-4, warmup_iters=50)


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line naming the problem (argparse would print the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    p = _Parser(
        prog="python -m minipar.train",
        description="Train a GPT on bytes of text (by default the Python standard library's source).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", type=positive_int, default=DEFAULTS["n_layer"], help="transformer blocks")
    m.add_argument("--n-head", type=positive_int, default=DEFAULTS["n_head"], help="attention heads")
    m.add_argument("--n-embd", type=positive_int, default=DEFAULTS["n_embd"], help="hidden size")
    m.add_argument("--block-size", type=positive_int, default=DEFAULTS["block_size"], help="context length in bytes")
    m.add_argument("--dropout", type=non_negative_float, default=0.0, help="dropout probability")
    o = p.add_argument_group("optimisation")
    o.add_argument("--max-iters", type=positive_int, default=DEFAULTS["max_iters"], help="training steps")
    o.add_argument("--batch-size", type=positive_int, default=DEFAULTS["batch_size"], help="sequences per step")
    o.add_argument("--lr", type=non_negative_float, default=DEFAULTS["lr"], help="peak learning rate")
    o.add_argument("--min-lr", type=non_negative_float, default=DEFAULTS["min_lr"], help="final learning rate of the cosine decay")
    o.add_argument("--warmup-iters", type=int, default=DEFAULTS["warmup_iters"], help="linear warm-up steps")
    o.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    o.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="max global gradient norm (0: off)")
    o.add_argument("--seed", type=int, default=1337, help="seed of the weights, the batches and dropout")
    o.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="floating dtype of the whole run")
    d = p.add_argument_group("data and output")
    d.add_argument("--data", metavar="PATH", help="text file or directory (default: the Python standard library)")
    d.add_argument("--eval-interval", type=positive_int, default=100, help="steps between validation estimates")
    d.add_argument("--eval-iters", type=positive_int, default=10, help="batches per validation estimate")
    d.add_argument("--log-interval", type=positive_int, default=20, help="steps between progress lines")
    d.add_argument("--log-json", metavar="FILE", help="write one JSON object per step (iter, loss, lr, ms, ...)")
    d.add_argument("--init-weights", metavar="FILE", help="start from these weights (.safetensors, GPT-2 names)")
    d.add_argument("--export-weights", metavar="FILE", help="save the final weights (.safetensors, GPT-2 names)")
    d.add_argument("--plot", metavar="FILE", default="out/loss.png", help="loss-curve picture ('' for none)")
    d.add_argument("--sample", type=int, default=200, help="bytes to generate after training (0: none)")
    return p


def _writable(p, flag, path):
    """Fail now, not after the whole run, if ``path`` cannot be written."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        p.error(f"{flag} {path}: cannot create {directory} ({exc.strerror})")
    if os.path.isdir(path) or not os.access(directory, os.W_OK):
        p.error(f"{flag} {path}: not a writable file path")


def check_args(p, args):
    """Errors a flag's own type cannot see, one line each, before anything is built."""
    if args.warmup_iters < 0:
        p.error(f"--warmup-iters must be >= 0, got {args.warmup_iters}")
    if args.min_lr > args.lr:
        p.error(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.data is not None and not os.path.exists(args.data):
        p.error(f"--data {args.data}: no such file or directory")
    if args.init_weights is not None and not os.path.isfile(args.init_weights):
        p.error(f"--init-weights {args.init_weights}: no such file")
    for flag in ("init_weights", "export_weights"):
        path = getattr(args, flag)
        if path is not None and not path.endswith(".safetensors"):
            p.error(f"--{flag.replace('_', '-')} {path}: expected a .safetensors file")
    for flag in ("log_json", "export_weights", "plot"):
        if getattr(args, flag):
            _writable(p, "--" + flag.replace("_", "-"), getattr(args, flag))


def build(p, args):
    """The data, model and optimizer the flags describe; a bad combination is a one-line error."""
    import minipar
    from minipar import checkpoint
    from minipar.data import Dataset, load_corpus
    from minipar.models import GPT, GPTConfig
    from minipar.optim import AdamW

    minipar.set_default_dtype(args.dtype)
    minipar.manual_seed(args.seed)
    try:
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, dropout=args.dropout)
    except ValueError as exc:
        p.error(str(exc))
    try:
        data = Dataset(load_corpus(args.data))
        data.check_block_size(args.block_size)
    except (OSError, ValueError) as exc:
        p.error(f"--data {args.data or '(default corpus)'}: {exc}")
    model = GPT(config)
    if args.init_weights:
        try:
            weights = checkpoint.load_weights(args.init_weights)
            # a float32 file may start a float64 run and back: the cast is explicit, here
            model.load_state_dict({k: v.astype(args.dtype) for k, v in weights.items()})
        except (OSError, ValueError) as exc:
            problems = str(exc).splitlines()
            more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
            p.error(f"--init-weights {args.init_weights}: {' '.join(problems[:2])}{more}; "
                    "the model flags must match the file's model")
    optimizer = AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                      weight_decay=args.weight_decay)
    return data, model, optimizer


def learning_rate(it, args):
    """Linear warm-up to --lr, then cosine decay to --min-lr at --max-iters (as nanoGPT)."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    progress = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (args.lr - args.min_lr)


def estimate_val_loss(model, data, args):
    from minipar.autograd import no_grad

    model.eval()
    with no_grad():
        losses = [model(*data.batch("val", i, args.batch_size, args.block_size, args.seed))[1].item()
                  for i in range(args.eval_iters)]
    model.train()
    return sum(losses) / len(losses)


def train_loop(args, data, model, optimizer, log):
    """Run --max-iters steps; returns the train losses and (step, val loss) pairs, or None if the
    run diverged."""
    from minipar.optim import clip_grad_norm

    tokens_per_step = args.batch_size * args.block_size
    history, val_history, val_loss = [], [], None
    clock = time.perf_counter()
    for it in range(args.max_iters):
        lr = optimizer.lr = learning_rate(it, args)
        x, y = data.batch("train", it, args.batch_size, args.block_size, args.seed)
        _, loss = model(x, y)
        loss.backward()
        model.finalize_grads()
        grad_norm = clip_grad_norm(model.parameters(), args.grad_clip)
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm)):
            print(f"error: at iter {it} the loss is {loss.item()} and the gradient norm {grad_norm}: "
                  "training diverged; lower --lr or raise --warmup-iters", file=sys.stderr)
            return None
        optimizer.step()
        optimizer.zero_grad()
        now = time.perf_counter()
        ms, clock = 1e3 * (now - clock), now
        record = {"iter": it, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm, "ms": ms}
        last = it == args.max_iters - 1
        if (it + 1) % args.eval_interval == 0 or last:
            val_loss = record["val_loss"] = estimate_val_loss(model, data, args)
            val_history.append((it, val_loss))
            clock = time.perf_counter()  # validation time is not a training step's time
        history.append(record["loss"])
        log.write(json.dumps(record) + "\n")
        log.flush()
        if it % args.log_interval == 0 or last:
            val = f"{val_loss:.4f}" if val_loss is not None else "  -   "
            print(f"iter {it:>5} | loss {record['loss']:.4f} | val {val} | lr {lr:.2e} | "
                  f"{tokens_per_step / (ms / 1e3):>8,.0f} tok/s | {ms:7.1f} ms/iter", flush=True)
    return history, val_history


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    data, model, optimizer = build(parser, args)
    print(f"model: {model.num_parameters():,} parameters, {args.n_layer} layers, {args.n_head} heads, "
          f"{args.n_embd} hidden, context {args.block_size}, {args.dtype}")
    print(f"data: {sum(len(s) for s in data.splits.values()):,} bytes "
          f"({args.data or 'Python standard library'}), "
          f"{args.batch_size * args.block_size:,} tokens per step")

    with open(args.log_json or os.devnull, "w") as log:
        result = train_loop(args, data, model, optimizer, log)
    if result is None:
        return 1
    history, val_history = result

    if args.export_weights:
        from minipar import checkpoint

        checkpoint.save_weights(model.state_dict(), args.export_weights)
        print(f"weights written to {args.export_weights}")
    if args.plot:
        from minipar.plots import plot_loss

        plot_loss(history, val_history, args.plot, title=f"GPT {model.num_parameters():,} params")
        print(f"loss curve written to {args.plot}")
    if args.sample > 0:
        from minipar.data import decode, encode

        prompt = encode("def ")[None, :]
        text = decode(model.generate(prompt, args.sample, temperature=0.8)[0])
        print("sample:\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
