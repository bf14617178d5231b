"""``polygate stats``: exact figures from a database of known rows, the text and JSON
reports, plots, and every way of having nothing to report."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import polygate
from polygate.cli import main
from polygate.cli._stats import default_db, parse_since
from polygate.telemetry import AttemptEvent, Batch, CallEvent, SessionEvent
from polygate.telemetry._report import quantile, tail_share
from polygate.telemetry._sqlite import SQLiteSink
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, two_source_settings

NOW = time.time()


def _call(i: int, *, scope: str = "chat", total: float, generation: float, ttft: float | None,
          source: str | None = "a", outcome: str = "ok", error_class: str | None = None,
          hedges: int = 0, hedge_won: int = 0, attempts: int = 1, stall_ms: float | None = None,
          stall_count: int | None = None, active: float | None = None, started_at: float = NOW,
          kind: str = "chat") -> CallEvent:
    return CallEvent(
        session_id="s1", logical_call_id=f"{scope}-{i}", scope=scope, kind=kind, stream=0,
        started_at=started_at, outcome=outcome, error_class=error_class, error_message=None,
        total_latency_ms=total, generation_ms=generation, ttft_ms=ttft, stall_ms=stall_ms,
        stall_count=stall_count, active_generation_ms=active, attempts=attempts, hedges=hedges,
        hedge_won=hedge_won, source=source, cached=0, prompt_tokens=10, completion_tokens=20,
        usage_source="upstream", content=None,
    )


def _attempt(call: CallEvent, n: int, *, source: str, role: str = "primary", error: str = "ok",
             latency: float = 1000.0) -> AttemptEvent:
    return AttemptEvent(
        call_id=f"{call.logical_call_id}.{n}", logical_call_id=call.logical_call_id,
        scope=call.scope, source=source, role=role, started_at=call.started_at,
        latency_ms=latency, ttft_ms=None, status_code=200, streamed=1, error=error,
        error_class=None, error_message=None, tokens_reserved=100, tokens_settled=30,
        prompt_tokens=None, completion_tokens=None, usage_source=None,
    )


@pytest.fixture
def known_db(tmp_path: Path) -> Path:
    """100 chat calls: 87 of 5 s (10 of them hedged, 7 won by the hedge), 13 of 90 s
    that spent 88 s waiting; plus 2 failed and 1 cancelled call in scope "other"."""
    calls: list[CallEvent] = []
    attempts: list[AttemptEvent] = []
    for i in range(87):
        hedged = i < 10
        won = i < 7
        call = _call(i, total=5000, generation=4800, ttft=800, hedges=int(hedged), hedge_won=int(won),
                     attempts=2 if hedged else 1, source="b" if won else "a",
                     stall_ms=1000 if i < 4 else 0, stall_count=1 if i < 4 else 0, active=3000)
        calls.append(call)
        attempts.append(_attempt(call, 1, source="a", error="hedge_cancelled" if won else "ok",
                                 latency=5000))
        if hedged:
            attempts.append(_attempt(call, 2, source="b", role="hedge",
                                     error="ok" if won else "hedge_cancelled", latency=3000))
    for i in range(87, 100):
        call = _call(i, total=90_000, generation=2000, ttft=500, active=1500)
        calls.append(call)
        attempts.append(_attempt(call, 1, source="a", latency=90_000))
    for i, error in enumerate(("DeadlineExceeded", "DeadlineExceeded")):
        call = _call(i, scope="other", total=30_000, generation=0, ttft=None, source=None,
                     outcome="error", error_class=error, attempts=3)
        calls.append(call)
        attempts += [_attempt(call, n, source="c", error="transient") for n in (1, 2, 3)]
    cancelled = _call(9, scope="other", total=1000, generation=0, ttft=None, source=None,
                      outcome="cancelled", error_class="Cancelled")
    calls.append(cancelled)
    attempts.append(_attempt(cancelled, 1, source="c", error="cancelled"))
    session = SessionEvent("s1", NOW, NOW, NOW, 1, "0.1.0", 0, 5, json.dumps({"chat": 3, "other": 2}))
    path = tmp_path / "known.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch(calls, attempts, session))
    sink.close()
    return path


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["stats", *argv, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


# --------------------------------------------------------------------------- arithmetic


def test_quantile_and_tail_share() -> None:
    assert quantile([], 0.5) is None
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    values = [5000.0] * 87 + [90_000.0] * 13
    assert tail_share(values, 13) == pytest.approx((13, 100 * 1_170_000 / 1_605_000))
    assert tail_share(values, 0.5) == pytest.approx((1, 100 * 90_000 / 1_605_000))
    assert tail_share([], 10) == (0, 0.0)


def test_parse_since() -> None:
    assert parse_since("30m", now=10_000) == 10_000 - 1800
    assert parse_since("2d", now=1e6) == 1e6 - 2 * 86400
    assert parse_since(" 1.5h ", now=10_000) == 10_000 - 5400
    assert parse_since("2026-01-02T03:04:05+00:00") == 1767323045.0
    for bad in ("yesterday", "5 parsecs", "", "-3h"):
        with pytest.raises(ValueError, match="--since"):
            parse_since(bad)


@pytest.mark.parametrize("when", ["2026-01-02T03:04:05Z", "2026-01-02T03:04:05z",
                                  "2026-01-02T03:04:05.0Z", "2026-01-02T03:04:05.0000000+00:00"])
def test_since_reads_a_z_and_any_fraction_on_every_python(when: str) -> None:
    """Review finding (the Python versions): 3.10's fromisoformat reads only what
    isoformat writes, so --since 2026-01-01T00:00:00Z exited 2 there; the same
    arguments, read as 3.10 would be given them, on every Python."""
    from polygate.cli import _stats

    assert parse_since(when) == 1767323045.0
    normalised = _stats._iso_as_310_reads_it(when)
    assert not normalised.endswith(("Z", "z")) and parse_since(when) == 1767323045.0
    assert "." not in normalised or len(normalised.split(".")[1].split("+")[0]) == 6


@pytest.mark.parametrize("age", ["100000000w", "1" + "0" * 400 + "s", "3000000000000d"])
def test_an_age_reaching_before_any_date_is_refused(age: str) -> None:
    """A docs sweep of cli.md ("an age too large to be a time"): only an age that
    overflowed a float was refused; 100000000w (before year 1) went on as a negative
    epoch in the report."""
    with pytest.raises(ValueError, match="an age too large to be a time"):
        parse_since(age, now=1.8e9)
    assert parse_since("100000w", now=1.8e9) == 1.8e9 - 100_000 * 7 * 86400  # (1.9 kyr: a date)


def test_a_date_the_local_time_cannot_convert_is_said_so() -> None:
    """Outside review (hostile arguments): ``--since 0001-01-01`` is an ISO date, yet
    it was told "expected an age like 30m ... or an ISO date/time"."""
    with pytest.raises(ValueError, match="a date out of range"):
        parse_since("0001-01-01")
    assert parse_since("0001-01-01T00:00+00:00") < 0  # (an offset converts)


# --------------------------------------------------------------------------- the report


def test_exact_figures(known_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _json(capsys, "--db", f"sqlite://{known_db}", "--scope", "chat")
    assert (r["calls"], r["attempts"], r["scope"]) == (100, 110, "chat")
    latency = {row["source"]: row for row in r["latency"]}
    assert latency["(all)"] | {} == {
        "scope": "chat", "source": "(all)", "calls": 100,
        "p50_ms": 5000, "p90_ms": 90_000, "p99_ms": 90_000, "max_ms": 90_000,
    }
    assert latency["b"]["calls"] == 7 and latency["a"]["calls"] == 93
    tail = {t["slowest_pct"]: t for t in r["tail_share"]}
    assert tail[13]["calls"] == 13
    assert tail[13]["share_pct"] == pytest.approx(72.897, abs=1e-3)  # "13 % of calls ate 73 %"
    w = r["waiting_vs_generating"]
    assert w["total_ms"] == 1_605_000
    assert w["waiting_ms"] == 87 * 200 + 13 * 88_000
    assert w["waiting_pct"] == pytest.approx(100 * (87 * 200 + 13 * 88_000) / 1_605_000)
    assert (w["ttft_ms"], w["stall_ms"]) == (87 * 800 + 13 * 500, 4 * 1000)
    assert w["ttft_p50_ms"] == 800 and w["ttft_p99_ms"] == 800
    assert (w["calls_with_stalls"], w["stalls"]) == (4, 4)
    h = r["hedging"]
    assert (h["hedged_calls"], h["hedges"], h["hedge_wins"]) == (10, 10, 7)
    assert h["hedge_rate_pct"] == pytest.approx(10.0) and h["hedge_win_rate_pct"] == pytest.approx(70.0)
    assert h["suppressed_by_budget"] == 3  # only scope "chat" of the session totals
    assert r["attempts_per_call"] == {"mean": 1.1, "histogram": {"1": 90, "2": 10}}
    sources = {s["source"]: s for s in r["sources"]}
    assert sources["a"]["outcomes"] == {"ok": 93, "hedge_cancelled": 7}
    assert sources["b"]["hedge_attempts"] == 10 and sources["b"]["failure_pct"] == 0
    assert r["telemetry"] == {"sessions": 1, "rows_dropped": 5}


def test_embeddings_and_failed_calls_do_not_skew_the_split_or_the_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Probe findings (third round): an embedding call's generation_ms is the sum of its
    batches (4 batches of 1 s side by side: 4 s in a 1 s call), which made 'waiting'
    negative for every call in the report, and it counted in the hedge rate though
    embeddings are never hedged; a call that failed after its hedge took over (a
    committed stream that stalled) counted as won by the hedge.  No attempt rows at all
    (as in a database of cache hits): the text report's empty sources table raised."""
    calls = [
        _call(0, total=2000, generation=1500, ttft=500),
        _call(1, total=1000, generation=4000, ttft=None, kind="embed", attempts=4),
        _call(2, total=3000, generation=2500, ttft=400, hedges=1, hedge_won=1, attempts=2,
              source="b", outcome="error", error_class="StreamStalled"),
        _call(3, total=2000, generation=1000, ttft=300, hedges=1, hedge_won=1, attempts=2, source="b"),
        # (OCR pages are not hedged either: an OCR call is not in the rate.)
        _call(4, total=1000, generation=900, ttft=None, kind="ocr", attempts=1),
    ]
    path = tmp_path / "mixed.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch(calls, [], None))
    sink.close()
    r = _json(capsys, "--db", str(path))
    w = r["waiting_vs_generating"]
    assert (w["successful_calls"], w["other_calls"], w["failed_calls"]) == (2, 2, 1)
    assert (w["total_ms"], w["waiting_ms"], w["generating_ms"]) == (4000, 1500, 2500)
    h = r["hedging"]
    assert (h["hedged_calls"], h["hedge_wins"]) == (2, 1)
    assert h["hedge_rate_pct"] == pytest.approx(100 * 2 / 3)  # neither embedding nor OCR in it
    assert main(["stats", "--db", str(path)]) == 0
    text = capsys.readouterr().out
    assert "2 successful chat calls" in text and "2 embedding and OCR calls not split" in text
    assert "-" not in text.split("waiting (total - generation)")[1].split("\n")[0]


def test_attempts_of_calls_not_in_the_report_are_not_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: with no --since or --scope every attempt row was read, a call's still
    running (its first attempt written, its call row not yet) among them: '1 calls, 2
    attempts', and a source's failure rate from a call the report does not hold."""
    done = _call(1, total=2000, generation=1000, ttft=100)
    running = _call(2, total=2000, generation=1000, ttft=100)  # its row is not written yet
    path = tmp_path / "live.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch([done], [_attempt(done, 1, source="a"),
                              _attempt(running, 1, source="a", error="transient")], None))
    sink.close()
    for window in ([], ["--since", "1w"]):
        r = _json(capsys, "--db", str(path), *window)
        assert (r["calls"], r["attempts"]) == (1, 1), window
        assert {s["source"]: s["outcomes"] for s in r["sources"]}["a"] == {"ok": 1}


def test_scope_and_since_select_calls_with_all_their_attempts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Probe findings (fourth round): --scope selected the attempts by the scope each ran
    in, so a call's attempts in its fallback scope went missing ('4 calls, 4 attempts'
    beside a mean of 2 a call); --since selected them by when each was admitted, so a
    call started before the cut-off brought in its late attempt but not itself."""
    calls, attempts = [], []
    for i in range(4):
        call = _call(i, total=2000, generation=1000, ttft=100, attempts=2, source="b")
        calls.append(call)
        attempts += [_attempt(call, 1, source="a", error="transient"),
                     _attempt(call, 2, source="b")._replace(scope="large")]
    early = _call(9, total=9000, generation=1000, ttft=100, started_at=NOW - 100)
    calls.append(early)
    attempts.append(_attempt(early, 1, source="a")._replace(started_at=NOW))  # waited past the cut-off
    path = tmp_path / "fallback.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch(calls, attempts, None))
    sink.close()
    r = _json(capsys, "--db", str(path), "--scope", "chat", "--since", "2026-01-01T00:00:00+00:00")
    assert (r["calls"], r["attempts"]) == (5, 9)
    cut_off = datetime.datetime.fromtimestamp(NOW - 50, tz=datetime.timezone.utc).isoformat()
    r = _json(capsys, "--db", str(path), "--since", cut_off)  # (NOW is this module's import)
    assert (r["calls"], r["attempts"]) == (4, 8)
    assert r["attempts_per_call"]["mean"] == 2.0
    sources = {(s["scope"], s["source"]): s for s in r["sources"]}
    assert sources[("large", "b")]["outcomes"] == {"ok": 4}


def test_a_fallbacks_source_is_named_with_its_scope_in_the_latency_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Outside review (names in the reports): a source's name is its scope's own, and
    one provider's name in two scopes is the usual case.  A ``chat`` call that fell
    back to ``large``'s "openai" made a latency row ``chat / openai``, the row of
    ``chat``'s own "openai" (which failed every attempt it had)."""
    own = _call(1, total=1000, generation=900, ttft=100, source="openai")
    fell = _call(2, total=3000, generation=900, ttft=100, source="openai")._replace(
        answered_scope="large")
    path = tmp_path / "fallback.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch([own._replace(answered_scope="chat"), fell], [], None))
    sink.close()
    r = _json(capsys, "--db", str(path))
    rows = {(row["scope"], row["source"]): row["calls"] for row in r["latency"]}
    assert rows == {("chat", "(all)"): 2, ("chat", "openai"): 1, ("chat", "large/openai"): 1}


def test_all_scopes_with_errors(known_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _json(capsys, "--db", str(known_db))  # a plain path works too
    assert r["calls"] == 103
    assert r["outcomes"] == {"ok": 100, "error": 2, "cancelled": 1}
    assert r["error_classes"] == {"DeadlineExceeded": 2, "Cancelled": 1}
    other = {row["source"]: row for row in r["latency"] if row["scope"] == "other"}
    assert other["(error)"]["calls"] == 2 and other["(cancelled)"]["max_ms"] == 1000
    assert r["hedging"]["suppressed_by_budget"] == 5
    assert r["attempts_per_call"]["histogram"] == {"1": 91, "2": 10, "3": 2}
    c = next(s for s in r["sources"] if s["source"] == "c")
    assert c["failure_pct"] == pytest.approx(100 * 6 / 7)
    assert r["waiting_vs_generating"]["failed_calls"] == 3


def test_text_report(known_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--db", f"sqlite://{known_db}"]) == 0
    out = capsys.readouterr().out
    assert "103 calls, 117 attempts" in out
    assert "outcomes: ok 100, error 2, cancelled 1 (DeadlineExceeded 2, Cancelled 1)" in out
    assert "slowest 13 % (14 calls)" in out
    assert "won by the hedge: 7 (70.0 % of hedged calls)" in out
    assert "suppressed by the budget: 5" in out
    assert "warning: 5 telemetry rows were dropped" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["chat", "(all)", "100", "5.00", "s", "90.0", "s", "90.0", "s", "90.0", "s"] in lines


def test_since_filters_calls(known_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conn = sqlite3.connect(known_db)
    conn.execute("UPDATE calls SET started_at = started_at - 7200 WHERE scope = 'other'")
    conn.execute("UPDATE attempts SET started_at = started_at - 7200 WHERE scope = 'other'")
    conn.commit()
    conn.close()
    assert _json(capsys, "--db", str(known_db), "--since", "1h")["calls"] == 100
    assert _json(capsys, "--db", str(known_db), "--since", "3h")["calls"] == 103


def test_plot(known_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    assert main(["stats", "--db", str(known_db), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().err


def test_plot_without_matplotlib(
    known_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["stats", "--db", str(known_db), "--plot", str(tmp_path / "x.png")]) == 1
    # (The dependency itself: polygate is installed from its source, and the name on
    # PyPI is another project's.)
    assert "pip install 'matplotlib>=3.8'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["stats", "demo"])
def test_plot_with_a_matplotlib_that_cannot_be_imported(
    known_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], command: str,
) -> None:
    """matplotlib 3.7 under numpy 2 (both inside the floors once) fails to import: the
    advice to install it ("Requirement already satisfied") mended nothing."""
    broken = tmp_path / "site" / "matplotlib"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise ImportError("numpy.core.multiarray failed to import\\nmore lines")\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    png = str(tmp_path / "x.png")
    args = (["stats", "--db", str(known_db), "--plot", png] if command == "stats"
            else ["demo", "--plot", png])
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "matplotlib is installed but cannot be imported " \
        "(ImportError: numpy.core.multiarray failed to import)" in err
    assert "pip install" not in err


@pytest.mark.parametrize(("name", "problem"), [
    ("no/such/folder/out.png", "No such file or directory"),
    ("out.txt", "Format 'txt' is not supported"),
])
def test_a_plot_that_cannot_be_written_is_one_line(
    name: str, problem: str, known_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    assert main(["stats", "--db", str(known_db), "--plot", str(tmp_path / name)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "polygate stats: cannot write the plot" in err and problem in err


def test_demo_plot_that_cannot_be_written_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "no" / "out.png"
    assert main(["demo", "--calls", "20", "--plot", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "polygate demo: cannot write the plot" in err


# --------------------------------------------------------------------------- nothing to report


def _stats_error(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["stats", *argv])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


def test_missing_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.db"
    code, err = _stats_error(capsys, "--db", f"sqlite://{missing}")
    assert code == 1
    assert f"no telemetry database at {missing}" in err
    assert "POLYGATE__TELEMETRY=sqlite:///" in err
    assert not missing.exists()  # stats never creates a database


def test_empty_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    SQLiteSink.open(tmp_path / "empty.db").close()
    code, err = _stats_error(capsys, "--db", str(tmp_path / "empty.db"))
    assert code == 1 and "no calls recorded in" in err


def test_nothing_in_the_window(known_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _stats_error(capsys, "--db", str(known_db), "--scope", "nope", "--since", "1h")
    assert code == 1 and "since 1h in scope 'nope'" in err


def test_not_a_telemetry_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    code, err = _stats_error(capsys, "--db", str(path))
    assert code == 1 and "is not a polygate telemetry database" in err
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite" * 100)
    code, err = _stats_error(capsys, "--db", str(junk))
    assert code == 1 and "cannot read" in err


def test_a_file_that_is_no_database_leaves_no_connection_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.13 warns of an unclosed sqlite3 connection (a ResourceWarning: an
    error under ``-W error``): the reader closes the one it opened when the file turns
    out to be no database."""
    from polygate.telemetry import _sqlite

    opened: list[sqlite3.Connection] = []
    connect = _sqlite._connect

    def tracked(*args: object, **kwargs: object) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)  # type: ignore[arg-type]
        opened.append(conn)
        return conn

    monkeypatch.setattr(_sqlite, "_connect", tracked)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite" * 100)
    code, err = _stats_error(capsys, "--db", str(junk))
    assert code == 1 and "cannot read" in err
    assert opened
    for conn in opened:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            conn.execute("SELECT 1")


def test_newer_schema(known_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conn = sqlite3.connect(known_db)
    conn.execute("INSERT INTO polygate_schema VALUES (7, 0)")
    conn.commit()
    conn.close()
    code, err = _stats_error(capsys, "--db", str(known_db))
    assert code == 1 and "schema version 7, newer than this polygate supports" in err


@pytest.mark.parametrize("argv", [
    ["--since", "soon"], ["--tail", "0"], ["--tail", "x,5"],
    # review: an empty value was read as none given (--since "$SINCE" with SINCE unset
    # reported every call ever recorded), and an age past a float's range printed
    # "since": -Infinity, which is not JSON
    ["--since", ""], ["--since", " "], ["--scope", ""], ["--since", "9" * 400 + "s", "--json"],
])
def test_bad_arguments(known_db: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, err = _stats_error(capsys, "--db", str(known_db), *argv)
    assert code == 2 and err.startswith("polygate stats: --")


def test_unknown_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _stats_error(capsys, "--db", "mysql://u:hunter2-pw@h/db")
    assert code == 1 and "unknown database URL 'mysql://u:***@h/db'" in err
    assert "hunter2" not in err


@pytest.mark.parametrize("url", ["sqlite://other.db", "sqlite://data/t.db"])
def test_a_sqlite_url_with_a_host_is_refused_not_read_elsewhere(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: ``sqlite://other.db`` took "other.db" for a host and an empty path: the
    command read the default database instead, exited 0, and labelled its report with
    the URL it was given.  Refused, as the settings refuse it."""
    code, err = _stats_error(capsys, "--db", url)
    assert code == 1 and "names a host: a SQLite URL is sqlite:///path" in err


def test_an_unparseable_sqlite_url_is_refused_as_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    """Review: ``sqlite://[x`` reached the generic reader failure ("cannot read ...:
    ValueError"); it is a URL that cannot be parsed, said as such."""
    code, err = _stats_error(capsys, "--db", "sqlite://[x")
    assert code == 1 and "is not a database URL: Invalid IPv6 URL" in err
    assert "ValueError" not in err


def test_default_database(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    assert default_db(env) == f"sqlite://{tmp_path}/state/polygate/telemetry.db"
    env["POLYGATE__TELEMETRY"] = "sqlite:///x/t.db"  # without scopes: read the key itself
    assert default_db(env) == "sqlite:///x/t.db"
    env["POLYGATE__CHAT__A__BASE_URL"] = "http://a/v1"
    assert default_db(env) == "sqlite:///x/t.db"


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_telemetry_key_is_unset_for_stats_too(tmp_path: Path, value: str) -> None:
    """Review finding (docs, claim by claim): with no scopes, stats read the key raw,
    so an empty value (a variable that expanded empty) made it exit 2."""
    env = {"HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state"),
           "POLYGATE__TELEMETRY": value}
    assert default_db(env) == f"sqlite://{tmp_path}/state/polygate/telemetry.db"


def test_stats_reads_the_telemetry_key_as_a_session_does(tmp_path: Path) -> None:
    """A padded value: the sessions strip it and write to /x/t.db; stats looked for
    '/x/t.db ' (another file) and reported no database."""
    env = {"HOME": str(tmp_path), "POLYGATE__TELEMETRY": " sqlite:///x/t.db \n",
           "POLYGATE__CHAT__A__BASE_URL": "http://a/v1"}
    written = polygate.Settings.from_env(env).telemetry
    del env["POLYGATE__CHAT__A__BASE_URL"]  # the machine that only reads reports
    assert default_db(env) == written == "sqlite:///x/t.db"


def test_a_bad_telemetry_key_is_named_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.upper().startswith("POLYGATE")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("POLYGATE__TELEMETRY", "bogus://x")
    code, err = _stats_error(capsys)
    assert code == 2 and "POLYGATE__TELEMETRY: " in err and "Settings.telemetry" not in err, err
    (tmp_path / "polygate.toml").write_text('telemetry = "bogus://x"\n')
    code, err = _stats_error(capsys)
    assert code == 2 and "polygate.toml: telemetry: " in err and "Settings." not in err, err


def test_default_database_from_a_file_without_scopes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """A polygate.toml holding only ``telemetry`` (as for a machine that only reads
    reports) names the database; keys beside a file warn nothing here: stats only
    looks for the database."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "polygate.toml").write_text('telemetry = "sqlite:///from/file.db"\n')
    env = {"HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    assert default_db(env) == "sqlite:///from/file.db"
    (tmp_path / "polygate.toml").write_text(
        'telemetry = "sqlite:///from/file.db"\n[scopes.chat.sources.a]\nbase_url = "http://a/v1"\n')
    env["POLYGATE__CHAT__A__BASE_URL"] = "http://b/v1"  # ignored beside the file
    assert default_db(env) == "sqlite:///from/file.db"
    assert not recwarn.list


def test_a_configuration_file_that_is_missing_or_broken_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Probe finding (fourth round): with POLYGATE_CONFIG naming a missing file, stats
    reported on the default database instead (chat and check-config exit 2)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POLYGATE_CONFIG", str(tmp_path / "missing.toml"))
    code, err = _stats_error(capsys)
    assert code == 2 and "missing.toml: configuration file not found" in err
    monkeypatch.delenv("POLYGATE_CONFIG")
    (tmp_path / "polygate.toml").write_text("telemetry = [unclosed\n")
    code, err = _stats_error(capsys)
    assert code == 2 and "invalid TOML" in err


# --------------------------------------------------------------------------- from real sessions


def test_rows_written_by_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A session's own rows: hedges sent and won, one suppressed by the budget."""
    db = tmp_path / "t.db"
    settings = attrs.evolve(
        two_source_settings(weights=FIRST_A, hedge=polygate.Hedge(after_s=8, budget_burst=1, budget_ratio=0.01)),
        telemetry=f"sqlite://{db}",
    )

    async def calls() -> polygate.SessionStatistics:
        a = FakeUpstream(Reply(first_token_s=20, tokens=4))
        b = FakeUpstream(Reply(first_token_s=1, tokens=4))
        async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
            for _ in range(3):
                await s.chat(MESSAGES)
            return await s.statistics()

    stats = trio.run(calls, clock=trio.testing.MockClock(autojump_threshold=0))
    suppressed = stats.governance.hedges_suppressed_by_budget["chat"]
    assert suppressed >= 2  # the two calls after the first found the budget empty
    r = _json(capsys, "--db", str(db))
    assert r["calls"] == 3 and r["attempts"] == 4
    assert r["hedging"]["hedged_calls"] == 1 and r["hedging"]["hedge_wins"] == 1
    assert r["hedging"]["suppressed_by_budget"] == suppressed
    latency = {row["source"]: row for row in r["latency"]}
    assert latency["a"]["p50_ms"] == pytest.approx(20_000, rel=0.01)
    assert latency["b"]["max_ms"] == pytest.approx(9_000, rel=0.01)
    assert r["waiting_vs_generating"]["waiting_ms"] == pytest.approx(8000, rel=0.01)


def test_a_reader_that_left_is_no_traceback(known_db: Path) -> None:
    """``polygate stats | head -3``: once the reader has gone, writing fails with a
    broken pipe; the command ends quietly (status 141, as a shell reports SIGPIPE),
    with no traceback."""
    import os
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has already left, like `head` after its lines
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "polygate", "stats", "--db", str(known_db)],
            stdout=write_end, stderr=subprocess.PIPE, timeout=60, check=False,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr.decode()
    assert proc.returncode == 141


def test_the_database_may_be_given_as_an_argument(
    known_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", "--json", str(known_db)]) == 0
    positional = json.loads(capsys.readouterr().out)
    assert main(["stats", "--json", "--db", str(known_db)]) == 0
    assert json.loads(capsys.readouterr().out) == positional
    assert main(["stats", str(known_db), "--db", str(known_db) + "x"]) == 2
    assert "once" in capsys.readouterr().err


def test_the_report_is_one_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: the calls, attempts and sessions were three reads on three states of
    the database: a batch committed between them gave 5 calls with 10 attempts."""
    from polygate.telemetry._sqlite import SQLiteReader

    from ._stats_snapshot import report_while_a_batch_lands

    sink = SQLiteSink.open(tmp_path / "t.db")
    try:
        r = report_while_a_batch_lands(sink, SQLiteReader, str(tmp_path / "t.db"), monkeypatch, capsys)
    finally:
        sink.close()
    assert (r["calls"], r["attempts"]) == (5, 5)


#: A read-only bind mount needs root (the CI machine's tests run as root).
_NEEDS_ROOT = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None,
    reason="a read-only bind mount needs root",
)


@contextlib.contextmanager
def _read_only(folder: Path, at: Path) -> Iterator[Path]:
    """``folder`` mounted read-only at ``at`` (a bind mount: root only)."""
    at.mkdir()
    subprocess.run(["mount", "--bind", str(folder), str(at)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(at)], check=True)
        yield at
    finally:
        subprocess.run(["umount", str(at)], check=False)


@_NEEDS_ROOT
def test_a_closed_wal_database_on_a_read_only_volume_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: a session's database after every session closed (the file alone, no
    ``-wal`` or ``-shm``) on a read-only volume -- a sidecar's ``:ro`` mount, a
    snapshot -- failed with "unable to open database file": a WAL reader creates the
    ``-shm`` file.  It is read as immutable there (no writer can be live)."""
    src = tmp_path / "data"
    src.mkdir()
    settings = attrs.evolve(two_source_settings(names=("a",)), telemetry=f"sqlite://{src / 't.db'}")

    async def calls() -> None:
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
            for _ in range(3):
                await s.chat(MESSAGES)

    trio.run(calls, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(p.name for p in src.iterdir()) == ["t.db"]
    with _read_only(src, tmp_path / "ro") as ro:
        r = _json(capsys, "--db", str(ro / "t.db"))
    assert r["calls"] == 3


@_NEEDS_ROOT
def test_a_read_only_database_whose_wal_holds_rows_is_refused_not_read_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: read as immutable, a database whose ``-wal`` still holds committed rows
    (a writer killed, a copy taken without its ``-shm``) gave a report without them,
    silently.  It is refused, saying what to do."""
    live = tmp_path / "live"
    live.mkdir()
    w = sqlite3.connect(live / "t.db", isolation_level=None)
    w.execute("PRAGMA journal_mode=WAL")
    w.execute("PRAGMA wal_autocheckpoint=0")
    w.execute("CREATE TABLE t (x)")
    w.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    w.execute("INSERT INTO t VALUES (1)")  # committed, in the -wal only
    snap = tmp_path / "snap"
    snap.mkdir()
    shutil.copy(live / "t.db", snap / "t.db")
    shutil.copy(live / "t.db-wal", snap / "t.db-wal")
    w.close()
    with _read_only(snap, tmp_path / "ro") as ro:
        code, err = _stats_error(capsys, "--db", str(ro / "t.db"))
    assert code == 1 and "its write-ahead log t.db-wal still holds rows" in err


@pytest.mark.parametrize("where", ["env", "file"])
def test_an_unchecked_telemetry_value_is_never_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str,
) -> None:
    """Outside review (2026-12-02): with a configuration that does not load, stats
    fell back to the raw telemetry value without checking it; a libpq key=value
    string was then read as a file's path and printed whole, password included."""
    secret = "SECRETpw-1234"
    dsn = f"host=127.0.0.1 port=5432 user=app password={secret} dbname=telemetry"
    for key in [k for k in os.environ if k.startswith("POLYGATE")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    if where == "env":
        monkeypatch.setenv("POLYGATE__TELEMETRY", dsn)
    else:
        (tmp_path / "polygate.toml").write_text(f'telemetry = "{dsn}"\n')
    assert main(["stats"]) == 2
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    assert "invalid configuration" in captured.err


@pytest.mark.parametrize("how", ["--db", "positional"])
def test_a_libpq_string_given_as_the_database_is_never_printed_whole(
    capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """Review: ``--db "host=... password=..."`` (libpq's key=value form, which stats
    reads as a file's path) printed the password in "no telemetry database at ..."."""
    dsn = "host=127.0.0.1 port=5432 user=app password=hunter2-secret dbname=telemetry"
    argv = ["--db", dsn] if how == "--db" else [dsn]
    code, err = _stats_error(capsys, *argv)
    assert code == 1 and "no telemetry database at" in err
    assert "hunter2-secret" not in err and "password=***" in err


def test_ties_in_the_report_are_ordered_by_name() -> None:
    # The counts came out in the order the database returned the rows: the same data
    # with and without --since listed two equal error classes in opposite orders.
    from collections import Counter

    from polygate.telemetry._report import _by_count

    assert list(_by_count(Counter(["b", "a", "c", "c"]))) == ["c", "a", "b"]
    assert list(_by_count(Counter(["a", "b", "c", "c"]))) == ["c", "a", "b"]


def test_the_plot_draws_a_source_of_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A group of one call was one vertex (a step with nothing to step to): named in
    # the legend, drawn nowhere.  A 0 ms call (virtual time) fell off the log axis.
    pytest.importorskip("matplotlib")
    from polygate.cli import _replay, _stats
    from polygate.telemetry._report import CallRow

    figures: list[Any] = []
    monkeypatch.setattr(_replay, "save_plot", lambda fig, path, prog: figures.append(fig) or True)

    def row(source: str, ms: float) -> CallRow:
        return CallRow(scope="chat", kind="chat", source=source, outcome="ok", error_class=None,
                       started_at=NOW, total_latency_ms=ms, generation_ms=ms, ttft_ms=None,
                       stall_ms=None, stall_count=None, active_generation_ms=None, attempts=1,
                       hedges=0, hedge_won=0, cached=0, answered_scope="chat")

    assert _stats._plot([row("a", 1000), row("a", 2000), row("b", 3000), row("c", 0)],
                        str(tmp_path / "x.png")) == 0
    [figure] = figures
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert set(lines) == {"chat/a (2)", "chat/b (1)", "chat/c (1)"}
    for line in lines.values():
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        assert len(xs) >= 2 and ys[0] == 0.0 and ys[-1] == 1.0
        assert min(xs) > 0  # on the log axis


def test_the_plot_groups_calls_as_the_latency_table_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache hit and a fallback scope's source of the same name were drawn as the
    asked scope's own source: one curve, one bar, for three different answerers (an
    outside review, 2026-12-05)."""
    pytest.importorskip("matplotlib")
    from polygate.cli import _replay, _stats
    from polygate.telemetry._report import CallRow, build_report

    figures: list[Any] = []
    monkeypatch.setattr(_replay, "save_plot", lambda fig, path, prog: figures.append(fig) or True)

    def row(ms: float, *, cached: int = 0, answered: str = "small") -> CallRow:
        return CallRow(scope="small", kind="chat", source="openai", outcome="ok", error_class=None,
                       started_at=NOW, total_latency_ms=ms, generation_ms=0 if cached else ms,
                       ttft_ms=None, stall_ms=None, stall_count=None, active_generation_ms=None,
                       attempts=0 if cached else 1, hedges=0, hedge_won=0, cached=cached,
                       answered_scope=answered)

    calls = [row(1000), row(0, cached=1), row(30000, answered="large")]
    table = {r["source"] for r in build_report(calls, [], [])["latency"]}
    assert table == {"(all)", "openai", "(cache)", "large/openai"}
    assert _stats._plot(calls, str(tmp_path / "x.png")) == 0
    [figure] = figures
    cdf, bars = figure.axes[:2]
    assert {line.get_label() for line in cdf.get_lines()} == {
        "small/openai (1)", "small/(cache) (1)", "small/large/openai (1)"}
    assert {tick.get_text() for tick in bars.get_yticklabels()} == {
        "all successful", "small/openai", "small/(cache)", "small/large/openai"}


def test_stats_refuses_a_sqlite_url_whose_path_a_hash_or_a_question_mark_would_end(
    known_db: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--db sqlite:///…/run#1.db`` reported on ``…/run``, another database, labelled
    with the name asked for; the settings refuse the same URL (a review, 2026-12-05)."""
    other = known_db.parent / "run"
    shutil.copy(known_db, other)  # the file the path would end at: another run's
    for url in (f"sqlite://{known_db.parent}/run#1.db", f"sqlite://{known_db.parent}/run?1.db"):
        assert main(["stats", "--db", url, "--json"]) == 1
        captured = capsys.readouterr()
        assert "unencoded" in captured.err and not captured.out, captured.err
    quoted = known_db.parent / "run#1.db"
    shutil.copy(known_db, quoted)
    assert main(["stats", "--db", f"sqlite://{known_db.parent}/run%231.db", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calls"]


def test_stats_reads_the_default_database_in_a_state_folder_named_with_a_hash(
    tmp_path: Path, known_db: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Sessions write ``sqlite://`` at the default path as it is; stats built its URL
    unquoted, so a '#', '?' or '%' in the state folder read another path."""
    from polygate.telemetry import default_path

    env = {"HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state#1?%41")}
    where = default_path(env)
    where.parent.mkdir(parents=True)
    shutil.copy(known_db, where)  # what a session with telemetry="sqlite://" wrote
    assert main(["stats", "--db", default_db(env), "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["calls"]


# --------------------------------------------------------------------------- hostile files


def _edited(known_db: Path, sql: str, params: tuple[Any, ...] = ()) -> Path:
    conn = sqlite3.connect(known_db)
    conn.execute(sql, params)
    conn.commit()
    conn.close()
    return known_db


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("mode", [[], ["--json"]])
@pytest.mark.parametrize(("sql", "params", "column"), [
    ("UPDATE calls SET started_at = ?", (1e20,), "started_at"),
    ("UPDATE calls SET started_at = ?", (float("inf"),), "started_at"),
    ("UPDATE calls SET started_at = 'yesterday'", (), "started_at"),
    ("UPDATE calls SET scope = X'6368'", (), "scope"),
    ("UPDATE calls SET outcome = X'6f6b'", (), "outcome"),
    ("UPDATE attempts SET source = X'61'", (), "source"),
    ("UPDATE attempts SET latency_ms = 'slow'", (), "latency_ms"),
    ("UPDATE calls SET total_latency_ms = ?", (float("-inf"),), "total_latency_ms"),
])
def test_a_row_polygate_never_writes_is_one_line_not_a_traceback(
    known_db: Path, capsys: pytest.CaptureFixture[str], sql: str, params: tuple[Any, ...],
    column: str, mode: list[str],
) -> None:
    """Outside review (hypothesis over hostile telemetry files): a time past year 9999,
    a BLOB in a text column or text in a number's were tracebacks (the report's text
    or its JSON is written after the reading's try), and an infinity made ``--json``
    print ``Infinity``.  Such a row is named, in one line, exit 1."""
    path = _edited(known_db, sql, params)
    assert main(["stats", str(path), *mode]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("polygate stats: ") and f"row whose {column} is" in err


@pytest.mark.parametrize("zone", ["Etc/GMT-14", "Etc/GMT+12"])  # UTC+14, UTC-12
@pytest.mark.parametrize("started_at", [0.0, 253402214399.0, 253402297200.0])
def test_the_last_times_it_takes_show_in_every_time_zone(
    known_db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    zone: str, started_at: float,
) -> None:
    """Outside review (clocks): a time the rows' check took, 9999-12-31T23:00Z, is year
    10000 in UTC+14, and the text report (local time) raised ValueError, a traceback.
    The last time taken is 9999-12-30 UTC: each is a report or one line, exit 1."""
    path = _edited(known_db, "UPDATE calls SET started_at = ?", (started_at,))
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        code = main(["stats", str(path)])
    finally:
        monkeypatch.undo()
        time.tzset()
    out, err = capsys.readouterr()
    if started_at > 253402214399.0:
        assert code == 1 and out == "" and err.startswith("polygate stats: ")
        assert len(err.strip().splitlines()) == 1 and "row whose started_at is" in err
    else:
        assert code == 0 and err == "" and "calls started" in out


def test_json_has_no_infinity_when_sums_overflow(
    known_db: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Finite figures whose sums overflow (1e308 each) gave NaN and Infinity in
    ``--json``: not JSON.  They are ``null``."""
    path = _edited(known_db, "UPDATE calls SET total_latency_ms = 1e308")
    assert main(["stats", str(path), "--json"]) == 0
    _strict(capsys.readouterr().out)


@pytest.mark.parametrize(("stored", "counted"), [
    ("[1, 2]", 0), ("5", 0), ("null", 0), ('{"chat": true}', 0), ('{"chat": -3}', 0),
    ('{"chat": 2}', 2),
])
def test_a_sessions_suppressed_hedges_of_another_shape_are_skipped(
    known_db: Path, capsys: pytest.CaptureFixture[str], stored: str, counted: int,
) -> None:
    """Valid JSON that is no object ended the whole report (AttributeError), and
    ``true`` counted as one suppressed hedge."""
    path = _edited(known_db, "UPDATE sessions SET hedges_suppressed = ?", (stored,))
    assert _json(capsys, str(path))["hedging"]["suppressed_by_budget"] == counted


def test_a_tiny_tail_is_the_slowest_call_at_least(
    known_db: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--tail 1e-300`` reported "(0 calls)": ⌈x % · calls⌉ is 1 for any x > 0."""
    assert _json(capsys, str(known_db), "--tail", "1e-300")["tail_share"][0]["calls"] == 1


def test_an_unreachable_postgres_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """libpq's hint ("\\tIs the server running on that host...") came on a second line."""
    pytest.importorskip("psycopg")
    assert main(["stats", "--db", "postgresql://u:hunter2pw@127.0.0.1:1/x"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "hunter2pw" not in err


@pytest.mark.parametrize("name", ["plot.", "sub/", "sub/.png", "plot", "p.svg"])
def test_the_plot_said_written_is_the_file_written(
    name: str, known_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Outside review (fuzzing the command line): matplotlib found the format by its own
    reading of the name, and "wrote plot." named no file (it wrote plot.png), "sub/"
    wrote "sub/.png.png"."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    monkeypatch.chdir(out)
    assert main(["stats", "--db", str(known_db), "--plot", name]) == 0
    [said] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("wrote ")]
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert written == [said.removeprefix("wrote ")], (said, written)


# --------------------------------------------------------------------------- review: stats against the demo


def test_everything_but_decoding_counts_a_failed_calls_time_as_the_demo_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Review finding (stats against an independent computation): docs/cli.md calls
    "everything but decoding" the demo's measure, but it left failed calls out, where
    the demo counts a failed call's whole time as waiting.  One answered call (2 s,
    1 s of it to the first token) and one cut by a 30 s deadline: the demo's 31/32,
    stats said 50 %."""
    ok = _call(0, total=2000, generation=2000, ttft=1000, active=1000)
    dead = _call(1, total=30_000, generation=0, ttft=None, source=None, outcome="error",
                 error_class="DeadlineExceeded")
    path = tmp_path / "t.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch([ok, dead], [_attempt(ok, 1, source="a"), _attempt(dead, 1, source="a", error="cancelled")],
                     SessionEvent("s1", NOW, NOW, NOW, 1, "0.1.0", 0, 0, "{}")))
    sink.close()
    w = _json(capsys, str(path))["waiting_vs_generating"]
    assert w["not_decoding_pct"] == pytest.approx(100 * (1000 + 30_000) / 32_000)
    assert w["waiting_pct"] == 0.0  # (the successful calls' split is unchanged)
    assert main(["stats", str(path)]) == 0
    assert "everything but decoding (waiting + time to first token, and failed calls whole): 96.9 %" in (
        capsys.readouterr().out)


def test_a_source_whose_attempts_the_deadline_cut_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Review finding: every attempt on a source ran until the call's deadline cut it
    (the incident's hang), and its row said 0.0 % failures and nothing else but
    ``cancelled=5``: a `cancelled` attempt is not the source's failure, but the ones
    cut by their call's deadline now have a column of their own."""
    calls = [_call(i, total=30_000, generation=0, ttft=None, source=None, outcome="error",
                   error_class="DeadlineExceeded") for i in range(4)]
    caller = _call(9, total=500, generation=0, ttft=None, source=None, outcome="cancelled",
                   error_class="Cancelled")
    attempts = [_attempt(c, 1, source="a", error="cancelled", latency=30_000) for c in calls]
    attempts.append(_attempt(caller, 1, source="a", error="cancelled", latency=500))
    path = tmp_path / "t.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch([*calls, caller], attempts, SessionEvent("s1", NOW, NOW, NOW, 1, "0.1.0", 0, 0, "{}")))
    sink.close()
    [row] = _json(capsys, str(path))["sources"]
    assert (row["failure_pct"], row["deadline_pct"]) == (0.0, 80.0)  # (the caller's cancel is not one)
    assert main(["stats", str(path)]) == 0
    table = capsys.readouterr().out.split("Attempts per source\n")[1].splitlines()
    assert table[0].split()[:6] == ["scope", "source", "attempts", "hedges", "failures", "deadline"]
    assert table[1].split()[:8] == ["chat", "a", "5", "0", "0.0", "%", "80.0", "%"]


def test_sums_past_a_float_print_as_unknown_not_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Review finding: a file (edited, another tool's) whose latencies sum past a float
    printed "nan % of the time", "inf s" and 300-digit durations; --json said null."""
    calls = [_call(i, total=1e306, generation=1e306, ttft=1e305, active=1e305) for i in range(300)]
    path = tmp_path / "t.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch(calls, [_attempt(c, 1, source="a", latency=1e306) for c in calls],
                     SessionEvent("s1", NOW, NOW, NOW, 1, "0.1.0", 0, 0, "{}")))
    sink.close()
    assert main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "inf" not in out, out
    assert max(len(word) for line in out.splitlines()[1:] for word in line.split()) < 20, out
    assert "slowest 1 % (3 calls): - of the time" in out


def test_call_ids_of_two_processes_do_not_collide() -> None:
    """Review finding: the per-process tag was 32 random bits; among ~100,000
    processes writing one telemetry store (workers, restarts, CLI runs) two tags
    matched more often than not, and `stats --scope` then counted the other call's
    attempts.  64 bits now, drawn again in a forked child."""
    script = "from polygate._context import new_call_id; print(new_call_id())"
    ids = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.strip() for _ in range(2)}
    assert len(ids) == 2
    for call_id in ids:
        tag, _, counter = call_id.partition("-")
        assert len(tag) == 16 and int(tag, 16) >= 0 and counter == "00000001", call_id


def test_the_deadline_column_asks_the_database_nothing_per_attempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review finding (of the deadline column): it was a subquery of every deadline
    call in each attempt's row, and PostgreSQL, once it had the tables' statistics,
    re-scanned it for every attempt: ``--since 1h`` on a store of 200,000 old deadline
    calls took 215 s, where it took 0.8 s before.  The calls cut by their deadline are
    known from the calls already read; the attempts' query is the plain one."""
    from polygate.telemetry import _report

    queries: list[str] = []
    real = _report.open_reader

    def spying(url: str) -> Any:
        reader = real(url)
        query = reader.query

        def recorded(sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
            queries.append(sql)
            return query(sql, params)

        reader.query = recorded  # type: ignore[method-assign]
        return reader

    monkeypatch.setattr(_report, "open_reader", spying)
    calls = [_call(i, total=30_000, generation=0, ttft=None, source=None, outcome="error",
                   error_class="DeadlineExceeded") for i in range(3)]
    path = tmp_path / "t.db"
    sink = SQLiteSink.open(path)
    sink.write(Batch(calls, [_attempt(c, 1, source="a", error="cancelled") for c in calls],
                     SessionEvent("s1", NOW, NOW, NOW, 1, "0.1.0", 0, 0, "{}")))
    sink.close()
    [row] = _json(capsys, str(path), "--since", "1h")["sources"]
    assert row["deadline_pct"] == 100.0
    [attempts_query] = [q for q in queries if " FROM attempts" in q]
    assert "error_class" not in attempts_query and "CASE" not in attempts_query, attempts_query
