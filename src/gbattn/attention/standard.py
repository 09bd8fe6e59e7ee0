"""Standard multi-head causal softmax attention: ``y = W_out softmax(q k^T / sqrt(E)) v``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from gbattn.attention.core import AttentionBase, AttnArgs, apply_rope


@dataclass
class StandardOptions:
    """Standard attention has no options."""


class StandardAttention(AttentionBase):
    """The baseline (SPEC.md section 1): QKV as one ``Linear(d, 3d)``, ``W_out`` ``Linear(d, d)``."""

    Options = StandardOptions

    def __init__(self, args: AttnArgs, options: StandardOptions) -> None:
        super().__init__(args, options)
        self.qkv = nn.Linear(args.d_model, 3 * args.d_model, bias=args.bias)
        self.out = nn.Linear(args.d_model, args.d_model, bias=args.bias)

    def qkv_heads(self, proj_BTX: Tensor, rope, pos_T) -> tuple[Tensor, Tensor, Tensor]:
        """Split the first 3d columns of the input projection into heads; RoPE; cache 0."""
        d = self.args.d_model
        q = apply_rope(self.split_heads(proj_BTX[..., :d]), rope)
        k = apply_rope(self.split_heads(proj_BTX[..., d : 2 * d]), rope)
        k, v = self.cached_kv(0, pos_T, k, self.split_heads(proj_BTX[..., 2 * d : 3 * d]))
        return q, k, v

    def compute(self, x_BTD, *, mask, pos_T, rope, naive, record) -> Tensor:
        q, k, v = self.qkv_heads(self.qkv(x_BTD), rope, pos_T)
        o_BHTE, probs = self.attend(q, k, v, mask, naive)
        o_BTD = self.merge_heads(o_BHTE)
        if record is not None:
            record.add_round(probs, o_BTD)
        return self.out(o_BTD)
