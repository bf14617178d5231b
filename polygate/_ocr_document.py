"""OCR documents: recognising, reading and opening them, and preparing their pages.

A document is one of

* an image (PNG, JPEG, WebP or GIF, recognised by its magic bytes): one page.  A PNG
  or JPEG whose longer side is within ``Ocr.max_side_px`` is sent unaltered (one
  base64 encoding, in a worker thread: a renderer would only add a round trip); any
  other image is converted by a renderer (WebP and GIF are not accepted by every
  upstream; a large image is scaled down, aspect ratio kept);
* a PDF: each page rendered by PDFium (pypdfium2) at ``Ocr.dpi``, scaled down when its
  longer side would exceed ``Ocr.max_side_px`` — by a renderer
  (``polygate._ocr_renderers``: a process by default, so that nothing of the
  rendering holds this process's GIL);
* an ``https://`` URL: one page, handed to the upstream as is.

The rendering itself is ``polygate._ocr_render`` (shared by renderer processes and
threads).  Bad input — an unknown format, an image or PDF that does not open, a
document over ``max_document_bytes`` — raises :class:`ConfigError` from
:func:`open_document`, before any request is sent.
"""

from __future__ import annotations

import importlib.util
import io
import os
import stat
import threading
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from ._config import Ocr, is_utf8, mask_url
from ._errors import ConfigError
from ._ocr_render import BadDocument, image_page, page_messages, tokens, unaltered
from ._ocr_renderers import Renderers, new_key
from ._threads import run_sync

__all__ = ["Document", "PageRequest", "open_document", "read_document", "sniff"]

_URL_IMAGE_TOKENS = 1500  # unknown size: a typical page

#: Held around the only change polygate makes to Python's warning filters (see
#: _open_image): the threads opening images take turns at it.
_PILLOW_WARNINGS = threading.Lock()


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

    messages_json: bytes = attrs.field(repr=lambda v: f"<{len(v)} bytes>")  # UTF-8
    image_tokens: int
    width: int | None = None
    height: int | None = None


class Document:
    """A document opened for OCR.  :meth:`page` prepares one page off the event loop;
    :meth:`aclose` releases what renderers hold of it (bounded) and may be called
    twice."""

    kind: str
    page_count: int = 1

    async def page(self, index: int, prompt: str) -> PageRequest:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


class UrlDocument(Document):
    kind = "url"

    def __init__(self, url: str) -> None:
        self.url = url

    async def page(self, index: int, prompt: str) -> PageRequest:
        await trio.lowlevel.checkpoint()
        return PageRequest(page_messages(prompt, self.url).encode(), _URL_IMAGE_TOKENS)


class ImageDocument(Document):
    """An image: sent unaltered (a base64 encoding, in a worker thread: a renderer
    process would only add a round trip), or decoded, maybe scaled, and re-encoded —
    by a renderer, where Pillow's decoding and scaling hold no GIL of this process
    (in a thread they kept the event loop waiting 9–17 ms at a time, ``docs/ocr.md``)."""

    kind = "image"

    def __init__(
        self, data: bytes, fmt: str, size: tuple[int, int], settings: Ocr,
        renderers: Renderers | None = None,
    ) -> None:
        self.data = data
        self.format = fmt
        self.size = size
        self.settings = settings
        self.renderers = renderers

    async def page(self, index: int, prompt: str) -> PageRequest:
        s = self.settings
        if unaltered(self.format, self.size, s.max_side_px) or self.renderers is None:
            messages, width, height = await run_sync(
                _image_page, self.data, self.format, self.size, prompt, s.max_side_px,
                s.image_format, or_inline=True,
            )
        else:
            header = ("image", self.format, self.size, prompt, s.max_side_px, s.image_format,
                      _pil().MAX_IMAGE_PIXELS)
            (_, width, height), messages = await self.renderers.request(
                s.render_in, None, header, self.data
            )
        return PageRequest(messages, tokens(width, height), width, height)


def _image_page(*args: Any) -> tuple[bytes, int, int]:
    try:
        messages, width, height = image_page(*args)
    except BadDocument as exc:
        raise ConfigError(str(exc)) from None
    return messages.encode(), width, height  # here, in the worker thread


class PdfDocument(Document):
    """A PDF that a renderer opened (and holds under :attr:`key`); the bytes stay
    here for renderers that do not hold it yet."""

    kind = "pdf"

    def __init__(
        self, renderers: Renderers, key: int, data: bytes, page_count: int, settings: Ocr
    ) -> None:
        self._renderers = renderers
        self.key = key
        self.data = data
        self.page_count = page_count
        self.settings = settings
        self.closed = False

    async def page(self, index: int, prompt: str) -> PageRequest:
        if self.closed:
            raise ConfigError("the PDF was closed")
        s = self.settings
        header = ("page", self.key, index, prompt, s.dpi, s.max_side_px, s.image_format)
        (_, width, height), messages = await self._renderers.request(
            s.render_in, self.key, header, self.data
        )
        return PageRequest(messages, tokens(width, height), width, height)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self._renderers.drop(self.settings.render_in, self.key)


# --------------------------------------------------------------------------- opening


def _read(document: Any, settings: Ocr) -> bytes:
    cap = settings.max_document_bytes
    if isinstance(document, (bytes, bytearray)):
        data = bytes(document)
    else:  # a pathlib.Path, or any os.PathLike (trio.Path)
        document = document_path(document)
        try:
            info = os.stat(document)
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"document {str(document)!r} is not a file")
            size = info.st_size
            if size > cap:
                raise ConfigError(f"document {str(document)!r} is {size} bytes, over max_document_bytes={cap}")
            with open(document, "rb") as f:
                data = f.read(cap + 1)
        except ConfigError:  # (a ValueError too: said once, not wrapped below)
            raise
        except (OSError, ValueError) as exc:  # ValueError: a name the system refuses
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(f"cannot read document {str(document)!r}: {reason}") from None
    if len(data) > cap:
        raise ConfigError(f"document is {len(data)} bytes, over max_document_bytes={cap}")
    if not data:
        raise ConfigError("document is empty")
    return data


def read_document(document: Any, settings: Ocr) -> Document | bytes:
    """Recognise ``document`` (bytes, a ``pathlib.Path`` — or any path-like object — or
    an ``https://`` URL): a URL or image document, or the bytes of a PDF (opened by a
    renderer next); :class:`ConfigError` for anything that cannot be sent.  Runs in a
    worker thread: it reads files and parses image headers.  It holds nothing that
    needs closing, so a caller may abandon it."""
    if isinstance(document, str):
        return UrlDocument(check_url(document))
    data = _read(document, settings)
    fmt = sniff(data)
    if fmt is None:
        raise ConfigError(
            "document is not a PNG, JPEG, WebP, GIF or PDF (unrecognised first bytes)"
        )
    if fmt == "PDF":
        _check_pdf_libraries()
        return data
    return _open_image(data, fmt, settings)


async def open_document(document: Any, settings: Ocr, renderers: Renderers) -> Document:
    """:func:`read_document` in a worker thread, then a PDF opened by a renderer (which
    checks it and counts its pages).  Nothing is left open when it raises."""
    read = await run_sync(read_document, document, settings, abandon_on_cancel=True,
                          or_inline=True)
    if isinstance(read, ImageDocument):
        read.renderers = renderers
    if not isinstance(read, bytes):
        return read
    key = new_key()
    (_, count), _ = await renderers.request(settings.render_in, key, ("open", key), read)
    return PdfDocument(renderers, key, read, count, settings)


def document_path(document: Any) -> Path:
    """A path-like document as a Path, or ConfigError: a ``__fspath__`` that returns
    no path, or a name with a NUL byte (no file can have one)."""
    try:
        path = Path(os.fsdecode(os.fspath(document)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"document is not a usable path ({exc})") from None
    if "\0" in str(path):
        raise ConfigError(f"document {str(path)!r} is not a usable path (it holds a NUL byte)")
    return path


def check_url(url: str) -> str:
    """An ``https://`` URL with a host (handed to the upstream as is), else ConfigError."""
    if not is_utf8(url):
        raise ConfigError(
            "document: the URL holds a lone surrogate (e.g. U+D800), which is not valid Unicode"
        )
    try:
        parts = urlsplit(url)
        ok = parts.scheme == "https" and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok or any(c.isspace() for c in url):
        # Masked as a configured URL is: a signed link's token, a user:password.
        shown = mask_url(url)
        shown = shown if len(shown) <= 80 else shown[:80] + "…"
        raise ConfigError(
            f"a document given as a string must be an https:// URL, got {shown!r} "
            "(pass bytes, or a pathlib.Path for a file)"
        )
    return url


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(
            "OCR of an image or PDF needs Pillow (and pypdfium2 for PDFs): "
            "pip install 'pillow>=10' 'pypdfium2>=5.8' (polygate's pdf extra)"
        ) from None
    return Image


def _open_image(data: bytes, fmt: str, settings: Ocr) -> ImageDocument:
    image_mod = _pil()
    try:
        with _PILLOW_WARNINGS, warnings.catch_warnings():
            # Pillow warns above MAX_IMAGE_PIXELS; such an image is refused below.
            # catch_warnings saves the process's filters and puts them back: two
            # threads that interleave it (images of concurrent calls, each opened on a
            # worker thread) put back each other's, and the "ignore" stayed for good.
            warnings.simplefilter("ignore", image_mod.DecompressionBombWarning)
            image = image_mod.open(io.BytesIO(data))  # the header only: short
        with image:
            size = image.size
            image.verify()  # structure and checksums, without decoding every pixel
    except image_mod.DecompressionBombError as exc:
        raise ConfigError(f"the {fmt} image is too large to decode safely: {exc}") from None
    except Exception as exc:
        reason = "not a readable image" if "BytesIO" in str(exc) else str(exc)
        raise ConfigError(f"the {fmt} image cannot be read: {reason}") from None
    limit = image_mod.MAX_IMAGE_PIXELS
    if limit is not None and size[0] * size[1] > limit:
        # Pillow only warns up to twice its limit, and decodes: a 631-byte JPEG header
        # declaring 13000 × 13000 took 1.3 GB.  Refused, before any I/O.
        raise ConfigError(
            f"the {fmt} image is {size[0]}×{size[1]} pixels, too large to decode safely "
            f"(more than {limit:,} pixels)"
        )
    if min(size) <= 0:
        raise ConfigError(f"the {fmt} image has no pixels ({size[0]}×{size[1]})")
    return ImageDocument(data, fmt, size, settings)


def _check_pdf_libraries() -> None:
    """Say now, not from a renderer, that pypdfium2 or Pillow is missing."""
    if importlib.util.find_spec("pypdfium2") is None:
        raise ConfigError("OCR of a PDF needs pypdfium2: pip install 'pypdfium2>=5.8' (polygate's pdf extra)")
    if importlib.util.find_spec("PIL") is None:
        raise ConfigError(
            "OCR of an image or PDF needs Pillow (and pypdfium2 for PDFs): "
            "pip install 'pillow>=10' 'pypdfium2>=5.8' (polygate's pdf extra)"
        )
