"""Settings built as Python objects: validators, assembly guards, reprs that hide secrets.

The same configurations built from the environment and from TOML are in
``test_config_load.py``; this module checks the attrs classes alone.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import polygate
from polygate._config import (
    RESERVED_SEGMENTS,
    ConfigWarning,
    FieldError,
    Hedge,
    Retry,
    Scope,
    Settings,
    Source,
    StreamWatch,
    mask_url,
)
from polygate._errors import ConfigError

KEY = "sk-test-SECRET-1234567890"
REDIS_PW = "redis-PASSWORD-42"
URL_PW = "url-PASSWORD-77"


def src(name: str = "a", **kw: Any) -> Source:
    return Source(name=name, base_url=f"http://127.0.0.1:800{ord(name[0]) % 10}/v1", **kw)


def pair(**kw: Any) -> list[Source]:
    return [src("a", **kw), src("b", **kw)]


# --------------------------------------------------------------------------- defaults


def test_defaults_match_the_spec() -> None:
    s = Source(name="a", base_url="http://h/v1")
    assert (s.api_key, s.model, s.timeout_s, s.ttft_timeout_s) == (None, None, 300, None)
    assert (s.rpm, s.tpm, s.max_in_flight, s.weight, s.streaming) == (None, None, None, 1.0, True)
    assert Hedge() == Hedge(after_s=None, max_extra=1, stall_after_s=None, budget_ratio=0.1,
                            budget_burst=10, after_quantile=None, min_after_s=None,
                            max_after_s=None)
    assert not Hedge().enabled
    assert Retry() == Retry(max_attempts=3, backoff_base_s=0.25, backoff_max_s=8.0,
                            rate_limit_wait_s=60)
    assert StreamWatch() == StreamWatch(stall_timeout_s=None, stall_threshold_ms=2000)
    scope = Scope(sources=[s])
    assert (scope.hedge, scope.retry, scope.stream, scope.call_deadline_s) == (
        Hedge(), Retry(), StreamWatch(), None)
    settings = Settings(scopes={"chat": scope})
    assert (settings.backend, settings.telemetry) == ("memory", "off")


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        src(timeout_s=-1)


# --------------------------------------------------------------------------- bad values

BAD_VALUES: list[tuple[type, str, Any]] = [
    # (class, field, value) — each must raise a ConfigError naming the field
    *[(Source, "timeout_s", v) for v in (-1, 0, math.nan, math.inf, "30", True, None, 10**400)],
    *[(Source, "ttft_timeout_s", v) for v in (0, -0.5, math.nan, "x", False)],
    *[(Source, "weight", v) for v in (0, -1, math.inf, "1")],
    *[(Source, f, v) for f in ("rpm", "tpm", "max_in_flight") for v in (2.5, 0, -3, True, "10")],
    *[(Source, "streaming", v) for v in (1, "yes", None)],
    # "\udce9": a Latin-1 byte in an environment value, as Python decodes it
    *[(Source, "model", v) for v in ("", 3, "mod\udce9le")],
    *[(Source, "api_key", v) for v in ("", 3, "sk-a\nb")],
    *[(Source, "base_url", v) for v in ("127.0.0.1:8000/v1", "localhost", "ftp://h/v1",
                                        "http://", "http://h:99999/v1", "http://h:0/v1", 3)],
    *[(Source, "name", v) for v in ("", "a b", "a__b", "-a", 3)],
    *[(Source, "name", v) for seg in RESERVED_SEGMENTS for v in (seg, seg.lower())],
    *[(Hedge, "after_s", v) for v in (0, -1, math.nan, "8", True)],
    *[(Hedge, "max_extra", v) for v in (0, 4, 1.5, True, "2")],
    *[(Hedge, "stall_after_s", v) for v in (0, math.inf)],
    *[(Hedge, "budget_ratio", v) for v in (1.5, -0.1, math.nan, True)],
    *[(Hedge, "budget_burst", v) for v in (0, -1)],
    *[(Hedge, "after_quantile", v) for v in (1.0, 0, 0.0, -0.5, math.nan, True)],
    *[(Hedge, f, v) for f in ("min_after_s", "max_after_s") for v in (0, -2)],
    *[(Retry, "max_attempts", v) for v in (0, 2.5, True)],
    *[(Retry, f, v) for f in ("backoff_base_s", "rate_limit_wait_s") for v in (-1, math.nan)],
    *[(StreamWatch, "stall_timeout_s", v) for v in (0, -1)],
    *[(StreamWatch, "stall_threshold_ms", v) for v in (0, math.inf)],
]


@pytest.mark.parametrize(
    ("cls", "field", "unit"),
    [(Source, "timeout_s", "a number of seconds"), (Source, "weight", "a number"),
     (Hedge, "budget_burst", "a number"), (StreamWatch, "stall_threshold_ms", "a number of milliseconds")],
)
def test_a_value_that_is_no_number_is_told_in_the_fields_unit(cls: type, field: str, unit: str) -> None:
    """A review found ``stall_threshold_ms="x"`` (and ``weight``, ``budget_burst``)
    told "expected a number of seconds": the unit is the field's own, or none."""
    with pytest.raises(ConfigError, match=f"expected {unit}, got str"):
        build_with(cls, field, "x")


def build_with(cls: type, field: str, value: Any) -> Any:
    if cls is Source:
        kw: dict[str, Any] = {"name": "a", "base_url": "http://h/v1", field: value}
        return Source(**kw)
    return cls(**{field: value})


@pytest.mark.parametrize(("cls", "field", "value"), BAD_VALUES)
def test_bad_value_raises_config_error_naming_the_field(cls: type, field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        build_with(cls, field, value)
    assert isinstance(info.value, FieldError)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(
    ("cls", "kw", "field"),
    [
        (Hedge, {"min_after_s": 5, "max_after_s": 2}, "min_after_s"),
        (Retry, {"backoff_base_s": 2, "backoff_max_s": 1}, "backoff_max_s"),
    ],
)
def test_cross_field_checks(cls: type, kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        cls(**kw)


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"sources": []}, "non-empty"),
        ({"sources": [src("a"), src("a")]}, "appears twice"),
        ({"sources": ["a"]}, "Source objects"),
        ({"sources": [src()], "call_deadline_s": 0}, "call_deadline_s"),
        ({"sources": [src()], "embed_batch_size": 2.5}, "embed_batch_size"),
        ({"sources": [src()], "completion_estimate_tokens": -1}, "completion_estimate_tokens"),
        ({"sources": [src()], "hedge": {"after_s": 1}}, "hedge"),
    ],
)
def test_bad_scope(kw: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        Scope(**kw)


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"scopes": {}}, "non-empty"),
        ({"scopes": {"a b": Scope(sources=[src()])}}, "scope name"),
        ({"scopes": {"hedge": Scope(sources=[src()])}}, "reserved"),
        ({"scopes": {"chat": "x"}}, "must be a Scope"),
        ({"backend": "redis//localhost"}, "backend"),
        ({"backend": "postgresql://h/db"}, "backend"),
        ({"telemetry": "mysql://h/db"}, "telemetry"),
        ({"telemetry": "sqlite:/relative.db"}, "telemetry"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"max_line_bytes": 2.5}, "max_line_bytes"),
        ({"dead_cooldown_s": math.nan}, "dead_cooldown_s"),
        ({"log_content": "yes"}, "log_content"),
    ],
)
def test_bad_settings(kw: dict[str, Any], problem: str) -> None:
    kw.setdefault("scopes", {"chat": Scope(sources=[src()])})
    with pytest.raises(ConfigError, match=problem):
        Settings(**kw)


@pytest.mark.parametrize(
    "url", ["memory", "redis://localhost:6379/0", f"rediss://:{REDIS_PW}@h:6380/1"]
)
def test_good_backends(url: str) -> None:
    assert Settings(scopes={"c": Scope(sources=[src()])}, backend=url).backend == url


@pytest.mark.parametrize("url", ["off", "sqlite:///tmp/x.db", "postgresql://u@h/db"])
def test_good_telemetry(url: str) -> None:
    assert Settings(scopes={"c": Scope(sources=[src()])}, telemetry=url).telemetry == url


# --------------------------------------------------------------------------- assembly guards


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"sources": pair(timeout_s=10), "hedge": Hedge(after_s=10)}, "hedge.after_s"),
        ({"sources": [src("a", timeout_s=5), src("b")], "hedge": Hedge(after_s=8)}, "hedge.after_s"),
        ({"sources": pair(), "hedge": Hedge(after_s=8), "call_deadline_s": 8}, "hedge.after_s"),
        ({"sources": pair(), "hedge": Hedge(after_quantile=0.9, max_after_s=300)},
         "hedge.max_after_s"),
        # review: the learnt trigger is never below min_after_s, so these never hedge
        # once learnt (the first: never at all)
        ({"sources": pair(), "hedge": Hedge(after_quantile=0.9, min_after_s=500)},
         "hedge.min_after_s"),
        ({"sources": pair(), "hedge": Hedge(after_s=5, after_quantile=0.9, min_after_s=300)},
         "hedge.min_after_s"),
        ({"sources": pair(), "hedge": Hedge(after_quantile=0.9, min_after_s=60), "call_deadline_s": 60},
         "hedge.min_after_s"),
    ],
)
def test_assembly_errors(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as info:
        Scope(**kw)
    assert info.value.field == field


def test_ttft_below_after_s_warns() -> None:
    with pytest.warns(ConfigWarning, match="ttft_timeout_s"):
        Scope(sources=[src("a", ttft_timeout_s=5), src("b")], hedge=Hedge(after_s=8))


@pytest.mark.parametrize("hedge", [Hedge(after_s=8), Hedge(after_quantile=0.95)])
def test_single_source_hedging_warns(hedge: Hedge) -> None:
    with pytest.warns(ConfigWarning, match="single source"):
        Scope(sources=[src()], hedge=hedge)


def test_stall_after_s_alone_warns() -> None:
    # stall_after_s only adds a trigger to hedging that after_s or after_quantile turns
    # on; alone it would silently do nothing.
    with pytest.warns(ConfigWarning, match=r"^hedge.stall_after_s .*after_s or after_quantile"):
        scope = Scope(sources=pair(), hedge=Hedge(stall_after_s=5))
    assert not scope.hedge.enabled


@pytest.mark.parametrize("hedge", [Hedge(after_s=8, stall_after_s=5),
                                   Hedge(after_quantile=0.9, stall_after_s=5)])
def test_stall_after_s_with_a_trigger_is_silent(hedge: Hedge) -> None:
    assert Scope(sources=pair(), hedge=hedge).hedge.enabled


@pytest.mark.parametrize(("hedge", "says"), [
    (Hedge(min_after_s=2, max_after_s=10), r"^hedge.min_after_s and hedge.max_after_s .*hedging is off"),
    (Hedge(max_after_s=300), r"^hedge.max_after_s .*hedging is off"),
    (Hedge(after_s=5, max_after_s=3), r"^hedge.max_after_s .*the trigger is after_s"),
])
def test_clamps_without_a_quantile_warn(hedge: Hedge, says: str) -> None:
    """Review: "hedge between 2 and 10 s" built silently and never hedged (and
    max_after_s past every timeout was an error about a hedge that could not fire)."""
    with pytest.warns(ConfigWarning, match=says):
        Scope(sources=pair(), hedge=hedge)


def test_a_learnt_trigger_bound_past_the_ttft_timeouts_warns() -> None:
    """Review: min_after_s at or past every ttft_timeout_s, with nothing to hedge on
    before the sketch is warm, built silently: this scope never hedges."""
    with pytest.warns(ConfigWarning, match=r"^hedge.min_after_s \(5\) >= the smallest ttft_timeout_s"):
        Scope(sources=pair(ttft_timeout_s=4), hedge=Hedge(after_quantile=0.9, min_after_s=5))


def test_sane_hedging_is_silent() -> None:
    # filterwarnings = error: any warning here fails the test.
    scope = Scope(sources=pair(ttft_timeout_s=20), hedge=Hedge(after_s=8), call_deadline_s=120)
    assert scope.hedge.enabled


def test_single_source_without_hedging_is_silent() -> None:
    Scope(sources=[src()])


# --------------------------------------------------------------------------- secrets


def secret_settings() -> Settings:
    sources = [
        src("a", api_key=KEY),
        Source(name="b", base_url="http://127.0.0.1:8002/v1", api_key=KEY),
    ]
    return Settings(
        scopes={"chat": Scope(sources=sources)},
        backend=f"redis://:{REDIS_PW}@localhost:6379/0",
        telemetry=f"postgresql://app:{REDIS_PW}@db/telemetry",
    )


def test_reprs_hide_secrets() -> None:
    settings = secret_settings()
    scope = settings.scopes["chat"]
    for text in (repr(settings), str(settings), repr(scope), repr(scope.sources[0]),
                 repr(scope.sources[1]), str(scope.sources)):
        for secret in (KEY, REDIS_PW, URL_PW):
            assert secret not in text
    assert "api_key='***'" in repr(scope.sources[0])
    assert "redis://:***@localhost:6379/0" in repr(settings)


def test_secrets_lists_keys_and_backend_passwords() -> None:
    assert set(secret_settings().secrets()) >= {KEY, REDIS_PW}


@pytest.mark.parametrize(
    ("kw", "secret"),
    [
        ({"backend": f"http://:{REDIS_PW}@h/0"}, REDIS_PW),
        ({"backend": f"redis//:{REDIS_PW}@h/0"}, REDIS_PW),
        ({"backend": f"redis://:{REDIS_PW}@h:port/0"}, REDIS_PW),
        ({"telemetry": f"mysql://u:{REDIS_PW}@h/db"}, REDIS_PW),
        ({"telemetry": f"u:{REDIS_PW}@h/db"}, REDIS_PW),
    ],
)
def test_url_errors_hide_passwords(kw: dict[str, Any], secret: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings(scopes={"c": Scope(sources=[src()])}, **kw)
    assert secret not in str(info.value)


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        (f"ftp://u:{URL_PW}@h/v1", URL_PW),
        (f"u:{URL_PW}@h/v1", URL_PW),
        (f"http:/u:{URL_PW}@h/v1", URL_PW),
    ],
)
def test_base_url_errors_hide_passwords(url: str, secret: str) -> None:
    with pytest.raises(ConfigError) as info:
        Source(name="a", base_url=url)
    assert secret not in str(info.value)


def test_api_key_errors_never_echo_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        Source(name="a", base_url="http://h", api_key=f"{KEY}\nmore")
    assert KEY not in str(info.value)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("http://h/v1", "http://h/v1"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:pw@h/0", "redis://user:***@h/0"),
        ("user:pw@h/v1", "***@h/v1"),
        ("http://h/v1/@models", "http://h/v1/@models"),
        ("http://[::1", "<unparseable URL>"),
        # libpq's query form of the password, and other credential-like parameters
        ("postgresql://h/db?user=app&password=s3cret", "postgresql://h/db?user=app&password=***"),
        ("postgresql://u:pw@h/db?sslpassword=zz&sslmode=require",
         "postgresql://u:***@h/db?sslpassword=***&sslmode=require"),
        ("https://h/v1?api_key=sk-1&x=1", "https://h/v1?api_key=***&x=1"),
        ("redis://h:6379/0?prefix=app&timeout_s=1", "redis://h:6379/0?prefix=app&timeout_s=1"),
        # Outside review (fuzzing the library's arguments): a signed link's signature
        # (Azure's SAS, S3's, Google's, CloudFront's) and an OAuth token in a fragment
        # were shown whole, an OCR document URL refused among them.
        ("http://a.blob.example/a.png?sp=r&sig=SECRETSIG", "http://a.blob.example/a.png?sp=r&sig=***"),
        ("https://b.s3.example/x.pdf?X-Amz-Credential=AKIA1&X-Amz-Signature=SECRETSIG",
         "https://b.s3.example/x.pdf?X-Amz-Credential=***&X-Amz-Signature=***"),
        ("https://g.example/x?X-Goog-Signature=SECRETSIG", "https://g.example/x?X-Goog-Signature=***"),
        ("https://c.example/x?Expires=1&Signature=SECRETSIG&Key-Pair-Id=K",
         "https://c.example/x?Expires=1&Signature=***&Key-Pair-Id=***"),
        ("https://h/cb#access_token=SECRETTOK&state=1", "https://h/cb#access_token=***&state=1"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_a_password_in_a_telemetry_urls_query_never_shows() -> None:
    """Probe finding (third round): postgresql://host/db?password=… (libpq's documented
    form) showed the password in repr(Settings) and in check-config; only the
    user:password@ form was masked."""
    secret = "Sup3rSecretPassw0rd"
    settings = Settings(scopes=secret_settings().scopes,
                        telemetry=f"postgresql://db.internal/app?user=app&password={secret}")
    assert secret not in repr(settings)
    assert "password=***" in repr(settings)
    from polygate._secrets import url_secrets

    assert secret in url_secrets(settings.telemetry)  # so messages about it are redacted


def test_a_base_url_without_a_scheme_is_not_quoted_past_its_path() -> None:
    """Probe finding (third round): the scheme check quoted the whole value, a key in
    its query included."""
    for url in (f"api.example.com/v1?k={KEY}", f"ftp://api.example.com/v1?key={KEY}"):
        with pytest.raises(ConfigError, match="must be an absolute http") as info:
            Source(name="a", base_url=url)
        assert KEY not in str(info.value)


@given(st.from_regex(r"[A-Za-z0-9._~-]{4,30}", fullmatch=True))
def test_mask_url_hides_any_password(password: str) -> None:
    for url in (f"redis://:{password}@host:6379/0", f"x:{password}@host/v1"):
        assert password not in mask_url(url).replace("host", "").replace("6379", "")


def test_settings_are_frozen() -> None:
    settings = secret_settings()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.backend = "memory"  # type: ignore[misc]


def test_scopes_are_read_only() -> None:
    import attrs

    import polygate
    from polygate._config import RESERVED_SEGMENTS

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    with pytest.raises(TypeError):
        settings.scopes["x"] = settings.scopes["chat"]  # type: ignore[index]
    scope_fields = {f.name.upper() for f in attrs.fields(polygate.Scope)} - {"SOURCES"}
    assert scope_fields == RESERVED_SEGMENTS


@pytest.mark.parametrize("name", ["a\n", "chat\n", "a\r", "a\n\n"])
def test_a_name_that_ends_in_a_line_break_is_refused(name: str, tmp_path: Any) -> None:
    """review: the name check was ``re.match`` with ``$``, which also takes a name that
    ends in a line break; ``polygate serve`` then wrote the source's name into a header
    and split its answer's head (a client waited for a body it never saw the length of)."""
    import polygate

    def source(n: str = "a", **kw: Any) -> polygate.Source:
        return polygate.Source(name=n, base_url="http://a/v1", **kw)

    with pytest.raises(ConfigError):
        source(name)
    with pytest.raises(ConfigError):
        polygate.Settings(scopes={name: polygate.Scope(sources=[source()])})
    with pytest.raises(ConfigError):
        polygate.Scope(sources=[source()], fallback=name)
    config = tmp_path / "polygate.toml"
    config.write_text(f'[scopes.chat.sources."{name.encode("unicode_escape").decode()}"]\n'
                      'base_url = "http://127.0.0.1:9/v1"\n')
    with pytest.raises(ConfigError):
        polygate.Settings.from_toml(str(config))


def test_a_header_value_cannot_end_the_head_early() -> None:
    """Defence in depth: a value with a line break or a NUL (never one of ours) is
    written with spaces in their place, never as the end of the head."""
    from polygate.serve._http import field_value

    assert field_value(b"a\n") == b"a "
    assert field_value(b"a\r\nb: c\x00") == b"a  b: c "
    assert field_value(b"plain-1") == b"plain-1"


def test_a_fallback_reason_that_ends_in_a_line_break_is_refused() -> None:
    """The same "$" as the names' (review): ``status:413\\n`` was taken as a reason."""
    import polygate

    source = polygate.Source(name="a", base_url="http://a/v1")
    with pytest.raises(ConfigError, match="fallback_on"):
        polygate.Scope(sources=[source], fallback="b", fallback_on=("status:413\n",))
    assert polygate.Scope(sources=[source], fallback="b", fallback_on=("status:413",)).fallback_on


@pytest.mark.parametrize("reason", ["status:4\u0660\u0660", "status:4\uff10\uff10"])
def test_a_fallback_status_in_other_digits_is_refused(reason: str) -> None:
    """Review: a status written in Arabic-Indic or fullwidth digits was taken (``\\d``
    is any Unicode digit) and never fired: the status it is matched against is ASCII."""
    import polygate

    source = polygate.Source(name="a", base_url="http://a/v1")
    with pytest.raises(ConfigError, match="fallback_on"):
        polygate.Scope(sources=[source], fallback="b", fallback_on=(reason,))


@pytest.mark.parametrize("field", ["telemetry", "backend", "cache"])
def test_an_unencoded_at_in_a_urls_credentials_is_refused(field: str) -> None:
    """review: polygate reads credentials up to the last "@", libpq (and others) up to
    the first: 'app:hunter2@supersecretword@db' sent "hunter2" as the password and
    quoted "supersecretword@db" as a host it could not resolve, in logs and
    statistics."""
    scheme = {"telemetry": "postgresql", "backend": "redis", "cache": "redis"}[field]
    url = f"{scheme}://app:hunter2@supersecretword@127.0.0.1:1/{'db' if field == 'telemetry' else '0'}"
    with pytest.raises(ConfigError, match="percent-encode it") as info:
        Settings(scopes={"c": Scope(sources=[src()])}, **{field: url})
    assert "hunter2" not in str(info.value) and "supersecretword" not in str(info.value)
    Settings(scopes={"c": Scope(sources=[src()])},  # percent-encoded, it is fine
             **{field: url.replace("hunter2@supersecretword", "hunter2%40supersecretword")})


def test_every_piece_of_credentials_with_an_unencoded_at_is_a_secret() -> None:
    from polygate._secrets import url_secrets

    found = url_secrets("postgresql://app:hunter2@supersecretword@127.0.0.1:1/db")
    assert {"hunter2", "supersecretword"} <= set(found)


@pytest.mark.parametrize("field", ["telemetry", "backend", "cache"])
def test_a_password_holding_an_at_and_then_a_slash_is_still_refused(field: str) -> None:
    """review of the fix below: 'app:p@ssWordTail9/x1@host' has one "@" in its
    authority, and was read as credentials ending there: taken, masked as
    'app:***@ssWordTail9/x1@host', and libpq quoted 'ssWordTail9' as a host it could
    not resolve.  An "@" in the path too reads as a password holding "@" and "/"."""
    scheme = {"telemetry": "postgresql", "backend": "redis", "cache": "redis"}[field]
    url = f"{scheme}://app:p@ssWordTail9/x1@127.0.0.1:1/{'db' if field == 'telemetry' else '0'}"
    with pytest.raises(ConfigError, match="percent-encode it") as info:
        Settings(scopes={"c": Scope(sources=[src()])}, **{field: url})
    assert "ssWordTail9" not in str(info.value)
    assert "ssWordTail9" not in mask_url(url) and "127.0.0.1:1" in mask_url(url)


@pytest.mark.parametrize("field", ["telemetry", "backend", "cache"])
def test_an_at_after_the_credentials_is_the_paths_own(field: str) -> None:
    """An "@" in the query of a URL whose credentials end in its authority was
    refused as if the password held an unencoded "/"; the credentials are unambiguous
    there.  Without an "@" in the authority, an "@" after a "host:port" still is
    refused: it reads as a password holding "/" too."""
    scheme = {"telemetry": "postgresql", "backend": "redis", "cache": "redis"}[field]
    query = {"telemetry": "/db?application_name"}.get(field, "/0?prefix")
    url = f"{scheme}://app:hunter2word@127.0.0.1:1{query}=a@b"
    Settings(scopes={"c": Scope(sources=[src()])}, **{field: url})
    # Messages show it whole but the password (they showed "app:***@b": no host).
    assert mask_url(url) == url.replace("hunter2word", "***")
    with pytest.raises(ConfigError, match="percent-encode it"):
        Settings(scopes={"c": Scope(sources=[src()])}, **{field: url.replace("app:hunter2word@", "")})


def test_a_failure_rate_rule_that_can_never_trip_is_refused() -> None:
    """Review: ``rate_min_calls`` over ``rate_window`` (only the last ``rate_window``
    outcomes are kept) was accepted: the failure-rate rule could never open the
    breaker, and nothing said so."""
    import polygate

    with pytest.raises(ConfigError, match=r"rate_min_calls: .* must be <= rate_window"):
        polygate.Breaker(failure_rate=0.5, rate_window=5, rate_min_calls=6)
    polygate.Breaker(failure_rate=0.5, rate_window=10, rate_min_calls=10)
    polygate.Breaker(rate_window=5, rate_min_calls=10)  # (no rate rule: nothing to trip)


def test_a_rate_window_under_the_default_minimum_names_the_key_written(tmp_path: pathlib.Path) -> None:
    """Only failure_rate and rate_window set (a natural setup): the error named
    rate_min_calls, a key the user never wrote (its default, 10, was the problem), in
    every one of the three ways (an outside review, 2026-12-05)."""
    import polygate

    problem = r"must be >= rate_min_calls \(10, which is also its default: raise rate_window"
    with pytest.raises(ConfigError, match=r"Breaker\.rate_window: \(5\) " + problem):
        polygate.Breaker(failure_rate=0.5, rate_window=5)
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
           "POLYGATE__CHAT__BREAKER__FAILURE_RATE": "0.5",
           "POLYGATE__CHAT__BREAKER__RATE_WINDOW": "5"}
    with pytest.raises(ConfigError, match=r"POLYGATE__CHAT__BREAKER__RATE_WINDOW: \(5\) " + problem):
        Settings.from_env(env)
    path = tmp_path / "p.toml"
    path.write_text('[scopes.chat.breaker]\nfailure_rate = 0.5\nrate_window = 5\n'
                    '[scopes.chat.sources.a]\nbase_url = "http://a/v1"\n')
    with pytest.raises(ConfigError, match=r"scopes\.chat\.breaker\.rate_window: \(5\) " + problem):
        Settings.from_toml(path)


# --------------------------------------------------------------------------- refused values in messages

_SETTINGS_CLASSES = ("Source", "Hedge", "Retry", "StreamWatch", "Breaker", "Structured", "Ocr",
                     "Scope", "Settings", "Serve", "ServeKey")
_BUILDERS: dict[str, Any] = {
    "Source": lambda **kw: Source(**{"name": "a", "base_url": "http://h/v1", **kw}),
    "Scope": lambda **kw: Scope(**{"sources": [src()], **kw}),
    "Settings": lambda **kw: Settings(**{"scopes": {"chat": Scope(sources=[src()])}, **kw}),
    "ServeKey": lambda **kw: polygate.ServeKey(**{"key": "sk-gw-k-12345678", **kw}),
}
_EVERY_FIELD = [
    (name, field.name)
    for name in _SETTINGS_CLASSES
    for field in attrs.fields(getattr(polygate, name))
]


def _build(cls_name: str, field: str, value: Any) -> Any:
    builder = _BUILDERS.get(cls_name) or getattr(polygate, cls_name)
    return builder(**{field: value})


@pytest.mark.parametrize(("cls_name", "field"), _EVERY_FIELD)
@pytest.mark.parametrize(
    "value",
    [10**5000, -(10**5000), "sk-proj-" + "AbCdEfGh" * 6],
    ids=["huge-int", "huge-negative-int", "long-string"],
)
def test_a_refused_value_is_described_not_quoted_whole(cls_name: str, field: str, value: Any) -> None:
    # A 5,000-digit integer once made the validator's own message fail (Python refuses
    # to format an int past 4,300 digits): a bare ValueError naming no field escaped.
    # A long string, perhaps a key pasted into the wrong field, is described by its
    # length.  Every field of every settings class either takes the value or refuses
    # it with a short ConfigError that names the field.
    try:
        _build(cls_name, field, value)
    except ConfigError as error:
        message = str(error)
        assert field.split(".")[0] in message or cls_name in message
        assert len(message) < 400, message
        assert "AbCdEfGh" not in message
    except Exception as error:
        pytest.fail(f"{cls_name}.{field}={type(value).__name__}: {type(error).__name__}: {error}")


def test_a_huge_int_is_named_by_its_size() -> None:
    with pytest.raises(ConfigError) as info:
        src(timeout_s=-(10**5000))
    assert "timeout_s" in str(info.value)
    assert "a whole number of about 5001 digits" in str(info.value)


def test_a_serve_alias_naming_a_long_unknown_scope_does_not_quote_it() -> None:
    pasted = "sk-proj-" + "AbCdEfGh" * 6
    with pytest.raises(ConfigError) as info:
        Settings(scopes={"chat": Scope(sources=[src()])}, serve=polygate.Serve(models={"gpt": pasted}))
    assert "AbCdEfGh" not in str(info.value)
    assert f"a value of {len(pasted)} characters" in str(info.value)


class _HostileInt(int):
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class _SecretInt(int):
    def __repr__(self) -> str:
        return "sk-proj-" + "AbCdEfGh" * 4


class _HostileStr(str):
    def __len__(self) -> int:
        raise RuntimeError("no len")


_PASTED = "sk-proj-" + "AbCdEfGh" * 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("structured_output", [_PASTED]),  # a key inside a list: its repr is short enough
        ("structured_output", _PASTED.encode()),
        ("structured_output", _HostileStr("x" * 30)),
        ("rpm", _SecretInt(-5)),  # (a subclass's own repr is never asked)
        ("rpm", _HostileInt(-5)),
    ],
    ids=["key-in-list", "key-as-bytes", "str-whose-len-raises", "int-whose-repr-is-a-key",
         "int-whose-repr-raises"],
)
def test_an_odd_refused_value_still_gives_a_config_error_without_it(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        src(**{field: value})
    assert field in str(info.value)
    assert "AbCdEfGh" not in str(info.value)


def test_a_long_fallback_that_merely_holds_a_scheme_separator_is_not_quoted() -> None:
    # Quoted whole because it held "://" somewhere: only a value that starts like a
    # URL is shown (its password masked); a key that ends in "://x" is described.
    pasted = "sk-proj-" + "AbCdEfGh" * 5 + "://x"
    with pytest.raises(ConfigError) as info:
        Scope(sources=[src()], fallback=pasted)
    assert "AbCdEfGh" not in str(info.value)
    with pytest.raises(ConfigError, match=r"got 'http://user:\*\*\*@h/v1'"):
        Scope(sources=[src()], fallback=f"http://user:{URL_PW}@h/v1")


def test_a_long_refused_scope_name_is_not_in_the_field_path_either() -> None:
    # Review: the message said "a value of 45 characters (not shown)" after a field
    # path that showed it: "Settings.scopes.sk-proj-…".
    pasted = "sk-proj-" + "AbCdEfGh" * 5 + " "
    with pytest.raises(ConfigError) as info:
        Settings(scopes={pasted: Scope(sources=[src()])})
    assert "AbCdEfGh" not in str(info.value)


@pytest.mark.parametrize(("what", "name"), [
    *((what, name) for what in ("source", "scope", "key")
      for name in ("_ops", "-ops", ".ops", "a__b", "a b")),
    ("key", "k" * 65),  # (a long source or scope name is allowed: the next test)
])
def test_a_refused_name_is_told_the_whole_rule(what: str, name: str) -> None:
    """A sweep of docs/serve.md: a key name was refused with "must be letters, digits,
    '_', '-', '.'", a rule ``_ops`` and ``a__b`` meet (the first character, ``__`` and
    the length were unsaid), and a scope name with a rule that left out the ``.`` it
    allows.  The message now states the rule the check applies."""
    import polygate

    source = polygate.Source(name="a", base_url="http://a/v1")
    with pytest.raises(ConfigError) as caught:
        if what == "source":
            polygate.Source(name=name, base_url="http://a/v1")
        elif what == "scope":
            polygate.Settings(scopes={name: polygate.Scope(sources=[source])})
        else:
            polygate.Serve(keys={name: polygate.ServeKey(key="sk-gw-0123456789abcdef")})
    message = str(caught.value)
    assert "start with a letter or digit" in message and "'.'" in message and "'__'" in message
    assert ("64 characters" in message) is (what == "key")


@pytest.mark.parametrize("what", ["source", "scope"])
def test_a_long_source_or_scope_name_is_allowed(what: str) -> None:
    import polygate

    name = "k" * 65
    source = polygate.Source(name=name if what == "source" else "a", base_url="http://a/v1")
    polygate.Settings(scopes={name if what == "scope" else "chat": polygate.Scope(sources=[source])})


@pytest.mark.parametrize("host", ["h\x00x", "a\tb", "a b", "h\u200bx", "h\nx", ""])
def test_a_serve_host_that_is_not_printable_is_refused(host: str) -> None:
    """A docs sweep: ``Serve(host="h\\x00x")`` was taken (only whitespace was refused)
    and its NUL written raw to stderr when the server could not listen there."""
    import polygate

    with pytest.raises(ConfigError, match=r"Serve\.host: must be a host name or address"):
        polygate.Serve(host=host)


@pytest.mark.parametrize("host", ["::1", "localhost", "0.0.0.0", "höst.example", "10.0.0.1",
                                  "fe80::1%eth0", "2001:db8::8:800:200c:417a"])
def test_a_printable_serve_host_is_taken(host: str) -> None:
    import polygate

    assert polygate.Serve(host=host).host == host


@pytest.mark.parametrize("host", ["localhost:8080", "http://127.0.0.1:8080", "127.0.0.1/v1",
                                  "http://u:hunter2pw@127.0.0.1", "[::1]:8080",
                                  "[fe80::1%eth0]:80", "[::1]"])
def test_a_serve_host_with_a_port_or_a_scheme_is_refused(host: str) -> None:
    """Outside review (fuzzing the configuration): both passed ``check-config
    --serve``; ``polygate serve`` then failed to listen on "localhost:8080:8080"."""
    import polygate

    with pytest.raises(ConfigError, match=r"Serve\.host: .*no ':port'") as info:
        polygate.Serve(host=host)
    assert "hunter2pw" not in str(info.value)


_NO_NAME = ["a..b", ".a", "a" * 64, f"{'b' * 64}.example"]


@pytest.mark.parametrize("host", [*_NO_NAME, "\U0001f980.example", "\u0661\u0662\u0663.example"])
def test_a_serve_host_no_resolver_can_be_asked_for_is_refused(host: str) -> None:
    """Outside review (fuzzing the command line): ``polygate serve --host a..b`` was a
    UnicodeError traceback from the listener (Python's IDNA codec, which the resolver
    is asked through, refuses an empty label or one over 63 characters; trio encodes a
    name that is not ASCII by IDNA 2008, which refuses an emoji: a second review)."""
    import polygate

    with pytest.raises(ConfigError, match=r"Serve\.host: .*empty label"):
        polygate.Serve(host=host)


@pytest.mark.parametrize("host", _NO_NAME)
def test_a_base_url_whose_host_no_resolver_can_be_asked_for_is_refused(host: str) -> None:
    """The same host in a source's ``base_url`` passed check-config, then every call
    failed as "a malformed upstream body (UnicodeError)", retried, though no upstream
    had answered."""
    import polygate

    with pytest.raises(ConfigError, match=r"base_url.*empty label"):
        polygate.Source(name="a", base_url=f"http://{host}/v1")
    polygate.Source(name="a", base_url="http://xn--bcher-kva.de./v1")  # (a trailing dot: fine)


def test_a_labelled_key_table_with_a_field_name_that_is_no_string_is_a_config_error() -> None:
    """Outside review (fuzzing the configuration): ``keys={"k": {0: 1, "x": 1}}`` raised
    TypeError (sorting names of mixed types)."""
    import polygate

    with pytest.raises(ConfigError, match=r"keys\.k\..*unknown field"):
        polygate.Serve(keys={"k": {0: 1, "x": 1, "key": "abcdefgh"}})


@pytest.mark.parametrize("build", [
    lambda: __import__("polygate").Retry(max_attempts=10**5000),
    lambda: __import__("polygate").Source(name="a", base_url="http://a/v1", rpm=2**63),
    lambda: __import__("polygate").ServeKey(key="abcdefgh", tpm=10**5000),
    lambda: __import__("polygate").Ocr(max_document_bytes=2**64),
], ids=["Retry", "Source", "ServeKey", "Ocr"])
def test_a_whole_number_past_64_bits_is_refused(build: Any) -> None:
    """Outside review (fuzzing the configuration): ``Retry(max_attempts=10**5000)`` was
    taken, and the settings' repr then raised (Python shows no int of over 4,300
    digits): a valid configuration that could not be logged."""
    with pytest.raises(ConfigError, match=r"at most 2\*\*63 - 1"):
        build()


def test_fallback_on_given_as_a_set_is_in_one_order() -> None:
    """Review (interpreter flags): a set was stored in its iteration order, which
    PYTHONHASHSEED decides: a Scope's repr, equality and hash changed from one process
    to the next.  A set (which has no order) is sorted; a list keeps its own.  (In
    processes of fixed hash seeds: this one's seed may happen to iterate it sorted.)"""
    import os
    import subprocess
    import sys

    script = (
        "import polygate\n"
        "source = polygate.Source(name='a', base_url='http://x/v1')\n"
        "reasons = ['status:413', 'rate_limited', 'fatal', 'exhausted']\n"
        "for given in (set(reasons), frozenset(reasons), reasons):\n"
        "    print(polygate.Scope(sources=[source], fallback='b', fallback_on=given).fallback_on)\n"
    )
    expected = "('exhausted', 'fatal', 'rate_limited', 'status:413')\n" * 2 \
        + "('status:413', 'rate_limited', 'fatal', 'exhausted')\n"
    for seed in ("1", "2", "4"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}, timeout=60, check=True)
        assert done.stdout == expected, (seed, done.stdout)


@pytest.mark.parametrize("given", [{"fatal", 3}, frozenset({"fatal", None})])
def test_fallback_on_a_set_of_other_things_is_a_config_error(given: Any) -> None:
    """Review of the sorting above: a set with a member that is no string was sorted
    before the validator saw it (a bare TypeError)."""
    with pytest.raises(polygate.ConfigError, match="fallback_on"):
        polygate.Scope(sources=[polygate.Source(name="a", base_url="http://x/v1")],
                       fallback="b", fallback_on=given)
