"""Edges of the mixture of experts: the routing groups of sequence parallelism alone on an odd
length, whole-model calls refused under expert parallelism, and capacity dropping on grids where
ties decide (equal logits, equal rows), micro-batches and a pipeline stage without experts
(``tests/mpi/moe_edges.py``, float64, against one device)."""

import numpy
import pytest

from minipar.models.moe import RoutingGroups
from mpi_run import check_mpi


def test_routing_groups_of_sequence_parallelism_alone_need_no_even_length():
    # SP = 3 ranks of 3 positions each (T = 9, CP = 1): a layout the model runs, so its groups exist
    ids = RoutingGroups(rows=1, sp=3).ids(numpy.arange(2), numpy.arange(9))
    assert ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5]
    with pytest.raises(ValueError, match="10 positions do not cut into CP=1 x SP=3 parts"):
        RoutingGroups(rows=1, sp=3).ids(numpy.arange(1), numpy.arange(10))


def test_whole_model_state_dicts_refuse_under_expert_parallelism():
    """``full_state_dict`` once returned an EP rank's experts only, as if they were the whole model."""
    assert "whole-model calls refused on EP=2" in check_mpi(2, "moe_edges.py", "whole", timeout=60)


@pytest.mark.parametrize("args", [
    "ep=2 pp=2 nl=2 freq=2 cap=1.0",  # stage 1 has no MoE block: its EP group has nothing to route
    "ep=2 cap=0.5 ties=1",            # every logit equal: the lowest experts win, token order drops
    "ep=2 M=1 cap=0.5 dup=1",         # equal rows in one routing group: ties broken by token order
])
def test_capacity_dropping_on_a_grid_equals_one_device(args):
    out = check_mpi(4, "moe_edges.py", "layout", *args.split(), timeout=120)
    assert f"layout {args}: OK" in out, out
