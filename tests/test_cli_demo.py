"""`polygate demo`: the incident replay runs, in seconds, and hedging shows its effect."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import sqlite3
from pathlib import Path

import pytest

from polygate.cli import main


def test_demo_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--calls", "60", "--concurrency", "10"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "no hedging" in line and "hedge after" in line)
    assert "deadline 30 s" in header
    p99 = next(line for line in out.splitlines() if line.startswith("p99 latency"))
    values = [float(v) for v in re.findall(r"([\d.]+)s", p99)]
    assert len(values) == 3
    no_hedge, deadline, hedged = values
    assert deadline <= 30.0
    assert hedged < no_hedge  # the hung calls were rescued by a hedge
    failed = next(line for line in out.splitlines() if line.startswith("calls failed")).split()[-3:]
    assert failed[0] == "0" and failed[2] == "0"  # no hedging and hedging lose nothing


def test_demo_rejects_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--calls", "0"]) == 2
    assert "polygate demo: --calls and --concurrency must be > 0" in capsys.readouterr().err


def test_demo_writes_its_telemetry_for_stats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--db``: the replay's calls go to a SQLite telemetry file (the embedded store),
    one scope per configuration, and ``polygate stats`` answers from it."""
    db = tmp_path / "demo.db"
    assert main(["demo", "--calls", "20", "--concurrency", "10", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert f"polygate stats {db} --scope hedge_after_8s" in out
    with contextlib.closing(sqlite3.connect(db)) as conn:  # (a bare `with` only commits)
        counts = dict(conn.execute("SELECT scope, count(*) FROM calls GROUP BY scope").fetchall())
    assert counts == {"no_hedging": 20, "deadline_30s": 20, "hedge_after_8s": 20}
    assert main(["stats", str(db), "--scope", "hedge_after_8s"]) == 0
    assert "20 calls" in capsys.readouterr().out
    # The demo's waiting row and stats' "everything but decoding" are one measure
    # (docs/cli.md): the deadline column, whose failed calls are all waiting, too.
    row = next(line for line in out.splitlines() if line.startswith("time spent waiting"))
    demo = [float(v) for v in re.findall(r"([\d.]+)%", row)]
    failed = next(line for line in out.splitlines() if line.startswith("calls failed")).split()[-3:]
    assert int(failed[1]) > 0  # (the deadline cut some calls: the case that differed)
    for scope, shown in zip(("no_hedging", "deadline_30s", "hedge_after_8s"), demo, strict=True):
        assert main(["stats", str(db), "--scope", scope, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["waiting_vs_generating"]["not_decoding_pct"] == pytest.approx(shown, abs=0.051), scope


def test_demo_refuses_a_db_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--calls", "5", "--db", "postgresql://db/x"]) == 2
    assert "--db takes a SQLite file's path" in capsys.readouterr().err
    assert main(["demo", "--calls", "5", "--db", str(tmp_path)]) == 1  # a folder
    assert capsys.readouterr().err.startswith("polygate demo: ")


@pytest.mark.parametrize("db", ["sqlite://relative.db", "sqlite://host/x.db", "sqlite://"])
def test_demo_refuses_a_sqlite_url_that_names_no_file_of_its_own(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """review: a malformed sqlite:// URL passed unchecked, failed in the run (status 1,
    "cannot open", after the header); bare sqlite:// named the default telemetry
    database, mixing the demo's made-up calls with real ones."""
    assert main(["demo", "--calls", "5", "--db", db]) == 2
    captured = capsys.readouterr()
    assert "--db takes a SQLite file's path" in captured.err and captured.out == ""


def test_the_suggested_stats_command_quotes_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: a path with a space was printed as it is, so the command that follows
    it ("polygate stats my dir/x y.db …") could not be pasted."""
    db = tmp_path / "my dir" / "x y.db"
    db.parent.mkdir()
    assert main(["demo", "--calls", "5", "--concurrency", "5", "--db", str(db)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    command = line.split(": ", 1)[1]
    assert shlex.split(command)[:3] == ["polygate", "stats", str(db)]


def test_an_empty_plot_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # (--plot "$OUT" with the variable unset ran the whole replay and drew nothing.)
    assert main(["demo", "--calls", "5", "--plot", ""]) == 2
    assert capsys.readouterr().err == "polygate demo: --plot is empty\n"


def test_a_relative_db_in_a_working_directory_since_deleted_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: ``Path(db).absolute()`` asks for the working directory, which was gone:
    a FileNotFoundError traceback."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert main(["demo", "--calls", "2", "--concurrency", "1", "--db", "rel.db"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "polygate demo: cannot resolve --db rel.db: the working directory is gone"]


@pytest.mark.parametrize("name", ["run?x=1.db", "run#1.db", "run%41.db"])
def test_a_db_path_with_url_characters_is_the_file_named(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: the path went into a sqlite:// URL unquoted, and the file written was
    another (``run#1.db`` wrote ``run``; ``run%41.db`` wrote ``runA.db``), so the
    suggested ``polygate stats`` found nothing."""
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--calls", "1", "--concurrency", "1", "--db", name]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db" or p.name == "run") == [name]
    capsys.readouterr()
    assert main(["stats", name]) == 0


@pytest.mark.parametrize("url", ["sqlite:///?", "sqlite:///#demo", "sqlite:///?mode=rwc", "SUFFIX#demo",
                                 "sqlite:real.db"])
def test_a_db_url_that_names_another_file_is_refused(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: ``sqlite:///?`` named the default telemetry database (as bare
    ``sqlite://``, which is refused so that the demo's calls never mix with real ones),
    and ``sqlite:///real.db#demo`` wrote into ``real.db``."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    real = tmp_path / "real.db"
    url = url.replace("SUFFIX", f"sqlite:///{real}")
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--calls", "1", "--concurrency", "1", "--db", url]) == 2
    assert "--db takes a SQLite file's path or a sqlite:///path URL" in capsys.readouterr().err
    assert not (tmp_path / "state").exists() and not real.exists()
    assert not (tmp_path / "sqlite:real.db").exists()  # (which stats reads as a URL)
