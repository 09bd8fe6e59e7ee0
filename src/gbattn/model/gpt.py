"""The GPT language model with the transformer block written once (docs/paper.md, docs/baselines.md).

Pre-LN (the paper's) or Post-LN; LayerNorm or RMSNorm; a GELU, GELU-tanh or SwiGLU FFN; learned
absolute positions or RoPE; biases on or off; grouped-query attention; tied or separate output
embeddings; dropout at the sites the config names (the authors' by default: embeddings, attention
probabilities, FFN hidden, FFN output). Every Linear and Embedding is initialised N(0, 0.02) with
zero biases. The attention sublayer is any registered variant; the residual stream is ``plain`` or
Attention Residuals.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gbattn.attention.core import (
    AttnArgs,
    AttnContext,
    DynamicLayerCache,
    Record,
    StaticCache,
    check_device,
    check_integers,
    check_key_padding,
    check_tensor,
    positions_of,
    rope_for,
)
from gbattn.attention.registry import build_attention
from gbattn.checks import checked, coerce, is_count
from gbattn.config import ModelConfig
from gbattn.errors import ConfigError
from gbattn.model.attnres import AttnResStream
from gbattn.model.decoding import generate


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def make_dropout(cfg: ModelConfig, site: str) -> nn.Module:
    """Dropout at ``site`` if the config names it, else nothing."""
    p = cfg.dropout_at(site)
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _traced() -> bool:
    """Whether the forward runs under torch.compile or a torch.func transform (vmap, grad: per-sample gradients),
    where the input checks that read values on the host (``.item()``, a boolean mask) cannot run: left out there."""
    return torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is not None


class FeedForward(nn.Module):
    """d -> hidden -> d: ``proj(drop(gelu(fc(x))))`` or SwiGLU ``proj(drop(silu(x W_g) * x W_u))``
    (the gate and up projections are one fused ``fc``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_width
        self.kind = cfg.ffn
        self.fc = nn.Linear(cfg.d_model, (2 if cfg.ffn == "swiglu" else 1) * hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.drop_hidden = make_dropout(cfg, "ffn-hidden")

    def forward(self, x_BTD: Tensor) -> Tensor:
        h = self.fc(x_BTD)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh" if self.kind == "gelu-tanh" else "none")
        return self.proj(self.drop_hidden(h))


class Block(nn.Module):
    """One transformer block: an attention sublayer and an FFN sublayer, each with its norm.

    Pre-LN: ``h = h + drop(attn(ln1(h)))``, ``h = h + drop(ffn(ln2(h)))``.
    Post-LN: ``h = ln1(h + drop(attn(h)))``, ``h = ln2(h + drop(ffn(h)))``.

    ``GPT`` passes its shared :class:`AttnContext`; ``block(h_BTD, None)`` on its own is causal attention over
    positions 0 .. T-1 (with the config's RoPE, if it has one).
    """

    # Activation checkpointing (GPT.set_activation_checkpointing): off, or the function that recomputes.
    gradient_checkpointing = False  # (the name transformers' gradient_checkpointing_enable() looks for)
    _gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.ln1 = make_norm(cfg)
        attn_bias = cfg.bias if cfg.attn_bias is None else cfg.attn_bias
        # rope_base: a block called on its own (ctx None) applies the model's RoPE itself; in the model, the
        # context's tables (the same rope_for) are used instead. Without it, such a call ran without RoPE, silently.
        args = AttnArgs(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dropout_at("attention"), attn_bias, layer_idx,
                        cfg.n_layers, rope_base=cfg.rope_base if cfg.pos == "rope" else None)
        self.attn = build_attention(cfg.attn, args, cfg.attn_options)
        self.ln2 = make_norm(cfg)
        self.mlp = FeedForward(cfg)
        self.drop_attn = make_dropout(cfg, "attn-output")
        self.drop_ffn = make_dropout(cfg, "ffn-output")

    def attn_branch(self, h_BTD: Tensor, ctx: AttnContext, cache=None, record: Record | None = None) -> Tensor:
        """The attention sublayer's output (before it is added to the stream)."""
        x = self.ln1(h_BTD) if self.pre_norm else h_BTD
        return self.drop_attn(self.attn(x, context=ctx, cache=cache, record=record))

    def ffn_branch(self, h_BTD: Tensor) -> Tensor:
        x = self.ln2(h_BTD) if self.pre_norm else h_BTD
        return self.drop_ffn(self.mlp(x))

    def checkpointed(self, fn, h_BTD: Tensor, *state) -> Tensor:
        """``fn(h_BTD, *state)`` (this block, or one of its branches). With activation checkpointing on, in training
        with gradients recorded, its activations are recomputed in the backward pass instead of kept (dropout
        draws the same masks again). ``state``: the context, then a layer cache and a record: a call that writes
        either runs as it is, since its recomputation would write them twice."""
        if (self.gradient_checkpointing and self.training and torch.is_grad_enabled()
                and all(s is None for s in state[1:])):
            return self._gradient_checkpointing_func(fn, h_BTD, *state)
        return fn(h_BTD, *state)

    def forward(self, h_BTD: Tensor, ctx: AttnContext, cache=None, record: Record | None = None) -> Tensor:
        if self.pre_norm:
            h_BTD = h_BTD + self.attn_branch(h_BTD, ctx, cache, record)
            return h_BTD + self.ffn_branch(h_BTD)
        h_BTD = self.ln1(h_BTD + self.attn_branch(h_BTD, ctx, cache, record))
        return self.ln2(h_BTD + self.ffn_branch(h_BTD))


def check_model_config(cfg, function: str) -> None:
    """``GPT`` and the size functions take a model's configuration, not a model or a preset name."""
    if not isinstance(cfg, ModelConfig):
        hint = "model.cfg; a model counts its own with model.num_params()" if isinstance(cfg, GPT) else \
            "e.g. preset_config('cpu-char', 'boosted')"
        raise ConfigError(f"{function} takes a ModelConfig ({hint}), not a {type(cfg).__name__}")


class GPT(nn.Module):
    """Decoder-only language model. ``forward(idx_BT) -> logits_BTV`` (README, "Using gbattn from Python";
    the paper's block in docs/paper.md, "The small model").

    With a cache set up (:meth:`setup_cache`), pass ``input_pos`` (T,), the cache slots of these
    tokens, and the same call does prefill (T > 1) and decode (T = 1).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_model_config(cfg, "GPT")
        # Its own copy: the caller's config is mutable, and e.g. cfg.n_layers = 8 to build a deeper model next
        # made this model set up an 8-layer cache for its 4 blocks (and block_size moved past its wpe). The copy
        # is checked as a new config is: a field set after construction (cfg.norm = "mid") is not.
        self.cfg = cfg.replace()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.pos == "learned" else None
        self.drop = make_dropout(cfg, "embedding")
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        final_norm = cfg.norm == "pre" if cfg.final_norm is None else cfg.final_norm  # (Post-LN blocks end in one)
        self.ln_f = make_norm(cfg) if final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.residual = AttnResStream(cfg) if cfg.residual != "plain" else None
        # A submodule slot from the start, so setting up and clearing a cache never changes where the
        # attribute lives (that would make a compiled training step recompile after a decode).
        self.register_module("kv_cache", None)
        if not self.wte.weight.is_meta:  # a meta model has no values to draw (and drawing them took most of its build)
            self.apply(init_weights)

    # -- sizes ---------------------------------------------------------------------
    def num_params(self) -> int:
        """Every parameter, a tied embedding once (the paper's counts, docs/paper.md)."""
        return sum(p.numel() for p in self.parameters())

    # -- cache ---------------------------------------------------------------------
    def setup_cache(self, batch: int, max_len: int | None = None, dtype=None, device=None) -> None:
        """A fixed-size KV cache of ``max_len`` slots (default block_size) for ``batch`` rows, in
        ``dtype`` on ``device`` (default: the model's; a forward refuses a cache on another device, or of another
        dtype outside autocast); it follows the model's ``.to()``."""
        for name, value in (("batch", batch), ("max_len", max_len)):
            if not is_count(value) and (value is not None or name == "batch"):  # (batch=None was int()'s TypeError)
                raise ValueError(f"setup_cache({name}={value!r}): {name} must be an integer >= 1")
        batch, max_len = int(batch), max_len and int(max_len)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"setup_cache(dtype={dtype!r}): dtype must be a floating-point torch.dtype, e.g. "
                             f"torch.bfloat16 (or None: the model's)")
        max_len = max_len or self.cfg.block_size
        self.check_length(max_len)
        ref = self.wte.weight
        self.kv_cache = StaticCache(self.cfg.n_layers, batch, max_len, dtype or ref.dtype, device or ref.device)

    def clear_cache(self) -> None:
        self.kv_cache = None

    # -- activation checkpointing ----------------------------------------------------
    def set_activation_checkpointing(self, enable: bool = True, every_n_layers: int = 1, checkpoint_fn=None) -> None:
        """Recompute the activations of every ``every_n_layers``-th block (0, n, 2n, ...) in the backward pass
        instead of keeping them: less memory for one more forward pass of those blocks, the same loss and
        gradients (tested, dropout included). ``checkpoint_fn``: the function that recomputes (default
        ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``). Only training with gradients is
        affected; a forward that writes a KV cache or analysis records is never recomputed. The Hugging Face
        wrapper's ``gradient_checkpointing_enable()`` calls this."""
        if not is_count(every_n_layers):
            raise ValueError(f"every_n_layers={every_n_layers!r} must be an integer >= 1")
        every_n_layers = int(every_n_layers)
        # (enable="no" was true; a checkpoint_fn of 5 failed at the next training forward, "not callable")
        enable = checked("enable", enable, bool, None, "True or False")
        if checkpoint_fn is not None and not callable(checkpoint_fn):
            raise ValueError(f"checkpoint_fn of type {type(checkpoint_fn).__name__}: give a function (as "
                             f"torch.utils.checkpoint.checkpoint), or None")
        func = checkpoint_fn or Block._gradient_checkpointing_func
        for index, block in enumerate(self.blocks):
            block.gradient_checkpointing = enable and index % every_n_layers == 0
            block._gradient_checkpointing_func = func

    @property
    def has_cache(self) -> bool:
        return self.kv_cache is not None

    def check_length(self, length: int) -> None:
        if length > self.cfg.block_size:
            raise ValueError(
                f"sequence length {length} exceeds block_size={self.cfg.block_size} (the longest sequence the model "
                f"takes); use at most {self.cfg.block_size} tokens or a model with a larger block_size")

    # -- forward -------------------------------------------------------------------
    def forward(self, idx_BT: Tensor, targets_BT: Tensor | None = None, *, input_pos: Tensor | None = None,
                position_ids: Tensor | None = None, key_padding_mask: Tensor | None = None, cache=None,
                naive: bool = False, return_intermediates: bool = False, loss_chunk: int | None = None,
                logits_to_keep: int = 0):
        """Logits (B, T, V), or with ``targets_BT`` the mean next-token cross-entropy (-100 ignored);
        with ``return_intermediates`` also one :class:`Record` per layer. ``logits_to_keep``: the last N positions'
        logits only, (B, N, V) (0: every position's; as transformers' argument of that name).

        ``input_pos`` (T,): cache slots of the tokens (required with a cache; also their positions
        unless ``position_ids`` (B, T) is given, as with left padding). ``key_padding_mask`` (B, S):
        True for real tokens over every key slot (without a cache or ``position_ids``, each row's
        positions then count its real tokens, so a left-padded row is as it is alone). ``cache``: a
        cache object other than the one :meth:`setup_cache` makes (e.g. the Hugging Face wrapper's).
        ``naive``: the reference path.
        ``loss_chunk``: tokens per chunk of the loss's LM head (:meth:`chunked_loss`).
        """
        check_tensor("token ids", idx_BT)
        check_tensor("targets", targets_BT)
        if targets_BT is not None and targets_BT.shape != idx_BT.shape:
            raise ValueError(f"targets of shape {tuple(targets_BT.shape)} for token ids of shape "
                             f"{tuple(idx_BT.shape)}: give one target per token (model(idx[:, :-1], idx[:, 1:]))")
        if targets_BT is not None:
            self.check_targets(targets_BT)
        if logits_to_keep != 0 and (not is_count(logits_to_keep) or targets_BT is not None):
            raise ValueError(f"logits_to_keep={logits_to_keep!r}: give 0 (every position's logits) or a count >= 1 of "
                             f"the last positions', without targets (the loss needs every position's)")
        h_BTD, records = self.hidden(idx_BT, input_pos=input_pos, position_ids=position_ids,
                                     key_padding_mask=key_padding_mask, cache=cache, naive=naive,
                                     return_intermediates=return_intermediates)
        check_device("targets", targets_BT, idx_BT.device, "token ids")  # (after hidden's check of the token ids)
        if logits_to_keep:
            h_BTD = h_BTD[:, -int(logits_to_keep):]
        out = self.lm_head(h_BTD) if targets_BT is None else self.chunked_loss(h_BTD, targets_BT, loss_chunk)
        return (out, records) if return_intermediates else out

    def check_targets(self, targets_BT: Tensor) -> None:
        """Targets are integer token ids in the vocabulary, or -100 (ignored): a float or int32 tensor was
        cross_entropy's "expected target dtype to be Long", an id past the vocabulary its "Target 70 is out of
        bounds" (checked on the CPU only, where it needs no host sync, as the token ids are)."""
        check_integers("targets", targets_BT)
        if targets_BT.device.type == "cpu" and not _traced():  # (no host sync on CPU)
            vocab = self.lm_head.out_features
            bad = targets_BT[(targets_BT != -100) & ((targets_BT < 0) | (targets_BT >= vocab))]
            if bad.numel():
                raise ValueError(f"target {int(bad[0])} outside the vocabulary: targets are 0 .. {vocab - 1} "
                                 f"(vocab_size={vocab}), or -100 for a position left out of the loss")

    def generate(self, idx_BT: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """Continue ``idx_BT`` by ``max_new_tokens`` tokens; see :func:`gbattn.model.decoding.generate`."""
        return generate(self, idx_BT, max_new_tokens, **kwargs)

    def chunked_loss(self, h_BTD: Tensor, targets_BT: Tensor, chunk_tokens: int | None = None) -> Tensor:
        """Mean cross-entropy of the LM head over chunks of ``chunk_tokens`` rows, so no (B*T, V)
        logits tensor is held at once. On CPU the default keeps each chunk near 16 MB: large fresh
        allocations are page-faulted on every step, and this measured 1.7x faster end to end
        (README, "Design notes and deviations": chunked LM loss). Targets of -100 are ignored."""
        if chunk_tokens is not None and not is_count(chunk_tokens):
            raise ValueError(f"loss_chunk={chunk_tokens!r} must be an integer >= 1 (tokens per chunk of the LM head)")
        h_ND, y_N = h_BTD.flatten(0, 1), targets_BT.flatten()
        if chunk_tokens is None:
            chunk_tokens = max(64, (4 << 20) // self.cfg.vocab_size) if h_ND.device.type == "cpu" else h_ND.shape[0]
        total = 0.0
        for start in range(0, h_ND.shape[0], chunk_tokens):
            logits_1NV = self.lm_head(h_ND[None, start : start + chunk_tokens])
            total = total + lm_loss(logits_1NV, y_N[None, start : start + chunk_tokens], reduction="sum")
        return total / (y_N != -100).sum().clamp_min(1)

    def hidden(self, idx_BT: Tensor | None, *, input_pos: Tensor | None = None, position_ids: Tensor | None = None,
               key_padding_mask: Tensor | None = None, cache=None, naive: bool = False,
               return_intermediates: bool = False, layer_inputs: list[Tensor] | None = None,
               token_embeds_BTD: Tensor | None = None, own_cache: bool = True) -> tuple[Tensor, list[Record] | None]:
        """Final hidden states (after the final norm), (B, T, D), and the per-layer records. ``layer_inputs``: a
        list to which each block's input (B, T, D) is appended (the embedding's first; with Attention
        Residuals, the depth mixture its attention sublayer reads), as transformers' ``hidden_states``.
        ``token_embeds_BTD``: the tokens' embeddings in place of ``idx_BT`` (None), e.g. ``model.wte(idx_BT)`` or a
        soft prompt; positions and dropout are added as for token ids (transformers' ``inputs_embeds``).
        ``own_cache=False``: without ``cache``, no cache, not the model's own (:meth:`setup_cache`)."""
        if (idx_BT is None) == (token_embeds_BTD is None):
            raise ValueError("give token ids or token embeddings (token_embeds_BTD), one of the two")
        # ("no" was true: forward returned a (logits, records) tuple, or the slow reference path ran, silently)
        naive = coerce("naive", naive, bool)
        return_intermediates = coerce("return_intermediates", return_intermediates, bool)
        for what, ids in (("token ids", idx_BT), ("position_ids", position_ids), ("input_pos", input_pos)):
            check_integers(what, ids)
        check_tensor("token embeddings", token_embeds_BTD)
        whose, given = ("token ids", idx_BT) if idx_BT is not None else ("token embeddings", token_embeds_BTD)
        D = self.cfg.d_model
        if idx_BT is not None and (idx_BT.dim() != 2 or 0 in idx_BT.shape):  # (no rows was the vocabulary check's
            # "min(): Expected reduction dim to be specified for input.numel() == 0")
            raise ValueError(f"token ids of shape {tuple(idx_BT.shape)}: expected (batch, tokens) with at least one "
                             f"token and at least one row")
        if token_embeds_BTD is not None and (token_embeds_BTD.dim() != 3 or 0 in token_embeds_BTD.shape[:2]
                                             or token_embeds_BTD.shape[2] != D):
            raise ValueError(f"token embeddings of shape {tuple(token_embeds_BTD.shape)}: expected (batch, tokens, "
                             f"{D}) with at least one token and at least one row")
        if self.wte.weight.device.type != "meta":  # (a model on meta computes shapes only; accelerate's offloading
            # keeps the weights there until the embedding's own forward)
            check_device(whose, given, self.wte.weight.device, "a model")  # (else, on meta, garbage logits)
            if token_embeds_BTD is not None and token_embeds_BTD.dtype != self.wte.weight.dtype:
                raise ValueError(f"token embeddings of dtype {token_embeds_BTD.dtype} for a model in "
                                 f"{self.wte.weight.dtype}: give them in {self.wte.weight.dtype}")
        for what, tensor in (("position_ids", position_ids), ("input_pos", input_pos)):
            check_device(what, tensor, given.device, whose)
        B, T = given.shape[:2]
        if position_ids is not None and tuple(position_ids.shape) not in ((T,), (B, T), (1, T)):
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} for token ids of shape {(B, T)}: "
                             f"expected ({B}, {T}) or ({T},)")
        cache = self.kv_cache if cache is None and own_cache else cache
        S = cache.key_length(T) if cache is not None else T
        check_key_padding(key_padding_mask, B, S, given.device, whose)
        if input_pos is not None and tuple(input_pos.shape) != (T,):
            raise ValueError(f"input_pos of shape {tuple(input_pos.shape)} for {T} tokens: expected ({T},), one cache "
                             f"slot per token (position_ids (B, T) gives positions per row)")
        if cache is not None and input_pos is None:
            raise ValueError("a KV cache is set up: pass input_pos (the cache slots of these tokens), or call "
                             "clear_cache() first for a forward pass without it")
        if cache is not None and len(cache.layers) != len(self.blocks):
            raise ValueError(f"a KV cache of {len(cache.layers)} layers for a model of {len(self.blocks)}: each block "
                             f"needs its own layer cache")
        # A growing cache (the Hugging Face wrapper's) serves the model it was first used with: another model's keys
        # were a torch size error deep in the attention, or, of the same shapes, mixed in silently.
        bound = [] if cache is None else [(layer, block.attn) for block, layer in zip(self.blocks, cache.layers)
                                          if isinstance(layer, DynamicLayerCache)]
        if not all(layer_cache.serves(attn) for layer_cache, attn in bound):
            raise ValueError("this KV cache holds another model's keys and values (the model it was first used with; "
                             "a copy or a reloaded copy of that model is another one): pass a new cache, or none")
        if position_ids is not None:
            positions = position_ids
        elif input_pos is not None:
            positions = input_pos
        else:
            self.check_length(T)
            # Without a cache the mask covers these tokens: a left-padded row's tokens keep the positions they
            # have alone (as the Hugging Face wrapper gives them; they were 0..T-1, shifted by the padding).
            positions = torch.arange(T, device=given.device) if key_padding_mask is None else \
                positions_of(key_padding_mask.bool())
        if (input_pos is not None or position_ids is not None) and not _traced() and not positions.is_meta:
            # (one host sync: skipped in compiled decoding)
            lowest, last = map(int, torch.stack(torch.aminmax(positions)).tolist())
            if position_ids is not None and last >= self.cfg.block_size:
                raise ValueError(f"position_ids reach {last}; the model's positions are 0 .. {self.cfg.block_size - 1} "
                                 f"(block_size={self.cfg.block_size})")
            self.check_length(last + 1)
            if isinstance(cache, StaticCache) and input_pos is not None:
                # (last is input_pos's largest slot already unless position_ids gave the positions)
                first, stop = int(input_pos.min()), (last if position_ids is None else int(input_pos.max())) + 1
                if first < 0 or stop > cache.max_len:
                    raise ValueError(f"input_pos {first}..{stop - 1} outside the KV cache's slots 0 .. "
                                     f"{cache.max_len - 1} (setup_cache(..., max_len={cache.max_len}))")
            if lowest < 0:
                raise ValueError(f"{'position_ids' if position_ids is not None else 'input_pos'} reach {lowest}; the "
                                 f"model's positions are 0 .. {self.cfg.block_size - 1}")
        if idx_BT is not None and idx_BT.device.type == "cpu" and not _traced():  # (no host sync
            low, high, vocab = int(idx_BT.min()), int(idx_BT.max()), self.wte.num_embeddings  # (wte may be resized)
            if low < 0 or high >= vocab:
                raise ValueError(f"token id {low if low < 0 else high} outside the vocabulary: ids are 0 .. "
                                 f"{vocab - 1} (vocab_size={vocab})")
        h_BTD = self.wte(idx_BT) if idx_BT is not None else token_embeds_BTD
        if self.wpe is not None:
            h_BTD = h_BTD + self.wpe(positions)
        h_BTD = self.drop(h_BTD)
        if isinstance(cache, StaticCache) and not _traced():
            cache.check_serves(h_BTD)  # (else SDPA's "Expected query, key, and value to have the same dtype")
        rope = rope_for(positions, self.cfg.d_head, self.cfg.rope_base, h_BTD.dtype) if self.cfg.pos == "rope" else None
        ctx = AttnContext(T=T, S=S, device=given.device,
                          slots_T=input_pos if cache is not None else None, key_padding_BS=key_padding_mask,
                          causal=True, naive=naive, rope=rope)
        records = [Record() for _ in self.blocks] if return_intermediates else None
        for layer_cache, attn in bound:  # (after every check: a call refused leaves the cache as it was)
            layer_cache.bind(attn)
        layer_caches = cache.layers if cache is not None else [None] * len(self.blocks)
        layer_records = records or [None] * len(self.blocks)
        if self.residual is None:
            for block, layer_cache, record in zip(self.blocks, layer_caches, layer_records):
                if layer_inputs is not None:
                    layer_inputs.append(h_BTD)
                h_BTD = block.checkpointed(block, h_BTD, ctx, layer_cache, record)
        else:
            h_BTD = self.residual(h_BTD, self.blocks, ctx, layer_caches, layer_records, layer_inputs)
        return self.ln_f(h_BTD), records


def init_weights(module: nn.Module, init=nn.init) -> None:
    """docs/paper.md: every Linear and Embedding N(0, 0.02), biases 0. Every other parameter gets its
    initial value where its module makes it. ``init``: the init functions to use (the Hugging Face
    wrapper's ``init_module`` passes transformers' own, which leave weights loaded from a checkpoint alone)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            init.zeros_(module.bias)


def upcast(x: Tensor) -> Tensor:
    """Low-precision logits (bf16/fp16 under autocast) to float32 for the loss."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def lm_loss(logits_BTV: Tensor, targets_BT: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy, nats, in float32 or wider (stable under autocast); targets of -100
    are ignored. ``reduction``: "mean" over counted targets, "sum", or "none" (B, T). The one loss
    of training, evaluation, analysis and the Hugging Face wrapper. Targets are integers (int32 taken as long; a
    float tensor is a ValueError, not truncated)."""
    check_integers("targets", targets_BT)
    nll = F.cross_entropy(upcast(logits_BTV).flatten(0, 1), targets_BT.flatten().long(), ignore_index=-100,
                          reduction=reduction)
    return nll.view(targets_BT.shape) if reduction == "none" else nll
