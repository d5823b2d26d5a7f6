"""Each bad input to the training CLI and the launcher is one line and exit status 2, never a
traceback, and is found before training starts (issue 12)."""

import errno
import json
import math
import os
import resource
import struct
import subprocess
import sys

import pytest

from mpi_run import ROOT
from test_train import TINY, train

PROG = "python -m minipar.train: error: "
ONE_STEP = [*TINY, "--max-iters", "1", "--eval-iters", "1"]


def refused(run, *words):
    """The run ended with status 2 and one error line holding every word, before any step."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert all(w in lines[0] for w in words), (words, lines[0])
    assert "iter " not in run.stdout, run.stdout
    return lines[0]


@pytest.mark.parametrize("ranks", ["99999999999999999999", "1000001"])
def test_the_launcher_refuses_more_ranks_than_it_can_count(ranks):
    run = subprocess.run(["env", "PYTHON=/bin/false", os.path.join(ROOT, "run_mpi.sh"), "-n", ranks, __file__],
                         capture_output=True, text=True, timeout=30)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and f"-n {ranks}: at most 1000000 ranks" in lines[0], run.stderr


@pytest.mark.parametrize("args,words", [
    (["--tp", "2", "--tensor-model-parallel-size", "1"],  # argparse kept the last: TP 1
     ["--tp 2 and --tensor-model-parallel-size 1 are two names of one flag, given two values: give one"]),
    (["--n-lay", "3"], ["unrecognized arguments: --n-lay 3"]),  # no abbreviations, as Megatron-LM
    (["--tp", "--tensor-model-parallel-size", "2"], ["argument --tensor-model-parallel-size/--tp: expected one argument"]),  # not "two names of one flag"
])
def test_a_flag_is_read_as_typed(args, words, tmp_path):
    refused(train(*ONE_STEP, *args, cwd=tmp_path), PROG, *words)


def test_a_save_folder_that_is_a_file_is_named_as_given(tmp_path):
    (tmp_path / "ckpt").write_text("")
    refused(train(*ONE_STEP, "--save", "ckpt", cwd=tmp_path), PROG, "--save ckpt: ", "is a file, not a folder")  # not "ckpt/latest"


@pytest.mark.parametrize("plot,words", [("out/loss.xyz", ["--plot out/loss.xyz", "cannot write a .xyz file", ".png"]),
                                        ("foo", ["--plot foo", "no extension", "would write foo.png"])])
def test_a_plot_matplotlib_cannot_write_is_refused_before_training(plot, words, tmp_path):
    refused(train(*ONE_STEP, "--plot", plot, cwd=tmp_path), PROG, *words)
    assert not (tmp_path / "out" / "loss.xyz").exists()


@pytest.mark.parametrize("args,words", [
    (["--moe-router-topk", "3", "--moe-aux-loss-coeff", "0.01"],
     ["--moe-router-topk, --moe-aux-loss-coeff: for mixture-of-experts layers, and this model has none"]),
    (["--load", "no/such/dir"], ["--load: no/such/dir: no such directory"]),
    (["--tokenizer", "no/such/dir"], ["--tokenizer no/such/dir: no/such/dir: no such directory"]),
    (["--sample", "-5"], ["--sample is a number of tokens to generate (0: none), got -5"]),  # was taken as 0
    (["--cp-comm-type", "a2a"], ["--cp-comm-type a2a is how context-parallel ranks communicate, and --cp is 1"]),
    (["--save-interval", "5"], ["--save-interval 5 is how often --save DIR writes a checkpoint: give --save"]),
    (["--prompt", "hello", "--sample", "0"], ["--prompt 'hello' starts a sample, and --sample is 0"]),
    (["--sample", "5", "--prompt", ""], ["--prompt '': a sample continues some text: give --prompt TEXT, or --sample 0"]),
    # named one at a time, --num-virtual-stages 2 was refused next for --pp 1
    (["--schedule", "zb-v"], ["it needs --num-virtual-stages 2 and --pp > 1, got --num-virtual-stages 1, --pp 1"]),
    (["--schedule", "interleaved"], ["--schedule interleaved takes turns between each rank's chunks: with "
                                     "--num-virtual-stages 1 it is 1F1B; give --num-virtual-stages 2 or more"]),
    (["--override-opt_param-scheduler"], ["--override-opt_param-scheduler chooses between a checkpoint's "
                                          "learning-rate schedule and the flags': give --load"]),
    (["--use-checkpoint-lr-scheduler", "--override-lr-scheduler"],  # Megatron's older names
     ["--use-checkpoint-opt_param-scheduler takes the checkpoint's learning-rate schedule and "
      "--override-opt_param-scheduler the flags': give one"]),
])
def test_a_flag_that_would_do_nothing_or_names_nothing_is_refused(args, words, tmp_path):
    refused(train(*ONE_STEP, *args, cwd=tmp_path), PROG, *words)


@pytest.mark.parametrize("args,words", [
    (["--save", "D", "--export-hf", "D"], ["--save D is inside --export-hf D", "replaces whole"]),
    (["--export-hf", "H", "--log-json", "H/log.jsonl"], ["--log-json H/log.jsonl is inside --export-hf H"]),
    (["--log-json", "X.png", "--plot", "X.png"], ["--log-json and --plot both name X.png"]),
    (["--log-json", "corpus.txt"], ["--log-json corpus.txt would write into --data corpus.txt, an input"]),
    (["--data", "texts", "--save", "texts/ckpt"], ["--save texts/ckpt would write into --data texts"]),
])
def test_outputs_that_would_destroy_an_input_or_each_other_are_refused(args, words, tmp_path):
    """An audit found each of these losing data with exit status 0: --export-hf replaced the folder
    holding the checkpoints, the log overwrote the corpus, a checkpoint was read back as corpus text."""
    (tmp_path / "texts").mkdir()
    for corpus in (tmp_path / "corpus.txt", tmp_path / "texts" / "a.txt"):
        corpus.write_text("the corpus, which no flag may overwrite " * 20)
    refused(train(*ONE_STEP, "--data", "corpus.txt", *args, cwd=tmp_path), PROG, *words)
    assert (tmp_path / "corpus.txt").read_text().startswith("the corpus") and os.listdir(tmp_path / "texts") == ["a.txt"]


def test_a_refused_run_leaves_nothing_behind(tmp_path):
    """The output flags' folders were made while the flags were checked, even for a run refused."""
    outputs = ["--log-json", "a/b/log.jsonl", "--save", "c/d", "--export-weights", "e/w.safetensors",
               "--plot", "f/loss.png", "--export-hf", "g/h"]
    refused(train(*ONE_STEP, *outputs, "--seed", "-1", cwd=tmp_path), PROG, "--seed must be >= 0")
    assert os.listdir(tmp_path) == []
    # a run that goes on makes them, each where it writes
    run = train(*ONE_STEP, *outputs, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    for made in ("a/b/log.jsonl", "c/d/latest", "e/w.safetensors", "f/loss.png", "g/h/config.json"):
        assert (tmp_path / made).exists(), made


def test_an_empty_path_is_the_flag_not_given(tmp_path):
    """As --plot '' is no plot: some of these were refused ("--data : no such file"), --load ''
    started afresh."""
    empty = [arg for flag in ("--data", "--tokenizer", "--load", "--init-weights", "--save", "--log-json",
                              "--export-weights", "--export-hf") for arg in (flag, "")]
    run = train(*ONE_STEP, *empty, "--prompt", "", cwd=tmp_path)
    assert run.returncode == 0 and "Python standard library" in run.stdout, run.stderr
    assert os.listdir(tmp_path) == []


def test_a_folder_is_judged_by_the_nearest_one_above_it_that_exists(tmp_path):
    from minipar.checkpoint.files import folder_problem

    (tmp_path / "f.txt").write_text("")
    os.symlink(tmp_path / "gone", tmp_path / "link")
    os.symlink(tmp_path / "f.txt", tmp_path / "to_file")
    assert folder_problem(str(tmp_path / "new" / "deeper")) is None
    assert folder_problem(str(tmp_path / "f.txt" / "a" / "b")) == f"{tmp_path / 'f.txt'} is a file, not a folder"
    assert folder_problem(str(tmp_path / "link" / "a")) == f"{tmp_path / 'link'} is a link to nothing, not a folder"
    assert folder_problem(str(tmp_path / "to_file" / "a")) == f"{tmp_path / 'to_file'} is a file, not a folder"
    if os.path.isdir("/proc"):
        assert folder_problem("/proc/minipar/a").startswith("cannot create a file in /proc (to make minipar/a there) (")
    assert sorted(os.listdir(tmp_path)) == ["f.txt", "link", "to_file"]


def test_exporting_the_weights_over_those_the_run_started_from_is_allowed():
    from types import SimpleNamespace

    from minipar.train_checks import clashing_paths

    args = dict(log_json=None, export_weights="w.safetensors", plot=None, save="ckpt", export_hf=None,
                data="corpus.txt", init_weights="w.safetensors")
    assert clashing_paths(SimpleNamespace(**args)) == []
    assert clashing_paths(SimpleNamespace(**dict(args, plot="w.safetensors"))) == [
        "--export-weights and --plot both name w.safetensors: each needs a file of its own",
        "--plot w.safetensors would write into --init-weights w.safetensors, an input of this run: put it elsewhere"]


def test_a_path_that_only_begins_like_an_input_is_not_inside_it():
    """texts.jsonl and texts-ckpt lie beside the folder texts, not in it: names that share a
    beginning do not clash, and what is in the folder still does."""
    from types import SimpleNamespace

    from minipar.train_checks import clashing_paths

    args = dict(log_json="texts.jsonl", export_weights=None, plot=None, save="texts-ckpt", export_hf=None,
                data="texts", init_weights=None)
    assert clashing_paths(SimpleNamespace(**args)) == []
    assert clashing_paths(SimpleNamespace(**dict(args, save="texts/ckpt"))) == [
        "--save texts/ckpt would write into --data texts, an input of this run: put it elsewhere"]


def test_initial_weights_and_a_checkpoint_are_two_starting_points(tmp_path):
    """--init-weights and --load both set the weights: one of them would be dropped in silence."""
    from minipar.cli import FlagError
    from minipar.train import build_parser
    from minipar.train_checks import check_args

    (tmp_path / "w.safetensors").write_bytes(b"")
    args = build_parser().parse_args([*ONE_STEP, "--init-weights", str(tmp_path / "w.safetensors"),
                                      "--load", str(tmp_path)])
    with pytest.raises(FlagError) as refusal:
        check_args(args, 1)
    assert refusal.value.lines == ["--init-weights and --load both set the weights: give one"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a directory no file can be created in")
@pytest.mark.parametrize("flag", ["--log-json", "--export-weights", "--export-hf"])
def test_an_output_no_file_can_be_created_for_is_refused_before_training(flag):
    path = "/proc/minipar-out.safetensors" if flag == "--export-weights" else "/proc/minipar-out"
    refused(train(*ONE_STEP, flag, path), PROG, f"{flag} {path}: ", "/proc")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a write is for")
def test_a_full_disk_at_the_end_of_a_run_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """The run's own outputs fail as its checkpoints do: one line, no traceback, no temporary left."""
    from minipar import train as cli

    weights = tmp_path / "w.safetensors"
    write = os.write

    def full(fd, data):  # ENOSPC for the weights' temporary file only, as on a full disk
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".w.safetensors."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert cli.main([*ONE_STEP, "--export-weights", str(weights)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"{PROG}cannot write {weights} (No space left on device): the run trained all its "
                     "iterations, but saved no checkpoint: free space, and run again with --save DIR"], lines
    assert os.listdir(tmp_path) == []


def test_only_the_runs_own_outputs_fail_in_one_line():
    """Any other OSError (a tokenizer file removed during the run) keeps its traceback: it is not
    a write the user can fix by freeing space."""
    from types import SimpleNamespace

    from minipar.train import _an_output

    args = SimpleNamespace(log_json="out/log.json", export_weights=None, export_hf="hf", plot="")
    assert _an_output(args, os.path.abspath("out/log.json")) and _an_output(args, "hf")
    assert not _an_output(args, "tok/tokenizer.json") and not _an_output(args, None) and not _an_output(args, "")


def write_safetensors(path, shapes, dtype):
    """A safetensors file written by hand (NumPy has no bfloat16): the header's length as 8 bytes
    little-endian, the JSON header, then every tensor's bytes (zeros)."""
    size = {"BF16": 2, "I32": 4, "I64": 8}[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = size * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + bytes(offset))


@pytest.mark.parametrize("dtype", ["BF16", "I32", "I64"])
def test_weights_that_are_not_float32_or_float64_are_refused(dtype, tmp_path):
    from minipar.models import GPT, GPTConfig

    # every name and shape of the model the flags describe, so that only the dtype is wrong
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16))
    path = str(tmp_path / "w.safetensors")
    write_safetensors(path, {n: p.shape for n, p in model.named_parameters()}, dtype)
    line = refused(train(*ONE_STEP, "--init-weights", path), PROG, f"--init-weights {path}", f" is {dtype}",
                   "float32 or float64")
    assert ("convert bf16 weights to float32" in line) == (dtype == "BF16")


def test_a_model_too_large_for_the_machine_is_refused_from_its_size(tmp_path):
    def small_address_space():  # were the model built, it would fail fast here, not swap the machine
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    run = subprocess.run([sys.executable, "-m", "minipar.train", "--n-layer", "1000", "--n-embd", "8192", "--plot", ""],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, preexec_fn=small_address_space)
    refused(run, PROG, "12,886.7 GB for a model of 805,416,026,112 parameters", "GB for the activations the fullest "
            "rank keeps", "is available to each (MemAvailable", "--n-layer", "--tp")
    # a vocabulary of a billion tokens (the check once counted 256, and NumPy failed allocating 119 GiB)
    run = subprocess.run([sys.executable, "-m", "minipar.train", "--vocab-size", "1000000000", "--plot", ""],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, preexec_fn=small_address_space)
    refused(run, PROG, "for a model of 128,000,809,728 parameters", "fix: a smaller --vocab-size;")
    # ten million sequences a step: their token ids alone (the check once counted none, and the
    # run was killed for memory after 25 s without a word)
    run = subprocess.run([sys.executable, "-m", "minipar.train", "--global-batch-size", "10000000", "--plot", ""],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, preexec_fn=small_address_space)
    refused(run, PROG, "0.0 GB for a model of 842,496 parameters", "and 20.5 GB for the batch's token ids and",
            "fewer sequences per micro-batch (--micro-batch-size, --global-batch-size)")
    # a context of 300,000 positions: attention's T x T part of one layer (the check once counted no
    # activations, and the run took the machine's memory and was killed without a word)
    run = subprocess.run([sys.executable, "-m", "minipar.train", "--block-size", "300000", "--n-layer", "1",
                          "--n-head", "1", "--global-batch-size", "1", "--plot", ""],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, preexec_fn=small_address_space)
    refused(run, PROG, "GB for the activations the fullest rank keeps", "fix: fewer activations: a shorter --block-size")


def test_an_unknown_minipar_device_is_a_flag_problem(tmp_path):
    run = subprocess.run([sys.executable, "-m", "minipar.train", *ONE_STEP], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env=dict(os.environ, MINIPAR_DEVICE="tpu"))
    refused(run, PROG, "MINIPAR_DEVICE='tpu' (the default of --device) is not a device: set it to cpu or cuda")


@pytest.mark.parametrize("script", ["00_collectives.py", "01_autograd.py", "02_data_parallel.py"])
def test_an_unknown_minipar_device_stops_a_lesson_in_one_line(script):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "lessons", script)], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, MINIPAR_DEVICE="tpu"))
    refused(run, f"{script}: error: ", "MINIPAR_DEVICE='tpu'", "cpu", "cuda")
