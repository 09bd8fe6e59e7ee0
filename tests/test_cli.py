"""The command line: `gbattn list`, `gbattn params`, and one-line errors with status 2."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gbattn.cli import main
from gbattn.files import shell_path
from helpers import run_cli


def test_params_paper_counts(capsys):
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "boosted"])
    assert code == 0 and "8,734,208" in out
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "standard"])
    assert code == 0 and "7,419,392" in out


def test_params_takes_the_preset_as_train_does(capsys):
    """`params --preset X` is `params X` (train and bench take --preset); the two given differently are refused."""
    assert run_cli(capsys, ["params", "--preset", "cpu-char", "--attn", "boosted"]) == run_cli(
        capsys, ["params", "cpu-char", "--attn", "boosted"])
    code, out, _ = run_cli(capsys, ["params", "cpu-char", "--preset", "cpu-char"])
    assert code == 0 and out.startswith("cpu-char · attn=standard") and "809,856" in out
    code, _, err = run_cli(capsys, ["params", "cpu-char", "--preset", "paper-small"])
    assert code == 2 and err == "gbattn: error: the preset cpu-char and --preset paper-small disagree: give one\n"


def test_params_fair(capsys):
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "boosted", "--fair", "--json"])
    assert code == 0
    assert "d_model=288" in out and "8,789,184" in out
    record = json.loads(out.strip().splitlines()[-1])
    assert record["fair_width"] == 288 and record["parameters"] == 8_734_208
    assert record["forward_flops_per_token"] > 0


def test_params_gives_a_tiny_models_flops_in_figures_that_are_not_zero(capsys):
    """A tiny model's forward FLOPs per token (2,192 here) printed "0.00 M", and bench's column 0.04 for every row
    beside a FLOP ratio of 1.22: below a million, three significant digits."""
    from gbattn.terminal import in_millions

    assert [in_millions(v) for v in (2192.0, 42_560.0, 999_999.0, 15_724_544.0)] == ["0.00219", "0.0426", "1.00",
                                                                                      "15.72"]
    code, out, _ = run_cli(capsys, ["params", "cpu-char", "--set", "vocab_size=1", "--set", "d_model=1", "--set",
                                    "n_heads=1", "--attn", "boosted", "--fair"])
    assert code == 0 and "forward FLOPs per token:   0.00219 M" in out and ", 0.00244 M FLOPs per token" in out


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
        # a field inside one that holds none (was Python's "'int' object is not iterable")
        (["params", "paper-small", "--set", "d_model.x=3"], "--set d_model.x: d_model=256 has no fields to set"),
        (["params", "paper-small", "--attn", "boosted", "--set", "attn.rounds=2", "--set", "attn.rounds.x=3"],
         "--set attn.rounds.x: rounds=2 has no fields to set"),
        (["frobnicate"], "invalid choice"),
        (["train", "--out", "new-run"], "--data is required for a new run"),  # (not "data=None must be a string")
        # An empty --set value is a script's unset variable, as an empty option's is: `--set init_from=` trained from
        # scratch, `--set dropout_sites=` without dropout, `--attn boosted --set attn.layers=` a standard model.
        (["train", "--out", "new-run", "--set", "data="], "--set 'data=': the value is empty; give null for none"),
        (["train", "--out", "new-run", "--data", "d.txt", "--set", "init_from= "], "--set 'init_from= ': the value is"),
        (["params", "--set", "dropout_sites="], "--set 'dropout_sites=': the value is empty"),
        (["params", "--attn", "boosted", "--set", "attn.layers="], "--set 'attn.layers=': the value is empty"),
        # a folder that is not there is no run (not "holds no run to resume ... start it with the command ...")
        (["train", "--resume", "--out", "no-such-run"], "no-such-run/config.json not found"),
        (["train", "--out", "new-run", "--resume", "--restart"],
         "--resume continues the run in --out and --restart replaces it: give one of them"),
        # an option with a value given twice kept the last one silently (--set adds up, and stays allowed)
        (["params", "--attn", "boosted", "--attn", "standard"], "argument --attn: given twice (boosted, then "
                                                                 "standard): give it once (see: gbattn params --help)"),
        (["compare", "--recipe", "cpu-char", "--only", "standard", "--only", "gba-m2"],  # (no --out: nothing runs)
         "argument --only: given twice (standard, then gba-m2): give it once (it takes several values at once: "
         "--only standard gba-m2)"),
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
              MemoryError(),  # numpy's, for batch_size=2**62 windows (a traceback)
              ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum possible size.")]
    for error in errors:
        monkeypatch.setattr(gbattn.cli, "cmd_list", lambda args, error=error: (_ for _ in ()).throw(error))
        code, _, err = run_cli(capsys, ["list"])
        assert code == 2 and len(err.strip().splitlines()) == 1 and "out of memory" in err, err
    for bug in (RuntimeError("a bug"), ValueError("a bug")):
        monkeypatch.setattr(gbattn.cli, "cmd_list", lambda args, bug=bug: (_ for _ in ()).throw(bug))
        with pytest.raises(type(bug), match="a bug"):
            main(["list"])


def test_an_os_error_no_check_named_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """A name the file system refuses (300 characters: 'File name too long') was a traceback and status 1 from
    export, bench and plot; every command now answers one line naming the file, status 2."""
    long_name = str(tmp_path / ("a" * 300))
    for argv in (["export", str(tmp_path / "no-run"), "--out", long_name], ["bench", "--out", long_name],
                 ["plot", "--out", long_name, long_name]):
        code, _, err = run_cli(capsys, argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
        assert "File name too long" in err and "a" * 300 in err, (argv, err)
    # A rename's second name is the file replaced (atomic_write's temporary file -> a directory in its place): it
    # was left out, so the line named only the temporary file, which no longer exists
    import gbattn.cli
    from gbattn.files import atomic_write

    (tmp_path / "report.json").mkdir()
    monkeypatch.setattr(gbattn.cli, "cmd_list", lambda args: atomic_write(tmp_path / "report.json", "{}"))
    code, _, err = run_cli(capsys, ["list"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path / 'report.json'}: Is a directory" in err, err


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
    # argparse takes --option=value as well: its path is shortened the same way
    set_invocation(["bench", "--out=/home/me/runs/b/", "--data=../corpora/wikitext-2", "--out=runs/x"])
    assert command_line(portable=True) == "gbattn bench --out=b --data=wikitext-2 --out=runs/x"
    assert "../corpora" in command_line()
    # and a tokenizer file named after a kind, as a value of its own or of a --set
    set_invocation(["compare", "--tokenizer", "hf=/home/me/tok/tokenizer.json", "--set",
                    "tokenizer=gpt2=/srv/t.json", "--set", "lr=0.5"])
    assert command_line(portable=True) == (
        "gbattn compare --tokenizer hf=tokenizer.json --set tokenizer=gpt2=t.json --set lr=0.5")
    # an absolute path holding "=" is a path, not an option's value
    set_invocation(["train", "--data", "/home/me/runs=2/wiki"])
    assert command_line(portable=True) == "gbattn train --data wiki"
    # so is a relative one: one that climbs out is shortened whole, as a path without "=" is
    set_invocation(["train", "--out", "../runs/lr=3e-4", "--data", "data/lr=1/../../../wiki", "--out=runs/lr=1"])
    assert command_line(portable=True) == "gbattn train --out lr=3e-4 --data wiki --out=runs/lr=1"
    # a trailing "/" goes, as a value of its own or after "="
    set_invocation(["train", "--out", "runs/x/", "--out=runs/y/"])
    assert command_line(portable=True) == "gbattn train --out runs/x --out=runs/y"
    # a path cut to a name with a leading dash keeps "./" (`--out -cmp` read -cmp as an option)
    set_invocation(["compare", "--out", "/home/me/-cmp", "--set", "lr=-1"])
    assert command_line(portable=True) == "gbattn compare --out ./-cmp --set lr=-1"
    set_invocation([])


def test_suggested_commands_keep_a_leading_dash_path_a_path(tmp_path, monkeypatch):
    """`--out ./-run`, stopped, said "continue with `gbattn train --resume --out -run`", which argparse refused
    (-run read as an option); a comparison's --jobs children were started the same way, and every one failed."""
    from gbattn.cli import build_parser
    from gbattn.experiments import compare
    from gbattn.files import shell_path

    assert shell_path("-run") == "./-run" and shell_path("a b") == "'a b'" and shell_path("-a b") == "'./-a b'"
    args = build_parser().parse_args(["train", "--resume", "--out", shell_path("-run")])
    assert args.out == "./-run"
    started = []
    monkeypatch.setattr(compare.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or pytest.fail("ran"))
    monkeypatch.chdir(tmp_path)
    run_dir = Path("-cmp") / "standard" / "seed1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")  # (a planned run's: nothing written here)
    with pytest.raises(pytest.fail.Exception):
        compare.start_run(run_dir, None, None, None, {}, {"threads": 1})
    (cmd,) = started
    assert Path(build_parser().parse_args(cmd[3:]).out) == run_dir


def test_help_imports_nothing_heavy():
    """`gbattn --help` and every command's --help: no torch, numpy, transformers, matplotlib or tqdm (the progress
    display's import alone takes about as long as the whole --help)."""
    code = ("import sys\nfrom gbattn.cli import main\nfor argv in (['--help'], ['train', '--help'], "
            "['lm-eval', '--help'], ['analyze', '--help']):\n    try:\n        main(argv)\n    except SystemExit:\n"
            "        pass\nheavy = [m for m in ('torch', 'numpy', 'transformers', 'matplotlib', 'tqdm')\n"
            "         if m in sys.modules]\n"
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
    (" 3 ", None, 2, 3),  # ... written with spaces by a job script too
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
        # ... and a training field given there is named as one (it was "unknown model config field(s) ['lr']")
        argv = [command, "--preset", "cpu-char", "--set", "lr=1e-3", "--set", "batch_size=8"]
        assert main(argv) == 2
        assert capsys.readouterr().err == ("gbattn: error: --set lr, batch_size: training field(s); only model fields "
                                           "apply here (`gbattn train` and `compare` take training fields; `gbattn "
                                           "bench` has its own options: --batch for batch_size)\n")


def test_a_training_field_given_to_params_names_the_bench_option_that_sets_it(capsys):
    """`params --set KEY=...` of a training field that `bench` takes as an option of its own names that option, for
    every such field, and each named option is one bench has."""
    from gbattn.config import preset_config
    from gbattn.errors import ConfigError

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench_help = capsys.readouterr().out
    for key, value, option in (("batch_size", 8, "--batch"), ("seq_len", 16, "--seq-len"),
                               ("compile", True, "--compile"), ("amp", "off", "--no-amp"),
                               ("device", "cpu", "--device"), ("threads", 1, "--threads"),
                               ("activation_checkpointing", True, "--activation-checkpointing")):
        with pytest.raises(ConfigError) as caught:
            preset_config("cpu-char", "boosted", {key: value})
        assert f"`gbattn bench` has its own options: {option}" in str(caught.value) and f" for {key})" in str(
            caught.value), key
        assert f"{option} " in bench_help or f"{option}]" in bench_help, option


def test_generate_and_eval_help_state_their_defaults(capsys):
    """`generate --help` gave no default for its sampling options (0.8 and 200, where the Python
    generate() samples at 1.0 from every token): each option's help names the default it parses to."""
    import inspect

    from gbattn.analysis.cli import AGAINST_ONLY, analyze_run
    from gbattn.cli import build_parser

    parser = build_parser()
    for command, options in (("generate", ("max_new_tokens", "temperature", "top_k", "num_samples")),
                             ("eval", ("split",)), ("bench", ("repeats", "steps")),
                             ("analyze", ("max_rows", "batch_size", "top", "examples")), ("lm-eval", ("batch_size",)),
                             ("compare", ("jobs",))):
        argv = {"generate": [command, "RUN", "--prompt", "x"], "bench": [command],
                "compare": [command, "--recipe", "cpu-char", "--out", "OUT"],
                "lm-eval": [command, "RUN", "--tasks", "x"]}.get(command, [command, "RUN"])
        defaults = vars(parser.parse_args(argv))
        if command == "analyze":  # --top and --examples are None when not given (refused without --against): the
            # defaults used are analyze_run's
            defaults.update({name: inspect.signature(analyze_run).parameters[name].default for name in AGAINST_ONLY})
        if command == "generate":  # --top-k is None when not given (greedy decoding says it is unused): 200 is used
            from gbattn.arguments import GENERATE_DEFAULTS

            assert defaults["top_k"] is None
            defaults["top_k"] = GENERATE_DEFAULTS["top_k"]
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        for option in options:
            flag = "--" + option.replace("_", "-")
            stated = re.search(rf"{flag} \S+ (?:[^-]|-(?!-))*?\(default ([^)]+)\)", help_text)
            assert stated and stated.group(1) == str(defaults[option]), (command, flag, help_text)


def test_every_option_help_says_what_it_does_and_its_default():
    """`generate --help` showed --prompt and `lm-eval --help` --num-fewshot with no text at all, --max-new-tokens
    and --num-samples with "(default N)" only, and --residual, `params --preset`, `train --tokenizer`,
    `lm-eval --limit` without their default: every option of every command says what it does (two words
    outside parentheses and defaults) and, unless it is a switch, required or repeatable, its default."""
    import argparse

    from gbattn.cli import build_parser
    from gbattn.config import PRESETS

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    unclear = []
    for command, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = action.help or ""
            what = text
            while re.search(r"\([^()]*\)", what):
                what = re.sub(r"\([^()]*\)", "", what)
            what = re.sub(r"default[^;]*", "", what)
            name = f"{command} {'/'.join(action.option_strings) or action.dest}"
            if len(what.split()) < 2:
                unclear.append(f"{name}: says not what it does: {text!r}")
            if action.nargs != 0 and action.option_strings and not action.required \
                    and not isinstance(action, argparse._AppendAction) and "default" not in text:
                unclear.append(f"{name}: no default: {text!r}")
    assert unclear == []
    tokenizer_help = " ".join(commands["train"]._option_string_actions["--tokenizer"].help.split())
    for name, preset in PRESETS.items():  # the default it states is each preset's
        tokenizer = preset.train.get("tokenizer", "bpe")
        assert (f"{tokenizer} for" in tokenizer_help and name in tokenizer_help) if tokenizer != "bpe" \
            else (name not in tokenizer_help and "else bpe" in tokenizer_help), (name, tokenizer)


def test_train_init_from_a_hugging_face_checkpoint_says_to_upcycle_it_first(tmp_path, capsys):
    """--init-from a Hugging Face checkpoint's directory (its config.json another model's) is one line saying how to
    convert it, not what a run's config.json lacks."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"model_type": "llama"}')
    code, out, err = run_cli(capsys, ["train", "--init-from", llama, "--out", tmp_path / "new"])
    assert (code, out) == (2, "")
    assert err == (f"gbattn: error: {llama} is a Hugging Face checkpoint (llama), not a gbattn run: convert it "
                   f"first with `gbattn upcycle {shell_path(llama)} --attn standard --out DIR` (or --attn boosted), "
                   f"then --init-from DIR\n")
    assert not (tmp_path / "new").exists()


def test_a_file_given_for_a_run_or_comparison_directory_is_named_as_a_file(tmp_path, capsys):
    """`train --resume --out FILE`, `train --init-from FILE` and `plot FILE` said "FILE/config.json not found: is
    FILE a gbattn run directory?" (a path that cannot exist): one line naming FILE as a file, status 2."""
    weights = tmp_path / "best.pt"
    weights.write_bytes(b"x")
    for argv, expected in (
        (["train", "--resume", "--out", weights], f"{weights} is a file, not a gbattn run directory"),
        (["train", "--init-from", weights, "--data", "tiny-shakespeare", "--out", tmp_path / "new"],
         f"{weights} is a file, not a gbattn run directory"),
        (["plot", weights], f"{weights} is a file, not a `gbattn compare` directory"),
    ):
        code, out, err = run_cli(capsys, argv)
        assert (code, out, err) == (2, "", f"gbattn: error: {expected}\n"), argv
    assert not (tmp_path / "new").exists()
    fifo = tmp_path / "pipe"  # (called "a file")
    os.mkfifo(fifo)
    code, out, err = run_cli(capsys, ["train", "--init-from", fifo, "--data", "tiny-shakespeare", "--out",
                                      tmp_path / "new"])
    assert (code, out, err) == (2, "", f"gbattn: error: {fifo} is a device or a pipe, not a gbattn run directory\n")


def test_a_local_folder_named_as_a_path_is_not_guessed_to_be_the_hub_corpus(tmp_path, capsys, monkeypatch):
    """`--data ./wikitext-2-v1` is the README's way to name a local folder of a hub corpus's name: when it is
    missing, the line names a near folder, never the hub name (it asked "did you mean 'wikitext-2-v1'?",
    which fetches the hub's copy); a bare name still gets the corpus it misses."""
    monkeypatch.chdir(tmp_path)
    new_run = ["train", "--preset", "cpu-char", "--out", "run", "--data"]
    code, out, err = run_cli(capsys, [*new_run, "./wikitext-2-v1"])
    assert (code, out) == (2, "") and err.endswith("wikitext-2-v1, openwebtext)\n"), err
    (tmp_path / "wikitext-2-v0").mkdir()
    code, out, err = run_cli(capsys, [*new_run, "./wikitext-2-v1"])
    assert (code, out) == (2, "") and err.endswith("openwebtext) (did you mean 'wikitext-2-v0'?)\n"), err
    code, out, err = run_cli(capsys, [*new_run, "wikitext-2-v"])
    assert (code, out) == (2, "") and err.endswith("(did you mean 'wikitext-2-v1'?)\n"), err


def test_a_near_miss_name_is_answered_with_the_name_it_misses(tmp_path, capsys):
    """A typo of a preset, variant, option, field, recipe, model label or tokenizer got the list of allowed names
    only (up to 59 fields for --set): the one line also names the near miss; a name like none of them gets no guess."""
    new_run = ["train", "--preset", "cpu-char", "--data", "tiny-shakespeare", "--out", tmp_path / "run"]
    for argv, expected in (
        (["params", "paper-smal"], "preset='paper-smal' is not allowed (did you mean 'paper-small'?); choose one of "),
        (["params", "--attn", "boosed"], "attn='boosed' is not allowed (did you mean 'boosted'?); choose one of "),
        (["upcycle", tmp_path, "--attn", "boosed", "--out", tmp_path / "up"],
         "attn='boosed' is not allowed (did you mean 'boosted'?); choose one of "),
        (["params", "--attn", "boosted", "--set", "attn.gate=liner"], "(did you mean 'linear'?); choose one of "),
        (["params", "--set", "d_modle=288"], "--set d_modle: unknown field (did you mean 'd_model'?); model fields"),
        # a variant's option without its attn. prefix, the likeliest reading first (it had no hint at all)
        (["params", "--attn", "boosted", "--set", "rounds=3"], "--set rounds: unknown field (did you mean "
                                                                 "'attn.rounds'?); model fields"),
        ([*new_run, "--attn", "twicing", "--set", "layers=[-1]"], "(did you mean 'attn.layers' or 'n_layers'?)"),
        (["bench", "--preset", "cpu-char", "--set", "kv_source=shared"], "(did you mean 'attn.kv_source'?)"),
        (["params", "--attn", "boosted", "--set", "attn.rouds=3"], "['rouds'] (did you mean 'rounds'?); its options"),
        ([*new_run, "--set", "max_step=3"], "--set max_step: unknown field (did you mean 'max_steps'?); model fields"),
        # the listing names model and training fields: a field given under that group's name is shown without it
        (["params", "--set", "model.n_layers=2"], "(write 'n_layers': a field is set by its name alone, without "
                                                  "'model.')"),
        ([*new_run, "--set", "training.lr=1"], "(write 'lr': a field is set by its name alone, without 'training.'; "
                                               "a training field, which `gbattn train` and `compare` take)"),
        # bench takes model fields only: told to write `lr` alone, it refused that too (say where it applies)
        (["bench", "--set", "training.lr=1"], "without 'training.'; a training field, which `gbattn train` and "
                                              "`compare` take)"),
        (["params", "--attn", "boosted", "--set", "model.attn.rounds=3"], "(write 'attn.rounds': a field is set"),
        ([*new_run, "--set", "train.lr=1"], "(write 'lr': a field is set by its name alone, without 'train.'; "),
        # a field named by its first word (below the similarity cutoff): every field it begins
        ([*new_run, "--set", "warmup=5"], "--set warmup: unknown field (did you mean 'warmup_from_zero' or "
                                          "'warmup_steps'?); model fields"),
        ([*new_run, "--set", "eval=5"], "(did you mean 'eval_batch_size' or 'eval_every' or 'eval_tokens'?)"),
        ([*new_run, "--tokenizer", "chr"], "tokenizer='chr' is not allowed (did you mean 'char'?); choose one of "),
        (["compare", "--recipe", "cpu-prox", "--out", tmp_path / "c"], "(did you mean 'cpu-proxy'?); choose one of "),
        (["compare", "--recipe", "cpu-char", "--only", "standrd", "--out", tmp_path / "c"],
         "--only standrd: not in recipe 'cpu-char' (did you mean 'standard'?) (standard, "),
        (["compare", "--recipe", "cpu-char", "--only", "standard,gba-m2", "--out", tmp_path / "c"],
         "--only standard,gba-m2: not in recipe 'cpu-char'"),  # (a Python list, "['standard,gba-m2']", no hint)
        (["params", "--attn", "bogus"], "attn='bogus' is not allowed; choose one of standard, "),
        (["lis"], "argument command: invalid choice: 'lis' (did you mean 'list'?) (choose from 'list', "),
        (["eval", tmp_path, "--split", "valdi"], "invalid choice: 'valdi' (did you mean 'valid'?) (choose from "),
        (["denoise", "--experiments", "gates", "round"], "invalid choice: 'round' (did you mean 'rounds'?) (choose "),
        (["eval", tmp_path, "--split", "xx"], "invalid choice: 'xx' (choose from 'valid', 'test')"),
        # two neighbouring letters swapped in a short name (too far for the similarity cutoff alone)
        (["eval", tmp_path, "--split", "tset"], "invalid choice: 'tset' (did you mean 'test'?) (choose from "),
        (["generate", tmp_path, "--prompt", "a", "--device", "cdua"],
         "device='cdua' is not allowed (did you mean 'cuda'?); choose auto, cpu, cuda, cuda:N"),
        (["eval", tmp_path, "--device", "cpux"], "device='cpux' is not allowed (did you mean 'cpu'?); choose auto, "),
        (["eval", tmp_path, "--device", "cdua:1"], "device='cdua:1' is not allowed (did you mean 'cuda'?); choose "),
        (["eval", tmp_path, "--device", "gpu"], "device='gpu' is not allowed; choose auto, cpu, cuda, cuda:N"),
    ):
        code, out, err = run_cli(capsys, argv)
        assert (code, out, len(err.splitlines())) == (2, "", 1) and expected in err, (argv, err)
    # --data: a corpus name, or a file beside the one meant (WikiText's train split ships gzipped)
    (tmp_path / "wikitext").mkdir()
    (tmp_path / "wikitext" / "wiki.train.tokens.gz").write_bytes(b"")
    for data, expected in (("tiny-shakspeare", "(did you mean 'tiny-shakespeare'?)"),
                           (tmp_path / "wikitext" / "wiki.train.tokens",
                            f"(did you mean '{tmp_path / 'wikitext' / 'wiki.train.tokens.gz'}'?)"),
                           (tmp_path / "wikitext" / "nothing-like-it", "openwebtext)")):  # no guess
        code, out, err = run_cli(capsys, [*new_run[:-4], "--data", data, *new_run[-2:]])
        assert (code, out, len(err.splitlines())) == (2, "", 1) and err.endswith(f"{expected}\n"), (data, err)
    # a run or comparison directory typed with two letters swapped (train --resume, eval, plot, ...)
    (tmp_path / "runs" / "char-gba").mkdir(parents=True)
    meant, typo = f"(did you mean '{tmp_path / 'runs' / 'char-gba'}'?)", tmp_path / "runs" / "char-gab"
    for argv in (["eval", typo], ["train", "--resume", "--out", typo], ["generate", typo, "--prompt", "a"],
                 ["plot", typo], ["upcycle", typo, "--attn", "boosted", "--out", tmp_path / "up"]):
        code, out, err = run_cli(capsys, argv)
        assert (code, out, len(err.splitlines())) == (2, "", 1) and err.endswith(f"{meant}\n"), (argv, err)
    code, out, err = run_cli(capsys, ["eval", tmp_path / "runs" / "other-run"])
    assert (code, err) == (2, f"gbattn: error: {tmp_path / 'runs' / 'other-run'} does not exist (a gbattn run "
                              f"directory or an exported one is expected)\n")  # (it said "is not a directory")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    code, out, err = run_cli(capsys, ["eval", tmp_path / "gone"])
    assert (code, err) == (2, f"gbattn: error: {tmp_path / 'gone'} is a link to {tmp_path / 'nowhere'}, which does "
                              f"not exist (a gbattn run directory or an exported one is expected)\n")
    assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()


def test_quiet_help_says_what_train_and_compare_leave_out(capsys):
    """train --quiet also leaves out its plan, evaluation and summary lines (test_pipeline's quiet test), and
    compare --quiet each run's, where the help said "no progress display" only; the other commands print
    their summary under --quiet."""
    expected = {"train": "no progress display, plan or evaluation lines: the final JSON line only (warnings still "
                         "go to stderr)",
                "compare": "no progress display, nor each run's plan, evaluation or summary lines (warnings still "
                           "go to stderr)",
                "analyze": "no progress display (warnings still go to stderr)"}
    for command, text in expected.items():
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert f"--quiet {text}" in help_text, (command, help_text)


def test_help_in_a_narrow_terminal_keeps_hyphenated_names_whole(capsys, monkeypatch):
    """At 63 columns argparse wrapped `paper-` and `wt103's` onto two lines (and `--no-` and `compile`), and a word
    longer than the line anywhere (`wikitext-103-r` / `aw-v1`): a reader cannot tell such pieces from two words.
    Every word of each help text is the same in a narrow terminal as in a wide one."""
    def words(command: str, columns: int) -> list[str]:
        monkeypatch.setenv("COLUMNS", str(columns))
        with pytest.raises(SystemExit):
            main([command, "--help"])
        return capsys.readouterr().out.split()

    for command in ("compare", "train", "generate", "bench", "lm-eval"):
        narrow, wide = words(command, 40), words(command, 1000)
        assert sorted(set(narrow) - set(wide)) == [], command


def test_threads_help_says_a_recorded_value_only_where_the_command_resumes(capsys):
    """Every command's --threads said "a resumed run: its recorded value", which only train's resume does (eval,
    generate, analyze, bench and lm-eval set what they are given), and compare's left out OMP_NUM_THREADS, which
    it follows."""
    for command in ("train", "eval", "generate", "analyze", "bench", "lm-eval", "compare"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        threads_help = help_text.split("--threads THREADS CPU threads", 1)[1].split("README")[0]
        assert ("a resumed run: its recorded value" in threads_help) == (command == "train"), command
        assert ("keeps the fewer threads it recorded" in threads_help) == (command == "compare"), command
        assert "default: OMP_NUM_THREADS where it is set" in threads_help, command


def test_train_refuses_compile_and_no_compile_together(tmp_path, capsys):
    """`train --compile --no-compile` trained with the last one, silently (generate refuses the pair): one line,
    status 2, nothing written."""
    code, out, err = run_cli(capsys, ["train", "--preset", "cpu-char", "--data", "tiny-shakespeare", "--out",
                                      tmp_path / "run", "--set", "max_steps=1", "--compile", "--no-compile"])
    assert (code, out) == (2, "")
    assert err == ("gbattn: error: argument --no-compile: not allowed with argument --compile (see: gbattn train "
                   "--help)\n")
    assert not (tmp_path / "run").exists()


def test_an_unknown_option_of_a_command_points_at_that_commands_help(tmp_path, capsys):
    """A misspelt option of a command (`train --tokenzier char`) pointed at `gbattn --help`, which lists no
    command's options; the line points at the command's own help, as every other usage error does, and names
    the near miss among the command's options, as for a misspelt value."""
    code, out, err = run_cli(capsys, ["train", "--out", tmp_path / "run", "--tokenzier", "char"])
    assert (code, out) == (2, "")
    assert err == ("gbattn: error: unrecognized arguments: --tokenzier char (did you mean '--tokenizer'?) (see: "
                   "gbattn train --help)\n")
    # the near miss is among that command's own options (bench has --threads; --seeds, say, is compare's)
    code, _, err = run_cli(capsys, ["bench", "--treads=2", "--seds", "1"])
    assert (code, err) == (2, "gbattn: error: unrecognized arguments: --treads=2 --seds 1 (did you mean '--threads'?) "
                              "(see: gbattn bench --help)\n")
    code, _, err = run_cli(capsys, ["list", "extra"])
    assert (code, err) == (2, "gbattn: error: unrecognized arguments: extra (see: gbattn list --help)\n")
    # `--set a=1 b=2` (two settings after one --set) says that each --set takes one, where the command has --set
    code, _, err = run_cli(capsys, ["train", "--out", tmp_path / "run", "--set", "lr=1e-3", "d_model=64", "seed=1"])
    assert (code, err) == (2, "gbattn: error: unrecognized arguments: d_model=64 seed=1; each --set takes one "
                              "KEY=VALUE: --set d_model=64 (see: gbattn train --help)\n")
    code, _, err = run_cli(capsys, ["list", "lr=1e-3"])
    assert (code, err) == (2, "gbattn: error: unrecognized arguments: lr=1e-3 (see: gbattn list --help)\n")
    assert not (tmp_path / "run").exists()


def test_a_usage_error_quoting_what_was_typed_is_one_line_with_control_characters_escaped(capsys):
    """An unrecognized argument was quoted as typed: a newline in it split the usage error over two lines and an
    escape sequence in it reached the terminal; escaped as every other error line is (terminal_line)."""
    code, out, err = run_cli(capsys, ["list", "a\nb\x1b[31mc"])
    assert (code, out) == (2, "")
    assert err == "gbattn: error: unrecognized arguments: a b\\x1b[31mc (see: gbattn list --help)\n"


def test_help_texts_say_what_each_command_uses(capsys):
    """`bench --help` said of --preset "its training recipe is the default" (bench trains no recipe), and
    `compare --help` gave "(paper: 42 123)" as the seeds of every paper recipe (paper-postln's are 42,
    gba-design-paper's 42 123 7): the example names its recipe, whose seeds it gives."""

    from gbattn.experiments.recipes import get_recipe

    def help_of(command: str) -> str:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        return " ".join(capsys.readouterr().out.split())

    assert "its training recipe is the default" in help_of("train")
    assert "recipe" not in help_of("bench")
    recipe, seeds = re.search(r"--seeds .*?\(([a-z0-9-]+)'s: ([\d ]+)\)", help_of("compare")).groups()
    assert get_recipe(recipe).seeds == [int(s) for s in seeds.split()]
    assert "(its weights chosen by --checkpoint too)" in help_of("analyze")  # --against's run: the same choice
    assert "its first eval_tokens tokens (the run's setting), in whole rows of its seq_len" in help_of("eval")


def test_autocast_and_explicit_threads(monkeypatch):
    """amp=auto is bf16 on CUDA only (a CPU run stays float32); amp=bf16 asks for it anywhere. An
    explicit thread count is used as given, whatever the default would be."""
    import contextlib

    import torch

    from gbattn import runtime

    assert runtime.autocast(torch.device("cpu"), "auto") is contextlib.nullcontext
    assert runtime.autocast(torch.device("mps"), "auto") is contextlib.nullcontext  # CUDA only, a Mac's GPU too
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


def test_more_threads_than_cores_are_set_with_a_warning(monkeypatch, capsys):
    """`--threads 100` on 2 cores was taken silently, and every step ran slower for it (README, "Threads"): it is
    still set, with a warning naming the cores; as many threads as cores, or the default, say nothing."""
    import torch

    from gbattn import runtime
    from gbattn.errors import UserError

    before, real_default_threads = torch.get_num_threads(), runtime.default_threads
    monkeypatch.setattr(runtime, "usable_cpus", lambda: {0, 1})
    try:
        assert runtime.set_threads(3) == 3 and torch.get_num_threads() == 3
        assert capsys.readouterr().err == ("warning: threads=3 is more than the 2 cores this process may use: the "
                                           "threads beyond them take turns on the cores, which slows every step "
                                           "(README, \"Threads\")\n")
        monkeypatch.setattr(runtime, "default_threads", lambda: 2)
        assert runtime.set_threads(2) == 2 and runtime.set_threads(None) == 2
        assert capsys.readouterr().err == ""
        monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun the first process says it, once (each process said it)
        monkeypatch.setenv("RANK", "1")
        assert runtime.set_threads(3) == 3 and capsys.readouterr().err == ""
        monkeypatch.delenv("WORLD_SIZE")  # a RANK left in the environment of one process: it is the first (it said
        assert runtime.is_first_process()  # nothing, and its summary line was dropped)
        assert runtime.set_threads(3) == 3 and "warning: threads=3" in capsys.readouterr().err
        # A count from OMP_NUM_THREADS (a job script's) warns as --threads does (3 was taken silently), and one over
        # --threads' bound is refused as --threads 1025 is (2000 trained at 93 tokens/s where 1 gave 10,000)
        monkeypatch.setattr(runtime, "default_threads", real_default_threads)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert runtime.set_threads(None) == 3 and capsys.readouterr().err.startswith(
            "warning: OMP_NUM_THREADS=3 is more than the 2 cores this process may use: the threads beyond them")
        monkeypatch.setenv("OMP_NUM_THREADS", "1025")
        with pytest.raises(UserError, match=r"^OMP_NUM_THREADS=1025 is more than 1,024 threads \(OpenMP starts every "
                                            r"thread at once, and beyond what the OS allows it crashed\): set it "
                                            r"lower, or give --threads N"):
            runtime.set_threads(None)
        monkeypatch.setenv("OMP_NUM_THREADS", "1024")
        assert runtime.default_threads() == 1024
    finally:
        torch.set_num_threads(before)


def test_eval_scores_with_the_trainers_matmul_precision(tmp_path, monkeypatch, capsys):
    """docs/deviations.md, entry 10: on CUDA the trainer (validation and test) and `gbattn eval` run float32
    matmuls as TF32, so eval gives the run's own numbers again; eval left PyTorch's default (full float32)."""
    import torch

    from gbattn import runtime
    from gbattn.train import trainer
    from helpers import tiny_configs, write_corpus

    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        runtime.use_tf32(torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32
        runtime.use_tf32(torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags

    seen = []
    monkeypatch.setattr(trainer, "use_tf32", lambda device: seen.append(("train", device.type)))
    monkeypatch.setattr(runtime, "use_tf32", lambda device: seen.append(("eval", device.type)))
    model_cfg, train_cfg = tiny_configs(write_corpus(tmp_path / "c"), "standard", max_steps=2, eval_every=2,
                                        device="cpu", threads=1)
    trainer.train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    assert main(["eval", str(tmp_path / "run"), "--device", "cpu", "--threads", "1"]) == 0
    capsys.readouterr()
    assert seen == [("train", "cpu"), ("eval", "cpu")]


def test_eval_batches_rows_as_the_run_evaluated_unless_told(tmp_path, monkeypatch, capsys):
    """`gbattn eval` batched 32 rows whatever the run's eval_batch_size (set smaller to fit a large model in memory,
    it ran out there): it batches the run's eval_batch_size now, and --batch-size still wins; so does run.perplexity."""
    from gbattn import load_run
    from gbattn.errors import ConfigError
    from gbattn.eval import perplexity
    from gbattn.train import trainer
    from helpers import tiny_configs, write_corpus

    model_cfg, train_cfg = tiny_configs(write_corpus(tmp_path / "c"), "standard", max_steps=1, eval_batch_size=3,
                                        device="cpu", threads=1)
    trainer.train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    batches, real = [], perplexity.evaluate
    monkeypatch.setattr(perplexity, "evaluate", lambda model, tokens, seq_len, batch_size, *a, **kw: (
        batches.append(batch_size), real(model, tokens, seq_len, batch_size, *a, **kw))[1])
    for argv, want in (([], 3), (["--batch-size", "5"], 5)):
        assert main(["eval", str(tmp_path / "run"), "--threads", "1", *argv]) == 0
        capsys.readouterr()
        assert batches[-1] == want
    # run.perplexity(text), scored "as gbattn eval scores a split", batched 32 too
    run = load_run(tmp_path / "run")
    text = (tmp_path / "c" / "wiki.test.tokens").read_text()
    run.perplexity(text)
    assert batches[-1] == 3
    run.perplexity(text, batch_size=5)
    assert batches[-1] == 5
    # 0 is refused as `eval --batch-size 0` is (it was taken for "not given": the run's 3, silently)
    with pytest.raises(ConfigError, match=r"batch_size=0 must be an integer >= 1 \(rows per batch\)"):
        run.perplexity(text, batch_size=0)


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
    positional = arguments.Parser(prog="gbattn test")  # `gbattn eval ""` was the current directory
    positional.add_argument("run_dir")
    with pytest.raises(SystemExit):
        positional.parse_args([" "])
    assert "argument run_dir: is empty" in capsys.readouterr().err
    threads = arguments.Parser(prog="gbattn test")  # up to 1024 CPU threads: more crashed OpenMP (MAX_THREADS)
    arguments.threads(threads)
    assert threads.parse_args(["--threads", "1024"]).threads == 1024
    with pytest.raises(SystemExit):
        threads.parse_args(["--threads", "1025"])
    assert "argument --threads: 1025 must be <= 1024" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no thread at all: torch.set_num_threads(0) is an error after the start
        threads.parse_args(["--threads", "0"])
    assert "argument --threads: 0 must be >= 1" in capsys.readouterr().err


def test_integer_and_number_arguments_and_the_model_options_not_given(capsys):
    """A count is written as an integer ('1.5' and '1e3' are refused, not read as 1 and 1000); 0 is a seed
    and a temperature (greedy); --attn and --residual left out leave `--set attn=...` and `--set residual=...`
    to choose (an option's default would disagree with them)."""
    import argparse

    from gbattn import arguments

    for text in ("1.5", "1e3", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{text!r} is not an integer$"):
            arguments.at_least(0)(text)
    assert arguments.SEED("0") == 0 and arguments.non_negative_number("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'x' is not a number$"):
        arguments.non_negative_number("x")
    code, out, _ = run_cli(capsys, ["params", "--set", "attn=boosted", "--set", "residual=attnres-block"])
    assert code == 0 and out.startswith("paper-small · attn=boosted · residual=attnres-block · d_model=256\n")


def test_a_number_argument_refuses_a_negative_an_infinite_and_a_nan_value():
    """A temperature is a finite number >= 0: -0.5, inf and nan (all of which float() reads) are refused with
    the same line; 0 (greedy) is taken."""
    import argparse

    from gbattn import arguments

    for text in ("-0.5", "inf", "nan", "1e999"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be a finite number >= 0$"):
            arguments.non_negative_number(text)
    assert arguments.non_negative_number("0") == 0.0 and arguments.non_negative_number("0.7") == 0.7


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
    """``cuda`` (or ``auto`` where CUDA is available) is the GPU of this process's local rank (else torch's current
    one); an explicit ``cuda:N`` is kept; without CUDA, ``auto`` is the CPU and ``cuda`` a one-line error."""
    import torch

    from gbattn.errors import UserError
    from gbattn.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a machine with 4 GPUs
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("auto", local_rank=2) == torch.device("cuda", 2)
    assert resolve_device("cuda:0", local_rank=3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)  # without a rank (load_run): torch's current GPU
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 2)
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


def test_progress_messages_go_to_stderr_on_a_terminal_too(capsys, monkeypatch):
    """On a terminal the bar's messages (train's "step 5: valid loss ...", compare's "training standard seed 42")
    went through tqdm.write, whose default is stdout: `gbattn train ... | jq` typed at a terminal got them in its
    input. They go to stderr, as off a terminal."""
    import sys

    from gbattn.progress import Progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = Progress(2, desc="train")
    assert bar._bar is not None  # (the terminal's tqdm bar: what the test is about)
    bar.write("step 1: valid loss 4.1556")
    bar.close()
    out, err = capsys.readouterr()
    assert out == "" and "step 1: valid loss 4.1556" in err


def test_progress_lines_show_every_postfix_item_separated_by_spaces(capsys):
    """Off a terminal, several postfix items (loss and learning rate) are each key=value, separated by a space as
    tqdm's bar shows them; the latest update's items replace the earlier ones."""
    from gbattn.progress import Progress

    bar = Progress(2, desc="train", interval=1e9)
    bar.update(1, loss=2.5, lr=0.001)
    bar.update(1, loss=2.25, lr=0.0005)
    assert capsys.readouterr().err == "train: 2/2 steps loss=2.25 lr=0.0005\n"


def progress_clock(monkeypatch, start: float) -> list[float]:
    """The progress display's clock, set by the test: ``now[0] = t`` moves it to t seconds."""
    from gbattn import progress

    now = [start]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    return now


def test_progress_lines_keep_their_interval_start_at_initial_and_count_past_the_total(monkeypatch, capsys):
    """Off a terminal, with a clock the test moves: a line once `interval` seconds have passed since the
    last line (not since the start), the count from `initial`, an unknown total left out, a count
    that jumps past the total still printed; a disabled bar writes nothing, not even messages."""
    from gbattn import progress

    now = progress_clock(monkeypatch, 0.0)
    bar = progress.Progress(None, desc="read", unit="token", initial=5, interval=10.0)
    for t in (10.0, 15.0, 20.0):
        now[0] = t
        bar.update(5)
    assert capsys.readouterr().err == "read: 10 tokens\nread: 20 tokens\n"
    bar = progress.Progress(3, desc="train", interval=1e9)
    bar.update(2)
    bar.update(2)
    assert capsys.readouterr().err == "train: 4/3 steps\n"
    # The time left, at the rate since the start (a resumed count from `initial`), until the total.
    now[0] = 100.0
    bar = progress.Progress(100, desc="train", initial=10, interval=10.0)
    now[0] = 110.0
    bar.update(10, loss=2.5)
    now[0] = 115.0
    bar.update(5)
    now[0] = 200.0
    bar.update(75)
    assert capsys.readouterr().err == "train: 20/100 steps loss=2.5 eta 01:20\ntrain: 100/100 steps loss=2.5\n"
    quiet = progress.Progress(3, desc="q", disable=True)
    quiet.write("a message")
    quiet.update(3)
    assert capsys.readouterr().err == ""


def test_progress_eta_without_a_postfix_follows_the_unit_after_one_space(monkeypatch, capsys):
    """A line off a terminal with a time left but no postfix (a count of tokens read, say): one space between
    the unit and the eta, as between the unit and a postfix."""
    from gbattn import progress

    now = progress_clock(monkeypatch, 0.0)
    bar = progress.Progress(100, desc="train", interval=10.0)
    now[0] = 10.0
    bar.update(20)
    assert capsys.readouterr().err == "train: 20/100 steps eta 00:40\n"


def test_progress_shows_no_eta_before_a_rate_can_be_measured(monkeypatch, capsys):
    """No eta (and no division by zero) for a line with no count since the start (an update of 0 that only
    refreshes the postfix) or printed at the instant the bar started (interval 0)."""
    from gbattn import progress

    now = progress_clock(monkeypatch, 0.0)
    bar = progress.Progress(10, desc="train", initial=5, interval=10.0)
    now[0] = 20.0
    bar.update(0, loss=2.5)
    assert capsys.readouterr().err == "train: 5/10 steps loss=2.5\n"
    at_once = progress.Progress(10, desc="train", interval=0.0)
    at_once.update(1)
    assert capsys.readouterr().err == "train: 1/10 steps\n"


def test_progress_first_line_off_a_terminal_waits_an_interval_from_the_start(monkeypatch, capsys):
    """The first line comes `interval` seconds after the bar started, not at the first update (a log line for
    every bar, however short)."""
    from gbattn import progress

    now = progress_clock(monkeypatch, 1000.0)
    bar = progress.Progress(100, desc="train", interval=10.0)
    now[0] = 1005.0
    bar.update(1)
    assert capsys.readouterr().err == ""
    now[0] = 1010.0
    bar.update(1)
    assert capsys.readouterr().err.startswith("train: 2/100 steps ")


def test_progress_messages_off_a_terminal_go_to_stderr(capsys):
    """write() off a terminal (an evaluation line during training): the message on stderr, as it is."""
    from gbattn.progress import Progress

    bar = Progress(10, desc="train", interval=1e9)
    bar.write("step 5: val loss 2.50")
    assert capsys.readouterr() == ("", "step 5: val loss 2.50\n")


def test_progress_on_a_terminal_is_a_tqdm_bar_unless_disabled(monkeypatch):
    """On a terminal: a tqdm bar from `initial`, with the latest postfix, closed by close(); disabled:
    no bar at all."""
    from gbattn import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    assert progress.Progress(3, desc="q", disable=True)._bar is None
    bar = progress.Progress(10, desc="train", initial=4, unit="step")
    bar.update(1, loss=2.5)
    assert (bar._bar.n, bar._bar.postfix) == (5, "loss=2.5")
    # its total (so the percentage and the time left), its name and its unit reach the bar
    assert (bar._bar.total, bar._bar.desc, bar._bar.unit) == (10, "train", "step")
    assert str(bar._bar).startswith("train:  50%") and " 5/10 " in str(bar._bar)
    bar.close()
    assert bar._bar.disable


def test_progress_on_a_terminal_advances_the_bar_by_each_update_count(monkeypatch):
    """On a terminal, update(n) moves the tqdm bar by n (tokens read a row at a time), not by one."""
    from gbattn import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    bar = progress.Progress(None, desc="read", unit="token")
    bar.update(64)
    bar.update(36)
    assert (bar.n, bar._bar.n) == (100, 100)
    bar.close()


def test_params_without_a_preset_is_paper_small_standard_and_its_json_record(capsys):
    """`gbattn params` alone: paper-small, standard attention, plain residual; the JSON line holds the
    printed numbers, FLOPs as counted by hand (2 per weight of 12 d^2 per layer and the LM head, 4 T d
    per layer for QK^T and AV)."""
    d, layers, vocab, T = 256, 4, 16_384, 256
    code, out, _ = run_cli(capsys, ["params", "--json"])
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[:3] == ["paper-small · attn=standard · residual=plain · d_model=256",
                         "parameters:                7,419,392",
                         "forward FLOPs per token:   15.73 M  (torch.utils.flop_counter, T=256)"]
    assert json.loads(lines[-1]) == {
        "preset": "paper-small", "attn": "standard", "attn_options": {}, "residual": "plain", "d_model": 256,
        "parameters": 7_419_392, "forward_flops_per_token": 2 * (layers * 12 * d * d + vocab * d) + layers * 4 * T * d,
        "flops_seq_len": 256}  # (named "seq_len", it read as the 255 input tokens a training row has)


def test_params_fair_reports_the_standard_models_numbers_at_the_matched_width(capsys, monkeypatch):
    """--fair: the standard model (not GBA) at the width solved for GBA's own count, 288: its count, its
    FLOPs (the same formula at d 288) and its excess over GBA's count in percent."""
    import gbattn.model

    solve, targets = gbattn.model.param_matched_width, []
    monkeypatch.setattr(gbattn.model, "param_matched_width", lambda cfg, n: targets.append(n) or solve(cfg, n))
    d, layers, vocab, T = 288, 4, 16_384, 256
    fair_flops = 2 * (layers * 12 * d * d + vocab * d) + layers * 4 * T * d
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "boosted", "--fair", "--json"])
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[3] == "parameter-matched standard: d_model=288, 8,789,184 parameters (+0.63%), 18.58 M FLOPs per token"
    record = json.loads(lines[-1])
    assert (record["fair_width"], record["fair_parameters"]) == (288, 8_789_184)
    assert record["fair_forward_flops_per_token"] == fair_flops == 18_579_456
    assert record["parameters"] == 8_734_208 and targets == [8_734_208]  # +0.63%: 8,789,184 / 8,734,208 - 1
    code, out, _ = run_cli(capsys, ["params", "paper-small", "--attn", "boosted"])
    assert code == 0 and "{" not in out  # no JSON line without --json
    # the excess is the matched model's over GBA's count (+5.01% at cpu-char; 1 - n/n_fair would say +4.77%)
    code, out, _ = run_cli(capsys, ["params", "cpu-char", "--attn", "boosted", "--fair", "--json"])
    record = json.loads(out.strip().splitlines()[-1])
    excess = 100 * (record["fair_parameters"] / record["parameters"] - 1)
    assert f"parameters ({excess:+.2f}%)" in out and f"({excess:+.2f}%)" == "(+5.01%)"


def test_params_residual_option_reaches_the_model(capsys):
    """`params --residual attnres-full`: the record and the count are those of the AttnRes model."""
    from gbattn.config import preset_config
    from gbattn.model import count_params

    code, out, _ = run_cli(capsys, ["params", "paper-small", "--residual", "attnres-full", "--json"])
    record = json.loads(out.strip().splitlines()[-1])
    expected = count_params(preset_config("paper-small", "standard", {"residual": "attnres-full"}))
    assert code == 0 and record["residual"] == "attnres-full" and "residual=attnres-full" in out
    assert record["parameters"] == expected != 7_419_392


def test_list_under_python_oo_says_docstrings_are_stripped():
    """python -OO strips docstrings, where `gbattn list` takes each variant's description: it blamed every variant's
    file ("its file has no docstring")."""
    out = subprocess.run([sys.executable, "-OO", "-m", "gbattn", "list"], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert "  boosted       (no description: python -OO strips docstrings)" in out and "its file" not in out


def test_list_shows_option_defaults_as_json_kv_heads_and_every_recipe(capsys):
    """`gbattn list`: an option's default as JSON (a string quoted, None as null), K/V heads of a GQA
    preset, and one line per comparison recipe, its description aligned with the others."""
    from gbattn.experiments.recipes import RECIPES

    code, out, _ = run_cli(capsys, ["list"])
    assert code == 0
    lines = out.splitlines()
    assert "                  attn.gate (default \"linear\"; one of linear, mlp, vector, scalar, tanh, none)" in lines
    assert "                  attn.layers (default null)" in lines
    assert "                  attn.rounds (default 2)" in lines
    assert "d_model 256, 4 layers, 4/2 kv heads, block_size 256" in out
    assert "d_model 256, 4 layers, 4 heads, block_size 256" in out  # paper-small: no kv part
    from gbattn.config import PRESETS, preset_config

    for name in PRESETS:  # each preset's vocabulary and dropout are its own (its built model's)
        cfg = preset_config(name, "standard")
        assert f"block_size {cfg.block_size}, vocab {cfg.vocab_size}, dropout {cfg.dropout}:" in next(
            line for line in lines if line.startswith(f"  {name} ")), name
    recipe_lines = lines[lines.index("Comparison recipes (gbattn compare --recipe NAME):") + 1 :]
    assert len(recipe_lines) == len(RECIPES)
    column = 2 + max(len(name) for name in RECIPES) + 2  # every description starts in one column
    for line, (name, recipe) in zip(recipe_lines, RECIPES.items()):
        assert line == f"  {name}".ljust(column) + recipe.description


def test_version_and_a_missing_command(capsys):
    """--version prints `gbattn VERSION`; no command at all is a usage error with status 2."""
    from gbattn import __version__

    code, out, _ = run_cli(capsys, ["--version"])
    assert code == 0 and out == f"gbattn {__version__}\n"
    code, out, err = run_cli(capsys, [])
    assert code == 2 and out == "" and "the following arguments are required: command" in err


def test_a_user_error_message_is_one_line_and_an_interrupt_exits_130(capsys, monkeypatch):
    """A multi-line UserError message is printed on one line (whitespace runs collapsed), on stderr
    only; Ctrl-C during a command is `gbattn: interrupted` with status 130; an out-of-memory detail
    spread over lines is one line too, cut at 200 characters."""
    import torch

    import gbattn.cli
    from gbattn.errors import CheckpointError, DataNotFound

    def raising(error):
        return lambda args: (_ for _ in ()).throw(error)

    for error in (DataNotFound("no corpus\n   named  x"), CheckpointError("no corpus\n   named  x")):
        monkeypatch.setattr(gbattn.cli, "cmd_list", raising(error))
        assert run_cli(capsys, ["list"]) == (2, "", "gbattn: error: no corpus named x\n")
    monkeypatch.setattr(gbattn.cli, "cmd_list", raising(KeyboardInterrupt()))
    assert run_cli(capsys, ["list"]) == (130, "", "gbattn: interrupted\n")
    monkeypatch.setattr(gbattn.cli, "cmd_list", raising(torch.OutOfMemoryError("CUDA out of\nmemory. " + "x" * 300)))
    code, out, err = run_cli(capsys, ["list"])
    detail = "CUDA out of memory. " + "x" * 180
    assert (code, out) == (2, "") and err == (
        f"gbattn: error: out of memory ({detail}): choose smaller sizes (batch_size, seq_len, d_model, "
        f"--num-samples, ...)\n")


def test_terminal_text_and_line_share_one_escaping_and_keep_their_rules():
    """One escaping of a character (``\\x1b``), two rules: generated text keeps its newlines, tabs and non-ASCII
    spaces and escapes other control characters; an error line collapses whitespace (a carriage return and a
    no-break space too) and escapes every other character that is not printable (a right-to-left override)."""
    from gbattn import terminal

    text = "a\x1b[31mb\rc\n\td\u00a0e\u202ef"
    assert terminal.terminal_text(text) == "a\\x1b[31mb\\rc\n\td\u00a0e\u202ef"
    assert terminal.terminal_line(text) == "a\\x1b[31mb c d e\\u202ef"
    assert all(terminal.escaped(c) == ascii(c)[1:-1] for c in "\x1b\r\u202e")
    # the 8-bit controls too: a CSI (\x9b) starts an escape sequence on many terminals, as \x1b[ does
    eight_bit = "ok\x9b31mRED\x85x\x7fy"
    assert terminal.terminal_text(eight_bit) == "ok\\x9b31mRED\\x85x\\x7fy"
    assert terminal.terminal_line(eight_bit) == "ok\\x9b31mRED x\\x7fy"  # a next-line (\x85) is whitespace


def test_sigterm_during_a_command_is_one_line_status_143_and_unwinds(tmp_path):
    """SIGTERM outside a training loop (data preparation, an export, a benchmark) ended the process at
    once with no word (status -15): it now unwinds as Ctrl-C does (the command's cleanup runs) and exits
    143 with `gbattn: terminated`; afterwards SIGTERM's default is back. In a child process, so that a
    regression ends the child and not the test run. Only as the program (argv from the command line): a
    Python caller of main(argv) keeps SIGTERM's default."""
    cleaned = tmp_path / "cleaned"
    code = ("import os, signal, sys, time\nimport gbattn.cli\ncleaned = sys.argv[1]\n"
            "def terminated_mid_command(args):\n    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        time.sleep(30)\n    finally:\n        open(cleaned, 'w').close()\n"
            "def default_kept(args):\n    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
            "gbattn.cli.cmd_list = default_kept\nassert gbattn.cli.main(['list']) == 0\n"
            "gbattn.cli.cmd_list = terminated_mid_command\nsys.argv[1:] = ['list']\nstatus = gbattn.cli.main()\n"
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\nsys.exit(status)\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.run([sys.executable, "-c", code, str(cleaned)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert (proc.returncode, proc.stderr) == (143, "gbattn: terminated\n") and cleaned.exists(), proc.stderr[-500:]


def test_a_forked_worker_stopped_by_sigterm_dies_silently_as_by_default():
    """A process forked during a command (a multiprocessing pool's worker: lm-eval's bootstrap of a perplexity's
    standard error) inherited main's SIGTERM handler, so Pool.terminate() made each worker print a traceback of
    Terminated and exit 1 in a run that succeeded. The worker now ends as SIGTERM's default ends it (-SIGTERM)."""
    code = ("import multiprocessing, sys, time\nimport gbattn.cli\n"
            "def wait(ready):\n    ready.set()\n    time.sleep(60)\n"
            "def forks_a_worker(args):\n    fork = multiprocessing.get_context('fork')\n    ready = fork.Event()\n"
            "    worker = fork.Process(target=wait, args=(ready,))\n    worker.start()\n    assert ready.wait(60)\n"
            "    worker.terminate()\n    worker.join(60)\n    print(worker.exitcode)\n"
            "gbattn.cli.cmd_list = forks_a_worker\nsys.argv[1:] = ['list']\nsys.exit(gbattn.cli.main())\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, f"{-signal.SIGTERM}\n"), proc.stderr[-500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-500:]


def test_main_restores_the_ctrl_c_handler_it_set_while_starting(capsys):
    """The handler for Ctrl-C during torch's import is only for the start: afterwards the previous one
    is back (a later Ctrl-C raises KeyboardInterrupt, the command checkpoints)."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, handler)
    try:
        assert main(["list"]) == 0 and capsys.readouterr().err == ""
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_torch_is_imported_ends_the_command_at_once_with_status_130():
    """Ctrl-C during torch's import (nothing has started yet): `gbattn: interrupted` and status 130, as a
    Ctrl-C during a command, and the command never runs. In a child process: the handler ends the process."""
    code = ("import builtins, os, signal\nimport gbattn.cli\nreal_import = builtins.__import__\n"
            "def importing(name, *args, **kwargs):\n    if name == 'torch':\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n    return real_import(name, *args, **kwargs)\n"
            "builtins.__import__ = importing\ngbattn.cli.main(['list'])\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "gbattn: interrupted\n"), proc.stderr[-500:]


def test_main_leaves_an_ignored_ctrl_c_ignored_while_starting(capsys, monkeypatch):
    """A process started with SIGINT ignored (a shell's background job) is not ended by a Ctrl-C meant for
    the script that started it, at the start either: no handler is set over the ignored signal."""
    import signal

    from gbattn import cli

    set_for, real = [], signal.signal

    def recorded(signum, handler):
        set_for.append(signum)
        return real(signum, handler)

    monkeypatch.setattr(cli.signal, "signal", recorded)
    before = real(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["list"]) == 0 and capsys.readouterr().err == ""
        assert signal.SIGINT not in set_for and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        real(signal.SIGINT, before)


def test_resolve_device_refuses_what_torch_cannot_name():
    """A non-string device, `cuda:x` (torch's RuntimeError) and mps where it is not allowed are one-line
    UserErrors."""
    import torch

    from gbattn.errors import UserError
    from gbattn.runtime import resolve_device

    with pytest.raises(UserError, match="device=None is not allowed"):
        resolve_device(None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(UserError, match=r"^device='cuda:x' is not allowed; choose auto, cpu, cuda, cuda:N$"):
            resolve_device("cuda:x")
    # mps only where the caller allows it (load_run), and then named among the choices
    with pytest.raises(UserError, match=r"^device='mps' is not allowed; choose auto, cpu, cuda, cuda:N$"):
        resolve_device("mps")
    with pytest.raises(UserError, match=r"^device='xpu' is not allowed; choose auto, cpu, cuda, cuda:N or mps$"):
        resolve_device("xpu", mps=True)


def test_autocast_is_bfloat16_and_the_cpu_device_name_counts_threads(monkeypatch):
    """amp=bf16 autocasts to bfloat16 (not float16); a CPU's name holds the torch thread count in use,
    `1 thread` singular, and the architecture where platform.processor() names none."""
    import platform

    import torch

    from gbattn import runtime

    with runtime.autocast(torch.device("cpu"), "bf16")():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(platform, "processor", lambda: "cpuX")
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(runtime, "cpu_model", lambda: None)  # no /proc/cpuinfo: the architecture alone
    monkeypatch.setattr(runtime, "cpu_kernels", lambda: None)
    for threads, expected in ((1, "cpu (1 thread, cpuX)"), (3, "cpu (3 threads, cpuX)")):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        assert runtime.device_name(torch.device("cpu")) == expected
    # platform.processor() is often empty on Linux: the machine's architecture, not an empty name
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert runtime.device_name(torch.device("cpu")) == "cpu (3 threads, aarch64)"


def test_the_cpu_device_name_holds_the_cpu_model(monkeypatch, tmp_path):
    """A results file's hardware said `cpu (2 threads, x86_64)` for every x86 machine (platform.processor() is the
    architecture on Linux), so two hosts' benchmarks could not be told apart; it now holds /proc/cpuinfo's model
    name too, cleaned to one printable line of at most 100 characters; a missing file or field leaves the
    architecture alone."""
    import platform

    import torch

    from gbattn import runtime

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel\t\t: 1\n"  # the model number, first
                       "model name\t: AMD EPYC  7B13\x1b[31m 64-Core\n"
                       "processor\t: 1\nmodel name\t: other\n")
    assert runtime.cpu_model(str(cpuinfo)) == "AMD EPYC 7B13[31m 64-Core"
    assert runtime.cpu_model(str(tmp_path / "none")) is None
    cpuinfo.write_text("processor\t: 0\nmodel name\t:   \n")
    assert runtime.cpu_model(str(cpuinfo)) is None
    cpuinfo.write_text(f"model name\t: {'Z' * 300}\n")  # a damaged or odd file: a bounded name, not its whole line
    assert runtime.cpu_model(str(cpuinfo)) == "Z" * 100
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(runtime, "cpu_model", lambda: "AMD EPYC 7B13")
    monkeypatch.setattr(runtime, "cpu_kernels", lambda: None)
    assert runtime.device_name(torch.device("cpu")) == "cpu (2 threads, x86_64, AMD EPYC 7B13)"


def test_the_cuda_device_name_is_the_devices_asked_for(monkeypatch):
    """On a machine with two kinds of GPU, cuda:1's results record cuda:1's name, not the current device's (a
    benchmark never makes its device the current one)."""
    import torch

    from gbattn import runtime

    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-40GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: names[0 if device is None else torch.device(device).index or 0])
    assert runtime.device_name(torch.device("cuda", 1)) == "NVIDIA A100-SXM4-40GB"
    assert runtime.device_name(torch.device("cuda", 0)) == "NVIDIA H100 80GB HBM3"


def test_the_cpu_device_name_holds_the_kernels_instruction_set(monkeypatch):
    """Two CPU runs of one seed bit-match only when torch dispatches to the same kernels: the same code
    gave a different validation loss at step 250 with AVX2 kernels than with AVX512 ones on one machine
    (docs/deviations.md, entry 21), so the device name records the instruction set, as torch reports
    it, after the CPU's model."""
    import platform

    import torch

    from gbattn import runtime

    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(runtime, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert runtime.device_name(torch.device("cpu")) == "cpu (1 thread, x86_64, AMD EPYC, AVX2)"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "")
    assert runtime.device_name(torch.device("cpu")) == "cpu (1 thread, x86_64, AMD EPYC)"
    # the real call, with torch's kernels forced down to the baseline
    code = "import torch; from gbattn import runtime; print(runtime.cpu_kernels())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "DEFAULT"


def test_rng_states_of_a_cuda_device_are_its_generators(monkeypatch):
    """On CUDA, dropout draws from the device's generator: rng_state/set_rng_state use it, a checkpoint
    holds both generators; on the CPU only the CPU's, even when the checkpoint came from a GPU run, and on a GPU only
    the CPU's where the checkpoint came from a CPU run."""
    import torch

    from gbattn import runtime

    cuda = torch.device("cuda", 1)
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: ("cuda-state", device))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device)))
    cpu_state = torch.get_rng_state()
    assert runtime.rng_state(cuda) == ("cuda-state", cuda)
    runtime.set_rng_state(cuda, "s")
    assert calls == [("s", cuda)]
    states = runtime.all_rng_states(cuda)
    assert states["cuda"] == ("cuda-state", cuda) and torch.equal(states["torch"], cpu_state)
    assert set(runtime.all_rng_states(torch.device("cpu"))) == {"torch"}
    calls.clear()
    runtime.restore_rng_states({"torch": cpu_state, "cuda": OnTheGPU("g")}, torch.device("cpu"))
    assert calls == []
    runtime.restore_rng_states({"torch": cpu_state, "cuda": OnTheGPU("g")}, cuda)
    assert calls == [("g", cuda)]
    runtime.restore_rng_states({"torch": cpu_state}, cuda)  # a CPU run's checkpoint resumed on a GPU: its own stream
    assert calls == [("g", cuda)]


class OnTheGPU:
    """A generator state as a checkpoint read onto the run's GPU holds it: torch.set_rng_state refuses it ("RNG
    state must be a torch.ByteTensor", every resume on CUDA did) until it is back on the CPU."""

    def __init__(self, state):
        self.state = state

    def cpu(self):
        return self.state


def test_generator_states_read_onto_the_gpu_are_restored_from_the_cpu(monkeypatch):
    """A GPU run's checkpoint is read onto its GPU: both generators' states come back through the CPU, so that the
    run resumes the same random streams (the CPU's state here a real one, checked after the restore)."""
    import torch

    from gbattn import runtime

    cuda, calls = torch.device("cuda", 0), []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device)))
    saved = torch.get_rng_state()
    expected = torch.rand(3)
    torch.manual_seed(12345)
    runtime.restore_rng_states({"torch": OnTheGPU(saved), "cuda": OnTheGPU("cuda-state")}, cuda)
    assert torch.equal(torch.rand(3), expected) and calls == [("cuda-state", cuda)]


def test_busy_cores_fall_back_to_the_load_average_and_proc_stat_edge_cases(monkeypatch):
    """Two /proc/stat readings with no time between them, or none: the load average (none readable:
    nothing busy); the sample waits `interval` (0.2 s by default); guest time (fields 9-10, already in
    user and nice) is not counted twice, steal time is; a line of fewer than five fields, or with a value that is not a
    number, is unreadable."""
    import io

    from gbattn import runtime

    slept = []
    monkeypatch.setattr(runtime.time, "sleep", slept.append)
    monkeypatch.setattr(runtime, "_cpu_times", lambda cpus=None: (10.0, 100.0))
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert runtime.busy_cores() == 1.5 and slept == [0.2]

    def no_loadavg():
        raise OSError("no load average")

    monkeypatch.setattr(runtime, "_cpu_times", lambda cpus=None: None)
    monkeypatch.setattr(runtime.os, "getloadavg", no_loadavg)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # 3 of the machine's 64
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 64)
    assert runtime.busy_cores() == 0.0 and runtime.free_cores() == 3
    monkeypatch.undo()
    for line, expected in (("cpu  100 5 50 800 40 3 2 0 7 9\n", (160.0, 1000.0)), ("cpu  100 5 50 800\n", None),
                           ("cpu  100 5 50 800 40 3 2 6 7 9\n", (166.0, 1006.0)),  # steal time (field 8) is busy
                           ("cpu  100 x 50 800 40\n", None)):  # a value that is not a number: unreadable
        monkeypatch.setattr(runtime, "open", lambda *a, line=line, **k: io.StringIO(line), raising=False)
        assert runtime._cpu_times() == expected


def test_default_threads_divide_among_this_machines_processes_only(monkeypatch):
    """LOCAL_WORLD_SIZE (processes on this machine) divides the free cores, rounded down to whole threads;
    WORLD_SIZE (all machines) does not."""
    from gbattn import runtime

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(runtime, "free_cores", lambda: 8)
    assert runtime.default_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert runtime.default_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # a whole number of threads each (torch takes no 2.67 threads)
    assert runtime.default_threads() == 2 and type(runtime.default_threads()) is int
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "0")  # not a number of processes: ignored
    assert runtime.default_threads() == 8


def test_command_line_quotes_arguments_and_falls_back_to_sys_argv(monkeypatch):
    """An argument with a space is quoted as a shell needs it; a portable path loses its trailing slash;
    without a recorded invocation the process's own arguments are the command."""
    from gbattn import runtime

    runtime.set_invocation(["generate", "run", "--prompt", "to be"])
    assert runtime.command_line() == "gbattn generate run --prompt 'to be'"
    runtime.set_invocation(["export", "runs/x/", "--out", "/tmp/hf/"])
    assert runtime.command_line(portable=True) == "gbattn export runs/x --out hf"  # trailing slashes dropped
    runtime.set_invocation([])
    monkeypatch.setattr(runtime.sys, "argv", ["gbattn", "list"])
    assert runtime.command_line() == "gbattn list"


def test_error_classes_are_user_errors_and_the_builtin_errors_they_refine():
    """Every gbattn error is a UserError (one line, status 2); a caller catching the builtin type
    (ValueError for configuration and data, RuntimeError for checkpoints) still catches it."""
    from gbattn.errors import CheckpointError, ConfigError, DataError, DataNotFound, UserError

    for cls, builtin in ((ConfigError, ValueError), (DataError, ValueError), (DataNotFound, ValueError),
                         (CheckpointError, RuntimeError)):
        assert issubclass(cls, UserError) and issubclass(cls, builtin), cls


def test_gbattn_debug_shows_the_traceback_of_an_error_the_cli_reports_in_one_line(tmp_path, monkeypatch, capsys):
    """A bad input is one line and status 2; with GBATTN_DEBUG=1 the same error propagates with its traceback:
    a user error, an OSError no check named and running out of memory (the last two raised by the command itself)."""
    import gbattn.cli
    from gbattn.errors import UserError

    def disk_full(args):
        raise OSError(28, "No space left on device", "somewhere")

    def out_of_memory(args):
        raise MemoryError("cannot allocate 8 GiB")

    for argv, command, error in ((["eval", str(tmp_path / "no-such-run")], None, UserError),
                                 (["list"], disk_full, OSError), (["list"], out_of_memory, MemoryError)):
        if command is not None:
            monkeypatch.setattr(gbattn.cli, "cmd_list", command)
        for off in ("", "0"):
            monkeypatch.setenv("GBATTN_DEBUG", off)
            assert main(argv) == 2
            assert capsys.readouterr().err.startswith("gbattn: error: ")
        monkeypatch.setenv("GBATTN_DEBUG", "1")
        with pytest.raises(error):
            main(argv)


@pytest.mark.parametrize("as_keyword", [False, True])
def test_build_configs_keeps_an_explicit_warmup_given_either_way(as_keyword):
    """build_configs keeps a warmup the user sets as given, in ``sets`` or as a keyword: the keyword was
    fitted to a tenth of a short run (25 -> 2 steps of 20), as the preset's own default is."""
    from gbattn.config import build_configs
    from gbattn.train.trainer import fitted_warmup

    sets, keywords = ({"max_steps": 20}, {"warmup_steps": 25}) if as_keyword else ({"max_steps": 20,
                                                                                  "warmup_steps": 25}, {})
    _, train_cfg = build_configs("cpu-char", "standard", "data", sets, **keywords)
    warmup, note = fitted_warmup(train_cfg, 20)
    assert warmup == 25 and note.startswith("warning: warmup_steps=25 >= the run's 20 steps")
    _, preset_default = build_configs("cpu-char", "standard", "data", {"max_steps": 20})
    assert fitted_warmup(preset_default, 20)[0] == 2  # the preset's warmup of 100 is fitted to the run
    _, asked_to_fit = build_configs("cpu-char", "standard", "data", {**sets, "fit_warmup": True}, **keywords)
    assert fitted_warmup(asked_to_fit, 20)[0] == 2  # fit_warmup given too: it is what was asked for


def test_a_value_equal_to_its_default_changes_no_recorded_model():
    """A run recorded with no variant options (rounds 2 by default) was refused `train --resume --set attn.rounds=2`
    as a change '(recorded: None)', as was --set final_norm=true of a Pre-LN run (which has one); and `bench --attn
    boosted boosted:rounds=2,gate=linear` benched one model twice. Two configs that build one model are one model;
    a real change names the value the run has."""
    from gbattn.bench.speed import _refuse_repeats
    from gbattn.cli import build_parser
    from gbattn.config import build_configs
    from gbattn.errors import UserError
    from gbattn.train.cli import resume_conflicts

    model_cfg, train_cfg = build_configs("cpu-char", "boosted", "tiny-shakespeare")
    assert model_cfg.attn_options == {} and model_cfg.final_norm is None

    def conflicts(*sets):
        args = build_parser().parse_args(["train", "--resume", "--out", "run", *sets])
        return resume_conflicts(args, {"preset": "cpu-char"}, model_cfg, train_cfg)

    same = ["attn.rounds=2", "attn.gate=linear", "attn_options.kv_source=residual", "final_norm=true", "attn_bias=true",
            "n_kv_heads=4", "dropout_sites=[ffn-output,attention,ffn-hidden,embedding]"]  # (the same sites)
    assert conflicts(*[arg for item in same for arg in ("--set", item)]) == []
    assert conflicts("--set", "attn.rounds=3") == ["--set attn.rounds=3 (recorded: 2)"]
    assert conflicts("--set", "final_norm=false") == ["--set final_norm=False (recorded: True)"]
    # a Post-LN, bias-free run: its unset final norm is none, its attention has no bias (what the block builds)
    model_cfg, train_cfg = build_configs("cpu-llama", "boosted", "tiny-shakespeare", {"norm": "post"})
    assert model_cfg.final_norm is None and model_cfg.attn_bias is None and not model_cfg.bias
    assert conflicts("--set", "final_norm=false", "--set", "attn_bias=false") == []
    assert conflicts("--set", "final_norm=true", "--set", "attn_bias=true") == [
        "--set final_norm=True (recorded: False)", "--set attn_bias=True (recorded: False)"]
    with pytest.raises(UserError, match=r"^--attn names boosted twice \(boosted:rounds=2,gate=linear is the same"):
        _refuse_repeats("--attn", ["standard", "boosted", "boosted:rounds=2,gate=linear"], "cpu-char", {})
    _refuse_repeats("--attn", ["standard", "boosted", "boosted:rounds=3"], "cpu-char", {})


def test_params_with_a_second_setting_after_one_set_says_each_set_takes_one(capsys):
    """`params --set d_model=64 n_heads=2`: the optional preset took 'n_heads=2' ("preset='n_heads=2' is not
    allowed"), where the other commands say each --set takes one KEY=VALUE."""
    code, out, err = run_cli(capsys, ["params", "--set", "d_model=64", "n_heads=2"])
    assert (code, out, err) == (2, "", "gbattn: error: 'n_heads=2' is not a preset; each --set takes one KEY=VALUE: "
                                       "--set n_heads=2\n")


@pytest.mark.parametrize("argv, line", [
    (["decode_kernels.py", "--preset", "nope"], "decode_kernels.py: error: preset='nope' is not allowed; choose"),
    (["unk_token_counts.py", "--train", "no-such-corpus", "--text", "wt", "--out", "c.json"],
     "unk_token_counts.py: error: --data 'no-such-corpus': no such file or directory"),
    (["postln_plateau.py", "--data", "x", "--out", "p", "--seeds", "1", "--jobs", "0", "--results", "r.json"],
     "postln_plateau.py: error: argument --jobs: 0 must be >= 1"),  # (it looped forever)
    # (tracebacks: FileNotFoundError, StopIteration, IsADirectoryError; --also and --results only after training)
    (["unk_token_counts.py", "--train", "tiny-shakespeare", "--text", "no-such-folder", "--out", "c.json"],
     "unk_token_counts.py: error: --text no-such-folder: does not exist"),
    (["unk_token_counts.py", "--train", "tiny-shakespeare", "--text", ".", "--out", "c.json"],
     "unk_token_counts.py: error: --text .: no file with 'valid' in its name"),
    (["unk_token_counts.py", "--train", "tiny-shakespeare", "--text", "wt", "--out", "."],
     "unk_token_counts.py: error: --out .: is a folder; name the JSON file to write"),
    (["postln_plateau.py", "--data", "x", "--out", "p", "--seeds", "1", "--also", "no-such-comparison", "--results",
      "r.json"], "postln_plateau.py: error: --also no-such-comparison: does not exist"),
    (["postln_plateau.py", "--data", "x", "--out", "p", "--seeds", "1", "--results", "."],
     "postln_plateau.py: error: --results .: is a folder; name the JSON file to write"),
])
def test_a_script_answers_a_mistake_in_one_line(tmp_path, argv, line):
    """The scripts of scripts/ answer a bad preset, corpus or count as the commands do: one line, exit 2 (they were
    tracebacks, exit 1)."""
    from helpers import REPOSITORY

    (tmp_path / "wt").mkdir()
    for split in ("valid", "test"):
        (tmp_path / "wt" / f"wiki.{split}.tokens").write_text(" = A = \n", encoding="utf-8")
    proc = subprocess.run([sys.executable, str(REPOSITORY / "scripts" / argv[0]), *argv[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_loop_of_links_is_one_line_wherever_a_path_is_given(tmp_path, monkeypatch, capsys):
    """Two links to each other as --out: train, compare and denoise ended in a RuntimeError traceback from
    Path.resolve() (status 1); export said "a link to loopB, which does not exist" of a loopB that exists."""
    monkeypatch.chdir(tmp_path)
    os.symlink("loopB", "loopA")
    os.symlink("loopA", "loopB")
    assert main(["train", "--preset", "cpu-char", "--data", "tiny-shakespeare", "--out", "loopA/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gbattn: error: Symlink loop from ") and err.endswith(
        "links that lead back to each other name no file or folder; remove one of them\n")
    from gbattn.errors import UserError
    from gbattn.files import check_writable_dir

    with pytest.raises(UserError, match="^--out loopA is a link to loopB in a loop of links that lead back to each"):
        check_writable_dir("loopA")


def test_a_failed_new_run_leaves_none_of_the_folders_it_made(tmp_path, monkeypatch, capsys):
    """`train --out typo1/typo2/run --data nonexist` removed run but left typo1/typo2 (made for it, empty); a folder
    that was there, or that holds something else, stays."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--preset", "cpu-char", "--data", "no-such-corpus"]
    assert main([*argv, "--out", "typo1/typo2/run"]) == 2
    assert "no-such-corpus" in capsys.readouterr().err and sorted(os.listdir(tmp_path)) == []
    (tmp_path / "kept" / "other").mkdir(parents=True)
    assert main([*argv, "--out", "kept/new/run"]) == 2
    assert sorted(os.listdir(tmp_path / "kept")) == ["other"]


@pytest.mark.parametrize("argv, named", [
    (["train", "--data", "c\udcff.txt", "--out", "run"], "--data c\\xff.txt"),
    (["train", "--data", "tiny-shakespeare", "--out", "r\udcff"], "--out r\\xff"),
    (["eval", "r\ud800"], "run_dir r\\ud800"),
    (["export", "run", "--out", "e\udcff"], "--out e\\xff"),
    (["lm-eval", "run", "--tasks", "t", "--output", "o\udcff.json"], "--output o\\xff.json"),
    (["plot", "ok", "c\udcff"], "compare_dir c\\xff"),
    # --set values (a comparison trained, then failed writing results.md), and lm-eval's model directory
    (["compare", "--recipe", "cpu-char", "--set", "data=sp\udcff", "--out", "c"], "--set data=sp\\xff"),
    (["lm-eval", "m\udcff", "--tasks", "t"], "model m\\xff"),
])
def test_a_path_whose_name_is_not_utf8_is_one_line(tmp_path, monkeypatch, capsys, argv, named):
    """A file or folder name that is no UTF-8 (a byte of another encoding, which Python keeps as a surrogate) ended in a
    UnicodeEncodeError traceback where gbattn wrote it into a results file, a figure or an export, some after the
    training had run: refused up front, naming it with the bytes escaped, and nothing written."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, argv)
    assert (code, out) == (2, "")
    at = len(named.split()[-1].split("\\")[0]) + 1  # the character escaped
    assert err == (f"gbattn: error: {named}: not UTF-8 (character {at}): gbattn writes paths and settings into its "
                   f"results as UTF-8 text; rename the file or folder, or type the value again\n")
    assert list(tmp_path.iterdir()) == []


def test_a_quoted_tilde_in_a_path_argument_is_the_home_directory(tmp_path, monkeypatch, capsys):
    """`--out "~/runs/a"` (a ~ the shell left, as --data takes it) made a folder named ~ in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    code, _, err = run_cli(capsys, ["train", "--data", "tiny-shakespeare", "--preset", "cpu-char", "--out", "~/runs/a",
                                    "--set", "max_steps=1", "--set", "eval_every=1", "--set", "n_layers=1",
                                    "--set", "d_model=16", "--set", "n_heads=1", "--set", "batch_size=2",
                                    "--set", "eval_tokens=200", "--threads", "1", "--quiet"])
    assert code == 0, err
    assert (home / "runs" / "a" / "result.json").is_file() and list(work.iterdir()) == []
    code, out, err = run_cli(capsys, ["eval", "~/runs/a", "--threads", "1"])
    assert code == 0 and out.startswith("test perplexity"), err
    # --set init_from= too (it was refused where --init-from took it), and analyze's --against
    code, _, err = run_cli(capsys, ["train", "--set", "init_from=~/runs/a", "--out", "~/runs/b", "--set", "max_steps=1",
                                    "--set", "batch_size=2", "--set", "eval_tokens=200", "--threads", "1", "--quiet"])
    assert code == 0 and (home / "runs" / "b" / "result.json").is_file(), err
    code, _, err = run_cli(capsys, ["analyze", "~/runs/b", "--against", "~/runs/a", "--max-rows", "1", "--quiet",
                                    "--threads", "1"])
    assert code == 0 and (home / "runs" / "b" / "analysis" / "summary.json").is_file(), err
    assert list(work.iterdir()) == []


def test_a_set_path_value_has_its_tilde_expanded_as_the_set_parser_reads_it(monkeypatch):
    """--set init_from=~/x is the home directory's x however the value is spelt (spaces around it, quotes: parse_sets
    leaves them out, and the ~ was kept), and an item without '=' stays parse_sets' to refuse (it was made
    'init_from=', refused as an empty value rather than as no key=value)."""
    import os

    from gbattn.cli import _home, _home_set

    monkeypatch.setenv("HOME", "/home/me")
    for item in ("init_from=~/base", "init_from= ~/base ", 'init_from="~/base"', "init_from='~/base'"):
        assert _home_set(item) == "init_from=/home/me/base", item
    assert _home_set("init_from = ~/base") == "init_from =/home/me/base"  # (spaces around the key: parse_sets's)
    assert _home_set("init_from=~") == "init_from=/home/me"  # the home directory itself, and another user's
    assert _home("~") == "/home/me" and _home("~root/runs") == os.path.expanduser("~root/runs") != "~root/runs"
    for item in ("init_from", "init_from=runs/~x", "lr=~1", "data=~/d.txt"):  # (data: the corpus reads its own ~)
        assert _home_set(item) == item


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full is Linux's")
def test_a_stderr_that_refuses_writes_loses_no_result_and_keeps_the_exit_status(tmp_path):
    """stderr on a full disk (`2>/dev/full`, a terminal gone after a hangup): a note before the work (greedy
    decoding's, --threads past the cores) ended `generate` and `train` with status 1 and nothing done, and a
    one-line error's status 2 became 1. Notes and errors that cannot be written are dropped; the work and the
    status stay."""
    from gbattn.train.trainer import train
    from helpers import tiny_configs, write_corpus

    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=2, eval_every=2, threads=1), quiet=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    gbattn = [sys.executable, "-m", "gbattn"]
    with open("/dev/full", "w") as full:
        def run(*argv):
            return subprocess.run([*gbattn, *map(str, argv)], stdout=subprocess.PIPE, stderr=full, text=True, env=env,
                                  timeout=600)

        made = run("generate", tmp_path / "run", "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0",
                   "--top-k", "5", "--no-compile")  # (the note: greedy decoding ignores --top-k)
        assert made.returncode == 0 and made.stdout.startswith("ab"), made
        trained = run("train", "--out", tmp_path / "more", "--data", data, "--tokenizer", "char", "--quiet",
                      "--threads", "512", "--set", "max_steps=2", "--set", "n_layers=1", "--set", "d_model=16",
                      "--set", "n_heads=2")
        assert trained.returncode == 0 and (tmp_path / "more" / "result.json").is_file(), trained
        assert run("eval", tmp_path / "nowhere").returncode == 2
