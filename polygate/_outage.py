"""Whether an outage of the shared governance backend (Redis) has been logged and its
end not yet: the one piece of state ``polygate serve``'s 503 warning and the backend's
"answers again" line share, so that the log tells of every outage's start and end."""

from __future__ import annotations

__all__ = ["OUTAGE_LOG", "OutageLog"]


class OutageLog:
    """Whether an outage of the governance backend has been logged and its end not yet.
    Shared by ``polygate serve``'s 503 warning and the backend's "answers again":
    each rate-limited alone (one line every 10 s), a second outage within 10 s of the
    first's end went unsaid, and the log's last word was "answers again" while calls
    were answered 503.  Now an outage's start is said whenever the last word was its
    end, and its end whenever the last word was its start."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False


OUTAGE_LOG = OutageLog()
