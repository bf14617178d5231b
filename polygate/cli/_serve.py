"""``polygate serve`` (what it does is its help, ``_DESCRIPTION``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import sys
from typing import Any

from .._secrets import printable

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

# The command's --help: a constant, not the module's docstring, which python -OO
# (PYTHONOPTIMIZE=2) drops.
_DESCRIPTION = """``polygate serve``: the OpenAI-compatible gateway server (see docs/serve.md).

Serves the configuration ``polygate.session()`` would load (``POLYGATE_CONFIG``,
``./polygate.toml``, or ``POLYGATE__…`` keys; or ``--config PATH``) on
``--host``/``--port`` (default: ``[serve] host``/``port``, 127.0.0.1:8080).  Prints
one line, ``polygate serve: listening on http://HOST:PORT``, once it accepts
connections (``--port 0`` picks a free port).

Signals: SIGTERM or SIGINT drains (stop accepting, let calls in flight finish within
``[serve] grace_s``, then cancel the rest) and exits 0; a second one cancels at once.
One while the server is still starting stops the start (it never answers), exit 0.
SIGHUP reloads the configuration from the same place; calls in flight finish on the
old one, and an invalid new configuration is logged and ignored.

A governance backend (Redis) that does not answer at start does not stop it: it
listens, answers every call 503 (``/readyz`` too) and opens its session as soon as the
backend answers.

Exit status: 0 after a drain, 2 the configuration (or the address) is unusable, 1 any
other failure to start (a message, never a traceback).
"""

__all__ = ["add_parser", "run"]

log = logging.getLogger("polygate.serve")


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve your configuration as an OpenAI-compatible HTTP gateway",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="PATH", help="a TOML file instead of the default configuration")
    parser.add_argument("--host", help="address to listen on (default: [serve] host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: [serve] port, 8080; 0: any free port)")
    return parser


#: Where a reload reads the configuration from when the start read the environment.
_ENVIRONMENT = ""


def _load(config: str | None) -> Any:
    """``config``: a file; ``None``: where a session without settings looks (``--config``
    absent); :data:`_ENVIRONMENT`: the ``POLYGATE__…`` keys alone, never a file."""
    from .._config import gathered_warnings
    from .._config_load import load_settings, settings_from_env

    # A warning (environment keys a file leaves unused, a hedge that can never fire)
    # is one line of the server's log, as check-config prints it: not Python's
    # two-line warning with a file name and source line.
    with gathered_warnings() as notes:
        if config == _ENVIRONMENT:
            settings = settings_from_env(os.environ)
        else:
            settings = load_settings(path=config)
    for note in notes:
        log.warning("%s", note)
    return settings


class _Lines(logging.Formatter):
    """``polygate serve: …``, and the level for what needs a look: ``polygate serve:
    warning: …``, ``polygate serve: error: …`` (a grep, or a log shipper's rule, tells
    a refused reload from a start line)."""

    def __init__(self) -> None:
        super().__init__("polygate serve: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # Nothing in a record a terminal acts on: a configuration error may quote an
        # environment key's name as written.  (Its lines stay lines: a bug's report is
        # indented under its first, see polygate._bugs.)
        message = "\n".join(printable(line) for line in record.getMessage().split("\n"))
        if record.levelno >= logging.WARNING:
            return f"polygate serve: {record.levelname.lower()}: {message}"
        return f"polygate serve: {message}"

    def formatException(self, ei: Any) -> str:
        # A traceback's last line quotes the exception's text (a client's or an
        # upstream's bytes): escaped as the message is, line by line.
        return "\n".join(printable(line) for line in super().formatException(ei).split("\n"))


def run(args: argparse.Namespace) -> int:
    import trio

    from .._config_load import locate_config
    from .._errors import ConfigError, PolygateError

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Lines())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # polygate's own lines, not a library's: coredis logs every dropped Redis
    # connection at INFO (with an empty traceback), and every failed connection attempt
    # at ERROR with a traceback of ~127 lines (a hung Redis: one a cache lookup, 8,000
    # lines in 30 s at 20 calls a second), which the cache and governance backends
    # already report, once an outage, in their own words.  (Its only other records are
    # warnings of pub/sub and WATCH, which polygate does not use.)
    logging.getLogger("coredis").setLevel(logging.CRITICAL)
    try:
        # A reload reads the configuration from where the start read it: the file
        # found now, or the environment -- never a polygate.toml that appears (or
        # disappears) in the working directory meanwhile, nor a POLYGATE_CONFIG set
        # since (a server's environment does not change).
        where = args.config or locate_config() or _ENVIRONMENT
        settings = _load(args.config or None)
        try:
            return trio.run(_serve, settings, args, where)
        except BaseExceptionGroup as group:  # (the start's nursery: one error in it)
            leaf = _leaf(group)
            if leaf is group:
                raise
            raise leaf from None
    except ConfigError as exc:
        print(f"polygate serve: invalid configuration: {printable(str(exc))}", file=sys.stderr)
        return 2
    except PolygateError as exc:  # could not start (a governance backend down is not one)
        print(f"polygate serve: cannot start: {printable(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a signal before the receiver was installed (see hold_signals)
        log.info("stopped before it started listening")
        return 0


def _leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    """The one error inside nested groups of one; the group itself otherwise."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


async def _serve(settings: Any, args: argparse.Namespace, where: str) -> int:
    import trio

    from ..serve import open_server
    from . import held_signals

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    with trio.open_signal_receiver(*stops) as signals, \
            trio.CancelScope() as start:
        # One that came before the receiver, while the command loaded and read its
        # configuration: a stop ends the start now (a SIGHUP: nothing to reload).
        if any(signum != signal.SIGHUP for signum in held_signals):
            start.cancel()
        held_signals.clear()
        if hasattr(signal, "pthread_sigmask"):
            # A supervisor may start it with them blocked (a mask inherited through a
            # fork from a thread that blocked them): trio's handlers would never run,
            # and SIGTERM would stay pending for ever instead of draining.  Unblocked
            # once the handlers are in place: one already pending is then received
            # (a stop ends the start), not delivered to the default action (death).
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        # One reader of the signals for the server's whole life, from before its start:
        # while it starts (its session opening: a telemetry database, Redis), a stop
        # signal ends the start (nothing is listening yet, nothing to drain) and a
        # SIGHUP is dropped (nothing to reload); once started, each goes to the loop.
        started = False
        send, received = trio.open_memory_channel[int](0)

        async def relay() -> None:
            async for signum in signals:
                if started:
                    # (Waits while the loop is busy, a reload: the receiver meanwhile
                    # keeps what comes, each signal once.)
                    await send.send(signum)
                elif signum != signal.SIGHUP:
                    start.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay)  # (it runs at the start's first checkpoint)
            async with open_server(settings, host=args.host, port=args.port) as server:
                if start.cancel_called:
                    # A stop the relay heard at open_server's last checkpoint: this task
                    # was already scheduled to go on, and would print its listening line
                    # before the cancellation landed at its next checkpoint.
                    await trio.lowlevel.checkpoint()
                started = True
                keys = len(settings.serve.api_keys) + len(settings.serve.keys)
                _settle_heap()
                _listening_line(server.url)
                log.info("%d scope(s), %s", len(settings.scopes),
                         f"{keys} gateway key(s)" if keys else "no gateway keys (loopback only)")
                # Reloads run in a task of their own, one after the other: a stop signal
                # is heard while one opens its session (a telemetry database that does
                # not answer holds it up to its connect timeout), and abandons it.  A
                # SIGHUP while one is pending is the same reload (it reads the file
                # when it runs).
                ask, asked = trio.open_memory_channel[None](1)
                reloading = False

                async def reloader() -> None:
                    nonlocal reloading
                    async for _ in asked:
                        reloading = True
                        try:
                            await _reload(server, where)
                        finally:
                            reloading = False

                async with trio.open_nursery() as reloads:
                    reloads.start_soon(reloader)
                    async for signum in received:
                        if signum == signal.SIGHUP:
                            with contextlib.suppress(trio.WouldBlock):
                                ask.send_nowait(None)
                            continue
                        if reloading:
                            log.warning("reload abandoned: shutting down")
                        reloads.cancel_scope.cancel()
                        break
                log.info("draining: no new connections; calls in flight have %g s",
                         server.settings.serve.grace_s)
                async with trio.open_nursery() as draining:

                    async def drain() -> None:
                        await server.shutdown()
                        draining.cancel_scope.cancel()

                    draining.start_soon(drain)
                    async for again in received:
                        if again == signal.SIGHUP:
                            log.warning("reload ignored: shutting down")
                        else:
                            log.info("second signal: cancelling the calls in flight now")
                            draining.cancel_scope.cancel()
            nursery.cancel_scope.cancel()  # (the relay)
    log.info("stopped before it started listening" if start.cancelled_caught else "stopped")
    return 0


async def _reload(server: Any, where: str) -> None:
    """Read the configuration again from ``where`` (a file, or :data:`_ENVIRONMENT`)."""
    from .._bugs import log_bug
    from .._errors import PolygateError

    settings = None
    try:
        settings = _load(where)
        await server.reload(settings)
    except PolygateError as exc:
        if settings is not None and server.settings is settings:
            # The server still waits for its governance backend: these settings are
            # the ones it now keeps trying (and serves once the backend answers).
            log.warning("configuration reloaded: %d scope(s), served once the governance "
                        "backend answers: %s", len(settings.scopes), exc)
            return
        server.metrics.reload_failures += 1
        log.error("reload refused, the old configuration stays: %s", exc)
        return
    except Exception as exc:
        # A bug in reading a configuration must not end a server that is answering
        # calls (the signal loop would take the process, and every call in flight, with
        # it): refused like an invalid file, with the traceback for the report.
        server.metrics.reload_failures += 1
        log.error("reload refused, the old configuration stays: unexpected %s",
                  type(exc).__name__)
        log_bug(log, exc, "reading the configuration again", server.settings.secrets())
        return
    _settle_heap()
    log.info("configuration reloaded: %d scope(s)", len(settings.scopes))


def _listening_line(url: str) -> None:
    """The listening line on stdout.  A stdout whose reader has gone (a pipe to a
    process that exited, a closed log collector) ended the server with status 141 and
    not a word, where stdout carries nothing else: the line goes to the log instead,
    and the server serves on (stdout then points at /dev/null, so that no later flush
    fails again)."""
    line = f"polygate serve: listening on {url}"
    try:
        print(line, flush=True)
    except OSError as exc:
        from . import _drop_output

        _drop_output()
        log.warning("%s (stdout could not be written: %s)", line, exc.strerror or exc)


def _settle_heap() -> None:
    """Keep what the server holds for its lifetime out of the garbage collector's way.

    A full (generation 2) collection walks every tracked object: after start-up that is
    some 40,000 of them (modules, the session, pydantic and prometheus-client tables),
    and walking them stalled every stream and request in flight for ~25 ms on a 2-core
    machine — the p99 of `benchmarks/serve.py`'s stream ramp was that pause.  Frozen
    objects are never walked, so a full collection costs what the requests in flight
    hold.  Called once the server listens, and after each reload: the previous
    generation is unfrozen and collected first (one full collection per reload), so a
    reload never keeps the old configuration's cycles alive."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
