import pytest

import minipar
from minipar.dtypes import get_default_dtype, set_default_dtype


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts in float32 with the process generator at seed 0, and leaves it so."""
    dtype = get_default_dtype()
    minipar.manual_seed(0)
    yield
    set_default_dtype(dtype)


@pytest.fixture
def float64():
    set_default_dtype("float64")
    yield
