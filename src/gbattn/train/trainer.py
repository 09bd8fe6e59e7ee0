"""The one training loop: AdamW, warmup + cosine, clipping, gradient accumulation, bf16 autocast
and ``torch.compile`` on CUDA, DDP through ``torchrun``, evaluation every epoch (and every N
steps), best-validation checkpoint, final test perplexity from the best checkpoint, exact
resume on CPU, atomic checkpoints, and a stop on a non-finite loss.
"""

from __future__ import annotations

import contextlib
import math
import platform
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gbattn import __version__
from gbattn.config import ModelConfig
from gbattn.data.corpus import load_corpus
from gbattn.data.tokenizer import Tokenizer, get_tokenizer
from gbattn.data.tokens import epoch_permutation, num_rows, random_windows, rows_batch, tokenize_corpus
from gbattn.errors import CheckpointError, DataError, UserError
from gbattn.eval.perplexity import evaluate
from gbattn.model.gpt import GPT
from gbattn.model.params import flops_per_token
from gbattn.progress import Progress
from gbattn.train import checkpoint as ckpt
from gbattn.train.config import TrainConfig
from gbattn.train.distributed import DistEnv, init_distributed


class TrainingDiverged(UserError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""

    exit_code = 3


class TrainingInterrupted(UserError):
    """SIGINT or SIGTERM: a checkpoint was saved at a step boundary; ``--resume`` continues."""

    exit_code = 130


# --------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={name!r} but CUDA is not available here; use --device cpu")
    return torch.device(name)


def learning_rate(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine to ``min_lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_matrices_only:
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    else:
        groups = [{"params": params, "weight_decay": cfg.weight_decay}]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass
class Data:
    tokenizer: Tokenizer
    splits: dict  # split -> np.ndarray of token ids
    corpus_name: str
    corpus_fingerprint: str
    notes: list


def prepare_data(cfg: TrainConfig, vocab_size: int, tokenizer: Tokenizer | None = None, progress: bool = True) -> Data:
    """Corpus -> tokenizer (trained once, cached) -> token memmaps (cached)."""
    corpus = load_corpus(cfg.data, tuple(cfg.split))
    tok = tokenizer or get_tokenizer(cfg.tokenizer, corpus, vocab_size=vocab_size, verbose=progress)
    caps = {"train": cfg.train_tokens, "valid": cfg.eval_tokens, "test": cfg.eval_tokens}
    splits = tokenize_corpus(corpus, tok, caps, progress=progress)
    return Data(tok, splits, corpus.name, corpus.fingerprint, corpus.notes)


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to checkpoint and stop at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.requested = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# --------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------


class Trainer:
    """Train one model into ``run_dir``. ``Trainer(...).run()`` returns the result record."""

    def __init__(self, run_dir: str | Path, model_cfg: ModelConfig | None = None, train_cfg: TrainConfig | None = None,
                 resume: bool = False, quiet: bool = False, extra: dict | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.quiet = quiet
        self.extra = extra or {}  # recorded in config.json (e.g. the compare runner's labels)
        config_path = self.run_dir / ckpt.CONFIG
        if resume:
            saved = ckpt.read_json(config_path)
            self.model_cfg = ModelConfig.from_dict(saved["model"])
            self.train_cfg = TrainConfig.from_dict(saved["train"])
            self.extra = saved.get("extra", {})
        else:
            if (self.run_dir / ckpt.CHECKPOINT).exists() or config_path.exists():
                raise UserError(f"{self.run_dir} already holds a run; pass --resume to continue it, or choose another --out")
            if model_cfg is None or train_cfg is None:
                raise ValueError("model_cfg and train_cfg are required for a new run")
            self.model_cfg, self.train_cfg = model_cfg, train_cfg
        if not self.train_cfg.data:
            raise UserError("no --data given")

    # -- setup ---------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.train_cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        requested = resolve_device(cfg.device)
        self.dist: DistEnv = init_distributed(requested.type)
        self.device = resolve_device(cfg.device, self.dist.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        use_bf16 = cfg.amp == "bf16" or (cfg.amp == "auto" and self.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        self.main = self.dist.is_main
        self.show = self.main and not self.quiet

        # Data: the main process builds the caches first, the others then read them.
        saved_tok = self.run_dir / ckpt.TOKENIZER
        tokenizer = Tokenizer.load(saved_tok) if self.resume and saved_tok.is_file() else None
        if not self.main:
            self.dist.barrier()
        self.data = prepare_data(cfg, self.model_cfg.vocab_size, tokenizer, progress=self.show)
        if self.main:
            self.dist.barrier()
        if self.data.tokenizer.vocab_size != self.model_cfg.vocab_size:
            if self.resume:
                raise CheckpointError("the tokenizer's vocabulary no longer matches the saved model config")
            self.model_cfg = self.model_cfg.replace(vocab_size=self.data.tokenizer.vocab_size)
        self.seq_len = cfg.seq_len or self.model_cfg.block_size - 1
        if self.seq_len > self.model_cfg.block_size:
            raise UserError(f"seq_len={self.seq_len} exceeds block_size={self.model_cfg.block_size}")

        train = self.data.splits["train"]
        per_rank, rem = divmod(cfg.batch_size, self.dist.world * cfg.grad_accum)
        if rem or per_rank == 0:
            raise UserError(
                f"batch_size={cfg.batch_size} must be divisible by processes x grad_accum = {self.dist.world} x {cfg.grad_accum}"
            )
        self.micro_batch = per_rank
        if cfg.sampling == "rows":
            self.n_rows = num_rows(train, self.seq_len)
            self.steps_per_epoch = self.n_rows // cfg.batch_size
            if self.steps_per_epoch == 0:
                raise DataError(
                    f"the training split has {len(train):,} tokens: fewer than one batch of "
                    f"{cfg.batch_size} rows of {self.seq_len + 1} tokens"
                )
            self.total_steps = cfg.max_steps or math.ceil(cfg.epochs * self.steps_per_epoch)
        else:
            if len(train) <= self.seq_len + 1:
                raise DataError(f"the training split has {len(train)} tokens: fewer than one window of {self.seq_len + 1}")
            self.steps_per_epoch = None
            self.total_steps = cfg.max_steps

        torch.manual_seed(cfg.seed)  # identical initial weights on every process
        self.model = GPT(self.model_cfg).to(self.device)
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        self.step_model = self.model
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.step_model = DDP(self.model, device_ids=ids)
        if cfg.compile:
            self.step_model = torch.compile(self.step_model)
        torch.manual_seed(cfg.seed + 1000 * self.dist.rank)  # dropout streams differ across processes
        self.flops_per_token = flops_per_token(self.model_cfg, seq_len=self.seq_len, backward=True)

        # State that a checkpoint carries.
        self.step = 0
        self.best_valid = float("inf")
        self.best_step = None
        self.elapsed = 0.0  # wall-clock seconds of training and evaluation, across resumes
        self.train_seconds = 0.0  # of training steps only (for tokens/s)
        self.tokens_seen = 0
        self.curve: list[dict] = []
        if self.resume and (self.run_dir / ckpt.CHECKPOINT).exists():
            self._load(self.run_dir / ckpt.CHECKPOINT)
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._write_config()
            if self.resume:
                ckpt.truncate_metrics(self.run_dir / ckpt.METRICS, self.step)
                self._log({"event": "resume", "step": self.step})

    def _write_config(self) -> None:
        ckpt.atomic_json(
            {
                "model": self.model_cfg.to_dict(),
                "train": self.train_cfg.to_dict(),
                "extra": self.extra,
                "data": {"corpus": self.data.corpus_name, "fingerprint": self.data.corpus_fingerprint,
                         "tokenizer": self.data.tokenizer.fingerprint, "notes": self.data.notes,
                         "tokens": {s: int(len(v)) for s, v in self.data.splits.items()}},
                "seq_len": self.seq_len,
                "steps": self.total_steps,
                "steps_per_epoch": self.steps_per_epoch,
                "parameters": self.model.num_params(),
                "flops_per_token_train": self.flops_per_token,
                "versions": {"gbattn": __version__, "torch": torch.__version__, "python": platform.python_version()},
            },
            self.run_dir / ckpt.CONFIG,
        )
        if not (self.run_dir / ckpt.TOKENIZER).exists():
            self.data.tokenizer.save(self.run_dir / ckpt.TOKENIZER)

    # -- checkpoints ---------------------------------------------------------------
    def _state(self) -> dict:
        return {
            "format": 1,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "best_valid": self.best_valid,
            "best_step": self.best_step,
            "elapsed": self.elapsed,
            "train_seconds": self.train_seconds,
            "tokens_seen": self.tokens_seen,
            "curve": self.curve,
            "rng": rng_state(self.device),
        }

    def _save(self) -> None:
        if self.main:
            ckpt.atomic_torch_save(self._state(), self.run_dir / ckpt.CHECKPOINT)
        self.dist.barrier()

    def _load(self, path: Path) -> None:
        state = ckpt.load_checkpoint(path, map_location=self.device)
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} does not match this run's model ({str(e).splitlines()[0][:120]})") from None
        self.step = state["step"]
        self.best_valid, self.best_step = state["best_valid"], state["best_step"]
        self.elapsed, self.train_seconds = state["elapsed"], state["train_seconds"]
        self.tokens_seen, self.curve = state["tokens_seen"], state["curve"]
        set_rng_state(state["rng"], self.device)
        if self.dist.rank:  # dropout streams differ across processes
            torch.manual_seed(self.train_cfg.seed + 1000 * self.dist.rank + self.step)

    def _log(self, record: dict) -> None:
        if self.main:
            ckpt.append_jsonl(self.run_dir / ckpt.METRICS, record)

    # -- batches -------------------------------------------------------------------
    def _global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.train_cfg
        train = self.data.splits["train"]
        if cfg.sampling == "rows":
            epoch, i = divmod(step, self.steps_per_epoch)
            rows = epoch_permutation(self.n_rows, cfg.seed, epoch)[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            return rows_batch(train, self.seq_len, rows)
        return random_windows(train, self.seq_len, cfg.batch_size, cfg.seed, step)

    def _is_eval_step(self, step: int) -> bool:
        """Evaluate after ``step`` (1-based count of finished steps)?"""
        cfg = self.train_cfg
        if step == self.total_steps:
            return True
        if cfg.eval_every and step % cfg.eval_every == 0:
            return True
        return self.steps_per_epoch is not None and step % self.steps_per_epoch == 0

    # -- evaluation ----------------------------------------------------------------
    def _evaluate(self, split: str):
        return evaluate(self.model, self.data.splits[split], self.seq_len, self.train_cfg.eval_batch_size,
                        self.device, self.autocast, self.dist)

    def _eval_and_checkpoint(self) -> None:
        t0 = time.perf_counter()
        res = self._evaluate("valid")
        improved = res.loss < self.best_valid
        if improved:
            self.best_valid, self.best_step = res.loss, self.step
            if self.main:
                ckpt.atomic_torch_save({"model": self.model.state_dict(), "step": self.step, "valid_loss": res.loss},
                                       self.run_dir / ckpt.BEST)
        epoch = self.step / self.steps_per_epoch if self.steps_per_epoch else None
        point = {"step": self.step, "tokens": self.tokens_seen, "epoch": epoch, "valid_loss": res.loss, "valid_ppl": res.ppl}
        self.curve.append(point)
        self.elapsed += time.perf_counter() - t0
        self._log({"event": "eval", "split": "valid", **point, "best": improved, "elapsed": self.elapsed})
        if self.show:
            self.bar.write(f"step {self.step}: valid loss {res.loss:.4f} ppl {res.ppl:.2f}{' (best)' if improved else ''}")
        self._save()

    # -- the loop ------------------------------------------------------------------
    def run(self) -> dict:
        result_path = self.run_dir / ckpt.RESULT
        if self.resume and result_path.exists():
            return ckpt.read_json(result_path)
        threads = torch.get_num_threads()
        try:
            return self._run()
        finally:
            torch.set_num_threads(threads)  # `threads` applies to this run only

    def _run(self) -> dict:
        self._setup()
        cfg = self.train_cfg
        name = f"{self.extra['label']}/{self.run_dir.name}" if "label" in self.extra else self.run_dir.name
        self.bar = Progress(self.total_steps, desc=f"train {name}", initial=self.step, disable=not self.show)
        tokens_per_step = cfg.batch_size * self.seq_len
        last_ckpt = time.monotonic()
        window_loss, window_n, window_t0, window_tokens = 0.0, 0, time.perf_counter(), 0
        self.model.train()
        with _StopFlag() as stop:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                lr = learning_rate(self.step, cfg, self.total_steps)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                loss = self._train_step(self.step)
                if not math.isfinite(loss):
                    self._log({"event": "stop", "reason": "non-finite loss", "step": self.step, "loss": str(loss)})
                    self.bar.close()
                    raise TrainingDiverged(
                        f"loss became {loss} at step {self.step}: stopped; the last good checkpoint "
                        f"(step {self._checkpoint_step()}) is kept in {self.run_dir}"
                    )
                self.step += 1
                self.tokens_seen += tokens_per_step
                dt = time.perf_counter() - t0
                self.train_seconds += dt
                self.elapsed += dt
                window_loss, window_n, window_tokens = window_loss + loss, window_n + 1, window_tokens + tokens_per_step
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    now = time.perf_counter()
                    tok_s = window_tokens / max(now - window_t0, 1e-9)
                    rec = {"event": "train", "step": self.step, "tokens": self.tokens_seen, "loss": window_loss / window_n,
                           "lr": lr, "tok_s": tok_s, "elapsed": self.elapsed}
                    self._log(rec)
                    self.bar.update(window_n, loss=f"{rec['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
                    window_loss, window_n, window_t0, window_tokens = 0.0, 0, now, 0
                if self._is_eval_step(self.step):
                    self._eval_and_checkpoint()
                    last_ckpt = time.monotonic()
                    window_t0 = time.perf_counter()  # tokens/s counts training time only
                elif time.monotonic() - last_ckpt > 60 * cfg.checkpoint_minutes:
                    self._save()
                    last_ckpt = time.monotonic()
                if self._should_stop(stop.requested) and self.step < self.total_steps:
                    self._save()
                    self._log({"event": "interrupted", "step": self.step})
                    self.bar.close()
                    raise TrainingInterrupted(
                        f"interrupted at step {self.step}; checkpoint saved in {self.run_dir}: continue with "
                        f"`gbattn train --resume --out {self.run_dir}` (or rerun the same `gbattn compare` command)"
                    )
        self.bar.close()
        return self._finish()

    def _should_stop(self, requested: bool) -> bool:
        if not self.dist.enabled:
            return requested
        return self.dist.all_sum([float(requested)])[0] > 0

    def _checkpoint_step(self) -> int | str:
        try:
            return ckpt.load_checkpoint(self.run_dir / ckpt.CHECKPOINT)["step"]
        except CheckpointError:
            return "none"

    def _train_step(self, step: int) -> float:
        """One optimizer step over the global batch; returns the mean loss (all processes)."""
        cfg = self.train_cfg
        x, y = self._global_batch(step)
        lo = self.dist.rank * self.micro_batch * cfg.grad_accum
        x, y = x[lo : lo + self.micro_batch * cfg.grad_accum], y[lo : lo + self.micro_batch * cfg.grad_accum]
        total = 0.0
        for micro in range(cfg.grad_accum):
            xs = x[micro * self.micro_batch : (micro + 1) * self.micro_batch].to(self.device, non_blocking=True)
            ys = y[micro * self.micro_batch : (micro + 1) * self.micro_batch].to(self.device, non_blocking=True)
            sync = micro == cfg.grad_accum - 1 or not self.dist.enabled
            ctx = contextlib.nullcontext() if sync else self.step_model.no_sync()
            with ctx:
                with self.autocast():
                    loss = self.step_model(xs, ys) / cfg.grad_accum
                loss.backward()
            total += loss.detach()
        if cfg.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            total = total + 0.0 * norm  # a non-finite gradient norm also stops the run
        value = float(total)
        if self.dist.enabled:
            value = self.dist.all_sum([value])[0] / self.dist.world
        if math.isfinite(value):  # never step on a non-finite loss or gradient
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def _finish(self) -> dict:
        """Test perplexity from the best-validation checkpoint; write result.json."""
        best_path = self.run_dir / ckpt.BEST
        if best_path.exists():
            self.model.load_state_dict(ckpt.load_checkpoint(best_path, map_location=self.device)["model"])
        test = self._evaluate("test")
        valid_best = math.exp(self.best_valid) if self.best_valid < 50 else float("inf")
        result = {
            "run_dir": str(self.run_dir),
            "attn": self.model_cfg.attn,
            "attn_options": self.model_cfg.attn_options,
            "residual": self.model_cfg.residual,
            "norm": self.model_cfg.norm,
            "d_model": self.model_cfg.d_model,
            "parameters": self.model.num_params(),
            "seed": self.train_cfg.seed,
            "steps": self.step,
            "best_step": self.best_step,
            "train_tokens_seen": self.tokens_seen,
            "tokens_per_parameter": self.tokens_seen / self.model.num_params(),
            "flops_per_token_train": self.flops_per_token,
            "train_flops": self.flops_per_token * self.tokens_seen,
            "valid_loss": self.best_valid,
            "valid_ppl": valid_best,
            "test_loss": test.loss,
            "test_ppl": test.ppl,
            "test_tokens": test.tokens,
            "wall_clock_s": self.elapsed,
            "train_tokens_per_s": self.tokens_seen / max(self.train_seconds, 1e-9),
            "device": _device_name(self.device),
            "processes": self.dist.world,
            "curve": self.curve,
            "extra": self.extra,
        }
        self._log({"event": "test", "step": self.step, "test_loss": test.loss, "test_ppl": test.ppl, "tokens": test.tokens})
        if self.main:
            ckpt.atomic_json(result, self.run_dir / ckpt.RESULT)
            if self.show:
                print(f"{self.run_dir}: best valid ppl {valid_best:.2f} (step {self.best_step}), test ppl {test.ppl:.2f}")
        self.dist.barrier()
        return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})"


def train(run_dir, model_cfg=None, train_cfg=None, resume=False, quiet=False, extra=None) -> dict:
    """Train (or resume) one run; returns its result record."""
    return Trainer(run_dir, model_cfg, train_cfg, resume=resume, quiet=quiet, extra=extra).run()
