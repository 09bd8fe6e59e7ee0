"""The repository's results files hold no absolute paths of the machines that made them (issue 17),
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
