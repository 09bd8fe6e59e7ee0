"""``gbattn train``."""

from __future__ import annotations

import json

from gbattn.config import parse_sets


def register(sub) -> None:
    p = sub.add_parser("train", help="train one model into a run directory (resumable)")
    p.add_argument("--preset", default="paper-small", help="model preset; its training recipe is the default")
    p.add_argument("--attn", default="standard", help="attention variant (see `gbattn list`)")
    p.add_argument("--residual", default=None, help="residual stream: plain, attnres-full or attnres-block")
    p.add_argument("--data", default=None, help="HF name (wikitext-103-raw-v1, ...), a local directory, or a text file")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tokenizer", default=None, help="bpe (paper), char, gpt2 or gpt2=PATH/tokenizer.json")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model (CUDA)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model or training field: --set lr=1e-3 --set d_model=288 --set attn.rounds=3")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> None:
    from gbattn.train.config import build_configs
    from gbattn.train.trainer import train

    if args.resume:
        result = train(args.out, resume=True, quiet=args.quiet)
    else:
        if not args.data:
            from gbattn.errors import UserError

            raise UserError("--data is required for a new run (an HF name, a local directory or a text file)")
        sets = parse_sets(args.sets)
        if args.residual:
            sets["residual"] = args.residual
        model_cfg, train_cfg = build_configs(
            args.preset, args.attn, args.data, sets, seed=args.seed, tokenizer=args.tokenizer, device=args.device,
            compile=args.compile,
        )
        result = train(args.out, model_cfg, train_cfg, quiet=args.quiet)
    summary = {k: result[k] for k in ("attn", "parameters", "steps", "valid_ppl", "test_ppl", "train_tokens_per_s")}
    print(json.dumps(summary))
