"""What the fake upstream should do: one scripted :class:`Reply`, or a :class:`Profile`
of seeded distributions that draws a Reply per request.

A Reply is pure data: it says *what* goes over the wire and *when*, never how.  The
two faces (the httpx transport and the loopback server) share one renderer
(:mod:`._render`), so a Reply means the same bytes and the same timing in both.

Determinism of :meth:`Profile.draw`: the upstream owns one ``random.Random(seed)``.
Each draw takes exactly one 64-bit number from it and seeds a private generator for
that request, so request *i*'s reply depends only on the seed and *i* — never on how
many numbers an earlier draw (or a user callable) consumed.  Inside a draw the five
uniforms that decide fault, hang, stall and their positions come first, then every
distribution is sampled in field order whether it is used or not; changing a
probability therefore never shifts the timings drawn for other requests.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeAlias

import attrs

__all__ = ["ARGUMENT_PIECE", "FAULTS", "Distribution", "Fault", "Profile", "Reply", "ToolCall", "answer_tokens",
           "sample", "split_text"]

Fault: TypeAlias = Literal[
    "malformed_json",
    "truncated",
    "reset",
    "html",
    "no_choices",
    "silent",
    "error_event",
    "oversized",
]
FAULTS: frozenset[str] = frozenset(
    {
        "malformed_json",
        "truncated",
        "reset",
        "html",
        "no_choices",
        "silent",
        "error_event",
        "oversized",
    }
)

#: A number (constant), a ``(lo, hi)`` tuple (uniform) or a callable of the draw's RNG.
Distribution: TypeAlias = float | tuple[float, float] | Callable[[random.Random], float]


def sample(dist: Distribution, rng: random.Random) -> float:
    """One value of ``dist``; a constant consumes no randomness."""
    if isinstance(dist, tuple):
        lo, hi = dist
        return rng.uniform(lo, hi)
    if callable(dist):
        return float(dist(rng))
    return float(dist)


def _too_large(attribute: attrs.Attribute[Any], value: Any) -> None:
    """A ValueError for a number no float holds (an int of over ~308 digits), which
    ``math.isfinite`` and the like meet with an OverflowError (and ``repr`` of one past
    4,300 digits with another ValueError)."""
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, int) and not isinstance(v, bool):
            try:
                float(v)
            except OverflowError:
                raise ValueError(f"{attribute.name}: a number too large for a time or a "
                                 "distribution (one float cannot hold it)") from None


def _check_distribution(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    _too_large(attribute, value)
    if isinstance(value, tuple):
        if len(value) != 2 or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in value):
            raise ValueError(f"{attribute.name}: a distribution tuple is (lo, hi), two finite "
                             f"numbers, got {value!r}")
        if value[0] > value[1] or value[0] < 0:
            raise ValueError(f"{attribute.name}: need 0 <= lo <= hi, got {value!r}")
    elif callable(value):
        return
    elif (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value < 0):
        raise ValueError(f"{attribute.name}: expected a finite number >= 0, (lo, hi) or a "
                         f"callable, got {value!r}")


def _to_distribution(value: Any) -> Any:
    """JSON gives lists; a two-element list is the ``(lo, hi)`` form."""
    return tuple(value) if isinstance(value, list) else value


_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"(?:[\x21-\x7e](?:[\t\x20-\x7e]*[\x21-\x7e])?)?")


#: Headers that frame the message: the fake's own to write.  (``connection: close``
#: is a script's to send: the server then closes after the answer, as scripted.)
_FRAMING = frozenset({"content-length", "transfer-encoding"})


def _headers(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Headers are stored as a tuple of pairs so a Reply stays hashable.  Each must be
    one a server can send (an HTTP token, a value of printable ASCII without line
    breaks): checked here, not on every request the script answers."""
    try:
        items = value.items() if isinstance(value, Mapping) else value
        pairs = tuple((str(k), str(v)) for k, v in items)
    except (TypeError, ValueError):
        raise TypeError(f"headers must be a mapping or (name, value) pairs, got {value!r}") from None
    for name, text in pairs:
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"header name {name!r} is not an HTTP token")
        if name.lower() in _FRAMING:
            raise ValueError(
                f"header {name!r} frames the message: the fake writes it itself (a script's "
                "own made the two faces send different bytes, and the server's answer fail)")
        if not _HEADER_VALUE.fullmatch(text):
            raise ValueError(
                f"header {name!r}: its value must be printable ASCII without line breaks "
                f"or blanks at either end, got {text!r}")
    return pairs


def _reply(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Reply):
        raise TypeError(f"{attribute.name} must be a Reply, got {type(value).__name__}")


def _instance(*kinds: type, optional: bool = False) -> Any:
    """A validator: one of ``kinds`` (or None, when ``optional``), and not a bool (an
    int to Python)."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"{attribute.name} must be {names}, got {value!r}")

    return check


def _non_negative(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A time: a number >= 0 (infinity waits for ever; NaN is no time)."""
    if value is None:
        return
    _too_large(attribute, value)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


def _optional_header_number(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A number a header carries: >= 0 and finite (``Retry-After: inf`` is no header)."""
    _non_negative(_inst, attribute, value)
    if value is not None and math.isinf(value):
        raise ValueError(f"{attribute.name} must be finite, got {value!r}")


def _count(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A count (tokens, a token index, bytes): a whole number >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be a whole number >= 0, got {value!r}")


#: Statuses h11 cannot frame as a reply with a body (1xx are interim, 204/205/304
#: have none): a fake that sent them would not be the reply the script says.
_NO_BODY_STATUSES = frozenset({204, 205, 304})


def _check_error_body(_inst: object, _attr: attrs.Attribute[Any], value: Any) -> None:
    """bytes (sent as they are) or a value JSON can write: checked here, once, not on
    every request (where it would fail inside the fake, as an upstream fault)."""
    if value is None or isinstance(value, bytes):
        return
    try:
        # As the fake writes it (UTF-8, no NaN: JSON has none), so that every request
        # the script answers can be written.
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:  # (UnicodeEncodeError is a ValueError)
        raise TypeError(f"error_body must be bytes or a JSON value, got {value!r} ({exc})") from None


def _check_status(_inst: object, _attr: attrs.Attribute[Any], value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or not 200 <= value <= 599
            or value in _NO_BODY_STATUSES):
        others = ", ".join(map(str, sorted(_NO_BODY_STATUSES)))
        raise ValueError(
            f"status must be a whole number in [200, 599] other than {others} "
            f"(a reply with a body), got {value!r}")


def _optional_text(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{attribute.name} must be a string or None, got {type(value).__name__}")
    _utf8(_inst, attribute, value)


def _utf8(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A string the fake will send must be UTF-8: a lone surrogate ("\\ud800") passed
    construction and then failed every request the script answered."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{attribute.name} is not UTF-8 text (a lone surrogate?)") from None


#: A wait cut into keep-alive pieces: at least a millisecond, or a tinier one would be
#: an endless run of comments at a standstill of virtual time.
def _keepalive(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An interval of at least 1 ms, or None (a bool is no interval)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0.001:
        raise ValueError(f"{attribute.name} must be a number >= 0.001 or None, got {value!r}")


def _flag(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """True or False ("no" is a truthy string: a usage a script meant to leave out)."""
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _optional_flag(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _flag(inst, attribute, value)


_probability = [attrs.validators.ge(0.0), attrs.validators.le(1.0)]


def _check_fault(_inst: object, _attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in FAULTS:
        raise ValueError(f"fault must be one of {sorted(FAULTS)} or None, got {value!r}")


#: The most characters of a tool call's arguments one delta carries (models stream
#: them a few characters at a time).
ARGUMENT_PIECE = 8


def split_text(text: str) -> list[str]:
    """Word-boundary tokens that keep their leading spaces; joined they give ``text``."""
    tokens = re.findall(r"\s*\S+", text)
    tail = text[len("".join(tokens)) :]
    if tail:
        tokens = [*tokens[:-1], tokens[-1] + tail] if tokens else [tail]
    return tokens


def answer_tokens(reply: Reply, tokens: int | None = None) -> int:
    """How many tokens ``reply`` streams (with ``tokens`` for its own, when given):
    its reasoning, its content (``text`` split into words, else ``tokens`` words --
    none beside tool calls) and each tool call's head and argument pieces (before any
    request's token limit)."""
    if reply.text is not None:
        content = len(split_text(reply.text))
    else:
        content = 0 if reply.tool_calls else reply.tokens if tokens is None else tokens
    pieces = sum(1 + -(-len(call.arguments) // ARGUMENT_PIECE) for call in reply.tool_calls)
    return reply.reasoning_tokens + content + pieces


def _arguments(value: Any) -> str:
    """A tool call's arguments as the model writes them: a string is sent as it is
    (a test of a model's broken JSON needs that), anything else as compact JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"arguments must be a string or a JSON value, got {value!r} ({exc})") from None


def _name(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, got {value!r}")
    _utf8(_inst, attribute, value)


def _optional_name(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _name(inst, attribute, value)


@attrs.frozen
class ToolCall:
    """A function call a :class:`Reply` answers with, streamed as models stream one: a
    first delta with its ``id``, its type and its ``name`` (and empty arguments), then
    its ``arguments`` in pieces of up to eight characters, each a token.

    ``arguments`` is a string, sent as it is (broken JSON included), or a JSON value
    (written compactly).  ``id``: None makes one per request, ``call_<fake>_<request
    index>_<call index>``."""

    name: str = attrs.field(validator=_name)
    arguments: str = attrs.field(default="{}", converter=_arguments, validator=_utf8)
    id: str | None = attrs.field(default=None, validator=_optional_name)


def _tool_calls(value: Any) -> tuple[ToolCall, ...]:
    """A sequence of ToolCalls, kept as a tuple so that a Reply stays hashable."""
    if isinstance(value, ToolCall | str | bytes | Mapping):
        raise TypeError(f"tool_calls must be a sequence of ToolCall, got {value!r}")
    try:
        calls = tuple(value)
    except TypeError:
        raise TypeError(f"tool_calls must be a sequence of ToolCall, got {value!r}") from None
    for call in calls:
        if not isinstance(call, ToolCall):
            raise TypeError(f"tool_calls must hold ToolCall objects, got {call!r}")
    return calls


def _finish_default(reply: Reply) -> str:
    return "tool_calls" if reply.tool_calls else "stop"


@attrs.frozen(kw_only=True)
class Reply:
    """One scripted response.

    Timing of a 2xx chat stream (times after the request arrives): the status line
    and headers at ``headers_delay_s``; the role chunk right after them (as vLLM
    sends it: a role-only delta is not a token, so a client must not count it as the
    first token); the first token ``first_token_s`` later; each next token
    ``inter_token_s`` after the previous one; then the finish chunk, the usage chunk
    and ``[DONE]`` at once.  ``stall_at = k`` adds ``stall_s`` of silence after ``k``
    tokens (0: before the first; ``k`` = the token count: before the finish chunk).
    ``keepalive_s`` sends ``: keep-alive`` comments during every such wait.  Tokens
    count reasoning tokens first, then content tokens, then the pieces of the
    ``tool_calls`` (see :class:`ToolCall`).  With tool calls the content is ``text``
    alone (none when it is None: ``"content": null``, as a model that only calls tools
    answers; ``tokens`` then counts nothing), and ``finish_reason`` defaults to
    ``"tool_calls"``.

    A non-streamed answer (or an embedding) waits for the whole generation time
    before its headers, as real servers do; a non-2xx reply waits only
    ``headers_delay_s`` and sends its error body.

    Faults apply to 2xx replies (``"silent"`` to any).  ``fault_after`` counts
    tokens as ``stall_at`` does.  In a stream, ``"malformed_json"`` and
    ``"oversized"`` insert one bad line and the stream then carries on to
    ``[DONE]`` (a lenient client would not notice the end); ``"truncated"``,
    ``"reset"`` and ``"error_event"`` end it.  In a JSON body: ``"malformed_json"``
    breaks the JSON, ``"truncated"`` declares the full Content-Length and sends
    half, ``"reset"`` resets after the headers, ``"error_event"`` is a 200 body with
    a top-level ``"error"``.  ``"html"`` and ``"no_choices"`` replace the whole
    answer, stream request or not.
    """

    status: int = attrs.field(default=200, validator=_check_status)
    headers: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_headers)
    retry_after_s: float | None = attrs.field(default=None, validator=_optional_header_number)
    retry_after_ms: float | None = attrs.field(default=None, validator=_optional_header_number)
    error_body: Any = attrs.field(default=None, hash=False, validator=_check_error_body)
    headers_delay_s: float = attrs.field(default=0.0, validator=_non_negative)
    first_token_s: float = attrs.field(default=0.0, validator=_non_negative)
    inter_token_s: float = attrs.field(default=0.0, validator=_non_negative)
    tokens: int = attrs.field(default=8, validator=_count)
    text: str | None = attrs.field(default=None, validator=_optional_text)
    reasoning_tokens: int = attrs.field(default=0, validator=_count)
    stall_at: int | None = attrs.field(default=None, validator=_count)
    stall_s: float = attrs.field(default=0.0, validator=_non_negative)
    keepalive_s: float | None = attrs.field(default=None, validator=_keepalive)
    fault: Fault | None = attrs.field(default=None, validator=_check_fault)
    fault_after: int = attrs.field(default=0, validator=_count)
    error_event_code: int | str = attrs.field(default=500, validator=_instance(int, str))
    oversized_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_count)
    stream: bool | None = attrs.field(default=None, validator=_optional_flag)
    usage: bool = attrs.field(default=True, validator=_flag)
    # False: the stream ends after its finish (and usage) chunk without ``[DONE]``
    # (complete all the same: the finish_reason says so).
    done: bool = attrs.field(default=True, validator=_flag)
    # After the content: the answer's tool calls (its content is then ``text`` alone).
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=_tool_calls)
    # None: a finish chunk (and a choice) whose finish_reason is null, as some servers send.
    finish_reason: str | None = attrs.field(
        default=attrs.Factory(_finish_default, takes_self=True),
        validator=[_instance(str, optional=True), _utf8],
    )
    model: str | None = attrs.field(default=None, validator=[_instance(str, optional=True), _utf8])
    embedding_dim: int | None = attrs.field(
        default=None, validator=attrs.validators.optional([_instance(int), attrs.validators.gt(0)])
    )


#: Fault kinds a Profile can draw, in the order their probability ranges are laid out.
_PROFILE_FAULTS = ("p_429", "p_500", "p_401", "p_400", "p_malformed", "p_truncated", "p_reset")


def _check_fault_sum(inst: Profile, _attr: attrs.Attribute[Any], _value: Any) -> None:
    total = sum(getattr(inst, name) for name in _PROFILE_FAULTS)
    if total > 1.0 + 1e-9:
        raise ValueError(f"fault probabilities add up to {total:.3f} > 1")


@attrs.frozen(kw_only=True)
class Profile:
    """Seeded distributions that draw one :class:`Reply` per request.

    Distribution fields (``first_token_s``, ``inter_token_s``, ``tokens``,
    ``hang_s``, ``stall_s``, ``retry_after_s``) take a number, a ``(lo, hi)``
    uniform range, or a callable ``(random.Random) -> float``.  The fault
    probabilities (``p_429`` … ``p_reset``) are mutually exclusive slices of one
    uniform draw and must add up to at most 1.  A hang (``hang_p``) adds ``hang_s``
    to the first-token wait, or before the headers with ``hang_phase="headers"``.  A
    stall (``stall_p``) puts ``stall_s`` of silence after a random token strictly
    inside the stream.  Malformed/truncated/reset faults strike after a random
    number of tokens.  ``streaming=False`` answers stream requests with plain JSON.
    Fields a Profile does not draw come from ``base``; ``keepalive_s`` is the
    Profile's when set, else the base's.  The distribution fields are always drawn:
    their defaults (0, 0, 8 tokens) replace the base's values.
    """

    first_token_s: Distribution = attrs.field(
        default=0.0, converter=_to_distribution, validator=_check_distribution
    )
    inter_token_s: Distribution = attrs.field(
        default=0.0, converter=_to_distribution, validator=_check_distribution
    )
    tokens: Distribution = attrs.field(
        default=8, converter=_to_distribution, validator=_check_distribution
    )
    hang_p: float = attrs.field(default=0.0, validator=_probability)
    hang_s: Distribution = attrs.field(
        default=0.0, converter=_to_distribution, validator=_check_distribution
    )
    hang_phase: Literal["first_token", "headers"] = attrs.field(
        default="first_token", validator=attrs.validators.in_(("first_token", "headers"))
    )
    stall_p: float = attrs.field(default=0.0, validator=_probability)
    stall_s: Distribution = attrs.field(
        default=0.0, converter=_to_distribution, validator=_check_distribution
    )
    keepalive_s: float | None = attrs.field(default=None, validator=_keepalive)
    p_429: float = attrs.field(default=0.0, validator=_probability)
    retry_after_s: Distribution = attrs.field(
        default=1.0, converter=_to_distribution, validator=_check_distribution
    )
    p_500: float = attrs.field(default=0.0, validator=_probability)
    p_401: float = attrs.field(default=0.0, validator=_probability)
    p_400: float = attrs.field(default=0.0, validator=_probability)
    p_malformed: float = attrs.field(default=0.0, validator=_probability)
    p_truncated: float = attrs.field(default=0.0, validator=_probability)
    p_reset: float = attrs.field(default=0.0, validator=[*_probability, _check_fault_sum])
    streaming: bool = attrs.field(default=True, validator=_flag)
    base: Reply = attrs.field(factory=Reply, validator=_reply)

    def draw(self, rng: random.Random, request: object = None) -> Reply:
        """The Reply for one request (``request`` is accepted for symmetry with
        callable behaviours and not used).  See the module docstring for why this is
        deterministic."""
        del request
        r = random.Random(rng.getrandbits(64))
        u_fault, u_fault_at, u_hang, u_stall, u_stall_at = (r.random() for _ in range(5))
        first = sample(self.first_token_s, r)
        inter = sample(self.inter_token_s, r)
        drawn = sample(self.tokens, r)
        if not isinstance(drawn, int | float) or isinstance(drawn, bool) or not math.isfinite(drawn):
            raise ValueError(f"Profile.tokens: the distribution returned {drawn!r}, not a finite number")
        tokens = max(0, round(drawn))
        hang = sample(self.hang_s, r)
        stall = sample(self.stall_s, r)
        retry_after = sample(self.retry_after_s, r)

        changes: dict[str, Any] = {
            "first_token_s": first,
            "inter_token_s": inter,
            "tokens": tokens,
            # Not drawn: the Profile's own value, else its base's (as every field it
            # does not draw); a keep-alive set on the base was silently dropped.
            "keepalive_s": self.keepalive_s if self.keepalive_s is not None else self.base.keepalive_s,
            "stream": self.base.stream if self.streaming else False,
        }
        if u_hang < self.hang_p:
            if self.hang_phase == "headers":
                changes["headers_delay_s"] = self.base.headers_delay_s + hang
            else:
                changes["first_token_s"] = first + hang
        # Stalls and faults fall among the tokens the answer streams: the drawn words,
        # or the base's own text, reasoning and tool calls.
        count = answer_tokens(self.base, tokens)
        if u_stall < self.stall_p:
            changes["stall_at"] = 1 + int(u_stall_at * (count - 1)) if count >= 2 else count
            changes["stall_s"] = stall
        changes.update(self._fault_changes(u_fault, u_fault_at, count, retry_after))
        return attrs.evolve(self.base, **changes)

    def _fault_changes(
        self, u: float, u_at: float, tokens: int, retry_after: float
    ) -> dict[str, Any]:
        edge = 0.0
        for name in _PROFILE_FAULTS:
            edge += getattr(self, name)
            if u < edge:
                break
        else:
            return {}
        after = int(u_at * (tokens + 1))
        changes: dict[str, dict[str, Any]] = {
            "p_429": {"status": 429, "retry_after_s": retry_after},
            "p_500": {"status": 500},
            "p_401": {"status": 401},
            "p_400": {"status": 400},
            "p_malformed": {"fault": "malformed_json", "fault_after": after},
            "p_truncated": {"fault": "truncated", "fault_after": after},
            "p_reset": {"fault": "reset", "fault_after": after},
        }
        return changes[name]
