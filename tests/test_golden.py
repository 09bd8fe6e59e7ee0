"""Golden losses (torchtitan's loss-compare habit): a few float64 AdamW steps of a tiny model for
every variant case, pinned in ``tests/data/golden_losses.json`` before the attention core was
rewritten around the narrow variant contract (``compute(x_BTD, call)``), so a refactor that changes
what a model computes fails here. Every variant case of ``conftest.VARIANT_CASES`` in every stream
must have pinned losses: a case without them fails.

A variant case added later is pinned with ``python tests/test_golden.py --add`` (adds the missing
cases, keeps every pinned value) and listed in ``PINNED_LATER`` with the reason. Regenerate all
cases (``--write``) only for a deliberate change of the mathematics.
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


# Variant cases pinned from the rewritten code rather than from the code before the rewrite: they
# guard against changes after they were pinned, not against the rewrite itself.
PINNED_LATER = {
    "boosted-gate=tanh-layers=[-1]": "the tanh gate came with the attention-core rewrite, so no earlier code "
                                     "computes it; pinned (--add) from the rewritten code",
}


def all_cases() -> list[tuple[tuple, str]]:
    return [(case, stream) for case in VARIANT_CASES for stream in STREAMS]


def key(case, stream: str) -> str:
    return f"{case_id(case)}|{stream}"


def test_every_case_has_pinned_losses_and_nothing_else_is_pinned():
    pinned = json.loads(GOLDEN.read_text())
    expected = {key(case, stream) for case, stream in all_cases()}
    missing, stale = sorted(expected - pinned.keys()), sorted(pinned.keys() - expected)
    assert not missing, f"no golden losses for {missing}: see the docstring"
    assert not stale, f"golden losses of cases that no longer exist: {stale}"
    assert set(PINNED_LATER) <= {case_id(case) for case in VARIANT_CASES}


@pytest.mark.parametrize("case,stream", all_cases(), ids=[f"{case_id(c)}-{s}" for c, s in all_cases()])
def test_losses_equal_the_pinned_ones(case, stream):
    pinned = json.loads(GOLDEN.read_text())
    if key(case, stream) not in pinned:
        pytest.fail(f"{key(case, stream)} has no golden losses: pin it with `python tests/test_golden.py --add` and "
                    f"list it in PINNED_LATER")
    assert golden_losses(case, STREAMS[stream]) == pytest.approx(pinned[key(case, stream)], rel=1e-11, abs=0)


if __name__ == "__main__" and ("--write" in sys.argv or "--add" in sys.argv):
    table = json.loads(GOLDEN.read_text()) if "--add" in sys.argv else {}
    added = [key(c, s) for c, s in all_cases() if key(c, s) not in table]
    table.update({key(c, s): golden_losses(c, STREAMS[s]) for c, s in all_cases() if key(c, s) in added})
    GOLDEN.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(added)} cases to {GOLDEN}: {', '.join(added)}")
