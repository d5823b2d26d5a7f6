"""Stopping and resuming a training run (``--exit-interval``, ``--load``): what a resume must
continue exactly (the losses, the learning-rate schedule) and the checkpoints it refuses."""

import argparse
import json

import pytest

from minipar.lr_schedule import learning_rate
from test_train import TINY, losses, reseal, saved_index, train


def test_exit_interval_stops_at_each_multiple_and_resuming_repeats_the_run(tmp_path, corpus):
    common = [*TINY, "--data", corpus, "--max-iters", "6", "--dropout", "0.1", "--dtype", "float64"]
    whole, parts, save = str(tmp_path / "whole.jsonl"), str(tmp_path / "parts.jsonl"), str(tmp_path / "ckpt")
    assert train(*common, "--log-json", whole).returncode == 0
    interrupted = common + ["--save", save, "--exit-interval", "2", "--log-json", parts]
    first = train(*interrupted)
    assert first.returncode == 0 and "stopped after 2 iterations" in first.stdout, first.stderr
    for done in (4, 6):  # the same command with --load goes on to the next multiple, then to the end
        run = train(*interrupted, "--load", save)
        assert run.returncode == 0, run.stderr
        assert ("stopped after 4 iterations" in run.stdout) == (done == 4)
    assert losses(parts) == losses(whole)  # bit for bit in float64, dropout included
    again = train(*interrupted, "--load", save)
    assert again.returncode == 2 and "is at iteration 6, so --max-iters 6 leaves nothing to train" in again.stderr


@pytest.mark.parametrize("args,message", [
    (["--exit-interval", "2"], "--exit-interval stops the run to resume it later: give --save DIR"),
    (["--seed", "5"], "trained with --seed 1, not 5"),
    (["--batch-size", "8"], "trained with --global-batch-size 4, not 8"),
])
def test_a_resume_that_would_not_continue_the_run_is_refused(args, message, tmp_path, corpus):
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "2", "--seed", "1", "--save", save).returncode == 0
    run = train(*TINY, "--data", corpus, "--max-iters", "4", "--seed", "1", "--load", save, *args)
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def rates(path):
    with open(path) as fh:
        return [json.loads(line)["lr"] for line in fh]


def test_a_resume_keeps_the_learning_rate_schedule_it_was_trained_on(tmp_path, corpus):
    """Another --lr, or a longer --max-iters (which stretches the cosine), would change the rate at
    the resume step without a word. As Megatron-LM, such a resume is refused unless the user
    chooses: the checkpoint's schedule, or the flags' from here on."""
    common = [*TINY, "--data", corpus, "--warmup-iters", "0", "--lr", "0.01", "--weight-decay", "0.5"]
    whole, save = str(tmp_path / "whole.jsonl"), str(tmp_path / "ckpt")
    assert train(*common, "--max-iters", "4", "--log-json", whole).returncode == 0
    assert train(*common, "--max-iters", "4", "--save", save, "--exit-interval", "2").returncode == 0
    other = [*TINY, "--data", corpus, "--warmup-iters", "0", "--lr", "0.02", "--max-iters", "6", "--load", save]
    ended = train(*common, "--max-iters", "1", "--load", save)  # said first: the schedule is not what is wrong
    assert ended.returncode == 2 and "so --max-iters 1 leaves nothing to train" in ended.stderr, ended.stderr
    run = train(*other)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert ("trained on another learning-rate schedule: --lr 0.02 (saved: 0.01), --weight-decay 0.1 (saved: 0.5), "
            "a decay over 6 steps (--lr-decay-iters, or --max-iters when not given; saved: 4)") in lines[0]
    taken, followed = str(tmp_path / "taken.jsonl"), str(tmp_path / "followed.jsonl")
    assert train(*other, "--use-checkpoint-opt_param-scheduler", "--log-json", taken).returncode == 0
    assert losses(taken)[:2] == losses(whole)[2:]  # the run it continues (its weight decay too), then --min-lr
    assert rates(taken) == rates(whole)[2:] + [3e-4, 3e-4]
    assert train(*other, "--override-opt_param-scheduler", "--log-json", followed).returncode == 0
    flags = argparse.Namespace(lr=0.02, min_lr=3e-4, warmup_iters=0, lr_decay_iters=6)
    assert rates(followed) == [learning_rate(it, flags) for it in range(2, 6)] and rates(followed) != rates(taken)


def test_a_checkpoint_saved_before_schedules_were_resumes_and_a_damaged_schedule_is_refused(tmp_path, corpus):
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "2", "--save", save).returncode == 0
    index_file, index = saved_index(save)
    assert index["trainer"]["schedule"] == dict(lr=3e-3, min_lr=3e-4, warmup_iters=50, lr_decay_iters=2, weight_decay=0.1)
    for schedule, message in (({**index["trainer"]["schedule"], "lr": "0.003"}, "is not one (lr)"),
                              ({**index["trainer"]["schedule"], "min_lr": 1.0}, "is not one (min_lr above lr)"),
                              (None, "resuming at iteration 2")):  # from before: nothing to compare
        if schedule is None:
            del index["trainer"]["schedule"]
        else:
            index["trainer"]["schedule"] = schedule
        reseal(index_file, index)
        run = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", save)
        assert message in (run.stderr if schedule else run.stdout), run.stderr
        assert run.returncode == (2 if schedule else 0), run.stderr
    run = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", save, "--use-checkpoint-opt_param-scheduler")
    assert run.returncode == 2 and "was saved before checkpoints kept their learning-rate schedule" in run.stderr


def test_the_schedule_warms_up_decays_over_its_steps_and_then_holds():
    flags = argparse.Namespace(lr=1.0, min_lr=0.1, warmup_iters=2, lr_decay_iters=6)
    got = [learning_rate(it, flags) for it in range(8)]
    # (it + 1) / (warmup + 1), then the cosine's top: the peak once (it used to be held two steps)
    assert got[:3] == [pytest.approx(1 / 3), pytest.approx(2 / 3), 1.0] and got[3] < 1.0
    assert got[4] == pytest.approx(0.55) and got[6:] == [0.1, 0.1]  # half way: the mean; after: --min-lr


def test_a_constant_schedule_is_a_schedule_a_checkpoint_can_keep():
    """--min-lr equal to --lr (a constant rate after warm-up) is a run's schedule: the flags take it
    and a checkpoint that saved it resumes, under the same flags or taking the saved ones; only
    --min-lr above --lr is refused, in the flags and in a saved schedule."""
    from minipar.lr_schedule import flag_problems, resume_problem, schedule_state

    def flags(**changes):
        values = dict(lr=0.01, min_lr=0.01, warmup_iters=0, lr_decay_iters=None, max_iters=4, weight_decay=0.1,
                      use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False, load="ckpt")
        return argparse.Namespace(**{**values, **changes})

    args = flags()
    assert flag_problems(args) == [] and args.lr_decay_iters == 4
    saved = schedule_state(args)
    assert resume_problem(saved, args, "ckpt") is None
    assert resume_problem(saved, flags(use_checkpoint_opt_param_scheduler=True, lr=0.5, min_lr=0.5), "ckpt") is None
    assert "--min-lr 0.02 is above --lr 0.01" in flag_problems(flags(min_lr=0.02))[0]
    assert "min_lr above lr" in resume_problem({**saved, "min_lr": 0.02}, args, "ckpt")


def test_a_checkpoint_that_counted_dropout_calls_is_refused_in_one_line(tmp_path, corpus):
    """Masks are keyed by the iteration and the position now: a checkpoint that stored the old
    running count of dropout calls cannot continue exactly, and says so."""
    save = str(tmp_path / "ckpt")
    assert train(*TINY, "--data", corpus, "--max-iters", "4", "--exit-interval", "2", "--save", save).returncode == 0
    index_file, index = saved_index(save)
    assert set(index["trainer"]["rng"]) == {"seed"}  # the iteration, saved beside it, keys the masks
    index["trainer"]["rng"]["calls"] = 20
    reseal(index_file, index)
    run = train(*TINY, "--data", corpus, "--max-iters", "4", "--load", save)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1 and "keyed by position" in lines[0], run.stderr
