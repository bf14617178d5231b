"""The endpoints: one HTTP request in, one session call, one answer out.

No gateway logic lives here -- admission, hedging, retries, deadlines and statistics
are the session's.  This module only checks the gateway key, maps the request's
``model`` to a scope, hands the body's parameters to ``Session.chat`` /
``stream_chat`` / ``embed`` unchanged, and writes the result (or the error of
:mod:`._errors`) back in OpenAI's shapes.

The logical call's id is chosen here before the call starts (``PRESET_CALL_ID``), so
that a stream's response head -- sent before the call has an answer -- can carry the
same ``x-polygate-call-id`` as the call's telemetry rows.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import inspect
import json
import logging
import math
import re
import sys
import urllib.parse
from array import array
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol

import attrs
import trio

from .._bugs import log_bug
from .._config import Settings
from .._context import PRESET_CALL_ID, PRESET_HEADERS, fresh_call_id
from .._errors import ConfigError, PolygateError
from .._json import MAX_DEPTH, loads, nested_deeper
from .._key_quota import KeyQuotas, KeyRefusal
from .._session import Session
from .._types import CallStats, ChatResponse, StreamChunk
from .._whole_chunk import KEPT_HEADER
from ._errors import OUT_OF_MEMORY, ErrorReply, reply_for
from ._http import BAD_KEY, ClientGone, Connection, Request, field_value
from ._json import Unencodable, dump, has_lone_surrogate
from ._meter import CURRENT, CallMeter, tap
from ._metrics import Metrics, render
from ._sse import (
    KEEPALIVE,
    StreamShape,
    answer_header,
    error_event,
    reported_usage,
    string_content,
)
from ._trace import Joiner, joiner
from ._unavailable import UnavailableSession

__all__ = ["NO_CALL", "Gateway", "answer", "endpoint_label"]

log = logging.getLogger("polygate.serve")

_JSON: Final = (b"content-type", b"application/json")
#: Body keys that are Session keywords, not upstream parameters: a client of the
#: gateway may not set them (structured re-asks multiply upstream calls; the cache is
#: shared by every client; the scope and the deadline are the gateway's).
_NOT_PARAMS: Final = frozenset({"scope", "call_deadline_s", "schema", "cache"})


def _named(*methods: Callable[..., Any]) -> frozenset[str]:
    """The parameters of Session methods other than their ``**params``: a body key
    so named would clash with the call's own arguments (``self``, ``inputs``)."""
    return frozenset(
        name for method in methods for name, p in inspect.signature(method).parameters.items()
        if p.kind is not p.VAR_KEYWORD
    )


#: The body keys each endpoint refuses (400): the Session keywords and whatever else
#: the session method names -- except the body's own ``messages``, taken out before
#: the call (an embeddings body says ``input``; ``inputs`` would clash).
_CHAT_REFUSED: Final = (_NOT_PARAMS | _named(Session.chat, Session.stream_chat)) - {"messages"}
_EMBED_REFUSED: Final = _NOT_PARAMS | _named(Session.embed)
_READY_TIMEOUT_S: Final = 2.0
#: At most this many already-arrived chunks are written to a client in one send.
_BURST: Final = 32
_SHUTDOWN = ErrorReply(
    503, "The gateway is shutting down and cancelled this call; retry it.", "api_error",
    "shutting_down", retry_after_s=1,
)


@attrs.define(eq=False)
class Gateway:
    """One configuration generation: its settings, its open session, what is derived
    from them once (key digests, the models list), and who is still using it."""

    settings: Settings
    #: An UnavailableSession while the governance backend has not answered since start.
    session: Session | UnavailableSession
    #: (Not in the repr: an unsalted digest lets a key be guessed offline, and a
    #: crash reporter that records locals would keep it.)
    keys: dict[bytes, int] = attrs.field(init=False, repr=False)
    #: The name of each key in ``keys`` (``None``: an unlabelled ``api_keys`` entry).
    names: tuple[str | None, ...] = attrs.field(init=False, repr=False)
    #: The labelled keys with a quota; ``None`` when no key has one.
    quotas: KeyQuotas | None = attrs.field(init=False, repr=False)
    models_body: bytes = attrs.field(init=False, repr=False)
    #: The scopes each labelled key with ``models`` may call (a key not here: all).
    reach: dict[str, frozenset[str]] = attrs.field(init=False, repr=False)
    #: Each such key's own ``/v1/models``: what it may name.
    reach_body: dict[str, bytes] = attrs.field(init=False, repr=False)
    #: Runs a request's call in its client's trace context; None when the session
    #: does not trace (nothing is read then).
    join_trace: Joiner | None = attrs.field(init=False, repr=False)
    users: int = 0
    retired: bool = False
    idle: trio.Event = attrs.field(factory=trio.Event)
    #: The last readiness verdict (when, status, body) and the lock its checks take.
    ready: tuple[float, int, bytes] | None = attrs.field(default=None, repr=False)
    ready_lock: trio.Lock = attrs.field(factory=trio.Lock, repr=False)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.session, Session):
            tap(self.session)  # every call counted in /metrics, cancelled ones too
        self.join_trace = joiner() if isinstance(self.session, Session) and self.session._traces() else None
        serve = self.settings.serve
        # The digests of the keys, each to its index (the loader refuses a repeat).  A
        # presented key is looked up by its digest: the time depends on that digest
        # alone, which tells nothing of any key, and not on how many keys there are
        # (compared with each in turn, ten thousand tenants' keys cost ~1 ms a request).
        self.keys = {_digest(key): index for index, key in enumerate(
            (*serve.api_keys, *(k.key for k in serve.keys.values())))}
        self.names = (*(None for _ in serve.api_keys), *serve.keys)
        quotas = self.session._key_quotas()
        self.quotas = quotas if quotas is not None and quotas.limits else None
        # Once each: an alias may repeat its scope's own name (models = {"chat": "chat"}).
        names = list(dict.fromkeys([*self.settings.scopes, *self.settings.serve.models]))
        self.models_body = dump({"object": "list", "data": [_model(n) for n in names]})
        # A key bound to scopes reaches each by any of its names (alias or its own).
        self.reach = {
            name: frozenset(s for s in map(self.scope_of, key.models) if s is not None)
            for name, key in serve.keys.items() if key.models
        }
        self.reach_body = {
            name: dump({"object": "list",
                        "data": [_model(n) for n in names if self.scope_of(n) in scopes]})
            for name, scopes in self.reach.items()
        }

    def scope_of(self, model: Any) -> str | None:
        if not isinstance(model, str):
            return None
        return self.settings.serve.scope_of(model, self.settings.scopes)

    def authorised(self, headers: Mapping[str, str]) -> bool:
        return not self.keys or self._match(headers) >= 0

    def key_name(self, headers: Mapping[str, str]) -> str | None:
        """The name of the presented key when a name matters: the key has a quota or is
        bound to scopes (``None`` otherwise, without hashing it again)."""
        if self.quotas is None and not self.reach:
            return None
        index = self._match(headers)
        return self.names[index] if index >= 0 else None

    def limited(self, name: str | None) -> str | None:
        """``name`` when that key has a quota."""
        return name if self.quotas is not None and name in self.quotas.limits else None

    def _match(self, headers: Mapping[str, str]) -> int:
        """The index of the presented key in ``keys``, or -1."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return -1
        # HTTP's optional whitespace only (a header is read as latin-1, where str.strip
        # would also take NBSP and NEL: a key with either byte around it matched).
        return self.keys.get(_digest(token.strip(" \t")), -1)

    def enter(self) -> None:
        self.users += 1

    def leave(self) -> None:
        self.users -= 1
        if self.retired and self.users == 0:
            self.idle.set()

    def retire(self) -> None:
        self.retired = True
        if self.users == 0:
            self.idle.set()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "polygate"}


class _State(Protocol):
    draining: bool
    #: The server's name in ``Via`` (``polygate-`` and 12 hex digits, drawn at start),
    #: and its entry there (``1.1 polygate-…``).
    via: str
    via_line: str


@attrs.define(eq=False)
class Context:
    """What a request handler needs besides the request; ``state.draining`` is read
    when each answer goes out (a draining server closes the connection after it)."""

    conn: Connection
    gateway: Gateway
    metrics: Metrics
    state: _State
    #: The scope of the request's call.  Cancelled by the server when its client leaves
    #: (the connection then says ``client_gone``: a 499, nothing sent), and when a
    #: drain's grace period is over: the call stops and the client is told why (503,
    #: or an error event on a stream already started).  See :func:`_stopped`.
    stop: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: The call this request started, once it has started one.
    meter: CallMeter | None = None
    #: ``gateway``'s keys admitted this request when its head arrived (the server
    #: checks them before reading a body): no second check.
    key_checked: bool = False

    @property
    def draining(self) -> bool:
        """Whether this answer is the connection's last: the server drains and no
        pipelined request waits behind it (one that does is answered too, see
        ``Server._answer``)."""
        return self.state.draining and not self.conn.pending()

    def start_call(self, scope: str, call_id: str) -> contextvars.Token[CallMeter | None]:
        self.meter = CallMeter(scope, call_id)
        return CURRENT.set(self.meter)

    def count_call(self, scope: str, stats: CallStats | None, result: str) -> None:
        if self.meter is not None:
            self.meter.count(self.metrics, stats, result)
        else:
            self.metrics.call(scope, stats, result)

    def count_leftover(self, status: int, code: str | None = None) -> None:
        """Count the started call that no answer counted: its client left (499), a
        drain cut it (503), this module failed (500), or ``code`` says why."""
        if self.meter is not None:
            result = code or _LEFTOVER.get(status, str(status))
            self.meter.count_leftover(self.metrics, result)


_LEFTOVER: Final = {499: "client_closed", 503: "shutting_down", 500: "internal_error"}


# --------------------------------------------------------------------------- entry


async def answer(ctx: Context, request: Request) -> None:
    """Answer one request.  Raises only when the request was cancelled (its client
    left, or the server stopped); a bug in this module is logged and answered 500."""
    started = trio.current_time()
    endpoint, status = request.path, 500
    code: str | None = None  # (the leftover call's result, where the status says less)
    try:
        join = ctx.gateway.join_trace
        if join is None:
            endpoint, status = await _route(ctx, request)
        else:
            with join(request.headers):
                endpoint, status = await _route(ctx, request)
    except ClientGone:
        status = 499  # nginx's "client closed request"
    except MemoryError:
        # No bug: the process's limit (a container's, RLIMIT_AS) met a large request.
        # A 503 says what a client can do about it (another replica, later), where a
        # 500 and a traceback read as a defect.
        status, code = 503, "out_of_memory"
        _out_of_memory(request)
        await _unavailable(ctx, ErrorReply(503, OUT_OF_MEMORY, "api_error", code))
    except Exception as exc:
        where = f"answering {request.method} {endpoint_label(request.path)}"
        log_bug(log, exc, where, ctx.gateway.settings.secrets())
        await _internal_error(ctx)
    except BaseException:  # cancelled, perhaps inside a group from the call's nursery
        # Its client left, or the server stopped hard (a second SIGTERM, the end of a
        # drain's last words) with the client still there: not a client that left.
        status = 499 if ctx.conn.client_gone else 503
        if status == 499:
            ctx.metrics.disconnects += 1
        ctx.count_leftover(status)
        ctx.metrics.request(endpoint_label(endpoint), status, trio.current_time() - started)
        raise
    if status == 499:
        ctx.metrics.disconnects += 1
    ctx.count_leftover(status, code)
    ctx.metrics.request(endpoint_label(endpoint), status, trio.current_time() - started)


async def _internal_error(ctx: Context) -> None:
    """A 500 when no answer had started; otherwise the connection cannot be trusted."""
    await _unavailable(
        ctx, ErrorReply(500, "internal error in the gateway", "api_error", "internal_error")
    )


async def _unavailable(ctx: Context, reply: ErrorReply) -> None:
    """``reply`` when no answer had started; otherwise the connection cannot be trusted."""
    if ctx.conn.responding:
        ctx.conn.client_gone = True  # close it
        return
    with contextlib.suppress(ClientGone):
        await _fail(ctx, reply)


#: When the last out-of-memory warning was logged, in this run's time (one per trio
#: run: another run's clock, a thread's beside it or an earlier run's, is no measure).
_MEMORY_LOGGED: trio.lowlevel.RunVar[float] = trio.lowlevel.RunVar("polygate_memory_logged")


def _out_of_memory(request: Request) -> None:
    """One warning a minute, without a traceback (there is no bug to find in it)."""
    now = trio.current_time()
    last = _MEMORY_LOGGED.get(-math.inf)
    if 0 <= now - last < 60:
        return
    _MEMORY_LOGGED.set(now)
    log.warning("out of memory answering %s %s (%d bytes of body): answered 503; raise the "
                "process's memory limit, or lower [serve] max_request_bytes (a request's "
                "size) or max_body_bytes (an answer's)",
                request.method, endpoint_label(request.path), len(request.body))


_ROUTES: Final = {
    "/v1/chat/completions": "POST",
    "/v1/embeddings": "POST",
    "/v1/models": "GET",
    "/healthz": "GET",
    "/readyz": "GET",
    "/metrics": "GET",
}


def endpoint_label(path: str) -> str:
    if path in _ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


async def _route(ctx: Context, request: Request) -> tuple[str, int]:
    path = request.path
    method = _ROUTES.get(path, "GET" if path.startswith("/v1/models/") else None)
    if method is None:
        return path, await _fail(ctx, ErrorReply(
            404, f"Unknown request URL: {request.method} {path}", "invalid_request_error",
            "unknown_url"))
    if request.method != method and not (request.method == "HEAD" and method == "GET"):
        return path, await _fail(ctx, ErrorReply(
            405, f"{request.method} is not allowed on {path} (use {method})",
            "invalid_request_error", "method_not_allowed",
            allow="GET, HEAD" if method == "GET" else method))
    if path == "/healthz":
        return path, await _send_json(ctx, 200, b'{"status":"ok"}')
    if path == "/readyz":
        return path, await _readyz(ctx)
    if not ctx.key_checked and not ctx.gateway.authorised(request.headers):
        return path, await _fail(ctx, ErrorReply(
            401, BAD_KEY, "invalid_request_error", "invalid_api_key"))
    gateway = ctx.gateway
    who = gateway.key_name(request.headers)
    # A key bound to scopes: any other is, to it, a model that does not exist.
    reach = gateway.reach.get(who) if who is not None else None
    if path == "/metrics":
        if reach is not None:
            # A tenant's key: the metrics name every key and count its requests.
            return path, await _fail(ctx, ErrorReply(
                403, "This gateway key is bound to scopes and may not read /metrics.",
                "invalid_request_error", "permission_denied"))
        return path, await _metrics(ctx)
    if path == "/v1/models":
        listing = gateway.models_body if who is None or reach is None else gateway.reach_body[who]
        return path, await _send_json(ctx, 200, listing)
    if path.startswith("/v1/models/"):
        name = urllib.parse.unquote(path[len("/v1/models/"):])
        listed = gateway.scope_of(name)
        if listed is None or (reach is not None and listed not in reach):
            return path, await _fail(ctx, _unknown_model(name))
        return path, await _send_json(ctx, 200, dump(_model(name)))
    via = request.headers.get("via")
    passed = _VIA_NONE if via is None else _gateways_passed(via)
    if ctx.state.via in passed or len(passed) >= MAX_HOPS:
        return path, await _fail(ctx, _loop(ctx.state.via in passed, len(passed)))
    body = _parse_body(request.body)
    if isinstance(body, ErrorReply):
        return path, await _fail(ctx, body)
    scope = gateway.scope_of(body.get("model"))
    if scope is not None and reach is not None and scope not in reach:
        return path, await _fail(ctx, _unknown_model(body.get("model")))
    if scope is None:
        model = body.get("model")
        if model is None:
            return path, await _fail(ctx, _bad_param("you must provide a model parameter", "model"))
        if not isinstance(model, str):  # a malformed request, not a name nobody serves
            return path, await _fail(ctx, _bad_param(
                f"model must be a string, not {_json_type(model)}", "model"))
        return path, await _fail(ctx, _unknown_model(model))
    embeddings = path == "/v1/embeddings"
    not_accepted = _EMBED_REFUSED if embeddings else _CHAT_REFUSED
    if not not_accepted.isdisjoint(body):  # (no set made, nothing sorted: the usual)
        refused = sorted(not_accepted & body.keys())
        return path, await _fail(
            ctx, _bad_param(f"parameter {refused[0]!r} is not accepted here", refused[0])
        )
    handler = _embeddings if embeddings else _chat
    key = gateway.limited(who)
    # The call's requests name this gateway after those the request came through.
    added = PRESET_HEADERS.set(
        (("via", ctx.state.via_line),) if not passed
        else (("via", ", ".join([*(f"1.1 {name}" for name in passed), ctx.state.via_line])),))
    try:
        if key is None:
            return path, await handler(ctx, scope, body, _Charge())
        return path, await _charged(ctx, handler, scope, body, key)
    finally:
        PRESET_HEADERS.reset(added)


#: The most polygate gateways a request may have come through (its ``Via``): a chain
#: longer than this is a loop through gateways that do not all see each other.
MAX_HOPS: Final = 8
#: A gateway's name in ``Via``: what this server writes (``_State.via``).
_VIA_NAME: Final = re.compile(r"polygate-[0-9a-f]{12}")
_VIA_NONE: Final[tuple[str, ...]] = ()


def _gateways_passed(via: str) -> tuple[str, ...]:
    """The polygate gateways named in a request's ``Via`` (RFC 9110 7.6.3: a list of
    ``protocol received-by [comment]``), in order; other proxies' entries are left."""
    names = []
    for entry in via.split(","):
        parts = entry.split()
        if len(parts) >= 2 and _VIA_NAME.fullmatch(parts[1]):
            names.append(parts[1])
    return tuple(names)


def _loop(here: bool, hops: int) -> ErrorReply:
    # final: an outer gateway's retry would loop again.  The library reads the two
    # apart (polygate._errors.classify_status): a request that came back here names
    # this server, whose name only its upstreams see, so no client can forge it, and
    # the source that sent it is taken out (``loop_detected``, dead); a chain too long
    # may be a client's made-up names, and fails its own call alone (``too_many_hops``).
    message = (
        "This request has already passed through this gateway (its Via header names "
        "it): a source of the scope leads back here. Point the source at the "
        "upstream itself, not at a gateway that sends the request back."
        if here else
        f"This request has come through {hops} gateways (its Via header): a chain "
        f"this long is taken for a loop (the most is {MAX_HOPS - 1}).")
    return ErrorReply(508, message, "api_error", "loop_detected" if here else "too_many_hops",
                      final=True)


# --------------------------------------------------------------------------- per-key quotas

_Handler = Callable[["Context", str, dict[str, Any], "_Charge"], Awaitable[int]]


@attrs.define
class _Charge:
    """What a call cost the key that made it, by the rules of
    :mod:`polygate._key_quota`.  A request refused before its session call started
    (a 400 of this module) costs nothing; once started, until the call says otherwise
    (a client that left, a drain), the request counts and its estimate stands."""

    started: bool = False
    attempted: bool = True
    tokens: int | None = None
    #: Whether the call's end (an answer, an error) has been read into this charge.
    ended: bool = False
    #: The prompt's share of the estimate, and the chunks of text a stream forwarded:
    #: what a stream that ends without its usage cost at least.
    prompt: int = 0
    streamed: int = 0

    @property
    def counts(self) -> bool:
        return self.started and self.attempted

    def answered(self, stats: CallStats, usage: Any) -> None:
        self.attempted = self.ended = True
        total = getattr(usage, "total_tokens", None)
        self.tokens = 0 if stats.cached else total if isinstance(total, int) else None
        if self.tokens is not None and getattr(usage, "source", None) != "upstream":
            # An estimate (the upstream reported none): never below what the stream
            # forwarded, as for a client that left.
            self.tokens = max(self.tokens, self.prompt + self.streamed)

    def failed(self, exc: BaseException, meter: CallMeter | None) -> None:
        if isinstance(exc, Unencodable):
            return  # the answer came (or was coming): its cost, or the estimate, stands
        self.ended = True
        stats: CallStats | None = getattr(exc, "call_stats", None)
        self.attempted = stats is not None and (stats.cached or (meter is not None and meter.sent))
        self.tokens = None

    def left(self, meter: CallMeter | None) -> None:
        """The call ended with neither (its client left, a drain cut it): it counts if
        a request of it reached a source."""
        if not self.ended and meter is not None:
            self.attempted = meter.sent


async def _charged(
    ctx: Context, handler: _Handler, scope: str, body: dict[str, Any], key: str
) -> int:
    """Admit the call against the key's quota, run it, settle what it cost."""
    quotas = ctx.gateway.quotas
    assert quotas is not None
    tokens: int | None
    prompt = 0
    if handler is _embeddings:
        texts = _embedding_inputs(body.get("input"))
        tokens = None if texts is None else quotas.embed_estimate(texts)
    else:
        completion = ctx.gateway.settings.scopes[scope].completion_estimate_tokens
        estimate = quotas.chat_estimate(body.get("messages"), body, completion)
        tokens, prompt = estimate if estimate is not None else (None, 0)
    if tokens is None:  # malformed: the handler answers 400 before any upstream work
        return await handler(ctx, scope, body, _Charge())
    try:
        admitted = await quotas.admit(key, tokens)
    except PolygateError as exc:  # the governance backend is down: fail closed
        return await _fail(ctx, reply_for(exc))
    if isinstance(admitted, KeyRefusal):
        ctx.metrics.key_refused(key, admitted.reason)
        return await _fail(ctx, _key_refusal(admitted))
    charge = _Charge(prompt=prompt)
    try:
        return await handler(ctx, scope, body, charge)
    finally:
        charge.left(ctx.meter)
        if charge.counts:  # as the quota counts it: a voided request (a 400) is not
            ctx.metrics.key_admitted(key)
        spent = charge.tokens
        if spent is None and charge.counts:
            spent = quotas.at_least(admitted, charge.prompt, charge.streamed)
        # Settling never raises and needs no checkpoint to finish (the memory backend
        # has none; Redis shields its round trip, bounded): a client that left still
        # returns its permit.
        await quotas.settle(admitted, attempted=charge.counts, tokens=spent)


def _json_type(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "an array" if isinstance(value, list) else "an object"


def _key_refusal(refusal: KeyRefusal) -> ErrorReply:
    if refusal.wait_s is None:
        message = (f"This request needs about {refusal.tokens} tokens, more than gateway key "
                   f"{refusal.name!r} may use in a minute (tpm {refusal.limit}).")
    else:
        unit = {"rpm": "requests a minute", "tpm": "tokens a minute",
                "in_flight": "calls at once"}.get(refusal.reason, "")
        message = (f"Gateway key {refusal.name!r} is over its {refusal.reason} limit "
                   f"({refusal.limit} {unit}); retry in {max(1, math.ceil(refusal.wait_s))} s.")
    return ErrorReply(429, message, "rate_limit_error", "rate_limit_exceeded",
                      retry_after_s=refusal.wait_s, final=refusal.wait_s is None)


def _parse_body(raw: bytes) -> dict[str, Any] | ErrorReply:
    if _nested_too_deeply(raw):
        return ErrorReply(
            400, f"The JSON body of your request is nested deeper than {MAX_DEPTH} levels.",
            "invalid_request_error", "invalid_json",
        )
    try:
        body = loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return ErrorReply(
            400, "We could not parse the JSON body of your request: it is not valid JSON.",
            "invalid_request_error", "invalid_json",
        )
    except ValueError:
        # Valid JSON, but an integer longer than Python reads (its 4,300-digit limit
        # on int(), a guard against quadratic-time conversion).
        return ErrorReply(
            400, "The JSON body of your request holds an integer too long to read "
            f"(more than {sys.get_int_max_str_digits()} digits).",
            "invalid_request_error", "invalid_json",
        )
    if not isinstance(body, dict):
        return ErrorReply(400, "The request body must be a JSON object.",
                          "invalid_request_error", "invalid_json")
    if _lone_surrogates(raw, body):
        return ErrorReply(
            400, "The JSON body of your request is not valid Unicode text: it holds a lone "
            "surrogate (an unpaired \\ud800-\\udfff escape).", "invalid_request_error",
            "invalid_json",
        )
    return body


#: A JSON escape of a UTF-16 surrogate (paired or not).
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogates(raw: bytes, body: Any) -> bool:
    """Whether the parsed body holds a lone surrogate, which no text encoding can
    carry upstream.  One can come only from a surrogate escape, or from bytes that
    are not strict UTF-8 (``json.loads`` decodes with ``surrogatepass``): a strict
    UTF-8 body without such an escape is checked in one scan, without a walk."""
    if (raw.isascii() or _is_utf8(raw)) and _SURROGATE_ESCAPE.search(raw) is None:
        return False
    try:
        return has_lone_surrogate(body)
    except RecursionError:  # nesting is not this check's concern
        return False


def _nested_too_deeply(raw: bytes) -> bool:
    """Whether the body nests deeper than the session takes its arguments
    (``MAX_DEPTH``: a body just under the recursion limit parsed, and the next walk of
    it answered 500), read as ``json.loads`` reads bytes (UTF-8, or the UTF-16/32 it
    detects)."""
    # Counted before decoding (nested_deeper counts again): every request passes here.
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except (UnicodeDecodeError, LookupError):
        return False  # not text: json.loads refuses it, a 400 as well
    return nested_deeper(text, MAX_DEPTH)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _bad_param(message: str, param: str) -> ErrorReply:
    return ErrorReply(400, message, "invalid_request_error", "invalid_request", param=param)


def _unknown_model(model: Any) -> ErrorReply:
    shown = model if isinstance(model, str) else json.dumps(model)
    return ErrorReply(
        404, f"The model `{shown[:200]}` does not exist: it is neither a scope nor an alias "
        "of this gateway (GET /v1/models lists them).",
        "invalid_request_error", "model_not_found",
    )


# --------------------------------------------------------------------------- answers


#: The statistics headers of an answer no call stands behind (a malformed request, a
#: wrong key, an unknown model): a client reads every JSON answer's the same way.
NO_CALL = [
    (b"x-polygate-source", b""), (b"x-polygate-attempts", b"0"),
    (b"x-polygate-hedges", b"0"), (b"x-polygate-cached", b"false"),
]


def _stats_headers(call_id: str, stats: CallStats | None) -> list[tuple[bytes, bytes]]:
    cid = (stats.logical_call_id if stats is not None else call_id).encode()
    headers = [(b"x-polygate-call-id", cid), (b"x-request-id", cid)]
    if stats is None:
        return [*headers, *NO_CALL]
    return [
        *headers,
        (b"x-polygate-source", (stats.source or "").encode()),
        (b"x-polygate-attempts", b"%d" % stats.attempts),
        (b"x-polygate-hedges", b"%d" % stats.hedges),
        (b"x-polygate-cached", b"true" if stats.cached else b"false"),
    ]


#: A JSON answer's header lines (_send_json with _stats_headers), in one formatting.
_ANSWER_FIELDS: Final = (
    b"content-type: application/json\r\nx-polygate-call-id: %s\r\nx-request-id: %s\r\n"
    b"x-polygate-source: %s\r\nx-polygate-attempts: %d\r\nx-polygate-hedges: %d\r\n"
    b"x-polygate-cached: %s\r\n"
)


async def _send_answer(ctx: Context, body: bytes, stats: CallStats) -> int:
    """``_send_json(ctx, 200, body, _stats_headers(call_id, stats))`` for a call's
    answer, byte for byte (tests/test_serve_http.py holds them together), its head
    written in one formatting instead of a list, a join and a value check a header:
    the numbers and the constant need none."""
    await ctx.conn.send_prepared(200, _answer_fields(stats), body, close=ctx.draining)
    return 200


def _answer_fields(stats: CallStats) -> bytes:
    cid = field_value(stats.logical_call_id.encode())
    return _ANSWER_FIELDS % (
        cid, cid, field_value((stats.source or "").encode()), stats.attempts, stats.hedges,
        b"true" if stats.cached else b"false")


async def _send_json(
    ctx: Context, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> int:
    if headers is None:  # no call behind it (/v1/models, the health checks)
        headers = _stats_headers(fresh_call_id(), None)
    await ctx.conn.send_response(status, [_JSON, *headers], body, close=ctx.draining)
    return status


async def _fail(
    ctx: Context, reply: ErrorReply, call_id: str | None = None, stats: CallStats | None = None
) -> int:
    headers = _stats_headers(call_id or fresh_call_id(), stats)
    await ctx.conn.send_response(
        reply.status, [*reply.headers(), *headers], reply.body(), close=ctx.draining
    )
    return reply.status


async def _stopped(ctx: Context, call_id: str) -> int:
    """The call's scope (``ctx.stop``) was cancelled: its client left (nothing to
    send: a 499), or a drain's grace period ended (the client is told why)."""
    if ctx.conn.client_gone:
        raise ClientGone
    # The call ran (its row is written as its cancellation unwound): its figures, as
    # any failed call's answer has them and /metrics counts them.
    meter = ctx.meter
    return await _fail(ctx, _SHUTDOWN, call_id, meter.stats if meter is not None else None)


async def answer_cut(conn: Connection) -> None:
    """Tell a request still arriving when a drain's grace period ended (its head or
    body not all here) what a call the drain cut is told: no call ran, and the
    connection closes (the rest of its body is never read)."""
    await conn.send_response(
        _SHUTDOWN.status, [*_SHUTDOWN.headers(), *_stats_headers(fresh_call_id(), None)],
        _SHUTDOWN.body(), close=True,
    )


async def _call_failed(
    ctx: Context, scope: str, call_id: str, exc: BaseException, charge: _Charge
) -> int:
    charge.failed(exc, ctx.meter)
    reply = reply_for(exc)
    if reply.status == 500:
        log_bug(log, exc, "answering a call", ctx.gateway.settings.secrets())
    stats: CallStats | None = getattr(exc, "call_stats", None)
    meter = ctx.meter
    if stats is None and isinstance(exc, ConfigError) and (meter is None or meter.stats is None):
        # Refused by the session's checks of its arguments before any call started:
        # no call (no telemetry row, nothing charged), as the server's own 400s.
        if meter is not None:
            meter.counted = True
    else:
        ctx.count_call(scope, stats, reply.code)
    return await _fail(ctx, reply, call_id, stats)


async def _chat(ctx: Context, scope: str, body: dict[str, Any], charge: _Charge) -> int:
    messages = body.pop("messages", None)
    if messages is None:
        return await _fail(ctx, _bad_param("you must provide a messages parameter", "messages"))
    stream = body.pop("stream", False)
    if stream is not None and type(stream) is not bool:  # 1 == True in Python, not in JSON
        return await _fail(ctx, _bad_param("stream must be true or false", "stream"))
    options = body.get("stream_options")
    if not stream:
        body.pop("stream_options", None)  # OpenAI accepts it only with stream: true
    elif options is not None:
        if not isinstance(options, dict):
            return await _fail(ctx, _bad_param("stream_options must be an object", "stream_options"))
        usage = options.get("include_usage")
        if usage is not None and type(usage) is not bool:  # "false" would read as true
            return await _fail(ctx, _bad_param(
                "stream_options.include_usage must be true or false",
                "stream_options.include_usage"))
    call_id = fresh_call_id()
    token = PRESET_CALL_ID.set(call_id)
    metered = ctx.start_call(scope, call_id)
    try:
        if stream:
            include_usage = bool(options and options.get("include_usage"))
            return await _chat_stream(ctx, scope, call_id, messages, body, include_usage, charge)
        with ctx.stop:
            try:
                charge.started = True
                response = await ctx.gateway.session.chat(messages, scope=scope, **body)
            except Exception as exc:
                return await _call_failed(ctx, scope, call_id, exc, charge)
        if ctx.stop.cancelled_caught:
            return await _stopped(ctx, call_id)
    finally:
        PRESET_CALL_ID.reset(token)
        CURRENT.reset(metered)
    stats = response.call_stats
    charge.answered(stats, response.usage)
    try:
        answer = dump(_answer_body(response))
    except Unencodable as exc:
        return await _unencodable(ctx, scope, call_id, exc, stats)
    ctx.count_call(scope, stats, "ok")
    return await _send_answer(ctx, answer, stats)


def _answer_body(response: ChatResponse) -> dict[str, Any]:
    """The upstream's body as the library validated it: its usage as read (none when
    it reported none or numbers the library refused), content that is not a string
    blanked, a missing or unreadable reason "stop", an ``id``, ``created`` and
    ``model`` of OpenAI's types (:func:`answer_header`), ``object`` a
    ``chat.completion``, a ``system_fingerprint`` or ``service_tier`` that is no string
    left out (as the stream's chunks leave it); every other field (a provider's
    extras) as the upstream sent it."""
    raw = response.raw
    out = dict(raw)
    out["id"], out["created"], out["model"] = answer_header(raw)
    out["object"] = "chat.completion"
    for key in KEPT_HEADER:
        if out.get(key) is not None and type(out[key]) is not str:
            del out[key]
    usage = reported_usage(response)
    if usage is None:
        out.pop("usage", None)
    else:
        out["usage"] = usage
    choices = raw.get("choices")
    if isinstance(choices, list):
        choices = string_content(choices, "message") or choices
        # The answer is complete (the library accepted it), so a choice whose reason
        # was missing or unreadable ended as the stream's finish chunk says: "stop".
        out["choices"] = [
            {**c, "finish_reason": "stop"} if type(c) is dict and not c.get("finish_reason") else c
            for c in choices]
    return out


async def _unencodable(
    ctx: Context, scope: str, call_id: str, exc: Unencodable, stats: CallStats | None
) -> int:
    """An answer that came but cannot be written as JSON: a 502, counted as such; the
    call's cost stands (the upstream did the work)."""
    reply = reply_for(exc)
    ctx.count_call(scope, stats, reply.code)
    return await _fail(ctx, reply, call_id, stats)


async def _chat_stream(
    ctx: Context, scope: str, call_id: str, messages: Any, params: dict[str, Any],
    include_usage: bool, charge: _Charge,
) -> int:
    """Forward the committed chunks as they come.  The response head goes out with
    the first chunk, or with the first keep-alive comment when the call is still
    waiting after ``sse_keepalive_s``; until then a failure is a plain HTTP error
    with its status, after it an SSE error event."""
    conn = ctx.conn
    interval = ctx.gateway.settings.serve.sse_keepalive_s
    shape = StreamShape()
    head_sent = False
    failure: BaseException | None = None

    def head() -> bytes:
        # (The caller marks it sent once its write has begun: a write cancelled before
        # any byte went out, a drain's, leaves the answer free to be a whole 503.)
        return conn.response_head(200, [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # proxies (nginx) must not buffer the stream
            (b"x-polygate-call-id", call_id.encode()),
            (b"x-request-id", call_id.encode()),
        ], close=ctx.draining)

    try:
        charge.started = True
        stream = ctx.gateway.session.stream_chat(messages, scope=scope, **params)
    except Exception as exc:  # arguments refused before the call started
        return await _call_failed(ctx, scope, call_id, exc, charge)
    with ctx.stop:
        async with stream:
            chunks = stream.__aiter__()
            done = False
            late: StreamChunk | None = None  # taken as its clock's keep-alive fell due
            # The last write (or a chunk about to be written): keep-alives count from it.
            wrote_at = trio.current_time()
            while not done:
                # One clock per quiet period, not a cancel scope per chunk: its deadline
                # is the keep-alive while waiting for a chunk (a write that waits for
                # the client has its own, the send timeout: Connection.finish_frame,
                # which no drain cuts mid-frame).  A write the kernel takes at once
                # (nearly all) leaves the clock alone: when it falls due with chunks
                # still flowing, nothing was quiet, and the next clock counts from the
                # last write.  (A scope costs ~5 µs; moving its deadline ~2 µs, which
                # was twice a chunk.)
                with trio.CancelScope(deadline=wrote_at + interval) as clock:
                    while True:
                        if late is not None:
                            chunk, late = late, None
                        else:
                            try:
                                chunk = await chunks.__anext__()
                            except StopAsyncIteration:
                                done = True
                                break
                            except Exception as exc:
                                failure = exc
                                done = True
                                break
                            if clock.cancel_called:
                                # The keep-alive fell due as the chunk came (it was
                                # ready: no checkpoint raised).  Moving the deadline
                                # cannot un-cancel this clock, so the chunk goes out
                                # under the next one; it keeps the stream alive too
                                # (the next clock counts from now).
                                late = chunk
                                wrote_at = trio.current_time()
                                break
                        # Chunks that arrived with this one go out in the same write:
                        # nothing waits for them, and a burst costs one send, not one
                        # per token.
                        frames: list[bytes] = []
                        try:
                            frames.append(conn.frame(shape.chunk(chunk)))
                            charge.streamed += chunk.text != ""
                            for ready in stream._ready(_BURST):
                                frames.append(conn.frame(shape.chunk(ready)))
                                charge.streamed += ready.text != ""
                        except Unencodable as exc:
                            # A NaN in a chunk: the stream ends with an error event,
                            # after the chunks of its burst that came before it.
                            failure = exc
                            done = True
                            if not frames:
                                break
                        out = head() if not head_sent else b""
                        # No scheduler pass after a write the kernel took whole: the
                        # next chunk is waited for (or taken) right after.
                        rest = await conn.write_first(out + b"".join(frames))
                        head_sent = True  # begun: no other head may follow
                        if rest:  # the client's buffer is full: bounded by the send timeout
                            await conn.finish_frame(rest)
                        wrote_at = trio.current_time()
                        if rest:
                            clock.deadline = wrote_at + interval
                        if done:  # (the burst's earlier chunks went out; then its error)
                            break
                if clock.cancelled_caught and trio.current_time() >= wrote_at + interval:
                    out = head() if not head_sent else b""  # quiet that long: a keep-alive
                    rest = await conn.write_first(out + conn.frame(KEEPALIVE))
                    head_sent = True
                    if rest:
                        await conn.finish_frame(rest)
                    wrote_at = trio.current_time()
    if ctx.stop.cancelled_caught:
        if not head_sent or conn.client_gone:
            return await _stopped(ctx, call_id)
        event = error_event(_SHUTDOWN.message, _SHUTDOWN.type, _SHUTDOWN.code)
        await conn.send(conn.frame(event) + conn.end())
        return _SHUTDOWN.status
    if failure is not None:
        try:
            if not head_sent:
                return await _call_failed(ctx, scope, call_id, failure, charge)
            charge.failed(failure, ctx.meter)
            reply = reply_for(failure)
            stats = getattr(failure, "call_stats", None)
            ctx.count_call(scope, stats, reply.code)
            await conn.send(conn.frame(error_event(reply.message, reply.type, reply.code)) + conn.end())
            return reply.status
        finally:
            # Its traceback holds this frame, whose local it is: a cycle only the
            # cyclic collector frees, with the connection, for every failed stream.
            failure = None
    response = stream.response
    assert response is not None
    charge.answered(response.call_stats, response.usage)
    try:
        ending = shape.ending(response, include_usage)
    except Unencodable as exc:
        if not head_sent:
            return await _unencodable(ctx, scope, call_id, exc, response.call_stats)
        reply = reply_for(exc)
        ctx.count_call(scope, response.call_stats, reply.code)
        await conn.send(conn.frame(error_event(reply.message, reply.type, reply.code)) + conn.end())
        return reply.status
    ctx.count_call(scope, response.call_stats, "ok")
    out = head() if not head_sent else b""
    await conn.send(out + conn.frame(ending) + conn.end())
    return 200


#: The most inputs one embeddings request may hold, as OpenAI's API says.  A client's
#: request is small and the answer is not: each input costs the gateway a vector of
#: the model's dimensions, held and then encoded in one piece (20,000 one-letter
#: inputs, a 100 KB request, made a 650 MB answer and held every other client's
#: request for seconds).  ``Session.embed()`` itself takes any number: its caller
#: holds the answer.
MAX_EMBEDDING_INPUTS = 2048


def _embedding_inputs(value: Any) -> list[str] | None:
    """A request's ``input`` as a non-empty list of strings, or ``None`` (a 400)."""
    inputs = [value] if isinstance(value, str) else value
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        return None
    return inputs


async def _embeddings(ctx: Context, scope: str, body: dict[str, Any], charge: _Charge) -> int:
    inputs = _embedding_inputs(body.pop("input", None))
    if inputs is None:
        return await _fail(ctx, _bad_param(
            "input must be a string or a non-empty array of strings "
            "(token arrays are not supported by this gateway)", "input"))
    if not all(inputs):
        return await _fail(ctx, _bad_param(
            "input must not hold an empty string: there is nothing to embed", "input"))
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        return await _fail(ctx, _bad_param(
            f"input holds {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} are accepted "
            "in one request (send the rest in further requests)", "input"))
    # The answer's encoding is the gateway's own (it reads either from the upstream and
    # writes the client's): not sent upstream, where a server that serves only floats
    # refuses base64 -- the OpenAI SDKs' default -- with a 400, and not in the cache
    # key, so an SDK's base64 and curl's float share the vectors they both ask for.
    encoding = body.pop("encoding_format", None)
    if encoding not in (None, "float", "base64"):
        return await _fail(ctx, _bad_param(
            "encoding_format must be 'float' or 'base64'", "encoding_format"))
    if "dimensions" in body and body["dimensions"] is None:
        # null is the default here, as OpenAI reads it; not sent upstream as null,
        # which a server that types the field (vLLM) refuses.
        del body["dimensions"]
    base64_out = encoding == "base64"
    call_id = fresh_call_id()
    token = PRESET_CALL_ID.set(call_id)
    metered = ctx.start_call(scope, call_id)
    try:
        with ctx.stop:
            try:
                charge.started = True
                response = await ctx.gateway.session.embed(inputs, scope=scope, **body)
            except Exception as exc:
                return await _call_failed(ctx, scope, call_id, exc, charge)
        if ctx.stop.cancelled_caught:
            return await _stopped(ctx, call_id)
    finally:
        PRESET_CALL_ID.reset(token)
        CURRENT.reset(metered)
    stats = response.call_stats
    # The key pays for what went upstream: not for inputs the cache (or another
    # request's flight) answered, as a whole cache hit costs it nothing.
    spent = response.upstream_usage
    charge.answered(stats, spent if spent is not None else response.usage)
    usage = response.usage
    try:
        data = [
            {"object": "embedding", "index": i, "embedding": _b64(v) if base64_out else v}
            for i, v in enumerate(response.vectors)
        ]
        payload: dict[str, Any] = {
            "object": "list", "data": data, "model": response.model or body.get("model")}
        if usage is not None and usage.source == "upstream":
            # As for chat: the library's estimate is for its own accounting, never a count.
            payload["usage"] = {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens}
        answer = dump(payload)
    except Unencodable as exc:  # a NaN or an infinity in a vector
        return await _unencodable(ctx, scope, call_id, exc, stats)
    ctx.count_call(scope, stats, "ok")
    return await _send_json(ctx, 200, answer, _stats_headers(call_id, stats))


def _b64(vector: list[float]) -> str:
    """A vector as OpenAI's base64 (little-endian float32).  A value that is not finite,
    or that float32 cannot hold (1e39 packs to infinity), is Unencodable: the answer
    would say a number the upstream never sent."""
    floats = array("f", vector)
    if not all(map(math.isfinite, floats)):
        raise Unencodable("a vector value is not finite as a 32-bit float")
    if sys.byteorder == "big":
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode()


#: How long a readiness verdict answers ``/readyz``: a probe needs no fresher one, and
#: the check reads the whole session's statistics (a round trip a source on Redis).
_READY_FRESH_S = 1.0


async def _readyz(ctx: Context) -> int:
    """Readiness, checked at most once a second however many ask: the path needs no
    key, and each check read every source's state (5.9 ms of the gateway's CPU with
    100 scopes of 10 sources, 45 times a /healthz), for anyone who can reach the port.
    One check at a time; the others wait for its verdict (bounded by its timeout)."""
    if ctx.state.draining:
        return await _send_json(ctx, 503, b'{"status":"draining"}')
    gateway = ctx.gateway
    async with gateway.ready_lock:
        verdict = gateway.ready
        if verdict is None or trio.current_time() - verdict[0] >= _READY_FRESH_S:
            status, body = await _ready_check(gateway)
            verdict = gateway.ready = (trio.current_time(), status, body)
    return await _send_json(ctx, verdict[1], verdict[2])


async def _ready_check(gateway: Gateway) -> tuple[int, bytes]:
    with trio.move_on_after(_READY_TIMEOUT_S):
        try:
            await gateway.session.statistics()  # reaches the governance backend
        except PolygateError as exc:
            return 503, dump({"status": "unavailable", "reason": reply_for(exc).code})
        return 200, b'{"status":"ready"}'
    return 503, b'{"status":"unavailable","reason":"backend_timeout"}'


async def _metrics(ctx: Context) -> int:
    stats = None
    with trio.move_on_after(_READY_TIMEOUT_S):
        try:
            stats = await ctx.gateway.session.statistics()
        except PolygateError:
            stats = None  # the gateway's own counters still go out
    body = await render(ctx.metrics, stats)
    cid = fresh_call_id().encode()
    await ctx.conn.send_response(
        200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
              (b"x-polygate-call-id", cid), (b"x-request-id", cid)], body, close=ctx.draining,
    )
    return 200
