"""A real ``redis-server`` for the tests, started on a free loopback port.

Import the fixtures into a test module (``from ._redis_server import redis_server``).
Without the binary (or without coredis) the Redis tests skip with the reason; in CI
(``POLYGATE_CI=1``, set by ``.ci/run``) they fail instead, so a missing service can
never turn the Redis suite green by skipping it.

The server runs without persistence (``--save '' --appendonly no``): a restart forgets
everything, which is what the failure tests want.  Two ACL users exist besides the
default one: ``alice`` (password :data:`ALICE_PASSWORD`) and ``nolua`` (password
``nolua-pw``), who may run every command but scripts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

ALICE_PASSWORD = "alice-SECRET-pw-0123"
NOLUA_PASSWORD = "nolua-pw"


def need_redis() -> str:
    """The redis-server binary; skip (fail in CI) when it or coredis is missing."""
    binary = shutil.which("redis-server")
    problem = None
    if binary is None:
        problem = "redis-server is not on PATH (apt-get install redis-server)"
    else:
        try:
            import coredis  # noqa: F401
        except ImportError:
            problem = "coredis is not installed (pip install -e '.[redis]')"
    if problem is not None:
        if os.environ.get("POLYGATE_CI") == "1":
            pytest.fail(f"the Redis backend tests need a Redis: {problem}")
        pytest.skip(f"the Redis backend tests need a Redis: {problem}")
    assert binary is not None
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(port: int, *args: str, password: str | None = None, timeout: float = 2.0) -> bytes:
    """Send one command (RESP) and return the first reply line; for setup only."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        payload = b""
        if password is not None:
            payload += _resp("AUTH", password)
        payload += _resp(*args)
        sock.sendall(payload)
        data = b""
        want = 2 if password is not None else 1
        while data.count(b"\r\n") < want:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n")[want - 1]


def _resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        raw = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


class RedisServer:
    """One redis-server process; ``kill()`` and ``start()`` again keep the port."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="polygate-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no",
             "--loglevel", "warning", "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        give_up = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                if command(self.port, "PING", timeout=0.5) == b"+PONG":
                    break
            if self.proc.poll() is not None or time.monotonic() > give_up:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        for user, password, rules in (
            ("alice", ALICE_PASSWORD, ["+@all"]),
            ("nolua", NOLUA_PASSWORD, ["+@all", "-@scripting"]),
        ):
            reply = command(self.port, "ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", *rules)
            assert reply == b"+OK", reply

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_redis(binary: str, port: int | None = None) -> Iterator[RedisServer]:
    server = RedisServer(binary, port)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the whole test run (tests keep apart by key prefix)."""
    with running_redis(need_redis()) as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of the test's own, for tests that kill or restart it."""
    with running_redis(need_redis()) as server:
        yield server
