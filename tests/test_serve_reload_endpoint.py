"""A reload that changes what a source reaches (a rotated key, a new URL or model)
under the same name.

``polygate serve``'s generations share one in-process governance backend keyed by
(scope, source name), so that a reload keeps in-flight permits, quota windows and
breakers.  A review found the other side of that: an operator's fix for a source
gone dead (its key revoked: 401, dead for ``dead_cooldown_s``, 300 s) is a new key
and a reload, and the new key was never tried: the name stayed dead, every request a
502, for five minutes.  A name whose endpoint changed now starts its health afresh;
the quota window and permits stay (the calls they count are real), and the verdicts
of calls still running on the old generation, on the endpoint it replaced, no longer
count for it."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

import polygate
from polygate.governance import MemoryBackend
from polygate.governance._model import (
    AdmitRequest,
    BreakerPolicy,
    Feedback,
    SettleRequest,
    SourceLimits,
)
from polygate.serve import open_server
from polygate.testing import FakeUpstream, RecordedRequest, Reply

from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, http

OLD_KEY = "sk-old-" + "o" * 20
NEW_KEY = "sk-new-" + "n" * 20


def _settings(url: str, key: str, **source: Any) -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=url, api_key=key, **source)],
            call_deadline_s=5)},
        serve=polygate.Serve(api_keys=[GATEWAY_KEY]))


def _by_key(*, slow_401_s: float = 0.0, asked: trio.Event | None = None) -> FakeUpstream:
    """An upstream that has revoked the old key and takes the new one; ``asked`` is
    set when the old key's request has arrived (the fake runs in the test's run)."""

    def behaviour(request: RecordedRequest, _rng: object) -> Reply:
        if request.headers.get("authorization") == f"Bearer {NEW_KEY}":
            return Reply(text="works")
        if asked is not None:
            asked.set()
        return Reply(status=401, headers_delay_s=slow_401_s)

    return FakeUpstream(behaviour)


async def test_a_rotated_key_is_tried_at_once_after_the_reload() -> None:
    upstream = _by_key()
    async with upstream.serve() as url, open_server(_settings(url, OLD_KEY), port=0) as server:
        assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 502
        refused = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert refused.status == 502 and "dead" in refused.json()["error"]["message"]
        await server.reload(_settings(url, NEW_KEY))
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert answer.status == 200, answer.body[:300]
    assert answer.json()["choices"][0]["message"]["content"] == "works"
    assert [r.status for r in upstream.requests] == [401, 200]


async def test_a_new_url_for_the_name_is_tried_at_once() -> None:
    revoked, fresh = FakeUpstream(Reply(status=401)), FakeUpstream(Reply(text="works"))
    async with revoked.serve() as old_url, fresh.serve() as new_url, \
            open_server(_settings(old_url, OLD_KEY), port=0) as server:
        assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 502
        await server.reload(_settings(new_url, OLD_KEY))
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert answer.status == 200 and len(fresh.requests) == 1


async def test_a_reload_that_changes_nothing_the_source_reaches_keeps_it_dead() -> None:
    upstream = _by_key()
    async with upstream.serve() as url, open_server(_settings(url, OLD_KEY), port=0) as server:
        assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 502
        # Another field (its weight, a timeout) changed; the key, URL and model did not.
        await server.reload(_settings(url, OLD_KEY, timeout_s=60))
        refused = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert refused.status == 502 and "dead" in refused.json()["error"]["message"]
    assert len(upstream.requests) == 1


async def test_a_call_still_on_the_old_key_cannot_mark_the_new_one_dead() -> None:
    """The old generation's call, in flight across the reload, gets the revoked key's
    401 after it: that verdict is on the endpoint the reload replaced."""
    asked = trio.Event()
    upstream = _by_key(slow_401_s=0.5, asked=asked)
    async with upstream.serve() as url, open_server(_settings(url, OLD_KEY), port=0) as server:
        async with trio.open_nursery() as nursery:
            old_call: list[int] = []

            async def on_the_old_generation() -> None:
                old_call.append((await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status)

            nursery.start_soon(on_the_old_generation)
            with trio.fail_after(5):
                await asked.wait()  # (its 401 comes 0.5 s later)
            await server.reload(_settings(url, NEW_KEY))
        # Its 401 came after the reload; its retry is not sent to the revoked key.
        assert old_call == [502]
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert answer.status == 200, answer.body[:300]
    assert [r.status for r in upstream.requests] == [401, 200]


async def test_renewing_an_endpoint_keeps_the_quota_window_and_the_permits() -> None:
    backend = MemoryBackend()
    old = SourceLimits(rpm=10, max_in_flight=2, endpoint="old")
    new = SourceLimits(rpm=10, max_in_flight=2, endpoint="new")
    policy = BreakerPolicy(failures=1)
    backend.renew({("chat", "a"): "old"})
    held = await backend.admit(AdmitRequest("chat", "a", old, 5, policy))
    failed = await backend.admit(AdmitRequest("chat", "a", old, 5, policy))
    await backend.settle(SettleRequest(failed, 5, Feedback.FAILURE, policy))  # type: ignore[arg-type]
    assert (await backend.snapshot("chat", "a")).breaker == "open"
    backend.renew({("chat", "a"): "new"})
    state = await backend.snapshot("chat", "a")
    assert (state.breaker, state.dead, state.consecutive_failures) == ("closed", False, 0)
    assert (state.in_flight, state.requests_in_window) == (1, 2)
    # The old endpoint's verdict, settled after the reload, no longer counts.
    await backend.settle(SettleRequest(held, 5, Feedback.FAILURE, policy, cooldown_s=300,  # type: ignore[arg-type]
                                       dead=True))
    state = await backend.snapshot("chat", "a")
    assert (state.breaker, state.dead, state.in_flight) == ("closed", False, 0)
    # It counts for the old endpoint, whose calls no longer go there.
    refused = await backend.admit(AdmitRequest("chat", "a", old, 5, policy))
    assert refused.reason == "dead"  # type: ignore[union-attr]
    # The new endpoint's verdicts do.
    granted = await backend.admit(AdmitRequest("chat", "a", new, 5, policy))
    await backend.settle(SettleRequest(granted, 5, Feedback.FAILURE, policy))  # type: ignore[arg-type]
    assert (await backend.snapshot("chat", "a")).breaker == "open"


async def test_a_replaced_endpoint_keeps_its_own_health_for_its_calls(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryBackend()
    policy = BreakerPolicy(failures=1, open_s=1.0)
    old, new = SourceLimits(endpoint="old"), SourceLimits(endpoint="new")
    backend.renew({("chat", "a"): "old"})
    failed = await backend.admit(AdmitRequest("chat", "a", old, 1, policy))
    await backend.settle(SettleRequest(failed, 1, Feedback.FAILURE, policy))  # type: ignore[arg-type]
    await trio.sleep(1.0)
    # A call of the old generation holds the half-open breaker's probe at the reload.
    probe = await backend.admit(AdmitRequest("chat", "a", old, 1, policy))
    assert probe.probe  # type: ignore[union-attr]
    backend.renew({("chat", "a"): "new"})
    # The old endpoint's calls still meet its breaker (its probe is out) ...
    refused = await backend.admit(AdmitRequest("chat", "a", old, 1, policy))
    assert refused.reason == "breaker_open"  # type: ignore[union-attr]
    # ... and its probe's failure re-opens it, not the new endpoint's.
    await backend.settle(SettleRequest(probe, 1, Feedback.FAILURE, policy))  # type: ignore[arg-type]
    refused = await backend.admit(AdmitRequest("chat", "a", old, 1, policy))
    assert refused.reason == "breaker_open" and refused.retry_at is not None  # type: ignore[union-attr]
    state = await backend.snapshot("chat", "a")
    assert (state.breaker, state.consecutive_failures, state.in_flight) == ("closed", 0, 0)
    again = await backend.admit(AdmitRequest("chat", "a", new, 1, policy))
    assert again.probe is False  # type: ignore[union-attr]


async def test_calls_waiting_on_the_old_generation_survive_a_key_rotation() -> None:
    """Review: refusing every attempt to the replaced endpoint failed the old
    generation's calls still waiting for a permit (``max_in_flight``) with "a: dead",
    where both keys were valid: they are judged by the old endpoint's own health."""
    upstream = FakeUpstream(Reply(text="ok", first_token_s=0.3))
    statuses: list[int] = []
    async with upstream.serve() as url, \
            open_server(_settings(url, OLD_KEY, max_in_flight=1), port=0) as server:

        async def one() -> None:
            statuses.append((await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
            # Everything in this run waits: one call on the upstream's 0.3 s, three
            # for its permit (the server and the fake run here too).
            await trio.testing.wait_all_tasks_blocked()
            assert server.statistics().in_flight == 4 and len(upstream.requests) == 1
            await server.reload(_settings(url, NEW_KEY, max_in_flight=1))
    assert statuses == [200] * 4, statuses
    keys = [r.headers["authorization"] for r in upstream.requests]
    assert keys == [f"Bearer {OLD_KEY}"] * 4  # (each on the generation it came to)


def test_the_endpoint_digest_never_holds_the_key() -> None:
    from polygate.governance._model import endpoint_of

    digest = endpoint_of("http://a/v1", "m1", NEW_KEY)
    assert NEW_KEY not in digest and "n" * 8 not in digest
    assert digest != endpoint_of("http://a/v1", "m1", OLD_KEY)
    assert digest != endpoint_of("http://a/v1", "m2", NEW_KEY)


async def test_a_revoked_keys_dead_mark_outlives_many_reloads(autojump_clock: trio.testing.MockClock) -> None:
    """Review: a source keeps the health of the last 8 endpoints replaced, and the
    oldest went first, live marks and all: after nine more key changes within its
    cooldown a revoked key was admitted again for its calls.  Records whose marks have
    run out go first."""
    backend = MemoryBackend()
    policy = BreakerPolicy()
    revoked = SourceLimits(endpoint="revoked")
    backend.renew({("chat", "a"): "revoked"})
    failed = await backend.admit(AdmitRequest("chat", "a", revoked, 1, policy))
    await backend.settle(SettleRequest(failed, 0, Feedback.FAILURE, policy,  # type: ignore[arg-type]
                                       cooldown_s=300, dead=True))
    for n in range(12):
        backend.renew({("chat", "a"): f"key-{n}"})
        await trio.sleep(1.0)
    refused = await backend.admit(AdmitRequest("chat", "a", revoked, 1, policy))
    assert refused.reason == "dead", refused  # type: ignore[union-attr]
    assert len(backend._state("chat", "a").retired or ()) <= 8
