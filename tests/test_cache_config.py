"""Configuring the cache: the three ways, and every bad input as a ConfigError naming
the problem before any I/O, without a secret in sight."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import polygate
from polygate._config_load import describe, settings_from_env, settings_from_toml
from polygate.cache import parse_cache_url

PASSWORD = "cache-SECRET-pw-42"


def _scope(**kw: Any) -> polygate.Scope:
    return polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")], **kw)


def _settings(cache: str = "off", **scope: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": _scope(**scope)}, cache=cache)


def test_defaults() -> None:
    settings = _settings()
    assert settings.cache == "off"
    assert settings.scopes["chat"].cache_ttl_s is None


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("off", "off"),
        ("memory", "memory"),
        ("memory://", "memory"),
        ("memory?max_entries=10&max_bytes=4096", "memory"),
        ("sqlite:///var/tmp/cache.db", "sqlite"),
        ("sqlite:///var/tmp/cache.db?timeout_s=0.5", "sqlite"),
        ("sqlite://", "sqlite"),
        ("redis://localhost:6379/2", "redis"),
        (f"redis://user:{PASSWORD}@localhost/0?prefix=app:c&timeout_s=0.2", "redis"),
        ("rediss://h:6380/0?ssl_cert_reqs=none", "redis"),
    ],
)
def test_good_urls(url: str, kind: str) -> None:
    options = parse_cache_url(url)
    assert options.kind == kind
    assert _settings(url).cache == url
    assert PASSWORD not in repr(options) and PASSWORD not in options.where()


def test_parsed_options() -> None:
    memory = parse_cache_url("memory?max_entries=10&max_bytes=4096")
    assert (memory.max_entries, memory.max_bytes) == (10, 4096)
    sqlite = parse_cache_url("sqlite:///var/tmp/c.db?timeout_s=0.5")
    assert sqlite.path == Path("/var/tmp/c.db") and sqlite.timeout_s == 0.5
    assert parse_cache_url("sqlite://").path is None  # the default file
    redis = parse_cache_url(f"redis://bob:{PASSWORD}@h:7000/3?prefix=p&timeout_s=0.2")
    assert (redis.host, redis.port, redis.db, redis.username, redis.password) == ("h", 7000, 3, "bob", PASSWORD)
    assert (redis.prefix, redis.timeout_s) == ("p", 0.2)
    assert redis.where() == "redis://bob@h:7000/3"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("", "unknown cache"),
        ("on", "unknown cache"),
        ("memcached://h:11211", "unknown cache"),
        ("postgresql://db/x", "unknown cache"),
        ("memory?max_entries=0", "max_entries must be a whole number"),
        ("memory?max_entries=ten", "max_entries must be a whole number"),
        ("memory?max_bytes=10", "max_bytes must be a whole number"),
        ("memory?size=1", "unknown option 'size' for a memory cache"),
        ("sqlite:relative.db", "three slashes"),
        ("sqlite://host/path.db", "three slashes"),
        ("sqlite:///x.db?timeout_s=0", "timeout_s must be a number of seconds"),
        ("sqlite:///x.db?timeout_s=nan", "timeout_s must be a number of seconds"),
        ("sqlite:///x.db?journal=off", "unknown option 'journal' for a sqlite cache"),
        # A path no file can have: a bare ValueError ("embedded null byte") or a
        # UnicodeEncodeError when the session opened it, before.
        # The path ended at '#': "run#1.db" opened "run" (an outside review, 2026-12-05).
        ("sqlite:///tmp/run#1.db", "unencoded '#'"),
        ("sqlite:///tmp/run.db#", "unencoded '#'"),
        ("sqlite:///tmp/x%00y.db", "cannot hold a NUL character"),
        ("sqlite:///tmp/x\x00y.db", "cannot hold a NUL character"),
        ("sqlite:///tmp/x\ud83dy.db", "cannot name"),
        ("redis://", "has no host"),
        ("redis://h:99999/0", "is not a valid URL"),
        ("redis://h/zero", "must be a number"),
        ("redis://h/0#x", "is not a valid URL"),  # (as Settings.backend says)
        # int() reads these as 15, 1 and 1: a typo would pick another database.
        ("redis://h/1_5", "must be a number, got '1_5'"),
        ("redis://h/\u0661", "must be a number"),
        ("redis://h/+1", "must be a number"),
        ("redis://h/-1", "must be >= 0"),
        ("redis://h:0/0", "port in 'redis://h:0/0' must be 1 to 65535"),  # (it meant 6379)
        ("redis://h/0?timeout_s=-1", "timeout_s must be"),
        ("redis://h/0?prefix=", "option prefix"),
        ("redis://h/0?db=3", "unknown option 'db' for a redis cache"),
        ("redis://h/0?ssl_cert_reqs=none", "need a rediss:// URL"),
        ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
        ("rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs names no file"),
    ],
)
def test_bad_urls(url: str, problem: str) -> None:
    with pytest.raises(polygate.ConfigError, match=problem):
        parse_cache_url(url)
    with pytest.raises(polygate.ConfigError, match=r"Settings\.cache: .*" + problem):
        _settings(url)


@pytest.mark.parametrize("content", ["not a certificate\n", "", "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"])
@pytest.mark.parametrize("kind", ["cache", "backend"])
def test_a_ca_file_without_a_certificate_is_a_config_error(tmp_path: Path, content: str, kind: str) -> None:
    """A ``ssl_ca_certs`` file that is there but holds no CA certificate (empty, a key,
    another file) is refused with the settings, by both readers of a Redis URL: it was
    a bare ``ssl.SSLError`` at session open, ``check-config`` calling it valid."""
    from polygate.governance._redis import parse_redis_url

    bad = tmp_path / "ca.pem"
    bad.write_text(content)
    url = f"rediss://:pw-SECRET@h/0?ssl_ca_certs={bad}"
    with pytest.raises(polygate.ConfigError, match="ssl_ca_certs holds no CA certificate") as caught:
        parse_cache_url(url) if kind == "cache" else parse_redis_url(url)
    assert "pw-SECRET" not in str(caught.value)


@pytest.mark.parametrize(("db", "problem"), [
    ("1_5", "must be a number"), ("\u0661", "must be a number"), ("+1", "must be a number"),
    ("-1", "must be >= 0"),
])
def test_the_backends_database_is_ascii_digits(db: str, problem: str) -> None:
    """The governance backend reads its URL's address with the cache's reader."""
    from polygate.governance._redis import parse_redis_url

    with pytest.raises(polygate.ConfigError, match=problem):
        parse_redis_url(f"redis://h/{db}")
    assert parse_redis_url("redis://h/15").db == 15


def test_not_a_string() -> None:
    with pytest.raises(polygate.ConfigError, match=r"Settings\.cache"):
        _settings(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        f"redis://u:{PASSWORD}@h/0?nope=1",
        f"redis://u:{PASSWORD}@h/x",
        f"redis://u:{PASSWORD}@h:99999/0",
        f"u:{PASSWORD}@h:6379",
        f"memcached://u:{PASSWORD}@h",
    ],
)
def test_no_password_in_messages(url: str) -> None:
    with pytest.raises(polygate.ConfigError) as info:
        _settings(url)
    assert PASSWORD not in str(info.value)
    env = {"POLYGATE__CACHE": url, "POLYGATE__CHAT__A__BASE_URL": "http://a/v1"}
    with pytest.raises(polygate.ConfigError) as env_info:
        settings_from_env(env)
    assert "POLYGATE__CACHE" in str(env_info.value)
    assert PASSWORD not in str(env_info.value)


def test_password_never_shown() -> None:
    url = f"redis://u:{PASSWORD}@h:6379/0"
    settings = _settings(url, cache_ttl_s=5)
    assert PASSWORD not in repr(settings)
    assert PASSWORD not in str(describe(settings))
    assert PASSWORD in settings.secrets()  # so upstream text and rows are redacted


@pytest.mark.parametrize("ttl", [0, -1, -0.5, math.nan, math.inf, "60", True])
def test_bad_ttl(ttl: Any) -> None:
    with pytest.raises(polygate.ConfigError, match="cache_ttl_s"):
        _scope(cache_ttl_s=ttl)


def test_env_and_toml(tmp_path: Path) -> None:
    env = {
        "POLYGATE__CACHE": "memory?max_entries=100",
        "POLYGATE__CHAT__CACHE_TTL_S": "600",
        "POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
    }
    from_env = settings_from_env(env)
    assert from_env.cache == "memory?max_entries=100"
    assert from_env.scopes["chat"].cache_ttl_s == 600.0
    path = tmp_path / "polygate.toml"
    path.write_text(
        'cache = "memory?max_entries=100"\n'
        "[scopes.chat]\ncache_ttl_s = 600\n"
        '[scopes.chat.sources.a]\nbase_url = "http://a/v1"\n'
    )
    assert settings_from_toml(path) == from_env


@pytest.mark.parametrize(
    ("env", "where"),
    [
        ({"POLYGATE__CACHE": "memcached://h"}, "POLYGATE__CACHE"),
        ({"POLYGATE__CHAT__CACHE_TTL_S": "0"}, "POLYGATE__CHAT__CACHE_TTL_S"),
        ({"POLYGATE__CHAT__CACHE_TTL_S": "nan"}, "POLYGATE__CHAT__CACHE_TTL_S"),
        ({"POLYGATE__CHAT__CACHE_TTL_S": "soon"}, "POLYGATE__CHAT__CACHE_TTL_S"),
    ],
)
def test_env_errors_name_the_key(env: dict[str, str], where: str) -> None:
    with pytest.raises(polygate.ConfigError, match=where):
        settings_from_env({**env, "POLYGATE__CHAT__A__BASE_URL": "http://a/v1"})


def test_toml_errors_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "polygate.toml"
    path.write_text('[scopes.chat]\ncache_ttl_s = -5\n[scopes.chat.sources.a]\nbase_url = "http://a/v1"\n')
    with pytest.raises(polygate.ConfigError, match=r"scopes\.chat\.cache_ttl_s: must be a finite number > 0"):
        settings_from_toml(path)


def test_reserved_names() -> None:
    with pytest.raises(polygate.ConfigError, match="reserved"):
        polygate.Source(name="cache_ttl_s", base_url="http://a/v1")
    with pytest.raises(polygate.ConfigError, match="reserved"):
        polygate.Settings(scopes={"cache": _scope()})


async def test_unusable_sqlite_file_fails_at_session_start(tmp_path: Path) -> None:
    folder = tmp_path / "a-folder.db"
    folder.mkdir()
    settings = _settings(f"sqlite://{folder}", cache_ttl_s=5)
    with pytest.raises(polygate.ConfigError, match="cache database"):
        async with polygate.session(settings):
            pass


@pytest.mark.parametrize("password", ["k9Xq#2mT7vLr", "k9Xq/2mT7vLr", "k9Xq?2mT7vLr", "ab#"])
def test_a_cache_url_that_cannot_be_parsed_shows_no_part_of_its_password(password: str) -> None:
    """Review: a cache URL whose password held an unencoded ``#`` quoted the parser's
    error text, "Port could not be cast to integer value as 'k9Xq'": the password's
    start (masking covers runs of 6 characters or more).  The backend's URL already
    had wording that quotes nothing; the cache's has it too."""
    url = f"redis://u:{password}@cache.internal:6379/0"
    with pytest.raises(polygate.ConfigError, match=r"Settings\.cache: .* is not a valid URL") as info:
        _settings(url)
    assert password[:3] not in str(info.value)
