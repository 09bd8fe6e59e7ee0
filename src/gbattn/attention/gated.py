"""Gated attention, Qwen's G1 gate (Qiu et al., NeurIPS 2025; docs/baselines.md)::

    y = W_out (SDPA(Q, K, V) * sigmoid(x W_theta))

after SDPA and before W_out; x is the sublayer's input that feeds Q/K/V (normalised under Pre-LN, the stream
itself under Post-LN). ``elementwise``: W_theta
d -> H*E; ``headwise``: d -> H. No bias on W_theta; it is fused with the QKV projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gbattn.attention.core import AttnArgs, Call, PackedLinear
from gbattn.attention.standard import StandardAttention
from gbattn.checks import Typed, one_of


@dataclass
class GatedOptions(Typed):
    prefix = "attn."

    mode: str = field(default="elementwise", metadata=one_of("elementwise", "headwise"))


class GatedAttention(StandardAttention):
    Options = GatedOptions

    def __init__(self, args: AttnArgs, options: GatedOptions) -> None:
        super().__init__(args, options)
        self.gate_width = self.q_width if options.mode == "elementwise" else args.n_heads
        self.qkv = PackedLinear(args.d_model, self.q_width + 2 * self.kv_width, self.gate_width, bias=args.bias)

    def compute(self, x_BTD: Tensor, call: Call) -> Tensor:
        widths = [self.q_width, self.kv_width, self.kv_width, self.gate_width]
        q_BTX, k_BTX, v_BTX, gate_BTX = self.qkv(x_BTD).split(widths, dim=-1)
        o_BHTE = call.attend(call.queries(q_BTX), *call.keys_values("kv", k_BTX, v_BTX))
        gate_BTX = torch.sigmoid(gate_BTX)  # X: the query width (elementwise) or one per head (headwise)
        call.note(gate=gate_BTX)
        if self.options.mode == "elementwise":
            return self.out(call.merge(o_BHTE) * gate_BTX)
        return self.out(call.merge(o_BHTE * gate_BTX.transpose(1, 2).unsqueeze(-1)))
