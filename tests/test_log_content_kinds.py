"""``log_content`` stores a chat call's content, and only a chat call's: an ``embed``
or ``ocr`` call's row never holds its inputs, so an upstream error text that quotes
them is scrubbed with ``log_content`` on as with it off (docs/telemetry.md).  Review:
``log_content=True`` turned the scrubbing off for every kind of call, and an OCR
call's signed document URL and its prompt, quoted by a 400, were stored whole."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import attrs
import pytest
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

from .test_ocr import ocr_settings

URL = "https://bucket.example.com/scan.png?X-Amz-Signature=deadbeefcafef00d1234"
PROMPT = "Transcribe the secret payroll of ACME Corp"
INPUT = "the confidential merger memo of ACME Corp"


def _refusal(*quoted: str) -> Reply:
    body = {"error": {"message": "Invalid input " + " and ".join(f"'{q}'" for q in quoted),
                      "type": "invalid_request_error"}}
    return Reply(status=400, error_body=body)


def _stored(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT error_message FROM attempts").fetchall()
        rows += conn.execute("SELECT error_message, content FROM calls").fetchall()
    finally:
        conn.close()
    return repr(rows)


@pytest.mark.parametrize("log_content", [False, True])
async def test_an_ocr_calls_prompt_and_url_are_never_stored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, log_content: bool
) -> None:
    db = tmp_path / "t.db"
    settings = attrs.evolve(ocr_settings(), telemetry=f"sqlite://{db}", log_content=log_content)
    up = FakeUpstream(_refusal(URL, PROMPT))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.ocr(URL, prompt=PROMPT)
    stored = _stored(db)
    assert "[prompt text]" in stored
    assert "deadbeefcafef00d" not in stored and "payroll" not in stored


@pytest.mark.parametrize("log_content", [False, True])
async def test_an_embed_calls_inputs_are_never_stored(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, log_content: bool
) -> None:
    db = tmp_path / "t.db"
    source = polygate.Source(name="a", base_url="http://a/v1")
    settings = polygate.Settings(scopes={"embed": polygate.Scope(sources=[source])},
                                 telemetry=f"sqlite://{db}", log_content=log_content)
    up = FakeUpstream(_refusal(INPUT))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.embed([INPUT])
    stored = _stored(db)
    assert "[prompt text]" in stored and "merger" not in stored


async def test_a_chat_calls_content_is_stored_with_log_content(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The control: a chat call's row holds its messages with ``log_content``, so its
    error text is stored as the upstream wrote it."""
    db = tmp_path / "t.db"
    source = polygate.Source(name="a", base_url="http://a/v1")
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[source])},
                                 telemetry=f"sqlite://{db}", log_content=True)
    up = FakeUpstream(_refusal(INPUT))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError):
            await s.chat([{"role": "user", "content": INPUT}])
    stored = _stored(db)
    assert "[prompt text]" not in stored
    assert stored.count("merger") == 3  # the attempt's error text, the call's, its messages
