"""Figures of the analysis (docs/paper.md, "Analysis")
and of a comparison directory, drawn with matplotlib's Agg canvas (no display, no pyplot
global state). Every function takes plain numbers (the JSON summary, numpy arrays) and
returns a :class:`matplotlib.figure.Figure`; :func:`save` writes it as PNG (and PDF).

Figures are sized for a README (about 1000 px wide, shown at ~800 px): titles, axis labels
with units, legends.
"""

from __future__ import annotations

import contextlib
import math
import textwrap
from pathlib import Path

import numpy as np

from gbattn.errors import optional_module
from gbattn.experiments.report import (
    TEST_IS_VALIDATION,
    compared_values,
    diverged_note,
    mean_std,
    missing_text,
    no_test_split,
    published_omitted_note,
    published_value,
    relative_change,
    run_steps_text,
    seed_key,
    seed_values,
    seeds_held_note,
    seeds_sentence,
    standard_row,
)
from gbattn.files import write_figure

DPI = 100
STYLE = {
    "font.size": 12,
    "axes.titlesize": 13,
    "axes.labelsize": 12,
    "legend.fontsize": 10,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "text.parse_math": False,  # token strings may hold '$'
}
ROUND_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def round_color(m: int) -> str:
    """Round 0 blue, round 1 red, ...: any number of rounds (colours repeat after eight)."""
    return ROUND_COLORS[m % len(ROUND_COLORS)]


def require_matplotlib():
    """The matplotlib module, or a one-line UserError saying how to install it (its pyplot-free Agg canvas is
    imported too: matplotlib 3.7 with numpy 2 fails there)."""
    matplotlib = optional_module("matplotlib", "plot", "figures need")
    optional_module("matplotlib.backends.backend_agg", "plot", "figures need")
    return matplotlib


def new_figure(figsize: tuple[float, float]):
    """A Figure on the Agg canvas (PNG/PDF without a display)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def style():
    """A context manager applying :data:`STYLE` while a figure is drawn and saved."""
    matplotlib = require_matplotlib()
    known = {k: v for k, v in STYLE.items() if k in matplotlib.rcParams}
    return matplotlib.rc_context(known)


def save(fig, out_dir: Path, name: str, pdf: bool = False) -> list[Path]:
    """Write ``out_dir/name.png`` (and ``.pdf``); returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.png"] + ([out_dir / f"{name}.pdf"] if pdf else [])
    with style():
        for path in paths:
            write_figure(fig, path, dpi=DPI)
    return paths


def change_words(relative_drop: float) -> str:
    """A relative drop in words, right for both signs: 0.22 -> '22% lower', -0.03 -> '3% higher'."""
    return f"{abs(100 * relative_drop):.0f}% {'lower' if relative_drop >= 0 else 'higher'}"


def count_words(n: int, noun: str) -> str:
    """``3 layers``, ``1 layer``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def change_percent(relative_drop: float) -> str:
    """A relative drop as the signed change of the entropy: 0.2 -> '-20%', -0.03 -> '+3%', and a change that
    rounds to nothing '+0%' (never '-0%')."""
    return f"{round(-100 * relative_drop) + 0:+d}%"


def plain_number(value: float, _pos=None) -> str:
    """A tick label without mathtext: 5, 0.5, 1,000, 50,000."""
    return f"{value:,.12g}"


def plain_log_axis(axis) -> None:
    """Plain tick labels (100, 200, 1,000) on a log axis (``ax.yaxis``): STYLE turns mathtext off
    for token strings, so matplotlib's default labels would print as raw ``$\\mathdefault{10^{3}}$``.
    Call after the data are drawn: the ticks per decade follow the span of the view."""
    from matplotlib import ticker

    lo, hi = sorted(axis.get_view_interval())
    decades = math.log10(hi / lo) if lo > 0 else 3.0
    subs = (1.0,) if decades > 2.5 else (1.0, 2.0, 5.0) if decades > 1 else tuple(float(k) for k in range(1, 10))
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    axis.set_major_formatter(ticker.FuncFormatter(plain_number))
    axis.set_minor_formatter(ticker.NullFormatter())


def round_name(m: int) -> str:
    return "round 0 (attention)" if m == 0 else f"round {m} (correction)"


def token_label(text: str) -> str:
    """A token made visible on an axis: spaces and newlines drawn, long tokens cut."""
    text = text.replace("\n", "↵").replace("\t", "⇥")
    if text.strip() == "":
        text = "␣" * max(1, len(text))
    return text if len(text) <= 12 else text[:11] + "…"


def _drawing(figsize):
    """(figure, context manager) so that STYLE applies while axes are created."""
    stack = contextlib.ExitStack()
    stack.enter_context(style())
    return new_figure(figsize), stack


# --------------------------------------------------------------------------------------
# gbattn analyze
# --------------------------------------------------------------------------------------


def paper_gates_label(gates: dict, paper: dict, n_layers: int | None, attention: str = "") -> str:
    """What to call the paper's per-layer gate means beside a run's: "paper" where the run has the paper's shape
    (its depth, every layer corrected, M=2, the linear gate), else "paper (its 4-layer M=2 model)": beside an 8-layer
    run, one of 3 rounds or another gate they line up with nothing of the run's."""
    depth = len(paper["gate_mean_per_layer"])
    rows = gates["per_layer"]
    same = (n_layers in (None, depth) and sorted({r["layer"] for r in rows}) == list(range(depth))
            and all(r["round"] == 1 for r in rows) and ("gate=" not in attention or "gate=linear" in attention))
    return "paper" if same else f"paper (its {depth}-layer M=2 model)"


def gates_figure(gates: dict, paper: dict, title: str = "", paper_label: str = "paper"):
    """Per-layer, per-dimension mean gate (heatmap, one row per corrected layer and round) and each
    layer's mean ± std, with the paper's per-layer means as markers (``paper_label``: :func:`paper_gates_label`)."""
    rows = gates["per_layer"]
    C = max(r["round"] for r in rows)
    layers = sorted({r["layer"] for r in rows})
    fig, ctx = _drawing((11, 4.6))
    with ctx:
        heat_ax, bar_ax = fig.subplots(1, 2, width_ratios=[2.2, 1])
        per_dim = np.asarray([r["per_dimension"] for r in rows])
        low = -1.0 if per_dim.min() < 0 else 0.0  # a tanh gate (upcycling) lies in (-1, 1)
        image = heat_ax.imshow(per_dim, aspect="auto", cmap="viridis", vmin=low, vmax=1, interpolation="nearest")
        names = [f"layer {r['layer']}" + (f" g{r['round']}" if C > 1 else "") for r in rows]
        heat_ax.set_yticks(range(len(rows)), names)
        heat_ax.set_xlabel("model dimension")
        heat_ax.set_title("mean gate per dimension (held-out tokens)")
        heat_ax.grid(False)
        fig.colorbar(image, ax=heat_ax, label="gate value g (0 = drop correction, 1 = keep)")

        width = 0.8 / C
        for c in range(C):
            round_rows = [r for r in rows if r["round"] == c + 1]
            xs = np.asarray([layers.index(r["layer"]) for r in round_rows]) + (c - (C - 1) / 2) * width
            bar_ax.bar(xs, [r["mean"] for r in round_rows], width, yerr=[r["std"] for r in round_rows], capsize=4,
                       color=round_color(c + 1), alpha=0.8,
                       label="ours: mean ± std\n(over tokens × dimensions)" + (f" (g{c + 1})" if C > 1 else ""))
        paper_markers = (
            ("gate_mean_per_layer", "D", paper_label),
            ("gate_mean_per_layer_revised", "x",
             "paper (revision)" if paper_label == "paper" else paper_label[:-1] + ", revision)"),
        )
        for key, marker, label in paper_markers:
            values = paper.get(key) or []
            at = [(i, values[layer]) for i, layer in enumerate(layers) if layer < len(values)]
            if at:
                bar_ax.plot(*zip(*at), marker, color="black", markersize=7, linestyle="none", label=label)
        bar_ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
        bar_ax.set_xlabel("layer")
        bar_ax.set_ylabel("gate value")
        bar_ax.set_ylim(low, 1)
        bar_ax.set_title("gate per layer")
        bar_ax.legend(loc="upper left")
        fig.suptitle(title or "GBA gates g_m: shrinkage of the correction round")
    return fig


def entropy_figure(entropy: dict, paper: dict | None, title: str = ""):
    """Distribution of per-query attention entropy per round, per-layer (and per-head) means,
    and mean entropy by position against the bound log(t + 1)."""
    edges = np.asarray(entropy["histogram"]["edges"])
    counts = np.asarray(entropy["histogram"]["counts_per_round"])  # (M, K)
    M = counts.shape[0]
    layers = entropy["per_layer"]
    L = len(layers)
    fig, ctx = _drawing((11, 8.4))
    with ctx:
        grid = fig.add_gridspec(2, 2)
        hist_ax, layer_ax, pos_ax = (
            fig.add_subplot(grid[0, 0]),
            fig.add_subplot(grid[0, 1]),
            fig.add_subplot(grid[1, :]),
        )
        widths = np.diff(edges)
        layers_M = entropy.get("layers_per_round") or []
        partial = len(set(layers_M)) > 1  # GBA in some layers only: each round's mean is over its own layers
        for m in range(M):
            density = counts[m] / max(counts[m].sum(), 1) / widths
            mean = entropy["mean_per_round"][m]
            over = f" ({count_words(layers_M[m], 'layer')})" if partial else ""
            hist_ax.stairs(density, edges, color=round_color(m), fill=True, alpha=0.35)
            hist_ax.stairs(
                density, edges, color=round_color(m), linewidth=1.5, label=f"{round_name(m)}: mean {mean:.2f}{over}"
            )
            hist_ax.axvline(mean, color=round_color(m), linestyle="--", linewidth=1.2)
        hist_ax.axvline(entropy["max_possible"], color="gray", linestyle=":",
                        label=f"max log T = {entropy['max_possible']:.2f}")
        hist_ax.set_xlabel("attention entropy per query (nats)")
        hist_ax.set_ylabel("density (per nat)")
        hist_ax.set_title("distribution (all layers, heads, positions)")
        hist_ax.legend(loc="upper left")

        width = 0.8 / M
        for m in range(M):
            xs = np.arange(L) + (m - (M - 1) / 2) * width
            layer_ax.bar(xs, [r["mean_per_round"][m] if m < len(r["mean_per_round"]) else np.nan for r in layers],
                         width, color=round_color(m), alpha=0.8, label=round_name(m))
            for li, r in enumerate(layers):
                if m >= len(r["per_head"]):  # a layer without this round (GBA in some layers only)
                    continue
                heads = r["per_head"][m]
                layer_ax.plot([xs[li]] * len(heads), heads, "o", color="black", markersize=3, alpha=0.6,
                              label="per head" if (li == 0 and m == 0) else None)
        if paper and M > 1:
            layer_ax.axhline(paper["entropy_round0_nats"], color=round_color(0), linestyle=":", linewidth=1.5,
                             label=f"paper round 0 ({paper['entropy_round0_nats']:.2f}, T={paper['seq_len']})")
            layer_ax.axhline(paper["entropy_correction_nats"], color=round_color(1), linestyle=":", linewidth=1.5,
                             label=f"paper correction ({paper['entropy_correction_nats']:.2f}, T={paper['seq_len']})")
        for li, r in enumerate(layers):
            if r.get("relative_drop") is not None:  # the correction's entropy change, inside the bars
                layer_ax.annotate(change_percent(r["relative_drop"]), (li, 0), textcoords="offset points",
                                  xytext=(0, 6), ha="center", fontsize=10,
                                  bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "linewidth": 0})
        tops = [max(max(h) for h in r["per_head"]) for r in layers]
        if paper and M > 1:
            tops.append(paper["entropy_round0_nats"])
        layer_ax.set_ylim(0, 1.1 * max(tops + [1e-3]))
        layer_ax.set_xticks(range(L), [str(i) for i in range(L)])
        layer_ax.set_xlabel("layer")
        layer_ax.set_ylabel("mean entropy (nats)")
        drop = entropy.get("relative_drop")
        where = "in the layers that have it;\n" if partial else "overall; "  # (on one line it ran off the figure)
        first = "correction" if M == 2 else "round 1"  # (with 2 corrections, "correction" named no round)
        layer_ax.set_title("per layer" + (f"\n({first} {change_words(drop)} {where}change per layer in boxes)"
                                          if drop is not None else ""), fontsize=11)
        layer_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9)

        profile = np.asarray(entropy["per_position_mean"])  # (M, T)
        positions = np.arange(profile.shape[1])
        for m in range(M):  # (each round's curve over its own layers, as the histogram's: a round 0 over every layer
            # beside a correction over some read as the correction raising the entropy)
            over = f" ({count_words(layers_M[m], 'layer')})" if partial else ""
            pos_ax.plot(positions, profile[m], color=round_color(m), linewidth=1.8, label=round_name(m) + over)
        pos_ax.plot(positions, np.log(positions + 1), color="gray", linestyle=":", linewidth=1.5,
                    label="bound log(t+1) (uniform attention)")
        pos_ax.set_xlabel("query position t (tokens)")
        pos_ax.set_ylabel("mean entropy (nats)")
        pos_ax.set_title("by position: a causal row at t can reach at most log(t+1) nats")
        pos_ax.legend(loc="upper left")
        fig.suptitle(title or "Attention entropy per round")
    return fig


NORM_KEYS = [
    ("x", "x (sublayer input)"),
    ("round0_output", "F_0 (round 0)"),
    ("residual", "r = x − F before the correction"),
    ("correction", "c (correction)"),
    ("gated_correction", "g ⊙ c (gated correction)"),
    ("residual_after", "x − F after the correction"),
]


def norms_figure(norms: dict, title: str = ""):
    """Mean per-token L2 norms per layer: input, round-0 output, residual x − F, correction,
    gated correction and what is left after it."""
    rows = norms["per_layer"]
    rounds = sorted({r["round"] for r in rows})
    fig, ctx = _drawing((11, 4.8))
    with ctx:
        ax = fig.subplots()
        groups = [(r["layer"], r["round"]) for r in rows]
        width = 0.8 / len(NORM_KEYS)
        colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#9467bd", "#d62728", "#2ca02c"]
        for k, (key, label) in enumerate(NORM_KEYS):
            xs = np.arange(len(groups)) + (k - (len(NORM_KEYS) - 1) / 2) * width
            ax.bar(xs, [r[key] for r in rows], width, color=colors[k], label=label)
        for i, r in enumerate(rows):
            ax.annotate(f"|gc|/|r| = {r['gated_over_residual']:.2f}", (i, max(r[k] for k, _ in NORM_KEYS)),
                        textcoords="offset points", xytext=(0, 4), ha="center", fontsize=9)
        names = [f"layer {li}" + (f", round {m}" if len(rounds) > 1 else "") for li, m in groups]
        ax.set_xticks(range(len(groups)), names)
        ax.set_ylabel("mean L2 norm per token (model units)")
        ax.set_title(title or "Residual and gated correction norms per layer")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.margins(y=0.12)
    return fig


def loss_diff_figure(diff_NT: np.ndarray, this_name: str, against_name: str, tie_nats: float, title: str = ""):
    """Distribution of the per-token loss difference (against − this run; positive = this
    run better; within ``tie_nats`` a tie, ``stats.TIE_NATS``) and its mean by position."""
    diff = np.asarray(diff_NT, dtype=np.float64)
    flat = diff.ravel()
    fig, ctx = _drawing((11, 4.6))
    with ctx:
        hist_ax, pos_ax = fig.subplots(1, 2, width_ratios=[1.3, 1])
        lo, hi = np.percentile(flat, [0.5, 99.5]) if flat.size else (-1.0, 1.0)
        lo, hi = min(lo, -1e-3), max(hi, 1e-3)
        hist_ax.hist(np.clip(flat, lo, hi), bins=80, range=(lo, hi), color="#7f7f7f", alpha=0.85)
        hist_ax.axvline(0, color="black", linewidth=1)
        mean = float(flat.mean()) if flat.size else 0.0
        hist_ax.axvline(mean, color="#d62728", linestyle="--", linewidth=1.5, label=f"mean {mean:+.3f} nats")
        better = float((flat > tie_nats).mean()) if flat.size else 0.0
        worse = float((flat < -tie_nats).mean()) if flat.size else 0.0
        clipped = int(((flat < lo) | (flat > hi)).sum())  # the tails, drawn in the end bins
        hist_ax.set_xlabel(f"loss({against_name}) − loss({this_name})  (nats per token)" + (
            f"\n{clipped:,} tokens outside [{lo:+.2f}, {hi:+.2f}] counted in the end bins" if clipped else ""))
        hist_ax.set_ylabel("tokens")
        hist_ax.set_title(f"{this_name} better on {100 * better:.0f}% of tokens, worse on {100 * worse:.0f}% "
                          f"(ties: within {tie_nats:g})")
        hist_ax.legend(loc="upper left")
        positions = np.arange(diff.shape[1])
        pos_ax.plot(positions, diff.mean(0), color="#d62728", linewidth=1.5)
        pos_ax.axhline(0, color="black", linewidth=1)
        pos_ax.set_xlabel("position in the row (tokens)")
        pos_ax.set_ylabel("mean difference (nats)")
        pos_ax.set_title("mean by position")
        fig.suptitle(title or f"Per-token loss difference: {against_name} − {this_name}")
    return fig


def examples_figure(examples: list[dict], layer: int, context: int = 24, title: str = ""):
    """For each example, the head-averaged attention of every round of layer ``layer`` over
    the last ``context`` tokens it can see (the paper's example figure).

    Each example: ``attention`` (rounds, t + 1), ``tokens`` (t + 1 strings), ``target``
    (string), ``loss``, ``against_loss``."""
    n = max(len(examples), 1)
    fig, ctx = _drawing((11, 2.9 * n + 0.6))
    with ctx:
        axes = np.atleast_1d(fig.subplots(n, 1, squeeze=False)[:, 0])
        for ax, ex in zip(axes, examples):
            att = np.asarray(ex["attention"])
            keep = min(context, att.shape[1])
            att, tokens = att[:, -keep:], ex["tokens"][-keep:]
            M = att.shape[0]
            width = 0.8 / M
            for m in range(M):
                xs = np.arange(keep) + (m - (M - 1) / 2) * width
                ax.bar(xs, att[m], width, color=round_color(m), label=round_name(m))
            ax.set_xticks(
                range(keep),
                [token_label(t) for t in tokens],
                rotation=60 if max(map(len, tokens)) > 2 else 0,
                ha="right" if max(map(len, tokens)) > 2 else "center",
            )
            ax.set_xlim(-0.6, keep - 0.4)
            ax.get_xticklabels()[-1].set_fontweight("bold")  # the query's own token
            ax.set_ylabel("attention weight\n(mean over heads)")
            ax.set_title(f"row {ex['row']}, position {ex['position']}: predicting {token_label(ex['target'])!r} — loss "
                         f"{ex['loss']:.2f} vs {ex['against_loss']:.2f} nats for the other model "
                         f"(gain {ex['against_loss'] - ex['loss']:+.2f})", fontsize=11)
        if examples:
            fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=M, frameon=False)
        else:
            axes[0].text(0.5, 0.5, "no example positions", ha="center", va="center", transform=axes[0].transAxes)
        axes[-1].set_xlabel(f"context tokens (at most the last {context}; bold = the query's own token, "
                            f"which predicts the next one)")
        fig.suptitle(title or f"Where the boosted model gains most: layer {layer} attention, head-averaged")
    return fig


# --------------------------------------------------------------------------------------
# gbattn plot
# --------------------------------------------------------------------------------------


def _tokens_axis(max_tokens: float) -> tuple[float, str]:
    if max_tokens >= 1e6:
        return 1e6, "tokens seen (millions)"
    if max_tokens >= 1e3:
        return 1e3, "tokens seen (thousands)"
    return 1.0, "tokens seen"


def results_figure(report: dict):
    """Test perplexity per model: mean ± std (each seed as a dot), published numbers as markers;
    the y axis is zoomed to the values (it does not start at 0).

    Like with like: when the models have different seeds, each mean (and its Δ vs standard) is
    over the seeds all models share (:func:`compared_values`); "n=" under each model says how
    many seeds its mean has. Published numbers only for runs as long as the published ones
    (:func:`published_value`)."""
    rows = report.get("models", [])
    compared = compared_values(rows)
    fig, ctx = _drawing((10, 5.2))
    with ctx:
        ax = fig.subplots()
        values = []
        base = standard_row(rows)  # results.md's reference: without a result, no line and no Δ (as there)
        base = base if base is not None and compared[base["label"]] else None
        if base is not None:
            base_mean, _ = mean_std(compared[base["label"]].values())
            ax.axhline(base_mean, color="gray", linestyle="--", linewidth=1, label=f"{base['label']} mean")
        tick_labels = []
        for i, r in enumerate(rows):
            every_seed = seed_values(r)
            mean, std = mean_std(compared[r["label"]].values())
            name = textwrap.fill(r["label"], 20, break_on_hyphens=True)  # a long name ran into its neighbours'
            if mean is None:
                tick_labels.append(f"{name}\nno result")
                continue
            n_mean, n_all = len(compared[r["label"]]), len(every_seed)
            tick_labels.append(f"{name}\nn={n_mean}" + (f" (dots n={n_all})" if n_all != n_mean else ""))
            mean_label = ("ours: mean ± std over n seeds (n under each model)" if max(map(len, compared.values())) > 1
                          else "ours: one seed's value (no spread: no error bar)")
            # One value has no spread: no bar (a zero-length one drew caps, as if it were a std of 0).
            ax.errorbar([i], [mean], yerr=None if std is None else [std], fmt="o", color="#1f77b4", markersize=9,
                        capsize=6, elinewidth=2, label=mean_label if not values else None)
            ax.plot([i] * n_all, list(every_seed.values()), ".", color="#1f77b4", alpha=0.5, markersize=7,
                    label="ours: all seeds (one dot each)" if not values else None)
            change = relative_change(compared[r["label"]], compared[base["label"]]) if base and r is not base else None
            delta = f" ({100 * change:+.1f}%)" if change is not None else ""
            # Above its own column (left of the point, the first model's number ran over the y axis' tick labels).
            top = max([mean + (std or 0), *every_seed.values()])
            ax.annotate(f"{mean:.2f}{delta}", (i, top), textcoords="offset points", xytext=(0, 6), ha="center",
                        va="bottom", fontsize=10)
            values += list(every_seed.values()) + [mean - (std or 0), mean + (std or 0)]
        published_drawn = False
        for i, r in enumerate(rows):
            pub = published_value(report, r)
            if pub is not None:
                ax.errorbar([i + 0.18], [pub[0]], yerr=None if pub[1] is None else [pub[1]], fmt="D", color="black",
                            mfc="white", markersize=7, capsize=4, label="published" if not published_drawn else None)
                values += [pub[0] - (pub[1] or 0), pub[0] + (pub[1] or 0)]
                published_drawn = True
        if values:
            lo, hi = min(values), max(values)
            pad = max(0.15 * (hi - lo), 0.01 * hi, 1e-3)
            ax.set_ylim(lo - pad, hi + 2 * pad)  # room above the highest column for its number
        ax.set_xticks(range(len(rows)), tick_labels, rotation=20 if len(rows) > 4 else 0)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_ylabel("test perplexity (lower is better)")
        ax.set_title(f"{report.get('recipe', '')} ({run_steps_text(rows)}): test perplexity (zoomed axis, not from 0)\n"
                     f"{seeds_sentence(rows, complete=report.get('complete', True))}", fontsize=12)
        if ax.get_legend_handles_labels()[0]:  # nothing drawn (no finite value): no empty legend, no warning
            ax.legend(loc="best")
        source = report.get("published_source")
        footer = [] if report.get("complete", True) else [f"INCOMPLETE ({missing_text(report)})"]
        held_note = seeds_held_note(report, rows)
        if held_note:
            footer.append(held_note)
        diverged = diverged_note(rows, held_note)
        if diverged:
            footer.append(diverged)
        if published_drawn and source:
            footer.append(f"published: {source}")
        omitted = published_omitted_note(report)
        if omitted:
            footer.append(omitted)
        if no_test_split(rows):
            footer.append(TEST_IS_VALIDATION[0].lower() + TEST_IS_VALIDATION[1:])
        if footer:
            fig.supxlabel("\n".join(footer), fontsize=9)
    return fig


# One line style per seed: named ones, then dash patterns (after four seeds the styles came round again, and seed 5's
# legend entry looked like seed 1's); more seeds than these share them.
LINESTYLES = ["-", "--", ":", "-.", (0, (6, 1.5)), (0, (1, 3)), (0, (4, 1.5, 1, 1.5, 1, 1.5)), (0, (10, 3, 3, 3))]


def model_colors(n: int) -> list:
    """One colour per model: matplotlib's ten for up to ten models, else ``n`` spread over a colour map (the ten came
    round again, and the eleventh model's legend entry looked like the first's)."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    import matplotlib

    return [matplotlib.colormaps["turbo"](0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def curves_figure(curves: dict, setting: str = "", unfinished: list[str] | None = None,
                  not_drawn: list[str] | None = None):
    """Training loss and validation perplexity against tokens seen, one line per run; ``setting`` (recipe,
    data, steps) goes under the title, and a footer names the ``unfinished`` runs drawn (not in results.json) and
    the runs the comparison asked for that have no curve (``not_drawn``: never started, or no event logged).

    ``curves``: label -> seed -> {"train": [(tokens, loss)], "valid": [(tokens, ppl)]}."""
    require_matplotlib()
    from matplotlib.lines import Line2D

    fig, ctx = _drawing((11, 4.8))
    with ctx:
        train_ax, valid_ax = fig.subplots(1, 2)
        all_tokens = [t for runs in curves.values() for c in runs.values() for t, _ in c["train"] + c["valid"]]
        scale, xlabel = _tokens_axis(max(all_tokens, default=0))
        seeds = sorted({s for runs in curves.values() for s in runs}, key=seed_key)
        colors = model_colors(len(curves))
        valid_values = []
        for color, (_label, runs) in zip(colors, curves.items()):
            for seed, c in runs.items():
                style = LINESTYLES[seeds.index(seed) % len(LINESTYLES)]
                if c["train"]:
                    t, v = np.asarray(c["train"], dtype=float).T
                    # a run that logged once (a few steps, say) is a dot: a line through one point draws nothing
                    train_ax.plot(t / scale, v, linestyle=style, color=color, linewidth=1.2, alpha=0.9,
                                  marker="o" if len(t) == 1 else None, markersize=4)
                if c["valid"]:
                    t, v = np.asarray(c["valid"], dtype=float).T
                    valid_ax.plot(t / scale, v, linestyle=style, color=color, marker="o", markersize=4, linewidth=1.5)
                    valid_values += list(v)
        finite = [v for v in valid_values if math.isfinite(v)]
        log_axis = bool(finite) and max(finite) / max(min(finite), 1e-9) > 3
        if log_axis:
            valid_ax.set_yscale("log")
            plain_log_axis(valid_ax.yaxis)
        train_ax.set_xlabel(xlabel)
        train_ax.set_ylabel("training loss (nats per token)")
        train_ax.set_title("training loss")
        valid_ax.set_xlabel(xlabel)
        valid_ax.set_ylabel("validation perplexity" + (" (log scale)" if log_axis else ""))
        valid_ax.set_title("validation perplexity (every evaluation)")
        handles = [Line2D([], [], color=c, linewidth=2, label=label) for c, label in zip(colors, curves)]
        if len(seeds) > 1:
            handles += [Line2D([], [], color="gray", linestyle=LINESTYLES[i % len(LINESTYLES)], label=f"seed {s}")
                        for i, s in enumerate(seeds)]
        if handles:
            valid_ax.legend(handles=handles, loc="upper right")
        fig.suptitle("Training and validation curves of every run" + (f"\n{setting}" if setting else ""))
        footer = []
        if unfinished:
            footer.append(f"unfinished, not in results.json (their curves stop where the runs stopped): "
                          f"{', '.join(unfinished)}")
        if not_drawn:
            footer.append(f"not drawn (not started, or nothing logged yet): {', '.join(not_drawn)}")
        if footer:
            fig.supxlabel("\n".join(footer), fontsize=9)
    return fig


def gap_figure(series: list[dict], model: str, references: list[str]):
    """One panel per reference: ``model``'s validation loss minus the reference's (mean over seeds,
    paired by seed and step) against the tokens per parameter ``model`` has seen, one line per run
    length; below 0 the model is better. A reference that trains for another number of steps than the
    model is named with its length in the legend: at the model's last step it is not at its own end."""
    fig, ctx = _drawing((5.5 * len(references), 4.6))
    with ctx:
        axes = np.atleast_1d(fig.subplots(1, len(references), squeeze=False)[0])
        for ax, ref in zip(axes, references):
            for i, s in enumerate(x for x in series if x["reference"] == ref):
                xs = [p["tokens_per_parameter"] for p in s["points"]]
                ys = [p["difference"] for p in s["points"]]
                most = max(p["seeds"] for p in s["points"])
                # A point fewer seeds evaluated (an extra evaluation of one seed, a diverged one) is drawn hollow
                # and left out of the line: joined in, one seed's value looked like a turn of the mean.
                full = [(x, y) for x, y, p in zip(xs, ys, s["points"]) if p["seeds"] == most]
                partial = [(x, y) for x, y, p in zip(xs, ys, s["points"]) if p["seeds"] < most]
                seeds = f"{most} seed{'s' if most > 1 else ''}{'; hollow: fewer' if partial else ''}"
                # pooled directories ("a + b") one to a line: on one, the legend was wider than the panel
                directories = s["directory"].replace(" + ", " +\n")
                label = f"{s['steps']:,}-step runs ({directories}, {seeds})"
                if s.get("reference_steps") not in (None, s["steps"]):  # a compute-matched reference: not its end
                    label += f"\n{ref} trains {s['reference_steps']:,} steps: paired at equal steps only"
                ax.plot(*zip(*full), marker="o", markersize=3, color=f"C{i}", label=label)
                if partial:
                    ax.plot(*zip(*partial), linestyle="none", marker="o", markersize=5, markerfacecolor="none",
                            color=f"C{i}")
                if s["points"][-1]["step"] == s["steps"]:  # (paired to a shorter reference, the line ends before)
                    ax.plot(xs[-1:], ys[-1:], marker="D", markersize=8, color=f"C{i}")
            ax.axhline(0, color="black", linewidth=1)
            ax.set_xlabel(f"training tokens per parameter of {model}")
            ax.set_ylabel(f"validation loss (nats)\n{model} − {ref}")  # on one line, taller than the panel
            ax.set_title(f"{model} − {ref} (below 0: {model} better)", fontsize=11)
            ax.legend(loc="best", fontsize=9)
        # Two lines: on one, the title is wider than a one-panel figure and was cut at both ends.
        fig.suptitle("How the gap moves with training length\n(diamonds: end of each run's schedule)")
    return fig
