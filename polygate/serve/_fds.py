"""How many client connections the process's open-file limit lets the server hold.

Each client connection holds a descriptor, and its call one more for the upstream's
socket.  A server whose ``max_connections`` outgrows the open-file limit never
reaches its own cap: past the limit, ``accept`` fails with ``EMFILE`` (the next
client waits unanswered in the listen queue), and the calls of connections already
open cannot open their upstream sockets (each attempt fails, charged to a source that
did nothing wrong).  So the server raises its soft limit toward the hard one when it
needs to (Go's runtime does the same at start), and when even the hard limit is
short, serves fewer connections -- the rest get the documented 503 -- and says so.
"""

from __future__ import annotations

import logging
import os

from .._errors import ConfigError

__all__ = ["connection_room"]

log = logging.getLogger("polygate.serve")

#: Descriptors kept for everything else: listeners, epoll, idle upstream connections
#: beyond the calls', telemetry, Redis, logs, an OCR renderer's pipes.
RESERVE = 128
#: A client's socket, and its call's upstream socket.
PER_CONNECTION = 2
#: At start, below this many descriptors free beyond one connection's, none is served.
SPARE = 8


def _open_now() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_room(wanted: int, open_connections: int = 0, *, starting: bool = False) -> int:
    """The client connections the open-file limit leaves room for, at most ``wanted``
    (``wanted`` where there is no such limit to read).  ``open_connections``: client
    connections open now (a reload), whose descriptors ``wanted`` counts already.
    ``starting``: a limit with no room for one connection is a ConfigError (a reload
    keeps serving what fits)."""
    try:
        import resource
    except ImportError:  # (not POSIX)
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    base = max(0, _open_now() - PER_CONNECTION * open_connections) + RESERVE
    needed = base + PER_CONNECTION * wanted
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            except (OSError, ValueError) as exc:
                log.warning("cannot raise the open-file limit from %d to %d: %s", soft, raised, exc)
            else:
                log.info("raised the open-file limit from %d to %d for %d connections",
                         soft, raised, wanted)
                soft = raised
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    if starting and soft - _open_now() < PER_CONNECTION + SPARE:
        # Room for "1" here was none: accept failed with EMFILE for ever, and every
        # client waited unanswered, with no 503.
        raise ConfigError(
            f"the open-file limit ({soft}, hard "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}) leaves no room "
            "for a client connection: raise it (ulimit -n, or LimitNOFILE= in a systemd "
            "unit)"
        )
    room = max(1, (soft - base) // PER_CONNECTION)
    log.warning(
        "the open-file limit (%d, hard %s) leaves room for %d client connections, not "
        "max_connections=%d: serving at most %d (more get 503). Raise it (ulimit -n, "
        "or LimitNOFILE= in a systemd unit) to serve more.",
        soft, "unlimited" if hard == resource.RLIM_INFINITY else hard, room, wanted, room,
    )
    return room
