"""The PostgreSQL sink against a real server that these tests start themselves
(``tests/_postgres_server.py``): rows, schema versioning, connection errors at session
start, a server lost and found at run time, a stuck write cancelled server-side, and
the password kept out of everything."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import polygate
import polygate._session
from polygate.cli import main as cli_main
from polygate.telemetry import SCHEMA_VERSION, CallEvent, open_telemetry
from polygate.testing import FakeUpstream, Reply, Router

from ._postgres_server import PgServer, postgres_server
from .conftest import FIRST_A, MESSAGES, SECRET, two_source_settings

PG_PASSWORD = "pg-SECRET-pass-7f3a9"


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    with postgres_server(PG_PASSWORD) as server:
        yield server


@pytest.fixture
def pg_url(pg: PgServer, request: pytest.FixtureRequest) -> str:
    """A fresh database per test."""
    import psycopg

    name = "t_" + request.node.name.lower().replace("[", "_").replace("]", "").replace("-", "_")[:50]
    with psycopg.connect(pg.url(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return pg.url(name)


def _query(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description else []


def _dicts(url: str, table: str) -> list[dict[str, Any]]:
    return [r[0] for r in _query(url, f"SELECT row_to_json(t) FROM {table} t ORDER BY started_at")]


def _settings(url: str, **kw: Any) -> polygate.Settings:
    return attrs.evolve(two_source_settings(weights=FIRST_A, hedge=polygate.Hedge(after_s=8)),
                        telemetry=url, **kw)


# --------------------------------------------------------------------------- rows


async def test_rows_in_postgres(autojump_clock: trio.testing.MockClock, pg_url: str) -> None:
    a = FakeUpstream([Reply(first_token_s=20, tokens=4), Reply(status=500), Reply()])
    b = FakeUpstream(Reply(first_token_s=1, inter_token_s=0.5, tokens=4))
    async with polygate.session(_settings(pg_url), transport=Router({"a": a, "b": b})) as s:
        hedged = await s.chat(MESSAGES)
        await s.chat(MESSAGES)
        stats = (await s.statistics()).telemetry
    assert stats.sink == "postgresql"
    calls = _dicts(pg_url, "calls")
    assert len(calls) == 2
    first = next(c for c in calls if c["logical_call_id"] == hedged.call_stats.logical_call_id)
    assert (first["attempts"], first["hedges"], first["hedge_won"], first["source"]) == (2, 1, 1, "b")
    assert first["total_latency_ms"] == pytest.approx(hedged.call_stats.total_latency_ms)
    assert first["ttft_ms"] == pytest.approx(1000)
    attempts = _dicts(pg_url, "attempts")
    assert sorted(a["error"] for a in attempts) == ["hedge_cancelled", "ok", "ok", "transient"]
    assert {a["role"] for a in attempts} == {"primary", "hedge"}
    [session_row] = _dicts(pg_url, "sessions")
    assert session_row["rows_written"] == 6 and session_row["ended_at"] is not None
    assert json.loads(session_row["hedges_suppressed"]) == {}
    assert _query(pg_url, "SELECT version FROM polygate_schema ORDER BY version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)]


async def test_a_nul_in_an_error_body_costs_no_row(
    autojump_clock: trio.testing.MockClock, pg_url: str
) -> None:
    """Review: a 400 whose error body held a NUL made an error_message PostgreSQL
    refuses in text: the whole batch (the other calls' rows, the sessions row) was
    lost, where SQLite kept them.  The NUL is replaced, for every sink alike."""
    bad = Reply(status=400, error_body={"error": {"message": "bad\x00byte"}})
    a = FakeUpstream([Reply(), bad, Reply()])
    async with polygate.session(_settings(pg_url), transport=Router({"a": a, "b": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
        await s.chat(MESSAGES)
        stats = (await s.statistics()).telemetry
    assert stats.dropped == 0 and stats.write_errors == 0, stats
    calls = _dicts(pg_url, "calls")
    assert len(calls) == 3
    [failed] = [c for c in calls if c["outcome"] == "error"]
    assert "bad\ufffdbyte" in failed["error_message"]


async def test_a_url_with_its_host_as_a_parameter_is_taken(
    autojump_clock: trio.testing.MockClock, pg_url: str
) -> None:
    """Review: libpq's forms without a host in the authority (a Unix socket,
    ``postgresql:///db?host=/run/pg``; ``postgresql://u:pw@/db?host=h&port=p``) were
    refused by the settings, whose own message says postgresql://… is accepted."""
    from urllib.parse import urlsplit

    parts = urlsplit(pg_url)
    url = (f"postgresql://{parts.username}:{parts.password}@{parts.path}"
           f"?host={parts.hostname}&port={parts.port}")
    async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream(Reply()),
                                                                   "b": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
        assert (await s.statistics()).telemetry.sink == "postgresql"
    assert len(_dicts(pg_url, "calls")) == 1
    polygate.Settings(scopes=_settings(url).scopes, telemetry="postgresql:///telemetry?host=/var/run/postgresql")


async def test_a_database_with_its_own_sessions_table_is_refused(pg_url: str) -> None:
    """Review: an application's database with its own ``sessions`` table lost every
    row of every session, silently.  A ConfigError at start; its table untouched."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE sessions (id serial PRIMARY KEY, user_name text)")
    with pytest.raises(polygate.ConfigError, match="has a table 'sessions' that is not polygate's"):
        async with polygate.session(_settings(pg_url), transport=Router({"a": FakeUpstream(Reply())})):
            pass
    assert _query(pg_url, "SELECT column_name FROM information_schema.columns WHERE table_name = "
                          "'sessions' ORDER BY ordinal_position") == [("id",), ("user_name",)]


async def test_schema_columns_match_the_events(pg_url: str) -> None:
    async with polygate.session(_settings(pg_url), transport=Router({})):
        pass
    columns = _query(
        pg_url,
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'calls' "
        "ORDER BY ordinal_position",
    )
    assert tuple(c[0] for c in columns) == CallEvent._fields


async def test_newer_schema_refused(pg_url: str) -> None:
    async with polygate.session(_settings(pg_url), transport=Router({})):
        pass
    _query(pg_url, "INSERT INTO polygate_schema VALUES (42, 0) RETURNING version")
    with pytest.raises(polygate.ConfigError, match="schema version 42, newer"):
        async with polygate.session(_settings(pg_url), transport=Router({})):
            pass  # pragma: no cover


async def test_two_sessions_start_on_a_fresh_database_at_once(pg_url: str) -> None:
    async def one() -> None:
        async with polygate.session(_settings(pg_url), transport=Router({})):
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert _query(pg_url, "SELECT count(*) FROM polygate_schema") == [(SCHEMA_VERSION,)]  # once each


# --------------------------------------------------------------------------- bad input


def _dead_url(database: str = "postgres") -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://polygate:{PG_PASSWORD}@127.0.0.1:{port}/{database}"


@pytest.mark.parametrize("problem", ["wrong password", "no database"])
async def test_a_server_that_refuses_us_at_start_is_a_config_error(pg: PgServer, problem: str) -> None:
    if problem == "wrong password":
        url = pg.url(password="wrong-" + PG_PASSWORD)
    else:
        url = pg.url("no_such_database")
    t0 = time.monotonic()
    with pytest.raises(polygate.ConfigError) as info:
        async with polygate.session(_settings(url), transport=Router({})):
            pass  # pragma: no cover
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "telemetry database postgresql://polygate:***@127.0.0.1" in message
    assert PG_PASSWORD not in message and "wrong-" not in message


def _exec(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql)


@pytest.mark.parametrize("said", [
    "the database system is shutting down", "the database system is starting up",
    "the database system is in recovery mode", "sorry, too many clients already",
    "too many connections for role \"app\"",
])
def test_a_server_that_cannot_take_us_now_is_not_a_wrong_setting(said: str) -> None:
    """Review: every FATAL was a ConfigError, so a session could not start during a
    database's rolling restart.  Passing states are a server not answering; a refusal
    among several hosts' failures still is a refusal."""
    from polygate.telemetry._postgres import _refused_by_server

    passing = f'connection failed: connection to server at "127.0.0.1", port 1 failed: FATAL:  {said}'
    assert not _refused_by_server(Exception(passing))
    assert _refused_by_server(Exception(
        passing + '\nconnection to server at "127.0.0.2", port 1 failed: FATAL:  '
        'password authentication failed for user "app"'))
    assert _refused_by_server(Exception('connection is bad: invalid sslmode value: "bogus"'))


async def test_a_role_out_of_connection_slots_stops_no_call(pg: PgServer, pg_url: str) -> None:
    """A real server saying "too many connections for role": the session starts, its
    rows are dropped and counted."""
    import psycopg

    database = pg_url.rsplit("/", 1)[1]
    _exec(pg_url, "DROP ROLE IF EXISTS busy_app")
    _exec(pg_url, "CREATE ROLE busy_app LOGIN PASSWORD 'busy-app-pass-123' CONNECTION LIMIT 1")
    url = f"postgresql://busy_app:busy-app-pass-123@{pg.host}:{pg.port}/{database}"
    with psycopg.connect(url):  # another client holds the only slot
        async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream(Reply())})) as s:
            assert (await s.chat(MESSAGES)).text
            stats = (await s.statistics()).telemetry
    assert stats.written == 0


def test_a_postgresql_password_that_is_no_utf8_once_decoded_is_a_config_error() -> None:
    """The settings' libpq check raised a bare UnicodeDecodeError for a password
    percent-escaped to a byte that is no UTF-8 ('%80'), found by the security fuzz."""
    with pytest.raises(polygate.ConfigError) as info:
        _settings("postgresql://user:00000%80secret@127.0.0.1:5000/db")
    assert "00000" not in str(info.value)


@pytest.mark.parametrize("query", ["sslmod=disable", "sslmode=bogus"])
async def test_a_url_libpq_refuses_is_a_config_error(pg_url: str, query: str) -> None:
    """Review: a misspelt parameter against a live server was "unreachable": a
    warning, and every row of the session dropped.  One libpq cannot read is refused
    by the settings; one whose value it refuses, when the session starts."""
    url = f"{pg_url}?{query}"
    with pytest.raises(polygate.ConfigError) as info:
        async with polygate.session(_settings(url), transport=Router({})):
            pass  # pragma: no cover
    assert PG_PASSWORD not in str(info.value)
    if query.startswith("sslmod="):
        assert "'sslmod'" in str(info.value) and "Settings.telemetry" in str(info.value)


async def test_a_multi_host_url_is_taken(pg: PgServer, pg_url: str) -> None:
    """libpq's multi-host form (a primary and a standby) was refused as a bad port.
    The first host refuses connections; libpq goes on to the second."""
    database = pg_url.rsplit("/", 1)[1]
    dead_port = _dead_url().rsplit(":", 1)[1].split("/")[0]
    url = f"postgresql://{pg.user}:{PG_PASSWORD}@127.0.0.1:{dead_port},{pg.host}:{pg.port}/{database}"
    async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    assert len(_dicts(pg_url, "calls")) == 1
    with pytest.raises(polygate.ConfigError, match="not a valid URL"):
        _settings(url.replace(f":{pg.port}/", ":x/"))


async def test_servers_that_never_answer_stop_no_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Review: libpq gives each host its own connect timeout, so silent hosts ran past
    the opening's bound, which was a ConfigError; a server that does not answer is a
    warning, and the session starts when the bound falls."""
    import socket

    from polygate.telemetry import _open

    monkeypatch.setattr(_open, "OPEN_TIMEOUT_S", 1.0)
    with socket.socket() as one, socket.socket() as two:
        for sock in (one, two):  # they accept (the backlog) and never say a word
            sock.bind(("127.0.0.1", 0))
            sock.listen(8)
        ports = [sock.getsockname()[1] for sock in (one, two)]
        url = f"postgresql://polygate:{PG_PASSWORD}@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/postgres"
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="polygate.telemetry"):
            async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream(Reply())})) as s:
                assert time.monotonic() - t0 < 5
                assert (await s.chat(MESSAGES)).text
    assert "did not answer within" in caplog.text and PG_PASSWORD not in caplog.text


async def test_a_writer_without_ddl_rights_uses_a_provisioned_schema(pg: PgServer, pg_url: str) -> None:
    """Review: the schema check ran CREATE TABLE IF NOT EXISTS, which PostgreSQL
    refuses without the CREATE privilege even when the table is there: an
    application role on a schema its administrator created could not start."""
    async with polygate.session(_settings(pg_url), transport=Router({})):
        pass  # the administrator's session creates the schema
    _exec(pg_url, "DROP ROLE IF EXISTS writer")
    _exec(pg_url, "CREATE ROLE writer LOGIN PASSWORD 'writer-pass-123456'")
    _exec(pg_url, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    _exec(pg_url, "GRANT SELECT, INSERT, UPDATE ON calls, attempts, sessions, polygate_schema TO writer")
    database = pg_url.rsplit("/", 1)[1]
    url = f"postgresql://writer:writer-pass-123456@{pg.host}:{pg.port}/{database}"
    async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    assert len(_dicts(pg_url, "calls")) == 1


async def test_tables_locked_by_maintenance_stop_no_call(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """review: the schema checks at start waited for a table lock for as long as the
    statement timeout (30 s), past the opening's 15-s bound: a VACUUM FULL of the
    calls table kept every session from starting (ConfigError).  A lock held past a
    few seconds is a sink that cannot write now: a warning, and the session starts."""
    import psycopg

    from polygate.telemetry import _postgres

    async with polygate.session(_settings(pg_url), transport=Router({})):
        pass  # the schema exists
    monkeypatch.setattr(_postgres, "MIGRATE_LOCK_TIMEOUT_MS", 300)
    with psycopg.connect(pg_url) as maintenance:
        maintenance.execute("LOCK TABLE calls IN ACCESS EXCLUSIVE MODE")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="polygate.telemetry"):
            async with polygate.session(_settings(pg_url), transport=Router({"a": FakeUpstream(Reply())})) as s:
                assert time.monotonic() - t0 < 5
                assert (await s.chat(MESSAGES)).text
        maintenance.rollback()
    assert "locked" in caplog.text and PG_PASSWORD not in caplog.text
    async with polygate.session(_settings(pg_url), transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)  # the lock gone, rows are written again
    assert len(_dicts(pg_url, "calls")) == 1


async def test_a_server_down_at_start_stops_no_call(
    pg: PgServer, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A dead sink never stops calls (SPEC 6): a server that does not answer when the
    session starts is a warning, not an error; rows are dropped and counted, and once
    the server answers the first connection creates the schema and rows are written."""
    from polygate.telemetry._postgres import PostgresSink

    dead = _dead_url()
    with caplog.at_level(logging.WARNING, logger="polygate.telemetry"):
        sink = PostgresSink.open(dead)
    assert "unreachable" in caplog.text and PG_PASSWORD not in caplog.text
    assert "postgresql://polygate:***@127.0.0.1" in caplog.text
    sink._reconnect_s = 0.05
    async with polygate.session(_settings(dead), transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)  # the session opened, and the call is not held up
        await trio.sleep(0.3)
        down = (await s.statistics()).telemetry
    assert down.written == 0 and down.dropped >= 1
    assert down.last_error is not None and PG_PASSWORD not in down.last_error

    # The same sink once its server answers (here: pointed at a live one), its pause
    # after the failed open over.
    sink._url, sink._next_connect = pg_url, 0.0
    monkeypatched = functools.partial(open_telemetry, sink=sink, linger_s=0)
    original = polygate._session.open_telemetry
    polygate._session.open_telemetry = monkeypatched  # type: ignore[assignment]
    try:
        async with polygate.session(_settings(pg_url), transport=Router({"a": FakeUpstream(Reply())})) as s:
            await s.chat(MESSAGES)
    finally:
        polygate._session.open_telemetry = original  # type: ignore[assignment]
    assert _query(pg_url, "SELECT max(version) FROM polygate_schema") == [(SCHEMA_VERSION,)]
    assert len(_dicts(pg_url, "calls")) == 1


def test_the_cause_of_an_outage_is_said_for_as_long_as_it_lasts() -> None:
    """Review finding (logs under sustained faults): while the server was down, every
    batch between two reconnection tries failed with a placeholder ("telemetry
    database unreachable; waiting before reconnecting"), which became the sink's last
    error: the once-a-minute drop warning and the closing summary no longer said that
    the server refused the connection, rejected the login or could not be found."""
    from polygate.telemetry import Batch
    from polygate.telemetry._postgres import PostgresSink

    sink = PostgresSink.unconnected(_dead_url())
    sink._reconnect_s = 3600.0
    said = []
    for _ in range(2):
        with pytest.raises(ConnectionError) as caught:
            sink.write(Batch([], [], None))
        said.append(str(caught.value))
    sink.close()
    assert "refused" in said[0].lower(), said
    assert "waiting before reconnecting" in said[1] and "refused" in said[1].lower(), said
    assert PG_PASSWORD not in " ".join(said)


def test_the_first_reconnect_waits_from_the_failed_open() -> None:
    """Review finding (sessions opened and closed over and over): a sink whose open
    failed (a port that drops each connection: a crashed server behind a proxy, a
    pooler without a backend) tried again with its first batch, 60 ms later, where the
    docs say a reconnect is tried at most every 5 s; against a server that does not
    answer, a session's close then spent its whole close timeout on a second connect.
    The first batch now waits ``reconnect_s`` from the open's try, as later ones do."""
    import socket
    import threading

    from polygate.telemetry import Batch
    from polygate.telemetry._postgres import PostgresSink

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)  # (a close does not wake a blocked accept)
    tries: list[float] = []
    done = threading.Event()

    def drop_each() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            tries.append(time.monotonic())
            conn.close()

    dropper = threading.Thread(target=drop_each)
    dropper.start()
    url = f"postgresql://polygate:{PG_PASSWORD}@127.0.0.1:{listener.getsockname()[1]}/db"
    try:
        sink = PostgresSink.open(url)
        with pytest.raises(ConnectionError) as caught:
            sink.write(Batch([], [], None))
        # (Said only where no connection is tried: the pause.)
        assert "waiting before reconnecting" in str(caught.value)
        assert "closed" in str(caught.value).lower()  # what the open's try said
        sink._next_connect = 0.0  # (the pause over: the batch tries)
        with pytest.raises(ConnectionError) as caught:
            sink.write(Batch([], [], None))
        assert "waiting" not in str(caught.value) and "closed" in str(caught.value).lower()
        sink.close()
        assert tries  # (the port was reached: its drops are what the sink saw)
    finally:
        done.set()
        dropper.join(5)
        listener.close()


def test_the_pause_after_a_try_at_a_silent_server_counts_from_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review of the fix above: counted from the try's start, the pause was over by
    the time a server that does not answer had let the try fail (``connect_timeout``),
    so the first batch, and each later one, waited out another connect timeout: the
    pause counts from the try's end."""
    import socket

    from polygate.telemetry import Batch
    from polygate.telemetry._postgres import PostgresSink

    monkeypatch.setitem(PostgresSink.__init__.__kwdefaults__, "reconnect_s", 1.0)
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    url = (f"postgresql://polygate:{PG_PASSWORD}@127.0.0.1:{silent.getsockname()[1]}/db"
           "?connect_timeout=2")  # (libpq's least)
    try:
        sink = PostgresSink.open(url)  # ~2 s: the try times out
        with pytest.raises(ConnectionError) as caught:
            sink.write(Batch([], [], None))
        sink.close()
    finally:
        silent.close()
    assert "waiting before reconnecting" in str(caught.value)
    assert "timeout" in str(caught.value).lower()


# --------------------------------------------------------------------------- at run time


def _use_sink(monkeypatch: pytest.MonkeyPatch, url: str, **options: Any) -> Any:
    from polygate.telemetry._postgres import PostgresSink

    sink = PostgresSink.open(url)
    sink._reconnect_s = 0.05
    monkeypatch.setattr(
        polygate._session, "open_telemetry", functools.partial(open_telemetry, sink=sink, **options)
    )
    return sink


def _kill_telemetry_connections(pg: PgServer) -> int:
    rows = _query(
        pg.url(),
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = 'polygate-telemetry'",
    )
    return len(rows)


async def test_server_lost_and_found_at_run_time(
    monkeypatch: pytest.MonkeyPatch, pg: PgServer, pg_url: str
) -> None:
    """A connection the server ended while the session was quiet costs no row: the
    next batch finds it closed and is written again on a new connection (an outside
    review found an idle timeout, a restart or a proxy losing most batches of a quiet
    service: each write found its connection closed, and the 5 s reconnect wait after
    it dropped the next ones too).  Calls never notice."""
    _use_sink(monkeypatch, pg_url, linger_s=0)
    settings = _settings(pg_url)
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
        await trio.sleep(0.3)
        before = (await s.statistics()).telemetry
        assert before.written == 2
        assert _kill_telemetry_connections(pg) == 1
        for _ in range(3):
            await s.chat(MESSAGES)  # calls carry on while the sink is broken
            await trio.sleep(0.3)
        after = (await s.statistics()).telemetry
    assert (after.write_errors, after.dropped, after.written) == (0, 0, 8)
    assert len(_dicts(pg_url, "calls")) + len(_dicts(pg_url, "attempts")) == 8


async def test_a_stuck_write_is_cancelled_server_side(
    monkeypatch: pytest.MonkeyPatch, pg: PgServer, pg_url: str
) -> None:
    """A table lock makes the COPY wait; the pipeline abandons the write after its
    timeout and cancel_safe() ends the query on the server."""
    import psycopg

    sink = _use_sink(monkeypatch, pg_url, linger_s=0, write_timeout_s=0.5)
    settings = _settings(pg_url)
    with psycopg.connect(pg_url) as locker:
        locker.execute("LOCK TABLE calls IN ACCESS EXCLUSIVE MODE")  # held until commit
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
            await s.chat(MESSAGES)
            await trio.sleep(1.5)
            stats = (await s.statistics()).telemetry
            assert stats.write_errors == 1 and "longer than 0.5 s" in (stats.last_error or "")
            waiting = _query(
                pg.url(),
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                "'polygate-telemetry' AND wait_event_type = 'Lock'",
            )
            assert waiting == [(0,)]  # the server cancelled the COPY
            locker.rollback()
            await s.chat(MESSAGES)
            await trio.sleep(0.5)
            assert (await s.statistics()).telemetry.written >= 2
    assert not sink._lock.locked()


def test_a_connection_sent_a_cancel_is_never_written_on_again(
    monkeypatch: pytest.MonkeyPatch, pg_url: str
) -> None:
    """The full suite under load failed the test above: the cancel of an abandoned
    write runs in a thread, and one that ran late reached the server during the next
    write on the same connection, which it cancelled (its rows dropped:
    "InFailedSqlTransaction").  A connection a cancel was sent to is closed before the
    next write, which opens a fresh one: a late cancel ends nothing."""
    import threading

    import psycopg

    from polygate.telemetry._postgres import PostgresSink
    from polygate.telemetry._sink import Batch

    sent = threading.Event()
    monkeypatch.setattr(psycopg.Connection, "cancel_safe", lambda self, timeout=None: sent.set())
    sink = PostgresSink.open(pg_url)
    try:
        first = sink._conn
        assert first is not None
        sink.interrupt()
        assert sent.wait(5)
        sink.write(Batch())
        assert first.closed and sink._conn is not None and sink._conn is not first
        second = sink._conn
        sink.write(Batch())  # no cancel since: the same connection goes on
        assert sink._conn is second
        # Another cancel within the reconnect back-off (5 s): the connection the sink
        # closed on purpose is no unreachable server (review: the batch was dropped).
        sent.clear()
        sink.interrupt()
        assert sent.wait(5)
        sink.write(Batch())
        assert second.closed and sink._conn is not None and sink._conn is not second
    finally:
        sink.close()


async def test_password_is_nowhere(
    autojump_clock: trio.testing.MockClock,
    pg_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = _settings(pg_url, log_content=True)
    leak = Reply(status=500, error_body={"error": {"message": f"echo {SECRET} {PG_PASSWORD}"}})
    router = Router({"a": FakeUpstream(leak), "b": FakeUpstream(leak)})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat([{"role": "user", "content": f"{SECRET} {PG_PASSWORD}"}])
        stats = await s.statistics()
        assert PG_PASSWORD not in repr(s) and PG_PASSWORD not in repr(settings)
    everything = json.dumps([_dicts(pg_url, t) for t in ("calls", "attempts")]) + json.dumps(
        _query(pg_url, "SELECT row_to_json(t) FROM sessions t"))
    assert "***" in everything
    for secret in (SECRET, PG_PASSWORD):
        assert secret not in everything
        assert secret not in caplog.text
        assert secret not in repr(stats)


# --------------------------------------------------------------------------- stats


async def test_polygate_stats_reads_postgres(
    autojump_clock: trio.testing.MockClock, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a = FakeUpstream(Reply(first_token_s=20, tokens=4))
    b = FakeUpstream(Reply(first_token_s=1, tokens=4))
    async with polygate.session(_settings(pg_url), transport=Router({"a": a, "b": b})) as s:
        for _ in range(3):
            await s.chat(MESSAGES)
    code = await trio.to_thread.run_sync(cli_main, ["stats", "--db", pg_url, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["calls"] == 3 and report["hedging"]["hedged_calls"] == 3
    assert PG_PASSWORD not in out + err


def test_ci_flag_turns_a_skip_into_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import _postgres_server

    monkeypatch.setattr(_postgres_server, "_bin_dir", lambda: None)
    monkeypatch.setenv("POLYGATE_CI", "1")
    with pytest.raises(pytest.fail.Exception, match="POLYGATE_CI=1"):
        _postgres_server.require_postgres()
    monkeypatch.delenv("POLYGATE_CI")
    with pytest.raises(pytest.skip.Exception, match="not found"):
        _postgres_server.require_postgres()



def test_stats_reads_one_snapshot(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same on PostgreSQL (its reader's connection is in autocommit mode)."""
    from polygate.telemetry._postgres import PostgresReader, PostgresSink

    from ._stats_snapshot import report_while_a_batch_lands

    sink = PostgresSink.open(pg_url)
    try:
        r = report_while_a_batch_lands(sink, PostgresReader, pg_url, monkeypatch, capsys)
    finally:
        sink.close()
    assert (r["calls"], r["attempts"]) == (5, 5)


async def test_polygate_stats_on_a_locked_table_gives_up(
    autojump_clock: trio.testing.MockClock, pg_url: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """review: with a table locked (VACUUM FULL, CLUSTER, a retention TRUNCATE), the
    stats reader waited for as long as the lock was held, printing nothing."""
    import psycopg

    from polygate.telemetry import _postgres

    async with polygate.session(_settings(pg_url), transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    monkeypatch.setattr(_postgres, "READER_LOCK_TIMEOUT_MS", 300)
    with psycopg.connect(pg_url) as holder:
        holder.execute("LOCK TABLE calls IN ACCESS EXCLUSIVE MODE")
        code = await trio.to_thread.run_sync(cli_main, ["stats", "--db", pg_url])
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    assert "lock timeout" in err and PG_PASSWORD not in out + err, err
    assert err.startswith("polygate stats: cannot read "), err


@pytest.mark.parametrize(("write_timeout_s", "shown"), [(None, "30s"), (5.0, "30s"), (60.0, "1min"),
                                                        (1e12, "2147483647ms")])
async def test_a_longer_write_timeout_raises_the_statement_timeout(
    pg_url: str, write_timeout_s: float | None, shown: str
) -> None:
    """A docs sweep of telemetry.md: ``telemetry_write_timeout_s`` above 30 s did
    nothing on PostgreSQL, whose ``statement_timeout`` was always 30 s (a write allowed
    60 s was cancelled by the server at 30).  Never below 30 s: a migration at open
    runs under it; the pipeline's own bound cuts a shorter write (server-side)."""
    from polygate.telemetry import open_sink
    from polygate.telemetry._postgres import PostgresSink

    options = {} if write_timeout_s is None else {"write_timeout_s": write_timeout_s}
    sink = await open_sink(pg_url, **options)
    try:
        assert isinstance(sink, PostgresSink) and sink._conn is not None
        assert sink._conn.execute("SHOW statement_timeout").fetchone() == (shown,)
    finally:
        sink.close()
    # The setting reaches it (the session's telemetry is opened this way).
    settings = attrs.evolve(two_source_settings(), telemetry=pg_url,
                            telemetry_write_timeout_s=write_timeout_s or 30.0)
    async with open_telemetry(settings) as telemetry:
        assert telemetry.pipeline is not None
        sink = telemetry.pipeline.sink
        assert isinstance(sink, PostgresSink) and sink._conn is not None
        assert sink._conn.execute("SHOW statement_timeout").fetchone() == (shown,)


# --------------------------------------------------------------------------- an operator's database
# (An outside review, 2026-12-05, ran the sink against what operators' databases do.)


async def test_a_quiet_service_behind_an_idle_timeout_loses_no_row(pg_url: str) -> None:
    """The server closes connections idle for 0.3 s (``idle_session_timeout``; a proxy
    or a firewall does the same) and a call comes every 0.6 s: the server is up all
    along, so no row may be lost.  Each batch found its connection closed and was
    dropped, and the 5 s reconnect wait after it dropped the next ones too: 12 of 16."""
    database = pg_url.rsplit("/", 1)[1]
    _query(pg_url, f"ALTER DATABASE \"{database}\" SET idle_session_timeout = '300ms'")
    async with polygate.session(_settings(pg_url), transport=Router({"a": FakeUpstream(Reply())})) as s:
        for _ in range(4):
            await s.chat(MESSAGES)
            await trio.sleep(0.6)  # real time: quiet for longer than the idle timeout
        stats = (await s.statistics()).telemetry
    assert (stats.dropped, stats.write_errors) == (0, 0), stats
    assert len(_dicts(pg_url, "calls")) == 4


def _role(pg: PgServer, pg_url: str, role: str, *grants: str) -> str:
    """A login role of this test's database with only ``grants`` (``{role}`` filled in)."""
    database = pg_url.rsplit("/", 1)[1]
    if _query(pg_url, f"SELECT 1 FROM pg_roles WHERE rolname = '{role}'"):
        _query(pg_url, f"DROP OWNED BY {role}")
        _query(pg_url, f"DROP ROLE {role}")
    _query(pg_url, f"CREATE ROLE {role} LOGIN PASSWORD '{role}-pass-123456'")
    _query(pg_url, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    for grant in grants:
        _query(pg_url, grant.format(role=role))
    return f"postgresql://{role}:{role}-pass-123456@{pg.host}:{pg.port}/{database}"


async def _provision(url: str) -> None:
    async with polygate.session(_settings(url), transport=Router({})):
        pass


_TABLES = "calls, attempts, sessions, polygate_schema"


@pytest.mark.parametrize("change", [
    "GRANT SELECT ON " + _TABLES + " TO {role}",  # may read, not write
    "GRANT SELECT, INSERT ON " + _TABLES + " TO {role}",  # no UPDATE: the sessions upsert fails
    "ALTER TABLE calls ADD COLUMN tenant text NOT NULL",
    "ALTER TABLE calls ALTER COLUMN started_at TYPE timestamptz USING to_timestamp(started_at)",
    "ALTER TABLE sessions DROP CONSTRAINT sessions_pkey",
    "ALTER DATABASE {database} SET default_transaction_read_only = on",
])
async def test_a_database_that_cannot_take_a_row_is_refused_at_start(
    pg: PgServer, pg_url: str, change: str
) -> None:
    """A database that answers but can never take polygate's rows passed the checks at
    start, and every batch was then dropped for the session's life: a wrong setting,
    to say before any call (a trial write, rolled back)."""
    await _provision(pg_url)
    database = pg_url.rsplit("/", 1)[1]
    if "{role}" in change:
        url = _role(pg, pg_url, "limited_app", change)
    else:
        _query(pg_url, change.format(database=f'"{database}"'))
        url = pg_url
    with pytest.raises(polygate.ConfigError, match=r"cannot use .* as a telemetry database") as info:
        async with polygate.session(_settings(url), transport=Router({})):
            pass
    assert PG_PASSWORD not in str(info.value) and "pass-123456" not in str(info.value)
    assert _query(pg_url, "SELECT count(*) FROM calls") == [(0,)]  # the trial row rolled back


async def test_the_documented_privileges_are_enough(pg: PgServer, pg_url: str) -> None:
    await _provision(pg_url)
    url = _role(pg, pg_url, "writer_app", "GRANT SELECT, INSERT, UPDATE ON " + _TABLES + " TO {role}")
    async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    assert len(_dicts(pg_url, "calls")) == 1


async def test_the_tables_are_found_along_the_search_path(pg: PgServer, pg_url: str) -> None:
    """The role's search_path starts with a schema it can read but not create in, and
    polygate's tables are in ``public``, where every unqualified statement finds them:
    the schema was looked for in the first schema only, and creating it there refused."""
    await _provision(pg_url)
    database = pg_url.rsplit("/", 1)[1]
    url = _role(pg, pg_url, "path_app", "GRANT SELECT, INSERT, UPDATE ON " + _TABLES + " TO {role}")
    _query(pg_url, "CREATE SCHEMA app_views")
    _query(pg_url, "GRANT USAGE ON SCHEMA app_views TO path_app")
    _query(pg_url, f'ALTER ROLE path_app IN DATABASE "{database}" SET search_path = app_views, public')
    async with polygate.session(_settings(url), transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    assert len(_dicts(pg_url, "calls")) == 1
    with trio.fail_after(60):
        code = await trio.to_thread.run_sync(cli_main, ["stats", "--db", url, "--json"])
    assert code == 0


@pytest.mark.parametrize("query", ["sslmode=require", "sslmode=verify-full&sslrootcert=/nonexistent/root.crt"])
async def test_tls_the_url_asks_for_and_cannot_have_is_a_config_error(pg_url: str, query: str) -> None:
    """libpq's own TLS refusals (this server has no TLS) were taken for a server that
    does not answer: the session started, and every row was dropped for its life, a
    reconnect tried every 5 s.  No retry mends a setting."""
    with pytest.raises(polygate.ConfigError, match="cannot connect to the telemetry database") as info:
        async with polygate.session(_settings(f"{pg_url}?{query}"), transport=Router({})):
            pass
    assert PG_PASSWORD not in str(info.value)


def test_a_drivers_detail_line_stays_out_of_the_message() -> None:
    """PostgreSQL's DETAIL may quote a whole failing row (a NOT NULL violation's),
    prompts and answers included under ``log_content=True``: it reached ``last_error``
    and the warning log."""
    from polygate.telemetry._postgres import _explain

    error = RuntimeError(
        'null value in column "tenant" violates not-null constraint\n'
        "DETAIL:  Failing row contains (s1, c1, chat, my secret prompt).\n"
    )
    text = _explain("postgresql://u:pw@h/db", error)
    assert "not-null constraint" in text and "secret prompt" not in text


@pytest.mark.parametrize(("said", "kept"), [
    ("value too long for type character varying(12)\n"
     'CONTEXT:  COPY calls, line 1, column content: "{""messages"":[{""content"":""my secret prompt',
     "value too long for type character varying(12)"),
    ("syntax error at or near \"x\"\nLINE 1: INSERT my secret prompt\n        ^\nHINT:  look",
     'syntax error at or near "x"'),
    ('new row violates check constraint "c"\nDETAIL:  Failing row contains (upstream said\n'
     'ERROR: bad request, {"messages":[{"content":"my secret prompt"}]}).',
     'new row violates check constraint "c"'),
    ("new row violates check constraint \"c\"\nDETAIL:  Failing row (my secret prompt,\n"
     "more of my secret prompt)\nQUERY:  my secret prompt\nCONTEXT:  PL/pgSQL my secret prompt",
     'new row violates check constraint "c"'),
    ('connection failed: FATAL:  password authentication failed for user "u"\n\tIs the server running',
     'connection failed: FATAL:  password authentication failed for user "u" Is the server running'),
])
def test_no_field_of_a_server_error_that_quotes_data_reaches_the_message(said: str, kept: str) -> None:
    """Outside review (logs): a CONTEXT line quotes the start of the COPY line that
    failed (a row with its prompt, under ``log_content=True``; a check constraint a DBA
    added, a column narrowed), and reached ``last_error`` and the warning log, as QUERY
    and LINE lines quote the statement.  Only DETAIL lines were dropped."""
    from polygate.telemetry._postgres import _explain

    text = _explain("postgresql://u:pw@h/db", RuntimeError(said))
    assert text == f"RuntimeError: {kept}"


def test_a_server_errors_primary_message_is_all_that_is_said() -> None:
    """Review of the fix: a row's value holding a line break and a word that reads as
    a field ("...\nERROR: bad request") ended the DETAIL early, and the rest of the row
    was kept.  A server's error has fields: its primary message alone is said."""
    from types import SimpleNamespace

    from polygate.telemetry._postgres import _explain

    class CheckViolation(Exception):
        diag = SimpleNamespace(message_primary='new row violates check constraint "c"')

    error = CheckViolation('new row violates check constraint "c"\nDETAIL:  Failing row '
                           'contains (upstream said\nERROR: bad request, my secret prompt).')
    assert _explain("postgresql://u:pw@h/db", error) == (
        'CheckViolation: new row violates check constraint "c"')
