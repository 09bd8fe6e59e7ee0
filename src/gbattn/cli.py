"""``gbattn <command>``: the command-line interface.

User mistakes (bad options, missing data, broken checkpoints) print one line to stderr and exit
with status 2; tracebacks are kept for bugs. Command modules import their heavy dependencies
(torch, transformers) only when the command runs, so ``gbattn --help`` and ``gbattn list`` start fast.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import sys
import threading

from gbattn import arguments
from gbattn.errors import Interrupted, Terminated, UserError, locale_misread, terminated_handler
from gbattn.parent_death import stop_with_parent
from gbattn.terminal import ForgivingStream, note, terminal_line

COMMAND_MODULES = ["gbattn.train.cli", "gbattn.eval.cli", "gbattn.hf_cli", "gbattn.experiments.cli",
                   "gbattn.synthetic.cli", "gbattn.analysis.cli", "gbattn.bench.cli", "gbattn.upcycle"]


def model_config_from_args(args):
    from gbattn.config import merge_options, parse_sets, preset_config

    overrides = merge_options(parse_sets(args.sets), attn=args.attn, residual=args.residual)
    return preset_config(args.preset or "paper-small", overrides.pop("attn", "standard"), overrides)


def cmd_list(args) -> None:
    from gbattn.attention.registry import describe_variants
    from gbattn.config import PRESETS
    from gbattn.experiments.recipes import RECIPES

    print("Attention variants (--attn NAME, options with --set attn.KEY=VALUE):")
    for row in describe_variants():
        print(f"  {row['name']:<13} {row['description']}")
        for key, default in row["options"].items():  # (the values of a choice too: the README alone listed them)
            choices = f"; one of {', '.join(row['choices'][key])}" if key in row["choices"] else ""
            print(f"  {'':<13}   attn.{key} (default {json.dumps(default)}{choices})")
    print("\nPresets (--preset NAME):")
    for name, p in PRESETS.items():
        m = p.model
        kv = f"/{m['n_kv_heads']} kv" if m.get("n_kv_heads") else ""
        print(f"  {name:<13} d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']}{kv} heads, "
              f"block_size {m['block_size']}, vocab {m['vocab_size']}, dropout {m['dropout']}: {p.description}")
    print("\nResidual streams (--residual): plain (default), attnres-full, attnres-block (--set attnres_block=S)")
    print("\nComparison recipes (gbattn compare --recipe NAME):")
    width = max(map(len, RECIPES))
    for name, r in RECIPES.items():
        print(f"  {name:<{width}}  {r.description}")


def cmd_params(args) -> None:
    from gbattn.model import count_params, flops_per_token, param_matched_width
    from gbattn.terminal import in_millions

    if args.preset is not None and "=" in args.preset:  # `--set d_model=64 n_heads=2`: the positional took the second
        raise UserError(f"{args.preset!r} is not a preset; each --set takes one KEY=VALUE: --set {args.preset}")
    if args.preset_option is not None:  # `params --preset X`, as `train --preset X`
        if args.preset is not None and args.preset != args.preset_option:
            raise UserError(f"the preset {args.preset} and --preset {args.preset_option} disagree: give one")
        args.preset = args.preset_option
    cfg = model_config_from_args(args)
    preset = args.preset or "paper-small"
    n = count_params(cfg)
    flops = flops_per_token(cfg)
    out = {"preset": preset, "attn": cfg.attn, "attn_options": cfg.attn_options, "residual": cfg.residual,
           "d_model": cfg.d_model, "parameters": n, "forward_flops_per_token": flops,
           "flops_seq_len": cfg.block_size}  # (the length T the FLOPs are counted at; training's seq_len is T - 1)
    opts = ", ".join(f"{k}={v}" for k, v in cfg.attn_options.items())
    print(f"{preset} · attn={cfg.attn}{f' ({opts})' if opts else ''} · residual={cfg.residual} · d_model={cfg.d_model}")
    print(f"parameters:                {n:,}")
    print(f"forward FLOPs per token:   {in_millions(flops)} M  (torch.utils.flop_counter, T={cfg.block_size})")
    if args.fair:
        width, n_fair = param_matched_width(cfg, n)
        fair_flops = flops_per_token(cfg.replace(attn="standard", attn_options={}, d_model=width))
        print(f"parameter-matched standard: d_model={width}, {n_fair:,} parameters "
              f"({100 * (n_fair / n - 1):+.2f}%), {in_millions(fair_flops)} M FLOPs per token")
        out.update(fair_width=width, fair_parameters=n_fair, fair_forward_flops_per_token=fair_flops)
    if args.json:
        print(json.dumps(out))


def build_parser() -> arguments.Parser:
    from gbattn import __version__

    parser = arguments.Parser(prog="gbattn", description="Gradient-boosted attention (arXiv 2604.03190): models, "
                              "training, reproduction of the paper's tables, analysis, export and benchmarks.")
    parser.add_argument("--version", action="version", version=f"gbattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=arguments.Parser)

    what = "attention variants with their options, presets, residual streams, recipes"
    p = sub.add_parser("list", help=what, description=f"List the {what}.")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("params", help="parameter count and forward FLOPs per token of a model")
    p.add_argument("preset", nargs="?", default=None, help="a preset name (see `gbattn list`; default paper-small)")
    p.add_argument("--preset", dest="preset_option", metavar="PRESET", default=None,
                   help="the preset given as train and bench take it (default paper-small)")
    arguments.model(p, training=False)
    p.add_argument("--fair", action="store_true", help="also the parameter-matched standard width and its count")
    p.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    p.set_defaults(func=cmd_params)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _interrupted_while_starting(signum, frame) -> None:
    note("gbattn: interrupted")
    os._exit(130)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# The commands that may run under torchrun: train on every process; compare refuses it in its own words
# (--jobs N). Every other command would run whole in each process, each writing the same outputs.
UNDER_TORCHRUN = ("train", "compare")

CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"
NUMPY_ARRAY_TOO_BIG = "array is too big"  # numpy's ValueError for an array past the largest it makes
SYMLINK_LOOP = "Symlink loop from "  # Python 3.11-3.12 Path.resolve() raises RuntimeError (3.13: OSError, ELOOP)


def show_tracebacks() -> bool:
    """``GBATTN_DEBUG=1``: an error ends in its Python traceback instead of the one line (README, "Trust")."""
    return os.environ.get("GBATTN_DEBUG", "") not in ("", "0")


def _usable_standard_streams() -> None:
    """The program's stdout and stderr as it can always write them: a closed one (``gbattn list >&-``: Python's None)
    goes to the null device, and a character stdout's encoding lacks (``PYTHONIOENCODING=ascii``, ``LC_ALL=C`` without
    UTF-8 mode) is written escaped, as stderr writes it; each was a traceback (after the work: lm-eval's results)."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 (for the process's life)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")


# The arguments that name files and folders (positional or not), of every command (``model``: lm-eval's, and
# compare's --model specs; ``against``: analyze's run, and plot's labels), and the --set keys that do
PATH_ARGUMENTS = ("against", "compare_dir", "data", "include_path", "init_from", "model", "out", "output", "per_token",
                  "run_dir", "source", "tokenizer")
PATH_SETS = ("init_from",)


def _utf8_or_refused(name: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        try:  # a byte of another encoding shown as \xff, a lone surrogate as \ud800
            shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            shown = value.encode("utf-8", "backslashreplace").decode()
        raise UserError(f"{name} {shown}: not UTF-8 (character {e.start + 1}): gbattn writes paths and settings "
                        f"into its results as UTF-8 text; "
                        f"{locale_misread(value) or 'rename the file or folder, or type the value again'}") from None


def _home(value):
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


def _home_set(item):
    """``--set KEY=~/path`` of a path key (PATH_SETS) with its ``~`` expanded, as parse_sets reads the value: spaces
    around it and one pair of quotes left out; any other item as given (one without ``=`` is parse_sets' to refuse)."""
    key, equals, value = item.partition("=") if isinstance(item, str) else ("", "", "")
    bare = value.strip()
    if len(bare) > 1 and bare[0] == bare[-1] and bare[0] in "\"'":
        bare = bare[1:-1]
    return f"{key}={os.path.expanduser(bare)}" if equals and key.strip() in PATH_SETS and bare.startswith("~") else item


def _checked_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The path arguments: a quoted ``~`` (which the shell left) is the home directory, as ``--data`` always took it
    (``--out "~/runs/a"`` made a folder ``./~/runs/a``); a name that is no UTF-8 (a byte of another encoding, kept by
    Python as a surrogate) is one line: gbattn writes folder names into its results files, figures and exports as
    UTF-8, and each failed with a UnicodeEncodeError traceback, some after the training had run. So is a --set value
    (``--set data=...``, ``tokenizer=hf=...``)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in commands.choices[args.command]._actions:
        values = getattr(args, action.dest, None)
        if action.dest == "sets" and isinstance(values, list):
            values = [_home_set(item) for item in values]
            setattr(args, action.dest, values)
            for item in values:
                if isinstance(item, str):
                    _utf8_or_refused(action.option_strings[-1], item)
            continue
        if action.dest not in PATH_ARGUMENTS:
            continue
        if action.dest not in ("tokenizer", "data"):  # (a tokenizer's KIND=PATH and --data read their ~ themselves)
            values = [_home(v) for v in values] if isinstance(values, list) else _home(values)
            setattr(args, action.dest, values)
        name = action.option_strings[-1] if action.option_strings else (action.metavar or action.dest)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str):
                _utf8_or_refused(name, value)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (a Python caller's streams are the caller's)
        _usable_standard_streams()
    if "LOCAL_RANK" in os.environ:  # a torchrun worker: torchrun killed while it imported torch left it waiting
        stop_with_parent()  # for torchrun's store for 30 minutes, when it asked for this on joining the processes
    parser = build_parser()
    args = parser.parse_args(argv)  # --help and usage errors end here, before anything heavy is imported
    # Ctrl-C while torch is imported: torch's import can swallow the KeyboardInterrupt (the command
    # then ran to its end) or fail oddly, and nothing has started yet, so leave at once (unless this
    # process was started with SIGINT ignored, as a shell's background job is: it stays ignored).
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    previous = signal.signal(signal.SIGINT, _interrupted_while_starting) if _main_thread() and not ignored else None
    import torch

    from gbattn.runtime import launched_processes, set_invocation

    if previous is not None:
        signal.signal(signal.SIGINT, previous)
    # SIGTERM (a job scheduler's stop, `kill`) ends the command as Ctrl-C does, with one line and status 143,
    # where the default handler ended it at once, silently (a training loop checkpoints first, on its own).
    # Only as the program itself (argv from the command line): a Python caller of main() keeps SIGTERM's meaning
    # (a test run stopped by its timeout must stop, not go on to its next test). A SIGTERM the process was started
    # with ignored, or a handler of its caller's, stays; so does torchrun's (it terminates every process when one
    # fails, and its processes must not wait on each other then).
    term_default = (argv is None and _main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
                    and "LOCAL_RANK" not in os.environ)
    if term_default:
        signal.signal(signal.SIGTERM, terminated_handler())
    set_invocation(sys.argv[1:] if argv is None else argv)
    try:
        _checked_paths(parser, args)
        processes = launched_processes()
        if processes > 1 and args.command not in UNDER_TORCHRUN:
            raise UserError(f"gbattn {args.command} runs in one process, not under torchrun ({processes} "
                            f"processes here): only gbattn train runs on several")
        args.func(args)
        sys.stdout.flush()
    # A mistake, or a stop where nothing is lost (Interrupted: what was kept, and how to continue). One write:
    # torchrun's processes write unbuffered (-u) to one stderr, at once.
    except (UserError, Interrupted) as e:
        if show_tracebacks():
            raise
        note(f"gbattn: error: {terminal_line(str(e))}")
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt as e:
        note(f"gbattn: {'terminated' if isinstance(e, Terminated) else 'interrupted'}")
        return 143 if isinstance(e, Terminated) else 130
    except (MemoryError, RuntimeError, ValueError) as e:  # sizes a machine cannot hold (batch, width, samples)
        from gbattn.runtime import compile_failure

        failed = compile_failure(e)  # (a traceback of a hundred lines, from inductor's C++ compiler check)
        if failed and not show_tracebacks():
            # (a comparison's run trains in a `train` of its own under --jobs: its way named too)
            off = {"compare": "--set compile=false", "train": "--no-compile; a comparison's: --set compile=false"}.get(
                args.command, "--no-compile")
            note(f"gbattn: error: {terminal_line(failed)[:300]}: run without compiling ({off}); on a CPU it needs "
                 f"a working C++ compiler (README, \"Compiled vs eager\")")
            return 2
        if str(e).startswith(SYMLINK_LOOP) and not show_tracebacks():  # Path.resolve() of links to each other
            note(f"gbattn: error: {terminal_line(str(e))}: links that lead back to each other name no file or "
                 f"folder; remove one of them")
            return 2
        # torch.OutOfMemoryError on CUDA; on CPU the allocator raises a plain RuntimeError, and numpy a ValueError
        # for an array past its largest size (batch_size=2**62 windows), before it asks for the memory
        if (not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and CPU_ALLOCATION_FAILED not in str(e)
                and not (isinstance(e, ValueError) and str(e).startswith(NUMPY_ARRAY_TOO_BIG)) or show_tracebacks()):
            raise
        detail = terminal_line(str(e))[:200]
        note(f"gbattn: error: out of memory{f' ({detail})' if detail else ''}: choose smaller sizes (batch_size, "
             f"seq_len, d_model, --num-samples, ...)")
        return 2
    except BrokenPipeError:  # `gbattn ... | head`: the reader left; end quietly, with SIGPIPE's status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # what the file system refused where no check named it (a name too long, a full disk, ...)
        if show_tracebacks():
            raise
        # both names of a rename (atomic_write's temporary file -> the file it replaces, e.g. a directory)
        names = " -> ".join(str(name) for name in (e.filename, e.filename2) if name is not None)
        where = f"{names}: " if names else ""
        note(f"gbattn: error: {terminal_line(where + (e.strerror or str(e)))}")
        return 2
    finally:
        if term_default:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0


def run() -> None:
    """The ``gbattn`` program (its console script, ``python -m gbattn`` and ``python -m gbattn.cli``): :func:`main`
    on the command line's arguments, then the process ends with its status. Before it ends, ``gc.freeze()``: the
    interpreter's last garbage collections went over every object of torch and its compiler's modules, about 0.7 s
    of CPU at every exit of a command that trained. stderr drops what it cannot write (:class:`ForgivingStream`)."""
    if sys.stderr is not None and not isinstance(sys.stderr, ForgivingStream):
        sys.stderr = ForgivingStream(sys.stderr)
    code = main()
    gc.freeze()
    sys.exit(code)


def run_script(script_main) -> None:
    """A script of ``scripts/`` run as a command runs: a mistake (a :class:`UserError`: bad data, a bad preset or
    variant) is one line on stderr naming the script, exit status 2, not a traceback."""
    try:
        script_main()
    except UserError as e:
        if show_tracebacks():
            raise
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {terminal_line(str(e))}\n")
        sys.exit(2)


if __name__ == "__main__":
    run()
