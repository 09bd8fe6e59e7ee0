"""The paper presets train as the authors' code does (docs/paper.md, "The authors' training loop"):
their warmup formula and their dropout sites; and defaults that fit the data (warmup fitted to a
short run, the real vocabulary, how often evaluations run)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from gbattn.config import PRESETS, TrainConfig, build_configs, preset_config
from gbattn.model import GPT
from gbattn.train.trainer import fitted_warmup, learning_rate, train
from helpers import TINY, tiny_configs, train_killed_at, write_corpus


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
    sublayer output (B, T, D), the FFN hidden layer (B, T, hidden), attention maps (B, H, T, T).
    Every call drops with the config's probability."""
    cfg = model.cfg
    counts = {"width d": 0, "ffn hidden": 0, "attention maps": 0}
    probabilities = set()
    original = F.dropout

    def counting(x, p=0.5, training=True, inplace=False):
        if training and p > 0:
            probabilities.add(p)
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
    assert probabilities <= {cfg.dropout}, f"dropout probabilities {probabilities}, the config's {cfg.dropout}"
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


# Every preset written out from where it is documented: docs/paper.md ("The small model", "Training recipe",
# the medium recipe), the README's presets table and "Choosing cpu-proxy", nanoGPT's shakespeare_char CPU run
# (README and docs/deviations.md: batch 12, 2,000 steps, lr 1e-3 to 1e-4, 100 warmup steps, betas (0.9, 0.99),
# weight decay 0.1 on matrices, random windows, 90/10 split) and GPT-2's OpenWebText recipe (lr 6e-4 to 6e-5,
# betas (0.9, 0.95), weight decay 0.1 on matrices, 2,000 warmup steps; 3e-4 to 3e-5 at 350M).
GPT2_BLOCK = dict(norm="pre", norm_type="layernorm", ffn="gelu", ffn_mult=4, bias=True, pos="learned",
                  tie_embeddings=True, n_kv_heads=None, dropout_sites=["embedding", "attention", "ffn-hidden",
                                                                       "ffn-output"])
LLAMA = dict(GPT2_BLOCK, norm_type="rmsnorm", ffn="swiglu", bias=False, pos="rope", rope_base=10000.0, n_kv_heads=2)
PAPER_RECIPE = dict(tokenizer="bpe", train_tokens=10_000_000, eval_tokens=1_000_000, batch_size=32, epochs=15.0,
                    max_steps=None, lr=3e-4, min_lr=0.0, warmup_steps=1500, warmup_from_zero=True,
                    schedule="cosine", weight_decay=0.01, decay_matrices_only=False, beta1=0.9, beta2=0.999,
                    grad_clip=1.0, sampling="rows", seq_len=None, eval_every=None, seed=42)
CPU_RECIPE = {**PAPER_RECIPE, "epochs": 2.0,  # (a compare recipe sets max_steps; `train --preset` takes 2 epochs)
              "train_tokens": None, "eval_tokens": None, "lr": 1e-3, "warmup_steps": 100, "warmup_from_zero": False}
OWT = dict(CPU_RECIPE, tokenizer="gpt2", eval_tokens=1_000_000, lr=6e-4, min_lr=6e-5, warmup_steps=2000,
           weight_decay=0.1, decay_matrices_only=True, beta2=0.95, epochs=1.0)
DOCUMENTED = {
    "paper-small": (dict(GPT2_BLOCK, d_model=256, n_layers=4, n_heads=4, block_size=256, vocab_size=16384,
                         dropout=0.1), PAPER_RECIPE),
    "paper-medium": (dict(GPT2_BLOCK, d_model=384, n_layers=6, n_heads=6, block_size=256, vocab_size=16384,
                          dropout=0.1),
                     dict(PAPER_RECIPE, lr=2e-4, batch_size=24, epochs=10.0, warmup_steps=2000,
                          train_tokens=30_000_000)),
    "llama-small": (dict(LLAMA, d_model=256, n_layers=4, n_heads=4, block_size=256, vocab_size=16384, dropout=0.1),
                    PAPER_RECIPE),
    "owt-125m": (dict(GPT2_BLOCK, d_model=768, n_layers=12, n_heads=12, block_size=1024, vocab_size=50257,
                      dropout=0.0), OWT),
    "owt-350m": (dict(GPT2_BLOCK, d_model=1024, n_layers=24, n_heads=16, block_size=1024, vocab_size=50257,
                      dropout=0.0), dict(OWT, lr=3e-4, min_lr=3e-5)),
    "cpu-proxy": (dict(GPT2_BLOCK, d_model=128, n_layers=4, n_heads=4, block_size=128, vocab_size=4096, dropout=0.0),
                  CPU_RECIPE),
    "cpu-llama": (dict(LLAMA, d_model=128, n_layers=4, n_heads=4, block_size=128, vocab_size=4096, dropout=0.0),
                  CPU_RECIPE),
    "cpu-char": (dict(GPT2_BLOCK, d_model=128, n_layers=4, n_heads=4, block_size=64, vocab_size=65, dropout=0.0),
                 dict(CPU_RECIPE, tokenizer="char", split=[0.9, 0.1, 0.0], seq_len=64, sampling="random",
                      batch_size=12, max_steps=2000, min_lr=1e-4, weight_decay=0.1, decay_matrices_only=True,
                      beta2=0.99, eval_every=250, epochs=15.0)),  # (the default's epochs: max_steps sets its length)
}


@pytest.mark.parametrize("preset", sorted(DOCUMENTED))
def test_every_preset_holds_its_documented_model_and_recipe(preset):
    """Each preset's model and training config, field by field, as the docs give them (a recipe value
    changed in config.py, or a paper number, would train a different model silently)."""
    model_expected, train_expected = DOCUMENTED[preset]
    model_cfg, train_cfg = build_configs(preset, "standard", "data", {})
    assert {k: getattr(model_cfg, k) for k in model_expected} == model_expected
    assert {k: getattr(train_cfg, k) for k in train_expected} == train_expected
    assert set(PRESETS) == set(DOCUMENTED)


def test_the_training_defaults_are_the_papers_recipe():
    """TrainConfig's own defaults (a config built in code, a field no preset names) are the paper's recipe: one
    update per global batch of 32 rows, the default warmup fitted to a short run, the 90/5/5 split."""
    defaults = TrainConfig()
    assert {k: getattr(defaults, k) for k in PAPER_RECIPE} == PAPER_RECIPE
    rest = dict(grad_accum=1, fit_warmup=True, split=[0.9, 0.05, 0.05], amp="auto")
    assert {k: getattr(defaults, k) for k in rest} == rest
    for name in PRESETS:
        train_cfg = build_configs(name, "standard", "data", {})[1]
        assert (train_cfg.grad_accum, train_cfg.fit_warmup, train_cfg.amp) == (1, True, "auto"), name


# --------------------------------------------------------------------------------------
# Defaults that fit the data
# --------------------------------------------------------------------------------------


def test_a_default_warmup_longer_than_the_run_is_fitted_and_said():
    """The limit is where the learning rate reaches its peak within the run (docs/deviations.md, entry 9): the paper
    presets warm up from zero, so 1,500 warmup steps in a 1,499- or 1,500-step run become 150 (at exactly the run's
    length the peak came after the last step: kept with a warning before 2026-12-07); in 1,501 and 2,999 steps (a
    warmup over half the run, fitted before it was measured) kept; in a 4-step run, 1 (never 0, and the note says
    "at least 1 step", not just "a tenth"); 0 in a 1-step run warming up from zero."""
    _, cfg = build_configs("paper-small", "standard", "data", {})
    warmup, note = fitted_warmup(cfg, 135)
    assert warmup == 14 and note == ("warmup_steps=1,500 is longer than this 135-step run (the learning rate would "
                                     "never reach lr=0.0003): using 14 (a tenth of the run); --set warmup_steps=N "
                                     "keeps a warmup as given")
    warmup, note = fitted_warmup(cfg, 1_499)
    assert warmup == 150 and "longer than this 1,499-step run" in note
    warmup, note = fitted_warmup(cfg, 1_500)
    assert warmup == 150 and "is as long as this 1,500-step run (the learning rate would never reach" in note
    assert fitted_warmup(cfg, 1_501) == fitted_warmup(cfg, 2_999) == fitted_warmup(cfg, 18_375) == (1500, None)
    assert fitted_warmup(cfg, 4)[0] == 1
    assert "using 1 (a tenth of the run, at least 1 step);" in fitted_warmup(cfg, 4)[1]
    assert "using 1 (a tenth of the run, at least 1 step);" in fitted_warmup(cfg, 5)[1]   # round(0.5) is 0
    from_zero = dataclasses.replace(cfg, warmup_from_zero=True)
    assert fitted_warmup(from_zero, 1)[0] == 0 and "using 0 (a tenth of the run);" in fitted_warmup(from_zero, 1)[1]


def test_the_plan_counts_its_evaluations_without_going_over_every_step(tmp_path, monkeypatch):
    """The plan counted its evaluations by asking of each step whether it evaluates: a run of 10**12 steps (or of
    1e300 epochs) printed nothing for minutes before its first step. Counted arithmetically now, equal to asking
    each step in small runs; and epochs that make more steps than a run can count are one line (1e308 epochs was an
    OverflowError traceback)."""
    import re

    from gbattn.errors import ConfigError
    from gbattn.train.trainer import Trainer, steps_of_epochs

    trainer = Trainer(tmp_path / "run", *tiny_configs(write_corpus(tmp_path / "c")), quiet=True)
    trainer._setup()

    def planned() -> int:
        return int(re.search(r"\(([\d,]+) in all\)", "\n".join(trainer._plan())).group(1).replace(",", ""))

    for total, eval_every, per_epoch in ((1, None, None), (7, None, None), (7, 3, None), (9, 3, None), (9, None, 4),
                                         (8, None, 4), (3, None, 4), (10, 20, 4), (10, 3, 4)):
        trainer.total_steps, trainer.steps_per_epoch = total, per_epoch
        trainer.train_cfg = trainer.train_cfg.replace(eval_every=eval_every)
        assert planned() == sum(trainer._is_eval_step(s) for s in range(1, total + 1)), (total, eval_every, per_epoch)
    trainer.total_steps, trainer.train_cfg = 3, trainer.train_cfg.replace(eval_every=1)
    assert "evaluation every step (3 in all)" in "\n".join(trainer._plan())  # (it said "every 1 steps")
    monkeypatch.setattr(Trainer, "_is_eval_step", lambda self, step: pytest.fail("the plan went over every step"))
    trainer.total_steps, trainer.train_cfg = 10**12, trainer.train_cfg.replace(eval_every=7)
    assert planned() == 142_857_142_858
    with pytest.raises(ConfigError, match=r"^epochs=1e-13 of 100 steps each is no step at all; set at least 0.01 "
                                          r"epochs, or max_steps$"):  # (rounded to 0 steps: trained none, exit 0)
        steps_of_epochs(1e-13, 100)
    assert steps_of_epochs(1e-9, 100) == 1
    for epochs in (1e308, 1e300):
        with pytest.raises(ConfigError, match=re.escape(f"epochs={epochs:g} of 100 steps each is more steps than a "
                                                        f"run can count (9,223,372,036,854,775,807); set fewer "
                                                        f"epochs, or max_steps")):
            steps_of_epochs(epochs, 100)


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
    assert "warmup_steps=1,500 is longer than this" in warned and "warmup_steps" not in printed
    assert "evaluation every epoch = every" in printed and "--set eval_every=N evaluates less often" in printed
    assert ("66 steps (3 epochs of 22 steps) of 4 x 32 tokens, lr 0.0003 (warmup 7, then cosine to 0), evaluation"
            in printed)
    # One epoch: its evaluation is the one at the end, where it said "every epoch = every 22 steps (1 in all)".
    train(tmp_path / "one-epoch", *build_configs("paper-small", "standard", str(data), {**sets, "epochs": 1}))
    printed = capsys.readouterr().out
    assert "evaluation at the end (1 in all)" in printed and "every epoch" not in printed
    assert "evaluates less often" not in printed  # (one evaluation: none is less often; it was advised)
    # A fraction of an epoch is that many steps, a part of one counted whole: a float product a hair above a whole
    # number (0.07 x 100 = 7.000000000000001) took a step more
    from gbattn.train.trainer import steps_of_epochs

    assert [steps_of_epochs(e, n) for e, n in ((0.07, 100), (1.1, 100), (0.55, 100), (8.3, 30), (0.5, 22),
                                              (1.1, 22), (15, 2_100))] == [7, 110, 55, 249, 11, 25, 31_500]
    # An interval as long as the run or longer (the preset's 250 steps in a 20-step run): "at the end", where it
    # said "every 250 steps (1 in all)".
    del sets["epochs"]
    for interval in (250, 20):
        sets.update(max_steps=20, eval_every=interval)
        train(tmp_path / f"short{interval}", *build_configs("paper-small", "standard", str(data), sets))
        printed = capsys.readouterr().out
        assert "(warmup 2, then cosine to 0), evaluation at the end (1 in all), cpu with 1 thread" in printed
        assert "evaluates less often" not in printed  # eval_every is given: no advice to give it
        assert "20 steps (0.909 epochs of 22 steps) of 4 x 32 tokens" in printed  # these steps', not the preset's


def test_the_plan_says_how_many_of_a_tokenizers_ids_name_no_token(tmp_path, capsys):
    """A Hugging Face tokenizer.json whose ids leave gaps (its words at ids 0..n-1, <unk> at 5,000) gives a model
    of 5,001 embedding rows, most of them for no token: the plan says so (it printed 5,001 tokens and nothing
    else); one without gaps adds nothing, and a model config asking for the tokenizer's own size is not told apart."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from helpers import WORDS

    data = write_corpus(tmp_path / "c")
    words = sorted({*WORDS, "."})
    for unk_id, note in ((5_000, f"; {5_000 - len(words):,} of its ids name no token, and each still has an "
                                 f"embedding row"), (len(words), "")):
        backend = Backend(models.WordLevel({**{w: i for i, w in enumerate(words)}, "<unk>": unk_id},
                                           unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        backend.save(str(tmp_path / "tokenizer.json"))
        sets = dict(TINY, tokenizer=f"hf={tmp_path / 'tokenizer.json'}", batch_size=4, max_steps=1, threads=1,
                    train_tokens=None, eval_tokens=None)
        train(tmp_path / f"run{unk_id}", *build_configs("paper-small", "standard", str(data), sets), quiet=False)
        printed = capsys.readouterr().out
        assert f"hf tokenizer: {unk_id + 1:,} tokens (the model config asked for 16,384; the vocabulary is the " \
               f"tokenizer's){note}\n" in printed, printed
        assert "\n1 step (" in printed, printed  # one step, not "1 steps"
    # A model config that asks for the tokenizer's own size: no note of what it asked for
    sets["vocab_size"] = len(words) + 1
    train(tmp_path / "asked", *build_configs("paper-small", "standard", str(data), sets), quiet=False)
    assert f"hf tokenizer: {len(words) + 1:,} tokens\n" in capsys.readouterr().out


def test_the_plan_says_a_run_trains_compiled(tmp_path, capsys, monkeypatch):
    """A compiled run says so (its tokens/s counts the compile time), an eager one does not."""
    import torch

    data = write_corpus(tmp_path / "c")
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # the plan, not the compiler
    for compiled in (True, False):
        sets = dict(TINY, tokenizer="char", batch_size=4, max_steps=1, threads=1, compile=compiled)
        train(tmp_path / f"run-{compiled}", *build_configs("paper-small", "standard", str(data), sets))
        printed = capsys.readouterr().out
        assert ("with 1 thread, compiled (tokens/s counts the time it takes)" in printed) == compiled, printed
    # On a GPU the plan names no threads, and still says the run is compiled.
    from types import SimpleNamespace

    from gbattn.train.trainer import Trainer

    for compiled in (True, False):
        for recomputed in (True, False):
            on_gpu = SimpleNamespace(device=torch.device("cuda"), compiled=compiled, threads=4,
                                     dist=SimpleNamespace(world=1),
                                     train_cfg=SimpleNamespace(activation_checkpointing=recomputed, parallel="ddp"))
            assert Trainer._execution_text(on_gpu) == (
                (", compiled (tokens/s counts the time it takes)" if compiled else "")
                + (", each block recomputed in the backward pass (activation_checkpointing)" if recomputed else ""))
    # Under torchrun it names its processes, and a CPU's threads are each process's (it said "cpu with 1 thread"
    # for 2 processes of 1 thread each)
    for device, said in (("cpu", " in 2 processes (fsdp2) with 1 thread each"), ("cuda", " in 2 processes (fsdp2)")):
        two = SimpleNamespace(device=torch.device(device), compiled=False, threads=1, dist=SimpleNamespace(world=2),
                              train_cfg=SimpleNamespace(activation_checkpointing=False, parallel="fsdp2"))
        assert Trainer._execution_text(two) == said


def test_cosine_decays_to_min_lr_and_constant_holds():
    """cpu-char (nanoGPT): cosine from lr to min_lr=lr/10 after the warmup, halfway at the middle;
    schedule=constant stays at lr after the warmup, and warms up as cosine does."""
    _, cfg = build_configs("cpu-char", "standard", "data", {})
    assert cfg.min_lr > 0 and cfg.min_lr == pytest.approx(cfg.lr / 10)
    W, total = cfg.warmup_steps, cfg.warmup_steps + 2000
    assert learning_rate(W, cfg, total, W) == pytest.approx(cfg.lr, rel=1e-12)
    assert learning_rate(W + 1000, cfg, total, W) == pytest.approx((cfg.lr + cfg.min_lr) / 2, rel=1e-12)
    assert learning_rate(total, cfg, total, W) == pytest.approx(cfg.min_lr, rel=1e-12)
    assert min(learning_rate(s, cfg, total, W) for s in range(W, total)) >= cfg.min_lr
    flat = cfg.replace(schedule="constant")
    assert [learning_rate(s, flat, total, W) for s in (W, W + 1000, total - 1)] == [cfg.lr] * 3
    # ... after the same warmup (lr * (step + 1) / W here, warmup_from_zero off): not the peak from the first step
    assert not cfg.warmup_from_zero
    assert [learning_rate(s, flat, total, W) for s in (0, W // 2, W - 1)] == pytest.approx(
        [cfg.lr / W, cfg.lr * (W // 2 + 1) / W, cfg.lr], rel=1e-12)
    # a min_lr given with the constant schedule was ignored, silently; the preset's own (cpu-char's) is not refused
    from gbattn.errors import ConfigError

    assert build_configs("cpu-char", "standard", "data", {"schedule": "constant"})[1].schedule == "constant"
    with pytest.raises(ConfigError, match=r"^min_lr=0.0001 is where the cosine schedule ends; schedule=constant holds"):
        build_configs("cpu-char", "standard", "data", {"schedule": "constant", "min_lr": 1e-4})


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


def test_a_run_trains_with_its_fitted_warmup(tmp_path, monkeypatch):
    """paper-small's default warmup (1,500 steps) in a 12-step run is fitted to 1 step, and the updates
    use that warmup (lr 0 at the first update, the peak at the second, then cosine), not 1,500 steps of
    a warmup the run never finishes; config.json records the warmup used."""
    from gbattn import rundir
    from gbattn.train.trainer import Trainer

    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, tokenizer="char", batch_size=8, max_steps=12, eval_every=12, lr=3e-3, train_tokens=None,
                eval_tokens=None, threads=1)
    model_cfg, train_cfg = build_configs("paper-small", "standard", str(data), sets)
    assert (train_cfg.warmup_steps, train_cfg.fit_warmup, fitted_warmup(train_cfg, 12)[0]) == (1500, True, 1)
    original, seen = Trainer._train_step, []

    def spy(self, step):
        seen.append(self.optimizer.param_groups[0]["lr"])
        return original(self, step)

    monkeypatch.setattr(Trainer, "_train_step", spy)
    train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    assert seen == [learning_rate(s, train_cfg, 12, 1) for s in range(12)]
    assert seen[:2] == [0.0, 3e-3]
    assert rundir.read_config(tmp_path / "run" / rundir.CONFIG)["warmup_steps"] == 1


def test_a_resumed_run_keeps_the_warmup_it_started_with(tmp_path, monkeypatch):
    """A run whose warmup was fitted by an earlier gbattn's rule (a warmup over half the run: 9 of 12 steps fitted
    to 1) resumes with the warmup its config.json records, not the 9 today's rule keeps: killed at step 7 and
    resumed, it ends on the uninterrupted run's weights exactly."""
    from gbattn import rundir
    from gbattn.train import trainer

    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, warmup_steps=9, fit_warmup=True)
    with monkeypatch.context() as earlier_rule:
        earlier_rule.setattr(trainer, "WARMUP_FIT_LIMIT", trainer.EARLIER_WARMUP_FIT_LIMIT)
        train(tmp_path / "ref", *configs, quiet=True)
        train_killed_at(7, tmp_path / "killed", *configs, monkeypatch)
    assert rundir.read_config(tmp_path / "killed" / rundir.CONFIG)["warmup_steps"] == 1
    assert fitted_warmup(configs[1], 12)[0] == 9  # what a new run would use today
    seen, original = [], trainer.Trainer._train_step

    def spy(self, step):
        seen.append((step, self.optimizer.param_groups[0]["lr"]))
        return original(self, step)

    monkeypatch.setattr(trainer.Trainer, "_train_step", spy)
    train(tmp_path / "killed", resume=True, quiet=True)
    assert seen and all(lr == learning_rate(step, configs[1], 12, 1) for step, lr in seen)
    ref, resumed = (rundir.load_checkpoint(tmp_path / run / rundir.CHECKPOINT)["model"] for run in ("ref", "killed"))
    for name in ref:
        torch.testing.assert_close(resumed[name], ref[name], rtol=0, atol=0)


def test_a_resumed_run_with_its_recorded_warmup_gives_no_note_of_todays_fit(tmp_path, monkeypatch, capsys):
    """A from-zero warmup as long as the run (12 of 12 steps), kept by the rule before 2026-12-07 (its peak after
    the last step): resumed, the run trains with the warmup it records, without the note today's fit would give
    ("using 1") and without being refused as a warmup gbattn did not write."""
    from gbattn import rundir
    from gbattn.train import trainer

    data = write_corpus(tmp_path / "c")
    configs = tiny_configs(data, warmup_steps=12, fit_warmup=True, warmup_from_zero=True)
    with monkeypatch.context() as earlier_rule:
        earlier_rule.setattr(trainer, "longest_warmup", lambda total_steps, from_zero: total_steps)
        train_killed_at(7, tmp_path / "killed", *configs, monkeypatch)
    assert rundir.read_config(tmp_path / "killed" / rundir.CONFIG)["warmup_steps"] == 12
    assert "using 1" in fitted_warmup(configs[1], 12)[1]  # what today's fit would say
    capsys.readouterr()
    train(tmp_path / "killed", resume=True, quiet=True)
    assert capsys.readouterr().err == ""
    assert rundir.read_config(tmp_path / "killed" / rundir.CONFIG)["warmup_steps"] == 12


def test_every_training_step_runs_with_dropout_on(tmp_path, monkeypatch):
    """A run's steps run the model in training mode (dropout 0.1 drawn), the steps after each evaluation
    (scored in eval mode) too: every run compared with another stays equal if none drops out at all."""
    from gbattn.train.trainer import Trainer

    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, tokenizer="char", batch_size=8, max_steps=6, eval_every=2, warmup_steps=1, train_tokens=None,
                eval_tokens=None, threads=1)
    model_cfg, train_cfg = build_configs("paper-small", "standard", str(data), sets)
    assert model_cfg.dropout == 0.1
    original, modes = Trainer._train_step, []

    def spy(self, step):
        modes.append(all(module.training for module in self.model.modules()))
        return original(self, step)

    monkeypatch.setattr(Trainer, "_train_step", spy)
    train(tmp_path / "run", model_cfg, train_cfg, quiet=True)
    assert modes == [True] * 6
