"""Per-key quotas in ``polygate serve``: a labelled gateway key's RPM, TPM and
in-flight bound, held in the session's governance backend (so replicas on one Redis
share them), charged with what the call really cost, and returned whatever ends the
call -- an answer, an error, or a client that left.  Loopback FakeUpstream, real clock;
the two-replica test runs a real redis-server."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import polygate
from polygate._config_load import describe, settings_from_env, settings_from_toml
from polygate._key_quota import KEY_SCOPE
from polygate.serve import Server, open_server
from polygate.testing import FakeUpstream, Reply

from ._redis_server import RedisServer, redis_server  # noqa: F401 - fixture
from ._serve_kit import (
    AUTH,
    CHAT,
    GATEWAY_KEY,
    gateway,
    http,
    request_bytes,
    settings_for,
    two_replicas_alternately,
    wait_for,
)

pytestmark = pytest.mark.integration

ALICE = "sk-gw-alice-0123456789abcdef"
BOB = "sk-gw-bob-0123456789abcdef"
URL = "http://127.0.0.1:8001/v1"
CALL = "/v1/chat/completions"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def keyed(**alice: Any) -> polygate.Serve:
    return polygate.Serve(api_keys=[GATEWAY_KEY], keys={
        "alice": polygate.ServeKey(key=ALICE, **alice),
        "bob": polygate.ServeKey(key=BOB, rpm=100),
    })


async def key_state(server: Server, name: str) -> Any:
    backend = server.session._runtime.governor.backend
    return await backend.snapshot(KEY_SCOPE, name)


# --------------------------------------------------------------------------- configuration


def test_env_and_toml_agree_and_never_show_the_key(tmp_path: Path) -> None:
    env = settings_from_env({
        "POLYGATE__CHAT__A__BASE_URL": URL,
        "POLYGATE__SERVE__KEYS__ALICE__KEY": ALICE,
        "POLYGATE__SERVE__KEYS__ALICE__RPM": "60",
        "POLYGATE__SERVE__KEYS__ALICE__MAX_IN_FLIGHT": "2",
    })
    path = tmp_path / "p.toml"
    path.write_text(
        '[serve.keys.alice]\nkey_env = "ALICE_KEY"\nrpm = 60\nmax_in_flight = 2\n'
        f'[scopes.chat.sources.a]\nbase_url = "{URL}"\n'
    )
    toml = settings_from_toml(path, env={"ALICE_KEY": ALICE})
    assert toml.serve == env.serve
    assert env.serve.keys["alice"] == polygate.ServeKey(key=ALICE, rpm=60, max_in_flight=2)
    assert env.serve.authenticated
    shown = repr(env.serve) + json.dumps(describe(env))
    assert ALICE not in shown
    assert describe(env)["serve"]["keys"]["alice"] == {
        "key": "***", "rpm": 60, "tpm": None, "max_in_flight": 2, "models": []}
    assert ALICE in env.secrets()  # redacted from upstream text like any secret


@pytest.mark.parametrize(("serve", "where"), [
    (f'[serve.keys.alice]\nkey = "{ALICE}"\nrpm = 0\n', "serve.keys.alice.rpm"),
    (f'[serve.keys.alice]\nkey = "{ALICE}"\ntpm = "many"\n', "serve.keys.alice.tpm"),
    ('[serve.keys.alice]\nrpm = 3\n', "serve.keys.alice.key"),
    (f'[serve.keys.alice]\nkey = "{ALICE} x"\n', "serve.keys.alice.key"),
    (f'[serve.keys.alice]\nkey = "{ALICE}"\nrpx = 3\n', "serve.keys.alice.rpx"),
    (f'[serve.keys."a:b"]\nkey = "{ALICE}"\n', "serve.keys"),
    (f'[serve]\napi_keys = ["{ALICE}"]\n[serve.keys.a]\nkey = "{ALICE}"\n', "serve.keys"),
    (f'[serve.keys.a]\nkey = "{ALICE}"\n[serve.keys.b]\nkey = "{ALICE}"\n', "serve.keys"),
    ('[serve.keys.alice]\nkey_env = "NOPE"\n', "serve.keys.alice.key_env"),
])
def test_bad_keys_name_their_path_and_hide_the_key(tmp_path: Path, serve: str, where: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(f'{serve}[scopes.chat.sources.a]\nbase_url = "{URL}"\n')
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_toml(path, env={})
    message = str(info.value)
    assert message.startswith(f"{path}: {where}"), message
    assert ALICE not in message


@pytest.mark.parametrize("extra", [
    {"POLYGATE__SERVE__KEYS__ALICE__RPM": "5"},  # no key
    {"POLYGATE__SERVE__KEYS__ALICE__KEY": ALICE, "POLYGATE__SERVE__KEYS__ALICE__RPX": "1"},
    {"POLYGATE__SERVE__KEYS__ALICE": ALICE},
])
def test_bad_env_keys_name_the_variable(extra: dict[str, str]) -> None:
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": URL, **extra})
    assert str(info.value).startswith("POLYGATE__SERVE__KEYS__ALICE")
    assert ALICE not in str(info.value)


async def test_labelled_keys_alone_allow_a_public_address() -> None:
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url=URL)])},
        serve=polygate.Serve(keys={"alice": polygate.ServeKey(key=ALICE)}),
    )
    from polygate.serve._server import check_exposure

    check_exposure(settings, "0.0.0.0")  # keys are configured: no ConfigError
    with pytest.raises(polygate.ConfigError):
        check_exposure(polygate.Settings(scopes=settings.scopes), "0.0.0.0")


async def test_a_key_is_hashed_once_a_request_and_checked_again_after_a_reload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The server checks the key from the head, before it reads a body; the answer
    # does not check it again -- unless a reload changed the keys in between.
    import attrs

    from polygate.serve import _app

    from ._serve_kit import read_answer

    hashed: list[str] = []
    digest = _app._digest

    def counted(key: str) -> bytes:
        hashed.append(key)
        return digest(key)

    monkeypatch.setattr(_app, "_digest", counted)
    async with gateway() as (server, _):
        hashed.clear()
        assert (await http(server, "POST", CALL, CHAT, AUTH)).status == 200
        assert len(hashed) == 1

        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            head, _, body = request_bytes("POST", CALL, CHAT, AUTH).partition(b"\r\n\r\n")
            await stream.send_all(head + b"\r\n\r\n")
            await wait_for(lambda: len(hashed) == 2)  # admitted at its head
            other = polygate.Serve(api_keys=["sk-gw-other-0123456789"], models={"gpt-4o": "chat"})
            await server.reload(attrs.evolve(server.settings, serve=other))
            await stream.send_all(body)
            answer = await read_answer(stream)
        assert answer.status == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"


# --------------------------------------------------------------------------- the limits


async def test_a_keys_rpm_refuses_it_alone_and_at_the_wire() -> None:
    async with gateway(Reply(tokens=2), serve=keyed(rpm=2)) as (server, upstream):
        alice = [await http(server, "POST", CALL, CHAT, bearer(ALICE)) for _ in range(3)]
        bob = await http(server, "POST", CALL, CHAT, bearer(BOB))
        plain = await http(server, "POST", CALL, CHAT, AUTH)
        metrics = (await http(server, "GET", "/metrics", headers=AUTH)).body.decode()
    assert [a.status for a in alice] == [200, 200, 429]
    refused = alice[2]
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "'alice'" in error["message"] and "rpm" in error["message"]
    assert ALICE not in refused.body.decode()
    assert 50 <= int(refused.headers["retry-after"]) <= 60
    assert (bob.status, plain.status) == (200, 200)  # other keys keep their own quota
    assert len(upstream.requests) == 4  # the refused call never reached a source
    assert 'polygate_serve_key_refusals_total{key="alice",reason="rpm"} 1.0' in metrics
    assert 'polygate_serve_key_requests_total{key="alice"} 2.0' in metrics
    assert ALICE not in metrics and BOB not in metrics


async def test_a_voided_request_is_not_counted_as_charged() -> None:
    """Probe finding (third round): requests the quota voided (answered 400 before any
    upstream work) counted in polygate_serve_key_requests_total, which then disagreed
    with the quota: 5 counted where the key was charged 2."""
    bad = {**CHAT, "messages": []}
    async with gateway(Reply(tokens=2), serve=keyed(rpm=2)) as (server, _):
        statuses = [(await http(server, "POST", CALL, body, bearer(ALICE))).status
                    for body in (bad, bad, bad, CHAT, CHAT, CHAT)]
        metrics = (await http(server, "GET", "/metrics", headers=AUTH)).body.decode()
    assert statuses == [400, 400, 400, 200, 200, 429]
    assert 'polygate_serve_key_requests_total{key="alice"} 2.0' in metrics


async def test_a_key_pays_the_answers_usage_not_its_estimate() -> None:
    async with gateway(Reply(tokens=5), serve=keyed(tpm=10_000)) as (server, _):
        answer = await http(server, "POST", CALL, {**CHAT, "max_tokens": 900}, bearer(ALICE))
        streamed = await http(server, "POST", CALL, {**CHAT, "stream": True}, bearer(ALICE))
        state = await key_state(server, "alice")
    assert (answer.status, streamed.status) == (200, 200)
    used = answer.json()["usage"]["total_tokens"]
    assert used < 900  # the estimate reserved the 900-token budget; the usage replaced it
    assert state.tokens_in_window == 2 * used
    assert (state.in_flight, state.tokens_reserved, state.requests_in_window) == (0, 0, 2)


async def test_a_client_that_leaves_a_long_stream_pays_what_it_was_shown() -> None:
    """Review: a keyed stream whose client left near the end of a 2,000-token answer
    paid only the call's estimate (the prompt and a 256-token budget): a key with
    ``tpm = 1000`` read 6,000 tokens in a minute without one refusal."""
    upstream = FakeUpstream(Reply(tokens=2000, stall_at=2000, stall_s=30))
    async with gateway(upstream, serve=keyed(tpm=1000)) as (server, _):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        await client.send_all(request_bytes("POST", CALL, {**CHAT, "stream": True}, bearer(ALICE)))
        got = b""
        with trio.fail_after(20):
            while got.count(b'"content"') < 2001:  # the role chunk, then 2,000 tokens
                data = await client.receive_some(1 << 16)
                assert data
                got += data
        await client.aclose()
        await wait_for(lambda: server.statistics().in_flight == 0 and upstream.in_flight == 0)
        key = await key_state(server, "alice")
        refused = await http(server, "POST", CALL, {**CHAT, "stream": True}, bearer(ALICE))
    assert key.tokens_in_window >= 2000
    assert refused.status == 429


async def test_a_key_pays_at_least_what_a_stream_without_usage_forwarded() -> None:
    """The same floor for a stream read to its end whose upstream reported no usage:
    the key paid the estimate (the prompt and a 256-token budget) for 2,000 tokens."""
    upstream = FakeUpstream(Reply(tokens=2000, usage=False))
    async with gateway(upstream, serve=keyed(tpm=100_000)) as (server, _):
        answer = await http(server, "POST", CALL, {**CHAT, "stream": True}, bearer(ALICE))
        key = await key_state(server, "alice")
    assert answer.status == 200 and answer.body.count(b'"content"') >= 2000
    assert key.tokens_in_window >= 2000


async def test_a_tpm_refusal_behind_open_reservations_does_not_say_a_minute() -> None:
    """Review: a key's window full only of reservations (calls in flight, settled down
    to their usage when they end) was refused with ``Retry-After: 60`` -- when it
    frees at the latest -- though the tokens came back half a second later.  The
    SDKs obey up to 60 s: the client slept a minute for nothing."""
    upstream = FakeUpstream(Reply(tokens=2, first_token_s=0.5))
    async with gateway(upstream, serve=keyed(tpm=600)) as (server, _):
        answers = []

        async def one() -> None:
            answers.append(await http(server, "POST", CALL, CHAT, bearer(ALICE)))

        async with trio.open_nursery() as nursery:  # each reserves 264 of the 600
            for _ in range(3):
                nursery.start_soon(one)
        right_after = await http(server, "POST", CALL, CHAT, bearer(ALICE))
    [refused] = [a for a in answers if a.status == 429]
    assert right_after.status == 200  # the two calls paid their usage: a few tokens
    assert refused.headers["retry-after"] == "1"


async def test_a_request_over_the_keys_whole_tpm_is_refused_without_retry_after() -> None:
    async with gateway(Reply(tokens=2), serve=keyed(tpm=100)) as (server, upstream):
        answer = await http(server, "POST", CALL, {**CHAT, "max_tokens": 500}, bearer(ALICE))
    assert answer.status == 429
    assert "retry-after" not in answer.headers  # no wait cures it: an SDK must not retry
    assert answer.headers["x-should-retry"] == "false"  # what the OpenAI SDKs obey
    assert "tpm 100" in answer.json()["error"]["message"]
    assert upstream.requests == []


async def test_a_request_over_every_sources_tpm_is_not_to_be_retried() -> None:
    """Outside review: a request whose estimate alone is over every source's ``tpm``
    got a plain 502, which the OpenAI SDKs retry twice for nothing (the same request
    over a gateway key's ``tpm`` says ``x-should-retry: false``)."""
    async with gateway(Reply(tokens=2), source_tpm=100, sources=2) as (server, upstream):
        answer = await http(server, "POST", CALL, {**CHAT, "max_tokens": 500}, AUTH)
        fits = await http(server, "POST", CALL, {**CHAT, "max_tokens": 8}, AUTH)
    assert (answer.status, answer.json()["error"]["code"]) == (502, "sources_exhausted")
    assert answer.headers["x-should-retry"] == "false"
    assert "too_large" in answer.json()["error"]["message"]
    assert fits.status == 200 and len(upstream.requests) == 1
    assert "x-should-retry" not in fits.headers


@pytest.mark.parametrize("full", ["rpm", "max_in_flight"])
async def test_a_request_over_the_whole_tpm_says_so_when_another_limit_is_full(full: str) -> None:
    """Review finding: with the key's rpm window or in-flight cap full as well, the
    refusal named that limit, with a Retry-After (and the SDKs retried a request no
    wait can cure): the backend checks the whole-tpm case last."""
    limit = {"rpm": 1} if full == "rpm" else {"max_in_flight": 1}
    async with gateway(Reply(tokens=2, inter_token_s=0.5), serve=keyed(tpm=100, **limit)) as (server, _):
        async with trio.open_nursery() as nursery:
            small = {**CHAT, "max_tokens": 8}  # within the key's tpm
            if full == "rpm":
                assert (await http(server, "POST", CALL, small, bearer(ALICE))).status == 200
            else:  # a call of the key in flight holds its one permit
                nursery.start_soon(http, server, "POST", CALL, small, bearer(ALICE))
                await wait_for(lambda: server.statistics().in_flight == 1)
            answer = await http(server, "POST", CALL, {**CHAT, "max_tokens": 500}, bearer(ALICE))
    assert answer.status == 429
    assert "retry-after" not in answer.headers and answer.headers["x-should-retry"] == "false"
    assert "tpm 100" in answer.json()["error"]["message"]
    assert ("alice", "too_large") in dict(server.metrics.key_refusals)


async def test_the_openai_sdk_does_not_retry_a_request_over_the_whole_tpm() -> None:
    """openai-python retries a 429 with backoff whatever ``Retry-After`` says; it
    obeys ``x-should-retry: false``.  One request, one refusal."""
    import openai

    async with gateway(Reply(tokens=2), serve=keyed(tpm=100)) as (server, _):

        def call() -> BaseException:
            client = openai.OpenAI(base_url=server.base_url, api_key=ALICE, max_retries=2, timeout=20)
            with client, pytest.raises(openai.RateLimitError) as info:
                client.chat.completions.create(
                    model=CHAT["model"], messages=CHAT["messages"], max_tokens=500)
            return info.value

        error = await trio.to_thread.run_sync(call)
        refusals = dict(server.metrics.key_refusals)
    assert "tpm 100" in str(error)
    assert refusals == {("alice", "too_large"): 1}


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_in_flight_bound_and_a_client_that_leaves_returns_its_permit(
    backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "redis":  # the settle runs in a cancelled scope: shielded, bounded
        server_: RedisServer = request.getfixturevalue("redis_server")
        backend = f"{server_.url}?prefix=inflight-{secrets.token_hex(4)}"
    upstream = FakeUpstream(Reply(first_token_s=30))
    async with gateway(upstream, serve=keyed(max_in_flight=1), backend=backend) as (server, _):
        client = await trio.open_tcp_stream("127.0.0.1", server.port)
        await client.send_all(request_bytes("POST", CALL, {**CHAT, "stream": True}, bearer(ALICE)))
        await wait_for(lambda: upstream.in_flight == 1)
        second = await http(server, "POST", CALL, CHAT, bearer(ALICE))
        assert second.status == 429
        assert int(second.headers["retry-after"]) == 1
        assert "in_flight" in second.json()["error"]["message"]
        await client.aclose()
        await wait_for(lambda: upstream.in_flight == 0)
        await wait_for(lambda: server.statistics().in_flight == 0)
        state = await key_state(server, "alice")
    assert state.in_flight == 0
    assert state.tokens_reserved == 0
    assert state.reserved_total == state.settled_total + state.released_total
    assert state.requests_in_window == 1  # the abandoned call counts; the 429 does not


@pytest.mark.parametrize(("path", "bad"), [
    (CALL, {**CHAT, "messages": [{"content": "hi"}]}),  # no role: the session's 400
    (CALL, {**CHAT, "stream": "yes"}),  # the server's own 400, before the call
    (CALL, {**CHAT, "stream": True, "stream_options": 3}),
    # (a string is no boolean: "false" read as true sent a usage chunk nobody asked for)
    (CALL, {**CHAT, "stream": True, "stream_options": {"include_usage": "false"}}),
    ("/v1/embeddings", {"model": "embed", "input": []}),
])
async def test_a_call_refused_before_any_upstream_work_costs_the_key_nothing(
    path: str, bad: dict[str, Any]
) -> None:
    async with gateway(Reply(tokens=2), serve=keyed(rpm=1)) as (server, upstream):
        refused = await http(server, "POST", path, bad, bearer(ALICE))
        answer = await http(server, "POST", CALL, CHAT, bearer(ALICE))
        state = await key_state(server, "alice")
    assert refused.status == 400
    assert answer.status == 200  # the 400 did not use alice's one request a minute
    assert len(upstream.requests) == 1
    assert (state.requests_in_window, state.in_flight) == (1, 0)


async def test_a_cache_hit_counts_as_a_request_and_costs_no_tokens(tmp_path: Path) -> None:
    upstream = FakeUpstream(Reply(tokens=5))
    async with upstream.serve() as url:
        import attrs

        from polygate.serve import open_server

        from ._serve_kit import settings_for

        settings = attrs.evolve(
            settings_for(url, serve=keyed(tpm=10_000), cache_ttl_s=60), cache="memory")
        async with open_server(settings, port=0) as server:
            first = await http(server, "POST", CALL, CHAT, bearer(ALICE))
            hit = await http(server, "POST", CALL, CHAT, bearer(ALICE))
            state = await key_state(server, "alice")
    assert hit.headers["x-polygate-cached"] == "true"
    assert state.requests_in_window == 2
    assert state.tokens_in_window == first.json()["usage"]["total_tokens"]
    assert len(upstream.requests) == 1


async def test_a_partial_embedding_hit_costs_the_key_only_its_misses() -> None:
    """Outside review (2026-12-02): the inputs the cache answered cost the key tokens
    as if they had gone upstream (a request with 2 of 3 inputs cached paid for 3); as
    a whole hit costs nothing, each hit input costs nothing."""
    upstream = FakeUpstream(Reply(tokens=5))
    async with upstream.serve() as url:
        import attrs

        from polygate.serve import open_server

        from ._serve_kit import settings_for

        base = settings_for(url, serve=keyed(tpm=100_000), cache="memory")
        settings = attrs.evolve(base, scopes={
            **base.scopes, "embed": attrs.evolve(base.scopes["embed"], cache_ttl_s=60)})
        inputs = ["x" * 400, "y" * 400, "z" * 400]
        async with open_server(settings, port=0) as server:
            first = await http(server, "POST", "/v1/embeddings",
                               {"model": "embed", "input": inputs[:2]}, bearer(ALICE))
            before = (await key_state(server, "alice")).tokens_in_window
            second = await http(server, "POST", "/v1/embeddings",
                                {"model": "embed", "input": inputs}, bearer(ALICE))
            after = (await key_state(server, "alice")).tokens_in_window
            sent = upstream.requests[-1].body["input"]
    assert first.status == second.status == 200
    assert sent == [inputs[2]]  # only the miss went upstream
    assert before == first.json()["usage"]["total_tokens"]
    # the third input's share of the second answer, as the first answer priced its two
    assert second.json()["usage"]["total_tokens"] == before * 3 // 2
    assert after - before == before // 2


# --------------------------------------------------------------------------- scale-out


@pytest.mark.timeout(120)
async def test_two_replicas_hold_one_keys_rpm(redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    rpm = 3
    prefix = f"keys-{secrets.token_hex(4)}"
    upstream = FakeUpstream(Reply(tokens=2))
    async with upstream.serve() as url:
        config = tmp_path / "c.toml"
        config.write_text(
            f'backend = "{redis_server.url}?prefix={prefix}"\n'
            f'[serve.keys.alice]\nkey = "{ALICE}"\nrpm = {rpm}\n'
            f'[scopes.chat.sources.a]\nbase_url = "{url}"\nmodel = "m1"\n'
        )
        answers = await two_replicas_alternately(config, 8, bearer(ALICE))
        stored = await _everything_in_redis(redis_server, prefix)
    statuses = [answer.status for answer in answers]
    assert statuses.count(200) == rpm
    assert statuses.count(429) == 8 - rpm
    assert len(upstream.requests) == rpm
    # The key's state is kept under its name; neither the key nor a hash of it is stored.
    assert any(f"{KEY_SCOPE}:alice" in key for key in stored)
    assert ALICE not in "".join(stored.keys()) + "".join(stored.values())


async def _everything_in_redis(server: RedisServer, prefix: str) -> dict[str, str]:
    import coredis

    out: dict[str, str] = {}
    async with coredis.Redis(host="127.0.0.1", port=server.port, decode_responses=True) as client:
        async for key in client.scan_iter(match=f"{prefix}:*"):
            kind = await client.type(key)
            if kind == "string":
                out[key] = str(await client.get(key))
            elif kind == "hash":
                out[key] = json.dumps(await client.hgetall(key))
            elif kind == "zset":
                out[key] = json.dumps(await client.zrange(key, 0, -1))
            else:
                out[key] = kind
    return out


@pytest.mark.parametrize("limit", [{"max_tokens": 5000.0}, {"max_completion_tokens": 5000.0},
                                   {"max_tokens": 100, "n": 50.0},
                                   {"max_tokens": "5000"}, {"max_tokens": 100, "n": "50"}])
async def test_a_whole_float_limit_is_reserved_like_the_integer(limit: dict[str, object]) -> None:
    """Outside review (HTTP, 2026-12-03): a key's tpm refused ``max_tokens: 5000`` but
    admitted ``5000.0`` (and ``n: 50.0``) with the default estimate, although vLLM and
    SGLang read it as 5000: the call could cost what the integer form was refused.  The
    same for ``"5000"`` and ``n: "50"`` (review, 2026-12-06), read as numbers too."""
    async with gateway(serve=keyed(tpm=1000)) as (server, _):
        answer = await http(server, "POST", CALL, {**CHAT, **limit}, bearer(ALICE))
    assert answer.status == 429, answer.body[:300]
    assert ("alice", "too_large") in dict(server.metrics.key_refusals)


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_content_part_typed_as_a_list_or_an_object_is_forwarded_not_a_500(
    named: bool, stream: bool,
) -> None:
    """Outside review (fuzzing the gateway's bodies): ``{"type": []}`` as a content part
    crashed the token estimate, a 500 with a traceback in the log (for a named key with
    a quota, before the call).  It is the upstream's to judge: forwarded as sent."""
    parts = [{"type": []}, {"type": {"a": 1}}, {"type": ["text"], "text": "hi"}]
    body = {**CHAT, "messages": [{"role": "user", "content": parts}], "stream": stream}
    async with gateway(serve=keyed(rpm=1000, tpm=100_000)) as (server, upstream):
        answer = await http(server, "POST", CALL, body, bearer(ALICE) if named else AUTH)
    assert answer.status == 200, answer.body[:300]
    assert upstream.requests[-1].body["messages"] == body["messages"]


async def test_no_object_a_handler_holds_shows_the_gateway_key_or_the_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review finding (docs, claim by claim): the request every handler holds (a local
    of answer(), _route(), _chat(): what a crash reporter records) showed the raw
    gateway key in its repr, and the prompt."""
    import polygate.serve._server as server_mod
    from polygate.testing import Reply

    from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, gateway, http

    seen: list[str] = []
    real = server_mod.answer

    async def spy(ctx: Any, request: Any) -> None:
        seen.extend([repr(request), repr(ctx), repr(ctx.gateway), repr(ctx.gateway.session)])
        await real(ctx, request)

    monkeypatch.setattr(server_mod, "answer", spy)
    async with gateway(Reply(tokens=2)) as (server, _):
        answered = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        seen.append(repr(server))
    assert answered.status == 200
    assert seen and not [r[:200] for r in seen if GATEWAY_KEY in r or '"hi"' in r]
    assert "authorization" in seen[0] and "bytes>" in seen[0]  # what it holds, not the values


async def test_a_prompt_carried_in_tools_counts_against_the_keys_tpm() -> None:
    """A tenant that moved its prompt into a tool's description was estimated at a few
    tokens, and admitted whatever its size, where the same text in a message is refused
    (an outside review, tenants of one gateway, 2026-12-05)."""
    big = "lorem ipsum dolor sit amet " * 1500  # ~40,000 characters: ~10,000 tokens
    serve = polygate.Serve(api_keys=[GATEWAY_KEY], keys={
        "alice": polygate.ServeKey(key=ALICE, tpm=2000)})
    in_message = {"model": "chat", "messages": [{"role": "user", "content": big}], "max_tokens": 10}
    in_tools = {"model": "chat", "messages": [{"role": "user", "content": "call f"}], "max_tokens": 10,
                "tools": [{"type": "function", "function": {
                    "name": "f", "description": big, "parameters": {"type": "object"}}}]}
    small_tools = {**in_tools, "tools": [{"type": "function", "function": {"name": "f"}}]}
    headers = {"authorization": f"Bearer {ALICE}"}
    async with gateway(Reply(tokens=2), serve=serve) as (server, upstream):
        refused = await http(server, "POST", CALL, in_message, headers)
        in_a_tool = await http(server, "POST", CALL, in_tools, headers)
        answered = await http(server, "POST", CALL, small_tools, headers)
    for answer in (refused, in_a_tool):
        assert answer.status == 429 and answer.headers.get("x-should-retry") == "false"
    assert answered.status == 200
    assert len(upstream.requests) == 1


# --------------------------------------------------------------------------- keys bound to scopes


def _teams(url: str) -> polygate.Settings:
    def scope() -> polygate.Scope:
        return polygate.Scope(sources=[polygate.Source(name="s", base_url=url, model="m1")])

    return polygate.Settings(
        scopes={"team-a": scope(), "team-b": scope(), "embed": scope()},
        serve=polygate.Serve(
            api_keys=[GATEWAY_KEY], models={"gpt-a": "team-a", "gpt-b": "team-b"},
            keys={"alice": polygate.ServeKey(key=ALICE, models=["gpt-a", "embed"]),
                  "bob": polygate.ServeKey(key=BOB, models=["team-b"], rpm=100)}))


async def test_a_key_bound_to_scopes_reaches_only_those() -> None:
    """A tenant's key names the scopes it may call (by a scope's name or an alias):
    any other is, to it, a model that does not exist.  Before, a gateway key was bound
    to no scope, and separate scopes kept no tenant from another's (an outside review,
    tenants of one gateway, 2026-12-05)."""
    from polygate.serve import open_server

    upstream = FakeUpstream(Reply(tokens=2))

    def chat(model: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}]}

    def bearer(key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    async with upstream.serve() as url, open_server(_teams(url), port=0) as server:
        # Alice: team-a by its alias or its own name, and embeddings.
        for model in ("gpt-a", "team-a"):
            assert (await http(server, "POST", CALL, chat(model), bearer(ALICE))).status == 200
        embedded = await http(server, "POST", "/v1/embeddings", {"model": "embed", "input": ["x"]},
                              bearer(ALICE))
        assert embedded.status == 200
        sent = len(upstream.requests)
        for model in ("gpt-b", "team-b"):
            refused = await http(server, "POST", CALL, chat(model), bearer(ALICE))
            assert refused.status == 404 and refused.json()["error"]["code"] == "model_not_found"
            # As a model that does not exist: nothing says it does.
            unknown = await http(server, "POST", CALL, chat("nowhere"), bearer(ALICE))
            assert refused.json()["error"]["message"] == unknown.json()["error"]["message"].replace(
                "nowhere", model)
        assert len(upstream.requests) == sent  # (nothing went upstream for them)
        listed = {m["id"] for m in (await http(server, "GET", "/v1/models", None, bearer(ALICE))).json()["data"]}
        assert listed == {"team-a", "gpt-a", "embed"}
        assert (await http(server, "GET", "/v1/models/gpt-b", None, bearer(ALICE))).status == 404
        assert (await http(server, "GET", "/v1/models/team-a", None, bearer(ALICE))).status == 200
        # Bob (bound, with a quota): his scope only, by either name.
        assert (await http(server, "POST", CALL, chat("gpt-b"), bearer(BOB))).status == 200
        assert (await http(server, "POST", CALL, chat("team-a"), bearer(BOB))).status == 404
        listed = {m["id"] for m in (await http(server, "GET", "/v1/models", None, bearer(BOB))).json()["data"]}
        assert listed == {"team-b", "gpt-b"}
        # /metrics names every key and counts its requests: the operator's, not a tenant's.
        for key in (ALICE, BOB):
            forbidden = await http(server, "GET", "/metrics", None, bearer(key))
            assert forbidden.status == 403 and b"alice" not in forbidden.body
        assert (await http(server, "GET", "/metrics", None, bearer(GATEWAY_KEY))).status == 200
        # A key bound to nothing (api_keys) reaches everything, as before.
        everything = await http(server, "GET", "/v1/models", None, bearer(GATEWAY_KEY))
        assert {m["id"] for m in everything.json()["data"]} == {
            "team-a", "team-b", "embed", "gpt-a", "gpt-b"}
        for model in ("gpt-a", "team-b"):
            assert (await http(server, "POST", CALL, chat(model), bearer(GATEWAY_KEY))).status == 200


def test_a_keys_models_are_written_three_ways_alike(tmp_path: Path) -> None:
    """``models`` of a labelled key: a list in Python and TOML, comma-separated in the
    environment; each must be a scope or an alias."""
    toml = tmp_path / "p.toml"
    toml.write_text(f"""
[scopes.chat.sources.a]
base_url = "{URL}"
[scopes.other.sources.a]
base_url = "{URL}"
[serve]
models = {{ "gpt-4o" = "chat" }}
[serve.keys.alice]
key = "{ALICE}"
models = ["gpt-4o", "other"]
""")
    env = {"POLYGATE__CHAT__A__BASE_URL": URL, "POLYGATE__OTHER__A__BASE_URL": URL,
           "POLYGATE__SERVE__MODELS": "gpt-4o=chat",
           "POLYGATE__SERVE__KEYS__ALICE__KEY": ALICE,
           "POLYGATE__SERVE__KEYS__ALICE__MODELS": "gpt-4o, other"}
    from_toml = settings_from_toml(toml).serve.keys["alice"]
    assert from_toml == settings_from_env(env).serve.keys["alice"]
    assert from_toml == polygate.ServeKey(key=ALICE, models=("gpt-4o", "other"))
    with pytest.raises(polygate.ConfigError,
                       match=r"POLYGATE__SERVE__KEYS__ALICE__MODELS: 'gpt-5' is no scope or alias"):
        settings_from_env({**env, "POLYGATE__SERVE__KEYS__ALICE__MODELS": "gpt-5"})
    toml.write_text(toml.read_text().replace('["gpt-4o", "other"]', '"other"'))
    with pytest.raises(polygate.ConfigError, match=r"serve\.keys\.alice\.models: expected an array"):
        settings_from_toml(toml)
    with pytest.raises(polygate.ConfigError, match=r"ServeKey\.models: names a model twice"):
        polygate.ServeKey(key=ALICE, models=["chat", "chat"])
    with pytest.raises(polygate.ConfigError, match=r"ServeKey\.models: must be a list"):
        polygate.ServeKey(key=ALICE, models="chat")  # type: ignore[arg-type]


def test_a_key_bound_to_scopes_cannot_be_unbound_by_an_empty_value(tmp_path: Path) -> None:
    """``…__MODELS=$TEAM_MODELS`` with the variable unset: an empty value is an unset key
    everywhere else, and here it would have given the tenant every scope and the
    metrics.  Refused, as TOML's ``models = []`` is (a review, 2026-12-05)."""
    env = {"POLYGATE__CHAT__A__BASE_URL": URL, "POLYGATE__SERVE__KEYS__ALICE__KEY": ALICE}
    for empty in ("", "  "):
        with pytest.raises(polygate.ConfigError,
                           match=r"POLYGATE__SERVE__KEYS__ALICE__MODELS: is empty"):
            settings_from_env({**env, "POLYGATE__SERVE__KEYS__ALICE__MODELS": empty})
    assert settings_from_env(env).serve.keys["alice"].models == ()  # left out: every scope
    toml = tmp_path / "p.toml"
    toml.write_text(f'[scopes.chat.sources.a]\nbase_url = "{URL}"\n'
                    f'[serve.keys.alice]\nkey = "{ALICE}"\nmodels = []\n')
    with pytest.raises(polygate.ConfigError, match=r"serve\.keys\.alice\.models: is empty"):
        settings_from_toml(toml)


def test_a_key_bound_to_a_scope_is_bound_to_its_fallbacks_too() -> None:
    """A call moves along its scope's fallbacks: a key bound to team-a whose calls fell
    back to team-b was answered by team-b's sources, spent its quotas, and read its name
    in the errors, where ``/v1/models/team-b`` told it no such model exists (a review,
    2026-12-05).  The binding must cover the chain."""
    def scope(fallback: str | None = None) -> polygate.Scope:
        return polygate.Scope(sources=[polygate.Source(name="s", base_url=URL)], fallback=fallback)

    scopes = {"team-a": scope("team-b"), "team-b": scope("team-c"), "team-c": scope()}
    with pytest.raises(polygate.ConfigError,
                       match=r"serve\.keys\.alice\.models: scope 'team-a' falls back to 'team-b'"):
        polygate.Settings(scopes=scopes, serve=polygate.Serve(
            keys={"alice": polygate.ServeKey(key=ALICE, models=["team-a"])}))
    with pytest.raises(polygate.ConfigError, match=r"scope 'team-b' falls back to 'team-c'"):
        polygate.Settings(scopes=scopes, serve=polygate.Serve(
            keys={"alice": polygate.ServeKey(key=ALICE, models=["team-a", "team-b"])}))
    polygate.Settings(scopes=scopes, serve=polygate.Serve(
        keys={"alice": polygate.ServeKey(key=ALICE, models=["team-a", "team-b", "team-c"]),
              "bob": polygate.ServeKey(key=BOB, models=["team-c"])}))

# --------------------------------------------------------------------------- a key named with a "."
# A key's name may hold a '.' as a scope's may: its errors split the name at the dot and
# named a TOML path or an environment key that does not exist (a review, 2026-12-05).

DOTTED_URL = "http://a.example/v1"
DOTTED_KEY = "sk-aaaaaaaaaaaaaaaaaaaaaa"


def _dotted_toml(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(
        f'[scopes.team-a]\nfallback = "team-b"\n[scopes.team-a.sources.s]\nbase_url = "{DOTTED_URL}"\n'
        f'[scopes.team-b.sources.s]\nbase_url = "{DOTTED_URL}"\n' + body)
    return path


def test_toml_fallback_refusal_names_the_dotted_key(tmp_path: Path) -> None:
    path = _dotted_toml(tmp_path, f'[serve.keys."team.a"]\nkey = "{DOTTED_KEY}"\nmodels = ["team-a"]\n')
    with pytest.raises(polygate.ConfigError) as err:
        settings_from_toml(path, env={})
    assert 'serve.keys."team.a".models' in str(err.value), str(err.value)


def test_toml_unknown_model_names_the_dotted_key(tmp_path: Path) -> None:
    path = _dotted_toml(tmp_path, f'[serve.keys."team.a"]\nkey = "{DOTTED_KEY}"\nmodels = ["nope"]\n')
    with pytest.raises(polygate.ConfigError) as err:
        settings_from_toml(path, env={})
    assert 'serve.keys."team.a".models' in str(err.value), str(err.value)


def test_env_fallback_refusal_names_the_key_that_was_set() -> None:
    env = {"POLYGATE__TEAM-A__S__BASE_URL": DOTTED_URL, "POLYGATE__TEAM-A__FALLBACK": "team-b",
           "POLYGATE__TEAM-B__S__BASE_URL": DOTTED_URL,
           "POLYGATE__SERVE__KEYS__TEAM.A__KEY": DOTTED_KEY,
           "POLYGATE__SERVE__KEYS__TEAM.A__MODELS": "team-a"}
    with pytest.raises(polygate.ConfigError) as err:
        settings_from_env(env)
    assert str(err.value).startswith("POLYGATE__SERVE__KEYS__TEAM.A__MODELS:"), str(err.value)


def test_env_rpm_error_names_the_key_that_was_set() -> None:
    """(Older than the models refusals: every field of a dotted key's name.)"""
    env = {"POLYGATE__CHAT__S__BASE_URL": DOTTED_URL, "POLYGATE__SERVE__KEYS__TEAM.A__KEY": DOTTED_KEY,
           "POLYGATE__SERVE__KEYS__TEAM.A__RPM": "0"}
    with pytest.raises(polygate.ConfigError) as err:
        settings_from_env(env)
    assert str(err.value).startswith("POLYGATE__SERVE__KEYS__TEAM.A__RPM:"), str(err.value)


# --------------------------------------------------------------------------- review: attempts that never left


@contextlib.contextmanager
def _connect_hangs() -> Iterator[str]:
    """A base URL whose connects hang: a listener whose accept queue is full (Linux
    drops the SYNs of further connects, which then wait for their retransmissions)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        listener.close()
        for filler in fillers:
            filler.close()


def _free_port_url() -> str:
    with socket.socket() as s:  # (bound, never listening: connects are refused)
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


async def test_a_client_that_leaves_before_any_request_left_pays_nothing() -> None:
    """Review finding (every account of one call): a client that left while its call's
    only attempt was still connecting -- no request ever left -- was charged a request
    and the whole estimate on its key, where the source's own ledger voided the same
    attempt ("voided when no attempt reached a source", polygate/_key_quota.py)."""
    with _connect_hangs() as url:
        async with open_server(settings_for(url, serve=keyed(rpm=100)), port=0) as server:
            client = await trio.open_tcp_stream("127.0.0.1", server.port)
            await client.send_all(request_bytes("POST", CALL, CHAT, bearer(ALICE)))
            backend = server.session._runtime.governor.backend

            async def admitted() -> bool:
                return (await backend.snapshot("chat", "s0")).admissions == 1

            with trio.fail_after(10):  # (the attempt is admitted, and connecting)
                while not await admitted():  # noqa: ASYNC110 - the backend's state: no event
                    await trio.sleep(0.01)
            await client.aclose()
            await wait_for(lambda: server.statistics().in_flight == 0)
            state = await key_state(server, "alice")
            source = await backend.snapshot("chat", "s0")
            metrics = (await http(server, "GET", "/metrics", headers=AUTH)).body.decode()
    assert (source.requests_in_window, source.tokens_in_window) == (0, 0)
    assert (state.requests_in_window, state.tokens_in_window, state.in_flight) == (0, 0, 0)
    assert 'polygate_serve_key_requests_total{key="alice"}' not in metrics


async def test_a_call_whose_attempts_all_failed_to_connect_pays_nothing() -> None:
    """The same rule for a call that failed: every attempt's connect was refused, so
    no request reached a source; the key was charged the estimate ("an error after
    attempts")."""
    async with open_server(settings_for(_free_port_url(), serve=keyed(rpm=100)), port=0) as server:
        answer = await http(server, "POST", CALL, CHAT, bearer(ALICE))
        state = await key_state(server, "alice")
    assert answer.status == 502
    assert (state.requests_in_window, state.tokens_in_window, state.in_flight) == (0, 0, 0)
