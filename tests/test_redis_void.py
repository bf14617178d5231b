"""Abandoned admissions voided by the Redis backend's own loop (``_void_loop``): on a
timer, after a probe, never once per exchange.  A real redis-server, hung (SIGSTOP) or
lost (killed and restarted empty).  Outside review of the loop, 2026-12-03."""

from __future__ import annotations

import secrets
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply

from ._redis_server import RedisServer, command, need_redis, running_redis

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with running_redis(need_redis()) as server:
        yield server


def evalsha_calls(port: int) -> int:
    """``cmdstat_evalsha:calls=N`` from INFO commandstats (a bulk reply: read whole)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n")
        data = b""
        while b"\r\n" not in data:
            data += sock.recv(65536)
        size = int(data[1:data.index(b"\r\n")])
        start = data.index(b"\r\n") + 2
        while len(data) < start + size:
            data += sock.recv(65536)
    text = data[start:start + size].decode()
    assert text.startswith("# Commandstats"), text[:100]
    for line in text.splitlines():
        if line.startswith("cmdstat_evalsha:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def settings_for(redis: RedisServer, **options: Any) -> polygate.Settings:
    query = "&".join(f"{k}={v}" for k, v in {"timeout_s": 0.5, "prefix": f"v{secrets.token_hex(3)}", **options}.items())
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])},
        backend=f"{redis.url}?{query}",
    )


def one_source(redis: RedisServer, url: str | None = None, **options: Any) -> polygate.Settings:
    """One source with one permit (``max_in_flight=1``): a phantom admission holds it."""
    query = "&".join(f"{k}={v}" for k, v in
                     {"timeout_s": 0.3, "prefix": f"r{secrets.token_hex(3)}", **options}.items())
    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)])},
        backend=f"{url or redis.url}?{query}",
    )


async def in_flight(s: Any) -> list[int]:
    snap = await s.statistics()
    return [src.state.in_flight for src in snap.governance.sources]


async def abandon_one(s: Any, redis: RedisServer, error: type[Exception], hang_s: float = 0.0,
                      **chat: Any) -> None:
    """One call whose admission is sent into a hung Redis (SIGSTOP) and given up
    (``error``); Redis runs again ``hang_s`` later."""
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(error):
            await s.chat(MESSAGES, **chat)
        await trio.sleep(hang_s)
    finally:
        redis.proc.send_signal(signal.SIGCONT)


async def abandon_many(s: Any, redis: RedisServer, n: int) -> None:
    """n admissions sent into a hung Redis, then Redis is killed and restarted empty:
    those admissions never ran, so no void can ever find them."""
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        async def one() -> None:
            with pytest.raises(polygate.GovernanceBackendError):
                await s.chat(MESSAGES)

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    finally:
        redis.kill()
    redis.proc = None
    redis.start()


async def reconnect(s: Any) -> None:
    for _ in range(20):
        try:
            await s.chat(MESSAGES)
            return
        except polygate.GovernanceBackendError:
            await trio.sleep(0.1)
    raise AssertionError("never reconnected")


def test_voids_for_never_found_admissions_are_not_sent_once_per_exchange(redis: RedisServer) -> None:
    """While an abandoned admission can never be voided (its Redis lost it), the void
    loop is documented to retry on a timer 'from poll_s, doubling up to every second'.
    Busy, it must not resend every void after every successful exchange of the process."""

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        async with polygate.session(settings_for(redis), transport=up.transport()) as s:
            backend: Any = s._runtime.governor.backend
            assert (await s.chat(MESSAGES)).text
            await abandon_many(s, redis, 20)
            await reconnect(s)
            await trio.sleep(1.0)  # past the doubling: the timer is at its 1 s cap
            assert len(backend._abandoned) == 20
            command(redis.port, "CONFIG", "RESETSTAT")
            start = trio.current_time()
            calls = 0
            while trio.current_time() - start < 1.0:
                await s.chat(MESSAGES)
                calls += 1
            total = evalsha_calls(redis.port)
            voids = total - 2 * calls  # each call: one ADMIT, one SETTLE
            # On a 1 s timer: at most about 2 rounds of 20 voids in this second.
            assert voids <= 3 * 20, (calls, total, voids)

    trio.run(body)


def test_an_admission_cut_by_its_deadline_in_a_hung_redis_is_counted_as_voided(redis: RedisServer) -> None:
    """Third diff review (2026-12-03): a void sent into a hung Redis runs unseen.  An
    admission cut by the *call's* deadline left the backend 'healthy', so the void went
    straight into the hung Redis (no probe first).  Once Redis runs again, the permit must be gone and the statistics must say
    the admission was granted and voided (abandoned_voided == 1)."""

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        async with polygate.session(one_source(redis, timeout_s=0.5), transport=up.transport()) as s:
            backend: Any = s._runtime.governor.backend
            assert (await s.chat(MESSAGES)).text
            # hung longer than timeout_s: a void sent into it would be given up
            await abandon_one(s, redis, polygate.DeadlineExceeded, 1.5, call_deadline_s=0.1)
            await trio.sleep(1.5)
            stats = backend.statistics()
            assert await in_flight(s) == [0]
            assert stats.abandoned == 1
            assert stats.abandoned_voided == 1, stats
            assert not backend._abandoned, "still re-voiding an admission already voided"

    trio.run(body)


def test_idle_void_with_an_acl_user_that_may_not_ping(redis: RedisServer) -> None:
    """Third diff review (2026-12-03): a least-privilege ACL user with every command
    polygate used before the void loop's own timer, but not PING: the idle void never
    happened (each PING refused), and the phantom permit waited for its lease again.
    The loop's probe is one of polygate's own scripts."""

    async def body() -> None:
        reply = command(redis.port, "ACL", "SETUSER", "pg", "on", ">pg-pw", "~*", "&*", "+@all", "-ping")
        assert reply == b"+OK"
        up = FakeUpstream(Reply(tokens=2))
        settings = one_source(redis, f"redis://pg:pg-pw@127.0.0.1:{redis.port}/0", timeout_s=0.5)
        async with polygate.session(settings, transport=up.transport()) as idle:
            backend: Any = idle._runtime.governor.backend
            assert (await idle.chat(MESSAGES)).text
            await abandon_one(idle, redis, polygate.GovernanceBackendError)
            await trio.sleep(2.5)
            assert backend.statistics().abandoned_voided == 1

    trio.run(body)


def test_a_redis_stalled_longer_than_the_lease_leaves_no_phantom_permit(redis: RedisServer) -> None:
    """Fourth diff review (2026-12-03): an admission sent into a Redis that hangs for longer than lease_s runs when
    Redis resumes, with a lease counted from then (Redis TIME).  The entry was dropped
    while Redis was still down ('past its lease'), so nobody voids it: the only permit
    of the source is held by nobody for a whole lease after Redis's return, although
    the docs promise it is freed 'within about a second of Redis's return'."""

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        async with polygate.session(one_source(redis, lease_s=1.5), transport=up.transport()) as s:
            backend: Any = s._runtime.governor.backend
            assert (await s.chat(MESSAGES)).text
            await abandon_one(s, redis, polygate.GovernanceBackendError, 2.5)  # > lease_s
            assert len(backend._abandoned) == 1
            await trio.sleep(1.2)  # 'within about a second of Redis's return'
            held = await in_flight(s)
            assert held == [0], "the late-run admission holds the only permit, voided by nobody"

    trio.run(body)


def test_flapping_health_makes_a_busy_process_void_per_call(redis: RedisServer) -> None:
    """Fourth diff review (2026-12-03): one scope's keys are broken (a WRONGTYPE error, fast: unhealthy), another's
    work (healthy again): a process alternating between them flips _healthy on every
    call, and every flip wakes a void round at once.  The docs: 'a busy one sends no
    more voids than an idle one'."""

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        prefix = f"f{secrets.token_hex(3)}"
        settings = polygate.Settings(
            scopes={
                "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")]),
                "other": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1")]),
            },
            backend=f"{redis.url}?timeout_s=0.5&lease_s=30&prefix={prefix}",
        )
        async with polygate.session(settings, transport=up.transport()) as s:
            backend: Any = s._runtime.governor.backend
            assert (await s.chat(MESSAGES)).text
            await abandon_many(s, redis, 20)
            await reconnect(s)
            # break scope "other"'s keys: a key of the wrong type
            for suffix in ("state", "window", "wtok", "open", "permits"):
                command(redis.port, "SET", f"{prefix}:other:b:{suffix}", "x")
            with pytest.raises(polygate.GovernanceBackendError):
                await s.chat(MESSAGES, scope="other")
            await trio.sleep(2.0)
            assert len(backend._abandoned) == 20
            command(redis.port, "CONFIG", "RESETSTAT")
            start, good, bad = trio.current_time(), 0, 0
            while trio.current_time() - start < 2.0:
                await s.chat(MESSAGES)
                good += 1
                try:
                    await s.chat(MESSAGES, scope="other")
                except polygate.GovernanceBackendError:
                    bad += 1
            took = trio.current_time() - start
            total = evalsha_calls(redis.port)
            extra = total - 2 * good - bad
            assert extra / took <= 2 * 21 + 5

    trio.run(body)


@pytest.mark.parametrize("stall", [0.4, 1.0, 1.6, 2.2])
def test_close_right_after_redis_resumes_leaves_no_phantom_permit(redis: RedisServer, stall: float) -> None:
    """Fourth diff review (2026-12-03): Redis comes back and the session closes at once (a void round racing close):
    the admission that ran late is either voided by close or by the round, never left
    to its lease (settle_left settles open admissions the same way)."""

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        settings = one_source(redis, lease_s=15)
        s_cm = polygate.session(settings, transport=up.transport())
        s = await s_cm.__aenter__()
        try:
            assert (await s.chat(MESSAGES)).text
            await abandon_one(s, redis, polygate.GovernanceBackendError, stall)
        finally:
            start = trio.current_time()
            await s_cm.__aexit__(None, None, None)
            took = trio.current_time() - start
        assert took < 1.5
        # another process, same prefix: is the only permit free?
        async with polygate.session(settings, transport=up.transport()) as other:
            held = await in_flight(other)
        assert held == [0]

    trio.run(body)


def two_scopes(redis: RedisServer, max_in_flight: int = 1, **options: Any) -> polygate.Settings:
    query = "&".join(f"{k}={v}" for k, v in
                     {"timeout_s": 0.3, "prefix": f"r{secrets.token_hex(3)}", **options}.items())
    return polygate.Settings(
        scopes={
            "chat": polygate.Scope(sources=[
                polygate.Source(name="a", base_url="http://a/v1", max_in_flight=max_in_flight)]),
            "other": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1")]),
        },
        backend=f"{redis.url}?{query}",
    )


async def abandon(s: Any, n: int, **chat: Any) -> None:
    async def one() -> None:
        with pytest.raises((polygate.GovernanceBackendError, polygate.DeadlineExceeded)):
            await s.chat(MESSAGES, **chat)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def held_in_redis(url: str) -> int:
    """in_flight of chat/a as another process sees it."""
    from polygate.governance._redis import RedisBackend, parse_redis_url

    backend = RedisBackend(parse_redis_url(url))
    await backend.start()
    try:
        return (await backend.snapshot("chat", "a")).in_flight
    finally:
        await backend.aclose()


@pytest.mark.parametrize("n", [0, 1, 50])
def test_close_while_redis_hangs_with_abandoned_admissions(redis: RedisServer, n: int) -> None:
    """Fifth diff review (2026-12-03): Redis hangs; calls cut by their deadline leave
    abandoned admissions; the application shuts down (still hung).  The close's last
    void round, and the void loop's probe, each waited a whole timeout_s (4 s) into
    the hung Redis; a close is bounded by its freeze (1 s) and short probes."""

    async def body() -> float:
        up = FakeUpstream(Reply(tokens=2))
        async with polygate.session(two_scopes(redis, max_in_flight=100, timeout_s=4),
                                    transport=up.transport()) as s:
            backend: Any = s._runtime.governor.backend
            assert (await s.chat(MESSAGES)).text
            assert redis.proc is not None
            redis.proc.send_signal(signal.SIGSTOP)
            await abandon(s, n, call_deadline_s=0.2)
            assert len(backend._abandoned) == n
            start = trio.current_time()
        return trio.current_time() - start

    try:
        took = trio.run(body)
    finally:
        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGCONT)
    assert took < 2.0, f"close took {took:.2f} s with Redis hung (freeze bound 1 s; timeout_s=4)"


@pytest.mark.parametrize("stall", [0.5, 1.0])
def test_statistics_after_close_agree_with_the_permits_the_close_voided(redis: RedisServer, stall: float) -> None:
    """Fifth diff review (2026-12-03): an abandoned admission that ran late (Redis was
    hung) was voided by the close after the session froze its figures, so
    ``statistics()`` after the close still counted its permit.  The void runs before
    the freeze, as settle_left does."""

    async def body() -> tuple[int, int, Any]:
        up = FakeUpstream(Reply(tokens=2))
        settings = two_scopes(redis, lease_s=15)
        assert settings.backend is not None
        url = settings.backend
        async with polygate.session(settings, transport=up.transport()) as s:
            backend: Any = s._runtime.governor.backend
            assert (await s.chat(MESSAGES)).text
            assert redis.proc is not None
            redis.proc.send_signal(signal.SIGSTOP)
            try:
                await abandon(s, 1)
                await trio.sleep(stall)
            finally:
                redis.proc.send_signal(signal.SIGCONT)
            # the block ends at once: the close races the void loop's next round
        after = await s.statistics()
        reported = sum(src.state.in_flight for src in after.governance.sources if src.state.source == "a")
        return reported, await held_in_redis(url), backend.statistics()

    reported, held, stats = trio.run(body)
    assert held == 0, ("the late admission's permit is still held", stats)
    assert reported == held, (
        f"statistics() after the close says in_flight={reported}, Redis holds {held} "
        f"(voided by the close after the figures were frozen; {stats})")


class _DelayProxy:
    """A TCP proxy to Redis that delays every reply by ``delay`` seconds."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.delay = 0.0
        self.listen_port = 0

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.listen_port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", self.port)
        try:
            await self._relay(client, server)
        finally:
            with trio.CancelScope(shield=True):  # (closing a socket does not wait)
                await server.aclose()
                await client.aclose()

    async def _relay(self, client: trio.SocketStream, server: trio.SocketStream) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](10_000)
        gone = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

        async with trio.open_nursery() as nursery:
            async def up() -> None:
                try:
                    while data := await client.receive_some(65536):
                        await server.send_all(data)
                except gone:
                    pass
                nursery.cancel_scope.cancel()

            async def down_read() -> None:
                try:
                    while data := await server.receive_some(65536):
                        await send.send((trio.current_time() + self.delay, data))
                except gone:
                    pass
                nursery.cancel_scope.cancel()

            async def down_write() -> None:
                try:
                    async for at, data in recv:
                        await trio.sleep_until(at)
                        await client.send_all(data)
                except gone:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(up)
            nursery.start_soon(down_read)
            nursery.start_soon(down_write)


def test_a_slow_but_alive_redis_still_gets_its_abandoned_admission_voided(
    redis: RedisServer,
) -> None:
    """Sixth diff review (2026-12-03): with Redis answering in 0.3 s (timeout_s=1:
    every exchange succeeds), a call cut by its own deadline (0.15 s) left an
    admission that ran; the void loop's probe, bounded at 0.25 s, never succeeded, so
    the permit was held by nobody for its lease.  The probe has the whole timeout_s
    (unshielded: it would not hold a close)."""

    async def body() -> int:
        proxy = _DelayProxy(redis.port)
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.serve)
            prefix = f"s{secrets.token_hex(3)}"
            settings = polygate.Settings(
                scopes={"chat": polygate.Scope(sources=[
                    polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)])},
                backend=f"redis://127.0.0.1:{proxy.listen_port}/0?timeout_s=1&prefix={prefix}",
            )
            up = FakeUpstream(Reply(tokens=2))
            async with polygate.session(settings, transport=up.transport()) as s:
                backend: Any = s._runtime.governor.backend
                assert (await s.chat(MESSAGES)).text
                proxy.delay = 0.3
                with pytest.raises((polygate.GovernanceBackendError, polygate.DeadlineExceeded)):
                    await s.chat(MESSAGES, call_deadline_s=0.15)
                assert len(backend._abandoned) == 1
                await trio.sleep(3.0)  # the void loop: poll_s, doubling to 1 s
                held = await held_in_redis(f"redis://127.0.0.1:{redis.port}/0?prefix={prefix}")
            nursery.cancel_scope.cancel()
        return held

    assert trio.run(body) == 0
