"""``gbattn bench``."""

from __future__ import annotations

from gbattn import arguments
from gbattn.arguments import at_least
from gbattn.bench import DEFAULT_VARIANTS


def register(sub) -> None:
    p = sub.add_parser("bench", help="speed, memory and FLOPs of each variant next to standard (one interleaved run)")
    arguments.preset(p, training=False)
    p.add_argument("--attn", nargs="+", default=None, metavar="VARIANT",
                   help=f"variants, name or name:key=value,... with attention options or model fields, e.g. "
                        f"boosted:rounds=3 or standard:residual=attnres-block (default: "
                        f"{' '.join(DEFAULT_VARIANTS)})")
    arguments.device(p)
    p.add_argument("--batch", type=at_least(1), default=None,
                   help="rows per training step (default 8 on CPU, 32 on CUDA)")
    p.add_argument("--seq-len", type=at_least(1), default=None, help="tokens per row (default block_size - 1)")
    p.add_argument("--repeats", type=at_least(1), default=5,
                   help="interleaved timing rounds, the median reported (default %(default)s)")
    p.add_argument("--steps", type=at_least(1), default=3, help="training steps per timing round (default %(default)s)")
    p.add_argument("--decode", type=at_least(1), default=None,
                   help="cached decode steps after the prefill (default 64, or half the block size when smaller); "
                        "the prefill is up to 128 tokens, within the block size")
    p.add_argument("--sweep", type=at_least(1), nargs="+", default=None, metavar="T",  # a bare --sweep: no sweep
                   help="sequence lengths for the sweep (e.g. 256 512 1024 2048 4096); none by default")
    p.add_argument("--sweep-attn", nargs="+", default=None, metavar="VARIANT",
                   help="variants timed in the --sweep (default: standard boosted)")
    p.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--compile", default="off", choices=["off", "on", "both"],
                   help="torch.compile the training and decode steps: off, on, or both side by side (default off)")
    p.add_argument("--activation-checkpointing", default="off", choices=["off", "on", "both"],
                   help="recompute each block in the training step's backward pass: off, on, or both side by side "
                        "(eager only; default off)")
    arguments.sets(p, "a model field for every variant", "--set d_model=288 (a variant's own options go with it: "
                                                          "--attn boosted:rounds=3)")
    arguments.threads(p)
    p.add_argument("--out", default=None,
                   help="write bench.json and bench.md here (default: none, the table is printed only)")
    arguments.quiet(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> None:
    from gbattn.bench.speed import bench_markdown, run_bench
    from gbattn.config import parse_sets
    from gbattn.runtime import default_threads

    report = run_bench(args.preset or "paper-small", args.attn, args.device or "auto", args.batch, args.seq_len,
                       args.repeats, args.steps, None, args.decode, args.sweep, args.sweep_attn, not args.no_amp,
                       args.compile, args.threads or default_threads(), args.out, args.quiet, parse_sets(args.sets),
                       args.activation_checkpointing)
    print(bench_markdown(report), end="")  # stdout is bench.md, byte for byte (the table ends its own line)
