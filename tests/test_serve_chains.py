"""Gateways in a chain, and loops (outside review, 2026-12-06: "gateways in a chain").

A gateway whose source pointed back at itself turned one request into ~1,000 nested
ones within 2 s: 2,057 descriptors, every other client refused with 503 for the
while, and a 504 (or after 65 s a 429) that said nothing of a loop.  Now each call a
gateway makes names it in ``Via``, and a request that comes back to it is refused
with 508 ``loop_detected``: the library takes the source that sent it out (dead, as
a 401: its route leads back, and no client can forge a gateway's name, which only
its upstreams see), and a call whose every source looped is answered 508 in turn.  A
chain too long (eight names, which a client can make up) is ``too_many_hops``:
fatal to that call alone.

Real loopback servers, real clock, generous margins."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import polygate
from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply

from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, http, wait_for

pytestmark = pytest.mark.integration


def _scopes(**sources: str) -> dict[str, polygate.Scope]:
    return {
        scope: polygate.Scope(sources=[polygate.Source(
            name=f"{scope}-src", base_url=url, api_key=GATEWAY_KEY, model="chat")])
        for scope, url in sources.items()
    }


def _requests(server: Any) -> int:
    return sum(server.metrics.requests.values())


def _statuses(server: Any) -> dict[int, int]:
    counted: dict[int, int] = {}
    for (_, status), n in server.metrics.requests.items():
        counted[status] = counted.get(status, 0) + n
    return counted


def _settings(scopes: dict[str, polygate.Scope], **serve: Any) -> polygate.Settings:
    return polygate.Settings(scopes=scopes, serve=polygate.Serve(api_keys=[GATEWAY_KEY], **serve))


async def test_a_gateway_whose_source_is_itself_refuses_the_second_pass_at_once() -> None:
    upstream = FakeUpstream(Reply(text="fine"))
    async with upstream.serve() as good, open_server(
            _settings(_scopes(chat="http://127.0.0.1:9/v1", good=good)), port=0) as server:
        # The operator's typo: the gateway's own URL as the source of scope "chat".
        await server.reload(_settings(_scopes(chat=server.base_url, good=good)))
        with trio.fail_after(10):
            looped = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert looped.status == 508, looped
        assert looped.headers["x-should-retry"] == "false"
        error = looped.json()["error"]
        assert error["code"] == "loop_detected"
        assert "passed through this gateway" in error["message"]
        # One request went round once: the call, and the one request it sent back.
        await wait_for(lambda: _requests(server) >= 2)
        assert _statuses(server) == {508: 2}
        # The looping source is dead now: the next call does not go round at all.
        again = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert again.status == 502 and "dead" in again.json()["error"]["message"]
        await wait_for(lambda: _requests(server) >= 3)
        assert _statuses(server) == {508: 2, 502: 1}
        # Another scope is served all along.
        other = await http(server, "POST", "/v1/chat/completions", {**CHAT, "model": "good"}, AUTH)
        assert other.status == 200 and other.json()["choices"][0]["message"]["content"] == "fine"


async def test_a_looping_source_beside_a_healthy_one_fails_no_call() -> None:
    """Second review: a 508 read as fatal stopped the call at the looping source,
    and about half the calls failed for as long as the typo stayed."""
    upstream = FakeUpstream(Reply(text="fine"))
    async with upstream.serve() as good, open_server(
            _settings(_scopes(chat=good)), port=0) as server:
        both = polygate.Scope(sources=[
            polygate.Source(name="typo", base_url=server.base_url, api_key=GATEWAY_KEY, model="chat"),
            polygate.Source(name="real", base_url=good, api_key=GATEWAY_KEY, model="chat")])
        await server.reload(_settings({"chat": both}))
        for _ in range(12):
            answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
            assert answer.status == 200, answer


async def test_two_gateways_that_point_at_each_other_stop_at_once() -> None:
    placeholder = "http://127.0.0.1:9/v1"
    async with open_server(_settings(_scopes(chat=placeholder)), port=0) as a, \
            open_server(_settings(_scopes(chat=placeholder)), port=0) as b:
        await a.reload(_settings(_scopes(chat=b.base_url)))
        await b.reload(_settings(_scopes(chat=a.base_url)))
        with trio.fail_after(10):
            answer = await http(a, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert answer.status == 508 and answer.json()["error"]["code"] == "loop_detected"
        # a → b → a (refused), and the refusal goes back the way it came.
        await wait_for(lambda: _requests(a) + _requests(b) >= 3)
        assert _requests(a) + _requests(b) == 3


async def test_a_ring_of_three_gateways_stops_at_once() -> None:
    """Review: only the gateway that saw its own name again answered 508; the one
    before it answered a plain 502, which the others retried behind their breakers:
    the client waited 121 s."""
    placeholder = "http://127.0.0.1:9/v1"
    async with open_server(_settings(_scopes(chat=placeholder)), port=0) as a, \
            open_server(_settings(_scopes(chat=placeholder)), port=0) as b, \
            open_server(_settings(_scopes(chat=placeholder)), port=0) as c:
        await a.reload(_settings(_scopes(chat=b.base_url)))
        await b.reload(_settings(_scopes(chat=c.base_url)))
        await c.reload(_settings(_scopes(chat=a.base_url)))
        with trio.fail_after(10):
            answer = await http(a, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert answer.status == 508 and answer.json()["error"]["code"] == "loop_detected"
        await wait_for(lambda: _requests(a) + _requests(b) + _requests(c) >= 4)
        assert _requests(a) + _requests(b) + _requests(c) == 4


async def test_a_forged_via_fails_its_own_request_and_no_other() -> None:
    """Review: seven made-up gateway names in a tenant's ``Via`` made the inner gateway
    answer 508, and the outer took its source (the inner gateway) out for 300 s, for
    every tenant."""
    upstream = FakeUpstream(Reply(text="still here"))
    forged = ", ".join(f"1.1 polygate-{n:012x}" for n in range(7))
    async with upstream.serve() as url, \
            open_server(_settings(_scopes(chat=url)), port=0) as inner, \
            open_server(_settings(_scopes(chat=inner.base_url)), port=0) as outer:
        refused = await http(outer, "POST", "/v1/chat/completions", CHAT, {**AUTH, "via": forged})
        assert refused.status == 508, refused
        assert refused.json()["error"]["code"] == "too_many_hops"
        for _ in range(3):
            served = await http(outer, "POST", "/v1/chat/completions", CHAT, AUTH)
            assert served.status == 200, served
            assert served.json()["choices"][0]["message"]["content"] == "still here"


async def test_a_chain_without_a_loop_is_served_and_names_each_gateway_in_order() -> None:
    upstream = FakeUpstream(Reply(text="through two"))
    async with upstream.serve() as url, \
            open_server(_settings(_scopes(chat=url)), port=0) as inner, \
            open_server(_settings(_scopes(chat=inner.base_url)), port=0) as outer:
        answer = await http(outer, "POST", "/v1/chat/completions", CHAT,
                            {**AUTH, "via": "1.1 corporate-proxy"})
        assert answer.status == 200, answer
        assert answer.json()["choices"][0]["message"]["content"] == "through two"
    seen = upstream.requests[0].headers["via"]
    # Another proxy's entry is not passed on (it is not ours to vouch for); each
    # polygate gateway's is, in the order passed.
    assert seen == f"1.1 {outer.via}, 1.1 {inner.via}"
    assert outer.via != inner.via and outer.via.startswith("polygate-")


async def test_a_library_call_sends_no_via() -> None:
    upstream = FakeUpstream(Reply())
    async with upstream.serve() as url, polygate.session(_settings(_scopes(chat=url))) as s:
        await s.chat(CHAT["messages"])
    assert "via" not in upstream.requests[0].headers


@pytest.mark.parametrize("lines", [
    ["1.1 polygate-{me}"],
    ["1.1 polygate-0123456789ab, 1.1 polygate-{me}, 1.1 other"],
    ["1.1 polygate-0123456789ab", "1.0 polygate-{me} (a proxy added its own line)"],
])
async def test_a_request_that_names_this_gateway_in_any_via_line_is_a_loop(lines: list[str]) -> None:
    upstream = FakeUpstream(Reply())
    async with upstream.serve() as url, open_server(_settings(_scopes(chat=url)), port=0) as server:
        raw = [line.format(me=server.via.removeprefix("polygate-")) for line in lines]
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            body = b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}'
            head = ("POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\n"
                    f"authorization: Bearer {GATEWAY_KEY}\r\n"
                    + "".join(f"via: {line}\r\n" for line in raw)
                    + f"content-length: {len(body)}\r\n\r\n")
            await stream.send_all(head.encode() + body)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
    assert data.startswith(b"HTTP/1.1 508 "), data[:200]
    assert b"x-should-retry: false" in data.lower() and b'"loop_detected"' in data
    assert not upstream.requests


async def test_a_chain_as_long_as_the_limit_is_refused_as_a_loop() -> None:
    upstream = FakeUpstream(Reply())
    async with upstream.serve() as url, open_server(_settings(_scopes(chat=url)), port=0) as server:
        names = [f"1.1 polygate-{n:012x}" for n in range(8)]
        ok = await http(server, "POST", "/v1/chat/completions", CHAT,
                        {**AUTH, "via": ", ".join(names[:7])})
        refused = await http(server, "POST", "/v1/chat/completions", CHAT,
                             {**AUTH, "via": ", ".join(names)})
    assert ok.status == 200, ok
    assert refused.status == 508 and refused.json()["error"]["code"] == "too_many_hops"
    assert len(upstream.requests) == 1


@pytest.mark.parametrize(("status", "code", "expected"), [
    (508, "loop_detected", polygate.SourceDeadError),  # its route leads back: the source's
    (508, None, polygate.SourceDeadError),  # another gateway's loop detection (Cloudflare's)
    (508, "too_many_hops", polygate.FatalUpstreamError),  # maybe made up: this call alone
    (503, None, polygate.TransientUpstreamError),
    (429, None, polygate.RateLimitedError),
])
def test_how_a_loop_is_classified(status: int, code: str | None, expected: type[Exception]) -> None:
    from polygate._errors import classify_status

    error = classify_status(status, "text", source="s", code=code)
    assert type(error) is expected and error.status_code == status
