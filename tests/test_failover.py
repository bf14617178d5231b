"""Failover that finishes the answer (MockClock, fake transport): fallback chains between
scopes, the same-source retry policy, and committed streams resumed on another source,
stitched so that the caller sees one stream and ``stream.response`` is all of it."""

from __future__ import annotations

import json
import random
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polygate
from polygate._resume import CONTINUE_PROMPT, ResumedForward, Stitcher
from polygate.governance import BreakerState
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import MESSAGES, SECRET, ask

WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)


def _scopes(**scopes: dict[str, Any]) -> polygate.Settings:
    """``name={"sources": {"a": {...}}, **scope}``; sources named after their hosts."""
    built = {}
    for name, spec in scopes.items():
        spec = dict(spec)
        sources = [
            polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, **kw)
            for n, kw in spec.pop("sources").items()
        ]
        built[name] = polygate.Scope(sources=sources, **spec)
    return polygate.Settings(scopes=built)


def _err(status: int, code: str, message: str) -> Reply:
    return Reply(status=status, error_body={"error": {"message": message, "type":
                                                       "invalid_request_error", "code": code}})


CONTEXT = _err(400, "context_length_exceeded",
               "This model's maximum context length is 8192 tokens. However, you requested 9000.")
POLICY = _err(400, "content_filter",
              "The response was filtered due to the prompt triggering the content management policy.")


# --------------------------------------------------------------------------- fallback


async def test_an_exhausted_scope_falls_back_within_the_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    small = FakeUpstream(Reply(status=503))
    large = FakeUpstream(Reply(text="from the large model"))
    settings = _scopes(
        chat={"sources": {"small": {}}, "fallback": "large",
              "retry": polygate.Retry(max_attempts=2, backoff_base_s=0.5)},
        large={"sources": {"large": {}}},
    )
    async with polygate.session(settings, transport=Router({"small": small, "large": large})) as s:
        r = await s.chat(MESSAGES)
    st_ = r.call_stats
    assert (r.text, r.source, st_.scope, st_.attempts) == ("from the large model", "large", "large", 3)
    assert len(small.requests) == 2


@pytest.mark.parametrize("streaming", [False, True])
async def test_errors_of_a_fallback_chain_are_every_scopes(
    streaming: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """``AllSourcesExhausted.errors`` lists every attempt's error across the chain, in
    the order they happened (SPEC §3; docs/concepts.md) -- the context-length 400 that
    moved the call on included -- not only the last scope's."""
    a = FakeUpstream(Reply(status=503))
    b = FakeUpstream(CONTEXT)
    c = FakeUpstream(Reply(status=502))
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "mid", "retry": polygate.Retry(max_attempts=2)},
        mid={"sources": {"b": {}}, "fallback": "big"},
        big={"sources": {"c": {}}, "retry": polygate.Retry(max_attempts=1)},
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await ask(s, streaming)
    errors = info.value.errors
    assert [(e.source, e.status_code) for e in errors] == [("a", 503), ("a", 503), ("b", 400), ("c", 502)]
    assert info.value.call_stats is not None and info.value.call_stats.attempts == 4


async def test_fallbacks_chain_and_share_one_deadline(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(status=503, headers_delay_s=3))
    b = FakeUpstream(Reply(status=503, headers_delay_s=3))
    c = FakeUpstream(Reply(first_token_s=10))
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "mid", "retry": polygate.Retry(max_attempts=1),
              "call_deadline_s": 8},
        mid={"sources": {"b": {}}, "fallback": "big", "retry": polygate.Retry(max_attempts=1)},
        big={"sources": {"c": {}}},
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await s.chat(MESSAGES)
    # a fails at 3, b at 6, c is cancelled by the call's one deadline at 8
    assert info.value.call_stats is not None
    assert info.value.call_stats.total_latency_ms == pytest.approx(8000)
    assert [len(u.requests) for u in (a, b, c)] == [1, 1, 1]
    assert c.requests[0].started_at == pytest.approx(6)


async def test_a_context_length_error_moves_to_a_larger_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    small = FakeUpstream(CONTEXT)
    large = FakeUpstream(Reply(text="long answer"))
    settings = _scopes(
        chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "large"},
        large={"sources": {"large": {"model": "m-128k"}}},
    )
    async with polygate.session(settings, transport=Router({"small": small, "large": large})) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.call_stats.scope) == ("long answer", "large")
    assert len(small.requests) == 1  # a fatal 400 is never retried on the same source


async def test_a_model_that_refused_earlier_in_the_chain_is_never_asked_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: only the model that refused last was remembered, so a chain m-8k →
    m-32k → m-8k → m-128k sent the request to m-8k again after m-32k refused it too."""
    small, mid = FakeUpstream(CONTEXT), FakeUpstream(CONTEXT)
    again, large = FakeUpstream(Reply(text="8k again")), FakeUpstream(Reply(text="large"))
    settings = _scopes(
        chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "mid"},
        mid={"sources": {"mid": {"model": "m-32k"}}, "fallback": "again"},
        again={"sources": {"again": {"model": "m-8k"}}, "fallback": "large"},
        large={"sources": {"large": {"model": "m-128k"}}},
    )
    router = Router({"small": small, "mid": mid, "again": again, "large": large})
    async with polygate.session(settings, transport=router) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.call_stats.scope) == ("large", "large")
    assert again.requests == [] and len(mid.requests) == 1


async def test_a_context_length_error_is_never_resent_to_the_same_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fallback whose sources all serve the model that refused is skipped for its
    own fallback; with none left, the caller gets the 400 itself."""
    small = FakeUpstream(CONTEXT)
    same = FakeUpstream(Reply(text="same model elsewhere"))
    large = FakeUpstream(Reply(text="large"))
    settings = _scopes(
        chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "mirror"},
        mirror={"sources": {"same": {"model": "m-8k"}}, "fallback": "large"},
        large={"sources": {"large": {"model": "m-128k"}}},
    )
    router = Router({"small": small, "same": same, "large": large})
    async with polygate.session(settings, transport=router) as s:
        assert (await s.chat(MESSAGES)).text == "large"
    assert same.requests == []
    settings = _scopes(
        chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "mirror"},
        mirror={"sources": {"same": {"model": "m-8k"}}},
    )
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.FatalUpstreamError, match="maximum context length"):
            await s.chat(MESSAGES)


@pytest.mark.parametrize("hedged", [False, True])
async def test_a_context_refusal_is_not_resent_to_its_model_inside_a_mixed_fallback_scope(
    autojump_clock: trio.testing.MockClock, hedged: bool,
) -> None:
    """review: a fallback scope serving the refusing model beside a larger one was
    entered (right), and then its source of the refusing model was picked (weights
    made it certain here; even weights, half the calls): the same 400 reached the
    caller, and the larger model was never asked.  Its sources are excluded from
    the pick, the hedge's too."""
    small, x = FakeUpstream(CONTEXT), FakeUpstream(CONTEXT)
    y = FakeUpstream(Reply(text="long answer", first_token_s=5 if hedged else 0))
    z = FakeUpstream(Reply(text="long answer"))
    large: dict[str, Any] = {"sources": {"x": {"model": "m-8k", "weight": 1.0},
                                         "y": {"model": "m-128k", "weight": 1e-9},
                                         "z": {"model": "m-128k", "weight": 1e-18}}}
    if hedged:
        large["hedge"] = polygate.Hedge(after_s=1)
    settings = _scopes(chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "large"}, large=large)
    async with polygate.session(settings, transport=Router({"small": small, "x": x, "y": y, "z": z})) as s:
        r = await s.chat(MESSAGES)
    assert r.text == "long answer" and r.source == ("z" if hedged else "y")
    assert x.requests == []


async def test_the_only_source_left_after_a_context_refusal_is_retried_after_a_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review of the exclusion above: the backoff waits once every source failed, and
    counted the excluded one too: the only source the call could use was asked again
    three times at t=0."""
    small, x = FakeUpstream(CONTEXT), FakeUpstream(CONTEXT)
    y = FakeUpstream([Reply(status=503), Reply(status=503)], then=Reply(text="ok"))
    settings = _scopes(
        chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "large"},
        large={"sources": {"x": {"model": "m-8k"}, "y": {"model": "m-128k"}},
               "retry": polygate.Retry(max_attempts=3, backoff_base_s=1.0)})
    async with polygate.session(settings, transport=Router({"small": small, "x": x, "y": y})) as s:
        assert (await s.chat(MESSAGES)).text == "ok"
    assert x.requests == [] and len(y.requests) == 3
    for before, after in zip(y.requests, y.requests[1:], strict=False):
        assert before.ended_at is not None and after.started_at > before.ended_at


async def test_a_stream_continues_in_the_fallback_when_its_source_was_the_only_one_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review of the exclusion above: a committed stream whose source was the only one
    of its scope the call could use went back to that source (three cuts, then the
    error), instead of on to the fallback."""
    answer = "one two three four five six seven eight nine ten"
    small, x = FakeUpstream(CONTEXT), FakeUpstream(CONTEXT)
    y = FakeUpstream(Reply(text=answer, fault="truncated", fault_after=4))
    z = FakeUpstream(Reply(text=" five six seven eight nine ten"))
    settings = _scopes(
        chat={"sources": {"small": {"model": "m-8k"}}, "fallback": "large",
              "stream": polygate.StreamWatch(resume=True)},
        large={"sources": {"x": {"model": "m-8k"}, "y": {"model": "m-128k"}}, "fallback": "huge"},
        huge={"sources": {"z": {"model": "m-128k"}}},
    )
    async with polygate.session(settings, transport=Router({"small": small, "x": x, "y": y, "z": z})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    assert stream.response.text == answer
    assert (len(x.requests), len(y.requests), len(z.requests)) == (0, 1, 1)


async def test_a_content_policy_refusal_is_not_routed_around_unless_asked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    strict = FakeUpstream(POLICY)
    lax = FakeUpstream(Reply(text="anything goes"))
    router = Router({"strict": strict, "lax": lax})
    broad = ("exhausted", "context_length", "fatal", "status:400")
    settings = _scopes(chat={"sources": {"strict": {}}, "fallback": "other", "fallback_on": broad},
                       other={"sources": {"lax": {}}})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.chat(MESSAGES)
    assert info.value.code == "content_filter" and lax.requests == []
    settings = _scopes(
        chat={"sources": {"strict": {}}, "fallback": "other", "fallback_on": ("content_policy",)},
        other={"sources": {"lax": {}}})
    async with polygate.session(settings, transport=router) as s:
        assert (await s.chat(MESSAGES)).call_stats.scope == "other"


async def test_a_fatal_4xx_moves_only_when_listed(autojump_clock: trio.testing.MockClock) -> None:
    bad = FakeUpstream(_err(422, "unsupported_parameter", "Unsupported parameter: 'seed'"))
    good = FakeUpstream(Reply(text="ok"))
    router = Router({"bad": bad, "good": good})
    settings = _scopes(chat={"sources": {"bad": {}}, "fallback": "other"},
                       other={"sources": {"good": {}}})
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
    settings = _scopes(chat={"sources": {"bad": {}}, "fallback": "other",
                             "fallback_on": ("status:422",)},
                       other={"sources": {"good": {}}})
    async with polygate.session(settings, transport=router) as s:
        assert (await s.chat(MESSAGES)).text == "ok"


async def test_rate_limited_moves_the_later_calls_of_a_429s_window_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Probe finding (fourth round): fallback_on=("rate_limited",) moved only the call
    that got the 429; the next calls, refused at admission while the source cooled
    down (no attempt, so no 429 of their own), failed instead of moving on."""
    cheap = FakeUpstream(Reply(status=429, retry_after_s=120))
    costly = FakeUpstream(Reply(text="costly answer"))
    settings = _scopes(chat={"sources": {"cheap": {}}, "fallback": "costly",
                             "fallback_on": ("rate_limited",), "call_deadline_s": 30},
                       costly={"sources": {"costly": {}}})
    async with polygate.session(settings, transport=Router({"cheap": cheap, "costly": costly})) as s:
        answers = [await s.chat(MESSAGES) for _ in range(3)]
    assert [(a.text, a.call_stats.scope) for a in answers] == [("costly answer", "costly")] * 3
    assert len(cheap.requests) == 1  # the later calls did not knock on it again


# --------------------------------------------------------------------------- retry policy


@pytest.mark.parametrize(("same", "expected"), [(0, "b"), (1, "a")])
async def test_same_source_retries_wait_out_retry_after_before_failing_over(
    autojump_clock: trio.testing.MockClock, same: int, expected: str
) -> None:
    """a answers 429 (Retry-After: 2 s) once.  Failing over at once (the default), b
    answers at 0; with ``same_source_retries=1`` a answers at 2 s."""
    a = FakeUpstream([Reply(status=429, retry_after_s=2)], then=Reply(text="a"))
    b = FakeUpstream(Reply(text="b"))
    settings = _scopes(chat={"sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
                             "retry": polygate.Retry(same_source_retries=same)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
        done = trio.current_time()
    assert r.text == expected
    assert done == pytest.approx(0 if expected == "b" else 2)


async def test_same_source_retries_then_fail_over(autojump_clock: trio.testing.MockClock) -> None:
    """A 500 twice on the preferred source: retried once (after a backoff), then the call
    moves to the other source; the retry did not use up max_attempts."""
    a = FakeUpstream(Reply(status=500))
    b = FakeUpstream(Reply(text="b"))
    settings = _scopes(chat={"sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
                             "retry": polygate.Retry(same_source_retries=1, max_attempts=2)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, len(a.requests), r.call_stats.attempts) == ("b", 2, 3)


class _TopJitter(random.Random):
    """Each backoff at its ceiling (full_jitter draws with ``uniform``)."""

    def uniform(self, a: float, b: float) -> float:
        return b


@pytest.mark.parametrize("same", [0, 1])
async def test_a_same_source_retry_that_never_ran_leaves_its_source_among_the_failed(
    autojump_clock: trio.testing.MockClock, same: int,
) -> None:
    """Review (found by mutating it): a 429s with a Retry-After past
    ``rate_limit_wait_s``, so the same-source retry planned for it never runs and the
    call fails over; b and c answer 500.  Planning the retry took a out of the failed
    sources, so "every source failed" never held again: once their own retries were
    used, b and c were asked round after round in one instant (a retry storm on two
    failing upstreams) where without same-source retries each round waits a backoff."""
    a = FakeUpstream(Reply(status=429, retry_after_s=1000))
    b = FakeUpstream(Reply(status=500))
    c = FakeUpstream(Reply(status=500))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-4}, "c": {"weight": 1e-9}},
        "breaker": polygate.Breaker(failures=1000),
        "retry": polygate.Retry(same_source_retries=same, max_attempts=8, backoff_base_s=10,
                                backoff_max_s=10, rate_limit_wait_s=30),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c}),
                                rng=_TopJitter(1)) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
    times = sorted(q.started_at for u in (b, c) for q in u.requests)
    # Before every source had failed, b then c at once; after, one round a backoff.
    assert max(times.count(t) for t in set(times)) <= 2, times


# --------------------------------------------------------------------------- resume


def _continuing(rest: str, **kw: Any) -> Any:
    """An upstream that answers a continuation request (its last message is the
    continue prompt, or a trailing assistant message) with ``rest``."""

    def behaviour(request: Any, rng: Any) -> Reply:
        messages = request.body["messages"]
        if messages[-1]["role"] == "assistant" or messages[-1]["content"] == CONTINUE_PROMPT:
            return Reply(text=rest, **kw)
        return Reply(text=ANSWER, **kw)

    return behaviour


def _resume_settings(**stream: Any) -> polygate.Settings:
    return _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True, **stream),
    })


def _sse_choices(choices: list[dict[str, Any]], *, end: bool) -> bytes:
    """An SSE body: a chunk per first-choice dict (``{"delta": …}``, with ``logprobs``
    or not), then, with ``end``, a stop and ``[DONE]`` (without: a cut stream)."""
    events = [json.dumps({"choices": [{"index": 0, **choice}]}) for choice in choices]
    if end:
        events += [json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                   "[DONE]"]
    return "".join(f"data: {e}\n\n" for e in events).encode()


def _two_upstreams(answers: dict[str, bytes], seen: dict[str, Any] | None = None) -> Router:
    """Sources ``a`` and ``b`` answering their SSE body; ``seen``: each one's last
    request body."""
    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen[request.url.host] = json.loads(request.content)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=answers[request.url.host])

    transport = httpx.MockTransport(answer)
    return Router({"a": transport, "b": transport})


async def _read(s: polygate.Session) -> tuple[polygate.ChatStream, list[polygate.StreamChunk]]:
    chunks = []
    async with s.stream_chat(MESSAGES) as stream:
        async for chunk in stream:
            chunks.append(chunk)
    return stream, chunks


async def test_a_stream_cut_mid_way_is_finished_by_another_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cut after 40 of 60 tokens: b continues (restating the last words, which are
    stitched away); the caller sees one stream, marked where it resumed."""
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    shown = " ".join(WORDS[:40])
    rest = " " + " ".join(WORDS[37:])  # restates w37 w38 w39
    b = FakeUpstream(_continuing(rest, inter_token_s=0.01))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        stream, chunks = await _read(s)
    response = stream.response
    assert response is not None
    assert stream.text == response.text == ANSWER
    assert [c.resumed for c in chunks].count(True) == 1
    resumed_at = next(i for i, c in enumerate(chunks) if c.resumed)
    assert "".join(c.text for c in chunks[:resumed_at]) == shown
    cs = response.call_stats
    assert (cs.resumes, cs.source, cs.attempts) == (1, "b", 2)
    sent = b.requests[0].body["messages"]
    assert sent[-2] == {"role": "assistant", "content": shown}
    assert sent[-1] == {"role": "user", "content": CONTINUE_PROMPT}
    # usage: the continuation's reported usage plus an estimate for the cut segment
    assert response.usage is not None and response.usage.source == "estimated"
    assert response.usage.completion_tokens > b.requests[0].reply.tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "text"])
async def test_a_callers_json_format_is_left_out_of_a_continuation(
    kind: str, autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review: a caller's own JSON ``response_format`` was sent again with the
    request to continue, and a constrained decoder wrote a new document after the cut
    one (the joined text no JSON at all).  It is left out, as polygate's own format
    for ``schema=`` is; a text format stays."""
    fmt: dict[str, Any] = {"type": kind}
    if kind == "json_schema":
        fmt["json_schema"] = {"name": "c", "schema": {"type": "object"}}
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[40:])))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES, response_format=fmt) as stream:
            async for _ in stream:
                pass
    assert stream.response is not None and stream.response.text == ANSWER
    assert a.requests[0].body["response_format"] == fmt
    assert b.requests[0].body.get("response_format") == (fmt if kind == "text" else None)


@pytest.mark.parametrize("usage", [False, True])
async def test_a_finish_on_a_chunk_of_pure_restatement_reaches_the_caller(
    autojump_clock: trio.testing.MockClock, usage: bool
) -> None:
    """Outside review: a continuation whose only text restates what was shown, in the
    chunk that also carries the finish (as many providers send the last token), lost
    that chunk whole -- its finish_reason and Azure's content_filter_results never
    reached the caller, where the same chunk unresumed does."""
    import httpx

    verdict = {"hate": {"filtered": False, "severity": "safe"}}

    def event(choice: dict[str, Any] | None, **top: Any) -> bytes:
        body = {"id": "x", "object": "chat.completion.chunk", "model": "m",
                "choices": [] if choice is None else [{"index": 0, **choice}], **top}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    class Continuation(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=len(WORDS))).transport()

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.host == "a":
                return await self.a.handle_async_request(request)
            await request.aread()
            body = event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            body += event({"delta": {"content": " " + " ".join(WORDS[-3:])}, "finish_reason": "stop",
                           "content_filter_results": verdict})
            if usage:
                body += event(None, usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})
            body += b"data: [DONE]\n\n"
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    async with polygate.session(_resume_settings(), transport=Continuation()) as s:
        stream, chunks = await _read(s)
    assert stream.response is not None and stream.response.call_stats.resumes == 1
    assert stream.text == stream.response.text == ANSWER
    last = [c for c in chunks if c.raw.get("choices")][-1]
    assert last.resumed and last.text == ""
    assert last.raw["choices"][0]["finish_reason"] == "stop"
    assert last.raw["choices"][0]["content_filter_results"] == verdict
    assert stream.response.finish_reason == "stop"


async def test_a_continuation_waits_for_admission_no_longer_than_the_stall_watch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review: a continuation waited for admission as long as the call allowed
    (here the 60 s RPM window; without a deadline, for ever) while the caller's stream,
    watched for 3 s of silence, said nothing.  Its wait is silence like its wait for a
    first token: past stall_timeout_s the stream fails with its own error and text."""
    a = FakeUpstream([Reply(status=500), Reply(text=ANSWER, fault="truncated", fault_after=10)])
    b = FakeUpstream(Reply(text="from b"))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0, "rpm": 2}, "b": {"weight": 1e-9, "rpm": 1}},
        "stream": polygate.StreamWatch(resume=True, stall_timeout_s=3),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        assert (await s.chat(MESSAGES)).text == "from b"  # a answered 500: each RPM now used up
        shown: list[str] = []
        with pytest.raises(polygate.TransientUpstreamError) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    shown.append(chunk.text)
                    cut_at = trio.current_time()
        assert trio.current_time() - cut_at <= 3 + 1e-6
    assert "".join(shown) == " ".join(WORDS[:10]) and info.value.text == "".join(shown)
    assert len(b.requests) == 1


async def test_a_resume_of_mapping_messages_is_sent_as_their_items(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Found by a differential fuzz: messages that are Mappings but not dicts (the
    public signature allows them) broke the continuation's encoding with a bare
    TypeError; they are sent as their items, as the first request sends them."""
    import types

    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[40:]), inter_token_s=0.01))
    messages = [types.MappingProxyType(dict(m)) for m in MESSAGES]
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(messages) as stream:
            text = "".join([c.text async for c in stream])
    assert text == ANSWER and stream.response is not None and stream.response.call_stats.resumes == 1
    assert b.requests[0].body["messages"][0] == dict(MESSAGES[0])


async def test_a_slow_consumer_is_no_stall_across_the_seam(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A consumer taking 0.5 s a chunk holds the first segment back for many seconds.
    That time is the caller's (docs/statistics.md): subtracted from the joined
    timeline, it is no stall at the seam -- the continuation answered at once."""
    a = FakeUpstream(Reply(text=ANSWER, first_token_s=0.5, inter_token_s=0.01,
                           fault="truncated", fault_after=40))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[40:]), inter_token_s=0.01))
    settings = _resume_settings(stall_timeout_s=3.0)
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                await trio.sleep(0.5)
    response = stream.response
    assert response is not None and response.text == ANSWER
    cs = response.call_stats
    assert cs.resumes == 1
    assert (cs.stall_count, cs.stall_ms) == (0, 0), cs
    # and the generation time is the upstreams', not the consumer's 30 s
    assert cs.generation_ms is not None and cs.generation_ms < 2_000


async def test_a_cut_segments_usage_estimate_uses_the_callers_prompt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The cut segment reported no usage: its estimate is the caller's prompt plus what
    it showed (docs/failover.md) -- not the continuation's prompt, which holds the
    whole text shown and is reported by the continuation itself."""
    long = " ".join(f"word{i:04d}" for i in range(1_000))  # 9,999 characters
    a = FakeUpstream(Reply(text=long, fault="truncated", fault_after=600))
    b = FakeUpstream(_continuing(" " + " ".join(f"word{i:04d}" for i in range(600, 1_000))))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    response = stream.response
    assert response is not None and response.text == long
    from polygate.testing._render import _prompt_tokens

    usage, continuation = response.usage, _prompt_tokens(b.requests[0].body)
    assert usage is not None
    # the continuation's own (reported) prompt carries the ~6,000 characters shown
    assert continuation > 1_000
    # the cut segment adds the caller's small prompt, not another continuation's
    assert usage.prompt_tokens - continuation < 50, (usage, continuation)


async def test_a_continuation_that_reasons_first_is_still_stitched(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reasoning model used as the continuation sends its reasoning, then restates the
    last words shown.  The reasoning goes through as it comes (unchanged: no content
    added), and the restatement is still removed."""
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    rest = " " + " ".join(WORDS[37:])  # restates w37 w38 w39
    b = FakeUpstream(_continuing(rest, inter_token_s=0.01, reasoning_tokens=3))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        stream, chunks = await _read(s)
    response = stream.response
    assert response is not None
    assert stream.text == response.text == ANSWER
    reasoning = [c for c in chunks if "reasoning_content" in c.delta]
    assert len(reasoning) == 3
    assert all("content" not in c.delta for c in reasoning)
    assert reasoning[0].resumed  # the continuation's first chunk carries the mark


async def test_a_prefill_source_continues_from_the_text_shown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    rest = " " + " ".join(WORDS[40:])
    b = FakeUpstream(_continuing(rest))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "prefill": True}},
        "stream": polygate.StreamWatch(resume=True)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        stream, _ = await _read(s)
    assert stream.response is not None and stream.response.text == ANSWER
    body = b.requests[0].body
    assert body["messages"][-1] == {"role": "assistant", "content": " ".join(WORDS[:40])}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False


async def test_open_breakers_send_a_call_to_its_fallback_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: with its only source's breaker open, each call waited out the open
    period (4.5 s, then 7.9 s, 11.5 s as probes failed) before the probe failed and
    it moved to the fallback, which could have answered at once.  A scope whose
    sources' breakers are all open is exhausted for a call with a fallback; the
    breaker's probe is still the first call that finds it due."""
    a = FakeUpstream(Reply(status=500))
    big = FakeUpstream(Reply(text="big"))
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "large", "retry": polygate.Retry(max_attempts=1),
              "call_deadline_s": 60},
        large={"sources": {"big": {}}},
    )
    async with polygate.session(settings, transport=Router({"a": a, "big": big})) as s:
        for _ in range(5):  # the breaker opens after 5 consecutive failures
            await s.chat(MESSAGES)
        for _ in range(3):
            t0 = trio.current_time()
            r = await s.chat(MESSAGES)
            assert r.source == "big" and trio.current_time() == t0
            assert r.call_stats.attempts == 1  # nothing sent to the open source
        assert len(a.requests) == 5
        await trio.sleep(30)  # past any open period: the next call is the probe
        r = await s.chat(MESSAGES)
    assert r.source == "big" and len(a.requests) == 6


async def test_a_fallback_whose_breaker_period_ended_long_ago_is_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review finding (a session living for weeks): the fallback check read an OPEN
    breaker as down, and a snapshot says OPEN until an admission check moves it to
    half-open.  big failed once an hour ago (open for 30 s) and nothing asked it since:
    the call, a's breaker open, waited out two of a's open periods (60 s) and probed
    the dead a twice before moving to big, which was up all along."""
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
            breaker=polygate.Breaker(failures=1, open_s=30),
            retry=polygate.Retry(max_attempts=3, backoff_base_s=0.1), fallback="large"),
        "large": polygate.Scope(
            sources=[polygate.Source(name="big", base_url="http://big/v1", api_key=SECRET)],
            breaker=polygate.Breaker(failures=1, open_s=30), retry=polygate.Retry(max_attempts=1)),
    })
    a = FakeUpstream(Reply(status=500))
    big = FakeUpstream([Reply(status=500)], then=Reply(text="big answers"))
    async with polygate.session(settings, transport=Router({"a": a, "big": big})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES, scope="large")  # big's breaker opens for 30 s
        await trio.sleep(3600)
        [state] = [x.state for x in (await s.statistics()).governance.sources if x.state.source == "big"]
        assert state.breaker is BreakerState.OPEN  # (as documented: until a check)
        assert state.breaker_open_until == pytest.approx(30)
        r = await s.chat(MESSAGES, call_deadline_s=120)
    assert r.text == "big answers" and r.call_stats.scope == "large"
    assert r.call_stats.total_latency_ms < 1000, r.call_stats
    assert len(a.requests) == 1  # not probed again while big was up


async def test_a_continuation_in_a_fallback_scope_reserves_what_is_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a continuation that moved on to the fallback scope was asked for what
    was left of ``max_tokens`` but reserved the whole of it again (moving to a scope
    reset the estimate from the caller's parameters)."""
    a = FakeUpstream([Reply(text=ANSWER, fault="truncated", fault_after=40), Reply(status=503)])
    b = FakeUpstream(Reply(status=503))
    big = FakeUpstream(_continuing(" " + " ".join(WORDS[40:])))
    settings = _scopes(
        chat={"sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}}, "fallback": "big",
              "retry": polygate.Retry(max_attempts=2), "stream": polygate.StreamWatch(resume=True)},
        big={"sources": {"big": {}}},
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "big": big})) as s:
        async with s.stream_chat(MESSAGES, max_tokens=100) as stream:
            async for _ in stream:
                pass
        stats = await s.statistics()
    assert stream.response is not None and stream.response.text == ANSWER
    reserved = {x.state.source: x.state.reserved_total for x in stats.governance.sources}
    left = 100 - (len(" ".join(WORDS[:40])) + 3) // 4
    assert big.requests[0].body["max_tokens"] == left
    assert reserved["big"] == reserved["b"]  # the same continuation, the same limit


@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("prefill", [False, True])
async def test_a_continuation_asks_for_what_is_left_of_the_token_limit(
    autojump_clock: trio.testing.MockClock, limit: str, prefill: bool,
) -> None:
    """Review: the continuation was asked with the caller's whole ``max_tokens`` again,
    so a resumed answer could run to nearly twice the limit the caller set (and the
    quota reserved for it).  The limit bounds the whole answer: what was shown
    (estimated at four characters a token, as a cut segment's usage is) comes off."""
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[40:])))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "prefill": prefill}},
        "stream": polygate.StreamWatch(resume=True)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES, **{limit: 100}) as stream:
            async for _ in stream:
                pass
    shown = " ".join(WORDS[:40])
    assert a.requests[0].body[limit] == 100
    assert b.requests[0].body[limit] == 100 - (len(shown) + 3) // 4
    assert stream.response is not None and stream.response.text == ANSWER


async def test_the_time_between_segments_is_waiting_not_decoding(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review (scheduling-aware): ``a`` resets after 3 tokens, the continuation's first
    try (``b``) fails after 1.5 s, then ``a`` continues.  The 1.5 s seam is outside
    both segments' transport times (so outside generation_ms), yet the joined
    timeline counted it as decoding: active_generation_ms 1740 ms of a 300 ms
    generation.  SPEC §5: ttft, stalls and active decoding are where the generation
    time went."""
    a = FakeUpstream([
        Reply(text=ANSWER, first_token_s=0.1, inter_token_s=0.1, fault="reset", fault_after=3),
        Reply(tokens=2, first_token_s=0.1, inter_token_s=0.1),
    ])
    b = FakeUpstream(Reply(status=503, headers_delay_s=1.5))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-6}},
        "stream": polygate.StreamWatch(resume=True), "retry": polygate.Retry(max_attempts=3)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        stream, _ = await _read(s)
    assert stream.response is not None
    st = stream.response.call_stats
    assert st.resumes == 1 and [r.status for r in b.requests] == [503]
    assert st.ttft_ms is not None and st.stall_ms is not None
    assert st.active_generation_ms is not None
    assert st.ttft_ms + st.active_generation_ms + st.stall_ms <= st.generation_ms + 1e-6
    assert st.total_latency_ms - st.generation_ms >= 1500  # the seam is waiting


@pytest.mark.parametrize("retries", [3, 1])
async def test_a_rejected_prefill_is_asked_again_without_one(
    autojump_clock: trio.testing.MockClock, retries: int,
) -> None:
    """The target answers the prefill with a 400; it is asked again with the continue
    prompt, and that 400 never reaches the caller.  Free of max_attempts (a probe found
    max_attempts=1 ended the stream instead: the 400 is about polygate's way of asking)."""
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    rest = " " + " ".join(WORDS[40:])

    def picky(request: Any, rng: Any) -> Reply:
        if request.body.get("continue_final_message"):
            return _err(400, "invalid_request_error", "Unsupported parameter: continue_final_message")
        return _continuing(rest)(request, rng)

    b = FakeUpstream(picky)
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "prefill": True}},
        "stream": polygate.StreamWatch(resume=True), "retry": polygate.Retry(max_attempts=retries)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        stream, _ = await _read(s)
    assert stream.response is not None and stream.response.text == ANSWER
    assert [r.status for r in b.requests] == [400, 200]
    assert b.requests[1].body["messages"][-1]["content"] == CONTINUE_PROMPT


@pytest.mark.parametrize("fault", [
    {"stall_at": 20, "stall_s": 100},
    {"fault": "malformed_json", "fault_after": 10},
    {"fault": "error_event", "fault_after": 10},
])
async def test_a_committed_stream_survives_stalls_and_bad_events(
    autojump_clock: trio.testing.MockClock, fault: dict[str, Any]
) -> None:
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, **fault))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[1:])))  # worst case: a restates nearly all
    async with polygate.session(_resume_settings(stall_timeout_s=5),
                                transport=Router({"a": a, "b": b})) as s:
        stream, _ = await _read(s)
    assert stream.response is not None
    assert stream.text == stream.response.text
    assert stream.text.startswith(" ".join(WORDS[:10])) and stream.text.endswith("w59")
    assert stream.response.call_stats.resumes == 1


async def test_a_continuation_that_sends_no_first_token_is_a_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: a continuation was guarded only by its source's ttft_timeout_s (unset) and
    timeout_s (300 s), so a committed stream whose continuation hung stayed silent for
    600 s with stall_timeout_s=5.  Each continuation now has stall_timeout_s to send its
    first token; one that does not is a stall, and the next source is tried."""
    a = FakeUpstream([Reply(text=ANSWER, fault="truncated", fault_after=10)],
                     then=Reply(text=" " + " ".join(WORDS[10:])))
    b = FakeUpstream(Reply(text=" " + " ".join(WORDS[10:]), first_token_s=10_000))  # hangs
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True, stall_timeout_s=5),
        "retry": polygate.Retry(max_attempts=3),
    })
    gaps: list[float] = []
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        last = trio.current_time()
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                gaps.append(trio.current_time() - last)
                last = trio.current_time()
    assert stream.response is not None and stream.response.text == ANSWER
    assert stream.response.call_stats.resumes == 1
    # a failed, so it goes last: b is asked first and hangs for stall_timeout_s, then a
    # continues; the caller's silence is those 5 s and the back-off before the retry.
    assert b.requests[0].started_at == pytest.approx(0.0, abs=0.01)
    assert 5 <= max(gaps) < 6
    assert stream.response.call_stats.attempts == 3


async def test_a_source_that_cannot_stream_may_take_longer_to_continue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review of the fix above: a source that cannot stream sends its continuation as one
    body, its whole answer its "first token": the stall watch (silence between tokens)
    does not bound it, or it could never finish a stream whose rest takes longer."""
    a = FakeUpstream([Reply(text=ANSWER, fault="truncated", fault_after=10)], then=Reply(status=500))
    b = FakeUpstream(Reply(text=" " + " ".join(WORDS[10:]), first_token_s=8.0))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "streaming": False}},
        "stream": polygate.StreamWatch(resume=True, stall_timeout_s=5),
        "retry": polygate.Retry(max_attempts=4),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        stream, _ = await _read(s)
    assert stream.response is not None and stream.response.text == ANSWER
    assert stream.response.call_stats.resumes == 1 and len(b.requests) == 1


async def test_a_continuation_keeps_its_sources_shorter_ttft_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The stall watch only shortens a continuation's wait for its first token: a
    source's own ttft_timeout_s below it still applies (and its miss is a timeout)."""
    a = FakeUpstream([Reply(text=ANSWER, fault="truncated", fault_after=10)],
                     then=Reply(text=" " + " ".join(WORDS[10:])))
    b = FakeUpstream(Reply(text="x", first_token_s=10_000))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "ttft_timeout_s": 2}},
        "stream": polygate.StreamWatch(resume=True, stall_timeout_s=5),
        "retry": polygate.Retry(max_attempts=3),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        t0 = trio.current_time()
        stream, _ = await _read(s)
    assert stream.response is not None and stream.response.text == ANSWER
    assert trio.current_time() - t0 < 5


async def _silence_before_failure(settings: polygate.Settings, router: Router) -> tuple[float, BaseException]:
    """How long a committed stream that then fails was silent before it said so."""
    last: float | None = None
    async with polygate.session(settings, transport=router) as s:
        with pytest.raises(polygate.PolygateError) as failed:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    last = trio.current_time()
        assert last is not None  # (it had committed)
        return trio.current_time() - last, failed.value


async def test_a_continuations_429s_are_retried_within_one_stall_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: a 429's retry is free of max_attempts, bounded by the deadline or
    rate_limit_wait_s; for a continuation it is silence on the caller's stream, and
    short 429s (Retry-After: 1, each wait within stall_timeout_s) added up to 60 s of
    it and ~120 requests.  They are retried within one stall_timeout_s in all; then
    the stream fails with its own error and what was shown."""
    a = FakeUpstream([Reply(text=ANSWER, fault="truncated", fault_after=10)],
                     then=Reply(status=429, retry_after_s=1))
    b = FakeUpstream(Reply(status=429, retry_after_s=1))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True, stall_timeout_s=2),
        "retry": polygate.Retry(max_attempts=3),
    })
    silence, error = await _silence_before_failure(settings, Router({"a": a, "b": b}))
    assert silence == pytest.approx(2.0, abs=0.01)
    assert len(a.requests) + len(b.requests) <= 7  # (the first, and two rounds each a second)
    assert isinstance(error, polygate.TransientUpstreamError)  # the cut, as without resume
    assert error.call_stats is not None and error.call_stats.resumes == 1


async def test_a_continuations_same_source_retry_waits_at_most_its_stall_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: Retry(same_source_retries=1) after a continuation's 503 with Retry-After:
    30 waited those 30 s for its source, the caller's stream silent all along with
    stall_timeout_s=2.  A cooldown past the window is not waited for: the next source is
    asked at once."""
    a = FakeUpstream([Reply(text=ANSWER, fault="truncated", fault_after=10)],
                     then=Reply(status=503, retry_after_s=30))
    b = FakeUpstream(Reply(status=503, retry_after_s=30))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True, stall_timeout_s=2),
        "retry": polygate.Retry(max_attempts=3, same_source_retries=1),
    })
    silence, error = await _silence_before_failure(settings, Router({"a": a, "b": b}))
    assert silence < 2
    assert len(b.requests) == 1 and b.requests[0].started_at < 2
    assert isinstance(error, polygate.TransientUpstreamError)


async def test_a_malformed_event_before_the_commit_fails_the_attempt_as_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text=ANSWER, fault="malformed_json", fault_after=0))
    b = FakeUpstream(Reply(text=ANSWER))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        stream, chunks = await _read(s)
    assert stream.response is not None and stream.response.text == ANSWER
    assert stream.response.call_stats.resumes == 0 and not any(c.resumed for c in chunks)
    assert b.requests[0].body["messages"] == MESSAGES  # a plain retry, not a continuation


@pytest.mark.parametrize("call", [
    b'"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"lookup",'
    b'"arguments":"{\\"ci"}}]',
    # the legacy form (functions=...), which OpenAI-compatible servers still stream
    b'"function_call":{"name":"lookup","arguments":"{\\"ci"}',
    # review: a refusal cut halfway, "continued" by another model, was the refused
    # request answered afresh (half a refusal, then "Sure! ...")
    b'"refusal":"I\'m sorry, I can"',
], ids=["tool_calls", "function_call", "refusal"])
async def test_a_tool_call_cut_mid_arguments_is_not_resumed(
    call: bytes, autojump_clock: trio.testing.MockClock,
) -> None:
    """Half-sent tool-call arguments (or half a refusal) cannot be continued by another
    model: the stream fails as it would without resume (documented limit)."""
    body = (
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Let me look. "}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{' + call + b'}}]}\n\n'
    )
    b = FakeUpstream(Reply(text=ANSWER))

    async def cut(request: Any) -> Any:
        import httpx

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    import httpx

    transport = Router({"a": httpx.MockTransport(cut), "b": b})  # type: ignore[dict-item]
    async with polygate.session(_resume_settings(), transport=transport) as s:
        with pytest.raises(polygate.TransientUpstreamError, match="truncated"):
            await _read(s)
    assert b.requests == []


@pytest.mark.parametrize("restate", [0, 5], ids=["nothing_held", "restated_tail_held"])
@pytest.mark.parametrize("extra", [
    {"reasoning_content": "(picking up where I stopped)"},  # reasoning beside the text
    {"x_vendor": {"segment": 2}},  # a provider's extra on the delta
], ids=["reasoning", "vendor_field"])
async def test_a_continuation_whose_first_text_comes_with_another_field_keeps_it(
    autojump_clock: trio.testing.MockClock, extra: dict[str, Any], restate: int
) -> None:
    """Review finding: a delta that cannot be held (it carries another field) made
    the stitcher decide with what it held, and its own text was dropped: " w10" was
    missing from the caller's stream and from response.text alike."""
    import httpx

    words = WORDS[:20]
    answer = " ".join(words)
    a = FakeUpstream(Reply(text=answer, fault="truncated", fault_after=10))  # shows w0..w9

    async def continuation(request: Any) -> Any:
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        deltas += [{"content": " " + w} for w in words[10 - restate:10]]  # a restated tail
        deltas += [{"content": " " + words[10], **extra}]
        deltas += [{"content": " " + w} for w in words[11:]]
        body = b"".join(
            b"data: " + json.dumps({"choices": [{"index": 0, "delta": d}]}).encode() + b"\n\n"
            for d in deltas)
        body += b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    transport = Router({"a": a, "b": httpx.MockTransport(continuation)})  # type: ignore[dict-item]
    async with polygate.session(_resume_settings(), transport=transport) as s:
        stream, chunks = await _read(s)
    r = stream.response
    assert r is not None and r.call_stats.resumes == 1
    assert "".join(c.text for c in chunks) == r.text == answer


async def test_chat_restarts_cleanly_instead_of_resuming(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """chat() has shown nothing: a cut answer is retried whole, never stitched."""
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    b = FakeUpstream(Reply(text=ANSWER))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.call_stats.resumes) == (ANSWER, 0)
    assert b.requests[0].body["messages"] == MESSAGES


async def test_resume_off_keeps_todays_behaviour(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    b = FakeUpstream(Reply(text=ANSWER))
    settings = _scopes(chat={"sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}}})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.TransientUpstreamError):
            await _read(s)
    assert b.requests == []


async def test_a_resume_can_move_to_the_fallback_scope(autojump_clock: trio.testing.MockClock) -> None:
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    big = FakeUpstream(_continuing(" " + " ".join(WORDS[40:])))
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "big", "retry": polygate.Retry(max_attempts=1),
              "stream": polygate.StreamWatch(resume=True)},
        big={"sources": {"big": {}}},
    )
    async with polygate.session(settings, transport=Router({"a": a, "big": big})) as s:
        stream, _ = await _read(s)
    assert stream.response is not None and stream.response.text == ANSWER
    assert (stream.response.call_stats.scope, stream.response.call_stats.resumes) == ("big", 1)


async def test_resumes_are_bounded(autojump_clock: trio.testing.MockClock) -> None:
    """Every continuation is cut too: after max_resumes the stream fails as itself."""
    cut = Reply(text=ANSWER, fault="truncated", fault_after=5)
    a = FakeUpstream(cut)
    b = FakeUpstream(cut)
    async with polygate.session(_resume_settings(max_resumes=2),
                                transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.TransientUpstreamError) as info:
            await _read(s)
    assert info.value.call_stats is not None
    assert len(a.requests) + len(b.requests) == 3


async def test_the_asked_scopes_resume_policy_holds_in_its_fallback(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``resume`` and ``max_resumes`` are the call's, set by the scope it asked: a
    fallback with other settings neither stops nor extends them."""
    cut = Reply(text=ANSWER, fault="truncated", fault_after=5)
    a, big = FakeUpstream(cut), FakeUpstream(cut)
    settings = _scopes(
        chat={"sources": {"a": {}}, "fallback": "big", "retry": polygate.Retry(max_attempts=1),
              "stream": polygate.StreamWatch(resume=True, max_resumes=2)},
        big={"sources": {"big": {}}, "stream": polygate.StreamWatch(resume=True, max_resumes=5)},
    )
    async with polygate.session(settings, transport=Router({"a": a, "big": big})) as s:
        with pytest.raises(polygate.TransientUpstreamError) as info:
            await _read(s)
    assert len(a.requests) + len(big.requests) == 3  # the first segment and 2 resumes
    assert info.value.call_stats is not None and info.value.call_stats.resumes == 2


async def test_a_deadline_during_a_continuation_counts_the_resume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=20))
    b = FakeUpstream(_continuing(" " + " ".join(WORDS[20:]), inter_token_s=1.0))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True), "call_deadline_s": 5.0,
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await _read(s)
    assert info.value.call_stats is not None and info.value.call_stats.resumes == 1


@pytest.mark.parametrize("seed", range(8))
async def test_a_second_continuation_prefers_a_source_that_never_failed(
    autojump_clock: trio.testing.MockClock, seed: int,
) -> None:
    """a is cut, b continues and is cut too: the second continuation goes to c, which
    never failed in this call, not back to a (every failed source goes last, not only
    the latest).  Weights favour a, so a wrong pick is not left to chance."""
    import random

    cut = Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=5)
    ups = {n: FakeUpstream(cut) for n in "abc"}
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-6}, "c": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True, max_resumes=2),
    })
    async with polygate.session(settings, transport=Router(ups), rng=random.Random(seed)) as s:
        with pytest.raises(polygate.TransientUpstreamError):
            await _read(s)
    order = [n for _, n in sorted((r.started_at, n) for n, u in ups.items() for r in u.requests)]
    assert order == ["a", "b", "c"]


async def test_a_failed_continuation_reports_the_whole_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The continuation fails too and no resume is left: the error's statistics are
    the stream's as the caller lived it (both segments, one resume), and it carries
    the text shown."""
    a = FakeUpstream(Reply(text=ANSWER, first_token_s=0.5, inter_token_s=0.25,
                           fault="truncated", fault_after=4))
    b = FakeUpstream(_continuing(" w4 w5 w6 w7 w8", first_token_s=0.5, inter_token_s=0.25,
                                 fault="truncated", fault_after=2))
    shown: list[str] = []
    async with polygate.session(_resume_settings(max_resumes=1),
                                transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.TransientUpstreamError) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for chunk in stream:
                    shown.append(chunk.text)
    error = info.value
    cs = error.call_stats
    assert cs is not None
    assert (cs.resumes, cs.source, cs.attempts) == (1, "b", 2)
    assert cs.ttft_ms == pytest.approx(500)  # the first segment's
    # both segments' transport time: a's 0.5 + 3 x 0.25 s, b's 0.5 + 0.25 s (at least)
    assert cs.generation_ms is not None and cs.generation_ms >= 2000
    assert error.text == "".join(shown) and len(shown) >= 5


# --------------------------------------------------------------------------- stitching


def _fed(stitcher: Stitcher, text: str, pieces: list[int]) -> str:
    out, i, k = [], 0, 0
    while i < len(text):
        size = pieces[k % len(pieces)]
        out.append(stitcher.feed(text[i:i + size]))
        i += size
        k += 1
    out.append(stitcher.flush())
    return "".join(out)


@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(st.sampled_from(["alpha", "beta", "gamma", "the", "a", "theory", ",", "."]),
                   min_size=2, max_size=40),
    cut=st.integers(min_value=1, max_value=200),
    restate=st.integers(min_value=0, max_value=60),
    pieces=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=20),
)
def test_stitching_never_invents_and_ignores_chunking(
    words: list[str], cut: int, restate: int, pieces: list[int]
) -> None:
    """Whatever the text (repetitive on purpose) and the chunking: the stitched text is
    a suffix of the continuation (only a restated start is ever dropped, nothing is
    added) and the same as when the continuation arrives in one piece."""
    text = " ".join(words)
    cut = min(cut, len(text) - 1)
    continuation = text[max(0, cut - restate):]
    stitched = _fed(Stitcher(text[:cut]), continuation, pieces)
    whole = Stitcher(text[:cut])
    assert continuation.endswith(stitched)
    assert stitched == whole.feed(continuation) + whole.flush()


@settings(max_examples=300, deadline=None)
@given(
    cut=st.integers(min_value=1, max_value=59),
    restate=st.integers(min_value=0, max_value=8),
    pieces=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=20),
)
def test_a_restated_tail_of_whole_words_is_removed(cut: int, restate: int, pieces: list[int]) -> None:
    """Distinct words, a continuation that restates the last ``restate`` words: the
    result is exactly the answer when the restatement is long enough to be told from a
    coincidence (≥ 12 characters), and keeps the repetition when it is shorter."""
    shown = " ".join(WORDS[:cut])
    restated = " ".join(WORDS[cut - restate:cut]) if restate and restate < cut else ""
    rest = " " + " ".join(WORDS[cut:]) if cut < 60 else ""
    continuation = (" " + restated if restated else "") + rest
    stitched = _fed(Stitcher(shown), continuation, pieces)
    if len(" " + restated) >= 12 if restated else True:
        assert shown + stitched == ANSWER
    else:
        assert shown + stitched == shown + continuation


@pytest.mark.parametrize(("shown", "continuation", "rest"), [
    # Chinese, Japanese, Thai: no spaces between words; a restated clause of 12+
    # characters (a review found it shown twice: every character is alphanumeric, so
    # no edge counted as a word boundary)
    ("今天天气很好，我们一起去公园散步，然后我们去了附近的一家餐厅",
     "然后我们去了附近的一家餐厅吃午饭。下午我们回家休息。", "吃午饭。下午我们回家休息。"),
    ("昨日は雨でしたが、今日はとても良い天気なので公園に行きます",
     "今日はとても良い天気なので公園に行きます。そして本を読みます。", "。そして本を読みます。"),
    ("วันนี้อากาศดีมากเราจะไปเดินเล่นที่สวนสาธารณะ", "เราจะไปเดินเล่นที่สวนสาธารณะกัน", "กัน"),
])
def test_a_restated_tail_in_a_script_without_spaces_is_removed(
    shown: str, continuation: str, rest: str
) -> None:
    for pieces in ([1], [3, 5], [len(continuation)]):
        assert _fed(Stitcher(shown), continuation, pieces) == rest


def test_latin_words_still_need_whole_word_edges() -> None:
    """The other side: in a spaced script, " the" is still no overlap of " theory"."""
    shown = "we wrote something about the"
    continuation = "something about theory and practice"  # ends inside "theory": no overlap
    assert _fed(Stitcher(shown), continuation, [4]) == continuation


@pytest.mark.parametrize("pieces", [[1], [4], [6, 3], [200]])
def test_a_genuine_continuation_of_a_run_loses_nothing(pieces: list[int]) -> None:
    """Why an overlap must also end on a word's edge (a change that let it end inside
    a word, for streams cut mid-word, was reverted): an exact continuation of a run
    of one letter (base64 of zeros) matched 16 characters of the text shown and lost
    them, corrupting the data without a sign.  A garbled seam after a mid-word cut
    ("over the lajumps over the lazy dog") is the lesser harm, and visible."""
    shown = '{"png": "' + "A" * 16
    continuation = "A" * 24 + 'B=="}'
    assert _fed(Stitcher(shown), continuation, pieces) == continuation
    assert _fed(Stitcher("The quick brown fox jumps over the la"),
                "jumps over the lazy dog.", pieces) == "jumps over the lazy dog."


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=1, max_value=59), restate=st.integers(min_value=0, max_value=5),
       stall=st.booleans())
async def test_a_resumed_streams_response_is_what_the_caller_was_shown(
    autojump_clock: trio.testing.MockClock, cut: int, restate: int, stall: bool
) -> None:
    """Property: for any cut point and restated overlap, ``stream.response.text`` is
    exactly the concatenation of the chunks the caller received."""
    fault = {"stall_at": cut, "stall_s": 100} if stall else {"fault": "truncated", "fault_after": cut}
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, **fault))
    rest = " " + " ".join(WORDS[max(0, cut - restate):])
    b = FakeUpstream(_continuing(rest, inter_token_s=0.01))
    async with polygate.session(_resume_settings(stall_timeout_s=1),
                                transport=Router({"a": a, "b": b})) as s:
        stream, chunks = await _read(s)
    assert stream.response is not None
    assert "".join(c.text for c in chunks) == stream.text == stream.response.text
    assert stream.text.startswith(" ".join(WORDS[:cut]))
    json.dumps(stream.response.raw)  # still a JSON-able body


# --------------------------------------------------------------------------- settings


def test_an_env_fallback_names_its_scope_in_any_case() -> None:
    """Review: the environment's scope names are lowered (POLYGATE__LARGE__* is scope
    "large"), but FALLBACK=LARGE was taken as written: "'LARGE', which is not a scope"."""
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1", "POLYGATE__CHAT__FALLBACK": "LARGE",
           "POLYGATE__LARGE__B__BASE_URL": "http://b/v1"}
    assert polygate.Settings.from_env(env).scopes["chat"].fallback == "large"
    # ...and so does the other value that names a scope, an alias's
    settings = polygate.Settings.from_env({**env, "POLYGATE__SERVE__MODELS": "Big-Model=LARGE"})
    assert settings.serve.models == {"Big-Model": "large"}


def test_fallback_settings_are_checked_the_same_three_ways(tmp_path: Any) -> None:
    src = [polygate.Source(name="a", base_url="http://a/v1")]
    with pytest.raises(polygate.ConfigError, match="fallback chain loops: x -> y -> x"):
        polygate.Settings(scopes={"x": polygate.Scope(src, fallback="y"),
                                  "y": polygate.Scope(src, fallback="x")})
    with pytest.raises(polygate.ConfigError, match="falls back to 'nowhere'"):
        polygate.Settings(scopes={"x": polygate.Scope(src, fallback="nowhere")})
    with pytest.raises(polygate.ConfigError, match="unknown reason 'sometimes'"):
        polygate.Scope(src, fallback_on=("exhausted", "sometimes"))
    env = {"POLYGATE__X__A__BASE_URL": "http://a/v1", "POLYGATE__X__FALLBACK": "x"}
    with pytest.raises(polygate.ConfigError, match="loops: x -> x"):
        polygate.Settings.from_env(env)
    env = {"POLYGATE__X__A__BASE_URL": "http://a/v1", "POLYGATE__X__FALLBACK_ON": "exhausted,bogus"}
    with pytest.raises(polygate.ConfigError, match=r"POLYGATE__X__FALLBACK_ON.*bogus"):
        polygate.Settings.from_env(env)
    path = tmp_path / "p.toml"
    path.write_text('[scopes.x]\nfallback_on = ["status:99"]\n[scopes.x.sources.a]\n'
                    'base_url = "http://a/v1"\n')
    with pytest.raises(polygate.ConfigError, match=r"scopes\.x\.fallback_on"):
        polygate.Settings.from_toml(str(path))
    with pytest.raises(polygate.ConfigError, match="max_open_s"):
        polygate.Breaker(open_s=30, max_open_s=10)


@pytest.mark.parametrize(("reason", "instead"), [
    ("status:429", "rate_limited"), ("status:401", "exhausted"), ("status:404", "exhausted"),
    ("status:408", "exhausted"), ("status:409", "exhausted"), ("status:425", "exhausted"),
])
def test_a_status_that_is_never_fatal_is_no_fallback_reason(reason: str, instead: str) -> None:
    """Review: ``status:429`` (or 401/403/404, 408/409/425) passed the check, but those
    statuses are never a FatalUpstreamError, so the reason could never fire and the
    call ended without moving.  Refused, naming the reason that covers it."""
    src = [polygate.Source(name="a", base_url="http://a/v1")]
    with pytest.raises(polygate.ConfigError, match=f"'{reason}' never moves a call.*'{instead}'"):
        polygate.Scope(src, fallback_on=(reason,))
    env = {"POLYGATE__X__A__BASE_URL": "http://a/v1", "POLYGATE__X__FALLBACK_ON": reason}
    with pytest.raises(polygate.ConfigError, match="POLYGATE__X__FALLBACK_ON"):
        polygate.Settings.from_env(env)
    polygate.Scope(src, fallback_on=("status:413", "status:422"))  # fatal statuses: fine


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_a_resumed_streams_answer_keeps_every_segments_reasoning(
    autojump_clock: trio.testing.MockClock, field: str
) -> None:
    """Review: after a resume, stream.response.message had only the last segment's
    reasoning (none here): the reasoning the caller was shown from the first segment
    was gone from the answer.  It is every segment's, as shown, in the field the
    upstream used (Ollama's and OpenRouter's ``reasoning`` too)."""
    first = _sse_choices([{"delta": {"role": "assistant", field: "Let me think. "}},
                          {"delta": {"content": "w0 w1 w2 w3 w4"}}],
                         end=False)  # cut: no finish_reason, no [DONE]
    rest = _sse_choices([{"delta": {"role": "assistant", field: "Picking up."}},
                         {"delta": {"content": " w5"}}], end=True)
    async with polygate.session(_resume_settings(), transport=_two_upstreams({"a": first, "b": rest})) as s:
        stream, chunks = await _read(s)
    response = stream.response
    assert response is not None and response.call_stats.resumes == 1
    shown = "".join(c.delta.get(field) or "" for c in chunks)
    assert shown == "Let me think. Picking up."
    assert response.message["reasoning_content"] == shown
    assert response.message.get("reasoning") == (shown if field == "reasoning" else None)
    assert response.text == "w0 w1 w2 w3 w4 w5"


# the models that refused the context, after the move ------------------------------------


def _small_big_small(**big: Any) -> polygate.Settings:
    """chat (w: m-small) → big (x: m-big) → other (y: m-small again)."""
    return _scopes(
        chat={"sources": {"w": {"model": "m-small"}}, "fallback": "big",
              "stream": polygate.StreamWatch(resume=True)},
        big={"sources": {"x": {"model": "m-big"}}, "fallback": "other", **big},
        other={"sources": {"y": {"model": "m-small"}}},
    )


async def test_a_continuation_never_goes_to_a_model_that_refused_the_context(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: w (m-small) refused the context, the call moved to big; x committed and
    was cut, and being big's only source, the continuation went to big's fallback --
    whose only model, m-small, had refused this call's shorter prompt already."""
    w, y = FakeUpstream(CONTEXT), FakeUpstream(CONTEXT)
    x = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    async with polygate.session(_small_big_small(), transport=Router({"w": w, "x": x, "y": y})) as s:
        with pytest.raises(polygate.TransientUpstreamError):
            await _read(s)
    assert len(w.requests) == 1 and y.requests == []


async def test_a_scope_exhausted_after_a_context_refusal_never_falls_back_to_that_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same chain with big exhausted (503s): its fallback serves only m-small,
    which refused this call's context; the call ends with big's error instead."""
    w, y = FakeUpstream(CONTEXT), FakeUpstream(CONTEXT)
    x = FakeUpstream(Reply(status=503))
    settings = _small_big_small(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"w": w, "x": x, "y": y})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
    assert len(w.requests) == 1 and len(x.requests) == 1 and y.requests == []


@pytest.mark.parametrize("refusal", ["context", "policy"])
async def test_a_prefilled_continuation_refused_for_its_conversation_is_not_asked_again(
    autojump_clock: trio.testing.MockClock, refusal: str,
) -> None:
    """Review: any 400 to a prefilled continuation was taken for a refused prefill, and
    the same source was asked again without it: a context-length refusal with a longer
    request still, a content-policy refusal turned into a transient error."""
    refused = CONTEXT if refusal == "context" else _err(
        400, "content_filter", "The response was filtered due to the content management policy.")
    a = FakeUpstream(Reply(text=ANSWER, fault="truncated", fault_after=40))
    b = FakeUpstream(refused)
    settings = _scopes(chat={"sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "prefill": True}},
                             "stream": polygate.StreamWatch(resume=True)})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        with pytest.raises(polygate.PolygateError):
            await _read(s)
    assert len(b.requests) == 1
    assert b.requests[0].body["messages"][-1]["role"] == "assistant"  # the prefill


async def test_same_source_retries_retry_the_preferred_source_after_a_hedged_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: the retried source was the round's first to fail; with a hedge that
    failed before the primary, the next round was pinned to the hedge's source, not
    the preferred one."""
    a = FakeUpstream([Reply(status=503, headers_delay_s=5)], then=Reply(text="preferred"))
    b = FakeUpstream([Reply(status=503, headers_delay_s=0.5)], then=Reply(text="backup"))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "hedge": polygate.Hedge(after_s=1),
        "retry": polygate.Retry(same_source_retries=1),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert (r.source, r.text, len(a.requests), len(b.requests)) == ("a", "preferred", 2, 1)


async def test_reasoning_a_cut_segment_showed_counts_in_usage_and_the_token_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (transcripts, 2026-12-03): a segment cut inside its reasoning had
    shown the caller its thoughts, yet counted 0 completion tokens in the summed usage,
    and the continuation was asked for the caller's whole ``max_tokens`` again.  A
    model's limit and its bill count reasoning tokens: what was shown, reasoning
    included, is estimated at four characters a token in both."""
    a = FakeUpstream(Reply(text=ANSWER, reasoning_tokens=30, fault="truncated", fault_after=20))
    b = FakeUpstream(_continuing(ANSWER))
    async with polygate.session(_resume_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES, max_tokens=500) as stream:
            chunks = [c async for c in stream]
    response = stream.response
    assert response is not None and response.call_stats.resumes == 1
    first = next(i for i, c in enumerate(chunks) if c.resumed)
    thoughts = sum(len(c.delta.get("reasoning_content") or "") for c in chunks[:first])
    assert thoughts > 40 and not any(c.text for c in chunks[:first])  # cut while reasoning
    spent = (thoughts + 3) // 4
    assert b.requests[0].body["max_tokens"] == 500 - spent
    from polygate.testing._render import _prompt_tokens

    usage = response.usage
    assert usage is not None and usage.source == "estimated"
    continuation = len(ANSWER.split())  # the fake counts a word a token
    assert usage.completion_tokens == continuation + spent, (usage, spent)
    assert usage.prompt_tokens > _prompt_tokens(b.requests[0].body)


def _event(delta: dict[str, Any], usage: dict[str, int] | None = None,
           finish: str | None = None) -> bytes:
    """One SSE event of a chunk of choice 0, with ``usage`` when given."""
    body: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _resumed(cut: bytes, rest: bytes) -> polygate.ChatResponse:
    """A stream that source a cuts after ``cut`` and source b finishes with ``rest``."""
    import httpx

    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"},
        content=cut if request.url.host == "a" else rest))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9)],
        stream=polygate.StreamWatch(resume=True))})
    async with polygate.session(settings, transport=transport) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    response = stream.response
    assert response is not None and response.call_stats.resumes == 1
    return response


async def test_a_cut_segment_that_reported_usage_counts_what_it_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Outside review (transcripts, 2026-12-03): vLLM's continuous usage reports the
    usage on every chunk; a segment cut after reporting some was estimated all the
    same (its prompt from the caller's message, not the 46 tokens it reported), where
    docs/failover.md says each segment counts "its reported usage, or, for a segment
    cut before it reported any, an estimate"."""
    words = ["alpha ", "beta ", "gamma ", "delta "]
    cut = b"".join(_event({"content": w}, {"prompt_tokens": 46, "completion_tokens": i + 1,
                                          "total_tokens": 47 + i}) for i, w in enumerate(words[:2]))
    rest = b"".join(_event({"content": w}, {"prompt_tokens": 60, "completion_tokens": i + 1,
                                           "total_tokens": 61 + i}) for i, w in enumerate(words[2:]))
    rest += _event({}, {"prompt_tokens": 60, "completion_tokens": 2, "total_tokens": 62}, "stop")
    rest += b"data: [DONE]\n\n"
    response = await _resumed(cut, rest)
    # Its prompt as reported; its completion the larger of what it reported and what it
    # showed ("alpha beta ": 3 tokens at four characters a token); estimated, as any
    # cut segment's cost (diff review: a stale first-chunk usage of 0 tokens, or one
    # without a prompt, was taken whole and called "upstream").
    assert response.usage == polygate.Usage(46 + 60, 3 + 2, 111, "estimated")


@pytest.mark.parametrize(("reported", "prompt_from_estimate"), [
    ({"prompt_tokens": 40, "completion_tokens": 0, "total_tokens": 40}, False),  # stale
    ({"completion_tokens": 1}, True),  # in part: no prompt
    ({"total_tokens": 900}, False),  # only a total: a floor (third diff review)
])
async def test_a_cut_segments_partial_usage_is_a_lower_bound(
    autojump_clock: trio.testing.MockClock, reported: dict[str, int], prompt_from_estimate: bool,
) -> None:
    """Diff review (2026-12-03): a cut segment whose only usage came with its first
    chunk (no text yet), or reported no prompt, counted its 400 characters shown as 0
    tokens, or its prompt as 0, and the sum still said "upstream" (which lets a gateway
    key's tpm settle below what was streamed)."""
    cut = _event({"role": "assistant"}, reported) + b"".join(
        _event({"content": "word " * 20}) for _ in range(4))  # 400 characters
    rest = _event({"content": " end"}) + _event(
        {}, {"prompt_tokens": 300, "completion_tokens": 2, "total_tokens": 302}, "stop")
    rest += b"data: [DONE]\n\n"
    response = await _resumed(cut, rest)
    usage = response.usage
    assert usage is not None and usage.source == "estimated"
    assert usage.completion_tokens == 100 + 2  # 400 characters shown, then the rest's 2
    if prompt_from_estimate:
        assert usage.prompt_tokens > 300
    elif "prompt_tokens" in reported:
        assert usage.prompt_tokens == 40 + 300
    else:  # the cut segment's 900 in all: its 100 shown, the rest its prompt
        assert usage.prompt_tokens == 800 + 300


@pytest.mark.parametrize("final", [{"completion_tokens": 2}, {"total_tokens": 500}])
async def test_a_continuations_partial_usage_never_counts_a_part_as_nothing(
    autojump_clock: trio.testing.MockClock, final: dict[str, int],
) -> None:
    """Second diff review (2026-12-03): a continuation that reported its usage in part
    (no prompt; or only a total) counted the missing parts as 0 in the resumed call's
    sum.  A missing part is estimated, and a reported total is a floor."""
    cut = b"".join(_event({"content": "word "}) for _ in range(40))  # 200 characters
    rest = _event({"content": " end"}) + _event({}, final, "stop") + b"data: [DONE]\n\n"
    response = await _resumed(cut, rest)
    usage = response.usage
    assert usage is not None and usage.source == "estimated"
    # the continuation's prompt carries the 200 characters shown: ~50 tokens and more
    cut_share = 50
    if "total_tokens" in final:
        assert usage.total_tokens >= cut_share + 500, usage
    else:
        assert usage.prompt_tokens > 2 * cut_share, usage  # the cut's and the continuation's
        assert usage.completion_tokens == cut_share + 2


class _Sink:
    """The caller's end of a stream, recording what a ResumedForward passes on."""

    shown_tool_calls = False
    reasoning_field = "reasoning_content"

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.shown_reasoning: list[str] = []

    def offer(self, chunk: dict[str, Any]) -> bool:
        self.chunks.append(chunk)
        return True

    async def deliver_held(self) -> None:
        pass

    def mark_resumed(self) -> None:
        pass


def _lp_chunk(text: str, tokens: list[str] | None = None) -> dict[str, Any]:
    tokens = [text] if tokens is None else tokens
    entries = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
               for t in tokens]
    return {"choices": [{"index": 0, "delta": {"content": text},
                         "logprobs": {"content": entries, "refusal": None}, "finish_reason": None}]}


@pytest.mark.parametrize(
    ("shown", "pieces", "expected"),
    [
        # " w9" restated: under 12 characters, kept; both held chunks' tokens go with it
        (" w8 w9", [(" w9", None), (" x1", None), (" x2", None)], " w9 x1 x2"),
        # a restatement of 16 characters over two chunks, the second straddling its end
        (" one two three four", [(" two three", [" two", " three"]),
                                 (" four five", [" four", " five"]), (" six", None)], " five six"),
        # a chunk straddling the restatement's end whose tokens do not spell its text
        # keeps all its entries (where they split cannot be told)
        (" one two three four", [(" two three four five", ["bogus"])], " five"),
    ],
)
def test_held_chunks_keep_their_logprobs(
    shown: str, pieces: list[tuple[str, list[str] | None]], expected: str
) -> None:
    """A review found the stitched chunk carrying the logprobs of the last held chunk
    only: " w9 x1" shown with the tokens of " x1".  Every token shown keeps its entry,
    and a dropped restatement's tokens go with it."""
    sink = _Sink()
    forward = ResumedForward(sink, Stitcher(shown))  # type: ignore[arg-type]
    for text, tokens in pieces:
        assert forward.offer(_lp_chunk(text, tokens))
    trio.run(forward.finish)
    text = "".join(c["choices"][0]["delta"]["content"] for c in sink.chunks)
    assert text == expected
    tokens = [e["token"] for c in sink.chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert tokens == ["bogus"] if "bogus" in str(pieces) else "".join(tokens) == expected


@pytest.mark.parametrize("prefill", [False, True])
async def test_a_stream_cut_in_its_reasoning_is_asked_again_as_it_was(
    autojump_clock: trio.testing.MockClock, prefill: bool
) -> None:
    """Review: a stream cut after showing reasoning only was continued with an empty
    assistant message (and the continue prompt, or vLLM's prefill parameters), which
    some providers refuse with a 400 -- fatal once the stream is committed.  With
    nothing shown the conversation is sent as it was."""
    bodies: dict[str, Any] = {}
    upstreams = _two_upstreams({
        "a": _sse_choices([{"delta": {"role": "assistant", "reasoning_content": "Let me think. "}}],
                          end=False),
        "b": _sse_choices([{"delta": {"role": "assistant", "content": "w0 w1"}}], end=True),
    }, bodies)
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "prefill": prefill}},
        "stream": polygate.StreamWatch(resume=True),
    })
    schema = {"type": "string"}
    async with polygate.session(settings, transport=upstreams) as s:
        # (A bare JSON string is a valid answer for the schema: "w0 w1" is not, so
        # the structured stream ends in an error, after the requests were seen.)
        with pytest.raises(polygate.StructuredOutputError):
            async with s.stream_chat(MESSAGES, schema=schema, max_completion_tokens=100) as stream:
                async for _ in stream:
                    pass
    # Asked again as it was: its messages, its format; within what is left of its
    # token limit ("Let me think. ": 14 characters shown, about 4 tokens).
    for key in ("messages", "response_format"):
        assert bodies["b"][key] == bodies["a"][key], key
    assert bodies["b"]["max_completion_tokens"] == 100 - 4
    assert bodies["b"]["messages"] == MESSAGES
    assert "continue_final_message" not in bodies["b"]
    async with polygate.session(settings, transport=upstreams) as s:
        stream, _ = await _read(s)
    assert stream.response is not None and stream.response.text == "w0 w1"
    assert stream.response.call_stats.resumes == 1


async def test_a_400_to_a_stream_cut_in_its_reasoning_is_no_prefill_refusal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the re-ask of a stream cut in its reasoning carries no prefill, yet a
    prefill source's 400 to it was taken for a refusal of the prefill and the same
    request sent again."""
    import httpx

    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.host)
        if request.url.host == "a":
            body = (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", '
                    b'"reasoning_content": "Let me think. "}}]}\n\n')
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)
        return httpx.Response(400, json={"error": {"message": "unsupported value: logit_bias"}})

    transport = httpx.MockTransport(answer)
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "prefill": True}},
        "stream": polygate.StreamWatch(resume=True),
    })
    async with polygate.session(settings, transport=Router({"a": transport, "b": transport})) as s:
        # The stream's own failure, caused by the continuation's 400: sent once.
        with pytest.raises(polygate.TransientUpstreamError, match="truncated") as info:
            await _read(s)
    assert isinstance(info.value.__cause__, polygate.FatalUpstreamError)
    assert "unsupported value" in str(info.value.__cause__)
    assert sent == ["a", "b"]


@pytest.mark.parametrize("cache", [False, True])
async def test_a_resumed_streams_answer_carries_the_logprobs_shown(
    autojump_clock: trio.testing.MockClock, cache: bool
) -> None:
    """Review: stream.response's first choice kept the last segment's logprobs (they
    began with the restatement the caller was not shown and missed the first
    segment's tokens), and a cache hit of the answer replayed those.  They are the
    entries the caller was shown."""

    def sse(tokens: list[str], *, end: bool) -> bytes:
        return _sse_choices([{"delta": {"content": t}, "logprobs": {"content": [
            {"token": t, "logprob": -0.25, "bytes": list(t.encode()), "top_logprobs": []}],
            "refusal": None}} for t in tokens], end=end)

    upstreams = _two_upstreams({
        "a": sse(["one", " two", " three", " four", " five"], end=False),  # cut
        "b": sse([" three", " four", " five", " six", " seven"], end=True),  # restates 16 chars
    })

    def tokens_of(chunks: list[polygate.StreamChunk]) -> list[str]:
        return [e["token"] for c in chunks for ch in c.raw.get("choices") or []
                if isinstance(ch.get("logprobs"), dict) for e in ch["logprobs"]["content"]]

    settings = attrs.evolve(_resume_settings(), cache="memory" if cache else "off")
    if cache:
        settings = attrs.evolve(settings, scopes={
            "chat": attrs.evolve(settings.scopes["chat"], cache_ttl_s=60)})
    async with polygate.session(settings, transport=upstreams) as s:
        async with s.stream_chat(MESSAGES, logprobs=True) as stream:
            chunks = [c async for c in stream]
        if cache:  # the replay of the stored answer
            async with s.stream_chat(MESSAGES, logprobs=True) as stream:
                chunks = [c async for c in stream]
            assert stream.response is not None and stream.response.call_stats.cached
    response = stream.response
    assert response is not None and response.text == "one two three four five six seven"
    assert "".join(tokens_of(chunks)) == response.text
    shown = [e["token"] for e in response.choices[0]["logprobs"]["content"]]
    assert shown == ["one", " two", " three", " four", " five", " six", " seven"]


async def test_a_resumed_answer_without_logprob_entries_keeps_them_null(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A provider that sends ``"logprobs": {"content": null}`` on every chunk: with no
    entries shown, the resumed answer's stay null, not an empty list."""
    null = {"content": None, "refusal": None}
    upstreams = _two_upstreams({
        "a": _sse_choices([{"delta": {"content": t}, "logprobs": null} for t in ("one", " two")],
                          end=False),
        "b": _sse_choices([{"delta": {"content": " three"}, "logprobs": null}], end=True),
    })
    async with polygate.session(_resume_settings(), transport=upstreams) as s:
        stream, _ = await _read(s)
    response = stream.response
    assert response is not None and response.call_stats.resumes == 1
    assert response.text == "one two three"
    assert response.choices[0]["logprobs"]["content"] is None


async def test_a_continuation_from_a_source_that_cannot_stream_keeps_its_logprobs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: a continuation answered as one JSON body is shown as one chunk, which
    was made without the answer's logprobs: the resumed answer's spelled only the
    first segment."""
    import httpx

    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -0.25, "bytes": list(token.encode()), "top_logprobs": []}

    first = _sse_choices([{"delta": {"content": t}, "logprobs": {"content": [entry(t)]}}
                          for t in ("one", " two", " three")], end=False)  # cut
    rest = {"id": "x", "object": "chat.completion", "model": "m", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": " four five"},
        "logprobs": {"content": [entry(" four"), entry(" five")]}}]}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=first)
        return httpx.Response(200, json=rest)

    transport = httpx.MockTransport(answer)
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "streaming": False}},
        "stream": polygate.StreamWatch(resume=True),
    })
    async with polygate.session(settings, transport=Router({"a": transport, "b": transport})) as s:
        async with s.stream_chat(MESSAGES, logprobs=True) as stream:
            chunks = [c async for c in stream]
    response = stream.response
    assert response is not None and response.text == "one two three four five"
    tokens = [e["token"] for e in response.choices[0]["logprobs"]["content"]]
    assert tokens == ["one", " two", " three", " four", " five"]
    assert chunks[-1].raw["choices"][0]["logprobs"]["content"][-1]["token"] == " five"


async def test_a_hedge_that_won_and_was_cut_is_finished_by_a_continuation_that_is_no_hedge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The hedge (b) wins the first segment's race and is cut mid-way; another source
    finishes the answer: ``source`` is the one that finished it, and ``hedge_won`` is
    False (the winner, a continuation, is no hedge) (docs/failover.md)."""
    shown = " ".join(WORDS[:40])
    rest = " " + " ".join(WORDS[37:])

    def slow_first(request: Any, rng: Any) -> Reply:
        if request.body["messages"][-1]["content"] == CONTINUE_PROMPT:
            return Reply(text=rest, inter_token_s=0.01)
        return Reply(text=ANSWER, first_token_s=30, inter_token_s=0.01)

    a = FakeUpstream(slow_first)
    b = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}},
        "stream": polygate.StreamWatch(resume=True),
        "hedge": polygate.Hedge(after_s=0.5),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        stream, chunks = await _read(s)
    assert stream.response is not None and stream.text == ANSWER
    assert "".join(c.text for c in chunks if not c.resumed).startswith(shown)
    cs = stream.response.call_stats
    assert (cs.hedges, cs.resumes, cs.source, cs.hedge_won) == (1, 1, "a", False)


async def test_a_continuation_whose_own_round_its_hedge_won_says_hedge_won(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The other side (review: the docs said a resumed answer's ``hedge_won`` is
    always False): the continuation is a new round, which hedges as any round does;
    when its hedge (c) wins, ``hedge_won`` says so, as for any call's winner."""
    rest = " " + " ".join(WORDS[40:])
    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    b = FakeUpstream(Reply(text=rest, first_token_s=30, inter_token_s=0.01))
    c = FakeUpstream(Reply(text=rest, inter_token_s=0.01))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9}, "c": {"weight": 1e-18}},
        "stream": polygate.StreamWatch(resume=True),
        "hedge": polygate.Hedge(after_s=0.5),
    })
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c})) as s:
        stream, _ = await _read(s)
    assert stream.response is not None and stream.text == ANSWER
    cs = stream.response.call_stats
    assert (cs.hedges, cs.resumes, cs.source, cs.hedge_won) == (1, 1, "c", True)


@pytest.mark.parametrize("extra", [
    {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
    {"reasoning_content": "the rest, reasoned"},
    # (review: content parts, Mistral's typed chunks, reached the stitcher as a list:
    # no text for the library's caller, the restatement doubled at the gateway's)
    {"content": [{"type": "text", "text": " " + " ".join(WORDS[37:])}]},
])
async def test_a_continuation_from_a_source_that_cannot_stream_shows_all_it_answered(
    autojump_clock: trio.testing.MockClock, extra: dict[str, Any],
) -> None:
    """Review: a continuation answered in one JSON body (a source that cannot stream)
    was shown as its content alone: its tool calls were in ``stream.response`` but no
    chunk showed them (a client of the gateway got ``finish_reason: "tool_calls"``
    and no calls), and its reasoning was shown nowhere.  It is shown as a JSON answer
    not resumed is: its whole message in one chunk."""
    import httpx

    rest = " " + " ".join(WORDS[40:])

    def answer(request: httpx.Request) -> httpx.Response:
        finish = "tool_calls" if "tool_calls" in extra else "stop"
        return httpx.Response(200, json={
            "id": "two", "object": "chat.completion", "created": 9, "model": "m",
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": rest, **extra}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70}})

    a = FakeUpstream(Reply(text=ANSWER, inter_token_s=0.01, fault="truncated", fault_after=40))
    settings = _scopes(chat={
        "sources": {"a": {"weight": 1.0}, "b": {"weight": 1e-9, "streaming": False}},
        "stream": polygate.StreamWatch(resume=True),
    })
    router = Router({"a": a, "b": httpx.MockTransport(answer)})
    async with polygate.session(settings, transport=router) as s:
        stream, chunks = await _read(s)
    assert stream.response is not None and stream.text == ANSWER
    [(key, value)] = extra.items()
    shown = [c.delta[key] for c in chunks if key in c.delta]
    if key == "content":
        assert "".join(c.text for c in chunks) == ANSWER
        assert stream.response.text == ANSWER
    elif key == "tool_calls":
        assert shown == [[{**value[0], "index": 0}]]
        assert stream.response.message["tool_calls"] == value
    else:
        assert shown == [value] and stream.response.message[key] == value


async def test_a_failed_calls_statistics_name_the_scope_it_ended_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What statistics.md says of ``CallStats.scope`` on an error (a docs sweep found
    it unsaid): the scope the call ended in, the fallback it moved to; the telemetry
    row's ``answered_scope`` stays NULL, since no scope answered."""
    settings = polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                               fallback="backup", retry=polygate.Retry(max_attempts=1)),
        "backup": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1")],
                                 retry=polygate.Retry(max_attempts=1)),
    })
    failing = Router({"a": FakeUpstream(Reply(status=500)), "b": FakeUpstream(Reply(status=500))})
    async with polygate.session(settings, transport=failing) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.chat(MESSAGES)
    assert (caught.value.call_stats.scope, caught.value.call_stats.attempts) == ("backup", 2)


def _dead_then(fallback: bool, *, dead_cooldown_s: float = 300.0) -> polygate.Settings:
    scopes = {"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        retry=polygate.Retry(max_attempts=3, backoff_base_s=2.0, backoff_max_s=8.0),
        fallback="backup" if fallback else None,
    )}
    if fallback:
        scopes["backup"] = polygate.Scope(
            sources=[polygate.Source(name="b", base_url="http://b/v1", api_key=SECRET)])
    return polygate.Settings(scopes=scopes, dead_cooldown_s=dead_cooldown_s)


@pytest.mark.parametrize("fallback", [True, False])
async def test_a_scope_whose_sources_are_all_dead_moves_on_without_a_backoff(
    autojump_clock: trio.testing.MockClock, fallback: bool,
) -> None:
    """Review finding (three front doors, one behaviour): when the only source of a
    scope answered 401, the call slept a retry backoff (up to backoff_base_s * 2 with
    full jitter: 1.7 s in one run) before the next round found no source to admit and
    the call moved to its fallback (or failed). A dead mark outlasts any backoff, so
    the wait served nothing: through `polygate serve`, a misconfigured key cost every
    request that pause."""
    a, b = FakeUpstream(Reply(status=401)), FakeUpstream(Reply(text="from backup"))
    async with polygate.session(_dead_then(fallback), transport=Router({"a": a, "b": b})) as s:
        start = trio.current_time()
        if fallback:
            r = await s.chat(MESSAGES)
            assert (r.text, r.call_stats.scope, r.call_stats.attempts) == ("from backup", "backup", 2)
        else:
            with pytest.raises(polygate.AllSourcesExhausted, match="HTTP 401"):
                await s.chat(MESSAGES)
        assert trio.current_time() - start == 0
    assert len(a.requests) == 1


async def test_a_dead_mark_shorter_than_the_backoff_still_backs_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The other side of the test above: where a dead mark may end before the backoff
    would (``dead_cooldown_s`` below ``backoff_max_s``), the backoff is what keeps the
    call from asking the refusing source again at once, so it still waits."""
    a = FakeUpstream([Reply(status=401)], then=Reply(text="key fixed"))
    settings = _dead_then(False, dead_cooldown_s=0.001)
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        elapsed = trio.current_time() - start
    assert r.text == "key fixed" and r.call_stats.attempts == 2
    assert 0 < elapsed <= 4.0  # full jitter in [0, backoff_base_s * 2]


def _breaker_then(fallback: bool, *, open_s: float = 30.0) -> polygate.Settings:
    scopes = {"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        retry=polygate.Retry(max_attempts=3, backoff_base_s=2.0, backoff_max_s=8.0),
        breaker=polygate.Breaker(failures=1, open_s=open_s),
        fallback="backup" if fallback else None,
    )}
    if fallback:
        scopes["backup"] = polygate.Scope(
            sources=[polygate.Source(name="b", base_url="http://b/v1", api_key=SECRET)])
    return polygate.Settings(scopes=scopes)


async def test_the_failure_that_opens_the_breaker_moves_on_without_a_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The dead case's sibling: the 500 that opened the only source's breaker (for
    30 s) was followed by a retry backoff (1.1 s in one run, up to backoff_base_s * 2)
    before the next round found the breaker open and moved to the fallback, as every
    later call does at once. The open period outlasts any backoff, so the wait served
    nothing."""
    a, b = FakeUpstream(Reply(status=500)), FakeUpstream(Reply(text="from backup"))
    async with polygate.session(_breaker_then(True), transport=Router({"a": a, "b": b})) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        assert (r.text, r.call_stats.scope, r.call_stats.attempts) == ("from backup", "backup", 2)
        assert trio.current_time() - start == 0
    assert len(a.requests) == 1


async def test_without_a_fallback_an_open_breaker_is_waited_out_as_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Without a fallback, skipping the backoff changes nothing: admission waits for
    the open period either way (two periods of 30 s: the probe after the first
    fails and opens it again), and the call fails after its three attempts."""
    a = FakeUpstream(Reply(status=500))
    async with polygate.session(_breaker_then(False), transport=Router({"a": a})) as s:
        start = trio.current_time()
        with pytest.raises(polygate.AllSourcesExhausted, match="HTTP 500"):
            await s.chat(MESSAGES)
        assert trio.current_time() - start == pytest.approx(60)
    assert len(a.requests) == 3


async def test_a_breaker_open_for_less_than_the_backoff_still_backs_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Where the open period may end before the backoff would, the backoff is what
    keeps the failing source from being probed again at once, so it still waits."""
    a = FakeUpstream([Reply(status=500)], then=Reply(text="back"))
    settings = _breaker_then(False, open_s=0.001)
    async with polygate.session(settings, transport=Router({"a": a}), rng=_Halfway()) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        elapsed = trio.current_time() - start
    assert r.text == "back" and r.call_stats.attempts == 2
    assert elapsed == pytest.approx(1.0)  # half of backoff_base_s: the backoff, whole


class _Halfway(random.Random):
    """Every draw halfway: full jitter's backoff is half its ceiling."""

    def random(self) -> float:
        return 0.5


async def test_a_cooldown_past_the_backoff_skips_it_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review note (rate-limit signals): a 503 that asked for 120 s (Retry-After)
    cools its source past the call's rate_limit_wait_s, and the next round gives up
    at once, saying when to come back; the backoff before that round (1 s here)
    served nothing."""
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        retry=polygate.Retry(max_attempts=3, backoff_base_s=2.0, backoff_max_s=8.0),
    )})
    a = FakeUpstream(Reply(status=503, headers={"retry-after": "120"}))
    async with polygate.session(settings, transport=Router({"a": a}), rng=_Halfway()) as s:
        start = trio.current_time()
        with pytest.raises(polygate.AllSourcesExhausted) as failed:
            await s.chat(MESSAGES)
        assert trio.current_time() - start == 0
    assert failed.value.retry_after_s == pytest.approx(120)
    assert len(a.requests) == 1


async def test_a_same_source_retry_into_an_open_breaker_fails_over_without_a_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix above: with same_source_retries, the retry on the same source
    slept its backoff (1 s here) before finding the breaker the failure had opened,
    and only then failed over (failover.md: "If the source's breaker opens ... the call
    fails over at once")."""
    scopes = {
        "chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
            retry=polygate.Retry(max_attempts=3, backoff_base_s=2.0, backoff_max_s=8.0, same_source_retries=1),
            breaker=polygate.Breaker(failures=1, open_s=30.0), fallback="backup"),
        "backup": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1", api_key=SECRET)]),
    }
    a, b = FakeUpstream(Reply(status=500)), FakeUpstream(Reply(text="from backup"))
    async with polygate.session(polygate.Settings(scopes=scopes), transport=Router({"a": a, "b": b}),
                                rng=_Halfway()) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        assert (r.text, trio.current_time() - start) == ("from backup", 0)
    assert len(a.requests) == 1


async def test_the_look_that_may_skip_a_backoff_never_outlasts_it(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review of the fix above: the look at the failed sources' state (a snapshot, a
    round trip on Redis) ran before the backoff, unbounded: a Redis that hung added its
    read timeout to the backoff. It is bounded by the backoff it may skip, and the
    backoff counts it."""
    from polygate.governance import MemoryBackend

    async def hangs(self: Any, scope: str, source: str) -> Any:
        await trio.sleep_forever()

    monkeypatch.setattr(MemoryBackend, "snapshot", hangs)
    a = FakeUpstream([Reply(status=500)], then=Reply(text="back"))
    async with polygate.session(_breaker_then(False, open_s=0.001), transport=Router({"a": a}),
                                rng=_Halfway()) as s:
        start = trio.current_time()
        r = await s.chat(MESSAGES)
        elapsed = trio.current_time() - start
    assert r.text == "back" and elapsed == pytest.approx(1.0)  # the backoff alone
