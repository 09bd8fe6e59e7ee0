"""Attention variants: each an ``nn.Module`` with one calling convention (``core.AttentionBase``)."""

from gbattn.attention.core import AttentionBase, AttnArgs, Record, Round
from gbattn.attention.registry import (
           VARIANTS,
           build_attention,
           describe_variants,
           variant_options,
)

__all__ = ["AttentionBase", "AttnArgs", "Record", "Round", "VARIANTS", "build_attention", "describe_variants",
           "variant_options"]
