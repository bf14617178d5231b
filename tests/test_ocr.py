"""OCR (SPEC §8.2) through the fake transport under MockClock, with real documents:
PDFs made by pypdfium2 (and one written by hand) rendered by PDFium, images made by
Pillow.  The fake upstream decodes each page image it receives and answers with its
size, so the tests see what was sent, and in which order it came back."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pypdfium2 as pdfium
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

import polygate
from polygate import _ocr_document, _ocr_render, _ocr_renderers
from polygate._ocr import DEFAULT_PROMPT
from polygate.testing import FakeUpstream, RecordedRequest, Reply, Router

from .conftest import FIRST_A


def make_pdf(sizes: list[tuple[float, float]]) -> bytes:
    """A PDF whose page i has size ``sizes[i]`` in points (blank pages: the fake tells
    pages apart by their rendered size)."""
    pdf = pdfium.PdfDocument.new()
    try:
        for width, height in sizes:
            pdf.new_page(width, height).close()
        out = io.BytesIO()
        pdf.save(out)
        return out.getvalue()
    finally:
        pdf.close()


def _query(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` in the telemetry database ``db``."""
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _pdf_of(objects: list[bytes]) -> bytes:
    """A PDF file of ``objects`` (numbered from 1; the first is the catalog)."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def minimal_pdf() -> bytes:
    """A one-page PDF written by hand (catalog, pages, page, content, font), 200×100 pt."""
    content = b"BT /F1 24 Tf 20 40 Td (Hello OCR) Tj ET"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    return _pdf_of(objects)


def encrypted_pdf() -> bytes:
    """:func:`minimal_pdf` with a standard security handler whose keys no password
    matches: PDFium refuses it ("Incorrect password error")."""
    plain = minimal_pdf()
    body = plain[:plain.index(b"xref")] + (
        b"6 0 obj\n<< /Filter /Standard /V 1 /R 2 /Length 40 /P -4 /O <" + b"00" * 32
        + b"> /U <" + b"11" * 32 + b"> >>\nendobj\n"
    )
    offsets = [body.index(b"%d 0 obj" % n) for n in range(1, 7)]
    return body + (
        b"xref\n0 7\n0000000000 65535 f \n" + b"".join(b"%010d 00000 n \n" % o for o in offsets)
        + b"trailer\n<< /Size 7 /Root 1 0 R /Encrypt 6 0 R /ID [<%s> <%s>] >>\nstartxref\n%d\n%%%%EOF\n"
        % (b"ab" * 16, b"ab" * 16, len(body))
    )


def image_bytes(fmt: str, size: tuple[int, int], mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, "white" if mode != "P" else 0).save(out, fmt)
    return out.getvalue()


def sent_image(req: RecordedRequest) -> tuple[str, bytes]:
    """The mime type and bytes of the page image a request carried."""
    url = req.body["messages"][0]["content"][1]["image_url"]["url"]
    head, data = url.split(",", 1)
    assert head.startswith("data:") and head.endswith(";base64")
    return head[5:-7], base64.b64decode(data)


def size_reply(rec: RecordedRequest, rng: Any, **kw: Any) -> Reply:
    """Answer with the size of the image received; the page of width 100 + 50 i
    (points at 72 dpi) takes i + 1 seconds."""
    _, data = sent_image(rec)
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    delay = (width - 100) / 50 + 1
    return Reply(text=f"{width}x{height}", first_token_s=delay, **kw)


def ocr_settings(sources: tuple[str, ...] = ("a",), **ocr: Any) -> polygate.Settings:
    scope = polygate.Scope(
        sources=[polygate.Source(name=n, base_url=f"http://{n}/v1",
                                 weight=FIRST_A.get(n, 1.0)) for n in sources],
        ocr=polygate.Ocr(**ocr),
    )
    return polygate.Settings(scopes={"ocr": scope})


@pytest.mark.parametrize("blank", ["", "   ", "\n\t"])
def test_a_blank_prompt_or_model_in_the_settings_is_refused(blank: str) -> None:
    """review: a blank Ocr.prompt was taken, and every page was sent with it as its whole
    instruction, where the same prompt given to ocr() is refused."""
    with pytest.raises(polygate.ConfigError, match="prompt"):
        polygate.Ocr(prompt=blank)
    with pytest.raises(polygate.ConfigError, match="model"):
        polygate.Source(name="a", base_url="http://a/v1", model=blank)


SIZES = [(100 + 50 * i, 100.0) for i in range(5)]  # at dpi=72: 100x100, 150x100, …


# --------------------------------------------------------------------------- PDFs


async def test_pdf_pages_in_order_with_their_usage_and_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(size_reply)
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf(SIZES))
    assert [p.index for p in r.pages] == [0, 1, 2, 3, 4]
    assert [p.text for p in r.pages] == [f"{100 + 50 * i}x100" for i in range(5)]
    assert r.text == "\n\n".join(p.text for p in r.pages)
    assert all(p.source == "a" and p.usage is not None for p in r.pages)
    assert r.usage is not None
    assert r.usage.total_tokens == sum(p.usage.total_tokens for p in r.pages if p.usage)
    assert r.usage.source == "upstream"
    assert r.source == "a" and r.model == "fake-model"
    st = r.call_stats
    assert st.attempts == 5 and st.hedges == 0 and st.reasks == 0
    assert st.generation_ms == pytest.approx(1000 * (1 + 2 + 3 + 4 + 5))  # the sum
    assert st.ttft_ms is None  # several pages: no single first token
    assert st.scope == "ocr"
    assert isinstance(r, polygate.OcrResponse) and isinstance(r.pages[0], polygate.OcrPage)


async def test_request_shape(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="# Title"))
    async with polygate.session(ocr_settings(), transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf([(612, 792)]), temperature=0, max_tokens=4096)
    [req] = up.requests
    assert req.path.endswith("/chat/completions")
    [message] = req.body["messages"]
    assert message["role"] == "user"
    text, image = message["content"]
    assert text == {"type": "text", "text": DEFAULT_PROMPT}
    assert image["type"] == "image_url"
    mime, data = sent_image(req)
    assert mime == "image/jpeg"  # the default image_format
    with Image.open(io.BytesIO(data)) as page:
        # letter size at the default 150 dpi, aspect ratio kept
        assert page.format == "JPEG"
        assert abs(page.size[0] - 1275) <= 1 and abs(page.size[1] - 1650) <= 1
    assert req.body["temperature"] == 0 and req.body["max_tokens"] == 4096
    assert r.text == "# Title"
    assert r.call_stats.ttft_ms is not None  # one page: that call's own statistics


async def test_large_pages_are_scaled_down_keeping_the_aspect_ratio(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(text="x"))
    settings = ocr_settings(max_side_px=1000, image_format="png")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.ocr(make_pdf([(3000, 1500), (500, 2500)]))
    sizes = []
    for req in up.requests:
        mime, data = sent_image(req)
        assert mime == "image/png"
        with Image.open(io.BytesIO(data)) as image:
            sizes.append(image.size)
    assert sorted(sizes) == [(200, 1000), (1000, 500)]


@pytest.mark.parametrize("render_in", ["process", "thread"])
async def test_the_longer_side_never_passes_max_side_px(
    autojump_clock: trio.testing.MockClock, render_in: str
) -> None:
    """Review finding: pypdfium2 renders ceil(side * scale) pixels, and an ISO A1 page
    (1683.78 x 2383.94 pt) at max_side_px=1600 came out 1601 px tall."""
    up = FakeUpstream(Reply(text="x"))
    settings = ocr_settings(max_side_px=1600, image_format="png", render_in=render_in)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.ocr(make_pdf([(1683.78, 2383.94), (1000.63, 1417.32)]))
    for req in up.requests:
        with Image.open(io.BytesIO(sent_image(req)[1])) as image:
            assert max(image.size) == 1600, image.size


@given(
    width=st.floats(1.0, 20_000.0), height=st.floats(1.0, 20_000.0),
    dpi=st.floats(36.0, 600.0), max_side=st.integers(16, 8192),
)
def test_pdf_scale_fits_max_side_px_and_loses_nothing_else(
    width: float, height: float, dpi: float, max_side: int
) -> None:
    import math

    scale = _ocr_render.pdf_scale(width, height, dpi, max_side)
    longest = max(width, height)
    assert math.ceil(longest * scale) <= max_side  # as pypdfium2 sizes the bitmap
    # and it is the wanted scale, less no more than rounding
    assert scale >= min(dpi / 72.0, max_side / longest) * (1 - 1e-12)


async def test_pages_selects_and_keeps_document_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(size_reply)
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf(SIZES), pages=[3, 0])
    assert [p.index for p in r.pages] == [0, 3]
    assert [p.text for p in r.pages] == ["100x100", "250x100"]
    assert len(up.requests) == 2


async def test_pages_are_bounded_and_come_back_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Under MockClock, virtual time jumps while workers wait for their render threads,
    # so how much the pages overlap is not deterministic here: the bound and the order
    # are (the overlap itself is checked on the real clock, test_integration_chains).
    up = FakeUpstream(size_reply)
    sizes = [(100 + 50 * (6 - i), 100) for i in range(7)]  # the first page is the slowest
    settings = ocr_settings(dpi=72, max_concurrent_pages=3)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf(sizes))
    assert [p.text for p in r.pages] == [f"{w}x100" for w, _ in sizes]
    assert up.statistics().peak_in_flight <= 3
    assert r.call_stats.generation_ms == pytest.approx(1000 * sum(range(1, 8)))


async def test_hand_written_pdf(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(size_reply)
    async with polygate.session(ocr_settings(dpi=144), transport=Router({"a": up})) as s:
        r = await s.ocr(minimal_pdf())
    assert r.text == "400x200"
    _, data = sent_image(up.requests[0])
    with Image.open(io.BytesIO(data)) as image:
        # the text was rendered: the page is not blank
        assert image.convert("L").getextrema()[0] < 128


async def test_a_path_is_read(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    path = tmp_path / "doc.pdf"
    path.write_bytes(make_pdf(SIZES[:2]))
    up = FakeUpstream(size_reply)
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        r = await s.ocr(path)
        r2 = await s.ocr(trio.Path(path), pages=range(1, 2))  # any path-like; any sequence
    assert [p.text for p in r.pages] == ["100x100", "150x100"]
    assert [(p.index, p.text) for p in r2.pages] == [(1, "150x100")]


# --------------------------------------------------------------------------- images and URLs


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
async def test_an_image_within_the_limits_is_sent_unaltered(
    autojump_clock: trio.testing.MockClock, fmt: str
) -> None:
    data = image_bytes(fmt, (640, 480))
    up = FakeUpstream(Reply(text="text"))
    async with polygate.session(ocr_settings(), transport=Router({"a": up})) as s:
        r = await s.ocr(data)
    mime, sent = sent_image(up.requests[0])
    assert mime == f"image/{fmt.lower()}" and sent == data
    assert [p.index for p in r.pages] == [0]


@pytest.mark.parametrize(("fmt", "mode"), [("WEBP", "RGB"), ("GIF", "P"), ("PNG", "RGBA")])
@pytest.mark.parametrize("image_format", ["jpeg", "png"])
async def test_other_images_are_converted_and_large_ones_scaled(
    autojump_clock: trio.testing.MockClock, fmt: str, mode: str, image_format: str
) -> None:
    data = image_bytes(fmt, (3000, 1000), mode)
    up = FakeUpstream(Reply(text="text"))
    settings = ocr_settings(image_format=image_format)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.ocr(data)
    mime, sent = sent_image(up.requests[0])
    assert mime == f"image/{image_format}"
    with Image.open(io.BytesIO(sent)) as image:
        assert image.format == image_format.upper()
        assert image.size == (2048, 683)  # the default max_side_px, 3:1 kept


@pytest.mark.parametrize("render_in", ["process", "thread"])
@pytest.mark.parametrize("image_format", ["jpeg", "png"])
async def test_a_16_bit_grey_image_keeps_its_tones(
    autojump_clock: trio.testing.MockClock, render_in: str, image_format: str
) -> None:
    """A 16-bit greyscale scan, scaled: its tones are scaled to 8 bits, not clipped
    (Pillow's convert() clips, which made every tone above 255/65535 white)."""
    out = io.BytesIO()
    Image.new("I;16", (200, 100), 40_000).save(out, "PNG")
    up = FakeUpstream(Reply(text="text"))
    settings = ocr_settings(max_side_px=64, render_in=render_in, image_format=image_format)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.ocr(out.getvalue())
    _, sent = sent_image(up.requests[0])
    with Image.open(io.BytesIO(sent)) as image:
        assert image.size == (64, 32)
        pixel = image.convert("L").getpixel((10, 10))
    assert abs(pixel - 40_000 // 256) <= 3, pixel


async def test_a_small_webp_is_converted_not_scaled(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="text"))
    async with polygate.session(ocr_settings(), transport=Router({"a": up})) as s:
        await s.ocr(image_bytes("WEBP", (300, 200)))
    mime, sent = sent_image(up.requests[0])
    with Image.open(io.BytesIO(sent)) as image:
        assert (mime, image.size) == ("image/jpeg", (300, 200))


async def test_an_https_url_is_handed_over_as_is(autojump_clock: trio.testing.MockClock) -> None:
    url = "https://example.com/scans/page-1.png?sig=abc"
    up = FakeUpstream(Reply(text="hello"))
    settings = ocr_settings(prompt="Read this page.")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.ocr(url)
        r2 = await s.ocr(url, prompt="Only the title.")
    contents = [req.body["messages"][0]["content"] for req in up.requests]
    assert contents[0] == [
        {"type": "text", "text": "Read this page."},  # the scope's prompt
        {"type": "image_url", "image_url": {"url": url}},
    ]
    assert contents[1][0]["text"] == "Only the title."  # the call's prompt wins
    assert r.text == r2.text == "hello"


# --------------------------------------------------------------------------- bad input


class Weird:
    pass


@pytest.mark.parametrize("render_in", ["process", "thread"])
async def test_bad_documents_before_any_io(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, render_in: str
) -> None:
    big = tmp_path / "big.pdf"
    big.write_bytes(make_pdf([(100, 100)]) + b"\0" * 2000)
    cases: list[tuple[Any, str]] = [
        (b"hello world", "not a PNG, JPEG, WebP, GIF or PDF"),
        (b"", "empty"),
        (b"%PDF-1.7\n this is no pdf", "PDF cannot be opened"),
        (encrypted_pdf(), r"^the PDF cannot be opened: .*password"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "PNG image cannot be read"),
        (image_bytes("PNG", (10, 10))[:30], "PNG image cannot be read"),
        (b"x" * 3000, "over max_document_bytes"),
        (big, r"^document '[^']*' is \d+ bytes, over max_document_bytes=2048$"),
        (tmp_path / "missing.pdf", "cannot read document"),
        # (said once: outside review, "cannot read document '/x': document '/x' is ...")
        (tmp_path, r"^document '[^']*' is not a file$"),
        ("http://example.com/a.png", "https:// URL"),
        ("/tmp/a.pdf", "https:// URL"),
        ("https://", "https:// URL"),
        (12, "got int"),
        (memoryview(b"%PDF-"), "got memoryview"),
        (Weird(), "got Weird"),
        (None, "got NoneType"),
    ]
    up = FakeUpstream(Reply(text="x"))
    settings = ocr_settings(max_document_bytes=2048, render_in=render_in)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        for document, problem in cases:
            with pytest.raises(polygate.ConfigError, match=problem):
                await s.ocr(document)
    assert up.requests == []


async def test_bad_pages_and_prompts_before_any_io(autojump_clock: trio.testing.MockClock) -> None:
    pdf = make_pdf([(100, 100)] * 3)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"pages": [3]}, "page 3 is out of range: the document has 3 page"),
        ({"pages": [0, 7]}, "page 7 is out of range"),
        ({"pages": [-1]}, "0-based"),
        ({"pages": [True]}, "0-based"),
        ({"pages": [1.0]}, "0-based"),
        ({"pages": []}, "non-empty"),
        ({"pages": "0"}, "non-empty"),
        ({"pages": 0}, "non-empty"),
        # outside review: bytes-like pages, refused as bytes are (not read as [0])
        ({"pages": bytearray(b"\x00")}, "non-empty"),
        ({"pages": memoryview(b"\x00")}, "non-empty"),
        ({"pages": [1, 1]}, "twice"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "read \ud800 this"}, "prompt is not valid Unicode"),
        ({"messages": []}, "set by polygate"),
        # chat()'s own arguments, which OCR does not take: never sent as vendor fields
        ({"cache": False}, "ocr\\(\\) does not take 'cache'"),
        ({"schema": {"type": "object"}}, "ocr\\(\\) does not take 'schema'"),
        ({"scope": "nope"}, "unknown scope"),
        ({"call_deadline_s": 0}, "call_deadline_s"),
    ]
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(), transport=Router({"a": up})) as s:
        for kwargs, problem in cases:
            with pytest.raises(polygate.ConfigError, match=problem):
                await s.ocr(pdf, **kwargs)
        for image in (image_bytes("PNG", (10, 10)), "https://example.com/x.png"):
            with pytest.raises(polygate.ConfigError, match="out of range"):
                await s.ocr(image, pages=[1])
    assert up.requests == []


# --------------------------------------------------------------------------- the call


async def test_pdf_pages_and_converted_images_render_in_a_renderer_process(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_here: list[tuple[str, int]] = []  # rendering done in this process: (what, thread)

    def spy(name: str, original: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            in_here.append((name, threading.get_ident()))
            return original(*args)
        return wrapper

    for name in ("open", "page"):
        monkeypatch.setattr(_ocr_render.Renderer, name, spy(name, getattr(_ocr_render.Renderer, name)))
    monkeypatch.setattr(_ocr_document, "image_page", spy("image", _ocr_document.image_page))
    up = FakeUpstream(size_reply)
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf(SIZES[:3]))
        assert [p.text for p in r.pages] == ["100x100", "150x100", "200x100"]
        assert (await s.ocr(image_bytes("WEBP", (150, 40)))).text == "150x40"
        assert (await s.ocr(image_bytes("PNG", (120, 20)))).text == "120x20"
        stats = s._runtime.renderers.statistics()
    # the PDF was opened and rendered elsewhere, and the WebP converted there; the
    # PNG (sent as it is: a base64 encoding) was prepared in a worker thread
    assert [name for name, _ in in_here] == ["image"]
    assert in_here[0][1] != threading.get_ident()
    assert stats.started >= 1 and stats.alive == stats.started - stats.stopped


async def test_with_render_in_thread_pdf_pages_render_in_worker_threads(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    original = _ocr_render.Renderer.page

    def page(self: Any, *args: Any) -> Any:
        threads.append(threading.get_ident())
        return original(self, *args)

    monkeypatch.setattr(_ocr_render.Renderer, "page", page)
    up = FakeUpstream(size_reply)
    settings = ocr_settings(dpi=72, render_in="thread")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf(SIZES[:3]))
        assert s._runtime.renderers.statistics("process").started == 0
    assert [p.text for p in r.pages] == ["100x100", "150x100", "200x100"]
    assert len(threads) == 3
    assert threading.get_ident() not in threads


async def test_a_failed_page_is_retried_on_another_source(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeUpstream([Reply(status=503), Reply(text="from a")])
    b = FakeUpstream(Reply(text="from b"))
    settings = ocr_settings(sources=("a", "b"), max_concurrent_pages=1)
    async with polygate.session(settings, transport=Router({"a": a, "b": b})) as s:
        r = await s.ocr(make_pdf([(100, 100)] * 2))
    assert [(p.text, p.source) for p in r.pages] == [("from b", "b"), ("from a", "a")]
    assert r.call_stats.attempts == 3
    assert len({req.body["messages"][0]["content"][1]["image_url"]["url"]
                for req in (a.requests[0], b.requests[0])}) == 1  # the retry sent the same page


async def test_a_failed_ocr_call_carries_every_pages_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As an embedding call's batches: AllSourcesExhausted.errors holds the failed
    attempts of every page (a page that failed once, then answered, included)."""
    seen: dict[int, int] = {}

    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        _, data = sent_image(rec)
        with Image.open(io.BytesIO(data)) as image:
            width = image.size[0]
        seen[width] = seen.get(width, 0) + 1
        if width <= 120:  # page 0 fails once, then answers
            return Reply(status=503) if seen[width] == 1 else Reply(text="ok")
        return Reply(status=500, headers_delay_s=1)  # page 1 always fails, later

    up = FakeUpstream(behaviour)
    settings = attrs.evolve(ocr_settings(dpi=72), scopes={"ocr": attrs.evolve(
        ocr_settings(dpi=72).scopes["ocr"], retry=polygate.Retry(backoff_base_s=0.5))})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as info:
            await s.ocr(make_pdf(SIZES[:2]))
    failed = [r for r in up.requests if r.status >= 500]
    assert len(info.value.errors) == len(failed) == info.value.call_stats.attempts - 1
    assert info.value.errors[0].status_code == 503  # the one that failed first


async def test_a_fatal_page_fails_the_call_with_one_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        _, data = sent_image(rec)
        with Image.open(io.BytesIO(data)) as image:
            wide = image.size[0] > 120
        return Reply(status=400) if wide else Reply(text="ok", first_token_s=50.0)

    up = FakeUpstream(behaviour)
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError) as info:
            await s.ocr(make_pdf(SIZES[:3]))
    assert info.value.call_stats is not None
    assert up.in_flight == 0  # the slow pages were cancelled, not left behind


async def test_the_deadline_covers_every_page(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="x", first_token_s=1000.0))
    async with polygate.session(ocr_settings(), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.DeadlineExceeded) as info:
            await s.ocr(make_pdf([(100, 100)] * 6), call_deadline_s=20)
    assert info.value.call_stats is not None
    assert info.value.call_stats.total_latency_ms == pytest.approx(20_000)
    assert up.in_flight == 0


@pytest.mark.parametrize("render_in", ["process", "thread"])
async def test_cancelled_call_closes_the_document(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, render_in: str
) -> None:
    keys: list[int] = []

    def new_key() -> int:
        keys.append(_ocr_renderers.new_key())
        return keys[-1]

    monkeypatch.setattr(_ocr_document, "new_key", new_key)
    up = FakeUpstream(Reply(text="x", first_token_s=1000.0))
    async with polygate.session(ocr_settings(render_in=render_in), transport=Router({"a": up})) as s:
        with trio.move_on_after(5):
            await s.ocr(make_pdf([(100, 100)] * 3))
        renderers = s._runtime.renderers
        stats = renderers.statistics(render_in)
        assert stats.idle >= 1 and stats.holding == 0
        # The renderers really closed it: asked for a page of it, they do not have it.
        with pytest.raises(polygate.ConfigError, match="the PDF was closed"):
            await renderers.request(render_in, keys[0], ("page", keys[0], 0, "p", 72.0, 100, "jpeg"), b"")
    assert up.in_flight == 0


async def test_telemetry_row_is_one_ocr_call(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:

    db = tmp_path / "t.db"
    up = FakeUpstream(Reply(text="x"))
    settings = attrs.evolve(ocr_settings(), telemetry=f"sqlite://{db}")
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf([(100, 100)] * 3))
    calls = _query(db, "SELECT logical_call_id, kind, attempts, content FROM calls")
    attempts = _query(db, "SELECT logical_call_id FROM attempts")
    assert calls == [(r.call_stats.logical_call_id, "ocr", 3, None)]
    assert attempts == [(r.call_stats.logical_call_id,)] * 3


# --------------------------------------------------------------------------- the page's JSON

@given(prompt=st.text(), image=st.binary(max_size=300), mime=st.sampled_from(["image/png", "image/jpeg"]))
def test_a_page_message_is_the_json_of_its_parts(prompt: str, image: bytes, mime: str) -> None:
    """The data URI is spliced into the message, not JSON-escaped (see page_messages):
    the text is the same as encoding the whole message, whatever the prompt holds."""
    uri = _ocr_render.data_uri(mime, image)
    spliced = _ocr_render.page_messages(prompt, uri)
    assert spliced == _ocr_render._ENCODE(_ocr_render._message(prompt, str(uri)))
    content = json.loads(spliced)[0]["content"]
    assert content == [{"type": "text", "text": prompt},
                       {"type": "image_url", "image_url": {"url": str(uri)}}]


def test_a_url_that_was_not_made_here_is_escaped() -> None:
    url = 'https://example.com/a"b\\c'
    message = json.loads(_ocr_render.page_messages("p", url))
    assert message[0]["content"][1]["image_url"]["url"] == url


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_encoding_through_a_file_gives_the_same_image(fmt: str) -> None:
    image = Image.new("RGB", (64, 48), (200, 30, 90))
    uri = _ocr_render.encoded(image, fmt)
    expected = io.BytesIO()
    if fmt == "png":
        image.save(expected, "PNG", compress_level=6)
    else:
        image.save(expected, "JPEG", quality=_ocr_render._JPEG_QUALITY)
    assert base64.b64decode(uri.split(",", 1)[1]) == expected.getvalue()


@pytest.mark.parametrize("render_in", ["process", "thread"])
async def test_an_image_that_opens_but_does_not_decode_is_a_config_error(
    autojump_clock: trio.testing.MockClock, render_in: str,
) -> None:
    """A probe found a truncated JPEG (it passes open() and verify()) failing only when
    decoded, as a plain PolygateError 'the OCR renderer failed' (docs/ocr.md: a page
    that opens but fails to render later raises ConfigError)."""
    picture = io.BytesIO()
    Image.new("RGB", (300, 300), (120, 30, 200)).save(picture, "JPEG", quality=95)
    truncated = picture.getvalue()[: len(picture.getvalue()) // 3]
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(max_side_px=100, render_in=render_in),
                                transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="cannot be decoded"):
            await s.ocr(truncated)
    assert up.requests == []


def test_an_image_over_the_pixel_limit_is_refused_before_any_io(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pillow only warns between its limit and twice it, and decodes: a probe's 631-byte
    JPEG header declaring 13000 × 13000 took 1.3 GB in a renderer.  Over the limit is a
    ConfigError when the document is opened, and no warning reaches the caller."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 6_000)
    picture = io.BytesIO()
    Image.new("RGB", (100, 100)).save(picture, "PNG")
    with pytest.raises(polygate.ConfigError, match="100×100 pixels, too large to decode safely"):
        _ocr_document._open_image(picture.getvalue(), "PNG", polygate.Ocr())


def _pdf_with_a_broken_second_page() -> bytes:
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R 4 0 R] /Count 2 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] >>",
        b"<< /Type /Font >>",  # page 1 is not a page: PDFium "Failed to load page."
    ]
    return _pdf_of(objects)


@pytest.mark.parametrize("render_in", ["process", "thread"])
async def test_a_page_failing_mid_call_still_writes_the_call_row(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, render_in: str
) -> None:
    """Review: page 1 of a PDF that PDFium cannot load was found bad after page 0 was
    sent and answered: the ConfigError left the call without a call row, while page
    0's attempt row was written (docs/ocr.md: one call row, one row per attempt)."""
    db = tmp_path / "t.db"
    up = FakeUpstream(Reply(text="page text"))
    settings = attrs.evolve(
        ocr_settings(render_in=render_in, max_concurrent_pages=1), telemetry=f"sqlite://{db}"
    )
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match="page 1 of the PDF cannot be loaded"):
            await s.ocr(_pdf_with_a_broken_second_page())
    assert len(up.requests) == 1  # page 0 was sent and answered
    attempts = _query(db, "SELECT logical_call_id, error FROM attempts")
    calls = _query(db, "SELECT logical_call_id, kind, outcome FROM calls")
    assert [error for _, error in attempts] == ["ok"]
    # the attempt row's logical call has a call row
    assert [(cid, kind) for cid, kind, _ in calls] == [(attempts[0][0], "ocr")]


async def test_a_path_with_a_nul_byte_or_a_url_with_a_lone_surrogate_is_a_config_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: ``Path("scan\\x00.pdf")`` raised a bare ValueError from os.stat, and an
    https URL holding a lone surrogate a UnicodeEncodeError from inside the call."""
    up = FakeUpstream(Reply(text="x"))

    class NotAPath:
        def __fspath__(self) -> Any:
            return 5

    async with polygate.session(ocr_settings(), transport=Router({"a": up})) as s:
        for document in (Path("scan\x00.pdf"), "https://example.com/scan-\ud800.png", NotAPath()):
            with pytest.raises(polygate.ConfigError, match="document"):
                await s.ocr(document)
    assert up.requests == []


def test_a_refused_url_document_is_shown_masked() -> None:
    """Review: a refused URL was quoted as given, a signed link's token or a
    user:password with it (messages get logged and stored)."""
    from polygate._ocr_document import check_url

    for url, secret in (("http://h/x.png?token=SECRETTOKEN123", "SECRETTOKEN123"),
                        ("https://u:passw0rd123@h x", "passw0rd123"),
                        # outside review: a signed link's own signature, and a fragment's
                        ("http://a.blob.example/a.png?sp=r&sig=SECRETSIG123", "SECRETSIG123"),
                        ("http://b.example/a.png?X-Amz-Signature=SECRETSIG123", "SECRETSIG123"),
                        ("http://h/a.png#access_token=SECRETTOK123", "SECRETTOK123")):
        with pytest.raises(polygate.ConfigError, match="must be an https:// URL") as info:
            check_url(url)
        assert secret not in str(info.value)


async def test_pages_given_as_a_range_are_checked_by_their_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """review: ``pages=range(10**9)`` was checked page by page (minutes of CPU on the
    event loop) before it was found out of range; a range is now checked by its ends,
    and read as the pages it names, in order."""
    pdf = make_pdf([(100, 100)] * 3)
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        started = time.perf_counter()
        with pytest.raises(polygate.ConfigError, match="out of range"):
            await s.ocr(pdf, pages=range(10**9))
        assert time.perf_counter() - started < 1.0
        with pytest.raises(polygate.ConfigError, match="0-based"):
            await s.ocr(pdf, pages=range(-1, 2))
        assert [p.index for p in (await s.ocr(pdf, pages=range(2, -1, -2))).pages] == [0, 2]
        assert [p.index for p in (await s.ocr(pdf, pages=range(1, 3))).pages] == [1, 2]


async def test_pages_do_not_teach_the_chat_hedge_trigger(autojump_clock: trio.testing.MockClock) -> None:
    """review: on a scope with an adaptive hedge, OCR pages (never hedged) fed the
    scope's latency sketch: slow first tokens of images lifted the trigger of the
    chat calls that share the scope.  Only the calls that hedge teach it."""
    scope = polygate.Scope(
        sources=[polygate.Source(name=n, base_url=f"http://{n}/v1") for n in ("a", "b")],
        hedge=polygate.Hedge(after_quantile=0.9), ocr=polygate.Ocr())
    up = FakeUpstream(Reply(text="page", first_token_s=5))
    async with polygate.session(polygate.Settings(scopes={"chat": scope}),
                                transport=Router({"a": up, "b": up})) as s:
        await s.ocr(make_pdf(SIZES), scope="chat")
        assert all(sketch.count == 0 for sketch in s._runtime.sketches.values())
        await s.chat([{"role": "user", "content": "hi"}])
        assert sum(sketch.count for sketch in s._runtime.sketches.values()) == 1
