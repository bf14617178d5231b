"""Hypothesis: asyncio cancellation at random points never breaks polygate's books.

Random calls (chat, stream, embed) against random replies (delays, errors, 429s),
cancelled from asyncio at random moments (``task.cancel()``, a timeout, a stream left
early) and a session sometimes left while calls are in flight.  The invariants:

* exactly one outcome per call: a result, one polygate error (never a group), or the
  caller's own cancellation / timeout;
* when the caller sees ``CancelledError`` or ``TimeoutError``, every upstream request
  of that call has already ended (settled before the error, not after);
* nothing leaks: the upstream has nothing in flight, and the governance records show
  no permit or reservation held, reserved = settled + released;
* the trio run is gone once the session is (the next session starts afresh).

trio's scheduler batches are shuffled by hypothesis (trio's plugin), so the trio side
explores interleavings too.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polygate
import polygate.aio
from polygate.testing import FakeUpstream, Reply

from ._aio_support import BACKENDS

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

# (the thread method: see tests/test_aio.py)
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60, method="thread")]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


replies = st.builds(
    Reply,
    status=st.sampled_from([200, 200, 200, 200, 500, 429, 400]),
    retry_after_s=st.just(0.01),
    headers_delay_s=st.sampled_from([0.0, 0.0, 0.01, 0.03]),
    first_token_s=st.sampled_from([0.0, 0.005, 0.02]),
    inter_token_s=st.sampled_from([0.0, 0.002]),
    tokens=st.integers(0, 6),
    fault=st.sampled_from([None, None, None, "reset", "truncated"]),
)

cancels = st.one_of(
    st.none(),
    st.tuples(st.just("task"), st.sampled_from([0.0, 0.001, 0.005, 0.01, 0.02, 0.04])),
    st.tuples(st.just("timeout"), st.sampled_from([0.001, 0.005, 0.01, 0.02, 0.04])),
    st.tuples(st.just("break"), st.integers(0, 3)),
)

scenarios = st.fixed_dictionaries({
    "calls": st.lists(
        st.tuples(st.sampled_from(["chat", "stream", "embed"]), replies, cancels,
                  st.sampled_from([0.0, 0.0, 0.005])),
        min_size=1, max_size=6),
    "close_after": st.sampled_from([None, None, None, 0.0, 0.005, 0.02]),
    "max_in_flight": st.sampled_from([None, 1, 2]),
})


def _settings(sc: dict[str, Any]) -> polygate.Settings:
    sources = [polygate.Source(name=n, base_url=f"http://{n}/v1", timeout_s=5,
                               max_in_flight=sc["max_in_flight"]) for n in ("a", "b")]
    retry = polygate.Retry(max_attempts=2, backoff_base_s=0.001, backoff_max_s=0.005,
                           rate_limit_wait_s=0.1)
    return polygate.Settings(scopes={
        "chat": polygate.Scope(sources=sources, retry=retry, call_deadline_s=0.5),
        "embed": polygate.Scope(sources=sources, retry=retry, call_deadline_s=0.5),
    })


def _tag(request: Any) -> str:
    body = request.body if isinstance(request.body, dict) else {}
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    inputs = body.get("input")
    return str(inputs[0]) if isinstance(inputs, list) and inputs else ""


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sc=scenarios)
async def test_cancellation_at_random_points_keeps_the_books(sc: dict[str, Any]) -> None:
    by_tag = {f"call-{i}": reply for i, (_, reply, _, _) in enumerate(sc["calls"])}
    upstream = FakeUpstream(lambda rec, _rng: by_tag.get(_tag(rec), Reply()))
    outcomes: dict[int, list[Any]] = {i: [] for i in range(len(sc["calls"]))}
    unsettled_at_error: list[str] = []

    def requests_of(tag: str) -> list[Any]:
        return [r for r in upstream.requests if _tag(r) == tag]

    async def one(s: polygate.aio.Session, index: int, kind: str, cancel: Any,
                  delay: float) -> None:
        tag = f"call-{index}"
        if delay:
            await asyncio.sleep(delay)

        async def run() -> Any:
            if kind == "chat":
                return await s.chat([{"role": "user", "content": tag}])
            if kind == "embed":
                return await s.embed([tag])
            async with s.stream_chat([{"role": "user", "content": tag}]) as stream:
                n = 0
                async for _ in stream:
                    n += 1
                    if cancel is not None and cancel[0] == "break" and n > cancel[1]:
                        return "left early"
            return stream.response

        try:
            if cancel is not None and cancel[0] == "timeout":
                result: Any = await asyncio.wait_for(run(), cancel[1])
            elif cancel is not None and cancel[0] == "task":
                task = asyncio.ensure_future(run())
                await asyncio.sleep(cancel[1])
                task.cancel()
                result = await task
            else:
                result = await run()
        except polygate.PolygateError as exc:  # (DeadlineExceeded is a TimeoutError too)
            outcomes[index].append(exc)
            return
        except (asyncio.CancelledError, asyncio.TimeoutError, TimeoutError) as exc:
            # The caller's own cancellation: everything of this call has ended by now.
            if any(r.outcome is None for r in requests_of(tag)):
                unsettled_at_error.append(tag)
            outcomes[index].append(type(exc).__name__)
            return
        except BaseException as exc:
            outcomes[index].append(exc)
            return
        outcomes[index].append(result)

    async with polygate.aio.session(_settings(sc), transport=upstream.transport()) as s:
        tasks = [asyncio.ensure_future(one(s, i, kind, cancel, delay))
                 for i, (kind, _, cancel, delay) in enumerate(sc["calls"])]
        if sc["close_after"] is None:
            await asyncio.gather(*tasks)
            stats = await s.statistics()
        else:
            await asyncio.sleep(sc["close_after"])
            stats = None
    await asyncio.gather(*tasks)  # (after a close: the calls were cancelled by it)

    assert not unsettled_at_error
    for index, got in outcomes.items():
        assert len(got) == 1, (index, got)  # exactly one outcome
        outcome = got[0]
        assert not isinstance(outcome, BaseExceptionGroup)
        assert (
            outcome in ("CancelledError", "TimeoutError", "left early")
            or isinstance(outcome, (polygate.ChatResponse, polygate.EmbeddingResponse,
                                    polygate.PolygateError))
        ), outcome
        if type(outcome) is polygate.PolygateError:
            assert str(outcome) in ("this session is closed",
                                    "the session was closed while this call was in flight")
            assert sc["close_after"] is not None  # only a closing session says so
    assert upstream.in_flight == 0
    assert all(r.outcome is not None for r in upstream.requests)
    if stats is not None:
        for source in stats.governance.sources:
            state = source.state
            assert state.in_flight == 0
            assert state.tokens_reserved == 0
            assert state.reserved_total == state.settled_total + state.released_total
    assert not trio.lowlevel.in_trio_run()  # the last session took its trio run with it
