"""Review finding (failed on main f431ce0, fixed since), Low-Medium: an OCR call opens its
document (file read, PDF parse, under the process-wide PDFium lock) *before* its
logical call and deadline begin, in a thread that cannot be abandoned
(polygate/_ocr.py:109, ``run_sync(open_document, ...)``; the CallContext and its
``started_at`` come later, :135).  While other calls render pages (they hold
``_PDFIUM`` for each render, _ocr_document.py:162/187), a new call waits for the lock
outside its deadline and deaf to cancellation; its ``total_latency_ms`` leaves the wait
out.  docs/ocr.md: "one deadline over everything (rendering included)"; SPEC §8: one
deadline over the whole tree.

The other call's long render is simulated by holding the lock from a thread for 1.5 s
(real clock, loopback-free fake transport).

Run: python -m pytest tests/interplay/test_f_ocr_open_outside_deadline.py -q
"""

from __future__ import annotations

import threading
import time

import pytest
import trio

import polygate
from polygate import _ocr_document
from polygate.testing import FakeUpstream, Reply, Router

from ..conftest import SECRET
from ..test_ocr import make_pdf


async def test_the_deadline_covers_opening_the_document() -> None:
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)]
    )})
    pdf = make_pdf([(200, 100)])

    def other_call_renders() -> None:  # another OCR call's long page render
        with _ocr_document._PDFIUM:
            time.sleep(1.5)

    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(text="x"))})) as s:
        thread = threading.Thread(target=other_call_renders)
        thread.start()
        await trio.sleep(0.05)
        start = trio.current_time()
        with pytest.raises(polygate.DeadlineExceeded) as info:
            # Was: an answer after ~1.5 s, total_latency_ms ≈ a few ms.
            await s.ocr(pdf, call_deadline_s=0.5)
        ended = trio.current_time() - start
        await trio.to_thread.run_sync(thread.join)
    assert 0.5 <= ended < 1.0
    assert info.value.call_stats is not None
    assert info.value.call_stats.total_latency_ms >= 500
