"""OCR documents: recognising, reading and rendering them into page images.

Everything here is synchronous and meant for a worker thread (``trio.to_thread``):
decoding and rendering a page takes tens of milliseconds, the event loop must not
wait for it.  Nothing here knows of calls, sources or the network.

A document is one of

* an image (PNG, JPEG, WebP or GIF, recognised by its magic bytes): one page.  A PNG
  or JPEG whose longer side is within ``Ocr.max_side_px`` is sent unaltered; any other
  image is re-encoded (WebP and GIF are not accepted by every upstream; a large image
  is scaled down, aspect ratio kept);
* a PDF: each page rendered by PDFium (pypdfium2) at ``Ocr.dpi``, scaled down when its
  longer side would exceed ``Ocr.max_side_px``;
* an ``https://`` URL: one page, handed to the upstream as is.

Re-encoded images use ``Ocr.image_format``: JPEG (quality 90, transparency flattened
onto white) by default — for rendered text about ten times faster to encode than PNG
and no larger — or PNG (lossless).

**PDFium is not thread-safe**, not even across documents: every pdfium call of the
process goes through :data:`_PDFIUM` (one lock), and every pdfium object is closed
explicitly under it, so that no garbage-collector finaliser calls pdfium from another
thread.  Pillow work (encoding) runs outside the lock.

Bad input — an unknown format, an image or PDF that does not open, a document over
``max_document_bytes`` — raises :class:`ConfigError` from :func:`open_document`,
before any request is sent.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from ._config import Ocr
from ._errors import ConfigError

__all__ = ["Document", "PageRequest", "open_document", "sniff"]

_PDFIUM = threading.Lock()
_JPEG_QUALITY = 90
# Admission estimate of an image's prompt tokens: one per 28×28-pixel patch (the rule
# of Qwen2-VL-style models; OpenAI's tiles come out lower).  Settled with real usage.
_PATCH_PX = 28 * 28
_URL_IMAGE_TOKENS = 1500  # unknown size: a typical page
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

_MIME = {"PNG": "image/png", "JPEG": "image/jpeg"}


def sniff(data: bytes) -> str | None:
    """``"PNG"``, ``"JPEG"``, ``"WEBP"``, ``"GIF"`` or ``"PDF"`` by magic bytes; ``None``
    for anything else.  A PDF header may follow a little junk (PDFium allows 1 KiB)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if b"%PDF-" in data[:1024]:
        return "PDF"
    return None


@attrs.frozen
class PageRequest:
    """One page, ready to send: the messages of its chat request (already JSON, built
    off the event loop: a page image is hundreds of kilobytes of base64) and the
    admission estimate of its image's tokens."""

    messages_json: str = attrs.field(repr=lambda v: f"<{len(v)} characters>")
    image_tokens: int
    width: int | None = None
    height: int | None = None


class _DataURI(str):
    """A data URI made here (:func:`_data_uri`): base64, so nothing in it needs JSON
    escaping."""

    __slots__ = ()


def _page_messages(prompt: str, url: str) -> str:
    if not isinstance(url, _DataURI):
        return _ENCODE(_message(prompt, url))
    # JSON-escaping megabytes of base64 holds the GIL (so the event loop waits) for
    # milliseconds a page, to change nothing: it is spliced into the skeleton's empty
    # "url" instead.
    skeleton = _ENCODE(_message(prompt, ""))
    at = skeleton.rindex('"url":""') + len('"url":"')
    return skeleton[:at] + url + skeleton[at:]


def _message(prompt: str, url: str) -> list[dict[str, Any]]:
    return [{
        "role": "user",
        "content": [
            {"type": "text", "text": prompt},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }]


def _data_uri(mime: str, data: bytes) -> str:
    return _DataURI(f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}")


def _tokens(width: int, height: int) -> int:
    return max(1, math.ceil(width * height / _PATCH_PX))


class Document:
    """A document opened for OCR; :meth:`page` (in a worker thread) prepares one page.
    :meth:`close` releases what it holds (a PDF handle) and may be called twice."""

    kind: str
    page_count: int = 1

    def page(self, index: int, prompt: str) -> PageRequest:
        raise NotImplementedError

    def close(self) -> None:
        return None


class UrlDocument(Document):
    kind = "url"

    def __init__(self, url: str) -> None:
        self.url = url

    def page(self, index: int, prompt: str) -> PageRequest:
        return PageRequest(_page_messages(prompt, self.url), _URL_IMAGE_TOKENS)


class ImageDocument(Document):
    kind = "image"

    def __init__(self, data: bytes, fmt: str, size: tuple[int, int], settings: Ocr) -> None:
        self.data = data
        self.format = fmt
        self.size = size
        self.settings = settings

    def page(self, index: int, prompt: str) -> PageRequest:
        width, height = self.size
        if self.format in _MIME and max(width, height) <= self.settings.max_side_px:
            uri = _data_uri(_MIME[self.format], self.data)  # within the limits: unaltered
        else:
            image = _decoded(self.data)
            image.thumbnail((self.settings.max_side_px,) * 2, _lanczos())
            width, height = image.size
            uri = _encoded(image, self.settings.image_format)
        return PageRequest(_page_messages(prompt, uri), _tokens(width, height), width, height)


class PdfDocument(Document):
    kind = "pdf"

    def __init__(self, pdf: Any, page_count: int, settings: Ocr) -> None:
        self._pdf = pdf
        self.page_count = page_count
        self.settings = settings

    def page(self, index: int, prompt: str) -> PageRequest:
        with _PDFIUM:
            if self._pdf is None:
                raise ConfigError("the PDF was closed")
            try:
                page = self._pdf[index]
            except Exception as exc:
                raise ConfigError(f"page {index} of the PDF cannot be loaded: {exc}") from None
            try:
                width_pt, height_pt = page.get_size()
                bitmap = page.render(scale=_pdf_scale(width_pt, height_pt, self.settings))
                try:
                    # A copy: an image may share the bitmap's buffer (RGBA, L), and the
                    # bitmap is freed below.  A memory copy next to a render is cheap.
                    image = bitmap.to_pil().copy()
                finally:
                    bitmap.close()
            except Exception as exc:
                raise ConfigError(f"page {index} of the PDF cannot be rendered: {exc}") from None
            finally:
                page.close()
        uri = _encoded(image, self.settings.image_format)  # outside the lock
        width, height = image.size
        return PageRequest(_page_messages(prompt, uri), _tokens(width, height), width, height)

    def close(self) -> None:
        with _PDFIUM:
            if self._pdf is not None:
                self._pdf.close()
                self._pdf = None


def _pdf_scale(width_pt: float, height_pt: float, settings: Ocr) -> float:
    """``dpi / 72`` pixels per point, lowered so the longer side fits ``max_side_px``
    (one scale for both axes: the aspect ratio is kept)."""
    scale = settings.dpi / 72.0
    longest = max(width_pt, height_pt, 1e-6)
    return min(scale, settings.max_side_px / longest)


# --------------------------------------------------------------------------- Pillow


def _pil() -> Any:
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ConfigError(
            "OCR of an image or PDF needs Pillow (and pypdfium2 for PDFs): "
            "pip install 'polygate[pdf]'"
        ) from None
    return Image, ImageOps


def _lanczos() -> Any:
    image, _ = _pil()
    return image.Resampling.LANCZOS


def _decoded(data: bytes) -> Any:
    """The first frame, upright (EXIF orientation applied), fully decoded."""
    image_mod, image_ops = _pil()
    with image_mod.open(io.BytesIO(data)) as opened:
        opened.seek(0)
        image = image_ops.exif_transpose(opened)
        image.load()
        return image


def _encoded(image: Any, fmt: str) -> str:
    image_mod, _ = _pil()
    if fmt == "png":
        if image.mode not in ("RGB", "RGBA", "L", "LA"):
            image = image.convert("RGBA" if "A" in image.getbands() or "transparency" in image.info else "RGB")
        return _data_uri("image/png", _saved(image, "PNG", compress_level=6))
    if image.mode != "RGB":
        rgba = image.convert("RGBA")
        background = image_mod.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        image = background
    return _data_uri("image/jpeg", _saved(image, "JPEG", quality=_JPEG_QUALITY))


def _saved(image: Any, fmt: str, **options: Any) -> bytes:
    """The encoded image.  Saved to a file with a descriptor, not a BytesIO: Pillow
    then encodes without holding the GIL, so the event loop is not kept waiting
    (a page's JPEG is ~12 ms of encoding: the loop's longest stall went from 7 ms to
    1 ms, ``benchmarks/ocr.py``).  In memory where the system allows (memfd)."""
    memfd = getattr(os, "memfd_create", None)
    with (os.fdopen(memfd("polygate-page"), "w+b") if memfd else tempfile.TemporaryFile()) as out:
        image.save(out, fmt, **options)
        out.seek(0)
        return out.read()


# --------------------------------------------------------------------------- opening


def _read(document: Any, settings: Ocr) -> bytes:
    cap = settings.max_document_bytes
    if isinstance(document, (bytes, bytearray)):
        data = bytes(document)
    else:  # a pathlib.Path, or any os.PathLike (trio.Path)
        document = Path(os.fsdecode(os.fspath(document)))
        try:
            info = os.stat(document)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"document {str(document)!r} is not a file")
            size = info.st_size
            if size > cap:
                raise ConfigError(f"document {str(document)!r} is {size} bytes, over max_document_bytes={cap}")
            with open(document, "rb") as f:
                data = f.read(cap + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read document {str(document)!r}: {exc.strerror or exc}") from None
    if len(data) > cap:
        raise ConfigError(f"document is {len(data)} bytes, over max_document_bytes={cap}")
    if not data:
        raise ConfigError("document is empty")
    return data


def open_document(document: Any, settings: Ocr) -> Document:
    """Recognise and open ``document`` (bytes, a ``pathlib.Path`` — or any path-like
    object — or an ``https://`` URL); :class:`ConfigError` for anything that cannot be
    sent.  Runs in a worker
    thread: it reads files, parses image headers and opens PDFs."""
    if isinstance(document, str):
        return UrlDocument(check_url(document))
    data = _read(document, settings)
    fmt = sniff(data)
    if fmt is None:
        raise ConfigError(
            "document is not a PNG, JPEG, WebP, GIF or PDF (unrecognised first bytes)"
        )
    if fmt == "PDF":
        return _open_pdf(data, settings)
    return _open_image(data, fmt, settings)


def check_url(url: str) -> str:
    """An ``https://`` URL with a host (handed to the upstream as is), else ConfigError."""
    try:
        parts = urlsplit(url)
        ok = parts.scheme == "https" and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok or any(c.isspace() for c in url):
        shown = url if len(url) <= 80 else url[:80] + "…"
        raise ConfigError(
            f"a document given as a string must be an https:// URL, got {shown!r} "
            "(pass bytes, or a pathlib.Path for a file)"
        )
    return url


def _open_image(data: bytes, fmt: str, settings: Ocr) -> ImageDocument:
    image_mod, _ = _pil()
    try:
        with image_mod.open(io.BytesIO(data)) as image:
            size = image.size
            image.verify()  # structure and checksums, without decoding every pixel
    except image_mod.DecompressionBombError as exc:
        raise ConfigError(f"the {fmt} image is too large to decode safely: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"the {fmt} image cannot be read: {exc}") from None
    if min(size) <= 0:
        raise ConfigError(f"the {fmt} image has no pixels ({size[0]}×{size[1]})")
    return ImageDocument(data, fmt, size, settings)


def _open_pdf(data: bytes, settings: Ocr) -> PdfDocument:
    try:
        import pypdfium2 as pdfium
    except ImportError:
        raise ConfigError("OCR of a PDF needs pypdfium2: pip install 'polygate[pdf]'") from None
    _pil()  # rendering needs Pillow too: say so now, not after the first request
    with _PDFIUM:
        try:
            pdf = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as exc:
            raise ConfigError(f"the PDF cannot be opened: {exc}") from None
        try:
            count = len(pdf)
        except Exception:
            pdf.close()
            raise
    if count <= 0:
        with _PDFIUM:
            pdf.close()
        raise ConfigError("the PDF has no pages")
    return PdfDocument(pdf, count, settings)
