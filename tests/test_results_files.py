"""The repository's results files hold no absolute paths of the machines that made them,
and every README table points at a results file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABSOLUTE = re.compile(r"""(?:^|[\s"'`(=:])(/(?:tmp|work|root|home|opt|usr|Users|mnt|var)/[^\s"'`)]*)""")


def test_results_files_hold_no_absolute_paths():
    found = []
    for path in sorted((ROOT / "results").rglob("*")):
        if path.suffix in (".json", ".md", ".txt") and path.is_file():
            for match in ABSOLUTE.finditer(path.read_text(encoding="utf-8")):
                found.append(f"{path.relative_to(ROOT)}: {match.group(1)}")
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
