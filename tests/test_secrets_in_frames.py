"""No secret in the frames of an error a caller gets.

A crash reporter records the locals of every frame of an error's traceback, and of
every exception chained to it (Sentry does by default; so does
``traceback.TracebackException(capture_locals=True)``), each as its ``repr``.  The
messages were clean, but the frames were not (an outside review): the frames that
read an upstream's error body that echoed the key held it (``payload``, ``excerpt``,
an SSE event's ``data``), the exchange's held the request with its ``authorization``
header, the telemetry opening's held the PostgreSQL URL with its password (``url``),
and the Redis driver's frames, chained as the cause, its ``creds``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate._secrets import frameless
from polygate.testing import FakeUpstream, Reply, Router

from ._postgres_server import postgres_server
from ._redis_server import RedisServer, command, need_redis, running_redis

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

SECRET = "sk-SECRETKEY-abcdef0123456789"
ECHO = {"error": {"message": f"Incorrect API key provided: {SECRET}", "code": "invalid_api_key"}}
MESSAGES = [{"role": "user", "content": "hi"}]
TESTS = Path(__file__).parent


def _in_frames(error: BaseException, secret: str) -> list[str]:
    """Every local, in every frame of the error and of the exceptions chained to it
    (cause, context, a group's members), whose ``repr`` shows ``secret``; the test
    modules' own frames aside."""
    found: list[str] = []
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        todo += [exc.__cause__, exc.__context__, *getattr(exc, "exceptions", ())]
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            file = Path(frame.f_code.co_filename)
            if not (file.parent == TESTS and file.name.startswith("test_")):
                found += [f"{type(exc).__name__} {frame.f_code.co_name}: {name}"
                          for name, value in frame.f_locals.items() if secret in repr(value)]
            tb = tb.tb_next
    return found


def _requests_in_frames(error: BaseException) -> list[str]:
    """The frames that hold the request (itself or through its response): its
    headers carry the key, though its ``repr`` does not show them."""
    found = []
    tb = error.__traceback__
    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            request = value if isinstance(value, httpx.Request) else (
                value._request if isinstance(value, httpx.Response) else None)
            if request is not None and SECRET in request.headers.get("authorization", ""):
                found.append(f"{tb.tb_frame.f_code.co_name}: {name}")
        tb = tb.tb_next
    return found


def _settings(**source: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, **source)],
        retry=polygate.Retry(max_attempts=1),
    )})


async def _ask(s: polygate.Session, streamed: bool) -> None:
    if streamed:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    else:
        await s.chat(MESSAGES)


@pytest.mark.parametrize("status", [400, 422])
@pytest.mark.parametrize("streamed", [False, True])
async def test_an_echoed_key_is_in_no_frame_of_a_fatal_error(
    status: int, streamed: bool, autojump_clock: trio.testing.MockClock
) -> None:
    up = FakeUpstream(Reply(status=status, error_body=ECHO))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await _ask(s, streamed)
    assert SECRET not in str(info.value)
    assert not _in_frames(info.value, SECRET)
    assert not _requests_in_frames(info.value)


@pytest.mark.parametrize("status", [401, 429, 500])
async def test_an_echoed_key_is_in_no_frame_of_an_attempts_error(
    status: int, autojump_clock: trio.testing.MockClock
) -> None:
    up = FakeUpstream(Reply(status=status, error_body=ECHO,
                            retry_after_s=1000 if status == 429 else None))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES, call_deadline_s=5)
    assert not _in_frames(info.value, SECRET)
    (error,) = info.value.errors
    assert SECRET not in str(error)
    assert not _in_frames(error, SECRET)
    assert not _requests_in_frames(error)


def _error_event(request: httpx.Request) -> httpx.Response:
    body = ('data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
            '"delta":{"role":"assistant","content":"hello"}}]}\n\n'
            "data: " + json.dumps({"error": {"message": f"upstream broke, key {SECRET}",
                                             "code": 400}}) + "\n\n")
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=body.encode())


async def test_an_echoed_key_is_in_no_frame_of_a_committed_streams_error(
    autojump_clock: trio.testing.MockClock
) -> None:
    async with polygate.session(_settings(), transport=httpx.MockTransport(_error_event)) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
    assert info.value.text == "hello" and SECRET not in str(info.value)
    assert not _in_frames(info.value, SECRET)


@pytest.mark.integration
async def test_over_a_real_socket_too() -> None:
    """The default transport (no httpx.Request is built) against a loopback server."""
    up = FakeUpstream(Reply(status=400, error_body=ECHO))
    async with up.serve() as base_url:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=base_url, api_key=SECRET)])})
        async with polygate.session(settings) as s:
            with pytest.raises(polygate.FatalUpstreamError) as info:
                await s.chat(MESSAGES)
    assert SECRET not in str(info.value)
    assert not _in_frames(info.value, SECRET)


async def test_a_failed_exchange_holds_no_request_in_its_frames(
    autojump_clock: trio.testing.MockClock
) -> None:
    up = FakeUpstream(Reply(fault="reset", fault_after=1))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    (error,) = info.value.errors
    assert not _requests_in_frames(error)
    assert not _in_frames(info.value, SECRET)


@pytest.mark.integration
async def test_a_refused_telemetry_password_is_in_no_frame() -> None:
    wrong = "WRONG-pg-pw-1234xyz"
    with postgres_server("pg-SECRET-pw-4242") as pg:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[
                polygate.Source(name="a", base_url="http://a/v1", api_key="sk-abcdefgh")])},
            telemetry=pg.url(password=wrong))
        with pytest.raises(polygate.ConfigError) as info:
            async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})):
                pass
    assert wrong not in str(info.value)
    assert not _in_frames(info.value, wrong)


@pytest.mark.integration
async def test_a_refused_redis_password_is_in_no_frame() -> None:
    wrong = "WRONG-redis-pw-5150"
    server: RedisServer
    with running_redis(need_redis()) as server:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[
                polygate.Source(name="a", base_url="http://a/v1", api_key="sk-abcdefgh")])},
            backend=f"redis://alice:{wrong}@127.0.0.1:{server.port}/0")
        with pytest.raises(polygate.GovernanceBackendError) as info:
            async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})):
                pass
    assert wrong not in str(info.value)
    assert not _in_frames(info.value, wrong)


# --------------------------------------------------------------------------- the caller's own


class Mine(Exception):
    pass


def _raise_mine() -> None:
    raise Mine("the caller's own error")


@pytest.mark.parametrize("streamed", [False, True])
async def test_the_callers_handled_exception_keeps_its_frames(
    streamed: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """Review of the fix: a call made while the caller handles an exception has that
    exception as its error's context, and clearing the chain's frames cleared the
    caller's too (a later bare ``raise`` or ``log.exception`` lost them)."""
    up = FakeUpstream(Reply(status=400, error_body=ECHO))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        try:
            _raise_mine()
        except Mine as mine:
            with pytest.raises(polygate.FatalUpstreamError) as info:
                await _ask(s, streamed)
            kept = mine.__traceback__
    assert kept is not None
    assert SECRET not in str(info.value)


@pytest.mark.integration
async def test_the_callers_handled_exception_keeps_its_frames_through_redis() -> None:
    with running_redis(need_redis()) as server:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])},
            backend=f"{server.url}?timeout_s=0.5&prefix=mine")
        async with polygate.session(settings, transport=FakeUpstream(Reply()).transport()) as s:
            await s.chat(MESSAGES)
            command(server.port, "HSET", "mine:chat:a:state", "rt", "junk")  # (an error reply)
            try:
                _raise_mine()
            except Mine as mine:
                with pytest.raises(polygate.GovernanceBackendError):
                    await s.chat(MESSAGES)
                kept = mine.__traceback__
        assert kept is not None


class _Odd(Exception):
    """Another library's error naming its parts in an ``exceptions`` that holds no
    exceptions."""

    def __init__(self) -> None:
        super().__init__("odd")
        self.exceptions = {"db": "timed out"}


def test_frameless_follows_groups_only_and_stops_at_the_callers() -> None:
    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:
            return caught

    odd = raised(_Odd())
    member = raised(ValueError("member"))
    group = raised(ExceptionGroup("g", [member]))
    mine = raised(Mine("mine"))
    error = raised(RuntimeError("ours"))
    error.__cause__, error.__context__ = group, odd
    odd.__context__ = mine
    assert frameless(error, handled=mine) is error
    assert error.__traceback__ is None and group.__traceback__ is None
    assert member.__traceback__ is None and odd.__traceback__ is None
    assert mine.__traceback__ is not None  # the caller's: left as it was


async def test_an_odd_exceptions_attribute_in_the_callers_chain_is_no_crash(
    autojump_clock: trio.testing.MockClock
) -> None:
    up = FakeUpstream(Reply(status=400, error_body=ECHO))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        try:
            raise _Odd()
        except _Odd:
            with pytest.raises(polygate.FatalUpstreamError):
                await s.chat(MESSAGES)


# --------------------------------------------------------------------------- cancellations


@pytest.mark.integration
@pytest.mark.parametrize("embed", [False, True])
async def test_the_callers_fail_after_shows_no_key_in_the_cancellations_frames(embed: bool) -> None:
    """Outside review (frames): a caller's own ``trio.fail_after`` around a call gives a
    TooSlowError whose context (not suppressed: a reporter walks it) is the Cancelled
    that unwound the call; its frames ran down into the transport, whose locals held the
    request's bytes and headers, ``Bearer <key>`` in them."""
    import traceback

    async with FakeUpstream(Reply(headers_delay_s=30)).serve() as url:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=url, api_key=SECRET)])})
        async with polygate.session(settings) as s:
            with pytest.raises(trio.TooSlowError) as info:
                with trio.fail_after(0.3):
                    if embed:
                        await s.embed(["x"], scope="chat")
                    else:
                        await s.chat(MESSAGES)
    assert isinstance(info.value.__context__, trio.Cancelled)
    assert not _in_frames(info.value, SECRET)
    shown = "".join(traceback.TracebackException.from_exception(
        info.value, capture_locals=True).format())
    assert SECRET not in shown


@pytest.mark.integration
async def test_a_telemetry_opening_cut_by_the_caller_shows_no_password() -> None:
    """The same for an opening the caller's bound cuts: the frames that opened the
    telemetry database held its URL, password and all."""
    import socket

    password = "pg-CUT-pw-98765"
    with socket.socket() as listener:  # accepts (the kernel does), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[
                polygate.Source(name="a", base_url="http://a/v1", api_key="sk-abcdefgh")])},
            telemetry=f"postgresql://u:{password}@127.0.0.1:{port}/db")
        with pytest.raises(trio.TooSlowError) as info:
            with trio.fail_after(0.5):
                async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})):
                    pass
    assert not _in_frames(info.value, password)
