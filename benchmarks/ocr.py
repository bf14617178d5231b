"""OCR of a 20-page PDF against a zero-delay loopback upstream: wall time, and the
event loop's longest stall while the pages render.

The FakeUpstream server runs in its own process (so its JSON parsing of 20 page images
is not on this loop).  The PDF is generated here with PDFium: US-letter pages of 45
lines of Helvetica text each.  Measured side by side, in rounds (the first one — the
imports, and the renderer processes starting — is reported apart):

* **ocr**: ``session.ocr(pdf)`` with the defaults (renderer processes, 150 dpi, JPEG,
  4 pages at once); the same with ``render_in="thread"`` (the pages rendered in worker
  threads of this process: the design before renderer processes); and with
  ``image_format="png"``;
* **render only, in a thread**: the same pages rendered and encoded one after another
  in a worker thread, no network — the floor a sequential renderer would need;
* **render on the loop**: the same rendering done synchronously in the trio thread,
  one page per task step — what polygate avoids; its stall is the cost of one page.

The stall is measured two ways.  A probe task sleeps 1 ms in a loop and records how
late it wakes: the stall as the loop lives it, which on a busy machine includes the
OS preempting the process (the same probe on an otherwise idle loop gives that noise
floor).  Beside it, how much of that worst wake-up the loop's thread spent runnable
but waiting for a CPU (``/proc/self/task/<id>/schedstat``, Linux): the part of the
stall that is the OS's scheduling (on 2 cores: of the renderer processes too), not a
lock or the GIL; and how much of it was the cyclic garbage collector (a full
collection of this process's ~50,000 objects takes ~20 ms here, whatever runs).  An
instrument times every task step in CPU time of the loop's thread
(``time.thread_time``): the loop's own work per step, free of preemption.

    python benchmarks/ocr.py              # 20 pages, 5 rounds
    python benchmarks/ocr.py --gc-freeze  # gc.freeze() after the first round
    python benchmarks/ocr.py --quick      # 4 pages, 1 round (CI smoke)

``--gc-freeze`` leaves what exists after the first round (imports, sessions) out of
the collector's scans, as a latency-minded application may do: the full collections
that otherwise land in some rounds' worst stall then cost well under a millisecond.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_raw
import trio

import polygate
from polygate import _ocr_render

from _common import fake_server, machine, median, write_result

LINE = "the quick brown fox jumps over the lazy dog, 0123456789 and some more words"


def make_pdf(pages: int) -> bytes:
    pdf = pdfium.PdfDocument.new()
    font = pdfium_raw.FPDFText_LoadStandardFont(pdf.raw, b"Helvetica")
    for number in range(pages):
        page = pdf.new_page(612, 792)
        for line in range(45):
            obj = pdfium_raw.FPDFPageObj_CreateTextObj(pdf.raw, font, 11.0)
            text = (f"Page {number + 1}, line {line + 1}: {LINE}\0").encode("utf-16-le")
            wide = ctypes.cast(ctypes.c_char_p(text), ctypes.POINTER(pdfium_raw.FPDF_WCHAR))
            pdfium_raw.FPDFText_SetText(obj, wide)
            pdfium_raw.FPDFPageObj_Transform(obj, 1, 0, 0, 1, 40, 750 - line * 15)
            pdfium_raw.FPDFPage_InsertObject(page.raw, obj)
        pdfium_raw.FPDFPage_GenerateContent(page.raw)
        page.close()
    out = io.BytesIO()
    pdf.save(out)
    pdf.close()
    return out.getvalue()


class StepTimer(trio.abc.Instrument):
    """The longest task step, in CPU seconds of the loop's thread."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._started: float | None = None  # added mid-step: the first end has no start

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._started is not None:
            self.longest = max(self.longest, time.thread_time() - self._started)
            self._started = None


def _schedstat_path() -> str | None:
    try:
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        with open(path) as f:
            f.read()
        return path
    except OSError:
        return None


def _run_queue_wait(path: str | None) -> float:
    """Seconds the calling thread has spent runnable, waiting for a CPU (0 where the
    system does not say)."""
    if path is None:
        return 0.0
    with open(path) as f:
        return int(f.read().split()[1]) / 1e9


class GcClock:
    """Seconds spent in the cyclic garbage collector so far (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._started


GC_CLOCK = GcClock()
gc.callbacks.append(GC_CLOCK)


async def with_stall_probe(
    work: Callable[[], Awaitable[Any]],
) -> tuple[float, float, float, float, float]:
    """(wall seconds of ``work``, the probe's longest stall in ms, the longest task
    step in CPU ms, the parts of the longest stall spent waiting for a CPU and in the
    garbage collector, in ms) while it ran."""
    worst = worst_queued = worst_gc = 0.0
    done = trio.Event()
    schedstat = _schedstat_path()

    async def probe(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal worst, worst_queued, worst_gc
        task_status.started()  # runs on to its first sleep before ``work`` starts
        while not done.is_set():
            q0, g0 = _run_queue_wait(schedstat), GC_CLOCK.total
            t0 = time.perf_counter()
            await trio.sleep(0.001)
            late = time.perf_counter() - t0 - 0.001
            if late > worst:
                worst, worst_queued = late, _run_queue_wait(schedstat) - q0
                worst_gc = GC_CLOCK.total - g0

    steps = StepTimer()
    trio.lowlevel.add_instrument(steps)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(probe)
            t0 = time.perf_counter()
            await work()
            wall = time.perf_counter() - t0
            done.set()
    finally:
        trio.lowlevel.remove_instrument(steps)
    return wall, worst * 1000, steps.longest * 1000, worst_queued * 1000, worst_gc * 1000


def render_all(pdf: bytes, settings: polygate.Ocr, pages: int) -> None:
    renderer = _ocr_render.Renderer()
    renderer.open(1, pdf)
    try:
        for index in range(pages):
            renderer.page(index, "Transcribe.", settings.dpi, settings.max_side_px, settings.image_format)
    finally:
        renderer.close()


async def run(pages: int, rounds: int, freeze: bool = False) -> dict[str, Any]:
    pdf = make_pdf(pages)
    results: dict[str, list[tuple[float, float, float, float, float]]] = {}
    first: dict[str, tuple[float, float, float, float, float]] = {}
    with fake_server({"text": "# A page\n\nIts text.", "tokens": 8}) as url:
        def settings_for(**ocr: Any) -> polygate.Settings:
            return polygate.Settings(scopes={"ocr": polygate.Scope(
                sources=[polygate.Source(name="a", base_url=url, timeout_s=120)],
                ocr=polygate.Ocr(**ocr),
            )})

        async with polygate.session(settings_for()) as default, \
                polygate.session(settings_for(render_in="thread")) as threads, \
                polygate.session(settings_for(image_format="png")) as png:
            ocr_settings = polygate.Ocr()

            def ocr_with(s: polygate.Session) -> Callable[[], Awaitable[None]]:
                async def work() -> None:
                    r = await s.ocr(pdf)
                    assert len(r.pages) == pages
                return work

            async def render_thread() -> None:
                await trio.to_thread.run_sync(render_all, pdf, ocr_settings, pages)

            async def render_loop() -> None:
                renderer = _ocr_render.Renderer()
                renderer.open(1, pdf)
                try:
                    for index in range(pages):  # one page per task step
                        renderer.page(index, "Transcribe.", ocr_settings.dpi,
                                      ocr_settings.max_side_px, ocr_settings.image_format)
                        await trio.lowlevel.checkpoint()
                finally:
                    renderer.close()

            async def idle() -> None:
                await trio.sleep(1.0)

            cases = {
                "ocr (default: processes)": ocr_with(default),
                "ocr, render_in=thread": ocr_with(threads),
                "ocr (png, processes)": ocr_with(png),
                "render only, in a thread": render_thread,
                "render on the loop": render_loop,
                "idle loop (noise floor)": idle,
            }
            for number in range(rounds + 1):  # round 0: imports and first connections
                for name, work in cases.items():
                    measured = await with_stall_probe(work)
                    if number == 0:
                        first[name] = measured
                    else:
                        results.setdefault(name, []).append(measured)
                if number == 0 and freeze:
                    gc.collect()
                    gc.freeze()
    return {"pdf_bytes": len(pdf), "first": first, "measured": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 pages, 1 round (CI smoke)")
    parser.add_argument("--pages", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() after the first round")
    args = parser.parse_args()
    pages = args.pages or (4 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 5)
    out = trio.run(run, pages, rounds, args.gc_freeze)
    print(f"OCR of a {pages}-page PDF ({out['pdf_bytes']} bytes) against a zero-delay "
          f"loopback upstream; {rounds} round(s){', gc.freeze()' if args.gc_freeze else ''}:")
    print(f"  {'':26s} {'wall s':>7s} {'stall ms':>9s} {'CPU wait':>9s} {'GC':>6s} {'step ms':>8s}"
          f"   first round: wall s, stall ms, step ms")
    summary: dict[str, dict[str, float]] = {}
    for name, measured in out["measured"].items():
        wall = median([m[0] for m in measured])
        worst = max(measured, key=lambda m: m[1])
        step = max(m[2] for m in measured)
        fw, fs, fc, _, _ = out["first"][name]
        summary[name] = {"wall_s": wall, "max_stall_ms": worst[1], "max_stall_cpu_wait_ms": worst[3],
                         "max_stall_gc_ms": worst[4], "max_step_cpu_ms": step,
                         "stalls_ms": [m[1] for m in measured],
                         "first_wall_s": fw, "first_stall_ms": fs, "first_step_cpu_ms": fc}
        print(f"  {name:26s} {wall:7.3f} {worst[1]:9.2f} {worst[3]:9.2f} {worst[4]:6.2f} {step:8.2f}"
              f"   {fw:8.3f} {fs:8.2f} {fc:8.2f}")
    ocr = summary["ocr (default: processes)"]
    before = summary["ocr, render_in=thread"]
    floor = summary["render only, in a thread"]
    idle = summary["idle loop (noise floor)"]
    print("  (wall: median of rounds; stall and step: the worst of all rounds; CPU wait and GC:")
    print("   the parts of the worst stall the loop's thread was runnable but had no CPU, and")
    print("   spent in the garbage collector)")
    print(f"  processes / threads: ×{ocr['wall_s'] / before['wall_s']:.2f} wall, stall "
          f"{ocr['max_stall_ms']:.2f} against {before['max_stall_ms']:.2f} ms; first round "
          f"{ocr['first_wall_s']:.2f} s against {before['first_wall_s']:.2f} s")
    print(f"  ocr / render only: ×{ocr['wall_s'] / floor['wall_s']:.2f} wall; idle loop's stall "
          f"{idle['max_stall_ms']:.2f} ms; rendering on the loop "
          f"{summary['render on the loop']['max_stall_ms']:.1f} ms; the loop's longest step "
          f"{ocr['max_step_cpu_ms']:.2f} ms CPU")
    print(f"  target: the loop's longest stall ≤ 5 ms while a {pages}-page PDF renders: "
          f"{'met' if ocr['max_stall_ms'] <= 5 else 'MISSED'} ({ocr['max_stall_ms']:.2f} ms)")
    # (A smoke run, nox's, keeps the full run's figures as they were.)
    write_result("ocr-quick" if args.quick else "ocr", {"machine": machine(), "pages": pages, "rounds": rounds,
                         "gc_freeze": args.gc_freeze, **out, "summary": summary})


if __name__ == "__main__":
    main()
