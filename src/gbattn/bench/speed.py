"""``gbattn bench``: what each attention variant costs next to standard, measured in one run.

Timings are interleaved (variant A, B, C, A, B, C, ...) and summarised by the median, because
machines are noisy; CUDA timings synchronise and warm up first. Reported per variant: training
step time and tokens/s, peak memory of a training step, forward FLOPs per token
(``torch.utils.flop_counter``), prefill time and cached decode tokens/s, and the ratios to
standard, including (step-time ratio) / (training-FLOP ratio): 1.0 means the variant costs
exactly its extra arithmetic. Plus a sequence-length sweep of time and peak memory.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from time import process_time

import torch

from gbattn.bench import DEFAULT_VARIANTS
from gbattn.config import ModelConfig, TrainConfig, get_preset, parse_variant, preset_config, variant_spec
from gbattn.errors import ConfigError, UserError
from gbattn.files import check_writable_dir, portable_path, write_report
from gbattn.model.decoding import compiled_decode_step, eager_decode_step
from gbattn.model.gpt import GPT
from gbattn.model.params import flops_per_token
from gbattn.progress import Progress
from gbattn.rundir import RunLock, check_out
from gbattn.runtime import autocast as bf16_autocast
from gbattn.runtime import (
    command_line,
    compile_failure,
    cpu_busy_seconds,
    device_name,
    resolve_device,
    set_threads,
    software_versions,
    usable_cpus,
    use_tf32,
)
from gbattn.terminal import in_millions, note, terminal_line
from gbattn.train.trainer import clip_and_read, make_optimizer

COMPILED = " · compiled"  # the label suffix of a variant's compiled row; its eager row has the bare label
RECOMPUTED = " · recomputed"  # ... of its row with activation checkpointing (GPT.set_activation_checkpointing)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Case:
    label: str
    cfg: ModelConfig
    model: GPT = None
    optimizer: torch.optim.Optimizer = None
    step_times: list = field(default_factory=list)
    prefill_times: list = field(default_factory=list)
    decode_times: list = field(default_factory=list)
    compiled: bool = False
    recomputed: bool = False  # activation checkpointing: each block recomputed in the backward pass
    decodes: bool = True  # False: a recomputing row beside its kept row, which decodes the same (training only differs)
    step_model: object = None
    decode_step: object = None
    warmup_s: dict = field(default_factory=dict)
    grad_clip: float = TrainConfig.grad_clip


def bench_training(preset: str) -> TrainConfig:
    """The preset's training settings, whose optimizer and gradient clipping the benchmarked step uses."""
    return TrainConfig.from_dict(dict(get_preset(preset).train))


def bench_optimizer(model: GPT, device: torch.device, training: TrainConfig | None = None) -> torch.optim.Optimizer:
    """The optimizer of every benchmarked step, timed or probed for memory: `gbattn train`'s (its parameter groups;
    fused on CUDA, foreach on a CPU), for ``training`` (default: the training defaults)."""
    return make_optimizer(model, training or TrainConfig(), device)


def train_step(case: Case, x, y, autocast) -> None:
    """`gbattn train`'s step at ``grad_accum=1``: forward and backward, the gradients clipped with the loss and the
    norm read in one host sync (:func:`gbattn.train.trainer.clip_and_read`), then AdamW's step."""
    with autocast():
        loss = case.model(x, y)
    loss.backward()
    loss_value, norm = clip_and_read(case.model.parameters(), case.grad_clip, loss.detach())
    if math.isfinite(loss_value) and math.isfinite(norm):  # (as the trainer: never a step on a non-finite one)
        case.optimizer.step()
    case.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def prefill_and_decode(model: GPT, prompt, n_decode: int, device, autocast, step=None) -> tuple[float, float]:
    """Seconds for one prefill of ``prompt`` and for ``n_decode`` single-token cached steps (through
    ``step``, e.g. the compiled one, or the model's eager forward)."""
    model.eval()
    T = prompt.shape[1]
    model.setup_cache(prompt.shape[0], max_len=T + n_decode)
    step = step or eager_decode_step(model)
    slots = torch.arange(T, T + n_decode, device=device)  # (views of it: no host sync per token, as in generate)
    sync(device)
    t0 = time.perf_counter()
    with autocast():
        logits = model(prompt, input_pos=torch.arange(T, device=device))
    sync(device)
    t1 = time.perf_counter()
    nxt = logits[:, -1:].argmax(-1)
    for i in range(n_decode):
        with autocast():
            logits_BV = step(nxt, slots[i:i + 1], None, None)
        nxt = logits_BV.argmax(-1, keepdim=True)
    sync(device)
    t2 = time.perf_counter()
    model.clear_cache()
    model.train()
    return t1 - t0, t2 - t1


def peak_memory_train_step(cfg: ModelConfig, batch: int, seq_len: int, device: torch.device, amp: bool,
                           recomputed: bool, training: TrainConfig | None = None) -> float:
    """Peak memory (bytes) of a steady-state training step: parameters, gradients, AdamW state
    and activations (``recomputed``: with activation checkpointing). CUDA: ``max_memory_allocated``. CPU: the
    peak resident-set growth of a fresh subprocess (the CPU allocator keeps no statistics), after a one-token
    warm-up step there so that loading and initialising libraries (about 90 MiB) is not counted."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _run_steps(cfg, batch, seq_len, device, amp, steps=2, recomputed=recomputed, training=training)
        return torch.cuda.max_memory_allocated(device) - base
    payload = json.dumps({"cfg": cfg.to_dict(), "batch": batch, "seq_len": seq_len, "threads": torch.get_num_threads(),
                          "recomputed": recomputed, "training": (training or TrainConfig()).to_dict()})
    # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed, so the warm-up's
    # freed tensors would stay resident and be reused uncounted by the measured steps.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-m", "gbattn.bench.speed", payload], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"the CPU memory probe (a fresh process training {cfg.attn} at batch {batch} x {seq_len}) "
                        f"failed: {last}")
    return float(proc.stdout.strip().splitlines()[-1])


def _run_steps(cfg, batch, seq_len, device, amp, steps, recomputed, training=None):
    training = training or TrainConfig()
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    model.set_activation_checkpointing(recomputed)
    case = Case("probe", cfg, model, bench_optimizer(model, device, training), recomputed=recomputed,
                grad_clip=training.grad_clip)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    autocast = bf16_autocast(device, "auto" if amp else "off")
    for _ in range(steps):
        train_step(case, x, x, autocast)
    sync(device)
    del case, model


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (the CPU memory probe needs Linux)")


def _memory_probe_main(payload: str) -> None:
    # VmHWM is this process's own resident high-water mark. Not getrusage's ru_maxrss: Linux
    # carries that across fork/exec, so a child would report its (large) parent's RSS. A warm-up
    # step at one token first pages in the code and libraries the step uses; then the high-water
    # mark is reset to the current RSS (writing 5 to clear_refs), so only the step's tensors count.
    d = json.loads(payload)
    cfg = ModelConfig.from_dict(d["cfg"])
    torch.set_num_threads(d["threads"])  # the timed steps' threads (each keeps its own scratch memory)
    recomputed = d["recomputed"]
    training = TrainConfig.from_dict(d["training"]) if "training" in d else TrainConfig()
    _run_steps(cfg, 1, 1, torch.device("cpu"), False, steps=1, recomputed=recomputed, training=training)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # a kernel or sandbox without it: the warm-up's own peak (one token) is below the steps'
        pass
    base = _status_bytes("VmRSS")
    _run_steps(cfg, d["batch"], d["seq_len"], torch.device("cpu"), False, steps=2, recomputed=recomputed,
               training=training)
    print(max(0, _status_bytes("VmHWM") - base))


def run_bench(preset: str, variants: list[str] | None = None, device: str = "auto", batch: int | None = None,
              seq_len: int | None = None, repeats: int = 5, steps: int = 3, prefill: int | None = None,
              decode: int | None = None, sweep: list[int] | None = None, sweep_variants: list[str] | None = None,
              amp: bool = True, compile: str = "off", threads: int | None = None, out: str | None = None,
              quiet: bool = False, sets: dict | None = None, activation_checkpointing: str = "off") -> dict:
    """``sets``: model-config overrides for every variant (``{"dropout": 0.0}``); a variant's own
    options (``boosted:rounds=3``) apply on top. ``compile``: off (eager), on, or both side by side
    (each variant eager and ``torch.compile``d, training step and decode step, same repeats).
    ``activation_checkpointing``: off, on, or both side by side (each variant's training step keeping its
    activations and recomputing each block in the backward pass; eager only).
    ``decode``: cached decode steps (default 64, or half the block size when smaller) after a prefill
    of ``prefill`` tokens (default up to 128, what the block size leaves)."""
    sets = dict(sets or {})
    if activation_checkpointing != "off" and compile != "off":  # (four rows a variant, none of them compared)
        raise UserError(f"--activation-checkpointing {activation_checkpointing} times eager training steps: "
                        f"give it with --compile off")
    if "attn" in sets:
        raise UserError("--set attn=... would make every variant benched that one: name the variants with --attn")
    if sweep_variants and not sweep:  # its variants were dropped, silently, with the sweep not asked for
        raise UserError("--sweep-attn goes with --sweep T ... (the variants of the sequence-length sweep)")
    if out:  # a run, comparison, export or denoise output is not a benchmark's folder (rundir.check_out)
        check_out(out, (), "a folder for bench.json and bench.md")
        check_writable_dir(out, "--out", create=False)  # (made by the lock, which removes it if the bench is refused)
    # One writer, from before the timings: a second bench into this folder is refused at once (it was refused
    # only when its report was written, its minutes of timings lost). Two benches mixed bench.json and bench.md.
    lock = RunLock(out, what="benchmark") if out else None
    try:
        if threads is not None:  # (more than the usable cores: a warning, as train's and eval's)
            set_threads(threads)
        dev = resolve_device(device)
        variants = [_label(spec) for spec in variants or DEFAULT_VARIANTS]
        if variants[0] != "standard":  # every ratio is against standard
            variants = ["standard"] + [v for v in variants if v != "standard"]
        options = [key for key in sets if key.startswith(("attn.", "attn_options"))]
        if options:  # (refused by standard's row, which no --attn named: "attention 'standard' has no option(s)")
            option = options[0].split(".", 1)[1] if "." in options[0] else "KEY"
            raise UserError(f"--set {options[0]}: an attention option would apply to every variant, standard's row "
                            f"too; give it with its variant: --attn VARIANT:{option}=VALUE (e.g. --attn "
                            f"boosted:rounds=3)")
        _refuse_repeats("--attn", variants, preset, sets)
        base_cfg = _variant_config(preset, "standard", sets)
        sweep_variants = [_label(spec) for spec in sweep_variants or ["standard", "boosted"]]
        if sweep:  # a bad --sweep-attn, or a --sweep length no model takes, fails now, not after the timings
            _refuse_repeats("--sweep-attn", sweep_variants, preset, sets)
            repeated = sorted({T for T in sweep if sweep.count(T) > 1})  # (each was timed again, a row of its own)
            if repeated:
                raise UserError(f"--sweep names length(s) {repeated} more than once: each length is timed once")
            for T in sweep:
                for spec in sweep_variants:
                    _sweep_config(preset, spec, sets, T)
        # (the preset's block size, or the one --set gave: an error naming the preset's would cite a size it does
        # not have)
        block_source = f"from --set block_size={base_cfg.block_size}" if "block_size" in sets else f"of preset {preset}"
        prefill, decode = _prefill_and_decode_lengths(block_source, base_cfg.block_size, prefill, decode)
        seq_len = base_cfg.input_length(seq_len)
        batch = batch or (32 if dev.type == "cuda" else 8)
        if seq_len > base_cfg.block_size:
            raise UserError(f"--seq-len {seq_len} exceeds the block size {base_cfg.block_size} {block_source}")
        autocast = bf16_autocast(dev, "auto" if amp else "off")
        use_tf32(dev)

        modes = {"off": [False], "on": [True], "both": [False, True]}
        training = bench_training(preset)
        cases = []
        for spec in variants:
            cfg = _variant_config(preset, spec, sets)
            for compiled, recomputed in itertools.product(modes[compile], modes[activation_checkpointing]):
                torch.manual_seed(0)
                model = GPT(cfg).to(dev)
                model.set_activation_checkpointing(recomputed)
                # (decoding trains nothing: with --activation-checkpointing both a recomputing row's would be its kept
                # row's again; with on, no row keeps its activations, so the recomputing rows decode)
                case = Case(spec + (COMPILED if compiled else "") + (RECOMPUTED if recomputed else ""), cfg, model,
                            bench_optimizer(model, dev, training), compiled=compiled, recomputed=recomputed,
                            decodes=not (recomputed and activation_checkpointing == "both"),
                            grad_clip=training.grad_clip)
                case.step_model = torch.compile(model) if compiled else model
                case.decode_step = compiled_decode_step(model) if compiled else None
                cases.append(case)

        x = torch.randint(0, base_cfg.vocab_size, (batch, seq_len), device=dev)
        prompt = torch.randint(0, base_cfg.vocab_size, (1, prefill), device=dev)
        compiled_cases = sum(case.compiled for case in cases)  # (eager only: dynamo not even imported)
        # Compiled cases warm up twice: one compiled after another made an earlier one compile again in its next round
        # (compiled standard's first measured repeat: 0.98 s a step, then 0.13 s, once compiled Twicing had compiled)
        warmups = 2 if compiled_cases else 1  # (the second round: compiled cases only)
        total = len(cases) * (repeats + 1) + compiled_cases
        bar = Progress(total, desc=f"bench {preset} on {dev.type}", unit="round", disable=quiet, interval=15)
        left_out: dict[str, str] = {}  # label -> why: a compiled case torch.compile failed on, reported as such
        # torch.compile compiles each variant's model through the same code (GPT.forward, the decode step): past
        # dynamo's recompile limit (8 by default) a further variant's training step ran eagerly, unsaid, as its
        # "compiled" row and its decode step failed. Room for every compiled case here, however many variants are
        # benched.
        room = (torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit + compiled_cases)
                if compiled_cases else contextlib.nullcontext())
        # On a CPU, how many of its cores other work kept busy while the measured repeats ran: a machine busy with
        # other work gave slower, noisier steps (a bench under a load of 7 on 2 cores printed its tokens/s without a
        # word). Not this process's own share of its threads' time: torch runs a small model's ops on fewer threads
        # than it has, and the memory probes' and the compiler's child processes are not this process's time.
        measured_from = None
        with room:
            for rep in range(repeats + warmups):  # the first rounds warm up (and compile)
                if rep == warmups:
                    measured_from = _load_snapshot()
                for case in cases:
                    if 0 < rep < warmups and not case.compiled:
                        continue
                    if case.label in left_out:
                        bar.update(1)
                        continue
                    runner = Case(case.label, case.cfg, case.step_model, case.optimizer, grad_clip=case.grad_clip)
                    try:
                        sync(dev)
                        t0 = time.perf_counter()
                        for _ in range(steps if rep >= warmups else 2):
                            train_step(runner, x, x, autocast)
                        sync(dev)
                        elapsed = time.perf_counter() - t0
                        p, d = prefill_and_decode(case.model, prompt, decode, dev, autocast, case.decode_step) \
                            if case.decodes else (None, None)
                    except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
                        if not case.compiled:
                            raise
                        _leave_out_failed_compile(case, cases, left_out, e)
                        bar.update(1)
                        continue
                    if rep >= warmups:
                        case.step_times.append(elapsed / steps)
                        case.prefill_times.append(p)
                        case.decode_times.append(d)
                    elif rep == 0:
                        case.warmup_s = {"train_2_steps": elapsed, "decode": d}
                    else:  # the second warm-up round: 2 steps and a decode again (what compiled again, if anything)
                        case.warmup_s.update(train_2_steps_again=elapsed, decode_again=d)
                    bar.update(1)
        bar.close()
        # (read before the memory probes: their child processes would count as other work)
        other_busy = _other_busy_cores(measured_from, _load_snapshot()) if dev.type == "cpu" else None
        cases = [case for case in cases if case.label not in left_out]
        if not cases:
            raise UserError(f"no variant to report: standard{COMPILED}'s {left_out['standard' + COMPILED]}")

        rows = []
        for case in cases:
            step = statistics.median(case.step_times)
            rows.append({
                "variant": case.label,
                "parameters": case.model.num_params(),
                "dropout": case.cfg.dropout,  # (a row's own: --attn boosted:dropout=0.5)
                "step_s": step,
                "step_s_all": case.step_times,
                "tokens_per_s": batch * seq_len / step,
                # (measured eagerly, in a fresh process on CPU: a compiled row has none, its eager row the figure)
                "peak_memory_bytes": None if case.compiled else peak_memory_train_step(
                    case.cfg, batch, seq_len, dev, amp, case.recomputed, training=training),
                "forward_flops_per_token": flops_per_token(case.cfg, seq_len=seq_len),
                # (a recomputing row's: its backward pass runs each block's forward again; the ratio left it out)
                "train_flops_per_token": flops_per_token(case.cfg, seq_len=seq_len, backward=True,
                                                         recomputed=case.recomputed),
                **({"prefill_s": None, "prefill_s_all": [], "decode_s_all": [], "decode_tokens_per_s": None}
                   if not case.decodes else {  # (a recomputing row beside its kept row decodes as that row)
                    "prefill_s": statistics.median(case.prefill_times),
                    "prefill_s_all": case.prefill_times,
                    # each repeat's decode_tokens steps: the spread behind decode_ratio
                    "decode_s_all": case.decode_times,
                    "decode_tokens_per_s": decode / statistics.median(case.decode_times)}),
                "compiled": case.compiled,
                "activation_checkpointing": case.recomputed,
                "warmup_s": case.warmup_s,
            })
        add_ratios_to_standard(rows)
        eager = {r["variant"]: r for r in rows if not r["compiled"]}
        for r in rows:
            if r["compiled"]:
                # each warm-up round's time over what its steps and decode take measured
                r["compile_s"] = {
                    "train": sum(max(0.0, r["warmup_s"][key] - 2 * r["step_s"])
                                 for key in ("train_2_steps", "train_2_steps_again") if key in r["warmup_s"]),
                    "decode": sum(max(0.0, r["warmup_s"][key] - decode / r["decode_tokens_per_s"])
                                  for key in ("decode", "decode_again") if r["warmup_s"].get(key) is not None)}
                own = eager.get(r["variant"].removesuffix(COMPILED))
                if own is not None:  # against the same variant, eager, in the same repeats
                    paired = [t0 / t for t, t0 in zip(r["step_s_all"], own["step_s_all"])]
                    r["compiled_step_speedup"] = statistics.median(paired)
                    r["compiled_decode_speedup"] = r["decode_tokens_per_s"] / own["decode_tokens_per_s"]
        kept = {r["variant"]: r for r in rows if not r["activation_checkpointing"]}
        for r in rows:
            own = kept.get(r["variant"].removesuffix(RECOMPUTED)) if r["activation_checkpointing"] else None
            if own is not None:  # against the same variant keeping its activations, in the same repeats
                step_pairs = zip(r["step_s_all"], own["step_s_all"])
                r["recomputed_step_ratio"] = statistics.median(t / t0 for t, t0 in step_pairs)
                r["recomputed_memory_ratio"] = memory_ratio(r, own)
        for case in cases:
            case.model = case.step_model = case.optimizer = case.decode_step = None

        sweep_rows = _sweep(preset, sweep or [], sweep_variants, dev, amp, quiet, sets, training)
        report = {
            "preset": preset,
            "sets": sets,
            "dropout": base_cfg.dropout,
            "device": device_name(dev),
            "batch": batch,
            "seq_len": seq_len,
            "repeats": repeats,
            "steps_per_repeat": steps,
            "prefill_tokens": prefill,
            "decode_tokens": decode,
            "amp_bf16": amp and dev.type == "cuda",
            "compile": compile,
            "grad_clip": training.grad_clip,  # (a bench.json before it: a step without clipping, :func:`_step_text`)
            "other_busy_cores": other_busy,  # (None on CUDA, where unreadable, and in a bench.json before it)
            "activation_checkpointing": activation_checkpointing,
            **({} if compile == "off" else {"inductor_caches": _inductor_caches()}),
            "versions": software_versions(),  # gbattn's, torch's and Python's: what produced the figures
            "threads": torch.get_num_threads(),
            "command": command_line(portable=True),
            "variants": rows,
            "left_out": [{"variant": label, "reason": reason} for label, reason in left_out.items()],
            "sweep": sweep_rows,
        }
        if out:
            write_report(Path(out) / "bench.json", report, bench_markdown(report))
        return report
    finally:
        if lock is not None:
            lock.release()


def _leave_out_failed_compile(case: Case, cases: list[Case], left_out: dict[str, str], error: Exception) -> None:
    """Record that torch.compile failed on ``case`` (one line on stderr, the reason in the report); the other
    variants are still timed. Without compiled standard, no compiled row has its baseline: all are left out."""
    reason = terminal_line(compile_failure(error))
    note(f"gbattn: warning: {case.label} left out of the report, {reason[:300]}")
    left_out[case.label] = _portable_text(reason)[:300]  # (bench.json and bench.md hold no path of this machine)
    if case.label == "standard" + COMPILED:
        for other in cases:
            if other.compiled and other.label not in left_out:
                left_out[other.label] = f"no baseline: standard{COMPILED} failed to compile"
    case.model = case.step_model = case.optimizer = case.decode_step = None  # its memory back for the others


def _portable_text(text: str) -> str:
    """``text`` with each absolute path in it as :func:`gbattn.files.portable_path` writes it, its last component
    (an existing file's with its folder), for a results file: a compiler's path in torch.compile's error,
    ``(None, '/opt/bin/g++')``, becomes ``(None, 'g++')``; a URL's path (``https://host/path``) stays."""
    return re.sub(r"(?<![\w.~/:-])/[^\s'\"(),;]+", lambda path: portable_path(path.group()), text)


def add_ratios_to_standard(rows: list[dict]) -> None:
    """Each row's ratios to standard run the same way: an eager row's to eager standard, a compiled
    row's to compiled standard (so a compiled variant's ratios are not its compile speedup too), and one with
    activation checkpointing to standard with it."""
    def way(row: dict) -> tuple:
        return row["compiled"], row["activation_checkpointing"]

    for r in rows:
        base = next(b for b in rows if way(b) == way(r))  # standard comes first in each
        # Paired: each repeat's time over standard's in the same repeat (they ran back to back), so
        # a machine that slows down for a while moves both; the median and range of those ratios.
        paired = sorted(t / t0 for t, t0 in zip(r["step_s_all"], base["step_s_all"]))
        r["step_ratio"] = statistics.median(paired)
        r["step_ratio_range"] = [paired[0], paired[-1]]
        r["flop_ratio"] = r["train_flops_per_token"] / base["train_flops_per_token"]
        r["step_over_flop_ratio"] = r["step_ratio"] / r["flop_ratio"]
        r["memory_ratio"] = memory_ratio(r, base)
        r["decode_ratio"] = base["decode_tokens_per_s"] / r["decode_tokens_per_s"] if r["decode_tokens_per_s"] else None


def memory_ratio(row: dict, base: dict) -> float | None:
    """``row``'s peak memory over ``base``'s; None where either has no figure (a compiled row's, or a CPU probe that
    measured no growth)."""
    memory, base_memory = row["peak_memory_bytes"], base["peak_memory_bytes"]
    return memory / base_memory if memory and base_memory else None


def _prefill_and_decode_lengths(block_source: str, block_size: int, prefill: int | None,
                                decode: int | None) -> tuple[int, int]:
    """(prefill, decode) tokens that fit the block size together, or a one-line error; ``block_source`` says
    where the block size came from (``of preset cpu-char``, ``from --set block_size=32``)."""
    if block_size < 2:  # (the hints below would name --decode 0, which bench refuses)
        raise UserError(f"the block size {block_size} {block_source} holds no prompt and decode step together: "
                        f"bench needs a block size of 2 or more")
    decode = decode or max(1, min(64, block_size // 2))
    if decode >= block_size:
        raise UserError(f"--decode {decode} leaves no room for a prompt within the block size {block_size} "
                        f"{block_source}; use at most --decode {block_size - 1}")
    prefill = prefill or min(128, block_size - decode)
    if prefill + decode > block_size:
        raise UserError(f"a prefill of {prefill} tokens and {decode} decode steps exceed the block size {block_size} "
                        f"{block_source}")
    return prefill, decode


SHARED_KEYS = ("block_size", "vocab_size")  # the shape of every row's batch: --set, not one row's


def _variant_config(preset: str, spec: str, sets: dict) -> ModelConfig:
    """A spec's model: its options set the variant's attention options, except model fields
    (``boosted:residual=attnres-block``), which set that row's model, so that two blocks are timed in one run."""
    try:
        name, attn_options, model = variant_spec(spec)
    except ConfigError as e:
        raise UserError(f"--attn {e}") from None
    if shared := [k for k in SHARED_KEYS if k in model]:
        raise UserError(f"--attn {spec}: {' and '.join(shared)} shape every row's batch, so they are set for all "
                        f"rows with --set {shared[0]}=...")
    return preset_config(preset, name, {**sets, **model, **{f"attn.{k}": v for k, v in attn_options.items()}})


def _sweep_config(preset: str, spec: str, sets: dict, seq_len: int) -> ModelConfig:
    """The model a sweep times at ``seq_len`` tokens (its block size), or a one-line error for a length too long,
    blaming --sweep (not a ``block_size`` the user never set)."""
    try:
        return _variant_config(preset, spec, sets).replace(block_size=seq_len)
    except ConfigError as e:  # (the block size's bound, the one field set here: "must be an integer in [1, N]")
        raise UserError(f"--sweep {seq_len}: a sweep length is the model's block size, which "
                        f"{str(e).removeprefix(f'block_size={seq_len} ')}") from None


def _label(spec: str) -> str:
    """A variant's label in the table: ``spec`` as given, its bare name when it lists no options (``standard:``)."""
    name, options = parse_variant(spec)
    return spec if options else name


def _refuse_repeats(option: str, specs: list[str], preset: str, sets: dict) -> None:
    """Each of ``specs`` (checked) must make a model of its own: a variant named twice, or given the same options
    twice (``boosted:rounds=2,`` after ``boosted:rounds=2``, or its default spelt out), would be benched twice under
    two rows."""
    configs = [_variant_config(preset, spec, sets).resolved() for spec in specs]  # every spec checked first
    seen: list[tuple[dict, str]] = []  # (model config, the spec that first made it)
    for spec, config in zip(specs, configs):
        first = next((earlier for model, earlier in seen if model == config), None)
        if first == spec:
            raise UserError(f"{option} names {spec} more than once: each variant is benched once")
        if first is not None:
            raise UserError(f"{option} names {first} twice ({spec} is the same model): each variant is benched once")
        seen.append((config, spec))


def _sweep(preset, lengths, variants, dev, amp, quiet, sets, training) -> list[dict]:
    """Forward + backward time and peak memory against sequence length (batch 1)."""
    rows = []
    if not lengths:
        return rows
    autocast = bf16_autocast(dev, "auto" if amp else "off")
    bar = Progress(len(lengths) * len(variants), desc="sequence-length sweep", unit="case", disable=quiet, interval=15)
    for T in lengths:
        for spec in variants:
            cfg = _sweep_config(preset, spec, sets, T)
            torch.manual_seed(0)
            model = GPT(cfg).to(dev)
            case = Case(spec, cfg, model, bench_optimizer(model, dev, training), grad_clip=training.grad_clip)
            x = torch.randint(0, cfg.vocab_size, (1, T), device=dev)
            train_step(case, x, x, autocast)  # warm-up
            times = []
            for _ in range(3):
                sync(dev)
                t0 = time.perf_counter()
                train_step(case, x, x, autocast)
                sync(dev)
                times.append(time.perf_counter() - t0)
            del case, model
            rows.append({"seq_len": T, "variant": spec, "step_s": statistics.median(times),
                         "peak_memory_bytes": peak_memory_train_step(cfg, 1, T, dev, amp, recomputed=False,
                                                                     training=training),
                         "attention_matrix_bytes_per_head": 4 * T * T,
                         "activation_checkpointing": False})  # (whatever --activation-checkpointing says)
            bar.update(1)
    bar.close()
    return rows


BUSY_CORES = 0.5  # from this many of its cores kept busy by other work, bench.md says the machine was busy


def _load_snapshot() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the cores this process may use, this process's CPU seconds, wall seconds), or None where
    /proc/stat cannot be read."""
    busy = cpu_busy_seconds(usable_cpus())
    return None if busy is None else (busy, process_time(), time.perf_counter())


def _other_busy_cores(start, end) -> float | None:
    """Cores kept busy by other work between two :func:`_load_snapshot` (the cores' busy time less this process's,
    over the wall time), or None over less than a second (/proc/stat counts 10 ms ticks) or where unreadable."""
    if start is None or end is None or end[2] - start[2] < 1.0:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2]))


def _step_text(report: dict) -> str:
    """What a timed training step does: `gbattn train`'s, or, in a bench.json of an earlier gbattn (no
    ``grad_clip``), a step without its clipping and host sync, with AdamW's per-parameter loop on a CPU."""
    if report.get("grad_clip") is None:
        return ("Step: forward, backward and AdamW over all parameters, as `gbattn bench` timed it before its step "
                "became `gbattn train`'s: without the gradient clipping and the host sync of every training step, and "
                "on a CPU with AdamW's per-parameter loop where `gbattn train` runs its foreach kernels.")
    clipped = (f"the gradients clipped at norm {report['grad_clip']:g}" if report["grad_clip"] > 0
               else "the gradient norm taken (grad_clip 0: no clipping)")
    return (f"Step: `gbattn train`'s at grad_accum 1: forward, backward, {clipped} with the loss and the norm read in "
            f"one host sync, then AdamW with {report['preset']}'s parameter groups (fused on CUDA, foreach kernels "
            f"on a CPU).")


def _own_dropout_text(report: dict) -> str:
    """" (boosted:dropout=0.5: 0.5)": the rows whose dropout is not the header's (it named standard's alone)."""
    own = [f"{r['variant']}: {r['dropout']:g}" for r in report["variants"]
           if r.get("dropout", report["dropout"]) != report["dropout"]]
    return f" ({', '.join(own)})" if own else ""


def bench_markdown(report: dict) -> str:
    mib = 1 << 20
    lines = [
        f"# gbattn bench: {report['preset']} on {report['device']}",
        "",
        f"Command: `{report['command']}` · {_versions_text(report)} · "
        f"batch {report['batch']} x {report['seq_len']} tokens · "
        f"median of {report['repeats']} interleaved repeat{'s' if report['repeats'] != 1 else ''} of "
        f"{report['steps_per_repeat']} "
        f"step{'s' if report['steps_per_repeat'] != 1 else ''} · "
        f"dropout {report['dropout']:g}{_own_dropout_text(report)}"
        f"{' · bf16 autocast' if report['amp_bf16'] else ''}"
        f"{'' if report['compile'] == 'off' else ' · torch.compile: ' + report['compile']}"
        f"{_checkpointing_text(report)}",
        "",
        "| variant | parameters | step (ms) | tokens/s | peak memory (MiB) | fwd MFLOP/token | step ratio (range) | "
        "FLOP ratio | step / FLOP ratio | memory ratio | prefill (ms) | decode tokens/s | decode cost ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["variants"]:
        mem_ratio = f"{r['memory_ratio']:.2f}" if r["memory_ratio"] else "—"
        memory = _mib(r["peak_memory_bytes"])
        lo, hi = r["step_ratio_range"]
        spread = f" ({lo:.2f}–{hi:.2f})" if report["repeats"] > 1 else ""  # one repeat: no range to show
        lines.append(
            f"| {r['variant']} | {r['parameters']:,} | {1000 * r['step_s']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{memory} | {in_millions(r['forward_flops_per_token'])} | "
            f"{r['step_ratio']:.3f}{spread} | "
            f"{r['flop_ratio']:.3f} | {r['step_over_flop_ratio']:.3f} | {mem_ratio} | {_decoding(r)} |"
        )
    spread_note = ("(range: lowest and highest of those ratios). " if report["repeats"] > 1 else
                   "(one repeat: no range, so no sign of the noise; use --repeats 3 or more). ")
    compile_note = ""
    if report["compile"] != "off":
        compile_note = (" A compiled row's ratios are to standard compiled; its prefill runs eagerly (only the "
                        "training and decode steps are compiled). Peak memory is measured on the eager training step "
                        "only, so a compiled row has none (—)")
        if report["compile"] == "on":
            compile_note += (" and --compile on, with no eager rows, has no memory figures; --compile both or off "
                             "measures them")
        compile_note += "."
    lines += ["", "Step ratio: median over repeats of the variant's step time over standard's in the same repeat "
              + spread_note +
              "FLOP ratio: training (forward + backward) FLOPs per token from torch.utils.flop_counter. "
              "Step / FLOP ratio 1.00 = the variant costs exactly its extra arithmetic. Decode cost ratio: "
              "time per decoded token relative to standard (prefill of "
              f"{report['prefill_tokens']} tokens, then {report['decode_tokens']} cached steps, batch 1)."
              + _decode_checkpointing_note(report) + compile_note]
    lines += ["", _step_text(report)]
    if (report.get("other_busy_cores") or 0.0) >= BUSY_CORES:
        lines += ["", f"While timing, other work kept about {report['other_busy_cores']:.1f} of the cores this process "
                      f"may use busy: its steps are slower, and their ratios noisier, than on an idle machine."]
    if report.get("left_out"):
        lines += ["", "Left out: " + "; ".join(f"{r['variant']} ({r['reason']})" for r in report["left_out"]) + "."]
    compiled = [r for r in report["variants"] if r.get("compiled_step_speedup")]
    if compiled:
        eager = {r["variant"]: r for r in report["variants"] if not r["compiled"]}
        rows = [(eager[r["variant"].removesuffix(COMPILED)], r) for r in compiled]
        lines += _paired_section(
            "Compiled vs eager (torch.compile; CUDA graphs for decoding on CUDA)",
            ["step eager (ms)", "step compiled (ms)", "step speedup", "decode eager (tokens/s)",
             "decode compiled (tokens/s)", "decode speedup", "compile time: train / decode (s)"],
            [(e["variant"], [f"{1000 * e['step_s']:.1f}", f"{1000 * r['step_s']:.1f}",
                             f"{r['compiled_step_speedup']:.2f}", f"{e['decode_tokens_per_s']:,.0f}",
                             f"{r['decode_tokens_per_s']:,.0f}", f"{r['compiled_decode_speedup']:.2f}",
                             _compile_times(r)]) for e, r in rows],
            "Speedups: the variant's eager time over its compiled time in the same repeats (step: median of the "
            f"paired ratios). Compile time: {_warm_up_words(report)} extra time over the measured steps."
            + _compile_cache_note(report))
    if report["compile"] == "on":  # no eager rows to compare with, but the compile time is still the user's cost
        lines += ["", f"Compile time ({_warm_up_words(report)} extra time over the measured steps), train / decode: "
                  + ", ".join(f"{r['variant']} {_compile_times(r)} s"
                              for r in report["variants"]) + "." + _compile_cache_note(report)]
    recomputed = [r for r in report["variants"] if r.get("recomputed_step_ratio")]
    if recomputed:
        kept = {r["variant"]: r for r in report["variants"] if not r.get("activation_checkpointing")}
        rows = [(kept[r["variant"].removesuffix(RECOMPUTED)], r) for r in recomputed]
        lines += _paired_section(
            "Activation checkpointing vs kept activations (training step)",
            ["step kept (ms)", "step recomputed (ms)", "step ratio", "peak memory kept (MiB)",
             "peak memory recomputed (MiB)", "memory ratio"],
            [(k["variant"], [f"{1000 * k['step_s']:.1f}", f"{1000 * r['step_s']:.1f}",
                             f"{r['recomputed_step_ratio']:.2f}", _mib(k["peak_memory_bytes"]),
                             _mib(r["peak_memory_bytes"]),
                             f"{r['recomputed_memory_ratio']:.2f}" if r.get("recomputed_memory_ratio") else "—"])
             for k, r in rows],
            "Step ratio: median over repeats of the recomputing step's time over the same variant's keeping its "
            "activations, in the same repeat; memory ratio: its peak memory over that row's.")
    if report["sweep"]:
        eager = "" if report["compile"] == "off" else ", eager"  # the sweep is never compiled
        kept = "" if report.get("activation_checkpointing", "off") == "off" else ", activations kept"  # nor recomputes
        lines += ["", f"## Sequence-length sweep (batch 1, one training step{eager}{kept})", "",
                  "| T | variant | step (ms) | peak memory (MiB) | one T x T fp32 matrix (MiB) |",
                  "| ---: | --- | ---: | ---: | ---: |"]
        for r in report["sweep"]:
            matrix = _small_figure(r["attention_matrix_bytes_per_head"] / mib)
            lines.append(f"| {r['seq_len']:,} | {r['variant']} | {1000 * r['step_s']:.1f} | "
                         f"{_small_figure(r['peak_memory_bytes'] / mib)} | {matrix} |")
    return "\n".join(lines) + "\n"


def _paired_section(title: str, columns: list[str], rows: list[tuple[str, list[str]]], note: str) -> list[str]:
    """A section comparing each variant run one way with the same variant run the other way: a heading, a table of
    ``rows`` (the variant, then its cells under ``columns``), then ``note``."""
    return ["", f"## {title}", "", "| variant | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns),
            *(f"| {variant} | " + " | ".join(cells) + " |" for variant, cells in rows), "", note]


def _inductor_caches() -> str:
    """Whether torch.compile could load earlier compilations (``enabled``) or compiled from scratch (``disabled``,
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1): the compile times mean a first compile only in the second case."""
    import torch._inductor.config

    return "disabled" if torch._inductor.config.force_disable_caches else "enabled"


def _warm_up_words(report: dict) -> str:
    """Whose time the compile time is: the two warm-up rounds' of compiled rows, or the one round's of a bench.json
    written before compiled rows warmed up twice."""
    twice = any("train_2_steps_again" in (r.get("warmup_s") or {}) for r in report["variants"])
    return "the two warm-up rounds'" if twice else "the warm-up round's"


def _compile_cache_note(report: dict) -> str:
    """What the compile times measured, from the report's ``inductor_caches`` (none in a report written before)."""
    caches = report.get("inductor_caches")
    if caches == "disabled":
        return " Inductor's caches were disabled (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1): each a first compile."
    if caches == "enabled":
        return (" Inductor's caches were enabled: a compilation an earlier run cached is loaded, not redone, so a "
                "compile time can be far below a first compile's (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 measures that).")
    return ""


def _checkpointing_text(report: dict) -> str:
    """The heading's note on activation checkpointing (none in a report written before bench had it)."""
    mode = report.get("activation_checkpointing", "off")
    return "" if mode == "off" else f" · activation checkpointing: {mode}"


def _decode_checkpointing_note(report: dict) -> str:
    """What activation checkpointing does to the FLOP ratio (a recomputing row's FLOPs count its blocks' forward run
    again in the backward pass) and to the decoding columns: nothing (decoding trains nothing)."""
    mode = report.get("activation_checkpointing", "off")
    flops = (" A recomputing row's training FLOPs count its blocks' forward pass run again in the backward pass, and"
             " its ratios are to standard recomputing.")
    if mode == "on":
        return flops + " Decoding trains nothing, so a recomputing row decodes as it would keeping its activations."
    if mode == "both":
        return flops + " A recomputing row decodes as its kept row (decoding trains nothing): its decoding cells are —."
    return ""


def _versions_text(report: dict) -> str:
    """``gbattn V · torch V · Python V`` (a report written before bench recorded its versions: torch's alone)."""
    versions = report.get("versions")
    if not versions:
        return f"torch {report['torch']}"
    return f"gbattn {versions['gbattn']} · torch {versions['torch']} · Python {versions['python']}"


def _compile_times(row: dict) -> str:
    """A compiled row's compile times, "train / decode" in seconds."""
    return f"{_small_figure(row['compile_s']['train'])} / {_small_figure(row['compile_s']['decode'])}"


def _decoding(row: dict) -> str:
    """A row's prefill (ms), decode tokens/s and decode cost ratio cells; — for a recomputing row beside its kept
    row, which decodes as that row (activation checkpointing changes training only)."""
    if row["decode_tokens_per_s"] is None:
        return "— | — | —"
    return f"{1000 * row['prefill_s']:.1f} | {row['decode_tokens_per_s']:,.0f} | {row['decode_ratio']:.2f}"


def _mib(value_bytes: float | None) -> str:
    """A peak memory in MiB (:func:`_small_figure`), or — where a row has none (a compiled row's)."""
    return _small_figure(value_bytes / (1 << 20)) if value_bytes else "—"


def _small_figure(value: float) -> str:
    """A figure without rounding a small one to 0 (at T = 128 one T x T fp32 matrix is 0.0625 MiB; a tiny model's
    peak memory can be under 0.5 MiB, a compile from a warm cache 0.3 s): whole from 10 up, two significant
    digits below."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


if __name__ == "__main__":  # the CPU memory probe runs in a fresh process
    _memory_probe_main(sys.argv[1])
