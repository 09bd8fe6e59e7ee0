"""The Hugging Face config of a gbattn model: gbattn's own config.json under one key, ``gbattn``.

``config.gbattn["model"]`` is the whole :class:`gbattn.config.ModelConfig` as a dict (the one
source of truth for the architecture); an exported run also keeps its training config, preset,
data record, ``seq_len`` and ``step`` there, so gbattn itself can load the directory
(``gbattn.rundir.load_run``). The standard names that other tools read are properties over that
dict, readable and writable:

=========================  ==========================
``hidden_size``            ``d_model``
``num_hidden_layers``      ``n_layers``
``num_attention_heads``    ``n_heads``
``num_key_value_heads``    ``n_kv_heads`` (None: ``n_heads``)
``max_position_embeddings``  ``block_size``
``vocab_size``             ``vocab_size``
``tie_word_embeddings``    ``tie_embeddings``
``rope_theta``             ``rope_base``
=========================  ==========================

The standard names are also keywords of ``GbattnConfig(...)``; gbattn's own field names are not
(``GbattnConfig(d_model=64)`` is refused: they go in ``gbattn={"model": {...}}``), nor attributes
(``config.dropout = 0.0`` is refused: ``config.gbattn["model"]["dropout"]``).

A classic ``__init__`` works with transformers 4.x and 5.x alike (5.x wraps config subclasses in
``@dataclass`` but keeps an explicit ``__init__``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import PretrainedConfig

from gbattn.config import ModelConfig
from gbattn.errors import CheckpointError, ConfigError
from gbattn.model.gpt import check_model_config
from gbattn.rundir import STANDARD_FIELDS, check_standard_names, recorded_model_config

MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
STANDARD_NAMES = ", ".join(STANDARD_FIELDS)


def _model_field(name: str, doc: str) -> property:
    def get(self):
        return self.gbattn["model"][name]

    def set_(self, value):
        self.gbattn["model"][name] = value

    return property(get, set_, doc=doc)


def stray_model_fields(mapping: dict) -> dict:
    """The entries of ``mapping`` named as gbattn's model fields that are not also standard names (``vocab_size``)."""
    return {name: mapping[name] for name in sorted(mapping)
            if name in MODEL_FIELDS and not isinstance(getattr(GbattnConfig, name, None), property)}


# Other models' config names (Llama's, GPT-2's, BERT's) for what a standard name or a gbattn model field holds: given
# to GbattnConfig, transformers kept them as attributes nothing reads, and the model was built without them.
OTHER_MODELS_NAMES = {
    "n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings", "intermediate_size": "ffn_hidden", "n_inner": "ffn_hidden",
    "hidden_act": "ffn", "activation_function": "ffn", "rms_norm_eps": "norm_eps", "layer_norm_eps": "norm_eps",
    "layer_norm_epsilon": "norm_eps", "attention_dropout": "dropout", "hidden_dropout": "dropout",
    "hidden_dropout_prob": "dropout", "attention_probs_dropout_prob": "dropout", "resid_pdrop": "dropout",
    "embd_pdrop": "dropout", "attn_pdrop": "dropout", "attention_bias": "bias", "mlp_bias": "bias",
    "head_dim": None, "rope_scaling": None,
}


def refuse_other_models_names(keywords: dict) -> None:
    """Another model's config name (``intermediate_size``, ``n_embd``, ...) is a ConfigError naming the standard name
    or gbattn model field that holds it (it was kept as an attribute nothing reads)."""
    given = sorted(name for name in keywords if name in OTHER_MODELS_NAMES)
    if not given:
        return
    name = given[0]
    ours = OTHER_MODELS_NAMES[name]
    where = (f"use {ours}=..." if ours in STANDARD_FIELDS else
             f"gbattn's model field for it is {ours}: GbattnConfig(gbattn={{'model': {{{ours!r}: ...}}}})" if ours
             else "gbattn has no such setting (the head width is d_model / n_heads; RoPE is not scaled)")
    raise ConfigError(f"GbattnConfig({name}={keywords[name]!r}) is another model's name, which gbattn does not read: "
                      f"{where}")


def refuse_model_fields(keywords: dict, assigned: bool = False) -> None:
    """gbattn's own model field names given as keywords (or, ``assigned``, set as attributes) are a ConfigError:
    they belong in the ``gbattn`` dict (otherwise they were plain attributes that nothing reads, or dropped)."""
    stray = stray_model_fields(keywords)
    if stray and assigned:
        name, value = next(iter(stray.items()))
        raise ConfigError(f"config.{name} = {value!r}: gbattn's model fields are in its model dict, "
                          f"config.gbattn['model'][{name!r}], read when a model is built from the config; the "
                          f"standard names ({STANDARD_NAMES}) are attributes")
    if stray:
        raise ConfigError(f"GbattnConfig({', '.join(f'{k}={v!r}' for k, v in stray.items())}): gbattn's model "
                          f"fields go in its model dict, GbattnConfig(gbattn={{'model': {stray!r}}}); the "
                          f"standard names ({STANDARD_NAMES}) are taken as keywords")


def check_transformers_fields(config: dict) -> None:
    """The fields of a saved config.json that transformers reads itself, checked first: a dtype that names no torch
    floating-point type, or token ids that are not integers, were tracebacks from inside transformers
    (``module 'torch' has no attribute 'word'``, ``'<' not supported between 'str' and 'int'``)."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        dtype = getattr(torch, value, None) if isinstance(value, str) else value  # (a torch.dtype, from Python)
        # (float8 types are floating point too, and a TypeError inside transformers: no storage holds them)
        if value is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ConfigError(f"config.json: {key}={value!r} names no torch dtype a model is saved in (float32, "
                              f"bfloat16, float16, float64): the file is damaged")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = config.get(key)
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        if value is not None and not all(type(i) is int and i >= 0 for i in ids):
            raise ConfigError(f"config.json: {key}={value!r} must be a token id (an integer >= 0) or null: the file "
                              f"is damaged")


class GbattnConfig(PretrainedConfig):
    """``GbattnConfig(gbattn={"model": {...}, ...})``, or :meth:`from_model_config`
    (README, "Hugging Face transformers")."""

    model_type = "gbattn"

    hidden_size = _model_field("d_model", "width of the residual stream (d_model)")
    num_hidden_layers = _model_field("n_layers", "number of blocks (n_layers)")
    num_attention_heads = _model_field("n_heads", "query heads (n_heads)")
    max_position_embeddings = _model_field("block_size", "longest sequence (block_size)")
    vocab_size = _model_field("vocab_size", "vocabulary size")
    tie_word_embeddings = _model_field("tie_embeddings", "output embedding tied to the input embedding")
    rope_theta = _model_field("rope_base", "RoPE base (rope_base; read when pos='rope')")

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads (grouped-query attention); n_heads when n_kv_heads is None."""
        model = self.gbattn["model"]
        return model.get("n_kv_heads") or model["n_heads"]

    @num_key_value_heads.setter
    def num_key_value_heads(self, value: int | None) -> None:
        self.gbattn["model"]["n_kv_heads"] = value

    def __init__(self, gbattn: dict | None = None, use_cache: bool = True, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None, **kwargs) -> None:
        refuse_model_fields(kwargs)
        refuse_other_models_names(kwargs)
        section = copy.deepcopy(gbattn) if gbattn is not None else {}
        if not isinstance(section, dict) or not isinstance(section.get("model", {}), dict):
            raise ConfigError("GbattnConfig(gbattn=...) takes gbattn's config.json content: a dict with a model dict")
        section["model"] = ModelConfig.from_dict(section.get("model", {})).to_dict()
        self.gbattn = section
        self.use_cache = use_cache
        # Passed THROUGH super().__init__: 4.x sets the token ids and tie_word_embeddings from its own
        # keyword arguments (overwriting what was set before); 5.x sets unknown keywords as attributes.
        # Standard names given as keywords (hidden_size=..., tie_word_embeddings=...) land in the
        # model dict through the properties above.
        kwargs.setdefault("tie_word_embeddings", section["model"]["tie_embeddings"])
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
        self.gbattn["model"] = ModelConfig.from_dict(self.gbattn["model"]).to_dict()

    def __setattr__(self, name: str, value) -> None:
        """gbattn's own field names are refused (``config.dropout = 0.0`` set a plain attribute that nothing
        read, and save_pretrained wrote it beside the gbattn dict, where from_pretrained refuses it)."""
        refuse_model_fields({name: value}, assigned=True)
        super().__setattr__(name, value)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' ``from_dict`` (``from_pretrained`` ends here): a saved config, so its gbattn model dict
        must be whole, as gbattn itself reads it (``rundir.recorded_model_config``: a missing field was a
        default, and 2-head weights ran as 4 heads); gbattn's own field names among the overrides are refused
        (transformers dropped them unused, silently)."""
        stored = stray_model_fields(config_dict) if isinstance(config_dict, dict) else {}
        if stored:  # a config saved after `config.dropout = ...`, which nothing read: the model is the gbattn dict's
            raise ConfigError(f"the config holds gbattn's model field names at its top level ({stored!r}), where "
                              f"nothing reads them: the model is built from config.gbattn['model']; delete them "
                              f"from config.json, or move them into its gbattn model dict")
        refuse_model_fields(kwargs)
        if isinstance(config_dict, dict):
            check_transformers_fields(config_dict)
        section = config_dict.get("gbattn") if isinstance(config_dict, dict) else None
        if not isinstance(section, dict) or not isinstance(section.get("model"), dict):
            raise ConfigError("the config has no gbattn model dict (config.json's gbattn: {model: {...}}, which "
                              "`gbattn export` and save_pretrained write): not a saved gbattn model (a gbattn run "
                              "directory loads after `gbattn export RUN --out DIR`)")
        try:
            check_standard_names(config_dict, "config.json")  # (an 8-head model was built over a 4-head dict)
            model = recorded_model_config(section["model"], "config.json (gbattn)").to_dict()
        except CheckpointError as e:  # a ValueError, as transformers' own config errors and the refusals above
            raise ConfigError(str(e)) from None
        mirrors = set(STANDARD_FIELDS)  # (checked above; kept, they would set n_kv_heads where the dict has None)
        config_dict = {k: v for k, v in config_dict.items() if k not in mirrors}
        return super().from_dict({**config_dict, "gbattn": {**section, "model": model}}, **kwargs)

    def to_dict(self) -> dict:
        """transformers' dict (what ``save_pretrained`` writes), with the standard names beside the gbattn model
        dict they are read from, for the tools that read config.json itself (PEFT's prompt learning takes
        ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` from it): mirrors, checked against that
        dict and then left out when read back (:meth:`from_dict`), so the dict stays the one record."""
        config = super().to_dict()
        model = self.gbattn["model"]
        for name, field in STANDARD_FIELDS.items():
            if field != "rope_base" or model["pos"] == "rope":  # (a RoPE base only where RoPE is used)
                config[name] = getattr(self, name)
        return config

    def to_diff_dict(self) -> dict:
        """What ``save_pretrained`` writes: transformers' dict of the values that differ from its defaults, with
        every mirror of :meth:`to_dict` kept (4.x dropped ``tie_word_embeddings`` of a tied model, equal to its
        default, so the two versions wrote different files)."""
        config, full = super().to_diff_dict(), self.to_dict()
        return {**config, **{name: full[name] for name in STANDARD_FIELDS if name in full}}

    @classmethod
    def from_model_config(cls, model_cfg: ModelConfig, run: dict | None = None, **kwargs) -> GbattnConfig:
        """The config of a gbattn model; ``run``: the rest of a run's config.json (train, preset, data, ...)."""
        check_model_config(model_cfg, "GbattnConfig.from_model_config")  # (a dict: "has no attribute 'to_dict'")
        return cls(gbattn={**(run or {}), "model": model_cfg.to_dict()}, **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        """The gbattn :class:`ModelConfig` (a fresh, validated record)."""
        return ModelConfig.from_dict(self.gbattn["model"])
