"""A committed stream's consumer sets its own pace; the upstream is not charged for it
(review R9, R13): no timeout, no stall, no breaker failure, no false statistics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.governance import BreakerState
from polygate.testing import FakeUpstream, Reply, Schedule

from .conftest import MESSAGES, one_source_settings, reader_leads


async def test_a_slow_consumer_is_not_an_upstream_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R9: the upstream sends 60 tokens 10 ms apart after 0.5 s; the caller spends 3 s
    on each chunk.  The statistics describe the upstream: no stall, and the generation
    time is at most the upstream's 1.09 s, not the caller's three minutes.  (While the
    caller holds the read loop nothing is read, so chunks that arrived meanwhile count
    from the moment the hold began: the figures are then lower bounds.)"""
    up = FakeUpstream(Reply(first_token_s=0.5, inter_token_s=0.01, tokens=60))
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                await trio.sleep(3)
    assert stream.response is not None
    cs = stream.response.call_stats
    assert (cs.stall_count, cs.stall_ms) == (0, 0)
    assert cs.ttft_ms == pytest.approx(500)
    assert cs.active_generation_ms is not None and 0 < cs.active_generation_ms <= 590 + 1e-6
    assert cs.ttft_ms + cs.active_generation_ms <= cs.generation_ms <= 1090 + 1e-6
    assert cs.total_latency_ms > 60_000  # the caller's own pace is in the total


async def test_a_real_stall_is_still_seen_behind_a_slow_consumer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Subtracting the consumer's time must not hide the upstream's own silence: a
    5 s pause after token 40 counts as one stall, whatever the caller does."""
    up = FakeUpstream(Reply(first_token_s=0.5, inter_token_s=0.01, tokens=60,
                            stall_at=40, stall_s=5))
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                if chunk.text:
                    await trio.sleep(0.001)
    assert stream.response is not None
    cs = stream.response.call_stats
    assert cs.stall_count == 1
    assert cs.stall_ms == pytest.approx(5010, abs=2)


async def test_a_slow_reader_never_fails_the_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R13: the upstream finishes in 0.8 s; the caller takes a minute to read it.
    ``timeout_s=20`` is the upstream's budget, not the caller's: no error, and five such
    streams leave the breaker closed with no failure counted."""
    up = FakeUpstream(Reply(first_token_s=0.2, inter_token_s=0.01, tokens=60))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", timeout_s=20)],
        stream=polygate.StreamWatch(stall_timeout_s=2))})
    async with polygate.session(settings, transport=up.transport()) as s:
        for _ in range(5):
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    await trio.sleep(1)
            assert stream.response is not None and stream.response.text == stream.text
            assert len(stream.text.split()) == 60
        state = (await s.statistics()).governance.sources[0].state
    assert state.breaker is BreakerState.CLOSED and state.consecutive_failures == 0
    # every request was read to its [DONE] (nothing cut by a clock): five whole answers
    assert len(up.requests) == 5 and all(r.outcome != "fault" for r in up.requests)


@pytest.mark.parametrize("reader", ["stops", "keeps up", "a little slow"])
async def test_a_cut_after_the_caller_held_the_stream_is_not_the_sources_failure(
    reader: str, autojump_clock: trio.testing.MockClock,
) -> None:
    """While the caller holds the stream nothing is read, and a server stops waiting on
    a reader that stops reading (nginx's send_timeout cuts it once what it wrote no
    longer fits the buffers): such a cut fed the breaker of a healthy source (five slow
    readers opened it).  After a hold of 5 s or more at one stretch it is neutral, and
    says why.  A cut of a stream read at the upstream's pace still counts, and so does
    one read a little slower than the upstream (held a moment at each chunk: 2.5 s in
    all over 400 tokens, and the source that crashes under it must feed its breaker)."""
    up = FakeUpstream(Reply(first_token_s=0.1, inter_token_s=0.01, tokens=450, fault="reset", fault_after=400))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        retry=polygate.Retry(max_attempts=1))})
    pause_s = 10.0 if reader == "stops" else 0.0
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(polygate.TransientUpstreamError) as caught:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    if pause_s:
                        await trio.sleep(pause_s)
                        pause_s = 0.0
                    elif reader == "a little slow":
                        await trio.sleep(0.012)
        state = (await s.statistics()).governance.sources[0].state
    if reader == "stops":
        # (10 s, less the 0.3 s the 32-chunk channel took to fill)
        assert "(after the caller held the stream 9.7 s at one stretch:" in str(caught.value)
        assert state.consecutive_failures == 0
    else:
        assert "held" not in str(caught.value) and state.consecutive_failures == 1


async def test_the_watchdogs_still_fire_after_the_consumer_caught_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The clocks stop only while the caller holds the read loop: an upstream that goes
    silent afterwards trips ``stall_timeout_s`` as before, 2 s after its last token."""
    up = FakeUpstream(Reply(first_token_s=0.2, inter_token_s=0.01, tokens=60,
                            stall_at=50, stall_s=100))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", timeout_s=20)],
        stream=polygate.StreamWatch(stall_timeout_s=2))})
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(polygate.StreamStalled) as info:
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    await trio.sleep(0.5)
    assert stream.text == info.value.text and len(info.value.text) > 0


async def test_the_first_token_of_a_whole_answer_read_at_once_is_not_held_back() -> None:
    """An answer that arrives in one read (generated before the request's head went
    out, or a burst) is parsed a chunk at a time; the caller gets the first token
    before the other 49 are parsed, not after (benchmarks/streams.py, sequential:
    the first chunk took as long as the whole read).  ``stream.text`` is what the
    producer has handed on so far: at the first chunk, only that chunk."""
    body = b"".join(
        b'data: {"choices":[{"index":0,"delta":{"content":"t%d "}}]}\n\n' % i for i in range(50)
    ) + b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    for _ in range(20):  # trio orders each batch at random: both orders, many times
        async with polygate.session(
            one_source_settings(), transport=httpx.MockTransport(handler)
        ) as s:
            async with s.stream_chat(MESSAGES) as stream:
                seen: list[str] = []
                async for chunk in stream:
                    if not seen:
                        assert stream.text == "t0 "
                    seen.append(chunk.text)
        assert "".join(seen) == "".join(f"t{i} " for i in range(50))


async def test_only_a_stream_hands_its_first_token_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-on (two scheduler passes before the rest of a read is parsed) is for
    whoever waits for the first token: a stream's caller.  A chat() that no hedge
    watches waits for the whole answer only, and skips it (~30 µs of CPU a call
    through the gateway)."""
    from polygate.transport import _exchange

    body = b"".join(
        b'data: {"choices":[{"index":0,"delta":{"content":"t%d "}}]}\n\n' % i for i in range(5)
    ) + b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    handed: list[int] = []
    original = _exchange._hand_on_first_token

    async def counted() -> None:
        handed.append(1)
        await original()

    monkeypatch.setattr(_exchange, "_hand_on_first_token", counted)
    async with polygate.session(
        one_source_settings(), transport=httpx.MockTransport(handler)
    ) as s:
        response = await s.chat(MESSAGES)
        assert response.text == "t0 t1 t2 t3 t4 "
        assert handed == []
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
        assert handed == [1]


# --- a held chunk that carries data but no content token (outside review, 2026-12-02) ---

_FILTER = {"hate": {"filtered": False, "severity": "safe"}}


def _content(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def _paced_transport(events: list[dict[str, object]], gap_s: float) -> httpx.MockTransport:
    """Each event ``gap_s`` after the one before, then [DONE]."""

    async def body() -> AsyncIterator[bytes]:
        for event in events:
            await trio.sleep(gap_s)
            yield b"data: " + json.dumps(event).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return httpx.MockTransport(lambda _: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=body()))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("where", ["finish", "mid-stream"])
def test_a_caller_behind_on_a_data_only_chunk_is_not_a_stall(seed: int, where: str) -> None:
    """32 content chunks fill the stream's channel; the next chunk carries data and no
    token: Azure's finish chunk with its filter results, or OpenRouter's reasoning
    signature mid-stream.  The caller reads only after 30 s.  Held like a content
    chunk, it stops the attempt's clocks as one does: the caller gets the whole answer,
    no ``StreamStalled`` (``stall_timeout_s=5``), and the breaker counts no failure.
    (The stall clock stayed where it was, 25 s in the past, when the hold ended.)"""
    events: list[dict[str, object]] = [_content(f"t{i} ") for i in range(32)]
    if where == "finish":
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                                    "content_filter_results": _FILTER}]})
    else:
        events.append({"choices": [{"index": 0, "delta": {"reasoning_details": [
            {"type": "reasoning.encrypted", "data": "sig"}]}, "finish_reason": None}]})
        events += [_content(f"u{i} ") for i in range(3)]
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", timeout_s=300)],
        stream=polygate.StreamWatch(stall_timeout_s=5))})
    out: dict[str, object] = {}

    async def main() -> None:
        async with polygate.session(settings, transport=_paced_transport(events, 0.01)) as s:
            async with s.stream_chat(MESSAGES) as stream:
                await trio.sleep(30)
                out["chunks"] = [chunk async for chunk in stream]
            out["response"] = stream.response
            out["state"] = (await s.statistics()).governance.sources[0].state

    Schedule(seed).run(main)
    response = out["response"]
    assert isinstance(response, polygate.ChatResponse)
    assert response.text.split()[-1] == ("t31" if where == "finish" else "u2")
    # Every event but a bare finish (no data to relay: the response carries it).
    assert len(out["chunks"]) == len(events) - (where == "mid-stream")  # type: ignore[arg-type]
    assert response.call_stats.stall_count == 0
    state = out["state"]
    assert state.consecutive_failures == 0 and state.breaker is BreakerState.CLOSED  # type: ignore[attr-defined]


async def test_a_held_chunk_the_caller_never_got_is_not_in_its_text(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``stream.text`` is what the iterator yielded plus what waits in its channel.  A
    33rd chunk held back (the channel full) when the deadline cut the call was neither:
    the caller got 32 chunks, and the text is theirs alone."""
    up = FakeUpstream(Reply(first_token_s=0.1, inter_token_s=0.01, tokens=40))
    got: list[str] = []
    async with polygate.session(one_source_settings(call_deadline_s=5),
                                transport=up.transport()) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            async with s.stream_chat(MESSAGES) as stream:
                await trio.sleep(10)  # the channel fills, the 33rd chunk is held, the deadline cuts
                async for chunk in stream:
                    got.append(chunk.text)
    assert len(got) == 32
    assert stream.text == "".join(got)


async def test_stream_text_holds_every_chunk_yielded(autojump_clock: trio.testing.MockClock) -> None:
    """Review of the fix above: a caller behind by 33 chunks reads them in a loop that
    does not checkpoint; the iterator takes what waits in the channel without a
    scheduler pass, so the held 33rd chunk, moved into the channel by the first
    receive, was yielded before its sender recorded it in ``stream.text``."""
    up = FakeUpstream(Reply(first_token_s=0.1, inter_token_s=0.01, tokens=40))
    lag: list[int] = []
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        async with s.stream_chat(MESSAGES) as stream:
            await trio.sleep(10)  # 32 chunks in the channel, the 33rd held
            got: list[str] = []
            async for chunk in stream:
                got.append(chunk.text)
                if not stream.text.startswith("".join(got)):
                    lag.append(len(got))
    assert lag == []
    assert stream.text == "".join(got)


def _json_answer(request: httpx.Request) -> httpx.Response:
    """An upstream that cannot stream: a plain JSON body to ``stream: true``."""
    return httpx.Response(200, json={
        "id": "x", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "whole answer"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}})


@pytest.mark.parametrize("seed", range(8))
def test_stream_text_holds_a_json_answers_chunk_once_yielded(seed: int) -> None:
    """The same for the one chunk of a JSON answer, in every scheduler order."""
    lag: list[str] = []

    async def main() -> None:
        async with polygate.session(one_source_settings(),
                                    transport=httpx.MockTransport(_json_answer)) as s:
            async with s.stream_chat(MESSAGES) as stream:
                got = ""
                async for chunk in stream:
                    got += chunk.text
                    if not stream.text.startswith(got):
                        lag.append(stream.text)

    Schedule(seed).run(main)
    assert lag == []


def test_a_taken_back_piece_leaves_the_text_before_it() -> None:
    """``drop_last`` on a TextParts whose last append joined pieces (every 16th)."""
    from polygate.transport import TextParts, drop_last

    for n in range(1, 40):
        parts = TextParts()
        for i in range(n):
            parts.append(f"<{i}>")
        drop_last(parts, f"<{n - 1}>")
        assert "".join(parts) == "".join(f"<{i}>" for i in range(n - 1))


async def test_a_slow_reader_falls_at_most_32_chunks_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The bound docs/asyncio.md holds the asyncio stream to, in trio: what the call has
    shown (``stream.text``: yielded or queued) is at most 33 chunks ahead of what the
    reader took -- the channel's 32 and the one the call holds -- and the buffer does
    fill, so the bound is reached, not merely respected."""
    up = FakeUpstream(Reply(first_token_s=0.1, tokens=100))
    pieces: list[str] = []
    shown: list[int] = []
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for chunk in stream:
                pieces.append(chunk.text)
                shown.append(len(stream.text))
                await trio.sleep(0.01)
    assert len(pieces) == 100 and all(pieces)
    leads = reader_leads(pieces, shown)
    assert 32 <= max(leads) <= 33
    assert stream.response is not None
    assert stream.response.call_stats.total_latency_ms >= 100 + (100 - 33) * 10


async def test_a_chunk_for_a_waiting_reader_takes_none_of_the_buffers_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """trio's channel hands a chunk to a reader waiting for it outside its buffer: a
    burst of 33 chunks lets the call complete while the reader holds its first (the
    asyncio stream's twin is in tests/test_aio.py)."""
    up = FakeUpstream(Reply(first_token_s=0.1, tokens=33))
    async with polygate.session(one_source_settings(), transport=up.transport()) as s:
        async with s.stream_chat(MESSAGES) as stream:
            await stream.__anext__()
            await trio.testing.wait_all_tasks_blocked()
            assert up.requests[0].outcome == "complete"
            rest = [chunk async for chunk in stream]
    assert len(rest) == 32 and stream.response is not None
