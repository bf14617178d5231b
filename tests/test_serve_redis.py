"""Scale-out: replicas of ``polygate serve`` on one Redis share one governance view.
Two server processes hold one RPM limit at the wire; a Redis that dies answers 503.
A real redis-server, started by the tests (``tests/_redis_server.py``)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import trio

from polygate.testing import FakeUpstream, Reply

from ._redis_server import RedisServer, own_redis, redis_server  # noqa: F401 - fixtures
from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, gateway, http, two_replicas_alternately

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def test_two_replicas_hold_one_rpm_limit(redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    rpm = 3
    prefix = f"serve-{secrets.token_hex(4)}"
    upstream = FakeUpstream(Reply(tokens=2))
    async with upstream.serve() as url:
        config = tmp_path / "c.toml"
        config.write_text(
            f'backend = "{redis_server.url}?prefix={prefix}"\n'
            f'[serve]\napi_keys = ["{GATEWAY_KEY}"]\n\n'
            f'[scopes.chat]\ncall_deadline_s = 2.0\n'
            f'[scopes.chat.sources.a]\nbase_url = "{url}"\nmodel = "m1"\nrpm = {rpm}\n'
        )
        answers = await two_replicas_alternately(config, 8, AUTH)
    statuses = [answer.status for answer in answers]
    for answer in answers:
        if answer.status == 429:
            assert 1 <= int(answer.headers["retry-after"]) <= 60
    assert statuses.count(200) == rpm
    assert statuses.count(429) == 8 - rpm
    assert len(upstream.requests) == rpm  # the limit held at the wire, across both


async def test_governance_backend_down_is_503(own_redis: RedisServer) -> None:  # noqa: F811
    prefix = f"down-{secrets.token_hex(4)}"
    backend = f"{own_redis.url}?prefix={prefix}"
    async with gateway(Reply(tokens=2), backend=backend, call_deadline_s=10) as (server, upstream):
        assert (await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)).status == 200
        own_redis.kill()
        with trio.fail_after(15):
            answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        ready = await http(server, "GET", "/readyz")
    assert answer.status == 503
    assert answer.json()["error"]["code"] == "governance_unavailable"
    assert ready.status == 503
    assert len(upstream.requests) == 1  # fail closed: nothing sent unadmitted
