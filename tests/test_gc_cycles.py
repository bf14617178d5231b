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
import gc
import itertools
import json
import random
import types
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import h11
import pytest
import trio
import trio.testing

import polygate
import polygate.aio
from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply, Router

N = 8
MESSAGES = [{"role": "user", "content": "hello there"}]
NOBREAK = polygate.Breaker(failures=10**9)
BAD = {"error": {"message": "bad request", "code": "x"}}


@contextmanager
def _collector_off() -> Iterator[list[Any]]:
    """The objects only the cyclic collector would have freed, made in the block."""
    gc.collect()
    found: list[Any] = []
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found += gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


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
}


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
        with _collector_off() as garbage:
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
            with _collector_off() as garbage:
                for _ in range(N):
                    await call(s)
        return garbage

    garbage = asyncio.run(main())
    assert not garbage, f"{kind}: {len(garbage) / N:.0f} objects a call: {_described(garbage)}"


# ------------------------------------------------------------------ polygate serve

KEY = "sk-gw-gc-0123456789"


async def _post(port: int, body: dict[str, Any]) -> int:
    """One request on its own connection, read to its end: the answer's status."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-length: {len(data)}\r\n"
            f"content-type: application/json\r\nauthorization: Bearer {KEY}\r\n\r\n")
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "gw")]))
    status = 0
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(head.encode() + data)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status


@pytest.mark.parametrize(("status", "answer"), [(400, 400), (500, 502)])
async def test_a_gateway_error_answer_leaves_nothing_to_collect(status: int, answer: int) -> None:
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                                       breaker=NOBREAK, retry=polygate.Retry(max_attempts=1))},
        serve=polygate.Serve(api_keys=[KEY]), telemetry="off")
    up = FakeUpstream(Reply(status=status, error_body=BAD))
    body = {"model": "chat", "messages": MESSAGES}
    async with open_server(settings, port=0, transport=up.transport()) as server:

        async def requests(n: int) -> None:
            for _ in range(n):
                assert await _post(server.port, body) == answer
            # The server's side of each request has ended (its connection's task saw
            # the client's close), not only the answer's bytes.
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)

        await requests(3)
        with _collector_off() as garbage:
            await requests(N)
    assert not garbage, f"{len(garbage) / N:.0f} objects a request: {_described(garbage)}"
