"""Behaviours of the gateway server and the response cache that no other test pinned.

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate import _errors as errors
from polygate.serve._errors import reply_for
from polygate.testing import Reply
from tests._serve_kit import AUTH, CHAT, gateway, http

# --------------------------------------------------------------------------- status mapping (SPEC §8.5)


def _exhausted(*errs: errors.UpstreamError, **kw: Any) -> errors.AllSourcesExhausted:
    return errors.AllSourcesExhausted("every source failed", errors=list(errs), **kw)


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    """Mutant E1 (_errors.py: math.ceil -> round): a wait of 1.2 s must say
    Retry-After: 2 (docs: "whole seconds, rounded up"); a client that waits 1 s
    comes back before the source admits it."""
    reply = reply_for(_exhausted(errors.RateLimitedError("slow down", retry_after_s=1.2)))
    headers = dict(reply.headers())
    assert reply.status == 429
    assert headers[b"retry-after"] == b"2"
    assert headers[b"retry-after-ms"] == b"1200"


@pytest.mark.parametrize(("wait_s", "ms"), [(59.9994, b"60000"), (0.0001, b"1"), (2.5, b"2500")])
def test_retry_after_ms_is_rounded_up_too(wait_s: float, ms: bytes) -> None:
    """A key refused 0.6 ms after its one request of the minute waits 59.9994 s: a
    client that obeys ``retry-after-ms: 59999`` to the millisecond (polygate's own
    reads it first) comes back 0.4 ms early and is refused again.  The milliseconds
    are rounded up, as the seconds are."""
    reply = reply_for(_exhausted(errors.RateLimitedError("slow down", retry_after_s=wait_s)))
    assert dict(reply.headers())[b"retry-after-ms"] == ms


def test_retry_after_is_the_earliest_any_source_gave() -> None:
    """Mutant E3 (rate_limited_for: min -> max): when every attempt was a 429,
    Retry-After is the earliest a source asked for (docs/serve.md)."""
    reply = reply_for(_exhausted(
        errors.RateLimitedError("a", source="a", retry_after_s=30),
        errors.RateLimitedError("b", source="b", retry_after_s=4),
    ))
    assert (reply.status, reply.retry_after_s) == (429, 4)


def test_retry_after_is_each_sources_latest_word() -> None:
    """An outside review (2026-12-05): a source's earlier 429 asked for 0.5 s, its
    latest for 100 s; the smallest of all said 0.5, so the client came back 99 s too
    early.  Each source counts by its latest Retry-After, then the earliest of those."""
    reply = reply_for(_exhausted(
        errors.RateLimitedError("a", source="a", retry_after_s=0.5),
        errors.RateLimitedError("b", source="b", retry_after_s=30),
        errors.RateLimitedError("a", source="a", retry_after_s=100),
    ))
    assert (reply.status, reply.retry_after_s) == (429, 30)


async def test_giving_up_after_rate_limit_wait_s_says_when_a_source_frees(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same review: the call gave up after ``rate_limit_wait_s`` with no
    ``retry_after_s``, so the gateway fell back on the errors' first Retry-After,
    measured from when that old 429 came."""
    from polygate.testing import FakeUpstream, Reply, Router

    a = FakeUpstream([
        Reply(status=429, retry_after_s=0.5),  # t=0: waited out
        Reply(status=429, retry_after_s=100, headers_delay_s=0.6),  # t=1.1: cools 100 s
        Reply(),
    ])
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        retry=polygate.Retry(max_attempts=1, rate_limit_wait_s=1))})
    async with polygate.session(settings, transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat([{"role": "user", "content": "hi"}])
    assert info.value.retry_after_s == pytest.approx(100.0 - (trio.current_time() - 1.1))
    assert reply_for(info.value).retry_after_s == info.value.retry_after_s


def test_429s_without_retry_after_still_answer_429_with_a_default_wait() -> None:
    """Mutant E4 (no known Retry-After -> None, i.e. 502): attempts all answered 429
    without a Retry-After are still "every source rate limited": 429, Retry-After 1."""
    reply = reply_for(_exhausted(errors.RateLimitedError("a"), errors.RateLimitedError("b")))
    assert reply.status == 429 and reply.code == "rate_limit_exceeded"
    assert dict(reply.headers())[b"retry-after"] == b"1"


def test_a_429_beside_a_5xx_is_sources_exhausted_not_rate_limited() -> None:
    """Mutant E7 (all -> any RateLimitedError): one source rate limited and another
    failing with a 503 is not "every source rate limited": 502 sources_exhausted."""
    reply = reply_for(_exhausted(
        errors.RateLimitedError("a", source="a", retry_after_s=5),
        errors.TransientUpstreamError("b", source="b", status_code=503),
    ))
    assert (reply.status, reply.code) == (502, "sources_exhausted")
    assert reply.retry_after_s is None


def test_a_stalled_stream_is_504_stream_stalled() -> None:
    """Mutant E6 (the StreamStalled branch dropped: it is an UpstreamError, so 502
    upstream_error): the table of SPEC §8.5 / _errors.py says 504 stream_stalled."""
    reply = reply_for(errors.StreamStalled("silent for 30 s", source="a"))
    assert (reply.status, reply.type, reply.code) == (504, "timeout_error", "stream_stalled")


# --------------------------------------------------------------------------- answers' x-polygate-* headers (SPEC §8.5)



@pytest.mark.integration
async def test_an_embeddings_answer_carries_its_call_statistics_headers() -> None:
    """Mutant A15 (_embeddings sends _stats_headers(call_id, None), the NO_CALL
    figures): JSON answers carry the winning source, the attempts and the hedges of
    the call that made them (SPEC §8.5), embeddings as chat."""
    async with gateway() as (server, _):
        answer = await http(server, "POST", "/v1/embeddings", {"model": "embed", "input": "x"}, AUTH)
    assert answer.status == 200
    assert answer.headers["x-polygate-source"] == "e"
    assert answer.headers["x-polygate-attempts"] == "1"
    assert answer.headers["x-polygate-hedges"] == "0"
    assert answer.headers["x-polygate-cached"] == "false"
    assert answer.headers["x-polygate-call-id"] == answer.headers["x-request-id"] != ""


# --------------------------------------------------------------------------- per-key quotas

ALICE = "sk-gw-alice-0123456789abcdef"
CAROL = "sk-gw-carol-0123456789abcdef"


@pytest.mark.integration
async def test_a_named_key_without_a_quota_is_not_charged_beside_one_with_a_quota() -> None:
    """Mutant A4 (Gateway.limited_key returns the presented key's name whether or not
    it has a limit): a labelled key with no rpm/tpm/max_in_flight has no quota
    (docs/serve.md), and must be served as an unlabelled key, not answered 500."""
    serve = polygate.Serve(keys={
        "alice": polygate.ServeKey(key=ALICE, rpm=5),
        "carol": polygate.ServeKey(key=CAROL),
    })
    async with gateway(serve=serve) as (server, upstream):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT,
                            {"authorization": f"Bearer {CAROL}"})
        assert answer.status == 200, answer.body
        assert server.metrics.key_requests == {}
        assert len(upstream.requests) == 1


@pytest.mark.integration
async def test_a_stream_no_source_admitted_after_a_keep_alive_costs_the_key_nothing() -> None:
    """Mutants A25 and A26 (_chat_stream: ``charge.failed(failure)`` dropped on the failure
    after the head went out): a call no source admitted is voided -- it counts
    neither as a request nor as tokens (docs/serve.md, "What a call costs its key") --
    also when a keep-alive had already committed the stream's head."""
    import attrs

    from polygate.serve import open_server
    from polygate.testing import FakeUpstream, Reply
    from tests._serve_kit import GATEWAY_KEY, settings_for, wait_for

    upstream = FakeUpstream(Reply(first_token_s=3))
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], sse_keepalive_s=0.05, keys={
        "alice": polygate.ServeKey(key=ALICE, rpm=5)})
    async with upstream.serve() as url:
        settings = settings_for(url, serve=serve, call_deadline_s=0.6)
        chat = settings.scopes["chat"]
        source = attrs.evolve(chat.sources[0], max_in_flight=1)
        settings = attrs.evolve(settings, scopes={
            **settings.scopes, "chat": attrs.evolve(chat, sources=[source])})
        async with open_server(settings, port=0) as server, trio.open_nursery() as nursery:
            # An unkeyed call holds the source's one permit (its answer is slow).
            # (A session call of its own, with a deadline longer than the scope's.)
            nursery.start_soon(lambda: server.session.chat(
                CHAT["messages"], scope="chat", call_deadline_s=30))
            await wait_for(lambda: upstream.in_flight == 1)
            answer = await http(server, "POST", "/v1/chat/completions",
                                {**CHAT, "stream": True}, {"authorization": f"Bearer {ALICE}"})
            state = await server.session._runtime.governor.backend.snapshot("@key", "alice")
            results = {result for (*_, result) in server.metrics.calls}
            nursery.cancel_scope.cancel()
    assert answer.status == 200  # committed by a keep-alive, then an error event
    assert b": keep-alive" in answer.body and b'"deadline_exceeded"' in answer.body
    assert len(upstream.requests) == 1  # the keyed call never reached the upstream
    assert state.requests_in_window == 0  # voided: no source admitted it
    assert server.metrics.key_requests == {}
    # Counted in /metrics by what ended it (mutant A26: every committed stream's
    # failure counted as upstream_error).
    assert results == {"deadline_exceeded"}


# --------------------------------------------------------------------------- /readyz while draining


@pytest.mark.integration
async def test_readyz_pipelined_before_a_drain_answers_503_draining() -> None:
    """Mutant A30 (_readyz without its draining check): /readyz answers 503 while the
    server drains (docs/serve.md's endpoint table), so a load balancer takes the
    replica out.  A /readyz pipelined behind a call in flight is answered during the
    drain: it must say draining, not ready."""
    from polygate.testing import Reply
    from tests._serve_kit import read_until_closed, request_bytes, wait_for

    async with gateway(Reply(first_token_s=1.0)) as (server, upstream):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with client:
            await client.send_all(
                request_bytes("POST", "/v1/chat/completions", CHAT, AUTH)
                + request_bytes("GET", "/readyz"))
            async with trio.open_nursery() as nursery:
                await wait_for(lambda: upstream.requests)  # the call waits for its upstream
                nursery.start_soon(server.shutdown, 5)
                rest = await read_until_closed(client, 10)
    answers = rest.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200", b"503"], rest[-600:]
    assert answers[1].endswith(b'{"status":"draining"}')


# --------------------------------------------------------------------------- metrics


def test_a_duration_on_a_bucket_bound_is_counted_in_that_bucket() -> None:
    """Mutant M1 (_Histogram.observe: bisect_left -> bisect_right): Prometheus buckets
    are ``le`` (less than or equal): a request of exactly 5 ms is in le="0.005"."""
    from polygate.serve._metrics import Metrics

    metrics = Metrics()
    metrics.request("/v1/chat/completions", 200, 0.005)
    cumulative = dict(metrics.durations["/v1/chat/completions"].cumulative())
    assert cumulative["0.0025"] == 0
    assert cumulative["0.005"] == 1


@pytest.mark.integration
async def test_calls_cached_counts_only_the_cache_answers() -> None:
    """Mutant M2 (Metrics.call counts every call with statistics as cached):
    polygate_serve_calls_cached_total{scope} counts the calls answered from the
    cache (docs/serve.md, Metrics), not the misses that went upstream."""
    import attrs

    from polygate.serve import open_server
    from polygate.testing import FakeUpstream, Reply
    from tests._serve_kit import settings_for

    upstream = FakeUpstream(Reply(tokens=3))
    async with upstream.serve() as url:
        settings = attrs.evolve(settings_for(url, cache_ttl_s=60), cache="memory")
        async with open_server(settings, port=0) as server:
            first = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
            hit = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
            metrics = (await http(server, "GET", "/metrics", headers=AUTH)).body.decode()
    assert (first.headers["x-polygate-cached"], hit.headers["x-polygate-cached"]) == ("false", "true")
    assert len(upstream.requests) == 1
    assert 'polygate_serve_calls_cached_total{scope="chat"} 1.0' in metrics
    assert 'polygate_serve_call_attempts_total{scope="chat"} 1.0' in metrics


# --------------------------------------------------------------------------- coalescing


async def test_an_embed_waiter_served_by_a_flight_counts_as_coalesced(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutant C1 (Coalescer.settle: "only the first settlement counts" dropped): the
    embed leader settles each flight with its vector, then (its ``finally``) abandons
    whatever was not shared -- which, unguarded, overwrote the answer: the waiter woke
    to an abandoned flight, led again and was served from the store (a hit, not
    coalesced; on a backend without a local look, a second upstream call)."""
    from polygate.testing import FakeUpstream, Reply, Router

    settings = polygate.Settings(scopes={"embed": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", model="emb")],
        cache_ttl_s=600)}, cache="memory")
    up = FakeUpstream(Reply(first_token_s=2.0))
    out: dict[str, polygate.EmbeddingResponse] = {}
    async with polygate.session(settings, transport=Router({"a": up})) as s:

        async def one(name: str, inputs: list[str], delay: float) -> None:
            await trio.sleep(delay)
            out[name] = await s.embed(inputs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first", ["x", "y"], 0.0)
            nursery.start_soon(one, "second", ["y"], 0.5)
        stats = (await s.statistics()).cache
    assert len(up.requests) == 1
    assert (stats.misses, stats.coalesced, stats.hits) == (2, 1, 0)
    assert out["second"].call_stats.cached and out["second"].vectors == out["first"].vectors[1:]


async def test_a_replayed_hit_longer_than_the_stream_buffer_loses_no_chunk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutant Q27 (the replay offers each chunk without waiting for a consumer that
    is behind): a stored answer replays as more chunks than the stream's buffer holds
    (32) -- here 40 choices; a caller that reads slowly must still get every one."""
    from polygate.testing import FakeUpstream, Reply, Router

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], cache_ttl_s=60)},
        cache="memory")
    up = FakeUpstream(Reply(tokens=2))
    messages = [{"role": "user", "content": "hi"}]
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        first = await s.chat(messages, n=40)
        async with s.stream_chat(messages, n=40) as stream:
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                await trio.sleep(0.01)  # a slow reader (MockClock: no real time)
    assert len(up.requests) == 1
    assert stream.response is not None and stream.response.call_stats.cached
    contents: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.raw["choices"]:
            contents[choice["index"]] = contents.get(choice["index"], "") + (
                choice["delta"].get("content") or "")
    assert len(first.choices) == 40
    assert contents == {c["index"]: c["message"]["content"] for c in first.choices}


# --------------------------------------------------------------------------- the usage a resumed stream reports


def test_a_resumed_streams_usage_is_reported_even_when_its_last_segments_is_refused() -> None:
    """Mutant S8 (reported_usage without ``call_stats.resumes or``): a resumed
    stream's usage covers every segment, estimated where a cut segment reported none;
    its raw body is the last segment's, whose own usage the library may have refused.
    The answer still reports the call's usage (the branch's stated rule), not none."""
    from polygate.serve._sse import reported_usage

    usage = polygate.Usage(12, 30, 42, "estimated")
    response = polygate.ChatResponse(
        text="x", message={"role": "assistant", "content": "x"},
        choices=[{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
        usage=usage, source="b", model="m", finish_reason="stop",
        call_stats=polygate.CallStats(logical_call_id="c", resumes=1),
        raw={"id": "two", "choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": 5}},
    )
    assert reported_usage(response) == {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}


@pytest.mark.integration
async def test_a_resumed_stream_without_usage_costs_its_key_at_least_a_token_a_chunk() -> None:
    """Mutant A17 (_Charge.answered without its floor: an estimated usage stands as
    it is): a stream pays "an estimate when the upstream reported none: never below
    the prompt's estimate plus one token per text chunk forwarded" (docs/serve.md).
    A resumed stream's estimate counts what each segment showed at ~4 characters a
    token, well under one a chunk when chunks are short words."""
    import random

    from polygate._resume import CONTINUE_PROMPT
    from polygate.testing import FakeUpstream, Reply

    pick = random.Random(7)
    first = " ".join(pick.choice("abcdefghijklm") for _ in range(100))
    rest = " " + " ".join(pick.choice("nopqrstuvwxyz") for _ in range(400))

    def cut_then_continued(request: Any, rng: Any) -> Reply:
        if request.body["messages"][-1]["content"] == CONTINUE_PROMPT:
            return Reply(text=rest, usage=False)
        return Reply(text=first, fault="truncated", fault_after=50, usage=False)

    serve = polygate.Serve(keys={"alice": polygate.ServeKey(key=ALICE, tpm=100_000)})
    async with gateway(FakeUpstream(cut_then_continued), sources=2, serve=serve,
                       stream=polygate.StreamWatch(resume=True)) as (server, upstream):
        answer = await http(server, "POST", "/v1/chat/completions", {**CHAT, "stream": True},
                            {"authorization": f"Bearer {ALICE}"})
        state = await server.session._runtime.governor.backend.snapshot("@key", "alice")
    assert answer.status == 200 and len(upstream.requests) == 2
    chunks = answer.body.count(b'"content":"')
    assert chunks >= 400
    assert state.tokens_in_window >= chunks  # (and the prompt's estimate)


@pytest.mark.integration
async def test_metrics_count_every_attempt_of_a_call() -> None:
    """Mutant X8 (Metrics.call adds 1 a call to polygate_serve_call_attempts_total,
    not the call's attempts): a call retried once after a 503 made two attempts."""
    from polygate.testing import FakeUpstream, Reply

    def flaky(request: Any, rng: Any) -> Reply:
        return Reply(status=503) if request.index == 0 else Reply(tokens=2)

    async with gateway(FakeUpstream(flaky), sources=2) as (server, upstream):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        metrics = (await http(server, "GET", "/metrics", headers=AUTH)).body.decode()
    assert answer.status == 200 and answer.headers["x-polygate-attempts"] == "2"
    assert len(upstream.requests) == 2
    assert 'polygate_serve_call_attempts_total{scope="chat"} 2.0' in metrics


@pytest.mark.integration
async def test_an_embeddings_answer_names_the_model_the_upstream_answered_with() -> None:
    """Mutant X10 (the embeddings answer's ``model`` is always the request's): the
    request's model names a scope (or an alias); the answer says the model that
    made the vectors, as the chat answer (the upstream's body) does."""
    async with gateway() as (server, _):
        answer = await http(server, "POST", "/v1/embeddings", {"model": "embed", "input": "x"}, AUTH)
        chat = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert answer.status == 200
    assert answer.json()["model"] == "emb"
    assert chat.json()["model"] == "m1"


@pytest.mark.integration
async def test_unknown_urls_share_one_endpoint_label() -> None:
    """Mutant X14 (endpoint_label returns an unknown path as it came): a label per URL
    a scanner tries would grow /metrics without bound; every unknown URL is counted
    under endpoint="other"."""
    async with gateway() as (server, _):
        for n in range(3):
            assert (await http(server, "GET", f"/wp-admin/{n}.php", headers=AUTH)).status == 404
        metrics = (await http(server, "GET", "/metrics", headers=AUTH)).body.decode()
    assert 'polygate_serve_requests_total{endpoint="other",status="404"} 3.0' in metrics
    assert "wp-admin" not in metrics


# --------------------------------------------------------------------------- more, from a second round of mutants


def test_retry_after_ms_is_never_zero() -> None:
    """Mutant (ErrorReply.headers: max(1, round(ms)) -> round(ms)): a source that
    answered 429 with 'Retry-After: 0' gives the 429 a wait of 0; retry-after-ms
    must still say at least 1 (as Retry-After says at least 1 s)."""
    reply = reply_for(_exhausted(errors.RateLimitedError("slow down", retry_after_s=0.0)))
    headers = dict(reply.headers())
    assert reply.status == 429
    assert headers[b"retry-after"] == b"1"
    assert headers[b"retry-after-ms"] == b"1"


def test_deadline_exceeded_is_a_timeout_error() -> None:
    """Mutant (reply_for: DeadlineExceeded's type timeout_error -> api_error): the
    table of polygate/serve/_errors.py gives a passed call deadline type
    'timeout_error' (as a stalled stream), code 'deadline_exceeded', status 504."""
    reply = reply_for(errors.DeadlineExceeded("the call's deadline passed"))
    assert (reply.status, reply.type, reply.code) == (504, "timeout_error", "deadline_exceeded")


def test_out_of_memory_only_when_every_attempt_ran_out_of_memory() -> None:
    """Mutant (reply_for: all(... == "memory") -> any(...)): one attempt that this
    process could not hold in memory beside one the upstream failed (a 500) is the
    sources' exhaustion, 502 sources_exhausted -- not 503 out_of_memory, which tells
    the client that the gateway, not the upstream, is at fault."""
    oom = errors.TransientUpstreamError("out of memory", source="a")
    oom.exhausted = "memory"
    upstream = errors.TransientUpstreamError("upstream said 500", source="b", status_code=500)
    reply = reply_for(_exhausted(oom, upstream))
    assert (reply.status, reply.code) == (502, "sources_exhausted")
    only_oom = reply_for(_exhausted(oom))
    assert (only_oom.status, only_oom.code) == (503, "out_of_memory")


def test_a_plain_polygate_error_is_503_unavailable() -> None:
    """Mutant (reply_for: the PolygateError fallback 503 -> 500): an error of
    polygate's that is no upstream's nor the request's (a session closed under the
    call, say) is 'unavailable', not the 500 of a bug in the gateway."""
    reply = reply_for(polygate.PolygateError("this session is closed"))
    assert (reply.status, reply.type, reply.code) == (503, "api_error", "unavailable")


async def test_embeddings_without_upstream_usage_carry_none() -> None:
    """Mutant (_embeddings: usage written whatever its source): an upstream that
    reported no usage gets the library's estimate for its own accounting; the
    answer must not pass that estimate off as a count (as for chat)."""
    from polygate.testing import Reply

    async with gateway(Reply(usage=False)) as (server, _):
        answer = await http(server, "POST", "/v1/embeddings",
                            {"model": "embed", "input": ["one", "two"]}, AUTH)
        assert answer.status == 200, answer.body
        assert "usage" not in answer.json()
    async with gateway(Reply()) as (server, _):  # (reported: relayed)
        answer = await http(server, "POST", "/v1/embeddings",
                            {"model": "embed", "input": ["one", "two"]}, AUTH)
        assert "usage" in answer.json()


async def test_a_missing_model_is_said_so() -> None:
    """Mutant (_route: the 'model is None' branch dropped): a body without a model
    must say 'you must provide a model parameter' (OpenAI's words), not 'model must
    be a string, not an object' -- the client sent no object."""
    async with gateway() as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]}, AUTH)
    error = answer.json()["error"]
    assert (answer.status, error["code"], error["param"]) == (400, "invalid_request", "model")
    assert error["message"] == "you must provide a model parameter"


async def test_a_null_finish_reason_reads_stop_in_a_json_answer() -> None:
    """Mutant (_answer_body: 'not c.get("finish_reason")' -> '"finish_reason" not
    in c'): an upstream's complete answer whose finish_reason is null (some servers
    send it) is relayed as 'stop', as the stream's finish chunk says (docstring of
    _answer_body: "a missing or unreadable reason 'stop'")."""
    from polygate.testing import Reply

    async with gateway(Reply(finish_reason=None, stream=False)) as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert answer.status == 200, answer.body
    assert answer.json()["choices"][0]["finish_reason"] == "stop"


async def test_readyz_says_draining_during_a_drain() -> None:
    """Mutant (_readyz: the draining check dropped): a /readyz that reaches the
    server while it drains (here: its head begun before the drain, finished during
    it) must be 503 draining, so that a load balancer stops sending to it."""
    from tests._serve_kit import read_answer, wait_for

    async with gateway() as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream, trio.open_nursery() as nursery:
            await stream.send_all(b"GET /readyz HTTP/1.1\r\nhost: gateway\r\n")
            await wait_for(lambda: server.statistics().in_flight == 1)
            nursery.start_soon(server.shutdown, 10.0)
            await wait_for(lambda: server.draining)
            await stream.send_all(b"\r\n")
            answer = await read_answer(stream)
        assert (answer.status, answer.json()) == (503, {"status": "draining"})


async def test_metrics_label_a_model_lookup_as_one_endpoint() -> None:
    """Mutant (endpoint_label: '/v1/models/{model}' -> 'other'): GET
    /v1/models/NAME counts under endpoint '/v1/models/{model}' (one label for every
    name: no cardinality blow-up, yet told apart from unknown URLs)."""
    async with gateway() as (server, _):
        assert (await http(server, "GET", "/v1/models/gpt-4o", None, AUTH)).status == 200
        text = (await http(server, "GET", "/metrics", None, AUTH)).body.decode()
    assert 'polygate_serve_requests_total{endpoint="/v1/models/{model}",status="200"} 1.0' in text


async def test_an_unknown_models_name_is_cut_in_the_message() -> None:
    """Mutant (_unknown_model: shown[:200] -> shown): a long unknown model name is
    echoed at most 200 characters (a 1 MiB name is not written back)."""
    async with gateway() as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions",
                            {"model": "x" * 5000, "messages": [{"role": "user", "content": "hi"}]}, AUTH)
    assert answer.status == 404
    assert "x" * 201 not in answer.json()["error"]["message"]


# --------------------------------------------------------------------------- a third round


async def test_a_stream_whose_head_goes_out_during_a_drain_says_close() -> None:
    """Mutant (_chat_stream's head: close=ctx.draining -> close=False): a stream
    whose first chunk (and so its head) goes out while the server drains is the
    connection's last answer, so its head must say 'connection: close' -- as every
    other answer during a drain does (Context.draining) -- or the client reuses a
    connection the server is about to close."""
    from tests._serve_kit import AUTH, CHAT, gateway, read_answer, request_bytes, wait_for

    async with gateway(Reply(first_token_s=1.0)) as (server, _):
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream, trio.open_nursery() as nursery:
            await stream.send_all(request_bytes("POST", "/v1/chat/completions",
                                                {**CHAT, "stream": True}, AUTH))
            await wait_for(lambda: server.statistics().in_flight == 1)
            nursery.start_soon(server.shutdown, 10.0)
            await wait_for(lambda: server.draining)
            answer = await read_answer(stream)
        assert answer.status == 200
        assert b"[DONE]" in answer.body
        assert answer.headers.get("connection") == "close", answer.headers


async def test_stream_null_is_no_stream() -> None:
    """Mutant (_chat: 'stream is not None and type(stream) is not bool' -> 'type(stream)
    is not bool'): OpenAI reads "stream": null as its default (false), as clients that
    serialise every optional field send it: a JSON answer, not a 400."""
    from tests._serve_kit import AUTH, CHAT, gateway, http

    async with gateway() as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions", {**CHAT, "stream": None}, AUTH)
    assert answer.status == 200, answer.body
    assert answer.json()["object"] == "chat.completion"


async def test_include_usage_null_is_its_default() -> None:
    """Mutant (_chat: 'usage is not None and type(usage) is not bool' -> 'type(usage)
    is not bool'): stream_options.include_usage null is the default (no usage chunk),
    not a 400."""
    from tests._serve_kit import AUTH, CHAT, gateway, http

    async with gateway() as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions",
                            {**CHAT, "stream": True, "stream_options": {"include_usage": None}}, AUTH)
    assert answer.status == 200, answer.body
    import json

    events = [line[6:] for line in answer.body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e).get("usage") is None for e in events[:-1])  # no usage chunk


async def test_a_chunked_body_of_exactly_max_request_bytes_is_taken() -> None:
    """Mutant (_read_body: len(body) > max_request_bytes -> >=): a chunked body of
    exactly max_request_bytes is taken, as one with a Content-Length of that size is
    (docs/serve.md: a body *over* it is 413); one byte more is refused."""
    import json

    import polygate
    from tests._serve_kit import CHAT, GATEWAY_KEY, gateway, read_answer

    def chat_of_length(n: int) -> bytes:
        base = json.dumps({**CHAT, "pad": ""}).encode()
        return json.dumps({**CHAT, "pad": "x" * (n - len(base))}).encode()

    async def post_chunked(port: int, body: bytes) -> int:
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ntransfer-encoding: chunked\r\n"
                b"authorization: Bearer %s\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                % (GATEWAY_KEY.encode(), len(body), body))
            return (await read_answer(stream)).status

    serve = polygate.Serve(api_keys=[GATEWAY_KEY], max_request_bytes=1000)
    async with gateway(Reply(tokens=2), serve=serve) as (server, upstream):
        assert await post_chunked(server.port, chat_of_length(1000)) == 200
        assert await post_chunked(server.port, chat_of_length(1001)) == 413
    assert len(upstream.requests) == 1


async def test_the_connection_limits_503_says_retry_after_1() -> None:
    """Mutant (Server._refuse: the 'retry-after: 1' line dropped): docs/serve.md's
    status table gives the max_connections refusal 'Retry-After: 1, then the connection
    is closed'."""
    import polygate
    from tests._serve_kit import GATEWAY_KEY, gateway, read_until_closed, wait_for

    serve = polygate.Serve(api_keys=[GATEWAY_KEY], max_connections=1)
    async with gateway(serve=serve) as (server, _):
        held = await trio.open_tcp_stream("127.0.0.1", server.port)  # sends nothing: not idle
        await wait_for(lambda: server.statistics().connections == 1)
        extra = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with extra:
            data = await read_until_closed(extra)
        await held.aclose()
    head = data.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")
    assert head[0].startswith(b"http/1.1 503") and b"too_many_connections" in data
    assert b"retry-after: 1" in head
    assert b"connection: close" in head


# ----------------------------------------------------------------------- NaN in a stream

_NAN_CHUNK = (b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"a"},'
              b'"logprobs":{"x":NaN}}]}')
_OK_CHUNK = b'{"id":"x","model":"m","choices":[{"index":0,"delta":{"content":"b"}}]}'


async def _stream_through(sse: bytes, serve: object | None = None, key: str | None = None,
                          times: int = 1) -> list[object]:
    """POST a streamed chat ``times`` to a gateway whose one streaming source answers
    ``sse`` (raw bytes); the answers (tests._serve_kit.Answer)."""
    import polygate
    from polygate.serve import open_server
    from tests._raw_server import raw_server
    from tests._serve_kit import GATEWAY_KEY, http
    from tests.test_serve_hostile import _sse

    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(_sse(*sse))

    async with raw_server(reply) as upstream:
        source = polygate.Source(name="sse", base_url=f"http://127.0.0.1:{upstream.port}/sse/v1",
                                 model="chat", streaming=True)
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[source], retry=polygate.Retry(max_attempts=1))},
            serve=serve or polygate.Serve(api_keys=[GATEWAY_KEY]),
        )
        async with open_server(settings, port=0) as gw:
            headers = {"authorization": f"Bearer {key or GATEWAY_KEY}"}
            body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            return [await http(gw, "POST", "/v1/chat/completions", body, headers) for _ in range(times)]


async def test_a_nan_in_the_first_chunk_is_a_plain_502() -> None:
    """Mutant (_chat_stream: 'if not frames: break' dropped): a stream whose very
    first chunk cannot be written as JSON has sent nothing yet, so it fails as any
    call before its head does -- a plain HTTP 502 upstream_error ('until then a
    failure is a plain HTTP error with its status') -- not a 200 whose body is only an
    error event."""
    from tests.test_serve_hostile import _strict

    answer, = await _stream_through((_NAN_CHUNK, _OK_CHUNK))
    assert answer.status == 502, answer.body
    assert _strict(answer.body)["error"]["code"] == "upstream_error"


async def test_a_stream_cut_by_a_nan_still_counts_against_its_key() -> None:
    """Mutant (_Charge.failed: the Unencodable early return dropped): a stream that
    ended with an error event because a chunk held a NaN had reached the upstream (which
    did the work): docs/serve.md 'an error after attempts' -- the estimate stands, the
    request counts against the key's rpm.  On the mutant it is voided (the Unencodable
    carries no call_stats): a key with rpm 1 got a second request in."""
    import polygate
    from tests._serve_kit import GATEWAY_KEY

    alice = "sk-gw-alice-0123456789abcdef"
    serve = polygate.Serve(api_keys=[GATEWAY_KEY],
                           keys={"alice": polygate.ServeKey(key=alice, rpm=1)})
    first, second = await _stream_through((_OK_CHUNK, _NAN_CHUNK), serve, alice, times=2)
    assert first.status == 200 and b'"upstream_error"' in first.body, first.body
    assert second.status == 429, second.body


async def test_a_percent_encoded_model_name_is_looked_up_decoded() -> None:
    """Mutant (_route: urllib.parse.unquote dropped from /v1/models/{model}): a
    client that percent-encodes the path segment (an alias with a '/' or a ':', as
    an SDK that quotes path parameters sends it) gets the model, named as configured."""
    import polygate
    from tests._serve_kit import AUTH, GATEWAY_KEY, gateway, http

    serve = polygate.Serve(api_keys=[GATEWAY_KEY], models={"meta-llama/Llama-3:8b": "chat"})
    async with gateway(serve=serve) as (server, _):
        answer = await http(server, "GET", "/v1/models/meta-llama%2FLlama-3%3A8b", None, AUTH)
    assert answer.status == 200, answer.body
    assert answer.json()["id"] == "meta-llama/Llama-3:8b"


async def test_a_failure_after_a_streams_head_closes_its_connection(monkeypatch) -> None:
    """Mutant (_unavailable: 'ctx.conn.client_gone = True  # close it' dropped): a
    500 or out-of-memory 503 that comes after a stream's head went out cannot be
    answered; its docstring: 'otherwise the connection cannot be trusted' -- it must
    close, so the client sees the cut.  On the mutant the connection stays open with a
    chunked body never ended: the client waits (here past 5 s) for the rest."""
    from polygate.serve import _app
    from tests._serve_kit import AUTH, CHAT, gateway, read_until_closed, request_bytes

    real = _app.StreamShape.chunk
    calls = []

    def chunk(self, c):  # the second chunk meets the process's memory limit
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError
        return real(self, c)

    monkeypatch.setattr(_app.StreamShape, "chunk", chunk)
    async with gateway(Reply(tokens=4, inter_token_s=0.2)) as (server, _):
        async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
            await stream.send_all(request_bytes("POST", "/v1/chat/completions",
                                                {**CHAT, "stream": True}, AUTH))
            data = await read_until_closed(stream, limit_s=5)
    assert data.startswith(b"HTTP/1.1 200"), data
    assert b"[DONE]" not in data


async def test_a_client_gone_before_the_cuts_503_is_a_disconnect() -> None:
    """Mutant (Server._told_cut: 'self.metrics.disconnects += 1' dropped beside
    status 499): a request still arriving at the end of a drain's grace whose client
    is gone by the time the 503 is written counts as a 499 and as a disconnect, as
    every other 499 does (a client that left mid-head, mid-body, mid-call).  White-box:
    the write's ClientGone is hard to time from outside."""
    import time

    from polygate.serve._http import ClientGone
    from tests._serve_kit import gateway

    class Gone:
        async def send_response(self, *args: object, **kwargs: object) -> None:
            raise ClientGone

    async with gateway() as (server, _):
        await server._told_cut(Gone(), "/v1/chat/completions", time.monotonic())
        assert server.metrics.requests.get(("/v1/chat/completions", 499)) == 1
        assert server.metrics.disconnects == 1
