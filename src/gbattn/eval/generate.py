"""Text generation with the KV cache (one forward signature for prefill and decode)."""

from __future__ import annotations

import torch
from torch import Tensor


def sample_next(logits_BV: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """Next token ids (B, 1): greedy at temperature 0, else softmax sampling with optional top-k."""
    if temperature <= 0:
        return logits_BV.argmax(-1, keepdim=True)
    logits_BV = logits_BV / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    probs = torch.softmax(logits_BV.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model,
    idx_BT: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> Tensor:
    """Continue ``idx_BT`` by ``max_new_tokens`` tokens; returns (B, T + max_new_tokens).

    With the cache: one prefill of the prompt, then one decode step per token. Once the
    sequence fills the model's position table (``block_size``), later tokens are predicted from
    the last ``block_size`` tokens without a cache, as nanoGPT does.
    """
    was_training = model.training
    model.eval()
    device = idx_BT.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    block = model.cfg.block_size
    B, T = idx_BT.shape
    if T == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if T > block:
        idx_BT = idx_BT[:, -block:]
        T = block
    out = idx_BT
    cached = use_cache and T < block
    if cached:
        model.setup_cache(B, max_len=min(block, T + max_new_tokens))
        logits = model(out, input_pos=torch.arange(T, device=device))[:, -1]
    try:
        for _ in range(max_new_tokens):
            if not cached:
                logits = model(out[:, -block:])[:, -1]
            nxt = sample_next(logits, temperature, top_k, generator)
            out = torch.cat([out, nxt], dim=1)
            pos = out.shape[1] - 1
            if cached and pos < min(block, T + max_new_tokens):
                logits = model(nxt, input_pos=torch.tensor([pos], device=device))[:, -1]
            elif cached:
                model.clear_cache()
                cached = False
    finally:
        model.clear_cache()
        model.train(was_training)
    return out
