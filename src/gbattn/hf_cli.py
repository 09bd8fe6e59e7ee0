"""``gbattn export`` and ``gbattn lm-eval`` (the transformers and lm-evaluation-harness extras)."""

from __future__ import annotations

from gbattn import arguments


def register(sub) -> None:
    p = sub.add_parser("export", help="write a run as a Hugging Face model directory (safetensors, config, tokenizer)")
    p.add_argument("run_dir", help="a run directory (or an exported directory)")
    p.add_argument("--out",
                   required=True, help="the directory to write (AutoModelForCausalLM loads it after "
                   "`import gbattn.hf`)")
    arguments.checkpoint(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on a run or an exported directory")
    p.add_argument("model", help="a run directory or a directory written by `gbattn export`")
    p.add_argument("--tasks", required=True, help="comma-separated task names, e.g. hellaswag,piqa")
    p.add_argument("--include-path", default=None,
                   help="a directory of extra task YAML files (default: none, the harness's own tasks only)")
    p.add_argument("--limit", type=float, default=None,
                   help="at most N documents per task (a fraction < 1: that share of each task; default: every "
                   "document)")
    p.add_argument("--num-fewshot", type=arguments.at_least(0), default=None,
                   help="solved examples put before each question (default: each task's own setting)")
    p.add_argument("--batch-size", type=arguments.at_least(1), default=8,
                   help="requests per batch of the harness (default %(default)s)")
    p.add_argument("--log-samples", action="store_true", help="also write every document's requests and answers")
    p.add_argument("--output", default=None,
                   help="results file (default MODEL/lm-eval/results-<tasks>[-limitN][-Nshot][-last].json; "
                   "samples-<task>-... beside it)")
    arguments.checkpoint(p)
    arguments.device(p)
    arguments.threads(p)
    p.set_defaults(func=cmd_lm_eval)


def require(module: str, extra: str) -> None:
    """A one-line error when an optional dependency is not installed, or fails to import."""
    from gbattn.errors import optional_module

    optional_module(module, extra, "this command needs")


def cmd_export(args) -> None:
    require("transformers", "transformers")
    require("safetensors", "transformers")
    from gbattn.files import read_json
    from gbattn.hf.export import export_run
    from gbattn.rundir import CONFIG, is_exported
    from gbattn.terminal import printable_text

    exported = is_exported(args.run_dir)
    out = export_run(args.run_dir, args.out, args.checkpoint)
    which = "its weights" if exported else f"{read_json(out / CONFIG)['gbattn']['checkpoint']} weights"
    print(printable_text(f"exported {args.run_dir} ({which}) to {out}; load it with `import gbattn.hf` and "
                         f"AutoModelForCausalLM.from_pretrained({str(out)!r})"))


def cmd_lm_eval(args) -> None:
    from pathlib import Path

    from gbattn.errors import UserError

    require("transformers", "lm-eval")
    require("lm_eval", "lm-eval")
    from gbattn.files import refuse_linked_folder, relative_path
    from gbattn.hf.lmeval import check_file_names, print_tables, results_stem, run_lm_eval, write_results
    from gbattn.rundir import (
        BEST,
        CONFIG,
        LM_EVAL_DIR,
        check_model_dir,
        check_output_file,
        chosen_weights,
        file_identity,
    )
    from gbattn.runtime import command_line, resolve_device, set_threads, software_versions
    from gbattn.terminal import note

    tasks = list(dict.fromkeys(t.strip() for t in args.tasks.split(",") if t.strip()))  # a task named twice: once
    if not tasks:
        raise UserError("--tasks names no task; e.g. --tasks hellaswag,piqa")
    if args.limit is not None and not args.limit > 0:
        raise UserError(f"--limit {args.limit:g} must be > 0")
    if args.limit is not None and args.limit >= 1 and not float(args.limit).is_integer():  # inf: a traceback
        raise UserError(f"--limit {args.limit:g} is not a whole number of documents (a fraction below 1 is a share of "
                        f"each task)")
    model = check_model_dir(args.model)
    checkpoint = args.checkpoint
    weights, which = chosen_weights(model, checkpoint)  # (the weights load_run reads: an export has neither file)
    if which != (checkpoint or "best") and weights.is_file():  # (its results file was named as the best weights')
        checkpoint = which
        note(f"note: {args.model} has no best-validation weights ({BEST}) yet: scoring its last checkpoint")
    stem = results_stem(tasks, args.limit, args.num_fewshot, checkpoint)
    if not args.output:
        refuse_linked_folder(model / LM_EVAL_DIR, "lm-eval's scores", "--output")
    out = Path(args.output) if args.output else model / LM_EVAL_DIR / f"results-{stem}.json"
    check_file_names(out, tasks, args.log_samples)  # (first: a name made of the tasks is told as such)
    check_output_file(args.output or out, "--output")  # (as typed: Path() dropped a trailing slash, and newlm/ was
    # written as a file newlm)
    set_threads(args.threads)
    device = resolve_device(args.device or "auto")
    config_before = file_identity(model / CONFIG)
    results = run_lm_eval(model, tasks, include_path=args.include_path, limit=args.limit, batch_size=args.batch_size,
                          device=device, checkpoint=checkpoint, num_fewshot=args.num_fewshot,
                          log_samples=args.log_samples)
    if file_identity(model / CONFIG) != config_before:  # (an export over it, or train --restart, meanwhile: its
        # scores of the weights read were written after the replacement removed the old ones, labelled as the new's)
        raise UserError(f"{model} was replaced while lm-eval ran (another export, or a restarted or resumed run): "
                        f"its scores are of the weights it read, no longer there, so none are written; run it again")
    # the versions, as train, bench and denoise record them (the harness's pretty_env_info, the machine's description,
    # is left out; the harness records its own and transformers' versions)
    results["gbattn"].update(model=relative_path(model, Path.cwd()), command=command_line(portable=True),
                             versions=software_versions())
    roots = [model.resolve()] + ([Path(args.include_path).resolve()] if args.include_path else [])
    written = write_results(results, out, roots)
    print_tables(results)  # after the files: a reader that left (`| head`) or a stdout that cannot print loses nothing
    print(f"wrote {', '.join(str(p) for p in written)}")
