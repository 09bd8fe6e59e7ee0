"""Conversion of Hugging Face checkpoints and upcycling (gbattn.convert, gbattn.upcycle; docs/method.md,
"Upcycling"): converted models compute transformers' logits, upcycled models compute their source's
logits exactly (float64), the new parameters receive gradient, refusals are one line, and the run
directory ``gbattn upcycle`` writes is continued by ``gbattn train --init-from``. Offline: tiny
random models built from configs, no hub."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from gbattn import rundir
from gbattn.cli import main
from gbattn.config import build_configs, get_preset
from gbattn.convert import load_source
from gbattn.data.corpus import load_corpus
from gbattn.data.tokenizer import get_tokenizer
from gbattn.errors import CheckpointError, ConfigError, UserError
from gbattn.hf.modeling import TF_MAJOR
from gbattn.model.gpt import GPT
from gbattn.upcycle import upcycle, write_run
from helpers import LFS_MESSAGE, LFS_POINTER

README = Path(__file__).resolve().parent.parent / "README.md"

VOCAB = 50
EXACT = dict(rtol=1e-12, atol=1e-12)  # float64 logits: equal up to summation order


def perturb(model: torch.nn.Module) -> None:
    """Random biases and norm gains too (a fresh model has zeros and ones, which hide mapping errors)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))


def save_hf(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def gpt2_model(**changes):
    """A tiny random GPT-2 (``changes``: further config fields)."""
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(**{**dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                            bos_token_id=0, eos_token_id=0), **changes})
    model = transformers.GPT2LMHeadModel(cfg)
    perturb(model)
    return model.eval()


def llama_model(**changes):
    """A tiny random Llama with grouped-query attention (``changes``: further config fields)."""
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(**{**dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB,
                                             rope_theta=500.0, tie_word_embeddings=False), **changes})
    model = transformers.LlamaForCausalLM(cfg)
    perturb(model)
    return model.eval()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_hf(gpt2_model(), tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf(llama_model(), tmp_path_factory.mktemp("llama"))


def write_gbattn_run(directory: Path) -> Path:
    """A gbattn run directory of a tiny standard model (GQA, char tokenizer of tiny-shakespeare), written by hand."""
    tok = get_tokenizer("char", load_corpus("tiny-shakespeare", (0.9, 0.1, 0.0)), verbose=False)
    sets = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "block_size": 33, "vocab_size": tok.vocab_size}
    model_cfg, train_cfg = build_configs("cpu-char", "standard", "tiny-shakespeare", sets)
    torch.manual_seed(3)
    model = GPT(model_cfg)
    perturb(model)
    directory.mkdir(parents=True)
    tok.save(directory / rundir.TOKENIZER)
    rundir.save_checkpoint({"model": model.state_dict(), "step": 7}, directory / rundir.BEST)
    config = {"preset": "cpu-char", "model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "extra": {},
              "data": {"corpus": "tiny-shakespeare"}, "seq_len": 32, "steps": 7, "parameters": model.num_params()}
    (directory / rundir.CONFIG).write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def gbattn_dir(tmp_path_factory):
    return write_gbattn_run(tmp_path_factory.mktemp("gbattn") / "run")


@pytest.fixture(params=["gbattn", "gpt2", "llama"])
def source_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


def tokens(seed: int = 0, batch: int = 3, length: int = 17):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits64(model: torch.nn.Module, idx_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.double().eval()(idx_BT)


def upcycled_model(up) -> GPT:
    model = GPT(up.model_cfg)
    model.load_state_dict(up.state)
    return model.eval()


# --------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------


@pytest.fixture
def float64_llama(monkeypatch):
    """transformers computes Llama's RMSNorm and RoPE angles in float32 even in a float64 model;
    patched here to float64 (as gbattn computes them) so the comparison can be exact."""
    from transformers.models.llama import modeling_llama as ml

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        dim = 2 * self.inv_freq.shape[0]
        # transformers 5 reads rope_parameters (rope_scaling when given); 4.x the top-level rope_theta alone (a
        # rope_parameters key in config.json is only an attribute there)
        params = (getattr(self.config, "rope_parameters", None) or {}) if TF_MAJOR >= 5 else {}
        base = params.get("rope_theta", getattr(self.config, "rope_theta", None))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(ml.LlamaRotaryEmbedding, "forward", rope)


@pytest.mark.parametrize("make", [gpt2_model, llama_model], ids=["gpt2", "llama-gqa"])
def test_converted_logits_equal_transformers(make, tmp_path, float64_llama):
    hf = make()
    source = load_source(save_hf(hf, tmp_path / "hf"))
    idx = tokens()
    with torch.no_grad():
        expected = hf.double()(idx).logits
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)
    assert source.tokenizer.kind == "hf" and source.tokenizer.encode("w3 w7 zzz") == [3, 7, 0]


@pytest.mark.parametrize("make", [gpt2_model, llama_model], ids=["gpt2", "llama-gqa"])
def test_converted_model_generates_as_transformers_does(make, tmp_path, float64_llama):
    """Greedy cached decoding of a left-padded batch, after upcycling to GBA: the tokens transformers' own
    model generates (its positions start at each row's first real token, as gbattn's under RoPE)."""
    hf = make().double()
    source = load_source(save_hf(hf, tmp_path / "hf"))
    model = upcycled_model(upcycle(source, "boosted", {"rounds": 3})).double()
    idx = tokens(seed=4, batch=3, length=9)
    mask = torch.ones_like(idx, dtype=torch.bool)
    mask[1, :4], mask[2, :8] = False, False
    idx = idx.masked_fill(~mask, 0)
    with torch.no_grad():
        expected = hf.generate(idx, attention_mask=mask.long(), max_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
    assert torch.equal(model.generate(idx, 12, temperature=0, prompt_mask=mask, compile=False), expected)


# Config fields the models above leave at their defaults: a conversion that ignored one would still pass there.
NON_DEFAULT = [
    (gpt2_model, {"tie_word_embeddings": False}),  # an untied head: lm_head.weight, not wte
    (gpt2_model, {"n_inner": 48}),
    (gpt2_model, {"layer_norm_epsilon": 1e-2}),
    (gpt2_model, {"activation_function": "gelu"}),  # exact GELU, not the tanh approximation
    (gpt2_model, {"activation_function": "gelu_fast"}),  # the tanh approximation written another way
    (gpt2_model, {"activation_function": "gelu_pytorch_tanh"}),  # and a third
    (gpt2_model, {"activation_function": "gelu_python"}),  # exact GELU written with erf (it was refused)
    (llama_model, {"hidden_act": "swish"}),  # silu's other name
    (llama_model, {"rms_norm_eps": 1e-2}),
    (llama_model, {"attention_bias": True, "mlp_bias": True}),
    (llama_model, {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize("make,changes", NON_DEFAULT,
                         ids=[f"{m.__name__[:-6]}-{json.dumps(c, separators=(',', '='))}" for m, c in NON_DEFAULT])
def test_non_default_config_fields_convert_exactly(make, changes, tmp_path, float64_llama):
    """Each field the conversion reads, away from its default, still gives transformers' logits."""
    hf = make(**changes)
    source = load_source(save_hf(hf, tmp_path / "hf"))
    idx = tokens()
    with torch.no_grad():
        expected = hf.double()(idx).logits
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)


def test_float64_weights_that_need_more_digits_than_float32_are_rounded_with_a_note(tmp_path, float64_llama):
    """gbattn's parameters are float32: a float64 checkpoint whose weights need more digits was rounded silently (its
    logits moved by ~3e-7, where the README promises the source's function to 1e-12). Said in the notes; a float64
    checkpoint of float32 values converts exactly, with none."""
    for make in (gpt2_model, llama_model):
        exact = make().double()
        source = load_source(save_hf(exact, tmp_path / f"exact-{make.__name__}"))
        assert source.notes == []
        with torch.no_grad():
            next(exact.parameters()).add_(1e-12)  # (a digit float32 does not have)
        source = load_source(save_hf(exact, tmp_path / f"finer-{make.__name__}"))
        assert len(source.notes) == 1 and re.fullmatch(
            r"1 weight\(s\) stored in float64 \(\S+\) need more digits than float32, gbattn's parameters, and are "
            r"rounded to it: the model computes the source's function to float32's precision, not exactly",
            source.notes[0]), source.notes
        # past float32's range: no rounding makes it (it became inf, and the weights were called damaged)
        with torch.no_grad():
            next(exact.parameters()).view(-1)[0] = 1e39
        with pytest.raises(CheckpointError, match=r"holds values past float32's range \(3.4e38\), gbattn's parameters: "
                                                  r"it cannot be converted$"):
            load_source(save_hf(exact, tmp_path / f"past-{make.__name__}"))


@pytest.mark.parametrize("attention_bias,mlp_bias,attn_bias", [(True, False, True), (False, True, False),
                                                             (True, True, None)])
def test_a_llama_with_biases_in_attention_or_mlp_alone_converts_exactly(attention_bias, mlp_bias, attn_bias, tmp_path,
                                                                        float64_llama):
    """A Llama whose attention_bias and mlp_bias differ was refused ("gbattn's bias flag covers both"), though
    ModelConfig's attn_bias gives the attention projections' biases apart from bias: attention_bias is now attn_bias
    (None where it equals mlp_bias, as gbattn's own configs record it) and mlp_bias is bias, each projection takes its
    biases where it has them, and the logits are transformers'."""
    hf = llama_model(attention_bias=attention_bias, mlp_bias=mlp_bias)
    source = load_source(save_hf(hf, tmp_path / "hf"))
    assert (source.model_cfg.bias, source.model_cfg.attn_bias) == (mlp_bias, attn_bias)
    assert [f"blocks.0.{name}.bias" in source.state for name in ("attn.qkv", "attn.out", "mlp.fc", "mlp.proj")] == [
        attention_bias, attention_bias, mlp_bias, mlp_bias]
    idx = tokens()
    with torch.no_grad():
        expected = hf.double()(idx).logits
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)


def test_converted_llama_matches_transformers_as_shipped_in_float32(llama_dir):
    """Without the float64 patch: transformers' float32 norms and RoPE agree to float32 rounding."""
    hf = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(load_source(llama_dir).build_model()(idx), hf(idx).logits, rtol=1e-4, atol=1e-5)


def test_converted_configs(gpt2_dir, llama_dir):
    gpt2, llama = load_source(gpt2_dir).model_cfg, load_source(llama_dir).model_cfg
    assert (gpt2.ffn, gpt2.norm_type, gpt2.pos, gpt2.bias, gpt2.tie_embeddings, gpt2.block_size) == (
        "gelu-tanh", "layernorm", "learned", True, True, 64)
    assert (llama.ffn, llama.norm_type, llama.pos, llama.bias, llama.tie_embeddings, llama.n_kv_heads) == (
        "swiglu", "rmsnorm", "rope", False, False, 2)
    assert (llama.rope_base, llama.norm_eps, llama.ffn_width) == (500.0, 1e-6, 64)


def test_sharded_safetensors_and_torch_bin(tmp_path, float64_llama):
    """Shards with an index, and a plain ``pytorch_model.bin`` (tensors only) or its shards with their
    index (``pytorch_model.bin.index.json``), convert to the same model."""
    hf = llama_model()
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    save_hf(hf, tmp_path / "single")
    binary, binary_shards = tmp_path / "bin", tmp_path / "bin-shards"
    for directory in (binary, binary_shards):
        directory.mkdir()
        shutil.copy(tmp_path / "single" / "config.json", directory)
    torch.save(hf.state_dict(), binary / "pytorch_model.bin")
    names = list(hf.state_dict())
    weight_map = {name: f"pytorch_model-0000{1 + i % 2}-of-00002.bin" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        torch.save({k: v for k, v in hf.state_dict().items() if weight_map[k] == shard}, binary_shards / shard)
    (binary_shards / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    idx = tokens()
    expected = logits64(load_source(tmp_path / "single").build_model(), idx)
    for directory in (sharded, binary, binary_shards):
        shutil.copy(tmp_path / "single" / "tokenizer.json", directory)
        torch.testing.assert_close(logits64(load_source(directory).build_model(), idx), expected, **EXACT)


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for a checkpoint that runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_pickle_that_would_run_code_is_refused(gpt2_dir, tmp_path):
    directory = tmp_path / "evil"
    directory.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(gpt2_dir / name, directory)
    marker = tmp_path / "ran"
    torch.save({"transformer.wte.weight": torch.zeros(VOCAB, 32), "payload": _RunsCode(marker)},
               directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="could run code"):
        load_source(directory)
    assert not marker.exists()


def test_safetensors_weights_are_read_before_a_pickle_or_an_index_beside_them(gpt2_dir, tmp_path):
    """A directory holding model.safetensors and also a pytorch_model.bin or a shard index (many hub
    repositories ship both formats; a left-over index): the single safetensors file is read, as transformers
    reads it, and safetensors shards before a pytorch_model.bin. Reading the pickle first would unpickle a file
    transformers never loads (here one that runs code), and an index first reads shards that may be stale."""
    from safetensors.torch import load_file, save_file

    marker = tmp_path / "ran"
    directory = shutil.copytree(gpt2_dir, tmp_path / "both")
    torch.save({"transformer.wte.weight": torch.zeros(VOCAB, 32), "payload": _RunsCode(marker)},
               directory / "pytorch_model.bin")
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(weights, "model-00001-of-00001.safetensors")}))  # a shard no longer there
    idx = tokens()
    expected = logits64(load_source(gpt2_dir).build_model(), idx)
    torch.testing.assert_close(logits64(load_source(directory).build_model(), idx), expected, **EXACT)
    assert not marker.exists()
    # shards with their index (no single file): read before the pickle beside them
    (directory / "model.safetensors").unlink()
    save_file(weights, directory / "model-00001-of-00001.safetensors")
    torch.testing.assert_close(logits64(load_source(directory).build_model(), idx), expected, **EXACT)
    assert not marker.exists()


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_torch_bin_of_another_pickle_protocol(gpt2_dir, tmp_path, zip_format):
    """A ``pytorch_model.bin`` of tensors saved with ``pickle_protocol=3`` converts without torch's warning
    about the protocol (two lines of stderr per load before, five in the legacy format); one saved with
    protocol 4, which torch's safe reader does not read, is refused naming its protocol (before: "holds
    Python objects beyond tensors", which it does not)."""
    import warnings

    directory = tmp_path / "bin"
    directory.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(gpt2_dir / name, directory)
    state = gpt2_model().state_dict()
    torch.save(state, directory / "pytorch_model.bin", pickle_protocol=3, _use_new_zipfile_serialization=zip_format)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = load_source(directory)
    assert [str(w.message) for w in caught] == []
    idx = tokens()
    torch.testing.assert_close(logits64(source.build_model(), idx), logits64(load_source(gpt2_dir).build_model(), idx),
                               **EXACT)
    torch.save(state, directory / "pytorch_model.bin", pickle_protocol=4, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointError, match=re.escape("is pickled with protocol 4, which torch's safe reader")):
        load_source(directory)
    # Protocol 3, which the safe reader reads, refused for what it holds (a Python object), not for its protocol
    torch.save({**state, "extra": Fraction(1, 3)}, directory / "pytorch_model.bin", pickle_protocol=3,
               _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointError, match=r"holds Python objects beyond tensors \(loading it could run code\)"):
        load_source(directory)
    # Protocols 0 and 1, which the safe reader does not read either, have no PROTO opcode: tensors alone were "not a
    # torch.save file" (legacy format) or said to hold "Python objects beyond tensors" (zip format)
    for protocol in (0, 1):
        torch.save(state, directory / "pytorch_model.bin", pickle_protocol=protocol,
                   _use_new_zipfile_serialization=zip_format)
        with pytest.raises(CheckpointError, match=re.escape("is pickled with protocol 0 or 1, which torch's safe")):
            load_source(directory)


# How other savers (older transformers, a plain torch.save, GPT2Model) name and store the same weights.
WEIGHT_FILES = {
    "tied-head-stored-too": (gpt2_model, {}, lambda sd: sd),
    "llama-tied-head-stored-too": (llama_model, {"tie_word_embeddings": True}, lambda sd: sd),
    "no-transformer-prefix": (gpt2_model, {}, lambda sd: {k.removeprefix("transformer."): v for k, v in sd.items()}),
    "causal-mask-buffers": (gpt2_model, {}, lambda sd: {**sd, "transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64),
                                                        "transformer.h.1.attn.masked_bias": torch.tensor(-1e4)}),
    # a LlamaModel's names (no model. prefix) and no head: tied, the embedding is the head (refused before)
    "llama-base-model-tied": (llama_model, {"tie_word_embeddings": True},
                              lambda sd: {k.removeprefix("model."): v for k, v in sd.items() if k != "lm_head.weight"}),
    # a tied checkpoint holding the shared tensor once, as lm_head.weight (safetensors.torch.save_model keeps that
    # name): transformers ties the embedding to it (refused before: "lacks the weight wte.weight")
    "tied-tensor-stored-as-head": (gpt2_model, {}, lambda sd: {k: v for k, v in sd.items()
                                                               if k != "transformer.wte.weight"}),
    "llama-tied-tensor-stored-as-head": (llama_model, {"tie_word_embeddings": True},
                                         lambda sd: {k: v for k, v in sd.items() if k != "model.embed_tokens.weight"}),
    "llama-no-model-prefix": (llama_model, {}, lambda sd: {k.removeprefix("model."): v for k, v in sd.items()}),
    "rope-frequencies": (llama_model, {}, lambda sd: {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq":
                                                          torch.ones(4)}),
    # a buffer gbattn leaves out may be a mask of -inf: not the damage that a non-finite weight is
    "masked-bias-minus-infinity": (gpt2_model, {}, lambda sd: {**sd, "transformer.h.0.attn.masked_bias":
                                                               torch.tensor(float("-inf"))}),
}


@pytest.mark.parametrize("make,changes,edit", WEIGHT_FILES.values(), ids=WEIGHT_FILES)
def test_weights_as_other_savers_store_them_convert_exactly(make, changes, edit, tmp_path, float64_llama):
    hf = make(**changes)
    directory = save_hf(hf, tmp_path / "hf")
    (directory / "model.safetensors").unlink()
    torch.save(edit(hf.state_dict()), directory / "pytorch_model.bin")
    idx = tokens()
    with torch.no_grad():
        expected = hf.double()(idx).logits
    torch.testing.assert_close(logits64(load_source(directory).build_model(), idx), expected, rtol=1e-10, atol=1e-10)


def _int8_quantized(directory: Path) -> None:
    """As bitsandbytes saves an 8-bit model: int8 weights, a scale per row, quantization_config in config.json."""
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    for name in [k for k in weights if k.endswith("proj.weight")]:
        scale = weights[name].abs().amax(dim=1)
        weights[name] = (weights[name] / scale[:, None] * 127).round().to(torch.int8)
        weights[name.removesuffix("weight") + "SCB"] = scale
    save_file(weights, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("weights", ["int8", "float"])
def test_a_quantized_checkpoint_is_refused_saying_so(weights, llama_dir, tmp_path):
    """A config.json with a quantization_config: transformers runs the model quantized (its stored int8 weights and
    scales, or float weights it quantizes as it loads them), which gbattn's floating-point weights cannot compute.
    Before, stored int8 weights were "not floating-point numbers ...: the file is damaged; restore a copy of it", and
    float ones were converted as if unquantized."""
    directory = shutil.copytree(llama_dir, tmp_path / "quantized")
    if weights == "int8":
        _int8_quantized(directory)
    else:
        _edit_config(llama_dir, directory := tmp_path / "float", quantization_config={"quant_method": "bitsandbytes",
                                                                                      "load_in_8bit": True})
    with pytest.raises(CheckpointError, match=re.escape("quantization_config (bitsandbytes): a quantized checkpoint "
                                                        "cannot be converted exactly")) as e:
        load_source(directory)
    assert "\n" not in str(e.value)


def test_a_torch_bin_of_quantized_tensors_is_refused_in_one_line(gpt2_dir, tmp_path, capsys):
    """A pytorch_model.bin holding a torch-quantized (qint8) tensor: one line on stderr, as for any bad file (torch's
    reader printed four lines of its deprecation warnings above it)."""
    from safetensors.torch import load_file

    directory = shutil.copytree(gpt2_dir, tmp_path / "qint8")
    weights = load_file(directory / "model.safetensors")
    with warnings.catch_warnings():  # torch deprecates its quantized tensors, and says so as one is made
        warnings.simplefilter("ignore")
        try:
            weights["transformer.ln_f.weight"] = torch.quantize_per_tensor(weights["transformer.ln_f.weight"], 0.1, 0,
                                                                           torch.qint8)
        except (AttributeError, RuntimeError):
            pytest.skip("this torch makes no quantized tensors")
    torch.save(weights, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    with warnings.catch_warnings(record=True) as shown:  # outside pytest, each on stderr
        warnings.simplefilter("always")
        assert main(["upcycle", str(directory), "--attn", "boosted", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert [str(w.message) for w in shown] == []
    assert err.count("\n") == 1 and "not floating-point numbers (transformer.ln_f.weight: torch.qint8)" in err, err


def test_float8_weights_convert_exactly(tmp_path, float64_llama):
    """Weights stored as float8 (without a quantization scale): transformers reads their values into its float
    model, and so does the conversion (a traceback before: torch's isfinite has no float8_e4m3fn kernel)."""
    from safetensors.torch import load_file, save_file

    directory = save_hf(llama_model(), tmp_path / "hf")
    weights = {k: v.to(torch.float8_e4m3fn) for k, v in load_file(directory / "model.safetensors").items()}
    save_file(weights, directory / "model.safetensors")
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval().double()  # (4.x names dtype torch_dtype)
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits
    source = load_source(directory)
    assert {v.dtype for v in source.state.values()} == {torch.float32}  # read into float32, as transformers does
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=re.escape("hold NaN or infinite values (model.norm.weight)")):
        load_source(directory)
    if hasattr(torch, "float4_e2m1fn_x2"):  # two values a byte: no float32 of it to read, refused in one line
        weights["model.norm.weight"] = torch.zeros(32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        save_file(weights, directory / "model.safetensors")
        with pytest.raises(CheckpointError, match=re.escape("not floating-point numbers (model.norm.weight: "
                                                            "torch.float4_e2m1fn_x2)")):
            load_source(directory)


@pytest.mark.parametrize("make,prefix", [(gpt2_model, "transformer."), (llama_model, "model.")], ids=["gpt2", "llama"])
def test_an_untied_base_model_without_a_head_is_refused_saying_so(make, prefix, tmp_path):
    """A GPT2Model or LlamaModel checkpoint (no prefix, no lm_head.weight) whose config is untied: there is no head
    to convert; the error says the checkpoint looks like a base model (it said only "lacks model.embed_tokens.weight"
    for Llama, "lacks the weight lm_head.weight" for GPT-2)."""
    hf = make(tie_word_embeddings=False)
    directory = save_hf(hf, tmp_path / "hf")
    (directory / "model.safetensors").unlink()
    torch.save({k.removeprefix(prefix): v for k, v in hf.state_dict().items() if k != "lm_head.weight"},
               directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=re.escape("tie_word_embeddings is false but the checkpoint has no "
                                                        "lm_head.weight (a base GPT2Model or LlamaModel")):
        load_source(directory)


@pytest.mark.parametrize("make,embedding", [(gpt2_model, "wte.weight"), (llama_model, "model.embed_tokens.weight")],
                         ids=["gpt2", "llama"])
def test_a_tied_config_whose_checkpoint_stores_another_head_is_refused(make, embedding, tmp_path, float64_llama):
    """tie_word_embeddings true, and a stored lm_head.weight that is not the embedding: transformers 5 then
    unties them (its logits use the stored head), transformers 4 ties them. Before, the conversion used the
    embedding silently (logits about 19 away from transformers' 5.x). Refused, saying how to choose; the
    choice 'untied' converts to transformers' logits."""
    from safetensors.torch import load_file, save_file

    directory = save_hf(make(tie_word_embeddings=True), tmp_path / "hf")
    weights = load_file(directory / "model.safetensors")
    key = "transformer.wte.weight" if make is gpt2_model else embedding
    for head in (torch.randn_like(weights[key]), torch.nextafter(weights[key], torch.full_like(weights[key], 2.0))):
        weights["lm_head.weight"] = head  # another head, or one a float step from the embedding: not the same head
        save_file(weights, directory / "model.safetensors")
        with pytest.raises(CheckpointError, match=re.escape(f"tie_word_embeddings is true but the checkpoint's "
                                                            f"lm_head.weight differs from {embedding}; set")) as e:
            load_source(directory)
        assert "\n" not in str(e.value)
    _edit_config(directory, tmp_path / "untied", tie_word_embeddings=False)
    hf = type(make()).from_pretrained(tmp_path / "untied").eval().double()
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits
    torch.testing.assert_close(logits64(load_source(tmp_path / "untied").build_model(), idx), expected,
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("which,key", [("gpt2", "n_embd"), ("llama", "intermediate_size")])
def test_a_config_lacking_a_size_is_refused_naming_it(which, key, request, tmp_path):
    """A config.json without one of the sizes the conversion has no default for: one line naming it."""
    directory = shutil.copytree(request.getfixturevalue(f"{which}_dir"), tmp_path / "edited")
    config = json.loads((directory / "config.json").read_text())
    del config[key]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(f"config.json lacks {key}: not a complete model config")):
        load_source(directory)


def test_an_untied_checkpoint_without_its_embedding_is_refused_naming_it(tmp_path):
    """Untied, the stored head is no stand-in for a missing embedding (only a tied checkpoint may keep the shared
    tensor as lm_head.weight): "lacks the weight wte.weight", not a complaint about the head."""
    directory = save_hf(gpt2_model(tie_word_embeddings=False), tmp_path / "hf")
    _without("transformer.wte.weight")(directory)
    with pytest.raises(CheckpointError, match=re.escape("the checkpoint lacks the weight wte.weight")):
        load_source(directory)


def _training_checkpoint(directory: Path) -> None:
    from safetensors.torch import load_file

    torch.save({"model": load_file(directory / "model.safetensors"), "step": 3}, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


def _shard_outside(directory: Path) -> None:
    from safetensors.torch import load_file

    index = {"weight_map": dict.fromkeys(load_file(directory / "model.safetensors"), "../outside.safetensors")}
    (directory / "model.safetensors").rename(directory.parent / "outside.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_without_weight_map(directory: Path) -> None:
    (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _shorter_positions(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "n_positions": 32}))


def _attention_weight_transposed(directory: Path) -> None:
    """GPT-2's fused attention weight stored (out, in) as a Linear's, not (in, out) as Conv1D's: as many numbers."""
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    name = "transformer.h.0.attn.c_attn.weight"
    weights[name] = weights[name].t().contiguous()
    save_file(weights, directory / "model.safetensors")


def _infinite_norm_gain(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    weights["transformer.ln_f.weight"][3] = float("inf")
    save_file(weights, directory / "model.safetensors")


def _norm_gain_under_two_names(directory: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    weights["ln_f.weight"] = torch.zeros_like(weights["transformer.ln_f.weight"])  # which copy won was the file's order
    save_file(weights, directory / "model.safetensors")


def _sparse_norm_gain(directory: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(directory / "model.safetensors")
    weights["transformer.ln_f.weight"] = weights["transformer.ln_f.weight"].to_sparse()
    torch.save(weights, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


def _lfs_shard(directory: Path) -> None:
    from safetensors.torch import load_file

    shard = "model-00001-of-00001.safetensors"
    index = {"weight_map": dict.fromkeys(load_file(directory / "model.safetensors"), shard)}
    (directory / "model.safetensors").unlink()
    (directory / shard).write_text(LFS_POINTER)
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _lfs_torch_bin(directory: Path) -> None:
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_text(LFS_POINTER)


def _without(name: str):
    """The weight ``name`` left out of the checkpoint."""

    def damage(directory: Path) -> None:
        from safetensors.torch import load_file, save_file

        weights = load_file(directory / "model.safetensors")
        del weights[name]
        save_file(weights, directory / "model.safetensors")

    return damage


def _torch_bin_holding(content):
    """The weights replaced by a ``pytorch_model.bin`` holding ``content``."""

    def damage(directory: Path) -> None:
        (directory / "model.safetensors").unlink()
        torch.save(content, directory / "pytorch_model.bin")

    return damage


DAMAGED = {
    "training-checkpoint": (_training_checkpoint, "pytorch_model.bin is not a state dict of named tensors"),
    # tensors that are not a mapping of names (tracebacks without the check)
    "tensor-list": (_torch_bin_holding([torch.zeros(2)]), "pytorch_model.bin is not a state dict of named tensors"),
    "numbered-tensors": (_torch_bin_holding({0: torch.zeros(2)}), "pytorch_model.bin is not a state dict of named "
                                                                  "tensors"),
    "shard-outside": (_shard_outside, "names shard '../outside.safetensors', which is not a file in"),
    "no-weights": (lambda d: (d / "model.safetensors").unlink(),
                   "has no model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
                   "pytorch_model.bin.index.json"),
    "no-weight-map": (_index_without_weight_map, "has no weight_map of tensor names to shard files"),
    # the embedding (tied: the head too) left out, not stored as lm_head.weight either
    "no-embedding": (_without("transformer.wte.weight"), "the checkpoint lacks the weight wte.weight"),
    "shape": (_shorter_positions, "weight wpe.weight has shape (64, 32), the config implies (32, 32)"),
    # same number of elements: read as (in, out) it was another function
    "transposed": (_attention_weight_transposed, "weight h.0.attn.c_attn.weight has shape (96, 32), the config "
                                                 "implies (32, 96)"),
    "safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\x08" + bytes(15)), "is not a valid safetensors"),
    "tokenizer": (lambda d: (d / "tokenizer.json").write_text("{not json"), "is not a valid tokenizer.json"),
    # upcycled before, into a run that every later command refused as damaged
    "non-finite": (_infinite_norm_gain, "hold NaN or infinite values (transformer.ln_f.weight)"),
    # a traceback before ("copy_() between dense and sparse Tensors is not implemented")
    "sparse": (_sparse_norm_gain, "not floating-point numbers (transformer.ln_f.weight: torch.float32, "
                                  "torch.sparse_coo, not dense)"),
    "two-names": (_norm_gain_under_two_names, "holds ln_f.weight both with and without the transformer. prefix"),
    # a clone without Git LFS: "header too large" (or "invalid load key", "not valid JSON") before, with no hint
    "lfs-safetensors": (lambda d: (d / "model.safetensors").write_text(LFS_POINTER),
                        f"model.safetensors {LFS_MESSAGE}"),
    "lfs-shard": (_lfs_shard, f"model-00001-of-00001.safetensors {LFS_MESSAGE}"),
    "lfs-torch-bin": (_lfs_torch_bin, f"pytorch_model.bin {LFS_MESSAGE}"),
    "lfs-tokenizer": (lambda d: (d / "tokenizer.json").write_text(LFS_POINTER), f"tokenizer.json {LFS_MESSAGE}"),
}


@pytest.mark.parametrize("damage,message", DAMAGED.values(), ids=DAMAGED)
def test_damaged_checkpoint_directories_are_refused_in_one_line(damage, message, gpt2_dir, tmp_path):
    """Weights that are not a state dict, a shard index naming a file outside the directory (it is not
    read) or naming no shards, a weight of another shape than the config's, a broken safetensors file or
    tokenizer.json, an infinite weight, a weight stored both with and without GPT-2's prefix."""
    directory = tmp_path / "damaged"
    shutil.copytree(gpt2_dir, directory)
    damage(directory)
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        load_source(directory)
    assert "\n" not in str(e.value)


def _edit_config(source: Path, directory: Path, **changes) -> Path:
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


@pytest.mark.parametrize("which,changes,message", [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}, "RoPE scaling"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 1.5, "rope_theta": 500.0}}, "RoPE scaling"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": True, "rope_theta": 500.0}}, "RoPE scaling"),
    ("llama", {"rope_parameters": None, "rope_theta": 500.0, "rope_scaling": {"type": "dynamic"}}, "rope_scaling"),
    # Both keys: transformers applies the older rope_scaling's llama3 scaling on top of rope_parameters.
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ("llama", {"head_dim": 16}, "head_dim=16"),
    ("llama", {"head_dim": 4}, "head_dim=4 is not hidden_size/num_attention_heads"),  # narrower heads, too
    ("llama", {"head_dim": 0}, "head_dim=0 is not hidden_size/num_attention_heads"),  # not read as "absent"
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
    # null names no activation (transformers 5 refuses the config, 4.x fails on it): it was read as the default
    ("gpt2", {"activation_function": None}, "activation_function=null names no activation"),
    ("llama", {"hidden_act": None}, "hidden_act=null names no activation"),
    # transformers 4.x rotates that share of each head, 5.x all of it: it was converted as if 1 (4.57's logits moved
    # by 0.04 at 0.9; at 0.5 its forward failed)
    ("llama", {"partial_rotary_factor": 0.9}, "partial_rotary_factor=0.9 cannot be converted exactly"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 cannot be converted exactly"),
    ("gpt2", {"model_type": "bert"}, "model_type='bert'"),
    # Llama-like, but with a sliding attention window (and Mistral's own weight names): not converted as a Llama
    ("llama", {"model_type": "mistral"}, "model_type='mistral' cannot be converted"),
    # Fields of the wrong type (tracebacks before):
    ("gpt2", {"activation_function": ["gelu"]}, 'activation_function=["gelu"] must be a string'),
    ("gpt2", {"embd_pdrop": "0.1"}, 'embd_pdrop="0.1" must be a number'),
    # Out of range (the site was left without dropout, silently):
    ("gpt2", {"attn_pdrop": -1}, "attn_pdrop=-1 must be a rate in [0, 1)"),
    ("gpt2", {"resid_pdrop": float("nan")}, "resid_pdrop=NaN must be a rate in [0, 1)"),
    ("gpt2", {"embd_pdrop": 1}, "embd_pdrop=1 must be a rate in [0, 1)"),  # every activation dropped
    ("llama", {"rope_theta": "abc", "rope_parameters": None}, 'rope_theta="abc" must be a number'),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": [1]}}, "rope_theta=[1] must be"),
    ("llama", {"rope_scaling": "linear"}, 'rope_scaling="linear" is not a dict of RoPE parameters'),
    ("llama", {"max_position_embeddings": 10**13}, "block_size=10000000000000 must be an integer in"),
    ("llama", {"head_dim": "16"}, 'head_dim="16" must be an integer'),
    # What gbattn cannot compute exactly, each refused in one line:
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
     "RoPE scaling"),
    # both names of the kind, disagreeing: transformers goes by rope_type (linear scaling), so must the check
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "type": "default", "rope_theta": 500.0}},
     "RoPE scaling"),
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=false cannot be converted exactly (gbattn needs true)"),
    ("gpt2", {"scale_attn_weights": None}, "scale_attn_weights=null cannot be converted exactly"),  # false to HF
    # a flag of another type: said to be one (before: "cannot be converted exactly")
    ("gpt2", {"scale_attn_weights": "yes"}, 'scale_attn_weights="yes" must be true or false'),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true cannot be converted"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=true cannot be converted exactly"),
    # A bool is no number (JSON true would count as 1):
    ("llama", {"rms_norm_eps": True}, "rms_norm_eps=true must be a number"),
    ("gpt2", {"n_layer": True}, "n_layer=True must be a positive integer"),
    ("gpt2", {"n_head": 0}, "n_head=0 must be a positive integer"),
    # a quantization_config naming no method, or not a mapping: quantized all the same (transformers refuses to load it)
    ("llama", {"quantization_config": {"load_in_8bit": True}}, "quantization_config (unknown): a quantized checkpoint"),
    ("llama", {"quantization_config": "bitsandbytes"}, "quantization_config (unknown): a quantized checkpoint"),
    ("llama", {"quantization_config": {}}, "quantization_config (unknown): a quantized checkpoint"),  # empty: still one
])
def test_inexact_conversions_refused_in_one_line(which, changes, message, request, tmp_path):
    directory = _edit_config(request.getfixturevalue(f"{which}_dir"), tmp_path / "edited", **changes)
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        load_source(directory)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes,base", [
    ({"rope_parameters": None, "rope_theta": 500.0, "rope_scaling": {"rope_type": "default"}}, 500.0),
    ({"rope_parameters": None, "rope_theta": 500.0, "rope_scaling": {"type": "default", "factor": 1.0}}, 500.0),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 250.0}, "rope_scaling": None}, 250.0),
    # linear scaling by a factor of 1 divides the positions by 1 (it was refused as RoPE scaling)
    ({"rope_parameters": None, "rope_theta": 500.0, "rope_scaling": {"rope_type": "linear", "factor": 1.0}}, 500.0),
    ({"rope_parameters": {"rope_type": "linear", "factor": 1, "rope_theta": 250.0}, "rope_scaling": None}, 250.0),
    # rope_scaling, when present, replaces rope_parameters whole (gbattn took 500 and 100 before):
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "rope_theta": 100.0,
      "rope_scaling": {"rope_type": "default"}}, 100.0),
    ({"rope_parameters": None, "rope_theta": 100.0, "rope_scaling": {"type": "default", "rope_theta": 700.0}}, 700.0),
    # a base written as a JSON integer (as many released configs write it)
    ({"rope_parameters": None, "rope_theta": 300, "rope_scaling": {"rope_type": "default"}}, 300.0),
])
def test_rope_entries_without_scaling_are_accepted(changes, base, llama_dir, tmp_path, float64_llama):
    """A ``default`` RoPE entry (what older configs write for no scaling) converts, with the base
    transformers 5 takes, and to its logits. transformers 4.x takes the top-level rope_theta alone: where that
    is another base, its model is another one (the test failed under 4.57 for two of these configs)."""
    directory = _edit_config(llama_dir, tmp_path / "edited", **changes)
    source = load_source(directory)
    assert source.model_cfg.rope_base == base
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval().double()
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits
    if TF_MAJOR < 5 and hf.config.rope_theta != base:  # 4.x: another base, so another model than 5.x's
        assert not torch.allclose(logits64(source.build_model(), idx), expected, rtol=1e-6, atol=1e-6)
        return
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)


def test_llama_fields_left_out_take_transformers_defaults(llama_dir, tmp_path, float64_llama):
    """A Llama config.json without tie_word_embeddings, num_key_value_heads, a RoPE base or the other fields below
    means what transformers' LlamaConfig makes of it: an untied head (GPT-2's default is tied), as many key/value
    heads as query heads, a RoPE base of 10000, 2048 positions, eps 1e-6, no dropout, silu and no biases; and
    attention_dropout is the model's (attention-only) dropout rate."""
    directory = save_hf(llama_model(num_key_value_heads=4), tmp_path / "mha")
    config = json.loads((directory / "config.json").read_text())
    del config["tie_word_embeddings"], config["num_key_value_heads"]
    for key in ("rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "rms_norm_eps",
                "attention_dropout", "hidden_act", "attention_bias", "mlp_bias", "head_dim"):
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps(config))
    source = load_source(directory)
    assert not source.model_cfg.tie_embeddings and source.model_cfg.kv_heads == 4
    assert source.model_cfg.n_kv_heads is None  # as many key/value heads as query heads: recorded as gbattn's own runs
    assert source.model_cfg.rope_base == 10000.0
    assert (source.model_cfg.block_size, source.model_cfg.norm_eps, source.model_cfg.dropout) == (2048, 1e-6, 0.0)
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval().double()
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)
    dropout = load_source(_edit_config(llama_dir, tmp_path / "dropout", attention_dropout=0.1)).model_cfg
    assert (dropout.dropout, dropout.dropout_sites) == (0.1, ["attention"])


def test_gpt2_fields_left_out_take_transformers_defaults(gpt2_dir, tmp_path):
    """A GPT-2 config.json without the fields below means what transformers' GPT2Config makes of it (eps 1e-5, a
    tied head, the tanh GELU, a hidden width of 4 * n_embd, scaled attention, 0.1 dropout at every site): the
    converted model's logits are transformers'."""
    directory = shutil.copytree(gpt2_dir, tmp_path / "gpt2")
    config = json.loads((directory / "config.json").read_text())
    for key in ("layer_norm_epsilon", "tie_word_embeddings", "activation_function", "n_inner", "scale_attn_weights",
                "scale_attn_by_inverse_layer_idx", "add_cross_attention", "embd_pdrop", "attn_pdrop", "resid_pdrop"):
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps(config))
    source = load_source(directory)
    assert (source.model_cfg.norm_eps, source.model_cfg.tie_embeddings) == (1e-5, True)
    assert (source.model_cfg.ffn, source.model_cfg.ffn_width, source.model_cfg.dropout) == ("gelu-tanh", 128, 0.1)
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory).eval().double()
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)


def test_missing_or_mismatched_tokenizer_refused(gpt2_dir, tmp_path, monkeypatch):
    """Refused before the weights are read (a large checkpoint's take minutes and its size in memory)."""
    import gbattn.convert

    def read_hf_weights(path):
        raise AssertionError("the weights were read before the tokenizer was checked")

    directory = tmp_path / "copy"
    shutil.copytree(gpt2_dir, directory)
    (directory / "tokenizer.json").unlink()
    monkeypatch.setattr(gbattn.convert, "read_hf_weights", read_hf_weights)
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_source(directory)
    small = HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    small.save(str(directory / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="2 tokens but the model's vocab_size is 50: a padded embedding table"):
        load_source(directory)
    # a larger tokenizer (the model's table is not padded: the tokenizer is another model's)
    large = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(60)}, unk_token="w0"))
    large.save(str(directory / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="60 tokens but the model's vocab_size is 50: ids from 50 on have no "
                                              "embedding row, so the tokenizer is not this model's"):
        load_source(directory)


# --------------------------------------------------------------------------------------
# Upcycling: the same function
# --------------------------------------------------------------------------------------

FUNCTION_PRESERVING = [
    ("boosted", {}),
    ("boosted", {"kv_source": "input", "rounds": 3}),
    ("boosted", {"kv_source": "shared"}),  # the tanh gate, chosen since attn.gate is not set
    ("boosted", {"kv_source": "shared", "gate": "tanh", "rounds": 3}),
    ("boosted", {"gate": "mlp", "layers": [-1]}),
    ("boosted", {"gate": "vector", "rounds": 3}),
    ("boosted", {"gate": "tanh"}),
    ("boosted", {"gate": "none", "kv_source": "input"}),
    ("gated", {}),
    ("gated", {"mode": "headwise"}),
    ("standard", {}),
]


@pytest.mark.parametrize("attn,options", FUNCTION_PRESERVING,
                         ids=[f"{a}-{json.dumps(o, separators=(',', '='))}" for a, o in FUNCTION_PRESERVING])
def test_upcycled_logits_equal_the_source(source_dir, attn, options):
    source = load_source(source_dir)
    up = upcycle(source, attn, options)
    assert up.model_cfg.attn == attn and (up.new > 0) == (attn != "standard")
    # every source parameter copied, a tied one counted once; the rest are new
    assert up.copied == sum(p.numel() for p in source.build_model().parameters())
    assert up.copied + up.new == sum(p.numel() for p in upcycled_model(up).parameters())
    idx = tokens(seed=1)
    torch.testing.assert_close(logits64(upcycled_model(up), idx), logits64(source.build_model(), idx), **EXACT)


def test_the_python_route_of_the_readme_gives_transformers_the_source_logits(gpt2_dir):
    """README, "Upcycling": upcycle() from Python, the GPT it describes, and that GPT behind transformers'
    interface (GbattnForCausalLM.from_gpt) give the source checkpoint's own transformers logits."""
    from gbattn.hf import GbattnForCausalLM

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    for named in ("up = upcycle(SOURCE", "model = gbattn.GPT(up.model_cfg)", "model.load_state_dict(up.state)",
                  "GbattnForCausalLM.from_gpt(model)", "write_run(up, OUT)"):
        assert named in readme, named
    up = upcycle(gpt2_dir, "boosted", {"rounds": 2})
    model = GPT(up.model_cfg)
    model.load_state_dict(up.state)
    wrapped = GbattnForCausalLM.from_gpt(model).double().eval()
    idx = tokens(seed=4)
    with torch.no_grad():
        expected = gpt2_model().double()(idx).logits
        torch.testing.assert_close(wrapped(idx).logits, expected, **EXACT)


def test_a_save_pretrained_of_the_python_route_says_what_gbattn_needs_to_read_it(gpt2_dir, tmp_path, capsys):
    """The README's Python route, ``from_gpt(model)`` then ``save_pretrained``, writes a model without its run (no
    train section, no gbattn tokenizer): gbattn's commands say that, and the way to a directory they read, in one
    line (they said "has no model and train sections: is it a gbattn run directory?", though it has a model)."""
    from gbattn.hf import GbattnForCausalLM

    up = upcycle(gpt2_dir, "boosted")
    model = GPT(up.model_cfg)
    model.load_state_dict(up.state)
    GbattnForCausalLM.from_gpt(model).save_pretrained(tmp_path / "saved")
    capsys.readouterr()  # (transformers' progress bar)
    with pytest.raises(CheckpointError, match=re.escape("from_gpt(model) without run=")):
        rundir.load_run(tmp_path / "saved")
    saved = tmp_path / "saved"
    for argv in (["eval", saved], ["upcycle", saved, "--attn", "gated", "--out", tmp_path / "o"]):
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "a model but no run" in err and "gbattn export" in err, err


def test_shared_without_a_gate_takes_tanh_and_says_so(gpt2_dir):
    up = upcycle(gpt2_dir, "boosted", {"kv_source": "shared"})
    assert up.model_cfg.attn_options["gate"] == "tanh"
    assert any("tanh gate" in note for note in up.notes)


def test_upcycle_leaves_the_callers_source_and_options_as_they_were(gpt2_dir):
    """upcycle() adds the tanh gate to its own copy of the options and its note to its own list: the caller's
    options dict and the Source's notes are left as given, so upcycling the same Source again (another seed, another
    variant) gives one note, not one more each time, and the options can be reused for another source."""
    source = load_source(gpt2_dir)
    options = {"kv_source": "shared"}
    first = upcycle(source, "boosted", options)
    second = upcycle(source, "boosted", options, seed=1)
    assert options == {"kv_source": "shared"} and source.notes == []
    assert len(first.notes) == len(second.notes) == 1 and second.model_cfg.attn_options["gate"] == "tanh"


def test_write_run_checks_what_it_writes(gpt2_dir, tmp_path):
    """An Upcycled whose model_cfg or state the caller changed after upcycle() was written as it was, and the run then
    refused as damaged ("restore a copy of it", of a file just written); an out that is no path was pathlib's
    TypeError. Each is refused before anything is written."""
    import dataclasses

    wrong_heads = upcycle(load_source(gpt2_dir), "boosted")
    wrong_heads.model_cfg.n_heads = 3  # (a field set after construction: checked when written)
    with pytest.raises(ConfigError, match="n_heads=3"):
        write_run(wrong_heads, tmp_path / "heads")
    up = upcycle(load_source(gpt2_dir), "boosted")
    nan = dataclasses.replace(up, state={k: v.clone() for k, v in up.state.items()})
    nan.state["wte.weight"][0, 0] = float("nan")
    with pytest.raises(UserError, match=r"^the weights in the upcycled model hold NaN or infinite values "
                                        r"\(wte.weight\): changed after upcycle\(\) \(write_run writes what upcycle "
                                        r"returns\)$"):
        write_run(nan, tmp_path / "nan")
    wider = dataclasses.replace(up, model_cfg=up.model_cfg.replace(d_model=2 * up.model_cfg.d_model))
    with pytest.raises(UserError, match=r"^the weights in the upcycled model do not match .*: changed after upcycle"):
        write_run(wider, tmp_path / "wider")
    with pytest.raises(TypeError, match="^out of type NoneType: give a run directory"):
        write_run(up, None)
    assert not any((tmp_path / name).exists() for name in ("heads", "nan", "wider"))
    assert rundir.load_run(write_run(up, tmp_path / "fine")).model_cfg == up.model_cfg


def test_layers_option_puts_rounds_only_there(gpt2_dir):
    model = upcycled_model(upcycle(gpt2_dir, "boosted", {"layers": [-1]}))
    assert [len(b.attn.corrections) for b in model.blocks] == [0, 1]


def test_a_source_lacking_a_weight_is_refused(gpt2_dir):
    """A :class:`Source` given to :func:`upcycle` directly that lacks a weight: refused, naming it (it would keep
    its random init, another function)."""
    source = load_source(gpt2_dir)
    del source.state["blocks.1.ln2.bias"]
    with pytest.raises(CheckpointError, match=re.escape("the source lacks blocks.1.ln2.bias")):
        upcycle(source, "boosted")


@pytest.mark.parametrize("rows,message", [
    (40, "weight wte.weight has shape (40, 32), the boosted model's is (50, 32)"),  # else the rest kept a random init
    (60, "weight wte.weight has no place in the boosted model"),  # else a traceback
])
def test_a_source_weight_of_another_shape_is_refused(rows, message, gpt2_dir):
    """A :class:`Source` given to :func:`upcycle` directly whose embedding has fewer or more rows than its config's
    vocabulary: refused, naming it."""
    source = load_source(gpt2_dir)
    wte = source.state["wte.weight"]
    source.state["wte.weight"] = wte[:rows] if rows < len(wte) else torch.cat([wte, wte[: rows - len(wte)]])
    with pytest.raises(CheckpointError, match=re.escape(message)):
        upcycle(source, "boosted")


@pytest.mark.parametrize("key,value", [("blocks.2.ln1.weight", torch.ones(32)), ("wte.weight", torch.zeros(50, 16))],
                         ids=["unknown-name", "other-width"])
def test_a_source_weight_the_new_model_has_no_place_for_is_refused(key, value, gpt2_dir):
    """A :class:`Source` given to :func:`upcycle` directly holding a weight of a layer the model lacks, or a weight of
    another width: refused naming it (without those checks, tracebacks: no such key, a copy that cannot broadcast)."""
    source = load_source(gpt2_dir)
    source.state[key] = value
    with pytest.raises(CheckpointError, match=re.escape(f"weight {key} has no place in the boosted model")):
        upcycle(source, "boosted")


def test_no_correction_round_is_a_copy_and_says_so(gpt2_dir):
    up = upcycle(gpt2_dir, "boosted", {"rounds": 1})
    assert up.new == 0 and up.rule.startswith("a copy: no layer has a correction round")


@pytest.mark.parametrize("options", [{"rounds": 1}, {"layers": []}, {"rounds": 1, "gate": "linear"}])
def test_shared_without_a_correction_round_names_no_gate(gpt2_dir, options):
    """kv_source=shared with no correction round (rounds=1, or no layer): a copy with no gate, so no note of the tanh
    gate (printed before) and no refusal of another gate (there is none to start at 0)."""
    up = upcycle(gpt2_dir, "boosted", {"kv_source": "shared", **options})
    assert up.new == 0 and up.notes == [] and up.rule.startswith("a copy: no layer has a correction round")


def test_the_rule_names_no_gate_where_there_is_none(gpt2_dir):
    """gate=none has no parameters (g_m = 1): the rule said "the none gates at their normal init" before."""
    assert upcycle(gpt2_dir, "boosted", {"gate": "none"}).rule.endswith(
        "W_Q^m and W_K^m at their normal init, no gate (g_m = 1)")
    assert upcycle(gpt2_dir, "boosted", {"gate": "mlp"}).rule.endswith("W_Q^m, W_K^m and the mlp gates at their "
                                                                       "normal init")


def test_the_rule_names_the_parameters_it_zeroed(gpt2_dir):
    """The rule recorded in the run (and printed) names what starts at zero: each kv_source zeroes other parameters."""
    for options, start in (({}, "value rows W_V^m of the correction projections zeroed"),
                           ({"kv_source": "input"}, "value rows W_V^m of the fused input projection zeroed"),
                           ({"kv_source": "shared"}, "tanh gates zeroed (W_g = 0, b = 0")):
        assert upcycle(gpt2_dir, "boosted", options).rule.startswith(start), options


# --------------------------------------------------------------------------------------
# Upcycling: the new parameters learn
# --------------------------------------------------------------------------------------


def new_parameter_grads(model: GPT, attn: str, options: dict) -> dict[str, torch.Tensor]:
    """The gradient of every new parameter group, by name: each correction round's W_Q^m, W_K^m, W_V^m
    rows (and biases) and gate parameters; gated attention's W_theta rows."""
    groups = {}
    for i, block in enumerate(model.blocks):
        a = block.attn
        q, kv = a.q_width, a.kv_width
        if attn == "gated":
            groups[f"{i}.W_theta"] = a.qkv.weight.grad[q + 2 * kv:]
        for m, c in enumerate(getattr(a, "corrections", []), start=1):
            kv_source = options.get("kv_source", "residual")
            groups[f"{i}.{m}.W_Q"] = c.proj.weight.grad[:q]
            if kv_source == "residual":
                groups[f"{i}.{m}.W_K"] = c.proj.weight.grad[q : q + kv]
                groups[f"{i}.{m}.W_V"] = c.proj.weight.grad[q + kv :]
            elif kv_source == "input":
                lo = q + 2 * kv + 2 * kv * (m - 1)
                groups[f"{i}.{m}.W_K"] = a.qkv.weight.grad[lo : lo + kv]
                groups[f"{i}.{m}.W_V"] = a.qkv.weight.grad[lo + kv : lo + 2 * kv]
            for name, p in c.gate.named_parameters():
                groups[f"{i}.{m}.gate.{name}"] = p.grad
    return groups


def backward(model: GPT, seed: int) -> None:
    model.zero_grad()
    idx = tokens(seed=seed, length=18)
    model(idx[:, :-1], idx[:, 1:]).backward()


# (attn, options, the new groups with gradient at the first step: the zeroed factor's partner)
LEARNING = [
    ("boosted", {"kv_source": "residual", "rounds": 3}, ("W_V",)),
    ("boosted", {"kv_source": "residual", "gate": "tanh"}, ("W_V",)),
    ("boosted", {"kv_source": "input", "rounds": 3, "gate": "mlp"}, ("W_V",)),
    ("boosted", {"kv_source": "shared", "gate": "tanh"}, ("gate.",)),
    ("gated", {}, ("W_theta",)),
]


@pytest.mark.parametrize("attn,options,live", LEARNING,
                         ids=[f"{a}-{json.dumps(o, separators=(',', '='))}" for a, o, _ in LEARNING])
def test_new_parameters_get_gradient(gpt2_dir, attn, options, live):
    """First backward: gradient exactly where the rule says (the zeroed factor's partner), none elsewhere
    (those wait for the first step). After one AdamW step and a second backward, every new parameter
    group has gradient: the start is not a dead saddle."""
    model = upcycled_model(upcycle(gpt2_dir, attn, options)).double()
    backward(model, seed=2)
    first = new_parameter_grads(model, attn, options)
    assert first
    for name, grad in first.items():
        expect_live = any(f".{tag}" in name or name.endswith(tag) for tag in live)
        assert (grad.abs().max().item() > 0) == expect_live, f"{name}: gradient {grad.abs().max().item()} at step 1"
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    backward(model, seed=3)
    dead = [name for name, grad in new_parameter_grads(model, attn, options).items() if not grad.abs().max() > 0]
    assert not dead, f"no gradient after one step: {dead}"


# --------------------------------------------------------------------------------------
# Refusals and the command line
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn,sets,message", [
    ("twicing", [], "twicing cannot be upcycled exactly"),
    ("differential", [], "differential attention cannot be upcycled exactly"),
    ("boosted", ["attn.kv_source=shared", "attn.gate=linear"], "--set attn.gate=tanh"),
    ("boosted", ["d_model=64"], "attn.KEY=VALUE"),
    # named like an attention option but without the dot: refused too (read as attn.rounds=3, it was taken silently)
    ("boosted", ["attn_rounds=3"], "--set attn_rounds: upcycle keeps the source's block"),
    ("boosted", ["attn.rounds=0"], "attn.rounds"),
    ("boosted", ["attn.layers=[5]"], "[5] outside the model's 2 layers"),
    # not a variant at all: upcycle's own line, not the registry's, which offers twicing and differential too
    ("bogus", [], "attn='bogus' is not allowed; choose one of boosted, gated, standard"),
])
def test_refusals_are_one_line_exit_2(gbattn_dir, tmp_path, capsys, attn, sets, message):
    argv = ["upcycle", str(gbattn_dir), "--attn", attn, "--out", str(tmp_path / "out")]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out" / rundir.CONFIG).exists()


def test_options_are_refused_before_the_source_is_read(gbattn_dir, tmp_path, capsys, monkeypatch):
    """A bad --set attn.KEY=VALUE is refused before the source's weights are read (minutes for a large checkpoint;
    they were read and converted first), and options given from Python as anything but a dict get the registry's
    line (a ValueError or TypeError from dict() before)."""
    import gbattn.convert

    monkeypatch.setattr(gbattn.convert, "load_source", lambda *a, **k: pytest.fail("read before the options"))
    for sets, message in ((["attn.rounds=0"], "attn.rounds=0 must be an integer in [1, 1024]"),
                          (["attn.kv_sourc=input"], "attention 'boosted' has no option(s) ['kv_sourc']"),
                          (["attn.kv_source=shared", "attn.gate=null"], "attn.gate=None must be a string")):
        argv = ["upcycle", str(gbattn_dir), "--attn", "boosted", "--out", str(tmp_path / "out")]
        assert main([*argv, *(arg for item in sets for arg in ("--set", item))]) == 2
        assert message in capsys.readouterr().err
    for options in ("rounds=3", 3):
        with pytest.raises(ConfigError, match="give the variant's options as a dict"):
            upcycle(gbattn_dir, "boosted", options)


def test_options_are_taken_in_every_spelling_train_takes():
    """`upcycle --set attn_options.rounds=3` (or attn_options={...}) was refused as "not an attention option", while
    `gbattn train` takes all three spellings of one option: each gives the same options now."""
    from gbattn.config import parse_sets
    from gbattn.upcycle import attn_options

    want = {"rounds": 3, "kv_source": "input"}
    for sets in (["attn.rounds=3", "attn.kv_source=input"], ["attn_options.rounds=3", "attn.kv_source=input"],
                 ['attn_options={"rounds": 3, "kv_source": "input"}'],
                 ['attn_options={"rounds": 3, "kv_source": "input"}', "attn.rounds=3"]):
        assert attn_options(parse_sets(sets)) == want, sets
    with pytest.raises(ConfigError, match="^--set attn_optionsx.rounds: upcycle keeps the source's block"):
        attn_options(parse_sets(["attn_optionsx.rounds=3"]))


def test_kv_source_shared_refuses_every_gate_but_tanh(gbattn_dir):
    """Only the tanh gate starts at exactly 0 (W_g = 0, b = 0: tanh(0) = 0); any other (a sigmoid's 0.5, a
    constant, g = 1) would add A_m V_0 to round 0's output from the start, changing the function."""
    from gbattn.attention.boosted import GATE_CLASSES

    for gate in sorted(set(GATE_CLASSES) - {"tanh"}):
        with pytest.raises(UserError, match=re.escape(f"use --set attn.gate=tanh (not {gate!r})")):
            upcycle(gbattn_dir, "boosted", {"kv_source": "shared", "gate": gate})


def test_upcycling_a_non_standard_run_refused(gbattn_dir, tmp_path):
    up_dir = tmp_path / "up"
    assert main(["upcycle", str(gbattn_dir), "--attn", "boosted", "--out", str(up_dir)]) == 0
    with pytest.raises(UserError, match="starts from a standard-attention model"):
        upcycle(up_dir, "gated")


@pytest.mark.parametrize("which", ["gbattn", "gpt2"])
def test_cli_upcycle_then_train_init_from(which, request, tmp_path, capsys, monkeypatch):
    """``gbattn upcycle`` writes a run directory (config, tokenizer, best.pt at step 0; no checkpoint.pt)
    whose model is the source's function, and ``gbattn train --init-from`` continues it for 3 steps."""
    source = request.getfixturevalue(f"{which}_dir")
    up_dir = tmp_path / "up"
    assert main(["upcycle", str(source), "--attn", "boosted", "--set", "attn.rounds=3", "--out", str(up_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "parameters copied" in out[0] and "W_V^m" in out[0]
    assert sorted(p.name for p in up_dir.iterdir() if not p.name.startswith(".")) == [
        "best.pt", "config.json", "tokenizer.json"]
    config = json.loads((up_dir / "config.json").read_text())
    assert config["extra"]["upcycled_from"] == source.name and config["preset"] == (
        "cpu-char" if which == "gbattn" else None)
    run = rundir.load_run(up_dir)
    assert run.step == 0 and run.model_cfg.attn_options == {"rounds": 3}
    idx = torch.randint(0, run.model_cfg.vocab_size, (2, 16))
    torch.testing.assert_close(logits64(run.model, idx), logits64(load_source(source).build_model(), idx), **EXACT)
    # Its last weights do not exist yet: one line saying so (it was "no such file: .../checkpoint.pt").
    with pytest.raises(rundir.CheckpointError, match=r"has no last checkpoint \(checkpoint.pt\), only "
                                                     r"best-validation weights \(best.pt\): an upcycled run"):
        rundir.load_run(up_dir, "last")

    if which == "gpt2":  # trained elsewhere: the run records no corpus of its own
        assert main(["eval", str(up_dir)]) == 2
        assert capsys.readouterr().err.strip() == f"gbattn: error: {up_dir} records no corpus: pass --data (a corpus " \
                                                  f"name, a directory or a text file)"

    train_dir = tmp_path / "train"
    argv = ["train", "--init-from", str(up_dir), "--out", str(train_dir), "--data", "tiny-shakespeare",
            "--threads", "1", "--no-compile", "--set", "max_steps=3", "--set", "batch_size=4",
            "--set", "eval_tokens=2000", "--set", "seq_len=32"]
    assert main([*argv, "--tokenizer", "bogus"]) == 2  # the model's tokenizer is the source's
    assert "--init-from trains with the tokenizer of" in capsys.readouterr().err and not train_dir.exists()
    assert main([*argv, "--set", "parallel=fsdp2"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "parallel=fsdp2 applies under torchrun only" in captured.err  # not silently one process
    # a source without a preset says whose recipe it trains with (it was silent); one with a preset says nothing
    noted = f"note: {up_dir} records no preset: training with paper-small's recipe" in captured.err
    assert noted == (which != "gbattn")
    if which == "gpt2":  # under torchrun, said by the first process alone (every process said it)
        from gbattn import runtime

        with monkeypatch.context() as patched:
            patched.setattr(runtime, "is_first_process", lambda: False)
            assert main([*argv[:4], str(tmp_path / "train-rank1"), *argv[5:]]) == 0
        assert "records no preset" not in capsys.readouterr().err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["attn"] == "boosted"
    trained = json.loads((train_dir / "config.json").read_text())
    assert trained["model"] == config["model"] and trained["train"]["init_from"] == str(up_dir)
    # The recipe is the source's preset's; a Hugging Face source has none and takes paper-small's, which the
    # run records as its preset (README, "Upcycling a trained model"), while --preset is refused: it sets the model.
    recipe = "cpu-char" if which == "gbattn" else "paper-small"
    assert trained["preset"] == recipe
    preset_train = get_preset(recipe).train
    keys = [k for k in ("lr", "warmup_steps", "epochs", "train_tokens", "weight_decay") if k in preset_train]
    assert {k: trained["train"][k] for k in keys} == {k: preset_train[k] for k in keys}
    if which == "gpt2":
        assert main([*argv[:4], str(tmp_path / "other"), *argv[5:], "--preset", "paper-small"]) == 2
        assert "--init-from trains the model of" in capsys.readouterr().err and not (tmp_path / "other").exists()
    # A run killed before its first checkpoint starts again from --init-from, recorded as given: from
    # another working directory a relative path names nothing, and the error says where to resume.
    trained["train"]["init_from"] = "up"
    (train_dir / "config.json").write_text(json.dumps(trained))
    for name in ("checkpoint.pt", "best.pt", "result.json", "metrics.jsonl"):
        (train_dir / name).unlink(missing_ok=True)
    monkeypatch.chdir(train_dir)
    assert main(["train", "--resume", "--out", str(train_dir), "--quiet"]) == 2
    assert "has no checkpoint yet, so it starts again from its --init-from up, which is not a directory from " \
           "here: resume from the directory the run was started in, or restore it if it was moved or deleted" in \
        capsys.readouterr().err
    # recorded as an absolute path, it was moved or deleted (where the run was started does not matter)
    trained["train"]["init_from"] = str(tmp_path / "gone")
    (train_dir / "config.json").write_text(json.dumps(trained))
    assert main(["train", "--resume", "--out", str(train_dir), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"gbattn: error: {train_dir} has no checkpoint yet, so it starts again from its --init-from {tmp_path / 'gone'}"
        f", which is not a directory from here: it was moved or deleted: restore it")


def test_readme_names_what_train_init_from_refuses(gbattn_dir, tmp_path, capsys):
    """README, "Upcycling a trained model": `train --init-from` refuses --attn, --residual and model --set values
    even when they equal the source's, but a --preset or --tokenizer only when it differs from the source's (the
    README said all five were refused). A missing corpus stops an accepted start before any training."""
    up_dir = tmp_path / "up"
    assert main(["upcycle", str(gbattn_dir), "--attn", "boosted", "--out", str(up_dir)]) == 0
    recorded = json.loads((up_dir / "config.json").read_text())
    own = {"--attn": "boosted", "--residual": "plain", "--preset": recorded["preset"],
           "--tokenizer": recorded["train"]["tokenizer"], "--set": "d_model=" + str(recorded["model"]["d_model"])}
    capsys.readouterr()
    refused = []
    for option, value in own.items():
        out = tmp_path / option.strip("-")
        assert main(["train", "--init-from", str(up_dir), "--out", str(out), "--data", str(tmp_path / "none"),
                     option, value]) == 2
        if "--init-from trains" in capsys.readouterr().err:
            refused.append(option)
    assert refused == ["--attn", "--residual", "--set"]
    prose = " ".join(README.read_text(encoding="utf-8").split())
    assert ("`train --init-from` keeps the source's model and tokenizer (`--attn`, `--residual` and model `--set` "
            "values are refused, but for `dropout` and `dropout_sites`, which change no parameter, and so are a "
            "`--preset` or `--tokenizer` other than the source's)") in prose


def test_train_init_from_takes_another_dropout(gbattn_dir, tmp_path, capsys):
    """Fine-tuning often wants another dropout, which changes no parameter: `train --init-from` refused `--set
    dropout` as it refuses a model change. It trains with the dropout given (and its sites), from the source's
    weights; another width is still refused."""
    common = ["--quiet", "--data", "tiny-shakespeare", "--threads", "1", "--no-compile", "--set", "max_steps=1",
              "--set", "batch_size=4", "--set", "eval_tokens=2000", "--set", "seq_len=32"]
    out = tmp_path / "ft"
    assert main(["train", "--init-from", str(gbattn_dir), "--out", str(out), *common, "--set", "dropout=0.25",
                 "--set", "dropout_sites=attention"]) == 0, capsys.readouterr()
    model = rundir.read_config(out / rundir.CONFIG)["model"]
    source = rundir.read_config(gbattn_dir / rundir.CONFIG)["model"]
    assert (model["dropout"], model["dropout_sites"]) == (0.25, ["attention"])
    assert {k: v for k, v in model.items() if k not in ("dropout", "dropout_sites")} == {
        k: v for k, v in source.items() if k not in ("dropout", "dropout_sites")}
    capsys.readouterr()
    assert main(["train", "--init-from", str(gbattn_dir), "--out", str(tmp_path / "wider"), *common, "--set",
                 "dropout=0", "--set", f"d_model={2 * source['d_model']}"]) == 2
    assert "leave out --set d_model (model settings other than dropout and" in capsys.readouterr().err


def test_init_from_starts_at_the_upcycled_weights_with_a_fresh_optimizer(gbattn_dir, tmp_path, monkeypatch):
    """A run started with ``init_from`` an upcycled run takes its first step from exactly those weights (the
    source's function, not a fresh init), with no optimizer state; a model config other than the start's is
    refused."""
    from gbattn.train.trainer import Trainer, train
    from gbattn.upcycle import write_run

    write_run(upcycle(gbattn_dir, "boosted", {"rounds": 2}), tmp_path / "up")
    start = rundir.load_run(tmp_path / "up")
    train_cfg = start.train_cfg.replace(init_from=str(tmp_path / "up"), seq_len=32, compile=False, threads=1)
    seen = {}

    def first_step(self, step):
        seen.update(step=step, state=dict(self.model.state_dict()), moments=len(self.optimizer.state))
        raise RuntimeError("stopped before the first step")

    monkeypatch.setattr(Trainer, "_train_step", first_step)
    with pytest.raises(RuntimeError, match="stopped before the first step"):
        train(tmp_path / "train", start.model_cfg, train_cfg, quiet=True)
    assert seen["step"] == 0 and seen["moments"] == 0
    assert seen["state"].keys() == start.model.state_dict().keys()
    assert all(torch.equal(seen["state"][k], v) for k, v in start.model.state_dict().items())
    other = start.model_cfg.replace(attn="standard", attn_options={})
    with pytest.raises(UserError, match=r"its model config differs from this run's \(other than in dropout and "):
        train(tmp_path / "other", other, train_cfg, quiet=True)
    seen.clear()  # another dropout changes no parameter: it starts from the same weights
    other_dropout = start.model_cfg.replace(dropout=start.model_cfg.dropout + 0.1, dropout_sites=["attention"])
    assert (other_dropout.dropout, other_dropout.dropout_sites) != (start.model_cfg.dropout,
                                                                    start.model_cfg.dropout_sites)
    with pytest.raises(RuntimeError, match="stopped before the first step"):
        train(tmp_path / "dropout", other_dropout, train_cfg, quiet=True)
    assert all(torch.equal(seen["state"][k], v) for k, v in start.model.state_dict().items())


def test_train_init_from_records_which_weights_it_started_from(gbattn_dir, tmp_path, capsys):
    """A run started from another run records in its extra which of that run's weights it took (best, last or
    exported) and their step, as an upcycled run records its source's: it recorded the directory alone, which does not
    say which when the source holds best.pt and a later checkpoint.pt (or goes on training)."""
    source = tmp_path / "source"
    shutil.copytree(gbattn_dir, source)
    best = rundir.load_checkpoint(source / rundir.BEST)
    later = {k: v + 1 for k, v in best["model"].items()}
    rundir.save_checkpoint({"model": later, "step": 9}, source / rundir.CHECKPOINT)
    write_run(upcycle(source, "boosted"), tmp_path / "up")
    common = ["--quiet", "--data", "tiny-shakespeare", "--threads", "1", "--no-compile", "--set", "max_steps=1",
              "--set", "batch_size=4", "--set", "eval_tokens=2000", "--set", "seq_len=32"]
    for start, step in ((source, 7), (tmp_path / "up", 0)):
        out = tmp_path / f"from-{start.name}"
        assert main(["train", "--init-from", str(start), "--out", str(out), *common]) == 0, capsys.readouterr()
        extra = rundir.read_config(out / rundir.CONFIG)["extra"]
        assert extra == {  # (by its last part: result.json holds it)
            "init_from": start.name, "init_from_checkpoint": "best", "init_from_step": step,
            "init_from_weights": rundir.weights_digest(rundir.load_run(start).model.state_dict())}
        assert str(tmp_path) not in (out / rundir.RESULT).read_text()  # (an absolute --init-from was written there)


def test_a_continuation_killed_before_its_first_checkpoint_resumes_only_from_the_weights_it_started_from(
        gbattn_dir, tmp_path, capsys):
    """A `train --init-from` run killed before its first checkpoint starts again from its source when resumed: a
    source that had trained on since (best.pt of a later step) or been trained again (the same step, other values)
    gave it other weights, silently (test ppl 23.10 and 26.02 where the run started would give 26.16). Refused, in
    one line, naming both; the source as it was resumes it."""
    source = tmp_path / "source"
    shutil.copytree(gbattn_dir, source)
    out = tmp_path / "continued"
    argv = ["train", "--init-from", str(source), "--out", str(out), "--quiet", "--data", "tiny-shakespeare",
            "--threads", "1", "--no-compile", "--set", "max_steps=1", "--set", "batch_size=4", "--set",
            "eval_tokens=2000", "--set", "seq_len=32"]
    assert main(argv) == 0, capsys.readouterr()
    finished = rundir.load_checkpoint(out / rundir.CHECKPOINT)["model"]
    for name in (rundir.CHECKPOINT, rundir.BEST, rundir.RESULT, rundir.METRICS):  # as killed before its first save
        (out / name).unlink()
    best = rundir.load_checkpoint(source / rundir.BEST)
    resume = ["train", "--resume", "--out", str(out), "--quiet", "--threads", "1"]
    other_values = {k: v + 1 for k, v in best["model"].items()}
    for changed, recorded in (({**best, "step": best["step"] - 1}, f"step {best['step'] - 1})"),
                              ({**best, "model": other_values}, f"step {best['step']})")):
        rundir.save_checkpoint(changed, source / rundir.BEST)
        assert main(resume) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1:] == [  # (after the warmup note)
            f"gbattn: error: {out} has no checkpoint yet, so it starts again from its --init-from {source}, whose best "
            f"weights ({recorded} are not the ones it started from (best weights of step {best['step']}): restore "
            f"those, or train it again from these with --restart"]
    rundir.save_checkpoint(best, source / rundir.BEST)
    assert main(resume) == 0, capsys.readouterr()
    resumed = rundir.load_checkpoint(out / rundir.CHECKPOINT)["model"]
    assert all(torch.equal(resumed[k], v) for k, v in finished.items())
    # from an export whose weights were saved over since (fine-tuned, say): named as changed, not as its step's
    from safetensors.torch import load_file, save_file

    export, out = tmp_path / "export", tmp_path / "from-export"
    assert main(["export", str(source), "--out", str(export)]) == 0, capsys.readouterr()
    argv[argv.index(str(source))], argv[argv.index(str(tmp_path / "continued"))] = str(export), str(out)
    assert main(argv) == 0, capsys.readouterr()
    for name in (rundir.CHECKPOINT, rundir.BEST, rundir.RESULT, rundir.METRICS):
        (out / name).unlink()
    tensors = load_file(export / "model.safetensors")
    first = sorted(tensors)[0]
    save_file({**tensors, first: tensors[first] + 1}, export / "model.safetensors", metadata={"format": "pt"})
    assert main(["train", "--resume", "--out", str(out), "--quiet", "--threads", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1:] == [
        f"gbattn: error: {out} has no checkpoint yet, so it starts again from its --init-from {export}, whose weights "
        f"changed since their export (step {best['step']}) are not the ones it started from (exported weights of step "
        f"{best['step']}): restore those, or train it again from these with --restart"]


def test_train_init_from_keeps_the_source_runs_data_split(gbattn_dir, tmp_path, capsys):
    """A continuation splits a single-file corpus as its source run did: the preset's split would train on
    text the source held out for validation and test."""
    from gbattn.upcycle import write_run

    source = tmp_path / "source"
    shutil.copytree(gbattn_dir, source)
    config = json.loads((source / rundir.CONFIG).read_text())
    config["train"]["split"] = [0.8, 0.15, 0.05]
    (source / rundir.CONFIG).write_text(json.dumps(config))
    write_run(upcycle(source, "boosted"), tmp_path / "up")
    assert main(["train", "--init-from", str(tmp_path / "up"), "--out", str(tmp_path / "train"), "--quiet",
                 "--data", "tiny-shakespeare", "--threads", "1", "--no-compile", "--set", "max_steps=1",
                 "--set", "batch_size=4", "--set", "eval_tokens=2000", "--set", "seq_len=32"]) == 0, capsys.readouterr()
    assert rundir.read_config(tmp_path / "train" / rundir.CONFIG)["train"]["split"] == [0.8, 0.15, 0.05]


def test_train_init_from_trains_on_the_source_runs_windows(gpt2_dir, tmp_path, capsys):
    """A continuation trains on windows of its source run's seq_len, not its preset's (cpu-char's 64 exceeds
    the block_size of a run trained with block_size=32 seq_len=32); --set seq_len still chooses. An upcycled
    Hugging Face model records no train seq_len (None: block_size - 1), and its continuation keeps that."""
    common = ["--quiet", "--threads", "1", "--no-compile", "--set", "max_steps=1", "--set", "batch_size=4",
              "--set", "eval_tokens=2000"]
    assert main(["train", "--preset", "cpu-char", "--data", "tiny-shakespeare", "--out", str(tmp_path / "source"),
                 *common, "--set", "d_model=32", "--set", "n_layers=1", "--set", "n_heads=2",
                 "--set", "block_size=32", "--set", "seq_len=32"]) == 0, capsys.readouterr()
    for source, sets, seq_len, recorded in (("source", [], 32, 32), ("source", ["--set", "seq_len=16"], 16, 16),
                                            ("up", [], None, 63)):
        if source == "up":
            assert main(["upcycle", str(gpt2_dir), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 0
        out = tmp_path / f"{source}-{seq_len}"
        assert main(["train", "--init-from", str(tmp_path / source), "--out", str(out), "--data", "tiny-shakespeare",
                     *common, *sets]) == 0, capsys.readouterr()
        config = rundir.read_config(out / rundir.CONFIG)
        assert (config["train"]["seq_len"], config["seq_len"]) == (seq_len, recorded)


def test_out_holding_a_run_is_refused(gbattn_dir, tmp_path, capsys, monkeypatch):
    """An --out holding a run, or a run's weights without its config.json, is refused before the conversion (it was
    refused after it: the source was read and converted first), and nothing in it changes."""
    import gbattn.upcycle

    assert main(["upcycle", str(gbattn_dir), "--attn", "gated", "--out", str(tmp_path / "up")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(gbattn.upcycle, "upcycle", lambda *a, **k: pytest.fail("converted before refusing --out"))
    assert main(["upcycle", str(gbattn_dir), "--attn", "gated", "--out", str(tmp_path / "up")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    # Weights without config.json (an upcycle killed before writing config.json, which comes last, or a run killed
    # early) are kept too, and the line says what is there and what to do: it was "already holds a run".
    for name in ("checkpoint.pt", "best.pt"):
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "up" / "best.pt", tmp_path / name / name)
        assert main(["upcycle", str(gbattn_dir), "--attn", "boosted", "--out", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err == (f"gbattn: error: {tmp_path / name} holds {name} but no config.json (written "
                                           f"last): an upcycle or a run stopped before it finished; delete "
                                           f"{tmp_path / name} or choose another --out\n")
        assert (tmp_path / name / name).read_bytes() == (tmp_path / "up" / "best.pt").read_bytes()
    # A config.json that is a directory: refused as a run, before any file is written (it was a traceback, exit 1,
    # after tokenizer.json and best.pt were written beside it).
    (tmp_path / "config-dir" / "config.json").mkdir(parents=True)
    assert main(["upcycle", str(gbattn_dir), "--attn", "gated", "--out", str(tmp_path / "config-dir")]) == 2
    assert capsys.readouterr().err == (f"gbattn: error: {tmp_path / 'config-dir'} already holds a run; choose another "
                                       f"--out\n")
    assert [p.name for p in (tmp_path / "config-dir").iterdir()] == ["config.json"]


def test_write_run_refuses_an_out_that_came_to_hold_a_run(gbattn_dir, tmp_path):
    """write_run checks --out again under its lock (another process may have written a run there since the command
    checked it; the README's Python route calls write_run alone): a run there is refused and left as it was."""
    write_run(upcycle(gbattn_dir, "gated"), tmp_path / "up")
    before = {p.name: p.read_bytes() for p in (tmp_path / "up").iterdir() if not p.name.startswith(".")}
    with pytest.raises(UserError, match="already holds a run; choose another --out"):
        write_run(upcycle(gbattn_dir, "boosted"), tmp_path / "up")
    assert {p.name: p.read_bytes() for p in (tmp_path / "up").iterdir() if not p.name.startswith(".")} == before


def test_out_holding_another_programs_tokenizer_is_refused(gbattn_dir, tmp_path, capsys):
    """An --out holding a tokenizer.json but no config.json (a Hugging Face tokenizer folder, an upcycle stopped after
    writing it) is refused by upcycle, which replaced the file before, and by train --init-from, which kept it as the
    new run's, so that every later command refused the run; the folder stays as it was."""
    folder = tmp_path / "hf-tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
    (folder / "tokenizer_config.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    up_dir = tmp_path / "up"
    assert main(["upcycle", str(gbattn_dir), "--attn", "gated", "--out", str(up_dir)]) == 0
    capsys.readouterr()
    for argv in (["upcycle", str(gbattn_dir), "--attn", "gated", "--out", str(folder)],
                 ["train", "--init-from", str(up_dir), "--out", str(folder), "--threads", "1", "--no-compile",
                  "--set", "max_steps=1", "--set", "seq_len=32", "--quiet"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == (f"gbattn: error: --out {folder} holds tokenizer.json but no config.json: "
                                           f"not a gbattn run's (another program's file, or an upcycle stopped before "
                                           f"it finished), and a new run writes its own; delete it or choose another "
                                           f"--out\n")
        assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != ".lock"} == before


def test_an_upcycle_refused_while_writing_leaves_no_file(gpt2_dir, tmp_path):
    """A source whose run record cannot be written (block_size 1 leaves no input token per row) is refused
    before any file is written: before, tokenizer.json and best.pt were left in --out, and every later try
    with that --out was refused as "already holds a run". (A Hugging Face checkpoint of one position is refused as
    it is read, below; a Source made from Python still reaches write_run.)"""
    from gbattn.config import ModelConfig
    from gbattn.convert import Source
    from gbattn.errors import ConfigError

    cfg = ModelConfig.from_dict(dict(vocab_size=VOCAB, block_size=1, d_model=32, n_layers=1, n_heads=4))
    source = Source(cfg, GPT(cfg).state_dict(), load_source(gpt2_dir).tokenizer, "gbattn", "one-position")
    with pytest.raises(ConfigError, match="block_size=1 leaves no input tokens per row"):
        write_run(upcycle(source, "boosted"), tmp_path / "up")
    assert not (tmp_path / "up").exists()  # (its lock made it, and removed it with nothing written)


@pytest.mark.parametrize("make,key", [(gpt2_model, "n_positions"), (llama_model, "max_position_embeddings")],
                         ids=["gpt2", "llama"])
def test_a_checkpoint_of_one_position_is_refused_naming_it(make, key, tmp_path, capsys):
    """A checkpoint of one position was refused by `gbattn upcycle` with "block_size=1 leaves no input tokens per row
    ...: use block_size >= 2, or --set seq_len=1", advice upcycle itself refuses (it keeps the source's block, and
    --set seq_len is not an attention option); it is refused in one line naming the source and its key now, as the
    config is read, and --out is left unmade."""
    source = save_hf(make(**{key: 1}), tmp_path / "one-position")
    capsys.readouterr()  # (transformers' progress bar)
    assert main(["upcycle", str(source), "--attn", "standard", "--out", str(tmp_path / "up")]) == 2
    assert capsys.readouterr().err == (f"gbattn: error: {source}: {key}=1: a model of one position leaves its upcycled "
                                       f"run no input tokens per row (seq_len = block_size - 1 = 0, and upcycle keeps "
                                       f"the source's block); upcycle a model of 2 positions or more\n")
    assert not (tmp_path / "up").exists()


def test_upcycled_run_records_its_parameters_and_how_it_was_made(gpt2_dir, tmp_path, capsys):
    """config.json counts every parameter of the upcycled model (copied and new) and records the source's kind,
    the rule and the seed of the new parameters (not recorded before: two --seed values gave the same record), and no
    step trained; the command prints the conversion's notes before its summary, which counts the copied and new
    parameters."""
    argv = ["upcycle", gpt2_dir, "--attn", "boosted", "--set", "attn.kv_source=shared", "--out", tmp_path / "up",
            "--seed", "5"]
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "the tanh gate" in out[0] and "parameters copied" in out[1]
    config = rundir.read_config(tmp_path / "up" / rundir.CONFIG)
    up = upcycle(gpt2_dir, "boosted", {"kv_source": "shared"}, seed=5)
    assert config["parameters"] == sum(p.numel() for p in upcycled_model(up).parameters()) > up.copied
    assert f"{up.copied:,} parameters copied, {up.new:,} new; attn=boosted" in out[1] and config["steps"] == 0
    assert config["extra"] == {"upcycled_from": gpt2_dir.name, "source_kind": "gpt2", "rule": up.rule, "seed": 5}
    assert config["train"]["tokenizer"] == "hf"  # its tokenizer.json, which train --init-from then keeps
    written = rundir.load_run(tmp_path / "up").model.state_dict()
    assert all(torch.equal(written[k], v) for k, v in up.state.items())  # the recorded seed remakes the weights


def test_perplexity_of_an_upcycled_llama_scores_the_texts_tokens_as_eval_does(tmp_path):
    """A Llama tokenizer's post-processor puts its start token before a prompt; ``run.perplexity(text)``, scored as
    `gbattn eval` scores a split, scores the text's own tokens, as a split holds them (it scored the start token too:
    one more token predicted and another perplexity than `gbattn eval` gives for the same text)."""
    from tokenizers import processors

    directory = save_hf(llama_model(), tmp_path / "llama")
    vocab = {"<unk>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<unk>", "<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(directory / "tokenizer.json"))
    run = rundir.load_run(write_run(upcycle(directory, "boosted"), tmp_path / "up"))
    assert run.tokenizer.encode("w5 w6 w7 w8") == [1, 5, 6, 7, 8]  # a prompt keeps its start token
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        by_hand = torch.nn.functional.cross_entropy(run.model(ids[:, :-1])[0], ids[0, 1:]).item()
    scored = run.perplexity("w5 w6 w7 w8")
    assert scored.tokens == 3 and scored.loss == pytest.approx(by_hand, rel=1e-6)


def test_sources_that_are_not_what_a_command_wants_get_a_line_that_says_so(gpt2_dir, tmp_path, capsys):
    """A config field of the wrong type, a directory without config.json, and a Hugging Face
    checkpoint (safetensors or pytorch_model.bin) given to a command that wants a gbattn run: each one
    line, exit 2, saying what is wrong and what to do. Before, eval, generate, export and analyze said
    only "has no gbattn section" (or "no model and train sections" for a .bin), and lm-eval loaded the
    checkpoint with the Auto classes and stopped in a traceback."""
    typed = _edit_config(gpt2_dir, tmp_path / "typed", n_embd="32")
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "bin"
    shutil.copytree(gpt2_dir, binary)
    (binary / "model.safetensors").unlink()
    torch.save(gpt2_model().state_dict(), binary / "pytorch_model.bin")
    tasks = Path(__file__).parent / "data" / "lmeval"
    hf_checkpoint = "is a Hugging Face checkpoint (gpt2), not a gbattn run: convert it first with `gbattn upcycle"
    cases = [
        (["upcycle", typed, "--attn", "boosted", "--out", tmp_path / "o1"], "n_embd='32' must be a positive integer"),
        (["upcycle", empty, "--attn", "boosted", "--out", tmp_path / "o2"], "has no config.json: neither a Hugging"),
    ]
    for source in (gpt2_dir, binary):
        cases += [
            (["train", "--init-from", source, "--out", tmp_path / "o3", "--data", "tiny-shakespeare"], hf_checkpoint),
            (["eval", source, "--data", "tiny-shakespeare"], hf_checkpoint),
            (["generate", source, "--prompt", "w1"], hf_checkpoint),
            (["export", source, "--out", tmp_path / "o4"], hf_checkpoint),
            (["analyze", source, "--data", "tiny-shakespeare", "--out", tmp_path / "o5"], hf_checkpoint),
            (["lm-eval", source, "--tasks", "gbattn_toy_mc", "--include-path", tasks, "--output", tmp_path / "o6.json"],
             hf_checkpoint),
        ]
    for argv, message in cases:
        assert main([str(a) for a in argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("lost", ["model", "train"])
def test_a_run_whose_config_lost_a_section_is_called_so(lost, gbattn_dir, tmp_path, capsys):
    """A gbattn run whose config.json lost its train (or model) section was read as a Hugging Face config:
    "model_type=None cannot be converted; gbattn converts ... gbattn run directories". It gets the line every
    command reading a run gives."""
    damaged = tmp_path / "damaged"
    shutil.copytree(gbattn_dir, damaged)
    config = json.loads((damaged / rundir.CONFIG).read_text())
    del config[lost]
    (damaged / rundir.CONFIG).write_text(json.dumps(config))
    assert main(["upcycle", str(damaged), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 2
    assert capsys.readouterr().err == (f"gbattn: error: {damaged / rundir.CONFIG} has no model and train sections: is "
                                       f"it a gbattn run directory?\n")


def test_a_hugging_face_config_with_a_field_named_like_a_run_section_converts(gpt2_dir, tmp_path):
    """A config.json with a model_type is a Hugging Face config even when it holds a field named "train", or fields
    named "model" and "train" (fields transformers keeps as attributes): converted, not called a run that lost its
    model section, nor read as a run."""
    directory = _edit_config(gpt2_dir, tmp_path / "edited", train={"lr": 0.1})
    assert load_source(directory).kind == "gpt2"
    both = _edit_config(gpt2_dir, tmp_path / "both", train={"lr": 0.1}, model={"name": "mine"})  # and "model" too
    assert load_source(both).kind == "gpt2"


def test_an_upcycle_stopped_before_its_config_leaves_nothing_and_runs_again(gbattn_dir, tmp_path, capsys,
                                                                             monkeypatch):
    """Ctrl-C or SIGTERM during an upcycle's writes left tokenizer.json and best.pt without config.json, and the same
    command run again was refused ("holds best.pt but no config.json: ... delete it"), though that process made them.
    A stopped upcycle removes what it wrote, the folder it made too (it was left holding its .lock: the folder was
    made before the lock, which removes only a folder it made; a kill -9 cannot: that line stays for it)."""
    from gbattn import rundir as rundir_mod

    real_write_config = rundir_mod.write_config

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    argv = ["upcycle", str(gbattn_dir), "--attn", "boosted", "--out", str(tmp_path / "up")]
    monkeypatch.setattr(rundir_mod, "write_config", stopped)
    assert main(argv) == 130
    capsys.readouterr()
    assert not (tmp_path / "up").exists()
    (tmp_path / "there").mkdir()  # a folder that was there is kept, empty
    assert main([*argv[:-1], str(tmp_path / "there")]) == 130
    capsys.readouterr()
    assert [p.name for p in (tmp_path / "there").iterdir()] == [".lock"]
    monkeypatch.setattr(rundir_mod, "write_config", real_write_config)
    assert main(argv) == 0, capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "up").iterdir()) == [".lock", "best.pt", "config.json", "tokenizer.json"]


def test_a_source_holding_weights_without_a_config_is_called_an_unfinished_run(gbattn_dir, tmp_path, capsys):
    """A run or an upcycle stopped before writing config.json (written last), given as the source: the line every
    command reading a run gives, not "neither a Hugging Face checkpoint directory nor a gbattn run directory"."""
    stopped = tmp_path / "stopped"
    shutil.copytree(gbattn_dir, stopped)
    (stopped / rundir.CONFIG).unlink()
    assert main(["upcycle", str(stopped), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 2
    assert capsys.readouterr().err == (f"gbattn: error: {stopped} holds best.pt but no config.json (written last): an "
                                       f"upcycle or a run stopped before it finished; {rundir.UNFINISHED_RUN_ADVICE}\n")


def test_a_shard_index_naming_a_weight_no_shard_holds_is_refused(llama_dir, tmp_path):
    """A sharded checkpoint whose index names a tensor that none of its shards holds (a shard from another
    save, a download cut short) is refused, naming the tensor."""
    sharded = tmp_path / "sharded"
    llama_model().save_pretrained(sharded, max_shard_size="20KB")
    shutil.copy(llama_dir / "tokenizer.json", sharded)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape("the shards lack model.layers.9.mlp.up_proj.weight")):
        load_source(sharded)


def test_differing_gpt2_dropout_rates_are_noted(gpt2_dir, tmp_path):
    """GPT-2 has a rate per site, gbattn one rate: the largest is used at every site with a non-zero rate,
    and the conversion says so in a note that the upcycled model keeps; equal rates give no note."""
    directory = _edit_config(gpt2_dir, tmp_path / "edited", embd_pdrop=0.1, attn_pdrop=0.0, resid_pdrop=0.2)
    source = load_source(directory)
    assert source.model_cfg.dropout == 0.2
    assert source.model_cfg.dropout_sites == ["embedding", "attn-output", "ffn-output"]
    assert len(source.notes) == 1 and source.notes[0].startswith("dropout rates differ")
    assert upcycle(source, "boosted").notes == source.notes
    assert load_source(gpt2_dir).notes == []
    zero = load_source(_edit_config(gpt2_dir, tmp_path / "zero", attn_pdrop=0.0))  # one rate, a site without
    assert zero.notes == [] and zero.model_cfg.dropout_sites == ["embedding", "attn-output", "ffn-output"]
    # the largest rate wherever it is (not resid_pdrop's), and a zero resid_pdrop does not turn dropout off
    for rates, largest, sites in (((0.3, 0.1, 0.1), 0.3, ["embedding", "attention", "attn-output", "ffn-output"]),
                                  ((0.1, 0.25, 0.0), 0.25, ["embedding", "attention"])):
        edited = _edit_config(gpt2_dir, tmp_path / f"rates{largest}",
                              **dict(zip(("embd_pdrop", "attn_pdrop", "resid_pdrop"), rates)))
        source = load_source(edited)
        assert (source.model_cfg.dropout, source.model_cfg.dropout_sites) == (largest, sites)


def test_rope_parameters_without_a_base_take_the_top_level_rope_theta(llama_dir, tmp_path, float64_llama):
    """A config with rope_theta at the top level and a rope_parameters entry that names no base (hand-edited,
    or written between transformers versions): transformers uses the top-level base, and so does the
    conversion, so the logits still equal transformers'."""
    directory = _edit_config(llama_dir, tmp_path / "edited", rope_theta=500.0,
                             rope_parameters={"rope_type": "default"})
    source = load_source(directory)
    assert source.model_cfg.rope_base == 500.0
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval().double()
    idx = tokens()
    with torch.no_grad():
        expected = hf(idx).logits
    torch.testing.assert_close(logits64(source.build_model(), idx), expected, rtol=1e-10, atol=1e-10)


def test_upcycle_seed_draws_only_the_new_parameters(gpt2_dir):
    """The same seed gives the same model; another seed other W_Q^m, W_K^m and gates, the same copied
    weights; the caller's random state is left as it was."""
    source = load_source(gpt2_dir)
    a, b, c = (upcycle(source, "boosted", {"rounds": 2}, seed=s).state for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], c[k]) for k in source.state)
    redrawn = [k for k in a if ".corrections." in k and not torch.equal(a[k], c[k])]
    assert redrawn and all(".corrections." in k for k in a if not torch.equal(a[k], c[k]))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    upcycle(source, "boosted", seed=3)
    assert torch.equal(torch.rand(3), expected)
    # the seed as a run's: a numpy integer is that integer (it failed config.json's writing with best.pt written),
    # others are refused before any work (1.5 seeded 1 and was recorded 1.5; "3" was recorded as a string)
    import numpy as np

    numpy_seed = upcycle(source, "boosted", seed=np.int64(3)).seed
    assert numpy_seed == 3 and type(numpy_seed) is int
    for bad in (1.5, "3", True, -1, 2**63):
        with pytest.raises(ConfigError, match=r"^seed="):
            upcycle(source, "boosted", seed=bad)


def test_a_run_upcycled_from_an_export_says_its_data_path_was_cut():
    """A run upcycled from an export records the export's data path, cut to its last part; where that corpus is
    not found, eval and train --init-from said "a relative path is relative to where the run was trained" (it was
    never trained) instead of what they say of the export itself."""
    from gbattn.data.prepare import data_path_cut, recorded_path_advice

    def run(checkpoint: str, extra) -> rundir.LoadedRun:
        return rundir.LoadedRun(Path("up"), None, None, None, None, {"extra": extra}, 0, checkpoint)

    assert data_path_cut(run("exported", {})) and data_path_cut(run("best", {"source_checkpoint": "exported"}))
    assert not data_path_cut(run("best", {"source_checkpoint": "best"})) and not data_path_cut(run("last", None))
    assert "(an export keeps only its last part)" in recorded_path_advice(
        "up", data_path_cut(run("best", {"source_checkpoint": "exported"})))


def test_upcycled_run_keeps_the_source_runs_data_record(gbattn_dir, gpt2_dir, tmp_path):
    """A gbattn source's data record (corpus and fingerprint) is the upcycled run's, so `gbattn eval` of the
    upcycled run still refuses other data; a Hugging Face source records its tokenizer."""
    from gbattn.upcycle import write_run

    source = tmp_path / "source"
    shutil.copytree(gbattn_dir, source)
    config = json.loads((source / rundir.CONFIG).read_text())
    config["data"] = {"corpus": "tiny-shakespeare", "fingerprint": "f" * 64}
    (source / rundir.CONFIG).write_text(json.dumps(config))
    write_run(upcycle(source, "boosted"), tmp_path / "up")
    assert rundir.read_config(tmp_path / "up" / rundir.CONFIG)["data"] == config["data"]
    assert rundir.load_run(tmp_path / "up").data_fingerprint == "f" * 64
    write_run(upcycle(gpt2_dir, "gated"), tmp_path / "hf")
    assert rundir.read_config(tmp_path / "hf" / rundir.CONFIG)["data"] == {
        "tokenizer": load_source(gpt2_dir).tokenizer.fingerprint}


def test_upcycling_a_continuation_records_no_start_of_its_own(gbattn_dir, tmp_path):
    """A gbattn source that was itself continued from another run (train.init_from set): the upcycled run's
    weights are the upcycled ones, so its config records no init_from; the rest of the training config is kept."""
    from gbattn.upcycle import write_run

    source = tmp_path / "continued"
    shutil.copytree(gbattn_dir, source)
    config = json.loads((source / rundir.CONFIG).read_text())
    config["train"]["init_from"] = "runs/base/seed42"
    (source / rundir.CONFIG).write_text(json.dumps(config))
    write_run(upcycle(source, "boosted"), tmp_path / "up")
    recorded = rundir.read_config(tmp_path / "up" / rundir.CONFIG)["train"]
    assert recorded["init_from"] is None
    assert {k: v for k, v in recorded.items() if k != "init_from"} == {
        k: v for k, v in config["train"].items() if k != "init_from"}


def test_weights_gbattn_does_not_convert_are_refused(gpt2_dir, llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    for name, source in (("gpt2", gpt2_dir), ("llama", llama_dir)):
        directory = tmp_path / name
        shutil.copytree(source, directory)
        weights = load_file(directory / "model.safetensors")
        weights["extra.adapter.weight"] = torch.zeros(2, 2)
        save_file(weights, directory / "model.safetensors")
        with pytest.raises(CheckpointError, match=re.escape("holds weights gbattn does not convert "
                                                            "(extra.adapter.weight)")):
            load_source(directory)


def test_many_weights_gbattn_does_not_convert_are_named_five_then_elided(gpt2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = shutil.copytree(gpt2_dir, tmp_path / "gpt2")
    weights = load_file(directory / "model.safetensors")
    weights.update({f"extra.{i}.weight": torch.zeros(2) for i in range(6)})
    save_file(weights, directory / "model.safetensors")
    named = ", ".join(f"extra.{i}.weight" for i in range(5))
    with pytest.raises(CheckpointError, match=re.escape(f"does not convert ({named}, ...)")):
        load_source(directory)


def test_the_summary_names_a_source_once_when_its_folder_is_named_after_its_kind(tmp_path, llama_dir):
    """`upcycled llama into OUT`, not `upcycled llama llama into OUT`; another folder name follows the kind."""
    shutil.copytree(llama_dir, tmp_path / "llama")
    assert upcycle(tmp_path / "llama", "boosted").summary("out").startswith("upcycled llama into out: ")
    assert upcycle(llama_dir, "boosted").summary("out").startswith(f"upcycled llama {Path(llama_dir).name} into out: ")


@pytest.mark.parametrize("given", [".", "./"])
def test_a_source_given_as_the_working_directory_is_recorded_by_its_name(given, gbattn_dir, gpt2_dir, tmp_path, capsys,
                                                                        monkeypatch):
    """`gbattn upcycle . --out ../up` recorded "upcycled_from": "." (and printed "upcycled gbattn . into"), which names
    no source once read from anywhere else: the directory's own name is recorded, as for any other path."""
    for source in (gbattn_dir, gpt2_dir):
        monkeypatch.chdir(source)
        out = tmp_path / f"up-{source.name}-{len(given)}"
        assert main(["upcycle", given, "--attn", "boosted", "--out", str(out)]) == 0
        assert rundir.read_config(out / rundir.CONFIG)["extra"]["upcycled_from"] == source.name
        assert f" {source.name} " in capsys.readouterr().out


def test_a_source_given_as_the_parent_directory_is_recorded_by_its_name(gbattn_dir, tmp_path, monkeypatch):
    """`gbattn upcycle .. --out ...` from a folder inside the source recorded "upcycled_from": "..", as "." was."""
    source = tmp_path / "source"
    shutil.copytree(gbattn_dir, source)
    (source / "notes").mkdir()
    monkeypatch.chdir(source / "notes")
    assert main(["upcycle", "..", "--attn", "boosted", "--out", str(tmp_path / "up")]) == 0
    assert rundir.read_config(tmp_path / "up" / rundir.CONFIG)["extra"]["upcycled_from"] == "source"


def test_upcycling_a_gbattn_run_says_which_weights_it_took(gbattn_dir, tmp_path, capsys):
    """A gbattn run holds best.pt and checkpoint.pt; upcycling takes best.pt (the last weights when there is none).
    The summary and config.json's extra name them and their step (before, neither said which)."""
    assert main(["upcycle", str(gbattn_dir), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 0
    assert f"upcycled gbattn {gbattn_dir.name} (best weights, step 7) into " in capsys.readouterr().out
    extra = rundir.read_config(tmp_path / "up" / rundir.CONFIG)["extra"]
    assert extra["source_checkpoint"] == "best" and extra["source_step"] == 7
    last = tmp_path / "last"
    shutil.copytree(gbattn_dir, last)
    weights = rundir.load_checkpoint(last / rundir.BEST)
    rundir.save_checkpoint({**weights, "step": 9}, last / rundir.CHECKPOINT)
    (last / rundir.BEST).unlink()
    config = json.loads((last / rundir.CONFIG).read_text())
    (last / rundir.CONFIG).write_text(json.dumps({**config, "steps": 9}))  # a 9-step run (a step past it is refused)
    assert main(["upcycle", str(last), "--attn", "gated", "--out", str(tmp_path / "up-last")]) == 0
    assert "upcycled gbattn last (last weights, step 9) into " in capsys.readouterr().out
    extra = rundir.read_config(tmp_path / "up-last" / rundir.CONFIG)["extra"]
    assert extra["source_checkpoint"] == "last" and extra["source_step"] == 9


def test_upcycling_a_run_at_step_0_still_says_which_weights_it_took(gbattn_dir, tmp_path):
    """A source whose weights are at step 0 (a `standard` copy that upcycle wrote, upcycled again): the summary names
    its weights and their step, as for any other gbattn run (a check on the step, not on the weights' name, dropped
    them there)."""
    copy = write_run(upcycle(gbattn_dir, "standard"), tmp_path / "copy")
    up = upcycle(copy, "boosted")
    assert (up.source.checkpoint, up.source.step) == ("best", 0)
    assert up.summary("out").startswith("upcycled gbattn copy (best weights, step 0) into out: ")


def test_upcycle_without_seed_draws_the_new_parameters_as_upcycle_does_and_records_seed_0(gpt2_dir, tmp_path):
    """`gbattn upcycle` without --seed uses upcycle()'s default seed (0), records it, and so writes the weights
    upcycle(SOURCE, attn) gives from Python (the README's route); another default on the command line would give
    other new parameters than the Python route for the same source."""
    assert main(["upcycle", str(gpt2_dir), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 0
    assert rundir.read_config(tmp_path / "up" / rundir.CONFIG)["extra"]["seed"] == 0
    written = rundir.load_run(tmp_path / "up").model.state_dict()
    up = upcycle(gpt2_dir, "boosted")
    assert up.seed == 0 and all(torch.equal(written[k], v) for k, v in up.state.items())


def test_a_run_whose_weights_are_a_git_lfs_pointer_is_refused_in_one_line(gbattn_dir, tmp_path, capsys):
    """A gbattn run directory cloned without Git LFS: best.pt is a pointer; one line saying so, exit 2."""
    run = tmp_path / "run"
    shutil.copytree(gbattn_dir, run)
    (run / rundir.BEST).write_text(LFS_POINTER)
    assert main(["upcycle", str(run), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 2
    err = capsys.readouterr().err
    assert f"best.pt {LFS_MESSAGE}" in err and len(err.strip().splitlines()) == 1, err


def test_a_source_that_is_not_a_directory_is_refused_saying_so(gpt2_dir, tmp_path, capsys):
    """A source path that names no directory (a typo, or a checkpoint's weights file given instead of its folder):
    one line saying what a source must be, not "has no config.json", which reads as if the folder were there."""
    for source in (tmp_path / "missing", gpt2_dir / "model.safetensors"):
        assert main(["upcycle", str(source), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 2
        assert capsys.readouterr().err == (f"gbattn: error: {source} is not a directory (a Hugging Face checkpoint "
                                           f"or a gbattn run directory)\n")


def test_the_summary_names_the_new_variants_options(gpt2_dir):
    """The summary line says which options the new variant was given (none: no parentheses)."""
    assert " 0 new; attn=standard: a copy" in upcycle(gpt2_dir, "standard").summary("out")
    assert " new; attn=boosted (rounds=3, kv_source=\"input\"): value rows" in upcycle(
        gpt2_dir, "boosted", {"rounds": 3, "kv_source": "input"}).summary("out")


def test_write_run_given_anything_but_an_upcycled_model_says_what_it_takes(tmp_path):
    """write_run(SOURCE_PATH, OUT), the source where upcycle's result goes, was "'str' object has no attribute
    'source'" after --out had been made; it is a TypeError naming what it takes, and --out is not made."""
    for given in ("runs/std", tmp_path):
        with pytest.raises(TypeError, match=rf"write_run takes what upcycle\(SOURCE, attn\) returns, not a "
                                            rf"{type(given).__name__}"):
            write_run(given, tmp_path / "up")
    assert not (tmp_path / "up").exists()


def test_a_checkpoints_tokenizer_json_that_is_a_directory_is_named_as_such(gpt2_dir, tmp_path):
    """A Hugging Face checkpoint whose tokenizer.json is a directory (an unpacked archive, a copy gone wrong):
    named as what is there, not as a missing file ("has no tokenizer.json" sends the user to write one)."""
    directory = shutil.copytree(gpt2_dir, tmp_path / "hf")
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer.json").mkdir()
    with pytest.raises(CheckpointError, match=re.escape(f"{directory / 'tokenizer.json'} is a directory, not a "
                                                        f"regular file")):
        load_source(directory)


def test_upcycle_takes_a_loaded_run_and_names_a_source_of_another_type(gbattn_dir):
    """upcycle(gbattn.load_run(DIR), attn), a run a researcher has loaded, was pathlib's "expected str, bytes or
    os.PathLike object, not LoadedRun" from inside load_source: it upcycles that run as upcycle(DIR, attn) does (and
    write_run records the same source); a source of another type (a model) is a TypeError saying what it takes."""
    from_dir = upcycle(gbattn_dir, "boosted", seed=1)
    from_run = upcycle(rundir.load_run(gbattn_dir), "boosted", seed=1)
    assert from_run.model_cfg == from_dir.model_cfg and from_run.summary("out") == from_dir.summary("out")
    assert from_run.state.keys() == from_dir.state.keys()
    assert all(torch.equal(from_run.state[k], from_dir.state[k]) for k in from_dir.state)
    fields = ("kind", "name", "preset", "train_cfg", "config", "checkpoint", "step", "notes")
    assert [getattr(from_run.source, f) for f in fields] == [getattr(from_dir.source, f) for f in fields]
    assert from_run.source.tokenizer.fingerprint == from_dir.source.tokenizer.fingerprint
    assert (from_run.source.preset, from_run.source.step, from_run.source.checkpoint) == ("cpu-char", 7, "best")
    with pytest.raises(TypeError, match=r"^a source of type GPT: give a directory \(a gbattn run or a Hugging Face "
                                        r"checkpoint\), a loaded run \(gbattn.load_run\) or a Source$"):
        upcycle(from_run.source.build_model(), "boosted")


def test_the_conversion_a_hugging_face_checkpoint_is_told_to_run_quotes_its_path(tmp_path):
    """`gbattn upcycle my model --attn ...`, suggested for a checkpoint in `my model`, failed when pasted
    ("unrecognized arguments"): the path is quoted as a shell reads it back."""
    from gbattn.rundir import refuse_hf_checkpoint

    with pytest.raises(UserError, match=r"convert it first with `gbattn upcycle '.*/my model' --attn standard "):
        refuse_hf_checkpoint({"model_type": "gpt2"}, tmp_path / "my model")
