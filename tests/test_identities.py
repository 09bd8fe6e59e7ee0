"""Identities that pin the equations down (docs/method.md, docs/baselines.md)."""

from __future__ import annotations

import math

import pytest
import torch

from gbattn.attention import AttnArgs, build_attention
from gbattn.attention.boosted import GATE_CLASSES

D, H, T = 12, 3, 7
E = D // H


def args(**kw):
    return AttnArgs(d_model=D, n_heads=H, dropout=0.0, **kw)


def randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.4)
    return module.double()


def heads(x_BTD):
    return x_BTD.view(x_BTD.shape[0], x_BTD.shape[1], H, E).transpose(1, 2)


def merge(x_BHTE):
    return x_BHTE.transpose(1, 2).reshape(x_BHTE.shape[0], x_BHTE.shape[2], D)


def softmax_attention_matrix(q_BTD, k_BTD):
    """Explicit causal softmax(q k^T / sqrt(E)) per head, (B, H, T, T)."""
    scores = heads(q_BTD) @ heads(k_BTD).transpose(-1, -2) / math.sqrt(E)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def linear(x, layer, rows=None):
    w, b = layer.weight, layer.bias
    if rows is not None:
        w, b = w[rows], b[rows]
    return x @ w.T + b


def test_boosted_one_round_equals_standard_with_same_weights():
    std = randomize(build_attention("standard", args()))
    gba = build_attention("boosted", args(), {"rounds": 1}).double()
    gba.load_state_dict(std.state_dict())  # same parameter names: qkv, out
    x = torch.randn(2, T, D, dtype=torch.float64)
    for naive in (False, True):
        torch.testing.assert_close(gba(x, naive=naive), std(x, naive=naive), rtol=0, atol=0)


@pytest.mark.parametrize("kv_source", ["residual", "input", "shared"])
@pytest.mark.parametrize("gate", ["none", "linear"])
def test_boosted_two_rounds_equals_hand_written(kv_source, gate):
    gba = randomize(build_attention("boosted", args(), {"rounds": 2, "gate": gate, "kv_source": kv_source}))
    x = torch.randn(2, T, D, dtype=torch.float64)
    # Round 0: ordinary attention on x.
    q0 = linear(x, gba.qkv, slice(0, D))
    k0 = linear(x, gba.qkv, slice(D, 2 * D))
    v0 = linear(x, gba.qkv, slice(2 * D, 3 * D))
    F0 = merge(softmax_attention_matrix(q0, k0) @ heads(v0))
    # Round 1: attend with the residual r = x - F0.
    r = x - F0
    corr = gba.corrections[0]
    q1 = linear(r, corr.proj, slice(0, D))
    if kv_source == "residual":
        k1, v1 = linear(r, corr.proj, slice(D, 2 * D)), linear(r, corr.proj, slice(2 * D, 3 * D))
    elif kv_source == "input":
        k1, v1 = linear(x, gba.qkv, slice(3 * D, 4 * D)), linear(x, gba.qkv, slice(4 * D, 5 * D))
    else:  # shared: exactly round 0's keys and values
        k1, v1 = k0, v0
    c1 = merge(softmax_attention_matrix(q1, k1) @ heads(v1))
    g = (
        torch.ones(())
        if gate == "none"
        else torch.sigmoid(torch.cat([F0, c1], -1) @ corr.gate.proj.weight.T + corr.gate.proj.bias)
    )
    expected = linear(F0 + g * c1, gba.out)
    for naive in (False, True):
        torch.testing.assert_close(gba(x, naive=naive), expected, rtol=1e-12, atol=1e-12)


def test_shared_kv_source_has_no_round_kv_parameters():
    shared = build_attention("boosted", args(), {"kv_source": "shared", "gate": "none"})
    residual = build_attention("boosted", args(), {"kv_source": "residual", "gate": "none"})
    def n(m):
        return sum(p.numel() for p in m.parameters())

    assert n(residual) - n(shared) == 2 * (D * D + D)  # the round's W_K, W_V and biases


@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("kv_source", ["residual", "input", "shared"])
def test_boosted_parameter_count_per_kv_source(kv_source, rounds):
    """Exactly: round 0's W_QKV and W_out; each further round its W_Q (and W_K, W_V with kv_source=residual),
    biases included; kv_source=input adds each further round's W_K, W_V of x to the fused projection."""
    gba = build_attention("boosted", args(), {"rounds": rounds, "gate": "none", "kv_source": kv_source})
    per_round = {"residual": 3 * (D * D + D), "input": 3 * (D * D + D), "shared": D * D + D}[kv_source]
    assert sum(p.numel() for p in gba.parameters()) == 4 * (D * D + D) + (rounds - 1) * per_round


GATE_PARAMETERS = {  # docs/method.md, section 5: parameters of one extra round's gate at width d
    "linear": lambda d: 2 * d * d + d, "tanh": lambda d: 2 * d * d + d,
    "mlp": lambda d: (2 * d + 1) * 32 + 32 + 32 * d + d, "vector": lambda d: d, "scalar": lambda d: 1,
    "none": lambda d: 0,
}


@pytest.mark.parametrize("gate", sorted(GATE_PARAMETERS))
@pytest.mark.parametrize("kv_source", ["residual", "input", "shared"])
def test_extra_round_parameters_are_the_method_docs_formulas(kv_source, gate):
    """docs/method.md, sections 5 and 8: an extra round adds its projections, 3d^2 + 3d (d^2 + d with
    kv_source=shared), and its gate's count from section 5's table (mlp at gate_hidden 32)."""
    assert set(GATE_PARAMETERS) == set(GATE_CLASSES)
    n_standard = sum(p.numel() for p in build_attention("standard", args()).parameters())
    gba = build_attention("boosted", args(), {"rounds": 3, "gate": gate, "kv_source": kv_source})
    projections = (D * D + D) * (1 if kv_source == "shared" else 3)
    assert sum(p.numel() for p in gba.parameters()) - n_standard == 2 * (projections + GATE_PARAMETERS[gate](D))


def test_baseline_extra_parameters_are_the_baselines_docs_counts():
    """docs/baselines.md: gated attention adds W_theta, d^2 (elementwise) or d H (headwise); differential
    attention adds 4E lambda entries and 2E RMSNorm gains; Twicing adds nothing."""
    def extra(name, options=None, d=D, heads=H):
        module_args = AttnArgs(d_model=d, n_heads=heads)
        return (sum(p.numel() for p in build_attention(name, module_args, options).parameters())
                - sum(p.numel() for p in build_attention("standard", module_args).parameters()))

    assert extra("gated") == D * D and extra("gated", {"mode": "headwise"}) == D * H
    assert extra("differential", d=16, heads=4) == 6 * (16 // 4)
    assert extra("twicing") == 0


def test_twicing_equals_explicit_two_a_minus_a_squared():
    tw = randomize(build_attention("twicing", args()))
    x = torch.randn(2, T, D, dtype=torch.float64)
    q, k, v = (linear(x, tw.qkv, slice(i * D, (i + 1) * D)) for i in range(3))
    A = softmax_attention_matrix(q, k)
    expected = linear(merge((2 * A - A @ A) @ heads(v)), tw.out)
    for naive in (False, True):
        torch.testing.assert_close(tw(x, naive=naive), expected, rtol=1e-12, atol=1e-12)


def test_twicing_inactive_layer_is_standard():
    tw = randomize(build_attention("twicing", args(layer_idx=0, n_layers=2), {"layers": [-1]}))
    std = build_attention("standard", args()).double()
    std.load_state_dict(tw.state_dict())
    x = torch.randn(2, T, D, dtype=torch.float64)
    torch.testing.assert_close(tw(x), std(x), rtol=0, atol=0)


def test_gated_elementwise_equals_hand_written():
    g = randomize(build_attention("gated", args()))
    x = torch.randn(2, T, D, dtype=torch.float64)
    W, b = g.qkv.weight, g.qkv.bias
    q, k, v = (x @ W[i * D : (i + 1) * D].T + b[i * D : (i + 1) * D] for i in range(3))
    gate = torch.sigmoid(x @ W[3 * D :].T)  # no bias on W_theta
    expected = linear(merge(softmax_attention_matrix(q, k) @ heads(v)) * gate, g.out)
    torch.testing.assert_close(g(x), expected, rtol=1e-12, atol=1e-12)


def test_differential_equals_hand_written():
    Hd = 4
    d = build_attention("differential", AttnArgs(d_model=16, n_heads=Hd, layer_idx=2))
    randomize(d)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    e = 16 // Hd
    W, b = d.qkv.weight, d.qkv.bias
    q, k, v = (x @ W[i * 16 : (i + 1) * 16].T + b[i * 16 : (i + 1) * 16] for i in range(3))
    with torch.no_grad():
        lam = (
            math.exp((d.lambda_q1 @ d.lambda_k1).item())
            - math.exp((d.lambda_q2 @ d.lambda_k2).item())
            + (0.8 - 0.6 * math.exp(-0.6))
        )
    outs = []
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    for h in range(Hd // 2):
        a = []
        for half in range(2):
            s = slice((2 * h + half) * e, (2 * h + half + 1) * e)
            sc = (q[0, :, s] @ k[0, :, s].T) / math.sqrt(e)
            a.append(sc.masked_fill(~causal, float("-inf")).softmax(-1))
        o = (a[0] - lam * a[1]) @ v[0, :, h * 2 * e : (h + 1) * 2 * e]
        o = o / torch.sqrt((o**2).mean(-1, keepdim=True) + 1e-5) * d.subln.weight
        outs.append(o * (1 - (0.8 - 0.6 * math.exp(-0.6))))
    expected = linear(torch.cat(outs, -1)[None], d.out)
    torch.testing.assert_close(d(x), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gate", sorted(GATE_CLASSES))
def test_every_gate_starts_at_the_method_docs_initial_value(gate):
    """docs/method.md, section 5, "initial value", in a model as built (gbattn's N(0, 0.02) init): vector
    exactly 0.5, scalar exactly sigmoid(0.5), none 1, linear and mlp near 0.5, tanh near 0."""
    from gbattn.config import ModelConfig
    from gbattn.model import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, block_size=16, d_model=D, n_layers=2, n_heads=H, dropout=0.0,
                      attn="boosted", attn_options={"rounds": 3, "gate": gate})
    _, records = GPT(cfg)(torch.randint(0, 37, (2, 9)), return_intermediates=True)
    gates = [r.gate.expand(2, 9, D) for record in records for r in record.of_kind("correction")]
    assert len(gates) == 4  # two layers, two extra rounds each
    g = torch.stack(gates)
    exact = {"vector": 0.5, "scalar": 1 / (1 + math.exp(-0.5)), "none": 1.0}
    if gate in exact:
        torch.testing.assert_close(g, torch.full_like(g, exact[gate]), rtol=0, atol=1e-7)
    else:
        centre = 0.0 if gate == "tanh" else 0.5
        assert (g - centre).abs().max() < 0.05, (gate, (g - centre).abs().max())
