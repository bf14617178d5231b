"""Streams that survive their source: continuing a committed answer elsewhere.

When the committed path of a ``stream_chat()`` fails — cut before its
``finish_reason``, silent past ``stall_timeout_s``, a malformed event, an error event —
and the scope has ``StreamWatch(resume=True)``, the call asks another source (or the
fallback scope) for the *rest of the same answer*, and the caller sees one stream:

* **With a prefill** (``Source(prefill=True)``: the upstream continues a trailing
  assistant message, as vLLM does with ``continue_final_message``), the request is the
  original conversation plus an assistant message holding the text already shown.
* **Without one**, the assistant message is followed by a user message asking to
  continue exactly where it stopped, without repeating anything.  A target that
  rejects the prefill with a 400 is asked again this way; that 400 never reaches the
  caller.

Models asked to continue often restate the last words.  :class:`Stitcher` holds the
start of the continuation until it can tell (at most ``window`` characters), drops the
longest overlap with the end of what was shown — whole words, at least
``min_overlap`` (12) characters, so that a genuine continuation that merely begins like
the tail ("the" after "in the") is left alone — and lets the rest through.  Shorter
restatements are kept: a repeated word is a smaller harm than a lost one.  The first
chunk of a continuation is marked ``resumed``.

Limits (documented, tested): only the first choice's *content* is continued — a stream
that already showed tool-call deltas, or asked for ``n > 1``, is not resumed; reasoning
text is not carried over (a continuation may reason afresh).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ._hedge import Forward
from ._types import carries_value, choice_index
from .transport import carries_audio, carries_extras, shows_call_or_refusal

__all__ = [
    "CONTINUE_PROMPT",
    "PREFILL_PARAMS",
    "ResumedForward",
    "Stitcher",
    "StreamSink",
    "continuation_messages",
    "first_logprobs",
    "resumable_delta",
]

CONTINUE_PROMPT = (
    "Your previous message was cut off. Continue it exactly where it stopped: do not "
    "repeat any of it, do not add a preamble or comment, output only the rest."
)
# vLLM's names: continue the last (assistant) message, no new generation prompt.
PREFILL_PARAMS: Mapping[str, Any] = {"continue_final_message": True, "add_generation_prompt": False}


def continuation_messages(
    messages: Sequence[Mapping[str, Any]], shown: str, *, prefill: bool
) -> list[Mapping[str, Any]]:
    """The conversation that asks for the rest of an answer of which ``shown`` was seen.
    With nothing shown (a stream cut in its reasoning) it is the conversation as it
    was: an empty assistant message, which some providers refuse with a 400, would
    ask for the rest of nothing."""
    if not shown:
        return list(messages)
    assistant = {"role": "assistant", "content": shown}
    if prefill:
        return [*messages, assistant]
    return [*messages, assistant, {"role": "user", "content": CONTINUE_PROMPT}]


def resumable_delta(delta: Mapping[str, Any]) -> bool:
    """A delta a continuation can extend: no tool calls, nor the legacy
    ``function_call`` (half-sent arguments cannot be continued by another model), nor a
    ``refusal`` (a refusal cut halfway, "continued" by another model, would be the
    refused request answered: a refusal is never routed around), nor ``audio`` (half an
    utterance cannot be continued in another voice).  As the assembler reads them: a
    value it ignores for its type (``refusal: 5``) or an empty one is none (taken for
    one, it turned resuming off for a stream that showed only text)."""
    audio = delta.get("audio")
    return not (shows_call_or_refusal(delta) if type(delta) is dict else True) and not (
        type(audio) is dict and carries_audio(audio))


class Stitcher:
    """Removes the overlap between the end of what was shown and the start of a
    continuation, holding at most ``window`` characters while it decides."""

    __slots__ = ("_held", "_min", "_passing", "_tail", "emitted")

    def __init__(self, shown: str, *, window: int = 256, min_overlap: int = 12) -> None:
        self._tail = shown[-window:]
        self._min = min_overlap
        self._held = ""
        self._passing = not self._tail  # nothing shown: nothing to overlap
        self.emitted: list[str] = []

    @property
    def deciding(self) -> bool:
        return not self._passing

    @property
    def holding(self) -> bool:
        """Continuation text is held while deciding."""
        return bool(self._held)

    def feed(self, text: str) -> str:
        """Continuation text in; the text to show now out ("" while deciding)."""
        if self._passing:
            self.emitted.append(text)
            return text
        self._held += text
        if len(self._held) <= len(self._tail) and self._could_overlap():
            return ""
        return self._decide()

    def flush(self) -> str:
        """The end of the continuation: decide with what there is."""
        return "" if self._passing else self._decide()

    def _whole_words(self, k: int) -> bool:
        """The overlap starts and ends at word boundaries on both sides: " the" is not
        an overlap of " theory".  In scripts written without spaces (Chinese,
        Japanese, Thai…) every character's edge is one."""
        tail, held = self._tail, self._held
        starts = k == len(tail) or not _one_word(tail[-k - 1], held[0])
        ends = k == len(held) or not _one_word(held[k - 1], held[k])
        return starts and ends

    def _could_overlap(self) -> bool:
        """The held text may still be the start of a suffix of the tail."""
        tail, held = self._tail, self._held
        start = tail.find(held[: len(tail)])
        while start != -1:
            if tail[start:].startswith(held[: len(tail) - start]):
                return True
            start = tail.find(held[: len(tail)], start + 1)
        return False

    def _decide(self) -> str:
        tail, held = self._tail, self._held
        overlap = 0
        for k in range(min(len(tail), len(held)), self._min - 1, -1):
            if tail.endswith(held[:k]) and self._whole_words(k):
                overlap = k
                break
        out = held[overlap:]
        self._held = ""
        self._passing = True
        if out:
            self.emitted.append(out)
        return out


#: Scripts written without spaces between words: CJK ideographs, kana, bopomofo,
#: Thai, Lao, Myanmar, Khmer (code point ranges, first to last).
_SPACELESS = (
    (0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3040, 0x30FF),
    (0x3100, 0x312F), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF), (0xFF66, 0xFF9F), (0x20000, 0x3134F),
)


def _one_word(a: str, b: str) -> bool:
    """Whether two adjacent characters sit inside one word: both alphanumeric, and
    neither of a script that marks no word boundary (where any edge may be one)."""
    return a.isalnum() and b.isalnum() and not (_spaceless(a) or _spaceless(b))


def _spaceless(c: str) -> bool:
    code = ord(c)
    return code >= 0x0E00 and any(first <= code <= last for first, last in _SPACELESS)


def _content(chunk: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return None, ""
    for choice in choices:
        if isinstance(choice, dict) and choice_index(choice) == 0:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                return delta, content if isinstance(content, str) else ""
    return None, ""


class StreamSink(Forward, Protocol):
    """The caller's end of a stream that can say where a continuation begins."""

    shown_tool_calls: bool  # tool-call or refusal deltas were shown: not resumable
    #: The first choice's reasoning shown so far, and the field it came in
    #: (``reasoning_content``, or ``reasoning`` as Ollama and OpenRouter send it): a
    #: resumed stream's answer keeps every segment's, as the caller saw it.
    shown_reasoning: list[str]
    reasoning_field: str
    #: The first choice's ``logprobs.content`` entries shown so far.
    shown_logprobs: list[Any]

    def mark_resumed(self) -> None:
        """The next chunk offered is the first of a continuation."""
        ...


class ResumedForward:
    """The caller's end of a stream, for a continuation: stitched, first chunk marked.

    Chunks whose content is held while the stitcher decides are not passed on; the
    decision goes out as one chunk — the last held chunk, with the stitched text and
    the logprobs of every token of it (each held chunk carried its own)."""

    def __init__(self, inner: StreamSink, stitcher: Stitcher) -> None:
        self._inner = inner
        self._stitcher = stitcher
        self._last: dict[str, Any] | None = None
        self._held_chunks: list[dict[str, Any]] = []
        self._first = True
        self._queued: dict[str, Any] | None = None  # offered after the held chunk goes

    def offer(self, chunk: dict[str, Any]) -> bool:
        stitcher = self._stitcher
        delta, text = _content(chunk)
        if stitcher.deciding:
            other = delta is not None and _shows_other(delta)
            if not other and not text:
                if stitcher.holding and _ends_text(chunk):
                    # The answer's finish (or what follows it): no more text comes to
                    # decide with, and no text may follow it.  The held text goes
                    # first, then this chunk.
                    held = self._held(stitcher.flush())
                    if held is not None and not self._pass(held):
                        self._queued = chunk  # the caller is behind: after that one
                        return False
                # Nothing to stitch (an annotation, a data-only chunk): it goes on as
                # it came, unmarked, and the held text keeps its own chunk.
                return self._inner.offer(chunk)
            if other and not text and not stitcher.holding:
                # Reasoning (or another field) before any of the continuation's text:
                # shown as it comes, and the restatement that may follow is still
                # looked for -- a reasoning model reasons afresh, then restates.
                return self._pass(chunk)
            if other:
                # A chunk that cannot be held (it carries reasoning or a vendor field):
                # decide now, with its own text in the decision (it was dropped).
                out = stitcher.feed(text) if text else ""
                if stitcher.deciding:
                    out = stitcher.flush()
            else:
                out = stitcher.feed(text)
            if stitcher.deciding:
                self._last = chunk
                self._held_chunks.append(chunk)
                return True
            chunk = _with_content(chunk, out, [*self._held_chunks, chunk])
            self._held_chunks = []
        elif text:
            stitcher.emitted.append(text)
        return self._pass(chunk)

    async def deliver_held(self) -> None:
        await self._inner.deliver_held()
        queued, self._queued = self._queued, None
        if queued is not None and not self._inner.offer(queued):
            await self._inner.deliver_held()

    async def finish(self) -> None:
        """The continuation ended: show what the stitcher still holds."""
        if self._stitcher.deciding:
            held = self._held(self._stitcher.flush())
            if held is not None and not self._pass(held):
                await self._inner.deliver_held()

    def _held(self, out: str) -> dict[str, Any] | None:
        """The last held chunk with the stitched text ``out``, or None when there is
        nothing to show: no text, and no finish_reason or vendor field on it (the
        finish on a chunk whose text was all restatement still reaches the caller)."""
        last, pieces = self._last, self._held_chunks
        self._held_chunks = []
        if last is None or not (out or _worth_showing(last)):
            return None
        return _with_content(last, out, pieces)

    def _pass(self, chunk: dict[str, Any]) -> bool:
        if self._first:
            self._first = False
            self._inner.mark_resumed()
        return self._inner.offer(chunk)


def _ends_text(chunk: Mapping[str, Any]) -> bool:
    """Whether no text of the first choice can follow ``chunk``: it carries that
    choice's ``finish_reason``, or no such choice (the usage chunk after the finish)."""
    choice = _first_choice(chunk)
    return choice is None or choice.get("finish_reason") is not None


def _worth_showing(chunk: dict[str, Any]) -> bool:
    """Whether a chunk carries more than its text: a choice's ``finish_reason``, or
    what a chunk without a content token is passed on for (a vendor field such as
    Azure's ``content_filter_results``: :func:`carries_extras`)."""
    choices = chunk.get("choices")
    if isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") is not None for c in choices
    ):
        return True
    return carries_extras(chunk)


def _with_content(chunk: dict[str, Any], text: str, pieces: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``chunk`` showing ``text``, the end of what ``pieces`` (the chunks held for the
    decision, ``chunk``'s own text among them) held together: the restatement the
    stitcher dropped is their start.  The first choice's ``logprobs.content`` is
    theirs, for the tokens of ``text``."""
    out = copy.deepcopy(chunk)
    delta, _ = _content(out)
    if delta is not None:
        delta["content"] = text
    merged = _kept_logprobs(pieces, text)
    if merged is not None:
        choice = _first_choice(out)
        if choice is not None:
            given = choice.get("logprobs")
            choice["logprobs"] = {**(given if isinstance(given, dict) else {}), "content": merged}
    return out


def _first_choice(chunk: Mapping[str, Any]) -> dict[str, Any] | None:
    choices = chunk.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice_index(choice) == 0:
                return choice
    return None


def first_logprobs(chunk: Mapping[str, Any]) -> list[Any] | None:
    """The first choice's ``logprobs.content`` entries in ``chunk``, if any."""
    choice = _first_choice(chunk)
    logprobs = choice.get("logprobs") if choice is not None else None
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    return entries if isinstance(entries, list) else None


def _kept_logprobs(pieces: Sequence[dict[str, Any]], text: str) -> list[Any] | None:
    """The logprob entries of the tokens of ``text``, the kept end of the pieces' text:
    a piece wholly inside the dropped restatement gives none, one that straddles its
    end gives its tokens past it (all of them when its tokens do not spell its text,
    whose split then cannot be told).  None when no piece carries logprobs."""
    spans = [(_content(piece)[1], first_logprobs(piece)) for piece in pieces]
    if all(entries is None for _, entries in spans):
        return None
    dropped = sum(len(t) for t, _ in spans) - len(text)  # the restatement's length
    kept: list[Any] = []
    at = 0
    for piece_text, entries in spans:
        start, at = at, at + len(piece_text)
        if entries is None or at <= dropped:
            continue
        tokens = [e.get("token") if isinstance(e, dict) else None for e in entries]
        if start >= dropped or not all(isinstance(t, str) for t in tokens) or (
            "".join(tokens) != piece_text  # type: ignore[arg-type]
        ):
            kept.extend(entries)
            continue
        end = start
        for entry, token in zip(entries, tokens, strict=True):
            end += len(token)  # type: ignore[arg-type]
            if end > dropped:
                kept.append(entry)
    return kept


def _shows_other(delta: Mapping[str, Any]) -> bool:
    """Whether a continuation's delta shows the caller more than text: reasoning, a
    call, a refusal, or a provider's field the relay keeps.  A value the assembler
    ignores for its type (``refusal: 5`` on every chunk) is nothing shown: counted, it
    made the stitcher decide before it could see the restatement."""
    for key, value in delta.items():
        if key in ("content", "role", "refusal", "tool_calls", "function_call"):
            continue
        if key in ("reasoning_content", "reasoning"):
            if isinstance(value, str) and value:
                return True
        elif value and carries_value(value):  # (a false or a 0 shows nothing, as before)
            return True
    return type(delta) is dict and shows_call_or_refusal(delta)
