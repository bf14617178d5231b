"""A Ctrl-C that breaks polygate.aio's trio run (docs/asyncio.md: "Ctrl-C is handled
as usual").  asyncio.run()'s second Ctrl-C raises wherever the thread is; landing in
trio's run loop, it ends the run in TrioInternalError.  The program then hung (the
call waited for a run that was gone) or, when the timing let it out, ended with
``PolygateError: polygate's trio run has ended`` and exit status 1.  It now ends as
Ctrl-C ends it: KeyboardInterrupt.  Real processes, bounded."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_ctrl_c_that_breaks_the_trio_run_ends_the_program_as_ctrl_c(loop: str) -> None:
    try:
        done = subprocess.run([sys.executable, "-m", "tests._aio_ki_child", loop],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("the program did not end: its call waited for a run that was gone")
    assert done.stdout == "open\n"
    assert done.returncode in (-signal.SIGINT, 128 + signal.SIGINT), done.stderr[-3000:]
    assert "PolygateError" not in done.stderr
    assert "unhandled exception during asyncio.run() shutdown" not in done.stderr
