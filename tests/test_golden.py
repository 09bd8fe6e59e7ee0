"""Golden losses (torchtitan's loss-compare habit): a few float64 AdamW steps of a tiny model for
every variant case, pinned in ``tests/data/golden_losses.json`` when the attention core was
rewritten (issue 12), so a refactor that changes what a model computes fails here.

Regenerate only for a deliberate change of the mathematics: ``python tests/test_golden.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import VARIANT_CASES, case_id
from gbattn.config import ModelConfig
from gbattn.model import GPT

GOLDEN = Path(__file__).parent / "data" / "golden_losses.json"
STREAMS = {
    "pre": {},
    "post-rope": {"norm": "post", "pos": "rope"},
    "attnres-block": {"residual": "attnres-block", "attnres_block": 3},
}


def golden_losses(variant_case, stream: dict, steps: int = 4) -> list[float]:
    name, options = variant_case
    torch.manual_seed(1234)
    cfg = ModelConfig(vocab_size=29, block_size=16, d_model=16, n_layers=2, n_heads=4, dropout=0.0, attn=name,
                      attn_options=options, **stream)
    model = GPT(cfg).double()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(6.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    generator = torch.Generator().manual_seed(99)
    idx = torch.randint(0, 29, (3, 13), generator=generator)
    losses = []
    for _ in range(steps):
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def all_cases():
    pinned = json.loads(GOLDEN.read_text())
    return [(case, stream) for case in VARIANT_CASES for stream in STREAMS if f"{case_id(case)}|{stream}" in pinned]


@pytest.mark.parametrize("case,stream", all_cases(), ids=[f"{case_id(c)}-{s}" for c, s in all_cases()])
def test_losses_equal_the_pinned_ones(case, stream):
    pinned = json.loads(GOLDEN.read_text())[f"{case_id(case)}|{stream}"]
    assert golden_losses(case, STREAMS[stream]) == pytest.approx(pinned, rel=1e-11, abs=0)


if __name__ == "__main__" and "--write" in sys.argv:
    table = {f"{case_id(c)}|{s}": golden_losses(c, STREAMS[s]) for c in VARIANT_CASES for s in STREAMS}
    GOLDEN.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(table)} cases to {GOLDEN}")
