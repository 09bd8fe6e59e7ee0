"""Count the kernels a compiled decode step calls, per variant (README, "Compiled vs eager").

    python scripts/decode_kernels.py [--preset paper-small] [--attn standard boosted]

Compiles gbattn's one-token cached forward (gbattn.model.decoding) with inductor on the CPU, without the C++
wrapper so that the generated Python shows each call, and counts the calls in it: matrix products (extern
kernels), attention kernels and inductor's own fused kernels. At batch 1 a small model's step is bound by how
many kernels it runs; CUDA graphs remove their launch cost, not their count. The CUDA code inductor writes for the
same graph differs in how it fuses (Triton, not C++), so these counts are the CPU's.
"""

from __future__ import annotations

import argparse
import re

import torch
from torch._inductor.utils import run_and_get_code

from gbattn.bench.speed import parse_variant
from gbattn.cli import run_script
from gbattn.config import preset_config
from gbattn.model.decoding import eager_decode_step
from gbattn.model.gpt import GPT

KINDS = {
    "matrix products": re.compile(r"\bextern_kernels\.(?:mm|addmm|bmm|baddbmm)\("),
    "attention": re.compile(r"torch\.ops\.aten\._scaled_dot_product_\w+\.default\("),
    "fused (inductor)": re.compile(r"\bcpp_fused_\w+\("),
}


def count_calls(source: str) -> dict[str, int]:
    """Calls of each kind in the ``call`` function of inductor's generated wrapper."""
    body = source.split("def call(", 1)[1].split("\ndef ", 1)[0]
    return {kind: len(pattern.findall(body)) for kind, pattern in KINDS.items()}


def decode_step_kernels(preset: str, spec: str) -> dict[str, int]:
    """Kernel calls of one compiled decode step of variant ``spec`` (``name`` or ``name:key=value,...``, as
    ``gbattn bench --attn`` takes)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    name, options = parse_variant(spec)
    model = GPT(preset_config(preset, name, {f"attn.{key}": value for key, value in options.items()})).eval()
    model.setup_cache(1, max_len=16)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), input_pos=torch.arange(8))
        # compiled_decode_step's graph and options (in-place buffer reuse off), but without its C++ wrapper on a CPU,
        # which would hide the calls from the generated Python
        step = torch.compile(eager_decode_step(model), options={"inplace_buffers": False}, fullgraph=True,
                             dynamic=False)
        _, sources = run_and_get_code(step, torch.zeros(1, 1, dtype=torch.long), torch.arange(8, 9), None, None)
    counts = count_calls(sources[-1])
    counts["all"] = sum(counts.values())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", default="paper-small")
    parser.add_argument("--attn", nargs="+", default=["standard", "boosted"],
                        help="variants, name or name:key=value,... as gbattn bench takes (the first is the baseline)")
    args = parser.parse_args()
    rows = {attn: decode_step_kernels(args.preset, attn) for attn in args.attn}
    base = rows[args.attn[0]]["all"]
    kinds = list(KINDS) + ["all"]
    print(f"Kernels called by one compiled decode step, {args.preset}, batch 1 (inductor, CPU code)\n")
    print("| variant | " + " | ".join(kinds) + f" | all / {args.attn[0]}'s |")
    print("| --- |" + " ---: |" * (len(kinds) + 1))
    for attn, counts in rows.items():
        print(f"| {attn} | " + " | ".join(str(counts[k]) for k in kinds) + f" | {counts['all'] / base:.2f} |")


if __name__ == "__main__":
    run_script(main)
