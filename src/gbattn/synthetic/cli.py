"""``gbattn denoise``."""

from __future__ import annotations

from gbattn import arguments

EXPERIMENTS = ("rounds", "gates", "difficulty", "deq")
FULL_SEEDS = (0, 1, 2)
INITS = ("pytorch", "normal")  # training.INITS, the first the Protocol's default
QUICK_SEEDS = (0,)
# Evaluation queries are drawn and run through the model in one batch: a million at d = 128 through four rounds
# peaked at 3.6 GB of memory (measured); --eval-queries 10**9 was an out-of-memory crash, not a usage error.
MAX_EVAL_QUERIES = 1_000_000


def register(sub) -> None:
    p = sub.add_parser("denoise", help="the paper's synthetic pattern-denoising tables (docs/method.md)",
                       description="Train GBA on the synthetic pattern-denoising task and print the paper's tables "
                       "(rounds, gate ablation, difficulty, DEQ) with chance and the Bayes-optimal ceiling. The full "
                       "run (72 training runs: 3 seeds x 24 models) takes about 40 seconds on one CPU thread; --quick "
                       "(1 seed, 24 runs) about 15 seconds.")
    p.add_argument("--quick", action="store_true",
                   help=f"seed {QUICK_SEEDS[0]} only unless --seeds is given, 1,000 queries per evaluation unless "
                   "--eval-queries is, and 20,000 Bayes queries")
    p.add_argument("--out",
                   default="runs/denoise", help="output directory (default runs/denoise)")
    p.add_argument("--seeds", type=arguments.SEED, nargs="+", default=None,
                   help=f"training seeds, each model trained once per seed (default {list(FULL_SEEDS)}, "
                   f"{list(QUICK_SEEDS)} with --quick)")
    p.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=None,
                   help="the tables to run (default: all)")
    p.add_argument("--steps", type=arguments.at_least(1), default=None,
                   help="training steps per run (default 150, the paper's)")
    p.add_argument("--eval-queries", type=arguments.at_least(1, MAX_EVAL_QUERIES), default=None,
                   help=f"fresh queries per evaluation (default 5000, at most {MAX_EVAL_QUERIES:,}: they are drawn "
                   "and run through the model at once)")
    p.add_argument("--init", choices=INITS, default=INITS[0],
                   help="initialisation of the Linear weights: pytorch (default: nn.Linear's own; no "
                   "initialisation is given for this task) or normal (the language model's N(0, 0.02), zero "
                   "biases; docs/deviations.md, entry 18)")
    p.add_argument("--deq-tol", type=arguments.number_where(lambda t: 0 < t < 1, "a number in (0, 1)"), default=None,
                   help="the DEQ's fixed-point tolerance, relative residual per query (default 1e-5)")
    p.add_argument("--deq-max-iter", type=arguments.at_least(1, 100_000), default=None,
                   help="the DEQ's most fixed-point iterations, forward and adjoint (default 200)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default: the models are tiny), auto (CUDA if available), cuda or cuda:N")
    p.add_argument("--threads", type=arguments.at_least(1, arguments.MAX_THREADS), default=1,
                   help="CPU threads (default 1: the matrices are tiny, more threads only add overhead)")
    arguments.quiet(p)
    p.set_defaults(func=cmd_denoise)


def cmd_denoise(args) -> None:
    from dataclasses import replace
    from pathlib import Path

    from gbattn.errors import UserError
    from gbattn.runtime import command_line, resolve_device, set_threads
    from gbattn.synthetic.tables import run_denoise
    from gbattn.synthetic.task import Protocol

    experiments = args.experiments or list(EXPERIMENTS)
    given = [flag for flag, value in (("--deq-tol", args.deq_tol), ("--deq-max-iter", args.deq_max_iter))
             if value is not None]
    if given and "deq" not in experiments:  # (ignored, and results.md said they were used)
        one = len(given) == 1
        raise UserError(f"{' and '.join(given)} set{'s' if one else ''} the DEQ solver of the deq experiment, which "
                        f"--experiments {' '.join(experiments)} leaves out: add deq, or leave "
                        f"{'it' if one else 'them'} out")
    device = resolve_device(args.device)
    set_threads(args.threads)
    protocol = Protocol()
    seeds = args.seeds or list(FULL_SEEDS)
    if args.quick:
        protocol = replace(protocol, eval_queries=1000, bayes_queries=20_000)
        seeds = args.seeds or list(QUICK_SEEDS)
    if args.steps is not None:
        protocol = replace(protocol, steps=args.steps)
    if args.eval_queries is not None:
        protocol = replace(protocol, eval_queries=args.eval_queries)
    protocol = replace(protocol, init=args.init)
    if args.deq_tol is not None:
        protocol = replace(protocol, deq_tol=args.deq_tol)
    if args.deq_max_iter is not None:
        protocol = replace(protocol, deq_max_iter=args.deq_max_iter)
    report = run_denoise(args.out, experiments, seeds, protocol, str(device), args.quiet,
                         command_line(portable=True))
    print(
        f"Wrote {Path(args.out) / 'results.json'}, results.md"
        + (", rounds.png" if "rounds" in report["tables"] else "")
    )
    print(f"Total wall-clock: {report['wall_seconds']:.0f} s ({report['wall_seconds'] / 60:.1f} min)")
