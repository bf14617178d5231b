"""The official ``openai`` SDK as the gateway's client, sync and async: answers, streams,
embeddings, headers through ``with_raw_response``, and the exception class it raises
for each error the gateway maps (SPEC §8.5)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import openai
import pytest
import trio

import polygate
from polygate.testing import Reply

from ._serve_kit import GATEWAY_KEY, gateway

pytestmark = pytest.mark.integration

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def sync_client(base_url: str, key: str = GATEWAY_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=20)


def async_client(base_url: str, key: str = GATEWAY_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=20)


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


# --------------------------------------------------------------------------- answers


async def test_sync_json_and_raw_headers() -> None:
    async with gateway(Reply(tokens=4)) as (server, upstream):

        def call() -> Any:
            with sync_client(server.base_url) as client:
                raw = client.chat.completions.with_raw_response.create(
                    model="gpt-4o", messages=MESSAGES, temperature=0.5)
                return raw.headers, raw.parse()

        headers, completion = await in_thread(call)
    assert completion.choices[0].message.content == "The quick brown fox"
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage.completion_tokens == 4
    assert headers["x-polygate-source"] == "s0"
    assert headers["x-polygate-attempts"] == "1"
    assert headers["x-polygate-hedges"] == "0"
    assert headers["x-polygate-cached"] == "false"
    assert headers["x-polygate-call-id"] == upstream.requests[0].headers["x-polygate-call-id"]
    assert upstream.requests[0].body["temperature"] == 0.5


async def test_async_json() -> None:
    async with gateway(Reply(tokens=3)) as (server, _):
        async with async_client(server.base_url) as client:
            completion = await client.chat.completions.create(model="chat", messages=MESSAGES)
    assert completion.choices[0].message.content == "The quick brown"
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("include_usage", [True, False])
async def test_async_stream(include_usage: bool) -> None:
    async with gateway(Reply(tokens=5, inter_token_s=0.01)) as (server, upstream):
        async with async_client(server.base_url) as client:
            async with client.chat.completions.with_streaming_response.create(
                model="chat", messages=MESSAGES, stream=True,
                stream_options={"include_usage": include_usage},
            ) as response:
                headers = response.headers
                chunks = [chunk async for chunk in await response.parse()]
    assert headers["content-type"].startswith("text/event-stream")
    # Sent before the call had an answer, and still the call's own id.
    assert headers["x-polygate-call-id"] == upstream.requests[0].headers["x-polygate-call-id"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The quick brown fox jumps"
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    # Every chunk carries the upstream's fingerprint, the gateway's own (role, finish,
    # usage) too: the SDK's stream helper reads it from the first (a probe found it lost).
    assert {c.system_fingerprint for c in chunks} == {"fp_fake"}
    usage = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage) == 1
        assert usage[0].completion_tokens == 5
        assert not chunks[-1].choices
    else:
        assert usage == []


async def test_a_cached_stream_keeps_the_fingerprint_on_every_chunk() -> None:
    """Review: a hit replayed over SSE lost ``system_fingerprint`` (and
    ``service_tier``) on every chunk, the gateway's own included, where the miss had it
    on all of them: the replay built its chunks from id, created and model only."""
    async with gateway(Reply(tokens=3), cache="memory", cache_ttl_s=60) as (server, upstream):
        async with async_client(server.base_url) as client:
            runs = []
            for _ in range(2):
                response = await client.chat.completions.with_raw_response.create(
                    model="chat", messages=MESSAGES, stream=True,
                    stream_options={"include_usage": True},
                )
                runs.append([c async for c in response.parse()])
    assert len(upstream.requests) == 1
    miss, hit = runs
    assert {c.system_fingerprint for c in miss} == {"fp_fake"}
    assert {c.system_fingerprint for c in hit} == {"fp_fake"}
    assert "".join(c.choices[0].delta.content or "" for c in hit if c.choices) == "The quick brown"


async def test_stream_usage_is_null_when_the_upstream_reports_none() -> None:
    """``include_usage`` with an upstream that reports no usage: the usage chunk says
    ``null``, as the JSON answer has none -- never the library's estimate (the
    completion budget) passed off as the upstream's count."""
    async with gateway(Reply(tokens=3, usage=False)) as (server, _):
        async with async_client(server.base_url) as client:
            whole = await client.chat.completions.create(
                model="chat", messages=MESSAGES, max_tokens=50)
            stream = await client.chat.completions.create(
                model="chat", messages=MESSAGES, max_tokens=50, stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
    assert whole.usage is None
    assert not chunks[-1].choices  # the usage chunk is there ...
    assert chunks[-1].usage is None  # ... and says it is not known
    assert all(c.usage is None for c in chunks)


async def test_sync_stream_helper_accumulates() -> None:
    """The SDK's own stream helper (which needs a role and a finish) assembles the answer."""
    async with gateway(Reply(tokens=4)) as (server, _):

        def call() -> Any:
            with sync_client(server.base_url) as client, client.chat.completions.stream(
                model="chat", messages=MESSAGES
            ) as stream:
                for _ in stream:
                    pass
                return stream.get_final_completion()

        final = await in_thread(call)
    assert final.choices[0].message.content == "The quick brown fox"
    assert final.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("encoding", ["default", "float"])
async def test_embeddings(encoding: str) -> None:
    async with gateway() as (server, upstream):
        async with async_client(server.base_url) as client:
            extra: Any = {} if encoding == "default" else {"encoding_format": "float"}
            result = await client.embeddings.create(model="embed", input=["a", "b", "c"], **extra)
            single = await client.embeddings.create(model="embed", input="a", **extra)
    # The SDK asks for base64 by default and decodes it; both ways give the same floats.
    assert [d.index for d in result.data] == [0, 1, 2]
    assert len(result.data[0].embedding) == 8
    assert all(math.isfinite(x) for x in result.data[0].embedding)
    assert single.data[0].embedding == pytest.approx(result.data[0].embedding, rel=1e-6)
    assert result.usage.prompt_tokens > 0
    assert upstream.requests[0].body["input"] == ["a", "b", "c"]


async def test_models_list() -> None:
    async with gateway() as (server, _):

        def call() -> list[str]:
            with sync_client(server.base_url) as client:
                return sorted(m.id for m in client.models.list())

        assert await in_thread(call) == ["chat", "embed", "gpt-4o"]


# --------------------------------------------------------------------------- errors


async def _error_of(server: Any, key: str = GATEWAY_KEY, **kwargs: Any) -> openai.APIError:
    params = {"model": "chat", "messages": MESSAGES, **kwargs}
    async with async_client(server.base_url, key) as client:
        with pytest.raises(openai.APIError) as info:
            await client.chat.completions.create(**params)
    return info.value


async def test_error_classes_async() -> None:
    async with gateway(Reply(tokens=2)) as (server, _):
        assert type(await _error_of(server, key="wrong")) is openai.AuthenticationError
        assert type(await _error_of(server, model="nope")) is openai.NotFoundError
        bad = await _error_of(server, messages="not a list")
        assert type(bad) is openai.BadRequestError
        assert isinstance(bad, openai.APIStatusError)
        assert bad.response.headers["x-polygate-call-id"]


async def test_fatal_upstream_error_is_bad_request_in_the_sync_sdk() -> None:
    reply = Reply(status=422, error_body={"error": {"message": "no such tool"}})
    async with gateway(reply) as (server, _):

        def call() -> Exception:
            with sync_client(server.base_url) as client:
                try:
                    client.chat.completions.create(model="chat", messages=MESSAGES)
                except openai.APIError as exc:
                    return exc
            raise AssertionError("no error")

        error = await in_thread(call)
    assert type(error) is openai.BadRequestError
    assert "no such tool" in str(error)


async def test_rate_limited_is_rate_limit_error() -> None:
    async with gateway(Reply(status=429, retry_after_s=3),
                       retry=polygate.Retry(rate_limit_wait_s=0.2)) as (server, _):
        error = await _error_of(server)
    assert type(error) is openai.RateLimitError
    assert error.response.headers["retry-after"] == "3"


@pytest.mark.parametrize(("reply", "scope", "status"), [
    (Reply(status=503), {"retry": polygate.Retry(max_attempts=1)}, 502),
    (Reply(first_token_s=10), {"call_deadline_s": 0.3}, 504),
])
async def test_server_side_failures_are_internal_server_errors(
    reply: Reply, scope: dict[str, Any], status: int
) -> None:
    async with gateway(reply, **scope) as (server, _):
        error = await _error_of(server)
    assert type(error) is openai.InternalServerError
    assert error.status_code == status


async def test_body_over_the_cap_is_413() -> None:
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], max_request_bytes=2000)
    async with gateway(serve=serve) as (server, _):
        error = await _error_of(server, messages=[{"role": "user", "content": "x" * 5000}])
    assert type(error) is openai.APIStatusError
    assert error.status_code == 413


async def test_failure_before_the_stream_commits_is_a_status() -> None:
    async with gateway(Reply(status=400)) as (server, _):
        async with async_client(server.base_url) as client:
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="chat", messages=MESSAGES, stream=True)


async def test_failure_after_the_stream_commits_is_an_error_event() -> None:
    # The connection resets after three tokens: content was shown, so no retry.
    async with gateway(Reply(tokens=8, inter_token_s=0.01, fault="reset", fault_after=3)) as (server, _):
        async with async_client(server.base_url) as client:
            stream = await client.chat.completions.create(model="chat", messages=MESSAGES, stream=True)
            seen = []
            with pytest.raises(openai.APIError) as info:
                async for chunk in stream:
                    if chunk.choices:
                        seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "The quick brown"
    assert not isinstance(info.value, openai.APIStatusError)  # an SSE event, not a status
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "upstream_error"


def _replaying(name: str) -> Any:
    import httpx

    from .conftest import TRANSCRIPTS

    data = (TRANSCRIPTS / name).read_bytes()
    ctype = "text/event-stream" if name.endswith(".sse") else "application/json"
    return httpx.MockTransport(lambda request: httpx.Response(200, headers={"content-type": ctype}, content=data))


@pytest.mark.parametrize(("name", "streaming"), [
    ("08-openai-nonstream-parallel-tool-calls.json", False),
    ("19-azure-nonstream-tool-calls-prompt-filter.json", False),
    ("01-openai-stream-refusal-usage.sse", True),
    ("02-openai-stream-parallel-tool-calls-usage.sse", True),
    ("29-llamacpp-stream-tool-call-timings-crlf-as-documented.sse", True),
])
async def test_a_stream_assembles_to_the_json_answer_for_tool_calls_and_refusals(
    name: str, streaming: bool,
) -> None:
    """Review: from a source that cannot stream, the one chunk's tool calls had no
    ``index`` (the SDK's stream helper raised TypeError); and the role chunk said
    ``"content": ""`` before tool calls or a refusal, so a client assembling the stream
    got ``""`` where the JSON answer (and OpenAI's own stream) has null."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    from polygate.serve import open_server

    from ._serve_kit import GATEWAY_KEY

    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=streaming)],
            retry=polygate.Retry(max_attempts=1))},
        serve=polygate.Serve(api_keys=[GATEWAY_KEY]),
    )

    def both(base_url: str) -> tuple[Any, Any]:
        with sync_client(base_url) as client:
            answer = client.chat.completions.create(model="chat", messages=MESSAGES)
            state = ChatCompletionStreamState()
            for chunk in client.chat.completions.create(model="chat", messages=MESSAGES, stream=True):
                state.handle_chunk(chunk)
            return answer.choices[0].message, state.current_completion_snapshot.choices[0].message

    async with open_server(settings, port=0, transport=_replaying(name)) as server:
        whole, assembled = await in_thread(lambda: both(server.base_url))
    assert assembled.content == whole.content
    assert assembled.refusal == whole.refusal
    calls = whole.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in assembled.tool_calls or []] == [
        (c.id, c.function.name, c.function.arguments) for c in calls]


async def test_a_whole_answer_shown_as_a_stream_chunk_indexes_its_tool_calls() -> None:
    """The library's side: the one chunk of a JSON answer to ``stream_chat`` is an
    OpenAI delta, each tool call with its ``index``."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=False)])})
    async with polygate.session(
        settings, transport=_replaying("08-openai-nonstream-parallel-tool-calls.json")
    ) as s, s.stream_chat(MESSAGES) as stream:
        chunks = [c async for c in stream]
    [chunk] = chunks
    assert [c["index"] for c in chunk.delta["tool_calls"]] == [0, 1]


@pytest.mark.parametrize("upstream", ["later-choice-first", "openrouter-transcript"])
async def test_a_choice_role_reaches_the_sdk_once(upstream: str) -> None:
    """Outside review: a choice's role went to the client twice -- after a role chunk
    the gateway made for choice 0 when choice 1 came first (n = 2), and on every delta
    of OpenRouter, which repeats it -- and the SDK's accumulator, which joins strings,
    built role "assistantassistant"."""
    import json

    import httpx

    from polygate.serve import open_server

    from .conftest import TRANSCRIPTS

    if upstream == "later-choice-first":
        def ch(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"index": index, "delta": delta, "finish_reason": finish}

        events = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [c]} for c in (
            ch(1, {"role": "assistant", "content": "X"}), ch(0, {"role": "assistant", "content": "Y"}),
            ch(0, {}, "stop"), ch(1, {}, "stop"))]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        n = 2
    else:
        data = (TRANSCRIPTS / "15-openrouter-stream-reasoning-details-usage.sse").read_bytes()
        n = 1
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=data))
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                                       retry=polygate.Retry(max_attempts=1))},
        serve=polygate.Serve(api_keys=[GATEWAY_KEY]))
    async with open_server(settings, port=0, transport=transport) as server:

        def final() -> Any:
            with sync_client(server.base_url) as client, client.chat.completions.stream(
                    model="chat", messages=MESSAGES, n=n) as stream:
                return stream.get_final_completion()

        completion = await trio.to_thread.run_sync(final)
    assert [c.message.role for c in completion.choices] == ["assistant"] * n
    if upstream == "later-choice-first":
        assert [c.message.content for c in completion.choices] == ["Y", "X"]


async def test_every_relayed_event_is_a_chunk_of_one_stream() -> None:
    """Outside review (transcripts, 2026-12-03): Azure's annotation chunks arrive with
    a blank header (id "", created 0, model "", object ""); the gateway stamped the
    stream's id, time and model on them but relayed ``object: ""``, which the SDK's
    ``ChatCompletionChunk`` model refuses."""
    import httpx
    from openai.types.chat import ChatCompletionChunk

    from polygate.serve import open_server

    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                                       retry=polygate.Retry(max_attempts=1))},
        serve=polygate.Serve(api_keys=[GATEWAY_KEY]))
    transport = _replaying("10-azure-stream-async-filter-annotations.sse")
    body = {"model": "chat", "messages": MESSAGES, "stream": True}
    async with open_server(settings, port=0, transport=transport) as server:
        async with httpx.AsyncClient() as client:
            reply = await client.post(f"{server.base_url}/chat/completions", json=body,
                                      headers={"authorization": f"Bearer {GATEWAY_KEY}"})
    events = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: {")]
    assert len(events) > 3
    assert {(e["id"], e["object"], e["created"], e["model"]) for e in events} == {
        (events[0]["id"], "chat.completion.chunk", events[0]["created"], events[0]["model"])}
    for event in events:
        ChatCompletionChunk.model_validate(event)
