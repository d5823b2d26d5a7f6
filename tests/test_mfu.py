"""MFU: the model's FLOPs per token from its shape, and the machine's measured matrix-product peak."""

from minipar.comm.mpi import world
from minipar.mfu import flops_per_token, measured_peak
from minipar.models import GPT, GPTConfig


def test_flops_per_token_are_six_per_weight_of_every_matrix_product_plus_attention():
    config = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=64)
    model = GPT(config)
    # every weight a token meets in a matrix product: the blocks' matrices and the tied head
    weights = sum(p.size for n, p in model.named_parameters() if n.endswith(".weight") and p.ndim == 2
                  and "wpe" not in n)
    attention = 2 * 2 * config.block_size * config.n_embd * config.n_layer  # q k^T and P v, forward
    assert flops_per_token(3, 32, 16, 64) == 6 * weights + 3 * attention


def test_the_peak_is_a_rate_of_matrix_products():
    peak = measured_peak(world(), "float64", n=64, repeats=2)
    assert 1e6 < peak < 1e15  # FLOP/s: above a slow interpreter, below any one machine
