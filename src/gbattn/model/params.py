"""Parameter counts, forward FLOPs (measured by ``torch.utils.flop_counter``) and the
parameter-matched width solver ("param-fair" baseline, docs/baselines.md)."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from gbattn.checks import checked
from gbattn.config import MAX_D_MODEL, ModelConfig
from gbattn.errors import ConfigError
from gbattn.model.gpt import GPT, check_model_config, lm_loss


def count_params(cfg: ModelConfig) -> int:
    """Exact parameter count (tied weights counted once), built on the meta device: no memory (README,
    "Presets and parameter counts"; per round: docs/method.md, "Cost")."""
    check_model_config(cfg, "count_params")
    with torch.device("meta"):
        return GPT(cfg).num_params()


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, backward: bool = False,
                    recomputed: bool = False) -> float:
    """Forward (or forward + backward) FLOPs per token at ``seq_len`` (default block_size),
    counted by ``torch.utils.flop_counter`` on the meta device (matmuls and SDPA; docs/method.md, "Cost"),
    plus AttnRes's weighted sums over depth, counted from their sizes (the backward pass twice the forward's).
    ``recomputed``: a training step with activation checkpointing, whose backward pass runs each block's forward
    again (not the LM head's, nor AttnRes's sums over depth)."""
    check_model_config(cfg, "flops_per_token")
    if seq_len is not None:  # an integer as a config field takes it (numpy's too): 2.5 or True is a ConfigError
        # (0 was read as "the default" and gave block_size's figure; -1 a torch error on the meta device)
        seq_len = checked("seq_len", seq_len, int, lambda n: n >= 1, "an integer >= 1 (or None: block_size)")
    # (a string read as True: backward="no" gave the forward + backward figure, three times the forward's)
    backward = checked("backward", backward, bool, None, "True or False")
    recomputed = checked("recomputed", recomputed, bool, None, "True or False")
    if recomputed and not backward:
        raise ValueError("recomputed=True counts a training step's recomputation in its backward pass: give "
                         "backward=True too")
    T = seq_len or cfg.block_size
    # (the caller's torch.no_grad() or inference_mode left nothing to backward, and its anomaly detection read a meta
    # tensor's value: each a RuntimeError from train_run)
    with (torch.device("meta"), torch.inference_mode(False), torch.enable_grad(),
          torch.autograd.set_detect_anomaly(False)):
        model = GPT(cfg)
        # (torch's own recomputation, whatever a caller set as the model's: the count is of the arithmetic)
        model.set_activation_checkpointing(recomputed, checkpoint_fn=partial(checkpoint, use_reentrant=False))
        idx = torch.zeros(1, T, dtype=torch.long)
        counter = FlopCounterMode(display=False)
        with counter:
            logits = model(idx)
            if backward:
                lm_loss(logits, idx).backward()
    depth_sums = model.residual.mixture_flops_per_token(cfg.d_model) if model.residual is not None else 0
    return counter.get_total_flops() / T + depth_sums * (3 if backward else 1)


def param_matched_width(cfg: ModelConfig, target_params: int) -> tuple[int, int]:
    """Smallest ``d_model`` (a multiple of n_heads, of 2 n_heads with RoPE) whose STANDARD model with ``cfg``'s other
    settings has at least ``target_params`` parameters. Returns (width, its parameter count)
    (docs/baselines.md, "Comparison rules")."""
    check_model_config(cfg, "param_matched_width")
    # (NaN compared false and gave cfg's own width, a negative or zero count the narrowest width, a string
    # Python's "'<' not supported between instances of 'int' and 'str'")
    target_params = checked("target_params", target_params, int, lambda n: n >= 1, "an integer >= 1 (a parameter "
                            "count, e.g. count_params(cfg))")
    step = cfg.n_heads * (2 if cfg.pos == "rope" else 1)  # RoPE rotates pairs: an even head width
    base = cfg.replace(attn="standard", attn_options={})
    # Parameter count grows monotonically with width: double to bracket (up to the widest a config takes: a width past
    # it was refused as if the caller had asked for it), then bisect.
    widest = MAX_D_MODEL // step * step
    hi = max(step, (cfg.d_model // step) * step)
    while count_params(base.replace(d_model=hi)) < target_params and hi < widest:
        hi = min(2 * hi, widest)
    if count_params(base.replace(d_model=hi)) < target_params:
        raise ConfigError(f"no standard model up to d_model={widest:,} has {target_params:,} parameters, so none "
                          f"matches them")
    lo = step
    while lo < hi:
        mid = ((lo + hi) // 2 // step) * step
        mid = max(mid, lo)
        if count_params(base.replace(d_model=mid)) >= target_params:
            hi = mid
        else:
            lo = mid + step
    return lo, count_params(base.replace(d_model=lo))
