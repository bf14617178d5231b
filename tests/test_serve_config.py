"""``Settings.serve``: the gateway server's settings, built three ways with one
validation; errors name the key and never show a gateway key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import polygate
from polygate._config_load import describe, settings_from_env, settings_from_toml

KEY = "sk-gw-SECRET-abcdef"
URL = "http://127.0.0.1:8001/v1"
BASE_ENV = {"POLYGATE__CHAT__A__BASE_URL": URL}


def toml(tmp_path: Path, serve: str) -> Path:
    path = tmp_path / "polygate.toml"
    path.write_text(f"{serve}\n[scopes.chat.sources.a]\nbase_url = \"{URL}\"\n")
    return path


def test_defaults_are_safe() -> None:
    serve = polygate.Serve()
    assert (serve.host, serve.port) == ("127.0.0.1", 8080)
    assert serve.api_keys == ()
    assert serve.grace_s == 30
    assert polygate.Settings(scopes={"chat": polygate.Scope(sources=[
        polygate.Source(name="a", base_url=URL)])}).serve == serve


def test_env_and_toml_agree(tmp_path: Path) -> None:
    env = settings_from_env({
        **BASE_ENV,
        "POLYGATE__SERVE__API_KEYS": f"{KEY}, second-key",
        "POLYGATE__SERVE__MODELS": "gpt-4o=chat, gpt-4o-mini = chat",
        "POLYGATE__SERVE__GRACE_S": "5",
    })
    path = toml(tmp_path, f'[serve]\napi_keys = ["{KEY}", "second-key"]\ngrace_s = 5\n'
                          '[serve.models]\n"gpt-4o" = "chat"\n"gpt-4o-mini" = "chat"\n')
    assert settings_from_toml(path, env={}).serve == env.serve
    assert env.serve.api_keys == (KEY, "second-key")
    assert dict(env.serve.models) == {"gpt-4o": "chat", "gpt-4o-mini": "chat"}


def test_keys_from_an_environment_variable(tmp_path: Path) -> None:
    path = toml(tmp_path, '[serve]\napi_keys_env = "GATEWAY_KEYS"\n')
    settings = settings_from_toml(path, env={"GATEWAY_KEYS": f"{KEY},k2"})
    assert settings.serve.api_keys == (KEY, "k2")
    with pytest.raises(polygate.ConfigError, match="GATEWAY_KEYS is not set"):
        settings_from_toml(path, env={})
    with pytest.raises(polygate.ConfigError, match="GATEWAY_KEYS is set but empty"):
        settings_from_toml(path, env={"GATEWAY_KEYS": ""})


@pytest.mark.parametrize(("env", "where"), [
    ({"POLYGATE__SERVE__API_KEYS": f"{KEY} x"}, "POLYGATE__SERVE__API_KEYS"),
    ({"POLYGATE__SERVE__API_KEYS": f"{KEY},{KEY}"}, "POLYGATE__SERVE__API_KEYS"),
    ({"POLYGATE__SERVE__MODELS": "gpt-4o=nope"}, "POLYGATE__SERVE__MODELS"),
    ({"POLYGATE__SERVE__MODELS": "gpt-4o"}, "POLYGATE__SERVE__MODELS"),
    ({"POLYGATE__SERVE__PORT": "70000"}, "POLYGATE__SERVE__PORT"),
    ({"POLYGATE__SERVE__SSE_KEEPALIVE_S": "0"}, "POLYGATE__SERVE__SSE_KEEPALIVE_S"),
    ({"POLYGATE__SERVE__GRACE": "1"}, "POLYGATE__SERVE__GRACE"),
])
def test_env_errors_name_the_key_and_hide_the_secret(env: dict[str, str], where: str) -> None:
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_env({**BASE_ENV, **env})
    assert str(info.value).startswith(where)
    assert KEY not in str(info.value)


@pytest.mark.parametrize(("serve", "where"), [
    ('[serve]\napi_keys = "one-key"\n', "serve.api_keys"),
    (f'[serve]\napi_keys = ["{KEY}\\n"]\n', "serve.api_keys"),
    ('[serve]\nmax_connections = 0\n', "serve.max_connections"),
    ('[serve.models]\n"gpt-4o" = 3\n', "serve.models"),
    ('[serve.models]\n"gpt-4o" = "embed"\n', "serve.models"),
    ('[serve]\nhots = "x"\n', "serve.hots"),
])
def test_toml_errors_name_the_path(tmp_path: Path, serve: str, where: str) -> None:
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_toml(toml(tmp_path, serve), env={})
    assert f"polygate.toml: {where}" in str(info.value)
    assert KEY not in str(info.value)


def test_an_alias_may_not_shadow_a_scope() -> None:
    scopes = {n: polygate.Scope(sources=[polygate.Source(name="a", base_url=URL)])
              for n in ("chat", "embed")}
    with pytest.raises(polygate.ConfigError, match="also a scope name"):
        polygate.Settings(scopes=scopes, serve=polygate.Serve(models={"chat": "embed"}))


def test_serve_is_a_reserved_scope_name() -> None:
    with pytest.raises(polygate.ConfigError, match="reserved"):
        polygate.Settings(scopes={"serve": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=URL)])})


def test_keys_never_shown() -> None:
    settings = settings_from_env({**BASE_ENV, "POLYGATE__SERVE__API_KEYS": KEY})
    assert KEY not in repr(settings)
    assert KEY not in json.dumps(describe(settings))
    assert describe(settings)["serve"]["api_keys"] == "***"
    assert KEY in settings.secrets()  # redacted wherever upstream text is
