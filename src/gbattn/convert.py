"""Hugging Face checkpoints as gbattn models, read offline (docs/method.md, "Upcycling").

:func:`load_source` reads a model directory: a Hugging Face ``GPT2LMHeadModel`` or
``LlamaForCausalLM`` checkpoint (``config.json``, ``model.safetensors`` or shards with an index, a
``pytorch_model.bin`` read with ``weights_only=True``, ``tokenizer.json``), or a gbattn run
directory. It returns a :class:`Source`: a gbattn :class:`ModelConfig`, a :class:`GPT` state dict
with the same function, and the tokenizer. What cannot be converted exactly (RoPE scaling, a head
width other than hidden/heads, other activations and model types, a quantized checkpoint) is refused with one
line.

Parameter layouts (gbattn's :class:`StandardAttention` and :class:`FeedForward`):

* GPT-2: Conv1D weights are stored (in, out) and transposed; ``c_attn`` is already ``qkv`` with
  rows [Q; K; V]; ``c_proj`` -> ``out``; ``mlp.c_fc`` -> ``mlp.fc``; ``mlp.c_proj`` -> ``mlp.proj``.
* Llama: ``q_proj``, ``k_proj``, ``v_proj`` stacked into ``qkv`` rows [Q; K; V] (K and V with the
  grouped heads); ``o_proj`` -> ``out``; ``gate_proj``, ``up_proj`` stacked into ``mlp.fc`` rows
  [gate; up]; ``down_proj`` -> ``mlp.proj``. HF's RoPE is the rotate-half layout, as gbattn's.

Weights are read with or without the ``transformer.`` / ``model.`` prefix (a base ``GPT2Model`` or
``LlamaModel`` saves them without, and without ``lm_head.weight``: converted only when the config is tied).
A tied checkpoint may hold the shared tensor under either name (``safetensors.torch.save_model`` keeps
``lm_head.weight``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from gbattn import rundir
from gbattn.config import ModelConfig, TrainConfig
from gbattn.data.tokenizer import Tokenizer
from gbattn.errors import CheckpointError, ConfigError
from gbattn.files import did_you_mean_path, error_detail, portable_path, read_json, read_json_bytes, refuse_not_regular
from gbattn.model.gpt import GPT

TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
HF_TOKENIZER = "tokenizer.json"
# GPT-2 activations gbattn computes exactly ("gelu_new", "gelu_fast" and "gelu_pytorch_tanh" are three
# implementations of GELU's tanh approximation).
GPT2_ACTIVATIONS = {"gelu_new": "gelu-tanh", "gelu_fast": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu": "gelu",
                    "gelu_python": "gelu"}  # (gelu_python: x/2 (1 + erf(x/sqrt 2)), exact GELU as torch's)
# Llama activations gbattn's SwiGLU computes ("swish" is transformers' other name for silu).
LLAMA_ACTIVATIONS = ("silu", "swish")
# Buffers older checkpoints carry that hold no parameters (causal masks, RoPE frequencies).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


@dataclass
class Source:
    """A model to upcycle: its config, a :class:`GPT` state dict and its tokenizer."""

    model_cfg: ModelConfig
    state: dict[str, Tensor]
    tokenizer: Tokenizer
    kind: str  # gpt2 | llama | gbattn
    name: str  # a portable name of the source (no absolute path)
    preset: str | None = None  # a gbattn source's preset
    train_cfg: TrainConfig | None = None  # a gbattn source's training config
    config: dict = field(default_factory=dict)  # a gbattn source's config.json
    checkpoint: str | None = None  # a gbattn source's weights: best, last or exported (rundir.load_run)
    step: int | None = None  # the training step of those weights
    notes: list[str] = field(default_factory=list)  # what the conversion could not keep exactly

    def build_model(self) -> GPT:
        """A :class:`GPT` holding these weights, in eval mode."""
        return rundir.model_holding(self.model_cfg, self.state, self.name)


def load_source(source: str | Path | rundir.LoadedRun | Source) -> Source:
    """A gbattn run directory (or one written by ``gbattn export``) or a Hugging Face checkpoint directory as a
    source; a loaded run (:func:`gbattn.load_run`) as one too, and a :class:`Source` as it is."""
    if isinstance(source, Source):
        return source
    if isinstance(source, rundir.LoadedRun):
        return source_of_run(source)
    if not isinstance(source, (str, os.PathLike)):  # (a model: pathlib's "expected str, bytes or os.PathLike object")
        raise TypeError(f"a source of type {type(source).__name__}: give a directory (a gbattn run or a Hugging Face "
                        f"checkpoint), a loaded run (gbattn.load_run) or a Source")
    path = Path(source)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (a Hugging Face checkpoint or a gbattn run directory)"
                              f"{did_you_mean_path(path)}")
    if not (path / rundir.CONFIG).is_file():
        refuse_not_regular(path / rundir.CONFIG)
        rundir.refuse_weights_without_config(path, then=rundir.UNFINISHED_RUN_ADVICE)  # an upcycle or run stopped early
        raise CheckpointError(f"{path} has no {rundir.CONFIG}: neither a Hugging Face checkpoint directory nor a "
                              f"gbattn run directory")
    config = rundir.read_config(path / rundir.CONFIG)
    saved = rundir.gbattn_section(config, path / rundir.CONFIG)
    if saved is None and "model_type" not in config and ("model" in config or "train" in config):
        rundir.read_configs(config, path / rundir.CONFIG)  # a run's config.json that lost a section: said so
    if saved is not None:
        return source_of_run(rundir.load_run(path))
    return convert_hf(path)


def source_of_run(run: rundir.LoadedRun) -> Source:
    """A loaded gbattn run (:func:`gbattn.load_run`: its config.json, or an export's gbattn section) as a source, with
    its model's weights."""
    return Source(run.model_cfg, run.model.state_dict(), run.tokenizer, "gbattn", source_name(run.run_dir),
                  preset=run.config.get("preset"), train_cfg=run.train_cfg, config=run.config,
                  checkpoint=run.checkpoint, step=run.step)


def source_name(path: Path) -> str:
    """The name an upcycled run records for its source (:func:`gbattn.files.portable_path`); the working directory
    (``.``) or a parent (``..``) by its own name, as neither names anything once read elsewhere."""
    return portable_path(str(path if path.name not in ("", "..") else path.resolve()))


def convert_hf(path: str | Path) -> Source:
    """A Hugging Face GPT-2 or Llama checkpoint directory as a gbattn :class:`Source`."""
    path = Path(path)
    hf = read_json(path / rundir.CONFIG)
    model_type = hf.get("model_type")
    refuse_quantized(hf, path)
    if model_type == "gpt2":
        model_cfg, notes = gpt2_config(hf, path)
        convert = gpt2_state
    elif model_type == "llama":
        model_cfg, notes = llama_config(hf, path), []
        convert = llama_state
    else:
        raise CheckpointError(f"{path}: model_type={model_type!r} cannot be converted; gbattn converts gpt2 "
                              f"(GPT2LMHeadModel) and llama (LlamaForCausalLM) checkpoints and gbattn run directories")
    tokenizer = hf_tokenizer(path, model_cfg.vocab_size)  # before the weights, which may take minutes to read
    weights = read_hf_weights(path)
    # else upcycled into a run that every command then calls damaged; a mask buffer may hold -inf
    rundir.check_finite({k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}, path)
    state = convert(weights, model_cfg, path)
    # gbattn's parameters are float32: float64 weights that need more digits are rounded (their logits moved by
    # about 1e-7, where the conversion is otherwise exact), said in the summary and the run's record
    wide = {k: v for k, v in weights.items() if v.dtype == torch.float64 and not k.endswith(IGNORED_SUFFIXES)}
    past = [k for k, v in wide.items() if not torch.isfinite(v.float()).all()]  # (made inf, and called damaged)
    if past:
        raise CheckpointError(f"{path}: weight {past[0]} holds values past float32's range (3.4e38), gbattn's "
                              f"parameters: it cannot be converted")
    rounded = [k for k, v in wide.items() if not torch.equal(v.float().double(), v)]
    if rounded:
        notes.append(f"{len(rounded)} weight(s) stored in float64 ({rounded[0]}{', ...' if len(rounded) > 1 else ''}) "
                     f"need more digits than float32, gbattn's parameters, and are rounded to it: the model computes "
                     f"the source's function to float32's precision, not exactly")
    return Source(model_cfg, state, tokenizer, model_type, source_name(path), notes=notes)


# --------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------


def refuse_quantized(hf: dict, where: Path) -> None:
    """A ``quantization_config`` means transformers runs the model quantized (stored integer or float8 weights with
    their scales, or float weights it quantizes as it loads them): not a function gbattn's float weights compute."""
    quantization = hf.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise CheckpointError(f"{where}: quantization_config ({method if isinstance(method, str) else 'unknown'}): "
                              f"a quantized checkpoint cannot be converted exactly; convert the model's unquantized "
                              f"(float16, bfloat16 or float32) checkpoint")


def _sizes(hf: dict, where: Path, *names: str) -> list[int]:
    missing = [n for n in names if n not in hf]
    if missing:
        raise CheckpointError(f"{where / rundir.CONFIG} lacks {', '.join(missing)}: not a complete model config")
    wrong = [n for n in names if not isinstance(hf[n], int) or isinstance(hf[n], bool) or hf[n] < 1]
    if wrong:
        raise CheckpointError(f"{where / rundir.CONFIG}: " + ", ".join(f"{n}={hf[n]!r}" for n in wrong)
                              + " must be a positive integer")
    return [hf[n] for n in names]


_KIND_WORDS = {str: "a string", bool: "true or false", int: "an integer", float: "a number", dict: "a mapping"}


def _field(hf: dict, where: Path, key: str, default, *kinds: type):
    """``hf[key]`` (``default`` when absent or null), refused in one line when not of ``kinds`` (a
    bool is no number)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        words = "a number" if float in kinds else " or ".join(_KIND_WORDS.get(k, k.__name__) for k in kinds)
        raise CheckpointError(f"{where}: {key}={json.dumps(value)} must be {words}")
    return value


def _activation(hf: dict, where: Path, key: str, default: str) -> str:
    """The activation's name ``hf[key]`` (``default`` when absent); null is refused, not read as the default:
    transformers refuses it (5.x) or fails on it (4.x), so it names no function the checkpoint computes."""
    if key in hf and hf[key] is None:
        raise CheckpointError(f"{where}: {key}=null names no activation (transformers cannot load it either); give "
                              f"its name, or leave the key out for {default}")
    return _field(hf, where, key, default, str)


def _model_config(d: dict, where: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise CheckpointError(f"{where}: cannot be converted ({e})") from None


def _refuse_one_position(block: int, key: str, where: Path) -> None:
    """The source's positions ``block`` (its ``key``), refused at 1: upcycle keeps the source's block and refuses
    --set seq_len, so its run would train on rows of block_size - 1 = 0 input tokens (ModelConfig.input_length)."""
    if block == 1:
        raise CheckpointError(f"{where}: {key}=1: a model of one position leaves its upcycled run no input tokens "
                              f"per row (seq_len = block_size - 1 = 0, and upcycle keeps the source's block); "
                              f"upcycle a model of 2 positions or more")


def gpt2_config(hf: dict, where: Path) -> tuple[ModelConfig, list[str]]:
    """The gbattn config of a GPT-2 ``config.json`` (with a note where dropout rates differ)."""
    vocab, block, d, layers, heads = _sizes(hf, where, "vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    _refuse_one_position(block, "n_positions", where)
    act = _activation(hf, where, "activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise CheckpointError(f"{where}: activation_function={act!r} cannot be converted exactly; gbattn has "
                              f"{', '.join(GPT2_ACTIVATIONS)}")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        _field(hf, where, key, want, bool)  # "yes" is no flag; null stays refused (transformers reads it as false)
        if hf.get(key, want) != want:
            raise CheckpointError(f"{where}: {key}={json.dumps(hf[key])} cannot be converted exactly (gbattn needs "
                                  f"{json.dumps(want)})")
    # GPT-2's dropout sites: embeddings, attention probabilities, both sublayer outputs ("resid").
    embd, attn, resid = (_field(hf, where, key, 0.1, int, float) for key in ("embd_pdrop", "attn_pdrop", "resid_pdrop"))
    for key, rate in (("embd_pdrop", embd), ("attn_pdrop", attn), ("resid_pdrop", resid)):
        if not 0 <= rate < 1:  # a NaN or negative rate read as "no dropout at that site"
            raise CheckpointError(f"{where}: {key}={json.dumps(rate)} must be a rate in [0, 1)")
    rates = {"embedding": embd, "attention": attn, "attn-output": resid, "ffn-output": resid}
    p = max(rates.values())
    notes = []
    if len({r for r in rates.values() if r > 0}) > 1:
        notes.append(f"dropout rates differ ({rates}); gbattn has one rate: {p} at every site that has one")
    d_cfg = dict(vocab_size=vocab, block_size=block, d_model=d, n_layers=layers, n_heads=heads,
                 ffn=GPT2_ACTIVATIONS[act], ffn_hidden=_field(hf, where, "n_inner", 4 * d, int), dropout=p,
                 dropout_sites=[s for s, r in rates.items() if r > 0], norm="pre", norm_type="layernorm",
                 norm_eps=_field(hf, where, "layer_norm_epsilon", 1e-5, int, float), pos="learned", bias=True,
                 tie_embeddings=_field(hf, where, "tie_word_embeddings", True, bool), attn="standard")
    return _model_config(d_cfg, where), notes


def _scales(rope: dict) -> bool:
    """Whether a ``rope_parameters`` / ``rope_scaling`` dict changes RoPE (a type other than
    ``default``, under either key name, or a partial rotation). ``linear`` with factor 1 divides the
    positions by 1: no scaling."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("factor")
    identity = kind == "linear" and isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 1
    return (kind != "default" and not identity) or rope.get("partial_rotary_factor", 1.0) != 1.0


def llama_rope_base(hf: dict, where: Path) -> float:
    """RoPE base of a Llama config; RoPE scaling of any kind, in ``rope_parameters`` (transformers
    >= 5) or the older ``rope_scaling``, is refused: gbattn's RoPE has none. A ``default`` entry is no
    scaling. As in transformers 5, a non-empty ``rope_scaling`` takes the place of ``rope_parameters``
    whole, and the base is that entry's ``rope_theta``, else the top-level ``rope_theta``, else 10000."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise CheckpointError(f"{where}: {key}={json.dumps(rope)} is not a dict of RoPE parameters")
        if _scales(rope):
            raise CheckpointError(f"{where}: {key}={json.dumps(rope)} (RoPE scaling) cannot be converted exactly: "
                                  f"gbattn's RoPE has no scaling")
    base = _field(hf, where, "rope_theta", 10000.0, int, float)
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    return float(_field(rope, where, "rope_theta", base, int, float))


def llama_config(hf: dict, where: Path) -> ModelConfig:
    """The gbattn config of a Llama ``config.json``."""
    vocab, d, layers, heads, hidden = _sizes(hf, where, "vocab_size", "hidden_size", "num_hidden_layers",
                                             "num_attention_heads", "intermediate_size")
    if _activation(hf, where, "hidden_act", "silu") not in LLAMA_ACTIVATIONS:
        raise CheckpointError(f"{where}: hidden_act={hf['hidden_act']!r} cannot be converted exactly; gbattn's "
                              f"SwiGLU uses silu")
    # transformers 4.x's Llama rotates this share of each head (its default RoPE reads the top-level field), 5.x's
    # all of it: the checkpoint's function depends on the version, and gbattn's RoPE rotates all of it
    partial = _field(hf, where, "partial_rotary_factor", 1.0, int, float)
    if partial != 1:
        raise CheckpointError(f"{where}: partial_rotary_factor={json.dumps(partial)} cannot be converted exactly: "
                              f"transformers 4.x rotates that share of each head (5.x all of it), gbattn's RoPE all "
                              f"of it")
    head_dim = _field(hf, where, "head_dim", None, int)
    if head_dim is not None and head_dim * heads != d:
        raise CheckpointError(f"{where}: head_dim={head_dim} is not hidden_size/num_attention_heads = {d}/{heads}; "
                              f"gbattn's heads are d_model/n_heads wide")
    # attention_bias: the q/k/v and o projections' biases (gbattn's attn_bias, None where it equals bias: the
    # default); mlp_bias: the gate, up and down projections' (gbattn's bias; RMSNorm has none)
    attn_bias, mlp_bias = (_field(hf, where, key, False, bool) for key in ("attention_bias", "mlp_bias"))
    kv = _field(hf, where, "num_key_value_heads", heads, int)
    block = _field(hf, where, "max_position_embeddings", 2048, int)
    _refuse_one_position(block, "max_position_embeddings", where)
    d_cfg = dict(vocab_size=vocab, block_size=block, d_model=d, n_layers=layers,
                 n_heads=heads, n_kv_heads=None if kv == heads else kv, ffn="swiglu", ffn_hidden=hidden,
                 dropout=_field(hf, where, "attention_dropout", 0.0, int, float), dropout_sites=["attention"],
                 norm="pre", norm_type="rmsnorm", norm_eps=_field(hf, where, "rms_norm_eps", 1e-6, int, float),
                 pos="rope", rope_base=llama_rope_base(hf, where), bias=mlp_bias,
                 attn_bias=None if attn_bias == mlp_bias else attn_bias,
                 tie_embeddings=_field(hf, where, "tie_word_embeddings", False, bool), attn="standard")
    return _model_config(d_cfg, where)


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


def read_hf_weights(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint directory: ``model.safetensors``, safetensors shards with their
    index, or ``pytorch_model.bin`` (and shards) read with ``torch.load(weights_only=True)``, which
    refuses a file that would unpickle arbitrary objects."""
    path = Path(path)
    if (path / rundir.SAFETENSORS).is_file():
        return rundir.read_safetensors(path / rundir.SAFETENSORS, "cpu")
    if (path / rundir.SAFETENSORS_INDEX).is_file():
        return rundir.read_shards(path, rundir.SAFETENSORS_INDEX, lambda p: rundir.read_safetensors(p, "cpu"))
    if (path / TORCH_BIN).is_file():
        return read_torch_weights(path / TORCH_BIN)
    if (path / TORCH_BIN_INDEX).is_file():
        return rundir.read_shards(path, TORCH_BIN_INDEX, read_torch_weights)
    for name in (rundir.SAFETENSORS, TORCH_BIN):
        refuse_not_regular(path / name)
    raise CheckpointError(f"{path} has no {rundir.SAFETENSORS}, {rundir.SAFETENSORS_INDEX}, {TORCH_BIN} or "
                          f"{TORCH_BIN_INDEX}")


def read_torch_weights(path: Path) -> dict[str, Tensor]:
    """A ``torch.save``'d state dict of tensors only (:func:`gbattn.rundir.read_torch_file`)."""
    state = rundir.read_torch_file(path)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise CheckpointError(f"{path} is not a state dict of named tensors")
    return state


class _Weights:
    """Named tensors taken one by one; what is missing or left over is an error naming it."""

    def __init__(self, weights: dict[str, Tensor], prefix: str, where: Path) -> None:
        self.where = where
        kept = [k for k in weights if not k.endswith(IGNORED_SUFFIXES)]
        self.weights = {k.removeprefix(prefix): weights[k] for k in kept}
        if len(self.weights) < len(kept):  # one of the two copies would be taken, by the file's order
            twice = sorted(k for k in kept if prefix and k.startswith(prefix) and k.removeprefix(prefix) in weights)
            raise CheckpointError(f"{where}: the checkpoint holds {twice[0].removeprefix(prefix)} both with and "
                                  f"without the {prefix} prefix; keep one")

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in self.weights:
            raise CheckpointError(f"{self.where}: the checkpoint lacks the weight {name}")
        w = self.weights.pop(name)
        if tuple(w.shape) != shape:
            raise CheckpointError(f"{self.where}: weight {name} has shape {tuple(w.shape)}, the config implies {shape}")
        return w.to(torch.float32) if w.is_floating_point() else w

    def embedding(self, name: str, shape: tuple[int, ...], tied: bool) -> Tensor:
        """The token embedding ``name``; a tied checkpoint that stores the shared tensor only as
        ``lm_head.weight`` (as ``safetensors.torch.save_model`` keeps it) gives it from there, as
        transformers does when it ties the two."""
        if tied and name not in self.weights and "lm_head.weight" in self.weights:
            return self.take("lm_head.weight", shape)
        return self.take(name, shape)

    def head(self, embedding: Tensor, tied: bool, embedding_name: str) -> Tensor:
        """The output head: ``embedding`` when tied (a tied checkpoint may still store an equal
        ``lm_head.weight``), else the stored ``lm_head.weight``. A tied config whose checkpoint stores
        another head is refused: transformers 5 then leaves the two untied and uses the stored head,
        transformers 4 ties them and drops it, so the model's function depends on the version."""
        if not tied:
            if "lm_head.weight" not in self.weights:
                raise CheckpointError(f"{self.where}: tie_word_embeddings is false but the checkpoint has no "
                                      f"lm_head.weight (a base GPT2Model or LlamaModel, saved without its head?): "
                                      f"an untied output layer cannot be made up; convert the GPT2LMHeadModel or "
                                      f"LlamaForCausalLM checkpoint")
            return self.take("lm_head.weight", tuple(embedding.shape))
        if "lm_head.weight" in self.weights and not torch.equal(self.take("lm_head.weight", tuple(embedding.shape)),
                                                                embedding):
            raise CheckpointError(f"{self.where}: tie_word_embeddings is true but the checkpoint's lm_head.weight "
                                  f"differs from {embedding_name}; set tie_word_embeddings in {rundir.CONFIG} to false "
                                  f"to convert the stored head, or delete it from the checkpoint to tie them")
        return embedding

    def finish(self) -> None:
        left = sorted(self.weights)
        if left:
            raise CheckpointError(f"{self.where}: the checkpoint holds weights gbattn does not convert "
                                  f"({', '.join(left[:5])}{', ...' if len(left) > 5 else ''})")


def gpt2_state(weights: dict[str, Tensor], cfg: ModelConfig, where: Path) -> dict[str, Tensor]:
    """A :class:`GPT` state dict from GPT-2 weights (with or without the ``transformer.`` prefix)."""
    w = _Weights(weights, "transformer.", where)
    d, h, V = cfg.d_model, cfg.ffn_width, cfg.vocab_size
    out = {"wte.weight": w.embedding("wte.weight", (V, d), cfg.tie_embeddings),
           "wpe.weight": w.take("wpe.weight", (cfg.block_size, d))}
    for i in range(cfg.n_layers):
        src, dst = f"h.{i}.", f"blocks.{i}."
        for name, (hf_name, d_in, d_out) in {"attn.qkv": ("attn.c_attn", d, 3 * d), "attn.out": ("attn.c_proj", d, d),
                                             "mlp.fc": ("mlp.c_fc", d, h), "mlp.proj": ("mlp.c_proj", h, d)}.items():
            out[dst + name + ".weight"] = w.take(src + hf_name + ".weight", (d_in, d_out)).t().contiguous()
            out[dst + name + ".bias"] = w.take(src + hf_name + ".bias", (d_out,))
        for name, hf_name in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[dst + name + ".weight"] = w.take(src + hf_name + ".weight", (d,))
            out[dst + name + ".bias"] = w.take(src + hf_name + ".bias", (d,))
    out["ln_f.weight"], out["ln_f.bias"] = w.take("ln_f.weight", (d,)), w.take("ln_f.bias", (d,))
    out["lm_head.weight"] = w.head(out["wte.weight"], cfg.tie_embeddings, "wte.weight")
    w.finish()
    return out


def llama_state(weights: dict[str, Tensor], cfg: ModelConfig, where: Path) -> dict[str, Tensor]:
    """A :class:`GPT` state dict from Llama weights (with or without the ``model.`` prefix: a ``LlamaModel``
    saves them without); the attention projections' biases where they have them (``attention_bias``), the MLP's
    where it has them (``mlp_bias``)."""
    w = _Weights(weights, "model.", where)
    d, h, V, kv = cfg.d_model, cfg.ffn_width, cfg.vocab_size, cfg.kv_heads * cfg.d_head
    attn_bias = cfg.bias if cfg.attn_bias is None else cfg.attn_bias  # (as gbattn's Block reads it)
    out = {"wte.weight": w.embedding("embed_tokens.weight", (V, d), cfg.tie_embeddings)}
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"blocks.{i}."
        stacks = {"attn.qkv": [("self_attn.q_proj", d), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
                  "attn.out": [("self_attn.o_proj", d)], "mlp.fc": [("mlp.gate_proj", h), ("mlp.up_proj", h)],
                  "mlp.proj": [("mlp.down_proj", d)]}
        for name, parts in stacks.items():
            d_in = h if name == "mlp.proj" else d
            out[dst + name + ".weight"] = torch.cat([w.take(src + p + ".weight", (n, d_in)) for p, n in parts])
            if cfg.bias if name.startswith("mlp.") else attn_bias:
                out[dst + name + ".bias"] = torch.cat([w.take(src + p + ".bias", (n,)) for p, n in parts])
        out[dst + "ln1.weight"] = w.take(src + "input_layernorm.weight", (d,))
        out[dst + "ln2.weight"] = w.take(src + "post_attention_layernorm.weight", (d,))
    out["ln_f.weight"] = w.take("norm.weight", (d,))
    out["lm_head.weight"] = w.head(out["wte.weight"], cfg.tie_embeddings, "model.embed_tokens.weight")
    w.finish()
    return out


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def hf_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    """The directory's ``tokenizer.json`` as a gbattn tokenizer of kind ``hf``, with the model's vocabulary size."""
    file = path / HF_TOKENIZER
    if not file.is_file():
        refuse_not_regular(file)
        raise CheckpointError(f"{path} has no {HF_TOKENIZER} (the Hugging Face tokenizers file); write one with "
                              f"AutoTokenizer.from_pretrained(...).save_pretrained('{path}')")
    content = read_json_bytes(file)  # a huge file is refused unread
    try:
        tok = Tokenizer("hf", content.decode("utf-8"))
    except Exception as e:  # JSON or HF tokenizers errors: all mean a bad file
        raise CheckpointError(f"{file} is not a valid tokenizer.json ({error_detail(e, with_type=True)})") from None
    if tok.vocab_size != vocab_size:
        why = ("a padded embedding table cannot be converted exactly" if tok.vocab_size < vocab_size else
               f"ids from {vocab_size:,} on have no embedding row, so the tokenizer is not this model's")
        raise CheckpointError(f"{file} has {tok.vocab_size:,} tokens but the model's vocab_size is {vocab_size:,}: "
                              f"{why}")
    return tok
