"""Perplexity over non-overlapping rows (the paper's evaluation: SPEC.md section 1)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gbattn.data.tokens import num_rows, rows_batch


@dataclass
class EvalResult:
    loss: float  # mean next-token cross-entropy, nats
    tokens: int  # number of predicted tokens
    per_token: np.ndarray | None = None  # (tokens,) losses in row order, if asked

    @property
    def ppl(self) -> float:
        return math.exp(self.loss) if self.loss < 50 else float("inf")


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
    """Mean loss over every non-overlapping row of ``seq_len + 1`` tokens of ``tokens``.
    Under DDP each process takes a slice of the rows and the sums are all-reduced."""
    was_training = model.training
    model.eval()
    rows = np.arange(num_rows(tokens, seq_len))
    if dist_env is not None and dist_env.enabled:
        rows = rows[dist_env.rank :: dist_env.world]
    total, count, losses = 0.0, 0, []
    autocast = autocast or contextlib.nullcontext
    for start in range(0, len(rows), batch_size):
        x, y = rows_batch(tokens, seq_len, rows[start : start + batch_size])
        x, y = x.to(device), y.to(device)
        with autocast():
            logits = model(x)
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        total += nll.sum().item()
        count += nll.numel()
        if per_token:
            losses.append(nll.cpu().numpy())
        if progress is not None:
            progress(len(x))
    if dist_env is not None and dist_env.enabled:
        total, count = dist_env.all_sum([total, float(count)])
    model.train(was_training)
    return EvalResult(
        loss=total / max(count, 1),
        tokens=int(count),
        per_token=np.concatenate(losses) if per_token and losses else None,
    )
