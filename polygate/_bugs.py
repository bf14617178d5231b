"""Logging a bug that the outside can trigger at will (an upstream's bytes, a client's
request): one redacted traceback per exception type a minute, the rest one line at
DEBUG.  Without the bound, an upstream that trips it on every attempt (or a client on
every request) would fill the logs; without the redaction, an exception's text could
carry a key or a URL's password into them; and an upstream's bytes in that text could
carry a terminal's escape sequences."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterable

import trio

from ._secrets import printable, redact

__all__ = ["log_bug"]

#: One traceback per exception type and logger in this many seconds.
EVERY_S = 60.0
#: When each (logger, exception type) last logged its traceback, in this run's time.
#: Keyed by the logger too: the transport's bug must not silence the server's.  One
#: table per trio run, not per process: each run has a clock of its own (trio's starts
#: at a random offset, a MockClock at 0), and a time from another run -- a thread's
#: run beside it, or the test before -- made the bound log every time, or not at all.
_LAST: trio.lowlevel.RunVar[dict[tuple[str, type[BaseException]], float]] = trio.lowlevel.RunVar(
    "polygate_bug_logged")


def log_bug(log: logging.Logger, exc: BaseException, where: str, secrets: Iterable[str]) -> None:
    """``exc`` (an unexpected error) logged at ERROR with its traceback, ``secrets``
    redacted and control characters escaped, once per type a minute; ``where`` says
    what was being done ("in an exchange with a", "answering POST /v1/…")."""
    now = trio.current_time()
    kind = type(exc)
    try:
        _last = _LAST.get()
    except LookupError:  # (this run's first)
        _last = {}
        _LAST.set(_last)
    last = _last.get((log.name, kind))
    if last is not None and 0 <= now - last < EVERY_S:
        log.debug("unexpected %s %s", kind.__name__, where)
        return
    if len(_last) > 64:
        _last.clear()
    _last[log.name, kind] = now
    trace = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    log.error("unexpected error %s\n%s", where, _indented(redact(trace, secrets)))


def _indented(text: str) -> str:
    """Every line indented, control characters escaped: no line of an exception's
    text can pass for a log line of its own (``polygate serve: error: …``)."""
    return "\n".join("  " + printable(line) for line in text.rstrip().splitlines())
