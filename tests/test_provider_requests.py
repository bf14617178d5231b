"""What polygate itself adds to a request, and a provider refuses: it is asked again
without it, free of ``max_attempts``, and never asked so again in the session
(review, provider by provider: each of these failed every call to the provider).

* Mistral refuses the ``stream_options`` polygate adds to ask for usage (its
  pydantic models forbid extra fields: avante-corp/avante.nvim#2347,
  dnakov/anon-kode#53); so did Azure OpenAI before api-version 2024-09-01
  ("Unrecognized request argument supplied: stream_options", openai/openai-python#1469)
  and, at times, Groq and xAI.
* OpenAI refuses to stream o3 and gpt-5 to an organization that has not verified
  itself, and answers the same request unstreamed
  (BeehiveInnovations/pal-mcp-server#134, charmbracelet/crush#422).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import Router

MESSAGES = [{"role": "user", "content": "hi"}]

MISTRAL_422 = {
    "object": "error",
    "message": {"detail": [{"type": "extra_forbidden",
                            "loc": ["body", "stream_options", "include_usage"],
                            "msg": "Extra inputs are not permitted", "input": True}]},
    "type": "invalid_request_error", "param": None, "code": None,
}
AZURE_400 = {"error": {"message": "Unrecognized request argument supplied: stream_options",
                       "type": "invalid_request_error", "param": None, "code": None}}
UNVERIFIED = {"error": {
    "message": "Your organization must be verified to stream this model. Please go to: "
               "https://platform.openai.com/settings/organization/general and click on Verify "
               "Organization. If you just verified, it can take up to 15 minutes for access to "
               "propagate.",
    "type": "invalid_request_error", "param": "stream", "code": "unsupported_value"}}


def _sse(text: str) -> bytes:
    chunks = [
        {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                      "finish_reason": None}]},
        {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
    ]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


ANSWER = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _refusing(seen: list[dict[str, Any]], refused: str, body: dict[str, Any],
              status: int) -> httpx.MockTransport:
    """A provider that refuses requests carrying ``refused`` (a body key), and answers
    the others as asked (streamed or not)."""
    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        seen.append(sent)
        if sent.get(refused):
            return httpx.Response(status, json=body)
        if sent.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=_sse("hello"))
        return httpx.Response(200, json=ANSWER)
    return httpx.MockTransport(handler)


def _settings(**source: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="p", base_url="http://p/v1", **source)],
        retry=polygate.Retry(max_attempts=1))})


@pytest.mark.parametrize(("status", "body"), [(422, MISTRAL_422), (400, AZURE_400)],
                         ids=["mistral", "azure"])
async def test_a_source_that_refuses_stream_options_is_asked_without_them(
    autojump_clock: trio.testing.MockClock, status: int, body: dict[str, Any]
) -> None:
    seen: list[dict[str, Any]] = []
    router = Router({"p": _refusing(seen, "stream_options", body, status)})
    async with polygate.session(_settings(), transport=router) as s:
        first = await s.chat(MESSAGES)  # (max_attempts=1: the retry is free)
        async with s.stream_chat(MESSAGES) as stream:
            text = "".join([chunk.text async for chunk in stream])
    assert first.text == text == "hello"
    assert first.usage.source == "upstream"  # (Mistral sends usage unasked)
    # Refused once; streamed after it, without stream_options, in this call and the next.
    assert ["stream_options" in sent for sent in seen] == [True, False, False]
    assert all(sent["stream"] for sent in seen)


async def test_a_callers_own_stream_options_refused_are_the_callers_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The caller's own ``stream_options`` (beyond the ``include_usage`` polygate asks
    for anyway), refused: the request as the caller wrote it was refused, so its error
    is the call's, and the source is asked so again later.  ``include_usage`` alone is
    polygate's own, a gateway client's too (review: every streamed request with it
    through ``polygate serve`` failed on such a source)."""
    seen: list[dict[str, Any]] = []
    router = Router({"p": _refusing(seen, "stream_options", MISTRAL_422, 422)})
    async with polygate.session(_settings(), transport=router) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES, stream_options={"include_obfuscation": False})
        await s.chat(MESSAGES, stream_options={"include_usage": True})
        await s.chat(MESSAGES)
    assert ["stream_options" in sent for sent in seen] == [True, True, False, False]


async def test_a_source_that_refuses_to_stream_is_asked_unstreamed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[dict[str, Any]] = []
    router = Router({"p": _refusing(seen, "stream", UNVERIFIED, 400)})
    async with polygate.session(_settings(model="o3"), transport=router) as s:
        first = await s.chat(MESSAGES)
        async with s.stream_chat(MESSAGES) as stream:  # (one chunk: the whole answer)
            text = "".join([chunk.text async for chunk in stream])
    assert first.text == text == "hello"
    assert [bool(sent.get("stream")) for sent in seen] == [True, False, False]
    assert all("stream_options" not in sent for sent in seen[1:])


async def test_ocr_pages_learn_it_too(autojump_clock: trio.testing.MockClock) -> None:
    from .test_ocr import image_bytes

    seen: list[dict[str, Any]] = []
    router = Router({"p": _refusing(seen, "stream_options", MISTRAL_422, 422)})
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="p", base_url="http://p/v1")],
        retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=router) as s:
        r = await s.ocr(image_bytes("PNG", (64, 64)))
    assert r.text == "hello" and ["stream_options" in sent for sent in seen] == [True, False]


async def test_an_error_that_only_echoes_the_request_teaches_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 400 about the request whose text quotes the body sent (stream_options in it)
    is the request's error: the source is not taught to go without stream_options."""
    seen: list[dict[str, Any]] = []
    echo = {"error": {"message": "messages.0.role: Input should be 'user'; body was "
                                 "{'stream_options': {'include_usage': True}, 'model': 'm'}",
                      "type": "invalid_request_error"}}
    bad = True

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if bad:
            return httpx.Response(400, json=echo)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=_sse("hello"))

    async with polygate.session(_settings(), transport=Router({"p": httpx.MockTransport(handler)})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
        bad = False
        await s.chat(MESSAGES)
    assert ["stream_options" in sent for sent in seen] == [True, True]


class _Slow(httpx.AsyncBaseTransport):
    """Refuses requests carrying ``refused`` after ``delay`` s (several in flight)."""

    def __init__(self, refused: str, status: int, body: dict[str, Any], delay: float) -> None:
        self.refused, self.status, self.body, self.delay = refused, status, body, delay

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent = json.loads(await request.aread())
        await trio.sleep(self.delay)
        if sent.get(self.refused):
            return httpx.Response(self.status, json=self.body)
        if sent.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=_sse("hello"))
        return httpx.Response(200, json=ANSWER)


@pytest.mark.parametrize(("refused", "status", "body"),
                         [("stream_options", 422, MISTRAL_422), ("stream", 400, UNVERIFIED)])
async def test_calls_in_flight_when_a_source_refuses_are_each_asked_again(
    autojump_clock: trio.testing.MockClock, refused: str, status: int, body: dict[str, Any]
) -> None:
    """Review: the first refusal taught the source, and the next, of a request sent
    before it, was then no longer recognised: its call failed.  What a refusal
    refused is what its request carried."""
    texts: list[str] = []
    async with polygate.session(_settings(), transport=Router({"p": _Slow(refused, status, body, 1.0)})) as s:

        async def one() -> None:
            texts.append((await s.chat(MESSAGES)).text)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.sleep(0.1)  # (virtual time: sent before the first is refused)
            nursery.start_soon(one)
    assert texts == ["hello", "hello"]


async def test_a_refusal_beside_a_failed_hedge_is_still_asked_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a round whose primary was refused for stream_options and whose hedge
    failed with a 500 counted against max_attempts, and the call failed."""
    class Broken(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            await request.aread()
            await trio.sleep(1.0)
            return httpx.Response(500, json={"error": {"message": "boom"}})

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        hedge=polygate.Hedge(after_s=0.5),
        retry=polygate.Retry(max_attempts=1))})
    router = Router({"a": _Slow("stream_options", 422, MISTRAL_422, 1.0), "b": Broken()})
    async with polygate.session(settings, transport=router) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.source) == ("hello", "a")


async def test_a_gateway_clients_include_usage_is_the_gateways() -> None:
    """Review: a gateway client's ``stream_options.include_usage`` (the OpenAI SDK's
    usual call) reached the library as the caller's own, so a source that refuses the
    field failed every such stream.  The gateway makes its usage chunk itself."""
    from polygate.serve import open_server

    key = "sk-gw-test-0123456789"
    seen: list[dict[str, Any]] = []
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="p", base_url="http://p/v1")])},
        serve=polygate.Serve(api_keys=[key]))
    router = Router({"p": _refusing(seen, "stream_options", MISTRAL_422, 422)})
    out: dict[str, Any] = {}
    async with open_server(settings, port=0, transport=router) as server:
        def post() -> None:
            with httpx.Client(timeout=20) as client:
                answer = client.post(
                    server.base_url + "/chat/completions", headers={"authorization": f"Bearer {key}"},
                    json={"model": "chat", "messages": MESSAGES, "stream": True,
                          "stream_options": {"include_usage": True}})
                out["status"], out["text"] = answer.status_code, answer.text

        await trio.to_thread.run_sync(post)
    assert out["status"] == 200 and "hello" in out["text"] and '"usage":{' in out["text"]


def _then_429(seen: list[dict[str, Any]]) -> httpx.MockTransport:
    """Refuses stream_options once (Mistral's 422), then answers only 429s."""
    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        seen.append(sent)
        if sent.get("stream_options"):
            return httpx.Response(422, json=MISTRAL_422)
        return httpx.Response(429, headers={"retry-after": "1"},
                              json={"error": {"message": "slow down", "code": "rate_limit_exceeded"}})
    return httpx.MockTransport(handler)


async def test_a_refusal_asked_again_is_no_failure_of_the_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the asked-again attempt stood among the call's failures, so a source
    that then answered only 429s no longer made the call ``rate_limited``, and
    ``fallback_on=("rate_limited",)`` did not move it."""
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(
            sources=[polygate.Source(name="p", base_url="http://p/v1")],
            retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=5),
            fallback="backup", fallback_on=("rate_limited",)),
        "backup": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1")]),
    })
    seen: list[dict[str, Any]] = []
    backup = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=_sse("backup")))
    async with polygate.session(settings, transport=Router({"p": _then_429(seen), "b": backup})) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.source) == ("backup", "b")


@pytest.mark.parametrize("seed", range(12))
async def test_a_refusal_is_asked_again_on_the_same_source(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """Review: the re-ask was an ordinary pick, and could go to another source whose
    500 took the call's only attempt, though the source that refused would answer."""
    import random

    asked: list[tuple[str, bool]] = []

    def mistral(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        asked.append(("a", "stream_options" in sent))
        if "stream_options" in sent:
            return httpx.Response(422, json=MISTRAL_422)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=_sse("from a"))

    def broken(request: httpx.Request) -> httpx.Response:
        asked.append(("b", False))
        return httpx.Response(500, json={"error": {"message": "boom"}})

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1"),
                 polygate.Source(name="b", base_url="http://b/v1")],
        retry=polygate.Retry(max_attempts=1))})
    router = Router({"a": httpx.MockTransport(mistral), "b": httpx.MockTransport(broken)})
    async with polygate.session(settings, transport=router, rng=random.Random(seed)) as s:
        try:
            await s.chat(MESSAGES)
        except polygate.AllSourcesExhausted:
            assert asked[0] == ("b", False)  # (b was picked first, and failed)
            return
    assert asked[asked.index(("a", True)) + 1] == ("a", False)


# ----------------------------------------------------------------------
# Review of the re-ask first: it waits out no cooldown (another source is free), and an
# asked-again attempt is no failure of the call in serve's memory check, nor after a
# structured re-ask (the call's errors are rebuilt from its attempts' records).


def _answer(text: str) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse(text))


async def test_asked_again_does_not_wait_out_a_cooldown_while_another_source_is_free(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Call X is refused stream_options by a (Mistral's 422, 1 s in); meanwhile call Y
    got a 429 (Retry-After 30) from a.  X is asked again without stream_options: a
    cools down for 29 s more while b is free.  same_source_retries=0 (the default:
    "fail over at once ... another one is the fastest answer")."""
    n = 0

    async def a_handler(request: httpx.Request) -> httpx.Response:
        nonlocal n
        n += 1
        sent = json.loads(request.content)
        if n == 1:
            await trio.sleep(1)
            return httpx.Response(422, json=MISTRAL_422)
        if sent.get("stream_options"):
            return httpx.Response(429, headers={"retry-after": "30"},
                                  json={"error": {"message": "slow down", "code": "rate_limit_exceeded"}})
        return _answer("from a")

    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
        polygate.Source(name="b", base_url="http://b/v1", weight=1e-9),
    ])})
    router = Router({"a": httpx.MockTransport(a_handler),
                     "b": httpx.MockTransport(lambda r: _answer("from b"))})
    done: dict[str, tuple[float, str | None]] = {}
    async with polygate.session(settings, transport=router) as s:
        async def call(name: str) -> None:
            r = await s.chat(MESSAGES)
            done[name] = (trio.current_time(), r.source)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "X")
            await trio.sleep(0.1)
            nursery.start_soon(call, "Y")
    assert done["Y"][1] == "b"
    # X: refused at t=1; b was free all along.
    assert done["X"][0] < 5, done


async def test_serve_out_of_memory_not_hidden_by_an_asked_again_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only this process's memory failed the call (the 422 before it was an asked-again
    attempt, 'no failure of the call'): serve answers 503 out_of_memory, as it does
    without the refusal -- rate_limited_for leaves asked-again errors out, reply_for's
    memory check does not."""
    from polygate.serve._errors import reply_for

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream_options"):
            return httpx.Response(422, json=MISTRAL_422)
        raise MemoryError()

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=Router({"a": httpx.MockTransport(handler)})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as failed:
            await s.chat(MESSAGES)
    error = failed.value
    assert [e.asked_again for e in error.errors] == [True, False]
    assert error.errors[1].exhausted == "memory"
    reply = reply_for(error)
    assert (reply.status, reply.code) == (503, "out_of_memory"), (reply.status, reply.code)


async def test_structured_reask_errors_keep_the_asked_again_marker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A schema call: round 1 is refused stream_options (asked again, answered with
    text that is not the schema's), the re-ask round gets only 429s.  Without a re-ask
    the call's AllSourcesExhausted lists the asked-again TransientUpstreamError
    (asked_again=True), left out of the rate_limited judgement; after a re-ask
    (_call.py body(): exc.errors = every_error(ctx), the attempt records' errors) it
    lists the raw 422 FatalUpstreamError, asked_again=False: the call reads as refused
    by a fatal error, and failure_reasons no longer says rate_limited."""
    from polygate._fallback import failure_reasons

    n = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal n
        n += 1
        if json.loads(request.content).get("stream_options"):
            return httpx.Response(422, json=MISTRAL_422)
        if n == 2:
            return _answer("not json at all")
        return httpx.Response(429, headers={"retry-after": "1"},
                              json={"error": {"message": "slow down", "code": "rate_limit_exceeded"}})

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=5))})
    async with polygate.session(settings, transport=Router({"a": httpx.MockTransport(handler)})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as failed:
            await s.chat(MESSAGES, schema=schema)
    error = failed.value
    assert error.errors, error
    assert not any(isinstance(e, polygate.FatalUpstreamError) for e in error.errors), [
        (type(e).__name__, e.asked_again) for e in error.errors]
    assert "rate_limited" in failure_reasons(error)
