"""Rebuild a trained model from its run directory alone (config.json, tokenizer.json, weights)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gbattn.config import ModelConfig
from gbattn.data.tokenizer import Tokenizer
from gbattn.errors import CheckpointError
from gbattn.model.gpt import GPT
from gbattn.train import checkpoint as ckpt
from gbattn.train.config import TrainConfig

WHICH = ("best", "last")


@dataclass
class LoadedRun:
    run_dir: Path
    model: GPT
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    tokenizer: Tokenizer
    config: dict  # config.json as written
    step: int

    @property
    def seq_len(self) -> int:
        return self.config.get("seq_len") or self.model_cfg.block_size - 1


def load_run(run_dir: str | Path, which: str = "best", device: str | torch.device = "cpu") -> LoadedRun:
    """The model of ``run_dir`` with its best-validation (or last) weights, in eval mode."""
    run_dir = Path(run_dir)
    if which not in WHICH:
        raise CheckpointError(f"checkpoint={which!r} is not allowed; choose one of {', '.join(WHICH)}")
    config = ckpt.read_json(run_dir / ckpt.CONFIG)
    model_cfg = ModelConfig.from_dict(config["model"])
    train_cfg = TrainConfig.from_dict(config["train"])
    tok_path = run_dir / ckpt.TOKENIZER
    if not tok_path.is_file():
        raise CheckpointError(f"{tok_path} not found: is {run_dir} a gbattn run directory?")
    tokenizer = Tokenizer.load(tok_path)
    path = run_dir / (ckpt.BEST if which == "best" else ckpt.CHECKPOINT)
    if which == "best" and not path.exists():
        path = run_dir / ckpt.CHECKPOINT  # no evaluation happened yet
    state = ckpt.load_checkpoint(path, map_location=device)
    model = GPT(model_cfg).to(device)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path} does not match {run_dir / ckpt.CONFIG} ({str(e).splitlines()[0][:120]})") from None
    model.eval()
    return LoadedRun(run_dir, model, model_cfg, train_cfg, tokenizer, config, int(state.get("step", 0)))
