"""What callers pass in, and what they do with it while the call runs (an outside
review, "what real callers pass in"): every attempt of a call sends the call as it was
made, whatever the caller changes meanwhile; an openai SDK message object is a
message; the SDK's own request options are refused, not sent as body fields."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pydantic
import pytest
import trio
import trio.testing
from openai.types.chat import ChatCompletion

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import SECRET

HI = [{"role": "user", "content": "hi"}]


def _tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _renaming(tools: list[dict[str, Any]], reply: Reply) -> Any:
    """A behaviour that renames the caller's first tool, as a caller building its next
    request would while this one is in flight, then answers ``reply``."""
    def behaviour(_request: Any, _rng: Any) -> Reply:
        tools[0]["function"]["name"] = "CHANGED"
        return reply
    return behaviour


def _settings(names: tuple[str, ...] = ("a", "b"), *, cache: str | None = None,
              **scope: Any) -> polygate.Settings:
    # a first, b a near-certain second: the order of the attempts is known.
    weights = {"a": 1.0, "b": 1e-9}
    sources = [polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, weight=weights[n])
               for n in names]
    if cache:
        scope["cache_ttl_s"] = 60
        return polygate.Settings(scopes={"chat": polygate.Scope(sources=sources, **scope)}, cache=cache)
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=sources, **scope)})


def _bodies(*upstreams: FakeUpstream) -> list[dict[str, Any]]:
    requests = sorted((r for u in upstreams for r in u.requests), key=lambda r: r.started_at)
    return [r.body for r in requests]


# ------------------------------------------------------------------ changed meanwhile


async def test_a_retry_sends_the_parameters_as_the_call_made_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The caller edits its tools list and a nested dict while attempt 1 is in flight:
    attempt 2 sent the edits (only the messages were encoded once)."""
    tools = _tools()
    extra = {"k": "v"}

    def first(_request: Any, _rng: Any) -> Reply:
        tools.append({"type": "function", "function": {"name": "g", "parameters": {}}})
        tools[0]["function"]["name"] = "CHANGED"
        extra["k"] = "CHANGED"
        return Reply(status=500)

    a, b = FakeUpstream(first), FakeUpstream(Reply())
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        await s.chat(HI, tools=tools, vendor_field=extra)
    one, two = _bodies(a, b)
    assert one["tools"] == two["tools"] == _tools()
    assert one["vendor_field"] == two["vendor_field"] == {"k": "v"}


async def test_a_retry_sends_the_messages_as_the_call_made_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]

    def first(_request: Any, _rng: Any) -> Reply:
        messages[0]["content"][0]["text"] = "CHANGED"  # type: ignore[index]
        messages.append({"role": "user", "content": "more"})
        return Reply(status=500)

    a, b = FakeUpstream(first), FakeUpstream(Reply())
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        await s.chat(messages)
    one, two = _bodies(a, b)
    assert one["messages"] == two["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


async def test_a_hedge_sends_the_parameters_as_the_call_made_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tools = _tools()
    hung = _renaming(tools, Reply(first_token_s=90))
    a, b = FakeUpstream(hung), FakeUpstream(Reply(first_token_s=0.5))
    settings = _settings(hedge=polygate.Hedge(after_s=2.0))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        response = await s.chat(HI, tools=tools)
    assert response.call_stats.hedges == 1
    one, two = _bodies(a, b)
    assert one["tools"] == two["tools"] == _tools()


async def test_a_reask_repeats_the_messages_as_the_call_made_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A re-ask round encoded the caller's dicts again: an edit made while round 1
    was in flight was asked in round 2."""
    messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    answers = iter([Reply(text="not json"), Reply(text='{"x": 1}')])

    def reply(_request: Any, _rng: Any) -> Reply:
        messages[1]["content"] = "CHANGED"
        return next(answers)

    a = FakeUpstream(reply)
    async with polygate.session(_settings(("a",)), transport=Router({"a": a})) as s:
        response = await s.chat(messages, schema=schema)
    assert response.call_stats.reasks == 1
    first, second = (r.body["messages"] for r in a.requests)
    assert first == [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]
    assert second[:2] == first


async def test_a_continuation_asks_the_question_as_the_call_made_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    messages = [{"role": "user", "content": "hi"}]

    def cut(_request: Any, _rng: Any) -> Reply:
        messages[0]["content"] = "CHANGED"
        return Reply(tokens=8, fault="truncated", fault_after=3)

    a, b = FakeUpstream(cut), FakeUpstream(Reply())
    settings = _settings(stream=polygate.StreamWatch(resume=True))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(messages) as stream:
            async for _ in stream:
                pass
    assert len(b.requests) == 1
    assert b.requests[0].body["messages"][0] == {"role": "user", "content": "hi"}


def _named_answer(request: Any, _rng: Any) -> Reply:
    return Reply(text="answer-for-" + request.body["tools"][0]["function"]["name"])


async def test_the_cache_stores_the_answer_to_the_call_as_made(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The entry's key is the call as made; its answer was the edited request's, served
    to every identical call until it expired."""
    tools = _tools()
    first = _renaming(tools, Reply(status=500))
    a, b = FakeUpstream(first), FakeUpstream(_named_answer)
    async with polygate.session(_settings(cache="memory"), transport=Router({"a": a, "b": b})) as s:
        await s.chat(HI, tools=tools)
        again = await s.chat(HI, tools=_tools())
    assert again.call_stats.cached
    assert again.text == "answer-for-f"


async def test_a_coalesced_waiter_gets_the_answer_to_its_own_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tools = _tools()
    first = _renaming(tools, Reply(status=500, headers_delay_s=1))
    a, b = FakeUpstream(first), FakeUpstream(_named_answer)
    answers: dict[str, polygate.ChatResponse] = {}
    async with polygate.session(_settings(cache="memory"), transport=Router({"a": a, "b": b})) as s:

        async def leader() -> None:
            answers["leader"] = await s.chat(HI, tools=tools)

        async def waiter() -> None:
            await trio.sleep(0.1)
            answers["waiter"] = await s.chat(HI, tools=_tools())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader)
            nursery.start_soon(waiter)
    assert answers["waiter"].text == answers["leader"].text == "answer-for-f"
    assert len(b.requests) == 1


async def test_plain_parameters_and_messages_are_sent_unchanged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The copies are of what the wire carries: an int subclass, a str subclass, a
    tuple and a read-only mapping go out as json writes them."""
    import enum
    import types

    class Size(enum.IntEnum):
        SMALL = 8

    class Name(str):
        pass

    a = FakeUpstream(Reply())
    async with polygate.session(_settings(("a",)), transport=Router({"a": a})) as s:
        await s.chat((types.MappingProxyType({"role": Name("user"), "content": "hi"}),),
                     max_tokens=Size.SMALL, stop=("x", "y"), logit_bias={5: 1})
    body = a.requests[0].body
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_tokens"] == 8 and body["stop"] == ["x", "y"] and body["logit_bias"] == {"5": 1}


# ------------------------------------------------------------------ the SDK's objects


def _sse(*deltas: tuple[dict[str, Any], str | None]) -> bytes:
    events = [json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
              for delta, finish in deltas]
    return "".join(f"data: {event}\n\n" for event in [*events, "[DONE]"]).encode()


async def test_an_openai_sdk_message_in_the_history_is_a_message() -> None:
    """The SDK's guides append ``completion.choices[0].message`` to the history; it was
    refused as "must be an object with a string 'role'" (it has one)."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answers = [_sse(({"role": "assistant", "content": None, "tool_calls": [call]}, None), ({}, "tool_calls")),
               _sse(({"role": "assistant", "content": "done"}, None), ({}, "stop"))]
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=answers.pop(0))

    settings = _settings(("a",))
    async with polygate.session(settings, transport=httpx.MockTransport(handler)) as s:
        first = await s.chat(HI, tools=_tools())
        sdk = ChatCompletion.model_validate(first.raw).choices[0].message
        history = [*HI, sdk, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
        second = await s.chat(history, tools=_tools())
    assert second.text == "done"
    message = sent[1]["messages"][1]
    assert message["role"] == "assistant"
    assert message["tool_calls"][0]["id"] == "call_1"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert history[1] is sdk  # the caller's list is left as it was


async def test_an_object_that_is_no_message_is_refused_naming_its_type() -> None:
    class NotAMessage(pydantic.BaseModel):
        text: str

    async with polygate.session(_settings(("a",)), transport=Router({"a": FakeUpstream(Reply())})) as s:
        with pytest.raises(polygate.ConfigError, match=r"messages\[0\] must be an object with a string 'role'"):
            await s.chat([NotAMessage(text="hi")])
        with pytest.raises(polygate.ConfigError, match=r"messages\[1\] .*got int"):
            await s.chat([*HI, 5])


@pytest.mark.parametrize("option", ["extra_body", "extra_headers", "extra_query", "timeout"])
async def test_the_sdks_request_options_are_refused_not_sent(option: str) -> None:
    """Code ported from ``client.chat.completions.create(...)`` sent them upstream as
    top-level body fields."""
    value = 30 if option == "timeout" else {"top_k": 20}
    a = FakeUpstream(Reply())
    async with polygate.session(_settings(("a",)), transport=Router({"a": a})) as s:
        with pytest.raises(polygate.ConfigError, match=f"'{option}' is an option of the openai SDK"):
            await s.chat(HI, **{option: value})
        with pytest.raises(polygate.ConfigError, match=f"'{option}' is an option of the openai SDK"):
            s.stream_chat(HI, **{option: value})
    assert a.requests == []


async def test_embed_refuses_a_schema_class_and_stream_by_name() -> None:
    class Answer(pydantic.BaseModel):
        x: int

    a = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)])})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.ConfigError, match="embed\\(\\) takes no schema"):
            await s.embed(["x"], schema=Answer)
        with pytest.raises(polygate.ConfigError, match="embed\\(\\) takes no 'stream'"):
            await s.embed(["x"], stream=True)
    assert a.requests == []


async def test_a_dict_message_may_hold_the_sdks_tool_call_objects() -> None:
    """The guides' other way to write the same history: ``{"role": "assistant",
    "content": m.content, "tool_calls": m.tool_calls}``, the SDK's objects inside."""
    from openai.types.chat import ChatCompletionMessageToolCall

    call = ChatCompletionMessageToolCall.model_validate(
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}})
    a = FakeUpstream(Reply())
    async with polygate.session(_settings(("a",)), transport=Router({"a": a})) as s:
        await s.chat([*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    assert a.requests[0].body["messages"][1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]


@pytest.mark.parametrize("by_name", [False, True])
def test_an_aio_call_already_running_keeps_the_arguments_it_was_made_with(by_name: bool) -> None:
    """polygate.aio hands the call to trio after its caller's task yielded twice: the
    copy was taken there, after the caller's edits (trio's is taken before the call's
    first checkpoint); then, for arguments given by name, still."""
    import asyncio
    import collections

    import polygate.aio

    upstream = FakeUpstream(Reply())
    embedder = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)]),
        "embed": polygate.Scope(sources=[polygate.Source(name="e", base_url="http://e/v1", api_key=SECRET)])})

    async def main() -> None:
        async with polygate.aio.session(settings, transport=Router({"a": upstream, "e": embedder})) as s:
            history = [{"role": "user", "content": "A"}]
            tools = _tools()
            inputs = collections.deque(["A"])
            call = asyncio.create_task(s.chat(messages=history, tools=tools) if by_name
                                       else s.chat(history, tools=tools))
            embedding = asyncio.create_task(s.embed(inputs=inputs) if by_name else s.embed(inputs))
            await asyncio.sleep(0)  # the calls' tasks have run their first step
            assert not call.done() and not embedding.done()
            history[0]["content"] = "CHANGED"
            history.append({"role": "user", "content": "next"})
            tools[0]["function"]["name"] = "CHANGED"
            inputs.append("more")
            await call
            await embedding

    asyncio.run(main())
    body = upstream.requests[0].body
    assert body["messages"] == [{"role": "user", "content": "A"}]
    assert body["tools"] == _tools()
    assert embedder.requests[0].body["input"] == ["A"]


@pytest.mark.parametrize("field", ["timeout", "extra_body", "extra_headers", "extra_query"])
async def test_through_the_gateway_such_names_are_the_clients_vendor_fields(field: str) -> None:
    """A gateway's body is a client's wire, where every other field goes upstream as
    it was written (docs/serve.md): the library's refusal of the SDK's options made
    them a 400 there."""
    from ._serve_kit import AUTH, CHAT, gateway, http

    value: Any = 30 if field == "timeout" else {"x": 1}
    async with gateway() as (server, upstream):
        answer = await http(server, "POST", "/v1/chat/completions", {**CHAT, field: value}, AUTH)
        embedded = await http(server, "POST", "/v1/embeddings",
                              {"model": "embed", "input": ["a"], "stream": False}, AUTH)
    assert answer.status == 200 and embedded.status == 200
    assert upstream.requests[0].body[field] == value


# ------------------------------------------------------------------ an agent's loop


def _long_history(turns: int = 20) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for turn in range(turns):
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        history += [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{turn}", "content": "y" * 50_000}]
    return history


async def test_a_finished_stream_holds_no_copy_of_the_history(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An agent keeps the stream for its response until the next turn: it held the
    call's copy of the whole history twice (objects and JSON) as long as that."""
    import gc
    import tracemalloc

    history = _long_history()
    size = len(json.dumps(history))  # ~1 MB
    a = FakeUpstream(Reply())
    async with polygate.session(_settings(("a",)), transport=Router({"a": a})) as s:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            async with s.stream_chat(history) as stream:
                async for _ in stream:
                    pass
            a.requests.clear()  # (the fake's record of the request is a copy too)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert stream.response.text
    assert held < size / 5


async def test_a_history_over_every_tpm_says_what_it_needs_and_what_is_allowed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The refusal said "no source admitted the call (a: too_large)": an agent could
    not tell how much of its history to drop, nor whether its max_tokens was the
    cause; through a fallback, the first scope's limits were left out."""
    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, tpm=10_000)
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="big", base_url="http://b/v1", api_key=SECRET,
                                                        tpm=20_000)], fallback="small"),
        "small": polygate.Scope(sources=[source])})
    upstream = FakeUpstream(Reply())
    async with polygate.session(settings, transport=Router({"a": upstream, "big": upstream})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as history:
            await s.chat(_long_history(2), max_tokens=100)
        with pytest.raises(polygate.AllSourcesExhausted) as budget:
            await s.chat(HI, max_tokens=30_000)
    message = str(history.value)
    assert history.value.too_large
    needed = int(message.split("needs about ")[1].split(" tokens")[0].replace(",", ""))
    assert needed > 20_000
    assert "the completion's budget 100)" in message
    assert "tpm: big 20,000 in 'chat', a 10,000 in 'small'" in message
    assert "the completion's budget 30,000)" in str(budget.value)
    assert upstream.requests == []


async def test_an_embedding_batch_over_every_tpm_says_so(autojump_clock: trio.testing.MockClock) -> None:
    source = polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, tpm=1_000)
    settings = polygate.Settings(scopes={"embed": polygate.Scope(sources=[source], embed_batch_size=2)})
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.embed(["word " * 700] * 4)
    message = str(caught.value)
    assert "one batch of its inputs needs about" in message and "embed_batch_size is 2" in message
    assert "completion" not in message and "tpm: a 1,000" in message


async def test_no_over_tpm_detail_where_an_earlier_scope_took_the_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first scope admitted the call and failed; its fallback refused it as too
    large: the message said no source may take it, listing the one that did."""
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="big", base_url="http://b/v1", api_key=SECRET,
                                                        tpm=1_000_000)],
                               retry=polygate.Retry(max_attempts=1), fallback="small"),
        "small": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET,
                                                         tpm=1_000)])})
    router = Router({"big": FakeUpstream(Reply(status=500)), "a": FakeUpstream(Reply())})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.chat(_long_history(1), max_tokens=10)
    assert not caught.value.too_large
    message = str(caught.value)
    assert "needs about" not in message and "tpm:" not in message
    assert "no source admitted the call (a: too_large) after 0 failed attempt(s) in scope 'small'" in message


def test_an_aio_call_keeps_its_schema_as_made() -> None:
    import asyncio

    import polygate.aio

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    upstream = FakeUpstream(Reply(text='{"x": 1}'))

    async def main() -> Any:
        async with polygate.aio.session(_settings(("a",)), transport=Router({"a": upstream})) as s:
            call = asyncio.create_task(s.chat(HI, schema=schema))
            await asyncio.sleep(0)
            schema["properties"]["x"]["type"] = "string"  # type: ignore[index]
            return await call

    assert asyncio.run(main()).parsed == {"x": 1}
    sent = upstream.requests[0].body["response_format"]["json_schema"]["schema"]
    assert sent["properties"]["x"]["type"] == "integer"


@pytest.mark.parametrize(("kind", "given", "meant"), [
    ("chat", "call_deadline", "call_deadline_s"), ("chat", "deadline_s", "call_deadline_s"),
    ("chat", "scopes", "scope"), ("chat", "cached", "cache"), ("chat", "schemas", "schema"),
    ("stream", "call_deadline", "call_deadline_s"), ("embed", "scopes", "scope"),
    ("aio", "call_deadline", "call_deadline_s"),
    # (A review of the check: these went upstream still.)
    ("chat", "deadline", "call_deadline_s"), ("chat", "deadline_ms", "call_deadline_s"),
    ("chat", "Scope", "scope"), ("chat", "CACHE", "cache"), ("chat", "scope_name", "scope"),
])
async def test_a_misspelt_argument_of_the_call_is_refused_not_sent(kind: str, given: str, meant: str) -> None:
    """Review finding (polygate as a typed library): `chat(M, call_deadline=5)` passed
    both type checkers and went to the upstream as a request field; the call ran
    without the 5 s deadline its caller asked for (60 s against a slow upstream under
    the default timeouts, or more), silently."""
    a = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={name: polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)]) for name in ("chat", "embed")})
    match = f"got '{given}', which is not one of its own arguments .* did you mean {meant}="
    if kind == "aio":
        import asyncio

        from polygate import aio

        async def on_asyncio() -> None:
            async with aio.session(settings, transport=Router({"a": a})) as s:
                with pytest.raises(polygate.ConfigError, match=match):
                    await s.chat(HI, **{given: 5})

        await trio.to_thread.run_sync(asyncio.run, on_asyncio())
    else:
        async with polygate.session(settings, transport=Router({"a": a})) as s:
            with pytest.raises(polygate.ConfigError, match=match):
                if kind == "chat":
                    await s.chat(HI, **{given: 5})
                elif kind == "stream":
                    s.stream_chat(HI, **{given: 5})
                else:
                    await s.embed(["x"], scope="embed", **{given: 5})
    assert a.requests == []


async def test_the_usual_fields_near_no_argument_of_the_call_still_go_upstream() -> None:
    a = FakeUpstream(Reply())
    async with polygate.session(_settings(("a",)), transport=Router({"a": a})) as s:
        await s.chat(HI, cache_prompt=True, cache_control={"type": "ephemeral"}, seed=1,
                     prompt_cache_key="k", max_tokens=3, temperature=0.2)
    assert {"cache_prompt", "cache_control", "seed", "prompt_cache_key"} <= set(a.requests[0].body)
