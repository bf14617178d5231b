"""Telemetry through real sessions into a real SQLite file: what the rows say about
calls and attempts (exact under MockClock), the schema and its versioning, bad URLs,
and secrets."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import polygate
from polygate.telemetry import AttemptEvent, CallEvent, SessionEvent, _schema, open_sink
from polygate.telemetry._sqlite import SQLiteSink, default_path, sqlite_path, state_dir
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, SECRET, two_source_settings


def _url(path: Path) -> str:
    return f"sqlite://{path}"


def _rows(db: Path, table: str) -> list[dict[str, Any]]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(f"SELECT * FROM {table} ORDER BY rowid")]
    finally:
        conn.close()


def _with_telemetry(settings: polygate.Settings, db: Path, **kw: Any) -> polygate.Settings:
    return attrs.evolve(settings, telemetry=_url(db), **kw)


# --------------------------------------------------------------------------- rows


async def test_a_call_and_its_attempt_become_rows(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    up = FakeUpstream(Reply(first_token_s=1.5, inter_token_s=0.1, tokens=10, stall_at=5, stall_s=3.0))
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES)
        stats = await s.statistics()
    assert stats.telemetry.sink == "sqlite" and stats.telemetry.dropped == 0
    [call] = _rows(db, "calls")
    [attempt] = _rows(db, "attempts")
    st = r.call_stats
    assert call["logical_call_id"] == st.logical_call_id
    assert (call["scope"], call["kind"], call["stream"], call["outcome"]) == ("chat", "chat", 0, "ok")
    assert call["error_class"] is None and call["content"] is None
    for field in ("total_latency_ms", "generation_ms", "ttft_ms", "stall_ms", "active_generation_ms"):
        assert call[field] == pytest.approx(getattr(st, field)), field
    assert call["ttft_ms"] == pytest.approx(1500)
    assert call["stall_ms"] == pytest.approx(3100) and call["stall_count"] == 1
    assert (call["attempts"], call["hedges"], call["hedge_won"], call["source"]) == (1, 0, 0, "a")
    assert r.usage is not None
    assert (call["prompt_tokens"], call["completion_tokens"], call["usage_source"]) == (
        r.usage.prompt_tokens, 10, "upstream")
    assert attempt["call_id"] == f"{st.logical_call_id}.1"
    assert attempt["logical_call_id"] == st.logical_call_id
    assert (attempt["source"], attempt["role"], attempt["error"], attempt["status_code"]) == (
        "a", "primary", "ok", 200)
    assert attempt["latency_ms"] == pytest.approx(st.generation_ms)
    assert attempt["ttft_ms"] == pytest.approx(1500)
    assert attempt["streamed"] == 1
    assert attempt["tokens_reserved"] > 0 and attempt["tokens_settled"] == r.usage.total_tokens
    [session_row] = _rows(db, "sessions")
    assert session_row["session_id"] == call["session_id"]
    assert session_row["ended_at"] is not None
    assert session_row["rows_written"] == 2 and session_row["rows_dropped"] == 0


async def test_wall_clock_time_stamps(tmp_path: Path) -> None:
    import time

    db = tmp_path / "t.db"
    before = time.time()
    async with polygate.session(
        _with_telemetry(two_source_settings(names=("a",)), db),
        transport=Router({"a": FakeUpstream(Reply())}),
    ) as s:
        await s.chat(MESSAGES)
    after = time.time()
    [call] = _rows(db, "calls")
    [attempt] = _rows(db, "attempts")
    assert before <= call["started_at"] <= attempt["started_at"] <= after


async def test_hedge_loser_and_winner_rows(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    a = FakeUpstream(Reply(first_token_s=20, tokens=4))
    b = FakeUpstream(Reply(first_token_s=1, inter_token_s=0.5, tokens=4))
    settings = _with_telemetry(
        two_source_settings(hedge=polygate.Hedge(after_s=8), weights=FIRST_A), db
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert r.call_stats.hedge_won
    [call] = _rows(db, "calls")
    assert (call["attempts"], call["hedges"], call["hedge_won"], call["source"]) == (2, 1, 1, "b")
    attempts = {row["role"]: row for row in _rows(db, "attempts")}
    assert attempts["primary"]["source"] == "a"
    assert attempts["primary"]["error"] == "hedge_cancelled"
    assert attempts["primary"]["error_class"] is None
    assert attempts["primary"]["latency_ms"] == pytest.approx(10_500)  # sent at 0, cancelled at 10.5
    assert attempts["hedge"]["source"] == "b" and attempts["hedge"]["error"] == "ok"
    assert attempts["hedge"]["latency_ms"] == pytest.approx(2500)


async def test_failed_call_rows(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    settings = _with_telemetry(
        two_source_settings(retry=polygate.Retry(max_attempts=2, backoff_base_s=0)), db
    )
    router = Router({"a": FakeUpstream(Reply(status=503)), "b": FakeUpstream(Reply(status=502))})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
    [call] = _rows(db, "calls")
    assert (call["outcome"], call["error_class"], call["attempts"]) == ("error", "AllSourcesExhausted", 2)
    assert call["source"] is None and call["prompt_tokens"] is None
    attempts = _rows(db, "attempts")
    assert sorted(a["status_code"] for a in attempts) == [502, 503]
    assert {a["error"] for a in attempts} == {"transient"}
    assert {a["error_class"] for a in attempts} == {"TransientUpstreamError"}


async def test_deadline_and_fatal_rows(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",), call_deadline_s=5), db)
    router = Router({"a": FakeUpstream([Reply(first_token_s=60), Reply(status=400)])})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES)
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
    deadline, fatal = _rows(db, "calls")
    assert (deadline["outcome"], deadline["error_class"]) == ("error", "DeadlineExceeded")
    assert deadline["total_latency_ms"] == pytest.approx(5000)
    assert (fatal["outcome"], fatal["error_class"]) == ("error", "FatalUpstreamError")
    assert [a["error"] for a in _rows(db, "attempts")] == ["cancelled", "fatal"]


async def test_a_call_that_fell_back_is_its_asked_scopes_row(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """``calls.scope`` is the scope called (docs/telemetry.md), so ``polygate stats
    --scope`` finds a call that moved to its fallback; each attempt row keeps the
    scope it ran in, and ``CallStats.scope`` says which scope answered."""
    db = tmp_path / "t.db"
    settings = polygate.Settings(
        scopes={
            "fb": polygate.Scope(sources=[polygate.Source(name="f1", base_url="http://f1/v1")],
                                 fallback="chat", retry=polygate.Retry(max_attempts=1)),
            "chat": polygate.Scope(sources=[polygate.Source(name="c1", base_url="http://c1/v1")]),
        },
        telemetry=_url(db),
    )
    ups = {"f1": FakeUpstream(Reply(status=503)), "c1": FakeUpstream(Reply())}
    async with polygate.session(settings, transport=Router(ups)) as s:
        response = await s.chat(MESSAGES, scope="fb")
    assert response.call_stats.scope == "chat"
    [call] = _rows(db, "calls")
    assert (call["scope"], call["source"], call["answered_scope"]) == ("fb", "c1", "chat")
    assert [(a["scope"], a["source"]) for a in _rows(db, "attempts")] == [("fb", "f1"), ("chat", "c1")]


async def test_a_failed_call_row_has_no_answered_scope(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """answered_scope is NULL when no scope answered (a probe found the last scope tried)."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",), retry=polygate.Retry(max_attempts=1)), db)
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(status=500))})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
    [call] = _rows(db, "calls")
    assert (call["outcome"], call["answered_scope"]) == ("error", None)


async def test_a_reasked_call_row_counts_its_reasks(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """CallStats.reasks is in the call's row (schema 2), so re-asks can be queried."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    up = FakeUpstream([Reply(text="not JSON"), Reply(text='{"n": 1}')])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        response = await s.chat(MESSAGES, schema=schema)
    assert response.parsed == {"n": 1} and response.call_stats.reasks == 1
    [call] = _rows(db, "calls")
    assert (call["reasks"], call["resumes"], call["attempts"]) == (1, 0, response.call_stats.attempts)


async def test_caller_cancellation_is_a_row(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(first_token_s=60))})) as s:
        with trio.move_on_after(3):
            await s.chat(MESSAGES)
    [call] = _rows(db, "calls")
    assert (call["outcome"], call["error_class"]) == ("cancelled", "Cancelled")
    assert call["total_latency_ms"] == pytest.approx(3000)
    [attempt] = _rows(db, "attempts")
    assert attempt["error"] == "cancelled"


async def test_stream_and_embed_rows(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    chat = polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])
    embed = polygate.Scope(sources=[polygate.Source(name="e", base_url="http://e/v1")])
    settings = polygate.Settings(scopes={"chat": chat, "embed": embed}, telemetry=_url(db))
    router = Router({"a": FakeUpstream(Reply(tokens=3)), "e": FakeUpstream(Reply(embedding_dim=4))})
    async with polygate.session(settings, transport=router) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
        await s.embed(["x", "y"])
    streamed, embedded = _rows(db, "calls")
    assert (streamed["kind"], streamed["stream"], streamed["scope"]) == ("chat", 1, "chat")
    assert (embedded["kind"], embedded["stream"], embedded["scope"]) == ("embed", 0, "embed")
    assert embedded["source"] == "e" and embedded["outcome"] == "ok"


async def test_content_only_when_asked(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    for log_content in (False, True):
        db = tmp_path / f"{log_content}.db"
        settings = _with_telemetry(two_source_settings(names=("a",)), db, log_content=log_content)
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
            r = await s.chat(MESSAGES)
        [call] = _rows(db, "calls")
        if log_content:
            assert json.loads(call["content"]) == {"messages": MESSAGES, "output": r.message}
        else:
            assert call["content"] is None


@pytest.mark.parametrize("quote", [
    "Invalid content in messages[0]: '{prompt}'",  # quoted whole
    'Bad input "{cut}..."',  # quoted, cut short by the upstream
    "{prompt} is not allowed",  # the whole message, unquoted
])
async def test_an_error_that_quotes_the_prompt_stores_no_prompt(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, quote: str
) -> None:
    """Outside review (2026-12-02): upstreams quote the offending input in a 400's
    message; with ``log_content=False`` that text reached ``error_message`` of the call
    and attempt rows, storing the prompt where no content is to be stored."""
    prompt = "please ZQXMARKER4242 answer in French"
    body = {"error": {"message": quote.format(prompt=prompt, cut=prompt[:20])}}
    messages = [{"role": "user", "content": prompt}]
    for log_content in (False, True):
        db = tmp_path / f"{log_content}.db"
        settings = _with_telemetry(two_source_settings(names=("a",)), db, log_content=log_content)
        up = FakeUpstream(Reply(status=400, error_body=body))
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            with pytest.raises(polygate.FatalUpstreamError):
                await s.chat(messages)
        [call] = _rows(db, "calls")
        [attempt] = _rows(db, "attempts")
        for row in (call, attempt):
            assert "HTTP 400" in row["error_message"]
            assert ("ZQXMARKER4242" in row["error_message"]) is log_content
        if not log_content:
            assert b"ZQXMARKER4242" not in db.read_bytes()


@pytest.mark.parametrize("kind", ["embed", "embed-cached", "ocr-prompt", "ocr-url"])
async def test_an_error_that_quotes_an_input_that_is_not_a_message_stores_no_input(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, kind: str
) -> None:
    """Outside review (2026-12-03): the quoted-prompt rule looked at chat messages only,
    so with ``log_content=False`` an embedding input an upstream's 400 quoted (and an
    OCR call's own prompt, or its document's signed URL) was stored in both rows.  And
    with ``log_content=True`` too (review, 2026-12-05): it stores a *chat* call's
    content only, so these inputs are scrubbed either way."""
    from .test_ocr import image_bytes, ocr_settings

    secret = "https://files.example/scan.png?sig=ZQXMARKER4242" if kind == "ocr-url" \
        else "patient ZQXMARKER4242 diagnosis notes"
    body = {"error": {"message": f"Invalid input[0]: '{secret}' is not allowed"}}
    for log_content in (False, True):
        db = tmp_path / f"{log_content}.db"
        up = FakeUpstream(Reply(status=400, error_body=body))
        if kind.startswith("embed"):
            settings = polygate.Settings(scopes={"embed": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
                cache_ttl_s=60 if kind == "embed-cached" else None,
            )}, cache="memory" if kind == "embed-cached" else "off")
        else:
            settings = ocr_settings()
        settings = _with_telemetry(settings, db, log_content=log_content)
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            with pytest.raises(polygate.FatalUpstreamError):
                if kind.startswith("embed"):
                    await s.embed([secret, "another input"])
                elif kind == "ocr-prompt":
                    await s.ocr(image_bytes("PNG", (64, 64)), prompt=secret)
                else:
                    await s.ocr(secret)
        rows = _rows(db, "calls") + _rows(db, "attempts")
        assert len(rows) >= 2
        for row in rows:
            assert "HTTP 400" in row["error_message"]
            assert "[prompt text]" in row["error_message"], row
        assert b"ZQXMARKER4242" not in db.read_bytes()


MULTILINE_PROMPT = "Summarise my notes ZQXMARKER4242 below.\nLine two of the private notes. é"


@pytest.mark.parametrize(("status", "body"), [
    # FastAPI / pydantic's 422 (in front of vLLM and other Python servers): the value
    # comes back as "input", and the body, not OpenAI's shape, is stored as its JSON
    (422, {"detail": [{"type": "string_too_long", "loc": ["body", "messages", 0, "content"],
                       "msg": "String should have at most 16 characters", "input": MULTILINE_PROMPT}]}),
    # OpenAI's shape, quoting a multi-line prompt cut short
    (400, {"error": {"message": "Invalid content in messages[0]: '" + MULTILINE_PROMPT[:60] + "...'"}}),
], ids=["pydantic-422", "quoted-multiline-cut"])
async def test_an_error_that_quotes_a_multiline_prompt_stores_no_prompt(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, status: int, body: Any,
) -> None:
    """review: a prompt quoted in JSON (its line break written as a backslash and an n)
    or quoted over two lines was stored, with ``log_content=False``."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db, log_content=False)
    up = FakeUpstream(Reply(status=status, error_body=body))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat([{"role": "user", "content": MULTILINE_PROMPT}])
    for table in ("calls", "attempts"):
        [row] = _rows(db, table)
        assert row["error_message"] and "[prompt text]" in row["error_message"]
    assert b"ZQXMARKER4242" not in db.read_bytes()


async def test_a_reasked_call_row_holds_the_request_and_the_final_answer(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Review: with log_content, a re-asked call's row held the last round's
    conversation (the invalid answer and polygate's re-ask prompt), where the docs say
    the request's messages."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db, log_content=True)
    up = FakeUpstream([Reply(text="not JSON"), Reply(text='{"n": 1}')])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=schema)
    assert r.call_stats.reasks == 1
    [call] = _rows(db, "calls")
    assert json.loads(call["content"]) == {"messages": MESSAGES, "output": r.message}


async def test_an_attempt_row_leaves_out_the_time_its_consumer_held_the_stream(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """Review: a stream_chat() consumer that took 1 s per chunk made its attempt's
    latency_ms 168 s for an upstream that answered in 1.33 s: ``polygate stats``'
    per-source latency blamed the upstream for the caller's pace (generation_ms and
    the source's health already left it out)."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    # (more chunks than the stream buffers: the consumer's pace holds the upstream)
    up = FakeUpstream(Reply(first_token_s=1.0, inter_token_s=0.01, tokens=200))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                await trio.sleep(1.0)
    [call] = _rows(db, "calls")
    [attempt] = _rows(db, "attempts")
    assert call["generation_ms"] == pytest.approx(1330)  # (the statistics leave the holds out)
    assert attempt["latency_ms"] == pytest.approx(call["generation_ms"])


async def test_secrets_never_reach_rows_logs_or_statistics(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The upstream echoes the API key in its error body and the prompt contains it;
    with log_content on, nothing polygate stores, logs or reports shows it."""
    caplog.set_level(logging.DEBUG)
    db = tmp_path / "t.db"
    settings = _with_telemetry(
        two_source_settings(retry=polygate.Retry(max_attempts=2, backoff_base_s=0)), db,
        log_content=True,
    )
    leak = Reply(status=500, error_body={"error": {"message": f"bad key {SECRET} here"}})
    router = Router({"a": FakeUpstream(leak), "b": FakeUpstream(leak)})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat([{"role": "user", "content": f"my key is {SECRET}"}])
        stats = await s.statistics()
    conn = sqlite3.connect(db)
    try:
        text = "\n".join(conn.iterdump())
    finally:
        conn.close()
    assert "bad key *** here" in text  # the message is kept, redacted
    assert SECRET not in text
    assert SECRET not in caplog.text
    assert SECRET not in repr(stats)


# --------------------------------------------------------------------------- schema


def test_schema_columns_are_the_event_fields(tmp_path: Path) -> None:
    sink = SQLiteSink.open(tmp_path / "t.db")
    sink.close()
    conn = sqlite3.connect(tmp_path / "t.db")
    for table, event in (("calls", CallEvent), ("attempts", AttemptEvent), ("sessions", SessionEvent)):
        columns = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        assert tuple(columns) == event._fields, table
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # one row per version applied, the newest last
    assert conn.execute("SELECT version FROM polygate_schema ORDER BY version").fetchall() == [
        (v,) for v in range(1, _schema.SCHEMA_VERSION + 1)]
    conn.close()


def test_reopening_keeps_rows_and_version(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    SQLiteSink.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO sessions VALUES ('s', 1, 1, NULL, 1, 'x', 0, 0, '{}')")
    conn.commit()
    conn.close()
    SQLiteSink.open(path).close()
    assert [r["session_id"] for r in _rows(path, "sessions")] == ["s"]
    assert len(_rows(path, "polygate_schema")) == _schema.SCHEMA_VERSION  # nothing applied twice


def test_migration_to_a_new_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.db"
    SQLiteSink.open(path).close()
    migrations = dict(_schema.MIGRATIONS)
    newest = _schema.SCHEMA_VERSION
    migrations[newest + 1] = ("ALTER TABLE calls ADD COLUMN tenant TEXT",)
    monkeypatch.setattr(_schema, "MIGRATIONS", migrations)
    SQLiteSink.open(path).close()
    conn = sqlite3.connect(path)
    assert "tenant" in [r[1] for r in conn.execute("PRAGMA table_info(calls)")]
    assert [r[0] for r in conn.execute("SELECT version FROM polygate_schema ORDER BY version")] == [
        *range(1, newest + 2)]
    conn.close()


async def test_a_version_1_database_is_migrated_and_keeps_its_rows(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A file written by the first release (schema 1) gains the columns of version 2
    (re-asks, resumes, the answering scope): its old rows read as 'none of those', new
    rows carry them."""
    path = _version_1_file(tmp_path)
    up = FakeUpstream(Reply())
    settings = _with_telemetry(two_source_settings(names=("a",)), path)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.chat(MESSAGES)
    first, second = _rows(path, "calls")
    assert (first["logical_call_id"], first["reasks"], first["resumes"], first["answered_scope"]) == (
        "old", 0, 0, None)
    assert (second["reasks"], second["resumes"], second["answered_scope"]) == (0, 0, "chat")
    versions = [r["version"] for r in _rows(path, "polygate_schema")]
    assert versions == [1, 2] == list(range(1, _schema.SCHEMA_VERSION + 1))


def _version_1_file(folder: Path) -> Path:
    """A telemetry file as the first release wrote it (schema 1), with one call row."""
    path = folder / "t.db"
    conn = sqlite3.connect(path)
    conn.execute(_schema.version_table("sqlite"))
    for version, stmts in _schema.statements("sqlite", 0, 1):
        for statement in stmts:
            conn.execute(statement)
        conn.execute("INSERT INTO polygate_schema VALUES (?, 0)", (version,))
    old = CallEvent(*_event_fields_v1())
    conn.execute(f"INSERT INTO calls VALUES ({', '.join('?' * 24)})", old[:24])
    conn.commit()
    conn.close()
    return path


def _event_fields_v1() -> tuple[Any, ...]:
    return ("s", "old", "chat", "chat", 0, 1.0, "ok", None, None, 1.0, 1.0, None, None, None,
            None, 1, 0, 0, "a", 0, None, None, None, None)


async def test_newer_schema_is_refused_at_session_start(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    SQLiteSink.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO polygate_schema VALUES (99, 0)")
    conn.commit()
    conn.close()
    settings = _with_telemetry(two_source_settings(names=("a",)), path)
    with pytest.raises(polygate.ConfigError, match=r"schema version 99, newer than this polygate supports \(2\)"):
        async with polygate.session(settings, transport=Router({})):
            pass  # pragma: no cover


@pytest.mark.parametrize("kind", ["directory", "not a database", "unwritable folder"])
async def test_unusable_sqlite_file_is_a_config_error(tmp_path: Path, kind: str) -> None:
    if kind == "directory":
        path = tmp_path / "dir.db"
        path.mkdir()
    elif kind == "not a database":
        path = tmp_path / "junk.db"
        path.write_bytes(b"this is not a database file at all" * 100)
    else:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        path = blocker / "sub" / "t.db"  # a folder cannot be made under a file
    settings = _with_telemetry(two_source_settings(names=("a",)), path)
    with pytest.raises(polygate.ConfigError, match="telemetry database"):
        async with polygate.session(settings, transport=Router({})):
            pass  # pragma: no cover


async def test_unknown_scheme_is_a_config_error() -> None:
    with pytest.raises(polygate.ConfigError, match="unknown sink 'mysql://u:\\*\\*\\*@h/db'"):
        await open_sink("mysql://u:pw-SECRET@h/db")


def test_sqlite_urls_and_default_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert sqlite_path("sqlite:///tmp/x.db") == Path("/tmp/x.db")
    assert sqlite_path("sqlite:///tmp/with%20space.db") == Path("/tmp/with space.db")
    assert sqlite_path("sqlite:////tmp/x.db") == Path("/tmp/x.db")  # one slash too many: shown once
    env = {"HOME": "/home/u", "XDG_STATE_HOME": str(tmp_path)}
    assert sqlite_path("sqlite://", env) == tmp_path / "polygate" / "telemetry.db"
    assert state_dir({"HOME": "/home/u"}, "linux") == Path("/home/u/.local/state/polygate")
    assert state_dir({"HOME": "/home/u", "XDG_STATE_HOME": "rel"}, "linux") == Path(
        "/home/u/.local/state/polygate")
    assert state_dir({"HOME": "/Users/u"}, "darwin") == Path(
        "/Users/u/Library/Application Support/polygate")
    assert state_dir({"HOME": "C:/u", "LOCALAPPDATA": "C:/u/AppData/Local"}, "win32") == Path(
        "C:/u/AppData/Local/polygate")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_path() == tmp_path / "polygate" / "telemetry.db"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("sqlite:///tmp/x%00y.db", "cannot hold a NUL character"),
        ("sqlite:///tmp/x\x00y.db", "cannot hold a NUL character"),
        ("sqlite:///tmp/x\ud83dy.db", "cannot name"),
        # The path ended at '#': "run#1.db" opened "run" (a review, 2026-12-05).
        ("sqlite:///tmp/run#1.db", "unencoded '#'"),
        ("sqlite:///tmp/run?1.db", "unencoded '\\?'"),  # (it wrote /tmp/run)
        ("sqlite:///tmp/run.db?", "unencoded '\\?'"),
    ],
)
def test_a_sqlite_path_no_file_can_have_is_a_config_error(url: str, problem: str) -> None:
    """The settings took it (``check-config``: valid), then opening the session raised
    a bare ValueError ("embedded null byte") or UnicodeEncodeError: a traceback from
    ``polygate serve`` and ``polygate chat``."""
    with pytest.raises(polygate.ConfigError, match=r"Settings\.telemetry: .*" + problem):
        attrs.evolve(two_source_settings(names=("a",)), telemetry=url)


def test_an_empty_home_falls_back_to_the_users_entry_not_the_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``HOME=""`` made ``Path.home()`` the file system's root: the default files went
    to ``/.local/state/polygate`` (created there when run as root)."""
    import pwd

    entry = pwd.getpwuid(os.getuid()).pw_dir
    monkeypatch.setenv("HOME", "")
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert state_dir(platform="linux") == Path(entry) / ".local" / "state" / "polygate"


def test_a_user_with_no_home_is_told_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HOME and a uid with no entry in the password database (a container run as
    ``--user 12345``): a RuntimeError traceback from ``Path.home()`` before."""
    import pwd

    def no_entry(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(polygate.ConfigError, match="set HOME or XDG_STATE_HOME"):
        state_dir({}, "linux")
    assert state_dir({"XDG_STATE_HOME": "/state"}, "linux") == Path("/state/polygate")


async def test_default_sqlite_url_creates_the_state_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = attrs.evolve(two_source_settings(names=("a",)), telemetry="sqlite://")
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        await s.chat(MESSAGES)
    assert len(_rows(tmp_path / "state" / "polygate" / "telemetry.db", "calls")) == 1


async def test_statistics_without_telemetry() -> None:
    async with polygate.session(two_source_settings(names=("a",)), transport=Router({})) as s:
        stats = await s.statistics()
    assert stats.telemetry.sink == "off" and stats.telemetry.written == 0


async def test_many_calls_all_flushed_on_exit(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(), db)
    router = Router({"a": FakeUpstream(Reply(first_token_s=0.2)), "b": FakeUpstream(Reply())})
    async with polygate.session(settings, transport=router) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(300):
                nursery.start_soon(s.chat, MESSAGES)
    stats = await s.statistics()
    assert stats.telemetry.written == 600 and stats.telemetry.dropped == 0
    assert len(_rows(db, "calls")) == 300 and len(_rows(db, "attempts")) == 300
    [session_row] = _rows(db, "sessions")
    assert session_row["rows_written"] == 600


async def test_a_cancelled_session_still_flushes(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    with trio.move_on_after(0.5) as outer:
        async with polygate.session(
            settings, transport=Router({"a": FakeUpstream([Reply()] * 5 + [Reply(first_token_s=60)])})
        ) as s:
            for _ in range(5):
                await s.chat(MESSAGES)
            await s.chat(MESSAGES)  # hangs until the outer scope cancels the session
    assert outer.cancelled_caught
    calls = _rows(db, "calls")
    assert len(calls) == 6
    assert calls[-1]["outcome"] == "cancelled"


async def test_a_session_left_by_cancellation_counts_what_it_wrote(tmp_path: Path) -> None:
    """Cancelled while the flusher is writing a batch: that batch still commits (the
    close waits for it, bounded), so it counts as written -- never as dropped -- and the
    sessions row says what the database holds ("dropped means not confirmed")."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    with trio.CancelScope() as outer:
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
            async with trio.open_nursery() as nursery:
                for _ in range(300):
                    nursery.start_soon(s.chat, MESSAGES)
            # the flusher is (very likely) writing now: leave the session
            outer.cancel()
    stats = (await s.statistics()).telemetry
    in_db = len(_rows(db, "calls")) + len(_rows(db, "attempts"))
    assert in_db == 600, (stats, _rows(db, "sessions"))
    assert (stats.written, stats.dropped) == (600, 0), stats
    [session_row] = _rows(db, "sessions")
    assert (session_row["rows_written"], session_row["rows_dropped"]) == (600, 0)


async def test_pipeline_bounds_are_settings(tmp_path: Path) -> None:
    """Review debt: the pipeline's queue, batch and timeouts come from Settings (and so
    from TOML and POLYGATE__TELEMETRY_* keys), not from constants."""
    settings = attrs.evolve(
        _with_telemetry(two_source_settings(names=("a",)), tmp_path / "t.db"),
        telemetry_queue=3, telemetry_batch=2, telemetry_write_timeout_s=7.0,
        telemetry_close_timeout_s=1.0,
    )
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        pipeline = s._telemetry.pipeline if s._telemetry is not None else None
        assert pipeline is not None
        assert (pipeline.capacity, pipeline.max_batch) == (3, 2)
        assert (pipeline.write_timeout_s, pipeline.shutdown_timeout_s) == (7.0, 1.0)
        assert (await s.statistics()).telemetry.capacity == 3
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1", "POLYGATE__TELEMETRY_QUEUE": "50"}
    assert polygate.Settings.from_env(env).telemetry_queue == 50


async def test_a_session_waits_for_another_process_creating_the_same_database(tmp_path: Path) -> None:
    """Review: while another connection held a fresh file inside polygate's own
    migration transaction (another process starting at the same time), opening failed
    at once with ConfigError "database is locked": switching a fresh file to WAL does
    not wait for the busy timeout.  It waits now (real clock: another connection holds
    the lock for 0.3 s, within the 5 s timeout)."""
    import threading

    path = tmp_path / "t.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # what SQLiteSink.open does, in another process
    other.execute(_schema.version_table("sqlite"))
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    release.start()
    try:
        settings = _with_telemetry(two_source_settings(names=("a",)), path)
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
            await s.chat(MESSAGES)
    finally:
        release.join()
        other.close()
    assert len(_rows(path, "calls")) == 1


@pytest.mark.parametrize("table", ["sessions", "calls", "attempts", "Sessions", "CALLS"])
async def test_a_database_with_a_table_of_the_same_name_is_refused(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, table: str
) -> None:
    """Review: an application's database with its own ``sessions`` table: the session
    started, recorded schema version 2 over it, and every batch then failed ("no column
    named session_id"): every row lost, silently, and later sessions none the wiser.
    A ConfigError at session start, and the application's table left as it was."""
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, user_name TEXT)")
    conn.commit()
    conn.close()
    settings = _with_telemetry(two_source_settings(names=("a",)), path)
    # (SQLite's names ignore case: "CALLS" is the table polygate would write.)
    with pytest.raises(polygate.ConfigError, match=f"has a table '{table}' that is not polygate's") as info:
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})):
            pass
    # Named by the URL as configured (review: "sqlite:////tmp/…", one slash too many).
    assert str(info.value).startswith(f"the telemetry database sqlite://{path} has"), info.value
    conn = sqlite3.connect(path)
    try:
        assert [r[1] for r in conn.execute(f"PRAGMA table_info({table})")] == ["id", "user_name"]
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'polygate_schema'").fetchall() == []
    finally:
        conn.close()



@pytest.mark.parametrize("text", [
    "The model can't accept this request.\ninput: 'please summarise the confidential merger pl…'",
    "The model can't accept: 'please summarise the confidential merger pl...' (it's too long)",
    'Bad "x" and `y` then "please summarise the\nconfidential merger pl…"',
])
def test_a_quote_cut_short_is_found_whatever_quote_marks_come_before_it(text: str) -> None:
    """review: with quotes allowed over several lines, an apostrophe before the quote
    ("can't") paired with its opening mark, and the quoted prompt was stored; every
    quote mark is now tried as an opening one."""
    from polygate.telemetry._recorder import error_text

    prompt = ["please summarise the confidential merger plan for ACME and its board",
              "please summarise the\nconfidential merger plan for ACME"]
    out = error_text(RuntimeError(text), (), prompt)
    assert out is not None and "confidential merger" not in out and "[prompt text]" in out, out


def test_an_echoed_prompt_holding_a_nul_is_replaced() -> None:
    """A text review: the NUL (which PostgreSQL refuses) was replaced before the prompt
    was looked for, so an upstream's echo of a prompt holding one no longer matched it,
    and the prompt was stored where ``log_content=False`` stores none."""
    from polygate.telemetry._recorder import error_text

    prompt = "Summarise the confidential memo for ACME: \x00 payroll of J. Doe is 250k"
    out = error_text(RuntimeError(f"HTTP 400: Invalid content in messages[0]: '{prompt}'"),
                     (), [prompt])
    assert out == "HTTP 400: Invalid content in messages[0]: '[prompt text]'", out
    kept = error_text(RuntimeError("a NUL \x00 in an error that quotes nothing"), (), [prompt])
    assert kept == "a NUL \ufffd in an error that quotes nothing"


def test_a_megabyte_prompt_and_an_error_full_of_escapes_stay_cheap() -> None:
    """A review: each of the 64 quoted runs looked up was searched for in every
    spelling of the prompt (eight, with Python's repr): a 2 MB prompt and an error
    text full of quotes and escapes cost 1.3 s of the event loop for one row.  A run
    with no escape in it is looked for in the prompt as it is, and a run the text
    repeats once."""
    import time

    from polygate.telemetry._recorder import error_text

    base = "Résumé A/B & <c> «ü» \x01 line\n"
    prompt = base * (2_000_000 // len(base))
    chunk = "'\\u0026\\/\\x01 \"abcdefghij\" `q` "
    started = time.process_time()
    error_text(RuntimeError((chunk * 200)[:2000]), (), [prompt])
    assert time.process_time() - started < 0.4  # (1.3 s before)


@pytest.mark.parametrize("runs", ["hex ids", "short words"])
def test_an_error_of_short_runs_that_may_begin_an_escape_stays_cheap(runs: str) -> None:
    """A review: runs of 8 to 16 characters that may begin with an escape's tail (hex
    ids, dates, "function", "required") were looked for in every spelling of a 2 MB
    prompt, ~22 ms each, up to 64 a row: about 1 s of the event loop.  They are now
    looked for in the prompt as it is, and in its spellings only within a bound."""
    import random
    import time

    from polygate.telemetry._recorder import error_text

    base = "Résumé A/B & <c> «ü» \x01 line\n"
    prompt = base * (2_000_000 // len(base))
    rnd = random.Random(0)
    if runs == "hex ids":
        ids = ["".join(rnd.choice("0123456789abcdef") for _ in range(12)) for _ in range(64)]
        quoted = " ".join(f'"request_id":"{i}"' for i in ids)
    else:
        quoted = " ".join(f"'{w}'" for w in (
            "function", "required", "abstract", "database", "attracted", "redacted",
            "truncated", "20240105", "1717171717", "external", "tentative", "catering"))
    started = time.process_time()
    error_text(RuntimeError(("\\u0026\\/\\x01 " + quoted)[:2000]), (), [prompt])
    assert time.process_time() - started < 0.4  # (~1 s before)


@pytest.mark.parametrize(("prompt", "shown"), [
    # the cut fell in the prompt's only escape, and a short word follows it
    ("Tell me\x07deadbeef12", "'Tell me...07deadbeef12'"),
    # what follows the escape is under 8 long: looked for in each spelling
    ("ab \u2028u45xc6", '"ab \\u...2028u45xc6"'),
])
def test_a_short_run_a_cut_began_inside_an_escape_is_still_found(prompt: str, shown: str) -> None:
    """The same review: a run whose rest, past what could be an escape's tail, was
    under 8 characters was looked for in the spellings the error showed signs of, and
    one whose cut took the error's only backslash in none: stored."""
    from polygate.telemetry._recorder import error_text

    out = error_text(RuntimeError(f"1 validation error: input_value={shown}"), (), [prompt])
    assert out is not None and "[prompt text]" in out.split("...")[-1], out


def test_a_run_found_past_a_tail_does_not_hide_the_echo_that_opens_inside_it() -> None:
    """A review: a quote opened by an apostrophe and closed by the prompt's own, "I
    have been told it", was taken for prompt text past what may be an escaped quote's
    tail, and the quotes inside it were skipped: the echo they opened was stored."""
    from polygate.telemetry._recorder import error_text

    prompt = "Context: I have been told it's fine to share the code 4417 now."
    text = """input_value='"I have been told it's fine to share the code 4417"'"""
    out = error_text(RuntimeError(text), (), [prompt])
    assert out is not None and "fine to share" not in out, out


def test_a_pathological_prompt_and_an_error_of_many_runs_stay_bounded() -> None:
    """The same review: one letter repeated 2 M times, and 64 runs like 'aaaaaaaaab'
    (the worst case of a substring search: ~7 ms each): 0.85 s for one row.  The
    searches of one row are bounded (~32 M characters), past which a run is taken for
    prompt text unsearched."""
    import random
    import time

    from polygate.telemetry._recorder import error_text

    rnd = random.Random(0)
    text = " ".join(f"'{'a' * rnd.randint(7, 14)}{rnd.choice('bcx')}{'a' * rnd.randint(0, 3)}'"
                    for _ in range(300))[:2000]
    started = time.process_time()
    error_text(RuntimeError(text), (), ["a" * 2_000_000])
    assert time.process_time() - started < 0.3


def test_a_small_prompts_error_keeps_its_words() -> None:
    """A review of the bound above: a 99 KB prompt's spellings total ~1 M characters,
    so an error of 40 quoted runs each holding a backslash (a JSON body inside a
    string) ran out of the bound after ~30, and the rest of its words were stored as
    "[prompt text]" though nothing of the prompt was in it.  Under 100,000 characters
    a prompt is never cut short."""
    from polygate.telemetry._recorder import error_text

    line = "Кратко изложи отчёт & перечисли риски/владельцев: <b>итог</b> 😀\n"
    prompt = line * (99_000 // len(line.encode()))
    items = ",".join(f'\\"item_{i:02d}\\"' for i in range(40))
    text = ('upstream 400: {\\"error\\":\\"caf\\u00e9 \\u0026 \\/\\",\\"items\\":['
            + items + "]}")
    out = error_text(RuntimeError(text), (), [prompt])
    assert out is not None and "[prompt text]" not in out, out


@pytest.mark.parametrize("escaped", ["\\n", "\\u0026", "\\x01", "\\/"])
def test_a_quoted_run_that_begins_with_an_escapes_tail_is_still_found(escaped: str) -> None:
    """The other side of the above: a run with no backslash that begins inside an
    escape ("u0026..." of "\\u0026...") is in a spelling of the prompt, not in the prompt
    as it is; its rest is looked for."""
    from polygate.telemetry._recorder import error_text

    secret = "the confidential merger plan for ACME"
    prompt = {"\\n": "\n", "\\u0026": "&", "\\x01": "\x01", "\\/": "/"}[escaped] + secret
    text = f"HTTP 400: bad input {escaped[0]}'{escaped[1:]}{secret}'"
    out = error_text(RuntimeError(text), (), [prompt])
    assert out is not None and "merger" not in out, out


@pytest.mark.parametrize("spelling", ["repr", "json"])
def test_a_run_a_cut_began_inside_an_escape_is_still_found(spelling: str) -> None:
    """A review of the change above: a cut inside an escape (pydantic's 'first...last'
    through "\\x07", an upstream's truncation through "\\u00e9") began a run with part
    of an escape's tail, "07 were…", found in no spelling of the prompt's whole tails:
    the rest of the prompt was stored."""
    import json

    from polygate.telemetry._recorder import error_text

    prompt = ("Ab\x07cd: the quarterly numbers for ACME\u00e9\x07 were confidential and "
              "large indeed")
    shown = repr(prompt)[1:-1] if spelling == "repr" else json.dumps(prompt)[1:-1]
    escape = "\\x07" if spelling == "repr" else "\\u0007"
    at = shown.rindex(escape)
    text = f"input_value='{shown[:8]}...{shown[at + 2:]}'"  # (the cut: two into the escape)
    out = error_text(RuntimeError(text), (), [prompt])
    assert out is not None and "confidential" not in out, out


def test_redacting_a_prompt_stays_cheap_in_an_error_full_of_quote_marks() -> None:
    """review: trying every quote mark made a 2,000-character error text dense with
    them cost ~0.13 s against a 260 KB prompt, on the event loop, for each row; the
    searches are bounded now.  (And a prompt with an apostrophe, quoted cut short, is
    still found on both sides of it.)"""
    import time

    from polygate.telemetry._recorder import _without_prompt

    searched: list[str] = []

    class Counted(str):
        def __contains__(self, part: object) -> bool:
            searched.append(str(part))
            return str.__contains__(self, part)  # type: ignore[operator]

    prompt = [Counted("aaaaaaaa" * 20000 + "z"), Counted("b" * 100000)]
    started = time.perf_counter()
    _without_prompt("'\"`aaaaaaaa" * 1500, prompt)
    assert time.perf_counter() - started < 1.0
    assert 0 < len(searched) <= 2 * 64  # at most 64 quoted runs, each in both texts
    secret = "Please read it's about the secret merger plan with Globex"
    out = _without_prompt(f"Bad content: '{secret[:45]}...'", [secret])
    assert "merger" not in out and "Please read" not in out, out


LONG_PROMPT = ("Please summarise the confidential merger plan ZQXMARKER4242 between ACME and "
               "Globex for the board. " * 6)


@pytest.mark.parametrize("message", [
    # quoted whole: the error's message is cut (300 characters) before its closing quote
    f"Invalid content in messages[0]: '{LONG_PROMPT}'",
    # echoed without quotes, and cut
    f"Invalid content in messages[0]: {LONG_PROMPT}",
], ids=["quoted", "unquoted"])
async def test_a_long_prompt_an_error_echoes_past_its_cut_is_not_stored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, message: str
) -> None:
    """review: an upstream's message is cut to 300 characters when its error is made,
    so a long quoted prompt lost its closing quote, and its first ~250 characters were
    stored as they were; an echo without quotes the same."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db, log_content=False)
    body = {"error": {"message": message, "type": "invalid_request_error"}}
    up = FakeUpstream(Reply(status=400, error_body=body))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat([{"role": "user", "content": LONG_PROMPT}])
    for table in ("calls", "attempts"):
        [row] = _rows(db, table)
        assert row["error_message"].startswith(
            "[a] HTTP 400: Invalid content in messages[0]: "), row["error_message"]
        assert "[prompt text]" in row["error_message"], row["error_message"]
    assert b"ZQXMARKER4242" not in db.read_bytes()
    assert b"confidential" not in db.read_bytes()


@pytest.mark.parametrize(("text", "kept"), [
    ("Bad: 'it is fine' and 'Please summarise the confidential…", "Bad: 'it is fine' and '"),
    ("Bad input Please summarise the confidential…", "Bad input "),
    ("Bad: Please summarise the confidential merger plan ZQXMARKER4242 between A...", "Bad: "),
])
def test_a_prompt_cut_at_the_end_of_an_error_text_is_replaced(text: str, kept: str) -> None:
    from polygate.telemetry._recorder import _without_prompt

    out = _without_prompt(text, [LONG_PROMPT])
    assert out.startswith(kept + "[prompt text]"), out
    assert "confidential" not in out and "Please" not in out, out


def test_an_unclosed_quote_of_other_text_is_kept() -> None:
    from polygate.telemetry._recorder import _without_prompt

    text = "The model can't take requests longer than the context window…"
    assert _without_prompt(text, [LONG_PROMPT]) == text


async def test_a_committed_stream_cut_by_its_deadline_is_stored_with_its_source(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The row says what the statistics say (docs/statistics.md, docs/telemetry.md): a
    committed stream's DeadlineExceeded carries the committed source."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",), call_deadline_s=3), db)
    up = FakeUpstream(Reply(first_token_s=1, inter_token_s=1, tokens=10))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            async with s.stream_chat([{"role": "user", "content": "hi"}]) as stream:
                async for _ in stream:
                    pass
    [call] = _rows(db, "calls")
    assert call["error_class"] == "DeadlineExceeded"
    assert call["source"] == info.value.call_stats.source == "a"


async def test_cut_echoes_joined_in_an_exhausted_calls_message_are_not_stored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """review: an exhausted call's message joins its attempts' errors ("…; [b] HTTP
    500: …"), so a cut echo no longer ended the text, and the calls row stored the
    first one's ~250 characters of prompt."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(retry=polygate.Retry(max_attempts=2)), db,
                               log_content=False)
    body = {"error": {"message": f"Invalid content in messages[0]: '{LONG_PROMPT}'",
                      "type": "server_error"}}
    router = Router({n: FakeUpstream(Reply(status=500, error_body=body)) for n in ("a", "b")})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat([{"role": "user", "content": LONG_PROMPT}])
    [call] = _rows(db, "calls")
    assert call["error_message"].count("[prompt text]") == 2, call["error_message"]
    assert b"ZQXMARKER4242" not in db.read_bytes()


_AMPERSAND = "Compare A & B: " + LONG_PROMPT
_SLASH = "Compare A/B: " + LONG_PROMPT
_LINES = "Résumé:\u2028" + LONG_PROMPT
_NBSP = "Le résumé\xa0: " + LONG_PROMPT


@pytest.mark.parametrize(("text", "prompt"), [
    # pydantic's validation error (FastAPI, vLLM) writes a long input cut in its middle
    ("1 validation error for ChatRequest\nmessages.0.content\n  String should have at most "
     f"100 characters [type=string_too_long, input_value='{LONG_PROMPT[:25]}..."
     f"{LONG_PROMPT[-24:]}', input_type=str]", LONG_PROMPT),
    # Go's encoding/json (Ollama, Go gateways) escapes & < > as \\u0026 \\u003c \\u003e
    ('{"error":{"message":"Invalid content in messages[0]: '
     + _AMPERSAND.replace("&", "\\u0026")[:120] + "…", _AMPERSAND),
    # PHP's json_encode escapes /
    ('{"error":{"message":"Invalid content: ' + _SLASH.replace("/", "\\/")[:120] + "…", _SLASH),
    # Go also always escapes U+2028 and U+2029, leaving other non-ASCII as it is
    ('json: cannot unmarshal request body {"content":"'
     + _LINES.replace("\u2028", "\\u2028")[:120] + "…", _LINES),
    # pydantic's input_value is Python's repr: a no-break space is \xa0 there
    (f"1 validation error\n  input_value={_NBSP!r}"[:140] + "...", _NBSP),
], ids=["pydantic-middle-cut", "go-escapes", "php-escapes", "go-line-separator",
        "python-repr"])
def test_other_cut_and_escaped_echoes_of_a_prompt_are_replaced(text: str, prompt: str) -> None:
    from polygate.telemetry._recorder import _without_prompt

    out = _without_prompt(text, [prompt])
    assert "confidential" not in out and "Please summarise" not in out, out
    assert "Globex for the board" not in out and "[prompt text]" in out, out


@pytest.mark.parametrize(("inter_token_s", "outcome"), [(0.0, "ok"), (1.0, "cancelled")])
async def test_a_stream_left_unread_is_cancelled_only_while_its_answer_is_still_coming(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, inter_token_s: float, outcome: str
) -> None:
    """A stream's call ends when its answer is complete, not when its reader is done:
    a caller that leaves after that, with chunks still unread, leaves an ``ok`` row (the
    upstream did the work; its cost stands, as for a polygate.aio call cancelled after
    its answer came).  One that leaves while the answer is still coming cancels the call
    (docs/telemetry.md)."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    upstream = FakeUpstream(Reply(first_token_s=0.1, inter_token_s=inter_token_s, tokens=3))
    async with polygate.session(settings, transport=Router({"a": upstream})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            await trio.sleep(0.5)  # (virtual time: all three tokens came, or one)
        assert stream.response is None
    [call] = _rows(db, "calls")
    [attempt] = _rows(db, "attempts")
    assert (call["outcome"], attempt["error"]) == (outcome, outcome)


@pytest.mark.parametrize("length", [499, 500, 501, 5000])
def test_an_error_message_is_at_most_500_characters_with_its_cut_mark(length: int) -> None:
    """A docs sweep of telemetry.md ("at most 500 characters"): a cut message kept 500
    and added its "…", 501 in all, over a varchar(500) an administrator's schema may
    hold the column in."""
    from polygate.telemetry._recorder import error_text

    text = error_text(RuntimeError("x" * length), ())
    assert text is not None and len(text) == min(length, 500)
    assert text.endswith("…") is (length > 500)


async def _until(condition: Any, limit_s: float = 30.0) -> None:
    """Wait (real time, bounded) until ``await condition()`` holds: a state to reach,
    not a race to win."""
    with trio.fail_after(limit_s):
        while not await condition():  # noqa: ASYNC110 - counters of a worker thread: no event
            await trio.sleep(0.02)


def _call_ids(db: Path) -> list[str]:
    return [row["logical_call_id"] for row in _rows(db, "calls")]


@pytest.mark.timeout(90)
async def test_a_file_locked_when_the_session_starts_is_opened_by_a_later_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A docs sweep of telemetry.md ("the tables are locked when the session starts:
    a warning, and the session starts"): on SQLite the session did not start, with a
    ConfigError "database is locked", once another connection had held the file past
    the 5 s busy timeout.  Real time: the busy timeout is SQLite's own."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    async with polygate.session(settings, transport=Router({"a": FakeUpstream()})):
        pass  # the file and its schema, as another process would have made them
    caplog.set_level(logging.WARNING, logger="polygate.telemetry")
    locker = sqlite3.connect(db, isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        async with polygate.session(settings, transport=Router({"a": FakeUpstream()})) as s:
            assert any("is locked" in r.getMessage() for r in caplog.records)
            first = await s.chat(MESSAGES)

            async def dropped() -> bool:  # the batch that met the lock: dropped, counted
                return (await s.statistics()).telemetry.dropped_sink_error >= 2

            await _until(dropped)
            locker.execute("ROLLBACK")
            second = await s.chat(MESSAGES)
        telemetry = (await s.statistics()).telemetry
    finally:
        locker.close()
    assert (telemetry.dropped_sink_error, telemetry.written) == (2, 2)  # one call each
    assert _call_ids(db) == [second.call_stats.logical_call_id]  # (first: dropped)
    assert first.call_stats.logical_call_id != second.call_stats.logical_call_id


@pytest.mark.timeout(90)
@pytest.mark.parametrize("given_up", ["write", "close"])
async def test_a_write_given_up_on_while_it_opens_the_file_never_lands(
    tmp_path: Path, given_up: str
) -> None:
    """A review of the change above: a write that opened a file locked at the start
    waited for it out of ``interrupt()``'s reach, so a write the pipeline had given up
    on (its write timeout, or the close's bound) landed once the lock went, its rows
    counted dropped *and* in the file."""
    db = tmp_path / "t.db"
    settings = _with_telemetry(two_source_settings(names=("a",)), db)
    async with polygate.session(settings, transport=Router({"a": FakeUpstream()})):
        pass
    bounds = ({"telemetry_write_timeout_s": 1.0} if given_up == "write"
              else {"telemetry_close_timeout_s": 1.0})
    settings = attrs.evolve(settings, **bounds)
    locker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        async with polygate.session(settings, transport=Router({"a": FakeUpstream()})) as s:
            answer = await s.chat(MESSAGES)
            if given_up == "write":

                async def dropped() -> bool:
                    return (await s.statistics()).telemetry.dropped_sink_error >= 2

                await _until(dropped)  # given up after 1 s, within SQLite's 5 s wait
                locker.execute("ROLLBACK")  # while the abandoned opening still waits
        telemetry = (await s.statistics()).telemetry
        if given_up == "close":
            assert telemetry.dropped_at_close == 2
            locker.execute("ROLLBACK")
        # The abandoned opening ends within SQLite's own waits (~10 s): then look.
        await _until(_no_telemetry_thread_busy)
    finally:
        locker.close()
    assert answer.call_stats.logical_call_id not in _call_ids(db)


async def _no_telemetry_thread_busy() -> bool:
    import threading

    return not any(t.name == "polygate-telemetry-close" for t in threading.enumerate())


def test_stats_reads_a_version_1_file_as_it_is(tmp_path: Path) -> None:
    """``polygate stats`` only reads: a first-release file (no ``answered_scope``
    column) is reported, not migrated, its calls' answering scope unknown."""
    from polygate.telemetry._report import open_reader, read_rows

    path = _version_1_file(tmp_path)
    reader = open_reader(f"sqlite:///{path}")
    try:
        calls, _, _ = read_rows(reader)
    finally:
        reader.close()
    assert [(c.scope, c.source, c.answered_scope) for c in calls] == [("chat", "a", None)]
    conn = sqlite3.connect(path)
    try:  # (closed: Python 3.13 warns of a connection left to the collector)
        assert [v for (v,) in conn.execute("SELECT version FROM polygate_schema")] == [1]
    finally:
        conn.close()


def test_a_batch_is_written_in_few_statements_and_reads_back_whole(tmp_path: Path) -> None:
    """Review finding (stores under load): the sink wrote a batch with ``executemany``,
    one SQLite step a row, and the sqlite3 module gives up the GIL around each: while
    the event loop kept the GIL busy (a closed loop of calls on a fast upstream), each
    row waited for it again, a 376-row batch took seconds, and 19,263 rows of 20,862
    calls were dropped as "queue full".  Rows now go in multi-row INSERTs (at most 999
    parameters each, SQLite's oldest limit): a few steps a batch."""
    from polygate.telemetry import Batch

    calls = [CallEvent(
        "s1", f"c{i}", "chat", "chat", 1, 1.0e9 + i, "ok", None, None, 10.0 + i, 5.0, 1.0, 0.0, 0,
        4.0, 1, 0, 0, "a", 0, 3, 4, "upstream", None) for i in range(1000)]
    attempts = [AttemptEvent(
        f"c{i}.1", f"c{i}", "chat", "a", "primary", 1.0e9 + i, 9.0, 1.0, 200, 1, "ok", None, None,
        20, 7, 3, 4, "upstream") for i in range(1001)]
    sink = SQLiteSink.open(tmp_path / "t.db")
    statements: list[str] = []
    assert sink._conn is not None
    sink._conn.set_trace_callback(statements.append)
    if hasattr(sink._conn, "setlimit"):  # (3.11+) a statement of more parameters fails
        sink._conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    sink.write(Batch(calls, attempts, SessionEvent("s1", 1.0e9, 1.0e9, None, 1, "x", 0, 0, "{}")))
    sink._conn.set_trace_callback(None)
    sink.close()
    inserts = [s for s in statements if s.startswith("INSERT INTO")]
    assert 3 <= len(inserts) <= 60, len(inserts)  # (1,000 calls, 1,001 attempts, the session)
    got_calls = _rows(tmp_path / "t.db", "calls")
    got_attempts = _rows(tmp_path / "t.db", "attempts")
    assert [tuple(r.values()) for r in got_calls] == [tuple(c) for c in calls]
    assert [tuple(r.values()) for r in got_attempts] == [tuple(a) for a in attempts]
