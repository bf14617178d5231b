"""Exploration (passes on main f431ce0; not collected by pytest): random scenarios
mixing resumed streams, hedging, fallback scopes, the response cache (coalesced
identical calls, chat and stream), same-source retries, 429s with Retry-After 0,
a small recovering breaker, deadlines, outside cancellation and slow consumers,
played through polygate.testing.EventTransport under seeded Schedules.

Invariants checked per run: no group or non-polygate exception from a public call;
every answer is the whole answer (a continuation may add " ." when the cut came after
the last word); a stream's ``response.text`` is exactly what its consumer was shown;
a call without a slow consumer ends by its deadline; no call outlives its
cancellation; no task outlives the calls; governance back to zero (in_flight,
tokens_reserved, reserved == settled + released); no half-open probe left out with
nothing in flight; admissions never spin (> 300 tries per virtual second).

    python tests/interplay/explore_interplay.py N [FIRST_SEED]

1,400 scenarios (seeds 0-199, 1000-1799, 3000-3299, 5000-5299) found nothing.
"""

from __future__ import annotations

import collections
import random
import sys
import traceback
from typing import Any

import trio

import polygate
import polygate._session as session_mod
from polygate._resume import CONTINUE_PROMPT
from polygate.governance import MemoryBackend
from polygate.testing import EventTransport, FakeUpstream, RecordedRequest, Reply, Schedule

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

WORDS = [f"w{i}" for i in range(30)]
ANSWER = " ".join(WORDS)
MODES = ["ok", "ok", "trunc", "stall", "500", "429", "429", "hang", "slow"]


def behaviour(modes: list[str]) -> Any:
    """Scripted modes in arrival order, then healthy; a continuation request is
    answered with the rest of ANSWER after the text it quotes."""
    it = iter(modes)

    def pick(rec: RecordedRequest, rng: random.Random) -> Reply:
        mode = next(it, "ok")
        msgs = (rec.body or {}).get("messages") or []
        shown = ""
        if msgs and msgs[-1].get("role") == "assistant":
            shown = msgs[-1]["content"]
        elif len(msgs) >= 2 and msgs[-1].get("content") == CONTINUE_PROMPT:
            shown = msgs[-2]["content"]
        text = (ANSWER[len(shown):] if shown else ANSWER) or " ."
        ntok = max(1, len(text.split()))
        base: dict[str, Any] = {"text": text, "tokens": ntok, "inter_token_s": 0.1,
                                "first_token_s": 0.2}
        if mode == "trunc":
            return Reply(**base, fault="truncated", fault_after=rng.randint(1, max(1, ntok - 1)))
        if mode == "stall":
            return Reply(**base, stall_at=rng.randint(1, ntok), stall_s=rng.choice([3.0, 50.0]))
        if mode == "500":
            return Reply(status=500, headers_delay_s=rng.choice([0.0, 0.5]))
        if mode == "429":
            return Reply(status=429, retry_after_s=rng.choice([0.0, 0.5, 3.0]))
        if mode == "hang":
            return Reply(**{**base, "first_token_s": 40.0})
        if mode == "slow":
            return Reply(**{**base, "first_token_s": 3.0})
        return Reply(**base)

    return pick


def scenario(rng: random.Random) -> dict[str, Any]:
    return {
        "sources": {n: [rng.choice(MODES) for _ in range(rng.randint(0, 4))] for n in "abc"},
        "hedge": rng.choice([None, 1.0, 2.5]),
        "resume": rng.random() < 0.8,
        "fallback": rng.random() < 0.6,
        "same": rng.choice([0, 0, 1, 2]),
        "stall_timeout": rng.choice([None, 2.0]),
        "cache": rng.random() < 0.6,
        "calls": [
            {"kind": rng.choice(["chat", "stream", "stream"]),
             "start": rng.choice([0.0, 0.0, 0.3, 1.0]),
             "deadline": rng.choice([None, 5.0, 20.0]),
             "cancel": rng.choice([None, None, 0.5, 2.0, 6.0]),
             "pace": rng.choice([0.0, 0.0, 0.3])}
            for _ in range(rng.randint(1, 3))
        ],
        "seed": rng.randrange(1 << 30),
    }


def settings(sc: dict[str, Any]) -> polygate.Settings:
    def src(n: str) -> polygate.Source:
        return polygate.Source(name=n, base_url=f"http://{n}/v1", api_key="sk-test-key-123",
                               timeout_s=30)

    chat = polygate.Scope(
        sources=[src("a"), src("b")],
        hedge=polygate.Hedge(after_s=sc["hedge"]) if sc["hedge"] else polygate.Hedge(),
        retry=polygate.Retry(max_attempts=2, backoff_base_s=0.1, backoff_max_s=0.5,
                             rate_limit_wait_s=4.0, same_source_retries=sc["same"]),
        stream=polygate.StreamWatch(stall_timeout_s=sc["stall_timeout"], resume=sc["resume"]),
        fallback="big" if sc["fallback"] else None,
        breaker=polygate.Breaker(failures=2, open_s=1.0, max_open_s=4.0),
        cache_ttl_s=60.0 if sc["cache"] else None,
    )
    big = polygate.Scope(
        sources=[src("c")], retry=polygate.Retry(max_attempts=2, backoff_base_s=0.1),
        stream=polygate.StreamWatch(stall_timeout_s=sc["stall_timeout"], resume=sc["resume"]),
    )
    return polygate.Settings(scopes={"chat": chat, "big": big},
                             cache="memory" if sc["cache"] else "off")


def only_cancelled(group: BaseExceptionGroup[Any]) -> bool:
    return all(only_cancelled(e) if isinstance(e, BaseExceptionGroup)
               else isinstance(e, trio.Cancelled) for e in group.exceptions)


def count_tasks() -> int:
    def walk(task: Any) -> int:
        return 1 + sum(walk(c) for n in task.child_nurseries for c in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


class Counting(MemoryBackend):
    """The memory backend, stopping a run whose admissions spin."""

    def __init__(self) -> None:
        super().__init__()
        self.times: collections.deque[float] = collections.deque()

    async def admit(self, request: Any) -> Any:
        now = trio.current_time()
        self.times.append(now)
        while self.times and self.times[0] <= now - 1.0:
            self.times.popleft()
        if len(self.times) > 300:
            raise KeyboardInterrupt(f"admissions spin at t={now}")
        return await super().admit(request)


async def one_call(s: polygate.Session, i: int, spec: dict[str, Any], out: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "same question"}]
    await trio.sleep(spec["start"])
    t0 = trio.current_time()
    r: dict[str, Any] = {"i": i, "spec": spec, "t0": t0, "shown": None, "text": None, "err": None}
    with trio.CancelScope() as cs:
        if spec["cancel"] is not None:
            cs.deadline = t0 + spec["cancel"]
        try:
            if spec["kind"] == "chat":
                r["text"] = (await s.chat(messages, call_deadline_s=spec["deadline"])).text
            else:
                seen = []
                async with s.stream_chat(messages, call_deadline_s=spec["deadline"]) as stream:
                    async for chunk in stream:
                        seen.append(chunk.text)
                        if spec["pace"]:
                            await trio.sleep(spec["pace"])
                assert stream.response is not None
                r["shown"], r["text"] = "".join(seen), stream.response.text
        except polygate.PolygateError as exc:
            r["err"] = exc
        except BaseExceptionGroup as group:
            if not only_cancelled(group):
                r["problem"] = f"group {group!r}"
            raise
        except Exception as exc:
            r["problem"] = f"{type(exc).__name__}: {exc!r}"
    r["cancelled"] = cs.cancelled_caught
    r["t1"] = trio.current_time()
    out["calls"].append(r)


async def play(sc: dict[str, Any], out: dict[str, Any]) -> None:
    backend = Counting()
    session_mod._backend_for = lambda settings: backend
    ups = {n: FakeUpstream(behaviour(m), name=n, seed=sc["seed"]) for n, m in sc["sources"].items()}
    async with polygate.session(settings(sc), transport=EventTransport(ups),
                                rng=random.Random(sc["seed"])) as s:
        before = count_tasks()
        with trio.move_on_after(400) as limit:
            async with trio.open_nursery() as nursery:
                for i, spec in enumerate(sc["calls"]):
                    nursery.start_soon(one_call, s, i, spec, out)
        if limit.cancelled_caught:
            out["problems"].append("liveness: calls still running at 400 s")
            return
        if count_tasks() != before:
            out["problems"].append(f"tasks {before} -> {count_tasks()}")
        for src in (await s.statistics()).governance.sources:
            x = src.state
            if x.in_flight or x.tokens_reserved or x.reserved_total != x.settled_total + x.released_total:
                out["problems"].append(f"governance leak {x}")
        for key, state in backend._sources.items():
            if state.probe_out and state.in_flight == 0:
                out["problems"].append(f"probe_out stuck on {key} with nothing in flight")


def check(out: dict[str, Any]) -> list[str]:
    problems = list(out["problems"])
    for r in out["calls"]:
        spec, i = r["spec"], r["i"]
        if "problem" in r:
            problems.append(f"call {i}: {r['problem']}")
        if r["text"] is not None:
            if r["text"] not in (ANSWER, ANSWER + " ."):
                problems.append(f"call {i} {spec['kind']}: text {r['text']!r} != ANSWER")
            if spec["kind"] == "stream" and r["shown"] != r["text"]:
                problems.append(f"call {i}: shown {r['shown']!r} != response {r['text']!r}")
        took = r["t1"] - r["t0"]
        if spec["deadline"] is not None and not spec["pace"] and took > spec["deadline"] + 1e-6:
            problems.append(f"call {i}: ended {took:.3f}s after start, deadline {spec['deadline']}")
        if spec["cancel"] is not None and not r["cancelled"] and took > spec["cancel"] + 1e-6:
            problems.append(f"call {i}: outlived its cancellation")
    return problems


def run_one(sc: dict[str, Any], seed: int) -> list[str]:
    out: dict[str, Any] = {"calls": [], "problems": []}
    original = session_mod._backend_for
    try:
        Schedule(seed).run(play, sc, out)
    except BaseException as exc:  # every way out is a finding
        out["problems"].append("crash: " + "".join(traceback.format_exception(exc)[-3:]))
    finally:
        session_mod._backend_for = original
    return check(out)


def main() -> None:
    count = int(sys.argv[1])
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    found = 0
    for seed in range(first, first + count):
        sc = scenario(random.Random(seed))
        problems = run_one(sc, seed)
        if problems:
            found += 1
            print(f"--- seed {seed}: {sc}")
            for line in problems[:5]:
                print("   ", line[:600])
    print(f"{found} of {count} scenarios broke an invariant")


if __name__ == "__main__":
    main()
