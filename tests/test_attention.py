"""Attention variants against their independent references (gbattn.attention.reference): both
paths of every module, outputs and all gradients, in float64, with grouped K/V, RoPE and left
padding; causality; padding that matters; dropout; the analysis record; the core's two paths in every
kind of context and which one runs; the registry's checks of options and layers."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest
import torch

from conftest import VARIANT_CASES, case_id
from gbattn.attention import AttnArgs, build_attention
from gbattn.attention.reference import REFERENCES, RefSpec
from gbattn.attention.registry import VARIANTS, describe_variants, variant_options
from gbattn.errors import ConfigError

D, B, T = 16, 2, 7
# gqa4: two query heads per K/V head and several K/V heads, so a query head paired with the wrong K/V head
# shows (in differential attention too: 4 head pairs over 2 K/V pairs).
HEADS = {"mha": (4, 4, None), "gqa-rope": (4, 2, 10000.0), "mqa-rope": (4, 1, 500.0), "gqa4-rope": (8, 4, 10000.0)}


def test_every_variant_has_a_reference():
    assert set(REFERENCES) == set(VARIANTS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_keeps_the_options_contract(name):
    """A variant's options are a ``Typed`` record (a plain dataclass took ``--set attn.x=true`` for a number, and
    printing the model failed), each field of a type the configs check, none named as a model field (``--model
    x=variant:norm_eps=...`` set the model's field instead, silently), and its file says in a docstring what it is
    (``gbattn list`` failed without one)."""
    import sys
    import typing

    from gbattn.checks import Typed, coerce
    from gbattn.config import ModelConfig

    options = VARIANTS[name].Options
    assert issubclass(options, Typed), f"{name}: its Options must subclass gbattn.checks.Typed"
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for field_ in dataclasses.fields(options):
        assert field_.name not in model_fields, f"{name}: option {field_.name!r} is also a model field"
        default = field_.default if field_.default is not dataclasses.MISSING else field_.default_factory()
        coerce(field_.name, default, typing.get_type_hints(options)[field_.name])  # (a TypeError for another type)
    assert (sys.modules[VARIANTS[name].__module__].__doc__ or "").strip(), f"{name}: its file has no docstring"


def test_a_config_field_of_a_type_the_configs_do_not_check_is_a_type_error():
    """coerce returned a value of a type it does not know unchanged: Literal["a", "b"] took any word."""
    import typing

    from gbattn.checks import coerce

    with pytest.raises(TypeError, match=r"^where: its declared type typing.Literal\['queries', 'keys'\] is not one "
                                        r"gbattn's configs check"):
        coerce("where", "bogus", typing.Literal["queries", "keys"])
    with pytest.raises(TypeError, match=r"^pair: its declared type tuple is not one"):
        coerce("pair", 7, tuple)


def make(variant_case, heads="mha", layer_idx=1, dropout=0.0, bias=True):
    name, opts = variant_case
    H, G, base = HEADS[heads]
    args = AttnArgs(d_model=D, n_heads=H, n_kv_heads=G, dropout=dropout, bias=bias, layer_idx=layer_idx, n_layers=2,
                    rope_base=base)
    module = build_attention(name, args, opts).double()
    with torch.no_grad():  # larger weights than the LM init, so attention is far from uniform
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def left_padded(length: int = T):
    """Row 0 starts with two padding tokens; RoPE positions count real tokens only."""
    keep = torch.ones(B, length, dtype=torch.bool)
    keep[0, :2] = False
    positions = (keep.long().cumsum(1) - 1).clamp_min(0)
    return keep, positions


# Differential attention pairs K/V heads, so it has no one-K/V-head case (its refusal is tested below).
REFERENCE_CASES = [(case, heads) for case in VARIANT_CASES for heads in HEADS
                   if not (case[0] == "differential" and HEADS[heads][1] % 2)]


def assert_equals_reference(variant_case, heads: str, naive: bool, length: int = T, layer_idx: int = 1) -> None:
    """The module's output and every gradient (input and parameters) equal the reference's, in
    float64, on a left-padded batch of ``length`` tokens, in layer ``layer_idx`` of 2."""
    name, opts = variant_case
    attn = make(variant_case, heads, layer_idx=layer_idx)
    keep, positions = left_padded(length)
    x = torch.randn(B, length, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(B, length, D, dtype=torch.float64)

    y = attn(x, key_padding_mask=keep, positions=positions if attn.args.rope_base is not None else None, naive=naive)
    (y * weight).sum().backward()
    grads = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in attn.named_parameters()}}

    params = {n: p.detach().clone().requires_grad_() for n, p in attn.state_dict().items()}
    x_ref = x.detach().clone().requires_grad_()
    H, G, base = HEADS[heads]
    spec = RefSpec(H, G, opts, layer_idx=layer_idx, n_layers=2, key_padding_BT=keep, positions_BT=positions,
                   rope_base=base)
    y_ref = REFERENCES[name](params, x_ref, spec)
    (y_ref * weight).sum().backward()
    ref_grads = {"x": x_ref.grad, **{n: params[n].grad for n, _ in attn.named_parameters()}}

    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for key, g in grads.items():
        assert ref_grads[key] is not None, key
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-9, atol=1e-10, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("variant_case,heads", REFERENCE_CASES, ids=[f"{case_id(c)}-{h}" for c, h in REFERENCE_CASES])
@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_module_equals_reference_outputs_and_all_gradients(variant_case, heads, naive):
    assert_equals_reference(variant_case, heads, naive)


LAYER_SELECTING_CASES = [(name, opts) for name, opts in VARIANT_CASES if "layers" in opts]


@pytest.mark.parametrize("variant_case", LAYER_SELECTING_CASES, ids=[case_id(c) for c in LAYER_SELECTING_CASES])
@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_layer_outside_the_chosen_layers_equals_reference(variant_case, naive):
    """The shared cases put a ``layers`` variant in a chosen layer (1 of 2); in layer 0 it must be
    the reference's plain attention there."""
    assert LAYER_SELECTING_CASES
    assert_equals_reference(variant_case, "gqa-rope", naive, layer_idx=0)


def test_entropy_gate_in_several_query_chunks_equals_reference():
    """The fast path keeps no probabilities, so the mlp gate's entropy is recomputed in query
    chunks of at most 2^17 scores: at 160 tokens (B * H * T * S = 204,800) that is two chunks."""
    assert_equals_reference(("boosted", {"rounds": 3, "gate": "mlp"}), "gqa-rope", naive=False, length=160)


def test_entropy_gate_one_query_at_a_time_when_a_query_alone_has_too_many_scores():
    """B * H * S over 2^17 (512 rows x 4 heads x 65 keys = 133,120): the chunk is one query, not zero (a chunk
    size of 0 was a ValueError from range() in ordinary training, e.g. 64 rows x 8 heads x 512 tokens)."""
    attn = make(("boosted", {"rounds": 2, "gate": "mlp"}))
    x = torch.randn(512, 65, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), attn(x, naive=True), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_entropy_of_a_low_precision_map_with_zeros_is_finite(dtype):
    """0 log 0 = 0 in every dtype: the clamp is the map's own dtype's tiny (float32's rounds to 0 in float16, and
    a causal map's zeros made the mlp gate's input, so a float16 GBA model's logits, NaN)."""
    from gbattn.attention.core import entropy

    scores = torch.randn(2, 3, 5, 5, dtype=torch.float64).masked_fill(torch.ones(5, 5).triu(1).bool(), -math.inf)
    probs = scores.softmax(-1).to(dtype)
    assert (probs == 0).any()
    torch.testing.assert_close(entropy(probs).double(), entropy(probs.double()), rtol=1e-2, atol=1e-2)
    attn = make(("boosted", {"rounds": 3, "gate": "mlp"})).to(dtype)
    x = torch.randn(B, T, D, dtype=dtype)
    with torch.no_grad():
        for naive in (False, True):
            assert attn(x, naive=naive).isfinite().all(), naive


@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_rope_positions_with_gaps_equal_reference(variant_case, naive):
    """RoPE at the ``positions`` given, not 0..T-1: positions with gaps (not a shift of 0..T-1, which
    RoPE's relative scores could not tell apart) give the reference's output at those positions."""
    name, opts = variant_case
    attn = make(variant_case, "gqa-rope")
    positions = torch.tensor([[0, 3, 4, 9, 10, 11, 15], [2, 2, 5, 6, 8, 13, 14]])
    x = torch.randn(B, T, D, dtype=torch.float64)
    spec = RefSpec(4, 2, opts, layer_idx=1, n_layers=2, positions_BT=positions, rope_base=HEADS["gqa-rope"][2])
    torch.testing.assert_close(attn(x, positions=positions, naive=naive), REFERENCES[name](attn.state_dict(), x, spec),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_a_module_on_its_own_decodes_with_a_cache_as_without(variant_case, naive):
    """A module used on its own with a DynamicLayerCache (its forward's docstring): a prompt of 4 tokens,
    then 2 and 1 more, give the uncached output of all 7 (left padding in row 0, RoPE positions going on
    after the cached ones). Before, each call restarted at position 0 and SDPA's top-left causal mask hid
    the cached keys."""
    from gbattn.attention.core import DynamicLayerCache

    attn = make(variant_case, "gqa-rope").eval()
    x = torch.randn(B, T, D, dtype=torch.float64)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, :2] = False
    full = attn(x, key_padding_mask=keep, naive=naive)
    cache = DynamicLayerCache()
    parts = [attn(x[:, a:b], key_padding_mask=keep[:, :b], cache=cache, naive=naive)
             for a, b in ((0, 4), (4, 6), (6, 7))]
    torch.testing.assert_close(torch.cat(parts, 1)[keep], full[keep], rtol=1e-10, atol=1e-10)


def test_a_module_on_its_own_runs_as_a_data_parallel_replica(variant_case):
    """nn.DataParallel's replicate() leaves each replica's weights as plain tensor attributes, none registered:
    a module on its own read its device and dtype from next(self.parameters()) and raised StopIteration. A replica
    made so (on the CPU: replicate itself needs CUDA) gives the module's output."""
    import copy

    attn = make(variant_case, "gqa-rope").eval()
    replica = copy.deepcopy(attn)
    for module in replica.modules():
        for name in list(module._parameters):
            tensor = module._parameters.pop(name)
            object.__setattr__(module, name, None if tensor is None else tensor.detach().clone())
    assert list(replica.parameters()) == []
    x = torch.randn(B, T, D, dtype=torch.float64)
    torch.testing.assert_close(replica(x), attn(x), rtol=0, atol=0)


def test_a_module_on_its_own_refuses_a_cache_it_cannot_use():
    """A model's StaticLayerCache needs the model's slots, bidirectional attention cannot grow token by
    token, and a cache holds one batch: each is a ValueError rather than a silently wrong output or a
    bare size error."""
    from gbattn.attention.core import StaticLayerCache

    attn = build_attention("standard", AttnArgs(d_model=D, n_heads=4))
    x = torch.randn(B, T, D)
    with pytest.raises(ValueError, match="DynamicLayerCache"):
        attn(x, cache=StaticLayerCache(B, 16, torch.float32, "cpu"))
    from gbattn.attention.core import DynamicLayerCache

    with pytest.raises(ValueError, match="causal decoding"):
        attn(x, causal=False, cache=DynamicLayerCache())
    cache = DynamicLayerCache()
    attn(x, cache=cache)
    with pytest.raises(ValueError, match=f"this cache holds {B} rows and the new tokens come in {B + 1}"):
        attn(torch.randn(B + 1, 1, D), cache=cache)  # another batch: a new cache, not a bare torch.cat error


def test_a_cache_on_another_device_than_the_new_tokens_is_named():
    """A module moved to another device after its prefill (here the meta device, the one other device every machine
    has) decoded on into a cache holding the old device's keys and values: torch.cat's "Tensor on device meta is
    not on the expected device cpu!". A model's StaticCache names this (check_serves); a DynamicLayerCache now
    too."""
    from gbattn.attention.core import DynamicLayerCache

    attn = build_attention("boosted", AttnArgs(d_model=D, n_heads=4))
    cache = DynamicLayerCache()
    attn(torch.randn(B, 3, D), cache=cache)
    attn.to("meta")
    with pytest.raises(ValueError, match=r"^this cache holds keys and values on cpu and the new tokens are on meta: "):
        attn(torch.randn(B, 1, D, device="meta"), cache=cache)


def test_a_cache_serves_one_module_used_on_its_own():
    """Two modules stacked by hand and given one DynamicLayerCache wrote to the same "kv" entry: the
    second layer attended to the first's keys too, a silently wrong output. Now the second module's
    call is a ValueError, and a cache per module decodes as the uncached stack."""
    from gbattn.attention.core import DynamicLayerCache

    first, second = (build_attention("standard", AttnArgs(d_model=D, n_heads=4)).eval() for _ in range(2))
    x = torch.randn(1, 3, D)
    shared = DynamicLayerCache()
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \(1, 2\) for a batch of 1 over 1 key slots"):
        second(x[:, :1], cache=shared, key_padding_mask=torch.ones(1, 2, dtype=torch.bool))  # refused: binds nothing
    h = x[:, :1] + first(x[:, :1], cache=shared)
    with pytest.raises(ValueError, match="another attention module's keys and values"):
        second(h, cache=shared)
    caches = DynamicLayerCache(), DynamicLayerCache()
    steps = []
    for t in range(3):
        h = x[:, t : t + 1] + first(x[:, t : t + 1], cache=caches[0])
        steps.append(second(h, cache=caches[1]))
    torch.testing.assert_close(torch.cat(steps, 1), second(x + first(x)))


def test_a_cache_whose_module_is_gone_serves_no_other(monkeypatch):
    """The cache recorded its module by id(): once that module was freed, a new module could get the same id and
    decode on the old module's keys and values (9 of 200 temporary modules in a loop). Here every module shares
    one id, as a freed module's and its successor's do: the second module is still refused."""
    from gbattn.attention import core
    from gbattn.attention.core import DynamicLayerCache

    monkeypatch.setattr(core, "id", lambda obj: 0, raising=False)  # core's id(), as when ids are reused
    x = torch.randn(1, 2, D)
    cache = DynamicLayerCache()
    build_attention("standard", AttnArgs(d_model=D, n_heads=4))(x, cache=cache)
    with pytest.raises(ValueError, match="another attention module's keys and values"):
        build_attention("standard", AttnArgs(d_model=D, n_heads=4))(x, cache=cache)


@torch.no_grad()
def test_a_cache_deep_copied_with_its_module_serves_the_copy():
    """A cache copied alone still serves its module (a branch of the decoding); a module and its cache copied
    together in one deep copy, the module first, decode on as the original (the owner check refused the copy).
    A pickled cache decodes on too (its module, held weakly, is not pickled)."""
    import copy
    import pickle

    from gbattn.attention.core import DynamicLayerCache

    attn = build_attention("boosted", AttnArgs(d_model=D, n_heads=4)).eval()
    x = torch.randn(1, 4, D)
    cache = DynamicLayerCache()
    attn(x[:, :3], cache=cache)
    expected = attn(x)[:, 3:]
    torch.testing.assert_close(attn(x[:, 3:], cache=copy.deepcopy(cache)), expected)
    module_copy, cache_copy = copy.deepcopy((attn, cache))
    torch.testing.assert_close(module_copy(x[:, 3:], cache=cache_copy), expected)
    with pytest.raises(ValueError, match="another attention module's keys and values"):
        module_copy(x[:, 3:], cache=copy.deepcopy(cache))  # a copy of the original's cache: another module's
    torch.testing.assert_close(attn(x[:, 3:], cache=pickle.loads(pickle.dumps(cache))), expected)  # pickled too


def test_a_cache_filled_with_autograd_on_deep_copies_as_it_pickles():
    """A cache filled outside ``torch.no_grad()`` holds keys and values with an autograd graph, and its deep copy
    (alone or with its module) was torch's "Only Tensors created explicitly by the user (graph leaves) support the
    deepcopy protocol"; pickled, it decoded on. The copy holds the values, as a pickled one does."""
    import copy

    from gbattn.attention.core import DynamicLayerCache

    attn = build_attention("boosted", AttnArgs(d_model=D, n_heads=4)).eval()
    x = torch.randn(1, 4, D)
    cache = DynamicLayerCache()
    attn(x[:, :3], cache=cache)
    assert cache.entries["kv0"][0].grad_fn is not None  # (what the test is about)
    expected = attn(x)[:, 3:]
    torch.testing.assert_close(attn(x[:, 3:], cache=copy.deepcopy(cache)), expected)
    module_copy, cache_copy = copy.deepcopy((attn, cache))
    assert all(t.grad_fn is None for pair in cache_copy.entries.values() for t in pair)
    torch.testing.assert_close(module_copy(x[:, 3:], cache=cache_copy), expected)


def test_queries_default_to_the_last_slots_of_the_keys():
    """A context with T queries over S > T keys and no slots: query t sits in slot S - T + t and sees
    keys 0 .. S - T + t (the docstring's default), as with those slots given explicitly."""
    from gbattn.attention.core import AttnContext

    ctx = AttnContext(T=2, S=5, device=torch.device("cpu"))
    expected = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])
    assert torch.equal(ctx.mask()[0, 0], expected)
    explicit = AttnContext(T=2, S=5, device=torch.device("cpu"), slots_T=torch.tensor([3, 4]))
    assert torch.equal(explicit.mask(), ctx.mask())
    assert torch.equal(ctx.chunk(1, 2).mask()[0, 0], expected[1:])


def test_no_attention_dropout_in_eval_mode(variant_case):
    """A module built with dropout gives, in eval mode, the reference's dropout-free output on both
    paths."""
    name, opts = variant_case
    attn = make(variant_case, dropout=0.5).eval()
    x = torch.randn(B, T, D, dtype=torch.float64)
    y_ref = REFERENCES[name](attn.state_dict(), x, RefSpec(4, 4, opts, layer_idx=1, n_layers=2))
    for naive in (False, True):
        torch.testing.assert_close(attn(x, naive=naive), y_ref, rtol=1e-10, atol=1e-10)


def test_differential_refuses_an_odd_number_of_kv_heads():
    with pytest.raises(ValueError, match="n_kv_heads \\(1\\) must be even"):
        build_attention("differential", AttnArgs(d_model=D, n_heads=4, n_kv_heads=1))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_build_attention_refuses_what_a_model_config_refuses(name):
    """A module built on its own is checked as ModelConfig checks a model: a head width that does not
    divide d_model (standard computed with 28 of 30 columns, GBA failed inside), K/V heads that do
    not divide the query heads and RoPE on an odd head width were torch errors from inside forward."""
    with pytest.raises(ConfigError, match="d_model=30 is not divisible by n_heads=4"):
        build_attention(name, AttnArgs(d_model=30, n_heads=4))
    with pytest.raises(ConfigError, match="n_kv_heads=4 must divide n_heads=6"):
        build_attention(name, AttnArgs(d_model=24, n_heads=6, n_kv_heads=4))
    with pytest.raises(ConfigError, match="rope_base needs an even head width; d_model/n_heads = 15"):
        build_attention(name, AttnArgs(d_model=30, n_heads=2, rope_base=1e4))
    # n_kv_heads=0 was read as "None" (every head its own K/V), -2 kept; n_heads 0 and d_model 0 were a
    # ZeroDivisionError, dropout 1.5 torch's error at the first call, rope_base 0 accepted.
    for field_, value, message in (("n_kv_heads", 0, "n_kv_heads=0 must be an integer >= 1"),
                                   ("n_kv_heads", -2, "n_kv_heads=-2 must be an integer >= 1"),
                                   ("n_heads", 0, "n_heads=0 must be an integer >= 1"),
                                   ("d_model", 0, "d_model=0 must be an integer >= 1"),
                                   ("dropout", 1.5, r"dropout=1\.5 must be in \[0, 1\)"),
                                   ("dropout", 1.0, r"dropout=1\.0 must be in \[0, 1\)"),  # every probability dropped
                                   ("dropout", -0.1, r"dropout=-0\.1 must be in \[0, 1\)"),  # torch's error in training
                                   ("rope_base", 0.0, r"rope_base=0\.0 must be > 0"),
                                   ("layer_idx", -1, "layer_idx=-1 must be an integer >= 0"),
                                   ("n_layers", 0, "n_layers=0 must be an integer >= 1"),
                                   # a string was a TypeError from a comparison; bias="no" (or 0) built the
                                   # biases it meant to leave out, and rope_base=inf was accepted
                                   ("dropout", "0.1", r"dropout='0\.1' must be a number"),
                                   ("rope_base", "1e4", r"rope_base='1e4' must be"),
                                   ("rope_base", math.inf, r"rope_base=inf must be a number or null"),
                                   ("bias", "no", r"bias='no' must be true or false"),
                                   ("bias", 0, r"bias=0 must be true or false")):
        with pytest.raises(ConfigError, match=message):
            build_attention(name, dataclasses.replace(AttnArgs(d_model=32, n_heads=4), **{field_: value}))
    with pytest.raises(ConfigError, match=r"args of type dict: give an AttnArgs\(d_model=\.\.\., n_heads=\.\.\.\)"):
        build_attention(name, {"d_model": 32, "n_heads": 4})  # was "'dict' object has no attribute 'd_model'"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_module_on_its_own_names_a_misshapen_input_or_mask(name):
    """An input without its batch axis or of another width, and a key_padding_mask of another batch
    or without its batch axis, were torch's shape errors (or "not enough values to unpack")."""
    attn = build_attention(name, AttnArgs(d_model=D, n_heads=4))
    x = torch.randn(2, 5, D)
    for bad in (x[0], torch.randn(2, 5, D // 2)):
        with pytest.raises(ValueError, match=rf"input of shape \({', '.join(map(str, bad.shape))},?\): expected "
                                             rf"\(batch, tokens, d_model={D}\)"):
            attn(bad)
    for shape in ((3, 5), (5,)):  # another number of tokens: test_a_padding_mask_of_another_width_is_refused
        bad = torch.ones(shape, dtype=torch.bool)
        with pytest.raises(ValueError, match=r"key_padding_mask of shape .* over 5 key slots: expected \(2, 5\)"):
            attn(x, causal=False, key_padding_mask=bad)
    one = torch.ones(1, 5, dtype=torch.bool)  # one row for every row, as broadcasting gives
    torch.testing.assert_close(attn(x, causal=False, key_padding_mask=one), attn(x, causal=False))


def test_a_module_on_its_own_names_a_tensor_on_another_device():
    """An input, a key_padding_mask or positions on another device than the module's (here the meta device, the
    one other device every machine has) were torch's "Tensor on device meta is not on the expected device cpu!",
    and a mask on another device under causal=False reached SDPA, which read it as garbage: outputs near 1e31."""
    attn = build_attention("boosted", AttnArgs(d_model=D, n_heads=4, rope_base=100.0))
    x = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match=r"^input on meta for a module on cpu: give it on cpu"):
        attn(x.to("meta"))
    mask = torch.ones(2, 5, dtype=torch.bool, device="meta")
    for causal in (True, False):
        with pytest.raises(ValueError, match=r"^key_padding_mask on meta for an input on cpu: give it on cpu"):
            attn(x, causal=causal, key_padding_mask=mask)
    with pytest.raises(ValueError, match=r"^positions on meta for an input on cpu: give it on cpu"):
        attn(x, positions=torch.arange(5, device="meta"))
    meta_attn = build_attention("boosted", AttnArgs(d_model=D, n_heads=4)).to("meta")  # (all on meta: shapes only)
    assert meta_attn(x.to("meta"), causal=False, key_padding_mask=mask).shape == x.shape


def test_rope_positions_of_another_length_are_refused():
    """RoPE positions of another length than the input were a broadcasting error inside RoPE; float or bool ones
    were accepted as positions."""
    x = torch.randn(2, 5, D)
    rope = build_attention("boosted", AttnArgs(d_model=D, n_heads=4, rope_base=1e4))
    # (3, 5): the right length for another batch was a broadcasting error inside RoPE
    for bad in (torch.arange(4), torch.arange(10).view(2, 5)[:, :4], torch.arange(5).expand(3, 5)):
        with pytest.raises(ValueError, match=r"positions of shape .*: expected \(5,\) or \(2, 5\)"):
            rope(x, positions=bad)
    for bad in (torch.arange(5) + 0.5, torch.ones(2, 5, dtype=torch.bool)):  # were rotated by 0.5 .. 4.5, or by 0/1
        with pytest.raises(ValueError, match=rf"positions of dtype {bad.dtype}: expected integers \(torch\.long\)"):
            rope(x, positions=bad)
    rows = torch.arange(5).expand(2, 5)
    torch.testing.assert_close(rope(x, positions=rows), rope(x), rtol=0, atol=0)
    torch.testing.assert_close(rope(x, positions=torch.arange(5)[None]), rope(x), rtol=0, atol=0)  # one row for all


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_tables_of_a_low_precision_model_round_exact_angles_once(dtype):
    """cos and sin at every position are the float64 values rounded once to the model's dtype: angles formed
    in bfloat16 would round position 2047 to 2048 (and float16's large angles by several radians), turning
    a long context's far tokens, silently. Per row, (B, T) positions give the (T,) tables."""
    from gbattn.attention.core import rope_for

    positions = torch.arange(0, 4096, 3)
    exact = rope_for(positions, 16, 10000.0, torch.float64)
    cos, sin = rope_for(positions, 16, 10000.0, dtype)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (len(positions), 16)
    torch.testing.assert_close(cos, exact[0].to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(sin, exact[1].to(dtype), rtol=0, atol=0)
    rows_cos, rows_sin = rope_for(positions.expand(2, -1), 16, 10000.0, dtype)
    assert rows_cos.shape == (2, 1, len(positions), 16)
    assert torch.equal(rows_cos[1, 0], cos) and torch.equal(rows_sin[0, 0], sin)


def test_positions_for_a_module_without_rope_are_refused():
    """RoPE positions given to a module built without ``rope_base`` were ignored, silently: the
    caller's positions changed nothing and no error said the module had no RoPE."""
    x = torch.randn(2, 5, D)
    plain = build_attention("boosted", AttnArgs(d_model=D, n_heads=4))
    with pytest.raises(ValueError, match=r"positions are for RoPE, which this module does not use: build it with "
                                         r"AttnArgs\(rope_base=\.\.\.\)"):
        plain(x, positions=torch.arange(5) + 3)


@pytest.mark.filterwarnings("error:Mismatch dtype between input and weight")  # differential's RMSNorm
@pytest.mark.parametrize("name", list(VARIANTS))
def test_an_input_of_another_dtype_than_the_module_is_named(name):
    """Token ids or float64 activations given to a float32 module (or float32 ones to a module moved
    to float64) were torch's "mat1 and mat2 must have the same dtype" from inside a projection.
    Under autocast a float32 module takes bfloat16 activations, as before."""
    attn = build_attention(name, AttnArgs(d_model=D, n_heads=4))
    x = torch.randn(2, 5, D)
    for bad, module in ((x.double(), attn), (x.long(), attn), (x, copy.deepcopy(attn).double())):
        weights = next(module.parameters()).dtype
        with pytest.raises(ValueError, match=rf"input of dtype {bad.dtype} for a module whose parameters are "
                                             rf"{weights}: give {weights} activations"):
            module(bad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn(x.bfloat16()).dtype == torch.bfloat16
        with pytest.raises(ValueError, match=r"input of dtype torch\.int64 for a module whose parameters are "
                                             r"torch\.float32"):
            attn(x.long())  # token ids: autocast casts no integers (was a dtype error from inside a projection)


def test_a_row_of_padding_only_attends_to_nothing(variant_case):
    """A row whose keys are all padding (README, "Using gbattn from Python"): each of its attention
    maps is all zeros on both paths (as SDPA gives), its output and every gradient are finite, and
    the other rows are what they are alone."""
    attn = make(variant_case, "gqa-rope" if variant_case[0] != "differential" else "mha")
    x = torch.randn(2, 6, D, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0] = False
    fast = attn(x, causal=False, key_padding_mask=keep)
    naive, record = attn(x, causal=False, key_padding_mask=keep, return_intermediates=True)
    torch.testing.assert_close(fast, naive, rtol=1e-10, atol=1e-10)
    assert all(r.probs_BHTS[0].abs().max() == 0 for r in record.rounds if r.probs_BHTS is not None)
    torch.testing.assert_close(fast[1:], attn(x[1:], causal=False), rtol=1e-10, atol=1e-10)
    fast.sum().backward()
    assert torch.isfinite(fast).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters() if p.grad is not None)


@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_an_empty_batch_or_sequence_gives_an_empty_output(variant_case, naive):
    """A module used on its own maps no rows or no tokens to no outputs, as torch's layers do; the mlp gate's fast
    path divided by zero (ZeroDivisionError in its chunked entropy)."""
    name, opts = variant_case
    attn = build_attention(name, AttnArgs(d_model=16, n_heads=4, n_kv_heads=2), opts)
    for shape in ((0, 5, 16), (2, 0, 16)):
        assert attn(torch.randn(shape), naive=naive).shape == shape


def test_causal_takes_true_or_false_only():
    """causal=None (a wrapper's unset default passed on) read as False and gave bidirectional attention, silently;
    a string such as "False" read as True."""
    attn = build_attention("standard", AttnArgs(d_model=8, n_heads=2))
    x = torch.randn(1, 4, 8)
    for bad in (None, "False", 0):
        with pytest.raises(ValueError, match=rf"^causal={bad!r} must be true or false$"):
            attn(x, causal=bad)
    assert not torch.equal(attn(x, causal=False), attn(x, causal=True))
    # naive and return_intermediates too, of a module and of a model ("no" was true: a (y, record) tuple came
    # back, or the reference path ran, silently)
    from gbattn import GPT, ModelConfig

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=8, n_layers=1, n_heads=2, dropout=0.0))
    ids = torch.randint(0, 11, (1, 4))
    for call in (lambda **kw: attn(x, **kw), lambda **kw: model(ids, **kw)):
        for name in ("naive", "return_intermediates"):
            for bad in (None, "no", 0):
                with pytest.raises(ValueError, match=rf"^{name}={bad!r} must be true or false$"):
                    call(**{name: bad})
        assert isinstance(call(return_intermediates=True), tuple) and torch.is_tensor(call(naive=True))


def test_a_float_padding_mask_is_refused():
    """A float mask read as bool turned nn.MultiheadAttention's additive convention (0 = keep,
    -inf = padding) into its inverse: the padding was attended and the real tokens hidden, silently.
    Bool and integer masks agree."""
    attn = make(("boosted", {"rounds": 2}))
    x = torch.randn(B, T, D, dtype=torch.float64)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, -2:] = False
    additive = torch.zeros(B, T).masked_fill(~keep, float("-inf"))
    for mask in (additive, keep.double()):
        with pytest.raises(ValueError, match=r"key_padding_mask of dtype torch\.float\w*: give a bool \(or integer\) "
                                             r"mask, True for real tokens"):
            attn(x, causal=False, key_padding_mask=mask)
    torch.testing.assert_close(attn(x, causal=False, key_padding_mask=keep.long()),
                               attn(x, causal=False, key_padding_mask=keep), rtol=0, atol=0)


def test_a_layer_past_n_layers_is_refused_where_attn_layers_counts_in_it():
    """AttnArgs(layer_idx=2, n_layers=2) with attn.layers=[-1] was built as a plain layer, silently
    (its index read modulo n_layers). Without attn.layers a layer index only sets differential
    attention's lambda schedule, and n_layers (default 1) does not bound it."""
    with pytest.raises(ConfigError, match=r"layer_idx=2 outside n_layers=2 \(layers 0\.\.1\), which "
                                          r"attn.layers=\[-1\] counts in"):
        build_attention("boosted", AttnArgs(d_model=D, n_heads=4, layer_idx=2, n_layers=2), {"layers": [-1]})
    last = build_attention("boosted", AttnArgs(d_model=D, n_heads=4, layer_idx=1, n_layers=2), {"layers": [-1]})
    assert any(n.startswith("corrections.") for n, _ in last.named_parameters())
    build_attention("differential", AttnArgs(d_model=D, n_heads=4, layer_idx=2))


def test_build_attention_names_the_variants_for_an_unknown_name():
    """It was KeyError('bogus'): the table was indexed before the name was checked."""
    with pytest.raises(ConfigError, match="attn='bogus' is not allowed; choose one of standard, boosted"):
        build_attention("bogus", AttnArgs(d_model=D, n_heads=4))
    # a misspelt variant with options is the same unknown name (not told to give 'boostd' and its options apart)
    with pytest.raises(ConfigError, match="attn='boostd:rounds=3' is not allowed; choose one of standard, boosted"):
        build_attention("boostd:rounds=3", AttnArgs(d_model=D, n_heads=4))


@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_causality(variant_case, naive):
    attn = make(variant_case, "gqa-rope" if variant_case[0] != "differential" else "mha")
    x = torch.randn(B, 9, D, dtype=torch.float64)
    t = 4
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
    y1, y2 = attn(x, naive=naive), attn(x2, naive=naive)
    torch.testing.assert_close(y1[:, : t + 1], y2[:, : t + 1], rtol=0, atol=1e-12)
    assert (y1[:, t + 1 :] - y2[:, t + 1 :]).abs().max() > 1e-6  # the change is seen later on


@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_left_padding_is_hidden_and_matters(variant_case, naive):
    """Changing the padding tokens changes no real output; and the mask does something: without it
    the same inputs give other outputs at the real positions of the padded row."""
    attn = make(variant_case)
    keep, _ = left_padded()
    x = torch.randn(B, T, D, dtype=torch.float64)
    x2 = x.clone()
    x2[0, :2] += 3.0
    y1 = attn(x, key_padding_mask=keep, naive=naive)
    y2 = attn(x2, key_padding_mask=keep, naive=naive)
    torch.testing.assert_close(y1[keep], y2[keep], rtol=0, atol=1e-12)
    assert (attn(x, naive=naive)[0, 2:] - y1[0, 2:]).abs().max() > 1e-6


def test_non_causal_with_padding_equals_reference(variant_case):
    """causal=False (a bidirectional encoder) with a key padding mask."""
    name, opts = variant_case
    attn = make(variant_case)
    keep, _ = left_padded()
    x = torch.randn(B, T, D, dtype=torch.float64)
    spec = RefSpec(4, 4, opts, layer_idx=1, n_layers=2, causal=False, key_padding_BT=keep)
    y_ref = REFERENCES[name](attn.state_dict(), x, spec)
    for naive in (False, True):
        torch.testing.assert_close(attn(x, key_padding_mask=keep, causal=False, naive=naive), y_ref, rtol=1e-10,
                                   atol=1e-10)


def test_fast_matches_naive_with_dropout_on_cpu(variant_case):
    """Both paths draw the same dropout masks for the same RNG state on CPU, and dropout does
    something."""
    attn = make(variant_case, dropout=0.3).train()
    x = torch.randn(B, 6, D, dtype=torch.float64)
    torch.manual_seed(7)
    y_fast = attn(x)
    torch.manual_seed(7)
    y_naive = attn(x, naive=True)
    torch.testing.assert_close(y_fast, y_naive, rtol=1e-10, atol=1e-10)
    assert (y_fast - attn.eval()(x)).abs().max() > 1e-6


def test_twicing_uses_one_dropout_mask_for_both_products():
    """With dropout, A is dropped out once: 2 (A' V) - A' (A' V) for one mask A' (Twicing's
    definition), which a second independent mask would not give."""
    attn = make(("twicing", {}), dropout=0.5).train()
    x = torch.randn(1, 5, D, dtype=torch.float64)
    torch.manual_seed(3)
    y, record = attn(x, return_intermediates=True)
    first, second = record.rounds
    # Recover the dropped-out A' from the first product: A' V = first.output; the same A' gives the second.
    q, k, v = (attn.qkv(x)[..., i * D : (i + 1) * D] for i in range(3))
    torch.manual_seed(3)
    A = torch.softmax((q.view(1, 5, 4, 4).transpose(1, 2) @ k.view(1, 5, 4, 4).transpose(1, 2).transpose(-1, -2)) / 2
                      + torch.full((5, 5), float("-inf")).triu(1), -1)
    dropped = torch.nn.functional.dropout(A, 0.5)
    av = dropped @ v.view(1, 5, 4, 4).transpose(1, 2)
    torch.testing.assert_close(first.output_BTD, av.transpose(1, 2).reshape(1, 5, D))
    torch.testing.assert_close(second.output_BTD, (dropped @ av).transpose(1, 2).reshape(1, 5, D))


def test_same_seed_same_output(variant_case):
    """Construction draws its parameters from the global RNG only: the same seed gives the same
    module (and output), another seed another."""
    x = torch.randn(2, 5, D)
    name, opts = variant_case
    args = AttnArgs(d_model=D, n_heads=4, n_kv_heads=4, dropout=0.0, bias=True, layer_idx=1, n_layers=2)

    def built(seed):
        torch.manual_seed(seed)
        return build_attention(name, args, opts)

    a, b, c = built(3), built(3), built(4)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert not torch.equal(a(x), c(x))


EXPECTED_KINDS = {
    "standard": ["attention"],
    "twicing": ["attention", "second-pass"],
    "gated": ["attention"],
    "differential": ["attention", "negative-map"],
}


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_record_schema_and_consistency(variant_case, layer_idx):
    """The record's kinds per variant (a ``layers`` variant is plain attention outside its layers:
    the shared cases choose layer 1 of 2), its maps equal the reference's explicit attention
    matrix, and its rounds rebuild the layer's output."""
    name, opts = variant_case
    attn = make(variant_case, layer_idx=layer_idx)
    x = torch.randn(B, T, D, dtype=torch.float64)
    y, record = attn(x, return_intermediates=True)
    kinds = [r.kind for r in record.rounds]
    assert record.of_kind(*set(kinds)) == record.rounds and record.of_kind("no-such-kind") == []
    chosen = opts.get("layers") is None or layer_idx == 1
    if name == "boosted":
        rounds = opts.get("rounds", 2) if chosen else 1
        assert kinds == ["attention"] + ["correction"] * (rounds - 1)
    elif name == "twicing" and not chosen:
        assert kinds == ["attention"]
    else:
        assert name in EXPECTED_KINDS, f"a new variant {name!r}: add its record's kinds to EXPECTED_KINDS (README)"
        assert kinds == EXPECTED_KINDS[name]
    for r in record.rounds:
        assert r.output_BTD.shape == (B, T, D)
        assert r.entropy_BHT.shape == r.probs_BHTS.shape[:3]
    # Each round's map == the matrix the reference forms for it (differential: one per head pair,
    # positive then negative; Twicing's second pass reuses A).
    spec = RefSpec(4, 4, opts, layer_idx=layer_idx, n_layers=2, maps=[])
    REFERENCES[name](attn.state_dict(), x, spec)
    if name == "differential":
        expected = [torch.cat(spec.maps[0::2], dim=1), torch.cat(spec.maps[1::2], dim=1)]
    elif name == "twicing":
        expected = spec.maps * len(record.rounds)
    else:
        expected = spec.maps
    assert len(expected) == len(record.rounds)
    for r, probs_BHTS in zip(record.rounds, expected):
        torch.testing.assert_close(r.probs_BHTS, probs_BHTS, rtol=1e-10, atol=1e-12, msg=lambda m, k=r.kind: f"{k} {m}")
    out = attn.out
    if name == "boosted":
        F = record.rounds[0].output_BTD
        for c in record.of_kind("correction"):
            torch.testing.assert_close(c.residual_BTD, x - F)
            F = F + c.gate * c.output_BTD
        torch.testing.assert_close(out(F), y)
    elif name == "twicing" and len(record.rounds) == 2:
        torch.testing.assert_close(out(2 * record.rounds[0].output_BTD - record.rounds[1].output_BTD), y)
    elif name in ("standard", "twicing"):
        torch.testing.assert_close(out(record.rounds[0].output_BTD), y)
    elif name == "gated":
        g = record.rounds[0].gate
        o = record.rounds[0].output_BTD
        gated_o = o * g if g.shape[-1] == D else (o.view(B, T, 4, 4) * g[..., None]).reshape(B, T, D)
        torch.testing.assert_close(out(gated_o), y)
    else:
        assert name == "differential", f"a new variant {name!r}: say how its rounds rebuild its output, here"
        pos, neg = (r.output_BTD.view(B, T, 2, 8) for r in record.rounds)
        o = attn.subln(pos - attn.lambda_full() * neg) * (1 - attn.lambda_init)
        torch.testing.assert_close(out(o.reshape(B, T, D)), y)


# ---- the core's two paths, its calling convention and its refusals ---------------------

# Contexts a model or a module used on its own builds: (T, S, query slots or None for the default last T
# of S, key padding (B, S) or None, causal).
CORE_CONTEXTS = {
    "default-last-slots": (3, 7, None, None, True),
    "prefill-slots-of-a-longer-cache": (3, 7, [0, 1, 2], None, True),
    "slots-out-of-order": (4, 4, [3, 0, 2, 1], None, True),
    "left-padded-decode": (1, 6, [5], [[False, False, True, True, True, True], [True] * 6], True),
    "non-causal-over-more-keys": (3, 7, None, None, False),
}


@pytest.mark.parametrize("context", CORE_CONTEXTS)
def test_fast_path_equals_explicit_attention_in_every_context(context):
    """The fast path (SDPA, ``is_causal`` only where it is exactly the mask) and the reference path both
    equal masked softmax attention written out: query t in slot s_t sees the real keys in slots up to s_t;
    with grouped K/V heads (query head h uses K/V head h // 2) and values twice the query width."""
    from gbattn.attention.core import AttnContext, fast_path, reference_path

    T, S, slots, padding, causal = CORE_CONTEXTS[context]
    q = torch.randn(B, 4, T, 3, dtype=torch.float64)
    k = torch.randn(B, 2, S, 3, dtype=torch.float64)
    v = torch.randn(B, 2, S, 6, dtype=torch.float64)
    slots_T = torch.tensor(slots) if slots is not None else torch.arange(S - T, S)
    keep = torch.tensor(padding) if padding is not None else None
    ctx = AttnContext(T=T, S=S, device=torch.device("cpu"), slots_T=None if slots is None else slots_T,
                      key_padding_BS=keep, causal=causal)
    seen = torch.ones(B, 1, T, S, dtype=torch.bool)
    if causal:
        seen &= (torch.arange(S)[None, :] <= slots_T[:, None])[None, None]
    if keep is not None:
        seen &= keep[:, None, None, :]
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.7).masked_fill(~seen, float("-inf"))
    expected = scores.softmax(-1) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(fast_path(q, k, v, ctx, 0.0, 0.7), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference_path(q, k, v, ctx, 0.0, 0.7)[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("naive", [False, True], ids=["fast", "naive"])
def test_attend_uses_an_explicit_scale(naive):
    """``Call.attend(..., scale=s)`` scores with s, not the module's 1/sqrt(E), on both paths; so does the entropy of
    its map after it (the fast path recomputed it with the module's scale: 1.18 for 1.22)."""
    from gbattn.attention.core import AttnContext, Call

    attn = make(("standard", {}))
    q, k, v = (torch.randn(B, 4, T, 4, dtype=torch.float64) for _ in range(3))
    ctx = AttnContext(T=T, S=T, device=torch.device("cpu"), naive=naive)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    call = Call(attn, ctx)
    torch.testing.assert_close(call.attend(q, k, v, scale=0.3), scores.softmax(-1) @ v, rtol=1e-12, atol=1e-12)
    p = scores.softmax(-1)
    expected_entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    torch.testing.assert_close(call.entropy(q, k), expected_entropy, rtol=1e-10, atol=1e-12)


def test_naive_takes_the_reference_path_and_the_default_the_fused_one(variant_case, monkeypatch):
    """``naive=True`` forms explicit T x S maps (SDPA never called, also with padding and without
    causality); the default calls SDPA once per attention map of the layer."""
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    attn = make(variant_case)
    keep, _ = left_padded()
    x = torch.randn(B, T, D, dtype=torch.float64)
    attn(x, naive=True)
    attn(x, key_padding_mask=keep, causal=False, naive=True)
    maps = len(attn(x, return_intermediates=True)[1].rounds)
    assert calls == []
    attn(x)
    assert len(calls) == maps


def test_a_record_passed_in_is_filled_and_returned():
    """A model passes each layer's own :class:`Record`; with ``return_intermediates`` too, that record
    (not a new one) is filled and returned."""
    from gbattn.attention import Record

    attn = make(("twicing", {}))
    record = Record()
    _, returned = attn(torch.randn(B, T, D, dtype=torch.float64), record=record, return_intermediates=True)
    assert returned is record and [r.kind for r in record.rounds] == ["attention", "second-pass"]


def test_a_padding_mask_of_another_shape_gets_one_line_from_a_module_and_from_a_model():
    """The mask's shape was checked in three places with three lines (the module's batch check, its context's
    "key_padding_mask has 5 keys, expected 7", the model's own): now one check, the same line from both."""
    from gbattn import GPT, preset_config

    attn = make(("standard", {}))
    with pytest.raises(ValueError, match=r"^key_padding_mask of shape \(2, 5\) for a batch of 2 over 7 key slots: "
                                         r"expected \(2, 7\), True for real tokens$"):
        attn(torch.randn(B, T, D, dtype=torch.float64), key_padding_mask=torch.ones(B, 5, dtype=torch.bool))
    model = GPT(preset_config("cpu-char", "standard"))
    idx = torch.randint(0, 60, (B, T))
    for shape in ((B, 5), (B + 1, T), (B, T, 1), (T,)):
        lines = []
        for call in (lambda mask: attn(torch.randn(B, T, D, dtype=torch.float64), key_padding_mask=mask),
                     lambda mask: model(idx, key_padding_mask=mask)):
            with pytest.raises(ValueError) as caught:
                call(torch.ones(shape, dtype=torch.bool))
            lines.append(str(caught.value))
        assert lines[0] == lines[1], lines


@pytest.mark.parametrize("layers, n_layers", [([2], 2), ([-3], 2), ([0, 3], 3), ([-4, 0], 3)])
def test_layers_outside_the_model_are_refused_at_both_ends(layers, n_layers):
    """``attn.layers`` indices run from -n_layers to n_layers - 1: the first index past either end is refused,
    by the option check and by ``build_attention`` (which checks the layer count in its AttnArgs)."""
    with pytest.raises(ConfigError, match=r"outside the model's"):
        variant_options("boosted", {"layers": layers}, n_layers=n_layers)
    with pytest.raises(ConfigError, match=r"outside the model's"):
        build_attention("twicing", AttnArgs(d_model=D, n_heads=4, n_layers=n_layers), {"layers": layers})


@pytest.mark.parametrize("layers, repeated", [([1, 1], r"\[1\]"), ([1, -3], r"\[1\]"), ([0, -4, 2, 2], r"\[0, 2\]")])
def test_a_layer_named_twice_in_layers_is_refused(layers, repeated):
    """``attn.layers`` names each layer once: a repeat (directly or by its negative index) is most likely a typo for
    another layer, which would silently be left as it is."""
    with pytest.raises(ConfigError, match=rf"names layer\(s\) {repeated} more than once"):
        variant_options("boosted", {"layers": layers}, n_layers=4)
    with pytest.raises(ConfigError, match=r"more than once"):
        build_attention("twicing", AttnArgs(d_model=D, n_heads=4, n_layers=4), {"layers": layers})


@pytest.mark.parametrize("kv_source", ["residual", "input", "shared"])
def test_a_layer_outside_the_chosen_layers_has_a_standard_layers_parameters(kv_source):
    """A boosted layer outside attn.layers is standard attention in its parameters too (names and shapes): with
    kv_source=input its fused projection sized by the option's rounds, not the layer's, carried rows that
    never had a gradient, and counted them."""
    args = AttnArgs(d_model=D, n_heads=4, n_kv_heads=2, layer_idx=0, n_layers=2)
    outside = build_attention("boosted", args, {"rounds": 3, "kv_source": kv_source, "layers": [-1]})
    standard = build_attention("standard", args)
    assert outside.rounds == 1
    assert {n: p.shape for n, p in outside.named_parameters()} == {n: p.shape for n, p in standard.named_parameters()}


def test_empty_layers_is_no_layer_for_boosted_and_twicing():
    """attn.layers=[] names no layer (an upcycle with it is a copy): every layer plain attention, not every layer."""
    for name in ("boosted", "twicing"):
        built = [build_attention(name, AttnArgs(d_model=D, n_heads=4, layer_idx=i, n_layers=2), {"layers": []})
                 for i in range(2)]
        x = torch.randn(B, T, D)
        for attn in built:
            plain = build_attention("standard", attn.args)
            plain.load_state_dict(attn.state_dict())
            torch.testing.assert_close(attn(x), plain(x), rtol=0, atol=0)


def test_layers_at_both_ends_of_the_model_are_accepted():
    assert variant_options("boosted", {"layers": [-2, 1]}, n_layers=2).layers == [-2, 1]
    built = [build_attention("boosted", AttnArgs(d_model=D, n_heads=4, layer_idx=i, n_layers=3), {"layers": [-3, 2]})
             for i in range(3)]
    assert [attn.rounds for attn in built] == [2, 1, 2]


def test_an_option_given_to_a_variant_without_options_names_none():
    """... and the variants it is an option of: `train --set attn.rounds=3` (train --help's example) without
    `--attn boosted` said only that standard attention has no options."""
    with pytest.raises(ConfigError, match=r"has no option\(s\) \['rounds'\] \(rounds is an option of boosted\); "
                                          r"its options are: none$"):
        variant_options("standard", {"rounds": 2})
    with pytest.raises(ConfigError, match=r"\['layers', 'mode'\] \(layers is an option of boosted and twicing; mode "
                                          r"is an option of gated\); its options are: none$"):
        variant_options("differential", {"layers": [0], "mode": "headwise"})
    with pytest.raises(ConfigError, match=r"\['colour'\]; its options are: mode$"):
        variant_options("gated", {"colour": 1})


def test_gate_hidden_without_the_mlp_gate_is_refused():
    """`--set attn.gate_hidden=64` with the default linear gate was accepted and built the same model as without it."""
    with pytest.raises(ConfigError, match=r"attn.gate_hidden=64 is the mlp gate's width; attn.gate='linear' has none"):
        variant_options("boosted", {"gate_hidden": 64})
    assert variant_options("boosted", {"gate": "mlp", "gate_hidden": 64}).gate_hidden == 64
    # bounded as ffn_hidden is: 10**17 was torch's "Storage size calculation overflowed" traceback
    assert variant_options("boosted", {"gate": "mlp", "gate_hidden": 2**24}).gate_hidden == 2**24
    with pytest.raises(ConfigError, match=r"gate_hidden=16777217 must be an integer in \[1, 16777216\]"):
        variant_options("boosted", {"gate": "mlp", "gate_hidden": 2**24 + 1})
    assert variant_options("boosted", {"gate": "vector", "gate_hidden": 32}).gate == "vector"  # the default: no change


def test_the_scalar_gate_starts_at_its_logit_and_the_option_needs_that_gate():
    """attn.scalar_gate_logit sets every round's scalar gate a at init (the authors' 0.5 by default: a gate of
    sigmoid(0.5) = 0.62; 0 starts it at 0.5, docs/deviations.md entry 13); with another gate it is refused."""
    from gbattn.attention.boosted import ScalarGate
    from gbattn.config import ModelConfig
    from gbattn.model import GPT

    def gates(**options):
        cfg = ModelConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=2, d_model=8, attn="boosted",
                          attn_options={"gate": "scalar", "rounds": 3, **options})
        return [m.logit.item() for m in GPT(cfg).modules() if isinstance(m, ScalarGate)]

    assert gates() == [0.5] * 4 and gates(scalar_gate_logit=0) == [0.0] * 4
    assert math.isclose(torch.sigmoid(torch.tensor(0.5)).item(), 0.6225, abs_tol=1e-4)
    with pytest.raises(ConfigError, match=r"attn.scalar_gate_logit=0.0 starts the scalar gate; attn.gate='vector' "
                                          r"is another"):
        variant_options("boosted", {"gate": "vector", "scalar_gate_logit": 0})
    # one past float32's range was a RuntimeError traceback from the init ("cannot be converted ... overflow")
    assert gates(scalar_gate_logit=-100) == [-100.0] * 4 and gates(scalar_gate_logit=100) == [100.0] * 4  # (both ends)
    for logit in (1e39, -1e300, 100.5):
        with pytest.raises(ConfigError, match=rf"^attn.scalar_gate_logit={re.escape(repr(logit))} must be in "
                                              r"\[-100, 100\]$"):
            variant_options("boosted", {"gate": "scalar", "scalar_gate_logit": logit})


def test_options_that_are_not_a_dict_are_refused_in_one_line():
    """An options record (BoostedOptions(rounds=3)) or a list was "'BoostedOptions' object is not iterable" (a
    TypeError from inside): now a ConfigError that says to give a dict."""
    from gbattn.attention.boosted import BoostedOptions

    for options in (BoostedOptions(rounds=3), ["rounds", 3]):
        with pytest.raises(ConfigError, match=f"options of type {type(options).__name__}: give the variant's options "
                                              f"as a dict"):
            build_attention("boosted", AttnArgs(d_model=D, n_heads=4), options)
    assert build_attention("boosted", AttnArgs(d_model=D, n_heads=4), {"rounds": 3}).rounds == 3


def test_describe_variants_gives_each_module_docstring_and_option_defaults():
    """What ``gbattn list`` prints: the first line of each variant's module docstring, and its options."""
    rows = {row["name"]: row for row in describe_variants()}
    assert list(rows) == list(VARIANTS)
    assert rows["standard"]["description"] == "Standard multi-head causal softmax attention (docs/baselines.md)."
    assert rows["standard"]["options"] == {} and rows["differential"]["options"] == {}
    assert rows["boosted"]["options"] == {"rounds": 2, "gate": "linear", "kv_source": "residual", "gate_hidden": 32,
                                          "layers": None, "scalar_gate_logit": 0.5}
    assert rows["gated"]["options"] == {"mode": "elementwise"}
    # the words an option takes, which `gbattn list` gives beside its default (the README alone listed them)
    assert rows["boosted"]["choices"] == {"gate": ["linear", "mlp", "vector", "scalar", "tanh", "none"],
                                          "kv_source": ["residual", "input", "shared"]}
    assert rows["gated"]["choices"] == {"mode": ["elementwise", "headwise"]} and rows["twicing"]["choices"] == {}


def test_differential_lambda_vectors_are_redrawn_from_n_0_0_1():
    """``init_own_parameters`` (the Hugging Face wrapper's init) draws the four lambda vectors N(0, 0.1), as
    the constructor does: 8,000 draws have mean about 0 and standard deviation about 0.1."""
    attn = build_attention("differential", AttnArgs(d_model=32, n_heads=4))
    draws = []
    for _ in range(250):
        attn.init_own_parameters()
        draws += [p.detach().clone() for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2)]
    draws = torch.cat(draws)
    assert draws.numel() == 8000
    assert abs(draws.mean().item()) < 0.005 and abs(draws.std().item() - 0.1) < 0.005


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:`torch.jit.trace.*` is deprecated")
@pytest.mark.parametrize("heads", ["mha", "gqa-rope"])
def test_torch_jit_trace_of_a_module_gives_its_output(variant_case, heads):
    """``torch.jit.trace`` of a module was a TypeError from inside SDPA ("argument 'enable_gqa' must be bool, not
    Tensor"): under tracing the head counts are tensors, and the fast path passed their comparison on as is
    (deprecated in torch, but still how TorchScript models are made)."""
    attn = make(variant_case, heads).eval()
    x = torch.randn(B, T, D, dtype=torch.float64)
    traced = torch.jit.trace(attn, (x,))
    torch.testing.assert_close(traced(x), attn(x))


def test_a_module_prints_its_heads_and_options():
    """``print(module)`` showed only its Linear widths: not the heads, the K/V heads, nor the variant's options
    (rounds, gate, kv_source), which change what it computes. They are shown now, each as its keyword."""
    boosted = build_attention("boosted", AttnArgs(d_model=32, n_heads=4, n_kv_heads=2, dropout=0.1, layer_idx=1,
                                                  n_layers=2), {"rounds": 3, "kv_source": "shared"})
    assert repr(boosted).splitlines()[1].strip() == ("d_model=32, n_heads=4, n_kv_heads=2, dropout=0.1, layer=1 of 2, "
                                                     "rounds=3, gate=linear, kv_source=shared, gate_hidden=32, "
                                                     "layers=None, scalar_gate_logit=0.5")
    standard = build_attention("standard", AttnArgs(d_model=32, n_heads=4, rope_base=500.0))
    assert repr(standard).splitlines()[1].strip() == "d_model=32, n_heads=4, rope_base=500.0"
