"""Figures and reports of `gbattn plot` / `gbattn analyze` / results.md from hand-made inputs
(no training): like-with-like seeds on the results chart, plain tick labels on log axes, missing
runs named, published numbers only for runs as long as the published ones, wording of a rise,
and no absolute paths in what is stored."""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
from matplotlib.text import Text

from gbattn.analysis import figures
from gbattn.analysis.cli import plot_compare, print_summary
from gbattn.cli import main as cli_main
from gbattn.errors import CheckpointError, UserError
from gbattn.experiments.report import results_markdown
from gbattn.files import relative_path
from helpers import hold_lock, in_use, stand_in_run


def model_row(label: str, test_ppl: dict, steps: int = 2000, published=None, compute_matched_to=None) -> dict:
    """A results.json model row with the fields results.md and the results chart read."""
    values = list(test_ppl.values())
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else None
    return {
        "label": label, "attn": "boosted" if label.startswith("gba") else "standard", "attn_options": {},
        "norm": "pre", "residual": "plain", "d_model": 128, "parameters": 800_000, "param_matched_to": None,
        "compute_matched_to": compute_matched_to, "flops_per_token_train": 5e6,
        "seeds": sorted(int(s) for s in test_ppl), "test_ppl": test_ppl, "valid_ppl": test_ppl,
        "test_ppl_mean": mean, "test_ppl_std": std, "valid_ppl_mean": mean, "valid_ppl_std": std,
        "steps": steps, "train_tokens": 1_536_000, "tokens_per_parameter": 1.9, "train_flops": 8e12,
        "wall_clock_s": 170.0, "tokens_per_s": 10_000.0, "device": "cpu",
        "curves": {s: [{"step": steps, "tokens": 1_536_000, "valid_ppl": v}] for s, v in test_ppl.items()},
        "published": published,
    }


def report_of(rows: list[dict], sets: dict | None = None) -> dict:
    return {"recipe": "cpu-char", "description": "tiny-shakespeare at nanoGPT's CPU configuration (2,000 steps)",
            "preset": "cpu-char", "data": "tiny-shakespeare", "seeds": [42, 123], "sets": sets or {},
            "command": "gbattn compare --recipe cpu-char", "complete": False,
            "published_source": "nanoGPT README", "models": rows}


def drawn_texts(fig) -> dict:
    """The text of a drawn figure: title, tick labels, legend entries, annotations, and all of
    its text (the footer included)."""
    with figures.style():
        fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend()
    return {"title": ax.get_title(), "ticks": [t.get_text() for t in ax.get_xticklabels()],
            "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            "annotations": [t.get_text() for t in ax.texts],
            "all": "\n".join(t.get_text() for t in fig.findobj(Text))}


# ---- results chart -------------------------------------------------------------------------


def test_results_figure_marks_seed_counts_and_compares_on_the_shared_seed():
    """One seed beside two: every mean is over the shared seed 42, so param-fair (95 on seed 42)
    is drawn ahead of GBA (96), although its two-seed mean (99) is behind; n= under each model."""
    rows = [model_row("standard", {"42": 100.0, "123": 110.0}),
            model_row("param-fair", {"42": 95.0, "123": 103.0}),
            model_row("gba-m2", {"42": 96.0})]
    texts = drawn_texts(figures.results_figure(report_of(rows)))
    assert texts["ticks"] == ["standard\nn=1 (dots n=2)", "param-fair\nn=1 (dots n=2)", "gba-m2\nn=1"]
    assert "means over the 1 seed all models share (42); 'all seeds' dots show the rest" in texts["title"]
    # Every mean is one seed's value: there is no std to draw, and the legend does not promise one.
    assert "ours: one seed's value (no spread: no error bar)" in texts["legend"]
    # Means and Δ vs standard over seed 42 only: 95 / 100 and 96 / 100.
    assert texts["annotations"] == ["100.00", "95.00 (-5.0%)", "96.00 (-4.0%)"]
    # and the dashed reference line is that mean too (100, not the 105 of standard's two seeds)
    ax = figures.results_figure(report_of(rows)).axes[0]
    (reference,) = [line for line in ax.get_lines() if line.get_label() == "standard mean"]
    assert list(reference.get_ydata()) == [100.0, 100.0]

    same = [model_row("standard", {"42": 100.0, "123": 110.0}), model_row("gba-m2", {"42": 96.0, "123": 98.0})]
    texts = drawn_texts(figures.results_figure({**report_of(same), "complete": True, "missing": []}))
    assert texts["ticks"] == ["standard\nn=2", "gba-m2\nn=2"] and "seeds 42, 123 (every model)" in texts["title"]
    assert texts["annotations"] == ["105.00", "97.00 (-7.6%)"]
    assert "ours: mean ± std over n seeds (n under each model)" in texts["legend"]

    disjoint = [model_row("standard", {"42": 100.0}), model_row("gba-m2", {"123": 96.0})]
    texts = drawn_texts(figures.results_figure(report_of(disjoint)))
    assert "means over different seeds" in texts["title"]
    assert texts["annotations"] == ["100.00", "96.00"]  # no seed shared with standard: no Δ
    # a two-seed mean beside a one-seed value (no seed shared): the legend promises the spread the first one has
    mixed = [model_row("standard", {"42": 100.0, "123": 110.0}), model_row("gba-m2", {"7": 96.0})]
    assert "ours: mean ± std over n seeds (n under each model)" in drawn_texts(
        figures.results_figure(report_of(mixed)))["legend"]


def test_results_figure_of_an_incomplete_comparison_names_the_runs_missing_and_the_seeds_held(recwarn):
    """A comparison stopped after one run: results.md said INCOMPLETE and named the runs missing, while results.png
    drew the one model finished under "means over seed 42 (every model)", with nothing about the other two. A seed
    asked for with no result in any model is named as in results.md; no finite value at all draws no empty legend
    (matplotlib warned on stderr) and no empty seed list."""
    rows = [model_row("gba-m2", {"42": 96.0})]
    report = {**report_of(rows), "seeds": [42], "missing": ["standard/seed42", "compute-matched/seed42"]}
    texts = drawn_texts(figures.results_figure(report))
    assert "means over seed 42 (every model drawn)" in texts["title"]
    assert "INCOMPLETE (runs missing: standard/seed42, compute-matched/seed42)" in texts["all"].splitlines()
    assert "INCOMPLETE" in results_markdown(report)
    complete = {**report_of(rows), "seeds": [42, 123], "complete": True, "missing": []}
    note = "Every model has seed 42 only (seed 123 not finished): each mean is over 1 seed"
    assert note in drawn_texts(figures.results_figure(complete))["all"].splitlines()
    assert note + "." in results_markdown(complete)
    assert "INCOMPLETE" not in drawn_texts(figures.results_figure(complete))["all"]
    rows[0]["test_ppl"] = {"42": None}
    texts = drawn_texts(figures.results_figure({**complete, "seeds": [42]}))
    assert "no model has a finite test perplexity" in texts["title"] and texts["legend"] == []
    assert not [w for w in recwarn if "No artists with labels" in str(w.message)]


def test_curves_name_the_runs_asked_for_that_left_no_curve(tmp_path, monkeypatch):
    """compare stopped before compute-matched started: curves.png ("curves of every run") named only the
    unfinished standard run and left compute-matched out without a word."""
    drawn = []
    real_curves_figure = figures.curves_figure
    monkeypatch.setattr(figures, "curves_figure", lambda *a, **kw: drawn.append(real_curves_figure(*a, **kw))
                        or drawn[-1])
    rows = [model_row("gba-m2", {"42": 96.0})]
    report = {**report_of(rows), "seeds": [42], "missing": ["standard/seed42", "compute-matched/seed42"]}
    (tmp_path / "results.json").write_text(json.dumps(report))
    for label in ("gba-m2", "standard"):
        write_run(tmp_path, label, 42)
    plot_compare(tmp_path)
    assert drawn[-1].get_supxlabel() == (
        "unfinished, not in results.json (their curves stop where the runs stopped): standard seed 42\n"
        "not drawn (not started, or nothing logged yet): compute-matched/seed42")


def test_results_figure_compares_with_a_suffixed_standard_and_signs_every_change():
    """The reference is the first model named standard, suffix or not ("standard-2k"), and says so in the legend;
    a change of exactly 0 is "+0.0%" (not left out) and a worse model's is signed "+"."""
    rows = [model_row("standard-2k", {"42": 10.0}), model_row("gba-m2", {"42": 10.0}),
            model_row("gba-m3", {"42": 11.0})]
    texts = drawn_texts(figures.results_figure(report_of(rows)))
    assert texts["annotations"] == ["10.00", "10.00 (+0.0%)", "11.00 (+10.0%)"]
    assert "standard-2k mean" in texts["legend"]
    # each kind of mark is one legend entry, however many models; a published value sits beside its model's column
    assert texts["legend"].count("ours: all seeds (one dot each)") == 1
    rows[1]["published"] = [9.5, None]
    ax = figures.results_figure(report_of(rows)).axes[0]
    (published,) = [line for line in ax.get_lines() if line.get_marker() == "D"]
    assert list(published.get_xdata()) == [1.18]


def test_results_figure_and_markdown_omit_published_numbers_of_a_shorter_run():
    """--set max_steps=200 on a recipe whose published number is for 2,000 steps: no published
    value, a line saying why, and the steps of this run in the heading and the chart's title."""
    rows = [model_row("standard", {"42": 9.0}, steps=200, published=[6.55, None]),
            model_row("compute-matched", {"42": 8.5}, steps=291, compute_matched_to="gba-m2"),
            model_row("gba-m2", {"42": 8.8}, steps=200)]
    report = report_of(rows, sets={"max_steps": 200})
    md = results_markdown(report)
    heading, table_row = md.splitlines()[0], next(line for line in md.splitlines() if line.startswith("| standard"))
    assert heading.endswith("(2,000 steps) (this run: 200 steps, compute-matched 291)")
    assert "6.55" not in md and table_row.split(" | ")[7] == "—"
    assert "published numbers omitted: this comparison overrides the recipe's training length (max_steps=200)" in md
    texts = drawn_texts(figures.results_figure(report))
    assert "published" not in texts["legend"] and "200 steps" in texts["title"]
    assert "published numbers omitted: this comparison overrides" in texts["all"]

    # The same rows at the recipe's 2,000 steps and no --set: the published value is shown.
    for r in rows:
        r["steps"] = 2914 if r["compute_matched_to"] else 2000
    report = report_of(rows)
    md = results_markdown(report)
    assert "| 6.55 |" in md and "omitted" not in md and "this run" not in md.splitlines()[0]
    assert "published" in drawn_texts(figures.results_figure(report))["legend"]
    # A row whose steps differ from the described 2,000 loses its published value without any --set.
    rows[0]["steps"] = 1000
    assert "6.55" not in results_markdown(report_of(rows))
    rows[0]["steps"] = 2000
    # Other data than the recipe's, or a changed model: the published number is for another setting.
    other_data = {**report_of(rows), "data": "wikitext-2"}
    assert "6.55" not in results_markdown(other_data)
    assert "published numbers omitted: these runs trained on wikitext-2, not tiny-shakespeare" in results_markdown(
        other_data)
    assert "6.55" not in results_markdown(report_of(rows, sets={"d_model": 32}))


# ---- curves --------------------------------------------------------------------------------


def test_curves_on_a_log_axis_have_plain_tick_labels():
    """Validation perplexity from 5 to 50,000 (four decades): a log axis whose tick labels are
    plain numbers, not mathtext that STYLE's parse_math=False would print raw."""
    points = [(1_000 * k, v) for k, v in enumerate([50_000.0, 5_000.0, 500.0, 50.0, 5.0], start=1)]
    curves = {"standard": {"42": {"train": [(t, 3.0) for t, _ in points], "valid": points}},
              "gba-m2": {"42": {"train": [(t, 2.5) for t, _ in points], "valid": [(t, v * 1.1) for t, v in points]}}}
    fig = figures.curves_figure(curves)
    with figures.style():
        fig.canvas.draw()
    valid_ax = fig.axes[1]
    assert valid_ax.get_yscale() == "log"
    labels = [t.get_text() for t in valid_ax.get_yticklabels() + valid_ax.get_yticklabels(minor=True)]
    assert "1,000" in labels and "10,000" in labels
    assert not [text for text in labels if "$" in text or "mathdefault" in text]


def test_curves_give_every_model_its_own_colour():
    """Colours were C0..C9 in turn: the eleventh model of a design study drew (and was listed) in the first's colour.
    Twelve models, twelve colours, on the lines and in the legend alike."""
    from matplotlib.colors import to_rgba

    curves = {f"model-{i}": {"42": {"train": [(1_000, 3.0 - i / 10), (2_000, 2.9 - i / 10)],
                                    "valid": [(2_000, 20.0 + i)]}} for i in range(12)}
    fig = figures.curves_figure(curves)
    line_colors = [to_rgba(line.get_color()) for line in fig.axes[0].get_lines()]
    legend_colors = [to_rgba(h.get_color()) for h in fig.axes[1].get_legend().legend_handles]
    assert len(set(line_colors)) == 12 and legend_colors == line_colors
    assert [to_rgba(c) for c in figures.model_colors(3)] == [to_rgba(f"C{i}") for i in range(3)]  # the usual ten


def test_curves_draw_a_run_that_logged_its_training_loss_once():
    """A short run (gbattn compare --set max_steps=4) logs one training loss: the panel showed nothing,
    a line through one point having no length; it is a dot now, and longer runs stay lines."""
    curves = {"standard": {"42": {"train": [(16_384, 8.1)], "valid": [(8_192, 3_000.0), (16_384, 2_900.0)]}},
              "gba-m2": {"42": {"train": [(1_000, 3.0), (2_000, 2.9)], "valid": [(2_000, 20.0)]}}}
    train_ax = figures.curves_figure(curves).axes[0]
    one, two = train_ax.get_lines()
    assert len(one.get_xdata()) == 1 and one.get_marker() == "o" and one.get_markersize() > 0
    assert len(two.get_xdata()) == 2 and two.get_marker() in (None, "None", "")


# ---- gbattn plot on a copied comparison ----------------------------------------------------


def write_run(compare_dir, label: str, seed: int, events: bool = True) -> None:
    run_dir = compare_dir / label / f"seed{seed}"
    run_dir.mkdir(parents=True)
    lines = [{"event": "train", "step": 1, "tokens": 100, "loss": 4.0},
             {"event": "eval", "step": 2, "tokens": 200, "valid_ppl": 50.0}] if events else [{"event": "start"}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


def paired_runs(compare_dir: Path) -> Path:
    """A comparison folder with standard's and gba-m2's seed-42 runs, each evaluated at step 2 (--gap pairs them)."""
    compare_dir.mkdir()
    for label in ("standard", "gba-m2"):
        write_run(compare_dir, label, 42)
        with open(compare_dir / label / "seed42" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"event": "eval", "step": 2, "tokens": 200, "valid_loss": 3.9}) + "\n")
    return compare_dir


def test_plot_names_the_runs_whose_curves_are_missing(tmp_path, capsys):
    compare_dir = tmp_path / "copied"
    compare_dir.mkdir()
    rows = [model_row("standard", {"42": 100.0}), model_row("twicing", {"42": 98.0}), model_row("gba-m2", {"42": 96.0})]
    (compare_dir / "results.json").write_text(json.dumps(report_of(rows)))
    write_run(compare_dir, "standard", 42)
    write_run(compare_dir, "twicing", 42, events=False)  # gba-m2/seed42 not copied at all
    (compare_dir / "param-fair" / "seed42" / "metrics.jsonl").mkdir(parents=True)  # not a file
    rows.insert(1, model_row("param-fair", {"42": 97.0}))
    (compare_dir / "results.json").write_text(json.dumps(report_of(rows)))

    with pytest.raises(UserError) as caught:
        plot_compare(compare_dir)
    message = str(caught.value)
    assert "gba-m2/seed42/ (no directory)" in message
    assert "twicing/seed42/metrics.jsonl (no train or eval events)" in message
    assert "param-fair/seed42/metrics.jsonl (no file)" in message
    assert "standard/seed42" not in message
    assert not (compare_dir / "figures").exists()

    assert cli_main(["plot", str(compare_dir)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "gba-m2/seed42" in err

    # Every listed run present: both figures are written.
    write_run(compare_dir, "gba-m2", 42)
    (compare_dir / "twicing" / "seed42" / "metrics.jsonl").unlink()
    (compare_dir / "twicing" / "seed42").rmdir()
    write_run(compare_dir, "twicing", 42)
    shutil.rmtree(compare_dir / "param-fair")
    write_run(compare_dir, "param-fair", 42)
    assert [p.name for p in plot_compare(compare_dir)] == ["results.png", "curves.png"]
    run = tmp_path / "run"  # --out a run directory: refused, nothing written into it
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert cli_main(["plot", str(compare_dir), "--out", str(run)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gbattn: error: --out {run} holds a run, not a folder of figures: choose another --out"]
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_plot_refuses_a_figures_folder_planted_as_a_link_and_leaves_its_target(tmp_path, capsys):
    """A comparison received with figures/ linking to a folder elsewhere: plot deleted that folder's
    results.pdf and curves.pdf (out of date, it took them) and drew into it. Refused in one line; an --out
    given by the user is used as given."""
    compare_dir = paired_runs(tmp_path / "cmp")
    rows = [model_row("standard", {"42": 100.0}), model_row("gba-m2", {"42": 96.0})]
    (compare_dir / "results.json").write_text(json.dumps(report_of(rows)))
    paper = tmp_path / "paper"
    paper.mkdir()
    for name in ("results.pdf", "curves.pdf"):
        (paper / name).write_text("mine\n")
    (compare_dir / "figures").symlink_to(paper)
    assert cli_main(["plot", str(compare_dir), "--pdf"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gbattn: error: {compare_dir / 'figures'} is a link to {paper}: gbattn writes a comparison's figures only "
        f"into a folder of its own there, never through a link (it can lead anywhere); remove the link, or give --out"]
    assert sorted(p.name for p in paper.iterdir()) == ["curves.pdf", "results.pdf"]
    assert (paper / "results.pdf").read_text() == "mine\n"
    assert cli_main(["plot", str(compare_dir), "--gap", "gba-m2", "--pdf"]) == 2  # (--gap's default folder too)
    assert capsys.readouterr().err.startswith(f"gbattn: error: {compare_dir / 'figures'} is a link to {paper}:")
    assert sorted(p.name for p in paper.iterdir()) == ["curves.pdf", "results.pdf"]
    assert [p.name for p in plot_compare(compare_dir, out=tmp_path / "elsewhere")] == ["results.png", "curves.png"]


def test_plot_of_a_comparison_with_no_run_at_all_is_one_line_and_draws_nothing(tmp_path, capsys):
    """A results.json that lists no model, and no run folder beside it: one line, not two empty figures."""
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    (compare_dir / "results.json").write_text(json.dumps({"recipe": "x", "models": []}))
    assert cli_main(["plot", str(compare_dir)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gbattn: error: cannot plot {compare_dir}: no run has curves (results.json lists no finished run and no "
        f"<label>/seed<S>/metrics.jsonl holds train or eval events)"]
    assert not (compare_dir / "figures").exists()


def test_curves_name_the_setting_and_the_unfinished_runs_they_draw(tmp_path, monkeypatch):
    """results.json lists standard and gba-m2 on seed 42; gba-m2/seed7 is still training. Its curve is drawn,
    and was indistinguishable from a finished run's (the legend says only 'seed 7'): the footer now names it,
    and the title says which recipe, data and steps the curves are of."""
    drawn = []
    real_curves_figure = figures.curves_figure
    monkeypatch.setattr(figures, "curves_figure", lambda *a, **kw: drawn.append(real_curves_figure(*a, **kw))
                        or drawn[-1])
    rows = [model_row("standard", {"42": 100.0}), model_row("gba-m2", {"42": 96.0})]
    (tmp_path / "results.json").write_text(json.dumps(report_of(rows)))
    for label, seed in (("standard", 42), ("gba-m2", 42), ("gba-m2", 7)):
        write_run(tmp_path, label, seed)
    plot_compare(tmp_path)
    (fig,) = drawn
    assert fig.get_suptitle() == ("Training and validation curves of every run\n"
                                  "cpu-char on tiny-shakespeare (2,000 steps)")
    assert fig.get_supxlabel() == ("unfinished, not in results.json (their curves stop where the runs stopped): "
                                   "gba-m2 seed 7")
    assert texts_outside(fig) == []
    write_run(tmp_path, "standard", 7)
    rows = [model_row("standard", {"42": 100.0, "7": 99.0}), model_row("gba-m2", {"42": 96.0, "7": 95.0})]
    (tmp_path / "results.json").write_text(json.dumps(report_of(rows)))
    plot_compare(tmp_path)
    assert drawn[-1].get_supxlabel() == ""  # every run drawn is finished


def test_curves_keep_a_run_that_only_trained_and_skip_boolean_counts(tmp_path):
    """A run stopped before its first evaluation still has its training curve (and an empty validation
    one); a metrics line whose count or loss is true/false (JSON booleans are not numbers) is skipped
    like a damaged one."""
    from gbattn.analysis.cli import read_curves

    run_dir = tmp_path / "standard" / "seed42"
    run_dir.mkdir(parents=True)
    events = [{"event": "train", "step": 1, "tokens": 100, "loss": 4.0},
              {"event": "train", "step": 2, "tokens": True, "loss": 3.5},
              {"event": "train", "step": 3, "tokens": 300, "loss": False}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert read_curves(tmp_path, report_of([model_row("standard", {"42": 100.0})])) == {
        "standard": {"42": {"train": [(100, 4.0)], "valid": []}}}


def test_curves_draw_an_unfinished_continuation_after_the_model_it_continues(tmp_path):
    """A continuation (the upcycle recipe's standard-continued) is drawn after its base's training tokens, finished
    or not: one killed midway has no results.json row yet, and was drawn from 0, over the start of the base's curve;
    its recipe says what it continues."""
    from gbattn.analysis.cli import read_curves

    for label, tokens in (("base", 500), ("standard-continued", 100)):
        run_dir = tmp_path / label / "seed42"
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"event": "train", "step": 1, "tokens": tokens,
                                                           "loss": 4.0}) + "\n")
    report = {**report_of([model_row("base", {"42": 100.0})]), "recipe": "upcycle"}
    curves = read_curves(tmp_path, report)
    assert curves["standard-continued"]["42"]["train"] == [(1_536_000 + 100, 4.0)]  # base's train_tokens + its own
    assert curves["base"]["42"]["train"] == [(500, 4.0)]


def test_plot_skips_non_finite_or_overflowing_numbers_in_metrics(tmp_path, capsys):
    """gbattn writes a non-finite value as null, so NaN, Infinity or a 400-digit count in metrics.jsonl is damage:
    a 400-digit token count was an OverflowError traceback from the curves, and a NaN validation loss gave --gap
    points whose difference was null (an empty figure, exit 0). Such lines are now skipped like cut ones."""
    from gbattn.analysis.cli import read_curves

    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    metrics = compare_dir / "gba-m2" / "seed1" / "metrics.jsonl"
    damaged = ['{"event": "train", "step": 1, "tokens": 1' + "0" * 400 + ', "loss": 4.0}',
               '{"event": "train", "step": 2, "tokens": 20, "loss": NaN}',
               '{"event": "train", "step": 3, "tokens": 30, "loss": 3.0}',
               '{"event": "eval", "step": 400, "tokens": Infinity, "valid_ppl": 9.0, "valid_loss": 1.0}',
               '{"event": "eval", "tokens": 4000, "valid_ppl": 9.0, "valid_loss": 1.0}',  # no step to pair by
               '{"event": "eval", "step": NaN, "tokens": 4000, "valid_ppl": 9.0, "valid_loss": 1.0}']
    lines = metrics.read_text().splitlines()
    lines = [line.replace('"valid_loss": ', '"valid_loss": NaN, "x": ') if '"step": 400,' in line else line
             for line in lines]
    metrics.write_text("\n".join(lines + damaged) + "\n")
    curves = read_curves(compare_dir, json.loads((compare_dir / "results.json").read_text()))
    assert curves["gba-m2"]["1"]["train"] == [(30, 3.0)]
    figures.curves_figure(curves)  # (drawing the 400-digit count was the OverflowError)
    assert cli_main(["plot", str(compare_dir), "--gap", "gba-m2", "--out", str(tmp_path / "gap")]) == 0
    (series,) = json.loads((tmp_path / "gap" / "gap.json").read_text())["series"]
    assert all(isinstance(p["difference"], float) for p in series["points"])
    assert [p["seeds"] for p in series["points"] if p["step"] == 400] == [1]  # seed 1's damaged end is not paired


def test_plot_reads_only_the_seed_folders_compare_names(tmp_path):
    """A backup copy standard/seed1.bak (or a folder 'seed') was drawn as an unfinished run of seed '1.bak', and
    --gap paired it as a seed of its own: only seed<integer> folders are runs."""
    from gbattn.analysis.cli import gap_series, read_curves

    compare_dir = _gap_dir(tmp_path / "cmp", 400, seeds=(1,))
    for label in ("standard", "gba-m2"):
        with open(compare_dir / label / "seed1" / "metrics.jsonl", "a") as f:  # a training curve to draw
            f.write(json.dumps({"event": "train", "step": 1, "tokens": 10, "loss": 4.0}) + "\n")
        for copy in ("seed1.bak", "seed", "seed01"):
            shutil.copytree(compare_dir / label / "seed1", compare_dir / label / copy)
    report = json.loads((compare_dir / "results.json").read_text())
    assert {label: list(runs) for label, runs in read_curves(compare_dir, report).items()} == {
        "gba-m2": ["1"], "standard": ["1"]}
    assert {p["seeds"] for p in gap_series(compare_dir, "gba-m2", "standard")["points"]} == {1}


# ---- gbattn analyze: wording and stored paths ----------------------------------------------


def analysis_summary(relative_drop: float) -> dict:
    return {
        "run_dir": "gba-m2/seed42", "attention": "boosted (rounds=2)", "residual": "plain", "norm": "pre",
        "checkpoint": "best", "step": 8,
        "rows": 4, "split": "test", "seq_len": 31, "loss": {"mean_nats": 2.0, "ppl": 7.39},
        "paper": {"gate_mean_per_layer": [0.35], "gate_mean_per_layer_revised": [0.3], "entropy_round0_nats": 3.31,
                  "entropy_correction_nats": 2.58, "entropy_relative_drop": 0.22, "seq_len": 256},
        "gates": {"available": False, "reason": "no gates"},
        "entropy": {"mean_per_round": [2.0, 2.0 * (1 - relative_drop)], "max_possible": 3.43,
                    "relative_drop": relative_drop, "per_layer": [{"layer": 0, "relative_drop": relative_drop}]},
        "norms": {"available": False}, "notes": [], "figures": ["entropy.png"],
    }


def test_print_summary_says_higher_for_a_rise_in_entropy(tmp_path, capsys):
    print_summary(analysis_summary(-0.03), tmp_path / "summary.json")
    printed = capsys.readouterr().out
    assert "(3% higher; change per layer L0 +3%)" in printed and "% lower;" not in printed
    assert "paper: 3.31 -> 2.58 (22% lower, layer 0 the exception, T=256)" in printed
    assert f"figures: {tmp_path / 'entropy.png'}" in printed
    print_summary(analysis_summary(0.22), tmp_path / "summary.json")
    assert "(22% lower; change per layer L0 -22%)" in capsys.readouterr().out


def test_results_md_says_whose_tokens_per_s_count_the_compiling():
    """A compiled run's tokens/s counts torch.compile's first-step compiling (79 tokens/s where it trained at 21,895
    once compiled), and results.md put it beside eager runs' without a word."""
    rows = [model_row("standard", {"42": 100.0}), model_row("gba-m2", {"42": 96.0})]
    assert "count torch.compile's compiling" not in results_markdown(report_of(rows))
    rows[1]["compiled"] = True
    assert ("\ntokens/s and wall-clock of gba-m2 count torch.compile's compiling (once for each leg of a run that "
            "trained compiled).\n") in results_markdown(report_of(rows))


def test_texts_read_from_received_files_reach_the_report_and_terminal_escaped(tmp_path, capsys):
    """An escape sequence in a received comparison's result.json device or recipe.json commands, or in a run
    folder's name, was printed raw by compare (its results.md), analyze and export: a terminal took it as a command
    (a window title, a cleared screen). Now written as text, ``\\x1b``."""
    hostile = "\x1b]0;TITLE\x07\x1b[2J"
    report = report_of([model_row("standard", {"42": 100.0})])
    report["models"][0]["device"] = f"cpu{hostile}"
    report["commands"] = [f"gbattn compare --recipe cpu-char {hostile}"]
    report["data"] = f"data{hostile}"  # (a received recipe.json's data path)
    markdown = results_markdown(report)
    assert "\x1b" not in markdown and "\x07" not in markdown
    assert "Command: `gbattn compare --recipe cpu-char \\x1b]0;TITLE\\x07\\x1b[2J`" in markdown
    assert "Data: `data\\x1b]0;TITLE\\x07\\x1b[2J` · seeds 42, 123" in markdown
    assert "hardware: cpu\\x1b]0;TITLE\\x07\\x1b[2J" in markdown
    summary = analysis_summary(0.22)
    summary["run_dir"] = f"run{hostile}"
    print_summary(summary, tmp_path / f"a{hostile}" / "summary.json")
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "analyzed run\\x1b]0;TITLE" in printed
    assert f"summary: {tmp_path}/a\\x1b]0;TITLE\\x07\\x1b[2J/summary.json" in printed
    # plot's line naming the figures it wrote, into a folder of such a name
    compare_dir = paired_runs(tmp_path / "cmp")
    (compare_dir / "results.json").write_text(json.dumps(report_of(
        [model_row("standard", {"42": 100.0}), model_row("gba-m2", {"42": 96.0})])))
    figs = tmp_path / f"figs{hostile}"
    assert cli_main(["plot", str(compare_dir), "--out", str(figs)]) == 0
    printed = capsys.readouterr().out
    shown = f"{tmp_path}/figs\\x1b]0;TITLE\\x07\\x1b[2J"
    assert "\x1b" not in printed and printed == f"figures: {shown}/results.png, {shown}/curves.png\n"


def test_printable_text_escapes_a_newline_and_a_tab_and_keeps_spaces():
    """printable_text writes a text read from a file (a received result.json's device, a folder's name) into
    results.md and onto the terminal: a newline or a tab in it is not printable either (kept raw, a newline broke
    the line it was in, in two), so each is escaped as an escape sequence is; a space stays as it is."""
    from gbattn.terminal import printable_text

    assert printable_text("a\nb") == "a\\nb"
    assert printable_text("a\tb c") == "a\\tb c"
    assert printable_text("\x1b[31m red") == "\\x1b[31m red"


def test_print_summary_of_a_gba_run_against_another_line_by_line(tmp_path, capsys):
    """Every line for a GBA run analysed --against another: loss and perplexity, each layer's gate
    mean±std beside both versions of the paper's, rounds named from 0, the norms as |r| -> |g*c| ->
    |x-F after| of each corrected layer by name (a layer without GBA has none), the other run's loss before
    this one's, the median and the largest gain (the first top token), and only the notes that do not restate
    the attention's own note."""
    summary = analysis_summary(0.25)
    summary["gates"] = {"available": True, "per_layer": [{"layer": 0, "round": 1, "mean": 0.4, "std": 0.1},
                                                         {"layer": 1, "round": 1, "mean": 0.55, "std": 0.05}]}
    summary["norms"] = {"available": True,
                        "per_layer": [{"layer": 1, "round": 1, "residual": 1.5, "gated_correction": 0.25,
                                       "residual_after": 1.25}]}
    summary["loss_diff"] = {"against": "standard/seed42", "against_attention": "standard", "against_loss": 2.1,
                            "against_checkpoint": "last", "against_step": 5,
                            "loss": 2.0, "mean": 0.1, "median": 0.05, "fraction_positive": 0.6,
                            "fraction_negative": 0.3, "fraction_tied": 0.1, "tie_nats": 1e-4,
                            "top_tokens": [{"diff": 0.75, "token": "cat"}, {"diff": 0.5, "token": "dog"}]}
    other = "standard/seed42 was trained on another corpus; both models are evaluated on gba-m2/seed42's rows"
    summary["notes"] = ["boosted (rounds=2) attention says this on its gates line", other]
    print_summary(summary, tmp_path / "summary.json")
    assert capsys.readouterr().out.splitlines() == [
        "analyzed gba-m2/seed42 (boosted (rounds=2), best weights at step 8) on 4 test rows x 31 tokens: "
        "loss 2.0000 nats, ppl 7.39",
        "  gates, mean±std per layer:   L0 0.40±0.10 / L1 0.55±0.05    paper (its 1-layer M=2 model): 0.35 (revision "
        "0.30)",
        "  entropy, nats (bound log(t+1), max 3.43): round 0 2.00 -> round 1 1.50 (25% lower; change per layer "
        "L0 -25%)    paper: 3.31 -> 2.58 (22% lower, layer 0 the exception, T=256)",
        "  norms per layer, |r| -> |g*c| -> |x-F after|: L1 1.50->0.25->1.25",
        "  vs standard/seed42 (standard, last weights at step 5): loss 2.1000 -> 2.0000 nats; per-token gain mean "
        "+0.1000, median +0.0500; "
        "this run better on 60% of tokens, worse on 30%, within 0.0001 nats on 10%; largest gain +0.75 on 'cat'",
        f"  note: {other}",
        f"  figures: {tmp_path / 'entropy.png'}",
        f"  summary: {tmp_path / 'summary.json'}",
    ]
    # weights saved over an export (rundir.CHANGED) are not that step's: named as eval names them
    summary["checkpoint"], summary["loss_diff"]["against_checkpoint"] = "changed", "changed"
    print_summary(summary, tmp_path / "summary.json")
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("analyzed gba-m2/seed42 (boosted (rounds=2), weights changed since their export at "
                                 "step 8) on 4 test rows"), printed[0]
    assert printed[4].startswith("  vs standard/seed42 (standard, weights changed since their export at step 5): ")


def test_print_summary_prints_a_note_whose_folder_begins_with_the_attentions_name(tmp_path, capsys):
    """A standard run --against `standard-wiki/seed42`, trained on another corpus: that note begins with "standard",
    the attention's name, and was dropped as if it were the "no boosting rounds" note the gates line already
    prints; only that one is left out."""
    no_boost = "standard attention has no boosting rounds: GBA's gates and corrections do not exist"
    other = "standard-wiki/seed42 was trained on another corpus; both models are evaluated on standard/seed42's rows"
    summary = {**analysis_summary(0.1), "attention": "standard", "gates": {"available": False, "reason": no_boost},
               "notes": [no_boost, other]}
    print_summary(summary, tmp_path / "summary.json")
    printed = capsys.readouterr().out
    assert f"  note: {other}\n" in printed and f"  note: {no_boost}" not in printed
    assert f"  gates: {no_boost}\n" in printed


def test_print_summary_names_a_residual_stream_or_post_ln_that_is_not_the_default(tmp_path, capsys):
    """An AttnRes or Post-LN run's header read exactly like a plain Pre-LN one's ("boosted (rounds=2), best
    checkpoint ..."): it now names the residual stream and Post-LN where they are not the defaults."""
    summary = analysis_summary(0.1)
    for residual, norm, said in (("plain", "pre", "(boosted (rounds=2), best weights"),
                                 ("attnres-full", "pre", "(boosted (rounds=2), attnres-full residual, best weights"),
                                 ("attnres-block", "post", "attnres-block residual, Post-LN, best")):
        print_summary({**summary, "residual": residual, "norm": norm}, tmp_path / "summary.json")
        assert said in capsys.readouterr().out.splitlines()[0]


def test_print_summary_states_an_unchanged_entropy(tmp_path, capsys):
    """A correction round exactly as sharp as round 0 (relative drop 0.0, not None) is still stated."""
    print_summary(analysis_summary(0.0), tmp_path / "summary.json")
    assert "round 0 2.00 -> round 1 2.00 (0% lower;" in capsys.readouterr().out
    print_summary(analysis_summary(0.004), tmp_path / "summary.json")  # a drop that rounds to 0: no "-0%"
    printed = capsys.readouterr().out
    assert "change per layer L0 +0%)" in printed and "-0%" not in printed


def test_print_summary_of_gba_in_some_layers_gives_the_change_over_the_corrected_layers(tmp_path, capsys):
    """GBA in layer 1 only: round 0's mean (3.10) is over both layers, round 1's over layer 1 alone, so "round 0
    3.10 -> round 1 3.20 (0% higher)" read as a contradiction; each mean now says over how many layers, and the
    change names the corrected layers' own round 0 and round 1."""
    summary = analysis_summary(0.0)
    summary["entropy"].update(mean_per_round=[3.1, 3.2], layers_per_round=[2, 1], per_layer=[
        {"layer": 0, "mean_per_round": [3.0]}, {"layer": 1, "mean_per_round": [3.2, 3.2], "relative_drop": 0.0}])
    print_summary(summary, tmp_path / "summary.json")
    assert ("round 0 3.10 (2 layers) -> round 1 3.20 (1 layer) (in the 1 layer with a correction: 3.20 -> 3.20, "
            "0% lower; change per layer L1 +0%)") in capsys.readouterr().out
    # a sharper correction: its own round 0 first, then round 1
    summary["entropy"].update(mean_per_round=[2.9, 2.4], relative_drop=0.25, per_layer=[
        {"layer": 0, "mean_per_round": [2.6]}, {"layer": 1, "mean_per_round": [3.2, 2.4], "relative_drop": 0.25}])
    print_summary(summary, tmp_path / "summary.json")
    assert ("round 0 2.90 (2 layers) -> round 1 2.40 (1 layer) (in the 1 layer with a correction: 3.20 -> 2.40, "
            "25% lower; change per layer L1 -25%)") in capsys.readouterr().out


def test_print_summary_of_gba_in_every_layer_with_two_correction_rounds(tmp_path, capsys):
    """GBA in both layers (2 and 2 layers per round): the round means and the change are overall, with no layer
    counts; with two correction rounds each gate is named by its layer and round (L0 g1, L0 g2)."""
    summary = analysis_summary(0.25)
    summary["entropy"]["layers_per_round"] = [2, 2]
    summary["gates"] = {"available": True, "per_layer": [{"layer": 0, "round": m, "mean": 0.5, "std": 0.1}
                                                         for m in (1, 2)]}
    print_summary(summary, tmp_path / "summary.json")
    printed = capsys.readouterr().out
    assert "round 0 2.00 -> round 1 1.50 (25% lower; change per layer L0 -25%)" in printed
    assert "gates, mean±std per layer:   L0 g1 0.50±0.10 / L0 g2 0.50±0.10    paper" in printed
    # three rounds: the change is round 1's, said so (after round 2's value it read as round 2's)
    summary["entropy"]["mean_per_round"] = [2.0, 1.5, 2.1]
    summary["entropy"]["layers_per_round"] = [2, 2, 2]
    print_summary(summary, tmp_path / "summary.json")
    assert ("round 0 2.00 -> round 1 1.50 -> round 2 2.10 (25% lower round 1 against round 0; change per layer "
            "L0 -25%)") in capsys.readouterr().out


def test_print_summary_names_the_layer_and_round_of_each_norm(tmp_path, capsys):
    """With three rounds in two layers the norms line printed four unnamed triples ("5.80->0.37->5.85 / ..."):
    each is now named by its layer and round, as on the gates line."""
    summary = analysis_summary(0.1)
    summary["norms"] = {"available": True, "per_layer": [
        {"layer": li, "round": m, "residual": 1.0, "gated_correction": 0.5, "residual_after": 0.75}
        for li in (0, 1) for m in (1, 2)]}
    print_summary(summary, tmp_path / "summary.json")
    assert ("norms per layer, |r| -> |g*c| -> |x-F after|: L0 round 1 1.00->0.50->0.75 / L0 round 2 1.00->0.50->0.75"
            " / L1 round 1 1.00->0.50->0.75 / L1 round 2 1.00->0.50->0.75") in capsys.readouterr().out


def test_against_names_the_other_runs_residual_stream_and_post_ln(tmp_path, capsys):
    """A Pre-LN GBA run --against a Post-LN one printed "vs RUN (boosted, best checkpoint ...)" and drew
    "loss(GBA M=2 (against)) − loss(GBA M=2)", as if the two were the same model: the other run's residual
    stream and norm are now stored, printed and in the names the figures use."""
    from types import SimpleNamespace

    from gbattn.analysis.cli import _short_name

    summary = analysis_summary(0.1)
    summary["loss_diff"] = {"against": "post/seed42", "against_attention": "boosted (rounds=2)",
                            "against_residual": "attnres-block", "against_norm": "post", "against_loss": 2.1,
                            "against_checkpoint": "best", "against_step": 5, "loss": 2.0, "mean": 0.1,
                            "median": 0.05, "fraction_positive": 0.6, "fraction_negative": 0.3, "fraction_tied": 0.1,
                            "tie_nats": 1e-4, "top_tokens": []}
    print_summary(summary, tmp_path / "summary.json")
    assert "vs post/seed42 (boosted (rounds=2), attnres-block residual, Post-LN, best weights at step 5)" in (
        capsys.readouterr().out)

    def run(residual, norm):
        return SimpleNamespace(config={}, model_cfg=SimpleNamespace(attn="boosted", attn_options={},
                                                                    residual=residual, norm=norm))

    names = [_short_name(run(*stream)) for stream in (("plain", "pre"), ("plain", "post"), ("attnres-full", "pre"))]
    assert names == ["GBA M=2", "GBA M=2, Post-LN", "GBA M=2, attnres-full residual"]


def test_a_runs_own_label_names_it_in_the_figures():
    """A run that `gbattn compare` labelled (config extra.label) is named by that label, whatever its attention."""
    from types import SimpleNamespace

    from gbattn.analysis.cli import _short_name

    cfg = SimpleNamespace(attn="boosted", attn_options={"rounds": 3}, residual="plain", norm="post")
    assert _short_name(SimpleNamespace(config={"extra": {"label": "gba-wide"}}, model_cfg=cfg)) == "gba-wide"
    assert _short_name(SimpleNamespace(config={"extra": None}, model_cfg=cfg)) == "GBA M=3, Post-LN"


def test_against_a_run_of_the_same_corpus_has_no_note():
    """Only a different recorded corpus is a note; the same one (or one run without a fingerprint) is not."""
    from types import SimpleNamespace

    from gbattn.analysis.cli import _check_against

    def run(data_fingerprint):
        return SimpleNamespace(tokenizer=SimpleNamespace(fingerprint="tok"), seq_len=32,
                               data_fingerprint=data_fingerprint)

    assert _check_against(run("abc"), run("abc"), "gba", "std") == []
    assert _check_against(run("abc"), run(None), "gba", "std") == []
    assert _check_against(run("abc"), run("xyz"), "gba", "std") == [
        "std was trained on another corpus; both models are evaluated on gba's rows"]


def test_relative_path_is_never_absolute(tmp_path):
    out = tmp_path / "work" / "analysis"
    assert relative_path(out / "gates.png", out) == "gates.png"
    assert relative_path(tmp_path / "work" / "cmp" / "gba-m2" / "seed42", out.parent) == "cmp/gba-m2/seed42"
    # Outside the base (or the base itself): the last two parts.
    assert relative_path(tmp_path / "runs" / "standard" / "seed42", out.parent) == "standard/seed42"
    assert relative_path(out.parent, out.parent) == f"{tmp_path.name}/work"


def _gap_dir(root, steps: int, seeds=(1, 2)):
    """A comparison directory with two models' eval events, for --gap."""
    root.mkdir(parents=True)
    rows = []
    for label, params, offset in (("gba-m2", 100, -0.01), ("standard", 80, 0.0)):
        for seed in seeds:
            run = root / label / f"seed{seed}"
            run.mkdir(parents=True)
            events = [{"event": "eval", "step": s, "tokens": 10 * s, "valid_loss": 2.0 - s / steps + offset * s / steps}
                      for s in range(steps // 4, steps + 1, steps // 4)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        rows.append({"label": label, "parameters": params, "steps": steps, "seeds": list(seeds)})
    (root / "results.json").write_text(json.dumps({"recipe": "x", "models": rows}))
    return root


def test_gap_plot_pairs_by_seed_and_step_across_run_lengths(tmp_path, capsys):
    short, long = _gap_dir(tmp_path / "short", 400), _gap_dir(tmp_path / "long", 1600)
    code = cli_main(["plot", str(short), str(long), "--gap", "gba-m2", "--against", "standard",
                     "--out", str(tmp_path / "fig")])
    assert code == 0
    gap = json.loads((tmp_path / "fig" / "gap.json").read_text())
    assert gap["command"] == "gbattn plot short long --gap gba-m2 --against standard --out fig"  # no machine paths
    ends = {s["steps"]: s["points"][-1] for s in gap["series"]}
    assert ends[400]["difference"] == pytest.approx(-0.01) and ends[1600]["difference"] == pytest.approx(-0.01)
    assert ends[1600]["tokens_per_parameter"] == pytest.approx(160.0) and ends[400]["seeds"] == 2
    fig = figures.gap_figure(gap["series"], "gba-m2", ["standard"])
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert texts == ["400-step runs (short, 2 seeds)", "1,600-step runs (long, 2 seeds)"]
    code = cli_main(["plot", str(short), str(long)])  # several directories need --gap
    err = capsys.readouterr().err
    assert code == 2 and "several comparison directories go with --gap" in err
    code = cli_main(["plot", str(short), "--against", "standard"])  # --against alone was silently ignored
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "gbattn: error: --against goes with --gap MODEL (the gap of MODEL to each --against model)"]
    assert not (short / "figures").exists()
    code = cli_main(["plot", str(short), "--gap", "gba-m2", "--out", str(tmp_path / "fig3")])  # against standard
    assert code == 0 and json.loads((tmp_path / "fig3" / "gap.json").read_text())["references"] == ["standard"]
    code = cli_main(["plot", str(short), "--gap", "gba-m3", "--out", str(tmp_path / "fig2")])
    assert code == 2 and "has no finished 'gba-m3' runs (did you mean 'gba-m2'?)" in capsys.readouterr().err
    code = cli_main(["plot", str(short), "--gap", "gba-m2", "--against", "standrd", "--out", str(tmp_path / "fig2")])
    assert code == 2 and "has no finished 'standrd' runs (did you mean 'standard'?)" in capsys.readouterr().err
    # A directory or reference given twice is drawn once (it was a second identical line or panel), also when
    # spelt another way ...
    code = cli_main(["plot", str(short), str(long), f"{short}/", str(long / ".." / "long"), "--gap", "gba-m2",
                     "--against", "standard", "standard", "--out", str(tmp_path / "fig4")])
    gap = json.loads((tmp_path / "fig4" / "gap.json").read_text())
    assert code == 0 and gap["references"] == ["standard"]
    assert [(s["directory"], s["reference"]) for s in gap["series"]] == [("short", "standard"), ("long", "standard")]
    # ... and the model against itself (a flat 0) is one line, not a figure.
    code = cli_main(["plot", str(short), "--gap", "gba-m2", "--against", "standard", "gba-m2",
                     "--out", str(tmp_path / "fig5")])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "gbattn: error: --against gba-m2 is the --gap model itself: its gap to itself is 0 at every step"]
    assert not (tmp_path / "fig5").exists()


def test_gap_reads_each_results_json_once(tmp_path, monkeypatch):
    """Grouping the directories into lines and each reference's series read the same results.json files: they
    were read (and checked) again for every reference and once more for the grouping."""
    import gbattn.analysis.cli as analysis_cli

    short, long = _gap_dir(tmp_path / "short", 400), _gap_dir(tmp_path / "long", 1600)
    reads: list[str] = []
    real = analysis_cli.read_comparison
    monkeypatch.setattr(analysis_cli, "read_comparison", lambda d: reads.append(Path(d).name) or real(d))
    assert cli_main(["plot", str(short), str(long), "--gap", "gba-m2", "--against", "standard",
                     "--out", str(tmp_path / "fig")]) == 0
    assert sorted(reads) == ["long", "short"]


def test_gap_pools_the_seeds_of_one_comparison_continued_in_another_directory(tmp_path, capsys):
    """A comparison given more seeds in another directory (`compare --seeds 7 --out OTHER`, as the repository's
    cpu-char-long and cpu-char-long-seed7) is one line over all its seeds, not a line per directory; the same
    recipe at another length stays a line of its own, and a seed in both directories is one line, exit 2."""
    first, later = _gap_dir(tmp_path / "first", 400), _gap_dir(tmp_path / "later", 400, seeds=(3,))
    events = (later / "gba-m2" / "seed3" / "metrics.jsonl").read_text().splitlines()
    shifted = [dict(json.loads(e), valid_loss=json.loads(e)["valid_loss"] - 0.03) for e in events]
    (later / "gba-m2" / "seed3" / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in shifted))
    longer = _gap_dir(tmp_path / "longer", 1600)
    out = tmp_path / "fig"
    assert cli_main(["plot", str(first), str(longer), str(later), "--gap", "gba-m2", "--out", str(out)]) == 0
    gap = json.loads((tmp_path / "fig" / "gap.json").read_text())
    assert [(s["directory"], s["steps"]) for s in gap["series"]] == [("first + later", 400), ("longer", 1600)]
    pooled = gap["series"][0]["points"]
    assert [p["seeds"] for p in pooled] == [3, 3, 3, 3]
    assert pooled[-1]["difference"] == pytest.approx((-0.01 - 0.01 - 0.04) / 3)  # seed 3 is 0.03 further ahead
    texts = [t.get_text() for t in figures.gap_figure(gap["series"], "gba-m2", ["standard"]).axes[0]
             .get_legend().get_texts()]
    assert texts[0] == "400-step runs (first +\nlater, 3 seeds)"  # one directory to a line
    again = _gap_dir(tmp_path / "again", 400, seeds=(2,))
    assert cli_main(["plot", str(first), str(again), "--gap", "gba-m2", "--out", str(tmp_path / "fig2")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gbattn: error: gba-m2 seed 2 is in both {first} and {again}: plot one of them"]


def test_gap_pairs_only_the_seeds_results_json_lists_as_finished(tmp_path):
    """A seed still training (its folder is there, results.json does not list it) added its early evaluations
    only: the first points averaged three seeds, the last two, and the curve mixed populations."""
    from gbattn.analysis.cli import gap_series

    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    for label, loss in (("gba-m2", 9.0), ("standard", 1.0)):  # seed 3 stopped after its first evaluation
        run = compare_dir / label / "seed3"
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"event": "eval", "step": 100, "tokens": 1000,
                                                       "valid_loss": loss}) + "\n")
    points = gap_series(compare_dir, "gba-m2", "standard")["points"]
    assert [p["seeds"] for p in points] == [2, 2, 2, 2]
    assert points[0]["difference"] == pytest.approx(-0.0025)
    # a seed the model finished and the reference did not: not paired, though the reference has its steps in others
    report = json.loads((compare_dir / "results.json").read_text())
    report["models"][0]["seeds"] = [1, 2, 3]  # gba-m2 lists seed 3 as finished (evaluated to its end), standard not
    (compare_dir / "gba-m2" / "seed3" / "metrics.jsonl").write_text("".join(
        json.dumps({"event": "eval", "step": step, "tokens": 10 * step, "valid_loss": 9.0}) + "\n"
        for step in (100, 200, 300, 400)))
    (compare_dir / "results.json").write_text(json.dumps(report))
    points = gap_series(compare_dir, "gba-m2", "standard")["points"]
    assert [p["seeds"] for p in points] == [2, 2, 2, 2] and points[0]["difference"] == pytest.approx(-0.0025)


def test_gap_leaves_out_a_seed_that_diverged_as_results_md_does(tmp_path, capsys):
    """A seed listed as finished whose test perplexity is null (it diverged) is left out of results.md's means and
    paired differences; the gap paired it all the same (a diverged run's losses of 31-76 nats in the mean). It is left
    out, with a note naming it; a results.json without test perplexities (written before they were kept) pairs every
    seed, as before."""
    from gbattn.analysis.cli import gap_series

    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    for seed, loss in ((2, 60.0),):  # gba-m2 seed 2's evaluations: a diverged run's
        (compare_dir / "gba-m2" / f"seed{seed}" / "metrics.jsonl").write_text("".join(
            json.dumps({"event": "eval", "step": step, "tokens": 10 * step, "valid_loss": loss}) + "\n"
            for step in (100, 200, 300, 400)))
    points = gap_series(compare_dir, "gba-m2", "standard")["points"]  # (no test perplexities recorded: both seeds)
    assert [p["seeds"] for p in points] == [2, 2, 2, 2]
    report = json.loads((compare_dir / "results.json").read_text())
    report["models"][0]["test_ppl"] = {"1": 7.0, "2": None}
    report["models"][1]["test_ppl"] = {"1": 7.1, "2": 7.2}
    (compare_dir / "results.json").write_text(json.dumps(report))
    capsys.readouterr()
    points = gap_series(compare_dir, "gba-m2", "standard")["points"]
    assert [p["seeds"] for p in points] == [1, 1, 1, 1] and points[-1]["difference"] == pytest.approx(-0.01)
    assert capsys.readouterr().err == (f"note: {compare_dir}: gba-m2 seed 2 diverged (no test perplexity) "
                                       f"and is left out of the gap, as results.md's means leave it out\n")


def test_gap_of_a_copied_comparison_reads_the_curves_results_json_records(tmp_path, capsys):
    """results.json copied without its run folders (as the repository's results/ holds them): --gap said the
    models "share no evaluation"; it reads the validation curves results.json records, the same points."""
    import shutil

    from gbattn.analysis.cli import gap_series

    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    report = json.loads((compare_dir / "results.json").read_text())
    for row in report["models"]:  # the curves as `gbattn compare` records them: each seed's evaluations
        row["curves"] = {str(seed): [{k: e[k] for k in ("step", "tokens", "valid_loss")} | {"valid_ppl": 1.0}
                                     for e in map(json.loads, (compare_dir / row["label"] / f"seed{seed}" /
                                                               "metrics.jsonl").read_text().splitlines())]
                         for seed in row["seeds"]}
    (compare_dir / "results.json").write_text(json.dumps(report))
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copy(compare_dir / "results.json", copied)
    assert gap_series(copied, "gba-m2", "standard")["points"] == gap_series(compare_dir, "gba-m2", "standard")["points"]
    # a damaged curve is no evaluation (one line, exit 2), and a run folder, where there is one, comes first
    report["models"][1]["curves"] = {"1": "damaged", "2": [{"step": "x"}]}
    (copied / "results.json").write_text(json.dumps(report))
    assert cli_main(["plot", str(copied), "--gap", "gba-m2", "--out", str(tmp_path / "fig")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gbattn: error: cannot plot the gap of {copied}: results.json lists standard seed 1, 2 as finished, but no "
        f"standard/seed<S>/metrics.jsonl nor results.json holds its evaluations; copy every run directory along with "
        f"results.json"]
    # one seed's curve damaged, the other's kept: left out of the mean, silently, before
    report["models"][1]["curves"]["2"] = report["models"][0]["curves"]["2"]
    (copied / "results.json").write_text(json.dumps(report))
    assert cli_main(["plot", str(copied), "--gap", "gba-m2", "--out", str(tmp_path / "fig")]) == 2
    assert "results.json lists standard seed 1 as finished, but no" in capsys.readouterr().err
    shutil.copytree(compare_dir / "standard", copied / "standard")
    # its run folder beside a results.json that records another curve for it (gba-m2's): another run, refused
    assert cli_main(["plot", str(copied), "--gap", "gba-m2", "--out", str(tmp_path / "fig")]) == 2
    assert (f"{copied / 'standard' / 'seed2'} holds another run than {copied}'s results.json records for standard seed"
            f" 2 (its evaluation at step 100 differs): put back that run" in capsys.readouterr().err)
    shutil.copy(compare_dir / "results.json", copied)
    assert gap_series(copied, "gba-m2", "standard")["points"] == gap_series(compare_dir, "gba-m2", "standard")["points"]


def test_plot_refuses_a_run_folder_that_is_not_the_run_results_json_records(tmp_path, capsys):
    """A finished run's folder replaced by another run (a copy of another comparison's): curves.png drew it beside
    results.png's table of this comparison, and --gap paired its evaluations, silently."""
    import shutil

    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    for metrics in compare_dir.glob("*/seed*/metrics.jsonl"):  # the perplexities curves.png draws
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        events = [e | {"valid_ppl": math.exp(e["valid_loss"])} for e in events]
        metrics.write_text("".join(json.dumps(e) + "\n" for e in events))
    report = json.loads((compare_dir / "results.json").read_text())
    for row in report["models"]:
        row["curves"] = {str(seed): [{k: e[k] for k in ("step", "tokens", "valid_loss", "valid_ppl")}
                                     for e in map(json.loads, (compare_dir / row["label"] / f"seed{seed}" /
                                                               "metrics.jsonl").read_text().splitlines())]
                         for seed in row["seeds"]}
    (compare_dir / "results.json").write_text(json.dumps(report))
    with open(compare_dir / "standard" / "seed2" / "metrics.jsonl", "a") as f:  # a damaged line: skipped (a traceback)
        f.write(json.dumps({"event": "eval", "step": [100], "tokens": 1000, "valid_loss": 1.0}) + "\n")
    assert cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")]) == 0, capsys.readouterr().err
    assert cli_main(["plot", str(compare_dir), "--gap", "gba-m2", "--out", str(tmp_path / "gap")]) == 0
    capsys.readouterr()
    other = _gap_dir(tmp_path / "other", 400)  # (the same steps, other losses)
    metrics = other / "standard" / "seed1" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"valid_loss": 1.', '"valid_loss": 1.5'))
    shutil.rmtree(compare_dir / "standard" / "seed1")
    shutil.copytree(other / "standard" / "seed1", compare_dir / "standard" / "seed1")
    for argv in (["plot", str(compare_dir), "--out", str(tmp_path / "fig")],
                 ["plot", str(compare_dir), "--gap", "gba-m2", "--out", str(tmp_path / "gap")]):
        assert cli_main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"gbattn: error: {compare_dir / 'standard' / 'seed1'} holds another run than {compare_dir}'s results.json "
            f"records for standard seed 1 (its evaluation at step 100 differs): put back that run, or run `gbattn "
            f"compare` on it again"]


def test_gap_names_a_comparison_given_as_dot_by_its_own_name(tmp_path, monkeypatch):
    """`gbattn plot . --gap gba-m2` inside a comparison wrote "directory": "" into gap.json and drew the legend
    "400-step runs (, 2 seeds)" (and ".." for `plot ..`): the folder's own name is used now."""
    compare_dir = _gap_dir(tmp_path / "short", 400)
    for given, cwd in ((".", compare_dir), ("..", compare_dir / "standard")):
        monkeypatch.chdir(cwd)
        assert cli_main(["plot", given, "--gap", "gba-m2", "--out", str(tmp_path / "fig")]) == 0
        (series,) = json.loads((tmp_path / "fig" / "gap.json").read_text())["series"]
        assert series["directory"] == "short"
    # a link by its own name (the name given), as result.json names a run: it was named by its target's
    (tmp_path / "latest").symlink_to(compare_dir)
    assert cli_main(["plot", str(tmp_path / "latest"), "--gap", "gba-m2", "--out", str(tmp_path / "fig")]) == 0
    assert json.loads((tmp_path / "fig" / "gap.json").read_text())["series"][0]["directory"] == "latest"


def test_plot_of_a_run_export_or_denoise_output_names_what_the_folder_holds(tmp_path, capsys):
    """`plot COMPARE RUN --gap M` said "RUN/results.json not found: is RUN a gbattn run directory?" of a run
    directory, and `plot DENOISE_OUT` "is not the results.json of a `gbattn compare` directory (it has no
    models)": each now names what the folder holds, in one line, and nothing is written."""
    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    run = stand_in_run(tmp_path / "run")
    denoise = tmp_path / "denoise"
    denoise.mkdir()
    (denoise / "results.json").write_text(json.dumps({"protocol": {}, "tables": {}, "runs": []}))
    cases = [(["plot", str(run)], f"{run} holds a run, not a `gbattn compare` directory: `gbattn plot` draws a "
                                  f"comparison's results.json and curves; `gbattn analyze` reads a run"),
             (["plot", str(compare_dir), str(run), "--gap", "gba-m2"], f"{run} holds a run, not a `gbattn compare`"),
             (["plot", str(denoise)], f"{denoise} holds a `gbattn denoise` output, not a `gbattn compare` directory"),
             (["plot", str(compare_dir), str(denoise), "--gap", "gba-m2"], f"{denoise} holds a `gbattn denoise`")]
    started = tmp_path / "started"  # a comparison stopped before its first run finished: recipe.json, no results
    started.mkdir()
    (started / "recipe.json").write_text(json.dumps({"recipe": "x"}))
    cases.append((["plot", str(started)], f"{started} is a comparison with no finished run yet (no results.json"))
    for argv, expected in cases:
        assert cli_main([*argv, "--out", str(tmp_path / "fig")]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (argv, err)
    assert not (tmp_path / "fig").exists()
    # An --out holding a run (or a comparison) got the figures beside its own files; now refused, unwritten.
    for out, held in ((run, "a run"), (compare_dir, "a `gbattn compare` comparison")):
        assert cli_main(["plot", str(compare_dir), "--gap", "gba-m2", "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"gbattn: error: --out {out} holds {held}, not a folder of figures: choose another --out"]
        assert not (out / "gap.png").exists() and not (out / "gap.json").exists()


def test_gap_refuses_a_finished_seed_whose_metrics_hold_no_evaluation(tmp_path, capsys):
    """A finished seed whose metrics.jsonl was emptied or cut inside its first line was left out of the gap's mean
    (over one seed of two, exit 0), where `plot` refuses the same directory: one line naming the seed."""
    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    metrics = compare_dir / "standard" / "seed1" / "metrics.jsonl"
    whole = metrics.read_text()
    second_line = whole.index("\n") + 10
    # emptied, cut inside its first line, or cut after its first evaluation (steps 200 to 400 were seed 2's alone)
    for damaged in ("", whole[:10], whole[:second_line]):
        metrics.write_text(damaged)
        assert cli_main(["plot", str(compare_dir), "--gap", "gba-m2", "--out", str(tmp_path / "fig")]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"gbattn: error: cannot plot the gap of {compare_dir}: results.json lists standard seed 1 as finished, but "
            f"no standard/seed<S>/metrics.jsonl nor results.json holds its evaluations up to step 400, as the other "
            f"seeds do; copy every run directory along with results.json"]
        assert not (tmp_path / "fig").exists()


def test_gap_skips_an_evaluation_whose_loss_is_not_a_number(tmp_path):
    """A diverged evaluation (valid_loss null) of seed 1 at step 100 is left out: that step is seed 2's alone."""
    from gbattn.analysis.cli import gap_series

    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    metrics = compare_dir / "gba-m2" / "seed1" / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    events[0]["valid_loss"] = None
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert [p["seeds"] for p in gap_series(compare_dir, "gba-m2", "standard")["points"]] == [1, 2, 2, 2]


def test_gap_of_models_without_a_shared_evaluation_is_one_line_and_goes_to_the_first_directory(tmp_path, capsys):
    """A reference evaluated at other steps than the model shares no point: one line, nothing drawn. Without
    --out, the gap of several directories goes to the first one's figures folder."""
    compare_dir = _gap_dir(tmp_path / "cmp", 400)
    for seed in (1, 2):
        metrics = compare_dir / "standard" / f"seed{seed}" / "metrics.jsonl"
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({**e, "step": e["step"] + 1}) + "\n" for e in events))
    assert cli_main(["plot", str(compare_dir), "--gap", "gba-m2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gbattn: error: {compare_dir}: gba-m2 and standard share no evaluation (same seed and step)"]
    assert not (compare_dir / "figures").exists()
    short, long = _gap_dir(tmp_path / "short", 400), _gap_dir(tmp_path / "long", 800)
    assert cli_main(["plot", str(short), str(long), "--gap", "gba-m2"]) == 0
    assert (short / "figures" / "gap.png").is_file() and not (long / "figures").exists()


def test_gap_averages_each_step_over_the_seeds_evaluated_there(tmp_path):
    """Each --gap point is the mean over seeds of the model's minus the reference's loss at that step, and its
    tokens per parameter the mean of the model's seeds' tokens: with every seed logging the same numbers, one
    seed's alone passed too, and with three seeds the mean is not their median. The points go by step, also where a
    step was evaluated in a later seed only."""
    from gbattn.analysis.cli import gap_series

    compare_dir = _gap_dir(tmp_path / "cmp", 400, seeds=(1, 2, 3))
    metrics = compare_dir / "gba-m2" / "seed2" / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**e, "valid_loss": e["valid_loss"] + 0.3, "tokens": e["tokens"] + 20}) + "\n"
                               for e in events))
    first_seed = compare_dir / "gba-m2" / "seed1" / "metrics.jsonl"
    first_seed.write_text("".join(first_seed.read_text().splitlines(keepends=True)[1:]))  # no step 100 in seed 1
    logged = {}  # (label, seed, step) -> (tokens, valid_loss), read back here
    for label in ("gba-m2", "standard"):
        for seed in (1, 2, 3):
            for line in (compare_dir / label / f"seed{seed}" / "metrics.jsonl").read_text().splitlines():
                e = json.loads(line)
                logged[label, seed, e["step"]] = (e["tokens"], e["valid_loss"])
    points = gap_series(compare_dir, "gba-m2", "standard")["points"]
    assert [p["step"] for p in points] == [100, 200, 300, 400]
    for p in points:
        step = p["step"]
        seeds = [seed for seed in (1, 2, 3) if ("gba-m2", seed, step) in logged]
        gaps = [logged["gba-m2", seed, step][1] - logged["standard", seed, step][1] for seed in seeds]
        assert p["difference"] == pytest.approx(statistics.fmean(gaps)) and p["seeds"] == len(seeds)
        parameters = 100  # gba-m2's, as _gap_dir writes them
        tokens = [logged["gba-m2", seed, step][0] for seed in seeds]
        assert p["tokens_per_parameter"] == pytest.approx(statistics.fmean(tokens) / parameters)


def test_gap_to_a_longer_compute_matched_reference_says_its_end_is_not_paired(tmp_path):
    """A compute-matched reference trains 600 steps against GBA's 400: paired by step, the line (and its
    diamond) ends at step 400, mid-way through the reference's schedule, so the legend says so (it read like
    the final, compute-matched gap); a reference of the model's length gets no such note."""
    root = _gap_dir(tmp_path / "cmp", 400)
    rows = json.loads((root / "results.json").read_text())["models"]
    for seed in (1, 2):
        run = root / "compute-matched" / f"seed{seed}"
        run.mkdir(parents=True)
        events = [{"event": "eval", "step": s, "tokens": 10 * s, "valid_loss": 1.5 - s / 600} for s in (200, 400, 600)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rows.append({"label": "compute-matched", "parameters": 80, "steps": 600, "seeds": [1, 2]})
    (root / "results.json").write_text(json.dumps({"recipe": "x", "models": rows}))
    assert cli_main(["plot", str(root), "--gap", "gba-m2", "--against", "standard", "compute-matched",
                     "--out", str(tmp_path / "fig")]) == 0
    series = json.loads((tmp_path / "fig" / "gap.json").read_text())["series"]
    assert [(s["reference"], s["reference_steps"], s["points"][-1]["step"]) for s in series] == [
        ("standard", 400, 400), ("compute-matched", 600, 400)]
    fig = figures.gap_figure(series, "gba-m2", ["standard", "compute-matched"])
    legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]
    assert legends == [["400-step runs (cmp, 2 seeds)"],
                       ["400-step runs (cmp, 2 seeds)\ncompute-matched trains 600 steps: paired at equal steps only"]]
    assert texts_outside(fig) == []

    def diamonds(fig):
        return [len(line.get_xdata()) for ax in fig.axes for line in ax.get_lines() if line.get_marker() == "D"]

    assert diamonds(fig) == [1, 1]  # GBA's line ends at its own last step, 400, against either reference
    # The other way round, the compute-matched model's gap to standard (400 steps) ends at its step 400 of 600: the
    # diamond, "end of each run's schedule", marked it there; it is left out now.
    assert cli_main(["plot", str(root), "--gap", "compute-matched", "--against", "standard",
                     "--out", str(tmp_path / "fig2")]) == 0
    (longer,) = json.loads((tmp_path / "fig2" / "gap.json").read_text())["series"]
    assert (longer["steps"], longer["points"][-1]["step"]) == (600, 400)
    assert diamonds(figures.gap_figure([longer], "compute-matched", ["standard"])) == []


def test_plot_out_that_is_a_file_or_under_one_is_one_line(tmp_path, capsys):
    gap = _gap_dir(tmp_path / "gap", 400)
    compare_dir = tmp_path / "copied"
    compare_dir.mkdir()
    (compare_dir / "results.json").write_text(json.dumps(report_of([model_row("standard", {"42": 100.0})])))
    write_run(compare_dir, "standard", 42)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [(["plot", compare_dir], "is a file, not a directory", a_file),
             (["plot", compare_dir], "is not writable", a_file / "sub"),
             (["plot", gap, "--gap", "gba-m2", "--against", "standard"], "is a file, not a directory", a_file),
             (["plot", gap, "--gap", "gba-m2", "--against", "standard"], "is not writable", a_file / "sub")]
    for argv, expected, out in cases:
        code = cli_main([*map(str, argv), "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and f"--out {out} {expected}" in err, (argv, err)
    assert a_file.read_text() == "x"


def test_plot_without_pdf_removes_the_pdfs_of_an_earlier_plot(tmp_path):
    """`plot --pdf`, then `plot` after more runs finished, left the first call's PDFs beside the new PNGs."""
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    (compare_dir / "results.json").write_text(json.dumps(report_of([model_row("standard", {"42": 100.0})])))
    write_run(compare_dir, "standard", 42)
    assert len(plot_compare(compare_dir, pdf=True)) == 4
    (compare_dir / "figures" / "notes.pdf").write_bytes(b"x")  # not one of plot's figures: it stays
    plot_compare(compare_dir)
    assert sorted(p.name for p in (compare_dir / "figures").iterdir()) == [".lock", "curves.png", "notes.pdf",
                                                                           "results.png"]
    gap = _gap_dir(tmp_path / "gap", 400)
    for pdf in (["--pdf"], []):
        assert cli_main(["plot", str(gap), "--gap", "gba-m2", "--out", str(tmp_path / "g"), *pdf]) == 0
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [".lock", "gap.json", "gap.png"]


def test_a_plot_into_a_folder_another_process_writes_is_one_line_and_writes_nothing(tmp_path, capsys):
    """Two plots of different comparisons into one --out, at once, left one's curves.png beside the other's
    results.png (each figure written whole, the two writers interleaved), silently: the folder's lock, as a run's."""
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    (compare_dir / "results.json").write_text(json.dumps(report_of([model_row("standard", {"42": 100.0})])))
    write_run(compare_dir, "standard", 42)
    gap_dir = _gap_dir(tmp_path / "gap", 400)
    out = tmp_path / "fig"
    holder = hold_lock(out, "folder of figures")
    try:
        for argv in ([str(compare_dir)], [str(gap_dir), "--gap", "gba-m2"]):
            assert cli_main(["plot", *argv, "--out", str(out)]) == 2
            assert capsys.readouterr().err.strip().splitlines() == in_use(out, "folder of figures")
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    assert cli_main(["plot", str(compare_dir), "--out", str(out)]) == 0  # the lock released with its process

def test_a_seed_the_reference_lacks_is_left_out_of_the_paired_differences():
    """GBA finished seeds 1, 2 and 3, standard 1 and 2 (its seed 3 failed): GBA's paired differences are over
    seeds 1 and 2, the ones both have, and the cell is marked, every seed of the table agreeing in sign."""
    rows = [model_row("standard", {"1": 9.0, "2": 9.1}), model_row("gba-m2", {"1": 8.8, "2": 8.9, "3": 8.7})]
    rows[0]["valid_loss"] = {"1": 2.20, "2": 2.21}
    rows[1]["valid_loss"] = {"1": 2.17, "2": 2.18, "3": 9.99}
    md = results_markdown({**report_of(rows), "seeds": [1, 2, 3]})
    gba = next(line for line in md.splitlines() if line.startswith("| gba-m2 | 800,000 | 0.008 |"))
    assert "-0.030 (-0.030 / -0.030) **same sign**" in gba


def test_paired_differences_with_a_missing_seed_name_their_seeds_and_are_not_marked():
    """Standard on seeds 1, 2, 3 and GBA on 1 and 2 (its seed 3 failed): GBA's cell names each
    value's seed, says seed 3 is missing, and is not marked although both seeds agree in sign."""
    rows = [model_row("standard", {"1": 9.0, "2": 9.1, "3": 9.2}), model_row("gba-m2", {"1": 8.8, "2": 8.9})]
    rows[0]["valid_loss"] = {"1": 2.20, "2": 2.21, "3": 2.22}
    rows[1]["valid_loss"] = {"1": 2.17, "2": 2.18}
    md = results_markdown({**report_of(rows), "seeds": [1, 2, 3]})
    gba = next(line for line in md.splitlines() if line.startswith("| gba-m2 | 800,000 | 0.008 |"))
    assert "1: -0.030 / 2: -0.030; seed 3 missing" in gba and "**same sign**" not in gba
    rows[1]["valid_loss"]["3"] = 2.19
    rows[1]["test_ppl"]["3"] = 8.7  # (a seed paired is one with a test perplexity: one that did not diverge)
    gba = next(line for line in results_markdown(report_of(rows)).splitlines()
               if line.startswith("| gba-m2 | 800,000 | 0.008 |"))
    assert "(-0.030 / -0.030 / -0.030) **same sign**" in gba
    # a named seed's difference keeps its sign when it is worse, and every missing seed is named
    from gbattn.experiments.report import paired_cell

    assert paired_cell({"1": 0.02, "2": -0.01}, ["1", "2", "3", "4"]) == (
        "+0.005 (1: +0.020 / 2: -0.010; seed 3, 4 missing), p 0.80 over 2 seeds")


def test_a_compute_matched_cell_with_seeds_beyond_the_tables_names_them():
    """Standard on seeds 1 and 2 (the table's, named in the caption), compute-matched and GBA on 1, 2 and 3 (a
    comparison continued with --only): GBA's cell against compute-matched was three unnamed values under a caption
    naming two seeds, marked with the two seeds' chance of agreeing. Each value names its seed, the extra seed is
    said, the p says over how many, and the cell is not marked."""
    rows = [model_row("standard", {"1": 9.0, "2": 9.1}), model_row("gba-m2", {"1": 8.8, "2": 8.9, "3": 8.7}),
            model_row("compute-matched", {"1": 8.5, "2": 8.6, "3": 8.4}, compute_matched_to="gba-m2")]
    for row, losses in zip(rows, ({"1": 2.20, "2": 2.21}, {"1": 2.17, "2": 2.18, "3": 2.16},
                                  {"1": 2.12, "2": 2.14, "3": 2.11})):
        row["valid_loss"] = losses
    md = results_markdown({**report_of(rows), "seeds": [1, 2, 3]})
    assert "each seed's difference (1, 2); " in md
    gba = next(line for line in md.splitlines() if line.startswith("| gba-m2 | 800,000 | 0.008 |"))
    to_standard, to_matched = gba.split(" | ")[-2:]
    assert to_standard.startswith("-0.030 (-0.030 / -0.030) **same sign**")
    assert to_matched.startswith("+0.047 (1: +0.050 / 2: +0.040 / 3: +0.050; seed 3 beyond the table's), p ")
    assert to_matched.endswith(" over 3 seeds |") and "**same sign**" not in to_matched


def test_results_footer_claims_a_spread_only_where_a_model_has_two_seeds():
    """One seed per model: no "± std" is shown, and the footer says so instead of "mean ± sample std"."""
    rows = [model_row("standard", {"42": 9.0}), model_row("gba-m2", {"42": 8.8})]
    md = results_markdown(report_of(rows))
    assert "one seed per model, so no spread" in md and "sample std" not in md
    rows[1]["test_ppl"]["123"] = 8.7
    md = results_markdown(report_of(rows))
    assert "mean ± sample std over seeds" in md and "no spread" not in md


def test_results_say_when_test_is_validation_and_how_far_param_fair_is_above_gba():
    rows = [model_row("standard", {"42": 9.0}), model_row("param-fair", {"42": 8.6}), model_row("gba-m2", {"42": 8.8})]
    rows[1].update(param_matched_to="gba-m2", parameters=840_000)
    md = results_markdown(report_of(rows))
    assert "no test split: test perplexity is the validation perplexity" in md
    assert "`param-fair`: gba-m2 with standard attention at the smallest width giving at least its parameters (+5.0%)" \
        in md
    # The results figure says so too (it read "test perplexity" with nothing beside it).
    footer = "this data has no test split: test perplexity is the validation perplexity of the checkpoint chosen on it"
    assert footer in drawn_texts(figures.results_figure(report_of(rows)))["all"].splitlines()
    rows[0]["valid_ppl"] = {"42": 9.5}  # a real test split: test and validation differ
    assert "no test split" not in results_markdown(report_of(rows))
    assert "no test split" not in drawn_texts(figures.results_figure(report_of(rows)))["all"]


def test_the_validation_curve_table_averages_the_seeds_all_models_share():
    rows = [model_row("standard", {"42": 9.0, "123": 11.0}), model_row("gba-m2", {"42": 8.8})]
    md = results_markdown(report_of(rows))
    assert "## Validation perplexity during training (seed 42, the one all models share)" in md  # (not "mean over")
    rows[1] = model_row("gba-m2", {"42": 8.8, "123": 10.0, "7": 9.0})
    rows[0] = model_row("standard", {"42": 9.0, "123": 11.0, "5": 9.0})
    assert ("## Validation perplexity during training (mean over seeds 42, 123, the ones all models share)"
            in results_markdown(report_of(rows)))
    rows = [model_row("standard", {"42": 9.0, "123": 11.0}), model_row("gba-m2", {"42": 8.8})]
    assert "| 2,000 | 9.00 | 8.80 |" in md  # standard over seed 42 alone, not (9 + 11) / 2


def test_the_hardware_line_names_every_device_the_runs_used_once():
    rows = [model_row("standard", {"42": 9.0}), model_row("gba-m2", {"42": 8.8})]
    rows[1]["device"] = "cuda (NVIDIA H200); cpu (1 thread, x86_64)"
    rows[0]["device"] = "cpu (1 thread, x86_64)"
    line = next(x for x in results_markdown(report_of(rows)).splitlines() if x.startswith("Data:"))
    assert line.endswith("· hardware: cpu (1 thread, x86_64); cuda (NVIDIA H200) · INCOMPLETE (runs missing)")
    rows.reverse()  # in order of appearance, not sorted
    line = next(x for x in results_markdown(report_of(rows)).splitlines() if x.startswith("Data:"))
    assert line.endswith("· hardware: cuda (NVIDIA H200); cpu (1 thread, x86_64) · INCOMPLETE (runs missing)")


def test_plot_of_a_damaged_comparison_is_one_line_and_skips_damaged_metrics(tmp_path, capsys):
    """results.json whose rows are not rows, or lack a label, is named in one line (tracebacks
    before); a metrics line with a non-numeric loss or no token count is skipped like a cut one."""
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    write_run(compare_dir, "standard", 42)
    with open(compare_dir / "standard" / "seed42" / "metrics.jsonl", "a") as f:
        f.write('{"event": "train", "loss": 1.0}\n{"event": "train", "step": 9, "tokens": 9, "loss": "x"}\n')
    report = report_of([model_row("standard", {"42": 100.0})])
    for models, expected in ((5, "models must be a list of rows"), ([{"x": 1}], "a row has label=None"),
                             ([{**report["models"][0], "seeds": "42"}], "seeds='42' must be a list of integers"),
                             ([{**report["models"][0], "valid_loss": {"42": True}}],
                              "valid_loss must map seeds to numbers"),
                             ([{**report["models"][0], "init_from": ["base"]}],
                              "init_from=['base'] is of the wrong type")):
        (compare_dir / "results.json").write_text(json.dumps({**report, "models": models}))
        code = cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "results.json is damaged" in err and expected in err, err
    (compare_dir / "results.json").write_text(json.dumps({**report, "sets": ["max_steps=9"]}))  # --set values
    assert cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")]) == 2
    assert capsys.readouterr().err.strip().endswith("seeds must be a list and sets a mapping; rerun `gbattn compare` "
                                                    "with the same arguments to write it again")
    (compare_dir / "results.json").write_text(json.dumps({**report, "missing": [1]}))  # written into results.md
    assert cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")]) == 2
    assert "missing=[1] must be a list of run names" in capsys.readouterr().err
    (compare_dir / "results.json").write_text(json.dumps({"x": 1}))  # another program's file, not a damaged one
    assert cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "results.json is not the results.json of a `gbattn compare` directory (it has no models)")
    (compare_dir / "results.json").write_text(json.dumps(report))
    assert cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")]) == 0


def test_plot_of_a_comparison_whose_values_are_not_keyed_by_integer_seeds_is_one_line(tmp_path, capsys):
    """Seeds are sorted as numbers: a results.json whose test_ppl names seed "--7" was a ValueError traceback."""
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    write_run(compare_dir, "standard", 42)
    row = model_row("standard", {"42": 100.0})
    (compare_dir / "results.json").write_text(json.dumps(report_of([{**row, "test_ppl": {"42": 100.0, "--7": 90.0}}])))
    code = cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "results.json is damaged: standard: test_ppl has seed '--7', not an integer" in err


def test_plot_of_a_comparison_with_a_perplexity_of_zero_is_one_line(tmp_path, capsys):
    """The Δ vs standard divides by standard's mean perplexity: a results.json holding 0 was a ZeroDivisionError."""
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    write_run(compare_dir, "standard", 42)
    write_run(compare_dir, "gba-m2", 42)
    rows = [model_row("standard", {"42": 0.0}), model_row("gba-m2", {"42": 96.0})]
    (compare_dir / "results.json").write_text(json.dumps(report_of(rows)))
    code = cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("results.json is damaged: standard: test_ppl={'42': 0.0} must be perplexities (numbers above 0 and at "
            "most e^50; gbattn writes null from a loss of 50 nats)") in err


def test_gate_figure_shows_negative_tanh_gates():
    """A tanh gate (upcycled models) can be negative: the axes reach -1 instead of cutting it at 0."""
    rows = [{"layer": 0, "round": 1, "mean": -0.2, "std": 0.1, "per_dimension": [-0.3, -0.1]},
            {"layer": 1, "round": 1, "mean": 0.4, "std": 0.1, "per_dimension": [0.3, 0.5]}]
    fig = figures.gates_figure({"per_layer": rows}, {})
    heat_ax, bar_ax = fig.axes[0], fig.axes[1]
    assert bar_ax.get_ylim() == (-1.0, 1.0) and heat_ax.images[0].get_clim() == (-1.0, 1.0)
    fig = figures.gates_figure({"per_layer": [{**r, "mean": 0.5, "per_dimension": [0.5, 0.5]} for r in rows]}, {})
    assert fig.axes[1].get_ylim() == (0.0, 1.0)


def test_report_change_vs_standard_is_over_the_seeds_both_have():
    from gbattn.experiments.report import relative_change

    gba = {"1": 90.0, "2": 110.0, "3": 500.0}  # seed 3: GBA only
    standard = {"1": 100.0, "2": 100.0, "4": 1.0}  # seed 4: standard only
    assert relative_change(gba, standard) == pytest.approx(0.0)
    assert relative_change({"1": 95.0}, {"1": 100.0}) == pytest.approx(-0.05)
    assert relative_change({"1": 90.0}, {"2": 100.0}) is None


def test_a_model_as_good_as_standard_shows_a_change_of_zero_not_a_missing_one():
    """A Δ vs standard of exactly 0 is a change, "+0.0%", not "—" (which says there is none to give)."""
    rows = [model_row("standard", {"42": 9.0}), model_row("gba-m2", {"42": 9.0})]
    gba = next(line for line in results_markdown(report_of(rows)).splitlines() if line.startswith("| gba-m2 |"))
    assert gba.split(" | ")[5] == "+0.0%"


def test_the_seeds_sentence_counts_its_seeds_in_words():
    """The results figure's subtitle: "seeds" for two, "seed" for one, both where every model has the same
    seeds and where the means are over the seeds all models share."""
    from gbattn.experiments.report import seeds_sentence

    both = [model_row("standard", {"42": 9.0, "123": 9.1}), model_row("gba-m2", {"42": 8.8, "123": 8.9})]
    assert seeds_sentence(both) == "means over seeds 42, 123 (every model)"
    assert seeds_sentence(both[:1] + [model_row("gba-m2", {"42": 8.8})]) == (
        "means over the 1 seed all models share (42); 'all seeds' dots show the rest")
    three = [model_row("standard", {"1": 9.0, "2": 9.0, "3": 9.0}), model_row("gba-m2", {"1": 8.8, "2": 8.8})]
    assert seeds_sentence(three).startswith("means over the 2 seeds all models share (1, 2)")
    assert seeds_sentence([model_row("standard", {"42": 9.0})]) == "means over seed 42 (every model)"


def test_report_std_is_the_sample_standard_deviation_of_the_finite_values():
    import math

    from gbattn.experiments.report import mean_std

    mean, std = mean_std([10.0, 12.0, None, float("inf"), float("nan")])  # a diverged seed is left out
    assert mean == 11.0 and std == pytest.approx(math.sqrt(2.0))  # n - 1: sqrt(((-1)**2 + 1**2) / 1)
    assert mean_std([10.0, 12.0, 14.0])[1] == pytest.approx(2.0)
    assert mean_std([10.0]) == (10.0, None) and mean_std([None, float("inf")]) == (None, None)


# ---- gbattn analyze figures from hand-made summaries ---------------------------------------


def test_entropy_figure_draws_densities_the_bound_and_each_layers_change():
    """The histogram is a density per nat (each round's integrates to 1; the bins here are not 1 nat
    wide), the position panel's bound is log(t + 1), and a layer whose correction lowers the
    entropy by 20% is boxed -20%, one that changes it by 0.4% +0%."""
    T = 8
    entropy = {"histogram": {"edges": np.linspace(0, math.log(T), 5).tolist(),
                             "counts_per_round": [[1, 2, 3, 4], [4, 3, 2, 1]]}, "max_possible": math.log(T),
               "mean_per_round": [1.5, 1.2], "relative_drop": 0.2,
               "per_layer": [{"mean_per_round": [1.5, 1.2], "per_head": [[1.4, 1.6], [1.1, 1.3]],
                              "relative_drop": 0.2}],
               "per_position_mean": [np.linspace(0, 2, T).tolist(), np.linspace(0, 1.6, T).tolist()]}
    fig = figures.entropy_figure(entropy, None)
    hist_ax, layer_ax, pos_ax = fig.axes[:3]
    assert layer_ax.get_ylim()[1] == pytest.approx(1.1 * 1.6)  # room for the highest head's dot, above the means
    for patch in hist_ax.patches:
        values, edges = patch.get_data()[:2]
        assert float(np.sum(values * np.diff(edges))) == pytest.approx(1.0)
    (bound,) = [line for line in pos_ax.get_lines() if line.get_label().startswith("bound")]
    np.testing.assert_allclose(bound.get_ydata(), np.log(np.arange(T) + 1))
    # the histogram's vertical lines: each round's mean and the largest possible entropy, log T (the last edge)
    assert sorted(line.get_xdata()[0] for line in hist_ax.get_lines()) == pytest.approx([1.2, 1.5, math.log(T)])
    assert [t.get_text() for t in layer_ax.texts] == ["-20%"]
    assert texts_outside(fig) == []  # the per-layer title on one line ran past the figure's right edge
    # A drop that rounds to nothing is boxed +0%, as the terminal says it (the box read -0%).
    entropy["per_layer"][0]["relative_drop"] = 0.004
    assert [t.get_text() for t in figures.entropy_figure(entropy, None).axes[1].texts] == ["+0%"]


def test_entropy_figure_of_gba_in_some_layers_says_over_which_layers_each_mean_is():
    """GBA in layer 1 of 2: the legend's round means are over 2 and 1 layers and the change is the corrected
    layer's, not "overall" (the figure read "round 0: mean 3.10", "round 1: mean 3.20", "0% lower overall")."""
    T = 8
    entropy = {"histogram": {"edges": np.linspace(0, math.log(T), 5).tolist(),
                             "counts_per_round": [[1, 2, 3, 4], [4, 3, 2, 1]]}, "max_possible": math.log(T),
               "mean_per_round": [3.1, 3.2], "layers_per_round": [2, 1], "relative_drop": 0.0,
               "per_layer": [{"mean_per_round": [3.0], "per_head": [[3.0]]},
                             {"mean_per_round": [3.2, 3.2], "per_head": [[3.2], [3.2]], "relative_drop": 0.0}],
               "per_position_mean": [np.linspace(0, 2, T).tolist(), np.linspace(0, 1.6, T).tolist()]}
    fig = figures.entropy_figure(entropy, None)
    hist_ax, layer_ax = fig.axes[:2]
    assert texts_outside(fig) == []
    labels = [t.get_text() for t in hist_ax.get_legend().get_texts()]
    assert labels[:2] == ["round 0 (attention): mean 3.10 (2 layers)", "round 1 (correction): mean 3.20 (1 layer)"]
    assert "0% lower in the layers that have it;" in layer_ax.get_title() and "overall" not in layer_ax.get_title()
    # round 1's bars: none for layer 0, which has no correction (not its round 0 again)
    heights = [bar.get_height() for bar in layer_ax.containers[1]]
    assert math.isnan(heights[0]) and heights[1] == pytest.approx(3.2)


def test_entropy_figure_of_gba_in_every_layer_boxes_an_unchanged_layer_and_labels_each_thing_once():
    """GBA in both layers: the round means are over all layers (no "(2 layers)", the change is "overall"), a
    layer whose correction leaves the entropy unchanged is boxed +0% (not left bare), the histogram's bound is
    the top edge log T, "per head" is one legend entry, and the paper's lines set the axis top with 10% room.
    A one-round model (no correction) gets no paper correction line to compare with."""
    T = 8
    entropy = {"histogram": {"edges": np.linspace(0, math.log(T), 5).tolist(),
                             "counts_per_round": [[1, 2, 3, 4], [4, 3, 2, 1]]}, "max_possible": math.log(T),
               "mean_per_round": [1.5, 1.2], "layers_per_round": [2, 2], "relative_drop": 0.2,
               "per_layer": [
                   {"mean_per_round": [1.5, 1.5], "per_head": [[1.4, 1.6], [1.4, 1.6]], "relative_drop": 0.0},
                   {"mean_per_round": [1.5, 0.9], "per_head": [[1.4, 1.6], [0.8, 1.0]], "relative_drop": 0.4}],
               "per_position_mean": [np.linspace(0, 2, T).tolist(), np.linspace(0, 1.6, T).tolist()]}
    paper = {"entropy_round0_nats": 3.31, "entropy_correction_nats": 2.58, "seq_len": 256}
    hist_ax, layer_ax = figures.entropy_figure(entropy, paper).axes[:2]
    assert [t.get_text() for t in hist_ax.get_legend().get_texts()] == [
        "round 0 (attention): mean 1.50", "round 1 (correction): mean 1.20", f"max log T = {math.log(T):.2f}"]
    assert "(correction 20% lower overall; " in layer_ax.get_title()
    assert [t.get_text() for t in layer_ax.texts] == ["+0%", "-40%"]
    # GBA in some layers: the by-position curves say over how many layers, as the histogram's legend (a round 0 over
    # both beside a correction over one read as the correction raising the entropy); two corrections: "round 1"
    partial = {**entropy, "layers_per_round": [2, 1, 1], "mean_per_round": [1.5, 1.2, 1.1],
               "histogram": {**entropy["histogram"], "counts_per_round": [[1, 2, 3, 4], [4, 3, 2, 1], [4, 3, 2, 1]]},
               "per_position_mean": entropy["per_position_mean"] + [np.linspace(0, 1.5, T).tolist()],
               "per_layer": [{"mean_per_round": [1.5], "per_head": [[1.4, 1.6]]},
                             {"mean_per_round": [1.5, 0.9, 0.8], "per_head": [[1.4, 1.6], [0.8, 1.0], [0.7, 0.9]],
                              "relative_drop": 0.4}]}
    _, partial_layer_ax, pos_ax = figures.entropy_figure(partial, paper).axes[:3]
    assert [t.get_text() for t in pos_ax.get_legend().get_texts()][:3] == [
        "round 0 (attention) (2 layers)", "round 1 (correction) (1 layer)", "round 2 (correction) (1 layer)"]
    assert "(round 1 20% lower in the layers that have it;" in partial_layer_ax.get_title()
    assert [t.get_text() for t in layer_ax.get_legend().get_texts()].count("per head") == 1
    assert layer_ax.get_ylim()[1] == pytest.approx(1.1 * 3.31)
    centres = [[bar.get_x() + bar.get_width() / 2 for bar in c] for c in layer_ax.containers]
    assert centres == [pytest.approx([-0.2, 0.8]), pytest.approx([0.2, 1.2])]  # each round beside the other
    assert {"paper round 0 (3.31, T=256)", "paper correction (2.58, T=256)"} <= {
        t.get_text() for t in layer_ax.get_legend().get_texts()}
    one_round = {**entropy, "mean_per_round": [1.5], "layers_per_round": [2], "relative_drop": None,
                 "histogram": {**entropy["histogram"], "counts_per_round": [[1, 2, 3, 4]]},
                 "per_layer": [{"mean_per_round": [1.5], "per_head": [[1.4, 1.6]]}] * 2,
                 "per_position_mean": entropy["per_position_mean"][:1]}
    layer_ax = figures.entropy_figure(one_round, paper).axes[1]
    assert not [line for line in layer_ax.get_lines() if line.get_label().startswith("paper")]


def test_gate_figure_of_two_correction_rounds_names_each_row_and_sets_the_rounds_bars_side_by_side():
    """Three rounds in layers 0 and 1: the heatmap's rows are named by layer and gate (g1, g2), each layer's two
    bars sit either side of its tick, and without a title of its own the figure says what it shows."""
    rows = [{"layer": li, "round": c, "mean": 0.5, "std": 0.1, "per_dimension": [0.4, 0.6]}
            for li in (0, 1) for c in (1, 2)]
    fig = figures.gates_figure({"per_layer": rows}, {})
    heat_ax, bar_ax = fig.axes[:2]
    assert [t.get_text() for t in heat_ax.get_yticklabels()] == ["layer 0 g1", "layer 0 g2", "layer 1 g1",
                                                                 "layer 1 g2"]
    centres = [[bar.get_x() + bar.get_width() / 2 for bar in c] for c in bar_ax.containers if hasattr(c, "patches")]
    assert centres == [pytest.approx([-0.2, 0.8]), pytest.approx([0.2, 1.2])]
    assert fig.get_suptitle() == "GBA gates g_m: shrinkage of the correction round"


def test_norms_figure_names_each_group_by_layer_and_round_and_each_norm_in_the_legend():
    """Two correction rounds in layer 0: the groups are "layer 0, round 1" and "layer 0, round 2" (one round: the
    layer alone), each group says |gc|/|r| to two places above its tallest bar, and the legend names the six
    norms."""
    def row(layer: int, m: int) -> dict:
        return {"layer": layer, "round": m, "x": 4.0, "round0_output": 3.0, "residual": 2.0, "correction": 1.5,
                "gated_correction": 0.5, "residual_after": 1.8, "gated_over_residual": 0.25}

    ax = figures.norms_figure({"per_layer": [row(0, 1), row(0, 2)]}).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["layer 0, round 1", "layer 0, round 2"]
    assert [(t.get_text(), t.xy) for t in ax.texts] == [("|gc|/|r| = 0.25", (0, 4.0)), ("|gc|/|r| = 0.25", (1, 4.0))]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [label for _, label in figures.NORM_KEYS]
    one = figures.norms_figure({"per_layer": [row(1, 1)]}).axes[0]
    assert [t.get_text() for t in one.get_xticklabels()] == ["layer 1"]


def test_loss_diff_figure_names_the_difference_and_counts_ties_apart():
    """Five tokens better, three worse, two within the tie margin: 50% better, 30% worse, and the
    axis says which loss is subtracted from which."""
    diff = np.array([[0.5, 0.2, 0.3, 0.1, 0.4], [-0.5, -0.2, -0.1, 5e-5, -5e-5]])
    fig = figures.loss_diff_figure(diff, "gba", "standard", 1e-4)
    hist_ax = fig.axes[0]
    assert hist_ax.get_xlabel().startswith("loss(standard) − loss(gba)  (nats per token)")
    assert hist_ax.get_title().startswith("gba better on 50% of tokens, worse on 30% ")
    # 1,000 tokens with two outliers: the histogram's range is the 0.5-99.5th percentiles, the outliers are
    # piled into the end bins, and the axis says so (an end bin read as that many tokens at its value).
    many = np.concatenate([np.linspace(-0.1, 0.1, 998), [-5.0, 5.0]])[None, :]
    hist_ax = figures.loss_diff_figure(many, "gba", "standard", 1e-4).axes[0]
    lo, hi = np.percentile(many, [0.5, 99.5])
    assert hist_ax.get_xlabel() == (f"loss(standard) − loss(gba)  (nats per token)\n"
                                    f"10 tokens outside [{lo:+.2f}, {hi:+.2f}] counted in the end bins")
    # nothing outside the range: no such line
    # a token at the range's end is inside it: ten at exactly the 0.5th percentile are not counted as outside
    edge = np.concatenate([np.full(10, -1.0), np.linspace(-0.5, 0.5, 990)])[None, :]
    lo, hi = np.percentile(edge, [0.5, 99.5])
    assert lo == -1.0
    hist_ax = figures.loss_diff_figure(edge, "gba", "standard", 1e-4).axes[0]
    assert hist_ax.get_xlabel().endswith(f"\n{int((edge > hi).sum())} tokens outside [{lo:+.2f}, {hi:+.2f}] counted in "
                                         f"the end bins")
    ties = figures.loss_diff_figure(np.zeros((2, 5)), "gba", "standard", 1e-4).axes[0]
    assert ties.get_xlabel() == "loss(standard) − loss(gba)  (nats per token)"


def test_loss_diff_figure_signs_its_mean_either_way():
    """The mean line's label carries its sign: a run worse on average reads "mean -0.100 nats", a better one
    "mean +0.100 nats"."""
    for diff, said in ((np.full((1, 4), -0.1), "mean -0.100 nats"), (np.full((1, 4), 0.1), "mean +0.100 nats")):
        hist_ax = figures.loss_diff_figure(diff, "gba", "standard", 1e-4).axes[0]
        assert [t.get_text() for t in hist_ax.get_legend().get_texts()] == [said]
    # the position panel is the mean over rows at each position, not their sum
    diff = np.array([[0.1, 0.4, -0.2], [0.3, 0.0, -0.4]])
    (by_position,) = figures.loss_diff_figure(diff, "gba", "standard", 1e-4).axes[1].get_lines()[:1]
    assert list(by_position.get_ydata()) == pytest.approx([0.2, 0.2, -0.3])


def test_examples_figure_shows_the_last_context_tokens_and_the_gain():
    """A query at position 29 with context 24: the bars are over tokens 6..29 (ending at the query's
    own), and the gain is the other model's loss minus this one's."""
    example = {"row": 3, "position": 29, "attention": np.linspace(0.0, 1.0, 60).reshape(2, 30),
               "tokens": [f"t{i}" for i in range(30)], "target": "x", "loss": 1.0, "against_loss": 1.5}
    fig = figures.examples_figure([example], layer=1, context=24)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"t{i}" for i in range(6, 30)]
    assert [bar.get_height() for bar in ax.containers[0]] == pytest.approx(example["attention"][0, 6:])
    assert "loss 1.00 vs 1.50 nats for the other model (gain +0.50)" in ax.get_title()


def test_examples_figure_of_a_short_context_shows_every_token_upright_with_the_query_in_bold():
    """A query at position 4 (five tokens, fewer than the 24 of context): five bars, one per token, the
    one-character names upright, the last (the query's own token) bold; no example at all is a figure that says so."""
    example = {"row": 0, "position": 4, "attention": np.full((2, 5), 0.2), "tokens": list("abcde"), "target": "f",
               "loss": 1.0, "against_loss": 1.5}
    ax = figures.examples_figure([example], layer=0, context=24).axes[0]
    ticks = ax.get_xticklabels()
    assert [t.get_text() for t in ticks] == list("abcde") and {t.get_rotation() for t in ticks} == {0.0}
    assert [t.get_fontweight() for t in ticks] == ["normal"] * 4 + ["bold"]
    assert ax.get_xlim() == pytest.approx((-0.6, 4.6))
    pairs = figures.examples_figure([{**example, "tokens": ["ab", "cd", "ef", "gh", "ij"]}], layer=0).axes[0]
    assert {t.get_rotation() for t in pairs.get_xticklabels()} == {0.0}  # two characters stay upright too
    newline = figures.examples_figure([{**example, "target": "\n"}], layer=0).axes[0]
    assert "predicting '↵'" in newline.get_title()  # the target drawn as the axis draws a token
    empty = figures.examples_figure([], layer=0).axes[0]
    assert [t.get_text() for t in empty.texts] == ["no example positions"]


def test_gate_figure_error_bars_are_the_std_and_paper_markers_sit_at_their_layer():
    """GBA in layers 1 and 3 only: each bar's error bar spans mean ± std, and the paper's markers are
    its values for layers 1 and 3 (0.48 and 0.43), not for the first two layers."""
    rows = [{"layer": 1, "round": 1, "mean": 0.4, "std": 0.1, "per_dimension": [0.3, 0.5]},
            {"layer": 3, "round": 1, "mean": 0.6, "std": 0.05, "per_dimension": [0.55, 0.65]}]
    fig = figures.gates_figure({"per_layer": rows}, {"gate_mean_per_layer": [0.35, 0.48, 0.41, 0.43]})
    # one correction round: each heatmap row is named by its layer alone (no "g1")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["layer 1", "layer 3"]
    bar_ax = fig.axes[1]
    (errorbars,) = [c for c in bar_ax.containers if hasattr(c, "has_yerr")]
    segments = errorbars.lines[2][0].get_segments()
    assert [(s[0][1], s[1][1]) for s in segments] == [pytest.approx((0.3, 0.5)), pytest.approx((0.55, 0.65))]
    (paper,) = [line for line in bar_ax.get_lines() if line.get_label() == "paper"]
    assert list(paper.get_xdata()) == [0, 1] and list(paper.get_ydata()) == [0.48, 0.43]
    # The legend says what the error bar is a spread of (summary.json's std_definition), not just "std".
    assert "ours: mean ± std\n(over tokens × dimensions)" in [t.get_text() for t in bar_ax.get_legend().get_texts()]
    assert texts_outside(fig) == []
    # ... and the paper's values are called its own model's beside a run of another shape (layers 1 and 3 of four
    # here; another depth, more rounds or another gate too), plain "paper" beside one of its shape only
    paper = {"gate_mean_per_layer": [0.35, 0.48, 0.41, 0.43]}
    label = figures.paper_gates_label
    assert label({"per_layer": rows}, paper, 4) == "paper (its 4-layer M=2 model)"
    every = [{**rows[0], "layer": layer} for layer in range(4)]
    assert label({"per_layer": every}, paper, 4, "boosted") == "paper"
    assert label({"per_layer": every}, paper, 8, "boosted (layers=[0, 1, 2, 3])") == "paper (its 4-layer M=2 model)"
    assert label({"per_layer": every}, paper, 4, "boosted (gate=scalar)") == "paper (its 4-layer M=2 model)"
    assert label({"per_layer": every}, paper, 4, "boosted (gate=mlp)") == "paper (its 4-layer M=2 model)"
    assert label({"per_layer": every}, paper, 4, "boosted (rounds=2, gate=linear)") == "paper"
    assert label({"per_layer": every + [{**rows[0], "round": 2}]}, paper, 4) == "paper (its 4-layer M=2 model)"
    drawn = figures.gates_figure({"per_layer": rows}, {**paper, "gate_mean_per_layer_revised": [0.3] * 4}, "",
                                 label({"per_layer": rows}, paper, 4))
    assert {line.get_label() for line in drawn.axes[1].get_lines()} >= {
        "paper (its 4-layer M=2 model)", "paper (its 4-layer M=2 model, revision)"}


def test_curves_count_thousands_of_tokens_in_thousands_and_fewer_as_they_are():
    """5,000 tokens: the axis is in thousands (x 5.0); 500: plain tokens; exactly 1,000 and 1,000,000 in
    thousands and millions."""
    for last, xlabel, x in ((5_000, "tokens seen (thousands)", 5.0), (500, "tokens seen", 500.0),
                            (1_000, "tokens seen (thousands)", 1.0), (1_000_000, "tokens seen (millions)", 1.0)):
        fig = figures.curves_figure({"standard": {"42": {"train": [(last, 3.0)], "valid": [(last, 20.0)]}}})
        assert fig.axes[0].get_xlabel() == fig.axes[1].get_xlabel() == xlabel
        assert list(fig.axes[1].get_lines()[0].get_xdata()) == [x]


def test_curves_are_drawn_in_the_units_of_the_token_axis():
    """Two million tokens: the x axis is in millions, for the training and the validation curve alike."""
    points = [(500_000, 40.0), (1_000_000, 20.0), (2_000_000, 10.0)]
    fig = figures.curves_figure({"standard": {"42": {"train": [(t, 3.0) for t, _ in points], "valid": points}}})
    train_ax, valid_ax = fig.axes[:2]
    assert valid_ax.get_xlabel() == train_ax.get_xlabel() == "tokens seen (millions)"
    for ax in (train_ax, valid_ax):
        assert list(ax.get_lines()[0].get_xdata()) == [0.5, 1.0, 2.0]


def test_print_summary_says_on_how_many_tokens_this_run_is_better_and_worse(tmp_path, capsys):
    summary = analysis_summary(0.1)
    summary["loss_diff"] = {"against": "standard/seed42", "against_attention": "standard", "against_loss": 2.1,
                            "against_checkpoint": "best", "against_step": 8,
                            "loss": 2.0, "mean": 0.1, "median": 0.05, "fraction_positive": 0.6,
                            "fraction_negative": 0.3, "fraction_tied": 0.1, "tie_nats": 1e-4, "top_tokens": []}
    print_summary(summary, tmp_path / "summary.json")
    assert ("this run better on 60% of tokens, worse on 30%, within 0.0001 nats on 10%"
            in capsys.readouterr().out)


def test_paired_table_gives_each_models_validation_loss_as_mean_and_sample_std():
    rows = [model_row("standard", {"1": 9.0, "2": 9.1, "3": 9.2}), model_row("gba-m2", {"1": 8.8, "2": 8.9, "3": 9.0})]
    rows[0]["valid_loss"] = {"1": 2.20, "2": 2.21, "3": 2.22}
    rows[1]["valid_loss"] = {"1": 2.17, "2": 2.18, "3": 2.19}
    md = results_markdown({**report_of(rows), "seeds": [1, 2, 3]})
    std = next(line for line in md.splitlines() if line.startswith("| standard | 800,000 | 0.008 |"))
    assert "| 2.210 ± 0.010 |" in std  # n - 1: sqrt((0.01**2 + 0.01**2) / 2)
def test_plot_refuses_a_results_json_with_a_boolean_count_or_a_text_published_value(tmp_path, capsys):
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    for label in ("standard", "gba-m2"):  # with a validation loss at one step: --gap has a point to divide
        write_run(compare_dir, label, 42)
        with open(compare_dir / label / "seed42" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"event": "eval", "step": 2, "tokens": 200, "valid_loss": 3.9}) + "\n")
    row = model_row("standard", {"42": 100.0})
    for damaged, expected in (({**row, "parameters": True}, "parameters=True must be an integer"),
                              ({**row, "seeds": [True]}, "seeds=[True] must be a list of integers"),
                              ({**row, "published": "6.55"}, "published='6.55' is of the wrong type"),
                              # plot --gap divided by it: a ZeroDivisionError traceback, negative tokens per parameter
                              ({**row, "parameters": 0}, "parameters=0 must be an integer >= 1"),
                              ({**row, "parameters": -5}, "parameters=-5 must be an integer >= 1"),
                              ({**row, "steps": 0}, "steps=0 must be an integer >= 1"),
                              # the chart read published[1] (an IndexError) and drew a text value
                              ({**row, "published": [6.55]}, "published=[6.55] must be [mean, std] (numbers or null)"),
                              ({**row, "published": ["6.55", None]}, "published=['6.55', None] must be [mean, std]")):
        (compare_dir / "results.json").write_text(json.dumps(report_of([row, {**damaged, "label": "gba-m2"}])))
        for argv in (["--out", str(tmp_path / "fig")], ["--gap", "gba-m2", "--out", str(tmp_path / "gap")]):
            code = cli_main(["plot", str(compare_dir), *argv])
            err = capsys.readouterr().err.strip()
            assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_plot_refuses_a_results_json_with_a_number_too_large_for_a_float(tmp_path, capsys):
    """A 400-digit integer is a JSON number but no float: as a perplexity or a published value the chart's
    mean, and as the parameters --gap's tokens per parameter, were an OverflowError traceback (exit 1); as the train
    tokens of a model another continues (added to its curves' tokens) it is not added."""
    compare_dir = paired_runs(tmp_path / "cmp")
    huge, row = 10**400, model_row("standard", {"42": 100.0})
    for damaged, expected in (({**row, "test_ppl": {"42": huge}}, "test_ppl must map seeds to numbers"),
                              ({**row, "published": [huge, None]}, "must be [mean, std] (numbers or null)"),
                              ({**row, "parameters": huge}, "must be an integer >= 1")):
        (compare_dir / "results.json").write_text(json.dumps(report_of([row, {**damaged, "label": "gba-m2"}])))
        for argv in (["--out", str(tmp_path / "fig")], ["--gap", "gba-m2", "--out", str(tmp_path / "gap")]):
            code = cli_main(["plot", str(compare_dir), *argv])
            err = capsys.readouterr().err.strip()
            assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    # the train tokens of a model another continues are added to its curves' tokens: too large, they are not
    continued = {**row, "label": "gba-m2", "init_from": "standard"}
    (compare_dir / "results.json").write_text(json.dumps(report_of([{**row, "train_tokens": huge}, continued])))
    assert cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")]) == 0


def test_plot_refuses_a_results_json_with_values_gbattn_never_writes(tmp_path, capsys):
    """read_report took a negative published std, an infinite published mean, perplexities of 1e308, a negative
    validation loss and a curve's validation loss of 1.7e308, none of which gbattn writes (a perplexity is null from a
    loss of 50 nats, and a loss, computed in float32, null beyond the largest float32): the chart's error bar and axis
    limits, the mean over seeds and --gap's mean difference were tracebacks (exit 1). Each is one line naming the
    file and the field, exit 2; a
    validation loss above 50 nats (a diverged seed's, which gbattn writes) is taken, and a metrics line with a loss
    gbattn never writes is skipped like any damaged one."""
    compare_dir = paired_runs(tmp_path / "cmp")
    row = model_row("standard", {"42": 100.0})
    ppl = "must be perplexities (numbers above 0 and at most e^50; gbattn writes null from a loss of 50 nats)"
    published = ("must be [mean, std] of a perplexity: a mean above 0 and a std from 0, both finite and at most e^50 "
                 "(or null)")
    for damaged, expected in (
            ({**row, "published": [6.55, -1.0]}, f"gba-m2: published=[6.55, -1.0] {published}"),
            ({**row, "published": [math.inf, None]}, f"gba-m2: published=[inf, None] {published}"),
            ({**row, "test_ppl": {"42": 1e308, "123": 1.5e308}},
             f"gba-m2: test_ppl={{'42': 1e+308, '123': 1.5e+308}} {ppl}"),
            ({**row, "valid_loss": {"42": -1.0}}, "gba-m2: valid_loss={'42': -1.0} must be losses (numbers from 0 to "
                                                  "3.4e38, the largest float32; gbattn writes null beyond)")):
        (compare_dir / "results.json").write_text(json.dumps(report_of([row, {**damaged, "label": "gba-m2"}])))
        code = cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")])
        assert code == 2 and capsys.readouterr().err.strip().splitlines() == [
            f"gbattn: error: {compare_dir / 'results.json'} is damaged: {expected}; rerun `gbattn compare` with the "
            f"same arguments to write it again"], damaged
    # a comparison copied without its run folders: --gap reads the curves results.json records
    copied = tmp_path / "copied"
    copied.mkdir()
    curve = [{"step": 2, "tokens": 200, "valid_loss": 1.7e308, "valid_ppl": None}]
    rows = [{**row, "curves": {"42": [{**curve[0], "valid_loss": 3.9}]}}, {**row, "label": "gba-m2", "curves": {
        "42": curve, "7": curve}, "seeds": [7, 42], "test_ppl": {"7": 100.0, "42": 100.0}}]
    (copied / "results.json").write_text(json.dumps(report_of(rows)))
    assert cli_main(["plot", str(copied), "--gap", "gba-m2", "--out", str(tmp_path / "gap")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"gbattn: error: {copied / 'results.json'} is damaged: gba-m2: the curve of seed 42 has valid_loss=1.7e+308 at "
        f"step 2, which must be a loss (a number from 0 to 3.4e38, the largest float32; gbattn writes null beyond); "
        f"rerun `gbattn compare` with the same arguments to write it again"]
    # what gbattn writes for a seed that diverged: a loss above 50 nats, its perplexity null
    diverged = {**row, "test_ppl": {"42": None}, "valid_ppl": {"42": None}, "valid_loss": {"42": 64.49}}
    (compare_dir / "results.json").write_text(json.dumps(report_of([row, {**diverged, "label": "gba-m2"}])))
    assert cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")]) == 0
    with open(compare_dir / "gba-m2" / "seed42" / "metrics.jsonl", "a") as f:  # a loss no float32 holds: skipped
        f.write(json.dumps({"event": "eval", "step": 3, "tokens": 300, "valid_loss": 1.7e308}) + "\n")
    with open(compare_dir / "standard" / "seed42" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "eval", "step": 3, "tokens": 300, "valid_loss": 3.8}) + "\n")
    (compare_dir / "results.json").write_text(json.dumps(report_of([row, {**row, "label": "gba-m2"}])))
    assert cli_main(["plot", str(compare_dir), "--gap", "gba-m2", "--out", str(tmp_path / "gap")]) == 0
    assert [p["step"] for p in json.loads((tmp_path / "gap" / "gap.json").read_text())["series"][0]["points"]] == [2]


def test_plot_refuses_a_label_that_leads_out_of_the_comparison(tmp_path, capsys):
    """plot reads LABEL/seedS/metrics.jsonl of every row: a results.json label "../elsewhere" drew the curves of a
    folder outside the comparison as that model's. A label that is not a folder name is damage, one line."""
    compare_dir = tmp_path / "cmp"
    compare_dir.mkdir()
    write_run(compare_dir, "standard", 42)
    write_run(tmp_path, "elsewhere", 42)
    for label in ("../elsewhere", "..", "", "a/b"):
        rows = [model_row("standard", {"42": 100.0}), model_row(label, {"42": 90.0})]
        (compare_dir / "results.json").write_text(json.dumps(report_of(rows)))
        code = cli_main(["plot", str(compare_dir), "--out", str(tmp_path / "fig")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and f"label={label!r}" in err, err
    assert not (tmp_path / "fig").exists()


def test_a_continued_model_counts_its_continuation_and_is_drawn_after_its_base(tmp_path):
    """``upcycle``: rows that continue ``base``'s weights say what their steps, tokens and FLOPs count
    and what the base adds; their curves start after the base's tokens; a recipe without param-fair
    or compute-matched rows explains neither."""
    from gbattn.analysis.cli import read_curves

    base = {**model_row("base", {"42": 200.0}, steps=600), "train_tokens": 1_000, "train_flops": 2.11e13,
            "wall_clock_s": 390.0}
    rows = [base, {**model_row("standard-continued", {"42": 129.0}, steps=600), "init_from": "base"},
            {**model_row("gba-upcycled", {"42": 128.0}, steps=600), "init_from": "base"}]
    md = results_markdown(report_of(rows))
    assert ("standard-continued, gba-upcycled continue base's trained weights (a fresh optimizer and schedule): "
            "their steps, train tokens, tokens/param, train PFLOP and wall-clock count the continuation only; for "
            "the whole training add base's 600 steps, 0.001M tokens, 0.0211 PFLOP and 6.5 min") in md
    short_base = [{**base, "wall_clock_s": 1.2}, *rows[1:]]  # (under half a minute: seconds, as the table's)
    assert "0.0211 PFLOP and 1.2 s (the curves" in results_markdown(report_of(short_base))
    from gbattn.experiments.report import wall_clock_text  # minutes from half a minute on

    assert [wall_clock_text(s) for s in (29.9, 30.0, 45.0, 7_200.0)] == ["29.9 s", "0.5 min", "0.8 min", "120.0 min"]
    assert "| 600 | 0.001M |" in md  # (the base's row: under a million in three significant digits, not 0.00M)
    assert "`param-fair`" not in md and "`compute-matched`" not in md
    rows.append(model_row("compute-matched", {"42": 120.0}, compute_matched_to="gba-upcycled"))
    md = results_markdown(report_of(rows))
    assert "`param-fair`" not in md and "`compute-matched`: standard trained for as many" in md
    for label, first in (("base", 10), ("gba-upcycled", 1_010)):
        run = tmp_path / label / "seed42"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"event": "eval", "step": 1, "tokens": 10, "valid_ppl": 9.0})
                                           + "\n")
        assert read_curves(tmp_path, report_of(rows))[label]["42"]["valid"] == [(first, 9.0)]


def test_a_local_copy_inside_another_folder_is_the_recipes_corpus():
    """--data data/wikitext-103 (a copy kept in a folder of the working directory) is the WikiText-103
    the published numbers are for: they are shown, not omitted as if it were another corpus (the
    report took the first folder, ``data``, for the corpus)."""
    from gbattn.experiments.report import other_setting

    assert other_setting({"recipe": "paper-wt103", "data": "data/wikitext-103", "sets": {}}) is None
    assert other_setting({"recipe": "paper-wt103", "data": "data/wikitext-2", "sets": {}}) == (
        "these runs trained on data/wikitext-2, not wikitext-103-raw-v1")
    rows = [model_row("standard", {"42": 9.0}, published=[6.55, None]), model_row("gba-m2", {"42": 8.8})]
    md = results_markdown({**report_of(rows), "data": "corpora/tiny-shakespeare/input.txt"})
    assert "| 6.55 |" in md and "omitted" not in md


# ---- mutation sweep: what the table, the chart and the curves must not get wrong ----------


def table_cells(md: str, label: str) -> list[str]:
    """The cells of ``label``'s row of the results table (the first table of results.md)."""
    line = next(x for x in md.splitlines() if x.startswith(f"| {label} | "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_model_without_a_finite_result_is_no_result_and_the_others_compare_on_their_shared_seed():
    """A diverged seed (inf, NaN, null) is no value; standard with none left is 'no result' (no
    baseline line, no Δ), and the other models are still compared over the seed they share."""
    from gbattn.experiments.report import compared_values, seed_values

    assert seed_values({"test_ppl": {"1": 9.0, "2": float("inf"), "3": None, "4": float("nan")}}) == {"1": 9.0}
    rows = [{**model_row("standard", {"42": 1.0}), "test_ppl": {"42": float("inf")}},
            model_row("gba-m2", {"42": 96.0, "123": 98.0}), model_row("twicing", {"42": 99.0})]
    assert compared_values(rows) == {"standard": {}, "gba-m2": {"42": 96.0}, "twicing": {"42": 99.0}}
    texts = drawn_texts(figures.results_figure(report_of(rows)))
    assert texts["ticks"] == ["standard\nno result", "gba-m2\nn=1 (dots n=2)", "twicing\nn=1"]
    assert texts["annotations"] == ["96.00", "99.00"] and "standard mean" not in texts["legend"]
    # A later standard row is not the reference either: results.md's Δ column has none, so the chart has none
    rows.append(model_row("standard-2x", {"42": 100.0}))
    texts = drawn_texts(figures.results_figure(report_of(rows)))
    assert texts["annotations"] == ["96.00", "99.00", "100.00"] and "standard-2x mean" not in texts["legend"]
    md = results_markdown(report_of(rows))
    assert [table_cells(md, label)[5] for label in ("gba-m2", "twicing", "standard-2x")] == ["—"] * 3


def test_results_md_gives_a_model_whose_every_seed_diverged_no_value_and_no_difference():
    """Every run of GBA diverged (null in results.json): its table rows hold no number where a mean, a
    Δ or a paired difference would be, and standard's row is unchanged."""
    rows = [model_row("standard", {"42": 9.0, "123": 9.2}), model_row("gba-m2", {"42": 9.0, "123": 9.2})]
    rows[0]["valid_loss"] = {"42": 2.20, "123": 2.22}
    diverged = {"42": None, "123": None}
    rows[1].update(test_ppl=diverged, valid_ppl=diverged, valid_loss=diverged, test_ppl_mean=None, test_ppl_std=None,
                   valid_ppl_mean=None, valid_ppl_std=None)
    md = results_markdown(report_of(rows))
    table = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
             if line.startswith("| gba-m2 |")]
    assert table[0][4:8] == ["—", "—", "—", "—"]  # test ppl, Δ vs standard, valid ppl, published
    assert table[1][3:] == ["—", "—"]  # valid loss, Δ vs standard (no compute-matched row: no column)
    assert "| standard | 800,000 | 0.008 | 2.210 ± 0.014 | — |" in md


def test_results_figure_error_bars_are_the_std_dots_every_seed_and_the_axis_holds_them_all():
    """Standard on seeds 42 and 123, GBA on 42: standard's mean is over seed 42 (no std, so no bar),
    its dots are both seeds, and the zoomed axis still shows the 110 dot; GBA's published value has
    its std as a bar. A single value gets a margin of 1% rather than an empty axis."""
    rows = [model_row("standard", {"42": 100.0, "123": 110.0}),
            model_row("gba-m2", {"42": 96.0}, published=[90.0, 2.0])]
    ax = figures.results_figure(report_of(rows)).axes[0]
    dots = [list(line.get_ydata()) for line in ax.get_lines() if line.get_marker() == "."]
    assert dots == [[100.0, 110.0], [96.0]]
    bars = [[tuple(s[:, 1]) for s in c.lines[2][0].get_segments()] for c in ax.containers if c.has_yerr]
    assert bars == [[(88.0, 92.0)]]  # the published value's std; a mean over one seed has no bar
    assert ax.get_ylim()[0] < 88.0 and ax.get_ylim()[1] > 110.0
    # Each mean's number sits above the top of its column: its highest dot, or the top of its bar.
    assert [(t.get_text(), t.xy) for t in ax.texts] == [("100.00", (0, 110.0)), ("96.00 (-4.0%)", (1, 96.0))]
    same = [model_row("standard", {"42": 100.0, "123": 110.0})]
    ax = figures.results_figure(report_of(same)).axes[0]
    ((segment,),) = [c.lines[2][0].get_segments() for c in ax.containers if c.has_yerr]
    assert tuple(segment[:, 1]) == pytest.approx((105.0 - 50 ** 0.5, 105.0 + 50 ** 0.5))
    assert ax.texts[0].xy[1] == pytest.approx(105.0 + 50 ** 0.5)
    ax = figures.results_figure(report_of([model_row("standard", {"42": 100.0})])).axes[0]
    assert ax.get_ylim() == pytest.approx((99.0, 102.0))  # twice the margin above, for the number
    # A published value without a std (one seed) has no bar either: caps at the point would read as a std of 0.
    rows = [model_row("standard", {"42": 100.0, "123": 110.0}, published=[90.0, None])]
    ax = figures.results_figure(report_of(rows)).axes[0]
    assert [c.has_yerr for c in ax.containers] == [True, False]


def test_results_figure_numbers_and_long_names_overlap_nothing():
    """Seven models, the first the highest (the upcycle recipe's base): each mean's number, drawn left of its
    point, ran over the y axis' tick labels for the first model, and 'standard-continued-compute-matched'
    ran into its neighbours' names. No number now overlaps a tick label or another number, and long names
    are wrapped."""
    labels = ["base", "standard-continued", "gba-upcycled", "gba-shared-upcycled",
              "standard-continued-compute-matched", "gba-scratch", "standard-scratch"]
    perplexities = [200.2, 129.2, 128.0, 127.6, 117.3, 124.8, 126.9]
    rows = [model_row(label, {"42": ppl}) for label, ppl in zip(labels, perplexities)]
    fig = figures.results_figure(report_of(rows))
    with figures.style():
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    numbers = [t.get_window_extent(renderer) for t in ax.texts]
    names = [t.get_text() for t in ax.get_xticklabels()]
    y_ticks = [t.get_window_extent(renderer) for t in ax.get_yticklabels() if t.get_text()]
    assert len(numbers) == len(names) == 7
    assert not [(i, j) for i, a in enumerate(numbers) for j, b in enumerate(numbers[i + 1:] + y_ticks)
                if a.overlaps(b)]
    assert all(box.x0 >= ax.get_window_extent(renderer).x0 for box in numbers)
    # A long name is wrapped at its hyphens (the tilted one-line name crossed the next model's).
    assert names[4] == "standard-continued-\ncompute-matched\nn=1"
    assert max(len(line) for name in names for line in name.splitlines()) <= 20


def test_results_figure_names_the_published_source_only_when_a_published_value_is_drawn():
    rows = [model_row("standard", {"42": 9.0}, steps=200, published=[6.55, None]), model_row("gba-m2", {"42": 8.8},
                                                                                               steps=200)]
    texts = drawn_texts(figures.results_figure(report_of(rows, sets={"max_steps": 200})))
    assert "published: nanoGPT README" not in texts["all"] and "published numbers omitted" in texts["all"]
    for r in rows:
        r["steps"] = 2000
    assert "published: nanoGPT README" in drawn_texts(figures.results_figure(report_of(rows)))["all"]
    # a published entry without a mean (null in results.json) is no published value: no source named for it
    rows[0]["published"] = [None, None]
    md = results_markdown(report_of(rows))
    assert "Published:" not in md and "omitted" not in md
    assert "published" not in drawn_texts(figures.results_figure(report_of(rows)))["all"]


def test_a_schedule_or_model_override_drops_published_numbers_and_says_which():
    """At the published 2,000 steps, --set lr (a schedule) or a model option still makes the published
    number another setting's: it is left out, and the line says length or schedule, or the model."""
    rows = [model_row("standard", {"42": 9.0}, published=[6.55, None]), model_row("gba-m2", {"42": 8.8})]
    md = results_markdown(report_of(rows, sets={"lr": 0.01}))
    assert "6.55" not in md
    assert ("published numbers omitted: this comparison overrides the recipe's training length or schedule "
            "(lr=0.01).") in md
    md = results_markdown(report_of(rows, sets={"max_steps": 1000, "seq_len": 32}))
    assert "6.55" not in md and "overrides the recipe's training length (max_steps=1000, seq_len=32)." in md
    # a length key beside another is named by the wider word: lr is no length, weight_decay neither length nor schedule
    md = results_markdown(report_of(rows, sets={"max_steps": 1000, "lr": 0.01}))
    assert "overrides the recipe's training length or schedule (max_steps=1000, lr=0.01)." in md
    md = results_markdown(report_of(rows, sets={"max_steps": 1000, "weight_decay": 0.5}))
    assert "overrides the recipe's training settings (max_steps=1000, weight_decay=0.5)." in md
    # every length key at once is still the length, every length and schedule key at once the length or schedule
    length = {"max_steps": 1000, "epochs": 1, "batch_size": 8, "seq_len": 32}
    md = results_markdown(report_of(rows, sets=length))
    assert "overrides the recipe's training length (max_steps=1000, epochs=1, batch_size=8, seq_len=32)." in md
    md = results_markdown(report_of(rows, sets={**length, "lr": 0.01, "warmup_steps": 10}))
    assert ("overrides the recipe's training length or schedule (max_steps=1000, epochs=1, batch_size=8, seq_len=32, "
            "lr=0.01, warmup_steps=10).") in md
    md = results_markdown(report_of(rows, sets={"attn.rounds": 3}))
    assert "6.55" not in md and "published numbers omitted: this comparison changes the model (attn.rounds=3)." in md
    md = results_markdown(report_of(rows, sets={"attn_options.rounds": 3}))  # the long form of attn.rounds
    assert "6.55" not in md and "changes the model (attn_options.rounds=3)." in md
    assert "Published: nanoGPT README." not in md
    assert "Published: nanoGPT README." in results_markdown(report_of(rows))


def test_results_md_says_which_rows_differ_in_block_from_the_delta_references():
    """paper-postln's Pre-LN AttnRes rows were shown '-5.5% vs standard' against the Post-LN standard model with
    nothing saying so; a line now names them and the references. Rows all of one block get no such line."""
    def row(label, seeds, norm="pre", residual="plain", **kw):
        return {**model_row(label, seeds, **kw), "norm": norm, "residual": residual,
                "valid_loss": {s: math.log(v) for s, v in seeds.items()}}

    seeds = {"42": 60.0, "123": 61.0}
    rows = [row("standard-postln", seeds, norm="post"),
            row("compute-matched-postln", seeds, norm="post", compute_matched_to="gba-m2-postln"),
            row("gba-m2-postln", seeds, norm="post"),
            row("standard-attnres", seeds, residual="attnres-block"),
            row("gba-m2-attnres", seeds, residual="attnres-block")]
    md = results_markdown(report_of(rows))
    assert ("The Δ columns compare every row with standard-postln and compute-matched-postln (Post-LN), so the Δ of "
            "standard-attnres and gba-m2-attnres (Pre-LN, attnres-block) includes the change of block or residual "
            "stream.") in md
    one_seed = [row(r["label"], {"42": 60.0}, norm=r["norm"], residual=r["residual"],
                    compute_matched_to=r["compute_matched_to"]) for r in rows]
    assert ("The Δ columns compare every row with standard-postln (Post-LN), so the Δ of standard-attnres and "
            "gba-m2-attnres (Pre-LN, attnres-block)") in results_markdown(report_of(one_seed))  # no paired table
    assert "The Δ columns" not in results_markdown(report_of(rows[:3]))
    # a first row that is no reference is named too (the references are found by label, not by place)
    first_other = [rows[4], *rows[:4]]
    assert ("so the Δ of gba-m2-attnres and standard-attnres (Pre-LN, attnres-block)"
            in results_markdown(report_of(first_other)))
    # The footer names the model each compute-matched row is matched to (it said "as GBA used" with seven GBA rows
    # in gba-design, matched to gba-m2 alone).
    assert ("`compute-matched-postln`: standard trained for as many training FLOPs (torch.utils.flop_counter, forward "
            "+ backward) as gba-m2-postln used.") in md


def test_results_md_shows_a_model_entrys_other_model_fields_beside_its_attention(tmp_path):
    """`--model gba-m3=boosted:rounds=3,ffn=swiglu` was shown as `boosted (rounds=3)`, as if it had the recipe's own
    FFN; the entry's other model fields follow its attention now (norm, residual and d_model keep their own places).
    A report written before has no such field and reads as it did; a damaged one is refused in one line."""
    from gbattn.experiments.recipes import ModelSpec, get_recipe
    from gbattn.experiments.report import aggregate, read_report

    run = {"attn": "boosted", "attn_options": {"rounds": 3}, "norm": "post", "residual": "plain", "d_model": 128,
           "parameters": 900_000, "flops_per_token_train": 6e6, "test_ppl": 7.0, "valid_ppl": 7.1, "valid_loss": 1.96,
           "steps": 20, "train_tokens_seen": 1000, "tokens_per_parameter": 0.1, "train_flops": 1e12,
           "wall_clock_s": 3.0, "train_tokens_per_s": 300.0, "device": "cpu", "curve": []}
    spec = ModelSpec("gba-m3", attn="boosted", attn_options={"rounds": 3},
                     model={"ffn": "swiglu", "norm": "post", "d_model": 128, "attn_bias": False})
    rows = aggregate(get_recipe("cpu-char"), [spec], {"gba-m3": {42: run}})
    assert rows[0]["model_options"] == {"ffn": "swiglu", "attn_bias": False}
    md = results_markdown(report_of([{**model_row("gba-m3", {"42": 7.0}), **rows[0]}]))
    assert "| gba-m3 | boosted (rounds=3), Post-LN, ffn=swiglu, attn_bias=False | 128 |" in md
    assert "| standard | standard | 128 |" in results_markdown(report_of([model_row("standard", {"42": 7.0})]))
    # a report written before rows kept them: its recipe's own model of that label says (cpu-baselines'
    # differential-no-attn-bias read as plain differential)
    old = {**model_row("differential-no-attn-bias", {"42": 7.0}), "attn": "differential"}
    assert "| differential-no-attn-bias | differential, attn_bias=False | 128 |" in results_markdown(
        {**report_of([old]), "recipe": "cpu-baselines"})
    path = tmp_path / "results.json"
    path.write_text(json.dumps(report_of([{**model_row("gba-m3", {"42": 7.0}), "model_options": ["ffn"]}])))
    with pytest.raises(CheckpointError, match=r"gba-m3: model_options=\['ffn'\] must be a mapping of model fields"):
        read_report(path)


def test_a_data_or_optimizer_override_drops_published_numbers_and_a_neutral_one_keeps_them():
    """--set tokenizer=gpt2 (another vocabulary), train_tokens (a tenth of the data), eval_tokens (another test
    set) or weight_decay trains runs that the published number is not for; they kept it, since only length and
    schedule keys counted. Result-neutral keys (device, log_every, ...) keep it."""
    rows = [model_row("standard", {"42": 9.0}, published=[6.55, None]), model_row("gba-m2", {"42": 8.8})]
    for key, value in (("tokenizer", "gpt2"), ("train_tokens", 1_000_000), ("eval_tokens", 10_000),
                       ("weight_decay", 0.5), ("schedule", "constant")):
        md = results_markdown(report_of(rows, sets={key: value}))
        assert "6.55" not in md, key
        assert f"published numbers omitted: this comparison overrides the recipe's training settings ({key}={value})." \
            in md
        texts = drawn_texts(figures.results_figure(report_of(rows, sets={key: value})))
        assert "published" not in texts["legend"], key
    md = results_markdown(report_of(rows, sets={"device": "cuda", "log_every": 50, "eval_batch_size": 8}))
    assert "| 6.55 |" in md and "omitted" not in md


def test_a_set_that_repeats_the_recipes_own_value_keeps_published_numbers():
    """--set max_steps=2000 on cpu-char (its preset's 2,000 steps), residual=plain or dropout=0.0 (its model's) trains
    the recipe's own runs: the published number was withheld "for overriding the recipe's training length
    (max_steps=2000)" or "for changing the model". A value other than the recipe's own (its training settings, then
    its preset's, then the config defaults) still withholds it, and is the only one named."""
    from gbattn.experiments.report import other_setting, result_overrides

    rows = [model_row("standard", {"42": 9.0}, published=[6.55, None]), model_row("gba-m2", {"42": 8.8})]
    own = {"max_steps": 2000, "seq_len": 64, "tokenizer": "char", "split": [0.9, 0.1, 0.0], "residual": "plain",
           "dropout": 0.0, "n_layers": 4, "final_norm": True, "device": "cpu"}  # (a Pre-LN model has its final norm)
    assert result_overrides(report_of(rows, sets=own)) == {} and other_setting(report_of(rows, sets=own)) is None
    md = results_markdown(report_of(rows, sets=own))
    assert "| 6.55 |" in md and "omitted" not in md
    md = results_markdown(report_of(rows, sets={**own, "max_steps": 1000}))
    assert "6.55" not in md and "overrides the recipe's training length (max_steps=1000)." in md
    md = results_markdown(report_of(rows, sets={**own, "dropout": 0.1}))
    assert "6.55" not in md and "published numbers omitted: this comparison changes the model (dropout=0.1)." in md
    # a setting the recipe leaves at the config default (cpu-char sets no beta1: 0.9) is its own value too, and one
    # the recipe sets over its preset's (cpu-char-long's 8,000 steps) is that recipe's own
    assert result_overrides(report_of(rows, sets={"beta1": 0.9, "beta2": 0.95})) == {"beta2": 0.95}
    longer = {**report_of(rows), "recipe": "cpu-char-long"}
    assert result_overrides({**longer, "sets": {"max_steps": 8000}}) == {}
    assert result_overrides({**longer, "sets": {"max_steps": 2000}}) == {"max_steps": 2000}


def test_published_numbers_are_kept_for_the_recipes_corpus_however_it_is_named_and_only_at_its_length():
    """A file in a local copy, or the Hugging Face name with -raw/-v1, is the recipe's corpus; a run
    longer than the published 2,000 steps is not what the number is for, any more than a shorter one."""
    from gbattn.experiments.report import corpus_family

    names = ("wikitext-103", "wikitext-103-raw-v1", "wikitext-103-v1", "wikitext-103/wiki.train.tokens")
    assert {corpus_family(n) for n in names} == {"wikitext-103"} and corpus_family("wikitext-2-v1") == "wikitext-2"
    rows = [model_row("standard", {"42": 9.0}, published=[6.55, None]), model_row("gba-m2", {"42": 8.8})]
    assert "| 6.55 |" in results_markdown({**report_of(rows), "data": "tiny-shakespeare/input.txt"})
    for r in rows:
        r["steps"] = 4000
    md = results_markdown(report_of(rows))
    assert "6.55" not in md
    assert ("published numbers omitted: these runs trained for 4,000 steps, not the 2,000 steps the published "
            "numbers are for.") in md
    assert md.splitlines()[0].endswith("(2,000 steps) (this run: 4,000 steps)")


def test_the_heading_states_the_steps_when_the_description_names_none():
    from gbattn.experiments.report import run_steps_text

    rows = [model_row("standard", {"42": 9.0}, steps=2500), model_row("gba-m2", {"42": 8.8}, steps=2500)]
    md = results_markdown({**report_of(rows), "description": "a test"})
    assert md.splitlines()[0] == "# cpu-char: a test (this run: 2,500 steps)"
    rows[0]["published"] = [6.55, None]  # a description naming no step count leaves a published value in
    md = results_markdown({**report_of(rows), "description": "a test"})
    assert "| 6.55 |" in md and "omitted" not in md
    assert run_steps_text([{"steps": 291, "compute_matched_to": "gba-m2"}]) == "291 steps"
    assert run_steps_text([{"steps": 0}]) == "steps unknown"
    assert run_steps_text([{"steps": 1}]) == "1 step"  # (it said "1 steps")


def test_the_results_table_row_holds_each_column_in_its_units():
    """Δ vs standard in percent over the seeds all models share (twicing has seed 1 only, so GBA's Δ is
    over seed 1: 96 / 100, not 97 / 105), validation ppl from the validation values, millions of
    tokens, PFLOP and minutes; a standard row named with a suffix is still the reference."""
    rows = [model_row("standard-postln", {"1": 100.0, "2": 110.0}), model_row("gba-m2", {"1": 96.0, "2": 98.0}),
            model_row("twicing", {"1": 99.0})]
    rows[1].update(valid_ppl={"1": 97.0, "2": 99.0}, valid_ppl_mean=98.0, valid_ppl_std=2 ** 0.5, norm="post",
                   attn_options={"rounds": 2}, train_tokens=12_500_000, train_flops=3.2e15, wall_clock_s=7_200.0,
                   tokens_per_s=1_736.1)
    md = results_markdown({**report_of(rows), "seeds": [1, 2]})
    assert table_cells(md, "gba-m2") == ["gba-m2", "boosted (rounds=2), Post-LN", "128", "800,000", "97.00 ± 1.41",
                                         "-4.0%", "98.00 ± 1.41", "—", "2,000", "12.50M", "1.9", "3.2", "1,736",
                                         "120.0 min"]
    assert table_cells(md, "twicing")[5] == "-1.0%" and table_cells(md, "standard-postln")[5] == "—"
    assert ("Seeds differ between models (standard-postln: 1, 2; gba-m2: 1, 2; twicing: 1): test ppl is each "
            "model's mean over its own seeds; Δ vs standard-postln is over the seed all models share (1).") in md
    two = [model_row("standard", {"1": 9.0, "2": 9.0}), model_row("gba-m2", {"1": 8.0, "2": 8.0})]
    assert table_cells(results_markdown(report_of(two)), "standard")[4] == "9.00 ± 0.00"  # two seeds, no spread


def test_the_validation_curve_table_averages_every_seed_when_no_seed_is_shared_by_all():
    same = [model_row("standard", {"42": 9.0, "123": 11.0}), model_row("gba-m2", {"42": 8.0, "123": 8.5})]
    md = results_markdown(report_of(same))
    assert "## Validation perplexity during training (seed mean)" in md and "| 2,000 | 10.00 | 8.25 |" in md
    disjoint = [model_row("standard", {"42": 9.0}), model_row("gba-m2", {"123": 8.0})]
    md = results_markdown(report_of(disjoint))
    assert "## Validation perplexity during training (seed mean)" in md and "| 2,000 | 9.00 | 8.00 |" in md
    # one seed, every model's: the table is that seed's, and says so (it said "seed mean" of one seed)
    one = [model_row("standard", {"5": 9.0}), model_row("gba-m2", {"5": 8.0})]
    md = results_markdown(report_of(one))
    assert "## Validation perplexity during training (seed 5)" in md and "| 2,000 | 9.00 | 8.00 |" in md


def test_the_valid_ppl_column_leaves_out_a_seed_that_diverged_as_every_other_column_does():
    """A seed whose test perplexity is null (it diverged; its best validation finite below 50 nats) was in the valid
    ppl mean alone, beside the test column, the paired table and a note leaving it out."""
    from gbattn.experiments.recipes import ModelSpec, get_recipe
    from gbattn.experiments.report import aggregate

    def run(test_ppl, valid_ppl):
        return {"attn": "standard", "attn_options": {}, "d_model": 128, "parameters": 900_000,
                "flops_per_token_train": 6e6, "test_ppl": test_ppl, "valid_ppl": valid_ppl, "valid_loss": 1.96,
                "steps": 20, "train_tokens_seen": 1000, "tokens_per_parameter": 0.1, "train_flops": 1e12,
                "wall_clock_s": 3.0, "train_tokens_per_s": 300.0, "device": "cpu", "curve": []}

    runs = {1: run(39.1, 39.0), 2: run(None, 1e20), 3: run(39.2, 39.2)}
    row, = aggregate(get_recipe("cpu-char"), [ModelSpec("standard")], {"standard": runs})
    assert row["valid_ppl_mean"] == pytest.approx(39.1) and row["valid_ppl_std"] == pytest.approx(0.1 * 2 ** 0.5)
    assert row["test_ppl_mean"] == pytest.approx(39.15) and row["valid_ppl"]["2"] == 1e20  # (the seed's own kept)


def test_results_md_says_the_delta_is_over_the_seeds_each_model_shares_with_standard_when_none_is_shared_by_all():
    """No seed is shared by every model: the line under the table says so, names each model's seeds, and gives
    the Δ column's seeds as those each model shares with standard (not "the seeds all models share ()")."""
    rows = [model_row("standard", {"1": 9.0, "2": 9.2}), model_row("twicing", {"1": 8.9, "3": 9.0}),
            model_row("gba-m2", {"2": 8.8, "3": 8.7})]
    assert ("Seeds differ between models (standard: 1, 2; twicing: 1, 3; gba-m2: 2, 3): test ppl is each model's "
            "mean over its own seeds; Δ vs standard is over the seeds each model shares with standard (no seed is "
            "shared by all models).") in results_markdown({**report_of(rows), "seeds": [1, 2, 3]})


def test_continued_models_are_named_once_per_base_they_continue():
    rows = [model_row("base", {"42": 200.0}), {**model_row("a", {"42": 129.0}), "init_from": "base"},
            {**model_row("b", {"42": 128.0}), "init_from": "base"}, {**model_row("c", {"42": 127.0}), "init_from": "x"}]
    md = results_markdown(report_of(rows))
    assert md.count("continue base's trained weights") == 1 and "a, b continue base's trained weights" in md
    assert "c continue x's trained weights" in md and "add x's its steps, tokens, FLOPs and wall-clock" in md


def paired_md(losses: dict, seeds=(1, 2, 3), updates: dict | None = None) -> str:
    """results.md of rows label -> per-seed validation losses, each row updated with ``updates[label]``."""
    rows = []
    for label, values in losses.items():
        row = model_row(label, {str(s): 9.0 for s in seeds})
        row.update(valid_loss=values, **(updates or {}).get(label, {}))
        rows.append(row)
    return results_markdown({**report_of(rows), "seeds": list(seeds)})


def paired_cells(md: str, label: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {label} | 800,000 | 0.008 |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_paired_differences_are_marked_only_when_every_seed_agrees_in_sign_and_the_cell_is_their_mean():
    """GBA beats standard on seeds 1 and 2 but not 3: not marked. The cell's first number is the mean of
    the differences (-0.030, not their median -0.020); the compute-matched column compares with
    the compute-matched row (not param-fair), and says nothing on that row itself."""
    from gbattn.experiments.report import paired_cell

    md = paired_md({"standard": {"1": 2.20, "2": 2.20, "3": 2.20}, "param-fair": {"1": 2.0, "2": 2.0, "3": 2.0},
                    "compute-matched": {"1": 2.10, "2": 2.10, "3": 2.10},
                    "gba-m2": {"1": 2.19, "2": 2.18, "3": 2.24}},
                   updates={"param-fair": {"param_matched_to": "gba-m2"},
                            "compute-matched": {"compute_matched_to": "gba-m2"}})
    gba = paired_cells(md, "gba-m2")
    assert gba[4] == "+0.003 (-0.010 / -0.020 / +0.040), p 0.87"
    assert gba[5] == "+0.103 (+0.090 / +0.080 / +0.140) **same sign**, p 0.03"
    assert paired_cells(md, "compute-matched")[5] == "—" and paired_cells(md, "standard")[4] == "—"
    assert paired_cell({"1": -0.010, "2": -0.020, "3": -0.060}).startswith("-0.030 (")
    assert "**same sign**" not in paired_cell({"1": -0.02})  # one seed cannot agree with another
    # a tie (difference exactly 0) has no sign: seeds that tie are not marked as agreeing with the others
    assert "**same sign**" not in paired_cell({"1": 0.0, "2": -0.01, "3": -0.02})
    assert "**same sign**" not in paired_cell({"1": 0.0, "2": 0.0})
    # The mark is not called significant: the legend gives the chance that seeds agree in sign with no difference
    # (2 seeds agree half the time), not "real".
    assert ("**same sign** = every seed's difference has the same sign, which 3 seeds give by chance alone 1 time in 4 "
            "when the models do not differ: a count, not a significance test; p = the two-sided paired t-test over "
            "the seeds (2 degrees of freedom), which assumes normally distributed differences.") in md
    assert "real" not in md


def test_the_paired_reference_is_the_first_row_named_standard_with_or_without_a_suffix():
    """Post-LN recipes name their reference standard-postln: the paired table still compares with it (not
    with a later standard row, and not with none)."""
    md = paired_md({"gba-m2": {"1": 2.1, "2": 2.0}, "standard-postln": {"1": 2.2, "2": 2.3},
                    "standard": {"1": 9.0, "2": 9.0}}, seeds=(1, 2))
    assert "Paired per-seed differences" in md
    assert paired_cells(md, "gba-m2")[4].startswith("-0.200 (-0.100 / -0.300) **same sign**")
    assert paired_cells(md, "standard-postln")[4] == "—"


def test_the_paired_t_test_p_value_is_students_t_in_closed_form():
    """Two-sided p of the paired t-test against Student's t in closed form for 1 to 4 degrees of freedom
    (2 to 5 seeds) and the normal distribution for very many; equal differences are p 0 (or none when
    all are 0), differences whose mean is exactly 0 are p 1, one seed has none. The 3-seed value is the
    one the README quotes for the design study."""
    from gbattn.experiments.report import p_text, paired_t_p

    closed_form = {1: lambda t: 1 - 2 / math.pi * math.atan(t),
                   2: lambda t: 1 - t / math.sqrt(t * t + 2),
                   3: lambda t: 1 - 2 / math.pi * (math.atan(t / math.sqrt(3)) + t / math.sqrt(3) / (1 + t * t / 3)),
                   4: lambda t: 1 - t * (t * t + 6) / (t * t + 4) ** 1.5}
    rng = random.Random(0)
    for df, p_of_t in closed_form.items():
        for _ in range(20):
            diffs = [rng.gauss(rng.uniform(-0.05, 0.05), rng.uniform(0.001, 0.05)) for _ in range(df + 1)]
            t = abs(statistics.fmean(diffs)) / (statistics.stdev(diffs) / math.sqrt(df + 1))
            assert paired_t_p(diffs) == pytest.approx(p_of_t(t), abs=1e-12), (df, diffs)
    many = [rng.gauss(0.001, 0.05) for _ in range(200_001)]
    t = abs(statistics.fmean(many)) / (statistics.stdev(many) / math.sqrt(len(many)))
    assert paired_t_p(many) == pytest.approx(math.erfc(t / math.sqrt(2)), abs=1e-5)
    assert paired_t_p([-0.02, -0.02]) == 0.0 and paired_t_p([0.0, 0.0]) is None and paired_t_p([0.1]) is None
    # differences that cancel exactly (mean 0, so t = 0) are no evidence of a difference: p is 1
    assert paired_t_p([0.25, -0.25]) == 1.0 and paired_t_p([-0.5, 0.0, 0.5]) == 1.0
    assert p_text(paired_t_p([0.25, -0.25])) == "p 1.00"
    assert (p_text(0.2049), p_text(0.004), p_text(None)) == ("p 0.20", "p < 0.01", "")
    # "p < 0.01" only where two decimals would read 0.00: 0.006 rounds to 0.01, and "p 0.00" never shows
    assert (p_text(0.006), p_text(0.00499)) == ("p 0.01", "p < 0.01")


def test_the_paired_table_needs_two_seeds_orders_them_by_number_and_skips_a_diverged_seed():
    one = paired_md({"standard": {"1": 2.2}, "gba-m2": {"1": 2.1}}, seeds=(1,))
    assert "Paired per-seed differences" not in one
    md = paired_md({"standard": {"42": 2.2, "123": 2.3}, "gba-m2": {"42": 2.1, "123": None}}, seeds=(42, 123))
    assert ("then each seed's difference (42, 123); **same sign** = every seed's difference has the same sign, "
            "which 2 seeds give by chance alone 1 time in 2") in md
    assert "over the seeds (1 degree of freedom)" in md  # one, singular
    gba = paired_cells(md, "gba-m2")
    assert gba[3] == "2.100" and gba[4] == "-0.100 (42: -0.100; seed 123 missing)"
    # In memory (write_results, before results.json turns it into null) a run whose every evaluation was
    # non-finite has an infinite best loss: the same table as from results.json, not a crash or "+inf".
    for bad in (float("inf"), float("nan")):
        md = paired_md({"standard": {"42": 2.2, "123": 2.3}, "gba-m2": {"42": 2.1, "123": bad}}, seeds=(42, 123))
        assert paired_cells(md, "gba-m2")[3:5] == ["2.100", "-0.100 (42: -0.100; seed 123 missing)"], bad
    # each seed's difference in the header's numeric order (7, 42, 123), not as text ("123" < "42" < "7") and not
    # in the order results.json lists them
    md = paired_md({"standard": {"123": 2.5, "7": 2.41, "42": 2.3}, "gba-m2": {"42": 2.2, "123": 2.45, "7": 2.38}},
                   seeds=(7, 42, 123))
    assert "then each seed's difference (7, 42, 123);" in md and "over the seeds (2 degrees of freedom)" in md
    assert paired_cells(md, "gba-m2")[4].startswith("-0.060 (-0.030 / -0.100 / -0.050) **same sign**")


def test_a_comparison_without_a_standard_row_has_the_compute_matched_column_alone():
    """`compare --only gba-gate-vector param-fair-gba-gate-vector compute-matched-gba-gate-vector --matched
    gba-gate-vector` has no standard row: its paired table was left out entirely; it now pairs each model with its
    compute-matched row, the standard reference column there is, and the model with its param-fair row."""
    md = paired_md({"gba-v": {"1": 2.20, "2": 2.25, "3": 2.22}, "param-fair-gba-v": {"1": 2.18, "2": 2.21, "3": 2.23},
                    "compute-matched-gba-v": {"1": 2.10, "2": 2.12, "3": 2.15}},
                   updates={"param-fair-gba-v": {"param_matched_to": "gba-v"},
                            "compute-matched-gba-v": {"compute_matched_to": "gba-v"}})
    assert "| model | parameters | train PFLOP | valid loss | Δ vs compute-matched | Δ vs param-fair |" in md
    assert "Δ vs standard" not in md.split("## Paired per-seed differences")[1].split("##")[0]
    gba = paired_cells(md, "gba-v")
    assert len(gba) == 6 and gba[4].startswith("+0.100 (+0.100 / +0.130 / +0.070) **same sign**")
    assert gba[5].startswith("+0.017 (+0.020 / +0.040 / -0.010), p 0.37")  # (the model against its param-fair row)
    assert paired_cells(md, "param-fair-gba-v")[4].startswith("+0.083 (+0.080 / +0.090 / +0.080) **same sign**")
    assert paired_cells(md, "compute-matched-gba-v")[4:] == ["—", "—"]
    assert paired_cells(md, "param-fair-gba-v")[5] == "—"
    assert "Δ vs param-fair: a model against its own param-fair row, standard attention widened to at least" in md
    # a model and its param-fair row alone (no standard, no compute-matched row): the table was left out entirely
    pair = paired_md({"gba-v": {"1": 2.20, "2": 2.25, "3": 2.22},
                      "param-fair-gba-v": {"1": 2.18, "2": 2.21, "3": 2.23}},
                     updates={"param-fair-gba-v": {"param_matched_to": "gba-v"}})
    assert "| model | parameters | train PFLOP | valid loss | Δ vs param-fair |" in pair
    assert paired_cells(pair, "gba-v")[4].startswith("+0.017 (+0.020 / +0.040 / -0.010), p 0.37")
    # a param-fair row of one seed: its column left out, and said (it went unsaid); one whose model has no row: none
    one = paired_md({"gba-v": {"1": 2.20, "2": 2.25, "3": 2.22}, "param-fair-gba-v": {"1": 2.18},
                     "compute-matched-gba-v": {"1": 2.10, "2": 2.12, "3": 2.15}},
                    updates={"param-fair-gba-v": {"param_matched_to": "gba-v"},
                             "compute-matched-gba-v": {"compute_matched_to": "gba-v"}})
    assert "Δ vs param-fair of gba-v is left out: param-fair-gba-v has 1 seed with a validation loss." in one
    assert "| Δ vs param-fair |" not in one
    orphan = paired_md({"param-fair-gba-v": {"1": 2.18, "2": 2.21}, "compute-matched-gba-v": {"1": 2.1, "2": 2.12}},
                       updates={"param-fair-gba-v": {"param_matched_to": "gba-v"},
                                "compute-matched-gba-v": {"compute_matched_to": "gba-v"}})
    assert "Δ vs param-fair" not in orphan
    # nor a main-table column of dashes: "Δ vs standard" is nowhere
    assert "Δ vs standard" not in md and "| model | attention | d | parameters | test ppl | valid ppl |" in md
    main = md.split("\n\n")[2].splitlines()
    assert len({row.count("|") for row in main}) == 1 and main[2].split("|")[5].strip() != "—", main
    # nothing to pair with at all: no table
    alone = paired_md({"gba-v": {"1": 2.2, "2": 2.3}, "gba-w": {"1": 2.1, "2": 2.2}}, seeds=(1, 2))
    assert "Paired per-seed" not in alone


def test_a_reference_of_one_seed_leaves_its_own_column_out_and_says_so():
    """A standard row of one seed (`compare --seeds 1 --only standard ...`, then `--seeds 1 2 3` without it) removed
    the whole paired table, the compute-matched column of three seeds with it, unsaid. Its own column alone is left
    out, with a line saying why; the other reference's column stays."""
    md = paired_md({"standard": {"1": 2.30}, "gba-m2": {"1": 2.20, "2": 2.25, "3": 2.22},
                    "compute-matched": {"1": 2.10, "2": 2.12, "3": 2.15}},
                   updates={"compute-matched": {"compute_matched_to": "gba-m2"}})
    paired_part = md.split("## Paired per-seed differences")[1].split("\n## ")[0]
    assert "| model | parameters | train PFLOP | valid loss | Δ vs compute-matched |" in paired_part
    assert "Δ vs standard is left out: standard has 1 seed with a validation loss." in paired_part
    assert paired_cells(md, "gba-m2")[4].startswith("+0.100 (+0.100 / +0.130 / +0.070) **same sign**")
    # and the other way round: a compute-matched row of one seed leaves the standard column
    md = paired_md({"standard": {"1": 2.30, "2": 2.31, "3": 2.33}, "gba-m2": {"1": 2.20, "2": 2.25, "3": 2.22},
                    "compute-matched": {"1": 2.10}}, updates={"compute-matched": {"compute_matched_to": "gba-m2"}})
    paired_part = md.split("## Paired per-seed differences")[1].split("\n## ")[0]
    assert "| model | parameters | train PFLOP | valid loss | Δ vs standard |" in paired_part
    assert "Δ vs compute-matched is left out: compute-matched has 1 seed with a validation loss." in paired_part
    # neither has two: no table, as before
    one = paired_md({"standard": {"1": 2.2}, "gba-m2": {"1": 2.1}}, seeds=(1,))
    assert "Paired per-seed differences" not in one and "left out" not in one
    # ... but where other models have two or more, the section says why it has no table (it vanished, unsaid)
    md = paired_md({"standard": {"1": 2.30}, "twicing": {"1": 2.20, "2": 2.25, "3": 2.22}})
    paired_part = md.split("## Paired per-seed differences")[1].split("Test perplexity from")[0]
    assert paired_part == (" (validation loss, nats; negative = better)\n\nΔ vs standard is left out: standard has 1 "
                           "seed with a validation loss.\n\n")


def test_a_comparison_without_a_compute_matched_row_has_the_standard_column_alone():
    """`compare --only standard gba-m2` (or a recipe with no compute-matched model) had a "Δ vs compute-matched"
    column of dashes beside the standard one; now the standard column is the only one."""
    md = paired_md({"standard": {"1": 2.20, "2": 2.25, "3": 2.22}, "gba-v": {"1": 2.18, "2": 2.21, "3": 2.23}})
    paired_part = md.split("## Paired per-seed differences")[1].split("##")[0]
    assert "| model | parameters | train PFLOP | valid loss | Δ vs standard |" in paired_part
    assert "compute-matched" not in paired_part
    assert len(paired_cells(md, "gba-v")) == 5 and paired_cells(md, "standard")[4] == "—"
    assert paired_cells(md, "gba-v")[4].startswith("-0.017 (-0.020 / -0.040 / +0.010)")


def test_the_curve_table_leaves_out_an_evaluation_that_was_not_finite():
    """A NaN evaluation is an infinite perplexity in memory and null in result.json (read_result accepts
    it): both give the mean of the finite seeds, where the null crashed statistics.fmean (TypeError) and
    every later `gbattn compare` of the directory with it."""
    rows = [model_row("standard", {"42": 9.0, "123": 9.2}), model_row("gba-m2", {"42": 8.8, "123": 8.9})]
    rows[1]["curves"]["42"].insert(0, {"step": 1000, "tokens": 768_000, "valid_ppl": 20.0})
    for bad in (float("inf"), None):
        rows[1]["curves"]["123"][:1 if bad is None else 0] = [{"step": 1000, "tokens": 768_000, "valid_ppl": bad}]
        table = results_markdown(report_of(rows)).split("## Validation perplexity during training")[1]
        assert "| 1,000 |  | 20.00 |" in table and "| 2,000 | 9.10 | 8.85 |" in table, bad


def test_curves_colour_each_model_dash_each_seed_and_choose_the_log_axis_from_every_run():
    """Two models on seeds 1 and 2: a colour per model, a line style per seed, a legend entry for each;
    validation perplexity spans 100 to 500 only across the runs (each run's own span is under 3x),
    which takes a log axis; a million tokens is counted in millions."""
    def run(lo: float, hi: float) -> dict:
        return {"train": [(1_000, 3.0), (1_000_000, 2.0)], "valid": [(1_000, hi), (1_000_000, lo)]}

    curves = {"standard": {"1": run(400.0, 500.0), "2": run(410.0, 490.0)},
              "gba-m2": {"1": run(110.0, 210.0), "2": run(100.0, 200.0)}}
    fig = figures.curves_figure(curves)
    valid_ax = fig.axes[1]
    lines = valid_ax.get_lines()
    assert [(line.get_color(), line.get_linestyle()) for line in lines] == [
        ("C0", "-"), ("C0", "--"), ("C1", "-"), ("C1", "--")]
    assert [t.get_text() for t in valid_ax.get_legend().get_texts()] == ["standard", "gba-m2", "seed 1", "seed 2"]
    assert valid_ax.get_yscale() == "log" and valid_ax.get_xlabel() == "tokens seen (millions)"
    assert valid_ax.get_ylabel() == "validation perplexity (log scale)"  # the axis says it is not linear
    # a model with seed 2 alone draws it dashed, as the legend's "seed 2" (not in the style of its first run)
    partial = figures.curves_figure({**curves, "gba-m2": {"2": run(100.0, 200.0)}}).axes[1]
    assert [(line.get_color(), line.get_linestyle()) for line in partial.get_lines()] == [
        ("C0", "-"), ("C0", "--"), ("C1", "--")]
    # seven seeds, seven line styles (after four they came round again: seed 5 drawn, and its legend entry, as seed 1)
    from matplotlib.axes import Axes

    styles, plot = [], Axes.plot
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Axes, "plot", lambda ax, *a, **k: styles.append(repr(k.get("linestyle"))) or plot(ax, *a, **k))
        figures.curves_figure({"standard": {str(s): run(400.0, 500.0) for s in range(1, 8)}})
    assert len(styles) == 14 and len(set(styles)) == 7  # each seed's training and validation lines
    one = figures.curves_figure({"standard": {"42": run(400.0, 500.0)}}).axes[1]
    assert [t.get_text() for t in one.get_legend().get_texts()] == ["standard"] and one.get_yscale() == "linear"
    assert one.get_ylabel() == "validation perplexity"
    tenfold = figures.curves_figure({"standard": {"42": run(100.0, 1_000.0)}}).axes[1]
    assert tenfold.get_yscale() == "log"


def test_a_log_axis_labels_powers_of_ten_over_many_decades_and_no_minor_tick_in_mathtext():
    """Four decades: one labelled tick per decade (2,000 and 5,000 would crowd the axis). One decade
    (20 to 200): ticks at 1, 2 and 5 per decade, and the minor ticks between them carry no label
    (matplotlib's own would print raw mathtext, as STYLE turns mathtext off)."""
    def labels(values: list[float]) -> tuple[set, list]:
        fig = figures.curves_figure({"standard": {"42": {"train": [], "valid": list(enumerate(values))}}})
        with figures.style():
            fig.canvas.draw()
        axis = fig.axes[1]
        assert axis.get_yscale() == "log"
        return ({t.get_text() for t in axis.get_yticklabels()} - {""},
                [t.get_text() for t in axis.get_yticklabels(minor=True) if t.get_text()])

    major, minor = labels([50_000.0, 5_000.0, 500.0, 50.0, 5.0])
    assert major and major <= {"1", "10", "100", "1,000", "10,000", "100,000"} and not minor, (major, minor)
    major, minor = labels([200.0, 60.0, 20.0])
    assert {"20", "50", "100", "200"} <= major and not minor, (major, minor)


def test_a_log_axis_ticks_each_decade_from_three_decades_and_every_digit_under_one():
    """The ticks per decade follow the view's span: three decades (5 to 5,000) take one per decade, as four do;
    under one decade (20 to 70, a log axis from a ratio over 3) every digit, 30 and 40 too; in between 1, 2 and 5."""
    def major(values: list[float]) -> set:
        fig = figures.curves_figure({"standard": {"42": {"train": [], "valid": list(enumerate(values))}}})
        with figures.style():
            fig.canvas.draw()
        assert fig.axes[1].get_yscale() == "log"
        return {t.get_text() for t in fig.axes[1].get_yticklabels()} - {""}

    three = major([5_000.0, 500.0, 50.0, 5.0])
    assert three and three <= {"1", "10", "100", "1,000", "10,000"}, three
    assert {"30", "40", "60"} <= major([70.0, 40.0, 20.0])
    # between one and two and a half decades (10 to 1,000, about 2.2 with the margins): 1, 2 and 5 in each
    assert {"20", "50", "200", "500"} <= major([1_000.0, 100.0, 10.0])


def test_gap_figure_counts_the_seeds_of_a_run_length_and_marks_where_it_ends():
    """A line whose points average different numbers of seeds (a seed that stopped early, an evaluation one seed
    made) says so: it read '2 seeds' while its first point was one seed's difference; such a point is drawn hollow,
    apart from the line (joined in, seed 42's extra evaluation of cpu-proxy at step 689 looked like a dip of the
    three-seed mean)."""
    series = [{"reference": "standard", "steps": 400, "directory": "short",
               "points": [{"step": 200, "tokens_per_parameter": 1.0, "difference": -0.1, "seeds": 1},
                          {"step": 400, "tokens_per_parameter": 2.0, "difference": -0.2, "seeds": 2}]},
              {"reference": "standard", "steps": 1600, "directory": "long",
               "points": [{"step": 1600, "tokens_per_parameter": 4.0, "difference": -0.3, "seeds": 1}]}]
    ax = figures.gap_figure(series, "gba-m2", ["standard"]).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["400-step runs (short, 2 seeds; hollow: fewer)",
                                                                   "1,600-step runs (long, 1 seed)"]
    lines = [(list(line.get_xdata()), line.get_markerfacecolor(), line.get_linestyle()) for line in ax.get_lines()
             if line.get_marker() == "o"]
    assert lines[:2] == [([2.0], lines[0][1], "-"), ([1.0], "none", "None")]  # the line, then the hollow point
    ends = [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines() if line.get_marker() == "D"]
    assert ends == [([2.0], [-0.2]), ([4.0], [-0.3])]
    # the difference is the model's minus the reference's, on two lines beside the axis
    assert ax.get_title() == "gba-m2 − standard (below 0: gba-m2 better)"
    assert ax.get_ylabel() == "validation loss (nats)\ngba-m2 − standard"
    assert ax.get_xlabel() == "training tokens per parameter of gba-m2"


def texts_outside(fig) -> list[str]:
    """The titles, axis labels and legend entries of a drawn figure that reach past its edges (cut off in the PNG)."""
    with figures.style():
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [*fig.texts, *(t for legend in fig.legends for t in legend.get_texts())]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *(ax.get_legend().get_texts() if ax.get_legend() else [])]
    outside = []
    for text in texts:
        box = text.get_window_extent(renderer)
        if text.get_text() and (box.x0 < 0 or box.y0 < 0 or box.x1 > fig.bbox.width or box.y1 > fig.bbox.height):
            outside.append(text.get_text())
    return outside


def test_gap_figure_keeps_its_title_and_axis_labels_inside():
    # One panel is 5.5 inches wide; the title on one line was 8 inches wide, cut at both ends.
    # Two: the y label naming both models on one line was taller than the panel.
    # Three: a line pooling two directories, named on one line, made its legend wider than the panel.
    series = [{"reference": ref, "steps": 8000, "directory": "cpu-char-long + cpu-char-long-seed7",
               "points": [{"step": 1600 * x, "tokens_per_parameter": x, "difference": -0.1 + 0.01 * x, "seeds": 3}
                          for x in range(6)]}
              for ref in ("standard", "compute-matched")]
    for references in (["standard"], ["standard", "compute-matched"]):
        fig = figures.gap_figure(series, "gba-m2", references)
        assert texts_outside(fig) == [], references
    # Three, where it happened: the published training-length figures, drawn again from their gap.json
    for published in sorted((Path(__file__).resolve().parents[1] / "results").glob("training-length*/gap.json")):
        gap = json.loads(published.read_text())
        assert texts_outside(figures.gap_figure(gap["series"], gap["model"], gap["references"])) == [], published
        assert fig.get_suptitle().startswith("How the gap moves with training length")

def test_round_colours_repeat_after_eight_and_long_tokens_are_cut_to_twelve_characters():
    assert [figures.round_color(m) for m in (0, 1, 8, 9)] == [figures.ROUND_COLORS[0], figures.ROUND_COLORS[1],
                                                              figures.ROUND_COLORS[0], figures.ROUND_COLORS[1]]
    assert figures.token_label("abcdefghijklmnop") == "abcdefghijk…" and figures.token_label("abcdefghijkl") == (
        "abcdefghijkl")
    assert figures.token_label("  ") == "␣␣" and figures.token_label("a\nb") == "a↵b"


def test_count_words_is_singular_for_one_only():
    assert [figures.count_words(n, "layer") for n in (0, 1, 2)] == ["0 layers", "1 layer", "2 layers"]


def test_results_figure_tilts_the_model_names_only_when_there_are_more_than_four():
    def rotations(n: int) -> set:
        rows = [model_row("standard", {"42": 100.0})] + [model_row(f"gba-{i}", {"42": 90.0 + i}) for i in range(n - 1)]
        return {t.get_rotation() for t in figures.results_figure(report_of(rows)).axes[0].get_xticklabels()}

    assert rotations(4) == {0.0} and rotations(5) == {20.0}


def test_read_report_refuses_text_steps_or_losses_and_a_seed_list_that_is_not_one_but_takes_a_diverged_seed(tmp_path):
    """Every field the figures read is checked (steps, validation losses, the report's seeds); a
    diverged seed stored as null is a result the chart leaves out, not damage."""
    from gbattn.errors import CheckpointError
    from gbattn.experiments.report import read_report

    row, path = model_row("standard", {"42": 100.0}), tmp_path / "results.json"
    for report, expected in ((report_of([{**row, "steps": "2000"}]), "standard: steps='2000' must be an integer"),
                             # looked up in the recipes (unhashable: a TypeError traceback) and searched as text
                             ({**report_of([row]), "recipe": ["cpu-char"]}, "recipe=['cpu-char'] must be a string"),
                             ({**report_of([row]), "description": 5}, "description=5 must be a string"),
                             (report_of([{**row, "valid_loss": {"42": "2.2"}}]),
                              "valid_loss must map seeds to numbers"),
                             ({**report_of([row]), "seeds": "42"}, "seeds must be a list and sets a mapping"),
                             ({**report_of([row]), "models": [row, "gba"]}, "models must be a list of rows")):
        path.write_text(json.dumps(report))
        with pytest.raises(CheckpointError) as caught:
            read_report(path)
        assert "results.json is damaged" in str(caught.value) and expected in str(caught.value)
    diverged = {**row, "test_ppl": {"42": 100.0, "123": None}, "valid_loss": {"42": None}}
    path.write_text(json.dumps(report_of([diverged])))
    assert read_report(path)["models"][0]["test_ppl"] == {"42": 100.0, "123": None}


def test_curves_give_each_of_three_models_its_own_colour():
    run = {"train": [(1, 3.0), (2, 2.5)], "valid": [(1, 20.0), (2, 15.0)]}
    fig = figures.curves_figure({"standard": {"1": run}, "gba-m2": {"1": run}, "gba-m3": {"1": run}})
    assert [line.get_color() for line in fig.axes[1].get_lines()] == ["C0", "C1", "C2"]


def test_curves_legend_orders_seeds_as_numbers():
    """Seeds 2, 10 and 123 are listed 2, 10, 123 in the legend (as strings, "10" < "123" < "2")."""
    run = {"train": [(1, 3.0), (2, 2.5)], "valid": [(1, 20.0), (2, 15.0)]}
    fig = figures.curves_figure({"standard": {"123": run, "2": run, "10": run}})
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert labels == ["standard", "seed 2", "seed 10", "seed 123"]


def test_results_md_says_when_every_model_has_fewer_seeds_than_the_comparison_names():
    """A comparison stopped after its seed 42 runs: the heading names seeds 42 and 123, so the table says
    that each mean is over seed 42 alone; with every seed finished it says nothing of the kind."""
    from gbattn.experiments.report import results_markdown

    partial = [model_row("standard", {"42": 10.0}), model_row("gba-m2", {"42": 9.0})]
    md = results_markdown(report_of(partial))
    assert "Every model has seed 42 only (seed 123 not finished): each mean is over 1 seed." in md
    full = [model_row("standard", {"42": 10.0, "123": 11.0}), model_row("gba-m2", {"42": 9.0, "123": 9.5})]
    assert "Every model has" not in results_markdown(report_of(full))
    diverged = [{**row, "test_ppl": {"42": None}} for row in partial]  # no model has a result: no seed to name
    assert "Every model has" not in results_markdown(report_of(diverged))


def test_results_md_names_seeds_that_diverged_apart_from_seeds_not_finished():
    """Every run of seeds 42, 123 and 7 finished, but seeds 123 and 7 diverged (test perplexity null: a loss of 50
    nats or more): results.md said "seeds 123, 7 not finished" of a complete comparison. A seed is "not finished"
    where a model's row lacks it; one every model finished without a finite perplexity is named as diverged."""
    def row(label: str, value: float, diverged: list[str]) -> dict:
        return {**model_row(label, {"42": value}), "seeds": sorted([42, *map(int, diverged)]),
                "test_ppl": {"42": value, **dict.fromkeys(diverged)}}

    rows = [row("standard", 10.0, ["123", "7"]), row("gba-m2", 9.0, ["123", "7"])]
    md = results_markdown({**report_of(rows), "seeds": [7, 42, 123], "complete": True})
    assert ("Every model has seed 42 only (seeds 7, 123 diverged, with no finite perplexity): each mean is over 1 "
            "seed.") in md
    assert "not finished" not in md
    rows = [row("standard", 10.0, ["123"]), row("gba-m2", 9.0, ["123"])]
    md = results_markdown({**report_of(rows), "seeds": [7, 42, 123]})  # seed 7 not finished: no row has it
    assert ("Every model has seed 42 only (seed 7 not finished; seed 123 diverged, with no finite perplexity): each "
            "mean is over 1 seed.") in md
    rows = [row("standard", 10.0, ["123"]), row("gba-m2", 9.0, [])]  # gba-m2 has not finished seed 123
    md = results_markdown(report_of(rows))
    assert "Every model has seed 42 only (seed 123 not finished): each mean is over 1 seed." in md
    # (it was said of every model where one had diverged and another not finished): of the one that did
    assert ("\n\nDiverged, with no finite test perplexity, and left out of the means, Δ and paired differences: "
            "standard seed 123.\n") in md and md.count("diverged") == 0
    # a model none of whose seeds held a result: named, and the others' seeds are not called every model's (it was
    # "Every model has seeds 1, 3 only (seed 2 diverged)" beside a standard row of dashes)
    rows = [{**model_row("standard", {"1": 9.0}), "seeds": [1, 2, 3], "test_ppl": dict.fromkeys(["1", "2", "3"]),
             "test_ppl_mean": None, "test_ppl_std": None},
            {**model_row("gba-m2", {"1": 9.0, "3": 8.0}), "seeds": [1, 2, 3], "test_ppl": {"1": 9.0, "2": None,
                                                                                              "3": 8.0}}]
    md = results_markdown({**report_of(rows), "seeds": [1, 2, 3]})
    assert "Every model has" not in md
    assert ("Every model with a finite result has seeds 1, 3 only (seed 2 diverged, with no finite perplexity): each "
            "mean is over 2 seeds.") in md
    assert ("Diverged, with no finite test perplexity, and left out of the means, Δ and paired differences: standard "
            "seeds 1, 2, 3; gba-m2 seed 2.") in md
    from gbattn.experiments.report import seeds_sentence

    assert seeds_sentence(rows) == "means over seeds 1, 3 (every model with a finite result)"
    # gba-m2 without seed 2 (not finished) beside a standard that diverged on all three: both said
    unfinished = [rows[0], {**model_row("gba-m2", {"1": 9.0, "3": 8.0})}]
    md = results_markdown({**report_of(unfinished), "seeds": [1, 2, 3]})
    assert ("Every model with a finite result has seeds 1, 3 only (seed 2 not finished): each mean is over 2 "
            "seeds.") in md and "differences: standard seeds 1, 2, 3." in md
    # paired differences leave the diverged seed out (it was paired on its finite but huge validation loss)
    rows[1]["valid_loss"] = {"1": 2.0, "2": 40.0, "3": 2.1}
    rows.append({**model_row("twicing", {"1": 9.5, "2": 9.4, "3": 9.3}), "valid_loss": {"1": 2.2, "2": 2.3, "3": 2.4}})
    from gbattn.experiments.report import paired_differences

    assert paired_differences(rows[1], rows[2]) == pytest.approx({"1": -0.2, "3": -0.3})
    # every seed diverged: "one seed per model, so no spread" was said of three seeds each
    md = results_markdown({**report_of(rows[:1]), "seeds": [1, 2, 3]})
    assert "Test perplexity from the best-validation checkpoint; no model has a finite one." in md
    # one model with none, another with one finite seed of two: no spread, and not "no model has a finite one"
    mixed = [{**model_row("standard", {"1": 9.0}), "seeds": [1, 2], "test_ppl": {"1": None, "2": None},
              "test_ppl_mean": None, "test_ppl_std": None},
             {**model_row("gba-m2", {"1": 9.0}), "seeds": [1, 2], "test_ppl": {"1": 9.0, "2": None}}]
    md = results_markdown({**report_of(mixed), "seeds": [1, 2]})
    assert ("Test perplexity from the best-validation checkpoint; at most one finite result per model, so no "
            "spread.") in md
    # the results figure's footer says which seeds diverged, as results.md does
    drawn = drawn_texts(figures.results_figure({**report_of(mixed), "seeds": [1, 2]}))["all"]
    assert "Diverged, with no finite test perplexity, and left out of the means" in " ".join(drawn.split())


def test_read_report_refuses_a_label_that_is_no_folder_name_and_takes_integer_numbers(tmp_path):
    """A row's label names its folder (LABEL/seedS/ is read): "", "..", one with a slash or a backslash is
    damage; a perplexity or published number written as an integer (100, not 100.0) is a number."""
    from gbattn.errors import CheckpointError
    from gbattn.experiments.report import read_report

    row, path = model_row("standard", {"42": 100.0}), tmp_path / "results.json"
    for label in ("", "..", "a/b", "a\\b"):
        path.write_text(json.dumps(report_of([{**row, "label": label}])))
        with pytest.raises(CheckpointError, match="not the name of a folder in the comparison"):
            read_report(path)
    path.write_text(json.dumps(report_of([{**row, "test_ppl": {"42": 100}, "published": [72, None]}])))
    assert read_report(path)["models"][0]["test_ppl"] == {"42": 100}


def test_a_published_row_without_a_mean_shows_no_value_and_names_no_published_source():
    """results.json may record published = [null, null] (read_report allows it): no published value is shown,
    so results.md names no source for one."""
    from gbattn.experiments.report import results_markdown

    rows = [model_row("standard", {"42": 9.0}, published=[None, None]), model_row("gba-m2", {"42": 8.8})]
    md = results_markdown(report_of(rows))
    assert "Published:" not in md and "published numbers omitted" not in md
    rows[0]["published"] = [6.55, None]
    assert "Published: nanoGPT README." in results_markdown(report_of(rows))


def test_the_seeds_results_md_names_are_in_numeric_order_negative_ones_too():
    """Seeds are named in numeric order (9 before 10, not as text), a negative one (read_report allows it)
    first: in the line that says which seeds every model has."""
    from gbattn.experiments.report import results_markdown

    rows = [model_row("standard", {"10": 10.0, "9": 10.5, "-1": 11.0}), model_row("gba-m2", {"10": 9.0, "9": 9.5,
                                                                                               "-1": 9.2})]
    md = results_markdown({**report_of(rows), "seeds": [-1, 9, 10, 11]})
    assert "Every model has seeds -1, 9, 10 only (seed 11 not finished): each mean is over 3 seeds." in md


def test_the_delta_columns_name_their_reference_when_it_is_another_standard():
    """The Δ columns divide by the first row whose label starts with "standard": in the upcycle recipe that is
    standard-continued, and results.md's header said "Δ vs standard". Each header, and the seeds line, names it."""
    rows = [model_row("gba-scratch", {"42": 9.0, "123": 9.5}), model_row("standard-continued", {"42": 10.0}),
            model_row("standard", {"42": 11.0, "123": 12.0})]
    md = results_markdown(report_of(rows))
    assert "| model | attention | d | parameters | test ppl | Δ vs standard-continued | valid ppl |" in md
    assert "Δ vs standard-continued is over the seed all models share (42)." in md
    apart = results_markdown(report_of([model_row("gba-scratch", {"42": 9.0}),
                                        model_row("standard-continued", {"42": 10.0, "123": 11.0}),
                                        model_row("standard", {"123": 12.0})]))
    assert ("Δ vs standard-continued is over the seeds each model shares with standard-continued (no seed is shared "
            "by all models)." in apart)
    paired = results_markdown(report_of([{**model_row("standard-continued", {"42": 10.0, "123": 11.0}),
                                           "valid_loss": {"42": 2.3, "123": 2.4}},
                                          {**model_row("gba-m2", {"42": 9.0, "123": 10.0}),
                                           "valid_loss": {"42": 2.2, "123": 2.3}}]))
    header = "| model | parameters | train PFLOP | valid loss | Δ vs standard-continued |"
    assert header in paired
    assert "| gba-scratch | boosted | 128 | 800,000 | 9.25 ± 0.35 | -10.0% |" in md  # over seed 42: 9 / 10
    plain = results_markdown(report_of([model_row("standard", {"42": 10.0}), model_row("gba-m2", {"42": 9.0})]))
    assert "| test ppl | Δ vs standard | valid ppl |" in plain


def test_gap_groups_comparisons_whose_settings_were_given_in_another_order(tmp_path):
    """same_comparison: two directories of one recipe, data, model steps and settings are one line whatever order
    their settings were given in (--set a=1 --set b=2 or the reverse); another recipe, or another step count, is a
    line of its own."""
    from gbattn.analysis.cli import same_comparison

    def report(recipe, sets, steps):
        return {"recipe": recipe, "data": "tiny-shakespeare", "sets": sets,
                "models": [{"label": "gba-m2", "steps": steps}]}

    reports = {"one": report("cpu-char", {"lr": 1e-3, "threads": 1}, 2000),
               "two": report("cpu-char", {"threads": 1, "lr": 1e-3}, 2000),
               "other": report("cpu-proxy", {"lr": 1e-3, "threads": 1}, 2000),
               "longer": report("cpu-char", {"lr": 1e-3, "threads": 1}, 8000)}
    groups = same_comparison([tmp_path / name for name in reports], "gba-m2", read=lambda d: reports[d.name])
    assert [[d.name for d in group] for group in groups] == [["one", "two"], ["other"], ["longer"]]


def test_gap_keeps_apart_directories_whose_model_of_one_label_is_another_model(tmp_path):
    """`compare --model mine=boosted:rounds=2` in one directory and `--model mine=boosted:rounds=4` in another, of one
    recipe, data, settings and steps: --gap mine pooled them into one line, "a + b", with a's parameter count for
    both. What defines the model (the models --model and --matched added, and the row's variant, options and size)
    keeps them apart: a line each, each over its own parameters."""
    from gbattn.analysis.cli import same_comparison

    dirs = {}
    for name, rounds, params in (("a", 2, 100), ("b", 4, 130)):
        root = _gap_dir(tmp_path / name, 400, seeds=(1,) if name == "a" else (2,))
        shutil.move(root / "gba-m2", root / "mine")
        report = json.loads((root / "results.json").read_text())
        report["models"][0].update(label="mine", attn="boosted", attn_options={"rounds": rounds}, parameters=params)
        report.update(recipe="cpu-char", data="tiny-shakespeare", sets={"max_steps": 400},
                      added={"mine": f"boosted:rounds={rounds}"})
        (root / "results.json").write_text(json.dumps(report))
        dirs[name] = root
    assert cli_main(["plot", str(dirs["a"]), str(dirs["b"]), "--gap", "mine", "--out", str(tmp_path / "fig")]) == 0
    series = json.loads((tmp_path / "fig" / "gap.json").read_text())["series"]
    assert [(s["directory"], s["points"][-1]["tokens_per_parameter"]) for s in series] == [
        ("a", pytest.approx(4000 / 100)), ("b", pytest.approx(4000 / 130))]
    # the row alone tells them apart too (a results.json of a recipe's own model, with the same added models)
    reports = {name: json.loads((root / "results.json").read_text()) for name, root in dirs.items()}
    reports["b"]["added"] = reports["a"]["added"]
    groups = same_comparison([dirs["a"], dirs["b"]], "mine", read=lambda d: reports[d.name])
    assert [[d.name for d in group] for group in groups] == [["a"], ["b"]]
    reports["b"]["models"][0].update(attn_options={"rounds": 2}, parameters=100)  # the same model: one line
    groups = same_comparison([dirs["a"], dirs["b"]], "mine", read=lambda d: reports[d.name])
    assert [[d.name for d in group] for group in groups] == [["a", "b"]]


def test_gap_pools_directories_that_differ_only_in_a_result_neutral_setting(tmp_path):
    """One comparison continued elsewhere with --seeds and another --set eval_batch_size (or device, compile,
    log_every ...), which `gbattn compare` itself takes for the same comparison, was drawn as two lines; the
    result-neutral settings (TrainConfig.RESULT_NEUTRAL) are left out of the comparison, another lr is not."""
    from gbattn.analysis.cli import same_comparison

    def report(sets):
        return {"recipe": "cpu-char", "data": "tiny-shakespeare", "sets": {"lr": 1e-3, **sets},
                "models": [{"label": "gba-m2", "steps": 2000}]}

    reports = {"first": report({"eval_batch_size": 4}), "later": report({"eval_batch_size": 8, "device": "cuda"}),
               "other": report({"lr": 3e-3, "eval_batch_size": 4}),
               "again": report({"log_every": 50, "compile": True, "threads": 2})}
    groups = same_comparison([tmp_path / name for name in reports], "gba-m2", read=lambda d: reports[d.name])
    assert [[d.name for d in group] for group in groups] == [["first", "later", "again"], ["other"]]


def test_gap_pairs_a_continued_model_at_its_whole_training_length(tmp_path):
    """upcycle: gba-upcycled continues base's 200 steps (2,000 tokens) for 200 more, whose steps and tokens count
    from the start of the continuation. --gap gba-upcycled --against standard-scratch paired the continuation's step
    200 with the from-scratch model's step 200 and drew it at the continuation's tokens only, while the curves
    figure draws it after base's tokens. Its steps and tokens are now the whole training's: step 400 is paired with
    the from-scratch model's step 400, at 4,000 tokens per its parameters; two continuations of one base pair as
    before."""
    from gbattn.analysis.cli import gap_series

    root = tmp_path / "up"
    rows = []
    for label, steps, init_from, loss in (("base", 200, None, 3.0), ("gba-upcycled", 200, "base", 2.0),
                                          ("standard-continued", 200, "base", 2.1),
                                          ("standard-scratch", 400, None, 2.5)):
        for seed in (1, 2):
            run = root / label / f"seed{seed}"
            run.mkdir(parents=True)
            events = [{"event": "eval", "step": s, "tokens": 10 * s, "valid_loss": loss + 1 / s}
                      for s in range(100, steps + 1, 100)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        rows.append({"label": label, "parameters": 100, "steps": steps, "seeds": [1, 2], "init_from": init_from,
                     "train_tokens": 10 * steps})
    (root / "results.json").write_text(json.dumps({"recipe": "upcycle", "models": rows}))
    gap = gap_series(root, "gba-upcycled", "standard-scratch")
    assert (gap["steps"], gap["reference_steps"]) == (400, 400)
    assert [(p["step"], p["tokens_per_parameter"]) for p in gap["points"]] == [(300, 30.0), (400, 40.0)]
    # continuation step 100 (whole step 300) against scratch step 300, and 200 (400) against 400
    assert [p["difference"] for p in gap["points"]] == [pytest.approx(2.0 + 1 / 100 - 2.5 - 1 / 300),
                                                        pytest.approx(2.0 + 1 / 200 - 2.5 - 1 / 400)]
    gap = gap_series(root, "standard-scratch", "gba-upcycled")  # the continued model as the reference: its whole
    assert (gap["steps"], gap["reference_steps"]) == (400, 400)  # training too (not 200, "paired at equal steps")
    gap = gap_series(root, "gba-upcycled", "standard-continued")  # both continue base: step for step
    assert [(p["step"], p["difference"]) for p in gap["points"]] == [(300, pytest.approx(-0.1)),
                                                                     (400, pytest.approx(-0.1))]
