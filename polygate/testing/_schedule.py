"""Seeded scheduling: one reproducible interleaving of trio's scheduler per seed.

Trio runs the tasks that became runnable in one loop iteration as a *batch*, in a
random order, so that code cannot come to rely on one order.  Outside hypothesis it
only reverses each batch with probability ½; once hypothesis is imported, trio's
plugin shuffles every batch with its module-level ``random.Random`` — which
hypothesis then re-seeds with the *same* seed for every example, so without help
every example explores the same interleaving.

:class:`Schedule` makes the interleaving a value: ``Schedule(seed).run(main)`` runs
``main`` under ``MockClock(autojump_threshold=0)`` with every batch shuffled by
``random.Random(seed)``, and restores trio's state afterwards.  The same seed gives
the same run (but for waits on worker threads: a finished thread's task comes back
at a moment of real time, into whichever batch is then being run); a hypothesis strategy of seeds (``polygate.testing.strategies.
schedules()``) explores a different interleaving per example, and a failure prints
the seed that reproduces it.

This relies on two private names of trio's run loop, the ones trio's own
hypothesis plugin uses (``trio._core._run._r`` and
``_ALLOW_DETERMINISTIC_SCHEDULING``); a trio without them raises RuntimeError here
rather than silently running unshuffled.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio
import trio.testing

__all__ = ["Schedule"]

T = TypeVar("T")

_FLAG = "_ALLOW_DETERMINISTIC_SCHEDULING"

#: Held for a whole :meth:`Schedule.run`: trio's scheduler state is process-wide, so
#: two runs at once (two threads) would shuffle with one generator and each put back
#: what the other had changed, leaving every later ``trio.run`` shuffled.
_RUNNING = threading.Lock()


def _run_module() -> Any:
    from trio._core import _run  # private: see the module docstring

    if not isinstance(getattr(_run, "_r", None), random.Random) or not hasattr(_run, _FLAG):
        raise RuntimeError(
            f"trio {trio.__version__} has no seedable scheduler "
            "(trio._core._run._r / _ALLOW_DETERMINISTIC_SCHEDULING): Schedule cannot work"
        )
    return _run


@attrs.frozen
class Schedule:
    """One interleaving of trio's scheduler: the seed of its batch shuffles."""

    seed: int = attrs.field(validator=attrs.validators.instance_of(int))

    def run(
        self,
        async_fn: Callable[..., Awaitable[T]],
        *args: Any,
        clock: trio.abc.Clock | None = None,
    ) -> T:
        """``trio.run(async_fn, *args)`` with every batch of runnable tasks shuffled
        by ``random.Random(seed)``; under ``MockClock(autojump_threshold=0)`` unless
        ``clock`` is given.  One at a time in a process, from outside trio: another
        already running (another thread's, or the caller's own) is a RuntimeError."""
        run = _run_module()
        if not _RUNNING.acquire(blocking=False):
            raise RuntimeError(
                "another Schedule.run is in progress in this process: trio's scheduler "
                "state is process-wide, so seeded runs cannot overlap"
            )
        try:
            return self._run(run, async_fn, *args, clock=clock)
        finally:
            _RUNNING.release()

    def _run(
        self, run: Any, async_fn: Callable[..., Awaitable[T]], *args: Any,
        clock: trio.abc.Clock | None,
    ) -> T:
        state = run._r.getstate()
        flag = getattr(run, _FLAG)
        run._r.seed(self.seed)
        setattr(run, _FLAG, True)  # shuffle every batch, not just reverse half of them
        try:
            return trio.run(
                async_fn, *args, clock=clock or trio.testing.MockClock(autojump_threshold=0)
            )
        finally:
            setattr(run, _FLAG, flag)
            run._r.setstate(state)
