"""What ``polygate stats`` computes from a telemetry database (pure, testable).

The questions are the queue-hang incident's (``docs/incident.md``): where does the time go —
latency quantiles per scope and source, how much of all the time the slowest few
calls take ("13 % of calls ate 71 %"), waiting versus generating (``total −
generation``, time to first token, stalls), hedging (rate, win rate, suppressed by
budget), error classes, attempts per call, and each source's attempts.

Definitions match the demo's (``docs/cli.md``): quantiles are nearest-rank over
``total_latency_ms`` of every call, failed ones included; the tail share is the summed
latency of the slowest ⌈x % · calls⌉ calls over the summed latency of all calls.

Hedges suppressed by the budget (calls the budget denied a hedge, each counted once)
are counted by the governor, not stored per call, so they come from the ``sessions``
rows: the totals of sessions active in the window, not cut to it.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

from .._config import mask_url
from .._errors import ConfigError
from .._secrets import printable
from ._schema import check_version

__all__ = [
    "AttemptRow", "CallRow", "NoData", "Reader", "build_report", "open_reader", "read_rows", "split_calls",
    "time_split",
]


class CallRow(NamedTuple):
    scope: str
    kind: str  # "chat" | "embed" | "ocr"
    source: str | None
    outcome: str
    error_class: str | None
    started_at: float
    total_latency_ms: float
    generation_ms: float
    ttft_ms: float | None
    stall_ms: float | None
    stall_count: int | None
    active_generation_ms: float | None
    attempts: int
    hedges: int
    hedge_won: int
    cached: int
    answered_scope: str | None  # the scope that answered (None before schema 2)
    logical_call_id: str = ""


class AttemptRow(NamedTuple):
    scope: str
    source: str
    role: str
    latency_ms: float
    ttft_ms: float | None
    error: str
    logical_call_id: str = ""


class SessionRow(NamedTuple):
    session_id: str
    rows_dropped: int
    hedges_suppressed: str


class Reader(Protocol):
    where: str

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...

    def tables(self) -> set[str]: ...

    def snapshot(self) -> AbstractContextManager[None]:
        """The queries inside read one state of the database: a batch a session
        commits meanwhile is in all of them or in none."""
        ...

    def close(self) -> None: ...


class NoData(Exception):
    """The database exists but holds nothing to report (a message for the user)."""


def open_reader(url: str) -> Reader:
    """A read-only reader for ``url``: ``sqlite:///path``, a plain file path, or a
    PostgreSQL URL.  A missing SQLite file is :class:`NoData` (never created)."""
    if url.startswith(("postgresql://", "postgres://")):
        from ._postgres import PostgresReader

        return PostgresReader(url)
    if "://" in url and not url.startswith("sqlite:"):
        raise ConfigError(f"unknown database URL {mask_url(url)!r}: use sqlite:///path or postgresql://…")
    from ._sqlite import SQLiteReader, sqlite_path

    try:
        host = urlsplit(url).netloc if url.startswith("sqlite:") else ""
    except ValueError as exc:  # sqlite://[x: an unclosed IPv6 bracket
        raise ConfigError(f"{mask_url(url)!r} is not a database URL: {exc}") from None
    if host:
        # sqlite://other.db: "other.db" is a host, and the path empty (the default
        # file, read in its place); refused as the settings refuse it.
        raise ConfigError(
            f"{mask_url(url)!r} names a host: a SQLite URL is sqlite:///path/to/file.db "
            "(or give the file's path alone)"
        )
    path = sqlite_path(url) if url.startswith("sqlite:") else Path(url)
    if not path.is_file():
        # (Masked: a libpq "key=value" string given for a file shows no password.)
        raise NoData(f"no telemetry database at {printable(mask_url(str(path)))}")
    return SQLiteReader(path)


def read_rows(
    reader: Reader, *, since: float | None = None, scope: str | None = None
) -> tuple[list[CallRow], list[AttemptRow], list[SessionRow]]:
    """The rows to report on; :class:`NoData` when the tables are not there.  One
    snapshot: the calls, their attempts and the sessions rows agree."""
    with reader.snapshot():
        return _read_rows(reader, since, scope)


def _read_rows(
    reader: Reader, since: float | None, scope: str | None
) -> tuple[list[CallRow], list[AttemptRow], list[SessionRow]]:
    tables = reader.tables()
    if "polygate_schema" not in tables or "calls" not in tables:
        raise NoData(f"{reader.where} is not a polygate telemetry database (no calls table)")
    found = reader.query("SELECT max(version) FROM polygate_schema")[0][0] or 0
    check_version(int(found), reader.where)
    where: list[str] = []
    params: list[Any] = []
    if since is not None:
        where.append("started_at >= ?")
        params.append(since)
    if scope is not None:
        where.append("scope = ?")
        params.append(scope)
    clause = (" WHERE " + " AND ".join(where)) if where else ""
    # (A file of schema 1, read as it is, has no answered_scope: unknown, as migrated.)
    columns = [f if f != "answered_scope" or found >= 2 else "NULL" for f in CallRow._fields]
    calls = [CallRow(*r) for r in reader.query(
        f"SELECT {', '.join(columns)} FROM calls{clause}", tuple(params))]
    # The attempts of those calls, whatever scope each ran in (a fallback's) and
    # whenever it was admitted (after a wait past --since): one report, one set of calls
    # -- with no filter too (the attempts of a call still running, or of one whose
    # row was never written, belong to no call reported).
    selected = f" WHERE logical_call_id IN (SELECT logical_call_id FROM calls{clause})"
    attempts = [AttemptRow(*r) for r in reader.query(
        f"SELECT {', '.join(AttemptRow._fields)} FROM attempts{selected}", tuple(params))]
    session_clause = " WHERE updated_at >= ?" if since is not None else ""
    sessions = [SessionRow(*r) for r in reader.query(
        f"SELECT {', '.join(SessionRow._fields)} FROM sessions{session_clause}",
        (since,) if since is not None else ())]
    for table, rows in (("calls", calls), ("attempts", attempts), ("sessions", sessions)):
        for row in rows:
            _check_row(table, row, reader.where)
    return calls, attempts, sessions


#: Each column's kind: text, optional text, a number, an optional number, or a time.
_KINDS: dict[str, str] = {
    "scope": "text", "kind": "text", "outcome": "text", "role": "text", "error": "text",
    "session_id": "text", "hedges_suppressed": "text", "logical_call_id": "text",
    "source": "text?", "error_class": "text?", "answered_scope": "text?",
    "started_at": "time",
    "ttft_ms": "number?", "stall_ms": "number?", "stall_count": "number?",
    "active_generation_ms": "number?",
}
#: A time ``polygate stats`` can show: 1970 to 9999-12-30 in UTC, so that the report's
#: local time stays within year 9999 in every time zone (up to UTC+14).
_LAST_TIME = 253402214400.0


def _check_row(table: str, row: NamedTuple, where: str) -> None:
    """A row as a session writes it; a ConfigError naming the column otherwise.  The
    file may be another tool's, or edited by hand: a BLOB in a text column, text or an
    infinity in a number's, a time past year 9999 were tracebacks or JSON with NaN."""
    for name, value in zip(row._fields, row, strict=True):
        kind = _KINDS.get(name, "number")
        if value is None and kind.endswith("?"):
            continue
        if kind.startswith("text"):
            good = isinstance(value, str)
        else:
            good = ((type(value) is int and -(2**63) <= value < 2**63)
                    or (type(value) is float and math.isfinite(value))) and (
                        kind != "time" or 0 <= value < _LAST_TIME)
        if not good:
            shown = repr(value) if not isinstance(value, bytes | str) or len(value) <= 40 else (
                f"{type(value).__name__} of {len(value)}")
            raise ConfigError(f"{where} has a {table} row whose {name} is {shown}: not what "
                              "polygate writes there (another tool's file, or edited?)")


# --------------------------------------------------------------------------- arithmetic


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (``values`` sorted ascending); ``None`` when empty."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def tail_share(latencies: Sequence[float], pct: float) -> tuple[int, float]:
    """How many calls the slowest ``pct`` % are, and their share (%) of all the time."""
    ordered = sorted(latencies, reverse=True)
    total = sum(ordered)
    # (rounded first: 7 / 100 * 100 is 7.000000000000001 in floating point, and its
    # ceiling one call too many)
    k = math.ceil(round(pct / 100.0 * len(ordered), 9))
    if ordered and pct > 0:
        k = max(k, 1)  # (a tiny share rounded to 0 above: the slowest call, at least)
    if not ordered or total <= 0:
        return k, 0.0
    return k, 100.0 * sum(ordered[:k]) / total


def _pct(part: float, whole: float) -> float | None:
    return 100.0 * part / whole if whole else None


def _latency(values: Iterable[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {
        "p50_ms": quantile(ordered, 0.5),
        "p90_ms": quantile(ordered, 0.9),
        "p99_ms": quantile(ordered, 0.99),
        "max_ms": ordered[-1] if ordered else None,
    }


def _by_count(counts: Counter[str]) -> dict[str, int]:
    """Most frequent first, ties by name: the same rows give the same report, whatever
    order the database returned them in."""
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def build_report(
    calls: Sequence[CallRow],
    attempts: Sequence[AttemptRow],
    sessions: Sequence[SessionRow],
    *,
    tails: Sequence[float] = (1, 5, 10, 13, 25),
    scope: str | None = None,
) -> dict[str, Any]:
    """Everything ``polygate stats`` prints, as plain data (the ``--json`` output)."""
    if not calls:
        raise NoData("no calls recorded")
    report: dict[str, Any] = {"calls": len(calls), "attempts": len(attempts)}
    report["first_call_at"] = min(c.started_at for c in calls)
    report["last_call_at"] = max(c.started_at for c in calls)
    report["outcomes"] = _by_count(Counter(c.outcome for c in calls))
    report["error_classes"] = _by_count(Counter(c.error_class for c in calls if c.error_class))
    report["latency"] = _latency_table(calls)
    report["tail_share"] = [
        {"slowest_pct": pct, "calls": k, "share_pct": share}
        for pct in tails
        for k, share in [tail_share([c.total_latency_ms for c in calls], pct)]
    ]
    report["waiting_vs_generating"] = _waiting(calls)
    report["hedging"] = _hedging(calls, sessions, scope)
    report["cache"] = _cache(calls)
    report["attempts_per_call"] = _attempts_per_call(calls)
    # (Taken from the calls read, not by a query per attempt: PostgreSQL re-scanned a
    # subquery of every deadline call for each attempt, minutes on a large store.)
    cut = {c.logical_call_id for c in calls if c.error_class == "DeadlineExceeded"}
    report["sources"] = _sources(attempts, cut)
    report["telemetry"] = {
        "sessions": len(sessions),
        "rows_dropped": sum(s.rows_dropped for s in sessions),
    }
    return report


def answered_by(c: CallRow) -> str:
    """What a call's group is called, under its scope, wherever calls are grouped by
    who answered them (the latency table, ``polygate stats --plot``)."""
    if c.cached:  # answered by the cache, not by the source that once answered it
        return "(cache)"
    if c.outcome == "ok" and c.source:
        # A source is its scope's: one of the fallback that answered is named with
        # it ("large/openai"), not taken for the asked scope's source of that name.
        fell_back = c.answered_scope and c.answered_scope != c.scope
        return f"{c.answered_scope}/{c.source}" if fell_back else c.source
    return f"({c.outcome})"


def _latency_table(calls: Sequence[CallRow]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for c in calls:
        source = answered_by(c)
        groups[(c.scope, source)].append(c.total_latency_ms)
        groups[(c.scope, "(all)")].append(c.total_latency_ms)
    rows = []
    for (scope, source), values in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "(all)", kv[0][1])):
        rows.append({"scope": scope, "source": source, "calls": len(values), **_latency(values)})
    return rows


def time_split(calls: Sequence[CallRow]) -> dict[str, float]:
    """Where the time of these calls went, in ms: waiting (``total − generation``:
    admission, retries, backoff, hedge triggers, loser cleanup) and, inside the
    winner's generation, time to first token, stalls, net decoding, and the rest (the
    tail after the last chunk, or a whole non-streamed answer)."""
    total = sum(c.total_latency_ms for c in calls)
    generation = sum(c.generation_ms for c in calls)
    ttft = sum(c.ttft_ms or 0.0 for c in calls)
    stall = sum(c.stall_ms or 0.0 for c in calls)
    active = sum(c.active_generation_ms or 0.0 for c in calls)
    return {
        "total_ms": total,
        "waiting_ms": total - generation,
        "generating_ms": generation,
        "ttft_ms": ttft,
        "stall_ms": stall,
        "active_decode_ms": active,
        "other_generation_ms": max(generation - ttft - stall - active, 0.0),
    }


def split_calls(calls: Sequence[CallRow]) -> list[CallRow]:
    """The calls whose time splits into waiting and generating: chat calls.  An
    embedding call's ``generation_ms`` is the sum of its batches and a multi-page OCR
    call's the sum of its pages (seed 000 §4.5), which run side by side: more than the
    call's own time, so ``total - generation`` would be negative."""
    return [c for c in calls if c.kind == "chat"]


def _waiting(calls: Sequence[CallRow]) -> dict[str, Any]:
    """:func:`time_split` of the successful chat calls, with TTFT and stall figures."""
    chat = split_calls(calls)
    ok = [c for c in chat if c.outcome == "ok"]
    split = time_split(ok)
    total = split["total_ms"]
    ttfts = sorted(c.ttft_ms for c in ok if c.ttft_ms is not None)
    stalled = [c for c in ok if (c.stall_count or 0) > 0]
    failed = [c for c in chat if c.outcome != "ok"]
    failed_ms = sum(c.total_latency_ms for c in failed)
    return {
        "successful_calls": len(ok),
        "other_calls": len(calls) - len(chat),  # embeddings and OCR: not split
        **split,
        "waiting_pct": _pct(split["waiting_ms"], total),
        # The demo's "everything but decoding": waiting plus time to first token, and
        # a failed call's whole time (it decoded nothing its caller got), over all
        # chat calls' time.  Left out, a deadline that cut the hung calls short hid
        # most of the waiting (the demo's deadline column: 59 %, not 20 %).
        "not_decoding_pct": _pct(split["waiting_ms"] + split["ttft_ms"] + failed_ms,
                                 total + failed_ms),
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p90_ms": quantile(ttfts, 0.9),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "calls_with_stalls": len(stalled),
        "calls_with_stalls_pct": _pct(len(stalled), len(ok)),
        "stalls": sum(c.stall_count or 0 for c in ok),
        "stall_p90_ms": quantile(sorted(c.stall_ms or 0.0 for c in stalled), 0.9),
        "failed_calls": len(failed),
        "failed_calls_ms": failed_ms,
    }


def _hedging(calls: Sequence[CallRow], sessions: Sequence[SessionRow], scope: str | None) -> dict[str, Any]:
    # Embedding calls and OCR pages are never hedged: the rate is over the calls that
    # may be (chat).
    calls = [c for c in calls if c.kind == "chat"]
    hedged = [c for c in calls if c.hedges > 0]
    # A win is a hedge that answered: a call that failed after its hedge had taken
    # over (a committed stream that then stalled) won nothing.
    wins = sum(1 for c in hedged if c.hedge_won and c.outcome == "ok")
    suppressed = 0
    for s in sessions:
        try:
            per_scope: Any = json.loads(s.hedges_suppressed)
        except (ValueError, RecursionError):
            continue
        if not isinstance(per_scope, dict):  # (junk of another shape: skipped as junk)
            continue
        for name, count in per_scope.items():
            if (scope is None or name == scope) and type(count) is int and count >= 0:
                suppressed += count
    return {
        "hedged_calls": len(hedged),
        "hedges": sum(c.hedges for c in calls),
        "hedge_rate_pct": _pct(len(hedged), len(calls)),
        "hedge_wins": wins,
        "hedge_win_rate_pct": _pct(wins, len(hedged)),
        "suppressed_by_budget": suppressed,
    }


def _cache(calls: Sequence[CallRow]) -> dict[str, Any]:
    """Calls answered by the response cache (hits and coalesced calls: ``cached = 1``).
    The hit rate is over successful calls, per scope and in all."""
    ok = [c for c in calls if c.outcome == "ok"]
    per_scope: dict[str, list[CallRow]] = defaultdict(list)
    for c in ok:
        per_scope[c.scope].append(c)
    hits = sum(1 for c in ok if c.cached)
    return {
        "cached_calls": hits,
        "hit_rate_pct": _pct(hits, len(ok)),
        "scopes": {
            name: {"calls": len(rows), "cached_calls": sum(1 for c in rows if c.cached),
                   "hit_rate_pct": _pct(sum(1 for c in rows if c.cached), len(rows))}
            for name, rows in sorted(per_scope.items())
        },
    }


def _attempts_per_call(calls: Sequence[CallRow]) -> dict[str, Any]:
    histogram: Counter[str] = Counter(str(c.attempts) if c.attempts < 4 else "4+" for c in calls)
    return {
        "mean": sum(c.attempts for c in calls) / len(calls),
        "histogram": {k: histogram[k] for k in ("0", "1", "2", "3", "4+") if histogram[k]},
    }


def _sources(attempts: Sequence[AttemptRow], deadline_calls: set[str]) -> list[dict[str, Any]]:
    """Each source's attempts; ``deadline_calls``: the ids of the calls that ended in
    DeadlineExceeded (a ``cancelled`` attempt of one was cut by the deadline)."""
    groups: dict[tuple[str, str], list[AttemptRow]] = defaultdict(list)
    for a in attempts:
        groups[(a.scope, a.source)].append(a)
    rows = []
    for (scope, source), rows_ in sorted(groups.items()):
        errors = Counter(a.error for a in rows_)
        done = [a.latency_ms for a in rows_ if a.error == "ok"]
        ttfts = sorted(a.ttft_ms for a in rows_ if a.error == "ok" and a.ttft_ms is not None)
        failures = sum(n for e, n in errors.items() if e not in ("ok", "hedge_cancelled", "cancelled"))
        # Not a failure of the source's own (its error value is the call's), but the
        # incident's hang: a source whose attempts ran until the call's deadline.
        cut = sum(1 for a in rows_ if a.error == "cancelled" and a.logical_call_id in deadline_calls)
        rows.append({
            "scope": scope,
            "source": source,
            "attempts": len(rows_),
            "hedge_attempts": sum(1 for a in rows_ if a.role == "hedge"),
            "ok": errors.get("ok", 0),
            "failure_pct": _pct(failures, len(rows_)),
            "deadline_pct": _pct(cut, len(rows_)),
            "ok_latency": _latency(done),
            "ttft_p50_ms": quantile(ttfts, 0.5),
            "outcomes": _by_count(errors),
        })
    return rows
