"""The command line: `gbattn list`, `gbattn params`, and one-line errors with status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gbattn.cli import main
from helpers import run_cli


def test_params_paper_counts(capsys):
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "boosted"])
    assert code == 0 and "8,734,208" in out
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "standard"])
    assert code == 0 and "7,419,392" in out


def test_params_fair(capsys):
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "boosted", "--fair", "--json"])
    assert code == 0
    assert "d_model=288" in out and "8,789,184" in out
    record = json.loads(out.strip().splitlines()[-1])
    assert record["fair_width"] == 288 and record["parameters"] == 8_734_208
    assert record["forward_flops_per_token"] > 0


def test_params_set_override(capsys):
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "boosted", "--set", "attn.rounds=1"])
    assert code == 0 and "7,419,392" in out  # M = 1 is standard attention


def test_list_shows_variants_and_presets(capsys):
    code, out, _ = run_cli(capsys, ["list"])
    assert code == 0
    for name in (
        "standard",
        "boosted",
        "twicing",
        "gated",
        "differential",
        "paper-small",
        "cpu-proxy",
        "attn.kv_source",
    ):
        assert name in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["params", "huge"], "preset='huge' is not allowed"),
        (["params", "paper-small", "--attn", "nope"], "attn='nope' is not allowed"),
        (
            ["params", "paper-small", "--attn", "boosted", "--set", "attn.rounds=0"],
            "attn.rounds=0 must be an integer in [1, 1024]",
        ),
        (["params", "paper-small", "--set", "d_model=30"], "d_model=30 is not divisible by n_heads=4"),
        (["params", "paper-small", "--attn", "boosted", "--set", "attn.gate=relu"], "attn.gate='relu' is not allowed"),
        (
            ["params", "paper-small", "--attn", "boosted", "--set", "attn.kv_source=x"],
            "attn.kv_source='x' is not allowed",
        ),
        (["params", "paper-small", "--set", "d_model"], "expected key=value"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_user_errors_one_line_status_2(capsys, argv, message):
    code, _, err = run_cli(capsys, argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_out_of_memory_is_one_line_and_other_errors_are_not_hidden(capsys, monkeypatch):
    """CUDA raises torch.OutOfMemoryError, the CPU allocator a plain RuntimeError (`train --set
    d_model=1000000` on CPU was a traceback): both are one line and status 2; any other RuntimeError
    is a bug and keeps its traceback."""
    import torch

    import gbattn.cli

    errors = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB"),
              RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. {gbattn.cli.CPU_ALLOCATION_FAILED}: you "
                           f"tried to allocate 12000000000000 bytes."),
              MemoryError()]
    for error in errors:
        monkeypatch.setattr(gbattn.cli, "cmd_list", lambda args, error=error: (_ for _ in ()).throw(error))
        code, _, err = run_cli(capsys, ["list"])
        assert code == 2 and len(err.strip().splitlines()) == 1 and "out of memory" in err, err
    monkeypatch.setattr(gbattn.cli, "cmd_list", lambda args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["list"])


@pytest.mark.parametrize("module", ["gbattn.cli", "gbattn"])
def test_console_script_exit_status(module):
    """``python -m gbattn.cli`` (torchrun's form) and ``python -m gbattn`` are the ``gbattn`` command."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "params", "paper-small", "--attn", "bogus"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gbattn: error: attn='bogus' is not allowed; choose one of standard, boosted, twicing, gated, differential"
    )


def test_command_line_records_the_cli_arguments(capsys):
    from gbattn.runtime import command_line

    assert main(["params", "paper-small", "--attn", "twicing"]) == 0
    assert command_line() == "gbattn params paper-small --attn twicing"


def test_portable_command_line_holds_no_path_outside_the_working_directory():
    """Results files record the command with absolute paths and paths that climb out (``../``)
    shortened to their last component; names and paths inside stay as typed."""
    from gbattn.runtime import command_line, set_invocation

    set_invocation(["compare", "--data", "../corpora/wikitext-2", "--out", "runs/x", "--tokenizer", "/tmp/t/",
                    "--recipe", "cpu-char"])
    assert command_line(portable=True) == (
        "gbattn compare --data wikitext-2 --out runs/x --tokenizer t --recipe cpu-char")
    assert "../corpora" in command_line()
    set_invocation([])


def test_help_imports_nothing_heavy():
    """`gbattn --help` and every command's --help: no torch, numpy, transformers or matplotlib."""
    code = ("import sys\nfrom gbattn.cli import main\nfor argv in (['--help'], ['train', '--help'], "
            "['lm-eval', '--help'], ['analyze', '--help']):\n    try:\n        main(argv)\n    except SystemExit:\n"
            "        pass\nheavy = [m for m in ('torch', 'numpy', 'transformers', 'matplotlib') if m in sys.modules]\n"
            "print('HEAVY', heavy, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "HEAVY []" in proc.stderr, proc.stderr[-500:]


@pytest.mark.parametrize("busy_ticks, loadavg, expected", [
    (0, 2.0, 2),     # idle now, although the 1-minute load average still counts a run that just ended
    (50, 0.0, 1),    # one of two cores busy now
    (100, 0.0, 1),   # both busy: still 1
    (None, 2.0, 1),  # /proc/stat unreadable: the load average decides
    (None, 0.3, 2),
])
def test_default_threads_are_the_cores_free_now(monkeypatch, busy_ticks, loadavg, expected):
    """The default CPU threads (README, "Threads"): the cores this process may use minus those busy
    over the last moment, measured from /proc/stat; the load average only where that is unreadable."""
    from gbattn import runtime

    samples = iter([(0.0, 0.0), (float(busy_ticks or 0), 100.0)])
    monkeypatch.setattr(runtime, "_cpu_times", lambda cpus=None: None if busy_ticks is None else next(samples))
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (loadavg, loadavg, loadavg))
    assert runtime.free_cores() == expected


@pytest.mark.parametrize("omp, local_world, free, expected", [
    (None, None, 2, 2),  # nothing set: the free cores
    ("1", "2", 2, 1),    # torchrun's OMP_NUM_THREADS=1 for each of several processes is kept
    ("3", None, 2, 3),   # an explicit OMP_NUM_THREADS is kept
    (None, "2", 2, 1),   # torchrun without it: the free cores shared among this machine's processes
    (None, "4", 2, 1),   # at least 1
    ("0", None, 2, 2),   # not a thread count: ignored
    ("x", None, 2, 2),
])
def test_default_threads_keep_the_launchers_choice(monkeypatch, omp, local_world, free, expected):
    """Without --threads, OMP_NUM_THREADS (set by torchrun, by a job script) decides; under torchrun
    without it, each process takes its share of the free cores, not all of them."""
    from gbattn import runtime

    for name, value in (("OMP_NUM_THREADS", omp), ("LOCAL_WORLD_SIZE", local_world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "free_cores", lambda: free)
    assert runtime.default_threads() == expected


@pytest.mark.parametrize("command, takes_training_fields", [
    ("params", False), ("bench", False), ("train", True), ("compare", True)])
def test_set_example_in_help_is_accepted(capsys, command, takes_training_fields):
    """The `--set` example each command's --help shows builds a config there (`params --set lr=...`
    is refused, so its help must not suggest it)."""
    import re

    from gbattn.config import build_configs, parse_sets, preset_config, split_overrides

    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    example = re.search(r"override [^,]*, e\.g\. (.*?)(?:\s+--[a-z-]+ [A-Z]|\s+--[a-z-]+\s{2}|$)", help_text).group(1)
    sets = parse_sets(re.findall(r"--set (\S+)", example))
    assert sets, help_text
    train_sets, _ = split_overrides(sets)
    if takes_training_fields:
        build_configs("cpu-char", "boosted", "tiny-shakespeare", sets)
    else:
        assert not train_sets, f"{command} --help suggests training fields {sorted(train_sets)}"
        preset_config("cpu-char", "boosted", sets)


def test_autocast_and_explicit_threads(monkeypatch):
    """amp=auto is bf16 on CUDA only (a CPU run stays float32); amp=bf16 asks for it anywhere. An
    explicit thread count is used as given, whatever the default would be."""
    import contextlib

    import torch

    from gbattn import runtime

    assert runtime.autocast(torch.device("cpu"), "auto") is contextlib.nullcontext
    assert runtime.autocast(torch.device("cuda"), "off") is contextlib.nullcontext
    assert runtime.autocast(torch.device("cuda"), "auto") is not contextlib.nullcontext
    with runtime.autocast(torch.device("cpu"), "bf16")():
        assert torch.is_autocast_enabled("cpu")
    with runtime.autocast(torch.device("cpu"), "auto")():
        assert not torch.is_autocast_enabled("cpu")

    before = torch.get_num_threads()
    monkeypatch.setattr(runtime, "default_threads", lambda: 2)
    try:
        assert runtime.set_threads(1) == 1 and torch.get_num_threads() == 1
        assert runtime.set_threads(None) == 2
    finally:
        torch.set_num_threads(before)


def test_count_arguments_at_their_limits_and_empty_option_values(capsys):
    import argparse

    from gbattn import arguments

    count = arguments.at_least(1)
    assert count("1") == 1 and count(str(2**31 - 1)) == 2**31 - 1
    for text in ("0", str(2**31)):
        with pytest.raises(argparse.ArgumentTypeError):
            count(text)
    assert arguments.SEED(str(2**63 - 1)) == 2**63 - 1
    with pytest.raises(argparse.ArgumentTypeError, match="must be <= 9223372036854775807"):
        arguments.SEED(str(2**63))
    parser = arguments.Parser(prog="gbattn test")
    parser.add_argument("--out")
    parser.add_argument("--seeds", nargs="+")
    assert parser.parse_args(["--out", "o", "--seeds", "1", "2"]).seeds == ["1", "2"]
    for argv in (["--out", ""], ["--out", "   "], ["--out=\t"], ["--seeds", "1", ""]):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
        assert f"argument {argv[0].split('=')[0]}: is empty" in capsys.readouterr().err


def test_cpu_busy_time_is_read_from_proc_stat_deltas(monkeypatch):
    """/proc/stat's first line: busy = total - idle - iowait (a core waiting on the disk is free to
    compute), and the busy share is that of the interval between two readings, not since boot."""
    import io

    from gbattn import runtime

    line = "cpu  100 5 50 800 40 3 2 0 0 0\n"  # user nice system idle iowait irq softirq steal ...
    monkeypatch.setattr(runtime, "open", lambda *a, **k: io.StringIO(line), raising=False)
    assert runtime._cpu_times() == (160.0, 1000.0)

    samples = iter([(1000.0, 5000.0), (1050.0, 5100.0)])  # half the interval busy, a long uptime before it
    monkeypatch.setattr(runtime, "_cpu_times", lambda cpus=None: next(samples))
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 4)
    assert runtime.busy_cores() == pytest.approx(2.0)


def test_free_cores_count_only_the_cpus_this_process_may_use(monkeypatch):
    """Pinned to cpus 2 and 3 (a cgroup, Slurm) of a machine whose cpus 0 and 1 are busy: both of
    ours are free. /proc/stat's per-cpu lines are read, not the machine's total."""
    import io

    from gbattn import runtime

    readings = iter([
        "cpu  200 0 0 200 0 0 0 0\ncpu0 100 0 0 0 0 0 0 0\ncpu1 100 0 0 0 0 0 0 0\n"
        "cpu2 0 0 0 100 0 0 0 0\ncpu3 0 0 0 100 0 0 0 0\nintr 0\n",
        "cpu  400 0 0 400 0 0 0 0\ncpu0 200 0 0 0 0 0 0 0\ncpu1 200 0 0 0 0 0 0 0\n"
        "cpu2 0 0 0 200 0 0 0 0\ncpu3 0 0 0 200 0 0 0 0\nintr 0\n",
    ])
    monkeypatch.setattr(runtime, "open", lambda *a, **k: io.StringIO(next(readings)), raising=False)
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {2, 3})
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 4)
    assert runtime.free_cores() == 2  # the whole machine is half busy: 2 of 4, which once left ours 1 thread
    monkeypatch.setattr(runtime, "open", lambda *a, **k: io.StringIO("cpu0 1 0 0 1 0\n"), raising=False)
    assert runtime._cpu_times({0}) == (1.0, 2.0) and runtime._cpu_times({5}) is None


def test_cuda_is_this_processs_gpu_under_torchrun(monkeypatch):
    """``cuda`` (or ``auto`` where CUDA is available) is the GPU of this process's local rank; an
    explicit ``cuda:N`` is kept; without CUDA, ``auto`` is the CPU and ``cuda`` a one-line error."""
    import torch

    from gbattn.errors import UserError
    from gbattn.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("auto", local_rank=2) == torch.device("cuda", 2)
    assert resolve_device("cuda:0", local_rank=3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", local_rank=1) == torch.device("cpu")
    with pytest.raises(UserError, match="CUDA is not available"):
        resolve_device("cuda")


def test_progress_lines_off_a_terminal(capsys):
    """Off a terminal: a line every `interval` seconds and one when the count reaches the total,
    with the count so far and the latest postfix."""
    from gbattn.progress import Progress

    bar = Progress(3, desc="train", unit="step", interval=1e9)
    bar.update(1, loss=2.5)
    bar.update(1)
    assert capsys.readouterr().err == ""  # not yet: the interval has not passed
    bar.update(1)
    assert capsys.readouterr().err == "train: 3/3 steps loss=2.5\n"
    bar.close()
    quiet = Progress(2, desc="q", disable=True)
    quiet.update(2)
    assert quiet.n == 2 and capsys.readouterr().err == ""


def test_progress_lines_keep_their_interval_start_at_initial_and_count_past_the_total(monkeypatch, capsys):
    """Off a terminal, with a clock the test moves: a line once `interval` seconds have passed since the
    last line (not since the start), the count from `initial`, an unknown total left out, a count
    that jumps past the total still printed; a disabled bar writes nothing, not even messages."""
    from gbattn import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = progress.Progress(None, desc="read", unit="token", initial=5, interval=10.0)
    for t in (10.0, 15.0, 20.0):
        now[0] = t
        bar.update(5)
    assert capsys.readouterr().err == "read: 10 tokens \nread: 20 tokens \n"
    bar = progress.Progress(3, desc="train", interval=1e9)
    bar.update(2)
    bar.update(2)
    assert capsys.readouterr().err == "train: 4/3 steps \n"
    quiet = progress.Progress(3, desc="q", disable=True)
    quiet.write("a message")
    quiet.update(3)
    assert capsys.readouterr().err == ""


def test_progress_on_a_terminal_is_a_tqdm_bar_unless_disabled(monkeypatch):
    """On a terminal: a tqdm bar from `initial`, with the latest postfix, closed by close(); disabled:
    no bar at all."""
    from gbattn import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    assert progress.Progress(3, desc="q", disable=True)._bar is None
    bar = progress.Progress(10, desc="train", initial=4)
    bar.update(1, loss=2.5)
    assert (bar._bar.n, bar._bar.postfix) == (5, "loss=2.5")
    bar.close()
    assert bar._bar.disable
