"""Rendering OCR pages: a PDF page or an image becomes the chat messages of one page.

This module is **self-contained on purpose**: it imports only the standard library,
and Pillow and pypdfium2 lazily.  It runs in two places:

* in a **renderer process** (:func:`serve`), where PDF pages are rendered so that
  nothing they do holds the calling process's GIL.  polygate starts
  ``python -I -c <boot> <this file>``, which loads this file alone under the name
  ``_polygate_ocr_render`` — not the ``polygate`` package (~0.6 s of imports), and not
  the caller's ``__main__`` (which ``multiprocessing``'s spawn would re-run: a script
  without an ``if __name__ == "__main__":`` guard would run twice);
* in the calling process, in a worker thread: images (one page, mostly a base64
  encoding) and, with ``Ocr.render_in="thread"``, PDF pages too.

A :class:`Renderer` holds at most one PDF open (the last one it was given): the pages
of one document go to the renderers that already hold it, so a document crosses to a
process once per renderer, not once per page.

**PDFium is not thread-safe**, not even across documents: every pdfium call of the
process goes through :data:`_PDFIUM` (one lock), and every pdfium object is closed
explicitly under it, so that no garbage-collector finaliser calls pdfium from another
thread.  Pillow work (encoding) runs outside the lock.  (In a renderer process there is
one thread and the lock is never contended.)

Errors a document causes raise :class:`BadDocument` with a message fit for a user
(no path, no traceback); the caller turns it into ``ConfigError``.  Re-encoded images
use the format asked for: JPEG (quality 90, transparency flattened onto white) — for
rendered text about ten times faster to encode than PNG and no larger — or PNG.

Wire format between polygate and a renderer process (its stdin and stdout; the
process's own fd 1 is pointed at stderr, so that nothing a library prints can corrupt
it): a frame is an 8-byte header — the lengths of a pickled tuple of plain values and of
a raw blob (a document, a page's messages) — then the two.  Blobs are not pickled: a
50 MiB PDF is written as it is, in pipe-sized pieces.  One request, one reply.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import pickle
import select
import struct
import sys
import tempfile
import threading
import warnings
from typing import Any

__all__ = [
    "BadDocument", "Renderer", "answer", "image_page", "page_messages", "serve", "tokens", "unaltered",
]

_LOCK = threading.Lock()
#: Documents to close once no PDFium call runs (see :func:`close_soon`): (renderer,
#: the key it held when the close was asked for).
_PENDING: list[tuple[Renderer, int | None]] = []
_exit_guarded = False


class _PdfiumLock:
    """The one lock around every PDFium call of the process.  Whoever leaves it closes
    the documents whose close was asked for while it was held."""

    def __enter__(self) -> None:
        _LOCK.acquire()

    def __exit__(self, *exc: object) -> None:
        try:
            _close_pending()
        finally:
            _LOCK.release()
        close_soon()  # one asked for between the drain and the release


_PDFIUM = _PdfiumLock()


def close_soon(renderer: Renderer | None = None, key: int | None = None) -> None:
    """Close ``renderer``'s document (if it still holds ``key``'s) now when no PDFium
    call runs, else as soon as the running one ends; never waits.  For the event
    loop's thread: a render cut short by a deadline goes on in its abandoned thread,
    holding the lock for as long as PDFium takes (seconds, on a hostile page), and a
    call's end or a session's close must not wait for it."""
    if renderer is not None:
        _PENDING.append((renderer, key))
    # Either the lock is free (taken here) or its holder drains after us: every leaver
    # drains, then looks again once it has let go.
    while _PENDING and _LOCK.acquire(blocking=False):
        try:
            _close_pending()
        finally:
            _LOCK.release()


def _close_pending() -> None:
    while _PENDING:  # (the lock held)
        renderer, key = _PENDING.pop()
        if renderer.key == key:
            renderer.close_held()


class _Anchor:
    pass


def _guard_exit() -> None:
    """At exit, wait for a page still rendering in an abandoned thread and let no
    other begin, before pypdfium2's objects are closed under it (by
    ``weakref.finalize``'s exit hook) and the library destroyed (by pypdfium2's): a
    segfault in the rendering thread otherwise.  Exit hooks run last registered
    first, so this one is registered after pypdfium2 is imported, and after
    ``weakref.finalize`` registered its own (a finalizer made here makes sure)."""
    global _exit_guarded
    if not _exit_guarded:
        import atexit
        import weakref

        _exit_guarded = True
        weakref.finalize(_Anchor(), int)  # (gone at once: it only registers the hook)
        # Taken for good (daemon threads waiting on it end with the process); bounded:
        # a page PDFium will not finish does not hold the exit forever.
        atexit.register(_LOCK.acquire, timeout=60)
_JPEG_QUALITY = 90
# Admission estimate of an image's prompt tokens: one per 28×28-pixel patch (the rule
# of Qwen2-VL-style models; OpenAI's tiles come out lower).  Settled with real usage.
_PATCH_PX = 28 * 28
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_MIME = {"PNG": "image/png", "JPEG": "image/jpeg"}

FRAME = struct.Struct("!II")  # pickled header length, blob length
MAX_HEADER = 1 << 20


class BadDocument(Exception):
    """The document cannot be rendered; the message says why, fit for a user."""


def tokens(width: int, height: int) -> int:
    return max(1, math.ceil(width * height / _PATCH_PX))


# --------------------------------------------------------------------------- messages


class DataURI(str):
    """A data URI made here (:func:`data_uri`): base64, so nothing in it needs JSON
    escaping."""

    __slots__ = ()


def data_uri(mime: str, data: bytes) -> str:
    return DataURI(f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}")


def page_messages(prompt: str, url: str) -> str:
    """The JSON of one page's messages: a user message with the prompt and the image."""
    if not isinstance(url, DataURI):
        return _ENCODE(_message(prompt, url))
    # JSON-escaping megabytes of base64 would take milliseconds a page to change
    # nothing: it is spliced into the skeleton's empty "url" instead.
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


# --------------------------------------------------------------------------- Pillow


def _pil() -> Any:
    from PIL import Image, ImageOps

    return Image, ImageOps


def decoded(data: bytes, max_side_px: int | None = None) -> Any:
    """The first frame, upright (EXIF orientation applied), fully decoded; a JPEG at
    the smallest power-of-two scale still at least ``max_side_px`` a side (Pillow's
    ``draft``: a 13000 × 13000 JPEG decodes in ~100 MB, not ~1.3 GB)."""
    image_mod, image_ops = _pil()
    with image_mod.open(io.BytesIO(data)) as opened:
        opened.seek(0)
        if max_side_px is not None and opened.format == "JPEG":
            opened.draft(opened.mode, (max_side_px, max_side_px))
        image = image_ops.exif_transpose(opened)
        image.load()
        if image.mode.startswith("I"):
            # 16-bit greyscale (PNG's I;16, or I): convert() to 8 bits clips at 255,
            # which turns every tone of a 16-bit scan white.  Scale instead.
            image = image.convert("I").point(lambda v: v * (1 / 256)).convert("L")
        return image


def encoded(image: Any, fmt: str) -> str:
    """``image`` as a data URI in ``fmt`` (``"jpeg"`` or ``"png"``)."""
    image_mod, _ = _pil()
    if fmt == "png":
        if image.mode not in ("RGB", "RGBA", "L", "LA"):
            image = image.convert("RGBA" if "A" in image.getbands() or "transparency" in image.info else "RGB")
        return data_uri("image/png", saved(image, "PNG", compress_level=6))
    if image.mode != "RGB":
        rgba = image.convert("RGBA")
        background = image_mod.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        image = background
    return data_uri("image/jpeg", saved(image, "JPEG", quality=_JPEG_QUALITY))


def saved(image: Any, fmt: str, **options: Any) -> bytes:
    """The encoded image.  Saved to a file with a descriptor, not a BytesIO: Pillow
    then encodes without holding the GIL, so that in a worker thread the event loop is
    not kept waiting (a page's JPEG is ~12 ms of encoding).  In memory where the system
    allows (memfd)."""
    memfd = getattr(os, "memfd_create", None)
    with (os.fdopen(memfd("polygate-page"), "w+b") if memfd else tempfile.TemporaryFile()) as out:
        image.save(out, fmt, **options)
        out.seek(0)
        return out.read()


def unaltered(fmt: str, size: tuple[int, int], max_side_px: int) -> bool:
    """An image sent as it is: a PNG or JPEG within ``max_side_px``."""
    return fmt in _MIME and max(size) <= max_side_px


def image_page(
    data: bytes, fmt: str, size: tuple[int, int], prompt: str, max_side_px: int, image_format: str
) -> tuple[str, int, int]:
    """An image's page: ``(messages JSON, width, height)``.  A PNG or JPEG within
    ``max_side_px`` goes unaltered; anything else is decoded, scaled down (aspect ratio
    kept) and re-encoded in ``image_format``."""
    width, height = size
    if unaltered(fmt, size, max_side_px):
        uri = data_uri(_MIME[fmt], data)
    else:
        image_mod, _ = _pil()
        try:
            image = decoded(data, max_side_px)
            image.thumbnail((max_side_px,) * 2, image_mod.Resampling.LANCZOS)
            width, height = image.size
            uri = encoded(image, image_format)
        except Exception as exc:
            # It opened and passed verify() but does not decode (a truncated scan, an
            # empty IDAT, a broken WebP frame, no memory for it): a bad document.
            raise BadDocument(f"the {fmt} image cannot be decoded: {type(exc).__name__}: {exc}") from None
    return page_messages(prompt, uri), width, height


# --------------------------------------------------------------------------- PDFs


def pdf_scale(width_pt: float, height_pt: float, dpi: float, max_side_px: int) -> float:
    """``dpi / 72`` pixels per point, lowered so the longer side fits ``max_side_px``
    (one scale for both axes: the aspect ratio is kept)."""
    longest = max(width_pt, height_pt, 1e-6)
    scale = min(dpi / 72.0, max_side_px / longest)
    # pypdfium2 renders ceil(side * scale) pixels, and the product can land a hair
    # above the integer (1683.78 x 2383.94 pt at 1600 px: 1601).  Down by an ulp at a
    # time until it fits: a few steps at most, the excess being rounding.
    for _ in range(64):
        if math.ceil(longest * scale) <= max_side_px:
            break
        scale = math.nextafter(scale, 0.0)
    return scale


class Renderer:
    """What one renderer holds: at most one open PDF, under the key it was given.
    :meth:`handle` answers one request; not for two threads at once."""

    def __init__(self) -> None:
        self.key: int | None = None
        self._pdf: Any = None

    def handle(self, header: tuple[Any, ...], blob: bytes) -> tuple[tuple[Any, ...], bytes]:
        """One request → its reply: ``("ok", …)`` with a blob, or ``("bad", message)``
        for a document that cannot be rendered."""
        op = header[0]
        try:
            if op == "open":  # ("open", key) + the PDF
                return ("ok", self.open(header[1], blob)), b""
            if op == "page":  # ("page", key, index, prompt, dpi, max_side_px, image_format)
                if blob:
                    self.open(header[1], blob)
                elif self.key != header[1]:
                    raise BadDocument("the PDF was closed")
                try:
                    messages, width, height = self.page(*header[2:])
                except BaseException:
                    if blob:
                        # Opened by this request: a failed reply ("bad", or "fail" for an
                        # error of ours) says the renderer holds nothing (what polygate
                        # records), so it must not.
                        self.close()
                    raise
                return ("ok", width, height), messages.encode()
            if op == "image":  # ("image", format, size, prompt, max_side_px, image_format, pixels)
                # The application's Image.MAX_IMAGE_PIXELS, which it checked the image
                # against: this fresh interpreter has Pillow's default (an application
                # that raised it for large scans had them refused here alone).
                _pil()[0].MAX_IMAGE_PIXELS = header[6]
                messages, width, height = image_page(blob, *header[1:6])
                return ("ok", width, height), messages.encode()
            if op == "drop":  # ("drop", key)
                if self.key == header[1]:
                    self.close()
                return ("ok",), b""
        except BadDocument as exc:
            return ("bad", str(exc)), b""
        raise ValueError(f"unknown renderer request {op!r}")

    def open(self, key: int, data: bytes) -> int:
        """Open ``data`` as the PDF of ``key`` (closing the one held before); its page
        count."""
        self.close()
        import pypdfium2 as pdfium

        _guard_exit()
        with _PDFIUM:
            try:
                pdf = pdfium.PdfDocument(data)
            except pdfium.PdfiumError as exc:
                reason = str(exc)
                if "Success" in reason:
                    # PDFium refused it without an error code (a document with no pages
                    # does this): its "Success" would read as nonsense.
                    reason = "PDFium gave no reason (no pages, or a damaged page tree)"
                raise BadDocument(f"the PDF cannot be opened: {reason}") from None
            try:
                count = len(pdf)
            except Exception:
                pdf.close()
                raise
            if count <= 0:
                pdf.close()
                raise BadDocument("the PDF has no pages")
            self._pdf, self.key = pdf, key
        return count

    def page(
        self, index: int, prompt: str, dpi: float, max_side_px: int, image_format: str
    ) -> tuple[str, int, int]:
        """Page ``index`` of the PDF held: ``(messages JSON, width, height)``."""
        with _PDFIUM:
            if self._pdf is None:
                raise BadDocument("the PDF was closed")
            try:
                page = self._pdf[index]
            except Exception as exc:
                raise BadDocument(f"page {index} of the PDF cannot be loaded: {exc}") from None
            try:
                width_pt, height_pt = page.get_size()
                bitmap = page.render(scale=pdf_scale(width_pt, height_pt, dpi, max_side_px))
                try:
                    # A copy: an image may share the bitmap's buffer (RGBA, L), and the
                    # bitmap is freed below.  A memory copy next to a render is cheap.
                    image = bitmap.to_pil().copy()
                finally:
                    bitmap.close()
            except Exception as exc:
                raise BadDocument(f"page {index} of the PDF cannot be rendered: {exc}") from None
            finally:
                page.close()
        uri = encoded(image, image_format)  # outside the lock
        width, height = image.size
        return page_messages(prompt, uri), width, height

    def close(self) -> None:
        with _PDFIUM:
            self.close_held()

    def close_held(self) -> None:
        """:meth:`close`, with the PDFium lock already held."""
        if self._pdf is not None:
            self._pdf.close()
        self._pdf = self.key = None


def answer(renderer: Renderer, header: tuple[Any, ...], blob: bytes) -> tuple[tuple[Any, ...], bytes]:
    """``renderer.handle``, with anything else it raises — a bug, not the document —
    as a ``("fail", "Type: message")`` reply: what went wrong, not where."""
    try:
        return renderer.handle(header, blob)
    except Exception as exc:
        return ("fail", f"{type(exc).__name__}: {exc}"), b""


# --------------------------------------------------------------------------- the process


def _read_exactly(source: Any, size: int) -> bytes | None:
    """``size`` bytes from the raw file ``source``; None at end of file before the
    first byte."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = source.readinto(view[got:])
        if not n:
            if got == 0:
                return None
            raise EOFError("end of file inside a frame")
        got += n
    return bytes(buf)


def serve(idle_exit_s: float) -> None:
    """A renderer process's loop: requests on stdin, replies on stdout, until stdin
    closes or (where ``select`` works on pipes) ``idle_exit_s`` pass without a request.
    polygate stops using an idle renderer well before that, so it never sends to one
    that could be exiting."""
    with (
        open(sys.stdin.fileno(), "rb", buffering=0, closefd=False) as source,
        open(os.dup(sys.stdout.fileno()), "wb") as sink,  # buffered: write() writes it all
    ):
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr
        # A fresh interpreter: the application's warning filters (and -W, and
        # logging.captureWarnings) never reach it, so Pillow's warnings about a sloppy
        # file it reads anyway ("Tag data larger than file") were printed raw on the
        # application's stderr.  The parent checked the file; nothing here to act on.
        warnings.simplefilter("ignore")
        _exit_with_parent(source.fileno())
        _serve(source, sink, idle_exit_s)


def _exit_with_parent(fd: int) -> None:
    """Exit the moment the parent is gone (its end of our stdin closed: it exited, was
    killed, or closed us), even in the middle of a page: the loop only reads between
    requests, and PDFium can take minutes on one hostile page, at full CPU, for
    nobody.  A daemon thread polls for the hang-up alone (no event asked for: POLLHUP
    and POLLERR are always reported, data on the pipe is not).  Not PR_SET_PDEATHSIG:
    the process is started from a worker thread, whose exit would fire it."""
    poll = getattr(select, "poll", None)
    if poll is None:  # (Windows: the loop's read notices, between requests)
        return

    def watch() -> None:
        poller = poll()
        poller.register(fd, 0)
        while True:
            for _, events in poller.poll():
                if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)

    threading.Thread(target=watch, name="polygate-renderer-parent", daemon=True).start()


def _serve(source: Any, sink: Any, idle_exit_s: float) -> None:
    renderer = Renderer()
    while True:
        if sys.platform != "win32":
            ready, _, _ = select.select([source], [], [], idle_exit_s)
            if not ready:
                return
        head = _read_exactly(source, FRAME.size)
        if head is None:
            return
        header_len, blob_len = FRAME.unpack(head)
        if header_len > MAX_HEADER:
            raise ValueError("renderer request header too large")
        header = pickle.loads(_read_exactly(source, header_len) or b"")
        blob = (_read_exactly(source, blob_len) or b"") if blob_len else b""
        reply, out = answer(renderer, header, blob)
        del blob
        packed = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        sink.write(FRAME.pack(len(packed), len(out)) + packed)
        sink.write(out)
        sink.flush()
