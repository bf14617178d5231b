"""What polygate leaves process-wide: the warnings machinery, the ids a forked process
draws, settings handed to another process, trio's scheduling state."""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest

import polygate

#: Two sources per scope: a configuration without a warning of its own.
_ENV = {
    "POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
    "POLYGATE__CHAT__B__BASE_URL": "http://b/v1",
    "POLYGATE__EMBED__A__BASE_URL": "http://a/v1",
}


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch every microsecond: an unguarded swap of global state shows."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _in_threads(work: Callable[[], object], *, threads: int = 2, rounds: int = 2000) -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            for _ in range(rounds):
                work()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    started = [threading.Thread(target=body) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(120)
    assert not errors, errors


def _warnings_state() -> tuple[object, ...]:
    return (list(warnings.filters), warnings.showwarning, warnings._showwarnmsg_impl)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fast_switching")
def test_settings_built_in_two_threads_leave_the_warnings_machinery_alone() -> None:
    """Two sessions opened without settings, in two threads, each read the
    environment.  The assembly used ``warnings.catch_warnings``, whose save and
    restore of the process's filters two threads interleave: the process was left
    with an "always" filter before the user's own, and every later warning appended
    to a list nobody reads."""
    before = _warnings_state()
    try:
        _in_threads(lambda: polygate.Settings.from_env(_ENV))
        after = _warnings_state()
    finally:
        warnings.filters[:] = before[0]  # type: ignore[index]
        warnings.showwarning = before[1]  # type: ignore[assignment]
        warnings._showwarnmsg_impl = before[2]  # type: ignore[attr-defined]
        warnings._filters_mutated()  # type: ignore[attr-defined]
    assert after == before


def test_a_settings_warning_still_reaches_python_and_names_the_key() -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1", "POLYGATE__CHAT__HEDGE__AFTER_S": "1"}
    with pytest.warns(polygate.ConfigWarning, match=r"^POLYGATE__CHAT__\*: hedging .*single source") as seen:
        polygate.Settings.from_env(env)
    assert [w.filename for w in seen] == [__file__]  # the caller's line, not polygate's
