"""Efficiency checks that are not wall-clock: no T x T tensor in any fast path, and the bench
command's report (ratios are computed, never asserted as timings)."""

from __future__ import annotations

import json
import math
import re
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gbattn.attention import AttnArgs, build_attention
from gbattn.cli import main as cli_main
from helpers import load_script, run_cli, stand_in_run


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
    peak = peak_memory_train_step(cfg, batch=2, seq_len=16, device=torch.device("cpu"), amp=False, recomputed=False)
    del parent_ballast
    n = count_params(cfg)
    # fp32 weights + gradients + two AdamW moments, + a parameter-sized temporary of AdamW's foreach kernels (the step
    # is `gbattn train`'s: its optimizer), + a little
    assert 4 * 4 * n <= peak < 4 * 5 * n + 16 * 2**20
    # Loading and initialising the libraries a step uses (about 90 MiB) is not the step's memory: a
    # model of a few thousand parameters at one token peaks at well under a MiB.
    tiny = preset_config("cpu-char", "standard", {"d_model": 16, "n_layers": 1, "n_heads": 1})
    assert peak_memory_train_step(tiny, batch=1, seq_len=1, device=torch.device("cpu"), amp=False,
                                  recomputed=False) < 4 * 2**20
    # recomputing too: its warm-up step recomputes, so loading the checkpointing code (3.5 MiB) is not counted
    assert peak_memory_train_step(tiny, batch=1, seq_len=1, device=torch.device("cpu"), amp=False,
                                  recomputed=True) < 2 * 2**20


def test_a_bench_into_a_folder_another_process_writes_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """Two benches into one --out at once could leave one's bench.json beside the other's bench.md: the folder's
    lock, as a run's, refuses the second writer, before its timings (it was refused only when writing its report,
    its minutes of timings lost: here building a model would fail the test)."""
    import gbattn.bench.speed
    from helpers import hold_lock, in_use

    def no_work(*args, **kwargs):
        raise AssertionError("the bench built a model before taking its folder's lock")

    monkeypatch.setattr(gbattn.bench.speed, "GPT", no_work)
    holder = hold_lock(tmp_path / "b", "benchmark")
    try:
        assert cli_main(["bench", "--preset", "cpu-char", "--attn", "standard", "--repeats", "1", "--steps", "1",
                         "--batch", "2", "--decode", "2", "--set", "n_layers=1", "--set", "d_model=32", "--set",
                         "n_heads=2", "--out", str(tmp_path / "b"), "--quiet", "--threads", "1"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == in_use(tmp_path / "b", "benchmark")
        assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()


def test_bench_command_report(tmp_path, capsys, monkeypatch):
    from gbattn.bench import speed

    # The CPU memory probe (a subprocess per case) is tested above; here it is stubbed for speed.
    probed = []
    monkeypatch.setattr(speed, "peak_memory_train_step",
                        lambda cfg, batch, seq_len, dev, amp, recomputed=False, **_:
                        probed.append(cfg) or 1e6 * cfg.d_model)
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
    # provenance: every version that produced the figures, as other results files record them, and in bench.md
    from gbattn.runtime import software_versions

    versions = software_versions()
    assert report["versions"] == versions and report["threads"] == torch.get_num_threads()
    assert f"gbattn {versions['gbattn']} · torch {versions['torch']} · Python {versions['python']}" in (
        tmp_path / "bench.md").read_text()
    out = capsys.readouterr().out
    assert "step / FLOP ratio" in out
    assert out == (tmp_path / "bench.md").read_text()  # what is printed is what is written (no extra blank line)
    # no absolute path of this machine in either file (the command records --out as given, made relative)
    assert str(tmp_path) not in (tmp_path / "bench.json").read_text() + (tmp_path / "bench.md").read_text()


def test_bench_ratios_follow_their_definitions(monkeypatch):
    """Every ratio in the report recomputed from the report's own raw numbers, with several repeats
    (a single repeat hides which ratios are paired) and a stubbed compile (the side-by-side columns)."""
    import statistics

    from gbattn.bench import speed
    from gbattn.model.decoding import eager_decode_step

    monkeypatch.setattr(speed, "peak_memory_train_step",
                        lambda cfg, batch, seq_len, dev, amp, recomputed=False, **_:
                        3e6 if cfg.attn == "boosted" else 2e6)
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
    assert gba["step_over_flop_ratio"] == pytest.approx(gba["step_ratio"] / gba["flop_ratio"])
    assert gba["memory_ratio"] == pytest.approx(1.5)
    assert gba["decode_ratio"] == pytest.approx(base["decode_tokens_per_s"] / gba["decode_tokens_per_s"])
    # a compiled row's ratios are to standard compiled (to eager standard they would fold in the compile speedup)
    compiled_base, compiled = (rows[name + speed.COMPILED] for name in ("standard", "boosted"))
    paired = sorted(t / t0 for t, t0 in zip(compiled["step_s_all"], compiled_base["step_s_all"]))
    assert compiled_base["step_ratio"] == 1.0 and compiled_base["decode_ratio"] == 1.0
    assert compiled["step_ratio"] == pytest.approx(statistics.median(paired))
    assert compiled["step_ratio_range"] == pytest.approx([paired[0], paired[-1]])
    assert compiled["flop_ratio"] == pytest.approx(gba["flop_ratio"])
    assert compiled["decode_ratio"] == pytest.approx(
        compiled_base["decode_tokens_per_s"] / compiled["decode_tokens_per_s"])
    assert compiled["compiled_decode_speedup"] == pytest.approx(
        compiled["decode_tokens_per_s"] / gba["decode_tokens_per_s"])
    assert compiled["compiled_step_speedup"] == pytest.approx(
        statistics.median(t0 / t for t, t0 in zip(compiled["step_s_all"], gba["step_s_all"])))


def test_a_memory_ratio_to_a_standard_without_a_memory_figure_is_none():
    """The CPU probe can measure no growth (0 bytes) for standard: its variants' memory ratio is none (—), not a
    ZeroDivisionError after every timing; a row measured as 0 has none either."""
    from gbattn.bench.speed import add_ratios_to_standard

    def row(memory):
        return {"compiled": False, "activation_checkpointing": False, "step_s_all": [1.0], "train_flops_per_token": 1.0,
                "peak_memory_bytes": memory, "decode_tokens_per_s": 1.0}

    rows = [row(0.0), row(2e6)]
    add_ratios_to_standard(rows)
    assert [r["memory_ratio"] for r in rows] == [None, None]
    rows = [row(2e6), row(0.0)]
    add_ratios_to_standard(rows)
    assert [r["memory_ratio"] for r in rows] == [1.0, None]


def fake_timings(monkeypatch, clock, fake_step, fake_decode) -> None:
    """bench on a fake clock: ``fake_step``/``fake_decode`` advance ``clock[0]``; memory 1e6 bytes;
    torch.compile and the compiled decode step are stand-ins."""
    import types

    from gbattn.bench import speed

    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(speed, "train_step", fake_step)
    monkeypatch.setattr(speed, "prefill_and_decode", fake_decode)
    monkeypatch.setattr(speed, "peak_memory_train_step", lambda cfg, batch, seq_len, dev, amp, recomputed=False,
                        **_: 1e6)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    monkeypatch.setattr(speed, "compiled_decode_step", lambda model: "compiled step")


def steady_timings(monkeypatch, step_s: float) -> None:
    """:func:`fake_timings` where every training step takes ``step_s`` and every decode 0.5 s of prefill and
    0.5 s of decoding."""
    clock = [0.0]

    def fake_step(case, x, y, autocast):
        clock[0] += step_s

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        clock[0] += 1.0
        return 0.5, 0.5

    fake_timings(monkeypatch, clock, fake_step, fake_decode)


def test_bench_timings_follow_a_fake_clock(monkeypatch):
    """A clock that training steps and decodes advance by known amounts: eager steps 0.5 s, compiled
    steps 0.25 s after two warm-up rounds of two steps (3 s, then 1 s each: a variant compiled after another
    compiles again in its second round), a decode of 2 s eager and 1 s compiled after warm-ups of 5 s and 2 s. The
    report's per-step times, speedups and compile times (both rounds' time over the steps') follow exactly; standard
    comes first whatever order the variants are given in; FLOPs are counted at the measured length."""

    from gbattn.bench import speed
    from gbattn.model.params import flops_per_token

    clock, calls = [0.0], {}

    def fake_step(case, x, y, autocast):
        calls[case.label] = calls.get(case.label, 0) + 1
        compiled = case.label.endswith(speed.COMPILED)
        clock[0] += (3.0 if calls[case.label] <= 2 else 1.0 if calls[case.label] <= 4 else 0.25) if compiled else 0.5

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        key = ("decode", step is not None, id(model))
        calls[key] = calls.get(key, 0) + 1
        seconds = 2.0 if step is None else 5.0 if calls[key] == 1 else 2.0 if calls[key] == 2 else 1.0
        clock[0] += 0.25 + seconds
        return 0.25, seconds

    fake_timings(monkeypatch, clock, fake_step, fake_decode)
    report = speed.run_bench("cpu-char", ["boosted", "standard"], device="cpu", batch=2, seq_len=16, repeats=2,
                             steps=3, decode=4, sweep=[8], compile="both", threads=None, quiet=True,
                             sets={"n_layers": 1})
    # what it ran at: threads=None is torch's own count, recorded as that count
    assert (report["batch"], report["seq_len"], report["threads"]) == (2, 16, torch.get_num_threads())
    assert [r["variant"] for r in report["variants"]] == ["standard", "standard · compiled", "boosted",
                                                         "boosted · compiled"]
    rows = {r["variant"]: r for r in report["variants"]}
    for name in ("standard", "boosted"):
        eager, compiled = rows[name], rows[name + speed.COMPILED]
        assert eager["step_s_all"] == [0.5, 0.5] and eager["tokens_per_s"] == 2 * 16 / 0.5
        assert eager["warmup_s"] == {"train_2_steps": 1.0, "decode": 2.0} and eager["decode_tokens_per_s"] == 2.0
        assert compiled["step_s"] == 0.25 and compiled["decode_tokens_per_s"] == 4.0 and compiled["prefill_s"] == 0.25
        assert compiled["compiled_step_speedup"] == 2.0 and compiled["compiled_decode_speedup"] == 2.0
        assert compiled["compile_s"] == {"train": 5.5 + 1.5, "decode": 4.0 + 1.0}
        cfg = speed._variant_config("cpu-char", name, {"n_layers": 1})
        assert eager["forward_flops_per_token"] == flops_per_token(cfg, seq_len=16) != flops_per_token(cfg)
    assert rows["boosted"]["step_ratio"] == 1.0 and rows["boosted"]["flop_ratio"] > 1.0
    assert [(r["variant"], r["step_s"], r["attention_matrix_bytes_per_head"]) for r in report["sweep"]] == [
        ("standard", 0.5, 4 * 8 * 8), ("boosted", 0.5, 4 * 8 * 8)]


def test_bench_runs_on_the_threads_it_is_given_and_records_them(monkeypatch):
    """threads=N: every timed step runs on N threads, and the report records N (the count the timings are of)."""
    from gbattn.bench import speed

    clock, seen = [0.0], set()

    def fake_step(case, x, y, autocast):
        seen.add(torch.get_num_threads())
        clock[0] += 0.5

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        clock[0] += 1.0
        return 0.5, 0.5

    fake_timings(monkeypatch, clock, fake_step, fake_decode)
    threads = torch.get_num_threads()
    try:
        report = speed.run_bench("cpu-char", ["standard"], device="cpu", batch=1, seq_len=8, repeats=1, steps=1,
                                 decode=2, threads=threads + 1, quiet=True, sets={"n_layers": 1})
    finally:
        torch.set_num_threads(threads)
    assert seen == {threads + 1} and report["threads"] == threads + 1


def test_bench_warns_of_more_threads_than_cores_as_train_does(monkeypatch, capsys):
    """`bench --threads 3` on 2 usable cores ran on 3 threads without a word, where train, eval and generate warn
    (README, "Threads"): bench sets its threads through runtime.set_threads, the one place that warns; as many
    threads as cores say nothing."""
    from gbattn import runtime

    steady_timings(monkeypatch, 0.5)
    monkeypatch.setattr(runtime, "usable_cpus", lambda: {0, 1})
    argv = ["bench", "--preset", "cpu-char", "--device", "cpu", "--attn", "standard", "--repeats", "1", "--steps",
            "1", "--batch", "1", "--seq-len", "8", "--decode", "2", "--set", "n_layers=1", "--quiet", "--threads"]
    before = torch.get_num_threads()
    try:
        code, out, err = run_cli(capsys, argv + ["3"])
        assert (code, err) == (0, "warning: threads=3 is more than the 2 cores this process may use: the threads "
                                  "beyond them take turns on the cores, which slows every step (README, \"Threads\")\n")
        assert "(3 threads" in out  # still run on the threads asked for
        assert run_cli(capsys, argv + ["2"])[::2] == (0, "")
    finally:
        torch.set_num_threads(before)


def test_bench_rows_may_fill_the_block_size_and_no_more(monkeypatch):
    """--seq-len equal to the block size is a row the model takes whole (timed); one token more is one line."""
    from gbattn.bench import speed
    from gbattn.errors import UserError

    steady_timings(monkeypatch, 0.5)
    options = dict(device="cpu", batch=1, repeats=1, steps=1, decode=2, quiet=True,
                   sets={"n_layers": 1, "block_size": 8})
    report = speed.run_bench("cpu-char", ["standard"], seq_len=8, **options)
    assert report["seq_len"] == 8 and report["sets"] == {"n_layers": 1, "block_size": 8}  # the model benched
    with pytest.raises(UserError, match="^--seq-len 9 exceeds the block size 8 from --set block_size=8$"):
        speed.run_bench("cpu-char", ["standard"], seq_len=9, **options)


def test_bench_progress_counts_every_round_of_every_variant_warm_up_included(monkeypatch, capsys):
    """Off a terminal the bench's progress line ends at its total: each variant's warm-up round and its repeats
    (2 variants x (3 + 1) rounds = 8), never a count past the total."""
    from gbattn.bench import speed

    steady_timings(monkeypatch, 0.5)
    speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=1, seq_len=8, repeats=3, steps=1,
                    decode=2, threads=1, quiet=False, sets={"n_layers": 1})
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench cpu-char on cpu: ")]
    assert lines[-1] == "bench cpu-char on cpu: 8/8 rounds"


def test_a_dynamo_error_of_an_eager_row_is_raised_not_reported_as_a_failed_compile(monkeypatch):
    """Only a compiled row is left out when torch.compile fails: an eager row that raises dynamo's error (code it
    runs that compiles itself) is a failure of the bench, raised, not a row left out as "torch.compile failed"."""
    from gbattn.bench import speed

    clock = [0.0]

    def fake_step(case, x, y, autocast):
        raise torch._dynamo.exc.TorchDynamoException("inside an eager step")

    fake_timings(monkeypatch, clock, fake_step, lambda *args, **kwargs: (0.5, 0.5))
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="inside an eager step"):
        speed.run_bench("cpu-char", ["standard"], device="cpu", batch=1, seq_len=8, repeats=1, steps=1, decode=2,
                        quiet=True, sets={"n_layers": 1})


def test_bench_reports_the_median_prefill_and_no_negative_compile_time(monkeypatch):
    """Prefills of 1, 1 and 7 s over three repeats: 1 s, their median (the mean, 3 s, lets one slow repeat through).
    Warm-up decodes faster than the measured ones (0.5 s against 2 s) compiled in no time: 0, never negative."""
    from gbattn.bench import speed

    clock, calls = [0.0], []

    def fake_step(case, x, y, autocast):
        clock[0] += 0.5

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        prefill, decode = [(9.0, 0.5), (9.0, 0.5), (1.0, 2.0), (1.0, 2.0), (7.0, 2.0)][len(calls)]  # 2 warm-ups
        calls.append(step)
        clock[0] += prefill + decode
        return prefill, decode

    fake_timings(monkeypatch, clock, fake_step, fake_decode)
    report = speed.run_bench("cpu-char", ["standard"], device="cpu", batch=1, seq_len=8, repeats=3, steps=1, decode=2,
                             compile="on", quiet=True, sets={"n_layers": 1})
    (row,) = report["variants"]
    assert row["prefill_s_all"] == [1.0, 1.0, 7.0] and row["prefill_s"] == 1.0
    assert row["compile_s"]["decode"] == 0.0


def test_bench_rows_are_block_size_minus_one_tokens_by_default(monkeypatch):
    """Without --seq-len a row is block_size - 1 tokens, as in training (input and its shifted target fit the
    block), and the FLOPs per token are counted at that length."""
    from gbattn.bench import speed
    from gbattn.model.params import flops_per_token

    steady_timings(monkeypatch, 1.0)
    sets = {"n_layers": 1, "block_size": 16}
    report = speed.run_bench("cpu-char", ["standard"], device="cpu", batch=2, repeats=1, steps=1, decode=4,
                             threads=1, quiet=True, sets=sets)
    (row,) = report["variants"]
    assert report["seq_len"] == 15 and row["tokens_per_s"] == 2 * 15 / 1.0
    assert row["forward_flops_per_token"] == flops_per_token(speed._variant_config("cpu-char", "standard", sets), 15)


def test_bench_command_forwards_every_option(monkeypatch, capsys):
    """`gbattn bench`: each option reaches run_bench in its place; the defaults are paper-small, device
    auto, 5 repeats of 3 steps, bf16 autocast, no compile, the default CPU threads."""
    from gbattn import runtime
    from gbattn.bench import speed

    calls = []
    monkeypatch.setattr(speed, "run_bench", lambda *args: calls.append(args) or {})
    monkeypatch.setattr(speed, "bench_markdown", lambda report: "the table\n")
    monkeypatch.setattr(runtime, "default_threads", lambda: 7)
    assert cli_main(["bench"]) == 0 and capsys.readouterr().out == "the table\n"
    assert calls[0] == ("paper-small", None, "auto", None, None, 5, 3, None, None, None, None, True, "off", 7, None,
                        False, {}, "off")
    assert cli_main(["bench", "--preset", "cpu-char", "--attn", "boosted", "--device", "cpu", "--batch", "2",
                     "--seq-len", "16", "--repeats", "4", "--steps", "6", "--decode", "8", "--sweep", "32", "64",
                     "--sweep-attn", "twicing", "--no-amp", "--compile", "both", "--set", "dropout=0.05",
                     "--threads", "2", "--out", "b", "--quiet", "--activation-checkpointing", "on"]) == 0
    assert calls[1] == ("cpu-char", ["boosted"], "cpu", 2, 16, 4, 6, None, 8, [32, 64], ["twicing"], False, "both", 2,
                        "b", True, {"dropout": 0.05}, "on")
    for option in ("--seq-len", "--batch", "--steps", "--repeats", "--decode", "--sweep"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["bench", option, "0"])
        assert exit_info.value.code == 2 and f"argument {option}: 0 must be >= 1" in capsys.readouterr().err
    assert len(calls) == 2


def test_bench_out_holding_a_run_or_a_comparison_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """`bench --out RUN` wrote bench.json and bench.md into a run directory (and into a comparison), where they
    read as that run's measurement; like every command writing a folder it is now one line, nothing written.
    So did a bench.json or bench.md that `gbattn bench` did not write (someone's own notes, replaced unasked):
    refused the same way. A folder of an earlier bench is still rewritten."""
    from gbattn.bench import speed

    monkeypatch.setattr(speed, "train_step", lambda *a, **k: pytest.fail("timed before --out was checked"))
    run = stand_in_run(tmp_path / "run")
    comparison = tmp_path / "cmp"
    comparison.mkdir()
    (comparison / "recipe.json").write_text("{}")
    foreign = {}
    for name, files in {"other-json": {"bench.json": '{"mine": 1}', "bench.md": "# my bench"},
                        "list-json": {"bench.json": "[1]"}, "notes": {"bench.md": "# my notes"},
                        # another program's command, or gbattn bench's without its list of rows
                        "other-command": {"bench.json": '{"command": "my-bench --fast", "variants": []}'},
                        "no-rows": {"bench.json": '{"command": "gbattn bench --preset cpu-char", "variants": {}}'}
                        }.items():
        foreign[name] = tmp_path / name
        foreign[name].mkdir()
        for file, text in files.items():
            (foreign[name] / file).write_text(text)
    for out, held in ((run, "a run"), (comparison, "a `gbattn compare` comparison"),
                      (foreign["other-json"], "a bench.json that `gbattn bench` did not write"),
                      (foreign["list-json"], "a bench.json that gbattn cannot read (it holds list, expected a JSON "
                                             "object)"),
                      (foreign["notes"], "a bench.md without the bench.json gbattn writes beside it"),
                      (foreign["other-command"], "a bench.json that `gbattn bench` did not write"),
                      (foreign["no-rows"], "a bench.json that `gbattn bench` did not write")):
        before = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
        assert cli_main(["bench", "--preset", "cpu-char", "--device", "cpu", "--out", str(out), "--quiet"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"gbattn: error: --out {out} holds {held}, not a folder for bench.json and bench.md: choose another --out"]
        assert {p.name: p.read_text() for p in out.iterdir() if p.is_file()} == before
    earlier = tmp_path / "bench"
    earlier.mkdir()
    (earlier / "bench.json").write_text('{"command": "gbattn bench --preset cpu-char", "variants": []}')
    (earlier / "bench.md").write_text("x")
    assert speed.check_out(earlier, (), "a folder for bench.json and bench.md") is None
    # a bench refused for its options leaves no --out behind (it was made before they were checked)
    for bad in (["--set", "n_heads=3"], ["--attn", "bogus"]):
        assert cli_main(["bench", "--preset", "cpu-char", "--device", "cpu", "--out", str(tmp_path / "new" / "sub"),
                         "--quiet", *bad]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not (tmp_path / "new").exists()


def test_bench_takes_medians_of_uneven_timings_and_labels_its_counts(monkeypatch):
    """Timings that differ from repeat to repeat (a constant clock hides mean, min and first-value
    bugs): per-step times are medians, paired ratios and their range follow the repeats, a compiled
    warm-up faster than two steps is no negative compile time. The defaults (batch 8 on CPU, a prefill
    of what the block size leaves) and the counts are labelled as run; only eager rows are probed for
    memory, compiled rows train through torch.compile's model, the FLOP ratio is of training FLOPs;
    the sweep trains at its own length (beyond the preset's block size) after a warm-up step."""
    import types

    from gbattn.bench import speed
    from gbattn.model.params import flops_per_token

    class Compiled:
        def __init__(self, model):
            self.model = model

    # seconds per training step, in call order: 2 warm-up steps (twice for a compiled row), then 2 steps in each of
    # 3 repeats
    steps = {"standard": [0.5, 0.5, 0.375, 0.375, 1.0, 1.0, 0.5, 0.5],
             "boosted": [0.5, 0.5, 0.75, 0.75, 1.0, 1.0, 2.0, 2.0],
             "standard · compiled": [0.125, 0.125, 0.125, 0.125, 0.1875, 0.1875, 0.5, 0.5, 0.25, 0.25],
             "boosted · compiled": [3.0, 3.0, 0.25, 0.25, 0.375, 0.375, 0.5, 0.5, 1.0, 1.0]}
    sweep_steps = [4.0, 1.0, 3.0, 2.5]  # a warm-up step, then 3 timed ones (the median of 2 of them is not 2.5)
    clock, seen, decodes, probed, kept = [0.0], {}, [], [], []

    def fake_step(case, x, y, autocast):
        kept.append(case.model)  # no id is reused while the test runs
        if x.shape == (1, 128):  # a sweep case: a fresh model each
            key, schedule = ("sweep", id(case.model)), sweep_steps
        else:
            assert x.shape == (8, 16)
            key, schedule = case.label, steps[case.label]
            compiled = case.label.endswith(speed.COMPILED)
            assert isinstance(case.model, Compiled) == compiled, case.label
        seen[key] = seen.get(key, 0) + 1
        clock[0] += schedule[seen[key] - 1]

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        decodes.append((tuple(prompt.shape), n_decode))
        kept.append(model)
        n = seen[id(model)] = seen.get(id(model), 0) + 1
        if step is not None:  # a compiled row: its second warm-up round decodes too
            n = max(1, n - 1)
        prefill, decode = [0.25, 0.75, 0.25, 0.5][n - 1], [2.0, 1.0, 4.0, 2.0][n - 1]
        clock[0] += prefill + decode
        return prefill, decode

    def fake_probe(cfg, batch, seq_len, dev, amp, recomputed, training=None):
        probed.append((cfg.attn, cfg.block_size, batch, seq_len, recomputed))
        return 1e6

    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(speed, "train_step", fake_step)
    monkeypatch.setattr(speed, "prefill_and_decode", fake_decode)
    monkeypatch.setattr(speed, "peak_memory_train_step", fake_probe)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: Compiled(model))
    monkeypatch.setattr(speed, "compiled_decode_step", lambda model: "compiled step")
    report = speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", seq_len=16, repeats=3, steps=2,
                             decode=4, sweep=[128], compile="both", threads=1, quiet=True, sets={"n_layers": 1})
    assert (report["batch"], report["repeats"], report["steps_per_repeat"]) == (8, 3, 2)
    assert (report["prefill_tokens"], report["decode_tokens"], report["amp_bf16"]) == (60, 4, False)
    assert set(decodes) == {((1, 60), 4)} and len(decodes) == 4 * 4 + 2
    rows = {r["variant"]: r for r in report["variants"]}
    standard, boosted = rows["standard"], rows["boosted"]
    assert standard["step_s_all"] == [0.375, 1.0, 0.5] and standard["step_s"] == 0.5
    assert standard["tokens_per_s"] == 8 * 16 / 0.5 and standard["prefill_s"] == 0.5
    assert standard["decode_tokens_per_s"] == 4 / 2.0
    # each repeat's prefill and decode seconds are kept (the warm-up's are not), so their spread can be read
    assert standard["prefill_s_all"] == [0.75, 0.25, 0.5] and standard["decode_s_all"] == [1.0, 4.0, 2.0]
    assert boosted["step_ratio"] == 2.0 and boosted["step_ratio_range"] == [1.0, 4.0]  # 2, 1, 4 in the repeats
    assert boosted["decode_ratio"] == 1.0
    fast, slow = rows["standard · compiled"], rows["boosted · compiled"]
    assert fast["step_s"] == 0.25 and fast["compiled_step_speedup"] == 2.0
    assert fast["compile_s"] == {"train": 0.0, "decode": 0.0}  # a warm-up of 0.25 s is under two 0.25 s steps
    assert slow["compile_s"] == {"train": 5.0, "decode": 0.0} and slow["compiled_step_speedup"] == 2.0
    assert [r["peak_memory_bytes"] for r in report["variants"]] == [1e6, None, 1e6, None]
    for row in report["variants"]:
        cfg = speed._variant_config("cpu-char", row["variant"].removesuffix(speed.COMPILED), {"n_layers": 1})
        assert row["train_flops_per_token"] == flops_per_token(cfg, seq_len=16, backward=True)
    # memory probes: the eager rows at (batch 8, 16 tokens), then the sweep at (1, 128) with a block of 128, each
    # keeping its activations (activation checkpointing is off here; the sweep never recomputes)
    assert probed == [("standard", 64, 8, 16, False), ("boosted", 64, 8, 16, False), ("standard", 128, 1, 128, False),
                      ("boosted", 128, 1, 128, False)]
    assert [(r["variant"], r["step_s"]) for r in report["sweep"]] == [("standard", 2.5), ("boosted", 2.5)]


def test_prefill_and_decode_times_each_part_and_decodes_every_token(monkeypatch):
    """One prefill, then exactly n_decode cached steps at positions T, T+1, ...; the prefill's and the
    decode's seconds each from their own clock readings; the model is back in training mode with no
    cache afterwards."""
    import contextlib
    import types

    from gbattn.bench import speed
    from gbattn.config import preset_config
    from gbattn.model.decoding import eager_decode_step
    from gbattn.model.gpt import GPT

    model = GPT(preset_config("cpu-char", "standard", {"n_layers": 1, "d_model": 32, "n_heads": 2, "dropout": 0.1}))
    readings = iter([10.0, 10.5, 13.0])
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    eager, positions, states = eager_decode_step(model), [], set()

    def step(token, slot, position, padding):
        positions.append(slot.tolist())
        # as generate decodes: no dropout, no autograd graph, a cache of the prompt and the new tokens (5 + 4)
        states.add((model.training, torch.is_grad_enabled(), model.kv_cache.max_len))
        return eager(token, slot, position, padding)

    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5))
    prefill_s, decode_s = speed.prefill_and_decode(model, prompt, 4, torch.device("cpu"), contextlib.nullcontext,
                                                   step)
    assert (prefill_s, decode_s) == (0.5, 2.5)
    assert positions == [[5], [6], [7], [8]] and states == {(False, False, 9)}
    assert model.training and not model.has_cache


def test_bench_prefill_and_decode_defaults_fit_the_block_size():
    """Decode 64 tokens (half the block when smaller) after a prompt of up to 128 tokens; a decode that
    leaves no prompt, or a prefill and decode together beyond the block, is a one-line error."""
    from gbattn.bench.speed import _prefill_and_decode_lengths, run_bench
    from gbattn.errors import UserError

    assert _prefill_and_decode_lengths("of preset p", 1024, None, None) == (128, 64)
    assert _prefill_and_decode_lengths("of preset p", 64, None, None) == (32, 32)
    assert _prefill_and_decode_lengths("of preset p", 64, None, 63) == (1, 63)
    assert _prefill_and_decode_lengths("of preset p", 64, 40, 24) == (40, 24)  # exactly the block
    with pytest.raises(UserError, match="--decode 64 leaves no room for a prompt within the block size 64"):
        _prefill_and_decode_lengths("of preset p", 64, None, 64)
    with pytest.raises(UserError, match="a prefill of 41 tokens and 24 decode steps exceed the block size 64"):
        _prefill_and_decode_lengths("of preset p", 64, 41, 24)
    # a block of one token: the hints were --decode 0 (refused by the option) and --set seq_len=1 (a train field)
    with pytest.raises(UserError, match="^the block size 1 of preset p holds no prompt and decode step together: bench "
                                        "needs a block size of 2 or more$"):
        _prefill_and_decode_lengths("of preset p", 1, None, None)
    with pytest.raises(UserError, match="^the block size 1 from --set block_size=1 holds no prompt and decode step "
                                        "together: bench needs a block size of 2 or more$"):
        run_bench("cpu-char", ["standard"], device="cpu", repeats=1, steps=1, threads=1, quiet=True,
                  sets={"block_size": 1})
    # a block size from --set is named as such, not as the preset's (cpu-char's is 64)
    with pytest.raises(UserError, match="^--seq-len 40 exceeds the block size 32 from --set block_size=32$"):
        run_bench("cpu-char", ["standard"], device="cpu", seq_len=40, threads=1, quiet=True, sets={"block_size": 32})
    with pytest.raises(UserError, match="^--decode 32 leaves no room for a prompt within the block size 32 from --set "
                                        "block_size=32; use at most --decode 31$"):
        run_bench("cpu-char", ["standard"], device="cpu", decode=32, threads=1, quiet=True, sets={"block_size": 32})
    with pytest.raises(UserError, match="^--seq-len 65 exceeds the block size 64 of preset cpu-char$"):
        run_bench("cpu-char", ["standard"], device="cpu", seq_len=65, threads=1, quiet=True)


def test_a_bench_training_step_learns_and_clears_its_gradients():
    """The timed step is a whole training step: backward and an optimizer update (the weights move),
    gradients cleared for the next one; variant options are parsed values."""
    import contextlib

    from gbattn.bench.speed import Case, parse_variant, train_step
    from gbattn.config import preset_config
    from gbattn.errors import UserError
    from gbattn.model.gpt import GPT

    assert parse_variant("boosted:rounds=3,kv_source=shared") == ("boosted", {"rounds": 3, "kv_source": "shared"})
    assert parse_variant("standard") == ("standard", {})
    # a list option of several layers: its commas were read as separators ("options are key=value")
    assert parse_variant("twicing:layers=[-2,-1]") == ("twicing", {"layers": [-2, -1]})
    assert parse_variant("boosted:layers=[0, 1],rounds=3,gate=vector") == (
        "boosted", {"layers": [0, 1], "rounds": 3, "gate": "vector"})
    with pytest.raises(UserError, match="options are key=value"):
        parse_variant("boosted:rounds")
    # a value is everything after the first "=": gate=tanh=x is refused as a gate, not benched as tanh
    assert parse_variant("boosted:gate=tanh=x") == ("boosted", {"gate": "tanh=x"})
    model = GPT(preset_config("cpu-char", "standard", {"n_layers": 1, "d_model": 32, "n_heads": 2}))
    before = [p.detach().clone() for p in model.parameters()]
    case = Case("standard", model.cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    train_step(case, x, x, contextlib.nullcontext)
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before) if p.dim() > 1)

    # It is `gbattn train`'s step: the gradients are clipped before AdamW's update (the bench skipped the clipping and
    # its host sync). Clipped to a norm of 1e-20, AdamW's eps swamps the gradients and the weights barely move; and
    # no update is made on a non-finite loss, as the trainer makes none.
    def moved(grad_clip: float, scale: float = 1.0) -> float:
        torch.manual_seed(0)
        model = GPT(preset_config("cpu-char", "standard", {"n_layers": 1, "d_model": 32, "n_heads": 2}))
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
        before = [p.detach().clone() for p in model.parameters()]
        case = Case("standard", model.cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0),
                    grad_clip=grad_clip)
        train_step(case, x, x, contextlib.nullcontext)
        if not all(torch.equal(p, b) for p, b in zip(model.parameters(), before)):  # (inf - inf is nan)
            return max((p - b).abs().max().item() for p, b in zip(model.parameters(), before))
        return 0.0

    assert moved(0.0) > 5e-3 and moved(1.0) > 5e-3  # (AdamW's first step moves by about lr, clipped to 1 or not)
    assert moved(1e-20) < 1e-6
    assert moved(0.0, scale=math.inf) == 0.0


def test_bench_markdown_follows_the_report():
    """The tables of a report written out by hand: ms from seconds, MiB from bytes, the ratio columns
    in their places, the compiled table pairing each variant with its eager row, the sweep."""
    from gbattn.bench.speed import bench_markdown

    def row(variant, **values):
        return dict(variant=variant, parameters=1_234_567, forward_flops_per_token=2.5e6, compiled=False, **values)

    report = {
        "preset": "cpu-char", "device": "cpu (1 thread)", "command": "gbattn bench --compile both", "torch": "9.9",
        "batch": 2, "seq_len": 16, "repeats": 3, "steps_per_repeat": 4, "dropout": 0.0, "amp_bf16": False,
        "compile": "both", "prefill_tokens": 32, "decode_tokens": 8,
        "variants": [
            row("standard", step_s=0.0125, tokens_per_s=2560.0, peak_memory_bytes=3 * 2**20, step_ratio=1.0,
                step_ratio_range=[1.0, 1.0], flop_ratio=1.0, step_over_flop_ratio=1.0, memory_ratio=1.0,
                prefill_s=0.002, decode_tokens_per_s=400.0, decode_ratio=1.0),
            dict(row("standard · compiled", step_s=0.005, tokens_per_s=6400.0, peak_memory_bytes=None,
                     step_ratio=0.4, step_ratio_range=[0.35, 0.5], flop_ratio=1.0, step_over_flop_ratio=0.4,
                     memory_ratio=None, prefill_s=0.001, decode_tokens_per_s=1000.0, decode_ratio=0.4),
                 compiled=True, compiled_step_speedup=2.5, compiled_decode_speedup=2.5,
                 compile_s={"train": 12.0, "decode": 3.0}),
            row("boosted", step_s=0.025, tokens_per_s=1280.0, peak_memory_bytes=6 * 2**20, step_ratio=2.0,
                step_ratio_range=[1.5, 2.5], flop_ratio=1.6, step_over_flop_ratio=1.25, memory_ratio=2.0,
                prefill_s=0.004, decode_tokens_per_s=250.0, decode_ratio=1.6),
        ],
        "sweep": [{"seq_len": 128, "variant": "standard", "step_s": 0.002, "peak_memory_bytes": 3 * 2**20,
                   "attention_matrix_bytes_per_head": 4 * 128 * 128},
                  {"seq_len": 2048, "variant": "standard", "step_s": 0.05, "peak_memory_bytes": 40 * 2**20,
                   "attention_matrix_bytes_per_head": 4 * 2048 * 2048},
                  {"seq_len": 768, "variant": "standard", "step_s": 0.01, "peak_memory_bytes": 12 * 2**20,
                   "attention_matrix_bytes_per_head": 4 * 768 * 768}],
    }
    text = bench_markdown(report)
    assert text.endswith(" |\n")  # bench.md ends its last line (the sweep's last row)
    lines = text.splitlines()
    assert lines[0] == "# gbattn bench: cpu-char on cpu (1 thread)"
    assert lines[2] == ("Command: `gbattn bench --compile both` · torch 9.9 · batch 2 x 16 tokens · median of 3 "
                        "interleaved repeats of 4 steps · dropout 0 · torch.compile: both")
    assert lines[6:9] == [
        "| standard | 1,234,567 | 12.5 | 2,560 | 3 | 2.50 | 1.000 (1.00–1.00) | 1.000 | 1.000 | 1.00 | 2.0 | 400 | "
        "1.00 |",
        "| standard · compiled | 1,234,567 | 5.0 | 6,400 | — | 2.50 | 0.400 (0.35–0.50) | 1.000 | 0.400 | — | 1.0 | "
        "1,000 | 0.40 |",
        "| boosted | 1,234,567 | 25.0 | 1,280 | 6 | 2.50 | 2.000 (1.50–2.50) | 1.600 | 1.250 | 2.00 | 4.0 | 250 | "
        "1.60 |",
    ]
    # a compiled row's prefill and the sweep run eagerly, and say so (they read as compiled timings)
    assert lines[10].endswith("(prefill of 32 tokens, then 8 cached steps, batch 1). A compiled row's ratios are to "
                              "standard compiled; its prefill runs eagerly (only the training and decode steps are "
                              "compiled). Peak memory is measured on the eager training step only, so a compiled "
                              "row has none (—).")
    # which step was timed: a report of an earlier bench (no grad_clip) says its step was not `gbattn train`'s
    assert lines[12] == ("Step: forward, backward and AdamW over all parameters, as `gbattn bench` timed it before "
                         "its step became `gbattn train`'s: without the gradient clipping and the host sync of every "
                         "training step, and on a CPU with AdamW's per-parameter loop where `gbattn train` runs its "
                         "foreach kernels.")
    assert lines[14] == "## Compiled vs eager (torch.compile; CUDA graphs for decoding on CUDA)"
    assert lines[18] == "| standard | 12.5 | 5.0 | 2.50 | 400 | 1,000 | 2.50 | 12 / 3 |"
    assert lines[22] == "## Sequence-length sweep (batch 1, one training step, eager)"
    assert lines[26] == "| 128 | standard | 2.0 | 3 | 0.062 |"  # 64 KiB, not rounded to 0 MiB
    assert lines[27] == "| 2,048 | standard | 50.0 | 40 | 16 |"
    assert lines[28] == "| 768 | standard | 10.0 | 12 | 2.2 |"  # 2.25 MiB: two digits below 10 MiB, not "2"
    assert lines[-1] == lines[28]
    assert bench_markdown({**report, "grad_clip": 1.0}).splitlines()[12] == (
        "Step: `gbattn train`'s at grad_accum 1: forward, backward, the gradients clipped at norm 1 with the loss and "
        "the norm read in one host sync, then AdamW with cpu-char's parameter groups (fused on CUDA, foreach kernels "
        "on a CPU).")
    assert "the gradient norm taken (grad_clip 0: no clipping)" in bench_markdown({**report, "grad_clip": 0.0})
    # a machine busy with other work while it timed (this process got under 80% of its threads' time): said
    busy = bench_markdown({**report, "other_busy_cores": 1.26}).splitlines()
    assert busy[14] == ("While timing, other work kept about 1.3 of the cores this process may use busy: its steps are "
                        "slower, and their ratios noisier, than on an idle machine.")
    assert all("While timing" not in bench_markdown({**report, "other_busy_cores": busy})
               for busy in (0.2, None))
    # measured: the cores' busy time less this process's own, over the wall time (none over under a second)
    from gbattn.bench.speed import _other_busy_cores

    assert _other_busy_cores((100.0, 10.0, 0.0), (104.0, 11.5, 2.0)) == pytest.approx(1.25)
    assert _other_busy_cores((100.0, 10.0, 0.0), (100.5, 10.9, 2.0)) == 0.0  # (tick rounding: never below 0)
    assert _other_busy_cores((100.0, 10.0, 0.0), (101.0, 10.5, 0.5)) is None and _other_busy_cores(None, None) is None
    report["amp_bf16"], report["compile"] = True, "off"
    assert bench_markdown(report).splitlines()[2].endswith("dropout 0 · bf16 autocast")
    # a row with its own dropout (--attn boosted:dropout=0.5): the header named standard's alone
    report["variants"][2]["dropout"] = 0.5
    assert bench_markdown(report).splitlines()[2].endswith("dropout 0 (boosted: 0.5) · bf16 autocast")
    del report["variants"][2]["dropout"]
    assert bench_markdown(report).splitlines()[10].endswith("batch 1).")
    assert "## Sequence-length sweep (batch 1, one training step)" in bench_markdown(report).splitlines()
    # one repeat: a range of one ratio would read as no noise at all, so none is shown, and the note says why
    report["repeats"] = 1
    lines = bench_markdown(report).splitlines()
    assert lines[8].startswith("| boosted | 1,234,567 | 25.0 | 1,280 | 6 | 2.50 | 2.000 | 1.600 |")
    assert "(one repeat: no range, so no sign of the noise; use --repeats 3 or more)" in lines[10]


def test_bench_markdown_keeps_a_small_peak_memory_from_reading_as_0():
    """A tiny model's peak memory under 0.5 MiB printed as "0" MiB in both tables (read as nothing measured):
    two significant digits below 10 MiB, whole MiB with thousands separators from 10 up."""
    from gbattn.bench.speed import bench_markdown

    def row(variant, peak_memory_bytes):
        return dict(variant=variant, parameters=1_000, forward_flops_per_token=1e6, compiled=False, step_s=0.01,
                    tokens_per_s=100.0, peak_memory_bytes=peak_memory_bytes, step_ratio=1.0,
                    step_ratio_range=[1.0, 1.0], flop_ratio=1.0, step_over_flop_ratio=1.0, memory_ratio=1.0,
                    prefill_s=0.001, decode_tokens_per_s=100.0, decode_ratio=1.0)

    def sweep_row(peak_memory_bytes):
        return {"seq_len": 8, "variant": "standard", "step_s": 0.001, "peak_memory_bytes": peak_memory_bytes,
                "attention_matrix_bytes_per_head": 4 * 8 * 8}

    report = {"preset": "cpu-char", "device": "cpu", "command": "gbattn bench", "torch": "9.9", "batch": 1,
              "seq_len": 8, "repeats": 1, "steps_per_repeat": 1, "dropout": 0.0, "amp_bf16": False, "compile": "off",
              "prefill_tokens": 4, "decode_tokens": 4,
              "variants": [row("standard", 0.25 * 2**20), row("boosted", 1234.4 * 2**20)],
              "sweep": [sweep_row(0.3 * 2**20), sweep_row(12.6 * 2**20)]}
    lines = bench_markdown(report).splitlines()
    assert [line.split(" | ")[4] for line in lines[6:8]] == ["0.25", "1,234"]
    assert [line.split(" | ")[3] for line in lines[-2:]] == ["0.3", "13"]


def test_cpu_memory_probe_reports_the_high_water_mark_over_the_start(monkeypatch, capsys):
    """The probe's figure is VmHWM after two training steps less VmRSS before them, both read from
    /proc/self/status in kB of 1024 bytes, after a warm-up step and a reset of the high-water mark
    (a fake status file here, and no training)."""
    import io
    import json

    from gbattn.bench import speed
    from gbattn.config import preset_config

    status = {"text": "Name:\tpython\nVmHWM:\t  5000 kB\nVmRSS:\t  1500 kB\n"}
    written = []

    class ClearRefs(io.StringIO):
        def write(self, text):
            written.append(text)
            status["text"] = "VmRSS:\t 1500 kB\nVmHWM:\t 1500 kB\n"  # the high-water mark reset to the RSS

    def fake_open(path, mode="r"):
        if path == "/proc/self/clear_refs":
            assert mode == "w"
            return ClearRefs()
        assert path == "/proc/self/status"
        return io.StringIO(status["text"])

    monkeypatch.setattr(speed, "open", fake_open, raising=False)
    assert speed._status_bytes("VmRSS") == 1500 * 1024 and speed._status_bytes("VmHWM") == 5000 * 1024
    runs = []

    trainings = []

    def fake_steps(cfg, batch, seq_len, device, amp, steps, recomputed=False, training=None):
        runs.append((cfg.d_model, batch, seq_len, device.type, amp, steps, torch.get_num_threads()))
        trainings.append(training)
        status["text"] = "VmRSS:\t 1800 kB\nVmHWM:\t 9000 kB\n"  # RSS fell back from its high-water mark

    monkeypatch.setattr(speed, "_run_steps", fake_steps)
    cfg = preset_config("cpu-char", "standard", {"d_model": 48})
    threads = torch.get_num_threads()
    training = speed.bench_training("cpu-char")
    try:
        speed._memory_probe_main(json.dumps({"cfg": cfg.to_dict(), "batch": 3, "seq_len": 5, "threads": threads + 1,
                                             "recomputed": False, "training": training.to_dict()}))
    finally:
        torch.set_num_threads(threads)
    # at the timed steps' thread count: a one-token warm-up step, the high-water mark reset, the two measured steps
    assert runs == [(48, 1, 1, "cpu", False, 1, threads + 1), (48, 3, 5, "cpu", False, 2, threads + 1)]
    assert trainings == [training, training]  # the preset's training settings (its optimizer's groups), both steps
    assert written == ["5"]
    assert capsys.readouterr().out == f"{(9000 - 1500) * 1024}\n"
    # without a writable clear_refs (some sandboxes) the figure is still taken, the same way
    def no_clear_refs(path, mode="r"):
        if path == "/proc/self/clear_refs":
            raise PermissionError(path)
        return fake_open(path, mode)

    monkeypatch.setattr(speed, "open", no_clear_refs, raising=False)
    status["text"] = "VmRSS:\t 1500 kB\nVmHWM:\t 1500 kB\n"
    try:
        speed._memory_probe_main(json.dumps({"cfg": cfg.to_dict(),
                                             "batch": 3, "seq_len": 5, "threads": threads, "recomputed": False}))
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out == f"{(9000 - 1800) * 1024}\n" and len(runs) == 4
    status["text"] = "Name:\tpython\n"
    with pytest.raises(RuntimeError, match="/proc/self/status has no VmHWM"):
        speed._status_bytes("VmHWM")


def test_cpu_memory_probe_reports_no_growth_as_0_never_below(monkeypatch, capsys):
    """A high-water mark read below the RSS taken as the start (the kernel's counters lag each other) is no
    growth, 0 bytes: never a negative peak memory, whose ratios to standard would be negative too."""
    import io
    import json

    from gbattn.bench import speed
    from gbattn.config import preset_config

    status = {"VmRSS": 2000 * 1024, "VmHWM": 2000 * 1024}
    monkeypatch.setattr(speed, "open", lambda path, mode="r": io.StringIO(), raising=False)  # clear_refs
    monkeypatch.setattr(speed, "_status_bytes", lambda field: status[field])

    def fake_steps(cfg, batch, seq_len, device, amp, steps, recomputed=False, training=None):
        if steps == 2:  # the measured steps: the mark read lower than the start
            status["VmHWM"] = 1900 * 1024

    monkeypatch.setattr(speed, "_run_steps", fake_steps)
    threads = torch.get_num_threads()
    cfg = preset_config("cpu-char", "standard", {})
    try:
        speed._memory_probe_main(json.dumps({"cfg": cfg.to_dict(),
                                             "batch": 1, "seq_len": 4, "threads": threads, "recomputed": False}))
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out == "0\n"


def test_bench_refuses_a_repeated_variant_and_a_bad_sweep_variant_before_timing(monkeypatch):
    """A variant named twice (two rows of one label, paired wrongly with compiled rows), a bad
    --sweep-attn and a --sweep length too long are one-line errors before any training step, not after the
    whole timed run."""
    from gbattn.bench import speed
    from gbattn.errors import UserError

    def no_step(*args):
        raise AssertionError("a training step ran before the options were checked")

    monkeypatch.setattr(speed, "train_step", no_step)
    common = dict(device="cpu", batch=1, seq_len=8, repeats=1, steps=1, decode=2, threads=1, quiet=True)
    with pytest.raises(UserError, match="--attn names boosted more than once"):
        speed.run_bench("cpu-char", ["boosted", "twicing", "boosted"], **common)
    with pytest.raises(UserError, match="--attn names standard more than once"):
        speed.run_bench("cpu-char", ["standard", "boosted", "standard"], **common)
    # an empty option list is the bare name, and options written two ways are one model: each was a row of its own
    for specs, repeated in ((["standard", "standard:"], "standard"), (["boosted:", "twicing", "boosted"], "boosted"),
                            (["standard:", "boosted", "standard"], "standard")):
        with pytest.raises(UserError, match=f"^--attn names {repeated} more than once"):
            speed.run_bench("cpu-char", specs, **common)
    with pytest.raises(UserError, match=r"^--attn names boosted:rounds=3 twice \(boosted:rounds=3.0, is the same "):
        speed.run_bench("cpu-char", ["boosted:rounds=3", "boosted:rounds=3.0,"], **common)
    with pytest.raises(UserError, match=r"^--attn names boosted twice \(boosted:rounds=2 is the same model\)"):
        speed.run_bench("cpu-char", ["boosted", "boosted:rounds=2"], **common)  # a default spelled out
    # layers named otherwise: from the end, in another order, or every layer (cpu-char has 4): the same model
    for specs in (["boosted:layers=[3]", "boosted:layers=[-1]"], ["twicing:layers=[0,3]", "twicing:layers=[3,0]"],
                  ["boosted", "boosted:layers=[0,1,2,3]"]):
        with pytest.raises(UserError, match=rf"^--attn names {re.escape(specs[0])} twice \({re.escape(specs[1])} is "
                                            r"the same model\)"):
            speed.run_bench("cpu-char", specs, **common)
    with pytest.raises(UserError, match="^--sweep-attn names boosted more than once"):
        speed.run_bench("cpu-char", ["standard"], sweep=[16], sweep_variants=["boosted", "boosted:"], **common)
    with pytest.raises(UserError, match=r"^--sweep names length\(s\) \[16\] more than once: each length is timed once"):
        speed.run_bench("cpu-char", ["standard"], sweep=[16, 32, 16], **common)
    with pytest.raises(UserError, match="attn='bogus' is not allowed"):
        speed.run_bench("cpu-char", ["standard"], sweep=[16], sweep_variants=["standard", "bogus"], **common)
    # a --sweep length no model takes: refused only after every timing and memory probe (measured: 8 rounds, then
    # the error, nothing written); it blamed block_size=99999999, which no --set gave: it blames --sweep
    with pytest.raises(UserError, match=r"^--sweep 99999999: a sweep length is the model's block size, which must be "
                                        r"an integer in \[1, 16777216\]$"):
        speed.run_bench("cpu-char", ["standard"], sweep=[16, 99999999], **common)
    # sweep variants without a sweep: refused by run_bench itself, as by the CLI (they were dropped, silently)
    for no_sweep in (None, []):
        with pytest.raises(UserError, match=r"--sweep-attn goes with --sweep T \.\.\."):
            speed.run_bench("cpu-char", ["standard"], sweep=no_sweep, sweep_variants=["twicing"], **common)


def test_bench_sweep_options_without_a_sweep_are_refused(capsys):
    """A bare `--sweep` (no lengths) and `--sweep-attn` without `--sweep` ran the whole timed bench and drew no
    sweep, without a word: each is one line, status 2, before any work."""
    for argv, expected in ((["--sweep"], "argument --sweep: expected at least one argument"),
                           (["--sweep-attn", "twicing"], "--sweep-attn goes with --sweep T ...")):
        code, out, err = run_cli(capsys, ["bench", "--preset", "cpu-char", *argv])
        assert (code, out, len(err.splitlines())) == (2, "", 1) and expected in err, (argv, err)


def test_bench_refuses_a_set_of_attn_before_any_work():
    """--set attn=... would turn every variant into that one (a table of one model under several names): refused
    in one line, naming --attn, before a model is built."""
    from gbattn.bench import speed
    from gbattn.errors import UserError

    with pytest.raises(UserError, match=r"^--set attn=\.\.\. would make every variant benched that one: name the "
                                        r"variants with --attn$"):
        speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", quiet=True, sets={"attn": "boosted"})
    # an option of one variant (--help's example was --set attn.rounds=3): standard's row, always there, refused it as
    # "attention 'standard' has no option(s)", so no bench could take one; it goes with its variant
    for key, option in (("attn.rounds", "rounds"), ("attn_options.rounds", "rounds"), ("attn_options", "KEY")):
        with pytest.raises(UserError, match=rf"^--set {key}: an attention option would apply to every variant, "
                                            rf"standard's row too; give it with its variant: --attn VARIANT:{option}="):
            speed.run_bench("cpu-char", ["boosted"], device="cpu", quiet=True, sets={key: 3})


def test_bench_times_and_probes_memory_with_one_optimizer(monkeypatch):
    """The memory probe and the sweep build the timed step's optimizer, not AdamW's default (on CUDA
    the timed step's is fused and the default foreach one holds more temporaries): every AdamW the
    bench builds gets the same options, `gbattn train`'s for the preset (its parameter groups and weight decay,
    foreach on a CPU: the bench's own AdamW over all parameters ran torch's per-parameter loop there)."""
    from gbattn.bench import speed

    built, adamw = [], torch.optim.AdamW

    def recording_adamw(params, **options):
        params = list(params)
        built.append({**options, "decays": [g["weight_decay"] for g in params if isinstance(g, dict)]})
        return adamw(params, **options)

    def in_process_probe(cfg, batch, seq_len, dev, amp, recomputed, training=None):  # the probe's subprocess
        order.append("probe")
        speed._run_steps(cfg, batch, seq_len, dev, amp, steps=1, recomputed=recomputed, training=training)
        return 1e6

    monkeypatch.setattr(torch.optim, "AdamW", recording_adamw)
    monkeypatch.setattr(speed, "peak_memory_train_step", in_process_probe)
    order, snapshot = [], speed._load_snapshot
    monkeypatch.setattr(speed, "_load_snapshot", lambda: order.append("snapshot") or snapshot())
    report = speed.run_bench("cpu-char", ["standard"], device="cpu", batch=1, seq_len=8, repeats=1, steps=1, decode=2,
                             sweep=[8], sweep_variants=["standard"], threads=1, quiet=True, sets={"n_layers": 1})
    assert report["other_busy_cores"] is None or report["other_busy_cores"] >= 0  # (under a second: none measured)
    # the busy cores are read around the measured repeats alone: the memory probes' child processes (each a probe
    # here, in-process) came between, and counted as other work
    assert order == ["snapshot", "snapshot", "probe", "probe"]  # (the timed case's probe, then the sweep's)
    assert len(built) == 4  # the timed case, its probe, the sweep case and its probe
    training = speed.bench_training("cpu-char")
    assert all(options == {"lr": training.lr, "betas": (training.beta1, training.beta2), "fused": False,
                           "foreach": True, "decays": [training.weight_decay, 0.0]} for options in built), built
    assert training.decay_matrices_only  # (cpu-char's: two groups, the vectors without weight decay)
    # the CPU probe's subprocess gets the preset's training settings (it built the training defaults' optimizer)
    import json
    import subprocess

    sent = []
    monkeypatch.undo()  # (the real probe again, its subprocess stood in for)
    monkeypatch.setattr(speed.subprocess, "run", lambda argv, **kw: sent.append(json.loads(argv[-1])) or
                        subprocess.CompletedProcess(argv, 0, "123\n", ""))
    cfg = speed._variant_config("cpu-char", "standard", {"n_layers": 1})
    assert speed.peak_memory_train_step(cfg, 1, 8, torch.device("cpu"), False, False, training=training) == 123.0
    assert sent[0]["training"] == training.to_dict() != speed.TrainConfig().to_dict()


def test_bench_times_and_probes_each_variant_with_and_without_activation_checkpointing(monkeypatch):
    """--activation-checkpointing both: each variant's training step twice, keeping its activations and recomputing
    its blocks (the recomputing function counted: only the second row's model calls it), each with its own memory
    probe; ratios to standard are within the same way of training, and the recomputing row's step and memory
    ratios to its kept row are paired by repeat. Decoding, which trains nothing, is timed for the kept row only.
    With --compile, refused in one line before any work."""
    from gbattn.bench import speed
    from gbattn.errors import UserError
    from gbattn.model.gpt import Block

    probed, recomputing_blocks = [], set()

    def counted(fn, *args):
        recomputing_blocks.add(id(fn))  # (the block itself, called whole)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    def probe(cfg, batch, seq_len, dev, amp, recomputed=False, training=None):
        probed.append((cfg.attn, recomputed))
        return (1e6 if recomputed else 4e6) * (1.5 if cfg.attn == "boosted" else 1.0)

    monkeypatch.setattr(Block, "_gradient_checkpointing_func", counted)
    monkeypatch.setattr(speed, "peak_memory_train_step", probe)
    report = speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=2, seq_len=8, repeats=2,
                             steps=1, decode=2, threads=1, quiet=True, sets={"n_layers": 1},
                             activation_checkpointing="both")
    rows = {r["variant"]: r for r in report["variants"]}
    assert list(rows) == ["standard", "standard · recomputed", "boosted", "boosted · recomputed"]
    assert probed == [("standard", False), ("standard", True), ("boosted", False), ("boosted", True)]
    assert len(recomputing_blocks) == 2  # the two recomputing rows' blocks (one a model), not the kept rows'
    assert report["activation_checkpointing"] == "both"
    for name in ("standard", "boosted"):
        kept, recomputed = rows[name], rows[name + " · recomputed"]
        assert not kept["activation_checkpointing"] and recomputed["activation_checkpointing"]
        assert recomputed["recomputed_memory_ratio"] == 0.25
        paired = sorted(t / t0 for t, t0 in zip(recomputed["step_s_all"], kept["step_s_all"]))
        assert recomputed["recomputed_step_ratio"] == pytest.approx(sum(paired) / 2)  # (the median of two)
        assert recomputed["decode_tokens_per_s"] is None and kept["decode_tokens_per_s"] > 0
        assert "recomputed_step_ratio" not in kept
    assert rows["boosted · recomputed"]["memory_ratio"] == 1.5  # to standard recomputing, not to standard
    # a recomputing row's training FLOPs count its blocks' forward run again (its FLOP ratio was the kept row's)
    from gbattn.model.params import flops_per_token

    for name in ("standard", "boosted"):
        cfg = speed._variant_config("cpu-char", name, {"n_layers": 1})
        kept, recomputed = rows[name], rows[name + " · recomputed"]
        assert kept["train_flops_per_token"] == flops_per_token(cfg, seq_len=8, backward=True)
        assert recomputed["train_flops_per_token"] == flops_per_token(cfg, seq_len=8, backward=True, recomputed=True)
        assert recomputed["train_flops_per_token"] > kept["train_flops_per_token"]
    assert rows["boosted · recomputed"]["flop_ratio"] == (rows["boosted · recomputed"]["train_flops_per_token"]
                                                          / rows["standard · recomputed"]["train_flops_per_token"])
    table = speed.bench_markdown(report)
    assert "· activation checkpointing: both" in table.splitlines()[2]
    recomputed_line = next(line for line in table.splitlines() if line.startswith("| boosted · recomputed |"))
    assert recomputed_line.endswith("| 1.50 | — | — | — |")  # memory ratio to standard recomputing; no decoding
    section = table[table.index("## Activation checkpointing vs kept activations"):]
    boosted_line = next(line for line in section.splitlines() if line.startswith("| boosted |"))
    assert boosted_line.endswith(f"| {rows['boosted · recomputed']['recomputed_step_ratio']:.2f} | 5.7 | 1.4 | 0.25 |")
    for compile in ("both", "on"):
        with pytest.raises(UserError, match=r"^--activation-checkpointing on times eager training steps: give it "
                                            r"with --compile off$"):
            speed.run_bench("cpu-char", ["standard"], device="cpu", compile=compile, activation_checkpointing="on")


def test_bench_with_activation_checkpointing_on_times_decoding_on_its_recomputing_rows(monkeypatch):
    """--activation-checkpointing on: decoding was skipped on every recomputing row (left to a kept row, and with on
    there is none), so the table's decoding cells were all — while its note cited the prefill and decode steps, and
    bench.json their counts. Each row's decoding is timed (checkpointing changes training only, as the note says);
    with both, still the kept row's only."""
    from gbattn.bench import speed

    steady_timings(monkeypatch, 0.5)
    report = speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=2, seq_len=8, repeats=2,
                             steps=1, decode=4, threads=1, quiet=True, sets={"n_layers": 1},
                             activation_checkpointing="on")
    assert [r["variant"] for r in report["variants"]] == ["standard · recomputed", "boosted · recomputed"]
    for row in report["variants"]:
        assert row["activation_checkpointing"] and row["decode_s_all"] == [0.5, 0.5]
        assert (row["prefill_s"], row["decode_tokens_per_s"], row["decode_ratio"]) == (0.5, 8.0, 1.0)
    lines = speed.bench_markdown(report).splitlines()
    assert lines[7].startswith("| boosted · recomputed |") and lines[7].endswith("| 500.0 | 8 | 1.00 |")
    assert lines[9].endswith("(prefill of 60 tokens, then 4 cached steps, batch 1). A recomputing row's training "
                              "FLOPs count its blocks' forward pass run again in the backward pass, and its ratios "
                              "are to standard recomputing. Decoding trains nothing, so a recomputing row decodes as "
                              "it would keeping its activations.")


def test_bench_sweep_heading_says_its_steps_keep_their_activations(monkeypatch):
    """The sequence-length sweep never recomputes its blocks, but with --activation-checkpointing on or both its
    heading read as the rows' way of training: it says "activations kept" (as a compiled bench's says "eager"), and
    each sweep row in bench.json records it; with off, the heading is as before."""
    from gbattn.bench import speed

    steady_timings(monkeypatch, 0.5)
    options = dict(device="cpu", batch=1, seq_len=8, repeats=1, steps=1, decode=2, threads=1, quiet=True,
                   sets={"n_layers": 1}, sweep=[8], sweep_variants=["standard"])
    for mode, heading in (("on", "## Sequence-length sweep (batch 1, one training step, activations kept)"),
                          ("both", "## Sequence-length sweep (batch 1, one training step, activations kept)"),
                          ("off", "## Sequence-length sweep (batch 1, one training step)")):
        report = speed.run_bench("cpu-char", ["standard"], activation_checkpointing=mode, **options)
        assert [row["activation_checkpointing"] for row in report["sweep"]] == [False], mode
        assert heading in speed.bench_markdown(report).splitlines(), mode


def test_cpu_memory_probe_of_a_recomputing_step_holds_less(monkeypatch):
    """The CPU memory probe's fresh process trains with activation checkpointing when asked: a model whose
    activations outweigh its weights peaks lower recomputing its blocks than keeping their activations."""
    from gbattn.bench.speed import peak_memory_train_step
    from gbattn.config import preset_config

    cfg = preset_config("cpu-char", "boosted", {"d_model": 64, "n_layers": 6, "block_size": 257})
    kept, recomputed = (peak_memory_train_step(cfg, batch=8, seq_len=256, device=torch.device("cpu"), amp=False,
                                               recomputed=flag) for flag in (False, True))
    assert recomputed < 0.7 * kept, (recomputed, kept)


def test_bench_reports_compile_time_with_compile_on(monkeypatch):
    """--compile on (no eager rows): the compile time is still measured and shown, not only --compile both.
    Compiled steps take 3 s in the warm-up and 0.25 s after; the compiled decode 5 s, then 1 s."""

    from gbattn.bench import speed

    clock, calls = [0.0], {}

    def fake_step(case, x, y, autocast):
        calls[case.label] = calls.get(case.label, 0) + 1
        clock[0] += 3.0 if calls[case.label] <= 2 else 0.25

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        calls[id(model)] = calls.get(id(model), 0) + 1
        seconds = 5.0 if calls[id(model)] == 1 else 1.0
        clock[0] += seconds
        return 0.0, seconds

    fake_timings(monkeypatch, clock, fake_step, fake_decode)
    report = speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=2, seq_len=16, repeats=2,
                             steps=3, decode=4, compile="on", threads=1, quiet=True, sets={"n_layers": 1})
    assert all(r["compile_s"] == {"train": 5.5, "decode": 4.0} for r in report["variants"])
    assert ("Compile time (the two warm-up rounds' extra time over the measured steps), train / decode: "
            "standard · compiled 5.5 / 4 s, boosted · compiled 5.5 / 4 s.") in speed.bench_markdown(report)
    report["variants"][0]["compile_s"] = {"train": 0.3, "decode": 0.04}  # from a warm cache: not shown as 0
    assert "standard · compiled 0.3 / 0.04 s" in speed.bench_markdown(report)
    # no row has a memory figure (measured eagerly only): the table's dashes are explained, not left blank
    assert all(r["peak_memory_bytes"] is None for r in report["variants"])
    assert ("Peak memory is measured on the eager training step only, so a compiled row has none (—) and "
            "--compile on, with no eager rows, has no memory figures; --compile both or off measures them."
            ) in speed.bench_markdown(report)


def test_a_failed_cpu_memory_probe_is_one_line(monkeypatch):
    """The probe's process failing (out of memory, killed, no /proc) is a one-line error naming the case
    and the probe's last line, not a traceback."""
    import subprocess
    import types

    from gbattn.bench import speed
    from gbattn.config import preset_config
    from gbattn.errors import UserError

    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: types.SimpleNamespace(
        returncode=1, stdout="", stderr="Traceback (most recent call last):\n  ...\nMemoryError: no room\n"))
    cfg = preset_config("cpu-char", "boosted", {})
    with pytest.raises(UserError, match=r"^the CPU memory probe \(a fresh process training boosted at batch 2 x 16\) "
                                        r"failed: MemoryError: no room$"):
        speed.peak_memory_train_step(cfg, 2, 16, torch.device("cpu"), False, False)
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: types.SimpleNamespace(
        returncode=-9, stdout="", stderr=""))
    with pytest.raises(UserError, match="failed: exit status -9$"):
        speed.peak_memory_train_step(cfg, 2, 16, torch.device("cpu"), False, False)


def test_the_cpu_memory_probes_figure_is_the_last_line_it_prints(monkeypatch):
    """The probe's process prints its figure last: a line something else printed before it (a library's notice)
    is not the figure."""
    import subprocess
    import types

    from gbattn.bench import speed
    from gbattn.config import preset_config

    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: types.SimpleNamespace(
        returncode=0, stdout="a notice printed on import\n1234567\n", stderr=""))
    cfg = preset_config("cpu-char", "standard", {})
    assert speed.peak_memory_train_step(cfg, 2, 16, torch.device("cpu"), False, False) == 1234567.0


def test_a_variant_that_fails_to_compile_is_left_out_and_the_others_reported(monkeypatch, capsys, tmp_path):
    """torch.compile failing on one variant (a backend error in the warm-up) is one warning line and a note in the
    report, the other rows still timed; failing on compiled standard leaves out every compiled row (no baseline for
    their ratios); with --compile on, nothing left to report is one line and exit status 2."""
    from torch._dynamo.exc import BackendCompilerFailed

    clock, failing = [0.0], set()

    def fake_step(case, x, y, autocast):
        if case.label in failing:
            raise BackendCompilerFailed("inductor", RuntimeError("no C++ compiler\nmore detail"), None)
        clock[0] += 0.5

    fake_timings(monkeypatch, clock, fake_step, lambda *args, **kwargs: (0.0, 1.0))
    argv = ["bench", "--preset", "cpu-char", "--device", "cpu", "--attn", "standard", "boosted", "gated", "--repeats",
            "2", "--steps", "1", "--batch", "1", "--seq-len", "8", "--decode", "2", "--set", "n_layers=1", "--threads",
            "1", "--quiet", "--compile", "both", "--out", tmp_path / "one"]
    failing.add("boosted · compiled")
    code, out, err = run_cli(capsys, argv)
    reason = "torch.compile failed: RuntimeError: no C++ compiler"
    assert (code, err) == (0, f"gbattn: warning: boosted · compiled left out of the report, {reason}\n")
    report = json.loads((tmp_path / "one" / "bench.json").read_text())
    assert [r["variant"] for r in report["variants"]] == [
        "standard", "standard · compiled", "boosted", "gated", "gated · compiled"]
    assert report["left_out"] == [{"variant": "boosted · compiled", "reason": reason}]
    assert f"Left out: boosted · compiled ({reason})." in out

    failing.add("standard · compiled")
    code, out, err = run_cli(capsys, argv[:-1] + [tmp_path / "two"])
    report = json.loads((tmp_path / "two" / "bench.json").read_text())
    assert code == 0 and [r["variant"] for r in report["variants"]] == ["standard", "boosted", "gated"]
    no_baseline = "no baseline: standard · compiled failed to compile"
    assert {r["variant"]: r["reason"] for r in report["left_out"]} == {
        "standard · compiled": reason, "boosted · compiled": no_baseline, "gated · compiled": no_baseline}
    assert err == f"gbattn: warning: standard · compiled left out of the report, {reason}\n"

    # a failing variant of standard with options is not standard itself: only its own row is left out
    failing.clear()
    failing.add("standard:n_heads=2 · compiled")
    code, out, err = run_cli(capsys, [*argv[:7], "standard:n_heads=2", *argv[7:-1], tmp_path / "three"])
    report = json.loads((tmp_path / "three" / "bench.json").read_text())
    assert code == 0 and [r["variant"] for r in report["left_out"]] == ["standard:n_heads=2 · compiled"]
    failing.add("standard · compiled")
    code, out, err = run_cli(capsys, argv[:-3] + ["on"])
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == f"gbattn: error: no variant to report: standard · compiled's {reason}"


def test_a_failed_compiles_reason_in_the_results_files_holds_no_absolute_path(monkeypatch, capsys, tmp_path):
    """torch.compile's error can name a path of this machine (a compiler that is not there: CXX=/opt/.../g++), and
    bench.json and bench.md stored it as given. The warning on stderr keeps the whole message; the results files keep
    each absolute path's last component (a URL as it is)."""
    from torch._dynamo.exc import BackendCompilerFailed

    clock = [0.0]
    message = ("No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, '/opt/nonexistent/bin/g++'), "
               "see https://pytorch.org/docs/main/torch.compiler.html")

    def fake_step(case, x, y, autocast):
        if case.label == "boosted · compiled":
            raise BackendCompilerFailed("inductor", RuntimeError(message), None)
        clock[0] += 0.5

    fake_timings(monkeypatch, clock, fake_step, lambda *args, **kwargs: (0.0, 1.0))
    code, out, err = run_cli(capsys, [
        "bench", "--preset", "cpu-char", "--device", "cpu", "--attn", "standard", "boosted", "--repeats", "1",
        "--steps", "1", "--batch", "1", "--seq-len", "8", "--decode", "2", "--set", "n_layers=1", "--threads", "1",
        "--quiet", "--compile", "both", "--out", tmp_path / "bench"])
    assert (code, err) == (0, f"gbattn: warning: boosted · compiled left out of the report, torch.compile failed: "
                              f"RuntimeError: {message}\n")
    reason = ("torch.compile failed: RuntimeError: No working C++ compiler found in torch._inductor.config.cpp.cxx: "
              "(None, 'g++'), see https://pytorch.org/docs/main/torch.compiler.html")
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["left_out"] == [{"variant": "boosted · compiled", "reason": reason}]
    assert f"Left out: boosted · compiled ({reason})." in out
    assert "/opt/" not in (tmp_path / "bench" / "bench.md").read_text() and "/opt/" not in out


def test_bench_compiles_more_variants_than_dynamos_recompile_limit(monkeypatch):
    """Each compiled variant compiles GPT.forward and the decode step anew, and dynamo allows 8 compilations of one
    code object: a ninth compiled variant's training step ran eagerly, unsaid, in its "compiled" row, and its
    decode step failed (10 variants, --compile on: measured). While bench times, the limit leaves room for every
    compiled case; afterwards it is as it was."""
    import torch._dynamo

    from gbattn.bench import speed

    clock, limits = [0.0], []

    def fake_step(case, x, y, autocast):
        limits.append(torch._dynamo.config.recompile_limit)
        clock[0] += 0.5

    fake_timings(monkeypatch, clock, fake_step, lambda *args, **kwargs: (0.0, 1.0))
    variants = ["standard", "boosted", "boosted:rounds=3", "boosted:kv_source=shared", "twicing", "gated",
                "differential", "boosted:gate=vector", "boosted:rounds=4", "boosted:rounds=5"]
    before = torch._dynamo.config.recompile_limit
    report = speed.run_bench("cpu-char", variants, device="cpu", batch=1, seq_len=8, repeats=1, steps=1, decode=2,
                             compile="on", threads=1, quiet=True, sets={"n_layers": 1})
    assert len(report["variants"]) == 10 and min(limits) >= before + 10
    assert torch._dynamo.config.recompile_limit == before


def test_bench_records_whether_inductor_could_load_earlier_compilations(monkeypatch):
    """The compile times bench reports are a first compile only with inductor's caches disabled: the same tiny
    bench run twice measured 28 / 9 s, then 3 / 1 s (train / decode), and neither bench.json nor its command said
    which (README's runs set TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 outside the command). The report records it and
    bench.md says what the compile times mean; an eager bench has nothing to record."""
    import torch._inductor.config

    from gbattn.bench import speed

    clock = [0.0]

    def fake_step(case, x, y, autocast):
        clock[0] += 0.5

    fake_timings(monkeypatch, clock, fake_step, lambda *args, **kwargs: (0.0, 1.0))
    arguments = dict(device="cpu", batch=1, seq_len=8, repeats=1, steps=1, decode=2, threads=1, quiet=True,
                     sets={"n_layers": 1})
    for disabled, caches, note in ((False, "enabled", "Inductor's caches were enabled: a compilation an earlier run "
                                    "cached is loaded, not redone"),
                                   (True, "disabled", "Inductor's caches were disabled "
                                    "(TORCHINDUCTOR_FORCE_DISABLE_CACHES=1): each a first compile.")):
        # torch's own patch: monkeypatch's undo left the setting unreadable ("... does not exist"), and every later
        # torch.compile in the process failed
        with torch._inductor.config.patch(force_disable_caches=disabled):
            for compile in ("on", "both"):
                report = speed.run_bench("cpu-char", ["standard"], compile=compile, **arguments)
                assert report["inductor_caches"] == caches and note in speed.bench_markdown(report)
    assert isinstance(torch._inductor.config.force_disable_caches, bool)  # still readable
    assert "inductor_caches" not in speed.run_bench("cpu-char", ["standard"], compile="off", **arguments)


def test_decode_kernels_script_counts_each_variants_matrix_products_and_attention_calls():
    """scripts/decode_kernels.py (README, "Compiled vs eager") counts the calls of inductor's compiled decode step:
    at cpu-char (4 layers), standard's 4 per layer (qkv, out, two FFN) and the LM head are 17 matrix products with 4
    attention calls; GBA M=2 adds round 1's projection and the gate per layer (25) and a second attention (8)."""
    script = load_script("decode_kernels")
    body = ("def call(args):\n    extern_kernels.addmm(a, b, c)\n    cpp_fused_gelu_0(x)\n"
            "    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)\n"
            "    extern_kernels.mm(a, b)\n\ndef later():\n    extern_kernels.mm(a, b)\n")
    assert script.count_calls("header\n" + body) == {"matrix products": 2, "attention": 1, "fused (inductor)": 1}
    standard = script.decode_step_kernels("cpu-char", "standard")
    boosted = script.decode_step_kernels("cpu-char", "boosted:rounds=2")
    assert (standard["matrix products"], standard["attention"]) == (17, 4)
    assert (boosted["matrix products"], boosted["attention"]) == (25, 8)
    assert boosted["fused (inductor)"] > standard["fused (inductor)"] > 0
    assert standard["all"] == sum(standard[kind] for kind in script.KINDS)


def test_a_variants_model_fields_set_its_row_so_two_blocks_are_timed_in_one_run(monkeypatch):
    """`--attn standard:residual=attnres-block` times that block next to the plain one in the same run: a spec's
    model fields set its row's model, its other options the attention's; block_size and vocab_size, which shape
    every row's batch, are refused there with one line."""
    from gbattn.bench import speed
    from gbattn.errors import UserError
    from gbattn.model.gpt import GPT

    cfg = speed._variant_config("cpu-char", "boosted:residual=attnres-block,rounds=3", {"n_layers": 1})
    assert (cfg.residual, cfg.attn, cfg.attn_options) == ("attnres-block", "boosted", {"rounds": 3})
    steady_timings(monkeypatch, 1.0)
    report = speed.run_bench("cpu-char", ["standard", "standard:residual=attnres-block"], device="cpu", batch=1,
                             seq_len=8, repeats=1, steps=1, decode=2, threads=1, quiet=True, sets={"n_layers": 2})
    plain, attnres = report["variants"]
    assert (plain["variant"], attnres["variant"]) == ("standard", "standard:residual=attnres-block")
    expected = GPT(speed._variant_config("cpu-char", "standard", {"n_layers": 2, "residual": "attnres-block"}))
    assert attnres["parameters"] == expected.num_params() > plain["parameters"]
    for key in ("block_size", "vocab_size"):
        with pytest.raises(UserError, match=f"^--attn standard:{key}=64: {key} shape every row's batch"):
            speed.run_bench("cpu-char", ["standard", f"standard:{key}=64"], device="cpu", batch=1, seq_len=8,
                            repeats=1, steps=1, decode=2, threads=1, quiet=True)


def test_decode_floor_script_reads_every_matrix_a_decode_step_multiplies_once():
    """scripts/decode_floor.py (README, "Compiled vs eager"): the weight-read floor multiplies one vector by every
    Linear weight of the model, the output layer's whether or not it is tied to the token embedding, and by nothing
    else (the position table and an untied token embedding are lookups, not products)."""
    from gbattn.config import preset_config
    from gbattn.model.gpt import GPT

    script = load_script("decode_floor")
    for attn, sets in (("standard", {}), ("boosted", {"attn.rounds": 3}), ("standard", {"tie_embeddings": False})):
        model = GPT(preset_config("cpu-char", attn, sets))
        lookups = {"wpe.weight"} | ({"wte.weight"} if not model.cfg.tie_embeddings else set())
        expected = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name not in lookups)
        matrices = script.weight_matrices(model)
        assert sum(w.numel() for w in matrices) == expected
    with torch.no_grad():
        floor, n_weights = script.weight_read_floor(model)
        outputs = floor()
    assert n_weights == expected and [o.shape for o in outputs] == [(1, w.shape[0]) for w in matrices]


def test_bench_interleaves_its_variants_round_by_round_and_its_progress_ends_at_the_total(monkeypatch, capsys):
    """Rounds are interleaved (standard, boosted, standard, boosted, ...: each repeat's ratio pairs steps made back
    to back, not minutes apart), and a compiled row left out still counts its rounds, so the progress ends at its
    total."""
    import itertools

    from torch._dynamo.exc import BackendCompilerFailed

    from gbattn.bench import speed

    clock, labels = [0.0], []

    def fake_step(case, x, y, autocast):
        labels.append(case.label)
        if case.label == "boosted" + speed.COMPILED:
            raise BackendCompilerFailed("inductor", RuntimeError("no C++ compiler"), None)
        clock[0] += 0.5

    fake_timings(monkeypatch, clock, fake_step, lambda *args, **kwargs: (0.0, 1.0))
    speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=1, seq_len=8, repeats=2, steps=1,
                    decode=2, threads=1, quiet=True, sets={"n_layers": 1})
    assert [label for label, _ in itertools.groupby(labels)] == ["standard", "boosted"] * 3  # warm-up + 2 repeats
    speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=1, seq_len=8, repeats=2, steps=1,
                    decode=2, threads=1, quiet=False, sets={"n_layers": 1}, compile="both")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench cpu-char on cpu: ")]
    assert lines[-1] == "bench cpu-char on cpu: 14/14 rounds"  # 4 cases x (warm-up + 2 repeats), + 2 warm-ups again


def test_recomputed_step_ratio_and_decode_compile_time_are_medians_of_uneven_repeats(monkeypatch):
    """Three uneven repeats (1, 1 and 4 s): the recomputing row's step ratio to its kept row is their median (1.0, as
    the table says, not the mean 2.0), and a compiled decode's compile time is its warm-up less the median decode
    (5 - 1 = 4 s, not 5 - 2)."""
    from gbattn.bench import speed

    clock, calls = [0.0], {}

    def uneven(key, warm_up_calls, warm_up):  # the warm-up round's calls, then 1, 1 and 4 s
        calls[key] = calls.get(key, 0) + 1
        return warm_up if calls[key] <= warm_up_calls else (1.0, 1.0, 4.0)[(calls[key] - warm_up_calls - 1) % 3]

    def fake_step(case, x, y, autocast):  # (the warm-up round trains two steps)
        clock[0] += uneven(case.label, 2, 1.0) if case.label.endswith(" · recomputed") else 1.0

    def fake_decode(model, prompt, n_decode, device, autocast, step=None):
        seconds = uneven(("decode", id(model)), 1, 5.0) if step is not None else 1.0
        clock[0] += seconds
        return 0.0, seconds

    fake_timings(monkeypatch, clock, fake_step, fake_decode)
    report = speed.run_bench("cpu-char", ["standard"], device="cpu", batch=1, seq_len=8, repeats=3, steps=1,
                             decode=2, threads=1, quiet=True, sets={"n_layers": 1}, activation_checkpointing="both")
    rows = {r["variant"]: r for r in report["variants"]}
    assert rows["standard · recomputed"]["step_s_all"] == [1.0, 1.0, 4.0]
    assert rows["standard · recomputed"]["recomputed_step_ratio"] == 1.0
    calls.clear()
    report = speed.run_bench("cpu-char", ["standard"], device="cpu", batch=1, seq_len=8, repeats=3, steps=1,
                             decode=2, threads=1, quiet=True, sets={"n_layers": 1}, compile="on")
    (row,) = report["variants"]
    assert row["decode_tokens_per_s"] == 2.0 and row["compile_s"]["decode"] == 4.0


def test_bench_markdown_shows_the_range_from_two_repeats(monkeypatch):
    """Two repeats give each ratio a lowest and a highest: shown, as the note under the table says."""
    from gbattn.bench import speed

    steady_timings(monkeypatch, 0.5)
    report = speed.run_bench("cpu-char", ["standard", "boosted"], device="cpu", batch=1, seq_len=8, repeats=2,
                             steps=1, decode=2, threads=1, quiet=True, sets={"n_layers": 1})
    table = speed.bench_markdown(report)
    assert "(range: lowest and highest of those ratios)" in table
    assert next(line for line in table.splitlines() if line.startswith("| boosted |")).count("(1.00–1.00)") >= 1


def test_the_memory_probes_get_the_benchs_precision_and_threads(monkeypatch):
    """Every memory probe (each row's and the sweep's) measures at the bench's own amp; the CPU probe's fresh
    process trains on the bench's thread count (each thread holds its own scratch memory); AdamW is fused on CUDA."""
    import types

    from gbattn.bench import speed
    from gbattn.config import preset_config
    from gbattn.model.gpt import GPT

    probed = []
    for amp in (True, False):
        probed.clear()
        steady_timings(monkeypatch, 0.5)
        monkeypatch.setattr(speed, "peak_memory_train_step",
                            lambda cfg, batch, seq_len, dev, amp, recomputed=False, **_:
                            probed.append(amp) or 1e6)
        speed.run_bench("cpu-char", ["standard"], device="cpu", batch=1, seq_len=8, repeats=1, steps=1, decode=2,
                        sweep=[16], threads=1, quiet=True, sets={"n_layers": 1}, amp=amp)
        assert len(probed) >= 2 and set(probed) == {amp}  # a row's probe and the sweep's
    monkeypatch.undo()
    payloads = []
    monkeypatch.setattr(speed.subprocess, "run", lambda argv, **kwargs: payloads.append(json.loads(argv[-1])) or
                        types.SimpleNamespace(returncode=0, stdout="123\n", stderr=""))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        cfg = preset_config("cpu-char", "standard", {"n_layers": 1})
        assert speed.peak_memory_train_step(cfg, 1, 8, torch.device("cpu"), False, False) == 123.0
    finally:
        torch.set_num_threads(threads)
    assert payloads[0]["threads"] == 3
    model = GPT(preset_config("cpu-char", "standard", {"n_layers": 1, "d_model": 16, "n_heads": 1}))
    assert speed.bench_optimizer(model, torch.device("cuda")).defaults["fused"]
    assert not speed.bench_optimizer(model, torch.device("cpu")).defaults["fused"]
