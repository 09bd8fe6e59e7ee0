"""Gated attention, Qwen's G1 gate (Qiu et al., NeurIPS 2025; SPEC.md section 3).

``Y' = SDPA(Q, K, V) * sigmoid(x W_theta)`` after SDPA and before W_out, where x is the same
normalised input that feeds Q/K/V. ``elementwise``: W_theta d -> H*E; ``headwise``: d -> H.
No bias on W_theta; it is fused with the QKV projection into one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gbattn.attention.core import PackedLinear
from gbattn.attention.standard import StandardAttention
from gbattn.config import check_choice

GATE_MODES = ("elementwise", "headwise")


@dataclass
class GatedOptions:
    mode: str = "elementwise"  # elementwise | headwise

    def __post_init__(self) -> None:
        check_choice("attn.mode", self.mode, GATE_MODES)


class GatedAttention(StandardAttention):
    Options = GatedOptions

    def __init__(self, args, options: GatedOptions) -> None:
        super().__init__(args, options)
        d = args.d_model
        self.gate_width = d if options.mode == "elementwise" else args.n_heads
        self.qkv = PackedLinear(d, 3 * d, self.gate_width, bias=args.bias)

    def compute(self, x_BTD, *, mask, pos_T, rope, naive, record) -> Tensor:
        proj_BTX = self.qkv(x_BTD)
        q, k, v = self.qkv_heads(proj_BTX, rope, pos_T)
        o_BHTE, probs = self.attend(q, k, v, mask, naive)
        gate_BTG = torch.sigmoid(proj_BTX[..., 3 * self.args.d_model :])
        if self.options.mode == "elementwise":
            o_BTD = self.merge_heads(o_BHTE) * gate_BTG
        else:
            o_BTD = self.merge_heads(o_BHTE * gate_BTG.transpose(1, 2).unsqueeze(-1))
        if record is not None:
            record.add_round(probs, o_BTD)
            record.gates.append(gate_BTG)
        return self.out(o_BTD)
