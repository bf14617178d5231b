"""``polygate chat``: one call through the user's configuration — in-process on the
fake transport, and end to end through ``main()`` against a FakeUpstream server in
its own process, configured by environment keys."""

from __future__ import annotations

import functools
import io
import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.cli import main
from polygate.cli._chat import chat_once
from polygate.testing import FakeUpstream, Reply, Router

from ._raw_server import raw_server
from .conftest import SECRET, two_source_settings


async def test_chat_once_prints_the_answer(autojump_clock: trio.testing.MockClock) -> None:
    out = io.StringIO()
    up = FakeUpstream(Reply(text="hello from the fake"))
    response = await chat_once(
        two_source_settings(names=("a",)), [{"role": "user", "content": "hi"}], "chat", False, out,
        transport=Router({"a": up}),
    )
    assert out.getvalue() == "hello from the fake\n"
    assert response.text == "hello from the fake"


async def test_chat_once_streams(autojump_clock: trio.testing.MockClock) -> None:
    class Recorder(io.StringIO):
        writes: list[str]

        def write(self, s: str) -> int:
            self.writes.append(s)
            return super().write(s)

    out = Recorder()
    out.writes = []
    up = FakeUpstream(Reply(text="one two three", inter_token_s=0.1))
    response = await chat_once(
        two_source_settings(names=("a",)), [{"role": "user", "content": "hi"}], "chat", True, out,
        transport=Router({"a": up}),
    )
    assert out.getvalue() == "one two three\n"
    assert len(out.writes) >= 4  # chunk by chunk, then the newline
    assert response.call_stats.ttft_ms is not None


# --------------------------------------------------------------------------- main()


@pytest.fixture
def server() -> Iterator[str]:
    """A FakeUpstream in its own process (main() runs its own trio loop)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "polygate.testing.serve", "--port", "0",
         "--reply", json.dumps({"text": "pong from the server", "inter_token_s": 0.01})],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        yield line.removeprefix("listening on ")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No polygate.toml, no POLYGATE_CONFIG, no stray POLYGATE__ keys."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("POLYGATE_CONFIG", raising=False)
    import os

    for key in list(os.environ):
        if key.startswith("POLYGATE__"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_main_one_call_with_stats_and_telemetry(
    server: str, env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env.setenv("POLYGATE__CHAT__A__BASE_URL", server)
    env.setenv("POLYGATE__CHAT__A__API_KEY", SECRET)
    env.setenv("POLYGATE__TELEMETRY", f"sqlite://{tmp_path}/t.db")
    assert main(["chat", "ping", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "pong from the server\n"
    assert "source a, model" in captured.err and "1 attempt(s), 0 hedge(s)" in captured.err
    assert "time to first token" in captured.err and "tokens:" in captured.err
    assert SECRET not in captured.out + captured.err
    conn = sqlite3.connect(tmp_path / "t.db")
    assert conn.execute("SELECT outcome, source FROM calls").fetchall() == [("ok", "a")]
    conn.close()


def test_main_streams_and_reads_stdin(
    server: str, env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    env.setenv("POLYGATE__CHAT__A__BASE_URL", server)
    monkeypatch.setattr(sys, "stdin", io.StringIO("a prompt from a pipe"))
    assert main(["chat", "-", "--stream", "--system", "be brief"]) == 0
    assert capsys.readouterr().out == "pong from the server\n"


def test_main_failed_call(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    env.setenv("POLYGATE__CHAT__A__BASE_URL", f"http://127.0.0.1:{port}/v1")
    env.setenv("POLYGATE__CHAT__RETRY__MAX_ATTEMPTS", "1")
    assert main(["chat", "ping", "--stats"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("polygate chat: the call failed: AllSourcesExhausted")
    assert "attempt(s)" in err  # the statistics of the failed call


@pytest.mark.parametrize(
    ("argv", "keys", "message"),
    [
        (["chat", "hi"], {}, "invalid configuration"),
        (["chat", "hi", "--scope", "embed"], {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1"},
         "unknown scope 'embed'"),
        (["chat", "   "], {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1"}, "the prompt is empty"),
        (["chat", "hi"], {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
                          "POLYGATE__TELEMETRY": "sqlite:///proc/no/such/dir/t.db"},
         "telemetry database"),
    ],
)
def test_main_bad_configuration(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str], keys: dict[str, str], message: str,
) -> None:
    for key, value in keys.items():
        env.setenv(key, value)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


class _Bytes(io.TextIOWrapper):
    """A standard input whose bytes are given (``buffer``), as a pipe's are."""


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        (None, "no standard input"),  # closed: a service, a cron job, `<&-`
        (_Bytes(io.BytesIO(b"hello \xff there"), encoding="utf-8"), "not valid utf-8 text"),
    ],
)
def test_a_prompt_from_stdin_that_cannot_be_read_is_one_line(
    env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    stdin: object, message: str,
) -> None:
    """Outside review (2026-12-02): ``polygate chat -`` raised a bare AttributeError
    with no standard input, and UnicodeDecodeError on bytes that are not UTF-8."""
    env.setenv("POLYGATE__CHAT__A__BASE_URL", "http://a/v1")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", "-"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and "Traceback" not in captured.err


def test_a_prompt_argument_that_is_not_utf8_is_said_so(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An argument in bytes that are not UTF-8 (surrogate escapes) was refused as
    "invalid configuration: messages[0] ..." at a position inside the JSON."""
    env.setenv("POLYGATE__CHAT__A__BASE_URL", "http://a/v1")
    assert main(["chat", "caf\udce9"]) == 2
    err = capsys.readouterr().err
    assert "the prompt is not UTF-8" in err and "configuration" not in err


_C_LOCALE = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def _without_polygate_keys(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATE")}
    return {**env, **_C_LOCALE, **extra}


def test_utf8_arguments_and_keys_under_a_locale_that_is_not_utf8(
    server: str, tmp_path: Path
) -> None:
    """Review: under ``LC_ALL=C`` with Python's UTF-8 mode off, arguments and the
    environment arrive as ASCII with surrogate escapes: ``polygate chat é`` was
    refused as "not UTF-8", and a key ``…__MODEL=modèle`` as "a byte that is not
    UTF-8", though their bytes are UTF-8."""
    env = _without_polygate_keys(POLYGATE__CHAT__A__BASE_URL=server,
                                 POLYGATE__CHAT__A__MODEL="modèle")
    done = subprocess.run([sys.executable, "-m", "polygate", "chat", "é", "--system", "ü"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "pong from the server\n"), done.stderr
    done = subprocess.run([sys.executable, "-m", "polygate", "check-config"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "mod\\xe8le" in done.stdout  # (an ASCII stdout shows it escaped)


def test_an_argument_whose_bytes_are_not_utf8_is_still_refused_under_that_locale(
    tmp_path: Path,
) -> None:
    env = _without_polygate_keys(POLYGATE__CHAT__A__BASE_URL="http://127.0.0.1:9/v1")
    done = subprocess.run([sys.executable.encode(), b"-m", b"polygate", b"chat", b"caf\xe9"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "polygate chat: the prompt is not UTF-8 text"


async def test_a_stream_that_fails_midway_ends_its_line(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The error's line starts on a line of its own, not after the half answer."""
    out = io.StringIO()
    up = FakeUpstream(Reply(text="one two three", inter_token_s=0.1, fault="truncated",
                            fault_after=2))
    with pytest.raises(polygate.PolygateError):
        await chat_once(
            two_source_settings(names=("a",)), [{"role": "user", "content": "hi"}], "chat",
            True, out, transport=Router({"a": up}),
        )
    assert out.getvalue() and out.getvalue().endswith("\n")


def test_a_prompt_from_stdin_is_read_as_the_stream_decodes_it(
    env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: read as the text stream decodes it (its encoding, its newline
    translation), not as UTF-8 bytes: a cp1252 pipe on Windows is text too."""
    env.setenv("POLYGATE__CHAT__A__BASE_URL", "http://a/v1")
    seen: list[str] = []

    def run_chat(fn: object, settings: object, messages: list[dict[str, str]], *rest: object) -> object:
        seen.append(messages[-1]["content"])
        raise KeyboardInterrupt  # (enough: the prompt was read)

    monkeypatch.setattr("trio.run", run_chat)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\r\nok"),
                                                       encoding="cp1252", newline=None))
    assert main(["chat", "-"]) == 130
    assert seen == ["café\nok"]
    closed = io.StringIO("x")
    closed.close()
    monkeypatch.setattr(sys, "stdin", closed)
    assert main(["chat", "-"]) == 2
    assert "standard input is closed" in capsys.readouterr().err


async def test_ctrl_c_mid_stream_ends_the_answers_line(autojump_clock: trio.testing.MockClock) -> None:
    """Review: Ctrl-C mid-stream printed "\\npolygate chat: interrupted" on stderr (a
    blank line there, and the answer's line left open on stdout, when it went to a
    file).  The answer's line is ended on stdout; the message is one line."""

    class Interrupting(io.StringIO):
        def write(self, text: str) -> int:
            if self.getvalue() and text != "\n":
                raise KeyboardInterrupt  # Ctrl-C, as trio delivers it: in the main task
            return super().write(text)

    up = FakeUpstream(Reply(text="one two three", inter_token_s=0.1))
    out = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        await chat_once(
            two_source_settings(names=("a",)), [{"role": "user", "content": "hi"}], "chat",
            True, out, transport=Router({"a": up}),
        )
    assert out.getvalue() == "one\n"


def test_the_interrupt_message_is_one_line(
    env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    env.setenv("POLYGATE__CHAT__A__BASE_URL", "http://a/v1")

    def interrupted(*args: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr("trio.run", interrupted)
    assert main(["chat", "hi"]) == 130
    assert capsys.readouterr().err == "polygate chat: interrupted\n"


_EVIL = "\\u001b]0;pwned\\u0007\\u001b[2J\\u001b[31mFAKE\\r\\npolygate chat: all good"


def _answers(status: int, body: bytes) -> Any:
    async def reply(stream: trio.SocketStream, head: bytes) -> None:
        await stream.send_all(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(body), body))
    return reply


@pytest.mark.parametrize(("status", "body", "argv"), [
    (400, '{"error":{"message":"' + _EVIL + '","type":"invalid_request_error"}}', []),
    (200, '{"id":"x","object":"chat.completion","model":"' + _EVIL + '","choices":[{"index":0,'
          '"message":{"role":"assistant","content":"fine"},"finish_reason":"stop"}]}', ["--stats"]),
])
async def test_an_upstreams_words_reach_the_terminal_escaped(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], status: int, body: str,
    argv: list[str],
) -> None:
    """An outside review (2026-12-05): the upstream's error message, and with
    ``--stats`` the model it names, were printed raw: an escape sequence in them set
    the terminal's title, cleared it, and a line break forged a line of ours."""
    async with raw_server(_answers(status, body.encode())) as server:
        env.setenv("POLYGATE__CHAT__A__BASE_URL", server.url)
        env.setenv("POLYGATE__CHAT__A__STREAMING", "false")
        env.setenv("POLYGATE__CHAT__RETRY__MAX_ATTEMPTS", "1")
        code = await trio.to_thread.run_sync(functools.partial(main, ["chat", *argv, "hi"]))
    err = capsys.readouterr().err
    assert code == (1 if status == 400 else 0)
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err
    assert "pwned" in err and "\\x1b" in err  # shown, escaped
    assert "\npolygate chat: all good" not in err


def test_a_utf8_prompt_on_stdin_is_read_under_a_locale_that_is_not_utf8(
    server: str, tmp_path: Path,
) -> None:
    """Review: ``polygate chat é`` worked under ``LC_ALL=C`` with UTF-8 mode off;
    ``echo é | polygate chat -`` was refused as "not UTF-8": standard input under that
    locale keeps the bytes as surrogate escapes, which the argument's path turns back."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATE")}
    env.update(LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0",
               POLYGATE__CHAT__A__BASE_URL=server)
    for argv, stdin in ((["é"], b""), (["-"], "é\n".encode())):
        done = subprocess.run([sys.executable, "-m", "polygate", "chat", *argv], env=env,
                              input=stdin, capture_output=True, timeout=120, cwd=tmp_path)
        assert (done.returncode, done.stdout) == (0, b"pong from the server\n"), (argv, done.stderr)
