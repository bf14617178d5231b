"""Real providers' error shapes, each classified as what it means (review, provider by
provider: each was classified in a way that hurt; "Actual:" in a docstring is what
the code did before its fix).

Each test serves a documented or recorded provider error body through
httpx.MockTransport (source "a"), next to a healthy source "b" where there is one, and
asserts what a user of a gateway needs.  Sources are cited beside each shape.
"""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate._fallback import failure_reasons

from .conftest import FIRST_A, MESSAGES, SECRET, two_source_settings

OK_BODY = {
    "id": "x", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "from b"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def serving(status: int, body: Any, headers: dict[str, str] | None = None,
            b_answers: bool = True) -> tuple[httpx.MockTransport, dict[str, int]]:
    calls = {"a": 0, "b": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls[host] += 1
        if host == "a":
            return httpx.Response(status, content=json.dumps(body).encode(),
                                  headers={"content-type": "application/json", **(headers or {})})
        return httpx.Response(200, json=OK_BODY)

    return httpx.MockTransport(handler), calls


# ---------------------------------------------------------------- source state sent as 400

# Gemini's OpenAI-compatible endpoint: a wrong/expired key is HTTP 400 INVALID_ARGUMENT,
# reason API_KEY_INVALID (its error bodies come as a one-element list).
# https://ai.google.dev/gemini-api/docs/generate-content/api-errors ; recorded in
# continuedev/continue#10290, #10748, #12960 and cequence-io/openai-scala-client#109.
GEMINI_BAD_KEY = [{"error": {
    "code": 400, "message": "API key not valid. Please pass a valid API key.",
    "status": "INVALID_ARGUMENT",
    "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID",
                 "domain": "googleapis.com",
                 "metadata": {"service": "generativelanguage.googleapis.com"}},
                {"@type": "type.googleapis.com/google.rpc.LocalizedMessage", "locale": "en-US",
                 "message": "API key not valid. Please pass a valid API key."}]}}]
# Same page: 400 FAILED_PRECONDITION "Gemini API free tier is not available in your
# country. Please enable billing on your project in Google AI Studio." (Retry: no; fix:
# a paid plan) -- the project's state, not the request's.
GEMINI_NO_BILLING = [{"error": {
    "code": 400, "status": "FAILED_PRECONDITION",
    "message": "Gemini API free tier is not available in your country. Please enable "
               "billing on your project in Google AI Studio."}}]
# Anthropic: an account out of credit is HTTP 400 invalid_request_error (anthropics/
# claude-code#4208, #4684, #66314, anthropics/claude-quickstarts#229; docs.claude.com/
# en/api/errors: "We may also use this error type for other 4XX status codes").
ANTHROPIC_NO_CREDIT = {"type": "error", "error": {
    "type": "invalid_request_error",
    "message": "Your credit balance is too low to access the Anthropic API. Please go to "
               "Plans & Billing to upgrade or purchase credits."},
    "request_id": "req_011CbrFTcXhtiMzr3s6EocF7"}


# The same, through LiteLLM's proxy, which words Anthropic's body into its message.
LITELLM_NO_CREDIT = {"error": {
    "message": "litellm.BadRequestError: AnthropicException - " + json.dumps(ANTHROPIC_NO_CREDIT),
    "type": None, "param": None, "code": "400"}}


@pytest.mark.parametrize("body", [GEMINI_BAD_KEY, GEMINI_BAD_KEY[0], GEMINI_NO_BILLING,
                                  ANTHROPIC_NO_CREDIT, LITELLM_NO_CREDIT],
                         ids=["gemini-key-list", "gemini-key-object", "gemini-no-billing",
                              "anthropic-no-credit", "anthropic-no-credit-via-litellm"])
async def test_a_source_state_sent_as_400_fails_over_and_marks_the_source_dead(
    autojump_clock: trio.testing.MockClock, body: Any
) -> None:
    """Expected: the call is answered by the healthy source b (a is a dead source, as a
    401/402 is).  Actual: FatalUpstreamError at once -- every call fails while b is fine,
    and `polygate serve` answers its client 400 upstream_rejected ("your request is
    wrong") for the gateway's own bad key / empty account."""
    transport, calls = serving(400, body)
    async with polygate.session(two_source_settings(weights=FIRST_A), transport=transport) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.source) == ("from b", "b")
    assert calls == {"a": 1, "b": 1}


# ---------------------------------------------------------------- transient sent as 4xx

# Groq: "498 Custom: Flex Tier Capacity Exceeded -- ... the flex tier is at capacity and
# the request won't be processed. You can try again later." (console.groq.com/docs/errors)
GROQ_FLEX = {"error": {"message": "Flex tier capacity exceeded. This is a temporary error "
                       "and you may retry your request later.",
                       "type": "capacity_exceeded", "code": "capacity_exceeded"}}
# TGI (router/src/server.rs): InferError::GenerationError(_) => StatusCode::FAILED_DEPENDENCY
# (424): a shard failing mid-generation (CUDA OOM, a crashed shard) -- the server's fault.
TGI_GENERATION = {"error": "Request failed during generation: Server error: CUDA out of memory. "
                           "Tried to allocate 2.00 GiB", "error_type": "generation"}


@pytest.mark.parametrize(("status", "body"), [(498, GROQ_FLEX), (424, TGI_GENERATION)],
                         ids=["groq-498-flex-capacity", "tgi-424-generation-error"])
async def test_a_capacity_or_server_failure_sent_as_4xx_is_retried_elsewhere(
    autojump_clock: trio.testing.MockClock, status: int, body: Any
) -> None:
    """Expected: transient (or rate limited), so the call goes to b.  Actual:
    FatalUpstreamError raised at once, never retried, no failover."""
    transport, _ = serving(status, body)
    async with polygate.session(two_source_settings(weights=FIRST_A), transport=transport) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.source) == ("from b", "b")


# ---------------------------------------------------------------- request error sent as 403

# OpenRouter: "403: Your chosen model requires moderation and your input was flagged";
# error.metadata then has reasons, flagged_input, provider_name, model_slug
# (openrouter.ai/docs/api-reference/errors, "Moderation Errors").
OPENROUTER_FLAGGED = {"error": {
    "code": 403,
    "message": "openai/gpt-4o requires moderation on OpenAI. Your input was flagged for "
               "\"harassment\". No credits were charged.",
    "metadata": {"reasons": ["harassment"], "flagged_input": "you are a ...",
                 "provider_name": "OpenAI", "model_slug": "openai/gpt-4o"}}}


async def test_one_flagged_prompt_does_not_take_the_source_out_for_everyone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Expected: a moderation refusal is the request's (content policy: fatal, the
    source untouched), so the next, clean call on the same source is served.  Actual:
    SourceDeadError -- the source is dead for dead_cooldown_s (300 s): one user's
    flagged prompt refuses every other user's call, and the flagged prompt is sent on
    to every other source (which may flag it and die too)."""
    flagged = True

    def handler(request: httpx.Request) -> httpx.Response:
        if flagged:
            return httpx.Response(403, json=OPENROUTER_FLAGGED)
        return httpx.Response(200, json=OK_BODY)

    settings = two_source_settings(names=("a",))
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.PolygateError) as first:
            await s.chat(MESSAGES)
        flagged = False
        await trio.sleep(5)
        r = await s.chat(MESSAGES)  # a benign call, 5 s later
    assert r.text == "from b"
    err = first.value
    assert isinstance(err, polygate.FatalUpstreamError)
    assert "content_policy" in failure_reasons(err)


# ---------------------------------------------------------------- context length not recognised

# llama.cpp server (tools/server/utils.hpp ERROR_TYPE_EXCEED_CONTEXT_SIZE):
LLAMACPP_CTX = {"error": {"code": 400, "type": "exceed_context_size_error",
                          "message": "the request exceeds the available context size, try increasing it",
                          "n_prompt_tokens": 5000, "n_ctx": 4096}}
# Gemini (OpenAI-compatible endpoint), a prompt over the window:
GEMINI_CTX = [{"error": {"code": 400, "status": "INVALID_ARGUMENT",
                         "message": "The input token count (1200000) exceeds the maximum "
                                    "number of tokens allowed (1048576)."}}]
# TGI / Together (TGI validation):
TGI_CTX = {"error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. "
                    "Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
           "error_type": "validation"}


@pytest.mark.parametrize(("status", "body"), [(400, LLAMACPP_CTX), (400, GEMINI_CTX), (422, TGI_CTX)],
                         ids=["llamacpp", "gemini", "tgi"])
async def test_context_overflow_is_recognised(
    autojump_clock: trio.testing.MockClock, status: int, body: Any
) -> None:
    """Expected: the refusal counts as context_length (fallback_on=["context_length"]
    routes it to a larger model).  Actual: only "fatal"/"status:NNN"."""
    transport, _ = serving(status, body)
    async with polygate.session(two_source_settings(names=("a",)), transport=transport) as s:
        with pytest.raises(polygate.FatalUpstreamError) as failed:
            await s.chat(MESSAGES)
    assert "context_length" in failure_reasons(failed.value)


# ---------------------------------------------------------------- Gemini list-shaped bodies

async def test_a_list_shaped_error_body_gives_the_providers_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Gemini's OpenAI-compatible endpoint wraps its error object in a list.  Expected:
    the message is the provider's message, as for {"error": {...}}.  Actual: the whole
    body dumped as JSON (cut at 300 characters), and no code."""
    transport, _ = serving(404, [{"error": {"code": 404, "status": "NOT_FOUND",
                                            "message": "models/gemini-9 is not found for API version v1main"}}])
    async with polygate.session(two_source_settings(names=("a",)), transport=transport) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as failed:
            await s.chat(MESSAGES)
    [error] = failed.value.errors
    assert error.message == "models/gemini-9 is not found for API version v1main"


# ---------------------------------------------------------------- finish_reason "error" (OpenRouter)

# OpenRouter's response schema (openrouter.ai/docs/api-reference/responses, mirrored at
# docs.blackbox.ai/api-reference/responses; koog's OpenRouterChoice/OpenRouterStreamChoice):
#   type NonStreamingChoice = {finish_reason, native_finish_reason, message, error?: ErrorResponse}
#   type StreamingChoice    = {finish_reason, native_finish_reason, delta,   error?: ErrorResponse}
# with finish_reason "error" "if the model finishes the request with an error".
CHOICE_ERROR = {"code": 502, "message": "Provider returned error",
                "metadata": {"provider_name": "Chutes", "raw": "upstream connect error"}}


def _chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> str:
    return "data: " + json.dumps({"id": "gen-1", "object": "chat.completion.chunk", "created": 1,
                                  "model": "m", "choices": [{"index": 0, "delta": delta,
                                  "finish_reason": finish, **choice}]}) + "\n\n"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_an_answer_that_finished_with_an_error_is_no_answer(
    autojump_clock: trio.testing.MockClock, stream: bool
) -> None:
    """Expected: a choice whose finish_reason is "error" (its error beside it) is a
    failed attempt (transient: 502), retried on b.  Actual: the cut answer ("The
    capital of") is returned as a success with finish_reason "error", counted ok,
    and written to the response cache, so later calls are served the broken answer."""
    calls = {"a": 0, "b": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls[host] += 1
        if host == "b":
            return httpx.Response(200, json=OK_BODY)
        if stream:
            body = (_chunk({"role": "assistant", "content": "The capital of"})
                    + _chunk({"content": ""}, "error", native_finish_reason="error", error=CHOICE_ERROR)
                    + "data: [DONE]\n\n")
            return httpx.Response(200, content=body.encode(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={
            "id": "gen-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "error", "native_finish_reason": "error",
                         "message": {"role": "assistant", "content": "The capital of"},
                         "error": CHOICE_ERROR}]})

    sources = [polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET,
                               weight=FIRST_A[n], streaming=stream) for n in ("a", "b")]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=sources)})
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.source, r.finish_reason) == ("from b", "b", "stop")


# ---------------------------------------------------------------- Gemini 429: the wait is in the body

# Gemini answers a 429 with no Retry-After header; the wait is a google.rpc.RetryInfo
# detail (retryDelay "37s") in the body, and a QuotaFailure names the quota (a per-day
# one resets in hours).  Recorded in dcdpr/jp#1061 ("Honor Gemini's retry delay":
# "Gemini answers a 429 without a Retry-After header and reports how long to wait only
# in the response body ... The same gap was reported against the Vercel AI SDK in
# vercel/ai#18627").  https://ai.google.dev/gemini-api/docs/rate-limits
GEMINI_429 = [{"error": {
    "code": 429, "status": "RESOURCE_EXHAUSTED",
    "message": "You exceeded your current quota, please check your plan and billing details. "
               "* Quota exceeded for metric: generativelanguage.googleapis.com/"
               "generate_content_free_tier_requests, limit: 10, model: gemini-2.5-flash\n"
               "Please retry in 37.5s.",
    "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{
                    "quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                    "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                    "quotaValue": "10"}]},
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37.5s"}]}}]


@pytest.mark.parametrize("inside", ["a 429", "an error event", "a JSON body"])
async def test_gemini_429_waits_the_retry_delay_its_body_gives(
    autojump_clock: trio.testing.MockClock, inside: str,
) -> None:
    """Expected: the source cools down for the retryDelay (37.5 s): in the 60 s of
    rate_limit_wait_s it is asked about twice.  Actual: the 1 s default cooldown -- 61
    requests in 60 s, each counted against the project's quota, for nothing.  And a
    later review (rate-limit signals as providers send them): the same body as an error
    event in a 200 stream, or as a 200's JSON body, still cooled its source for 1 s."""
    sent: list[float] = []
    error = GEMINI_429[0]

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(trio.current_time())
        if inside == "a 429":
            return httpx.Response(429, json=GEMINI_429)
        if inside == "a JSON body":
            return httpx.Response(200, json=error)
        body = f"data: {json.dumps(error)}\n\n".encode()
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    async with polygate.session(two_source_settings(names=("a",)),
                                transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as failed:
            await s.chat(MESSAGES)
    assert failed.value.errors[0].retry_after_s == pytest.approx(37.5)
    assert len(sent) <= 3


# ---------------------------------------------------------------- OpenRouter 402 that says "wait"

async def test_an_openrouter_402_with_retry_after_is_a_wait_not_a_dead_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """openrouter.ai/docs/api/errors: "On 429 and 503 responses, and on 402 responses
    whose error.metadata.limit_source is openrouter_in_flight_budget ..., OpenRouter may
    include a standard HTTP Retry-After ... A 402 without the header is not a
    wait-and-retry case."  Expected: the source is asked again after the 2 s it gave.
    Actual: dead for dead_cooldown_s (300 s)."""
    state = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        state["n"] += 1
        if state["n"] == 1:
            return httpx.Response(402, headers={"retry-after": "2"}, json={"error": {
                "code": 402, "message": "In-flight spending budget exceeded; retry shortly",
                "metadata": {"limit_source": "openrouter_in_flight_budget"}}})
        return httpx.Response(200, json=OK_BODY)

    async with polygate.session(two_source_settings(names=("a",)),
                                transport=httpx.MockTransport(handler)) as s:
        r = await s.chat(MESSAGES)
    assert r.text == "from b" and state["n"] == 2
    assert trio.current_time() < 10


async def test_an_answer_that_finished_with_an_error_is_not_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same OpenRouter shape with the response cache on.  Actual: the cut answer is
    cached (cache_ttl_s) and the second call is served it without asking anyone."""
    sent = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        sent["n"] += 1
        return httpx.Response(200, json={
            "id": "gen-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "error", "native_finish_reason": "error",
                         "message": {"role": "assistant", "content": "The capital of"},
                         "error": CHOICE_ERROR}]})

    sources = [polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, streaming=False)]
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=sources, cache_ttl_s=60)},
                                 cache="memory")
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        for _ in range(2):
            try:
                await s.chat(MESSAGES)
            except polygate.PolygateError:
                pass
    assert sent["n"] >= 2


# ---------------------------------------------------------------- a request's error is no source's state

# Gemini: a request naming an uploaded file still processing (or expired) is a 400
# FAILED_PRECONDITION -- the caller's file, not the project's billing.
GEMINI_FILE_NOT_ACTIVE = [{"error": {
    "code": 400, "status": "FAILED_PRECONDITION",
    "message": "The File smq4dsfof7gd is not in an ACTIVE state and usage is not allowed."}}]
# A 400 that quotes the caller's input (pydantic validation errors echo the value): the
# caller's text says "credit balance is too low"; the 400 is about the request.
QUOTED_PROMPT_400 = {"object": "error", "type": "BadRequestError", "code": 400, "param": None,
                     "message": "1 validation error: messages.0.role: Input should be 'system', "
                                "'user', 'assistant' or 'tool' [input_value='my credit balance is "
                                "too low, help']"}


@pytest.mark.parametrize("body", [GEMINI_FILE_NOT_ACTIVE, QUOTED_PROMPT_400],
                         ids=["gemini-file-not-active", "prompt-quoted-credit-text"])
async def test_a_request_error_does_not_take_the_source_out(
    autojump_clock: trio.testing.MockClock, body: Any
) -> None:
    """Review of the rules above: any FAILED_PRECONDITION, and any 400 whose message held
    "credit balance is too low" anywhere (a prompt quoted in it too), marked the source
    dead: one caller's request error refused every other caller for 300 s."""
    bad = True

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json=body) if bad else httpx.Response(200, json=OK_BODY)

    async with polygate.session(two_source_settings(names=("a",)),
                                transport=httpx.MockTransport(handler)) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
        bad = False
        assert (await s.chat(MESSAGES)).text == "from b"  # (OK_BODY's text) the source is up


# llama.cpp's server (--embeddings) refuses an input longer than its physical batch
# with a 500 (tools/server: send_error(..., ERROR_TYPE_SERVER)); its wording before it
# counted the tokens (issues #11105, #12295), and gpustack's llama-box's.
TOO_LARGE = [
    "input (1000 tokens) is too large to process. increase the physical batch size "
    "(current batch size: 512)",
    "input is too large to process. increase the physical batch size",
    "input is too large to process, please increase the physical batch size",
]


def _llama_cpp(message: str) -> Any:
    def answer(request: httpx.Request) -> httpx.Response:
        inputs = json.loads(request.content)["input"]
        if any(len(text) > 200 for text in inputs):
            return httpx.Response(500, json={"error": {
                "code": 500, "type": "server_error", "message": message}})
        data = [{"object": "embedding", "index": i, "embedding": [0.25] * 8}
                for i in range(len(inputs))]
        return httpx.Response(200, json={"object": "list", "data": data, "model": "bge",
                                         "usage": {"prompt_tokens": 3, "total_tokens": 3}})
    return answer


@pytest.mark.parametrize("message", TOO_LARGE)
async def test_an_input_too_large_for_llama_cpp_is_the_requests_fault(
    autojump_clock: trio.testing.MockClock, message: str
) -> None:
    """Review (embeddings across providers): the 500 was retried as a server failure,
    three identical requests a call, and two such calls opened the breaker of a
    healthy server for every other caller.  It is fatal, sent once, breaker-neutral,
    and a context-length refusal for ``fallback_on``."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return _llama_cpp(message)(request)

    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        for _ in range(3):
            with pytest.raises(polygate.FatalUpstreamError) as failed:
                await s.embed(["x" * 1000])
        ok = await s.embed(["short text"])
    assert len(sent) == 4 and len(ok.vectors) == 1
    assert ok.call_stats.total_latency_ms < 1000  # no breaker opened
    assert "context_length" in failure_reasons(failed.value)


async def test_a_retry_after_twice_through_polygates_own_transport() -> None:
    """The same finding end to end, on a loopback server and polygate's own HTTP
    transport: a 429 with two Retry-After lines of 3 s tells the caller 3 s (with a
    rate_limit_wait_s of 0.5 s the call gives up at once, saying when to come back)."""
    from tests._raw_server import raw_server

    body = json.dumps({"error": {"message": "Rate limit reached", "code": "rate_limit_exceeded"}}).encode()

    async def reply(stream: Any, head: Any) -> None:
        await stream.send_all(
            b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"retry-after: 3\r\nretry-after: 3\r\n"
            + b"content-length: %d\r\n\r\n" % len(body) + body)

    async with raw_server(reply) as up:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=up.url, api_key=SECRET)],
            retry=polygate.Retry(rate_limit_wait_s=0.5))})
        async with polygate.session(settings) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as failed:
                await s.chat(MESSAGES)
    assert failed.value.errors[0].retry_after_s == 3.0
    assert failed.value.retry_after_s is not None and 2.0 < failed.value.retry_after_s <= 3.0
