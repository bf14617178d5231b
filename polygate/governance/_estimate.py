"""Token estimates reserved at admission (settled later with the real usage).

The default is a character heuristic (about four characters a token for English,
plus a small per-message overhead): fast, dependency-free and within the settle
correction for quota purposes.  ``tiktoken`` is used when it is installed *and* its
encoding file is already in the local cache — loading it must never reach the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "CharEstimator", "TokenEstimator", "chars_tokens", "completion_budget", "default_estimator",
    "params_tokens", "positive_count",
]

_PER_MESSAGE = 4


class TokenEstimator(Protocol):
    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int: ...


# An image part is not its bytes: a base64 data URI of a page would "cost" hundreds of
# thousands of tokens by its length.  Vision models bill an image by its size, about
# 765 tokens for a 1024×1024 image in high detail on OpenAI's models.
_PER_IMAGE = 765
_MEDIA_PARTS = frozenset({"image_url", "input_image", "input_audio", "file"})
# ``json.dumps(value, ensure_ascii=False, default=str)`` without making its encoder
# anew each time (a third of what counting a tool call cost).
_encode = json.JSONEncoder(ensure_ascii=False, default=str).encode


def _message_parts(message: Mapping[str, Any]) -> tuple[str, int]:
    """The text a message carries (content, tool calls, names…) and its media parts.
    Non-string content counts too: content-part lists by their text, anything else by
    its JSON, so tool calls and structured content never reserve 0 tokens."""
    parts: list[str] = []
    media = 0
    for key, value in message.items():
        if key == "role":
            continue  # counted in the per-message overhead
        if isinstance(value, str):
            parts.append(value)
        elif key == "content" and isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, Mapping) else None
                # (A caller's part may say anything: a list or an object as its type
                # cannot be looked up in a set, and is counted by its JSON below.)
                if isinstance(kind, str) and kind in _MEDIA_PARTS:
                    media += 1
                elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif part is not None:
                    parts.append(_encode(part))
        elif value is not None:
            parts.append(_encode(value))
    return " ".join(parts), media


def chars_tokens(chars: int) -> int:
    """The tokens of ``chars`` characters of text, where no tokenizer counts them:
    about four characters a token, rounded up."""
    return (chars + 3) // 4


#: Request parameters an upstream reads as prompt: tool definitions (and the older
#: functions) and a response format's schema are billed as input tokens.  Left out,
#: an agent's long tool list reserved nothing against tpm, and a prompt moved into a
#: tool's description escaped a gateway key's tpm.
_PROMPT_PARAMS = ("tools", "functions", "response_format")


def params_tokens(params: Mapping[str, Any]) -> int:
    """About four characters a token of the JSON of each :data:`_PROMPT_PARAMS`."""
    tokens = 0
    for name in _PROMPT_PARAMS:
        value = params.get(name)
        if value is not None:
            tokens += chars_tokens(len(value if isinstance(value, str) else _encode(value)))
    return tokens


class CharEstimator:
    """``len(text) / 4`` rounded up, plus a per-message overhead and a flat cost per
    image (or other media) part."""

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        total = 3
        for message in messages:
            text, media = _message_parts(message)
            total += _PER_MESSAGE + chars_tokens(len(text)) + media * _PER_IMAGE
        return total


class TiktokenEstimator:
    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        total = 3
        for message in messages:
            text, media = _message_parts(message)
            total += _PER_MESSAGE + media * _PER_IMAGE
            total += len(self._encoding.encode(text, disallowed_special=()))
        return total


_CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def _tiktoken_cached() -> bool:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    if cache is None:
        try:
            temp = tempfile.gettempdir()
        except OSError:
            # No writable temporary directory (a container's read-only root, no
            # tmpfs): tiktoken could not have cached its file there, and asking raised
            # from every session's open, a bare traceback from `polygate serve`.
            return False
        cache = os.path.join(temp, "data-gym-cache")
    key = hashlib.sha1(_CL100K_URL.encode()).hexdigest()
    return os.path.exists(os.path.join(cache, key))


def default_estimator() -> TokenEstimator:
    try:
        import tiktoken
    except ImportError:
        return CharEstimator()
    if not _tiktoken_cached():
        return CharEstimator()
    try:
        return TiktokenEstimator(tiktoken.get_encoding("cl100k_base"))
    except Exception:  # a broken cache must not break admission
        return CharEstimator()


#: The most a completion estimate counts: far past any model's output, and small
#: enough that a window's sum stays an exact integer in every backend (Redis's Lua
#: numbers are doubles, its counters 64-bit: ``max_tokens=2**63`` failed its script
#: after the window entry was written).
MAX_COMPLETION_ESTIMATE = 10**12


#: A count written as text, as pydantic's lax mode reads one into an int (vLLM's and
#: SGLang's requests): blanks around it (stripped first), a ``+``, ``_`` between
#: digits, a fraction of zeros (``" +5_000.00 "`` is 5000).
_COUNT_TEXT = re.compile(r"\+?([0-9](?:_?[0-9])*)(?:\.0+)?")


def positive_count(value: Any) -> int | None:
    """``value`` as a count the upstream will read: a positive int, or a positive
    whole float (``5000.0``: pydantic-based servers, vLLM's and SGLang's, take it as
    5000, so it must reserve what 5000 does), or a text those servers read as a count
    (``"100000"``, ``"+5_000.0"``: a caller, or a gateway client, must not slip a large
    limit past the reservation by quoting it); ``None`` for anything else."""
    if type(value) is int:  # (the common case first: no isinstance)
        return value if value > 0 else None
    if isinstance(value, str):
        # (Blanks as pydantic strips them, Unicode's too: a no-break space around the
        # digits slipped past a key's tpm.)
        found = _COUNT_TEXT.fullmatch(value.strip())
        if found is None:
            return None
        digits = found[1].replace("_", "").lstrip("0")
        # (Past 13 digits it is past the cap: no int() of a 10,000-digit string.)
        count = int(digits or "0") if len(digits) <= 13 else MAX_COMPLETION_ESTIMATE
        return min(count, MAX_COMPLETION_ESTIMATE) if count > 0 else None
    if isinstance(value, float) and value.is_integer() and value > 0:  # (finite too)
        return int(min(value, MAX_COMPLETION_ESTIMATE))
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return int(value)
    return None


def completion_budget(params: Mapping[str, Any], default: int) -> int:
    """``max_completion_tokens`` or ``max_tokens`` when the caller set one, times ``n``,
    at most :data:`MAX_COMPLETION_ESTIMATE`."""
    # The first of the two that is a limit (a positive count): a null
    # max_completion_tokens is no limit, and the upstream then goes by max_tokens.
    tokens = positive_count(params.get("max_completion_tokens"))
    if tokens is None:
        tokens = positive_count(params.get("max_tokens"))
        if tokens is None:
            tokens = default
    n = positive_count(params.get("n", 1))
    if n is not None and n > 1:
        tokens *= n
    return min(tokens, MAX_COMPLETION_ESTIMATE)
