"""The telemetry schema, its version, and the migrations both SQL sinks share.

polygate creates and migrates its own tables.  ``polygate_schema`` holds one row per
applied version; :data:`MIGRATIONS` maps each version to the statements that bring
the previous one up to it, written once in a small dialect-neutral form (``{real}``,
``{int}``, ``{bigint}`` become the SQLite or PostgreSQL type).  Migrations are frozen
text: a released version's statements never change, a new column is a new version.

A database whose version is newer than :data:`SCHEMA_VERSION` was written by a newer
polygate: it is refused with :class:`~polygate.ConfigError` rather than written with
rows that lack the newer columns' meaning.

Booleans are stored as integers 0/1 and time stamps as epoch seconds (double) in both
databases, so the same queries (and ``polygate stats``) read either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from .._errors import ConfigError
from ._events import AttemptEvent, CallEvent, SessionEvent

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Dialect",
    "check_version",
    "insert_sql",
    "statements",
    "upsert_session_sql",
]

Dialect = Literal["sqlite", "postgresql"]

_TYPES: Mapping[str, Mapping[str, str]] = {
    "sqlite": {"real": "REAL", "int": "INTEGER", "bigint": "INTEGER", "text": "TEXT"},
    "postgresql": {"real": "DOUBLE PRECISION", "int": "INTEGER", "bigint": "BIGINT", "text": "TEXT"},
}

_V1 = (
    """CREATE TABLE IF NOT EXISTS calls (
        session_id TEXT NOT NULL,
        logical_call_id TEXT NOT NULL,
        scope TEXT NOT NULL,
        kind TEXT NOT NULL,
        stream {int} NOT NULL,
        started_at {real} NOT NULL,
        outcome TEXT NOT NULL,
        error_class TEXT,
        error_message TEXT,
        total_latency_ms {real} NOT NULL,
        generation_ms {real} NOT NULL,
        ttft_ms {real},
        stall_ms {real},
        stall_count {int},
        active_generation_ms {real},
        attempts {int} NOT NULL,
        hedges {int} NOT NULL,
        hedge_won {int} NOT NULL,
        source TEXT,
        cached {int} NOT NULL,
        prompt_tokens {bigint},
        completion_tokens {bigint},
        usage_source TEXT,
        content TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS calls_started_at ON calls (started_at)",
    """CREATE TABLE IF NOT EXISTS attempts (
        call_id TEXT NOT NULL,
        logical_call_id TEXT NOT NULL,
        scope TEXT NOT NULL,
        source TEXT NOT NULL,
        role TEXT NOT NULL,
        started_at {real} NOT NULL,
        latency_ms {real} NOT NULL,
        ttft_ms {real},
        status_code {int},
        streamed {int} NOT NULL,
        error TEXT NOT NULL,
        error_class TEXT,
        error_message TEXT,
        tokens_reserved {bigint} NOT NULL,
        tokens_settled {bigint},
        prompt_tokens {bigint},
        completion_tokens {bigint},
        usage_source TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS attempts_started_at ON attempts (started_at)",
    """CREATE TABLE IF NOT EXISTS sessions (
        session_id TEXT PRIMARY KEY,
        started_at {real} NOT NULL,
        updated_at {real} NOT NULL,
        ended_at {real},
        pid {int} NOT NULL,
        polygate_version TEXT NOT NULL,
        rows_written {bigint} NOT NULL,
        rows_dropped {bigint} NOT NULL,
        hedges_suppressed TEXT NOT NULL
    )""",
)

# CallStats fields added by the second release (§8): a column each, for old rows the
# value they would have had (no re-ask, no resume; the answering scope unknown).
_V2 = (
    "ALTER TABLE calls ADD COLUMN reasks {int} NOT NULL DEFAULT 0",
    "ALTER TABLE calls ADD COLUMN resumes {int} NOT NULL DEFAULT 0",
    "ALTER TABLE calls ADD COLUMN answered_scope TEXT",
)

#: version -> statements that bring version - 1 up to it.
MIGRATIONS: dict[int, Sequence[str]] = {1: _V1, 2: _V2}
SCHEMA_VERSION = max(MIGRATIONS)

VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS polygate_schema "
    "(version {int} NOT NULL, applied_at {real} NOT NULL)"
)


def statements(dialect: Dialect, current: int, target: int | None = None) -> list[tuple[int, list[str]]]:
    """The migrations from ``current`` up to ``target`` (default: the newest), each as
    ``(version, statements)`` rendered for ``dialect``."""
    target = max(MIGRATIONS) if target is None else target
    types = _TYPES[dialect]
    return [
        (version, [s.format(**types) for s in MIGRATIONS[version]])
        for version in sorted(MIGRATIONS)
        if current < version <= target
    ]


def version_table(dialect: Dialect) -> str:
    return VERSION_TABLE.format(**_TYPES[dialect])


def check_version(found: int, where: str) -> None:
    """Refuse a database written by a newer polygate."""
    newest = max(MIGRATIONS)
    if found > newest:
        raise ConfigError(
            f"the telemetry database {where} has schema version {found}, newer than this "
            f"polygate supports ({newest}); upgrade polygate or point telemetry elsewhere"
        )


#: The tables polygate writes, and the columns it writes in each.
_COLUMNS = {"calls": CallEvent._fields, "attempts": AttemptEvent._fields,
            "sessions": SessionEvent._fields}
#: A database without polygate's version table that has one of these already holds
#: another program's (an application's own ``sessions``).
TABLES = tuple(_COLUMNS)


def shape_checks() -> list[tuple[str, str]]:
    """One query per table, selecting every column polygate writes and no row: a table
    of that name that is not polygate's (``CREATE TABLE IF NOT EXISTS`` kept it) fails
    its query, at session start rather than at every write."""
    return [(name, f"SELECT {', '.join(fields)} FROM {name} LIMIT 0") for name, fields in _COLUMNS.items()]


@contextmanager
def read_transaction(execute: Callable[[str], Any], begin: str) -> Iterator[None]:
    """The queries inside read one state of the database (``stats``'s snapshot): a
    batch a session commits meanwhile is in all of them or in none."""
    execute(begin)
    try:
        yield
    finally:
        execute("COMMIT")


def foreign_table(table: str, where: str, problem: BaseException | str) -> ConfigError:
    text = str(problem).strip()
    first = text.splitlines()[0] if text else type(problem).__name__
    return ConfigError(
        f"the telemetry database {where} has a table {table!r} that is not polygate's "
        f"({first}); point telemetry at a database of its own"
    )


def insert_sql(table: Literal["calls", "attempts"], dialect: Dialect) -> str:
    fields = CallEvent._fields if table == "calls" else AttemptEvent._fields
    mark = "?" if dialect == "sqlite" else "%s"
    return f"INSERT INTO {table} ({', '.join(fields)}) VALUES ({', '.join([mark] * len(fields))})"


def upsert_session_sql(dialect: Dialect) -> str:
    fields = SessionEvent._fields
    mark = "?" if dialect == "sqlite" else "%s"
    updates = ", ".join(f"{f} = excluded.{f}" for f in fields if f not in ("session_id", "started_at"))
    return (
        f"INSERT INTO sessions ({', '.join(fields)}) VALUES ({', '.join([mark] * len(fields))}) "
        f"ON CONFLICT (session_id) DO UPDATE SET {updates}"
    )
