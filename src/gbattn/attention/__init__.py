"""Attention variants: each an ``nn.Module`` with one calling convention (see ``core.AttentionBase``)."""

from gbattn.attention.core import AttentionBase, AttnArgs, Intermediates
from gbattn.attention.registry import VARIANTS, build_attention, describe_variants, variant_options

__all__ = ["AttentionBase", "AttnArgs", "Intermediates", "VARIANTS", "build_attention", "describe_variants", "variant_options"]
