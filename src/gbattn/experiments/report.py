"""What a comparison reports: ``results.json`` and ``results.md`` from the finished runs, and the
like-with-like rules the table and the results chart share (docs/baselines.md, "Comparison rules"):
means over the seeds every model has, paired per-seed differences, and published numbers only for
runs as long as the published ones."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from pathlib import Path

from gbattn.checks import is_count
from gbattn.errors import CheckpointError
from gbattn.experiments.recipes import ModelSpec, Recipe, added_models_problem
from gbattn.files import read_json, write_report
from gbattn.terminal import in_millions, printable_text

# Like with like: results.json rows can hold different seeds (a budget that ran out) and runs
# shorter than the published ones (--set max_steps=...). results.md uses these rules too. These keys
# name an override "length or schedule"; any other training override that changes a result is a "setting".

TRAINING_LENGTH_KEYS = ("max_steps", "epochs", "batch_size", "seq_len", "lr", "warmup_steps")


def seed_key(seed: str):
    """Sort key of a results.json seed ("42", "123"): numeric when it is a number."""
    return (0, int(seed), "") if str(seed).lstrip("-").isdigit() else (1, 0, str(seed))


def seed_values(row: dict) -> dict[str, float]:
    """seed -> test perplexity of a results.json model row (finite values only)."""
    values = row.get("test_ppl") or {}
    return {str(s): v for s, v in values.items() if v is not None and math.isfinite(v)}


def held_seeds(rows: list[dict]) -> list[str]:
    """Every seed some model row has a result of, in order."""
    return sorted({s for r in rows for s in seed_values(r)}, key=seed_key)


def diverged_seeds(row: dict) -> list[str]:
    """The seeds a model row finished with no finite test perplexity (diverged), in order."""
    finite = seed_values(row)
    return [str(s) for s in row.get("seeds", []) if str(s) not in finite]


def diverged_note(rows: list[dict], held_note: str | None = None) -> str | None:
    """Which models' seeds diverged (finished with no finite test perplexity), left out of every mean, Δ and paired
    difference (a model none of whose seeds held a result was unexplained, and the others' seeds were said to be
    every model's); None where none did, or where ``held_note`` (:func:`seeds_held_note`) already says it of every
    model."""
    if held_note and "diverged" in held_note and all(seed_values(r) for r in rows):
        return None
    named = [f"{r['label']} seed{'s' if len(d) > 1 else ''} {', '.join(d)}" for r in rows if (d := diverged_seeds(r))]
    if not named:
        return None
    return ("Diverged, with no finite test perplexity, and left out of the means, Δ and paired differences: "
            + "; ".join(named))


def common_seeds(rows: list[dict]) -> list[str] | None:
    """None when every row with a result has the same seeds; else the seeds all of them share
    (possibly none)."""
    seed_sets = [set(seed_values(r)) for r in rows if seed_values(r)]
    if not seed_sets or all(s == seed_sets[0] for s in seed_sets):
        return None
    return sorted(set.intersection(*seed_sets), key=seed_key)


def compared_values(rows: list[dict]) -> dict[str, dict[str, float]]:
    """label -> the per-seed values each model is shown with: the seeds all models share when
    their seed sets differ and some seed is shared; otherwise every seed of the model."""
    common = common_seeds(rows)
    compared = {}
    for r in rows:
        values = seed_values(r)
        compared[r["label"]] = {s: values[s] for s in common} if common and values else values
    return compared


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1; None for one value) of the finite values: None and
    non-finite values (a run that diverged) are left out; (None, None) when none is left."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def relative_change(values: dict[str, float], base_values: dict[str, float]) -> float | None:
    """mean(values) / mean(base) - 1 over the seeds both have; None when they share none."""
    shared = set(values) & set(base_values)
    if not shared:
        return None
    return statistics.fmean(values[s] for s in shared) / statistics.fmean(base_values[s] for s in shared) - 1


def seeds_sentence(rows: list[dict], complete: bool = True) -> str:
    """Which seeds the means (and Δ vs standard) are over, in words (of the models drawn, when the comparison is
    not ``complete``)."""
    common = common_seeds(rows)
    if common is None:
        seeds = held_seeds(rows)
        if not seeds:
            return "no model has a finite test perplexity"
        every = "every model" + ("" if complete else " drawn")
        if any(not seed_values(r) for r in rows):  # (a model with no finite result: not "every model")
            every += " with a finite result"
        return f"means over seed{'s' if len(seeds) != 1 else ''} {', '.join(seeds)} ({every})"
    if common:
        return (f"means over the {len(common)} seed{'s' if len(common) > 1 else ''} all models share "
                f"({', '.join(common)}); 'all seeds' dots show the rest")
    return "means over different seeds (no seed is shared by all models); Δ vs standard over the seeds both share"


def seeds_held_note(report: dict, rows: list[dict]) -> str | None:
    """When every model has the same seeds but not all those the comparison asked for: which, and why the others
    have no result (results.md and results.png say it alike)."""
    if common_seeds(rows) is not None:
        return None
    held = held_seeds(rows)
    missing = [str(s) for s in report.get("seeds", []) if str(s) not in held]
    if not (held and missing):
        return None
    # A seed every model finished has no result where its runs diverged (no finite perplexity); "not
    # finished" is said of the seeds some model's row lacks.
    diverged = [s for s in missing if all(s in map(str, r.get("seeds", [])) for r in rows)]
    why = "; ".join(f"seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)} {what}" for seeds, what in (
        ([s for s in missing if s not in diverged], "not finished"),
        (diverged, "diverged, with no finite perplexity")) if seeds)
    # (a model with no finite result at all: diverged_note names it; "every model" was said of the others)
    who = "Every model" if all(seed_values(r) for r in rows) else "Every model with a finite result"
    return (f"{who} has seed{'s' if len(held) > 1 else ''} {', '.join(held)} only ({why}): each "
            f"mean is over {len(held)} seed{'s' if len(held) > 1 else ''}")


def described_steps(description: str) -> int | None:
    """The step count a recipe description mentions ("... (2,000 steps)"), or None."""
    found = re.search(r"(\d[\d,]*) steps", description or "")
    return int(found.group(1).replace(",", "")) if found else None


def result_overrides(report: dict) -> dict:
    """The report's ``--set`` training values that change a result: every training field but the
    result-neutral ones (``TrainConfig.RESULT_NEUTRAL``): the length and schedule, and also the data
    (tokenizer, train_tokens, eval_tokens, split, ...) and the optimizer, any of which makes the runs
    another setting than a published number's."""
    from gbattn.config import TrainConfig

    changing = set(TrainConfig.field_names()) - set(TrainConfig.RESULT_NEUTRAL)
    return {k: v for k, v in changed_sets(report).items() if k in changing}


def changed_sets(report: dict) -> dict:
    """The report's ``--set`` values other than its recipe's own (its training settings, then its preset's, then the
    config defaults, as :func:`gbattn.config.build_configs` builds them): ``--set max_steps=2000`` on a 2,000-step
    recipe changes nothing, where it withheld the published numbers as an override. Every one where the recipe is not
    known, and one the configs refuse (the recipe's own value builds)."""
    from gbattn.config import build_configs, field_path
    from gbattn.errors import ConfigError
    from gbattn.experiments.recipes import RECIPES

    sets = report.get("sets") or {}
    recipe = RECIPES.get(report.get("recipe"))
    if recipe is None:
        return dict(sets)

    def fields(extra: dict) -> dict:
        """The recipe's model (its defaults spelt out: final_norm=true is a Pre-LN model's own) and training fields
        with ``extra`` set."""
        model_cfg, train_cfg = build_configs(recipe.preset, "standard", str(report.get("data")),
                                             {**recipe.train, **extra})
        return {**model_cfg.resolved().to_dict(), **train_cfg.to_dict()}

    def field(found: dict, key: str):
        """The value of the field ``key`` names (``attn.x``: an attention option), a KeyError where none is."""
        for part in field_path(key).split("."):
            if not isinstance(found, dict):
                raise KeyError(part)
            found = found[part]
        return found

    own = fields({})
    changed = {}
    for key, given in sets.items():
        try:
            same = field(fields({key: given}), key) == field(own, key)
        except (ConfigError, KeyError):
            same = False
        if not same:
            changed[key] = given
    return changed


def _corpus_names(data: str) -> list[str]:
    """Each folder or file of a --data value, in order, as a corpus name (``-raw`` and ``-vN`` dropped)."""
    parts = [p for p in Path(data).parts if p not in (".", "..", "/")] or [data]
    return [re.sub(r"(-raw)?(-v\d+)?$", "", p) for p in parts]


def wall_clock_text(seconds: float) -> str:
    """Minutes to one decimal from half a minute; seconds below it (a short comparison's every row said "0.0 min",
    and 3.1 s would read "0.1 min": 6 s)."""
    return f"{seconds / 60:.1f} min" if seconds >= 30 else f"{seconds:.1f} s"


def corpus_family(data: str) -> str:
    """The corpus a --data value names, for telling corpora apart: a local copy's folder or a file in
    it and the Hugging Face name alike (``wikitext-103``, ``wikitext-103-raw-v1``,
    ``wikitext-103/wiki.train.tokens``; ``tiny-shakespeare/input.txt``)."""
    return _corpus_names(data)[0]


def corpus_families(data: str) -> set[str]:
    """The corpora a --data value may name, one per folder or file in it: a local copy inside another
    folder (``data/wikitext-103``, ``corpora/tiny-shakespeare/input.txt``) names its corpus too."""
    return set(_corpus_names(data))


def other_setting(report: dict) -> str | None:
    """Why the runs are not the published ones' setting, or None: data other than the recipe's
    (e.g. WikiText-2 for a WikiText-103 recipe), or ``--set`` values that change the model."""
    from gbattn.config import ModelConfig
    from gbattn.experiments.recipes import RECIPES
    from gbattn.files import portable_path

    recipe = RECIPES.get(report.get("recipe"))
    if recipe is not None and recipe.default_data and (corpus_family(portable_path(recipe.default_data))
                                                       not in corpus_families(str(report.get("data")))):
        return f"these runs trained on {report.get('data')}, not {recipe.default_data}"
    model_fields = set(ModelConfig.__dataclass_fields__)
    changed = {k: v for k, v in changed_sets(report).items() if k.split(".")[0] in model_fields
               or k.startswith("attn.")}
    if changed:
        return "this comparison changes the model (" + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")"
    return None


def published_value(report: dict, row: dict):
    """The row's published (mean, std), or None when the runs are not what the published number is
    for: other data or another model (:func:`other_setting`), ``sets`` overriding a training field that
    is not result-neutral (:func:`result_overrides`), or a recipe description naming a step count other
    than the row's ``steps``."""
    pub = row.get("published")
    if not pub or pub[0] is None or result_overrides(report) or other_setting(report):
        return None
    described = described_steps(report.get("description", ""))
    return None if described is not None and row.get("steps") != described else pub


def published_omitted_note(report: dict) -> str | None:
    """A line saying why published numbers are left out, or None when none is."""
    rows = report.get("models", [])
    if not any(r.get("published") and r["published"][0] is not None and published_value(report, r) is None
               for r in rows):
        return None
    overrides, other = result_overrides(report), other_setting(report)
    if other:
        return f"published numbers omitted: {other}"
    if overrides:
        what = ("length" if set(overrides) <= {"max_steps", "epochs", "batch_size", "seq_len"} else
                "length or schedule" if set(overrides) <= set(TRAINING_LENGTH_KEYS) else "settings")
        return (f"published numbers omitted: this comparison overrides the recipe's training {what} "
                f"({', '.join(f'{k}={v}' for k, v in overrides.items())})")
    return (f"published numbers omitted: these runs trained for {run_steps_text(rows)}, not the "
            f"{described_steps(report.get('description', '')):,} steps the published numbers are for")


def run_steps_text(rows: list[dict]) -> str:
    """The rows' training steps in words: "200 steps, compute-matched 291"."""
    plain = sorted({r["steps"] for r in rows if r.get("steps") and not r.get("compute_matched_to")})
    matched = sorted({r["steps"] for r in rows if r.get("steps") and r.get("compute_matched_to")})
    if not plain and not matched:
        return "steps unknown"
    text = " / ".join(f"{s:,}" for s in plain or matched) + (" step" if (plain or matched) == [1] else " steps")
    if plain and matched:
        text += ", compute-matched " + " / ".join(f"{s:,}" for s in matched)
    return text


def devices_text(rows: list[dict]) -> str:
    """The devices the rows' runs ran on, each named once, in order of appearance ("—" for none)."""
    return "; ".join(dict.fromkeys(printable_text(d) for r in rows for d in r["device"].split("; "))) or "—"


def steps_differ_from_description(report: dict) -> bool:
    """True when the description names no step count, or one other than the rows' (compute-
    matched rows aside): the heading then states the steps of this run."""
    rows = [r for r in report.get("models", []) if r.get("steps")]
    if not rows:
        return False
    described = described_steps(report.get("description", ""))
    plain = {r["steps"] for r in rows if not r.get("compute_matched_to")}
    return described is None or plain != {described}


# --------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------


# The model fields results.md shows in their own way (Post-LN, the residual stream, the d column); a recipe entry's
# other model fields are shown after its attention options.
SHOWN_MODEL_FIELDS = ("norm", "residual", "d_model")


def model_options(report: dict, row: dict) -> dict:
    """A row's model fields beyond its attention that results.md shows after it: recorded with the row, or, in a report
    written before they were (no such field), those its recipe's own model of that label sets (cpu-baselines'
    differential-no-attn-bias, attn_bias=False, read as plain differential)."""
    from gbattn.experiments.recipes import RECIPES

    if "model_options" in row:
        return row["model_options"]
    recipe = RECIPES.get(report.get("recipe"))
    spec = next((s for s in recipe.models if s.label == row["label"]), None) if recipe else None
    return spec_model_options(spec) if spec else {}


def spec_model_options(spec: ModelSpec) -> dict:
    """A recipe entry's model fields that results.md shows after its attention (not :data:`SHOWN_MODEL_FIELDS`)."""
    return {k: v for k, v in spec.model.items() if k not in SHOWN_MODEL_FIELDS}


def aggregate(recipe: Recipe, specs: list[ModelSpec], results: dict) -> list[dict]:
    rows = []
    for spec in specs:
        runs = results.get(spec.label, {})
        if not runs:
            continue
        any_run = next(iter(runs.values()))
        test_mean, test_std = mean_std([r["test_ppl"] for r in runs.values()])
        # over the seeds with a test perplexity, as every other column: a seed that diverged (its test null, its
        # best validation finite below 50 nats) was in this mean alone, beside a note saying it was left out
        finished = [r for r in runs.values() if r["test_ppl"] is not None and math.isfinite(r["test_ppl"])]
        valid_mean, valid_std = mean_std([r["valid_ppl"] for r in finished])
        rows.append({
            "label": spec.label,
            "attn": any_run["attn"],
            "attn_options": any_run["attn_options"],
            "norm": any_run.get("norm", "pre"),
            "residual": any_run.get("residual", "plain"),
            # the entry's other model fields (`--model gba-m3=boosted:rounds=3,ffn=swiglu`'s ffn): the attention
            # column showed `boosted (rounds=3)` alone, as if the row were the recipe's own block
            "model_options": spec_model_options(spec),
            "d_model": any_run["d_model"],
            "parameters": any_run["parameters"],
            "param_matched_to": spec.param_matched_to,
            "compute_matched_to": spec.compute_matched_to,
            "init_from": spec.init_from,
            "flops_per_token_train": any_run["flops_per_token_train"],
            "seeds": sorted(runs),
            "test_ppl": {str(s): r["test_ppl"] for s, r in sorted(runs.items())},
            "valid_ppl": {str(s): r["valid_ppl"] for s, r in sorted(runs.items())},
            "valid_loss": {str(s): r["valid_loss"] for s, r in sorted(runs.items())},
            "test_ppl_mean": test_mean, "test_ppl_std": test_std,
            "valid_ppl_mean": valid_mean, "valid_ppl_std": valid_std,
            "steps": any_run["steps"],
            "train_tokens": any_run["train_tokens_seen"],
            "tokens_per_parameter": any_run["tokens_per_parameter"],
            "train_flops": any_run["train_flops"],
            "wall_clock_s": statistics.fmean(r["wall_clock_s"] for r in runs.values()),
            "tokens_per_s": statistics.fmean(r["train_tokens_per_s"] for r in runs.values()),
            "compiled": any(r.get("compiled", False) for r in runs.values()),  # (None: a run from before it was kept)
            # each device once (a resumed run's names every leg of it: "A; B" beside "A" named A twice)
            "device": devices_text([{"device": r["device"]} for r in runs.values()]),
            "curves": {str(s): r["curve"] for s, r in sorted(runs.items())},
            "published": recipe.published.get(spec.label),
        })
    return rows


def is_number(value) -> bool:
    """A JSON number the report can compute with: an int (not a bool) or a float, that fits a float (a 400-digit
    integer does not: float() of it is an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


# The finite values gbattn writes (it writes null for any other; a larger one overflowed a mean, a paired difference or
# a figure's axis): a perplexity is infinite from a loss of 50 nats (gbattn.eval.perplexity.perplexity), and a loss,
# cross-entropy computed in float32 (lm_loss), is infinite beyond the largest float32.
MAX_PERPLEXITY = math.exp(50)
MAX_LOSS = 3.4028234663852886e38
PERPLEXITY_RANGE = "above 0 and at most e^50; gbattn writes null from a loss of 50 nats"
LOSS_RANGE = "from 0 to 3.4e38, the largest float32; gbattn writes null beyond"


def is_perplexity(value) -> bool:
    """A finite perplexity as gbattn writes one (:data:`PERPLEXITY_RANGE`)."""
    return is_number(value) and 0 < value <= MAX_PERPLEXITY


def is_loss(value) -> bool:
    """A finite loss as gbattn writes one (:data:`LOSS_RANGE`)."""
    return is_number(value) and 0 <= value <= MAX_LOSS


def curve_out_of_range(curve: list[dict]) -> str | None:
    """The first value of a validation curve (:func:`gbattn.rundir.valid_curve`) that no run writes, in words
    ("valid_ppl=0 at step 2, which must be ..."), or None."""
    for point in curve:
        for key, fits, what in (("valid_loss", is_loss, f"a loss (a number {LOSS_RANGE})"),
                                ("valid_ppl", is_perplexity, f"a perplexity (a number {PERPLEXITY_RANGE})")):
            if point.get(key) is not None and not fits(point[key]):
                return f"{key}={point[key]!r} at step {point['step']}, which must be {what}"
    return None


def read_report(path: str | Path) -> dict:
    """A comparison's ``results.json`` with what the figures and gaps read checked: a damaged file is
    one line (:class:`CheckpointError`) naming the file and the field."""
    from gbattn.rundir import valid_curve

    report = read_json(path)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path} is damaged: {what}; rerun `gbattn compare` with the same arguments to "
                               f"write it again")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if "models" not in report:
        raise CheckpointError(f"{path} is not the results.json of a `gbattn compare` directory (it has no models)")
    rows = report.get("models")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise bad("models must be a list of rows")
    for r in rows:
        label = r.get("label")
        if not isinstance(label, str):
            raise bad(f"a row has label={label!r}")
        if label in ("", ".", "..") or "/" in label or "\\" in label:  # LABEL/seedS/ is read: never outside
            raise bad(f"a row has label={label!r}, not the name of a folder in the comparison")
        for key in ("parameters", "steps"):  # plot --gap divides by the parameters
            if not (is_int(r.get(key)) and is_number(r[key])) or r[key] < 1:
                raise bad(f"{label}: {key}={r.get(key)!r} must be an integer >= 1")
        if not isinstance(r.get("seeds"), list) or not all(is_int(s) for s in r["seeds"]):
            raise bad(f"{label}: seeds={r.get('seeds')!r} must be a list of integers")
        for key in ("test_ppl", "valid_ppl", "valid_loss"):
            values = r.get(key, {})
            if not isinstance(values, dict) or not all(v is None or is_number(v) for v in values.values()):
                raise bad(f"{label}: {key} must map seeds to numbers")
            seed = next((s for s in values if not re.fullmatch(r"-?[0-9]+", s)), None)  # sorted as numbers
            if seed is not None:
                raise bad(f"{label}: {key} has seed {seed!r}, not an integer")
            if key == "valid_loss" and not all(v is None or is_loss(v) for v in values.values()):
                raise bad(f"{label}: {key}={values!r} must be losses (numbers {LOSS_RANGE})")
            if key != "valid_loss" and not all(v is None or is_perplexity(v) for v in values.values()):  # Δ divides
                raise bad(f"{label}: {key}={values!r} must be perplexities (numbers {PERPLEXITY_RANGE})")
        curves = r.get("curves")  # plot --gap reads a copied comparison's; one that is no curve is no evaluation
        for seed, curve in curves.items() if isinstance(curves, dict) else ():
            wrong = curve_out_of_range(curve) if valid_curve(curve) else None
            if wrong:
                raise bad(f"{label}: the curve of seed {seed} has {wrong}")
        if not isinstance(r.get("model_options", {}), dict):
            raise bad(f"{label}: model_options={r['model_options']!r} must be a mapping of model fields")
        for key in ("published", "compute_matched_to", "param_matched_to", "init_from"):
            if r.get(key) is not None and not isinstance(r[key], list if key == "published" else str):
                raise bad(f"{label}: {key}={r[key]!r} is of the wrong type")
        published = r.get("published")  # (mean, std), either null
        if published is not None and (len(published) != 2 or not all(v is None or is_number(v) for v in published)):
            raise bad(f"{label}: published={published!r} must be [mean, std] (numbers or null)")
        if published is not None and not ((published[0] is None or is_perplexity(published[0]))
                                          and (published[1] is None or 0 <= published[1] <= MAX_PERPLEXITY)):
            raise bad(f"{label}: published={published!r} must be [mean, std] of a perplexity: a mean above 0 and a "
                      f"std from 0, both finite and at most e^50 (or null)")
    if not isinstance(report.get("seeds", []), list) or not isinstance(report.get("sets", {}), dict):
        raise bad("seeds must be a list and sets a mapping")
    if problem := added_models_problem(report.get("added", {}), report.get("matched", []), "added"):
        raise bad(problem)
    if not is_count(report.get("runs_at_once", 1)):
        raise bad(f"runs_at_once={report['runs_at_once']!r} must be an integer >= 1")
    missing = report.get("missing", [])
    if not isinstance(missing, list) or not all(isinstance(m, str) for m in missing):
        raise bad(f"missing={report['missing']!r} must be a list of run names")
    for key in ("recipe", "description", "data", "published_source"):  # looked up and searched as text
        if report.get(key) is not None and not isinstance(report[key], str):
            raise bad(f"{key}={report[key]!r} must be a string")
    return report


def write_results(out: Path, recipe: Recipe, request: dict, specs: list[ModelSpec], results: dict) -> dict:
    rows = aggregate(recipe, specs, results)
    missing = [f"{s.label}/seed{seed}" for s in specs for seed in request["seeds"]
               if seed not in results.get(s.label, {})]
    report = {
        "recipe": recipe.name,
        "description": recipe.description,
        "preset": recipe.preset,
        "data": request["data"],
        "seeds": request["seeds"],
        "sets": request["sets"],
        "command": request.get("command", ""),
        "commands": request.get("commands") or [request.get("command", "")],
        "complete": not missing,
        "missing": missing,  # the runs asked for and not finished, LABEL/seedN
        "published_source": recipe.published_source,
        "models": rows,
    }
    for key, recorded in (("added", request.get("models")), ("matched", request.get("matched"))):
        if recorded:  # compare --model / --matched: what the recipe's models were joined by (recipes.with_models)
            report[key] = recorded
    if request.get("runs_at_once", 1) > 1:  # compare --jobs: runs trained beside one another (:func:`shared_note`)
        report["runs_at_once"] = request["runs_at_once"]
    write_report(out / "results.json", report, results_markdown(report))
    return report


def standard_row(rows: list[dict]) -> dict | None:
    """The reference of the Δ columns: the first row whose label starts with "standard" (the upcycle recipe's is
    ``standard-continued``; the headers name it)."""
    return next((r for r in rows if r["label"].startswith("standard")), None)


def reference_label(base: dict | None) -> str:
    """The Δ columns' reference as the table names it: its label (``standard-continued``), or "standard"."""
    return base["label"] if base else "standard"


def delta_header(base: dict | None) -> str:
    """'Δ vs standard', naming the reference row when it is another standard (``Δ vs standard-continued``)."""
    return f"Δ vs {reference_label(base)}"


def missing_text(report: dict, shown: int = 6) -> str:
    """'runs missing: a/seed1, b/seed2' for an incomplete report (the first ``shown`` named; a results.json written
    before it recorded them: 'runs missing')."""
    missing = report.get("missing") or []
    if not missing:
        return "runs missing"
    more = f", and {len(missing) - shown} more" if len(missing) > shown else ""
    return f"runs missing: {', '.join(missing[:shown])}{more}"


def _fmt(mean, std, digits=2) -> str:
    if mean is None:
        return "—"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


TEST_IS_VALIDATION = ("This data has no test split: test perplexity is the validation perplexity of the checkpoint "
                      "chosen on it")


def no_test_split(rows: list[dict]) -> bool:
    """Every model's test perplexity is its validation one, seed by seed: the data has no test split."""
    return bool(rows) and all(r.get("test_ppl") and r.get("test_ppl") == r.get("valid_ppl") for r in rows)


def results_markdown(report: dict) -> str:
    """results.md: the table, then validation perplexity during training.

    Like with like (rules shared with the results figure):

    - Δ vs standard: when the models have different seeds, over the seeds all models share (or,
      if none is, the seeds each model shares with standard); a line below the table says so. No column
      without a standard row (``compare --only`` leaving it out).
    - published: shown for a row only when its runs trained as the published number's did: not when
      ``sets`` overrides a training field that is not result-neutral (max_steps, lr, tokenizer,
      train_tokens, ...), nor when the recipe description names a step count other than the row's
      ``steps``; a line says why they are left out.
    - the heading states this run's steps when the description names none or another count.
    """
    rows = report["models"]
    base = standard_row(rows)
    compared = compared_values(rows)
    heading = f"# {report['recipe']}: {report['description']}"
    if steps_differ_from_description(report):
        heading += f" (this run: {run_steps_text(rows)})"
    lines = [
        heading,
        "",
        *(f"{'Command' if i == 0 else 'then'}: `{printable_text(c)}`  "
          for i, c in enumerate(report.get("commands") or [report["command"]])),
        f"Data: `{printable_text(report['data'])}` · seeds {', '.join(map(str, report['seeds']))} · hardware: "
        f"{devices_text(rows)}{'' if report['complete'] else ' · INCOMPLETE (' + missing_text(report) + ')'}",
        "",
    ]
    delta_column = [delta_header(base)] if base else []  # no standard row (compare --only): no column of dashes
    header = ["model", "attention", "d", "parameters", "test ppl", *delta_column, "valid ppl", "published", "steps",
              "train tokens", "tokens/param", "train PFLOP", "tokens/s", "wall-clock"]
    lines += ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 2)]
    for r in rows:
        delta = []
        if base:
            change = relative_change(compared[r["label"]], compared[base["label"]]) if r is not base else None
            delta = [f"{100 * change:+.1f}%" if change is not None else "—"]
        opts = ", ".join(f"{k}={v}" for k, v in r["attn_options"].items())
        attn = r["attn"] + (f" ({opts})" if opts else "")
        if r["norm"] != "pre":
            attn += ", Post-LN"
        if r["residual"] != "plain":
            attn += f", {r['residual']}"
        attn += "".join(f", {k}={v}" for k, v in model_options(report, r).items())
        pub = published_value(report, r)
        cells = [r["label"], attn, str(r["d_model"]), f"{r['parameters']:,}",
                 _fmt(r["test_ppl_mean"], r["test_ppl_std"]), *delta, _fmt(r["valid_ppl_mean"], r["valid_ppl_std"]),
                 _fmt(*pub) if pub else "—", f"{r['steps']:,}", f"{in_millions(r['train_tokens'])}M",
                 f"{r['tokens_per_parameter']:.3g}", f"{r['train_flops'] / 1e15:.3g}", f"{r['tokens_per_s']:,.0f}",
                 wall_clock_text(r["wall_clock_s"])]
        lines.append("| " + " | ".join(cells) + " |")
    common = common_seeds(rows)
    held_note = seeds_held_note(report, rows)  # (None where the seeds differ between models: said below instead)
    if common is not None:
        over = (f"the seed{'s' if len(common) > 1 else ''} all models share ({', '.join(common)})" if common
                else f"the seeds each model shares with {reference_label(base)} (no seed is shared by all models)")
        seeds_per_model = "; ".join(f"{r['label']}: {', '.join(seed_values(r)) or 'none'}" for r in rows)
        lines += ["", f"Seeds differ between models ({seeds_per_model}): test ppl is each model's mean over its own "
                      f"seeds{f'; {delta_header(base)} is over {over}' if base else ''}."]
    elif held_note:
        lines += ["", held_note + "."]
    diverged = diverged_note(rows, held_note)
    if diverged:
        lines += ["", diverged + "."]
    continued = continued_note(rows)
    if continued:
        lines += ["", continued]
    other_stream = other_stream_note(rows)
    if other_stream:
        lines += ["", other_stream]
    compiled = [r["label"] for r in rows if r.get("compiled")]
    if compiled:  # (a compiled run's tokens/s was 79 where it trained at 21,895 a second once compiled)
        lines += ["", f"tokens/s and wall-clock of {', '.join(compiled)} count torch.compile's compiling (once for "
                      f"each leg of a run that trained compiled)."]
    if report.get("runs_at_once", 1) > 1:
        lines += ["", shared_note(report["runs_at_once"])]
    omitted = published_omitted_note(report)
    if omitted:
        lines += ["", omitted + "."]
    if report.get("published_source") and any(published_value(report, r) for r in rows):
        lines += ["", f"Published: {report['published_source']}."]
    lines += paired_table(rows)
    spread = ("mean ± sample std over seeds" if any(len(seed_values(r)) > 1 for r in rows)
              else "one seed per model, so no spread" if all(len(r.get("seeds", [])) <= 1 for r in rows)
              else "at most one finite result per model, so no spread" if any(seed_values(r) for r in rows)
              else "no model has a finite one")  # (seeds that diverged: it said "one seed per model" of three)
    lines += ["", f"Test perplexity from the best-validation checkpoint; {spread}."
              + (f" {TEST_IS_VALIDATION}." if no_test_split(rows) else "")]
    # Each param-matched row by its own label (a --matched model's `param-fair-LABEL` was called `param-fair`, and the
    # gaps of two such rows were given under that one name), as the compute-matched rows are
    matched = [f"`{r['label']}`: {r['param_matched_to']} with standard attention at the smallest width giving at "
               f"least its parameters{param_gap_text(r, rows)}" for r in rows if r.get("param_matched_to")]
    matched += [f"`{r['label']}`: standard trained for as many training FLOPs (torch.utils.flop_counter, forward "
                f"+ backward) as {r['compute_matched_to']} used" for r in rows if r.get("compute_matched_to")]
    if matched:
        lines.append("; ".join(matched) + ".")
    # Like the Δ column: over the seeds all models share when their seed sets differ.
    common = common_seeds(rows)
    drawn = sorted({str(s) for r in rows for s in r["curves"]}, key=seed_key)  # (a one-seed table said "seed mean")
    curve_seeds = (f"mean over seeds {', '.join(common)}, the ones all models share" if common and len(common) > 1
                   else f"seed {common[0]}, the one all models share" if common
                   else f"seed {drawn[0]}" if len(drawn) == 1 else "seed mean")
    lines += ["", f"## Validation perplexity during training ({curve_seeds})", ""]
    continued_steps = continued_steps_note(rows)
    if continued_steps:
        lines += [continued_steps, ""]
    steps = sorted({p["step"] for r in rows for c in r["curves"].values() for p in c})
    if steps:
        lines.append("| step | " + " | ".join(r["label"] for r in rows) + " |")
        lines.append("| ---: | " + " | ".join("---:" for _ in rows) + " |")
        at_step = []  # per row: step -> its seeds' valid_ppl (looked up, not searched for each step: 4,000
        for r in rows:  # evaluations a run took 6 s, a time that grew as their square)
            values: dict[int, list] = {}
            for seed, c in r["curves"].items():
                if not common or str(seed) in common:
                    for p in c:
                        values.setdefault(p["step"], []).append(p["valid_ppl"])
            at_step.append(values)
        for step in steps:
            cells = []
            for values in at_step:
                # A point that was not finite (null in result.json, as read_result allows) is left out, as a
                # diverged seed is from the means.
                mean, _ = mean_std(values.get(step, []))
                cells.append(f"{mean:.2f}" if mean is not None else "")
            lines.append(f"| {step:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def shared_note(runs_at_once: int) -> str:
    """Under the table of a comparison whose runs trained several at once (``compare --jobs``)."""
    return (f"tokens/s and wall-clock were measured with up to {runs_at_once} runs training at once (compare --jobs), "
            f"sharing the machine for some or all of their time: each is lower than the run would get alone, by as "
            f"much as it shared, so these columns compare rows only as far as their runs trained alike.")


def continued_note(rows: list[dict]) -> str:
    """For models that continue another model's trained weights (``init_from``): what their
    steps, tokens, FLOPs and wall-clock count, and what to add for the whole training."""
    by_label = {r["label"]: r for r in rows}
    notes = []
    for base in dict.fromkeys(r["init_from"] for r in rows if r.get("init_from")):
        labels = ", ".join(r["label"] for r in rows if r.get("init_from") == base)
        b = by_label.get(base)
        add = (f"{b['steps']:,} steps, {in_millions(b['train_tokens'])}M tokens, {b['train_flops'] / 1e15:.3g} PFLOP "
               f"and {wall_clock_text(b['wall_clock_s'])}" if b else "its steps, tokens, FLOPs and wall-clock")
        notes.append(f"{labels} continue {base}'s trained weights (a fresh optimizer and schedule): their steps, "
                     f"train tokens, tokens/param, train PFLOP and wall-clock count the continuation only; for the "
                     f"whole training add {base}'s {add} (the curves figure draws them after {base}'s tokens)")
    return " ".join(f"{note}." for note in notes)


def continued_steps_note(rows: list[dict]) -> str | None:
    """For the validation table: the steps of a model that continues another's trained weights count from the
    start of its continuation, so a line of the table does not pair equal training lengths; None when no row
    continues one."""
    by_label = {r["label"]: r for r in rows}
    notes = []
    for base in dict.fromkeys(r["init_from"] for r in rows if r.get("init_from")):
        labels = ", ".join(r["label"] for r in rows if r.get("init_from") == base)
        b = by_label.get(base)
        after = f"{base}'s {b['steps']:,} steps" if b else f"{base}'s steps"
        notes.append(f"The steps of {labels} count from the start of their continuation: add {after} to compare "
                     f"them with a model trained from scratch at the same training length")
    return " ".join(f"{note}." for note in notes) or None


def block_text(row: dict) -> str:
    """A row's block and residual stream in words: 'Pre-LN', 'Post-LN', 'Pre-LN, attnres-block'."""
    norm = "Post-LN" if row.get("norm", "pre") == "post" else "Pre-LN"
    residual = row.get("residual", "plain")
    return norm if residual == "plain" else f"{norm}, {residual}"


def other_stream_note(rows: list[dict]) -> str | None:
    """A line naming the rows whose block or residual stream differs from the Δ columns' references (the
    first standard row; the compute-matched one, when the paired table shows Δ vs compute-matched), whose Δ
    therefore includes that change; None when none does."""
    base = standard_row(rows)
    if base is None:
        return None
    matched = next((r for r in rows if r.get("compute_matched_to")), None)
    references = [base] + ([matched] if matched is not None and len(valid_losses(base)) > 1 else [])
    blocks = {block_text(r) for r in references}
    other = [r for r in rows if block_text(r) not in blocks]
    if not other:
        return None
    def grouped(group: list[dict]) -> str:
        by_block: dict[str, list[str]] = {}
        for r in group:
            by_block.setdefault(block_text(r), []).append(r["label"])
        return "; ".join(f"{' and '.join(labels)} ({block})" for block, labels in by_block.items())

    return (f"The Δ columns compare every row with {grouped(references)}, so the Δ of {grouped(other)} includes "
            f"the change of block or residual stream.")


def param_gap_text(row: dict, rows: list[dict]) -> str:
    """' (+5.0%)': how far the param-matched ``row`` is above its model in parameters ('' where that is unknown)."""
    target = next((r for r in rows if r["label"] == row["param_matched_to"]), {})
    return f" ({100 * (row['parameters'] / target['parameters'] - 1):+.1f}%)" if target.get("parameters") else ""


def valid_losses(row: dict) -> dict[str, float]:
    """seed -> validation loss of a results.json model row (finite values only: a run whose every evaluation
    was non-finite records an infinite best loss in memory, null in results.json), of the seeds that did not diverge
    (a finite test perplexity: a seed left out of the means as diverged was paired on its 31-76 nats)."""
    values, finite = row.get("valid_loss") or {}, seed_values(row)
    return {str(s): v for s, v in values.items() if v is not None and math.isfinite(v) and str(s) in finite}


def paired_differences(row: dict, reference: dict) -> dict[str, float]:
    """seed -> validation loss of ``row`` minus that of ``reference`` (nats), over the seeds both have."""
    mine, theirs = valid_losses(row), valid_losses(reference)
    return {s: mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs), key=seed_key)}


SAME_SIGN = "**same sign**"


def _regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) by its continued fraction (modified Lentz), on the side of x where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _regularized_incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * fraction


def paired_t_p(differences: Iterable[float]) -> float | None:
    """Two-sided p-value of the paired t-test that the mean per-seed difference is 0 (Student's t with
    n - 1 degrees of freedom; None with fewer than 2 seeds or when every difference is 0). Its assumption,
    normally distributed differences, cannot be checked with a handful of seeds: read it as a guide."""
    values = list(differences)
    if len(values) < 2:
        return None
    mean, std = statistics.fmean(values), statistics.stdev(values)
    if std == 0.0:
        return None if mean == 0.0 else 0.0
    t = mean / (std / math.sqrt(len(values)))
    df = len(values) - 1
    return _regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def p_text(p: float | None) -> str:
    """'p 0.20' (two decimals; 'p < 0.01' below that), or '' when there is no p-value."""
    if p is None:
        return ""
    return "p < 0.01" if p < 0.005 else f"p {p:.2f}"


def same_sign_note(n_seeds: int) -> str:
    """What the same-sign mark is worth with ``n_seeds`` seeds: two models that do not differ give every seed
    the same sign by chance alone 1 time in 2^(n-1) (half the time with 2 seeds, a quarter with 3)."""
    freedom = f"{n_seeds - 1} degree{'s' if n_seeds > 2 else ''} of freedom"
    return (f"{SAME_SIGN} = every seed's difference has the same sign, which {n_seeds} seeds give by chance alone "
            f"1 time in {2 ** (n_seeds - 1)} when the models do not differ: a count, not a significance test; "
            f"p = the two-sided paired t-test over the seeds ({freedom}), which assumes normally distributed "
            f"differences")


def paired_cell(diffs: dict[str, float], seeds: list[str] | None = None) -> str:
    """'-0.021 (-0.030 / -0.015 / -0.019) **same sign**, p 0.02': mean, each seed, whether every seed's
    difference has the same sign, and the paired t-test's p (:func:`paired_t_p`). When the cell's seeds are not
    ``seeds`` (the table's, which its caption names in order): a seed missing, or one beyond them (a
    compute-matched reference with more seeds than standard), each value is named by its seed, the p says over how
    many, and the cell is not marked (the caption's chance of the mark is for the table's seeds)."""
    if not diffs:
        return "—"
    values = list(diffs.values())
    missing = [s for s in (seeds or []) if s not in diffs]
    extra = [s for s in diffs if seeds is not None and s not in seeds]
    named = bool(missing or extra)  # the cell's seeds are not the table's
    agree = not named and len(values) > 1 and (all(v < 0 for v in values) or all(v > 0 for v in values))
    if named:
        per_seed = " / ".join(f"{s}: {v:+.3f}" for s, v in diffs.items()) + "".join(
            f"; seed {', '.join(those)} {why}" for those, why in ((missing, "missing"), (extra, "beyond the table's"))
            if those)
    else:
        per_seed = " / ".join(f"{v:+.3f}" for v in values)
    p = p_text(paired_t_p(values))
    if p and named:
        p += f" over {len(values)} seeds"
    return f"{statistics.fmean(values):+.3f} ({per_seed}){' ' + SAME_SIGN if agree else ''}{', ' + p if p else ''}"


def paired_table(rows: list[dict]) -> list[str]:
    """Paired per-seed differences of validation loss to standard and to compute-matched, when the
    runs have more than one seed, each marked when every seed's difference has the same sign (with the chance
    of that between models that do not differ: :func:`same_sign_note`). A comparison of some of a recipe's
    models (``compare --only``) without a standard row has the compute-matched column alone, and one without a
    compute-matched row the standard column alone. A reference with fewer than two seeds leaves its column out,
    saying so (a standard row of one seed beside three-seed rows took the compute-matched column with it, unsaid).
    A model with a param-fair row of its own (``param_matched_to``) gets a third column, against that row: the
    comparison at equal parameters had no cell and no p, only each row's mean perplexity."""
    base = standard_row(rows)
    first = next((r for r in rows if r.get("compute_matched_to")), None)
    own = {}  # a model (and its param-fair row) -> its own compute-matched row (compare --matched adds more than one)
    for r in rows:
        if r.get("compute_matched_to"):
            own.setdefault(r["compute_matched_to"], r)
    left_out = []  # a reference of one seed (or none finite): nothing to pair over, said
    for header, ref in ((delta_header(base), base), ("Δ vs compute-matched", first)):
        n = len(valid_losses(ref)) if ref is not None else 2
        if n < 2:
            left_out.append(f"{header} is left out: {ref['label']} has {n} seed{'s' if n != 1 else ''} with a "
                            f"validation loss.")
    base, first = (ref if ref is not None and len(valid_losses(ref)) >= 2 else None for ref in (base, first))
    labels = {r["label"] for r in rows}
    param_fair = {}  # a model (with a row here) -> its own param-fair row, of two seeds or more
    for r in rows:
        if r.get("param_matched_to") in labels:
            n = len(valid_losses(r))
            if n >= 2:
                param_fair[r["param_matched_to"]] = r
            else:  # (left out silently)
                left_out.append(f"Δ vs param-fair of {r['param_matched_to']} is left out: {r['label']} has {n} "
                                f"seed{'s' if n != 1 else ''} with a validation loss.")
    if base is None and first is None and not param_fair:  # (its notes were dropped with it: the section vanished)
        if left_out and any(len(valid_losses(r)) >= 2 for r in rows):
            return ["", "## Paired per-seed differences (validation loss, nats; negative = better)", "",
                    " ".join(left_out)]
        return []
    seeds = sorted(valid_losses(base or first or next(iter(param_fair.values()))), key=seed_key)
    columns = ([delta_header(base)] * (base is not None) + ["Δ vs compute-matched"] * (first is not None)
               + ["Δ vs param-fair"] * bool(param_fair))
    lines = ["", "## Paired per-seed differences (validation loss, nats; negative = better)", "",
             f"Each cell: the mean over seeds of (model − reference) on the same seed, then each seed's difference "
             f"({', '.join(seeds)}); {same_sign_note(len(seeds))}."
             + (f" Δ vs compute-matched: a model with a compute-matched row of its own, and its param-fair row, "
                f"against that row; every other model against {first['label']}." if first and len(own) > 1 else "")
             + (" Δ vs param-fair: a model against its own param-fair row, standard attention widened to at least "
                "its parameters." if param_fair else "")
             + "".join(f" {text}" for text in left_out), "",
             f"| model | parameters | train PFLOP | valid loss | {' | '.join(columns)} |",
             "| --- | ---: | ---: | ---: |" + " --- |" * len(columns)]
    for r in rows:
        mean, std = mean_std(valid_losses(r).values())
        cells = []
        if base is not None:
            cells.append(paired_cell(paired_differences(r, base), seeds) if r is not base else "—")
        if first is not None:
            matched = own.get(r["label"]) or own.get(r.get("param_matched_to")) or first
            cells.append(paired_cell(paired_differences(r, matched), seeds) if r is not matched else "—")
        if param_fair:
            fair = param_fair.get(r["label"])
            cells.append(paired_cell(paired_differences(r, fair), seeds) if fair is not None else "—")
        lines.append(f"| {r['label']} | {r['parameters']:,} | {r['train_flops'] / 1e15:.3g} | {_fmt(mean, std, 3)} | "
                     f"{' | '.join(cells)} |")
    return lines
