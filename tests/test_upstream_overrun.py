"""An upstream that sends more than its Content-Length said (a proxy that counts a
non-ASCII answer's characters, not its bytes): the rest of one caller's answer must
never reach another caller (an outside review, "framing differentials").

The next request on the connection reads those bytes as its status line, and h11's
error quoted them ("illegal status line: bytearray(b'...')"): through ``polygate
serve`` another tenant's 502 showed the first tenant's answer."""

from __future__ import annotations

import json

import pytest
import trio

import polygate

from ._raw_server import Reply as RawReply
from ._raw_server import raw_server
from ._serve_kit import AUTH, CHAT, http, one_source, raw_gateway

SECRET = "SECRET-OF-TENANT-A-the-rest-of-its-answer"


def _overrunning_answer() -> tuple[bytes, bytes]:
    """An answer whose Content-Length covers its JSON, and the bytes it sends past it
    (the rest of a text, as a proxy that counted characters would leave over)."""
    document = json.dumps({
        "id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "\u00e9" * 40},
                     "finish_reason": "stop"}],
    }, ensure_ascii=False).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(document)
    return head + document, f" \u00e9 {SECRET}\r\n\r\n".encode()


def _late_overrun() -> RawReply:
    """Answers the first request short, and sends its rest when the next request on
    the connection comes (late: after the answer was read and pooled)."""
    answer, rest = _overrunning_answer()
    served = [0]

    async def reply(stream: trio.SocketStream, _head: bytes) -> None:
        served[0] += 1
        await stream.send_all(answer if served[0] == 1 else rest)

    return reply


ONCE = polygate.Retry(max_attempts=1)


async def test_the_next_caller_never_reads_the_rest_of_an_answer() -> None:
    async with raw_server(_late_overrun()) as upstream, polygate.session(one_source(upstream.url, retry=ONCE)) as s:
        first = await s.chat([{"role": "user", "content": "A"}])
        assert first.text == "\u00e9" * 40
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.chat([{"role": "user", "content": "B"}])
    said = repr(caught.value) + str(caught.value) + "".join(str(e) for e in caught.value.errors)
    assert "illegal status line" in said
    assert "its-answer" not in said and "xc3" not in said


async def test_through_the_gateway_another_tenants_502_holds_none_of_it() -> None:
    async with raw_gateway(_late_overrun(), retry=ONCE) as (server, _):
        first = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        second = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
    assert first.status == 200
    assert second.status == 502
    assert b"its-answer" not in second.body and b"xc3" not in second.body
