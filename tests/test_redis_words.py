"""A Redis server's own words (its error replies) in polygate's errors and log lines:
escaped, so that nothing in them forges a log line or acts on a terminal.

Review (what reaches the logs): a reply ``-ERR boom\\rpolygate serve: error: FORGED``
went into ``GovernanceBackendError`` and the cache's warning as it was, and under a
plain ``logging.basicConfig`` the CR overwrote the real line with the forged one.  A
hostile Redis answers here: HELLO properly, every other command with that reply."""

from __future__ import annotations

import functools
import logging

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
    out = []
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
    return f"-ERR unknown command 'HELLO', with args beginning with: {quoted}\r\n".encode()


async def _no_hello(stream: trio.SocketStream) -> None:
    buf = b""
    with trio.move_on_after(30):
        async for data in stream:
            buf += data
            commands, buf = _commands(buf)
            for args in commands:
                await stream.send_all(_unknown_hello(args) if args[0].upper() == b"HELLO"
                                      else b"-NOAUTH Authentication required.\r\n")


async def _hostile(stream: trio.SocketStream) -> None:
    reply = b"-ERR " + FORGED.encode() + b"\r\n"
    buf = b""
    with trio.move_on_after(30):
        async for data in stream:
            buf += data
            commands, buf = _commands(buf)
            for args in commands:
                await stream.send_all(_HELLO if args[0].upper() == b"HELLO" else reply)


def _clean(text: str) -> None:
    assert text.isprintable(), repr(text)
    assert "\\r" in text and "\\x1b" in text  # (said, escaped: not dropped)


@pytest.mark.parametrize("where", ["governance", "cache"])
async def test_a_redis_error_reply_is_escaped_in_errors_and_logs(
    where: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="polygate")
    up = FakeUpstream(Reply(text="answered"))
    async with trio.open_nursery() as nursery, up.serve() as url:
        [listener] = await nursery.start(functools.partial(trio.serve_tcp, _hostile, 0, host="127.0.0.1"))
        redis = f"redis://127.0.0.1:{listener.socket.getsockname()[1]}/0"
        scope = polygate.Scope(sources=[polygate.Source(name="a", base_url=url, model="m")],
                               cache_ttl_s=60 if where == "cache" else None)
        settings = polygate.Settings(
            scopes={"chat": scope}, telemetry="off",
            **({"backend": redis} if where == "governance" else {"cache": redis}))
        with trio.fail_after(20):
            if where == "governance":  # (its opening loads the scripts: refused)
                with pytest.raises(polygate.GovernanceBackendError) as caught:
                    async with polygate.session(settings) as s:
                        await s.chat(MSG, call_deadline_s=10)
                _clean(str(caught.value))
            else:
                async with polygate.session(settings) as s:
                    assert (await s.chat(MSG, call_deadline_s=10)).text == "answered"  # fails open
        nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records if "boom" in r.getMessage()]
    if where == "cache":
        assert said, [r.getMessage() for r in caplog.records]
    for message in said:
        _clean(message)


@pytest.mark.parametrize("password", [
    "Zq7x" + "abcdefghij" * 12 + "K9mPw",  # (129 characters: quoted cut short)
    "pa\tss\nword-0123456789",  # (its line break quoted as a space)
])
@pytest.mark.parametrize("where", ["governance", "cache"])
async def test_a_password_the_server_quotes_cut_or_altered_is_masked(
    where: str, password: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Review: a Redis without HELLO quotes the client's ``HELLO 3 AUTH user
    password`` in its refusal, cut at 128 characters and with CR/LF made spaces;
    polygate masked only the password's exact copy, and the first 109 characters of
    a long one were in the warning, readable."""
    from urllib.parse import quote

    caplog.set_level(logging.INFO, logger="polygate")
    up = FakeUpstream(Reply(text="answered"))
    texts: list[str] = []
    async with trio.open_nursery() as nursery, up.serve() as url:
        [listener] = await nursery.start(functools.partial(trio.serve_tcp, _no_hello, 0, host="127.0.0.1"))
        redis = f"redis://:{quote(password, safe='')}@127.0.0.1:{listener.socket.getsockname()[1]}/0"
        scope = polygate.Scope(sources=[polygate.Source(name="a", base_url=url, model="m")],
                               cache_ttl_s=60 if where == "cache" else None)
        settings = polygate.Settings(
            scopes={"chat": scope}, telemetry="off",
            **({"backend": redis} if where == "governance" else {"cache": redis}))
        with trio.fail_after(20):
            if where == "governance":
                with pytest.raises(polygate.GovernanceBackendError) as caught:
                    async with polygate.session(settings) as s:
                        await s.chat(MSG, call_deadline_s=10)
                texts.append(str(caught.value))
            else:
                async with polygate.session(settings) as s:
                    assert (await s.chat(MSG, call_deadline_s=10)).text == "answered"
        nursery.cancel_scope.cancel()
    texts += [r.getMessage() for r in caplog.records]
    assert any("HELLO" in text for text in texts), texts  # (the refusal was said)
    spaced = password.replace("\n", " ")
    for text in texts:
        for form in (password, spaced, printable(password), printable(spaced)):
            assert form[:6] not in text, text  # (not even its start, raw or escaped)
