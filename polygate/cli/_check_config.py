"""``polygate check-config``: load the configuration a session would use and show it.

Prints every resolved setting (defaults included) with secrets masked, and any
:class:`ConfigWarning`.  It refuses exactly what ``polygate.session()`` refuses before
connecting anything (:func:`~polygate._config_preflight.preflight`): Redis URL options
and the coredis package, the telemetry sink's kind and driver.  It connects to nothing.  Exit status 0 when the configuration is valid, 2 with the
:class:`ConfigError` message on stderr (no traceback) when it is not — so it can run
in CI or a container's start script before the application does.  With ``--serve``
it also refuses what ``polygate serve`` refuses before it listens (the address is
only known when it listens: a port in use is not found here).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from .._config import Settings, gathered_warnings
from .._config_load import describe, load_settings, locate_config
from .._config_preflight import preflight
from .._errors import ConfigError
from .._secrets import printable

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "check-config",
        help="validate the configuration and print it with secrets masked",
        description=(
            "Load the configuration polygate.session() would use (POLYGATE_CONFIG, "
            "./polygate.toml, or POLYGATE__* environment keys) or the given TOML file, "
            "and print it with secrets masked. Exit status 2 when it is invalid."
        ),
    )
    parser.add_argument("--config", metavar="PATH", help="a TOML file to check instead")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--serve", action="store_true",
        help="also refuse what `polygate serve` refuses before it listens: a [serve] host "
        "that is not a loopback address without gateway keys, the serve extra missing",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    origin = args.config or "environment (POLYGATE__* keys)"
    error: ConfigError | None = None
    with gathered_warnings() as notes:
        try:
            # (Inside: a ./polygate.toml it cannot look at, in a working directory
            # its user may not enter, is a typed refusal, as `polygate serve` gives.)
            origin = args.config or locate_config() or origin
            settings = _load(args.config, serve=args.serve)
        except ConfigError as exc:
            error = exc
    for note in notes:  # an invalid configuration's warnings too: found before its error
        print(f"warning: {printable(note)}", file=sys.stderr)
    if error is not None:
        print(f"polygate check-config: invalid configuration: {printable(str(error))}", file=sys.stderr)
        return 2
    if args.json:
        report = {"source": origin, "settings": describe(settings), "warnings": notes}
        print(json.dumps(report, indent=2))
    else:
        print(f"configuration from {printable(origin)}: valid")
        print(_table(describe(settings)))
    return 0


def _load(path: str | None, *, serve: bool) -> Settings:
    settings = load_settings(path=path)
    preflight(settings)  # what session() refuses before connecting, refused here too
    if serve:  # (only then: a library's configuration may name any [serve] host)
        from ..serve._server import check_serving

        check_serving(settings, settings.serve.host)
    return settings


def _table(described: dict[str, Any]) -> str:
    """Dotted paths (as in TOML) and values, aligned; sources keyed by their name."""
    rows = [(printable(path), printable(value)) for path, value in _rows(described, "")]
    width = max(len(path) for path, _ in rows)
    return "\n".join(f"  {path:<{width}}  {value}" for path, value in rows)


def _rows(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict) and not node and path:
        yield path, "-"  # an empty table (serve.keys, serve.models) is a field too
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _rows(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list) and all(isinstance(item, str) for item in node):
        yield path, ", ".join(node) or "-"
    elif isinstance(node, list):
        for item in node:
            rest = {k: v for k, v in item.items() if k != "name"}
            yield from _rows(rest, f"{path}.{item['name']}")
    else:
        yield path, _show(node)


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
