"""The repository's results files hold no absolute paths of the machines that made them,
and every README table points at a results file that exists."""

from __future__ import annotations

import re
from itertools import count
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


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as
    hyphens, "-1", "-2", ... after a repeated one (code blocks hold no headings)."""
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (match := re.match(r"#+ (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in anchors else next(f"{slug}-{i}" for i in count(1)
                                                              if f"{slug}-{i}" not in anchors))
    return anchors


def test_links_between_the_readme_and_docs_reach_their_files_and_headings():
    """Every relative link of README.md and docs/*.md names a file of the repository, and a #heading
    that its target has (docs/README.md's index and the cross references between documents)."""
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", link):
                continue
            target_name, _, anchor = link.partition("#")
            target = (path.parent / target_name).resolve() if target_name else path
            if not target.exists() or not target.is_relative_to(ROOT):
                broken.append(f"{path.relative_to(ROOT)}: {link} (no such file in the repository)")
            elif anchor and anchor not in heading_anchors(target.read_text(encoding="utf-8")):
                broken.append(f"{path.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


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
