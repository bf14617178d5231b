"""A process at its thread limit, for a block of a test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def no_threads() -> Iterator[None]:
    """trio cannot start a thread while the block runs: what ``Thread.start`` raises
    at the process's or the user's ``RLIMIT_NPROC``, from where trio starts its
    threads (a cached idle one would otherwise take the work)."""
    import trio._threads as threads

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("can't start new thread")

    assert callable(threads.start_thread_soon)  # (trio's private name: still there)
    saved = threads.start_thread_soon
    threads.start_thread_soon = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        threads.start_thread_soon = saved
