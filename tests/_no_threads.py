"""A process at its thread limit, for a block of a test."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def no_threads() -> Iterator[None]:
    """No thread can start while the block runs: what ``Thread.start`` raises at the
    process's or the user's ``RLIMIT_NPROC``, from the interpreter's own starter (a
    ``threading.Timer``, a thread of polygate's) and from where trio starts its
    threads (an idle one it keeps would otherwise take the work)."""
    import trio._threads as trio_threads

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("can't start new thread")

    # (The interpreter's name for its starter: 3.13 starts joinable threads.)
    starters = [name for name in ("_start_new_thread", "_start_joinable_thread")
                if hasattr(threading, name)]
    assert starters and callable(trio_threads.start_thread_soon)  # (private names: still there)
    with contextlib.ExitStack() as undo:
        for module, name in [(trio_threads, "start_thread_soon")] + [(threading, n) for n in starters]:
            saved = getattr(module, name)
            setattr(module, name, refuse)
            undo.callback(setattr, module, name, saved)
        yield
