"""The Redis backend beyond the contract, up to real worker processes.

First what only Redis has, in one process: instances sharing one view, leases, scripts
loaded again after ``NOSCRIPT``, namespaced keys that all expire, URLs, and start-up
failures with clear messages and no secret.  Then four worker processes — each its own
``trio.run`` and session — sharing one source against a loopback FakeUpstream server
(``python -m polygate.testing.serve``): RPM, TPM and ``max_in_flight`` hold across them,
a breaker opened by one is open in the others, and Redis killed under them makes every
call fail closed, within the bound, until it is back.

The workers are this module run as a script (``python -m tests.test_redis_multiprocess``):
they read one JSON command per line and answer one JSON line.  Real clock, generous
margins, bounded waits; every child process is killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from polygate.governance import Admission, BreakerState, Feedback, RefusalReason

from . import _redis_server
from ._redis_server import RedisServer, need_redis
from .test_backend_contract import POLICY, ask, granted, refused, settle, snap

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
redis_server = _redis_server.redis_server  # fixtures: one shared server, and one per test
own_redis = _redis_server.own_redis


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    return redis_server


def _redis(url: str, prefix: str, **options: Any) -> Any:
    from polygate.governance._redis import RedisBackend, parse_redis_url

    query = "&".join(f"{k}={v}" for k, v in {"prefix": prefix, **options}.items())
    return RedisBackend(parse_redis_url(f"{url}?{query}"), window_s=0.6)


@asynccontextmanager
async def _started(backend: Any) -> AsyncIterator[Any]:
    await backend.start()
    try:
        yield backend
    finally:
        await backend.aclose()


def test_two_backends_share_one_view(server: RedisServer) -> None:
    prefix = f"share-{secrets.token_hex(4)}"

    async def body() -> None:
        async with _started(_redis(server.url, prefix)) as one, _started(_redis(server.url, prefix)) as two:
            await granted(one, ask(rpm=2, mif=3))
            await granted(two, ask(rpm=2, mif=3))
            await refused(one, ask(rpm=2, mif=3), RefusalReason.RPM)  # one quota, not two
            policy = attrs.evolve(POLICY, failures=2)
            for _ in range(2):
                a = await granted(one, ask(source="b", breaker=policy))
                await one.settle(settle(a, None, Feedback.FAILURE, breaker=policy))
            await refused(two, ask(source="b", breaker=policy), RefusalReason.BREAKER_OPEN)
            a = await granted(one, ask(source="c"))
            await one.settle(settle(a, 0, Feedback.NEUTRAL, cooldown_s=30.0))
            await refused(two, ask(source="c"), RefusalReason.COOLING_DOWN)
            assert await one.budget_take("chat", 1.0)
            assert not await two.budget_take("chat", 1.0)
            s1, s2 = await one.snapshot("chat", "a"), await two.snapshot("chat", "a")
            assert s1 == s2 and s1.in_flight == 2

    trio.run(body)


def test_a_settle_in_another_process_wakes_waiters(server: RedisServer) -> None:
    prefix = f"wake-{secrets.token_hex(4)}"

    async def body() -> None:
        async with _started(_redis(server.url, prefix)) as one, _started(_redis(server.url, prefix)) as two:
            held = await granted(one, ask(mif=1))
            woke: list[float] = []

            async def waiter() -> None:
                while not isinstance(result := await two.admit(ask(mif=1)), Admission):
                    await two.wait_changed(two.now() + 30.0)
                await two.settle(settle(result, 1))
                woke.append(two.now())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(0.2)
                settled_at = one.now()
                await one.settle(settle(held, 1))
            # the change counter is polled every 50 ms; the fallback re-check is 1 s
            assert woke and woke[0] - settled_at < 0.8

    trio.run(body)


def test_leases_return_the_permits_of_a_crashed_holder(server: RedisServer) -> None:
    prefix = f"lease-{secrets.token_hex(4)}"

    async def body() -> None:
        crashed = _redis(server.url, prefix, lease_s=0.4)
        async with _started(crashed):
            await granted(crashed, ask(30, mif=1))
            # As if the process died: its renewals stop (aclose()), and nothing of its
            # own settles the permit (a close settles what it still holds).
            crashed._open.clear()
        async with _started(_redis(server.url, prefix)) as other:
            start = other.now()
            await refused(other, ask(30, mif=1), RefusalReason.IN_FLIGHT)
            with trio.fail_after(5):
                while not isinstance(result := await other.admit(ask(30, mif=1)), Admission):
                    await other.wait_changed(other.now() + 30.0)
            assert other.now() - start < 0.4 + 1.5  # lease, plus one re-check interval
            s = await snap(other)
            assert (s.in_flight, s.settled_total, s.cost_total) == (1, 30, 30)  # kept the estimate
            await other.settle(settle(result, 5))

    trio.run(body)


def test_leases_are_renewed_while_held(server: RedisServer) -> None:
    prefix = f"renew-{secrets.token_hex(4)}"

    async def body() -> None:
        async with _started(_redis(server.url, prefix, lease_s=0.9)) as holder, \
                _started(_redis(server.url, prefix)) as other:
            held = await granted(holder, ask(mif=1))
            await trio.sleep(2.0)  # over two lease lengths, renewed every 0.3 s
            await refused(other, ask(mif=1), RefusalReason.IN_FLIGHT)
            assert holder.statistics().open_leases == 1
            await holder.settle(settle(held, 1))
            await other.settle(settle(await granted(other, ask(mif=1)), 1))
            stats = holder.statistics()
            assert (stats.open_leases, stats.leases_lost, stats.settle_failures) == (0, 0, 0)

    trio.run(body)


def test_scripts_are_loaded_again_after_noscript(server: RedisServer) -> None:
    from ._redis_server import command

    async def body() -> None:
        async with _started(_redis(server.url, f"flush-{secrets.token_hex(4)}")) as b:
            a = await granted(b, ask())
            assert command(server.port, "SCRIPT", "FLUSH") == b"+OK"
            await b.settle(settle(a, 1))  # NOSCRIPT, loaded again, called again
            assert (await snap(b)).in_flight == 0 and b.statistics().settle_failures == 0
            await granted(b, ask())

    trio.run(body)


def test_keys_are_namespaced_and_all_expire(server: RedisServer) -> None:
    import coredis

    prefix = f"keys-{secrets.token_hex(4)}"

    async def body() -> None:
        async with _started(_redis(server.url, prefix)) as b:
            a = await granted(b, ask(20, rpm=5, tpm=100, mif=2))
            held = await granted(b, ask(5))  # keeps the open and permits keys alive
            await b.settle(settle(a, 10, Feedback.NEUTRAL, cooldown_s=3600.0))
            await b.budget_take("chat", 2.0)
            async with coredis.Redis(port=server.port) as raw:
                keys = sorted(k.decode() for k in await raw.keys(f"{prefix}:*"))
                assert keys == sorted([
                    f"{prefix}:changes", f"{prefix}:chat:budget",
                    *(f"{prefix}:chat:a:{k}" for k in ("state", "window", "wtok", "open", "permits")),
                ])
                ttls = {k: await raw.pttl(k) for k in keys}
                assert all(ttl > 0 for ttl in ttls.values()), ttls  # nothing lives forever
                assert ttls[f"{prefix}:chat:a:window"] <= 1600  # one window, plus a second
                assert ttls[f"{prefix}:chat:a:state"] >= 86_000_000  # a day, and the cooldown
            await b.settle(settle(held, 5))

    trio.run(body)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://h:1/x", "database"),
        ("redis://h/0?timeout_s=fast", "timeout_s"),
        ("redis://h/0?timeout_s=0", "timeout_s"),
        ("redis://h/0?colour=blue", "unknown option"),
        ("redis://h/0?prefix=", "prefix"),
        ("redis://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        # TLS options on a plain URL would be ignored: no TLS while the file says how
        # to verify it.  The cache refuses the same URL with the same words.
        ("redis://h/0?ssl_cert_reqs=none", "need a rediss:// URL"),
        ("redis://h/0?ssl_ca_certs=/etc/ca.pem", "need a rediss:// URL"),
        # a CA file that is not there: named now, not a bare FileNotFoundError at open
        ("rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs names no file"),
        ("redis://h/0?poll_s=1&lease_s=1", "poll_s"),
        ("http://h/0", "scheme"),
        ("redis:///0", "host"),
        ("redis://u:pw-SECRET@h:99999/0", "URL"),
    ],
)
def test_bad_urls_are_config_errors(url: str, problem: str) -> None:
    from polygate import ConfigError
    from polygate.governance._redis import parse_redis_url

    with pytest.raises(ConfigError, match=problem) as info:
        parse_redis_url(url)
    assert "SECRET" not in str(info.value)


def test_url_options_and_no_secret_in_repr() -> None:
    from polygate.governance._redis import RedisBackend, parse_redis_url

    o = parse_redis_url("rediss://bob:p%40ss-SECRET@cache.local:6380/3?prefix=app&timeout_s=0.5&lease_s=9")
    assert (o.host, o.port, o.db, o.username, o.password, o.ssl) == ("cache.local", 6380, 3, "bob", "p@ss-SECRET", True)
    assert (o.prefix, o.timeout_s, o.lease_s) == ("app", 0.5, 9.0)
    backend = RedisBackend(o)
    for text in (repr(o), o.where(), repr(backend)):
        assert "SECRET" not in text
    assert parse_redis_url("redis://localhost").port == 6379


async def _session_error(backend_url: str) -> BaseException:
    import polygate

    with pytest.raises(BaseException) as info:  # the callers check which
        # (a bad option is refused by Settings itself, the others by session())
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])},
            backend=backend_url,
        )
        async with polygate.session(settings):
            pass
    return info.value


def test_session_start_fails_clearly_without_secrets(server: RedisServer) -> None:
    from polygate import ConfigError, GovernanceBackendError

    from ._redis_server import ALICE_PASSWORD, NOLUA_PASSWORD, command, free_port

    # (a user who may run anything but SELECT: a database other than 0 is refused)
    rules = ("~*", "&*", "+@all", "-select")
    assert command(server.port, "ACL", "SETUSER", "nosel", "on", f">{NOLUA_PASSWORD}", *rules) == b"+OK"
    # (and one who may load scripts but not run them)
    rules = ("~*", "&*", "+@all", "-evalsha")
    assert command(server.port, "ACL", "SETUSER", "noeval", "on", f">{NOLUA_PASSWORD}", *rules) == b"+OK"

    async def body() -> None:
        cases = {
            f"redis://alice:wrong-{ALICE_PASSWORD}@127.0.0.1:{server.port}/0": (GovernanceBackendError, "credentials"),
            f"redis://nolua:{NOLUA_PASSWORD}@127.0.0.1:{server.port}/0": (GovernanceBackendError, "Lua"),
            f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.5": (GovernanceBackendError, "cannot reach"),
            # (review: it was read as SCRIPT LOAD's refusal: "does not run Lua scripts")
            f"redis://alice:{ALICE_PASSWORD}@127.0.0.1:{server.port}/99": (
                GovernanceBackendError, "set-up or SCRIPT LOAD: ResponseError: DB index is out of range"),
            f"redis://noeval:{NOLUA_PASSWORD}@127.0.0.1:{server.port}/0": (
                GovernanceBackendError, "does not run Lua scripts, which the redis backend needs "
                "(the probe script (EVALSHA) refused"),
            f"redis://nosel:{NOLUA_PASSWORD}@127.0.0.1:{server.port}/1": (
                GovernanceBackendError, "no permissions to run the 'select' command"),
            f"redis://alice:{ALICE_PASSWORD}@127.0.0.1:{server.port}/0?bogus=1": (ConfigError, "bogus"),
        }
        for url, (kind, words) in cases.items():
            error = await _session_error(url)
            assert isinstance(error, kind), (url, error)  # (Settings raises a ConfigError subclass)
            assert words in str(error)
            assert "Lua" in words or "Lua" not in str(error), error
            assert ALICE_PASSWORD not in str(error) and NOLUA_PASSWORD not in str(error)
        import polygate

        good = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])},
            backend=f"redis://alice:{ALICE_PASSWORD}@127.0.0.1:{server.port}/0",
        )
        assert ALICE_PASSWORD not in repr(good)
        async with polygate.session(good) as s:
            assert (await s.statistics()).governance.sources[0].state.admissions == 0

    trio.run(body)


async def _serve_bytes(reply: bytes | None, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A TCP server that answers anything with ``reply`` (``None``: says nothing)."""
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(4096)
            if reply is None:
                await trio.sleep_forever()
            await stream.send_all(reply)
            await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


@pytest.mark.parametrize("reply", [b"HTTP/1.1 400 Bad Request\r\n\r\n", b"$-5\r\n\x00garbage\r\n", None])
def test_a_server_that_is_not_redis_fails_within_the_bound(reply: bytes | None) -> None:
    from polygate import GovernanceBackendError

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve_bytes, reply)
            start = trio.current_time()
            error = await _session_error(f"redis://127.0.0.1:{port}/0?timeout_s=0.5")
            assert type(error) is GovernanceBackendError, error
            assert trio.current_time() - start < 0.5 * 8 + 1.0  # a few bounded steps at most
            nursery.cancel_scope.cancel()

    trio.run(body)


def test_chat_runs_through_the_redis_backend(server: RedisServer) -> None:
    import polygate
    from polygate.testing import FakeUpstream, Reply

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=3))
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://a/v1", rpm=100, tpm=100_000, max_in_flight=4),
                         polygate.Source(name="b", base_url="http://a/v1", weight=1e-9)],
                hedge=polygate.Hedge(after_s=5.0),
            )},
            backend=f"{server.url}?prefix=chat-{secrets.token_hex(4)}",
        )
        async with polygate.session(settings, transport=up.transport()) as s:
            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(s.chat, [{"role": "user", "content": "hi"}])
            stats = await s.statistics()
        states = [x.state for x in stats.governance.sources]
        assert sum(x.admissions for x in states) == 6  # "a" holds 4 permits at most, "b" the rest
        for x in states:
            assert (x.in_flight, x.tokens_reserved, x.reserved_total) == (0, 0, x.settled_total)
        assert states[0].admissions >= 4 and states[0].cost_total > 0
        assert stats.governance.hedge_budget["chat"] == 10.0  # refilled, capped at burst
        assert up.statistics().requests == 6

    trio.run(body)




def test_rediss_verifies_the_server_certificate(tmp_path: Path) -> None:
    """TLS: a certificate signed by ``ssl_ca_certs`` is accepted, an unknown one is not."""
    import shutil
    import socket

    from polygate import GovernanceBackendError

    from ._redis_server import free_port

    binary, openssl = need_redis(), shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not on PATH: cannot make a certificate for the TLS test")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file",
         str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients",
         "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        give_up = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if proc.poll() is not None:
                pytest.skip("this redis-server was built without TLS")
            assert time.monotonic() < give_up, "TLS redis-server did not start"
            time.sleep(0.02)

        async def body() -> None:
            trusted = _redis(f"rediss://127.0.0.1:{port}/0", f"tls-{secrets.token_hex(4)}", ssl_ca_certs=cert)
            async with _started(trusted) as b:
                await b.settle(settle(await granted(b, ask()), 1))
                assert (await snap(b)).admissions == 1
            with pytest.raises(GovernanceBackendError, match="certificate"):
                async with _started(_redis(f"rediss://127.0.0.1:{port}/0", "tls-untrusted")):
                    pass

        trio.run(body)
    finally:
        proc.kill()
        proc.wait(timeout=10)


# ================================================================== worker processes

MESSAGES = [{"role": "user", "content": "hi"}]


def _worker_settings(cmd: dict[str, Any]) -> Any:
    import polygate

    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url=cmd["upstream"], timeout_s=30, **cmd.get("source", {}))],
            call_deadline_s=cmd.get("deadline", 10.0),
            retry=polygate.Retry(backoff_base_s=0.01, backoff_max_s=0.05),
            # open long enough that no probe happens while a test looks
            breaker=polygate.Breaker(open_s=30, max_open_s=30),
        )},
        backend=cmd["backend"],
    )


async def _calls(session: Any, n: int, concurrency: int, params: dict[str, Any]) -> dict[str, Any]:
    """``n`` chat calls, ``concurrency`` at a time: outcomes, durations, usage."""
    outcomes: list[str] = []
    durations: list[float] = []
    usage: list[int] = []
    remaining = n

    async def one() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.monotonic()
            try:
                r = await session.chat(MESSAGES, **params)
            except Exception as exc:  # the outcome is what the test checks
                outcomes.append(type(exc).__name__)
            else:
                outcomes.append("ok")
                usage.append(r.usage.total_tokens)
            durations.append(time.monotonic() - start)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(one)
    return {"outcomes": outcomes, "durations": durations, "usage": usage}


async def _worker_command(cmd: dict[str, Any]) -> dict[str, Any]:
    import polygate

    async with polygate.session(_worker_settings(cmd)) as s:
        backend = s._runtime.governor.backend
        params = cmd.get("params", {})
        out: dict[str, Any] = {
            "estimate": s._runtime.governor.prompt_estimate(MESSAGES) + params.get("max_tokens", 256),
        }
        phases = cmd.get("phases", ["run"])
        for index, phase in enumerate(phases):
            if index:  # later phases start when the parent says so (Redis killed, back…)
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                assert json.loads(line)["phase"] == phase
            out[phase] = await _calls(s, cmd["calls"], cmd.get("concurrency", 1), params)
            if index < len(phases) - 1:
                print(json.dumps({"phase": phase, **out[phase]}), flush=True)
        state = (await s.statistics()).governance.sources[0].state
        out["breaker"] = state.breaker.value
        out["backend"] = attrs.asdict(backend.statistics())
    return out


def worker_main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = trio.run(_worker_command, json.loads(line))
        except BaseException as exc:
            result = {"crash": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)


class Worker:
    """One worker process; lines from its stdout arrive through a reader thread."""

    def __init__(self) -> None:
        self.errfile = tempfile.TemporaryFile()  # noqa: SIM115 - closed by kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_redis_multiprocess"], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errfile, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker silent for {timeout} s{self._stderr()}") from None
        if line is None:
            raise AssertionError(f"worker exited{self._stderr()}")
        result: dict[str, Any] = json.loads(line)
        assert "crash" not in result, f"{result['crash']}{self._stderr()}"
        return result

    def _stderr(self) -> str:
        self.errfile.seek(0)
        return "; stderr:\n" + self.errfile.read().decode(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.errfile.close()


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Worker]]:
    need_redis()
    started: list[Worker] = []
    try:
        for _ in range(4):
            started.append(Worker())
        yield started
    finally:
        for w in started:
            w.kill()


@contextlib.contextmanager
def fake_server(reply: dict[str, Any]) -> Iterator[str]:
    """A loopback FakeUpstream in its own process; yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "polygate.testing.serve", "--port", "0", "--reply", json.dumps(reply)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        yield line.removeprefix("listening on ")
    finally:
        proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def upstream_stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base_url}/_stats", timeout=10) as r:
        stats: dict[str, Any] = json.loads(r.read())
    return stats


def run_all(workers: list[Worker], cmd: dict[str, Any]) -> list[dict[str, Any]]:
    for w in workers:
        w.send(cmd)
    return [w.recv() for w in workers]


def _backend(server: RedisServer) -> str:
    return f"{server.url}?prefix=mp-{secrets.token_hex(4)}"


def test_rpm_holds_across_processes(workers: list[Worker], server: RedisServer) -> None:
    rpm = 12
    with fake_server({"tokens": 2}) as up:
        results = run_all(workers, {"backend": _backend(server), "upstream": up, "source": {"rpm": rpm},
                                    "calls": 8, "concurrency": 4, "deadline": 5.0})
        stats = upstream_stats(up)
    outcomes = [o for r in results for o in r["run"]["outcomes"]]
    assert outcomes.count("ok") == rpm  # all workers together get the quota, no more
    assert set(outcomes) == {"ok", "AllSourcesExhausted"}
    times = sorted(stats["request_times"])
    assert stats["requests"] == len(times) == rpm
    assert max(sum(1 for t in times if start <= t < start + 60.0) for start in times) <= rpm
    assert all(r["backend"]["open_leases"] == 0 for r in results)


def test_tpm_holds_across_processes_up_to_the_settle_correction(
    workers: list[Worker], server: RedisServer
) -> None:
    tpm = 1300
    with fake_server({"tokens": 300}) as up:
        results = run_all(workers, {"backend": _backend(server), "upstream": up, "source": {"tpm": tpm},
                                    "calls": 4, "concurrency": 2, "deadline": 5.0})
        stats = upstream_stats(up)
    used = [u for r in results for u in r["run"]["usage"]]
    estimate = results[0]["estimate"]
    cost = max(used)
    assert used and cost == min(used) and cost > estimate  # every answer costs more than reserved
    n = len(used)
    # Each admission saw window + estimate <= tpm, and a refusal saw window + estimate > tpm
    # with every held or settled call counting at most its cost:
    assert (tpm - estimate) // cost + 1 <= n <= tpm // estimate
    assert sum(used) <= tpm + n * (cost - estimate)  # the settle correction bound
    assert stats["requests"] == n


def test_max_in_flight_holds_across_processes(workers: list[Worker], server: RedisServer) -> None:
    limit = 3
    with fake_server({"tokens": 2, "headers_delay_s": 0.15}) as up:
        results = run_all(workers, {"backend": _backend(server), "upstream": up,
                                    "source": {"max_in_flight": limit}, "calls": 4,
                                    "concurrency": 2, "deadline": 30.0})
        stats = upstream_stats(up)
    outcomes = [o for r in results for o in r["run"]["outcomes"]]
    assert outcomes == ["ok"] * 16  # every call waits for a permit, none is refused
    assert 2 <= stats["peak_in_flight"] <= limit
    assert stats["requests"] == 16


def test_a_breaker_opened_in_one_process_is_open_in_the_others(
    workers: list[Worker], server: RedisServer
) -> None:
    backend = _backend(server)
    with fake_server({"status": 500}) as up:
        first, second = workers[0], workers[1]
        first.send({"backend": backend, "upstream": up, "calls": 2, "deadline": 5.0})
        failed = first.recv()
        assert failed["breaker"] == "open"
        seen = upstream_stats(up)["requests"]
        assert seen == 5  # the 6th attempt found the breaker open
        second.send({"backend": backend, "upstream": up, "calls": 2, "deadline": 5.0})
        other = second.recv()
        assert other["breaker"] == "open"
        assert other["run"]["outcomes"] == ["AllSourcesExhausted"] * 2
        assert max(other["run"]["durations"]) < 2.0  # refused at once: opened 30 s ago at most
        assert upstream_stats(up)["requests"] == seen  # nothing sent by the second process


def test_redis_killed_under_running_workers(workers: list[Worker], own_redis: RedisServer) -> None:
    with fake_server({"tokens": 2}) as up:
        for w in workers:
            w.send({"backend": f"{own_redis.url}?timeout_s=1", "upstream": up, "calls": 5,
                    "concurrency": 2, "phases": ["up", "down", "back"]})
        for w in workers:
            assert w.recv()["outcomes"] == ["ok"] * 5
        before = upstream_stats(up)["requests"]
        assert before == 20
        own_redis.kill()
        for w in workers:
            w.send({"phase": "down"})
        for w in workers:
            down = w.recv()
            assert down["outcomes"] == ["GovernanceBackendError"] * 5  # fail closed
            assert max(down["durations"]) < 1.0 + 0.5  # within the bound
        assert upstream_stats(up)["requests"] == before  # nothing sent unadmitted
        own_redis.start()  # same port, empty: no persistence
        for w in workers:
            w.send({"phase": "back"})
        for w in workers:
            result = w.recv()
            assert result["back"]["outcomes"] == ["ok"] * 5  # reconnected by itself
            assert result["backend"]["open_leases"] == 0  # nothing held in any process
            assert result["breaker"] == "closed"
        assert upstream_stats(up)["requests"] == before + 20


def test_settling_after_redis_died_returns_the_answer(own_redis: RedisServer) -> None:
    """An attempt in flight when Redis dies still returns its answer; its settle is
    retried for ``settle_s``, then counted; a call waiting for a permit fails closed."""
    import polygate
    from polygate.testing import FakeUpstream, Reply

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2, headers_delay_s=0.6))
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[
                polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)])},
            backend=f"{own_redis.url}?timeout_s=0.5",
        )
        async with polygate.session(settings, transport=up.transport()) as s:
            backend = s._runtime.governor.backend
            results: dict[str, Any] = {}

            async def call(name: str) -> None:
                start = trio.current_time()
                try:
                    results[name] = await s.chat(MESSAGES)
                except polygate.PolygateError as exc:
                    results[name] = exc
                results[name + "_s"] = trio.current_time() - start

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "held")
                await trio.sleep(0.2)
                nursery.start_soon(call, "waiting")  # no permit: waits
                await trio.sleep(0.1)
                own_redis.kill()
            assert isinstance(results["held"], polygate.ChatResponse)
            assert results["held_s"] < 0.6 + 0.5 + 0.5  # the answer, the settle bound, slack
            assert type(results["waiting"]) is polygate.GovernanceBackendError
            assert results["waiting_s"] < 0.3 + 0.05 + 0.5 + 0.5  # poll, then one bounded admit
            stats = backend.statistics()
            assert (stats.settle_failures, stats.open_leases) == (1, 0)
            own_redis.start()
            r = await s.chat(MESSAGES)  # the same session, Redis back
            assert r.text
        assert up.statistics().requests == 2

    trio.run(body)


async def _abandoned_admissions_voided(s: Any, n: int) -> list[Any]:
    """Waits until the backend has voided ``n`` abandoned admissions (late replies
    drained after Redis came back), checks nothing is left in flight or reserved, and
    returns the sources' states."""
    backend = s._runtime.governor.backend
    with trio.fail_after(5):
        while backend.statistics().abandoned_voided < n:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert backend.statistics().abandoned == n
    states = [source.state for source in (await s.statistics()).governance.sources]
    for state in states:
        assert (state.in_flight, state.tokens_reserved) == (0, 0)
    return states


def test_a_hung_redis_fails_calls_within_the_bound(own_redis: RedisServer) -> None:
    """SIGSTOP: the server accepts bytes and answers nothing.  Calls fail closed after
    ``timeout_s``; once it runs again, the late replies are drained and calls succeed."""
    import signal

    import polygate
    from polygate.testing import FakeUpstream, Reply

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name=n, base_url="http://a/v1", weight=w) for n, w in (("a", 1), ("b", 1e-9))],
                hedge=polygate.Hedge(after_s=5.0))},
            backend=f"{own_redis.url}?timeout_s=0.5",
        )
        async with polygate.session(settings, transport=up.transport()) as s:
            assert (await s.chat(MESSAGES)).text
            assert own_redis.proc is not None
            own_redis.proc.send_signal(signal.SIGSTOP)
            try:
                for _ in range(2):
                    start = trio.current_time()
                    with pytest.raises(polygate.GovernanceBackendError, match="did not answer"):
                        await s.chat(MESSAGES)
                    # one bounded admission; the refill after a failure is skipped
                    assert trio.current_time() - start < 0.5 + 0.3
            finally:
                own_redis.proc.send_signal(signal.SIGCONT)
            assert (await s.chat(MESSAGES)).text
            # The two admissions ran when Redis woke up, their answers long given up on:
            # voided after the next success, not left to their 15-second leases.
            sources = await _abandoned_admissions_voided(s, 2)
            for state in sources:
                if state.source == "a":  # two calls sent, two voided
                    assert (state.admissions, state.requests_in_window) == (4, 2)
                    assert state.released_total == state.settled_total == state.reserved_total // 2
        assert up.statistics().requests == 2

    trio.run(body)


def test_a_hung_redis_holds_a_call_no_longer_than_its_deadline(own_redis: RedisServer) -> None:
    """review: an admission waited out the backend's ``timeout_s`` (2 s) whatever the
    call's deadline (0.3 s): the call ended after ~1.2 s, as GovernanceBackendError.  An
    admission is bounded by the deadline (one sent but not answered by then is
    abandoned and voided later, as one that timed out), and the deadline speaks."""
    import signal

    import polygate
    from polygate.testing import FakeUpstream, Reply

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])},
            backend=f"{own_redis.url}?timeout_s=2",
        )
        async with polygate.session(settings, transport=up.transport()) as s:
            assert (await s.chat(MESSAGES)).text
            assert own_redis.proc is not None
            own_redis.proc.send_signal(signal.SIGSTOP)
            try:
                start = trio.current_time()
                with pytest.raises(polygate.DeadlineExceeded):
                    await s.chat(MESSAGES, call_deadline_s=0.3)
                assert trio.current_time() - start < 0.3 + 0.25
            finally:
                own_redis.proc.send_signal(signal.SIGCONT)
            assert (await s.chat(MESSAGES)).text
            await _abandoned_admissions_voided(s, 1)
        assert up.statistics().requests == 2

    trio.run(body)


@pytest.mark.parametrize(("open_s", "cooldown_s"), [(1000.0, 0.0), (1e300, 1e300)])
def test_state_lives_as_long_as_its_open_breaker_and_any_cooldown(
    server: RedisServer, open_s: float, cooldown_s: float
) -> None:
    """review: the state hash was kept ``key_ttl_s`` (60 s here) past its last write,
    and longer only for a cooldown, so Redis forgot a breaker open for 1000 s after a
    minute (the memory backend forgets nothing).  And a huge period (a valid setting)
    made PEXPIRE refuse the TTL Lua wrote in exponent form: every settle on the
    source failed halfway."""
    import coredis

    prefix = f"ttl-{secrets.token_hex(4)}"
    policy = attrs.evolve(POLICY, failures=1, open_s=open_s, max_open_s=open_s)

    async def body() -> None:
        async with _started(_redis(server.url, prefix, key_ttl_s=60)) as b:
            a = await granted(b, ask(breaker=policy))
            await b.settle(settle(a, None, Feedback.FAILURE, breaker=policy, cooldown_s=cooldown_s))
            assert b.statistics().settle_retries == 0
            assert (await snap(b)).breaker is BreakerState.OPEN
            async with coredis.Redis(port=server.port) as raw:
                ttl = await raw.pttl(f"{prefix}:chat:a:state")
                assert ttl >= min(open_s * 1000 * 0.5, 10**15 - 10**6), ttl  # (jitter: half at least)
                assert ttl <= 10**15
            await refused(b, ask(breaker=policy), RefusalReason.COOLING_DOWN if cooldown_s
                          else RefusalReason.BREAKER_OPEN)

    trio.run(body)


@pytest.mark.parametrize("op", ["budget_take", "budget_refill", "admit"])
def test_a_connection_lost_after_a_script_was_sent_retries_only_what_is_idempotent(
    server: RedisServer, op: str
) -> None:
    """review: any script was sent again after a ConnectionError, even one the dead
    connection had already delivered: a hedge-budget token could be taken (or added)
    twice.  The budget's take and refill are not retried once sent; an admission
    (idempotent per member) still is."""
    prefix = f"idem-{secrets.token_hex(4)}"

    async def body() -> None:
        async with _started(_redis(server.url, prefix)) as b:
            errors = b._errors
            real = b._evalsha
            calls: list[str] = []

            async def flaky(script: Any, keys: Any, args: Any, sent: Any = None) -> Any:
                calls.append(script.name)
                if len(calls) == 1:
                    await real(script, keys, args, sent)  # it runs in Redis ...
                    raise errors.ConnectionError("connection lost")  # ... the reply is lost
                return await real(script, keys, args, sent)

            await b.budget_take("chat", 5.0)  # 4 left: room for a refill to show twice
            level = await b.budget_level("chat", 5.0)
            b._evalsha = flaky
            if op == "admit":
                await granted(b, ask())
                assert calls == ["admit", "admit"]
                return
            from polygate import GovernanceBackendError

            with pytest.raises(GovernanceBackendError, match="connection lost"):
                if op == "budget_take":
                    await b.budget_take("chat", 5.0)
                else:
                    b._healthy = True
                    await b._script(b_module()._REFILL, [b._budget_key("chat")],
                                    [repr(5.0), b._ttl_ms, repr(0.5)], "budget_refill")
            b._evalsha = real
            assert calls == [op]
            expected = level - 1 if op == "budget_take" else min(5.0, level + 0.5)
            assert await b.budget_level("chat", 5.0) == pytest.approx(expected)

    trio.run(body)


def b_module() -> Any:
    from polygate.governance import _redis

    return _redis


if __name__ == "__main__":
    worker_main()


def test_a_held_lease_keeps_its_sources_keys_past_key_ttl(server: RedisServer) -> None:
    """review: with lease_s=600 and key_ttl_s=60 (both valid), the permits and the
    state expired a minute after the admission while its lease ran for ten: another
    process was then granted past max_in_flight, and the holder's settle found
    nothing.  The keys live as long as the longest lease."""
    import coredis

    prefix = f"lease-{secrets.token_hex(4)}"

    async def body() -> None:
        async with _started(_redis(server.url, prefix, lease_s=600, key_ttl_s=60)) as b:
            await granted(b, ask(mif=1))
            async with coredis.Redis(port=server.port) as raw:
                for key in ("state", "permits"):
                    ttl = await raw.pttl(f"{prefix}:chat:a:{key}")
                    assert 590_000 <= ttl <= 602_000, (key, ttl)

    trio.run(body)


@pytest.mark.parametrize("period", [1e13, 1e303])
def test_a_huge_period_is_an_open_breaker_and_a_cooldown_as_in_memory(
    server: RedisServer, period: float
) -> None:
    """review: an instant past ~9.2e18 us came back from Lua as a negative integer,
    read as "unknown" (a refusal without retry_at, a dead source shown alive); and
    1e303 s overflowed the conversion to microseconds: every admission and settle
    raised a bare OverflowError.  Both are valid settings, handled by memory."""
    policy = attrs.evolve(POLICY, failures=1, open_s=period, max_open_s=period)

    async def body() -> None:
        async with _started(_redis(server.url, f"huge-{secrets.token_hex(4)}")) as b:
            a = await granted(b, ask(breaker=policy))
            await b.settle(settle(a, None, Feedback.FAILURE, breaker=policy))
            refusal = await refused(b, ask(breaker=policy), RefusalReason.BREAKER_OPEN)
            assert refusal.retry_at is not None and refusal.retry_at > trio.current_time() + 1e9
            d = await granted(b, ask(source="d"))
            await b.settle(settle(d, None, Feedback.FAILURE, cooldown_s=period, dead=True))
            shown = await snap(b, "d")
            assert shown.dead and shown.cooldown_until is not None
            assert b.statistics().settle_failures == 0

    trio.run(body)


@pytest.mark.parametrize("settle_s", [0, 0.0001])
def test_settle_s_zero_still_settles(server: RedisServer, settle_s: float) -> None:
    """review: settle_s (how long a settle is retried, [0, 60]) bounded the first try
    too: at 0 every settle was cut before its answer, counted as failed, and marked
    the backend unhealthy (so the hedge budget was never refilled)."""

    async def body() -> None:
        async with _started(_redis(server.url, f"st-{secrets.token_hex(4)}", settle_s=settle_s)) as b:
            for _ in range(3):
                a = await granted(b, ask(mif=1))
                await b.settle(settle(a, 3))
            shown = await snap(b)
            stats = b.statistics()
            assert (shown.in_flight, stats.settle_failures, stats.open_leases) == (0, 0, 0), stats
            assert b._healthy

    trio.run(body)


def test_a_call_deadline_inside_an_admission_says_nothing_of_redis(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review: a call whose deadline fell during its admission's round trip marked
    the backend unhealthy, and its hedge-budget refill (and every other, until some
    exchange answered) was skipped as if Redis were down."""
    import polygate
    from polygate.governance._redis import RedisBackend
    from polygate.testing import FakeUpstream, Reply

    real = RedisBackend._evalsha

    async def remote(self: Any, script: Any, keys: Any, args: Any, sent: Any = None) -> Any:
        await trio.sleep(0.015)  # a Redis 30 ms away, answering every exchange
        result = await real(self, script, keys, args, sent)
        await trio.sleep(0.015)
        return result

    monkeypatch.setattr(RedisBackend, "_evalsha", remote)
    settings = polygate.Settings(backend=f"{server.url}?prefix=du-{secrets.token_hex(4)}", scopes={
        "chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1"),
                                        polygate.Source(name="b", base_url="http://b/v1")],
                               hedge=polygate.Hedge(after_s=0.01, budget_burst=2, budget_ratio=0.5))})

    async def body() -> None:
        upstream = FakeUpstream(Reply(tokens=2, first_token_s=0.3))  # late: it hedges
        async with polygate.session(settings, transport=upstream.transport()) as s:
            backend = s._runtime.governor.backend
            assert (await s.chat(MESSAGES)).call_stats.hedges == 1  # the bucket 2 -> 1 -> 1.5
            with pytest.raises(polygate.DeadlineExceeded):
                await s.chat(MESSAGES, call_deadline_s=0.02)  # cut inside its admission
            assert backend.statistics().refill_failures == 0
            assert await backend.budget_level("chat", 2.0) == 2.0  # as memory: 1.5 + 0.5

    trio.run(body)


@pytest.mark.parametrize("mode", ["oom", "readonly"])
async def test_an_admission_refused_with_an_error_reply_is_not_abandoned(
    own_redis: RedisServer, mode: str
) -> None:
    """Review: an admission Redis answered with an error (OOM, a READONLY replica)
    was counted as abandoned, one entry a call, re-voided every lease_s/3 while the
    outage lasted (each void refused too): an error reply is an answer, and the
    script was refused at its first write."""
    import polygate
    from polygate.testing import FakeUpstream, Reply

    url = f"{own_redis.url}?timeout_s=0.5&prefix=ab{secrets.token_hex(3)}"
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])}, backend=url)
    messages = [{"role": "user", "content": "hi"}]
    async with polygate.session(settings, transport=FakeUpstream(Reply(tokens=2)).transport()) as s:
        backend: Any = s._runtime.governor.backend
        assert (await s.chat(messages)).text
        if mode == "oom":
            _redis_server.command(own_redis.port, "CONFIG", "SET", "maxmemory", "1")
        else:
            _redis_server.command(own_redis.port, "REPLICAOF", "127.0.0.1", "1")
        try:
            for _ in range(5):
                with pytest.raises(polygate.GovernanceBackendError):
                    await s.chat(messages)
        finally:
            _redis_server.command(own_redis.port, "CONFIG", "SET", "maxmemory", "0")
            _redis_server.command(own_redis.port, "REPLICAOF", "NO", "ONE")
        assert (await s.chat(messages)).text
        assert backend.statistics().abandoned == 0
        assert not backend._abandoned


def test_an_idle_session_voids_its_abandoned_admission_on_its_own(own_redis: RedisServer) -> None:
    """Outside review (multi-process Redis, 2026-12-03): an admission abandoned while
    Redis hung was voided only after this session's next successful exchange.  A
    session with nothing else to do (a process gone idle, a gateway replica the load
    balancer stopped sending to) left the phantom's permit to its lease, and another
    session's call, under max_in_flight=1, waited for it until its deadline."""
    import signal

    import polygate
    from polygate.testing import FakeUpstream, Reply

    async def body() -> None:
        up = FakeUpstream(Reply(tokens=2))
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://a/v1", max_in_flight=1)],
                call_deadline_s=4.0)},
            backend=f"{own_redis.url}?timeout_s=0.5",  # (lease_s: 15 s, the default)
        )
        async with polygate.session(settings, transport=up.transport()) as idle, \
                polygate.session(settings, transport=up.transport()) as other:
            assert (await idle.chat(MESSAGES)).text
            assert own_redis.proc is not None
            own_redis.proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(polygate.GovernanceBackendError):
                    await idle.chat(MESSAGES)
            finally:
                own_redis.proc.send_signal(signal.SIGCONT)
            # ``idle`` makes no other call: its phantom permit must go all the same.
            start = trio.current_time()
            assert (await other.chat(MESSAGES)).text
            assert trio.current_time() - start < 2.0
        assert up.statistics().requests == 2

    trio.run(body)


async def _serve_resp(
    replies: dict[bytes, bytes], task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """A Redis-like server answering each command by its name (``+OK`` when not
    listed): enough of RESP for coredis's connection set-up."""
    async def handler(stream: trio.SocketStream) -> None:
        buffer = bytearray()

        async def line() -> bytes:
            while (end := buffer.find(b"\r\n")) < 0:
                data = await stream.receive_some(4096)
                if not data:
                    raise EOFError
                buffer.extend(data)
            out = bytes(buffer[:end])
            del buffer[:end + 2]
            return out

        async with stream:
            with contextlib.suppress(EOFError, trio.BrokenResourceError):
                while True:
                    head = await line()
                    args = [await line() for _ in range(2 * int(head[1:]))][1::2]
                    await stream.send_all(replies.get(args[0].upper(), b"+OK\r\n"))

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


@pytest.mark.parametrize("user", ["evaluator", "ci-scripting"])
def test_a_users_name_in_a_refusal_does_not_make_it_luas(user: str) -> None:
    """Diff review: Redis 7.2 names the user in NOPERM ("User evaluator has no
    permissions to run the 'select' command"), and the refusal was named Lua's for
    the 'lua' in evaLUAtor (then, for a user named ci-scripting).  It is named by the
    command refused."""
    from polygate import GovernanceBackendError

    hello = (b"%7\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.2.4\r\n"
             b"$5\r\nproto\r\n:3\r\n$2\r\nid\r\n:6\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n"
             b"$4\r\nrole\r\n$6\r\nmaster\r\n$7\r\nmodules\r\n*0\r\n")
    select = b"-NOPERM User %s has no permissions to run the 'select' command\r\n" % user.encode()

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve_resp, {b"HELLO": hello, b"SELECT": select})
            error = await _session_error(f"redis://{user}:pw-SECRET@127.0.0.1:{port}/1?timeout_s=1")
            nursery.cancel_scope.cancel()
        assert type(error) is GovernanceBackendError, error
        assert "refused the connection's set-up or SCRIPT LOAD" in str(error), error
        assert "'select'" in str(error) and "Lua" not in str(error)
        assert "pw-SECRET" not in str(error)

    trio.run(body)


def test_a_redis_busy_with_another_clients_script_is_not_said_to_lack_lua() -> None:
    """Diff review: BUSY ("Redis is busy running a script") from a server that another
    client's long script holds was named "does not run Lua scripts"."""
    from polygate import GovernanceBackendError

    from ._redis_server import _resp, command, need_redis, running_redis

    with running_redis(need_redis()) as server:
        assert command(server.port, "CONFIG", "SET", "busy-reply-threshold", "20") == b"+OK"
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as hog:
            hog.sendall(_resp("EVAL", "while true do end", "0"))
            # (waits until the script holds the server: its answer to PING says so)
            while not command(server.port, "PING").startswith(b"-BUSY"):
                pass
            try:
                error = trio.run(_session_error, f"redis://127.0.0.1:{server.port}/0?timeout_s=2")
            finally:
                command(server.port, "SCRIPT", "KILL")
    assert type(error) is GovernanceBackendError, error
    assert "BUSY" in str(error) and "Lua" not in str(error), error
