"""The GPT model: exact parameter counts, presets, block options (GPT-2 and Llama style), causality,
cached decoding, dropout sites, errors."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from gbattn.attention.core import AttnContext, positions_of, rope_for
from gbattn.config import DROPOUT_SITES, PRESETS, ConfigError, ModelConfig, preset_config
from gbattn.model import GPT, count_params, flops_per_token, lm_loss, param_matched_width

BLOCKS = {
    "gpt2": {},
    "llama": dict(norm_type="rmsnorm", ffn="swiglu", bias=False, pos="rope", rope_base=500.0, n_kv_heads=2),
    "post-gelu-tanh-mqa": dict(norm="post", ffn="gelu-tanh", pos="rope", n_kv_heads=1),
}


def tiny_config(variant_case, **kw) -> ModelConfig:
    name, opts = variant_case
    base = dict(
        vocab_size=37, block_size=24, d_model=16, n_layers=2, n_heads=4, dropout=0.0, attn=name, attn_options=opts
    )
    base.update(kw)
    if name == "differential" and base.get("n_kv_heads") == 1:
        base["n_kv_heads"] = 2  # differential attention pairs K/V heads
    return ModelConfig(**base)


def tiny_model(variant_case, **kw) -> GPT:
    model = GPT(tiny_config(variant_case, **kw)).double()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for p in model.parameters():
            p.mul_(8.0) if p.dim() > 1 else None
    return model.eval()


# ---- The paper's table (docs/paper.md): these counts must come out exactly -----------


@pytest.mark.parametrize(
    "attn,overrides,expected",
    [
        ("standard", {}, 7_419_392),
        ("twicing", {}, 7_419_392),
        ("boosted", {"attn.rounds": 2}, 8_734_208),
        ("standard", {"d_model": 288}, 8_789_184),
    ],
)
def test_paper_parameter_counts(attn, overrides, expected):
    cfg = preset_config("paper-small", attn, overrides)
    assert count_params(cfg) == expected
    assert GPT(cfg).num_params() == expected  # the real module, not only the meta build


@pytest.mark.parametrize(
    "preset,attn,expected",
    [
        # Llama-style at paper-small's size: embeddings 4,194,304; per layer Q/K/V 131,072 (2 K/V heads),
        # W_out 65,536, SwiGLU 3 x 256 x 688 = 528,384, two RMSNorm gains 512; final RMSNorm 256.
        ("llama-small", "standard", 7_096_576),
        # + per layer: the correction's Q/K/V 131,072 and the gate 2d -> d with its bias 131,328.
        ("llama-small", "boosted", 8_146_176),
        ("cpu-llama", "standard", 1_262_720),
        ("cpu-llama", "boosted", 1_525_376),
    ],
)
def test_llama_preset_parameter_counts(preset, attn, expected):
    assert count_params(preset_config(preset, attn)) == expected


def test_size_functions_given_a_model_or_a_preset_name_say_they_take_a_config():
    """count_params(model), the natural call from Python, was "'GPT' object has no attribute
    'vocab_size'"; a preset name, to them or to GPT, "'str' object has no attribute ..."."""
    cfg = tiny_config(("standard", {}))
    model = GPT(cfg)
    # Each names itself (without its own check, GPT's or count_params' would name that one)
    for name, function in (("count_params", count_params), ("flops_per_token", flops_per_token),
                           ("param_matched_width", lambda c: param_matched_width(c, 10_000))):
        with pytest.raises(ConfigError, match=rf"^{name} takes a ModelConfig \(model\.cfg; a model counts its own "
                                              r"with model\.num_params\(\)\), not a GPT"):
            function(model)
        with pytest.raises(ConfigError, match=rf"^{name} takes a ModelConfig \(e\.g\. preset_config\('cpu-char', "
                                              r"'boosted'\)\), not a str"):
            function("cpu-char")
    assert count_params(model.cfg) == model.num_params()
    with pytest.raises(ConfigError, match=r"GPT takes a ModelConfig \(e\.g\. preset_config\('cpu-char', 'boosted'\)\), "
                                          r"not a str"):
        GPT("cpu-char")  # was "'str' object has no attribute 'vocab_size'"


def test_param_matched_width_is_288():
    cfg = preset_config("paper-small", "boosted")
    assert param_matched_width(cfg, count_params(cfg)) == (288, 8_789_184)
    assert count_params(cfg.replace(attn="standard", attn_options={}, d_model=284)) < 8_734_208


def test_flops_boosted_more_than_standard():
    std = flops_per_token(preset_config("paper-small", "standard"))
    gba = flops_per_token(preset_config("paper-small", "boosted"))
    assert 1.1 < gba / std < 1.5


def test_flops_per_token_by_hand():
    """paper-small standard (d 256, 4 layers, vocab 16,384, context 256), counted by hand: 2 FLOPs per
    weight of the attention (4d^2), FFN (8d^2) and LM-head matmuls, plus QK^T and AV (2 x 2Td per
    layer); training (forward and backward) is 3x the forward."""
    cfg = preset_config("paper-small", "standard")
    d, layers, vocab, context = 256, 4, 16_384, 256
    forward = 2 * (layers * 12 * d * d + vocab * d) + layers * 4 * context * d
    assert flops_per_token(cfg) == forward == 15_728_640
    for attn in ("standard", "boosted"):
        cfg = preset_config("paper-small", attn)
        assert flops_per_token(cfg, backward=True) == 3 * flops_per_token(cfg)


def test_gba_cost_at_paper_small_is_the_method_docs():
    """docs/method.md, section 8, at paper-small (d 256, T 256, 4 layers): an extra round adds per token
    and layer its d -> 3d projection, the two attention matmuls (4 T d) and the 2d -> d gate, so the
    sublayer goes from 786,432 to 1,703,936 FLOPs and the model from 15.73 M to 19.40 M; parameters
    +5d^2 + 4d per layer (8,734,208), +3d^2 + 2d with kv_source=shared (8,207,872)."""
    d, T, layers = 256, 256, 4
    standard, gba = preset_config("paper-small", "standard"), preset_config("paper-small", "boosted")
    extra_round = 2 * d * 3 * d + 4 * T * d + 2 * 2 * d * d
    assert (2 * d * 3 * d, 4 * T * d, 2 * 2 * d * d, extra_round) == (393_216, 262_144, 262_144, 1_703_936 - 786_432)
    assert flops_per_token(gba) - flops_per_token(standard) == layers * extra_round
    assert flops_per_token(gba) == 19_398_656
    shared = preset_config("paper-small", "boosted", {"attn.kv_source": "shared"})
    assert (5 * d * d + 4 * d, 3 * d * d + 2 * d) == (328_704, 197_120)
    assert count_params(gba) == count_params(standard) + layers * 328_704 == 8_734_208
    assert count_params(shared) == count_params(standard) + layers * 197_120 == 8_207_872


def test_docs_parameter_figures_are_the_counts():
    """The parameter figures docs/paper.md and docs/baselines.md state, recomputed with count_params: the
    standard paper-small formula and the param-fair bracket, G1's W_theta, differential attention's lambda
    vectors and norm gains, AttnRes's pseudo-queries and gains, and a Llama-block GBA round."""
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    paper, baselines = (" ".join((docs / name).read_text(encoding="utf-8").split())
                        for name in ("paper.md", "baselines.md"))

    def extra(preset, attn, **overrides):
        """Parameters over the preset's standard model (plain residual stream)."""
        return count_params(preset_config(preset, attn, overrides)) - count_params(preset_config(preset, "standard"))

    def standard(d):
        return count_params(preset_config("paper-small", "standard", {"d_model": d}))

    linear, rest = divmod(standard(256) - 48 * 256 * 256, 256)
    assert rest == 0 and all(standard(d) == 48 * d * d + linear * d for d in (4, 284, 288))
    assert f"`48 d^2 + (16384 + 256 + 4*13 + 2) d = 48 d^2 + {linear:,} d` parameters" in paper
    gba = count_params(preset_config("paper-small", "boosted"))
    assert standard(284) < gba <= standard(288)
    assert f"d = 284 gives {standard(284):,} (too few) and d = 288 gives {standard(288):,}" in paper

    assert f"`d^2` parameters per layer ({extra('paper-small', 'gated') // 4:,} at d = 256)" in baselines
    assert f"That is `+6E` per layer, +{extra('paper-small', 'differential') // 4:,} at d = 256 (E = 64)" in baselines
    attnres = extra("cpu-proxy", "standard", residual="attnres-full")
    assert attnres == extra("cpu-proxy", "standard", residual="attnres-block") == 2 * (2 * 4 + 1) * 128
    assert f"`2(2L + 1) d`. That is {attnres:,} at d = 128, L = 4." in baselines
    assert f"({extra('llama-small', 'boosted') // 4:,} at `llama-small`: d = 256, H = 4, G = 2, E = 64)" in baselines


def test_flops_count_matrix_products_only_and_training_is_three_forwards():
    """docs/baselines.md, "Compute-matched baseline": only matrix products count (a norm or an activation of
    another kind changes nothing), every variant's training FLOPs are 3x its forward's, Twicing adds one
    T x T product pair per layer, the gated variant its bias-free d -> d gate, differential attention's
    two maps count at the value width 2E its zero-padded queries and keys run at (2x standard's pair), and
    AttnRes its weighted sums over depth."""
    d, T, layers = 128, 128, 4
    standard = preset_config("cpu-proxy", "standard")
    base = flops_per_token(standard)
    for overrides in ({"norm_type": "rmsnorm"}, {"ffn": "gelu-tanh"}, {"norm": "post"}, {"bias": False}):
        assert flops_per_token(standard.replace(**overrides)) == base, overrides
    extra = {"twicing": layers * 4 * T * d, "gated": layers * 2 * d * d, "differential": layers * 4 * T * d}
    for attn, more in extra.items():
        assert flops_per_token(preset_config("cpu-proxy", attn)) - base == more, attn
    # Full AttnRes: its weighted sums over N sources (2 N d), N = 2 .. 8 at sublayers 1 .. 7 and 9 at the final mix;
    # its depth logits, matrix-vector products, are not counted.
    attnres = preset_config("cpu-proxy", "standard", {"residual": "attnres-full"})
    assert flops_per_token(attnres) - base == 2 * d * (sum(range(2, 9)) + 9)
    for attn, overrides in (("standard", {}), ("twicing", {}), ("gated", {}), ("differential", {}), ("boosted", {}),
                            ("boosted", {"attn.gate": "mlp"}), ("standard", {"residual": "attnres-block"})):
        cfg = preset_config("cpu-proxy", attn, overrides)
        assert flops_per_token(cfg, backward=True) == 3 * flops_per_token(cfg), (attn, overrides)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_forward_backward(preset):
    cfg = preset_config(preset, "boosted")
    if count_params(cfg) > 20_000_000:  # large presets: shapes and autograd on the meta device
        with torch.device("meta"):
            model = GPT(cfg)
            idx = torch.zeros(2, 16, dtype=torch.long)
            lm_loss(model(idx), idx).backward()
        assert model.wte.weight.grad is not None
        return
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = lm_loss(model(idx), idx)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


# ---- behaviour over every variant -----------------------------------------------------


@pytest.mark.parametrize("block", list(BLOCKS))
def test_model_causality(variant_case, block):
    model = tiny_model(variant_case, **BLOCKS[block])
    idx = torch.randint(0, 37, (2, 12))
    idx2 = idx.clone()
    idx2[:, 6:] = (idx2[:, 6:] + 5) % 37
    a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-12)
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6


@pytest.mark.parametrize("block", list(BLOCKS))
def test_cached_decode_equals_full_forward(variant_case, block):
    model = tiny_model(variant_case, **BLOCKS[block])
    idx = torch.randint(0, 37, (2, 11))
    full = model(idx)
    model.setup_cache(batch=2, max_len=16)
    prefill = 4
    step_logits = [model(idx[:, :prefill], input_pos=torch.arange(prefill))]
    for t in range(prefill, idx.shape[1]):
        step_logits.append(model(idx[:, t : t + 1], input_pos=torch.tensor([t])))
    cached = torch.cat(step_logits, dim=1)
    torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)
    model.clear_cache()
    torch.testing.assert_close(model(idx), full, rtol=0, atol=0)
    for rows in (1, 3):  # a cache for one row does not silently take two; a cache for three is no torch size error
        model.setup_cache(batch=rows, max_len=16)
        with pytest.raises(ValueError, match=f"a batch of 2 rows written to a KV cache set up for {rows}"):
            model(idx[:, :prefill], input_pos=torch.arange(prefill))


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_cached_decode_with_position_ids_other_than_its_slots_equals_full_forward(variant_case, block):
    """With a cache, ``position_ids`` give the positions and ``input_pos`` only the slots: positions 2s + row
    (a gap RoPE sees too, and another per row) decode as the full forward at those positions does. Positions
    taken from the slots instead of from ``position_ids`` are another model's logits."""
    model = tiny_model(variant_case, **BLOCKS[block])
    idx = torch.randint(0, 37, (2, 11))
    positions_BT = 2 * torch.arange(11).expand(2, -1) + torch.tensor([[0], [1]])
    full = model(idx, position_ids=positions_BT)
    assert (full - model(idx)).abs().max() > 1e-6  # the positions matter here
    model.setup_cache(batch=2, max_len=16)
    prefill = 4
    step_logits = [model(idx[:, :prefill], input_pos=torch.arange(prefill), position_ids=positions_BT[:, :prefill])]
    for t in range(prefill, idx.shape[1]):
        step_logits.append(
            model(idx[:, t : t + 1], input_pos=torch.tensor([t]), position_ids=positions_BT[:, t : t + 1])
        )
    torch.testing.assert_close(torch.cat(step_logits, dim=1), full, rtol=1e-10, atol=1e-10)
    model.clear_cache()


@pytest.mark.parametrize("block", list(BLOCKS))
def test_a_left_padded_batch_with_only_a_mask_gives_each_row_as_alone(block):
    """model(idx, key_padding_mask=keep) gave a left-padded row's tokens positions 0..T-1, shifted by
    its padding: with learned positions its logits were not the row's alone (they were under RoPE,
    which sees only differences). Each row's positions now count its real tokens, as the Hugging
    Face wrapper's do and as position_ids=positions_of(keep) gives."""
    model = tiny_model(("boosted", {"rounds": 2}), **BLOCKS[block])
    idx = torch.randint(0, 37, (2, 7))
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, :3] = False
    padded = model(idx, key_padding_mask=keep)
    torch.testing.assert_close(padded[0, 3:], model(idx[:1, 3:])[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(padded[1], model(idx[1:])[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(padded, model(idx, key_padding_mask=keep, position_ids=positions_of(keep)),
                               rtol=0, atol=0)


def test_positions_of_a_padded_batch_are_what_its_docstring_says():
    """Real tokens count from 0 in each row; padding before them sits at 0, padding after a real token at
    that token's position (the docstring said "padding at 0", which holds for left padding only)."""
    keep = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    assert positions_of(keep).tolist() == [[0, 0, 0, 1], [0, 1, 1, 1], [0, 0, 1, 1]]


def test_a_model_converted_after_setup_cache_still_decodes():
    """setup_cache fixed the cache's dtype at the model's dtype then: a model moved to float32 after
    it failed its next cached call ("Expected query, key, and value to have the same dtype"; once
    the cache was written, index_copy_'s "self and source expected to have the same dtype")."""
    model = tiny_model(("twicing", {}))  # a value-only cache entry too
    idx = torch.randint(0, 37, (1, 6))
    model.setup_cache(batch=1, max_len=8)
    model.float()  # before the first write
    full = model(idx, input_pos=torch.arange(6))
    assert full.dtype == torch.float32
    model.clear_cache()
    torch.testing.assert_close(full, model(idx))
    model.setup_cache(batch=1, max_len=8)
    model(idx[:, :5], input_pos=torch.arange(5))
    model.double()  # after it: the written buffers follow .to() and the next token reads them
    last = model(idx[:, 5:], input_pos=torch.tensor([5]))
    assert last.dtype == torch.float64
    model.clear_cache()
    torch.testing.assert_close(last[:, 0], model(idx)[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_naive_model_path_equals_fast(variant_case, block):
    model = tiny_model(variant_case, **BLOCKS[block])
    idx = torch.randint(0, 37, (2, 10))
    torch.testing.assert_close(model(idx, naive=True), model(idx), rtol=1e-10, atol=1e-10)
    logits, record = model(idx, return_intermediates=True)
    assert len(record) == 2 and all(layer.rounds for layer in record)  # each layer's attention filled its own
    torch.testing.assert_close(logits, model(idx), rtol=1e-10, atol=1e-10)


def test_same_seed_same_model(variant_case):
    cfg = tiny_config(variant_case)
    torch.manual_seed(5)
    a = GPT(cfg)
    torch.manual_seed(5)
    b = GPT(cfg)
    idx = torch.randint(0, 37, (2, 8))
    torch.testing.assert_close(a(idx), b(idx), rtol=0, atol=0)


def test_a_model_keeps_its_own_copy_of_its_config():
    """GPT held the caller's (mutable) config: cfg.n_layers = 3 to build a deeper model next made the first one
    set up a 3-layer cache for its 2 blocks in generate ("a KV cache of 3 layers for a model of 2"), and
    cfg.block_size moved past its position table."""
    cfg = tiny_config(("boosted", {"rounds": 2}))
    model = GPT(cfg).eval()
    idx = torch.randint(0, 37, (1, 4))
    expected = model.generate(idx, 10, temperature=0)
    cfg.n_layers, cfg.block_size = 3, 48
    cfg.attn_options["rounds"] = 3
    assert model.cfg == tiny_config(("boosted", {"rounds": 2}))
    assert torch.equal(model.generate(idx, 10, temperature=0), expected)


def test_a_config_changed_after_it_was_built_is_checked_by_gpt():
    """A field set on a built config skips its checks: GPT(cfg) then built a model of vocab_size 0, block_size 0 or
    norm "mid" (read as Post-LN) silently, or failed in torch ("negative dimension -1")."""
    cases = (("vocab_size", 0, "vocab_size=0 must be"), ("block_size", 0, "block_size=0 must be"),
             ("norm", "mid", "norm='mid' is not allowed"), ("d_model", -1, "d_model=-1 must be"))
    for field_name, bad, message in cases:
        cfg = tiny_config(("boosted", {"rounds": 2}))
        setattr(cfg, field_name, bad)
        with pytest.raises(ConfigError, match=message):
            GPT(cfg)


def test_each_block_is_built_for_its_own_layer():
    """Block i's attention is layer i of n_layers: ``attn.layers=[-1]`` puts correction rounds in the
    last layer only, and differential attention's lambda_init is 0.8 - 0.6 exp(-0.3 i) per layer."""
    model = GPT(tiny_config(("boosted", {"layers": [-1]}), n_layers=3))
    assert [len(block.attn.corrections) for block in model.blocks] == [0, 0, 1]
    model = GPT(tiny_config(("differential", {}), n_layers=3))
    expected = [0.8 - 0.6 * math.exp(-0.3 * i) for i in range(3)]
    assert [block.attn.lambda_init for block in model.blocks] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("block", BLOCKS)
def test_a_block_called_on_its_own_is_the_block_inside_the_model(block):
    """``block(h, None)`` (gbattn.model.Block on its own) is causal attention over positions 0 .. T-1 with the
    config's RoPE, as inside the model (its context's rope tables): a RoPE block called so ran without RoPE,
    silently. GBA and differential attention (its own RoPE'd pairs) both."""
    for case in (("boosted", {}), ("differential", {})):
        model = tiny_model(case, **BLOCKS[block])
        h_BTD = torch.randn(2, 7, 16, dtype=torch.float64)
        cfg = model.cfg
        rope = rope_for(torch.arange(7), cfg.d_head, cfg.rope_base, h_BTD.dtype) if cfg.pos == "rope" else None
        ctx = AttnContext(T=7, S=7, device=h_BTD.device, causal=True, rope=rope)
        for layer in model.blocks:
            torch.testing.assert_close(layer(h_BTD, None), layer(h_BTD, ctx), rtol=1e-12, atol=1e-12)
        if rope is not None:  # (the check above is not vacuous: the same block without RoPE differs)
            plain = AttnContext(T=7, S=7, device=h_BTD.device, causal=True)
            assert not torch.allclose(model.blocks[0](h_BTD, None), model.blocks[0](h_BTD, plain))


def test_init_follows_paper():
    """docs/paper.md: every Linear and Embedding weight (positions, GBA's gate included) is drawn from
    N(0, 0.02), mean and spread, with zero biases; the output embedding is the token embedding."""
    model = GPT(preset_config("paper-small", "boosted"))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert {"wte", "wpe", "blocks.0.attn.qkv", "blocks.0.attn.corrections.0.gate.proj", "blocks.1.mlp.fc"} <= \
        set(layers)
    for name, layer in layers.items():  # (each holds 65,536 weights or more: the mean's error is under 1e-4)
        assert layer.weight.std().item() == pytest.approx(0.02, abs=0.001), name
        assert abs(layer.weight.mean().item()) < 0.001, name
        assert getattr(layer, "bias", None) is None or layer.bias.abs().max() == 0, name
    assert model.lm_head.weight is model.wte.weight


BLOCK_EQUATION_CASES = {
    "pre-layernorm-gelu-learned": dict(norm="pre", ffn="gelu"),
    "post-layernorm-gelu-tanh-learned": dict(norm="post", ffn="gelu-tanh"),
    "pre-rmsnorm-swiglu-rope-untied": dict(norm_type="rmsnorm", ffn="swiglu", bias=False, pos="rope",
                                           tie_embeddings=False),
    "post-rmsnorm-swiglu-rope": dict(norm="post", norm_type="rmsnorm", ffn="swiglu", pos="rope"),
    # a RoPE base and a norm eps other than the defaults (10,000 and 1e-5: what a model ignoring them uses)
    "pre-layernorm-rope500-gqa-eps0.01": dict(pos="rope", rope_base=500.0, n_kv_heads=2, norm_eps=1e-2),
}


@pytest.mark.parametrize("kw", BLOCK_EQUATION_CASES.values(), ids=BLOCK_EQUATION_CASES)
def test_model_equals_its_equations_written_out(kw):
    """The whole model against its equations (the module docstrings, docs/baselines.md), written
    out here from the weights, with the attention module as the one black box (it has its own
    references): embeddings, Pre-LN ``h + attn(ln1 h)``, ``h + ffn(ln2 h)`` or Post-LN
    ``ln1(h + attn h)``, ``ln2(h + ffn h)``, GELU / GELU-tanh / SwiGLU, LayerNorm / RMSNorm, the
    final norm (Pre-LN only) and the head."""
    cfg = tiny_config(("boosted", {}), **kw)
    model = tiny_model(("boosted", {}), **kw)
    with torch.no_grad():  # norm gains and biases that differ from layer to layer
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3) if p.dim() == 1 else None
    idx = torch.randint(0, cfg.vocab_size, (2, 9))
    eps = cfg.norm_eps

    def norm(x, module):
        w = module.weight
        if cfg.norm_type == "rmsnorm":
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
        mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
        b = module.bias if module.bias is not None else 0.0
        return (x - mu) / torch.sqrt(var + eps) * w + b

    def linear(x, layer):
        return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0.0)

    def ffn(x, mlp):
        h = linear(x, mlp.fc)
        if cfg.ffn == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = gate * torch.sigmoid(gate) * up
        elif cfg.ffn == "gelu-tanh":
            h = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
        else:
            h = 0.5 * h * (1 + torch.erf(h / 2**0.5))
        return linear(h, mlp.proj)

    rope = rope_for(torch.arange(9), cfg.d_head, cfg.rope_base, torch.float64) if cfg.pos == "rope" else None

    def attn(x, block):
        return block.attn(x, context=AttnContext(T=9, S=9, device=x.device, rope=rope))

    h = model.wte.weight[idx]
    if cfg.pos == "learned":
        h = h + model.wpe.weight[:9]
    for block in model.blocks:
        if cfg.norm == "pre":
            h = h + attn(norm(h, block.ln1), block)
            h = h + ffn(norm(h, block.ln2), block.mlp)
        else:
            h = norm(h + attn(h, block), block.ln1)
            h = norm(h + ffn(h, block.mlp), block.ln2)
    if cfg.norm == "pre":
        h = norm(h, model.ln_f)
    head = model.wte.weight if cfg.tie_embeddings else model.lm_head.weight
    assert (model.lm_head.weight is model.wte.weight) == cfg.tie_embeddings
    torch.testing.assert_close(model(idx), h @ head.T, rtol=1e-10, atol=1e-10)


# ---- clear errors -----------------------------------------------------------------------


def test_sequence_longer_than_position_table():
    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=8, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="exceeds block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(attn="nope"), r"attn='nope' is not allowed; choose one of standard, boosted"),
        (dict(attn="boosted", attn_options={"rounds": 0}), r"attn.rounds=0 must be an integer in \[1, 1024\]"),
        (
            dict(attn="boosted", attn_options={"gate": "relu"}),
            r"attn.gate='relu' is not allowed; choose one of linear, mlp",
        ),
        (
            dict(attn="boosted", attn_options={"kv_source": "x"}),
            r"attn.kv_source='x' is not allowed; choose one of residual",
        ),
        (dict(attn="boosted", attn_options={"round": 2}),
         r"has no option\(s\) \['round'\] \(did you mean 'rounds'\?\); its options are: rounds"),
        (dict(d_model=30, n_heads=4), r"d_model=30 is not divisible by n_heads=4"),
        (dict(attn="differential", n_heads=3, d_model=30), r"n_heads \(3\) and n_kv_heads \(3\) must be even"),
        (dict(n_kv_heads=3), r"n_kv_heads=3 must divide n_heads=4"),
        (dict(d_model=128.5), r"d_model=128.5 must be an integer"),
        (dict(dropout_sites=["embedding", "somewhere"]), r"dropout_sites entry='somewhere' is not allowed"),
        (dict(ffn="relu"), r"ffn='relu' is not allowed; choose one of gelu, gelu-tanh, swiglu"),
        (dict(norm="middle"), r"norm='middle' is not allowed; choose one of pre, post"),
        (dict(n_layers=2, attn="boosted", attn_options={"layers": [5]}), r"layers=\[5\]: \[5\] outside the model's 2"),
        (dict(n_layers=2, attn="twicing", attn_options={"layers": [0, -3]}), r"\[-3\] outside the model's 2 layers"),
        (dict(d_model=257), r"d_model=257 is not divisible by n_heads=4; choose d_model as a multiple of 4"),
        (dict(n_kv_heads=0), r"n_kv_heads=0 must be an integer >= 1"),
        (dict(ffn_hidden=0), r"ffn_hidden=0 must be an integer in \[1, 16777216\]"),
        (dict(ffn_mult=0), r"ffn_mult=0 must be an integer in \[1, 1024\]"),
        (dict(norm_eps=0), r"norm_eps=0.0 must be > 0"),
        # past float32's range: inf (a model trained to a uniform output, silently), or rounded to 0
        (dict(norm_eps=1e39), r"norm_eps=1e\+39 must be > 0 and within float32's range \(1.4e-45 to 3.4e\+38\)"),
        (dict(norm_eps=1e-50), r"norm_eps=1e-50 must be > 0 and within float32's range"),
        (dict(dropout=1), r"dropout=1.0 must be in \[0, 1\)"),
        (dict(pos="rope", d_model=12, n_heads=4), r"pos='rope' needs an even head width; d_model/n_heads = 3"),
        (dict(norm="post", residual="attnres-block"), r"residual='attnres-block' is defined for norm='pre' only"),
        # A RoPE base given to a model with learned positions was ignored, silently.
        (dict(rope_base=500.0), r"rope_base=500.0 is used by pos='rope' only; this model has pos='learned'"),
        # ffn_mult beside an explicit hidden width was ignored, silently.
        (dict(ffn_hidden=64, ffn_mult=2), r"ffn_mult=2 and ffn_hidden=64 both set the FFN's width, and ffn_hidden "
                                          r"wins: give one of them"),
        # A block size given to a model without block AttnRes was ignored, silently (attnres-full is blocks of one).
        (dict(attnres_block=3), r"attnres_block=3 is used by residual='attnres-block' only; this model has "
                                r"residual='plain'"),
        (dict(residual="attnres-full", attnres_block=3), r"this model has residual='attnres-full': set residual="),
        (dict(attn_options="rounds=3"), r"attn_options='rounds=3' must be a mapping"),
        (dict(dropout_sites=5), r"dropout_sites=5 must be a list of strings"),
        (dict(dropout_sites="embedding,1"), r"dropout_sites entry='1' is not allowed; choose one of embedding, "),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**kwargs)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(split=[1.0, 0.0, 0.0]), r"split=\[1.0, 0.0, 0.0\] must be three fractions .* train and valid > 0"),
        (dict(split=[0.0, 0.5, 0.5]), r"train and valid > 0"),
        (dict(split=[0.9, 0.1]), r"three fractions"),
        (dict(batch_size=32, grad_accum=3), r"batch_size=32 is not divisible by grad_accum=3"),
        (dict(lr=1e-3, min_lr=2e-3), r"min_lr=0.002 is above lr=0.001"),
        (dict(sampling="random"), r"sampling='random' has no epochs: set max_steps"),
        (dict(split=[0.5, 0.3, 0.1, 0.1]), r"split=\[0.5, 0.3, 0.1, 0.1\] must be three fractions"),
        (dict(split=[0.9, 0.05, 0.049]), r"summing to 1"),
        (dict(split=[0.9, 0.2, -0.1]), r"split=\[0.9, 0.2, -0.1\] must be three fractions"),
        (dict(split=5), r"split=5 must be a list of numbers"),
        (dict(split=[0.5, "x", 0.5]), r"split\[1\]='x' must be a number"),
        (dict(beta2=1), r"beta2=1.0 must be in \[0, 1\)"),
        (dict(min_lr=-1e-4), r"min_lr=-0.0001 must be >= 0"),
        (dict(weight_decay=float("nan")), r"weight_decay=nan must be a finite number"),
        (dict(seed=2**63), r"seed=9223372036854775808 is out of range \(at most 2\*\*63 - 1\)"),
        # AdamW's first step, lr / (1 - beta1), past float32 (a RuntimeError mid-run, at every resume)
        (dict(lr=4e37), r"lr=4e\+37 is too large: AdamW's first step of lr / \(1 - beta1\) = 4e\+38 is past float32"),
        (dict(lr=1e36, beta1=0.999), r"lr=1e\+36 is too large"),
    ],
)
def test_training_config_errors_name_the_field(kwargs, match):
    from gbattn.config import TrainConfig

    with pytest.raises(ConfigError, match=match):
        TrainConfig(**kwargs)
    TrainConfig(split=[0.9, 0.1, 0.0], batch_size=12, grad_accum=4, lr=1e-3, min_lr=1e-3)  # the edges are fine
    edges = TrainConfig(warmup_steps=0, weight_decay=0, grad_clip=0, seed=0, beta1=0)
    assert (edges.warmup_steps, edges.weight_decay, edges.grad_clip, edges.seed) == (0, 0.0, 0.0, 0)
    assert TrainConfig(seed=2**63 - 1).seed == 2**63 - 1
    assert TrainConfig(lr=3e37).lr == 3e37  # (its first step, 3e38, fits)


def test_overrides_leave_the_presets_as_they_were():
    """A preset is a template: one config's overrides never reach the next config built from it."""
    from gbattn.config import build_configs

    model, train = build_configs("cpu-char", "boosted", "somewhere", {"d_model": 64, "lr": 5e-4, "dropout": 0.2,
                                                                    "attn.rounds": 3})
    assert (model.d_model, model.dropout, model.attn_options, train.lr) == (64, 0.2, {"rounds": 3}, 5e-4)
    model, train = build_configs("cpu-char", "standard", "elsewhere", {})
    assert (model.d_model, model.dropout, model.attn, train.lr, train.data) == (128, 0.0, "standard", 1e-3,
                                                                                 "elsewhere")
    assert preset_config("cpu-char", "boosted") == preset_config("cpu-char", "boosted", {})
    assert PRESETS["cpu-char"].model["d_model"] == 128 and "data" not in PRESETS["cpu-char"].train


def test_overrides_leave_the_callers_dicts_as_they_were():
    """preset_config(..., {"attn_options": opts, "attn.gate": "mlp"}) wrote gate="mlp" into the caller's opts (the
    next config built from them got it too), and --set attn.x into a preset holding attn_options would have
    written into the preset."""
    from gbattn.config import set_path

    opts = {"rounds": 3}
    cfg = preset_config("cpu-char", "boosted", {"attn_options": opts, "attn.gate": "mlp"})
    assert cfg.attn_options == {"rounds": 3, "gate": "mlp"} and opts == {"rounds": 3}
    template = {"attn_options": {"rounds": 2}}
    built = dict(template)
    set_path(built, "attn.kv_source", "shared")
    assert built["attn_options"] == {"rounds": 2, "kv_source": "shared"} and template == {"attn_options": {"rounds": 2}}


def test_cpu_char_keeps_biases_that_nanogpt_leaves_out():
    """docs/deviations.md, entry 7 and README's cpu-char caption: 809,856 parameters with GPT-2's biases, nanoGPT's
    bias-free default 804,096 (`--set bias=false`)."""
    from gbattn.config import build_configs

    counts = {bias: count_params(build_configs("cpu-char", "standard", "tiny-shakespeare", {"bias": bias})[0])
              for bias in (True, False)}
    assert counts == {True: 809_856, False: 804_096}
    assert build_configs("cpu-char", "standard", "tiny-shakespeare", {})[0].bias


def test_overrides_that_are_no_dict_are_refused_naming_the_argument():
    """preset_config(..., [("d_model", 64)]) and build_configs(..., sets=[...]) were "'list' object has no attribute
    'items'" from inside config.py; each is one ConfigError naming the argument."""
    from gbattn.config import build_configs

    with pytest.raises(ConfigError, match=r"overrides of type list: give a dict of field names and values"):
        preset_config("cpu-char", "boosted", [("d_model", 64)])
    with pytest.raises(ConfigError, match=r"sets of type list: give a dict of field names and values"):
        build_configs("cpu-char", "boosted", "tiny-shakespeare", [("d_model", 64)])
    # a key that is no field name ("'int' object has no attribute 'split'")
    with pytest.raises(ConfigError, match=r"^overrides: key 1 of type int: give field names as strings$"):
        preset_config("cpu-char", "boosted", {1: 2})
    # None: no overrides, as for preset_config
    assert build_configs("cpu-char", "boosted", "tiny-shakespeare", None) == build_configs("cpu-char", "boosted",
                                                                                           "tiny-shakespeare", {})
    assert preset_config("cpu-char", "boosted", None) == preset_config("cpu-char", "boosted")  # None: no overrides


def test_a_near_miss_is_a_close_name_or_two_neighbouring_letters_swapped_only():
    """Two letters swapped far apart ('ttse' for 'test') are no typo the hint names; neighbours ('tset') are."""
    from gbattn.checks import near_miss

    assert near_miss("tset", ["valid", "test"]) == "test" and near_miss("ttse", ["valid", "test"]) is None


def test_two_misspellings_of_one_name_suggest_it_once():
    """Two unknown names close to one field: the hint names it once (not "did you mean 'd_model' or 'd_model'?")."""
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_dict({"d_modle": 64, "d_mdoel": 64})
    assert str(error.value).count("'d_model'") == 1 and "did you mean 'd_model'?" in str(error.value)


def test_an_integer_out_of_range_is_named_as_it_was_given():
    """A float out of an integer field's range was shown converted: --set seed=1e30 said
    "seed=1000000000000000019884624838656 is out of range", a config.json's 1e308 a 309-digit number."""
    from gbattn.checks import coerce

    for value, shown in ((1e30, "seed=1e+30"), (-1e308, "seed=-1e+308"), (2**70, "seed=1180591620717411303424")):
        with pytest.raises(ConfigError) as error:
            coerce("seed", value, int)
        assert str(error.value) == f"{shown} is out of range (at most 2**63 - 1)"


def test_a_name_that_is_no_string_is_a_config_error_with_no_guess():
    """check_choice's near-miss hint iterated a value that was no string: preset_config(None), get_recipe(3) and an
    attention module of variant None were Python's "'NoneType' object is not iterable" (before the hint, the
    ConfigError naming the choices), and a list ['pre'] was answered "did you mean 'pre'?"."""
    from gbattn.attention import AttnArgs, build_attention
    from gbattn.checks import check_choice
    from gbattn.experiments.recipes import get_recipe

    for call, shown in ((lambda: preset_config(None), "preset=None"), (lambda: get_recipe(3), "recipe=3"),
                        (lambda: build_attention(None, AttnArgs(d_model=8, n_heads=2)), "attn=None"),
                        (lambda: check_choice("norm", ["pre"], ("pre", "post")), "norm=['pre']")):
        with pytest.raises(ConfigError) as error:
            call()
        assert str(error.value).startswith(f"{shown} is not allowed; choose one of "), error.value


def test_flops_per_token_at_a_shorter_sequence():
    """At T tokens the attention scores cost 4 T d per layer (QK^T and AV), the matmuls of the
    weights the same per token: a shorter sequence counts fewer FLOPs per token."""
    cfg = preset_config("paper-small", "standard")
    d, layers, vocab = 256, 4, 16_384
    for T in (64, 256):
        assert flops_per_token(cfg, seq_len=T) == 2 * (layers * 12 * d * d + vocab * d) + layers * 4 * T * d


def test_flops_per_token_refuses_a_sequence_length_below_one():
    """seq_len=0 gave block_size's figure (0 read as "not given"), -1 a torch error about a negative dimension.
    A numpy integer is taken as a config field takes it (np.int64(64) was "must be an integer >= 1")."""

    cfg = preset_config("cpu-char", "standard")
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"seq_len={bad!r} must be an integer >= 1"):
            flops_per_token(cfg, seq_len=bad)
    for bad in (2.5, True):
        with pytest.raises(ValueError, match=f"seq_len={bad!r} must be an integer"):
            flops_per_token(cfg, seq_len=bad)
    assert flops_per_token(cfg, seq_len=None) == flops_per_token(cfg, seq_len=cfg.block_size)
    assert flops_per_token(cfg, seq_len=np.int64(32)) == flops_per_token(cfg, seq_len=32)
    # one token is the shortest sequence there is, and is counted (d 128, 4 layers, vocab 65, T 1)
    assert flops_per_token(cfg, seq_len=1) == 2 * (4 * 12 * 128 * 128 + 65 * 128) + 4 * 4 * 1 * 128


def test_a_recomputing_training_step_counts_its_blocks_forward_again():
    """Activation checkpointing runs each block's forward again in the backward pass (not the LM head's): bench gave
    a recomputing row the kept step's FLOPs, so its FLOP ratio left out GBA's larger share of its FLOPs in the
    blocks. As torch recomputes: it stops once it has what the backward pass keeps, so a block's last product (the
    FFN's output projection, whose output nothing keeps) is not run again."""
    d, vocab, layers = 128, 4096, 4
    for attn in ("standard", "boosted"):
        cfg = preset_config("cpu-proxy", attn)
        assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.ffn_mult) == (vocab, d, layers, 4)
        blocks = flops_per_token(cfg) - 2 * d * vocab  # the forward pass but the LM head's
        last_products = layers * 2 * (4 * d) * d
        assert flops_per_token(cfg, backward=True, recomputed=True) - flops_per_token(cfg, backward=True) == (
            blocks - last_products), attn
    attnres = preset_config("cpu-proxy", "boosted", {"residual": "attnres-block"})  # its branches recomputed
    assert flops_per_token(attnres, backward=True, recomputed=True) > flops_per_token(attnres, backward=True)
    with pytest.raises(ValueError, match="give backward=True too"):
        flops_per_token(cfg, recomputed=True)


def test_flops_per_token_takes_backward_true_or_false_only():
    """backward="no" (or None) read as a truth value: "no" gave the forward + backward figure."""
    cfg = preset_config("cpu-char", "standard")
    for bad in ("no", None, 1):
        with pytest.raises(ValueError, match=rf"^backward={bad!r} must be True or False$"):
            flops_per_token(cfg, seq_len=8, backward=bad)
    assert flops_per_token(cfg, seq_len=8, backward=True) > flops_per_token(cfg, seq_len=8, backward=False)


def test_param_matched_width_of_an_exact_match_is_that_width():
    """``at least`` the target: a width whose count equals it exactly is the answer, not the next one."""
    cfg = preset_config("cpu-char", "standard")
    target = count_params(cfg.replace(d_model=96))
    assert param_matched_width(cfg, target) == (96, target)
    assert param_matched_width(cfg, target + 1)[0] == 100


def test_param_matched_width_stops_at_the_widest_model_a_config_takes():
    """Doubling to bracket the answer went past d_model's limit, 2**20, and was refused as a width nobody asked for
    (d_model=1200000), though a width below the limit matched: it is found now, and a count no width up to the limit
    reaches is said so."""
    from gbattn.config import MAX_D_MODEL

    cfg = preset_config("cpu-char", "boosted", {"d_model": 600_000, "n_layers": 1, "n_heads": 1})
    width, n = param_matched_width(cfg, count_params(cfg))
    assert width < MAX_D_MODEL and n >= count_params(cfg) > count_params(cfg.replace(attn="standard",
                                                                                    attn_options={}, d_model=width - 1))
    widest = count_params(cfg.replace(attn="standard", attn_options={}, d_model=MAX_D_MODEL))
    assert param_matched_width(cfg, widest) == (MAX_D_MODEL, widest)
    with pytest.raises(ConfigError, match=f"^no standard model up to d_model={MAX_D_MODEL:,} has {widest + 1:,} "
                                          f"parameters, so none matches them$"):
        param_matched_width(cfg, widest + 1)


def test_param_matched_width_below_the_models_own_width():
    """A target far below the model's count: the search starts at one step, not near the model's width
    (cpu-char, 4 heads, d 128: the width whose count is the target is 32)."""
    cfg = preset_config("cpu-char", "standard")
    target = count_params(cfg.replace(d_model=32))
    assert param_matched_width(cfg, target) == (32, target)
    assert param_matched_width(cfg, 1) == (4, count_params(cfg.replace(d_model=4)))


def test_param_matched_width_refuses_a_target_that_is_no_parameter_count():
    """NaN gave the model's own width (every comparison with it is false), 0 or a negative count the narrowest
    width, a string Python's "'<' not supported"; an integral float or a numpy integer is a count."""

    cfg = preset_config("cpu-char", "standard")
    for bad in (float("nan"), float("inf"), 0, -5, "1000", 1e5 + 0.5, True):
        with pytest.raises(ConfigError, match=rf"target_params={bad!r} must be an integer >= 1 \(a parameter count"):
            param_matched_width(cfg, bad)
    target = count_params(cfg.replace(d_model=96))
    assert param_matched_width(cfg, float(target)) == param_matched_width(cfg, np.int64(target)) == (96, target)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset='huge' is not allowed; choose one of paper-small"):
        preset_config("huge")


def test_chunked_loss_equals_full_cross_entropy():
    model = tiny_model(("boosted", {}))
    idx = torch.randint(0, 37, (3, 10))
    targets = torch.randint(0, 37, (3, 10))
    targets[0, :4] = -100
    full = lm_loss(model(idx), targets)
    for chunk in (1, 7, 30, None):
        torch.testing.assert_close(model(idx, targets, loss_chunk=chunk), full, rtol=1e-10, atol=1e-10)
    # a negative chunk was a loss of 0 (no chunk at all, silently); 0 was range()'s "arg 3 must not be zero"
    for chunk in (-5, 0, 2.5, True):
        with pytest.raises(ValueError, match=rf"loss_chunk={chunk!r} must be an integer >= 1"):
            model(idx, targets, loss_chunk=chunk)
    torch.testing.assert_close(model(idx, targets, loss_chunk=np.int64(7)), full, rtol=1e-10, atol=1e-10)


def test_low_precision_logits_get_a_float32_loss():
    """bf16/fp16 logits (autocast) are upcast before the cross-entropy: the loss is float32 and equals
    the loss of the same logits in float32, not a bf16-rounded one."""
    logits = torch.randn(2, 7, 37, generator=torch.Generator().manual_seed(0)) * 4
    targets = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        for reduction in ("mean", "sum", "none"):
            loss = lm_loss(low, targets, reduction=reduction)
            assert loss.dtype == torch.float32 and loss.shape == (() if reduction != "none" else (2, 7))
            torch.testing.assert_close(loss, lm_loss(low.float(), targets, reduction=reduction), rtol=0, atol=0)


def test_a_loss_with_every_target_ignored_is_zero_not_nan():
    """A batch whose targets are all -100 (nothing to predict) has loss 0, for any chunking, not 0/0."""
    model = tiny_model(("standard", {}))
    idx = torch.randint(0, 37, (2, 6))
    for chunk in (None, 5):
        assert model(idx, torch.full_like(idx, -100), loss_chunk=chunk).item() == 0.0


def test_dropout_only_at_the_sites_named():
    """dropout=0.5 with no sites drops nothing (training mode gives the eval logits); at any one site alone
    it does, with the configured probability."""
    idx = torch.randint(0, 37, (2, 8))
    for sites, drops in [([], False)] + [([site], True) for site in DROPOUT_SITES]:
        model = tiny_model(("standard", {}), dropout=0.5, dropout_sites=sites)
        expected = model(idx)
        torch.manual_seed(0)
        assert (not torch.equal(model.train()(idx), expected)) == drops, sites
        assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} <= {0.5}, sites


def test_biases_off_means_no_bias_anywhere():
    """bias=False takes the bias out of every Linear and every LayerNorm (gpt2-style norm, not only Llama's
    RMSNorm); bias=True keeps them."""
    for norm in ("pre", "post"):
        model = GPT(tiny_config(("standard", {}), bias=False, norm=norm))
        assert [n for n, _ in model.named_parameters() if n.endswith("bias")] == [], norm
    with_bias = GPT(tiny_config(("standard", {})))
    assert {"ln_f.bias", "blocks.0.ln1.bias", "blocks.0.mlp.fc.bias"} <= {n for n, _ in with_bias.named_parameters()}


def test_biases_off_in_every_variant(variant_case):
    """bias=False holds in every variant's projections (gated attention's fused QKV and gate projection
    included); only GBA's gate keeps its b_g (README)."""
    names = [n for n, _ in GPT(tiny_config(variant_case, bias=False)).named_parameters() if n.endswith("bias")]
    assert [n for n in names if ".gate." not in n] == []
    assert all(".corrections." in n for n in names)


def test_a_static_cache_written_under_inference_mode_or_with_autograd_decodes_on_and_deep_copies():
    """StaticCache's buffers were made at their first write: a prefill under torch.inference_mode made inference
    tensors, and the next decode under torch.no_grad was torch's "Inplace update to inference tensor outside
    InferenceMode", for good. A prefill with autograd on left buffers holding a graph, and copy.deepcopy(model) was
    "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol". Both decode on as the
    full forward does; the copy holds the keys and values without their graph."""
    import copy

    model = tiny_model(("boosted", {"rounds": 2})).eval()
    idx = torch.randint(0, 37, (1, 6))
    full = model(idx)
    model.setup_cache(1)
    with torch.inference_mode():
        model(idx[:, :5], input_pos=torch.arange(5))
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, 5:], input_pos=torch.tensor([5]))[:, 0], full[:, -1])
    model.setup_cache(1)
    model(idx[:, :5], input_pos=torch.arange(5))
    assert model.kv_cache.layers[0].kv0_k.grad_fn is not None  # (what the copy is about)
    copied = copy.deepcopy(model)
    assert all(t.grad_fn is None for t in copied.kv_cache.layers[0].buffers())
    for decoding in (model, copied):
        torch.testing.assert_close(decoding(idx[:, 5:], input_pos=torch.tensor([5]))[:, 0], full[:, -1])


def test_a_model_on_meta_computes_shapes_with_positions_and_a_cache():
    """A model on the meta device computes shapes only (counting a decode step's FLOPs): with position_ids or a set
    up cache it was "Cannot copy out of meta tensor" (the host-side position checks) and "unknown device type for
    autocast" (the cache's dtype check)."""
    with torch.device("meta"):
        model = GPT(tiny_model(("boosted", {"rounds": 2})).cfg)
        idx = torch.zeros(2, 5, dtype=torch.long)
        assert model(idx, position_ids=torch.arange(5)).shape == (2, 5, 37)
        model.setup_cache(2)
        assert model(idx, input_pos=torch.arange(5)).shape == (2, 5, 37)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_a_cache_slot_past_the_block_is_a_clear_error(block):
    """input_pos reaching block_size (24 here) is refused with the block_size message, with or
    without a cache, for learned positions and for RoPE (which has no table to overflow)."""
    model = tiny_model(("standard", {}), **BLOCKS[block])
    idx = torch.randint(0, 37, (1, 1))
    model(idx, input_pos=torch.tensor([23]))  # the last position is fine
    with pytest.raises(ValueError, match="exceeds block_size=24"):
        model(idx, input_pos=torch.tensor([24]))
    model.setup_cache(1)
    assert model.kv_cache.max_len == 24  # the default cache holds the whole block: its last slot too
    model(idx, input_pos=torch.tensor([23]))
    with pytest.raises(ValueError, match="exceeds block_size=24"):
        model(idx, input_pos=torch.tensor([24]))
    model.clear_cache()


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_input_pos_without_a_cache_gives_positions_and_stays_causal(block):
    """Without a cache, ``input_pos`` (here 3..9 for 7 tokens) gives the tokens' positions only: the output is
    that of ``position_ids`` at those positions, causal, not a mask of key slots against query slots 3..9 (which
    would let every token see up to 3 later ones)."""
    model = tiny_model(("standard", {}), **BLOCKS[block])
    idx = torch.randint(0, 37, (2, 7))
    positions = torch.arange(3, 10)
    logits = model(idx, input_pos=positions)
    torch.testing.assert_close(logits, model(idx, position_ids=positions.expand(2, -1)), rtol=0, atol=0)
    changed = idx.clone()
    changed[:, -1] = (idx[:, -1] + 1) % 37
    torch.testing.assert_close(model(changed, input_pos=positions)[:, :-1], logits[:, :-1], rtol=0, atol=0)


def test_a_cache_slot_past_setup_caches_max_len_is_a_clear_error():
    """A cache shorter than the block (setup_cache(1, max_len=8) of a 24-token model) refuses slot 8
    and a negative slot in one line naming its max_len (it was index_copy_'s IndexError)."""
    model = tiny_model(("boosted", {"rounds": 2}))
    idx = torch.randint(0, 37, (1, 1))
    model.setup_cache(1, max_len=8)
    model(idx, input_pos=torch.tensor([7]))  # the last slot is fine
    outside = r"outside the KV cache's slots 0 \.\. 7 \(setup_cache\(\.\.\., max_len=8\)\)"
    for slot in (8, -1):
        with pytest.raises(ValueError, match=outside):
            model(idx, input_pos=torch.tensor([slot]))
        # with position_ids (a left-padded row's positions lag its slots) the slots are checked, not the positions
        with pytest.raises(ValueError, match=outside):
            model(idx, input_pos=torch.tensor([slot]), position_ids=torch.tensor([[3]]))
    model.clear_cache()


def test_setup_cache_and_input_pos_of_the_wrong_kind_are_clear_errors():
    """setup_cache(batch=0 or -1) and max_len=-3 were accepted and max_len=0 silently became
    block_size; an input_pos of another length or with a batch axis reached torch's size error or
    index_copy_'s, after a cache of the right size was set up."""
    model = tiny_model(("boosted", {"rounds": 2}))
    for kwargs in ({"batch": 0}, {"batch": -1}, {"batch": 2, "max_len": 0}, {"batch": 2, "max_len": -3},
                   {"batch": 2.0}, {"batch": True}, {"batch": 2, "max_len": True}, {"batch": None}):
        name, value = list(kwargs.items())[-1]
        with pytest.raises(ValueError, match=rf"setup_cache\({name}={value!r}\): {name} must be an integer >= 1"):
            model.setup_cache(**kwargs)
        assert not model.has_cache
    model.setup_cache(np.int64(2), max_len=np.int64(8))  # numpy's integers are integers (they were refused as none)
    assert type(model.kv_cache.max_len) is int and model.kv_cache.max_len == 8
    model.clear_cache()
    idx = torch.randint(0, 37, (2, 5))
    model.setup_cache(2)
    for bad in (torch.arange(4), torch.arange(5)[None].expand(2, 5)):
        with pytest.raises(ValueError, match=rf"input_pos of shape \({', '.join(map(str, bad.shape))},?\) for 5 "
                                             r"tokens: expected \(5,\), one cache slot per token"):
            model(idx, input_pos=bad)
    model.clear_cache()


def test_a_cache_of_another_dtype_or_device_than_the_model_is_a_clear_error():
    """setup_cache(dtype=torch.bfloat16) on a float model (or device="meta") was accepted, and the next forward
    was SDPA's "Expected query, key, and value to have the same dtype" (index_copy's device error); a string or an
    integer dtype was torch.empty's TypeError or the same dtype error. Under autocast another dtype decodes."""
    model = tiny_model(("boosted", {"rounds": 2}))  # float64
    idx = torch.randint(0, 37, (2, 5))
    for dtype in ("float16", torch.int64):
        with pytest.raises(ValueError, match=rf"setup_cache\(dtype={dtype!r}\): dtype must be a floating-point "
                                             r"torch\.dtype"):
            model.setup_cache(2, dtype=dtype)
    model.setup_cache(2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"a KV cache of dtype torch\.float32 for a model computing in "
                                         r"torch\.float64: call setup_cache without dtype="):
        model(idx, input_pos=torch.arange(5))
    model.setup_cache(2, device="meta")
    with pytest.raises(ValueError, match=r"a KV cache on meta for a model computing on cpu: call setup_cache "
                                         r"without device="):
        model(idx, input_pos=torch.arange(5))
    model.float().setup_cache(2, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(idx, input_pos=torch.arange(5))).all()
    # but not float64, which autocast leaves as it is (its keys met bfloat16 queries: SDPA's dtype error)
    model.setup_cache(2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            ValueError, match=r"^a KV cache of dtype torch\.float64 under autocast for a model computing in "
                              r"torch\.float32: autocast leaves float64 as it is"):
        model(idx, input_pos=torch.arange(5))
    model.clear_cache()


def test_int32_cache_slots_are_taken_as_int32_positions_are():
    """input_pos in int32 passes the model's integer check (as token ids and position_ids in int32 do) and was
    index_copy_'s "Expected a long tensor for index": the cache takes it, with the int64 slots' logits."""
    model = tiny_model(("boosted", {"rounds": 2})).eval()
    idx = torch.randint(0, 37, (2, 6))
    expected = []
    for dtype in (torch.int64, torch.int32):
        model.setup_cache(2)
        first = model(idx[:, :5], input_pos=torch.arange(5, dtype=dtype))
        expected.append(torch.cat([first, model(idx[:, 5:], input_pos=torch.tensor([5], dtype=dtype))], dim=1))
    model.clear_cache()
    torch.testing.assert_close(expected[1], expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("variant_case", [("boosted", {"rounds": 2}), ("twicing", {})], ids=["boosted", "twicing"])
def test_a_cache_in_the_models_dtype_takes_autocasts_keys_and_values(variant_case):
    """A float32 model with its default (float32) cache decodes under bfloat16 autocast: the bfloat16 keys and
    values (and Twicing's value-only A V) are stored in the cache's dtype, and a cached step gives the uncached
    forward's last logits (to bfloat16's precision)."""
    model = tiny_model(variant_case).float()
    idx = torch.randint(0, 37, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(idx)[:, -1].float()
        model.setup_cache(2)
        model(idx[:, :5], input_pos=torch.arange(5))
        last = model(idx[:, 5:], input_pos=torch.tensor([5]))[:, -1].float()
    model.clear_cache()
    torch.testing.assert_close(last, full, rtol=0, atol=0.05)


def test_targets_of_another_shape_than_the_tokens_are_refused():
    """Targets transposed (T, B) or flattened (B*T,) hold as many entries as the tokens and gave a
    loss against the wrong targets, silently; off by one ((B, T+1)) was cross_entropy's "Expected
    input batch_size (16) to match target batch_size (18)"."""
    model = tiny_model(("boosted", {"rounds": 2}))
    idx = torch.randint(0, 37, (2, 9))
    for targets in (idx[:, 1:].T, idx[:, 1:].flatten(), idx):
        shape = ", ".join(map(str, targets.shape))
        with pytest.raises(ValueError, match=rf"targets of shape \({shape},?\) for token ids of shape \(2, 8\): "
                                             r"give one target per token \(model\(idx\[:, :-1\], idx\[:, 1:\]\)\)"):
            model(idx[:, :-1], targets)
    assert torch.isfinite(model(idx[:, :-1], idx[:, 1:]))


def test_token_ids_outside_the_vocabulary_are_named():
    """A token id >= vocab_size or negative (a tokenizer larger than the model) was the embedding's
    "IndexError: index out of range in self"."""
    model = tiny_model(("standard", {}))  # vocab_size 37
    idx = torch.randint(0, 37, (2, 5))
    for bad, first in ((37, 37), (-1, -1)):
        wrong = idx.clone()
        wrong[1, 2] = bad
        with pytest.raises(ValueError, match=rf"token id {first} outside the vocabulary: ids are 0 \.\. 36 "
                                             r"\(vocab_size=37\)"):
            model(wrong)
    model(idx)
    model.wte = torch.nn.Embedding(40, model.cfg.d_model, dtype=torch.float64)  # replaced, as a resize does
    wrong[1, 2] = 39
    assert model(wrong).shape == (2, 5, 37)


def test_targets_of_another_dtype_or_outside_the_vocabulary_are_named():
    """int32 targets beside the int32 token ids a model takes were cross_entropy's "expected target dtype to be
    Long or Byte, but got Int" (float ones the same), and a target past the vocabulary its "Target 37 is out of
    bounds"; -100 stays the ignored target, and int32 ids with their int32 targets give the long ones' loss."""
    model = tiny_model(("standard", {}))  # vocab_size 37
    idx = torch.randint(0, 37, (2, 6))
    loss = model(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(model(idx[:, :-1].int(), idx[:, 1:].int()), loss, rtol=0, atol=0)
    for bad in (idx.float(), idx.bool()):
        with pytest.raises(ValueError, match=rf"targets of dtype {bad.dtype}: expected integers \(torch\.long\)"):
            model(idx[:, :-1], bad[:, 1:])
    for bad in (37, -5, -1):
        wrong = idx[:, 1:].clone()
        wrong[1, 3] = bad
        with pytest.raises(ValueError, match=rf"target {bad} outside the vocabulary: targets are 0 \.\. 36 "
                                             r"\(vocab_size=37\), or -100 for a position left out of the loss"):
            model(idx[:, :-1], wrong)
    ignored = idx[:, 1:].clone()
    ignored[:, :2] = -100
    assert torch.isfinite(model(idx[:, :-1], ignored))
    # lm_loss, the loss of evaluation and of the Hugging Face wrapper's labels too, took float targets as long
    # (1.7 read as 1, silently) once it took int32 ones
    logits = model(idx[:, :-1])
    torch.testing.assert_close(lm_loss(logits, idx[:, 1:].int()), lm_loss(logits, idx[:, 1:]), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"targets of dtype torch.float32: expected integers \(torch\.long\)"):
        lm_loss(logits, idx[:, 1:].float() + 0.7)


def test_targets_are_checked_against_the_output_heads_vocabulary():
    """A replaced (resized) output head sets the targets' range, as a replaced embedding sets the token ids': a
    target of 39 is taken by a 40-token head and 40 is named."""
    model = tiny_model(("standard", {}))  # vocab_size 37
    model.lm_head = torch.nn.Linear(model.cfg.d_model, 40, bias=False, dtype=torch.float64)  # as a resize does
    idx = torch.randint(0, 37, (2, 6))
    targets = idx[:, 1:].clone()
    targets[1, 3] = 39
    assert torch.isfinite(model(idx[:, :-1], targets))
    targets[1, 3] = 40
    with pytest.raises(ValueError, match=r"target 40 outside the vocabulary: targets are 0 \.\. 39 \(vocab_size=40\)"):
        model(idx[:, :-1], targets)


def test_a_list_or_numpy_array_where_a_tensor_goes_is_named():
    """Token ids, targets, masks, positions and a module's input given as a list or a numpy array were Python's
    "'list' object has no attribute 'dim'" (or 'dtype', 'shape') from inside the call."""

    from gbattn.attention.core import AttnArgs
    from gbattn.attention.registry import build_attention

    model = tiny_model(("standard", {}), pos="rope")
    ids = [[1, 2, 3]]
    tensor = torch.tensor(ids)
    calls = {
        "token ids": [lambda: model(ids), lambda: model(np.array(ids)), lambda: model.generate(ids, 2),
                      lambda: model(ids, tensor)],
        "targets": [lambda: model(tensor, ids)],
        "key_padding_mask": [lambda: model(tensor, key_padding_mask=[[True] * 3])],
        "position_ids": [lambda: model(tensor, position_ids=[0, 1, 2])],
        "prompt_mask": [lambda: model.generate(tensor, 2, prompt_mask=[[True] * 3])],
    }
    attn = build_attention("standard", AttnArgs(d_model=8, n_heads=2, rope_base=100.0))
    x = torch.randn(1, 3, 8)
    calls["input"] = [lambda: attn(x.tolist()), lambda: attn(x.numpy())]
    calls["key_padding_mask"].append(lambda: attn(x, key_padding_mask=np.ones((1, 3), dtype=bool)))
    calls["positions"] = [lambda: attn(x, positions=[0, 1, 2])]
    for what, refused in calls.items():
        for call in refused:
            with pytest.raises(ValueError, match=rf"^{what} of type (list|ndarray): give a torch tensor"):
                call()
    model.generate(tensor, 2, prompt_mask=torch.ones(1, 3, dtype=torch.bool))
    model(tensor, tensor, key_padding_mask=torch.ones(1, 3, dtype=torch.bool), position_ids=torch.arange(3))
    attn(x, key_padding_mask=torch.ones(1, 3, dtype=torch.bool), positions=torch.arange(3))


def test_malformed_forward_and_cache_calls_are_clear_errors():
    """No tokens, a cache longer than the block, a set-up cache without input_pos, a cache of another
    depth and position_ids past the block each raise their one-line message, not a torch error or
    logits computed against the wrong cache slots."""
    from gbattn.attention.core import StaticCache

    model = tiny_model(("standard", {}))  # block_size 24, 2 layers
    idx = torch.randint(0, 37, (1, 3))
    with pytest.raises(ValueError, match="at least one token"):
        model(idx[:, :0])
    with pytest.raises(ValueError, match=r"token ids of shape \(0, 3\): expected \(batch, tokens\) with at least one "
                                         r"token and at least one row"):
        model(idx[:0])  # was the vocabulary check's "min(): Expected reduction dim to be specified"
    with pytest.raises(ValueError, match="exceeds block_size=24"):
        model.setup_cache(1, max_len=25)
    assert not model.has_cache
    model.setup_cache(1, max_len=24)
    with pytest.raises(ValueError, match=r"pass input_pos \(the cache slots of these tokens\), or call clear_cache\(\) "
                                         r"first for a forward pass without it"):
        model(idx)
    model.clear_cache()
    with pytest.raises(ValueError, match="a KV cache of 1 layers for a model of 2"):
        model(idx, input_pos=torch.arange(3), cache=StaticCache(1, 1, 24, torch.float64, "cpu"))
    with pytest.raises(ValueError, match=r"position_ids reach 24; the model's positions are 0 \.\. 23"):
        model(idx[:, :1], position_ids=torch.tensor([[24]]))


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_token_ids_position_ids_and_padding_masks_of_the_wrong_kind_are_named(block):
    """Float token ids, float or bool positions, position_ids or a key_padding_mask of another batch or length, and
    negative positions were torch's errors from the embedding or a broadcast ("The size of tensor a (2) must
    match the size of tensor b (3)", "index out of range in self"); under RoPE negative positions
    were accepted. (T,), (1, T) and (B, T) positions and a (1, T) mask still broadcast."""
    model = tiny_model(("boosted", {"rounds": 2}), **BLOCKS[block])  # block_size 24
    idx = torch.randint(0, 37, (2, 5))
    with pytest.raises(ValueError, match=r"token ids of dtype torch\.float32: expected integers \(torch\.long\)"):
        model(idx.float())
    # Under RoPE float positions were rotated by fractional angles and a bool mask passed as position_ids
    # read as positions 0/1, silently (other logits); learned positions gave the embedding's error.
    for name, bad in (("position_ids", torch.arange(5) + 0.5), ("position_ids", torch.ones(2, 5, dtype=torch.bool)),
                      ("input_pos", torch.arange(5.0))):
        with pytest.raises(ValueError, match=rf"{name} of dtype {bad.dtype}: expected integers \(torch\.long\)"):
            model(idx, **{name: bad})
    for bad in (torch.arange(5).expand(3, 5), torch.arange(4).expand(2, 4)):
        shape = ", ".join(map(str, bad.shape))
        with pytest.raises(ValueError, match=rf"position_ids of shape \({shape}\) for token ids of shape \(2, 5\): "
                                             r"expected \(2, 5\) or \(5,\)"):
            model(idx, position_ids=bad)
    for shape in ((3, 5), (2, 4)):  # (2, 4): once a mask gives the positions, wpe's broadcast error came first
        with pytest.raises(ValueError, match=rf"key_padding_mask of shape \({shape[0]}, {shape[1]}\) for a batch of 2 "
                                             r"over 5 key slots: expected \(2, 5\)"):
            model(idx, key_padding_mask=torch.ones(shape, dtype=torch.bool))
    for name in ("position_ids", "input_pos"):
        for lowest in (-2, -1):  # -1 too: the first position outside
            with pytest.raises(ValueError, match=rf"{name} reach {lowest}; the model's positions are 0 \.\. 23"):
                model(idx, **{name: torch.arange(5) + lowest})
    logits = model(idx)
    for positions in (torch.arange(5), torch.arange(5)[None], torch.arange(5).expand(2, 5)):
        torch.testing.assert_close(model(idx, position_ids=positions), logits, rtol=0, atol=0)
    torch.testing.assert_close(model(idx, key_padding_mask=torch.ones(1, 5, dtype=torch.bool)), logits)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_token_ids_targets_positions_and_masks_on_another_device_are_named(block):
    """Token ids on another device than the model (here the meta device, the one other device every machine has)
    gave logits read from garbage, silently; targets, position_ids, input_pos or a key_padding_mask on another
    device than the token ids were torch's "Tensor on device meta is not on the expected device cpu!" (or
    "Cannot copy out of meta tensor"). A model on meta (shapes only; or its weights offloaded there until
    used, as accelerate does) takes token ids on any device."""
    model = tiny_model(("boosted", {"rounds": 2}), **BLOCKS[block])
    idx = torch.randint(0, 37, (2, 5))
    with pytest.raises(ValueError, match=r"^token ids on meta for a model on cpu: give it on cpu"):
        model(idx.to("meta"))
    meta = {"position_ids": torch.arange(5), "input_pos": torch.arange(5),
            "key_padding_mask": torch.ones(2, 5, dtype=torch.bool)}
    for name, value in meta.items():
        with pytest.raises(ValueError, match=rf"^{name} on meta for token ids on cpu: give it on cpu"):
            model(idx, **{name: value.to("meta")})
    with pytest.raises(ValueError, match=r"^targets on meta for token ids on cpu: give it on cpu"):
        model(idx, idx.to("meta"))
    assert GPT(model.cfg).to("meta")(idx.to("meta")).shape == (2, 5, 37)  # (all on meta: shapes only)
    untied = tiny_model(("boosted", {"rounds": 2}), tie_embeddings=False, **BLOCKS[block])
    expected, weight = untied(idx), untied.wte.weight
    offloaded = torch.nn.Parameter(weight.to("meta"))  # as accelerate offloads: loaded for the embedding's forward only
    untied.wte.weight = offloaded
    untied.wte.register_forward_pre_hook(lambda module, args: setattr(module, "weight", weight))
    untied.wte.register_forward_hook(lambda module, args, out: setattr(module, "weight", offloaded))
    torch.testing.assert_close(untied(idx), expected, rtol=0, atol=0)


def test_dropout_sites_listed_twice_are_refused():
    twice = r"dropout_sites=\['embedding', 'attention', 'embedding'\] lists an entry twice"
    with pytest.raises(ConfigError, match=twice):
        ModelConfig(dropout_sites=["embedding", "attention", "embedding"])
    assert ModelConfig(dropout_sites="embedding,attention").dropout_sites == ["embedding", "attention"]


@pytest.mark.parametrize("field_name", ["lr", "epochs", "weight_decay", "checkpoint_minutes"])
def test_number_fields_refuse_infinity(field_name):
    """A float field takes a finite number only: json.loads reads `Infinity` in a config.json as
    float('inf'), which every range check (> 0, >= 0) would let through."""
    from gbattn.config import TrainConfig

    with pytest.raises(ConfigError, match=rf"{field_name}=inf must be a finite number"):
        TrainConfig(**{field_name: float("inf")})
    with pytest.raises(ConfigError, match=r"norm_eps=inf must be a finite number"):
        ModelConfig(norm_eps=float("inf"))
    # an integer past a float's range (json.loads reads 400 digits as one): was an OverflowError traceback
    with pytest.raises(ConfigError, match=rf"^{field_name}=9{{400}} must be a finite number$"):
        TrainConfig(**{field_name: int("9" * 400)})


def test_several_attn_sets_all_apply():
    """`--set attn.rounds=3 --set attn.gate=scalar`: both options reach the variant (each --set adds
    to attn_options; none replaces the ones before it)."""
    from gbattn.config import set_path

    cfg = preset_config("paper-small", "boosted", {"attn.rounds": 3, "attn.gate": "scalar"})
    assert cfg.attn_options == {"rounds": 3, "gate": "scalar"}
    d = {"attn_options": {"rounds": 2}}
    set_path(d, "attn.gate", "vector")
    assert d == {"attn_options": {"rounds": 2, "gate": "vector"}}


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias=1), r"bias=1 must be true or false"),
    (dict(tie_embeddings=0), r"tie_embeddings=0 must be true or false"),
    (dict(d_model="256"), r"d_model='256' must be an integer"),
    (dict(n_kv_heads="2"), r"n_kv_heads='2' must be an integer or null"),
])
def test_typed_fields_refuse_a_string_int_and_an_int_bool(kwargs, match):
    """checks.py's rules: an int field never takes a string (config.json "d_model": "256", or
    --set d_model='"256"'), a bool field only true/false (not 1 or 0, which JSON keeps as numbers)."""
    from gbattn.config import TrainConfig

    with pytest.raises(ConfigError, match=match):
        ModelConfig(**kwargs)
    with pytest.raises(ConfigError, match=r"fit_warmup=1 must be true or false"):
        TrainConfig(fit_warmup=1)


def test_param_matched_width_with_rope_keeps_an_even_head_width():
    """RoPE rotates pairs: the solver steps by 2 n_heads and returns the smallest such width that
    reaches the target (cpu-modern's param-fair row, matched to GBA M=2 at cpu-llama)."""
    cfg = preset_config("cpu-llama", "boosted", {"vocab_size": 4096})
    target = count_params(cfg)
    width, n = param_matched_width(cfg.replace(attn="standard", attn_options={}), target)
    step = 2 * cfg.n_heads
    assert width % step == 0 and n >= target
    assert count_params(cfg.replace(attn="standard", attn_options={}, d_model=width - step)) < target


def test_the_config_defaults_are_the_papers_model_and_recipe():
    """ModelConfig() is paper-small's standard model, TrainConfig() the paper's recipe (docs/paper.md: d 256,
    4 layers, 4 heads, T 256, BPE 16,384, GELU FFN 4d, Pre-LN LayerNorm (PyTorch's eps 1e-5), tied embeddings,
    biases, dropout 0.1 at the authors' sites; AdamW lr 3e-4 (PyTorch's betas), weight decay 0.01, 1,500 warmup
    steps from 0, cosine to 0, batch 32, 10M tokens, 15 epochs, clipping 1.0, seed 42, valid/test capped at 1M);
    a single file splits 90/5/5 (README, 'Data'); RoPE's base is the usual 10,000."""
    from gbattn.config import TrainConfig

    model = ModelConfig()
    assert (model.vocab_size, model.block_size, model.d_model, model.n_layers, model.n_heads, model.kv_heads,
            model.ffn, model.ffn_width, model.dropout, model.dropout_sites, model.norm, model.norm_type,
            model.norm_eps, model.pos, model.rope_base, model.bias, model.tie_embeddings, model.attn,
            model.residual) == (16384, 256, 256, 4, 4, 4, "gelu", 1024, 0.1,
                                ["embedding", "attention", "ffn-hidden", "ffn-output"], "pre", "layernorm", 1e-5,
                                "learned", 10000.0, True, True, "standard", "plain")
    assert model == preset_config("paper-small")
    train = TrainConfig()
    expected = dict(tokenizer="bpe", split=[0.9, 0.05, 0.05], train_tokens=10_000_000, eval_tokens=1_000_000,
                    seq_len=None, sampling="rows", batch_size=32, grad_accum=1, epochs=15.0, max_steps=None, lr=3e-4,
                    min_lr=0.0, warmup_steps=1500, fit_warmup=True, warmup_from_zero=True, schedule="cosine",
                    weight_decay=0.01, decay_matrices_only=False, beta1=0.9, beta2=0.999, grad_clip=1.0,
                    eval_every=None, seed=42, amp="auto", parallel="ddp", init_from=None)
    assert {k: getattr(train, k) for k in expected} == expected
    assert ModelConfig(block_size=2).input_length(None) == 1 and ModelConfig(block_size=2).input_length(5) == 5
    assert ModelConfig(pos="rope", d_model=16, n_heads=4).d_head == 4
    # FFN widths: 4d for both GELUs, 2/3 of it rounded up to 16 for SwiGLU (README: 688 at d 256), or as given.
    assert [ModelConfig(ffn=ffn).ffn_width for ffn in ("gelu", "gelu-tanh", "swiglu")] == [1024, 1024, 688]
    assert ModelConfig(ffn="swiglu", ffn_hidden=100).ffn_width == ModelConfig(ffn_hidden=100).ffn_width == 100


def test_typed_records_coerce_lists_and_refuse_what_is_not_a_record():
    """A list field takes a tuple, a JSON list, or a comma-separated string, with or without brackets and
    with empty items left out (`--set dropout_sites=` is no site); from_dict refuses a non-mapping and names
    unknown fields with the record they are not in."""
    from gbattn.config import TrainConfig

    assert ModelConfig(dropout_sites=("embedding", "ffn-output")).dropout_sites == ["embedding", "ffn-output"]
    assert ModelConfig(dropout_sites="[embedding, attention]").dropout_sites == ["embedding", "attention"]
    assert ModelConfig(dropout_sites="embedding,,attention,").dropout_sites == ["embedding", "attention"]
    assert ModelConfig(dropout_sites="").dropout_sites == []
    assert TrainConfig(split="[0.8, 0.1, 0.1]").split == [0.8, 0.1, 0.1]
    with pytest.raises(ConfigError, match=r"a model config must be a mapping, got list"):
        ModelConfig.from_dict([("d_model", 64)])
    with pytest.raises(ConfigError, match=r"unknown training config field\(s\) \['colour'\]; allowed: "
                                          r"activation_checkpointing, amp, "):
        TrainConfig.from_dict({"lr": 1e-3, "colour": "red"})


def test_numpy_numbers_are_taken_as_python_numbers():
    """A width from a numpy sweep (np.int64(128)) was refused with "d_model=np.int64(128) must be an integer",
    in a ModelConfig, an option and an AttnArgs, while 128.0 was taken; numpy's integers and floats are now
    taken as Python's (so config.json can write them), and what is not a number is still refused."""
    import json

    from gbattn.attention import AttnArgs, build_attention

    cfg = ModelConfig(d_model=np.int64(64), n_heads=np.int32(4), dropout=np.float32(0.5), attn="boosted",
                      attn_options={"rounds": np.int64(3)})
    assert (cfg.d_model, cfg.n_heads, cfg.dropout, cfg.attn_options) == (64, 4, 0.5, {"rounds": 3})
    # an integral numpy float32 as 64.0 is (it was "must be an integer" while np.float64(64.0) was taken)
    assert ModelConfig(d_model=np.float32(64.0), n_heads=np.float32(4.0)).d_model == 64
    with pytest.raises(ConfigError, match="d_model=64.5 must be an integer"):
        ModelConfig(d_model=np.float32(64.5))
    assert type(cfg.d_model) is int and type(cfg.dropout) is float and type(cfg.attn_options["rounds"]) is int
    json.dumps(cfg.to_dict())  # np.int64 is not JSON-serialisable
    attn = build_attention("boosted", AttnArgs(d_model=np.int64(16), n_heads=np.int64(4), dropout=np.float64(0.1)),
                           {"rounds": np.int64(3)})
    assert type(attn.args.d_model) is int and attn.rounds == 3 and attn(torch.randn(1, 3, 16)).shape == (1, 3, 16)
    for bad in (torch.tensor(64), np.bool_(True)):
        with pytest.raises(ConfigError, match="d_model=.* must be an integer"):
            ModelConfig(d_model=bad)


def test_set_values_options_and_keywords_keep_what_was_given():
    """`--set tokenizer=hf=PATH` keeps everything after the first '='; an option given as 0 or False
    (`--seed 0`) is given, not 'not given', and so is build_configs' keyword (compare's seed=0); an explicit
    `--set fit_warmup=true` stays beside `--set warmup_steps`; `attn_options.x` is the long name of `attn.x`."""
    from gbattn.config import build_configs, merge_options, parse_sets, set_path

    assert parse_sets(["tokenizer=hf=/models/tok=1", " lr = 1e-3 "]) == {"tokenizer": "hf=/models/tok=1", "lr": 1e-3}
    # An integer of more digits than Python converts (4,300) stays the text given: a traceback before.
    assert parse_sets(["d_model=" + "1" * 5000]) == {"d_model": "1" * 5000}
    assert merge_options({"lr": 1e-3}, seed=0, compile=False, attn=None) == {"lr": 1e-3, "seed": 0, "compile": False}
    assert build_configs("paper-small", "standard", "data", {}, seed=0)[1].seed == 0
    _, train = build_configs("paper-small", "standard", "data", {"warmup_steps": 200, "fit_warmup": True})
    assert (train.warmup_steps, train.fit_warmup) == (200, True)
    # a keyword is as explicit as a --set: its warmup is kept as given, its epochs refused beside a preset's max_steps
    _, train = build_configs("paper-small", "standard", "data", warmup_steps=10)
    assert (train.warmup_steps, train.fit_warmup) == (10, False)
    with pytest.raises(ConfigError, match=r"^epochs=3.0 is not used: max_steps=2000 \(preset cpu-char's\) sets"):
        build_configs("cpu-char", "standard", "data", epochs=3.0)
    # ... a value no run takes is named as such first ("not used" sent the user to a second error)
    for bad, message in ((-1, r"epochs=-1.0 must be > 0"), ("word", r"epochs='word' must be a number")):
        with pytest.raises(ConfigError, match=rf"^{message}$"):
            build_configs("cpu-char", "standard", "data", {"epochs": bad})
    d = {"attn_options": {"gate": "scalar"}}
    set_path(d, "attn_options.rounds", 3)
    assert d == {"attn_options": {"gate": "scalar", "rounds": 3}}
    assert preset_config("paper-small", "boosted", {"attn_options.rounds": 3}).attn_options == {"rounds": 3}


def test_a_set_field_given_twice_must_agree():
    """`--set lr=1e-3 --set lr=2e-3` is refused, not settled by the last (as a flag and a --set that disagree
    are); `attn.rounds` and `attn_options.rounds` name one field; the same value twice is accepted."""
    from gbattn.config import parse_sets

    with pytest.raises(ConfigError, match=r"^--set lr=1e-3 and --set lr = 2e-3 disagree: give one of them$"):
        parse_sets(["lr=1e-3", "lr = 2e-3"])
    with pytest.raises(ConfigError, match=r"--set attn.rounds=3 and --set attn_options.rounds=2 disagree"):
        parse_sets(["attn.rounds=3", "attn_options.rounds=2"])
    assert parse_sets(["lr=1e-3", "lr=0.001", "attn.gate=scalar"]) == {"lr": 1e-3, "attn.gate": "scalar"}
    # A whole attn_options mapping and one of its options: the last given won (either order), silently
    for items in (['attn_options={"rounds": 3}', "attn.rounds=4"], ["attn.rounds=4", 'attn_options={"rounds": 3}'],
                  ["attn.gate=linear", 'attn_options={"rounds": 3}']):
        with pytest.raises(ConfigError, match=rf"^--set {re.escape(items[0])} and --set {re.escape(items[1])} "
                                              r"disagree: give one of them$"):
            parse_sets(items)
    assert parse_sets(["attn.rounds=3", 'attn_options={"rounds": 3}']) == {"attn.rounds": 3,
                                                                          "attn_options": {"rounds": 3}}


def test_epochs_beside_a_max_steps_that_sets_the_length_is_refused():
    """--set epochs=N on a preset whose max_steps sets the length (cpu-char's 2,000) trained the preset's steps,
    epochs ignored silently; with max_steps given too, max_steps won. Both are one line now; epochs alone where the
    preset trains for epochs is taken."""
    from gbattn.config import build_configs

    # cpu-char samples random windows: the advice names sampling=rows too (max_steps=null alone was refused as
    # "sampling='random' has no epochs", whose advice was max_steps: the user went back and forth)
    with pytest.raises(ConfigError, match=r"^epochs=0.5 is not used: max_steps=2000 \(preset cpu-char's\) sets "
                                          r"the run's length; give max_steps=null and sampling=rows \(random windows "
                                          r"have no epochs\) to train for epochs, or leave epochs out$"):
        build_configs("cpu-char", "standard", "tiny-shakespeare", {"epochs": 0.5})
    with pytest.raises(ConfigError, match=r"^sampling='random' has no epochs: set max_steps, or sampling=rows to "
                                          r"train for epochs$"):
        build_configs("cpu-char", "standard", "tiny-shakespeare", {"epochs": 0.5, "max_steps": None})
    with pytest.raises(ConfigError, match=r"^epochs=2 is not used: max_steps=5 \(given too\) sets the run's length; "
                                          r"give max_steps=null to train"):  # (a preset reading rows: no sampling)
        build_configs("paper-small", "standard", "tiny-shakespeare", {"epochs": 2, "max_steps": 5})
    with pytest.raises(ConfigError, match=r"^epochs=2 is not used: max_steps=5 \(given too\)"):
        build_configs("paper-small", "standard", "tiny-shakespeare", {"epochs": 2, "max_steps": 5})
    assert build_configs("paper-small", "standard", "tiny-shakespeare", {"epochs": 2})[1].epochs == 2
    assert build_configs("cpu-char", "standard", "tiny-shakespeare", {"epochs": 2, "max_steps": None,
                                                                      "sampling": "rows"})[1].epochs == 2


def test_a_set_value_nested_too_deeply_is_one_line():
    """5,000 nested lists in a --set value (or a variant's option) were a RecursionError traceback, exit 1."""
    from gbattn.config import parse_sets, variant_spec

    deep = "[" * 5000
    with pytest.raises(ConfigError, match=r"^--set d_model: nested too deeply to read$"):
        parse_sets([f"d_model={deep}"])
    with pytest.raises(ConfigError, match=r"^boosted:rounds: nested too deeply to read$"):
        variant_spec(f"boosted:rounds={deep}")


def test_the_attention_and_data_given_as_arguments_and_in_the_overrides_must_agree():
    """build_configs("cpu-char", "boosted", data, {"attn": "standard"}) built the standard model, silently (the
    overrides won over the argument; the data too): a field given both ways with different values is refused, as
    `--attn` and `--set attn=` that disagree are; the same value both ways is taken."""
    from gbattn.config import build_configs

    with pytest.raises(ConfigError, match=r"^attn='boosted' and the overrides' attn='standard' disagree: give one"):
        build_configs("cpu-char", "boosted", "tiny-shakespeare", {"attn": "standard"})
    with pytest.raises(ConfigError, match=r"^attn='boosted' and the overrides' attn='gated' disagree"):
        preset_config("cpu-char", "boosted", {"attn": "gated"})
    with pytest.raises(ConfigError, match=r"^data='a.txt' and the overrides' data='b.txt' disagree"):
        build_configs("cpu-char", "boosted", "a.txt", {"data": "b.txt"})
    model_cfg, train_cfg = build_configs("cpu-char", "boosted", "a.txt", {"attn": "boosted", "data": "a.txt"})
    assert (model_cfg.attn, train_cfg.data) == ("boosted", "a.txt")


def test_build_configs_takes_a_path_for_its_data_and_names_a_model_field_given_as_a_keyword(tmp_path):
    """build_configs(preset, attn, pathlib.Path(...), sets) was "data must be a string"; it takes the path's string.
    A model field given as a keyword (d_model=64) was an "unknown training config field": it is named as a model
    field, which goes in sets."""
    from gbattn.config import build_configs

    assert build_configs("cpu-char", "boosted", tmp_path / "a.txt", {})[1].data == str(tmp_path / "a.txt")
    assert build_configs("cpu-char", "boosted", "a.txt") == build_configs("cpu-char", "boosted", "a.txt", {})  # no sets
    # ... in sets and as a keyword too (init_from=Path(...) was "must be a string"; data given twice "disagreed")
    _, train_cfg = build_configs("cpu-char", "boosted", tmp_path / "a.txt", {"data": tmp_path / "a.txt",
                                                                            "init_from": tmp_path / "run"})
    assert (train_cfg.data, train_cfg.init_from) == (str(tmp_path / "a.txt"), str(tmp_path / "run"))
    _, train_cfg = build_configs("cpu-char", "boosted", "a.txt", init_from=tmp_path / "run")
    assert train_cfg.init_from == str(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^d_model, n_layers: model field\(s\), which build_configs takes in sets "
                                          r"\(\{'d_model': \.\.\., 'n_layers': \.\.\.\}\)"):
        build_configs("cpu-char", "boosted", "a.txt", {}, n_layers=1, d_model=64, lr=1e-3)


def test_range_and_type_checks_hold_at_their_edges():
    """between() includes both ends (n_layers 4096 allowed, 4097 refused), a number field refuses
    true/false as an int field does, and an int field refuses -2**64 as it refuses 2**64."""
    from gbattn.config import TrainConfig

    assert ModelConfig(n_layers=4096).n_layers == 4096 and ModelConfig(n_layers=1).n_layers == 1
    with pytest.raises(ConfigError, match=r"n_layers=4097 must be an integer in \[1, 4096\]"):
        ModelConfig(n_layers=4097)
    with pytest.raises(ConfigError, match=r"lr=True must be a number"):
        TrainConfig(lr=True)
    for seed in (2**64, -(2**64)):
        with pytest.raises(ConfigError, match=r"seed=-?\d+ is out of range"):
            TrainConfig(seed=seed)


# (field, its least value, the message of one below it): a count is at least 1 unless 0 means something.
LEAST_TRAINING_VALUES = [
    ("train_tokens", 1, r"train_tokens=0 must be an integer >= 1"),
    ("eval_tokens", 1, r"eval_tokens=0 must be an integer >= 1"),
    ("seq_len", 1, r"seq_len=0 must be an integer >= 1"),
    ("batch_size", 1, r"batch_size=0 must be an integer >= 1"),
    ("grad_accum", 1, r"grad_accum=0 must be an integer >= 1"),
    ("max_steps", 1, r"max_steps=0 must be an integer >= 1"),
    ("warmup_steps", 0, r"warmup_steps=-1 must be an integer >= 0"),
    ("eval_every", 1, r"eval_every=0 must be an integer >= 1"),
    ("eval_batch_size", 1, r"eval_batch_size=0 must be an integer >= 1"),
    ("log_every", 1, r"log_every=0 must be an integer >= 1"),  # the loop takes step % log_every
    ("seed", 0, r"seed=-1 must be an integer in \[0, "),
    ("threads", 1, r"threads=0 must be an integer in \[1, "),
]
LEAST_MODEL_VALUES = [
    ("vocab_size", 1, r"vocab_size=0 must be an integer in \[1, "),
    ("block_size", 1, r"block_size=0 must be an integer in \[1, "),
    ("d_model", 1, r"d_model=0 must be an integer in \[1, "),
    ("n_layers", 1, r"n_layers=0 must be an integer in \[1, "),
    ("n_heads", 1, r"n_heads=0 must be an integer in \[1, "),
    ("n_kv_heads", 1, r"n_kv_heads=0 must be an integer >= 1"),
    ("ffn_mult", 1, r"ffn_mult=0 must be an integer in \[1, "),
    ("ffn_hidden", 1, r"ffn_hidden=0 must be an integer in \[1, "),
    ("attnres_block", 1, r"attnres_block=0 must be an integer >= 1"),
]


@pytest.mark.parametrize("name, least, refused", LEAST_TRAINING_VALUES + LEAST_MODEL_VALUES)
def test_every_count_field_takes_its_least_value_and_refuses_the_one_below(name, least, refused):
    """Each count's lower bound, written out: a batch of one row, a log line every step, a one-token
    vocabulary are taken; one below is refused with the field named (log_every=0 would end the first step in a
    ZeroDivisionError, batch_size=0 train on nothing)."""
    from gbattn.config import TrainConfig

    record = TrainConfig if name in TrainConfig.field_names() else ModelConfig
    narrow = {"n_heads": 1} if record is ModelConfig and name in ("d_model", "n_kv_heads") else {}
    narrow = {"residual": "attnres-block"} if name == "attnres_block" else narrow
    assert getattr(record(**{name: least}, **narrow), name) == least
    with pytest.raises(ConfigError, match=refused):
        record(**{name: least - 1}, **narrow)


def test_the_final_norm_follows_the_block_unless_set():
    """final_norm unset: a norm before the LM head with Pre-LN, none with Post-LN (its blocks end in one);
    final_norm=true gives a Post-LN model one (docs/deviations.md entry 16): its d (RMSNorm, or bias-free) or 2d
    parameters, and the head reads the normalised states, which a Pre-LN model without it does not."""
    d = 16
    base = dict(vocab_size=19, block_size=8, n_layers=2, n_heads=2, d_model=d, dropout=0.0)
    for block, extra in ((dict(), 2 * d), (dict(norm_type="rmsnorm"), d), (dict(bias=False), d)):
        post = ModelConfig(**base, **block, norm="post")
        assert count_params(post.replace(final_norm=True)) == count_params(post) + extra, block
        pre = post.replace(norm="pre")
        assert count_params(pre) == count_params(pre.replace(final_norm=False)) + extra, block
    torch.manual_seed(0)
    with_norm = GPT(ModelConfig(**base, norm="post", final_norm=True)).eval()
    without = GPT(ModelConfig(**base, norm="post")).eval()
    with torch.no_grad():  # the last block's norm scaled by 3: its output is no longer unit-normalised
        with_norm.blocks[1].ln2.weight.mul_(3.0)
    without.load_state_dict({k: v for k, v in with_norm.state_dict().items() if not k.startswith("ln_f.")})
    idx = torch.randint(0, 19, (2, 8))
    stream_BTD = without.hidden(idx)[0]  # (no final norm: the last block's output)
    logits_with = with_norm(idx)
    torch.testing.assert_close(logits_with, with_norm.lm_head(with_norm.ln_f(stream_BTD)))
    assert not torch.allclose(logits_with, without(idx), atol=1e-2)


def test_attn_bias_switches_the_attention_projections_biases_alone():
    """attn_bias=false drops the Q/K/V and output biases of every attention variant and nothing else (the official
    differential attention has none; docs/deviations.md entry 14): 4d per layer, a GBA round's own Q/K/V 3d more;
    unset it follows `bias`, and attn_bias=true keeps them in a bias-free block."""
    d, layers = 16, 3
    base = dict(vocab_size=19, block_size=8, n_layers=layers, n_heads=2, d_model=d)
    for attn, dropped in (("standard", 4 * d), ("differential", 4 * d), ("gated", 4 * d), ("twicing", 4 * d),
                          ("boosted", 4 * d + 3 * d)):
        cfg = ModelConfig(**base, attn=attn)
        without = GPT(cfg.replace(attn_bias=False))
        assert count_params(cfg) - count_params(cfg.replace(attn_bias=False)) == dropped * layers, attn
        names = {n for n, _ in GPT(cfg).named_parameters()} - {n for n, _ in without.named_parameters()}
        assert names and all(".attn." in n and n.endswith("bias") for n in names), (attn, names)
    free = ModelConfig(**base, bias=False)
    assert count_params(free.replace(attn_bias=True)) - count_params(free) == 4 * d * layers
    assert count_params(ModelConfig(**base, attn_bias=True)) == count_params(ModelConfig(**base))


# ---- activation checkpointing ----------------------------------------------------------


CHECKPOINT_LAYOUTS = {"pre": {}, "post": dict(norm="post"), "attnres-full": dict(residual="attnres-full"),
                      "attnres-block": dict(residual="attnres-block", attnres_block=3)}


def loss_and_grads(model: GPT, idx_BT: torch.Tensor, **kw) -> tuple[torch.Tensor, dict, list[list[int]]]:
    """A training step's loss and gradients, and each block's calls of its attention and its FFN (a recomputed
    block runs each twice)."""
    model.zero_grad(set_to_none=True)
    calls = [[0, 0] for _ in model.blocks]

    def count(block: int, sublayer: int):
        return lambda *_: calls[block].__setitem__(sublayer, calls[block][sublayer] + 1)

    # (pre-hooks: a recomputation stops once it has what the backward pass needs, before a module's forward returns)
    hooks = [module.register_forward_pre_hook(count(i, j))
             for i, block in enumerate(model.blocks) for j, module in enumerate((block.attn, block.mlp))]
    torch.manual_seed(7)  # the same dropout masks for both
    out = model(idx_BT[:, :-1], idx_BT[:, 1:], **kw)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


@pytest.mark.parametrize("layout", list(CHECKPOINT_LAYOUTS))
def test_activation_checkpointing_recomputes_each_block_with_the_same_loss_and_gradients(variant_case, layout):
    """float64, dropout at every site: a model that recomputes its blocks in the backward pass gives the loss and
    every gradient of one that keeps their activations (the same dropout masks are drawn again), and each chosen
    block's attention and FFN really run twice; a forward that writes analysis records does not recompute the
    attention that writes them (it would record twice)."""
    model = tiny_model(variant_case, dropout=0.1, **CHECKPOINT_LAYOUTS[layout]).train()
    idx_BT = torch.randint(0, 37, (2, 13))
    loss, grads, calls = loss_and_grads(model, idx_BT)
    assert calls == [[1, 1], [1, 1]]
    for every, recomputed in ((2, [[2, 2], [1, 1]]), (None, [[2, 2], [2, 2]])):  # (None: the defaults, every block)
        model.set_activation_checkpointing(**({} if every is None else {"enable": True, "every_n_layers": every}))
        again, again_grads, calls = loss_and_grads(model, idx_BT)
        assert calls == recomputed
        torch.testing.assert_close(again, loss, rtol=0, atol=1e-12)
        assert again_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(again_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)
    # (with Attention Residuals the FFN sublayer, which writes no record, is still recomputed)
    assert [attn for attn, _ in loss_and_grads(model, idx_BT, return_intermediates=True)[2]] == [1, 1]
    # nor one that writes a KV cache (recomputed, it would write its keys and values again)
    model.setup_cache(2)
    assert [attn for attn, _ in loss_and_grads(model, idx_BT, input_pos=torch.arange(12))[2]] == [1, 1]
    model.clear_cache()
    model.set_activation_checkpointing(False)
    assert loss_and_grads(model, idx_BT)[2] == [[1, 1], [1, 1]]
    # the default recomputes without reentrant autograd: torch.autograd.grad works through it (reentrant raises)
    model.set_activation_checkpointing(True)
    torch.manual_seed(7)  # loss_and_grads' dropout masks
    out = model(idx_BT[:, :-1], idx_BT[:, 1:])
    loss = out[0] if isinstance(out, tuple) else out
    trained = {n: p for n, p in model.named_parameters() if n in grads}
    for name, grad in zip(trained, torch.autograd.grad(loss, list(trained.values()))):
        torch.testing.assert_close(grad, grads[name], rtol=1e-10, atol=1e-12, msg=name)
    for every in (0, True, 2.0):  # (a bool is no count of layers; 2.0 would pick the blocks as 2 does, unchecked)
        with pytest.raises(ValueError, match=rf"every_n_layers={every!r} must be an integer >= 1"):
            model.set_activation_checkpointing(True, every_n_layers=every)
    model.set_activation_checkpointing(True, every_n_layers=np.int64(2))  # (numpy's integer was refused as none)
    # enable="no" was true (every block recomputed); a checkpoint_fn that is no function failed at the next forward
    model.set_activation_checkpointing(False)
    with pytest.raises(ValueError, match=r"^enable='no' must be True or False$"):
        model.set_activation_checkpointing("no")
    with pytest.raises(ValueError, match=r"^checkpoint_fn of type int: give a function"):
        model.set_activation_checkpointing(True, checkpoint_fn=5)
    assert not any(block.gradient_checkpointing for block in model.blocks)  # (left as it was)


@pytest.mark.parametrize("layout", [{}, {"residual": "attnres-block", "attnres_block": 2}], ids=["plain", "attnres"])
def test_per_sample_gradients_through_torch_func_vmap(layout):
    """torch.func.vmap(grad(loss)) over a batch gives each row's own gradient (per-sample gradients, as for
    differential privacy or influence estimates), and vmap of the forward the batched logits: the input checks that
    read values on the host (a boolean mask of targets, ids' min and max) stopped both ("vmap: ... .item()"); they
    are left out under torch.func transforms, as under torch.compile."""
    from torch.func import functional_call, grad, vmap

    model = tiny_model(("boosted", {"rounds": 2}), **layout).eval()
    idx = torch.randint(0, 37, (3, 9))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p, x_T, y_T):
        return functional_call(model, p, (x_T[None], y_T[None]))

    per_row = vmap(grad(loss), in_dims=(None, 0, 0))(params, idx[:, :-1], idx[:, 1:])
    for row in range(3):
        alone = grad(loss)(params, idx[row, :-1], idx[row, 1:])
        for name, g in alone.items():
            torch.testing.assert_close(per_row[name][row], g, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(vmap(lambda x_T: model(x_T[None])[0])(idx), model(idx), rtol=1e-10, atol=1e-12)


def test_hidden_takes_token_embeddings_in_place_of_ids_and_checks_them():
    """GPT.hidden(None, token_embeds_BTD=wte(idx)) is hidden(idx) (learned positions and RoPE alike), and what it is
    given wrongly is one ValueError each: ids and embeddings both or neither, a list, the wrong shape or width, no
    rows or no tokens, another dtype than the model's."""
    for pos in ("learned", "rope"):
        model = tiny_model(("boosted", {}), pos=pos).eval()
        idx_BT = torch.randint(0, 37, (2, 7))
        expected, _ = model.hidden(idx_BT)
        got, _ = model.hidden(None, token_embeds_BTD=model.wte(idx_BT))
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    embeds = model.wte(idx_BT).detach()
    for args, kwargs, match in (
            ((idx_BT,), {"token_embeds_BTD": embeds}, r"give token ids or token embeddings .* one of the two"),
            ((None,), {}, r"give token ids or token embeddings .* one of the two"),
            ((None,), {"token_embeds_BTD": embeds.tolist()}, r"token embeddings of type list: give a torch tensor"),
            ((None,), {"token_embeds_BTD": embeds[0]}, r"token embeddings of shape \(7, 16\): expected \(batch, "
                                                       r"tokens, 16\)"),
            ((None,), {"token_embeds_BTD": embeds[..., :8]}, r"of shape \(2, 7, 8\): expected \(batch, tokens, 16\)"),
            ((None,), {"token_embeds_BTD": embeds[:0]}, r"of shape \(0, 7, 16\): expected .* at least one row"),
            ((None,), {"token_embeds_BTD": embeds[:, :0]}, r"of shape \(2, 0, 16\): expected .* at least one token"),
            ((None,), {"token_embeds_BTD": embeds.float()}, r"token embeddings of dtype torch.float32 for a model in "
                                                            r"torch.float64: give them in torch.float64")):
        with pytest.raises(ValueError, match=match):
            model.hidden(*args, **kwargs)
