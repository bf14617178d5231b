"""``polygate demo`` (what it does is its help, ``_DESCRIPTION``)."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .._paths import sqlite_url
from .._secrets import printable

# The command's --help: a constant, not the module's docstring, which python -OO
# (PYTHONOPTIMIZE=2) drops.
_DESCRIPTION = """``polygate demo``: the queue-hang incident (``docs/incident.md``), replayed with and
without hedging.

Runs in virtual time on the built-in fake upstream: the 90-second hangs cost no wall
time, and the default 600 calls with their ~180,000 token chunks take about half a
minute of CPU here (``--calls 50``: seconds).  Or with ``--real-time``, scaled down
÷10 on real loopback servers.
"""

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="replay the queue-hang incident (docs/incident.md) on the built-in fake upstream, "
             "hedging off and on",
        description=_DESCRIPTION,
    )
    parser.add_argument("--calls", type=int, default=200, help="logical calls per configuration")
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--real-time", action="store_true",
                        help="run a ÷10 scaled replay on real loopback servers")
    parser.add_argument("--plot", metavar="PNG", help="write latency CDFs (needs matplotlib: the plot extra)")
    parser.add_argument(
        "--db", metavar="PATH",
        help="also write the replay's telemetry to this SQLite file (or sqlite:///… URL), "
             "one scope per configuration, for polygate stats",
    )
    return parser


def _scope_name(label: str) -> str:
    """A configuration's scope in the telemetry: ``hedge after 8 s`` → ``hedge_after_8s``."""
    return "_".join(label.replace(" s", "s").split())


def configurations(scale: float = 1.0) -> list[tuple[str, Any]]:
    import polygate

    from ._replay import scope_settings

    def secs(value: float) -> str:
        return f"{value * scale:g} s"

    return [
        ("no hedging", scope_settings(timeout_s=300 * scale)),
        (f"deadline {secs(30)}", scope_settings(call_deadline_s=30 * scale, timeout_s=300 * scale)),
        (f"hedge after {secs(8)}", scope_settings(
            hedge=polygate.Hedge(after_s=8 * scale, budget_ratio=0.3), timeout_s=300 * scale)),
    ]


def run(args: argparse.Namespace) -> int:
    if args.calls <= 0 or args.concurrency <= 0:
        print("polygate demo: --calls and --concurrency must be > 0", file=sys.stderr)
        return 2
    if args.plot is not None and not args.plot.strip():
        # (--plot "$OUT" with the variable unset: an empty name, not "no plot".)
        print("polygate demo: --plot is empty", file=sys.stderr)
        return 2
    import attrs

    from .._errors import ConfigError
    from ._replay import Summary, incident_upstreams, run_virtual, summarize

    telemetry = None
    if args.db is not None:
        telemetry = _telemetry_url(args.db)
        if telemetry is None:
            return 2

    scale = 0.1 if args.real_time else 1.0
    print(
        f"queue-hang incident replay (docs/incident.md): {args.calls} calls per configuration, "
        f"concurrency {args.concurrency};\n"
        f"source a hangs 90-96 s before its first token on 25 % of calls, b is healthy;\n"
        f"10 % of calls are long healthy generations (1,500-3,000 tokens at 40 tokens/s)."
    )
    if args.real_time:
        print("real time, every delay scaled ÷10, on two loopback servers\n")
    else:
        print("virtual time (trio MockClock): the hangs cost no wall time\n")
    results: dict[str, list[Any]] = {}
    scopes: list[str] = []
    try:
        for label, settings in configurations(scale):
            scope = "chat"
            if telemetry is not None:
                # One scope per configuration: polygate stats --scope tells them apart.
                scope = _scope_name(label)
                scopes.append(scope)
                settings = attrs.evolve(
                    settings, telemetry=telemetry, scopes={scope: settings.scopes["chat"]})
            upstreams = incident_upstreams(seed=args.seed, time_scale=scale)
            if args.real_time:
                outcomes = _run_real_time(
                    settings, upstreams, args.calls, args.concurrency, label, scope)
            else:
                outcomes = run_virtual(settings, upstreams, calls=args.calls,
                                       concurrency=args.concurrency, scope=scope)
            results[label] = outcomes
    except ConfigError as exc:  # the telemetry file cannot be opened
        print(f"polygate demo: {printable(str(exc))}", file=sys.stderr)
        return 1
    summaries = {label: summarize(o) for label, o in results.items()}
    _print_table(summaries, Summary, scale)
    if telemetry is not None:
        # (A name a terminal would act on is shown escaped: then no longer a command
        # to paste as it is, but nothing in it reaches the terminal as such.)
        print(f"\ntelemetry written to {printable(args.db)} (scopes {', '.join(scopes)}): "
              f"polygate stats {printable(shlex.quote(args.db))} --scope {scopes[-1]}")
    if args.plot:
        return _plot(results, args.plot, scale)
    return 0


def _print_table(summaries: dict[str, Any], summary_cls: Any, scale: float) -> None:
    unit = "s"
    rows = [
        ("p50 latency", "p50_s", unit),
        ("p90 latency", "p90_s", unit),
        ("p99 latency", "p99_s", unit),
        ("max latency", "max_s", unit),
        ("calls failed", "failed", ""),
        ("extra upstream requests", "extra_requests_pct", "%"),
        ("hedges sent / won", None, ""),
        ("time spent waiting (not decoding)", "waiting_share_pct", "%"),
        ("share of time in slowest 13 % of calls", "slowest_13pct_share_pct", "%"),
    ]
    labels = list(summaries)
    width = max(len(r[0]) for r in rows) + 2
    if scale != 1.0:
        print(f"(every time below is real seconds of a replay scaled by {scale:g})")
    print(" " * width + "".join(f"{label:>18}" for label in labels))
    for title, field, suffix in rows:
        cells = []
        for label in labels:
            s = summaries[label]
            if field is None:
                cells.append(f"{s.hedges} / {s.hedge_wins}")
            else:
                value = getattr(s, field)
                if isinstance(value, float) and math.isfinite(value):
                    cells.append(f"{value:.1f}{suffix.split()[0] if suffix else ''}")
                else:
                    cells.append(str(value))
        print(f"{title:<{width}}" + "".join(f"{c:>18}" for c in cells))
    print(
        "\nwaiting = a call's total time minus the winner's decoding time "
        "(total_latency_ms - (generation_ms - ttft_ms)); see docs/statistics.md"
    )


def _telemetry_url(db: str) -> str | None:
    """``--db`` as a ``sqlite://`` URL (a path or such a URL), or None after saying why."""
    from pathlib import Path
    from urllib.parse import unquote, urlsplit

    if db.startswith("sqlite:///"):
        parts = urlsplit(db)
        if not parts.query and not parts.fragment and unquote(parts.path).strip("/"):
            return db
        # (A query or a fragment is dropped from the file's name, and sqlite:///? names
        # the default database: the demo's calls would land in a file not named.)
        print("polygate demo: --db takes a SQLite file's path or a sqlite:///path URL "
              "(no '?' or '#' in a URL: pass such a name as a path)", file=sys.stderr)
        return None
    if "://" in db or db.startswith("sqlite:") or not db.strip():
        # (Bare sqlite:// too: it names the default telemetry database, where the
        # demo's made-up calls would mix with real ones.  And sqlite:run.db, which
        # polygate stats reads as a URL, not as the file ./sqlite:run.db written here.)
        print("polygate demo: --db takes a SQLite file's path or a sqlite:///path URL",
              file=sys.stderr)
        return None
    try:
        # A path is a name: its '%', '?' and '#' are quoted, not read as a URL's
        # (the rest as it is: a name in bytes that are not UTF-8 stays that name).
        return sqlite_url(str(Path(db).absolute()))
    except OSError as exc:  # (a relative path in a working directory since deleted)
        gone = isinstance(exc, FileNotFoundError)
        reason = "the working directory is gone" if gone else exc.strerror
        print(f"polygate demo: cannot resolve --db {printable(db)}: {reason}", file=sys.stderr)
        return None


def _run_real_time(
    settings: Any, upstreams: Any, calls: int, concurrency: int, label: str, scope_name: str,
) -> list[Any]:
    import attrs
    import trio

    import polygate

    from ._replay import replay

    async def main() -> list[Any]:
        async with upstreams["a"].serve() as url_a, upstreams["b"].serve() as url_b:
            scope = settings.scopes[scope_name]
            urls = {"a": url_a, "b": url_b}
            sources = [attrs.evolve(s, base_url=urls[s.name]) for s in scope.sources]
            real = polygate.Settings(
                scopes={scope_name: attrs.evolve(scope, sources=sources)},
                telemetry=settings.telemetry,
            )

            def progress(done: int) -> None:
                bar = "#" * (30 * done // calls)
                print(f"\r{label:<18} [{bar:<30}] {done}/{calls}", end="", flush=True)

            # A progress bar is for a terminal; redirected output gets the results only.
            tty = sys.stdout.isatty()
            outcomes = await replay(real, None, calls=calls, concurrency=concurrency,
                                    on_done=progress if tty else None, scope=scope_name)
            if tty:
                print()
            return outcomes

    result: list[Any] = trio.run(main)
    return result


def _plot(results: Mapping[str, Sequence[Any]], path: str, scale: float) -> int:
    from ._replay import matplotlib_unavailable, plot_cdf, plot_path

    path = plot_path(path)

    try:
        import matplotlib  # noqa: F401 - only to tell the user what is missing
    except ImportError as exc:
        print(f"error: {matplotlib_unavailable(exc)}", file=sys.stderr)
        return 1
    xlabel = "call latency, s" + (" (scaled ÷10)" if scale != 1.0 else "")
    if not plot_cdf(results, path, title="queue-hang incident replay: latency CDF", xlabel=xlabel,
                    prog="polygate demo"):
        return 1
    print(f"wrote {printable(path)}")
    return 0
