"""The checks of ``python -m minipar.train``'s flags and files, run on every rank before any rank
communicates (``minipar.train.main``): each problem is one line, and all of them are raised at
once as a FlagError.

    check_args    the flags among themselves and against the machine: the run's sizes (asked of
                  ``minipar.parallel.validate``), paths that must be writable, the model's memory
    check_files   what ``--load`` and ``--init-weights`` hold: this model, this seed, batch and
                  corpus; ``--load`` becomes the checkpoint directory itself, not ``latest``
"""

import os
from dataclasses import replace

import numpy

from minipar.cli import FlagError
from minipar.lr_schedule import flag_problems as schedule_flag_problems
from minipar.train_paths import clashing_paths, writable

PROG = "python -m minipar.train"  # the command: every error line it prints starts with it

# the RunConfig field each flag sets, so that a problem names the flag
FLAGS = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp", "cp_comm_type": "--cp-comm-type", "virtual_stages": "--num-virtual-stages", "schedule": "--schedule",
         "global_batch": "--global-batch-size", "micro_batch_size": "--micro-batch-size", "n_layer": "--n-layer", "pipeline_layers": "--pipeline-layers",
         "n_head": "--n-head", "n_embd": "--n-embd", "block_size": "--block-size", "dropout": "--dropout",
         "sequence_parallel": "--sequence-parallel", "zero_stage": "--zero-stage", "dtype": "--dtype",
         "ep": "--ep", "num_experts": "--num-experts", "moe_router_topk": "--moe-router-topk",
         "moe_layer_freq": "--moe-layer-freq", "moe_expert_capacity_factor": "--moe-expert-capacity-factor",
         "vocab_size": "--vocab-size", "recompute": "--recompute", "defer_embedding_wgrad": "--defer-embedding-wgrad-compute",
         "defer_wgrad_linears": "--defer-wgrad-linears"}

# the mixture-of-experts flags' defaults (train.py's parser takes them from here): any other value
# without --num-experts is a flag that would do nothing
PROMPT = "def "  # --prompt's default: the default corpus is Python
ROUTER_DEFAULTS = {"moe_router_topk": 2, "moe_router_pre_softmax": False, "moe_layer_freq": 1,
                   "moe_expert_capacity_factor": None, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0}


def run_config(args, world_size):
    """The run the flags describe, as plain numbers (``minipar.parallel.validate``)."""
    from minipar.parallel.validate import RunConfig

    return RunConfig(world_size=world_size, tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp,
                     cp_comm_type=args.cp_comm_type, virtual_stages=args.vpp,
                     schedule=args.schedule, global_batch=args.batch_size, micro_batch_size=args.micro_batch_size,
                     n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                     vocab_size=args.vocab_size,
                     dropout=args.dropout, sequence_parallel=args.sequence_parallel, zero_stage=args.zero_stage,
                     recompute=args.recompute, dtype=model_dtype(args), fp32_grads=args.accumulate_allreduce_grads_in_fp32,
                     pipeline_layers=args.pipeline_layers, defer_embedding_wgrad=args.defer_embedding_wgrad,
                     defer_wgrad_linears=args.defer_wgrad_linears,
                     ep=args.ep, num_experts=args.num_experts,
                     moe_router_topk=args.moe_router_topk if args.num_experts else None,
                     moe_layer_freq=args.moe_layer_freq, moe_expert_capacity_factor=args.moe_expert_capacity_factor)


def model_dtype(args):
    """The dtype of the model's weights: --bf16's, --fp16's, or --dtype's."""
    return "bfloat16" if args.bf16 else "float16" if args.fp16 else args.dtype


def mixed_precision_problems(args):
    """Megatron's mixed-precision flags among themselves and with --dtype (the masters' dtype)."""
    out, scale_flags = [], ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
    given = ["--" + f.replace("_", "-") for f in scale_flags if getattr(args, f) is not None]
    if args.bf16 and args.fp16:
        out.append("--bf16 and --fp16 are two 16-bit formats: give one")
    if (args.bf16 or args.fp16) and args.dtype != "float32":
        out.append(f"--dtype {args.dtype} with --{'bf16' if args.bf16 else 'fp16'}: mixed precision keeps float32 "
                   "master weights; drop --dtype")
    if given and not args.fp16:
        out.append(f"{' '.join(given)}: a loss scale is for --fp16 (bfloat16 has float32's range and needs none)")
    if args.loss_scale is not None and len(given) > 1:
        out.append("--loss-scale is a constant scale: the dynamic scale's flags "
                   f"({' '.join(g for g in given if g != '--loss-scale')}) do not apply")
    if args.fp16 and args.loss_scale is None:  # with Megatron's defaults for the flags not given
        from minipar.precision import MEGATRON_DEFAULTS

        scales = {f: (getattr(args, f), "") if getattr(args, f) is not None else
                  (MEGATRON_DEFAULTS[f], " (the default)") for f in ("min_loss_scale", "initial_loss_scale")}
        (low, low_note), (high, high_note) = scales["min_loss_scale"], scales["initial_loss_scale"]
        if low > high:
            out.append(f"--min-loss-scale {low:g}{low_note} is above --initial-loss-scale {high:g}{high_note}")
    if args.fp16 and not out:  # whatever else the scaler's own rules refuse
        from minipar.precision import from_flags

        try:
            from_flags("float32", False, True, False, args.loss_scale, args.initial_loss_scale, args.min_loss_scale,
                       args.loss_scale_window, args.hysteresis)
        except ValueError as exc:
            out.append(f"{' '.join(given) or '--fp16'}: {exc}")
    if args.accumulate_allreduce_grads_in_fp32 and not (args.bf16 or args.fp16):
        out.append("--accumulate-allreduce-grads-in-fp32 is for --bf16 or --fp16 runs")
    return out


def sample_problems(args):
    """--sample and --prompt, which are used only once the run has trained: checked now."""
    problems = []
    if args.sample < 0:
        problems.append(f"--sample is a number of tokens to generate (0: none), got {args.sample}")
    if args.sample == 0 and args.prompt not in (PROMPT, ""):
        problems.append(f"--prompt {args.prompt!r} starts a sample, and --sample is 0: give --sample N "
                        "(tokens to generate), or drop --prompt")
    if args.sample > 0 and not args.prompt:
        problems.append("--prompt '': a sample continues some text: give --prompt TEXT, or --sample 0")
    try:  # a command line that is not UTF-8 reaches Python as lone surrogates, which no encoder takes
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        problems.append(f"--prompt {args.prompt!r}: not UTF-8 text (at character {exc.start}): the sample's "
                        "tokens are of UTF-8 text; give the prompt in UTF-8")
    return problems


def check_args(args, world_size):
    """Every error a flag's own type cannot see, one line each, before anything is built or sent;
    raises FlagError with all of them. Fills in ``args.dp`` and ``args.micro_batches``."""
    from minipar.cli import device_problems
    from minipar.parallel.validate import resolve
    from minipar.train_plan import balanced_layers, balanced_linears, memory_problem

    problems = device_problems(args)
    problems += schedule_flag_problems(args)
    if args.recompute and args.recompute_granularity == "selective":
        problems.append("--recompute is --recompute-granularity full: give one of them")
    args.recompute = args.recompute or args.recompute_granularity == "full"  # the executor's full recompute
    if args.cp_comm_type != "p2p" and args.cp == 1:
        problems.append(f"--cp-comm-type {args.cp_comm_type} is how context-parallel ranks communicate, and --cp is 1: "
                        "give --cp > 1, or drop it")
    if args.ep > 1 and not args.num_experts:
        problems.append(f"--ep {args.ep} splits the experts of mixture-of-experts layers: give --num-experts")
    if not args.num_experts:  # the router's flags, set to other than their defaults, with no experts to route to
        unused = ["--" + dest.replace("_", "-") for dest, default in ROUTER_DEFAULTS.items() if getattr(args, dest) != default]
        if unused:
            problems.append(f"{', '.join(unused)}: for mixture-of-experts layers, and this model has none: "
                            "give --num-experts, or drop them")
    problems += mixed_precision_problems(args)
    if args.schedule == "pipedream-2bw" and args.fp16:  # (bf16 has no loss scale: its masters are the newest version)
        problems.append("--schedule pipedream-2bw with --fp16: an overflow skips a step, and the delayed update "
                        "would have to be skipped with it; train in --bf16")
    if args.seed < 0:
        problems.append(f"--seed must be >= 0, got {args.seed}")
    if args.data is not None and not os.path.exists(args.data):
        problems.append(f"--data {args.data}: no such file or directory")
    if args.init_weights is not None and not os.path.exists(args.init_weights):
        problems.append(f"--init-weights {args.init_weights}: no such file or directory")
    if args.init_weights and args.load:
        problems.append("--init-weights and --load both set the weights: give one")
    for flag in ("init_weights", "export_weights"):
        path = getattr(args, flag)
        if path is not None and not path.endswith(".safetensors") and not (flag == "init_weights" and os.path.isdir(path)):
            problems.append(f"--{flag.replace('_', '-')} {path}: expected a .safetensors file"
                            + (" or a Hugging Face snapshot directory" if flag == "init_weights" else ""))
    problems += sample_problems(args)
    if args.export_hf:
        from minipar.checkpoint.hf import export_dir_problem

        why = export_dir_problem(args.export_hf)
        if why:
            problems.append(f"--export-hf {args.export_hf}: {why}")
    if args.num_experts and (args.export_hf or (args.init_weights and os.path.isdir(args.init_weights))):
        flag, path = ("--export-hf", args.export_hf) if args.export_hf else ("--init-weights", args.init_weights)
        problems.append(f"{flag} {path}: GPT-2 has dense MLPs, and this model has --num-experts {args.num_experts}: "
                        "keep a mixture of experts in minipar's own files (--export-weights, --save)")
    if args.plot:
        from minipar.plots import path_problem

        why = path_problem(args.plot)
        if why:
            problems.append(f"--plot {args.plot}: {why}")
    problems += clashing_paths(args)
    for flag in ("log_json", "export_weights", "plot"):
        if getattr(args, flag):
            problems.append(writable("--" + flag.replace("_", "-"), getattr(args, flag)))
    if args.save:  # the folder named as given (its `latest` only if the folder itself is fine)
        from minipar.checkpoint.files import folder_problem

        why = folder_problem(os.path.abspath(args.save))
        problems.append(f"--save {args.save}: {why}" if why else writable("--save", os.path.join(args.save, "latest")))
    if args.save_interval and not args.save:
        problems.append(f"--save-interval {args.save_interval} is how often --save DIR writes a checkpoint: give --save")
    args.save_interval = args.save_interval or 100
    for flag in ("keep_checkpoints", "overwrite_checkpoints"):
        if getattr(args, flag) and not args.save:
            problems.append(f"--{flag.replace('_', '-')} is about the checkpoints of --save DIR: give --save")
    if args.exit_interval and not args.save:
        problems.append("--exit-interval stops the run to resume it later: give --save DIR to keep its state")
    problems += balanced_layers(args)
    run, layout = resolve(run_config(args, world_size), FLAGS)  # the layout, model, schedule, batch, ZeRO
    if not layout:  # the sizes make sense: will the model and its activations fit before they are allocated?
        if args.defer_wgrad_linears == "balanced":  # a count once the micro-batches are known
            args.defer_wgrad_linears = balanced_linears(args, run)
            run = replace(run, defer_wgrad_linears=args.defer_wgrad_linears)
        problems.append(memory_problem(args, run))
    problems = [p for p in problems if p] + layout
    if problems:
        raise FlagError(*problems)
    args.dp, args.micro_batches = run.dp, run.micro_batches


def _trainer_state_problem(saved, iteration):
    """What is wrong with a checkpoint's trainer state beyond its types (checked before), or None:
    the iteration the run resumes at is the index's, seeds are NumPy's (>= 0), the corpus it was
    trained on, recorded by every checkpoint of this format, is [bytes, SHA-256], what made its
    tokens is "bytes" or a SHA-256 (read by a recipe numbered from 1), and the bos/eos ids an export writes are ids or null."""
    from minipar.checkpoint.hf import token_id
    from minipar.checkpoint.index import is_sha256

    if saved["iteration"] != iteration:
        return f"says iteration {saved['iteration']}, the index {iteration}"
    negative = [key for key, value in (("seed", saved["seed"]), ("rng.seed", saved["rng"]["seed"])) if value < 0]
    if negative:
        return f"has a negative {' and '.join(negative)}"
    corpus = saved.get("corpus")
    if not (isinstance(corpus, list) and len(corpus) == 2 and type(corpus[0]) is int and corpus[0] >= 0
            and is_sha256(corpus[1])):
        return "has no corpus [bytes, sha256] (every checkpoint records the corpus it was trained on)"
    tokens = saved.get("tokenizer")  # (absent from checkpoints older than it)
    if tokens is not None and tokens != "bytes" and not is_sha256(tokens):
        return 'has a tokenizer that is neither "bytes" nor a SHA-256'
    recipe = saved.get("token_recipe")  # (absent from checkpoints older than it, and from runs on bytes)
    if recipe is not None and (type(recipe) is not int or recipe < 1):
        return "has a token_recipe that is not a whole number from 1"
    ids = saved.get("hf_token_ids", {})  # (absent from checkpoints older than it)
    if not (isinstance(ids, dict) and set(ids) <= {"bos_token_id", "eos_token_id"} and all(map(token_id, ids.values()))):
        return "has hf_token_ids that are not {bos_token_id, eos_token_id} of token ids, lists of them, or null"
    return None


def check_files(p, args, config, data):
    """The checkpoint or weights to start from must hold this model and have been trained on this
    corpus (read on every rank, before any communication). ``args.load`` becomes the checkpoint
    directory itself (not ``latest``, which may move)."""
    from minipar.checkpoint.sharded import CheckpointError, check_model, read_index
    from minipar.lr_schedule import resume_problem
    from minipar.run_inputs import corpus_matches, tokenizer_matches

    if args.load:
        try:
            index = read_index(args.load)
            mixed = "--bf16" if args.bf16 else "--fp16" if args.fp16 else None
            check_model(index, config, args.dtype,  # a 16-bit run's checkpoint keeps its float32 masters
                        f"the master weights of {mixed}, which are float32 always" if mixed else None)
        except CheckpointError as exc:
            p.error(f"--load: {exc}")
        args.load = index["path"]
        saved = index["trainer"]
        # read_index checked the index's own fields; the trainer's state is ours to check
        rng = saved.get("rng") if isinstance(saved.get("rng"), dict) else {}
        missing = [key for key in ("iteration", "seed", "batch_size") if type(saved.get(key)) is not int]
        missing += [] if type(rng.get("seed")) is int else ["rng.seed"]
        skipped = saved.get("skipped_in_a_row", 0)  # fp16's count (absent before it was saved)
        missing += [] if type(skipped) is int and skipped >= 0 else ["skipped_in_a_row"]
        if missing:
            p.error(f"--load: {args.load}/index.json: its trainer state has no whole number "
                    f"{', '.join(missing)}: it was not written by minipar.train")
        # the index is sealed, but whoever edits it can seal it again: its fields must agree
        problem = _trainer_state_problem(saved, index["iteration"])
        if problem:
            p.error(f"--load: {args.load}/index.json: its trainer state {problem}; load an earlier checkpoint")
        if args.hf_token_ids.get("eos_token_id") is None:  # neither --init-weights DIR nor --tokenizer gave them
            args.hf_token_ids = saved.get("hf_token_ids", {})  # the snapshot's a run began from, if it did
        problem = corpus_matches(saved.get("corpus"), data, f"--data {args.data or '(default corpus)'}")
        problem = problem or tokenizer_matches(saved.get("tokenizer"), args, saved.get("token_recipe"))
        if problem:
            p.error(problem)
        for key, flag in (("seed", "--seed"), ("batch_size", "--global-batch-size")):
            if saved[key] != getattr(args, key):
                p.error(f"--load: the checkpoint was trained with {flag} {saved[key]}, not "
                        f"{getattr(args, key)}: the data would differ from the run it continues")
        if index["iteration"] >= args.max_iters > 0:  # --max-iters 0: only evaluate, sample or export it
            p.error(f"--load: the checkpoint is at iteration {index['iteration']}, so --max-iters "
                    f"{args.max_iters} leaves nothing to train: raise --max-iters")
        problem = resume_problem(saved.get("schedule"), args, args.load)
        if problem:
            p.error(problem)
    if args.init_weights:
        from minipar import checkpoint
        from minipar.checkpoint import hf
        from minipar.models import GPT

        try:
            if os.path.isdir(args.init_weights):  # its config.json already set the model flags (train_sources)
                weights = hf.load_snapshot(args.init_weights)[0]
            else:
                weights = checkpoint.load_weights(args.init_weights)
                weights = hf.from_hf(weights) if hf.is_hf_layout(weights) else weights
        except (OSError, ValueError) as exc:
            p.error(f"--init-weights {args.init_weights}: {exc}")
        # the names and shapes of the single-device model (the trainer reseeds before its own)
        expected = {n: q.shape for n, q in GPT(config).named_parameters()}
        problems = [f"missing: {n}" for n in expected if n not in weights]
        problems += [f"unexpected: {n}" for n in weights if n not in expected]
        problems += [f"{n}: shape {tuple(weights[n].shape)}, model has {s}" for n, s in expected.items()
                     if n in weights and tuple(weights[n].shape) != s]
        if problems:
            more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
            # a snapshot's config.json set the model flags, which contradicting it refused already
            fix = ("its model.safetensors does not hold the model its config.json describes" if os.path.isdir(
                args.init_weights) else "the model flags must match the file's model")
            p.error(f"--init-weights {args.init_weights}: {'; '.join(problems[:2])}{more}; {fix}")
        bad = [n for n, w in weights.items() if not numpy.isfinite(w).all()]
        if bad:  # such a run diverged at once, or with --max-iters 0 exported them
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            p.error(f"--init-weights {args.init_weights}: {bad[0]}{more} holds NaN or infinite values: "
                    "a run starts from finite weights")
        # a float32 file may start a float64 run and back: the cast is explicit, here
        return {k: v.astype(args.dtype) for k, v in weights.items()}
    return None
