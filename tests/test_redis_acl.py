"""A Redis locked down as a security team configures it (an outside review, 2026-12-06):
ACL users given only what docs/distributed.md and docs/cache.md list, and no CLIENT
command at all.  polygate named its connections (coredis's CLIENT SETNAME at each
one), so a server refusing CLIENT could not run the governance backend and the cache
never answered; the cache's start-up PING logged an outage for a user without PING."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ._redis_server import RedisServer, command, need_redis, running_redis

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _acl_line(doc: str, user: str) -> list[str]:
    """The ``ACL SETUSER`` line a doc gives for ``user``, as arguments (the password
    placeholder filled in)."""
    found = re.search(rf"ACL SETUSER {user} (.+)", (DOCS / doc).read_text())
    assert found, f"{doc} gives no ACL line for {user}"
    return found[1].replace(">PASSWORD", ">pw-SECRET").split()


@pytest.fixture
def locked_redis() -> RedisServer:
    with running_redis(need_redis()) as server:
        for user, doc in (("polygate", "distributed.md"), ("polygate-cache", "cache.md")):
            reply = command(server.port, "ACL", "SETUSER", user, *_acl_line(doc, user))
            assert reply == b"+OK", reply
        # A user with everything but CLIENT, as `rename-command CLIENT ""` leaves it.
        assert command(server.port, "ACL", "SETUSER", "noclient", "on", ">pw-SECRET", "~*", "&*",
                       "+@all", "-client") == b"+OK"
        yield server


async def test_the_documented_acl_lines_run_governance_and_the_cache(locked_redis: RedisServer) -> None:
    port = locked_redis.port
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                                       cache_ttl_s=60)},
        backend=f"redis://polygate:pw-SECRET@127.0.0.1:{port}/0?prefix=polygate",
        cache=f"redis://polygate-cache:pw-SECRET@127.0.0.1:{port}/0?prefix=polygate-cache",
    )
    up = FakeUpstream(Reply(text="hi"))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        for _ in range(3):
            assert (await s.chat([{"role": "user", "content": "m"}])).text == "hi"
            await trio.sleep(0.05)  # (the write-behind)
        stats = await s.statistics()
    assert stats.cache.errors == 0 and stats.cache.hits >= 1
    assert stats.governance.sources[0].state.admissions == len(up.requests) >= 1


@pytest.mark.parametrize("what", ["backend", "cache"])
async def test_a_server_that_refuses_client_runs_polygate(locked_redis: RedisServer, what: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://noclient:pw-SECRET@127.0.0.1:{locked_redis.port}/0"
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                                       cache_ttl_s=60)},
        **({"backend": url} if what == "backend" else {"cache": url}),
    )
    up = FakeUpstream(Reply(text="hi"))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        for _ in range(2):
            await s.chat([{"role": "user", "content": "m"}])
            await trio.sleep(0.05)
        stats = await s.statistics()
    if what == "cache":
        assert stats.cache.errors == 0 and stats.cache.hits == 1
    assert "client" not in caplog.text.lower()


async def test_a_user_refused_a_command_the_scripts_call_is_told_at_start(locked_redis: RedisServer) -> None:
    """The review: a user without PEXPIRE started (the start-up probe calls TIME alone),
    then every admission failed "on @user_script:293", naming no command, and left the
    permit and window entry it had written before it (Redis rolls no script back): the
    fleet's max_in_flight used up until the leases lapsed.  Now said at start, by name,
    with nothing written."""
    port = locked_redis.port
    rules = _acl_line("distributed.md", "polygate")
    rules.remove("+pexpire")
    assert command(port, "ACL", "SETUSER", "nopexpire", *rules) == b"+OK"
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])},
        backend=f"redis://nopexpire:pw-SECRET@127.0.0.1:{port}/0",
    )
    with pytest.raises(polygate.GovernanceBackendError, match="may not run PEXPIRE") as caught:
        async with polygate.session(settings):
            pass
    assert "pw-SECRET" not in str(caught.value)
    assert command(port, "DBSIZE") == b":0"
