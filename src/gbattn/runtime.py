"""Process-level helpers: devices, autocast, random-number state, CPU threads and the command line
being run. It imports only gbattn's errors, checks and file helpers."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import sys
import time

import torch

from gbattn.arguments import MAX_THREADS
from gbattn.checks import did_you_mean
from gbattn.errors import UserError
from gbattn.files import portable_path
from gbattn.terminal import note


def launched_processes() -> int:
    """How many processes ``torchrun`` launched for this command (1 without it, or with an empty
    ``WORLD_SIZE``, which a job script may export)."""
    value = os.environ.get("WORLD_SIZE", "").strip() or "1"
    if not (value.isdigit() and int(value) > 0):  # every command reads it: a traceback, for `gbattn list` too
        raise UserError(f"WORLD_SIZE={value!r} in the environment is not a number of processes (torchrun sets it): "
                        f"unset it to run in one process")
    return int(value)


def resolve_device(name: str | torch.device = "auto", local_rank: int | None = None, mps: bool = False) -> torch.device:
    """The device ``name`` means, or a one-line UserError naming the ones allowed: ``auto`` -> CUDA when available,
    else CPU; ``cpu``; ``cuda`` -> the GPU of ``local_rank`` (torchrun's), else torch's current one; ``cuda:N``; and
    ``mps`` (a Mac's GPU) where ``mps`` allows it (``load_run``). The one parser of every command's --device and of
    ``load_run``'s device."""
    text = str(name) if isinstance(name, torch.device) else name
    try:
        device = torch.device(text if text != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    except (RuntimeError, TypeError):  # not a device name
        device = None
    if not isinstance(text, str) or device is None or device.type not in ("cpu", "cuda", *(("mps",) if mps else ())):
        names = ["auto", "cpu", "cuda", *(["mps"] if mps else [])]
        kind = text.partition(":")[0] if isinstance(text, str) else text  # cdua:1 is a typo of cuda; cuda:x is not
        hint = did_you_mean(kind, names) if kind not in names else ""
        raise UserError(f"device={text!r} is not allowed{hint}; choose auto, cpu, cuda, cuda:N"
                        f"{' or mps' if mps else ''}")
    if device.type == "cpu":
        return torch.device("cpu")  # cpu:0 too (torch.load cannot map to cpu:0)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={text!r} but MPS (Apple GPUs) is not available here; use cpu")
    if device.type == "cuda" and not torch.cuda.is_available():  # torch.load's error would read as a damaged file
        raise UserError(f"device={text!r} but CUDA is not available here; use cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if local_rank is None else local_rank)
    check_cuda_index(device)
    return device


def check_cuda_index(device: torch.device) -> None:
    """A CUDA device this machine has (else torch.load's error on a sound file reads as a damaged one)."""
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and device.index is not None and device.index >= count:
        held = f"{count} CUDA device{'s' if count != 1 else ''} ({', '.join(f'cuda:{i}' for i in range(count))})"
        raise UserError(f"device='{device}' but this machine has {held}; choose one of them")


def autocast_dtype(device: torch.device, amp: str = "auto") -> torch.dtype | None:
    """The dtype ``amp`` autocasts to on ``device``: bfloat16 on CUDA under ``auto`` or ``bf16``, else None."""
    return torch.bfloat16 if amp == "bf16" or (amp == "auto" and device.type == "cuda") else None


def precision_name(device: torch.device, amp: str = "auto") -> str:
    """What ``amp`` computes in on ``device``, as results files name it: ``bfloat16`` (autocast) or ``float32``."""
    return "bfloat16" if autocast_dtype(device, amp) is not None else "float32"


def autocast(device: torch.device, amp: str = "auto"):
    """A context-manager factory: bf16 autocast on CUDA under ``auto`` or ``bf16``, else nothing."""
    dtype = autocast_dtype(device, amp)
    if dtype is not None:
        return lambda: torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext


def use_tf32(device: torch.device) -> None:
    """On CUDA, float32 matmuls and convolutions as TF32: the precision training, ``gbattn eval`` and
    ``gbattn bench`` share (docs/deviations.md, entry 10), so eval gives a run's own numbers again."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def device_name(device: torch.device, threads: int | None = None) -> str:
    """The hardware a run or a benchmark ran on, for results files: the GPU's name, or the CPU's
    with the thread count in use (or ``threads``) and the instruction set torch's kernels use (runs on two CPUs
    bit-match only with the same kernels: docs/deviations.md, entry 21)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads() if threads is None else threads
    parts = [f"{threads} thread{'s' if threads != 1 else ''}", platform.processor() or platform.machine()]
    parts += [name for name in (cpu_model(), cpu_kernels()) if name]
    return f"cpu ({', '.join(parts)})"


def cpu_kernels() -> str | None:
    """The instruction set torch dispatches its CPU kernels to (``AVX512``, ``AVX2``, ``DEFAULT``), which
    ``ATEN_CPU_CAPABILITY`` may lower; None where torch does not say."""
    try:
        return torch.backends.cpu.get_cpu_capability() or None
    except (AttributeError, RuntimeError):
        return None


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's model name as Linux reports it (``AMD EPYC 7B13``), or None where it does not: the
    architecture alone (``x86_64``) does not tell two machines' benchmarks apart."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = " ".join("".join(c for c in value if c.isprintable()).split())[:100]
                    return name or None
    except OSError:
        pass
    return None


def software_versions() -> dict:
    """The versions that produced a results file or a run: gbattn's, torch's and Python's."""
    from gbattn import __version__

    return {"gbattn": __version__, "torch": torch.__version__, "python": platform.python_version()}


def rng_state(device: torch.device) -> torch.Tensor:
    """The generator state that dropout on ``device`` draws from."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def all_rng_states(device: torch.device) -> dict:
    """Every generator a training step draws from (checkpointed for exact resume)."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict, device: torch.device) -> None:
    """Put back :func:`all_rng_states`' states, from the CPU wherever they were read to: torch refuses a state that
    is not a CPU ByteTensor (a checkpoint read onto the GPU made every resume on CUDA fail)."""
    torch.set_rng_state(states["torch"].cpu())
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


# --------------------------------------------------------------------------------------
# CPU threads (README, "Threads")
# --------------------------------------------------------------------------------------


def free_cores() -> int:
    """Cores not busy with other work: the cores this process may use minus :func:`busy_cores`
    (at least 1). Oversubscribing a busy CPU slowed PyTorch 3.4-4.0x here (README, "Threads"),
    so gbattn defaults to this rather than to every core."""
    cpus = usable_cpus()
    cores = core_count(cpus)
    return max(1, min(cores, round(cores - busy_cores(cpus))))


def core_count(cpus: set[int] | None) -> int:
    """How many ``cpus`` there are (None: every core of the machine)."""
    return len(cpus) if cpus else os.cpu_count() or 1


def usable_cpus() -> set[int] | None:
    """The CPUs this process may run on (its affinity: a cgroup or a scheduler such as Slurm may
    grant fewer than the machine has); None where that cannot be read (not Linux)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return None


def busy_cores(cpus: set[int] | None = None, interval: float = 0.2) -> float:
    """How many of ``cpus`` (None: all the machine's) are busy now: their CPU use over ``interval``
    seconds (``/proc/stat``) times their count, so that work on other cores of a shared machine does
    not count. Where that cannot be read, the 1-minute load average, which lags (it still counts work
    that ended up to a few minutes ago) and is the whole machine's."""
    first = _cpu_times(cpus)
    if first is not None:
        time.sleep(interval)
        second = _cpu_times(cpus)
        if second is not None and second[1] > first[1]:
            return (second[0] - first[0]) / (second[1] - first[1]) * core_count(cpus)
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def cpu_busy_seconds(cpus: set[int] | None = None) -> float | None:
    """Busy CPU time since boot of ``cpus`` (None: every core), in seconds, all processes together (``/proc/stat``,
    counted in clock ticks of usually 10 ms); None where it cannot be read."""
    times = _cpu_times(cpus)
    return None if times is None else times[0] / os.sysconf("SC_CLK_TCK")


def _cpu_times(cpus: set[int] | None = None) -> tuple[float, float] | None:
    """(busy, total) CPU time since boot, from ``/proc/stat`` (Linux): of the whole machine (its
    ``cpu`` line), or summed over the ``cpuN`` lines of ``cpus``; None if unreadable."""
    busy = total = 0.0
    found = False
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu"):
                    break  # the cpu lines come first
                if (name == "cpu") if cpus is None else (name[3:].isdigit() and int(name[3:]) in cpus):
                    ticks = [float(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                    if len(ticks) < 5:
                        return None
                    busy, total, found = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks), True
    except (OSError, ValueError):
        return None
    return (busy, total) if found else None


def omp_threads() -> int | None:
    """The CPU threads ``OMP_NUM_THREADS`` asks for, or None where it is unset or no count (``0``, ``4,2``: ignored,
    as :func:`default_threads` ignores it)."""
    asked = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not (asked.isdigit() and int(asked) > 0):
        return None
    if int(asked) > MAX_THREADS:  # bounded as --threads is (2000 ran at 93 tokens/s, silently)
        raise UserError(f"OMP_NUM_THREADS={asked} is more than {MAX_THREADS:,} threads (OpenMP starts every "
                        f"thread at once, and beyond what the OS allows it crashed): set it lower, or give "
                        f"--threads N (README, \"Threads\")")
    return int(asked)


def default_threads() -> int:
    """CPU threads when none are asked for: ``OMP_NUM_THREADS`` where it is set (``torchrun`` sets it
    to 1 for each of several processes per machine), else :func:`free_cores` shared among this
    machine's processes of one ``torchrun`` (``LOCAL_WORLD_SIZE``)."""
    asked = omp_threads()
    if asked is not None:
        return asked
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return max(1, free_cores() // (int(local) if local.isdigit() and int(local) > 0 else 1))


def is_first_process() -> bool:
    """Whether this is the process that reports (rank 0 under ``torchrun``; the only one without it, whatever a
    leftover ``RANK`` says: it dropped the run's summary line), known before the process group is joined."""
    return launched_processes() == 1 or os.environ.get("RANK", "0") == "0"


def set_threads(threads: int | None) -> int:
    """Use ``threads`` CPU threads (None: :func:`default_threads`); returns the number set. More than the cores
    this process may use is done, with a warning: the threads beyond them take turns on the cores."""
    n = threads or default_threads()
    cores = core_count(usable_cpus())
    if n > cores and is_first_process():  # (under torchrun: said once, not by every process)
        given = f"threads={threads}" if threads else f"OMP_NUM_THREADS={n}"  # (the free cores: never more)
        note(f"warning: {given} is more than the {cores} core{'s' * (cores != 1)} this process may use: "
             f"the threads beyond them take turns on the cores, which slows every step (README, \"Threads\")")
    torch.set_num_threads(n)
    return n


# --------------------------------------------------------------------------------------
# The command being run (recorded in results files)
# --------------------------------------------------------------------------------------

_INVOCATION: list[str] = []


def compile_failure(error: BaseException) -> str | None:
    """``torch.compile failed: TYPE: first line`` for an error torch.compile raised (inductor without a working C++
    compiler on a CPU, a recompile limit), naming the backend's own error; None for any other error."""
    dynamo = sys.modules.get("torch._dynamo.exc")  # (not imported: nothing was compiled)
    if dynamo is None or not isinstance(error, (dynamo.TorchDynamoException, dynamo.FailOnRecompileLimitHit)):
        return None
    inner = getattr(error, "inner_exception", None) or error  # a backend's own error, not dynamo's wrapper
    message = next((line.strip() for line in str(inner).splitlines() if line.strip()), "")
    return f"torch.compile failed: {type(inner).__name__}: {message}"


def set_invocation(argv: list[str]) -> None:
    """Called by the CLI so that :func:`command_line` reports its arguments (also under pytest)."""
    _INVOCATION[:] = list(argv)


def portable_argument(arg: str) -> str:
    """One argument with its path made portable, also a path after the last ``=`` before the path's first
    ``/``: ``--out=PATH``, ``--tokenizer hf=PATH``, ``--set tokenizer=gpt2=PATH``; a path holding ``=``
    (``../runs/lr=3e-4``, ``/srv/runs=2/wiki``) is a path."""
    first_slash = arg.find("/") if "/" in arg else len(arg)
    head, eq, value = arg[:first_slash].rpartition("=")
    if eq:
        value += arg[first_slash:]
        return f"{head}={portable_path(value)}"
    made = portable_path(arg)
    # a value cut to a name that starts with a dash (`--out /runs/-cmp`) would be read as an option
    return f"./{made}" if made.startswith("-") and not arg.startswith("-") else made


def command_line(portable: bool = False) -> str:
    """The command that is running, as a user would type it; ``portable``: paths in it as
    :func:`gbattn.files.portable_path` writes them (for results files)."""
    argv = _INVOCATION or sys.argv[1:]
    if portable:
        argv = [portable_argument(a) for a in argv]
    return "gbattn " + " ".join(shlex.quote(a) for a in argv)
