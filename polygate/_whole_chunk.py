"""A whole (non-streamed) answer as the one chunk a stream of it would be.

A source that cannot stream (``Source(streaming=False)``) answers ``stream_chat()``
with one JSON body, shown as one chunk; its ``raw`` must still be a chunk --
``chat.completion.chunk``, every choice with a ``delta`` -- as every other chunk a
caller reads (a live stream's, a cache hit's replay) and ``polygate serve``'s SSE
are, or code reading ``chunk.raw["choices"][i]["delta"]`` fails on that source
alone.  The library and the server build it here, alike."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Final

from ._types import ANSWER_KEYS, carries_value, choice_index, message_delta

__all__ = ["CHUNK", "KEPT_HEADER", "answer_header", "chunk_header", "provider_fields", "whole_chunk"]

CHUNK: Final = "chat.completion.chunk"
#: A chunk's header fields kept the same over one stream besides its id, time and
#: model, when the upstream sent them.
KEPT_HEADER: Final = ("system_fingerprint", "service_tier")
#: A whole answer's choice keys that its chunk makes anew (see whole_chunk).
_WHOLE_CHOICE_KEYS: Final = frozenset({"index", "message", "delta", "finish_reason"})


def answer_header(raw: Mapping[str, Any]) -> tuple[str, int, str]:
    """The ``id``, ``created`` and ``model`` an answer says: the upstream's where each
    has its type (a non-empty string id, an integer ``created`` that is no bool, a
    string model), else the gateway's own.  OpenAI's clients type them so (a
    ``ChatCompletion``'s ``created`` is an int): an answer assembled from chunks that
    carried none, or ``created: 0``, said ``null``."""
    answer_id = raw.get("id")
    created = raw.get("created")
    model = raw.get("model")
    return (
        answer_id if isinstance(answer_id, str) and answer_id else "chatcmpl-polygate",
        created if type(created) is int else int(time.time()),
        model if isinstance(model, str) else "",
    )


def chunk_header(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A chunk's header for an answer (or a chunk) ``raw``."""
    answer_id, created, model = answer_header(raw)
    header = {"id": answer_id, "object": CHUNK, "created": created, "model": model}
    # What every chunk of an OpenAI stream carries when the upstream sent it (the SDK's
    # stream helper takes the fingerprint of each chunk: the last one's stays).
    for key in KEPT_HEADER:
        value = raw.get(key)
        if isinstance(value, str):
            header[key] = value
    return header


def provider_fields(raw: Mapping[str, Any], seen: set[str] | None = None) -> dict[str, Any]:
    """``raw``'s provider fields (any top-level key but an answer's own) that carry a
    value, but those in ``seen``."""
    return {k: v for k, v in raw.items()
            if k not in ANSWER_KEYS and (seen is None or k not in seen) and carries_value(v)}


def whole_chunk(raw: Mapping[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    """The one chunk of the whole answer ``raw``: its header, its provider fields, and
    every choice as a delta with its logprobs and other fields (``first``: the first
    choice's delta, as the library read it).  A finish reason comes later, as in a
    stream: in the answer (``stream.response``), and in the server's finish chunk."""
    return {**chunk_header(raw), **provider_fields(raw),
            "choices": _whole_choices(raw.get("choices"), first)
            or [{"index": 0, "delta": first, "finish_reason": None}]}


def _whole_choices(choices: Any, first: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A non-streamed body's choices as deltas, every choice kept, each with its
    logprobs.  ``None`` unless every choice is a message with a natural-number
    index."""
    if not (isinstance(choices, list) and choices):
        return None
    out = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, Mapping) else None
        if not isinstance(message, Mapping):
            return None
        index = choice_index(choice)
        if index is None:
            return None
        delta = first if index == 0 else message_delta(message)
        shaped = {"index": index, "delta": delta, "finish_reason": None}
        # The choice's other fields (its logprobs, Azure's content_filter_results,
        # vLLM's stop_reason): the JSON answer has them, so does the stream.
        for key, value in choice.items():
            if key not in _WHOLE_CHOICE_KEYS and carries_value(value) and (
                    key != "logprobs" or isinstance(value, Mapping)):
                shaped[key] = value
        out.append(shaped)
    return out
