"""Model configuration, presets and ``--set key=value`` overrides.

Configs are plain dataclasses, serialisable to JSON and validated on construction: a bad
value raises :class:`ConfigError` (a ``ValueError``) that names the field and the allowed
values. The attention variant's own options live in ``attn_options`` and are validated by
that variant's ``Options`` dataclass (see :mod:`gbattn.attention.registry`).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from gbattn.errors import ConfigError


NORMS = ("pre", "post")
POSITIONS = ("learned", "rope")
RESIDUALS = ("plain", "attnres-full", "attnres-block")


def check_choice(field_name: str, value: Any, allowed: tuple | list) -> None:
    if value not in allowed:
        raise ConfigError(f"{field_name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def check_positive(field_name: str, value: Any, minimum: int | float = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{field_name}={value!r} must be a number >= {minimum}")


class SerialisableConfig:
    """JSON round trip for the config dataclasses; unknown fields are a :class:`ConfigError`."""

    kind = "config"  # how error messages name this config

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.kind} field(s) {unknown}; allowed: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **changes: Any):
        return type(self).from_dict({**self.to_dict(), **changes})


@dataclass
class ModelConfig(SerialisableConfig):
    """The GPT language model (SPEC.md section 1, "Paper configuration")."""

    kind = "model config"

    vocab_size: int = 16384
    block_size: int = 256  # size of the position table = longest sequence the model accepts
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_mult: int = 4  # FFN is d -> ffn_mult*d -> d
    dropout: float = 0.1  # embedding, attention probabilities, sublayer outputs, FFN
    norm: str = "pre"  # "pre" (Pre-LN, paper) or "post" (Post-LN)
    pos: str = "learned"  # "learned" absolute positions (paper) or "rope"
    rope_base: float = 10000.0
    bias: bool = True
    tie_embeddings: bool = True
    attn: str = "standard"  # a name from gbattn.attention.registry
    attn_options: dict = field(default_factory=dict)  # the variant's own options
    residual: str = "plain"  # "plain", "attnres-full" or "attnres-block" (SPEC.md section 3)
    attnres_block: int = 2  # block size S in sublayers for "attnres-block"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "d_model", "n_layers", "n_heads", "ffn_mult", "attnres_block"):
            check_positive(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose d_model as a multiple of {self.n_heads}"
            )
        if not (0.0 <= self.dropout < 1.0):
            raise ConfigError(f"dropout={self.dropout!r} must be in [0, 1)")
        check_choice("norm", self.norm, NORMS)
        check_choice("pos", self.pos, POSITIONS)
        check_choice("residual", self.residual, RESIDUALS)
        if self.pos == "rope" and (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"pos='rope' needs an even head width; d_model/n_heads = {self.d_model // self.n_heads}")
        if self.residual != "plain" and self.norm != "pre":
            raise ConfigError(f"residual={self.residual!r} is defined for norm='pre' only (SPEC.md section 3)")
        if not isinstance(self.attn_options, dict):
            raise ConfigError("attn_options must be a mapping of the variant's options")
        # Validates the variant name and its options; imported here to avoid an import cycle.
        from gbattn.attention.registry import variant_options

        variant_options(self.attn, self.attn_options, n_heads=self.n_heads)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads



# --------------------------------------------------------------------------------------
# Presets. `paper-small` is the exact configuration of SPEC.md; `cpu-proxy` was chosen by
# profiling on 2 CPU cores (see README, "Choosing cpu-proxy").
# --------------------------------------------------------------------------------------

PRESETS: dict[str, dict] = {
    "paper-small": dict(vocab_size=16384, block_size=256, d_model=256, n_layers=4, n_heads=4, dropout=0.1),
    "paper-medium": dict(vocab_size=16384, block_size=256, d_model=384, n_layers=6, n_heads=6, dropout=0.1),
    "owt-125m": dict(vocab_size=50257, block_size=1024, d_model=768, n_layers=12, n_heads=12, dropout=0.0),
    "owt-350m": dict(vocab_size=50257, block_size=1024, d_model=1024, n_layers=24, n_heads=16, dropout=0.0),
    # Profiled on 2 CPU cores (README, "Choosing cpu-proxy"): ~10k train tokens/s for standard.
    "cpu-proxy": dict(vocab_size=4096, block_size=128, d_model=128, n_layers=4, n_heads=4, dropout=0.0),
    # nanoGPT's CPU configuration for character-level tiny-shakespeare (vocab set from the data).
    "cpu-char": dict(vocab_size=65, block_size=64, d_model=128, n_layers=4, n_heads=4, dropout=0.0),
}


def preset_config(name: str, attn: str = "standard", overrides: dict | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from a preset name, an attention variant and overrides."""
    check_choice("preset", name, tuple(PRESETS))
    d = dict(PRESETS[name])
    d["attn"] = attn
    for key, value in (overrides or {}).items():
        set_path(d, key, value)
    return ModelConfig.from_dict(d)


# --------------------------------------------------------------------------------------
# `--set key=value` overrides: `d_model=288`, `attn.rounds=3`, `attn.gate=mlp`.
# --------------------------------------------------------------------------------------

_ALIASES = {"attn.": "attn_options."}


def parse_value(text: str) -> Any:
    """JSON where it parses (numbers, true/false, null, lists), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def command_line() -> str:
    """The command that is running, as a user would type it (recorded in results files)."""
    argv = _INVOCATION or sys.argv[1:]
    return "gbattn " + " ".join(shlex.quote(a) for a in argv)


_INVOCATION: list[str] = []


def set_invocation(argv: list[str]) -> None:
    """Called by the CLI so that ``command_line`` reports its arguments (also under pytest)."""
    _INVOCATION[:] = list(argv)


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. attn.rounds=3 or d_model=288")
        key, value = item.split("=", 1)
        out[key.strip()] = parse_value(value.strip())
    return out


def set_path(d: dict, key: str, value: Any) -> None:
    """Set ``d[a][b] = value`` for ``key = "a.b"`` (``attn.x`` is short for ``attn_options.x``)."""
    for short, full in _ALIASES.items():
        if key.startswith(short):
            key = full + key[len(short):]
    parts = key.split(".")
    target = d
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = dict(target.get(part) or {})
        target = target[part]
    target[parts[-1]] = value
