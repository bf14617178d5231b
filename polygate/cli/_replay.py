"""Replaying the queue-hang incident (``docs/incident.md``) on the built-in fake upstream.

Shared by ``polygate demo`` and ``benchmarks/tail_replay.py``.  Two equivalent sources:
``a`` hangs before its first token on ``hang_p`` of the calls (90–96 s, the incident's
narrow peak) and is otherwise healthy; ``b`` is healthy.  Output length varies as real
traffic does: a median of ~186 tokens, and 10 % of the calls generate 1,500–3,000
tokens at ~40 tokens/s — healthy calls of 40–75 s that a whole-call timeout cannot
tell from a hang.
"""

from __future__ import annotations

import math
import os
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio
import trio.testing

import polygate
from polygate._secrets import printable
from polygate.testing import FakeUpstream, Profile, Router

__all__ = [
    "Outcome",
    "Summary",
    "incident_upstreams",
    "plot_cdf",
    "save_plot",
    "replay",
    "run_virtual",
    "scope_settings",
    "summarize",
    "tokens_distribution",
]

TOKENS_PER_S = 40.0


def tokens_distribution(rng: random.Random) -> float:
    """Median ~186 tokens; 10 % long generations of 1,500–3,000 tokens."""
    if rng.random() < 0.10:
        return rng.uniform(1500, 3000)
    return min(max(rng.lognormvariate(math.log(186), 0.45), 20), 900)


def incident_upstreams(
    *,
    seed: int = 24,
    hang_p_a: float = 0.25,
    hang_p_b: float = 0.0,
    time_scale: float = 1.0,
    tokens: Callable[[random.Random], float] = tokens_distribution,
    stall_p: float = 0.0,
    stall_s: tuple[float, float] = (50.0, 60.0),
) -> dict[str, FakeUpstream]:
    """The two sources of the incident; ``time_scale`` shrinks every delay."""
    s = time_scale

    def profile(hang_p: float) -> Profile:
        return Profile(
            first_token_s=(0.5 * s, 2.0 * s),
            inter_token_s=s / TOKENS_PER_S,
            tokens=tokens,
            hang_p=hang_p,
            hang_s=(90.0 * s, 96.0 * s),
            stall_p=stall_p,
            stall_s=(stall_s[0] * s, stall_s[1] * s),
        )

    return {
        "a": FakeUpstream(profile(hang_p_a), seed=seed, name="a"),
        "b": FakeUpstream(profile(hang_p_b), seed=seed + 1, name="b"),
    }


@attrs.frozen
class Outcome:
    """One logical call of a replay."""

    ok: bool
    total_s: float
    generation_s: float
    ttft_s: float | None
    attempts: int
    hedges: int
    hedge_won: bool
    error: str | None = None


async def replay(
    settings: polygate.Settings,
    transport: Any,
    *,
    calls: int,
    concurrency: int,
    on_done: Callable[[int], None] | None = None,
    scope: str = "chat",
) -> list[Outcome]:
    """``calls`` chat calls, ``concurrency`` at a time, each timed by its CallStats."""
    outcomes: list[Outcome] = []
    limiter = trio.Semaphore(concurrency)
    messages = [{"role": "user", "content": "Summarise the incident report in one paragraph."}]

    async with polygate.session(settings, transport=transport, rng=random.Random(7)) as s:

        async def one() -> None:
            try:
                r = await s.chat(messages, scope=scope)
            except polygate.PolygateError as exc:
                stats = getattr(exc, "call_stats", None)
                outcomes.append(Outcome(
                    False,
                    stats.total_latency_ms / 1000 if stats else 0.0,
                    0.0, None,
                    stats.attempts if stats else 0,
                    stats.hedges if stats else 0,
                    False,
                    type(exc).__name__,
                ))
            else:
                st = r.call_stats
                outcomes.append(Outcome(
                    True, st.total_latency_ms / 1000, st.generation_ms / 1000,
                    st.ttft_ms / 1000 if st.ttft_ms is not None else None,
                    st.attempts, st.hedges, st.hedge_won,
                ))
            finally:
                limiter.release()
                if on_done is not None:
                    on_done(len(outcomes))

        async with trio.open_nursery() as nursery:
            for _ in range(calls):
                await limiter.acquire()
                nursery.start_soon(one)
    return outcomes


def run_virtual(
    settings: polygate.Settings,
    upstreams: Mapping[str, FakeUpstream],
    *,
    calls: int,
    concurrency: int,
    seed: int = 0,
    scope: str = "chat",
) -> list[Outcome]:
    """The replay in virtual time: 90-second hangs cost milliseconds of wall time."""

    async def main() -> list[Outcome]:
        return await replay(settings, Router(dict(upstreams)), calls=calls,
                            concurrency=concurrency, scope=scope)

    # trio shuffles its run queue with a module-level Random; seeding it (when the
    # attribute exists) makes a virtual replay repeatable run after run.
    scheduler = getattr(getattr(trio, "_core", None), "_run", None)
    if scheduler is not None and hasattr(scheduler, "_r"):
        scheduler._r.seed(seed)
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


@attrs.frozen
class Summary:
    calls: int
    failed: int
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float
    extra_requests_pct: float
    hedges: int
    hedge_wins: int
    waiting_share_pct: float
    slowest_13pct_share_pct: float
    waiting_p99_s: float

    def row(self) -> dict[str, Any]:
        return attrs.asdict(self)


def summarize(outcomes: Sequence[Outcome]) -> Summary:
    totals = [o.total_s for o in outcomes]
    ok = [o for o in outcomes if o.ok]
    requests = sum(o.attempts for o in outcomes)
    extra = requests - len(outcomes)
    total_time = sum(totals) or 1.0
    # Waiting overhead: everything but decoding (the winner's generation minus its TTFT).
    waits = [o.total_s - o.generation_s + (o.ttft_s or 0.0) for o in ok]
    # A failed call decoded nothing the caller got: all of its time was waiting.
    waiting = sum(waits) + sum(o.total_s for o in outcomes if not o.ok)
    slow_n = max(1, math.ceil(0.13 * len(totals)))
    slowest = sum(sorted(totals, reverse=True)[:slow_n])
    return Summary(
        calls=len(outcomes),
        failed=len(outcomes) - len(ok),
        p50_s=_quantile(totals, 0.50),
        p90_s=_quantile(totals, 0.90),
        p99_s=_quantile(totals, 0.99),
        max_s=max(totals) if totals else math.nan,
        extra_requests_pct=100.0 * extra / max(1, len(outcomes)),
        hedges=sum(o.hedges for o in outcomes),
        hedge_wins=sum(o.hedge_won for o in outcomes),
        waiting_share_pct=100.0 * waiting / total_time,
        slowest_13pct_share_pct=100.0 * slowest / total_time,
        waiting_p99_s=_quantile(waits, 0.99),
    )


def matplotlib_unavailable(exc: ImportError) -> str:
    """Why ``--plot`` cannot draw: matplotlib missing (how to install it), or installed
    and failing to import -- a build for another numpy, a broken install -- which
    installing it again would not mend ("Requirement already satisfied")."""
    missing = exc.name
    if isinstance(exc, ModuleNotFoundError) and missing is not None and (
            missing == "matplotlib" or missing.startswith("matplotlib.")):
        return "--plot needs matplotlib: pip install 'matplotlib>=3.8' (polygate's plot extra)"
    reason = printable(str(exc).strip().partition("\n")[0])[:200]
    return f"--plot: matplotlib is installed but cannot be imported ({type(exc).__name__}: {reason})"


def plot_path(path: str) -> str:
    """The file a plot is written to: a name without an extension gets ``.png`` (as
    matplotlib would give it), and :func:`save_plot` writes exactly that name."""
    return path if len(os.path.splitext(path)[1]) > 1 else path + ".png"


def _plot_format(path: str) -> str:
    # Given to matplotlib, which then writes the name as it is: left to find the
    # format itself, it reads "plot." or "sub/.png" its own way ("plot.png",
    # "sub/.png.png") and the file said to the user was not the one written.
    ext = os.path.splitext(path)[1]
    return ext[1:] if len(ext) > 1 else "png"


def save_plot(fig: Any, path: str, prog: str) -> bool:
    """Write ``fig`` to ``path`` (closing it); False, with one line on stderr naming
    why, when it cannot be written (no such folder, no permission, a format matplotlib
    does not know)."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=120, format=_plot_format(path))
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"{prog}: cannot write the plot to {printable(path)}: {reason}", file=sys.stderr)
        return False
    finally:
        plt.close(fig)
    return True


def plot_cdf(
    results: Mapping[str, Sequence[Outcome]], path: str, *, title: str, xlabel: str,
    prog: str = "polygate",
) -> bool:
    """Latency CDFs, one line per configuration, on a log axis (needs matplotlib;
    failed calls count at the time they failed); False when it cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, outcomes in results.items():
        totals = sorted(o.total_s for o in outcomes)
        ax.step(totals, [(i + 1) / len(totals) for i in range(len(totals))], where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of calls")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return save_plot(fig, path, prog)


def scope_settings(
    *,
    hedge: polygate.Hedge | None = None,
    call_deadline_s: float | None = None,
    timeout_s: float = 300.0,
    max_attempts: int = 3,
) -> polygate.Settings:
    sources = [
        polygate.Source(name=n, base_url=f"http://{n}/v1", timeout_s=timeout_s) for n in ("a", "b")
    ]
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=sources,
        hedge=hedge or polygate.Hedge(),
        call_deadline_s=call_deadline_s,
        retry=polygate.Retry(max_attempts=max_attempts, backoff_base_s=0.0),
    )})
