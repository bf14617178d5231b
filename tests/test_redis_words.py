"""A Redis server's own words (its error replies) in polygate's errors and log lines:
escaped, so that nothing in them forges a log line or acts on a terminal.

Review (what reaches the logs): a reply ``-ERR boom\\rpolygate serve: error: FORGED``
went into ``GovernanceBackendError`` and the cache's warning as it was, and under a
plain ``logging.basicConfig`` the CR overwrote the real line with the forged one.  A
hostile Redis answers here: HELLO properly, every other command with that reply."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

import pytest
import trio

import polygate
from polygate._secrets import printable
from polygate.testing import FakeUpstream, Reply

pytest.importorskip("coredis")

MSG = [{"role": "user", "content": "hi"}]
FORGED = "boom\rpolygate serve: error: FORGED \x1b[31mRED\x1b[0m \u202e evil"
_HELLO = b"%4\r\n+server\r\n+redis\r\n+version\r\n+7.0.0\r\n+proto\r\n:3\r\n+id\r\n:7\r\n"


def _commands(buf: bytes) -> tuple[list[list[bytes]], bytes]:
    """The whole RESP arrays at the front of ``buf``, and what is left."""
    out: list[list[bytes]] = []
    while buf.startswith(b"*"):
        rest = buf
        try:
            head, rest = rest.split(b"\r\n", 1)
            args = []
            for _ in range(int(head[1:])):
                size, rest = rest.split(b"\r\n", 1)
                length = int(size[1:])
                if len(rest) < length + 2:
                    return out, buf
                args.append(rest[:length])
                rest = rest[length + 2:]
        except ValueError:
            return out, buf
        out.append(args)
        buf = rest
    return out, buf


_UNKNOWN = "unknown command 'HELLO', with args beginning with:"


def _unknown_hello(args: list[bytes]) -> bytes:
    """What a Redis without HELLO (before 6; a proxy; ``rename-command HELLO ""``)
    answers: its arguments quoted, cut at 128 characters, CR and LF made spaces
    (Redis's ``processCommand``)."""
    quoted = ""
    for arg in args[1:]:
        if len(quoted) >= 128:
            break
        quoted += "'" + arg.decode("utf-8", "replace")[:128 - len(quoted)] + "' "
    quoted = quoted.replace("\r", " ").replace("\n", " ")
    return f"-ERR {_UNKNOWN} {quoted}\r\n".encode()


def _answering(reply: Callable[[list[bytes]], bytes]) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A 'Redis' that answers each command with ``reply(command)``."""

    async def serve(stream: trio.SocketStream) -> None:
        buf = b""
        with trio.move_on_after(30):
            async for data in stream:
                buf += data
                commands, buf = _commands(buf)
                for args in commands:
                    await stream.send_all(reply(args))

    return serve


#: Without HELLO: its refusal quotes the password; then every command needs AUTH.
_no_hello = _answering(lambda args: _unknown_hello(args) if args[0].upper() == b"HELLO"
                       else b"-NOAUTH Authentication required.\r\n")
#: HELLO answered; every other command refused with the forged words.
_hostile = _answering(lambda args: _HELLO if args[0].upper() == b"HELLO"
                      else b"-ERR " + FORGED.encode() + b"\r\n")


def _clean(text: str) -> None:
    assert text.isprintable(), repr(text)
    assert "\\r" in text and "\\x1b" in text  # (said, escaped: not dropped)


async def _said_against(redis_server: Callable[[trio.SocketStream], Awaitable[None]], where: str,
                        password: str | None = None, user: str = "") -> list[str]:
    """A session on a Redis served by ``redis_server`` (governance or cache), one call:
    governance's error (its opening is refused) and every log line, as said."""
    from urllib.parse import quote

    up = FakeUpstream(Reply(text="answered"))
    texts: list[str] = []
    async with trio.open_nursery() as nursery, up.serve() as url:
        [listener] = await nursery.start(functools.partial(trio.serve_tcp, redis_server, 0, host="127.0.0.1"))
        auth = "" if password is None else f"{user}:{quote(password, safe='')}@"
        redis = f"redis://{auth}127.0.0.1:{listener.socket.getsockname()[1]}/0"
        scope = polygate.Scope(sources=[polygate.Source(name="a", base_url=url, model="m")],
                               cache_ttl_s=60 if where == "cache" else None)
        settings = (polygate.Settings(scopes={"chat": scope}, telemetry="off", backend=redis)
                    if where == "governance" else
                    polygate.Settings(scopes={"chat": scope}, telemetry="off", cache=redis))
        with trio.fail_after(20):
            if where == "governance":  # (its opening loads the scripts: refused)
                with pytest.raises(polygate.GovernanceBackendError) as caught:
                    async with polygate.session(settings) as s:
                        await s.chat(MSG, call_deadline_s=10)
                texts.append(str(caught.value))
            else:
                async with polygate.session(settings) as s:
                    assert (await s.chat(MSG, call_deadline_s=10)).text == "answered"  # fails open
        nursery.cancel_scope.cancel()
    return texts


@pytest.mark.parametrize("where", ["governance", "cache"])
async def test_a_redis_error_reply_is_escaped_in_errors_and_logs(
    where: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="polygate")
    texts = await _said_against(_hostile, where)
    said = texts + [r.getMessage() for r in caplog.records if "boom" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]  # (governance: its error)
    for message in said:
        _clean(message)


@pytest.mark.parametrize(("user", "password"), [
    ("", "Zq7x" + "abcdefghij" * 12 + "K9mPw"),  # (129 characters: quoted cut short)
    ("", "pa\tss\nword-0123456789"),  # (its line break quoted as a space)
    ("u" * 109, "Pw9zXq1234"),  # (a long user name: 5 characters of it quoted)
    ("", "unknown-cmd-77"),  # (begins like the server's own words)
])
@pytest.mark.parametrize("where", ["governance", "cache"])
async def test_a_password_the_server_quotes_cut_or_altered_is_masked(
    where: str, user: str, password: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Review: a Redis without HELLO quotes the client's ``HELLO 3 AUTH user
    password`` in its refusal, cut at 128 characters and with CR/LF made spaces;
    polygate masked only the password's exact copy, and the first 109 characters of
    a long one were in the warning, readable.  A second review: after a long user name
    Redis quoted 5 characters of it, under the 6 a mask of its starts needed; and that
    mask, on a password that begins like the server's own words ("unknown…"), showed
    where it did ("*** command 'HELLO'").  The arguments are not shown at all."""
    caplog.set_level(logging.INFO, logger="polygate")
    texts = await _said_against(_no_hello, where, password, user)
    texts += [r.getMessage() for r in caplog.records]
    assert any("HELLO" in text for text in texts), texts  # (the refusal was said)
    spaced = password.replace("\n", " ")
    for text in texts:
        assert "***" not in text, text  # (nothing left to mask: no mask shows a start)
        for form in (password, spaced, printable(password), printable(spaced)):
            if form[:5] not in _UNKNOWN:  # (the server's own words are its own)
                assert form[:5] not in text, text  # (not even its start, raw or escaped)
