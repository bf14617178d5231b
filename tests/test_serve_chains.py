"""Gateways in a chain, and loops (outside review, 2026-12-06: "gateways in a chain").

A gateway whose source pointed back at itself turned one request into ~1,000 nested
ones within 2 s: 2,057 descriptors, every other client refused with 503 for the
while, and a 504 (or after 65 s a 429) that said nothing of a loop.  Now each call a
gateway makes names it in ``Via``, a request that comes back to it is refused with
508 ``loop_detected``, and the library reads a 508 as its source's configuration
(dead: the call goes on with its other sources).  An inner gateway's
``x-should-retry: false`` (a request over its key's quota, no wait can admit it) is
obeyed by an outer polygate: it asked again 20 times in 20 s, and counted the
refusals against the inner gateway's breaker.

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
        assert looped.status == 502, looped
        error = looped.json()["error"]
        assert error["code"] == "sources_exhausted"
        assert "HTTP 508" in error["message"] and "passed through this gateway" in error["message"]
        # One request went round once: the call, and the one request it sent back.
        await wait_for(lambda: _requests(server) >= 2)
        assert _requests(server) == 2 and _statuses(server) == {502: 1, 508: 1}
        # The looping source is dead now: the next call does not go round at all.
        again = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert again.status == 502
        await wait_for(lambda: _requests(server) >= 3)
        assert _statuses(server) == {502: 2, 508: 1}
        # Another scope is served all along.
        other = await http(server, "POST", "/v1/chat/completions", {**CHAT, "model": "good"}, AUTH)
        assert other.status == 200 and other.json()["choices"][0]["message"]["content"] == "fine"


async def test_two_gateways_that_point_at_each_other_stop_within_a_few_requests() -> None:
    placeholder = "http://127.0.0.1:9/v1"
    async with open_server(_settings(_scopes(chat=placeholder)), port=0) as a, \
            open_server(_settings(_scopes(chat=placeholder)), port=0) as b:
        await a.reload(_settings(_scopes(chat=b.base_url)))
        await b.reload(_settings(_scopes(chat=a.base_url)))
        with trio.fail_after(20):
            answer = await http(a, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert answer.status == 502, answer
        assert "HTTP 508" in answer.json()["error"]["message"]
        # a → b → a (refused); b marks a dead, and a's retries find b answering at once.
        assert _requests(a) + _requests(b) <= 12


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
    assert refused.status == 508 and refused.json()["error"]["code"] == "loop_detected"
    assert len(upstream.requests) == 1


async def test_an_inner_gateways_final_refusal_is_not_asked_again() -> None:
    """The inner gateway's key has a tpm the request's estimate is over: its 429 says
    ``x-should-retry: false``.  The outer raises it at once, a fatal error (a 400 to
    its own client), and its breaker on the inner gateway stays closed."""
    upstream = FakeUpstream(Reply())
    inner_serve = {"keys": {"team": polygate.ServeKey(key="sk-gw-team-0123456789", tpm=1000)}}
    async with upstream.serve() as url, \
            open_server(_settings(_scopes(chat=url), **inner_serve), port=0) as inner:
        outer_scope = polygate.Scope(sources=[polygate.Source(
            name="inner", base_url=inner.base_url, api_key="sk-gw-team-0123456789", model="chat")])
        async with polygate.session(polygate.Settings(scopes={"chat": outer_scope})) as s:
            big = [{"role": "user", "content": "word " * 6000}]
            with trio.fail_after(10), pytest.raises(polygate.FatalUpstreamError) as caught:
                await s.chat(big)
            assert caught.value.status_code == 429
            assert caught.value.call_stats.attempts == 1
            # Small requests are served: the inner gateway is healthy to this session.
            for _ in range(6):
                assert (await s.chat(CHAT["messages"])).text
            with trio.fail_after(10), pytest.raises(polygate.FatalUpstreamError):
                await s.chat(big)
    assert len(upstream.requests) == 6


@pytest.mark.parametrize(("status", "should_retry", "expected"), [
    (503, False, polygate.FatalUpstreamError),
    (429, False, polygate.FatalUpstreamError),
    (408, False, polygate.FatalUpstreamError),
    (503, None, polygate.TransientUpstreamError),
    (429, None, polygate.RateLimitedError),
    (401, False, polygate.SourceDeadError),  # the source's state: dead all the same
    (508, None, polygate.SourceDeadError),
    (508, False, polygate.SourceDeadError),
])
def test_how_should_retry_and_a_loop_are_classified(
    status: int, should_retry: bool | None, expected: type[Exception],
) -> None:
    from polygate._errors import classify_status

    error = classify_status(status, "text", source="s", should_retry=should_retry)
    assert type(error) is expected and error.status_code == status
