"""The connection cap against the process's open-file limit (polygate/serve/_fds.py)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from polygate.testing import FakeUpstream, Reply

from ._serve_kit import AUTH, CHAT, GATEWAY_KEY, read_until_closed, request_bytes, serve_process

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX open-file limits")

_ROOM = (
    "import logging, resource, sys; logging.basicConfig(level=logging.INFO);"
    "from polygate.serve._fds import connection_room;"
    "room = connection_room(int(sys.argv[1]));"
    "print(room, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
)


def _room(wanted: int, soft: int, hard: int) -> tuple[int, int, str]:
    """``connection_room(wanted)`` in a process whose open-file limit is (soft, hard):
    the room, the soft limit after, and what it logged."""
    proc = subprocess.run(
        [sys.executable, "-c", _ROOM, str(wanted)], capture_output=True, text=True, check=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    room, after = map(int, proc.stdout.split())
    return room, after, proc.stderr


def test_a_soft_limit_below_the_connections_is_raised_toward_the_hard_one() -> None:
    room, after, log = _room(1024, 256, 8192)
    assert room == 1024
    assert 2 * 1024 < after <= 8192
    assert "raised the open-file limit from 256" in log


def test_a_hard_limit_below_the_connections_caps_them_and_says_so() -> None:
    room, after, log = _room(1024, 600, 600)
    assert after == 600
    assert 100 < room < 300  # each connection: its socket and its call's upstream socket
    assert f"leaves room for {room} client connections, not max_connections=1024" in log
    assert "LimitNOFILE" in log


def test_a_limit_with_room_to_spare_changes_nothing() -> None:
    room, after, log = _room(10, 4096, 4096)
    assert (room, after) == (10, 4096)
    assert "open-file limit" not in log


def test_a_limit_with_no_room_for_one_client_refuses_to_start_in_one_line(tmp_path: Path) -> None:
    """Review: at ``ulimit -n 10`` the server said it had room for 1 client and
    listened, but every ``accept`` failed with EMFILE: clients waited unanswered, with
    no 503, until their own timeouts."""
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:9/v1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "polygate", "serve", "--port", "0"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (12, 12)))
    assert done.returncode == 2
    assert "listening" not in done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "the open-file limit (12, hard 12) leaves no room for a client connection" in line


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_clients_beyond_the_open_file_limit_get_503_and_open_ones_keep_working(
    tmp_path: Path,
) -> None:
    """Outside review (HTTP, 2026-12-03): with the open-file limit below what
    ``max_connections`` (default 1024) needs -- the default soft limit of a shell or a
    systemd service is 1024 -- idle clients used up the descriptors: the next client
    waited unaccepted while the accept loop logged EMFILE ten times a second, and a
    call on a connection opened before could not open its upstream socket (502, the
    failure charged to the source).  Scaled down: a limit of 128."""
    limit = 128

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    upstream = FakeUpstream(Reply(tokens=2))
    async with upstream.serve() as url:
        config = tmp_path / "polygate.toml"
        config.write_text(
            f'[serve]\napi_keys = ["{GATEWAY_KEY}"]\nheader_timeout_s = 30\n'
            f'[scopes.chat.sources.a]\nbase_url = "{url}"\nmodel = "m1"\n')
        streams: list[trio.SocketStream] = []
        async with serve_process(config, preexec_fn=low_limit) as running:
            opened_first = await trio.open_tcp_stream("127.0.0.1", running.port)
            streams.append(opened_first)
            for _ in range(limit + 20):  # idle clients, far fewer than max_connections
                streams.append(await trio.open_tcp_stream("127.0.0.1", running.port))
            opened_late = await trio.open_tcp_stream("127.0.0.1", running.port)
            streams.append(opened_late)
            late = first = b""
            with trio.move_on_after(10):
                late = await read_until_closed(opened_late, 10)
            await opened_first.send_all(request_bytes(
                "POST", "/v1/chat/completions", CHAT, {**AUTH, "connection": "close"}))
            with trio.move_on_after(10):
                first = await read_until_closed(opened_first, 10)
            for stream in streams:
                await stream.aclose()
            running.proc.kill()
            await running.proc.wait()
            assert running.proc.stderr is not None
            err = b""
            with trio.move_on_after(5):
                while chunk := await running.proc.stderr.receive_some(1 << 20):
                    err += chunk
    assert late.startswith(b"HTTP/1.1 503"), (late[:200], err[-2000:])
    assert b"too_many_connections" in late
    assert first.startswith(b"HTTP/1.1 200"), first[:400]
    assert b"EMFILE" not in err
    assert b"leaves room for" in err


@pytest.mark.timeout(30)
async def test_max_connections_from_a_reload_in_force_while_the_backend_is_down() -> None:
    """Diff review (2026-12-03): a reload whose session could not open (the governance
    backend down) still puts its settings in force, but its max_connections never
    reached the cap the accept loop uses: a third idle connection under a reloaded
    max_connections=6 got 503."""
    import attrs

    import polygate
    from polygate import GovernanceBackendError
    from polygate.serve import open_server

    from ._serve_kit import settings_for

    upstream = FakeUpstream(Reply(tokens=2))
    async with upstream.serve() as url:
        first = settings_for(url, backend="redis://127.0.0.1:9/0?timeout_s=0.3",
                             serve=polygate.Serve(api_keys=[GATEWAY_KEY], max_connections=2))
        second = attrs.evolve(first, serve=attrs.evolve(first.serve, max_connections=6))
        async with open_server(first, port=0) as server:
            with pytest.raises(GovernanceBackendError):
                await server.reload(second)
            assert server.settings.serve.max_connections == 6
            streams = [await trio.open_tcp_stream("127.0.0.1", server.port) for _ in range(3)]
            answer = b""
            with trio.move_on_after(1):  # (an idle connection is answered nothing)
                answer = await read_until_closed(streams[-1], 2)
            for stream in streams:
                await stream.aclose()
            server.hard_stop()
    assert b"too_many_connections" not in answer, answer[-300:]
