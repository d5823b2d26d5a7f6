"""minipar: parallel training of language models, built plainly and checked against one device."""

from minipar.start import start_mpi_first

start_mpi_first()  # under an MPI launcher, before anything that can fail on one rank (see start.py)


from minipar.autograd import Tensor, backward, no_grad
from minipar.dtypes import get_default_dtype, set_default_dtype
from minipar.random import manual_seed

__all__ = ["Tensor", "backward", "no_grad", "get_default_dtype", "manual_seed", "set_default_dtype"]
__version__ = "0.1.0"
