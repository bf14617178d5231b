"""No call leaves garbage for the cyclic collector.

Python frees an object at once when its last reference goes, unless it is in a
reference cycle: then only the cyclic collector frees it, in passes that stop the
event loop (a full one took ~300 ms at gateway load) and keep whatever the cycle holds
(the request, the answer) alive until then.  An outside look found every failed
attempt in a cycle (its error's traceback held the frames whose locals led back to
it), also of calls that then succeeded, so a gateway behind 429s spent 38-40 % of its
time in the collector; every error a call raised in one with the call's frames; a
failed embed's error in one with its own group; a stream's failure in one with the
stream; and every ``polygate.aio`` stream, failed or not, in one with its job.

Each test runs a kind of call a few times to warm up, then ``N`` more with the
collector off and ``gc.DEBUG_SAVEALL``, and asserts a collection finds nothing.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import random
import sys
import traceback
import types
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import polygate
import polygate.aio
from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply, Router

from ._collector import collector_off

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

N = 8
MESSAGES = [{"role": "user", "content": "hello there"}]
NOBREAK = polygate.Breaker(failures=10**9)
BAD = {"error": {"message": "bad request", "code": "x"}}


def _described(objects: list[Any]) -> str:
    def name(o: Any) -> str:
        if isinstance(o, types.FrameType):
            return f"frame {o.f_code.co_filename.rsplit('/', 1)[-1]}:{o.f_code.co_name}"
        return f"{type(o).__module__}.{type(o).__qualname__}"
    return ", ".join(f"{n} {k}" for k, n in collections.Counter(map(name, objects)).most_common(12))


def _settings(sources: int = 1, **scope: Any) -> polygate.Settings:
    scope.setdefault("breaker", NOBREAK)
    chosen = [polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
              polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)][:sources]
    return polygate.Settings(scopes={
        "chat": polygate.Scope(sources=chosen, **scope),
        "embed": polygate.Scope(sources=chosen, embed_batch_size=1, **scope),
    })


def _cycling(*replies: Reply) -> Callable[[Any, Any], Reply]:
    it = itertools.cycle(replies)
    return lambda request, rng: next(it)


async def _stream_all(s: Any) -> None:
    async with s.stream_chat(MESSAGES) as stream:
        async for _ in stream:
            pass


async def _stream_a_little(s: Any) -> None:
    async with s.stream_chat(MESSAGES) as stream:
        async for chunk in stream:
            if chunk.text:
                break


def _failing(kind: type[BaseException], call: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[None]]:
    async def failing(s: Any) -> None:
        with pytest.raises(kind):
            await call(s)
    return failing


def _chat(s: Any) -> Awaitable[Any]:
    return s.chat(MESSAGES)


RETRY = polygate.Retry(max_attempts=3, backoff_base_s=0.01)

#: name: (settings, the upstreams (one, or a Router's), the call)
TRIO_KINDS: dict[str, Callable[[], tuple[polygate.Settings, Any, Callable[[Any], Awaitable[Any]]]]] = {
    "chat": lambda: (_settings(), FakeUpstream(Reply(tokens=5)), _chat),
    "stream": lambda: (_settings(), FakeUpstream(Reply(tokens=5)), _stream_all),
    "retried after a 500 and a 429": lambda: (
        _settings(retry=RETRY),
        FakeUpstream(_cycling(Reply(status=500), Reply(status=429, retry_after_s=0.1), Reply(tokens=5))),
        _chat),
    "failed over after a 500": lambda: (
        _settings(2, retry=RETRY),
        Router({"a": FakeUpstream(Reply(status=500)), "b": FakeUpstream(Reply(tokens=5))}),
        _chat),
    "a hedge's loser failed": lambda: (
        _settings(2, hedge=polygate.Hedge(after_s=1)),
        Router({"a": FakeUpstream(Reply(first_token_s=5, tokens=4)),
                "b": FakeUpstream(Reply(first_token_s=0.5, status=500))}),
        _stream_all),
    "a stream resumed elsewhere": lambda: (
        _settings(2, stream=polygate.StreamWatch(resume=True)),
        Router({"a": FakeUpstream(Reply(text="one two three four five six", fault="truncated",
                                        fault_after=3)),
                "b": FakeUpstream(Reply(text=" three four five six"))}),
        _stream_all),
    "exhausted": lambda: (
        _settings(retry=RETRY), FakeUpstream(Reply(status=500)),
        _failing(polygate.AllSourcesExhausted, _chat)),
    "fatal": lambda: (
        _settings(), FakeUpstream(Reply(status=400, error_body=BAD)),
        _failing(polygate.FatalUpstreamError, _chat)),
    "a stream exhausted": lambda: (
        _settings(retry=RETRY), FakeUpstream(Reply(status=500)),
        _failing(polygate.AllSourcesExhausted, _stream_all)),
    "a stream past its deadline": lambda: (
        _settings(), FakeUpstream(Reply(tokens=50, inter_token_s=1)),
        _failing(polygate.DeadlineExceeded,
                 lambda s: _stream_all_within(s, 5))),
    "a stream cut after its commit": lambda: (
        _settings(retry=polygate.Retry(max_attempts=1)),
        FakeUpstream(Reply(tokens=20, fault="truncated", fault_after=5)),
        _failing(polygate.TransientUpstreamError, _stream_all)),
    "a failed embed": lambda: (
        _settings(retry=polygate.Retry(max_attempts=1)),
        FakeUpstream(Reply(status=400, error_body=BAD)),
        _failing(polygate.FatalUpstreamError, lambda s: s.embed(["one", "two", "three"], scope="embed"))),
    # (Review: a cancelled embed's Cancelled, raised from a frame that held it.)
    "an embed cut by its caller": lambda: (
        _settings(), FakeUpstream(Reply(first_token_s=5)),
        lambda s: _cut_after(1, s.embed(["one", "two", "three"], scope="embed"))),
    "a cached embed cut by its caller": lambda: (
        _cached(_settings()), FakeUpstream(Reply(first_token_s=5)),
        lambda s: _cut_after(1, s.embed(["one", "two", "three"], scope="embed"))),
    # (The cache's embed: its closures named each other, a cycle every call, hits too.)
    "a cached embed": lambda: (
        _cached(_settings()), FakeUpstream(Reply()),
        lambda s: s.embed(["one", "two", "three"], scope="embed")),
    "a failed cached embed": lambda: (
        _cached(_settings(retry=polygate.Retry(max_attempts=1))),
        FakeUpstream(Reply(status=400, error_body=BAD)),
        _failing(polygate.FatalUpstreamError, lambda s: s.embed(["one", "two"], scope="embed"))),
}


async def _cut_after(seconds: float, call: Awaitable[Any]) -> None:
    with trio.move_on_after(seconds) as scope:
        await call
    assert scope.cancelled_caught


def _cached(settings: polygate.Settings) -> polygate.Settings:
    return attrs.evolve(settings, cache="memory", scopes={
        name: attrs.evolve(scope, cache_ttl_s=3600) for name, scope in settings.scopes.items()})


async def _stream_all_within(s: Any, deadline_s: float) -> None:
    async with s.stream_chat(MESSAGES, call_deadline_s=deadline_s) as stream:
        async for _ in stream:
            pass


@pytest.mark.parametrize("kind", sorted(TRIO_KINDS))
async def test_a_trio_call_leaves_nothing_to_collect(
    kind: str, autojump_clock: trio.testing.MockClock
) -> None:
    settings, upstream, call = TRIO_KINDS[kind]()
    transport = upstream if isinstance(upstream, Router) else upstream.transport()
    async with polygate.session(settings, transport=transport, rng=random.Random(0)) as s:
        for _ in range(3):
            await call(s)
        with collector_off() as garbage:
            for _ in range(N):
                await call(s)
    assert not garbage, f"{kind}: {len(garbage) / N:.0f} objects a call: {_described(garbage)}"


async def test_a_callers_own_handled_exception_is_not_cut_from_its_frames(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The error leaves a call without polygate's frames, but an exception the caller was
    handling as it called (the error's context) keeps its own."""
    up = FakeUpstream(Reply(status=400, error_body=BAD))
    async with polygate.session(_settings(), transport=up.transport()) as s:
        try:
            raise KeyError("the caller's own")
        except KeyError as mine:
            with pytest.raises(polygate.FatalUpstreamError) as info:
                await s.chat(MESSAGES)
            context, kept = info.value.__context__, mine.__traceback__
    assert isinstance(context, KeyError)
    assert kept is not None


async def test_two_readers_of_a_failed_stream_never_raise_one_object(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a reader woken by the channel's close could run first and raise the
    error itself, and the reader that took the failure from the channel raised it too:
    one object raised by two tasks, its traceback collecting both.  (The two readers'
    order is trio's scheduler's, which varies: many rounds.)"""
    up = FakeUpstream(Reply(status=500, first_token_s=1))
    async with polygate.session(_settings(retry=polygate.Retry(max_attempts=1)),
                                transport=up.transport()) as s:
        for _ in range(40):
            got: list[BaseException] = []
            async with s.stream_chat(MESSAGES) as stream:

                async def read(
                    stream: polygate.ChatStream = stream, got: list[BaseException] = got,
                ) -> None:
                    try:
                        async for _ in stream:
                            pass
                    except polygate.AllSourcesExhausted as exc:
                        got.append(exc)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    nursery.start_soon(read)
            first, second = got
            assert first is not second
            assert type(first) is type(second) and str(first) == str(second)


async def test_a_bug_beside_the_error_keeps_its_frames(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: the call's error leaves without polygate's frames, and so did a bug in a
    sibling branch riding along in its cause's group: where that bug happened is what
    its reader needs."""
    import polygate._call

    original = polygate._call.run_embed_attempt

    def clean_up_with_a_bug() -> None:
        raise RuntimeError("a bug in a branch's clean-up")

    async def attempt(ctx: Any, admission: Any, control: Any, batch: list[str]) -> Any:
        if batch == ["two"]:
            try:
                await trio.sleep(10)
            except trio.Cancelled:
                clean_up_with_a_bug()
        return await original(ctx, admission, control, batch)

    monkeypatch.setattr(polygate._call, "run_embed_attempt", attempt)
    up = FakeUpstream(Reply(status=400, error_body=BAD))
    async with polygate.session(_settings(retry=polygate.Retry(max_attempts=1)),
                                transport=up.transport()) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.embed(["one", "two"], scope="embed")
    assert info.value.__traceback__ is not None
    cause = info.value.__cause__
    assert isinstance(cause, BaseExceptionGroup)
    (bug,) = cause.exceptions
    assert isinstance(bug, RuntimeError)
    assert "clean_up_with_a_bug" in [frame.name for frame in traceback.extract_tb(bug.__traceback__)]


# ------------------------------------------------------------------ polygate.aio

AIO_KINDS: dict[str, tuple[Reply, Callable[[Any], Awaitable[Any]]]] = {
    "chat": (Reply(tokens=5), _chat),
    "stream": (Reply(tokens=5), _stream_all),
    "a stream left early": (Reply(tokens=50, inter_token_s=0.001), _stream_a_little),
    "fatal": (Reply(status=400, error_body=BAD), _failing(polygate.FatalUpstreamError, _chat)),
    "a fatal stream": (Reply(status=400, error_body=BAD),
                       _failing(polygate.FatalUpstreamError, _stream_all)),
}


@pytest.mark.parametrize("kind", sorted(AIO_KINDS))
def test_an_asyncio_call_leaves_nothing_to_collect(kind: str) -> None:
    reply, call = AIO_KINDS[kind]

    async def main() -> list[Any]:
        async with polygate.aio.session(_settings(), transport=FakeUpstream(reply).transport()) as s:
            for _ in range(3):
                await call(s)
            with collector_off() as garbage:
                for _ in range(N):
                    await call(s)
        return garbage

    garbage = asyncio.run(main())
    assert not garbage, f"{kind}: {len(garbage) / N:.0f} objects a call: {_described(garbage)}"


# ------------------------------------------------------------------ polygate serve

KEY = "sk-gw-gc-0123456789"


async def _post(port: int, body: dict[str, Any]) -> bytes:
    """One request on a connection it closes: the whole answer, as the server closes."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: {len(data)}\r\n"
            f"content-type: application/json\r\nauthorization: Bearer {KEY}\r\n"
            "connection: close\r\n\r\n")
    got = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(head.encode() + data)
        while chunk := await stream.receive_some(65536):
            got += chunk
    return got


GATEWAY_KINDS = {
    "a 400": (Reply(status=400, error_body=BAD), False, b"400"),
    "a 500": (Reply(status=500), False, b"502"),
    "a stream's 400 before its commit": (Reply(status=400, error_body=BAD), True, b"400"),
    "a stream cut after its commit": (Reply(tokens=20, fault="truncated", fault_after=5), True,
                                      b"200"),
    "a stream's error event": (Reply(tokens=20, fault="error_event", fault_after=5), True, b"200"),
}


#: CPython 3.10's ``contextlib`` leaves an exception thrown through a
#: ``@contextmanager``'s ``__exit__`` in a cycle with that frame (3.11 breaks it).
#: Closing httpx's ``aiter_raw`` mid-body (a stream cut by an error event, through a
#: caller's transport) throws ``GeneratorExit`` through its ``request_context``: one
#: cycle a request there, the interpreter's, which the collector frees.
_CONTEXTLIB_310 = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="CPython 3.10's contextlib leaves a cycle per closed aiter_raw")


@pytest.mark.parametrize("kind", [
    pytest.param(kind, marks=_CONTEXTLIB_310) if kind == "a stream's error event" else kind
    for kind in sorted(GATEWAY_KINDS)
])
async def test_a_gateway_error_answer_leaves_nothing_to_collect(kind: str) -> None:
    reply, streamed, answer = GATEWAY_KINDS[kind]
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                                       breaker=NOBREAK, retry=polygate.Retry(max_attempts=1))},
        serve=polygate.Serve(api_keys=[KEY]), telemetry="off")
    up = FakeUpstream(reply)
    body = {"model": "chat", "messages": MESSAGES, "stream": streamed}
    async with open_server(settings, port=0, transport=up.transport()) as server:

        async def requests(n: int) -> None:
            for _ in range(n):
                got = await _post(server.port, body)
                assert got.startswith(b"HTTP/1.1 " + answer), got[:200]
                if answer == b"200":
                    assert b'"error"' in got, got[-300:]  # the stream's error event
            # The server's side of each request has ended (its connection's task saw
            # the client's close), not only the answer's bytes.
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)

        await requests(3)
        with collector_off() as garbage:
            await requests(N)
    assert not garbage, f"{len(garbage) / N:.0f} objects a request: {_described(garbage)}"
