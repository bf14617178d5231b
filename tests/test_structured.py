"""Structured output (SPEC §8.1) through the fake transport under MockClock: the
response_format sent, validation, re-asks inside one logical call and one deadline,
the statistics of the last round, the per-source ways of asking, stream_chat, and bad
schemas refused before any I/O."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pydantic
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import polygate
from polygate.testing import FakeUpstream, RecordedRequest, Reply, Router

from .conftest import FIRST_A, MESSAGES, one_source_settings, two_source_settings


class Answer(pydantic.BaseModel):
    city: str
    population: int


GOOD = '{"city": "Paris", "population": 2100000}'
WRONG_TYPE = '{"city": "Paris", "population": "lots"}'
NOT_JSON = "Paris, about two million people."

CITY_SCHEMA: dict[str, Any] = {
    "title": "City",
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


def by_round(*replies: Reply) -> Any:
    """A behaviour answering by round: the round is the number of assistant messages
    (answers already re-asked about) in the request."""

    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        done = sum(1 for m in rec.body["messages"] if m.get("role") == "assistant")
        return replies[min(done, len(replies) - 1)]

    return behaviour


def with_structured(settings: polygate.Settings, max_reasks: int) -> polygate.Settings:
    scope = settings.scopes["chat"]
    new = attrs.evolve(scope, structured=polygate.Structured(max_reasks=max_reasks))
    return attrs.evolve(settings, scopes={"chat": new})


# --------------------------------------------------------------------------- the happy path


async def test_first_answer_valid(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text=GOOD))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed == Answer(city="Paris", population=2100000)
    assert isinstance(r.parsed, Answer)
    assert r.text == GOOD
    assert r.call_stats.reasks == 0 and r.call_stats.attempts == 1
    [req] = up.requests
    assert req.body["messages"] == MESSAGES
    assert req.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Answer", "schema": Answer.model_json_schema(), "strict": True},
    }


async def test_dict_schema_parses_to_the_json_value(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text=GOOD))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=CITY_SCHEMA)
    assert r.parsed == {"city": "Paris", "population": 2100000}
    rf = up.requests[0].body["response_format"]
    assert rf["json_schema"] == {"name": "City", "schema": CITY_SCHEMA, "strict": True}


@pytest.mark.parametrize("fence", [
    "```json\n{}\n```", "``` json\n{}\n```", "~~~\n{}\n~~~", "````json\n{}\n````", "\n```JSON \r\n{}\r\n```\n",
])
async def test_fenced_answer_is_accepted(autojump_clock: trio.testing.MockClock, fence: str) -> None:
    """Every CommonMark fence around the whole answer (a review found an info string
    after a space, tildes and longer fences re-asked)."""
    up = FakeUpstream(Reply(text=fence.replace("{}", GOOD)))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed == Answer(city="Paris", population=2100000)
    assert r.call_stats.reasks == 0


_FENCE_AS_A_REGEX = (
    # The fence rule as one regular expression (as it was written before): the oracle.
    r"\A\s*(?P<fence>`{3,}|~{3,})[ \t]*[A-Za-z0-9_+.-]*[ \t]*\r?\n(?P<body>.*?)\r?\n?[ \t]*"
    r"(?P=fence)\s*\Z"
)


@hsettings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(
    ["`", "```", "````", "~~~", " ", "\t", "\n", "\r\n", "\r", "json", "{", "}", "x y", "é"]
), max_size=20).map("".join))
def test_the_fence_is_read_as_commonmark_writes_it(text: str) -> None:
    import re

    from polygate._structured import _unfenced

    match = re.match(_FENCE_AS_A_REGEX, text, re.S)
    assert _unfenced(text) == (match.group("body") if match else text)


@pytest.mark.parametrize("text", [
    '```json\n{"city": "Paris",' + " " * 60_000 + "x",  # blanks, then no closing fence
    "```" + " " * 60_000 + "json x\n{}\n```",  # blanks in the opening line
])
def test_a_fenced_answer_is_read_in_linear_time(text: str) -> None:
    """Outside review: one regular expression for the whole fenced answer backtracked
    over a run of blanks, quadratic (a 30 KB answer held the event loop 4 s, a 50 KB
    one overran its deadline by 4 s from a worker thread that held the GIL)."""
    from polygate._structured import _unfenced

    started = time.perf_counter()
    _unfenced(text)
    assert time.perf_counter() - started < 0.5


def test_an_unterminated_string_of_escapes_is_scanned_in_linear_time() -> None:
    """Outside review: the nesting check's string pattern failed at the end of an
    unterminated string and started again at every later quote mark: quadratic, run on
    every answer to a dict schema, every upstream body and every request to the
    gateway (40 KB: 3.6 s)."""
    from polygate._json import nested_deeper

    for tail in (b'\\"', b"\\\n"):
        data = b"[" * 300 + b'"' + tail * 30_000
        started = time.perf_counter()
        assert nested_deeper(data, 256)  # the 300 brackets before it still count
        assert not nested_deeper(data, 300)
        assert time.perf_counter() - started < 0.5


def test_a_model_given_as_schema_is_not_kept_alive() -> None:
    """Outside review: the cache of models' JSON Schemas was weak in its keys, but its
    values held the model (and its bound validator): every model ever passed stayed,
    a class made per request among them."""
    import gc
    import weakref

    from polygate._structured import schema_of

    model: Any = pydantic.create_model("Made", x=(int, ...))
    assert schema_of(model).validate('{"x": 1}').x == 1
    assert schema_of(model).json_schema is schema_of(model).json_schema  # built once
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kind", ["model", "dict"])
async def test_a_lone_surrogate_escape_is_refused_by_both_kinds_of_schema(
    autojump_clock: trio.testing.MockClock, kind: str
) -> None:
    """Outside review: an answer escaping a lone surrogate ("P\\ud800") was re-asked
    under a model (pydantic's reader refuses it) and handed over in ``parsed`` under a
    JSON Schema dict, where it could be neither encoded nor sent back."""

    class City(pydantic.BaseModel):
        city: str
        population: int

    schema: Any = City if kind == "model" else {"type": "object"}
    up = FakeUpstream([Reply(text='{"city": "P\\ud800", "population": 1}'),
                       Reply(text='{"city": "P\\ud83d\\ude00", "population": 1}')])  # a pair: text
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        r = await s.chat(MESSAGES, schema=schema)
    assert r.call_stats.reasks == 1
    city = r.parsed.city if kind == "model" else r.parsed["city"]
    assert city == "P\U0001f600"
    if kind == "dict":
        reask = up.requests[1].body["messages"][-1]["content"]
        assert "lone surrogate" in reask


def test_a_fence_closed_by_another_fence_is_no_fence() -> None:
    from polygate._structured import _unfenced

    assert _unfenced("```json\n{}\n~~~") == "```json\n{}\n~~~"
    assert _unfenced('{"a": "```"}') == '{"a": "```"}'


async def test_plain_chat_has_no_parsed_value(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text=GOOD))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES)
    assert r.parsed is None and r.call_stats.reasks == 0
    assert "response_format" not in up.requests[0].body


# --------------------------------------------------------------------------- re-asks


async def test_reask_appends_the_answer_and_the_problems(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(by_round(
        Reply(text=WRONG_TYPE, first_token_s=2.0), Reply(text=GOOD, first_token_s=5.0)
    ))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES, schema=Answer)
        assert trio.current_time() - start == pytest.approx(7.0)
    assert r.parsed == Answer(city="Paris", population=2100000)
    st = r.call_stats
    assert st.reasks == 1 and st.attempts == 2
    assert st.generation_ms == pytest.approx(5000)  # the last round's, not the sum
    assert st.ttft_ms == pytest.approx(5000)
    assert st.total_latency_ms == pytest.approx(7000)
    first, second = (q.body["messages"] for q in up.requests)
    assert first == MESSAGES
    assert second[: len(MESSAGES)] == MESSAGES
    assert second[len(MESSAGES)] == {"role": "assistant", "content": WRONG_TYPE}
    reask = second[len(MESSAGES) + 1]
    assert reask["role"] == "user" and "$.population" in reask["content"]
    assert len(second) == len(MESSAGES) + 2
    # every round asks the same way
    assert up.requests[1].body["response_format"] == up.requests[0].body["response_format"]


async def test_out_of_reasks_raises_structured_output_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(by_round(
        Reply(text=NOT_JSON), Reply(text=WRONG_TYPE), Reply(text='{"city": 1}')
    ))
    settings = with_structured(one_source_settings(), 2)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            await s.chat(MESSAGES, schema=Answer)
    error = info.value
    assert isinstance(error, polygate.PolygateError)
    assert len(error.errors) == 3  # one string per round, in order
    assert "Invalid JSON" in error.errors[0]
    assert "$.population" in error.errors[1]
    assert "$.city" in error.errors[2] and "$.population" in error.errors[2]
    assert error.text == '{"city": 1}'
    assert error.call_stats is not None
    assert error.call_stats.reasks == 2 and error.call_stats.attempts == 3
    assert error.call_stats.source == "a"
    assert len(up.requests) == 3


async def test_max_reasks_zero_never_reasks(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=GOOD)))
    settings = with_structured(one_source_settings(), 0)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            await s.chat(MESSAGES, schema=Answer)
    assert len(info.value.errors) == 1 and len(up.requests) == 1
    assert info.value.call_stats is not None and info.value.call_stats.reasks == 0


async def test_dict_schema_reask_quotes_jsonschema_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(by_round(Reply(text=WRONG_TYPE), Reply(text=GOOD)))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=CITY_SCHEMA)
    assert r.parsed == {"city": "Paris", "population": 2100000}
    reask = up.requests[1].body["messages"][-1]["content"]
    assert "$.population: 'lots' is not of type 'integer'" in reask


async def test_each_round_has_its_own_retries(autojump_clock: trio.testing.MockClock) -> None:
    # round 1: valid JSON of the wrong shape; round 2: a 503 first, then a good answer
    up = FakeUpstream([Reply(text=WRONG_TYPE), Reply(status=503), Reply(text=GOOD)])
    settings = one_source_settings(retry=polygate.Retry(max_attempts=2, backoff_base_s=0.5))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.call_stats.attempts == 3 and r.call_stats.reasks == 1
    assert r.parsed is not None
    # the retry of round 2 resends round 2's messages
    assert up.requests[1].body["messages"] == up.requests[2].body["messages"]


@pytest.mark.parametrize("mode", ["json_schema", "prompt"])
async def test_a_reask_of_mapping_messages_is_sent_as_their_items(
    autojump_clock: trio.testing.MockClock, mode: str
) -> None:
    """Found by a differential fuzz: messages that are Mappings but not dicts (the
    public signature allows them) broke the re-ask's encoding, and an instruction's,
    with a bare TypeError; they are sent as their items, as a first request sends them."""
    import types

    up = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=GOOD)))
    messages = [types.MappingProxyType(dict(m)) for m in MESSAGES]
    async with polygate.session(_source_settings(mode), transport=Router({"a": up})) as s:
        r = await s.chat(messages, schema=Answer)
    assert r.call_stats.reasks == 1 and r.parsed == Answer(city="Paris", population=2100000)
    assert dict(MESSAGES[0]) in up.requests[1].body["messages"]


async def test_a_reask_round_starts_behind_a_source_that_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (fourth round): a re-ask round went back first to the source that
    had failed earlier in the same call ('a source that failed in this call goes to the
    back'): one attempt more, and a second request to the failing source."""
    a = FakeUpstream(Reply(status=503))
    b = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=GOOD)))
    settings = two_source_settings(weights=FIRST_A)  # a first, while it has not failed
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed is not None and r.call_stats.reasks == 1
    assert (len(a.requests), len(b.requests), r.call_stats.attempts) == (1, 2, 3)


async def test_a_failed_reasked_call_carries_every_rounds_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (fourth round): AllSourcesExhausted.errors held only the last
    round's failed attempts; an earlier round's (retried, then answered) were missing."""
    up = FakeUpstream([Reply(status=503), Reply(text=WRONG_TYPE)], then=Reply(status=500))
    settings = one_source_settings(retry=polygate.Retry(max_attempts=2, backoff_base_s=0.5))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES, schema=Answer)
    assert [e.status_code for e in info.value.errors] == [503, 500, 500]
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 4


async def test_a_reask_round_is_hedged(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(by_round(Reply(text=WRONG_TYPE), Reply(text=GOOD, first_token_s=30.0)))
    b = FakeUpstream(Reply(text=GOOD, first_token_s=1.0))
    settings = two_source_settings(hedge=polygate.Hedge(after_s=2.0), weights=FIRST_A)
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    st = r.call_stats
    assert (st.reasks, st.hedges, st.hedge_won, st.source) == (1, 1, True, "b")
    assert st.attempts == 3  # round 1, then round 2's primary and its hedge
    assert st.generation_ms == pytest.approx(1000)
    assert len(b.requests[0].body["messages"]) == len(MESSAGES) + 2


async def test_the_deadline_covers_every_round(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text=NOT_JSON, first_token_s=4.0))
    settings = with_structured(one_source_settings(call_deadline_s=10.0), 10)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        start = trio.current_time()
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await s.chat(MESSAGES, schema=Answer)
        assert trio.current_time() - start == pytest.approx(10.0)
    assert len(up.requests) == 3  # rounds at 0, 4 and 8 s; the third cut at 10 s
    assert up.in_flight == 0
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 3


async def test_fatal_error_in_a_reask_round_is_raised_as_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream([Reply(text=NOT_JSON), Reply(status=400)])
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES, schema=Answer)


async def test_callers_response_format_is_sent_as_is(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=GOOD)))
    own = {"type": "json_object"}
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer, response_format=own)
    assert r.parsed is not None and r.call_stats.reasks == 1  # still validated, re-asked
    for req in up.requests:
        assert req.body["response_format"] == own
        assert req.body["messages"][0] == MESSAGES[0]  # no instruction added


# --------------------------------------------------------------------------- ways of asking


def _source_settings(*modes: str, **scope: Any) -> polygate.Settings:
    names = "abc"
    sources = [
        polygate.Source(name=names[i], base_url=f"http://{names[i]}/v1", structured_output=mode,
                        weight=1.0 if i == 0 else 1e-9)
        for i, mode in enumerate(modes)
    ]
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=sources, **scope)})


@pytest.mark.parametrize("mode", ["json_object", "prompt"])
async def test_instruction_modes(autojump_clock: trio.testing.MockClock, mode: str) -> None:
    up = FakeUpstream(by_round(Reply(text=WRONG_TYPE), Reply(text=GOOD)))
    async with polygate.session(_source_settings(mode), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed == Answer(city="Paris", population=2100000)
    for req, rest in zip(up.requests, (MESSAGES, None), strict=True):
        system, *conversation = req.body["messages"]
        assert system["role"] == "system"
        assert json.dumps(Answer.model_json_schema(), separators=(",", ":")) in system["content"]
        if rest is not None:
            assert conversation == rest
        if mode == "json_object":
            assert req.body["response_format"] == {"type": "json_object"}
        else:
            assert "response_format" not in req.body
    # the re-ask appends to the conversation, not to the instruction
    conversation = up.requests[1].body["messages"][1:]
    assert conversation[len(MESSAGES)] == {"role": "assistant", "content": WRONG_TYPE}
    assert sum(m["role"] == "system" for m in up.requests[1].body["messages"]) == 1


async def test_instruction_joins_an_existing_system_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(text=GOOD))
    messages = [{"role": "system", "content": "You are terse."}, *MESSAGES]
    async with polygate.session(_source_settings("prompt"), transport=Router({"a": up})) as s:
        await s.chat(messages, schema=Answer)
    sent = up.requests[0].body["messages"]
    assert len(sent) == len(messages)
    assert sent[0]["content"].startswith("You are terse.\n\n")
    assert "JSON Schema" in sent[0]["content"]
    assert sent[1:] == MESSAGES


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": "You are terse."}], None,
], ids=["parts", "null"])
async def test_instruction_joins_a_system_message_of_any_content_form(
    content: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    """OpenAI's array of content parts (and null) is a leading system message too:
    still one system message, never a second put in front of it."""
    up = FakeUpstream(Reply(text=GOOD))
    messages = [{"role": "system", "content": content}, *MESSAGES]
    async with polygate.session(_source_settings("prompt"), transport=Router({"a": up})) as s:
        await s.chat(messages, schema=Answer)
    sent = up.requests[0].body["messages"]
    assert [m["role"] for m in sent] == ["system", *(m["role"] for m in MESSAGES)]
    if content is None:
        assert "JSON Schema" in sent[0]["content"]
    else:
        assert sent[0]["content"][0] == content[0]
        assert "JSON Schema" in sent[0]["content"][1]["text"]


@pytest.mark.parametrize("mode", ["json_schema", "prompt"])
async def test_a_dict_schema_is_sent_in_the_callers_key_order(
    mode: str, autojump_clock: trio.testing.MockClock,
) -> None:
    """Models write properties in schema order: a schema asking for its reasoning
    first gets it first.  The dict goes out as given, never sorted."""
    schema = {"type": "object", "required": ["reasoning", "answer"], "properties": {
        "reasoning": {"type": "string"}, "answer": {"type": "integer"}}}
    up = FakeUpstream(Reply(text='{"reasoning": "r", "answer": 1}'))
    async with polygate.session(_source_settings(mode), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=schema)
    assert r.parsed == {"reasoning": "r", "answer": 1}
    body = up.requests[0].body
    if mode == "json_schema":
        sent = body["response_format"]["json_schema"]["schema"]
    else:
        text = body["messages"][0]["content"]
        sent = json.loads(text[text.index("{"):])
    assert list(sent) == ["type", "required", "properties"]
    assert list(sent["properties"]) == ["reasoning", "answer"]


async def test_a_lone_surrogate_in_a_schema_is_a_config_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(text=GOOD))
    schema = {"type": "object", "description": "bad \ud800 text"}
    async with polygate.session(_source_settings("json_schema"), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="lone surrogate"):
            await s.chat(MESSAGES, schema=schema)
    assert up.requests == []


def _big_schema(properties: int, *, broken: bool = False) -> dict[str, Any]:
    props: dict[str, Any] = {f"field_{i}": {"type": "string", "maxLength": 100, "description": f"f{i}"}
                             for i in range(properties)}
    if broken:
        props["field_0"] = {"type": "no-such-type"}
    return {"type": "object", "properties": props, "required": list(props)}


async def test_a_big_schema_compiles_off_the_loop_inside_the_deadline() -> None:
    """Checking and compiling a JSON Schema is pure Python (seconds for thousands of
    properties): it runs in a worker thread at the start of the call, so the loop
    never stalls on it, and the call's deadline covers it."""
    up = FakeUpstream(Reply(text="{}"))
    worst = 0.0
    done = trio.Event()

    async def watch_the_loop() -> None:
        nonlocal worst
        while not done.is_set():
            before = time.perf_counter()
            await trio.sleep(0.005)
            worst = max(worst, time.perf_counter() - before - 0.005)

    async with polygate.session(_source_settings("json_schema"), transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_the_loop)
            started = time.perf_counter()
            with pytest.raises(polygate.DeadlineExceeded):
                await s.chat(MESSAGES, schema=_big_schema(3000), call_deadline_s=0.2)
            took = time.perf_counter() - started
            done.set()
    assert took < 1.0, took  # compiling alone takes seconds here
    assert worst < 0.1, worst
    assert up.requests == []


async def test_a_big_broken_schema_is_a_config_error_before_any_io() -> None:
    up = FakeUpstream(Reply(text="{}"))
    async with polygate.session(_source_settings("json_schema"), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="not a valid JSON Schema"):
            await s.chat(MESSAGES, schema=_big_schema(100, broken=True))
        with pytest.raises(polygate.ConfigError, match="not a valid JSON Schema"):
            async with s.stream_chat(MESSAGES, schema=_big_schema(101, broken=True)) as stream:
                async for _ in stream:
                    pass
    assert up.requests == []


async def test_failover_asks_each_source_its_own_way(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(status=500))
    b = FakeUpstream(Reply(text=GOOD))
    settings = _source_settings("json_schema", "prompt")
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.source == "b" and r.parsed is not None
    assert a.requests[0].body["response_format"]["type"] == "json_schema"
    assert a.requests[0].body["messages"] == MESSAGES
    assert "response_format" not in b.requests[0].body
    assert b.requests[0].body["messages"][0]["role"] == "system"


# --------------------------------------------------------------------------- stream_chat


async def test_stream_chat_validates_at_the_end(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text=GOOD, inter_token_s=0.1))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        async with s.stream_chat(MESSAGES, schema=Answer) as stream:
            text = "".join([c.text async for c in stream])
    assert text == GOOD
    assert stream.response is not None
    assert stream.response.parsed == Answer(city="Paris", population=2100000)
    assert up.requests[0].body["response_format"]["type"] == "json_schema"


async def test_stream_chat_never_reasks(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(by_round(Reply(text=WRONG_TYPE, inter_token_s=0.1), Reply(text=GOOD)))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        async with s.stream_chat(MESSAGES, schema=Answer) as stream:
            seen: list[str] = []
            with pytest.raises(polygate.StructuredOutputError) as info:
                async for chunk in stream:
                    seen.append(chunk.text)
    assert "".join(seen) == WRONG_TYPE  # the caller saw the text: no second round
    assert len(up.requests) == 1
    error = info.value
    assert len(error.errors) == 1 and "$.population" in error.errors[0]
    assert error.text == WRONG_TYPE
    assert error.call_stats is not None and error.call_stats.reasks == 0
    assert stream.response is None


# --------------------------------------------------------------------------- bad schemas


class NotAModel:
    city: str


BAD_SCHEMAS: list[Any] = [
    5, "Answer", ["object"], True, NotAModel, Answer(city="x", population=1),
    {"type": "strnig"}, {"properties": 5}, {"required": "city"},
    {"$ref": "#/$defs/Missing"}, {"$ref": "https://example.com/city.json"},
    {"type": "string", "pattern": "("}, {"type": "object", "default": float("nan")},
    {"type": "object", "x": object()},
    # a dangling $ref inside an embedded resource (its own $id, so its own base)
    {"$defs": {"B": {"$id": "https://ex.com/b.json", "properties": {"q": {"$ref": "#/nope"}}}},
     "properties": {"a": {"$ref": "https://ex.com/b.json"}}},
    # dangling $refs where only a walk over every key finds them (OpenAPI-style
    # components; draft-07, where $defs is no keyword; a dependency after an array one)
    {"properties": {"pet": {"$ref": "#/components/schemas/Pet"}},
     "components": {"schemas": {"Pet": {"properties": {"owner": {"$ref": "#/components/schemas/Owner"}}}}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"pet": {"$ref": "#/$defs/Pet"}},
     "$defs": {"Pet": {"properties": {"owner": {"$ref": "#/$defs/Owner"}}}}},
    {"$schema": "http://json-schema.org/draft-07/schema#",
     "dependencies": {"a": ["b"], "card": {"$ref": "#/definitions/Card"}}, "definitions": {}},
    # draft-07: a $ref hides its siblings, not what it points to
    {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/pet",
     "definitions": {"pet": {"properties": {"owner": {"$ref": "#/definitions/gone"}}}}},
    # pointers through a number or into a list by name; a $dynamicRef to nothing
    {"minimum": 5, "properties": {"a": {"$ref": "#/minimum/x"}}},
    {"allOf": [{}], "properties": {"a": {"$ref": "#/allOf/x"}}},
    {"properties": {"a": {"$dynamicRef": "#nope"}}},
    {"$schema": 5}, {"$schema": []},
    # a property may be called "default": its schema is a schema, not data
    {"properties": {"default": {"$ref": "#/nope"}}},
]

# Valid schemas whose references resolve only against an embedded resource's own base.
GOOD_REF_SCHEMAS: list[Any] = [
    # draft-04 says "id", not "$id"
    {"$schema": "http://json-schema.org/draft-04/schema#",
     "definitions": {"s": {"id": "http://ex.com/s.json", "definitions": {"z": {"type": "integer"}},
                           "properties": {"q": {"$ref": "#/definitions/z"}}}},
     "properties": {"a": {"$ref": "#/definitions/s"}}},
    {"$defs": {"B": {"$id": "https://ex.com/b.json", "$defs": {"z": {"type": "integer"}},
                     "properties": {"q": {"$ref": "#/$defs/z"}}}},
     "properties": {"a": {"$ref": "https://ex.com/b.json"}}},
    # a relative $id: "#/$defs/i" is only in the resource it names (not in the root)
    {"$id": "https://ex.com/root.json",
     "$defs": {"c": {"$id": "sub/c.json", "$defs": {"i": {"type": "integer"}},
                     "properties": {"q": {"$ref": "#/$defs/i"}}}},
     "properties": {"a": {"$ref": "sub/c.json"}}},
]

# Valid schemas a stricter or narrower walk refused or crashed on (probes).
VALID_SCHEMAS: list[Any] = [
    # a schema dependency beside an array one (referencing's own walk crashed here)
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
     "dependencies": {"billing": {"required": ["card"]}, "card": ["billing"]}},
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
     "dependencies": {"billing": {"required": ["card"]}, "card": ["billing"]}},
    # draft-07 ignores a $ref's siblings, dangling references in them too
    {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/pet",
     "definitions": {"pet": {"type": "object"}}, "properties": {"legacy": {"$ref": "#/definitions/gone"}}},
    # the metaschemas jsonschema ships resolve without a fetch
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
     "properties": {"schema": {"$ref": "http://json-schema.org/draft-07/schema#"}}},
    # an embedded $schema does not change the root draft's rules (jsonschema's): "id"
    # sets no base in 2020-12
    {"$defs": {"y": {"type": "string"}},
     "properties": {"x": {"$schema": "http://json-schema.org/draft-04/schema#", "id": "http://ex.com/e.json",
                          "properties": {"p": {"$ref": "#/$defs/y"}}}}},
    # a "$ref" key inside data is no reference
    {"properties": {"a": {"enum": [{"$ref": "#/nope"}], "default": {"$ref": "#/nope"},
                          "example": {"$ref": "#/nope"}}}},
    # $dynamicRef is a keyword of 2020-12 only: in draft-07 it is an unknown one
    {"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"a": {"$dynamicRef": "#nope"}}},
]


# Schemas that lead back to themselves without descending into the answer: JSON Schema
# forbids them, and jsonschema recursed on every answer until Python's limit, which
# was taken for the answer's fault (re-asked until the re-asks ran out).
LOOPING_SCHEMAS: list[Any] = [
    {"$ref": "#"},
    {"$defs": {"Node": {"$ref": "#/$defs/Node"}}, "$ref": "#/$defs/Node"},
    {"$defs": {"A": {"allOf": [{"$ref": "#/$defs/B"}]}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}},
     "$ref": "#/$defs/A"},
    {"anyOf": [{"type": "string"}, {"$ref": "#"}]},
    {"not": {"if": {"$ref": "#"}}},
    # only where a property leads: the loop is under "a", still in place there
    {"properties": {"a": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"oneOf": [{"$ref": "#/$defs/X"}]}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a",
     "definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"$ref": "#/definitions/a"}}},
    # the same keywords where the draft has them
    {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": {"$ref": "#"}}},
    {"dependentSchemas": {"a": {"$ref": "#"}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "if": {"type": "object"}, "then": {"$ref": "#"}},
    # review: draft-03 applies in place its disallow (its not) and the schemas of a type list
    {"$schema": "http://json-schema.org/draft-03/schema#", "type": "any", "disallow": [{"$ref": "#"}]},
    {"$schema": "http://json-schema.org/draft-03/schema#", "type": ["string", {"$ref": "#"}]},
    # review: a $recursiveRef is "#" whatever it says (2019-09, and jsonschema reads it so)
    {"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveRef": "#/$defs/a",
     "$defs": {"a": {"type": "string"}}},
]

# Recursive schemas that descend into the answer before they come back: valid.
RECURSIVE_SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"name": {"type": "string"},
                                      "children": {"type": "array", "items": {"$ref": "#"}}}},
    {"$defs": {"Node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"},
                                                                            {"type": "null"}]}}}},
     "$ref": "#/$defs/Node"},
    {"$dynamicAnchor": "node", "type": "object",
     "properties": {"kids": {"type": "array", "items": {"$dynamicRef": "#node"}}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/t",
     "definitions": {"t": {"type": "object",
                           "properties": {"children": {"type": "array", "items": {"$ref": "#/definitions/t"}}}}},
     "allOf": [{"$ref": "#"}]},  # draft-07 ignores a $ref's siblings: no loop
    {"$ref": "https://json-schema.org/draft/2020-12/schema"},
    {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "http://json-schema.org/draft-07/schema#"},
    # review: keywords the schema's own draft does not have are no loop (jsonschema
    # ignores them): dependencies in 2020-12, if in draft-04
    {"type": "object", "dependencies": {"name": {"$ref": "#"}}},
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "if": {"$ref": "#"}},
    # draft-03: schemas in a type list and under disallow that descend first
    {"$schema": "http://json-schema.org/draft-03/schema#",
     "type": ["object", {"type": "array", "items": {"$ref": "#"}}],
     "disallow": [{"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                                    "name": {"type": "integer", "required": True}}}]},
]


@pytest.mark.parametrize(
    ("schema", "loops"),
    [*((x, True) for x in LOOPING_SCHEMAS), *((x, False) for x in RECURSIVE_SCHEMAS)],
    ids=[*(f"loops-{i}" for i in range(len(LOOPING_SCHEMAS))),
         *(f"descends-{i}" for i in range(len(RECURSIVE_SCHEMAS)))],
)
async def test_a_schema_that_loops_in_place_is_a_config_error_before_any_io(
    autojump_clock: trio.testing.MockClock, schema: Any, loops: bool
) -> None:
    """A loop in place is refused before any request; a recursive schema that descends
    into the answer first (a tree) is used as any other."""
    up = FakeUpstream(Reply(text='{"name": "n", "children": [{"name": "m", "children": []}], "kids": []}'))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        if loops:
            with pytest.raises(polygate.ConfigError, match="leads back"):
                await s.chat(MESSAGES, schema=schema)
            assert up.requests == []
        else:
            r = await s.chat(MESSAGES, schema=schema)
            assert r.call_stats.reasks == 0 and r.parsed is not None


async def test_a_loop_found_only_while_validating_is_a_config_error_not_a_reask(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop the check before I/O does not see (here: the check switched off) recurses
    on a shallow answer: the schema's fault, a ConfigError after the one request; a deep
    answer that exhausts the validator is still the answer's fault (re-asked)."""
    from polygate import _structured

    monkeypatch.setattr(_structured, "_in_place_loop", lambda *args: None)
    up = FakeUpstream(Reply(text='{"a": 1}'))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="recursed without end"):
            await s.chat(MESSAGES, schema={"$defs": {"L": {"allOf": [{"$ref": "#/$defs/L"}]}},
                                           "properties": {"a": {"$ref": "#/$defs/L"}}})
    assert len(up.requests) == 1


def test_a_long_chain_of_references_is_checked_without_recursion() -> None:
    """The check walks with its own stack: a chain of 3000 draft-07 references, each to
    the next, was reported as a dangling one once Python's stack ran out."""
    from polygate._structured import _compile

    chain = {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/d0",
             "definitions": {f"d{i}": {"$ref": f"#/definitions/d{i + 1}"} for i in range(2999)}}
    _compile({**chain, "definitions": {**chain["definitions"], "d2999": {"type": "object"}}})
    with pytest.raises(polygate.ConfigError, match="d2999"):
        _compile(chain)  # the last link missing


async def test_validation_never_fetches_a_remote_schema(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """jsonschema's default registry retrieves an unknown URI over HTTP while it
    validates: polygate validates with the metaschemas' registry, which never does.  A
    reference the check before I/O let through (it resolves against the root's base,
    not its own) fails as a ConfigError at validation, without a fetch."""
    import urllib.request

    fetched: list[Any] = []

    def no_network(url: Any, *args: Any, **kwargs: Any) -> Any:
        fetched.append(url)
        raise OSError("no network in tests")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    schema = {"$id": "https://a.example/root.json",
              "$defs": {"x": {"$id": "https://a.example/x.json", "type": "string"}},
              "properties": {"p": {"$id": "https://b.example/dir/p.json", "$ref": "x.json"}}}
    up = FakeUpstream(Reply(text='{"p": 1}'))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="schema"):
            await s.chat(MESSAGES, schema=schema)
    assert fetched == []


# review: a pointer may reach any value of the document, and only an object (or a
# boolean) is a schema: jsonschema took these and failed on the first JSON answer, after
# the request, and an answer that was not JSON was re-asked for the schema's fault.
REFS_TO_NON_SCHEMAS: list[Any] = [
    {"$ref": "#/$defs/a/type", "$defs": {"a": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/required/0"}}, "required": ["a"]},
    {"$ref": "#/$defs/a/minimum", "$defs": {"a": {"minimum": 3}}},
    {"$ref": "#/$defs/a/enum", "$defs": {"a": {"enum": [1, 2]}}},
    {"$dynamicRef": "#/$defs/a/minimum", "$defs": {"a": {"minimum": 3}}},
    {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a/type",
     "definitions": {"a": {"type": "string"}}},
    # review of that fix: an object is not a schema yet -- under a key no draft knows
    # (the metaschema never looked at it), a map of property names
    {"components": {"schemas": {"A": {"type": "strnig"}}}, "$ref": "#/components/schemas/A"},
    {"properties": {"type": {"type": "string"}}, "$ref": "#/properties"},
    # ... and a target inside data is walked: its own references must resolve
    {"$ref": "#/$defs/a/default", "$defs": {"a": {"default": {"$ref": "#/nowhere"}}}},
]


@pytest.mark.parametrize("answer", ['{"a": 1}', "Paris, about two million people."])
@pytest.mark.parametrize("schema", REFS_TO_NON_SCHEMAS, ids=range(len(REFS_TO_NON_SCHEMAS)))
async def test_a_reference_to_a_value_that_is_no_schema_is_refused_before_any_io(
    autojump_clock: trio.testing.MockClock, schema: Any, answer: str
) -> None:
    up = FakeUpstream(Reply(text=answer))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match=r"not a (valid )?schema|does not resolve"):
            await s.chat(MESSAGES, schema=schema)
        with pytest.raises(polygate.ConfigError, match=r"not a (valid )?schema|does not resolve"):
            s.stream_chat(MESSAGES, schema=schema)
    assert up.requests == []


async def test_a_reference_to_a_boolean_schema_is_a_schema(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(text='{"a": 1}'))
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/any"}}, "$defs": {"any": True}}
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=schema)
    assert r.parsed == {"a": 1}


@pytest.mark.parametrize("schema", BAD_SCHEMAS, ids=lambda s: type(s).__name__)
async def test_bad_schema_before_any_io(autojump_clock: trio.testing.MockClock, schema: Any) -> None:
    up = FakeUpstream(Reply(text=GOOD))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="schema"):
            await s.chat(MESSAGES, schema=schema)
        with pytest.raises(polygate.ConfigError, match="schema"):
            s.stream_chat(MESSAGES, schema=schema)
    assert up.requests == []


@pytest.mark.parametrize("schema", GOOD_REF_SCHEMAS, ids=range(len(GOOD_REF_SCHEMAS)))
async def test_references_resolve_against_their_own_resource(
    autojump_clock: trio.testing.MockClock, schema: Any
) -> None:
    """A reference inside an embedded resource resolves against that resource's base,
    in every draft (draft-04 names it ``id``): the schema is valid, and validation
    follows the reference."""
    up = FakeUpstream(by_round(Reply(text='{"a": {"q": "x"}}'), Reply(text='{"a": {"q": 1}}')))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=schema)
    assert r.call_stats.reasks == 1  # the first answer broke the referenced subschema


@pytest.mark.parametrize("schema", VALID_SCHEMAS, ids=range(len(VALID_SCHEMAS)))
async def test_valid_schemas_are_accepted(autojump_clock: trio.testing.MockClock, schema: Any) -> None:
    up = FakeUpstream(Reply(text='{"billing": 1, "card": 2, "schema": {"type": "string"}, "x": {"p": "s"}}'))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=schema)
    assert r.call_stats.reasks == 0 and r.parsed is not None


def test_pydantic_v1_models_are_refused() -> None:
    import pydantic.v1

    class Old(pydantic.v1.BaseModel):
        x: int

    from polygate._structured import schema_of

    with pytest.raises(polygate.ConfigError, match="pydantic v2"):
        schema_of(Old)


def test_dict_schemas_are_compiled_once() -> None:
    from polygate._structured import schema_of

    one = schema_of(dict(CITY_SCHEMA))
    assert schema_of(dict(CITY_SCHEMA)) is one
    reordered = dict(reversed(list(CITY_SCHEMA.items())))
    other = schema_of(reordered)
    # sent as given (key order is the caller's), checked by the one compiled validator
    assert list(other.json_schema) == list(reordered) != list(one.json_schema)
    assert other._validator is one._validator  # type: ignore[attr-defined]
    assert schema_of(Answer).json_schema is schema_of(Answer).json_schema  # (a model: per call, its schema built once)


def test_polygate_imports_neither_pydantic_nor_jsonschema() -> None:
    code = (
        "import sys, polygate, polygate.testing; "
        "print(sorted(m for m in ('pydantic', 'jsonschema') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_large_answers_are_validated_off_the_loop(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polygate import _structured

    threads: list[int] = []
    original = _structured._DictSchema.validate

    def validate(self: Any, text: str, *budget: float) -> Any:
        threads.append(threading.get_ident())
        return original(self, text, *budget)

    monkeypatch.setattr(_structured._DictSchema, "validate", validate)
    big = json.dumps({"city": "x" * 5000, "population": 1})
    up = FakeUpstream([Reply(text=GOOD), Reply(text=big)])
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        small_answer = await s.chat(MESSAGES, schema=CITY_SCHEMA)
        big_answer = await s.chat(MESSAGES, schema=CITY_SCHEMA)
    assert small_answer.parsed["population"] == 2100000
    assert big_answer.parsed["city"] == "x" * 5000
    assert threads[0] == threading.get_ident() != threads[1]


def slow_validation(monkeypatch: pytest.MonkeyPatch, took_s: float) -> None:
    """Thread-hopped validations take ``took_s`` of (virtual) time."""
    from polygate import _structured

    async def run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
        await trio.sleep(took_s)
        return fn(*args)

    monkeypatch.setattr(_structured, "run_sync", run_sync)


BIG = json.dumps({"city": "x" * 5000, "population": 1})


async def test_a_threaded_validation_takes_no_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Under MockClock a validation in a worker thread takes no virtual time, however
    long it takes for real (it once let the clock jump to the call's deadline)."""
    answer = json.dumps([{"city": "x" * 20, "population": i} for i in range(2000)])
    up = FakeUpstream(Reply(text=answer))
    settings = one_source_settings(call_deadline_s=60.0)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        for _ in range(3):
            start = trio.current_time()
            r = await s.chat(MESSAGES, schema={"type": "array", "items": CITY_SCHEMA})
            assert trio.current_time() == start and r.call_stats.total_latency_ms == 0
            assert len(r.parsed) == 2000


async def test_total_latency_covers_the_last_validation(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last round's validation is part of the logical call: in its latency."""
    slow_validation(monkeypatch, 3.0)
    up = FakeUpstream(Reply(text=BIG, first_token_s=1.0))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES, schema=CITY_SCHEMA)
        took = trio.current_time() - start
    assert took == pytest.approx(4.0)
    assert r.call_stats.total_latency_ms == pytest.approx(4000)
    assert r.call_stats.generation_ms == pytest.approx(1000)


async def test_the_deadline_covers_the_last_validation(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadline that passes while the answer is validated ends the call there."""
    slow_validation(monkeypatch, 30.0)
    up = FakeUpstream(Reply(text=BIG, first_token_s=1.0))
    settings = one_source_settings(call_deadline_s=5.0)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        start = trio.current_time()
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await s.chat(MESSAGES, schema=CITY_SCHEMA)
        assert trio.current_time() - start == pytest.approx(5.0)
    assert info.value.call_stats is not None
    assert info.value.call_stats.total_latency_ms == pytest.approx(5000)


async def test_an_inline_validation_past_the_deadline_is_deadline_exceeded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small answer validated on the loop cannot be interrupted, but a deadline
    that passed meanwhile is the call's outcome, not OK (real clock)."""
    from polygate import _structured

    original = _structured._DictSchema.validate

    def validate(self: Any, text: str, *budget: float) -> Any:
        time.sleep(0.3)  # the loop is blocked: as a slow inline validation would
        return original(self, text, *budget)

    monkeypatch.setattr(_structured._DictSchema, "validate", validate)
    up = FakeUpstream(Reply(text=GOOD))
    settings = one_source_settings(call_deadline_s=0.2)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES, schema=CITY_SCHEMA)
        with pytest.raises(polygate.DeadlineExceeded):  # an invalid answer too
            await s.chat(MESSAGES, schema={"type": "object", "required": ["country"]})


@pytest.mark.timeout(120)
async def test_a_slow_validation_is_cut_at_the_deadline_over_loopback() -> None:
    """Real clock, real server: an answer whose validation takes over a second ends at
    a 0.5 s deadline (the thread is abandoned), and without one the call's total
    latency covers the validation.  (A review on 3.12: the 800 KB answer of before
    validated in 0.35 s here, under the floor below, so the cut was never tried; and
    the session's first schema call, run alone on 3.11, spent 60 ms importing and
    compiling before the call's clock starts, as documented: a small call first.)"""
    schema = {"type": "array", "items": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string", "pattern": "^x+$"}}, "required": ["a", "b"]}}
    answer = json.dumps([{"a": i, "b": "x" * 20} for i in range(60000)], separators=(",", ":"))
    up = FakeUpstream([Reply(text="[]")], then=Reply(text=answer))
    took_s = 0.0
    async with up.serve() as base:
        scope = polygate.Scope(sources=[polygate.Source(name="a", base_url=base, model="m")])
        async with polygate.session(polygate.Settings(scopes={"chat": scope})) as s:
            assert (await s.chat(MESSAGES, schema=schema)).parsed == []
            started = time.perf_counter()
            r = await s.chat(MESSAGES, schema=schema)
            wall_ms = (time.perf_counter() - started) * 1000
            assert len(r.parsed) == 60000
            assert r.call_stats.total_latency_ms >= 0.9 * wall_ms
            took_s = wall_ms / 1000
            if took_s >= 0.9:
                started = time.perf_counter()
                with pytest.raises(polygate.DeadlineExceeded):
                    await s.chat(MESSAGES, schema=schema, call_deadline_s=0.5)
                assert time.perf_counter() - started < 0.5 + took_s / 2
    if took_s < 0.9:  # (outside the session: pytest-trio drops a skip's reason inside)
        pytest.skip(f"validation took only {took_s:.2f} s: nothing to cut")


# --------------------------------------------------------------------------- telemetry


async def test_every_rounds_attempts_are_rows_of_the_one_call(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    up = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=WRONG_TYPE), Reply(text=GOOD)))
    settings = attrs.evolve(one_source_settings(), telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
        with pytest.raises(polygate.StructuredOutputError):  # no answer has a country
            await s.chat(MESSAGES, schema={"type": "object", "required": ["country"]})
    conn = sqlite3.connect(db)
    try:
        calls = conn.execute("SELECT logical_call_id, outcome, error_class, attempts FROM calls "
                             "ORDER BY rowid").fetchall()
        attempts = conn.execute("SELECT logical_call_id, call_id, error FROM attempts "
                                "ORDER BY rowid").fetchall()
    finally:
        conn.close()
    assert calls[0] == (r.call_stats.logical_call_id, "ok", None, 3)
    assert [a[1] for a in attempts[:3]] == [f"{r.call_stats.logical_call_id}.{i}" for i in (1, 2, 3)]
    assert {a[0] for a in attempts[:3]} == {r.call_stats.logical_call_id}
    assert calls[1][1:] == ("error", "StructuredOutputError", 3)


async def test_usage_is_the_last_rounds_and_every_round_is_on_its_attempt_row(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """docs/structured.md: ``response.usage`` is what the returned answer cost; the
    earlier rounds' tokens are on their attempt rows and charged to the quota."""
    db = tmp_path / "t.db"
    up = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=GOOD)))
    settings = attrs.evolve(one_source_settings(), telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
        (source,) = (await s.statistics()).governance.sources
    assert r.call_stats.reasks == 1 and r.usage is not None
    conn = sqlite3.connect(db)
    try:
        call = conn.execute("SELECT prompt_tokens, completion_tokens FROM calls").fetchone()
        rows = conn.execute("SELECT prompt_tokens, completion_tokens, tokens_settled FROM attempts "
                            "ORDER BY rowid").fetchall()
    finally:
        conn.close()
    assert len(rows) == 2 and None not in rows[0] and None not in rows[1]
    assert call == (r.usage.prompt_tokens, r.usage.completion_tokens) == rows[1][:2]  # the last round
    assert rows[0][0] < rows[1][0]  # the re-ask carried the first answer and the problems
    assert all(row[2] == row[0] + row[1] for row in rows)  # settled: what each round cost
    assert source.state.cost_total == rows[0][2] + rows[1][2]  # both rounds charged


# --------------------------------------------------------------------------- property

_answers = st.sampled_from(
    [GOOD, WRONG_TYPE, NOT_JSON, '{"city": 1}', "", f"```json\n{GOOD}\n```", "[]", "null"]
)
_replies = st.one_of(
    _answers.map(lambda text: Reply(text=text)),
    st.sampled_from([
        Reply(status=500), Reply(status=429, retry_after_s=1.0), Reply(status=400),
        Reply(fault="truncated", fault_after=1), Reply(text=GOOD, first_token_s=500.0),
    ]),
)


@hsettings(max_examples=80, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(_replies, min_size=1, max_size=10), max_reasks=st.integers(0, 3),
       stream=st.booleans())
async def test_the_reask_loop_ends_within_max_reasks_plus_one_rounds(
    autojump_clock: trio.testing.MockClock, script: list[Reply], max_reasks: int, stream: bool
) -> None:
    up = FakeUpstream(script)
    settings = with_structured(one_source_settings(call_deadline_s=120.0), max_reasks)
    outcome: Any = None
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        try:
            if stream:
                async with s.stream_chat(MESSAGES, schema=Answer) as chat_stream:
                    async for _ in chat_stream:
                        pass
                outcome = chat_stream.response
            else:
                outcome = await s.chat(MESSAGES, schema=Answer)
        except polygate.PolygateError as exc:  # exactly one polygate error, never a group
            outcome = exc
    rounds = len({sum(m["role"] == "assistant" for m in r.body["messages"]) for r in up.requests})
    allowed = 0 if stream else max_reasks
    assert rounds <= allowed + 1
    assert up.in_flight == 0
    if isinstance(outcome, polygate.ChatResponse):
        assert isinstance(outcome.parsed, Answer)
        assert outcome.call_stats.reasks == rounds - 1
        assert outcome.call_stats.attempts == len(up.requests)
    elif isinstance(outcome, polygate.StructuredOutputError):
        assert len(outcome.errors) == allowed + 1 == rounds
        assert outcome.call_stats is not None
        assert outcome.call_stats.reasks == allowed
        assert outcome.call_stats.attempts == len(up.requests)
    else:
        assert isinstance(outcome, (polygate.AllSourcesExhausted, polygate.FatalUpstreamError,
                                    polygate.DeadlineExceeded, polygate.TransientUpstreamError))


@pytest.mark.parametrize("answer", ["[" * 3000 + "]" * 3000, '{"x": NaN}', '{"x": -Infinity}'])
async def test_an_answer_no_json_reader_takes_is_reasked(
    autojump_clock: trio.testing.MockClock, answer: str,
) -> None:
    """Probe findings (tenth round): a 6 KB answer nested 3000 deep raised a bare
    RecursionError out of chat() (a dict schema); NaN and Infinity, which are no JSON,
    were accepted as values.  Each is an invalid answer: re-asked, then
    StructuredOutputError."""
    up = FakeUpstream(Reply(text=answer))
    async with polygate.session(with_structured(one_source_settings(), 1),
                                transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            # any number, and any array: only the JSON reading can refuse these
            await s.chat(MESSAGES, schema={"type": ["object", "array"],
                                           "properties": {"x": {"type": "number"}}})
    assert info.value.call_stats is not None and info.value.call_stats.reasks == 1
    assert len(up.requests) == 2


@pytest.mark.parametrize("depth", [257, 900])
async def test_an_answer_deeper_than_max_depth_is_reasked_on_every_python(
    autojump_clock: trio.testing.MockClock, depth: int,
) -> None:
    """On 3.13 the standard decoder reads 3000 levels that 3.11's recursed out of: the
    same answer was accepted on one Python and re-asked on the other.  The limit is
    polygate's own (MAX_DEPTH, as for messages), whatever the interpreter's stack."""
    from polygate._json import MAX_DEPTH

    up = FakeUpstream(Reply(text="[" * depth + "]" * depth))
    async with polygate.session(with_structured(one_source_settings(), 1),
                                transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            await s.chat(MESSAGES, schema={"type": "array"})
    assert f"deeper than {MAX_DEPTH} levels" in str(info.value.errors[0])
    assert len(up.requests) == 2
    shallow = FakeUpstream(Reply(text="[" * MAX_DEPTH + "]" * MAX_DEPTH))
    async with polygate.session(with_structured(one_source_settings(), 1),
                                transport=Router({"a": shallow})) as s:
        answer = await s.chat(MESSAGES, schema={"type": "array"})
    assert answer.parsed is not None and len(shallow.requests) == 1


def test_a_schema_deeper_than_max_depth_is_a_config_error_on_every_python() -> None:
    from polygate._json import MAX_DEPTH
    from polygate._structured import schema_of

    deep: dict[str, Any] = {}
    for _ in range(MAX_DEPTH + 1):
        deep = {"items": deep}
    with pytest.raises(polygate.ConfigError, match=f"deeper than {MAX_DEPTH} levels"):
        schema_of(deep)


def test_a_schema_too_deep_or_a_model_with_a_surrogate_is_a_config_error() -> None:
    """Before any request: a dict schema 3000 levels deep raised a bare RecursionError,
    and a pydantic model whose schema holds a lone surrogate (a description) was sent."""
    from polygate._structured import schema_of

    deep: dict[str, Any] = {}
    for _ in range(3000):
        deep = {"items": deep}
    with pytest.raises(polygate.ConfigError, match="nested too deeply"):
        schema_of(deep)

    class Odd(pydantic.BaseModel):
        x: int = pydantic.Field(description="\ud800")

    with pytest.raises(polygate.ConfigError, match="lone surrogate"):
        schema_of(Odd)


@pytest.mark.parametrize("depth", [120, 400])
async def test_a_schema_too_deep_for_the_validator_is_a_config_error(
    autojump_clock: trio.testing.MockClock, depth: int
) -> None:
    """Found by a probe: a schema nested ~100 levels deep encodes, but jsonschema's check
    of it recursed out of the stack: a bare RecursionError from chat(), after nothing
    was sent.  A ConfigError before any I/O, as for any schema that cannot be used."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    up = FakeUpstream(Reply(text=GOOD))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="schema: nested too deeply"):
            await s.chat(MESSAGES, schema=schema)
    assert up.requests == []


def test_reported_problems_keep_their_documented_bounds() -> None:
    """'At most 20, each at most 300 characters': it was 21 lines and 301 characters."""
    from polygate._structured import _bounded

    lines = _bounded(f"$.f{i}: " + "x" * 400 for i in range(30))
    assert len(lines) == 20 and max(map(len, lines)) <= 300
    assert lines[-1] == "… and 11 more"


# --------------------------------------------------------------------------- review findings (2026-12-02, fourth)


class Reading(pydantic.BaseModel):
    x: float
    note: str = ""


@pytest.mark.parametrize("answer", ['{"x": NaN}', '{"x": -Infinity}', '{"x": 1, "more": [1, NaN]}',
                                    '{"note": "a", "x": Infinity}'])
async def test_non_json_constants_are_reasked_with_a_pydantic_model_too(
    autojump_clock: trio.testing.MockClock, answer: str,
) -> None:
    """Review: pydantic-core's JSON reader takes NaN and Infinity, so a model schema
    accepted ``{"x": NaN}`` as ``Reading(x=nan)`` with no re-ask, where the docs say an
    answer is JSON as RFC 8259 has it (the dict schema already re-asked)."""
    up = FakeUpstream(by_round(Reply(text=answer), Reply(text='{"x": 1.5, "note": "NaN or Infinity"}')))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Reading)
    # the words NaN and Infinity inside a string are text, not constants
    assert r.parsed == Reading(x=1.5, note="NaN or Infinity")
    assert r.call_stats.reasks == 1 and len(up.requests) == 2
    reask = up.requests[1].body["messages"][-1]["content"]
    assert "not JSON" in reask


class InfiniteDefault(pydantic.BaseModel):
    limit: float = float("inf")


class ObjectInSchema(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(json_schema_extra=lambda s: s.update(bad=object()))
    x: int


@pytest.mark.parametrize("model", [InfiniteDefault, ObjectInSchema])
async def test_a_model_whose_json_schema_is_not_json_is_a_config_error(
    autojump_clock: trio.testing.MockClock, model: Any,
) -> None:
    """Review: a model with an infinite default sent ``"default":Infinity`` upstream (no
    JSON: a 400 from a real upstream), and an object in ``json_schema_extra`` raised a
    bare TypeError out of chat() after admission.  Both are bad schemas: ConfigError
    before any request, as for a dict."""
    up = FakeUpstream(Reply(text='{"x": 1, "limit": 1.5}'))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match=f"schema: .*{model.__name__}.*JSON"):
            await s.chat(MESSAGES, schema=model)
        with pytest.raises(polygate.ConfigError):
            async with s.stream_chat(MESSAGES, schema=model) as stream:
                async for _ in stream:
                    pass
    assert up.requests == []


class _OneMessage(httpx.AsyncBaseTransport):
    """A JSON answer whose first choice is ``message`` (also to a stream request: a
    source may answer a stream with JSON)."""

    def __init__(self, message: dict[str, Any], finish: str) -> None:
        self.message, self.finish = message, finish
        self.bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(await request.aread()))
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "model": "m1",
            "choices": [{"index": 0, "message": self.message, "finish_reason": self.finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        })


_TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Paris"}'}}
_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
NO_ANSWER_MESSAGES = [
    pytest.param({"role": "assistant", "content": None, "tool_calls": [_TOOL_CALL]}, "tool_calls", id="tool_calls"),
    pytest.param({"role": "assistant", "content": None, "refusal": "I can't help with that."}, "stop", id="refusal"),
    # (review: the legacy function_call, asked for with ``functions=``, was re-asked)
    pytest.param({"role": "assistant", "content": None,
                  "function_call": {"name": "lookup", "arguments": '{"q": "Paris"}'}},
                 "function_call", id="function_call"),
]


@pytest.mark.parametrize(("message", "finish"), NO_ANSWER_MESSAGES)
async def test_tool_calls_or_a_refusal_are_returned_not_reasked(
    autojump_clock: trio.testing.MockClock, message: dict[str, Any], finish: str,
) -> None:
    """Review: an answer made of tool calls (the model chose a tool) or a refusal was
    taken for invalid JSON and re-asked until StructuredOutputError, the re-ask
    sending an empty assistant turn: the tool calls and the refusal were lost and two
    rounds paid for nothing.  Like the OpenAI SDK's ``parse()``, the response comes
    back with ``parsed=None`` and its ``tool_calls`` or ``refusal``; no re-ask."""
    for stream in (False, True):
        up = _OneMessage(message, finish)
        async with polygate.session(one_source_settings(), transport=up) as s:
            if stream:
                async with s.stream_chat(MESSAGES, schema=Answer, tools=_TOOLS) as st_:
                    async for _ in st_:
                        pass
                r = st_.response
            else:
                r = await s.chat(MESSAGES, schema=Answer, tools=_TOOLS)
        assert r is not None and r.parsed is None and r.text == ""
        assert r.call_stats.reasks == 0 and len(up.bodies) == 1
        key = next(k for k in ("tool_calls", "function_call", "refusal") if k in message)
        assert r.message[key] == message[key]


async def test_a_cached_tool_call_answer_is_a_hit(autojump_clock: trio.testing.MockClock) -> None:
    """The cache re-validates a structured hit to build ``parsed``: a tool-call answer,
    stored as any complete answer is, must come back as a hit (not a miss every time)."""
    message, finish = NO_ANSWER_MESSAGES[0].values
    base = one_source_settings()
    scope = attrs.evolve(base.scopes["chat"], cache_ttl_s=60)
    settings = attrs.evolve(base, scopes={"chat": scope}, cache="memory")
    up = _OneMessage(message, finish)
    async with polygate.session(settings, transport=up) as s:
        await s.chat(MESSAGES, schema=Answer, tools=_TOOLS)
        hit = await s.chat(MESSAGES, schema=Answer, tools=_TOOLS)
    assert hit.call_stats.cached and hit.parsed is None
    assert hit.message["tool_calls"][0]["id"] == "call_1" and len(up.bodies) == 1


@pytest.mark.parametrize("mode", ["json_schema", "json_object", "prompt"])
async def test_response_format_none_is_no_format_of_the_callers(
    autojump_clock: trio.testing.MockClock, mode: str,
) -> None:
    """review: ``chat(schema=..., response_format=None)`` counted as the caller's own
    format, so ``"response_format": null`` was sent and polygate's format was not: a
    None is unset, as for every other parameter a caller leaves at its default."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[polygate.Source(
        name="a", base_url="http://a/v1", structured_output=mode)])})
    up = FakeUpstream(Reply(text='{"city": "Paris", "population": 2100000}'))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=CITY_SCHEMA, response_format=None)
    assert r.parsed == {"city": "Paris", "population": 2100000}
    sent = up.requests[0].body
    expected = {"json_schema": "json_schema", "json_object": "json_object", "prompt": None}[mode]
    assert (sent.get("response_format") or {}).get("type") == expected
    assert mode != "prompt" or "response_format" not in sent


async def test_a_reask_never_starts_past_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    """An outside review (hostile schemas, 2026-12-05): a caller's validator ran past
    the call's deadline and found the answer wrong; the call ended DeadlineExceeded,
    but only after the re-ask round was admitted -- its request sent past the
    deadline, and an RPM slot taken from the next call."""

    class Answer(pydantic.BaseModel):
        city: str
        population: int

        @pydantic.field_validator("city")
        @classmethod
        def _slow_and_wrong(cls, value: str) -> str:
            autojump_clock.jump(10.0)  # the validator's CPU time, as the clock sees it
            raise ValueError("never right")

    up = FakeUpstream(Reply(text='{"city": "Paris", "population": 2100000}'))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", rpm=2)], call_deadline_s=5.0)})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat([{"role": "user", "content": "hi"}], schema=Answer)
        assert len(up.requests) == 1
        start = trio.current_time()
        await s.chat([{"role": "user", "content": "hi"}], call_deadline_s=1.0)  # rpm's second slot
        assert trio.current_time() - start < 1.0


@pytest.mark.parametrize(("dialect", "embedded"), [
    ("http://json-schema.org/draft-07/schema#", False),
    ("https://json-schema.org/draft-07/schema#", False),
    ("https://json-schema.org/draft-07/schema#", True),  # an embedded resource's
])
async def test_the_draft_a_schema_names_is_the_one_that_judges(
    autojump_clock: trio.testing.MockClock, dialect: str, embedded: bool
) -> None:
    """The same review: an https draft-07 URI (its own is http), or any URI jsonschema
    did not know, was read as 2020-12, where draft-07's ``dependencies`` checks
    nothing: ``{"a": 1}`` passed a schema that requires ``b`` beside ``a``."""
    up = FakeUpstream(Reply(text='{"a": 1}'))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        structured=polygate.Structured(max_reasks=0))})
    schema: dict[str, Any] = {"$schema": dialect, "type": "object", "dependencies": {"a": ["b"]}}
    if embedded:
        up = FakeUpstream(Reply(text='{"x": {"a": 1}}'))
        schema = {"$defs": {"sub": {"$id": "urn:sub", **schema}},
                  "type": "object", "properties": {"x": {"$ref": "urn:sub"}}}
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            await s.chat([{"role": "user", "content": "hi"}], schema=schema)
    assert "'b' is a dependency of 'a'" in info.value.errors[0]


@pytest.mark.parametrize("dialect", [
    "http://json-schema.org/draft/2020-12/schema", "http://json-schema.org/draft/2019-09/schema#",
])
async def test_the_http_spelling_of_a_newer_draft_is_that_draft(
    autojump_clock: trio.testing.MockClock, dialect: str
) -> None:
    """A review of the fix above: it refused the http spelling of 2020-12 (whose own
    URI is https), which worked before and is common in hand-written schemas."""
    up = FakeUpstream(Reply(text='{"a": 1}'))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        structured=polygate.Structured(max_reasks=0))})
    schema = {"$schema": dialect, "type": "object", "required": ["b"]}
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            await s.chat([{"role": "user", "content": "hi"}], schema=schema)
    assert "'b' is a required property" in info.value.errors[0]


@pytest.mark.parametrize("dialect", ["urn:example:my-draft", "", "https://example.com/schema"])
async def test_a_schema_naming_an_unknown_draft_is_a_config_error(
    autojump_clock: trio.testing.MockClock, dialect: str
) -> None:
    up = FakeUpstream(Reply(text='{"a": 1}'))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="names no JSON Schema draft"):
            await s.chat([{"role": "user", "content": "hi"}], schema={"$schema": dialect})
    assert up.requests == []
