"""Model and training configurations, presets, and ``--set key=value`` overrides.

Both configs are typed records (:class:`gbattn.checks.Typed`): a value of the wrong type or out of
range is refused where it enters, with a message naming the field. A preset is one record holding
a model and its training recipe (docs/paper.md for the paper's). The attention variant's own
options live in ``attn_options`` and are checked by that variant's ``Options`` record.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from gbattn.arguments import MAX_THREADS
from gbattn.attention.registry import check_head_layout, variant_options, variants_with_option
from gbattn.checks import (
    MAX_INT,
    Typed,
    at_least,
    between,
    check_choice,
    coerce,
    did_you_mean,
    each_one_of,
    fraction,
    greater_than,
    one_of,
    parse_value,
    positive_float32,
)
from gbattn.errors import ConfigError

MAX_VOCAB_SIZE = 2**24  # the largest vocabulary a model (and so a tokenizer) may have

# Where dropout can be applied (docs/paper.md, "The authors' training loop"). The default is the
# authors' set: no dropout on the attention sublayer's output.
DROPOUT_SITES = ("embedding", "attention", "attn-output", "ffn-hidden", "ffn-output")
AUTHORS_DROPOUT_SITES = ["embedding", "attention", "ffn-hidden", "ffn-output"]
# The model fields that change no parameter: a run started from another run's weights may set them.
DROPOUT_FIELDS = ("dropout", "dropout_sites")
MAX_D_MODEL = 2**20  # the widest model a config takes


@dataclass
class ModelConfig(Typed):
    """The language model: a GPT-2-style block by default (the paper's), Llama-style with
    ``norm_type=rmsnorm, ffn=swiglu, bias=false, pos=rope, n_kv_heads=...`` (docs/baselines.md, "The
    Llama-style block")."""

    kind = "model config"

    # Sizes are bounded far above any model that fits a machine (beyond them tensor sizes overflow).

    vocab_size: int = field(default=16384, metadata=between(1, MAX_VOCAB_SIZE))
    block_size: int = field(default=256, metadata=between(1, 2**24))  # longest sequence (learned position table)
    d_model: int = field(default=256, metadata=between(1, MAX_D_MODEL))
    n_layers: int = field(default=4, metadata=between(1, 4096))
    n_heads: int = field(default=4, metadata=between(1, 4096))
    n_kv_heads: int | None = field(default=None, metadata=at_least(1))  # grouped-query attention; None = n_heads
    ffn: str = field(default="gelu", metadata=one_of("gelu", "gelu-tanh", "swiglu"))
    ffn_mult: int = field(default=4, metadata=between(1, 1024))  # hidden width ffn_mult * d_model (GELU)
    ffn_hidden: int | None = field(default=None, metadata=between(1, 2**24))  # explicit hidden width
    dropout: float = field(default=0.1, metadata=fraction())
    dropout_sites: list[str] = field(default_factory=lambda: list(AUTHORS_DROPOUT_SITES),
                                     metadata=each_one_of(*DROPOUT_SITES))
    norm: str = field(default="pre", metadata=one_of("pre", "post"))  # Pre-LN (paper) or Post-LN
    # A norm before the LM head; None: with Pre-LN only (a Post-LN block already ends in one; docs/deviations.md 16)
    final_norm: bool | None = None
    norm_type: str = field(default="layernorm", metadata=one_of("layernorm", "rmsnorm"))
    norm_eps: float = field(default=1e-5, metadata=positive_float32())
    pos: str = field(default="learned", metadata=one_of("learned", "rope"))
    rope_base: float = field(default=10000.0, metadata=greater_than(0))  # (its tables are float64)
    bias: bool = True  # biases of every Linear and LayerNorm
    attn_bias: bool | None = None  # biases of the attention projections; None = bias (docs/deviations.md 14)
    tie_embeddings: bool = True
    attn: str = "standard"  # a name from gbattn.attention.registry
    attn_options: dict = field(default_factory=dict)  # the variant's own options
    residual: str = field(default="plain", metadata=one_of("plain", "attnres-full", "attnres-block"))
    attnres_block: int = field(default=2, metadata=at_least(1))  # block size S in sublayers

    def validate(self) -> None:
        check_head_layout(self.d_model, self.n_heads, self.n_kv_heads, "pos='rope'" if self.pos == "rope" else None)
        if self.residual != "plain" and self.norm != "pre":
            raise ConfigError(f"residual={self.residual!r} is defined for norm='pre' only (docs/baselines.md)")
        if self.ffn_hidden is not None and self.ffn_mult != ModelConfig.ffn_mult:  # (the width was ffn_hidden's)
            raise ConfigError(f"ffn_mult={self.ffn_mult} and ffn_hidden={self.ffn_hidden} both set the FFN's width, "
                              f"and ffn_hidden wins: give one of them")
        # a field one setting reads, given beside another (it was ignored)
        for name, owner, value in (("rope_base", "pos", "rope"), ("attnres_block", "residual", "attnres-block")):
            if getattr(self, owner) != value and getattr(self, name) != getattr(ModelConfig, name):
                raise ConfigError(f"{name}={getattr(self, name)} is used by {owner}={value!r} only; this model has "
                                  f"{owner}={getattr(self, owner)!r}: set {owner}={value} too, or leave {name} out")
        options = variant_options(self.attn, self.attn_options, n_heads=self.n_heads, n_kv_heads=self.kv_heads,
                                  n_layers=self.n_layers)
        self.attn_options = {k: v for k, v in dataclasses.asdict(options).items() if k in self.attn_options}

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_width(self) -> int:
        """FFN hidden width: explicit, else ffn_mult * d (GELU) or 2/3 of that rounded up to 16 (SwiGLU,
        which has three matrices instead of two)."""
        if self.ffn_hidden:
            return self.ffn_hidden
        width = self.ffn_mult * self.d_model
        if self.ffn != "swiglu":
            return width
        return -(-(2 * width // 3) // 16) * 16

    def resolved(self) -> ModelConfig:
        """This model with its defaults spelt out (every option of its variant, the final norm, the attention
        projections' biases, the key/value heads), its dropout sites in one order and its ``attn.layers`` as the
        layers they name: two configs that build the same model resolve equal, where a value given that equals its
        default made them differ (``attn.rounds=2`` against ``{}``), or the same sites or layers spelt otherwise."""
        options = dataclasses.asdict(variant_options(self.attn, self.attn_options, n_heads=self.n_heads,
                                                     n_kv_heads=self.kv_heads, n_layers=self.n_layers))
        if options.get("layers") is not None:  # layer indices as the layers they name: [-1] is [1] of 2 layers, and
            layers = sorted(i % self.n_layers for i in options["layers"])  # every layer is None (bench timed the
            options["layers"] = None if layers == list(range(self.n_layers)) else layers  # same model twice)
        return self.replace(attn_options=options, n_kv_heads=self.kv_heads,
                            final_norm=self.norm == "pre" if self.final_norm is None else self.final_norm,
                            attn_bias=self.bias if self.attn_bias is None else self.attn_bias,
                            dropout_sites=[site for site in DROPOUT_SITES if site in self.dropout_sites])

    def input_length(self, seq_len: int | None) -> int:
        """Input tokens per row: ``seq_len``, or ``block_size - 1`` when it is None (the default of
        ``TrainConfig.seq_len``, and of ``gbattn bench --seq-len``)."""
        if seq_len is None and self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size} leaves no input tokens per row (seq_len defaults to "
                              f"block_size - 1): use block_size >= 2, or --set seq_len=1")
        return seq_len or self.block_size - 1

    def dropout_at(self, site: str) -> float:
        """Dropout probability at ``site`` (0 where the site is off)."""
        return self.dropout if site in self.dropout_sites else 0.0


DEVICE_NAMES = ("auto", "cpu", "cuda")
TOKENIZER_KINDS = ("bpe", "gpt2", "char", "hf")
TOKENIZER_FILE_KINDS = ("gpt2", "hf")  # HF tokenizer JSON; also from a file with KIND=PATH
TOKENIZER_CHOICES = "bpe, char, gpt2, gpt2=PATH or hf=PATH"


def unknown_tokenizer(kind: str) -> str | None:
    """None for a tokenizer kind gbattn has (``bpe``, ``char``, ``gpt2``, ``KIND=PATH`` of a file kind; a bare
    ``hf``, which an upcycled Hugging Face model records), else the near-miss hint of the refusal ("" or " (did you
    mean 'char'?)"; none for "bpe=PATH")."""
    base = kind.split("=", 1)[0]
    if base in TOKENIZER_KINDS and ("=" not in kind or base in TOKENIZER_FILE_KINDS):
        return None
    return did_you_mean(base, TOKENIZER_KINDS) if base not in TOKENIZER_KINDS else ""


@dataclass
class TrainConfig(Typed):
    """A training recipe; the defaults are the paper's (docs/paper.md)."""

    kind = "training config"

    data: str = ""
    tokenizer: str = "bpe"  # bpe (paper) | gpt2 | gpt2=PATH | char | hf=PATH
    split: list[float] = field(default_factory=lambda: [0.9, 0.05, 0.05])  # single-file rule train/valid/test
    train_tokens: int | None = field(default=10_000_000, metadata=at_least(1))  # first N training tokens
    eval_tokens: int | None = field(default=1_000_000, metadata=at_least(1))  # valid/test caps
    seq_len: int | None = field(default=None, metadata=at_least(1))  # input tokens per row; None: block_size - 1
    sampling: str = field(default="rows", metadata=one_of("rows", "random"))
    batch_size: int = field(default=32, metadata=at_least(1))  # global rows per optimizer step
    grad_accum: int = field(default=1, metadata=at_least(1))
    epochs: float = field(default=15.0, metadata=greater_than(0))
    max_steps: int | None = field(default=None, metadata=at_least(1))  # overrides epochs
    lr: float = field(default=3e-4, metadata=greater_than(0))
    min_lr: float = field(default=0.0, metadata=at_least(0))
    warmup_steps: int = field(default=1500, metadata=at_least(0))
    fit_warmup: bool = True  # shorten a warmup longer than the run to a tenth of it (and say so)
    warmup_from_zero: bool = True  # lr = peak*step/W (the authors': first update at 0); false: (step+1)/W
    schedule: str = field(default="cosine", metadata=one_of("cosine", "constant"))
    weight_decay: float = field(default=0.01, metadata=at_least(0))
    decay_matrices_only: bool = False  # nanoGPT: decay only weights with >= 2 dims
    beta1: float = field(default=0.9, metadata=fraction())
    beta2: float = field(default=0.999, metadata=fraction())
    grad_clip: float = field(default=1.0, metadata=at_least(0))  # 0 = no clipping
    eval_every: int | None = field(default=None, metadata=at_least(1))  # every N steps and at the end (None: epochs)
    eval_batch_size: int = field(default=32, metadata=at_least(1))
    seed: int = field(default=42, metadata=between(0, MAX_INT))
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    amp: str = field(default="auto", metadata=one_of("auto", "bf16", "off"))
    compile: bool | None = None  # torch.compile the model; None = where it was measured faster (README)
    activation_checkpointing: bool = False  # recompute each block in the backward pass (less memory, more time)
    parallel: str = field(default="ddp", metadata=one_of("ddp", "fsdp2"))  # under torchrun
    checkpoint_minutes: float = field(default=5.0, metadata=greater_than(0))
    log_every: int = field(default=10, metadata=at_least(1))
    threads: int | None = field(default=None, metadata=between(1, MAX_THREADS))  # CPU threads (None: runtime.py)
    init_from: str | None = None  # start from this run directory's weights (fresh optimizer), e.g. upcycled

    # Fields that change how fast a run goes or where it runs, not what it computes.
    RESULT_NEUTRAL = ("device", "compile", "activation_checkpointing", "checkpoint_minutes", "log_every", "threads",
                      "eval_batch_size")

    def validate(self) -> None:
        if len(self.split) != 3 or abs(sum(self.split) - 1) > 1e-9 or min(self.split) < 0 or min(self.split[:2]) <= 0:
            raise ConfigError(f"split={self.split!r} must be three fractions train,valid,test summing to 1 "
                              f"with train and valid > 0")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        if self.sampling == "random" and self.max_steps is None:
            raise ConfigError("sampling='random' has no epochs: set max_steps, or sampling=rows to train for epochs")
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr={self.min_lr} is above lr={self.lr}")
        # (checked where a run's config.json is read too: a damaged one was refused only at resume, naming no file,
        # and eval, generate and --init-from took it; gbattn.runtime.resolve_device says the same of --device)
        if not re.fullmatch(r"auto|cpu(:\d+)?|cuda(:\d+)?", self.device):
            kind = self.device.partition(":")[0]
            hint = did_you_mean(kind, DEVICE_NAMES) if kind not in DEVICE_NAMES else ""
            raise ConfigError(f"device={self.device!r} is not allowed{hint}; choose auto, cpu, cuda, cuda:N")
        # (--tokenizer hf without a file is refused where the tokenizer is made)
        if (hint := unknown_tokenizer(self.tokenizer)) is not None:
            raise ConfigError(f"tokenizer={self.tokenizer!r} is not allowed{hint}; choose one of {TOKENIZER_CHOICES}")
        # AdamW's first step moves a weight by up to lr / (1 - beta1), a float32 scalar in its update (past float32's
        # largest, 3.4e38, a RuntimeError mid-run that every resume repeated)
        if self.lr / (1 - self.beta1) > 3.4e38:
            raise ConfigError(f"lr={self.lr:g} is too large: AdamW's first step of lr / (1 - beta1) = "
                              f"{self.lr / (1 - self.beta1):.3g} is past float32's largest number (3.4e38)")


# --------------------------------------------------------------------------------------
# Presets: one record each, a model and its training recipe.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: dict
    train: dict


PAPER_RECIPE: dict[str, Any] = dict(
    tokenizer="bpe", train_tokens=10_000_000, eval_tokens=1_000_000, batch_size=32, epochs=15.0, lr=3e-4,
    min_lr=0.0, warmup_steps=1500, warmup_from_zero=True, weight_decay=0.01, grad_clip=1.0,
)
# The paper's recipe scaled to 2 CPU cores (README, "Design notes and deviations": choosing cpu-proxy): all of
# WikiText-2, a short warmup, a higher lr; a compare recipe sets the length (max_steps).
CPU_PROXY_RECIPE: dict[str, Any] = dict(
    tokenizer="bpe", train_tokens=None, eval_tokens=None, batch_size=32, epochs=2.0, lr=1e-3, min_lr=0.0,
    warmup_steps=100, warmup_from_zero=False, weight_decay=0.01, grad_clip=1.0,
)
OWT_RECIPE: dict[str, Any] = dict(
    tokenizer="gpt2", train_tokens=None, eval_tokens=1_000_000, batch_size=32, epochs=1.0, lr=6e-4, min_lr=6e-5,
    warmup_steps=2000, warmup_from_zero=False, weight_decay=0.1, decay_matrices_only=True, beta2=0.95, grad_clip=1.0,
)
LLAMA_BLOCK = dict(norm_type="rmsnorm", ffn="swiglu", bias=False, pos="rope", rope_base=10000.0)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "paper-small",
            "the paper's model and recipe (docs/paper.md)",
            dict(vocab_size=16384, block_size=256, d_model=256, n_layers=4, n_heads=4, dropout=0.1),
            dict(PAPER_RECIPE),
        ),
        Preset(
            "paper-medium",
            "the authors' medium recipe (no published results) on a size of gbattn's choosing (none is published)",
            dict(vocab_size=16384, block_size=256, d_model=384, n_layers=6, n_heads=6, dropout=0.1),
            dict(PAPER_RECIPE, lr=2e-4, batch_size=24, epochs=10.0, warmup_steps=2000, train_tokens=30_000_000),
        ),
        Preset(
            "llama-small",
            "paper-small's size and recipe in a Llama-style block (RMSNorm, SwiGLU, RoPE, no biases, GQA)",
            dict(
                vocab_size=16384,
                block_size=256,
                d_model=256,
                n_layers=4,
                n_heads=4,
                n_kv_heads=2,
                dropout=0.1,
                **LLAMA_BLOCK,
            ),
            dict(PAPER_RECIPE),
        ),
        Preset(
            "owt-125m",
            "GPT-2 small size on OpenWebText (GPT-2 tokenizer; not from the paper)",
            dict(vocab_size=50257, block_size=1024, d_model=768, n_layers=12, n_heads=12, dropout=0.0),
            dict(OWT_RECIPE),
        ),
        Preset(
            "owt-350m",
            "GPT-2 medium size on OpenWebText (not from the paper)",
            dict(vocab_size=50257, block_size=1024, d_model=1024, n_layers=24, n_heads=16, dropout=0.0),
            dict(OWT_RECIPE, lr=3e-4, min_lr=3e-5),
        ),
        Preset(
            "cpu-proxy",
            "the paper's model scaled to 2 CPU cores (README, 'Design notes and deviations': choosing cpu-proxy)",
            dict(vocab_size=4096, block_size=128, d_model=128, n_layers=4, n_heads=4, dropout=0.0),
            dict(CPU_PROXY_RECIPE),
        ),
        Preset(
            "cpu-llama",
            "cpu-proxy's size in a Llama-style block",
            dict(
                vocab_size=4096,
                block_size=128,
                d_model=128,
                n_layers=4,
                n_heads=4,
                n_kv_heads=2,
                dropout=0.0,
                **LLAMA_BLOCK,
            ),
            dict(CPU_PROXY_RECIPE),
        ),
        # nanoGPT's CPU run of shakespeare_char: batch 12, 2,000 steps, lr 1e-3 cosine to 1e-4, 100 warmup,
        # betas (0.9, 0.99), weight decay 0.1 on matrices, random windows, 90/10 split (vocab set by the data).
        # With GPT-2's biases, which nanoGPT's default leaves out (docs/deviations.md, entry 7).
        Preset(
            "cpu-char",
            "nanoGPT's CPU configuration for character-level tiny-shakespeare",
            dict(vocab_size=65, block_size=64, d_model=128, n_layers=4, n_heads=4, dropout=0.0),
            dict(
                tokenizer="char",
                split=[0.9, 0.1, 0.0],
                train_tokens=None,
                eval_tokens=None,
                seq_len=64,
                sampling="random",
                batch_size=12,
                max_steps=2000,
                lr=1e-3,
                min_lr=1e-4,
                warmup_steps=100,
                warmup_from_zero=False,
                weight_decay=0.1,
                decay_matrices_only=True,
                beta2=0.99,
                grad_clip=1.0,
                eval_every=250,
            ),
        ),
    ]
}


def get_preset(name: str) -> Preset:
    check_choice("preset", name, tuple(PRESETS))
    return PRESETS[name]


def preset_config(name: str, attn: str = "standard", overrides: dict | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from a preset name, an attention variant and model overrides
    (``{"d_model": 288, "attn.rounds": 3}``: model fields, ``attn.KEY`` a variant option, as ``--set``;
    README, "Presets and parameter counts"; the paper's in docs/paper.md)."""
    d = dict(get_preset(name).model, attn=attn)
    training, model = split_overrides(overrides or {}, "overrides")  # an unknown key is named as `train --set` names it
    if training:  # `params --set lr=...` was "unknown model config field(s) ['lr']", as if lr were no field at all
        own = {"batch_size": "--batch", "seq_len": "--seq-len", "compile": "--compile", "amp": "--no-amp (amp=off)",
               "device": "--device", "threads": "--threads", "activation_checkpointing": "--activation-checkpointing"}
        bench = [f"{own[key]} for {key}" for key in training if key in own]
        raise ConfigError(f"--set {', '.join(training)}: training field(s); only model fields apply here (`gbattn "
                          f"train` and `compare` take training fields"
                          + (f"; `gbattn bench` has its own options: {', '.join(bench)}" if bench else "") + ")")
    check_agrees("attn", attn, model)
    for key, value in model.items():
        set_path(d, key, value)
    return ModelConfig.from_dict(d)


def check_agrees(name: str, value: Any, overrides: dict) -> None:
    """A field given as an argument (``attn``, ``data``) and in the overrides must have one value: the overrides'
    won, silently, as a flag and a ``--set`` of one field that disagree would (:func:`merge_options`)."""
    if name in overrides and overrides[name] != value:
        raise ConfigError(f"{name}={value!r} and the overrides' {name}={overrides[name]!r} disagree: give one of them")


def refuse_unused_epochs(epochs, max_steps: int, whose: str, sampling: str | None = None) -> None:
    """The ConfigError of an ``epochs`` given beside a ``max_steps`` (``whose``: "given too", "preset X's"), which
    sets the run's length: a bad value is named as such first (epochs=-1 was "not used", and the advice to drop
    max_steps then met "must be > 0"). ``sampling``: the run's; random windows have no epochs, and the advice says
    so (it sent the user to max_steps=null, which was refused as "sampling='random' has no epochs")."""
    field_ = next(f for f in dataclasses.fields(TrainConfig) if f.name == "epochs")
    field_.metadata["check"]("epochs", coerce("epochs", epochs, float))
    rows = " and sampling=rows (random windows have no epochs)" if sampling == "random" else ""
    raise ConfigError(f"epochs={epochs} is not used: max_steps={max_steps} ({whose}) sets the run's length; give "
                      f"max_steps=null{rows} to train for epochs, or leave epochs out")


def build_configs(
    preset: str, attn: str, data: str | os.PathLike, sets: dict[str, Any] | None = None, **train_kwargs
) -> tuple[ModelConfig, TrainConfig]:
    """Model and training configs: the preset's record, then keyword values, then ``--set`` overrides ``sets``
    (None: none; README, "Using gbattn from Python"). A warmup the user sets explicitly is kept as given
    (``fit_warmup`` off)."""
    train_sets, model_sets = split_overrides({} if sets is None else sets, "sets")

    def as_text(value):  # a pathlib.Path (data, init_from) as its string, wherever given ("must be a string" was told)
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    train_sets = {k: as_text(v) for k, v in train_sets.items()}
    train_kwargs = {k: as_text(v) for k, v in train_kwargs.items()}
    misplaced = sorted(set(train_kwargs) & set(ModelConfig.field_names()))  # (was "unknown training config field")
    if misplaced:
        raise ConfigError(f"{', '.join(misplaced)}: model field(s), which build_configs takes in sets "
                          f"({{{', '.join(f'{k!r}: ...' for k in misplaced)}}}), not as keywords (training fields)")
    train_d = dict(get_preset(preset).train)
    given = {k: v for k, v in train_kwargs.items() if v is not None}
    train_d.update(given)
    data = as_text(data)
    train_d["data"] = data
    check_agrees("data", data, train_sets)
    for key, value in train_sets.items():
        train_d[key] = value
    explicit = {**given, **train_sets}  # a warmup set as a keyword is as explicit as one in sets
    if "warmup_steps" in explicit and "fit_warmup" not in explicit:
        train_d["fit_warmup"] = False
    if explicit.get("min_lr") and train_d.get("schedule") == "constant":  # (ignored, silently; a preset's own is not
        # refused: `--preset cpu-char --set schedule=constant` keeps working)
        raise ConfigError(f"min_lr={explicit['min_lr']} is where the cosine schedule ends; schedule=constant holds lr "
                          f"after the warmup: leave min_lr out, or use schedule=cosine")
    if explicit.get("epochs") is not None and train_d.get("max_steps") is not None:  # (max_steps won, silently)
        refuse_unused_epochs(explicit["epochs"], train_d["max_steps"],
                             "given too" if explicit.get("max_steps") is not None else f"preset {preset}'s",
                             train_d.get("sampling", TrainConfig.sampling))
    return preset_config(preset, attn, model_sets), TrainConfig.from_dict(train_d)


def training_input_length(model_cfg: ModelConfig, train_cfg: TrainConfig) -> int:
    """Input tokens per training row (:meth:`ModelConfig.input_length` of ``train_cfg.seq_len``), refused where
    they exceed the model's ``block_size``: checked by a run before its data, and by a comparison before it is
    recorded."""
    seq_len = model_cfg.input_length(train_cfg.seq_len)
    if seq_len > model_cfg.block_size:
        raise ConfigError(f"seq_len={seq_len} exceeds block_size={model_cfg.block_size}")
    return seq_len


# --------------------------------------------------------------------------------------
# `--set key=value`: `d_model=288`, `attn.rounds=3`, `lr=1e-3`.
# --------------------------------------------------------------------------------------


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``--set key=value`` items as a dict. A field set twice to different values (``attn.x`` and
    ``attn_options.x`` name one field) is an error, as a flag and a ``--set`` that disagree are."""
    out: dict[str, Any] = {}
    first: dict[str, tuple[str, Any]] = {}  # field -> (the item that set it as typed, its value)
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. attn.rounds=3 or d_model=288")
        key, value = item.split("=", 1)
        if not value.strip():  # a script's unset variable (`--set init_from=$RUN`), refused as an empty option is
            raise ConfigError(f"--set {item!r}: the value is empty; give null for none, [] for an empty list")
        key = key.strip()
        value = parse_value(value.strip(), f"--set {key}")
        path = field_path(key)
        for other, (other_item, other_value) in first.items():  # one field, or a mapping and a field inside it
            if other == path:
                agree = other_value == value
            elif path.startswith(other + ".") or other.startswith(path + "."):  # attn_options={...} and attn.x
                pairs = sorted([(other, other_value), (path, value)], key=lambda pair: len(pair[0]))
                (whole, mapping), (inner, inner_value) = pairs
                # (a field inside a value that is no mapping: set_path says so, naming it)
                agree = not isinstance(mapping, dict) or _inside(mapping, inner[len(whole) + 1:]) == inner_value
            else:
                continue
            if not agree:
                raise ConfigError(f"--set {other_item} and --set {item} disagree: give one of them")
        first.setdefault(path, (item, value))
        out[key] = value
    return out


def _inside(mapping: dict, dotted: str) -> Any:
    """``mapping[a][b]`` for ``dotted = "a.b"``, or a value no field holds where one is missing."""
    for part in dotted.split("."):
        if not isinstance(mapping, dict) or part not in mapping:
            return _MISSING
        mapping = mapping[part]
    return mapping


_MISSING = object()


def parse_variant(spec: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,key=value`` -> (name, options); a list value keeps its commas
    (``twicing:layers=[-2,-1]``)."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", rest)):  # not at a comma inside [...]
        if "=" not in item:
            raise ConfigError(f"{spec!r}: options are key=value, e.g. boosted:rounds=3,kv_source=shared")
        key, value = item.split("=", 1)
        options[key] = parse_value(value, f"{name}:{key}")
    return name, options


def variant_spec(spec: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A variant as ``bench --attn`` and ``compare --model`` take it: (name, attention options, model fields), where
    an option that names a model field sets that field (``boosted:rounds=3,residual=attnres-block``: the option
    ``rounds`` and the field ``residual``) and any other is an attention option."""
    name, options = parse_variant(spec)
    if not name:
        raise ConfigError(f"{spec!r}: name the attention variant first, e.g. boosted:rounds=3")
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"attn", "attn_options"}
    return (name, {key: value for key, value in options.items() if key not in model_fields},
            {key: value for key, value in options.items() if key in model_fields})


def field_path(key: str) -> str:
    """The dotted field a ``--set`` key names: ``attn.x`` is short for ``attn_options.x``."""
    return "attn_options." + key[len("attn."):] if key.startswith("attn.") else key


def merge_options(sets: dict[str, Any], **options: Any) -> dict[str, Any]:
    """``sets`` (parsed ``--set`` values) with the command-line options that name the same fields
    (``--attn``, ``--residual``, ``--seed``, ``--tokenizer``, ...) added; None means not given. A field
    given both ways with different values is an error, not a silent choice of one."""
    out = dict(sets)
    for key, value in options.items():
        if value is None:
            continue
        if key in out and out[key] != value:
            option = key.replace("_", "-")  # (the option's spelling: init_from is --init-from)
            flag = (f"--{option}" if value else f"--no-{option}") if isinstance(value, bool) else f"--{option} {value}"
            given = str(out[key]).lower() if isinstance(out[key], bool) else out[key]  # as it was typed
            raise ConfigError(f"{flag} and --set {key}={given} disagree: give one of them")
        out[key] = value
    return out


def set_path(d: dict, key: str, value: Any) -> None:
    """``d[a][b] = value`` for ``key = "a.b"`` (``attn.x`` is short for ``attn_options.x``). Each inner dict on
    the way is a copy: one that came from the caller's overrides (``{"attn_options": opts}``) or a preset is
    left as it was; a field inside one that is no mapping (``d_model.x``) is a ConfigError."""
    parts = field_path(key).split(".")
    target = d
    for part in parts[:-1]:
        inner = target.get(part)
        if inner is not None and not isinstance(inner, dict):  # (d_model.x=3: "'int' object is not iterable")
            raise ConfigError(f"--set {key}: {part}={inner!r} has no fields to set (attn.KEY sets a variant option, "
                              f"e.g. attn.rounds=3)")
        target[part] = dict(inner or {})
        target = target[part]
    target[parts[-1]] = value


def split_overrides(sets: dict[str, Any], what: str = "sets") -> tuple[dict, dict]:
    """Route ``--set`` keys to the training config or the model config; ``what``: how an error names ``sets``, the
    caller's argument (a list was "'list' object has no attribute 'items'")."""
    if not isinstance(sets, dict):
        raise ConfigError(f"{what} of type {type(sets).__name__}: give a dict of field names and values, e.g. "
                          f"{{'d_model': 288, 'attn.rounds': 3}}")
    train_fields, model_fields = set(TrainConfig.field_names()), set(ModelConfig.field_names())
    train, model = {}, {}
    for key, value in sets.items():
        if not isinstance(key, str):  # ({1: 2} was "'int' object has no attribute 'split'")
            raise ConfigError(f"{what}: key {key!r} of type {type(key).__name__}: give field names as strings")
        head = key.split(".", 1)[0]
        if key in train_fields:
            train[key] = value
        elif head in model_fields or head == "attn":
            model[key] = value
        else:  # a variant's option without its prefix (`--set rounds=3`) is named as attn.KEY first
            prefixed = [f"attn.{key}"] if variants_with_option(key) else []
            hint = did_you_mean([*prefixed, key], [*prefixed, *sorted(train_fields | model_fields)])
            # a field named by its first words (`warmup` for warmup_steps): too short for the similarity cutoff
            longer = sorted(name for name in train_fields | model_fields if name.startswith(f"{key}_"))
            hint = hint or (f" (did you mean {' or '.join(map(repr, longer))}?)" if 0 < len(longer) <= 3 else "")
            # the listing below names model and training fields: `model.n_layers` or `training.lr` is a likely reading
            group, _, rest = key.partition(".")
            if group in ("model", "train", "training") and rest.split(".", 1)[0] in train_fields | model_fields:
                hint = f" (write {rest!r}: a field is set by its name alone, without {group + '.'!r}"
                # bench, params and upcycle take model fields only: `training.lr` told them to write `lr`, then refused
                hint += ("; a training field, which `gbattn train` and `compare` take)" if rest in train_fields
                         else ")")
            raise ConfigError(f"--set {key}: unknown field{hint}; model fields: {', '.join(sorted(model_fields))}; "
                              f"training fields: {', '.join(sorted(train_fields))}")
    return train, model
