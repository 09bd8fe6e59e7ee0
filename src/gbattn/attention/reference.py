"""Independent references: one pure function per attention variant, written from the equations
(docs/method.md, docs/baselines.md) with explicit T x S attention matrices, used only by the
tests (flash-linear-attention's ``naive.py`` habit). They share no code with the modules: they read
the module's parameters by name and recompute everything else (heads, grouped K/V, RoPE, masks,
gates) from scratch. Every registered variant must have one here (a test checks).

Each reference is ``ref(params, x_BTD, spec) -> y_BTD`` where ``params`` is the module's
``state_dict`` (missing biases count as zero) and ``spec`` a :class:`RefSpec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

REFERENCES: dict[str, Callable] = {}


def reference(name: str):
    def register(fn: Callable) -> Callable:
        REFERENCES[name] = fn
        return fn

    return register


@dataclass
class RefSpec:
    n_heads: int
    n_kv_heads: int
    options: dict = field(default_factory=dict)
    layer_idx: int = 0
    n_layers: int = 1
    causal: bool = True
    key_padding_BT: Tensor | None = None  # True for real tokens
    positions_BT: Tensor | None = None  # RoPE positions (default 0..T-1)
    rope_base: float | None = None
    maps: list | None = None  # when a list: every attention matrix the reference forms, in order


# --------------------------------------------------------------------------------------
# Pieces written once for the references
# --------------------------------------------------------------------------------------


def linear(p: dict, name: str, x: Tensor, rows: slice | None = None) -> Tensor:
    w = p[f"{name}.weight"]
    b = p.get(f"{name}.bias")
    if rows is not None:
        w = w[rows]
        b = None if b is None or rows.start >= b.shape[0] else b[rows]
    y = x @ w.T
    return y if b is None else y + b


def heads(x_BTX: Tensor, n: int) -> Tensor:
    """(B, T, n*E) -> (B, n, T, E) by explicit slicing."""
    E = x_BTX.shape[-1] // n
    return torch.stack([x_BTX[..., i * E : (i + 1) * E] for i in range(n)], dim=1)


def concat_heads(x_BHTE: Tensor) -> Tensor:
    return torch.cat([x_BHTE[:, i] for i in range(x_BHTE.shape[1])], dim=-1)


def rotary(x_BHTE: Tensor, spec: RefSpec) -> Tensor:
    """Rotate-half RoPE: dims i and i + E/2 rotate by angle pos * base^(-2i/E)."""
    if spec.rope_base is None:
        return x_BHTE
    B, H, T, E = x_BHTE.shape
    pos_BT = spec.positions_BT if spec.positions_BT is not None else torch.arange(T).expand(B, T)
    i = torch.arange(E // 2, dtype=torch.float64)
    angle_BTI = pos_BT.double()[..., None] * spec.rope_base ** (-2 * i / E)
    cos, sin = angle_BTI.cos()[:, None].to(x_BHTE.dtype), angle_BTI.sin()[:, None].to(x_BHTE.dtype)
    a, b = x_BHTE[..., : E // 2], x_BHTE[..., E // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def allowed(B: int, T: int, spec: RefSpec) -> Tensor:
    """(B, T, S=T): query t may see key s (causal: s <= t; padding: s is a real token)."""
    ok = torch.ones(B, T, T, dtype=torch.bool)
    if spec.causal:
        ok &= torch.ones(T, T, dtype=torch.bool).tril()
    if spec.key_padding_BT is not None:
        ok &= spec.key_padding_BT.bool()[:, None, :]
    return ok


def attention_matrix(q_BHTE: Tensor, k_BGSE: Tensor, spec: RefSpec) -> Tensor:
    """Explicit softmax(q k^T / sqrt(E)) per query head, (B, H, T, S); query head h uses key head
    h // (H / G); a query with no visible key attends to nothing (all zeros)."""
    B, H, T, E = q_BHTE.shape
    G = k_BGSE.shape[1]
    k_BHSE = torch.stack([k_BGSE[:, h // (H // G)] for h in range(H)], dim=1)
    scores = torch.einsum("bhte,bhse->bhts", q_BHTE, k_BHSE) / math.sqrt(E)
    ok = allowed(B, T, spec)[:, None]
    scores = scores.masked_fill(~ok, float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True).clamp_min(-1e300))
    probs = probs.masked_fill(~ok, 0.0)
    total = probs.sum(-1, keepdim=True)
    probs = probs / torch.where(total > 0, total, torch.ones_like(total))
    if spec.maps is not None:
        spec.maps.append(probs)
    return probs


def grouped(v_BGSF: Tensor, H: int) -> Tensor:
    G = v_BGSF.shape[1]
    return torch.stack([v_BGSF[:, h // (H // G)] for h in range(H)], dim=1)


def qkv_parts(p: dict, prefix: str, x: Tensor, spec: RefSpec, offset: int = 0):
    """Queries (H heads, RoPE), keys (G heads, RoPE) and values (G heads) of a fused projection."""
    D = x.shape[-1]
    E = D // spec.n_heads
    qw, kvw = spec.n_heads * E, spec.n_kv_heads * E
    q = linear(p, prefix, x, slice(offset, offset + qw))
    k = linear(p, prefix, x, slice(offset + qw, offset + qw + kvw))
    v = linear(p, prefix, x, slice(offset + qw + kvw, offset + qw + 2 * kvw))
    return rotary(heads(q, spec.n_heads), spec), rotary(heads(k, spec.n_kv_heads), spec), heads(v, spec.n_kv_heads)


def in_layers(spec: RefSpec) -> bool:
    layers = spec.options.get("layers")
    return layers is None or spec.layer_idx in {i % spec.n_layers for i in layers}


# --------------------------------------------------------------------------------------
# The variants
# --------------------------------------------------------------------------------------


@reference("standard")
def standard(p: dict, x_BTD: Tensor, spec: RefSpec) -> Tensor:
    q, k, v = qkv_parts(p, "qkv", x_BTD, spec)
    A = attention_matrix(q, k, spec)
    return linear(p, "out", concat_heads(A @ grouped(v, spec.n_heads)))


@reference("twicing")
def twicing(p: dict, x_BTD: Tensor, spec: RefSpec) -> Tensor:
    """(2A - A^2) V with A^2 formed explicitly, in the chosen layers; standard elsewhere."""
    if not in_layers(spec):
        return standard(p, x_BTD, spec)
    q, k, v = qkv_parts(p, "qkv", x_BTD, spec)
    A = attention_matrix(q, k, spec)
    return linear(p, "out", concat_heads((2 * A - A @ A) @ grouped(v, spec.n_heads)))


@reference("gated")
def gated(p: dict, x_BTD: Tensor, spec: RefSpec) -> Tensor:
    """SDPA(Q, K, V) * sigmoid(x W_theta) before W_out; W_theta has no bias."""
    q, k, v = qkv_parts(p, "qkv", x_BTD, spec)
    o = (attention_matrix(q, k, spec) @ grouped(v, spec.n_heads))  # (B, H, T, E)
    D = x_BTD.shape[-1]
    E = D // spec.n_heads
    first = spec.n_heads * E + 2 * spec.n_kv_heads * E
    gate = torch.sigmoid(x_BTD @ p["qkv.weight"][first:].T)
    if spec.options.get("mode", "elementwise") == "elementwise":
        y = concat_heads(o) * gate
    else:
        y = concat_heads(o * gate.permute(0, 2, 1)[..., None])
    return linear(p, "out", y)


@reference("differential")
def differential(p: dict, x_BTD: Tensor, spec: RefSpec) -> Tensor:
    """Per differential head j (query heads 2j, 2j+1; key/value group g of width 2E):
    (A1 - lambda A2) V_g, RMSNorm with gain, times (1 - lambda_init)."""
    D = x_BTD.shape[-1]
    H, G = spec.n_heads, spec.n_kv_heads
    E = D // H
    q = rotary(heads(linear(p, "qkv", x_BTD, slice(0, H * E)), H), spec)
    k = rotary(heads(linear(p, "qkv", x_BTD, slice(H * E, H * E + G * E)), G), spec)
    v = heads(linear(p, "qkv", x_BTD, slice(H * E + G * E, H * E + 2 * G * E)), G // 2)  # (B, G/2, T, 2E)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * spec.layer_idx)
    lam = (torch.exp(p["lambda_q1"] @ p["lambda_k1"]) - torch.exp(p["lambda_q2"] @ p["lambda_k2"]) + lam_init)
    per_group = (H // 2) // (G // 2)
    outs = []
    for j in range(H // 2):
        g = j // per_group
        a1 = attention_matrix(q[:, 2 * j : 2 * j + 1], k[:, 2 * g : 2 * g + 1], spec)[:, 0]
        a2 = attention_matrix(q[:, 2 * j + 1 : 2 * j + 2], k[:, 2 * g + 1 : 2 * g + 2], spec)[:, 0]
        o = (a1 - lam * a2) @ v[:, g]
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5) * p["subln.weight"]
        outs.append(o * (1 - lam_init))
    return linear(p, "out", torch.cat(outs, dim=-1))


def _gate(p: dict, prefix: str, gate: str, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor) -> Tensor:
    if gate == "linear":
        return torch.sigmoid(linear(p, f"{prefix}.proj", torch.cat([f_BTD, c_BTD], -1)))
    if gate == "tanh":
        return torch.tanh(linear(p, f"{prefix}.proj", torch.cat([f_BTD, c_BTD], -1)))
    if gate == "mlp":
        hidden = linear(p, f"{prefix}.net.0", torch.cat([f_BTD, c_BTD, entropy_BT1], -1))
        hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))  # exact GELU
        return torch.sigmoid(linear(p, f"{prefix}.net.2", hidden))
    if gate in ("vector", "scalar"):
        return torch.sigmoid(p[f"{prefix}.logit"])
    return torch.ones(())


@reference("boosted")
def boosted(p: dict, x_BTD: Tensor, spec: RefSpec) -> Tensor:
    """F = A_0 V_0; r = x - F; c_m = A_m(r) V_m; F += g_m(F, c_m) c_m; y = W_out F."""
    o = spec.options
    M = o.get("rounds", 2) if in_layers(spec) else 1
    kv_source, gate = o.get("kv_source", "residual"), o.get("gate", "linear")
    D = x_BTD.shape[-1]
    E = D // spec.n_heads
    H, G = spec.n_heads, spec.n_kv_heads
    q0, k0, v0 = qkv_parts(p, "qkv", x_BTD, spec)
    A0 = attention_matrix(q0, k0, spec)
    F = concat_heads(A0 @ grouped(v0, H))
    entropy_BT1 = (-(A0 * torch.log(torch.where(A0 > 0, A0, torch.ones_like(A0)))).sum(-1)).mean(1)[..., None]
    for m in range(1, M):
        r = x_BTD - F
        prefix = f"corrections.{m - 1}"
        if kv_source == "residual":
            q, k, v = qkv_parts(p, f"{prefix}.proj", r, spec)
        else:
            q = rotary(heads(linear(p, f"{prefix}.proj", r), H), spec)
            if kv_source == "input":
                start = H * E + 2 * G * E + 2 * G * E * (m - 1)
                k = rotary(heads(linear(p, "qkv", x_BTD, slice(start, start + G * E)), G), spec)
                v = heads(linear(p, "qkv", x_BTD, slice(start + G * E, start + 2 * G * E)), G)
            else:  # shared
                k, v = k0, v0
        c = concat_heads(attention_matrix(q, k, spec) @ grouped(v, H))
        F = F + _gate(p, f"{prefix}.gate", gate, F, c, entropy_BT1) * c
    return linear(p, "out", F)
