"""The learning-rate schedule: a linear warm-up to --lr, then a cosine decay to --min-lr over
--lr-decay-iters steps (--max-iters unless given), as nanoGPT and Megatron-LM; and what a resumed
run does with the schedule its checkpoint was trained on.

A checkpoint stores the schedule's values. A run that continues it with other values would change
its learning rate at the resume step without a word (a longer --max-iters stretches the cosine, so
the rate jumps back up), so, as Megatron-LM's ``OptimizerParamScheduler``, the values must match
unless the user chooses:

    --use-checkpoint-opt_param-scheduler   take the checkpoint's values, whatever the flags say
    --override-opt_param-scheduler         follow the flags' values from the resume step on
"""

import math

# what the schedule is made of, as (name in the checkpoint and in args, the flag that sets it)
FIELDS = (("lr", "--lr"), ("min_lr", "--min-lr"), ("warmup_iters", "--warmup-iters"),
          ("lr_decay_iters", "--lr-decay-iters"), ("weight_decay", "--weight-decay"))
INTEGERS = {"warmup_iters", "lr_decay_iters"}


def learning_rate(it, args):
    """The rate at iteration ``it`` (0-based): it warms up for ``warmup_iters`` steps,
    lr (it + 1) / (warmup + 1), so that the peak is reached once, at ``it = warmup``, where
    lr(it) = min_lr + (lr - min_lr) (1 + cos(pi p)) / 2 with p = (it - warmup) / (decay - warmup)
    begins; held at min_lr once p reaches 1."""
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    progress = (it - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (args.lr - args.min_lr)


def schedule_state(args):
    """What a checkpoint keeps of the schedule (the weight decay with it, as Megatron's does)."""
    return {name: getattr(args, name) for name, _ in FIELDS}


def _bad(saved):
    """The saved schedule's fields that are not what a run could have had."""
    bad = []
    for name, _ in FIELDS:
        value = saved.get(name)
        if name in INTEGERS:
            ok = type(value) is int and value >= 0
        else:
            ok = type(value) in (int, float) and math.isfinite(value) and value >= 0
        bad += [] if ok else [name]
    if not bad and saved["min_lr"] > saved["lr"]:
        bad.append("min_lr above lr")
    return bad


def flag_problems(args):
    """The schedule's flags a run cannot take (lines); fills in the decay's length."""
    problems = []
    if args.warmup_iters < 0:
        problems.append(f"--warmup-iters must be >= 0, got {args.warmup_iters}")
    if args.min_lr > args.lr:
        problems.append(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.max_iters
    elif args.lr_decay_iters <= args.warmup_iters < args.max_iters:
        # steps past the warm-up would follow a cosine of no steps (Megatron-LM refuses it too); a run
        # that ends within its warm-up never reaches it
        problems.append(f"--lr-decay-iters {args.lr_decay_iters} ends the decay before --warmup-iters "
                        f"{args.warmup_iters} ends the warm-up, and --max-iters {args.max_iters} trains past it: "
                        "give --lr-decay-iters above --warmup-iters")
    chosen = [flag for flag, on in (("--use-checkpoint-opt_param-scheduler", args.use_checkpoint_opt_param_scheduler),
                                    ("--override-opt_param-scheduler", args.override_opt_param_scheduler)) if on]
    if len(chosen) == 2:
        problems.append(f"{chosen[0]} takes the checkpoint's learning-rate schedule and {chosen[1]} the flags': give one")
    elif chosen and not args.load:
        problems.append(f"{chosen[0]} chooses between a checkpoint's learning-rate schedule and the flags': "
                        "give --load, or drop it")
    return problems


def resume_problem(saved, args, where):
    """What is wrong with resuming the checkpoint whose schedule is ``saved`` (None: saved before
    schedules were) under these flags, as one line, or None."""
    if args.override_opt_param_scheduler or args.max_iters == 0:
        return None  # the flags chosen, or nothing to train
    if saved is None:  # saved before checkpoints kept it: nothing to compare, nothing to take
        return (f"--load: {where} was saved before checkpoints kept their learning-rate schedule: give its "
                "flags instead of --use-checkpoint-opt_param-scheduler") if args.use_checkpoint_opt_param_scheduler else None
    bad = _bad(saved) if isinstance(saved, dict) else ["the whole"]
    if bad:
        return (f"--load: {where}/index.json: its learning-rate schedule is not one ({', '.join(bad)}): "
                "it was not written by minipar.train")
    if args.use_checkpoint_opt_param_scheduler:
        return None
    differ = [f"{flag} {getattr(args, name)} (saved: {saved[name]})" for name, flag in FIELDS
              if getattr(args, name) != saved[name] and name != "lr_decay_iters"]
    steps = args.lr_decay_iters
    if steps != saved["lr_decay_iters"]:
        differ.append(f"a decay over {steps} step{'s' if steps != 1 else ''} (--lr-decay-iters, or --max-iters when "
                      f"not given; saved: {saved['lr_decay_iters']})")
    if not differ:
        return None
    return (f"--load: the checkpoint was trained on another learning-rate schedule: {', '.join(differ)}; "
            "give the saved values, or --use-checkpoint-opt_param-scheduler to take them, or "
            "--override-opt_param-scheduler to follow the flags from here")


def take_schedule(args, saved):
    """--use-checkpoint-opt_param-scheduler: the flags take the checkpoint's values. Called once the
    ranks agree on the checkpoint (rank 0's, whatever ``latest`` said to each), so that every rank
    takes the same ones; ``resume_problem`` has checked them."""
    for name, _ in FIELDS:
        setattr(args, name, saved[name])
