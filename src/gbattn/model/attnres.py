"""Attention Residuals (Kimi Team, arXiv 2603.15031; docs/baselines.md): attention over depth
instead of the plain residual sum.

Sublayers (each attention and each FFN counts once) are numbered l = 0 .. 2L-1. Sources:
v_0 = the embedding (tokens + positions), v_{i+1} = the raw output of sublayer i. The input of
sublayer l is ``h_l = sum_{i=0..l} softmax_i(w_l . RMSNorm_l(v_i)) v_i`` (the embedding and the outputs of sublayers
0 .. l-1) with a zero-initialised
pseudo-query ``w_l`` (uniform weights at the start), one RMSNorm with gain per sublayer and no
1/sqrt(d); the sublayer still applies its own pre-norm to h_l. A last aggregation with its own
w feeds the final norm. Block AttnRes sums the outputs inside a block of S sublayers into a
partial b_n; the sources are [embedding, completed blocks, the partial block if non-empty].
S = 1 is Full AttnRes. The mixing is per position, so causality and KV caching are unchanged.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn

from gbattn.config import ModelConfig


class AttnResStream(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_sublayers = 2 * cfg.n_layers
        self.block_size = 1 if cfg.residual == "attnres-full" else cfg.attnres_block
        # One pseudo-query and one key norm per sublayer, plus one for the final aggregation.
        self.queries = nn.Parameter(torch.empty(self.n_sublayers + 1, cfg.d_model))
        self.init_own_parameters()
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.d_model) for _ in range(self.n_sublayers + 1))
        self.freeze_untrained()

    def freeze_untrained(self) -> None:
        """Sublayer 0 mixes one source (the embedding) in every mode: its norm never gets a gradient. Not trained,
        so optimizers and sharded checkpoints hold no state for it (also called by a loader that makes the
        parameters anew, e.g. transformers 5's from_pretrained)."""
        self.norms[0].weight.requires_grad_(False)

    def init_own_parameters(self, init=nn.init) -> None:
        """The pseudo-queries start at 0 (every depth mixture starts uniform)."""
        init.zeros_(self.queries)

    def mixture_sizes(self) -> list[int]:
        """The number of sources each aggregation mixes (the sublayers', then the final one's): the embedding,
        the ``l // S`` blocks completed before sublayer ``l``, and its block's partial sum if it has begun."""
        S = self.block_size
        return [1 + index // S + (1 if index % S else 0) for index in range(self.n_sublayers + 1)]

    def mixture_flops_per_token(self, d_model: int) -> int:
        """Forward FLOPs per token of the weighted sums over depth, ``2 N d`` for each mixture of N > 1 sources
        (docs/baselines.md, "Comparison rules"). They run as broadcast products, which
        ``torch.utils.flop_counter`` does not see, so :func:`gbattn.model.params.flops_per_token` adds them."""
        return sum(2 * n * d_model for n in self.mixture_sizes() if n > 1)

    def depth_weights(self, index: int, sources: list[Tensor]) -> Tensor:
        """Softmax over the sources, per position: (N, B, T)."""
        return self._depth_weights(index, torch.stack(sources))

    def _depth_weights(self, index: int, sources_NBTD: Tensor) -> Tensor:
        """``softmax_i(w . RMSNorm(v_i))`` computed as ``softmax_i((v_i . (g * w)) / rms(v_i))``: the same
        numbers, without a normalised copy of every source (which, kept for the backward pass beside the
        stacked sources, made a step of this stream cost 1.9x the plain stream's memory; README, "Residual
        streams"). ``eps`` is the one the norm module would use: nn.RMSNorm's default is that of the type
        it computes in, float32 at least (bfloat16's own, 0.0078, shrank the depth logits of embedding-sized
        sources 3-5x)."""
        norm = self.norms[index]
        accumulate = torch.promote_types(sources_NBTD.dtype, torch.float32)  # as RMSNorm's, float32 at least
        eps = norm.eps if norm.eps is not None else torch.finfo(accumulate).eps
        inv_rms_NBT = torch.rsqrt(sources_NBTD.pow(2).mean(-1, dtype=accumulate) + eps)
        logits_NBT = (sources_NBTD @ (norm.weight * self.queries[index])) * inv_rms_NBT
        return torch.softmax(logits_NBT, dim=0).to(sources_NBTD.dtype)

    def mix(self, index: int, sources: list[Tensor]) -> Tensor:
        """h = sum_i alpha_i v_i for aggregation ``index`` (a sublayer, or the final one)."""
        if len(sources) == 1:
            return sources[0]  # softmax over one source is exactly 1
        # In the stream's dtype (the embedding's; a cheap reduction over depth): under autocast the depth
        # logits and the mixture would be rounded to bf16, while the plain stream's h + sublayer(h) stays
        # float32 (tests/test_attnres.py). The meta device (count_params, flops_per_token) has no autocast; a compiled
        # model runs on a device that has (torch 2.11's dynamo cannot trace is_autocast_available: compiled decoding
        # of this stream failed there)
        device = sources[0].device.type
        with torch.autocast(device, enabled=False) if (torch.compiler.is_compiling()
                                                        or torch.amp.is_autocast_available(device)) else nullcontext():
            sources_NBTD = torch.stack(sources)  # one copy, read by the weights and the sum
            alpha_NBT = self._depth_weights(index, sources_NBTD)
            # (a broadcast product summed over depth: einsum's batched (1 x N) @ (N x D) products, one per position,
            # ran one small matrix product per position on CPU)
            return (alpha_NBT[..., None] * sources_NBTD).sum(0)

    def forward(self, emb_BTD: Tensor, blocks: nn.ModuleList, ctx, caches: list, records: list,
                layer_inputs: list | None = None) -> Tensor:
        """The stream through every sublayer of ``blocks``; ``caches`` and ``records`` one per block;
        ``layer_inputs``: a list to which each block's attention input h_{2i} is appended."""
        completed: list[Tensor] = [emb_BTD]
        partial: Tensor | None = None
        in_block = 0
        for sub in range(self.n_sublayers):
            h_BTD = self.mix(sub, completed + ([partial] if partial is not None else []))
            i = sub // 2
            if sub % 2 == 0 and layer_inputs is not None:
                layer_inputs.append(h_BTD)
            v_BTD = (
                blocks[i].checkpointed(blocks[i].attn_branch, h_BTD, ctx, caches[i], records[i])
                if sub % 2 == 0
                else blocks[i].checkpointed(blocks[i].ffn_branch, h_BTD)
            )
            # a block's sum in the stream's dtype (a sublayer's output is bf16 under autocast), as the plain stream's
            partial = v_BTD.to(emb_BTD.dtype) if partial is None else partial + v_BTD
            in_block += 1
            if in_block == self.block_size:
                completed.append(partial)
                partial, in_block = None, 0
        return self.mix(self.n_sublayers, completed + ([partial] if partial is not None else []))
