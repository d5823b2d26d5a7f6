from minipar.models.config import GPTConfig
from minipar.models.gpt import GPT

__all__ = ["GPT", "GPTConfig"]
