"""The session: owner of the HTTP transport, the governance backend and background work.

``polygate.session()`` opens a nursery for the session's own background tasks
(telemetry flushing, backend connections).  Calls run in the *caller's* task tree: a
call's rounds and attempts live in nurseries the call opens and closes itself, so no
task outlives the call that started it.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import os
import random
import sys
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Final, Literal, Protocol, TypeAlias, TypeVar

import attrs
import httpx
import sniffio
import trio

from ._cached import cache_mode, cached_chat, cached_embed
from ._call import Rounds, one_cancelled, one_interrupt
from ._config import Settings, is_utf8
from ._context import Runtime
from ._errors import ConfigError, PolygateError
from ._json import MAX_DEPTH, dumps, loads, nested_deeper, plain_messages
from ._key_quota import KEY_SCOPE, KeyQuotas
from ._lag import LoopLag
from ._ocr import run_ocr
from ._resume import first_logprobs, resumable_delta
from ._secrets import frameless
from ._structured import prepare
from ._types import (
    ANSWER_KEYS,
    ChatResponse,
    EmbeddingResponse,
    ModelMessage,
    OcrResponse,
    StreamChunk,
    carries_value,
    choice_index,
    json_default,
    message_delta,
    model_json,
)
from ._whole_chunk import whole_chunk
from .cache import Cache, CacheStatistics, open_cache
from .governance import GovernanceStatistics, Governor, MemoryBackend
from .governance._model import endpoint_of
from .governance._redis import RedisBackend
from .telemetry import Telemetry, TelemetryStatistics, open_telemetry
from .transport import LeanTransport, TextParts, carries_audio, carries_extras, drop_last, routed

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["ChatStream", "Session", "SessionStatistics", "session"]

T = TypeVar("T")

# What a context manager's body may raise that must not be held back until its
# nursery closes: trio's cancel scopes handle Cancelled (a group of only Cancelled
# leaves as one).  Anything else — an error, Ctrl-C, the GeneratorExit of an async
# generator closed around the block — leaves as itself after the nursery, never
# wrapped in its group.
_PASS_THROUGH = (trio.Cancelled,)
#: The most a session's close waits for its governance figures (see _freeze_governance).
_FREEZE_S = 1.0
_POOL_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=1024, keepalive_expiry=30)
#: How often a session closes its own pool's idle connections that expired or that
#: their server closed (LeanTransport.close_idle): within this, after traffic stops.
TIDY_EVERY_S = 5.0


class _Unset:
    """The default of ``call_deadline_s``: the scope's own (``None`` means none)."""

    def __repr__(self) -> str:  # what help() and an IDE show as the default
        return "<the scope's call_deadline_s>"


_UNSET: Any = _Unset()
#: A call's code is protected from KeyboardInterrupt (Ctrl-C): trio raises it in
#: whatever unprotected code runs when the signal comes, and a call's code takes
#: things to give back (a source's permit and reservation, a cache flight others
#: wait on, a stream's channel) with a try/finally a moment later.  Landing between
#: the two, it left them taken for the session's life: every later call refused, or
#: waiting on a flight no one would finish; a stream's block could never be left.
#: Protected, the interrupt comes at the next checkpoint instead, where every path
#: unwinds and settles as for a cancellation.  For the calls' code in the caller's
#: task; each task a call starts is marked too (trio gives a new task no protection
#: of its caller's): a round's paths, a stream's producer, embedding batches and
#: cached flights, OCR's pages.
_ki_protected = trio.lowlevel.enable_ki_protection
_BLOCK_EXITED = "this stream was closed before it finished (its block exited)"
#: What a call on a closed session raises (and a stream its closing cut), as _call.py.
_SESSION_CLOSED = "this session is closed"


@attrs.frozen
class SessionStatistics:
    governance: GovernanceStatistics
    telemetry: TelemetryStatistics = attrs.field(factory=TelemetryStatistics)
    cache: CacheStatistics = attrs.field(factory=CacheStatistics)


class Session:
    """Front door of polygate; obtain one with ``async with polygate.session(...)``."""

    def __init__(
        self, runtime: Runtime, telemetry: Telemetry | None = None, cache: Cache | None = None
    ) -> None:
        self._runtime = runtime
        self._telemetry = telemetry
        self._cache = cache
        # The trio run the session lives in: its events, locks and nursery are that
        # run's, and a call from another (a thread's own trio.run) would set them from
        # the wrong run -- trio's assertion, raised in an innocent task of this one.
        try:
            self._run: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:  # (made outside a run: by hand, in a test)
            self._run = None
        # The governance figures as the session closed, where its backend cannot be
        # read once closed (Redis): what statistics() reports from then on.  (The
        # memory backend's are read live, in the session's run: calls from tasks
        # outside the block settle after the close.)
        self._governance_at_close: GovernanceStatistics | None = None
        #: A relay's session (``polygate serve``'s): its calls' arguments are a
        #: client's request body, decoded for the call and held by nobody else, so
        #: they are its own without a copy, and each of its fields goes upstream as
        #: the client wrote it (a ``timeout`` or ``extra_body`` is a vendor field
        #: there, not the openai SDK's option).
        self._relay = False

    async def _freeze_governance(self, backend: RedisBackend) -> None:
        """Take the governance figures before a backend that closes with its session
        (Redis) is closed; bounded (each exchange is: see RedisBackend.bounded), and
        shielded (a session may close cancelled)."""
        deadline = trio.current_time() + _FREEZE_S
        with trio.CancelScope(shield=True, deadline=deadline), backend.bounded(deadline):
            try:
                self._governance_at_close = await self._runtime.governor.statistics()
            except PolygateError:
                pass  # (Redis not answering: statistics() after the close then raises)

    @property
    def _closed(self) -> bool:
        return self._runtime.closed

    @property
    def settings(self) -> Settings:
        return self._runtime.settings

    def __repr__(self) -> str:
        scopes = ", ".join(self._runtime.settings.scopes)
        return f"<polygate.Session scopes=[{scopes}]{' closed' if self._closed else ''}>"

    def _key_quotas(self) -> KeyQuotas:
        """The per-key quotas of ``settings.serve.keys``, held in this session's
        governance backend (for ``polygate serve``, which never reaches the backend
        itself)."""
        return KeyQuotas(self._runtime.settings.serve.keys, self._runtime.governor)

    def _traces(self) -> bool:
        """Whether this session's calls make OpenTelemetry spans (for ``polygate
        serve``, which then joins each request's call to its client's trace)."""
        return self._runtime.trace_headers is not None

    # ------------------------------------------------------------------ calls

    # A call's error leaves it without polygate's frames (from where it is raised here):
    # their locals (the call's context, its attempts' records, the error lists) lead
    # back to it, a cycle the cyclic collector alone frees, with the whole request, and
    # a gateway fails many calls a second when its sources refuse them.  The message
    # says what went wrong; the frames held secrets too (see frameless).  ``handled``:
    # the caller's own exception, whose frames are the caller's, stays as it is; so
    # does a bug that rides along beside it (a branch's, in its cause's group).

    @_ki_protected
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any] | ModelMessage],
        *,
        scope: str = "chat",
        call_deadline_s: float | None = _UNSET,
        schema: Any = None,
        cache: bool | Literal["refresh"] = True,
        **params: Any,
    ) -> ChatResponse:
        """One logical chat call; returns the assembled answer with its statistics.

        ``schema`` (a pydantic v2 model class or a JSON Schema dict) asks for
        structured output: ``response.parsed`` is the validated answer, and an invalid
        one is re-asked inside this call (``docs/structured.md``).  ``cache=False``:
        neither read nor write the response cache; ``"refresh"``: write only."""
        deadline = self._prepare(scope, call_deadline_s)
        messages, encoded = _check_messages(messages, own=not self._relay)
        params = _check_params(params, own=not self._relay)
        rounds = self._rounds(scope, schema, params, reask=True)
        mode = cache_mode(cache)
        handled = sys.exc_info()[1]
        try:
            return await cached_chat(
                self._runtime, self._cache, mode, scope, messages, encoded, params, deadline,
                rounds=rounds,
            )
        except PolygateError as exc:
            raise frameless(exc, handled=handled, spare=is_bug)  # noqa: B904 (the same error: see above)

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any] | ModelMessage],
        *,
        scope: str = "chat",
        call_deadline_s: float | None = _UNSET,
        schema: Any = None,
        cache: bool | Literal["refresh"] = True,
        **params: Any,
    ) -> ChatStream:
        """A streamed chat call: ``async with s.stream_chat(...) as stream:`` then
        ``async for chunk in stream``; ``stream.response`` once it is exhausted.

        With ``schema`` the answer is validated once the stream ends; an invalid one
        raises ``StructuredOutputError`` from the iteration (never re-asked: the
        caller has seen the text)."""
        deadline = self._prepare(scope, call_deadline_s, awaited=False)
        messages, encoded = _check_messages(messages, own=not self._relay)
        params = _check_params(params, own=not self._relay)
        rounds = self._rounds(scope, schema, params, reask=False)
        mode = cache_mode(cache)
        return ChatStream(
            self._runtime, scope, messages, encoded, params, deadline, rounds=rounds,
            cache=self._cache, cache_mode=mode, run=self._run,
        )

    @_ki_protected
    async def embed(
        self,
        inputs: Sequence[str],
        *,
        scope: str = "embed",
        call_deadline_s: float | None = _UNSET,
        cache: bool | Literal["refresh"] = True,
        **params: Any,
    ) -> EmbeddingResponse:
        """Embeddings of ``inputs`` (in order), batched by the scope's ``embed_batch_size``."""
        deadline = self._prepare(scope, call_deadline_s)
        if isinstance(inputs, str) or not isinstance(inputs, Sequence) or not inputs:
            raise ConfigError("inputs must be a non-empty list of strings")
        if not all(isinstance(text, str) for text in inputs):
            raise ConfigError("inputs must be a non-empty list of strings")
        for index, text in enumerate(inputs):
            _check_utf8(text, f"inputs[{index}]")
            if not text:
                # OpenAI refuses it (400), after a paid round trip; others embed
                # nothing into a vector that means nothing.
                raise ConfigError(f"inputs[{index}] is an empty string: there is nothing to embed")
        if "schema" in params:
            # (A chat keyword here is a mistake, not a vendor field to send upstream;
            # checked first: a model class would otherwise be "not JSON-serialisable".)
            raise ConfigError("embed() takes no schema: structured output is for chat calls")
        if "stream" in params and not self._relay:
            # Never sent: a provider answers it with a 400, after a paid round trip.
            raise ConfigError("embed() takes no 'stream': embeddings come in one answer")
        params = _check_params(params, reserved=("input",), own=not self._relay, kind="embed")
        dimensions = params.get("dimensions")
        if dimensions is not None and (type(dimensions) is not int or dimensions <= 0):
            # Checked here: the answer's vectors are held to it (a source that ignores
            # it is refused), which needs a number to compare them with.
            raise ConfigError(f"dimensions must be a whole number > 0, got {dimensions!r}")
        mode = cache_mode(cache)
        handled = sys.exc_info()[1]
        try:
            return await cached_embed(
                self._runtime, self._cache, mode, scope, list(inputs), params, deadline)
        except PolygateError as exc:
            raise frameless(exc, handled=handled, spare=is_bug)  # noqa: B904 (the same error: see above)

    @_ki_protected
    async def ocr(
        self,
        document: bytes | bytearray | str | os.PathLike[str],
        *,
        scope: str = "ocr",
        prompt: str | None = None,
        pages: Sequence[int] | None = None,
        call_deadline_s: float | None = _UNSET,
        **params: Any,
    ) -> OcrResponse:
        """The text of ``document`` (PNG/JPEG/WebP/GIF/PDF ``bytes``, a
        ``pathlib.Path``, or an ``https://`` URL), one vision request per page, all in
        one logical call; ``pages`` selects 0-based pages (``docs/ocr.md``)."""
        deadline = self._prepare(scope, call_deadline_s)
        if isinstance(prompt, str):  # (its other checks are OCR's own, in run_ocr)
            _check_utf8(prompt, "prompt")
        for name in ("cache", "schema"):
            # chat()'s own arguments: OCR answers are neither cached nor validated,
            # and sending them on as vendor fields would hide that.
            if name in params:
                raise ConfigError(f"ocr() does not take {name!r} (OCR answers are neither "
                                  "cached nor schema-validated)")
        params = _check_params(params, kind="ocr")
        handled = sys.exc_info()[1]
        try:
            return await run_ocr(
                self._runtime, scope, document, prompt=prompt, pages=pages, params=params,
                deadline_s=deadline,
            )
        except PolygateError as exc:
            raise frameless(exc, handled=handled, spare=is_bug)  # noqa: B904 (the same error: see above)

    def _local_counts(self) -> tuple[int, int, dict[str, int]]:
        """Telemetry rows written and dropped, and the hedges suppressed by the budget:
        this process's own counts, read without the governance backend (``polygate
        serve`` sums them over the sessions of its reloads, whatever state their
        backend is in)."""
        telemetry = self._telemetry.statistics() if self._telemetry else TelemetryStatistics()
        return telemetry.written, telemetry.dropped, self._runtime.governor.suppressed()

    async def statistics(self) -> SessionStatistics:
        telemetry = self._telemetry.statistics() if self._telemetry else TelemetryStatistics()
        cache = self._cache.statistics() if self._cache else CacheStatistics()
        governance = self._governance_at_close
        if governance is None:  # (Redis's, once closed, are frozen: read from anywhere)
            _check_run(self._run)
            governance = await self._runtime.governor.statistics()
        return SessionStatistics(governance, telemetry, cache)

    def _rounds(
        self, scope: str, schema: Any, params: Mapping[str, Any], *, reask: bool
    ) -> Rounds | None:
        if schema is None:
            return None
        reasks = self._runtime.settings.scopes[scope].structured.max_reasks if reask else 0
        return prepare(schema, params, reasks)

    def _prepare(
        self, scope: str, call_deadline_s: float | None, *, awaited: bool = True
    ) -> float | None:
        if self._closed:
            raise PolygateError(_SESSION_CLOSED)
        _check_run(self._run, awaited=awaited)
        if not isinstance(scope, str):
            raise ConfigError(f"scope must be a scope name, got {type(scope).__name__}")
        config = self._runtime.settings.scope(scope)
        if call_deadline_s is _UNSET:
            return config.call_deadline_s
        if call_deadline_s is None:
            return None
        refused = isinstance(call_deadline_s, bool) or not isinstance(call_deadline_s, (int, float))
        if not refused:
            try:
                seconds = float(call_deadline_s)
            except OverflowError:  # an integer no float holds (10**400)
                raise ConfigError(
                    "call_deadline_s must be a finite number > 0, got an integer too large "
                    "for one") from None
            refused = not math.isfinite(seconds) or seconds <= 0
        if refused:
            raise ConfigError(f"call_deadline_s must be a finite number > 0, got {call_deadline_s!r}")
        return seconds


# One encoder each, made once: json.dumps with arguments builds a new one per call.
# allow_nan=False: NaN and ±Infinity are not JSON (the default encoder writes bare
# NaN/Infinity tokens an upstream may reject, or worse, read); the check is free.
_encode_messages = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=json_default).encode
# ensure_ascii=False as the wire encodes them: a lone surrogate stays a character here,
# so _check_utf8 sees it (an escaped one would pass the check and fail at send).
_encode_params = json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=json_default).encode
_NOT_UNICODE = "is not valid Unicode (a lone surrogate, e.g. U+D800, cannot be sent as UTF-8)"
_TOO_DEEP = "{}: nested deeper than " + str(MAX_DEPTH) + " levels of arrays and objects"


def _check_utf8(text: str, what: str) -> None:
    """Refuse text holding a lone surrogate (only UTF-8 goes on the wire), naming it."""
    if is_utf8(text):
        return
    start = next(i for i, char in enumerate(text) if "\ud800" <= char <= "\udfff")
    raise ConfigError(f"{what} {_NOT_UNICODE}: U+{ord(text[start]):04X} at character {start}")


def _is_nan_error(exc: Exception) -> bool:
    """Whether an encoder (allow_nan=False) refused a NaN or an infinity."""
    return isinstance(exc, ValueError) and "Out of range float" in str(exc)


def _check_messages(messages: Any, *, own: bool = True) -> tuple[list[Any], str]:
    """Validate the messages and encode them once (every attempt reuses the JSON).

    Returns the call's own copy of them with the JSON: the caller may change its list
    and dicts while the call runs (building the next request), and a retry, a hedge,
    a re-ask, a continuation and the cache's entry must all be of the call as made.
    ``own=False``: they are the call's already (a relay's decoded body), not copied."""
    # (type() first: a list of dicts, the usual, needs no ABC check, ~0.2 µs each.)
    if type(messages) is not list and (
            isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence)):
        raise ConfigError("messages must be a list of message objects")
    if type(messages) is not list and type(messages) is not tuple:
        messages = list(messages)  # (any Sequence, a deque: JSON writes a list or a tuple)
    if not messages:
        raise ConfigError("messages must not be empty")
    given = messages
    for index, message in enumerate(given):
        if type(message) is not dict and not isinstance(message, Mapping):
            dumped = _dumped_model(message)
            if dumped is None:
                raise ConfigError(f"messages[{index}] must be an object with a string 'role', "
                                  f"got {type(message).__name__}")
            if messages is given:
                messages = list(given)  # (never the caller's own list)
            messages[index] = message = dumped
        if not isinstance(message.get("role"), str):
            raise ConfigError(f"messages[{index}] must be an object with a string 'role'")
    if plain_messages(messages):
        # The usual shape (text keys and values): msgspec writes byte for byte what the
        # encoder below would, and cannot meet a NaN.  Not other keys: msgspec writes
        # keys json refuses (NaN, bytes) and spells a float key its own way (1e16).
        # None: a lone surrogate, which the path below reports.
        fast = dumps(messages)
        if fast is not None:
            # Text keys and values: a copy of each dict is a copy of it all.
            if not own:
                return list(messages), fast.decode()
            return [message.copy() for message in messages], fast.decode()
    try:
        encoded = _encode_messages(messages)
    except RecursionError:
        raise ConfigError(_TOO_DEEP.format("messages")) from None
    except (TypeError, ValueError) as exc:
        if _is_nan_error(exc):
            raise ConfigError("messages must not contain NaN or Infinity (not JSON)") from None
        raise ConfigError(f"messages are not JSON-serialisable: {exc}") from None
    if nested_deeper(encoded, MAX_DEPTH):
        raise ConfigError(_TOO_DEEP.format("messages"))
    if not is_utf8(encoded):  # which one, on the error path only
        for index, message in enumerate(messages):
            _check_utf8(_encode_messages(message), f"messages[{index}]")
    if not own and not any(type(message) is not dict for message in messages):
        return list(messages), encoded
    return loads(encoded), encoded


def _dumped_model(message: Any) -> dict[str, Any] | None:
    """A message given as a pydantic model (the openai SDK's ``ChatCompletionMessage``,
    appended to the history as its guides do) as the SDK sends one; ``None`` for
    anything else."""
    try:
        dumped = model_json(message)
    except TypeError as exc:
        raise ConfigError(f"a message {exc}") from None
    return dumped if isinstance(dumped, dict) else None


#: Each call's own keyword arguments, which are not the upstream's parameters.
_NAMED: Final = {
    "chat": frozenset({"scope", "call_deadline_s", "schema", "cache", "messages"}),
    "embed": frozenset({"scope", "call_deadline_s", "cache", "inputs"}),
    "ocr": frozenset({"scope", "prompt", "pages", "call_deadline_s", "document"}),
}


#: Each call's main argument, the one copied whole.
_MAIN: Final = {"chat": "messages", "embed": "inputs", "ocr": "document"}


def own_arguments(
    kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments as the call keeps them (see :func:`_check_messages`), taken
    when it is made, for a call that starts later (``polygate.aio``'s, handed to trio
    after its caller's task yielded): its messages, inputs or document, given by
    position or by name, and its parameters, copied.  Arguments a check refuses are
    left as they are, for the call to refuse with the error it always gave."""
    named, main = _NAMED[kind], _MAIN[kind]
    try:
        if len(args) == 1:
            args = (_own_main(kind, args[0]),)
        elif not args and main in kwargs:
            kwargs = {**kwargs, main: _own_main(kind, kwargs[main])}
        if kind == "chat" and type(kwargs.get("schema")) is dict:
            try:  # (a model class is no value to copy)
                kwargs = {**kwargs, "schema": copy.deepcopy(kwargs["schema"])}
            except Exception:  # (too deep, a lock inside: the call says what is wrong with it)
                pass
        elif kind == "ocr" and type(kwargs.get("pages")) is list:
            kwargs = {**kwargs, "pages": list(kwargs["pages"])}
        params = {key: value for key, value in kwargs.items() if key not in named}
        if params and not _plain_scalars(params):
            if kind == "embed" and ("schema" in params or "stream" in params):
                return args, kwargs
            params = _check_params(
                params, reserved=("input",) if kind == "embed" else ("messages", "stream"), kind=kind)
            kwargs = {**{key: value for key, value in kwargs.items() if key in named}, **params}
    except ConfigError:
        pass
    return args, kwargs


def _own_main(kind: str, value: Any) -> Any:
    if kind == "chat":
        return _check_messages(value)[0]
    if kind == "embed":
        # (Of strings: the sequence is all there is to copy.  Anything else is the
        # call's to refuse.)
        return list(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else value
    return bytes(value) if type(value) is bytearray else value


#: The call's own keywords a near miss of which is refused (see _near_own), and the
#: first four letters of every one of them, any case (and of "deadline", its front
#: dropped): a key that starts otherwise is not looked at.
_OWN_KEYWORDS: Final = {
    "chat": ("scope", "call_deadline_s", "schema", "cache"),
    "embed": ("scope", "call_deadline_s", "cache"),
    "ocr": ("scope", "prompt", "pages", "call_deadline_s"),
}
_NEAR_HEADS: Final = frozenset({"scop", "call", "sche", "cach", "prom", "page", "dead"})
#: Misses too far from their keyword for difflib's measure ("deadline" is 0.70 of
#: "call_deadline_s"), and no field of any API polygate fronts.
_ALIASES: Final = {
    "deadline": "call_deadline_s", "deadline_ms": "call_deadline_s",
    "call_deadline_ms": "call_deadline_s", "deadline_seconds": "call_deadline_s",
    "scope_name": "scope",
}


@functools.lru_cache(maxsize=256)
def _near_own(key: str, kind: str) -> str | None:
    """The call's own keyword ``key`` is a near miss of (``call_deadline=5``,
    ``scopes="big"``, ``Scope=``), or ``None``: as a parameter it went to the upstream as
    a request field, and the call ran without the deadline (or in the default scope)
    its caller asked for, silently.  No field of the APIs polygate fronts is that close
    to one of them (checked against some 230 fields: OpenAI's, vLLM's, llama.cpp's,
    OpenRouter's and more).  Cached: a caller sends the same few keys call after call
    (``prompt_cache_key``, ``cache_prompt``: ~5 µs each through difflib)."""
    own = _OWN_KEYWORDS.get(kind, ())
    lowered = key.lower()
    alias = _ALIASES.get(lowered)
    if alias is not None and alias in own:
        return alias
    near = difflib.get_close_matches(lowered, own, n=1, cutoff=0.8)
    return near[0] if near else None


#: The openai SDK's request options, which are no body fields: code ported from
#: ``client.chat.completions.create(...)`` would send them upstream as such (OpenAI
#: answers 400; vLLM ignores them, so ``extra_body``'s fields would silently not apply).
_SDK_OPTIONS: Final = {
    "extra_body": "pass its fields as keyword arguments of their own",
    "extra_headers": "polygate sends each source's own headers",
    "extra_query": "put query parameters in the source's base_url",
    "timeout": "use call_deadline_s (or the source's timeout_s)",
}


def _check_params(
    params: dict[str, Any], reserved: tuple[str, ...] = ("messages", "stream"), *, own: bool = True,
    kind: str = "chat",
) -> dict[str, Any]:
    """Validate the call's parameters; returns the call's own copy of them (see
    :func:`_check_messages`): ``params`` itself where every value is a plain scalar
    (``**params`` is a new dict each call), else their JSON read back.  ``own=False``:
    a relay's (see Session._relay): neither copied nor held to the openai SDK's names."""
    for key in reserved:
        if key in params:
            raise ConfigError(f"parameter {key!r} is set by polygate, not by the caller")
    if own:
        for key, advice in _SDK_OPTIONS.items():
            if key in params:
                raise ConfigError(f"{key!r} is an option of the openai SDK, not a request field: {advice}")
        for key in params:
            if key[:4].lower() in _NEAR_HEADS:  # (the usual fields, max_tokens and the like, skip it)
                near = _near_own(key, kind)
                if near is not None:
                    raise ConfigError(
                        f"{kind}() got {key!r}, which is not one of its own arguments and would "
                        f"be sent to the upstream as a request field: did you mean {near}=?"
                    )
    options = params.get("stream_options")
    if options and type(options) is not dict and not isinstance(options, Mapping):
        raise ConfigError("parameter 'stream_options' must be an object (a mapping)")
    if not params or _plain_scalars(params):
        return params
    encoded = _check_encoded(params)
    if not own:
        return params
    copy: dict[str, Any] = loads(encoded)
    return copy


def _plain_scalars(params: Mapping[str, Any]) -> bool:
    """Every value a plain JSON scalar (the usual ``max_tokens=8, temperature=0.7``):
    encodable, one level deep, and UTF-8 when checked one by one, so the whole
    encoding below (~3 µs a call) would find nothing.  The keys are ``**params``'s,
    so text, but any text: a lone surrogate in one is refused below too."""
    for key, value in params.items():
        if not is_utf8(key):
            return False
        kind = type(value)
        if kind is str:
            if not is_utf8(value):
                return False
        elif kind is float:
            if not math.isfinite(value):
                return False
        elif kind is int:
            if not -_PLAIN_INT < value < _PLAIN_INT:
                return False  # (Python writes no int past 4,300 digits: the full check says so)
        elif kind is not bool and value is not None:
            return False
    return True


_PLAIN_INT = 1 << 64


def _check_encoded(params: Mapping[str, Any]) -> str:
    """The parameters encode as JSON, nest no deeper than MAX_DEPTH and are UTF-8:
    their JSON."""
    try:
        encoded = _encode_params(params)
    except RecursionError:
        raise ConfigError(_too_deep(params)) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(_unencodable(params, exc)) from None
    if nested_deeper(encoded, MAX_DEPTH):
        raise ConfigError(_too_deep(params))
    if not is_utf8(encoded):
        for key, value in params.items():
            _check_utf8(_encode_params({key: value}), f"parameter {key!r}")
    return encoded


def _too_deep(params: Mapping[str, Any]) -> str:
    """Which parameter nests too deeply (on the error path only)."""
    for key, value in params.items():
        try:
            deep = nested_deeper(_encode_params(value), MAX_DEPTH - 1)
        except RecursionError:
            deep = True
        if deep:
            return _TOO_DEEP.format(f"parameter {key!r}")
    return _TOO_DEEP.format("parameters")


def _unencodable(params: Mapping[str, Any], exc: Exception) -> str:
    """Which parameter cannot be sent (found on the error path only: the common path
    encodes all of them at once)."""
    name = "parameters"
    for key, value in params.items():
        try:
            _encode_params(value)
        except (TypeError, ValueError) as found:
            name, exc = f"parameter {key!r}", found
            break
    if _is_nan_error(exc):
        return f"{name} must not contain NaN or Infinity (not JSON)"
    return f"{name} must be JSON-serialisable: {exc}"


# --------------------------------------------------------------------------- streams


@attrs.frozen
class StreamDone:
    response: ChatResponse


@attrs.frozen
class StreamFailed:
    error: BaseException


StreamItem: TypeAlias = "StreamChunk | StreamDone | StreamFailed"
#: Items a stream holds for a reader that is behind (its channel's size) before the
#: call waits for it: the reading pauses, and the reader's pace shows in the timings.
STREAM_BUFFER = 32


class ItemSink(Protocol):
    """Where a stream's producer puts what it delivers, in order, the end last: the
    send side of the stream's own channel, or the one its reader gives it
    (``ChatStream._deliver_into``).  As trio's channel: ``send_nowait`` raises
    ``trio.WouldBlock`` when full, and a ``send`` that raised has put nothing."""

    def send_nowait(self, item: StreamItem, /) -> None: ...

    async def send(self, item: StreamItem, /) -> None: ...

    def close(self) -> None: ...


class ChatStream:
    """Async context manager and async iterator of :class:`StreamChunk`.

    The call runs in a producer task in the session's nursery, started as the block is
    entered (so it copies the caller's context variables) and cancelled as it is left;
    chunks of the committed path reach the iterator through a bounded channel.  Leaving
    the block early cancels the call, and every path is settled before ``__aexit__``
    returns.  The caller's task holds no nursery or cancel scope of polygate's across
    its block: the block may be left from another task of the run -- trio's finalizer
    closing an async generator that yields inside it and was dropped unclosed, or an
    ``AsyncExitStack`` handed over -- and what the body raises leaves as itself.
    """

    def __init__(
        self,
        runtime: Runtime,
        scope: str,
        messages: list[Mapping[str, Any]],
        messages_json: str,
        params: dict[str, Any],
        deadline: float | None,
        *,
        rounds: Rounds | None = None,
        cache: Cache | None = None,
        cache_mode: bool | str = True,
        run: trio.lowlevel.TrioToken | None = None,
    ) -> None:
        self._runtime = runtime
        self._owner_run = run  # (the session's run: where the stream must run)
        self._rounds = rounds
        self._cache = cache
        self._cache_mode = cache_mode
        self._scope = scope
        self._messages = messages
        self._messages_json = messages_json
        self._params = params
        self._deadline = deadline
        self._recv: trio.MemoryReceiveChannel[StreamItem] | None = None
        self._sink: ItemSink | None = None  # a reader's own buffer, instead of the channel
        self._end: StreamDone | StreamFailed | None = None  # taken by _ready(), given by __anext__
        self._entered = False
        # The producer's scope, cancelled as the block is left (or the session closes):
        # shielded, because the cancellations that reach the session's nursery are not
        # this call's (a cancellation of the caller's reaches it through the reader).
        self._producing = trio.CancelScope(shield=True)
        self._produced = trio.Event()  # the producer has ended: every path settled
        self._finished = False
        self._exited = False
        self._end_sent = False  # the answer (or the error) is in the channel
        self._failure: BaseException | None = None  # the end, when the stream failed
        self._unraised: BaseException | None = None  # ... when no reader has raised it yet
        self.response: ChatResponse | None = None
        self.text_parts: list[str] = TextParts()

    async def __aenter__(self) -> ChatStream:
        if self._entered:
            raise PolygateError("a ChatStream can be entered only once")
        _check_run(self._owner_run)
        if self._runtime.closed:
            raise PolygateError(_SESSION_CLOSED)
        # As a call awaited in a cancelled scope: nothing starts, nothing is sent.
        await trio.lowlevel.checkpoint_if_cancelled()
        nursery = self._runtime.nursery
        assert nursery is not None  # (set as the session opens, before any call)
        send: ItemSink
        if self._sink is None:
            send, self._recv = trio.open_memory_channel[StreamItem](STREAM_BUFFER)
        else:
            send = self._sink
        self._entered = True
        self._runtime.streams[self._producing] = self._produced
        # Started from the caller's task: the producer runs in a copy of its context.
        nursery.start_soon(self._producer, send)
        return self

    def _deliver_into(self, sink: ItemSink) -> None:
        """Before the block is entered: put what the call delivers into ``sink``, the
        buffer of a reader of its own (``polygate.aio``), instead of this stream's
        channel, which is then not made: this iterator yields nothing.  One buffer
        between the call and its reader, as in trio, not a second one behind it.
        ``sink.close()`` comes once the call has ended, after its end when it sent
        one; when it sent none, ``_end_unsent()`` says what the reader must hear."""
        if self._entered:
            raise PolygateError("a ChatStream's sink is chosen before it is entered")
        self._sink = sink

    async def _until_ended(self) -> None:
        """Until the call has ended, every path settled (for a reader that takes its
        items from its own sink, and so waits for no end of this iterator's)."""
        await self._produced.wait()

    def _end_unsent(self) -> BaseException | None:
        """For a sink closed with no end in it: the failure the call ended with,
        when its end could not be delivered (the sink full as it was cut off), or
        ``None``: the call was cut off before it had an end (the block left, or the
        session closed)."""
        return self._failure if self._end_sent else None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._entered:
            raise PolygateError("this ChatStream was never entered ('async with' enters it)")
        _check_run(self._owner_run)
        self._exited = True
        self._producing.cancel()
        # The block's own exception (a cancellation from outside too) then leaves as
        # itself, once every path of the call has settled.
        await _settled(self._produced)

    @_ki_protected  # (a task of its own: trio gives it no protection of its caller's)
    async def _producer(self, send: ItemSink) -> None:
        # A task of the session's nursery: nothing may leave it but the session's own
        # cancellation (which ends this stream: its reader hears the cut).
        try:
            with self._producing:
                await self._produce(send)
        except trio.Cancelled:
            raise  # (not this call's: its own scope is shielded, and takes its own)
        except BaseException as exc:  # (a bug of ours past _produce's own handler)
            if not self._end_sent:
                self._end_sent = True
                # The reader, woken by the channel's close below, raises it: the first
                # one this very exception, with its traceback (nobody raised it yet).
                self._failed(exc)
        finally:
            send.close()  # (only now: what a reader it wakes must hear is set)
            self._runtime.streams.pop(self._producing, None)
            # (polygate.aio's sink holds its stream, which holds this one: a cycle.)
            self._sink = None
            # The request is done with (a stream is entered once): a caller keeps the
            # stream for its response, often until the next turn of an agent's loop,
            # and it held the whole history twice, as objects and as JSON.
            self._messages, self._messages_json, self._params = [], "", {}
            self._produced.set()

    async def _produce(self, send: ItemSink) -> None:
        sink = _Sink(send, self.text_parts)
        try:
            response = await cached_chat(
                self._runtime, self._cache, self._cache_mode, self._scope, self._messages,
                self._messages_json, self._params, self._deadline,
                forward=sink, delivered=self.text_parts, rounds=self._rounds,
            )
        except trio.Cancelled:
            raise
        except BaseException as exc:
            # Every way the call ends reaches the iterator as itself — a polygate
            # error, Ctrl-C, a bug — never as EndOfChannel (the consumer raises it
            # from __anext__).
            self._end_sent = True
            # (A reader woken by the channel's close hears it too: a delivery cut by
            # the session's closing, with the channel full, then never arrives, and
            # the first reader is the one to raise this very exception.)
            if isinstance(exc, PolygateError):
                frameless(exc, handled=None)  # (as a call's: see Session.chat)
            self._failed(exc)
            await _deliver(send, StreamFailed(exc))
        else:
            if not sink.sent and (any(
                type(c) is dict and type(c.get("message")) is dict and _has_output(c["message"])
                for c in response.choices
            ) or _carries_more(response.raw)):
                # The upstream answered with a plain JSON body (it cannot stream):
                # the whole answer is one chunk, so iterating still shows it (when
                # any choice holds something: n > 1, the first may be empty).
                delta = message_delta(response.message)
                # (The first item: the channel has room.  Sent and shown with no
                # scheduler pass between: the iterator never sees one without the other.)
                # Its raw is that chunk (every choice a delta), not the body: as every
                # other chunk a caller reads.
                send.send_nowait(StreamChunk(text=response.text, delta=delta,
                                             raw=whole_chunk(response.raw, delta)))
                if response.text:
                    self.text_parts.append(response.text)
            await send.send(StreamDone(response))
            # Only once it is in the channel: a send cancelled as the block exits
            # (the channel full) sent no end, and a reader must hear the cut.
            self._end_sent = True

    def _failed(self, error: BaseException) -> None:
        # What this stream keeps of its failure, for the readers after the first, is
        # a copy: the first raises the error itself, whose traceback then holds the
        # reading frame, which holds this stream -- kept, a cycle the cyclic collector
        # alone frees.  A reader of polygate.aio's takes it from the sink, not from
        # __anext__: this stream never holds it.
        self._failure = twin_error(error)
        self._unraised = error if self._sink is None else None

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._recv is None:
            raise PolygateError("use 'async with session.stream_chat(...) as stream' first")
        _check_run(self._owner_run)  # (its channel is the run's: read elsewhere, trio's bare errors)
        if self._finished:
            if self._failure is not None:  # it failed: every reader hears so, every time
                raise twin_error(self._failure)
            raise StopAsyncIteration
        if self._exited:
            raise PolygateError(_BLOCK_EXITED)
        await trio.lowlevel.checkpoint_if_cancelled()
        item: StreamItem
        failed_elsewhere = False
        if self._end is not None:
            item, self._end = self._end, None
        else:
            try:
                try:
                    item = self._recv.receive_nowait()  # buffered chunks: no round trip each
                except trio.WouldBlock:
                    item = await self._recv.receive()
            except trio.EndOfChannel:
                self._finished = True
                if not self._end_sent:
                    # Cut off: the producer was cancelled with no end sent, which only
                    # the block's leaving does (this task read as another left it), or
                    # the session's closing under the stream.  A failure, which every
                    # later read hears too -- never a clean end.
                    self._failure = PolygateError(
                        _BLOCK_EXITED if self._exited or not self._runtime.closed
                        else _SESSION_CLOSED
                    )
                    raise twin_error(self._failure) from None  # (a copy: see _failed)
                if self._failure is None:  # another task reading this stream took its end
                    raise StopAsyncIteration from None
                failed_elsewhere = True  # ... and it was a failure: raised below
        if failed_elsewhere:
            # The error itself when no reader raised it yet, else a copy for this
            # reader; raised outside the handler above, so that it keeps its cause and
            # context.
            error, self._unraised = self._unraised, None
            if error is None:
                assert self._failure is not None  # (failed_elsewhere: it failed)
                error = twin_error(self._failure)
            try:
                raise error
            finally:
                del error  # (the traceback holds this frame: see _failed)
        if isinstance(item, StreamChunk):
            return item
        self._finished = True
        if isinstance(item, StreamDone):
            self.response = item.response
            raise StopAsyncIteration
        error = item.error
        del item  # (the traceback holds this frame: see _failed)
        if error is self._unraised:
            self._unraised = None  # (raised here: a later reader gets a copy)
        else:
            # A reader woken by the channel's close ran first and raised the error
            # itself: this one gets a copy (one object raised by two tasks collects
            # both tracebacks).
            assert self._failure is not None
            error = twin_error(self._failure)
        try:
            raise error
        finally:
            del error

    def _ready(self, limit: int) -> list[StreamChunk]:
        """Up to ``limit`` chunks that have already arrived, without waiting (for
        ``polygate serve``, which writes them to its client in one send).  The end of
        the stream, if it is among them, is kept for the next ``__anext__``."""
        ready: list[StreamChunk] = []
        if self._recv is None or self._finished or self._exited or self._end is not None:
            return ready
        while len(ready) < limit:
            try:
                item = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if not isinstance(item, StreamChunk):
                self._end = item
                break
            ready.append(item)
        return ready

    @property
    def text(self) -> str:
        """The first choice's content handed to this stream so far: yielded, or queued
        for the iterator (docs/concepts.md)."""
        return "".join(self.text_parts)


def is_bug(error: BaseException) -> bool:
    """An exception no polygate error stands for: a bug (it keeps its frames).  (Not a
    group: its members are judged one by one.)"""
    return isinstance(error, Exception) and not isinstance(error, (PolygateError, BaseExceptionGroup))


def twin_error(error: BaseException) -> BaseException:
    """The stream's failure for one more reader: a copy (one exception object is not
    raised by two tasks: each raise writes its traceback into it), or, for one that
    cannot be copied, a PolygateError that names it."""
    try:
        twin = copy.copy(error)
    except Exception:
        twin = None
    if type(twin) is not type(error):
        return PolygateError(f"the stream failed (another task reading it took the error): {error}")
    assert twin is not None
    twin.__traceback__ = None
    # Its own notes (copy.copy shares the original's list), the same cause and context.
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):
        setattr(twin, "__notes__", list(notes))  # noqa: B010 (no attribute before 3.11)
    twin.__cause__, twin.__context__ = error.__cause__, error.__context__
    twin.__suppress_context__ = error.__suppress_context__
    return twin


def _check_run(run: trio.lowlevel.TrioToken | None, *, awaited: bool = True) -> None:
    """Refuse a call made outside its session's trio run (``run``): in another trio
    run, or awaited where no trio run is (an asyncio loop, say, in another thread:
    trio's own error there is a bare RuntimeError or AttributeError from deep
    inside).  ``awaited=False``: only built here (``stream_chat`` builds its stream
    in a worker thread, to be entered in the session's run)."""
    if run is None:
        return
    try:
        current = trio.lowlevel.current_trio_token()
    except RuntimeError:
        if not awaited:
            return
        raise PolygateError(
            "this session belongs to a trio run, and this call was awaited outside any "
            "(an asyncio loop?): from asyncio use polygate.aio.session(), or hand the "
            "call to the session's run (trio.from_thread.run)"
        ) from None
    if current is not run:
        raise PolygateError(
            "this session belongs to another trio run (another thread's trio.run): "
            "open one session per run, or hand the call to its run (trio.from_thread.run)"
        )
    if awaited and sniffio.current_async_library() != "trio":
        # asyncio code on trio-asyncio's loop, inside the session's own run: the call
        # would die in trio's first checkpoint ("Task got bad yield") after its
        # admission, charged to the source as its failure.
        raise PolygateError(
            "this session is trio's, and this call was awaited from asyncio code (on "
            "trio-asyncio's loop): use polygate.aio.session(), or trio_asyncio.trio_as_aio"
        )


class _Sink:
    """The committed path's chunks, on their way to the iterator (see ``Forward``)."""

    __slots__ = (
        "_delivered", "_held", "_resumed", "_send", "reasoning_field", "sent", "shown_logprobs",
        "shown_reasoning", "shown_tool_calls",
    )

    def __init__(
        self, send: ItemSink, delivered: list[str]
    ) -> None:
        self._send = send
        self._delivered = delivered
        self._held: StreamChunk | None = None
        self._resumed = False
        self.sent = 0
        self.shown_tool_calls = False  # a stream that showed tool calls (or a refusal) cannot be resumed
        self.shown_reasoning: list[str] = []
        #: The first choice's ``logprobs.content`` entries shown (a resumed stream's
        #: answer carries these, not its last segment's).
        self.shown_logprobs: list[Any] = []
        self.reasoning_field = "reasoning_content"

    def mark_resumed(self) -> None:
        self._resumed = True

    def offer(self, chunk: dict[str, Any]) -> bool:
        delta: dict[str, Any] = {}
        choices = chunk.get("choices")
        if choices:
            # Choice 0 by the one rule (choice_index): an index of 0.0 or false is not 0.
            first = choices[0]
            if not (isinstance(first, dict) and choice_index(first) == 0):
                first = next((c for c in choices if isinstance(c, dict)
                              and choice_index(c) == 0), None)
            if first is not None:
                d = first.get("delta")
                if isinstance(d, dict):
                    delta = d
        content = delta.get("content")
        text = content if isinstance(content, str) else ""
        item = StreamChunk(text=text, delta=delta, raw=chunk, resumed=self._resumed)
        self._resumed = False
        self.sent += 1
        try:
            # No scheduling round trip per chunk while the buffer has room.
            self._send.send_nowait(item)
        except trio.WouldBlock:
            self._held = item
            return False
        self._shown(item)
        return True

    async def deliver_held(self) -> None:
        item, self._held = self._held, None
        if item is None:
            return
        # Shown before the send: the iterator may yield it before this task runs
        # again (it takes what waits in the channel without a scheduler pass).  A send
        # that raised sent nothing (trio's guarantee): then it was not shown.
        before = (len(self.shown_reasoning), self.shown_tool_calls, self.reasoning_field,
                  len(self.shown_logprobs))
        self._shown(item)
        try:
            await self._send.send(item)
        except BaseException:
            if item.text:
                drop_last(self._delivered, item.text)
            del self.shown_reasoning[before[0]:]
            del self.shown_logprobs[before[3]:]
            self.shown_tool_calls, self.reasoning_field = before[1], before[2]
            raise

    def _shown(self, item: StreamChunk) -> None:
        """Record ``item`` as shown to the caller: its text (``ChatStream.text``), its
        reasoning, whether it showed tool calls (then not resumable)."""
        delta, text = item.delta, item.text
        if text:
            self._delivered.append(text)
        if not resumable_delta(delta):
            self.shown_tool_calls = True
        reasoning = delta.get("reasoning_content")
        if not (isinstance(reasoning, str) and reasoning):
            reasoning = delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self.reasoning_field = "reasoning"
        if isinstance(reasoning, str) and reasoning:
            self.shown_reasoning.append(reasoning)
        entries = first_logprobs(item.raw)
        if entries:
            self.shown_logprobs.extend(entries)


async def _deliver(
    send: ItemSink, item: StreamFailed
) -> None:
    try:
        send.send_nowait(item)
    except trio.WouldBlock:
        await send.send(item)


def _has_output(message: Mapping[str, Any]) -> bool:
    """Whether a whole (JSON) answer holds a content token (docs/concepts.md): the
    legacy ``function_call``, Ollama's ``reasoning`` and OpenAI's ``audio`` count too."""
    audio = message.get("audio")
    return any(message.get(k) for k in (
        "content", "reasoning_content", "reasoning", "refusal", "tool_calls", "function_call",
    )) or (type(audio) is dict and carries_audio(audio))


def _carries_more(body: dict[str, Any]) -> bool:
    """Whether a whole (JSON) answer without a content token still holds what the one
    chunk it becomes must show: a choice's field beyond its message (Azure's
    ``content_filter_results`` on an answer it filtered to nothing) or the body's
    (``prompt_filter_results``), as a streamed answer's chunks would carry them."""
    return carries_extras(body) or any(
        carries_value(v) for k, v in body.items() if k not in ANSWER_KEYS)


# --------------------------------------------------------------------------- session()


def _backend_for(settings: Settings) -> MemoryBackend | RedisBackend:
    """The backend the settings name: in-process, or Redis (connected by ``start()``).
    Importing the Redis backend does not import coredis; building one checks for it."""
    if settings.backend == "memory":
        return MemoryBackend()
    return RedisBackend.from_url(settings.backend)


class SharedBackends:
    """The governance backends of sessions that follow one another in one process
    (``polygate serve``'s generations): one in-process backend for all of them, so
    that a reload keeps in-flight limits, quota windows and breakers as Redis does."""

    def __init__(self) -> None:
        self._memory = MemoryBackend()

    def for_settings(self, settings: Settings) -> MemoryBackend | RedisBackend:
        return self._memory if settings.backend == "memory" else _backend_for(settings)

    def in_force(self, settings: Settings) -> None:
        """``settings`` are now in force (a generation's session opened on them): a
        source whose endpoint changed under its name -- a rotated key, a new URL or
        model, the fix for a source gone dead -- starts its health afresh, and the
        old generation's verdicts on the endpoint it replaced no longer count
        (MemoryBackend.renew).  Not for Redis: its state is every replica's, and
        replicas change keys one at a time."""
        if settings.backend == "memory":
            self._memory.renew({
                (name, source.name): endpoint_of(source.base_url, source.model, source.api_key)
                for name, scope in settings.scopes.items() for source in scope.sources
            })

    def forget_unused(self, in_force: Iterable[Settings]) -> None:
        """Drop the in-memory state of the source and gateway-key names none of
        ``in_force`` (every generation still open) uses, once it holds nothing (see
        MemoryBackend.forget_all_but).  Called once a reload is in force: a reload that
        fails changes nothing."""
        kept: set[tuple[str, str]] = set()
        for settings in in_force:
            kept.update((name, source.name) for name, scope in settings.scopes.items()
                        for source in scope.sources)
            kept.update((KEY_SCOPE, key) for key in settings.serve.keys)
        self._memory.forget_all_but(kept)


def session(
    settings: Settings | None = None,
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    rng: random.Random | None = None,
) -> AbstractAsyncContextManager[Session]:
    """Open a session.  Without ``settings``: ``POLYGATE_CONFIG`` / ``./polygate.toml``
    when present, else the ``POLYGATE__…`` environment (``env`` replaces ``os.environ``).
    ``transport`` replaces the network for every source (tests, the demo).  What it
    returns opens one session, once: entering it again is a PolygateError."""
    return OneUse(_session(settings, env, transport, rng), "polygate.session()", trio_task=True)


class OneUse(AbstractAsyncContextManager[T]):
    """An ``async with`` block that can be entered once (a generator's context
    manager entered twice fails inside contextlib with a bare AttributeError)."""

    def __init__(self, block: AbstractAsyncContextManager[T], what: str, *, trio_task: bool = False) -> None:
        self._block = block
        self._what = what
        self._entered = False
        #: The block is trio's, left by the task that entered it (its nursery's rule).
        self._trio_task = trio_task
        self._task: trio.lowlevel.Task | None = None

    async def __aenter__(self) -> T:
        if self._entered:
            raise PolygateError(
                f"this {self._what} block was already entered; call {self._what} again "
                "for another session"
            )
        if self._trio_task:
            self._task = _entering_task(self._what)
        self._entered = True
        return await self._block.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if not self._entered:
            # Passed on, it would run the generator to its yield: a session opened
            # (files, connections) by a call meant to close one, then a bare RuntimeError.
            raise PolygateError(f"this {self._what} block was never entered ('async with' enters it)")
        if self._task is not None and trio.lowlevel.current_task() is not self._task:
            # Its nursery would be left by a stranger: trio's own error is a corrupted
            # cancel scope stack, after which the run is lost.  The block stays open,
            # for the task that entered it to leave.
            raise PolygateError(
                f"a {self._what} block must be left by the task that entered it (unlike a "
                "stream_chat() block): hand the work to that task, not the block to another"
            )
        return await self._block.__aexit__(exc_type, exc, tb)


def _entering_task(what: str) -> trio.lowlevel.Task:
    """The trio task entering a session block; a clear error where there is none (trio's
    own, from deep inside, says "must be called from async context")."""
    try:
        task = trio.lowlevel.current_task()
    except RuntimeError:
        raise PolygateError(
            f"{what} is for trio code, and this block was entered outside any trio run (an "
            "asyncio loop?): from asyncio use polygate.aio.session()"
        ) from None
    if sniffio.current_async_library() != "trio":
        raise PolygateError(
            f"{what} is for trio code, and this block was entered from asyncio code (on "
            "trio-asyncio's loop): use polygate.aio.session()"
        )
    return task


@asynccontextmanager
async def _session(
    settings: Settings | None,
    env: Mapping[str, str] | None,
    transport: httpx.AsyncBaseTransport | None,
    rng: random.Random | None,
) -> AsyncIterator[Session]:
    from ._config_load import given_settings

    try:
        settings = given_settings(settings, env)
    finally:
        del env  # (a configuration error's frames would show it: see frameless_on)
    if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
        # (A sync httpx.HTTPTransport is the easy mistake: every attempt would fail
        # with an AttributeError, logged and counted against the sources' breakers.)
        raise ConfigError(
            f"transport must be an httpx.AsyncBaseTransport, got {type(transport).__name__}"
        )
    if rng is not None and not isinstance(rng, random.Random):
        raise ConfigError(f"rng must be a random.Random, got {type(rng).__name__}")
    async with session_on(settings, _backend_for(settings), transport=transport, rng=rng) as opened:
        yield opened


async def _cut_streams(runtime: Runtime) -> None:
    """Cancel the streams still running as their session closes (read from tasks
    outside its block, or in its block under a shield) and wait until each has
    settled: shielded, and bounded as a nursery's exit is (each was just cancelled)."""
    if not runtime.streams:
        return
    running = list(runtime.streams.items())  # (each producer removes itself as it ends)
    for producing, _ in running:
        producing.cancel()
    for _, ended in running:
        await _settled(ended)


@trio.lowlevel.enable_ki_protection  # (Ctrl-C goes to the main task, which holds it)
async def _close(
    handle: Session, cache: Cache | None, telemetry: Telemetry,
    backend: MemoryBackend | RedisBackend, closed: trio.Event,
) -> None:
    """The session's close, each step bounded: its streams first (their rows count),
    the renderers, the cache's queued writes (before its writer stops), telemetry; on
    Redis, then, the admissions of calls still running go back, so that the figures
    taken next show them settled.  Shielded as a whole, so that a cancellation from
    outside (the session left by it) cuts no step short and skips none."""
    runtime = handle._runtime
    try:
        with trio.CancelScope(shield=True):
            try:
                await _cut_streams(runtime)
                await runtime.renderers.aclose()  # discards idle renderers (kills processes)
                if cache is not None:
                    await cache.aclose()
                await telemetry.aclose()
            finally:
                if isinstance(backend, RedisBackend):
                    await backend.settle_left()
                    await handle._freeze_governance(backend)
    finally:
        closed.set()


async def _settled(ended: trio.Event) -> None:
    """Wait until a cancelled producer has ended; Ctrl-C, if it came, once it has."""
    interrupted = await _waited_out(ended)
    if interrupted is not None:
        raise interrupted


async def _waited_out(ended: trio.Event) -> KeyboardInterrupt | None:
    """Wait until ``ended`` is set: shielded, and bounded as a nursery's exit is (what
    it waits for has bounds of its own).  Ctrl-C, which no shield holds back, is held
    and returned, as a nursery's exit holds it until its children are done: a caller
    never leaves with a call still running."""
    if ended.is_set():
        return None  # (no scope, no checkpoint: as a nursery with no child left)
    interrupted: KeyboardInterrupt | None = None
    with trio.CancelScope(shield=True):
        while not ended.is_set():
            try:
                await ended.wait()
            except KeyboardInterrupt as exc:
                interrupted = interrupted or exc  # (a second Ctrl-C: the first is kept)
    return interrupted


async def _tidy(transport: LeanTransport) -> None:
    """Close the pool's idle connections that expired or that their server closed,
    every ``TIDY_EVERY_S``, for the session's life (cancelled with its nursery)."""
    while True:
        await trio.sleep(TIDY_EVERY_S)
        transport.close_idle()


@asynccontextmanager
async def session_on(
    settings: Settings,
    backend: MemoryBackend | RedisBackend,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    rng: random.Random | None = None,
    relay: bool = False,
) -> AsyncIterator[Session]:
    """:func:`session` on a given governance ``backend``: ``polygate serve`` keeps one
    in-process backend across the generations a reload makes, so that in-flight limits,
    quota windows and breakers hold across a reload as they do on Redis.  (Closing a
    session closes its backend: the memory backend's close is a no-op.)  ``relay``:
    the session relays clients' request bodies (see Session._relay)."""
    rng = rng if rng is not None else random.Random()
    owned = transport is None
    handle: Session | None = None
    pool: LeanTransport | None = None
    if transport is None:
        pool = LeanTransport.from_limits(_POOL_LIMITS)
        # (Through the environment's egress proxies, for the sources they carry.)
        transport = routed(pool, [s.url for scope in settings.scopes.values() for s in scope.sources])
    body_error: BaseException | None = None
    interrupted: KeyboardInterrupt | None = None  # Ctrl-C during the close: raised last
    loop_lag = LoopLag.acquire()  # (released last, below)
    try:
        if isinstance(backend, RedisBackend):
            await backend.start()  # connects, checks Lua, loads scripts; cleans up on failure
        try:
            # Telemetry opens (and fails with ConfigError) at session start; its flusher
            # runs in the session's nursery and is flushed, bounded, before it is cancelled.
            async with (
                open_telemetry(settings) as telemetry,
                open_cache(settings.cache) as cache,  # ConfigError: a SQLite file it cannot use
                trio.open_nursery() as nursery,
            ):
                governor = Governor(settings, backend, rng=rng)
                runtime = Runtime(
                    settings, transport, governor, rng=rng, recorder=telemetry.recorder,
                    nursery=nursery, trace_headers=telemetry.trace_headers, loop_lag=loop_lag,
                )
                telemetry.start(nursery, governor)
                if cache is not None:
                    cache.start(nursery)  # the writer of write-behind backends
                if pool is not None:
                    nursery.start_soon(_tidy, pool, name="polygate pool tidier")
                handle = Session(runtime, telemetry, cache)
                handle._relay = relay
                try:
                    yield handle
                except _PASS_THROUGH:
                    raise
                except BaseException as exc:  # Ctrl-C too: re-raised below as itself
                    body_error = exc
                finally:
                    runtime.closed = True
                    # In a task of its own, protected from Ctrl-C (trio then raises it
                    # in the main task, which holds it here): every bounded step of the
                    # close runs to its end, and Ctrl-C leaves after them, as itself
                    # (raised below).
                    closed = trio.Event()
                    nursery.start_soon(_close, handle, cache, telemetry, backend, closed,
                                       name="polygate session close")
                    interrupted = await _waited_out(closed)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Ctrl-C as the nursery's exit waited for its cancelled tasks: held, as
            # one held in the close, and raised below as itself.
            held = one_interrupt(group)
            if held is not None:
                interrupted = interrupted or held
            else:
                # The body's cancellation and the background tasks', side by side: one
                # Cancelled leaves (an `except trio.Cancelled:` around the block runs).
                cancelled = one_cancelled(group)
                if cancelled is None:
                    raise
                if body_error is None and interrupted is None:
                    raise cancelled from None
                # The body raised as the scope around it was cancelled: its error is
                # what leaves (as from a plain nursery), never lost to the Cancelled --
                # raised below, outside this handler, so that its own cause and
                # context stay.
        finally:
            await backend.aclose()  # (in the task that started it: its nursery is this task's)
    except BaseExceptionGroup as group:  # (Ctrl-C as the backend's nursery closed)
        held = one_interrupt(group)
        if held is None:
            raise
        interrupted = interrupted or held
    finally:
        if loop_lag is not None:
            loop_lag.release()
        if owned:  # a transport the caller passed in stays theirs to close
            await transport.aclose()
    if body_error is not None and (interrupted is None or isinstance(body_error, KeyboardInterrupt)):
        raise body_error
    if interrupted is not None:
        # Ctrl-C is never lost to the body's error (that one is its context).
        interrupted.__context__ = interrupted.__context__ or body_error
        raise interrupted
