"""The README's Python snippets run verbatim (so they cannot drift from the code), in a directory
where the Quickstart's run `runs/char-gba` exists (a tiny one, trained here)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from gbattn.config import build_configs
from gbattn.train.trainer import train

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 3
    assert any("load_run" in s for s in SNIPPETS) and any("causal=False" in s for s in SNIPPETS)
    assert any("gbattn.train_run(" in s for s in SNIPPETS)


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    """The Quickstart's run `runs/char-gba` (a tiny one), trained once for the module: each test works in a copy."""
    root = tmp_path_factory.mktemp("readme")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GBATTN_CACHE", str(root / "cache"))
        model_cfg, train_cfg = build_configs("cpu-char", "boosted", "tiny-shakespeare",
                                             {"max_steps": 2, "eval_every": 2, "threads": 1, "d_model": 32})
        train(root / "char-gba", model_cfg, train_cfg, quiet=True)
    return root / "char-gba"


@pytest.fixture
def in_quickstart_directory(quickstart_run, tmp_path, monkeypatch):
    """The test's directory as the current one, holding a copy of the Quickstart's run at `runs/char-gba`."""
    shutil.copytree(quickstart_run, tmp_path / "runs" / "char-gba")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path, in_quickstart_directory, capsys):
    capsys.readouterr()
    exec(compile(SNIPPETS[index], f"README.md snippet {index}", "exec"), {})
    printed = capsys.readouterr().out
    if "record.rounds" in SNIPPETS[index]:
        assert "['attention', 'correction']" in printed
    if "load_run" in SNIPPETS[index]:
        assert printed.startswith("boosted 2\nROMEO:")
    if "gbattn.train_run(" in SNIPPETS[index]:  # the run directory `gbattn train` writes, its result as printed
        from gbattn.rundir import read_result
        result = read_result(tmp_path / "runs/py-gba" / "result.json")
        assert printed == f"20 {round(result['valid_ppl'], 1)}\n" and result["attn"] == "boosted"
        # the preset recorded, as `gbattn train --preset` records it ("train --init-from takes its recipe")
        assert json.loads((tmp_path / "runs/py-gba" / "config.json").read_text())["preset"] == "cpu-char"


TRANSFORMERS_SNIPPETS = re.findall(r"^```\n(import gbattn\.hf\b.*?)^```", README.read_text(encoding="utf-8"),
                                   flags=re.S | re.M)


def test_readme_transformers_snippet_runs_and_equals_gbattn_generate(in_quickstart_directory, capsys):
    """README, "Hugging Face transformers": the Auto-classes snippet runs verbatim on the Quickstart run exported
    to `runs/char-gba-hf`, and prints what gbattn's own greedy decoding gives (the sequence fits in block_size)."""
    pytest.importorskip("transformers")
    import gbattn
    from gbattn.hf.export import export_run

    assert len(TRANSFORMERS_SNIPPETS) == 1
    export_run("runs/char-gba", "runs/char-gba-hf")
    capsys.readouterr()
    exec(compile(TRANSFORMERS_SNIPPETS[0], "README.md transformers snippet", "exec"), {})
    printed = capsys.readouterr().out
    expected = gbattn.load_run("runs/char-gba-hf").generate("ROMEO:", max_new_tokens=50, temperature=0)
    assert printed == expected + "\n"


DOCS = README.parent / "docs"
SOURCES = README.parent / "src" / "gbattn"
# A section cited by name, `README, "Threads"` or `docs/method.md, 'Cost'` (a help text's quotes), or `README "Speed"`
CITATION = re.compile(r"""(README|docs/[a-z]+\.md),? (?:"([^"]+)"|'([^']+)')""")


def headings(text: str) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in text.splitlines() if line.startswith("#")]


@pytest.mark.parametrize("module", ["gbattn", "gbattn.attention", "gbattn.hf"])
def test_every_public_name_cites_the_readme_or_docs(module):
    """A researcher reading help() on a public class or function is pointed at the README or docs/ section
    that describes it (that the section exists is the next test's)."""
    import importlib
    import inspect

    if module == "gbattn.hf":
        pytest.importorskip("transformers")
    mod = importlib.import_module(module)
    uncited = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # VARIANTS, PRESETS: dicts, documented by the README's tables
        doc = inspect.getdoc(obj) or ""
        if "README" not in doc and "docs/" not in doc:
            uncited.append(name)
    assert not uncited, f"{module}: no README or docs/ section cited in the docstring of {uncited}"


def test_every_section_the_code_cites_is_a_heading():
    """Every README or docs/ section that src/ cites by name, in a docstring, a comment or a text the user reads
    (`gbattn list`'s preset lines, --help), is a heading containing that name: a reader searching the headings
    finds it ("Choosing cpu-proxy", cited by `gbattn list`, was a bold phrase inside a list)."""
    missing, cited = [], 0
    for path in sorted(SOURCES.rglob("*.py")):
        text = re.sub(r'" f?"', "", " ".join(path.read_text(encoding="utf-8").split()))  # "a " "b" -> "a b"
        for source, double_quoted, single_quoted in CITATION.findall(text):
            section = double_quoted or single_quoted
            target = README if source == "README" else README.parent / source
            cited += 1
            if not any(section.lower() in h for h in headings(target.read_text(encoding="utf-8"))):
                missing.append(f"{path.relative_to(SOURCES)}: {source}, {section!r}")
    assert cited > 40 and missing == []


def test_readme_names_every_option_train_resume_refuses():
    """README, "Trust": the options `train --resume` refuses when they differ from the recorded run are
    train's RUN_OPTIONS (it left out --residual and --tokenizer)."""
    from gbattn.train.cli import RUN_OPTIONS

    prose = " ".join(README.read_text(encoding="utf-8").split())
    sentence = prose[prose.index("`train --resume` refuses"):].split(" values that differ")[0]
    assert [name for name in RUN_OPTIONS if f"`--{name}`" not in sentence] == []


def test_readme_states_the_generate_defaults():
    """README, "Using gbattn from Python": the defaults it gives for run.generate are gbattn generate's (one table
    of them, arguments.GENERATE_DEFAULTS), and the generate command it shows spells them out."""
    from gbattn.arguments import GENERATE_DEFAULTS

    text = README.read_text(encoding="utf-8")
    stated = re.search(r"gbattn generate's defaults: (\d+), ([\d.]+), top-k (\d+)", text)
    assert stated, "the README no longer states generate's defaults"
    assert (int(stated[1]), float(stated[2]), int(stated[3])) == (
        GENERATE_DEFAULTS["max_new_tokens"], GENERATE_DEFAULTS["temperature"], GENERATE_DEFAULTS["top_k"])
    spelled = "--max-new-tokens {max_new_tokens} --temperature {temperature} --top-k {top_k}".format(
        **GENERATE_DEFAULTS)
    assert spelled in text


def test_readme_names_the_cpu_recipe_with_a_published_number():
    """README, "Reproducing the paper's tables": "The CPU recipes have no published numbers" while cpu-char's
    published column holds nanoGPT's number for standard; the README names each recipe whose published
    numbers are not the paper's."""
    from gbattn.experiments.recipes import RECIPES

    prose = " ".join(README.read_text(encoding="utf-8").split())
    others = {name: recipe for name, recipe in RECIPES.items()
              if recipe.published and not recipe.published_source.startswith("arXiv 2604.03190")}
    assert others and all(f"`{name}`'s column holds {recipe.published_source.split()[0]}'s" in prose
                           for name, recipe in others.items())
    assert "The CPU recipes have no published numbers" not in prose


def anchors(path: Path) -> set[str]:
    """The #fragments GitHub gives a Markdown file's headings: lower case, punctuation but `-` dropped, spaces as
    `-`, a repeated heading suffixed -1, -2, ... (fenced code skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    found: set[str] = set()
    count: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{count[slug]}" if slug in count else slug)
        count[slug] = count.get(slug, 0) + 1
    return found


def test_every_link_of_the_readme_and_docs_resolves_inside_the_repository():
    """A relative link of README.md or docs/*.md names a file of the repository (never one outside it), and its
    #anchor a heading of that file: the contents line and the cross-references survive renamed sections."""
    root = README.parent
    broken = []
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or root not in file.parents:
                broken.append(f"{page.name}: {target} (no such file in the repository)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_a_results_heading_naming_a_recipe_gives_that_recipes_default_seeds():
    """A results heading such as "(`cpu-baselines`: cpu-char, 2,000 steps, seeds 42, 123 and 7)" promises that
    `gbattn compare --recipe cpu-baselines` trains those seeds: the first seeds it names are the recipe's default
    (a recipe's seeds edited in the code left the README's table with a command that no longer reproduced it)."""
    from gbattn.experiments.recipes import get_recipe

    headings = [line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("### ")]
    checked = []
    for heading in headings:
        named = re.search(r"\(`([a-z0-9-]+)`[:,]", heading)
        if named is None:
            continue
        seeds = re.search(r"seeds? (\d+(?:, \d+)*(?: and \d+)?)", heading[named.end():])
        assert seeds, heading
        assert get_recipe(named.group(1)).seeds == [int(s) for s in re.findall(r"\d+", seeds.group(1))], heading
        checked.append(named.group(1))
    assert {"cpu-baselines", "gba-design", "cpu-char-long", "cpu-proxy-long", "gba-design-proxy",
            "cpu-modern"} <= set(checked)


def test_the_sdist_carries_the_tests_and_everything_they_read(tmp_path):
    """The source distribution holds the repository's tests with their conftest.py, helpers.py and data, and the
    README, docs/, results/ and scripts/ they read (setuptools took the test files alone, so a packager's
    `pytest` in an unpacked sdist stopped at "No module named 'conftest'"); its metadata holds the SPDX license
    and gbattn.__version__; a run trained under results/ stays out. Built with the environment's setuptools from a
    copy of the repository."""
    import subprocess
    import sys
    import tarfile

    import gbattn

    root = README.parent
    copy = tmp_path / "repo"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "build", "dist", ".cache", ".device", "__pycache__", "*.egg-info", ".pytest_cache",
        ".lock"))
    local = copy / "results" / "mine"  # a comparison trained under results/: not the published results
    for name in ("standard/seed42/checkpoint.pt", "standard/seed42/best.pt", "standard/seed42/metrics.jsonl",
                 "standard/seed42/config.json", "standard/seed42/result.json", "standard/seed42/tokenizer.json",
                 "standard/seed42/.lock", "recipe.json"):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_text("{}")
    built = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_sdist(sys.argv[1]))", str(tmp_path)],
                           cwd=copy, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    with tarfile.open(tmp_path / built.stdout.split()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
        info = sdist.extractfile(f"gbattn-{gbattn.__version__}/PKG-INFO").read().decode()
    wanted = {path.relative_to(copy).as_posix() for folder in ("tests", "docs", "results", "scripts", "src/gbattn")
              for path in (copy / folder).rglob("*") if path.is_file() and not path.is_relative_to(local)}
    assert not wanted - names, sorted(wanted - names)[:10]
    assert {"README.md", "LICENSE", "pyproject.toml", "tests/conftest.py", "tests/helpers.py"} <= names
    assert not any(name.startswith((".ci/", "results/mine/")) or "__pycache__" in name for name in names)
    assert f"\nVersion: {gbattn.__version__}\n" in info and "\nLicense-Expression: MIT\n" in info
