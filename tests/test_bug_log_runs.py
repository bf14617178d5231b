"""The once-a-minute bound on a bug's traceback (``polygate._bugs.log_bug``) is kept per
trio run: each run has a clock of its own, and a process holds several runs (threads
each in ``trio.run``, ``polygate.aio`` sessions on two loops, a test suite's runs one
after another).  Kept process-wide, times from one run were compared with another's
clock: two runs at once logged a traceback an attempt (trio's clock starts at a random
offset, so one run always saw a negative difference), and a MockClock test after
another lost its first traceback to the earlier test's minute."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
import trio
import trio.testing

import polygate

SETTINGS = polygate.Settings(scopes={"chat": polygate.Scope(
    sources=[polygate.Source(name="a", base_url="http://a/v1")],
    retry=polygate.Retry(max_attempts=1), call_deadline_s=5)})


class _Buggy(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a transport bug")


async def _calls(n: int) -> None:
    async with polygate.session(SETTINGS, transport=_Buggy()) as s:
        for _ in range(n):
            with pytest.raises(polygate.PolygateError):
                await s.chat([{"role": "user", "content": "hi"}])
            await trio.sleep(0.001)


class _Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR and "a transport bug" in record.getMessage():
            self.count += 1  # (under the handler's own lock: Handler.handle takes it)


@pytest.fixture
def tracebacks() -> object:
    handler = _Tracebacks()
    log = logging.getLogger("polygate.transport")
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)


def test_each_run_under_a_mock_clock_logs_its_first_traceback(tracebacks: _Tracebacks) -> None:
    for runs in (1, 2, 3):
        trio.run(_calls, 3, clock=trio.testing.MockClock(autojump_threshold=0))
        assert tracebacks.count == runs  # one a run, the later calls' at DEBUG


def test_two_runs_at_once_log_one_traceback_each(tracebacks: _Tracebacks) -> None:
    threads = [threading.Thread(target=trio.run, args=(_calls, 30)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert tracebacks.count == 2
