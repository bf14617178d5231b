"""What a secret is and where it may not appear: redaction of every spelling, before
any cut; keys that can travel in a header; URLs whose passwords a parser misreads."""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

import polygate
from polygate._config import mask_url
from polygate._config_load import settings_from_env, settings_from_toml
from polygate._secrets import clip, redact, url_secrets
from polygate.testing import FakeUpstream, Reply
from polygate.transport import Endpoint
from polygate.transport._exchange import _classified

KEY = "sk-live-SECRET-4f9a1c77d0e2'\\\"x"
PASSWORD = "Xk9mQ2vLr7#Tq/z?w"


# --------------------------------------------------------------------------- redaction


@pytest.mark.parametrize("spelling", [
    KEY,
    repr(KEY)[1:-1],
    repr(KEY.encode())[2:-1],
    json.dumps(KEY)[1:-1],
    quote(KEY, safe=""),
    html.escape(KEY),  # an HTML error page
    KEY.lower(),  # a header value read case-insensitively
])
def test_every_spelling_of_a_secret_is_redacted(spelling: str) -> None:
    assert redact(f"echo: {spelling}!", (KEY,)) == "echo: ***!"


def test_redaction_comes_before_the_cut() -> None:
    text = "y" * 180 + KEY + " and more"
    clipped = clip(text, 200, (KEY,))
    assert clipped == "y" * 180 + "*** and more"


def test_a_cut_mid_secret_drops_the_partial_tail() -> None:
    text = "y" * 190 + KEY
    clipped = clip(text[:200], 300, (KEY,), cut=True)  # an excerpt that stopped in the key
    assert KEY[:4] not in clipped and clipped.endswith("…")
    text = "an excerpt that stopped in the key " + KEY
    assert clip(text[:40], 300, (KEY,), cut=True) == "an excerpt that stopped in the key …"


OTHER = "sk-gw-bob-0123456789abcdefgh"


@pytest.mark.parametrize("guess", ["s", "sk", "sk-", "sk-g", "sk-gw-b", "sk-gw-bob-01", "sk-gw-bob-0X"])
def test_a_cut_says_nothing_of_whether_its_tail_begins_a_secret(guess: str) -> None:
    """The cut drops the last word whatever it holds: dropped only where it began a
    secret, a client that can place text at the cut (an upstream's 400 echoing its
    value) learnt whether its guess began a key, a character at a time."""
    wrong = "q" * len(guess)
    for pad in ("x" * 280, "words " * 47):
        right_cut = clip(pad + guess + "'. Supported values", len(pad) + len(guess), (KEY, OTHER))
        wrong_cut = clip(pad + wrong + "'. Supported values", len(pad) + len(guess), (KEY, OTHER))
        assert right_cut == wrong_cut.replace(wrong, guess)
        assert guess not in right_cut[-len(guess) - 1:] and right_cut.endswith("…")


def test_a_cut_message_in_words_without_blanks_keeps_them() -> None:
    """Review: the drop took the trailing run of non-blank characters, so a Chinese
    error text (no blanks: DashScope's, Zhipu's, Moonshot's) lost up to three times
    a key's length, and all of it with a long key.  Only visible ASCII can spell a
    key."""
    message = "请求参数错误：模型不支持该参数，请检查后重试。" * 20
    clipped = clip(message, 300, ("sk-proj-" + "A" * 156,))
    assert clipped == message[:300] + "…"
    assert clip(message[:290] + "sk-pr", 300, ("sk-proj-" + "A" * 156,), cut=True) == message[:290] + "…"


def test_a_cut_says_nothing_of_how_long_the_secrets_are() -> None:
    """Review: a drop capped at the longest spelling of a secret (three times its
    length) told a client who sent a long run without blanks how long another
    tenant's key was.  The whole run goes, whatever the secrets."""
    text = "a message: " + "z" * 500
    assert clip(text, 300, (OTHER,)) == clip(text, 300, (OTHER + "0" * 40,)) == "a message: …"
    assert clip("z" * 500, 300, (OTHER,)) == "…"
    assert clip("z" * 500, 300) == "z" * 300 + "…"  # no secrets: nothing to hide


async def test_a_tenant_cannot_read_a_key_through_an_echoed_value_cut_at_the_limit() -> None:
    """The attack end to end: an upstream that echoes a bad role in its 400 (as OpenAI
    does), a tenant padding the role so that the gateway's cut lands after its guess.
    A guess that begins another tenant's key and one that does not get the same
    answer."""
    from polygate.serve import open_server

    def echo(request: Any, rng: Any) -> Reply:
        role = request.body["messages"][0]["role"]
        return Reply(status=400, error_body={"error": {
            "message": f"Invalid value: '{role}'. Supported values are: 'system', 'user'.",
            "type": "invalid_request_error", "code": "invalid_value"}})

    carol = "sk-gw-carol-attacker-key-000"
    up = FakeUpstream(echo)
    async with up.serve() as url:
        settings = polygate.Settings(
            scopes={
                "carol": polygate.Scope(sources=[polygate.Source(name="sc", base_url=url)]),
                "bob": polygate.Scope(sources=[polygate.Source(name="sb", base_url=url)]),
            },
            serve=polygate.Serve(keys={
                "carol": polygate.ServeKey(key=carol, models=["carol"]),
                "bob": polygate.ServeKey(key=OTHER, models=["bob"]),
            }),
        )
        async with open_server(settings, port=0) as server, \
                httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:

            async def answer(guess: str) -> str:
                pad = "x" * (300 - len("Invalid value: '") - len(guess))
                r = await client.post("/chat/completions", headers={
                    "authorization": f"Bearer {carol}"}, json={
                    "model": "carol", "messages": [{"role": pad + guess, "content": "hi"}]})
                assert r.status_code == 400, r.text
                return str(r.json()["error"]["message"])

            right, wrong = await answer("sk-gw-bo"), await answer("sk-gw-bq")
            assert right.endswith("…") and right == wrong


def test_short_secrets_are_left_alone() -> None:
    assert redact("abc abc", ("abc",)) == "abc abc"


@pytest.mark.parametrize(("url", "expected"), [
    (f"redis://default:{PASSWORD}@h:6379/0", {f"default:{PASSWORD}", PASSWORD}),
    ("postgresql://u:p%40ss-word@db/t", {"u:p%40ss-word", "p%40ss-word", "p@ss-word"}),
    ("redis://user@h/0", set()),
    ("sqlite:///tmp/a@b.db", set()),
    ("http://h/v1", set()),
])
def test_url_secrets_come_from_the_raw_text(url: str, expected: set[str]) -> None:
    assert set(url_secrets(url)) == expected


def test_settings_secrets_include_the_decoded_password() -> None:
    settings = polygate.Settings(
        scopes={"c": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://h")])},
        telemetry="postgresql://u:p%40ss-word@db/t",
    )
    assert "p@ss-word" in settings.secrets()


# --------------------------------------------------------------------------- F1 F2 F13


BAD_KEYS = [
    "sk-live-SECRET-4f9a\x001c77d0e2",
    "sk-live-SECRET-4f9a\x0b1c77d0e2",
    "sk-live-SECRET-4f9a\x0c1c77d0e2",
    "sk-live-SECRET-4f9a1c\u200b",
    "sk-live-SECRET-4f9a1c\u00e9",
    "sk-live-SECRET-4f9a1c ",
    " sk-live-SECRET-4f9a1c",
    "sk-live SECRET-4f9a1c",
]


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_a_key_that_cannot_be_a_header_is_announced_at_construction_and_never_sent(
    key: str,
) -> None:
    """Built in Python, such a key is a ConfigWarning at once (the loaders and
    check-config refuse it outright, below); no call sends it: the source fails every
    call as SourceDeadError, typed, before any I/O, and no message shows the key."""
    with pytest.warns(polygate.ConfigWarning, match="printable ASCII") as caught:
        source = polygate.Source(name="a", base_url="http://h/v1", api_key=key)
    assert all("SECRET" not in str(w.message) for w in caught)
    endpoint = Endpoint("a", "http://h/v1", key)
    assert endpoint.key_problem is not None and "SECRET" not in endpoint.key_problem
    assert all(name != "authorization" for name, _ in endpoint.headers(None))
    up = FakeUpstream(Reply())
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[source], retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.chat([{"role": "user", "content": "hi"}])
    assert [type(e) for e in info.value.errors] == [polygate.SourceDeadError]
    assert "cannot be sent" in str(info.value.errors[0])
    assert "SECRET" not in repr(info.value) and "SECRET" not in repr(info.value.errors)
    assert up.requests == []


def test_a_key_with_a_line_break_is_refused_at_construction() -> None:
    with pytest.raises(polygate.ConfigError, match="line breaks") as info:
        polygate.Source(name="a", base_url="http://h/v1", api_key="sk-live-SECRET\r\nX: 1")
    assert "SECRET" not in str(info.value)


@pytest.mark.parametrize("key", BAD_KEYS[:5])
def test_a_bad_key_is_refused_by_the_loaders(key: str, tmp_path: Path) -> None:
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_env({"POLYGATE__CHAT__A__BASE_URL": "http://h/v1", "POLYGATE__CHAT__A__API_KEY": key})
    assert "SECRET" not in str(info.value)
    assert "POLYGATE__CHAT__A__API_KEY" in str(info.value)
    path = tmp_path / "p.toml"
    path.write_text(f'[scopes.chat.sources.a]\nbase_url = "http://h/v1"\napi_key = {json.dumps(key)}\n')
    with pytest.raises(polygate.ConfigError) as info:
        settings_from_toml(str(path))
    assert "SECRET" not in str(info.value)


def test_check_config_refuses_a_key_with_an_invisible_character(tmp_path: Path) -> None:
    env = {**os.environ, "POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:9/v1",
           "POLYGATE__CHAT__A__API_KEY": "sk-live-SECRET-4f9a1c\u200b"}
    done = subprocess.run([sys.executable, "-m", "polygate", "check-config"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert "SECRET" not in done.stdout + done.stderr and "Traceback" not in done.stderr


def test_a_transport_error_shows_no_spelling_of_the_key() -> None:
    """Defence in depth below the validators: h11 quotes a refused value escaped."""
    key = "sk-SECRET-\x00-abcdef"
    endpoint = Endpoint("a", "http://h/v1", "sk-SECRET-ok-abcdef")
    object.__setattr__(endpoint, "api_key", key)
    error = _classified(httpx.LocalProtocolError(f"Illegal header value {('Bearer ' + key).encode()!r}"), endpoint)
    assert "SECRET" not in str(error)


# --------------------------------------------------------------------------- F4 F10


@pytest.mark.parametrize("kind", ["base_url", "backend", "telemetry"])
@pytest.mark.parametrize("password", [PASSWORD, "Xk9mQ2vLr7/Tq", "1234/Xk9mQ2v", "Xk9mQ2?vLr7"])
def test_a_url_password_a_parser_misreads_is_never_shown(kind: str, password: str) -> None:
    scheme = {"base_url": "http", "backend": "redis", "telemetry": "postgresql"}[kind]
    url = f"{scheme}://user:{password}@127.0.0.1:5000/v1"
    with pytest.raises(polygate.ConfigError) as info:
        if kind == "base_url":
            polygate.Source(name="a", base_url=url)
        else:
            polygate.Settings(scopes={"c": polygate.Scope(sources=[
                polygate.Source(name="a", base_url="http://h")])}, **{kind: url})
    for n in range(4, len(password) + 1):
        assert password[:n] not in str(info.value), str(info.value)
    assert password[:4] not in mask_url(url)


def test_check_config_never_prints_a_password_prefix(tmp_path: Path) -> None:
    env = {**os.environ, "POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:9/v1",
           "POLYGATE__BACKEND": f"redis://default:{PASSWORD}@127.0.0.1:6379/0"}
    done = subprocess.run([sys.executable, "-m", "polygate", "check-config"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert PASSWORD[:6] not in done.stdout + done.stderr


@pytest.mark.parametrize(("url", "problem"), [
    ("http://127.0.0.1:9/v1\r\nX-Injected: 1", "blanks or control characters"),
    ("http://127.0.0.1:9/v1\t", "blanks or control characters"),
    ("http://127.0.0.1:9/ v1", "blanks or control characters"),
    ("http://127.0.0.1:9/v1?api-version=2024-06-01", "query or a fragment"),
    ("http://127.0.0.1:9/v1#frag", "query or a fragment"),
    ("http://user:pa55-SECRET@127.0.0.1:9/v1", "credentials before the host"),
    ("http://user:1234/x@api.example.com/v1", "percent-encode"),
])
def test_a_base_url_that_cannot_work_as_written_is_refused(url: str, problem: str) -> None:
    with pytest.raises(polygate.ConfigError, match=problem) as info:
        polygate.Source(name="a", base_url=url)
    assert "SECRET" not in str(info.value)


def test_an_at_sign_in_a_base_url_path_is_fine() -> None:
    polygate.Source(name="a", base_url="http://h/v1/@models")


@pytest.mark.parametrize("header", ["content-type", "content-encoding", "content-encoding, cut"])
async def test_a_key_in_an_upstream_response_header_never_shows(header: str, tmp_path: Path) -> None:
    """A probe found the source's key, echoed by an upstream in a response header, in
    the error's message: whole from Content-Type (a body that was not JSON), lower-cased
    from Content-Encoding, and so in the telemetry rows and a gateway's 502 body."""
    from ._raw_server import raw_server

    value = {
        "content-type": f"text/plain; k={KEY}",
        "content-encoding": f"gzip-{KEY}",
        # quoted cut at 40 characters, inside the key: the cut part must not show either
        "content-encoding, cut": f"gzip-padding-padding-{KEY}",
    }[header]
    header = header.split(",")[0]

    async def reply(stream: Any, head: bytes) -> None:
        await stream.send_all(f"HTTP/1.1 200 OK\r\n{header}: {value}\r\n"
                              "content-length: 3\r\n\r\nabc".encode("latin-1"))

    db = tmp_path / "t.db"
    async with raw_server(reply) as server:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=server.url, api_key=KEY, streaming=False)],
            retry=polygate.Retry(max_attempts=1))}, telemetry=f"sqlite://{db}")
        async with polygate.session(settings) as s:
            with pytest.raises(polygate.AllSourcesExhausted) as info:
                await s.chat([{"role": "user", "content": "hi"}])
    text = f"{info.value!s} {info.value!r} {info.value.errors!r}"
    for spelling in (KEY, KEY.lower(), KEY[:12]):
        assert spelling not in text
    import sqlite3

    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT * FROM calls").fetchall() + conn.execute(
            "SELECT * FROM attempts").fetchall()
    conn.close()
    cells = [str(cell).lower() for row in rows for cell in row]
    assert cells and not [c for c in cells if KEY.lower()[:12] in c]


async def test_an_upstream_echoing_any_secret_of_the_settings_is_redacted(
    autojump_clock: Any,
) -> None:
    """Review finding: only the source's own key was redacted from its error text;
    the backend's password (docs/distributed.md promises it), another source's key,
    a gateway key or the cache URL's password came through as the upstream sent them."""
    from polygate.testing import Router

    others = {
        "b_key": "sk-other-source-SECRET-77aa",
        "gateway": "sk-gw-SECRET-0c1d2e3f",
        "cache_pw": "cache-pw-SECRET-9b8a",
    }
    echo = " / ".join(others.values())
    a = FakeUpstream(Reply(status=400, error_body={"error": {"message": f"echo: {echo}"}}))
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key="sk-own-SECRET-1234", weight=1.0),
            polygate.Source(name="b", base_url="http://b/v1", api_key=others["b_key"], weight=1e-9),
        ])},
        serve=polygate.Serve(api_keys=(others["gateway"],)),
        cache=f"redis://:{others['cache_pw']}@127.0.0.1:1/0",  # unreachable: fails open
    )
    async with polygate.session(settings, transport=Router({"a": a, "b": FakeUpstream()})) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.chat([{"role": "user", "content": "hi"}], cache=False)
    shown = str(info.value) + repr(info.value) + str(vars(info.value))
    assert "echo:" in shown
    assert not [name for name, secret in others.items() if secret in shown]


def test_a_postgres_password_in_the_query_is_in_no_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Review: with ``?password=`` in the telemetry URL, the warning that the server is
    unreachable quoted the driver's error, which repeated the password whole (only the
    user part's password was redacted)."""
    import logging

    import trio

    pytest.importorskip("psycopg")
    scopes = {"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://127.0.0.1:9/v1")])}
    # A bad percent escape: libpq quotes the token it refused.  Refused with the
    # settings now, in words of its own.
    with pytest.raises(polygate.ConfigError, match="cannot be read by libpq") as info:
        polygate.Settings(scopes=scopes, telemetry="postgresql://u@127.0.0.1:1/db?password=Zq7SECRETpw%zz")
    assert "Zq7SECRET" not in str(info.value)
    secret = "Zq7SECRETpw"
    settings = polygate.Settings(scopes=scopes, telemetry=f"postgresql://u@127.0.0.1:1/db?password={secret}")

    async def main() -> str:
        try:
            async with polygate.session(settings) as s:
                return repr(await s.statistics())
        except polygate.PolygateError as exc:
            return str(exc)

    with caplog.at_level(logging.DEBUG):
        shown = trio.run(main)
    text = shown + "\n".join(r.getMessage() for r in caplog.records)
    assert "Zq7SECRET" not in text
    assert caplog.records  # (the warning was written: there was something to hide)
