"""Gradient-boosted attention (GBA, arXiv 2604.03190; SPEC.md section 1).

M attention rounds inside one layer, each with its own projections::

    F = Attn_0(q=x, kv=x)
    for m in 1..M-1:
        r_m = x - F                      # negative gradient of 0.5 ||x - F||^2
        c_m = Attn_m(q=r_m, kv=KV_SOURCE)
        F   = F + g_m(F, c_m) * c_m      # gate = shrinkage in [0, 1]^d
    y = W_out F

``kv_source``: ``residual`` (K/V from r_m; what the authors ran), ``input`` (K/V from x; the
first paper text) or ``shared`` (round 0's K/V reused, only a new W_Q). With M = 1 the module
is standard attention, with the same parameter names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gbattn.attention.core import AttentionBase, AttnArgs, apply_rope, chunked_entropy, entropy
from gbattn.config import ConfigError, check_choice

GATES = ("linear", "mlp", "vector", "scalar", "none")
KV_SOURCES = ("residual", "input", "shared")


@dataclass
class BoostedOptions:
    rounds: int = 2  # M >= 1; M = 1 is standard attention
    gate: str = "linear"  # linear (paper) | mlp | vector | scalar | none
    kv_source: str = "residual"  # residual (authors' code) | input | shared
    gate_hidden: int = 32  # hidden width of the mlp gate
    learned_beta: float | None = None  # if set: learned inverse temperature per round, init beta (synthetic task)
    out_proj: bool = True  # W_out after the last round (False in the synthetic task)
    layers: list | None = None  # layer indices with correction rounds (negative counts from the end); None = all

    def __post_init__(self) -> None:
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ConfigError(f"attn.rounds={self.rounds!r} must be an integer >= 1")
        check_choice("attn.gate", self.gate, GATES)
        check_choice("attn.kv_source", self.kv_source, KV_SOURCES)
        if not isinstance(self.gate_hidden, int) or self.gate_hidden < 1:
            raise ConfigError(f"attn.gate_hidden={self.gate_hidden!r} must be an integer >= 1")
        if self.layers is not None and not (
            isinstance(self.layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in self.layers)
        ):
            raise ConfigError(f"attn.layers={self.layers!r} must be null or a list of layer indices, e.g. [2, 3]")
        if self.learned_beta is not None and not self.learned_beta > 0:
            raise ConfigError(f"attn.learned_beta={self.learned_beta!r} must be > 0 or null")


# --------------------------------------------------------------------------------------
# Gates g_m(F, c_m) in [0, 1]: the shrinkage of the boosting step
# --------------------------------------------------------------------------------------


class LinearGate(nn.Module):
    """Paper gate: ``sigmoid(W_g [F ; c] + b)``, W_g: 2d -> d (starts near 0.5 with N(0, 0.02) init)."""

    needs_entropy = False

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * d, d)

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.proj(torch.cat([f_BTD, c_BTD], dim=-1)))


class MLPGate(nn.Module):
    """The authors' standalone gate: ``sigmoid(MLP([F ; c ; entropy of round 0]))``."""

    needs_entropy = True

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * d + 1, options.gate_hidden), nn.GELU(), nn.Linear(options.gate_hidden, d))

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.net(torch.cat([f_BTD, c_BTD, entropy_BT1.to(f_BTD.dtype)], dim=-1)))


class VectorGate(nn.Module):
    """A learned per-dimension constant, ``sigmoid(w)``, w initialised to 0 (gate 0.5)."""

    needs_entropy = False

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.logit = nn.Parameter(torch.zeros(d))

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.logit)


class ScalarGate(nn.Module):
    """One learned constant per round (MART's shrinkage eta_m): ``sigmoid(a)``, a initialised to 0.5."""

    needs_entropy = False

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()
        self.logit = nn.Parameter(torch.tensor(0.5))

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return torch.sigmoid(self.logit).reshape(1)


class NoGate(nn.Module):
    """g = 1: plain boosting without shrinkage."""

    needs_entropy = False

    def __init__(self, d: int, options: BoostedOptions) -> None:
        super().__init__()

    def forward(self, f_BTD: Tensor, c_BTD: Tensor, entropy_BT1: Tensor | None) -> Tensor:
        return f_BTD.new_ones(1)


GATE_CLASSES = {"linear": LinearGate, "mlp": MLPGate, "vector": VectorGate, "scalar": ScalarGate, "none": NoGate}


class CorrectionRound(nn.Module):
    """Round m >= 1: its own projections of the residual, its gate and (optionally) its temperature."""

    def __init__(self, args: AttnArgs, options: BoostedOptions) -> None:
        super().__init__()
        d = args.d_model
        # residual: Q, K, V all from r_m; input/shared: only Q from r_m (K/V come from x / round 0).
        width = 3 * d if options.kv_source == "residual" else d
        self.proj = nn.Linear(d, width, bias=args.bias)
        self.gate = GATE_CLASSES[options.gate](d, options)


class BoostedAttention(AttentionBase):
    """Gradient-boosted attention; see the module docstring for the equations."""

    Options = BoostedOptions
    supports_memory = True

    def __init__(self, args: AttnArgs, options: BoostedOptions) -> None:
        super().__init__(args, options)
        n = args.n_layers
        if options.layers is not None and args.layer_idx not in {i % n for i in options.layers}:
            options = dataclasses.replace(options, rounds=1)  # a layer without corrections: standard attention
            self.options = options
        d, M = args.d_model, options.rounds
        # One fused projection of x: round-0 Q/K/V, plus round-m K/V when they come from x.
        extra = 2 * d * (M - 1) if options.kv_source == "input" else 0
        self.qkv = nn.Linear(d, 3 * d + extra, bias=args.bias)
        self.corrections = nn.ModuleList(CorrectionRound(args, options) for _ in range(M - 1))
        if options.learned_beta is not None:
            self.log_beta = nn.Parameter(torch.full((M,), math.log(options.learned_beta)))
        self.out = nn.Linear(d, d, bias=args.bias) if options.out_proj else nn.Identity()

    def cache_shapes(self):
        own_kv = self.options.rounds if self.options.kv_source != "shared" else 1
        return super().cache_shapes() * own_kv

    def round_scale(self, m: int) -> float | Tensor:
        return self.scale if self.options.learned_beta is None else self.log_beta[m].exp()

    def attend_round(self, m: int, q, k, v, mask, naive: bool):
        scale = self.round_scale(m)
        if isinstance(scale, Tensor):  # a learned temperature: fold it into q (SDPA takes a float scale)
            q, scale = q * scale, 1.0
        return self.attend(q, k, v, mask, naive, scale=scale)

    def compute(self, x_BTD, *, mask, pos_T, rope, naive, record, memory_BSD: Tensor | None = None) -> Tensor:
        d = self.args.d_model
        heads = lambda t: apply_rope(self.split_heads(t), rope)  # noqa: E731
        if memory_BSD is None:
            proj_BTX = self.qkv(x_BTD)
            q_BTD, x_kv = proj_BTX[..., :d], proj_BTX[..., d:]
        else:  # cross-attention (synthetic task): queries from x, keys/values from the memory
            w, b = self.qkv.weight, self.qkv.bias
            q_BTD = F.linear(x_BTD, w[:d], None if b is None else b[:d])
            x_kv = F.linear(memory_BSD, w[d:], None if b is None else b[d:])
        kv_rope = None if memory_BSD is not None else rope
        k0, v0 = self.cached_kv(0, pos_T, apply_rope(self.split_heads(x_kv[..., :d]), kv_rope), self.split_heads(x_kv[..., d : 2 * d]))
        q0 = heads(q_BTD)
        o_BHTE, probs = self.attend_round(0, q0, k0, v0, mask, naive)
        f_BTD = self.merge_heads(o_BHTE)
        if record is not None:
            record.add_round(probs, f_BTD)

        entropy_BT1 = None
        if any(c.gate.needs_entropy for c in self.corrections):  # mlp gate: round-0 entropy, head mean
            ent_BHT = entropy(probs) if probs is not None else chunked_entropy(q0, k0, mask, self.round_scale(0))
            entropy_BT1 = ent_BHT.mean(dim=1).unsqueeze(-1)

        kv_source = self.options.kv_source
        for m, corr in enumerate(self.corrections, start=1):
            r_BTD = x_BTD - f_BTD
            proj = corr.proj(r_BTD)
            q = heads(proj[..., :d])
            if kv_source == "residual":
                k, v = heads(proj[..., d : 2 * d]), self.split_heads(proj[..., 2 * d :])
                k, v = self.cached_kv(m, pos_T, k, v)
            elif kv_source == "input":
                lo = 2 * d * m
                k = apply_rope(self.split_heads(x_kv[..., lo : lo + d]), kv_rope)
                k, v = self.cached_kv(m, pos_T, k, self.split_heads(x_kv[..., lo + d : lo + 2 * d]))
            else:  # shared: round 0's keys and values, exactly
                k, v = k0, v0
            c_BHTE, probs = self.attend_round(m, q, k, v, mask, naive)
            c_BTD = self.merge_heads(c_BHTE)
            g = corr.gate(f_BTD, c_BTD, entropy_BT1)
            f_BTD = f_BTD + g * c_BTD
            if record is not None:
                record.add_round(probs, c_BTD)
                record.residuals.append(r_BTD)
                record.gates.append(g.expand_as(c_BTD))
        return self.out(f_BTD)
