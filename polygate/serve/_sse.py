"""Server-sent events out: the session's committed chunks as OpenAI chunk events.

The session forwards *content* chunks (SPEC §4: role-only deltas, the finish chunk
and the usage chunk carry no content), and chunks that carry data without content (a
reasoning block's signature, a finish chunk's annotations).  A client expects the
rest of OpenAI's stream too, so this module adds, around the forwarded chunks and in
the same writes:

* before the first chunk, a role chunk (``delta: {"role": "assistant", "content": ""}``)
  unless that chunk already names the role;
* after the last, a finish chunk for every choice whose ``finish_reason`` the
  forwarded chunks did not carry, the usage chunk when the client asked for it
  (``stream_options.include_usage``; ``"usage": null`` when the upstream reported
  none, as the JSON answer then has none), and ``data: [DONE]``.

A chunk whose ``raw`` is not a chunk (an upstream that cannot stream answers with a
whole ``chat.completion``) is re-shaped from its delta.  Nothing is buffered: each
forwarded chunk is encoded and written as it comes.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter
from typing import Any, Final

from .._types import (
    ANSWER_KEYS,
    CALL_PAYLOADS,
    LOGPROB_LISTS,
    MAX_CHOICES,
    ChatResponse,
    StreamChunk,
    TextParts,
    Usage,
    call_slot,
    call_type,
    carries_call,
    carries_something,
    choice_index,
    finish_reason_of,
    name_again,
    note_closing,
    parts_text,
)
from .._whole_chunk import (
    CHUNK,
    KEPT_HEADER,
    answer_header,
    chunk_header,
    provider_fields,
    whole_chunk,
)
from ._json import dump

__all__ = [
    "DONE", "KEEPALIVE", "StreamShape", "answer_header", "error_event", "reported_usage",
    "string_content",
]


DONE: Final = b"data: [DONE]\n\n"
KEEPALIVE: Final = b": keep-alive\n\n"
#: The size of a header that has every field (see ``chunk_header``, kept in
#: ``StreamShape._meta``).
_FULL_HEADER: Final = 4 + len(KEPT_HEADER)


def _event(payload: Any) -> bytes:
    """One event; raises :class:`._json.Unencodable` on a non-finite float."""
    return b"data: " + dump(payload) + b"\n\n"


def error_event(message: str, type_: str, code: str) -> bytes:
    """An OpenAI-style error inside a stream (the SDKs raise ``APIError`` on it)."""
    return _event({"error": {"message": message, "type": type_, "param": None, "code": code}})


class StreamShape:
    """Turns one call's forwarded chunks into the client's events."""

    __slots__ = ("_calls", "_finished", "_meta", "_nulled", "_roled", "_seen", "_started")

    def __init__(self) -> None:
        self._meta: dict[str, Any] | None = None
        #: The provider's top-level fields some relayed chunk carried (see ending).
        self._seen: set[str] | None = None
        self._finished: set[int] = set()
        self._roled: set[int] = set()  # the choices whose role the client has
        #: The choices whose role chunk said content null, and no text came after it:
        #: the client has None there, where the answer may have "" (see ending).
        self._nulled: set[int] | None = None
        self._started = False
        #: Per choice, the tool calls the client has (see _tool_calls).
        self._calls: dict[int, _Calls] | None = None

    def chunk(self, chunk: StreamChunk) -> bytes:
        raw = chunk.raw
        choices = raw.get("choices")
        # A choice whose index is no natural number (choice_index) is never relayed
        # raw: the library refuses such a stream, and a client that keys choices by
        # index must not meet 1.0 or "1"; the chunk is re-shaped from its delta.
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, Mapping) and "delta" in c and choice_index(c) is not None
                        for c in choices)):
            annotated = _with_deltas(choices)
            if annotated is not None:
                # A data-only chunk whose choices carry no delta (Azure's annotations
                # of what came before): relayed with an empty one, its data kept.
                raw = {**raw, "choices": annotated}
            else:
                # A whole answer (a source that cannot stream) made a chunk here when
                # the library still showed its body; it now makes the chunk itself.
                raw = whole_chunk(raw, chunk.delta)
            choices = raw["choices"]
        if not _CHUNK_KEYS.issuperset(raw):  # (no set made for the common chunk)
            if self._seen is None:
                self._seen = set()
            self._seen.update(raw.keys() - _CHUNK_KEYS)
        if "usage" in raw:
            # The usage goes out once, in the ending's usage chunk, when the client asked
            # for it (a finish chunk the session relayed may carry the upstream's).
            raw = {k: v for k, v in raw.items() if k != "usage"}
        cleaned = string_content(choices, "delta")
        if cleaned is not None:
            raw = {**raw, "choices": cleaned}
            choices = cleaned
        if not self._started:
            self._started = True
            self._meta = chunk_header(raw)
        if (meta := self._meta) is not None and len(meta) < _FULL_HEADER:
            # A fingerprint (or tier) first seen after the stream began (resumed from a
            # source that sends none onto one that does): the stream's from here on,
            # its finish chunk's too, so that a client ends with one.
            for key in KEPT_HEADER:
                if key not in meta and isinstance(raw.get(key), str):
                    meta[key] = raw[key]
        if meta is not None and (
            raw.get("id") != meta["id"] or raw.get("model") != meta["model"]
            or raw.get("created") != meta["created"] or raw.get("object") != CHUNK
            or any(raw.get(key) != meta[key] if key in meta else raw.get(key) is not None
                   for key in KEPT_HEADER)
        ):
            # A resumed stream's continuation (another source, another completion), or
            # a chunk with its header blank (Azure's annotations: id "", object ""):
            # one stream keeps one id, time, model, fingerprint and tier, as the
            # finish chunk does, and every event is a chunk (the SDK's chunk model
            # accepts no other object).  A fingerprint or tier the stream has none of
            # is no string (a string one is the stream's from here on, above): left
            # out (the SDK's chunk model takes only a string).
            # (A null one is relayed as it came: the SDK reads None either way, and
            # rewriting every chunk of a stream that sends null cost ~25 %.)
            if any(raw.get(key) is not None and key not in meta for key in KEPT_HEADER):
                raw = {k: v for k, v in raw.items() if k not in KEPT_HEADER or k in meta}
            raw = {**raw, **meta}
        # Every choice gets its role before its first delta, as in an OpenAI stream
        # (with n > 1 too): the library forwards content, not the upstream's role-only
        # chunks, and a client assembling choices by index reads the role from there.
        unroled: list[tuple[int, str | None]] | None = None
        # Entries (by their place in ``choices``: one chunk may hold two entries of one
        # choice, and only the later one repeats a role) whose role is left out: it
        # goes in a role chunk of its own, or the client has it already.
        unrole: set[int] | None = None
        # Tool calls shaped (see _tool_calls), by the entry's place in ``choices``: one
        # chunk may hold two entries of one choice.
        retooled: dict[int, list[dict[str, Any]]] | None = None
        # Choices this chunk begins that name their role themselves: (index, texted,
        # the entry's place).
        introduced: list[tuple[int, bool, int]] | None = None
        dropping = undelta = False
        # Two entries of one choice in this chunk: a choice it begins gets a role chunk
        # of its own, whatever its entries name (the SDK's stream helper makes a choice
        # of each entry of the first chunk it reads).
        twice = len(choices) > 1 and len({choice_index(c) for c in choices}) < len(choices)
        for position, choice in enumerate(choices):
            index = choice_index(choice)
            if index is None:  # (never, after the check above)
                continue
            if not _relayed(choice, index):
                dropping = True
                continue
            delta = choice.get("delta")
            if type(delta) is not dict:  # (per chunk: no isinstance)
                # ``"delta": null`` beside a finish_reason: an empty delta for the client
                # (the OpenAI SDK's stream helper reads every entry's delta as an object).
                undelta = True
            elif delta.get("tool_calls"):
                shaped = self._tool_calls(index, delta["tool_calls"])
                if shaped is not None:
                    if retooled is None:
                        retooled = {}
                    retooled[position] = shaped
            if index not in self._roled:
                # The choices below it first, whatever they begin with (null: a client's
                # accumulator takes text over it): the OpenAI SDK's stream helper puts a
                # new choice at the end of its list and then looks it up by index
                # (choice 1 before choice 0 raised an IndexError there).
                # (An index is below the library's cap on choices, 128: it refuses a
                # stream or body with a larger one.)
                for lower in range(index):
                    if lower not in self._roled:
                        self._roled.add(lower)
                        if unroled is None:
                            unroled = []
                        unroled.append((lower, None))
                        self._null(lower)
                self._roled.add(index)
                delta = choice.get("delta")
                roled = isinstance(delta, Mapping) and delta.get("role")
                # The role chunk says "" before text, as OpenAI's streams do, and null
                # before anything else (tool calls, a refusal, reasoning), as theirs do
                # too: the client's content is then None, as is the JSON answer's when
                # no text follows -- or "" when the answer has "" (see ending).  So is
                # it after a first delta that names the role itself with no text.
                texted = isinstance(delta, Mapping) and isinstance(delta.get("content"), str)
                if not texted:
                    self._null(index)
                if not roled or choice.get("logprobs") or twice:
                    # A role chunk of its own before a first delta that carries
                    # logprobs too (a replayed cache hit does): the OpenAI SDK's stream
                    # helper builds a choice from its first chunk, logprobs included,
                    # and then adds that chunk's logprobs again.
                    if unroled is None:
                        unroled = []
                    unroled.append((index, "" if texted else None))
                    if roled:
                        if unrole is None:
                            unrole = set()
                        unrole.add(position)
                else:
                    if introduced is None:
                        introduced = []
                    introduced.append((index, texted, position))
            else:
                delta = choice.get("delta")
                if isinstance(delta, Mapping) and "role" in delta:
                    # The client has this choice's role already (a role chunk made for
                    # it when a later choice came first; OpenRouter repeats the role
                    # in every delta): again, the SDK's accumulator joins the strings,
                    # "assistantassistant".
                    if unrole is None:
                        unrole = set()
                    unrole.add(position)  # (in place: a chunk may hold thousands of entries)
            if (self._nulled is not None and index in self._nulled and type(delta) is dict
                    and isinstance(delta.get("content"), str)):
                self._nulled.discard(index)  # (the client's None is text now)
            # (A truth test: the reasons are cleaned above, so it is finish_reason_of's.)
            if choice.get("finish_reason"):
                self._finished.add(index)
        if unroled is not None and introduced is not None:
            # Role chunks go before this chunk: a choice it begins with its own role
            # would come after a higher one's role chunk (the SDK's stream helper
            # raised IndexError), so its role goes in them too, in index order.
            if unrole is None:
                unrole = set()
            for index, texted, position in introduced:
                unroled.append((index, "" if texted else None))
                unrole.add(position)
        if unrole is not None or retooled is not None or undelta:
            choices = [_reshaped(c, position, unrole, retooled) for position, c in enumerate(choices)]
            raw = {**raw, "choices": choices}
        if dropping:
            choices = [c for c in choices if _relayed(c, choice_index(c) or 0)]
            raw = {**raw, "choices": choices}
        if unroled is None:
            return _event(raw)
        unroled.sort(key=itemgetter(0))
        return self._roles(unroled, self._meta) + _event(raw)

    def _null(self, index: int) -> None:
        if self._nulled is None:
            self._nulled = set()
        self._nulled.add(index)

    def _tool_calls(self, choice: int, calls: Any) -> list[dict[str, Any]] | None:
        """A delta's tool calls as the OpenAI SDK's stream helper must get them to
        assemble what the library assembles (the JSON answer): each with its index (a
        server that sends none, Gemini's, broke the helper; calls counted from 1 or
        with gaps too: a client's index is the call's place), and an ``id`` or a
        ``name`` a server repeats on every delta sent once (the helper joins strings:
        "c1c1", "lookuplookup").  Which delta is which call, and which names are
        repeats, follow the library's assembler.  ``None`` when the calls go as they
        came."""
        if self._calls is None:
            self._calls = {}
        state = self._calls.get(choice)
        if state is None:
            state = self._calls[choice] = _Calls()
        held, aliases, closed = state.held, state.aliases, state.closed
        if not isinstance(calls, list):
            return None  # (the library ignores it; nothing for a client to build)
        out: list[dict[str, Any]] = []
        changed = False
        for call in calls:
            if not isinstance(call, dict):
                changed = True  # the library ignores it; the helper would raise
                continue
            index = call_slot(call, held, aliases, closed)
            slot = held.get(index)
            cid = call.get("id")
            kind = call.get("type")
            fresh = slot is None
            if slot is None:
                if not carries_call(call):
                    changed = True  # carries no call (the library keeps none)
                    continue
                # The client's index is the call's place among the choice's calls, in
                # the order they began: the helper takes an index as a place in its
                # list (calls counted from 1, or with a gap, raised an IndexError).
                slot = held[index] = {"id": None, "name": _Name(), "at": len(held),
                                      "kind": call_type(call)}
                if not (isinstance(kind, str) and kind):
                    # A server that sends no type (Azure AI Foundry, Mistral): the
                    # call's type, as the JSON answer has it; the helper kept None,
                    # and agent code that checks for "function" skipped the call.
                    call = {**call, "type": call_type(call)}
                    changed = True
            elif "type" in call and not (isinstance(kind, str) and kind):
                # A later delta's "type": null (a server that writes every field):
                # the helper would overwrite the call's type with it, and its stream
                # helper then fails an assertion.
                call = {k: v for k, v in call.items() if k != "type"}
                changed = True
            # (``type``: an index of 0.0 or true equals 0 and 1, and typed clients
            # refuse it.)
            if type(call.get("index")) is not int or call["index"] != slot["at"]:
                shaped = {**call, "index": slot["at"]}
                changed = True
            else:
                shaped = call
            if isinstance(cid, str) and cid:
                if slot["id"] is not None:
                    # Sent again (the same, or changed: the first stays, as in the
                    # library's answer; the helper would join them, "c1c1").
                    shaped = {k: v for k, v in shaped.items() if k != "id"}
                    changed = True
                else:
                    slot["id"] = cid
            elif cid is not None and not isinstance(cid, str):
                # An id of 7: the library keeps none (the helper added 7 and 7: 14).
                shaped = {k: v for k, v in shaped.items() if k != "id"}
                changed = True
            function = call.get("function")
            if isinstance(function, dict):
                note_closing(closed, index, function.get("arguments"))  # (as the assembler)
            for key in CALL_PAYLOADS:
                # The payload (``function``, or a custom tool's ``custom``): a name
                # sent again whole goes once, as the library's answer has it.
                payload = call.get(key)
                if type(payload) is not dict:
                    continue
                name = payload.get("name")
                if isinstance(name, str) and name:
                    repeat = slot["name"].repeat(name)
                    if repeat is not None:
                        trimmed = {k: v for k, v in payload.items() if k != "name"}
                        if repeat:
                            trimmed["name"] = repeat
                        shaped = {**shaped, key: trimmed}
                        changed = True
            payload_key = slot["kind"]
            fields = CALL_PAYLOADS.get(payload_key)
            if fields is not None:
                payload = shaped.get(payload_key)
                texts = _payload_texts(payload, fields, fresh, payload_key == "function")
                if texts is not payload:
                    shaped = {**shaped, payload_key: texts}
                    changed = True
            out.append(shaped)
        return out if changed else None

    def _roles(self, roles: list[tuple[int, str | None]], meta: dict[str, Any] | None) -> bytes:
        return _event({**(meta or {}), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": content}, "finish_reason": None}
            for index, content in roles]})

    def ending(self, response: ChatResponse, include_usage: bool) -> bytes:
        """The role chunk (when nothing was forwarded), finish chunk, usage chunk, [DONE]."""
        out = b""
        if not self._started:
            self._started = True
            self._meta = chunk_header(response.raw)
        meta = self._meta or chunk_header(response.raw)
        answer = response.raw
        if len(meta) < _FULL_HEADER and isinstance(answer, Mapping):
            # A fingerprint (or tier) only on chunks that were not forwarded (the
            # finish chunk, the usage chunk): the JSON answer has it, so the stream's
            # finish chunk carries it too.
            for key in KEPT_HEADER:
                if key not in meta and isinstance(answer.get(key), str):
                    meta[key] = answer[key]
        finishing = []
        unroled: list[tuple[int, str | None]] = []
        texts = []  # finished choices the client has content None for, the answer ""
        for position, choice in enumerate(response.choices or [{}]):
            index = choice.get("index", position) if isinstance(choice, Mapping) else position
            message = choice.get("message") if isinstance(choice, Mapping) else None
            content = message.get("content") if isinstance(message, Mapping) else None
            if index not in self._roled:  # a choice nothing was forwarded for
                # The choices below it first, as chunk() does (the SDK's stream helper
                # looks a choice up by index in the list it appends to).
                for lower in range(index if type(index) is int else 0):
                    if lower not in self._roled:
                        self._roled.add(lower)
                        unroled.append((lower, None))
                        self._null(lower)
                self._roled.add(index)
                unroled.append((index, None if content is None else ""))
            # The client has None where the answer has "" (text that never came, or ""
            # only in the upstream's own role chunk, which the library does not forward:
            # vLLM's before tool calls; a reasoning model stopped before its answer): a
            # client assembling the stream takes the "" over its None.
            text = (content is not None and self._nulled is not None
                    and index in self._nulled)
            if index in self._finished:
                if text:  # (after its finish: only where the upstream's came first)
                    texts.append({"index": index, "delta": {"content": ""}, "finish_reason": None})
                continue
            reason = choice.get("finish_reason") if isinstance(choice, Mapping) else None
            finishing.append({"index": index, "delta": {"content": ""} if text else {},
                              "finish_reason": finish_reason_of(reason) or "stop"})
        if unroled:
            unroled.sort(key=itemgetter(0))
            out += self._roles(unroled, meta)
        if texts:
            out += _event({**meta, "choices": texts})
        events = [{**meta, "choices": [finish]} for finish in finishing]  # one choice an
        # event, as OpenAI sends them (n > 1)
        if include_usage:
            events.append({**meta, "choices": [], "usage": reported_usage(response)})
        # The provider's own fields of the answer (Azure's prompt_filter_results, which
        # came in a chunk with no choices; llama.cpp's timings, on its finish chunk)
        # that no relayed chunk carried: once, on the last chunk, as the JSON answer
        # has them assembled.
        raw = response.raw
        extras = provider_fields(raw, self._seen) if isinstance(raw, Mapping) else {}
        if extras:
            if not events:
                events.append({**meta, "choices": []})
            events[-1].update(extras)
        for event in events:
            out += _event(event)
        return out + DONE


class _Calls:
    """One choice's tool calls as the client has them: by key (:func:`call_slot`),
    each with its first id, its name so far and its place; the indexes that mean a
    later call; the calls whose arguments look complete."""

    __slots__ = ("aliases", "closed", "held")

    def __init__(self) -> None:
        self.held: dict[int, dict[str, Any]] = {}
        self.aliases: dict[int, int] = {}
        self.closed: set[int] = set()


class _Name:
    """A tool call's name as the client has it so far (as pieces joined as they come,
    as the assembler holds them: a name in one-character fragments stays compact)."""

    __slots__ = ("name", "size")

    def __init__(self) -> None:
        self.name: list[str] = TextParts()
        self.size = 0

    def repeat(self, name: str) -> str | None:
        """Take a ``name`` delta.  ``None``: a fragment, relayed as it is; else what
        to relay of a name that repeats (or extends) the one so far (the assembler's
        rule, :func:`name_again`): the part the client lacks, ``""`` for nothing."""
        size = self.size
        if name_again(self.name, size, name):
            self.name = TextParts()
            self.name.append(name)
            self.size = len(name)
            return name[size:]
        self.name.append(name)
        self.size = size + len(name)
        return None


def _reshaped(choice: dict[str, Any], position: int, unrole: set[int] | None,
              retooled: dict[int, list[dict[str, Any]]] | None) -> dict[str, Any]:
    """``choice``, at ``position`` in its chunk, with its delta's role left out
    (``unrole``) and its tool calls replaced (``retooled``), both by position, as
    :meth:`StreamShape.chunk` decided."""
    if type(choice.get("delta")) is not dict:
        return {**choice, "delta": {}}  # (no role or calls to change in it)
    drop = unrole is not None and position in unrole
    tools = retooled.get(position) if retooled is not None else None
    if not drop and tools is None:
        return choice
    delta = {k: v for k, v in choice["delta"].items() if not (drop and k == "role")}
    if tools is not None:
        delta["tool_calls"] = tools
    return {**choice, "delta": delta}


def _relayed(choice: Mapping[str, Any], index: int) -> bool:
    """Whether a stream choice goes to the client: one that carries nothing (the
    library's rule; it refuses a stream whose choice over its cap carries something)
    is left out, and no roles are made up for the indexes below it -- a client would
    count choices that never come, and never finish."""
    return index < MAX_CHOICES and carries_something(choice)


def _with_deltas(choices: Any) -> list[dict[str, Any]] | None:
    """``choices`` with an empty delta where a choice has none, when each is a chunk's
    choice (no ``message``) with a natural-number index; otherwise None."""
    if not (isinstance(choices, list) and choices):
        return None
    out = []
    for choice in choices:
        if not isinstance(choice, Mapping) or "message" in choice or choice_index(choice) is None:
            return None
        out.append(dict(choice) if "delta" in choice else {**choice, "delta": {}})
    return out


#: A chunk's own top-level keys (any other is a provider's field).
_CHUNK_KEYS: Final = ANSWER_KEYS


def string_content(choices: list[Any], key: str) -> list[Any] | None:
    """``choices`` with each ``message``/``delta`` (``key``) content that is neither a
    string nor null blanked to ``""``, and each ``finish_reason`` that is neither a
    string nor null (or is ``""``) made null; ``None`` when none needs it (the common case copies
    nothing).  The library reads such a content (a number, a list of parts) as no text
    and such a reason as none, and a client that concatenates deltas or types the
    reason as a string enum must not meet an int or a list.

    A stream's entries (``delta``) also get the ``index`` the library read (a missing
    one is 0: an entry without one broke the OpenAI SDK's stream helper), and lose
    the fields the library's assembler ignores for their type (:data:`_DELTA_TYPES`,
    and ``logprobs`` that are no object or whose ``content``/``refusal`` is no list):
    relayed, the helper failed on them or joined them into what the JSON answer does
    not have (``"refusal": 5`` twice made 10)."""
    for choice in choices:  # a plain loop: this runs once per streamed chunk
        if _not_text(choice, key):
            break
    else:
        return None
    return [_cleaned(choice, key) if _not_text(choice, key) else choice for choice in choices]


#: What the library's assembler reads of a delta, by type (transport/_assemble.py):
#: a value of another type (not null) it ignores, and the relay leaves out.
_DELTA_TYPES: Final = (
    ("role", str), ("refusal", str), ("reasoning_content", str), ("reasoning", str),
    ("tool_calls", list), ("function_call", dict),
)


def _cleaned(choice: dict[str, Any], key: str) -> dict[str, Any]:
    out = dict(choice)
    reason = out.get("finish_reason")
    if reason is not None and finish_reason_of(reason) is None:
        out["finish_reason"] = None
    part = out.get(key)
    if type(part) is dict:
        content = part.get("content")
        if content is not None and type(content) is not str:
            # Typed parts: their text, as the library reads them (parts_text); a
            # number or an object: no text.
            part = out[key] = {**part, "content": parts_text(content) if type(content) is list else ""}
    if key == "delta":
        if "index" not in out:
            out["index"] = choice_index(out)
        if type(part) is dict and _odd_delta(part):
            out[key] = {k: v for k, v in part.items()
                        if v is None or _DELTA_KINDS.get(k, type(v)) is type(v)}
        logprobs = out.get("logprobs")
        if logprobs is not None:
            if type(logprobs) is not dict:
                del out["logprobs"]
            elif _odd_logprobs(logprobs):
                out["logprobs"] = {k: v for k, v in logprobs.items()
                                   if v is None or k not in LOGPROB_LISTS or type(v) is list}
    return out


_DELTA_KINDS: Final[dict[str, type]] = dict(_DELTA_TYPES)


def _odd_delta(delta: dict[str, Any]) -> bool:
    # Over the delta's own keys: one or two, where the table has six.
    kinds = _DELTA_KINDS
    for name, value in delta.items():
        kind = kinds.get(name)
        if kind is not None and value is not None and type(value) is not kind:
            return True
    return False


def _odd_logprobs(logprobs: dict[str, Any]) -> bool:
    for name in LOGPROB_LISTS:
        value = logprobs.get(name)
        if value is not None and type(value) is not list:
            return True
    return False


def _not_text(choice: Any, key: str) -> bool:
    # dict, not Mapping: parsed JSON is dicts, and an ABC check costs ~0.4 µs a chunk.
    if type(choice) is not dict:
        return False
    reason = choice.get("finish_reason")
    if reason is not None and finish_reason_of(reason) is None:
        return True  # (as the library reads it: "" too, StepFun's and Zhipu's)
    part = choice.get(key)
    if key == "delta":
        if "index" not in choice:
            return True
        logprobs = choice.get("logprobs")
        if logprobs is not None and (type(logprobs) is not dict or _odd_logprobs(logprobs)):
            return True
        if type(part) is dict and _odd_delta(part):
            return True
    if type(part) is not dict:
        return False
    content = part.get("content")
    return content is not None and type(content) is not str


def reported_usage(response: ChatResponse) -> dict[str, Any] | None:
    """The usage the upstream reported, as the library read it -- for the JSON answer
    and the stream's usage chunk alike.  ``None`` (no ``usage``, or ``"usage": null``:
    not known) when it reported none, or numbers the library refused as not
    believable (a negative, 1e300, a string): the library's estimate of a call (its
    completion budget) is for its own accounting, never passed off as a count.  The
    provider's other usage fields (``prompt_tokens_details`` ...) go through."""
    # (type() is dict first: parsed JSON is dicts, and an ABC check costs ~0.2 µs.)
    raw = response.raw
    wire = raw.get("usage") if type(raw) is dict or isinstance(raw, Mapping) else None
    usage = response.usage
    if usage is None or (type(wire) is not dict and not isinstance(wire, Mapping)):
        return None
    counts = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.source == "upstream":
        return {**wire, **counts}
    if response.call_stats.resumes or Usage.from_wire(wire) is not None:
        # A resumed stream's raw body is its last segment's; its usage covers them
        # all (a cut segment's share: what it reported before the cut, never less
        # than the text it showed).
        # Believable numbers on the wire beside an estimate mean just that, also for
        # the stream's cache hits, whose statistics say no resume (this call made none).
        return counts
    return None


def _payload_texts(payload: Any, fields: tuple[str, ...], fresh: bool, needed: bool) -> Any:
    """A call's payload (``function``, ``custom``) as the SDK's stream helper must get
    it to build the JSON answer's call: its text fields strings, as the library's
    assembler keeps only strings (a ``name`` of 7 or ``arguments`` of 5 or null were
    relayed, and the helper kept them where the answer has ``""``).  On a call's
    first delta a field that is not a string is ``""``, and a payload that is no
    object is ``{"name": "", "arguments": ""}`` (the answer's); on a later delta such
    a field is dropped, and a function's payload that is no object is ``{}``: the
    helper asserts that every delta of a function call has one.  ``payload`` itself
    when it is already so."""
    if type(payload) is not dict:
        if fresh:
            return dict.fromkeys(fields, "")
        return {} if needed else payload
    for field in fields:  # (a loop: this runs for every tool-call delta)
        if field in payload and not isinstance(payload[field], str):
            break
    else:
        return payload
    if fresh:
        return {k: v if k not in fields or isinstance(v, str) else "" for k, v in payload.items()}
    return {k: v for k, v in payload.items() if k not in fields or isinstance(v, str)}

