"""``polygate stats`` (what it does is its help, ``_DESCRIPTION``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from .._paths import sqlite_url
from .._secrets import printable

# The command's --help: a constant, not the module's docstring, which python -OO
# (PYTHONOPTIMIZE=2) drops.
_DESCRIPTION = """``polygate stats``: the incident's questions, answered from a telemetry database.

Reads the ``calls``, ``attempts`` and ``sessions`` tables that a session with
``telemetry`` set writes (SQLite or PostgreSQL, read-only) and prints latency
quantiles per scope and source, the share of all time the slowest calls take,
waiting versus generating, hedging, the response cache's hit rate, error classes,
attempts per call and each source's attempts.  ``--json`` prints the same as data; ``--plot`` draws the latency
CDF per source and where the time went (needs matplotlib, polygate's ``plot`` extra).

Exit status: 0 with a report, 1 when there is nothing to report (no database, no
calls in the window) or the database cannot be read, 2 for bad arguments.
"""

__all__ = ["add_parser", "parse_since", "run"]

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "stats",
        help="latency, tail share, waiting vs generating and hedging from a telemetry database",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--db", metavar="URL",
        help="sqlite:///path, a SQLite file, or postgresql://… (default: the configured "
             "telemetry, else the default SQLite file under the user's state directory)",
    )
    parser.add_argument(
        "database", nargs="?", metavar="DB",
        help="the same as --db (polygate stats telemetry.db)",
    )
    parser.add_argument(
        "--since", metavar="WHEN",
        help="only calls started since WHEN: an age (90s, 30m, 6h, 2d, 1w) or an ISO date/time",
    )
    parser.add_argument("--scope", help="only calls of this scope")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write plots (needs matplotlib: the plot extra)")
    parser.add_argument(
        "--tail", metavar="PCTS", default="1,5,10,13,25",
        help="slowest-calls shares to report, in %% (default: 1,5,10,13,25)",
    )
    return parser


#: The earliest time a date can name (1 January of year 1): an age reaching before it
#: names no time at all (a --since of 100000000w went on as a negative epoch).
_EARLIEST = datetime(1, 1, 1, tzinfo=timezone.utc).timestamp()


def parse_since(text: str, now: float | None = None) -> float:
    """``30m``-style ages or ISO 8601 date/times (local time unless an offset is
    given) to epoch seconds; ``ValueError`` otherwise."""
    now = time.time() if now is None else now
    match = _AGO.match(text)
    if match:
        since = now - float(match.group(1)) * _UNIT_S[match.group(2)]
        if not math.isfinite(since) or since < _EARLIEST:
            shown = text if len(text) <= 40 else text[:40] + "…"
            raise ValueError(f"--since {shown!r}: an age too large to be a time")
        return since
    try:
        when = datetime.fromisoformat(_iso_as_310_reads_it(text.strip()))
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected an age like 30m, 6h, 2d or an ISO date/time"
        ) from None
    try:
        return when.timestamp()
    except (ValueError, OverflowError, OSError):
        # A valid date the local time zone cannot convert (year 1 minus an offset).
        raise ValueError(f"--since {text!r}: a date out of range; give an offset "
                         "(2026-01-01T00:00+00:00) or a later one") from None


def _tails(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--tail {text!r}: expected percentages in (0, 100], comma-separated")
    return values


#: A time's fraction of a second (Python 3.10 reads only 3 or 6 digits of it).
_FRACTION = re.compile(r"(T[0-9:]+)\.([0-9]+)")


def _iso_as_310_reads_it(text: str) -> str:
    """``text`` as Python 3.10's ``fromisoformat`` reads it too (3.11 reads most of
    ISO 8601): a ``Z`` (or RFC 3339's ``z``) is ``+00:00``, a fraction has six digits."""
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    return _FRACTION.sub(lambda m: f"{m.group(1)}.{(m.group(2) + '000000')[:6]}", text, count=1)


def default_db(env: dict[str, str] | None = None) -> str:
    """The configured telemetry URL when there is one, else the default SQLite file."""
    from .._config import FieldError, as_utf8, gathered_warnings
    from .._config_load import load_settings, locate_config, read_toml
    from .._errors import ConfigError
    from ..telemetry import default_path

    environ = dict(os.environ) if env is None else env
    try:
        with gathered_warnings():
            # (keys beside a file are the configuration's business, not the report's)
            configured: Any = load_settings(environ).telemetry
    except ConfigError:
        # Not a whole configuration (a machine that only reads reports may name just
        # the database): the telemetry key itself, from the file or the environment.
        path = locate_config(environ)
        if path is None:
            # Read as a session reads it (stripped; empty is unset): a padded value
            # named another file than the one the sessions write.
            configured = as_utf8(environ.get("POLYGATE__TELEMETRY", "").strip()) or "off"
            where = "POLYGATE__TELEMETRY"
        else:
            # A file named that is missing or not TOML is an error, as for every other
            # command: reporting on the default database instead would answer about
            # another database than the one configured.
            configured = read_toml(path).get("telemetry", "off")
            where = f"{printable(path)}: telemetry"
        # Checked as the settings check it (a ConfigError that never quotes a
        # password): unchecked, a libpq "key=value" string was read as a file's path
        # and printed whole, its password with it.  Named by what the user wrote.
        try:
            _checked_telemetry(configured)
        except FieldError as exc:
            raise ConfigError(f"{where}: {exc.problem}") from None
    if isinstance(configured, str) and configured and configured != "off":
        return configured
    # (Quoted: a state folder named with '#', '?' or '%' is a name, not a URL's parts.)
    return sqlite_url(str(default_path(environ)))


def _checked_telemetry(value: Any) -> None:
    from .._config import Scope, Settings, Source

    stand_in = {"stats": Scope(sources=[Source(name="stats", base_url="http://127.0.0.1/v1")])}
    Settings(scopes=stand_in, telemetry=value)


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite as ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def run(args: argparse.Namespace) -> int:
    from .._config import mask_url
    from .._errors import ConfigError
    from ..telemetry._report import NoData, build_report, open_reader, read_rows

    for name, value in (("--since", args.since), ("--db", args.db), ("DB", args.database),
                        ("--scope", args.scope), ("--plot", args.plot)):
        if value is not None and not value.strip():
            # (--since "$SINCE" with SINCE unset: not "every call ever recorded")
            print(f"polygate stats: {name} is empty", file=sys.stderr)
            return 2
    try:
        since = parse_since(args.since) if args.since is not None else None
        tails = _tails(args.tail)
    except ValueError as exc:
        print(f"polygate stats: {printable(str(exc))}", file=sys.stderr)
        return 2
    if args.database and args.db and args.database != args.db:
        print("polygate stats: give the database once, as DB or as --db", file=sys.stderr)
        return 2
    try:
        url = args.db or args.database or default_db()
    except ConfigError as exc:
        print(f"polygate stats: invalid configuration: {printable(str(exc))}", file=sys.stderr)
        return 2
    where = mask_url(url)
    try:
        reader = open_reader(url)
        try:
            calls, attempts, sessions = read_rows(reader, since=since, scope=args.scope)
        finally:
            reader.close()
        report = build_report(calls, attempts, sessions, tails=tails, scope=args.scope)
    except NoData as exc:
        print(f"polygate stats: {_no_data(exc, where, args)}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"polygate stats: {printable(str(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:  # sqlite3 / psycopg errors: say what, not a traceback
        print(f"polygate stats: cannot read {printable(where)}: {type(exc).__name__}: "
              f"{printable(str(exc))}",
              file=sys.stderr)
        return 1
    report = {"database": where, "since": since, "scope": args.scope, **report}
    if args.json:
        # (Sums of huge finite figures can still overflow to an infinity: null in JSON,
        # which has no Infinity or NaN.)
        print(json.dumps(_finite(report), indent=2, allow_nan=False))
    else:
        print(render(report))
    if args.plot:
        return _plot(calls, args.plot)
    return 0


def _no_data(exc: Exception, where: str, args: argparse.Namespace) -> str:
    text = str(exc)
    if text == "no calls recorded":
        window = []
        if args.since:
            window.append(f"since {args.since}")
        if args.scope:
            window.append(f"in scope {args.scope!r}")
        text = f"no calls recorded in {printable(where)}" + (f" {' '.join(window)}" if window else "")
    return (
        f"{text}.\nTelemetry is written by sessions whose settings set telemetry, e.g. "
        "POLYGATE__TELEMETRY=sqlite:///path/to/telemetry.db; point --db at that database."
    )


# --------------------------------------------------------------------------- text


def _dur(ms: float | None) -> str:
    # (Not finite: the sum of a file's huge latencies, which --json shows as null.)
    if ms is None or not math.isfinite(ms):
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms >= 1e12:  # (past ~30 years: a number no one reads 300 digits of)
        return f"{ms / 1000:.3g} s"
    return f"{ms / 1000:.2f} s" if ms < 10_000 else f"{ms / 1000:.1f} s"


def _p(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f} %"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    rows = [[printable(c) for c in r] for r in rows]  # (escaped before they are measured)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]  # rows may be none
    align = [str.ljust if i < 2 else str.rjust for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return indent + "  ".join(align[i](c, widths[i]) for i, c in enumerate(cells)).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    first = datetime.fromtimestamp(report["first_call_at"]).strftime("%Y-%m-%d %H:%M:%S")
    last = datetime.fromtimestamp(report["last_call_at"]).strftime("%Y-%m-%d %H:%M:%S")
    scope = f", scope {report['scope']!r}" if report.get("scope") else ""
    out.append(f"{report['calls']} calls, {report['attempts']} attempts in {report['database']}{scope}")
    out.append(f"calls started {first} … {last}")
    outcomes = ", ".join(f"{k} {v}" for k, v in report["outcomes"].items())
    errors = ", ".join(f"{k} {v}" for k, v in report["error_classes"].items())
    out.append(f"outcomes: {outcomes}" + (f" ({errors})" if errors else ""))

    out += ["", "Latency of calls (total_latency_ms; failed calls grouped by outcome)"]
    out += _table(
        ["scope", "source", "calls", "p50", "p90", "p99", "max"],
        [[r["scope"], r["source"], str(r["calls"]), _dur(r["p50_ms"]), _dur(r["p90_ms"]),
          _dur(r["p99_ms"]), _dur(r["max_ms"])] for r in report["latency"]],
    )

    out += ["", "Share of all call time taken by the slowest calls"]
    for t in report["tail_share"]:
        out.append(f"  slowest {t['slowest_pct']:g} % ({t['calls']} calls): {_p(t['share_pct'])} of the time")

    w = report["waiting_vs_generating"]
    total = w["total_ms"]
    other = f"; {w['other_calls']} embedding and OCR calls not split" if w["other_calls"] else ""
    out += ["", f"Waiting vs generating ({w['successful_calls']} successful chat calls, "
                f"{_dur(total)} in all{other})"]
    if total:
        for label, key in (("waiting (total - generation)", "waiting_ms"),
                           ("time to first token", "ttft_ms"), ("stalls", "stall_ms"),
                           ("decoding", "active_decode_ms"),
                           ("rest of generation", "other_generation_ms")):
            out.append(f"  {label:<30}{_dur(w[key]):>10}  {_p(100 * w[key] / total):>7}")
    out.append("  everything but decoding (waiting + time to first token, and failed calls whole): "
               f"{_p(w['not_decoding_pct'])}")
    out.append(f"  TTFT p50 {_dur(w['ttft_p50_ms'])}, p90 {_dur(w['ttft_p90_ms'])}, "
               f"p99 {_dur(w['ttft_p99_ms'])}")
    out.append(f"  calls with stalls: {w['calls_with_stalls']} ({_p(w['calls_with_stalls_pct'])}), "
               f"{w['stalls']} stalls, p90 stall time per stalled call {_dur(w['stall_p90_ms'])}")
    if w["failed_calls"]:
        out.append(f"  failed or cancelled calls: {w['failed_calls']}, {_dur(w['failed_calls_ms'])}")

    h = report["hedging"]
    out += ["", "Hedging"]
    out.append(f"  hedged calls: {h['hedged_calls']} ({_p(h['hedge_rate_pct'])}), {h['hedges']} hedges sent")
    out.append(f"  won by the hedge: {h['hedge_wins']} ({_p(h['hedge_win_rate_pct'])} of hedged calls)")
    out.append(f"  hedges suppressed by the budget: {h['suppressed_by_budget']} calls (session totals)")

    c = report.get("cache")
    if c is not None and c["cached_calls"]:
        out += ["", "Response cache"]
        out.append(f"  served from the cache: {c['cached_calls']} calls, "
                   f"hit rate {_p(c['hit_rate_pct'])} of successful calls")
        if len(c["scopes"]) > 1:
            for name, row in c["scopes"].items():
                out.append(f"    {name}: {row['cached_calls']} of {row['calls']} ({_p(row['hit_rate_pct'])})")

    a = report["attempts_per_call"]
    histogram = ", ".join(f"{k}: {v}" for k, v in a["histogram"].items())
    out += ["", f"Attempts per call: mean {a['mean']:.2f} ({histogram})"]

    out += ["", "Attempts per source"]
    out += _table(
        ["scope", "source", "attempts", "hedges", "failures", "deadline", "p50 ok", "p99 ok", "ttft p50",
         "outcomes"],
        [[r["scope"], r["source"], str(r["attempts"]), str(r["hedge_attempts"]), _p(r["failure_pct"]),
          _p(r["deadline_pct"]),
          _dur(r["ok_latency"]["p50_ms"]), _dur(r["ok_latency"]["p99_ms"]), _dur(r["ttft_p50_ms"]),
          " ".join(f"{k}={v}" for k, v in r["outcomes"].items())] for r in report["sources"]],
    )
    t = report["telemetry"]
    if t["rows_dropped"]:
        out += ["", f"warning: {t['rows_dropped']} telemetry rows were dropped by these sessions; "
                    "the figures above miss them"]
    # A name the file holds (a scope, a source, an error class: another tool's file, or
    # one edited by hand) is shown escaped, as a path is: a line break or an escape
    # sequence in it never splits a line or reaches the terminal as such.
    return "\n".join(printable(line) for line in out)


# --------------------------------------------------------------------------- plots


#: The plot's shortest latency (log axis): 0.1 ms.
_PLOT_MIN_S = 1e-4


def _plot(calls: Sequence[Any], path: str) -> int:
    from ._replay import matplotlib_unavailable, plot_path, save_plot

    path = plot_path(path)

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"polygate stats: {matplotlib_unavailable(exc)}", file=sys.stderr)
        return 1
    from ..telemetry._report import answered_by, split_calls, time_split

    # Grouped as the latency table groups them: a cache hit, or a fallback scope's
    # source, is not the asked scope's source.
    groups: dict[str, list[float]] = {}
    for c in calls:
        groups.setdefault(f"{c.scope}/{answered_by(c)}", []).append(c.total_latency_ms / 1000.0)
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for label, values in sorted(groups.items()):
        # From 0 at the fastest call: a group of one call is then a step, not a lone
        # point that draws nothing; and a 0 ms call (virtual time) stays on the log axis.
        values = sorted(max(v, _PLOT_MIN_S) for v in values)
        cdf.step([values[0], *values], [0.0, *((i + 1) / len(values) for i in range(len(values)))],
                 where="post", label=f"{label} ({len(values)})")
    cdf.set_xscale("log")
    cdf.set_xlabel("call latency, s")
    cdf.set_ylabel("fraction of calls")
    cdf.set_title("latency CDF per scope/source")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize="small")
    parts = [("waiting", "waiting_ms"), ("first token", "ttft_ms"), ("stalls", "stall_ms"),
             ("decoding", "active_decode_ms"), ("rest", "other_generation_ms")]
    ok = [c for c in split_calls(calls) if c.outcome == "ok"]
    by_source: dict[str, list[Any]] = {"all successful": ok}
    for c in ok:
        by_source.setdefault(f"{c.scope}/{answered_by(c)}", []).append(c)
    labels = list(by_source)[::-1]
    splits = [time_split(by_source[label]) for label in labels]
    left = [0.0] * len(labels)
    for name, key in parts:
        shares = [100.0 * s[key] / (s["total_ms"] or 1.0) for s in splits]
        bars.barh(labels, shares, left=left, label=name)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    bars.set_xlim(0, 100)
    bars.set_xlabel("% of total call time")
    bars.set_title("where the time of successful chat calls went")
    bars.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=5)
    fig.tight_layout()
    if not save_plot(fig, path, "polygate stats"):
        return 1
    print(f"wrote {printable(path)}", file=sys.stderr)
    return 0
