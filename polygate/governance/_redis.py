"""The Redis governance backend: one shared view of quotas, breakers, cooldowns, permits
and hedge budgets for every process that points at the same Redis.

Selected with ``Settings(backend="redis://host:port/db")`` (or ``rediss://`` for TLS,
``redis://user:password@…`` for ACL users).  Options ride in the query string::

    redis://10.0.0.5:6379/0?prefix=myapp&timeout_s=0.5&lease_s=15

Why it is built the way it is:

**One script per operation.**  Every :class:`GovernanceBackend` method runs as one Lua
script (:mod:`._redis_scripts`), loaded once at session start and called by SHA
(``EVALSHA``; after ``NOSCRIPT`` — a restarted or flushed Redis — it is loaded again
and called once more).  A script is atomic, so two processes can never interleave
between a check and its update; time inside scripts is the server's ``TIME``.  Server
instants in replies (``retry_at``, ``cooldown_until``) are turned into this process's
trio clock as ``local_now + (server_instant - server_now)``, with ``local_now`` read
when the reply arrives, so a wait errs late, never early.

**Fail closed, within a bound.**  Each operation answers or raises
:class:`~polygate.GovernanceBackendError` within ``timeout_s`` (default 1 s): the call is
never sent upstream unadmitted.  coredis reconnects on the next command, so once Redis
is back calls succeed again without restarting anything.  An admission that was sent
but not answered in time may still run on a Redis that was only slow; it is *abandoned*
and voided (settled as never sent, which is idempotent) as soon as Redis answers again,
so its permit is not left to the lease.

**Atomic against cancellation, like the memory backend.**  The memory backend has no
checkpoint inside an operation, so a cancelled caller either never started one or saw it
complete.  Here an operation is a network round trip, so each runs in a
``CancelScope(shield=True)`` whose deadline is the operation's bound: once a script is
sent, its reply is read — a granted admission always reaches the caller, which settles
it — and a cancellation waits for at most ``timeout_s``.  ``admit`` first checks for a
pending cancellation, so a cancelled caller sends nothing, and its bound is also the
caller's deadline (one unanswered then is abandoned, as above).  ``settle`` runs in the
attempt's ``finally``, often inside a cancelled scope (a hedge loser, a call deadline):
it is cleanup that must not be lost, so it is shielded too, and retried (backing off
from 20 ms) for up to ``settle_s`` (default ``timeout_s``).  If it still fails the
response is returned anyway; the failure is counted in :meth:`statistics` and logged,
and the lease (below) returns the permit.  So a call deadline can be overrun by at most
the longer of ``timeout_s`` (the first try's bound) and ``settle_s`` while a broken Redis
is being given up on.

**Leases.**  A permit is a lease that expires ``lease_s`` (default 15 s) after it was
last renewed.  The backend remembers its open admissions and a background task renews
them every ``lease_s / 3`` in one script per source; a crashed process stops renewing,
and any script touching that source then returns the permit and settles the
reservation as a cancelled attempt's (the estimate stays in the window).  A process
that cannot reach Redis for longer than ``lease_s`` loses its leases the same way
(counted as ``leases_lost``); the in-flight bound holds as long as holders can renew.

**Waiting.**  There is no cross-process push: settles bump a change counter
(``P:changes``), and while some task waits for admission one background task per
backend reads it every ``poll_s`` (default 50 ms) and wakes the waiters when it moved.
Local settles wake local waiters at once.  A waiter also re-checks at least every
second, which is how it notices leases expiring.  Idle, the backend sends nothing but
lease renewals.

**Keys** (``P`` = ``prefix``, default ``polygate``): ``P:{scope}:{source}:state |
window | wtok | open | permits | lapsed``, ``P:{scope}:budget`` and ``P:changes``.  Every key
has a TTL: the window keys live one window past their last admission, the others
``key_ttl_s`` (default one day, and at least as long as a running cooldown or an open
breaker) past their last write; so idle sources and scopes vanish by themselves.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import re
import secrets
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import attrs
import trio

from .._config import mask_url
from .._coredis import closing_connection_class, import_coredis, server_words
from .._errors import ConfigError, GovernanceBackendError
from .._outage import OUTAGE_LOG
from .._redis_url import SHARED_OPTIONS, check_tls_options, client_tls, redis_address, shared_option
from .._secrets import frameless
from . import _redis_scripts as lua
from ._memory import WINDOW_S
from ._model import (
    Admission,
    AdmitRequest,
    BreakerState,
    Feedback,
    Refusal,
    RefusalReason,
    SettleRequest,
    SourceSnapshot,
)

__all__ = ["RedisBackend", "RedisBackendStatistics", "RedisOptions", "parse_redis_url"]

log = logging.getLogger("polygate.governance.redis")
T = TypeVar("T")

_BREAKER = {"c": BreakerState.CLOSED, "o": BreakerState.OPEN, "h": BreakerState.HALF_OPEN}
_REASONS = {r.value: r for r in RefusalReason}
_FEEDBACK = {Feedback.SUCCESS: "s", Feedback.FAILURE: "f", Feedback.NEUTRAL: "n"}
_FLOAT_OPTIONS = {
    "timeout_s": (0.01, 60.0),
    "settle_s": (0.0, 60.0),
    "lease_s": (0.3, 86400.0),
    "poll_s": (0.005, 10.0),
    "key_ttl_s": (60.0, 365 * 86400.0),
}


@attrs.frozen
class RedisOptions:
    """A parsed backend URL.  ``repr`` and :meth:`where` never show the password."""

    host: str
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ssl: bool = False
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: str | None = None
    prefix: str = "polygate"
    timeout_s: float = 1.0
    settle_s: float | None = None  # None: timeout_s
    lease_s: float = 15.0
    poll_s: float = 0.05
    key_ttl_s: float = 86400.0

    def where(self) -> str:
        scheme = "rediss" if self.ssl else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{host}:{self.port}/{self.db}"


def parse_redis_url(url: str) -> RedisOptions:
    """``redis://[user[:password]@]host[:port][/db][?option=value&…]`` → options.

    Raises :class:`ConfigError` naming the problem; the message never holds the password.
    """
    shown = mask_url(url) if isinstance(url, str) else repr(url)
    if not isinstance(url, str):
        raise ConfigError(f"backend: expected a redis:// URL, got {shown}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"backend: {shown!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"backend: unknown scheme in {shown!r}: expected redis:// or rediss://")
    address = redis_address(shown, parts, port, say="backend: ")
    options: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in _FLOAT_OPTIONS:
            lo, hi = _FLOAT_OPTIONS[name]
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not lo <= number <= hi:
                raise ConfigError(f"backend: option {name} must be a number in [{lo}, {hi}], got {value!r}")
            options[name] = number
        elif not shared_option(options, name, value, say="backend: "):
            known = ", ".join(sorted([*_FLOAT_OPTIONS, *SHARED_OPTIONS]))
            raise ConfigError(f"backend: unknown option {name!r} in the redis URL (known: {known})")
    check_tls_options(parts.scheme, options, say="backend: ")
    if options.get("poll_s", 0.05) * 3 > options.get("lease_s", 15.0):
        raise ConfigError("backend: poll_s must be well below lease_s")
    return RedisOptions(**address, **options)


@attrs.frozen
class RedisBackendStatistics:
    """What this process's Redis backend had to give up on (never a secret, never a key)."""

    open_leases: int  # admissions of this process not yet settled
    settle_failures: int  # settles given up after retrying (their lease returns the permit)
    settle_retries: int
    leases_lost: int  # leases that ran out before this process renewed them
    renew_failures: int
    refill_failures: int  # hedge-budget refills skipped or failed (best effort)
    abandoned: int  # admissions whose answer never came: voided once Redis answers again
    abandoned_voided: int  # of those, granted after all and then voided


@attrs.frozen
class _Script:
    name: str
    source: str
    #: Whether running it twice does what running it once does (ADMIT per member,
    #: SETTLE per reservation); the hedge budget's take and refill do not.
    idempotent: bool = True
    sha: str = attrs.field(kw_only=True)

    @sha.default
    def _sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


_ADMIT = _Script("admit", lua.ADMIT)
_SETTLE = _Script("settle", lua.SETTLE)
_SNAPSHOT = _Script("snapshot", lua.SNAPSHOT)
_RENEW = _Script("renew", lua.RENEW)
_TAKE = _Script("budget_take", lua.BUDGET_TAKE, idempotent=False)
_REFILL = _Script("budget_refill", lua.BUDGET_REFILL, idempotent=False)
_LEVEL = _Script("budget_level", lua.BUDGET_LEVEL)
#: Redis refusing a script command, quoted as the command refused ("no permissions to
#: run the 'script|load' command", "unknown command 'SCRIPT'").  Not any mention of
#: scripts: BUSY's reply names one, and Redis 7.2's NOPERM names the ACL user.
_SCRIPT_REFUSED = re.compile(r"'(?:script|eval)[^']*'", re.IGNORECASE)
#: ... or scripting said to be off, in a reply that is not an ACL's (no user named).
_SCRIPTING_OFF = re.compile(r"\bscripting\b", re.IGNORECASE)

_PROBE = _Script("probe", lua.PROBE)
_PERMITS = _Script("permits", lua.PERMITS)
#: Abandoned admissions remembered at most (a long hang behind a proxy that accepts
#: and never answers adds one per call): past it, the oldest is left to its lease.
_MAX_ABANDONED = 10_000
#: What a closing session gives its last void round (a Redis that answers does so
#: in a millisecond; a hung one is not waited for longer).
_CLOSE_VOID_S = 0.25
_SCRIPTS = (_ADMIT, _SETTLE, _SNAPSHOT, _RENEW, _TAKE, _REFILL, _LEVEL, _PROBE, _PERMITS)


def _coredis() -> Any:
    return import_coredis("the redis backend")


def _us(seconds: float) -> int:
    """A period for a script, in microseconds.  Capped at 1e15 s (~31.7 million years,
    the cap the scripts' TTLs use): ``int(1e303 * 1e6)`` is an OverflowError, and a
    valid setting must not fail every admission."""
    return int(min(seconds, 1e15) * 1e6)


class RedisBackend:
    """Governance state shared by every process that uses the same Redis and prefix.

    Use it through a session (``Settings(backend="redis://…")``); standalone, call
    :meth:`start` first and :meth:`aclose` at the end, in the same task.
    ``window_s`` exists for tests: quotas are per minute.
    """

    def __init__(self, options: RedisOptions, *, window_s: float = WINDOW_S, recheck_s: float = 1.0) -> None:
        self.options = options
        self._where = options.where()
        self._timeout = options.timeout_s
        self._settle_s = options.settle_s if options.settle_s is not None else options.timeout_s
        self._lease_us = int(options.lease_s * 1e6)
        self._window_us = int(window_s * 1e6)
        self._ttl_ms = int(options.key_ttl_s * 1000)
        self._recheck_s = recheck_s
        self._token = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._keys: dict[tuple[str, str], list[str]] = {}
        self._open: dict[tuple[str, str], set[str]] = {}
        self._changed = trio.Event()
        self._has_waiters = trio.Event()
        self._waiting = 0
        self._version: bytes | None = None
        self._healthy = True
        self._client: Any = None
        self._errors: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._last_warning: dict[str, float] = {}
        self._settle_failures = 0
        self._settle_retries = 0
        self._leases_lost = 0
        self._renew_failures = 0
        self._refill_failures = 0
        #: Admissions sent but not answered: when an answering Redis was first seen
        #: after each (``None``: not yet), from which its lease is counted -- one that
        #: runs late, on a Redis that was hung, runs with a lease from then.
        self._abandoned: dict[tuple[str, str, str], float | None] = {}
        #: Settles that Ctrl-C cut before their answer, with their arguments: sent as
        #: the session closes (settle_left), else their leases return their permits.
        self._unsettled: dict[tuple[tuple[str, str], str], list[Any]] = {}
        #: The last exchange found no Redis (no answer, no connection; an error reply
        #: is an answer): its next success wakes the void loop at once.
        self._unreachable = False
        self._abandoned_total = 0
        self._abandoned_voided = 0
        self._cleanup = trio.Event()
        # Set by aclose(): an operation after it fails at once, never touching the
        # closed client (a call that outlived its session: see aclose).
        self._closed = False
        self._cap: float | None = None  # (see bounded())

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisBackend:
        """Parse ``url`` (:func:`parse_redis_url`) and check that coredis is installed."""
        options = parse_redis_url(url)
        del url  # (a ConfigError's frames would show it, its password too: see frameless)
        _coredis()
        return cls(options, **kwargs)

    def __repr__(self) -> str:
        return f"<RedisBackend {self._where} prefix={self.options.prefix!r}>"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect, check credentials and Lua, load the scripts, start renewing leases.

        Raises :class:`GovernanceBackendError` with a message that names the server
        (never the password) when any of it fails; nothing is left running then.
        """
        if self._stack is not None:
            raise RuntimeError("this RedisBackend is already started")
        coredis = _coredis()
        self._errors = coredis.exceptions
        opts = self.options
        ssl_kw = client_tls(opts.ssl, opts.ssl_ca_certs, opts.ssl_cert_reqs, log=log,
                            where=f"backend {opts.host}:{opts.port}",
                            exposed="the Redis password and every admission")
        # coredis's own timeouts are shorter than an operation's bound, so a stuck
        # connect or read fails inside coredis (which then recycles the connection)
        # rather than being cut off by the bound.
        self._client = coredis.Redis(
            host=opts.host, port=opts.port, db=opts.db, username=opts.username,
            password=opts.password, connect_timeout=self._timeout * 0.3,
            stream_timeout=self._timeout * 0.6, pool_timeout=self._timeout,
            # (No client name: coredis would send CLIENT SETNAME at each connection and
            # fail it where an ACL or rename-command refuses CLIENT, a common hardening.)
            retry_policy=coredis.retry.NoRetryPolicy(), **ssl_kw,
        )
        self._client.connection_pool.connection_class = closing_connection_class(coredis)
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(self._client)
            await self._load_scripts()
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self._renew_loop)
            self._nursery.start_soon(self._poll_loop)
            self._nursery.start_soon(self._void_loop)
        except BaseException:
            self._nursery = None
            await stack.aclose()  # no cancel scope around it: it exits scopes entered above
            raise
        self._stack = stack

    async def _load_scripts(self) -> None:
        for script in _SCRIPTS:
            source = script.source

            async def load(source: str = source) -> Any:
                return await self._client.script_load(source)

            try:
                sha = await self._run(load, "SCRIPT LOAD")
            except GovernanceBackendError as exc:
                named = self._refused_at_start(exc, "SCRIPT LOAD")
                if named is exc:
                    raise
                raise named from None
            if _text(sha) != script.sha:
                raise self._error(
                    f"redis at {self._where} answered SCRIPT LOAD with an unexpected digest"
                )
        try:
            now = await self._script(_PROBE, [], [], "probe")
        except GovernanceBackendError as exc:
            named = self._refused_at_start(exc, "the probe script (EVALSHA)", first=False)
            if named is exc:
                raise
            raise named from None
        if not isinstance(now, int) or now <= 0:
            raise self._error(f"redis at {self._where} gave no usable TIME to scripts")
        try:
            refused = _text(await self._script(
                _PERMITS, [f"{self.options.prefix}:permits-check"], [], "permits check"))
        except GovernanceBackendError:
            refused = ""  # (OOM, a replica: said as at any admission, not here)
        if refused:
            # Said now, by name: found at the first admission, it was a script refused
            # half-way ("on @user_script:293"), its writes before it left in Redis.
            raise self._error(
                f"redis at {self._where}: this user may not run {refused.upper()}, which the "
                "redis backend's scripts call (docs/distributed.md gives the ACL line)"
            )

    def _refused_at_start(
        self, exc: GovernanceBackendError, what: str, *, first: bool = True
    ) -> GovernanceBackendError:
        """A start-up exchange's refusal, named: Lua's only when Redis refused a
        script command (a user denied ``@scripting``, ``SCRIPT`` renamed away), not for
        any words about scripts (``BUSY``: another client's script runs long)."""
        cause = exc.__cause__
        errors = self._errors
        if not isinstance(cause, errors.ResponseError) or isinstance(
            cause, errors.AuthenticationError  # (named by _run: the credentials)
        ):
            return exc
        words = str(cause)
        if _SCRIPT_REFUSED.search(words) or (
            not isinstance(cause, errors.AuthorizationError) and _SCRIPTING_OFF.search(words)
        ):
            return self._error(
                f"redis at {self._where} does not run Lua scripts, which the redis "
                f"backend needs ({what} refused: {self._clean(cause)})"
            )
        if not first:
            return self._error(f"redis at {self._where} refused {what}: {self._clean(cause)}")
        # The connection's set-up (AUTH, SELECT of the db) answers with the first
        # command, and its refusal is not Lua's: a db index out of range, SELECT
        # denied by an ACL.  (No PING first: a least-privilege ACL user may lack it.)
        return self._error(
            f"redis at {self._where} refused the connection's set-up or {what}: "
            f"{self._clean(cause)}"
        )

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
            self._nursery = None
        try:
            await self.settle_left()
        finally:
            # Whatever cut the settling short (Ctrl-C, which no shield holds back): the
            # scopes start() entered in this task are exited, in reverse order, or the
            # run would end with its nursery still open.
            self._closed = True
            await stack.aclose()

    @contextlib.contextmanager
    def bounded(self, deadline: float) -> Iterator[None]:
        """Within the block, no exchange waits past ``deadline`` (each is shielded on
        its own: an outer scope's deadline would not reach it)."""
        self._cap = deadline
        try:
            yield
        finally:
            self._cap = None

    async def settle_left(self) -> None:
        """Calls still running as the session closes (in tasks outside its block: the
        caller's mistake) would hold their permits, shared with every process, until
        their leases ran out, and retry their settles against a closed client past
        their deadlines.  Each is settled here, as a cancelled attempt is (its
        estimate kept, its permit returned, nothing fed to the breaker), within one
        ``timeout_s`` in all; their own settles later are no-ops.  Then the abandoned
        admissions left (:meth:`_void_left`): both before the session freezes its
        figures."""
        await self._settle_open()
        await self._void_left()

    async def _settle_open(self) -> None:
        left: list[tuple[tuple[str, str], str, list[Any] | None]] = [
            (key, member, None) for key, members in self._open.items() for member in members
        ]
        left += [(key, member, args) for (key, member), args in self._unsettled.items()]
        if not left:
            return
        self._open.clear()
        self._unsettled.clear()
        settled = 0
        deadline = trio.current_time() + self._timeout
        with trio.CancelScope(shield=True, deadline=deadline), self.bounded(deadline):
            for key, member, given in left:
                # (sent, the estimate kept: tokens None; neutral: no breaker feedback)
                cancelled = SettleRequest(Admission(*key, 0, 0), None, Feedback.NEUTRAL)
                args = given if given is not None else self._settle_args(member, cancelled)
                try:
                    await self._script(_SETTLE, self._source_keys(key), args, "settle")
                except GovernanceBackendError:
                    break
                settled += 1
        if settled < len(left):
            log.warning("closing with %d unsettled admission(s); their leases expire in %.0f s",
                        len(left) - settled, self._lease_us / 1e6)

    async def _void_left(self) -> None:
        """The abandoned admissions still unvoided as the session closes: one round
        (a probe first), within :data:`_CLOSE_VOID_S`, or a late one runs on with its
        permit until its lease ends.  Run before the session freezes its figures, so
        that they say what the close left in Redis."""
        if not self._abandoned:
            return
        deadline = trio.current_time() + min(self._timeout, _CLOSE_VOID_S)
        with trio.CancelScope(shield=True, deadline=deadline), self.bounded(deadline):
            try:
                await self._script(_PROBE, [], [], "probe")
                await self._void_abandoned()
            except GovernanceBackendError:
                pass  # not answering: a close does not wait longer for it
            except Exception:
                log.exception("voiding abandoned redis admissions failed")
        self._abandoned.clear()  # once: what is left now is left to its lease

    def now(self) -> float:
        return trio.current_time()

    def statistics(self) -> RedisBackendStatistics:
        return RedisBackendStatistics(
            open_leases=sum(len(m) for m in self._open.values()),
            settle_failures=self._settle_failures,
            settle_retries=self._settle_retries,
            leases_lost=self._leases_lost,
            renew_failures=self._renew_failures,
            refill_failures=self._refill_failures,
            abandoned=self._abandoned_total,
            abandoned_voided=self._abandoned_voided,
        )

    # ------------------------------------------------------------------ operations

    async def admit(self, request: AdmitRequest) -> Admission | Refusal:
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled: send nothing
        rid = next(self._ids)
        member = f"{self._token}:{rid}"
        limits = request.limits
        args = [
            member, request.tokens, _opt(limits.rpm), _opt(limits.tpm), _opt(limits.max_in_flight),
            _us(request.breaker.open_s), self._lease_us, self._window_us, self._ttl_ms,
        ]
        key = (request.scope, request.source)
        sent: list[bool] = []
        # The caller's deadline (the call's) bounds the wait as well: an admission is
        # part of the call.  One sent but unanswered by then is abandoned below, as is
        # one that timed out.
        deadline = trio.current_effective_deadline()
        try:
            reply = await self._script(
                _ADMIT, self._source_keys(key), args, "admit", deadline=deadline, sent=sent)
        except GovernanceBackendError as exc:
            # An error reply (OOM, READONLY, a wrong password) is an answer: the script
            # was refused at its first write, or did not run.  Only an admission whose
            # answer never came may be granted all the same (a hung Redis runs it later):
            # void it once Redis answers again, rather than leave its permit to the lease.
            if sent and not isinstance(exc.__cause__, self._errors.ResponseError):
                self._abandon(request.scope, request.source, member)
            # Cut at the caller's deadline: its cancellation, due now, says so.
            await trio.lowlevel.checkpoint_if_cancelled()
            raise
        except KeyboardInterrupt:
            # Ctrl-C, which no shield holds back, cut the wait for the answer: one sent
            # may have been granted.  Voided as the session closes (settle_left), or by
            # the void loop before, rather than left to its lease.
            if sent:
                self._abandon(request.scope, request.source, member)
            raise
        local_now = trio.current_time()
        try:
            if reply[0] == 1:
                self._open.setdefault(key, set()).add(member)
                self._observe(reply[3])
                return Admission(request.scope, request.source, rid, request.tokens, reply[1] == 1)
            said = _text(reply[1])
            sooner = said == "tpm_open"  # a TPM window with admissions open
            reason = RefusalReason.TPM if sooner else _REASONS[said]
            retry_at = None if reply[2] < 0 else local_now + (reply[2] - reply[3]) / 1e6
            self._observe(reply[4])
        except (TypeError, ValueError, IndexError, KeyError, AttributeError):
            raise self._garbage("admit") from None
        return Refusal(request.source, reason, retry_at, sooner=sooner)

    def _abandon(self, scope: str, source: str, member: str) -> None:
        """An admission sent whose answer never came: voided by the void loop."""
        if len(self._abandoned) >= _MAX_ABANDONED:  # a long hang: the oldest go
            del self._abandoned[next(iter(self._abandoned))]
        self._abandoned[(scope, source, member)] = None
        self._abandoned_total += 1
        self._cleanup.set()  # the void loop's timer starts (see _void_loop)

    async def settle(self, request: SettleRequest) -> None:
        """Shielded and retried for up to ``settle_s``; never raises (see the module)."""
        if self._closed:
            return  # settled by aclose() (see settle_left), or left to its lease
        admission = request.admission
        key = (admission.scope, admission.source)
        member = f"{self._token}:{admission.reservation_id}"
        held = self._open.get(key)
        if held is not None:
            held.discard(member)  # before sending: a renewal must not race the settle
        args = self._settle_args(member, request)
        keys = self._source_keys(key)
        # The first try has any exchange's bound (timeout_s); settle_s is how long it
        # is retried after that -- were it the first try's bound too, settle_s=0 would
        # cut every settle before its answer, counted as failed although Redis ran it.
        started = trio.current_time()
        retry_until = started + self._settle_s
        done = False
        error: GovernanceBackendError | None = None
        try:
            with trio.CancelScope(shield=True, deadline=max(retry_until, started + self._timeout)):
                delay = 0.02
                first = True
                while True:
                    try:
                        reply = await self._script(
                            _SETTLE, keys, args, "settle", deadline=None if first else retry_until)
                        self._observe(reply[2])
                        done = True
                        break
                    except GovernanceBackendError as exc:
                        error = exc
                    except (TypeError, IndexError):
                        error = self._garbage("settle")
                    first = False
                    if self._closed:
                        # Closed meanwhile: settled by the close (settle_left) if it
                        # still held it, else left to its lease; no retry can reach
                        # Redis now.
                        return
                    if trio.current_time() + delay >= retry_until:
                        break
                    self._settle_retries += 1
                    await trio.sleep(delay)
                    delay = min(delay * 2, 0.25)
        except KeyboardInterrupt:
            # Ctrl-C, which no shield holds back, cut it before its answer: sent again
            # as the session closes (a settle is idempotent), or its lease returns it.
            if not done and not self._closed:
                self._unsettled[(key, member)] = args
            raise
        if not done:
            self._settle_failures += 1
            self._warn(
                "settle",
                f"could not settle an admission of {admission.scope}/{admission.source} "
                f"({error or 'gave up'}); its lease returns the permit within "
                f"{self._lease_us / 1e6:.0f} s ({self._settle_failures} settle failure(s) so far)",
            )
        self._notify()

    def _settle_args(self, member: str, request: SettleRequest) -> list[Any]:
        policy = request.breaker
        cooldown = request.cooldown_s if request.cooldown_s is not None and request.cooldown_s > 0 else 0.0
        return [
            member, 1 if request.sent else 0, -1 if request.tokens is None else request.tokens,
            _FEEDBACK[request.feedback], _us(cooldown), 1 if request.dead else 0,
            policy.failures, repr(float(policy.failure_rate)), policy.rate_window,
            policy.rate_min_calls, self._window_us, self._ttl_ms,
            _us(policy.open_s), _us(policy.max_open_s), policy.probes,
            repr(float(request.jitter)),
        ]

    async def snapshot(self, scope: str, source: str) -> SourceSnapshot:
        await trio.lowlevel.checkpoint_if_cancelled()
        # Unshielded: a read (its purge and expiry are upkeep every script repeats), so
        # whoever reads may stop waiting: a /metrics or /readyz scrape bounded to 2 s
        # waited out timeout_s on a hung Redis, past Prometheus's own scrape timeout.
        reply = await self._script(
            _SNAPSHOT, self._source_keys((scope, source)), [self._window_us, self._ttl_ms], "snapshot",
            shield=False,
        )
        local_now = trio.current_time()
        try:
            now, br, cf, in_flight, requests, tokens, reserved, cu, du, rt, st, rl, ct, ad, _lx, ou = reply
            cooling = cu > now
            breaker = _BREAKER[_text(br)]
            return SourceSnapshot(
                scope=scope, source=source, breaker=breaker,
                consecutive_failures=int(cf), in_flight=int(in_flight),
                requests_in_window=int(requests), tokens_in_window=int(tokens),
                tokens_reserved=int(reserved),
                cooldown_until=local_now + (cu - now) / 1e6 if cooling else None,
                dead=du > now, reserved_total=int(rt), settled_total=int(st),
                released_total=int(rl), cost_total=int(ct), admissions=int(ad),
                breaker_open_until=(
                    local_now + (ou - now) / 1e6 if breaker is BreakerState.OPEN else None
                ),
            )
        except (TypeError, ValueError, KeyError, AttributeError):
            raise self._garbage("snapshot") from None

    async def budget_take(self, scope: str, burst: float) -> bool:
        # No cancellation check here: a token taken must be known, so that a hedge
        # that is then not launched (the call decided or cancelled) gives it back.
        reply = await self._script(_TAKE, [self._budget_key(scope)], [repr(float(burst)), self._ttl_ms], "budget_take")
        try:
            return bool(reply[0] == 1)
        except (TypeError, IndexError):
            raise self._garbage("budget_take") from None

    async def budget_refill(self, scope: str, amount: float, burst: float) -> None:
        """Best effort, shielded (it runs in a call's ``finally``) and never raises: a
        lost refill only makes hedging a little more conservative.  Skipped while the
        last operation failed, so a dead Redis does not add a timeout to every call."""
        if not self._healthy:
            self._refill_failures += 1
            return
        try:
            await self._script(
                _REFILL, [self._budget_key(scope)],
                [repr(float(burst)), self._ttl_ms, repr(float(amount))], "budget_refill",
            )
        except GovernanceBackendError as exc:
            self._refill_failures += 1
            self._warn("refill", f"hedge budget refill failed: {exc}")

    async def budget_level(self, scope: str, burst: float) -> float:
        await trio.lowlevel.checkpoint_if_cancelled()
        reply = await self._script(_LEVEL, [self._budget_key(scope)], [repr(float(burst)), self._ttl_ms],
                                   "budget_level", shield=False)  # (a read, as snapshot's)
        try:
            return float(_text(reply))
        except (TypeError, ValueError, AttributeError):
            raise self._garbage("budget_level") from None

    def change_mark(self) -> trio.Event:
        return self._changed

    async def wait_changed(self, deadline: float, mark: trio.Event | None = None) -> None:
        changed = mark if mark is not None else self._changed
        self._waiting += 1
        self._has_waiters.set()
        try:
            with trio.move_on_at(min(deadline, trio.current_time() + self._recheck_s)):
                await changed.wait()
        finally:
            self._waiting -= 1

    # ------------------------------------------------------------------ background

    async def _poll_loop(self) -> None:
        """While someone waits, read the change counter every ``poll_s``."""
        key = f"{self.options.prefix}:changes"
        while True:
            if self._waiting == 0:
                self._has_waiters = trio.Event()
                await self._has_waiters.wait()
            try:
                value = await self._run(lambda: self._client.get(key), "poll")
                self._observe(value if value is not None else b"0")
            except GovernanceBackendError:
                self._notify()  # let the waiters find out for themselves, and fail
            except Exception:  # a bug: log it, never let it tear down the session
                log.exception("redis change poller failed")
            await trio.sleep(self.options.poll_s)

    async def _renew_loop(self) -> None:
        """Extend this process's leases every ``lease_s / 3``."""
        while True:
            await trio.sleep(self.options.lease_s / 3)
            try:
                await self._renew_all()
            except Exception:
                log.exception("redis lease renewal failed")

    async def _void_loop(self) -> None:
        """Void abandoned admissions once Redis answers again.

        An admission whose answer timed out may still run on a Redis that was only
        slow: its permit and window entry would then be held by nobody until the
        lease ran out.  Voiding (settle, never sent) is idempotent.  While any is
        left, this loop tries on its own timer -- from ``poll_s``, doubling up to a
        second -- and at once when an exchange succeeds after failures: each round
        first checks that Redis answers (the probe script, which needs no command
        beyond the others'), since a void sent into a hung Redis would run unseen,
        then voids; again while a void finds nothing (the late admission may not
        have run yet), until the lease would have expired it anyway.  (Waiting for
        another exchange to succeed left the permit to its lease in a process with
        nothing else to do: an idle one, a gateway replica no longer sent traffic.)"""
        first = self.options.poll_s
        cap = max(first, min(1.0, self.options.lease_s / 3))
        wait = first
        while True:
            if self._abandoned:
                with trio.move_on_after(wait):
                    await self._cleanup.wait()
            else:
                wait = first
                await self._cleanup.wait()
            self._cleanup = trio.Event()
            if not self._abandoned:
                continue
            wait = min(wait * 2, cap)
            try:
                # Unshielded (it changes nothing): a probe into a hung Redis must not
                # hold a close for its timeout_s; a slow one still has all of it.
                await self._script(_PROBE, [], [], "probe", shield=False)
            except GovernanceBackendError:
                continue  # not answering yet: the timer tries again
            try:
                await self._void_abandoned()
            except Exception:
                log.exception("voiding abandoned redis admissions failed")
            # A round at most every poll_s, however often the health flaps.
            await trio.sleep(first)
            self._cleanup = trio.Event()  # (set by this round's own exchanges: no news)

    async def _void_abandoned(self) -> None:
        """One void for each abandoned admission; one whose lease has run out since
        Redis first answered after it is dropped (found or not, it is gone)."""
        lease_s = self._lease_us / 1e6
        now = trio.current_time()
        for key, seen in list(self._abandoned.items()):
            if seen is None:
                self._abandoned[key] = now  # the probe, or this round, got an answer
            elif now - seen > lease_s:
                self._abandoned.pop(key, None)  # its lease has run out, wherever it ran
        for scope, source, member in list(self._abandoned):
            void = SettleRequest(Admission(scope, source, 0, 0), None, Feedback.NEUTRAL, sent=False)
            try:
                reply = await self._script(
                    _SETTLE, self._source_keys((scope, source)), self._settle_args(member, void), "void"
                )
            except GovernanceBackendError:
                return  # still unreachable: the next success triggers another round
            if reply[0] == 1:
                self._abandoned_voided += 1
                self._abandoned.pop((scope, source, member), None)
                self._notify()

    async def _renew_all(self) -> None:
        for key, members in list(self._open.items()):
            if not members:
                del self._open[key]
                continue
            listed = sorted(members)
            for i in range(0, len(listed), 500):
                chunk = listed[i : i + 500]
                try:
                    lost = await self._script(
                        _RENEW, self._source_keys(key), [self._lease_us, self._ttl_ms, *chunk], "renew"
                    )
                except GovernanceBackendError as exc:
                    self._renew_failures += 1
                    self._warn("renew", f"could not renew leases: {exc}")
                    return
                for m in lost if isinstance(lost, list) else ():
                    name = _text(m)
                    if name in members:
                        members.discard(name)
                        self._leases_lost += 1
                        self._warn("lease", f"a lease of {key[0]}/{key[1]} ran out before renewal")

    # ------------------------------------------------------------------ plumbing

    def _source_keys(self, key: tuple[str, str]) -> list[str]:
        keys = self._keys.get(key)
        if keys is None:
            base = f"{self.options.prefix}:{key[0]}:{key[1]}"
            keys = self._keys[key] = [
                f"{base}:state", f"{base}:window", f"{base}:wtok", f"{base}:open",
                f"{base}:permits", f"{self.options.prefix}:changes", f"{base}:lapsed",
            ]
        return keys

    def _budget_key(self, scope: str) -> str:
        return f"{self.options.prefix}:{scope}:budget"

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _observe(self, version: Any) -> None:
        """A reply carried the change counter: wake waiters if it moved since last seen
        (their refusals are older than that change)."""
        value = version if isinstance(version, bytes) else str(version).encode()
        if value != self._version:
            if self._version is not None:
                self._notify()
            self._version = value

    async def _script(
        self, script: _Script, keys: Sequence[str], args: Sequence[Any], what: str,
        *, deadline: float | None = None, sent: list[bool] | None = None, shield: bool = True,
    ) -> Any:
        """Run a script; ``sent`` gets an entry once the command was handed to a
        connection (after that, Redis may run it whatever happens to the reply).
        ``shield=False`` only for one that changes nothing but upkeep (the void loop's
        probe, the reads of :meth:`snapshot` and :meth:`budget_level`)."""
        async def call() -> Any:
            errors = self._errors
            handed: list[bool] = []
            try:
                return await self._evalsha(script, keys, args, handed)
            except errors.NoScriptError:
                pass  # Redis restarted or SCRIPT FLUSH: load it again, once
            except errors.ConnectionError:
                # A connection that died: one retry on a fresh one (ADMIT is idempotent
                # per member, SETTLE per reservation).  Not for a script that may have
                # run already (handed to the connection) and would count twice.
                if handed and not script.idempotent:
                    raise
            finally:
                if handed and sent is not None:
                    sent.append(True)
            await self._client.script_load(script.source)
            return await self._evalsha(script, keys, args, sent)

        return await self._run(call, what, deadline=deadline, shield=shield)

    async def _evalsha(
        self, script: _Script, keys: Sequence[str], args: Sequence[Any], sent: list[bool] | None = None
    ) -> Any:
        # Straight to a pooled connection: the client's command layer (retry policy,
        # telemetry span, version and cache checks) costs a fifth of the CPU of a call
        # and does nothing for us.  The pool still connects and reconnects.
        pool = self._client.connection_pool
        connection = await pool.get_connection()
        try:
            request = connection.create_request(b"EVALSHA", script.sha, len(keys), *keys, *args)
            if sent is not None:
                sent.append(True)
        finally:
            pool.release(connection)
        return await request

    async def _run(
        self, op: Callable[[], Awaitable[T]], what: str, *, deadline: float | None = None,
        shield: bool = True,
    ) -> T:
        """One bounded exchange, shielded unless told otherwise; every failure becomes
        GovernanceBackendError."""
        if self._closed:
            raise self._error(f"the session's redis backend ({self._where}) is closed")
        handled = sys.exc_info()[1]  # the caller's, if it calls from an except block
        started = trio.current_time()
        bound = started + self._timeout
        if deadline is not None:
            bound = min(bound, deadline)
        if self._cap is not None:
            bound = min(bound, self._cap)
        with trio.CancelScope(shield=shield, deadline=bound):
            try:
                result = await op()
            except GovernanceBackendError:
                self._healthy = False
                raise
            except Exception as exc:  # coredis, OS and protocol errors, their groups
                self._healthy = False
                errors = self._errors
                if errors is None or not isinstance(exc, errors.ResponseError):
                    self._unreachable = True  # (an error reply is an answer)
                # Chained for its type (an error reply is an answer, see admit), not
                # its frames: the driver's hold the password (see frameless).
                raise self._failure(what, exc, trio.current_time() - started) from frameless(exc, handled=handled)
            if self._unreachable:
                self._unreachable = False
                self._back()
                if self._abandoned:
                    self._cleanup.set()  # Redis is back: void at once
            self._healthy = True
            return result
        if deadline is None or deadline > bound or bound >= started + self._timeout:
            # Our own bound fell.  (A caller's deadline that came first says nothing of
            # Redis: marked unhealthy by it, the backend would skip the hedge budget's
            # refills until some other exchange answered.)
            self._healthy = False
            self._unreachable = True
        raise self._error(
            f"redis at {self._where} did not answer {what} within "
            f"{trio.current_time() - started:.2g} s"
        )

    def _error(self, message: str) -> GovernanceBackendError:
        """A failure of this backend, named on the error (``backend``: see
        polygate._outage, which tells each backend's outages apart)."""
        error = GovernanceBackendError(message)
        error.backend = self._where
        return error

    def _failure(self, what: str, exc: BaseException, waited: float) -> GovernanceBackendError:
        errors = self._errors
        if errors is not None and isinstance(exc, errors.AuthenticationError):
            return self._error(
                f"redis at {self._where} refused the credentials (wrong username or password?)"
            )
        if isinstance(exc, TimeoutError):  # (coredis's read gives up first: the wait it took)
            return self._error(
                f"redis at {self._where} did not answer {what} within {waited:.2g} s"
            )
        if errors is not None and isinstance(exc, errors.ConnectionError):
            return self._error(
                f"cannot reach redis at {self._where} ({what}: {self._clean(exc)})"
            )
        return self._error(f"redis at {self._where} failed {what}: {self._clean(exc)}")

    def _garbage(self, what: str) -> GovernanceBackendError:
        self._healthy = False
        return self._error(f"redis at {self._where} answered {what} with an unexpected reply")

    def _clean(self, exc: BaseException) -> str:
        """The error and its root cause (a refused connection, a TLS verification
        failure), in one line, with the password masked."""
        root = exc
        while root.__cause__ is not None and root.__cause__ is not root:
            root = root.__cause__
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if root is not exc:
            text += f" <- {type(root).__name__}: {root}"
        return server_words(text, self.options.password)[:400]

    def _back(self) -> None:
        """Redis answers after it did not: said, so that a log that told of an outage
        also tells of its end -- always after an outage the log told of (see
        :data:`OUTAGE_LOG`), otherwise at most every 10 s."""
        now = trio.current_time()
        if OUTAGE_LOG.ends(self._where) or now - self._last_warning.get("back", -math.inf) >= 10.0:
            self._last_warning["back"] = now
            log.info("redis at %s answers again", self._where)

    def _warn(self, kind: str, message: str) -> None:
        """Log at most one warning of each kind every 10 s: an outage is one event."""
        now = trio.current_time()
        if now - self._last_warning.get(kind, -math.inf) >= 10.0:
            self._last_warning[kind] = now
            log.warning("%s", message)


def _opt(value: int | None) -> int:
    return -1 if value is None else value


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
