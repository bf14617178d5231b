"""Secrets in the forms an upstream may echo them in (base64, every byte
percent-encoded, a Basic credential, upper case, hex), and secrets that hold a byte
that is not UTF-8 (a lone surrogate: how Python reads an environment value's): an
outside review found each of these printed, or redaction itself failing with an
untyped error that carried the secret."""
from __future__ import annotations

import base64
import warnings
from typing import Any

import pytest

import polygate
from polygate._config_load import settings_from_env
from polygate.testing import FakeUpstream, Reply, Router

KEY = "sk-proj-SECRETabcdef0123456789XYZ"


def _one(key: str = KEY, **settings: Any) -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=key)],
            retry=polygate.Retry(max_attempts=1))},
        **settings,
    )


async def _fail(settings: polygate.Settings, transport: Any) -> polygate.PolygateError:
    async with polygate.session(settings, transport=transport) as s:
        with pytest.raises(polygate.PolygateError) as info:
            await s.chat([{"role": "user", "content": "hi"}], cache=False)
    return info.value


# ------------------------------------------------------------------ 1. encoded echoes

_ECHOES = {
    # an upstream that logs/echoes the credential it refused, in the spellings the
    # brief names: base64 (alone, and as an HTTP Basic credential), percent-encoded
    # byte by byte (upper and lower hex, as e.g. a proxy's access-log line shows it)
    "base64": base64.b64encode(KEY.encode()).decode(),
    "base64url-unpadded": base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("="),
    "basic-credential": "Basic " + base64.b64encode(f"user:{KEY}".encode()).decode(),
    "percent-every-byte": "".join(f"%{b:02X}" for b in KEY.encode()),
    "percent-every-byte-lower": "".join(f"%{b:02x}" for b in KEY.encode()),
    "upper-case": KEY.upper(),
    "hex": KEY.encode().hex(),
}


def _decodes_to_key(text: str) -> bool:
    import re
    from urllib.parse import unquote

    if KEY in unquote(text):
        return True
    for run in re.findall(r"[A-Za-z0-9+/_=-]{16,}", text):
        for alt in (run, run.replace("-", "+").replace("_", "/")):
            try:
                if KEY.encode() in base64.b64decode(alt + "=" * (-len(alt) % 4)):
                    return True
            except ValueError:
                pass
    return False


@pytest.mark.parametrize("spelling", list(_ECHOES))
async def test_an_encoded_echo_of_the_key_is_redacted(spelling: str, autojump_clock: Any) -> None:
    echo = _ECHOES[spelling]
    up = FakeUpstream(Reply(status=401, error_body={"error": {"message": f"invalid credential {echo}"}}))
    error = await _fail(_one(), up.transport())
    shown = f"{error!s} {error!r} {getattr(error, 'errors', '')!r}"
    assert "invalid credential" in shown
    assert not _decodes_to_key(shown), shown
    assert KEY.upper() not in shown and KEY.encode().hex() not in shown


# ------------------------------------------------------------------ 2. surrogate secrets

SURROGATE_PW = "pw-SECRET\udcff-9876"  # a non-UTF-8 byte of an environment value


@pytest.mark.parametrize("field", ["telemetry", "cache", "backend"])
def test_a_url_whose_password_is_not_utf8_is_a_config_error(field: str) -> None:
    """Such a URL was taken; then redacting it (``quote()`` of the password) raised
    UnicodeEncodeError, so the first upstream error of any call escaped as that bare
    error with the password in its repr (for telemetry: opening the session did, in
    psycopg).  No client could send that password anyway: refused, quoting nothing."""
    url = {
        "telemetry": f"postgresql://u:{SURROGATE_PW}@127.0.0.1:1/db",
        "cache": f"redis://:{SURROGATE_PW}@127.0.0.1:1/0",
        "backend": f"redis://:{SURROGATE_PW}@127.0.0.1:1/0",
    }[field]
    with pytest.raises(polygate.ConfigError, match="UTF-8") as info:
        _one(**{field: url})
    assert "SECRET" not in str(info.value)


async def test_a_source_with_an_unsendable_key_does_not_break_the_other_sources(
    autojump_clock: Any,
) -> None:
    """docs/tests: a key that cannot be a header (built in Python) is a ConfigWarning
    and 'every call to this source fails ... while the other sources carry on'.  With
    a lone surrogate in it, every *other* source's error (a 400 here) escapes as a bare
    UnicodeEncodeError carrying the key: redact() cannot quote() it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", polygate.ConfigWarning)
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key="sk-SECRET\udcff-1234", weight=1e-9),
            polygate.Source(name="b", base_url="http://b/v1", api_key="sk-good-key-123", weight=1.0),
        ])})
    router = Router({"a": FakeUpstream(), "b": FakeUpstream(
        Reply(status=400, error_body={"error": {"message": "bad request"}}))})
    error = await _fail(settings, router)
    assert isinstance(error, polygate.FatalUpstreamError)
    assert "SECRET" not in repr(error)


def test_the_env_loader_with_a_surrogate_url_password_gives_a_config_error() -> None:
    """Any other configuration mistake next to such a URL: the loader's last-resort
    scrub (redact) raises UnicodeEncodeError instead of the ConfigError naming the key."""
    env = {
        "POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:9/v1",
        "POLYGATE__CHAT__A__TIMEOUT_S": "-1",
        "POLYGATE__BACKEND": f"redis://:{SURROGATE_PW}@127.0.0.1:6379/0",
    }
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_env(env)
    assert "SECRET" not in str(info.value)


def test_a_surrogate_password_in_an_unknown_scheme_url_gives_a_config_error() -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:9/v1",
           "POLYGATE__TELEMETRY": f"redis://:{SURROGATE_PW}@h/0"}
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_env(env)
    assert "SECRET" not in str(info.value)


# ------------------------------------------------------------------ 3. gateway keys from env

@pytest.mark.parametrize("var", ["POLYGATE__SERVE__API_KEYS", "POLYGATE__SERVE__KEYS__K__KEY"])
def test_a_gateway_key_with_a_non_utf8_byte_is_a_config_error(var: str) -> None:
    """A gateway key read from the environment with a non-UTF-8 byte (a lone
    surrogate) is added to the loader's secrets before validation; the validator's
    ConfigError is then scrubbed with redact(), which raises UnicodeEncodeError whose
    repr holds the gateway key."""
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:9/v1", var: "gw-SECRET\udcff-key"}
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_env(env)
    assert "SECRET" not in str(info.value)


def _cli(args: list[str], extra: dict[bytes, bytes], tmp_path: Any) -> tuple[int, str]:
    import os
    import subprocess
    import sys

    env = {k.encode(): v.encode() for k, v in os.environ.items() if not k.startswith("POLYGATE")}
    env.update(extra)
    try:
        done = subprocess.run([sys.executable, "-m", "polygate", *args], env=env,
                              capture_output=True, cwd=tmp_path, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args} hung")
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


@pytest.mark.parametrize("args", [["check-config"], ["serve", "--port", "0"]])
def test_cli_with_a_non_utf8_gateway_key_prints_no_traceback(args: list[str], tmp_path: Any) -> None:
    code, out = _cli(args, {b"POLYGATE__CHAT__A__BASE_URL": b"http://127.0.0.1:9/v1",
                            b"POLYGATE__SERVE__API_KEYS": b"gw-SECRET\xff-key"}, tmp_path)
    assert "Traceback" not in out, out[-500:]
    assert code == 2


def test_cli_with_a_non_utf8_telemetry_password_prints_no_traceback(tmp_path: Any) -> None:
    """check-config called the configuration valid (exit 0); polygate chat then died
    with a bare UnicodeEncodeError traceback from psycopg.  Both refuse it now."""
    env = {b"POLYGATE__CHAT__A__BASE_URL": b"http://127.0.0.1:9/v1",
           b"POLYGATE__TELEMETRY": b"postgresql://u:p\xffSECRETpw@127.0.0.1:1/db"}
    for args in (["check-config"], ["chat", "hi"]):
        code, out = _cli(args, env, tmp_path)
        assert "Traceback" not in out and "SECRET" not in out, out[-400:]
        assert code == 2, (args, out[-400:])


# ------------------------------------------------------------------ 4. serve: the 502 body

async def test_serve_error_body_shows_no_base64_echo_of_the_upstream_key() -> None:
    from ._serve_kit import AUTH, CHAT, gateway, http

    key = "sk-upstream-key"  # the key settings_for() gives every source
    echo = base64.b64encode(key.encode()).decode()
    reply = Reply(status=400, error_body={"error": {"message": f"token {echo} refused"}})
    async with gateway(reply) as (server, _up):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert answer.status == 400
    assert b"refused" in answer.body
    assert echo.encode() not in answer.body, answer.body


# ------------------------------------------------------------------ 5. reprs

async def test_no_repr_reachable_from_the_server_holds_a_gateway_key_digest() -> None:
    """Gateway (serve/_app.py) is an attrs class whose default repr shows ``keys``: the
    unsalted SHA-256 digest of every gateway key, a verifier for offline guessing,
    printed by any traceback-with-locals reporter (Sentry, rich) that meets it."""
    import hashlib

    from polygate.serve import open_server

    gw = "gw-key-0123456789abcdef"
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://127.0.0.1:9/v1")])},
        serve=polygate.Serve(api_keys=[gw]))
    digest = hashlib.sha256(gw.encode()).digest()
    async with open_server(settings, port=0) as server:
        shown = repr(vars(server))
    assert repr(digest)[2:-1] not in shown and digest.hex() not in shown


HIGH = "sk-SECRET\ud83d-1234"  # a lone surrogate that stands for no byte (json.loads('"\\ud83d"'))


def test_redact_never_fails_on_any_lone_surrogate() -> None:
    """Review: only U+DC80..U+DCFF (a non-UTF-8 byte of the environment) was handled;
    half an emoji from a JSON-loaded configuration still made redaction raise."""
    from polygate._secrets import redact

    assert redact(f"echo {HIGH} end", (HIGH,)) == "echo *** end"
    with pytest.raises(polygate.ConfigError) as info:
        _one(backend="redis://:pw-SECRET\ud83d-9876@127.0.0.1:6379/0")
    assert "SECRET" not in str(info.value)
