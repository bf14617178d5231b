"""``stream_chat()`` from a source that cannot stream (``Source(streaming=False)``):
its one JSON body is shown as one chunk, and that chunk's ``raw`` is a chunk as every
other a caller reads (a live stream's, a cache hit's replay): ``chat.completion.chunk``,
each choice with a ``delta``.  It was the whole ``chat.completion`` body, each choice a
``message``: code reading choice 1's tool calls from ``chunk.raw["choices"][1]["delta"]``
failed on that source alone (a review's find)."""

from __future__ import annotations

import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, ToolCall

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _settings(streaming: bool) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", streaming=streaming)])})


async def _chunks(streaming: bool) -> list[polygate.StreamChunk]:
    reply = Reply(text="Checking.", tool_calls=[ToolCall(name="get_weather", arguments={"city": "Paris"},
                                                         id="call_1")])
    async with polygate.session(_settings(streaming), transport=FakeUpstream(reply).transport()) as s:
        async with s.stream_chat(MESSAGES, n=2) as stream:
            return [chunk async for chunk in stream]


def _calls(chunks: list[polygate.StreamChunk], index: int) -> tuple[str, str]:
    """Choice ``index``'s first tool call, read from the chunks' raw deltas as a
    client of the SDK's chunk types reads it."""
    name = arguments = ""
    for chunk in chunks:
        for choice in chunk.raw["choices"]:
            if choice["index"] != index:
                continue
            for call in choice["delta"].get("tool_calls") or ():
                name += call.get("function", {}).get("name") or ""
                arguments += call.get("function", {}).get("arguments") or ""
    return name, arguments


async def test_a_whole_answer_is_one_chunk_shaped_as_a_chunk(autojump_clock: trio.testing.MockClock) -> None:
    [chunk] = await _chunks(streaming=False)
    assert chunk.raw["object"] == "chat.completion.chunk"
    assert chunk.raw["id"].startswith("chatcmpl-") and isinstance(chunk.raw["created"], int)
    assert [c["index"] for c in chunk.raw["choices"]] == [0, 1]
    assert all("delta" in c and "message" not in c for c in chunk.raw["choices"])
    assert chunk.raw["choices"][0]["delta"] == chunk.delta
    assert chunk.text == "Checking."


async def test_every_choice_reads_the_same_from_either_source(autojump_clock: trio.testing.MockClock) -> None:
    whole, streamed = await _chunks(streaming=False), await _chunks(streaming=True)
    for index in (0, 1):
        assert _calls(whole, index) == _calls(streamed, index) == ("get_weather", '{"city":"Paris"}')


async def test_a_source_that_cannot_stream_may_still_answer_with_events(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An upstream (or a proxy before it) that streams whatever it is asked, labelled
    ``text/event-stream``, answers a plain JSON request readably: it was refused as
    "malformed upstream body: not JSON", a transient failure against the source's
    breaker on every call (a streaming source that answers JSON was always read)."""
    reply = Reply(text="Hello there.", tool_calls=[ToolCall(name="f", id="call_1")])
    answers = []
    for forced in (True, False):
        upstream = FakeUpstream(Reply(**{**_fields(reply), "stream": forced}))
        async with polygate.session(_settings(False), transport=upstream.transport()) as s:
            answers.append(await s.chat(MESSAGES, n=2))
        assert upstream.requests[0].body.get("stream") is not True
    events, plain = answers
    assert events.choices == plain.choices and events.message == plain.message
    assert events.text == "Hello there."
    # (Its usage is polygate's estimate: a plain request asks no stream_options, so
    # the events carry none, as a real server's would not.)
    assert (events.usage.source, plain.usage.source) == ("estimated", "upstream")


def _fields(reply: Reply) -> dict[str, object]:
    import attrs

    return {a.name: getattr(reply, a.name) for a in attrs.fields(Reply)}


async def test_a_json_answer_labelled_as_events_is_still_read() -> None:
    """Review of the change above: a plain request's answer labelled
    ``text/event-stream`` was then read as events without a look, and a JSON body so
    labelled (a proxy that labels every answer of /chat/completions so; before, a
    source's ``streaming=False`` was the way around it) failed as a truncated stream,
    three attempts against the source's breaker.  The body decides, as it does for an
    unlabelled answer to a stream request."""
    import json

    from ._raw_server import answering, raw_server

    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    async with raw_server(answering(json.dumps(body).encode())) as upstream:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=upstream.url, streaming=False)])})
        async with polygate.session(settings) as s:
            answer = await s.chat(MESSAGES)
            async with s.stream_chat(MESSAGES) as stream:
                chunks = [chunk async for chunk in stream]
    assert answer.text == "Hello" and answer.usage.source == "upstream"
    assert answer.call_stats.attempts == 1 and answer.call_stats.ttft_ms is None
    assert "".join(c.text for c in chunks) == "Hello"
