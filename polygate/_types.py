"""Public result records: responses, chunks, usage and per-call statistics."""

from __future__ import annotations

import json
from collections.abc import Container, Mapping
from typing import Any, Final, Protocol

import attrs

__all__ = [
    "CallStats", "ChatResponse", "EmbeddingResponse", "OcrPage", "OcrResponse", "StreamChunk",
    "TextParts", "Usage", "choice_index", "message_delta",
]


def json_default(value: Any) -> Any:
    """For ``json`` encoders (``default=``): a Mapping that is not a dict (a
    MappingProxyType, a custom message class) is encoded as its items, as the public
    signatures (``Sequence[Mapping]``) allow; a pydantic model as the openai SDK sends
    one (:func:`model_json`)."""
    if isinstance(value, Mapping):
        return dict(value)
    dumped = model_json(value)
    if dumped is not None:
        return dumped
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class ModelMessage(Protocol):
    """A message given as a pydantic model (the openai SDK's ``ChatCompletionMessage``,
    appended to a history as its guides do): what ``model_json`` calls, so that a type
    checker takes such a history where the runtime does."""

    def model_dump(self, *, mode: str = ..., exclude_unset: bool = ...) -> dict[str, Any]: ...


def model_json(value: Any) -> Any:
    """A pydantic model instance (the openai SDK's ``ChatCompletionMessage``, its tool
    calls: what a caller appends to a history as the SDK's guides do) as the SDK
    writes one into a request: its fields that were given or read, in JSON's types;
    ``None`` for anything else (a model *class* too).  A model that cannot be dumped is
    a TypeError, as for any value JSON cannot hold."""
    dump = getattr(type(value), "model_dump", None)
    if not callable(dump):
        return None
    try:
        return dump(value, mode="json", exclude_unset=True)
    except Exception as exc:  # (its own validators, serialisers: the caller's to mend)
        raise TypeError(f"{type(value).__name__} could not be dumped to JSON: "
                        f"{type(exc).__name__}") from None


#: Compact JSON of messages as the wire carries them (a Mapping as its items), made
#: once: ``json.dumps`` with arguments builds an encoder per call.
encode_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=json_default).encode


def parts_text(parts: list[Any]) -> str:
    """The text of a content given as typed parts (``[{"type": "text", "text": ...}]``):
    the parts that have a string ``text``, joined -- but thinking, reasoning and
    refusal parts, which are no answer text."""
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
                   and p.get("type") not in NOT_TEXT_PARTS)


#: Typed parts that are no answer text (see ``parts_text``).
NOT_TEXT_PARTS: Final = frozenset({"thinking", "reasoning", "refusal"})
#: A choice's ``logprobs`` fields that are lists of tokens: one that is no list is no
#: tokens, for the assembler, a whole answer's reading and the gateway's relay alike.
LOGPROB_LISTS: Final = ("content", "refusal")


#: The most choices one answer may hold (OpenAI's own bound on ``n``): an upstream
#: answer with more, or with a choice whose index is at or over it and that carries
#: something, is malformed (``transport.Limits.max_choices``).
MAX_CHOICES = 128


_join = "".join  # a seam: tests count the characters joins copy
_append = list.append


class TextParts(list[str]):
    """A list of text pieces that joins them as a 16-ary tree while they arrive.

    A streamed answer arrives a token at a time; each piece is a small ``str`` with
    ~50 bytes of object overhead, kept until the answer is assembled.  Joining as it
    goes keeps a long answer near one byte per character instead of ~60 per token —
    what makes thousands of concurrent streams affordable.

    Every 16th piece joins the last 16 (level 0); every 256th then joins the last 16
    of those (level 1); and so on, like a base-16 counter's carries.  Each character
    is thus copied once per level — ``log16`` of the piece count, 5 for a million
    pieces — so the work stays linear in the bytes received (docs/security.md),
    where rejoining the whole text every 16 pieces was quadratic.  At most 15 pieces
    wait at each level.  Only ``append`` compacts; reading is as for any list.
    """

    __slots__ = ("_appended",)

    def __init__(self) -> None:
        super().__init__()
        self._appended = 0

    def append(self, piece: str) -> None:
        _append(self, piece)
        carries = self._appended = self._appended + 1
        if carries & 15:  # 15 appends in 16 end here (the hot path: one token)
            return
        while not carries & 15:
            carries >>= 4
            joined = _join(self[-16:])
            del self[-16:]
            _append(self, joined)


def indexless_call(call: Mapping[str, Any], calls: dict[int, dict[str, Any]]) -> int:
    """The index of a tool-call delta that has none (Gemini's OpenAI-compatible
    endpoint sends none): the last call's when it continues that call -- it names
    no call (no id, no name: an arguments fragment), or repeats the last call's id --
    else a new call's.  ``calls``: the choice's calls so far, by index, each with the
    ``id`` it has (``None`` when none came), the most recent last."""
    if not calls:
        return 0
    last: int = next(reversed(calls))
    cid = call.get("id")
    if isinstance(cid, str) and cid:
        if cid == calls[last]["id"]:
            return last
    else:
        function = call.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not (isinstance(name, str) and name):
            return last
    # Past every index so far (explicit ones need not run 0..n-1): a new call.
    return max(calls) + 1


def call_slot(
    call: Mapping[str, Any], calls: dict[int, dict[str, Any]], aliases: dict[int, int],
    closed: Container[int],
) -> int:
    """The key, in ``calls`` (a choice's tool calls so far, each with the ``id`` it
    has), of the call a tool-call delta belongs to: by its ``index`` -- unless it
    begins another call there: a name, an id that is not the held call's, and the held
    call's arguments complete so far (``closed``: the keys whose arguments end in a
    ``}`` or ``]``).  Ollama's OpenAI endpoint sends parallel calls each whole, every
    one at index 0 with its own id.  The new call's key comes after every key so far,
    and the index means it from then on (``aliases``).  A changed id alone, on the
    argument deltas of one call (Poolside's API, mlx-openai-server: a fresh id on every
    delta), or with the name again before the arguments are complete, stays the same
    call.  Without an index: :func:`indexless_call`."""
    index = call.get("index")
    if not isinstance(index, int):
        return indexless_call(call, calls)
    key = aliases.get(index, index)
    slot = calls.get(key)
    if slot is None or key not in closed:
        return key
    cid = call.get("id")
    function = call.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if isinstance(cid, str) and cid and slot["id"] is not None and cid != slot["id"] \
            and isinstance(name, str) and name:
        key = aliases[index] = max(calls) + 1
    return key


def note_closing(closed: set[int], key: int, arguments: Any) -> None:
    """Note in ``closed`` (see :func:`call_slot`) whether an arguments fragment leaves
    call ``key``'s arguments looking complete: its last character, blanks aside, a
    ``}`` or ``]``, or the whole of it ``null`` (what some Ollama versions send for a
    call without parameters).  A fragment that is not a string, or only blanks, says
    nothing."""
    if not isinstance(arguments, str):
        return
    end = arguments.rstrip()
    if not end:
        return
    if end.endswith(("}", "]")) or end == "null":
        closed.add(key)
    else:
        closed.discard(key)


#: An answer's (or a chunk's) own top-level keys: its header, choices and usage, and
#: OpenAI's padding (``obfuscation``, per chunk).  Any other is a provider's field
#: (Azure's ``prompt_filter_results``, llama.cpp's ``timings``).
ANSWER_KEYS: Final = frozenset({
    "id", "object", "created", "model", "system_fingerprint", "service_tier", "choices",
    "usage", "obfuscation", "error",
})


def valid_text(text: str) -> str:
    """``text`` as UTF-8 can hold it: every lone surrogate (JSON's ``"\\ud800"``
    escape, valid JSON but no Unicode text) read as U+FFFD, as a UTF-8 decoder with
    ``errors="replace"`` reads a bad byte; surrogate pairs join.  Such text would not
    print or encode: no sink takes it (a telemetry batch fails whole), and the next
    call would refuse it from the caller."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        # UTF-16 pairs what can pair and replaces the rest.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def carries_value(value: Any) -> bool:
    """Whether a provider field holds data: not null, nor an empty string, list or
    object (the library's assembly and the gateway's relay read it alike)."""
    return value is not None and value != "" and value != [] and value != {}


#: The objects that carry a tool call, by the call's type, with their text fields:
#: ``function`` (its name and arguments) and OpenAI's custom tools' ``custom`` (its
#: name and input); the assembly holds these fields (empty) from a call's first delta,
#: as a non-streamed answer always has them.  Any other object on a call's delta is a
#: provider's extra (Gemini's ``extra_content``).
CALL_PAYLOADS: Final[dict[str, tuple[str, ...]]] = {
    "function": ("name", "arguments"), "custom": ("name", "input"),
}


def finish_reason_of(value: Any) -> str | None:
    """A choice's ``finish_reason`` as the library reads it: a string that says one, or
    ``None`` -- for null, for anything not a string, and for ``""`` (StepFun and Zhipu
    send it on every chunk before the last, as others send null)."""
    return value if isinstance(value, str) and value else None


def carries_call(call: Mapping[str, Any]) -> bool:
    """Whether a tool-call delta sets anything (an id, a type, a payload: see
    CALL_PAYLOADS): one that does not gets no call, in the library's answer or the
    gateway's relay."""
    if isinstance(call.get("id"), str) and call["id"]:
        return True
    if isinstance(call.get("type"), str) and call["type"]:
        return True
    return any(type(call.get(key)) is dict for key in CALL_PAYLOADS)


def call_type(call: Mapping[str, Any]) -> str:
    """The type of the tool call a delta begins: its ``type``; without one (Azure AI
    Foundry's and Mistral's streams leave it out), ``custom`` for a delta that carries
    a custom tool's payload and no function's; else ``function``, as OpenAI's answers
    have it."""
    kind = call.get("type")
    if isinstance(kind, str) and kind:
        return kind
    if type(call.get("custom")) is dict and type(call.get("function")) is not dict:
        return "custom"
    return "function"


def name_again(held: list[str], size: int, name: str) -> bool:
    """Whether a tool call's ``name`` delta is the name again (some servers repeat it
    whole on later deltas), or extends it, rather than a fragment of it: ``held``, the
    name so far in pieces, ``size`` characters.  A one-character name so far is always
    a first fragment: "l", "l", "m" and "l", "lm_lookup" are "llm…", not the name
    repeated (a one-letter function name repeated whole would read as "ff": none was
    seen).  ``held`` is joined only to be compared with a name at least as long, so
    that work is paid by the bytes received."""
    return size >= 2 and len(name) >= size and name.startswith("".join(held))


def carries_something(choice: Mapping[str, Any]) -> bool:
    """Whether a stream choice carries anything: folding it into an answer would change
    it (``transport.ChatAssembler``), and the gateway relays it.  One that carries
    nothing (``{"index": 7}``, an empty delta) needs no state, whatever its index."""
    for key, value in choice.items():
        if value is None or key == "index" or key == "message":
            continue
        if key == "delta":
            if isinstance(value, dict) and any(v is not None for v in value.values()):
                return True
        elif key == "finish_reason":
            if finish_reason_of(value) is not None:
                return True
        elif key == "logprobs":
            if isinstance(value, dict):
                return True
        else:
            return True
    return False


def choice_index(choice: Mapping[str, Any]) -> int | None:
    """A choice's ``index`` as the wire gives it, or ``None`` when it is malformed.

    The one rule for every reader of choices (the assembler, the JSON body check, the
    stream's first-choice pick, the gateway's relay): a missing index is 0, as
    OpenAI-compatible servers that omit it send one choice; any other value that is
    not a natural number -- a bool (an ``int`` to Python, not to JSON), a float, a
    string, null, a negative -- is malformed.  Reading ``1.0`` or ``"1"`` as 0
    spliced a second choice's text into the answer, and a negative one sorted
    before choice 0 and replaced it.  An index at or over ``MAX_CHOICES`` is a natural
    number here; the readers refuse a choice that carries something at one."""
    index = choice.get("index", 0)
    if type(index) is int and index >= 0:  # type, not isinstance: a bool is no index
        return index
    return None


def message_delta(message: Mapping[str, Any]) -> dict[str, Any]:
    """A whole message (a JSON answer's) as the one delta a stream shows it in: its
    non-null fields, each tool call with its position as ``index`` (a stream delta's
    tool call must carry one: clients assemble calls by it).  In a whole message the
    position is what tells calls apart: an ``index`` a bridge put on every call (0 on
    each, seen from some) would merge them in a client."""
    delta = {k: v for k, v in message.items() if v is not None}
    calls = delta.get("tool_calls")
    if isinstance(calls, list) and any(
            isinstance(c, Mapping) and c.get("index") != i for i, c in enumerate(calls)):
        delta["tool_calls"] = [
            {**c, "index": i} if isinstance(c, Mapping) else c for i, c in enumerate(calls)
        ]
    return delta


@attrs.frozen
class Usage:
    """Token usage of one answer.  ``source`` says whether the upstream reported it
    (``"upstream"``) or polygate estimated it (``"estimated"``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    source: str = "upstream"

    @classmethod
    def from_wire(cls, payload: Any) -> Usage | None:
        """A usage record from an upstream ``usage`` object; ``None`` when it is absent
        or not believable (missing fields, negatives, absurdly large numbers).

        The total is the sum of the reported parts: ``total_tokens`` counts only when
        neither ``prompt_tokens`` nor ``completion_tokens`` is reported.  Quotas settle
        the total, so a ``total_tokens`` far above its parts (a bug, or a hostile
        upstream) would otherwise hold a TPM window for 60 s; one below them would
        under-count (docs/admission.md, "Accounting rules")."""
        if not isinstance(payload, dict):
            return None
        prompt = payload.get("prompt_tokens")
        completion = payload.get("completion_tokens")
        parts = prompt is not None or completion is not None
        if prompt is None:
            prompt = 0
        if completion is None:
            completion = 0
        if not (_plausible(prompt) and _plausible(completion)):
            return None
        total: Any = payload.get("total_tokens")
        if not parts and not _plausible(total):
            # ``{}``, or only a total that is no count (a string, a negative, 1e300):
            # nothing was reported, so the estimate stands -- a usage of 0 "from the
            # upstream" would settle nothing in the TPM window and show clients 0.
            return None
        if parts:
            total = prompt + completion
        return cls(int(prompt), int(completion), int(total), "upstream")


_MAX_PLAUSIBLE_TOKENS = 100_000_000


def _plausible(value: Any) -> bool:
    if type(value) is float:
        # 10.0 is the number 10 in JSON: a whole float counts as its integer.
        return value.is_integer() and 0 <= value <= _MAX_PLAUSIBLE_TOKENS
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and 0 <= value <= _MAX_PLAUSIBLE_TOKENS
    )


@attrs.frozen
class CallStats:
    """Statistics of one logical call, frozen after every path has been cleaned up.

    ``total_latency_ms - generation_ms`` is the waiting overhead (admission, backoff,
    retries, hedge triggers, loser cleanup).  ``ttft_ms`` and ``stall_ms`` say where
    the winner's generation time went.  See ``docs/statistics.md``.
    """

    logical_call_id: str
    attempts: int = 0
    hedges: int = 0
    hedge_won: bool = False
    source: str | None = None
    total_latency_ms: float = 0.0
    generation_ms: float = 0.0
    ttft_ms: float | None = None
    stall_ms: float | None = None
    stall_count: int | None = None
    active_generation_ms: float | None = None
    cached: bool = False
    reasks: int = 0
    # The scope that answered (another than the one asked when the call fell back).
    scope: str | None = None
    # Committed streams continued on another source after their path failed.
    resumes: int = 0


@attrs.frozen
class ChatResponse:
    """The answer of a chat call, shaped as a non-streamed OpenAI response would be.

    ``message`` is the first choice's assembled assistant message; ``choices`` holds
    every choice; ``raw`` the whole response body (for a streamed upstream, the
    equivalent non-streamed body, provider extras included).  ``parsed`` is set by a
    call made with ``schema=``: the validated answer (an instance of the pydantic
    model, or the JSON value a JSON Schema accepted); ``None`` otherwise.
    """

    text: str
    message: dict[str, Any]
    choices: list[dict[str, Any]]
    usage: Usage | None
    source: str
    model: str | None
    finish_reason: str | None
    call_stats: CallStats
    raw: dict[str, Any] = attrs.field(repr=False)
    parsed: Any = None


@attrs.frozen
class StreamChunk:
    """One content-bearing chunk of a stream.

    ``text`` is the first choice's content delta (``""`` when that chunk carries only
    reasoning, refusal or tool-call deltas, or deltas of other choices); ``delta`` the
    first choice's delta; ``raw`` the chunk as received.  ``resumed`` marks the first
    chunk of a continuation: the stream's source failed and another one took over.
    """

    text: str
    delta: dict[str, Any]
    raw: dict[str, Any] = attrs.field(repr=False)
    resumed: bool = False

    @property
    def reasoning(self) -> str:
        # The first that is text, as the assembler reads them (a reasoning_content of
        # 5 beside a reasoning of "think" is "think").
        for key in ("reasoning_content", "reasoning"):
            value = self.delta.get(key)
            if isinstance(value, str) and value:
                return value
        return ""


@attrs.frozen
class EmbeddingResponse:
    """Embedding vectors in input order.

    ``usage`` covers every input of the call.  ``upstream_usage`` is the part this
    call's own upstream requests spent: without a cache the same; with one, less the
    inputs answered from the cache or by another call's request (0 tokens when none
    went upstream).  None on a response built by hand."""

    vectors: list[list[float]] = attrs.field(repr=lambda v: f"<{len(v)} vectors>")
    usage: Usage | None
    call_stats: CallStats
    model: str | None = None
    source: str | None = None
    upstream_usage: Usage | None = attrs.field(default=None, repr=False)


@attrs.frozen
class OcrPage:
    """One page of an OCR call: its 0-based ``index`` in the document, the text the
    model transcribed, that page's usage and the source that answered it."""

    index: int
    text: str = attrs.field(repr=lambda t: repr(t if len(t) <= 60 else t[:60] + "…"))
    usage: Usage | None
    source: str


@attrs.frozen
class OcrResponse:
    """The answer of an OCR call: ``text`` is the pages' texts joined in document
    order (``"\n\n"`` between pages); ``pages`` holds each page."""

    text: str = attrs.field(repr=lambda t: f"<{len(t)} characters>")
    pages: list[OcrPage]
    usage: Usage | None
    source: str | None
    model: str | None
    call_stats: CallStats
