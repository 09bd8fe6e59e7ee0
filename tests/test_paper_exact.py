"""The paper presets train as the authors' code does (docs/paper.md, "The authors' training loop"):
their warmup formula and their dropout sites; and defaults that fit the data (warmup fitted to a
short run, the real vocabulary, how often evaluations run)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from gbattn.config import PRESETS, build_configs, preset_config
from gbattn.model import GPT
from gbattn.train.trainer import fitted_warmup, learning_rate, train
from helpers import TINY, write_corpus


def authors_lr(step: int, peak: float, warmup: int, total: int) -> float:
    """Their schedule, written out: lr = peak * step / W during warmup (0 at the first update), then
    cosine from peak to 0 over the remaining steps."""
    if step < warmup:
        return peak * step / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.parametrize("preset", ["paper-small", "paper-medium", "llama-small"])
def test_paper_presets_use_the_authors_warmup(preset):
    _, cfg = build_configs(preset, "boosted", "data", {})
    total, W = 18_375, cfg.warmup_steps
    for step in (0, 1, 2, 749, W - 1, W, W + 1, 9_000, total - 1):
        assert learning_rate(step, cfg, total, W) == pytest.approx(authors_lr(step, cfg.lr, W, total), rel=1e-12, abs=0)
    assert learning_rate(0, cfg, total, W) == 0.0


def test_cpu_presets_keep_their_measured_warmup():
    """cpu-char and cpu-proxy results were measured with lr * (step + 1) / W (README)."""
    for preset in ("cpu-char", "cpu-proxy", "cpu-llama"):
        _, cfg = build_configs(preset, "standard", "data", {})
        assert learning_rate(0, cfg, 2000, cfg.warmup_steps) == pytest.approx(cfg.lr / cfg.warmup_steps)


def count_dropout(model: GPT, idx_BT: torch.Tensor) -> dict[str, int]:
    """Dropout calls in one training-mode forward, by what they drop: the embedding sum or a
    sublayer output (B, T, D), the FFN hidden layer (B, T, hidden), attention maps (B, H, T, T)."""
    cfg = model.cfg
    counts = {"width d": 0, "ffn hidden": 0, "attention maps": 0}
    original = F.dropout

    def counting(x, p=0.5, training=True, inplace=False):
        if training and p > 0:
            if x.dim() == 4:
                counts["attention maps"] += 1
            elif x.shape[-1] == cfg.d_model:
                counts["width d"] += 1
            elif x.shape[-1] == cfg.ffn_width:
                counts["ffn hidden"] += 1
        return original(x, p, training, inplace)

    F.dropout = counting
    try:
        model.train()(idx_BT, naive=True)  # the reference path draws attention dropout through F.dropout
    finally:
        F.dropout = original
    return counts


# Attention-map dropout calls per layer: one per attention map (Twicing draws one mask and applies it to
# both of its products: two calls replaying one RNG state, tests/test_attention.py).
MAPS = {"standard": 1, "boosted": 2, "twicing": 2, "gated": 1, "differential": 2}


@pytest.mark.parametrize("preset", ["paper-small", "paper-medium", "llama-small"])
@pytest.mark.parametrize("attn", list(MAPS))
def test_paper_presets_drop_out_where_the_authors_do(preset, attn):
    """Embedding sum once; every attention map; the FFN hidden layer and the FFN output once per layer;
    never the attention sublayer's output."""
    cfg = preset_config(preset, attn, {"n_layers": 2, "vocab_size": 50, "d_model": 96})
    assert cfg.dropout == 0.1
    counts = count_dropout(GPT(cfg), torch.randint(0, 50, (2, 9)))
    assert counts == {"width d": 1 + 2, "ffn hidden": 2, "attention maps": 2 * MAPS[attn]}


def test_dropout_sites_are_a_model_option():
    cfg = preset_config("paper-small", "standard", {"n_layers": 2, "vocab_size": 50, "d_model": 64,
                                                    "dropout_sites": ["embedding", "attention", "attn-output",
                                                                      "ffn-output"]})
    counts = count_dropout(GPT(cfg), torch.randint(0, 50, (2, 9)))
    assert counts == {"width d": 1 + 2 * 2, "ffn hidden": 0, "attention maps": 2}  # gbattn's earlier sites


def test_every_preset_names_its_full_recipe():
    """A preset is one record: model and training defaults, no fallback to another recipe."""
    for name, preset in PRESETS.items():
        model_cfg, train_cfg = build_configs(name, "standard", "data", {})
        assert {"lr", "batch_size", "warmup_steps", "tokenizer", "weight_decay"} <= set(preset.train), name


# --------------------------------------------------------------------------------------
# Defaults that fit the data
# --------------------------------------------------------------------------------------


def test_a_default_warmup_longer_than_half_the_run_is_fitted_and_said():
    """The limit is half the run: 1,500 warmup steps in a 2,999-step run become 300; in 3,000, kept; in a
    4-step run, 1 (never 0)."""
    _, cfg = build_configs("paper-small", "standard", "data", {})
    warmup, note = fitted_warmup(cfg, 135)
    assert warmup == 14 and "warmup_steps=1,500 is longer than half of this 135-step run: using 14" in note
    warmup, note = fitted_warmup(cfg, 2_999)
    assert warmup == 300 and "longer than half of this 2,999-step run" in note
    assert fitted_warmup(cfg, 3_000) == fitted_warmup(cfg, 18_375) == (1500, None)
    assert fitted_warmup(cfg, 4)[0] == 1


def test_an_explicit_warmup_is_kept_and_warned_about_when_longer_than_the_run():
    _, cfg = build_configs("paper-small", "standard", "data", {"warmup_steps": 200})
    assert cfg.fit_warmup is False
    warmup, note = fitted_warmup(cfg, 135)
    assert warmup == 200 and note.startswith("warning: warmup_steps=200 >= the run's 135 steps")
    assert fitted_warmup(cfg, 200)[1].startswith("warning: warmup_steps=200 >= the run's 200 steps")
    assert fitted_warmup(cfg, 201) == (200, None)


def test_the_plan_reports_the_real_vocabulary_fitted_warmup_and_evaluations(tmp_path, capsys):
    data = write_corpus(tmp_path / "c", lines_per_split=(300, 40, 40))
    sets = dict(TINY, tokenizer="bpe", batch_size=4, epochs=3, train_tokens=None, eval_tokens=None, threads=1)
    train(tmp_path / "run", *build_configs("paper-small", "standard", str(data), sets))
    printed = capsys.readouterr()
    printed, warned = printed.out, printed.err
    assert "bpe tokenizer: " in printed
    assert "(the model config asked for 16,384; the vocabulary is the tokenizer's)" in printed
    assert "warmup_steps=1,500 is longer than half of this" in warned and "warmup_steps" not in printed
    assert "evaluation every epoch = every" in printed and "--set eval_every=N evaluates less often" in printed


def test_cosine_decays_to_min_lr_and_constant_holds():
    """cpu-char (nanoGPT): cosine from lr to min_lr=lr/10 after the warmup, halfway at the middle;
    schedule=constant stays at lr after the warmup."""
    _, cfg = build_configs("cpu-char", "standard", "data", {})
    assert cfg.min_lr > 0 and cfg.min_lr == pytest.approx(cfg.lr / 10)
    W, total = cfg.warmup_steps, cfg.warmup_steps + 2000
    assert learning_rate(W, cfg, total, W) == pytest.approx(cfg.lr, rel=1e-12)
    assert learning_rate(W + 1000, cfg, total, W) == pytest.approx((cfg.lr + cfg.min_lr) / 2, rel=1e-12)
    assert learning_rate(total, cfg, total, W) == pytest.approx(cfg.min_lr, rel=1e-12)
    assert min(learning_rate(s, cfg, total, W) for s in range(W, total)) >= cfg.min_lr
    flat = cfg.replace(schedule="constant")
    assert [learning_rate(s, flat, total, W) for s in (W, W + 1000, total - 1)] == [cfg.lr] * 3


@pytest.mark.parametrize("from_zero", [True, False])
def test_every_update_of_a_run_uses_the_scheduled_lr_in_every_parameter_group(tmp_path, monkeypatch, from_zero):
    """A 12-step run with warmup 3 and min_lr = lr / 10, written out: update s (0-based) has
    lr * s / 3 (the authors') or lr * (s + 1) / 3 during the warmup, then cosine from lr to min_lr over
    steps 3-12, in both parameter groups (decay_matrices_only); the train record of step s + 1 logs it."""
    from gbattn.train.trainer import Trainer

    data = write_corpus(tmp_path / "c")
    peak, floor, W, total = 3e-3, 3e-4, 3, 12

    def expected(s: int) -> float:
        if s < W:
            return peak * (s if from_zero else s + 1) / W
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * (s - W) / (total - W)))

    sets = dict(TINY, tokenizer="char", batch_size=8, max_steps=total, eval_every=total, warmup_steps=W, lr=peak,
                min_lr=floor, warmup_from_zero=from_zero, decay_matrices_only=True, train_tokens=None,
                eval_tokens=None, threads=1)
    original, seen = Trainer._train_step, []

    def spy(self, step):
        seen.append([group["lr"] for group in self.optimizer.param_groups])
        return original(self, step)

    monkeypatch.setattr(Trainer, "_train_step", spy)
    train(tmp_path / "run", *build_configs("paper-small", "standard", str(data), sets), quiet=True)
    assert all(len(lrs) == 2 for lrs in seen)
    assert [lr for lrs in seen for lr in lrs] == pytest.approx([expected(s) for s in range(total) for _ in "ab"],
                                                               rel=1e-12, abs=0)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [(e["step"], e["lr"]) for e in events if e["event"] == "train"]
    assert logged == [(s + 1, pytest.approx(expected(s), rel=1e-12, abs=0)) for s in range(total)]
