"""The loss scalers' and the policy's edges: what they refuse, and a scale resumed under other flags."""

import math

import pytest

from minipar.precision import ConstantLossScaler, DynamicLossScaler, Policy


@pytest.mark.parametrize("make", [lambda: DynamicLossScaler(initial_scale=math.inf),
                                  lambda: DynamicLossScaler(initial_scale=math.inf, min_scale=math.inf),
                                  lambda: ConstantLossScaler(math.inf),
                                  lambda: DynamicLossScaler(growth_factor=math.inf)])
def test_an_infinite_scale_is_refused(make):
    # an infinite scale makes every gradient inf: every step skipped, and inf / 2 is inf again, so the
    # dynamic scale never came down (nor counted as "at its floor", which stops a stuck run)
    with pytest.raises(ValueError, match="finite"):
        make()


def test_a_resumed_scale_grows_under_a_shorter_window():
    saved = DynamicLossScaler(initial_scale=2.0**10, growth_interval=1000)
    for _ in range(700):
        saved.update(False)
    resumed = DynamicLossScaler(initial_scale=2.0**10, growth_interval=100)  # --loss-scale-window 100
    resumed.load_state_dict(saved.state_dict())
    for _ in range(100):
        resumed.update(False)
    assert resumed.scale == 2.0**11  # 700 clean steps in a row already: the window is over


def test_a_resumed_hysteresis_is_at_most_the_flags():
    saved = DynamicLossScaler(initial_scale=2.0**10, hysteresis=4)
    resumed = DynamicLossScaler(initial_scale=2.0**10, hysteresis=1)  # --hysteresis 1
    resumed.load_state_dict(saved.state_dict())
    resumed.update(True)
    assert resumed.scale == 2.0**9


@pytest.mark.parametrize("state", [{"scale": math.nan, "growth_tracker": 0, "hysteresis_tracker": 2},
                                   {"scale": math.inf, "growth_tracker": 0, "hysteresis_tracker": 2},
                                   {"scale": 0.0, "growth_tracker": 0, "hysteresis_tracker": 2},
                                   {"scale": 8.0, "growth_tracker": -1, "hysteresis_tracker": 2}])
def test_a_checkpoints_scale_that_cannot_train_is_refused(state):
    # the trainer turns a ValueError here into a CheckpointError naming the file
    with pytest.raises(ValueError, match="loss scale"):
        DynamicLossScaler().load_state_dict(state)


def test_masters_are_never_narrower_than_the_model():
    # float32 masters for a float64 model would round away every update's last digits silently
    with pytest.raises(ValueError, match="float64"):
        Policy.of("float64")
    assert Policy.of("float64", main="float64").main.name == "float64"


def test_a_policy_is_for_a_float_model():
    with pytest.raises(ValueError, match="int32"):
        Policy("int32", "float32", "int32")
