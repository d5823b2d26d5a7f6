"""An uneven split of the layers over the pipeline chunks (``--pipeline-layers``, GPT's
``layers_per_stage``): the rules, and a 2-stage run equal to one device. The measured win of a
balanced split on a slowed stage is bench/hetero_pipeline.py's (a timing, so not asserted here)."""

import pytest

from minipar.models import GPT, GPTConfig
from minipar.parallel.validate import RunConfig, problems
from mpi_run import check_mpi, run_mpi

FLAGS = {"pipeline_layers": "--pipeline-layers", "n_layer": "--n-layer", "pp": "--pp"}


@pytest.mark.parametrize("pp,v,n_layer,layers", [(2, 1, 4, (3, 1)), (3, 1, 4, (2, 1, 1)), (2, 2, 6, (1, 2, 2, 1))])
def test_an_uneven_split_that_covers_the_layers_is_a_run(pp, v, n_layer, layers):
    schedule = "interleaved" if v > 1 else "1f1b"
    cfg = RunConfig(pp=pp, virtual_stages=v, schedule=schedule, n_layer=n_layer, pipeline_layers=layers)
    assert problems(cfg) == []
    if n_layer % (pp * v):  # without the split, the same run is refused
        assert "not divisible" in problems(RunConfig(pp=pp, virtual_stages=v, schedule=schedule, n_layer=n_layer))[0]


@pytest.mark.parametrize("layers,message", [
    ((4, 0), "--pipeline-layers [4, 0]: every pipeline chunk needs at least one layer"),
    ((1, 1, 2), "--pipeline-layers [1, 1, 2] has 3 counts: give one per pipeline chunk, --pp x virtual_stages = 2 x 1"),
    ((3, 2), "--pipeline-layers [3, 2] sums to 5, not --n-layer 4: give counts that add up to 4"),
])
def test_a_bad_split_is_refused_with_the_reason(layers, message):
    assert problems(RunConfig(pp=2, n_layer=4, pipeline_layers=layers), FLAGS) == [message]


def test_one_device_refuses_a_split_of_its_layers_into_two():
    with pytest.raises(ValueError, match="has 2 counts"):
        GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32), layers_per_stage=(3, 1))


@pytest.mark.parametrize("args", [["--layers", "3,1"], ["--layers", "1,2,2,1", "--schedule", "interleaved", "--v", "2"]])
def test_an_uneven_pipeline_matches_the_single_device_run(args):
    """float64: loss, gradients (by their global names), norm and parameters after two steps."""
    out = check_mpi(2, "pipeline.py", "--pp", "2", "--m", "4", *args, timeout=120)
    assert out.count("OK (layers") == 2
    assert ("layers [0, 1, 2]" in out and "layers [3]" in out) if args[1] == "3,1" else "layers [0, 3, 4]" in out


def test_an_uneven_split_that_does_not_cover_the_layers_ends_the_job():
    code, out, _ = run_mpi(2, "pipeline.py", "--pp", "2", "--layers", "1,2,1", timeout=60)
    assert code == 3 and out.count("refused: ") == 2 and "has 3 counts" in out, out
