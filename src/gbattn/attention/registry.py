"""Attention variants by name. A new variant touches 4 source files: its own file, one line in ``VARIANTS``,
its reference function in ``reference.py`` and its cases in ``tests/conftest.py``; then three things describe it:
its record's kinds in ``tests/test_attention.py`` (``EXPECTED_KINDS``), its row in the README's variants table, and
its golden losses, pinned by ``python tests/test_golden.py --add``. A parameter the variant holds itself is
initialised in its own ``init_own_parameters`` (declared on ``AttentionBase``). The tests fail when any of these is
missing (README, "Design notes and deviations")."""

from __future__ import annotations

import dataclasses
import sys
import typing

from gbattn.attention.boosted import BoostedAttention
from gbattn.attention.core import AttentionBase, AttnArgs
from gbattn.attention.differential import DifferentialAttention
from gbattn.attention.gated import GatedAttention
from gbattn.attention.standard import StandardAttention
from gbattn.attention.twicing import TwicingAttention
from gbattn.checks import check_choice, coerce, did_you_mean
from gbattn.errors import ConfigError

VARIANTS: dict[str, type[AttentionBase]] = {
    "standard": StandardAttention,
    "boosted": BoostedAttention,
    "twicing": TwicingAttention,
    "gated": GatedAttention,
    "differential": DifferentialAttention,
}


def variants_with_option(key: str) -> list[str]:
    """The variants that have the option ``key`` (``rounds``: boosted; ``layers``: boosted and twicing)."""
    return [name for name, cls in VARIANTS.items() if key in {f.name for f in dataclasses.fields(cls.Options)}]


def check_variant_name(name) -> None:
    """``name`` must name a variant; ``boosted:rounds=3`` (the spec ``bench --attn`` and ``compare --model`` take)
    is told where the options go."""
    if isinstance(name, str) and name.partition(":")[0] in VARIANTS and ":" in name:
        option = name.partition(":")[2].split(",")[0]
        raise ConfigError(f"attn={name!r}: give the variant alone and its options apart, e.g. --attn "
                          f"{name.partition(':')[0]} --set attn.{option or 'KEY=VALUE'}")
    check_choice("attn", name, tuple(VARIANTS))


def variant_options(name: str, options: dict | None = None, n_heads: int | None = None, n_kv_heads: int | None = None,
                    n_layers: int | None = None):
    """Check a variant name, its options, head counts and layer indices; return the variant's Options record
    (README, "Attention variants")."""
    check_variant_name(name)
    cls = VARIANTS[name]
    if options is not None and not isinstance(options, dict):  # (a BoostedOptions record: "object is not iterable")
        raise ConfigError(f"options of type {type(options).__name__}: give the variant's options as a dict, e.g. "
                          f"{{'rounds': 2}} (or None)")
    options = dict(options or {})
    allowed = [f.name for f in dataclasses.fields(cls.Options)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        # --set attn.rounds=3 without --attn boosted (train --help's own example): say whose option it is
        owners = {key: variants_with_option(key) for key in unknown}
        whose = "; ".join(f"{key} is an option of {' and '.join(names)}" for key, names in owners.items() if names)
        raise ConfigError(
            f"attention {name!r} has no option(s) {unknown}{did_you_mean(unknown, allowed)}"
            f"{f' ({whose})' if whose else ''}; its options are: {', '.join(allowed) or 'none'}"
        )
    if n_heads is not None and (msg := cls.check_heads(n_heads, n_kv_heads or n_heads)):
        raise ConfigError(msg)
    record = cls.Options(**options)
    layers = getattr(record, "layers", None)
    if n_layers is not None and layers is not None:
        outside = [i for i in layers if not -n_layers <= i < n_layers]
        if outside:
            raise ConfigError(f"attn.layers={layers}: {outside} outside the model's {n_layers} layers (indices "
                              f"{-n_layers}..{n_layers - 1}, negative ones from the end)")
        repeated = sorted({i % n_layers for i in layers if sum(j % n_layers == i % n_layers for j in layers) > 1})
        if repeated:  # [1, 1] or [1, -3] of 4: a typo for another layer, most likely
            raise ConfigError(f"attn.layers={layers} names layer(s) {repeated} more than once (negative indices count "
                              f"from the end of the model's {n_layers} layers); name each layer once")
    return record


def check_args(args: AttnArgs) -> AttnArgs:
    """The head layout a module used on its own needs (``ModelConfig`` checks the same for a model);
    returns ``args`` with its fields coerced as ``ModelConfig``'s are (a numpy integer as an int)."""
    if not isinstance(args, AttnArgs):
        raise ConfigError(f"args of type {type(args).__name__}: give an AttnArgs(d_model=..., n_heads=...)")
    kinds = typing.get_type_hints(AttnArgs)  # its declared field types, each field coerced as ModelConfig's are:
    # a ConfigError for a string, a non-finite number, a non-bool bias
    args = dataclasses.replace(args, **{name: coerce(name, getattr(args, name), kind) for name, kind in kinds.items()})
    for name, least in (("d_model", 1), ("n_heads", 1), ("n_kv_heads", 1), ("n_layers", 1), ("layer_idx", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"{name}={value!r} must be an integer >= {least}")
    if not 0 <= args.dropout < 1:
        raise ConfigError(f"dropout={args.dropout!r} must be in [0, 1)")
    if args.rope_base is not None and not args.rope_base > 0:
        raise ConfigError(f"rope_base={args.rope_base!r} must be > 0")
    check_head_layout(args.d_model, args.n_heads, args.n_kv_heads, "rope_base" if args.rope_base is not None else None)
    return args


def check_head_layout(d_model: int, n_heads: int, n_kv_heads: int | None, rope: str | None) -> None:
    """Heads that split ``d_model`` evenly, K/V heads (None: one per head) that divide them, and an
    even head width under RoPE (``rope`` names the setting that asks for it). ``ModelConfig`` and a
    module built on its own check the same."""
    if d_model % n_heads:
        raise ConfigError(f"d_model={d_model} is not divisible by n_heads={n_heads}; "
                          f"choose d_model as a multiple of {n_heads}")
    if n_heads % (n_kv_heads or n_heads):
        raise ConfigError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    if rope is not None and (d_model // n_heads) % 2:
        raise ConfigError(f"{rope} needs an even head width; d_model/n_heads = {d_model // n_heads}")


def build_attention(name: str, args: AttnArgs, options: dict | None = None) -> AttentionBase:
    """Variant ``name`` (a key of :data:`VARIANTS`) for one layer, an ``nn.Module`` called as
    :meth:`AttentionBase.forward` describes: ``attn(x_BTD, causal=..., key_padding_mask=..., positions=...)``.
    ``options``: the variant's own (``describe_variants()`` lists them with their defaults); a bad name,
    option or head layout is a :class:`ConfigError` naming it. README, "Using gbattn from Python" and
    "Attention variants"; the equations in docs/method.md (``boosted``) and docs/baselines.md (the others)."""
    check_variant_name(name)  # (before the head layout: a misspelt variant is the error to report first)
    args = check_args(args)
    record = variant_options(name, options, args.n_heads, args.kv_heads, args.n_layers)
    if getattr(record, "layers", None) is not None and args.layer_idx >= args.n_layers:
        # attn.layers counts from the end of n_layers; a layer past it would be none of them, silently
        raise ConfigError(f"layer_idx={args.layer_idx} outside n_layers={args.n_layers} (layers "
                          f"0..{args.n_layers - 1}), which attn.layers={record.layers} counts in")
    return VARIANTS[name](args, record)


def describe_variants() -> list[dict]:
    """Name, one-line description, options (with defaults) and the values of each option that takes a choice of
    words (``choices``) of every variant (what ``gbattn list`` shows; README, "Attention variants")."""
    rows = []
    for name, cls in VARIANTS.items():
        doc = ((sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines() or [""])[0]
        doc = doc.rstrip(":.") + "." if doc else ("(no description: python -OO strips docstrings)" if
                                                  sys.flags.optimize >= 2 else "(no description: its file has no "
                                                                                 "docstring)")
        fields = dataclasses.fields(cls.Options)
        opts = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory()) for f in fields}
        choices = {f.name: list(f.metadata["choices"]) for f in fields if "choices" in f.metadata}
        rows.append({"name": name, "description": doc, "options": opts, "choices": choices})
    return rows
