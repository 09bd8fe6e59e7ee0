"""The GPT language model with the transformer block written once (SPEC.md section 1).

Pre-LN (default, paper) or Post-LN; learned absolute positions (default, paper) or RoPE;
tied input/output embeddings; dropout on the embeddings, attention probabilities, sublayer
outputs; every Linear and Embedding initialised N(0, 0.02) with zero biases. The attention
sublayer is any registered variant; the residual stream is ``plain`` or Attention Residuals.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gbattn.attention.core import AttnArgs, Intermediates, rope_tables
from gbattn.attention.registry import build_attention
from gbattn.config import ModelConfig


class MLP(nn.Module):
    """FFN d -> 4d -> d with GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_mult * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x_BTD)))


class Block(nn.Module):
    """One transformer block: an attention sublayer and an FFN sublayer, each with its norm.

    Pre-LN: ``h = h + drop(attn(ln1(h)))``, ``h = h + drop(ffn(ln2(h)))``.
    Post-LN: ``h = ln1(h + drop(attn(h)))``, ``h = ln2(h + drop(ffn(h)))``.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        args = AttnArgs(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.bias, layer_idx, cfg.n_layers)
        self.attn = build_attention(cfg.attn, args, cfg.attn_options)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def attn_branch(self, h_BTD: Tensor, record: list | None, **attn_kwargs) -> Tensor:
        """The attention sublayer's output (before it is added to the stream)."""
        x = self.ln1(h_BTD) if self.pre_norm else h_BTD
        if record is not None:
            y, inter = self.attn(x, return_intermediates=True, **attn_kwargs)
            record.append(inter)
        else:
            y = self.attn(x, **attn_kwargs)
        return self.drop(y)

    def ffn_branch(self, h_BTD: Tensor) -> Tensor:
        x = self.ln2(h_BTD) if self.pre_norm else h_BTD
        return self.drop(self.mlp(x))

    def forward(self, h_BTD: Tensor, record: list | None = None, **attn_kwargs) -> Tensor:
        if self.pre_norm:
            h_BTD = h_BTD + self.attn_branch(h_BTD, record, **attn_kwargs)
            return h_BTD + self.ffn_branch(h_BTD)
        h_BTD = self.ln1(h_BTD + self.attn_branch(h_BTD, record, **attn_kwargs))
        return self.ln2(h_BTD + self.ffn_branch(h_BTD))


class GPT(nn.Module):
    """Decoder-only language model. ``forward(idx_BT) -> logits_BTV``.

    With a cache set up (:meth:`setup_cache`), pass ``input_pos`` (T,) and the same call does
    prefill (T > 1) and decode (T = 1).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias) if cfg.norm == "pre" else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.residual = None
        if cfg.residual != "plain":
            from gbattn.model.attnres import AttnResStream

            self.residual = AttnResStream(cfg)
        self.apply(_init_weights)

    # -- sizes ---------------------------------------------------------------------
    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + (self.wpe.weight.numel() if self.wpe is not None else 0)
        return n

    # -- cache ---------------------------------------------------------------------
    def setup_cache(self, batch: int, max_len: int | None = None, dtype=None, device=None) -> None:
        max_len = max_len or self.cfg.block_size
        self._check_length(max_len)
        ref = self.wte.weight
        for block in self.blocks:
            block.attn.setup_cache(batch, max_len, dtype or ref.dtype, device or ref.device)

    def clear_cache(self) -> None:
        for block in self.blocks:
            block.attn.clear_cache()

    @property
    def has_cache(self) -> bool:
        return len(self.blocks[0].attn.caches) > 0

    def _check_length(self, length: int) -> None:
        if length > self.cfg.block_size:
            raise ValueError(
                f"sequence length {length} exceeds block_size={self.cfg.block_size} (the position table); "
                f"use at most {self.cfg.block_size} tokens or a model with a larger block_size"
            )

    # -- forward -------------------------------------------------------------------
    def forward(
        self,
        idx_BT: Tensor,
        targets_BT: Tensor | None = None,
        *,
        input_pos: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        naive: bool = False,
        return_intermediates: bool = False,
        loss_chunk: int | None = None,
    ):
        """Logits (B, T, V), or with ``targets_BT`` the mean next-token cross-entropy; with
        ``return_intermediates`` also one :class:`Intermediates` per layer.

        ``input_pos`` (T,): absolute positions of the tokens (default 0..T-1; required with a
        cache). ``key_padding_mask`` (B, S): True for real tokens. ``naive``: reference path.
        """
        h_BTD, record = self.hidden(idx_BT, input_pos, key_padding_mask, naive, return_intermediates)
        out = self.lm_head(h_BTD) if targets_BT is None else self.chunked_loss(h_BTD, targets_BT, loss_chunk)
        return (out, record) if return_intermediates else out

    def chunked_loss(self, h_BTD: Tensor, targets_BT: Tensor, chunk_tokens: int | None = None) -> Tensor:
        """Mean cross-entropy of the LM head over chunks of ``chunk_tokens`` rows, so no (B*T, V)
        logits tensor is held at once. On CPU the default keeps each chunk near 16 MB: large
        fresh allocations are page-faulted on every step, and this measured 1.7x faster end to
        end (README, "Choosing cpu-proxy"). Targets of -100 are ignored."""
        h_ND, y_N = h_BTD.flatten(0, 1), targets_BT.flatten()
        if chunk_tokens is None:
            chunk_tokens = max(64, (4 << 20) // self.cfg.vocab_size) if h_ND.device.type == "cpu" else h_ND.shape[0]
        total = 0.0
        for start in range(0, h_ND.shape[0], chunk_tokens):
            logits = _upcast(self.lm_head(h_ND[start : start + chunk_tokens]))
            total = total + F.cross_entropy(logits, y_N[start : start + chunk_tokens], reduction="sum")
        return total / (y_N != -100).sum().clamp_min(1)

    def hidden(
        self,
        idx_BT: Tensor,
        input_pos: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        naive: bool = False,
        return_intermediates: bool = False,
    ) -> tuple[Tensor, list[Intermediates] | None]:
        """Final hidden states (after the final norm), (B, T, D), and the intermediates record."""
        B, T = idx_BT.shape
        if input_pos is None:
            if self.has_cache:
                raise ValueError("a KV cache is set up: pass input_pos (positions of these tokens)")
            self._check_length(T)
            pos_T = torch.arange(T, device=idx_BT.device)
        else:
            pos_T = input_pos
            if pos_T.numel() and int(pos_T.max()) >= self.cfg.block_size:
                self._check_length(int(pos_T.max()) + 1)
        h_BTD = self.wte(idx_BT)
        if self.wpe is not None:
            h_BTD = h_BTD + self.wpe(pos_T)
        h_BTD = self.drop(h_BTD)
        rope = rope_tables(pos_T, self.cfg.d_head, self.cfg.rope_base, h_BTD.dtype) if self.cfg.pos == "rope" else None
        attn_kwargs = dict(key_padding_mask=key_padding_mask, input_pos=input_pos, rope=rope, naive=naive)
        record: list[Intermediates] | None = [] if return_intermediates else None
        if self.residual is None:
            for block in self.blocks:
                h_BTD = block(h_BTD, record, **attn_kwargs)
        else:
            h_BTD = self.residual(h_BTD, self.blocks, record, attn_kwargs)
        return self.ln_f(h_BTD), record


def _init_weights(module: nn.Module) -> None:
    """SPEC.md: every Linear and Embedding N(0, 0.02), biases 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def _upcast(x: Tensor) -> Tensor:
    """Low-precision logits (bf16/fp16 under autocast) to float32 for the loss."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def lm_loss(logits_BTV: Tensor, targets_BT: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy (float32 for stability under autocast)."""
    return F.cross_entropy(_upcast(logits_BTV).flatten(0, 1), targets_BT.flatten(), ignore_index=ignore_index)
