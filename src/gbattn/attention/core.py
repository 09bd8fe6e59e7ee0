"""The attention core: everything an attention variant needs that is not its own equations.

A variant subclasses :class:`AttentionBase` and writes only ``compute(x_BTD, call) -> y_BTD`` with
the methods of :class:`Call`::

    q_BHTE = call.queries(q_BTX)                         # split into heads, RoPE
    k_BGSE, v_BGSE = call.keys_values("kv", k_BTX, v_BTX)  # grouped K/V heads, RoPE, named cache entry
    o_BHTE = call.attend(q_BHTE, k_BGSE, v_BGSE)         # mask, path, dropout, GQA, analysis record
    y_BTX = call.merge(o_BHTE)

The core owns head splitting with RoPE, grouped-query attention, the KV cache (entries are named),
the choice between the reference path (explicit T x S scores) and the fast path
(``F.scaled_dot_product_attention``), dropout on the attention probabilities (also one mask used
twice, :meth:`Call.shared_dropout`) and the analysis :class:`Record`.

Shapes: B batch, T queries, S keys, H query heads, G key/value heads, E head width, D model width.
Methods and equations: docs/method.md, docs/baselines.md.
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gbattn.checks import Typed, coerce
from gbattn.runtime import rng_state, set_rng_state


@dataclass(frozen=True)
class AttnArgs:
    """What the model tells every attention variant (the variant's own options are separate; README,
    "Using gbattn from Python"). ``layer_idx`` and ``n_layers`` place the layer: ``attn.layers`` reads them, and
    differential attention's ``lambda_init`` its depth."""

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    dropout: float = 0.0  # on attention probabilities
    bias: bool = True
    layer_idx: int = 0
    n_layers: int = 1
    rope_base: float | None = None  # RoPE in a module used on its own (a model passes its own tables)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def in_layers(self, layers: list[int] | None) -> bool:
        """Whether this layer is one of ``layers`` (indices, negative ones counted from the end;
        None: every layer): a variant option such as ``attn.layers``."""
        return layers is None or self.layer_idx in {i % self.n_layers for i in layers}


@dataclass
class NoOptions(Typed):
    """This variant has no options."""

    prefix = "attn."


# --------------------------------------------------------------------------------------
# The analysis record
# --------------------------------------------------------------------------------------

@dataclass
class Round:
    """One attention call of a layer, in call order (docs/method.md, "The analysis record").

    ``kind``:

    * ``attention``: the layer's first softmax attention. ``probs_BHTS`` (B, H, T, S) before dropout
      (differential: the H/2 positive maps); ``output_BTD`` its head-merged output (GBA: F_0;
      gated: before the gate; differential: A_1 V). Gated attention also sets ``gate`` (B, T, D) or
      (B, T, H) for the headwise gate.
    * ``correction``: GBA round m >= 1. ``probs_BHTS``, ``output_BTD`` = c_m, ``residual_BTD`` = r_m,
      ``gate`` = g_m broadcastable to (B, T, D).
    * ``second-pass``: Twicing's A (A V): ``probs_BHTS`` = A again, ``output_BTD`` = A (A V).
    * ``negative-map``: differential attention's second map: ``probs_BHTS`` (B, H/2, T, S),
      ``output_BTD`` = A_2 V.
    """

    kind: str
    output_BTD: Tensor
    probs_BHTS: Tensor | None = None
    residual_BTD: Tensor | None = None
    gate: Tensor | None = None

    @property
    def entropy_BHT(self) -> Tensor | None:
        """Entropy in nats of every query's attention, (B, H, T)."""
        return None if self.probs_BHTS is None else entropy(self.probs_BHTS)


@dataclass
class Record:
    """Every :class:`Round` of one layer's forward pass (docs/method.md, "The analysis record")."""

    rounds: list[Round] = field(default_factory=list)

    def of_kind(self, *kinds: str) -> list[Round]:
        return [r for r in self.rounds if r.kind in kinds]


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy (nats) over the last dim, with 0 log 0 = 0."""
    return -(probs * torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))).sum(-1)


# --------------------------------------------------------------------------------------
# RoPE tables
# --------------------------------------------------------------------------------------


def rope_for(positions: Tensor, d_head: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of rotary position embeddings (rotate-half layout) at ``positions``: (T,) -> (T, E),
    (B, T) -> (B, 1, T, E); computed in float64, returned in ``dtype``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2, device=positions.device, dtype=torch.float64) / d_head))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


def check_tensor(what: str, value) -> None:
    """``value`` is a torch tensor (or None): a list or a numpy array was Python's "'list' object has no
    attribute 'dim'" from deep inside the call."""
    if value is not None and not isinstance(value, Tensor):
        raise ValueError(f"{what} of type {type(value).__name__}: give a torch tensor (e.g. torch.tensor(...))")


def check_integers(what: str, t: Tensor | None) -> None:
    """Token ids, positions and cache slots are integer tensors: under RoPE a float or bool tensor of
    positions was read as (fractional or 0/1) positions, silently."""
    check_tensor(what, t)
    if t is not None and t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what} of dtype {t.dtype}: expected integers (torch.long)")


def check_device(what: str, t: Tensor | None, device: torch.device, whose: str) -> None:
    """``t`` (or None) on ``device``, where ``whose`` computes: else torch's "Tensor on device meta is not on the
    expected device cpu!" from deep inside, or (a mask reaching SDPA) a silent garbage output."""
    if t is not None and t.device != device:
        raise ValueError(f"{what} on {t.device} for {whose} on {device}: give it on {device} (.to('{device}'))")


def check_key_padding(mask_BS: Tensor | None, B: int, S: int, device: torch.device, whose: str = "an input") -> None:
    """A ``key_padding_mask`` of shape (B, S) or (1, S) for B rows over S key slots, on the ``device`` of ``whose``
    (the input, or a model's token ids), else a ValueError saying the shape (or device) expected: the one check of a
    model's forward and of a module used on its own (both use the mask before their :class:`AttnContext` exists)."""
    check_tensor("key_padding_mask", mask_BS)
    check_device("key_padding_mask", mask_BS, device, whose)
    if mask_BS is not None and (mask_BS.dim() != 2 or mask_BS.shape[0] not in (1, B) or mask_BS.shape[1] != S):
        raise ValueError(f"key_padding_mask of shape {tuple(mask_BS.shape)} for a batch of {B} over {S} key slots: "
                         f"expected ({B}, {S}), True for real tokens")


def check_mask_dtype(what: str, mask: Tensor | None) -> None:
    """A padding mask is bool or integer, True (nonzero) for real tokens: a float one is a ValueError, since an
    additive mask (0 keep, -inf drop, as ``nn.MultiheadAttention`` takes) would read inverted."""
    check_tensor(what, mask)
    if mask is not None and mask.is_floating_point():
        raise ValueError(f"{what} of dtype {mask.dtype}: give a bool (or integer) mask, True for real tokens")


def positions_of(mask_BT: Tensor) -> Tensor:
    """Positions (B, T) of a padded batch: each real token's index among its row's real tokens (what
    it would have alone); padding before a row's first real token at 0, padding after a real token at
    that token's position. ``mask_BT`` is True on real tokens."""
    return (mask_BT.long().cumsum(-1) - 1).clamp_min(0)


def apply_rope(x_BHTE: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
    if rope is None:
        return x_BHTE
    cos, sin = rope
    half = x_BHTE.shape[-1] // 2
    rotated = torch.cat([-x_BHTE[..., half:], x_BHTE[..., :half]], dim=-1)
    return x_BHTE * cos + rotated * sin


# --------------------------------------------------------------------------------------
# What every layer of one forward call shares: shapes, cache slots, positions, mask, path
# --------------------------------------------------------------------------------------


@dataclass
class AttnContext:
    """Built once per forward call of a model (or of a module used on its own).

    Query t sits in cache slot ``slots_T[t]`` (default: the last T of S slots); key s sits in slot
    s. Causal attention lets a query see keys in slots up to its own. ``key_padding_BS`` is True
    for real tokens. ``rope`` holds cos/sin at the queries' positions (the new keys share them).
    """

    T: int
    S: int
    device: torch.device
    slots_T: Tensor | None = None
    key_padding_BS: Tensor | None = None
    causal: bool = True
    naive: bool = False
    rope: tuple[Tensor, Tensor] | None = None
    _mask: Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _built: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_mask_dtype("key_padding_mask", self.key_padding_BS)

    @property
    def square_causal(self) -> bool:
        """True when SDPA's own ``is_causal`` is exactly the mask (no T x S mask tensor needed)."""
        return self.causal and self.slots_T is None and self.key_padding_BS is None and self.T == self.S

    def query_slots(self) -> Tensor:
        if self.slots_T is not None:
            return self.slots_T
        return torch.arange(self.S - self.T, self.S, device=self.device)

    def mask(self) -> Tensor | None:
        """Boolean (B or 1, 1, T, S), True where a query may attend to a key; None if all may."""
        if not self._built:
            mask = None
            if self.causal:
                mask = (torch.arange(self.S, device=self.device)[None, :] <= self.query_slots()[:, None])[None, None]
            if self.key_padding_BS is not None:
                pad = self.key_padding_BS.bool()[:, None, None, :]
                mask = pad if mask is None else mask & pad
            self._mask, self._built = mask, True
        return self._mask

    def chunk(self, start: int, stop: int) -> AttnContext:
        """The same call restricted to queries start..stop-1 (for chunked statistics)."""
        return AttnContext(T=min(stop, self.T) - start, S=self.S, device=self.device,
                           slots_T=self.query_slots()[start:stop], key_padding_BS=self.key_padding_BS,
                           causal=self.causal, naive=True)


# --------------------------------------------------------------------------------------
# The two paths
# --------------------------------------------------------------------------------------


def _grouped(q_BHTE: Tensor, t_BGSX: Tensor) -> Tensor:
    """K or V heads repeated to the query heads (grouped-query attention: query head h uses
    key/value head h // (H / G))."""
    H, G = q_BHTE.shape[1], t_BGSX.shape[1]
    return t_BGSX if G == H else t_BGSX.repeat_interleave(H // G, dim=1)


def masked_softmax(scores_BHTS: Tensor) -> Tensor:
    """Softmax over keys; a row with no visible key gives all zeros (as SDPA does)."""
    return torch.nan_to_num(torch.softmax(scores_BHTS, dim=-1), nan=0.0)


def attention_probs(q_BHTE: Tensor, k_BGSE: Tensor, ctx: AttnContext, scale: float) -> Tensor:
    """Explicit masked softmax(q k^T * scale), (B, H, T, S)."""
    scores = torch.matmul(q_BHTE, _grouped(q_BHTE, k_BGSE).transpose(-1, -2)) * scale
    allowed = ctx.mask()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return masked_softmax(scores)


def reference_path(q_BHTE: Tensor, k_BGSE: Tensor, v_BGSF: Tensor, ctx: AttnContext, dropout_p: float,
                   scale: float) -> tuple[Tensor, Tensor]:
    """Explicit scores, mask, softmax and dropout: (output (B, H, T, F), probabilities before dropout)."""
    probs = attention_probs(q_BHTE, k_BGSE, ctx, scale)
    dropped = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return torch.matmul(dropped, _grouped(q_BHTE, v_BGSF)), probs


def fast_path(
    q_BHTE: Tensor, k_BGSE: Tensor, v_BGSF: Tensor, ctx: AttnContext, dropout_p: float, scale: float
) -> Tensor:
    """``F.scaled_dot_product_attention`` with the same semantics (on CPU the same dropout mask for
    the same RNG state): ``is_causal`` without a mask tensor when possible, SDPA's own grouped
    heads when keys and values share them, and q/k zero-padded to the value width when that is
    wider (the scores and the explicit scale are unchanged, and the fused kernels still run)."""
    H, G, Gv = q_BHTE.shape[1], k_BGSE.shape[1], v_BGSF.shape[1]
    gqa = bool(G != H and Gv == G)
    if not gqa:
        k_BGSE, v_BGSF = _grouped(q_BHTE, k_BGSE), _grouped(q_BHTE, v_BGSF)
    # The fused kernels take contiguous inputs only (a strided view, like every other head, would
    # fall back to the math path and its T x S matrix).
    q_BHTE, k_BGSE, v_BGSF = q_BHTE.contiguous(), k_BGSE.contiguous(), v_BGSF.contiguous()
    pad = v_BGSF.shape[-1] - q_BHTE.shape[-1]
    if pad > 0:
        q_BHTE, k_BGSE = F.pad(q_BHTE, (0, pad)), F.pad(k_BGSE, (0, pad))
    kwargs = dict(dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    if ctx.square_causal:
        return F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSF, is_causal=True, **kwargs)
    return F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSF, attn_mask=ctx.mask(), **kwargs)


def chunked_entropy(q_BHTE: Tensor, k_BGSE: Tensor, ctx: AttnContext, scale: float) -> Tensor:
    """Entropy of each query's attention (B, H, T) in query chunks of at most 2^17 scores
    (B * H * chunk * S) at a time, or of one query when B * H * S alone is more: without the T x S
    matrix at inference; under autograd the chunks' probabilities are kept for the backward pass
    (docs/method.md, section 5)."""
    B, H, T, _ = q_BHTE.shape
    if q_BHTE.numel() == 0:  # no rows or no queries (the chunk size divided by zero)
        return q_BHTE.new_zeros(B, H, T)
    chunk = max(1, (1 << 17) // (B * H * k_BGSE.shape[-2]))
    out = []
    for start in range(0, T, chunk):
        out.append(
            entropy(
                attention_probs(q_BHTE[..., start : start + chunk, :], k_BGSE, ctx.chunk(start, start + chunk), scale)
            )
        )
    return torch.cat(out, dim=-1)


# --------------------------------------------------------------------------------------
# KV caches: entries are named ("kv0", "kv1", "av", ...), one set per layer
# --------------------------------------------------------------------------------------


class StaticLayerCache(nn.Module):
    """A fixed-size cache (gpt-fast style): each entry is a key and a value buffer of ``max_len``
    slots, allocated at its first write with the written heads and widths. ``update`` writes at
    ``slots_T`` and returns the whole buffers, so prefill and decode are the same code and shapes
    stay fixed (``torch.compile``, CUDA graphs). A value-only entry has no key buffer. The cache
    follows ``.to()`` like any buffer, also before its first write (an empty ``placement`` buffer
    carries its dtype and device), so a model converted after ``setup_cache`` still decodes."""

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.batch, self.max_len = batch, max_len
        self.register_buffer("placement", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def _buffer(self, name: str, like: Tensor) -> Tensor:
        rows, heads, _, width = like.shape
        if self.batch != rows:
            raise ValueError(f"a batch of {rows} rows written to a KV cache set up for {self.batch} (setup_cache)")
        if not hasattr(self, name):
            # (a normal tensor even when the first write runs under torch.inference_mode: an inference tensor could
            # not be written outside it, and a prefill there broke every later decode under torch.no_grad)
            outside = torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()
            with outside:
                empty = self.placement.new_zeros(rows, heads, self.max_len, width)
            self.register_buffer(name, empty, persistent=False)
        return getattr(self, name)

    def __deepcopy__(self, memo: dict) -> StaticLayerCache:
        """A copy whose buffers hold the keys and values without their autograd graph: written under grad mode, a
        buffer is no graph leaf, which torch does not deep-copy (``copy.deepcopy(model)`` after a cached forward
        raised)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        buffers = {name: None if t is None else t.detach() for name, t in self._buffers.items()}
        copied.__dict__.update(copy.deepcopy({**self.__dict__, "_buffers": buffers}, memo))
        return copied

    def update(self, name: str, slots_T: Tensor, k_BGTE: Tensor | None, v_BGTF: Tensor) -> tuple[Tensor | None, Tensor]:
        slots_T = slots_T.long()  # (int32 slots pass the model's checks; index_copy_ takes int64 only)
        k_all = None
        if k_BGTE is not None:
            k_all = self._buffer(f"{name}_k", k_BGTE)
            k_all.index_copy_(2, slots_T, k_BGTE.to(k_all.dtype))
        v_all = self._buffer(f"{name}_v", v_BGTF)
        v_all.index_copy_(2, slots_T, v_BGTF.to(v_all.dtype))
        return k_all, v_all


class DynamicLayerCache:
    """A growing cache (for Hugging Face ``generate``): new keys and values are appended. It serves
    one layer: a module used on its own binds the cache to itself at its first call (``owner``)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[Tensor | None, Tensor]] = {}
        # The module used on its own that this cache serves, held weakly: once it is gone, its id() can be another
        # module's, and the cache still holds its keys and values (no module's but its own).
        self.owner: weakref.ref | None = None

    def __deepcopy__(self, memo: dict) -> DynamicLayerCache:
        """A copy of the entries, serving the same module; in a deep copy that copied its module first (``copy.
        deepcopy((module, cache))``), serving that module's copy. The copy holds the keys and values without their
        autograd graph (as a pickled cache does; torch deep-copies no tensor that has one)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        values = {name: tuple(None if t is None else t.detach() for t in pair) for name, pair in self.entries.items()}
        copied.__dict__.update(copy.deepcopy({**self.__dict__, "entries": values}, memo))
        owner = None if self.owner is None else self.owner()
        if owner is not None and id(owner) in memo:
            copied.owner = weakref.ref(memo[id(owner)])
        return copied

    def __getstate__(self) -> dict:
        """Pickled without its module (a weak reference, meaningless in another process): unpickled, the cache
        serves the first module used with it."""
        return {**self.__dict__, "owner": None}

    @property
    def length(self) -> int:
        return next(iter(self.entries.values()))[1].shape[2] if self.entries else 0

    def serves(self, module: nn.Module) -> bool:
        """Whether this cache may take ``module``'s keys and values: it is bound to no module yet, or to that one."""
        return self.owner is None or self.owner() is module

    def bind(self, module: nn.Module) -> None:
        """Serve ``module`` from now on (held weakly)."""
        self.owner = weakref.ref(module)

    def update(self, name: str, slots_T: Tensor | None, k_BGTE: Tensor | None, v_BGTF: Tensor):
        if name in self.entries:
            k_old, v_old = self.entries[name]
            if v_old.shape[0] != v_BGTF.shape[0]:  # else a bare torch.cat size error
                raise ValueError(f"this cache holds {v_old.shape[0]} rows and the new tokens come in "
                                 f"{v_BGTF.shape[0]}: decode another batch with a new cache")
            if v_old.device != v_BGTF.device:  # (a module moved after its prefill) else torch.cat's device error
                raise ValueError(f"this cache holds keys and values on {v_old.device} and the new tokens are on "
                                 f"{v_BGTF.device}: decode on one device, or start a new cache on {v_BGTF.device}")
            k_BGTE = None if k_BGTE is None else torch.cat([k_old, k_BGTE], dim=2)
            v_BGTF = torch.cat([v_old, v_BGTF], dim=2)
        self.entries[name] = (k_BGTE, v_BGTF)
        return k_BGTE, v_BGTF


class StaticCache(nn.Module):
    """One :class:`StaticLayerCache` per layer (``GPT.setup_cache``)."""

    def __init__(self, n_layers: int, batch: int, max_len: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.max_len = max_len
        self.layers = nn.ModuleList(StaticLayerCache(batch, max_len, dtype, device) for _ in range(n_layers))

    def key_length(self, T: int) -> int:
        return self.max_len

    def check_serves(self, h_BTD: Tensor) -> None:
        """A ValueError unless this cache can take the keys and values of activations like ``h_BTD``: on their
        device, and in their dtype outside autocast (under it, the cache's dtype is autocast's choice to make)."""
        placement = self.layers[0].placement
        if placement.device != h_BTD.device:
            raise ValueError(f"a KV cache on {placement.device} for a model computing on {h_BTD.device}: call "
                             f"setup_cache without device= (the model's), or move the model with .to()")
        # (a device without autocast, meta: "unknown device type for autocast")
        autocast = torch.amp.is_autocast_available(h_BTD.device.type) and torch.is_autocast_enabled(h_BTD.device.type)
        if placement.dtype != h_BTD.dtype and not autocast:
            raise ValueError(f"a KV cache of dtype {placement.dtype} for a model computing in {h_BTD.dtype}: call "
                             f"setup_cache without dtype= (the model's), or convert the model with .to(dtype); another "
                             f"dtype is for autocast")
        if autocast and placement.dtype == torch.float64 != h_BTD.dtype:  # autocast casts no float64 tensor
            raise ValueError(f"a KV cache of dtype torch.float64 under autocast for a model computing in "
                             f"{h_BTD.dtype}: autocast leaves float64 as it is, so its keys would meet queries of "
                             f"another dtype; call setup_cache without dtype= (the model's)")


# --------------------------------------------------------------------------------------
# One forward call of one layer
# --------------------------------------------------------------------------------------


class Call:
    """What a variant's ``compute`` may use; see the module docstring."""

    def __init__(self, module: AttentionBase, ctx: AttnContext, cache=None, record: Record | None = None) -> None:
        self.module, self.ctx, self.cache, self.record = module, ctx, cache, record
        self.naive = ctx.naive or record is not None
        self.dropout_p = module.dropout_p if module.training else 0.0
        self._replay: Tensor | None = None  # RNG state that every attend inside shared_dropout restarts from
        self._after: Tensor | None = None
        self._last_probs: Tensor | None = None
        self._last_scale: float = module.scale  # (attend's, for entropy)

    @staticmethod
    def split(x_BTX: Tensor, heads: int) -> Tensor:
        B, T, X = x_BTX.shape
        return x_BTX.view(B, T, heads, X // heads).transpose(1, 2)

    @staticmethod
    def merge(x_BHTF: Tensor) -> Tensor:
        B, H, T, Fw = x_BHTF.shape
        return x_BHTF.transpose(1, 2).reshape(B, T, H * Fw)

    def queries(self, q_BTX: Tensor) -> Tensor:
        """Queries split into the n_heads query heads, with RoPE: (B, H, T, E)."""
        return apply_rope(self.split(q_BTX, self.module.n_heads), self.ctx.rope)

    def keys_values(
        self, name: str, k_BTX: Tensor, v_BTX: Tensor, value_heads: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys (n_kv_heads, with RoPE) and values (``value_heads``, default n_kv_heads) of the new
        tokens, written to cache entry ``name``; returns every cached slot when a cache is set up."""
        k = apply_rope(self.split(k_BTX, self.module.n_kv_heads), self.ctx.rope)
        v = self.split(v_BTX, value_heads or self.module.n_kv_heads)
        if self.cache is None:
            return k, v
        return self.cache.update(name, self.ctx.slots_T, k, v)

    def cached(self, name: str, v_BHTF: Tensor) -> Tensor:
        """A value-only cache entry (Twicing's A V of every past position): (B, H, S, F)."""
        return v_BHTF if self.cache is None else self.cache.update(name, self.ctx.slots_T, None, v_BHTF)[1]

    def attend(self, q_BHTE: Tensor, k_BGSE: Tensor, v_BGSF: Tensor, kind: str = "attention",
               scale: float | None = None) -> Tensor:
        """Softmax attention of the queries over the keys: (B, H, T, F). Recorded as a :class:`Round`
        of ``kind`` when the analysis record is on."""
        scale = self.module.scale if scale is None else scale
        if self._replay is not None:
            set_rng_state(q_BHTE.device, self._replay)
        if self.naive:
            o_BHTF, probs = reference_path(q_BHTE, k_BGSE, v_BGSF, self.ctx, self.dropout_p, scale)
        else:
            o_BHTF, probs = fast_path(q_BHTE, k_BGSE, v_BGSF, self.ctx, self.dropout_p, scale), None
        if self._replay is not None and self._after is None:
            self._after = rng_state(q_BHTE.device)
        self._last_probs, self._last_scale = probs, scale
        if self.record is not None:
            self.record.rounds.append(Round(kind, self.merge(o_BHTF), probs))
        return o_BHTF

    @contextlib.contextmanager
    def shared_dropout(self):
        """Every :meth:`attend` inside draws the same dropout mask (one draw of the RNG in all)."""
        if not self.dropout_p:
            yield
            return
        device = self.ctx.device
        self._replay, self._after = rng_state(device), None
        try:
            yield
        finally:
            if self._after is not None:
                set_rng_state(device, self._after)
            self._replay = self._after = None

    def note(self, residual_BTD: Tensor | None = None, gate: Tensor | None = None) -> None:
        """Add the residual or gate of the last attention call to the record (if it is on)."""
        if self.record is not None:
            last = self.record.rounds[-1]
            last.residual_BTD = residual_BTD if residual_BTD is not None else last.residual_BTD
            last.gate = gate if gate is not None else last.gate

    def entropy(self, q_BHTE: Tensor, k_BGSE: Tensor) -> Tensor:
        """Entropy (B, H, T) of the last attend's map of these queries and keys (recomputed in
        chunks on the fast path, which keeps no probabilities, with the scale that attend used)."""
        if self._last_probs is not None:
            return entropy(self._last_probs)
        return chunked_entropy(q_BHTE, k_BGSE, self.ctx, self._last_scale)


# --------------------------------------------------------------------------------------
# Layers a variant may build from
# --------------------------------------------------------------------------------------


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose bias covers only its first ``n_biased`` outputs: one matmul for the
    biased Q/K/V projection and the bias-free gate projection."""

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
    """An attention layer (README, "Attention variants"). Subclasses define :attr:`Options` (a typed record
    of the variant's own options, or :class:`NoOptions`), may define :meth:`check_heads`, and implement
    :meth:`compute`.

    Calling convention of every variant (a model passes ``context``, ``cache`` and ``record``)::

        y_BTD = attn(x_BTD)                                    # causal, fast path
        y_BTD, record = attn(x_BTD, return_intermediates=True)  # reference path + analysis record
        attn(x_BTD, key_padding_mask=keep_BT, causal=False, naive=True)
    """

    Options: type = NoOptions

    @classmethod
    def check_heads(cls, n_heads: int, n_kv_heads: int) -> str | None:
        """An error message when this variant cannot use these head counts (else None)."""
        return None

    def __init__(self, args: AttnArgs, options) -> None:
        super().__init__()
        self.args, self.options = args, options
        self.n_heads, self.n_kv_heads, self.d_head = args.n_heads, args.kv_heads, args.d_head
        self.q_width, self.kv_width = args.n_heads * args.d_head, args.kv_heads * args.d_head
        self.dropout_p = args.dropout
        self.scale = 1.0 / math.sqrt(args.d_head)

    def extra_repr(self) -> str:
        """``print(module)``: the head layout and the variant's options (its Linear submodules show widths only)."""
        args = self.args
        shown = [f"d_model={args.d_model}", f"n_heads={self.n_heads}"]
        shown += [f"n_kv_heads={self.n_kv_heads}"] * (self.n_kv_heads != self.n_heads)
        shown += [f"dropout={args.dropout}"] * bool(args.dropout) + [f"rope_base={args.rope_base}"] * (
            args.rope_base is not None)
        shown += [f"layer={args.layer_idx} of {args.n_layers}"] * (args.n_layers > 1)
        return ", ".join(shown + [f"{key}={value}" for key, value in self.options.to_dict().items()])

    def init_own_parameters(self, init=nn.init) -> None:
        """Initialise the parameters this layer holds itself (not those of its Linear and norm
        submodules, which the model initialises). A variant's own constructor calls it once it has made
        them (this base class's does not; differential attention's draws the same distribution itself, see
        there), and so does the Hugging Face wrapper's ``_init_weights``;
        ``init``: ``torch.nn.init`` or transformers' equivalent."""

    def compute(self, x_BTD: Tensor, call: Call) -> Tensor:
        raise NotImplementedError

    def forward(self, x_BTD: Tensor, *, key_padding_mask: Tensor | None = None, causal: bool = True,
                positions: Tensor | None = None, naive: bool = False, return_intermediates: bool = False,
                context: AttnContext | None = None, cache=None, record: Record | None = None):
        """``x_BTD`` in the parameters' dtype (or under autocast); ``key_padding_mask`` (B, T): True
        for real tokens (``nn.MultiheadAttention``'s is True for padding: pass ``~mask``); ``positions`` (T,)
        or (B, T) for RoPE (only with ``AttnArgs.rope_base``).
        A model passes its shared ``context``, this layer's ``cache`` and ``record`` instead.

        Used on its own, ``cache`` is a :class:`DynamicLayerCache` (one per module) that each causal call appends
        to: the new tokens attend to every cached one, their positions continue after them, and
        ``key_padding_mask`` then covers the cached and the new tokens, (B, cached + T)."""
        if context is None:
            causal = coerce("causal", causal, bool)  # (None read as False: bidirectional attention, silently)
            # ("no" was true: a (y, record) tuple came back, or the slow reference path ran, silently)
            naive = coerce("naive", naive, bool)
            return_intermediates = coerce("return_intermediates", return_intermediates, bool)
            if cache is not None and not isinstance(cache, DynamicLayerCache):
                raise ValueError(f"cache of type {type(cache).__name__}: a module used on its own takes a "
                                 f"DynamicLayerCache (a model passes its own context with its cache)")
            if cache is not None and not cache.serves(self):  # else entries mix layers
                raise ValueError("this DynamicLayerCache holds another attention module's keys and values (the "
                                 "module it was first used with; a deep copy of that module is another one): give "
                                 "each module (each layer) its own cache")
            if cache is not None and not causal:
                raise ValueError("a cache is for causal decoding: with causal=False the cached tokens would have "
                                 "attended to the new ones; call the module on the whole sequence instead")
            check_tensor("input", x_BTD)
            if x_BTD.dim() != 3 or x_BTD.shape[-1] != self.args.d_model:
                raise ValueError(f"input of shape {tuple(x_BTD.shape)}: expected (batch, tokens, "
                                 f"d_model={self.args.d_model})")
            weight = self.out.weight  # (every variant's; a DataParallel replica holds no registered parameters)
            check_device("input", x_BTD, weight.device, "a module")
            weight_dtype = weight.dtype
            if not x_BTD.is_floating_point() or (x_BTD.dtype != weight_dtype
                                                 and not torch.is_autocast_enabled(x_BTD.device.type)):
                raise ValueError(f"input of dtype {x_BTD.dtype} for a module whose parameters are {weight_dtype}: "
                                 f"give {weight_dtype} activations (or convert the module with .to(dtype))")
            B, T = x_BTD.shape[:2]
            past = 0 if cache is None else cache.length  # keys already cached, before these T tokens
            check_key_padding(key_padding_mask, B, past + T, x_BTD.device)
            rope = None
            if positions is not None and self.args.rope_base is None:
                raise ValueError("positions are for RoPE, which this module does not use: build it with "
                                 "AttnArgs(rope_base=...) or leave positions out")
            if self.args.rope_base is not None:
                check_integers("positions", positions)
                check_device("positions", positions, x_BTD.device, "an input")
                if positions is not None and tuple(positions.shape) not in ((T,), (B, T), (1, T)):
                    raise ValueError(f"positions of shape {tuple(positions.shape)}: expected ({T},) or ({B}, {T})")
                pos = positions if positions is not None else torch.arange(past, past + T, device=x_BTD.device)
                rope = rope_for(pos, self.d_head, self.args.rope_base, x_BTD.dtype)
            context = AttnContext(T=T, S=past + T, device=x_BTD.device, key_padding_BS=key_padding_mask, causal=causal,
                                  naive=naive, rope=rope)
            if cache is not None:  # (after every check: a call refused leaves the cache unbound)
                cache.bind(self)
        if return_intermediates and record is None:
            record = Record()
        y_BTD = self.compute(x_BTD, Call(self, context, cache, record))
        return (y_BTD, record) if return_intermediates else y_BTD
