"""Twicing attention (Abdullaev & Nguyen, ICLR 2025; SPEC.md section 3).

``out = 2 (A V) - A (A V)`` = ``(2A - A^2) V`` with one attention matrix A used twice and A^2
never formed. No extra parameters. Dropout is applied to A once, before both uses (the fast
path replays the RNG state so both SDPA calls draw the same dropout mask). Note that
(2A - A^2) can have negative entries: the output is an affine, not convex, mix of values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gbattn.attention.core import fast_attention, masked_softmax, attention_scores
from gbattn.attention.standard import StandardAttention
from gbattn.config import ConfigError


@dataclass
class TwicingOptions:
    layers: list | None = None  # layer indices where twicing applies (negative counts from the end); None = all

    def __post_init__(self) -> None:
        if self.layers is not None and not (
            isinstance(self.layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in self.layers)
        ):
            raise ConfigError(f"attn.layers={self.layers!r} must be null or a list of layer indices, e.g. [-2, -1]")


class TwicingAttention(StandardAttention):
    """Standard attention whose output is ``2 A V - A (A V)`` in the chosen layers."""

    Options = TwicingOptions

    def __init__(self, args, options: TwicingOptions) -> None:
        super().__init__(args, options)
        n = args.n_layers
        self.active = options.layers is None or args.layer_idx in {i % n for i in options.layers}

    def cache_shapes(self):
        base = super().cache_shapes()
        # A second, value-only cache holds (A V) at every past position, needed by A (A V).
        return base + [(self.n_heads, 0, self.n_heads, self.d_head)] if self.active else base

    def compute(self, x_BTD, *, mask, pos_T, rope, naive, record) -> Tensor:
        if not self.active:
            return super().compute(x_BTD, mask=mask, pos_T=pos_T, rope=rope, naive=naive, record=record)
        q, k, v = self.qkv_heads(self.qkv(x_BTD), rope, pos_T)
        p = self.dropout_p if self.training else 0.0
        probs = None
        if naive:
            probs = masked_softmax(attention_scores(q, k, mask, self.scale))
            a = torch.nn.functional.dropout(probs, p=p) if p > 0 else probs
            av_q = torch.matmul(a, v)
            _, av_all = self.cached_kv(1, pos_T, None, av_q)
            aav = torch.matmul(a, av_all)
        else:
            state = _rng_state(q.device) if p > 0 else None
            av_q = fast_attention(q, k, v, mask, p, self.scale)
            _, av_all = self.cached_kv(1, pos_T, None, av_q)
            if state is not None:
                after = _rng_state(q.device)
                _set_rng_state(q.device, state)  # same dropout mask for the second use of A
            aav = fast_attention(q, k, av_all, mask, p, self.scale)
            if state is not None:
                _set_rng_state(q.device, after)
        o_BTD = self.merge_heads(2 * av_q - aav)
        if record is not None:
            record.add_round(probs, self.merge_heads(av_q))
            record.outputs.append(self.merge_heads(aav))
        return self.out(o_BTD)


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
