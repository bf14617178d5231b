"""Fields RFC 9110 asks of an origin server's answers: a Date on each, a challenge on a
401; and a transfer coding it does not take.  Outside review of HTTP at both ends,
2026-12-05."""

from __future__ import annotations

import email.utils

import pytest
import trio

from tests._serve_kit import AUTH, CHAT, gateway, http


async def _raw(port: int, data: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    out = b""
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(10):
            while True:
                piece = await stream.receive_some(65536)
                if not piece:
                    return out
                out += piece


@pytest.mark.parametrize("case", ["chat", "models", "healthz", "404", "401"])
async def test_every_2xx_and_4xx_answer_carries_a_date(case: str) -> None:
    """RFC 9110 §6.6.1: an origin server with a clock MUST generate a Date header
    field in all 2xx, 3xx and 4xx responses (uvicorn, hypercorn, nginx all do)."""
    headers = {**AUTH, "content-type": "application/json"}
    async with gateway() as (server, _):
        answer = await {
            "chat": lambda: http(server, "POST", "/v1/chat/completions", CHAT, headers),
            "models": lambda: http(server, "GET", "/v1/models", None, headers),
            "healthz": lambda: http(server, "GET", "/healthz"),
            "404": lambda: http(server, "GET", "/nowhere", None, headers),
            "401": lambda: http(server, "GET", "/v1/models"),
        }[case]()
    assert 200 <= answer.status < 500
    assert "date" in answer.headers, sorted(answer.headers)
    assert email.utils.parsedate_to_datetime(answer.headers["date"]) is not None


async def test_a_401_carries_a_bearer_challenge() -> None:
    """RFC 9110 §11.6.1 / §15.5.2: a 401 MUST carry WWW-Authenticate with at least one
    challenge; RFC 6750 §3 says which one for a bearer token."""
    async with gateway() as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions", CHAT,
                            {"content-type": "application/json"})
    assert answer.status == 401
    assert answer.headers.get("www-authenticate") == "Bearer", answer.headers
    # Refused while its head is read (a key checked before the body) and at routing.
    async with gateway() as (server, _):
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                                   ("POST", "/v1/embeddings", CHAT)):
            answer = await http(server, method, path, body, {"authorization": "Bearer wrong"})
            assert answer.status == 401, (path, answer.status)
            assert answer.headers.get("www-authenticate") == "Bearer", (path, answer.headers)


@pytest.mark.parametrize("coding", [
    b"transfer-encoding: gzip, chunked\r\n",     # (RFC 9112: 501 SHOULD; h11 will not say which)
    b"transfer-encoding: chunked, gzip\r\n",     # chunked not last: 400 MUST (§6.3)
    b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n",  # chunked twice: 400
    b"transfer-encoding: gzip\r\n",              # no chunked at all: 400 MUST
])
async def test_a_transfer_coding_other_than_chunked_is_a_400(coding: bytes) -> None:
    """h11 hints 501 for every one of these; RFC 9112 §6.3 asks a 400 (and a close) for
    all but the first, and the hint does not say which it saw, so each is a 400 (a
    first repair answered all four 501: a review of it, 2026-12-05)."""
    async with gateway() as (server, _):
        data = await _raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\n"
                                       + coding + b"\r\n0\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n"), data[:60]
    assert b"connection: close" in data, data
