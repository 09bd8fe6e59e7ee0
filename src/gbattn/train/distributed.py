"""Several processes through ``torchrun``: PyTorch's DDP (the default: every process holds the whole
model) or FSDP2 (``fully_shard``: parameters, gradients and optimizer state sharded over the
processes, each attention and FFN sublayer a unit), with gloo on CPU and NCCL on CUDA. Checkpoints are always full
(one file, loadable by any number of processes) and keyed by parameter name."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from gbattn.errors import UserError
from gbattn.parent_death import stop_with_parent
from gbattn.runtime import launched_processes


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        return t.cpu().tolist()

    def raise_together(self, error: UserError | None) -> None:
        """A collective in place of a barrier: raise this process's ``error``, or another process's, on
        every process, so that a mistake one process finds (a run directory in use, missing data) ends
        them all with its one line instead of leaving the others to fail waiting for it."""
        errors = [e for e in self.gather(None if error is None else (str(error), getattr(error, "exit_code", 2))) if e]
        if error is not None:
            raise error
        if errors:
            shared = UserError(errors[0][0])
            shared.exit_code = errors[0][1]
            raise shared

    def main_only(self, work):
        """``work()`` on the main process, the others waiting for it; its UserError is every process's
        (:meth:`raise_together`). Returns its result on the main process, None on the others."""
        result, error = None, None
        if self.is_main:
            try:
                result = work()
            except UserError as e:
                error = e
        self.raise_together(error)
        return result

    def main_first(self, work):
        """``work()`` on the main process, then on the others (which read the caches it built); a
        UserError on any process is every process's (:meth:`raise_together`)."""
        result = self.main_only(work)
        if not self.is_main:
            error = None
            try:
                result = work()
            except UserError as e:
                error = e
            self.raise_together(error)
        elif self.enabled:
            self.raise_together(None)
        return result

    def gather(self, obj) -> list:
        """``obj`` from every process, in rank order (a one-item list in one process)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def no_sync(self, model: torch.nn.Module, last_micro_step: bool, parallel: str):
        """Skip the gradient all-reduce on all but the last micro-step of gradient accumulation."""
        if not self.enabled or last_micro_step:
            if self.enabled and parallel == "fsdp2":
                model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if parallel == "fsdp2":
            model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return model.no_sync()


# What torchrun sets for each process it starts, besides WORLD_SIZE: joining the process group reads them.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(device_type: str) -> DistEnv:
    """Join the process group that ``torchrun`` describes in the environment (if any). A WORLD_SIZE without
    the rest of what torchrun sets (a job script's export, a process not started by torchrun) is one line."""
    world = launched_processes()
    if world <= 1:
        return DistEnv()
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name, "").strip()]
    ranks = [os.environ.get(name, "").strip() for name in ("RANK", "LOCAL_RANK")]
    if missing or not all(r.isdigit() and int(r) < world for r in ranks):
        wrong = (f"no {', '.join(missing)}" if missing
                 else f"RANK={ranks[0]!r} and LOCAL_RANK={ranks[1]!r}, not both process numbers below it")
        raise UserError(f"WORLD_SIZE={world} in the environment, but {wrong}: torchrun sets them all for each process "
                        f"it starts (torchrun --nproc_per_node N -m gbattn.cli train ...); unset WORLD_SIZE to train "
                        f"in one process")
    stop_with_parent()  # torchrun killed (kill -9): its workers, in sessions of their own, would train on unseen
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistEnv(rank=dist.get_rank(), local_rank=int(os.environ.get("LOCAL_RANK", "0")), world=dist.get_world_size())


def shutdown_distributed() -> None:
    """Leave the process group. First a pause with the GIL released: torch 2.13's gloo frees finished
    collectives (their Python tensors) on its own threads, which need the GIL; the model's DDP reducer,
    freed later with the GIL held, joins those threads, so a collective not yet freed then deadlocks
    the process at exit (seen in CI at the end of a finished two-process run)."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            time.sleep(0.5)
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, parallel: str, env: DistEnv, device: torch.device,
               amp: str = "auto") -> torch.nn.Module:
    """The module the training step calls: the model itself (one process), DDP, or the model with
    every attention and FFN sublayer and then the root sharded by FSDP2 (embeddings, tied head, norms
    and the AttnRes stream live in the root unit). On CUDA, where ``amp`` computes in bf16 (``auto``, ``bf16``),
    FSDP2 computes in bf16 and reduces gradients in float32; with ``amp=off`` in float32 (its bf16 was kept)."""
    if not env.enabled:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if device.type == "cuda" and amp != "off" and torch.cuda.is_bf16_supported():
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # the sublayers, not the block: Attention Residuals call them one at a time
        fully_shard(block.attn, mp_policy=policy)
        fully_shard(block.mlp, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _inner(step_model: torch.nn.Module) -> torch.nn.Module:
    return step_model.module if hasattr(step_model, "module") else step_model


def full_state(step_model: torch.nn.Module, optimizer=None) -> tuple[dict, dict | None]:
    """Full (unsharded) model and optimizer state dicts, keyed by parameter name, on the CPU.
    A collective under FSDP2: every process calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_state_dict(_inner(step_model), [], options=options)[0], None
    return get_state_dict(_inner(step_model), optimizer, options=options)


def load_full_state(
    step_model: torch.nn.Module, model_state: dict, optimizer=None, optim_state: dict | None = None
) -> None:
    """Load :func:`full_state`'s dicts into a (possibly sharded) model and optimizer. An optimizer
    state keyed by parameter index (checkpoints written before FSDP2 support) is loaded as such."""
    # set_state_dict's strict=True lets a missing weight keep its initial value (torch 2.13): checked here.
    expected, given = set(_inner(step_model).state_dict()), set(model_state)
    if expected != given:
        missing, unexpected = sorted(expected - given), sorted(given - expected)
        raise ValueError("its model weights do not match the model ("
                         + "; ".join(f"{what}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
                                     for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
                         + ")")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False, strict=True)
    if optim_state is not None and any(isinstance(k, int) for k in optim_state.get("state", {})):
        _inner(step_model).load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    if optimizer is None or optim_state is None:
        set_state_dict(_inner(step_model), [], model_state_dict=model_state, optim_state_dict={}, options=options)
        return
    set_state_dict(_inner(step_model), optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=options)
