"""A hostile (or merely odd) model's answers against structured output: each test here
was a reviewer's probe that failed on the code before its fix.

- a huge integer against a float ``multipleOf`` was a ConfigError after the call (the
  schema blamed), and ``1e400`` (read as infinity) passed as a value;
- ``uniqueItems`` compared unsortable items pair by pair: quadratic, past any budget;
- an answer's key holding a line break or an escape sequence forged problem lines;
- a validation thread that waited for a thread token, or whose call was cancelled,
  computed on past its call (holding one of trio's shared thread tokens).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pydantic
import pytest
import trio
import trio.testing

import polygate
from polygate import _structured
from polygate._errors import ConfigError
from polygate._structured import Invalid, schema_of
from polygate._threads import CPU_THREADS, cpu_limiter
from polygate.testing import FakeUpstream, RecordedRequest, Reply, Router

from ._no_threads import no_threads
from .test_structured_regex import _UNION, _chain

MESSAGES = [{"role": "user", "content": "hello there"}]


async def _eventually(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether ``condition`` came true within ``seconds`` (looked at every 10 ms: what
    it watches happens in a worker thread, which has no trio event to set)."""
    for _ in range(int(seconds * 100)):
        if condition():
            return True
        await trio.sleep(0.01)
    return condition()


def _settings(**scope: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], **scope)})


def _by_round(*texts: str) -> Any:
    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        done = sum(1 for m in rec.body["messages"] if m.get("role") == "assistant")
        return Reply(text=texts[min(done, len(texts) - 1)])
    return behaviour


# ---------------------------------------------------------------- 1. multipleOf overflow

HALVES = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}},
          "required": ["x"]}


async def test_a_huge_integer_against_a_float_multipleof_is_judged_not_a_config_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """jsonschema's multipleOf divides the integer by the float outside its own guard:
    an OverflowError, which the call took for a broken schema (a ConfigError, the
    request paid for, nothing re-asked).  Judged exactly: 10**400 is a multiple of 0.5,
    10**400 + 1 is not a multiple of 2.0."""
    up = FakeUpstream(Reply(text='{"x": 1' + "0" * 400 + "}"))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=HALVES)
    assert r.parsed == {"x": 10**400}
    evens = schema_of({"type": "integer", "multipleOf": 2.0})
    with pytest.raises(Invalid):  # (its message cut: 400 digits)
        evens.validate("1" + "0" * 399 + "1")


# ---------------------------------------------------------------- 2. uniqueItems is unbudgeted

UNIQUE = {"type": "array", "uniqueItems": True}


def _distinct_objects(n: int) -> str:
    # dicts do not sort: jsonschema's uniq falls back to comparing every pair
    return json.dumps([{"": i} for i in range(n)], separators=(",", ":"))


def test_unique_items_is_checked_in_linear_time() -> None:
    """jsonschema compares unsortable items (objects, mixed types) pair by pair: 4,000
    distinct objects took ~15 s, in one keyword call no budget could stop."""
    schema = schema_of(UNIQUE)
    start = time.perf_counter()
    assert len(schema.validate(_distinct_objects(4000))) == 4000
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(("items", "unique"), [
    ([1, 1.0], False), ([True, 1], True), ([False, 0], True), ([0, 0.0, False], False),
    ([{"a": [1, {"b": 2}]}, {"a": [1, {"b": 2.0}]}], False), ([{"a": 1}, {"a": True}], True),
    ([[1, 2], [2, 1]], True), (["1", 1], True), ([None, None], False), ([{}, []], True),
    ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], False), ([2**60, float(2**60)], False),
])
def test_unique_items_means_what_jsonschema_means(items: list[Any], unique: bool) -> None:
    import jsonschema

    assert jsonschema.Draft202012Validator(UNIQUE).is_valid(items) is unique
    text = json.dumps(items)
    if unique:
        assert schema_of(UNIQUE).validate(text) == items
    else:
        with pytest.raises(Invalid, match="has non-unique elements"):
            schema_of(UNIQUE).validate(text)


# ---------------------------------------------------------------- 3. problem lines forged by keys

FREE_INTS = {"type": "object", "additionalProperties": {"type": "integer"}}


class FreeInts(pydantic.BaseModel):
    values: dict[str, int]


def _keyed(kind: str, key: str) -> tuple[Any, str]:
    """A schema of integer values (a dict one, or a model's), and an answer whose one
    value under ``key`` is no integer: a problem whose path holds the key."""
    if kind == "dict":
        return FREE_INTS, json.dumps({key: "not an integer"})
    return FreeInts, json.dumps({"values": {key: "not an integer"}})


_FORGED_KEY = "k\n$.forged: \x1b[2Jpretend problem"


@pytest.mark.parametrize("kind", ["dict", "pydantic"])
async def test_a_key_cannot_add_lines_or_control_characters_to_the_problems(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    """docs/structured.md: 'Problems are reported one per line as `$.path: message`'.
    An answer's key goes raw into the path (jsonschema's json_path escapes only \\ and
    ', polygate's _json_path nothing): a key holding a newline and an escape sequence
    makes one problem two lines, a forged one among them, and puts ESC [2J into
    StructuredOutputError.errors and into the next prompt's problem list.
    Expected: one line, control characters escaped (as the messages' repr does)."""
    schema, answer = _keyed(kind, _FORGED_KEY)
    up = FakeUpstream(Reply(text=answer))
    settings = _settings(structured=polygate.Structured(max_reasks=1))
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.StructuredOutputError) as caught:
            await s.chat(MESSAGES, schema=schema)
    first = caught.value.errors[0]
    reask = up.requests[1].body["messages"][-1]["content"]
    assert "\x1b" not in first and "\x1b" not in reask
    assert len(first.splitlines()) == 1, first.splitlines()
    assert not any(line.startswith("$.forged") for line in reask.splitlines()), reask


# ---------------------------------------------------------------- 4. abandoned threads compute on

UNION = _UNION  # an expression tree: its check exponential in the answer's nesting


def _record_ends(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    ended: list[float] = []
    original = _structured._DictSchema.validate

    def recording(self: Any, text: str, *args: Any) -> Any:
        on_loop = threading.current_thread() is threading.main_thread()
        try:
            return original(self, text, *args)
        finally:
            if not on_loop:
                ended.append(time.perf_counter())

    monkeypatch.setattr(_structured._DictSchema, "validate", recording)
    return ended


async def test_a_thread_that_waited_for_a_token_stops_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """_validated computes the thread's budget as *seconds* (deadline - now) before the
    thread is started, and budget() starts counting when the thread runs: a thread that
    first waited for one of trio's thread tokens computes on past the call's deadline by
    that wait (docs: 'the thread stops itself then, never computing on after the call').
    Here: every token of the checks' own limiter (cpu_limiter, since the session of
    2026-12-07) held 1 s by other work; deadline 1.5 s; the check ended ~2.5 s."""
    ended = _record_ends(monkeypatch)
    schema_of(UNION).compile()
    limiter = cpu_limiter()
    up = FakeUpstream(Reply(text=_chain(24)))
    async with polygate.session(_settings(call_deadline_s=1.5), transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(int(limiter.total_tokens)):
                nursery.start_soon(functools.partial(
                    trio.to_thread.run_sync, time.sleep, 1.0, limiter=limiter))
            await trio.sleep(0.05)
            start = time.perf_counter()
            with pytest.raises(polygate.DeadlineExceeded):
                await s.chat(MESSAGES, schema=UNION)
        await _eventually(lambda: bool(ended), 4)
    assert ended
    assert ended[0] - start < 1.5 + 0.4, f"the check ended {ended[0] - start:.2f} s after the call began"


async def test_a_cancelled_calls_thread_stops_at_the_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call with no deadline whose caller cancels it (a client gone, a cancel
    scope's cancel()) abandons its check's thread, which computes on to its budget,
    min(effective deadline, _OFF_LOOP_S) = 60 s: the effective deadline is inf, the
    cancel is no deadline.  docs/structured.md: 'the thread stops itself then, never
    computing on after the call'.  (Monkeypatched to 8 s to keep the probe short.)"""
    monkeypatch.setattr(_structured, "_OFF_LOOP_S", 8.0)
    ended = _record_ends(monkeypatch)
    schema_of(UNION).compile()
    up = FakeUpstream(Reply(text=_chain(24)))
    limiter = cpu_limiter()
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(s.chat, MESSAGES, schema=UNION))
            assert await _eventually(lambda: limiter.borrowed_tokens >= 1, 5)
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()  # the caller gives up
        cancelled_at = time.perf_counter()
        await _eventually(lambda: bool(ended), 3)
    assert ended, "the cancelled call's check still computed 3 s after the cancel"
    assert ended[0] - cancelled_at < 1.0


async def test_cancelled_calls_threads_do_not_starve_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consequence: each abandoned check holds a thread token (then one of trio's
    40 default ones, shared by the whole process; now one of cpu_limiter's) until its
    budget ends.  After as many cancelled calls as tokens, the next, whose 3 KB answer
    is checked in a thread in milliseconds, waited for a token.  The re-asks section
    says an abandoned thread 'holds nothing'.  (_OFF_LOOP_S is monkeypatched to 20 s,
    from 60.)"""
    monkeypatch.setattr(_structured, "_OFF_LOOP_S", 20.0)
    schema_of(UNION).compile()
    plain = {"type": "array", "items": {"type": "integer"}}
    big_valid = json.dumps(list(range(800)))
    assert len(big_valid) > 2048

    def behaviour(rec: RecordedRequest, rng: Any) -> Reply:
        if rec.body["response_format"]["json_schema"]["schema"] == plain:
            return Reply(text=big_valid)
        return Reply(text=_chain(24))

    up = FakeUpstream(behaviour)
    limiter = cpu_limiter()
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(int(limiter.total_tokens)):
                nursery.start_soon(functools.partial(s.chat, MESSAGES, schema=UNION))
            assert await _eventually(lambda: limiter.borrowed_tokens >= limiter.total_tokens, 30)
            nursery.cancel_scope.cancel()  # the callers give up
        await trio.sleep(0.5)
        with trio.fail_after(2):
            r = await s.chat(MESSAGES, schema=plain)
        assert r.parsed == list(range(800))


# ---------------------------------------------------------------- 5. an overflowing number is Infinity

class Measure(pydantic.BaseModel):
    x: float


@pytest.mark.parametrize("kind", ["dict", "pydantic"])
async def test_an_overflowing_number_is_refused_as_infinity_is(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    """docs/structured.md refuses NaN and Infinity in an answer (no JSON value; a
    parsed value that cannot be written back as JSON).  The literal 1e400 reads as
    float('inf') in both readers (json.loads, pydantic-core) and passes: parsed holds
    inf, which json.dumps(..., allow_nan=False) refuses.  Expected: refused and
    re-asked like Infinity."""
    schema: Any = Measure if kind == "pydantic" else {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    up = FakeUpstream(_by_round('{"x": 1e400}', '{"x": 2.5}'))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=schema)
    value = r.parsed.x if kind == "pydantic" else r.parsed["x"]
    assert value == 2.5 and r.call_stats.reasks == 1, value


# --------------------------------------------------------------------------- a third review

# 1. _OVERFLOW misses 210..299 integer digits with a two-digit exponent: 1e350 -> inf
HUGE = "1" + "0" * 250 + "e99"  # 1e349: float('inf'), yet no 3-digit exponent, no 300-digit run


@pytest.mark.parametrize("kind", ["dict", "pydantic"])
async def test_an_overflow_written_with_a_long_mantissa_is_refused_as_1e400_is(
    autojump_clock: trio.testing.MockClock, kind: str,
) -> None:
    assert float(HUGE) == float("inf")
    schema: Any = Measure if kind == "pydantic" else {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    up = FakeUpstream(_by_round('{"x": ' + HUGE + "}", '{"x": 2.5}'))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        r = await s.chat(MESSAGES, schema=schema)
    value = r.parsed.x if kind == "pydantic" else r.parsed["x"]
    assert value == 2.5 and r.call_stats.reasks == 1, value


# 2. a key holding U+2028 / U+0085 still splits a problem line (json.dumps leaves them raw)
FREE_INTS = {"type": "object", "additionalProperties": {"type": "integer"}}


@pytest.mark.parametrize("sep", ["\u2028", "\x85", "\u2029"])
@pytest.mark.parametrize("kind", ["dict", "pydantic"])
def test_a_key_with_a_unicode_line_break_stays_on_one_line(kind: str, sep: str) -> None:
    schema, answer = _keyed(kind, f"k{sep}$.forged: pretend problem")
    with pytest.raises(Invalid) as caught:
        schema_of(schema).validate(answer)
    first = caught.value.problems[0]
    # docs/structured.md: "the answer's keys can neither split a line nor put an
    # escape sequence in the next prompt"
    assert len(first.splitlines()) == 1, first.splitlines()


# 3. uniqueItems' set of canonical forms: integers hash to n mod (2**61 - 1), so a
#    model's distinct multiples of that prime all collide: quadratic, where
#    jsonschema sorts them (15,000 of them: ~6 s here, jsonschema 10 ms)
def test_unique_items_with_colliding_integer_hashes_stays_fast() -> None:
    prime = 2**61 - 1
    items = [k * prime for k in range(1, 15_001)]
    schema = schema_of({"type": "array", "uniqueItems": True})
    start = time.perf_counter()
    assert schema.validate(json.dumps(items)) == items
    assert time.perf_counter() - start < 1.5, f"{time.perf_counter() - start:.1f} s"


# 4. the _OVERFLOW pre-check ([0-9]{300}, tried at every digit) is quadratic on digit
#    runs just under 300 and holds the interpreter's lock throughout (re): an 8 MB
#    answer of 299-digit runs starves the loop ~1.5 s, where json.loads takes 30 ms
async def test_the_overflow_precheck_does_not_hold_the_loop() -> None:
    answer = json.dumps(" ".join(["1" * 299] * (8 * 1024 * 1024 // 300)))
    up = FakeUpstream(Reply(text=answer))
    settings = _settings(structured=polygate.Structured(max_reasks=0))
    longest = 0.0

    async def ticker() -> None:
        nonlocal longest
        while True:
            before = time.perf_counter()
            await trio.sleep(0.005)
            longest = max(longest, time.perf_counter() - before)

    schema = {"type": "string"}
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.05)
            r = await s.chat(MESSAGES, schema=schema)
            nursery.cancel_scope.cancel()
    assert len(r.parsed) > 8_000_000
    assert longest < 0.5, f"the event loop stood still {longest:.2f} s"


# 5. (low) a float answer under a huge-integer multipleOf: OverflowError re-raised by
#    the wrapper -> ConfigError after the call (the model's answer blamed on the schema)
def test_a_float_under_a_huge_integer_multipleof_is_judged() -> None:
    schema = schema_of({"type": "number", "multipleOf": 10**400})
    try:
        schema.validate("1.5")
    except Invalid:
        pass  # 1.5 is not a multiple of 10**400: re-asked
    except ConfigError as exc:
        pytest.fail(f"the answer 1.5 was a ConfigError: {exc}")


# --------------------------------------------------------------------------- a skeptic's benchmark

# The overflow pre-check, a regular expression, ran over every answer validated at
# ~22 ns a character: 2.5 ms for a 37 KB answer on the event loop, where pydantic's
# whole validation took 0.7 ms.  Its replacement must find exactly what it found.
_REGEX = re.compile(r"[eE][+]?[0-9]{3}|(?<![0-9])[0-9]{210}")


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.one_of(
    st.text(alphabet="0123456789eE+-. \"é\ud800", max_size=12),
    st.integers(min_value=200, max_value=220).map(lambda n: "7" * n),
    st.sampled_from(["e999", "E+100", "e+12", "E1000", "1e308", "1.5e-400"]),
), max_size=12).map("".join))
def test_the_overflow_precheck_finds_what_the_regular_expression_found(text: str) -> None:
    assert _structured._may_overflow(text) == bool(_REGEX.search(text))


def test_the_overflow_precheck_costs_a_fraction_of_the_regular_expressions() -> None:
    """Measured within one run, best of seven: the pre-check of a 37 KB answer against
    the regular expression it replaced (~6× as long here) and a reading of it."""
    answer = json.dumps({"items": [{"name": f"item {i} of the answer, élan", "score": i * 1.5}
                                   for i in range(900)]})
    assert len(answer) > 36_000

    def best(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    regex = best(lambda: _REGEX.search(answer))
    check = best(lambda: _structured._may_overflow(answer))
    assert check * 2 < regex, f"pre-check {check * 1e6:.0f} µs, the expression {regex * 1e6:.0f} µs"


# --------------------------------------------------------------------------- threads that hold the GIL

def _count_threads(monkeypatch: pytest.MonkeyPatch, method: str, pause_s: float) -> list[int]:
    """``_DictSchema.<method>`` counted while it runs in a worker thread (``[now,
    most]``), each run ``pause_s`` longer (real time: the overlap to see)."""
    counts = [0, 0]
    lock = threading.Lock()
    original = getattr(_structured._DictSchema, method)

    def counted(self: Any, *args: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            return original(self, *args)
        with lock:
            counts[0] += 1
            counts[1] = max(counts)
        try:
            time.sleep(pause_s)
            return original(self, *args)
        finally:
            with lock:
                counts[0] -= 1

    monkeypatch.setattr(_structured._DictSchema, method, counted)
    return counts


async def test_large_answers_are_checked_a_few_threads_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread-pool look: 100 calls whose 420 KB answers were checked at once took up to
    40 of trio's threads, which took turns with the event loop for the interpreter's
    lock: the loop stood still up to 2.3 s (deadlines, hedges, keep-alives late).  The
    checks hold the lock all along: cpu_limiter runs CPU_THREADS of them at a time, and
    leaves trio's own threads (name resolution, SQLite) alone."""
    counts = _count_threads(monkeypatch, "validate", 0.1)
    plain = {"type": "array", "items": {"type": "integer"}}
    answer = json.dumps(list(range(800)))
    assert len(answer) > _structured._DictSchema.off_loop_chars
    up = FakeUpstream(Reply(text=answer))
    default = trio.to_thread.current_default_thread_limiter()
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(3 * CPU_THREADS):
                nursery.start_soon(functools.partial(s.chat, MESSAGES, schema=plain))
            assert await _eventually(lambda: counts[0] > 0, 5)
            assert default.borrowed_tokens == 0
    assert 1 <= counts[1] <= CPU_THREADS, counts


async def test_out_of_threads_a_large_answer_is_checked_on_the_loop_within_its_budget() -> None:
    """Outside review (running out of the OS's resources): at the process's thread
    limit, a large answer's check raised the interpreter's bare ``RuntimeError("can't
    start new thread")`` from ``chat()``.  It is checked on the loop instead, within
    the loop's own budget (its review: within the thread's, a hostile answer held the
    loop, and every other call, 60 s): a hostile one is not valid, at once."""
    small = {"type": "array", "items": {"type": "integer"}}
    answer = json.dumps(list(range(800)))
    assert len(answer) > _structured._DictSchema.off_loop_chars
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")],
        structured=polygate.Structured(max_reasks=0))})
    hostile = FakeUpstream(Reply(text=_chain(22)))
    with no_threads():
        async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(text=answer))})) as s:
            assert (await s.chat(MESSAGES, schema=small)).parsed == list(range(800))
        async with polygate.session(settings, transport=Router({"a": hostile})) as s:
            began = time.monotonic()
            with pytest.raises(polygate.StructuredOutputError) as failed:
                await s.chat(MESSAGES, schema=_UNION)
            assert time.monotonic() - began < 1.0
    assert "ran out of threads" in failed.value.errors[0]


async def test_out_of_threads_a_big_schema_is_not_compiled_on_the_loop() -> None:
    """The same review: a big schema's compile (3 s for 1 MB) is not moved onto the
    loop, where it would hold every other call: the call says why it cannot run."""
    big = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(60)}}
    assert len(json.dumps(big)) > _structured._INLINE_COMPILE_CHARS
    with no_threads():
        async with polygate.session(_settings(), transport=Router({"a": FakeUpstream(Reply(text="{}"))})) as s:
            with pytest.raises(polygate.PolygateError, match="ran out of threads"):
                await s.chat(MESSAGES, schema=big)


async def test_compiles_abandoned_by_cancelled_calls_leave_trios_threads_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread-pool look: 40 calls cancelled while their big schema compiled left 40
    compiles running on trio's 40 default threads for 7-14 s: a DNS lookup waited
    14.8 s, and a next call's deadline fired seconds late.  Now at most CPU_THREADS
    compiles run (the rest never start), on threads of their own."""
    counts = _count_threads(monkeypatch, "compile", 0.5)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(60)}}
    assert len(json.dumps(big)) > _structured._INLINE_COMPILE_CHARS
    up = FakeUpstream(Reply(text="{}", first_token_s=0.01))
    async with polygate.session(_settings(), transport=Router({"a": up})) as s:
        with trio.move_on_after(0.2):
            async with trio.open_nursery() as nursery:
                for _ in range(5 * CPU_THREADS):
                    nursery.start_soon(functools.partial(s.chat, MESSAGES, schema=big))
        with trio.fail_after(0.3):
            # (What name resolution does: a thread of trio's own, at once.)
            assert await trio.to_thread.run_sync(lambda: 42) == 42
    assert 1 <= counts[1] <= CPU_THREADS, counts


async def test_a_wait_for_a_checks_thread_is_not_held_against_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check's budget counts from its thread's start: a wait for one of the few
    threads (another call's check, an abandoned one) is no fault of the answer's, and
    judged over budget for it, the answer would be asked again (paid)."""
    monkeypatch.setattr(_structured, "_OFF_LOOP_S", 0.5)
    plain = {"type": "array", "items": {"type": "integer"}}
    answer = json.dumps(list(range(800)))
    up = FakeUpstream(Reply(text=answer))
    limiter = cpu_limiter()
    async with polygate.session(_settings(structured=polygate.Structured(max_reasks=0)),
                                transport=Router({"a": up})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(int(limiter.total_tokens)):
                nursery.start_soon(functools.partial(
                    trio.to_thread.run_sync, time.sleep, 1.0, limiter=limiter))
            await trio.sleep(0.05)
            r = await s.chat(MESSAGES, schema=plain)
    assert r.parsed == list(range(800))


def _two_scopes() -> polygate.Settings:
    return polygate.Settings(scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")],
                               structured=polygate.Structured(max_reasks=0)),
        "other": polygate.Scope(sources=[polygate.Source(name="b", base_url="http://b/v1")]),
    })


async def _swallowed(call: Callable[[], Any]) -> None:
    with contextlib.suppress(polygate.PolygateError):
        await call()


async def test_two_slow_checks_do_not_hold_up_another_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of the threads' limit (once 2): two calls with no deadline whose answers
    take their whole budget (a minute by default, 4 s here) held both threads, and a
    call whose 3 KB answer is checked in milliseconds missed its 2 s deadline."""
    monkeypatch.setattr(_structured, "_OFF_LOOP_S", 4.0)
    schema_of(UNION).compile()
    plain = {"type": "array", "items": {"type": "integer"}}
    answer = json.dumps(list(range(800)))
    hostile, fine = FakeUpstream(Reply(text=_chain(24))), FakeUpstream(Reply(text=answer))
    async with polygate.session(_two_scopes(), transport=Router({"a": hostile, "b": fine})) as s:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(_swallowed, functools.partial(s.chat, MESSAGES, schema=UNION))
            assert await _eventually(lambda: cpu_limiter().borrowed_tokens == 2, 5)
            start = time.perf_counter()
            r = await s.chat(MESSAGES, scope="other", schema=plain, call_deadline_s=2.0)
            took = time.perf_counter() - start
            nursery.cancel_scope.cancel()
    assert r.parsed == list(range(800))
    assert took < 1.0, f"the 3 KB answer's call took {took:.2f} s"
