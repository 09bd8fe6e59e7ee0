"""Training configuration and the recipes that are each preset's defaults.

``paper-small`` and ``paper-medium`` default to the paper's recipe (SPEC.md section 1):
AdamW lr 3e-4, weight decay 0.01, 1,500 warmup steps then cosine to 0, batch 32 rows of 256
tokens, 15 epochs over the first 10M training tokens, clipping 1.0, valid/test capped at 1M.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gbattn.config import ModelConfig, SerialisableConfig, check_choice, check_positive, preset_config, set_path
from gbattn.errors import ConfigError

SAMPLINGS = ("rows", "random")
SCHEDULES = ("cosine", "constant")


@dataclass
class TrainConfig(SerialisableConfig):
    """Training recipe; the defaults are the paper's (SPEC.md section 1)."""

    kind = "training"

    data: str = ""
    tokenizer: str = "bpe"  # bpe (paper) | gpt2 | gpt2=PATH | char
    split: list = field(default_factory=lambda: [0.9, 0.05, 0.05])  # single-file rule train/valid/test
    train_tokens: int | None = 10_000_000  # first N training tokens (paper: 10M); null = all
    eval_tokens: int | None = 1_000_000  # valid/test caps (paper: 1M); null = all
    seq_len: int | None = None  # input tokens per row; default block_size - 1 (the paper's 255 of 256)
    sampling: str = "rows"  # rows: shuffled non-overlapping rows per epoch | random: nanoGPT windows
    batch_size: int = 32  # global rows per optimizer step (across processes and accumulation)
    grad_accum: int = 1
    epochs: float = 15.0
    max_steps: int | None = None  # overrides epochs
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int = 1500
    schedule: str = "cosine"
    weight_decay: float = 0.01
    decay_matrices_only: bool = False  # nanoGPT: decay only weights with >= 2 dims
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    eval_every: int = 0  # also evaluate every N steps (0: once per epoch only; random sampling needs N)
    eval_batch_size: int = 32
    seed: int = 42
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    amp: str = "auto"  # auto (bf16 on CUDA, off on CPU) | bf16 | off
    compile: bool = False
    checkpoint_minutes: float = 5.0  # also checkpoint at every evaluation and on SIGINT/SIGTERM
    log_every: int = 10
    threads: int | None = None  # CPU threads (default: torch's choice)

    def __post_init__(self) -> None:
        check_choice("sampling", self.sampling, SAMPLINGS)
        check_choice("schedule", self.schedule, SCHEDULES)
        for name in ("batch_size", "grad_accum", "eval_batch_size", "log_every"):
            check_positive(name, getattr(self, name))
        check_positive("epochs", self.epochs, 0)
        if self.max_steps is not None:
            check_positive("max_steps", self.max_steps)
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        if self.sampling == "random" and self.max_steps is None:
            raise ConfigError("sampling='random' has no epochs: set max_steps")
        if self.lr <= 0 or self.min_lr < 0 or self.warmup_steps < 0:
            raise ConfigError("lr must be > 0, min_lr >= 0 and warmup_steps >= 0")
        if not (isinstance(self.split, (list, tuple)) and len(self.split) == 3):
            raise ConfigError(f"split={self.split!r} must be three fractions train,valid,test")



PAPER_RECIPE: dict[str, Any] = dict(
    tokenizer="bpe", train_tokens=10_000_000, eval_tokens=1_000_000, batch_size=32, epochs=15.0, lr=3e-4,
    min_lr=0.0, warmup_steps=1500, weight_decay=0.01, grad_clip=1.0,
)

TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "paper-small": dict(PAPER_RECIPE),
    "paper-medium": dict(PAPER_RECIPE),
    # GPT-2-style recipe on OpenWebText for the larger presets (not from the paper).
    "owt-125m": dict(tokenizer="gpt2", train_tokens=None, eval_tokens=1_000_000, batch_size=32, epochs=1.0,
                     lr=6e-4, min_lr=6e-5, warmup_steps=2000, weight_decay=0.1, decay_matrices_only=True,
                     beta2=0.95, grad_clip=1.0),
    "owt-350m": dict(tokenizer="gpt2", train_tokens=None, eval_tokens=1_000_000, batch_size=32, epochs=1.0,
                     lr=3e-4, min_lr=3e-5, warmup_steps=2000, weight_decay=0.1, decay_matrices_only=True,
                     beta2=0.95, grad_clip=1.0),
    # The paper's recipe scaled to 2 CPU cores: all of WikiText-2, a short warmup, a higher lr
    # for a small model; the length of a run is set by the compare recipe (max_steps).
    "cpu-proxy": dict(tokenizer="bpe", train_tokens=None, eval_tokens=None, batch_size=32, epochs=2.0, lr=1e-3,
                      min_lr=0.0, warmup_steps=100, weight_decay=0.01, grad_clip=1.0),
    # nanoGPT's CPU run of shakespeare_char: batch 12, 2,000 steps, lr 1e-3 cosine to 1e-4, 100
    # warmup, betas (0.9, 0.99), weight decay 0.1 on matrices, random windows, 90/10 split.
    "cpu-char": dict(tokenizer="char", split=[0.9, 0.1, 0.0], train_tokens=None, eval_tokens=None, seq_len=64,
                     sampling="random", batch_size=12, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                     weight_decay=0.1, decay_matrices_only=True, beta2=0.99, grad_clip=1.0, eval_every=250),
}


def split_overrides(sets: dict[str, Any]) -> tuple[dict, dict]:
    """Route ``--set`` keys to the training config or the model config."""
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train, model = {}, {}
    for key, value in sets.items():
        head = key.split(".", 1)[0]
        if key in train_fields:
            train[key] = value
        elif head in model_fields or head == "attn":
            model[key] = value
        else:
            raise ConfigError(
                f"--set {key}: unknown field; model fields: {', '.join(sorted(model_fields))}; "
                f"training fields: {', '.join(sorted(train_fields))}"
            )
    return train, model


def build_configs(preset: str, attn: str, data: str, sets: dict[str, Any], **train_kwargs) -> tuple[ModelConfig, TrainConfig]:
    """Model and training configs for a preset: preset defaults, then ``--set`` overrides."""
    train_sets, model_sets = split_overrides(sets)
    train_d = dict(TRAIN_DEFAULTS.get(preset, PAPER_RECIPE))
    train_d.update({k: v for k, v in train_kwargs.items() if v is not None})
    train_d["data"] = data
    for k, v in train_sets.items():
        set_path(train_d, k, v)
    return preset_config(preset, attn, model_sets), TrainConfig.from_dict(train_d)
