"""A session on Redis closing under calls it did not see finish (outside review,
2026-12-02): calls that outlive their session (in tasks outside its block: the
caller's mistake) neither hold their shared permits until their leases run out nor
retry their settles against a closed client past their deadlines, and the figures
of a closed session stay readable.  Real redis-server, real clock."""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import signal
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import polygate
import polygate.aio
from polygate.governance._redis import RedisBackend, parse_redis_url
from polygate.testing import FakeUpstream, Reply

from . import _redis_server
from ._redis_server import RedisServer, need_redis, running_redis
from .test_lifecycle import _ctrl_c_now

pytestmark = pytest.mark.integration
redis_server = _redis_server.redis_server  # the fixture

MESSAGES = [{"role": "user", "content": "hi"}]


def _settings(url: str) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)])}, backend=url)


def _url(redis_server: RedisServer) -> str:
    return f"{redis_server.url}?prefix=close{secrets.token_hex(4)}"


async def _held(url: str) -> tuple[int, int]:
    """(in_flight, tokens_reserved) as another process sees them."""
    backend = RedisBackend(parse_redis_url(url))
    await backend.start()
    try:
        snapshot = await backend.snapshot("chat", "a")
    finally:
        await backend.aclose()
    return snapshot.in_flight, snapshot.tokens_reserved


def _start_outliving_call(nursery: trio.Nursery, s: polygate.Session, result: dict[str, Any]) -> None:
    """A call (deadline 0.8 s) in a task of ``nursery``: outside the session's block."""

    async def call() -> None:
        start = trio.current_time()
        result["answer"] = await s.chat(MESSAGES, call_deadline_s=0.8)
        result["took"] = trio.current_time() - start

    nursery.start_soon(call)


async def _until_sent(up: FakeUpstream) -> None:
    with trio.fail_after(5):
        while not up.requests:  # noqa: ASYNC110 - the fake's record: no event to wait on
            await trio.sleep(0.01)


async def test_a_call_that_outlives_its_session_returns_its_permit(redis_server: RedisServer) -> None:
    """The call's answer comes at 0.5 s; its session closed at 0.1 s.  Its settle was
    retried against the closed client for ``settle_s`` (past the 0.8 s deadline), and
    its permit stayed held in Redis, for every process, until its lease ran out."""
    url = _url(redis_server)
    up = FakeUpstream(Reply(tokens=2, headers_delay_s=0.5))
    result: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        async with polygate.session(_settings(url), transport=up.transport()) as s:
            _start_outliving_call(nursery, s, result)
            await _until_sent(up)
        assert await _held(url) == (0, 0)  # settled as the session closed
    gc.collect()  # (a leaked client's streams would warn here: an error in this suite)
    assert isinstance(result["answer"], polygate.ChatResponse)
    assert result["took"] < 0.8
    assert await _held(url) == (0, 0)


async def test_the_figures_of_a_closed_session_stay_readable(redis_server: RedisServer) -> None:
    url = _url(redis_server)
    async with polygate.session(_settings(url), transport=FakeUpstream(Reply()).transport()) as s:
        await s.chat(MESSAGES)
        live = await s.statistics()
    after = await s.statistics()
    assert after.governance.sources[0].state.requests_in_window == 1
    assert after.governance == live.governance


def test_an_aio_session_on_redis_closes_cleanly(redis_server: RedisServer) -> None:
    """The asyncio door reads the closed trio session's statistics: the closed backend
    built a connection on its exited pool for it (never closed: ResourceWarnings)."""
    url = _url(redis_server)

    async def main() -> Any:
        async with polygate.aio.session(_settings(url), transport=FakeUpstream(Reply()).transport()) as s:
            await s.chat(MESSAGES)
        return await s.statistics()

    final = asyncio.run(main())
    gc.collect()
    assert final.governance.sources[0].state.requests_in_window == 1


# --- review of the close above (2026-12-02) ---


async def test_close_with_a_hung_redis_is_bounded_by_freeze_s() -> None:
    """_session.py: ``_FREEZE_S = 1.0`` "The most a session's close waits for its
    governance figures" (review of the close's
    freeze, 2026-12-02).  With ``timeout_s=4`` and a Redis that stopped answering
    (SIGSTOP), the freeze's outer 1 s deadline cannot cut the backend's own
    *shielded* per-operation scope: the close waits the whole timeout_s (4 s)."""
    with running_redis(need_redis()) as server:
        url = f"{server.url}?prefix=rv{secrets.token_hex(4)}&timeout_s=4"
        assert server.proc is not None
        async with polygate.session(_settings(url), transport=FakeUpstream(Reply()).transport()) as s:
            await s.chat(MESSAGES)
            os.kill(server.proc.pid, signal.SIGSTOP)
            start = trio.current_time()
        took = trio.current_time() - start
        os.kill(server.proc.pid, signal.SIGCONT)
    assert took < 2.0, f"session close took {took:.2f} s with Redis hung (bound: _FREEZE_S=1)"


async def test_closed_session_statistics_agree_with_the_permits_it_returned() -> None:
    """A call outlives its session: the close returns its permit (in Redis in_flight
    is 0), but the figures frozen *before* ``_settle_left`` still say in_flight=1 --
    ``statistics()`` after the close reports a permit that the close gave back."""
    with running_redis(need_redis()) as server:
        url = f"{server.url}?prefix=rv{secrets.token_hex(4)}"
        up = FakeUpstream(Reply(tokens=2, headers_delay_s=0.5))
        async with trio.open_nursery() as nursery:
            async with polygate.session(_settings(url), transport=up.transport()) as s:
                _start_outliving_call(nursery, s, {})
                await _until_sent(up)
            after = await s.statistics()
            held = await _held(url)
    assert held[0] == 0
    assert after.governance.sources[0].state.in_flight == held[0]


async def test_a_settle_sent_while_the_close_settles_is_not_retried_against_the_closed_backend() -> None:
    """A call's own settle that starts while ``_settle_left`` is still settling (Redis
    slow: each settle script takes 0.3 s to answer) passes the ``_closed`` check, then
    meets the closed backend: its retry loop retries "closed" until ``settle_s`` (1 s),
    counts a settle failure and warns -- the "settles retried past the deadline" that
    24d4c1c meant to end.  Its admission was settled by the close."""
    from polygate.governance import _redis as redis_mod

    with running_redis(need_redis()) as server:
        url = f"{server.url}?prefix=rv{secrets.token_hex(4)}"
        up = FakeUpstream(Reply(tokens=2, headers_delay_s=0.2))
        result: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            async with polygate.session(_settings(url), transport=up.transport()) as s:
                backend = s._runtime.governor.backend
                real = backend._script

                async def slow(script: Any, keys: Any, args: Any, what: str, **kw: Any) -> Any:
                    if script is redis_mod._SETTLE:
                        await trio.sleep(0.3)  # a slow Redis's answer time
                    return await real(script, keys, args, what, **kw)

                backend._script = slow
                _start_outliving_call(nursery, s, result)
                await _until_sent(up)
    assert isinstance(result["answer"], polygate.ChatResponse)
    stats = backend.statistics()
    assert (stats.settle_failures, stats.settle_retries) == (0, 0), (stats, result["took"])
    assert result["took"] < 0.8


def _ctrl_c_in_a_round_trip(
    monkeypatch: pytest.MonkeyPatch, script: Any, main_task: list[Any] | None = None,
    *, before_sending: bool = False,
) -> None:
    """Ctrl-C while the next ``script`` exchange (of the main task, when given) waits for
    Redis's answer (once: it has been sent), or for its connection (``before_sending``)."""
    from polygate.governance import _redis

    original = RedisBackend._evalsha
    armed = [True]

    class CtrlCOnSend(list[bool]):
        def __init__(self, sent: list[bool] | None) -> None:
            super().__init__()
            self.sent = sent

        def append(self, item: bool) -> None:  # the request is on its way
            super().append(item)
            if self.sent is not None:
                self.sent.append(item)
            _ctrl_c_now()  # delivered as the main task waits for the answer

    async def evalsha(self: Any, sc: Any, keys: Any, args: Any, sent: Any = None) -> Any:
        if sc is getattr(_redis, script) and armed[0] and (main_task is None or (
                main_task and trio.lowlevel.current_task() is main_task[0])):
            armed[0] = False
            if before_sending:
                _ctrl_c_now()  # delivered at its first wait: the pool's, before it is sent
            else:
                sent = CtrlCOnSend(sent)
        return await original(self, sc, keys, args, sent)

    monkeypatch.setattr(RedisBackend, "_evalsha", evalsha)


def test_ctrl_c_as_a_redis_session_takes_its_figures_closes_it_cleanly(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: Ctrl-C as a Redis session's close took its governance figures skipped
    the backend's close: its nursery (lease renewal, polling) was never exited, and the
    run ended in ``TrioInternalError``.  The close now runs to its end (the figures
    taken, the backend closed), and Ctrl-C leaves after it, as itself."""
    url = _url(redis_server)
    seen: list[Any] = []

    async def main() -> None:
        up = FakeUpstream(Reply(tokens=2))
        try:
            async with polygate.session(_settings(url), transport=up.transport()) as s:
                await s.chat(MESSAGES)
                _ctrl_c_in_a_round_trip(monkeypatch, "_SNAPSHOT")
        except KeyboardInterrupt:
            seen.append("KeyboardInterrupt")
        seen.append(s._runtime.governor.backend._closed)
        seen.append((await s.statistics()).governance.sources[0].state.in_flight)

    trio.run(main)
    assert seen == ["KeyboardInterrupt", True, 0]


def test_ctrl_c_as_a_redis_admission_waits_for_its_answer_leaves_no_permit(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: Ctrl-C while an admission's answer was on its way (granted in Redis, never
    heard) left its permit held for every process until its lease ran out (15 s): it
    was neither open nor abandoned, so the session's close did not return it.  It is
    abandoned now, and the close voids it."""
    url = _url(redis_server)
    main_task: list[Any] = []
    seen: list[Any] = []

    async def main() -> None:
        up = FakeUpstream(Reply(tokens=2))
        async with polygate.session(_settings(url), transport=up.transport()) as s:
            _ctrl_c_in_a_round_trip(monkeypatch, "_ADMIT", main_task)
            main_task.append(trio.lowlevel.current_task())
            with pytest.raises(KeyboardInterrupt):
                await s.chat(MESSAGES)
        seen.append(await _held(url))  # (granted in Redis, its answer unheard)

    trio.run(main)
    assert seen == [(0, 0)]


def test_ctrl_c_as_the_close_settles_the_calls_left_settles_them(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: Ctrl-C (a second one, say) as a Redis session's close returned the
    permits of calls still running cut that short: the permit stayed held for every
    process until its lease ran out.  The close holds Ctrl-C until it is done."""
    original = RedisBackend.settle_left
    fired: list[bool] = []

    async def settle_left(self: Any) -> None:
        if not fired:  # (the session's close only: _held's backend closes too)
            fired.append(True)
            _ctrl_c_now()  # pending: raised in the main task at its next wait
        await original(self)

    monkeypatch.setattr(RedisBackend, "settle_left", settle_left)
    url = _url(redis_server)
    up = FakeUpstream(Reply(tokens=2, headers_delay_s=0.5))
    seen: list[Any] = []

    async def main() -> None:
        result: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            try:
                async with polygate.session(_settings(url), transport=up.transport()) as s:
                    _start_outliving_call(nursery, s, result)
                    await _until_sent(up)
            except KeyboardInterrupt:
                seen.append("KeyboardInterrupt")
            seen.append(await _held(url))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen == ["KeyboardInterrupt", (0, 0)]


@pytest.mark.parametrize("fresh_connection", [False, True])
def test_ctrl_c_as_a_call_settles_on_redis_leaves_no_permit(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, fresh_connection: bool,
    tmp_path: Path,
) -> None:
    """Review: Ctrl-C as a call's settle waited for its connection (the pool's, or a
    fresh one after Redis dropped them) cut the settle before it was sent; its member
    had already left the open ones, so neither the close nor the void loop returned
    its permit, held for every process until its lease ran out.  The cut settle is
    sent as the session closes.  (Its attempt's telemetry row was lost too.)"""
    import sqlite3

    url = _url(redis_server)
    db = tmp_path / "t.db"
    settings = attrs.evolve(_settings(url), telemetry=f"sqlite:///{db}")
    main_task: list[Any] = []
    seen: list[Any] = []

    async def main() -> None:
        up = FakeUpstream(Reply(tokens=2))
        try:
            async with polygate.session(settings, transport=up.transport()) as s:
                _ctrl_c_in_a_round_trip(monkeypatch, "_SETTLE", main_task, before_sending=True)
                main_task.append(trio.lowlevel.current_task())
                if fresh_connection:
                    s._runtime.governor.backend._client.connection_pool.disconnect()
                await s.chat(MESSAGES)
        except KeyboardInterrupt:
            seen.append("KeyboardInterrupt")
        seen.append(await _held(url))

    trio.run(main)
    con = sqlite3.connect(db)
    attempts = con.execute("select count(*) from attempts").fetchone()[0]
    con.close()
    assert seen == ["KeyboardInterrupt", (0, 0)] and attempts == 1
