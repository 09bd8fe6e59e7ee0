"""``gbattn compare``."""

from __future__ import annotations

from gbattn import arguments


def register(sub) -> None:
    from gbattn.experiments.recipes import RECIPES  # plain records: no heavy imports

    p = sub.add_parser("compare", help="train every model of a recipe for every seed; results.json + results.md")
    p.add_argument("--recipe", required=True, help="one of: " + ", ".join(RECIPES))
    p.add_argument(
        "--data", default=None,
        help="the corpus every model trains on (default: the recipe's, e.g. tiny-shakespeare or wikitext-103-raw-v1)"
    )
    p.add_argument("--out",
                   required=True, help="comparison directory (a killed comparison resumes from it)")
    p.add_argument("--seeds", type=arguments.SEED, nargs="+", default=None,
                   help="training seeds, each model trained once per seed (default: the seeds the --out "
                        "comparison holds, or the recipe's for a new one (paper-wt103's: 42 123))")
    p.add_argument("--only", nargs="+", default=None, metavar="LABEL",
                   help="train only these models of the recipe (default: every model)")
    p.add_argument("--model", action="append", default=None, metavar="LABEL=VARIANT[:KEY=VALUE,...]",
                   help="add a model of your own, e.g. --model gba-m4=boosted:rounds=4 (attention options and model "
                        "fields, as `gbattn bench --attn` takes them); repeatable")
    p.add_argument("--matched", nargs="+", action="extend", default=None, metavar="LABEL",
                   help="give these models a parameter-matched (param-fair-LABEL) and a compute-matched "
                        "(compute-matched-LABEL) standard baseline")
    p.add_argument("--residual", default=None,
                   help="residual stream for every model: plain, attnres-full or attnres-block (default: the recipe's)")
    arguments.sets(p, "a model or training field for every run", "--set device=cuda --set lr=1e-3")
    p.add_argument("--jobs", type=arguments.at_least(1), default=1,
                   help="train this many runs at once, as separate processes that divide the CPU threads "
                   "(default %(default)s)")
    p.add_argument("--threads", type=arguments.at_least(1, arguments.MAX_THREADS), default=None,
                   help="CPU threads in all (default: OMP_NUM_THREADS where it is set, else the cores not busy with "
                        "other work; a run resumed from its checkpoint keeps the fewer threads it recorded; README, "
                        "'Threads')")
    arguments.quiet(p, also="nor each run's plan, evaluation or summary lines")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> None:
    from pathlib import Path

    from gbattn.config import TrainConfig, merge_options, parse_sets
    from gbattn.errors import UserError
    from gbattn.experiments.compare import run_compare
    from gbattn.terminal import terminal_text

    # An option and a --set of the same field are one setting (both given and different: an error); --data
    # and --threads are the comparison's own (recorded data, threads in all), checked as their fields are.
    sets = merge_options(parse_sets(args.sets), residual=args.residual, data=args.data, threads=args.threads)
    own = {key: sets.pop(key) for key in ("data", "threads") if key in sets}
    checked = TrainConfig.from_dict(own)
    models: dict[str, str] = {}
    for item in args.model or []:
        label, _, spec = item.partition("=")
        if not spec:
            raise UserError(f"--model {item}: expected LABEL=VARIANT, e.g. --model gba-m4=boosted:rounds=4")
        if models.setdefault(label, spec) != spec:
            raise UserError(f"--model {label}={models[label]} and --model {item} disagree: give one of them")
    report = run_compare(args.recipe, args.out, data=checked.data if "data" in own else None, seeds=args.seeds,
                         sets=sets, only=args.only, quiet=args.quiet, threads=checked.threads, jobs=args.jobs,
                         models=models, matched=args.matched)
    print(terminal_text((Path(args.out) / "results.md").read_text(encoding="utf-8")))  # (its texts read from files)
    if not report["complete"]:
        print("(incomplete: some runs are missing)")
