"""``gbattn bench``."""

from __future__ import annotations

from gbattn.arguments import at_least, directory

DEFAULT_VARIANTS = ["standard", "boosted", "boosted:kv_source=shared", "twicing", "gated", "differential"]


def register(sub) -> None:
    p = sub.add_parser("bench", help="speed, memory and FLOPs of each variant next to standard (one interleaved run)")
    p.add_argument("--preset", default="paper-small")
    p.add_argument("--attn", nargs="+", default=None, metavar="VARIANT",
                   help=f"variants, name or name:key=value,... (default: {' '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch", type=at_least(1), default=None,
                   help="rows per training step (default 8 on CPU, 32 on CUDA)")
    p.add_argument("--seq-len", type=at_least(1), default=None, help="tokens per row (default block_size - 1)")
    p.add_argument("--repeats", type=at_least(1), default=5, help="interleaved timing rounds (median reported)")
    p.add_argument("--steps", type=at_least(1), default=3, help="training steps per timing round")
    p.add_argument("--decode", type=at_least(1), default=None,
                   help="cached decode steps after the prefill (default 64, or half the block size when smaller); "
                        "the prefill is up to 128 tokens, within the block size")
    p.add_argument("--sweep", type=at_least(1), nargs="*", default=None, metavar="T",
                   help="sequence lengths for the sweep (e.g. 256 512 1024 2048 4096); none by default")
    p.add_argument("--sweep-attn", nargs="+", default=None, metavar="VARIANT", help="default: standard boosted")
    p.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--compile", default="off", choices=["off", "on", "both"],
                   help="torch.compile the training and decode steps: off, on, or both side by side (default off)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="model-config override for every variant, e.g. --set dropout=0")
    p.add_argument("--threads", type=at_least(1), default=None, help="CPU threads (default: torch's, one per core)")
    p.add_argument("--out", type=directory, default=None, help="write bench.json and bench.md here")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> None:
    from gbattn.bench.speed import bench_markdown, run_bench
    from gbattn.config import parse_sets

    report = run_bench(args.preset, args.attn, args.device, args.batch, args.seq_len, args.repeats, args.steps,
                       None, args.decode, args.sweep, args.sweep_attn, not args.no_amp, args.compile, args.threads,
                       args.out, args.quiet, parse_sets(args.sets))
    print(bench_markdown(report))
