"""Ctrl-C on a loop whose application left SIGINT to Python's default handler.

``asyncio.run()``, uvicorn and Jupyter's kernel handle SIGINT themselves.  A loop
driven by ``run_until_complete`` or ``run_forever`` (IPython's terminal, ``python -m
asyncio``, scripts) leaves it to Python's default handler, and trio's
``start_guest_run`` replaces that handler with its own, which treats every frame
outside trio as protected: a Ctrl-C in the application's own code (a ``time.sleep``,
an unrelated ``await``, an idle prompt) was held back and then delivered to the guest
run's main task, ending the run and with it every session on the loop.

So before the guest run starts, this module's handler takes the default's place
(trio installs its own only over the default).  It raises ``KeyboardInterrupt`` at
once, wherever the program is, as the default handler would, except inside one of
trio's steps or a hand-over to trio (the functions :func:`guard` registers): a
``KeyboardInterrupt`` there would break trio's scheduler.  There it is held until the
step ends, then raised (:func:`deliver`), a few microseconds later, by the code that
ran the step: in the same iteration of the loop, never posted to a later one (the
loop's ``run_until_complete`` may end in this one, and a later run, a later cell of
a REPL, would get a Ctrl-C nobody pressed in it).  The default handler is put back
when the last guest run that relied on it has finished.
"""

from __future__ import annotations

import signal
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["deliver", "guard", "held", "install", "uninstall"]


class _Held:
    __slots__ = ("pending",)

    def __init__(self) -> None:
        #: A Ctrl-C came inside one of trio's steps and waits for its end.
        self.pending = False


held = _Held()

_guarded: set[types.CodeType] = set()
_users = 0  # guest runs (main thread) relying on the handler


def guard(*functions: Callable[..., Any]) -> None:
    """Functions in which a Ctrl-C waits for the end of trio's step (each of them
    reaches a :func:`deliver`, or schedules a step that does)."""
    for fn in functions:
        _guarded.add(fn.__code__)


def _on_sigint(signum: int, frame: types.FrameType | None) -> None:
    outer = frame
    while outer is not None:
        if outer.f_code in _guarded:
            held.pending = True
            return
        outer = outer.f_back
    held.pending = False  # (one held before is this one now)
    signal.default_int_handler(signum, frame)  # (raises KeyboardInterrupt)


def deliver() -> None:
    """Raise the Ctrl-C held back during a step of trio's, now that it has ended."""
    if held.pending and threading.current_thread() is threading.main_thread():
        held.pending = False
        raise KeyboardInterrupt


def install() -> bool:
    """Before a guest run starts: take SIGINT over from Python's default handler, if
    it has it (in the main thread only).  True when the run must :func:`uninstall`."""
    global _users
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is not _on_sigint:
        if current is not signal.default_int_handler:
            return False  # the application's own (asyncio.run's, uvicorn's): left alone
        signal.signal(signal.SIGINT, _on_sigint)
    _users += 1
    return True


def uninstall() -> None:
    """A guest run that :func:`install` took SIGINT for has finished: the last one puts
    the default handler back (unless the application has set one of its own since)."""
    global _users
    _users -= 1
    # (A Ctrl-C still held is raised all the same: the step that ended the run is
    # still on its way to its deliver().)
    if _users == 0 and signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)
