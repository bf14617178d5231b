"""Behaviours of admission and settling that no other test pinned (the memory
backend, the governor, an attempt's settle, gateway-key quotas).

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from polygate.governance import (
    Admission,
    AdmitRequest,
    BreakerPolicy,
    BreakerState,
    Feedback,
    MemoryBackend,
    Refusal,
    RefusalReason,
)
from tests.test_backend_contract import ask, granted, refused, settle

# ------------------------------------------------------------------ backend: cooldowns


async def test_a_shorter_cooldown_on_the_same_source_keeps_the_longer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md: ``cooldown_until = max(old, now + cooldown)``.  (The contract test
    settles its shorter cooldown on another source, so it never checked this.)"""
    b = MemoryBackend()
    x, y = await granted(b, ask()), await granted(b, ask())
    start = b.now()
    await b.settle(settle(x, 0, Feedback.NEUTRAL, cooldown_s=30.0))
    await b.settle(settle(y, 0, Feedback.NEUTRAL, cooldown_s=1.0))
    refusal = await refused(b, ask(), RefusalReason.COOLING_DOWN)
    assert refusal.retry_at == start + 30.0
    await trio.sleep(2.0)
    await refused(b, ask(), RefusalReason.COOLING_DOWN)


async def test_a_dead_mark_past_its_cooldown_is_not_reported_dead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A dead mark never outlives its cooldown -- in statistics too, before any
    admission clears the stored flag."""
    b = MemoryBackend()
    a = await granted(b, ask())
    await b.settle(settle(a, 0, Feedback.FAILURE, cooldown_s=5.0, dead=True))
    assert (await b.snapshot("chat", "a")).dead
    await trio.sleep(6.0)
    s = await b.snapshot("chat", "a")
    assert not s.dead and s.cooldown_until is None


# ------------------------------------------------------------------ backend: tpm


async def test_tpm_refusal_time_when_one_entry_frees_exactly_the_excess(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first entry whose expiry frees *exactly* what is missing is the time."""
    b = MemoryBackend()
    t0 = b.now()
    first = await granted(b, ask(40, tpm=100))
    await b.settle(settle(first, 40))
    await trio.sleep(10.0)
    second = await granted(b, ask(60, tpm=100))
    await b.settle(settle(second, 60))
    refusal = await refused(b, ask(40, tpm=100), RefusalReason.TPM)  # 40 missing
    assert refusal.retry_at == t0 + 60.0 and not refusal.sooner
    await trio.sleep_until(refusal.retry_at)
    await granted(b, ask(40, tpm=100))


async def test_an_open_reservation_that_frees_exactly_the_excess_makes_the_time_sooner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``sooner`` when the open reservations hold at least what is missing -- equal
    counts (settling it at 0 would admit the call at once)."""
    b = MemoryBackend()
    closed = await granted(b, ask(50, tpm=100))
    await b.settle(settle(closed, 50))
    held = await granted(b, ask(50, tpm=100))  # open: 50, exactly the excess below
    refusal = await refused(b, ask(50, tpm=100), RefusalReason.TPM)
    assert refusal.sooner
    await b.settle(settle(held, 0))
    await granted(b, ask(50, tpm=100))


async def test_an_open_reservation_already_out_of_the_window_frees_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An admission older than the window (a long call still running) holds no tokens
    in it: its settle cannot make room, so the refusal's time is exact, not ``sooner``."""
    b = MemoryBackend()
    long_call = await granted(b, ask(50, tpm=100))
    await trio.sleep(61.0)
    recent = await granted(b, ask(60, tpm=100))
    await b.settle(settle(recent, 60))
    refusal = await refused(b, ask(50, tpm=100), RefusalReason.TPM)
    assert not refusal.sooner
    await b.settle(settle(long_call, 0))
    await refused(b, ask(50, tpm=100), RefusalReason.TPM)  # indeed: nothing freed


# ------------------------------------------------------------------ backend: breaker

RATE_POLICY = BreakerPolicy(
    failures=3, open_s=30.0, failure_rate=0.5, rate_window=4, rate_min_calls=4, max_open_s=1e6
)


async def _outcome(b: MemoryBackend, feedback: Feedback, policy: BreakerPolicy) -> None:
    a = await granted(b, ask(breaker=policy))
    await b.settle(settle(a, 1, feedback, breaker=policy))


async def test_the_rate_rule_trips_above_the_share_not_at_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs: 'more than that share failed among the last rate_window outcomes'."""
    b = MemoryBackend()
    for feedback in (Feedback.SUCCESS, Feedback.FAILURE, Feedback.SUCCESS, Feedback.FAILURE):
        await _outcome(b, feedback, RATE_POLICY)
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.CLOSED  # 2 of 4: 50 %


async def _open_then_probe(b: MemoryBackend, policy: BreakerPolicy) -> Admission:
    refusal = await refused(b, ask(breaker=policy), RefusalReason.BREAKER_OPEN)
    assert refusal.retry_at is not None
    await trio.sleep_until(refusal.retry_at)
    probe = await granted(b, ask(breaker=policy))
    assert probe.probe
    return probe


async def test_closing_clears_the_failure_history(autojump_clock: trio.testing.MockClock) -> None:
    """docs: 'probes successful probes in a row (history cleared)': one failure after
    closing must not trip the rate rule on the failures that opened it."""
    b = MemoryBackend()
    for _ in range(3):
        await _outcome(b, Feedback.FAILURE, RATE_POLICY)
    probe = await _open_then_probe(b, RATE_POLICY)
    await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=RATE_POLICY))
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.CLOSED
    await _outcome(b, Feedback.FAILURE, RATE_POLICY)
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.CLOSED


async def test_a_stale_failure_while_half_open_does_not_reopen(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only the probe's failure re-opens a half-open breaker: an attempt admitted
    before it opened, failing late, neither re-opens it nor strands the probe."""
    policy = BreakerPolicy(failures=1, open_s=10.0, rate_min_calls=100)
    b = MemoryBackend()
    stale = await granted(b, ask(breaker=policy))
    await _outcome(b, Feedback.FAILURE, policy)  # opens
    probe = await _open_then_probe(b, policy)
    await b.settle(settle(stale, None, Feedback.FAILURE, breaker=policy))
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.HALF_OPEN
    await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.CLOSED


async def test_probes_must_succeed_in_a_row_across_a_reopening(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``probes=2``: a success, then a failed probe (re-open), then one success is not
    two in a row."""
    policy = BreakerPolicy(failures=1, open_s=10.0, rate_min_calls=100, probes=2)
    b = MemoryBackend()
    await _outcome(b, Feedback.FAILURE, policy)
    probe = await _open_then_probe(b, policy)
    await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
    probe = await granted(b, ask(breaker=policy))
    await b.settle(settle(probe, None, Feedback.FAILURE, breaker=policy))
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.OPEN
    probe = await _open_then_probe(b, policy)
    await b.settle(settle(probe, 1, Feedback.SUCCESS, breaker=policy))
    assert (await b.snapshot("chat", "a")).breaker is BreakerState.HALF_OPEN


# ------------------------------------------------------------------ governor: settle rules

import polygate  # noqa: E402
from polygate._errors import Outcome  # noqa: E402
from polygate.testing import FakeUpstream, Reply, Router  # noqa: E402
from tests.conftest import FIRST_A, MESSAGES  # noqa: E402
from tests.test_governance import _settings, _state  # noqa: E402


async def test_a_call_cut_by_its_deadline_keeps_its_estimate_in_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """SPEC §3: 'a cancelled attempt whose cost is unknown keeps the estimate' (the
    request was sent: the upstream may bill it)."""
    a = FakeUpstream(Reply(first_token_s=100))
    async with polygate.session(_settings(names=("a",), source={"a": {"tpm": 10_000}}),
                                transport=Router({"a": a})) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES, max_tokens=100, call_deadline_s=1)
        state = _state(await s.statistics(), "a")
    assert state.reserved_total > 100 and state.tokens_reserved == 0
    assert state.cost_total == state.reserved_total == state.tokens_in_window


async def test_a_transient_failure_keeps_its_estimate_in_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md: a transient failure (a 500) settles the estimate: the request
    reached the upstream, which may bill it (a rule that settled nothing, or only what
    streamed, passed the rest of the suite)."""
    a = FakeUpstream(Reply(status=500))
    async with polygate.session(_settings(names=("a",), source={"a": {"tpm": 10_000}},
                                          retry=polygate.Retry(max_attempts=1)),
                                transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES, max_tokens=100)
        state = _state(await s.statistics(), "a")
    assert state.reserved_total > 100 and state.tokens_reserved == 0
    assert state.cost_total == state.reserved_total == state.tokens_in_window


@pytest.mark.parametrize("limit", ["timeout_s", "ttft_timeout_s"])
async def test_a_timed_out_attempt_feeds_the_breaker(
    limit: str, autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md: ``timeout`` (``timeout_s``, ``ttft_timeout_s``) is a breaker
    *failure*, like any transient, and keeps its estimate (a rule that made it neutral
    passed the rest of the suite)."""
    a = FakeUpstream(Reply(first_token_s=100))
    settings = _settings(names=("a",), source={"a": {"tpm": 10_000, limit: 3.0}},
                         retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES, max_tokens=100)
        stats = await s.statistics()
    assert [e.outcome for e in info.value.errors] == [Outcome.TIMEOUT]
    record = next(r for r in stats.governance.sources if r.state.source == "a")
    assert record.state.consecutive_failures == 1
    assert record.health.failure_ewma > 0
    assert record.state.cost_total == record.state.tokens_in_window > 100


async def test_a_stalled_stream_feeds_the_breaker(autojump_clock: trio.testing.MockClock) -> None:
    """admission.md: ``stalled`` (stall_timeout_s) is a breaker *failure*, with failure
    health, like any transient."""
    a = FakeUpstream([Reply(tokens=4, stall_at=2, stall_s=50), Reply()])
    settings = _settings(names=("a",), stream=polygate.StreamWatch(stall_timeout_s=2),
                         retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
        stats = await s.statistics()
    record = next(r for r in stats.governance.sources if r.state.source == "a")
    assert record.state.consecutive_failures == 1
    assert record.health.failure_ewma > 0


async def test_reported_usage_is_settled_even_below_what_streamed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An answer with usage settles ``usage.total_tokens``: the streamed floor is for
    answers whose cost is unknown, never an override of reported usage."""
    a = FakeUpstream(Reply(tokens=40))
    settings = _settings(names=("a",), source={"a": {"tpm": 100_000}}, completion_estimate_tokens=5)
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        # 40 content chunks against an estimate of 5: the streamed floor (the prompt's
        # estimate + 40) is above the estimate, and differs from the reported usage
        response = await s.chat([{"role": "user", "content": "x" * 400}])
        state = _state(await s.statistics(), "a")
    assert response.usage.source == "upstream"
    assert state.cost_total == state.tokens_in_window == response.usage.total_tokens


async def test_retry_after_zero_still_cools_the_source_for_a_tenth_of_a_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md: a 429's cooldown is never less than 0.1 s, so ``Retry-After: 0``
    cannot make retries spin."""
    a = FakeUpstream([Reply(status=429, retry_after_s=0), Reply()])
    async with polygate.session(_settings(names=("a",)), transport=Router({"a": a})) as s:
        response = await s.chat(MESSAGES)
    assert response.source == "a"
    assert [r.started_at for r in a.requests] == [0, pytest.approx(0.1)]


async def test_a_429_without_retry_after_cools_the_source_for_one_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md: a 429's cooldown is **1 s** when Retry-After is absent."""
    a = FakeUpstream([Reply(status=429), Reply()])
    async with polygate.session(_settings(names=("a",)), transport=Router({"a": a})) as s:
        response = await s.chat(MESSAGES)
    assert response.source == "a"
    assert [r.started_at for r in a.requests] == [0, pytest.approx(1.0)]


# ------------------------------------------------------------------ governor: health, probes


async def test_a_successful_probe_resets_the_failure_health(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md: 'a successful breaker probe sets [the failure EWMA] to 0'."""
    a = FakeUpstream([Reply(status=503), Reply()])
    settings = _settings(names=("a",), breaker=polygate.Breaker(failures=1, open_s=10),
                         retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
        await trio.sleep(10)
        await s.chat(MESSAGES)  # the probe
        stats = await s.statistics()
    record = next(r for r in stats.governance.sources if r.state.source == "a")
    assert record.state.breaker is BreakerState.CLOSED
    assert record.health.failure_ewma == 0


async def test_a_429_leaves_health_unchanged(autojump_clock: trio.testing.MockClock) -> None:
    """admission.md: 'Neutral outcomes (429, fatal, cancelled, hedge loser) leave health
    unchanged'."""
    a = FakeUpstream([Reply(status=429, retry_after_s=1), Reply(status=400), Reply()])
    async with polygate.session(_settings(names=("a",)), transport=Router({"a": a})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat(MESSAGES)
        stats = await s.statistics()
    record = next(r for r in stats.governance.sources if r.state.source == "a")
    assert len(a.requests) == 2
    assert record.health.failure_ewma == 0


async def test_a_source_whose_open_period_is_over_is_probed_first_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md, picking step 5: a source seen open whose period is over leads the
    order (whatever its weight) -- for its probe only; admitted, it is picked by weight
    again."""
    a = FakeUpstream([Reply(status=429, retry_after_s=5), Reply()])
    b = FakeUpstream([Reply(status=503), Reply()])
    settings = _settings(weights=FIRST_A, breaker=polygate.Breaker(failures=1, open_s=10))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        first = await s.chat(MESSAGES)  # a: 429 (5 s); b: 503, opens; seen open; a at 5 s
        assert first.source == "a" and trio.current_time() == pytest.approx(5, abs=0.01)
        await trio.sleep_until(20)
        probe = await s.chat(MESSAGES)
        after = [(await s.chat(MESSAGES)).source for _ in range(3)]
    assert probe.source == "b"
    assert after == ["a", "a", "a"]


# ------------------------------------------------------------------ governor: hedge budget


async def test_a_hedge_with_nowhere_to_go_gives_its_whole_token_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A budget token taken for a hedge that was not launched is refunded whole."""
    a = FakeUpstream(Reply(first_token_s=5))
    b = FakeUpstream(Reply())
    settings = _settings(weights=FIRST_A, source={"b": {"tpm": 10}},  # b refuses: too large
                         hedge=polygate.Hedge(after_s=1, budget_burst=1, budget_ratio=0.1))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        response = await s.chat(MESSAGES)
        stats = await s.statistics()
    assert response.call_stats.hedges == 0
    assert stats.governance.hedge_budget["chat"] == 1.0
    assert stats.governance.hedges_suppressed_by_budget.get("chat", 0) == 0


async def test_budget_refusals_count_calls_not_rechecks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``hedges_suppressed_by_budget`` counts the calls denied a hedge, not the
    trigger's re-checks within one call."""
    a = FakeUpstream(Reply(first_token_s=5))
    b = FakeUpstream(Reply())
    settings = _settings(weights=FIRST_A,
                         hedge=polygate.Hedge(after_s=1, budget_burst=1, budget_ratio=0.1))
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        hedged = await s.chat(MESSAGES)
        denied = await s.chat(MESSAGES)  # the bucket holds 0.1: re-checked every second
        stats = await s.statistics()
    assert hedged.call_stats.hedge_won and denied.source == "a"
    assert stats.governance.hedges_suppressed_by_budget["chat"] == 1


# ------------------------------------------------------------------ attempt: settle/telemetry row

from polygate._context import AttemptRecord, CallContext, NullRecorder  # noqa: E402
from tests.test_hedge import _SlowToConnect  # noqa: E402  (host b: 100 s to connect)


class _Attempts(NullRecorder):
    """Every finished attempt's row: (source, outcome, tokens settled, error)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, int | None]] = []
        self.records: list[AttemptRecord] = []

    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None:
        outcome = record.outcome.value if record.outcome is not None else "?"
        self.rows.append((record.source, outcome, record.tokens_settled))
        self.records.append(record)


async def test_an_attempt_never_sent_reports_zero_tokens_settled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An admission whose request never left (cut while it waited for a connection) is
    voided: its telemetry row says 0 tokens settled (Governor.release 'returns the
    tokens recorded against the quota (0 when the request never left)'), not the
    estimate the quota never recorded."""
    recorder = _Attempts()
    b = FakeUpstream()
    async with polygate.session(_settings(names=("b",)), transport=_SlowToConnect(Router({"b": b}))) as s:
        s._runtime.recorder = recorder  # type: ignore[attr-defined]
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES, call_deadline_s=5)
        state = _state(await s.statistics(), "b")
    assert b.requests == []
    assert recorder.rows == [("b", "cancelled", 0)]
    assert state.released_total > 0 and state.cost_total == 0 and state.tokens_in_window == 0


# ------------------------------------------------------------------ governor: waiting

from polygate.governance import only_breakers  # noqa: E402


async def test_a_cooldown_ending_past_rate_limit_wait_s_fails_the_call_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md, waiting step 3-4: without a deadline a wait for cooldowns alone is
    bounded by ``rate_limit_wait_s``; a cooldown that ends after it fails the call now,
    without sleeping (and without sending again after it)."""
    a = FakeUpstream(Reply(status=429, retry_after_s=100))
    settings = _settings(names=("a",), retry=polygate.Retry(rate_limit_wait_s=60))
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
        assert trio.current_time() == 0
    assert len(a.requests) == 1


class _StaleClockBackend(MemoryBackend):
    """A shared backend's view through a skewed clock: while t < 0.01 it refuses with a
    retry time already past (its time converted to ours); counts admission passes."""

    def __init__(self) -> None:
        super().__init__()
        self.admits = 0

    async def admit(self, request: AdmitRequest) -> Admission | Refusal:
        self.admits += 1
        if self.admits > 10_000:
            raise RuntimeError("admission is spinning")
        if self.now() < 0.01:
            await trio.lowlevel.checkpoint()
            return Refusal(request.source, RefusalReason.COOLING_DOWN, self.now() - 1.0)
        return await super().admit(request)


async def test_a_retry_time_already_past_is_not_a_spin(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Governor.acquire: 'A retry time that is already due ... must not turn the wait
    into a spin' -- it waits at least a millisecond a pass."""
    import polygate._session

    backend = _StaleClockBackend()
    monkeypatch.setattr(polygate._session, "_backend_for", lambda settings: backend)
    a = FakeUpstream(Reply())
    async with polygate.session(_settings(names=("a",)), transport=Router({"a": a})) as s:
        response = await s.chat(MESSAGES)
    assert response.source == "a"
    assert backend.admits <= 20


def test_only_dead_sources_are_not_only_breakers() -> None:
    """``only_breakers``: whether *open breakers* are all that kept a call out -- with
    none among the refusals (every source dead, or none to ask) they are not."""
    assert not only_breakers([Refusal("a", RefusalReason.DEAD, 10.0)])
    assert not only_breakers([])
    assert only_breakers([Refusal("a", RefusalReason.BREAKER_OPEN, 10.0),
                          Refusal("b", RefusalReason.DEAD, 10.0)])


# ------------------------------------------------------------------ per-key quotas

from polygate._key_quota import KEY_SCOPE, KeyQuotas, KeyRefusal  # noqa: E402
from polygate.governance import Governor  # noqa: E402

ALICE = "sk-gw-alice-0123456789abcdef"


def _quotas(backend: MemoryBackend | None = None, **limits: int) -> KeyQuotas:
    settings = _settings(names=("a",))
    governor = Governor(settings, backend or MemoryBackend())
    return KeyQuotas({"alice": polygate.ServeKey(key=ALICE, **limits)}, governor)


async def test_a_request_of_exactly_the_keys_tpm_is_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``too_large`` is an estimate *over* the key's tpm; one equal to it fits."""
    quotas = _quotas(tpm=100)
    admission = await quotas.admit("alice", 100)
    assert isinstance(admission, Admission)
    refusal = await quotas.admit("alice", 101)
    assert isinstance(refusal, KeyRefusal) and refusal.reason == "too_large" and refusal.wait_s is None


async def test_a_tpm_refusal_that_frees_soon_says_how_soon(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A ``sooner`` time (open reservations) is capped at 1 s -- but a window that
    frees in less than that anyway says so, not 1 s."""
    quotas = _quotas(tpm=100)
    old = await quotas.admit("alice", 60)
    assert isinstance(old, Admission)
    await quotas.settle(old, attempted=True, tokens=60)
    await trio.sleep(59.7)
    held = await quotas.admit("alice", 30)  # open: could free the 30 missing
    assert isinstance(held, Admission)
    refusal = await quotas.admit("alice", 40)
    assert isinstance(refusal, KeyRefusal) and refusal.reason == "tpm"
    assert refusal.wait_s == pytest.approx(0.3)


class _SkewedBackend(MemoryBackend):
    """Refuses the key's requests with a time already past (a shared backend's clock
    converted to ours)."""

    async def admit(self, request: AdmitRequest) -> Admission | Refusal:
        await trio.lowlevel.checkpoint()
        return Refusal(request.source, RefusalReason.RPM, self.now() - 0.5)


async def test_a_key_refusal_never_says_to_wait_a_negative_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    refusal = await _quotas(_SkewedBackend(), rpm=1).admit("alice", 10)
    assert isinstance(refusal, KeyRefusal) and refusal.wait_s is not None and refusal.wait_s > 0


async def test_a_request_that_reached_no_source_is_voided_for_the_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """_key_quota: 'voided when no attempt reached a source ... it counts neither as a
    request nor as tokens'."""
    quotas = _quotas(rpm=1, tpm=1000)
    admission = await quotas.admit("alice", 300)
    assert isinstance(admission, Admission)
    await quotas.settle(admission, attempted=False, tokens=None)
    state = await quotas._backend.snapshot(KEY_SCOPE, "alice")
    assert (state.requests_in_window, state.tokens_in_window, state.in_flight) == (0, 0, 0)
    assert isinstance(await quotas.admit("alice", 300), Admission)  # rpm=1: still free


def test_the_streamed_floor_never_discounts_the_estimate() -> None:
    """``at_least``: the prompt and the tokens streamed only when that is *more* than the
    estimate; else None (the estimate stands)."""
    admission = Admission(KEY_SCOPE, "alice", 1, 300, False)
    assert KeyQuotas.at_least(admission, prompt=10, streamed=5) is None
    assert KeyQuotas.at_least(admission, prompt=10, streamed=400) == 410
    assert KeyQuotas.at_least(admission, prompt=10, streamed=0) is None


async def test_an_in_flight_refusal_names_the_in_flight_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    quotas = _quotas(rpm=50, max_in_flight=2)
    for _ in range(2):
        assert isinstance(await quotas.admit("alice", 10), Admission)
    refusal = await quotas.admit("alice", 10)
    assert isinstance(refusal, KeyRefusal)
    assert (refusal.reason, refusal.limit, refusal.wait_s) == ("in_flight", 2, 1.0)


# ------------------------------------------------------------------ attempt: clocks


async def test_a_stream_cut_by_timeout_s_is_a_timeout_not_a_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """admission.md: ``timeout_s`` is ``timeout``; ``stalled`` is ``stall_timeout_s``
    alone -- a stream still sending tokens when its whole-attempt limit fires was not
    silent."""
    a = FakeUpstream(Reply(tokens=10, inter_token_s=1))
    settings = _settings(names=("a",), source={"a": {"timeout_s": 3.5}},
                         retry=polygate.Retry(max_attempts=1))
    recorder = _Attempts()
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        s._runtime.recorder = recorder  # type: ignore[attr-defined]
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    [error] = info.value.errors
    assert error.outcome is Outcome.TIMEOUT and "timeout_s=3.5" in str(error)
    assert recorder.rows[0][:2] == ("a", "timeout")


async def test_a_slow_reader_does_not_make_the_source_look_slow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """hold_while: the consumer's pace is not the upstream's slowness -- the latency
    sample that feeds the source's health (send to settle) leaves out the time the
    attempt was held for the caller."""
    a = FakeUpstream(Reply(tokens=50, inter_token_s=0.5))  # 24.5 s of generation
    async with polygate.session(_settings(names=("a",)), transport=Router({"a": a})) as s:
        async with s.stream_chat(MESSAGES) as stream:
            async for _ in stream:
                await trio.sleep(20)  # far behind the upstream: ~1,000 s in all
        stats = await s.statistics()
    assert trio.current_time() > 900
    record = next(r for r in stats.governance.sources if r.state.source == "a")
    assert record.health.latency_ewma_s is not None and record.health.latency_ewma_s <= 24.5


async def test_a_continuations_silent_start_is_a_stall(autojump_clock: trio.testing.MockClock) -> None:
    """_attempt: a continuation of a committed stream is bounded before its first
    token by the stall watch (when it is no longer than ttft_timeout_s, equal
    included), and its miss is a *stall* (``stalled``), not a ttft timeout."""
    a = FakeUpstream([Reply(tokens=6, fault="truncated", fault_after=2), Reply(first_token_s=100)])
    b = FakeUpstream(Reply(first_token_s=100))
    settings = _settings(weights=FIRST_A, source={n: {"ttft_timeout_s": 2} for n in "ab"},
                         stream=polygate.StreamWatch(stall_timeout_s=2, resume=True, max_resumes=1))
    recorder = _Attempts()
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        s._runtime.recorder = recorder  # type: ignore[attr-defined]
        with pytest.raises(polygate.PolygateError):
            async with s.stream_chat(MESSAGES) as stream:
                async for _ in stream:
                    pass
    assert recorder.rows[0][:2] == ("a", "transient")
    assert recorder.rows[1][:2] == ("b", "stalled")

