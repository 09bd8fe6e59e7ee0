"""Differential attention (Ye et al., ICLR 2025; SPEC.md section 3).

H/2 heads whose values are 2E wide; each head has two query/key halves of width E::

    out_h = (softmax(Q1 K1^T / sqrt(E)) - lambda softmax(Q2 K2^T / sqrt(E))) V_h
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,  lambda_init = 0.8 - 0.6 exp(-0.3 l)

then a per-head RMSNorm (eps 1e-5, learnable gain) and a scale by (1 - lambda_init). The
projections are the standard ones (same parameters) plus 4E lambda entries and 2E gains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gbattn.attention.core import apply_rope
from gbattn.attention.standard import StandardAttention


@dataclass
class DifferentialOptions:
    """Differential attention has no options (lambda_init follows the layer index)."""


def lambda_init_for(layer_idx: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


class DifferentialAttention(StandardAttention):
    Options = DifferentialOptions

    @staticmethod
    def check_heads(n_heads: int) -> str | None:
        return None if n_heads % 2 == 0 else f"differential attention needs an even n_heads (pairs of query/key halves); got {n_heads}"

    def __init__(self, args, options: DifferentialOptions) -> None:
        super().__init__(args, options)
        E = args.d_head
        self.lambda_init = lambda_init_for(args.layer_idx)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(E) * 0.1) for _ in range(4)
        )
        self.subln = nn.RMSNorm(2 * E, eps=1e-5, elementwise_affine=True)

    def cache_shapes(self):
        return [(self.n_heads, self.d_head, self.n_heads // 2, 2 * self.d_head)]

    def lambda_full(self) -> Tensor:
        return (
            torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
            - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
            + self.lambda_init
        )

    def compute(self, x_BTD, *, mask, pos_T, rope, naive, record) -> Tensor:
        d = self.args.d_model
        proj = self.qkv(x_BTD)
        q = apply_rope(self.split_heads(proj[..., :d]), rope)  # (B, H, T, E): H query halves
        k = apply_rope(self.split_heads(proj[..., d : 2 * d]), rope)
        v = self.split_heads(proj[..., 2 * d :], self.n_heads // 2)  # (B, H/2, S, 2E)
        k, v = self.cached_kv(0, pos_T, k, v)
        lam = self.lambda_full()
        # Every query half of head h uses head h's 2E-wide values. SDPA's fused CPU/GPU kernels
        # need one head width for q, k and v: zero-padding q and k to 2E leaves the scores
        # (and the explicit 1/sqrt(E) scale) unchanged, and keeps the T x S matrix unmaterialised.
        if not naive:
            q, k = F.pad(q, (0, self.d_head)), F.pad(k, (0, self.d_head))
        o_BHTF, probs = self.attend(q, k, v.repeat_interleave(2, dim=1), mask, naive)
        o_BGTF = o_BHTF[:, 0::2] - lam * o_BHTF[:, 1::2]  # (B, H/2, T, 2E)
        o_BGTF = self.subln(o_BGTF) * (1.0 - self.lambda_init)
        o_BTD = self.merge_heads(o_BGTF)
        if record is not None:
            record.add_round(probs[:, 0::2], o_BTD)  # positive maps
            record.add_round(probs[:, 1::2], o_BTD)  # negative maps
        return self.out(o_BTD)
