"""The repository's results files hold no absolute paths of the machines that made them, every README
table points at a results file that exists, every number of the README's results tables (and of the
summaries beside them) is recomputed from its results file, and each results.md / bench.md is what the
command writes from its JSON."""

from __future__ import annotations

import gzip
import json
import math
import re
import statistics
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
ABSOLUTE = re.compile(r"""(?:^|[\s"'`(=:])(/(?:tmp|work|root|home|opt|usr|Users|mnt|var)/[^\s"'`)]*)""")


def test_results_files_hold_no_absolute_paths():
    found = []
    for path in sorted((ROOT / "results").rglob("*")):
        if path.suffix in (".json", ".md", ".txt") and path.is_file():
            for match in ABSOLUTE.finditer(path.read_text(encoding="utf-8")):
                found.append(f"{path.relative_to(ROOT)}: {match.group(1)}")
    assert not found, "\n".join(found[:20])


def test_results_json_strings_are_not_absolute_paths():
    """No string anywhere in a results JSON file is an absolute or home-relative path, whatever its first
    folder (/scratch/..., /data/..., ~/..., C:\\...): run and data paths are recorded by their last parts."""

    def strings(value):
        if isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)
        elif isinstance(value, str):
            yield value

    found = []
    for path in sorted((ROOT / "results").rglob("*.json")):
        for text in strings(json.loads(path.read_text(encoding="utf-8"))):
            for word in re.split(r"[\s=]", text):
                word = word.strip("\"'`(),;[]")
                if re.match(r"(/[^/\s]+/|~/|[A-Za-z]:\\)", word):
                    found.append(f"{path.relative_to(ROOT)}: {word}")
    assert not found, "\n".join(found[:20])


def test_readme_links_to_results_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((results/[^)#]+)", readme)
    assert links, "the README links no results files"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


OUTSIDE = re.compile(r"SPEC\.md|DESIGN\.md|\.\./shared")


def test_nothing_names_a_file_outside_the_repository():
    """Docs, results, code and scripts cite only what the repository holds (its method documents are
    docs/), and results files record no path that climbs out of the directory they were run in, nor
    the git-ignored copy of the data that a GPU session carries (.device/)."""
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "src" / "gbattn").rglob("*.py"),
             *(ROOT / "scripts").rglob("*"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "results").rglob("*")]
    found = []
    for path in paths:
        if not path.is_file() or path.suffix not in (".md", ".py", ".sh", ".json", ".txt", ".csv") \
                or path.name == Path(__file__).name:
            continue
        text = path.read_text(encoding="utf-8")
        in_results = path.is_relative_to(ROOT / "results")
        pattern = re.compile(OUTSIDE.pattern + r"|\.\./|\.device/") if in_results else OUTSIDE
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not found, "\n".join(found[:20])


# -- every number of the README's results tables is its results file's ---------------------------------

README_TEXT = (ROOT / "README.md").read_text(encoding="utf-8")
README_PROSE = " ".join(README_TEXT.split())


def readme_table(anchor: str) -> list[list[str]]:
    """The body rows of the first Markdown table after ``anchor`` (which occurs once in the README), as
    cells with bold marks removed."""
    assert README_TEXT.count(anchor) == 1, f"{anchor!r} occurs {README_TEXT.count(anchor)} times in the README"
    lines = README_TEXT[README_TEXT.index(anchor):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")])
    return rows


def assert_table(anchor: str, expected: list[list[str | None]]) -> None:
    """The README table after ``anchor`` has the expected rows, cell by cell (None: a cell that no results
    file gives, such as a description or the paper's number)."""
    rows = readme_table(anchor)
    assert len(rows) == len(expected), f"{anchor}: README rows {[r[0] for r in rows]}"
    wrong = [f"{anchor} / {row[0]} / column {i + 1}: README {cell!r}, results file {want!r}"
             for row, want_row in zip(rows, expected) for i, (cell, want) in enumerate(zip(row, want_row))
             if want is not None and cell != want]
    wrong += [f"{anchor} / {row[0]}: {len(row)} cells, {len(want_row)} expected"
              for row, want_row in zip(rows, expected) if len(row) != len(want_row)]
    assert not wrong, "\n".join(wrong)


GPU = "gpu-paper-small-wt2-3seeds"  # the paper-scale comparison the README reports (three seeds, one H200)


def compare_rows(name: str) -> dict[str, dict]:
    return {m["label"]: m for m in json.loads((ROOT / "results" / name / "results.json").read_text())["models"]}


def deviations_prose() -> str:
    """docs/deviations.md with its line breaks and indentation folded to single spaces."""
    return " ".join((ROOT / "docs" / "deviations.md").read_text(encoding="utf-8").split())


def each_seed(values) -> str:
    """Per-seed differences as the documents write them: '+0.005 / -0.001'."""
    return " / ".join(f"{v:+.3f}" for v in values)


def bench_rows(name: str) -> dict[str, dict]:
    return {v["variant"]: v for v in json.loads((ROOT / "results" / name).read_text())["variants"]}


def signed(value: float, digits: int = 1, unit: str = "%") -> str:
    """'+0.8%', '−1.6%': the README's signs (U+2212 for minus)."""
    return f"{value:+.{digits}f}{unit}".replace("-", "\u2212")


def change(value: float, base: float) -> str:
    return signed(100 * (value / base - 1))


def nats(row: dict, seed: str) -> float:
    return math.log(row["valid_ppl"][seed])


def paired(row: dict, reference: dict, seeds: list[str]) -> list[float]:
    return [nats(row, s) - nats(reference, s) for s in seeds]


def mean_test_ppl(row: dict, seeds: list[str]) -> float:
    """A model's test perplexity, the mean over ``seeds``."""
    return statistics.fmean(row["test_ppl"][s] for s in seeds)


def seed_changes(row: dict, reference: dict, seeds: list[str]) -> list[str]:
    """Each seed's change of test perplexity against ``reference`` on the same seed: ['−1.6%', '−1.5%', ...]."""
    return [change(row["test_ppl"][s], reference["test_ppl"][s]) for s in seeds]


def with_later_seeds(row: dict, later: dict) -> dict:
    """``row`` with the perplexities of ``later``, a later run of the same model on other seeds, added seed by seed;
    asserts that it is the same model (attention, options, width, parameters, steps) and that no seed is in both."""
    assert all(later[key] == row[key] for key in ("attn", "attn_options", "d_model", "parameters", "steps")), \
        (row["label"], later["label"])
    assert not set(row["test_ppl"]) & set(later["test_ppl"])  # no seed twice
    return {**row, **{key: {**row[key], **later[key]} for key in ("test_ppl", "valid_ppl")}}


def paired_text(diffs: list[float]) -> str:
    """'−0.016 (−0.032 / −0.003 / −0.012) same sign': the mean, each seed's, and whether every seed agrees."""
    agree = all(d < 0 for d in diffs) or all(d > 0 for d in diffs)
    return (f"{signed(statistics.fmean(diffs), 3, '')} ({' / '.join(signed(d, 3, '') for d in diffs)})"
            f"{' same sign' if agree else ''}")


def paired_t_p(diffs: list[float]) -> float:
    """Two-sided p of the paired t-test of three per-seed differences: Student's t with 2 degrees of freedom
    has the closed form P(|T| > t) = 1 - t / sqrt(t^2 + 2)."""
    assert len(diffs) == 3
    t = abs(statistics.fmean(diffs)) / (statistics.stdev(diffs) / math.sqrt(3))
    return 1 - t / math.sqrt(t * t + 2)


def pflop(row: dict) -> str:
    return f"{row['train_flops'] / 1e15:.4f}"


def paired_table(rows: dict[str, dict], seeds: list[str], references: tuple[dict, dict]) -> list[list]:
    """A README table of paired validation losses: each model's label, parameters, training PFLOP, loss mean ± std
    over ``seeds``, then its paired differences to each reference ("—" in the reference's own row)."""
    expected = []
    for label, r in rows.items():
        losses = [nats(r, s) for s in seeds]
        expected.append([label, None, f"{r['parameters']:,}", pflop(r),
                         f"{statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f}",
                         *("—" if r is ref else paired_text(paired(r, ref, seeds)) for ref in references)])
    return expected


def test_readme_parameter_and_flop_table_is_what_gbattn_params_counts():
    """The README's `gbattn params` table: every parameter count and forward FLOPs per token (at T = block_size)
    is count_params' and flops_per_token's for the model its row names (the FLOP column was pinned nowhere)."""
    from gbattn.config import preset_config
    from gbattn.model import count_params, flops_per_token

    models = [("paper-small", "standard", {}), ("paper-small", "twicing", {}), ("paper-small", "boosted", {}),
              ("paper-small", "standard", {"d_model": 288}), ("llama-small", "standard", {}),
              ("llama-small", "boosted", {}), ("cpu-llama", "standard", {}), ("cpu-llama", "boosted", {})]
    expected = []
    for preset, attn, overrides in models:
        cfg = preset_config(preset, attn, overrides)
        expected.append([None, f"{count_params(cfg):,}", f"{flops_per_token(cfg) / 1e6:.2f} M"])
    assert_table("`gbattn params PRESET --attn X`", expected)


def test_readme_gpu_table_is_results_gpu():
    """The paper-scale table: three seeds' mean ± sample std of test perplexity, the change of the means, and the
    paired validation-loss differences to standard and to compute-matched, seed by seed."""
    rows = compare_rows(GPU)
    std, matched = rows["standard"], rows["compute-matched"]
    names = {"standard": "standard", "twicing": "twicing", "param-fair": "param-fair standard", "gba-m2": "GBA M=2",
             "compute-matched": f"compute-matched standard ({matched['steps']:,} steps)"}
    seeds = ["42", "123", "7"]

    expected = []
    for label, name in names.items():
        r, paper = rows[label], rows[label]["published"]
        assert sorted(r["test_ppl"]) == sorted(seeds)
        expected.append([name, str(r["d_model"]), f"{r['parameters']:,}", f"{r['train_flops'] / 1e15:.2f}",
                         f"{mean_test_ppl(r, seeds):.2f} ± {statistics.stdev(r['test_ppl'][s] for s in seeds):.2f}",
                         "—" if r is std else change(mean_test_ppl(r, seeds), mean_test_ppl(std, seeds)),
                         "—" if r is std else paired_text(paired(r, std, seeds)),
                         "—" if r is matched else paired_text(paired(r, matched, seeds)),
                         f"{paper[0]:.1f} ± {paper[1]:.1f}" if paper else "—",
                         "—" if r is std or not paper else change(paper[0], std["published"][0])])
    assert_table("### Paper recipe at paper scale", expected)


def test_readme_baselines_table_and_claims_are_results_cpu_baselines():
    """The cpu-baselines table (each model's validation loss over seeds 42, 123 and 7, paired to standard and to
    GBA M=2), the prose and "Should I use GBA?" claims drawn from it, its reproduction of cpu-char's rows, and
    docs/deviations.md's differential-attention bias effect (entry 14)."""
    rows, seeds = compare_rows("cpu-baselines"), ["42", "123", "7"]
    std, gba = rows["standard"], rows["gba-m2"]
    assert rows["differential-no-attn-bias"]["attn"] == "differential"
    assert_table("### Every attention mechanism", paired_table(rows, seeds, (std, gba)))

    def gain(label):
        return statistics.fmean(paired(rows[label], std, seeds))

    assert min(rows, key=gain) == "twicing" and rows["twicing"]["parameters"] == std["parameters"]
    flops = {label: 100 * (rows[label]["train_flops"] / std["train_flops"] - 1) for label in ("twicing", "gba-m2")}
    assert (f"Twicing gains the most here ({signed(gain('twicing'), 3, '')} nats) for no parameters and "
            f"{flops['twicing']:.0f}% more training FLOPs, GBA M=2 {signed(gain('gba-m2'), 3, '')} for "
            f"{100 * (gba['parameters'] / std['parameters'] - 1):.0f}% more parameters and {flops['gba-m2']:.0f}% more "
            f"FLOPs") in README_PROSE
    gated = paired(rows["gated"], std, seeds)
    assert min(gated) < 0 < max(gated)  # "gated attention is within noise of standard"
    assert all(d > 0 for label in ("differential", "differential-no-attn-bias")
               for d in paired(rows[label], std, seeds))  # "behind standard on every seed"
    assert gain("differential-no-attn-bias") > gain("differential")  # "and more so without its attention biases"
    assert all(d < 0 for d in paired(rows["twicing"], gba, seeds))  # "ahead of GBA M=2 on every seed"
    assert (f"Twicing gained more than GBA ({signed(gain('twicing'), 3, '')} against {signed(gain('gba-m2'), 3, '')} "
            f"nats, ahead of it on every one of 3 seeds, though within seed noise: paired t-test "
            f"p = {paired_t_p(paired(rows['twicing'], gba, seeds)):.2f}) for no extra parameters") in README_PROSE
    char, design = compare_rows("cpu-char"), compare_rows("gba-design")
    worst = max(abs(rows[label]["valid_ppl"][s] - char[label]["valid_ppl"][s])
                for label in ("standard", "twicing", "gba-m2") for s in ("42", "123"))
    assert worst < 3e-6 and "reproduce the `cpu-char` table's runs of seeds 42 and 123 to within 3e-6" in README_PROSE
    worst = max(abs(rows[label]["valid_ppl"]["7"] - design[label]["valid_ppl"]["7"])
                for label in ("standard", "gba-m2"))
    assert worst < 9e-5 and "seed 7 runs reproduce the design study's to within 9e-5" in README_PROSE

    bias = paired(rows["differential-no-attn-bias"], rows["differential"], seeds)
    assert (f"without the biases the validation loss is {statistics.fmean(bias):+.3f} nats on average "
            f"({each_seed(bias)}, seed 42 / 123 / 7), so the seeds disagree in sign. With or without them, "
            f"differential attention is behind standard attention at this scale ({gain('differential'):+.3f} and "
            f"{gain('differential-no-attn-bias'):+.3f} nats, on every seed)") in deviations_prose()
    assert min(bias) < 0 < max(bias)


def test_readme_design_study_tables_are_results_gba_design():
    design = compare_rows("gba-design")
    std, matched = design["standard"], design["compute-matched"]
    seeds = ["42", "123", "7"]
    assert_table("### GBA design study", paired_table(design, seeds, (std, matched)))
    gba = [label for label in design if label.startswith("gba")]
    beat = [label for label in gba if all(d < 0 for d in paired(design[label], std, seeds))]
    p_matched = max(paired_t_p(paired(design[label], matched, seeds)) for label in gba)
    p_m2, p_m3 = (paired_t_p(paired(design[label], std, seeds)) for label in beat)
    assert beat == ["gba-m2", "gba-m3"] and (
        f"neither significantly with three seeds (paired t-test p = {p_m2:.2f} and {p_m3:.2f}, "
        f"where every GBA configuration's deficit to compute-matched has p ≤ {math.ceil(100 * p_matched) / 100:.2f})"
    ) in README_PROSE

    assert_table("### Training length", training_length_table(design, char_long_three_seeds(), seeds, 4))


def char_long_three_seeds() -> dict[str, dict]:
    """cpu-char-long's models over seeds 42, 123 (results/cpu-char-long) and 7 (results/cpu-char-long-seed7, the
    same recipe continued in another directory with --seeds 7)."""
    rows = over_seeds("cpu-char-long", "cpu-char-long-seed7", ("42", "123"), ("7",))
    assert list(rows) == list(compare_rows("cpu-char-long"))  # the same models, in the same order
    return rows


def proxy_gap_lines() -> dict[tuple[str, str], dict[int, dict]]:
    """The WikiText-2 training-length figure's lines (results/training-length-proxy/gap.json): for each (directory,
    reference), its points by step."""
    gap = json.loads((ROOT / "results" / "training-length-proxy" / "gap.json").read_text())
    return {(s["directory"], s["reference"]): {p["step"]: p for p in s["points"]} for s in gap["series"]}


def gba_gaps(short: dict[str, dict], long: dict[str, dict], reference: str,
             seeds: list[str]) -> tuple[list[float], list[float]]:
    """GBA M=2 minus ``reference`` in validation nats, seed by seed, in the shorter runs and in the longer ones of a
    training-length study."""
    return paired(short["gba-m2"], short[reference], seeds), paired(long["gba-m2"], long[reference], seeds)


def training_length_table(short: dict[str, dict], long: dict[str, dict], seeds: list[str], factor: int) -> list[list]:
    """The rows of a training-length table (cpu-char-long's, cpu-proxy-long's): each model's tokens per parameter
    and validation loss (perplexity), the means over ``seeds``, in the shorter runs and in the runs ``factor`` times
    longer, and the paired differences to standard and to param-fair in both."""
    assert list(long) == ["standard", "param-fair", "compute-matched", "gba-m2"]
    assert all(set(seeds) <= set(long[label]["valid_ppl"]) for label in long)
    assert all(long[label]["steps"] == factor * short[label]["steps"] for label in ("standard", "param-fair", "gba-m2"))
    names = {"standard": "standard", "param-fair": f"param-fair (d {long['param-fair']['d_model']})",
             "compute-matched": f"compute-matched ({short['compute-matched']['steps']:,} / "
                                f"{long['compute-matched']['steps']:,} steps)", "gba-m2": "GBA M=2"}

    def cell(r):
        losses = [nats(r, s) for s in seeds]
        return (f"{r['tokens_per_parameter']:.2f}, {statistics.fmean(losses):.3f} "
                f"({statistics.fmean(r['valid_ppl'][s] for s in seeds):.2f})")

    def gap(label, reference):
        if label == reference:
            return "—"
        shorter = statistics.fmean(paired(short[label], short[reference], seeds))
        longer = statistics.fmean(paired(long[label], long[reference], seeds))
        return f"{signed(shorter, 3, '')} → {signed(longer, 3, '')}"

    return [[name, f"{long[label]['parameters']:,}", cell(short[label]), cell(long[label]), gap(label, "standard"),
             gap(label, "param-fair")] for label, name in names.items()]


def test_readme_cpu_proxy_long_is_its_results():
    """The WikiText-2 training-length table (seeds 42, 123 and 7: cpu-proxy's runs at 1,200 steps, cpu-proxy-long's
    at 2,400), the numbers of its prose and its figure."""
    seeds = ["42", "123", "7"]
    short, long = proxy_three_seeds(), compare_rows("cpu-proxy-long")
    assert all(sorted(r["valid_ppl"]) == sorted(seeds) for r in long.values())
    assert_table("### Longer training on WikiText-2", training_length_table(short, long, seeds, 2))
    end = {label: r["curves"]["42"][-1] for label, r in long.items()}

    def text(before: list[float], after: list[float]) -> str:
        """'from −0.012 to −0.028 nats (seeds 42 / 123 / 7: −0.020 → −0.020 / ...' (the parenthesis left open)."""
        each = " / ".join(f"{signed(a, 3, '')} → {signed(b, 3, '')}" for a, b in zip(before, after))
        return (f"from {signed(statistics.fmean(before), 3, '')} to {signed(statistics.fmean(after), 3, '')} nats "
                f"(seeds 42 / 123 / 7: {each}")

    def test_change(rows: dict, reference: str) -> str:
        return change(mean_test_ppl(rows["gba-m2"], seeds), mean_test_ppl(rows[reference], seeds))

    std_before, std_after = gba_gaps(short, long, "standard", seeds)
    fair_before, fair_after = gba_gaps(short, long, "param-fair", seeds)
    # the deficit to the wider model shrinks on every seed and stays on the wrong side on every seed
    assert all(b < a for a, b in zip(fair_before, fair_after)) and min(fair_after) > 0
    # the gain over standard grows on two seeds of three; seed 42's is unchanged at three decimals
    assert [round(b - a, 3) < 0 for a, b in zip(std_before, std_after)] == [False, True, True]
    ahead = paired(long["gba-m2"], long["compute-matched"], seeds)  # GBA minus compute-matched: its lead
    char_fair = [statistics.fmean(paired(rows["gba-m2"], rows["param-fair"], seeds))
                 for rows in (compare_rows("gba-design"), char_long_three_seeds())]
    expected = [
        f"(2x the tokens, {end['standard']['epoch']:.1f} epochs of the training split)",
        f"grows {text(std_before, std_after)}; test perplexity {test_change(short, 'standard')} → "
        f"{test_change(long, 'standard')}",
        f"shrinks {text(fair_before, fair_after)}), on every seed, and stays on the wrong side on every seed",
        f"test perplexity {mean_test_ppl(long['gba-m2'], seeds):.2f} against "
        f"{mean_test_ppl(long['param-fair'], seeds):.2f} at 2,400 steps",
        f"({end['compute-matched']['epoch']:.1f} epochs for its {long['compute-matched']['steps']:,} steps)",
        f"{statistics.fmean(ahead):.3f} nats ahead of GBA ({' / '.join(f'{a:.3f}' for a in ahead)})",
        f"({' → '.join(signed(g, 3, '') for g in char_fair)})",
    ]
    # the figure: gap.json of the 2,400-step runs, all three seeds
    by_line = proxy_gap_lines()
    assert {directory for directory, _ in by_line} == {"cpu-proxy-long", "cpu-proxy + cpu-proxy-seeds", "cpu-proxy-4x"}
    points, shorter = ({ref: by_line[directory, ref] for ref in ("standard", "param-fair")}
                       for directory in ("cpu-proxy-long", "cpu-proxy + cpu-proxy-seeds"))
    assert all(p["seeds"] == 3 for series in points.values() for p in series.values())
    for reference, before in (("standard", std_before), ("param-fair", fair_before)):  # the table's 1,200 steps
        assert math.isclose(shorter[reference][1200]["difference"], statistics.fmean(before), abs_tol=1e-9)
        # every evaluation three seeds made but step 689, seed 42's extra one (drawn hollow)
        assert [step for step, p in shorter[reference].items() if p["seeds"] < 3] == [689]
    short_fair, short_std = shorter["param-fair"], shorter["standard"]
    expected.append(f"In the 1,200-step runs the deficit to param-fair has no such dip "
                    f"({signed(short_fair[600]['difference'], 3, '')} at step 600, "
                    f"{signed(short_fair[900]['difference'], 3, '')} at 900, "
                    f"{signed(short_fair[1200]['difference'], 3, '')} at 1,200) and the gain over standard is "
                    f"{signed(short_std[900]['difference'], 3, '')} at step 900 and "
                    f"{signed(short_std[1200]['difference'], 3, '')} at the end")
    flat = [short_fair[step]["difference"] for step in (600, 900, 1200)]
    assert max(flat) - min(flat) < 0.002  # "no such dip"
    fair, std_gap = points["param-fair"], points["standard"]
    assert math.isclose(fair[2400]["difference"], statistics.fmean(fair_after), abs_tol=1e-9)
    closest = min(fair, key=lambda step: fair[step]["difference"])
    expected += [
        f"smallest at step {closest:,} ({signed(fair[closest]['difference'], 3, '')} nats) and grows back to "
        f"{signed(fair[2400]['difference'], 3, '')}",
        f"in place by step 900 ({signed(std_gap[900]['difference'], 3, '')}) and grows to "
        f"{signed(std_gap[2400]['difference'], 3, '')} at step 2,400",
    ]
    missing = [line for line in expected if line not in README_PROSE]
    assert not missing, "\n".join(missing)


def mean_and_each(diffs: list[float]) -> str:
    """'−0.017 (−0.020 / −0.013)': the mean of paired differences, then each seed's."""
    return f"{signed(statistics.fmean(diffs), 3, '')} ({' / '.join(signed(d, 3, '') for d in diffs)})"


def test_readme_cpu_proxy_4x_probe_is_its_results():
    """The 4x probe on WikiText-2 (the seeds it ran): its table puts the same seeds of cpu-proxy (1,200 steps),
    cpu-proxy-long (2,400) and cpu-proxy-4x (4,800, the same recipe with max_steps=4800, its compute-matched model
    trained by a later command) side by side, and its prose's changes are the table's and the gap figure's."""
    seeds = ["42", "123", "7"]
    lengths = [proxy_three_seeds(), compare_rows("cpu-proxy-long"), compare_rows("cpu-proxy-4x")]
    longest = lengths[-1]
    assert list(longest) == ["standard", "param-fair", "compute-matched", "gba-m2"]
    assert all(sorted(row["valid_ppl"]) == sorted(seeds) for row in longest.values())
    assert [r["gba-m2"]["steps"] for r in lengths] == [1200, 2400, 4800]
    report = json.loads((ROOT / "results" / "cpu-proxy-4x" / "results.json").read_text())
    assert report["recipe"] == "cpu-proxy-long" and report["sets"] == {"max_steps": 4800}
    assert sorted(report["seeds"]) == sorted(int(s) for s in seeds)
    rows, gaps, tests, matched = [], [], [], []
    for r in lengths:
        std, fair, cm = (paired(r["gba-m2"], r[ref], seeds) for ref in ("standard", "param-fair", "compute-matched"))
        gaps.append((std, fair))
        matched.append(cm)
        tests.append({k: mean_test_ppl(r[k], seeds) for k in ("standard", "param-fair", "compute-matched", "gba-m2")})
        rows.append([f"{r['gba-m2']['steps']:,}", f"{r['gba-m2']['tokens_per_parameter']:.2f}", mean_and_each(std),
                     mean_and_each(fair), mean_and_each(cm), " / ".join(f"{v:.2f}" for v in tests[-1].values())])
    assert_table("How far does the deficit to param-fair keep shrinking?", rows)
    # the compute-matched model: trained for GBA's FLOPs in each directory, ahead of GBA on every seed at each length,
    # its lead shrinking; at 4,800 steps the wider model is ahead of it on average
    assert all(abs(r["compute-matched"]["train_flops"] / r["gba-m2"]["train_flops"] - 1) < 1e-3 for r in lengths)
    assert all(d > 0 for cm in matched for d in cm)
    leads = [statistics.fmean(cm) for cm in matched]
    assert leads[0] > leads[1] > leads[2]
    fair_vs_matched = paired(longest["param-fair"], longest["compute-matched"], seeds)
    assert statistics.fmean(fair_vs_matched) < 0
    matched_epochs = longest["compute-matched"]["curves"]["42"][-1]["epoch"]
    assert "| steps (seeds 42, 123, 7) |" in README_TEXT
    (std_2x, fair_2x), (std_4x, fair_4x) = gaps[1], gaps[2]
    assert all(b < a for a, b in zip(fair_2x, fair_4x)) and all(b < a for a, b in zip(std_2x, std_4x))
    assert all(d > 0 for d in fair_4x)  # the wider model still ahead on every seed
    mean = statistics.fmean
    epochs = longest["standard"]["curves"]["42"][-1]["epoch"]
    # the gap figure's 4,800-step line: the deficit to param-fair, the mean of the seeds at each evaluation
    line = proxy_gap_lines()
    fair_line, long_line = line["cpu-proxy-4x", "param-fair"], line["cpu-proxy-long", "param-fair"]
    assert all(p["seeds"] == len(seeds) for p in fair_line.values())
    # the figure's last point is the evaluation at step 4,800, the table's the best checkpoint's (a seed's best may
    # be an earlier evaluation): within 0.0005 nats here
    assert abs(fair_line[4800]["difference"] - mean(fair_4x)) < 5e-4
    smallest = min(fair_line, key=lambda step: fair_line[step]["difference"])
    late = [p["difference"] for step, p in fair_line.items() if step >= 2700]
    assert abs(mean(late) - min(p["difference"] for p in long_line.values())) < 0.002  # "about where"
    expected = [
        f"A probe at 4x (4,800 steps, {epochs:.1f} epochs), seeds 42, 123 and 7",
        "--seeds 42 123 7 --jobs 3 --threads 3 --data wikitext-2",
        "The same three seeds at each length",
        "each seed's (42 / 123 / 7)",
        "shrinks on every seed, by "
        f"{100 * (1 - mean(fair_4x) / mean(fair_2x)):.0f}% on average ({signed(mean(fair_2x), 3, '')} → "
        f"{signed(mean(fair_4x), 3, '')})",
        f"({signed(mean(std_2x), 3, '')} → {signed(mean(std_4x), 3, '')})",
        f"(test perplexity {tests[2]['param-fair']:.2f} against {tests[2]['gba-m2']:.2f}, "
        f"{change(tests[2]['gba-m2'], tests[2]['param-fair'])} for GBA)",
        f"the deficit is smallest at step {smallest:,} ({signed(fair_line[smallest]['difference'], 3, '')} nats) and "
        f"ends at {signed(fair_line[4800]['difference'], 3, '')}, between {signed(min(late), 3, '')} and "
        f"{signed(max(late), 3, '')} since step 2,700",
        "paired by seed (42, 123 and 7)",
        "for the 4,800-step probe (seeds 42, 123 and 7)",
        "--only compute-matched --seeds 42 123 7 --threads 2",
        f"({longest['compute-matched']['steps']:,} steps, {matched_epochs:.1f} epochs, about 25 minutes a seed",
        f"its lead falls fastest of all, from {leads[0]:.3f} to {leads[1]:.3f} to {leads[2]:.3f} nats, as it repeats "
        f"the data more ({matched_epochs:.1f} epochs for its {longest['compute-matched']['steps']:,} steps)",
        f"the wider model is {-statistics.fmean(fair_vs_matched):.3f} nats ahead of it on average "
        f"({' / '.join(signed(d, 3, '') for d in fair_vs_matched)})",
        f"every matched baseline still beats GBA, by {min(leads[2], mean(fair_4x)):.3f} to "
        f"{max(leads[2], mean(fair_4x)):.3f} nats",
    ]
    missing = [line for line in expected if line not in README_PROSE]
    assert not missing, "\n".join(missing)


def test_the_training_length_figures_redraw_from_the_results_files():
    """`gbattn plot results/... --gap` on the repository's results.json files (no run folders) gives the points of
    the published gap.json: a reader can redraw both training-length figures without training."""
    from gbattn.analysis.cli import gap_series

    for figure in ("training-length", "training-length-proxy"):
        for series in json.loads((ROOT / "results" / figure / "gap.json").read_text())["series"]:
            directories = [ROOT / "results" / name for name in series["directory"].split(" + ")]
            redrawn = gap_series(directories, "gba-m2", series["reference"])["points"]
            assert [(p["step"], p["seeds"]) for p in redrawn] == [(p["step"], p["seeds"]) for p in series["points"]]
            assert [p["difference"] for p in redrawn] == pytest.approx([p["difference"] for p in series["points"]],
                                                                       abs=1e-12)


def test_readme_wikitext_tables_are_their_results():
    proxy, design_proxy = compare_rows("cpu-proxy"), compare_rows("gba-design-proxy")
    design = compare_rows("gba-design")
    seeds = ["42", "123", "7"]

    def plain(rows, label, name, std_label="standard"):
        r = rows[label]
        return [name, f"{r['test_ppl']['42']:.2f}",
                "—" if label == std_label else change(r["test_ppl"]["42"], rows[std_label]["test_ppl"]["42"]),
                f"{r['valid_ppl']['42']:.2f}"]

    def matched_name(rows, label="compute-matched"):
        return f"compute-matched standard ({rows[label]['steps']:,} steps)"

    names = {"standard": "standard", "twicing": "twicing", "param-fair": "param-fair standard",
             "gba-m2": "GBA M=2", "compute-matched": "compute-matched standard"}
    expected = []
    for label, name in names.items():
        r = proxy[label]
        name, test, delta, valid = plain(proxy, label, name)
        expected.append([name, str(r["d_model"]), f"{r['parameters']:,}", f"{r['steps']:,}", test, delta, valid])
    assert_table("**`cpu-proxy`**:", expected)

    names = {"standard": "standard", "param-fair": "param-fair standard",
             "compute-matched": matched_name(design_proxy), "gba-m2": "GBA M=2", "gba-m3": "GBA M=3"}
    expected = []
    for label, name in names.items():
        r = design_proxy[label]
        name, test, delta, valid = plain(design_proxy, label, name)
        if label.startswith("gba"):
            delta += f" ({signed(math.log(r['test_ppl']['42'] / design_proxy['standard']['test_ppl']['42']), 3, '')}" \
                     " nats)"
        on_char = "—" if label == "standard" else \
            signed(statistics.fmean(paired(design[label], design["standard"], seeds)), 3, "")
        expected.append([name, str(r["d_model"]), f"{r['parameters']:,}", pflop(r), test, delta, valid, on_char])
    assert_table("### The design study's two best", expected)

    modern = compare_rows("cpu-modern")
    names = {"standard": "standard", "twicing": "twicing", "param-fair": "param-fair standard", "gba-m2": "GBA M=2",
             "compute-matched": matched_name(modern)}
    expected = []
    for label, name in names.items():
        r = modern[label]
        name, test, delta, valid = plain(modern, label, name)
        on_proxy = f"— ({proxy['standard']['test_ppl']['42']:.2f})" if label == "standard" else \
            change(proxy[label]["test_ppl"]["42"], proxy["standard"]["test_ppl"]["42"])
        expected.append([name, str(r["d_model"]), f"{r['parameters']:,}", test, delta, valid, on_proxy])
    assert_table("### Llama-style block", expected)
    for name, seed in (("cpu-modern-seed123", "123"), ("cpu-modern-seed7", "7")):
        rows = compare_rows(name)
        standard, gba = rows["standard"]["test_ppl"][seed], rows["gba-m2"]["test_ppl"][seed]
        assert f"standard {standard:.2f}, GBA {gba:.2f} ({change(gba, standard)})" in README_PROSE

    depth = compare_rows("depth")
    names = [("standard", "standard", "plain"), ("standard-attnres", "standard", "AttnRes-block"),
             ("gba-m2", "GBA M=2", "plain"), ("gba-m2-attnres", "GBA M=2", "AttnRes-block"),
             ("compute-matched", matched_name(depth), "plain")]
    expected = []
    for label, name, residual in names:
        name, test, delta, valid = plain(depth, label, name)
        expected.append([name, residual, f"{depth[label]['parameters']:,}", test, delta, valid])
    assert_table("**`depth`**:", expected)

    postln = compare_rows("cpu-postln")
    names = [(postln, "standard-postln", "standard", "Post-LN", "standard-postln"),
             (postln, "param-fair-postln", f"param-fair standard (d {postln['param-fair-postln']['d_model']})",
              "Post-LN", "standard-postln"),
             (postln, "compute-matched-postln", matched_name(postln, "compute-matched-postln"), "Post-LN",
              "standard-postln"),
             (postln, "gba-m2-postln", "GBA M=2", "Post-LN", "standard-postln"),
             (proxy, "standard", "standard", "Pre-LN", "standard"), (proxy, "gba-m2", "GBA M=2", "Pre-LN", "standard"),
             (depth, "standard-attnres", "standard", "Pre-LN + AttnRes-block", "standard-attnres"),
             (depth, "gba-m2-attnres", "GBA M=2", "Pre-LN + AttnRes-block", "standard-attnres")]
    # The paper column: the published Post-LN (paper-postln) and Pre-LN (paper-wt103) means, Δ against the
    # published standard model of the same stream.
    from gbattn.experiments.recipes import get_recipe

    published = {**{f"{k}/Pre-LN": v for k, v in get_recipe("paper-wt103").published.items()},
                 **{f"{k.removesuffix('-postln')}/Post-LN": v for k, v in get_recipe("paper-postln").published.items()}}

    def paper_cell(label: str, stream: str) -> str:
        key = f"{label.removesuffix('-postln')}/{stream}"
        if key not in published:
            return "—"
        mean, digits = published[key][0], 2 if stream == "Post-LN" else 1
        base = published[f"standard/{stream}"][0]
        return f"{mean:.{digits}f}" + ("" if key.startswith("standard/") else f" ({change(mean, base)})")

    expected = []
    for rows, label, name, stream, std_label in names:
        name, test, delta, valid = plain(rows, label, name, std_label)
        expected.append([name, stream, f"{rows[label]['parameters']:,}", test, delta, valid, paper_cell(label, stream)])
    assert_table("**Post-LN** (`cpu-postln`)", expected)


def over_seeds(first_name: str, later_name: str, first_seeds: tuple[str, ...] = ("42",),
               later_seeds: tuple[str, ...] = ("123", "7")) -> dict[str, dict]:
    """The models of ``later_name`` (results of ``later_seeds``) with the perplexities of ``first_seeds`` from
    ``first_name`` (the same recipe, data and settings, trained earlier) added: one row per model, each seed's
    perplexities in it."""
    first, later = compare_rows(first_name), compare_rows(later_name)
    rows = {}
    for label, other in later.items():
        r = first[label]
        assert sorted(r["test_ppl"]) == sorted(first_seeds) and sorted(other["test_ppl"]) == sorted(later_seeds)
        assert math.isclose(other["train_flops"], r["train_flops"], rel_tol=1e-9)
        rows[label] = with_later_seeds(r, other)
    return rows


def proxy_three_seeds() -> dict[str, dict]:
    """cpu-proxy's five models over seed 42 (results/cpu-proxy, 2026-11-30) and seeds 123 and 7
    (results/cpu-proxy-seeds, 2026-12-05)."""
    assert list(compare_rows("cpu-proxy")) == list(compare_rows("cpu-proxy-seeds"))
    return over_seeds("cpu-proxy", "cpu-proxy-seeds")


def paper_models_three_seeds(rows: dict[str, dict], seeds: list[str]) -> list[list]:
    """The rows of a three-seed table of the paper's five models (cpu-proxy's, cpu-modern's): parameters, FLOPs, test
    perplexity mean ± std and the change of the means, the paired differences to standard and to GBA M=2."""
    std, gba = rows["standard"], rows["gba-m2"]
    names = {"standard": "standard", "twicing": "twicing", "param-fair": "param-fair standard", "gba-m2": "GBA M=2",
             "compute-matched": f"compute-matched standard ({rows['compute-matched']['steps']:,} steps)"}
    mean = {label: mean_test_ppl(row, seeds) for label, row in rows.items()}
    return [[name, f"{rows[label]['parameters']:,}", pflop(rows[label]),
             f"{mean[label]:.2f} ± {statistics.stdev(rows[label]['test_ppl'][s] for s in seeds):.2f}",
             "—" if label == "standard" else change(mean[label], mean["standard"]),
             *("—" if rows[label] is ref else paired_text(paired(rows[label], ref, seeds)) for ref in (std, gba))]
            for label, name in names.items()]


def test_readme_cpu_proxy_three_seed_table_is_its_results():
    """cpu-proxy over seeds 42, 123 and 7: test perplexity mean ± std and the change of the means, then each model's
    paired validation-loss differences to standard and to GBA M=2, and the prose's claims drawn from them."""
    rows, seeds = proxy_three_seeds(), ["42", "123", "7"]
    std, gba = rows["standard"], rows["gba-m2"]
    assert_table("**`cpu-proxy` over seeds 42, 123 and 7**", paper_models_three_seeds(rows, seeds))

    gain = paired(gba, std, seeds)
    tests = seed_changes(gba, std, seeds)
    assert all(d < 0 for d in gain)  # "ahead of standard on every seed"
    assert (f"GBA M=2 is ahead of standard on every seed ({', '.join(tests[:2])} and {tests[2]} test perplexity; "
            f"{signed(statistics.fmean(gain), 3, '')} nats of validation loss on average, paired t-test "
            f"p = {paired_t_p(gain):.2f})") in README_PROSE
    twicing = paired(rows["twicing"], gba, seeds)
    assert min(twicing) < 0 < max(twicing)  # "the seeds disagree"
    behind = {label: paired(gba, rows[label], seeds) for label in ("param-fair", "compute-matched")}
    assert all(d > 0 for diffs in behind.values() for d in diffs)  # "behind both on every seed"
    assert (f"behind the wider model ({signed(statistics.fmean(behind['param-fair']), 3, '')} nats) and the "
            f"longer-trained one ({signed(statistics.fmean(behind['compute-matched']), 3, '')}) on every seed"
            ) in README_PROSE


def modern_three_seeds() -> dict[str, dict]:
    """cpu-modern's five models over seed 42 (results/cpu-modern) and seeds 123 and 7: standard and GBA M=2 from
    results/cpu-modern-seed123 and -seed7, Twicing from results/cpu-modern-twicing, param-fair and compute-matched
    from results/cpu-modern-matched (whose GBA M=2 runs, the references of its compute-matched rows, are seed 7's
    copied and seed 123's trained again)."""
    rows = compare_rows("cpu-modern")
    later = [("cpu-modern-seed123", ("standard", "gba-m2")), ("cpu-modern-seed7", ("standard", "gba-m2")),
             ("cpu-modern-twicing", ("twicing",)), ("cpu-modern-matched", ("param-fair", "compute-matched"))]
    for name, labels in later:
        other = compare_rows(name)
        for label in labels:
            rows[label] = with_later_seeds(rows[label], other[label])
    assert all(sorted(r["test_ppl"]) == ["123", "42", "7"] for r in rows.values())
    return rows


def test_readme_cpu_modern_three_seed_table_is_its_results():
    """cpu-modern over seeds 42, 123 and 7: test perplexity mean ± std and the change of the means, each model's paired
    validation-loss differences to standard and to GBA M=2; the retrained GBA reference; the prose's claims."""
    rows, seeds = modern_three_seeds(), ["42", "123", "7"]
    std, gba = rows["standard"], rows["gba-m2"]
    assert_table("**`cpu-modern` over seeds 42, 123 and 7**", paper_models_three_seeds(rows, seeds))

    reference = compare_rows("cpu-modern-matched")["gba-m2"]  # the compute-matched rows' GBA runs
    assert reference["test_ppl"]["7"] == gba["test_ppl"]["7"]  # seed 7's: the run itself, copied
    again = reference["test_ppl"]["123"]
    assert again != gba["test_ppl"]["123"] and abs(again / gba["test_ppl"]["123"] - 1) < 2e-8
    assert (f"reproduced the earlier run's test perplexity to 2e-8 ({again:.6f} against "
            f"{gba['test_ppl']['123']:.6f})") in README_PROSE

    diffs = {label: paired(rows[label], std, seeds) for label in rows if label != "standard"}
    assert all(min(d) > 0 or max(d) < 0 for d in diffs.values())  # "one sign on every seed"
    assert (f"behind it ({signed(statistics.fmean(diffs['gba-m2']), 3, '')} and "
            f"{signed(statistics.fmean(diffs['twicing']), 3, '')} nats, paired t-tests p = "
            f"{paired_t_p(diffs['gba-m2']):.2f} and {paired_t_p(diffs['twicing']):.2f})") in README_PROSE
    proxy3 = proxy_three_seeds()
    gpt2 = {label: statistics.fmean(paired(proxy3[label], proxy3["standard"], seeds))
            for label in ("param-fair", "compute-matched")}
    assert (f"widening gains more here ({signed(statistics.fmean(diffs['param-fair']), 3, '')} against "
            f"{signed(gpt2['param-fair'], 3, '')} nats) and training for GBA's FLOPs about as much "
            f"({signed(statistics.fmean(diffs['compute-matched']), 3, '')} against "
            f"{signed(gpt2['compute-matched'], 3, '')})") in README_PROSE


def depth_three_seeds() -> dict[str, dict]:
    """depth's AttnRes models over seed 42 (results/depth) and seeds 123 and 7 (results/depth-seeds), the
    parameter-matched AttnRes standard model (results/depth-attnres-matched, all three seeds), and cpu-proxy's
    plain-residual models over the same seeds."""
    rows = {f"{label} plain": row for label, row in proxy_three_seeds().items()}
    rows.update({f"{label.removesuffix('-attnres')} AttnRes-block": row
                 for label, row in over_seeds("depth", "depth-seeds").items()})
    fair = compare_rows("depth-attnres-matched")["param-fair-gba-m2-attnres"]
    assert sorted(fair["valid_ppl"]) == ["123", "42", "7"] and fair["residual"] == "attnres-block"
    rows["param-fair AttnRes-block"] = fair
    return rows


def test_readme_depth_three_seed_table_is_its_results():
    """GBA on the AttnRes stream over seeds 42, 123 and 7, against the standard model of its stream, its own
    parameter-matched AttnRes baseline and the plain models, and the prose's claims drawn from it."""
    rows, seeds = depth_three_seeds(), ["42", "123", "7"]
    gba = rows["gba-m2 AttnRes-block"]
    order = [("standard plain", "standard", "standard plain"),
             ("standard AttnRes-block", "standard", "standard AttnRes-block"),
             ("param-fair AttnRes-block", f"param-fair standard (d {rows['param-fair AttnRes-block']['d_model']})",
              "standard AttnRes-block"),
             ("gba-m2 plain", "GBA M=2", "standard plain"),
             ("gba-m2 AttnRes-block", "GBA M=2", "standard AttnRes-block"),
             ("param-fair plain", f"param-fair standard (d {rows['param-fair plain']['d_model']})", "standard plain"),
             ("compute-matched plain", f"compute-matched standard ({rows['compute-matched plain']['steps']:,} steps)",
              "standard plain")]
    expected = []
    for key, name, reference in order:
        r = rows[key]
        expected.append([name, key.partition(" ")[2], f"{r['parameters']:,}", pflop(r),
                         f"{mean_test_ppl(r, seeds):.2f} ± {statistics.stdev(r['test_ppl'][s] for s in seeds):.2f}",
                         "—" if key == reference else paired_text(paired(r, rows[reference], seeds)),
                         "—" if r is gba else paired_text(paired(r, gba, seeds))])
    assert_table("**`depth` over seeds 42, 123 and 7**", expected)
    gain = paired(gba, rows["standard AttnRes-block"], seeds)
    plain_gain = paired(rows["gba-m2 plain"], rows["standard plain"], seeds)
    assert all(d < 0 for d in gain)  # "ahead of the AttnRes standard model on every seed"
    per_seed = paired_text(gain).removesuffix(" same sign")
    assert (f"GBA M=2 is ahead of the AttnRes standard model on every seed ({per_seed} nats, paired t-test "
            f"p = {paired_t_p(gain):.2f}; on the plain stream "
            f"{signed(statistics.fmean(plain_gain), 3, '')}, p = {paired_t_p(plain_gain):.2f})") in README_PROSE
    behind = {key: paired(gba, rows[key], seeds) for key in ("param-fair AttnRes-block", "compute-matched plain")}
    assert all(d > 0 for diffs in behind.values() for d in diffs)  # "behind ... on every seed"
    fair = rows["param-fair AttnRes-block"]
    assert (f"behind its own parameter-matched AttnRes baseline on every seed "
            f"({signed(statistics.fmean(behind['param-fair AttnRes-block']), 3, '')} nats; test perplexity "
            f"{mean_test_ppl(gba, seeds):.2f} against {mean_test_ppl(fair, seeds):.2f}, for "
            f"{100 * (1 - gba['parameters'] / fair['parameters']):.1f}% fewer parameters and "
            f"{100 * (gba['train_flops'] / fair['train_flops'] - 1):.0f}% more training FLOPs) and behind the plain "
            f"standard model trained for GBA's FLOPs "
            f"({signed(statistics.fmean(behind['compute-matched plain']), 3, '')})") in README_PROSE
    over_plain_fair = paired(gba, rows["param-fair plain"], seeds)
    assert all(d < 0 for d in over_plain_fair)
    widening = [statistics.fmean(paired(rows[f"param-fair {s}"], rows[f"standard {s}"], seeds))
                for s in ("AttnRes-block", "plain")]
    assert (f"It is ahead of the plain param-fair model on every seed "
            f"({signed(statistics.fmean(over_plain_fair), 3, '')}), but that credits it with AttnRes's own gain: "
            f"widening helps the AttnRes model as much as the plain one "
            f"({signed(widening[0], 3, '')} and {signed(widening[1], 3, '')} nats)") in README_PROSE
    assert "not on the Attention Residuals stream (its own AttnRes baseline of the same parameters won on every " \
        "one of 3 seeds)" in README_PROSE


def postln_plateau() -> tuple[dict, dict[tuple[str, int], int | None]]:
    """results/postln-plateau: the step each Post-LN run's training loss left the start-of-training plateau, by (model,
    seed), from the probes (stopped there) and the full runs of results/cpu-postln-seeds."""
    record = json.loads((ROOT / "results" / "postln-plateau" / "plateau.json").read_text(encoding="utf-8"))
    exits = {(r["label"], r["seed"]): r["exit_step"] for r in record["runs"]}
    assert len(exits) == len(record["runs"])  # no model and seed twice (a probe beside a full run)
    assert all(r["run"] == "full run" for r in record["runs"] if r["seed"] in (123, 7))
    return record, exits


def test_readme_post_ln_three_seeds_and_plateau_are_their_results():
    """Post-LN over seeds 42, 123 and 7 (each seed's test perplexity and change, the paired validation loss), the
    plateau table over every seed measured, and the prose's claims drawn from them."""
    rows, seeds = over_seeds("cpu-postln", "cpu-postln-seeds"), ["42", "123", "7"]
    record, exits = postln_plateau()
    std, gba = rows["standard-postln"], rows["gba-m2-postln"]
    fair, matched = rows["param-fair-postln"], rows["compute-matched-postln"]
    names = {"standard-postln": "standard", "param-fair-postln": f"param-fair standard (d {fair['d_model']})",
             "compute-matched-postln": f"compute-matched standard ({matched['steps']:,} steps)",
             "gba-m2-postln": "GBA M=2"}
    assert list(rows) == list(names)
    expected = []
    for label, name in names.items():
        r = rows[label]
        # seed 42's matched runs were not kept (their plateau step is unknown: "—")
        steps = [str(exits[label, int(s)]) if (label, int(s)) in exits else "—" for s in seeds]
        assert steps.count("—") == (1 if r in (fair, matched) else 0)
        expected.append([name, f"{r['parameters']:,}", " / ".join(f"{r['test_ppl'][s]:.2f}" for s in seeds),
                         "—" if r is std else " / ".join(seed_changes(r, std, seeds)),
                         "—" if r is std else paired_text(paired(r, std, seeds)),
                         " / ".join(steps)])
    assert_table("**Post-LN over seeds 42, 123 and 7**", expected)
    behind = {ref: paired(gba, rows[ref], seeds) for ref in ("param-fair-postln", "compute-matched-postln")}
    assert all(d > 0 for diffs in behind.values() for d in diffs)  # "beat GBA on every seed"
    assert "not under Post-LN (both matched models won on every one of 3 seeds)" in README_PROSE  # "Should I use GBA?"
    assert (f"the wider one by {signed(statistics.fmean(behind['param-fair-postln']), 3, '')} nats on average "
            f"({each_seed(behind['param-fair-postln'])}) and the longer-trained one by "
            f"{signed(statistics.fmean(behind['compute-matched-postln']), 3, '')} "
            f"({each_seed(behind['compute-matched-postln'])})") in README_PROSE
    pre = proxy_three_seeds()
    widen, widen_pre = seed_changes(fair, std, seeds), seed_changes(pre["param-fair"], pre["standard"], seeds)
    assert (f"Widening gains less under Post-LN on seeds 123 and 7 ({widen[1]} and {widen[2]}) than on seed 42 "
            f"({widen[0]}; under Pre-LN {widen_pre[0]}, {widen_pre[1]} and {widen_pre[2]} on the same seeds)"
            ) in README_PROSE
    wider_later = [exits["param-fair-postln", s] - exits["standard-postln", s] for s in (123, 7)]
    assert all(d > 0 for d in wider_later)
    assert f"later than standard on both seeds it was measured on (by {wider_later[0]} and {wider_later[1]} steps" \
        in README_PROSE
    postln = ("standard-postln", "gba-m2-postln")
    all_seeds = [42, 123, 7] + sorted({seed for label, seed in exits if label in postln} - {42, 123, 7})
    assert all((label, seed) in exits for label in postln for seed in all_seeds)
    expected = []
    for label, name in zip(postln, ("standard", "GBA M=2")):
        steps = [exits[label, seed] for seed in all_seeds]
        expected.append([name, " / ".join(map(str, steps)), f"{statistics.median(steps):g}", f"{max(steps)}"])
    assert_table("**The Post-LN plateau**", expected)
    assert f"seeds {', '.join(map(str, all_seeds[:-1]))} and {all_seeds[-1]}" in README_PROSE
    assert f"falls below {record['threshold']} nats" in README_PROSE
    delays = {s: exits["gba-m2-postln", s] - exits["standard-postln", s] for s in all_seeds}
    later, same = [s for s, d in delays.items() if d > 0], [s for s, d in delays.items() if d == 0]
    earlier = [s for s, d in delays.items() if d < 0]
    assert earlier == [4]
    assert exits["gba-m2-postln", 7] > 2 * max(exits["standard-postln", s] for s in all_seeds)  # "more than twice"
    assert {min(delays[s] for s in later if s != 7), max(delays[s] for s in later if s != 7)} == {30, 50}
    assert (f"GBA left it later than standard on {len(later)} of {len(all_seeds)} seeds and at the same step on "
            f"{len(same)} (earlier on seed 4), by 30 to 50 steps except on seed 7") in README_PROSE
    pre_ln = {(label, seed): step for (label, seed), step in exits.items() if not label.endswith("-postln")}
    assert len(pre_ln) == 10 and max(pre_ln.values()) == 120  # cpu-proxy's five models, seeds 123 and 7
    assert "each of `cpu-proxy`'s five models is below 6.4 nats by step 120" in README_PROSE
    assert max(exits["standard-postln", s] for s in all_seeds) <= 300  # "leaves it by step 300 on every seed"
    later_runs = compare_rows("cpu-postln-seeds")
    curve, std_curve = ({c["step"]: c["valid_ppl"] for c in later_runs[label]["curves"]["7"]} for label in
                        ("gba-m2-postln", "standard-postln"))
    assert (f"(validation {curve[600]:.0f} at step 600 against standard's {std_curve[600]:.0f})") in README_PROSE
    assert 1.95 < gba["test_ppl"]["7"] / std["test_ppl"]["7"] < 2.05  # "twice standard's perplexity"
    assert f"the seeds disagree, paired t-test p = {paired_t_p(paired(gba, std, seeds)):.2f}" in README_PROSE
    assert (f"under Pre-LN it was ahead on every one of the same seeds "
            f"({', '.join(seed_changes(pre['gba-m2'], pre['standard'], seeds)[:2])} and "
            f"{seed_changes(pre['gba-m2'], pre['standard'], seeds)[2]})") in README_PROSE


def test_readme_gba_m3_three_seeds_is_its_results():
    """GBA M=3 at cpu-proxy over seeds 42 (gba-design-proxy) and 123 and 7 (gba-design-proxy-m3), against cpu-proxy's
    three seeds of the other models; and "Should I use GBA?" line 4 drawn from it."""
    first, later, proxy3 = compare_rows("gba-design-proxy"), compare_rows("gba-design-proxy-m3"), proxy_three_seeds()
    assert list(later) == ["gba-m3"] and sorted(later["gba-m3"]["test_ppl"]) == ["123", "7"]
    assert all(abs(first[label]["test_ppl"]["42"] - proxy3[label]["test_ppl"]["42"]) < 5e-3
               for label in ("standard", "param-fair", "compute-matched", "gba-m2"))  # the same runs' numbers
    m3 = with_later_seeds(first["gba-m3"], later["gba-m3"])
    assert all(later["gba-m3"][key] == m3[key] for key in ("parameters", "steps", "attn_options"))
    seeds = ["42", "123", "7"]
    std = proxy3["standard"]
    tests = seed_changes(m3, std, seeds)
    mean_change = change(mean_test_ppl(m3, seeds), mean_test_ppl(std, seeds))
    gain = paired(m3, std, seeds)
    assert all(d < 0 for d in gain)  # "on every seed"
    versus = {label: paired(m3, proxy3[label], seeds) for label in ("gba-m2", "param-fair", "compute-matched")}
    assert all(d < 0 for d in versus["gba-m2"])  # "ahead of GBA M=2 on every seed"
    assert all(d > 0 for label in ("param-fair", "compute-matched") for d in versus[label])  # "behind both"
    assert (f"GBA M=3 is ahead of standard on every seed ({tests[0]}, {tests[1]} and {tests[2]} test perplexity, "
            f"{mean_change} for the means; {signed(statistics.fmean(gain), 3, '')} nats, paired t-test "
            f"p = {paired_t_p(gain):.2f}) and of GBA M=2 ({paired_text(versus['gba-m2'])}), and behind param-fair "
            f"({signed(statistics.fmean(versus['param-fair']), 3, '')}) and compute-matched "
            f"({signed(statistics.fmean(versus['compute-matched']), 3, '')}) on every seed") in README_PROSE
    m2_change = change(mean_test_ppl(proxy3["gba-m2"], seeds), mean_test_ppl(std, seeds))
    assert (f"which about doubles the gain ({mean_change} against {m2_change} test perplexity at `cpu-proxy`, means "
            f"over 3 seeds; in validation loss ahead of standard and of M=2 on every seed, though within seed noise: "
            f"paired t-tests p = {paired_t_p(gain):.2f} and {paired_t_p(versus['gba-m2']):.2f})") in README_PROSE


def test_readme_upcycle_table_is_results_upcycle():
    rows = compare_rows("upcycle")
    base, continued = rows["base"], rows["standard-continued"]
    expected = []
    for r in rows.values():
        if r is base:
            continue
        test = r["test_ppl"]["42"]
        if r["init_from"]:
            steps, flops = f"{r['steps']:,}", f"{pflop(r)} / {(r['train_flops'] + base['train_flops']) / 1e15:.4f}"
            wall = f"{r['wall_clock_s'] / 60:.1f} / {(r['wall_clock_s'] + base['wall_clock_s']) / 60:.1f} min"
        else:
            steps, flops, wall = f"{r['steps']:,} (all)", pflop(r), f"{r['wall_clock_s'] / 60:.1f} min"
        expected.append([None, f"{r['parameters']:,}", steps, flops, f"{test:.2f}",
                         "—" if r is continued else change(test, continued["test_ppl"]["42"]),
                         f"{r['valid_ppl']['42']:.2f}", wall])
    assert_table("### Upcycling at cpu-proxy", expected)
    assert f"test ppl {base['test_ppl']['42']:.2f}" in README_PROSE
    assert f"adds the base's {pflop(base)} PFLOP" in README_PROSE


def upcycle_three_seeds() -> dict[str, dict]:
    """upcycle's base and continuations over seed 42 (results/upcycle) and seeds 123 and 7 (results/upcycle-seeds);
    GBA from scratch with seeds 123 and 7 is cpu-proxy's (results/cpu-proxy-seeds: the same model and steps)."""
    rows = over_seeds("upcycle", "upcycle-seeds")
    assert list(rows) == ["base", "standard-continued", "gba-upcycled", "gba-shared-upcycled",
                          "standard-continued-compute-matched"]
    scratch, proxy = compare_rows("upcycle")["gba-scratch"], compare_rows("cpu-proxy-seeds")["gba-m2"]
    rows["gba-scratch"] = with_later_seeds(scratch, proxy)
    return rows


def test_readme_upcycle_three_seeds_is_its_results():
    """Upcycling over seeds 42, 123 and 7: each seed's test perplexity, its change against (a) and against GBA from
    scratch, the paired validation loss; and the prose's claims drawn from them."""
    rows, seeds = upcycle_three_seeds(), ["42", "123", "7"]
    continued, scratch = rows["standard-continued"], rows["gba-scratch"]
    names = {"standard-continued": "(a) standard, continued", "gba-upcycled": "(b) GBA M=2, upcycled",
             "gba-shared-upcycled": "(c) GBA M=2, upcycled, `kv_source=shared`",
             "standard-continued-compute-matched": "(d) standard, continued for (b)'s FLOPs"}
    expected = [[name, " / ".join(f"{rows[label]['test_ppl'][s]:.2f}" for s in seeds),
                 "—" if rows[label] is continued else " / ".join(seed_changes(rows[label], continued, seeds)),
                 "—" if rows[label] is continued else paired_text(paired(rows[label], continued, seeds)),
                 " / ".join(seed_changes(rows[label], scratch, seeds))] for label, name in names.items()]
    assert_table("**Upcycling over seeds 42, 123 and 7**", expected)
    bases = " / ".join(f"{rows['base']['test_ppl'][s]:.2f}" for s in seeds)
    assert f"The bases reach test perplexity {bases} after their 600 steps" in README_PROSE
    gains = {label: paired(rows[label], continued, seeds) for label in names if rows[label] is not continued}
    assert all(d < 0 for diffs in gains.values() for d in diffs)  # "on every one of 3 seeds"
    upcycled = [statistics.fmean(gains[label]) for label in ("gba-upcycled", "gba-shared-upcycled")]
    p_values = [paired_t_p(gains[label]) for label in ("gba-upcycled", "gba-shared-upcycled")]
    assert max(p_values) < 0.01
    assert (f"({signed(upcycled[0], 3, '')} and {signed(upcycled[1], 3, '')} nats, paired t-tests p < 0.01; about "
            f"{100 * (1 - mean_test_ppl(rows['gba-upcycled'], seeds) / mean_test_ppl(continued, seeds)):.0f}% test "
            "perplexity)") in README_PROSE
    matched = rows["standard-continued-compute-matched"]
    matched_gain = statistics.fmean(gains["standard-continued-compute-matched"])
    assert round(matched_gain / upcycled[0]) == 9  # "nine times better"
    assert (f"is nine times better ({signed(matched_gain, 3, '')} nats, "
            f"{change(mean_test_ppl(matched, seeds), mean_test_ppl(continued, seeds))} on average)") in README_PROSE
    assert all(d < 0 for d in paired(matched, scratch, seeds))  # "beats even GBA trained from scratch ... every seed"
    assert (f"on every seed ({matched['test_ppl']['42']:.2f} vs {scratch['test_ppl']['42']:.2f} with seed 42)"
            ) in README_PROSE
    shared_vs_residual = paired(rows["gba-shared-upcycled"], rows["gba-upcycled"], seeds)
    assert all(d < 0 for d in shared_vs_residual)
    assert f"ahead by {abs(statistics.fmean(shared_vs_residual)):.3f} nats on average" in README_PROSE
    later = compare_rows("upcycle-seeds")
    wall = [later[label]["wall_clock_s"] for label in ("gba-upcycled", "standard-continued")]  # (report: seed means)
    assert (f"took {wall[0] / wall[1]:.2f}x standard's wall-clock ({wall[0] / 60:.1f} against {wall[1] / 60:.1f} "
            "minutes, means of the two seeds)") in README_PROSE


def test_readme_cpu_char_table_is_results_cpu_char():
    rows = compare_rows("cpu-char")
    std = rows["standard"]
    names = {"standard": "standard", "twicing": "twicing", "param-fair": "param-fair standard", "gba-m2": "GBA M=2",
             "compute-matched": "compute-matched standard"}
    expected = []
    for label, name in names.items():
        r = rows[label]
        ppl = [r["valid_ppl"][s] for s in ("42", "123")]
        losses = f"{nats(r, '42'):.3f} / {nats(r, '123'):.3f}" + (" (nanoGPT reports ~1.88)" if r is std else "")
        expected.append([name, str(r["d_model"]), f"{r['parameters']:,}", f"{r['steps']:,}", losses,
                         f"{statistics.fmean(ppl):.2f} ± {statistics.stdev(ppl):.2f}",
                         "—" if r is std else change(statistics.fmean(ppl),
                                                     statistics.fmean(std["valid_ppl"][s] for s in ("42", "123")))])
    assert_table("**`cpu-char`**:", expected)


def test_deviations_warmup_effect_is_results_cpu_char_warmup_from_zero():
    """docs/deviations.md's measured effect of the authors' warmup formula at cpu-char: the two comparisons'
    per-seed validation losses and GBA's paired gain in each."""
    ours, theirs = compare_rows("cpu-char"), compare_rows("cpu-char-warmup-from-zero")
    seeds = ["42", "123"]

    shift = {label: [nats(theirs[label], s) - nats(ours[label], s) for s in seeds] for label in ("standard", "gba-m2")}
    gains = [paired(rows["gba-m2"], rows["standard"], seeds) for rows in (theirs, ours)]
    theirs_gain, ours_gain = (statistics.fmean(g) for g in gains)
    expected = (f"With the authors' formula the validation loss is {each_seed(shift['standard'])} nats (seed 42 / "
                f"123) for standard and {each_seed(shift['gba-m2'])} for GBA M=2; GBA's paired gain over standard is "
                f"{theirs_gain:+.3f} nats ({each_seed(gains[0])}) against {ours_gain:+.3f} ({each_seed(gains[1])}) "
                f"with gbattn's.")
    deviations = deviations_prose()
    assert expected in deviations, expected
    spread = min(abs(nats(rows[label], "42") - nats(rows[label], "123")) for rows in (ours, theirs) for label in shift)
    assert max(abs(v) for values in shift.values() for v in values) < spread  # "smaller than the seed spread"


def test_deviations_last_batch_effect_is_results_eval_last_batch():
    """docs/deviations.md's measured effect of the authors' dropped last rows, from each row's summed loss: the rows
    their loop keeps (batch starts 0, B, ... below rows - B), and the perplexity over all rows, which is what
    `gbattn eval` printed."""
    record = json.loads((ROOT / "results" / "eval-last-batch" / "row-losses.json").read_text(encoding="utf-8"))
    B, per_row = record["batch_size"], record["predictions_per_row"]
    text = []
    for split in ("valid", "test"):
        sums = record["row_loss_sums"][split]
        kept = B * len(range(0, len(sums) - B, B))
        every, theirs = (math.exp(sum(sums[:n]) / (n * per_row)) for n in (len(sums), kept))
        assert every == pytest.approx(record["eval_ppl"][split], rel=1e-6)
        dropped = math.exp(sum(sums[kept:]) / ((len(sums) - kept) * per_row))
        text.append((len(sums) - kept, len(sums), every, theirs, dropped))
    (nv, rv, av, tv, dv), (nt, rt, at, tt, dt) = text
    expected = (f"the authors' loop drops the last {nv} of {rv:,} valid rows and {nt} of {rt:,} test rows, which "
                f"moves validation perplexity from {av:.2f} to {tv:.2f} ({100 * (tv / av - 1):+.2f}%) and test "
                f"perplexity from {at:.2f} to {tt:.2f} ({100 * (tt / at - 1):+.2f}%). The dropped rows, the end of "
                f"each split, are harder than the average (perplexity {dv:.1f} and {dt:.1f}).")
    deviations = deviations_prose()
    assert expected in deviations, expected
    assert dv > av and dt > at


def test_deviations_scalar_gate_start_is_results_gba_design_scalar_at_half():
    """docs/deviations.md's measured scalar gate started at 0.5 (a = 0) against the design study's scalar gate
    (a = 0.5, a gate of 0.62) on the same seeds, its paired differences to standard in each, and the repeated
    seed-42 run of the design study's row."""
    design = compare_rows("gba-design")
    half = compare_rows("gba-design-scalar-at-half")["gba-gate-scalar"]
    repeat = compare_rows("gba-design-scalar-repro")["gba-gate-scalar"]
    assert half["attn_options"] == {"rounds": 2, "gate": "scalar", "scalar_gate_logit": 0.0}
    assert design["gba-gate-scalar"]["attn_options"] == repeat["attn_options"] == {"rounds": 2, "gate": "scalar"}
    seeds = ["42", "123", "7"]
    authors = design["gba-gate-scalar"]
    shift = paired(half, authors, seeds)
    expected = (f"Started at 0.5, the scalar-gate model reaches validation perplexity {half['valid_ppl_mean']:.2f} ± "
                f"{half['valid_ppl_std']:.2f}, against {authors['valid_ppl_mean']:.2f} ± "
                f"{authors['valid_ppl_std']:.2f} started at 0.62: its validation loss moves by {each_seed(shift)} nats "
                f"(seed 42 / 123 / 7), "
                f"differences of both signs and far below the seeds' spread. Its paired difference to standard is "
                f"{each_seed(paired(half, design['standard'], seeds))} against "
                f"{each_seed(paired(authors, design['standard'], seeds))}.")
    deviations = deviations_prose()
    assert expected in deviations, expected
    assert min(shift) < 0 < max(shift)  # "of both signs"
    spread = max(nats(authors, s) for s in seeds) - min(nats(authors, s) for s in seeds)
    assert max(abs(v) for v in shift) < spread / 5  # "far below the seeds' spread"
    again = abs(nats(repeat, "42") - nats(authors, "42"))
    assert again < 1e-6 and f"reached the same validation loss to {again:.0e} nats" in deviations


def test_deviations_post_ln_final_norm_is_results_cpu_postln_final_norm():
    """docs/deviations.md's measured final LayerNorm in Post-LN models against cpu-postln's rows on the same seed,
    GBA's gain over standard with and without it, and the variation of that gain over seeds it is compared with
    (cpu-postln, seeds 42, 123 and 7)."""
    report = json.loads((ROOT / "results" / "cpu-postln-final-norm" / "results.json").read_text())
    assert report["sets"] == {"final_norm": True} and report["seeds"] == [42]
    ours, theirs = compare_rows("cpu-postln"), compare_rows("cpu-postln-final-norm")
    std, gba = "standard-postln", "gba-m2-postln"
    d = {label: ours[label]["parameters"] for label in (std, gba)}
    assert all(theirs[label]["parameters"] - d[label] == 2 * 128 for label in (std, gba))  # "256 more parameters"
    shift = [nats(theirs[label], "42") - nats(ours[label], "42") for label in (std, gba)]
    with_norm, without = (paired(rows[gba], rows[std], ["42"])[0] for rows in (theirs, ours))
    seeds = over_seeds("cpu-postln", "cpu-postln-seeds")
    spread = paired(seeds[gba], seeds[std], ["42", "123", "7"])
    ppl = {(name, label): f"{rows[label]['valid_ppl']['42']:.2f}" for name, rows in (("ours", ours), ("theirs", theirs))
           for label in (std, gba)}
    test_change = [f"{100 * (rows[gba]['test_ppl']['42'] / rows[std]['test_ppl']['42'] - 1):+.1f}%"
                   for rows in (theirs, ours)]
    expected = (f"validation perplexity is {ppl['theirs', std]} for standard and {ppl['theirs', gba]} for GBA M=2, "
                f"against {ppl['ours', std]} and {ppl['ours', gba]} without: {shift[0]:+.3f} and {shift[1]:+.3f} nats. "
                f"GBA's gain over standard in validation loss halves, from {without:+.3f} to {with_norm:+.3f} nats "
                f"(test perplexity {test_change[0]} against {test_change[1]}). One seed: that change, "
                f"{with_norm - without:.3f} nats, is smaller than the {abs(spread[1] - spread[0]):.3f} nats by which "
                f"GBA's paired difference to standard varied between seeds 42 and 123 in these Post-LN models without "
                f"it (`cpu-postln`: {each_seed(spread[:2]).replace(' / ', ' and ')} nats; seed 7, whose start "
                f"stalled, {spread[2]:+.3f}")
    assert expected in deviations_prose(), expected
    assert with_norm - without < abs(spread[1] - spread[0]) and 1.7 < without / with_norm < 2.3  # "halves"


def test_deviations_twicing_layer_choice_is_results_cpu_char_twicing_last_layer():
    """docs/deviations.md's measured Twicing in the last layer only, against cpu-char's standard and every-layer
    Twicing on the same seeds."""
    table, last = compare_rows("cpu-char"), compare_rows("cpu-char-twicing-last-layer")["twicing"]
    seeds = ["42", "123"]
    assert last["attn_options"] == {"layers": [-1]} and table["twicing"]["attn_options"] in ({}, None)

    def ppl(row):
        values = [row["valid_ppl"][s] for s in seeds]
        return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}"

    def each(reference):
        return each_seed(paired(last, reference, seeds))

    expected = (f"Twicing in the last layer only reaches validation perplexity {ppl(last)}, against "
                f"{ppl(table['twicing'])} in every layer and {ppl(table['standard'])} for standard: its validation "
                f"loss is {each(table['standard'])} nats (seed 42 / 123) from standard's, and "
                f"{each(table['twicing'])} from every-layer Twicing's.")
    deviations = deviations_prose()
    assert expected in deviations, expected
    assert all(d > 0 for d in paired(last, table["standard"], seeds))  # "none of Twicing's gain"


def test_deviations_dropout_sites_are_results_dropout_sites():
    """docs/deviations.md entry 4's measured dropout sites at cpu-char with dropout 0.1: each model's shift in
    validation loss from the earlier sites to the authors' on the same seeds, and GBA's paired difference to
    standard under each (a changed cell, or runs with other settings, turn it red)."""
    seeds = ["7", "42", "123"]
    authors, before = compare_rows("dropout-sites-authors"), compare_rows("dropout-sites-before")
    earlier = ["embedding", "attention", "attn-output", "ffn-output"]
    for name, sets in (("dropout-sites-authors", {"dropout": 0.1}),
                       ("dropout-sites-before", {"dropout": 0.1, "dropout_sites": earlier})):
        report = json.loads((ROOT / "results" / name / "results.json").read_text())
        assert (report["recipe"], report["sets"], report["seeds"]) == ("cpu-char", sets, [7, 42, 123])

    def gain(rows):
        diffs = paired(rows["gba-m2"], rows["standard"], seeds)
        return f"{statistics.fmean(diffs):+.3f} ({each_seed(diffs)})"

    expected = (f"the authors' sites minus the earlier ones: standard "
                f"{each_seed(paired(authors['standard'], before['standard'], seeds))} nats (seed 7 / 42 / 123), GBA "
                f"M=2 {each_seed(paired(authors['gba-m2'], before['gba-m2'], seeds))}. GBA's paired difference to "
                f"standard is {gain(authors)} nats with the authors' sites and {gain(before)} with the earlier ones.")
    assert expected in deviations_prose(), expected
    assert all(d < 0 for d in paired(authors["gba-m2"], before["gba-m2"], seeds))  # "on every seed"
    shifts = paired(authors["standard"], before["standard"], seeds)
    assert min(shifts) < 0 < max(shifts)  # "both ways"
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    below = [f"{-statistics.fmean(paired(rows['gba-m2'], rows['standard'], seeds)):.3f}" for rows in (authors, before)]
    assert (f"At `cpu-char` with dropout 0.1 (3 seeds), GBA's validation loss was {below[0]} nats below standard's "
            f"with these sites and {below[1]} below with gbattn's earlier ones") in readme
    # the matched baselines trained into the same comparison, with the same dropout: ahead of GBA on every seed
    assert authors["param-fair"]["param_matched_to"] == authors["compute-matched"]["compute_matched_to"] == "gba-m2"
    behind = [paired(authors["gba-m2"], authors[label], seeds) for label in ("param-fair", "compute-matched")]
    assert all(d > 0 for diffs in behind for d in diffs)  # "on every seed"
    assert (f"the parameter-matched and the compute-matched standard models were {statistics.fmean(behind[0]):.3f} "
            f"and {statistics.fmean(behind[1]):.3f} nats below GBA, on every seed") in readme


def warmup_cells(record: dict) -> dict[tuple, dict[int, float]]:
    """results/warmup-fit by (setting, steps, peak lr, warmup used): each seed's validation perplexity (a run the
    fitting rule shortened and the same warmup given by hand are one cell, and must agree)."""
    cells: dict[tuple, dict[int, float]] = {}
    for run in record["runs"]:
        seen = cells.setdefault((run["setting"], run["steps"], run["lr"], run["warmup_used"]), {})
        assert seen.get(run["seed"], run["valid_ppl"]) == run["valid_ppl"], run["command"]
        seen[run["seed"]] = run["valid_ppl"]
    return cells


def test_deviations_warmup_fit_is_results_warmup_fit():
    """docs/deviations.md entry 9: its table is results/warmup-fit, each fitted run shortened its default warmup to a
    tenth of the run, and what the entry says of the two rules holds on every seed measured."""
    record = json.loads((ROOT / "results" / "warmup-fit" / "runs.json").read_text(encoding="utf-8"))
    for run in record["runs"]:
        if run["fit_warmup"]:
            assert run["warmup_used"] == round(run["steps"] / 10) and run["warmup_asked"] > run["steps"] / 2
    cells = warmup_cells(record)
    lines = ["| setting | steps | peak lr | warmup | valid ppl, seed 42 | seed 123 |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for (setting, steps, lr, warmup), ppl in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][3])):
        lines.append(f"| {setting} | {steps:,} | {lr:g} | {warmup:,} | "
                     + " | ".join(f"{ppl[s]:.2f}" if s in ppl else "—" for s in (42, 123)) + " |")
    deviations = (ROOT / "docs" / "deviations.md").read_text(encoding="utf-8")
    assert "\n".join(lines) in deviations
    # "half to all of the run, shortened to a tenth, trained worse in every case": each such warmup measured
    # beside the tenth, on each seed both have
    compared = 0
    for (setting, steps, lr, warmup), ppl in cells.items():
        tenth = cells.get((setting, steps, lr, round(steps / 10)), {})
        if steps / 2 < warmup <= steps:
            for seed in set(ppl) & set(tenth):
                assert tenth[seed] > ppl[seed], (setting, warmup, seed)
                compared += 1
    assert compared >= 5
    prose = " ".join(deviations.split())

    def longer(setting):
        steps = next(k[1] for k in cells if k[0] == setting)
        over = next(v for k, v in cells.items() if k[0] == setting and k[3] > steps)
        tenth = next(v for k, v in cells.items() if k[0] == setting and k[3] == round(steps / 10))
        return " and ".join(f"{over[s]:.2f} to {tenth[s]:.2f} (seed {s})" for s in sorted(set(over) & set(tenth)))

    assert f"validation perplexity went from {longer('paper schedule')}" in prose
    assert f"from {longer('cpu-proxy')}" in prose


def test_readme_quickstart_training_is_the_cpu_char_gba_run():
    """The Quickstart's `gbattn train --preset cpu-char --attn boosted` is cpu-char's GBA M=2 run (seed 42)."""
    gba = compare_rows("cpu-char")["gba-m2"]
    assert (f"{gba['steps']:,} steps; valid loss {nats(gba, '42'):.3f} (ppl {gba['valid_ppl']['42']:.2f})"
            in README_PROSE)


def test_readme_recipe_times_are_the_measured_wall_clock():
    """The recipes table's CPU times are the sum of the recorded runs' wall-clock for the recipe's seeds."""
    from gbattn.experiments.recipes import get_recipe

    def duration(recipe: str, directory: str | None = None) -> str:
        rows = compare_rows(directory or recipe)
        minutes = sum(r["wall_clock_s"] for r in rows.values()) * len(get_recipe(recipe).seeds) / 60
        return f"~{minutes:.0f} min" if minutes < 90 else f"~{minutes / 60:.1f} h"

    scale = {row[0]: row[2] for row in readme_table("## Reproducing the paper's tables")}
    for recipe in ("cpu-proxy", "cpu-modern", "upcycle", "cpu-char", "gba-design", "gba-design-proxy",
                   "cpu-baselines"):  # (cpu-baselines said ~31 min, its --jobs 2 wall time: the runs took 55)
        assert scale[f"`{recipe}`"] == f"2 CPU cores, {duration(recipe)}", recipe
    a_seed = sum(r["wall_clock_s"] for r in compare_rows("cpu-proxy-long").values()) / 3600
    assert scale["`cpu-proxy-long`"] == f"2 CPU cores, ~{a_seed:.1f} h a seed"
    # its seed 7, on an idle machine (seeds 42 and 123 ran beside another experiment)
    assert scale["`cpu-char-long`"] == f"2 CPU cores, {duration('cpu-char-long', 'cpu-char-long-seed7')}"
    assert scale["`cpu-postln`, `depth`"] == f"2 CPU cores, {duration('cpu-postln')} and {duration('depth')}"


def test_readme_reference_tables_name_every_variant_preset_and_recipe():
    """The README's variants, presets and recipes tables have a row for each registered variant (naming each of
    its options), each preset (its d, layers, heads (K/V), T and vocabulary, as config.py holds them) and each
    recipe: a variant, preset or recipe added without its row, or a preset reshaped, passed every test."""
    import dataclasses

    from gbattn.attention.registry import VARIANTS
    from gbattn.config import PRESETS
    from gbattn.experiments.recipes import RECIPES

    options = {row[0].strip("`"): row[2] for row in readme_table("## Attention variants")}
    assert list(options) == list(VARIANTS)
    unnamed = {name: [f.name for f in dataclasses.fields(cls.Options) if f"`{f.name}`" not in options[name]]
               for name, cls in VARIANTS.items()}
    assert all(not missing for missing in unnamed.values()), unnamed
    shapes = {row[0].strip("`"): row[1:6] for row in readme_table("## Presets and parameter counts")}
    assert shapes == {name: [str(m["d_model"]), str(m["n_layers"]),
                             f"{m['n_heads']} ({m['n_kv_heads']})" if m.get("n_kv_heads") else str(m["n_heads"]),
                             str(m["block_size"]), f"{m['vocab_size']:,}"]
                      for name, m in ((name, preset.model) for name, preset in PRESETS.items())}
    recipes = re.findall(r"`([\w-]+)`", " ".join(row[0] for row in readme_table("## Reproducing the paper's tables")))
    assert sorted(recipes) == sorted(RECIPES)


def test_readme_should_i_use_gba_is_the_tables():
    """The summary's numbers are the tables' (the step, memory and decode ranges over every CPU benchmark
    of paper-small)."""
    gpu, design = compare_rows(GPU), compare_rows("gba-design")
    modern, modern123 = compare_rows("cpu-modern"), compare_rows("cpu-modern-seed123")
    design_proxy = compare_rows("gba-design-proxy")
    seeds = ["42", "123", "7"]
    char_gain = statistics.fmean(paired(design["gba-m2"], design["standard"], seeds))
    paper_gain = change(mean_test_ppl(gpu["gba-m2"], seeds), mean_test_ppl(gpu["standard"], seeds))
    paper_diffs = paired(gpu["gba-m2"], gpu["standard"], seeds)
    assert all(d < 0 for d in paper_diffs)
    proxy3 = proxy_three_seeds()
    proxy_gain = change(mean_test_ppl(proxy3["gba-m2"], seeds), mean_test_ppl(proxy3["standard"], seeds))
    proxy_diffs, char_diffs = (paired(rows["gba-m2"], rows["standard"], seeds) for rows in (proxy3, design))
    assert all(d < 0 for d in proxy_diffs + char_diffs)  # "each on every one of 3 seeds"
    assert (f"{paper_gain} test perplexity at paper scale (every one of 3 seeds, paired t-test of the validation "
            f"losses p = "
            f"{paired_t_p(paper_diffs):.2f}, one H200), {proxy_gain} at `cpu-proxy` and "
            f"{signed(char_gain, 3, '')} nats on `cpu-char` (each on every one of 3 seeds, but within seed noise "
            f"there: paired t-tests p = {paired_t_p(proxy_diffs):.2f} and {paired_t_p(char_diffs):.2f})"
            ) in README_PROSE
    modern7 = compare_rows("cpu-modern-seed7")
    assert (f"{change(modern['gba-m2']['test_ppl']['42'], modern['standard']['test_ppl']['42'])}, "
            f"{change(modern123['gba-m2']['test_ppl']['123'], modern123['standard']['test_ppl']['123'])} and "
            f"{change(modern7['gba-m2']['test_ppl']['7'], modern7['standard']['test_ppl']['7'])} (worse) "
            "on three seeds") in README_PROSE
    upcycle3 = upcycle_three_seeds()
    matched, upcycled, continued = (upcycle3[k] for k in ("standard-continued-compute-matched", "gba-upcycled",
                                                           "standard-continued"))
    assert all(d < 0 for d in paired(matched, upcycled, seeds) + paired(upcycled, continued, seeds))  # "every seed"
    means = [mean_test_ppl(row, seeds) for row in (matched, upcycled, continued)]
    assert (f"gives {100 * (1 - means[0] / means[1]):.1f}% lower perplexity than the upcycled GBA on average, "
            f"{means[0]:.2f} against {means[1]:.2f}, ahead on every one of 3 seeds; the upcycled GBA itself is "
            f"{100 * (1 - means[1] / means[2]):.1f}% ahead of the standard model continued for the same steps, also "
            "on every seed)") in README_PROSE

    cpu = [bench_rows(f"{name}/bench.json") for name in ("bench-cpu", "bench-cpu-nodrop", "bench-compile-cpu",
                                                          "bench-compile-cpu-recheck", "bench-compile-cpu-xeon")]
    h200 = bench_rows("gpu-paper-small-wt2/bench-cuda.json")
    gba, std = cpu[0]["boosted"], cpu[0]["standard"]
    steps = [b["boosted"]["step_ratio"] for b in cpu]
    memory = [b["boosted"]["memory_ratio"] for b in cpu]
    decode = [b["boosted"]["decode_ratio"] for b in cpu]
    compiled = [b["standard · compiled"]["decode_tokens_per_s"] / b["boosted · compiled"]["decode_tokens_per_s"]
                for b in cpu if "boosted · compiled" in b]
    assert (f"(M=2, `paper-small`) {100 * (gba['parameters'] / std['parameters'] - 1):.0f}% more parameters and "
            f"{100 * (gba['flop_ratio'] - 1):.0f}% more training FLOPs, {min(steps):.1f}–{max(steps):.1f}x the step "
            f"time on a CPU ({h200['boosted']['step_ratio']:.1f}x on an H200 at this small size), "
            f"{100 * (min(memory) - 1):.0f}–{100 * (max(memory) - 1):.0f}% more training memory on a CPU "
            f"({h200['boosted']['memory_ratio']:.2f}x on the H200), a second KV cache and "
            f"{min(decode):.2f}–{max(decode):.2f}x the time per decoded token on a CPU "
            f"({min(compiled):.2f}–{max(compiled):.2f}x with the compiled decode step; "
            f"{h200['boosted']['decode_ratio']:.2f}x on the H200, eager), over the five CPU benchmarks") in README_PROSE
    assert len(cpu) == 5  # "five"
    recomputing = bench_rows("bench-activation-checkpointing-cpu/bench.json")
    assert (f"With activation checkpointing on both, its training memory was "
            f"{recomputing['boosted · recomputed']['memory_ratio']:.2f}x standard's, for about 1.4x the step time of "
            f"either without it (one CPU benchmark; the probe's figure") in README_PROSE

    m3, std = design_proxy["gba-m3"], design_proxy["standard"]
    flops = 100 * (m3["train_flops"] / std["train_flops"] - 1)
    assert (f"paired t-tests p = 0.14 and 0.16) for "  # the gain and its p: test_readme_gba_m3_three_seeds_...
            f"{100 * (m3['parameters'] / std['parameters'] - 1):.0f}% more parameters and "
            f"{flops:.0f}% more training FLOPs than standard") in README_PROSE


def test_readme_should_i_use_gba_claims_no_more_than_the_runs_show():
    """Line 1's "ahead in every GPT-2-style run" is every GPT-2-style results file's GBA M=2 against the standard model
    of its block and stream, seed by seed; line 2's design-study configurations are each checked against
    baselines matched to it (the test after the next), and its training-length claim on WikiText-2 every seed of
    cpu-proxy-long; line 5 gives the
    paper-scale means over three seeds, where the wider and the longer-trained models beat GBA on every seed."""
    pairs = [(GPU, "gba-m2", "standard"), ("gpu-paper-small-wt2", "gba-m2", "standard"),
             ("cpu-proxy", "gba-m2", "standard"), ("cpu-proxy-seeds", "gba-m2", "standard"),
             ("cpu-char", "gba-m2", "standard"),
             ("gba-design", "gba-m2", "standard"),
             ("cpu-char-long", "gba-m2", "standard"), ("cpu-char-long-seed7", "gba-m2", "standard"),
             ("cpu-proxy-long", "gba-m2", "standard"),
             ("gba-design-proxy", "gba-m2", "standard"),
             ("cpu-postln", "gba-m2-postln", "standard-postln"), ("depth", "gba-m2", "standard"),
             ("depth", "gba-m2-attnres", "standard-attnres"), ("depth-seeds", "gba-m2-attnres", "standard-attnres")]
    for name, model, reference in pairs:
        rows = compare_rows(name)
        seeds = sorted(set(rows[model]["valid_ppl"]) & set(rows[reference]["valid_ppl"]))
        assert seeds and all(d < 0 for d in paired(rows[model], rows[reference], seeds)), name
    assert "In a GPT-2-style Pre-LN block it came out ahead of standard attention of the same width in every run**:" \
        in README_PROSE
    postln, seeds = over_seeds("cpu-postln", "cpu-postln-seeds"), ["42", "123", "7"]
    changes = seed_changes(postln["gba-m2-postln"], postln["standard-postln"], seeds)
    assert [c[0] for c in changes] == ["\u2212", "+", "+"]  # ahead on seed 42 only
    assert (f"Under Post-LN it did not: at `cpu-proxy` it was ahead on seed 42 ({changes[0]}), behind on seed 123 "
            f"({changes[1]}), and on seed 7 its training stalled and it ended {changes[2]} worse") in README_PROSE

    design = compare_rows("gba-design")
    m2 = design["gba-m2"]
    cheaper = [label for label, r in design.items() if label.startswith("gba")
               and r["parameters"] < m2["parameters"] and r["train_flops"] < m2["train_flops"]]
    assert all(design[label]["parameters"] < design["param-fair"]["parameters"] for label in cheaper)
    assert len(cheaper) == len(CHEAPER_MATCHED)  # each, and GBA M=3, against baselines matched to it: the test below

    seeds = ["42", "123", "7"]
    before, after = gba_gaps(proxy_three_seeds(), compare_rows("cpu-proxy-long"), "param-fair", seeds)
    assert all(0 < b < a for a, b in zip(before, after))
    longest = compare_rows("cpu-proxy-4x")
    gaps_4x = paired(longest["gba-m2"], longest["param-fair"], seeds)
    matched_4x = paired(longest["gba-m2"], longest["compute-matched"], seeds)
    assert all(d > 0 for d in gaps_4x) and all(d > 0 for d in matched_4x)
    assert (f"2x on WikiText-2 (where its deficit to the wider model shrank on every one of 3 seeds, "
            f"{signed(statistics.fmean(before), 3, '')} → {signed(statistics.fmean(after), 3, '')} nats, and stayed a "
            f"deficit on every one, also at 4x on each of 3 seeds measured, "
            f"{signed(statistics.fmean(gaps_4x), 3, '')}, where the standard model trained for its FLOPs was ahead on "
            f"every seed too, by {statistics.fmean(matched_4x):.3f})") in README_PROSE

    gpu = compare_rows(GPU)
    fair, matched, gba = (gpu[label] for label in ("param-fair", "compute-matched", "gba-m2"))
    assert all(d > 0 for d in paired(gba, fair, seeds)) and all(d > 0 for d in paired(gba, matched, seeds))
    assert "not at paper scale (the wider model won on every one of 3 seeds)" in README_PROSE
    fair, matched, gba = (mean_test_ppl(r, seeds) for r in (fair, matched, gba))
    assert (f"(at paper scale, mean test perplexity over 3 seeds: {fair:.2f} for the wider model and {matched:.2f} "
            f"for the longer-trained one, against {gba:.2f} for GBA)") in README_PROSE


def test_readme_denoise_table_and_gate_spread_are_results_denoise():
    tables = json.loads((ROOT / "results" / "denoise" / "results.json").read_text())["tables"]
    rounds = tables["rounds"]["rows"]
    assert_table("## Synthetic pattern denoising", [
        ["ours (mean ± std, 3 seeds)", *(f"{r['ours']['mean']:.1f} ± {r['ours']['std']:.1f}" for r in rounds),
         f"{tables['rounds']['bayes']:.1f}"],
        ["paper v1", *(f"{r['paper_v1']:.1f}" for r in rounds), "—"],
        ["paper revision", *(f"{r['paper_revision']:.1f}" for r in rounds), f"{tables['rounds']['bayes']:.1f}"]])
    gates = [r["ours"]["mean"] for r in tables["gates"]["rows"] if r["gate"] != "baseline"]
    assert len(gates) == 5 and f"the five gates within {max(gates) - min(gates):.1f} points" in README_PROSE
    # the prose's DEQ, difficulty and one-step numbers (and docs/method.md's DEQ ones) are the tables' too
    deq = {c["key"]: c for c in tables["deq"]["columns"]}
    converged = " / ".join(f"{deq[key]['converged']['mean']:.1f}" for key in ("d16-K4-s0.5", "d32-K8-s0.5",
                                                                              "d64-K16-s0.5"))
    assert f"the DEQ collapsing to chance: {converged}% for K = 4 / 8 / 16" in README_PROSE
    method = " ".join((ROOT / "docs" / "method.md").read_text().split())
    assert f"gbattn: {converged}%, results/denoise" in method
    gain = tables["difficulty"]["columns"][0]
    assert gain["key"] == "d64-K16-s0.3"
    assert (f"the gain at d=64, K=16, σ=0.3 is {gain['delta']['mean']:+.1f} ± {gain['delta']['std']:.1f} points "
            f"(paper {gain['paper_delta']:+.1f})") in README_PROSE
    one_step = deq["d64-K16-s0.5"]
    assert (f"the one-step row at d=64, σ=0.5 is {one_step['one_step']['mean']:.1f} (paper "
            f"{one_step['paper_one_step']:.1f}") in README_PROSE


def test_readme_speed_tables_are_the_bench_files():
    dropout, nodrop = bench_rows("bench-cpu/bench.json"), bench_rows("bench-cpu-nodrop/bench.json")
    names = {"standard": "standard", "boosted": "boosted (M=2)",
             "boosted:kv_source=shared": "boosted, kv_source=shared",
             "twicing": "twicing", "gated": "gated", "differential": "differential"}
    mib = 1 << 20

    def step(v):
        lo, hi = v["step_ratio_range"]
        return f"{v['step_ratio']:.3f} ({lo:.2f}–{hi:.2f})"

    expected = []
    for variant, name in names.items():
        d, n = dropout[variant], nodrop[variant]
        standard = variant == "standard"
        expected.append([
            name, f"{n['parameters']:,}", f"{n['flop_ratio']:.3f}",
            f"1.000 ({1000 * d['step_s']:,.0f} ms)" if standard else step(d), f"{d['step_over_flop_ratio']:.3f}",
            f"1.000 ({1000 * n['step_s']:,.0f} ms)" if standard else step(n), f"{n['step_over_flop_ratio']:.3f}",
            f"1.00 ({n['peak_memory_bytes'] / mib:,.0f} MiB)" if standard else f"{n['memory_ratio']:.2f}",
            f"1.00 ({n['decode_tokens_per_s']:,.0f} tokens/s)" if standard else f"{n['decode_ratio']:.2f}"])
    assert_table("On this project's 2-core CPU (x86_64, torch 2.13 CPU build, batch 8 x 255", expected)

    h200 = bench_rows("gpu-paper-small-wt2/bench-cuda.json")
    assert_table("On one H200 (`gbattn bench", [
        [name, f"{1000 * v['step_s']:.1f}", f"{v['tokens_per_s']:,.0f}", f"{v['peak_memory_bytes'] / mib:,.0f}",
         f"{v['step_ratio']:.3f}", f"{v['flop_ratio']:.3f}", f"{v['step_over_flop_ratio']:.3f}",
         f"{v['decode_tokens_per_s']:,.0f}"] for variant, name in names.items() for v in [h200[variant]]])

    def compile_rows(bench):
        return [[name, f"{1000 * bench[variant]['step_s']:.1f}", f"{1000 * c['step_s']:.1f}",
                 f"{c['compiled_step_speedup']:.2f}", f"{bench[variant]['decode_tokens_per_s']:,.0f}",
                 f"{c['decode_tokens_per_s']:,.0f}", f"{c['compiled_decode_speedup']:.2f}",
                 " / ".join(f"{c['compile_s'][part]:.0f}" if c['compile_s'][part] >= 10  # two digits below 10
                            else f"{c['compile_s'][part]:.2g}" for part in ("train", "decode"))]
                for variant, name in (("standard", "standard"), ("boosted", "boosted (M=2)"))
                for c in [bench[f"{variant} · compiled"]]]

    first, recheck, proxy, xeon = (bench_rows(f"{name}/bench.json") for name in (
        "bench-compile-cpu", "bench-compile-cpu-recheck", "bench-compile-cpu-proxy", "bench-compile-cpu-xeon"))
    xeon_rows = [f"{1000 * xeon[v]['step_s']:.1f} / {1000 * xeon[f'{v} · compiled']['step_s']:.1f} ms {name}"
                 for v, name in (("standard", "standard"), ("boosted", "GBA"))]
    xeon_speed = {v: xeon[f"{v} · compiled"] for v in ("standard", "boosted")}
    assert (f"training steps {xeon_rows[0]} and {xeon_rows[1]} "
            f"({xeon_speed['standard']['compiled_step_speedup']:.2f}x and "
            f"{xeon_speed['boosted']['compiled_step_speedup']:.2f}x), decoding "
            f"{xeon['standard']['decode_tokens_per_s']:,.0f} → {xeon_speed['standard']['decode_tokens_per_s']:,.0f} "
            f"tokens/s standard ({xeon_speed['standard']['compiled_decode_speedup']:.2f}x) and "
            f"{xeon['boosted']['decode_tokens_per_s']:,.0f} → {xeon_speed['boosted']['decode_tokens_per_s']:,.0f} GBA "
            f"({xeon_speed['boosted']['compiled_decode_speedup']:.2f}x)") in README_PROSE
    assert_table("### Compiled vs eager", compile_rows(first))
    assert_table("The same at the CPU recipes' size", compile_rows(proxy))

    def pays_after(bench, variant):
        """New tokens after which compiling the decode step has paid its compile time, to the hundred."""
        eager, compiled = bench[variant], bench[f"{variant} · compiled"]
        saved = 1 / eager["decode_tokens_per_s"] - 1 / compiled["decode_tokens_per_s"]
        return f"{round(compiled['compile_s']['decode'] / saved, -2):,.0f}"

    assert (f"only after about {pays_after(recheck, 'standard')} (standard) to {pays_after(recheck, 'boosted')} "
            "(GBA) new tokens") in README_PROSE
    assert (f"{pays_after(first, 'boosted')} (GBA) to {pays_after(first, 'standard')} (standard) new tokens in the "
            f"first run and {pays_after(recheck, 'boosted')} to {pays_after(recheck, 'standard')} in the re-run "
            f"({pays_after(proxy, 'boosted')} and {pays_after(proxy, 'standard')} at `cpu-proxy` size)") in README_PROSE
    assert (f"paying after about {pays_after(xeon, 'standard')} and {pays_after(xeon, 'boosted')} new tokens"
            in README_PROSE)
    # the range the README gives covers every machine measured
    for variant, low, high in (("standard", 1.15, 1.6), ("boosted", 1.2, 2.0)):
        measured = [b[f"{variant} · compiled"]["compiled_decode_speedup"] for b in (first, recheck, xeon)]
        assert round(min(measured), 2) == low and round(max(measured), 1) == high, (variant, measured)
    cuda, owt = bench_rows("bench-compile-cuda/bench.json"), bench_rows("bench-compile-cuda-owt/bench.json")
    assert_table("On CUDA, one H200 (stage `bench`", compile_rows(cuda))
    assert_table("At `owt-125m` (stage `owt`", compile_rows(owt))
    assert_table("GBA (M=2) against standard on the H200", [
        [f"`{preset}`", *(" / ".join(f"{b[v][key]:.{digits}f}" for v in ("boosted", "boosted · compiled"))
                          for key, digits in (("step_ratio", 3),)), f"{b['boosted']['flop_ratio']:.3f}",
         *(" / ".join(f"{b[v][key]:.{digits}f}" for v in ("boosted", "boosted · compiled"))
           for key, digits in (("step_over_flop_ratio", 3), ("decode_ratio", 2)))]
        for preset, b in (("paper-small", cuda), ("owt-125m", owt))])
    gba, std = cuda["boosted · compiled"], cuda["standard · compiled"]
    assert (f"(step / FLOP {gba['step_over_flop_ratio']:.3f} at `paper-small`, "
            f"{owt['boosted · compiled']['step_over_flop_ratio']:.3f} at `owt-125m`), where eagerly at `paper-small` "
            f"it cost {100 * (cuda['boosted']['step_over_flop_ratio'] - 1):.1f}% more than its FLOPs") in README_PROSE
    assert (f"yet standard reaches {std['decode_tokens_per_s']:,.0f} tokens/s, not the 3,000 we aimed for, and GBA's "
            f"decoding costs {gba['decode_ratio']:.2f}x standard's per token, not the 1.25x") in README_PROSE
    assert (f"pays after {pays_after(cuda, 'boosted')} (GBA) to {pays_after(cuda, 'standard')} (standard) new tokens "
            f"at `paper-small` and {pays_after(owt, 'boosted')} to {pays_after(owt, 'standard')} at `owt-125m`"
            ) in README_PROSE

    def steps_to_pay(bench, variant):
        eager, compiled = bench[variant], bench[f"{variant} · compiled"]
        return f"{round(compiled['compile_s']['train'] / (eager['step_s'] - compiled['step_s']), -2):,.0f}"

    assert (f"after about {steps_to_pay(owt, 'standard')} (standard) to {steps_to_pay(owt, 'boosted')} (GBA) steps at "
            f"`owt-125m` and {steps_to_pay(cuda, 'boosted')} (GBA) to {steps_to_pay(cuda, 'standard')} (standard) at "
            "`paper-small`") in README_PROSE
    # generate's default on each device lies above every break-even measured there, and says so
    from gbattn.model import decoding

    for device, benches in (("cpu", (first, recheck, proxy, xeon)), ("cuda", (cuda, owt))):
        break_even = max(float(pays_after(b, v).replace(",", "")) for b in benches for v in ("standard", "boosted"))
        assert decoding.MIN_TOKENS_TO_COMPILE[device] > break_even, device
    assert (f"compiles by default on CUDA only from {decoding.MIN_TOKENS_TO_COMPILE['cuda']:,} cached decode steps"
            in README_PROSE)
    own = [1000 * s for s in nodrop["standard"]["step_s_all"]]
    assert f"standard's own step varied from {min(own):,.0f} to {max(own):,.0f} ms within one run" in README_PROSE
    sweep = json.loads((ROOT / "results" / "bench-cpu-nodrop" / "bench.json").read_text())["sweep"]
    by_length = {}
    for r in sweep:
        by_length.setdefault(r["seq_len"], {})[r["variant"]] = r
    ratios = ", ".join(f"{v['boosted']['step_s'] / v['standard']['step_s']:.2f}" for v in by_length.values())
    lengths = sorted(by_length)
    assert f"GBA's step over standard's is {ratios} at T = {lengths[0]} to {lengths[-1]:,}" in README_PROSE
    memory = {name: [by_length[t][name]["peak_memory_bytes"] / mib for t in (lengths[0], lengths[-1])]
              for name in ("standard", "boosted")}
    assert (f"peak memory grows from {memory['standard'][0]:,.0f} to {memory['standard'][1]:,.0f} MiB (standard) and "
            f"{memory['boosted'][0]:,.0f} to {memory['boosted'][1]:,.0f} MiB (GBA)") in README_PROSE

    speedups = [b[f"{v} · compiled"]["compiled_step_speedup"] for b in (first, recheck, xeon)
                for v in ("standard", "boosted")]
    assert (f"gains nothing at `paper-small` ({min(speedups):.2f}-{max(speedups):.2f}x on the three machines measured)"
            in README_PROSE)
    saved_ms = [1000 * (proxy[v]["step_s"] - proxy[f"{v} · compiled"]["step_s"]) for v in ("standard", "boosted")]
    assert (f"saves {saved_ms[0]:.1f} ms (standard) to {saved_ms[1]:.1f} ms (GBA) a step, which over the 1,200 steps "
            f"of a CPU recipe is about {1.2 * saved_ms[0]:.0f} s and {1.2 * saved_ms[1]:.0f} s") in README_PROSE
    # the same figures in "Training, evaluation, generation" (it said 18 ms for GBA's 18.5)
    proxy_speedups = [proxy[f"{v} · compiled"]["compiled_step_speedup"] for v in ("standard", "boosted")]
    proxy_compile = [proxy[f"{v} · compiled"]["compile_s"]["train"] for v in ("standard", "boosted")]
    assert (f"at `cpu-proxy` size ({min(proxy_speedups):.2f}-{max(proxy_speedups):.2f}x, batch 8) it saves "
            f"{saved_ms[0]:.1f} ms (standard) to {saved_ms[1]:.1f} ms (GBA) a step: over a 1,200-step run about "
            f"{1.2 * saved_ms[0]:.0f} s and {1.2 * saved_ms[1]:.0f} s, against {min(proxy_compile):.0f}-"
            f"{max(proxy_compile):.0f} s of compiling") in README_PROSE


def test_compare_results_md_is_its_results_json():
    """Each comparison's results.md is what `gbattn compare` writes from its results.json (not edited apart)."""
    from gbattn.experiments.report import read_report, results_markdown
    checked = 0
    for path in sorted((ROOT / "results").glob("*/results.json")):
        report = json.loads(path.read_text(encoding="utf-8"))
        if "models" in report:
            assert results_markdown(read_report(path)) == (path.parent / "results.md").read_text(encoding="utf-8"), path
            checked += 1
    assert checked == 36


def test_each_recipes_results_were_trained_with_its_length_and_evaluation_schedule():
    """Each comparison of a recipe run without --set was trained as the recipe says now: each row matched to and
    continuing the models the recipe names, each from-scratch row's steps the recipe's and evaluated at every
    multiple of the recipe's eval_every (a recipe edited after its runs, e.g. cpu-proxy's eval_every or the upcycle
    recipe's compute-matched reference, would describe runs that were never made), on the recipe's own corpus."""
    from gbattn.experiments.compare import spec_configs
    from gbattn.experiments.recipes import RECIPES, with_models
    from gbattn.experiments.report import other_setting

    checked = 0
    for path in sorted((ROOT / "results").glob("*/results.json")):
        report = json.loads(path.read_text(encoding="utf-8"))
        recipe = RECIPES.get(report.get("recipe"))
        if "models" not in report or recipe is None or report.get("sets"):
            continue
        recipe = with_models(recipe, report.get("added", {}), report.get("matched", []))  # compare --model, --matched
        assert other_setting(report) is None, (path, recipe.default_data)  # e.g. WikiText-2, not another corpus
        specs = {s.label: s for s in recipe.models}
        for row in report["models"]:
            spec = specs[row["label"]]
            references = (spec.compute_matched_to, spec.param_matched_to, spec.init_from)
            recorded = (row["compute_matched_to"], row["param_matched_to"], row.get("init_from"))  # older: no init_from
            assert recorded == references, (path, row["label"])
            published = recipe.published.get(row["label"])  # the recipe's published value, as compare recorded it
            assert row["published"] == (list(published) if published else None), (path, row["label"])
            if spec.compute_matched_to or spec.init_from:  # their steps follow their reference's
                continue
            _, train_cfg = spec_configs(recipe, spec, "data", row["seeds"][0], {}, None)
            if train_cfg.max_steps is None:
                continue
            assert row["steps"] == train_cfg.max_steps, (path, row["label"])
            evaluated = {p["step"] for curve in row["curves"].values() for p in curve}
            every = set(range(train_cfg.eval_every, row["steps"] + 1, train_cfg.eval_every))
            assert every <= evaluated, (path, row["label"], sorted(every - evaluated))
            checked += 1
    assert checked == 80, checked


def test_bench_md_is_its_bench_json():
    """Each benchmark's bench.md is what `gbattn bench` writes from its bench.json (the first H200 one was
    written by an earlier bench without step-ratio ranges, so its README table is checked against its JSON
    above instead)."""
    from gbattn.bench.speed import bench_markdown
    checked = 0
    for path in sorted((ROOT / "results").rglob("bench*.json")):
        report = json.loads(path.read_text(encoding="utf-8"))
        if all("step_ratio_range" in v for v in report["variants"]):
            report["compile"] = report["compile"] or "off"  # recorded as false before --compile took a mode
            assert bench_markdown(report) == path.with_suffix(".md").read_text(encoding="utf-8"), path
            checked += 1
    assert checked == 14


def test_bench_json_ratios_follow_from_their_timings():
    """Every committed bench.json's ratios recomputed from its own raw numbers: each row against
    standard run the same way (a compiled row against standard compiled, a recomputing one against standard
    recomputing), step ratios paired by repeat; a recomputing row's ratios to its own kept row too."""
    checked = 0
    for path in sorted((ROOT / "results").rglob("bench*.json")):
        rows = json.loads(path.read_text(encoding="utf-8"))["variants"]
        by_name = {v["variant"]: v for v in rows}
        for r in rows:
            base = by_name["standard" + (" · compiled" if r.get("compiled") else "")
                           + (" · recomputed" if r.get("activation_checkpointing") else "")]
            if r.get("activation_checkpointing"):
                kept = by_name[r["variant"].removesuffix(" · recomputed")]
                assert r["recomputed_step_ratio"] == pytest.approx(statistics.median(
                    t / t0 for t, t0 in zip(r["step_s_all"], kept["step_s_all"])))
                assert r["recomputed_memory_ratio"] == pytest.approx(r["peak_memory_bytes"] / kept["peak_memory_bytes"])
                assert r["decode_tokens_per_s"] is r["decode_ratio"] is None  # (decoding is the kept row's)
            paired = sorted(t / t0 for t, t0 in zip(r["step_s_all"], base["step_s_all"]))
            if "step_ratio_range" in r:  # the H200 file predates paired ratios
                assert r["step_ratio"] == pytest.approx(statistics.median(paired)), (path, r["variant"])
                assert r["step_ratio_range"] == pytest.approx([paired[0], paired[-1]]), (path, r["variant"])
            assert r["flop_ratio"] == pytest.approx(r["train_flops_per_token"] / base["train_flops_per_token"])
            assert r["step_over_flop_ratio"] == pytest.approx(r["step_ratio"] / r["flop_ratio"])
            if not r.get("activation_checkpointing"):
                assert r["decode_ratio"] == pytest.approx(base["decode_tokens_per_s"] / r["decode_tokens_per_s"]), (
                    path, r["variant"])
            checked += 1
    assert checked == 6 + 6 + 4 + 4 + 4 + 6 + 6 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4


def test_readme_activation_checkpointing_table_is_its_bench_file():
    """The README's activation-checkpointing table, its figures in the prose beside it and in the training
    options, from the bench file that measured them."""
    rows = bench_rows("bench-activation-checkpointing-cpu/bench.json")
    mib = 1 << 20
    expected = []
    for variant, name in (("standard", "standard"), ("boosted", "boosted (M=2)")):
        kept, recomputed = rows[variant], rows[variant + " · recomputed"]
        expected.append([name, f"{1000 * kept['step_s']:,.0f}", f"{1000 * recomputed['step_s']:,.0f}",
                         f"{recomputed['recomputed_step_ratio']:.2f}", f"{kept['peak_memory_bytes'] / mib:,.0f}",
                         f"{recomputed['peak_memory_bytes'] / mib:,.0f}",
                         f"{recomputed['recomputed_memory_ratio']:.2f}"])
    assert_table("--decode 16 --threads 2`, torch 2.13 CPU build, batch 8 x 255", expected)
    gba, gba_recomputed = rows["boosted"], rows["boosted · recomputed"]
    assert (f"its peak training memory is {gba_recomputed['memory_ratio']:.2f}x standard's instead of "
            f"{gba['memory_ratio']:.2f}x") in README_PROSE
    assert (f"took GBA's peak training memory to {gba_recomputed['recomputed_memory_ratio']:.2f}x for "
            f"{gba_recomputed['recomputed_step_ratio']:.2f}x the step time") in README_PROSE
    steps = [rows[v]["recomputed_step_ratio"] for v in ("standard · recomputed", "boosted · recomputed")]
    assert all(abs(x - 1.4) < 0.05 for x in steps), steps  # "about 1.4x the step time of either"


def test_readme_cpu_memory_remeasurement_is_its_bench_file():
    """The memory ratios re-measured with today's probe, as the README quotes them."""
    rows = json.loads((ROOT / "results" / "bench-cpu-memory" / "bench.json").read_text(encoding="utf-8"))["variants"]
    ratio = {r["variant"]: f"{r['memory_ratio']:.2f}" for r in rows}
    standard = next(r for r in rows if r["variant"] == "standard")
    quoted = (f"standard peaks at {standard['peak_memory_bytes'] / 2**20:.0f} MiB and the memory ratios are "
              f"{ratio['boosted']} (GBA), {ratio['boosted:kv_source=shared']} (`kv_source=shared`), "
              f"{ratio['twicing']} (Twicing), "
              f"{ratio['gated']} (gated) and {ratio['differential']} (differential)")
    assert quoted in README_PROSE


def test_readme_analysis_figures_are_the_h200_analysis_summary():
    """The numbers beside the analysis figures are results/gpu-paper-small-wt2-analysis/analysis-summary.json's (the
    earlier run's entropy drop its own summary's); the retrained seed-42 runs' last validation perplexities, in the
    session's device log, are the three-seed table's seed-42 ones to the two decimals the README gives."""
    summary = json.loads((ROOT / "results" / "gpu-paper-small-wt2-analysis" / "analysis-summary.json").read_text())
    earlier = json.loads((ROOT / "results" / "gpu-paper-small-wt2" / "analysis-summary.json").read_text())
    gates, entropy, norms = summary["gates"], summary["entropy"], summary["norms"]["per_layer"]
    assert summary["run_dir"] == "gba-m2/seed42" and summary["loss_diff"]["against"] == "standard/seed42"
    assert (f"per-layer means {' / '.join(f'{g:.2f}' for g in gates['mean_per_layer'])} "
            f"(paper v1 {' / '.join(f'{g:.2f}' for g in gates['paper_mean_per_layer'])}, "
            f"revision {' / '.join(f'{g:.2f}' for g in gates['paper_mean_per_layer_revised'])})") in README_PROSE
    assert max(range(4), key=lambda layer: gates["mean_per_layer"][layer]) == 1  # "most in layer 1"
    first, second = entropy["mean_per_round"]
    changes = [f"{signed(100 * (layer['mean_per_round'][1] / layer['mean_per_round'][0] - 1), 0)}"
               for layer in entropy["per_layer"]]
    assert (f"the correction round is {100 * entropy['relative_drop']:.0f}% lower in entropy on average "
            f"({first:.2f} → {second:.2f} nats; paper 3.31 → 2.58, 22%; the earlier single-seed run, "
            f"{100 * earlier['entropy']['relative_drop']:.0f}%), sharply so in layer 1 ({changes[1]}), slightly in "
            f"layers 2 and 3 ({changes[2]}, {changes[3]}); layer 0 is the exception ({changes[0]})") in README_PROSE
    diff = summary["loss_diff"]
    assert (f"GBA is better on {100 * diff['fraction_positive']:.0f}% of tokens, by {diff['mean']:+.3f} nats on average"
            in README_PROSE)
    assert (f"small in layer 0, {norms[0]['gated_correction']:.2f} against a residual of {norms[0]['residual']:.1f}, "
            f"and largest in layer 1, {norms[1]['gated_correction']:.1f}; layers 2 and 3: "
            f"{norms[2]['gated_correction']:.1f} and {norms[3]['gated_correction']:.1f})") in README_PROSE
    log = (ROOT / "results" / "bench-compile-cuda" / "device-log.txt").read_text()
    last = re.findall(r"\| 4,125 \| ([\d.]+) \| ([\d.]+) \|", log.split("analysis-runs.log")[1])[0]
    three_seeds = compare_rows(GPU)
    assert last == tuple(f"{three_seeds[label]['valid_ppl']['42']:.2f}" for label in ("standard", "gba-m2"))
    assert f"validation perplexity {last[0]} and {last[1]} at the last step" in README_PROSE


def test_readme_results_prose_is_the_results_files():
    """The figures quoted in the Results sections' prose, recomputed from the results files."""
    proxy, modern, modern123 = compare_rows("cpu-proxy"), compare_rows("cpu-modern"), compare_rows("cpu-modern-seed123")
    depth, postln, upcycle = compare_rows("depth"), compare_rows("cpu-postln"), compare_rows("upcycle")
    design, design_proxy, char = compare_rows("gba-design"), compare_rows("gba-design-proxy"), compare_rows("cpu-char")
    gpu, earlier = compare_rows(GPU), compare_rows("gpu-paper-small-wt2")

    def test(row):
        return row["test_ppl"]["42"]

    def more(row, other, key, digits=0):
        """How much more of ``key`` (parameters, train_flops) ``row`` has than ``other``, in percent."""
        return f"{100 * (row[key] / other[key] - 1):.{digits}f}%"

    def fewer(row, other, key):
        return f"{100 * (1 - row[key] / other[key]):.0f}%"

    expected = []
    # paper scale: three seeds, against the wider model, and against the earlier single-seed run
    seeds = ["42", "123", "7"]
    mean = {label: mean_test_ppl(row, seeds) for label, row in gpu.items()}

    gba, fair = gpu["gba-m2"], gpu["param-fair"]
    gain = paired(gba, gpu["standard"], seeds)
    expected.append(f"GBA's gain over standard ({change(mean['gba-m2'], mean['standard'])} test perplexity, "
                    f"every seed, paired t-test p = {paired_t_p(gain):.2f}) is close to the paper's")
    behind = paired(gba, fair, seeds)
    assert all(d > 0 for d in behind) and mean["compute-matched"] < min(mean["param-fair"], mean["gba-m2"])
    expected.append(f"the wider model is better on every seed ({mean['param-fair']:.2f} against "
                    f"{mean['gba-m2']:.2f} test perplexity; GBA's validation loss is "
                    f"{signed(statistics.fmean(behind), 3, '')} nats higher, "
                    f"{' / '.join(signed(d, 3, '') for d in behind)}, p = {paired_t_p(behind):.2f})")
    expected.append(f"beats both ({mean['compute-matched']:.2f})")
    expected.append(f"had standard {test(earlier['standard']):.2f}, param-fair {test(earlier['param-fair']):.2f} and "
                    f"GBA {test(earlier['gba-m2']):.2f}")
    rises = [test(gpu[label]) - test(earlier[label]) for label in gpu]
    expected.append(f"every model's test perplexity is {min(rises):.1f} to {max(rises):.1f} points higher than that "
                    f"run's, and GBA's gain over standard is {change(test(gba), test(gpu['standard']))} against "
                    f"{change(test(earlier['gba-m2']), test(earlier['standard']))}")
    deviations = deviations_prose()
    assert f"rose by {min(rises):.1f} to {max(rises):.1f} points per model" in deviations
    log = (ROOT / "results" / GPU / "device-log.txt").read_text(encoding="utf-8")
    begun, ended = (int(re.search(rf"\[(\d+) s\] {what} paper-wt103", log).group(1)) for what in ("start", "end"))
    expected.append(f"all 15 runs in {ended - begun} s with five at a time")
    assert all(sorted(row["test_ppl"]) == sorted(seeds) for row in gpu.values())  # wall_clock_s: a mean over seeds
    summed = sum(3 * row["wall_clock_s"] for row in gpu.values())
    one_seed = sum(row["wall_clock_s"] for row in earlier.values())  # each model's mean over its seeds, alone
    expected.append(f"`paper-wt103`'s 15 runs (three seeds) took {ended - begun} s with `--jobs 5`, while their own "
                    f"wall-clock times add up to {summed:,.0f} s")
    expected.append(f"took {one_seed:.0f} s per seed (other code: the earlier dropout sites), {3 * one_seed:.0f} s "
                    f"for three seeds: about {3 * one_seed / (ended - begun):.1f}x, a comparison across two sessions")

    # design study: the gaps of every GBA configuration to compute-matched
    seeds = ["42", "123", "7"]
    gaps = [paired(row, design["compute-matched"], seeds) for label, row in design.items() if label.startswith("gba")]
    means = [statistics.fmean(g) for g in gaps]
    expected.append(f"(by {signed(min(min(g) for g in gaps), 2, '')} to {signed(max(max(g) for g in gaps), 2, '')} "
                    f"nats per seed, {signed(min(means), 2, '')} to {signed(max(means), 2, '')} on average)")

    # gba-design-proxy: M=3 against the matched models
    m3 = design_proxy["gba-m3"]
    expected.append(f"GBA M=3, with {more(m3, design_proxy['param-fair'], 'parameters')} more parameters than "
                    f"param-fair and {more(m3, design_proxy['compute-matched'], 'train_flops')} more training FLOPs "
                    "than compute-matched")

    # cpu-modern: the mean gap over three seeds (every seed worse, behind at every validation), the parameter gaps
    gaps, behind = [], []  # (the gap was test nats beside the GPT-2 block's validation nats: 0.010 for 0.012)
    for rows, seed in ((modern, "42"), (modern123, "123"), (compare_rows("cpu-modern-seed7"), "7")):
        gaps += paired(rows["gba-m2"], rows["standard"], [seed])
        behind += [g["valid_ppl"] > s["valid_ppl"] for s, g in zip(rows["standard"]["curves"][seed],
                                                                     rows["gba-m2"]["curves"][seed], strict=True)]
    assert all(gap > 0 for gap in gaps) and len(behind) == 12 and all(behind)
    twicing = compare_rows("cpu-modern-twicing")["twicing"]
    assert twicing["seeds"] == [7, 123]
    changes = [change(modern["twicing"]["test_ppl"]["42"], modern["standard"]["test_ppl"]["42"])] + [
        change(twicing["test_ppl"][seed], rows["standard"]["test_ppl"][seed])
        for rows, seed in ((modern123, "123"), (compare_rows("cpu-modern-seed7"), "7"))]
    assert all(c.startswith("+") for c in changes)  # "on every seed"
    expected.append(f"loss, on every seed: {changes[0]} (seed 42), {changes[1]} (seed 123) and {changes[2]} (seed 7)")
    expected.append(f"in test perplexity, {signed(statistics.fmean(gaps), 3, '')} nats of validation loss on average")
    proxy3 = proxy_three_seeds()
    gpt2 = seed_changes(proxy3["gba-m2"], proxy3["standard"], seeds)
    gpt2_nats = statistics.fmean(paired(proxy3["gba-m2"], proxy3["standard"], seeds))
    expected.append(f"GPT-2-style block gave {gpt2[0]}, {gpt2[1]} and {gpt2[2]} on the same seeds "
                    f"({signed(gpt2_nats, 3, '')} nats; `cpu-proxy` below)")
    expected.append(f"param-fair here has {more(modern['param-fair'], modern['gba-m2'], 'parameters', 1)} more "
                    f"parameters than GBA, against {more(proxy['param-fair'], proxy['gba-m2'], 'parameters', 1)} in "
                    "`cpu-proxy`")
    expected.append(f"with {fewer(modern['standard'], modern['gba-m2'], 'parameters')} fewer parameters than GBA")
    expected.append(f"standard goes from {test(proxy['standard']):.2f} to {test(modern['standard']):.2f} with "
                    f"{fewer(modern['standard'], proxy['standard'], 'parameters')} fewer parameters")

    # upcycle
    base, scratch, continued = upcycle["base"], upcycle["gba-scratch"], upcycle["standard-continued"]
    matched, upcycled = upcycle["standard-continued-compute-matched"], upcycle["gba-upcycled"]
    in_all = {"train_flops": matched["train_flops"] + base["train_flops"]}
    expected.append(f"spending the same extra FLOPs on {matched['steps'] - upcycled['steps']} more standard steps")
    expected.append(f"with {fewer(in_all, scratch, 'train_flops')} fewer FLOPs in all")
    expected.append(f"(ahead by 0.001 nats on average, within noise) for "
                    f"{fewer(upcycle['gba-shared-upcycled'], upcycled, 'train_flops')} fewer FLOPs")
    restart = test(continued), test(upcycle["standard-scratch"])
    later = compare_rows("upcycle-seeds")["standard-continued"], compare_rows("cpu-proxy-seeds")["standard"]
    costs = [change(*restart)[1:]] + [change(later[0]["test_ppl"][s], later[1]["test_ppl"][s])[1:]
                                      for s in ("123", "7")]
    expected.append(f"costs standard {costs[0]}, {costs[1]} and {costs[2]} (seeds 42, 123 and 7) against one "
                    f"uninterrupted schedule of the same length ({restart[0]:.2f} vs {restart[1]:.2f} with seed 42)")

    # cpu-char and cpu-proxy
    expected.append(f"(with seed 123 alone it is "
                    f"{change(char['gba-m2']['valid_ppl']['123'], char['standard']['valid_ppl']['123'])})")
    expected.append(f"({more(char['compute-matched'], char['standard'], 'steps')} more steps)")
    expected.append(f"[`results/cpu-proxy/`](results/cpu-proxy/results.md), "
                    f"{sum(r['wall_clock_s'] for r in proxy.values()) / 60:.0f} minutes for the five models")

    # depth and Post-LN
    attnres, fair, first = depth["standard-attnres"], proxy["param-fair"], depth["standard-attnres"]["curves"]["42"][0]
    expected.append(f"test {test(attnres):.3f} vs {test(fair):.3f}, valid {attnres['valid_ppl']['42']:.3f} vs "
                    f"{fair['valid_ppl']['42']:.3f}, with different curves: {first['valid_ppl']:.2f} vs "
                    f"{fair['curves']['42'][0]['valid_ppl']:.2f} at step {first['step']}")
    gba_attnres = depth["gba-m2-attnres"]
    expected.append(f"GBA's gain on top of AttnRes ({test(attnres):.2f} → {test(gba_attnres):.2f}, "
                    f"{change(test(gba_attnres), test(attnres))})")
    expected.append(f"AttnRes's gain is about the same with or without GBA "
                    f"({change(test(attnres), test(depth['standard']))}, "
                    f"{change(test(gba_attnres), test(depth['gba-m2']))})")
    expected.append(f"AttnRes costs {attnres['parameters'] - depth['standard']['parameters']:,} parameters here")
    expected.append(f"[`results/cpu-postln/`](results/cpu-postln/results.md), "
                    f"{sum(r['wall_clock_s'] for r in postln.values()) / 60:.0f} minutes for the four models")
    expected.append(f"(validation {postln['standard-postln']['curves']['42'][0]['valid_ppl']:.0f} vs "
                    f"{proxy['standard']['curves']['42'][0]['valid_ppl']:.0f} at step 300)")

    # training length: the figure's end points (gap.json) and the epochs of tiny-shakespeare's 90% training split
    gap = json.loads((ROOT / "results" / "training-length" / "gap.json").read_text())
    ends = {(s["directory"], s["reference"]): s["points"][-1]["difference"] for s in gap["series"]}
    pooled = "cpu-char-long + cpu-char-long-seed7"
    assert all(p["seeds"] == 3 for series in gap["series"] for p in series["points"])
    assert min(p["difference"] for series in gap["series"] if series["directory"] == pooled
               and series["reference"] == "param-fair" for p in series["points"]) > 0  # "at every evaluation"
    expected.append(f"The figure reads {signed(ends['gba-design', 'standard'], 3, '')} vs standard and "
                    f"{signed(ends['gba-design', 'param-fair'], 3, '')} vs param-fair at step 2,000, and "
                    f"{signed(ends[pooled, 'standard'], 3, '')} and {signed(ends[pooled, 'param-fair'], 3, '')} at "
                    f"step 8,000")
    corpus = ROOT / "src" / "gbattn" / "data" / "corpora" / "tiny-shakespeare.txt.gz"
    train_chars = 0.9 * len(gzip.decompress(corpus.read_bytes()).decode("utf-8"))
    long = char_long_three_seeds()
    # each seed's gap at 2,000 (gba-design) and 8,000 steps: "both seeds agree" hid that seed 42's deficit to
    # param-fair doubled while seed 123's halved
    seed_gaps = {ref: {s: [paired(rows["gba-m2"], rows[ref], [s])[0] for rows in (design, long)]
                       for s in ("42", "123", "7")} for ref in ("standard", "param-fair")}

    def per_seed(ref: str) -> str:
        return ", ".join(f"seed {s} {signed(a, 3, '')} → {signed(b, 3, '')}" for s, (a, b) in seed_gaps[ref].items())

    def mean(ref: str) -> str:
        return " → ".join(signed(statistics.fmean(g[i] for g in seed_gaps[ref].values()), 3, "") for i in (0, 1))

    assert all(a < 0 and b < 0 for a, b in seed_gaps["standard"].values())  # "stays a gain on every seed"
    expected.append(f"nats; {per_seed('standard')}) and stays a gain on every seed, and its deficit to the "
                    f"parameter-matched model shrinks on average ({mean('param-fair')})")
    assert any(b > a for a, b in seed_gaps["param-fair"].values())  # "not on every seed": some seed's deficit grew
    assert all(b > 0 for _, b in seed_gaps["param-fair"].values())  # "stays a deficit on every seed"
    expected.append(f"but not on every seed ({per_seed('param-fair')}), and stays a deficit on every seed")
    fair_lead = [statistics.fmean(paired(rows["compute-matched"], rows["param-fair"], ["42", "123", "7"]))
                 for rows in (design, long)]
    expected.append(f"its lead over param-fair falls from {-fair_lead[0]:.3f} to {-fair_lead[1]:.3f} nats")
    expected.append(f"8,000 steps are {long['standard']['train_tokens'] / train_chars:.1f} epochs for it, and the "
                    f"compute-matched model's {long['compute-matched']['steps']:,} steps "
                    f"{long['compute-matched']['train_tokens'] / train_chars:.1f}")

    missing = [text for text in expected if text not in README_PROSE]
    assert not missing, "\n".join(missing)


# -- the published numbers: docs/paper.md, the recipes' `published`, the analysis' and the README's -------------

PAPER_MD = (ROOT / "docs" / "paper.md").read_text(encoding="utf-8")


def paper_md_table(anchor: str) -> dict[str, list[str]]:
    """The first Markdown table after ``anchor`` in docs/paper.md: first cell -> the other cells (bold removed)."""
    assert PAPER_MD.count(anchor) == 1, anchor
    lines = PAPER_MD[PAPER_MD.index(anchor):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("| "))
    rows = {}
    for line in lines[start + 2:]:
        if not line.lstrip().startswith("|"):
            break
        first, *cells = [cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")]
        rows[first] = cells
    return rows


def mean_std_cell(cell: str) -> tuple[float, float]:
    mean, std = cell.split(" ± ")
    return float(mean), float(std)


PAPER_LABELS = {"Standard": "standard", "Twicing": "twicing", "Standard, param-fair (d = 288)": "param-fair",
                "GBA, M = 2": "gba-m2"}


def test_docs_paper_md_perplexities_are_the_recipes_published_values():
    """docs/paper.md's published test perplexities (mean ± std, WikiText-103 and OpenWebText) are the
    ``published`` values of paper-wt103 and paper-owt, and its Δ column is the relative change of the
    means against Standard, rounded to 0.1% with its sign (the two GBA cells are the paper's -6.0% and -5.6%)."""
    from gbattn.experiments.recipes import get_recipe

    table = paper_md_table("## Published test perplexities")
    assert set(table) == set(PAPER_LABELS)
    for column, recipe in ((0, "paper-wt103"), (2, "paper-owt")):
        published = get_recipe(recipe).published
        assert {PAPER_LABELS[k]: mean_std_cell(v[column]) for k, v in table.items()} == published, recipe
        base = published["standard"][0]
        deltas = {PAPER_LABELS[k]: v[column + 1] for k, v in table.items()}
        assert deltas == {k: "—" if k == "standard" else change(v[0], base) for k, v in published.items()}, recipe
    assert (table["GBA, M = 2"][1], table["GBA, M = 2"][3]) == ("\u22126.0%", "\u22125.6%")


def test_docs_paper_md_post_ln_is_the_recipes_published_values():
    """Post-LN, 1 seed: Standard 77.20, GBA 84.60 (+9.6%), param-fair 71.81 (docs/paper.md and paper-postln)."""
    from gbattn.experiments.recipes import get_recipe

    table = paper_md_table("### Post-LN")
    published = get_recipe("paper-postln").published
    assert published == {"standard-postln": (77.20, None), "gba-m2-postln": (84.60, None),
                         "param-fair-postln": (71.81, None)}
    assert table == {"Standard, Post-LN": ["77.20"], "GBA M = 2, Post-LN": ["84.60 (+9.6% vs standard)"],
                     "Standard, param-fair, Post-LN": ["71.81"]}
    assert change(84.60, 77.20) == "+9.6%" and "1 seed" in get_recipe("paper-postln").published_source
    assert len(get_recipe("paper-postln").seeds) == 1


def test_docs_paper_md_analysis_numbers_are_the_analysis_modules():
    """The mean gate per layer (v1 and revision) and the entropy figures that `gbattn analyze` prints beside
    ours are docs/paper.md's; the 22% is the relative drop from 3.31 to 2.58 nats."""
    from gbattn.analysis.stats import PAPER

    gates = paper_md_table("- **Mean gate value per layer**")
    assert [float(g) for g in gates["v1"]] == PAPER["gate_mean_per_layer"] == [0.35, 0.48, 0.41, 0.43]
    assert [float(g) for g in gates["revision"]] == PAPER["gate_mean_per_layer_revised"] == [0.33, 0.49, 0.39, 0.36]
    assert (PAPER["entropy_round0_nats"], PAPER["entropy_correction_nats"]) == (3.31, 2.58)
    assert round(1 - 2.58 / 3.31, 2) == PAPER["entropy_relative_drop"] == 0.22
    assert ("22% lower than round 0's on average (3.31 nats for round 0, 2.58 nats for the correction)"
            in " ".join(PAPER_MD.split()))


def test_readme_says_the_papers_regime_as_the_paper_recipe_runs_it():
    """Where the README names the paper's own corpus, its name and token count are paper-wt103's."""
    from gbattn.config import get_preset
    from gbattn.experiments.recipes import get_recipe

    recipe = get_recipe("paper-wt103")
    said = re.findall(r"The paper's own corpus \(([^)]*)\)", README_PROSE)
    assert recipe.default_data.startswith("wikitext-103")
    assert said == [f"WikiText-103, {get_preset(recipe.preset).train['train_tokens'] / 1e6:.0f}M tokens"]


def test_readme_names_the_command_of_every_paper_table_and_figure():
    """The README's map from the paper's tables and figures (docs/paper.md) to commands has a row for each,
    a GPU and a CPU cell in each, recipes that exist and subcommands that exist, and every recipe holding
    published numbers at the paper's preset in it (a paper table without a command was a gap nobody saw)."""
    from gbattn.cli import build_parser
    from gbattn.experiments.recipes import RECIPES

    rows = readme_table("### Each paper table and figure, and its command")
    tables = {row[0]: row for row in rows}
    for what in ("parameter counts", "WikiText-103", "OpenWebText", "Post-LN", "gate per layer", "entropy",
                 "accuracy vs rounds", "gate ablation", "difficulty", "DEQ"):
        assert any(what in label for label in tables), what
    assert all(len(row) == 4 and row[1] and row[2] and row[3] for row in rows), rows
    text = " ".join(" ".join(row) for row in rows)
    recipes = set(re.findall(r"--recipe ([\w-]+)", text))
    assert recipes <= set(RECIPES), recipes - set(RECIPES)
    published = {name for name, r in RECIPES.items() if r.published and r.preset == "paper-small"}
    assert published == {"paper-wt103", "paper-owt", "paper-postln"} and published <= recipes
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert set(re.findall(r"`gbattn ([\w-]+)", text)) <= commands


def test_readme_threads_table_is_results_threads():
    """The README's Threads table is what scripts/threads_measure.sh wrote (results/threads/threads.json)."""
    report = json.loads((ROOT / "results/threads/threads.json").read_text(encoding="utf-8"))
    rows = report["threads"]
    section = README_TEXT.split("## Threads\n", 1)[1].split("\n## ", 1)[0]
    assert report["command"] == "bash scripts/threads_measure.sh" and f"`{report['command']}`" in section
    train, generate = (next(line for line in section.splitlines() if line.startswith(f"| {what}"))
                       for what in ("training, tokens/s", "generation, tokens/s"))
    chosen = re.search(r"\d+ threads?", rows["default"]["train_device"]).group()
    two, one, default = (rows[k]["train_tokens_per_s"] for k in ("2", "1", "default"))
    assert train.split(" | ")[1:] == [f"{two:,}", f"{one:,} ({one / two:.1f}x)", f"{default:,} ({chosen} chosen) |"]
    two, one, default = (rows[k]["generate_tokens_per_s"] for k in ("2", "1", "default"))
    assert generate.split(" | ")[1:] == [f"{two:,}", f"{one:,} ({one / two:.1f}x)", f"{default:,} |"]


def test_unk_token_counts_script_counts_what_the_authors_tokenizer_drops(tmp_path, monkeypatch):
    """scripts/unk_token_counts.py: a test line with one character training never shows is one <unk> id more in
    gbattn's ids than in the same BPE without an unknown token, and the line with it is the only one that differs."""
    train, text = tmp_path / "train", tmp_path / "text"
    train.mkdir(), text.mkdir()
    words = "the cat sat on the mat and the dog ran far away\n" * 40
    for split in ("train", "valid", "test"):
        (train / f"wiki.{split}.raw").write_text(words if split == "train" else words[:200], encoding="utf-8")
    (text / "wiki.valid.raw").write_text("the cat sat\n", encoding="utf-8")
    (text / "wiki.test.raw").write_text("the cat sat\n \nthe dog \u00df ran\n", encoding="utf-8")
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "counts.json"
    monkeypatch.setattr("sys.argv", ["unk_token_counts.py", "--train", str(train), "--text", str(text),
                                     "--vocab-size", "64", "--out", str(out)])
    load_script("unk_token_counts").main()
    record = json.loads(out.read_text(encoding="utf-8"))
    test, valid = record["splits"]["test"], record["splits"]["valid"]
    assert test["unk_tokens_gbattn"] == test["unseen_characters"] == test["distinct_unseen_characters"] == 1
    assert test["tokens_gbattn"] - test["tokens_authors"] == 1 and test["lines_that_differ"] == 1
    assert valid["tokens_gbattn"] == valid["tokens_authors"] and valid["unk_tokens_gbattn"] == 0
    assert record["train"] == "train" and record["text"] == "text"  # names, not this machine's paths


def test_deviations_unk_token_counts_are_results_unk_token_counts():
    """docs/deviations.md (entry 1) and the README's Data section quote results/unk-token-counts."""
    record = json.loads((ROOT / "results" / "unk-token-counts" / "counts.json").read_text(encoding="utf-8"))
    test, valid = record["splits"]["test"], record["splits"]["valid"]
    assert (record["train"], record["text"], record["vocab_size"]) == ("wikitext-2", "wikitext-2-raw", 16_384)
    fewer = test["tokens_gbattn"] - test["tokens_authors"]
    expected = (f"test has {test['unseen_characters']} characters ({test['distinct_unseen_characters']} distinct "
                f"ones, such as `ß`, `ł`, `×`) that training never shows, each one `<unk>` here. gbattn gives "
                f"{test['tokens_gbattn']:,} test tokens and the authors' tokenizer {test['tokens_authors']:,} "
                f"({fewer} fewer, {100 * fewer / test['tokens_gbattn']:.3f}%; {test['lines_that_differ']} lines "
                f"differ); valid {valid['tokens_gbattn']:,} and {valid['tokens_authors']:,} "
                f"({valid['tokens_gbattn'] - valid['tokens_authors']} fewer, {valid['unk_tokens_gbattn']} `<unk>`).")
    assert expected in deviations_prose(), expected
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    expected = (f"gbattn gives {test['tokens_gbattn']:,} tokens, {test['unk_tokens_gbattn']} of them `<unk>`, and "
                f"the authors' tokenizer {fewer} fewer")
    assert expected in readme, expected


def test_readme_attnres_cost_is_results_bench_attnres():
    """The README's cost of Attention Residuals (section "Residual streams"), today's stream and the one before
    2026-12-04, from their bench files: each row a model field set on one variant of the same run."""
    now, before = (bench_rows(f"{name}/bench.json") for name in ("bench-attnres", "bench-attnres-before"))
    standard, gba = "standard:residual=attnres-block,attnres_block=2", "boosted:residual=attnres-block,attnres_block=2"
    for rows in (now, before):
        assert rows[standard]["parameters"] == 1_336_320 and rows[gba]["parameters"] == 1_666_048
    s = now[standard]
    quoted = (f"A training step of standard with AttnRes takes {s['step_ratio']:.2f}x the plain standard's "
              f"time for {s['flop_ratio']:.3f}x its FLOPs, at {s['memory_ratio']:.2f}x its peak "
              f"memory, and GBA with AttnRes {now[gba]['step_ratio']:.2f}x (GBA on the plain stream "
              f"{now['boosted']['step_ratio']:.2f}x); a cached decoding step costs {s['decode_ratio']:.2f}x. "
              f"Before 2026-12-04")
    assert quoted in README_PROSE, quoted
    quoted = (f"the same command then gave {before[standard]['step_ratio']:.2f}x the step time and "
              f"{before[standard]['memory_ratio']:.2f}x the memory")
    assert quoted in README_PROSE, quoted


def test_readme_attnres_rerun_is_results_depth_attnres_rerun():
    """The AttnRes standard model of `depth`, trained again after the depth mixture was rewritten, against the
    table's run: the same perplexities to the digits the README gives."""
    before = compare_rows("depth")["standard-attnres"]
    again = compare_rows("depth-attnres-rerun")["standard-attnres"]
    assert before["attn_options"] == again["attn_options"] and before["residual"] == again["residual"]
    test, valid = (again[key]["42"] for key in ("test_ppl", "valid_ppl"))
    quoted = (f"reaches test perplexity {test:.4f} against {before['test_ppl']['42']:.4f} before (valid {valid:.4f} "
              f"and {before['valid_ppl']['42']:.4f})")
    assert quoted in README_PROSE, quoted
    assert abs(test / before["test_ppl"]["42"] - 1) < 1e-5  # float rounding, not another model


def test_readme_compiled_twicing_with_dropout_is_its_bench_files():
    """The compile speedups of standard and Twicing with dropout 0.1 at cpu-proxy, two runs of one command."""
    runs = [bench_rows(f"bench-compile-twicing-dropout/{name}.json") for name in ("bench", "bench-recheck")]
    speedup = {label: [rows[f"{label} · compiled"]["compiled_step_speedup"] for rows in runs]
               for label in ("standard", "twicing")}  # the median over repeats of eager / compiled
    quoted = (f"compiling sped a step of standard by {speedup['standard'][0]:.2f}x and {speedup['standard'][1]:.2f}x "
              f"and one of Twicing by {speedup['twicing'][0]:.2f}x and {speedup['twicing'][1]:.2f}x")
    assert quoted in README_PROSE, quoted
    assert max(speedup["twicing"]) < 1 <= min(speedup["standard"])


def test_readme_gba_m3_against_its_own_matched_baselines_is_results_gba_design_m3_matched():
    """`compare --matched gba-m3` on gba-design's seeds: GBA M=3 against a standard model of at least its parameters
    and one trained for its FLOPs, every seed; its own runs reproduce gba-design's."""
    rows, design = compare_rows("gba-design-m3-matched"), compare_rows("gba-design")
    seeds = ["42", "123", "7"]
    mine, fair, matched = rows["gba-m3"], rows["param-fair-gba-m3"], rows["compute-matched-gba-m3"]
    assert fair["param_matched_to"] == matched["compute_matched_to"] == "gba-m3"
    assert mine["attn_options"] == design["gba-m3"]["attn_options"] == {"rounds": 2 + 1}
    worst = max(abs(mine["test_ppl"][s] / design["gba-m3"]["test_ppl"][s] - 1) for s in ("42", "123"))
    behind = {label: paired(mine, rows[label], seeds) for label in ("param-fair-gba-m3", "compute-matched-gba-m3")}
    assert all(d > 0 for diffs in behind.values() for d in diffs)  # "on every seed"
    quoted = (f"a standard model of width {fair['d_model']} ({fair['parameters']:,} parameters, "
              f"{100 * (fair['parameters'] / mine['parameters'] - 1):.0f}% more than GBA M=3) is "
              f"{statistics.fmean(behind['param-fair-gba-m3']):.3f} nats below it "
              f"({each_seed(behind['param-fair-gba-m3'])}, seeds 42 / 123 / 7), and standard attention trained for "
              f"GBA M=3's training FLOPs ({matched['steps']:,} steps) "
              f"{statistics.fmean(behind['compute-matched-gba-m3']):.3f} below "
              f"({each_seed(behind['compute-matched-gba-m3'])}), on every seed. GBA M=3's runs reproduce "
              f"`gba-design`'s to within {worst:.0e} in perplexity (relative) on seeds 42 and 123; seed 7's ends at "
              f"{mine['test_ppl']['7']:.3f} against {design['gba-m3']['test_ppl']['7']:.3f}").replace("e-0", "e-")
    assert quoted in README_PROSE, quoted


CHEAPER_MATCHED = (("gba-design-gate-matched", "gba-gate-vector", "gba-gate-vector", "the vector gate"),
                   ("gba-design-gate-matched", "gba-gate-scalar", "gba-gate-vector", "the scalar gate"),
                   ("gba-design-cheap-matched", "gba-kv-shared", "gba-kv-shared", "round 0's K/V"),
                   ("gba-design-cheap-matched", "gba-upper-half", "gba-upper-half", "rounds in layers 2 and 3 only"))


def cheaper_matched_text() -> str:
    """The README's sentences on the design study's cheaper configurations against baselines matched to each: the
    paired differences (42 / 123 / 7) to its compute-matched and to its param-fair standard model, which is ahead of
    some on every seed and ties with the others (seeds of both signs)."""
    seeds, behind, ahead, ties, fair_rows = ["42", "123", "7"], [], [], [], []
    for name, label, matched_to, words in CHEAPER_MATCHED:
        rows = compare_rows(name)
        model = rows[label]
        cm, pf = rows[f"compute-matched-{matched_to}"], rows[f"param-fair-{matched_to}"]
        assert cm["compute_matched_to"] == pf["param_matched_to"] == matched_to
        assert cm["train_flops"] == pytest.approx(model["train_flops"], rel=0.01)  # gates: the same FLOPs, 0.05%
        diffs = paired(model, cm, seeds)
        assert all(d > 0 for d in diffs), label  # "ahead of it on every seed"
        behind.append(f"{words} by {statistics.fmean(diffs):.3f} nats ({each_seed(diffs)}; {cm['steps']:,} steps)")
        diffs = paired(model, pf, seeds)
        assert not all(d < 0 for d in diffs), label  # none beats its param-fair model
        (ahead if all(d > 0 for d in diffs) else ties).append(
            f"{words} ({statistics.fmean(diffs):+.3f}: {each_seed(diffs)})")
        fair_rows.append((pf, model))
    (width,), (size,) = {pf["d_model"] for pf, _ in fair_rows}, {pf["parameters"] for pf, _ in fair_rows}
    more = [100 * (pf["parameters"] / model["parameters"] - 1) for pf, model in fair_rows]
    return (f"Standard attention trained for each one's FLOPs is ahead of it on every seed (seeds 42 / 123 / 7): "
            f"{', '.join(behind)}. A standard model of width {width} ({size:,} parameters, {min(more):.0f}–"
            f"{max(more):.0f}% more) is ahead of {' and of '.join(ahead)} on every seed, and ties with "
            f"{' and with '.join(ties)}, seeds of both signs.").replace("-", "\u2212")


def test_readme_cheaper_design_configurations_against_their_own_baselines_are_their_results():
    """`compare --matched` for the design study's configurations with fewer parameters and FLOPs than GBA M=2 (which
    the table compares with GBA M=2's baselines): the README's paired differences are these results files', and their
    GBA runs repeat gba-design's."""
    design = compare_rows("gba-design")
    assert {label for _, label, _, _ in CHEAPER_MATCHED} == {
        label for label, r in design.items() if label.startswith("gba")
        and r["parameters"] < design["gba-m2"]["parameters"] and r["train_flops"] < design["gba-m2"]["train_flops"]}
    quoted = cheaper_matched_text()
    assert quoted in README_PROSE, quoted
    worst = 0.0
    for name, label, _, _ in CHEAPER_MATCHED:
        mine = compare_rows(name)[label]
        assert mine["attn_options"] == design[label]["attn_options"]
        worst = max(worst, *(abs(mine["test_ppl"][s] / design[label]["test_ppl"][s] - 1) for s in ("42", "123", "7")))
    repeat = f"Their GBA runs repeat `gba-design`'s to within {worst:.0e} in perplexity".replace("e-0", "e-")
    assert repeat in README_PROSE, repeat


def test_readme_every_design_configuration_lost_to_baselines_matched_to_it():
    """"Should I use GBA?" line 2: each of the design study's 7 GBA configurations against the standard models matched
    to its own size (GBA M=2's for itself and for K/V from x, of equal size; compare --matched for the others)."""
    seeds, design = ["42", "123", "7"], compare_rows("gba-design")
    own = dict.fromkeys(("gba-m2", "gba-kv-input"), (design, "param-fair", "compute-matched"))
    assert design["gba-kv-input"]["parameters"] == design["gba-m2"]["parameters"]
    assert design["gba-kv-input"]["train_flops"] == pytest.approx(design["gba-m2"]["train_flops"], rel=1e-3)
    m3 = compare_rows("gba-design-m3-matched")
    own["gba-m3"] = (m3, "param-fair-gba-m3", "compute-matched-gba-m3")
    for name, label, matched_to, _ in CHEAPER_MATCHED:
        rows = compare_rows(name)
        own[label] = (rows, f"param-fair-{matched_to}", f"compute-matched-{matched_to}")
    assert set(own) == {label for label in design if label.startswith("gba")}
    wider_ahead, ties = [], []
    for label, (rows, fair, matched) in own.items():
        assert all(d > 0 for d in paired(rows[label], rows[matched], seeds)), label
        diffs = paired(rows[label], rows[fair], seeds)
        assert not all(d < 0 for d in diffs), label
        (wider_ahead if all(d > 0 for d in diffs) else ties).append(label)
    assert sorted(ties) == ["gba-gate-scalar", "gba-gate-vector"]
    assert (f"not in any of the {len(own)} GBA configurations of the design study, each against baselines matched to "
            f"its own parameters and FLOPs (standard attention trained for each one's FLOPs was ahead on every seed; "
            f"the wider model was ahead of {len(wider_ahead)} on every seed and tied with the vector and scalar "
            f"gates)") in README_PROSE


def test_readme_decode_floor_is_results_decode_floor_cpu():
    """README "Compiled vs eager": the weight-read floor table and the 2x arithmetic under it are the rows of
    results/decode-floor-cpu/floor.md (scripts/decode_floor.py's output), whose ratio columns follow from its times."""
    text = (ROOT / "results" / "decode-floor-cpu" / "floor.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        if line.startswith(("| standard", "| boosted")):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            eager, compiled, floor = (float(c) for c in cells[2:5])
            assert cells[5:8] == [f"{eager / compiled:.2f}x", f"{eager / floor:.2f}x", f"{compiled / floor:.2f}x"]
            rows[cells[0]] = cells
    assert set(rows) == {"standard", "boosted"}
    names = {"standard": "standard", "boosted": "boosted (M=2)"}
    assert_table("How far could compiling go on a CPU?", [[names[v]] + rows[v][2:8] for v in names])
    eager, compiled, floor = (float(c) for c in rows["standard"][2:5])
    assert (f"for standard it leaves {eager / 2 - floor:.3f} ms a token for everything besides the weight products, "
            f"where the compiled step spends {compiled - floor:.3f} ms on it") in README_PROSE
    assert eager / 2 - floor < compiled - floor  # "within reach only in principle": not reached in this run
    assert f"and {rows['standard'][8]} ms for calling a compiled function at all" in README_PROSE
    command = "python scripts/decode_floor.py --repeats 15"
    assert command in text and command in README_PROSE


def test_one_off_timings_script_times_each_of_its_measures(monkeypatch, capsys):
    """scripts/one_off_timings.py (the README's four one-off timings) runs its measures, at a tiny size here: one it
    imports that is renamed or changes its arguments fails here, not in a user's hands."""
    script = load_script("one_off_timings")
    monkeypatch.setattr(script, "IDS", 1000)
    monkeypatch.setattr(script, "MATRICES", 2)
    monkeypatch.setattr(script, "ZEROS", 1024)
    script.main(["--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == [
        "token digest, 1,000 uint16 ids", "checkpoint CRC check, 8 MiB", "torch.load of it",
        "fresh torch.zeros, 0 MiB", "zero_ of the same tensor in place"]
    assert all(re.fullmatch(r"[^:]+: \d+\.\d{3} s, \d+\.\d{3} s", line) for line in lines[1:])
