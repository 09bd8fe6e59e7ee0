"""Standard multi-head causal softmax attention (docs/baselines.md)::

    y = W_out softmax(q k^T / sqrt(E)) v
"""

from __future__ import annotations

from torch import Tensor, nn

from gbattn.attention.core import AttentionBase, AttnArgs, Call, NoOptions


class StandardAttention(AttentionBase):
    """The baseline: Q, K, V as one fused projection, then ``W_out``."""

    Options = NoOptions

    def __init__(self, args: AttnArgs, options) -> None:
        super().__init__(args, options)
        self.qkv = nn.Linear(args.d_model, self.q_width + 2 * self.kv_width, bias=args.bias)
        self.out = nn.Linear(self.q_width, args.d_model, bias=args.bias)

    def project(self, x_BTD: Tensor, call: Call) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, and keys and values (cache entry ``kv``) of the fused projection."""
        q_BTX, k_BTX, v_BTX = self.qkv(x_BTD).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        return (call.queries(q_BTX), *call.keys_values("kv", k_BTX, v_BTX))

    def compute(self, x_BTD: Tensor, call: Call) -> Tensor:
        return self.out(call.merge(call.attend(*self.project(x_BTD, call))))
