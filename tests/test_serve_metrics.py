"""``GET /metrics``: valid Prometheus text (read back with prometheus-client's own
parser), the gateway's counters, and the session's statistics."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import polygate
from polygate.serve import _metrics, open_server
from polygate.testing import FakeUpstream, Reply

from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, gateway, http, read_until_closed, wait_for

pytestmark = pytest.mark.integration


def samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(found: dict[str, list[Any]], name: str, **labels: str) -> float:
    matching = [s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (name, labels, found.get(name))
    return float(matching[0])


async def test_exposition_parses_and_counts() -> None:
    async with gateway(Reply(tokens=2)) as (server, _):
        for _ in range(3):
            assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 200
        await http(server, "POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, AUTH)
        answer = await http(server, "GET", "/metrics", headers=AUTH)
    assert answer.status == 200
    assert answer.headers["content-type"].startswith("text/plain")
    found = samples(answer.body.decode())
    chat = "/v1/chat/completions"
    assert value(found, "polygate_serve_requests_total", endpoint=chat, status="200") == 3
    assert value(found, "polygate_serve_requests_total", endpoint=chat, status="404") == 1
    assert value(found, "polygate_serve_request_duration_seconds_count", endpoint=chat) == 4
    assert value(found, "polygate_serve_calls_total", scope="chat", source="s0", result="ok") == 3
    assert value(found, "polygate_serve_call_attempts_total", scope="chat") == 3
    # The session's side, read from Session.statistics() at the scrape.
    assert value(found, "polygate_source_in_flight", scope="chat", source="s0") == 0
    assert value(found, "polygate_source_admissions_total", scope="chat", source="s0") == 3
    assert value(found, "polygate_source_breaker_state", scope="chat", source="s0", state="closed") == 1
    assert value(found, "polygate_serve_requests_in_flight") == 1  # the scrape itself


@pytest.mark.parametrize("body", [
    {"model": "chat", "messages": "hi"},  # refused by the session's checks of its arguments
    {"model": "chat", "messages": "hi", "stream": True},
    {"model": "embed", "input": ["x"], "dimensions": "many"},
    {"model": "chat"},  # refused by the server's own
])
async def test_a_body_refused_before_any_call_is_no_call(body: dict[str, Any]) -> None:
    """Outside review (metrics, 2026-12-03): a 400 from the session's checks of its
    arguments (``messages`` not a list) was counted in ``polygate_serve_calls_total``,
    although no call started (no telemetry row, nothing charged to a key), while the
    server's own 400 for the same kind of body was not."""
    async with gateway(Reply(tokens=2)) as (server, _):
        assert (await http(server, "POST", "/v1/chat/completions", body, AUTH)).status == 400
        assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 200
        answer = await http(server, "GET", "/metrics", headers=AUTH)
    found = samples(answer.body.decode())
    assert [s.labels["result"] for s in found["polygate_serve_calls_total"]] == ["ok"]


async def test_no_key_leaks_into_metrics() -> None:
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], models={"gpt-4o": "chat"})
    async with gateway(Reply(status=401), serve=serve) as (server, _):
        await http(server, "POST", "/v1/chat/completions", CHAT, {"authorization": "Bearer guess"})
        await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        text = (await http(server, "GET", "/metrics", headers=AUTH)).body.decode()
    assert GATEWAY_KEY not in text
    assert "guess" not in text
    assert "sk-upstream-key" not in text
    found = samples(text)
    assert value(found, "polygate_source_dead", scope="chat", source="s0") == 1


async def test_a_slow_bodys_408_is_its_endpoints_and_takes_its_time() -> None:
    """Outside review: a 408 for a body too slow to arrive was counted under
    ``endpoint="other"`` (its head, and so its path, had arrived: a 413 of the same
    request is its endpoint's) and observed as 0 s in the duration histogram, as every
    answer to a request that could not be read was: slow clients dragged the
    percentiles down.  Its time counts from its first byte."""
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], body_timeout_s=0.5)
    async with gateway(serve=serve) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\nauthorization: "
                f"{AUTH['authorization']}\r\ncontent-length: 100\r\n\r\n{{".encode())
            assert (await read_until_closed(stream)).startswith(b"HTTP/1.1 408")
        requests = dict(server.metrics.requests)
        durations = {k: v.sum for k, v in server.metrics.durations.items()}
    assert requests == {("/v1/chat/completions", 408): 1}, requests
    assert sum(durations.values()) >= 0.45, durations


async def _scrape(server: Any) -> dict[str, list[Any]]:
    return samples((await http(server, "GET", "/metrics", headers=AUTH)).body.decode())


def _total(found: dict[str, list[Any]], name: str) -> float:
    return sum(float(s.value) for s in found.get(name, []))


async def test_session_counters_carry_across_a_reload(tmp_path: Any) -> None:
    """Review: the telemetry row counters and the suppressed hedges came from the
    current session alone, so a reload put them back to 0, and the rows a call in
    flight across it wrote in the old session were never counted."""
    from polygate.serve import open_server
    from polygate.testing import FakeUpstream

    from ._serve_kit import settings_for, wait_for

    db = f"sqlite:///{tmp_path / 't.db'}"
    hedge = polygate.Hedge(after_s=0.05, budget_ratio=0.0, budget_burst=1)
    upstream = FakeUpstream(Reply(tokens=2, first_token_s=0.3))
    async with upstream.serve() as url:
        def settings() -> polygate.Settings:
            return settings_for(url, telemetry=db, sources=2, hedge=hedge)

        async with open_server(settings(), port=0) as server:
            for _ in range(3):  # the first hedges, the next two find the budget empty
                assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 200
            before = await _scrape(server)
            assert _total(before, "polygate_hedges_suppressed_total") == 2
            async with trio.open_nursery() as nursery:
                # A call in flight across the reload: its rows go to the old session.
                nursery.start_soon(http, server, "POST", "/v1/chat/completions", CHAT, AUTH)
                await wait_for(lambda: upstream.in_flight >= 1)
                await server.reload(settings())
                during = await _scrape(server)
            await wait_for(lambda: server.statistics().generations == 1, limit_s=10)
            after = await _scrape(server)
    for name in ("polygate_telemetry_rows_written_total", "polygate_hedges_suppressed_total"):
        assert _total(before, name) <= _total(during, name) <= _total(after, name), name
    # Every row of the old session is counted once it has closed: 3 calls and their 4
    # attempts (one hedge), and the call in flight across the reload with its attempt.
    rows = _total(after, "polygate_telemetry_rows_written_total") + _total(
        after, "polygate_telemetry_rows_dropped_total")
    assert rows == 9
    assert _total(after, "polygate_hedges_suppressed_total") == 3  # (the last call's too)


async def test_a_scrape_is_written_while_the_gateway_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing the exposition is Python work that grows with the scopes, sources and
    keys (~70 ms at 1,000 sources and 1,000 keys): on the event loop it held every
    request and stream that long at each scrape.  Here the writing waits until another
    request has been answered; it is released only then."""
    entered, release = threading.Event(), threading.Event()
    released: list[bool] = []
    original = _metrics._Collector.render

    def held(self: Any) -> bytes:
        entered.set()
        released.append(release.wait(5))  # False: nothing else could run meanwhile
        return original(self)

    monkeypatch.setattr(_metrics._Collector, "render", held)
    async with gateway(Reply(tokens=2)) as (server, _), trio.open_nursery() as nursery:
        scraped: list[Any] = []

        async def scrape() -> None:
            scraped.append(await http(server, "GET", "/metrics", headers=AUTH))

        nursery.start_soon(scrape)
        await wait_for(entered.is_set)
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        release.set()
    assert answer.status == 200
    assert released == [True]
    found = samples(scraped[0].body.decode())
    # The copy was taken when the scrape began: the call answered meanwhile is not in it.
    assert "polygate_serve_calls_total" not in found or not found["polygate_serve_calls_total"]


def test_a_scrapes_copy_holds_every_counter() -> None:
    """The copy a scrape renders from holds each of the gateway's counters (a counter
    added later and left out of the copy would read 0 at every scrape)."""
    metrics = _metrics.Metrics()
    for number, (name, value) in enumerate(vars(metrics).items(), start=1):
        if isinstance(value, int):
            setattr(metrics, name, number)
        elif isinstance(value, dict) and name != "durations":
            value[("x", number) if name in ("requests", "key_refusals") else "x"] = number
    metrics.request("/v1/chat/completions", 200, 0.2)
    metrics.calls[("chat", "chat", "s0", "ok")] = 7
    metrics.closed.add(3, 4, {"chat": 5})
    copied = metrics.snapshot()
    metrics.request("/v1/chat/completions", 200, 0.2)  # after the copy: not in it
    metrics.calls[("chat", "chat", "s0", "ok")] += 1
    metrics.in_flight += 1
    for name, value in vars(copied).items():
        if name in ("durations", "sessions", "closed", "renders"):
            continue
        original = vars(metrics)[name]
        if name == "requests":
            original = {**original, ("/v1/chat/completions", 200): 1}
        elif name == "calls":
            original = {**original, ("chat", "chat", "s0", "ok"): 7}
        elif name == "in_flight":
            original -= 1
        assert value == original, name
    assert copied.durations["/v1/chat/completions"].counts != metrics.durations[
        "/v1/chat/completions"].counts
    counted = copied.counted()
    assert (counted.written, counted.dropped, counted.suppressed) == (3, 4, {"chat": 5})


async def test_a_scrape_needs_none_of_trios_shared_threads() -> None:
    """Outside review: the scrape's worker thread came from trio's shared pool (40),
    which blocking work also takes (a cache read waiting on a locked SQLite file):
    with it all taken a scrape waited for it, when an operator needs it most."""
    shared = trio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(shared.total_tokens))]
    async with gateway(Reply(tokens=2)) as (server, _):
        for holder in holders:
            shared.acquire_on_behalf_of_nowait(holder)
        try:
            with trio.fail_after(5):
                answer = await http(server, "GET", "/metrics", headers=AUTH)
        finally:
            for holder in holders:
                shared.release_on_behalf_of(holder)
    assert answer.status == 200
    assert "polygate_serve_requests_in_flight 1.0" in answer.body.decode()


async def test_a_call_answered_by_a_fallback_is_counted_with_the_scope_that_answered() -> None:
    """Outside review (names in the metrics): source names are a scope's own, and one
    provider's name in two scopes is the usual case.  A ``chat`` call that fell back to
    ``large`` was counted as ``{scope="chat",source="openai"}``, the very series of a
    call ``chat``'s own "openai" answered."""
    bad, good = FakeUpstream(Reply(status=503)), FakeUpstream(Reply(tokens=2))
    async with bad.serve() as bad_url, good.serve() as good_url:
        settings = polygate.Settings(
            scopes={
                "chat": polygate.Scope(
                    sources=[polygate.Source(name="openai", base_url=bad_url, model="small")],
                    retry=polygate.Retry(max_attempts=1), fallback="large"),
                "large": polygate.Scope(
                    sources=[polygate.Source(name="openai", base_url=good_url, model="big")]),
            },
            serve=polygate.Serve(api_keys=[GATEWAY_KEY]))
        async with open_server(settings, port=0) as server:
            assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 200
            await http(server, "POST", "/v1/chat/completions", {**CHAT, "model": "large"}, AUTH)
            await http(server, "POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, AUTH)
            found = samples((await http(server, "GET", "/metrics", headers=AUTH)).body.decode())
    assert sorted((s.labels["scope"], s.labels["answered_scope"], s.labels["source"], s.labels["result"])
                  for s in found["polygate_serve_calls_total"]) == [
        ("chat", "large", "openai", "ok"), ("large", "large", "openai", "ok")]


@pytest.mark.parametrize("where", ["_parse_body", "_answer_body"])
async def test_running_out_of_memory_is_a_503_that_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """An exhaustion review: a MemoryError (the process's limit, a container's or
    RLIMIT_AS, met by a large body) was answered 500 ``internal_error`` and logged as
    an "unexpected error" with a traceback, as if the gateway had a bug.  It is a 503
    ``out_of_memory`` (another replica, or later, may answer), one warning without a
    traceback, and a call it cut is counted under that result."""
    from polygate.serve import _app

    def out_of_memory(*args: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(_app, where, out_of_memory)
    async with gateway(Reply(tokens=2)) as (server, _):
        refused = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        again = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        answer = await http(server, "GET", "/metrics", headers=AUTH)
    assert (refused.status, again.status) == (503, 503)
    assert refused.json()["error"]["code"] == "out_of_memory"
    found = samples(answer.body.decode())
    assert value(found, "polygate_serve_requests_total", endpoint="/v1/chat/completions",
                 status="503") == 2
    results = [s.labels["result"] for s in found.get("polygate_serve_calls_total", [])]
    assert results == ([] if where == "_parse_body" else ["out_of_memory"])
    if where == "_answer_body":
        assert value(found, "polygate_serve_calls_total", result="out_of_memory") == 2
    messages = [r.getMessage() for r in caplog.records if r.name == "polygate.serve"]
    assert len([m for m in messages if "out of memory" in m]) == 1, messages  # once a minute
    assert not any("unexpected error" in m or "Traceback" in m for m in messages), messages


@pytest.mark.parametrize("tokens", [4, 40_000])
async def test_a_large_answer_is_written_without_a_second_copy(
    monkeypatch: pytest.MonkeyPatch, tokens: int,
) -> None:
    """Outside review (running out of the OS's resources): an answer was written as
    its head joined to its body, a second full-size copy at the peak of its memory.
    Out of memory there (RLIMIT_AS, a 30 MiB answer), the head was already counted as
    begun: the client was cut without a word, the log said "answered 503" and the
    call counted "ok".  A large body leaves after its head, the same object; a small
    one with its head, in one write."""
    from polygate.serve._http import Connection

    writes: list[bytes] = []
    send = Connection._send

    async def recorded(self: Connection, data: bytes) -> None:
        writes.append(data)
        await send(self, data)

    monkeypatch.setattr(Connection, "_send", recorded)
    async with gateway(Reply(tokens=tokens, stream=False)) as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert answer.status == 200
    if tokens == 4:
        assert len(writes) == 1 and writes[0].endswith(answer.body)
    else:
        head, body = writes
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        assert body == answer.body and len(body) > 100_000


async def test_running_out_of_memory_inside_the_call_blames_no_source(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A review of the change above: a MemoryError inside the call (building the
    upstream request from a large body, reading a large answer) was taken for the
    upstream's failure: 502 ``sources_exhausted``, a traceback a try ("unexpected error
    in an exchange"), and each counted against the source's health and breaker.  It is
    this process's exhaustion, as running out of descriptors is: 503 ``out_of_memory``."""
    import httpx

    from polygate.serve import open_server as serving

    from ._serve_kit import settings_for

    class OutOfMemory(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raise MemoryError

    async with serving(settings_for("http://127.0.0.1:9/v1"), port=0,
                       transport=OutOfMemory()) as server:
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        stats = await server._current.session.statistics()  # type: ignore[union-attr]
    assert answer.status == 503 and answer.json()["error"]["code"] == "out_of_memory"
    assert "ran out of memory" in answer.json()["error"]["message"]
    state = next(x.state for x in stats.governance.sources if x.state.scope == "chat")
    assert state.breaker == "closed" and state.consecutive_failures == 0
    assert not any("unexpected error" in r.getMessage() for r in caplog.records)
