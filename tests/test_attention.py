"""Attention variants: fast path vs naive reference, causality, masks, determinism."""

from __future__ import annotations

import pytest
import torch

from gbattn.attention import AttnArgs, build_attention
from gbattn.attention.core import entropy

D, H = 16, 4


def make(variant_case, layer_idx=1, dropout=0.0, dtype=torch.float64):
    name, opts = variant_case
    args = AttnArgs(d_model=D, n_heads=H, dropout=dropout, layer_idx=layer_idx, n_layers=2)
    module = build_attention(name, args, opts).to(dtype)
    # Larger weights than the N(0, 0.02) LM init so attention is far from uniform.
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def test_fast_matches_naive_outputs_and_all_gradients(variant_case):
    attn = make(variant_case)
    x = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for naive in (False, True):
        attn.zero_grad()
        x.grad = None
        y = attn(x, naive=naive)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in attn.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
    assert len(grads[0]) == len(grads[1])
    for g_fast, g_naive in zip(*grads):
        torch.testing.assert_close(g_fast, g_naive, rtol=1e-9, atol=1e-10)


def test_fast_matches_naive_with_dropout_on_cpu(variant_case):
    """Both paths draw the same dropout mask for the same RNG state on CPU."""
    attn = make(variant_case, dropout=0.3).train()
    x = torch.randn(2, 6, D, dtype=torch.float64)
    torch.manual_seed(7)
    y_fast = attn(x)
    torch.manual_seed(7)
    y_naive = attn(x, naive=True)
    torch.testing.assert_close(y_fast, y_naive, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("naive", [False, True])
def test_causality(variant_case, naive):
    attn = make(variant_case)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    t = 4
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :])
    y1, y2 = attn(x, naive=naive), attn(x2, naive=naive)
    torch.testing.assert_close(y1[:, : t + 1], y2[:, : t + 1], rtol=0, atol=1e-12)
    assert (y1[:, t + 1 :] - y2[:, t + 1 :]).abs().max() > 1e-6  # the change is seen later on


@pytest.mark.parametrize("naive", [False, True])
def test_key_padding_mask_hides_padded_keys(variant_case, naive):
    """Changing a padded token's input changes no output at real positions (right padding)."""
    attn = make(variant_case)
    x = torch.randn(2, 8, D, dtype=torch.float64)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, 5:] = False
    keep[1, 7:] = False
    x2 = x.clone()
    x2[0, 5:] += 3.0
    x2[1, 7:] -= 3.0
    y1 = attn(x, key_padding_mask=keep, naive=naive)
    y2 = attn(x2, key_padding_mask=keep, naive=naive)
    torch.testing.assert_close(y1[keep], y2[keep], rtol=0, atol=1e-12)


def test_key_padding_fast_matches_naive_left_padding(variant_case):
    """Left padding: rows with no visible key give 0 attention (no NaN) on both paths."""
    attn = make(variant_case)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False
    y_fast = attn(x, key_padding_mask=keep)
    y_naive = attn(x, key_padding_mask=keep, naive=True)
    assert torch.isfinite(y_fast).all()
    torch.testing.assert_close(y_fast, y_naive, rtol=1e-10, atol=1e-10)


def test_same_seed_same_output(variant_case):
    x = torch.randn(2, 5, D)
    torch.manual_seed(3)
    a = make(variant_case, dtype=torch.float32)
    torch.manual_seed(3)
    b = make(variant_case, dtype=torch.float32)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_intermediates_record(variant_case):
    attn = make(variant_case)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    y, rec = attn(x, return_intermediates=True)
    torch.testing.assert_close(y, attn(x, naive=True))
    assert rec.probs and len(rec.probs) == len(rec.entropies)
    for p, ent in zip(rec.probs, rec.entropies):
        assert p.shape[-2:] == (6, 6)
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)))
        assert torch.all(torch.triu(p, diagonal=1) == 0)  # causal
        torch.testing.assert_close(ent, entropy(p))
        assert (ent >= -1e-12).all() and (ent <= torch.log(torch.arange(1, 7, dtype=ent.dtype)) + 1e-9).all()
    for g in rec.gates:
        assert ((g >= 0) & (g <= 1)).all()
