"""The Hugging Face integration (gbattn.hf): config names, logits and loss equal to gbattn's for every
variant and layout, generate() parity with gbattn's own decoding, the cache, initialisation, export
and the Auto classes, Trainer, and lm-evaluation-harness on local tasks. Offline, CPU, tiny models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from gbattn import rundir
from gbattn.cli import main as cli_main
from gbattn.data.corpus import load_corpus
from gbattn.data.tokenizer import Tokenizer, get_tokenizer
from gbattn.hf import GbattnCache, GbattnConfig, GbattnForCausalLM, hf_tokenizer
from gbattn.hf.modeling import CACHE_FIELD, INIT_TYPES, init_module
from gbattn.model.gpt import GPT
from gbattn.runtime import software_versions
from gbattn.train.trainer import train
from helpers import LFS_POINTER, hold_lock, in_use, left_pad, run_cli, strict_json, tiny_configs, write_corpus
from test_model import BLOCKS, tiny_config

ROOT = Path(__file__).resolve().parents[1]
LMEVAL_DATA = ROOT / "tests" / "data" / "lmeval"

# Block layouts: residual stream x norm placement x block style (attnres is Pre-LN only).
ATTNRES = dict(residual="attnres-block", attnres_block=3)
LAYOUTS = {
    "gpt2-pre": {},
    "gpt2-post": dict(norm="post"),
    "gpt2-attnres": ATTNRES,
    "llama-pre": BLOCKS["llama"],
    "llama-post": dict(BLOCKS["llama"], norm="post"),
    "llama-attnres": dict(BLOCKS["llama"], **ATTNRES),
}
# The llama layouts are Llama blocks with grouped-query attention (RMSNorm, SwiGLU, RoPE, no biases, fewer key/value
# heads than query heads): every test over LAYOUTS or BLOCKS["llama"] runs a GQA model through the wrapper.
assert BLOCKS["llama"]["n_kv_heads"] < tiny_config(("standard", {}), **BLOCKS["llama"]).n_heads, BLOCKS["llama"]


pytestmark = pytest.mark.usefixtures("one_thread")


def without_standard_names(config: dict) -> dict:
    """An exported config.json without the standard names it mirrors its gbattn model dict in (an edit of the dict
    then reaches the model, as a file exported before the mirrors does)."""
    return {k: v for k, v in config.items() if k not in rundir.STANDARD_FIELDS}


def tiny_pair(variant_case, layout: dict, seed: int = 0):
    """(gbattn GPT, the wrapper sharing its weights), float64, weights scaled so attention is far from uniform."""
    torch.manual_seed(seed)
    gpt = GPT(tiny_config(variant_case, **layout)).double()
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if p.dim() > 1:
                p.mul_(8.0)
            elif name.endswith("queries"):  # AttnRes pseudo-queries start at 0: give the depth mixing a shape
                p.normal_(0.0, 1.0)
    gpt.eval()
    return gpt, GbattnForCausalLM.from_gpt(gpt).eval()


# ---- import hygiene and the config ---------------------------------------------------


def test_bare_import_does_not_import_transformers():
    code = "import sys, gbattn, gbattn.rundir; gbattn.load_run; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_of_gbattn_hf_without_transformers_names_the_extra():
    """Without transformers, `import gbattn.hf` says which extra installs it (it was a bare "No module named
    'transformers'"; the extra that sounds right, [hf], installs datasets), still as a ModuleNotFoundError."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import gbattn.hf\nexcept ModuleNotFoundError as e:\n    print(e.name, '|', e)")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True).stdout
    assert out.strip() == ("transformers | gbattn.hf needs transformers, which is not installed: pip install "
                           "'gbattn[transformers]'")


def test_config_standard_names_map_both_ways(tmp_path):
    cfg = GbattnConfig.from_model_config(tiny_config(("boosted", {}), n_kv_heads=2), run={"step": 7})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (16, 2, 4)
    assert (cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.vocab_size) == (2, 24, 37)
    assert cfg.tie_word_embeddings is True and cfg.model_type == "gbattn"
    cfg.vocab_size, cfg.num_key_value_heads, cfg.hidden_size = 40, 4, 32  # as resize_token_embeddings does
    assert cfg.gbattn["model"]["vocab_size"] == 40 and cfg.gbattn["model"]["n_kv_heads"] == 4
    assert (cfg.model_config.d_model, cfg.model_config.n_kv_heads, cfg.model_config.vocab_size) == (32, 4, 40)
    assert GbattnConfig(gbattn={"model": {"n_heads": 4}}).num_key_value_heads == 4  # n_kv_heads None -> n_heads
    made = GbattnConfig(hidden_size=64, num_attention_heads=8, tie_word_embeddings=False)
    assert made.model_config.d_model == 64 and made.model_config.n_heads == 8 and not made.model_config.tie_embeddings
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "gbattn" and saved["gbattn"]["step"] == 7
    # the standard names beside the dict, for tools that read config.json itself (no rope_theta without RoPE); each
    # version of transformers writes all of them (4.x left out tie_word_embeddings=True, its default)
    assert {k: saved.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                      "max_position_embeddings", "vocab_size", "tie_word_embeddings")} == dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=24,
        vocab_size=40, tie_word_embeddings=True) and "rope_theta" not in saved
    back = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(back, GbattnConfig) and back.gbattn == cfg.gbattn and back.vocab_size == 40
    # n_kv_heads left None (one K/V head per query head) stays None through config.json, whose mirror
    # num_key_value_heads says 4: the mirrors are read as a check, never as fields
    unset = GbattnConfig.from_model_config(tiny_config(("boosted", {})))
    unset.save_pretrained(tmp_path / "unset")
    assert json.loads((tmp_path / "unset" / "config.json").read_text())["num_key_value_heads"] == 4
    assert AutoConfig.from_pretrained(tmp_path / "unset").gbattn == unset.gbattn
    assert AutoConfig.from_pretrained(tmp_path, num_attention_heads=8).model_config.n_heads == 8
    with pytest.raises(ValueError, match=r"GbattnConfig\(dropout=0.5\): gbattn's model fields"):  # was dropped unused
        AutoConfig.from_pretrained(tmp_path, dropout=0.5)
    saved["dropout"] = 0.0  # saved by a gbattn that let `config.dropout = 0.0` set an attribute nothing read
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"holds gbattn's model field names at its top level \(\{'dropout': 0.0\}\)"):
        AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        GbattnConfig(gbattn={"model": {"d_model": 30, "n_heads": 4}})


def test_rope_theta_is_the_standard_name_of_rope_base(tmp_path):
    """GbattnConfig(rope_theta=...), Llama's name for the RoPE base, was kept as an attribute that nothing read: the
    model was built with rope_base=10000, and the saved config.json held both, disagreeing."""
    cfg = GbattnConfig.from_model_config(tiny_config(("boosted", {}), **BLOCKS["llama"]), rope_theta=500000.0)
    assert cfg.rope_theta == 500000.0 and cfg.model_config.rope_base == 500000.0
    assert GbattnForCausalLM(cfg).model.cfg.rope_base == 500000.0
    cfg.rope_theta = 1000.0
    assert cfg.gbattn["model"]["rope_base"] == 1000.0
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 1000.0 and AutoConfig.from_pretrained(tmp_path).model_config.rope_base == 1000.0
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_theta": 2.0}))
    with pytest.raises(ValueError, match=r"rope_theta=2.0 at its top level disagrees with rope_base=1000.0"):
        AutoConfig.from_pretrained(tmp_path)


def test_readme_names_every_refusal_of_the_wrapper():
    """The README's list of what the wrapper does not do names each of its one-line refusals (labels with
    logits_to_keep, a 4.x chunked prefill of a padded batch and gbattn's field names in GbattnConfig were not)."""
    prose = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    listed = prose[prose.index("What the wrapper does not do"):].split("**The exported tokenizer.**")[0]
    for refused in ("output_attentions",
                    "`GbattnCache`", "early-exit decoding", "`labels` with `logits_to_keep`", "`prefill_chunk_size`",
                    "`GbattnConfig` keywords or attributes", "`cache_implementation`"):
        assert refused in listed, refused


@pytest.mark.parametrize("keywords, match", [
    (dict(intermediate_size=1024), r"^GbattnConfig\(intermediate_size=1024\) is another model's name, which gbattn "
                                   r"does not read: gbattn's model field for it is ffn_hidden: "
                                   r"GbattnConfig\(gbattn=\{'model': \{'ffn_hidden': \.\.\.\}\}\)$"),
    (dict(n_embd=64, rms_norm_eps=1e-6),
     r"^GbattnConfig\(n_embd=64\) is another model's name, .*: use hidden_size=\.\.\.$"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"rope_scaling=.*: gbattn has no such setting"),
])
def test_config_refuses_other_models_names_for_its_fields(keywords, match):
    """Llama's or GPT-2's names for a setting (intermediate_size, n_embd, rope_scaling, ...) were kept as attributes
    nothing reads: a model of another width or without the RoPE scaling asked for was built, silently. The error
    names the standard name or gbattn field that holds it; a config saved and loaded again is untouched."""
    with pytest.raises(ValueError, match=match):
        GbattnConfig(**keywords)


# Every other model's name GbattnConfig refuses, and what its message points to instead (written out here, apart
# from configuration.OTHER_MODELS_NAMES: an entry dropped from that table was accepted and read by nothing).
OTHER_NAMES_POINT_TO = {
    "n_embd": "use hidden_size=", "n_layer": "use num_hidden_layers=", "n_head": "use num_attention_heads=",
    "n_positions": "use max_position_embeddings=", "intermediate_size": "field for it is ffn_hidden",
    "n_inner": "field for it is ffn_hidden", "hidden_act": "field for it is ffn",
    "activation_function": "field for it is ffn", "rms_norm_eps": "field for it is norm_eps",
    "layer_norm_eps": "field for it is norm_eps", "layer_norm_epsilon": "field for it is norm_eps",
    "attention_dropout": "field for it is dropout", "hidden_dropout": "field for it is dropout",
    "hidden_dropout_prob": "field for it is dropout", "attention_probs_dropout_prob": "field for it is dropout",
    "resid_pdrop": "field for it is dropout", "embd_pdrop": "field for it is dropout",
    "attn_pdrop": "field for it is dropout", "attention_bias": "field for it is bias",
    "mlp_bias": "field for it is bias", "head_dim": "gbattn has no such setting",
    "rope_scaling": "gbattn has no such setting",
}


@pytest.mark.parametrize("name", sorted(OTHER_NAMES_POINT_TO))
def test_config_refuses_each_other_models_name_and_points_to_ours(name):
    with pytest.raises(ValueError) as refused:
        GbattnConfig(**{name: 8})
    message = str(refused.value)
    assert message.startswith(f"GbattnConfig({name}=8) is another model's name")
    points_to = OTHER_NAMES_POINT_TO[name]
    assert points_to + ("..." if points_to.startswith("use") else ":" if "field" in points_to else " ") in message


def test_config_checks_what_it_is_given_and_copies_it():
    """Standard names given as keywords are validated like gbattn's own fields; a section that is not
    gbattn's config.json content is a clear error; the caller's dict is copied, not shared."""
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        GbattnConfig(hidden_size=30, num_attention_heads=4)
    for bad in ("model", {"model": [16]}):
        with pytest.raises(ValueError, match="takes gbattn's config.json content: a dict with a model dict"):
            GbattnConfig(gbattn=bad)
    # gbattn's own field names as keywords were set as plain attributes, ignored (a default 256-wide standard-attention
    # model was built) and written to config.json beside the gbattn dict
    with pytest.raises(ValueError, match=r"GbattnConfig\(attn='boosted', d_model=64\): gbattn's model fields go in "
                                         r"its model dict, GbattnConfig\(gbattn=\{'model': \{'attn': 'boosted', "
                                         r"'d_model': 64"):
        GbattnConfig(d_model=64, attn="boosted", hidden_size=64)
    with pytest.raises(ValueError, match=r"GbattnConfig\(n_layers=1\)"):
        AutoConfig.for_model("gbattn", n_layers=1)
    # ... and as attributes (HF's `model.config.dropout = 0.0`): a plain attribute nothing read, which save_pretrained
    # wrote beside the gbattn dict, where from_pretrained then refused the saved model
    cfg = GbattnConfig(gbattn={"model": {"n_heads": 4}})
    with pytest.raises(ValueError, match=r"^config.dropout = 0.0: gbattn's model fields are in its model dict, "
                                         r"config.gbattn\['model'\]\['dropout'\]"):
        cfg.dropout = 0.0
    assert "dropout" not in cfg.to_dict() and cfg.model_config.dropout == 0.1  # ModelConfig's default
    cfg.gbattn["model"]["dropout"], cfg.num_attention_heads = 0.0, 2  # the model dict, and a standard name
    assert cfg.model_config.dropout == 0.0 and cfg.model_config.n_heads == 2
    assert GbattnConfig(vocab_size=40).model_config.vocab_size == 40  # a standard name that is also gbattn's
    assert GbattnConfig(use_cache=False).use_cache is False and GbattnConfig().use_cache is True  # generate()'s default
    section = {"model": {"n_heads": 4}, "train": {"lr": 0.001}}
    GbattnConfig(gbattn=section).gbattn["train"]["lr"] = 0.5
    assert section == {"model": {"n_heads": 4}, "train": {"lr": 0.001}}


def test_a_saved_config_needs_its_whole_gbattn_model_dict(tmp_path):
    """from_pretrained reads a saved gbattn model dict as gbattn does: a missing field it always records, or a
    missing gbattn dict, is refused (they were defaults: 2-head weights loaded silently as 4 heads, a config
    without its gbattn dict as a 256-wide model); a field added later keeps its old meaning."""
    torch.manual_seed(0)
    model = GbattnForCausalLM(GbattnConfig.from_model_config(tiny_config(("standard", {}), n_heads=2)))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())

    def load_edited(edit):
        config = json.loads(json.dumps(saved))
        edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
        return AutoModelForCausalLM.from_pretrained(tmp_path)

    with pytest.raises(ValueError, match=r"config.json \(gbattn\): its model section has no n_heads \(every gbattn"):
        load_edited(lambda c: c["gbattn"]["model"].pop("n_heads"))
    for edit in (lambda c: c.pop("gbattn"), lambda c: c["gbattn"].pop("model"),
                 lambda c: c["gbattn"].update(model=[2])):
        with pytest.raises(ValueError, match="the config has no gbattn model dict"):
            load_edited(edit)
    with pytest.raises(ValueError, match="config.json \\(gbattn\\): n_heads='2' must be an integer"):
        load_edited(lambda c: c["gbattn"]["model"].update(n_heads="2"))
    before = load_edited(lambda c: c["gbattn"]["model"].pop("dropout_sites"))  # saved before dropout_sites existed
    assert before.config.model_config.dropout_sites == ["embedding", "attention", "attn-output", "ffn-output"]
    assert before.model.cfg.n_heads == 2


# ---- forward: logits, loss, cache, padding equal gbattn's ---------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_loss_equal_gbattn(variant_case, layout):
    """float64: full logits, the shifted loss, cached prefill + decode, and a left-padded batch all
    equal gbattn's own forward, for every variant, residual stream, norm placement and block style."""
    gpt, hf = tiny_pair(variant_case, LAYOUTS[layout])
    idx = torch.randint(0, 37, (2, 11))
    full = gpt(idx)
    torch.testing.assert_close(hf(idx).logits, full, rtol=1e-10, atol=1e-10)
    labels = idx.clone()
    labels[0, :3] = -100
    torch.testing.assert_close(hf(idx, labels=labels).loss, gpt(idx[:, :-1], labels[:, 1:]), rtol=1e-10, atol=1e-12)
    # cached: prefill 4 tokens, then one token at a time, through the cache object
    out = hf(idx[:, :4], use_cache=True)
    cache, steps = getattr(out, CACHE_FIELD), [out.logits]
    assert isinstance(cache, GbattnCache) and cache.get_seq_length() == 4
    for t in range(4, idx.shape[1]):
        out = hf(idx[:, t:t + 1], cache=cache)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    # left padding: each row's logits are those of the row alone
    rows = [idx[0, :9], idx[1, :5]]
    ids, mask = left_pad(rows, torch.long)
    padded = hf(ids, attention_mask=mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(padded[i, ids.shape[1] - len(row):], gpt(row[None])[0], rtol=1e-10, atol=1e-10)
    # ... and called directly (no generate(): positions from the mask), a cached step after a padded prefill
    prefill = hf(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
    step = hf(ids[:, -1:], attention_mask=mask, cache=getattr(prefill, CACHE_FIELD)).logits
    torch.testing.assert_close(step[:, -1], padded[:, -1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hidden_states_are_each_blocks_input_then_what_the_head_reads(layout):
    """output_hidden_states (by argument or config): n_layers + 1 tensors as transformers' models give them, each
    block's input (caught by a hook on the block, or with Attention Residuals on the norm its attention sublayer
    applies to the depth mixture), then the final norm's output, from which the head's logits come; a cached
    decoding step gives the same states for its token as the full forward; the tuple output holds them too."""
    gpt, hf = tiny_pair(("boosted", {}), LAYOUTS[layout])
    idx = torch.randint(0, 37, (2, 9))
    caught = []
    attnres = "residual" in LAYOUTS[layout]
    hooks = [(block.ln1 if attnres else block).register_forward_pre_hook(lambda m, a: caught.append(a[0]))
             for block in gpt.blocks]
    out = hf(idx, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    states = out.hidden_states
    assert len(states) == gpt.cfg.n_layers + 1 and len(caught) == gpt.cfg.n_layers
    for state, expected in zip(states, caught):
        torch.testing.assert_close(state, expected, rtol=0, atol=0)
    torch.testing.assert_close(gpt.lm_head(states[-1]), out.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, gpt(idx), rtol=1e-10, atol=1e-10)
    assert hf(idx).hidden_states is None and hf(idx, return_dict=False)[-1] is not None
    hf.config.output_hidden_states = True
    cache = getattr(hf(idx[:, :-1]), CACHE_FIELD)
    step = hf(idx[:, -1:], cache=cache).hidden_states
    hf.config.output_hidden_states = False
    for state, full in zip(step, states, strict=True):
        torch.testing.assert_close(state, full[:, -1:], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_inputs_embeds_are_the_token_embeddings_in_place_of_the_ids(layout):
    """inputs_embeds = the embedding of input_ids gives the same logits, loss, hidden states and cached steps, with
    left padding too, and generate(inputs_embeds=...) the new tokens generate(input_ids) gives; a soft prompt
    (embeddings no token has) gets a gradient, as prompt tuning and saliency maps need."""
    gpt, hf = tiny_pair(("boosted", {}), LAYOUTS[layout])
    idx = torch.randint(0, 37, (2, 9))
    embeds = gpt.wte(idx).detach()
    by_ids, by_embeds = hf(idx, labels=idx, output_hidden_states=True), hf(inputs_embeds=embeds, labels=idx,
                                                                         output_hidden_states=True)
    torch.testing.assert_close(by_embeds.logits, by_ids.logits, rtol=0, atol=0)
    torch.testing.assert_close(by_embeds.loss, by_ids.loss, rtol=0, atol=0)
    for a, b in zip(by_embeds.hidden_states, by_ids.hidden_states, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    prefill = hf(inputs_embeds=embeds[:, :-1], use_cache=True)  # a prompt of embeddings, then ids through the cache
    step = hf(idx[:, -1:], cache=getattr(prefill, CACHE_FIELD)).logits
    torch.testing.assert_close(step[:, -1], by_ids.logits[:, -1], rtol=1e-10, atol=1e-10)
    ids, mask = left_pad([idx[0], idx[1, :5]], torch.long)
    torch.testing.assert_close(hf(inputs_embeds=gpt.wte(ids).detach(), attention_mask=mask).logits,
                               hf(ids, attention_mask=mask).logits, rtol=0, atol=0)
    new = hf.generate(inputs_embeds=gpt.wte(ids).detach(), attention_mask=mask, max_new_tokens=4, do_sample=False,
                      pad_token_id=0)
    whole = hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(new, whole[:, ids.shape[1]:])
    # a one-token prompt: transformers 4.x fed its embedding again at every later step (a stock Llama's too); under
    # 4.x it is refused in one line, under 5 it gives the ids' tokens
    from gbattn.hf.modeling import TF_MAJOR
    one = idx[:, :1]
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    if TF_MAJOR >= 5:
        new = hf.generate(inputs_embeds=gpt.wte(one).detach(), **greedy)
        assert torch.equal(new, hf.generate(one, **greedy)[:, 1:])
    else:
        with pytest.raises(ValueError, match=r"^transformers 4.x's generate\(\) feeds a one-token inputs_embeds "):
            hf.generate(inputs_embeds=gpt.wte(one).detach(), **greedy)
    soft_prompt = torch.randn(1, 3, gpt.cfg.d_model, dtype=torch.float64, requires_grad=True)
    hf(inputs_embeds=torch.cat([soft_prompt.expand(2, -1, -1), embeds], 1)).logits[:, -1].sum().backward()
    assert soft_prompt.grad is not None and bool(soft_prompt.grad.abs().sum() > 0)
    block = gpt.cfg.block_size
    with pytest.raises(ValueError, match=rf"^a prompt of {block} tokens and max_new_tokens=3 feed the model"):
        hf.generate(inputs_embeds=torch.zeros(1, block, gpt.cfg.d_model, dtype=torch.float64), max_new_tokens=3)


def frozen(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not p.requires_grad]


@pytest.mark.parametrize("layout", ["gpt2-post", "llama-attnres"])
def test_the_base_model_gives_what_the_causal_lm_reads_and_keeps_its_checks(layout, tmp_path):
    """GbattnModel (AutoModel): last_hidden_state is the causal LM's last hidden state, through a left-padded batch
    and a cached step; cache_position gives its positions as the causal LM's does (the base model dropped it); it
    saves and loads as the causal LM does (the same weight names, so each loads the other's save), and refuses what
    the causal LM refuses, naming itself."""
    from gbattn.hf import GbattnModel

    gpt, hf = tiny_pair(("boosted", {"rounds": 3}), LAYOUTS[layout])
    base = GbattnModel.from_gpt(gpt).eval()
    idx = torch.randint(0, 37, (2, 9))
    ids, mask = left_pad([idx[0], idx[1, :5]], torch.long)
    full = hf(ids, attention_mask=mask, output_hidden_states=True)
    out = base(ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(out.last_hidden_state, full.hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(gpt.lm_head(out.last_hidden_state), full.logits, rtol=0, atol=0)
    assert len(out.hidden_states) == gpt.cfg.n_layers + 1
    # cache_position gives the positions as in the causal LM (it was dropped: positions 0..8)
    torch.testing.assert_close(base(idx, cache_position=torch.arange(2, 11)).last_hidden_state,
                               base(idx, position_ids=torch.arange(2, 11)[None]).last_hidden_state, rtol=0, atol=0)
    assert not torch.equal(base(idx, cache_position=torch.arange(2, 11)).last_hidden_state, base(idx).last_hidden_state)
    prefill = base(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
    step = base(ids[:, -1:], attention_mask=mask, cache=getattr(prefill, CACHE_FIELD)).last_hidden_state
    torch.testing.assert_close(step[:, -1], out.last_hidden_state[:, -1], rtol=1e-10, atol=1e-10)
    # the cache by its other keyword (4.x's only one): used, not dropped for a new one
    prefill = base(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
    cache = getattr(prefill, CACHE_FIELD)
    step = base(ids[:, -1:], attention_mask=mask, past_key_values=cache).last_hidden_state
    torch.testing.assert_close(step[:, -1], out.last_hidden_state[:, -1], rtol=1e-10, atol=1e-10)
    assert cache.get_seq_length() == ids.shape[1]
    base.save_pretrained(tmp_path / "base")
    hf.save_pretrained(tmp_path / "lm")
    head_input = hf(idx, output_hidden_states=True).hidden_states[-1]
    for saved in ("base", "lm"):
        again = AutoModel.from_pretrained(tmp_path / saved, dtype=torch.float64).eval()
        lm = AutoModelForCausalLM.from_pretrained(tmp_path / saved, dtype=torch.float64).eval()
        assert type(again) is GbattnModel and type(lm) is GbattnForCausalLM
        # the weights gbattn never trains stay frozen (transformers 5 loaded AttnRes's first norm trainable)
        for loaded in (again, lm):
            assert frozen(loaded) == frozen(hf) == (["model.residual.norms.0.weight"] if "attnres" in layout else [])
        torch.testing.assert_close(again(idx).last_hidden_state, head_input, rtol=0, atol=0)
        torch.testing.assert_close(lm(idx).logits, hf(idx).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^GbattnModel takes input_ids or inputs_embeds, one of the two"):
        base()
    with pytest.raises(ValueError, match=r"^GbattnModel returns no attention maps"):
        base(idx, output_attentions=True)


def test_peft_lora_and_prompt_tuning_adapt_a_gbattn_model():
    """PEFT as its users call it (tested: peft 0.21.2). LoRA on gbattn's projections trains the adapters alone,
    starts as the model it adapts (its B is zero), and merges back into a GbattnForCausalLM with the adapted
    logits. Prompt tuning (which reads hidden_size, num_hidden_layers and num_attention_heads from the config's
    dict, and feeds inputs_embeds) gives the loss of its soft prompt's embeddings before the tokens', with labels
    only on the tokens, and trains the prompt alone. Both generate."""
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    gpt, hf = tiny_pair(("boosted", {}), {})
    idx = torch.randint(0, 37, (2, 9))
    before = hf(idx).logits
    lora = get_peft_model(hf, LoraConfig(r=4, target_modules=["qkv", "proj"], task_type="CAUSAL_LM"))
    trainable = [(n, p) for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    torch.testing.assert_close(lora(input_ids=idx).logits, before, rtol=0, atol=0)
    lora(input_ids=idx, labels=idx).loss.backward()
    with torch.no_grad():
        for _, p in trainable:
            p -= 0.5 * p.grad
    adapted = lora(input_ids=idx).logits
    assert not torch.allclose(adapted, before)
    assert lora.generate(input_ids=idx, max_new_tokens=2, do_sample=False).shape == (2, 11)
    merged = lora.merge_and_unload()
    assert type(merged) is GbattnForCausalLM
    torch.testing.assert_close(merged(idx).logits, adapted, rtol=1e-10, atol=1e-10)

    gpt, hf = tiny_pair(("boosted", {}), {}, seed=1)
    tuned = get_peft_model(hf, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    out = tuned(input_ids=idx, labels=idx)
    prompt = tuned.get_prompt(batch_size=2)
    expected = hf(inputs_embeds=torch.cat([prompt, gpt.wte(idx)], 1),
                  labels=torch.cat([torch.full((2, 3), -100), idx], 1)).loss
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    trainable = [p for p in tuned.parameters() if p.requires_grad]
    assert len(trainable) == 1 and trainable[0].shape == (3, gpt.cfg.d_model) and bool(trainable[0].grad.abs().sum())
    assert tuned.generate(input_ids=idx, max_new_tokens=2, do_sample=False).shape == (2, 11)


def test_gradient_checkpointing_through_transformers_recomputes_gbattns_blocks():
    """transformers' gradient_checkpointing_enable() (activation_checkpointing_enable() in 5.x) with its own
    keywords, reentrant or not: each block's attention runs again in the backward pass, the loss and gradients
    are those without it (float64, dropout at every site), is_gradient_checkpointing says so, and
    gradient_checkpointing_disable() turns it off; every_n_layers (5.x) picks the blocks."""
    torch.manual_seed(0)
    hf = GbattnForCausalLM(GbattnConfig.from_model_config(tiny_config(("boosted", {}), dropout=0.1))).double().train()
    idx = torch.randint(0, 37, (2, 9))

    def step():
        hf.zero_grad(set_to_none=True)
        calls = []
        hooks = [block.attn.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
                 for i, block in enumerate(hf.model.blocks)]
        torch.manual_seed(3)
        loss = hf(idx, labels=idx).loss
        loss.backward()
        for hook in hooks:
            hook.remove()
        return loss.detach(), [p.grad.clone() for p in hf.parameters()], sorted(calls)

    loss, grads, calls = step()
    assert calls == [0, 1] and not hf.is_gradient_checkpointing
    enable = getattr(hf, "activation_checkpointing_enable", hf.gradient_checkpointing_enable)
    keyword = "activation_checkpointing_kwargs" if hasattr(hf, "activation_checkpointing_enable") else \
        "gradient_checkpointing_kwargs"
    for reentrant in (True, False):
        enable(**{keyword: {"use_reentrant": reentrant}})
        assert hf.is_gradient_checkpointing
        again, again_grads, calls = step()
        assert calls == [0, 0, 1, 1], reentrant
        torch.testing.assert_close(again, loss, rtol=0, atol=1e-12)
        for grad, expected in zip(again_grads, grads, strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    hf._set_gradient_checkpointing(True, every_n_layers=2)  # (what 5.x's every_n_layers=2 calls)
    assert step()[2] == [0, 0, 1]
    hf.gradient_checkpointing_disable()
    assert step()[2] == [0, 1] and not hf.is_gradient_checkpointing


def test_an_attention_mask_of_other_values_than_0_and_1_is_refused_and_a_float_one_of_0_and_1_taken():
    """The positions were the mask's running sum: a mask of 2s (or -1s) gave each row other positions than alone
    (logits off by 0.5, silently), and an additive float mask (0 keep, -inf drop) said "position_ids reach
    9223372036854775807" though none was given. transformers' models take 0 and 1, of any dtype."""
    gpt, hf = tiny_pair(("boosted", {}), {"pos": "rope"})
    idx = torch.randint(0, 37, (2, 8))
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[1, :3] = 0
    expected = hf(idx, attention_mask=keep).logits
    torch.testing.assert_close(hf(idx, attention_mask=keep.double()).logits, expected, rtol=0, atol=0)
    torch.testing.assert_close(hf(idx, attention_mask=keep.bool()).logits, expected, rtol=0, atol=0)
    for mask in (keep * 2, -keep, torch.where(keep.bool(), 0.0, float("-inf"))):
        with pytest.raises(ValueError, match=r"^attention_mask must hold 0 \(padding\) and 1 \(a real token\) only"):
            hf(idx, attention_mask=mask)


def test_past_key_values_keyword_and_tuple_output():
    gpt, hf = tiny_pair(("boosted", {"rounds": 3, "gate": "mlp"}), {})
    idx = torch.randint(0, 37, (2, 6))
    first = hf(idx[:, :4], use_cache=True)
    cache = getattr(first, CACHE_FIELD)
    a = hf(idx[:, 4:], past_key_values=cache).logits  # the name before transformers 5.24
    torch.testing.assert_close(a, gpt(idx)[:, 4:], rtol=1e-10, atol=1e-10)
    logits, = hf(idx, use_cache=False, return_dict=False)
    torch.testing.assert_close(logits, gpt(idx), rtol=0, atol=0)
    torch.testing.assert_close(hf(idx, logits_to_keep=1).logits, gpt(idx)[:, -1:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        hf(idx, attention_mask=torch.ones(2, 3, dtype=torch.long))
    kw = dict(attention_mask=torch.ones_like(idx), max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = hf.generate(idx, **kw)
    assert torch.equal(hf.generate(idx, cache=GbattnCache(2), **kw), ref)  # a cache the caller makes
    # Chunked prefill was transformers' "Cannot use prefill chunking without a cache" (it makes none for this model)
    fed = []
    hook = hf.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    assert torch.equal(hf.generate(idx, prefill_chunk_size=4, **kw), ref)
    with pytest.raises(ValueError, match="prefill chunking without a cache"):  # use_cache=False asks for none: no
        hf.generate(idx, prefill_chunk_size=4, use_cache=False, **kw)  # cache is made behind the caller's back
    # 5.x feeds the prompt in chunks through the hooks; 4.x calls forward() directly for the first 5 tokens (no
    # hooks) and then one token at a time (unchunked, both would be [6, 1, 1, 1])
    assert fed == ([4, 2, 1, 1, 1] if int(transformers.__version__.split(".")[0]) >= 5 else [1, 1, 1, 1])
    hook.remove()
    chunked = transformers.GenerationConfig(prefill_chunk_size=4, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(hf.generate(idx, chunked, attention_mask=kw["attention_mask"]), ref)  # the config given second
    beams = dict(kw, num_beams=3, num_return_sequences=2)
    assert torch.equal(hf.generate(idx, prefill_chunk_size=3, **beams), hf.generate(idx, **beams))
    ids, mask = left_pad([idx[0].clamp_min(1), idx[1, :3].clamp_min(1)], torch.long)  # only the padding is pad_token_id
    padded = dict(kw, attention_mask=mask)
    inferred = dict(kw, attention_mask=None)  # transformers makes the mask from pad_token_id (0) itself
    assert torch.equal(hf.generate(ids, **inferred), hf.generate(ids, **padded))
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert torch.equal(hf.generate(ids, prefill_chunk_size=2, **padded), hf.generate(ids, **padded))
        assert torch.equal(hf.generate(ids, prefill_chunk_size=2, **inferred), hf.generate(ids, **padded))
    else:  # 4.x gives the chunks positions 0.. of the padded width (the short row's tokens were silently others),
        # with the mask given or made from the padding (which the refusal missed)
        # the ids given by position or by keyword, as generate() takes them (the keywords were once not read)
        for given in (padded, inferred):
            for positional, keyword in (((ids,), {}), ((), {"input_ids": ids}), ((), {"inputs": ids})):
                with pytest.raises(ValueError, match="4.x.s chunked prefill .prefill_chunk_size. gives every row"):
                    hf.generate(*positional, prefill_chunk_size=2, **keyword, **given)
    # The check (4.x's generate runs it) takes the token ids as transformers does, tensors too: an eos_token_id of
    # tensor([7, 8]) made 4.x's chunked prefill of an unpadded batch a RuntimeError ('Boolean value of Tensor ...')
    unpadded, padding_only = idx.clamp_min(1), dict(pad_token_id=torch.tensor(0), eos_token_id=torch.tensor([7, 8]))
    assert not GbattnForCausalLM._padded_batch(unpadded, padding_only, hf.generation_config)
    assert GbattnForCausalLM._padded_batch(ids, padding_only, hf.generation_config)
    assert not GbattnForCausalLM._padded_batch(ids, dict(padding_only, eos_token_id=torch.tensor([7, 0])),
                                               hf.generation_config)  # pad is an end-of-text token: no mask made
    # a mask that is given decides (the 4.x refusal's other half; under 5.x generate() never asks)
    assert GbattnForCausalLM._padded_batch(ids, dict(padding_only, attention_mask=mask), hf.generation_config)
    assert not GbattnForCausalLM._padded_batch(ids, dict(padding_only, attention_mask=torch.ones_like(ids)),
                                               hf.generation_config)
    # no ids at all (a generate() without a prompt), or no pad_token_id: no mask is made from them (tracebacks once)
    assert not GbattnForCausalLM._padded_batch(None, padding_only, hf.generation_config)
    assert hf.generation_config.pad_token_id is None and not GbattnForCausalLM._padded_batch(ids, {},
                                                                                              hf.generation_config)
    assert torch.equal(hf.generate(unpadded, prefill_chunk_size=2, **dict(kw, eos_token_id=torch.tensor([7, 8]))),
                       hf.generate(unpadded, **dict(kw, eos_token_id=torch.tensor([7, 8]))))
    with warnings.catch_warnings():  # the name before transformers 5.24 (deprecated there)
        warnings.simplefilter("ignore", FutureWarning)
        assert torch.equal(hf.generate(idx, past_key_values=GbattnCache(2), **kw), ref)


def test_cache_rows_follow_beam_reordering_selection_and_repetition():
    """Every entry's keys and values (and a value-only entry's values) move with their batch rows, in every
    layer (a change made to the first layer only went unnoticed with one layer)."""
    cache = GbattnCache(2)
    k_BGSE, v_BGSE, av_BGSE = (torch.randn(3, 2, 4, 5) for _ in range(3))
    rows = torch.tensor([2, 0])
    for change, expected in ((lambda c: c.batch_select_indices(rows), lambda t: t[rows]),
                             (lambda c: c.reorder_cache(rows), lambda t: t[rows]),
                             (lambda c: c.batch_repeat_interleave(2), lambda t: t.repeat_interleave(2, dim=0))):
        for layer in cache.layers:
            layer.entries = {"kv0": (k_BGSE, v_BGSE), "av": (None, av_BGSE)}
        change(cache)
        for layer in cache.layers:
            (k, v), (no_k, av) = layer.entries["kv0"], layer.entries["av"]
            assert no_k is None and torch.equal(k, expected(k_BGSE)) and torch.equal(v, expected(v_BGSE))
            assert torch.equal(av, expected(av_BGSE))


def test_cache_crops_as_the_installed_transformers_crops():
    """crop() drops positions from the end of every entry of every layer, a value-only entry's too: transformers 5
    takes the number to remove as a negative count (crop(0): none; a positive one refused, as its own layers do),
    4.x a length to keep (negative: remove), crop(0) emptying the cache."""
    from gbattn.hf.modeling import TF_MAJOR

    k_BGSE, v_BGSE = torch.randn(2, 2, 6, 3), torch.randn(2, 2, 6, 3)

    def cropped(size):
        cache = GbattnCache(2)
        for layer in cache.layers:
            layer.entries = {"kv0": (k_BGSE, v_BGSE), "av": (None, v_BGSE)}
        cache.crop(size)
        lengths = {(name, k is None, v.shape[2]) for layer in cache.layers for name, (k, v) in layer.entries.items()}
        for layer in cache.layers:
            k, v = layer.entries["kv0"]
            assert torch.equal(k, k_BGSE[:, :, :k.shape[2]]) and torch.equal(v, v_BGSE[:, :, :v.shape[2]])
        assert len({n for _, _, n in lengths}) == 1
        return cache.get_seq_length()

    assert cropped(-2) == 4 and cropped(-6) == 0 and cropped(-9) == 6  # (more than it holds: left as it is)
    if TF_MAJOR >= 5:
        assert cropped(0) == 6
        with pytest.raises(ValueError, match=r"crop\(3\): transformers 5 crops by a negative number"):
            cropped(3)
    else:
        assert cropped(3) == 3 and cropped(0) == 0 and cropped(8) == 6


def test_misuses_are_clear_errors():
    """A cache of another kind (it would never be written: the next call would silently see no past),
    attention maps, and positions past block_size each raise an error that names the cause."""
    from transformers import DynamicCache

    gpt, hf = tiny_pair(("boosted", {}), {})
    idx = torch.randint(0, 37, (1, 6))
    with pytest.raises(TypeError, match="GbattnCache, not a DynamicCache"):
        hf(idx, past_key_values=DynamicCache())
    with pytest.raises(TypeError, match="GbattnCache, not a tuple"):
        hf(idx, past_key_values=((torch.zeros(1), torch.zeros(1)),))
    with pytest.raises(ValueError, match="output_attentions asked for, by argument or config") as refused:
        hf(idx, output_attentions=True)
    # asked for by the config: refused too, not silently answered without maps (5.x asks for eager attention first)
    with pytest.MonkeyPatch.context() as mp:
        if hasattr(hf.config, "_attn_implementation"):
            mp.setattr(hf.config, "_attn_implementation", "eager")
        mp.setattr(hf.config, "output_attentions", True)
        with pytest.raises(ValueError, match="output_attentions asked for, by argument or config"):
            hf(idx)
    # the config's output_hidden_states holds unless an argument decides
    hf.config.output_hidden_states = True
    assert len(hf(idx).hidden_states) == 3 and hf(idx, output_hidden_states=False).hidden_states is None
    hf.config.output_hidden_states = False
    # the advice names a call that runs on the wrapper (before, it named GPT(idx, ...), a constructor call)
    assert "model.model(input_ids, return_intermediates=True)" in str(refused.value)
    input_ids, model = idx, hf
    logits, records = model.model(input_ids, return_intermediates=True)
    assert len(records) == gpt.cfg.n_layers
    block = gpt.cfg.block_size
    with pytest.raises(ValueError, match=f"position_ids reach {block}; the model's positions are 0 .. {block - 1}"):
        hf(idx, position_ids=torch.arange(block - 5, block + 1)[None])
    torch.testing.assert_close(hf(idx).logits, gpt(idx), rtol=0, atol=0)
    # early exit (the model's own first layers as its draft: "'GPT' object has no attribute 'config'"), asked for by
    # keyword or by a generation config, given or the model's own
    with pytest.raises(ValueError, match=r"does not support early-exit decoding \(assistant_early_exit\)"):
        hf.generate(idx, max_new_tokens=2, do_sample=False, pad_token_id=0, assistant_early_exit=1)
    asking = transformers.GenerationConfig(assistant_early_exit=1, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="does not support early-exit decoding"):
        hf.generate(idx, generation_config=asking)
    with pytest.raises(ValueError, match="does not support early-exit decoding"):
        hf.generate(idx, asking)  # given second, not by name (generate(inputs, generation_config, ...))
    hf.generation_config.assistant_early_exit = 1
    with pytest.raises(ValueError, match="does not support early-exit decoding"):
        hf.generate(idx, max_new_tokens=2, do_sample=False, pad_token_id=0)
    hf.generation_config.assistant_early_exit = None
    # A cache with fewer layers than blocks would skip the blocks past its end (wrong logits, no error).
    for layers in (1, 3):
        with pytest.raises(ValueError, match=f"a KV cache of {layers} layers for a model of 2"):
            hf(idx, cache=GbattnCache(layers))
    with pytest.raises(ValueError, match=r"input_ids of shape \(6,\): expected \(batch, tokens\)"):
        hf(idx[0])
    with pytest.raises(ValueError, match=r"^input_ids of shape \(6,\): expected \(batch, tokens\)$"):
        hf.generate(idx[0], max_new_tokens=2, do_sample=False, pad_token_id=0)  # (was an IndexError)
    with pytest.raises(ValueError, match=r"^inputs_embeds of shape \(6, 16\): expected \(batch, tokens, hidden_size\)"):
        hf.generate(inputs_embeds=hf.model.wte(idx)[0], max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match=r"token ids of shape \(1, 0\)"):
        hf.generate(idx[:, :0], max_new_tokens=2, do_sample=False, pad_token_id=0)
    hf.config.return_dict = False  # the config's choice holds when forward() is given none
    logits, cache = hf(idx)
    torch.testing.assert_close(logits, gpt(idx), rtol=0, atol=0)
    assert isinstance(cache, GbattnCache) and not isinstance(hf(idx, return_dict=True), tuple)
    hf.config.return_dict = True
    hf.resize_token_embeddings(40)  # gbattn's own config follows, and the head stays tied
    assert hf.model.cfg.vocab_size == hf.config.vocab_size == hf.config.model_config.vocab_size == 40
    assert hf.model.lm_head.weight is hf.model.wte.weight and hf(idx).logits.shape[-1] == 40


def test_forward_and_generate_name_an_argument_that_is_no_tensor():
    """input_ids, attention_mask or labels given as lists (or numpy arrays) were Python's "'list' object has no
    attribute 'dim'" (or 'shape') from inside forward() or transformers' generate(); gbattn's own check names them."""
    _, hf = tiny_pair(("boosted", {}), {})
    idx = torch.randint(0, 37, (1, 6))
    for name, value in (("input_ids", idx.tolist()), ("attention_mask", [[1] * 6]), ("labels", idx.numpy()),
                        ("position_ids", list(range(6)))):
        arguments = {"input_ids": idx, name: value}
        with pytest.raises(ValueError, match=f"^{name} of type (list|ndarray): give a torch tensor"):
            hf(**arguments)
    for arguments in ({"inputs": idx.tolist()}, {"input_ids": idx.tolist()},
                      {"inputs": idx, "attention_mask": [[1] * 6]}):
        with pytest.raises(ValueError, match="of type list: give a torch tensor"):
            hf.generate(**arguments, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="^input_ids of type list: give a torch tensor"):
        hf.generate(idx.tolist(), max_new_tokens=2, do_sample=False)


def test_generate_refuses_a_cache_implementation_other_than_its_own():
    """cache_implementation="static" (or "offloaded", "quantized", ...) was ignored with transformers' warning that the
    model "does not support Cache instances", and generate() ran on a GbattnCache: one error names what it uses.
    "dynamic", which GbattnCache is, runs, as does leaving it unset."""
    gpt, hf = tiny_pair(("boosted", {}), {})
    idx = torch.randint(0, 37, (1, 6))
    expected = gpt.generate(idx, max_new_tokens=3, temperature=0)
    for kind in ("static", "offloaded", "quantized"):
        with pytest.raises(ValueError, match=f"cache_implementation={kind!r}: GbattnForCausalLM keeps"):
            hf.generate(idx, max_new_tokens=3, do_sample=False, cache_implementation=kind)
    asking = transformers.GenerationConfig(cache_implementation="static", max_new_tokens=3, do_sample=False)
    for given in ({"generation_config": asking}, {}):
        with pytest.raises(ValueError, match="cache_implementation='static': GbattnForCausalLM keeps"):
            hf.generate(idx, *([] if given else [asking]), **given)  # by name, or second
    assert torch.equal(hf.generate(idx, max_new_tokens=3, do_sample=False, cache_implementation="dynamic"), expected)
    # "dynamic_full", transformers 4.x's for a draft model: a dynamic cache, run without transformers' warning that
    # it "will be ignored" (printed at every drafting call), the caller's config left as it was; 5.x has no such kind
    from gbattn.hf.modeling import TF_MAJOR

    if TF_MAJOR >= 5:  # (its GenerationConfig refuses the kind itself)
        with pytest.raises(ValueError, match="cache_implementation='dynamic_full': GbattnForCausalLM keeps"):
            hf.generate(idx, max_new_tokens=3, do_sample=False, cache_implementation="dynamic_full")
        return
    full = transformers.GenerationConfig(cache_implementation="dynamic_full", max_new_tokens=3, do_sample=False)
    for arguments, keywords in (((), {"cache_implementation": "dynamic_full", "max_new_tokens": 3, "do_sample": False}),
                                ((), {"generation_config": full}), ((full,), {})):
        said: list[str] = []
        catcher = logging.Handler(logging.WARNING)
        catcher.emit = lambda record, said=said: said.append(record.getMessage())
        logging.getLogger("transformers").addHandler(catcher)
        try:
            assert torch.equal(hf.generate(idx, *arguments, **keywords), expected)
        finally:
            logging.getLogger("transformers").removeHandler(catcher)
        assert not [line for line in said if "will be ignored" in line], said
        assert full.cache_implementation == "dynamic_full"
    assert torch.equal(hf.generate(idx, max_new_tokens=3, do_sample=False), expected)


def test_generate_past_the_models_positions_is_refused_before_it_starts():
    """max_new_tokens (or max_length) past block_size decoded up to the last position, then stopped with "position_ids
    reach 24", the tokens lost: refused up front, naming how many fit. The last new token is never fed back: a
    sequence one token longer than the positions runs, and equals gbattn's own generate."""
    gpt, hf = tiny_pair(("standard", {}), {})
    idx = torch.randint(0, 37, (1, 6))
    with pytest.raises(ValueError, match=r"^a prompt of 6 tokens and max_new_tokens=20 feed the model positions "
                                         r"0 \.\. 24; it has 0 \.\. 23 \(max_position_embeddings, gbattn's "
                                         r"block_size\): ask for at most 19 new tokens"):
        hf.generate(idx, max_new_tokens=20, do_sample=False)
    with pytest.raises(ValueError, match=r"^max_length=26 feed the model positions 0 \.\. 24; it has 0 \.\. 23"):
        hf.generate(idx, max_length=26, do_sample=False)
    for asking, match in ((dict(max_new_tokens=20), "^a prompt of 6 tokens and max_new_tokens=20 feed"),
                          (dict(max_length=26), "^max_length=26 feed")):  # asked in a generation config
        config = transformers.GenerationConfig(do_sample=False, **asking)
        for arguments, keywords in ((), {"generation_config": config}), ((config,), {}):  # by name, or second
            with pytest.raises(ValueError, match=match):
                hf.generate(idx, *arguments, **keywords)
    assert torch.equal(hf.generate(idx, max_new_tokens=19, do_sample=False), gpt.generate(idx, 19, temperature=0))
    # numpy's and torch's integers too (np.int64(20) passed the check, and a tensor's was read as no max_new_tokens,
    # the check refusing 19 by the default max_length)
    for integer in (np.int64, torch.tensor):
        with pytest.raises(ValueError, match=r"^a prompt of 6 tokens and max_new_tokens=20 feed the model positions"):
            hf.generate(idx, max_new_tokens=integer(20), do_sample=False)
        assert torch.equal(hf.generate(idx, max_new_tokens=integer(19), do_sample=False),
                           gpt.generate(idx, 19, temperature=0))
    # ... or in the model's own generation config (an export's generation_config.json): it ran and stopped midway
    hf.generation_config.max_length = 26
    with pytest.raises(ValueError, match=r"^max_length=26 feed the model positions 0 \.\. 24; it has 0 \.\. 23"):
        hf.generate(idx, do_sample=False)
    hf.generation_config.max_length = 25
    assert torch.equal(hf.generate(idx, do_sample=False), gpt.generate(idx, 19, temperature=0))
    # no prompt: generate() starts from the BOS token, one token (counted as none, 25 new tokens passed the check and
    # stopped at position 24)
    hf.generation_config.bos_token_id = 0
    with pytest.raises(ValueError, match=r"^a prompt of 1 token and max_new_tokens=25 .* ask for at most 24 new"):
        hf.generate(max_new_tokens=25, do_sample=False)
    assert torch.equal(hf.generate(max_new_tokens=24, do_sample=False),
                       gpt.generate(torch.zeros(1, 1, dtype=torch.long), 24, temperature=0))


def test_a_negative_prompt_longer_than_the_prompt_is_checked_for_the_new_tokens_it_is_fed():
    """Guidance's negative prompt is fed each new token as the prompt is: 10 tokens of it beside a prompt of 6 passed
    the check for 16 new tokens and stopped midway ("exceeds block_size"); it counts its real tokens (its mask)."""
    _, hf = tiny_pair(("standard", {}), {})
    idx, negative = torch.randint(0, 37, (1, 6)), torch.randint(0, 37, (1, 10))
    guided = dict(guidance_scale=1.5, do_sample=False)
    refused = (r"^guidance's negative prompt \(negative_prompt_ids\) is longer than the prompt and is fed every new "
               r"token too: a prompt of 10 tokens and max_new_tokens=16 feed the model positions 0 \.\. 24; it has "
               r"0 \.\. 23 .*: ask for at most 15 new tokens$")
    for asking in (dict(max_new_tokens=16), dict(max_length=22)):
        with pytest.raises(ValueError, match=refused):
            hf.generate(idx, negative_prompt_ids=negative, **asking, **guided)
    assert hf.generate(idx, negative_prompt_ids=negative, max_new_tokens=15, **guided).shape == (1, 21)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), negative], 1)
    padded_mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], 1)
    with pytest.raises(ValueError, match=refused):
        hf.generate(idx, negative_prompt_ids=padded, negative_prompt_attention_mask=padded_mask, max_new_tokens=16,
                    **guided)
    # neither max_new_tokens nor max_length: transformers makes 20 new tokens within the positions (18 here, past
    # them for the negative prompt: it ran and stopped at "sequence length 25")
    with pytest.raises(ValueError, match=refused.replace("16", "18").replace("24;", "26;")):
        hf.generate(idx, negative_prompt_ids=negative, **guided)
    # ... 20 where they fit (a prompt of 2): a negative prompt of 6 is then fed positions up to 24, refused; a
    # max_length of 20 given (transformers 4.x's default, here asked for) leaves 18 new tokens, which fit
    short, negative6 = torch.randint(0, 37, (1, 2)), torch.randint(0, 37, (1, 6))
    with pytest.raises(ValueError, match=r"a prompt of 6 tokens and max_new_tokens=20 feed the model positions "
                                         r"0 \.\. 24; it has 0 \.\. 23"):
        hf.generate(short, negative_prompt_ids=negative6, **guided)
    assert hf.generate(short, negative_prompt_ids=negative6, max_length=20, **guided).shape == (1, 20)
    # without guidance (scale 1) the negative prompt is not fed: no check
    assert hf.generate(idx, negative_prompt_ids=negative, max_new_tokens=18, guidance_scale=1.0,
                       do_sample=False).shape == (1, 24)


def test_the_length_check_reads_the_settings_transformers_decodes_with():
    """The check read a given GenerationConfig alone, which transformers completes from the model's own (its
    max_new_tokens=30 ran past the positions and stopped with "position_ids reach 24"); a float max_new_tokens
    (transformers takes 30.0) skipped it; a left-padded batch was measured by its padded width, refusing new tokens
    its rows had room for; and a prompt longer than the positions was told to ask for 0 new tokens."""
    gpt, hf = tiny_pair(("standard", {}), {})
    idx = torch.randint(0, 37, (1, 3))
    hf.generation_config.max_new_tokens = 30
    with pytest.raises(ValueError, match=r"^a prompt of 3 tokens and max_new_tokens=30 feed the model positions"):
        hf.generate(idx, generation_config=transformers.GenerationConfig(do_sample=False))
    hf.generation_config.max_new_tokens = None
    for value in (30.0, torch.tensor(30.0)):
        with pytest.raises(ValueError, match=r"^a prompt of 3 tokens and max_new_tokens=30 feed"):
            hf.generate(idx, max_new_tokens=value, do_sample=False)
    # rows of 9 and 2 tokens left-padded to 24: the longest row's positions end at 8, with room for 16 new tokens
    rows = [torch.randint(2, 37, (n,)) for n in (9, 2)]
    ids = torch.stack([torch.cat([torch.ones(24 - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(24 - len(r), dtype=torch.long), torch.ones(len(r), dtype=torch.long)])
                        for r in rows])
    batched = hf.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    for row, alone in zip(batched[:, 24:], rows):
        assert torch.equal(row, hf.generate(alone[None], max_new_tokens=3, do_sample=False, pad_token_id=1)[0, -3:])
    # ... and by max_length, which counts the padded width: 27 is 3 new tokens (it was refused, "ask for at most
    # -1 new tokens"); 42 is 18, two past the 16 the longest row has room for (40 is the most)
    assert torch.equal(hf.generate(ids, attention_mask=mask, max_length=27, do_sample=False, pad_token_id=1), batched)
    with pytest.raises(ValueError, match=r"^max_length=42 over a batch padded to 24 \(its longest row 9 tokens\) feed "
                                         r"the model positions 0 \.\. 25; it has 0 \.\. 23 .*: ask for at most 16 new "
                                         r"tokens \(max_length=40\)$"):
        hf.generate(ids, attention_mask=mask, max_length=42, do_sample=False, pad_token_id=1)
    assert hf.generate(ids, attention_mask=mask, max_length=40, do_sample=False, pad_token_id=1).shape == (2, 40)
    with pytest.raises(ValueError, match=r"^a prompt of 25 tokens and max_new_tokens=1 .*: the prompt does not fit: "
                                         r"keep its last 24 tokens at most for 1 new$"):
        hf.generate(torch.randint(0, 37, (1, 25)), max_new_tokens=1, do_sample=False)
    # with more new tokens, the prompt's last tokens that leave room for them (it said 24, refused again for 10 new)
    with pytest.raises(ValueError, match=r"keep its last 15 tokens at most for 10 new$"):
        hf.generate(torch.randint(0, 37, (1, 30)), max_new_tokens=10, do_sample=False)
    assert hf.generate(torch.randint(0, 37, (1, 15)), max_new_tokens=10, do_sample=False).shape == (1, 25)
    with pytest.raises(ValueError, match=r"the prompt does not fit, and at most 24 new tokens do after a 1-token "
                                         r"prompt$"):
        hf.generate(torch.randint(0, 37, (1, 30)), max_new_tokens=25, do_sample=False)
    with pytest.raises(ValueError, match=r": ask for at most 1 new token$"):  # (it said "1 new tokens")
        hf.generate(torch.randint(0, 37, (1, 24)), max_new_tokens=2, do_sample=False)
    # Prompt lookup drafts prompt_lookup_num_tokens - 1 tokens past max_length (transformers cuts its candidates at
    # the prompt's end, not at max_length): max_length=24 with 3 ran into "sequence length 25 exceeds block_size"
    # midway. A repeating prompt, so that lookup finds its candidates.
    repeating = torch.tensor([[3, 4, 3, 4, 3, 4]])
    lookup = dict(do_sample=False, pad_token_id=0, eos_token_id=36, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match=r"^max_length=24 feed the model positions 0 \.\. 24 with prompt lookup's 2 "
                                         r"drafted tokens past them \(prompt_lookup_num_tokens=3\); it has 0 \.\. 23 "
                                         r".*: ask for at most 17 new tokens \(max_length=23\)$"):
        hf.generate(repeating, max_length=24, **lookup)
    for seed in range(10):  # (greedy, seeded: other repeating prompts)
        torch.manual_seed(seed)
        prompt = torch.randint(1, 5, (1, 6))
        assert torch.equal(hf.generate(prompt, max_length=23, **lookup),
                           hf.generate(prompt, max_length=23, do_sample=False, pad_token_id=0, eos_token_id=36))
    # ... and no more than the text so far less one token: 30 of them for 4 new tokens after 6 ran (it was refused,
    # "at most -5 new tokens")
    many = {**lookup, "prompt_lookup_num_tokens": 30}
    assert torch.equal(hf.generate(repeating, max_new_tokens=4, **many),
                       hf.generate(repeating, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=36))
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens=30\); it has 0 \.\. 23 .*: ask for at most 7 "
                                         r"new tokens$"):  # (6 + 7 - 1 + 11 drafted)
        hf.generate(repeating, max_new_tokens=14, **many)
    assert hf.generate(repeating, max_new_tokens=7, **many).shape == (1, 13)
    with pytest.raises(ValueError, match=r"prompt lookup's drafted tokens: a smaller prompt_lookup_num_tokens$"):
        hf.generate(torch.tensor([[3, 4] * 8]), max_new_tokens=5, **many)
    # No end-of-text token (an export of gbattn's char or paper BPE tokenizer): transformers 4.x's candidate search
    # ended in a TypeError once it found a draft in the prompt; refused in one line there, greedy's tokens under 5
    from gbattn.hf.modeling import TF_MAJOR
    no_eos = {**lookup, "eos_token_id": None}
    if TF_MAJOR >= 5:
        assert torch.equal(hf.generate(repeating, max_new_tokens=4, **no_eos),
                           hf.generate(repeating, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None))
    else:
        with pytest.raises(ValueError, match=r"^transformers 4.x's prompt lookup \(prompt_lookup_num_tokens\) needs an "
                                             r"end-of-text token id, and this generation has none"):
            hf.generate(repeating, max_new_tokens=4, **no_eos)
    # A gbattn draft model with fewer positions than the generation: refused before it starts (it failed midway, naming
    # the numbers of transformers' calls to the draft)
    small_gpt = GPT(tiny_config(("standard", {}), block_size=12))
    small = GbattnForCausalLM.from_gpt(small_gpt.double()).eval()
    with pytest.raises(ValueError, match=r"^the draft model \(assistant_model\) has fewer positions than this "
                                         r"generation needs: a prompt of 6 tokens and max_new_tokens=15 feed"):
        hf.generate(repeating, max_new_tokens=15, assistant_model=small, do_sample=False, pad_token_id=0)
    # Another library's target (GPT-2 of 64 positions) gives its draft one drafting call's length, not the whole
    # generation's: refused midway, naming the draft's positions (it said "a prompt of 14 tokens and
    # max_new_tokens=20 ... ask for at most 19 new tokens", transformers' numbers for its drafting call)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    target = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=37, n_positions=64)).eval()
    with pytest.raises(ValueError, match=r"^this model, drafting for another \(assistant_model\), has positions 0 "
                                         r"\.\. 11 \(max_position_embeddings, gbattn's block_size\), and the "
                                         r"generation it drafts for has reached \d+ tokens: keep that generation's "
                                         r"prompt and new tokens within 13 tokens, or give a draft with more"):
        target.generate(repeating, max_new_tokens=15, assistant_model=small.float(), do_sample=False, pad_token_id=0)
    assert torch.equal(target.generate(repeating, max_new_tokens=7, assistant_model=small, do_sample=False,
                                       pad_token_id=0),
                       target.generate(repeating, max_new_tokens=7, do_sample=False, pad_token_id=0))

def test_from_gpt_leaves_the_gpts_modules_as_they_were_and_its_own_cache_aside():
    """from_gpt ended with train(gpt.training), which set every module of the caller's GPT: a block put in eval mode
    trained with dropout again, silently. And with the GPT's own static cache set up (setup_cache, for its cached
    decoding), the wrapper's forward with use_cache=False (or in training mode, as under Trainer) asked for input_pos,
    which no transformers caller passes: the wrapper never reads that cache now, with use_cache on or off."""
    gpt = GPT(tiny_config(("boosted", {})))
    gpt.blocks[0].eval()
    hf = GbattnForCausalLM.from_gpt(gpt)
    assert hf.training and gpt.training and not gpt.blocks[0].training and not gpt.blocks[0].attn.training
    assert gpt.blocks[1].training
    gpt.eval()
    idx = torch.randint(0, 37, (2, 6))
    expected = gpt(idx)
    gpt.setup_cache(2)
    for use_cache in (True, False):
        torch.testing.assert_close(hf(idx, use_cache=use_cache).logits, expected, rtol=0, atol=0)
    hf.train()
    assert hf(idx, labels=idx).loss.isfinite()
    assert gpt.kv_cache is not None  # the GPT's own cache stays set up


def test_forward_honours_every_argument_it_takes():
    """Arguments forward() takes are honoured or refused, never silently ignored: inputs_embeds,
    output_attentions, explicit position_ids beside a padding mask, cache_position (one of the wrong length was torch's
    expand error; in a cached step it is taken as given, not shifted by the past), logits_to_keep as indices, labels
    that are all ignored; a training-mode call, or a config made with use_cache=False, keeps no cache; from_gpt
    keeps the GPT's mode."""
    gpt, hf = tiny_pair(("boosted", {}), {})
    idx = torch.randint(0, 37, (2, 6))
    # inputs_embeds beside the ids, or neither (was an AttributeError from input_ids.dim())
    for given in (dict(input_ids=idx, inputs_embeds=torch.zeros(2, 6, 16, dtype=torch.float64)), {}):
        with pytest.raises(ValueError, match=r"takes input_ids or inputs_embeds, one of the two"):
            hf(**given)
    for embeds, match in ((torch.zeros(2, 6, dtype=torch.float64), r"inputs_embeds of shape \(2, 6\): expected "
                                                                    r"\(batch, tokens, hidden_size\)"),
                          (torch.zeros(2, 6, 8, dtype=torch.float64), r"expected \(batch, tokens, 16\)"),
                          (torch.zeros(2, 6, 16), r"dtype torch.float32 for a model in torch.float64")):
        with pytest.raises(ValueError, match=match):
            hf(inputs_embeds=embeds)
    with pytest.raises(ValueError, match="output_attentions asked for"):
        hf(idx, output_attentions=True)
    full = gpt(idx)
    torch.testing.assert_close(hf(idx, logits_to_keep=torch.tensor([0, 3])).logits, full[:, [0, 3]], rtol=0, atol=0)
    assert hf(idx, labels=torch.full_like(idx, -100)).loss.item() == 0  # not 0/0
    # labels with only some positions' logits were cross_entropy's "Expected input batch_size (0) to match ..."
    for keep in (1, 3, torch.tensor([0, 3])):
        with pytest.raises(ValueError, match=r"labels need the logits of every position; logits_to_keep=.* keeps only"):
            hf(idx, labels=idx, logits_to_keep=keep)
    # numpy's integers are integers as config fields take them: np.int64(3) was every logit, np.int64(-1) taken
    torch.testing.assert_close(hf(idx, logits_to_keep=np.int64(3)).logits, full[:, -3:], rtol=1e-12, atol=1e-12)
    for keep in (-1, np.int64(-1), 2.5, True):  # -1 was every logit, silently; True was 1
        with pytest.raises(ValueError, match=re.escape(f"logits_to_keep={keep!r} must be 0 (every position), the "
                                                       f"number of last positions to keep, or a tensor of positions")):
            hf(idx, logits_to_keep=keep)
    # position_ids given with a padded batch are the ones used (not recomputed from the mask)
    rows = [idx[0], idx[1, :4]]
    ids, mask = left_pad(rows, torch.long)
    shifted = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        shifted[i, ids.shape[1] - len(row):] = torch.arange(1, len(row) + 1)
    padded = hf(ids, attention_mask=mask, position_ids=shifted).logits
    for i, row in enumerate(rows):
        alone = hf(row[None], position_ids=torch.arange(1, len(row) + 1)[None]).logits[0]
        torch.testing.assert_close(padded[i, ids.shape[1] - len(row):], alone, rtol=1e-10, atol=1e-10)
    # cache_position gives the positions where neither position_ids nor a padding mask does, as Llama reads it
    # (it was accepted and ignored: the logits of positions 0..5)
    torch.testing.assert_close(hf(idx, cache_position=torch.arange(2, 8)).logits,
                               hf(idx, position_ids=torch.arange(2, 8)[None]).logits, rtol=0, atol=0)
    assert not torch.equal(hf(idx, cache_position=torch.arange(2, 8)).logits, full)
    with pytest.raises(ValueError, match=re.escape("cache_position has shape (2, 6); expected (new tokens,) = (6,)")):
        hf(idx, cache_position=torch.arange(6).expand(2, 6))
    # (one of the wrong length was torch's "The expanded size of the tensor (6) must match ...")
    with pytest.raises(ValueError, match=re.escape("cache_position has shape (5,); expected (new tokens,) = (6,)")):
        hf(idx, cache_position=torch.arange(5))
    # in a cached step it gives the new tokens' positions as they are (past 4: 4 and 5, not 4 past them)
    first = hf(idx[:, :4], use_cache=True)
    step = hf(idx[:, 4:], past_key_values=getattr(first, CACHE_FIELD), cache_position=torch.arange(4, 6))
    torch.testing.assert_close(step.logits, full[:, 4:], rtol=1e-10, atol=1e-10)
    # without position_ids they come from the mask, also in a cached step (the mask's last T slots)
    first = hf(ids[:, :-2], attention_mask=mask[:, :-2], use_cache=True)
    step = hf(ids[:, -2:], attention_mask=mask, cache=getattr(first, CACHE_FIELD)).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(step[i], hf(row[None]).logits[0, -2:], rtol=1e-10, atol=1e-10)
    assert not GbattnForCausalLM.from_gpt(gpt).training
    assert GbattnForCausalLM.from_gpt(GPT(tiny_config(("boosted", {})))).training
    hf.train()
    assert getattr(hf(idx), CACHE_FIELD) is None  # training keeps no keys and values
    hf.eval()
    assert isinstance(getattr(hf(idx), CACHE_FIELD), GbattnCache)
    # a config made with use_cache=False: no cache unless the call asks for one
    uncached = GbattnForCausalLM.from_gpt(gpt, use_cache=False)
    assert uncached.config.use_cache is False and getattr(uncached(idx), CACHE_FIELD) is None
    assert isinstance(getattr(uncached(idx, use_cache=True), CACHE_FIELD), GbattnCache)


def test_an_untied_head_stays_untied_saves_and_resizes(tmp_path):
    """An untied output head is its own weight through save, load and resize_token_embeddings."""
    cfg = tiny_config(("standard", {}), tie_embeddings=False)
    hf = GbattnForCausalLM(GbattnConfig.from_model_config(cfg))
    assert hf.config.tie_word_embeddings is False and hf.model.lm_head.weight is not hf.model.wte.weight
    hf.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.model.lm_head.weight is not back.model.wte.weight
    assert torch.equal(back.model.lm_head.weight, hf.model.lm_head.weight)
    back.resize_token_embeddings(40)
    assert back.model.lm_head.weight.shape == (40, 16) and back(torch.tensor([[1, 2]])).logits.shape[-1] == 40
    # A torch.compile'd GPT is wrapped as the GPT it compiles: its weights were saved as model._orig_mod.*, which
    # from_pretrained took for missing weights and drew at random (a tied head could not be saved at all)
    gpt = GPT(cfg).eval()
    wrapped = GbattnForCausalLM.from_gpt(torch.compile(gpt))
    assert wrapped.model is gpt and not any("_orig_mod" in name for name in wrapped.state_dict())
    wrapped.save_pretrained(tmp_path / "compiled")
    idx = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "compiled")(idx).logits, gpt(idx))
    with pytest.raises(TypeError, match="from_gpt takes gbattn's GPT .* not a GbattnForCausalLM"):
        GbattnForCausalLM.from_gpt(wrapped)


def test_attn_implementation_sdpa_and_eager_load_the_same_model(tmp_path):
    """gbattn runs its own attention (F.scaled_dot_product_attention on the fast path) whatever
    attn_implementation says: "sdpa" and "eager" load, with gbattn's logits."""
    from transformers import AutoModelForCausalLM

    gpt, hf = tiny_pair(("boosted", {}), {})
    hf.save_pretrained(tmp_path)
    idx = torch.randint(0, 37, (1, 6))
    for implementation in ("sdpa", "eager"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation,
                                                      dtype=torch.float64).eval()
        torch.testing.assert_close(loaded(idx).logits, gpt(idx), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["gpt2-attnres", "llama-pre"])
def test_device_map_and_dtype_loading_keep_the_weights(layout, tmp_path):
    """The loading options users pass: device_map ("cpu", "auto", accelerate's dispatch through the meta device)
    loads gbattn's weights and nothing stays on the meta device; dtype=bfloat16 loads every weight in bfloat16
    and its logits follow gbattn's; both generate."""
    gpt, hf = tiny_pair(("boosted", {"rounds": 3}), LAYOUTS[layout])
    gpt.float()
    hf.save_pretrained(tmp_path)
    idx = torch.randint(1, 37, (2, 7))
    expected = gpt(idx)
    scale = expected.abs().max()
    for options in ({"device_map": "cpu"}, {"device_map": "auto"}, {"dtype": torch.bfloat16}):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, **options).eval()
        tensors = dict(loaded.named_parameters(), **dict(loaded.named_buffers()))
        assert not [name for name, t in tensors.items() if t.is_meta], options
        dtype = options.get("dtype", torch.float32)
        assert {t.dtype for t in loaded.parameters()} == {dtype}, options
        for name, weight in gpt.state_dict().items():
            assert torch.equal(loaded.model.state_dict()[name], weight.to(dtype)), (options, name)
        logits = loaded(idx).logits.float()
        assert (logits - expected).abs().max() <= (1e-6 if dtype == torch.float32 else 0.05) * scale, options
        assert loaded.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=3,
                               do_sample=False).shape == (2, 10)


@pytest.mark.parametrize("layout", ["gpt2-attnres", "llama-pre"])
def test_a_model_offloaded_in_parts_runs_and_an_attnres_one_is_refused(layout, tmp_path):
    """accelerate's offloading (device_map="auto" with max_memory too small for the model: blocks on the disk, loaded
    by hooks at each block's forward) gives gbattn's logits for a plain residual stream. An Attention Residuals
    stream calls its blocks' sublayers itself, so no hook loads them: it was "Cannot copy out of meta tensor" at the
    first forward; it is one line at loading, and at the forward of one placed in parts by dispatch_model."""
    from accelerate import dispatch_model

    gpt, hf = tiny_pair(("boosted", {}), LAYOUTS[layout])
    gpt.float()
    hf.save_pretrained(tmp_path / "model")
    idx = torch.randint(1, 37, (2, 7))
    # accelerate's plan for two devices, the first too small for the whole model: a plain stream is split between
    # them, an Attention Residuals one kept whole on the second (its no-split unit is the GPT, not a Block)
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    size = compute_module_sizes(hf)[""]
    plan = infer_auto_device_map(hf, max_memory={0: int(0.6 * size), 1: 3 * size, "cpu": 3 * size},
                                 no_split_module_classes=list(hf._no_split_modules))
    assert set(plan.values()) == ({0, 1} if gpt.cfg.residual == "plain" else {1})
    offloaded = dict(device_map="auto", max_memory={"cpu": 20_000}, offload_folder=str(tmp_path / "offload"))
    refused = r"an Attention Residuals model runs whole on one device, not placed in parts by a device_map \("
    if gpt.cfg.residual == "plain":
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", **offloaded).eval()
        assert "disk" in loaded.hf_device_map.values()
        torch.testing.assert_close(loaded(idx).logits, gpt(idx), rtol=1e-5, atol=1e-5)
        return
    for info in (False, True):  # (with output_loading_info, from_pretrained returns the model and the info)
        with pytest.raises(ValueError, match=f"^residual='attnres-block': {refused}"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=info, **offloaded)
    whole = dispatch_model(hf, {"": "cpu"})  # one device: it runs
    torch.testing.assert_close(whole(idx).logits, gpt(idx), rtol=1e-5, atol=1e-5)
    blocks = {f"model.blocks.{i}": "cpu" if i else "disk" for i in range(gpt.cfg.n_layers)}
    split = dispatch_model(hf, {**{f"model.{name}": "cpu" for name, _ in hf.model.named_children() if name != "blocks"},
                                **blocks}, offload_dir=str(tmp_path / "split"))
    with pytest.raises(ValueError, match=f"^residual='attnres-block': {refused}cpu, disk\\)"):
        split(idx)


@pytest.mark.parametrize(
    "case,names,value_only",
    [
        (("boosted", {"rounds": 3, "gate": "mlp"}), ["kv0", "kv1", "kv2"], []),
        (("boosted", {"gate": "scalar", "kv_source": "shared"}), ["kv0"], []),
        (("twicing", {}), ["av", "kv"], ["av"]),
        (("differential", {}), ["kv"], []),
    ],
    ids=["boosted-3", "boosted-shared", "twicing", "differential"],
)
def test_cache_holds_every_attention_call(case, names, value_only):
    """generate() returns the GbattnCache: every GBA round's K/V, Twicing's value-only A V, and
    differential attention's grouped entry (values 2E wide over half the K/V heads), per layer."""
    gpt, hf = tiny_pair(case, {})
    prompt = torch.randint(1, 37, (2, 5))
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                      pad_token_id=0, return_dict_in_generate=True)
    cache = getattr(out, CACHE_FIELD)
    assert isinstance(cache, GbattnCache) and len(cache) == 2
    for layer in cache.layers:
        assert sorted(layer.entries) == names
        for name, (k, v) in layer.entries.items():
            assert (k is None) == (name in value_only) and v.shape[:3] == (2, v.shape[1], 8)  # 5 + 4 - 1 slots
    if case[0] == "differential":
        k, v = cache.layers[0].entries["kv"]
        assert k.shape[1] == 4 and v.shape[1] == 2 and v.shape[-1] == 2 * k.shape[-1]


# ---- generate(): parity with gbattn's decoding ------------------------------------------


@pytest.mark.parametrize("block", ["gpt2", "llama"])
@pytest.mark.parametrize("residual", ["plain", "attnres-block"])
def test_generate_matches_gbattn(variant_case, residual, block):
    """Greedy generate() gives gbattn's GPT.generate(temperature=0) tokens; with and without the
    cache; a left-padded batch gives every row the continuation it gets alone."""
    layout = dict(BLOCKS[block] if block == "llama" else {}, **(ATTNRES if residual != "plain" else {}))
    gpt, hf = tiny_pair(variant_case, layout)
    prompts = [torch.randint(1, 37, (n,)) for n in (6, 3, 5)]
    new = 9
    alone = []
    for p in prompts:
        ours = gpt.generate(p[None], new, temperature=0)[0, len(p):]
        for use_cache in (True, False):
            theirs = hf.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=new,
                                 do_sample=False, use_cache=use_cache, pad_token_id=0)[0, len(p):]
            assert theirs.tolist() == ours.tolist(), f"use_cache={use_cache}"
        alone.append(ours)
    ids, mask = left_pad(prompts, torch.long)
    for use_cache in (True, False):
        together = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=use_cache,
                               pad_token_id=0)[:, ids.shape[1]:]
        for i in range(len(prompts)):
            assert together[i].tolist() == alone[i].tolist(), f"row {i}, use_cache={use_cache}"
    # Assisted decoding: the draft tokens the model rejects are cropped from its cache ("Assisted decoding requires
    # a cache"; a draft gbattn model failed in transformers' crop): greedy gives greedy's tokens, whichever drafts
    # (an end-of-text token given: transformers 4.x's prompt lookup fails without one)
    _, draft = tiny_pair(("standard", {}), {}, seed=1)
    p, greedy = prompts[0][None], dict(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=36)
    for model, other in ((hf, draft), (draft, hf)):  # (a gbattn model as the draft too)
        alone = model.generate(p, **greedy)
        for assisted in ({"assistant_model": other}, {"assistant_model": model}, {"prompt_lookup_num_tokens": 2}):
            assert torch.equal(model.generate(p, **greedy, **assisted), alone), list(assisted)


def test_gbattns_temperature_top_k_and_top_p_cut_what_transformers_warpers_cut_ties_included():
    """An exported model samples through transformers' warpers, gbattn generate through its own: the filtered
    logits must be equal bit for bit, or the same seed draws other tokens (README, "Hugging Face"). gbattn ranked
    top-p's tokens from the likeliest down and transformers from the least likely up: with tied logits (common in
    bfloat16) they kept other tokens ([1, 1, 0] at top_p=0.4: gbattn token 0, transformers token 1)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from gbattn.model.decoding import filtered_logits

    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(64, 1, dtype=torch.long)
    for temperature, top_k, top_p in ((1.0, None, 0.4), (0.7, None, 0.9), (1.3, 5, 0.5), (1.0, 3, None),
                                      (0.5, 8, 0.75), (2.0, None, 0.25)):
        logits = torch.randint(-3, 3, (64, 12), generator=generator).float()  # many ties in every row
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                      + ([TopKLogitsWarper(top_k)] if top_k else [])
                                      + ([TopPLogitsWarper(top_p)] if top_p else []))
        assert torch.equal(filtered_logits(logits, temperature, top_k, top_p), warpers(ids, logits.clone())), (
            temperature, top_k, top_p)
    tied = torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.isfinite(filtered_logits(tied, 1.0, None, 0.4)).tolist() == [[False, True, False]]


def test_beam_search_and_sampling_run_through_the_cache():
    gpt, hf = tiny_pair(("twicing", {}), BLOCKS["llama"])
    ids, mask = left_pad([torch.randint(1, 37, (n,)) for n in (5, 3)], torch.long)
    kw = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    beams = hf.generate(ids, num_beams=3, do_sample=False, **kw)
    assert torch.equal(beams, hf.generate(ids, num_beams=3, do_sample=False, use_cache=False, **kw))
    for i, row in enumerate(mask.sum(1).tolist()):  # each row's beams are those of the row alone
        alone = hf.generate(ids[i:i + 1, -row:], num_beams=3, do_sample=False, **dict(kw, attention_mask=None))
        assert beams[i, -5 - row:].tolist() == alone[0].tolist()
    torch.manual_seed(3)
    a = hf.generate(ids, do_sample=True, top_k=5, num_return_sequences=2, **kw)
    torch.manual_seed(3)
    b = hf.generate(ids, do_sample=True, top_k=5, num_return_sequences=2, use_cache=False, **kw)
    assert a.shape == (4, ids.shape[1] + 5) and torch.equal(a, b)
    # Sampling (temperature, top-k) draws the tokens gbattn's own sampler draws under the same seed, for a
    # left-padded batch too (float32 both: transformers samples from float32 scores).
    gpt.float(), hf.float()
    torch.manual_seed(11)
    ours = gpt.generate(ids, 6, temperature=0.8, top_k=6, prompt_mask=mask.bool(), compile=False)
    torch.manual_seed(11)
    theirs = hf.generate(ids, do_sample=True, temperature=0.8, top_k=6, top_p=1.0, **dict(kw, max_new_tokens=6))
    assert torch.equal(theirs, ours)


def test_generate_continues_from_a_returned_cache():
    """A second generate() given the first one's sequences and cache feeds only the new tokens
    (the cache holds the rest) and continues as generate() on the whole sequence does."""
    gpt, hf = tiny_pair(("boosted", {"rounds": 3, "gate": "mlp"}), {})
    prompt = torch.randint(1, 37, (2, 5))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    first = hf.generate(prompt, attention_mask=torch.ones_like(prompt), return_dict_in_generate=True, **kw)
    seq = first.sequences
    fed = []
    hook = hf.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    # The cache keyword's name is the installed transformers' (cache in 5.x, past_key_values in 4.x).
    again = hf.generate(seq, attention_mask=torch.ones_like(seq), **{CACHE_FIELD: getattr(first, CACHE_FIELD)}, **kw)
    hook.remove()
    assert fed == [1] * 4  # the cache holds all but the last token
    assert torch.equal(again, hf.generate(seq, attention_mask=torch.ones_like(seq), **kw))
    cache = getattr(first, CACHE_FIELD)
    cache.reset()
    assert cache.get_seq_length() == 0 and all(layer.entries == {} for layer in cache.layers)


def test_a_given_cache_is_used_with_use_cache_false():
    """As in transformers' own models, use_cache=False only stops a new cache being made: a cache that
    is passed is read and extended (it was dropped, and the logits ignored the past)."""
    gpt, hf = tiny_pair(("boosted", {}), {})
    idx = torch.randint(1, 37, (1, 6))
    cache = getattr(hf(idx[:, :4], use_cache=True), CACHE_FIELD)
    out = hf(idx[:, 4:], cache=cache, use_cache=False, attention_mask=torch.ones(1, 6))
    torch.testing.assert_close(out.logits, gpt(idx)[:, 4:])
    assert getattr(out, CACHE_FIELD) is cache and cache.get_seq_length() == 6


def test_a_cache_of_another_model_is_refused_and_a_reset_one_serves_any():
    """A GbattnCache holds one model's keys and values: given to another model (another variant, or the same one
    with other weights) it is a ValueError naming that, left untouched (it was a torch size error deep in the
    attention, or, for the same shapes, the other model's keys mixed in silently); reset, it serves any model."""
    _, boosted = tiny_pair(("boosted", {}), {})
    _, standard = tiny_pair(("standard", {}), {})
    _, retrained = tiny_pair(("boosted", {}), {}, seed=1)
    idx = torch.randint(1, 37, (2, 6))
    for other in (standard, retrained):
        cache = getattr(boosted(idx[:, :4], use_cache=True), CACHE_FIELD)
        with pytest.raises(ValueError, match="^this KV cache holds another model's keys and values"):
            other(idx[:, 4:], cache=cache)
        with pytest.raises(ValueError, match="^this KV cache holds another model's keys and values"):
            other.generate(idx, max_new_tokens=1, pad_token_id=0, **{CACHE_FIELD: cache})
        assert cache.get_seq_length() == 4  # untouched
        torch.testing.assert_close(boosted(idx[:, 4:], cache=cache).logits, boosted(idx).logits[:, 4:])
    cache.reset()
    torch.testing.assert_close(retrained(idx, cache=cache).logits, retrained(idx).logits)


# ---- initialisation ---------------------------------------------------------------------


def test_fresh_model_keeps_gbattn_init():
    cfg = tiny_config(("differential", {}), **ATTNRES)
    torch.manual_seed(5)
    gpt = GPT(cfg)
    torch.manual_seed(5)
    hf = GbattnForCausalLM(GbattnConfig.from_model_config(cfg))
    for (name, a), b in zip(gpt.state_dict().items(), hf.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert hf.model.lm_head.weight is hf.model.wte.weight
    # from_gpt marks the GPT's weights initialised: transformers' init passes leave a wrapped (trained) model's
    # weights alone (init_weights() drew them again)
    kept = {name: t.clone() for name, t in gpt.state_dict().items()}
    GbattnForCausalLM.from_gpt(gpt).init_weights()
    for name, t in gpt.state_dict().items():
        assert torch.equal(t, kept[name]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_init_replica_covers_every_parameter(variant_case, layout):
    """_init_weights (for weights missing from a checkpoint) knows every module that owns a parameter,
    and gives gbattn's values where they are constants."""
    gpt = GPT(tiny_config(variant_case, **LAYOUTS[layout]))
    for module in gpt.modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert isinstance(module, INIT_TYPES), type(module).__name__
    with torch.no_grad():
        for p in gpt.parameters():
            p.fill_(float("nan"))
    gpt.apply(lambda m: init_module(m, torch.nn.init))
    assert all(torch.isfinite(p).all() for p in gpt.parameters())
    fresh = GPT(tiny_config(variant_case, **LAYOUTS[layout]))
    for (name, a), b in zip(gpt.named_parameters(), fresh.parameters()):
        if torch.all(b == b.flatten()[0]):  # constants (norm gains, biases, AttnRes queries, gate logits)
            assert torch.equal(a, b), name


def test_missing_weights_are_initialised_like_gbattn(tmp_path):
    gpt, hf = tiny_pair(("differential", {}), ATTNRES)
    hf.float().save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    dropped = ["model.residual.queries", "model.blocks.0.ln1.weight", "model.blocks.0.attn.qkv.bias",
               "model.blocks.1.attn.lambda_q1"]
    save_file({k: v for k, v in weights.items() if k not in dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert sorted(info["missing_keys"]) == sorted(dropped)
    m = back.model
    assert m.residual.queries.abs().max() == 0 and torch.equal(m.blocks[0].ln1.weight, torch.ones(16))
    assert m.blocks[0].attn.qkv.bias.abs().max() == 0 and torch.isfinite(m.blocks[1].attn.lambda_q1).all()
    assert 0 < m.blocks[1].attn.lambda_q1.abs().max() < 1
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.attn.lambda_k1", "residual.norms.0.weight"):  # loaded
        assert torch.equal(m.get_parameter(name), weights["model." + name]), name


# ---- tokenizers -------------------------------------------------------------------------


def byte_level_tokenizer(corpus) -> Tokenizer:
    """A GPT-2-like byte-level BPE of 300 tokens trained on ``corpus`` (``--tokenizer gpt2=PATH``), its
    end-of-text token ``<|endoftext|>``."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    byte_level = Backend(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(corpus.lines("train"), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return Tokenizer("gpt2", byte_level.to_str())


def test_bpe_and_byte_level_tokenizers_keep_gbattn_ids(tmp_path):
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    bpe = get_tokenizer("bpe", corpus, vocab_size=120, verbose=False)
    gpt2 = byte_level_tokenizer(corpus)
    text = "the cat sat on the mat . a big red bird"
    for tok, eos, pad in ((bpe, "<pad>", "<pad>"), (gpt2, "<|endoftext|>", "<|endoftext|>")):
        hf = hf_tokenizer(tok, 64)
        assert len(hf) == tok.vocab_size and hf.eos_token == eos and hf.pad_token == pad
        hf.save_pretrained(tmp_path / tok.kind)
        back = AutoTokenizer.from_pretrained(tmp_path / tok.kind)
        # the paper's BPE (no decoder: pieces joined by spaces) writes a space before every piece, the first too
        leading = " " if tok.kind == "bpe" else ""
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == leading + tok.decode(tok.encode(text))
        assert back.eos_token_id == tok.encode(eos)[0]
        # A padded batch is padded on the left, as generate() needs (each row's last token is its own).
        batch = back(["the cat", text], padding=True, return_tensors="pt")
        short = len(tok.encode("the cat"))
        assert batch.input_ids[0, -short:].tolist() == tok.encode("the cat") and batch.attention_mask[0, -1] == 1
        assert batch.attention_mask[0, 0] == 0 and set(batch.input_ids[0, :-short].tolist()) == {back.pad_token_id}


@pytest.mark.parametrize("processor", ["template", "bert", "roberta", "sequence", "leading"])
def test_the_transformers_tokenizer_encodes_a_prompt_as_gbattn_does(tmp_path, processor):
    """A tokenizer whose post-processor ends a text with a special token (T5's "$A </s>", BERT's [SEP]): gbattn
    keeps only those before the text for a prompt, its transformers form kept those after it too, so generate()
    stopped at once after the </s> where `gbattn generate` went on. Now both encode the prompt alike (a pair keeps
    the separators between its texts), also saved and loaded by AutoTokenizer."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "[CLS]": 3, "[SEP]": 4, **{c: i + 5 for i, c in enumerate("abcde ")}}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "[CLS]", "[SEP]"])
    backend.post_processor = {
        "template": processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
                                                  special_tokens=[("<s>", 1), ("</s>", 2)]),
        "bert": processors.BertProcessing(("[SEP]", 4), ("[CLS]", 3)),
        "roberta": processors.RobertaProcessing(("</s>", 2), ("<s>", 1)),
        "sequence": processors.Sequence([processors.ByteLevel(), processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", 2)])]),
        "leading": processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]),
    }[processor]
    tok = Tokenizer("hf", backend.to_str())
    start = {"template": [1], "bert": [3], "roberta": [1], "sequence": [], "leading": [1]}[processor]
    assert tok.encode("abc") == [*start, 5, 6, 7]
    hf_tokenizer(tok, 64).save_pretrained(tmp_path)
    for loaded in (hf_tokenizer(tok, 64), AutoTokenizer.from_pretrained(tmp_path)):
        assert loaded("abc")["input_ids"] == tok.encode("abc")
    between = {"template": [2], "bert": [4], "roberta": [2, 2], "sequence": [], "leading": None}[processor]
    if between is not None:  # (a template without a pair: transformers' own)
        assert hf_tokenizer(tok, 64)("abc", "de")["input_ids"] == [*start, 5, 6, 7, *between, 8, 9]


def test_a_tokenizer_file_saved_with_truncation_or_padding_encodes_whole_lines(tmp_path):
    """A tokenizer.json saved with truncation and padding on (``--tokenizer gpt2=PATH``, ``hf=PATH``): gbattn
    encodes every line whole and unpadded, as its transformers form does (each line was cut to max_length
    tokens and padded to a fixed length)."""
    from tokenizers import Tokenizer as Backend

    plain = byte_level_tokenizer(load_corpus(str(write_corpus(tmp_path / "c"))))
    backend = Backend.from_str(plain.payload)
    backend.enable_truncation(max_length=3)
    backend.enable_padding(length=12, pad_id=0, pad_token="<|endoftext|>")
    (tmp_path / "tokenizer.json").write_text(backend.to_str())
    saved = get_tokenizer(f"hf={tmp_path / 'tokenizer.json'}", None)
    lines = ["the cat sat on the mat .", "a"]
    assert len(plain.encode(lines[0])) > 3
    assert saved.encode(lines[0]) == plain.encode(lines[0]) == hf_tokenizer(saved, 64).encode(lines[0])
    assert saved.encode_batch(lines) == plain.encode_batch(lines)
    # the payload without them: ids cached for the payload with them are not taken up again
    assert json.loads(saved.payload)["truncation"] is None and json.loads(saved.payload)["padding"] is None
    saved.save(tmp_path / "run-tokenizer.json")
    assert Tokenizer.load(tmp_path / "run-tokenizer.json").fingerprint == saved.fingerprint
    # padding alone (no truncation) is turned off too: the shorter lines of a batch were padded to the longest
    padded = Backend.from_str(plain.payload)
    padded.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    assert Tokenizer("hf", padded.to_str()).encode_batch(lines) == plain.encode_batch(lines)


def test_special_tokens_of_a_vocabulary_with_several_candidates():
    """A vocabulary with both ``</s>`` and ``<pad>``: eos is the real end of text, pad is ``<pad>``; one
    with ``<pad>`` alone takes it as eos too; one with neither takes the first token it marks special, and one
    without any is refused."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    def hf_kind(vocab, special=(), added=()):
        backend = Backend(models.WordLevel(vocab, unk_token="<unk>" if "<unk>" in vocab else None))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        backend.add_special_tokens(list(special))
        backend.add_tokens(list(added))  # added tokens that are not special
        return hf_tokenizer(Tokenizer("hf", backend.to_str()), 16)

    llama_like = hf_kind({"<unk>": 0, "<pad>": 1, "</s>": 2, "a": 3, "b": 4, "<s>": 5}, special=["<s>"])
    assert (llama_like.eos_token, llama_like.pad_token, llama_like.unk_token) == ("</s>", "<pad>", "<unk>")
    assert llama_like.bos_token == "<s>" and len(llama_like) == 6  # the start of text: lm-eval's rolling prefix
    # special tokens added after the trained vocabulary (Llama 3's): found among the added tokens, ids kept
    llama3_like = hf_kind({"<unk>": 0, "a": 1, "b": 2}, special=["<|begin_of_text|>", "<|end_of_text|>"])
    assert (llama3_like.bos_token, llama3_like.eos_token, llama3_like.pad_token) == (
        "<|begin_of_text|>", "<|end_of_text|>", "<|end_of_text|>")
    assert (llama3_like.bos_token_id, llama3_like.eos_token_id, len(llama3_like)) == (3, 4, 5)
    text_token = hf_kind({"<unk>": 0, "</s>": 1, "<s>": 2})  # "<s>" as text (not special): no start of text
    assert text_token.bos_token is None and text_token.eos_token == "</s>"
    added_text = hf_kind({"<unk>": 0, "</s>": 1, "<s>": 2}, added=["<s>"])  # an added token, but not a special one
    assert added_text.bos_token is None
    assert set(llama_like("a b").keys()) == {"input_ids", "attention_mask"}  # no token_type_ids
    gemma_like = hf_kind({"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "a": 4, "b": 5},
                         special=["<pad>", "<eos>", "<bos>", "<unk>"])  # Gemma's names, padding first
    assert (gemma_like.eos_token, gemma_like.pad_token, gemma_like.bos_token) == ("<eos>", "<pad>", "<bos>")
    assert (gemma_like.eos_token_id, gemma_like.bos_token_id) == (1, 2)
    pad_only = hf_kind({"<unk>": 0, "<pad>": 1, "a": 2})  # no end-of-text token: <pad> stands in, as for bpe
    assert (pad_only.eos_token, pad_only.pad_token, pad_only.unk_token) == ("<pad>", "<pad>", "<unk>")
    # none of those names: the first token it marks special; with none, refused (token 0 was made eos: an ordinary
    # token, which transformers then made special, so "xx" encoded as two tokens and decoding dropped it)
    from gbattn.errors import CheckpointError

    marked = hf_kind({"x": 0, "a": 1, "[END]": 2, "b": 3}, special=["[END]"])
    assert marked.eos_token == "[END]" and marked.eos_token_id == 2 and marked.pad_token is None
    for vocab, special in (({"x": 0, "a": 1, "b": 2}, []), ({"<unk>": 0, "a": 1}, ["<unk>"])):  # (not <unk>)
        with pytest.raises(CheckpointError, match=r"^the hf tokenizer has no end-of-text token \(none of "
                                                  r"<\|endoftext\|>, .*nor a token it marks special but its unknown "
                                                  r"one\), which its transformers form needs"):
            hf_kind(vocab, special=special)


def test_a_special_token_outside_the_vocabulary_is_refused(monkeypatch):
    """A special token that is not one of the vocabulary's would be added as a new id (an embedding
    row the model lacks): the conversion refuses it instead."""
    import re

    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from gbattn.errors import CheckpointError
    from gbattn.hf import tokenization

    tok = Tokenizer("hf", Backend(models.WordLevel({"a": 0, "b": 1}, unk_token=None)).to_str())
    monkeypatch.setattr(tokenization, "special_tokens", lambda tok, vocab, special: {"eos_token": "<new>"})
    with pytest.raises(CheckpointError, match=re.escape(
            'the hf tokenizer has 2 tokens but its transformers form has 3; special tokens {"eos_token": "<new>"} '
            'must be tokens of the vocabulary')):
        hf_tokenizer(tok, 16)


def test_an_exported_config_names_no_path_of_this_machine():
    """Every path a run's config may hold (data, a start run, the corpus, a tokenizer file) keeps only
    its last part (a tokenizer given as ``hf=PATH`` kept its whole path)."""
    from gbattn.hf.export import portable_paths

    section = {"train": {"data": "/srv/data/wiki", "init_from": "/home/me/runs/upcycled", "lr": 0.001,
                         "tokenizer": "hf=/home/me/tokenizers/tokenizer.json"},
               "data": {"corpus": "/srv/data/wiki"}, "extra": {"init_from": "../runs/base"}, "preset": "paper-small"}
    assert portable_paths(section) == {"train": {"data": "wiki", "init_from": "upcycled", "lr": 0.001,
                                                 "tokenizer": "hf=tokenizer.json"},
                                       "data": {"corpus": "wiki"}, "extra": {"init_from": "base"},
                                       "preset": "paper-small"}
    assert section["train"]["data"] == "/srv/data/wiki"  # a copy
    # the kind ends at the first "=": a path holding one keeps only its last part too
    held = portable_paths({"train": {"tokenizer": "hf=/home/me/tok=v2/tokenizer.json"}})
    assert held["train"]["tokenizer"] == "hf=tokenizer.json"
    for kept in ("gpt2", "char", "bpe"):
        assert portable_paths({"train": {"tokenizer": kept}})["train"]["tokenizer"] == kept


def test_eval_of_an_export_whose_corpus_is_elsewhere_says_the_export_kept_only_the_paths_last_part(
        tmp_path, capsys, monkeypatch):
    """README, "Hugging Face transformers": an export records its corpus by the path's last part, so `gbattn eval
    EXPORT` without the corpus there says so (it said the path was "relative to where it was trained", though the
    run was trained on an absolute one); the run itself, with a relative path, says that one is relative."""
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    write_corpus(tmp_path / "data" / "corpus")
    model_cfg, train_cfg = tiny_configs(str(tmp_path / "data" / "corpus"), max_steps=1, eval_tokens=512)
    train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # no ./corpus here
    code, _, err = run_cli(capsys, ["eval", tmp_path / "export"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'corpus'" in err and "(an export keeps only its last part)" in err and "relative" not in err
    monkeypatch.chdir(tmp_path / "data")
    model_cfg, train_cfg = tiny_configs("corpus", max_steps=1, eval_tokens=512)
    train(tmp_path / "relative", model_cfg, train_cfg, quiet=True)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, ["eval", tmp_path / "relative"])
    assert code == 2 and "(a relative path is relative to where the run was trained)" in err, err


def test_wrap_run_names_the_tokenizers_padding_and_length(tmp_path):
    """A bpe run's wrapper: the model's pad token is the tokenizer's, no eos (bpe's <pad> stands in),
    the tokenizer's model_max_length is the block size and it pads on the left, the run's step and
    weights recorded."""
    from gbattn.hf import wrap_run

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    bpe = get_tokenizer("bpe", corpus, vocab_size=120, verbose=False)
    cfg = tiny_config(("standard", {}), vocab_size=bpe.vocab_size)
    run = rundir.LoadedRun(tmp_path, GPT(cfg).eval(), cfg, None, bpe, {"model": cfg.to_dict()}, 7, "last")
    model, tokenizer = wrap_run(run)
    assert model.config.pad_token_id == tokenizer.pad_token_id == bpe.encode("<pad>")[0]
    assert model.config.eos_token_id is None and tokenizer.model_max_length == cfg.block_size
    assert model.config.gbattn["step"] == 7 and model.config.gbattn["checkpoint"] == "last"
    # a batch pads on the left, so every row ends at its last token and generate() continues from it
    mask = tokenizer(["to be or not to be " * 3, "to be"], padding=True)["attention_mask"]
    assert mask[1][0] == 0 and mask[1][-1] == 1 and all(mask[0])
    assert model.config.bos_token_id is None  # the paper's BPE has no start-of-text token
    # a vocabulary with a start-of-text token (an upcycled Llama's <s>): the model's config names it too, so
    # generate() without a prompt starts from it, as the source model's does
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    llama_like = Tokenizer("hf", backend.to_str())
    cfg = tiny_config(("standard", {}), vocab_size=llama_like.vocab_size)
    run = rundir.LoadedRun(tmp_path, GPT(cfg).eval(), cfg, None, llama_like, {"model": cfg.to_dict()}, 7, "last")
    model, tokenizer = wrap_run(run)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    unprompted = model.generate(max_new_tokens=2, do_sample=False, eos_token_id=None)
    assert unprompted.shape == (1, 3) and unprompted[0, 0] == tokenizer.bos_token_id


def test_wrap_run_given_a_path_says_it_takes_a_loaded_run(tmp_path):
    """wrap_run(path), as export_run takes a path, was "'str' object has no attribute 'tokenizer'" from inside it."""
    from gbattn.hf import wrap_run

    for given in (str(tmp_path), tmp_path):
        with pytest.raises(TypeError, match=r"wrap_run takes a loaded run \(gbattn.load_run\(path\)\), not a "
                                            rf"{type(given).__name__}"):
            wrap_run(given)


def test_a_config_from_something_other_than_a_model_config_is_refused_naming_it():
    """GbattnConfig.from_model_config({...}) was "'dict' object has no attribute 'to_dict'" from inside it."""
    from gbattn.errors import ConfigError

    with pytest.raises(ConfigError, match=r"GbattnConfig.from_model_config takes a ModelConfig .*, not a dict"):
        GbattnConfig.from_model_config(tiny_config(("standard", {})).to_dict())


def test_a_bpe_continuation_decoded_alone_keeps_its_word_boundary(tmp_path):
    """transformers' text-generation pipeline appends the decoded new tokens to the prompt: a paper's-BPE
    continuation keeps the space before its first piece ("the cat" + "sat" read "the catsat"), and the
    pipeline's text is the prompt followed by what gbattn's own decode of the whole sequence shows after it."""
    from transformers import pipeline

    from gbattn.hf import wrap_run

    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    bpe = get_tokenizer("bpe", corpus, vocab_size=120, verbose=False)
    ids = bpe.encode("the cat sat on the mat")
    hf = hf_tokenizer(bpe, 64)
    for cut in range(1, len(ids)):
        assert hf.decode(ids[:cut]) + hf.decode(ids[cut:]) == hf.decode(ids) == " " + bpe.decode(ids)
    torch.manual_seed(0)
    cfg = tiny_config(("standard", {}), vocab_size=bpe.vocab_size)
    run = rundir.LoadedRun(tmp_path, GPT(cfg).eval(), cfg, None, bpe, {"model": cfg.to_dict()}, 7, "last")
    model, tokenizer = wrap_run(run)
    prompt = bpe.decode(bpe.encode("the cat"))  # a prompt that decodes to itself
    new = run.model.generate(torch.tensor([bpe.encode(prompt)]), 4, top_k=1)[0, -4:].tolist()  # greedy
    text = pipeline("text-generation", model=model, tokenizer=tokenizer)(prompt, max_new_tokens=4, do_sample=False)
    assert text[0]["generated_text"] == f"{prompt} {bpe.decode(new)}"


def test_generate_stops_at_a_real_end_of_text_token_and_gbattn_generate_goes_on(tmp_path):
    """README: generate() of an export whose vocabulary has a real end-of-text token (GPT-2's) stops there,
    where gbattn's generation goes on for every token asked for; until then the two are the same."""
    from gbattn.hf import wrap_run

    gpt2 = byte_level_tokenizer(load_corpus(str(write_corpus(tmp_path / "c"))))
    eos = gpt2.encode("<|endoftext|>")[0]
    torch.manual_seed(0)
    cfg = tiny_config(("standard", {}), vocab_size=gpt2.vocab_size, tie_embeddings=False)
    gpt = GPT(cfg).eval()
    prompt = torch.tensor([gpt2.encode("the cat")])
    third = gpt.generate(prompt, 3, top_k=1)[0, -1]  # greedy
    assert third != eos
    with torch.no_grad():  # end-of-text's logit three times the third new token's: greedy picks it there
        gpt.lm_head.weight[eos] = 3 * gpt.lm_head.weight[third]
    run = rundir.LoadedRun(tmp_path, gpt, cfg, None, gpt2, {"model": cfg.to_dict()}, 7, "last")
    model, _ = wrap_run(run)
    assert model.generation_config.eos_token_id == eos
    ours = gpt.generate(prompt, 6, top_k=1)[0].tolist()
    theirs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                            do_sample=False)[0].tolist()
    n = prompt.shape[1]
    assert len(ours) == n + 6 and ours[n + 2] == eos and theirs == ours[:n + 3]


def test_quiet_transformers_puts_the_log_level_and_progress_bars_back():
    """The log level and the progress bars are as they were after the block: bars that were off stay off."""
    from transformers.utils import logging as hf_logging

    from gbattn.hf.export import quiet_transformers

    before, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_info()
    try:
        for enabled in (True, False):
            (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
            with quiet_transformers():
                assert hf_logging.get_verbosity() == hf_logging.ERROR and not hf_logging.is_progress_bar_enabled()
            assert hf_logging.get_verbosity() == hf_logging.INFO
            assert hf_logging.is_progress_bar_enabled() == enabled
    finally:
        hf_logging.set_verbosity(before)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


# ---- a trained run, exported ---------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GBA model trained for a few steps on tiny-shakespeare (char tokenizer), and its export."""
    root = tmp_path_factory.mktemp("hf-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GBATTN_CACHE", str(root / "cache"))
        torch.manual_seed(0)
        model_cfg, train_cfg = tiny_configs("tiny-shakespeare", max_steps=30, eval_every=30, eval_tokens=4096,
                                            batch_size=16)
        train(root / "run", model_cfg, train_cfg, quiet=True)
        assert cli_main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    return root / "run", root / "export"


def test_a_model_saved_without_its_run_is_refused_naming_both_ways_of_making_one(trained, capsys, tmp_path):
    """A model built from a GbattnConfig (not only one wrapped by from_gpt without run=) saves no run: the refusal
    said it was "saved from GbattnForCausalLM.from_gpt(model) without run=" of every such directory."""
    _, out = trained
    model = GbattnForCausalLM(GbattnConfig.from_model_config(tiny_config(("boosted", {}))))
    model.save_pretrained(tmp_path / "bare")
    shutil.copy(out / "gbattn-tokenizer.json", tmp_path / "bare")
    capsys.readouterr()  # (transformers 5's progress bar of the save)
    code, printed, err = run_cli(capsys, ["eval", tmp_path / "bare", "--threads", "1"])
    assert (code, printed) == (2, "") and err == (
        f"gbattn: error: {tmp_path / 'bare' / 'config.json'}: its gbattn section holds a model but no run (no train "
        f"section): a model saved without the run it came from (made from a GbattnConfig, or by GbattnForCausalLM."
        f"from_gpt(model) without run=), which gbattn's commands cannot read; save the model AutoModelForCausalLM "
        f"loads from a `gbattn export` (an upcycled model: write_run(up, OUT), then `gbattn export OUT`)\n")


def test_weights_saved_over_an_export_are_not_reported_as_the_exported_step(trained, capsys, tmp_path):
    """An export loaded with AutoModelForCausalLM, fine-tuned and saved with save_pretrained (or saved in another
    dtype): eval, generate and lm-eval reported the new weights as "exported weights at step 30", and a re-export
    recorded them as the run's best. The export records a digest of its weights; weights that differ from it are
    "changed", and so is a re-export of them. Saved unchanged, they stay the exported ones."""
    from gbattn.hf.lmeval import load_model

    _, out = trained
    step = json.loads((out / "config.json").read_text())["gbattn"]["step"]
    assert rundir.load_run(out).checkpoint == "exported"
    model = AutoModelForCausalLM.from_pretrained(out)
    same, tuned, again = tmp_path / "same", tmp_path / "tuned", tmp_path / "again"
    model.save_pretrained(same)
    with torch.no_grad():
        model.model.wte.weight[0, 0] += 0.25  # one value of one training step's worth
    model.save_pretrained(tuned)
    for folder in (same, tuned):
        for name in ("gbattn-tokenizer.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(out / name, folder / name)
    assert rundir.load_run(same).checkpoint == "exported"
    assert (rundir.load_run(tuned).checkpoint, rundir.load_run(tuned).step) == ("changed", step)
    assert load_model(tuned, None, torch.device("cpu"))[5] == "changed"
    assert load_model(same, None, torch.device("cpu"))[5] == "exported"
    assert cli_main(["eval", str(tuned), "--split", "valid"]) == 0
    printed = capsys.readouterr().out
    assert f"weights changed since their export at step {step}" in printed and '"checkpoint": "changed"' in printed
    assert cli_main(["export", str(tuned), "--out", str(again)]) == 0
    assert json.loads((again / "config.json").read_text())["gbattn"]["checkpoint"] == "changed"
    assert rundir.load_run(again).checkpoint == "changed"
    # upcycle's summary says so too (it read "changed weights, step 30")
    from types import SimpleNamespace

    from gbattn.upcycle import Upcycled

    source = SimpleNamespace(name="tuned", kind="gbattn", checkpoint=rundir.load_run(tuned).checkpoint, step=step)
    up = Upcycled(source, SimpleNamespace(attn="boosted", attn_options={}), {}, "zero", 1, 1, [])
    assert up.summary("out").startswith(f"upcycled gbattn tuned (weights changed since their export at step {step}) ")


def test_an_export_is_one_writer_and_replaces_nothing_a_running_analyze_or_lm_eval_still_writes(trained, tmp_path,
                                                                                                 capsys, monkeypatch):
    """export took no lock: a training started in its --out meanwhile had its tokenizer.json replaced by the export's,
    two exports at once left one's config.json beside the other's weights, and an export over an earlier one removed
    the analysis an analyze was still writing, which then wrote the replaced weights' summary beside the new ones;
    lm-eval wrote the scores of weights replaced while it ran. Each is refused in one line now."""
    run_dir, out = trained
    busy = tmp_path / "busy"
    holder = hold_lock(busy)  # a training there: named as what the holder writes, not this export
    try:
        code, printed, err = run_cli(capsys, ["export", run_dir, "--out", busy])
        assert (code, printed, err.strip().splitlines()) == (2, "", in_use(busy, "run"))
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in busy.iterdir()) == [".lock"]
    again = tmp_path / "again"
    shutil.copytree(out, again)
    (again / "analysis").mkdir()
    (again / "analysis" / "summary.json").write_text("{}")
    before = (again / "config.json").read_bytes()
    holder = hold_lock(again / "analysis", "analysis")  # an analyze of the earlier export, still running
    try:
        code, printed, err = run_cli(capsys, ["export", run_dir, "--out", again])
        assert (code, err.strip().splitlines()) == (2, in_use(again / "analysis", "analysis"))
    finally:
        holder.kill()
        holder.wait()
    assert (again / "config.json").read_bytes() == before and (again / "analysis" / "summary.json").exists()
    from gbattn.hf import lmeval

    def replaced_meanwhile(model, *args, **kwargs):
        (Path(model) / "config.json").write_bytes((Path(model) / "config.json").read_bytes() + b" ")
        return {"gbattn": {}}

    monkeypatch.setattr(lmeval, "run_lm_eval", replaced_meanwhile)
    code, printed, err = run_cli(capsys, ["lm-eval", again, "--tasks", "gbattn_toy_mc"])
    assert code == 2 and err.startswith(f"gbattn: error: {again} was replaced while lm-eval ran") and not (
        again / "lm-eval").exists()


def test_export_writes_safetensors_config_and_tokenizers(trained):
    run_dir, out = trained
    names = sorted(p.name for p in out.iterdir() if p.name != "special_tokens_map.json")  # transformers 4.x adds it
    assert names == [".lock", "config.json", "gbattn-tokenizer.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]  # (.lock: one writer, as a run directory has)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((run_dir / "config.json").read_text())
    assert config["model_type"] == "gbattn" and config["architectures"] == ["GbattnForCausalLM"]
    # a class every supported transformers version loads (5.x would write its own TokenizersBackend)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    for key in ("model", "train", "preset", "data", "seq_len"):
        assert config["gbattn"][key] == source[key], key
    assert config["gbattn"]["step"] == rundir.load_run(run_dir).step and config["gbattn"]["checkpoint"] == "best"
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.wte.weight" in keys and "model.lm_head.weight" not in keys  # tied: stored once


def test_export_loads_with_auto_classes_in_a_fresh_process(trained):
    """Offline, in a new interpreter: the Auto classes need `import gbattn.hf`, then load the model
    (same logits as the run, tie kept), the tokenizer (gbattn's ids), and with AutoModel the base model, whose
    last hidden state the run's head turns into the same logits."""
    run_dir, out = trained
    run = rundir.load_run(run_dir)
    text = "First Citizen:\nBefore we proceed"
    ids = run.tokenizer.encode(text)
    torch.save({"logits": run.model(torch.tensor([ids])).detach()}, out.parent / "ref.pt")
    code = f"""
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
try:
    AutoConfig.from_pretrained({str(out)!r})
    sys.exit("loaded without import gbattn.hf")
except ValueError as e:
    assert "gbattn" in str(e)
import gbattn.hf
model, tok = AutoModelForCausalLM.from_pretrained({str(out)!r}), AutoTokenizer.from_pretrained({str(out)!r})
assert type(model).__name__ == "GbattnForCausalLM" and not model.training
assert model.model.lm_head.weight is model.model.wte.weight
ids = tok.encode({text!r})
assert ids == {ids!r}, ids
assert tok.decode(ids) == {text!r} and tok.eos_token == "\\n" and len(tok) == {run.tokenizer.vocab_size}
ref = torch.load({str(out.parent / "ref.pt")!r}, weights_only=True)["logits"]
assert torch.allclose(model(torch.tensor([ids])).logits, ref, rtol=0, atol=1e-6)
from transformers import AutoModel
base = AutoModel.from_pretrained({str(out)!r})  # the same weights as a base model: the head's input
assert type(base).__name__ == "GbattnModel" and not base.training
features = base(torch.tensor([ids])).last_hidden_state
assert torch.allclose(base.model.lm_head(features), ref, rtol=0, atol=1e-6)
print("ok")
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_a_char_export_pads_with_no_token_of_its_text(trained):
    """A char tokenizer's only candidate, the newline, occurs in text: it must not be the padding
    token, or generate() without an attention_mask masks the prompt's newlines and the standard
    collator never trains on them. Greedy generate() of a prompt with newlines, mask given or not,
    continues it as gbattn does."""
    run_dir, out = trained
    model, tok = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    assert tok.pad_token is None and model.config.pad_token_id is None and model.generation_config.pad_token_id is None
    run = rundir.load_run(run_dir)
    prompt = "ROMEO:\nWhat say you\n"
    ids = torch.tensor([run.tokenizer.encode(prompt)])
    want = run.model.generate(ids, max_new_tokens=8, temperature=0, compile=False)[0, ids.shape[1]:]
    with torch.no_grad():
        want_first_logits = run.model(ids)[0, -1]
    enc = tok(prompt, return_tensors="pt")
    for kwargs in ({"input_ids": enc.input_ids}, dict(enc)):
        got = model.generate(**kwargs, max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        assert got.sequences[0, ids.shape[1]:].tolist() == want.tolist(), kwargs.keys()
        torch.testing.assert_close(got.logits[0][0], want_first_logits, rtol=0, atol=1e-5)


def test_gbattn_commands_take_the_exported_directory(trained, capsys):
    run_dir, out = trained
    a, b = rundir.load_run(run_dir), rundir.load_run(out)
    assert b.checkpoint == "exported" and b.step == a.step and b.model_cfg == a.model_cfg
    assert b.train_cfg == a.train_cfg and b.tokenizer.fingerprint == a.tokenizer.fingerprint
    idx = torch.tensor([a.tokenizer.encode("All:\nSpeak, speak.")])
    torch.testing.assert_close(b.model(idx), a.model(idx), rtol=0, atol=0)
    assert b.model.lm_head.weight is b.model.wte.weight
    outputs = []
    for model_dir in (run_dir, out):
        assert cli_main(["eval", str(model_dir), "--split", "valid"]) == 0
        assert cli_main(["generate", str(model_dir), "--prompt", "First", "--max-new-tokens", "12",
                         "--temperature", "0", "--no-compile"]) == 0
        outputs.append(capsys.readouterr().out)
    evals = [json.loads(o.splitlines()[1]) for o in outputs]
    assert evals[0]["loss"] == pytest.approx(evals[1]["loss"], rel=1e-6) and evals[1]["checkpoint"] == "exported"
    assert outputs[0].split("---")[0].splitlines()[2:] == outputs[1].split("---")[0].splitlines()[2:]
    # An export holds the run's best weights: asking it for the last ones is an error, not ignored.
    for argv in (["eval", out, "--checkpoint", "last"], ["generate", out, "--prompt", "F", "--checkpoint", "last"],
                 ["analyze", out, "--checkpoint", "last"], ["lm-eval", out, "--tasks", "gbattn_toy_mc",
                                                            "--include-path", LMEVAL_DATA, "--checkpoint", "last"]):
        assert cli_main([str(a) for a in argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"gbattn: error: {out} is an exported directory holding its run's best "
                                            f"weights: --checkpoint last (from Python: checkpoint='last') does not "
                                            f"apply (export the run's last weights with `gbattn export RUN "
                                            f"--checkpoint last`)"], argv
    assert rundir.load_run(out, "best").checkpoint == "exported"  # the one it holds may be named


def test_gbattn_commands_take_a_sharded_save(trained, tmp_path, capsys):
    """A model saved by transformers in shards (``model.safetensors.index.json``), with the exported
    tokenizer files beside it, evaluates as the export it came from."""
    from transformers import AutoModelForCausalLM

    _, out = trained
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(out).save_pretrained(sharded, max_shard_size="100KB")
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("model-*.safetensors"))) >= 2
    for name in ("tokenizer.json", "tokenizer_config.json", "gbattn-tokenizer.json"):
        shutil.copy(out / name, sharded / name)
    a, b = rundir.load_run(out), rundir.load_run(sharded)
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[name], tensor), name
    losses = []
    for model_dir in (out, sharded):
        assert cli_main(["eval", str(model_dir), "--split", "valid"]) == 0
        losses.append(json.loads(capsys.readouterr().out.splitlines()[1])["loss"])
    assert losses[0] == losses[1]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (sharded / shard).unlink()
    assert cli_main(["eval", str(sharded)]) == 2
    assert f"names shard '{shard}', which is not a file in" in capsys.readouterr().err


def test_an_export_holds_no_path_of_this_machine_and_eval_takes_data(tmp_path, capsys):
    """A run trained on a file given by absolute path: its export names the file only, and
    ``gbattn eval EXPORT --data PATH`` evaluates it where the file is (fingerprint checked)."""
    data = write_corpus(tmp_path / "corpus")
    train(tmp_path / "run", *tiny_configs(str(data), max_steps=4), quiet=True)
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    exported = (tmp_path / "export" / "config.json").read_text()
    assert str(tmp_path) not in exported and json.loads(exported)["gbattn"]["train"]["data"] == data.name
    results = []
    for argv in (["eval", tmp_path / "run"], ["eval", tmp_path / "export", "--data", data]):
        assert cli_main([str(a) for a in argv]) == 0
        results.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)
    other = write_corpus(tmp_path / "other", seed=1)
    assert cli_main(["eval", str(tmp_path / "export"), "--data", str(other)]) == 2
    assert "is not the data the run was trained on" in capsys.readouterr().err
    # A folder named as a corpus gbattn knows (tiny-shakespeare), exported as that name: without --data the bundled
    # corpus was loaded and refused as "--data tiny-shakespeare is not the data ...", a --data never typed
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    config["gbattn"]["train"]["data"] = "tiny-shakespeare"
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    assert cli_main(["eval", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gbattn: error: the data {tmp_path / 'export'} recorded (tiny-shakespeare) is not the data "
                          f"the run was trained on") and err.count("\n") == 1, err
    assert (f"; that is the path {tmp_path / 'export'} recorded (an export keeps only its last part): pass --data PATH "
            f"where the corpus is now; pass --allow-other-data to evaluate on it anyway\n") in err, err


def test_an_export_over_the_file_size_limit_is_one_line_and_keeps_an_earlier_export(trained, tmp_path, capsys):
    """A full disk or a file-size limit (`ulimit -f`) under the weights' write ended export in safetensors'
    SafetensorError traceback, exit 1: one line naming --out and the reason, the earlier export left whole."""
    import resource

    run_dir, out = trained
    earlier = tmp_path / "earlier"
    shutil.copytree(out, earlier)
    weights = (earlier / "model.safetensors").read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for target, kept in ((tmp_path / "new", "nothing was written"), (earlier, "an earlier export there is kept")):
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(weights) // 2, hard))  # (Python ignores SIGXFSZ)
        try:
            code = cli_main(["export", str(run_dir), "--out", str(target)])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        err = capsys.readouterr().err
        assert (code, err) == (2, f"gbattn: error: could not write the export to {target} (File too large); {kept}\n")
    assert (earlier / "model.safetensors").read_bytes() == weights and (earlier / "config.json").is_file()
    assert not (tmp_path / "new" / "config.json").exists()


def test_export_errors_are_one_line(trained, tmp_path, capsys):
    run_dir, out = trained
    assert cli_main(["export", str(run_dir), "--out", str(run_dir)]) == 2
    assert "is the run directory itself" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "nothing does not exist (a gbattn run directory or an exported one is expected)" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "gbattn-tokenizer.json").unlink()  # as in a directory written by save_pretrained or Trainer
    assert cli_main(["generate", str(broken), "--prompt", "a"]) == 2
    assert "has no gbattn-tokenizer.json" in capsys.readouterr().err
    no_weights = tmp_path / "no-weights"
    shutil.copytree(out, no_weights)
    (no_weights / "model.safetensors").unlink()
    assert cli_main(["eval", str(no_weights)]) == 2
    assert "has no model.safetensors" in capsys.readouterr().err
    wider = tmp_path / "wider"
    shutil.copytree(out, wider)
    config = without_standard_names(json.loads((wider / "config.json").read_text()))
    config["gbattn"]["model"]["block_size"] += 1  # the position table gets one more row than its weights
    (wider / "config.json").write_text(json.dumps(config))
    assert cli_main(["eval", str(wider)]) == 2
    err = capsys.readouterr().err
    assert "do not match its config (size mismatch for wpe.weight" in err and len(err.strip().splitlines()) == 1, err
    # from Python, a directory that is no path is named (pathlib's "expected str, bytes or os.PathLike object")
    from gbattn.hf.export import export_run

    for args, name in (((None, tmp_path / "o"), "run_dir"), ((run_dir, None), "out")):
        with pytest.raises(TypeError, match=f"^{name} of type NoneType: give a run directory"):
            export_run(*args)


def test_export_records_which_weights_it_holds(trained, tmp_path, capsys):
    """--checkpoint last exports the run's last weights (and says so); an export of an export keeps the
    record of the run's weights it holds; --out naming a file is a one-line error."""
    run_dir, out = trained
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "last"), "--checkpoint", "last"]) == 0
    assert "(last weights)" in capsys.readouterr().out
    last = rundir.load_run(run_dir, "last")
    config = json.loads((tmp_path / "last" / "config.json").read_text())
    assert config["gbattn"]["checkpoint"] == "last" and config["gbattn"]["step"] == last.step
    assert cli_main(["export", str(out), "--out", str(tmp_path / "again")]) == 0
    assert "(its weights)" in capsys.readouterr().out
    assert json.loads((tmp_path / "again" / "config.json").read_text())["gbattn"]["checkpoint"] == "best"
    # An export of the last weights asked for the best ones: refused as the other way round (it was evaluated, exit 0)
    assert cli_main(["eval", str(tmp_path / "last"), "--checkpoint", "best"]) == 2
    assert capsys.readouterr().err == (f"gbattn: error: {tmp_path / 'last'} is an exported directory holding its run's "
                                       f"last weights: --checkpoint best (from Python: checkpoint='best') does not "
                                       f"apply (export the run's best weights with `gbattn export RUN --checkpoint "
                                       f"best`)\n")
    never = tmp_path / "never-evaluated"  # killed before its first evaluation: its last weights are its only ones
    shutil.copytree(run_dir, never, ignore=shutil.ignore_patterns(rundir.BEST))
    assert cli_main(["export", str(never), "--out", str(tmp_path / "only")]) == 0
    assert f"exported {never} (last weights)" in capsys.readouterr().out  # it said "(best weights)" and recorded best
    assert json.loads((tmp_path / "only" / "config.json").read_text())["gbattn"]["checkpoint"] == "last"
    (tmp_path / "a-file").write_text("x")
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert "a-file is a file, not a directory" in err and len(err.strip().splitlines()) == 1, err


def test_export_refuses_its_run_by_any_name_needs_out_and_says_best(trained, tmp_path, capsys, monkeypatch):
    """--out naming the run directory by a relative path or a link to it is the run itself (not "holds
    a run"); --out is required; a plain export says it holds the best weights."""
    run_dir, _ = trained
    (tmp_path / "link").symlink_to(run_dir)
    monkeypatch.chdir(run_dir.parent)
    for out in (run_dir.name, str(tmp_path / "link")):
        assert cli_main(["export", str(run_dir), "--out", out]) == 2
        assert "is the run directory itself" in capsys.readouterr().err, out
    code, _, err = run_cli(capsys, ["export", run_dir])
    assert code == 2 and "the following arguments are required: --out" in err
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "best")]) == 0
    assert f"exported {run_dir} (best weights) to {tmp_path / 'best'}" in capsys.readouterr().out


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.name != ".lock"}  # (its token)


def test_an_export_killed_while_writing_is_not_taken_for_one_and_is_done_again(trained, tmp_path, capsys, monkeypatch):
    """An export killed (kill -9: nothing cleans up) as it writes gbattn's tokenizer file, after the model and
    transformers' tokenizer: --out held config.json and the weights, so transformers loaded the half-written
    directory, gbattn asked for a tokenizer file to be copied in, and exporting again was refused ('holds a
    transformers checkpoint of a gbattn model'). Now nothing in --out is taken for a model, and a new export
    gives the complete directory."""
    from gbattn.data.tokenizer import Tokenizer as GbattnTokenizer
    from gbattn.hf import export

    run_dir, reference = trained
    out = tmp_path / "killed"
    with monkeypatch.context() as patched:
        def killed(self, path):
            raise KeyboardInterrupt

        patched.setattr(GbattnTokenizer, "save", killed)
        patched.setattr(export.shutil, "rmtree", lambda *a, **k: None)  # a kill -9 removes nothing
        with pytest.raises(KeyboardInterrupt):
            export.export_run(run_dir, out)
    assert not (out / "config.json").exists()  # so neither gbattn nor transformers takes it for a model
    code, _, err = run_cli(capsys, ["generate", out, "--prompt", "a"])
    assert code == 2 and "holds an export that did not finish" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(capsys, ["export", run_dir, "--out", out])
    assert code == 0, err
    assert _files(out) == _files(reference) and [p.name for p in out.iterdir() if p.is_dir()] == []
    # The staging folder of an export killed in another process is removed by the next export; one of a process
    # still alive (here: pytest's parent) or of another host is left alone.
    finished = subprocess.Popen(["true"])
    finished.wait()
    host = socket.gethostname()
    names = (f".export.tmp{finished.pid}@{host}", f".export.tmp{os.getppid()}@{host}", f".export.tmp{finished.pid}@x")
    for name in names:
        (out / name).mkdir()
        (out / name / "model.safetensors").write_bytes(b"half")
    code, _, err = run_cli(capsys, ["export", run_dir, "--out", out])
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(names[1:])


@pytest.mark.parametrize("moved", range(6))  # six files: config.json is the last
def test_an_export_killed_while_replacing_an_earlier_one_never_looks_complete(trained, tmp_path, capsys, monkeypatch,
                                                                                moved):
    """Killed after ``moved`` of the staged files are in place over an earlier export (of the run's last
    weights): the earlier config.json went first, so no mix of old and new files is loaded as an export;
    gbattn says in one line that the export did not finish, and exporting again completes it."""
    from gbattn.hf import export

    run_dir, reference = trained
    out = tmp_path / "again"
    assert cli_main(["export", str(run_dir), "--out", str(out), "--checkpoint", "last"]) == 0
    capsys.readouterr()
    replace, done = os.replace, []

    def killed_after(src, dst):  # os is one module: other renames (atomic writes in the staging folder) go on
        if Path(dst).parent == out:
            if len(done) == moved:
                raise KeyboardInterrupt
            done.append(Path(dst).name)
        replace(src, dst)

    with monkeypatch.context() as patched:
        patched.setattr(export.os, "replace", killed_after)
        patched.setattr(export.shutil, "rmtree", lambda *a, **k: None)
        with pytest.raises(KeyboardInterrupt):
            export.export_run(run_dir, out)
    assert "config.json" not in done and not (out / "config.json").exists()
    code, _, err = run_cli(capsys, ["eval", out])
    assert code == 2 and "holds an export that did not finish" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(capsys, ["export", run_dir, "--out", out])
    assert code == 0, err
    assert _files(out) == _files(reference) and [p.name for p in out.iterdir() if p.is_dir()] == []


@pytest.mark.parametrize("moved", range(1, 5))  # gbattn's tokenizer file is the first, config.json the sixth
def test_an_export_that_fails_while_moving_its_files_in_is_called_unfinished_and_done_again(trained, tmp_path, capsys,
                                                                                           monkeypatch, moved):
    """An export into a new --out that fails (a full disk: an OSError, its staging folder removed as it stops)
    after ``moved`` of its files are in place: gbattn's tokenizer file moves first, so what is left is called an
    export that did not finish and the next export replaces it. Had the weights moved in before it, --out would
    hold model.safetensors alone, "a model directory" that every later export to it refuses."""
    from gbattn.hf import export

    run_dir, reference = trained
    out = tmp_path / "failed"
    replace, done = os.replace, []

    def full_after(src, dst):
        if Path(dst).parent == out:
            if len(done) == moved:
                raise OSError(28, "No space left on device")
            done.append(Path(dst).name)
        replace(src, dst)

    with monkeypatch.context() as patched:
        patched.setattr(export.os, "replace", full_after)
        with pytest.raises(OSError, match="No space left"):
            export.export_run(run_dir, out)
    assert done[0] == "gbattn-tokenizer.json" and not any(p.is_dir() for p in out.iterdir())  # no staging folder
    code, _, err = run_cli(capsys, ["eval", out])
    assert code == 2 and "holds an export that did not finish" in err, err
    code, _, err = run_cli(capsys, ["export", run_dir, "--out", out])
    assert code == 0, err
    assert _files(out) == _files(reference)


def test_a_sharded_export_over_a_single_file_one_leaves_no_earlier_weights_file(trained, tmp_path, monkeypatch):
    """An export whose weights come as shards (a model over transformers' shard size) over an earlier export
    of one model.safetensors: the earlier file goes, or transformers and gbattn would load it beside or instead
    of the shards."""
    from gbattn.hf import export

    run_dir, _ = trained
    out = tmp_path / "over"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    save = GbattnForCausalLM.save_pretrained
    monkeypatch.setattr(export.GbattnForCausalLM, "save_pretrained",
                        lambda self, path, **kw: save(self, path, max_shard_size="100KB", **kw))
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    assert not (out / "model.safetensors").exists() and len(list(out.glob("model-*.safetensors"))) >= 2
    # each shard readable as the other files are (transformers writes them 0600)
    assert {(p.stat().st_mode & 0o777) for p in out.glob("model*.safetensors*")} == {
        (out / "config.json").stat().st_mode & 0o777}
    exported, run = rundir.load_run(out), rundir.load_run(run_dir)
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(exported.model.state_dict()[name], tensor), name


def test_an_export_over_an_earlier_one_leaves_none_of_its_weights_and_refuses_a_directory_in_the_way(
        trained, tmp_path, capsys):
    """Exporting over an earlier export whose weights were sharded (or were a single file where shards
    now come) left the earlier weight files beside the new ones, for transformers to load; a directory
    named config.json in --out was an IsADirectoryError traceback."""
    run_dir, reference = trained
    out = tmp_path / "over"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    for stale in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "model.safetensors.index.json"):
        (out / stale).write_text("{}")
    (out / "model-00003-of-00003.safetensors").symlink_to(tmp_path / "gone")  # a link to a shard no longer there
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    assert _files(out) == _files(reference)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())  # no link left
    blocked = tmp_path / "blocked"
    (blocked / "config.json").mkdir(parents=True)
    code, _, err = run_cli(capsys, ["export", run_dir, "--out", blocked])
    assert code == 2 and "has a directory named config.json where the export writes that file" in err, err
    assert sorted(p.name for p in blocked.iterdir()) == [".lock", "config.json"]  # no staging folder left
    # a link to a folder where the export writes a file is replaced, not refused; the folder stays as it was
    elsewhere, linked = tmp_path / "elsewhere", tmp_path / "linked"
    elsewhere.mkdir()
    (elsewhere / "kept").write_text("x")
    linked.mkdir()
    (linked / "tokenizer.json").symlink_to(elsewhere)
    assert cli_main(["export", str(run_dir), "--out", str(linked)]) == 0
    assert not (linked / "tokenizer.json").is_symlink() and _files(linked) == _files(reference)
    assert _files(elsewhere) == {"kept": b"x"}


def test_an_export_over_an_earlier_one_leaves_none_of_its_tokenizer_side_files(trained, tmp_path):
    """transformers 4.x writes special_tokens_map.json beside the tokenizer, 5.x does not, and both read it over
    tokenizer_config.json: an export made under 5.x over one of a paper's-BPE run made under 4.x kept the earlier
    map, and AutoTokenizer loaded a char tokenizer with '<pad>' and '<unk>' as new tokens past the model's
    vocabulary, '<pad>' its end-of-text token. Files of that kind the new export does not write are removed."""
    run_dir, reference = trained
    out = tmp_path / "over"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    earlier = {"eos_token": "<pad>", "pad_token": "<pad>", "unk_token": "<unk>"}  # what 4.x wrote for the BPE run
    (out / "special_tokens_map.json").write_text(json.dumps(earlier))
    (out / "added_tokens.json").write_text(json.dumps({"<extra>": 99}))
    (out / "chat_template.jinja").write_text("{{ messages }}")
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    assert _files(out) == _files(reference)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "\n" and len(tok) == rundir.load_run(run_dir).tokenizer.vocab_size


def test_an_export_over_an_earlier_one_leaves_none_of_its_analysis(trained, tmp_path):
    """`gbattn analyze EXPORT` writes EXPORT/analysis (summary.json and its figures) of the exported weights, and
    `gbattn lm-eval EXPORT` EXPORT/lm-eval (results and samples): an export of other weights over it kept them, and
    they read as the new export's (as `train --restart` once kept a run's). They go, as with --restart; the folders'
    other files stay."""
    run_dir, reference = trained
    out = tmp_path / "over"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    analysis, scores = out / rundir.ANALYSIS_DIR, out / rundir.LM_EVAL_DIR
    analysis.mkdir(), scores.mkdir()
    for name in ("summary.json", "gates.png", "entropy.pdf", "norms.png", "my-notes.md", "gates.svg"):
        (analysis / name).write_text("x")
    (analysis / "summary.json").write_text(json.dumps(dict.fromkeys(rundir.ANALYSIS_SUMMARY_KEYS)))  # analyze's
    for name in ("results-toy.json", "samples-toy-toy.jsonl", "results-a+b-last.json", "my-notes.md"):
        (scores / name).write_text("x")
    assert cli_main(["export", str(run_dir), "--out", str(out), "--checkpoint", "last"]) == 0
    assert sorted(p.name for p in analysis.iterdir()) == ["gates.svg", "my-notes.md"]
    assert [p.name for p in scores.iterdir()] == ["my-notes.md"]
    assert _files(out).keys() == _files(reference).keys()


def test_exported_weights_follow_a_strict_umask(trained, tmp_path):
    """Under umask 077 the weights are private like every other file export writes (not 0644); under 002, group-
    writable like them (not 0644)."""
    run_dir, _ = trained
    # (002: a group's shared folder, the weights group-writable too, as every other file)
    for umask, name, mode in ((0o077, "private", 0o600), (0o002, "shared", 0o664)):
        callers = os.umask(umask)
        try:
            assert cli_main(["export", str(run_dir), "--out", str(tmp_path / name)]) == 0
        finally:
            os.umask(callers)
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / name).iterdir()}
        assert set(modes.values()) == {mode}, modes


# ---- transformers.Trainer ----------------------------------------------------------------


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):  # labels are the inputs: the model shifts them
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def test_trainer_lowers_the_loss_and_its_checkpoint_loads(trained, tmp_path):
    run_dir, _ = trained
    run = rundir.load_run(run_dir)
    tokenizer = hf_tokenizer(run.tokenizer, run.model_cfg.block_size)
    text = ROOT.joinpath("tests/data/lmeval/gbattn_toy_ppl.jsonl").read_text()
    text = "".join(json.loads(line)["text"] + "\n\n" for line in text.splitlines()) * 8
    ids = torch.tensor(run.tokenizer.encode(text))
    rows = ids[: len(ids) // 32 * 32].view(-1, 32)
    train_rows, held = rows[:-4], rows[-4:]
    torch.manual_seed(0)
    model = GbattnForCausalLM(GbattnConfig.from_model_config(run.model_cfg, pad_token_id=tokenizer.pad_token_id))

    def held_loss(m):
        m.eval()
        with torch.no_grad():
            return float(m(held, labels=held).loss)

    before = held_loss(model)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("num_items_in_batch")), with_kwargs=True)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=1, logging_steps=5,
                             save_steps=10, report_to="none", use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, seed=0, gradient_checkpointing=True)
    # Rows of one length: no padding (a char tokenizer has no padding token, see tokenization.py).
    Trainer(model=model, args=args, train_dataset=Rows(train_rows), processing_class=tokenizer,
            data_collator=default_data_collator).train()
    after = held_loss(model)
    assert after < before - 0.3, (before, after)
    assert model.is_gradient_checkpointing  # (the Trainer turned on gbattn's per-block recomputation)
    # The loss is divided by the Trainer's count of one optimizer step's labels (2 micro-batches of 4 rows):
    # transformers 5 counts the shifted labels (31 a row); 4.x counted every label (32 a row), which no position
    # predicts of a row's first, and is given no count: each batch's own mean is the loss.
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert int(seen[0]) == 2 * 4 * 31
    else:
        assert seen[0] is None
    checkpoint = tmp_path / "checkpoint-10"
    back = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert back.model.lm_head.weight is back.model.wte.weight
    torch.testing.assert_close(back(held).logits, model(held).logits, rtol=0, atol=1e-6)
    assert AutoTokenizer.from_pretrained(checkpoint).encode("Speak") == run.tokenizer.encode("Speak")


def test_trainers_loss_is_gbattns_loss_under_every_transformers_tested(tmp_path):
    """Under transformers 4.57, Trainer divided the summed loss by every label's count, a row's first too (which no
    position predicts): its loss, gradients and eval_loss were T/(T-1) too small (3.4557 for gbattn's 3.9494 at T=8).
    At learning rate 0, the logged loss and eval_loss are gbattn's loss of the batch under both."""
    gpt, hf = tiny_pair(("boosted", {"rounds": 2}), {})
    hf = hf.float()
    idx = torch.randint(0, 37, (2, 8))
    with torch.no_grad():
        expected = float(hf(idx, labels=idx).loss)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"input_ids": idx[i], "labels": idx[i]}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             max_steps=1, learning_rate=0.0, logging_steps=1, report_to="none", save_strategy="no",
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=hf, args=args, train_dataset=Rows(), data_collator=default_data_collator)
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [pytest.approx(expected, rel=1e-4)]
    assert trainer.evaluate(Rows())["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_labels_of_another_shape_or_outside_the_vocabulary_are_refused():
    """Labels already shifted by the caller, transposed or flattened were cross_entropy's "Expected
    input batch_size (20) to match target batch_size (16)" (counting tokens, not rows) or an IndexError."""
    _, hf = tiny_pair(("standard", {}), {})
    idx = torch.randint(0, 37, (4, 6))
    for labels in (idx[:, 1:], idx.T.contiguous(), idx.flatten()):
        with pytest.raises(ValueError, match=r"labels of shape .* for input_ids of shape \(4, 6\): labels are the "
                                             r"input ids \(-100 = ignored\), shifted inside"):
            hf(idx, labels=labels)
    assert torch.isfinite(hf(idx, labels=idx).loss)
    # checked as the GPT's own targets: a label past the vocabulary was cross_entropy's "Target 37 is out of bounds"
    wrong = idx.clone()
    wrong[1, 3] = 37
    with pytest.raises(ValueError, match=r"target 37 outside the vocabulary: targets are 0 \.\. 36"):
        hf(idx, labels=wrong)


def test_trainer_label_smoothing_shifts_the_labels(tmp_path):
    """Trainer's label smoother (label_smoothing_factor) shifts the labels only for a causal LM named
    in transformers' table of them; GbattnForCausalLM was not, so each position was trained on its
    own input token, silently."""
    from transformers.trainer_pt_utils import LabelSmoother

    _, hf = tiny_pair(("boosted", {"rounds": 2}), {})
    idx = torch.randint(0, 37, (4, 10))
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to="none", use_cpu=True)
    trainer = Trainer(model=hf, args=args, data_collator=default_data_collator)
    with torch.no_grad():
        loss = trainer.compute_loss(hf, {"input_ids": idx, "labels": idx})
        out = hf(idx)
    smoother = LabelSmoother(epsilon=0.1)
    torch.testing.assert_close(loss, smoother(out, idx, shift_labels=True), rtol=0, atol=0)
    assert (loss - smoother(out, idx)).abs() > 1e-3


def test_loss_with_num_items_in_batch_is_the_sum_over_that_count():
    gpt, hf = tiny_pair(("standard", {}), {})
    idx = torch.randint(0, 37, (2, 8))
    total = F.cross_entropy(gpt(idx)[:, :-1].flatten(0, 1), idx[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(hf(idx, labels=idx, num_items_in_batch=torch.tensor(50)).loss, total / 50)


# ---- lm-evaluation-harness ------------------------------------------------------------------


def local_tasks(directory: Path) -> Path:
    """tests/data/lmeval's task YAMLs with absolute data paths (the harness reads them relative to the
    working directory) and the datasets cache in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for yaml in LMEVAL_DATA.glob("*.yaml"):
        text = yaml.read_text()
        rel = f"tests/data/lmeval/{yaml.stem}.jsonl"
        assert rel in text
        text = text.replace(rel, str(ROOT / rel)).replace("  data_files:", f"  cache_dir: {directory / 'hf'}\n"
                                                                              "  data_files:")
        (directory / yaml.name).write_text(text)
    return directory


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full is Linux's")
def test_lm_eval_writes_its_results_where_stderr_cannot_be_written(trained, tmp_path):
    """`gbattn lm-eval ... 2>/dev/full`: the harness draws its progress bar on stderr, which failed there with
    ENOSPC, and no results file was written (status 2). The program's stderr drops what it cannot write."""
    run_dir, _ = trained
    out = tmp_path / "scores.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "gbattn", "lm-eval", str(run_dir), "--tasks", "gbattn_toy_mc",
                               "--include-path", str(local_tasks(tmp_path / "tasks")), "--output", str(out),
                               "--device", "cpu"], stdout=subprocess.PIPE, stderr=full, text=True, env=env,
                              timeout=600)
    assert done.returncode == 0 and json.loads(out.read_text())["results"]["gbattn_toy_mc"], done.stdout[-2000:]


def gbattn_loglikelihood(model: GPT, ids: list[int], n_target: int, max_len: int) -> float:
    """Sum of log p of the last ``n_target`` tokens of ``ids``, each given the tokens before it, from
    an input of at most ``max_len`` tokens ending just before the last token."""
    window = ids[-(max_len + 1):]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([window[:-1]]))[0].double(), -1)
    targets = torch.tensor(window[1:])
    return float(logp[torch.arange(len(targets)), targets][-n_target:].sum())


def gbattn_rolling(model: GPT, ids: list[int], prefix: int, max_len: int) -> float:
    """A document's log-likelihood in lm-eval's windows: the first max_len tokens after ``prefix``, then
    each next max_len tokens given the max_len tokens before the last of them (no token scored twice)."""
    total = gbattn_loglikelihood(model, [prefix] + ids[:max_len], min(max_len, len(ids)), max_len)
    for start in range(max_len, len(ids), max_len):
        end = min(start + max_len, len(ids))
        total += gbattn_loglikelihood(model, ids[:end], end - start, max_len)
    return total


def test_lm_eval_local_tasks_equal_gbattn_loglikelihoods(trained, tmp_path, capsys):
    """The harness's log-likelihoods on local tasks equal gbattn's own computation; documents longer
    than the block size log no tokenizer warning of "indexing errors" (the harness windows them)."""
    import logging

    warned = []
    catcher = logging.Handler()
    catcher.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("transformers.tokenization_utils_base").addHandler(catcher)
    run_dir, out = trained
    tasks = local_tasks(tmp_path / "tasks")
    run = rundir.load_run(run_dir)
    # the harness's windows are the input tokens the run trained on (its seq_len, block_size - 1 here): with learned
    # positions the last one never trained (windows of block_size scored through it)
    L, eos = run.seq_len, run.tokenizer.encode("\n")[0]
    assert run.model_cfg.block_size - 1 == L
    argv = ["--tasks", " gbattn_toy_mc, gbattn_toy_ppl", "--include-path", str(tasks), "--batch-size", "4",
            "--log-samples", "--device", "cpu"]
    results = {}
    for model_dir in (run_dir, out):
        assert cli_main(["lm-eval", str(model_dir), *argv]) == 0
        printed = capsys.readouterr().out
        assert "|gbattn_toy_mc " in printed and "bits_per_byte" in printed and "acc_norm" in printed
        folder = model_dir / "lm-eval"
        results[model_dir] = json.loads((folder / "results-gbattn_toy_mc+gbattn_toy_ppl.json").read_text())
        assert '"/' not in json.dumps(results[model_dir]) and "samples" not in results[model_dir]  # no absolute path
        assert results[model_dir]["gbattn"]["step"] == run.step and results[model_dir]["gbattn"]["max_length"] == L
        assert results[model_dir]["gbattn"]["versions"] == software_versions()  # (none was recorded)
        assert results[model_dir]["gbattn"]["logits_cache"] is False  # (the harness's model_args record is null)
        assert results[model_dir]["gbattn"]["block_size"] == run.model_cfg.block_size
        # the harness's record of how it ran (null for a model passed in memory, unless given)
        assert (results[model_dir]["config"]["batch_size"], results[model_dir]["config"]["device"]) == (4, "cpu")
        # relative to the working directory, or (outside it, as pytest's folder mostly is) its last two parts
        assert results[model_dir]["gbattn"]["model"] == (
            model_dir.resolve().relative_to(Path.cwd().resolve()).as_posix()
            if model_dir.resolve().is_relative_to(Path.cwd().resolve()) else "/".join(model_dir.parts[-2:]))
        assert results[model_dir]["gbattn"]["command"].startswith(f"gbattn lm-eval {model_dir.name} --tasks")
        assert results[model_dir]["gbattn"]["checkpoint"] == ("best" if model_dir == run_dir else "exported")
        samples = {t: [json.loads(line) for line in (folder / f"samples-{t}-gbattn_toy_mc+gbattn_toy_ppl.jsonl")
                       .read_text().splitlines()] for t in ("gbattn_toy_mc", "gbattn_toy_ppl")}
        assert len(samples["gbattn_toy_mc"]) == 6 and len(samples["gbattn_toy_ppl"]) == 4
        for s in samples["gbattn_toy_mc"]:
            context = run.tokenizer.encode(s["doc"]["question"])
            for choice, (ll, _) in zip(s["doc"]["choices"], s["filtered_resps"]):
                cont = run.tokenizer.encode(" " + choice)
                assert ll == pytest.approx(gbattn_loglikelihood(run.model, context + cont, len(cont), L), rel=1e-5)
        windows = 0
        for s in samples["gbattn_toy_ppl"]:
            ids = run.tokenizer.encode(s["doc"]["text"])
            windows += -(-len(ids) // L)
            got = s["filtered_resps"][0] if isinstance(s["filtered_resps"], list) else s["filtered_resps"]
            assert got == pytest.approx(gbattn_rolling(run.model, ids, eos, L), rel=1e-5)
        assert windows > 6  # documents longer than block_size: several windows each
    logging.getLogger("transformers.tokenization_utils_base").removeHandler(catcher)
    assert not [m for m in warned if m.startswith("Token indices sequence length")], warned
    from gbattn.hf.lmeval import GbattnLM, load_model

    model, tokenizer, _, max_length, _, _ = load_model(out, "best", torch.device("cpu"))
    lm = GbattnLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1, max_length=max_length)
    assert lm.prefix_token_id == eos and lm.tok_decode(tokenizer.encode("All:\nSpeak")) == "All:\nSpeak"
    a, b = (results[d]["results"] for d in (run_dir, out))
    for task in ("gbattn_toy_mc", "gbattn_toy_ppl"):
        for key, value in a[task].items():
            if isinstance(value, float):
                assert b[task][key] == pytest.approx(value, rel=1e-5), (task, key)


def test_lm_eval_scores_each_request_alone_whatever_tokens_its_neighbours_share(trained, tmp_path, capsys):
    """The harness's logits cache (its default) scores one request of those sharing context + continuation[:-1] tokens
    and reuses its logits for the rest, also where their split between context and continuation differs: "Befor" +
    "e w" was scored as "Before" + " w" (-5.58 for -4.02), and a document's second window took the logits of another
    document's first, so a rolling perplexity changed with the batch size (27.00 at 8, 15.78 at 1). gbattn turns the
    cache off: every number is gbattn's own, at every batch size."""
    run_dir, _ = trained
    run = rundir.load_run(run_dir)
    L, eos = run.seq_len, run.tokenizer.encode("\n")[0]
    text = "First Citizen:\nWe are accounted poor citizens, the patricians good. What authority surfeits on"
    assert len(text) > L + 1
    # the second's first window is [eos] + text[:L]; the first's second window is "\n" + text[:L - 1] + "x" after
    # "Second Citizen: Would": the same tokens but the last, split otherwise between context and continuation
    documents = ["Second Citizen: Would\n" + text[:L - 1] + "x", text]
    questions = [("First Citizen:\nBefor", ["e w", "x"]), ("First Citizen:\nBefore ", ["w", "x"])]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (tasks / "mc.jsonl").write_text("".join(json.dumps({"q": q, "choices": c, "label": 0}) + "\n"
                                            for q, c in questions))
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "share_ppl.yaml").write_text("task: share_ppl\n" + head.format(tasks / "docs.jsonl")
                                          + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                                          "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: byte_perplexity\n")
    (tasks / "share_mc.yaml").write_text("task: share_mc\n" + head.format(tasks / "mc.jsonl")
                                         + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: "
                                         "'{{choices}}'\ndoc_to_target: label\ntarget_delimiter: ''\n"
                                         "metric_list:\n  - metric: acc\n")
    for batch in (1, 8):
        out = tmp_path / f"batch{batch}.json"
        assert cli_main(["lm-eval", str(run_dir), "--tasks", "share_ppl,share_mc", "--include-path", str(tasks),
                         "--batch-size", str(batch), "--log-samples", "--output", str(out)]) == 0, capsys.readouterr()
        capsys.readouterr()
        rolling = [json.loads(line) for line in (tmp_path / f"samples-share_ppl-batch{batch}.jsonl").open()]
        for sample in rolling:
            got = sample["filtered_resps"]
            got, ids = got[0] if isinstance(got, list) else got, run.tokenizer.encode(sample["doc"]["text"])
            assert got == pytest.approx(gbattn_rolling(run.model, ids, eos, L), rel=1e-5), (batch, sample["doc"])
        for sample in (json.loads(line) for line in (tmp_path / f"samples-share_mc-batch{batch}.jsonl").open()):
            question = sample["doc"]["q"]
            spaces = question[len(question.rstrip()):]  # the harness moves them to the continuation: "Before", " w"
            for choice, (ll, _) in zip(sample["doc"]["choices"], sample["filtered_resps"]):
                context, cont = run.tokenizer.encode(question.rstrip()), run.tokenizer.encode(spaces + choice)
                want = gbattn_loglikelihood(run.model, context + cont, len(cont), L)
                assert ll == pytest.approx(want, rel=1e-5), (batch, sample["doc"]["q"], choice)


def test_lm_eval_says_which_tasks_num_fewshot_does_not_apply_to(trained, tmp_path, capsys):
    """--num-fewshot was passed to every task and the results file named by it: a task whose YAML fixes num_fewshot: 0
    (79 of the harness's, ifeval among them) ran 0-shot in a "-1shot" file, and a rolling log-likelihood (wikitext)
    scores each document alone, its table saying 1-shot. One note names them and why; the results record them."""
    run_dir, _ = trained
    tasks = local_tasks(tmp_path / "tasks")
    pinned = (tasks / "gbattn_toy_mc.yaml").read_text().replace("task: gbattn_toy_mc", "task: gbattn_toy_mc0")
    (tasks / "gbattn_toy_mc0.yaml").write_text(pinned + "num_fewshot: 0\n")
    argv = ["lm-eval", str(run_dir), "--tasks", "gbattn_toy_mc,gbattn_toy_mc0,gbattn_toy_ppl", "--include-path",
            str(tasks), "--num-fewshot", "1", "--output", str(tmp_path / "out" / "results.json")]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert ("note: --num-fewshot 1 does not apply to gbattn_toy_mc0 (its YAML fixes num_fewshot: 0); gbattn_toy_ppl "
            "(a rolling log-likelihood scores each document alone): their results are 0-shot") in err, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["gbattn"]["num_fewshot_not_applied"] == ["gbattn_toy_mc0", "gbattn_toy_ppl"]
    assert results["n-shot"]["gbattn_toy_mc"] == 1  # (the one it applied to: not named)
    # a group takes its tasks' count: it was named too, "its YAML fixes num_fewshot: 0", and it has no such YAML
    (tasks / "toy_zero.yaml").write_text("group: toy_zero\ntask:\n  - gbattn_toy_mc0\n")
    argv[3], argv[-1] = "toy_zero", str(tmp_path / "group" / "results.json")
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert ("note: --num-fewshot 1 does not apply to gbattn_toy_mc0 (its YAML fixes num_fewshot: 0): its results are "
            "0-shot") in err, err


def test_lm_eval_of_a_bpe_model_scores_the_tokens_of_context_and_continuation_together(tmp_path):
    """The paper's BPE through the harness's wrapper: a continuation is scored on the last tokens of
    context + continuation (a context's trailing spaces move to the continuation, the harness's rule), a
    rolling log-likelihood starts after <pad> (the end-of-text stand-in), and a generation keeps the space
    before its first piece."""
    from lm_eval.api.instance import Instance

    from gbattn.hf import wrap_run
    from gbattn.hf.lmeval import GbattnLM

    bpe = get_tokenizer("bpe", load_corpus(str(write_corpus(tmp_path / "c"))), vocab_size=120, verbose=False)
    torch.manual_seed(0)
    cfg = tiny_config(("boosted", {}), vocab_size=bpe.vocab_size)
    run = rundir.LoadedRun(tmp_path, GPT(cfg).eval(), cfg, None, bpe, {"model": cfg.to_dict()}, 7, "last")
    model, tokenizer = wrap_run(run)
    lm = GbattnLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=2, max_length=cfg.block_size)
    pairs = [("the cat sat on", " the mat"), ("the cat sat on ", "the mat"), ("a big red", " bird .")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)], disable_tqdm=True)
    for (context, continuation), (ll, _) in zip(pairs, got):
        whole, n = bpe.encode(context + continuation), len(bpe.encode(continuation))
        assert whole[:-n] == bpe.encode(context)
        assert ll == pytest.approx(gbattn_loglikelihood(run.model, whole, n, cfg.block_size), rel=1e-5)
    pad = bpe.encode("<pad>")[0]
    assert lm.prefix_token_id == pad
    text = "the cat sat on the mat . a big red bird"
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert rolling == pytest.approx(gbattn_rolling(run.model, bpe.encode(text), pad, cfg.block_size), rel=1e-5)
    prompt = bpe.encode("the cat")
    new = run.model.generate(torch.tensor([prompt]), 3, top_k=1)[0, len(prompt):].tolist()  # greedy
    [generated] = lm.generate_until([Instance("generate_until", {}, ("the cat", {"until": ["\n\n"], "max_gen_toks": 3,
                                                                                  "do_sample": False}), 0)],
                                    disable_tqdm=True)
    assert generated == " " + bpe.decode(new)
    # A prompt of no tokens (empty, or whitespace the paper's BPE drops) continues from the prefix token, as an empty
    # context is scored: alone it was a (1, 0) batch and a traceback, in a batch a row of padding only, continued
    # from nothing. Alone or beside another prompt, the same text; the other prompt's unchanged.
    from_pad = run.model.generate(torch.tensor([[pad]]), 3, top_k=1)[0, 1:].tolist()
    until = {"until": ["\n\n"], "max_gen_toks": 3, "do_sample": False}
    for batch_size in (1, 2):
        lm.batch_size_per_gpu = batch_size
        texts = lm.generate_until([Instance("generate_until", {}, (prompt_text, until), i)
                                   for i, prompt_text in enumerate(["", "the cat", "\n"])], disable_tqdm=True)
        assert texts == [" " + bpe.decode(from_pad), " " + bpe.decode(new), " " + bpe.decode(from_pad)], batch_size


def write_task(tasks: Path, name: str, row: str, spec: str) -> None:
    """A local lm-eval task ``name`` over one JSON row (its text in ``q``); ``spec``: the rest of its YAML."""
    (tasks / f"{name}.jsonl").write_text(row + "\n")
    (tasks / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / f'{name}.jsonl'}\n"
        f"test_split: test\ndoc_to_text: '{{{{q}}}}'\n" + spec)


MC_ROW = '{"q": "A:", "choices": ["b", "c"], "label": 0}'
MC_SPEC = "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"


@pytest.mark.parametrize("spec,detail", [
    ("output_type: bogus\n", "ValueError: Got invalid output_type 'bogus'"),
    ("output_type: multiple_choice\n" + MC_SPEC.replace("metric: acc", "metric: no_such_metric"), "KeyError: None"),
    ("output_type: multiple_choice\nfewshot_split: nosplit\nnum_fewshot: 1\n" + MC_SPEC, "KeyError: 'nosplit'"),
    ("output_type: multiple_choice\n" + MC_SPEC.replace("label\n", "'{{nofield}}'\n"),
     "UndefinedError: 'nofield' is undefined"),
    ("output_type: multiple_choice\n" + MC_SPEC.replace("'{{choices}}'", "'{{choices'"),
     "TemplateSyntaxError: unexpected end of template"),
    # the first document's empty choice, rendered while the task is built: its IndexError was blamed on the YAML alone
    ("output_type: multiple_choice\ntarget_delimiter: ''\n" + MC_SPEC.replace("'{{choices}}'", "['', ' c']"),
     "IndexError: string index out of range): check the task's output_type, metric_list, splits and templates, and "
     "its first document, which the harness renders then (an empty choice: IndexError)"),
], ids=["output-type", "metric", "split", "template-field", "template-syntax", "empty-first-choice"])
def test_lm_eval_names_a_task_yaml_it_cannot_build_in_one_line(trained, capsys, tmp_path, spec, detail):
    """A task YAML the harness cannot build into a task (an output_type, a metric, a split or a template of its
    own) is one line naming the task, with the harness's reason (tracebacks, exit status 1, before)."""
    run_dir, _ = trained
    write_task(tmp_path, "toy_bad", MC_ROW, spec)
    assert cli_main(["lm-eval", str(run_dir), "--tasks", "toy_bad", "--include-path", str(tmp_path),
                     "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        f"gbattn: error: lm-eval could not build the task(s) ['toy_bad'] from their YAML ({detail}"), err


def test_lm_eval_names_the_harness_check_a_request_fails(trained, capsys, tmp_path):
    """The harness asserts without a message that an answer fits the model and has tokens of its own: the line
    said "lm-eval refused the task for this model (malformed)". It names what is wrong with the task's answers."""
    from lm_eval.api.instance import Instance

    from gbattn.hf import wrap_run
    from gbattn.hf.lmeval import GbattnLM, harness_refusal

    run_dir, _ = trained
    write_task(tmp_path, "toy_answer", json.dumps({"q": "A:", "choices": ["b" * 40, "c"], "label": 0}),
               "output_type: multiple_choice\n" + MC_SPEC)
    assert cli_main(["lm-eval", str(run_dir), "--tasks", "toy_answer", "--include-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "gbattn: error: lm-eval refused the task for this model (an answer (continuation) is longer than the 32 input "
        "tokens the model trained on (its seq_len))"), err
    # a BPE answer whose first piece merges with the question's last one ("the ca" + "t sat": "the cat sat")
    bpe = get_tokenizer("bpe", load_corpus(str(write_corpus(tmp_path / "c"))), vocab_size=120, verbose=False)
    assert len(bpe.encode("the cat sat")) == len(bpe.encode("the ca"))
    cfg = tiny_config(("boosted", {}), vocab_size=bpe.vocab_size)
    model, tokenizer = wrap_run(rundir.LoadedRun(tmp_path, GPT(cfg).eval(), cfg, None, bpe, {"model": cfg.to_dict()},
                                                 7, "last"))
    lm = GbattnLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1, max_length=cfg.block_size)
    with pytest.raises(AssertionError) as refused:
        lm.loglikelihood([Instance("loglikelihood", {}, ("the ca", "t sat"), 0)], disable_tqdm=True)
    assert harness_refusal(refused.value, cfg.block_size) == (
        "an answer (continuation) encodes to no tokens of its own: it is empty, or its tokens merge with the end of "
        "the question's (a task's target_delimiter, such as ' ', keeps them apart)")
    assert harness_refusal(AssertionError("requested max tokens"), 33) == "requested max tokens"  # the harness's own
    # a question of whitespace only: the harness moves it into the answer, leaving the question empty ("its check
    # `len(context_enc) > 0` failed", unexplained)
    with pytest.raises(AssertionError) as refused:
        lm.loglikelihood([Instance("loglikelihood", {}, (" ", "the cat"), 0)], disable_tqdm=True)
    assert harness_refusal(refused.value, cfg.block_size) == (
        "a question (context) encodes to no tokens: the harness moves a question's trailing whitespace into its "
        "answer, so a question of whitespace only is empty (an empty one takes the prefix token: leave it empty)")


def test_an_unknown_task_names_the_yaml_files_of_the_include_path_that_do_not_parse(tmp_path, monkeypatch):
    """The harness's index skips a task YAML that does not parse, saying so only at debug level: the task was
    "unknown", with the advice to pass the --include-path that was passed. The line names the skipped file.
    (The index here leaves out the harness's own tasks, whose indexing takes seconds.)"""
    from lm_eval.tasks import TaskManager

    from gbattn.errors import UserError
    from gbattn.hf import lmeval
    from gbattn.hf.lmeval import task_manager

    def local_only(self, include_path=None, include_defaults=True, **kwargs):
        TaskManager.__init__(self, include_path=include_path, include_defaults=False, **kwargs)

    monkeypatch.setattr(lmeval.GbattnTaskManager, "__init__", local_only)

    write_task(tmp_path, "toy_ok", MC_ROW, "output_type: multiple_choice\n" + MC_SPEC)
    (tmp_path / "toy_broken.yaml").write_text("task: toy_broken\n  dataset_path: [unclosed\n")
    with pytest.raises(UserError, match=r"^unknown lm-eval task\(s\) \['toy_broken'\]: .*; the harness skipped "
                                        r"toy_broken.yaml \(\w*Error: .*\), which does not parse$"):
        task_manager(["toy_ok", "toy_broken"], str(tmp_path))
    (tmp_path / "zz_list.yaml").write_text("- task: zz_list\n")  # every file is read, each named
    with pytest.raises(UserError, match=r"skipped toy_broken.yaml \(.*\), zz_list.yaml \(ValueError: Expected YAML "
                                        r"dict from .*\), which do not parse$"):
        task_manager(["zz_list"], str(tmp_path))
    assert task_manager(["toy_ok"], str(tmp_path)).match_tasks(["toy_ok"])
    # a glob passed the check and reached the harness unexpanded, which blamed the task's YAML: named as a pattern
    write_task(tmp_path, "toy_ok2", MC_ROW, "output_type: multiple_choice\n" + MC_SPEC)
    (tmp_path / "toy_broken.yaml").unlink()
    (tmp_path / "zz_list.yaml").unlink()
    with pytest.raises(UserError, match=r"^--tasks 'toy_ok\*' is a pattern; name the tasks it matches: "
                                        r"toy_ok,toy_ok2$"):
        task_manager(["toy_ok", "toy_ok*"], str(tmp_path))


def copy_with_json_changed(directory, copy, name: str, **changes):
    """A copy of ``directory`` whose JSON file ``name`` has ``changes`` applied; returns the copy."""
    shutil.copytree(directory, copy)
    (copy / name).write_text(json.dumps({**json.loads((copy / name).read_text()), **changes}))
    return copy


def lm_eval_refused(directory, capsys) -> str:
    """`gbattn lm-eval DIRECTORY` on the toy task: exit 2 with one line on stderr, which is returned."""
    assert cli_main(["lm-eval", str(directory), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA),
                     "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_lm_eval_reads_the_generation_config_with_gbattns_reader_first(trained, capsys, tmp_path):
    """transformers reads generation_config.json with json.load while it loads the model: one nested too deeply
    was a RecursionError traceback. gbattn's reader reads it first: one line naming the file."""
    _, out = trained
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "generation_config.json").write_text("[" * 100_000)
    err = lm_eval_refused(damaged, capsys)
    assert err == (f"gbattn: error: {damaged / 'generation_config.json'} is not a gbattn file (its JSON is nested too "
                   f"deeply to read)\n"), err


def test_lm_eval_refuses_a_generation_config_that_transformers_rejects_in_one_line(trained, capsys, tmp_path):
    """A generation_config.json that reads as JSON but whose values transformers refuses while it loads the model
    (a ValueError: an unknown cache_implementation) is one line naming the directory, not a traceback."""
    damaged = copy_with_json_changed(trained[1], tmp_path / "damaged", "generation_config.json",
                                     cache_implementation="bogus")
    err = lm_eval_refused(damaged, capsys)
    assert err.startswith(f"gbattn: error: {damaged} does not load in transformers (Invalid `cache_implementation` "
                          f"(bogus)"), err


def test_lm_eval_refuses_a_tokenizer_naming_no_end_of_text_token(trained, capsys, tmp_path):
    """Without tokenizer_config.json (or its eos_token) the tokenizer has neither an eos nor a bos token, and the
    harness decoded None as each text's prefix: a TypeError traceback at the first request."""
    _, out = trained
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    config = json.loads((damaged / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (damaged / "tokenizer_config.json").write_text(json.dumps(config))
    err = lm_eval_refused(damaged, capsys)
    assert f"gbattn: error: the tokenizer in {damaged} names no end-of-text token (eos_token in its" in err, err
    # a bos_token alone is enough: lm-eval starts each text with it (in a directory without gbattn's tokenizer file,
    # a save_pretrained's, whose tokenizer files are not checked against an export's: lm-eval's next test)
    (damaged / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "\n"}))
    (damaged / "gbattn-tokenizer.json").unlink()
    from gbattn.hf.lmeval import load_model

    tokenizer = load_model(damaged, None, torch.device("cpu"))[1]
    assert (tokenizer.eos_token, tokenizer.bos_token) == (None, "\n")


def test_lm_eval_refuses_a_tokenizer_config_naming_a_file_elsewhere(trained, capsys, tmp_path):
    """A received export whose tokenizer_config.json says `"tokenizer_file": "/dev/zero"`: transformers 4.x read it
    until the memory ran out (and a bare name from the current folder, not the export's). A `*_file` setting is
    refused in one line (gbattn export writes none): a slow tokenizer's vocab_file and merges_file too."""
    _, out = trained
    tokenizer_files = ("/dev/zero", "../elsewhere/tokenizer.json", "tokenizer.json", 7)
    settings = [*(("tokenizer_file", value) for value in tokenizer_files), ("vocab_file", "/dev/zero"),
                ("merges_file", "../elsewhere/merges.txt")]
    for i, (key, value) in enumerate(settings):
        damaged = copy_with_json_changed(out, tmp_path / f"damaged{i}", "tokenizer_config.json", **{key: value})
        assert lm_eval_refused(damaged, capsys) == (
            f"gbattn: error: {damaged / 'tokenizer_config.json'}: {key}={value!r} names a file for "
            f"transformers to read, wherever it is (`gbattn export` writes no such setting); copy the tokenizer files "
            f"from the exported directory\n")


def test_an_export_into_a_folder_named_with_an_escape_sequence_says_where_it_went_escaped(trained, capsys, tmp_path):
    """`gbattn export` (what lm-eval reads) into a folder whose name holds an escape sequence printed the name raw in
    its line saying where it exported to: a terminal took it as a command. Written as text, ``\\x1b``."""
    run, _ = trained
    out = tmp_path / "export\x1b[31m"
    assert cli_main(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "\x1b" not in printed
    assert printed.startswith(f"exported {run} (best weights) to {tmp_path}/export\\x1b[31m; load it with "), printed


def test_lm_eval_refuses_tokenizer_files_that_are_not_the_exports(trained, capsys, tmp_path):
    """lm-eval reads an export's transformers tokenizer files (as any user of it would), which gbattn eval does not:
    with two ids swapped in tokenizer.json, another eos_token or an added bos_token in tokenizer_config.json, or a
    post-processor putting a token before each text, the export was scored silently (byte perplexity 59.57 and
    59.16 where it is 58.97). Each is refused, naming what differs from what `gbattn export` writes."""
    _, out = trained
    tokenizer_json = json.loads((out / "tokenizer.json").read_text())
    vocab = dict(tokenizer_json["model"]["vocab"])
    vocab["e"], vocab["t"] = vocab["t"], vocab["e"]
    prefixed = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "T", "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"T": {"id": "T", "ids": [vocab["T"]], "tokens": ["T"]}}}
    for name, file, changes, differs in (
            ("swapped", "tokenizer.json", {"model": {**tokenizer_json["model"], "vocab": vocab}},
             "vocabulary, encoding, decoding"),
            ("eos", "tokenizer_config.json", {"eos_token": "e"}, "special tokens"),
            ("bos", "tokenizer_config.json", {"bos_token": "T"}, "special tokens"),
            ("prefixed", "tokenizer.json", {"post_processor": prefixed}, "encoding"),
            # no decoder: each token decoded with a space after it ('e e e' for 'eee': exact_match 1.0 became 0.0)
            ("undecoded", "tokenizer.json", {"decoder": None}, "decoding"),
            # files transformers loads but cannot use: tracebacks (a RecursionError, "Missing [UNK] token") before
            ("empty unk", "tokenizer_config.json", {"unk_token": ""}, "special tokens"),
            ("no pre-tokenizer", "tokenizer.json", {"pre_tokenizer": None}, "encoding")):
        damaged = copy_with_json_changed(out, tmp_path / name, file, **changes)
        if name == "empty unk" and transformers.__version__.startswith("4."):  # 4.x drops an empty token: the same
            continue                                                             # tokenizer as the export's
        line = lm_eval_refused(damaged, capsys)
        named = re.fullmatch(rf"gbattn: error: the tokenizer files in {re.escape(str(damaged))} differ from those "
                             rf"`gbattn export` writes for its gbattn-tokenizer.json \((.*)\): they were edited, "
                             rf"come from another model, or were written by an earlier gbattn; copy them from the "
                             rf"exported directory, or export again\n", line)
        assert named and set(differs.split(", ")) <= set(named.group(1).split(", ")), (name, line)


def test_lm_eval_checks_an_exports_gbattn_tokenizer_against_its_recorded_fingerprint(trained, tmp_path):
    """lm-eval read an export's gbattn-tokenizer.json against config.json's top level, which records no fingerprint
    (the gbattn section does): a file edited with its transformers files to match was scored; gbattn eval refuses it."""
    from gbattn.hf.lmeval import load_model

    _, out = trained
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    record = json.loads((damaged / "gbattn-tokenizer.json").read_text())
    payload = json.loads(record["payload"])
    payload["chars"] = payload["chars"][::-1]
    (damaged / "gbattn-tokenizer.json").write_text(json.dumps({**record, "payload": json.dumps(payload)}))
    for load in (lambda d: load_model(d, None, torch.device("cpu")), rundir.load_run):
        with pytest.raises(rundir.CheckpointError, match="is not the tokenizer the run was trained with"):
            load(damaged)


def test_lm_eval_generates_from_an_export_as_from_its_run_whatever_its_config_asks(trained, tmp_path):
    """lm-eval built an export's generation settings from its config.json: eos_token_id edited to the id of "e" cut
    the answer "eeeeeeee" to "e" (exact_match 0.0 became 1.0), and suppress_tokens or repetition_penalty changed
    answers under transformers 4.x, while `gbattn generate` ignores them. An export generates as its run does: the
    checked tokenizer's special tokens, nothing else."""
    from gbattn.hf.lmeval import HARNESS_GENERATE_OUTPUTS, load_model

    run_dir, out = trained
    e_id = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["e"]
    damaged = copy_with_json_changed(out, tmp_path / "damaged", "config.json", eos_token_id=e_id, bos_token_id=e_id,
                                     suppress_tokens=[e_id], repetition_penalty=100.0)
    settings = {}
    for name, directory in (("run", run_dir), ("export", out), ("damaged", damaged)):
        model = load_model(directory, None, torch.device("cpu"))[0]
        settings[name] = ({k: v for k, v in model.generation_config.to_diff_dict().items()  # (the harness's own,
                           if k not in {*HARNESS_GENERATE_OUTPUTS, "_from_model_config"}},  # set on both; a mark)
                          [getattr(model.config, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")])
    assert settings["damaged"] == settings["export"] == settings["run"]
    assert "suppress_tokens" not in settings["damaged"][0] and "repetition_penalty" not in settings["damaged"][0]
    # and generate() keeps them (transformers 4.x rebuilt a generation config from config.json's settings there)
    model = load_model(damaged, None, torch.device("cpu"))[0]
    ids = torch.tensor([[e_id, e_id]])
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False),
                       load_model(out, None, torch.device("cpu"))[0].generate(
                           ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False))


def test_lm_eval_refuses_a_tokenizer_whose_length_limit_is_no_number(trained, capsys, tmp_path):
    """A tokenizer_config.json's model_max_length of "x" loaded, and transformers compared it with each text's length:
    a TypeError traceback at the first request."""
    damaged = copy_with_json_changed(trained[1], tmp_path / "damaged", "tokenizer_config.json", model_max_length="x")
    err = lm_eval_refused(damaged, capsys)
    assert f"gbattn: error: the tokenizer in {damaged}: model_max_length='x'" in err, err


def test_lm_eval_refuses_an_export_whose_model_type_is_not_gbattns(trained, capsys, tmp_path):
    """The Auto classes build the model config.json's model_type names, with that library's default sizes: an export
    whose model_type read "llama" (its gbattn dict whole) built a 7-billion-parameter Llama before its weights were
    found missing (killed for memory on a small machine); without a model_type they guess one from the directory's
    name. Refused before anything is built."""
    _, out = trained
    for value in ("gpt2", None):  # (not "llama" here: without the check, 28 GB)
        damaged = tmp_path / f"damaged-{value}-gpt2"  # without a model_type, transformers reads gpt2 in this name
        shutil.copytree(out, damaged)
        config = json.loads((damaged / "config.json").read_text())
        config.pop("model_type") if value is None else config.update(model_type=value)
        (damaged / "config.json").write_text(json.dumps(config))
        err = lm_eval_refused(damaged, capsys)
        assert err == (f"gbattn: error: {damaged / 'config.json'}: model_type={value!r}, not 'gbattn' as `gbattn "
                       f"export` writes it: transformers would build another kind of model from it\n"), err
    # another library's checkpoint (no gbattn dict): the advice to convert it first
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    shutil.copy(out / "model.safetensors", foreign)
    assert cli_main(["lm-eval", str(foreign), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA),
                     "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "is a Hugging Face checkpoint (gpt2), not a gbattn run: convert it first with `gbattn upcycle" in err, err


def test_lm_eval_refuses_the_weights_gbattns_readers_refuse(trained, capsys, tmp_path):
    """lm-eval checks an export's stored weights as gbattn eval does: the Auto classes loaded a pytorch_model.bin (a
    pickle) in place of model.safetensors, and cast integer weights to float silently; both were evaluated."""
    from safetensors.torch import load_file, save_file

    _, out = trained
    weights = load_file(out / "model.safetensors")
    pickled, integers = tmp_path / "pickled", tmp_path / "integers"
    shutil.copytree(out, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(weights, pickled / "pytorch_model.bin")
    shutil.copytree(out, integers)
    save_file({**weights, "model.ln_f.weight": torch.ones_like(weights["model.ln_f.weight"], dtype=torch.int64)},
              integers / "model.safetensors", metadata={"format": "pt"})
    pickled_hint = "its pytorch_model.bin is a pickle, which gbattn does not read here: save with save_pretrained("
    for damaged, expected in ((pickled, f"{pickled} has no model.safetensors (nor model.safetensors.index.json"),
                              (pickled, pickled_hint),  # (4.x's save_pretrained(safe_serialization=False) writes it)
                              (integers, f"the weights in {integers} are not floating-point numbers (")):
        assert cli_main(["eval", str(damaged)]) == 2  # gbattn's own reader
        assert expected in capsys.readouterr().err
        err = lm_eval_refused(damaged, capsys)
        assert expected in err, err


def refused_by_generate_and_lm_eval(export, expected: str, capsys) -> None:
    """`gbattn generate` and `gbattn lm-eval` of ``export`` each end with status 2 and exactly ``expected``."""
    for argv in (["generate", str(export), "--prompt", "A", "--max-new-tokens", "1"],
                 ["lm-eval", str(export), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA),
                  "--limit", "1"]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert err == expected, err


def test_a_tied_export_holding_another_head_is_refused(trained, capsys, tmp_path):
    """A tied config (tie_embeddings) whose model.safetensors also holds an lm_head.weight of other values: gbattn
    loaded both into its one shared tensor (the head won, replacing the embedding), transformers 5 unties them and
    keeps both, 4.x ties them and drops the head: three models from one directory. Refused by gbattn's readers and
    lm-eval alike; a stored head equal to the embedding (as safetensors.torch.save_model keeps it) loads."""
    from safetensors.torch import load_file, save_file

    _, out = trained
    weights = load_file(out / "model.safetensors")
    assert "model.lm_head.weight" not in weights  # a tied head is saved once
    damaged, equal = tmp_path / "damaged", tmp_path / "equal"
    for folder, head in ((damaged, weights["model.wte.weight"] + 1.0), (equal, weights["model.wte.weight"].clone())):
        shutil.copytree(out, folder)
        save_file({**weights, "model.lm_head.weight": head}, folder / "model.safetensors", metadata={"format": "pt"})
    expected = (f"gbattn: error: the weights in {damaged} tie the output head to the token embedding (tie_embeddings) "
                f"but hold an lm_head.weight that differs from wte.weight: the file is damaged; restore a copy of it\n")
    refused_by_generate_and_lm_eval(damaged, expected, capsys)
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(rundir.load_run(equal).model(x), rundir.load_run(out).model(x))


def test_standard_names_at_a_configs_top_level_agree_with_its_gbattn_dict(trained, capsys, tmp_path):
    """config.json's standard names at its top level (num_attention_heads, ...; save_pretrained writes none) are
    what transformers builds the model from, gbattn's readers its gbattn model dict: an edited num_attention_heads=8
    over a 4-head dict loaded silently as an 8-head model in the Auto classes and lm-eval, and as the 4-head one in
    gbattn eval and generate. A value that disagrees is refused by both; one that agrees loads."""
    _, out = trained
    config = json.loads((out / "config.json").read_text())
    model = config["gbattn"]["model"]
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    assert model["n_kv_heads"] is None  # as many key/value heads as query heads: a top-level count other than that
    for name, value, field in (("num_attention_heads", 2 * model["n_heads"], "n_heads"),
                               ("tie_word_embeddings", not model["tie_embeddings"], "tie_embeddings"),
                               ("num_key_value_heads", model["n_heads"] // 2, "n_kv_heads")):
        (damaged / "config.json").write_text(json.dumps({**config, name: value}))
        recorded = model[field] if field != "n_kv_heads" else model["n_heads"]  # (null: as many as n_heads)
        line = (f"{name}={value!r} at its top level disagrees with {field}={recorded!r} in its gbattn model dict: "
                f"transformers builds the model from the one, gbattn from the other; delete {name} from config.json")
        refused_by_generate_and_lm_eval(damaged, f"gbattn: error: {damaged / 'config.json'}: {line}\n", capsys)
        with pytest.raises(ValueError, match=re.escape(f"config.json: {line}")):
            AutoModelForCausalLM.from_pretrained(damaged)
    loaded = GbattnConfig.from_pretrained(out)  # rundir's table of the names is GbattnConfig's own
    assert {name: getattr(loaded, name) for name in rundir.STANDARD_FIELDS} == {
        name: model[field] if field != "n_kv_heads" else model[field] or model["n_heads"]
        for name, field in rundir.STANDARD_FIELDS.items()}
    agreeing = {"hidden_size": model["d_model"], "num_key_value_heads": model["n_kv_heads"] or model["n_heads"],
                "vocab_size": model["vocab_size"], "tie_word_embeddings": model["tie_embeddings"]}
    (damaged / "config.json").write_text(json.dumps({**config, **agreeing}))
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(rundir.load_run(damaged).model(x), AutoModelForCausalLM.from_pretrained(damaged)(x).logits)


def test_a_damaged_dtype_or_token_id_in_config_json_is_one_error_from_from_pretrained(trained, tmp_path):
    """config.json's dtype and token ids are read by transformers itself: "word", 0 or [] as a dtype and "word" as a
    token id were AttributeError, IndexError and TypeError tracebacks from inside transformers; -1 loaded silently."""
    _, out = trained
    config = json.loads((out / "config.json").read_text())
    dtype_key = "dtype" if "dtype" in config else "torch_dtype"
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    for key, value, expected in ((dtype_key, "word", "names no torch dtype a model is saved in"),
                                 (dtype_key, 0, "names no torch dtype a model is saved in"),
                                 (dtype_key, "int64", "names no torch dtype a model is saved in"),
                                 (dtype_key, "float8_e4m3fn", "names no torch dtype a model is saved in"),
                                 ("pad_token_id", "word", "must be a token id"),
                                 ("eos_token_id", -1, "must be a token id"),
                                 ("bos_token_id", 2.5, "must be a token id")):
        (damaged / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=re.escape(f"config.json: {key}={value!r} {expected}")):
            AutoModelForCausalLM.from_pretrained(damaged)
    (damaged / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, 1]}))
    AutoModelForCausalLM.from_pretrained(damaged)  # a list of end tokens, as transformers allows
    # a torch.dtype from Python (transformers' own from_dict takes one) is a dtype, not a damaged file
    assert isinstance(GbattnConfig.from_dict({**config, dtype_key: torch.float32}), GbattnConfig)


def test_lm_eval_refuses_a_tokenizer_with_ids_past_the_models_vocabulary(trained, capsys, tmp_path):
    """Tokenizer files with tokens the model has no embedding for (an edited tokenizer_class of LlamaTokenizer added
    <s>, </s> and <unk> as ids 65 to 67 of a 65-character model): a request that met one ended in a traceback from
    the model ("token id 65 outside the vocabulary", status 1). Refused in one line when the tokenizer loads; so is
    a tokenizer.json whose ids leave a gap, with no more tokens than the model has but an id past them (the count
    alone let it through)."""
    _, out = trained
    damaged, gapped = tmp_path / "damaged", tmp_path / "gapped"
    shutil.copytree(out, damaged)
    tokenizer = json.loads((damaged / "tokenizer.json").read_text())
    vocab = json.loads((damaged / "config.json").read_text())["gbattn"]["model"]["vocab_size"]
    shutil.copytree(out, gapped)
    moved = dict(tokenizer, model=dict(tokenizer["model"], vocab={**tokenizer["model"]["vocab"], "e": vocab + 4}))
    (gapped / "tokenizer.json").write_text(json.dumps(moved))  # "e" (in every document) at id vocab + 4
    tokenizer["added_tokens"].append({"id": vocab, "content": "<s>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (damaged / "tokenizer.json").write_text(json.dumps(tokenizer))
    (damaged / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((out / "tokenizer_config.json").read_text()), "bos_token": "<s>"}))
    for folder, top_id in ((damaged, vocab), (gapped, vocab + 4)):
        assert cli_main(["lm-eval", str(folder), "--tasks", "gbattn_toy_ppl", "--include-path", str(LMEVAL_DATA),
                         "--limit", "1"]) == 2
        err = capsys.readouterr().err
        assert err == (f"gbattn: error: the tokenizer in {folder} has token ids up to {top_id}, past the model's "
                       f"vocabulary of {vocab} (ids from {vocab} on have no embedding): its tokenizer files do not "
                       f"belong to this model\n"), err


def test_lm_eval_names_a_bad_dtype_in_config_json_not_the_tokenizer(trained, capsys, tmp_path):
    """An exported config.json whose dtype (torch_dtype in transformers 4.x) names no torch dtype: the model loads
    (in float32, as asked), then transformers read the field again loading the tokenizer, and the error said "the
    tokenizer in DIR does not load (module 'torch' has no attribute 'bogus')". Now it names the file and field."""
    from gbattn.hf import lmeval

    _, out = trained
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    config = json.loads((damaged / "config.json").read_text())
    for field, value in (("dtype", "bogus"), ("torch_dtype", "bogus"), ("dtype", 5), ("dtype", "Tensor")):
        (damaged / "config.json").write_text(json.dumps({**config, field: value}))
        assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
        err = capsys.readouterr().err
        assert err == (f"gbattn: error: {damaged / 'config.json'}: {field}={value!r} is not the name of a torch dtype "
                       f"(float32, bfloat16, float16, ...; `gbattn export` writes float32)\n"), err
    for value in ("bfloat16", None):  # a dtype's name, or none: the model loads (in float32) and is evaluated
        (damaged / "config.json").write_text(json.dumps({**config, "dtype": value}))
        assert lmeval.load_model(damaged, None, torch.device("cpu"))[0].dtype == torch.float32


def test_lm_eval_errors_are_one_line(trained, monkeypatch, capsys, tmp_path):
    from lm_eval.tasks import TaskManager

    from gbattn.hf import lmeval

    run_dir, out = trained

    def local_only(self, include_path=None, include_defaults=True, **kwargs):  # (the harness's index takes 30 s)
        TaskManager.__init__(self, include_path=include_path, include_defaults=False, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(lmeval.GbattnTaskManager, "__init__", local_only)
        assert cli_main(["lm-eval", str(run_dir), "--tasks", "no_such_task_xyz", "--include-path",
                         str(LMEVAL_DATA)]) == 2
    assert "unknown lm-eval task(s) ['no_such_task_xyz']" in capsys.readouterr().err
    # The task YAMLs' data paths are relative to the repository root: from elsewhere they are missing.
    monkeypatch.chdir(tmp_path)
    assert cli_main(["lm-eval", str(run_dir), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert "could not find a task's data" in err and len(err.strip().splitlines()) == 1, err
    # A harness task whose data is on the hub, without the hub (a traceback and status 1). The harness runs as a
    # download does (corpus.hub_access): huggingface_hub offline where the hub's host has no address, its loggers
    # quiet (23 to 53 s of retries, a line each, came before the error), other logging left on (the harness's).
    import huggingface_hub.constants as hub_constants

    from gbattn.data import corpus as corpus_mod

    seen = []

    def offline(**kwargs):
        seen.append((hub_constants.HF_HUB_OFFLINE, logging.getLogger("huggingface_hub").level,
                     logging.root.manager.disable))
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFoundError)")

    with monkeypatch.context() as mp:
        mp.setattr(lmeval, "simple_evaluate", offline)
        mp.setattr(corpus_mod, "_host_resolves", lambda url: False)
        mp.setattr(corpus_mod.urllib.request, "getproxies", dict)
        mp.setattr(hub_constants, "HF_HUB_OFFLINE", False)
        code = cli_main(["lm-eval", str(run_dir), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)])
        assert seen == [(True, logging.CRITICAL, logging.NOTSET)] and hub_constants.HF_HUB_OFFLINE is False
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "gbattn: error: lm-eval could not load a task's data (Couldn't reach 'Rowan/hellaswag' on the Hub "
        "(LocalEntryNotFoundError)): the harness's tasks download their data from the Hugging Face hub; run once "
        "where it is reachable (the datasets cache keeps it), or use local tasks (--include-path)"), err
    # An exported directory whose config names a layer its weights lack (the Auto classes alone would
    # initialise that layer at random and go on).
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    config = json.loads((damaged / "config.json").read_text())
    config["gbattn"]["model"]["n_layers"] += 1  # (the standard name beside it still says the old number)
    (damaged / "config.json").write_text(json.dumps(config))
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert "num_hidden_layers=2 at its top level disagrees with n_layers=3 in its gbattn model dict" in err, err
    config = without_standard_names(config)  # (as the line says: the model is then the dict's)
    (damaged / "config.json").write_text(json.dumps(config))
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert "do not match its config (missing keys: model.blocks." in err and len(err.strip().splitlines()) == 1, err
    # ... one layer fewer (weights its config has no place for), and a tokenizer.json that does not parse.
    config["gbattn"]["model"]["n_layers"] -= 2
    (damaged / "config.json").write_text(json.dumps(config))
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert "do not match its config (unexpected keys: model.blocks.1." in err and len(err.splitlines()) == 1, err
    # ... gbattn's model field names at the config's top level: GbattnConfig's line whole, its advice included
    (damaged / "config.json").write_text(json.dumps(dict(config, dropout=0.0)))
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("delete them from config.json, or move them into its gbattn model dict)"), err
    assert len(err.strip().splitlines()) == 1, err
    # ... weights of another shape (a block_size its position table does not have): transformers 5
    # raises itself, 4.x reports them as mismatched keys.
    config["gbattn"]["model"]["n_layers"] += 1
    config["gbattn"]["model"]["block_size"] += 1
    (damaged / "config.json").write_text(json.dumps(config))
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert f"the weights in {damaged} do not match its config (" in err and len(err.strip().splitlines()) == 1, err
    shutil.copy(out / "config.json", damaged / "config.json")
    # ... weights that are not finite (the Auto classes evaluated them: acc 1 on a multiple-choice task),
    # a safetensors file that does not parse and a generation_config.json of the wrong types (tracebacks).
    from safetensors.torch import load_file, save_file

    weights = load_file(out / "model.safetensors")
    weights["model.ln_f.weight"][0] = float("nan")
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    damages = {"hold NaN or infinite values (model.ln_f.weight)": lambda: None,
               "is not a valid safetensors file (Error while deserializing header": lambda: (
                   damaged / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b"{not json}"),
               # a clone without Git LFS (gbattn eval said so; lm-eval said "header too large")
               f"{damaged / 'model.safetensors'} is a Git LFS pointer, not the file itself": lambda: (
                   damaged / "model.safetensors").write_text(LFS_POINTER),
               "does not load in transformers ('<=' not supported": lambda: (
                   shutil.copy(out / "model.safetensors", damaged / "model.safetensors"),
                   (damaged / "generation_config.json").write_text('{"max_new_tokens": "many"}'))}
    for expected, damage in damages.items():
        damage()
        err = lm_eval_refused(damaged, capsys)
        assert expected in err, err
    shutil.copy(out / "generation_config.json", damaged / "generation_config.json")
    config["gbattn"]["step"] = "many"  # went into the results as the step
    (damaged / "config.json").write_text(json.dumps(config))
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert "step='many' must be an integer" in err and len(err.strip().splitlines()) == 1, err
    shutil.copy(out / "config.json", damaged / "config.json")
    (damaged / "tokenizer.json").write_text("{")
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer in {damaged} does not load (" in err and len(err.strip().splitlines()) == 1, err
    (damaged / "tokenizer.json").write_text(LFS_POINTER)
    assert cli_main(["lm-eval", str(damaged), "--tasks", "gbattn_toy_mc", "--include-path", str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert f"{damaged / 'tokenizer.json'} is a Git LFS pointer" in err and len(err.strip().splitlines()) == 1, err
    # A fine-tuned model saved by transformers alone (no tokenizer files beside it).
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out).save_pretrained(tmp_path / "saved")
    capsys.readouterr()
    assert cli_main(["lm-eval", str(tmp_path / "saved"), "--tasks", "gbattn_toy_mc", "--include-path",
                     str(LMEVAL_DATA)]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json" in err and len(err.strip().splitlines()) == 1, err
    for name in ("tokenizer.json", "tokenizer_config.json"):  # what Trainer's checkpoints hold (no gbattn file)
        shutil.copy(out / name, tmp_path / "saved" / name)
    from gbattn.hf.lmeval import load_model

    assert load_model(tmp_path / "saved", None, torch.device("cpu"))[4:] == (rundir.load_run(out).step, "exported")
    # A generation task asking for more tokens than the model's block size (the harness's check).
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_task(tasks, "toy_gen", '{"q": "A:", "a": "b"}', "output_type: generate_until\ndoc_to_target: '{{a}}'\n"
               "generation_kwargs:\n  until: ['\\n\\n']\nmetric_list:\n  - metric: exact_match\n")
    assert cli_main(["lm-eval", str(out), "--tasks", "toy_gen", "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(  # after the data's loading bar
        "gbattn: error: lm-eval refused the task for this model (Invalid configuration: requested max tokens"), err
    # A task's text with a character the char tokenizer never saw (the tokenizers library's own error).
    write_task(tasks, "toy_mc2", '{"q": "What is 2+2?", "choices": ["four", "five"], "label": 0}',
               "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
               "metric_list:\n  - metric: acc\n")
    assert cli_main(["lm-eval", str(out), "--tasks", "toy_mc2", "--include-path", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "gbattn: error: a task's text (a prompt, an answer or a stop string) has a character this model's tokenizer "
        "cannot encode"), err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    assert cli_main(["lm-eval", str(run_dir), "--tasks", "gbattn_toy_mc"]) == 2
    assert capsys.readouterr().err == ("gbattn: error: this command needs lm_eval, which is not installed: pip install "
                                       "'gbattn[lm-eval]'\n")


def test_lm_eval_task_generation_settings_that_change_no_answer_are_left_out_and_others_are_one_line(trained, tmp_path,
                                                                                                  capsys):
    """A task's generation_kwargs go to generate() as they are: return_dict_in_generate: true (the harness reads a
    tensor of ids) and use_cache (which the harness passes itself) were tracebacks, as was any setting generate()
    refuses. The first change no answer and are left out; the others are one line naming the task's settings."""
    _, out = trained
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    answers = {}
    for name, extra in (("plain", ""), ("outputs", ", return_dict_in_generate: true, output_scores: true, "
                                                   "output_attentions: true"), ("nocache", ", use_cache: false"),
                        ("static", ", cache_implementation: static"), ("bogus", ", bogus_arg: 3"),
                        # a task's own sampling settings (a traceback once the prompts' mask was no longer counted
                        # as the task's), num_beams: 0 (ZeroDivisionError) and two answers per prompt (the harness's
                        # zip() of prompts and answers)
                        ("temp", ", do_sample: true, temperature: -1.0"), ("beams", ", num_beams: 0"),
                        ("answers", ", do_sample: true, temperature: 1.0, num_return_sequences: 2")):
        write_task(tasks, f"gen_{name}", '{"q": "ROMEO:", "a": " I"}', "output_type: generate_until\ndoc_to_target: "
                   f"'{{{{a}}}}'\ngeneration_kwargs: {{until: [\"\\n\\n\"], max_gen_toks: 5{extra}}}\nmetric_list:\n"
                   "  - metric: exact_match\n")
        code = cli_main(["lm-eval", str(out), "--tasks", f"gen_{name}", "--include-path", str(tasks), "--log-samples",
                         "--output", str(tmp_path / f"{name}.json")])
        err = capsys.readouterr().err
        if name in ("static", "bogus", "temp", "beams", "answers"):
            line = err.strip().splitlines()[-1]
            assert code == 2 and "Traceback" not in err, err
            assert line.startswith("gbattn: error: a task's generation_kwargs ("), err
            named = {"static": "cache_implementation=", "bogus": "bogus_arg=3", "temp": "temperature=-1.0",
                     "beams": "num_beams=0", "answers": "num_return_sequences=2"}[name]
            assert named in line and "attention_mask" not in line, line  # (the harness's own, not the task's)
            # an arithmetic error's text alone ("division by zero") says too little: its type is named
            assert ("ZeroDivisionError" in line) is (name == "beams"), line
            continue
        assert code == 0, err
        samples = (tmp_path / f"samples-gen_{name}-{name}.jsonl").read_text().splitlines()
        answers[name] = [json.loads(sample)["resps"] for sample in samples]
    assert answers["outputs"] == answers["nocache"] == answers["plain"] and answers["plain"][0][0][0], answers
    # max_gen_toks: 0 was blamed on settings the harness passes itself ("generation_kwargs (attention_mask, do_sample)
    # do not work with this model: ... `max_length` is set to 3"); a task's own max_length below its prompts alike
    for name, given in (("zero", "max_gen_toks: 0"), ("short", "max_gen_toks: 4, max_length: 2")):
        write_task(tasks, f"gen_{name}", '{"q": "ROMEO:", "a": " I"}', "output_type: generate_until\ndoc_to_target: "
                   f"'{{{{a}}}}'\ngeneration_kwargs: {{until: [\"\\n\\n\"], {given}}}\nmetric_list:\n"
                   "  - metric: exact_match\n")
        code = cli_main(["lm-eval", str(out), "--tasks", f"gen_{name}", "--include-path", str(tasks),
                         "--output", str(tmp_path / f"{name}.json")])
        err = capsys.readouterr().err
        max_length = 6 if name == "zero" else 2  # "ROMEO:" is 6 characters
        assert code == 2 and err.strip().splitlines()[-1] == (
            f"gbattn: error: a task's generation settings leave no token to generate: prompts of 6 tokens and "
            f"max_length={max_length} (their length + max_gen_toks, or the task's own max_length); give max_gen_toks "
            f">= 1, and no max_length"), err


def test_lm_eval_arguments_are_checked_before_any_work(tmp_path, capsys):
    """Each mistake is a one-line error before a model or task is loaded (the model directory here
    is empty: reaching it would be another error)."""
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "a-file").write_text("task: t\n")
    for argv, message in (
            (["--tasks", " , "], "--tasks names no task"),
            (["--tasks", "t", "--limit", "0"], "--limit 0 must be > 0"),
            (["--tasks", "t", "--limit", "inf"], "--limit inf is not a whole number of documents"),  # a traceback
            (["--tasks", "t", "--limit", "1.5"], "--limit 1.5 is not a whole number of documents"),  # ran 1 document
            (["--tasks", "t", "--output", str(model)], f"--output {model} is a directory; give a file name"),
            # (a name ending in / that is no folder yet: written as a file of that name)
            (["--tasks", "t", "--output", f"{tmp_path / 'new'}/"], "new/ names a folder (it ends in /); give a file"),
            (["--tasks", "t", "--include-path", str(tmp_path / "none")], "is not a directory"),
            (["--tasks", "t", "--include-path", str(tmp_path / "a-file")], "a-file is not a directory"),
            (["--tasks", "t", "--batch-size", "0"], "--batch-size"),
            (["--tasks", "t", "--num-fewshot", "-1"], "--num-fewshot: -1 must be >= 0"),
    ):
        code, _, err = run_cli(capsys, ["lm-eval", model, *argv])
        assert code == 2 and message in err and len(err.strip().splitlines()) <= 2, (argv, err)
    code, _, err = run_cli(capsys, ["lm-eval", tmp_path / "nothing", "--tasks", "t"])
    assert code == 2 and "nothing does not exist (a gbattn run directory or an exported one is expected)" in err, err


def test_lm_eval_output_never_replaces_a_model_directorys_files(tmp_path, capsys):
    """--output onto the evaluated run's best weights (the default results file lies in that run) or
    onto another model directory's files is refused before any work; the files are unchanged."""
    from gbattn import rundir

    model, export = tmp_path / "model", tmp_path / "export"
    for folder, names in ((model, (rundir.CONFIG, rundir.BEST)), (export, (rundir.CONFIG, rundir.SAFETENSORS))):
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(b"weights")
    for target in (model / rundir.BEST, model / rundir.CONFIG, export / rundir.SAFETENSORS, export / "tokenizer.json"):
        code, out, err = run_cli(capsys, ["lm-eval", model, "--tasks", "t", "--output", target])
        assert code == 2 and out == "" and err.strip().splitlines() == [
            f"gbattn: error: --output {target} is a file of the model directory {target.parent}: write it elsewhere"]
    assert not (export / "tokenizer.json").exists()
    assert all(p.read_bytes() == b"weights" for folder in (model, export) for p in folder.iterdir())



def test_export_and_restart_leave_other_model_directories_alone(trained, tmp_path, capsys):
    """--out of export may hold an earlier gbattn export (replaced), never a run or a Hugging Face
    checkpoint; train --restart refuses a directory holding another kind of model (both wrote over
    its config.json and tokenizer.json)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    run_dir, out = trained
    hf_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=40, n_positions=32)).save_pretrained(hf_dir)
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    assert cli_main(["export", str(run_dir), "--out", str(hf_dir)]) == 2
    assert "holds a Hugging Face checkpoint (gpt2), not a gbattn export: choose another" in capsys.readouterr().err
    upcycled = tmp_path / "upcycled"
    shutil.copytree(run_dir, upcycled, ignore=shutil.ignore_patterns("checkpoint.pt"))
    assert cli_main(["export", str(run_dir), "--out", str(upcycled)]) == 2
    assert "holds a run" in capsys.readouterr().err
    (out / "notes.sh").write_text("#!/bin/sh\n")
    (out / "notes.sh").chmod(0o700)
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0  # an earlier export is replaced
    assert (out / "notes.sh").stat().st_mode & 0o777 == 0o700  # a file export did not write keeps its mode
    (out / "notes.sh").unlink()
    capsys.readouterr()
    fine_tuned = tmp_path / "checkpoint-500"  # transformers' Trainer output for a gbattn model
    shutil.copytree(out, fine_tuned)
    (fine_tuned / "trainer_state.json").write_text("{}")
    assert cli_main(["export", str(run_dir), "--out", str(fine_tuned)]) == 2
    assert "holds a transformers checkpoint of a gbattn model" in capsys.readouterr().err
    assert cli_main(["train", "--out", str(hf_dir), "--restart", "--data", "tiny-shakespeare", "--quiet",
                     "--preset", "cpu-char", "--set", "max_steps=1"]) == 2  # one step if the refusal is ever lost
    assert "holds a Hugging Face checkpoint (gpt2), not a gbattn run" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before  # not even a lock file left


def test_a_bpe_tokenizers_unk_token_is_its_own(tmp_path):
    corpus = load_corpus(str(write_corpus(tmp_path / "c")))
    bpe = get_tokenizer("bpe", corpus, vocab_size=120, verbose=False)
    hf = hf_tokenizer(bpe, 64)
    unk = bpe.encode("<unk>")
    assert hf.unk_token == "<unk>" and [hf.unk_token_id] == unk and len(hf) == bpe.vocab_size
    assert hf.encode("the \u00e9 cat") == bpe.encode("the \u00e9 cat") and unk[0] in hf.encode("\u00e9")
    # README: as the unk_token it is special, so skip_special_tokens=True leaves it out, where gbattn shows it
    ids = bpe.encode("<pad> the \u00e9 cat")
    assert bpe.decode(ids) == "the <unk> cat" and hf.decode(ids, skip_special_tokens=True) == " the cat"
    assert hf.decode(ids, skip_special_tokens=False) == " <pad> the <unk> cat"
    char = get_tokenizer("char", corpus)
    assert hf_tokenizer(char, 64).unk_token is None  # unseen characters are an error, as in gbattn
    with pytest.raises(Exception, match=r"Missing \[UNK\] token"):  # not some character's id
        hf_tokenizer(char, 64).encode("the \u00e9")
    assert hf_tokenizer(char, 64).decode(char.encode("the cat . a")) == "the cat . a"  # no clean-up of spaces
    # README: a character vocabulary without a newline (text8's) takes its first character, a space, as eos
    no_newline = hf_tokenizer(Tokenizer("char", json.dumps({"chars": sorted(set("the cat"))})), 64)
    assert no_newline.eos_token == " " and no_newline.decode(no_newline.encode("the cat"), skip_special_tokens=True) \
        == "thecat"


def test_a_char_tokenizers_end_of_text_is_its_newline_whatever_comes_first():
    """A character vocabulary's end of text is "\\n" even where a character sorts before it (a tab has id 0):
    token 0 stands in only for a vocabulary without a newline."""
    chars = Tokenizer("char", json.dumps({"chars": sorted(set("ab\t\n "))}))
    assert chars.encode("\t") == [0]
    assert hf_tokenizer(chars, 64).eos_token == "\n"
    # Without a newline it is token 0, whichever character that is (not the smallest or the last one)
    unsorted = Tokenizer("char", json.dumps({"chars": list("tca ")}))
    assert unsorted.encode("t") == [0] and hf_tokenizer(unsorted, 64).eos_token == "t"


def test_a_char_export_names_no_eos_so_generate_runs_past_newlines(trained):
    """A char model's "\\n" is eos only for lm-eval's windows: neither the exported config nor its
    generation config names an eos_token_id, and sampled generations go on after the newlines they hold."""
    run_dir, out = trained
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.eos_token_id is None and model.generation_config.eos_token_id is None
    run = rundir.load_run(run_dir)
    ids = torch.tensor([run.tokenizer.encode("A:\n")] * 16)
    torch.manual_seed(0)
    got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=True,
                         temperature=1.5, top_k=0)
    assert got.shape == (16, 3 + 30)
    texts = [run.tokenizer.decode(row[3:].tolist()) for row in got]
    assert any(text.rstrip("\n") != text.split("\n")[0] for text in texts), texts  # text after a newline


def test_exported_weights_get_the_same_permissions_as_the_other_files(trained):
    _, out = trained
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert modes["config.json"] == 0o666 & ~umask
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_lm_eval_of_an_upcycled_llama_equals_the_harness_on_its_source(tmp_path):
    """An upcycled model computes its source's function, so the harness's log-likelihoods of the two
    agree: a rolling log-likelihood and an empty context are conditioned on the source's start-of-text
    token ``<s>`` (lm-eval's prefix token), not on ``</s>`` (-125.25 against the source's -127.56 before)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from gbattn.hf.lmeval import GbattnLM, load_model
    from test_upcycle import VOCAB, llama_model

    source = tmp_path / "llama"
    hf = llama_model(bos_token_id=1, eos_token_id=2)
    hf.save_pretrained(source)
    backend = Backend(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}},
                                       unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(source)
    assert cli_main(["upcycle", str(source), "--attn", "boosted", "--out", str(tmp_path / "up")]) == 0
    text = " ".join(f"w{(7 * i) % 40 + 3}" for i in range(30))
    requests = [Instance("loglikelihood_rolling", {}, (text,), 0), Instance("loglikelihood", {}, ("", " w5 w6"), 1)]

    def scores(lm):
        return lm.loglikelihood_rolling(requests[:1], disable_tqdm=True) + [
            lm.loglikelihood(requests[1:], disable_tqdm=True)[0][0]]

    model, tokenizer, _, max_length, _, _ = load_model(tmp_path / "up", None, torch.device("cpu"))
    assert max_length == model.config.max_position_embeddings - 1  # (the run's seq_len, as it would train)
    expected = scores(HFLM(pretrained=hf, tokenizer=AutoTokenizer.from_pretrained(source), backend="causal",
                           batch_size=1, max_length=max_length))
    lm = GbattnLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1, max_length=max_length)
    assert lm.prefix_token_id == 1
    assert scores(lm) == pytest.approx(expected, rel=1e-5)


def test_lm_eval_results_name_paths_relative_to_the_model_directorys_parent(tmp_path):
    """A path inside a root (the model directory, the --include-path) is written relative to that root's
    parent, so the results file still says which model and task files it used; other values pass through."""
    from gbattn.hf.lmeval import portable

    run, tasks = (tmp_path / "runs" / "gba").resolve(), (tmp_path / "my-tasks").resolve()
    results = {"model": str(run), "files": [str(run / "lm-eval" / "x.jsonl"), str(tasks / "toy" / "t.yaml")],
               "text": "a b", "n": 3, "ok": True, "none": None, "pair": (str(run), 1), "count": np.int64(4)}
    assert portable(results, [run, tasks]) == {
        "model": "gba", "files": ["gba/lm-eval/x.jsonl", "my-tasks/toy/t.yaml"],
        "text": "a b", "n": 3, "ok": True, "none": None, "pair": ["gba", 1],  # a tuple's paths too
        "count": 4}  # a numpy number as the harness writes it: a number, not its text
    spaced = (tmp_path / "A User" / "gba").resolve()  # a home directory with a space in its name
    spaced.mkdir(parents=True)
    (tmp_path / "link").symlink_to(spaced)  # the same directory reached through a symlink
    assert portable({"model": str(spaced), "via": str(tmp_path / "link" / "x.json"), "text": "/ not a path",
                     "deep": str(tmp_path / "link" / "sub" / "x.json")},
                    [spaced]) == {"model": "gba", "via": "gba/x.json", "text": "/ not a path", "deep": "gba/sub/x.json"}
    # "/" and a top-level folder name no machine's files: a task's answer "/" was written "." (both files)
    answers = {"doc_to_choice": ["+", "/", "/usr", "/tmp"]}
    assert portable(answers, [spaced]) == answers and portable(answers, [spaced], existing_only=True) == answers
    # a generate_until task's stop sequences are text: "/" and "/end" were written "." and "end"
    config = {"generation_kwargs": {"until": ["/", "/end", str(spaced)], "max_gen_toks": 8}}
    assert portable(config, [spaced]) == config and portable(config, [spaced], existing_only=True) == config


def test_an_export_replaced_while_it_is_read_is_refused_not_mixed(trained, tmp_path, monkeypatch):
    """load_run reads an export's config.json (its step and config), tokenizer and weights one after another, and
    `gbattn export` replaces them one after another: read during an export, the step of one went with the weights of
    another, silently (46 of 2,079 reads of an export rewritten in a loop). A config.json replaced between the first
    read and the last is refused now; an export left alone reads as before."""
    from gbattn import files as files_module

    _, out = trained
    export = tmp_path / "export"
    shutil.copytree(out, export)
    assert rundir.load_run(export).checkpoint == "exported"
    real = rundir.read_exported_weights

    def read_while_exported_again(path, device):
        weights = real(path, device)
        config = path / "config.json"  # what move_into_place does: removed first, then put back (a new file)
        text = config.read_text()
        config.unlink()
        (path / "config.json.new").write_text(text)
        os.replace(path / "config.json.new", config)
        return weights

    monkeypatch.setattr(rundir, "read_exported_weights", read_while_exported_again)
    with pytest.raises(rundir.CheckpointError, match=f"^{re.escape(str(export))} was replaced by another `gbattn "
                                                     f"export` while it was read: read it again once that export "
                                                     f"has finished$"):
        rundir.load_run(export)
    # Read in the moment the export has removed config.json and staged the new files: an unfinished export, not
    # "not a run directory but holds one: EXPORT/.export.tmp<pid>@<host>", its staging folder offered as the run
    staging = export / f"{rundir.EXPORT_STAGING}{files_module.building_suffix()}"
    staging.mkdir()
    shutil.copy(export / "config.json", staging / "config.json")
    (export / "config.json").unlink()
    monkeypatch.undo()
    with pytest.raises(rundir.CheckpointError, match="holds an export that did not finish"):
        rundir.load_run(export)


def test_lm_eval_names_the_weights_it_evaluates(trained, tmp_path):
    """A run's best or last weights, or an export's, each with its step and the block size."""
    from gbattn.errors import UserError
    from gbattn.hf.lmeval import load_model

    run_dir, out = trained
    for model_dir, checkpoint, which in ((run_dir, "last", "last"), (run_dir, None, "best"), (out, None, "exported")):
        run = rundir.load_run(model_dir, checkpoint)
        model, _, block_size, max_length, step, got = load_model(model_dir, checkpoint, torch.device("cpu"))
        assert (got, step, block_size, max_length) == (which, run.step, 33, 32) and not model.training
        assert torch.equal(model.model.wte.weight, run.model.wte.weight)
    # a saved config whose gbattn dict records no step (a GbattnConfig built by hand): step 0, as gbattn eval says
    no_step = tmp_path / "no-step"
    shutil.copytree(out, no_step)
    config = json.loads((no_step / "config.json").read_text())
    del config["gbattn"]["step"]
    (no_step / "config.json").write_text(json.dumps(config))
    assert load_model(no_step, None, torch.device("cpu"))[4] == rundir.load_run(no_step).step == 0
    del config["gbattn"]["checkpoint"]  # nor which of its run's weights it holds: no "its run's None weights"
    (no_step / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="is an exported directory holding one set of weights: --checkpoint last "):
        rundir.load_run(no_step, "last")
    # an export holds its run's best weights only: the last ones asked of it are refused, not the export's scored
    with pytest.raises(UserError, match="is an exported directory holding its run's best weights: --checkpoint last"):
        load_model(out, "last", torch.device("cpu"))


def test_lm_eval_writes_its_results_before_it_prints_them(trained, tmp_path, capsys, monkeypatch):
    """The tables were printed first: a reader that left (`| true`, `| head`) or a stdout that could not print them
    ended the command before the results file was written, and the evaluation was lost. Written first now."""
    from gbattn.hf import lmeval

    _, out = trained
    results = {"results": {"toy": {"acc,none": 0.5}}, "gbattn": {"weights": "exported"}}
    monkeypatch.setattr(lmeval, "run_lm_eval", lambda *a, **kw: json.loads(json.dumps(results)))

    class CannotPrint(Exception):
        pass

    def cannot_print(results):
        raise CannotPrint

    monkeypatch.setattr(lmeval, "print_tables", cannot_print)
    target = tmp_path / "scores" / "res.json"
    with pytest.raises(CannotPrint):
        cli_main(["lm-eval", str(out), "--tasks", "toy", "--output", str(target), "--threads", "1"])
    assert json.loads(target.read_text())["results"] == results["results"]
    capsys.readouterr()


def test_lm_eval_evaluates_an_export_saved_in_bfloat16_in_float32(trained, tmp_path):
    """A directory saved in bfloat16 is evaluated in float32, as a run directory is, under every
    transformers version (5.x's from_pretrained would keep the saved dtype, 4.x load float32)."""
    from gbattn.hf.lmeval import load_model

    _, out = trained
    saved = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(out).to(torch.bfloat16).save_pretrained(saved)
    for name in ("gbattn-tokenizer.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / name, saved / name)
    model, *_ = load_model(saved, None, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    run = rundir.load_run(saved)  # gbattn's own commands read the same weights into float32
    torch.testing.assert_close(model.model.wte.weight, run.model.wte.weight, rtol=0, atol=0)


def test_lm_eval_reads_plain_outputs_whatever_a_save_pretrained_asked_for(trained, tmp_path):
    """A directory saved after `config.return_dict = False` or `output_hidden_states = True` (or the same, or
    `return_dict_in_generate`, in the generation config) made every harness request a traceback: a tuple has no
    .logits, and the wrapper returns no hidden states. lm-eval reads its own outputs: logits, generate()'s ids."""
    from gbattn.hf.lmeval import load_model

    _, out = trained
    saved = tmp_path / "saved"
    model = AutoModelForCausalLM.from_pretrained(out)
    model.config.return_dict = False
    model.config.output_hidden_states = True
    model.generation_config.output_hidden_states = model.generation_config.return_dict_in_generate = True
    # generation settings the harness gives itself: max_new_tokens=1 won over its max_gen_toks (answers cut short)
    model.generation_config.max_new_tokens, model.generation_config.do_sample = 1, True
    model.save_pretrained(saved)
    for name in ("gbattn-tokenizer.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / name, saved / name)
    config = json.loads((saved / "config.json").read_text())  # in config.json too, which 4.x copies into generation
    (saved / "config.json").write_text(json.dumps({**config, "return_dict_in_generate": True}))
    model, *_ = load_model(saved, None, torch.device("cpu"))
    ids = torch.tensor([[1, 2, 3]])
    assert model(ids).logits.shape == (1, 3, model.config.vocab_size)  # what HFLM's _model_call reads
    assert model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2).shape == (1, 5)
    assert model.generation_config.max_new_tokens is None and not model.generation_config.do_sample
    assert model.generate(ids, attention_mask=torch.ones_like(ids), max_length=6).shape == (1, 6)  # the harness's way


def test_lm_eval_passes_its_model_in_memory_without_the_harness_warnings(trained):
    """HFLM warns of a model given in memory that "many other model arguments may be ignored": the
    arguments gbattn gives (batch size, length) are used, so the warning is not printed; others are."""
    import logging

    from lm_eval.models.huggingface import HFLM

    from gbattn.hf.lmeval import GbattnLM, load_model

    _, out = trained
    model, tokenizer, _, max_length, _, _ = load_model(out, None, torch.device("cpu"))
    logged = []
    catcher = logging.Handler()
    catcher.emit = lambda record: logged.append(record.getMessage())
    harness_log = logging.getLogger(HFLM.__module__)
    harness_log.addHandler(catcher)
    try:
        lm = GbattnLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=3, max_length=max_length)
        assert (lm.batch_size, lm.max_length) == (3, max_length) and not logged, logged
        assert not harness_log.filters
        harness_log.warning("another warning")
        assert logged == ["another warning"]
    finally:
        harness_log.removeHandler(catcher)


def test_lm_eval_takes_a_harness_task_beside_an_include_path(tmp_path):
    """An --include-path that lacks one of the tasks is searched together with the harness's own tasks; that index
    builds a local task's mistake into one line too (one index: building it takes seconds)."""
    from gbattn.errors import UserError
    from gbattn.hf.lmeval import task_manager

    shutil.copytree(LMEVAL_DATA, tmp_path / "tasks")
    write_task(tmp_path / "tasks", "toy_bad", MC_ROW, "output_type: bogus\n")
    manager = task_manager(["gbattn_toy_mc", "arc_easy"], str(tmp_path / "tasks"))
    assert manager.match_tasks(["gbattn_toy_mc"]) and manager.match_tasks(["arc_easy"])
    with pytest.raises(UserError, match=r"^lm-eval could not build the task\(s\) \['toy_bad'\] from their YAML "
                                        r"\(ValueError: Got invalid output_type 'bogus'"):
        manager.load(["toy_bad"])
    # a full disk under the datasets cache blamed the task's YAML ("check the task's output_type, ...")
    import errno

    from lm_eval.tasks import TaskManager

    def full_disk(self, tasks, *args, **kwargs):
        raise OSError(errno.ENOSPC, "Not enough disk space")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TaskManager, "load", full_disk)
        with pytest.raises(UserError, match=r"^lm-eval could not build the task\(s\) \['gbattn_toy_mc'\]: a write "
                                            r"failed \(Not enough disk space\); free space where it writes"):
            manager.load(["gbattn_toy_mc"])


def test_lm_eval_results_file_names_and_contents(tmp_path):
    """The results stem names the tasks, limit and shots (safe as a file name); the results file leaves
    out the samples and the machine's description, a samples file is strict JSON (NaN as null), and
    the caller's results keep their samples."""
    from gbattn.hf.lmeval import results_stem, write_results

    assert results_stem(["hellaswag", "my/task x"], None, None) == "hellaswag+my_task_x"
    assert results_stem(["piqa"], 100.0, 5) == "piqa-limit100-5shot"
    assert results_stem(["piqa"], 0.5, 0) == "piqa-limit0.5-0shot"
    # the limit exactly as given (":g" kept 6 digits: 1234567 and 1234568 shared one file, named for neither)
    assert [results_stem(["t"], limit, None) for limit in (1234567.0, 1234568.0, 0.1234567)] == [
        "t-limit1234567", "t-limit1234568", "t-limit0.1234567"]
    assert results_stem(["arc-easy", "a+b.c"], None, None) == "arc-easy+a+b.c"  # already safe: kept
    # --checkpoint last has its own results file (it replaced the best weights'); best, the default, has none
    assert results_stem(["piqa"], 100.0, 5, "last") == "piqa-limit100-5shot-last"
    assert results_stem(["piqa"], None, None, "best") == results_stem(["piqa"], None, None) == "piqa"
    # a document's text that looks like a path ("/wiki/Coriolanus", an answer "/2") is text: kept (it was cut to
    # "wiki/Coriolanus"), while a path of this machine is made relative
    doc = {"text": "b", "source": "/wiki/Coriolanus", "target": "/2", "file": str(tmp_path / "data" / "x.jsonl")}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jsonl").write_text("")
    samples = {"toy": [{"doc": {"text": "a"}, "resps": [[float("nan")]]}], "my/task x": [{"doc": doc}]}
    results = {"results": {"toy": {"acc": 0.5}}, "pretty_env_info": "PyTorch version: 2", "samples": samples}
    out = tmp_path / "lm-eval" / "results-toy.json"
    written = write_results(results, out, [tmp_path])
    # a task YAML's name as the results stem has it (with its "/" the samples file was a FileNotFoundError)
    assert written == [out, out.with_name("samples-toy-toy.jsonl"), out.with_name("samples-my_task_x-toy.jsonl")]
    assert results["samples"] is samples and json.loads(written[2].read_text()) == {"doc": {
        "text": "b", "source": "/wiki/Coriolanus", "target": "/2", "file": f"{tmp_path.name}/data/x.jsonl"}}
    assert json.loads(out.read_text()) == {"results": {"toy": {"acc": 0.5}}}

    assert strict_json(written[1].read_text())["resps"] == [[None]]
    # Written again without samples (weights since resumed or re-exported): its tasks' samples of the earlier call go
    # (step-200 log-likelihoods stayed beside step-300 results); another results file's samples stay
    other = out.with_name("samples-toy-x-toy.jsonl")  # results-x-toy.json's samples of task "toy"
    other.write_text("")
    assert write_results({"results": {"toy": {"acc": 0.6}}, "configs": {"my/task x": {}}}, out, [tmp_path]) == [out]
    assert sorted(p.name for p in out.parent.iterdir()) == ["results-toy.json", other.name]
    # A full disk, or a file-size limit, under a samples file: the new results were written beside the previous
    # samples (another model's). The results and their samples are replaced together, or neither.
    import resource

    from gbattn.errors import UserError

    write_results({"results": {"toy": {"acc": 0.5}}, "samples": {"toy": [{"doc": "old"}]}}, out, [tmp_path])
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    big = {"results": {"toy": {"acc": 0.9}}, "samples": {"toy": [{"doc": "x" * 200_000}]}}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # (Python ignores SIGXFSZ)
    try:
        with pytest.raises(UserError, match=r"samples-toy-toy.jsonl \(File too large\); it and the 1 other file\(s\) "
                                            r"written with it are as they were$"):
            write_results(big, out, [tmp_path])
        # the previous samples of a task this call does not log are removed only once the new results are written
        # (they went before the write, which then failed: the previous results without their samples)
        with pytest.raises(UserError, match=r"samples-other-toy.jsonl \(File too large\)"):
            write_results({"results": {"toy": {"acc": 0.9}}, "samples": {"other": [{"doc": "x" * 200_000}]}}, out,
                          [tmp_path])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before


def test_lm_eval_command_forwards_every_option(tmp_path, monkeypatch, capsys):
    """`gbattn lm-eval`: each option reaches run_lm_eval (batch 8, no limit, shots or samples by
    default), --threads reaches set_threads, the results go to MODEL/lm-eval/results-<stem>.json or
    --output with the model and the --include-path as the roots of their paths (lm-eval runs in one process: no
    rank without results)."""
    from gbattn import runtime
    from gbattn.hf import lmeval

    calls, threads, written = [], [], []
    monkeypatch.setattr(lmeval, "run_lm_eval", lambda *args, **kwargs: calls.append((args, kwargs)) or {"gbattn": {}})
    monkeypatch.setattr(lmeval, "print_tables", lambda results: None)
    monkeypatch.setattr(lmeval, "write_results",
                        lambda results, out, roots: written.append((results["gbattn"]["command"], out, roots)) or [out])
    monkeypatch.setattr(runtime, "set_threads", threads.append)
    model, tasks = tmp_path / "model", tmp_path / "tasks"
    model.mkdir()
    tasks.mkdir()
    capsys.readouterr()
    assert cli_main(["lm-eval", str(model), "--tasks", "a"]) == 0
    assert capsys.readouterr().out == f"wrote {model / 'lm-eval' / 'results-a.json'}\n"  # where the results went
    assert calls[-1] == ((model, ["a"]), dict(include_path=None, limit=None, batch_size=8,
                                              device=runtime.resolve_device("auto"), checkpoint=None,
                                              num_fewshot=None, log_samples=False))
    assert written[-1] == ("gbattn lm-eval model --tasks a", model / "lm-eval" / "results-a.json", [model.resolve()])
    assert threads == [None]
    assert cli_main(["lm-eval", str(model), "--tasks", "a,b", "--include-path", str(tasks), "--limit", "0.5",
                     "--num-fewshot", "0", "--batch-size", "3", "--log-samples", "--checkpoint", "last", "--device",
                     "cpu", "--threads", "2", "--output", str(tmp_path / "r.json")]) == 0
    assert calls[-1] == ((model, ["a", "b"]), dict(include_path=str(tasks), limit=0.5, batch_size=3,
                                                   device=torch.device("cpu"), checkpoint="last", num_fewshot=0,
                                                   log_samples=True))
    assert written[-1][1:] == (tmp_path / "r.json", [model.resolve(), tasks.resolve()]) and threads[-1] == 2
    assert cli_main(["lm-eval", str(model), "--tasks", "a", "--limit", "100", "--num-fewshot", "5"]) == 0
    assert written[-1][1] == model / "lm-eval" / "results-a-limit100-5shot.json"
    # a task named twice is evaluated once; --checkpoint last has its own results file (it replaced best's)
    assert cli_main(["lm-eval", str(model), "--tasks", "a,b,a", "--checkpoint", "last"]) == 0
    assert calls[-1][0] == (model, ["a", "b"]) and written[-1][1] == model / "lm-eval" / "results-a+b-last.json"
    # --device reaches resolve_device (on a machine without CUDA, --device cpu reads the same as the default, auto)
    code, _, err = run_cli(capsys, ["lm-eval", model, "--tasks", "a", "--device", "cdua"])
    assert code == 2 and "device='cdua' is not allowed (did you mean 'cuda'?)" in err and len(calls) == 4, err
    # a run with no best-validation weights yet (in its first evaluation interval): its last checkpoint is scored,
    # asked for as such and named so (the file was the best weights', unsaid)
    (model / "config.json").write_text("{}")
    (model / "checkpoint.pt").write_bytes(b"x")
    code, _, err = run_cli(capsys, ["lm-eval", model, "--tasks", "a"])
    assert code == 0 and calls[-1][1]["checkpoint"] == "last"
    assert written[-1][1] == model / "lm-eval" / "results-a-last.json"
    assert f"note: {model} has no best-validation weights (best.pt) yet: scoring its last checkpoint\n" in err


def test_lm_eval_refuses_file_names_too_long_for_the_file_system_before_it_evaluates(tmp_path, monkeypatch, capsys):
    """Six long task names: the results file's name (246 bytes) was legal, but atomic_write's temporary name was not,
    and a samples file's name was longer still: the command failed after the whole evaluation, its results lost. Such
    names are refused before anything runs, in one line naming the file; a short --output takes the results."""
    from gbattn.files import building_suffix
    from gbattn.hf import lmeval

    calls = []
    monkeypatch.setattr(lmeval, "run_lm_eval", lambda *args, **kwargs: calls.append(args) or {"gbattn": {}})
    monkeypatch.setattr(lmeval, "print_tables", lambda results: None)
    monkeypatch.setattr(lmeval, "write_results", lambda results, out, roots: [out])
    model = tmp_path / "model"
    model.mkdir()
    room = lmeval.NAME_MAX - len(building_suffix())  # the longest results name that fits, temporary suffix and all
    task = "t" * (room - len("results-.json"))
    assert cli_main(["lm-eval", str(model), "--tasks", task]) == 0 and len(calls) == 1
    for argv in (["--tasks", task + "x"], ["--tasks", task, "--log-samples"]):  # one byte over; its samples file
        code, _, err = run_cli(capsys, ["lm-eval", model, *argv])
        assert code == 2 and err.count("\n") == 1 and "longer than the 255 a file name may have" in err, err
    assert len(calls) == 1  # nothing evaluated
    assert cli_main(["lm-eval", str(model), "--tasks", task + "x", "--output", str(tmp_path / "r.json")]) == 0
    assert len(calls) == 2
    # two tasks whose samples files would have one name (toy/mc and toy_mc): the second's replaced the first's
    code, _, err = run_cli(capsys, ["lm-eval", model, "--tasks", "toy/mc,toy_mc", "--log-samples"])
    assert (code, err) == (2, "gbattn: error: --log-samples: tasks toy/mc, toy_mc would write one samples file, "
                              "samples-toy_mc-toy_mc+toy_mc.jsonl; evaluate them in separate calls (or with separate "
                              "--output names)\n")
    assert len(calls) == 2


def test_lm_eval_counts_file_names_in_bytes_as_the_file_system_does(tmp_path):
    """A name of two-byte letters that fits in characters but not in bytes is refused (it failed after the whole
    evaluation); of two samples files, the one longest in bytes is the one checked, not the one longest in letters."""
    from gbattn.errors import UserError
    from gbattn.files import building_suffix
    from gbattn.hf import lmeval

    room = lmeval.NAME_MAX - len(os.fsencode(building_suffix()))
    letters = (room - len("results-.json")) // 2 + 1  # fits in characters, 2 bytes each: not in bytes
    with pytest.raises(UserError, match=r"bytes, and \d+ more while it is written\): longer than the 255"):
        lmeval.check_file_names(tmp_path / f"results-{'é' * letters}.json", ["t"], False)
    fits = "a" * (room - len("samples--r.jsonl"))  # its samples file's name is exactly the room there is
    lmeval.check_file_names(tmp_path / "r.json", [fits], True)
    wide = "é" * ((room - len("samples--r.jsonl")) // 2 + 1)  # fewer letters than `fits`, more bytes than the room
    assert len(wide) < len(fits)
    with pytest.raises(UserError, match="lm-eval would write samples-é"):
        lmeval.check_file_names(tmp_path / "r.json", [fits, wide], True)


def test_run_lm_eval_hands_the_harness_every_argument(monkeypatch):
    """The model wrapper gets the batch size and the block size as max_length, simple_evaluate the
    task manager, limit, shots and log_samples; the tokenizer's "longer than" warning is filtered
    only during the call; a refused task is a one-line error with the harness's bars closed; any other failure
    is raised as it is."""
    import io
    import logging

    from tqdm import tqdm

    from gbattn.errors import UserError
    from gbattn.hf import lmeval

    loads, made, evaluated, bars = [], [], [], []
    log = logging.getLogger("transformers.tokenization_utils_base")
    filters = list(log.filters)

    class LM:
        def __init__(self, **kwargs):
            made.append(kwargs)

    def evaluate(**kwargs):
        evaluated.append(kwargs)
        long, other = (log.makeRecord(log.name, logging.WARNING, __file__, 0, message, None, None) for message in
                       ("Token indices sequence length is longer than the specified maximum", "another warning"))
        assert not log.filter(long) and log.filter(other)
        return {"results": {}}

    monkeypatch.setattr(lmeval, "task_manager", lambda tasks, include_path: ("manager", tasks, include_path))
    monkeypatch.setattr(lmeval, "load_model", lambda *args: loads.append(args) or ("model", "tok", 41, 40, 7, "best"))
    monkeypatch.setattr(lmeval, "GbattnLM", LM)
    monkeypatch.setattr(lmeval, "simple_evaluate", evaluate)
    results = lmeval.run_lm_eval("dir", ["a"], include_path="inc", limit=0.5, batch_size=3, device="cpu",
                                 num_fewshot=0)
    assert loads == [("dir", None, torch.device("cpu"))]
    assert made == [dict(pretrained="model", tokenizer="tok", backend="causal", batch_size=3, max_length=40,
                         logits_cache=False)]
    assert isinstance(evaluated[0].pop("model"), LM)
    assert evaluated == [dict(tasks=["a"], task_manager=("manager", ["a"], "inc"), limit=0.5, num_fewshot=0,
                              log_samples=False, batch_size=3, device="cpu")]
    assert results == {"results": {}, "gbattn": {"step": 7, "block_size": 41, "max_length": 40, "checkpoint": "best",
                                                 "logits_cache": False}}
    assert log.filters == filters and lmeval._windowed_by_the_harness not in log.filters  # (not even from a run before)

    # Every failure that is the user's one line closes the bar the harness left open (it printed after the line)
    for failure, line in ((AssertionError("requested max tokens 64 exceed the model's 32"),
                           "lm-eval refused the task for this model .*requested max tokens 64"),
                          (ConnectionError("hub unreachable"), "lm-eval could not load a task's data"),
                          (FileNotFoundError("data/task.jsonl"), "lm-eval could not find a task's data"),
                          (Exception("Missing [UNK] token"), r"a task's text \(a prompt, an answer or a stop")):
        def refuse(failure=failure, **kwargs):
            bars.append(tqdm(total=3, file=io.StringIO()))
            raise failure

        monkeypatch.setattr(lmeval, "simple_evaluate", refuse)
        with pytest.raises(UserError, match=line):
            lmeval.run_lm_eval("dir", ["a"])
        assert bars[-1] not in getattr(tqdm, "_instances", ()), line
        assert lmeval._windowed_by_the_harness not in log.filters

    def fail(**kwargs):  # a bug, not a user's mistake: raised as it is, not as the untokenizable-character line
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(lmeval, "simple_evaluate", fail)
    with pytest.raises(RuntimeError, match="device-side assert triggered"):
        lmeval.run_lm_eval("dir", ["a"])
    assert lmeval._windowed_by_the_harness not in log.filters


def test_lm_eval_prints_the_groups_table_when_there_are_groups(monkeypatch, capsys):
    from gbattn.hf import lmeval

    monkeypatch.setattr(lmeval, "make_table", lambda results, column="results": f"{column} of {len(results)}")
    lmeval.print_tables({"results": {}})
    assert capsys.readouterr().out == "results of 1\n"
    lmeval.print_tables({"results": {}, "groups": {"g": {}}})
    assert capsys.readouterr().out == "results of 2\ngroups of 2\n"


def test_generate_stop_strings_with_a_tokenizer_that_joins_its_pieces_with_spaces_is_one_error(tmp_path):
    """The paper's BPE has no decoder: its export writes a space before each piece, so "abcdef" decodes as
    " ab c de f", and transformers' stop-string criterion failed with "substring not found" deep in generate():
    refused up front, naming why; without stop_strings it generates as gbattn does."""
    from gbattn.hf import wrap_run

    bpe = get_tokenizer("bpe", load_corpus(str(write_corpus(tmp_path / "c"))), vocab_size=120, verbose=False)
    cfg = tiny_config(("standard", {}), vocab_size=bpe.vocab_size)
    gpt = GPT(cfg).eval()
    model, tokenizer = wrap_run(rundir.LoadedRun(tmp_path, gpt, cfg, None, bpe, {"model": cfg.to_dict()}, 7, "last"))
    prompt = torch.tensor([bpe.encode("the cat")])
    with pytest.raises(ValueError, match=r"^stop_strings need a tokenizer whose tokens decode back to their text .* "
                                         r"writes a space before each piece"):
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                       stop_strings=["the"], tokenizer=tokenizer)
    assert torch.equal(model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                      do_sample=False), gpt.generate(prompt, 4, top_k=1))


def test_generate_stop_strings_stop_where_gbattns_stop_strings_do(tmp_path):
    """transformers' generate(stop_strings=..., tokenizer=...) works on the wrapper and ends at the token where
    gbattn's StopStrings ends the same greedy decoding, for a stop text that lies in the new text; one that begins
    in the prompt ends transformers' decoding there, where gbattn's looks at the new text only (README, "Using
    gbattn from Python")."""
    from gbattn.hf import wrap_run
    from gbattn.model.decoding import StopStrings

    chars = get_tokenizer("char", load_corpus(str(write_corpus(tmp_path / "c"))))
    torch.manual_seed(1)  # a tiny random model whose greedy text changes character (most repeat one)
    cfg = tiny_config(("boosted", {}), vocab_size=chars.vocab_size)
    gpt = GPT(cfg).eval()
    prompt = torch.tensor([chars.encode("the cat")])
    n = prompt.shape[1]
    model, tokenizer = wrap_run(rundir.LoadedRun(tmp_path, gpt, cfg, None, chars, {"model": cfg.to_dict()}, 7, "last"))
    new_text = chars.decode(gpt.generate(prompt, 12, top_k=1)[0, n:].tolist())  # greedy
    assert new_text.startswith("t")  # so "t" + "t", the prompt's last character and the first new one, reads "tt"
    inside = next(new_text[i:i + 2] for i in range(1, 11) if new_text[i] != new_text[i + 1])
    for stop_text, theirs_new in ((inside, new_text.index(inside) + 2), ("tt", 1)):
        ours = gpt.generate(prompt, 12, top_k=1, stop=StopStrings(chars.decode, [stop_text]))[0].tolist()
        assert len(ours) == n + new_text.index(stop_text) + 2
        theirs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                do_sample=False, stop_strings=[stop_text], tokenizer=tokenizer)[0].tolist()
        assert theirs == ours[:n + theirs_new], stop_text
