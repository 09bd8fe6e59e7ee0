"""How close compiled decoding is to the least a decode step can cost on this machine (README, "Compiled vs eager").

    python scripts/decode_floor.py [--preset paper-small] [--attn standard boosted] [--repeats 7] [--decode 64]

At batch 1 a cached decode step multiplies one vector by every weight matrix of the model (the output layer, and
each layer's projections, FFN and gate), so it reads every weight once. This script times, in the same interleaved
repeats and threads: eager decoding and compiled decoding as ``gbattn bench --compile both`` does (a 128-token
prefill, then ``--decode`` cached steps, batch 1, float32), and the *weight-read floor*, one compiled function
that does nothing but those vector-matrix products, once each (position and token lookups are not products and
are left out). Eager time over the floor is the most any compiled step can
gain in float32 on this machine; compiled time over the floor is what it leaves on the table. The last column is
the cost of calling a compiled function at all (dynamo's guards and the runtime wrapper), timed on one that adds 1
to a 4-element tensor; a compiled decode step pays it once per token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from gbattn.arguments import at_least
from gbattn.bench.speed import parse_variant, prefill_and_decode
from gbattn.cli import run_script
from gbattn.config import preset_config
from gbattn.errors import UserError
from gbattn.model.decoding import compiled_decode_step
from gbattn.model.gpt import GPT


def weight_matrices(model: GPT) -> list[torch.Tensor]:
    """Every matrix a batch-1 decode step multiplies a vector by: each Linear's weight, the output layer's included
    (tied or not; the token and position embeddings are lookups)."""
    return [module.weight for module in model.modules() if isinstance(module, nn.Linear)]


def weight_read_floor(model: GPT):
    """A compiled function doing one vector-matrix product with every matrix of :func:`weight_matrices`."""
    matrices = weight_matrices(model)
    vectors = [torch.randn(1, w.shape[1]) for w in matrices]

    def products() -> list[torch.Tensor]:
        return [F.linear(x, w) for x, w in zip(vectors, matrices)]

    compiled = torch.compile(products, options={"cpp_wrapper": True}, fullgraph=True, dynamic=False)
    compiled()
    return compiled, sum(w.numel() for w in matrices)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", default="paper-small")
    parser.add_argument("--attn", nargs="+", default=["standard", "boosted"],
                        help="variants, name or name:key=value,... as gbattn bench takes")
    parser.add_argument("--repeats", type=at_least(1), default=7, help="interleaved rounds, the median reported")
    parser.add_argument("--decode", type=at_least(1), default=64, help="cached decode steps per round")
    parser.add_argument("--threads", type=at_least(1), default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    tiny = torch.zeros(4)
    call = torch.compile(lambda x: x + 1, options={"cpp_wrapper": True}, fullgraph=True, dynamic=False)
    call(tiny)
    call_ms: list[float] = []
    cases = {}
    for spec in args.attn:
        torch.manual_seed(0)
        name, options = parse_variant(spec)
        model = GPT(preset_config(args.preset, name, {f"attn.{k}": v for k, v in options.items()})).eval()
        if args.decode >= model.cfg.block_size:  # (a prompt of no tokens: "negative dimension", a traceback)
            raise UserError(f"--decode {args.decode}: a prompt and its cached steps fit in {args.preset}'s "
                            f"block_size of {model.cfg.block_size}; give at most {model.cfg.block_size - 1}")
        prefill = min(128, model.cfg.block_size - args.decode)
        prompt = torch.randint(0, model.cfg.vocab_size, (1, prefill))
        with torch.no_grad():
            floor, n_weights = weight_read_floor(model)
            step = compiled_decode_step(model)
            prefill_and_decode(model, prompt, args.decode, device, torch.no_grad, step)  # compiles the step
        cases[spec] = dict(model=model, prompt=prompt, step=step, floor=floor, weights=n_weights,
                           eager=[], compiled=[], floor_ms=[])
    for _ in range(args.repeats):
        for case in cases.values():
            _, eager_s = prefill_and_decode(case["model"], case["prompt"], args.decode, device, torch.no_grad)
            _, compiled_s = prefill_and_decode(case["model"], case["prompt"], args.decode, device, torch.no_grad,
                                               case["step"])
            with torch.no_grad():
                start = time.perf_counter()
                for _ in range(args.decode):
                    case["floor"]()
                floor_s = time.perf_counter() - start
            case["eager"].append(eager_s / args.decode * 1e3)
            case["compiled"].append(compiled_s / args.decode * 1e3)
            case["floor_ms"].append(floor_s / args.decode * 1e3)
        start = time.perf_counter()
        for _ in range(args.decode):
            call(tiny)
        call_ms.append((time.perf_counter() - start) / args.decode * 1e3)
    threads = f"{args.threads} thread{'s' if args.threads != 1 else ''}"
    print(f"Decode step vs its weight-read floor, {args.preset}, batch 1, float32, {threads}, "
          f"median of {args.repeats} interleaved rounds of {args.decode} steps\n")
    print("| variant | weights read | eager (ms/token) | compiled (ms/token) | floor (ms/token) | compiled speedup "
          "| most a compiled step can gain (eager / floor) | compiled / floor | calling a compiled function (ms) |")
    print("| --- |" + " ---: |" * 8)
    for spec, case in cases.items():
        eager, compiled, floor = (statistics.median(case[k]) for k in ("eager", "compiled", "floor_ms"))
        print(f"| {spec} | {case['weights']:,} | {eager:.3f} | {compiled:.3f} | {floor:.3f} | {eager / compiled:.2f}x "
              f"| {eager / floor:.2f}x | {compiled / floor:.2f}x | {statistics.median(call_ms):.3f} |")


if __name__ == "__main__":
    run_script(main)
