"""The one training loop: AdamW, warmup + cosine, clipping, gradient accumulation, bf16 autocast and
``torch.compile``, DDP or FSDP2 through ``torchrun``, evaluation every epoch (and every N steps),
best-validation checkpoint, final test perplexity from the best checkpoint, exact resume, atomic
checkpoints, one writer per run directory, and a stop on a non-finite loss.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch

from gbattn import rundir
from gbattn.checks import MAX_INT, checked
from gbattn.config import DROPOUT_FIELDS, ModelConfig, TrainConfig, get_preset, training_input_length
from gbattn.data.corpus import load_corpus, test_split_note, tested_split
from gbattn.data.prepare import Data, data_path_cut, prepare_data, recorded_path_advice
from gbattn.data.tokenizer import Tokenizer
from gbattn.data.tokens import epoch_permutation, num_rows, random_windows, rows_batch
from gbattn.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DataNotFound,
    Interrupted,
    Terminated,
    UserError,
    shown,
    terminated_handler,
)
from gbattn.eval.perplexity import evaluate, perplexity
from gbattn.files import error_detail, folder_name, refuse_not_regular, shell_path
from gbattn.model.gpt import GPT
from gbattn.model.params import flops_per_token
from gbattn.parent_death import parent_death_signal
from gbattn.progress import Progress
from gbattn.runtime import (
    all_rng_states,
    autocast,
    device_name,
    is_first_process,
    precision_name,
    resolve_device,
    restore_rng_states,
    set_threads,
    software_versions,
    use_tf32,
)
from gbattn.terminal import note, printable_text
from gbattn.train.distributed import (
    DistEnv,
    full_state,
    init_distributed,
    load_full_state,
    wrap_model,
)

# A default warmup whose learning rate would never reach its peak within the run (longest_warmup) is fitted to a
# tenth of the run. A warmup that ends within the run is kept: shortening one of 0.5-1.0 runs to a tenth trained
# worse in every case measured (docs/deviations.md, entry 9).
WARMUP_FIT_LIMIT = 1.0  # nor one longer than this fraction of the run (tests set the earlier rule's 0.5) ...
WARMUP_FIT_TO = 0.1  # ... a default warmup too long for the run is fitted to this fraction of it
EARLIER_WARMUP_FIT_LIMIT = 0.5  # the limit before 2026-12-04: runs it fitted record the warmup they used
FREQUENT_EVAL_STEPS = 50  # an epoch shorter than this: say how often evaluations run
CHECKPOINT_FORMAT = 2  # checkpoint.pt's layout; another (1: gbattn before 2026-11-30) is refused on resume


class TrainingDiverged(UserError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""

    exit_code = 3


class TrainingInterrupted(Interrupted):
    """SIGINT, SIGTERM or another stopping signal: a checkpoint was saved at a step boundary; ``--resume`` continues."""


def learning_rate(step: int, cfg: TrainConfig, total_steps: int, warmup: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps (the authors': ``lr * step / warmup``, so the
    first update has lr 0; or ``lr * (step + 1) / warmup``), then cosine to ``min_lr`` at the end."""
    if step < warmup:
        return cfg.lr * (step + (0 if cfg.warmup_from_zero else 1)) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def steps_of_epochs(epochs: float, steps_per_epoch: int) -> int:
    """The steps of ``epochs`` epochs, a part of one counted whole; rounded first: 0.07 epochs of 100 steps is
    7.000000000000001 in floats, which took an eighth step. More than a step count holds is a ConfigError (1e308
    epochs was an OverflowError traceback)."""
    steps = round(epochs * steps_per_epoch, 9)
    if not steps <= MAX_INT:
        raise ConfigError(f"epochs={epochs:g} of {steps_per_epoch:,} steps each is more steps than a run can count "
                          f"({MAX_INT:,}); set fewer epochs, or max_steps")
    if steps == 0:  # (epochs=1e-13: a run of 0 steps, reported finished with a perplexity of inf, exit 0)
        raise ConfigError(f"epochs={epochs:g} of {steps_per_epoch:,} steps each is no step at all; set at least "
                          f"{1 / steps_per_epoch:.3g} epochs, or max_steps")
    return math.ceil(steps)


def _every_steps(n: int) -> str:
    """"every step" or "every 250 steps" (it said "every 1 steps")."""
    return "every step" if n == 1 else f"every {n:,} steps"


def longest_warmup(total_steps: int, from_zero: bool) -> int:
    """The longest warmup whose learning rate reaches its peak within a ``total_steps`` run: ``lr * (step + 1) / W``
    reaches it at step W - 1, ``lr * step / W`` (``warmup_from_zero``) only at step W, after the warmup."""
    return total_steps - (1 if from_zero else 0)


def shortened_warmup(total_steps: int, from_zero: bool = False) -> int:
    """The warmup a default one too long for a ``total_steps`` run is fitted to: a tenth of the run, at least 1, and
    no longer than reaches the peak (:func:`longest_warmup`: 0 in a one-step run warming up from zero)."""
    return min(max(1, round(WARMUP_FIT_TO * total_steps)), longest_warmup(total_steps, from_zero))


# Why a run of an earlier gbattn records another warmup than this gbattn fits (said where a run is refused so)
EARLIER_HALF_RUN_RULE = ("gbattn before 2026-12-04 shortened a default warmup over half the run to a tenth of it, "
                         "docs/deviations.md entry 9")
EARLIER_FROM_ZERO_RULE = ("gbattn before 2026-12-07 kept a default warmup from zero exactly as long as the run, "
                          "docs/deviations.md entry 9")


def earlier_warmup_rule(cfg: TrainConfig, total_steps: int, recorded: int) -> str:
    """The earlier gbattn's rule that fitted ``cfg``'s warmup to ``recorded`` over a ``total_steps`` run, or "": before
    2026-12-04 a default warmup over half the run was shortened to a tenth of it; before 2026-12-07 one warming up
    from zero exactly as long as the run was kept (its peak came after the last step). What such a run records and
    resumes with."""
    if not cfg.fit_warmup:
        return ""
    if cfg.warmup_steps > EARLIER_WARMUP_FIT_LIMIT * total_steps and recorded == shortened_warmup(total_steps):
        return EARLIER_HALF_RUN_RULE
    if cfg.warmup_from_zero and recorded == cfg.warmup_steps == total_steps:
        return EARLIER_FROM_ZERO_RULE
    return ""


def fitted_warmup(cfg: TrainConfig, total_steps: int) -> tuple[int, str | None]:
    """The warmup this run uses, and a one-line note when it differs from the config's or is suspect."""
    w = cfg.warmup_steps
    if cfg.fit_warmup and w > min(WARMUP_FIT_LIMIT * total_steps, longest_warmup(total_steps, cfg.warmup_from_zero)):
        fitted = shortened_warmup(total_steps, cfg.warmup_from_zero)
        tenth = round(WARMUP_FIT_TO * total_steps)
        why = "a tenth of the run" if fitted == tenth else "a tenth of the run, at least 1 step"
        longer = "longer than" if w > total_steps else "as long as"  # from zero: its peak comes after the last step
        return fitted, (f"warmup_steps={w:,} is {longer} this {total_steps:,}-step run (the learning rate "
                        f"would never reach lr={cfg.lr:g}): using {fitted:,} ({why}); --set "
                        f"warmup_steps=N keeps a warmup as given")
    if w > longest_warmup(total_steps, cfg.warmup_from_zero):
        return w, (f"warning: warmup_steps={w:,} >= the run's {total_steps:,} steps: the learning rate never reaches "
                   f"lr={cfg.lr:g}")
    return w, None


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_matrices_only:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = [{"params": params, "weight_decay": cfg.weight_decay}]
    # On a CPU torch picks its per-parameter loop (its foreach default is for accelerators); the foreach kernels
    # run the same per-tensor arithmetic, bit for bit, without a Python iteration per parameter.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda",
                             foreach=True if device.type == "cpu" else None)


def clip_and_read(parameters, grad_clip: float, loss) -> tuple[float, float]:
    """The end of every training step before the optimizer's: clip the gradients to norm ``grad_clip`` (0: none; the
    norm is taken all the same, max_norm inf scaling by exactly 1, since a non-finite one stops a run) and read the
    loss and the norm in one host sync. ``gbattn bench`` times it as part of the step it measures."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip or math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    loss_value, norm_value = torch.stack([torch.as_tensor(loss, dtype=torch.float32, device=norm.device),
                                          norm.float()]).tolist()
    return loss_value, norm_value


# Whether `compile` unset means on, per device: where `gbattn bench --compile both` measured compiled
# training faster end to end, compile time included (README, "Compiled vs eager"). CPU: no (over a CPU
# recipe's 1,200 steps it saved about 8 s (standard) to 22 s (GBA), against 19-22 s of compiling: at best
# even); CUDA: no, not yet (one H200: a compiled step 1.4-1.5x faster at paper-small, 2.1x at owt-125m, paying
# for its 17-45 s of compiling after 1,100 to 5,200 steps; but compiled training on CUDA was measured for standard
# and GBA only: `--compile` asks for it, scripts/gpu_session.sh's bench stage checks every variant).
COMPILE_BY_DEFAULT = {"cpu": False, "cuda": False}


def compile_by_default(device: torch.device) -> bool:
    return COMPILE_BY_DEFAULT.get(device.type, False)


def trains_compiled(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether a run of ``cfg`` on ``device`` trains compiled: its setting, else the device's default."""
    return bool(cfg.compile) if cfg.compile is not None else compile_by_default(device)


def compile_switch(model_cfg, recorded: TrainConfig, resumed: TrainConfig) -> str | None:
    """Why resuming a run recorded as ``recorded`` with the settings ``resumed`` would change it, or None:
    compiled and eager training draw different dropout masks, so with dropout the switch changes the run's
    path; so does switching activation checkpointing in a compiled run (compiled Twicing with dropout measured).
    The device each names decides the default (no GPU need be here)."""
    if not (model_cfg.dropout > 0 and model_cfg.dropout_sites):
        return None

    def compiled(cfg: TrainConfig) -> bool:
        cuda = str(cfg.device).startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
        return trains_compiled(cfg, torch.device("cuda" if cuda else "cpu"))

    was, now = compiled(recorded), compiled(resumed)
    if was != now:
        # (said of --set compile=true too, or of a --set device compiled by default: not only of the flag)
        return (f"--{'' if now else 'no-'}compile, or the --set compile or device that means it (recorded: trained "
                f"{'compiled' if was else 'eager'}; with dropout the two draw different masks)")
    if now and recorded.activation_checkpointing != resumed.activation_checkpointing:
        # (eager, recomputing a block draws its masks again, the same; compiled, Twicing's graph break fell back to
        # eager masks inside a recomputed block: another run from the first step)
        return (f"--set activation_checkpointing={str(resumed.activation_checkpointing).lower()} (recorded: "
                f"{str(recorded.activation_checkpointing).lower()}; a compiled run with dropout can draw other masks "
                f"with its blocks recomputed)")
    return None


def _finite_amount(value) -> bool:
    """Whether a checkpoint's value is a number (not a bool), finite and >= 0: seconds, a loss sum, a count."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")


# Signals whose default ends a process at once, silently, that schedulers and terminals send to a training: SIGHUP (a
# terminal closed without nohup), SIGUSR1 and SIGUSR2 (SLURM's --signal and scancel --signal: time is running out).
# Inside the training loop each stops the run as SIGTERM does, with its checkpoint (it ended without one).
STOPPING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


def stop_words(signum: int) -> str:
    """How a stop by signal ``signum`` is said: "interrupted" (SIGINT), "terminated" (SIGTERM), "stopped by SIGHUP"."""
    return {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}.get(
        signum, f"stopped by {signal.Signals(signum).name}")


class _StopFlag:
    """SIGINT/SIGTERM (and :data:`STOPPING_SIGNALS` where their handler is the default) ask the loop to checkpoint
    and stop at the next step boundary; a second Ctrl-C stops at
    once (as cli reports it: 130). A repeated SIGTERM asks again and changes nothing: machines send it, often
    more than once (the kernel sends a torchrun worker's or a comparison's run's parent-death SIGTERM once per
    thread of the dying parent; a scheduler and torchrun each send one), and a process that took the second
    as "stop now" left mid-step, without its checkpoint or its line, its peers failing in the next collective.
    A signal the process was started with ignored (a shell's background job ignores SIGINT) stays ignored, as
    it is before and after the loop."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = signal.SIGINT  # the signal that asked, SIGTERM where one did (exit status 128 + it)
        self._old = {}

    def __enter__(self):
        def handler(signum, frame):
            if self.requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            if not self.requested or signum == signal.SIGTERM:  # as among processes (Trainer._stop_signal)
                self.signum = signum
            self.requested = True

        for sig in (signal.SIGINT, signal.SIGTERM, *STOPPING_SIGNALS):
            now = signal.getsignal(sig)
            if now is signal.SIG_IGN or sig in STOPPING_SIGNALS and now is not signal.SIG_DFL:
                continue  # (nohup's SIGHUP ignored, and a caller's own handler of the others, stay)
            with contextlib.suppress(ValueError):  # not the main thread
                self._old[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc):
        # Stopped in a process its parent's death stops (a torchrun worker, a comparison's run): the rest of the
        # parent-death SIGTERMs, one per thread of the dying parent and spread out on a busy machine, still come,
        # and SIGTERM's own handler (torchrun's workers: the default) ended the process silently before its line
        # (test_a_killed_torchrun_leaves_no_process_training, under load). It is leaving: they change nothing.
        repeats_come = self.requested and parent_death_signal() == signal.SIGTERM
        for sig, old in self._old.items():
            if not (sig == signal.SIGTERM and repeats_come):
                signal.signal(sig, old)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises :class:`Terminated` inside, where its handler is the default (a torchrun worker's: cli leaves
    it), so a run stopped during its final test evaluation says, as in one process, that its checkpoint is saved and
    how to continue; the default ended the worker silently there. Any other handler stays as it is."""
    if not (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        yield
        return

    terminated, fired = terminated_handler(), []

    def once(signum, frame) -> None:  # the repeats (one per thread of a dying torchrun) change nothing
        if not fired:
            fired.append(signum)
            terminated(signum, frame)

    signal.signal(signal.SIGTERM, once)
    try:
        yield
    finally:
        # Stopped in a process its parent's death stops, which is leaving while the rest of those repeats still come:
        # the default put back ended the worker before its line (exit -15, no word), as in _StopFlag.__exit__
        repeats_come = fired and parent_death_signal() == signal.SIGTERM
        signal.signal(signal.SIGTERM, (lambda signum, frame: None) if repeats_come else signal.SIG_DFL)


def same_corpus(data: str, saved: dict, train_cfg) -> bool:
    """Whether ``data`` (``train --resume --data``, a resumed run's ``train_cfg.data``) names the recorded corpus by
    another path (the recorded one may be relative to where the run was started): the same fingerprint."""
    recorded = rundir.recorded_fingerprint(saved)
    try:
        return recorded is not None and load_corpus(data, tuple(train_cfg.split)).fingerprint == recorded
    except UserError:
        return False


MAX_DEVICES_RECORDED = 64  # a checkpoint's list of the devices a run ran on (each once): more is a damaged file


def given_neutral(saved: dict, recorded_model: ModelConfig, recorded_train: TrainConfig, model_cfg: ModelConfig | None,
                  train_cfg: TrainConfig | None, run_dir: Path) -> dict:
    """The result-neutral fields of ``train_cfg`` (threads, device, ...; the corpus at another path) that a run resumed
    with configs given takes over its recorded ones, or a UserError naming each field of ``model_cfg`` or
    ``train_cfg`` (None: not given) that would change the run, as `train --resume` refuses a ``--set`` that would."""
    from gbattn.experiments.compare import comparable, config_differences

    if model_cfg is not None and model_cfg.vocab_size == saved.get("vocab_size_asked"):
        model_cfg = model_cfg.replace(vocab_size=recorded_model.vocab_size)  # the tokenizer's was taken, as recorded
    given = comparable(model_cfg or recorded_model, train_cfg or recorded_train)
    have = comparable(recorded_model, recorded_train)
    # fit_warmup by the warmup it gives over the run's steps, as compare's check_run compares it (it was ignored: a
    # resume given fit_warmup=True over a run recorded with False trained the recorded warmup, silently; compared as
    # a flag, a run from before it existed, which records it off, was refused where the warmup was the same)
    steps, used = saved.get("steps"), saved.get("warmup_steps")
    warmup = []
    if train_cfg is not None and (type(steps) is not int or type(used) is not int):  # (a planned run records neither)
        given["train"]["fit_warmup"], have["train"]["fit_warmup"] = train_cfg.fit_warmup, recorded_train.fit_warmup
    elif train_cfg is not None and (asked := fitted_warmup(train_cfg, steps)[0]) != used:
        earlier = f"; {rule}" if (rule := earlier_warmup_rule(train_cfg, steps, used)) else ""
        warmup = [f"the warmup over its {steps:,} steps: recorded {used:,}, given {asked:,} "
                  f"(fit_warmup={train_cfg.fit_warmup}{earlier})"]
    neutral = {}
    if train_cfg is not None and train_cfg.data != recorded_train.data and same_corpus(train_cfg.data, saved,
                                                                                           recorded_train):
        given["train"]["data"] = recorded_train.data
        neutral["data"] = train_cfg.data  # the recorded corpus at another path
    differ = config_differences(have, given, "given") + warmup
    if differ:
        raise UserError(f"resume=True continues {run_dir} as it was started; these configs would change it: "
                        f"{'; '.join(differ)}. Give the run's own configs (or none), or start a new run in "
                        f"another directory")
    if train_cfg is not None:
        neutral.update({k: getattr(train_cfg, k) for k in TrainConfig.RESULT_NEUTRAL})
    return neutral


def check_recorded(preset, extra) -> None:
    """``preset`` and ``extra`` as config.json records them for its readers (:func:`gbattn.rundir.check_config`): a
    preset's name (``train --init-from`` builds its recipe from it) and a dict of JSON values, or None; else a
    ConfigError, where a Python caller's other values trained a whole run that no command could read back."""
    if preset is not None:
        get_preset(preset)
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise ConfigError(f"extra of type {type(extra).__name__}: give a dict (recorded in config.json) or None")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"extra holds a value JSON cannot record ({e}): give strings, numbers, lists and "
                          f"dicts") from None


class Trainer:
    """Train one model into ``run_dir``. ``Trainer(...).run()`` returns the result record.

    ``preset`` is recorded (``train --resume`` refuses another); ``extra`` too (e.g. compare's labels).
    """

    def __init__(self, run_dir: str | Path, model_cfg: ModelConfig | None = None, train_cfg: TrainConfig | None = None,
                 resume: bool = False, quiet: bool = False, extra: dict | None = None, preset: str | None = None,
                 restart: bool = False, overrides: dict | None = None) -> None:
        self.run_dir = rundir.as_directory(run_dir, "run_dir")
        # True or False only: restart="no" was true, and replaced the run in run_dir (its weights deleted)
        resume, quiet, restart = (checked(name, value, bool, None, "True or False")
                                  for name, value in (("resume", resume), ("quiet", quiet), ("restart", restart)))
        if resume and restart:  # (`train --resume --restart` is refused the same way)
            raise UserError("resume=True continues the run in run_dir and restart=True replaces it: give one of them")
        if overrides and not resume:  # (ignored, silently)
            raise UserError("overrides are for a resumed run (resume=True): a new run takes every value from train_cfg")
        # (any other field was applied to the resumed run, silently: `train --resume` refuses such --set values)
        changing = sorted(set(overrides or {}) - {*TrainConfig.RESULT_NEUTRAL, "data"})  # data: the corpus moved
        if changing:
            raise UserError(f"overrides {changing} would change the resumed run: only result-neutral fields "
                            f"({', '.join(TrainConfig.RESULT_NEUTRAL)}) may differ from the recorded ones")
        self.resume, self.quiet, self.restart = resume, quiet, restart
        self.extra, self.preset = extra or {}, preset
        config_path = self.run_dir / rundir.CONFIG
        # (a dict, or the two swapped, was "'dict' object has no attribute 'data'"; a resumed run checks them too)
        for name, value, kind in (("model_cfg", model_cfg, ModelConfig), ("train_cfg", train_cfg, TrainConfig)):
            if value is not None and not isinstance(value, kind):
                raise ConfigError(f"{name} of type {type(value).__name__}: give a {kind.__name__} (build_configs("
                                  f"preset, attn, data, sets) returns the model's and the training's)")
        check_recorded(preset, extra)
        if resume:
            self.saved = rundir.read_config(config_path)
            self.model_cfg, recorded = rundir.read_configs(self.saved, config_path)
            if model_cfg is not None or train_cfg is not None:  # (a script that started the run, run again to resume)
                overrides = {**given_neutral(self.saved, self.model_cfg, recorded, model_cfg, train_cfg, self.run_dir),
                             **(overrides or {})}
            self.train_cfg = recorded.replace(**(overrides or {}))  # result-neutral: threads, device, ...
            self.recorded_data = recorded.data  # the corpus path the run was started with
            self.extra, self.preset = self.saved.get("extra") or {}, self.saved.get("preset")
            if preset is not None and preset != self.preset:  # (ignored, silently; `train --resume --preset` refused)
                raise UserError(f"resume=True continues {self.run_dir} as it was started; preset: recorded "
                                f"{self.preset!r}, given {preset!r}. Leave preset out, or start a new run in another "
                                f"directory")
            if extra is not None and json.loads(json.dumps(extra)) != self.extra:  # (it was ignored, silently)
                raise UserError(f"resume=True continues {self.run_dir} as it was started; extra: recorded "
                                f"{json.dumps(self.extra)}, given {json.dumps(extra)}. Leave extra out, or start a new "
                                f"run in another directory")
            switched = compile_switch(self.model_cfg, recorded, self.train_cfg)  # ... but for this
            if switched:  # (compare resumes its runs with its --set compile=...: its own words there)
                how = ("Leave it out of the `gbattn compare` command, or compare into another --out"
                       if "label" in self.extra else "Leave it out, or start a new run (another --out, or --restart)")
                raise UserError(f"train --resume continues {self.run_dir} as it was started; this would change it: "
                                f"{switched}. {how}")
        else:
            if model_cfg is None or train_cfg is None:
                raise ValueError("model_cfg and train_cfg are required for a new run")
            # Its own copies, checked as new configs are: a field the caller set after building one (train_cfg.max_steps
            # = 0) trained a run no command could read back, or failed inside the optimizer
            self.saved, self.model_cfg, self.train_cfg = None, model_cfg.replace(), train_cfg.replace()
            self.recorded_data = None
        if not self.train_cfg.data:
            raise UserError("no data given (train_cfg.data: a corpus name, a file or a folder; `gbattn train --data`)")

    # -- setup ---------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.train_cfg
        self.threads = set_threads(cfg.threads)
        requested = resolve_device(cfg.device)
        self.dist: DistEnv = init_distributed(requested.type)
        self.device = resolve_device(cfg.device, self.dist.local_rank)
        self.main = self.dist.is_main
        self.show = self.main and not self.quiet
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        use_tf32(self.device)
        self.autocast = autocast(self.device, cfg.amp)
        self._check_processes_agree()
        # The main process first (it builds the caches the others then read); a mistake it finds ends every process.
        self.data: Data = self.dist.main_first(self._claim_and_prepare)
        self._check_one_run_directory()
        has_checkpoint = self.has_checkpoint
        vocab = self.data.tokenizer.vocab_size
        if vocab != self.model_cfg.vocab_size:
            if self.resume:
                raise CheckpointError("the tokenizer's vocabulary no longer matches the saved model config")
            self.model_cfg = self.model_cfg.replace(vocab_size=vocab)

        train = self.data.splits["train"]
        per_rank, rem = divmod(cfg.batch_size, self.dist.world * cfg.grad_accum)
        if rem or per_rank == 0:
            raise UserError(f"batch_size={cfg.batch_size} must be divisible by processes x grad_accum = "
                            f"{self.dist.world} x {cfg.grad_accum}")
        self.micro_batch = per_rank
        if cfg.sampling == "rows":
            self.n_rows = num_rows(train, self.seq_len)
            self._epoch_order = (None, None)  # (epoch, its row order): _global_batch's
            self.steps_per_epoch = self.n_rows // cfg.batch_size
            if self.steps_per_epoch == 0:
                advice = self._advice("train", len(train))
                raise DataError(f"{self.data.split_of('train')} has {len(train):,} token{'s' * (len(train) != 1)}: "
                                f"fewer than one batch of {cfg.batch_size} rows of {self.seq_len + 1} tokens; {advice}")
            self.total_steps = cfg.max_steps or steps_of_epochs(cfg.epochs, self.steps_per_epoch)
        else:
            if len(train) <= self.seq_len + 1:
                raise DataError(  # no window ends at the last token (random_windows): one row and one token more
                    f"{self.data.split_of('train')} has {len(train):,} tokens; random windows of {self.seq_len + 1} "
                    f"need at least {self.seq_len + 2}: {self._advice('train', len(train))}"
                )
            self.steps_per_epoch = None
            self.total_steps = cfg.max_steps
        for split in ("valid", "test"):
            count = len(self.data.splits[split])
            if num_rows(self.data.splits[split], self.seq_len) == 0:
                raise DataError(f"{self.data.split_of(split)} has {count:,} tokens: fewer than one row of "
                                f"{self.seq_len + 1}; {self._advice(split, count)}")
        self.warmup, warmup_note = fitted_warmup(cfg, self.total_steps)
        recorded_warmup = self.saved.get("warmup_steps") if self.saved is not None else None
        if isinstance(recorded_warmup, int) and recorded_warmup != self.warmup:
            # A resumed run keeps the warmup it started with: one fitted by an earlier gbattn's rule (a default
            # warmup over half the run, or one from zero as long as the run) would otherwise change its schedule
            # midway. Any other (config.json edited
            # by hand) was used silently, the resume still said exact.
            if recorded_warmup != cfg.warmup_steps and not earlier_warmup_rule(cfg, self.total_steps, recorded_warmup):
                raise CheckpointError(
                    f"{self.run_dir / rundir.CONFIG}: warmup_steps={recorded_warmup:,} is not a warmup gbattn wrote "
                    f"for this run (its warmup_steps={cfg.warmup_steps:,} over {self.total_steps:,} steps gives "
                    f"{self.warmup:,}): the file is damaged or was edited; restore a copy of it")
            self.warmup, warmup_note = recorded_warmup, None

        self.callers_rng = all_rng_states(self.device)  # (put back when the run ends: Trainer.run)
        # The checkpoint's weights checked before the model takes memory (rundir.check_weights_fit). Read onto the
        # CPU, as a fresh run holds what is not a weight (generator states, AdamW's step counts); loading the state
        # puts weights and moments on the run's device
        state = rundir.load_checkpoint(self.run_dir / rundir.CHECKPOINT) if has_checkpoint else None
        if state is not None:
            rundir.check_weights_fit(self.model_cfg, state["model"], self.run_dir / rundir.CHECKPOINT)
        torch.manual_seed(cfg.seed)  # identical initial weights on every process
        self.model = GPT(self.model_cfg).to(self.device)
        self.model.set_activation_checkpointing(cfg.activation_checkpointing)
        if self.start is not None:
            self._init_from(self.start)
        self.wrapped = wrap_model(self.model, cfg.parallel, self.dist, self.device, cfg.amp)  # DDP, FSDP2 or it
        self.optimizer = make_optimizer(self.wrapped, cfg, self.device)
        self.compiled = trains_compiled(cfg, self.device)
        self.step_model = torch.compile(self.wrapped) if self.compiled else self.wrapped
        torch.manual_seed(cfg.seed + 1000 * self.dist.rank)  # dropout streams differ across processes
        self.flops_per_token = flops_per_token(self.model_cfg, seq_len=self.seq_len, backward=True)

        self.tokens_per_step = cfg.batch_size * self.seq_len  # every step reads as many (tokens_seen counts them)
        # State that a checkpoint carries.
        self.step, self.best_valid, self.best_step = 0, float("inf"), None
        self.elapsed = 0.0  # wall-clock seconds of training and evaluation, across resumes
        self.train_seconds = 0.0  # of training steps only (for tokens/s)
        self.tokens_seen = 0
        self.grad_norm = 0.0  # of the last step's gradient (_train_step): a non-finite one stops the run
        self.curve: list[dict] = []
        # The training losses since the last "train" record (sum, steps): a record after a resume
        # averages the same steps as the uninterrupted run's.
        self.window_loss, self.window_n = 0.0, 0
        self.saved_processes = None  # how many processes the resumed checkpoint holds random streams of
        self.saved_trained_on = None  # the device, threads and compilation the resumed checkpoint was trained with
        self.earlier_devices: list[str] = []  # the devices (with threads) earlier legs of a resumed run ran on
        self.earlier_processes = 1  # the most processes an earlier leg trained in
        self.earlier_compiled = False  # whether an earlier leg trained compiled
        if state is not None:
            self._load(state, self.run_dir / rundir.CHECKPOINT)
        self.dist.main_only(lambda: self._write_config(resumed=has_checkpoint))
        other_processes = self.saved_processes not in (None, self.dist.world)  # resumed, but not exactly
        other_arithmetic = self._other_arithmetic()  # so too
        if self.show:
            for line in self._plan():
                print(line)
            if has_checkpoint:
                # a checkpoint of an earlier gbattn records neither the hardware nor the code it trained with: exact
                # only on those (one resumed on 2 threads, or by a gbattn whose AttnRes sums differ, ended 5e-5 away)
                unknown = self.saved_trained_on is None
                how = ("" if other_processes or other_arithmetic else "; exactly where it resumes on the device, "
                       "threads and gbattn it trained with, which its checkpoint, from an earlier gbattn, does not "
                       "record" if unknown else ", exactly")
                print(f"resuming at step {self.step:,} of {self.total_steps:,}, the last checkpoint (work after it "
                      f"is redone{how})")
            elif self.resume:
                print(printable_text(f"{self.run_dir} has no {rundir.CHECKPOINT} yet: training starts at step 0"))
        # Warnings and changed settings: stderr, apart from the output, and shown under --quiet too.
        if warmup_note and self.main:
            note(warmup_note)
        if other_processes and self.main:
            note(printable_text(self._other_processes_note()))
        if other_arithmetic and self.main:
            note(printable_text(f"warning: the checkpoint of {self.run_dir} was trained "
                                f"{' and '.join(other_arithmetic)}: it goes on, but not exactly as the uninterrupted "
                                f"run would (the same sums add up in another order)"))
        if self.train_cfg.parallel != "ddp" and not self.dist.enabled and self.main:
            note(f"parallel={self.train_cfg.parallel} applies under torchrun only (torchrun --nproc_per_node N -m "
                 f"gbattn.cli train ...); this is one process")

    def _check_processes_agree(self) -> None:
        """Under torchrun every process trains the same run: a field given to one process only (a job script that
        adds options per rank) trained another model beside it (a DDP traceback) or another seed or learning rate
        silently, config.json recording rank 0's. Result-neutral fields and the data path (a node's own copy) may
        differ; the data's content is compared once read (:meth:`_check_one_run_directory`)."""
        if not self.dist.enabled:
            return
        neutral = {*TrainConfig.RESULT_NEUTRAL, "data"}
        mine = {**self.model_cfg.__dict__, **{k: v for k, v in self.train_cfg.__dict__.items() if k not in neutral},
                "resume": self.resume, "restart": self.restart, "preset": self.preset, "extra": self.extra}
        # a node's own copy of a tokenizer file or of --init-from's run may sit at another path: their kind and
        # presence here, their content compared once read (:meth:`_check_one_run_directory`)
        if "=" in mine["tokenizer"]:
            mine["tokenizer"] = mine["tokenizer"].partition("=")[0] + "=PATH"
        mine["init_from"] = bool(mine["init_from"])
        if isinstance(mine["extra"], dict) and "init_from" in mine["extra"]:  # (its folder's name, recorded)
            mine["extra"] = {**mine["extra"], "init_from": "PATH"}
        mine = json.loads(json.dumps(mine, default=str))
        every = self.dist.gather(mine)
        for rank, theirs in enumerate(every[1:], 1):
            differ = sorted(k for k in set(theirs) | set(every[0]) if theirs.get(k) != every[0].get(k))
            if differ:
                raise UserError(f"the {self.dist.world} processes were launched with different runs: rank {rank}'s "
                                f"differs from rank 0's in {', '.join(differ)}; launch every process with the same "
                                f"command (torchrun --nproc_per_node N -m gbattn.cli train ...)")

    def _check_one_run_directory(self) -> None:
        """Under torchrun the run directory is one folder that every process sees, holding rank 0's lock, and every
        process read the same data: only rank 0 writes the checkpoints, which every process reads (on nodes that
        share no file system, the others tested their last weights as the best ones, or waited forever)."""
        if not self.dist.enabled:
            return
        token = self.dist.gather(self.lock.token if self.main else None)[0]
        start = rundir.weights_digest(self.start.model.state_dict()) if self.start is not None else None
        seen = self.dist.gather((self.main or rundir.RunLock.token_in(self.run_dir) == token, socket.gethostname(),
                                 str(self.run_dir), self.data.corpus_fingerprint, self.data.tokenizer.fingerprint,
                                 self.train_cfg.data, start))
        for rank, (sees, host, out, corpus, tokenizer, data, weights) in enumerate(seen):
            if not sees:  # (named as rank 0 names it, and as this process does where that differs)
                raise UserError(f"{seen[0][2]} is not one folder that every process sees: rank {rank} (on {host}"
                                f"{f', its --out {out}' if out != seen[0][2] else ''}) finds no run of rank 0's "
                                f"there; only rank 0 writes the checkpoints and every process reads them, so a run on "
                                f"several nodes needs its --out on a file system they share")
            if corpus != seen[0][3]:
                raise UserError(f"rank {rank} (on {host}) read another corpus from --data {data} than rank 0 from "
                                f"--data {seen[0][5]}: every process trains on the same data; give each node the same "
                                f"copy")
            if tokenizer != seen[0][4]:
                raise UserError(f"rank {rank} (on {host}) has another tokenizer than rank 0 (--tokenizer "
                                f"{self.train_cfg.tokenizer.partition('=')[0]}): give each node the same copy of its "
                                f"file (or of --init-from's run)")
            if weights != seen[0][6]:
                raise UserError(f"rank {rank} (on {host}) read other starting weights (--init-from) than rank 0: give "
                                f"each node the same copy of that run")

    def _claim_and_prepare(self) -> Data:
        """The main process takes the run directory (one writer, before any long work); then the data.
        A resumed run keeps its tokenizer; a run started from another run's weights takes that run's.
        A run with no checkpoint yet (planned by `compare --jobs N`, or killed before its first
        evaluation) starts from those weights too, as a fresh one does."""
        cfg = self.train_cfg
        if self.main:
            rundir.check_out(self.run_dir, (rundir.RUN,), "a gbattn run")  # --restart replaces only a run
            if not self.resume:  # weights without a config.json (a killed upcycle): not trained over, not deleted
                rundir.refuse_weights_without_config(self.run_dir)
            self.lock = rundir.RunLock(self.run_dir)
            if self.resume:  # what a resumed run reads or replaces later: a directory or a pipe in their place ran the
                # whole run and left one no command could read (tokenizer.json), or failed at the first evaluation
                for name in (rundir.TOKENIZER, rundir.BEST, rundir.METRICS):
                    refuse_not_regular(self.run_dir / name)
            # An upcycled model (weights no training saved): resumed, it trained from a random init at step 0 and
            # replaced them. `train --init-from` trains it (README, "Upcycling a trained model")
            if not self.restart and self._upcycled():
                held = (f"{self.run_dir} holds an upcycled model that no run has trained yet ({rundir.BEST}, a "
                        f"{rundir.CONFIG} of 0 steps, no {rundir.CHECKPOINT})")
                how = (f"`gbattn train --init-from {shell_path(self.run_dir)} --out NEW_DIR` (from Python: "
                       f"train_cfg.init_from) trains it into a new run")
                raise UserError(f"{held}: nothing to resume; {how}, its weights kept" if self.resume else
                                f"{held}; {how}, --restart (restart=True) replaces it, or choose another --out")
            if not self.restart and not self.resume and (
                (self.run_dir / rundir.CHECKPOINT).exists() or (self.run_dir / rundir.CONFIG).exists()
            ):
                raise UserError(f"{self.run_dir} already holds a run; pass --resume (from Python: resume=True) to "
                                f"continue it, --restart (restart=True) to replace it, or choose another --out")
        tokenizer, self.start = None, None
        self.has_checkpoint = self.resume and (self.run_dir / rundir.CHECKPOINT).exists()
        if cfg.init_from and not self.has_checkpoint:
            if self.resume and not Path(cfg.init_from).is_dir():  # recorded as given, relative to where it started
                how = ("it was moved or deleted: restore it" if Path(cfg.init_from).is_absolute() else
                       "resume from the directory the run was started in, or restore it if it was moved or deleted")
                raise UserError(f"{self.run_dir} has no checkpoint yet, so it starts again from its --init-from "
                                f"{cfg.init_from}, which is not a directory from here: {how}")
            self.start = rundir.load_run(cfg.init_from, None, "cpu")
            tokenizer = self.start.tokenizer
        elif self.resume and (self.run_dir / rundir.TOKENIZER).is_file():
            tokenizer = Tokenizer.load(self.run_dir / rundir.TOKENIZER, expected_vocab=self.model_cfg.vocab_size,
                                       recorded=rundir.recorded_fingerprint(self.saved, of="tokenizer"))
        self.seq_len = training_input_length(self.model_cfg, cfg)  # checked before the data is prepared
        asked = self.saved.get("vocab_size_asked") if self.resume else None  # recorded when it was not the tokenizer's
        self.requested_vocab = asked if type(asked) is int and asked > 0 else self.model_cfg.vocab_size
        recorded = rundir.recorded_fingerprint(self.saved) if self.resume else None
        changed = ": it has changed since this run started, and a run does not resume on other data"
        try:
            return prepare_data(cfg, self.model_cfg.vocab_size, tokenizer, progress=self.show, trained_on=recorded,
                                mismatch=changed)
        except DataNotFound as e:  # a path this run or --init-from's recorded (moved, or relative to elsewhere)
            if self.resume and cfg.data == self.recorded_data:
                raise DataNotFound(f"{e}; {recorded_path_advice(self.run_dir)}") from None
            if self.start is not None and cfg.data == self.start.train_cfg.data:
                raise DataNotFound(f"{e}; {recorded_path_advice(self.start.run_dir, data_path_cut(self.start))}") \
                    from None
            raise

    def _read_best(self) -> dict | None:
        """best.pt, read and checked to hold the weights of the run's best validation; None where there is none and
        none is needed (no validation yet, or the best was the last step). One lost before a resume (the last weights
        were tested and reported as the best step's), or of another step, is a one-line error."""
        best_path = self.run_dir / rundir.BEST
        if not best_path.exists():
            if self.best_step not in (None, self.step):
                raise CheckpointError(f"{best_path} is missing: the run's best validation was at step "
                                      f"{self.best_step}, whose weights it held, so its test perplexity cannot be "
                                      f"measured; restore a copy of it, or train again (--restart)")
            return None
        saved = rundir.load_checkpoint(best_path, self.device)
        if self.best_step is not None and saved.get("step") != self.best_step:
            raise CheckpointError(f"{best_path} holds the weights of step {saved.get('step')!r}, not those of the "
                                  f"run's best validation (step {self.best_step}): restore a copy of it, or train "
                                  f"again (--restart)")
        return saved

    def _upcycled(self) -> bool:
        """Whether the run directory holds weights that no training saved: best.pt and a config.json of 0 steps
        (`gbattn upcycle`'s output; a run records its steps, at least 1), no checkpoint.pt."""
        if (self.run_dir / rundir.CHECKPOINT).exists() or not (self.run_dir / rundir.BEST).exists():
            return False
        try:
            config = self.saved if self.saved is not None else rundir.read_config(self.run_dir / rundir.CONFIG)
        except CheckpointError:  # a damaged config.json: refused as a run's is
            return False
        return config.get("steps") == 0

    def _advice(self, split: str, count: int) -> str:
        """What to do about a split of ``count`` tokens, too short for the run: raise its cap where the cap cut it
        (``train_tokens``, ``eval_tokens``: the file itself may be long enough), text where it holds none, else give a
        longer file."""
        name = "train_tokens" if split == "train" else "eval_tokens"
        cap = getattr(self.train_cfg, name)
        if cap is not None and count >= cap:
            return f"{name}={cap:,} cut it there: raise it, or use a smaller seq_len"
        if count == 0 and self.data.tokenizer.kind != "char":  # a single file's last tenth of blank lines, say
            return ("none of its lines holds text (blank lines are left out by every tokenizer but char): give it "
                    "text, or for a single file another split setting")
        return "use a longer file or a smaller seq_len"

    def _plan(self) -> list[str]:
        """What this run will do, in a few lines (vocabulary, steps, learning rate and warmup, evaluations)."""
        cfg, v = self.train_cfg, self.data.tokenizer.vocab_size
        unused = self.data.tokenizer.unused_ids
        lines = [f"{self.data.tokenizer.kind} tokenizer: {v:,} token{'s' * (v != 1)}"
                 + (f" (the model config asked for {self.requested_vocab:,}; the vocabulary is the tokenizer's)"
                    if v != self.requested_vocab else "")
                 + (f"; {unused:,} of its ids name no token, and each still has an embedding row" if unused else "")]
        epochs = (
            f" ({self.total_steps / self.steps_per_epoch:.3g} epochs of {self.steps_per_epoch:,} "
            f"step{'s' if self.steps_per_epoch != 1 else ''})"
            if self.steps_per_epoch
            else ""
        )
        evals = []  # an interval as long as the run or longer: evaluation at the end (only)
        if self.steps_per_epoch and not cfg.eval_every and self.steps_per_epoch < self.total_steps:
            evals.append(f"every epoch = {_every_steps(self.steps_per_epoch)}")
        if cfg.eval_every and cfg.eval_every < self.total_steps:
            evals.append(_every_steps(cfg.eval_every))
        # (:meth:`_is_eval_step`'s steps, counted: a loop over every step kept a run of 10**9 steps silent for
        # minutes before its first)
        interval = cfg.eval_every or self.steps_per_epoch or self.total_steps
        n_evals = -(-self.total_steps // interval)
        steps = f"{self.total_steps:,} step{'s' if self.total_steps != 1 else ''}"
        decay = f"cosine to {cfg.min_lr:g}" if cfg.schedule == "cosine" else "constant"
        lines.append(f"{steps}{epochs} of {cfg.batch_size} x {self.seq_len} tokens, lr {cfg.lr:g} (warmup "
                     f"{self.warmup:,}, then {decay}), evaluation {' and '.join(evals) or 'at the end'} "
                     f"({n_evals:,} in all), {self.device.type}{self._execution_text()}")
        # (with one evaluation, none is less often: the hint was given for a run of one epoch or less too)
        if self.steps_per_epoch and self.steps_per_epoch < FREQUENT_EVAL_STEPS and not cfg.eval_every and n_evals > 1:
            lines[-1] += "; --set eval_every=N evaluates less often"
        return lines

    def _execution_text(self) -> str:
        """How the run computes: its processes (torchrun), CPU threads, compiled or not, recomputing its blocks or
        not. Under torchrun the threads are each process's (the plan said "cpu with 1 thread" for 2 processes)."""
        ways = ", compiled (tokens/s counts the time it takes)" if self.compiled else ""
        if self.train_cfg.activation_checkpointing:
            ways += ", each block recomputed in the backward pass (activation_checkpointing)"
        world = self.dist.world
        processes = f" in {world} processes ({self.train_cfg.parallel})" if world > 1 else ""
        if self.device.type != "cpu":
            return processes + ways
        each = " each" if world > 1 else ""
        return f"{processes} with {self.threads} thread{'s' if self.threads > 1 else ''}{each}{ways}"

    def _init_from(self, start: rundir.LoadedRun) -> None:
        """Start from another run's weights (e.g. ``gbattn upcycle``); the optimizer starts fresh. ``extra`` records
        which of its weights (best, last or exported) and their step, as an upcycled run records its source's."""
        if start.model_cfg.replace(**{key: getattr(self.model_cfg, key) for key in DROPOUT_FIELDS}) != self.model_cfg:
            raise UserError(f"init_from={start.run_dir}: its model config differs from this run's (other than in "
                            f"{' and '.join(DROPOUT_FIELDS)}); leave out --preset, --attn and model --set values (from "
                            f"Python: give its own, gbattn.load_run(...).model_cfg) to train the model as "
                            f"{start.run_dir}/config.json has it")
        weights = start.model.state_dict()
        rundir.load_weights(self.model, weights, start.run_dir)
        started = {"init_from_checkpoint": start.checkpoint, "init_from_step": start.step,
                   "init_from_weights": rundir.weights_digest(weights)}
        # A run killed before its first checkpoint starts again from its source, which may have trained on or been
        # replaced since: it trained from those weights, silently, and was not the run that was started
        recorded = {key: self.extra[key] for key in started if key in self.extra}
        if self.resume and recorded and recorded != {key: started[key] for key in recorded}:
            now = rundir.weights_named(start.checkpoint, f"(step {start.step})")
            then = rundir.weights_named(recorded.get("init_from_checkpoint"),
                                        f"of step {recorded.get('init_from_step')}")
            raise UserError(f"{self.run_dir} has no checkpoint yet, so it starts again from its --init-from "
                            f"{start.run_dir}, whose {now} are not the ones it started from ({then}): restore those, "
                            f"or train it again from these with --restart")
        self.extra = {**self.extra, **started}

    def _write_config(self, resumed: bool) -> None:
        """config.json and the tokenizer; a resumed run's metrics.jsonl is cut back to its checkpoint's step
        (a run with no checkpoint, killed before its first one or planned by compare --jobs, starts at step 0).
        A --restart discards the old run here, once the new one has passed every check (data, batch size over
        the processes): one that fails leaves the old run as it was."""
        if self.restart:
            rundir.discard_run(self.run_dir)
        rundir.write_config(
            self.run_dir, self.preset, self.model_cfg, self.train_cfg, self.extra,
            data={"corpus": self.data.corpus_name, "fingerprint": self.data.corpus_fingerprint,
                  "tokenizer": self.data.tokenizer.fingerprint, "notes": self.data.notes,
                  "tokens": {s: int(len(v)) for s, v in self.data.splits.items()}},
            seq_len=self.seq_len,
            steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
            warmup_steps=self.warmup,
            parameters=self.model.num_params(),
            flops_per_token_train=self.flops_per_token,
            vocab_size_asked=self.requested_vocab,  # `train --resume --set vocab_size=` it is no change
            versions=software_versions(),
        )
        if not (self.run_dir / rundir.TOKENIZER).exists():
            self.data.tokenizer.save(self.run_dir / rundir.TOKENIZER)
        if self.resume and (self.run_dir / rundir.METRICS).is_file():  # its steps after the checkpoint run again
            rundir.truncate_metrics(self.run_dir / rundir.METRICS, self.step)
        if resumed:
            self._log({"event": "resume", "step": self.step})

    # -- checkpoints ---------------------------------------------------------------
    def _state(self) -> dict:
        model_state, optim_state = full_state(self.wrapped, self.optimizer)
        return {"format": CHECKPOINT_FORMAT, "model": model_state, "optimizer": optim_state, "step": self.step,
                "best_valid": self.best_valid, "best_step": self.best_step, "elapsed": self.elapsed,
                "train_seconds": self.train_seconds, "tokens_seen": self.tokens_seen, "curve": self.curve,
                "train_window": [self.window_loss, self.window_n],
                "rng_per_rank": self.dist.gather(all_rng_states(self.device)),
                "trained_on": {"device": device_name(self.device), "threads": self.threads, "compiled": self.compiled},
                "devices": self.devices_used(), "most_processes": self.most_processes(),
                "ever_compiled": self.ever_compiled()}

    def ever_compiled(self) -> bool:
        """Whether a leg of this run trained compiled: its time and tokens/s count the compiling (result.json's
        ``compiled`` said the last leg's, false of a run compiled, stopped and finished eager)."""
        return self.compiled or self.earlier_compiled

    def most_processes(self) -> int:
        """The most processes a leg of this run trained in (result.json's ``processes``: it said the last leg's, 1 of
        a run trained in 2 processes and finished in one)."""
        return max(self.dist.world, self.earlier_processes)

    def devices_used(self) -> list[str]:
        """Every device (with its thread count, and its processes where more than one) this run has run on, each once,
        in order: result.json's device said only the last leg's ("cpu (2 threads)" of a run trained on 1 thread and
        resumed on 2 for its test)."""
        leg = device_name(self.device) + (f" x {self.dist.world} processes" if self.dist.world > 1 else "")
        used = list(dict.fromkeys([*self.earlier_devices, leg]))
        # at most as many as a checkpoint may record (a 65th was written, and every resume then refused the file as
        # damaged): the first ones and this one, "..." between them
        return used if len(used) <= MAX_DEVICES_RECORDED else [*used[:MAX_DEVICES_RECORDED - 2], "...", used[-1]]

    def _save(self) -> None:
        state = self._state()
        self.dist.main_only(lambda: rundir.save_checkpoint(state, self.run_dir / rundir.CHECKPOINT))

    def _load(self, state: dict, path: Path) -> None:
        """The run's state from ``state``, its checkpoint read from ``path`` (its weights checked by load_weights)."""
        try:
            if state.get("format") != CHECKPOINT_FORMAT:  # a layout this gbattn does not write was read as its own
                raise ValueError(f"its format is {shown(state.get('format'))}; this gbattn reads format "
                                 f"{CHECKPOINT_FORMAT}")
            check_optimizer_moments(state["model"], state["optimizer"], self.optimizer)
            # AdamW's settings are the run's (its config, this device), not the file's: a checkpoint's eps of "x" or
            # amsgrad of true was a traceback at the next step, its maximize=true or betas of 2 trained on silently.
            # The learning rate stays the file's: the schedule sets it at every step.
            settings = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                        for g in self.optimizer.param_groups]
            load_full_state(self.wrapped, state["model"], self.optimizer, state["optimizer"])
            for group, own in zip(self.optimizer.param_groups, settings):
                group.update(own)
            step, tokens_seen = state["step"], state["tokens_seen"]
            per_step = self.tokens_per_step
            if not (all(isinstance(v, int) and not isinstance(v, bool) for v in (step, tokens_seen))
                    and 0 <= step <= self.total_steps and tokens_seen == step * per_step):  # int() took "5", 5.5, True
                raise ValueError(f"step={shown(step)} and tokens_seen={shown(tokens_seen)} must be integers, 0 <= "
                                 f"step <= {self.total_steps} (the run's steps) and tokens_seen = step x {per_step:,} "
                                 f"(the tokens of a step)")  # (10**30 went into result.json's tokens and FLOPs)
            self.step = step
            best_step, curve, best_valid = state["best_step"], state["curve"], state["best_valid"]
            if not (best_step is None or isinstance(best_step, int) and not isinstance(best_step, bool) and
                    0 <= best_step <= step) or not rundir.valid_curve(curve):
                raise ValueError("its best step or validation curve is malformed")
            if isinstance(best_valid, bool) or not isinstance(best_valid, (int, float)):
                raise ValueError(f"its best validation loss {shown(best_valid)} is not a number")
            if math.isnan(best_valid):  # (no evaluation yet: inf) no loss would ever count as better
                raise ValueError("its best validation loss is NaN")
            if best_valid < 0:  # a cross-entropy never is: no later loss would count as better, nor be kept as best
                raise ValueError(f"its best validation loss {shown(best_valid)} is negative")
            # The best is the curve's first lowest loss, as _eval_and_checkpoint keeps it (a best_valid of 0.5 set by
            # hand was reported as the run's valid loss, and a better evaluation later was not kept as best)
            at_best = [p["valid_loss"] for p in curve if p["step"] == best_step]
            if ((best_step is None) != (best_valid == math.inf) or best_step is not None and at_best != [best_valid]
                    or any(p["valid_loss"] is not None and p["valid_loss"] < best_valid for p in curve)):
                raise ValueError(f"its best validation (loss {shown(best_valid)} at step {shown(best_step)}) is not "
                                 f"its validation curve's lowest loss")
            self.best_valid, self.best_step = float(best_valid), best_step
            seconds = (state["elapsed"], state["train_seconds"])  # NaN: a result.json without its wall-clock time
            if not all(_finite_amount(v) for v in seconds):
                raise ValueError(f"elapsed={shown(seconds[0])} and train_seconds={shown(seconds[1])} must be numbers "
                                 f"of seconds >= 0")
            self.elapsed, self.train_seconds = float(seconds[0]), float(seconds[1])
            self.tokens_seen, self.curve = tokens_seen, curve
            window = state.get("train_window", [0.0, 0])  # (checkpoints from before it was kept: none)
            # (a count of 0 or 0.5 with a sum of 1000 logged a training loss of 170.7 where it was 4.1)
            if not (isinstance(window, list) and len(window) == 2 and all(_finite_amount(v) for v in window)
                    and type(window[1]) is int and window[1] <= step and (window[1] > 0 or window[0] == 0)):
                raise ValueError("its training-loss window is malformed")
            self.window_loss, self.window_n = float(window[0]), window[1]
            # Checkpoints written before every process's state was kept hold rank 0's alone, as "rng".
            per_rank = state["rng_per_rank"] if "rng_per_rank" in state else [state["rng"]]
            if not (isinstance(per_rank, list) and per_rank and all(
                    isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) for r in per_rank)):
                raise ValueError("its random number generator states are malformed")
            self.saved_processes = len(per_rank)
            trained_on = state.get("trained_on")  # (checkpoints from before it was kept: none)
            if trained_on is not None and not (
                    isinstance(trained_on, dict) and isinstance(trained_on.get("device"), str)
                    and isinstance(trained_on.get("compiled"), bool) and type(trained_on.get("threads")) is int
                    and trained_on["threads"] > 0 and trained_on["device"].isprintable()):
                raise ValueError(f"its record of the hardware it trained on is malformed: {shown(trained_on)}")
            self.saved_trained_on = trained_on
            devices = state.get("devices", [trained_on["device"]] if trained_on is not None else [])
            if not (isinstance(devices, list) and len(devices) <= MAX_DEVICES_RECORDED
                    and all(isinstance(d, str) and len(d) <= 200 and d.isprintable() for d in devices)):
                raise ValueError(f"its record of the devices it ran on is malformed: {shown(devices)}")
            self.earlier_devices = devices
            most = state.get("most_processes", len(per_rank))  # (checkpoints from before it was kept: the last leg's)
            if not (type(most) is int and most >= len(per_rank)):  # (fewer than its own streams': damaged)
                raise ValueError(f"its record of the processes it ran in is malformed: {shown(most)}")
            self.earlier_processes = most
            # (checkpoints from before it was kept: the last leg's)
            compiled = state.get("ever_compiled", bool(trained_on and trained_on["compiled"]))
            if not isinstance(compiled, bool):
                raise ValueError(f"its record of a compiled leg is malformed: {shown(compiled)}")
            self.earlier_compiled = compiled
            if len(per_rank) == self.dist.world:  # every process resumes its own random stream
                restore_rng_states(per_rank[self.dist.rank], self.device)
            else:  # saved by another number of processes: rank 0's stream, distinct ones for the others
                restore_rng_states(per_rank[0], self.device)
                if self.dist.rank:
                    torch.manual_seed(self.train_cfg.seed + 1000 * self.dist.rank + self.step)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint {path} is malformed or does not match this run ({error_detail(e, 120)})"
            ) from None

    def _log(self, record: dict) -> None:
        if self.main:
            rundir.append_event(self.run_dir, record)

    # -- batches -------------------------------------------------------------------
    def _global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.train_cfg
        train = self.data.splits["train"]
        if cfg.sampling == "rows":
            epoch, i = divmod(step, self.steps_per_epoch)
            # The epoch's order, drawn once per epoch (a pure function of seed and epoch): drawn at every step, it
            # cost 312 ms and 67 MiB a step for OpenWebText's 8.8M rows of 1,025 tokens.
            if self._epoch_order[0] != epoch:
                self._epoch_order = (epoch, epoch_permutation(self.n_rows, cfg.seed, epoch))
            rows = self._epoch_order[1][i * cfg.batch_size : (i + 1) * cfg.batch_size]
            return rows_batch(train, self.seq_len, rows)
        return random_windows(train, self.seq_len, cfg.batch_size, cfg.seed, step)

    def _is_eval_step(self, step: int) -> bool:
        """Evaluate after ``step`` (1-based count of finished steps)?"""
        cfg = self.train_cfg
        if step == self.total_steps or (cfg.eval_every and step % cfg.eval_every == 0):
            return True
        return self.steps_per_epoch is not None and not cfg.eval_every and step % self.steps_per_epoch == 0

    # -- evaluation ----------------------------------------------------------------
    def _evaluate(self, split: str):
        return evaluate(self.model, self.data.splits[split], self.seq_len, self.train_cfg.eval_batch_size,
                        self.device, self.autocast, self.dist)

    def _eval_and_checkpoint(self) -> None:
        t0 = time.perf_counter()
        res = self._evaluate("valid")
        if not math.isfinite(res.loss):  # (a NaN is never below the best: it was logged and checkpointed as good, and
            # a run whose last update broke its model ended with exit 0, every figure null)
            self._log({"event": "stop", "reason": "non-finite validation loss", "step": self.step,
                       "valid_loss": str(res.loss)})
            self.bar.close()
            raise TrainingDiverged(self._diverged_message(f"the validation loss became {res.loss}", evaluated=True))
        improved = res.loss < self.best_valid
        if improved:
            self.best_valid, self.best_step = res.loss, self.step
            best = {"model": full_state(self.wrapped)[0], "step": self.step, "valid_loss": res.loss}
            self.dist.main_only(lambda: rundir.save_checkpoint(best, self.run_dir / rundir.BEST))
        epoch = self.step / self.steps_per_epoch if self.steps_per_epoch else None
        point = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "epoch": epoch,
            "valid_loss": res.loss,
            "valid_ppl": res.ppl,
        }
        self.curve.append(point)
        self.elapsed += time.perf_counter() - t0
        self._log({"event": "eval", "split": "valid", **point, "best": improved, "elapsed": self.elapsed})
        self._save()  # (before the line: a line that cannot be written lost the evaluation's checkpoint)
        if self.show:
            self.bar.write(
                f"step {self.step}: valid loss {res.loss:.4f} ppl {res.ppl:.2f}{' (best)' if improved else ''}"
            )

    # -- the loop ------------------------------------------------------------------
    def run(self) -> dict:
        result_path = self.run_dir / rundir.RESULT
        if self.resume and result_path.exists():
            result = rundir.read_result(result_path)
            if not self.quiet and is_first_process():  # under torchrun: said once
                print(printable_text(f"{self.run_dir} finished at step {result['steps']} (its result.json): nothing "
                                     f"to resume; --restart trains it again"))
            return result
        threads, self.callers_rng = torch.get_num_threads(), None
        tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # use_tf32 sets them on CUDA
        # A run's arithmetic is its own, not the caller's: a default dtype of float64 set in a notebook built the
        # model in float64 (another run, recorded nowhere, and its resume went on in float32), and torch.no_grad()
        # around train_run trained nothing (a RuntimeError)
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.inference_mode(False), torch.enable_grad():  # (the caller's inference_mode too)
                return self._run()
        finally:
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)  # `threads` applies to this run only
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32  # its precision too
            if self.callers_rng is not None:  # and so do its seeds: a caller's random stream goes on where it was
                restore_rng_states(self.callers_rng, self.device)
            if getattr(self, "lock", None) is not None:
                self.lock.release()

    def _run(self) -> dict:
        self._setup()
        cfg = self.train_cfg
        name = f"{self.extra['label']}/{self.run_dir.name}" if "label" in self.extra else self.run_dir.name
        self.bar = Progress(self.total_steps, desc=printable_text(f"train {name}"), initial=self.step,
                            disable=not self.show)
        last_ckpt = time.monotonic()
        window_t0, window_steps, window_tokens = time.perf_counter(), 0, 0  # this process's, for speed
        self.model.train()
        with _StopFlag() as stop:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                lr = learning_rate(self.step, cfg, self.total_steps, self.warmup)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                loss = self._train_step(self.step)
                if not (math.isfinite(loss) and math.isfinite(self.grad_norm)):
                    gradient = math.isfinite(loss)  # (the loss finite: its gradient overflowed)
                    self._log({"event": "stop", "reason": "non-finite gradient" if gradient else "non-finite loss",
                               "step": self.step, "loss": str(loss), "grad_norm": str(self.grad_norm)})
                    self.bar.close()
                    raise TrainingDiverged(self._diverged_message(
                        f"the gradient norm became {self.grad_norm} (loss {loss:.4g})" if gradient
                        else f"loss became {loss}"))
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                dt = time.perf_counter() - t0
                self.train_seconds += dt
                self.elapsed += dt
                self.window_loss, self.window_n = self.window_loss + loss, self.window_n + 1
                window_steps, window_tokens = window_steps + 1, window_tokens + self.tokens_per_step
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    now = time.perf_counter()
                    tok_s = window_tokens / max(now - window_t0, 1e-9)
                    rec = {
                        "event": "train",
                        "step": self.step,
                        "tokens": self.tokens_seen,
                        "loss": self.window_loss / self.window_n,
                        "lr": lr,
                        "tok_s": tok_s,
                        "elapsed": self.elapsed,
                    }
                    self._log(rec)
                    self.bar.update(window_steps, loss=f"{rec['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
                    self.window_loss, self.window_n, window_steps, window_tokens, window_t0 = 0.0, 0, 0, 0, now
                paused = time.perf_counter()
                if self._is_eval_step(self.step):
                    self._eval_and_checkpoint()
                    last_ckpt = time.monotonic()
                elif self._on_any_process(time.monotonic() - last_ckpt > 60 * cfg.checkpoint_minutes):
                    self._save()  # a collective: every process saves when one's clock says it is due
                    last_ckpt = time.monotonic()
                window_t0 += time.perf_counter() - paused  # tokens/s counts training time only
                if self._should_stop(stop.requested) and self.step < self.total_steps:
                    self._save()
                    self._log({"event": "interrupted", "step": self.step})
                    self.bar.close()
                    detail = (f"at step {self.step}; checkpoint saved in {self.run_dir}: continue with "
                              f"{self._continue_with()}")
                    raise self._interrupted(self._stop_signal(stop), detail)
        self.bar.close()
        try:
            with _sigterm_raises():
                result = self._finish()
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (cli's Terminated): the last step's checkpoint is saved
            signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
            if (self.run_dir / rundir.RESULT).exists():  # after result.json was written (its summary printing, say)
                raise self._finished_all_the_same(signum, "after the test evaluation") from None
            detail = (f"during the test evaluation after the last step; its checkpoint is saved in {self.run_dir}: "
                      f"continue with {self._continue_with(' (it tests again)')}")
            raise self._interrupted(signum, detail) from None
        if stop.requested:  # during the last step: the run finished, and the stop is not lost (compare goes no further)
            raise self._finished_all_the_same(stop.signum, "during the last step")
        return result

    def _finished_all_the_same(self, signum: int, when: str) -> TrainingInterrupted:
        """The one-line error of a stop that came once nothing was left to train (the stop is not lost: compare goes
        no further), saying the run finished."""
        return self._interrupted(signum, f"{when}: {self.run_dir} finished all the same (its result.json is written); "
                                         f"nothing is left to resume" + ("; rerun the same `gbattn compare` command "
                                                                        "for the rest of the comparison"
                                                                        if "label" in self.extra else ""))

    @staticmethod
    def _interrupted(signum: int, detail: str) -> TrainingInterrupted:
        """The one-line error of a run stopped by signal ``signum``, with the status a shell reports for it
        (130 for SIGINT, 143 for SIGTERM, 128 + the number of another)."""
        error = TrainingInterrupted(f"{stop_words(signum)} {detail}")
        error.exit_code = 128 + int(signum)
        return error

    def _stop_signal(self, stop) -> int:
        """The signal that stopped every process, the same on each (a collective): SIGTERM where any process
        received one, else the first process's other stopping signal (SIGHUP, SIGUSR1, ...), else SIGINT; one process
        alone may have been sent it."""
        received = self.dist.gather(stop.signum if stop.requested else None)
        return signal.SIGTERM if signal.SIGTERM in received else next(
            (signum for signum in received if signum in STOPPING_SIGNALS), signal.SIGINT)

    def _other_arithmetic(self) -> list[str]:
        """How the resumed checkpoint was trained otherwise than this run trains, each with how to resume as it ran:
        another device, CPU thread count or compilation adds up the same sums in another order (a tiny run killed at
        step 5 on 1 thread and resumed on 2 ended 1.6e-6 away from the uninterrupted run's weights, yet said
        "exactly"). Empty for a checkpoint from before this was recorded."""
        saved = self.saved_trained_on
        if saved is None:
            return []
        changes, device = [], device_name(self.device)
        if saved["device"] != device:
            threads = saved["threads"]
            same_but_threads = self.device.type == "cpu" and device_name(self.device, threads) == saved["device"]
            changes.append(f"on {saved['device']} and this run is on {device}"
                           + (f" (resume with --threads {threads})" if same_but_threads else ""))
        if saved["compiled"] != self.compiled:
            was = saved["compiled"]
            changes.append(f"{'compiled' if was else 'eager'} and this run trains {'eager' if was else 'compiled'} "
                           f"(resume with --{'' if was else 'no-'}compile"
                           + (f"; a comparison's: --set compile={'true' if was else 'false'}" if "label" in self.extra
                              else "") + ")")
        return changes

    def _other_processes_note(self) -> str:
        """The warning of a run resumed on another number of processes than its checkpoint holds the random streams
        of: it goes on, but not exactly as an uninterrupted run (:meth:`_load` seeds the streams it lacks)."""
        saved, args = self.saved_processes, f"train --resume {self._out_option()}"
        again = (f"`gbattn {args}` (one process)" if saved == 1
                 else f"`torchrun --nproc_per_node {saved} -m gbattn.cli {args}`")
        return (f"warning: the checkpoint of {self.run_dir} holds the random streams of {saved} process"
                f"{'es' if saved > 1 else ''} and this run has {self.dist.world}: it goes on, but not exactly as the "
                f"uninterrupted run would (gradients add up in another order, and a process without its own stream "
                f"draws other dropout masks); to continue exactly, resume as it ran: {again}")

    def _continue_with(self, note: str = "") -> str:
        """The resume command (:meth:`_resume_command`), ``note``, and for a comparison's run the comparison's own
        way to continue."""
        return (self._resume_command() + note
                + (" (or rerun the same `gbattn compare` command)" if "label" in self.extra else ""))

    def _resume_command(self) -> str:
        """How to continue this run: under torchrun, launched as it was (in one process it would train on
        alone: slower, with FSDP2 perhaps out of memory, and with rank 0's dropout stream only)."""
        command, where = self._launched_as(f"train --resume {self._out_option()}")
        return f"`{command}`{where}"

    def _out_option(self) -> str:
        """``--out RUN_DIR`` as a shell reads it back (a directory named with a space, say), for the commands a run
        suggests."""
        return f"--out {shell_path(self.run_dir)}"

    def _launched_as(self, args: str) -> tuple[str, str]:
        """``gbattn ARGS`` launched as this run was: in one process, or under torchrun with as many processes
        (command, and " on each node, ..." where they span several)."""
        if not self.dist.enabled:
            return f"gbattn {args}", ""
        per_node = os.environ.get("LOCAL_WORLD_SIZE", str(self.dist.world))
        return (f"torchrun --nproc_per_node {per_node} -m gbattn.cli {args}",
                "" if per_node == str(self.dist.world) else " on each node, launched as this run was")

    def _diverged_message(self, what: str, evaluated: bool = False) -> str:
        """``what`` became non-finite ("loss became nan") in the step being trained (steps counted from 1, as a
        checkpoint's: "at step 1" named the step after the checkpoint of step 1, "the last good"), or in the
        evaluation after the last one trained (``evaluated``): the run stops, saying what is kept."""
        when = f"after step {self.step}" if evaluated else f"in step {self.step + 1}"
        kept = self._checkpoint_step()
        again = ("".join(self._launched_as(f"train ... {self._out_option()} --restart")) if "label" not in self.extra
                 else "gbattn compare ... with another --out (a comparison's directory keeps its settings)")
        if kept is None:
            return (f"{what} {when}, before the first checkpoint: nothing to keep; start "
                    f"again with corrected settings: {again}")
        return (f"{what} {when}: stopped; the last good checkpoint (step {kept}) is kept in "
                f"{self.run_dir}; to start again with other settings: {again}")

    def _should_stop(self, requested: bool) -> bool:
        return self._on_any_process(requested)

    def _on_any_process(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any process: a decision every process takes together, because
        what it starts (a checkpoint, a stop) is a collective."""
        if not self.dist.enabled:
            return flag
        return self.dist.all_sum([float(flag)])[0] > 0

    def _checkpoint_step(self) -> int | None:
        try:
            return int(rundir.load_checkpoint(self.run_dir / rundir.CHECKPOINT)["step"])
        except CheckpointError:
            return None

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
            last = micro == cfg.grad_accum - 1
            with self.dist.no_sync(self.wrapped, last, cfg.parallel):
                with self.autocast():
                    loss = self.step_model(xs, ys) / cfg.grad_accum
                loss.backward()
            total += loss.detach()
        value, self.grad_norm = clip_and_read(self.wrapped.parameters(), cfg.grad_clip, total)
        if self.dist.enabled:
            value, self.grad_norm = (v / self.dist.world for v in self.dist.all_sum([value, self.grad_norm]))
        if math.isfinite(value) and math.isfinite(self.grad_norm):  # never step on a non-finite loss or gradient
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def _finish(self) -> dict:
        """Test perplexity from the best-validation checkpoint; write result.json."""
        best_path = self.run_dir / rundir.BEST
        # The main process (the one that writes best.pt) reads and checks it, its error every process's; the others
        # read their own copy (written by the main process before they went on)
        saved = self.dist.main_only(self._read_best)
        if saved is None and not self.dist.is_main and best_path.exists():
            saved = rundir.load_checkpoint(best_path, self.device)
        if saved is not None:  # written by an earlier process when resumed: checked as the run's checkpoint is
            best = saved["model"]
            rundir.check_weights_fit(self.model_cfg, best, best_path)
            load_full_state(self.wrapped, best)
        test = self._evaluate("test")
        valid_best = perplexity(self.best_valid)
        result = {
            # ("." or "..": the folder's own name, not "" or ".."; a link keeps its own name, link/.. is its target's)
            "run_dir": folder_name(self.run_dir),
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
            "test_split": tested_split(self.data.notes),  # the split test_* were taken on
            # what the test was scored in (amp=auto: bfloat16 on a GPU, float32 on a CPU), which eval names
            "test_precision": precision_name(self.device, self.train_cfg.amp),
            "wall_clock_s": self.elapsed,
            "train_tokens_per_s": self.tokens_seen / max(self.train_seconds, 1e-9),
            "compiled": self.ever_compiled(),  # its time and tokens/s count torch.compile's compiling
            "device": "; ".join(self.devices_used()),  # (every leg's: "cpu (1 thread, ...); cpu (2 threads, ...)")
            "processes": self.most_processes(),  # (the most of any leg; device names each leg's)
            "curve": self.curve,
            "extra": self.extra,
        }
        self._log(
            {"event": "test", "step": self.step, "test_loss": test.loss, "test_ppl": test.ppl, "tokens": test.tokens}
        )
        self.dist.main_only(lambda: rundir.write_result(self.run_dir, result))
        if self.show:
            print(printable_text(f"{self.run_dir}: best valid ppl {valid_best:.2f} (step {self.best_step}), test "
                                 f"ppl {test.ppl:.2f}" + test_split_note(self.data.notes)))
        return result


def check_optimizer_moments(model_state: dict, optim_state, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Refuse an optimizer state whose AdamW moments do not have their parameter's shape or are not finite
    floating-point numbers (``exp_avg_sq`` >= 0), whose step count is not a finite number >= 0, or whose
    parameter groups are not ``optimizer``'s: a damaged checkpoint would otherwise fail at the first step
    (a traceback, after the run's files were touched), diverge there, or train on with integer moments.
    A parameter's state holds both moments and the step count (AdamW writes them together at its first step; one
    missing was started again from zero, silently). A state keyed by parameter index (checkpoints from before FSDP2
    support) is checked against ``optimizer``'s own parameter at each index (its moments were not checked at all)."""
    moments = optim_state.get("state") if isinstance(optim_state, dict) else None
    if not isinstance(moments, dict):
        raise ValueError("its optimizer state is malformed")
    own = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    for name, param_state in moments.items():
        if isinstance(name, str):
            weight = model_state.get(name)
        elif type(name) is int and 0 <= name < len(own):
            weight, name = own[name], f"parameter {name}"
        elif optimizer is not None:
            raise ValueError(f"its optimizer's state names parameter {shown(name)}, which this model's optimizer has "
                             f"not (it has {len(own)}, numbered from 0)")
        else:
            weight = None
        missing = [key for key in ("exp_avg", "exp_avg_sq", "step")
                   if not isinstance(param_state, dict) or key not in param_state]
        if missing:
            raise ValueError(f"the optimizer's state of {name} has no {' and no '.join(missing)}")
        for key in ("exp_avg", "exp_avg_sq"):
            value = param_state.get(key)
            if not isinstance(value, torch.Tensor):  # (a number or null was an AttributeError at the first step)
                raise ValueError(f"the optimizer's {key} of {name} is {shown(value, 40)}, not a tensor")
            if weight is not None and value.shape != weight.shape:
                raise ValueError(f"the optimizer's {key} of {name} has shape {tuple(value.shape)}, "
                                 f"the weight {tuple(weight.shape)}")
            if not (value.is_floating_point() and rundir.all_finite(value)
                    and (key == "exp_avg" or value.numel() == 0 or bool(value.min() >= 0))):
                raise ValueError(f"the optimizer's {key} of {name} holds {value.dtype} values that are not finite "
                                 f"floating-point numbers{' >= 0' if key == 'exp_avg_sq' else ''}")
        count = param_state["step"]
        if not (isinstance(count, (int, float, torch.Tensor)) and not isinstance(count, bool)
                and torch.as_tensor(count).numel() == 1 and math.isfinite(float(count)) and float(count) >= 0):
            raise ValueError(f"the optimizer's step count of {name} is {shown(count)}, not a number >= 0")
    groups = optim_state.get("param_groups")
    if optimizer is not None and (not isinstance(groups, list) or [
            len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None for g in groups]
            != [len(g["params"]) for g in optimizer.param_groups]):
        raise ValueError("its optimizer's parameter groups are not this model's")


def train(run_dir, model_cfg=None, train_cfg=None, resume=False, quiet=False, extra=None, preset=None,
          overrides=None, restart=False) -> dict:
    """Train (or, ``resume=True``, resume) one run into the run directory ``run_dir``, as `gbattn train` does;
    returns its result record (``result.json``; README, "Using gbattn from Python"). A resumed run needs no configs;
    given, they must be its own but for result-neutral fields (``TrainConfig.RESULT_NEUTRAL``), which they set.
    ``restart=True`` replaces a run already in ``run_dir``, as `gbattn train --restart` does. ``preset``: the name of
    the preset the configs were built from, recorded in config.json as `gbattn train --preset` records it (None: none
    is recorded, and `gbattn train --init-from` the run then trains with paper-small's recipe); ``extra``: a dict of
    JSON values recorded with it. A resumed run keeps its recorded preset and extra: others given are a UserError."""
    return Trainer(run_dir, model_cfg, train_cfg, resume=resume, quiet=quiet, extra=extra, preset=preset,
                   overrides=overrides, restart=restart).run()
