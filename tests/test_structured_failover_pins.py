"""Behaviours of structured output, stream resume and fallback chains that no other
test pinned (polygate/_structured.py, _resume.py, _fallback.py and the parts of
_call.py that drive them).

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router
from tests.conftest import MESSAGES, one_source_settings
from tests.test_failover import CONTEXT, _scopes
from tests.test_structured import (
    GOOD,
    NOT_JSON,
    WRONG_TYPE,
    Answer,
    _OneMessage,
    by_round,
    pydantic,
)
from tests.test_structured import with_structured as _with_reasks

# --------------------------------------------------------------------------- structured


async def test_the_reask_message_lists_each_problem_as_a_bullet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S26 (_structured.py: ``"\\n".join(f"- {p}" ...)`` -> ``"\\n".join(exc.problems)``):
    docs/structured.md shows the re-ask's user message word for word, each problem on
    a line of its own after "- "."""
    up = FakeUpstream(by_round(Reply(text=WRONG_TYPE), Reply(text=GOOD)))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.call_stats.reasks == 1
    reask = up.requests[1].body["messages"][-1]
    assert reask == {"role": "user", "content": (
        "Your previous answer is not valid: it must be only a JSON value that matches the "
        "required JSON Schema.\nProblems:\n"
        "- $.population: Input should be a valid integer, unable to parse string as an integer\n"
        "Answer again with the corrected JSON only."
    )}


_TWO_PROBLEMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


async def test_a_rounds_errors_entry_is_its_problems_one_per_line_ordered_by_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S28 (``self.errors.append("\\n".join(...))`` -> ``"; ".join``) and S19 (the
    problems sorted by their path -> jsonschema's own order, keyword by keyword):
    SPEC 8.1/docs: ``errors`` holds one string per round, that round's problems one
    per line; the problem at ``$`` (a missing property) comes before ``$.population``."""
    up = FakeUpstream(Reply(text='{"population": "many"}'))
    settings = _with_reasks(one_source_settings(), 0)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            await s.chat(MESSAGES, schema=_TWO_PROBLEMS)
    assert info.value.errors == [
        "$: 'city' is a required property\n$.population: 'many' is not of type 'integer'"
    ]


class _Listed(pydantic.BaseModel):
    items: list[int]


async def test_a_pydantic_problem_in_a_list_is_reported_with_its_index(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S30 (_json_path: ``[{p}]`` for an int -> ``.{p}``): problems are ``$.path:
    message`` in JSONPath, a list element as ``$.items[1]`` (as the dict schema's
    jsonschema paths are), which is what the model is told to fix."""
    up = FakeUpstream(Reply(text='{"items": [1, "x"]}'))
    settings = _with_reasks(one_source_settings(), 0)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as info:
            await s.chat(MESSAGES, schema=_Listed)
    assert info.value.errors[0].startswith("$.items[1]: Input should be a valid integer")


async def test_the_schema_name_sent_is_cut_at_64_characters(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """S17 (_safe_name ``[:64]`` -> ``[:65]``): docs: the name is cut at 64 characters
    (OpenAI refuses ``json_schema.name`` longer than ``^[A-Za-z0-9_-]{1,64}$``)."""
    schema = {"title": "T" * 100, "type": "object"}
    up = FakeUpstream(Reply(text="{}"))
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        await s.chat(MESSAGES, schema=schema)
    assert up.requests[0].body["response_format"]["json_schema"]["name"] == "T" * 64


_TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


async def test_content_beside_tool_calls_is_validated(autojump_clock: trio.testing.MockClock) -> None:
    """S13 (not_an_answer: ``not response.text and bool(...)`` -> ``bool(...)``): only
    tool calls or a refusal *and no content* skip validation (docs/structured.md); an
    answer with content beside its tool calls is validated and parsed."""
    up = _OneMessage({"role": "assistant", "content": GOOD, "tool_calls": [_TOOL_CALL]}, "tool_calls")
    async with polygate.session(one_source_settings(), transport=up) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed == Answer(city="Paris", population=2100000)


async def test_a_reask_skips_a_scope_whose_model_refused_the_context_without_exhausted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """C5/F8 (_call.py ``start = first_not_refused(...)`` -> ``start = scope_name``, or
    first_not_refused returning its scope): docs/structured.md: a re-ask round starts in
    the first fallback scope that can take a prompt the asked scope's models refused as
    too long.  With ``fallback_on=("context_length",)`` only (no ``exhausted``), the
    round must not start (and die) in the asked scope."""
    small = FakeUpstream(CONTEXT)
    large = FakeUpstream(by_round(Reply(text=NOT_JSON), Reply(text=GOOD)))
    settings = _scopes(
        chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "big",
              "fallback_on": ("context_length",)},
        big={"sources": {"large": {"model": "m-128k"}}},
    )
    async with polygate.session(settings, transport=Router({"small": small, "large": large})) as s:
        r = await s.chat(MESSAGES, schema=Answer)
    assert r.parsed is not None and r.call_stats.reasks == 1 and r.call_stats.scope == "big"
    assert len(small.requests) == 1


# --------------------------------------------------------------------------- resume

WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)


def _continuing(full: str, rest: str) -> Any:
    from polygate._resume import CONTINUE_PROMPT

    def behaviour(request: Any, rng: Any) -> Reply:
        messages = request.body["messages"]
        if messages[-1]["role"] == "assistant" or messages[-1]["content"] == CONTINUE_PROMPT:
            return Reply(text=rest, inter_token_s=0.01)
        return Reply(text=full, inter_token_s=0.01)

    return behaviour


def _resume_settings() -> polygate.Settings:
    return _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True),
    })


async def _stream_text(s: polygate.Session, **params: Any) -> str:
    async with s.stream_chat(MESSAGES, **params) as stream:
        async for _ in stream:
            pass
    return stream.text


async def test_a_long_restatement_within_the_window_is_removed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R7 (Stitcher ``window=256`` -> ``64``): a continuation that restates the last
    ~100 characters shown (inside the 256-character window) is stitched away whole."""
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    b = FakeUpstream(_continuing(ANSWER, " " + " ".join(WORDS[15:])))  # restates w15..w39
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        assert await _stream_text(s) == ANSWER


async def test_an_overlap_must_start_at_a_word_edge_of_what_was_shown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R8 (_whole_words: ``starts = ...`` -> ``True``): "theory of relativity" is not a
    whole-word overlap of "...subtheory of relativity" (docs: whole words), so a
    continuation that begins so is a genuine one and is kept."""
    full = "we study the subtheory of relativity today"
    a = FakeUpstream(Reply(text=full, inter_token_s=0.01, fault="truncated", fault_after=6))
    b = FakeUpstream(_continuing(full, "theory of relativity is new"))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        text = await _stream_text(s)
    assert text == "we study the subtheory of relativitytheory of relativity is new"


async def test_the_longest_restatement_is_the_one_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R11 (_decide looks for the shortest overlap first): of two whole-word overlaps
    (13 and 27 characters), the longest is dropped (docs: "drops the longest overlap")."""
    full = "one two three one two three four five"
    a = FakeUpstream(Reply(text=full, inter_token_s=0.01, fault="truncated", fault_after=6))
    b = FakeUpstream(_continuing(full, "one two three one two three four five"))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        assert await _stream_text(s) == full


async def test_a_stream_asking_for_several_choices_is_not_resumed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """C7 (_can_resume: ``and (n is None or n == 1)`` dropped): docs/failover.md and
    _resume's limits: a stream that asked for ``n > 1`` is not resumed (only the first
    choice could be continued); its failure reaches the caller, nothing is sent to b."""
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    b = FakeUpstream(_continuing(ANSWER, " " + " ".join(WORDS[40:])))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.TransientUpstreamError):
            await _stream_text(s, n=2)
    assert b.requests == []


# --------------------------------------------------------------------------- fallback


def _two(fallback_on: tuple[str, ...], **chat: Any) -> polygate.Settings:
    return _scopes(
        chat={"sources": {"a": {}}, "fallback": "other", "fallback_on": fallback_on, **chat},
        other={"sources": {"other": {}}},
    )


async def test_an_anthropic_prompt_too_long_is_a_context_length_refusal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """F10 (_CONTEXT_TEXT loses "prompt is too long"): Anthropic's 400 without a code,
    "prompt is too long: N tokens > M maximum", is a context-length refusal and falls
    back under the default fallback_on."""
    a = FakeUpstream(Reply(status=400, error_body={"error": {
        "type": "invalid_request_error", "message": "prompt is too long: 210000 tokens > 200000 maximum"}}))
    other = FakeUpstream(Reply(text="from other"))
    settings = _two(("exhausted", "context_length"))
    async with polygate.session(settings, transport=Router({"a": a, "other": other})) as s:
        assert (await s.chat(MESSAGES)).text == "from other"


@pytest.mark.parametrize(("code", "message"), [
    pytest.param(None, "Your request was flagged by our moderation system.", id="flagged-by-text"),
    pytest.param("content_filter", "Request refused.", id="code-alone"),
])
async def test_a_content_policy_refusal_known_by_text_or_code_alone_is_not_routed(
    autojump_clock: trio.testing.MockClock, code: str | None, message: str,
) -> None:
    """F11 (_POLICY_TEXT loses "flagged by") and F12 (``code in POLICY_CODES or text``
    -> ``and``): a content-policy refusal, known by its text alone or its code alone,
    matches only ``content_policy``: a scope falling back on ``fatal`` keeps it."""
    body: dict[str, Any] = {"type": "invalid_request_error", "message": message}
    if code is not None:
        body["code"] = code
    a = FakeUpstream(Reply(status=400, error_body={"error": body}))
    other = FakeUpstream(Reply(text="from other"))
    async with polygate.session(_two(("fatal",)), transport=Router({"a": a, "other": other})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
    assert other.requests == []


async def test_rate_limited_needs_every_error_to_be_a_429(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """F1 (failure_reasons: ``all(...RateLimitedError)`` -> ``any``): docs/failover.md:
    ``rate_limited`` only when every error was a 429; a 429 then a 503 is exhaustion
    alone, which a scope falling back on ``rate_limited`` only does not route."""
    a = FakeUpstream(Reply(status=429, retry_after_s=1))
    b = FakeUpstream(Reply(status=503))
    other = FakeUpstream(Reply(text="from other"))
    settings = _scopes(
        chat={"sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}}, "fallback": "other",
              "fallback_on": ("rate_limited",), "retry": polygate.Retry(max_attempts=1)},
        other={"sources": {"other": {}}},
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "other": other})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    assert [type(e) for e in info.value.errors] == [polygate.RateLimitedError, polygate.TransientUpstreamError]
    assert other.requests == []
