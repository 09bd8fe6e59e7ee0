"""gbattn: gradient-boosted attention (arXiv 2604.03190) and the baselines it is compared with.

The names below load on first use, so ``import gbattn`` (and ``gbattn --help``) stays fast and
never imports ``transformers`` (that is ``gbattn.hf``)."""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

_EXPORTS = {
    "VARIANTS": "gbattn.attention.registry",
    "AttnArgs": "gbattn.attention.core",
    "Record": "gbattn.attention.core",
    "Round": "gbattn.attention.core",
    "build_attention": "gbattn.attention.registry",
    "PRESETS": "gbattn.config",
    "ModelConfig": "gbattn.config",
    "TrainConfig": "gbattn.config",
    "preset_config": "gbattn.config",
    "build_configs": "gbattn.config",
    "train_run": "gbattn.train.trainer:train",  # (`gbattn.train` is the subpackage)
    "GPT": "gbattn.model.gpt",
    "generate": "gbattn.model.decoding",
    "count_params": "gbattn.model.params",
    "flops_per_token": "gbattn.model.params",
    "param_matched_width": "gbattn.model.params",
    "load_run": "gbattn.rundir",
    "LoadedRun": "gbattn.rundir",
    "UserError": "gbattn.errors",
    "ConfigError": "gbattn.errors",
    "DataError": "gbattn.errors",
    "CheckpointError": "gbattn.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module, _, attr = _EXPORTS[name].partition(":")
        return getattr(importlib.import_module(module), attr or name)
    raise AttributeError(f"module 'gbattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
