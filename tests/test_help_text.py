"""Help texts in a narrow terminal: `gbattn --help`'s description (argparse's _fill_text, not the options'
_split_lines that tests/test_cli.py checks) keeps hyphenated and long words whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gbattn.cli import main


def test_the_description_of_gbattn_help_keeps_its_words_whole_in_a_narrow_terminal(capsys, monkeypatch):
    """At 14 columns the description's `Gradient-boosted` could be split at its hyphen (`Gradient-` / `boosted`), or,
    being longer than the line, anywhere (`Gradient-boo` / `sted`): a reader cannot tell such pieces from two words.
    Every word of the description is whole at 14 and 20 columns, running past the line's end where it is longer."""
    def words(columns: int) -> list[str]:
        monkeypatch.setenv("COLUMNS", str(columns))
        with pytest.raises(SystemExit):
            main(["--help"])
        return capsys.readouterr().out.split()

    wide = words(1000)
    assert "Gradient-boosted" in wide
    for columns in (14, 20):
        narrow = words(columns)
        assert "Gradient-boosted" in narrow, (columns, narrow)
        assert sorted(set(narrow) - set(wide)) == [], columns


SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_script_shows_its_help_under_python_oo(script):
    """python -OO strips docstrings, where each script takes its --help description: five ended in an
    AttributeError traceback (None.splitlines())."""
    done = subprocess.run([sys.executable, "-OO", str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
