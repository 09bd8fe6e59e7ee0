"""``gbattn compare`` (and ``gbattn denoise`` once registered here)."""

from __future__ import annotations

from gbattn.config import parse_sets


def register(sub) -> None:
    from gbattn.experiments.recipes import RECIPES

    p = sub.add_parser("compare", help="train every model of a recipe for every seed; results.json + results.md")
    p.add_argument("--recipe", required=True, help="one of: " + ", ".join(RECIPES))
    p.add_argument("--data", default=None, help="corpus (default: the recipe's, e.g. wikitext-103-raw-v1)")
    p.add_argument("--out", required=True, help="comparison directory (a killed comparison resumes from it)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the recipe's (paper: 42 123)")
    p.add_argument("--only", nargs="+", default=None, metavar="LABEL", help="train only these models of the recipe")
    p.add_argument("--residual", default=None,
                   help="residual stream for every model: plain, attnres-full or attnres-block (default: the recipe's)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every model, e.g. --set device=cuda --set compile=true")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per run (default: torch's choice, one per core); see README, 'Threads'")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> None:
    from gbattn.experiments.compare import run_compare

    sets = parse_sets(args.sets)
    if args.residual:
        sets["residual"] = args.residual
    report = run_compare(args.recipe, args.out, data=args.data, seeds=args.seeds, sets=sets,
                         only=args.only, quiet=args.quiet, threads=args.threads)
    print((__import__("pathlib").Path(args.out) / "results.md").read_text())
    if not report["complete"]:
        print("(incomplete: some runs are missing)")
