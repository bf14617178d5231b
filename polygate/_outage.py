"""Which governance backends' outages (Redis's) have been logged and their ends not
yet: the one piece of state ``polygate serve``'s 503 warning and the backend's
"answers again" line share, so that the log tells of every outage's start and end."""

from __future__ import annotations

import math
import time

__all__ = ["OUTAGE_LOG", "OutageLog"]


class OutageLog:
    """Which governance backends' outages have been logged and their ends not yet, by
    the backend (its URL, masked), and when each last had a line.  Shared by
    ``polygate serve``'s 503 warning and the Redis backend's "answers again": each
    rate-limited alone (one line every 10 s), a second outage within 10 s of the
    first's end went unsaid, and the log's last word was "answers again" while calls
    were answered 503.  Now an outage's start is said when its end was the backend's
    last word, at least a second before (a backend failing every other exchange, a
    brownout, gives a line a second, not two a flap), and its end whenever its start
    was said."""

    __slots__ = ("_clock", "_open", "_said_at")

    def __init__(self) -> None:
        self._open: set[str | None] = set()
        self._said_at: dict[str | None, float] = {}
        self._clock = time.monotonic  # (a log's rate: no trio clock needed)

    def starts(self, backend: str | None) -> bool:
        """Whether an outage of ``backend`` is to be said now (its first line); the
        caller tells :meth:`said` when it says it."""
        if backend is None:  # (unknown: no end will be said of it, so no start either)
            return False
        return backend not in self._open \
            and self._clock() - self._said_at.get(backend, -math.inf) >= _FLOOR_S

    def said(self, backend: str | None) -> None:
        """A line told of ``backend``'s outage (the first, or a reminder)."""
        if backend is None:
            return
        self._open.add(backend)
        self._said_at[backend] = self._clock()

    def ends(self, backend: str | None) -> bool:
        """Whether ``backend`` answering again is to be said (its outage was)."""
        if backend not in self._open:
            return False
        self._open.discard(backend)
        self._said_at[backend] = self._clock()
        return True


#: The least time between two lines about one backend's state changing.
_FLOOR_S = 1.0

OUTAGE_LOG = OutageLog()
