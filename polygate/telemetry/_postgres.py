"""The PostgreSQL sink: psycopg 3, synchronous, in the pipeline's worker thread.

Why psycopg in a thread and not asyncpg through trio-asyncio: measured side by side
(``benchmarks/telemetry_sink.py --postgres-compare``, numbers in
``docs/telemetry.md``), psycopg's ``COPY`` from a worker thread absorbs batches at
least as fast as asyncpg's ``copy_records_to_table``, and it needs neither an asyncio
loop inside trio nor a second event-loop bridge to maintain.  The pipeline already
runs every sink in a thread, so a blocking driver costs nothing on the call path.

* Each batch is one transaction of ``COPY … FROM STDIN`` per table, plus the session
  row's upsert.
* A write the pipeline abandons (too slow, or the session is closing) is cancelled
  server-side: :meth:`PostgresSink.interrupt` runs ``conn.cancel_safe()`` in a
  background thread, so the stuck ``COPY`` fails and releases the connection.
* TCP keepalives and ``tcp_user_timeout`` (unless the URL sets them) turn a dead
  network into an error within about half a minute instead of a hang.
* A failed write drops its batch (counted by the pipeline) and the connection, and
  the next batch reconnects — at most once per ``reconnect_s``; batches in between
  fail at once rather than waiting on a dead server.
* The schema is created or migrated under a transaction-scoped advisory lock, so
  several processes starting at once do not race.
* A server that does not answer when the session starts does not stop it (a dead sink
  never stops calls): the sink starts unconnected, drops and counts its rows, and the
  first connection creates the schema.  A server that answers and refuses us
  (credentials, no such database) is a ``ConfigError`` at start.

The URL (with its password) is handed to libpq and nowhere else: messages show it
through :func:`polygate._config.mask_url` and error texts are redacted of it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from .._config import mask_url
from .._errors import ConfigError, redact
from .._secrets import url_secrets
from .._threads import no_thread
from ._events import AttemptEvent, CallEvent, SessionEvent
from ._schema import (
    TABLES,
    check_version,
    foreign_table,
    read_transaction,
    shape_checks,
    statements,
    upsert_session_sql,
    version_table,
)
from ._sink import Batch

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresReader", "PostgresSink"]

logger = logging.getLogger("polygate.telemetry")

_SESSION = upsert_session_sql("postgresql")
_COPY_CALLS = f"COPY calls ({', '.join(CallEvent._fields)}) FROM STDIN"
_COPY_ATTEMPTS = f"COPY attempts ({', '.join(AttemptEvent._fields)}) FROM STDIN"
_LOCK_KEY = 0x706F6C7967617465  # "polygate": serialises schema creation across processes
_CONNECT_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
    "application_name": "polygate-telemetry",
}


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError(
            "PostgreSQL telemetry needs psycopg 3: pip install 'psycopg[binary]>=3.2.1' "
            "(polygate's postgres extra)"
        ) from None
    return psycopg


def _connect(url: str, *setup: str) -> psycopg.Connection[Any]:
    """Connect in autocommit mode (writes open explicit transactions), with our
    defaults for what the URL leaves unset, then run the ``setup`` statements."""
    driver = _psycopg()
    given = {k for k, _ in parse_qsl(urlsplit(url).query)}
    kwargs = {k: v for k, v in _CONNECT_DEFAULTS.items() if k not in given}
    conn: psycopg.Connection[Any] = driver.connect(url, autocommit=True, **kwargs)
    try:
        for statement in setup:
            conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


#: What a server says while it cannot take a connection *now*: a restart, a
#: recovery, its connection slots full.  It passes, as a server that does not answer
#: does; it is no wrong setting.
_PASSING = (
    "the database system is shutting down",
    "the database system is starting up",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    "too many connections",
    "too many clients already",
    "remaining connection slots are reserved",
)

#: libpq refusing a setting's value before it contacts anyone (``sslmode=bogus``,
#: ``port=x``, ``connect_timeout=x``): the URL is wrong, whatever the server's state.
_BAD_VALUE = re.compile(r"\binvalid (?:\w+ value|integer value|port number)")

#: libpq's own TLS refusals (no ``FATAL:``: the client said no): SSL required of a
#: server without it, a certificate that does not verify or match, a certificate or
#: key file it cannot read.  No retry mends a setting or a certificate.
_TLS_REFUSED = re.compile(
    r"does not support SSL, but SSL was required|root certificate file|certificate verify "
    r"failed|does not match host name|could not (?:load|read|open) (?:\w+ )*"
    r"(?:certificate|private key)|SSL error: (?:tlsv1 alert|sslv3 alert|certificate)"
)


def _refused_by_server(exc: BaseException) -> bool:
    """Whether a failed connect is a wrong setting: a server that said no
    (credentials, no such database, pg_hba: libpq quotes its ``FATAL:`` message), or a
    value libpq refused before connecting.  A server that does not answer (refused,
    timed out, no route, no such host) or says it cannot take a connection now
    (:data:`_PASSING`) is not.  libpq's TLS refusals (:data:`_TLS_REFUSED`) are
    wrong settings too.  With several hosts, libpq quotes each one's failure:
    one that said no is enough.  (psycopg gives no SQLSTATE for errors while
    connecting.)"""
    text = str(exc)
    said = text.split("FATAL:")[1:]
    if any(not any(p in part.split("\n", 1)[0] for p in _PASSING) for part in said):
        return True
    return not said and (_BAD_VALUE.search(text) is not None or _TLS_REFUSED.search(text) is not None)


def _explain(url: str, exc: BaseException) -> str:
    """An error text without the password (libpq does not echo it; belt and braces)."""
    # Every credential the URL carries, in its user part or its query (password=,
    # sslpassword=), raw and decoded: the driver's message may quote any of them.
    # A server's error has fields, and all but its primary message may quote data: a
    # DETAIL the whole failing row (a NOT NULL violation's), a CONTEXT the start of the
    # COPY line that failed, a QUERY or a LINE the statement, prompts and answers
    # included under log_content: never into a message or a log.  Its primary message
    # alone, then.  A connection's error has none (libpq's text): one line (libpq adds
    # hints on lines of their own, "\tIs the server running..."), and nothing from
    # the first field that may quote data on (a row's value may hold a line break and
    # a word that reads as the next field: "...\nERROR: bad request", then more row).
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None)
    if isinstance(primary, str) and primary:
        text = " ".join(primary.split())
    else:
        kept: list[str] = []
        for line in str(exc).splitlines():
            line = line.strip()
            marker = _MARKER.match(line)
            if marker is not None and (marker[1] in _QUOTING or marker[1].startswith("LINE ")):
                break
            if line:
                kept.append(line)
        text = " ".join(kept)
    return redact(f"{type(exc).__name__}: {text}".strip(), url_secrets(url))


#: The start of a line of a server error's fields ("DETAIL:  …", "LINE 1: …"), and
#: those that may quote data.
_MARKER = re.compile(r"([A-Z]+(?: \d+)?):")
_QUOTING = frozenset({"DETAIL", "CONTEXT", "QUERY", "STATEMENT", "WHERE"})


def _migrate(conn: psycopg.Connection[Any], where: str) -> int:
    import psycopg  # (the postgres extra: imported where it is used)

    with conn.transaction():
        # A table locked by maintenance (VACUUM FULL, a retention TRUNCATE) or another
        # process's migration: given up on after this, well inside the opening's bound,
        # and the session starts without the sink connected (see open()).
        conn.execute(f"SET LOCAL lock_timeout = {MIGRATE_LOCK_TIMEOUT_MS}")
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        # Created only when it is missing: PostgreSQL checks the CREATE privilege
        # even for CREATE TABLE IF NOT EXISTS of a table that is there, and an
        # application's role on a schema its administrator provisioned has none.
        # Looked up as every later statement finds it, along the search_path (not only
        # in its first schema, which may be one the role can read but not create in).
        (exists,) = conn.execute(
            "SELECT to_regclass('polygate_schema') IS NOT NULL"
        ).fetchone() or (False,)
        if not exists:
            conn.execute(version_table("postgresql"))
        row = conn.execute("SELECT max(version) FROM polygate_schema").fetchone()
        found = int(row[0] or 0) if row else 0
        check_version(found, where)
        if not found:
            for (table,) in conn.execute(
                "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL",
                (list(TABLES),),
            ).fetchall():
                raise foreign_table(table, where, "it was there before polygate's schema")
        for version, stmts in statements("postgresql", found):
            for statement in stmts:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO polygate_schema VALUES (%s, %s)", (version, time.time())
            )
            found = version
        for table, query in shape_checks():
            try:
                conn.execute(query)
            except psycopg.errors.LockNotAvailable:
                raise  # locked, not foreign
            except psycopg.Error as exc:
                raise foreign_table(table, where, exc) from None
    return found


def _trial_write(conn: psycopg.Connection[Any]) -> None:
    """Write one made-up row of each kind, as a batch is written, and roll it back: a
    database that answers but cannot take a row (a role that may read but not write, a
    read-only database or standby, a column of the wrong type, an extra NOT NULL column,
    ``sessions`` without its key for the upsert) is a wrong setting to say at start,
    not a stream of dropped rows later."""
    call = CallEvent(
        "polygate-trial", "polygate-trial", "trial", "chat", 0, 0.0, "ok", None, None,
        0.0, 0.0, None, None, None, None, 1, 0, 0, "trial", 0, None, None, None, None,
    )
    attempt = AttemptEvent(
        "polygate-trial", "polygate-trial", "trial", "trial", "primary", 0.0, 0.0, None,
        200, 1, "ok", None, None, 0, None, None, None, None,
    )
    session = SessionEvent("polygate-trial", 0.0, 0.0, None, 0, "0", 0, 0, "{}")
    with conn.transaction(force_rollback=True), conn.cursor() as cur:
        cur.execute(f"SET LOCAL lock_timeout = {MIGRATE_LOCK_TIMEOUT_MS}")
        with cur.copy(_COPY_CALLS) as copy:
            copy.write_row(call)
        with cur.copy(_COPY_ATTEMPTS) as copy:
            copy.write_row(attempt)
        cur.execute(_SESSION, session)


class PostgresSink:
    """A :class:`~polygate.telemetry.Sink` writing to one PostgreSQL database."""

    name = "postgresql"

    def __init__(
        self,
        url: str,
        conn: psycopg.Connection[Any] | None,
        *,
        statement_timeout_ms: int = 30_000,
        reconnect_s: float = 5.0,
        migrated: bool = True,
    ) -> None:
        self._url = url
        self._conn = conn
        #: False until a connection has created or migrated the schema (a server that
        #: was down when the session started).
        self._migrated = migrated
        self._lock = threading.Lock()
        self._statement_timeout_ms = statement_timeout_ms
        self._reconnect_s = reconnect_s
        self._next_connect = 0.0
        self._connect_error = "none yet"  # (what the last connection try said)
        self._closed = False
        #: The connection :meth:`interrupt` sent a cancel to: never written on again.
        self._cancelled: psycopg.Connection[Any] | None = None

    def __repr__(self) -> str:
        return f"<PostgresSink {mask_url(self._url)}>"

    @classmethod
    def open(
        cls, url: str, *, statement_timeout_ms: int = 30_000, connected: threading.Event | None = None,
    ) -> PostgresSink:
        """Connect and create or migrate the schema; blocking.  Raises
        :class:`ConfigError` when the server refuses us (credentials, no such
        database, a newer schema).  A server that does not answer at all is not an
        error: a dead sink never stops calls, so the sink opens without a connection,
        its rows are dropped and counted until the server answers, and the first
        connection creates the schema.  ``connected`` is set once the connection is
        made (what is left is the schema's work): until then, whoever waits on this
        may give up and take :meth:`unconnected` instead."""
        psycopg = _psycopg()
        where = mask_url(url)
        try:
            conn = _connect(url, f"SET statement_timeout = {int(statement_timeout_ms)}")
        except psycopg.Error as exc:
            if not isinstance(exc, psycopg.ProgrammingError) and not _refused_by_server(exc):
                said = _explain(url, exc)
                logger.warning(
                    "telemetry database %s is unreachable (%s): calls go on, rows are "
                    "dropped and counted until it answers", where, said,
                )
                return cls.unconnected(
                    url, statement_timeout_ms=statement_timeout_ms, failed=(time.monotonic(), said))
            raise ConfigError(
                f"cannot connect to the telemetry database {where}: {_explain(url, exc)}"
            ) from None
        if connected is not None:
            connected.set()
        try:
            _migrate(conn, where)
            _trial_write(conn)
        except ConfigError:
            conn.close()
            raise
        except psycopg.errors.LockNotAvailable:
            conn.close()
            logger.warning(
                "telemetry database %s has its tables locked (maintenance?): calls go "
                "on, rows are dropped and counted until they can be written", where,
            )
            return cls.unconnected(url, statement_timeout_ms=statement_timeout_ms)
        except psycopg.Error as exc:
            conn.close()
            raise ConfigError(
                f"cannot use {where} as a telemetry database: {_explain(url, exc)}"
            ) from None
        return cls(url, conn, statement_timeout_ms=statement_timeout_ms)

    @classmethod
    def unconnected(
        cls, url: str, *, statement_timeout_ms: int = 30_000, failed: tuple[float, str] | None = None,
    ) -> PostgresSink:
        """A sink for a server that did not answer: it connects, and creates the
        schema, with its first batch.  ``failed``: when (``time.monotonic()``) a try
        at the open ended without a connection, and what it said; the next waits
        ``reconnect_s`` from then, as every later one does (the first batch tried again
        at once: against a server that does not answer, a session's close waited
        another connect timeout)."""
        sink = cls(url, None, statement_timeout_ms=statement_timeout_ms, migrated=False)
        if failed is not None:
            sink._next_connect = failed[0] + sink._reconnect_s
            sink._connect_error = failed[1]
        return sink

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self._closed:
            raise RuntimeError("the telemetry sink is closed")
        now = time.monotonic()
        if now < self._next_connect:
            # What the last try said stays said: this becomes the sink's last error,
            # which the drop warnings and the closing summary quote.
            raise ConnectionError(
                "telemetry database unreachable; waiting before reconnecting "
                f"(the last try: {self._connect_error})")
        # The wait is for a server that did not take a connection: one that closed a
        # connection it had taken (an idle timeout, a restart, a proxy) is tried again
        # at once, or a quiet service behind an idle timeout would lose most batches.
        try:
            conn = _connect(self._url, f"SET statement_timeout = {int(self._statement_timeout_ms)}")
        except Exception as exc:
            # From the try's end: a server that does not answer takes connect_timeout
            # to fail, and counted from the start, the pause was over by then.
            self._next_connect = time.monotonic() + self._reconnect_s
            self._connect_error = _explain(self._url, exc)
            raise ConnectionError(self._connect_error) from None
        if not self._migrated:
            try:
                _migrate(conn, mask_url(self._url))
            except Exception as exc:  # a newer schema, too: this batch is dropped
                conn.close()
                self._next_connect = time.monotonic() + self._reconnect_s
                self._connect_error = _explain(self._url, exc)
                raise ConnectionError(self._connect_error) from None
            self._migrated = True
        self._conn = conn
        return conn

    def write(self, batch: Batch) -> None:
        with self._lock:
            if self._cancelled is not None:
                # A cancel sent for an earlier write (see interrupt) may still be on
                # its way: on this connection it would end this write's query.
                if self._cancelled is self._conn:
                    self._discard()
                    self._next_connect = 0.0  # (closed on purpose: no server to wait for)
                self._cancelled = None
            for retry in (False, True):
                conn = self._connection()
                committing = False
                try:
                    with conn.transaction(), conn.cursor() as cur:
                        if batch.calls:
                            with cur.copy(_COPY_CALLS) as copy:
                                for row in batch.calls:
                                    copy.write_row(row)
                        if batch.attempts:
                            with cur.copy(_COPY_ATTEMPTS) as copy:
                                for attempt in batch.attempts:
                                    copy.write_row(attempt)
                        if batch.session is not None:
                            cur.execute(_SESSION, batch.session)
                        committing = True
                    return
                except Exception as exc:
                    lost = conn.broken or conn.closed
                    if lost:
                        self._discard()
                    # A connection the server had closed while we were quiet (an idle
                    # timeout, a restart, a proxy) is found closed by the next write:
                    # that batch goes again, once, on a new connection.  Not when the
                    # COMMIT was on its way (it may have been written: never twice),
                    # nor for a connection a cancel was sent to.
                    if retry or not lost or committing or self._cancelled is conn:
                        raise ConnectionError(_explain(self._url, exc)) from None

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def interrupt(self) -> None:
        """Cancel the running query server-side, in the background (never blocks)."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        self._cancelled = conn  # (the next write takes a fresh connection)

        def cancel() -> None:
            try:
                conn.cancel_safe(timeout=5.0)
            except Exception:
                pass

        try:
            threading.Thread(target=cancel, name="polygate-telemetry-cancel", daemon=True).start()
        except RuntimeError as exc:  # (the process's thread limit: its statement_timeout ends it)
            if not no_thread(exc):
                raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._discard()


#: How long opening the sink waits for a lock on its tables (a migration, a shape check).
MIGRATE_LOCK_TIMEOUT_MS = 5_000

#: How long ``polygate stats`` waits for a lock on a table (VACUUM FULL, CLUSTER, a
#: retention TRUNCATE hold one), and for any one statement: bounded, never a hang.
READER_LOCK_TIMEOUT_MS = 10_000
READER_STATEMENT_TIMEOUT_MS = 600_000


class PostgresReader:
    """Read-only access for ``polygate stats``."""

    paramstyle = "%s"

    def __init__(self, url: str) -> None:
        psycopg = _psycopg()
        self.where = mask_url(url)
        try:
            self._conn = _connect(
                url, "SET default_transaction_read_only = on",
                f"SET lock_timeout = {int(READER_LOCK_TIMEOUT_MS)}",
                f"SET statement_timeout = {int(READER_STATEMENT_TIMEOUT_MS)}",
            )
        except psycopg.Error as exc:
            raise ConfigError(f"cannot connect to {self.where}: {_explain(url, exc)}") from None

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._conn.execute(sql.replace("?", "%s"), params).fetchall()
        return rows

    def tables(self) -> set[str]:
        # The tables the queries will find: along the search_path, as the sink's are.
        rows = self.query(
            "SELECT c.relname FROM pg_catalog.pg_class c "
            "WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND pg_catalog.pg_table_is_visible(c.oid)"
        )
        return {r[0] for r in rows}

    def snapshot(self) -> AbstractContextManager[None]:
        # (The connection is in autocommit mode: each query would see its own state.)
        return read_transaction(self._conn.execute, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")

    def close(self) -> None:
        self._conn.close()
