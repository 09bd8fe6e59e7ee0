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

    p = sub.add_parser("generate", help="generate text from a trained run (KV-cached decoding)")
    p.add_argument("run_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--checkpoint", default="best", choices=["best", "last"])
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context at every step")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_generate)


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


def cmd_generate(args) -> None:
    import time

    import torch

    from gbattn.errors import UserError
    from gbattn.eval.generate import generate
    from gbattn.eval.load import load_run
    from gbattn.train.trainer import resolve_device

    device = resolve_device(args.device)
    run = load_run(args.run_dir, args.checkpoint, device)
    ids = run.tokenizer.encode(args.prompt)
    if not ids:
        raise UserError("the prompt encodes to no tokens")
    idx = torch.tensor([ids] * args.num_samples, device=device)
    t0 = time.perf_counter()
    out = generate(run.model, idx, args.max_new_tokens, args.temperature, args.top_k, args.seed, not args.no_cache)
    dt = time.perf_counter() - t0
    for row in out.tolist():
        print(run.tokenizer.decode(row))
        print("---")
    print(f"{args.num_samples} x {args.max_new_tokens} tokens in {dt:.2f} s "
          f"({args.num_samples * args.max_new_tokens / dt:,.0f} tokens/s, {'no cache' if args.no_cache else 'KV cache'})")
