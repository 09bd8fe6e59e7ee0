"""Efficiency checks that are not wall-clock: no T x T tensor in any fast path, and the bench
command's report (ratios are computed, never asserted as timings)."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gbattn.attention import AttnArgs, build_attention
from gbattn.cli import main as cli_main


class LiveMemory(TorchDispatchMode):
    """Peak bytes of live op outputs (every intermediate passes through here; storages shared
    by views count once) and the largest single output. Forward passes under no_grad only: no
    autograd graph keeps tensors alive behind Python's back."""

    def __init__(self):
        super().__init__()
        self.refs, self.sizes = {}, {}
        self.current = self.peak = self.largest = 0

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.current -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                self.refs[key] += 1
                self.largest = max(self.largest, t.numel())
                weakref.finalize(t, self._release, key)
        return out


@pytest.mark.parametrize("naive", [False, True])
def test_fast_path_peak_memory_at_2048_far_below_a_t_by_t_matrix(variant_case, naive):
    T, D, H = 2048, 32, 4
    attn = build_attention(variant_case[0], AttnArgs(d_model=D, n_heads=H, layer_idx=1, n_layers=2), variant_case[1])
    x = torch.randn(1, T, D)
    with torch.no_grad(), LiveMemory() as probe:
        attn(x, naive=naive)
    one_head_tt_bytes = 4 * T * T  # one fp32 T x T matrix for ONE head
    if naive:  # the reference path holds the scores of every head of a call: the probe sees them
        assert probe.peak >= H // 2 * one_head_tt_bytes and probe.largest >= H // 2 * T * T
    else:
        assert probe.peak <= one_head_tt_bytes / 4, probe.peak / one_head_tt_bytes
        assert probe.largest <= T * T // 8


def test_cpu_memory_probe_counts_weights_gradients_and_adam_state():
    from gbattn.bench.speed import peak_memory_train_step
    from gbattn.config import preset_config
    from gbattn.model import count_params

    cfg = preset_config("cpu-char", "boosted", {"d_model": 256})
    # A large parent must not leak into the child's figure (Linux's ru_maxrss survives fork/exec).
    parent_ballast = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MiB resident here
    peak = peak_memory_train_step(cfg, batch=2, seq_len=16, device=torch.device("cpu"), amp=False)
    del parent_ballast
    n = count_params(cfg)
    assert 4 * 4 * n <= peak < 4 * 4 * n + 128 * 2**20  # fp32 weights + gradients + two AdamW moments, + a little


def test_bench_command_report(tmp_path, capsys, monkeypatch):
    from gbattn.bench import speed

    # The CPU memory probe (a subprocess per case) is tested above; here it is stubbed for speed.
    probed = []
    monkeypatch.setattr(speed, "peak_memory_train_step",
                        lambda cfg, batch, seq_len, dev, amp: probed.append(cfg) or 1e6 * cfg.d_model)
    code = cli_main(["bench", "--preset", "cpu-char", "--attn", "standard", "boosted:gate=vector", "--repeats", "1",
                     "--steps", "1", "--batch", "2", "--sweep", "32", "64", "--set", "dropout=0.05",
                     "--out", str(tmp_path), "--quiet"])
    assert code == 0
    # --set reaches every variant and the sweep; a variant's own options still apply.
    assert len(probed) == 6 and all(cfg.dropout == 0.05 for cfg in probed)
    assert probed[1].attn_options["gate"] == "vector"
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["variant"]: r for r in report["variants"]}
    assert rows["standard"]["step_ratio"] == 1.0 and report["dropout"] == 0.05
    # the default decode fits the block size (64 in cpu-char): half of it decoded, after a prompt of the rest
    assert (report["prefill_tokens"], report["decode_tokens"]) == (32, 32)
    gba = rows["boosted:gate=vector"]
    assert gba["flop_ratio"] > 1.0 and gba["parameters"] > rows["standard"]["parameters"]
    assert gba["step_over_flop_ratio"] == pytest.approx(gba["step_ratio"] / gba["flop_ratio"])
    assert gba["step_ratio"] == pytest.approx(gba["step_s_all"][0] / rows["standard"]["step_s_all"][0])  # one repeat
    assert gba["step_ratio_range"] == [gba["step_ratio"]] * 2
    assert all(r["peak_memory_bytes"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert [(r["seq_len"], r["variant"]) for r in report["sweep"]] == [
        (32, "standard"),
        (32, "boosted"),
        (64, "standard"),
        (64, "boosted"),
    ]
    assert "dropout 0.05" in (tmp_path / "bench.md").read_text()
    assert "step / FLOP ratio" in capsys.readouterr().out


def test_bench_ratios_follow_their_definitions(monkeypatch):
    """Every ratio in the report recomputed from the report's own raw numbers, with several repeats
    (a single repeat hides which ratios are paired) and a stubbed compile (the side-by-side columns)."""
    import statistics

    from gbattn.bench import speed
    from gbattn.model.decoding import eager_decode_step

    monkeypatch.setattr(speed, "peak_memory_train_step",
                        lambda cfg, batch, seq_len, dev, amp: 3e6 if cfg.attn == "boosted" else 2e6)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    monkeypatch.setattr(speed, "compiled_decode_step", eager_decode_step)
    report = speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=2, seq_len=16, repeats=3,
                             steps=1, decode=4, compile="both", threads=1, quiet=True, sets={"n_layers": 1})
    rows = {r["variant"]: r for r in report["variants"]}
    base, gba = rows["standard"], rows["boosted"]
    paired = sorted(t / t0 for t, t0 in zip(gba["step_s_all"], base["step_s_all"]))
    assert gba["step_ratio"] == pytest.approx(statistics.median(paired))
    assert gba["step_ratio_range"] == pytest.approx([paired[0], paired[-1]])
    assert gba["flop_ratio"] == pytest.approx(gba["train_flops_per_token"] / base["train_flops_per_token"])
    assert gba["memory_ratio"] == pytest.approx(1.5)
    assert gba["decode_ratio"] == pytest.approx(base["decode_tokens_per_s"] / gba["decode_tokens_per_s"])
    compiled = next(r for r in report["variants"] if r["variant"].startswith("boosted") and r["compiled"])
    assert compiled["compiled_decode_speedup"] == pytest.approx(
        compiled["decode_tokens_per_s"] / gba["decode_tokens_per_s"])
    assert compiled["compiled_step_speedup"] == pytest.approx(
        statistics.median(t0 / t for t, t0 in zip(compiled["step_s_all"], gba["step_s_all"])))


def test_bench_timings_follow_a_fake_clock(monkeypatch):
    """A clock that training steps and decodes advance by known amounts: eager steps 0.5 s, compiled
    steps 0.25 s after a 3 s warm-up step each, a decode of 2 s eager and 1 s compiled after a 5 s
    warm-up. The report's per-step times, speedups and compile times follow exactly; standard comes
    first whatever order the variants are given in; FLOPs are counted at the measured length."""
    import types

    from gbattn.bench import speed
    from gbattn.model.params import flops_per_token

    clock, calls = [0.0], {}

    def fake_step(case, x, y, autocast):
        calls[case.label] = calls.get(case.label, 0) + 1
        compiled = case.label.endswith(speed.COMPILED)
        clock[0] += (3.0 if calls[case.label] <= 2 else 0.25) if compiled else 0.5

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        key = ("decode", step is not None, id(model))
        calls[key] = calls.get(key, 0) + 1
        seconds = 2.0 if step is None else 5.0 if calls[key] == 1 else 1.0
        clock[0] += 0.25 + seconds
        return 0.25, seconds

    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(speed, "train_step", fake_step)
    monkeypatch.setattr(speed, "prefill_and_decode", fake_decode)
    monkeypatch.setattr(speed, "peak_memory_train_step", lambda cfg, batch, seq_len, dev, amp: 1e6)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    monkeypatch.setattr(speed, "compiled_decode_step", lambda model: "compiled step")
    report = speed.run_bench("cpu-char", ["boosted", "standard"], device="cpu", batch=2, seq_len=16, repeats=2,
                             steps=3, decode=4, sweep=[8], compile="both", threads=1, quiet=True,
                             sets={"n_layers": 1})
    assert [r["variant"] for r in report["variants"]] == ["standard", "standard · compiled", "boosted",
                                                         "boosted · compiled"]
    rows = {r["variant"]: r for r in report["variants"]}
    for name in ("standard", "boosted"):
        eager, compiled = rows[name], rows[name + speed.COMPILED]
        assert eager["step_s_all"] == [0.5, 0.5] and eager["tokens_per_s"] == 2 * 16 / 0.5
        assert eager["warmup_s"] == {"train_2_steps": 1.0, "decode": 2.0} and eager["decode_tokens_per_s"] == 2.0
        assert compiled["step_s"] == 0.25 and compiled["decode_tokens_per_s"] == 4.0 and compiled["prefill_s"] == 0.25
        assert compiled["compiled_step_speedup"] == 2.0 and compiled["compiled_decode_speedup"] == 2.0
        assert compiled["compile_s"] == {"train": 5.5, "decode": 4.0}
        cfg = speed._variant_config("cpu-char", name, {"n_layers": 1})
        assert eager["forward_flops_per_token"] == flops_per_token(cfg, seq_len=16) != flops_per_token(cfg)
    assert rows["boosted"]["step_ratio"] == 1.0 and rows["boosted"]["flop_ratio"] > 1.0
    assert [(r["variant"], r["step_s"], r["attention_matrix_bytes_per_head"]) for r in report["sweep"]] == [
        ("standard", 0.5, 4 * 8 * 8), ("boosted", 0.5, 4 * 8 * 8)]


def test_bench_command_forwards_every_option(monkeypatch, capsys):
    """`gbattn bench`: each option reaches run_bench in its place; the defaults are paper-small, device
    auto, 5 repeats of 3 steps, bf16 autocast, no compile, the default CPU threads."""
    from gbattn import runtime
    from gbattn.bench import speed

    calls = []
    monkeypatch.setattr(speed, "run_bench", lambda *args: calls.append(args) or {})
    monkeypatch.setattr(speed, "bench_markdown", lambda report: "the table")
    monkeypatch.setattr(runtime, "default_threads", lambda: 7)
    assert cli_main(["bench"]) == 0 and capsys.readouterr().out == "the table\n"
    assert calls[0] == ("paper-small", None, "auto", None, None, 5, 3, None, None, None, None, True, "off", 7, None,
                        False, {})
    assert cli_main(["bench", "--preset", "cpu-char", "--attn", "boosted", "--device", "cpu", "--batch", "2",
                     "--seq-len", "16", "--repeats", "4", "--steps", "6", "--decode", "8", "--sweep", "32", "64",
                     "--sweep-attn", "twicing", "--no-amp", "--compile", "both", "--set", "dropout=0.05",
                     "--threads", "2", "--out", "b", "--quiet"]) == 0
    assert calls[1] == ("cpu-char", ["boosted"], "cpu", 2, 16, 4, 6, None, 8, [32, 64], ["twicing"], False, "both", 2,
                        "b", True, {"dropout": 0.05})
    for option in ("--seq-len", "--batch", "--steps"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["bench", option, "0"])
        assert exit_info.value.code == 2 and f"argument {option}: 0 must be >= 1" in capsys.readouterr().err
    assert len(calls) == 2
