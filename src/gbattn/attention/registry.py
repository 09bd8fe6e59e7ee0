"""Attention variants by name. A new variant is one file plus one line in ``VARIANTS``."""

from __future__ import annotations

import dataclasses

from gbattn.attention.boosted import BoostedAttention
from gbattn.attention.core import AttentionBase, AttnArgs
from gbattn.attention.differential import DifferentialAttention
from gbattn.attention.gated import GatedAttention
from gbattn.attention.standard import StandardAttention
from gbattn.attention.twicing import TwicingAttention
from gbattn.config import ConfigError, check_choice

VARIANTS: dict[str, type[AttentionBase]] = {
    "standard": StandardAttention,
    "boosted": BoostedAttention,
    "twicing": TwicingAttention,
    "gated": GatedAttention,
    "differential": DifferentialAttention,
}


def variant_options(name: str, options: dict | None = None, n_heads: int | None = None):
    """Validate a variant name and its options; return the variant's Options instance."""
    check_choice("attn", name, tuple(VARIANTS))
    cls = VARIANTS[name]
    options = dict(options or {})
    allowed = [f.name for f in dataclasses.fields(cls.Options)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        hint = ", ".join(allowed) if allowed else "none"
        raise ConfigError(f"attention {name!r} has no option(s) {unknown}; its options are: {hint}")
    check_heads = getattr(cls, "check_heads", None)
    if check_heads is not None and n_heads is not None and (msg := check_heads(n_heads)):
        raise ConfigError(msg)
    return cls.Options(**options)


def build_attention(name: str, args: AttnArgs, options: dict | None = None) -> AttentionBase:
    """Instantiate variant ``name`` for one layer."""
    return VARIANTS[name](args, variant_options(name, options, args.n_heads))


def describe_variants() -> list[dict]:
    """Name, one-line description and options (with defaults) of every variant."""
    rows = []
    for name, cls in VARIANTS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        mod_doc = (__import__(cls.__module__, fromlist=["_"]).__doc__ or "").strip().splitlines()[0]
        opts = {f.name: (f.default if f.default is not dataclasses.MISSING else None) for f in dataclasses.fields(cls.Options)}
        rows.append({"name": name, "description": mod_doc or doc, "options": opts})
    return rows
