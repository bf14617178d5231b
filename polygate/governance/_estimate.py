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
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["CharEstimator", "TokenEstimator", "default_estimator", "completion_budget"]

_PER_MESSAGE = 4


class TokenEstimator(Protocol):
    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int: ...


def _message_text(message: Mapping[str, Any]) -> str:
    parts: list[str] = []
    for key, value in message.items():
        if key == "role":
            continue  # counted in the per-message overhead
        if isinstance(value, str):
            parts.append(value)
        elif value is not None:
            parts.append(json.dumps(value, ensure_ascii=False, default=str))
    return " ".join(parts)


class CharEstimator:
    """``len(text) / 4`` rounded up, plus a per-message overhead."""

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        total = 3
        for message in messages:
            total += _PER_MESSAGE + (len(_message_text(message)) + 3) // 4
        return total


class TiktokenEstimator:
    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> int:
        total = 3
        for message in messages:
            total += _PER_MESSAGE + len(self._encoding.encode(_message_text(message), disallowed_special=()))
        return total


_CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def _tiktoken_cached() -> bool:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    if cache is None:
        cache = os.path.join(tempfile.gettempdir(), "data-gym-cache")
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


def completion_budget(params: Mapping[str, Any], default: int) -> int:
    """``max_completion_tokens`` or ``max_tokens`` when the caller set one, times ``n``."""
    limit = params.get("max_completion_tokens", params.get("max_tokens"))
    tokens = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else default
    n = params.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        tokens *= n
    return tokens
