"""The three ways of configuring — Python objects, environment keys, TOML — agree.

Every configuration here is written once, TOML-shaped (``{"scopes": {"chat":
{"sources": {"a": {...}}}}}``), and built three ways by the ``build`` fixture; an
error must name the field (objects), the key (``POLYGATE__CHAT__A__RPM``) or the TOML
path (``scopes.chat.sources.a.rpm``).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from polygate._config import (
    Breaker,
    ConfigWarning,
    Hedge,
    Ocr,
    Retry,
    Scope,
    Serve,
    Settings,
    Source,
    StreamWatch,
    Structured,
)
from polygate._config_load import (
    describe,
    load_settings,
    locate_config,
    settings_from_env,
    settings_from_toml,
)
from polygate._errors import ConfigError

Config = dict[str, Any]
Build = Callable[[Config], Settings]

KEY = "sk-test-SECRET-1234567890"
REDIS_PW = "redis-PASSWORD-42"
URL_PW = "url-PASSWORD-77"
URL_A = "http://127.0.0.1:8001/v1"
URL_B = "http://127.0.0.1:8002/v1"
GATEWAY_KEY = "sk-gw-SECRET-0987654321"
SECRETS = (KEY, REDIS_PW, URL_PW, GATEWAY_KEY)


# --------------------------------------------------------------------------- the harness


def two_sources(**chat: Any) -> Config:
    """A valid base: scope chat with sources a and b."""
    return {"scopes": {"chat": {"sources": {"a": {"base_url": URL_A}, "b": {"base_url": URL_B}},
                                **chat}}}


def with_values(config: Config, **paths: Any) -> Config:
    """A copy with ``scopes__chat__sources__a__rpm=2`` style assignments (``__`` = ``.``)."""
    out = copy.deepcopy(config)
    for dotted, value in paths.items():
        *parents, last = dotted.split("__")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def to_objects(config: Config) -> Settings:
    scopes = {}
    for name, table in config["scopes"].items():
        table = dict(table)
        sources = [Source(name=n, **fields) for n, fields in table.pop("sources").items()]
        groups: dict[str, Any] = {g: cls(**table.pop(g)) for g, cls in
                  (("hedge", Hedge), ("retry", Retry), ("stream", StreamWatch),
                   ("breaker", Breaker), ("structured", Structured), ("ocr", Ocr)) if g in table}
        scopes[name] = Scope(sources=sources, **groups, **table)
    top = {k: v for k, v in config.items() if k not in ("scopes", "serve")}
    if "serve" in config:
        top["serve"] = Serve(**config["serve"])
    return Settings(scopes=scopes, **top)


def env_key(path: str) -> str:
    """``scopes.chat.sources.a.rpm`` → ``POLYGATE__CHAT__A__RPM``."""
    parts = path.split(".")
    if parts[0] == "scopes":
        parts = parts[1:]
        if len(parts) > 1 and parts[1] == "sources":
            del parts[1]
    return "POLYGATE__" + "__".join(p.upper() for p in parts)


def env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def leaves(node: Config, path: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        here = f"{path}.{key}" if path else key
        if isinstance(value, dict):
            yield from leaves(value, here)
        else:
            yield here, value


def to_env(config: Config) -> dict[str, str]:
    config = dict(config)
    serve = dict(config.pop("serve", {}))
    env = {env_key(path): env_text(value) for path, value in leaves(config)}
    # [serve]: a list is comma-separated, the models table is alias=scope pairs.
    if "api_keys" in serve:
        env["POLYGATE__SERVE__API_KEYS"] = ",".join(serve.pop("api_keys"))
    if "models" in serve:
        env["POLYGATE__SERVE__MODELS"] = ",".join(f"{a}={s}" for a, s in serve.pop("models").items())
    for name, fields in serve.pop("keys", {}).items():
        env.update({f"POLYGATE__SERVE__KEYS__{name.upper()}__{f.upper()}": env_text(v)
                    for f, v in fields.items()})
    env.update({f"POLYGATE__SERVE__{k.upper()}": env_text(v) for k, v in serve.items()})
    return env


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, str | list):
        return json.dumps(value)
    return repr(value)


def to_toml(node: Config, path: str = "") -> str:
    scalars = [f"{k} = {toml_value(v)}" for k, v in node.items() if not isinstance(v, dict)]
    lines = [f"[{path}]", *scalars] if path and scalars else scalars
    tables = [to_toml(v, f"{path}.{k}" if path else k)
              for k, v in node.items() if isinstance(v, dict)]
    return "\n".join([*lines, *tables]) + "\n"


def write(tmp_path: Path, text: str, name: str = "polygate.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


WAYS = ["objects", "env", "toml"]


def builder(way: str, tmp_path: Path) -> Build:
    if way == "objects":
        return to_objects
    if way == "env":
        return lambda config: settings_from_env(to_env(config))
    return lambda config: settings_from_toml(write(tmp_path, to_toml(config)), env={})


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def build(way: str, tmp_path: Path) -> Build:
    return builder(way, tmp_path)


def name_in(way: str, path: str) -> str:
    """How an error must name ``path`` when built ``way``."""
    if way == "env":
        return env_key(path)
    if way == "toml":
        return f"polygate.toml: {path}"
    return path.rsplit(".", 1)[-1]


def test_harness_writes_what_it_means(tmp_path: Path) -> None:
    config = with_values(two_sources(), scopes__chat__hedge__after_s=8.0)
    assert to_env(config)["POLYGATE__CHAT__HEDGE__AFTER_S"] == "8.0"
    assert "[scopes.chat.hedge]\nafter_s = 8.0" in to_toml(config)


# --------------------------------------------------------------------------- equal Settings

FULL: Config = {
    "backend": f"redis://:{REDIS_PW}@localhost:6379/0",
    "telemetry": "sqlite:///tmp/polygate.db",
    "max_body_bytes": 1000,
    "max_line_bytes": 100,
    "dead_cooldown_s": 60.5,
    "log_content": True,
    "telemetry_queue": 500,
    "telemetry_batch": 50,
    "telemetry_write_timeout_s": 12.5,
    "telemetry_close_timeout_s": 2.5,
    "cache": f"redis://:{REDIS_PW}@localhost:6379/1?prefix=app&timeout_s=0.2",
    "serve": {"host": "0.0.0.0", "port": 9000, "api_keys": [GATEWAY_KEY, "sk-gw-2"],
              "models": {"gpt-4o": "chat", "text-embedding-3-small": "embed"},
              "max_request_bytes": 1024, "max_connections": 10, "header_timeout_s": 1.5,
              "body_timeout_s": 2.5, "idle_timeout_s": 3.5, "send_timeout_s": 4.5,
              "sse_keepalive_s": 0.5, "grace_s": 5.5,
              "keys": {"team-a": {"key": "sk-gw-team-a", "rpm": 60, "tpm": 9000,
                                  "max_in_flight": 3}}},
    "scopes": {
        "chat": {
            "call_deadline_s": 120.0,
            "cache_ttl_s": 600.0,
            "embed_batch_size": 64,
            "completion_estimate_tokens": 512,
            "hedge": {"after_s": 8.0, "max_extra": 2, "stall_after_s": 5.0, "budget_ratio": 0.2,
                      "budget_burst": 4.0, "after_quantile": 0.95, "min_after_s": 2.0,
                      "max_after_s": 20.0},
            "retry": {"max_attempts": 5, "backoff_base_s": 0.5, "backoff_max_s": 4.0,
                      "rate_limit_wait_s": 30.0, "same_source_retries": 2},
            "stream": {"stall_timeout_s": 30.0, "stall_threshold_ms": 1500.0, "resume": True,
                       "max_resumes": 3},
            "breaker": {"failures": 3, "failure_rate": 0.75, "rate_window": 10,
                        "rate_min_calls": 6, "open_s": 2.0, "max_open_s": 40.0, "probes": 2},
            "fallback": "embed",
            "fallback_on": ["exhausted", "content_policy", "status:413"],
            "structured": {"max_reasks": 4},
            "ocr": {"dpi": 300.0, "max_side_px": 1024, "max_document_bytes": 1000000,
                    "max_concurrent_pages": 2, "prompt": "Transcribe this page.",
                    "image_format": "png", "render_in": "thread"},
            "sources": {
                "a": {"base_url": URL_A, "api_key": KEY, "model": "m1", "timeout_s": 250.0,
                      "ttft_timeout_s": 60.0, "rpm": 600, "tpm": 100000, "max_in_flight": 8,
                      "weight": 2.5, "streaming": False, "prefill": True,
                      "structured_output": "prompt"},
                "b": {"base_url": URL_B, "model": "m1"},
            },
        },
        "embed": {"sources": {"e": {"base_url": "https://embed.example/v1", "weight": 1.0}}},
    },
}

EQUAL_CASES = {
    "minimal": {"scopes": {"chat": {"sources": {"a": {"base_url": URL_A}}}}},
    "spec example": with_values(
        two_sources(call_deadline_s=120.0, hedge={"after_s": 8.0}),
        scopes__chat__sources__a__api_key=KEY, scopes__chat__sources__a__model="m1",
        scopes__chat__sources__a__timeout_s=300.0, scopes__chat__sources__b__model="m1",
    ),
    "full": FULL,
    "ints for floats": with_values(two_sources(), scopes__chat__sources__a__timeout_s=30,
                                   scopes__chat__hedge__after_s=8, dead_cooldown_s=5),
    "postgres telemetry": with_values(two_sources(),
                                      telemetry=f"postgresql://app:{REDIS_PW}@db:5432/t"),
    # in name order, which the environment's keys sorted whole are not (A-1__ before
    # A__, GPU10__ before GPU1__, A__ before A_B__ but AB__ before A_B__): a review
    # finding, the environment's sources came out in key order
    "names that sort apart as keys": {"scopes": {"chat": {"sources": {
        name: {"base_url": URL_A} for name in ("a", "a-1", "a_b", "ab", "gpu1", "gpu10")}}}},
}


@pytest.mark.parametrize("case", EQUAL_CASES)
def test_three_ways_build_equal_settings(case: str, tmp_path: Path) -> None:
    config = EQUAL_CASES[case]
    built = [builder(way, tmp_path)(config) for way in WAYS]
    assert built[0] == built[1] == built[2]


def test_full_case_sets_every_field() -> None:
    """Reminds whoever adds a settings field to add it to the equality table."""
    scope, source = FULL["scopes"]["chat"], FULL["scopes"]["chat"]["sources"]["a"]
    tables: list[tuple[type, dict[str, Any], set[str]]] = [
        (Settings, FULL, {"scopes", "serve"}),
        (Serve, FULL["serve"], set()),
        (Scope, scope, {"sources", "hedge", "retry", "stream", "breaker", "structured", "ocr"}),
        (Source, source, {"name"}),
        (Hedge, scope["hedge"], set()),
        (Retry, scope["retry"], set()),
        (StreamWatch, scope["stream"], set()),
        (Breaker, scope["breaker"], set()),
        (Structured, scope["structured"], set()),
        (Ocr, scope["ocr"], set()),
    ]
    for cls, table, structural in tables:
        missing = {f.name for f in attrs.fields(cls)} - set(table) - structural
        assert not missing, f"{cls.__name__} fields not covered: {missing}"
    for cls, table, structural in tables:
        for field in attrs.fields(cls):
            if field.name not in structural:
                assert table[field.name] != field.default, (cls.__name__, field.name)


def test_classmethods_delegate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = EQUAL_CASES["spec example"]
    for key, value in to_env(config).items():
        monkeypatch.setenv(key, value)
    assert Settings.from_env() == Settings.from_env(to_env(config)) == to_objects(config)
    assert Settings.from_toml(str(write(tmp_path, to_toml(config)))) == to_objects(config)


@hsettings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    timeout=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
    rpm=st.integers(min_value=1, max_value=2**40),
    weight=st.floats(min_value=1e-6, max_value=1e6),
    streaming=st.booleans(),
)
def test_numbers_round_trip_every_way(
    tmp_path: Path, timeout: float, rpm: int, weight: float, streaming: bool
) -> None:
    config = with_values(two_sources(), scopes__chat__sources__a__timeout_s=timeout,
                         scopes__chat__sources__a__rpm=rpm,
                         scopes__chat__sources__a__weight=weight,
                         scopes__chat__sources__a__streaming=streaming)
    built = [builder(way, tmp_path)(config) for way in WAYS]
    assert built[0] == built[1] == built[2]


# --------------------------------------------------------------------------- bad values

A = "scopes.chat.sources.a"
BAD: list[tuple[str, Any]] = [
    # (TOML path, value) — invalid however written
    *[(f"{A}.timeout_s", v) for v in (-1, 0, math.nan, math.inf, "abc", True)],
    *[(f"{A}.ttft_timeout_s", v) for v in (0, -2.5, math.nan)],
    *[(f"{A}.weight", v) for v in (0, -1, math.inf, "heavy")],
    *[(f"{A}.{f}", v) for f in ("rpm", "tpm", "max_in_flight") for v in (2.5, 0, -3, True, "ten")],
    *[(f"{A}.streaming", v) for v in (2, "maybe")],
    *[(f"{A}.base_url", v) for v in ("127.0.0.1:8000/v1", "localhost", "ftp://h/v1",
                                     "http://h:99999/v1")],
    *[("scopes.chat.hedge.after_s", v) for v in (-1, 0, math.nan, "soon", True)],
    *[("scopes.chat.hedge.max_extra", v) for v in (0, 4, 1.5, True)],
    *[("scopes.chat.hedge.stall_after_s", v) for v in (0, math.inf)],
    *[("scopes.chat.hedge.budget_ratio", v) for v in (1.5, -0.1, math.nan)],
    ("scopes.chat.hedge.budget_burst", 0),
    *[("scopes.chat.hedge.after_quantile", v) for v in (1.0, 0.0, -0.5, 2)],
    ("scopes.chat.hedge.min_after_s", 0),
    *[("scopes.chat.retry.max_attempts", v) for v in (0, 2.5, False)],
    *[("scopes.chat.retry.backoff_base_s", v) for v in (-1, math.nan)],
    ("scopes.chat.retry.backoff_max_s", 0.1),  # below the default backoff_base_s
    ("scopes.chat.retry.backoff_base_s", 10),  # past the default backoff_max_s (review: the
                                               # error named backoff_max_s, never written)
    ("scopes.chat.retry.rate_limit_wait_s", -5),
    ("scopes.chat.stream.stall_timeout_s", 0),
    *[("scopes.chat.structured.max_reasks", v) for v in (-1, 11, 1.5, True, "two")],
    *[(f"{A}.structured_output", v) for v in ("xml", "JSON_SCHEMA", 1)],
    *[("scopes.chat.ocr.dpi", v) for v in (0, 10, 5000, math.nan)],
    *[("scopes.chat.ocr.max_side_px", v) for v in (0, 32, 100000, 512.5)],
    *[("scopes.chat.ocr.max_document_bytes", v) for v in (0, -1, 1.5)],
    *[("scopes.chat.ocr.max_concurrent_pages", v) for v in (0, 65, True)],
    *[("scopes.chat.ocr.image_format", v) for v in ("gif", "PNG", 1)],
    *[("scopes.chat.ocr.render_in", v) for v in ("fork", "Thread", 1)],
    ("scopes.chat.stream.stall_threshold_ms", -1),
    *[("scopes.chat.call_deadline_s", v) for v in (0, math.nan, "1m")],
    *[("scopes.chat.embed_batch_size", v) for v in (0, 2.5)],
    ("scopes.chat.completion_estimate_tokens", -1),
    *[("backend", v) for v in ("redis//localhost", "postgresql://h/db", "mem")],
    *[("telemetry", v) for v in ("mysql://h/db", "sqlite:/relative.db", "on")],
    *[("max_body_bytes", v) for v in (0, 2.5)],
    ("max_line_bytes", -1),
    ("dead_cooldown_s", math.nan),
    ("log_content", "sometimes"),
]


@pytest.mark.parametrize(("path", "value"), BAD, ids=[f"{p}={v!r}" for p, v in BAD])
def test_bad_value_names_the_key(build: Build, way: str, path: str, value: Any) -> None:
    config = with_values(two_sources(), **{path.replace(".", "__"): value})
    with pytest.raises(ConfigError) as info:
        build(config)
    assert name_in(way, path) in str(info.value)


def test_messages_say_what_is_wrong(tmp_path: Path) -> None:
    cases: list[tuple[str, Any, str, str]] = [
        # path, value, the env message says, the TOML message says
        (f"{A}.rpm", 2.5, "expected a whole number, got '2.5'", "got a float (2.5)"),
        (f"{A}.timeout_s", "abc", "expected a number, got 'abc'", "expected a number, got a string"),
        (f"{A}.timeout_s", True, "expected a number, got 'true'", "got a boolean"),
        (f"{A}.timeout_s", math.nan, "finite", "finite"),
        ("scopes.chat.hedge.max_extra", 4, "[1, 3]", "[1, 3]"),
        ("log_content", "sometimes", "true/false/1/0/yes/no", "expected true or false"),
    ]
    for path, value, env_says, toml_says in cases:
        config = with_values(two_sources(), **{path.replace(".", "__"): value})
        with pytest.raises(ConfigError, match=None) as info:
            builder("env", tmp_path)(config)
        assert env_says in str(info.value)
        with pytest.raises(ConfigError) as info:
            builder("toml", tmp_path)(config)
        assert toml_says in str(info.value)


@pytest.mark.parametrize("reserved", ["hedge", "retry", "stream", "call_deadline_s"])
def test_reserved_segment_as_source_name(build: Build, way: str, reserved: str) -> None:
    config = with_values(two_sources(), **{f"scopes__chat__sources__{reserved}__base_url": URL_A})
    with pytest.raises(ConfigError) as info:
        build(config)
    expected = {
        "objects": "reserved",
        "env": f"POLYGATE__CHAT__{reserved.upper()}__BASE_URL",
        "toml": f"scopes.chat.sources.{reserved}",
    }[way]
    assert expected in str(info.value)
    assert "reserved" in str(info.value)


def test_duplicate_source_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'a' appears twice"):
        Scope(sources=[Source(name="a", base_url=URL_A), Source(name="a", base_url=URL_B)])
    text = f"""
[[scopes.chat.sources]]
name = "a"
base_url = "{URL_A}"
[[scopes.chat.sources]]
name = "a"
base_url = "{URL_B}"
"""
    with pytest.raises(ConfigError, match=r"polygate.toml: scopes\.chat\.sources: .*'a' appears twice"):
        settings_from_toml(write(tmp_path, text))
    # The environment cannot spell a duplicate: keys are unique, and upper case.
    with pytest.raises(ConfigError, match="upper case"):
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__a__BASE_URL": URL_B})


# --------------------------------------------------------------------------- assembly guards

GUARD_ERRORS = {
    "after_s >= min(timeout_s)": (
        with_values(two_sources(hedge={"after_s": 10.0}), scopes__chat__sources__b__timeout_s=10.0),
        "scopes.chat.hedge.after_s", "smallest source timeout_s",
    ),
    "after_s >= call_deadline_s": (
        two_sources(hedge={"after_s": 30.0}, call_deadline_s=20.0),
        "scopes.chat.hedge.after_s", "call_deadline_s",
    ),
    "max_after_s >= min(timeout_s)": (
        two_sources(hedge={"after_quantile": 0.9, "max_after_s": 400.0}),
        "scopes.chat.hedge.max_after_s", "timeout_s",
    ),
}


@pytest.mark.parametrize("case", GUARD_ERRORS)
def test_assembly_errors(build: Build, way: str, case: str) -> None:
    config, path, problem = GUARD_ERRORS[case]
    with pytest.raises(ConfigError) as info:
        build(config)
    message = str(info.value)
    assert problem in message
    assert (path.split(".", 2)[2] if way == "objects" else name_in(way, path)) in message


GUARD_WARNINGS = {
    "after_s >= min(ttft_timeout_s)": (
        with_values(two_sources(hedge={"after_s": 8.0}), scopes__chat__sources__a__ttft_timeout_s=5.0),
        "scopes.chat.hedge.after_s", "ttft_timeout_s",
    ),
    "single source, after_s": (
        {"scopes": {"chat": {"sources": {"a": {"base_url": URL_A}}, "hedge": {"after_s": 8.0}}}},
        "scopes.chat", "single source",
    ),
    "stall_after_s without after_s": (
        {"scopes": {"chat": {"sources": {"a": {"base_url": URL_A}, "b": {"base_url": URL_B}},
                             "hedge": {"stall_after_s": 5.0}}}},
        "scopes.chat.hedge.stall_after_s", "does nothing without",
    ),
    "single source, after_quantile": (
        {"scopes": {"chat": {"sources": {"a": {"base_url": URL_A}},
                             "hedge": {"after_quantile": 0.9}}}},
        "scopes.chat", "single source",
    ),
}


@pytest.mark.parametrize("case", GUARD_WARNINGS)
def test_assembly_warnings(build: Build, way: str, case: str) -> None:
    config, path, problem = GUARD_WARNINGS[case]
    with pytest.warns(ConfigWarning, match=problem) as record:
        settings = build(config)
    assert isinstance(settings, Settings)
    message = str(record[0].message)
    if way == "env":
        assert env_key(path) in message
    elif way == "toml":
        assert f"polygate.toml: {path}" in message


def test_warning_points_at_the_caller(tmp_path: Path) -> None:
    config = GUARD_WARNINGS["single source, after_s"][0]
    with pytest.warns(ConfigWarning) as record:
        settings_from_env(to_env(config))
    assert record[0].filename == __file__


# --------------------------------------------------------------------------- environment


def test_no_keys_at_all() -> None:
    for env in ({}, {"PATH": "/bin"}, {"POLYGATE__CHAT__A__BASE_URL": "  "}):
        with pytest.raises(ConfigError) as info:
            settings_from_env(env)
        message = str(info.value)
        assert "no polygate configuration found" in message
        for hint in ("POLYGATE_CONFIG", "./polygate.toml", "POLYGATE__"):
            assert hint in message


def test_empty_value_is_unset() -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__A__TIMEOUT_S": "",
           "POLYGATE__CHAT__B__MODEL": ""}
    scope = settings_from_env(env).scopes["chat"]
    assert [s.name for s in scope.sources] == ["a"]
    assert scope.sources[0].timeout_s == 300


def test_values_are_stripped() -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": f" {URL_A}\n", "POLYGATE__CHAT__A__RPM": " 60 "}
    source = settings_from_env(env).scopes["chat"].sources[0]
    assert (source.base_url, source.rpm) == (URL_A, 60)


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
     ("false", False), ("0", False), ("no", False), ("NO", False)],
)
def test_env_booleans(text: str, value: bool) -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__A__STREAMING": text,
           "POLYGATE__LOG_CONTENT": text}
    settings = settings_from_env(env)
    assert settings.scopes["chat"].sources[0].streaming is value
    assert settings.log_content is value


def test_env_names_are_lower_cased_and_sources_sorted() -> None:
    env = {"POLYGATE__CHAT__ZED__BASE_URL": URL_B, "POLYGATE__CHAT__MY_SRC__BASE_URL": URL_A,
           "POLYGATE__EMBED__E-1__BASE_URL": URL_A}
    settings = settings_from_env(env)
    assert sorted(settings.scopes) == ["chat", "embed"]
    assert [s.name for s in settings.scopes["chat"].sources] == ["my_src", "zed"]
    assert settings.scopes["embed"].sources[0].name == "e-1"


UNKNOWN_KEYS = {
    "POLYGATE__CHAT__A__TIMEOUT": "did you mean TIMEOUT_S?",
    "POLYGATE__CHAT__HEDGE__AFTER": "did you mean AFTER_S?",
    "POLYGATE__CHAT__RETRY__MAX_ATTEMPT": "did you mean MAX_ATTEMPTS?",
    "POLYGATE__CHAT__STREAM__STALL_TIMEOUT": "did you mean STALL_TIMEOUT_S?",
    "POLYGATE__CHAT__TIMEOUT_S": "scope keys are CALL_DEADLINE_S",
    "POLYGATE__CHAT__CALL_DEADLINE": "did you mean CALL_DEADLINE_S?",
    "POLYGATE__TELEMETRYY": "did you mean TELEMETRY?",
    "POLYGATE__CHAT__A__NAME": "source fields are BASE_URL",
    "POLYGATE__CHAT__A__B__BASE_URL": "too many segments",
    "POLYGATE__CHAT__HEDGE__BASE_URL": "HEDGE is reserved",
    "POLYGATE__CHAT__STRUCTURED__BASE_URL": "STRUCTURED is reserved",
    "POLYGATE__CHAT__OCR__BASE_URL": "OCR is reserved",
    "POLYGATE__CHAT__OCR__DPY": "did you mean DPI?",
    "POLYGATE__CHAT__STRUCTURED__MAX_REASK": "did you mean MAX_REASKS?",
    "POLYGATE__CHAT__CALL_DEADLINE_S__BASE_URL": "CALL_DEADLINE_S is a scope setting",
    "POLYGATE__Chat__A__BASE_URL": "upper case",
    # A lower-case prefix was skipped without a word: the setting stayed at its default.
    "polygate__CHAT__A__TIMEOUT_S": "upper case",
    "Polygate__CHAT__A__TIMEOUT_S": "upper case",
    # An empty segment was read as a source named "" whose BASE_URL was missing.
    "POLYGATE__CHAT____TIMEOUT_S": "an empty segment",
    "POLYGATE__CHAT__A__": "an empty segment",
    "POLYGATE__SERVE__": "an empty segment",
}


@pytest.mark.parametrize("key", UNKNOWN_KEYS)
def test_unknown_env_keys(key: str) -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__B__BASE_URL": URL_B, key: "1"}
    with pytest.raises(ConfigError) as info:
        settings_from_env(env)
    assert key in str(info.value)
    assert UNKNOWN_KEYS[key] in str(info.value)


def test_a_name_ending_in_an_underscore_has_an_env_spelling() -> None:
    """Names may end in '_' (never begin with one): ``…__GPU___BASE_URL`` is the source
    ``gpu_``.  A plain split read it as ``GPU`` and ``_BASE_URL`` ("unknown key"), a
    scope ``chat_`` as ``chat`` with a source ``_a``, and a serve key ``team_`` was
    unknown (an outside review, 2026-12-05)."""
    env = {"POLYGATE__CHAT__GPU___BASE_URL": URL_A, "POLYGATE__CHAT__GPU___API_KEY": KEY,
           "POLYGATE__CHAT___A__BASE_URL": URL_B,
           "POLYGATE__SERVE__KEYS__TEAM___KEY": "gk-team", "POLYGATE__SERVE__KEYS__TEAM___RPM": "5"}
    settings = settings_from_env(env)
    [gpu] = settings.scopes["chat"].sources
    assert (gpu.name, gpu.base_url, gpu.api_key) == ("gpu_", URL_A, KEY)
    assert [s.name for s in settings.scopes["chat_"].sources] == ["a"]
    assert settings.serve.keys["team_"].rpm == 5
    # The same settings as Python objects write it so.
    from polygate import Scope, Settings, Source

    assert settings == Settings(
        scopes={"chat": Scope(sources=[Source(name="gpu_", base_url=URL_A, api_key=KEY)]),
                "chat_": Scope(sources=[Source(name="a", base_url=URL_B)])},
        serve=settings.serve)


def test_a_key_that_is_not_ascii_is_refused() -> None:
    """The Kelvin sign is upper case and lower-cases to 'k': ``API_\u212aEY`` set api_key,
    beside ``API_KEY`` (one of the two won), and the secrets' scrub did not know its
    value; the message writes the key escaped, as it looks like the one it mimics."""
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__A__API_\u212aEY": KEY}
    with pytest.raises(ConfigError, match="upper case ASCII") as info:
        settings_from_env(env)
    assert "API_\\u212aEY" in str(info.value) and KEY not in str(info.value)
    with pytest.raises(ConfigError):
        settings_from_env({"POLYGATE__CHAT__\u212a__BASE_URL": URL_A})
    with pytest.raises(ConfigError):
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": URL_A,
                           "POLYGATE__SERVE__KEYS__\u212a__KEY": "gk-x"})


def test_missing_base_url_names_the_key() -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__B__MODEL": "m1",
           "POLYGATE__CHAT__B__API_KEY": KEY}
    with pytest.raises(ConfigError, match="POLYGATE__CHAT__B__BASE_URL is missing") as info:
        settings_from_env(env)
    assert KEY not in str(info.value)


@pytest.mark.parametrize(
    "key", ["POLYGATE__CHAT__HEDGE__AFTER_S", "POLYGATE__CHAT__RETRY__MAX_ATTEMPTS",
            "POLYGATE__CHAT__CALL_DEADLINE_S"],
)
def test_scope_without_sources(key: str) -> None:
    env = {"POLYGATE__EMBED__E__BASE_URL": URL_A, key: "3"}
    with pytest.raises(ConfigError, match="scope 'chat' has no sources") as info:
        settings_from_env(env)
    assert key in str(info.value)
    assert "POLYGATE__CHAT__{SOURCE}__BASE_URL" in str(info.value)


def test_a_scope_may_be_named_like_a_group() -> None:
    """``ocr`` is Session.ocr's default scope: STRUCTURED and OCR are reserved for
    sources only (a scope name is the first segment and cannot collide)."""
    env = {"POLYGATE__OCR__A__BASE_URL": URL_A, "POLYGATE__OCR__OCR__DPI": "300",
           "POLYGATE__STRUCTURED__A__BASE_URL": URL_B,
           "POLYGATE__STRUCTURED__STRUCTURED__MAX_REASKS": "0"}
    settings = settings_from_env(env)
    assert settings.scopes["ocr"].ocr.dpi == 300
    assert settings.scopes["structured"].structured.max_reasks == 0
    for name in ("ocr", "OCR", "structured"):
        with pytest.raises(ConfigError, match="reserved"):
            Source(name=name, base_url=URL_A)


def test_only_top_level_keys() -> None:
    with pytest.raises(ConfigError, match=r"no scope is configured.*POLYGATE__BACKEND"):
        settings_from_env({"POLYGATE__BACKEND": "memory"})


def test_other_prefixes_are_ignored() -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE_CONFIG": "", "POLYGATEX__Y": "1",
           "OTHER": "x"}
    assert settings_from_env(env).scopes["chat"].sources[0].base_url == URL_A


# --------------------------------------------------------------------------- TOML


def test_toml_array_of_sources_equals_tables(tmp_path: Path) -> None:
    tables = f"""
[scopes.chat.sources.a]
base_url = "{URL_A}"
rpm = 60
[scopes.chat.sources.b]
base_url = "{URL_B}"
"""
    arrays = f"""
[[scopes.chat.sources]]
name = "a"
base_url = "{URL_A}"
rpm = 60
[[scopes.chat.sources]]
name = "b"
base_url = "{URL_B}"
"""
    one = settings_from_toml(write(tmp_path, tables, "t.toml"))
    two = settings_from_toml(write(tmp_path, arrays, "a.toml"))
    assert one == two == to_objects(with_values(two_sources(), scopes__chat__sources__a__rpm=60))


TOML_ERRORS = {
    "unknown top-level key": ("backendd = 'memory'\n", "polygate.toml: backendd",
                              "did you mean backend?"),
    "unknown scope key": ("[scopes.chat]\ntimeout_s = 3\n", "scopes.chat.timeout_s",
                          "scope keys are"),
    "unknown source key": ("[scopes.chat.sources.a]\ntimeout = 3\n", "scopes.chat.sources.a.timeout",
                           "did you mean timeout_s?"),
    "unknown hedge key": ("[scopes.chat.hedge]\nafter = 3\n", "scopes.chat.hedge.after",
                          "did you mean after_s?"),
    "unknown retry key": ("[scopes.chat.retry]\nattempts = 3\n", "scopes.chat.retry.attempts",
                          "retry keys are"),
    "scopes not a table": ("scopes = 5\n", "polygate.toml: scopes", "expected a table"),
    "scope not a table": ("[scopes]\nchat = 5\n", "scopes.chat", "expected a table"),
    "hedge not a table": ("[scopes.chat]\nhedge = 8\n", "scopes.chat.hedge", "expected a table"),
    "sources not a table": ("[scopes.chat]\nsources = 'a'\n", "scopes.chat.sources",
                            "expected a table"),
    "source not a table": ("[scopes.chat.sources]\na = 'x'\n", "scopes.chat.sources.a",
                           "expected a table"),
    "array source without name": ("[[scopes.chat.sources]]\nbase_url = 'http://h'\n",
                                  "scopes.chat.sources[0]", "needs a name"),
    "name key in a table source": ("[scopes.chat.sources.a]\nname = 'a'\nbase_url = 'http://h'\n",
                                   "scopes.chat.sources.a.name", "table key names the source"),
    "missing base_url": ("[scopes.chat.sources.a]\nmodel = 'm'\n",
                         "scopes.chat.sources.a.base_url is missing", "no base_url"),
    "no sources": ("[scopes.chat.hedge]\nafter_s = 3.0\n", "scopes.chat.sources", "no sources"),
    "no scopes": ("backend = 'memory'\n", "polygate.toml: scopes", "no scope is configured"),
    "empty file": ("", "polygate.toml: scopes", "no scope is configured"),
    "bad scope name": ("[scopes.'a b'.sources.x]\nbase_url = 'http://h'\n", "polygate.toml: scopes",
                       "scope name 'a b'"),
    "bad source name": ('[scopes.chat.sources."a b"]\nbase_url = "http://h"\n',
                        'scopes.chat.sources."a b"', "must start with a letter or digit"),
    "reserved upper case": ("[scopes.chat.sources.HEDGE]\nbase_url = 'http://h'\n",
                            "scopes.chat.sources.HEDGE", "reserved"),
    "number as string": ("[scopes.chat.sources.a]\nbase_url = 'http://h'\nrpm = '60'\n",
                         "scopes.chat.sources.a.rpm", "without quotes"),
    "string as bool": ("log_content = 'yes'\n", "polygate.toml: log_content", "true or false"),
    "date as number": ("dead_cooldown_s = 1979-05-27\n", "dead_cooldown_s", "a date or time"),
    "array as string": ("backend = ['memory']\n", "polygate.toml: backend", "an array"),
    "syntax error": ("[scopes.chat\n", "polygate.toml: invalid TOML", "line 1"),
}


@pytest.mark.parametrize("case", TOML_ERRORS)
def test_toml_errors_name_the_path(tmp_path: Path, case: str) -> None:
    text, where, problem = TOML_ERRORS[case]
    with pytest.raises(ConfigError) as info:
        settings_from_toml(write(tmp_path, text))
    assert where in str(info.value)
    assert problem in str(info.value)


def test_toml_file_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml: configuration file not found"):
        settings_from_toml(missing)
    with pytest.raises(ConfigError, match="cannot read"):
        settings_from_toml(tmp_path)
    binary = tmp_path / "latin1.toml"
    binary.write_bytes(b"backend = '\xe9'\n")
    with pytest.raises(ConfigError, match=r"latin1\.toml: (invalid TOML|.*not UTF-8)"):
        settings_from_toml(binary)


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    # Windows editors write one; tomllib alone reports "invalid statement" at 1:1.
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\n".encode())
    assert settings_from_toml(path).scopes["chat"].sources[0].base_url == URL_A


def test_a_toml_path_to_an_endless_device_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"/dev/zero: the configuration file is larger than 16 MiB"):
        settings_from_toml(Path("/dev/zero"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_toml_path_to_a_named_pipe_never_hangs(tmp_path: Path) -> None:
    """Outside review (fuzzing the configuration): ``from_toml`` and ``check-config
    --config`` on a named pipe nobody writes to waited in open() for ever.  It reads as
    empty (so: no scope), and a pipe with a writer (``--config <(...)``) is read."""
    import threading

    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    outcome: list[object] = []

    def load() -> None:
        try:
            outcome.append(settings_from_toml(fifo))
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(5.0)
    if reader.is_alive():  # the bug: free the reader (a writer's open ends its wait)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5.0)
        pytest.fail("reading a named pipe with no writer hung")
    [error] = outcome
    assert isinstance(error, ConfigError) and "no scope is configured" in str(error), error

    # A shell's ``<(...)``: a pipe whose writer is there (here, has written and left).
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\n".encode())
        os.close(write_end)
        piped = settings_from_toml(Path(f"/dev/fd/{read_end}"))
    finally:
        os.close(read_end)
    assert piped.scopes["chat"].sources[0].base_url == URL_A


def test_api_key_env(tmp_path: Path) -> None:
    text = f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\napi_key_env = 'CHAT_KEY'\n"
    path = write(tmp_path, text)
    settings = settings_from_toml(path, env={"CHAT_KEY": KEY})
    assert settings.scopes["chat"].sources[0].api_key == KEY
    with pytest.raises(ConfigError, match="api_key_env: environment variable CHAT_KEY is not set"):
        settings_from_toml(path, env={})
    # Set to nothing but blanks: said so (review: "is not set" sent the operator to
    # look for a variable that was there).
    with pytest.raises(ConfigError, match="environment variable CHAT_KEY is set but empty"):
        settings_from_toml(path, env={"CHAT_KEY": "  "})
    both = write(tmp_path, text + f"api_key = '{KEY}'\n", "both.toml")
    with pytest.raises(ConfigError, match="set api_key or api_key_env, not both") as info:
        settings_from_toml(both, env={"CHAT_KEY": KEY})
    assert KEY not in str(info.value)


def test_api_key_env_defaults_to_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYGATE_TEST_CHAT_KEY", KEY)
    text = f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\napi_key_env = 'POLYGATE_TEST_CHAT_KEY'\n"
    assert settings_from_toml(write(tmp_path, text)).scopes["chat"].sources[0].api_key == KEY


def test_api_key_env_bad_secret_is_not_echoed(tmp_path: Path) -> None:
    text = f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\napi_key_env = 'K'\n"
    with pytest.raises(ConfigError, match="api_key_env: must be printable ASCII") as info:
        settings_from_toml(write(tmp_path, text), env={"K": f"{KEY}\r\nx"})
    assert KEY not in str(info.value)


@pytest.mark.parametrize("entry", ["[scopes.chat.sources.a]\napi_key_env", "[serve]\napi_keys_env"])
def test_a_key_pasted_in_place_of_a_variable_name_is_not_echoed(tmp_path: Path, entry: str) -> None:
    """Review: ``api_key_env = "<the key>"`` (a likely slip) said "environment variable
    sk-… is not set", the key in the message.  A value that cannot be a variable's
    name is not quoted."""
    pasted = "sk-live-7Hq2w9XPz" + "Lk4mN8"
    table, name = entry.split("\n")
    text = (f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\n" if table.startswith("[serve") else "")
    text += f"{table}\n" + (f"base_url = '{URL_A}'\n" if not table.startswith("[serve") else "")
    text += f"{name} = '{pasted}'\n"
    with pytest.raises(ConfigError, match=f"{name}: must name an environment variable") as info:
        settings_from_toml(write(tmp_path, text), env={})
    assert pasted not in str(info.value) and "sk-live" not in str(info.value)


# --------------------------------------------------------------------------- secrets


def secret_config() -> Config:
    return with_values(
        two_sources(),
        scopes__chat__sources__a__api_key=KEY,
        scopes__chat__sources__b__api_key=KEY,
        backend=f"redis://:{REDIS_PW}@localhost:6379/0",
        telemetry=f"postgresql://app:{REDIS_PW}@db/t",
    )


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


def test_describe_masks_secrets_and_lists_every_field(build: Build) -> None:
    settings = build(secret_config())
    described = describe(settings)
    text = json.dumps(described)  # JSON-able
    assert_no_secret(text)
    assert_no_secret(repr(settings))
    chat = described["scopes"]["chat"]
    assert [s["api_key"] for s in chat["sources"]] == ["***", "***"]
    assert described["telemetry"] == "postgresql://app:***@db/t"
    assert described["backend"] == "redis://:***@localhost:6379/0"
    assert set(described) == {f.name for f in attrs.fields(Settings)}
    assert set(chat["hedge"]) == {f.name for f in attrs.fields(Hedge)}
    assert set(chat["sources"][0]) == {f.name for f in attrs.fields(Source)}


def test_describe_unset_secret_is_none() -> None:
    described = describe(to_objects(two_sources()))
    assert described["scopes"]["chat"]["sources"][0]["api_key"] is None


SECRET_ERRORS: dict[str, dict[str, Any]] = {
    "bad timeout beside secrets": {"scopes__chat__sources__a__timeout_s": -1},
    "bad hedge beside secrets": {"scopes__chat__hedge__after_s": 400.0},
    "api key with a line break": {"scopes__chat__sources__a__api_key": f"{KEY}\nmore"},
    "backend with a bad scheme": {"backend": f"http://:{REDIS_PW}@h/0"},
    "backend without ://": {"backend": f"redis//:{REDIS_PW}@h/0"},
    "backend with a bad port": {"backend": f"redis://:{REDIS_PW}@h:port/0"},
    "telemetry with a bad scheme": {"telemetry": f"mysql://u:{REDIS_PW}@h/db"},
    "base_url with a bad scheme": {"scopes__chat__sources__b__base_url": f"ftp://u:{URL_PW}@h"},
    "base_url without a scheme": {"scopes__chat__sources__b__base_url": f"u:{URL_PW}@h/v1"},
}


@pytest.mark.parametrize("case", SECRET_ERRORS)
def test_errors_never_show_secrets(build: Build, case: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(with_values(secret_config(), **SECRET_ERRORS[case]))
    assert_no_secret(str(info.value))
    assert_no_secret(repr(info.value))


@pytest.mark.parametrize("way", ["env", "toml"])
def test_missing_base_url_error_hides_secrets(way: str, tmp_path: Path) -> None:
    config = with_values(secret_config(), scopes__chat__sources__c__api_key=KEY)
    with pytest.raises(ConfigError, match=r"base_url is missing|BASE_URL is missing") as info:
        builder(way, tmp_path)(config)
    assert_no_secret(str(info.value))


@hsettings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.from_regex(r"sk-[A-Za-z0-9_-]{8,40}", fullmatch=True))
def test_any_api_key_stays_hidden(tmp_path: Path, key: str) -> None:
    config = with_values(two_sources(), scopes__chat__sources__a__api_key=key)
    for way in ("env", "toml"):
        settings = builder(way, tmp_path)(config)
        assert key not in repr(settings) + json.dumps(describe(settings))
        bad = with_values(config, scopes__chat__sources__a__rpm="many")
        with pytest.raises(ConfigError) as info:
            builder(way, tmp_path)(bad)
        assert key not in str(info.value)


# --------------------------------------------------------------------------- load_settings


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty working directory and no polygate keys in os.environ."""
    for key in list(os.environ):
        if key.startswith("POLYGATE"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_load_settings_prefers_polygate_config(clean: Path) -> None:
    named = write(clean, to_toml(two_sources()), "named.toml")
    write(clean, to_toml(FULL))  # ./polygate.toml, which POLYGATE_CONFIG overrides
    assert locate_config({"POLYGATE_CONFIG": str(named)}) == str(named)
    assert load_settings({"POLYGATE_CONFIG": str(named)}) == to_objects(two_sources())


def test_load_settings_missing_named_file(clean: Path) -> None:
    with pytest.raises(ConfigError, match=r"POLYGATE_CONFIG names .*absent\.toml"):
        load_settings({"POLYGATE_CONFIG": str(clean / "absent.toml")})


def test_load_settings_uses_local_file(clean: Path) -> None:
    write(clean, to_toml(FULL))
    assert locate_config({}) == "polygate.toml"
    assert load_settings({}) == to_objects(FULL)


def test_load_settings_falls_back_to_env(clean: Path) -> None:
    env = to_env(two_sources())
    assert locate_config(env) is None
    assert load_settings(env) == to_objects(two_sources())
    assert load_settings({**env, "POLYGATE_CONFIG": " "}) == to_objects(two_sources())


def test_load_settings_defaults_to_os_environ(clean: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in to_env(two_sources()).items():
        monkeypatch.setenv(key, value)
    assert load_settings() == to_objects(two_sources())


def test_load_settings_nothing_found(clean: Path) -> None:
    with pytest.raises(ConfigError, match="no polygate configuration found"):
        load_settings({})


def test_load_settings_warns_about_ignored_keys(clean: Path) -> None:
    write(clean, to_toml(two_sources()))
    with pytest.warns(ConfigWarning, match="POLYGATE__CHAT__A__RPM are ignored"):
        load_settings({"POLYGATE__CHAT__A__RPM": "5"})


def test_load_settings_passes_env_to_api_key_env(clean: Path) -> None:
    write(clean, f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\napi_key_env = 'K'\n")
    assert load_settings({"K": KEY}).scopes["chat"].sources[0].api_key == KEY


@pytest.mark.parametrize("toml", [
    '[scopes.chat.sources.a]\nbase_url = "http://a/v1"\napi_key = 9876543210123\n',
    '[serve.keys.a]\nkey = 9876543210123\n[scopes.chat.sources.a]\nbase_url = "http://a/v1"\n',
])
def test_a_secret_of_the_wrong_type_is_not_echoed(tmp_path: Path, toml: str) -> None:
    """A key written as a bare number is still a key: the error says what kind of
    value it is, never the value."""
    with pytest.raises(ConfigError) as info:
        settings_from_toml(write(tmp_path, toml), env={})
    assert "expected a string, got an integer" in str(info.value)
    assert "9876543210123" not in str(info.value)


@pytest.mark.parametrize(("key", "text", "says"), [
    ("POLYGATE__CHAT__A__RPM", "1_000", "expected a whole number"),
    ("POLYGATE__CHAT__A__RPM", "١٢٣", "expected a whole number"),  # Arabic-Indic digits
    ("POLYGATE__CHAT__A__RPM", "１２", "expected a whole number"),  # full-width digits
    ("POLYGATE__CHAT__A__TIMEOUT_S", "1_0.5", "expected a number"),
    ("POLYGATE__CHAT__A__TIMEOUT_S", "٣.٥", "expected a number"),
    ("POLYGATE__CHAT__FALLBACK_ON", ",,", "an empty entry"),
    ("POLYGATE__CHAT__FALLBACK_ON", "exhausted,,context_length", "an empty entry"),
])
def test_environment_numbers_and_lists_are_plain(key: str, text: str, says: str) -> None:
    """What a shell user writes: ASCII digits (Python's int() also takes '1_000' and
    other scripts' digits), and lists without empty entries (',,' silently meant no
    fallback at all)."""
    from polygate._config_load import settings_from_env

    env = {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1", "POLYGATE__BIG__B__BASE_URL": "http://b/v1",
           "POLYGATE__CHAT__FALLBACK": "big", key: text}
    with pytest.raises(ConfigError) as info:
        settings_from_env(env)
    assert key in str(info.value) and says in str(info.value)


def test_plain_environment_numbers_still_parse() -> None:
    from polygate._config_load import settings_from_env

    settings = settings_from_env({
        "POLYGATE__CHAT__A__BASE_URL": "http://a/v1", "POLYGATE__CHAT__A__RPM": " +120 ",
        "POLYGATE__CHAT__A__TIMEOUT_S": "1e2", "POLYGATE__CHAT__A__WEIGHT": ".5",
    })
    source = settings.scopes["chat"].sources[0]
    assert (source.rpm, source.timeout_s, source.weight) == (120, 100.0, 0.5)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"POLYGATE__CHAT__FALLBACK": "chat"}, "POLYGATE__CHAT__FALLBACK: fallback chain loops"),
        ({"POLYGATE__CHAT__FALLBACK": "nope"}, "POLYGATE__CHAT__FALLBACK: scope 'chat' falls back"),
        ({"POLYGATE__CACHE__X__BASE_URL": "http://h/v1"}, "POLYGATE__CACHE__…: scope name 'cache' is reserved"),
    ],
)
def test_env_errors_about_a_scope_name_its_key(extra: dict[str, str], named: str) -> None:
    """Probe finding (third round): these named the placeholder
    POLYGATE__{SCOPE}__{SOURCE}__BASE_URL instead of the key the user set."""
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://h/v1", **extra}
    with pytest.raises(ConfigError) as info:
        settings_from_env(env)
    assert named in str(info.value) and "{SCOPE}" not in str(info.value)


@pytest.mark.parametrize(("query", "problem"), [
    ("timeout_s=abc", "option timeout_s must be a number"),
    ("colour=blue", "unknown option 'colour'"),
    ("poll_s=1&lease_s=1", "poll_s must be well below lease_s"),
])
def test_a_bad_backend_option_names_its_key_or_path(query: str, problem: str, tmp_path: Path) -> None:
    """Review finding: the backend URL's options were parsed only at session start,
    under a bare "backend:", where the cache's were named by their key or path."""
    url = f"redis://:{REDIS_PW}@h:6379/0?{query}"
    path = tmp_path / "polygate.toml"
    path.write_text(f'backend = "{url}"\n[scopes.chat.sources.a]\nbase_url = "{URL_A}"\n')
    for build, where in (
        (lambda: settings_from_env({"POLYGATE__BACKEND": url, "POLYGATE__CHAT__A__BASE_URL": URL_A}),
         "POLYGATE__BACKEND"),
        (lambda: settings_from_toml(path), f"{path}: backend"),
        (lambda: Settings(scopes={"chat": Scope(sources=[Source(name="a", base_url=URL_A)])}, backend=url),
         "Settings.backend"),
    ):
        with pytest.raises(ConfigError) as info:
            build()
        assert where in str(info.value) and problem in str(info.value), str(info.value)
        assert REDIS_PW not in str(info.value)


# --------------------------------------------------------------------------- review: hostile numbers and pasted keys

_HUGE = "1" + "0" * 400  # TOML allows it; no float holds it


@pytest.mark.parametrize("field", ["timeout_s", "weight"])
def test_an_integer_too_large_for_a_float_is_a_config_error(tmp_path: Path, field: str) -> None:
    """Review: ``timeout_s = 1000…0`` (401 digits) raised a bare OverflowError from the
    loader (check-config and serve printed a traceback; a SIGHUP with it ended a
    serving gateway)."""
    path = tmp_path / "p.toml"
    path.write_text(f'[scopes.chat.sources.a]\nbase_url = "{URL_A}"\n{field} = {_HUGE}\n')
    with pytest.raises(ConfigError, match=f"{field}: expected a finite number, got an integer too large"):
        settings_from_toml(path, env={})


def test_an_integer_past_pythons_digit_limit_is_a_config_error(tmp_path: Path) -> None:
    """tomllib meets Python's 4,300-digit cap as a plain ValueError, not a TOML error."""
    path = tmp_path / "p.toml"
    path.write_text(f'[scopes.chat.sources.a]\nbase_url = "{URL_A}"\nrpm = 1{"0" * 5000}\n')
    with pytest.raises(ConfigError, match=r"invalid TOML \(a number too large"):
        settings_from_toml(path, env={})


@pytest.mark.parametrize("text", [
    "[serve]\napi_keys = 918273645501\n",
    "[serve.keys]\nalice = 918273645501\n",
    "[serve]\napi_keys_env = 918273645501\n",
    "[serve.keys.alice]\nkey_env = 918273645501\n",
    "[scopes.chat.sources.b]\nbase_url = 'http://b/v1'\napi_key_env = 918273645501\n",
])
def test_a_key_written_as_a_bare_number_is_not_echoed(tmp_path: Path, text: str) -> None:
    """Review: ``api_keys = <number>`` (and a number where a key's table or a key's
    variable name belongs) was quoted in the error, as `Source.api_key` never is."""
    path = tmp_path / "p.toml"
    path.write_text(f'[scopes.chat.sources.a]\nbase_url = "{URL_A}"\n{text}')
    with pytest.raises(ConfigError) as caught:
        settings_from_toml(path, env={})
    assert "918273645501" not in str(caught.value)
    assert "an integer" in str(caught.value)


@pytest.mark.parametrize("value", [",", "a,,b", " , "])
def test_an_empty_gateway_key_in_the_environment_is_refused(value: str) -> None:
    """Review: ``POLYGATE__SERVE__API_KEYS=","`` (two variables expanded empty) loaded
    as no keys at all -- authentication off -- where TOML's api_keys_env holding the
    same is refused."""
    with pytest.raises(ConfigError, match="POLYGATE__SERVE__API_KEYS: an empty key") as caught:
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__SERVE__API_KEYS": value})
    assert value not in str(caught.value)


@pytest.mark.parametrize("value", [",", "key-one-1234,,key-two-5678", "key-one-1234,"])
def test_an_empty_gateway_key_in_api_keys_env_is_refused(tmp_path: Path, value: str) -> None:
    """Review: the same list through TOML's api_keys_env dropped the empty entry
    silently ("${KEY_A},${KEY_B}" with KEY_A unset: its clients met 401s)."""
    path = write(tmp_path, f'[serve]\napi_keys_env = "GW_KEYS"\n[scopes.chat.sources.a]\nbase_url = "{URL_A}"\n')
    with pytest.raises(ConfigError, match=r"serve\.api_keys_env: an empty key") as caught:
        settings_from_toml(path, env={"GW_KEYS": value})
    assert "key-one" not in str(caught.value)


def test_a_file_nested_past_pythons_limit_is_a_config_error(tmp_path: Path) -> None:
    """tomllib reads nested tables by recursion: a file nesting ~1,000 inline tables
    raised a bare RecursionError from session(), check-config, chat and serve."""
    path = tmp_path / "deep.toml"
    path.write_text("[scopes.chat.sources.a]\nbase_url = 'http://127.0.0.1:9/v1'\n"
                    "x = " + "{b = " * 1000 + "1" + "}" * 1000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        Settings.from_toml(str(path))


_ENV_BASE = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__A__API_KEY": KEY}
_GATEWAY_KEY = "sk-gw-SECRET-0123456789"


@pytest.mark.parametrize(("extra", "secret"), [
    # a deploy script whose variables slipped: a key in a boolean, a number, a float
    ({"POLYGATE__CHAT__A__STREAMING": KEY}, KEY),
    ({"POLYGATE__CHAT__A__RPM": KEY}, KEY),
    ({"POLYGATE__CHAT__HEDGE__AFTER_S": KEY}, KEY),
    ({"POLYGATE__LOG_CONTENT": KEY}, KEY),
    # a gateway key (one of a comma-separated list, parsed after the scope's keys)
    ({"POLYGATE__SERVE__API_KEYS": f"other-key-1,{_GATEWAY_KEY}",
      "POLYGATE__CHAT__A__MAX_IN_FLIGHT": _GATEWAY_KEY}, _GATEWAY_KEY),
    ({"POLYGATE__SERVE__KEYS__TEAM__KEY": _GATEWAY_KEY, "POLYGATE__SERVE__PORT": _GATEWAY_KEY},
     _GATEWAY_KEY),
    # a URL's password in a numeric key
    ({"POLYGATE__CHAT__CALL_DEADLINE_S": f"redis://:{REDIS_PW}@h:6379/0"}, REDIS_PW),
    # an alias list that quotes its bad item
    ({"POLYGATE__SERVE__API_KEYS": _GATEWAY_KEY, "POLYGATE__SERVE__MODELS": _GATEWAY_KEY},
     _GATEWAY_KEY),
])
def test_an_environment_value_of_the_wrong_type_never_echoes_a_secret(
    extra: dict[str, str], secret: str
) -> None:
    """review: a type error from an environment key quoted the value, which the
    loader's last line of defence never scrubbed: a key that landed in RPM was
    printed back."""
    with pytest.raises(ConfigError) as info:
        settings_from_env({**_ENV_BASE, **extra})
    assert secret not in str(info.value), str(info.value)


@pytest.mark.parametrize("token", [
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",  # a Hugging Face token
    "gsk_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcdefghijkl",  # a Groq key
    "Xq7Lm2Pz9Rt4Vb8Nc3Kd6Wf1Hs5Jg0Ay",  # 32 letters and digits (Mistral's shape)
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567",  # upper case, no underscore, long
])
def test_a_key_that_could_be_a_variable_name_is_not_echoed_either(
    tmp_path: Path, token: str
) -> None:
    """review: a key of letters, digits and ``_`` only passed for a variable's name
    and was quoted in full ("environment variable hf_… is not set")."""
    text = f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\napi_key_env = '{token}'\n"
    with pytest.raises(ConfigError, match="api_key_env: ") as info:
        settings_from_toml(write(tmp_path, text), env={})
    assert token not in str(info.value), str(info.value)


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "GROQ", "MY_KEY_2", "openai_key"])
def test_a_variable_name_that_is_unset_is_named(tmp_path: Path, name: str) -> None:
    text = f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\napi_key_env = '{name}'\n"
    with pytest.raises(ConfigError, match=f"environment variable {name} is not set"):
        settings_from_toml(write(tmp_path, text), env={})


@pytest.mark.parametrize(("path", "problem"), [
    (None, "must be a str or a path, not NoneType"),
    (5, "must be a str or a path, not int"),
    ("polygate\0.toml", "a path cannot hold a NUL character"),
])
def test_a_path_that_is_no_path_is_a_config_error(path: Any, problem: str) -> None:
    """review: None or 5 raised a bare TypeError, and a NUL in the path was called
    "invalid TOML (a number too large: embedded null byte)"."""
    with pytest.raises(ConfigError, match=problem):
        settings_from_toml(path)


def test_an_unknown_serve_key_lists_each_known_key_once() -> None:
    with pytest.raises(ConfigError, match="serve keys are") as info:
        settings_from_env({**_ENV_BASE, "POLYGATE__SERVE__COLOUR": "blue"})
    listed = str(info.value).split("serve keys are ", 1)[1].split(", ")
    assert "API_KEYS" in listed and len(listed) == len(set(listed)), listed


def test_an_unknown_serve_key_in_a_file_lists_each_known_key_once(tmp_path: Path) -> None:
    """Review: the TOML loader's list named api_keys twice (the environment's, above,
    was fixed before)."""
    path = tmp_path / "c.toml"
    path.write_text('[serve]\nbogus = 1\n[scopes.chat.sources.a]\nbase_url = "http://127.0.0.1:9/v1"\n')
    with pytest.raises(ConfigError, match="serve keys are") as info:
        settings_from_toml(path)
    listed = str(info.value).split("serve keys are ", 1)[1].split(", ")
    assert "api_keys" in listed and len(listed) == len(set(listed)), listed


def test_a_long_environment_value_of_the_wrong_type_is_not_quoted() -> None:
    """review: a key typed only into a number's variable (set under no secret key, so
    nothing to scrub it by) was quoted in full; and a 5,000-digit value made a 5 KB
    message.  Short values, the usual slips, are still quoted."""
    pasted = "sk-proj-0123456789abcdefghij"
    with pytest.raises(ConfigError, match="a value of 28 characters") as info:
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__A__RPM": pasted})
    assert pasted not in str(info.value)
    with pytest.raises(ConfigError, match="got 'fast'"):
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CHAT__A__RPM": "fast"})


def test_a_dotted_scopes_fallback_error_names_its_own_key(tmp_path: Path) -> None:
    """Review: a scope named with a "." (``gpt.4``) whose fallback names no scope was
    reported at POLYGATE__GPT__4__FALLBACK and scopes.gpt.4.fallback: keys that do
    not exist."""
    env = {"POLYGATE__GPT.4__A__BASE_URL": "http://127.0.0.1:1/v1", "POLYGATE__GPT.4__FALLBACK": "nope"}
    with pytest.raises(ConfigError) as info:
        settings_from_env(env)
    assert str(info.value).startswith("POLYGATE__GPT.4__FALLBACK: scope 'gpt.4' falls back to 'nope'")
    path = write(tmp_path, '[scopes."gpt.4"]\nfallback = "nope"\n'
                           '[scopes."gpt.4".sources.a]\nbase_url = "http://127.0.0.1:1/v1"\n')
    with pytest.raises(ConfigError) as info:
        settings_from_toml(path, env={})
    assert str(info.value).startswith(f'{path}: scopes."gpt.4".fallback: ')


_PASTED = "sk-proj-Pasted0123456789abcdefghijKLMNOP"


@pytest.mark.parametrize("key", [
    "POLYGATE__CHAT__A__BASE_URL", "POLYGATE__BACKEND", "POLYGATE__TELEMETRY", "POLYGATE__CACHE",
    "POLYGATE__CHAT__FALLBACK",
])
def test_a_key_pasted_where_a_url_or_a_name_goes_is_not_quoted(key: str) -> None:
    """Review: a key that slipped into a URL's (or a fallback's) variable was quoted
    whole in the refusal; a value of the wrong type was already described by its
    length past 24 characters, and so is this one now."""
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, key: _PASTED}
    with pytest.raises(ConfigError) as caught:
        settings_from_env(env)
    assert caught.value.args[0].startswith(key)
    assert "Pasted0123" not in str(caught.value).replace("pasted0123", "Pasted0123")
    assert f"a value of {len(_PASTED)} characters" in str(caught.value)


def test_a_short_wrong_value_is_still_quoted() -> None:
    with pytest.raises(ConfigError, match=r"got 'localhost:8000/v1'"):
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": "localhost:8000/v1"})
    with pytest.raises(ConfigError, match=r"unknown cache 'memry'"):
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__CACHE": "memry"})


def test_an_env_models_item_that_is_a_pasted_key_is_not_quoted() -> None:
    pasted = "sk-proj-" + "AbCdEfGh" * 5
    env = {"POLYGATE__CHAT__A__BASE_URL": URL_A, "POLYGATE__SERVE__MODELS": f"gpt=chat,{pasted}"}
    with pytest.raises(ConfigError, match="POLYGATE__SERVE__MODELS") as info:
        settings_from_env(env)
    assert "AbCdEf" not in str(info.value)


def test_a_huge_toml_integer_where_a_string_goes_is_not_quoted(tmp_path: Path) -> None:
    path = write(tmp_path, f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\nmodel = {'7' * 4000}\n")
    with pytest.raises(ConfigError, match=r"about 400[01] digits") as info:
        settings_from_toml(path)
    assert len(str(info.value)) < 300


def test_lower_case_keys_beside_a_file_are_named_as_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, f"[scopes.chat.sources.a]\nbase_url = '{URL_A}'\n")
    with pytest.warns(ConfigWarning, match="polygate__CHAT__A__RPM are ignored"):
        load_settings(env={"POLYGATE_CONFIG": str(path), "polygate__CHAT__A__RPM": "5"})


@pytest.mark.parametrize(("text", "message"), [
    ("[scopes.chat]\ncall_deadline_s = 5\n[scopes.chat.hedge]\nafter_s = 2\n",
     "{f}: scopes.chat: the scope has no sources (add a [scopes.chat.sources.NAME] table with "
     "a base_url); it sets call_deadline_s, hedge.after_s"),
    ("[scopes.chat.sources.a]\n",
     "{f}: scopes.chat.sources.a.base_url is missing: the source has no base_url"),
    ('[[scopes.chat.sources]]\nname = "a"\n',
     "{f}: scopes.chat.sources[0].base_url is missing: the source has no base_url"),
    ('[scopes.chat.sources.a]\nmodel = "m"\nrpm = 3\n',
     "{f}: scopes.chat.sources.a.base_url is missing: the source sets model, rpm but has no "
     "base_url"),
    ('backend = "memory"\n', "{f}: scopes: no scope is configured (found only backend)"),
], ids=["no-sources", "empty-source", "empty-array-source", "source-without-url", "no-scopes"])
def test_a_file_missing_a_part_is_told_so_from_its_path(
    tmp_path: Path, text: str, message: str
) -> None:
    """A docs sweep of configuration.md ("errors are prefixed with the file path"): the
    environment's wording was reused with the file's locations dropped into it, so
    the path came mid-sentence, once per key (``add x.toml: scopes.chat.sources``),
    and a source table with nothing but its name read "is set by  but has no"."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        settings_from_toml(path, env={})
    assert str(info.value) == message.format(f=path)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_toml_path_to_a_folder_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """Review of the named pipes' fix: a folder opens (os.open), then fails to read,
    and each try left its descriptor open (a reload on a bad path, one more each)."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(ConfigError, match="cannot read the file"):
            settings_from_toml(tmp_path)
    assert len(os.listdir("/proc/self/fd")) <= before


@pytest.mark.parametrize(("text", "hinted"), [
    ("30", True), (" 1.5e3 ", True), ("-2", True), ("0x1F", True), ("inf", True), ("1_000", True),
    ("fast", False), ("30s", False), (".5", False), ("5.", False), ("Infinity", False),
    ("NaN", False), ("1 # two", False), ("true", False),
])
def test_only_a_quoted_number_is_told_to_lose_its_quotes(tmp_path: Path, text: str, hinted: bool) -> None:
    """Review finding (docs, claim by claim): every string in a number field got
    "write it without quotes", "fast" and "30s" too, which unquoted are not TOML (and,
    read by float(), ".5" and "Infinity"); what TOML reads as a number gets it."""
    path = tmp_path / "p.toml"
    path.write_text(f'[scopes.chat.sources.a]\nbase_url = "http://h/v1"\ntimeout_s = "{text}"\n')
    with pytest.raises(ConfigError) as info:
        settings_from_toml(str(path))
    assert "expected a number, got a string" in str(info.value)
    assert ("(write it without quotes)" in str(info.value)) is hinted


def test_a_session_reading_its_configuration_warns_at_the_callers_line(tmp_path: Path) -> None:
    """Outside review (logs): a ConfigWarning of settings a session read for itself
    (``polygate.session(env=...)``) pointed inside polygate (the session's opening),
    not at the ``async with``; and one of settings built through a loader at the
    wrapper that keeps a configuration error's frames out of a crash report."""
    import warnings

    import trio

    import polygate
    from polygate.testing import FakeUpstream, Reply, Router

    path = tmp_path / "polygate.toml"
    path.write_text('[scopes.chat]\nhedge = {after_s = 1.0}\n[[scopes.chat.sources]]\n'
                    'name = "a"\nbase_url = "http://a/v1"\n')

    async def open_one() -> None:
        async with polygate.session(env={"POLYGATE_CONFIG": str(path)},
                                    transport=Router({"a": FakeUpstream(Reply())})):
            pass

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        trio.run(open_one)
        polygate.Settings.from_toml(path)
        polygate.Source(name="a", base_url="http://a/v1", api_key="sk-abc\u200bdef")
    assert len(got) == 3 and {w.filename for w in got} == {__file__}, [(w.filename, w.message) for w in got]
