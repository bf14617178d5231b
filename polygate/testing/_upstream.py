"""FakeUpstream: the script, the recorded requests and the in-flight accounting that
both faces share.

A face calls :meth:`FakeUpstream._open` when a request has arrived (it records the
request, picks the Reply and renders the plan) and :meth:`FakeUpstream._finish`
exactly once when the exchange is over, from a ``finally`` so that a cancelled or
disconnected client still brings ``in_flight`` back to zero.
"""

from __future__ import annotations

import inspect
import json
import random
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import attrs
import trio

from ._render import Exchange, Plan, error_reply, json_plan, models_payload, render
from ._script import Profile, Reply

if TYPE_CHECKING:
    import httpx

__all__ = ["Behaviour", "FakeUpstream", "Outcome", "RecordedRequest", "UpstreamStatistics"]

Outcome: TypeAlias = Literal["complete", "client_closed", "fault"]
#: What a name may hold: printable ASCII but '"' and '\\' (it goes into every answer's
#: id, in hand-built JSON, and into a header).
_NAME = re.compile(r'[ !#-\[\]-~]{1,200}')

_SECRET_HEADERS = frozenset({"authorization", "api-key", "x-api-key", "proxy-authorization"})


def _masked(headers: Mapping[str, str]) -> str:
    return repr({k: ("***" if k in _SECRET_HEADERS else v) for k, v in headers.items()})


@attrs.define
class RecordedRequest:
    """One request as the fake saw it.

    ``headers`` keep ``Authorization`` so tests can check a key was sent; the repr
    masks it, so a failing assertion never prints a secret.  ``outcome`` is
    ``None`` while the exchange is running, then ``"complete"`` (the whole answer,
    error statuses included, was delivered), ``"fault"`` (a scripted fault was
    delivered) or ``"client_closed"`` (the exchange ended early from outside: the
    client cancelled or closed, or the server was stopped).  ``started_at`` and
    ``ended_at`` come from ``trio.current_time()``; ``wall_started_at`` from
    ``time.time()`` (for checks across processes).
    """

    index: int
    method: str
    path: str
    body: Any
    headers: dict[str, str] = attrs.field(repr=_masked)
    started_at: float
    wall_started_at: float
    ended_at: float | None = None
    outcome: Outcome | None = None
    status: int | None = None
    reply: Reply | None = attrs.field(default=None, repr=False)
    #: The query string, without its ``?`` (``"api-version=2024-06-01"``: Azure's
    #: sources carry one in their URL), as sent: ``""`` when there is none.
    query: str = ""


@attrs.frozen
class UpstreamStatistics:
    """A snapshot of a FakeUpstream's counters.  ``faults``: scripted faults
    delivered; ``connections``: TCP connections the server face accepted (keep-alive
    reuse shows as fewer connections than requests; always 0 for the transport)."""

    requests: int
    completed: int
    client_closed: int
    faults: int
    in_flight: int
    peak_in_flight: int
    connections: int


#: A fixed Reply, a Profile, Replies consumed in order, or ``(request, rng) -> Reply``.
Behaviour: TypeAlias = (
    Reply | Profile | Sequence[Reply] | Callable[[RecordedRequest, random.Random], Reply]
)


def _check_callable(behaviour: object) -> None:
    """A behaviour callable's mistakes, named as it is made (each would otherwise fail
    every request: a class called with the request, a coroutine never awaited)."""
    if isinstance(behaviour, type):
        raise TypeError(f"a behaviour must be a Reply, a Profile or a callable (request, rng) -> "
                        f"Reply, got the class {behaviour.__name__} (an instance was meant?)")
    if not callable(behaviour):
        raise TypeError(f"unsupported behaviour: {behaviour!r}")
    mock = sys.modules.get("unittest.mock")  # (imported where a behaviour is a mock)
    if mock is not None and isinstance(behaviour, mock.NonCallableMock):
        # (A mock says what its spec says, and reads its own attributes as mocks: it is
        # the test's to make right; only an AsyncMock is known to be async.)
        if isinstance(behaviour, mock.AsyncMock):
            raise TypeError(_ASYNC)
        return
    try:
        is_async = inspect.iscoroutinefunction(behaviour) or inspect.iscoroutinefunction(
            type(behaviour).__call__)
    except Exception:  # (an odd callable: left to the call)
        is_async = False
    if is_async:
        raise TypeError(_ASYNC)
    try:
        signatures = [inspect.signature(behaviour), inspect.signature(behaviour, follow_wrapped=False)]
    except (TypeError, ValueError):  # (a builtin without one: left to the call)
        return
    for signature in signatures:
        try:
            signature.bind(None, None)
        except TypeError:
            continue
        return  # (a decorator's wrapper may take (request, rng) for what it wraps)
    raise TypeError(f"a behaviour callable takes (request, rng), and "
                    f"{getattr(behaviour, '__name__', behaviour)!r} takes {signatures[0]}")


_ASYNC = ("a behaviour callable must be a plain function (request, rng) -> Reply, not an async "
          "one: it is called as each request arrives")


class FakeUpstream:
    """A scripted, seeded, deterministic OpenAI-compatible upstream.

    ``behaviour`` decides the Reply of each chat or embedding request, in arrival
    order: a :class:`Reply` (always the same), a :class:`Profile` (drawn from the
    upstream's ``random.Random(seed)``), a sequence of Replies (one per request;
    when it runs out ``then`` takes over, or the last one repeats) or a callable
    ``(RecordedRequest, random.Random) -> Reply``.  Unknown paths (404) and bodies
    that are not JSON (400) are answered and recorded without consulting the
    script; ``GET …/_stats`` is neither.  Same seed and same request order give the
    same replies and the same bytes.

    ``requests`` keeps every RecordedRequest, or with ``history=N`` at least the
    latest N and fewer than 2N (for long benchmarks).  The counters stay exact; the
    ``request_times`` that ``/_stats`` lists are those of the kept requests, so
    memory stays bounded however many requests arrive.

    Two faces: :meth:`transport` (an httpx transport driven by trio time, for
    ``MockClock`` tests) and :meth:`serve` (a real HTTP/1.1 server on loopback).
    """

    def __init__(
        self,
        behaviour: Behaviour = Reply(),  # noqa: B008 - Reply is frozen
        *,
        seed: int = 0,
        name: str = "fake",
        then: Reply | Profile | None = None,
        embedding_dim: int = 8,
        history: int | None = None,
    ) -> None:
        if isinstance(behaviour, Sequence):
            if not behaviour or not all(isinstance(r, Reply) for r in behaviour):
                raise ValueError("a behaviour sequence must be a non-empty sequence of Replies")
            behaviour = tuple(behaviour)
        elif not isinstance(behaviour, Reply | Profile):
            _check_callable(behaviour)
        if then is not None and not isinstance(then, Reply | Profile):
            raise TypeError(f"then must be a Reply, a Profile or None, got {then!r}")
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be a whole number > 0, got {embedding_dim!r}")
        if history is not None and (isinstance(history, bool) or not isinstance(history, int)
                                    or history < 1):
            raise ValueError(f"history must be None or a whole number > 0, got {history!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            # (None would seed from the OS: a fake that is not the same twice.)
            raise TypeError(f"seed must be an int, got {seed!r}")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            # It goes into every answer's id (hand-built JSON) and x-request-id header.
            raise ValueError(
                f"name must be printable ASCII without '\"' or '\\\\' (it goes into ids and a "
                f"header), got {name!r}")
        self.name = name
        self.seed = seed
        self.embedding_dim = embedding_dim
        self.requests: list[RecordedRequest] = []
        self.history = history
        self.peak_in_flight = 0
        self.connections = 0
        self._behaviour = behaviour
        self._then = then
        self._cursor = 0
        self._rng = random.Random(seed)
        self._in_flight = 0
        self._started = 0
        self._outcomes: dict[Outcome, int] = {"complete": 0, "client_closed": 0, "fault": 0}

    def __repr__(self) -> str:
        return f"<FakeUpstream {self.name!r} seed={self.seed} requests={self._started}>"

    @property
    def in_flight(self) -> int:
        """Exchanges that have started and not yet ended."""
        return self._in_flight

    def statistics(self) -> UpstreamStatistics:
        return UpstreamStatistics(
            requests=self._started,
            completed=self._outcomes["complete"],
            client_closed=self._outcomes["client_closed"],
            faults=self._outcomes["fault"],
            in_flight=self._in_flight,
            peak_in_flight=self.peak_in_flight,
            connections=self.connections,
        )

    def transport(self) -> httpx.AsyncBaseTransport:
        """An httpx transport answering from this upstream (trio time only)."""
        from ._transport import FakeTransport

        return FakeTransport(self)

    @asynccontextmanager
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """Serve this upstream over HTTP/1.1 while the block runs; yields the base URL
        (``http://host:port/v1``).  Leaving the block stops the server and closes
        every connection."""
        from ._server import run_server

        async with run_server(self, host, port) as url:
            yield url

    def serve_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> ContextManager[str]:
        """:meth:`serve` for a test that is not in a trio run (asyncio, or synchronous):
        ``with upstream.serve_in_thread() as base_url:``.  The server runs in a trio run
        of its own, in a thread the block owns: it listens before the block starts, an
        error starting it is raised here, and leaving the block stops it and joins the
        thread.  A behaviour callable runs in that thread.  Read ``requests`` and the
        statistics from the test's thread: a request is recorded before its answer
        is sent, and an exchange counts as completed when the server has finished
        it, which may be just after the client has read the answer (all are final
        once the block is left)."""
        from ._thread import serve_in_thread

        return serve_in_thread(self, host, port)

    # ------------------------------------------------------------ used by the faces

    def _open(
        self, method: str, path: str, headers: dict[str, str], raw: bytes,
        *, failure_status: int | None = None, query: str = "",
    ) -> tuple[Plan, RecordedRequest | None]:
        """Record a request and decide its answer; ``None`` for ``/_stats``.  A script
        that fails raises; ``failure_status``: the status the face answers it with
        instead (the server's 500), recorded as that answer, delivered."""
        if path.endswith("/_stats"):
            return json_plan(200, self._stats_payload(), Exchange(0, self.name, path, None)), None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
            reply: Reply | None = error_reply(
                400,
                "We could not parse the JSON body of your request.",
                "invalid_request_error",
                None,
            )
        else:
            reply = None
        rec = RecordedRequest(
            index=self._started,
            method=method,
            path=path,
            body=body,
            headers=headers,
            started_at=trio.current_time(),
            wall_started_at=time.time(),
            query=query,
        )
        self._started += 1
        self.requests.append(rec)
        if self.history is not None and len(self.requests) >= 2 * self.history:
            del self.requests[: -self.history]
        self._in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        if method in ("GET", "HEAD") and path.endswith("/models"):
            # What an OpenAI client asks first (a health check, ``client.models.list()``):
            # the one model the fake answers as, unless its Reply names another.
            named = self._behaviour.model if isinstance(self._behaviour, Reply) else None
            rec.status = 200
            return json_plan(200, models_payload(named), Exchange(rec.index, self.name, path, None)), rec
        if method != "POST" or not path.endswith(("/chat/completions", "/embeddings")):
            reply = error_reply(
                404, f"Unknown path {path!r}.", "invalid_request_error", "unknown_url"
            )
        try:
            if reply is None:
                reply = self._pick(rec)
            rec.reply = reply
            rec.status = reply.status
            return render(
                reply, Exchange(rec.index, self.name, path, body, self.embedding_dim)
            ), rec
        except BaseException:
            # A broken script must not leave a request in flight.
            if failure_status is None:
                self._finish(rec, "fault")
            else:
                rec.status = failure_status
                self._finish(rec, "complete")
            raise

    def _finish(self, rec: RecordedRequest | None, outcome: Outcome) -> None:
        """End an exchange; only the first call for a request counts."""
        if rec is None or rec.outcome is not None:
            return
        rec.outcome = outcome
        rec.ended_at = trio.current_time()
        self._outcomes[outcome] += 1
        self._in_flight -= 1

    def _pick(self, rec: RecordedRequest) -> Reply:
        behaviour = self._behaviour
        if isinstance(behaviour, tuple):
            if self._cursor < len(behaviour):
                self._cursor += 1
                return behaviour[self._cursor - 1]
            if self._then is None:
                return behaviour[-1]
            behaviour = self._then
        if isinstance(behaviour, Reply):
            return behaviour
        if isinstance(behaviour, Profile):
            return behaviour.draw(self._rng, rec)
        assert callable(behaviour)
        reply = behaviour(rec, self._rng)
        if not isinstance(reply, Reply):
            raise TypeError(f"behaviour callable returned {reply!r}, not a Reply")
        return reply

    def _stats_payload(self) -> dict[str, Any]:
        payload = attrs.asdict(self.statistics())
        # Derived from the kept requests, not a second list: bounded by ``history`` too.
        payload["request_times"] = [r.wall_started_at for r in self.requests]
        return payload
