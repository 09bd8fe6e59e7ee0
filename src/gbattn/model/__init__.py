"""The GPT language model, its residual streams, generation and its size accounting."""

from gbattn.model.decoding import generate
from gbattn.model.gpt import GPT, Block, lm_loss
from gbattn.model.params import count_params, flops_per_token, param_matched_width

__all__ = ["GPT", "Block", "generate", "lm_loss", "count_params", "flops_per_token", "param_matched_width"]
