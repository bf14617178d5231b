"""The :class:`~polygate._context.Recorder` that turns calls and attempts into events.

Both methods run on the call path, in ``finally`` blocks and possibly inside
cancelled scopes, so they are synchronous, never block and never raise: they freeze
the record into an event tuple and ``send_nowait`` it.  A full channel drops the row
and counts it (see :mod:`._sink`); an exception while building an event (a bug) is
counted too rather than breaking the call it describes.

Secrets: rows carry source names, never URLs or keys.  Error messages are already
redacted by polygate's error constructors; they are redacted once more here against
every secret in the settings (API keys, the database password), because a row lives
longer than an exception.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from .._context import AttemptRecord, CallContext
from .._errors import redact
from .._types import CallStats, Usage, valid_text
from ._events import AttemptEvent, CallEvent, Event
from ._sink import Counters

__all__ = ["TelemetryRecorder", "attempt_event", "call_event"]

_MESSAGE_LIMIT = 500


class TelemetryRecorder:
    """Builds events on the call path and hands them to the pipeline's channel."""

    __slots__ = ("_counters", "_log_content", "_secrets", "_send", "session_id")

    def __init__(
        self,
        send: trio.MemorySendChannel[Event],
        counters: Counters,
        *,
        session_id: str,
        log_content: bool = False,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self._send = send
        self._counters = counters
        self.session_id = session_id
        self._log_content = log_content
        self._secrets = secrets

    def attempt(self, ctx: CallContext, record: AttemptRecord) -> None:
        try:
            event: Event = attempt_event(ctx, record, _wall_offset(), self._secrets,
                                         log_content=self._log_content)
        except Exception:
            self._counters.recorder_errors += 1
            return
        self._put(event)

    def call(
        self,
        ctx: CallContext,
        stats: CallStats,
        usage: Usage | None,
        error: BaseException | None,
        output: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            event = call_event(
                ctx, stats, usage, error, _wall_offset(), session_id=self.session_id,
                log_content=self._log_content, secrets=self._secrets, output=output,
            )
        except Exception:
            self._counters.recorder_errors += 1
            return
        size = len(event.content) if event.content else 0
        counters = self._counters
        omitted = 0
        if size and counters.queued_content + size > counters.max_queued_content:
            # Full in characters of content (one call's own may be over the bound): the
            # row goes without its text, saying so, rather than the call's figures
            # being lost with it.
            omitted = size
            event = event._replace(content=f'{{"omitted_characters":{size}}}')
            size = len(event.content or "")
        if self._put(event):
            counters.queued_content += size
            if omitted:
                counters.omit_content(omitted)

    def _put(self, event: Event) -> bool:
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self._counters.drop_full()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self._counters.drop_closed()
        else:
            return True
        return False


def _wall_offset() -> float:
    """Add to a ``trio.current_time()`` reading to get epoch seconds (read per event:
    the two clocks may drift, and under MockClock they differ by design)."""
    return time.time() - trio.current_time()


def error_text(
    error: BaseException, secrets: tuple[str, ...], prompt: Sequence[str] = ()
) -> str | None:
    """The error's text for a row: secrets redacted, and, when ``prompt`` (the call's
    message texts: content is not to be stored), the prompt text an upstream's error
    quotes (see :func:`_without_prompt`)."""
    text = str(error)
    if not text:
        return None
    text = redact(text, secrets)
    if prompt:
        # Before the NUL goes: a prompt that holds one, echoed, is only found as it is.
        text = _without_prompt(text[: 4 * _MESSAGE_LIMIT], prompt)
    # An upstream's error body can hold a NUL, which PostgreSQL refuses in text (the
    # whole batch, other calls' rows with it): replaced, for every sink alike.
    text = valid_text(text.replace("\x00", "\ufffd"))
    # At most _MESSAGE_LIMIT characters, the "…" of a cut included (a schema an
    # administrator made may hold the column as varchar(500)).
    return text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 1] + "…"


def _without_prompt(text: str, prompt: Sequence[str]) -> str:
    """``text`` without the call's prompt in it: upstreams quote the offending input in
    a 400's message ("Invalid content in messages[0]: '…'"), which would store the
    prompt where ``log_content=False`` stores none.  A message text that appears whole
    is replaced (as it is, or as a JSON encoder writes it), and so is any quoted run
    ('…', "…", `…`) of 8 or more characters found in one, over several lines too.  Each
    quote mark is tried as an opening one, so an apostrophe before a quote ("can't")
    does not hide it.

    Echoes are often cut: an upstream's message to 300 characters when its error is
    made, by the upstream ("…", "..."), or in its middle (pydantic's 'first...last'),
    and an exhausted call's message joins several.  So the text is read in pieces,
    each ending at a cut: within a piece a quote whose closing mark was cut off runs to
    the cut, a run before the first quote mark of a piece that follows a cut is read as
    quoted (its opening was cut off), and a tail that is how a message text begins is
    replaced, quoted or not.  Cheap on purpose: C-speed substring searches, at most
    64 of them through the prompt, on an error path."""
    forms = [form for piece in prompt if len(piece) >= 8 for form in _json_forms(piece, text)]
    if not forms:
        return text
    for form in forms:
        if form in text:
            text = text.replace(form, _PROMPT_SHOWN)
    raw = [piece for piece in prompt if len(piece) >= 8]
    budget = _Budget(_MAX_QUOTE_SEARCHES, max(map(len, forms)) + 4, raw)
    pieces = _AFTER_CUT.split(text)
    return "".join(
        _piece_without_prompt(piece, forms, budget, after_cut=i > 0)
        for i, piece in enumerate(pieces)
    )


_PROMPT_SHOWN = "[prompt text]"
_QUOTES = re.compile(r"""['"`]""")
#: Where a cut ended a piece of text: after an ellipsis ("…", or three dots).
_AFTER_CUT = re.compile(r"(?<=…)|(?<=\.\.\.)(?!\.)")
#: The most quoted runs (and cut tails) searched for in the prompt, each a search
#: through all of it: an error text full of quote marks (a body of JSON, say) stays
#: cheap to store.
_MAX_QUOTE_SEARCHES = 64


class _Budget:
    __slots__ = ("by_tail", "found", "left", "longest", "raw", "searched_left")

    def __init__(self, left: int, longest: int, raw: list[str]) -> None:
        self.left = left
        self.longest = longest  # no quoted run longer than this is prompt text
        self.raw = raw  # the prompt's texts as they are (the first of each one's forms)
        self.found: dict[str, bool] = {}  # runs already looked up (an error repeats them)
        #: Characters the searches may still go through this row (see _search), past
        #: which a run is taken for prompt text unsearched: a word of the error lost,
        #: never the prompt stored.  ~0.1 s of the event loop at worst.  A prompt of
        #: under 100,000 characters is never cut short (64 searches through each of its
        #: spellings cost what they always did): its error's words are all kept.
        self.searched_left = (
            _SEARCH_CHARS if sum(map(len, raw)) > _SMALL_PROMPT_CHARS else math.inf
        )
        #: The last run found was found only past what may be an escape's tail.
        self.by_tail = False

    def prompt_text(self, run: str, forms: list[str]) -> bool:
        """Whether ``run`` (a quoted run, its cut's ellipsis aside) is prompt text."""
        core = run.removesuffix("...").removesuffix("…").strip()
        if len(core) < 8 or len(run) > self.longest:
            return False
        self.by_tail = False
        known = self.found.get(core)
        if known is not None:
            return known
        if self.left <= 0:
            return False
        self.left -= 1
        found = self._search(core, forms)
        if not self.by_tail:  # (one found past a tail is tried again where it opens)
            self.found[core] = found
        return found

    def _within(self, texts: list[str]) -> bool:
        """Whether searching ``texts`` fits in what is left of this row's bound
        (counted as spent when it does)."""
        cost = sum(map(len, texts))
        if cost > self.searched_left:
            return False
        self.searched_left -= cost
        return True

    def _search(self, core: str, forms: list[str]) -> bool:
        if "\\" in core:
            return not self._within(forms) or any(core in form for form in forms)
        # No escape in it: in an escaped spelling it sits between escapes, so it is in
        # the text as it is -- but for what it may begin with of an escape's tail
        # ("u0026" of "\\u0026", "n" of "\\n"; or part of one, "07" of "\\x07", where a
        # cut fell inside it).  That is at most its first ``skip`` characters (the
        # longest start made of what a tail can hold), and what follows a tail is in
        # the text as it is; so is every end of that, the shortest kept 8 long (no run
        # under 8 counts: see prompt_text).  So one search, for ``core[cut:]``, answers
        # for the run as it is and for every tail it may begin with.  One search
        # through the prompt, not one through each of its spellings (a prompt of
        # megabytes: 8 of them).
        skip = 0
        while skip < _LONGEST_TAIL and skip < len(core) and core[skip] in _TAIL_CHARACTERS:
            skip += 1
        cut = max(0, min(skip, len(core) - 8))
        if not self._within(self.raw):
            return True
        rest = core[cut:]
        if any(rest in text for text in self.raw):
            self.by_tail = cut > 0 and not any(core in text for text in self.raw)
            return True
        if skip <= cut:
            return False
        # A tail longer than ``cut`` would leave under 8 characters to look for alone:
        # in each spelling then, as every run was before (a run of 8 or more that is in
        # one is replaced, the docs say).  Only short runs that begin with what a tail
        # can hold come here, each once an error.
        return not self._within(forms) or any(core in form for form in forms)


#: The bound on one row's searches (see _Budget.searched_left), and the prompts under
#: it: those of at most this many characters are never cut short.
_SEARCH_CHARS = 32_000_000
_SMALL_PROMPT_CHARS = 100_000
#: What may follow the backslash of an escape _json_forms's spellings write, and how
#: long that is at most (``U0001f600``).
_TAIL_CHARACTERS = frozenset("0123456789abcdefABCDEFuxUntr\"'\\/")
_LONGEST_TAIL = 9


def _piece_without_prompt(piece: str, forms: list[str], budget: _Budget, *, after_cut: bool) -> str:
    cut = len(piece) - len(_cut_mark(piece))
    if after_cut:
        # What follows a cut up to the first quote mark was inside a quote the cut
        # opened ('first...last': this is "last").
        first = _QUOTES.search(piece)
        end = first.start() if first is not None else cut
        if budget.prompt_text(piece[:end], forms):
            piece = _PROMPT_SHOWN + piece[end:]
            cut += len(_PROMPT_SHOWN) - end
    piece = _without_cut_prompt(piece, forms, budget)
    cut = len(piece) - len(_cut_mark(piece))
    spans: list[tuple[int, int]] = []
    reached = 0
    for mark in _QUOTES.finditer(piece):
        start = mark.end()
        if start <= reached:
            continue  # inside a quote already taken
        end = piece.find(mark.group(), start, cut)
        if end < 0:
            end = cut  # its closing mark cut off: the quote runs to the cut
        if budget.prompt_text(piece[start:end], forms):
            spans.append((start, end))
            if not budget.by_tail:
                # (A run found only past what may be an escape's tail may be a quote
                # that opened inside the prompt's own text: the quotes in it are still
                # tried, so an echo it hides is found too.)
                reached = end
        if budget.left <= 0:
            break
    for start, end in reversed(_merged(spans)):
        piece = piece[:start] + _PROMPT_SHOWN + piece[end:]
    return piece


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` (in order of their starts) with those that overlap made one."""
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _cut_mark(text: str) -> str:
    """The ellipsis that ends ``text``, if any ("" for none)."""
    for mark in ("…", "..."):
        if text.endswith(mark):
            return mark
    return ""


def _without_cut_prompt(text: str, forms: list[str], budget: _Budget) -> str:
    """``text`` without a tail (of 8 or more characters) that is how a prompt text
    begins: an echo cut short, quoted or not, by the upstream or by a limit on the
    text's length.  A cut's ellipsis stays."""
    mark = _cut_mark(text)
    body = text[: len(text) - len(mark)]
    for form in forms:
        # A tail of 16 characters or more is found by its first 16 (a common run of
        # 8, "########", could match all over the text); a shorter one directly.
        probe = form[:16]
        if len(probe) == 16:
            at = body.find(probe)
            while at >= 0 and budget.left > 0:
                budget.left -= 1
                if form.startswith(body[at:]):
                    return body[:at] + _PROMPT_SHOWN + mark
                at = body.find(probe, at + 1)
        for size in range(min(15, len(body), len(form)), 7, -1):
            if form.startswith(body[-size:]):
                return body[:-size] + _PROMPT_SHOWN + mark
    return text


def _json_forms(piece: str, text: str) -> list[str]:
    """``piece``, and how JSON encoders write it inside a string, each once: escaped as
    Python does (with non-ASCII escaped or not), as Go does (``&``, ``<``, ``>``, U+2028
    and U+2029 escaped too, other non-ASCII as it is) and as PHP does (``/`` escaped
    too); and as Python's ``repr`` writes it (pydantic's validation errors, FastAPI's
    and vLLM's, quote the input so: ``\\xa0`` for a no-break space, which no JSON
    encoder writes).  Only the spellings ``text`` can hold: an escaped form differs
    from the piece only in its escapes, so in a text without them it matches nothing
    the piece does not (and a prompt of megabytes is not copied eight times for every
    error row)."""
    forms = [piece]
    if "\\" not in text:
        return forms
    spellings = [json.dumps(piece, ensure_ascii=False)[1:-1]]
    if "\\u" in text:
        spellings.append(json.dumps(piece)[1:-1])
    go = any(escape in text for escape in _GO_ESCAPES)
    php = "\\/" in text
    for escaped in spellings:
        for form in (escaped, _go_escaped(escaped) if go else escaped,
                     escaped.replace("/", "\\/") if php else escaped):
            if form not in forms:
                forms.append(form)
    shown = repr(piece)[1:-1]
    if shown not in forms:
        forms.append(shown)
    return forms


#: The escapes Go's encoding/json writes where other encoders write the character.
_GO_ESCAPES = ("\\u0026", "\\u003c", "\\u003e", "\\u2028", "\\u2029")


def _go_escaped(text: str) -> str:
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


#: Keys whose values say what a message or a part is, not what it holds.
_STRUCTURE = frozenset({"role", "type", "index"})


def unstored_prompt(ctx: CallContext, log_content: bool) -> list[str]:
    """The prompt texts an error's text must not show: none when the call's row holds
    its content anyway (a chat call with ``log_content``), every one otherwise -- an
    ``embed`` or ``ocr`` call's content is never stored, ``log_content`` or not."""
    return [] if log_content and ctx.kind == "chat" else prompt_texts(ctx)


def prompt_texts(ctx: CallContext) -> list[str]:
    """Every text the caller sent: each string in the call's messages (contents and
    their parts: text, an image's URL, which may be signed; assistant tool calls'
    arguments, …), its other input texts (an embed's inputs, an OCR call's own
    prompt), and the answer a resumed stream had shown, which its continuation
    sends back."""
    texts: list[str] = list(ctx.input_texts)
    _strings(ctx.messages, texts)
    if ctx.continuation is not None and ctx.continuation.shown:
        texts.append(ctx.continuation.shown)
    return texts


def _strings(value: Any, into: list[str]) -> None:
    if isinstance(value, str):
        into.append(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if key not in _STRUCTURE:
                _strings(item, into)
    elif isinstance(value, list | tuple):
        for item in value:
            _strings(item, into)


def attempt_event(
    ctx: CallContext, record: AttemptRecord, offset: float, secrets: tuple[str, ...] = (),
    *, log_content: bool = False,
) -> AttemptEvent:
    """Freeze one finished attempt."""
    tl = record.timeline
    start = tl.sent_at if tl.sent_at is not None else record.started_at
    end = record.ended_at if record.ended_at is not None else trio.current_time()
    ttft = None
    if tl.first_token_at is not None and tl.sent_at is not None:
        ttft = (tl.first_token_at - tl.sent_at) * 1000.0
    usage = record.usage
    error = record.error
    outcome = record.outcome
    return AttemptEvent(
        call_id=record.attempt_id,
        logical_call_id=ctx.logical_call_id,
        scope=ctx.scope_name,
        source=record.source,
        role=record.role,
        started_at=record.started_at + offset,
        # The time a stream_chat() consumer held its chunks is the caller's, not the
        # upstream's (as in generation_ms and the source's health).
        latency_ms=max(end - start - tl.paused_s, 0.0) * 1000.0,
        ttft_ms=ttft,
        status_code=tl.status_code,
        streamed=int(tl.streamed),
        error=outcome.value if outcome is not None else "cancelled",
        error_class=type(error).__name__ if error is not None else None,
        error_message=(
            error_text(error, secrets, unstored_prompt(ctx, log_content))
            if error is not None else None
        ),
        tokens_reserved=record.tokens_reserved,
        tokens_settled=record.tokens_settled,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        completion_tokens=usage.completion_tokens if usage is not None else None,
        usage_source=usage.source if usage is not None else None,
    )


def call_event(
    ctx: CallContext,
    stats: CallStats,
    usage: Usage | None,
    error: BaseException | None,
    offset: float,
    *,
    session_id: str,
    log_content: bool = False,
    secrets: tuple[str, ...] = (),
    output: Mapping[str, Any] | None = None,
) -> CallEvent:
    """Freeze one finished logical call.  ``error``: ``None`` on success, a polygate
    error (or a bug's exception) when it failed, ``trio.Cancelled`` (any
    ``BaseException`` that is not an ``Exception``) when the caller cancelled it."""
    if error is None:
        outcome, error_class, message = "ok", None, None
    elif isinstance(error, Exception):
        outcome, error_class = "error", type(error).__name__
        message = error_text(error, secrets, unstored_prompt(ctx, log_content))
    else:
        outcome, error_class, message = "cancelled", type(error).__name__, None
    content = None
    if log_content and ctx.kind == "chat":
        answer = json.dumps(output, ensure_ascii=False, default=str) if output is not None else "null"
        asked = ctx.asked_json if ctx.asked_json is not None else ctx.messages_json
        content = valid_text(redact('{"messages":' + asked + ',"output":' + answer + "}", secrets))
    return CallEvent(
        session_id=session_id,
        logical_call_id=ctx.logical_call_id,
        scope=ctx.first_scope or ctx.scope_name,  # the scope called, fallbacks or not
        kind=ctx.kind,
        stream=int(ctx.streaming_to_caller),
        started_at=ctx.started_at + offset,
        outcome=outcome,
        error_class=error_class,
        error_message=message,
        total_latency_ms=stats.total_latency_ms,
        generation_ms=stats.generation_ms,
        ttft_ms=stats.ttft_ms,
        stall_ms=stats.stall_ms,
        stall_count=stats.stall_count,
        active_generation_ms=stats.active_generation_ms,
        attempts=stats.attempts,
        hedges=stats.hedges,
        hedge_won=int(stats.hedge_won),
        source=stats.source,
        cached=int(stats.cached),
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        completion_tokens=usage.completion_tokens if usage is not None else None,
        usage_source=usage.source if usage is not None else None,
        content=content,
        reasks=stats.reasks,
        resumes=stats.resumes,
        answered_scope=stats.scope if error is None else None,  # no scope answered
    )
