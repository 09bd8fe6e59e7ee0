"""Compiled decoding (gpt-fast's recipe): the one-token forward over the fixed-size KV cache runs
through ``torch.compile`` with fixed shapes and no host-device sync per token; on CUDA with CUDA
graphs (``mode="reduce-overhead"``). The tokens are the eager ones (tests/test_compiled.py)."""

from __future__ import annotations

import torch

from gbattn.model.generate import eager_decode_step

# Below this many new tokens, compiling costs more time than it saves (README, "Compiled training
# and decoding": compile time against the per-token gain, measured per device).
MIN_TOKENS_TO_COMPILE = {"cpu": 2000, "cuda": 64}


def compiled_decode_step(model, mode: str | None = None):
    """``step(token_B1, slot_1, position_B1 or None, key_padding_BS or None) -> logits_BV`` compiled."""
    device = next(model.parameters()).device
    # CUDA graphs on CUDA (what mode="reduce-overhead" turns on). In-place buffer reuse off: with it,
    # PyTorch 2.13's inductor miscompiles this step for a model with several layers of 3-round GBA with
    # the mlp gate (NaN logits; tests/test_compiled.py::test_compiled_decoding_inside_attention_residuals).
    options = {"inplace_buffers": False, "triton.cudagraphs": device.type == "cuda" and mode != "default"}
    return torch.compile(eager_decode_step(model), options=options, fullgraph=True, dynamic=False)


def decoder_for(model, compile: bool = True, max_new_tokens: int = 0) -> tuple[object | None, str]:
    """The decode step ``gbattn generate`` uses, and how to describe it: compiled where compiling is
    faster for this many tokens on this device (and ``compile`` is not switched off), else eager."""
    device = next(model.parameters()).device
    if compile and max_new_tokens >= MIN_TOKENS_TO_COMPILE.get(device.type, 1 << 30):
        return compiled_decode_step(model), "KV cache, compiled decode step"
    return None, "KV cache"
