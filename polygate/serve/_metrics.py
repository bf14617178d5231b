"""``GET /metrics``: the gateway's counters and the session's statistics, in
Prometheus's text format.

The request path only adds to plain integers and bucket arrays (well under a
microsecond); prometheus-client is used at scrape time alone, through a custom
collector, to write the exposition format.  Its own metric objects take a lock and
cost 5--8 µs per update, a visible share of the gateway's budget of 0.5 ms per
request (``benchmarks/serve.py``).  The text is written in a worker thread, from a
copy of the counters taken on the loop (see :func:`render`).

The session's side (breaker states, in-flight attempts, quota windows, hedge budget)
is read from ``Session.statistics()`` at each scrape: the server holds no governance
state of its own.  The counters a session keeps itself (telemetry rows, hedges
suppressed) are read from the process, so they go out while the backend is down.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import trio

from .._threads import run_sync
from .._types import CallStats

if TYPE_CHECKING:
    from .._session import Session, SessionStatistics

__all__ = ["Metrics", "render"]

#: Request duration buckets, seconds: from a cached answer to a long generation.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0, 120.0, 300.0)


class _Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum += value

    def copy(self) -> _Histogram:
        copied = _Histogram()
        copied.counts = list(self.counts)
        copied.sum = self.sum
        return copied

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class _Carried:
    """Session counters summed over sessions: telemetry rows, suppressed hedges."""

    __slots__ = ("dropped", "suppressed", "written")

    def __init__(self) -> None:
        self.written = 0
        self.dropped = 0
        self.suppressed: dict[str, int] = {}

    def add(self, written: int, dropped: int, suppressed: Mapping[str, int]) -> None:
        self.written += written
        self.dropped += dropped
        for scope, count in suppressed.items():
            self.suppressed[scope] = self.suppressed.get(scope, 0) + count


class Metrics:
    """The gateway's own counters (the request path updates these, nothing else)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.durations: dict[str, _Histogram] = {}
        # (scope, answered scope, source, result)
        self.calls: dict[tuple[str, str, str, str], int] = {}
        self.attempts: dict[str, int] = {}
        self.hedges: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.in_flight = 0
        self.connections = 0
        self.connections_total = 0
        self.connections_refused = 0
        self.idle_reclaimed = 0  # idle keep-alive connections closed to make room
        self.disconnects = 0
        self.reloads = 0
        self.reload_failures = 0
        self.key_requests: dict[str, int] = {}  # admitted under a key's quota
        self.key_refusals: dict[tuple[str, str], int] = {}  # (key name, reason)
        #: Every generation's open session (a reload's old one until its last request
        #: has left), and what the closed ones counted: a session counts its telemetry
        #: rows and its suppressed hedges from 0, and these counters must not go back
        #: at a reload, nor lose the rows an old session writes after it.
        self.sessions: set[Session] = set()
        self.closed = _Carried()
        #: Scrapes written one at a time, on a thread of their own: trio's shared
        #: threads may all be taken by blocking work (a cache read waiting on a locked
        #: SQLite file), when a scrape is most wanted.
        self.renders = trio.CapacityLimiter(1)

    def session_closed(self, session: Session) -> None:
        """Fold a closed session's final counts into :attr:`closed`.  (Its own counts,
        read with no backend and no checkpoint: a scrape never sees them twice, nor
        misses them, nor loses them to a backend that did not answer at the close.)"""
        self.sessions.discard(session)
        self.closed.add(*session._local_counts())

    def counted(self) -> _Carried:
        """What every session counted, the closed ones and the open ones (read as they
        are now, with no checkpoint: a session that closes meanwhile is in one place)."""
        carried = _Carried()
        carried.add(self.closed.written, self.closed.dropped, self.closed.suppressed)
        for session in self.sessions:
            carried.add(*session._local_counts())
        return carried

    def snapshot(self) -> Metrics:
        """A copy of the counters as they are now, for a scrape that renders them in a
        worker thread while the request path goes on adding to these.  (The sessions'
        counts are read here, on the loop, and carried as if closed.)"""
        copied = Metrics()
        copied.requests = dict(self.requests)
        copied.durations = {name: histogram.copy() for name, histogram in self.durations.items()}
        copied.calls = dict(self.calls)
        copied.attempts = dict(self.attempts)
        copied.hedges = dict(self.hedges)
        copied.cached = dict(self.cached)
        copied.in_flight = self.in_flight
        copied.connections = self.connections
        copied.connections_total = self.connections_total
        copied.connections_refused = self.connections_refused
        copied.idle_reclaimed = self.idle_reclaimed
        copied.disconnects = self.disconnects
        copied.reloads = self.reloads
        copied.reload_failures = self.reload_failures
        copied.key_requests = dict(self.key_requests)
        copied.key_refusals = dict(self.key_refusals)
        copied.closed = self.counted()
        return copied

    def key_admitted(self, name: str) -> None:
        self.key_requests[name] = self.key_requests.get(name, 0) + 1

    def key_refused(self, name: str, reason: str) -> None:
        key = (name, reason)
        self.key_refusals[key] = self.key_refusals.get(key, 0) + 1

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        histogram = self.durations.get(endpoint)
        if histogram is None:
            histogram = self.durations[endpoint] = _Histogram()
        histogram.observe(seconds)

    def call(self, scope: str, stats: CallStats | None, result: str) -> None:
        source = stats.source if stats is not None and stats.source else ""
        # A source's name is its scope's: one that fell back is named with the scope
        # that answered, which may have a source of the same name ("openai" in both).
        answered = (stats.scope or scope) if source and stats is not None else ""
        key = (scope, answered, source, result)
        self.calls[key] = self.calls.get(key, 0) + 1
        if stats is not None:
            self.attempts[scope] = self.attempts.get(scope, 0) + stats.attempts
            self.hedges[scope] = self.hedges.get(scope, 0) + stats.hedges
            if stats.cached:
                self.cached[scope] = self.cached.get(scope, 0) + 1


async def render(metrics: Metrics, stats: SessionStatistics | None) -> bytes:
    """The exposition text of ``metrics`` and the session's ``stats``, written in a
    worker thread from a copy taken now.  Writing it is Python work proportional to
    the scopes, sources and keys: ~70 ms at 100 scopes of 10 sources and 1,000 keys,
    which on the loop held every request and stream that long at each scrape; from a
    thread the loop takes the interpreter back at each switch interval (5 ms)."""
    collector = _Collector(metrics.snapshot(), stats, trio.current_time())
    # Not abandoned on cancellation: the thread is bounded (pure CPU, tens of ms at
    # most), and waiting for it keeps no work running past the server that started it.
    return await run_sync(collector.render, limiter=metrics.renders, or_inline=True)


class _Collector:
    def __init__(self, metrics: Metrics, stats: SessionStatistics | None, now: float) -> None:
        self.metrics = metrics
        self.stats = stats
        self.now = now

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return bytes(generate_latest(registry))

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        m = self.metrics
        requests = CounterMetricFamily(
            "polygate_serve_requests", "HTTP requests answered, by endpoint and status",
            labels=["endpoint", "status"],
        )
        for (endpoint, status), count in sorted(m.requests.items()):
            requests.add_metric([endpoint, str(status)], count)
        yield requests
        durations = HistogramMetricFamily(
            "polygate_serve_request_duration_seconds",
            "Time from a request's arrival to the end of its answer", labels=["endpoint"],
        )
        for endpoint, histogram in sorted(m.durations.items()):
            durations.add_metric([endpoint], histogram.cumulative(), histogram.sum)
        yield durations
        calls = CounterMetricFamily(
            "polygate_serve_calls",
            "Logical calls, by scope, the scope that answered, its winning source, and result",
            labels=["scope", "answered_scope", "source", "result"],
        )
        for (scope, answered, source, result), count in sorted(m.calls.items()):
            calls.add_metric([scope, answered, source, result], count)
        yield calls
        for name, table, text in (
            ("polygate_serve_call_attempts", m.attempts, "Transport attempts of the calls"),
            ("polygate_serve_call_hedges", m.hedges, "Hedge attempts of the calls"),
            ("polygate_serve_calls_cached", m.cached, "Calls answered from the cache"),
        ):
            family = CounterMetricFamily(name, text, labels=["scope"])
            for scope, count in sorted(table.items()):
                family.add_metric([scope], count)
            yield family
        keys = CounterMetricFamily(
            "polygate_serve_key_requests", "Calls charged to a gateway key's quota, by key name",
            labels=["key"],
        )
        for name, count in sorted(m.key_requests.items()):
            keys.add_metric([name], count)
        yield keys
        refusals = CounterMetricFamily(
            "polygate_serve_key_refusals",
            "Calls refused (429) because a gateway key was over its quota, by key name and limit",
            labels=["key", "reason"],
        )
        for (name, reason), count in sorted(m.key_refusals.items()):
            refusals.add_metric([name, reason], count)
        yield refusals
        yield GaugeMetricFamily(
            "polygate_serve_requests_in_flight", "Requests being answered", value=m.in_flight
        )
        yield GaugeMetricFamily(
            "polygate_serve_connections_open", "Client connections open", value=m.connections
        )
        for name, value, text in (
            ("polygate_serve_connections", m.connections_total, "Client connections accepted"),
            ("polygate_serve_connections_refused", m.connections_refused,
             "Connections answered 503 because max_connections were open, none of them idle"),
            ("polygate_serve_idle_connections_closed", m.idle_reclaimed,
             "Idle keep-alive connections closed to make room for a new one at max_connections"),
            ("polygate_serve_client_disconnects", m.disconnects,
             "Requests whose client left before the answer was complete (the call was cancelled)"),
            ("polygate_serve_reloads", m.reloads, "Configuration reloads (SIGHUP)"),
            ("polygate_serve_reload_failures", m.reload_failures,
             "Reloads refused (the configuration was invalid; the old one stays)"),
        ):
            yield CounterMetricFamily(name, text, value=value)
        # The sources' state and the hedge budget are the governance backend's: read
        # at the scrape, left out when it could not answer (Redis down), and this says
        # so.  What the sessions count themselves goes out whatever the backend does:
        # an outage is when these are read most, and a counter that vanishes breaks
        # every rate() over it.
        yield GaugeMetricFamily(
            "polygate_governance_backend_up",
            "1 when this scrape read the governance backend (the polygate_source_* and "
            "polygate_hedge_budget families come from it), 0 when it could not",
            value=1.0 if self.stats is not None else 0.0,
        )
        if self.stats is not None:
            yield from _backend_families(self.stats, self.now)
        # The session's counters are every session's: a reload's new one counts from 0.
        yield from _counted_families(m.counted())


def _backend_families(stats: SessionStatistics, now: float) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["scope", "source"]
    gauges = {
        "in_flight": ("polygate_source_in_flight", "Attempts in flight (permits held)"),
        "requests_in_window": ("polygate_source_requests_window",
                               "Admissions in the rolling 60 s RPM window"),
        "tokens_in_window": ("polygate_source_tokens_window",
                             "Tokens counted in the rolling 60 s TPM window"),
        "tokens_reserved": ("polygate_source_tokens_reserved",
                            "Tokens reserved by admissions still open"),
        "consecutive_failures": ("polygate_source_consecutive_failures",
                                 "Consecutive failures fed to the breaker"),
    }
    families = {k: GaugeMetricFamily(n, t, labels=labels) for k, (n, t) in gauges.items()}
    breaker = GaugeMetricFamily(
        "polygate_source_breaker_state", "1 for the breaker's current state",
        labels=[*labels, "state"],
    )
    dead = GaugeMetricFamily("polygate_source_dead", "1 while the source is marked dead", labels=labels)
    cooling = GaugeMetricFamily(
        "polygate_source_cooling_down", "1 while the source cools down (429, 503 with Retry-After)",
        labels=labels,
    )
    latency = GaugeMetricFamily(
        "polygate_source_latency_ewma_seconds",
        "Recent latency of attempts (answers, and waits cut before any answer)",
        labels=labels,
    )
    admissions = CounterMetricFamily(
        "polygate_source_admissions", "Attempts admitted to the source", labels=labels
    )
    for record in stats.governance.sources:
        state = record.state
        key = [state.scope, state.source]
        for field, family in families.items():
            family.add_metric(key, getattr(state, field))
        for value in ("closed", "open", "half_open"):
            breaker.add_metric([*key, value], 1.0 if state.breaker.value == value else 0.0)
        dead.add_metric(key, 1.0 if state.dead else 0.0)
        until = state.cooldown_until
        cooling.add_metric(key, 1.0 if until is not None and until > now else 0.0)
        if record.health.latency_ewma_s is not None:
            latency.add_metric(key, record.health.latency_ewma_s)
        admissions.add_metric(key, state.admissions)
    yield from families.values()
    yield from (breaker, dead, cooling, latency, admissions)
    budget = GaugeMetricFamily("polygate_hedge_budget", "Hedge tokens available", labels=["scope"])
    for scope, level in sorted(stats.governance.hedge_budget.items()):
        budget.add_metric([scope], level)
    yield budget


def _counted_families(counted: _Carried) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    suppressed = CounterMetricFamily(
        "polygate_hedges_suppressed", "Hedges not sent because the budget was empty",
        labels=["scope"],
    )
    for scope, count in sorted(counted.suppressed.items()):
        suppressed.add_metric([scope], count)
    yield suppressed
    yield CounterMetricFamily(
        "polygate_telemetry_rows_written", "Telemetry rows written", value=counted.written
    )
    yield CounterMetricFamily(
        "polygate_telemetry_rows_dropped", "Telemetry rows lost (queue full, sink error, close)",
        value=counted.dropped,
    )
