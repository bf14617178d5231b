"""Machinery of the scheduling-aware property suite (``test_schedules.py``): scenarios,
one run of a scenario under one schedule, and the invariants checked after it.

A *scenario* is sources with scripted replies, a scope configuration, a governance
backend latency and a few calls (chat or stream, start time, deadline, external
cancellation, the consumer's pace).  A *schedule* is the seed of trio's batch order
(:class:`polygate.testing.Schedule`); their strategies are in
``_schedule_scenarios.py``.  :func:`run` plays one scenario under one
schedule through :class:`polygate.testing.EventTransport` — bodies that wake through
shared events and deliver buffered tails without a checkpoint — and returns what
happened; :func:`violations` lists every invariant it broke.

Two private hooks, both here so that a redesign changes only this module:
``polygate._session._backend_for`` (the session's governance backend, replaced by a
:class:`RoundTripBackend`) and ``Session._runtime.recorder`` (replaced by a
:class:`Probe` that sees every attempt record and every call's context).
"""

from __future__ import annotations

import collections
import math
import random
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import attrs
import trio

import polygate
import polygate._session as session_mod
from polygate import Hedge
from polygate._errors import Outcome
from polygate.governance import MemoryBackend
from polygate.testing import EventTransport, FakeUpstream, Reply, Schedule

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

# No loop may admit faster than this.  The most legitimate churn: 3 calls retrying a
# "Retry-After: 0" 429 at its 0.1 s floor (free of max_attempts), each round trying
# <= 3 sources, with every settle waking every waiting acquirer to try them again:
# ~240 tries a second (found by hypothesis on Python 3.10, with 200 here).  A retry or
# polling loop without a floor on its period, or on the 1 ms wait floor, goes past
# 3,000 at once.
MAX_ADMITS_PER_S = 600
WINDOW_S = 60.0


class Spinning(BaseException):
    """Raised from the backend to stop a run whose admissions spin (a BaseException
    so that no retry loop can swallow it)."""


# ---------------------------------------------------------------------- the backend


class RoundTripBackend(MemoryBackend):
    """The memory backend, but every operation is a shielded round trip of
    ``latency`` virtual seconds — RedisBackend's cancellation semantics: ``admit``
    first checks for a pending cancellation and, once sent, its answer is read;
    ``settle`` runs to the end even in a cancelled scope.  With ``latency == 0`` it
    is exactly the memory backend (no checkpoint at all).

    It also watches two invariants live: admissions per virtual second (a spinning
    loop raises :class:`Spinning` at once instead of hanging the run), and the
    hedge budget within ``[0, burst]`` after every operation."""

    def __init__(self, latency: float) -> None:
        super().__init__()
        self.latency = latency
        self.admit_times: collections.deque[float] = collections.deque()
        self.admits = 0
        self.problems: list[str] = []

    async def _rtt(self) -> None:
        if self.latency > 0:
            with trio.CancelScope(shield=True):
                await trio.sleep(self.latency)

    def _count_admit(self) -> None:
        now = trio.current_time()
        times = self.admit_times
        times.append(now)
        self.admits += 1
        while times and times[0] <= now - 1.0:
            times.popleft()
        if len(times) > MAX_ADMITS_PER_S:
            problem = (
                f"admissions spin: {len(times)} admission tries within 1 virtual second "
                f"at t={now:.6f} ({self.admits} in all)"
            )
            self.problems.append(problem)
            raise Spinning(problem)

    async def admit(self, request: Any) -> Any:
        if self.latency > 0:
            await trio.lowlevel.checkpoint_if_cancelled()
            await self._rtt()
        self._count_admit()
        return await super().admit(request)

    async def settle(self, request: Any) -> None:
        await self._rtt()
        await super().settle(request)

    def _check_budget(self, scope: str, burst: float, op: str) -> None:
        level = self._budgets.get(scope, burst)
        if not -1e-9 <= level <= burst + 1e-9:
            self.problems.append(f"hedge budget {level} outside [0, {burst}] after {op}")

    async def budget_take(self, scope: str, burst: float) -> bool:
        await self._rtt()
        took = await super().budget_take(scope, burst)
        self._check_budget(scope, burst, "budget_take")
        return took

    async def budget_refill(self, scope: str, amount: float, burst: float) -> None:
        await self._rtt()
        await super().budget_refill(scope, amount, burst)
        self._check_budget(scope, burst, "budget_refill")


# ---------------------------------------------------------------------- the probe


@attrs.define
class Reported:
    """One attempt report (``Recorder.attempt``), with the instant it came."""

    call_id: str
    record: Any
    at: float


class Probe:
    """A Recorder that keeps what the calls report: every attempt record (with the
    time it was reported, i.e. after its settlement) and every call's context."""

    def __init__(self) -> None:
        self.attempts: list[Reported] = []
        self.calls: dict[str, Any] = {}  # logical_call_id -> ctx

    def attempt(self, ctx: Any, record: Any) -> None:
        self.attempts.append(Reported(ctx.logical_call_id, record, trio.current_time()))

    def call(self, ctx: Any, stats: Any, usage: Any, error: Any, output: Any = None) -> None:
        self.calls[ctx.logical_call_id] = ctx


# ---------------------------------------------------------------------- scenarios


@attrs.frozen
class SourceSpec:
    name: str
    replies: tuple[Reply, ...]
    weight: float = 1.0
    timeout_s: float = 20.0
    tpm: int | None = None
    rpm: int | None = None
    max_in_flight: int | None = None
    repeat_last: bool = False  # after the scripted replies: the last again, or a healthy one


@attrs.frozen
class CallSpec:
    kind: Literal["chat", "stream"] = "chat"
    start: float = 0.0  # virtual seconds after the session opened
    deadline: float | None = None  # call_deadline_s
    cancel_after: float | None = None  # the caller cancels this long after start
    pace: float = 0.0  # stream: the consumer's seconds per chunk
    stop_after: int | None = None  # stream: the consumer leaves after this many chunks


@attrs.frozen
class Scenario:
    sources: tuple[SourceSpec, ...]
    calls: tuple[CallSpec, ...]
    hedge: Hedge = attrs.field(factory=Hedge)
    max_attempts: int = 3
    rate_limit_wait_s: float = 2.0
    stall_timeout_s: float | None = None
    completion_estimate: int = 256  # Scope.completion_estimate_tokens
    latency: float = 0.0  # the governance backend's round trip
    tick_s: float = 0.0  # EventTransport: arrival instants rounded up to this
    seed: int = 0  # polygate's and the fakes' RNGs

    def settings(self) -> polygate.Settings:
        return polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[
                polygate.Source(
                    name=s.name, base_url=f"http://{s.name}/v1", weight=s.weight,
                    timeout_s=s.timeout_s, tpm=s.tpm, rpm=s.rpm, max_in_flight=s.max_in_flight,
                )
                for s in self.sources
            ],
            hedge=self.hedge,
            retry=polygate.Retry(
                max_attempts=self.max_attempts, backoff_base_s=0.1, backoff_max_s=1.0,
                rate_limit_wait_s=self.rate_limit_wait_s,
            ),
            stream=polygate.StreamWatch(stall_timeout_s=self.stall_timeout_s),
            completion_estimate_tokens=self.completion_estimate,
        )})

    def time_limit(self) -> float:
        """A bound on when every call must have ended (virtual seconds from the start).

        Per call: each of ``max_attempts`` failed rounds runs at most ``timeout_s``
        (plus the backend's round trips and a backoff), a round where everything was
        rate limited is free but waiting out cooldowns ends ``rate_limit_wait_s``
        after the start, and admission may wait a full RPM window or a breaker's open
        time; calls sharing a permit may run one after another, so the calls' bounds
        add up.  Generous on purpose: a call past it is one that never ends.
        """
        timeout = max(s.timeout_s for s in self.sources)
        per_round = (timeout + 8 * self.latency + 1.0) * (1 + self.hedge.max_extra)
        per_call = self.max_attempts * per_round + self.rate_limit_wait_s + 2 * WINDOW_S + 31.0
        return max(c.start for c in self.calls) + len(self.calls) * per_call


# ---------------------------------------------------------------------- a run


@attrs.define
class CallResult:
    index: int
    spec: CallSpec
    started: float = math.nan
    ended: float = math.nan
    response: polygate.ChatResponse | None = None
    error: BaseException | None = None
    cancelled: bool = False
    left_early: bool = False
    shown: str = ""
    chunk_ids: list[str | None] = attrs.Factory(list)
    leftover_nurseries: int = 0
    problems: list[str] = attrs.Factory(list)


@attrs.define
class Observation:
    calls: list[CallResult]
    upstreams: dict[str, FakeUpstream]
    backend: RoundTripBackend
    probe: Probe
    snapshots: list[Any] = attrs.Factory(list)  # SourceSnapshot after the calls
    windows: list[Any] = attrs.Factory(list)  # SourceSnapshot a window later
    budget: float | None = None
    tasks_before: int = 0
    tasks_after: int = 0
    same_batch_wakeups: int = 0
    problems: list[str] = attrs.Factory(list)  # run-level: spin, liveness, crash


def _count_tasks() -> int:
    def walk(task: Any) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


@contextmanager
def _backend_installed(backend: RoundTripBackend) -> Iterator[None]:
    original = session_mod._backend_for
    session_mod._backend_for = lambda settings: backend  # type: ignore[assignment]
    try:
        yield
    finally:
        session_mod._backend_for = original


def _only_cancelled(group: BaseExceptionGroup[Any]) -> bool:
    return all(
        _only_cancelled(e) if isinstance(e, BaseExceptionGroup) else isinstance(e, trio.Cancelled)
        for e in group.exceptions
    )


async def _one_call(s: polygate.Session, result: CallResult) -> None:
    spec = result.spec
    await trio.sleep(spec.start)
    result.started = trio.current_time()
    messages = [{"role": "user", "content": f"call {result.index}"}]
    kw: dict[str, Any] = {"call_deadline_s": spec.deadline}
    stream = None
    with trio.CancelScope() as scope:
        if spec.cancel_after is not None:
            scope.deadline = result.started + spec.cancel_after
        try:
            if spec.kind == "chat":
                result.response = await s.chat(messages, **kw)
            else:
                async with s.stream_chat(messages, **kw) as stream:
                    async for chunk in stream:
                        result.chunk_ids.append(chunk.raw.get("id"))
                        if spec.stop_after is not None and len(result.chunk_ids) >= spec.stop_after:
                            result.left_early = True
                            break
                        if spec.pace:
                            await trio.sleep(spec.pace)
                result.response = stream.response
        except polygate.PolygateError as exc:
            result.error = exc
        except BaseExceptionGroup as group:
            # A group of nothing but Cancelled is trio carrying the caller's own
            # cancellation out of a nursery; anything else in a group is an outcome
            # that leaked unwrapped.
            if not _only_cancelled(group):
                result.problems.append(f"a public call raised a group: {group!r}")
            raise  # the cancel scope takes its own Cancelled out of it
        except Exception as exc:  # a bug surfaced as itself: not a polygate error
            result.problems.append(f"a public call raised {type(exc).__name__}: {exc!r}")
        finally:
            if stream is not None:
                result.shown = stream.text
    result.cancelled = scope.cancelled_caught
    result.ended = trio.current_time()
    result.leftover_nurseries = len(trio.lowlevel.current_task().child_nurseries)


async def _play(sc: Scenario, obs: Observation) -> None:
    transport = EventTransport(obs.upstreams, tick_s=sc.tick_s)
    try:
        await _play_on(sc, obs, transport)
    finally:
        obs.same_batch_wakeups = transport.statistics().shared


async def _play_on(sc: Scenario, obs: Observation, transport: EventTransport) -> None:
    async with polygate.session(sc.settings(), transport=transport, rng=random.Random(sc.seed)) as s:
        s._runtime.recorder = obs.probe  # private hook, see the module docstring
        obs.tasks_before = _count_tasks()
        with trio.move_on_at(sc.time_limit()) as limit:
            async with trio.open_nursery() as nursery:
                for result in obs.calls:
                    nursery.start_soon(_one_call, s, result)
        if limit.cancelled_caught:
            late = [r.index for r in obs.calls if math.isnan(r.ended)]
            obs.problems.append(
                f"liveness: call(s) {late} still running at t={sc.time_limit():.1f}, past "
                "every bound of their configuration"
            )
            return
        obs.tasks_after = _count_tasks()
        stats = await s.statistics()
        obs.snapshots = [src.state for src in stats.governance.sources]
        obs.budget = stats.governance.hedge_budget.get("chat")
        await trio.sleep(WINDOW_S + 1)
        obs.windows = [src.state for src in (await s.statistics()).governance.sources]


def run(
    sc: Scenario, schedule: Schedule, backend: RoundTripBackend | None = None
) -> Observation:
    """Play ``sc`` under ``schedule``; every failure is in the returned observation.
    ``backend`` replaces the scenario's (the checks' own tests pass a faulty one)."""
    backend = backend if backend is not None else RoundTripBackend(sc.latency)
    upstreams = {
        src.name: FakeUpstream(
            [_own_words(r, src.name) for r in src.replies], seed=sc.seed + i, name=src.name,
            then=None if src.repeat_last else _own_words(Reply(), src.name),
        )
        for i, src in enumerate(sc.sources)
    }
    obs = Observation(
        calls=[CallResult(i, spec) for i, spec in enumerate(sc.calls)],
        upstreams=upstreams, backend=backend, probe=Probe(),
    )
    try:
        with _backend_installed(backend):
            schedule.run(_play, sc, obs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # every other way out becomes a reported problem
        spins = [p for p in backend.problems if "spin" in p]
        if spins:
            obs.problems.append(spins[0])
        else:
            where = "".join(traceback.format_exception(exc)[-6:])
            obs.problems.append(f"the run crashed: {exc!r}\n{where}")
    return obs


def _own_words(reply: Reply, name: str) -> Reply:
    """Each source answers in words of its own ("a0 a1 a2"), so that text shown from one
    answer and a response from another differ visibly."""
    if reply.text is not None:
        return reply
    return attrs.evolve(reply, text=" ".join(f"{name}{i}" for i in range(reply.tokens)))


def replay(sc: Scenario, seed: int) -> list[str]:
    """Run ``sc`` under ``Schedule(seed)`` and print what it broke (the reproduction
    line a failing property prints calls this)."""
    found = violations(sc, run(sc, Schedule(seed)))
    print("\n".join(found) or "every invariant held")
    return found


def compact(value: Any) -> str:
    """``repr`` of attrs instances with their non-default fields only (still a valid
    expression where the classes are importable)."""
    if attrs.has(type(value)):
        parts = []
        for field in attrs.fields(type(value)):
            v = getattr(value, field.name)
            default = field.default
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = default.factory(value) if default.takes_self else default.factory()
            if field.init and not (default is not attrs.NOTHING and v == default):
                parts.append(f"{field.name}={compact(v)}")
        return f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, tuple):
        inner = ", ".join(compact(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def reproduction(sc: Scenario, schedule: Schedule) -> str:
    """One shell line that replays ``sc`` under ``schedule`` (from the repository root)."""
    return (
        'python -c "from tests._schedules import *; '
        f'replay({compact(sc)}, {schedule.seed})"'
    )


# ---------------------------------------------------------------------- invariants


def violations(sc: Scenario, obs: Observation) -> list[str]:
    """Every invariant the run broke (empty: all held)."""
    out = list(obs.problems) + list(obs.backend.problems)
    if obs.problems or any("spin" in p for p in out):
        # The run did not finish normally (a spin aborts it from inside the backend):
        # the later checks would only report the abort's consequences.
        return list(dict.fromkeys(out))
    by_index = _contexts(obs)
    for result in obs.calls:
        ctx = by_index.get(result.index)
        out += [f"call {result.index}: {p}" for p in _call_violations(sc, obs, result, ctx)]
    out += _end_violations(sc, obs)
    return list(dict.fromkeys(out))


def _contexts(obs: Observation) -> dict[int, Any]:
    found = {}
    for ctx in obs.probe.calls.values():
        content = ctx.messages[0]["content"] if ctx.messages else ""
        found[int(content.split()[1])] = ctx
    return found


def _source_of(chunk_id: str | None) -> str | None:
    # FakeUpstream ids read "chatcmpl-<upstream name>-<request index>"
    if not chunk_id or not chunk_id.startswith("chatcmpl-"):
        return None
    return chunk_id[len("chatcmpl-"):].rsplit("-", 1)[0]


def _call_violations(sc: Scenario, obs: Observation, r: CallResult, ctx: Any) -> list[str]:
    out = list(r.problems)
    spec = r.spec
    # One outcome per call: an answer, one polygate error, the caller's own
    # cancellation, or (a stream) the consumer leaving early.
    kinds = [r.response is not None, r.error is not None, r.cancelled]
    if sum(kinds) > 1 or (sum(kinds) == 0 and not r.left_early and not r.problems):
        out.append(f"outcome: response={r.response is not None} error={r.error!r} "
                   f"cancelled={r.cancelled} left_early={r.left_early}")
    # One deadline: nothing ends later than it, but for the backend's shielded round
    # trips already under way or owed as cleanup (at most: an admission in flight, the
    # hedge token it then asks for, the settle, the budget refill) — and a slow
    # consumer's own reading.
    late = spec.deadline is not None and r.ended > r.started + spec.deadline + 5 * sc.latency + 1e-6
    if late and not r.cancelled and spec.pace == 0:
        out.append(f"ended at {r.ended:.3f}, past its deadline {spec.deadline} from {r.started}")
    if r.leftover_nurseries:
        out.append(f"{r.leftover_nurseries} nursery(ies) still open in the caller after the call")

    # stream.response starts with exactly what the caller was shown, from one source.
    if spec.kind == "stream":
        ids = {i for i in r.chunk_ids if i is not None}
        if len(ids) > 1:
            out.append(f"the caller was shown chunks of several answers: {sorted(ids)}")
        if r.response is not None:
            if not r.response.text.startswith(r.shown):
                out.append(
                    f"stream.response.text {r.response.text!r} does not start with the shown "
                    f"text {r.shown!r} (response from {r.response.source}, shown {sorted(ids)})"
                )
            if ids:
                (shown_id,) = ids if len(ids) == 1 else (sorted(ids)[0],)
                if r.response.raw.get("id") != shown_id or r.response.source != _source_of(shown_id):
                    out.append(
                        f"stream.response is {r.response.raw.get('id')} from "
                        f"{r.response.source}, but the caller was shown {shown_id}"
                    )
    if ctx is None:
        return out
    records = list(ctx.attempts)

    # Nothing launched after a win or a commit.
    firsts = [a.timeline.first_token_at for a in records if a.timeline.first_token_at is not None]
    if spec.kind == "stream" and firsts:
        decided, what = min(firsts), "the stream committed"
    else:
        oks = [a.ended_at for a in records if a.outcome is Outcome.OK and a.ended_at is not None]
        # the winner is decided once its settle (one backend round trip) returns
        decided, what = (min(oks) + sc.latency, "the round had a winner") if oks else (math.inf, "")
    for a in records:
        if a.started_at > decided + 1e-9:
            out.append(f"{a.role} attempt on {a.source} launched at {a.started_at:.3f}, after "
                       f"{what} at {decided:.3f}")

    # Losers settled before the statistics froze; attempts == records.
    stats = r.response.call_stats if r.response is not None else getattr(r.error, "call_stats", None)
    reports = [p for p in obs.probe.attempts if p.call_id == ctx.logical_call_id]
    if stats is not None:
        frozen = ctx.started_at + stats.total_latency_ms / 1000.0 + 1e-6
        if stats.attempts != len(records):
            out.append(f"call_stats.attempts={stats.attempts} but {len(records)} attempts ran")
        for a in records:
            if a.outcome is None or a.ended_at is None:
                out.append(f"attempt {a.attempt_id} unsettled when the statistics froze")
            elif a.ended_at > frozen:
                out.append(f"attempt {a.attempt_id} settled at {a.ended_at:.3f}, after the "
                           f"statistics froze at {frozen:.3f}")
        late = [p for p in reports if p.at > frozen]
        if late:
            out.append(f"{len(late)} attempt(s) reported after the statistics froze")
    # Sent means sent (the fakes report the write: REPORTS_SENT): every attempt stamped
    # as sent reached its upstream and no other did, and ``hedges`` counts the hedges
    # among them -- not a hedge cancelled before its request left (SPEC §5).
    for name, up in obs.upstreams.items():
        received = sum(1 for q in up.requests if isinstance(q.body, dict)
                       and q.body.get("messages", [{}])[0].get("content") == f"call {r.index}")
        sent = sum(1 for a in records if a.source == name and a.timeline.sent_at is not None)
        if received != sent:
            out.append(f"{sent} attempt(s) on {name} stamped as sent, {received} request(s) arrived")
    hedges_sent = sum(1 for a in records if a.role == "hedge" and a.timeline.sent_at is not None)
    if stats is not None and stats.hedges != hedges_sent:
        out.append(f"call_stats.hedges={stats.hedges}, but {hedges_sent} hedge(s) were sent")
    if not math.isnan(r.ended):
        unsettled = [a.attempt_id for a in records if a.outcome is None]
        if unsettled or len(reports) != len(records):
            out.append(f"attempts outlived the call: unsettled {unsettled}, "
                       f"{len(reports)} reported of {len(records)}")

    # The upstream's time only: no TIMEOUT or STALLED (a breaker failure) unless the
    # upstream really took that long or was silent that long.
    source_specs = {s.name: s for s in sc.sources}
    for a, reply in _replies_of(obs, r.index, records):
        slack = sc.tick_s + 1e-6
        if reply is None:
            continue
        took = _upstream_duration(reply)
        if a.outcome is Outcome.TIMEOUT and took + slack < source_specs[a.source].timeout_s:
            out.append(f"attempt on {a.source} charged TIMEOUT, but its upstream answered "
                       f"in {took:.2f} s < timeout_s "
                       f"(the consumer's pace {spec.pace} s/chunk is not the upstream's)")
        stall = sc.stall_timeout_s
        if a.outcome is Outcome.STALLED and stall is not None and _upstream_gap(reply) + slack < stall:
            out.append(f"attempt on {a.source} charged STALLED, but its upstream was never "
                       f"silent for {stall} s")

    # A consumer's pace never shows up as upstream stalls.
    if spec.kind == "stream" and r.response is not None and stats is not None:
        committed = _reply_of_id(obs, r.chunk_ids[0] if r.chunk_ids else None)
        threshold = 2.0  # StreamWatch.stall_threshold_ms default, in seconds
        steady = committed is not None and _upstream_gap(committed, inner=True) + sc.tick_s < threshold
        if steady and stats.stall_count:
            out.append(f"stall_count={stats.stall_count} ({stats.stall_ms:.0f} ms) for an "
                       f"upstream that never paused (consumer pace {spec.pace} s/chunk)")
    return out


def _replies_of(obs: Observation, index: int, records: list[Any]) -> list[tuple[Any, Reply | None]]:
    """Pair each sent attempt of call ``index`` with the Reply its upstream gave."""
    pairs: list[tuple[Any, Reply | None]] = []
    for name, up in obs.upstreams.items():
        requests = [q for q in up.requests
                    if isinstance(q.body, dict) and q.body.get("messages", [{}])[0].get("content")
                    == f"call {index}"]
        sent = [a for a in records if a.source == name and a.timeline.sent_at is not None]
        sent.sort(key=lambda a: a.timeline.sent_at)
        # a request cancelled at its write never reached the upstream: pair only when equal
        if len(sent) == len(requests):
            pairs += [(a, q.reply) for a, q in zip(sent, requests, strict=True)]
    return pairs


def _reply_of_id(obs: Observation, chunk_id: str | None) -> Reply | None:
    name = _source_of(chunk_id)
    if name is None or name not in obs.upstreams or chunk_id is None:
        return None
    index = int(chunk_id.rsplit("-", 1)[1])
    for q in obs.upstreams[name].requests:
        if q.index == index:
            return q.reply
    return None


def _upstream_duration(reply: Reply) -> float:
    """How long the upstream takes to send the whole answer (a hang: for ever)."""
    if reply.fault == "silent":
        return math.inf
    if reply.status != 200:
        return reply.headers_delay_s
    stall = reply.stall_s if reply.stall_at is not None else 0.0
    return (reply.headers_delay_s + reply.first_token_s
            + reply.inter_token_s * max(0, reply.tokens - 1) + stall)


def _upstream_gap(reply: Reply, *, inner: bool = False) -> float:
    """The upstream's longest silence after its first content token: up to the finish
    chunk, or (``inner``) between two content chunks only."""
    at = reply.stall_at
    n = reply.tokens
    stalls = at is not None and at >= 1 and (at < n if inner else at <= n)
    inter = reply.inter_token_s if n > 1 else 0.0
    if stalls and at is not None:
        return max(inter, (reply.inter_token_s if at < n else 0.0) + reply.stall_s)
    return inter


def _end_violations(sc: Scenario, obs: Observation) -> list[str]:
    out = []
    if obs.tasks_after != obs.tasks_before:
        out.append(f"tasks: {obs.tasks_before} before the calls, {obs.tasks_after} after")
    for up in obs.upstreams.values():
        if up.in_flight:
            out.append(f"upstream {up.name}: {up.in_flight} exchange(s) still open")
    for snap in obs.snapshots:
        name = snap.source
        if snap.in_flight or snap.tokens_reserved:
            out.append(f"{name}: in_flight={snap.in_flight} tokens_reserved="
                       f"{snap.tokens_reserved} after every call ended")
        if snap.reserved_total != snap.settled_total + snap.released_total:
            out.append(f"{name}: reserved {snap.reserved_total} != settled "
                       f"{snap.settled_total} + released {snap.released_total}")
        if snap.tokens_in_window < 0:
            out.append(f"{name}: {snap.tokens_in_window} tokens in the TPM window")
    for snap in obs.windows:
        if snap.requests_in_window or snap.tokens_in_window:
            out.append(f"{snap.source}: a window after the last call its window still holds "
                       f"{snap.requests_in_window} request(s) and {snap.tokens_in_window} "
                       "token(s) (window drift)")
    burst = sc.hedge.budget_burst
    if obs.budget is not None and not -1e-9 <= obs.budget <= burst + 1e-9:
        out.append(f"hedge budget {obs.budget} outside [0, {burst}]")
    return out
