"""No secret in the frames of a configuration error.

A crash reporter records the locals of each frame of an error's traceback (see
tests/test_secrets_in_frames.py).  A configuration error is what it sees at start-up,
and the frames that read and built the configuration held it whole (an outside review):
the environment (all of ``os.environ``, so a typo in a TOML file that holds no secret at
all showed the process's cloud credentials), a TOML file's tables, and a constructor's
arguments (attrs' ``__init__`` and the validators': keys, URLs with their passwords, the
gateway keys) beside the field that was wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import polygate
from polygate._config_load import load_settings
from polygate.testing import FakeUpstream, Reply, Router

from .test_secrets_in_frames import _in_frames

KEY = "sk-CFGSECRET-0123456789abcdef"
PASSWORD = "REDISPW-rrrrrrrrrrrr5555"
GATEWAY_KEY = "gw-GATEWAYKEY-9999999999999"
ENV = {
    "POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
    "POLYGATE__CHAT__A__API_KEY": KEY,
    "POLYGATE__CHAT__CALL_DEADLINE_S": "abc",
}
TOML = """
[scopes.chat]
call_deadline_s = "abc"
[[scopes.chat.sources]]
name = "a"
base_url = "http://a/v1"
"""


def _refused(secret: str, build: Any, *args: Any, **kwargs: Any) -> polygate.ConfigError:
    with pytest.raises(polygate.ConfigError) as info:
        build(*args, **kwargs)
    assert secret not in str(info.value)
    assert not _in_frames(info.value, secret)
    return info.value


@pytest.mark.parametrize("deadline", ["abc", "-5"])
def test_from_env(deadline: str) -> None:
    _refused(KEY, polygate.Settings.from_env, {**ENV, "POLYGATE__CHAT__CALL_DEADLINE_S": deadline})


def test_from_env_reading_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEY)
    for name, value in ENV.items():
        if not name.endswith("API_KEY"):
            monkeypatch.setenv(name, value)
    _refused(KEY, polygate.Settings.from_env)
    _refused(KEY, load_settings)


def test_from_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", KEY)  # (a file with no secret: the env's)
    path = tmp_path / "c.toml"
    path.write_text(TOML + f'api_key = "{KEY}"\n')
    _refused(KEY, polygate.Settings.from_toml, path)
    path.write_text(TOML)
    _refused(KEY, polygate.Settings.from_toml, path)


@pytest.mark.parametrize("base_url", ["ftp://a/v1", "http://a/v1"])
def test_a_source(base_url: str) -> None:
    key = KEY if base_url.startswith("ftp") else KEY + "\n"  # (a key that is no header)
    _refused(KEY, polygate.Source, name="a", base_url=base_url, api_key=key)


def _scopes() -> dict[str, polygate.Scope]:
    return {"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])}


@pytest.mark.parametrize("field", ["backend", "telemetry", "cache"])
def test_settings_beside_a_url_with_a_password(field: str) -> None:
    url = {"backend": f"redis://alice:{PASSWORD}@127.0.0.1:6379/0",
           "telemetry": f"postgresql://alice:{PASSWORD}@127.0.0.1/db",
           "cache": f"redis://alice:{PASSWORD}@127.0.0.1:6379/0"}[field]
    _refused(PASSWORD, polygate.Settings, scopes=_scopes(), telemetry_queue=-1, **{field: url})
    _refused(PASSWORD, polygate.Settings, scopes=_scopes(), backend=url + "?bogus=1")


def test_the_gateway_keys() -> None:
    _refused(GATEWAY_KEY, polygate.Serve, api_keys=[GATEWAY_KEY, "a b"])
    _refused(GATEWAY_KEY, polygate.Serve, api_keys=[GATEWAY_KEY], port=-3)


async def test_a_session_reading_its_configuration() -> None:
    with pytest.raises(polygate.ConfigError) as info:
        async with polygate.session(env=dict(ENV)):
            pass
    assert not _in_frames(info.value, KEY)


def test_an_asyncio_session_reading_its_configuration() -> None:
    import asyncio

    import polygate.aio

    async def main() -> BaseException:
        try:
            async with polygate.aio.session(env=dict(ENV)):
                pass
        except polygate.ConfigError as exc:
            return exc
        raise AssertionError("opened")

    assert not _in_frames(asyncio.run(main()), KEY)


@pytest.fixture
def no_coredis(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "coredis" or name.startswith("coredis."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "coredis", None)  # (import coredis: ImportError)


@pytest.mark.parametrize("field", ["cache", "backend"])
async def test_without_the_redis_extra(field: str, no_coredis: None) -> None:
    settings = polygate.Settings(scopes=_scopes(), **{field: f"redis://alice:{PASSWORD}@127.0.0.1:1/0"})
    with pytest.raises(polygate.ConfigError) as info:
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply())})):
            pass
    assert "coredis" in str(info.value) and PASSWORD not in str(info.value)
    assert not _in_frames(info.value, PASSWORD)


async def test_a_server_reading_its_configuration() -> None:
    """Review of the fix: ``open_server(env=...)`` kept ``env`` (the whole environment
    handed in) in its frame, through which every configuration error unwound: the
    reading's, and the later checks' (a port that is no port)."""
    from polygate.serve import open_server

    for env, port in ((dict(ENV), 0), ({k: v for k, v in ENV.items() if "DEADLINE" not in k}, 70000)):
        with pytest.raises(polygate.ConfigError) as info:
            async with open_server(env=env, port=port):
                pass
        assert not _in_frames(info.value, KEY)


def test_a_scope_given_a_source_as_a_dict() -> None:
    """Review of the fix: a source written as a dict (an easy mistake) was in the
    frames of Scope's refusal, its key raw."""
    _refused(KEY, polygate.Scope, sources=[{"name": "a", "base_url": "http://a/v1", "api_key": KEY}])
