"""gbattn: gradient-boosted attention (arXiv 2604.03190) and the baselines it is compared with."""

from gbattn.attention import VARIANTS, AttnArgs, Intermediates, build_attention
from gbattn.config import PRESETS, ModelConfig, preset_config
from gbattn.errors import CheckpointError, ConfigError, DataError, UserError
from gbattn.model import GPT, count_params, flops_per_token, param_matched_width

__version__ = "0.1.0"

__all__ = [
    "VARIANTS",
    "AttnArgs",
    "Intermediates",
    "build_attention",
    "PRESETS",
    "ModelConfig",
    "preset_config",
    "GPT",
    "count_params",
    "flops_per_token",
    "param_matched_width",
    "UserError",
    "ConfigError",
    "DataError",
    "CheckpointError",
]
