"""Behaviours of the settings, their loaders and OCR that no other test pinned.

Found by mutating the code: each test fails on one plausible bug (named in its
docstring) that the rest of the suite let through."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pypdfium2 as pdfium
import pytest
import trio
import trio.testing
from PIL import Image

import polygate
from polygate import ConfigError
from polygate._config import Breaker, ConfigWarning, Hedge, Ocr, Scope, Source
from polygate._config_load import settings_from_env, settings_from_toml
from polygate._ocr_render import tokens
from polygate.testing import FakeUpstream, RecordedRequest, Reply, Router


def _pdf(n: int, size: tuple[float, float] = (100, 100)) -> bytes:
    pdf = pdfium.PdfDocument.new()
    try:
        for _ in range(n):
            pdf.new_page(*size).close()
        out = io.BytesIO()
        pdf.save(out)
        return out.getvalue()
    finally:
        pdf.close()


def _png(size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, "white").save(out, "PNG")
    return out.getvalue()


def _settings(sources: tuple[str, ...] = ("a",), **ocr: Any) -> polygate.Settings:
    weights = {"a": 1.0, "b": 1e-9}
    scope = polygate.Scope(
        sources=[polygate.Source(name=n, base_url=f"http://{n}/v1", weight=weights[n])
                 for n in sources],
        ocr=polygate.Ocr(**ocr),
    )
    return polygate.Settings(scopes={"ocr": scope})


def _width(rec: RecordedRequest) -> int:
    import base64

    url = rec.body["messages"][0]["content"][1]["image_url"]["url"]
    data = base64.b64decode(url.split(",", 1)[1])
    with Image.open(io.BytesIO(data)) as image:
        return image.size[0]


# --------------------------------------------------------------------------- OCR: size limits

async def test_bytes_of_exactly_max_document_bytes_are_accepted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Mutant _ocr.py:62 `len(document) > max` -> `>=`: "larger documents are refused"."""
    png = _png((64, 64))
    up = FakeUpstream(Reply(text="ok"))
    async with polygate.session(_settings(max_document_bytes=len(png)),
                                transport=Router({"a": up})) as s:
        r = await s.ocr(png)
        assert r.text == "ok"
        with pytest.raises(ConfigError, match="max_document_bytes"):
            await s.ocr(png + b"\0")


async def test_a_file_of_exactly_max_document_bytes_is_accepted(
    autojump_clock: trio.testing.MockClock, tmp_path: Path,
) -> None:
    """Mutant _ocr_document.py:_read `size > cap` -> `size >= cap`."""
    png = _png((64, 64))
    path = tmp_path / "page.png"
    path.write_bytes(png)
    up = FakeUpstream(Reply(text="ok"))
    async with polygate.session(_settings(max_document_bytes=len(png)),
                                transport=Router({"a": up})) as s:
        assert (await s.ocr(path)).text == "ok"
        path.write_bytes(png + b"\0")
        with pytest.raises(ConfigError, match="max_document_bytes"):
            await s.ocr(path)


# --------------------------------------------------------------------------- OCR: kinds

async def test_a_pdf_header_after_a_little_junk_is_a_pdf(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/ocr.md: a PDF is recognised by `%PDF-` in its first KiB (PDFium allows
    leading junk).  Mutant sniff: `b"%PDF-" in data[:1024]` -> `data.startswith(b"%PDF-")`."""
    up = FakeUpstream(Reply(text="page"))
    async with polygate.session(_settings(render_in="thread"), transport=Router({"a": up})) as s:
        r = await s.ocr(b"junk before the header\n" * 4 + _pdf(2))
    assert [p.index for p in r.pages] == [0, 1]


# --------------------------------------------------------------------------- OCR: statistics

async def test_admission_estimate_counts_the_page_image(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/ocr.md: admission reserves the prompt's tokens plus one token per 28 x 28
    pixels; an upstream that reports no usage is settled at that estimate.  Mutant
    _ocr.py:177 `estimate = prompt_tokens + page.image_tokens` -> `prompt_tokens`."""
    up = FakeUpstream(Reply(text="ok", usage=False))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        r = await s.ocr(_png((560, 560)))
    assert r.usage.source == "estimated"
    assert r.pages[0].usage.prompt_tokens >= tokens(560, 560) == 400


async def test_usage_is_estimated_if_any_page_was(autojump_clock: trio.testing.MockClock) -> None:
    """docs/ocr.md Statistics: usage `source="estimated"` if any page's usage was.
    Mutant _ocr.py:218 `estimated = estimated or ...` -> `estimated = ...` (last page wins)."""
    up = FakeUpstream([Reply(text="p0", usage=False), Reply(text="p1")])
    async with polygate.session(_settings(max_concurrent_pages=1),
                                transport=Router({"a": up})) as s:
        r = await s.ocr(_pdf(2))
    assert [p.usage.source for p in r.pages] == ["estimated", "upstream"]
    assert r.usage.source == "estimated"


async def test_several_pages_source_is_the_one_that_answered_most(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """docs/ocr.md Statistics: several pages -> `source` is the source that answered the
    most pages.  Mutant _ocr.py:231 `_most_common(...)` -> `records[0].source`."""
    sizes = [(100, 100), (150, 100), (200, 100)]

    def only_page_0(rec: RecordedRequest, rng: Any) -> Reply:
        return Reply(text="a") if _width(rec) <= 120 else Reply(status=503)

    def not_page_0(rec: RecordedRequest, rng: Any) -> Reply:
        return Reply(status=503) if _width(rec) <= 120 else Reply(text="b")

    a, b = FakeUpstream(only_page_0), FakeUpstream(not_page_0)
    pdf = pdfium.PdfDocument.new()
    try:
        for w, h in sizes:
            pdf.new_page(w, h).close()
        out = io.BytesIO()
        pdf.save(out)
    finally:
        pdf.close()
    async with polygate.session(_settings(("a", "b"), dpi=72, max_concurrent_pages=1),
                                transport=Router({"a": a, "b": b})) as s:
        r = await s.ocr(out.getvalue())
    assert [p.source for p in r.pages] == ["a", "b", "b"]
    assert r.source == r.call_stats.source == "b"


# --------------------------------------------------------------------------- settings bounds

def test_ocr_ranges_include_their_lower_ends() -> None:
    """docs/ocr.md: dpi in [18, 1200], max_side_px in [64, 8192], max_concurrent_pages
    in [1, 64].  Mutant _in_range `lo <= value` -> `lo < value`."""
    ocr = Ocr(dpi=18, max_side_px=64, max_concurrent_pages=1)
    assert (ocr.dpi, ocr.max_side_px, ocr.max_concurrent_pages) == (18, 64, 1)
    ocr = Ocr(dpi=1200, max_side_px=8192, max_concurrent_pages=64)
    for bad in ({"dpi": 17.9}, {"max_side_px": 63}, {"max_concurrent_pages": 0},
                {"dpi": 1200.5}, {"max_side_px": 8193}, {"max_concurrent_pages": 65}):
        with pytest.raises(ConfigError):
            Ocr(**bad)


def test_ocr_document_cap_and_prompt_are_bounded() -> None:
    """Outside review: a cap over 4 GiB let a bare struct.error out of ocr() (a
    renderer's frames have 32-bit lengths; PDFium loads with an int size), and a prompt
    over 1 MiB killed every renderer process (it rides in each page's request header)."""
    assert Ocr(max_document_bytes=2**31 - 1, prompt="p" * 200_000).max_document_bytes == 2**31 - 1
    with pytest.raises(ConfigError, match=r"max_document_bytes: must be at most 2,147,483,647"):
        Ocr(max_document_bytes=2**31)
    with pytest.raises(ConfigError, match=r"prompt: must be at most 200,000 characters, got 200,001"):
        Ocr(prompt="p" * 200_001)


async def test_a_calls_prompt_is_bounded_as_the_settings_one_is(autojump_clock: trio.testing.MockClock) -> None:
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], ocr=Ocr())})
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(settings, transport=up.transport()) as s:
        with pytest.raises(ConfigError, match="prompt must be at most 200,000 characters"):
            await s.ocr(b"%PDF-1.4", prompt="p" * 200_001)
    assert up.requests == []


def test_breaker_max_open_s_may_equal_open_s() -> None:
    """Breaker: max_open_s "must be >= open_s".  Mutant `max_open_s < open_s` -> `<=`."""
    assert Breaker(open_s=30, max_open_s=30).max_open_s == 30
    with pytest.raises(ConfigError, match="max_open_s"):
        Breaker(open_s=30, max_open_s=29.9)


def test_hedge_after_s_equal_to_the_smallest_ttft_timeout_warns() -> None:
    """SPEC §2: `hedge.after_s >= min(ttft_timeout_s)` -> warning.  Mutant `>=` -> `>`."""
    sources = [Source(name="a", base_url="http://a/v1", ttft_timeout_s=5),
               Source(name="b", base_url="http://b/v1")]
    with pytest.warns(ConfigWarning, match="ttft_timeout_s"):
        Scope(sources=sources, hedge=Hedge(after_s=5))


# --------------------------------------------------------------------------- no secret in messages

def test_env_serve_key_is_scrubbed_from_an_earlier_keys_message() -> None:
    """A gateway key (POLYGATE__SERVE__KEYS__NAME__KEY) pasted into another variable
    that sorts before it: the message quoting that variable never shows it.
    Mutant _env_secrets: `| {"KEY"}` dropped."""
    key = "gwkey4242"
    env = {
        "POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
        "POLYGATE__CHAT__A__RPM": key,
        "POLYGATE__SERVE__KEYS__BOB__KEY": key,
    }
    with pytest.raises(ConfigError, match="POLYGATE__CHAT__A__RPM") as info:
        settings_from_env(env)
    assert key not in str(info.value)


def test_api_key_env_value_is_scrubbed_from_other_fields_messages(tmp_path: Path) -> None:
    """`api_key_env` reads the key from the environment: a message about another field
    that quotes the same text (the key pasted there too) never shows it.
    Mutant _secret_from_env: `secrets.add(value)` dropped."""
    key = "sk-short42"
    path = tmp_path / "polygate.toml"
    path.write_text(
        '[scopes.chat.sources.a]\nbase_url = "http://a/v1"\napi_key_env = "MY_KEY"\n'
        f'structured_output = "{key}"\n'
    )
    with pytest.raises(ConfigError, match="structured_output") as info:
        settings_from_toml(path, env={"MY_KEY": key})
    assert key not in str(info.value)


def test_toml_serve_api_keys_are_scrubbed_from_other_fields_messages(tmp_path: Path) -> None:
    """`[serve] api_keys = [...]` are secrets of the file: a message quoting the same
    text elsewhere never shows it.  Mutant _harvest_secrets: a list's items lose their key."""
    key = "gw-short42"
    path = tmp_path / "polygate.toml"
    path.write_text(
        f'[serve]\napi_keys = ["{key}"]\n\n'
        f'[scopes.chat.sources.a]\nbase_url = "http://a/v1"\nstructured_output = "{key}"\n'
    )
    with pytest.raises(ConfigError, match="structured_output") as info:
        settings_from_toml(path, env={})
    assert key not in str(info.value)
