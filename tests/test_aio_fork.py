"""os.fork() in processes that use ``polygate.aio`` (docs/asyncio.md, "Processes").

A child forked while a session is open inherits that session's trio run state, its
sockets and its loop object, but not the run itself: it is told so, in a typed error,
whether it opens a session of its own or uses the parent's; the parent goes on.  A
child forked when no session is open (gunicorn's --preload) opens its own.  Real
processes against a loopback upstream, each bounded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from polygate.testing import FakeUpstream, Reply

from ._aio_support import loopback

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform"),
]
ROOT = Path(__file__).resolve().parent.parent


def _echo(request: Any, _rng: Any) -> Reply:
    text = request.body["messages"][-1]["content"]
    return Reply(text=text, headers_delay_s=1.5 if text == "slow" else 0.0)


def _run(scenario: str) -> list[str]:
    with loopback(FakeUpstream(_echo)) as url:
        done = subprocess.run(
            [sys.executable, "-W", "error", "-m", "tests._aio_fork_child", url, scenario],
            capture_output=True, text=True, timeout=90, cwd=ROOT,
        )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stderr == "", done.stderr
    return done.stdout.splitlines()


def test_a_child_forked_with_no_session_open_opens_its_own() -> None:
    assert _run("preload") == ["parent before", "child own", "child status 0", "parent after"]


def test_a_child_forked_under_an_open_session_is_told_why_it_cannot_open_one() -> None:
    """It was refused with a message about another event loop "stopped, not closed",
    which does not exist in the child."""
    lines = _run("own")
    assert lines[0] == "parent warm" and lines[-2:] == ["child status 3", "parent again"]
    [error] = [line for line in lines if line.startswith("child error:")]
    assert "forked while a polygate.aio session of its parent was open" in error
    assert "'spawn'" in error


def test_a_child_using_the_session_it_inherited_is_refused_and_the_parent_goes_on() -> None:
    """The child's call went through on the parent's pooled connection, and its
    leaving the block stopped the parent's run: the parent's own close then never
    returned."""
    lines = _run("inherited")
    errors = [line for line in lines if line.startswith("child error:")]
    assert len(errors) == 2, lines  # the call, then leaving the block
    assert all("this session belongs to another process" in e for e in errors), errors
    assert lines[-3:] == ["child status 3", "parent again", "parent closed"], lines


def test_a_child_leaving_the_inherited_block_on_its_way_out_leaves_the_parent_alone() -> None:
    """A review: a child that only called sys.exit(0) ended with status 1 (the block's
    exit raised over its SystemExit), and its asyncio.run() shutdown closed the
    session generator it inherited, which asked the parent's trio run to close: the
    parent's own close then never returned."""
    assert _run("exit") == ["parent warm", "child status 0", "parent again", "parent closed"]


def test_a_child_leaving_with_a_call_and_a_stream_in_flight_leaves_them_to_the_parent() -> None:
    """A review: the child's asyncio.run() shutdown cancelled the call it inherited,
    and the cancellation ran the parent's trio run in the child, on the sockets and
    the epoll they share: the parent's call never finished.  And leaving the stream's
    block on the way out raised over the child's SystemExit (status 1).  (With trio's
    helper thread, not the default, asyncio's own hazard still stalls the parent's
    next call: the child's shutdown unregisters the parent loop's self-pipe.)"""
    assert _run("inflight") == ["parent warm", "child status 0", "parent streamed",
                                "parent slow", "parent again", "parent closed"]
