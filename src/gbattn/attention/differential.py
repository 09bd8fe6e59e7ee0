"""Differential attention (Ye et al., ICLR 2025; docs/baselines.md).

H/2 heads whose values are 2E wide; each head has two query/key halves of width E::

    out_h = (softmax(Q1 K1^T / sqrt(E)) - lambda softmax(Q2 K2^T / sqrt(E))) V_h
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,  lambda_init = 0.8 - 0.6 exp(-0.3 l)

then a per-head RMSNorm (eps 1e-5, learnable gain) and a scale by (1 - lambda_init). With grouped
K/V, key/value head g serves the query heads of its group, halves kept apart (docs/baselines.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gbattn.attention.core import AttnArgs, Call, NoOptions
from gbattn.attention.standard import StandardAttention


def lambda_init_for(layer_idx: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


class DifferentialAttention(StandardAttention):
    Options = NoOptions

    @classmethod
    def check_heads(cls, n_heads: int, n_kv_heads: int) -> str | None:
        if n_heads % 2 or n_kv_heads % 2:
            return (f"differential attention pairs heads into query/key halves: n_heads ({n_heads}) and "
                    f"n_kv_heads ({n_kv_heads}) must be even")
        return None

    def __init__(self, args: AttnArgs, options) -> None:
        super().__init__(args, options)
        E = args.d_head
        self.lambda_init = lambda_init_for(args.layer_idx)
        # N(0, 0.1) as init_own_parameters draws it, computed as randn * 0.1 in float32 (normal_'s
        # double-precision path for fewer than 16 values rounds differently, by an ulp).
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(E) * 0.1) for _ in range(4)
        )
        self.subln = nn.RMSNorm(2 * E, eps=1e-5, elementwise_affine=True)

    def init_own_parameters(self, init=nn.init) -> None:
        """The lambda vectors: N(0, 0.1) (the constructor draws them itself, see there)."""
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            init.normal_(p, mean=0.0, std=0.1)

    def lambda_full(self) -> Tensor:
        return (
            torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
            - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
            + self.lambda_init
        )

    def compute(self, x_BTD: Tensor, call: Call) -> Tensor:
        q_BTX, k_BTX, v_BTX = self.qkv(x_BTD).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q_BHTE = call.queries(q_BTX)  # (B, H, T, E): head h/2's halves at 2(h/2) and 2(h/2)+1
        # values: G/2 heads of width F = 2E
        k_BGSE, v_BGSF = call.keys_values("kv", k_BTX, v_BTX, value_heads=self.n_kv_heads // 2)
        positive_BHTF = call.attend(q_BHTE[:, 0::2], k_BGSE[:, 0::2], v_BGSF)
        negative_BHTF = call.attend(q_BHTE[:, 1::2], k_BGSE[:, 1::2], v_BGSF, kind="negative-map")
        diff_BHTF = positive_BHTF - self.lambda_full() * negative_BHTF
        # normalised in the gain's precision (float32 under autocast, as the authors' RMSNorm computes in float32)
        normed_BHTF = self.subln(diff_BHTF.to(self.subln.weight.dtype)).to(diff_BHTF.dtype)
        o_BHTF = normed_BHTF * (1.0 - self.lambda_init)
        return self.out(call.merge(o_BHTF))
