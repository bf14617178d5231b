"""Files created private, a Redis TLS downgrade announced, typed errors that hold no
reference to the request, logs a hostile upstream cannot flood, and caller
arguments refused before any I/O."""

from __future__ import annotations

import logging
import os
import stat
import traceback
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from ._redis_server import RedisServer, free_port, redis_server  # noqa: F401 (a fixture)
from .conftest import MESSAGES, SECRET, one_source_settings

# --------------------------------------------------------------------------- F9


async def test_the_telemetry_database_is_private(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    old = os.umask(0o022)
    try:
        db = tmp_path / "state" / "polygate" / "telemetry.db"
        settings = polygate.Settings(
            scopes=one_source_settings().scopes, telemetry=f"sqlite:///{db}", log_content=True
        )
        up = FakeUpstream(Reply())
        async with polygate.session(settings, transport=Router({"a": up})) as s:
            await s.chat([{"role": "user", "content": "record 123-45-6789"}])
        found = [db.parent.parent, db.parent, *db.parent.iterdir()]
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in found}
    assert {name for name in modes if name.startswith("telemetry.db")} >= {"telemetry.db"}
    exposed = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert not exposed, exposed


# --------------------------------------------------------------------------- I2


async def test_redis_without_certificate_checks_is_announced(caplog: pytest.LogCaptureFixture) -> None:
    from polygate import GovernanceBackendError
    from polygate.governance._redis import RedisBackend, parse_redis_url

    caplog.set_level(logging.WARNING)
    url = f"rediss://:redis-PASSWORD-9@127.0.0.1:{free_port()}/0?ssl_cert_reqs=none&timeout_s=0.5"
    backend = RedisBackend(parse_redis_url(url))
    with pytest.raises(GovernanceBackendError):
        await backend.start()
    (record,) = [r for r in caplog.records if "ssl_cert_reqs=none" in r.getMessage()]
    assert record.levelno == logging.WARNING and "redis-PASSWORD-9" not in caplog.text


async def test_redis_cache_without_certificate_checks_is_announced(caplog: pytest.LogCaptureFixture) -> None:
    """The response cache reads the same URL options as the backend, and says so too:
    an answer cache without checks lets anyone on the path read every prompt and
    answer, and rewrite the answers every caller is served."""
    from polygate.cache import parse_cache_url
    from polygate.cache._redis import RedisBackend

    caplog.set_level(logging.WARNING)
    url = f"rediss://:redis-PASSWORD-9@127.0.0.1:{free_port()}/0?ssl_cert_reqs=none&timeout_s=0.5"
    backend = RedisBackend.from_options(parse_cache_url(url))
    try:
        assert await backend.start() is not None  # (nothing listens: a failure, said)
    finally:
        await backend.aclose()
    (record,) = [r for r in caplog.records if "ssl_cert_reqs=none" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.name == "polygate.cache"
    assert "rewrite" in record.getMessage() and "redis-PASSWORD-9" not in caplog.text


# --------------------------------------------------------------------------- I1


def _references(error: BaseException) -> list[BaseException]:
    seen, todo = [], [error]
    while todo:
        exc = todo.pop()
        seen.append(exc)
        todo += [e for e in (exc.__cause__, exc.__context__) if e is not None and e not in seen]
        todo += list(getattr(exc, "errors", []) or [])
    return seen


@pytest.mark.parametrize("fault", ["reset", "truncated"])
async def test_a_typed_error_holds_no_reference_to_the_request(
    fault: str, autojump_clock: trio.testing.MockClock
) -> None:
    up = FakeUpstream(Reply(fault=fault, fault_after=1))
    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat(MESSAGES)
    chain = _references(info.value)
    assert not [e for e in chain if isinstance(e, httpx.HTTPError)], chain
    assert SECRET not in "".join(traceback.format_exception(info.value))


# --------------------------------------------------------------------------- logs


def _bug(request: httpx.Request) -> httpx.Response:
    raise LookupError(f"a bug that quotes {request.headers['authorization']}")


async def test_an_unexpected_error_logs_one_redacted_traceback_a_minute(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = one_source_settings(retry=polygate.Retry(max_attempts=1))
    async with polygate.session(settings, transport=httpx.MockTransport(_bug)) as s:
        for _ in range(5):
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat(MESSAGES)
            assert SECRET not in str(info.value)
        await trio.sleep(61)
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and "Traceback" in errors[0].getMessage()
    assert SECRET not in caplog.text


# --------------------------------------------------------------------------- F12


@pytest.mark.parametrize("value", ["abc", [1], 5])
async def test_a_bad_stream_options_is_a_config_error_before_any_io(
    value: object, autojump_clock: trio.testing.MockClock
) -> None:
    up = FakeUpstream(Reply())
    async with polygate.session(one_source_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="stream_options"):
            await s.chat(MESSAGES, stream_options=value)
        await s.chat(MESSAGES, stream_options={"include_usage": False})
    assert up.statistics().requests == 1


@pytest.mark.parametrize("max_tokens", [2**63, 10**30])
async def test_a_huge_max_tokens_is_no_backend_failure_on_redis(
    redis_server: RedisServer, max_tokens: int,  # noqa: F811 - the fixture
) -> None:
    """Review: ``max_tokens`` past a 64-bit integer (JSON allows it; ``polygate serve``
    passes it on) failed Redis's admission script half-way: GovernanceBackendError
    ("unreachable", a 503 from serve) with Redis up, and the script had already put a
    request that was never admitted in the source's RPM window.  An estimate counts at
    most MAX_COMPLETION_ESTIMATE, in every backend alike."""
    from polygate.governance._estimate import MAX_COMPLETION_ESTIMATE, completion_budget

    assert completion_budget({"max_tokens": max_tokens}, 256) == MAX_COMPLETION_ESTIMATE
    assert completion_budget({"max_tokens": 10, "n": 3}, 256) == 30
    up = FakeUpstream(Reply(tokens=2))
    async with up.serve() as url:
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url=url, rpm=1000)])},
            backend=redis_server.url + f"?prefix=huge{max_tokens % 9973}",
        )
        async with polygate.session(settings) as s:
            await s.chat(MESSAGES, max_tokens=max_tokens)
            await s.chat(MESSAGES)
            state = (await s.statistics()).governance.sources[0].state
    assert state.requests_in_window == state.admissions == 2
