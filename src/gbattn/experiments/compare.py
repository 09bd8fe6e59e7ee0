"""``gbattn compare``: train every model of a recipe for every seed, skip finished runs, resume
killed ones, and write ``results.json`` and ``results.md`` (a table shaped like the paper's).

Layout: ``OUT/recipe.json`` (what was asked), ``OUT/<label>/seed<S>/`` (one run directory
each), ``OUT/results.json`` and ``OUT/results.md`` (rewritten after every finished run).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from gbattn.config import command_line
from gbattn.errors import UserError
from gbattn.experiments.recipes import ModelSpec, Recipe, get_recipe, training_order
from gbattn.model.params import count_params, flops_per_token, param_matched_width
from gbattn.progress import Progress
from gbattn.train import checkpoint as ckpt
from gbattn.train.config import build_configs
from gbattn.train.trainer import prepare_data, train


def spec_configs(recipe: Recipe, spec: ModelSpec, data: str, seed: int, sets: dict, vocab_size: int | None):
    """Model and training configs of one model of a recipe (before width/step matching)."""
    merged = dict(recipe.train)
    merged.update(sets)
    merged.update(spec.model)
    for key, value in spec.attn_options.items():
        merged[f"attn.{key}"] = value
    if vocab_size is not None:
        merged["vocab_size"] = vocab_size
    return build_configs(recipe.preset, spec.attn, data, merged, seed=seed)


def run_compare(recipe_name: str, out_dir: str | Path, data: str | None = None, seeds: list[int] | None = None,
                sets: dict | None = None, only: list[str] | None = None, quiet: bool = False,
                threads: int | None = None) -> dict:
    """``threads``: CPU threads of every run (not part of the comparison's identity: it changes
    speed, not results)."""
    recipe = get_recipe(recipe_name)
    data = data or recipe.default_data
    if not data:
        raise UserError(f"recipe {recipe.name!r} needs --data (see README, 'Reproducing the tables')")
    seeds = seeds or recipe.seeds
    sets = dict(sets or {})
    run_sets = {**sets, "threads": threads} if threads else sets
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    request = {"recipe": recipe.name, "data": data, "seeds": seeds, "sets": sets,
               "command": command_line()}
    _check_request(out / "recipe.json", request)

    specs = [s for s in recipe.models if not only or s.label in only]
    unknown = sorted(set(only or []) - {s.label for s in recipe.models})
    if unknown:
        raise UserError(f"--only {unknown}: not in recipe {recipe.name!r} ({', '.join(s.label for s in recipe.models)})")
    # The tokenizer fixes the vocabulary for every model (and warms the token cache once).
    probe_model, probe_train = spec_configs(recipe, specs[0], data, seeds[0], run_sets, None)
    vocab = prepare_data(probe_train, probe_model.vocab_size, progress=not quiet).tokenizer.vocab_size

    bar = Progress(len(specs) * len(seeds), desc=f"compare {recipe.name}", unit="run", disable=quiet, interval=0)
    results: dict[str, dict[int, dict]] = {s.label: {} for s in specs}
    for seed in seeds:
        for spec in training_order(specs):
            run_dir = out / spec.label / f"seed{seed}"
            if (run_dir / ckpt.RESULT).exists():
                results[spec.label][seed] = ckpt.read_json(run_dir / ckpt.RESULT)
                bar.update(1, last=f"{spec.label}/seed{seed} (done before)")
                continue
            model_cfg, train_cfg = _matched_configs(recipe, spec, data, seed, run_sets, vocab, results, out)
            resume = (run_dir / ckpt.CONFIG).exists()
            bar.write(f"{'resuming' if resume else 'training'} {spec.label} seed {seed}: attn={model_cfg.attn} "
                      f"d_model={model_cfg.d_model} steps={train_cfg.max_steps or 'epochs'} -> {run_dir}")
            extra = {"label": spec.label, "recipe": recipe.name}
            results[spec.label][seed] = (
                train(run_dir, resume=True, quiet=quiet) if resume
                else train(run_dir, model_cfg, train_cfg, quiet=quiet, extra=extra)
            )
            bar.update(1, last=f"{spec.label}/seed{seed}")
            write_results(out, recipe, request, specs, results)
    bar.close()
    return write_results(out, recipe, request, specs, results)


def _matched_configs(recipe, spec, data, seed, sets, vocab, results, out):
    model_cfg, train_cfg = spec_configs(recipe, spec, data, seed, sets, vocab)
    if spec.param_matched_to:
        ref = next(s for s in recipe.models if s.label == spec.param_matched_to)
        ref_model, _ = spec_configs(recipe, ref, data, seed, sets, vocab)
        width, _ = param_matched_width(model_cfg, count_params(ref_model))
        model_cfg = model_cfg.replace(d_model=width)
    if spec.compute_matched_to:
        ref_result = results.get(spec.compute_matched_to, {}).get(seed)
        if ref_result is None:
            path = out / spec.compute_matched_to / f"seed{seed}" / ckpt.RESULT
            if not path.exists():
                raise UserError(f"{spec.label} is matched to {spec.compute_matched_to}'s compute: run that model first")
            ref_result = ckpt.read_json(path)
        seq_len = train_cfg.seq_len or model_cfg.block_size - 1
        per_token = flops_per_token(model_cfg, seq_len=seq_len, backward=True)
        steps = round(ref_result["train_flops"] / (per_token * train_cfg.batch_size * seq_len))
        train_cfg = type(train_cfg).from_dict({**train_cfg.to_dict(), "max_steps": steps})
    return model_cfg, train_cfg


def _check_request(path: Path, request: dict) -> None:
    if path.exists():
        before = ckpt.read_json(path)
        for key in ("recipe", "data", "sets"):
            if before.get(key) != request[key]:
                raise UserError(
                    f"{path.parent} holds a comparison with {key}={before.get(key)!r}, not {request[key]!r}; "
                    f"use another --out or the same settings"
                )
        request["seeds"] = sorted(set(before.get("seeds", [])) | set(request["seeds"]))
    ckpt.atomic_json(request, path)


# --------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def aggregate(recipe: Recipe, specs: list[ModelSpec], results: dict) -> list[dict]:
    rows = []
    for spec in specs:
        runs = results.get(spec.label, {})
        if not runs:
            continue
        any_run = next(iter(runs.values()))
        test_mean, test_std = _mean_std([r["test_ppl"] for r in runs.values()])
        valid_mean, valid_std = _mean_std([r["valid_ppl"] for r in runs.values()])
        rows.append({
            "label": spec.label,
            "attn": any_run["attn"],
            "attn_options": any_run["attn_options"],
            "norm": any_run.get("norm", "pre"),
            "residual": any_run.get("residual", "plain"),
            "d_model": any_run["d_model"],
            "parameters": any_run["parameters"],
            "param_matched_to": spec.param_matched_to,
            "compute_matched_to": spec.compute_matched_to,
            "flops_per_token_train": any_run["flops_per_token_train"],
            "seeds": sorted(runs),
            "test_ppl": {str(s): r["test_ppl"] for s, r in sorted(runs.items())},
            "valid_ppl": {str(s): r["valid_ppl"] for s, r in sorted(runs.items())},
            "test_ppl_mean": test_mean, "test_ppl_std": test_std,
            "valid_ppl_mean": valid_mean, "valid_ppl_std": valid_std,
            "steps": any_run["steps"],
            "train_tokens": any_run["train_tokens_seen"],
            "tokens_per_parameter": any_run["tokens_per_parameter"],
            "train_flops": any_run["train_flops"],
            "wall_clock_s": statistics.fmean(r["wall_clock_s"] for r in runs.values()),
            "tokens_per_s": statistics.fmean(r["train_tokens_per_s"] for r in runs.values()),
            "device": any_run["device"],
            "curves": {str(s): r["curve"] for s, r in sorted(runs.items())},
            "published": recipe.published.get(spec.label),
        })
    return rows


def write_results(out: Path, recipe: Recipe, request: dict, specs: list[ModelSpec], results: dict) -> dict:
    rows = aggregate(recipe, specs, results)
    complete = all(len(results.get(s.label, {})) == len(request["seeds"]) for s in specs)
    report = {
        "recipe": recipe.name,
        "description": recipe.description,
        "preset": recipe.preset,
        "data": request["data"],
        "seeds": request["seeds"],
        "sets": request["sets"],
        "command": request.get("command", ""),
        "complete": complete,
        "published_source": recipe.published_source,
        "models": rows,
    }
    ckpt.atomic_json(report, out / "results.json")
    (out / "results.md").write_text(results_markdown(report), encoding="utf-8")
    return report


def _fmt(mean, std, digits=2) -> str:
    if mean is None:
        return "—"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def results_markdown(report: dict) -> str:
    rows = report["models"]
    base = next((r for r in rows if r["label"].startswith("standard")), None)
    lines = [
        f"# {report['recipe']}: {report['description']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Data: `{report['data']}` · seeds {', '.join(map(str, report['seeds']))} · hardware: "
        f"{rows[0]['device'] if rows else '—'}{'' if report['complete'] else ' · INCOMPLETE (runs missing)'}",
        "",
        "| model | attention | d | parameters | test ppl | Δ vs standard | valid ppl | published | steps | train tokens | "
        "tokens/param | train PFLOP | tokens/s | wall-clock |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        delta = "—"
        if base and r is not base and r["test_ppl_mean"] and base["test_ppl_mean"]:
            delta = f"{100 * (r['test_ppl_mean'] / base['test_ppl_mean'] - 1):+.1f}%"
        opts = ", ".join(f"{k}={v}" for k, v in r["attn_options"].items())
        attn = r["attn"] + (f" ({opts})" if opts else "")
        if r["norm"] != "pre":
            attn += ", Post-LN"
        if r["residual"] != "plain":
            attn += f", {r['residual']}"
        pub = r["published"]
        lines.append(
            f"| {r['label']} | {attn} | {r['d_model']} | {r['parameters']:,} | {_fmt(r['test_ppl_mean'], r['test_ppl_std'])} | "
            f"{delta} | {_fmt(r['valid_ppl_mean'], r['valid_ppl_std'])} | {_fmt(*pub) if pub else '—'} | {r['steps']:,} | "
            f"{r['train_tokens'] / 1e6:.2f}M | {r['tokens_per_parameter']:.3g} | {r['train_flops'] / 1e15:.3g} | "
            f"{r['tokens_per_s']:,.0f} | {r['wall_clock_s'] / 60:.1f} min |"
        )
    if report.get("published_source"):
        lines += ["", f"Published: {report['published_source']}."]
    lines += ["", "Test perplexity from the best-validation checkpoint; mean ± sample std over seeds.",
              "`param-fair`: the smallest standard width with at least GBA's parameters; `compute-matched`: standard "
              "trained for as many training FLOPs (torch.utils.flop_counter, forward + backward) as GBA used."]
    lines += ["", "## Validation perplexity during training (seed mean)", ""]
    steps = sorted({p["step"] for r in rows for c in r["curves"].values() for p in c})
    if steps:
        lines.append("| step | " + " | ".join(r["label"] for r in rows) + " |")
        lines.append("| ---: | " + " | ".join("---:" for _ in rows) + " |")
        for step in steps:
            cells = []
            for r in rows:
                vals = [p["valid_ppl"] for c in r["curves"].values() for p in c if p["step"] == step]
                cells.append(f"{statistics.fmean(vals):.2f}" if vals else "")
            lines.append(f"| {step:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
