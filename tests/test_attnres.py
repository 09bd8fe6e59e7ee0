"""Attention Residuals (docs/baselines.md): identities, causality, parity and caching."""

from __future__ import annotations

import pytest
import torch

from gbattn.attention.core import AttnContext
from gbattn.config import ModelConfig, preset_config
from gbattn.model import GPT, count_params
from gbattn.model.attnres import AttnResStream
from gbattn.model.params import flops_per_token
from test_model import tiny_model


def test_depth_weights_uniform_at_init():
    stream = AttnResStream(ModelConfig(d_model=16, n_heads=2, n_layers=2, residual="attnres-full"))
    sources = [torch.randn(2, 5, 16) * (i + 1) for i in range(4)]
    torch.testing.assert_close(stream.depth_weights(3, sources), torch.full((4, 2, 5), 0.25))


def test_mixing_one_source_returns_it():
    stream = AttnResStream(ModelConfig(d_model=16, n_heads=2, n_layers=2, residual="attnres-full"))
    with torch.no_grad():
        stream.queries.normal_()
    v = torch.randn(2, 5, 16)
    assert torch.equal(stream.mix(0, [v]), v)
    torch.testing.assert_close(stream.depth_weights(0, [v]), torch.ones(1, 2, 5))


def test_mix_is_softmax_weighted_sum_of_normalised_keys():
    stream = AttnResStream(ModelConfig(d_model=8, n_heads=2, n_layers=1, residual="attnres-full")).double()
    with torch.no_grad():
        stream.queries.normal_()
        stream.norms[1].weight.uniform_(0.5, 1.5)
    v = [torch.randn(1, 3, 8, dtype=torch.float64) for _ in range(3)]
    w, g = stream.queries[1], stream.norms[1].weight
    logits = torch.stack(
        [((x / torch.sqrt((x**2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)) * g) @ w for x in v]
    )
    expected = sum(a[..., None] * x for a, x in zip(torch.softmax(logits, 0), v))
    torch.testing.assert_close(stream.mix(1, v), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_depth_weights_in_half_precision_are_those_of_the_streams_own_norms(dtype):
    """In bfloat16 or float16 the depth logits are w . norms[l](v_i) with the norm module's own eps (nn.RMSNorm's
    default is float32's, the type it computes in): the half type's eps (0.0078 for bfloat16) made the
    weights of embedding-sized sources 0.64 / 0.36 where the norm gives 0.78 / 0.22."""
    torch.manual_seed(0)
    stream = AttnResStream(ModelConfig(d_model=32, n_heads=2, n_layers=1, residual="attnres-full"))
    with torch.no_grad():
        stream.queries.normal_(0, 0.3)
    stream = stream.to(dtype)
    sources = [(torch.randn(2, 3, 32) * scale).to(dtype) for scale in (0.02, 0.05)]  # an embedding's size
    logits = torch.stack([(stream.norms[1](v).float() * stream.queries[1].float()).sum(-1) for v in sources])
    torch.testing.assert_close(stream.depth_weights(1, sources).float(), torch.softmax(logits, 0), atol=1e-2, rtol=0)


def test_block_size_one_equals_full():
    torch.manual_seed(1)
    full = tiny_model(("boosted", {}), residual="attnres-full")
    block = GPT(full.cfg.replace(residual="attnres-block", attnres_block=1)).double().eval()
    block.load_state_dict(full.state_dict())
    with torch.no_grad():
        full.residual.queries.normal_()
        block.residual.queries.copy_(full.residual.queries)
    idx = torch.randint(0, 37, (2, 9))
    torch.testing.assert_close(block(idx), full(idx), rtol=0, atol=0)


def test_block_mode_sources():
    """S = 2 with 2 layers: the final aggregation sees [embedding, block 1, block 2]."""
    model = tiny_model(("standard", {}), residual="attnres-block", attnres_block=2)
    seen = []
    original = model.residual.mix
    model.residual.mix = lambda i, sources: seen.append((i, len(sources))) or original(i, sources)
    model(torch.randint(0, 37, (1, 4)))
    assert seen == [(0, 1), (1, 2), (2, 2), (3, 3), (4, 3)]
    assert model.residual.mixture_sizes() == [n for _, n in seen]  # what the FLOP count adds up


@pytest.mark.parametrize("block_size,n_layers", [(3, 2), (3, 4), (4, 4), (5, 4)])
def test_mixture_sizes_are_the_sources_each_mix_sees(block_size, n_layers):
    """mixture_sizes (which the FLOP count adds up) equals the sources each aggregation is handed, for blocks
    of 3 to 5 sublayers that end mid-layer: a partial block counted only one sublayer into it passed at
    S = 1 and 2 and miscounted the FLOPs of every larger block."""
    model = tiny_model(("standard", {}), residual="attnres-block", attnres_block=block_size, n_layers=n_layers)
    seen = []
    original = model.residual.mix
    model.residual.mix = lambda i, sources: seen.append(len(sources)) or original(i, sources)
    model(torch.randint(0, 37, (1, 4)))
    assert len(seen) == 2 * n_layers + 1 and model.residual.mixture_sizes() == seen


def test_full_mode_sources_grow_by_one_per_sublayer():
    """Full AttnRes (S = 1) with 2 layers: sublayer l mixes the embedding and every earlier output, l + 1
    sources, and the final aggregation all 5; a block counter not reset after a completed block kept only
    the first block apart (2 layers of S = 2 see the same counts either way)."""
    model = tiny_model(("standard", {}), residual="attnres-full")
    seen = []
    original = model.residual.mix
    model.residual.mix = lambda i, sources: seen.append((i, len(sources))) or original(i, sources)
    model(torch.randint(0, 37, (1, 4)))
    assert seen == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert model.residual.mixture_sizes() == [n for _, n in seen]


def test_block_attnres_equals_its_equations_written_out():
    """Block AttnRes with S = 3 over 2 layers (sublayers attn 0, FFN 0, attn 1, FFN 1), written out with
    the sublayers as black boxes: each input mixes [embedding, completed blocks, the partial block's
    sum] with softmax(w_l . RMSNorm_l(v)) weights; the final norm gets the last mix (docs/baselines.md)."""
    model = tiny_model(("standard", {}), residual="attnres-block", attnres_block=3)
    stream = model.residual
    with torch.no_grad():
        stream.queries.normal_()
        for norm in stream.norms:
            norm.weight.uniform_(0.5, 1.5)
    idx = torch.randint(0, 37, (2, 9))
    ctx = AttnContext(T=9, S=9, device=idx.device)
    eps = torch.finfo(torch.float64).eps

    def mix(index, sources):
        w, g = stream.queries[index], stream.norms[index].weight
        logits = torch.stack([(v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * g) @ w for v in sources])
        return sum(a[..., None] * v for a, v in zip(torch.softmax(logits, 0), sources))

    first, second = model.blocks
    emb = model.wte.weight[idx] + model.wpe.weight[:9]
    a0 = first.attn_branch(emb, ctx)  # sublayer 0 sees the embedding alone
    f0 = first.ffn_branch(mix(1, [emb, a0]))  # the partial block so far: a0
    a1 = second.attn_branch(mix(2, [emb, a0 + f0]), ctx)  # partial: a0 + f0
    f1 = second.ffn_branch(mix(3, [emb, a0 + f0 + a1]))  # block 1 (3 sublayers) completed
    h = mix(4, [emb, a0 + f0 + a1, f1])  # the final mix: block 1 and the partial block 2
    expected = model.lm_head(model.ln_f(h))
    torch.testing.assert_close(model(idx), expected, rtol=1e-10, atol=1e-10)
    # and every gradient, the pseudo-queries' and the key norms' gains included
    weights = torch.randn_like(expected)
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad((model(idx) * weights).sum(), params, allow_unused=True)
    written_out = torch.autograd.grad((expected * weights).sum(), params, allow_unused=True)
    for a, b in zip(ours, written_out):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    mixed = [next(g for p, g in zip(params, ours) if p is q) for q in (stream.queries, stream.norms[4].weight)]
    assert all(g is not None and g.abs().sum() > 0 for g in mixed)  # the depth mixture's own parameters are checked


def test_parameter_counts():
    base = count_params(preset_config("paper-small", "boosted"))
    cfg = preset_config("paper-small", "boosted", {"residual": "attnres-block", "attnres_block": 2})
    assert count_params(cfg) == base + 9 * 2 * 256  # 2L + 1 pseudo-queries and RMSNorm gains


@pytest.mark.parametrize("residual", ["attnres-full", "attnres-block"])
def test_causality_parity_and_cache_inside_attnres(variant_case, residual):
    sizes = {"attnres_block": 3} if residual == "attnres-block" else {}  # attnres-full: blocks of one
    model = tiny_model(variant_case, residual=residual, **sizes)
    with torch.no_grad():
        model.residual.queries.normal_(0, 1.0)
    idx = torch.randint(0, 37, (2, 10))
    full = model(idx)
    # fast path == naive path
    torch.testing.assert_close(model(idx, naive=True), full, rtol=1e-10, atol=1e-10)
    logits, records = model(idx, return_intermediates=True)  # each layer's attention fills its own record
    torch.testing.assert_close(logits, full, rtol=1e-10, atol=1e-10)
    assert len(records) == 2 and all(layer.rounds for layer in records)
    # causality
    idx2 = idx.clone()
    idx2[:, 5:] = (idx2[:, 5:] + 3) % 37
    torch.testing.assert_close(model(idx2)[:, :5], full[:, :5], rtol=0, atol=1e-12)
    # cached decoding == full forward (prefill 3, then one token at a time)
    model.setup_cache(batch=2, max_len=12)
    steps = [model(idx[:, :3], input_pos=torch.arange(3))]
    steps += [model(idx[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(3, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual", ["attnres-full", "attnres-block"])
def test_under_bf16_autocast_the_depth_mixture_stays_in_the_streams_float32(residual, monkeypatch):
    """As the plain stream's h + sublayer(h) stays float32 under autocast, so does AttnRes's: each
    mixture sees float32 sources (a block's partial sum too, though its sublayers' outputs are bf16)
    and computes its depth logits and weighted sum in float32, equal to the same mixture out of
    autocast (autocast's bf16 einsum once gave 3-6x the plain stream's error against float32)."""
    sizes = {"attnres_block": 3} if residual == "attnres-block" else {}  # attnres-full: blocks of one
    model = tiny_model(("boosted", {}), residual=residual, **sizes).float()
    with torch.no_grad():
        model.residual.queries.normal_()
    assert flops_per_token(model.cfg) > 0  # on the meta device, which has no autocast to leave
    calls = []
    mix = AttnResStream.mix

    def recording(self, index, sources):
        out = mix(self, index, sources)
        with torch.autocast("cpu", enabled=False):
            calls.append(([s.dtype for s in sources], out.dtype, torch.equal(out, mix(self, index, sources))))
        return out

    monkeypatch.setattr(AttnResStream, "mix", recording)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randint(0, 37, (2, 10)))
    assert logits.dtype == torch.bfloat16 and len(calls) == 2 * model.cfg.n_layers + 1  # (the head is bf16)
    # (the mixture's own dtype too: a mix that turned autocast on inside equals itself out of autocast)
    assert all(dtypes == [torch.float32] * len(dtypes) and dtype == torch.float32 and same
               for dtypes, dtype, same in calls), calls


def test_the_first_sublayers_norm_is_frozen_and_every_other_trains():
    """Sublayer 0 mixes the embedding alone, so its key norm never gets a gradient: it is not trained
    (no optimizer state for it); the other 2L norms (and the final aggregation's) are."""
    for residual in ("attnres-full", "attnres-block"):
        stream = tiny_model(("standard", {}), residual=residual).residual
        assert [n.weight.requires_grad for n in stream.norms] == [False] + [True] * 4, residual
        assert stream.queries.requires_grad


def test_attnres_needs_pre_ln():
    with pytest.raises(ValueError, match="defined for norm='pre' only"):
        ModelConfig(residual="attnres-full", norm="post")
