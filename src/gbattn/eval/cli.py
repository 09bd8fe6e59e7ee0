"""``gbattn eval`` and ``gbattn generate``."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a trained run on its valid or test split")
    p.add_argument("run_dir")
    p.add_argument("--split", default="test", choices=["valid", "test"])
    p.add_argument("--checkpoint", default="best", choices=["best", "last"])
    p.add_argument("--per-token", metavar="FILE", help="also write every token's loss (nats) to FILE (.npy or .txt)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> None:
    import numpy as np
    import torch

    from gbattn.eval.load import load_run
    from gbattn.eval.perplexity import evaluate
    from gbattn.train.trainer import prepare_data, resolve_device

    device = resolve_device(args.device)
    run = load_run(args.run_dir, args.checkpoint, device)
    data = prepare_data(run.train_cfg, run.model_cfg.vocab_size, run.tokenizer, progress=False)
    autocast = None
    if device.type == "cuda":
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    res = evaluate(run.model, data.splits[args.split], run.seq_len, args.batch_size, device, autocast,
                   per_token=bool(args.per_token))
    out = {"run_dir": str(run.run_dir), "split": args.split, "checkpoint": args.checkpoint, "step": run.step,
           "loss": res.loss, "ppl": res.ppl, "tokens": res.tokens}
    if args.per_token:
        if args.per_token.endswith(".npy"):
            np.save(args.per_token, res.per_token)
        else:
            np.savetxt(args.per_token, res.per_token, fmt="%.6f")
        out["per_token_file"] = args.per_token
    print(f"{args.split} perplexity {res.ppl:.3f} (loss {res.loss:.4f} nats) over {res.tokens:,} tokens, "
          f"{args.checkpoint} checkpoint at step {run.step}")
    print(json.dumps(out))
