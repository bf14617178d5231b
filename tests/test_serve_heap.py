"""``polygate serve`` keeps its start-up heap out of the garbage collector's walks.

A full collection over the ~40,000 objects a server holds from start-up paused every
stream in flight for ~25 ms (the p99 of ``benchmarks/serve.py``'s stream ramp).  The
server freezes them once it listens, and again after a reload, having first collected
what the old configuration left behind."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from polygate.cli import _serve as serve_cli

from ._serve_kit import GATEWAY_KEY


class _Node:
    """A cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def thawed() -> Iterator[None]:
    """Leave the interpreter as the other tests expect it: nothing frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_settling_collects_the_garbage_first_then_freezes(thawed: None) -> None:
    garbage = weakref.ref(_Node())  # unreachable, in a cycle
    kept = _Node()
    serve_cli._settle_heap()
    assert garbage() is None  # collected, not frozen forever
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert kept.me is kept


def test_settling_again_frees_what_the_old_generation_left(thawed: None) -> None:
    old = _Node()
    serve_cli._settle_heap()  # ``old`` is frozen now
    left = weakref.ref(old)
    del old
    gc.collect()
    assert left() is not None  # frozen objects are never walked, so never freed
    serve_cli._settle_heap()  # a reload
    assert left() is None


def _config(path: Path) -> Path:
    path.write_text(
        f'[serve]\napi_keys = ["{GATEWAY_KEY}"]\n'
        '[scopes.chat.sources.a]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m1"\n'
    )
    return path


async def test_the_server_settles_its_heap_when_it_listens_and_after_a_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thawed: None
) -> None:
    settled: list[int] = []

    def settle() -> None:
        # Each step signals the server itself (this test runs it in-process, on the
        # main thread): the first settle asks for a reload, the second for a drain.
        settled.append(len(settled))
        os.kill(os.getpid(), signal.SIGHUP if len(settled) == 1 else signal.SIGTERM)

    monkeypatch.setattr(serve_cli, "_settle_heap", settle)
    config = _config(tmp_path / "c.toml")
    args = argparse.Namespace(config=str(config), host="127.0.0.1", port=0)
    with trio.fail_after(15):
        status = await serve_cli._serve(serve_cli._load(str(config)), args, str(config))
    assert status == 0
    assert settled == [0, 1]  # once listening, once after the reload


async def test_a_refused_reload_settles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thawed: None
) -> None:
    config = _config(tmp_path / "c.toml")
    settled: list[int] = []

    def settle() -> None:
        settled.append(len(settled))
        config.write_text("[scopes.chat.sources.a]\nbase_url = 42\n")  # the reload is refused
        os.kill(os.getpid(), signal.SIGHUP)

    async def reload_then_stop(server: object, where: str) -> None:
        await real_reload(server, where)
        os.kill(os.getpid(), signal.SIGTERM)

    real_reload = serve_cli._reload
    monkeypatch.setattr(serve_cli, "_settle_heap", settle)
    monkeypatch.setattr(serve_cli, "_reload", reload_then_stop)
    args = argparse.Namespace(config=str(config), host="127.0.0.1", port=0)
    with trio.fail_after(15):
        status = await serve_cli._serve(serve_cli._load(str(config)), args, str(config))
    assert status == 0
    assert settled == [0]


async def test_a_reload_that_fails_unexpectedly_is_refused_and_the_server_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Review: a reload whose reading raised anything but a PolygateError (an integer
    no float holds was one) left the signal loop, and the server stopped with every
    call in flight.  Refused and logged like an invalid file; the server goes on."""
    config = _config(tmp_path / "c.toml")

    def settle() -> None:
        os.kill(os.getpid(), signal.SIGHUP)

    def broken_load(path: str) -> object:
        raise RuntimeError("a bug in reading the file")

    async def reload_then_stop(server: object, where: str) -> None:
        await real_reload(server, where)  # (raising, it ends the server: the test fails)
        os.kill(os.getpid(), signal.SIGTERM)

    real_reload = serve_cli._reload
    settings = serve_cli._load(str(config))
    monkeypatch.setattr(serve_cli, "_settle_heap", settle)
    monkeypatch.setattr(serve_cli, "_load", broken_load)
    monkeypatch.setattr(serve_cli, "_reload", reload_then_stop)
    args = argparse.Namespace(config=str(config), host="127.0.0.1", port=0)
    with trio.fail_after(15):
        status = await serve_cli._serve(settings, args, str(config))
    assert status == 0
    assert any("reload refused" in r.getMessage() for r in caplog.records)
