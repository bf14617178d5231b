"""Building OpenAI-compatible requests and reading bodies within their size caps."""

from __future__ import annotations

import email.utils
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import httpx

from .._errors import (
    TransientUpstreamError,
    classify_status,
    error_code,
    error_message,
    redact,
)

__all__ = [
    "CALL_ID_HEADER",
    "Endpoint",
    "Limits",
    "chat_body",
    "embeddings_body",
    "read_capped",
    "raise_for_status",
    "parse_retry_after",
]


_USER_AGENT = "polygate/0.1"
CALL_ID_HEADER = "x-polygate-call-id"


@attrs.frozen
class Endpoint:
    """Where and as whom to send: what the transport needs to know of a source.

    URLs and headers are built once here, not per request.
    """

    name: str
    url: str
    api_key: str | None = attrs.field(default=None, repr=False)
    model: str | None = None
    streaming: bool = True
    chat_url: httpx.URL = attrs.field(init=False, repr=False)
    embeddings_url: httpx.URL = attrs.field(init=False, repr=False)
    _headers: tuple[tuple[str, str], ...] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "chat_url", httpx.URL(self.url + "/chat/completions"))
        object.__setattr__(self, "embeddings_url", httpx.URL(self.url + "/embeddings"))
        headers = [
            ("accept", "application/json, text/event-stream"),
            ("content-type", "application/json"),
            ("user-agent", _USER_AGENT),
        ]
        if self.api_key:
            headers.append(("authorization", f"Bearer {self.api_key}"))
        object.__setattr__(self, "_headers", tuple(headers))

    def headers(self, call_id: str | None = None) -> list[tuple[str, str]]:
        """Request headers; ``call_id`` lets upstream logs be joined with polygate's
        (every attempt of one logical call, hedges included, carries the same id)."""
        headers = list(self._headers)
        if call_id is not None:
            headers.append((CALL_ID_HEADER, call_id))
        return headers

    @property
    def secrets(self) -> tuple[str, ...]:
        return (self.api_key,) if self.api_key else ()


@attrs.frozen
class Limits:
    max_body_bytes: int = 32 * 1024 * 1024
    max_line_bytes: int = 4 * 1024 * 1024


_RESERVED_PARAMS = frozenset({"messages", "stream"})


def chat_body(
    endpoint: Endpoint, messages_json: str, params: Mapping[str, Any], stream: bool
) -> bytes:
    """The JSON body of ``POST /chat/completions``; ``messages_json`` is the messages
    array already encoded (once per call, however many attempts it takes).

    The source's ``model`` wins over a caller's ``model`` (sources of a scope are
    equivalent only with their own model names); every other parameter passes through
    unchanged.  A streamed request always asks for usage, keeping the caller's other
    ``stream_options``.
    """
    body: dict[str, Any] = {k: v for k, v in params.items() if k not in _RESERVED_PARAMS}
    if endpoint.model is not None:
        body["model"] = endpoint.model
    if stream:
        body["stream"] = True
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    else:
        body.pop("stream_options", None)
    head = _ENCODE(body)
    middle = "," if len(head) > 2 else ""
    return f'{head[:-1]}{middle}"messages":{messages_json}}}'.encode()


_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def embeddings_body(endpoint: Endpoint, inputs: Sequence[str], params: Mapping[str, Any]) -> bytes:
    body: dict[str, Any] = dict(params)
    if endpoint.model is not None:
        body["model"] = endpoint.model
    body["input"] = list(inputs)
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


async def read_capped(response: httpx.Response, limit: int, source: str) -> bytes:
    """The whole (decoded) body, or a transient error as soon as it passes ``limit``."""
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TransientUpstreamError(
            f"response body of {declared} bytes exceeds the {limit}-byte cap", source=source
        )
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_bytes():
        size += len(part)
        if size > limit:
            raise TransientUpstreamError(
                f"response body exceeds the {limit}-byte cap", source=source
            )
        parts.append(part)
    return b"".join(parts)


async def raise_for_status(response: httpx.Response, endpoint: Endpoint) -> None:
    """Raise the classified error of a non-2xx response (reading a bounded excerpt)."""
    if 200 <= response.status_code < 300:
        return
    excerpt = b""
    try:
        async for part in response.aiter_bytes():
            excerpt += part
            if len(excerpt) > 8192:
                break
    except httpx.HTTPError:
        pass  # the status alone classifies the failure
    detail, code = _error_detail(excerpt)
    detail = redact(detail, endpoint.secrets)
    retry_after = parse_retry_after(response.headers)
    error = classify_status(
        response.status_code, detail, source=endpoint.name, retry_after_s=retry_after
    )
    error.code = code
    raise error


def _error_detail(excerpt: bytes) -> tuple[str, str | None]:
    text = excerpt.decode("utf-8", "replace").strip()
    if not text:
        return "", None
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:200] + ("…" if len(text) > 200 else ""), None
    return error_message(payload), error_code(payload)


# Retry hints: openai-python reads retry-after-ms, then retry-after as seconds or an
# HTTP date.  Garbage and negatives are ignored; anything longer is clamped so a
# broken header cannot park a source for hours.
RETRY_AFTER_CAP_S = 600.0


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from ``retry-after-ms`` / ``retry-after``; ``None`` when absent
    or unparseable; clamped to ``[0, RETRY_AFTER_CAP_S]``."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return min(value, RETRY_AFTER_CAP_S)
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        value = when.timestamp() - time.time()
        value = max(value, 0.0)
    if not math.isfinite(value) or value < 0:
        return None
    return min(value, RETRY_AFTER_CAP_S)
