"""Assembling streamed chat chunks into the message a non-streamed call would return.

Pure and synchronous: it is fed parsed chunk dicts and knows nothing of sockets or
time, so it is tested directly against the recorded provider transcripts.

What counts as a *content token* (``docs/concepts.md``) is decided here, in
:func:`has_content`: non-empty ``content``, ``reasoning_content``/``reasoning``,
``refusal``, a tool call's id or a piece of its name or arguments, the same of the
legacy ``function_call``, or a piece of ``audio`` in any choice's delta.  Role-only and
empty deltas, usage-only chunks
and provider annotations are not content and reset no timer.
"""

from __future__ import annotations

from typing import Any

from .._errors import TransientUpstreamError
from .._types import (
    CALL_PAYLOADS,
    LOGPROB_LISTS,
    TextParts,
    call_slot,
    call_type,
    carries_call,
    carries_something,
    carries_value,
    choice_index,
    finish_reason_of,
    name_again,
    note_closing,
    parts_text,
)

__all__ = [
    "ChatAssembler", "TextParts", "drop_last", "has_content", "message_text", "malformed_index",
    "shows_call_or_refusal",
]

_CONTENT_KEYS = ("content", "reasoning_content", "reasoning", "refusal")
#: A tool-call delta's own fields, never merged as a provider's object.
_CALL_OWN = frozenset({"id", "type", "index"})
# Keys of a chunk that describe the chunk itself, not the response.
_CHUNK_ONLY_KEYS = frozenset({"object", "choices", "usage", "obfuscation", "error"})
_HEADER_KEYS = ("id", "created", "model", "system_fingerprint")
#: A chunk's keys that never become an extra of the answer, other than the two that
#: ChatAssembler.add reads (choices, usage): every chunk carries most of them.
_HELD_ELSEWHERE = (_CHUNK_ONLY_KEYS - {"choices", "usage"}) | frozenset(_HEADER_KEYS)


def has_content(chunk: dict[str, Any]) -> bool:
    """Whether a parsed chunk carries at least one content token."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(choice, dict) and _choice_has_content(choice) for choice in choices)


def _choice_has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    for key in _CONTENT_KEYS:
        value = delta.get(key)
        if isinstance(value, str) and value:
            return True
    # A call's output (the legacy function_call's too: an empty one, {} or
    # {"arguments": ""}, is an empty delta, as the SPEC says: no content).
    if shows_call_or_refusal(delta):
        return True
    audio = delta.get("audio")
    return isinstance(audio, dict) and carries_audio(audio)


def shows_call_or_refusal(delta: dict[str, Any]) -> bool:
    """Whether a delta carries what the assembler keeps of a tool call, a legacy
    ``function_call`` or a refusal: model output that another model cannot continue.
    A value the assembler ignores for its type (``refusal: 5``, ``tool_calls: "f"``)
    or an empty one (``{"index": 0}``, ``{"arguments": ""}``) is none."""
    refusal = delta.get("refusal")
    if isinstance(refusal, str) and refusal:
        return True
    tool_calls = delta.get("tool_calls")
    if isinstance(tool_calls, list) and any(_carries_tool_output(call) for call in tool_calls):
        return True
    function_call = delta.get("function_call")
    return isinstance(function_call, dict) and _carries_function(function_call)


def carries_audio(audio: dict[str, Any]) -> bool:
    """OpenAI's streamed ``audio`` with a piece of its data or transcript: model output,
    a content token as text is (its ``id`` or ``expires_at`` alone is not)."""
    return _nonempty(audio.get("data")) or _nonempty(audio.get("transcript"))


def _carries_tool_output(call: object) -> bool:
    """A tool-call delta with model output in it: its id, or a piece of its function's
    (or a custom tool's) name or arguments.  ``{"index": 0}``, a bare ``type`` or empty
    strings are an empty delta, no content token: they move no hedging timer and commit
    no stream, as an empty legacy ``function_call`` does not."""
    if type(call) is not dict:
        return False
    if _nonempty(call.get("id")):
        return True
    return any(type(value) is dict and _carries_function(value) for value in call.values())


def _carries_function(function_call: dict[str, Any]) -> bool:
    """A legacy ``function_call`` delta with its name or a piece of its arguments."""
    return any(isinstance(v, str) and v for v in function_call.values())


#: A delta's and a choice's keys that content tokens, the assembly or the gateway's own
#: chunks already carry (see carries_extras).
_PLAIN_DELTA_KEYS = frozenset({"role", *_CONTENT_KEYS, "tool_calls", "function_call"})
_PLAIN_CHOICE_KEYS = frozenset({"index", "delta", "finish_reason", "logprobs", "message"})
#: A delta's objects whose strings are streamed in pieces, to be joined (see _add_delta).
_JOINED_DELTA_OBJECTS = frozenset({"audio"})


def carries_extras(chunk: dict[str, Any]) -> bool:
    """Whether a chunk without a content token still carries data a stream's caller
    must see: a delta field beyond the content keys (OpenRouter's ``reasoning_details``
    holding a thinking block's signature, which the next turn sends back), a choice
    field beyond the usual (Azure's ``content_filter_results`` on the finish chunk), or
    logprobs entries."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            carries_value(v) for k, v in delta.items() if k not in _PLAIN_DELTA_KEYS
        ):
            return True
        if any(carries_value(v) for k, v in choice.items() if k not in _PLAIN_CHOICE_KEYS):
            return True
        logprobs = choice.get("logprobs")
        if type(logprobs) is dict and any(
            type(v) is list and v for v in (logprobs.get("content"), logprobs.get("refusal"))
        ):
            # A token that is part of a character (OpenAI's "bytes:\xe4\xbd", with
            # "content": ""), or vLLM's last: its entry, with no text to ride on.
            return True
    return False


def _nonempty(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return parts_text(content)
    return ""


def malformed_index(choice: dict[str, Any], what: str) -> str:
    """Why ``choice`` (whose index :func:`~polygate._types.choice_index` refused)
    makes ``what`` malformed."""
    index = choice.get("index")
    shown = "null" if index is None else repr(index)[:24]
    return f"{what}: choice index {shown} (not a natural number)"


def index_over(index: int, max_choices: int, what: str) -> str:
    """Why a choice ``index`` at or over the cap on choices makes ``what`` malformed,
    when the choice carries something (one that carries nothing is ignored, whatever
    its index): indexes run from 0 to n - 1, so it says the answer holds more choices
    than that.  (Taken as a choice, it cost the gateway's relay a role for every index
    below it: seconds of the event loop for one chunk.)"""
    return f"{what}: choice index {index}, over the {max_choices} choices one answer may hold"


def drop_last(parts: list[str], text: str) -> None:
    """Take back ``text``, the last piece appended to ``parts`` (a :class:`TextParts`
    may have joined it into its last element: it is that element's end either way)."""
    last = parts[-1]
    if len(last) == len(text):
        parts.pop()
    else:
        parts[-1] = last[: len(last) - len(text)]


class _Choice:
    __slots__ = (
        "_aliases", "_closed", "_max_tool_calls", "_source",
        "content", "extras", "finish_reason", "function_call", "index", "logprobs",
        "message_extras", "reasoning", "reasoning_name", "refusal", "role", "saw_content",
        "tool_calls",
    )

    def __init__(self, index: int, max_tool_calls: int = 128, source: str | None = None) -> None:
        self.index = index
        self._max_tool_calls = max_tool_calls
        self._source = source
        self.role: str | None = None
        self.content: list[str] = TextParts()
        self.saw_content = False
        self.reasoning: list[str] = TextParts()
        self.reasoning_name: str | None = None
        self.refusal: list[str] = TextParts()
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self._aliases: dict[int, int] = {}  # tool-call indexes that mean a later call (call_slot)
        self._closed: set[int] = set()  # calls whose arguments look complete so far (call_slot)
        self.function_call: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.logprobs: dict[str, Any] | None = None
        self.extras: dict[str, Any] = {}
        self.message_extras: dict[str, Any] = {}

    def add(self, choice: dict[str, Any]) -> bool:
        """Fold one choice of a chunk in; True when its delta carried content."""
        content = False
        for key, value in choice.items():
            if value is None:  # nothing to fold in ("logprobs": null, "finish_reason": null)
                continue
            if key == "delta":
                if isinstance(value, dict):
                    content = self._add_delta(value)
            elif key == "finish_reason":
                reason = finish_reason_of(value)
                if reason is not None:
                    self.finish_reason = reason
            elif key == "logprobs":
                if isinstance(value, dict):
                    self._add_logprobs(value)
            elif key != "index" and key != "message":
                _merge_extra(self.extras, key, value)
        return content

    def _add_delta(self, delta: dict[str, Any]) -> bool:
        # One pass over the (usually one-key) delta: this runs for every chunk.
        content = False
        for key, value in delta.items():
            if value is None:
                continue
            if key == "content":
                if isinstance(value, str):
                    self.saw_content = True
                    if value:
                        self.content.append(value)
                        content = True
            elif key == "reasoning_content" or key == "reasoning":
                if key == "reasoning" and _nonempty(delta.get("reasoning_content")):
                    continue  # the same text under both names (LightLLM, some vLLM): once
                if isinstance(value, str) and value:
                    self.reasoning.append(value)
                    content = True
                    if self.reasoning_name is None:
                        self.reasoning_name = key
            elif key == "role":
                if isinstance(value, str):
                    self.role = value
            elif key == "refusal":
                if isinstance(value, str) and value:
                    self.refusal.append(value)
                    content = True
            elif key == "tool_calls":
                if isinstance(value, list):
                    for call in value:
                        if isinstance(call, dict):
                            content = content or _carries_tool_output(call)
                            self._add_tool_call(call)
            elif key == "function_call":
                if isinstance(value, dict) and _carries_function(value):
                    content = True
                    if self.function_call is None:
                        self.function_call = {"name": TextParts(), "arguments": TextParts()}
                    _join_function(self.function_call, value)
            else:
                # OpenAI's ``audio`` comes in pieces, as content does (``data`` and
                # ``transcript`` streamed): its strings join, and a piece is a content
                # token.  Any other object keeps the last string sent: a signature or a
                # label sent again whole (Gemini's ``extra_content``) must not double.
                if key == "audio" and isinstance(value, dict) and carries_audio(value):
                    content = True
                _merge_extra(self.message_extras, key, value, join=key in _JOINED_DELTA_OBJECTS)
        return content

    def _add_tool_call(self, call: dict[str, Any]) -> None:
        index = call_slot(call, self.tool_calls, self._aliases, self._closed)
        slot = self.tool_calls.get(index)
        if slot is None:
            if not carries_call(call):
                return  # nothing to keep: no slot (an index flood costs nothing)
            if len(self.tool_calls) >= self._max_tool_calls:
                raise TransientUpstreamError(
                    f"malformed stream: more than {self._max_tool_calls} tool calls in a choice",
                    source=self._source,
                )
            kind = call_type(call)
            slot = {"id": None, "type": kind}
            fields = CALL_PAYLOADS.get(kind)
            if fields is not None:  # (as a non-streamed call has them, sent or not)
                slot[kind] = {field: TextParts() for field in fields}
            self.tool_calls[index] = slot
        if isinstance(call.get("id"), str) and call["id"] and slot["id"] is None:
            # The first id stays: one sent again changed on the deltas of one call (a
            # server that renumbers them) is the same call (see call_slot; the
            # gateway's clients see the first).
            slot["id"] = call["id"]
        if isinstance(call.get("type"), str) and call["type"]:
            slot["type"] = call["type"]
        for key, value in call.items():
            # (An ``id``, ``type`` or ``index`` that is an object is no provider's
            # object: merged, it replaced the call's own id or type.)
            if type(value) is not dict or key in _CALL_OWN:
                continue
            if key in CALL_PAYLOADS:
                # The call's payload: ``function`` (name and arguments), or a custom
                # tool's ``custom`` (name and input), streamed in pieces alike.
                held = slot.get(key)
                if type(held) is not dict:
                    held = slot[key] = {}
                _join_function(held, value)
                if key == "function":
                    note_closing(self._closed, index, value.get("arguments"))
            else:
                # A provider's object (Gemini's ``extra_content`` with its thought
                # signature, sent again whole on later deltas): merged field by field,
                # the last string sent kept, as a message's extras are.
                _merge_extra(slot, key, value)

    def _add_logprobs(self, logprobs: dict[str, Any]) -> None:
        if self.logprobs is None:
            self.logprobs = {}
        for key, value in logprobs.items():
            if key in LOGPROB_LISTS and value is not None and type(value) is not list:
                continue  # (no tokens: kept, a client's list of them met a string)
            if isinstance(value, list):
                self.logprobs.setdefault(key, [])
                if isinstance(self.logprobs[key], list):
                    self.logprobs[key].extend(value)
                else:
                    self.logprobs[key] = list(value)
            else:
                self.logprobs.setdefault(key, value)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role or "assistant"}
        if self.saw_content or self.content:
            message["content"] = "".join(self.content)
        elif self.tool_calls or self.refusal or self.function_call or self.message_extras.get("audio"):
            # (An answer of audio alone has no text: null, as OpenAI's JSON has it.)
            message["content"] = None
        else:
            message["content"] = ""
        # OpenAI's non-streamed message always carries "refusal" (null when none).
        message["refusal"] = "".join(self.refusal) if self.refusal else None
        if self.reasoning:
            text = "".join(self.reasoning)
            message["reasoning_content"] = text
            if self.reasoning_name == "reasoning":
                message["reasoning"] = text
        if self.tool_calls:
            # In the order the calls began (as a client of the gateway's stream, and a
            # cached answer's replay, list them), which is the indexes' order whenever
            # a server numbers its calls as it starts them.
            message["tool_calls"] = [_finished(call) for call in self.tool_calls.values()]
        if self.function_call is not None:
            message["function_call"] = _finished(self.function_call)
        for key, value in self.message_extras.items():
            message.setdefault(key, _finished(value))
        return message

    def as_dict(self) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": self.index,
            "message": self.message(),
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
        }
        for key, value in self.extras.items():
            choice.setdefault(key, _finished(value))
        return choice


def _join_function(target: dict[str, Any], part: dict[str, Any]) -> None:
    """A piece of a legacy ``function_call`` or of a tool call's payload joined into
    what is held: its ``name`` (sent once, in pieces, or again whole) and its other
    strings (``arguments``, a custom tool's ``input``) in pieces; tags replaced."""
    for key, value in part.items():
        if not isinstance(value, str):
            # (Not over text held in pieces: an object where a string belongs,
            # ``arguments: {}``, is ignored there, as it always was.)
            if value is not None and not isinstance(target.get(key), TextParts):
                target[key] = _own(value)
        elif key == "name":
            if value:
                # Most servers send the name once; a few repeat it whole on later
                # deltas.  Held as pieces, as the arguments are, so the whole stays
                # linear.
                held = target.get(key)
                if not isinstance(held, TextParts):
                    held = target[key] = TextParts()
                size = sum(map(len, held))  # (a few pieces: they are joined as they come)
                if name_again(held, size, value):
                    target[key] = held = TextParts()
                held.append(value)
        elif key in _TAGS:
            target[key] = value
        else:
            # Held as pieces, joined at the end: ``+=`` on a string that a dict also
            # holds copies all of it each time -- quadratic in a hostile stream of
            # one-character fragments (seconds of the loop for the body cap's worth).
            held = target.get(key)
            if not isinstance(held, TextParts):
                held = target[key] = TextParts()
            held.append(value)


def _merge_extra(target: dict[str, Any], key: str, value: Any, *, join: bool = False) -> None:
    """A provider extra of a delta or a choice, assembled as a non-streamed answer
    would hold it: objects merge field by field (Azure's ``content_filter_results``:
    an empty ``{}`` on the finish chunk, or a later annotation of other categories,
    keeps what came before), their strings joined with ``join`` (OpenAI's streamed
    ``audio``, its ``data`` and ``transcript`` in pieces; never its tags, ``id`` ...)
    and otherwise the last sent (a report, a signature sent again); list items that
    carry an ``index`` merge into the item of that index, their strings joined
    (OpenRouter's ``reasoning_details``: one entry per index, its text whole), other
    items accumulate; scalars: last wins.  What is held is a copy: the chunks (handed
    to a stream's caller) are never changed."""
    existing = target.get(key)
    if isinstance(value, list) and isinstance(existing, list):
        _merge_items(existing, value)
    elif isinstance(value, dict) and isinstance(existing, dict):
        _merge_fields(existing, value, join=join)
    else:
        target[key] = _own(value)


def _merge_top(target: dict[str, Any], key: str, value: Any) -> None:
    """A chunk's own extra (beside its choices), as ``_merge_extra`` -- but a list
    that begins with what is held is that list again, whole or grown, not more of it:
    Perplexity sends its ``citations`` and ``search_results`` whole on every chunk (a
    non-streamed answer holds each once)."""
    existing = target.get(key)
    if (type(value) is list and type(existing) is list and len(value) >= len(existing)
            and value[:len(existing)] == existing):
        target[key] = _own(value)
    else:
        _merge_extra(target, key, value)


#: Fields of an indexed list item that name or tag it: replaced, never joined (the
#: same ``format`` in every fragment must not become its repetition).
_TAGS = frozenset({"index", "type", "format", "id", "signature"})


#: How far back an indexed item looks for the entry of its index: fragments continue
#: one of the last few entries, and a stream of new indexes must cost each chunk a
#: bounded look, not one over everything held (quadratic: 17 s for 30,000 chunks).
_MERGE_LOOKBACK = 64


def _merge_items(held: list[Any], items: list[Any]) -> None:
    for item in items:
        index = item.get("index") if isinstance(item, dict) else None
        if type(index) is int:
            for entry in reversed(held[-_MERGE_LOOKBACK:]):
                if isinstance(entry, dict) and entry.get("index") == index:
                    _merge_fields(entry, item, join=True)
                    break
            else:
                held.append(_own(item))
        else:
            held.append(_own(item))


def _merge_fields(held: dict[str, Any], fields: dict[str, Any], *, join: bool) -> None:
    for key, value in fields.items():
        old = held.get(key)
        if value is None and key in held:
            continue  # a null does not erase what came (as the SDK's accumulator)
        if isinstance(old, TextParts):  # (a list subclass: before the lists below)
            if join and isinstance(value, str):
                old.append(value)  # (pieces, joined at the end: see _join_function)
            else:
                held[key] = _own(value)  # another kind of value: the last wins
        elif isinstance(old, dict) and isinstance(value, dict):
            _merge_fields(old, value, join=join)
        elif isinstance(old, list) and isinstance(value, list):
            _merge_items(old, value)
        elif join and isinstance(old, str) and isinstance(value, str) and key not in _TAGS:
            parts = held[key] = TextParts()
            parts.append(old)
            parts.append(value)
        elif key in _TAGS and value == "" and old:
            continue  # an empty tag (a signature to come) keeps the one that came
        else:
            held[key] = _own(value)


def _finished(value: Any) -> Any:
    """What is held as the answer holds it: text pieces joined (a copy of the
    containers on the way, so a second build is the same)."""
    if isinstance(value, TextParts):
        return "".join(value)
    if isinstance(value, dict):
        return {k: _finished(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finished(v) for v in value]
    return value


def _own(value: Any) -> Any:
    """A copy of a JSON value's containers (the merges above change them in place)."""
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_own(v) for v in value]
    return value


class ChatAssembler:
    """Accumulates ``chat.completion.chunk`` dicts; ``build()`` gives the response body.

    Bounded whatever the upstream sends: a choice (or tool call) gets state only
    when it carries something, and at most ``max_choices`` choices (and
    ``max_tool_calls`` tool calls per choice) do; one more is a malformed stream
    (:class:`~polygate.TransientUpstreamError`).  Without the caps a stream of new
    indexes held 25–60 times its own size.
    """

    def __init__(
        self, *, max_choices: int = 128, max_tool_calls: int = 128, source: str | None = None
    ) -> None:
        self._max_choices = max_choices
        self._max_tool_calls = max_tool_calls
        self._source = source
        #: Why the stream is malformed (a choice index that is not a natural number).
        self.malformed: str | None = None
        #: Some chunk held a choice (with a valid index), even one that carried
        #: nothing: without one the stream is no answer (see :meth:`build`).
        self.saw_choice = False
        self._choices: dict[int, _Choice] = {}
        self._header: dict[str, Any] = {}
        self._missing = set(_HEADER_KEYS)
        self._extras: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.chunks = 0
        #: Choices that have reported their finish_reason (see all_finished).
        self.finishes = 0

    def add(self, chunk: dict[str, Any]) -> bool:
        """Fold one chunk in; True when it carried at least one content token (the
        same answer as :func:`has_content`, without a second pass)."""
        self.chunks += 1
        missing = self._missing
        if missing:
            for key in tuple(missing):
                value = chunk.get(key)
                if value not in (None, "", 0):
                    self._header[key] = value
                    missing.discard(key)
        content = False
        for key, value in chunk.items():
            if key in _HELD_ELSEWHERE:  # id, object, model...: one look-up, not four
                continue
            if key == "choices":
                if isinstance(value, list):
                    for choice in value:
                        if not isinstance(choice, dict):
                            continue
                        index = choice_index(choice)
                        if index is None:
                            # Noted, not raised: add() is total (any chunk folds in);
                            # the exchange ends the attempt on it.  Never folded into
                            # another choice; its content still counts as content, as
                            # has_content() counts it.
                            if self.malformed is None:
                                self.malformed = malformed_index(choice, "malformed stream")
                            if _choice_has_content(choice):
                                content = True
                            continue
                        self.saw_choice = True
                        state = self._choices.get(index)
                        if state is None:
                            if not carries_something(choice):
                                continue
                            state = self._new_choice(index)
                        unfinished = state.finish_reason is None
                        if state.add(choice):
                            content = True
                        if unfinished and state.finish_reason is not None:
                            self.finishes += 1
            elif key == "usage":
                if isinstance(value, dict):
                    self.usage = value  # cumulative on vLLM: the last one is the total
            elif value is not None:
                _merge_top(self._extras, key, value)
        return content

    def last_usage(self) -> dict[str, Any] | None:
        """The last usage the stream reported (``None``: none yet)."""
        return self.usage

    def _new_choice(self, index: int) -> _Choice:
        # Indexes under the cap: so are the choices held, however many indexes come.
        if index >= self._max_choices:
            raise TransientUpstreamError(
                index_over(index, self._max_choices, "malformed stream"), source=self._source
            )
        state = self._choices[index] = _Choice(index, self._max_tool_calls, self._source)
        return state

    def all_finished(self, n: int) -> bool:
        """Every choice of an answer of ``n`` has reported its finish_reason: no
        content can follow (a usage chunk and ``[DONE]`` may)."""
        return self.finishes >= n and self.finishes == len(self._choices)

    @property
    def finished(self) -> bool:
        """Every choice that began has reported its ``finish_reason``: the answer is
        complete, [DONE] or not.  Every one, not some: with ``n > 1`` a body cut after
        one choice's finish, another still mid-sentence, was taken for a whole answer
        (cached, and its cut choice given a made-up "stop" by the gateway).  Choices
        begun, not ``n``: an upstream that ignores ``n`` answers with one."""
        return self.finishes > 0 and self.finishes == len(self._choices)

    def build(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self._header.get("id"),
            "object": "chat.completion",
            "created": self._header.get("created"),
            "model": self._header.get("model"),
        }
        if "system_fingerprint" in self._header:
            body["system_fingerprint"] = self._header["system_fingerprint"]
        choices = [self._choices[i].as_dict() for i in sorted(self._choices)]
        if not choices:
            # Choices came, none carrying anything: an empty answer.  (A stream with
            # no choice at all is no answer: the exchange refuses it, see saw_choice;
            # build() itself stays total.)
            choices = [_Choice(0).as_dict()]
        body["choices"] = choices
        body["usage"] = self.usage
        for key, value in self._extras.items():
            body.setdefault(key, _finished(value))
        return body
