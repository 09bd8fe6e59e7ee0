"""Perplexity over non-overlapping rows (the paper's evaluation: docs/paper.md)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from gbattn.checks import checked
from gbattn.data.tokens import num_rows, rows_batch
from gbattn.model.decoding import restore_modes, set_eval
from gbattn.model.gpt import lm_loss


def perplexity(loss_nats: float) -> float:
    """exp(loss), infinite from a loss of 50 nats (exp would be ~5e21 there: no model worth a perplexity); NaN for a
    NaN loss (a model whose outputs are NaN has none: it was called infinite)."""
    if math.isnan(loss_nats):
        return float("nan")
    return math.exp(loss_nats) if loss_nats < 50 else float("inf")


@dataclass
class EvalResult:
    loss: float  # mean next-token cross-entropy, nats
    tokens: int  # number of predicted tokens
    per_token: np.ndarray | None = None  # (tokens,) losses in row order, if asked

    @property
    def ppl(self) -> float:
        return perplexity(self.loss)


@torch.no_grad()
def evaluate(
    model,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    autocast=None,
    dist_env=None,
    per_token: bool = False,
    progress=None,
) -> EvalResult:
    """Mean loss over every non-overlapping row of ``seq_len + 1`` tokens of ``tokens`` (fewer tokens
    than one row: a ValueError). Under DDP each process takes a slice of the rows and the sums are all-reduced. The
    model's mode and KV cache are as they were afterwards."""
    # (a batch_size of 0 divided by zero; a seq_len of 0 was the model's "token ids of shape (32, 0)")
    seq_len = checked("seq_len", seq_len, int, lambda n: n >= 1, "an integer >= 1 (input tokens per row)")
    batch_size = checked("batch_size", batch_size, int, lambda n: n >= 1, "an integer >= 1 (rows per batch)")
    # (per_token="no" was true; float ids were cut to integers, 1.9 read as 1; a (1, N) array counted as 1 token)
    per_token = checked("per_token", per_token, bool, None, "True or False")
    shape, dtype = getattr(tokens, "shape", None), getattr(tokens, "dtype", None)
    integer = (np.issubdtype(dtype, np.integer) if isinstance(dtype, np.dtype) else isinstance(dtype, torch.dtype)
               and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool))
    if shape is None or len(shape) != 1 or not integer:
        raise ValueError(f"tokens of shape {tuple(shape) if shape is not None else '?'} and dtype {dtype}: give "
                         f"one row of integer token ids (a 1-D array)")
    for name, function in (("progress", progress), ("autocast", autocast)):
        if function is not None and not callable(function):  # (it failed after the first batch, "not callable")
            raise ValueError(f"{name} of type {type(function).__name__}: give a function, or None")
    rows = np.arange(num_rows(tokens, seq_len))
    if not len(rows):  # else a loss of 0 over no tokens: perplexity 1.0
        raise ValueError(f"{len(tokens):,} tokens: fewer than one row of seq_len + 1 = {seq_len + 1}, nothing to "
                         f"evaluate")
    modes, callers_cache = set_eval(model), getattr(model, "kv_cache", None)
    if callers_cache is not None:  # a KV cache the caller set up (setup_cache) is set aside, as generate() does:
        model.clear_cache()  # every forward here is a whole row (with it, each was refused for lacking input_pos)
    n_batches = math.ceil(len(rows) / batch_size)
    if dist_env is not None and dist_env.enabled:
        # Every process runs the same number of forward passes (FSDP2 gathers parameters in each);
        # a process out of rows repeats one with weight 0.
        n_batches = math.ceil(math.ceil(len(rows) / dist_env.world) / batch_size)
        rows = rows[dist_env.rank :: dist_env.world]
    # per-token losses go into one array made at the first batch: each batch's own small array, kept, broke up the
    # heap between the logits of successive batches, which could not be reused (`eval --per-token` of WikiText-2 at
    # batch 8: 5.06 GB peak for 1.26 MB of losses; 327 MB without them)
    total, count, losses, filled = 0.0, 0, None, 0
    autocast = autocast or contextlib.nullcontext
    try:  # a forward that raises leaves the model in the mode it was given in
        for b in range(n_batches):
            batch_rows = rows[b * batch_size : (b + 1) * batch_size]
            weight = 1.0 if len(batch_rows) else 0.0
            x, y = rows_batch(tokens, seq_len, batch_rows if len(batch_rows) else np.arange(1))
            x, y = x.to(device), y.to(device)
            with autocast():
                logits = model(x)
            nll = lm_loss(logits, y, reduction="none")
            # summed in float64: a float32 sum's rounding depended on the batch size (eval --batch-size 5 and 7 gave
            # other losses, and a resume with another eval_batch_size recorded others)
            total += weight * nll.double().sum().item()
            count += int(weight * nll.numel())
            if per_token and weight:
                if losses is None:
                    losses = torch.empty(len(rows) * seq_len, dtype=nll.dtype)
                losses[filled : filled + nll.numel()].copy_(nll.flatten())
                filled += nll.numel()
            if progress is not None:
                progress(len(batch_rows))
        if dist_env is not None and dist_env.enabled:
            total, count = dist_env.all_sum([total, float(count)])
    finally:
        restore_modes(modes)
        if callers_cache is not None:
            model.kv_cache = callers_cache
    return EvalResult(
        loss=total / max(count, 1),
        tokens=int(count),
        per_token=losses[:filled].numpy() if per_token and losses is not None else None,
    )
