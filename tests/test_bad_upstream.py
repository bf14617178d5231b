"""Broken upstream bytes give a typed error within their timeout — never a hang, a bare
traceback, lost accounting or a leaked secret."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, SECRET


def _settings(**source: object) -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, **source)],  # type: ignore[arg-type]
            retry=polygate.Retry(max_attempts=1),
        )},
        max_body_bytes=1024 * 1024,
        max_line_bytes=64 * 1024,
    )


async def _single_error(reply: Reply, **source: object) -> polygate.UpstreamError:
    up = FakeUpstream(reply)
    async with polygate.session(_settings(**source), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
        stats = await s.statistics()
    (src,) = stats.governance.sources
    assert src.state.in_flight == 0
    assert src.state.tokens_reserved == 0
    assert up.in_flight == 0
    (error,) = info.value.errors
    return error


CASES = [
    (Reply(fault="html"), "not JSON"),
    (Reply(fault="no_choices"), "no choices"),
    (Reply(fault="no_choices", stream=False), "no choices"),
    (Reply(fault="malformed_json", fault_after=2), "malformed"),
    (Reply(fault="truncated", fault_after=3), "truncated"),
    (Reply(fault="reset", fault_after=3), "transport error"),
    (Reply(fault="oversized", oversized_bytes=200 * 1024, fault_after=1), "line cap"),
    (Reply(fault="oversized", oversized_bytes=4 * 1024 * 1024, stream=False), "cap"),
    (Reply(fault="error_event", fault_after=2, error_event_code=500), "error event"),
    (Reply(status=500), "HTTP 500"),
]


@pytest.mark.parametrize(("reply", "needle"), CASES)
async def test_bad_bytes_are_transient(
    reply: Reply, needle: str, autojump_clock: trio.testing.MockClock
) -> None:
    error = await _single_error(reply)
    assert isinstance(error, polygate.TransientUpstreamError)
    assert needle in str(error)


async def test_silent_200_hits_the_ttft_timeout(autojump_clock: trio.testing.MockClock) -> None:
    error = await _single_error(Reply(fault="silent"), ttft_timeout_s=7)
    assert isinstance(error, polygate.TransientUpstreamError)
    assert trio.current_time() == pytest.approx(7)


async def test_silent_200_hits_the_attempt_timeout(autojump_clock: trio.testing.MockClock) -> None:
    error = await _single_error(Reply(fault="silent"), timeout_s=30)
    assert "timeout_s" in str(error)
    assert trio.current_time() == pytest.approx(30)


async def test_truncated_json_body(autojump_clock: trio.testing.MockClock) -> None:
    error = await _single_error(Reply(fault="truncated", stream=False))
    assert isinstance(error, polygate.TransientUpstreamError)


async def test_stream_with_finish_but_no_done_is_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    async with polygate.session(_settings(), transport=httpx.MockTransport(handler)) as s:
        r = await s.chat(MESSAGES)
    assert r.text == "hi" and r.finish_reason == "stop"


_N2_CUT = (  # choice 0 finished; choice 1 mid-sentence when the body ends (no [DONE])
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hello"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":1,"delta":{"role":"assistant","content":"Bon"},"finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
)
_N2_WHOLE = _N2_CUT + b'data: {"choices":[{"index":1,"delta":{"content":"jour"},"finish_reason":"stop"}]}\n\n'


@pytest.mark.parametrize("ending", ["clean", "cut mid-frame"])
async def test_an_n2_stream_cut_while_a_choice_is_unfinished_is_truncated(
    ending: str, autojump_clock: trio.testing.MockClock,
) -> None:
    """With ``n > 1`` the answer is complete without [DONE] only once every choice that
    began has its finish_reason: one choice's finish said nothing of the other, still
    mid-sentence (it was taken for a whole answer, cached, and given "stop")."""
    body = _N2_CUT + (b'data: {"choices":[{"index":1,"del' if ending != "clean" else b"")
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        retry=polygate.Retry(max_attempts=1), cache_ttl_s=60,
    )}, cache="memory")
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        for _ in range(2):
            with pytest.raises(polygate.PolygateError) as caught:
                await s.chat(MESSAGES, n=2)
            (error,) = caught.value.errors  # type: ignore[attr-defined]
            assert isinstance(error, polygate.TransientUpstreamError)
            assert ("truncated" if ending == "clean" else "malformed") in str(error)
    assert calls >= 2  # (nothing stored: the second call asked again)


async def test_an_n2_stream_whose_every_choice_finished_is_complete_without_done(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_N2_WHOLE)

    async with polygate.session(_settings(), transport=httpx.MockTransport(handler)) as s:
        r = await s.chat(MESSAGES, n=2)
    assert [(c["message"]["content"], c["finish_reason"]) for c in r.choices] == [
        ("Hello", "stop"), ("Bonjour", "stop")]


async def test_secret_never_appears_anywhere(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    echo = {"error": {"message": f"Incorrect API key provided: {SECRET}", "code": 401}}
    texts: list[str] = []
    for reply in (Reply(status=401, error_body=echo), Reply(status=400, error_body=echo),
                  Reply(fault="error_event", fault_after=1, error_event_code=401),
                  Reply(fault="html"), Reply(status=429, error_body=echo)):
        up = FakeUpstream(reply)
        async with polygate.session(_settings(), transport=Router({"a": up})) as s:
            texts.append(repr(s))
            try:
                await s.chat(MESSAGES, call_deadline_s=5)
            except polygate.PolygateError as exc:
                texts += [str(exc), repr(exc)]
                texts += [f"{e!s} {e!r}" for e in getattr(exc, "errors", [])]
            texts.append(repr(await s.statistics()))
    texts.append(repr(_settings()))
    out = capsys.readouterr()
    texts += [out.out, out.err, caplog.text]
    assert any("Incorrect API key" in t for t in texts)  # the upstream message is kept...
    for text in texts:
        assert SECRET not in text  # ...without the key


# --------------------------------------------------------------------- no choices

_USAGE = b'{"prompt_tokens":3,"completion_tokens":0,"total_tokens":3}'
_NO_CHOICE_STREAMS = {
    "empty object": b"data: {}\n\ndata: [DONE]\n\n",
    "header only": b'data: {"id":"x","object":"chat.completion.chunk","model":"m"}\n\ndata: [DONE]\n\n',
    "usage only": b'data: {"id":"x","choices":[],"usage":' + _USAGE + b"}\n\ndata: [DONE]\n\n",
    "empty choices": b'data: {"choices":[]}\n\ndata: {"choices":[]}\n\ndata: [DONE]\n\n',
    "non-object choices": b'data: {"choices":[1,"a",null]}\n\ndata: [DONE]\n\n',
}
_GOOD_STREAM = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
                b"data: [DONE]\n\n")


def _sse_handler(*bodies: bytes) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """Answers the n-th request with ``bodies[n]`` (the last one from then on)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = bodies[min(len(seen), len(bodies)) - 1]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return httpx.MockTransport(handler), seen


@pytest.mark.parametrize("body", _NO_CHOICE_STREAMS.values(), ids=_NO_CHOICE_STREAMS.keys())
async def test_a_stream_without_a_choice_is_a_malformed_answer(
    body: bytes, autojump_clock: trio.testing.MockClock
) -> None:
    """An answer with zero choices is no answer: it was accepted as an empty text."""
    transport, _ = _sse_handler(body)
    async with polygate.session(_settings(), transport=transport) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    (error,) = info.value.errors
    assert isinstance(error, polygate.TransientUpstreamError)
    assert "malformed stream: no choices" in str(error)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_json_body_with_empty_choices_is_a_malformed_answer(
    stream: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """The same for a whole JSON body (a source that cannot stream, or one that
    answered a stream request with JSON)."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "choices": []})

    source = {} if stream else {"streaming": False}
    async with polygate.session(_settings(**source), transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    (error,) = info.value.errors
    assert isinstance(error, polygate.TransientUpstreamError) and "no choices" in str(error)


async def test_a_stream_without_a_choice_is_retried_and_never_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport, seen = _sse_handler(_NO_CHOICE_STREAMS["usage only"], _GOOD_STREAM)
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
            retry=polygate.Retry(max_attempts=2), cache_ttl_s=60)},
        cache="memory",
    )
    async with polygate.session(settings, transport=transport) as s:
        first = await s.chat(MESSAGES)
        again = await s.chat(MESSAGES)
    assert (first.text, first.call_stats.attempts, len(seen)) == ("hi", 2, 2)
    assert again.text == "hi" and again.call_stats.cached  # the answer, not the empty one


@pytest.mark.parametrize("choice", [
    b'{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":"stop"}',
    b'{"index":0,"delta":{},"finish_reason":"stop"}',
    b'{"delta":{"content":""},"finish_reason":"length"}',
])
async def test_choices_with_no_content_are_still_an_empty_answer(
    choice: bytes, autojump_clock: trio.testing.MockClock
) -> None:
    transport, _ = _sse_handler(b'data: {"choices":[' + choice + b"]}\n\n"
                                b'data: {"choices":[],"usage":' + _USAGE + b"}\n\ndata: [DONE]\n\n")
    async with polygate.session(_settings(), transport=transport) as s:
        response = await s.chat(MESSAGES)
    assert response.text == "" and response.finish_reason in ("stop", "length")
    assert response.choices[0]["index"] == 0


@pytest.mark.parametrize(("code", "fatal"), [
    ("content_filter", True), ("context_length_exceeded", True),
    ("server_error", False), ("rate_limit_exceeded", False), ("invalid_api_key", False),
    ("rate_limit_error", False), ("authentication_error", False), ("permission_error", False),
    ("not_found_error", False), ("invalid_request_error", True), ("request_too_large", True),
])
async def test_an_error_event_whose_code_names_the_request_is_fatal(
    code: str, fatal: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """Review: an error event with no status was always transient, so a content-policy
    refusal inside a 200 stream was retried on another source (and a committed stream
    resumed past it): routed around.  A code that names the request as the problem (a
    content policy, the context's length) is what an HTTP 400 says; others stay
    transient, as the event's own status would decide."""
    a = FakeUpstream(Reply(fault="error_event", fault_after=1, error_event_code=code))
    b = FakeUpstream(Reply(text="from b"))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, weight=w)
        for n, w in (("a", 1.0), ("b", 1e-9))])})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        if fatal:
            with pytest.raises(polygate.FatalUpstreamError) as info:
                await s.chat(MESSAGES)
            assert info.value.status_code == (413 if code == "request_too_large" else 400)
            assert info.value.code == code
            assert b.requests == []
        else:
            assert (await s.chat(MESSAGES)).text == "from b"
    if not fatal:  # the class the code names: a rate limit cools down, a refused key is dead
        alone = FakeUpstream(Reply(fault="error_event", fault_after=1, error_event_code=code))
        one = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
            retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=0))})
        async with polygate.session(one, transport=Router({"a": alone})) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as exhausted:
                await s.chat(MESSAGES)
        assert type(exhausted.value.errors[0]) is {"server_error": polygate.TransientUpstreamError,
                               "rate_limit_exceeded": polygate.RateLimitedError,
                               "invalid_api_key": polygate.SourceDeadError,
                               # Anthropic's types: review, they were all transient
                               "rate_limit_error": polygate.RateLimitedError,
                               "authentication_error": polygate.SourceDeadError,
                               "permission_error": polygate.SourceDeadError,
                               "not_found_error": polygate.SourceDeadError}[code]


@pytest.mark.parametrize("after_content", [False, True])
async def test_an_error_chunk_in_vllms_bare_shape_is_an_error_event(
    after_content: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """Review: a chunk ``{"object": "error", "message": ..., "code": 400}`` (vLLM's
    error body, unwrapped) inside a 200 stream was read as a chunk without choices:
    after content, then ``[DONE]``, ``chat()`` answered with the text so far as if it
    were whole; before any, the call was retried as a malformed stream.  It is an
    error event, classified by its code (a 400: fatal)."""
    events = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"hel"}}]}\n\n'] \
        if after_content else []
    events += [b'data: {"object":"error","message":"bad input","type":"BadRequestError",'
               b'"param":null,"code":400}\n\n', b"data: [DONE]\n\n"]

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"".join(events), headers={"content-type": "text/event-stream"})

    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)])})
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.chat(MESSAGES)
    assert info.value.status_code == 400 and "bad input" in str(info.value)
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 1


@pytest.mark.parametrize(("error", "expected"), [
    ({"type": "invalid_request_error", "code": "invalid_value"}, polygate.FatalUpstreamError),
    ({"type": "invalid_request_error", "code": None}, polygate.FatalUpstreamError),
    ({"type": "rate_limit_error", "code": "slow_down"}, polygate.RateLimitedError),
    ({"type": "server_error", "code": "overloaded"}, polygate.TransientUpstreamError),
])
async def test_an_error_events_type_speaks_when_its_code_is_unknown(
    error: dict[str, Any], expected: type[Exception], autojump_clock: trio.testing.MockClock
) -> None:
    """An outside review (2026-12-05): OpenAI's error events name a type and a code
    (``{"type": "invalid_request_error", "code": "invalid_value"}``); a code polygate
    does not know hid the type, so a request error was retried on every source (and
    the gateway answered 502, not 400), where the same body with HTTP 400 is fatal."""
    event = {"error": {"message": "bad value", "param": None, **error}}

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: " + json.dumps(event).encode() + b"\n\n",
                              headers={"content-type": "text/event-stream"})

    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=0))})
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.PolygateError) as info:
            await s.chat(MESSAGES)
    raised = info.value
    if isinstance(raised, polygate.AllSourcesExhausted):
        raised = raised.errors[0]
    assert type(raised) is expected


@pytest.mark.parametrize("streaming", [True, False])
async def test_a_200_json_body_in_vllms_bare_error_shape_is_an_error(
    streaming: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """Review: the same body as a whole 200 JSON answer (a source that cannot stream,
    or one that answered a stream request with JSON) was retried on every source as a
    malformed body, the upstream's message lost."""
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"object": "error", "message": "bad input",
                                         "type": "BadRequestError", "param": None, "code": 400})

    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, streaming=streaming)
        for n in ("a", "b")])})
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.chat(MESSAGES)
    assert info.value.status_code == 400 and "bad input" in str(info.value)
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 1
