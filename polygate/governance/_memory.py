"""The in-process governance backend (the default).

Every public coroutine does its whole read-check-update without a checkpoint before it
returns, so within one trio run each operation is atomic — the same guarantee the Redis
backend gets from running each operation as one Lua script.

Quota windows are rolling 60-second windows of admissions: an admission appends an
entry ``(time, tokens)``; settling rewrites that entry's tokens to the real cost (or
keeps the estimate); entries older than 60 s fall out by themselves.  RPM counts
entries; TPM sums their tokens.  An admission is granted only if the window with the
new estimate stays within ``tpm``; settling may then *raise* an entry above its
estimate, so TPM can be exceeded by at most the sum of (real - estimate) of the calls
settled within one window — the settle correction bound.  RPM is never exceeded.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Collection, Mapping

import trio

from ._model import (
    Admission,
    AdmitRequest,
    BreakerPolicy,
    BreakerState,
    Feedback,
    Refusal,
    RefusalReason,
    SettleRequest,
    SourceSnapshot,
)

__all__ = ["MemoryBackend", "WINDOW_S"]

WINDOW_S = 60.0

#: A hedge takes a whole budget token, give or take rounding: refills of 0.1 ten times
#: add up to 0.9999999999999999, and that is a token (the Redis script says the same).
WHOLE_TOKEN = 1.0 - 1e-9


class _Entry:
    __slots__ = ("at", "live", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.at = at
        self.tokens = tokens
        # In the window.  One predicate decides membership — expire() clears this as
        # it pops — so settling never re-tests a float boundary that expire() saw
        # differently (``at + 60 <= now`` and ``at > now - 60`` can both be true).
        self.live = True


def _remove_newest_first(window: collections.deque[_Entry], entry: _Entry) -> None:
    """Take ``entry`` out of the window.  A voided admission is almost always among the
    newest (it never left, so it ends soon after it began), and the window holds a
    minute of admissions -- tens of thousands at gateway load -- so it is looked for
    from the newest end, and deleted there (a deque deletes in O(distance to an end)),
    not scanned from the oldest as ``deque.remove`` does."""
    last = len(window) - 1
    for back, item in enumerate(reversed(window)):
        if item is entry:
            del window[last - back]
            return


class _Source:
    __slots__ = (
        "admissions", "breaker", "consecutive", "cooldown_until", "cost_total", "dead_until",
        "endpoint", "in_flight", "open", "open_for", "opened_at", "outcomes", "probe_out",
        "probes_ok", "released_total", "reopens", "reserved_total", "retired", "settled_total",
        "window", "window_tokens",
    )

    def __init__(self) -> None:
        self.window: collections.deque[_Entry] = collections.deque()
        self.window_tokens = 0
        self.open: dict[int, tuple[_Entry, int]] = {}  # reservation id -> (entry, estimate)
        self.in_flight = 0
        self.cooldown_until = 0.0
        # Its own instant, not a flag on cooldown_until: a longer cooldown settled while
        # the source is dead (a 429's Retry-After) must not make the dead mark longer.
        self.dead_until = 0.0
        self.breaker = BreakerState.CLOSED
        self.consecutive = 0
        self.opened_at = 0.0
        self.open_for = 0.0  # this opening's period
        self.reopens = 0  # failed probes in a row: the open period doubles with each
        self.probe_out = False
        self.probes_ok = 0  # successful probes in a row while half-open
        self.outcomes: collections.deque[bool] = collections.deque()
        self.reserved_total = 0
        self.settled_total = 0
        self.released_total = 0
        self.cost_total = 0
        self.admissions = 0
        #: The endpoint in force (MemoryBackend.renew), None until one is set: then
        #: every admission is judged by this health, whatever endpoint it had.
        self.endpoint: str | None = None
        #: The health of endpoints a renew replaced, by endpoint (the last few): the
        #: calls still running on an old generation are admitted by, and feed, theirs.
        self.retired: dict[str, _Source] | None = None

    def health_for(self, endpoint: str, now: float) -> _Source:
        """The state whose health judges an attempt to ``endpoint``: this one, or that
        of an endpoint a renew replaced (fresh for one never seen here)."""
        if self.endpoint is None or not endpoint or endpoint == self.endpoint:
            return self
        retired = self.retired
        if retired is None:
            retired = self.retired = {}
        health = retired.get(endpoint)
        if health is None:
            health = retired[endpoint] = _Source()
            _bound(retired, now)
        return health

    def retire_health(self, endpoint: str, now: float) -> None:
        """``endpoint`` is now in force in place of ``self.endpoint``: the old one's
        health is kept for its calls still running (see health_for), and this state's
        starts afresh -- no dead mark, no cooldown, the breaker closed and its history
        gone -- even for an endpoint in force before (a key put back is the operator's
        fix too).  Not the quota window or the permits: the calls they count are real
        whatever they reach."""
        # The health moves to the record, and a new source's takes its place.
        old, fresh = _Source(), _Source()
        for field in _HEALTH:
            setattr(old, field, getattr(self, field))
            setattr(self, field, getattr(fresh, field))
        retired = self.retired
        if retired is None:
            retired = self.retired = {}
        if self.endpoint is not None:
            retired[self.endpoint] = old
        retired.pop(endpoint, None)
        _bound(retired, now)

    def expire(self, now: float) -> None:
        # Written as ``at + WINDOW_S <= now``, the very sum a refusal reports as its
        # retry_at: with floats, ``at <= now - WINDOW_S`` can still be false at that
        # instant, and a waiter woken then would be refused again, forever.
        window = self.window
        while window and window[0].at + WINDOW_S <= now:
            entry = window.popleft()
            entry.live = False
            self.window_tokens -= entry.tokens

    def tokens_reserved(self) -> int:
        return sum(estimate for _, estimate in self.open.values())


#: A source's health (as against its quota window and permits): what retire_health
#: keeps of an endpoint a renew replaced.
_HEALTH = ("cooldown_until", "dead_until", "breaker", "consecutive", "opened_at", "open_for",
           "reopens", "probe_out", "probes_ok", "outcomes")
#: The replaced endpoints' health a source keeps (a generation's calls end within its
#: drain; a key switched back and forth needs no more).
_RETIRED = 8


def _bound(retired: dict[str, _Source], now: float) -> None:
    """At most _RETIRED records: first dropped, those whose marks have all run out
    (a dropped record is a fresh one if its endpoint comes back: a revoked key's live
    dead mark must not go while its calls may still run); then the oldest."""
    while len(retired) > _RETIRED:
        spent = next((key for key, health in retired.items() if _spent(health, now)), None)
        del retired[spent if spent is not None else next(iter(retired))]


def _spent(health: _Source, now: float) -> bool:
    """Whether ``health`` holds nothing a fresh record would not: no dead mark or
    cooldown running, no probe out, no breaker open for a while yet."""
    return (health.dead_until <= now and health.cooldown_until <= now and not health.probe_out
            and (health.breaker is not BreakerState.OPEN or health.opened_at + health.open_for <= now))


class MemoryBackend:
    """Governance state for one process.  Not shared: see the Redis backend for that."""

    def __init__(self) -> None:
        self._sources: dict[tuple[str, str], _Source] = {}
        self._budgets: dict[str, float] = {}
        self._ids = itertools.count(1)
        self._changed = trio.Event()

    #: trio's clock itself (a method calling it was one more call, three a call).
    now = staticmethod(trio.current_time)

    def _state(self, scope: str, source: str) -> _Source:
        key = (scope, source)
        state = self._sources.get(key)
        if state is None:
            state = self._sources[key] = _Source()
        return state

    def forget_all_but(self, kept: Collection[tuple[str, str]]) -> None:
        """Drop the state of each (scope, source) not in ``kept`` once it holds nothing:
        its minute of admissions past, nothing reserved or in flight, no breaker open,
        no cooldown or dead mark.  ``polygate serve``'s generations share one backend,
        and a reload that renamed a source (a model version in its name) or a named
        gateway key left the old name's state, its last minute of admissions with it
        (~120 bytes each), for the life of the process: nothing admits under that name
        again, so nothing expired it.  Called once a reload is in force, with the names
        every open generation uses (SharedBackends.forget_unused); a name removed less
        than a minute before stays until the next.  A scope none of ``kept`` names
        leaves its hedge budget too (~100 bytes a renamed scope, a reload each): one
        that comes back starts full, as a new scope does."""
        scopes = {scope for scope, _ in kept}
        for scope in [scope for scope in self._budgets if scope not in scopes]:
            del self._budgets[scope]
        now = self.now()
        for key in [key for key in self._sources if key not in kept]:
            state = self._sources[key]
            state.expire(now)
            if not state.window and not state.open and state.in_flight == 0 \
                    and state.breaker is BreakerState.CLOSED \
                    and state.cooldown_until <= now and state.dead_until <= now:
                del self._sources[key]

    def renew(self, endpoints: Mapping[tuple[str, str], str]) -> None:
        """The endpoint each (scope, source) now reaches (``polygate serve``'s generation
        in force).  A name whose endpoint changed -- a rotated key, a new URL or model:
        the operator's fix for a source gone dead -- starts its health afresh.  The
        calls still running on the old generation keep the replaced endpoint's health,
        theirs alone: a revoked key stays dead for them, a valid one serves them, and
        what they meet there (the revoked key's 401) does not count for the new one."""
        now = self.now()
        for key, endpoint in endpoints.items():
            state = self._state(*key)
            if state.endpoint is not None and state.endpoint != endpoint:
                state.retire_health(endpoint, now)
            state.endpoint = endpoint
        self._notify()  # (a waiter for a dead source may go now)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def admit(self, request: AdmitRequest) -> Admission | Refusal:
        now = self.now()
        s = self._state(request.scope, request.source)
        name = request.source
        limits = request.limits
        if limits.tpm is not None and request.tokens > limits.tpm:
            # First: it depends on the settings alone, and no wait (a window, a permit,
            # an open breaker) would ever make it admissible.
            return Refusal(name, RefusalReason.TOO_LARGE, None)
        # The health that judges it: the source's, or -- an attempt of a call still
        # running on a generation a reload replaced, to the endpoint the reload took
        # away (see renew) -- that endpoint's: a revoked key stays dead for its calls,
        # a valid one serves them.  The quota window and permits are the source's.
        h = s if s.endpoint is None else s.health_for(limits.endpoint, now)
        if h.dead_until > now:
            return Refusal(name, RefusalReason.DEAD, h.dead_until)
        if h.cooldown_until > now:
            return Refusal(name, RefusalReason.COOLING_DOWN, h.cooldown_until)
        probe = False
        if h.breaker is BreakerState.OPEN:
            reopen_at = h.opened_at + h.open_for
            if now < reopen_at:
                return Refusal(name, RefusalReason.BREAKER_OPEN, reopen_at)
            h.breaker = BreakerState.HALF_OPEN
            h.probe_out = False
        if h.breaker is BreakerState.HALF_OPEN:
            if h.probe_out:
                return Refusal(name, RefusalReason.BREAKER_OPEN, None)
            probe = True
        if limits.max_in_flight is not None and s.in_flight >= limits.max_in_flight:
            return Refusal(name, RefusalReason.IN_FLIGHT, None)
        s.expire(now)
        if limits.rpm is not None and len(s.window) >= limits.rpm:
            return Refusal(name, RefusalReason.RPM, s.window[0].at + WINDOW_S)
        if limits.tpm is not None and s.window_tokens + request.tokens > limits.tpm:
            # While reservations are open, settling them (real usage below the
            # estimate, a void) can free tokens before the window expires: the window's
            # time is then only the latest (``sooner``) -- if what they hold in the
            # window could make room at all.
            free_at = _tpm_free_at(s, request.tokens, limits.tpm)
            excess = s.window_tokens + request.tokens - limits.tpm
            freeable = sum(entry.tokens for entry, _ in s.open.values() if entry.live)
            return Refusal(name, RefusalReason.TPM, free_at, sooner=freeable >= excess)
        entry = _Entry(now, request.tokens)
        s.window.append(entry)
        s.window_tokens += request.tokens
        rid = next(self._ids)
        s.open[rid] = (entry, request.tokens)
        s.in_flight += 1
        s.reserved_total += request.tokens
        s.admissions += 1
        if probe:
            h.probe_out = True
        return Admission(request.scope, name, rid, request.tokens, probe, limits.endpoint)

    async def settle(self, request: SettleRequest) -> None:
        admission = request.admission
        now = self.now()
        s = self._state(admission.scope, admission.source)
        held = s.open.pop(admission.reservation_id, None)
        if held is None:
            return  # already settled: settling is idempotent
        entry, estimate = held
        s.in_flight -= 1
        # Expire first: an entry still queued but already out of the window must not
        # have its tokens rewritten, or expiring it later subtracts the wrong amount.
        s.expire(now)
        if not request.sent:
            s.released_total += estimate
            if entry.live:
                _remove_newest_first(s.window, entry)
                entry.live = False
                s.window_tokens -= entry.tokens
        else:
            s.settled_total += estimate
            cost = estimate if request.tokens is None else request.tokens
            s.cost_total += cost
            if entry.live and cost != entry.tokens:
                s.window_tokens += cost - entry.tokens
            entry.tokens = cost
        # The verdict is on the endpoint it was admitted to: a reload may have replaced
        # it meanwhile (see renew), and then it is that endpoint's health it feeds.
        h = s if s.endpoint is None else s.health_for(admission.endpoint, now)
        if request.cooldown_s is not None and request.cooldown_s > 0:
            # A dead mark holds for its own cooldown and no longer: past it, a longer
            # ordinary cooldown (a 429's Retry-After) is one to wait out, not a failure.
            h.cooldown_until = max(h.cooldown_until, now + request.cooldown_s)
            if request.dead:
                h.dead_until = max(h.dead_until, now + request.cooldown_s)
        _feed_breaker(h, request.feedback, request.breaker, admission.probe, now, request.jitter)
        self._notify()

    async def snapshot(self, scope: str, source: str) -> SourceSnapshot:
        now = self.now()
        s = self._state(scope, source)
        s.expire(now)
        return SourceSnapshot(
            scope=scope,
            source=source,
            breaker=s.breaker,  # open -> half_open happens on the next admit
            consecutive_failures=s.consecutive,
            in_flight=s.in_flight,
            requests_in_window=len(s.window),
            tokens_in_window=s.window_tokens,
            tokens_reserved=s.tokens_reserved(),
            cooldown_until=s.cooldown_until if s.cooldown_until > now else None,
            dead=s.dead_until > now,
            reserved_total=s.reserved_total,
            settled_total=s.settled_total,
            released_total=s.released_total,
            cost_total=s.cost_total,
            admissions=s.admissions,
            breaker_open_until=(
                s.opened_at + s.open_for if s.breaker is BreakerState.OPEN else None
            ),
        )

    async def budget_take(self, scope: str, burst: float) -> bool:
        # Never above this burst: one a reload lowered, say, from the level it left.
        level = min(self._budgets.get(scope, burst), burst)
        if level < WHOLE_TOKEN:
            self._budgets[scope] = level
            return False
        self._budgets[scope] = max(level - 1.0, 0.0)
        return True

    async def budget_refill(self, scope: str, amount: float, burst: float) -> None:
        self._budgets[scope] = min(burst, self._budgets.get(scope, burst) + amount)

    async def budget_level(self, scope: str, burst: float) -> float:
        return min(self._budgets.get(scope, burst), burst)

    def change_mark(self) -> trio.Event:
        return self._changed

    async def wait_changed(self, deadline: float, mark: trio.Event | None = None) -> None:
        with trio.move_on_at(deadline):
            await (mark if mark is not None else self._changed).wait()

    async def aclose(self) -> None:
        return None


def _tpm_free_at(s: _Source, tokens: int, tpm: int) -> float:
    """When enough of the window expires for ``tokens`` more to fit."""
    excess = s.window_tokens + tokens - tpm
    freed = 0
    for entry in s.window:
        freed += entry.tokens
        if freed >= excess:
            return entry.at + WINDOW_S
    # Unreachable while window_tokens is the sum of the window (an estimate larger
    # than tpm is refused as TOO_LARGE first); never report a time in the past.
    return s.window[-1].at + WINDOW_S if s.window else math.inf


def _feed_breaker(
    s: _Source, feedback: Feedback, policy: BreakerPolicy, probe: bool, now: float,
    jitter: float,
) -> None:
    """closed -> open -> half_open -> (closed | open); never skips a state."""
    if probe:
        s.probe_out = False
    if feedback is Feedback.NEUTRAL:
        return
    failed = feedback is Feedback.FAILURE
    s.outcomes.append(failed)
    # ``while``: a reload may have lowered ``rate_window`` since the last outcome.
    while len(s.outcomes) > policy.rate_window:
        s.outcomes.popleft()
    if not failed:
        s.consecutive = 0
        if s.breaker is BreakerState.HALF_OPEN and probe:
            s.probes_ok += 1
            if s.probes_ok >= policy.probes:
                s.breaker = BreakerState.CLOSED
                s.outcomes.clear()
                s.reopens = 0
                s.probes_ok = 0
        return
    s.consecutive += 1
    if s.breaker is BreakerState.HALF_OPEN:
        if probe:
            # The source is still down: wait twice as long as last time (capped).
            s.reopens += 1
            _open(s, policy, now, jitter)
        return
    if s.breaker is BreakerState.CLOSED:
        rate_trip = (
            len(s.outcomes) >= policy.rate_min_calls
            and sum(s.outcomes) / len(s.outcomes) > policy.failure_rate
        )
        if s.consecutive >= policy.failures or rate_trip:
            s.reopens = 0
            _open(s, policy, now, jitter)


def _open(s: _Source, policy: BreakerPolicy, now: float, jitter: float) -> None:
    s.breaker = BreakerState.OPEN
    s.opened_at = now
    s.open_for = policy.open_for(s.reopens, jitter)
    s.probes_ok = 0
