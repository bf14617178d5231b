"""OCR's renderer processes (polygate/_ocr_renderers.py): reuse, documents sent once
per renderer, cancellation kills, a renderer that dies, idle retirement, the session's
close, and a script without a ``__main__`` guard running once.

Misbehaving renderers come from a stand-in for ``_ocr_render.py`` (the file a renderer
process loads): the real module, whose pages die, hang or print to stdout when the
prompt says so.  Tests that cancel a renderer mid-work run on the real clock (under a
zero-threshold ``MockClock`` no virtual time passes while a renderer works)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import trio
import trio.testing

import polygate
from polygate import _ocr_render, _ocr_renderers
from polygate.testing import FakeUpstream, Reply, Router

from .test_ocr import SIZES, image_bytes, make_pdf, ocr_settings

STAND_IN = """
import importlib.util, os, sys, time

_spec = importlib.util.spec_from_file_location("_polygate_ocr_render_real", {real!r})
_real = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _real
_spec.loader.exec_module(_real)


class Renderer(_real.Renderer):
    def page(self, index, prompt, *rest):
        if prompt == "die":
            os._exit(3)
        if prompt == "hang":
            time.sleep(120)
        if prompt == "chatter":
            print("noise on stdout", flush=True)
            os.write(1, b"more noise on fd 1\\n")
        return super().page(index, prompt, *rest)


_real.Renderer = Renderer
serve = _real.serve
"""


def _render_with(source: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renderer processes run ``source`` (a stand-in around the real module) as their
    script."""
    path.write_text(source.format(real=os.path.abspath(_ocr_render.__file__)))
    monkeypatch.setattr(_ocr_renderers, "_RENDER_FILE", str(path))


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _render_with(STAND_IN, tmp_path / "stand_in_render.py", monkeypatch)


def renderers(s: polygate.Session) -> _ocr_renderers.Renderers:
    return s._runtime.renderers


async def test_a_document_crosses_to_a_renderer_once(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="x"))
    settings = ocr_settings(dpi=72, max_concurrent_pages=1)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.ocr(make_pdf([(100, 100)] * 6))
        await s.ocr(make_pdf([(120, 100)] * 2))
        stats = renderers(s).statistics()
    # one renderer served both calls; each document went to it once (its opening),
    # not once per page
    assert (stats.started, stats.documents_sent) == (1, 2)
    assert len(up.requests) == 8


async def test_renderers_are_bounded_by_the_cpus(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_ocr_renderers, "_cores", lambda: 2)
    up = FakeUpstream(Reply(text="x"))
    settings = ocr_settings(dpi=72, max_concurrent_pages=8)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf([(100, 100)] * 8))
        stats = renderers(s).statistics()
    assert len(r.pages) == 8
    assert stats.started <= 2 and stats.documents_sent <= 2


async def test_the_session_stops_its_renderers(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        await s.ocr(make_pdf([(100, 100)] * 4))
        pool = renderers(s)
        assert pool.statistics().alive >= 1
    stats = pool.statistics()
    assert stats.alive == 0 and stats.stopped == stats.started
    with pytest.raises(polygate.PolygateError, match="closed"):
        await s.ocr(make_pdf([(100, 100)]))


async def test_rendering_takes_no_virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="x", first_token_s=2.0))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        start = trio.current_time()
        r = await s.ocr(make_pdf([(100, 100)] * 3))  # a renderer starts, then 3 pages
        assert trio.current_time() - start == pytest.approx(2.0)
    assert r.call_stats.total_latency_ms == pytest.approx(2000.0)


async def test_idle_renderers_retire(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_ocr_renderers, "IDLE_S", 0.0)
    up = FakeUpstream(Reply(text="x"))
    settings = ocr_settings(dpi=72, max_concurrent_pages=1)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.ocr(make_pdf([(100, 100)]))
        await s.ocr(make_pdf([(100, 100)]))
        stats = renderers(s).statistics()
    # every checkout found the renderer idle past IDLE_S: killed, a new one started
    assert (stats.started, stats.stopped) == (4, 3)  # each call: its opening, then its page


async def test_a_renderer_killed_while_idle_is_replaced(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="x"))
    settings = ocr_settings(dpi=72, max_concurrent_pages=1)
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        await s.ocr(make_pdf([(100, 100)]))
        [worker] = renderers(s)._pool("process").idle
        assert isinstance(worker, _ocr_renderers._ProcessWorker)
        worker.process.send_signal(signal.SIGKILL)  # the OOM killer, say
        await worker.process.wait()
        r = await s.ocr(make_pdf([(100, 100)] * 2))
        stats = renderers(s).statistics()
    assert len(r.pages) == 2
    assert (stats.started, stats.stopped) == (2, 1)


@pytest.mark.usefixtures("stand_in")
async def test_a_renderer_that_dies_fails_the_page_with_config_error() -> None:
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match=r"renderer process died \(exit status 3\)"):
            await s.ocr(make_pdf([(100, 100)] * 2), prompt="die")
        r = await s.ocr(make_pdf([(100, 100)]))  # the next call starts a new renderer
        stats = renderers(s).statistics()
    assert r.text == "x"
    assert stats.alive == stats.started - stats.stopped
    assert up.requests and all("die" not in q.body["messages"][0]["content"][0]["text"]
                               for q in up.requests)


#: A renderer that dies part-way through writing its reply (the OOM killer, a SIGKILL
#: from outside, as a page larger than the pipe is written in pieces).
CUT_SHORT = """
import importlib.util, os, pickle, sys

_spec = importlib.util.spec_from_file_location("_polygate_ocr_render_real", {real!r})
_real = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _real
_spec.loader.exec_module(_real)
_answer = _real.answer


def _serve(source, sink, idle_exit_s):
    renderer = _real.Renderer()
    while True:
        head = _real._read_exactly(source, _real.FRAME.size)
        if head is None:
            return
        header_len, blob_len = _real.FRAME.unpack(head)
        header = pickle.loads(_real._read_exactly(source, header_len))
        blob = (_real._read_exactly(source, blob_len) or b"") if blob_len else b""
        reply, out = _answer(renderer, header, blob)
        packed = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _real.FRAME.pack(len(packed), len(out))
        if header[0] == "page" and header[3] == "cut-blob":
            sink.write(frame + packed + out[: len(out) // 2])
            sink.flush()
            os._exit(9)
        if header[0] == "page" and header[3] == "cut-header":
            sink.write(frame + packed[:3])
            sink.flush()
            os._exit(9)
        sink.write(frame + packed + out)
        sink.flush()


_real._serve = _serve
serve = _real.serve
"""


@pytest.fixture
def cut_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _render_with(CUT_SHORT, tmp_path / "cut_short_render.py", monkeypatch)


@pytest.mark.usefixtures("cut_short")
@pytest.mark.parametrize("how", ["cut-blob", "cut-header"])
async def test_a_renderer_that_dies_mid_reply_fails_the_page_with_config_error(how: str) -> None:
    """Review: a reply cut in its page's bytes was taken for a whole one (half a page's
    messages spliced into the request: a 400 from the upstream, billed), and one cut in
    its header raised pickle's own ``UnpicklingError``.  Either is the renderer's death,
    said as such, and nothing is sent."""
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        with pytest.raises(polygate.ConfigError, match=r"renderer process died \(exit status 9\)"):
            await s.ocr(make_pdf([(300, 300)]), prompt=how)
        assert (await s.ocr(make_pdf([(100, 100)]))).text == "x"  # a new renderer
    assert len(up.requests) == 1


@pytest.mark.usefixtures("stand_in")
async def test_a_cancelled_call_kills_its_renderer_mid_page() -> None:
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        await s.ocr(make_pdf([(100, 100)]))  # renderers started: the next call is warm
        start = time.monotonic()
        with pytest.raises(polygate.DeadlineExceeded):
            await s.ocr(make_pdf([(100, 100)] * 3), prompt="hang", call_deadline_s=1.0)
        took = time.monotonic() - start
        stats = renderers(s).statistics()
        # every renderer that was hanging on a page was killed and reaped before the
        # call returned; only idle ones are left
        assert stats.alive == stats.idle
        assert stats.stopped >= 1
    assert took < 10  # not the 120 s a hanging page would take
    assert up.requests == [up.requests[0]]  # no hanging page was sent


async def test_a_cancelled_start_leaves_no_process() -> None:
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        for after in (0.0, 0.005, 0.02, 0.05):
            with trio.move_on_after(after):
                await s.ocr(make_pdf([(100, 100)]))
            stats = renderers(s).statistics()
            assert stats.alive == stats.idle  # killed, or started and parked: never lost


@pytest.mark.usefixtures("stand_in")
async def test_what_a_renderer_prints_does_not_corrupt_its_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(dpi=72), transport=Router({"a": up})) as s:
        r = await s.ocr(make_pdf([(100, 100)] * 2), prompt="chatter")
    assert [p.text for p in r.pages] == ["x", "x"]


async def test_only_images_to_convert_need_a_renderer(autojump_clock: trio.testing.MockClock) -> None:
    up = FakeUpstream(Reply(text="x"))
    async with polygate.session(ocr_settings(max_side_px=64), transport=Router({"a": up})) as s:
        await s.ocr(image_bytes("PNG", (40, 30)))
        await s.ocr(image_bytes("JPEG", (64, 30)))
        assert renderers(s).statistics().started == 0  # sent as they are
        await s.ocr(image_bytes("WEBP", (40, 30)))
        await s.ocr(image_bytes("PNG", (65, 30)))
        stats = renderers(s).statistics()
    assert stats.started == 1 and stats.documents_sent == 0  # images are not kept
    assert len(up.requests) == 4


SCRIPT = """
import io, sys
import pypdfium2 as pdfium
import trio
import polygate
from polygate.testing import FakeUpstream, Reply, Router

with open(sys.argv[1], "a") as log:
    log.write("ran\\n")  # top-level code: a re-import of __main__ would run it again


def pdf():
    doc = pdfium.PdfDocument.new()
    doc.new_page(100, 100).close()
    out = io.BytesIO()
    doc.save(out)
    doc.close()
    return out.getvalue()


async def main():
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(text="ok"))})) as s:
        r = await s.ocr(pdf())
    print(r.text)


trio.run(main)  # no `if __name__ == "__main__":` guard
"""


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "runs.log"
    done = subprocess.run(
        [sys.executable, str(script), str(log)], capture_output=True, text=True, timeout=100,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert log.read_text() == "ran\n"


async def test_an_idle_renderer_process_exits_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # the backstop for a session that never comes back: no request for a while, exit
    monkeypatch.setattr(_ocr_renderers, "_exit_after", lambda: 0.2)
    worker = await _ocr_renderers._ProcessWorker.start()
    with trio.fail_after(30):
        assert await worker.process.wait() == 0
    await worker.discard()


async def test_a_renderer_process_exits_when_polygate_goes_away() -> None:
    # the parent gone (its end of the pipe closed): the renderer exits, idle or not
    worker = await _ocr_renderers._ProcessWorker.start()
    assert worker.process.stdin is not None
    await worker.process.stdin.aclose()
    with trio.fail_after(30):
        assert await worker.process.wait() == 0
    await worker.discard()


async def test_a_renderer_exits_when_polygate_goes_away_mid_page(stand_in: None) -> None:
    """Outside review: a renderer noticed its parent gone only between pages, so a
    process killed (SIGTERM, SIGKILL: docker stop, systemd) left it rendering a hostile
    page at full CPU for minutes, for nobody.  The parent's end of the pipe closing
    (what the kernel does when it dies) ends it mid-page."""
    worker = await _ocr_renderers._ProcessWorker.start()
    assert worker.process.stdin is not None
    header = pickle.dumps(("page", 1, 0, "hang", 72.0, 2048, "jpeg"))
    pdf = make_pdf([(100, 100)])
    await worker.process.stdin.send_all(_ocr_render.FRAME.pack(len(header), len(pdf)) + header + pdf)
    with trio.move_on_after(0.5):  # (mid-page: hanging in its 120 s sleep)
        await worker.process.wait()
    assert worker.process.returncode is None
    await worker.process.stdin.aclose()
    with trio.fail_after(5):
        assert await worker.process.wait() == 0
    await worker.discard()


PIXELS_TOLD = """
import importlib.util, sys

_spec = importlib.util.spec_from_file_location("_polygate_ocr_render_real", {real!r})
_real = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _real
_spec.loader.exec_module(_real)


def image_page(*args):
    from PIL import Image
    raise _real.BadDocument(f"pixels={{Image.MAX_IMAGE_PIXELS}}")


_real.image_page = image_page
serve = _real.serve
"""


async def test_the_applications_pixel_limit_reaches_the_renderer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside review: an application that raised Pillow's MAX_IMAGE_PIXELS for large
    scans had them OCR'd in thread mode and refused in process mode (the renderer, a
    fresh interpreter, kept Pillow's default)."""
    from PIL import Image

    _render_with(PIXELS_TOLD, tmp_path / "pixels_render.py", monkeypatch)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300_000_000)
    async with polygate.session(ocr_settings(max_side_px=64), transport=Router({"a": FakeUpstream(Reply())})) as s:
        with pytest.raises(polygate.ConfigError, match="pixels=300000000"):
            await s.ocr(image_bytes("PNG", (100, 100)))  # (over max_side_px: converted there)


@pytest.mark.parametrize("render_in", ["process", "thread"])
async def test_a_renderer_bug_is_a_polygate_error_without_a_traceback(
    autojump_clock: trio.testing.MockClock, render_in: str
) -> None:
    async with polygate.session(ocr_settings(), transport=Router({"a": FakeUpstream(Reply())})) as s:
        with pytest.raises(polygate.PolygateError) as info:
            await renderers(s).request(render_in, 1, ("no such request",), b"")
        assert not isinstance(info.value, polygate.ConfigError)
        assert str(info.value) == (
            "the OCR renderer failed: ValueError: unknown renderer request 'no such request'"
        )
        assert renderers(s).statistics(render_in).idle == 1  # it answered: kept


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no process priorities here")
async def test_renderers_yield_the_cpu_to_the_event_loop() -> None:
    worker = await _ocr_renderers._ProcessWorker.start()
    try:
        with trio.fail_after(30):
            await worker.request(("drop", 0), b"")  # it has booted
        assert os.getpriority(os.PRIO_PROCESS, worker.process.pid) == 19  # the lowest (nice caps at 19)
    finally:
        await worker.discard()


async def test_a_thread_renderer_cut_short_before_its_thread_started_is_closed() -> None:
    """review: the request marked the renderer busy before trio started its thread; a
    cancellation at that point (trio checks for one first) left no thread to close it,
    and discard() left the closing to that thread: its open PDF went to the garbage
    collector's finaliser, outside the lock every PDFium call takes."""
    worker = _ocr_renderers._ThreadWorker()
    closed: list[bool] = []
    real_close = worker._renderer.close_held

    def close() -> None:
        closed.append(True)
        real_close()

    worker._renderer.close_held = close  # type: ignore[method-assign]
    with trio.CancelScope() as scope:
        scope.cancel()
        await worker._exchange(("drop", 1), b"")
    assert scope.cancelled_caught
    await worker.discard()
    assert closed == [True]


async def test_a_thread_that_starts_after_its_renderer_was_discarded_leaves_it_alone() -> None:
    """The other order: discard() closed an idle renderer, then the thread of the request
    cut short begins: it must not touch the closed renderer (nor close it twice)."""
    worker = _ocr_renderers._ThreadWorker()
    calls: list[str] = []
    worker._renderer.handle = lambda *args: calls.append("handle") or (("ok",), b"")  # type: ignore[method-assign]
    worker._renderer.close_held = lambda: calls.append("close")  # type: ignore[method-assign]
    await worker.discard()
    assert calls == ["close"]
    await trio.to_thread.run_sync(worker._handle, ("drop", 1), b"")
    assert calls == ["close"]
    assert not worker._busy


def _slow_page(monkeypatch: pytest.MonkeyPatch, index: int, seconds: float) -> None:
    """Page ``index`` renders for ``seconds``, holding the PDFium lock as a hostile page
    does (PDFium cannot be interrupted)."""
    real = _ocr_render.Renderer.page

    def page(self: _ocr_render.Renderer, at: int, *args: object) -> tuple[str, int, int]:
        if at == index:
            with _ocr_render._PDFIUM:
                time.sleep(seconds)
        return real(self, at, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_ocr_render.Renderer, "page", page)


async def test_a_call_cut_while_a_thread_renders_ends_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """review: in thread mode, a call cut by its deadline while one of its pages held
    the PDFium lock (2.5 s on a hostile page) returned seconds late: the renderers
    that had finished its other pages were told to close the document, shielded,
    and that close waited for the lock.  Closing never waits for it now; the lock's
    next leaver closes what was asked for."""
    _slow_page(monkeypatch, 2, 2.0)
    async with polygate.session(ocr_settings(render_in="thread", max_concurrent_pages=2),
                                transport=Router({"a": FakeUpstream(Reply(text="x"))})) as s:
        start = time.monotonic()
        with pytest.raises(polygate.DeadlineExceeded):
            await s.ocr(make_pdf(SIZES[:3]), call_deadline_s=0.5)
        assert time.monotonic() - start < 1.3
        pool = renderers(s)._pools["thread"]
        held = [w for w in pool.everyone if isinstance(w, _ocr_renderers._ThreadWorker)]
        await trio.sleep(2.5)  # the slow page ends; whoever leaves the lock closes the rest
        assert all(w._renderer.key is None for w in held)
        assert not _ocr_render._PENDING


@pytest.mark.parametrize("render_in", ["process", "thread"])
async def test_a_page_that_fails_after_its_document_opened_leaves_it_closed(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, render_in: str
) -> None:
    """review: a page request that carried the document opened it, then failed on its
    page; polygate recorded the renderer as holding nothing, so the call's end never
    told it to close the document (and statistics().holding said 0)."""
    from polygate import _ocr_document

    from .test_ocr import _pdf_with_a_broken_second_page

    keys: list[int] = []

    def new_key() -> int:
        keys.append(_ocr_renderers.new_key())
        return keys[-1]

    monkeypatch.setattr(_ocr_document, "new_key", new_key)
    async with polygate.session(ocr_settings(render_in=render_in, max_concurrent_pages=2),
                                transport=Router({"a": FakeUpstream(Reply(text="x"))})) as s:
        for _ in range(5):  # which renderer gets the bad page is the scheduler's choice
            with pytest.raises(polygate.ConfigError, match="page 1"):
                await s.ocr(_pdf_with_a_broken_second_page())
            assert renderers(s).statistics(render_in).holding == 0
            for worker in list(renderers(s)._pools[render_in].idle):
                # None still holds the document: a page of it without its bytes fails.
                reply, _ = await worker.request(("page", keys[-1], 0, "p", 72.0, 100, "jpeg"), b"")
                assert reply[0] == "bad", reply


def _slow_pdf(rectangles: int) -> bytes:
    """One page of ``rectangles`` filled squares: PDFium takes ~1 s a million to render it
    here, and cannot be interrupted."""
    import zlib

    from .test_ocr import _pdf_of

    ops = zlib.compress(b"".join(b"%d %d 5 5 re f\n" % (i % 190, i * 7 % 190) for i in range(rectangles)), 9)
    return _pdf_of([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] /Contents 4 0 R >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(ops) + ops + b"\nendstream",
    ])


_ENDS_WHILE_RENDERING = textwrap.dedent('''
    import sys, trio, polygate
    from polygate.testing import FakeUpstream, Reply, Router

    async def main():
        scope = polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                               ocr=polygate.Ocr(render_in="thread"))
        async with polygate.session(polygate.Settings(scopes={"ocr": scope}),
                                    transport=Router({"a": FakeUpstream(Reply(text="x"))})) as s:
            try:
                await s.ocr(open(sys.argv[1], "rb").read(), call_deadline_s=0.3)
            except polygate.DeadlineExceeded:
                print("cut", flush=True)

    trio.run(main)
    print("bye", flush=True)
''')


def test_a_program_that_ends_while_a_cut_page_renders_exits_cleanly(tmp_path: Path) -> None:
    """review: in thread mode, a program whose call was cut while PDFium rendered a
    page (its thread abandoned, as documented) ended with SIGSEGV, three times in
    three: pypdfium2's exit hook destroyed the library under the rendering thread.
    polygate's own exit hook, run first, waits for the page."""
    document = tmp_path / "slow.pdf"
    document.write_bytes(_slow_pdf(1_500_000))
    script = tmp_path / "ends.py"
    script.write_text(_ENDS_WHILE_RENDERING)
    done = subprocess.run([sys.executable, str(script), str(document)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.split() == ["cut", "bye"], done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_a_page_that_fails_for_any_reason_closes_what_its_request_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """review of the fix above: an error of ours after the open (the encoder's
    OSError: out of file descriptors) is a "fail" reply, recorded as holding nothing
    too, and left the document open."""

    def encoded(image: object, fmt: str) -> str:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_ocr_render, "encoded", encoded)
    renderer = _ocr_render.Renderer()
    reply, _ = _ocr_render.answer(renderer, ("page", 7, 0, "p", 72.0, 100, "jpeg"), make_pdf(SIZES[:2]))
    assert reply[0] == "fail"
    assert renderer.key is None


async def test_a_session_cancelled_from_outside_discards_every_idle_thread_renderer() -> None:
    """Review: a session left by a cancellation from outside discarded its first idle
    thread renderer only (the discard's checkpoint raised the cancellation, which cut
    the close's loop and skipped the cache's and telemetry's close after it); the others
    kept their document open until collected.  The close is shielded, each step
    bounded."""
    with trio.CancelScope() as outer:
        async with polygate.session(ocr_settings(render_in="thread"),
                                    transport=Router({"a": FakeUpstream(Reply(text="x"))})) as s:
            await s.ocr(make_pdf(SIZES[:3]))
            idle = [w for w in renderers(s)._pools["thread"].idle
                    if isinstance(w, _ocr_renderers._ThreadWorker)]
            outer.cancel()
            await trio.sleep(1)
    assert len(idle) >= 2 and all(w._abandoned for w in idle)


def _sloppy_jpeg() -> bytes:
    """A JPEG whose EXIF has a tag whose count points past its segment (a camera's or
    an editor's sloppy EXIF): Pillow warns "Tag data larger than file", and reads it."""
    import io
    import struct

    from PIL import Image

    image = Image.new("RGB", (160, 120), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010E] = "hello world description"
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif.tobytes())
    data = bytearray(out.getvalue())
    tiff = data.find(b"Exif\x00\x00") + 6
    (count,) = struct.unpack_from(">H", data, tiff + 8)
    for k in range(count):
        at = tiff + 10 + 12 * k
        if struct.unpack_from(">H", data, at)[0] == 0x010E:
            struct.pack_into(">I", data, at + 4, 5000)
    return bytes(data)


async def test_a_renderers_warnings_reach_no_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    """Outside review (logs): a renderer is a fresh interpreter, which the
    application's warning filters (its ``-W``, ``logging.captureWarnings``) never
    reach: Pillow's warning about the file it read printed raw on the application's
    stderr, each time a renderer started, with the application silencing warnings."""
    import warnings

    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="v", base_url="http://v/v1", model="m")],
        ocr=polygate.Ocr(render_in="process", max_side_px=64),
    )})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        async with polygate.session(settings, transport=Router({"v": FakeUpstream(Reply(text="page"))})) as s:
            assert (await s.ocr(_sloppy_jpeg())).text == "page"
    out, err = capfd.readouterr()
    assert out == "" and err == "", err


_ZIPPED_OCR = textwrap.dedent("""
    import sys, trio, polygate
    from polygate.testing import FakeUpstream, Reply, Router
    assert ".zip" in polygate.__file__, polygate.__file__
    document = open(sys.argv[1], "rb").read()
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", model="m")])})

    async def main():
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(text="page"))})) as s:
            print((await s.ocr(document)).text)

    trio.run(main)
""")


def test_pdfs_render_when_polygate_is_imported_from_a_zip(tmp_path: Path) -> None:
    """Review (interpreter flags): imported from a zip (a zipapp, a zipped vendored
    tree), every PDF failed "the OCR renderer process died": the renderer loaded
    ``_ocr_render.py`` by its path, and a path inside a zip is no file."""
    import zipfile

    package = Path(polygate.__file__).parent
    archive = tmp_path / "polygate.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for path in package.rglob("*.py"):
            z.write(path, path.relative_to(package.parent))
    (tmp_path / "doc.pdf").write_bytes(make_pdf([(612, 792)]))
    (tmp_path / "run.py").write_text(_ZIPPED_OCR)
    env = {**os.environ, "PYTHONPATH": str(archive)}
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "doc.pdf")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "page"
