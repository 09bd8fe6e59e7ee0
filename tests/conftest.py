"""Shared fixtures: every registered attention variant with the options worth covering."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile

import pytest
import torch

from gbattn.attention.registry import VARIANTS

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.pop("GBATTN_DEBUG", None)  # the tests check the one-line errors a user sees
os.environ["COLUMNS"] = "100"  # help texts read at one width (at 20, argparse broke OMP_NUM_THREADS across lines)
# Caches in a folder of this process, removed at its end, before anything reads where they are: a module's fixture
# training a run (before a test's own cache is set) wrote into ~/.cache/gbattn, and lm-eval's toy tasks into
# ~/.cache/huggingface (eleven dataset folders a run)
_CACHES = tempfile.mkdtemp(prefix="gbattn-tests-")
atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)
os.environ["GBATTN_CACHE"] = os.path.join(_CACHES, "gbattn")
os.environ["HF_HOME"] = os.path.join(_CACHES, "huggingface")
# torchrun's variables left in the shell: every in-process training took itself for one of several processes
for _name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(_name, None)
# The Ctrl-C tests send a real SIGINT to this process. Started as a shell's background job, it has SIGINT ignored,
# and gbattn leaves an ignored SIGINT ignored (tests of that set it themselves), so those tests saw no stop.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # `pytest -n N`: the cores divided between the N workers
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# (variant, options) pairs that the shared tests run over. Every registry entry must appear.
VARIANT_CASES = [
    ("standard", {}),
    ("boosted", {}),
    ("boosted", {"rounds": 3, "gate": "mlp"}),
    ("boosted", {"rounds": 3, "gate": "vector", "kv_source": "input"}),
    ("boosted", {"gate": "scalar", "kv_source": "shared"}),
    ("boosted", {"gate": "none"}),
    ("boosted", {"gate": "tanh", "layers": [-1]}),
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


@pytest.fixture
def one_thread():
    """One torch thread for a module of tiny models: many times faster than several threads
    competing for busy cores (``_deterministic_and_isolated`` puts the count back)."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_and_isolated(tmp_path, monkeypatch):
    """Seeded RNG, a per-test cache directory (tokenizers and token memmaps), the default thread
    count pinned (``OMP_NUM_THREADS``: two runs compared in one test must not pick different counts
    from a momentarily busy machine, since the count changes float sums), and torch's thread count
    put back after tests that train with a thread count of their own."""
    torch.manual_seed(0)
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "gbattn-cache"))
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    yield
    torch.set_num_threads(threads)
