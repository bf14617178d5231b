"""OCR: a document → page images (rendered off the event loop) → one vision chat
request per page, all inside one logical call (SPEC §8.2; seed 000: the OCR chain).

::

    Session.ocr(document)
      ├ check the arguments, open the document in a worker thread  (ConfigError, no I/O)
      └ logical call ─ deadline scope (one id, one telemetry call row)
          └ nursery: max_concurrent_pages workers, each taking the next page in order
              ├ render / encode the page in a worker thread (PDFium under one lock)
              └ retry loop of that page (admission, retries, failover) → its answer

Each page is a chat completion with one user message: a text part (the prompt) and an
``image_url`` part (a ``data:`` URI, or the caller's ``https://`` URL).  Pages come
back in document order, each with its own usage and source.  Statistics follow the
seeds' rule for OCR ("OCR = 单次") extended to several pages like embeddings: one
page → that call's own statistics; several → ``generation_ms`` is the sum of the
pages' winning transport times.  Pages are not hedged (as embeddings: seed 000); the
retry rules and failover apply to each page.

A page renders only when a worker is free for it, so at most
``max_concurrent_pages`` page images are held at once, whatever the document's size.
"""

from __future__ import annotations

import operator
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from ._attempt import AttemptControl
from ._call import (
    _deadline_at,
    _retry_loop,
    _with_deadline,
    call_stats,
    every_error,
    run_asking_again,
)
from ._config import MAX_OCR_PROMPT_CHARS, Ocr
from ._context import AttemptRecord, CallContext, ChatRequest, Runtime
from ._errors import AllSourcesExhausted, ConfigError
from ._ocr_document import Document, check_url, document_path, open_document
from ._types import CallStats, OcrPage, OcrResponse, Usage
from .governance import Admission, completion_budget
from .transport import message_text

__all__ = ["DEFAULT_PROMPT", "PAGE_SEPARATOR", "run_ocr"]

DEFAULT_PROMPT = (
    "Transcribe all the text of this page faithfully, as Markdown. Keep the reading "
    "order; write headings, lists and tables (as Markdown tables) as they appear; copy "
    "the text exactly, without translating, correcting or summarising it. Reply with "
    "the transcription only."
)
PAGE_SEPARATOR = "\n\n"


def check_arguments(
    document: Any, prompt: Any, pages: Any, settings: Ocr
) -> tuple[str, Sequence[int] | None]:
    """The prompt to send and the pages asked for (sorted), or ConfigError; cheap
    checks only (no file is read here)."""
    if isinstance(document, (bytes, bytearray)):
        if len(document) > settings.max_document_bytes:
            raise ConfigError(
                f"document is {len(document)} bytes, over max_document_bytes="
                f"{settings.max_document_bytes}"
            )
    elif isinstance(document, str):
        check_url(document)
    elif isinstance(document, os.PathLike):
        document_path(document)
    else:
        raise ConfigError(
            "document must be bytes, a pathlib.Path or an https:// URL string, "
            f"got {type(document).__name__}"
        )
    if prompt is None:
        prompt = settings.prompt or DEFAULT_PROMPT
    elif not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("prompt must be a non-empty string or None")
    elif len(prompt) > MAX_OCR_PROMPT_CHARS:
        # (It rides with every page to a renderer, whose request header is bounded:
        # a longer one killed every renderer process, a page at a time.)
        raise ConfigError(f"prompt must be at most {MAX_OCR_PROMPT_CHARS:,} characters, got {len(prompt):,}")
    if pages is None:
        return prompt, None
    if isinstance(pages, (str, bytes, bytearray, memoryview)) or not isinstance(
            pages, Sequence) or not pages:
        raise ConfigError("pages must be None or a non-empty list of 0-based page numbers")
    if isinstance(pages, range):
        # Checked by its ends, not page by page (range(10**9) is cheap to pass and
        # costly to walk); kept a range until the document's page count has checked it.
        ascending = pages if pages.step > 0 else pages[::-1]
        if ascending[0] < 0:
            raise ConfigError(f"pages must hold 0-based page numbers (ints >= 0), got {ascending[0]!r}")
        return prompt, ascending
    numbers: list[int] = []
    for page in pages:
        try:
            number = operator.index(page)  # ints, and numpy's integers
        except TypeError:
            number = -1
        if isinstance(page, bool) or number < 0:
            raise ConfigError(f"pages must hold 0-based page numbers (ints >= 0), got {page!r}")
        numbers.append(number)
    if len(set(numbers)) != len(numbers):
        raise ConfigError("pages must not name a page twice")
    return prompt, sorted(numbers)


async def run_ocr(
    runtime: Runtime,
    scope_name: str,
    document: Any,
    *,
    prompt: Any,
    pages: Any,
    params: Mapping[str, Any],
    deadline_s: float | None,
) -> OcrResponse:
    settings = runtime.settings.scopes[scope_name].ocr
    text_prompt, wanted = check_arguments(document, prompt, pages, settings)
    scope = runtime.settings.scopes[scope_name]
    # The logical call starts here: opening the document (reading it, a renderer
    # parsing a PDF — maybe starting first) is inside its one deadline and hears its
    # cancellation.
    # The caller's own prompt and a URL document (a signed URL holds a credential) are
    # kept out of telemetry as messages are; the default prompt is nobody's secret.
    own = [text_prompt] if text_prompt != DEFAULT_PROMPT else []
    if isinstance(document, str):
        own.append(document)
    ctx = CallContext(runtime, scope_name, scope, "ocr", trio.current_time(), params=params,
                      input_texts=own)

    async def body() -> OcrResponse:
        opened = await open_document(document, settings, runtime.renderers)
        try:
            if wanted is None:
                chosen = list(range(opened.page_count))
            elif wanted[-1] >= opened.page_count:
                raise ConfigError(
                    f"page {wanted[-1]} is out of range: the document has "
                    f"{opened.page_count} page(s), numbered from 0"
                )
            else:
                chosen = list(wanted)
            return await _ocr_pages(ctx, opened, chosen, text_prompt, params, deadline_s)
        finally:
            # Bounded: idle renderers holding the document answer at once.
            with trio.CancelScope(shield=True):
                await opened.aclose()

    try:
        response = await _with_deadline(ctx, deadline_s, body)
    except AllSourcesExhausted as exc:
        exc.errors = every_error(ctx)  # every page's, as an embedding call's batches
        raise
    runtime.recorder.call(ctx, response.call_stats, response.usage, None)
    return response


async def _ocr_pages(
    ctx: CallContext,
    document: Document,
    pages: list[int],
    prompt: str,
    params: Mapping[str, Any],
    deadline_s: float | None,
) -> OcrResponse:
    runtime = ctx.runtime
    scope = ctx.scope
    ctx.completion_estimate = completion_budget(params, scope.completion_estimate_tokens)
    prompt_tokens = runtime.governor.prompt_estimate([{"role": "user", "content": prompt}], params)
    deadline_at = _deadline_at(ctx, deadline_s)
    results: list[tuple[AttemptRecord, Any] | None] = [None] * len(pages)
    todo = iter(enumerate(pages))

    async def one_page(slot: int, index: int) -> None:
        page = await document.page(index, prompt)
        # The page's bytes arrived in this step; sending them is the next one (each
        # moves ~0.7 MB: together they made the loop's longest step).
        await trio.lowlevel.checkpoint()
        estimate = prompt_tokens + page.image_tokens
        request = ChatRequest(page.messages_json, params, estimate, ctx.completion_estimate)
        del page  # the request holds the only copy of the image while the page runs

        async def runner(admission: Admission, control: AttemptControl) -> Any:
            return await run_asking_again(ctx, admission, control, request)

        tokens = estimate + ctx.completion_estimate
        results[slot] = await _retry_loop(ctx, runner, None, deadline_at, tokens)

    @trio.lowlevel.enable_ki_protection  # (a task: see _session._ki_protected)
    async def worker() -> None:
        for slot, index in todo:  # one shared iterator: every page taken once, in order
            await one_page(slot, index)

    # A failed page leaves the nursery as a group: _with_deadline unwraps it.
    async with trio.open_nursery() as nursery:
        for _ in range(min(scope.ocr.max_concurrent_pages, len(pages))):
            nursery.start_soon(worker)
    return _ocr_response(ctx, pages, results)


def _ocr_response(
    ctx: CallContext, pages: list[int], results: list[tuple[AttemptRecord, Any] | None]
) -> OcrResponse:
    now = trio.current_time()
    out: list[OcrPage] = []
    prompt = completion = total = 0
    estimated = False
    generation = 0.0
    model: str | None = None
    for index, item in zip(pages, results, strict=True):
        assert item is not None
        record, body = item
        choices = body.get("choices") or []
        message = (choices[0].get("message") if choices else None) or {}
        out.append(OcrPage(index, message_text(message), record.usage, record.source))
        usage = record.usage
        if usage is not None:
            prompt += usage.prompt_tokens
            completion += usage.completion_tokens
            total += usage.total_tokens
            estimated = estimated or usage.source == "estimated"
        tl = record.timeline
        if tl.sent_at is not None and tl.ended_at is not None:
            generation += (tl.ended_at - tl.sent_at) * 1000.0
        if model is None and isinstance(body.get("model"), str):
            model = body["model"]
    records = [item[0] for item in results if item is not None]
    if len(records) == 1:
        stats = call_stats(ctx, records[0], now)  # one page: that call's own statistics
    else:
        stats = CallStats(
            logical_call_id=ctx.logical_call_id,
            attempts=len(ctx.attempts),
            source=_most_common(r.source for r in records),
            scope=ctx.scope_name,
            total_latency_ms=(now - ctx.started_at) * 1000.0,
            generation_ms=generation,
        )
    return OcrResponse(
        text=PAGE_SEPARATOR.join(page.text for page in out),
        pages=out,
        usage=Usage(prompt, completion, total, "estimated" if estimated else "upstream"),
        source=stats.source,
        model=model,
        call_stats=stats,
    )


def _most_common(sources: Any) -> str | None:
    counts = Counter(sources)
    return counts.most_common(1)[0][0] if counts else None
