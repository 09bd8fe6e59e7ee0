"""Shared fixtures: every registered attention variant with the options worth covering."""

from __future__ import annotations

import pytest
import torch

from gbattn.attention.registry import VARIANTS

# (variant, options) pairs that the shared tests run over. Every registry entry must appear.
VARIANT_CASES = [
    ("standard", {}),
    ("boosted", {}),
    ("boosted", {"rounds": 3, "gate": "mlp"}),
    ("boosted", {"rounds": 3, "gate": "vector", "kv_source": "input"}),
    ("boosted", {"gate": "scalar", "kv_source": "shared"}),
    ("boosted", {"gate": "none"}),
    ("twicing", {}),
    ("twicing", {"layers": [-1]}),
    ("gated", {"mode": "elementwise"}),
    ("gated", {"mode": "headwise"}),
    ("differential", {}),
]
assert {name for name, _ in VARIANT_CASES} == set(VARIANTS), "a registered variant is missing from VARIANT_CASES"


def case_id(case) -> str:
    name, opts = case
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.fixture(params=VARIANT_CASES, ids=[case_id(c) for c in VARIANT_CASES])
def variant_case(request):
    return request.param


@pytest.fixture(autouse=True)
def _deterministic_and_isolated(tmp_path, monkeypatch):
    """Seeded RNG, and a per-test cache directory (tokenizers and token memmaps)."""
    torch.manual_seed(0)
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "gbattn-cache"))
    yield
