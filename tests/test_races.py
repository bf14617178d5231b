"""A race decides once (review R1, R2, R12, R14 and its suspicious point 8).

These tests make two paths runnable in the *same* scheduler batch — bodies that wake on
one shared ``trio.Event``, the way two sockets become readable in one epoll wake-up —
or put an await (a slow shared backend) between a hedge's trigger and its launch.
FakeUpstream's pauses wake through cancel-scope deadlines and never show either.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import polygate
import polygate._session as session_mod
from polygate import GovernanceBackendError
from polygate._context import AttemptRecord, CallContext, NullRecorder
from polygate.governance import MemoryBackend
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, SECRET


def _settings(names: tuple[str, ...] = ("a", "b"), **hedge: Any) -> polygate.Settings:
    sources = [
        polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, weight=FIRST_A[n])
        for n in names
    ]
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=sources, hedge=polygate.Hedge(**{"after_s": 8, **hedge}))})


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _delta(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return _sse({"object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


class _GatedBody(httpx.AsyncByteStream):
    """A role chunk, then nothing until ``gate`` is set; then either the whole rest of
    the answer in one piece (already buffered) or word by word ``gap`` apart."""

    def __init__(self, gate: trio.Event, words: list[str], gap: float, *, cut: bool = False) -> None:
        self._gate, self._words, self._gap, self._cut = gate, words, gap, cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield _sse({"object": "chat.completion.chunk", "model": "m", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        await self._gate.wait()
        if self._cut:  # the words, then the body ends: no finish_reason, no [DONE]
            yield b"".join(map(_delta, self._words))
            return
        if self._gap == 0:
            yield b"".join([*map(_delta, self._words), _delta(None, "stop"), b"data: [DONE]\n\n"])
            return
        for word in self._words:
            yield _delta(word)
            await trio.sleep(self._gap)
        yield _delta(None, "stop") + b"data: [DONE]\n\n"


class _PinnedOrder(random.Random):
    """trio's scheduler, told the order of each batch instead of flipping a coin: in
    the order its tasks were created, or that reversed (``reverse``)."""

    reverse = False

    def shuffle(self, x: Any) -> None:  # (trio's deterministic mode sorts, then shuffles)
        if self.reverse:
            x.reverse()


@pytest.fixture
def batch_order(monkeypatch: pytest.MonkeyPatch) -> _PinnedOrder:
    """Both orders of a batch for certain, not by trio's coin: a test that counted on
    the coin to show it both ways in N calls failed once in ~10^4 runs, and would
    every time under a trio that stopped flipping it.  (trio's private names, the
    ones its own hypothesis support sets.)"""
    from trio._core import _run

    pinned = _PinnedOrder()
    monkeypatch.setattr(_run, "_r", pinned)
    monkeypatch.setattr(_run, "_ALLOW_DETERMINISTIC_SCHEDULING", True)
    return pinned


class _SameBatch(httpx.AsyncBaseTransport):
    """``a`` (the primary) and ``b`` (the hedge) release their first content on one
    shared event, set 2 s after the hedge is sent: both bodies become runnable in the
    same batch, in an order trio picks at random.  ``a`` streams word by word unless
    ``a_buffered``; ``b`` has its whole answer buffered."""

    def __init__(self, nursery: trio.Nursery, *, a_buffered: bool = False, b_cut: bool = False) -> None:
        self.gate = trio.Event()
        self._nursery = nursery
        self._a_gap = 0.0 if a_buffered else 1.0
        self._b_cut = b_cut

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        if request.url.host == "a":
            self.gate = trio.Event()  # one gate per call
            body = _GatedBody(self.gate, ["alpha", " beta", " gamma"], self._a_gap)
        else:
            gate = self.gate
            body = _GatedBody(gate, ["one", " two", " three"], 0.0, cut=self._b_cut)

            async def open_gate() -> None:
                await trio.sleep(2)
                gate.set()

            self._nursery.start_soon(open_gate)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)


async def test_a_stream_response_is_the_committed_paths_answer(
    autojump_clock: trio.testing.MockClock, batch_order: _PinnedOrder,
) -> None:
    """R1.  Whichever path trio runs first in the batch commits; the other, cancelled
    but runnable, reads its buffered answer to [DONE] without a checkpoint.  It must
    not win: the response is the committed path's answer, every time."""
    seen: set[str] = set()
    for i in range(4):
        batch_order.reverse = i % 2 == 1
        async with trio.open_nursery() as nursery:
            transport = _SameBatch(nursery)
            async with polygate.session(_settings(), transport=transport) as s:
                async with s.stream_chat(MESSAGES) as stream:
                    async for _ in stream:
                        pass
        response = stream.response
        assert response is not None
        assert stream.text and response.text.startswith(stream.text)
        assert response.source == ("a" if stream.text.startswith("alpha") else "b")
        assert response.call_stats.attempts == 2
        seen.add(response.source)
    assert seen == {"a", "b"}, "the scheduler never ran the batch both ways"


class _Attempts(NullRecorder):
    """Every finished attempt: (logical call, source, outcome, tokens settled)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, int | None]] = []

    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None:
        outcome = record.outcome.value if record.outcome is not None else "?"
        self.rows.append((ctx.logical_call_id, record.source, outcome, record.tokens_settled))


async def test_a_chat_loser_finishing_in_the_winners_batch_is_a_loser(
    autojump_clock: trio.testing.MockClock, batch_order: _PinnedOrder,
) -> None:
    """Suspicious point 8.  Both paths have their whole answer buffered when the gate
    opens; the one trio runs second was cancelled by the first and finishes without a
    checkpoint.  It is reported ``hedge_cancelled``, never ``ok`` beside the winner,
    and settles the usage it reported rather than the estimate."""
    recorder = _Attempts()
    winners: dict[str, str] = {}
    async with trio.open_nursery() as nursery:
        transport = _SameBatch(nursery, a_buffered=True)
        # (a burst that outlasts the twelve hedged calls)
        async with polygate.session(_settings(budget_burst=20), transport=transport) as s:
            s._runtime.recorder = recorder
            for i in range(4):
                batch_order.reverse = i % 2 == 1
                r = await s.chat(MESSAGES)
                assert r.call_stats.attempts == 2 and r.source is not None
                winners[r.call_stats.logical_call_id] = r.source
    outcomes: dict[str, dict[str, tuple[str, int | None]]] = {}
    for call, source, outcome, settled in recorder.rows:
        outcomes.setdefault(call, {})[source] = (outcome, settled)
    for call, winner in winners.items():
        loser = "b" if winner == "a" else "a"
        assert outcomes[call][winner][0] == "ok"
        assert outcomes[call][loser][0] == "hedge_cancelled"
    assert set(winners.values()) == {"a", "b"}, "the batch did not run both ways"


async def test_a_loser_cut_in_the_winners_batch_does_not_feed_the_breaker(
    autojump_clock: trio.testing.MockClock, batch_order: _PinnedOrder,
) -> None:
    """The hedge's buffered answer ends cut (truncated) in the batch where the primary
    completes.  When the primary runs first, it wins and cancels the hedge, whose
    buffered fault then surfaces without a checkpoint: that path lost, so it is
    ``hedge_cancelled`` and feeds neither the breaker nor the source's health (SPEC
    §3, §4: "losers do not feed the breaker").  When the hedge runs first, its cut is
    a real failure of a path still in the race, and counts."""
    recorder = _Attempts()
    async with trio.open_nursery() as nursery:
        transport = _SameBatch(nursery, a_buffered=True, b_cut=True)
        settings = _settings(budget_burst=20)
        settings = attrs.evolve(settings, scopes={"chat": attrs.evolve(
            settings.scopes["chat"], breaker=polygate.Breaker(failures=1000, failure_rate=1.0))})
        async with polygate.session(settings, transport=transport) as s:
            s._runtime.recorder = recorder
            for i in range(4):
                batch_order.reverse = i % 2 == 1
                r = await s.chat(MESSAGES)
                assert r.source == "a" and r.call_stats.attempts == 2
            sources = {x.state.source: x.state for x in (await s.statistics()).governance.sources}
    b_rows = [outcome for _, source, outcome, _ in recorder.rows if source == "b"]
    assert set(b_rows) <= {"hedge_cancelled", "transient"}, b_rows
    # (Each order shows one of the two: a loser, or a real failure still in the race.)
    assert set(b_rows) == {"hedge_cancelled", "transient"}, b_rows
    # Only the real failures fed the breaker; a loser never did.
    assert sources["b"].consecutive_failures == b_rows.count("transient")


class _SlowBudget(MemoryBackend):
    """The memory backend whose hedge-budget operations take a 0.5 s round trip, like a
    healthy but remote shared store; ``shielded``: a round trip the round's cancel
    cannot cut, as Redis's is, so the monitor is still there when it returns."""

    def __init__(self, shielded: bool = False) -> None:
        super().__init__()
        self.shielded = shielded

    async def budget_take(self, scope: str, burst: float) -> bool:
        with trio.CancelScope(shield=self.shielded):
            await trio.sleep(0.5)
        return await super().budget_take(scope, burst)


# (Shielded: the cancel of the decided round cannot end the take, so what keeps the hedge
# unsent is the monitor's re-check of the round after it; unshielded, the cancel alone
# did, and the re-checks could be dropped with every test green.)
@pytest.mark.parametrize("shielded", [False, True])
async def test_no_hedge_is_launched_after_the_primary_won(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, shielded: bool,
) -> None:
    """R2, chat(): the hedge triggers at 8 s and waits on the budget until 8.5 s; the
    primary's answer is complete at 8.3 s.  chat() returns at 8.3 s (8.5 s when the
    take cannot be cut), nothing is sent to b, and no budget token is spent."""
    backend = _SlowBudget(shielded)
    monkeypatch.setattr(session_mod, "_backend_for", lambda settings: backend)
    a = FakeUpstream(Reply(first_token_s=8.2, inter_token_s=0.1, tokens=2))
    b = FakeUpstream(Reply(first_token_s=30, tokens=2))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        t0 = trio.current_time()
        r = await s.chat(MESSAGES)
        returned = trio.current_time() - t0
        level = await backend.budget_level("chat", 10)
    assert (r.source, r.call_stats.attempts, r.call_stats.hedges) == ("a", 1, 0)
    assert returned == pytest.approx(8.5 if shielded else 8.3)
    assert b.requests == []
    assert level == 10  # started full; refilled by the finished call, capped at burst


@pytest.mark.parametrize("shielded", [False, True])
async def test_no_hedge_is_launched_after_a_stream_committed(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, shielded: bool,
) -> None:
    """R2, stream_chat(): a commits at 8.2 s while the hedge waits on the budget until
    8.5 s; the hedge is never sent, so it cannot finish first and take the round."""
    monkeypatch.setattr(session_mod, "_backend_for", lambda settings: _SlowBudget(shielded))
    a = FakeUpstream(Reply(first_token_s=8.2, inter_token_s=1, text="alpha beta gamma delta"))
    b = FakeUpstream(Reply(first_token_s=1, text="one two three"))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    assert stream.response is not None
    assert stream.response.text == stream.text == "alpha beta gamma delta"
    assert b.requests == []


async def test_a_commit_cancels_the_other_paths_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first content of a stream commits it and cancels every other path then,
    not when the committed path finishes."""
    a = FakeUpstream(Reply(first_token_s=20, inter_token_s=5, tokens=4))
    b = FakeUpstream(Reply(first_token_s=1, inter_token_s=5, tokens=4))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                pass
    assert stream.response is not None and stream.response.source == "b"
    # b sent at 8, first token at 9: a is cancelled at 9, long before b ends at 24.
    assert a.requests[0].ended_at == pytest.approx(9)
    assert a.requests[0].outcome == "client_closed"


async def test_a_staged_extra_skips_the_source_that_failed_in_this_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R12: the first extra (b) fails at once; the second goes to c, not back to b."""
    a = FakeUpstream(Reply(first_token_s=100))
    b = FakeUpstream(Reply(status=500))
    c = FakeUpstream(Reply(first_token_s=0.5))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name=n, base_url=f"http://{n}/v1", api_key=SECRET, weight=w)
                 for n, w in {"a": 1.0, "b": 1e-6, "c": 1e-12}.items()],
        hedge=polygate.Hedge(after_s=1, max_extra=2))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b, "c": c})) as s:
        r = await s.chat(MESSAGES)
    assert r.source == "c" and len(b.requests) == 1
    assert c.requests[0].started_at == pytest.approx(1)
    assert r.call_stats.total_latency_ms == pytest.approx(1500)


async def test_refused_hedges_are_retried_no_faster_than_the_floor(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R14: a learnt threshold of microseconds (instant first tokens) and a hedge
    target that refuses (its only permit is taken): the monitor looks again every
    50 ms at most, not every microsecond."""
    admits = 0

    class Counting(MemoryBackend):
        async def admit(self, request: Any) -> Any:
            nonlocal admits
            admits += 1
            return await super().admit(request)

    monkeypatch.setattr(session_mod, "_backend_for", lambda settings: Counting())
    a = FakeUpstream([Reply(first_token_s=0.0)] * 25, then=Reply(first_token_s=1.0))
    b = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", weight=1.0),
                 polygate.Source(name="b", base_url="http://b/v1", weight=1e-9, max_in_flight=1)],
        hedge=polygate.Hedge(after_quantile=0.9, max_after_s=5))})
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        for _ in range(25):
            await s.chat(MESSAGES)
        held = await s._runtime.governor.try_admit("chat", 10, exclude=("a",))
        assert isinstance(held, polygate.governance.Admission)
        admits = 0
        await s.chat(MESSAGES)  # first token after 1 s: ~20 re-checks, each refused by b
    assert s._runtime.sketch("chat", "a").quantile(0.9) < 1e-3  # type: ignore[operator]
    assert 1 + 10 <= admits <= 1 + 2 * 21


async def test_a_budget_that_cannot_answer_means_no_hedge(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hedge budget fails closed: a backend error on the budget is no hedge, and the
    primary carries on (with Redis down, late calls must not all double)."""

    class Down(MemoryBackend):
        async def budget_take(self, scope: str, burst: float) -> bool:
            raise GovernanceBackendError("the budget store is unreachable")

    monkeypatch.setattr(session_mod, "_backend_for", lambda settings: Down())
    a = FakeUpstream(Reply(first_token_s=20))
    b = FakeUpstream(Reply(first_token_s=1))
    async with polygate.session(_settings(), transport=Router({"a": a, "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert (r.source, r.call_stats.hedges, r.call_stats.attempts) == ("a", 0, 1)
    assert b.requests == []
