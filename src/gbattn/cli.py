"""``gbattn <command>``: the command-line interface.

User mistakes (bad options, missing data, broken checkpoints) print one line to stderr and
exit with status 2; tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import json
import sys

from gbattn.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and status 2."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"gbattn: error: {message} (see: {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser, preset_default: str | None = "paper-small") -> None:
    """--attn, --residual and --set, shared by every command that builds a model."""
    p.add_argument("--attn", default="standard", help="attention variant (see `gbattn list`)")
    p.add_argument("--residual", default=None, help="residual stream: plain, attnres-full or attnres-block")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set d_model=288 --set attn.rounds=3 --set attn.gate=mlp",
    )


def model_config_from_args(args):
    from gbattn.config import parse_sets, preset_config

    overrides = parse_sets(args.sets)
    if getattr(args, "residual", None):
        overrides["residual"] = args.residual
    return preset_config(args.preset, args.attn, overrides)


# --------------------------------------------------------------------------------------
# list / params
# --------------------------------------------------------------------------------------


def cmd_list(args) -> None:
    from gbattn.attention.registry import describe_variants
    from gbattn.config import PRESETS

    print("Attention variants (--attn NAME, options with --set attn.KEY=VALUE):")
    for row in describe_variants():
        print(f"  {row['name']:<13} {row['description']}")
        for key, default in row["options"].items():
            print(f"  {'':<13}   attn.{key} (default {json.dumps(default)})")
    print("\nPresets (PRESET):")
    for name, p in PRESETS.items():
        print(
            f"  {name:<13} d_model {p['d_model']}, {p['n_layers']} layers, {p['n_heads']} heads, "
            f"block_size {p['block_size']}, vocab {p['vocab_size']}, dropout {p['dropout']}"
        )
    print("\nResidual streams (--residual): plain (default), attnres-full, attnres-block (--set attnres_block=S)")
    from gbattn.experiments.recipes import RECIPES

    print("\nComparison recipes (gbattn compare --recipe NAME):")
    for name, r in RECIPES.items():
        print(f"  {name:<13} {r.description}")


def cmd_params(args) -> None:
    from gbattn.model import count_params, flops_per_token, param_matched_width

    cfg = model_config_from_args(args)
    n = count_params(cfg)
    flops = flops_per_token(cfg)
    out = {"preset": args.preset, "attn": cfg.attn, "attn_options": cfg.attn_options, "residual": cfg.residual,
           "d_model": cfg.d_model, "parameters": n, "forward_flops_per_token": flops, "seq_len": cfg.block_size}
    opts = ", ".join(f"{k}={v}" for k, v in cfg.attn_options.items())
    print(f"{args.preset} · attn={cfg.attn}{f' ({opts})' if opts else ''} · residual={cfg.residual} · d_model={cfg.d_model}")
    print(f"parameters:                {n:,}")
    print(f"forward FLOPs per token:   {flops / 1e6:,.2f} M  (torch.utils.flop_counter, T={cfg.block_size})")
    if args.fair:
        width, n_fair = param_matched_width(cfg, n)
        fair_cfg = cfg.replace(attn="standard", attn_options={}, d_model=width)
        fair_flops = flops_per_token(fair_cfg)
        print(f"parameter-matched standard: d_model={width}, {n_fair:,} parameters "
              f"({100 * (n_fair / n - 1):+.2f}%), {fair_flops / 1e6:,.2f} M FLOPs per token")
        out.update(fair_width=width, fair_parameters=n_fair, fair_forward_flops_per_token=fair_flops)
    if args.json:
        print(json.dumps(out))


# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from gbattn import __version__

    parser = _Parser(prog="gbattn", description="Gradient-boosted attention: models, training, reproduction, analysis.")
    parser.add_argument("--version", action="version", version=f"gbattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("list", help="attention variants with their options, presets and residual streams")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("params", help="parameter count and forward FLOPs per token of a model")
    p.add_argument("preset", help="a preset name (see `gbattn list`)")
    add_model_args(p)
    p.add_argument("--fair", action="store_true", help="also the parameter-matched standard width and its count")
    p.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    p.set_defaults(func=cmd_params)

    for register in _command_modules():
        register(sub)
    return parser


def _command_modules():
    """Commands defined next to the code they drive (each module has ``register(subparsers)``)."""
    import importlib

    names = ["gbattn.train.cli", "gbattn.eval.cli", "gbattn.experiments.cli", "gbattn.experiments.denoise",
             "gbattn.analysis.cli", "gbattn.bench.cli"]
    return [importlib.import_module(name).register for name in names]


def main(argv: list[str] | None = None) -> int:
    from gbattn.config import set_invocation

    parser = build_parser()
    args = parser.parse_args(argv)
    set_invocation(sys.argv[1:] if argv is None else argv)
    try:
        args.func(args)
    except UserError as e:
        print(f"gbattn: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("gbattn: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
