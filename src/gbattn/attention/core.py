"""Shared pieces of every attention variant.

* :func:`naive_attention` — the reference path: explicit scores, mask, softmax, dropout.
  It also returns the probabilities, so it is the path used for analysis (intermediates).
* :func:`fast_attention` — ``F.scaled_dot_product_attention`` with the same semantics
  (on CPU the same dropout mask for the same RNG state; rows with no visible key give 0).
* :class:`AttentionBase` — head split/merge, RoPE, the KV cache and path selection, so a
  variant file only writes its own equations.
* :class:`Intermediates` — what a variant returns on request for analysis (SPEC.md, GBA
  analysis: gates, per-round attention and entropies).

Shapes: B batch, T queries, S keys, H heads, D model width, E head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class AttnArgs:
    """What the model tells every attention variant (the variant's own options are separate)."""

    d_model: int
    n_heads: int
    dropout: float = 0.0  # dropout on attention probabilities
    bias: bool = True
    layer_idx: int = 0
    n_layers: int = 1

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class Intermediates:
    """Per-round record of one attention layer's forward pass (naive path only).

    ``probs[m]``: attention probabilities of round m, (B, H, T, S), before dropout.
    ``outputs[m]``: round m's head-concatenated attention output, (B, T, D) (F_0, c_1, ...).
    ``residuals[m-1]``: the residual r_m = x - F that round m >= 1 attends with, (B, T, D).
    ``gates[m-1]``: the gate g_m, broadcastable to (B, T, D).
    ``entropies[m]``: entropy in nats of each query's attention, (B, H, T).
    """

    probs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    residuals: list[Tensor] = field(default_factory=list)
    gates: list[Tensor] = field(default_factory=list)
    entropies: list[Tensor] = field(default_factory=list)

    def add_round(self, probs_BHTS: Tensor | None, out_BTD: Tensor) -> None:
        if probs_BHTS is not None:
            self.probs.append(probs_BHTS)
            self.entropies.append(entropy(probs_BHTS))
        self.outputs.append(out_BTD)


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy (nats) over the last dim, with 0 log 0 = 0."""
    return -(probs * torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))).sum(-1)


# --------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------


def dense_mask(
    T: int, S: int, device: torch.device, q_pos_T: Tensor | None, key_padding_mask_BS: Tensor | None, causal: bool
) -> Tensor | None:
    """Boolean mask, True where query t may attend to key s; shape (B or 1, 1, T, S) or None.

    Query t sits at absolute position ``q_pos_T[t]`` (default ``S - T + t``: the last T of S
    positions); key s sits at position s. ``key_padding_mask_BS`` is True for real tokens.
    """
    mask = None
    if causal:
        q_pos = q_pos_T if q_pos_T is not None else torch.arange(S - T, S, device=device)
        mask = (torch.arange(S, device=device)[None, :] <= q_pos[:, None])[None, None]
    if key_padding_mask_BS is not None:
        if key_padding_mask_BS.shape[-1] != S:
            raise ValueError(f"key_padding_mask has {key_padding_mask_BS.shape[-1]} keys, expected {S}")
        pad = key_padding_mask_BS.bool()[:, None, None, :]
        mask = pad if mask is None else mask & pad
    return mask


@dataclass
class MaskInfo:
    """How to mask one attention call: built once per layer call, used by every round."""

    T: int
    S: int
    q_pos_T: Tensor | None
    key_padding_mask_BS: Tensor | None
    causal: bool
    device: torch.device
    _dense: Tensor | None = None
    _built: bool = False

    @property
    def square_causal(self) -> bool:
        """True when SDPA's own ``is_causal`` is exactly our mask (no T x S mask needed)."""
        return self.causal and self.q_pos_T is None and self.key_padding_mask_BS is None and self.T == self.S

    def dense(self) -> Tensor | None:
        if not self._built:
            self._dense = dense_mask(self.T, self.S, self.device, self.q_pos_T, self.key_padding_mask_BS, self.causal)
            self._built = True
        return self._dense


# --------------------------------------------------------------------------------------
# The two paths
# --------------------------------------------------------------------------------------


def attention_scores(q_BHTE: Tensor, k_BHSE: Tensor, mask: MaskInfo, scale: float) -> Tensor:
    """Masked scores (masked entries are -inf), (B, H, T, S)."""
    scores = torch.matmul(q_BHTE, k_BHSE.transpose(-1, -2)) * scale
    allowed = mask.dense()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def masked_softmax(scores_BHTS: Tensor) -> Tensor:
    """Softmax over keys; a row with no visible key gives all zeros (as SDPA does)."""
    probs = torch.softmax(scores_BHTS, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def naive_attention(
    q_BHTE: Tensor, k_BHSE: Tensor, v_BHSF: Tensor, mask: MaskInfo, dropout_p: float, scale: float
) -> tuple[Tensor, Tensor]:
    """Reference attention: returns (output (B, H, T, F), probabilities before dropout (B, H, T, S))."""
    probs = masked_softmax(attention_scores(q_BHTE, k_BHSE, mask, scale))
    dropped = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(dropped, v_BHSF), probs


def fast_attention(q_BHTE: Tensor, k_BHSE: Tensor, v_BHSF: Tensor, mask: MaskInfo, dropout_p: float, scale: float) -> Tensor:
    """``F.scaled_dot_product_attention``; uses ``is_causal`` (no mask tensor) when it can."""
    if mask.square_causal:
        return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSF, dropout_p=dropout_p, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSF, attn_mask=mask.dense(), dropout_p=dropout_p, scale=scale)


def chunked_entropy(q_BHTE: Tensor, k_BHSE: Tensor, mask: MaskInfo, scale: float, chunk: int | None = None) -> Tensor:
    """Entropy of each query's attention (B, H, T) without holding the T x S matrix at once:
    query chunks of at most 2^17 scores (B * H * chunk * S) at a time."""
    B, H, _, _ = q_BHTE.shape
    chunk = chunk or max(1, (1 << 17) // (B * H * k_BHSE.shape[-2]))
    out = []
    for start in range(0, q_BHTE.shape[-2], chunk):
        q = q_BHTE[..., start : start + chunk, :]
        sub = MaskInfo(
            T=q.shape[-2],
            S=mask.S,
            q_pos_T=_q_positions(mask)[start : start + chunk] if mask.causal else None,
            key_padding_mask_BS=mask.key_padding_mask_BS,
            causal=mask.causal,
            device=mask.device,
        )
        out.append(entropy(masked_softmax(attention_scores(q, k_BHSE, sub, scale))))
    return torch.cat(out, dim=-1)


def _q_positions(mask: MaskInfo) -> Tensor:
    if mask.q_pos_T is not None:
        return mask.q_pos_T
    return torch.arange(mask.S - mask.T, mask.S, device=mask.device)


# --------------------------------------------------------------------------------------
# RoPE and the KV cache
# --------------------------------------------------------------------------------------


def rope_tables(pos_T: Tensor, d_head: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables (T, E) for rotary position embeddings (rotate-half layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2, device=pos_T.device, dtype=torch.float64) / d_head))
    angles = pos_T.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_BHTE: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
    if rope is None:
        return x_BHTE
    cos, sin = rope
    half = x_BHTE.shape[-1] // 2
    rotated = torch.cat([-x_BHTE[..., half:], x_BHTE[..., :half]], dim=-1)
    return x_BHTE * cos + rotated * sin


class KVCache(nn.Module):
    """A fixed-size key/value cache (gpt-fast style): ``update`` writes at ``pos_T`` and returns
    the whole cache, so prefill and decode are the same code. A cache with ``d_key = 0`` keeps
    values only (twicing keeps A·V of every past position that way)."""

    def __init__(self, batch: int, shape: "CacheShape", max_len: int, dtype, device) -> None:
        super().__init__()
        kh, dk, vh, dv = shape
        self.register_buffer("k", torch.zeros(batch, kh, max_len, dk, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(batch, vh, max_len, dv, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.v.shape[2]

    def update(self, pos_T: Tensor, k_BHTE: Tensor | None, v_BHTF: Tensor) -> tuple[Tensor, Tensor]:
        if k_BHTE is not None:
            self.k[:, :, pos_T] = k_BHTE.to(self.k.dtype)
        self.v[:, :, pos_T] = v_BHTF.to(self.v.dtype)
        return self.k, self.v


CacheShape = tuple  # (key heads, key width, value heads, value width)


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose bias covers only its first ``n_biased`` outputs: one fused matmul for
    projections of the same input where some have a bias and some have none."""

    def __init__(self, d_in: int, n_biased: int, n_unbiased: int, bias: bool = True) -> None:
        super().__init__(d_in, n_biased + n_unbiased, bias=bias)
        self.n_unbiased = n_unbiased
        if bias:
            self.bias = nn.Parameter(torch.zeros(n_biased))

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else torch.cat([self.bias, self.bias.new_zeros(self.n_unbiased)])
        return F.linear(x, self.weight, bias)


# --------------------------------------------------------------------------------------
# Base class of every variant
# --------------------------------------------------------------------------------------


class AttentionBase(nn.Module):
    """Common machinery. A variant implements :meth:`compute` (its equations) and
    :meth:`cache_shapes` (one (heads, d_key, d_value) per cache it keeps).

    Calling convention of every variant::

        y_BTD = attn(x_BTD)                                    # causal, fast path
        y_BTD, inter = attn(x_BTD, return_intermediates=True)  # naive path + record
        attn(x_BTD, key_padding_mask=mask_BT, naive=True)      # reference path
        attn(x_BTD, input_pos=pos_T)                           # with a KV cache set up
    """

    Options = None  # the variant's own options dataclass
    supports_memory = False  # accepts keys/values from another sequence (cross-attention)

    def __init__(self, args: AttnArgs, options) -> None:
        super().__init__()
        self.args = args
        self.options = options
        self.n_heads = args.n_heads
        self.d_head = args.d_head
        self.dropout_p = args.dropout
        self.scale = 1.0 / math.sqrt(args.d_head)
        self.caches = nn.ModuleList()

    # -- heads ---------------------------------------------------------------------
    def split_heads(self, x_BTD: Tensor, heads: int | None = None) -> Tensor:
        B, T, D = x_BTD.shape
        heads = heads or self.n_heads
        return x_BTD.view(B, T, heads, D // heads).transpose(1, 2)

    @staticmethod
    def merge_heads(x_BHTE: Tensor) -> Tensor:
        B, H, T, E = x_BHTE.shape
        return x_BHTE.transpose(1, 2).reshape(B, T, H * E)

    # -- cache ---------------------------------------------------------------------
    def cache_shapes(self) -> list[CacheShape]:
        """(key heads, key width, value heads, value width) of each cache this variant keeps."""
        return [(self.n_heads, self.d_head, self.n_heads, self.d_head)]

    def setup_cache(self, batch: int, max_len: int, dtype, device) -> None:
        self.caches = nn.ModuleList(KVCache(batch, shape, max_len, dtype, device) for shape in self.cache_shapes())

    def clear_cache(self) -> None:
        self.caches = nn.ModuleList()

    def cached_kv(self, index: int, pos_T: Tensor | None, k: Tensor | None, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k/v to cache ``index`` and return the full cache; pass-through without a cache."""
        if pos_T is None or len(self.caches) == 0:
            return k, v
        return self.caches[index].update(pos_T, k, v)

    # -- one attention call ----------------------------------------------------------
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: MaskInfo, naive: bool, scale: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Softmax attention through the chosen path: (output, probabilities or None)."""
        p = self.dropout_p if self.training else 0.0
        scale = self.scale if scale is None else scale
        if naive:
            return naive_attention(q, k, v, mask, p, scale)
        return fast_attention(q, k, v, mask, p, scale), None

    # -- entry point -------------------------------------------------------------------
    def forward(
        self,
        x_BTD: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        input_pos: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        causal: bool = True,
        naive: bool = False,
        return_intermediates: bool = False,
        memory: Tensor | None = None,
    ):
        """``key_padding_mask`` (B, S) is True for real tokens (S = T, or the cache length
        when a cache is set up); ``input_pos`` (T,) are the absolute positions of x's tokens
        (required with a cache); ``rope`` are cos/sin tables for those positions.
        ``memory`` (B, S, D): keys/values from another sequence (cross-attention, non-causal;
        variants with ``supports_memory`` only)."""
        B, T, _ = x_BTD.shape
        extra = {}
        if memory is not None:
            if not self.supports_memory:
                raise ValueError(f"{type(self).__name__} does not take a memory (cross-attention)")
            if causal or len(self.caches):
                raise ValueError("cross-attention with a memory is non-causal and uncached: pass causal=False")
            S, q_pos, extra = memory.shape[1], None, {"memory_BSD": memory}
        elif input_pos is not None and len(self.caches):
            S = self.caches[0].max_len
            q_pos = input_pos
        else:
            S, q_pos = T, None
        mask = MaskInfo(T, S, q_pos, key_padding_mask, causal, x_BTD.device)
        record = Intermediates() if return_intermediates else None
        y_BTD = self.compute(
            x_BTD,
            mask=mask,
            pos_T=input_pos if len(self.caches) else None,
            rope=rope,
            naive=naive or return_intermediates,
            record=record,
            **extra,
        )
        return (y_BTD, record) if return_intermediates else y_BTD

    def compute(self, x_BTD, *, mask, pos_T, rope, naive, record) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError
