"""Review finding (failed on main f431ce0, fixed since), Low-Medium: an OCR call opens its
document (file read, PDF parse, under the process-wide PDFium lock) *before* its
logical call and deadline begin, in a thread that cannot be abandoned
(polygate/_ocr.py:109, ``run_sync(open_document, ...)``; the CallContext and its
``started_at`` come later, :135).  While other calls render pages (they hold
``_PDFIUM`` for each render, _ocr_document.py:162/187), a new call waits for the lock
outside its deadline and deaf to cancellation; its ``total_latency_ms`` leaves the wait
out.  docs/ocr.md: "one deadline over everything (rendering included)"; SPEC §8: one
deadline over the whole tree.

The other call's long render is simulated (real clock, loopback-free fake transport)
with each renderer: ``render_in="thread"`` by holding the PDFium lock from a thread
for 1.5 s; ``render_in="process"`` (renderer processes, since) by holding every
renderer of the session for 1.5 s, as other calls' pages would.

Run: python -m pytest tests/interplay/test_f_ocr_open_outside_deadline.py -q
"""

from __future__ import annotations

import threading
import time

import pytest
import trio

import polygate
from polygate import _ocr_render
from polygate.testing import FakeUpstream, Reply, Router

from ..conftest import SECRET
from ..test_ocr import make_pdf


@pytest.mark.parametrize("render_in", ["thread", "process"])
async def test_the_deadline_covers_opening_the_document(render_in: str) -> None:
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        ocr=polygate.Ocr(render_in=render_in),
    )})
    pdf = make_pdf([(200, 100)])

    def other_call_renders() -> None:  # another OCR call's long page render
        with _ocr_render._PDFIUM:
            time.sleep(1.5)

    async def other_calls_hold_every_renderer() -> None:
        pool = s._runtime.renderers._pool("process")
        async with trio.open_nursery() as nursery:
            for _ in range(int(pool.limiter.total_tokens)):
                nursery.start_soon(hold, pool.limiter)

    async def hold(limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            await trio.sleep(1.5)

    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(text="x"))})) as s:
        async with trio.open_nursery() as nursery:
            if render_in == "thread":
                thread = threading.Thread(target=other_call_renders)
                thread.start()
            else:
                nursery.start_soon(other_calls_hold_every_renderer)
            await trio.sleep(0.05)
            start = trio.current_time()
            with pytest.raises(polygate.DeadlineExceeded) as info:
                # Was: an answer after ~1.5 s, total_latency_ms ≈ a few ms.
                await s.ocr(pdf, call_deadline_s=0.5)
            ended = trio.current_time() - start
            if render_in == "thread":
                await trio.to_thread.run_sync(thread.join)
    assert 0.5 <= ended < 1.0
    assert info.value.call_stats is not None
    assert info.value.call_stats.total_latency_ms >= 500
