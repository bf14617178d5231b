"""The command line, reviewed as users type it: what reaches the terminal.  Each test
failed before its fix."""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

from polygate.cli import main

from .test_cli_chat import env  # noqa: F401  (fixtures)
from .test_cli_stats import known_db  # noqa: F401


def test_the_no_calls_line_shows_the_path_escaped(
    known_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    """docs/cli.md: a path in an error line is shown escaped.  "no calls recorded in
    PATH" printed it raw: a line break split the line, an escape reached the terminal."""
    weird = tmp_path / "we\nird\x1b[31m.db"
    shutil.copy(known_db, weird)
    assert main(["stats", str(weird), "--scope", "nosuch"]) == 1
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("polygate stats: no calls recorded in "), err
    assert "\x1b" not in err
    assert "we\\nird\\x1b[31m.db" in first


def test_the_report_shows_names_from_the_file_escaped(
    known_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    """A scope, source or error class polygate never writes (its names refuse control
    characters; another tool's file, or one edited by hand) reached the terminal as an
    escape sequence: a title change, a screen clear, a forged line.  The text report
    escapes them, as it does a path, and the table stays aligned on what is shown."""
    db = tmp_path / "edited.db"
    shutil.copy(known_db, db)
    conn = sqlite3.connect(db)
    conn.execute("UPDATE calls SET scope = 'evil\x1b[31m\nX', error_class = 'E\x1b]0;pwned\x07' "
                 "WHERE rowid < 3")
    conn.execute("UPDATE attempts SET source = 's\x1b[2J' WHERE rowid < 3")
    conn.commit()
    conn.close()
    code = main(["stats", str(db)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[31m\\nX" in out and "s\\x1b[2J" in out and "E\\x1b]0;pwned\\x07" in out
    table = out.split("Latency of calls")[1].split("\n\n")[0].splitlines()[1:]
    widths = {len(line.split("  ")[0]) for line in table if line.strip()}
    assert len(widths) == 1, table  # (the scope column padded to the escaped names)
    # The JSON report keeps the values as they are: JSON escapes them itself.
    assert main(["stats", str(db), "--json"]) == 0
    assert "evil\x1b[31m\nX" in {r["scope"] for r in json.loads(capsys.readouterr().out)["latency"]}


def test_an_empty_plot_path_is_a_usage_error(
    known_db: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    """``--plot "$OUT"`` with OUT unset: refused (status 2) as ``demo --plot ""`` is,
    and as an empty --since, --scope or --db are, not a report without its plot."""
    assert main(["stats", str(known_db), "--plot", ""]) == 2
    assert capsys.readouterr().err == "polygate stats: --plot is empty\n"


@pytest.mark.parametrize("argv", [["check-config"], ["serve", "--port", "0"]])
def test_a_config_error_quoting_an_environment_key_is_shown_escaped(
    argv: list[str], env: pytest.MonkeyPatch,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An environment key's name with an escape sequence in it (a stray variable from
    a broken script) is quoted by the error: ``polygate chat`` escaped it, check-config
    and serve printed it raw."""
    env.setenv("POLYGATE__CHAT__B\x1b[31mX__BASE_URL", "http://x/v1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "\\x1b[31m" in err
    assert "\x1b" not in err


def test_serve_log_lines_are_escaped() -> None:
    """The server's log formatter: escapes shown as text."""
    import logging

    from polygate.cli._serve import _Lines

    record = logging.LogRecord("polygate", logging.ERROR, __file__, 1,
                               "reload refused: %s", ("bad key \x1b[2J\x07",), None)
    assert _Lines().format(record) == "polygate serve: error: reload refused: bad key \\x1b[2J\\x07"
    # A traceback logged with the record (log.exception) quotes the exception's text.
    try:
        raise ValueError("from upstream \x1b]0;pwned\x07")
    except ValueError:
        record = logging.LogRecord("polygate", logging.ERROR, __file__, 1, "cache write failed",
                                   (), sys.exc_info())
    shown = _Lines().format(record)
    assert "\x1b" not in shown and "\x07" not in shown
    assert shown.startswith("polygate serve: error: cache write failed\nTraceback")
    assert shown.endswith("ValueError: from upstream \\x1b]0;pwned\\x07")


def test_the_paths_a_plot_and_the_demo_name_are_shown_escaped(
    known_db: Path, tmp_path: Path, env: pytest.MonkeyPatch,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: ``wrote PATH`` (stats and demo) and the demo's closing line naming its
    telemetry file, with the command to read it, printed the names raw."""
    pytest.importorskip("matplotlib")
    plot = tmp_path / "p\x1b[31m.png"
    assert main(["stats", str(known_db), "--plot", str(plot)]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "wrote " in err and "p\\x1b[31m.png" in err
    db, png = tmp_path / "t\x1b[31m.db", tmp_path / "q\x1b[32m.png"
    assert main(["demo", "--calls", "4", "--concurrency", "2", "--db", str(db), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "telemetry written to " in out and "t\\x1b[31m.db" in out and "q\\x1b[32m.png" in out
