"""FakeUpstream answers with tool calls (``Reply(tool_calls=[ToolCall(...)])``): an
application's agent loop tested against the kit needs a model that calls its tools.

Each face (a streamed answer, a plain JSON answer, the loopback server) must send
what a real model sends, so the assembled message of a stream equals the JSON
answer's, the openai SDK's types parse every chunk and answer, and the tokens keep
their scripted times."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import polygate
from polygate.testing import FakeUpstream, RecordedRequest, Reply, ToolCall

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
WEATHER = ToolCall(name="get_weather", arguments={"city": "Paris", "unit": "celsius"}, id="call_1")


def _settings(streaming: bool) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url="http://a/v1", streaming=streaming)])})


async def _both_faces(reply: Reply, **params: Any) -> tuple[polygate.ChatResponse, polygate.ChatResponse]:
    """The same reply, streamed and as plain JSON."""
    answers = []
    for streaming in (True, False):
        async with polygate.session(_settings(streaming), transport=FakeUpstream(reply).transport()) as s:
            answers.append(await s.chat(MESSAGES, tools=TOOLS, **params))
    return answers[0], answers[1]


async def test_a_tool_call_streams_into_the_message_a_json_answer_has(
    autojump_clock: trio.testing.MockClock,
) -> None:
    streamed, plain = await _both_faces(Reply(tool_calls=[WEATHER]))
    assert streamed.message == plain.message == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}],
    }
    assert streamed.finish_reason == plain.finish_reason == "tool_calls"
    assert streamed.text == plain.text == ""
    # One token for the call's head, one for each 8-character piece of its arguments.
    assert streamed.usage.completion_tokens == plain.usage.completion_tokens == 1 + 5


async def test_text_and_several_calls_keep_their_order(autojump_clock: trio.testing.MockClock) -> None:
    calls = [WEATHER, ToolCall(name="get_time", arguments='{"tz": "CET"}', id="call_2")]
    streamed, plain = await _both_faces(Reply(text="Let me check.", tool_calls=calls), n=2)
    assert streamed.choices == plain.choices
    for choice in streamed.choices:
        message = choice["message"]
        assert message["content"] == "Let me check."
        assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in message["tool_calls"]] == [
            ("call_1", "get_weather", '{"city":"Paris","unit":"celsius"}'),
            ("call_2", "get_time", '{"tz": "CET"}'),
        ]
        assert choice["finish_reason"] == "tool_calls"


async def test_max_tokens_cuts_a_call_short_on_both_faces(autojump_clock: trio.testing.MockClock) -> None:
    streamed, plain = await _both_faces(Reply(tool_calls=[WEATHER]), max_tokens=3)
    assert streamed.message == plain.message
    assert streamed.finish_reason == plain.finish_reason == "length"
    # The head and two pieces: the arguments as far as the model got.
    assert streamed.message["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris",'


async def test_each_request_gets_ids_of_its_own_unless_the_script_names_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeUpstream(Reply(tool_calls=[ToolCall(name="f"), ToolCall(name="g", id="mine")]))
    async with polygate.session(_settings(True), transport=fake.transport()) as s:
        first = await s.chat(MESSAGES)
        second = await s.chat(MESSAGES)
    ids = [[c["id"] for c in r.message["tool_calls"]] for r in (first, second)]
    assert ids == [["call_fake_0_0", "mine"], ["call_fake_1_0", "mine"]]
    assert first.message["tool_calls"][0]["function"]["arguments"] == "{}"


async def test_the_pieces_keep_the_scripted_token_times(autojump_clock: trio.testing.MockClock) -> None:
    reply = Reply(tool_calls=[WEATHER], first_token_s=1.0, inter_token_s=0.5, stall_at=2, stall_s=10)
    async with polygate.session(_settings(True), transport=FakeUpstream(reply).transport()) as s:
        async with s.stream_chat(MESSAGES, tools=TOOLS) as stream:
            times = [trio.current_time() async for _ in stream]
    # Tokens 0..5 at 1, 1.5, then 10 s of silence before token 2, then every 0.5 s.
    assert times[:6] == [1.0, 1.5, 12.0, 12.5, 13.0, 13.5]
    assert stream.response.message["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_an_agent_loop_runs_against_the_fake(autojump_clock: trio.testing.MockClock) -> None:
    """The use the feature is for: a behaviour that calls the tool until it has its
    result, then answers."""

    def model(request: RecordedRequest, _rng: object) -> Reply:
        if request.body["messages"][-1]["role"] == "tool":
            return Reply(text="It is 18 degrees in Paris.")
        return Reply(tool_calls=[ToolCall(name="get_weather", arguments={"city": "Paris"})])

    fake = FakeUpstream(model)
    history: list[dict[str, Any]] = list(MESSAGES)
    async with polygate.session(_settings(True), transport=fake.transport()) as s:
        while True:
            response = await s.chat(history, tools=TOOLS)
            history.append(response.message)
            if response.finish_reason != "tool_calls":
                break
            for call in response.message["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                history.append({"role": "tool", "tool_call_id": call["id"], "content": f"18C in {args['city']}"})
    assert response.text == "It is 18 degrees in Paris."
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert fake.requests[1].body["messages"][2]["tool_call_id"] == "call_fake_0_0"


async def test_on_loopback_the_sdk_types_parse_every_chunk_and_answer() -> None:
    fake = FakeUpstream(Reply(text="On it.", tool_calls=[WEATHER, ToolCall(name="g")]))
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as client:
        body = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
        plain = ChatCompletion.model_validate((await client.post("/chat/completions", json=body)).json())
        chunks = []
        async with client.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(ChatCompletionChunk.model_validate_json(line[6:]))
    message = plain.choices[0].message
    assert message.content == "On it." and plain.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name) for c in message.tool_calls or ()] == [("call_1", "get_weather"),
                                                                            ("call_fake_0_1", "g")]
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            calls.setdefault(call.index, []).append(call.function.arguments if call.function else "")
    assert {i: "".join(parts) for i, parts in calls.items()} == {
        0: '{"city":"Paris","unit":"celsius"}', 1: "{}"}


@pytest.mark.parametrize(("make", "error", "words"), [
    (lambda: ToolCall(name=""), ValueError, "name must be a non-empty string"),
    (lambda: ToolCall(name=3), ValueError, "name must be a non-empty string"),
    (lambda: ToolCall(name="f\ud800"), ValueError, "name is not UTF-8"),
    (lambda: ToolCall(name="f", id=""), ValueError, "id must be a non-empty string"),
    (lambda: ToolCall(name="f", arguments=object()), TypeError, "arguments must be a string or a JSON value"),
    (lambda: ToolCall(name="f", arguments={"x": float("nan")}), TypeError, "arguments must be"),
    (lambda: Reply(tool_calls=WEATHER), TypeError, "tool_calls must be a sequence of ToolCall"),
    (lambda: Reply(tool_calls=[{"name": "f"}]), TypeError, "tool_calls must hold ToolCall objects"),
])
def test_a_tool_call_mistake_is_named_as_it_is_written(make: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        make()


def test_a_scripted_finish_reason_stays_and_a_reply_stays_hashable() -> None:
    assert Reply(tool_calls=[WEATHER], finish_reason="stop").finish_reason == "stop"
    assert Reply().finish_reason == "stop"
    assert hash(Reply(tool_calls=[WEATHER])) == hash(Reply(tool_calls=(WEATHER,)))


def test_the_server_process_takes_tool_calls_as_json() -> None:
    from polygate.testing.serve import parse_behaviour

    reply = parse_behaviour(None, '{"tool_calls": [{"name": "f", "arguments": {"x": 1}}]}')
    assert isinstance(reply, Reply) and reply.tool_calls == (ToolCall(name="f", arguments='{"x":1}'),)
    base = parse_behaviour('{"base": {"tool_calls": [{"name": "f"}]}, "p_429": 0.5}', None)
    assert base.base.tool_calls == (ToolCall(name="f"),)  # type: ignore[union-attr]
    done = subprocess.run(
        [sys.executable, "-m", "polygate.testing.serve", "--reply", '{"tool_calls": [{"nme": "f"}]}'],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "unknown tool call field(s) nme" in done.stderr


def test_a_tool_call_is_written_as_the_reference_writes_it() -> None:
    """Review: ``ToolCall(name, arguments="{}", id=None)`` in docs/reference.md, and
    a keyword-only class refused ``ToolCall("f")``."""
    assert ToolCall("f", {"x": 1}, "call_9") == ToolCall(name="f", arguments='{"x":1}', id="call_9")


async def test_an_empty_text_beside_tool_calls_is_an_empty_content(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: ``text=""`` is given, so the content is "" (null is for no text)."""
    streamed, plain = await _both_faces(Reply(text="", tool_calls=[WEATHER]))
    assert streamed.message["content"] == plain.message["content"] == ""
    assert streamed.message["tool_calls"] == plain.message["tool_calls"]


def test_a_profile_places_stalls_and_faults_among_its_bases_tool_pieces() -> None:
    """Review: a Profile drew stall and fault positions from its drawn ``tokens``,
    which count nothing beside tool calls: every stall came before the finish chunk,
    and a fault never past piece 8 of a longer call."""
    import random

    from polygate.testing import Profile

    base = Reply(tool_calls=[ToolCall("f", "x" * 72)])  # 1 head + 9 pieces = 10 tokens
    profile = Profile(base=base, tokens=40, stall_p=1.0, stall_s=5.0, p_truncated=1.0)
    rng = random.Random(0)
    drawn = [profile.draw(rng) for _ in range(200)]
    assert {r.stall_at for r in drawn} == set(range(1, 10))  # strictly inside the 10
    assert max(r.fault_after for r in drawn) == 10 and min(r.fault_after for r in drawn) == 0


async def test_an_oversized_body_still_goes_out_in_large_pieces() -> None:
    """The tool calls' 8-character argument pieces were first named as the module's
    1 MiB body pieces were: an oversized fault then went out 8 bytes at a time."""
    fake = FakeUpstream(Reply(fault="oversized", oversized_bytes=4 << 20, stream=False))
    async with httpx.AsyncClient(transport=fake.transport(), base_url="http://a/v1") as client:
        async with client.stream("POST", "/chat/completions", json={"messages": MESSAGES}) as r:
            sizes = [len(piece) async for piece in r.aiter_raw()]
    assert sum(sizes) >= 4 << 20 and len(sizes) <= 8

