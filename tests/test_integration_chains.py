"""Structured output and OCR against real loopback servers (real clock, real sockets):
the re-ask rounds and the page requests go over HTTP as they would to a real upstream."""

from __future__ import annotations

import base64
import io
from typing import Any

import pydantic
import pytest
import trio
from PIL import Image

import polygate
from polygate.testing import FakeUpstream, RecordedRequest, Reply

from .conftest import MESSAGES
from .test_integration import serving
from .test_ocr import make_pdf

pytestmark = pytest.mark.integration


class Answer(pydantic.BaseModel):
    city: str
    population: int


async def test_structured_reask_over_real_sockets() -> None:
    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        reasked = any(m["role"] == "assistant" for m in rec.body["messages"])
        text = '{"city": "Paris", "population": 2100000}' if reasked else "Paris!"
        return Reply(text=text, first_token_s=0.01, inter_token_s=0.001)

    up = FakeUpstream(behaviour)
    async with serving(a=up) as urls:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url=urls["a"], structured_output="json_object")])})
        async with polygate.session(settings) as s:
            r = await s.chat(MESSAGES, schema=Answer)
            async with s.stream_chat(MESSAGES, schema=Answer) as stream:
                with pytest.raises(polygate.StructuredOutputError):
                    async for _ in stream:
                        pass
    assert r.parsed == Answer(city="Paris", population=2100000)
    assert r.call_stats.reasks == 1 and r.call_stats.attempts == 2
    assert r.call_stats.generation_ms < r.call_stats.total_latency_ms
    assert up.requests[0].body["response_format"] == {"type": "json_object"}
    assert len(up.requests) == 3 and up.in_flight == 0


async def test_ocr_of_a_pdf_over_real_sockets() -> None:
    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        url = rec.body["messages"][0]["content"][1]["image_url"]["url"]
        with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
            return Reply(text=f"page {image.size[0]}", first_token_s=0.02)

    up = FakeUpstream(behaviour)
    pdf = make_pdf([(100 + 10 * i, 100) for i in range(6)])
    async with serving(a=up, b=up) as urls:
        settings = polygate.Settings(scopes={"ocr": polygate.Scope(
            sources=[polygate.Source(name=n, base_url=u) for n, u in urls.items()],
            ocr=polygate.Ocr(dpi=72, max_concurrent_pages=3),
        )})
        async with polygate.session(settings) as s:
            r = await s.ocr(pdf)
    assert [p.text for p in r.pages] == [f"page {100 + 10 * i}" for i in range(6)]
    assert {p.source for p in r.pages} <= {"a", "b"}
    assert r.call_stats.attempts == 6
    assert r.call_stats.generation_ms >= 6 * 20 * 0.9
    assert up.statistics().peak_in_flight <= 3 and up.in_flight == 0
    for q in up.requests:
        [message] = q.body["messages"]
        assert [part["type"] for part in message["content"]] == ["text", "image_url"]


async def test_ocr_pages_overlap_up_to_the_bound() -> None:
    up = FakeUpstream(Reply(text="x", first_token_s=0.3))
    pdf = make_pdf([(100, 100)] * 7)
    async with serving(a=up) as urls:
        settings = polygate.Settings(scopes={"ocr": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=urls["a"])],
            ocr=polygate.Ocr(max_concurrent_pages=3),
        )})
        async with polygate.session(settings) as s:
            start = trio.current_time()
            r = await s.ocr(pdf)
            elapsed = trio.current_time() - start
    assert len(r.pages) == 7
    assert up.statistics().peak_in_flight == 3  # rendering a blank page takes ms, not 0.3 s
    assert 0.9 <= elapsed < 2.0  # three waves of at most 3; one at a time would take 2.1 s
