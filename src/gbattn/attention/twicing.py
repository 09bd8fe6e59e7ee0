"""Twicing attention (Abdullaev & Nguyen, ICLR 2025; docs/baselines.md)::

    y = W_out (2 A V - A (A V))        # = (2A - A^2) V, A^2 never formed

One attention matrix A used twice, with one dropout mask; no extra parameters. (2A - A^2) can have
negative entries: the output is an affine, not convex, mix of values.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gbattn.attention.core import AttnArgs, Call
from gbattn.attention.standard import StandardAttention
from gbattn.checks import Typed


@dataclass
class TwicingOptions(Typed):
    prefix = "attn."

    layers: list[int] | None = None  # layer indices where twicing applies (negative counts from the end); None = all


class TwicingAttention(StandardAttention):
    """Standard attention whose output is ``2 A V - A (A V)`` in the chosen layers."""

    Options = TwicingOptions

    def __init__(self, args: AttnArgs, options: TwicingOptions) -> None:
        super().__init__(args, options)
        self.active = args.in_layers(options.layers)

    def compute(self, x_BTD: Tensor, call: Call) -> Tensor:
        if not self.active:
            return super().compute(x_BTD, call)
        q_BHTE, k_BGSE, v_BGSE = self.project(x_BTD, call)
        with call.shared_dropout():
            av_BHTE = call.attend(q_BHTE, k_BGSE, v_BGSE)
            av_BHSE = call.cached("av", av_BHTE)  # A (A V) needs A V at every visible position
            aav_BHTE = call.attend(q_BHTE, k_BGSE, av_BHSE, kind="second-pass")
        return self.out(call.merge(2 * av_BHTE - aav_BHTE))
