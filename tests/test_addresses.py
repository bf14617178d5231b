"""Addresses and name resolution (an outside review, 2026-12-06): a source whose DNS
hangs, a host name with its trailing dot over TLS, an IPv6 zone as a URL writes it, a
name httpx refuses, and the gateway's words for an IPv6 address it cannot listen on."""

from __future__ import annotations

import socket
import threading
import time
from functools import partial
from typing import Any

import pytest
import trio

import polygate
from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply
from polygate.transport import LeanTransport

from .conftest import MESSAGES
from .test_pool import tls_contexts


async def test_a_source_whose_dns_hangs_holds_one_thread_not_every_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """45 calls to a source whose name never resolves each started a lookup thread
    that outlived the call (trio abandons a cancelled lookup; its thread keeps one of
    trio's 40 slots until the resolver answers), and a healthy source's connection
    then waited for them: 2.8 s.  A name now holds one lookup thread at a time."""
    real = socket.getaddrinfo
    started: list[float] = []
    answer = threading.Event()

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name == "slow.test":
            started.append(time.monotonic())
            answer.wait(10)  # a DNS server that does not answer
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real("127.0.0.1" if name == "good.test" else host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    up = FakeUpstream(Reply(tokens=1))
    try:
        async with up.serve() as url:
            port = url.rsplit(":", 1)[1].split("/")[0]
            settings = polygate.Settings(scopes={
                "bad": polygate.Scope(sources=[polygate.Source(
                    name="bad", base_url="http://slow.test:9/v1", timeout_s=0.2)],
                    retry=polygate.Retry(max_attempts=1)),
                "chat": polygate.Scope(sources=[polygate.Source(
                    name="good", base_url=f"http://good.test:{port}/v1")]),
            })
            async with polygate.session(settings) as s:
                async def bad() -> None:
                    with pytest.raises(polygate.PolygateError):
                        await s.chat(MESSAGES, scope="bad")

                async with trio.open_nursery() as nursery:
                    for _ in range(45):
                        nursery.start_soon(bad)
                began = time.monotonic()
                with trio.fail_after(10):
                    r = await s.chat(MESSAGES, call_deadline_s=5)
                took = time.monotonic() - began
    finally:
        answer.set()
    assert r.source == "good" and took < 1.0
    assert len(started) == 1  # (one lookup of the hung name; its callers waited on it)


async def test_a_host_names_trailing_dot_is_no_part_of_its_certificate_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``https://localhost./v1`` (a fully qualified name) failed every handshake with
    "Hostname mismatch", and sent the dot in SNI (RFC 6066 forbids it); the dot is
    the DNS root, kept for the lookup alone."""
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(
        "127.0.0.1" if host in ("localhost.", b"localhost.") else host, *a, **k))
    server_context, client_context = tls_contexts("localhost")
    names: list[str | None] = []

    def sni(_sock: Any, name: str | None, _ctx: Any) -> None:
        names.append(name)

    server_context.sni_callback = sni

    async def handler(tls: trio.SSLStream[trio.SocketStream]) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await tls.receive_some(65536)
        await tls.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_ssl_over_tcp, handler, 0, server_context,
                                                host="127.0.0.1"))
        port = listeners[0].transport_listener.socket.getsockname()[1]
        async with LeanTransport(ssl_context=client_context) as transport:
            import httpx

            async with httpx.AsyncClient(transport=transport) as client:
                response = await client.post(f"https://localhost.:{port}/v1/chat/completions", content=b"{}")
        nursery.cancel_scope.cancel()
    assert response.content == b"ok" and names == ["localhost"]


def test_an_ipv6_zone_is_connected_to_as_itself() -> None:
    """RFC 6874 writes a zone ``%25eth0`` in a URL; the resolver reads ``%eth0`` (it
    answered "Name or service not known", every attempt)."""
    from polygate.transport._pool import _connectable

    assert _connectable("fe80::1%25eth0") == "fe80::1%eth0"
    assert _connectable("api.example.com") == "api.example.com"
    assert _connectable("::1") == "::1"


@pytest.mark.parametrize("url", ["http://ｂücher.test/v1", "http://💩.la/v1"])
def test_a_name_httpx_refuses_is_said_to_be_the_name(url: str) -> None:
    """It was "not a valid URL (bad port, or an unencoded '#' ... in the user:password
    part)": the URL had neither."""
    with pytest.raises(polygate.ConfigError, match="its host is not a name that can be looked up"):
        polygate.Source(name="a", base_url=url)


async def test_an_ipv6_address_the_gateway_cannot_listen_on_is_bracketed() -> None:
    """"cannot listen on ::1:8080" reads as one IPv6 address; the port is now apart."""
    with trio.socket.socket(socket.AF_INET6) as taken:
        await taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://127.0.0.1:9/v1")])})
        with pytest.raises(polygate.ConfigError, match=rf"cannot listen on \[::1\]:{port} \("):
            async with open_server(settings, host="::1", port=port):
                pass


async def test_callers_waiting_on_a_lookup_that_fails_fail_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of the one-lookup-a-name fix: ten connections to a name whose lookup fails
    in 0.3 s failed one lookup after another (the tenth at 3 s, calls past their
    timeouts); the callers that waited for a lookup take its outcome."""
    import httpx

    real = socket.getaddrinfo
    lookups: list[float] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host in ("nx.test", b"nx.test"):
            lookups.append(time.monotonic())
            time.sleep(0.3)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    took: list[float] = []
    async with LeanTransport() as transport:
        async def one() -> None:
            began = time.monotonic()
            # (The name said: the resolver's words name none. Review finding, base
            # URLs as deployments write them.)
            with pytest.raises(httpx.ConnectError, match=r"Name or service not known \(looking up 'nx.test'\)"):
                await transport.handle_async_request(
                    httpx.Request("POST", "http://nx.test:9/v1/chat/completions", content=b"{}"))
            took.append(time.monotonic() - began)

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(one)
        assert len(lookups) == 1 and max(took) < 1.0
        # A caller after the failure asks again (a name that comes back is found).
        with pytest.raises(httpx.ConnectError):
            await transport.handle_async_request(
                httpx.Request("POST", "http://nx.test:9/v1/chat/completions", content=b"{}"))
    assert len(lookups) == 2


async def test_a_lookup_failing_with_a_plain_oserror_is_shared_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: getaddrinfo's EAI_SYSTEM comes as a plain OSError, not a gaierror, and
    was not shared: three callers failed one lookup after another."""
    import errno

    import httpx

    lookups: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        lookups.append(host)
        time.sleep(0.3)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    async with LeanTransport() as transport:
        async def one() -> None:
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(_name_request("eio.test"))

        began = time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
    assert len(lookups) == 1 and time.monotonic() - began < 0.6


def test_a_lookup_abandoned_by_one_trio_run_holds_nothing_in_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a transport used by two trio runs, the first abandoning a hung lookup:
    its thread's release went to the finished run, and the name stayed blocked for
    good in the second."""
    import httpx

    real = socket.getaddrinfo
    answer = threading.Event()

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host in ("flaky.test", b"flaky.test"):
            answer.wait(10)  # hangs in the first run
            host = "127.0.0.1"
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    transport = LeanTransport()

    async def first() -> None:
        with trio.move_on_after(0.3):
            await transport.handle_async_request(
                httpx.Request("POST", "http://flaky.test:9/v1/chat/completions", content=b"{}"))

    trio.run(first)
    answer.set()

    async def second() -> bytes:
        up = FakeUpstream(Reply(text="ok"))
        async with up.serve() as url:
            port = url.rsplit(":", 1)[1].split("/")[0]
            with trio.fail_after(5):
                response = await transport.handle_async_request(httpx.Request(
                    "POST", f"http://flaky.test:{port}/v1/chat/completions",
                    content=b'{"model":"m","messages":[{"role":"user","content":"x"}]}'))
                body = await response.aread()
            await transport.aclose()
        return body

    assert b"ok" in trio.run(second)


def _name_request(name: str, port: int = 9) -> Any:
    import httpx

    return httpx.Request("POST", f"http://{name}:{port}/v1/chat/completions",
                         content=b'{"model":"m","messages":[{"role":"user","content":"x"}]}')


def test_a_name_that_recovers_is_looked_up_again_at_the_same_instant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: under a MockClock that stands still, a caller arriving the instant a
    lookup failed -- it never waited -- was given that failure (the outcome was shared
    by time, not by count)."""
    import httpx
    import trio.testing

    real = socket.getaddrinfo
    failing = [True]

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host in ("flip.test", b"flip.test"):
            if failing[0]:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            host = "127.0.0.1"
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def main() -> bytes:
        async with FakeUpstream(Reply(text="ok")).serve() as url, LeanTransport() as transport:
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(_name_request("flip.test", port))
            failing[0] = False
            return await (await transport.handle_async_request(_name_request("flip.test", port))).aread()

    assert b"ok" in trio.run(main, clock=trio.testing.MockClock())


async def test_a_transport_for_many_names_forgets_idle_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a LeanTransport used as a general httpx transport kept every name it
    ever looked up (~11 KB each)."""
    import httpx

    def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    async with LeanTransport() as transport:
        for i in range(600):
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(_name_request(f"n{i}.example.test"))
        assert len(transport._lookups) <= 256


async def test_a_label_no_resolver_takes_is_a_connect_error() -> None:
    """Review: a label over 63 characters raised the IDNA codec's bare UnicodeError
    from a LeanTransport used directly (a Source refuses such a URL at once)."""
    import httpx

    async with LeanTransport() as transport:
        with pytest.raises(httpx.ConnectError, match="not a name that can be looked up"):
            await transport.handle_async_request(_name_request("a" * 64 + ".test"))


@pytest.mark.parametrize(("url", "odd"), [
    ("http://${VLLM_HOST}:8000/v1", "$"),  # a TOML file's template, left unexpanded
    ("http://$VLLM_HOST/v1", "$"),
    ("http://%VLLM_HOST%/v1", "%"),
    ("http://<vllm-host>/v1", "<"),
    ("http://127.0.0.1;8000/v1", ";"),
    ("http://127,0,0,1:8000/v1", ","),
    ("http://loc%61lhost:8000/v1", "%"),
    ("http://*.example.com/v1", "*"),
])
def test_a_host_no_resolver_looks_up_is_refused_at_once(url: str, odd: str) -> None:
    """Review finding (base URLs as deployments write them): IDNA lets '$', '{', ';',
    ',', '%' through, so these were valid settings (`polygate check-config` said
    "valid"), and every call failed "Name or service not known", retried, naming no
    host. The character is said, not the URL."""
    with pytest.raises(polygate.ConfigError, match="which no host name has") as refused:
        polygate.Source(name="a", base_url=url)
    assert repr(odd) in str(refused.value)


@pytest.mark.parametrize("url", [
    "http://vllm_server:8000/v1", "http://[::1]:8000/v1", "http://[fe80::1%25eth0]:8000/v1",
    "http://bücher.example/v1", "http://localhost./v1", "https://API.OpenAI.com/v1",
    "http://10.0.0.7:8000/v1",
])
def test_host_names_and_addresses_as_deployments_write_them_stay_valid(url: str) -> None:
    polygate.Source(name="a", base_url=url)


@pytest.mark.parametrize("url", [
    "https://api.openai.com/v1/chat/completions", "http://h:8000/v1/embeddings/",
    "http://h:8000/v1/completions", "https://h/openai/v1/responses",
])
def test_a_base_url_that_is_an_endpoint_is_warned_of(url: str) -> None:
    """Review finding: the whole endpoint pasted as the base went to
    ".../chat/completions/chat/completions", and the upstream's 404 there marked the
    source dead for dead_cooldown_s."""
    with pytest.warns(polygate.ConfigWarning, match="an endpoint: polygate adds the endpoint"):
        polygate.Source(name="a", base_url=url)
