"""Generation: reproducible with a seed, cache == no cache, and the CLI."""

from __future__ import annotations

import pytest
import torch

from gbattn.cli import main as cli_main
from gbattn.eval.generate import generate
from gbattn.train.trainer import train

from helpers import write_corpus
from test_model import tiny_model
from test_pipeline import tiny_configs


def test_greedy_cached_equals_uncached(variant_case):
    model = tiny_model(variant_case)
    prompt = torch.randint(0, 37, (2, 5))
    a = generate(model, prompt, 30, temperature=0, use_cache=True)  # runs past block_size=24
    b = generate(model, prompt, 30, temperature=0, use_cache=False)
    assert a.shape == (2, 35)
    assert torch.equal(a, b)
    assert not model.has_cache


def test_sampling_reproducible_with_seed():
    model = tiny_model(("boosted", {}))
    prompt = torch.randint(0, 37, (3, 4))
    a = generate(model, prompt, 12, temperature=1.0, top_k=10, seed=7)
    b = generate(model, prompt, 12, temperature=1.0, top_k=10, seed=7)
    c = generate(model, prompt, 12, temperature=1.0, top_k=10, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :4], prompt)


def test_generate_cli(tmp_path, capsys):
    data = write_corpus(tmp_path / "c")
    train(tmp_path / "run", *tiny_configs(data, max_steps=4, eval_every=4), quiet=True)
    code = cli_main(["generate", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "10", "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("the cat") and "KV cache" in out
    cli_main(["generate", str(tmp_path / "run"), "--prompt", "the cat", "--max-new-tokens", "10", "--seed", "1"])
    assert capsys.readouterr().out.split("---")[0] == out.split("---")[0]
