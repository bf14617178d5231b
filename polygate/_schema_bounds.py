"""A JSON Schema's validation in bounded time: its regular expressions, and its walk.

**Patterns.** jsonschema checks ``pattern``, ``patternProperties`` and the keys that
``additionalProperties`` leaves to them with Python's ``re``: a backtracking engine
that holds the interpreter's lock for the whole match.  A schema's pattern such as
``^(a+)+$`` met by a model's answer such as ``"aaa…ab"`` takes time exponential in
the string's length (seconds at 30 characters, centuries at 60), and nothing else in
the process runs meanwhile: not the event loop, not the call's deadline, not another
thread.  The model writes the string; the schema's author rarely knows their pattern
backtracks.  These keywords match with the ``regex`` module instead (the
``structured`` extra): it avoids most such backtracking outright
(``^(a+)+$`` takes microseconds there), and gives up after :data:`MATCH_TIMEOUT_S`
(more for a long string) on the rest.  A match that gives up is
:class:`SlowPattern`: the answer is not valid, re-asked like any other, with the reason.
``unevaluatedProperties`` (2019-09 and later) still finds the keys a
``patternProperties`` evaluated with jsonschema's own ``re``: its walk over the
applicators is jsonschema's, not a keyword one can replace; and a schema that mixes
drafts is checked by jsonschema's own classes throughout (docs/structured.md).

**The walk.** Unions are tried branch by branch, each to its end (``anyOf`` gathers
every error of a failing branch), so a recursive union (an expression tree: ``anyOf``
of an ``add`` and a ``mul`` node, each holding expressions) takes time exponential in
the answer's nesting: 350 characters, 5 s.  The keywords that descend, and every
match, look at a budget first (:func:`budget`): past it, :class:`OverBudget`.  The caller validates a short
answer on the event loop with a small budget, and finishes one that overruns it in a
worker thread, within the call's time (``polygate._structured``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

__all__ = ["MATCH_TIMEOUT_S", "Budget", "OverBudget", "SlowPattern", "budget", "bounded_keywords"]

#: One match of one pattern against one string: a pattern that needs longer than
#: this on a string of a model's answer (microseconds is usual) backtracks.
MATCH_TIMEOUT_S = 0.1


class SlowPattern(Exception):
    """A pattern gave up on a string of the answer after ``seconds``."""

    def __init__(self, pattern: str, seconds: float) -> None:
        super().__init__(pattern, seconds)
        self.pattern = pattern
        self.seconds = seconds


class OverBudget(Exception):
    """The validation ran past the budget :func:`budget` gave it."""


#: The :class:`Budget` of the validation running in this thread, and whether it runs
#: in the event loop's thread.
_until = threading.local()


class Budget:
    """Until when a check may run (``time.monotonic()``; ``math.inf``: no bound), and
    ``stop()``, which ends it sooner: the call that waited for it was cancelled (a
    cancellation is no deadline, and a worker thread is not cancelled with its call:
    it would have computed on for up to its whole budget, holding one of the run's
    few threads for such work: polygate._threads.cpu_limiter)."""

    __slots__ = ("stopped", "until")

    def __init__(self, until: float) -> None:
        self.until = until
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True  # (a plain attribute: one thread writes it, one reads it)


@contextlib.contextmanager
def budget(limit: Budget, *, on_loop: bool = True) -> Iterator[None]:
    """Within the block, the validation in this thread raises :class:`OverBudget` once
    ``limit`` ends.  ``on_loop``: it runs in the event loop's thread (which waits for it
    anyway), not in a worker thread beside it."""
    before = getattr(_until, "limit", None), getattr(_until, "on_loop", True)
    _until.limit, _until.on_loop = limit, on_loop
    try:
        yield
    finally:
        _until.limit, _until.on_loop = before


def _left() -> float:
    """The budget's seconds left (:class:`OverBudget` when none are)."""
    limit: Budget | None = getattr(_until, "limit", None)
    if limit is None:
        return math.inf
    left = limit.until - time.monotonic()
    if left <= 0 or limit.stopped:
        raise OverBudget
    return left


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str) -> tuple[Any, bool]:
    """The pattern compiled, and whether by ``regex`` (bounded) rather than by ``re``.

    ``re`` where ``regex``'s syntax reads the pattern otherwise (jsonschema's check of
    the schema is ``re``'s, so the two must agree on what the pattern says): a brace
    group that is no quantifier (``/users/{id}``: ``re`` reads it as text, ``regex``
    as a fuzzy-matching constraint, or fails), ``[:`` (``regex`` reads ``[[:alpha:]]``
    as a POSIX class, ``re`` as a set), or any pattern ``regex`` cannot compile; and
    where ``regex`` is not installed (jsonschema installed alone: matched as jsonschema
    matches them, with no bound)."""
    try:
        import regex  # only schemas with patterns need it
    except ImportError:
        return re.compile(pattern), False
    if _read_alike(pattern):
        try:
            return regex.compile(pattern), True
        except regex.error:
            pass
    return re.compile(pattern), False


#: What ``re`` reads as a quantifier between braces: {m}, {m,}, {m,n}, {,n}.
_QUANTIFIER = re.compile(r"[0-9]+(?:,[0-9]*)?|,[0-9]+")


def _read_alike(pattern: str) -> bool:
    if "[:" in pattern:
        return False
    at = pattern.find("{")
    while at >= 0:
        escapes = len(pattern[:at]) - len(pattern[:at].rstrip("\\"))
        if escapes % 2 == 0:  # (an escaped brace is text to both)
            end = pattern.find("}", at)
            if end < 0 or not _QUANTIFIER.fullmatch(pattern, at + 1, end):
                return False
        at = pattern.find("{", at + 1)
    return True


#: How long one match may take before it gives up: MATCH_TIMEOUT_S, and 1 µs more a
#: character of the string (``regex`` takes ~10–100 ns a character on a pattern that
#: does not backtrack: a 4 MB base64 string took 0.1 s, and is no backtracking), at
#: most _MOST_S.
_PER_CHAR_S = 1e-6
_MOST_S = 0.5


def search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` is found in ``text``, as ``re.search`` finds it (where the
    two engines read it alike: not always for ``\\w`` or ``\\s`` on a few characters,
    docs/structured.md), in bounded time: :class:`SlowPattern` when one match gives
    up, :class:`OverBudget` when the check's budget ends first."""
    left = _left()  # (each match looks at the budget: an answer's many keys and strings)
    compiled, bounded = _compiled(pattern)
    if not bounded:
        return compiled.search(text) is not None
    give_up = min(MATCH_TIMEOUT_S + len(text) * _PER_CHAR_S, _MOST_S)
    on_loop = getattr(_until, "on_loop", True)
    while True:
        timeout = min(give_up, left)
        spent = time.thread_time()
        try:
            # On the event loop's thread, holding the interpreter's lock, as re does:
            # the loop waits for this check anyway, and a match that let the lock go
            # waited to take it back each time (3,000 strings took a minute in a busy
            # process).  In a worker thread, letting it go, so the loop runs meanwhile.
            return compiled.search(text, concurrent=not on_loop, timeout=timeout) is not None
        except TimeoutError:
            pass
        if time.thread_time() - spent < timeout / 2:
            # Its time went to other threads, waiting for the lock: not this pattern's.
            left = _left()
            continue
        if timeout < give_up:
            raise OverBudget from None
        raise SlowPattern(pattern, give_up) from None


def bounded_keywords(validators: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
    """A jsonschema validator class's keywords in bounded time, for
    ``jsonschema.validators.extend``, given its keywords and ValidationError: the regex
    ones, ``uniqueItems`` and ``multipleOf`` replaced, and the walk's steps checking
    the budget (``_BUDGETED``)."""

    def pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[Exception]:
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield error(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for key, value in instance.items():
                if search(patrn, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    original = validators["additionalProperties"]

    def additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[Any]:
        patterns = schema.get("patternProperties")
        if not patterns or not validator.is_type(instance, "object"):
            # No regex in the way: jsonschema's own, messages and all.
            yield from original(validator, extra, instance, schema)
            return
        properties = schema.get("properties", {})
        extras = sorted(
            (k for k in instance if k not in properties and not any(search(p, k) for p in patterns)),
            key=str,
        )
        if validator.is_type(extra, "object"):
            for key in extras:
                yield from validator.descend(instance[key], extra, path=key)
        elif not extra and extras:
            verb = "does" if len(extras) == 1 else "do"
            listed = ", ".join(repr(p) for p in sorted(patterns))
            yield error(f"{', '.join(map(repr, extras))} {verb} not match any of the regexes: {listed}")

    def unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Exception]:
        # jsonschema compares the items pair by pair when they do not sort (objects,
        # mixed types): quadratic, 31 s on 59 KB, past any budget in one keyword call.
        # Here each item's canonical form goes into a set: linear, the budget looked
        # at as it goes.
        if unique and validator.is_type(instance, "array") and not _unique(instance):
            yield error(f"{instance!r} has non-unique elements")

    original_multiple = validators.get("multipleOf")

    def multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Iterator[Any]:
        assert original_multiple is not None  # (replaced only where the draft has it)
        try:
            # (a list: its errors, or its failure, here)
            found = list(original_multiple(validator, divisor, instance, schema) or ())
        except (OverflowError, ValueError):
            # jsonschema divides a huge integer by a float (or a float by a huge
            # integer) outside its own guard: an OverflowError the call took for a
            # broken schema.  Judged exactly.
            if not all(isinstance(n, (int, float)) and not isinstance(n, bool)
                       for n in (instance, divisor)):
                raise
            if (Fraction(instance) / Fraction(divisor)).denominator != 1:
                yield error(f"{instance!r} is not a multiple of {divisor}")
            return
        yield from found

    replaced = {
        "pattern": pattern,
        "patternProperties": pattern_properties,
        "additionalProperties": additional_properties,
        "uniqueItems": unique_items,
        "multipleOf": multiple_of,
    }
    keywords = {**validators, **{k: v for k, v in replaced.items() if k in validators}}
    return {
        name: _budgeted(check) if name in _BUDGETED else check for name, check in keywords.items()
    }


def _unique(items: list[Any]) -> bool:
    """Whether no two items are equal as JSON Schema has it (``1`` and ``1.0`` are,
    ``true`` and ``1`` are not; arrays and objects by their contents)."""
    seen: set[Any] = set()
    for item in items:
        _left()
        key = _canonical(item)
        if key in seen:
            return False
        seen.add(key)
    return True


def _canonical(value: Any) -> Any:
    """A hashable form of a JSON value, equal where JSON Schema's equality is (``1`` and
    ``1.0`` are).  A number as text: an int's hash is its value modulo 2**61 - 1, the
    same in every process, so 15,000 multiples of it collided in the set (5 s);
    text's hash is salted per process."""
    if value is True or value is False:
        return ("b", value)
    if isinstance(value, (int, float)):
        whole = isinstance(value, int) or value.is_integer()
        return ("n", str(int(value)) if whole else repr(value))
    if isinstance(value, dict):
        return ("o", frozenset((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("a", tuple(_canonical(v) for v in value))
    return ("v", value)


#: The keywords that descend into other schemas (every draft's), and ``pattern``: the
#: walk's every step passes through one of them, and a pattern may take up to its
#: give-up on each string, so a look at the clock in each bounds the whole.  The rest
#: check one value each, quickly; unwrapped, they cost nothing more (every keyword
#: wrapped cost ~5 µs more on a 10-field answer of ~90 µs).
_BUDGETED = frozenset({
    "$ref", "$dynamicRef", "$recursiveRef", "allOf", "anyOf", "oneOf", "not", "if",
    "then", "else", "items", "prefixItems", "additionalItems", "contains", "properties",
    "patternProperties", "additionalProperties", "dependentSchemas", "dependencies",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties", "extends", "type",
    "pattern", "uniqueItems",
})


def _budgeted(check: Callable[..., Any]) -> Callable[..., Any]:
    """``check``, which first looks at the clock: every step of the walk does."""

    def keyword(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _left()
        return check(validator, value, instance, schema)

    return keyword
