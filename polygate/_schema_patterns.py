"""A JSON Schema's regular expressions, checked in bounded time.

jsonschema checks ``pattern``, ``patternProperties`` and the keys that
``additionalProperties`` leaves to them with Python's ``re``: a backtracking engine
that holds the interpreter's lock for the whole match.  A schema's pattern such as
``^(a+)+$`` met by a model's answer such as ``"aaa…ab"`` takes time exponential in
the string's length (seconds at 30 characters, centuries at 60), and nothing else in
the process runs meanwhile: not the event loop, not the call's deadline, not another
thread.  The model writes the string; the schema's author rarely knows their pattern
backtracks.

These keywords match with the ``regex`` module instead (the ``polygate[structured]``
extra): it avoids most such backtracking outright (``^(a+)+$`` takes microseconds
there), lets other threads run while it matches, and gives up after
:data:`MATCH_TIMEOUT_S` on the rest.  A match that gives up makes the answer
:class:`SlowPattern`: not valid, re-asked like any other, with the reason.

``unevaluatedProperties`` (2019-09 and later) still finds the keys a
``patternProperties`` evaluated with jsonschema's own ``re``: its walk over the
applicators is jsonschema's, not a keyword one can replace (docs/structured.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

__all__ = ["MATCH_TIMEOUT_S", "SlowPattern", "bounded_keywords"]

#: One match of one pattern against one string: a pattern that needs longer than
#: this on a string of a model's answer (microseconds is usual) backtracks.
MATCH_TIMEOUT_S = 0.1


class SlowPattern(Exception):
    """A pattern gave up on a string of the answer after :data:`MATCH_TIMEOUT_S`."""

    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        self.pattern = pattern


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str) -> Any:
    import regex  # only schemas with patterns need it

    return regex.compile(pattern)


def search(pattern: str, text: str) -> bool:
    """``re.search(pattern, text)``'s answer, in bounded time, or :class:`SlowPattern`."""
    try:
        # concurrent: the lock is released while it matches (an answer big enough to be
        # checked in a worker thread leaves the event loop running).
        return _compiled(pattern).search(text, concurrent=True, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        raise SlowPattern(pattern) from None


def bounded_keywords(validators: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
    """Replacements for a jsonschema validator class's regex keywords
    (``jsonschema.validators.extend``), given its keywords and ValidationError."""

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

    replaced = {
        "pattern": pattern,
        "patternProperties": pattern_properties,
        "additionalProperties": additional_properties,
    }
    return {k: v for k, v in replaced.items() if k in validators}
