"""The ``polygate`` command line: one argparse subcommand per module.

Each subcommand lives in ``polygate/cli/_<name>.py`` and exposes
``add_parser(subparsers)`` and ``run(args) -> int``.  :data:`SUBCOMMANDS` is the one
place that lists them, so adding ``demo``, ``stats`` or ``chat`` is one module plus
one line here.  Modules keep heavy or optional imports inside ``run`` so that
``polygate --help`` stays fast and works without the extras installed.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

#: Module names under ``polygate.cli`` (without the leading underscore), in help order.
SUBCOMMANDS: tuple[str, ...] = ("demo", "check_config", "stats", "chat", "serve")


class _Subcommand(Protocol):
    def add_parser(
        self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
    ) -> argparse.ArgumentParser: ...

    def run(self, args: argparse.Namespace) -> int: ...


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but an error writing its own text (``--help``, ``--version``
    into a full disk) is raised, as every command's output error is, not ignored."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse always names the stream (sys.stdout or sys.stderr): None is one the
        # process was started with closed (`>&-`, `2>&-`), where nothing is printed.
        if message and file is not None:
            file.write(message)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        if action.nargs is None and action.option_strings and arg_strings == ["--"]:
            # ``--config=--``: before Python 3.13 argparse drops a value of "--" and
            # hands the option an empty list (a traceback further on, or the default
            # configuration checked instead of the file named "--").
            return self._get_value(action, "--")
        return super()._get_values(action, arg_strings)


def build_parser() -> argparse.ArgumentParser:
    """The full parser; each subcommand's parser records its ``run`` as ``args.run``."""
    parser = _Parser(
        prog="polygate", description="polygate: a trio-native LLM gateway library."
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"polygate {__version__}")
    # (Its parsers are _Parser too: argparse makes them of the parent's class.)
    subparsers = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(title="commands", metavar="COMMAND", dest="command"),
    )
    for name in SUBCOMMANDS:
        module = cast(_Subcommand, importlib.import_module(f"{__name__}._{name}"))
        module.add_parser(subparsers).set_defaults(run=module.run)
    return parser


#: Errors of a write that could not be done (the output's disk is full, its device
#: failed): the output's fault, not the command's, said in one line.
_WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand and return its exit status (2 for usage errors)."""
    given = sys.argv[1:] if argv is None else argv
    if given[:1] != ["serve"]:
        return _main(argv)
    held_signals.clear()  # (an earlier main() in this process)
    previous = hold_signals()
    try:
        return _main(argv)
    finally:
        for signum, handler in previous.items():
            if argv is None:
                # The process's own command line: it exits now, and a signal in its last
                # milliseconds (a SIGHUP from a reload timer, a second SIGTERM) would
                # take the default action, death, and the exit status with it.  Ignored,
                # which the interpreter's finalization keeps (it resets handlers).
                signal.signal(signum, signal.SIG_IGN)
            else:  # (main() called in a process that goes on)
                signal.signal(signum, handler)


def _main(argv: list[str] | None) -> int:
    if sys.stderr is None:
        # Started with its errors closed (``2>&-``): print(..., file=None) writes to
        # stdout, so an error line would land in the answer (``chat … > answer.txt``).
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the process's
    try:
        parser = build_parser()  # (it imports every subcommand: Ctrl-C may land here)
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return _flushed(exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2)
    except OSError as exc:  # its text could not be written (see _Parser)
        return _unwritten(exc, "polygate")
    except KeyboardInterrupt:
        print("polygate: interrupted", file=sys.stderr)
        return 130
    if sys.stdout is None:
        # Started with its output closed (``>&-``): what it prints goes nowhere, as
        # print() does then, rather than failing where a command writes directly.
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the process's
    run = cast("Callable[[argparse.Namespace], int] | None", getattr(args, "run", None))
    if run is None:
        try:
            parser.print_help()
        except OSError as exc:  # (see _Parser)
            return _unwritten(exc, "polygate")
        return _flushed(2)
    # A path (a database's, a configuration's) may hold bytes that are not UTF-8: they
    # arrive as surrogate escapes, which a strict UTF-8 stdout refuses to print (a
    # bare UnicodeEncodeError, after the work was done).  Shown escaped instead.
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")
    try:
        return run(args)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not _interrupted(exc):
            raise
        # Ctrl-C, as itself or inside trio's group: one line, the shell's status.
        print(f"polygate {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        return _unwritten(exc, f"polygate {args.command}")


#: Stop signals (and SIGHUPs) that reached ``polygate serve`` before its own signal
#: receiver was in place; it reads them once it is (see :func:`hold_signals`).
held_signals: list[int] = []


def hold_signals() -> dict[int, Any]:
    """From here on, SIGINT, SIGTERM and SIGHUP are noted in :data:`held_signals`, until
    ``polygate serve`` installs its receiver.  A server must hear a stop signal at any
    moment of its start: Python's SIGINT handler (and trio's, which replaces it only
    while it is the default) raises KeyboardInterrupt wherever the main thread is, and
    where that is a weakref callback (importlib's module locks run one after each
    import) or a ``__del__``, Python prints "Exception ignored" and drops it: the
    server went on to listen.  SIGHUP's default action killed the process while it
    started, where the docs say it is ignored then.  Returns the handlers replaced."""
    def held(signum: int, frame: object) -> None:
        held_signals.append(signum)

    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None:
            previous[signum] = signal.signal(signum, held)
    return previous


def _flushed(code: int) -> int:
    """``code`` once stdout is flushed.  A buffered stdout fails at its flush: here,
    not at the interpreter's exit, where the error would pass in silence."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except OSError as exc:
        return _unwritten(exc, "polygate")
    return code


def _unwritten(exc: OSError, prog: str) -> int:
    """The exit status for output that could not be written; an error of another kind
    is raised again."""
    if isinstance(exc, BrokenPipeError):
        # The reader left (``polygate stats | head``): not an error of ours.  Point
        # stdout at /dev/null so the interpreter's final flush cannot fail again.
        _drop_output()
        return 141  # 128 + SIGPIPE, what a shell reports for a process killed by it
    if exc.errno not in _WRITE_ERRORS:
        raise exc
    print(f"{prog}: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
    _drop_output()
    return 1


def _drop_output() -> None:
    """stdout to /dev/null: the interpreter's final flush must not fail again."""
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def _interrupted(exc: BaseException) -> bool:
    """Ctrl-C: a KeyboardInterrupt, or a group of nothing else (trio's nurseries)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_interrupted(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)
