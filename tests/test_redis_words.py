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
