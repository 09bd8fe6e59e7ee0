"""The synthetic task's tables and figure, and the run of every experiment (``gbattn denoise``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from gbattn.analysis.figures import require_matplotlib
from gbattn.errors import UserError
from gbattn.experiments.report import mean_std
from gbattn.files import write_figure, write_report
from gbattn.progress import Progress
from gbattn.rundir import DENOISE, RunLock, check_out
from gbattn.runtime import device_name, software_versions
from gbattn.synthetic.task import (
    DEQ_SETTINGS,
    DIFFICULTY_SETTINGS,
    PAPER,
    ROUNDS,
    ROUNDS_SETTING,
    Protocol,
    Setting,
    bayes_optimal_accuracy,
    make_patterns,
)
from gbattn.synthetic.training import (
    DEFAULT_GATE,
    EXPERIMENTS,
    GATES,
    RunSpec,
    boosted_run,
    experiment_runs,
    experiment_settings,
    train_run,
)

FULL_SEEDS = (0, 1, 2)
INIT_WORDS = {"pytorch": "PyTorch default nn.Linear init", "normal": "N(0, 0.02) Linear weights, zero biases"}
SECONDS_PER_RUN = 0.55  # measured: 72 runs of 150 steps in 37 s, 24 (--quick) in 14 s, one idle CPU thread


def duration_words(seconds: float) -> str:
    """``seconds`` as an estimate: "under 1 s", "about 15 s" or "about 3 min"."""
    return "under 1 s" if seconds < 1 else f"about {seconds:.0f} s" if seconds < 90 else f"about {seconds / 60:.0f} min"


def percent_cell(values: list[float]) -> dict:
    """A table cell: mean and sample std (:func:`gbattn.experiments.report.mean_std`) of the values
    in percent, and their count."""
    pct = [100 * v for v in values]
    mean, std = mean_std(pct)
    return {"mean": mean, "std": std, "n": len(pct)}


def fmt(cell: dict | float | None, digits: int = 1, sign: bool = False) -> str:
    if cell is None:
        return "—"
    if not isinstance(cell, dict):
        return f"{cell:{'+' if sign else ''}.{digits}f}"
    text = f"{cell['mean']:{'+' if sign else ''}.{digits}f}"
    return text + (f" ± {cell['std']:.{digits}f}" if cell.get("std") is not None else "")


def summarise(name: str, runs: dict, bayes: dict, seeds) -> dict:
    """One experiment's table data from the finished runs."""
    def acc(spec_list) -> dict:
        return percent_cell([runs[s.key]["accuracy"] for s in spec_list])

    def ceiling(st: Setting) -> dict:
        return {"chance": 100 * st.chance, "bayes": 100 * bayes[st.key]["accuracy"],
                "bayes_se": 100 * bayes[st.key]["stderr"]}

    if name == "rounds":
        rows = [{"rounds": m, "ours": acc([boosted_run(ROUNDS_SETTING, m, DEFAULT_GATE, s) for s in seeds]),
                 "paper_v1": PAPER["rounds_v1"][m], "paper_revision": PAPER["rounds_revision"][m]} for m in ROUNDS]
        return {"setting": asdict(ROUNDS_SETTING), "gate": DEFAULT_GATE, "rows": rows, **ceiling(ROUNDS_SETTING)}
    if name == "gates":
        rows = [{"gate": "baseline", "ours": acc([boosted_run(ROUNDS_SETTING, 1, None, s) for s in seeds]),
                 "paper_revision": PAPER["gates_revision"]["baseline"]}]
        rows += [{"gate": g, "ours": acc([boosted_run(ROUNDS_SETTING, 2, g, s) for s in seeds]),
                  "paper_revision": PAPER["gates_revision"].get(g)} for g in GATES]
        return {"setting": asdict(ROUNDS_SETTING), "rows": rows, **ceiling(ROUNDS_SETTING)}
    if name == "difficulty":
        columns = []
        for st in DIFFICULTY_SETTINGS:
            one = [runs[boosted_run(st, 1, None, s).key]["accuracy"] for s in seeds]
            two = [runs[boosted_run(st, 2, DEFAULT_GATE, s).key]["accuracy"] for s in seeds]
            columns.append({"setting": asdict(st), "key": st.key, "m1": percent_cell(one), "m2": percent_cell(two),
                            "delta": percent_cell([b - a for a, b in zip(one, two)]),  # paired by seed
                            "paper_delta": PAPER["difficulty_delta"][st.key], **ceiling(st)})
        return {"gate": DEFAULT_GATE, "columns": columns}
    if name == "deq":
        columns = []
        for st in DEQ_SETTINGS:
            deq = [runs[RunSpec(st, kind="deq", seed=s).key] for s in seeds]
            columns.append({"setting": asdict(st), "key": st.key,
                            "one_step": acc([boosted_run(st, 1, None, s) for s in seeds]),
                            "converged": percent_cell([r["accuracy"] for r in deq]),
                            "paper_one_step": PAPER["deq_one_step"][st.key],
                            "paper_converged": PAPER["deq_converged"][st.key],
                            "residual_max": max(r["fixed_point"]["residual_max"] for r in deq),
                            "residual_mean": statistics.fmean(r["fixed_point"]["residual_mean"] for r in deq),
                            "converged_fraction": min(r["fixed_point"]["converged"] for r in deq),
                            "iterations_max": max(r["fixed_point"]["iterations"] for r in deq), **ceiling(st)})
        return {"columns": columns}
    raise ValueError(name)


def seeds_text(n: int) -> str:
    return f"{n} seed{'s' if n > 1 else ''}"


def ours_label(n_seeds: int) -> str:
    """Our column's name: one seed has a value, not a mean and a spread."""
    return f"ours (mean ± std, {seeds_text(n_seeds)})" if n_seeds > 1 else "ours (1 seed)"


def chance_cell(percent: float) -> str:
    return f"{round(percent, 2):g}"  # 6.25, 12.5, 25, 3.12


def bayes_cell(table: dict) -> str:
    return f"{table['bayes']:.1f} ± {table['bayes_se']:.1f} (MC s.e.)"


def row(label: str, cells: list[str]) -> str:
    """One Markdown table row."""
    return f"| {label} | " + " | ".join(cells) + " |"


def paper_omitted_note(protocol: dict) -> str | None:
    """Why the paper's numbers are left out of the tables and figure, or None when the runs trained for
    the paper's 150 steps (a shorter or longer run is not what the published accuracies are for)."""
    paper_steps = Protocol().steps
    if protocol["steps"] == paper_steps:
        return None
    steps = f"{protocol['steps']:,} step{'s' if protocol['steps'] != 1 else ''}"  # ("1 steps")
    return (f"Paper numbers omitted: these runs trained for {steps}, not the {paper_steps} the paper's accuracies "
            f"are for.")


def table_markdown(name: str, table: dict, n_seeds: int, published: bool = True) -> str:
    """The Markdown table of one experiment, ours beside the paper's (its cells "—" when not
    ``published``: runs of another length, :func:`paper_omitted_note`)."""
    ours = ours_label(n_seeds)

    def paper(value, **kwargs) -> str:
        return fmt(value, **kwargs) if published else "—"

    if name == "rounds":
        lines = [f"### Accuracy vs rounds M (d=64, K=16, sigma=0.5, gate {table['gate']}), accuracy %", "",
                 f"| rounds M | {ours} | paper v1 | paper revision |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['rounds']} | {fmt(r['ours'])} | {paper(r['paper_v1'])} | {paper(r['paper_revision'])} |"
                  for r in table["rows"]]
        chance, ceiling = chance_cell(table["chance"]), paper(PAPER["bayes_revision"])
        lines += [f"| chance (1/K) | {chance} | {chance} | {chance} |",
                  f"| Bayes-optimal (nearest true pattern) | {bayes_cell(table)} | — | {ceiling} |"]
    elif name == "gates":
        lines = ["### Gate ablation at M = 2 (d=64, K=16, sigma=0.5), accuracy %", "",
                 f"| gate | {ours} | paper revision |", "| --- | ---: | ---: |"]
        for r in table["rows"]:
            label = "one-round baseline (M = 1)" if r["gate"] == "baseline" else r["gate"]
            lines.append(f"| {label} | {fmt(r['ours'])} | {paper(r['paper_revision'])} |")
        lines += [f"| chance (1/K) | {chance_cell(table['chance'])} | {chance_cell(table['chance'])} |",
                  f"| Bayes-optimal (nearest true pattern) | {bayes_cell(table)} | {paper(PAPER['bayes_revision'])} |"]
    elif name == "difficulty":
        cols = table["columns"]
        head = " | ".join(Setting(**c["setting"]).label for c in cols)
        lines = [f"### Difficulty scaling: M = 2 (gate {table['gate']}) vs M = 1, accuracy %", "",
                 f"| | {head} |", "| --- |" + " ---: |" * len(cols),
                 row(f"M = 1, {ours}", [fmt(c["m1"]) for c in cols]),
                 row(f"M = 2, {ours}", [fmt(c["m2"]) for c in cols]),
                 row("gain M = 2 − M = 1, ours (points)", [fmt(c["delta"], sign=True) for c in cols]),
                 row("gain, paper (points)", [paper(c["paper_delta"], sign=True) for c in cols]),
                 row("chance (1/K)", [chance_cell(c["chance"]) for c in cols]),
                 row("Bayes-optimal (nearest true pattern)", [bayes_cell(c) for c in cols])]
    elif name == "deq":
        cols = table["columns"]
        lines = ["### One trained attention step vs the same attention iterated to its fixed point (DEQ), accuracy %",
                 "", row("d, K", [f"{c['setting']['d']}, {c['setting']['K']}" for c in cols]),
                 "| --- |" + " ---: |" * len(cols),
                 row("sigma", [f"{c['setting']['sigma']}" for c in cols]),
                 row(f"one step (trained), {ours}", [fmt(c["one_step"]) for c in cols]),
                 row("one step (trained), paper", [paper(c["paper_one_step"]) for c in cols]),
                 row(f"converged (trained DEQ), {ours}", [fmt(c["converged"]) for c in cols]),
                 row("converged (trained DEQ), paper", [paper(c["paper_converged"]) for c in cols]),
                 row("max residual ‖f(z*) − z*‖ (ours)", [f"{c['residual_max']:.1e}" for c in cols]),
                 row("max forward iterations (ours)", [str(c["iterations_max"]) for c in cols]),
                 row("queries converged within tolerance (ours, fewest of any seed), %",
                     [f"{100 * c['converged_fraction']:g}" for c in cols]),
                 row("chance (1/K)", [chance_cell(c["chance"]) for c in cols]),
                 row("Bayes-optimal (nearest true pattern)", [bayes_cell(c) for c in cols])]
        if any(c["converged_fraction"] < 1 for c in cols):  # the "converged" row then holds last iterates
            lines += ["", "Not every query reached the fixed point's tolerance: the \"converged\" accuracies of those "
                      "settings are of the last iterate (raise --deq-max-iter)."]
    else:
        raise ValueError(name)
    return "\n".join(lines)


def plot_rounds(table: dict, path: Path, steps: int, published: bool = True) -> None:
    """Accuracy vs rounds with error bars (std over seeds), the paper's rows (when ``published``: runs of the
    paper's length), chance and Bayes-optimal; the title names the ``steps`` each run trained for."""
    require_matplotlib().use("Agg")
    import matplotlib.pyplot as plt

    rows = table["rows"]
    rounds = [r["rounds"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    stds = [r["ours"]["std"] for r in rows]  # None of one seed: no bar (a zero-length one drew caps, as a std of 0)
    ax.errorbar(rounds, [r["ours"]["mean"] for r in rows],
                yerr=None if all(std is None for std in stds) else [std or 0.0 for std in stds],
                marker="o", capsize=4, label=ours_label(rows[0]["ours"]["n"]))
    if published:
        ax.plot(rounds, [r["paper_revision"] for r in rows], "s--", alpha=0.7, label="paper (revision)")
        ax.plot(rounds, [r["paper_v1"] for r in rows], "^:", alpha=0.7, label="paper (v1)")
    ax.axhline(table["bayes"], color="black", linestyle="-", linewidth=1,
               label=f"Bayes-optimal ({table['bayes']:.1f}%)")
    ax.axhline(table["chance"], color="grey", linestyle="--", linewidth=1,
               label=f"chance 1/K ({chance_cell(table['chance'])}%)")
    ax.set_xticks(rounds)
    ax.set_xlabel("attention rounds M (count)")
    ax.set_ylabel("denoising accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Pattern denoising: accuracy vs rounds\n(d=64, K=16, σ=0.5; {steps:,} training steps per run)")
    ax.legend(fontsize=8, loc="best")  # "lower right" hid the points of a short run (accuracies near 20%)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


def run_denoise(out_dir: str | Path, experiments=EXPERIMENTS, seeds=FULL_SEEDS, protocol: Protocol | None = None,
                device: str = "cpu", quiet: bool = False, command: str = "") -> dict:
    """Train every run the experiments need, print each table when its runs are done, and write
    ``results.json``, ``results.md`` and (with ``rounds``) ``rounds.png`` into ``out_dir``: its one writer,
    holding its lock (:class:`gbattn.rundir.RunLock`, as ``gbattn compare`` does) from before any work to the end."""
    held = check_out(out_dir, (DENOISE,), "a `gbattn denoise` output")  # a comparison, a run, other results: refused
    if held is None and (Path(out_dir) / "rounds.png").is_file():  # a user's figure: replaced or deleted below
        raise UserError(f"--out {out_dir} holds a rounds.png without the results.json gbattn denoise writes beside it, "
                        f"not a `gbattn denoise` output: choose another --out")
    with RunLock(out_dir, what="`gbattn denoise` output"):
        return write_tables(Path(out_dir), experiments, seeds, protocol or Protocol(), device, quiet, command)


def write_tables(out: Path, experiments, seeds, protocol: Protocol, device: str, quiet: bool, command: str) -> dict:
    """:func:`run_denoise`'s work, in ``out`` whose lock is held."""
    seeds = list(dict.fromkeys(seeds))  # each once, in the order given: a repeat is not another replicate
    experiments = list(dict.fromkeys(experiments))  # each table once (results.json counts those asked)
    started = time.perf_counter()
    if "rounds" in experiments:  # the rounds figure: fail before training
        require_matplotlib()
    for name in ("results.json", "results.md") + (("rounds.png",) if "rounds" in experiments else ()):
        if (out / name).is_dir() and not (out / name).is_symlink():  # replacing it failed after the first table
            raise UserError(f"--out {out}: {name} there is a directory, where gbattn denoise writes its {name}; "
                            "remove it or use another --out")
    plans = {name: experiment_runs(name, seeds) for name in experiments}
    todo = list(dict.fromkeys(spec for specs in plans.values() for spec in specs))
    settings = list(dict.fromkeys(st for name in experiments for st in experiment_settings(name)))
    bar = Progress(len(todo), desc="denoise", unit="run", disable=quiet, interval=10)
    bar.write(f"gbattn denoise: {len(todo)} training runs ({', '.join(experiments)}; seeds {list(seeds)}; "
              f"{protocol.steps} steps each; device {device}; torch threads {torch.get_num_threads()}); "
              f"{duration_words(len(todo) * SECONDS_PER_RUN * protocol.steps / 150)} on one idle CPU thread")

    omitted = paper_omitted_note(asdict(protocol))
    published = omitted is None
    if omitted:
        print(omitted + "\n", flush=True)  # beside the tables, which --quiet prints too
    bayes = {}
    for st in settings:
        acc, se = bayes_optimal_accuracy(make_patterns(st, protocol.pattern_seed), st.sigma, protocol.bayes_queries)
        bayes[st.key] = {"accuracy": acc, "stderr": se, "queries": protocol.bayes_queries}

    report = {"command": command, "versions": software_versions(), "protocol": asdict(protocol),
              "eval_steps": protocol.eval_steps, "seeds": list(seeds), "device": device,
              "hardware": device_name(torch.device(device)), "torch_threads": torch.get_num_threads(),
              "init": f"{INIT_WORDS[protocol.init]}; log beta = log {protocol.beta_init}", "bayes": bayes,
              "paper": PAPER, "tables": {}, "markdown": {}, "runs": {}, "experiments": list(experiments),
              "finished": False}
    runs, drawn = report["runs"], False
    for name, specs in plans.items():
        for spec in specs:
            if spec.key in runs:
                continue
            runs[spec.key] = train_run(spec, protocol, device)
            bar.update(1, last=f"{spec.key} {100 * runs[spec.key]['accuracy']:.1f}%")
        report["tables"][name] = summarise(name, runs, bayes, seeds)
        report["markdown"][name] = table_markdown(name, report["tables"][name], len(seeds), published)
        bar.write("")
        print(report["markdown"][name] + "\n", flush=True)
        # An earlier call's figure goes before this call's first tables are written, and this call's figure is drawn
        # after the tables that hold it: a call stopped in between leaves its tables without a figure, never beside
        # another call's (drawn first, a call stopped before its tables left its figure beside the earlier tables).
        if not drawn and (out / "rounds.png").is_file():  # (never a PDF: denoise writes none)
            (out / "rounds.png").unlink()
        report["wall_seconds"] = time.perf_counter() - started
        write_results(out, report)
        if name == "rounds":
            plot_rounds(report["tables"]["rounds"], out / "rounds.png", protocol.steps, published)
            drawn = True
    bar.close()
    report["wall_seconds"] = time.perf_counter() - started
    report["finished"] = True
    write_results(out, report)
    return report


def write_results(out: Path, report: dict) -> None:
    write_report(out / "results.json", report, results_markdown(report))


def software_words(report: dict) -> str:
    """" · gbattn VERSION · torch VERSION · Python VERSION · HARDWARE": what produced the results
    (nothing for results written before they recorded it)."""
    versions = report.get("versions")
    if not versions:
        return ""
    return (f" · gbattn {versions['gbattn']} · torch {versions['torch']} · Python {versions['python']} · "
            f"{report['hardware']}")


def results_markdown(report: dict) -> str:
    p = report["protocol"]
    lines = ["# Synthetic pattern denoising (docs/method.md §9)", "",
             f"Command: `{report['command']}`  ",
             f"Seeds {', '.join(map(str, report['seeds']))} · {p['steps']} steps of {p['batch']} fresh queries · "
             f"best of evaluations at steps {', '.join(map(str, report['eval_steps']))} on {p['eval_queries']:,} "
             f"fresh queries · patterns seed {p['pattern_seed']} · device {report['device']} · "
             f"wall-clock {report.get('wall_seconds', 0) / 60:.1f} min" + software_words(report), ""]
    default = Protocol()  # (results written before the protocol named its init: PyTorch's, the default)
    if (p.get("init", default.init), p["deq_tol"], p["deq_max_iter"]) != (default.init, default.deq_tol,
                                                                          default.deq_max_iter):
        lines += [f"Not the defaults: initialisation {report['init']}; DEQ solver to relative residual "
                  f"{p['deq_tol']:g}, at most {p['deq_max_iter']:,} iterations (docs/deviations.md, entry 18).", ""]
    # Written after each table (the rounds figure with its table): a stopped run leaves the tables it finished.
    missing = [] if report.get("finished", True) else [name for name in report["experiments"]
                                                       if name not in report["tables"]]
    if missing:
        done, asked = len(report["tables"]), len(report["experiments"])
        lines += [f"**Unfinished**: {done} of {asked} tables ({', '.join(missing)} not yet run): the run was stopped, "
                  f"or is still running; run the command again for all of them.", ""]
    omitted = paper_omitted_note(p)
    if omitted:
        lines += [omitted, ""]
    for text in report["markdown"].values():
        lines += [text, ""]
    n = len(report["eval_steps"])  # three, but fewer for --steps 1 or 2
    evaluations = {1: "the one evaluation", 2: "the better of two evaluations",
                   3: "the best of three evaluations"}.get(n, f"the best of {n} evaluations")
    lines += ["Bayes-optimal: the nearest true pattern to the noisy query (Monte Carlo, "
              f"{p['bayes_queries']:,} queries); no model can beat it except by evaluation noise "
              f"({evaluations} on fresh queries is reported, "
              f"{'as the authors do' if n == 3 else 'where the authors report the best of three'}).", ""]
    return "\n".join(lines)
