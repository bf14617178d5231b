"""Egress proxies from the environment (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY, NO_PROXY),
as openai-python and httpx honour them: a source behind a corporate proxy is reached
through it, a source in NO_PROXY or on loopback directly.  Against a real forward
proxy on loopback (absolute-form requests for http, CONNECT tunnels for https) that,
as a proxy does, resolves the source's name itself: ``upstream.test`` (which this
machine cannot resolve) is 127.0.0.1 to it."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import pytest
import trio

import polygate
from polygate.testing import FakeUpstream, Reply
from polygate.transport._proxies import environment_proxies

from .conftest import MESSAGES

_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
               "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD")


@pytest.fixture(autouse=True)
def _no_proxies_but_the_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)


#: What the proxy's resolver says that this machine's does not.
_NAMES = {"upstream.test": "127.0.0.1"}


def _named(url: str) -> str:
    return url.replace("127.0.0.1", "upstream.test")


@attrs.define
class ForwardProxy:
    """A forward proxy: what it was asked (request lines), and with what credentials."""

    url: str = ""
    lines: list[str] = attrs.field(factory=list)
    credentials: list[str | None] = attrs.field(factory=list)
    refuse: int | None = None  # answer every request with this status instead


async def _pipe(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await sink.aclose()


@asynccontextmanager
async def forward_proxy(refuse: int | None = None) -> AsyncIterator[ForwardProxy]:
    proxy = ForwardProxy(refuse=refuse)

    async def handle(client: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await client.receive_some(65536)
            if not data:
                return
            head += data
        head, rest = head.split(b"\r\n\r\n", 1)
        line, *fields = head.decode("latin-1").split("\r\n")
        proxy.lines.append(line)
        headers = dict(f.split(": ", 1) for f in fields)
        proxy.credentials.append(headers.get("Proxy-Authorization") or headers.get("proxy-authorization"))
        if proxy.refuse is not None:
            await client.send_all(f"HTTP/1.1 {proxy.refuse} No\r\ncontent-length: 0\r\n"
                                  "connection: close\r\n\r\n".encode())
            await client.aclose()
            return
        method, target, version = line.split(" ")
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            upstream = await trio.open_tcp_stream(_NAMES.get(host, host), int(port))
            await client.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            sent = rest
        else:  # absolute form: http://host:port/path
            authority, _, path = target.split("://", 1)[1].partition("/")
            host, port = authority.rsplit(":", 1)
            upstream = await trio.open_tcp_stream(_NAMES.get(host, host), int(port))
            # (One request a connection, so that each is seen here: its upstream
            # closes after answering, and the pipes close the client's connection.)
            kept = [f for f in fields if not f.lower().startswith(("proxy-", "connection:"))]
            sent = "\r\n".join([f"{method} /{path} {version}", *kept, "connection: close"]).encode() \
                + b"\r\n\r\n" + rest
        if sent:
            await upstream.send_all(sent)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pipe, client, upstream)
            nursery.start_soon(_pipe, upstream, client)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        listener = listeners[0]
        proxy.url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        yield proxy
        nursery.cancel_scope.cancel()


def _settings(url: str) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url=url, api_key="sk-upstream-key", model="m")],
        call_deadline_s=20)})


async def test_a_source_behind_an_http_proxy_is_reached_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async with FakeUpstream(Reply(text="through")).serve() as url, forward_proxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        async with polygate.session(_settings(_named(url))) as s:
            r = await s.chat(MESSAGES)
            async with s.stream_chat(MESSAGES) as stream:
                text = "".join([chunk.text async for chunk in stream])
    assert r.text == text == "through"
    assert [line.split(" ")[:2] for line in proxy.lines] == [["POST", _named(url) + "/chat/completions"]] * 2
    # (Timed from the request's write, which httpcore's trace reports through a proxy.)
    assert r.call_stats.ttft_ms is not None and stream.response.call_stats.ttft_ms is not None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
async def test_a_source_on_loopback_is_reached_directly(
    monkeypatch: pytest.MonkeyPatch, host: str,
) -> None:
    """A proxy elsewhere would reach its own loopback, not this machine's (Go's
    net/http never proxies loopback either)."""
    upstream = FakeUpstream(Reply(text="direct"))
    bind = "::1" if host == "[::1]" else "127.0.0.1"
    try:
        serving = upstream.serve(host=bind)
        url = await serving.__aenter__()
    except OSError:
        pytest.skip(f"no {bind} here")
    try:
        async with forward_proxy() as proxy:
            monkeypatch.setenv("ALL_PROXY", proxy.url)
            port = url.rsplit(":", 1)[1]
            async with polygate.session(_settings(f"http://{host}:{port}")) as s:
                assert (await s.chat(MESSAGES)).text == "direct"
    finally:
        await serving.__aexit__(None, None, None)
    assert proxy.lines == []


async def test_an_https_source_is_reached_through_a_connect_tunnel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    """The tunnel carries TLS end to end, verified with the pool's own CAs
    (SSL_CERT_FILE here)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("upstream.test").configure_cert(server_context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "tls"},
                                    "finish_reason": "stop"}]}).encode()

    async def serve(tls: trio.SSLStream[trio.SocketStream]) -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                data += await tls.receive_some(65536)
            await tls.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                               b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            tls.transport_stream.socket.close()

    async with trio.open_nursery() as nursery, forward_proxy() as proxy:
        listeners = await nursery.start(partial(trio.serve_ssl_over_tcp, serve, 0, server_context,
                                                host="127.0.0.1"))
        port = listeners[0].transport_listener.socket.getsockname()[1]
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[polygate.Source(
            name="a", base_url=f"https://upstream.test:{port}/v1", api_key="k", streaming=False)])})
        async with polygate.session(settings) as s:
            r = await s.chat(MESSAGES)
            assert r.text == "tls" and r.call_stats.generation_ms > 0
        nursery.cancel_scope.cancel()
    assert proxy.lines == [f"CONNECT upstream.test:{port} HTTP/1.1"]


async def test_the_proxys_credentials_go_to_it_and_nowhere_else(monkeypatch: pytest.MonkeyPatch) -> None:
    up = FakeUpstream(Reply(text="ok"))
    async with up.serve() as url, forward_proxy() as proxy:
        monkeypatch.setenv("http_proxy", proxy.url.replace("://", "://alice:pr0xy-s3cret@"))
        async with polygate.session(_settings(_named(url))) as s:
            assert (await s.chat(MESSAGES)).text == "ok"
    assert proxy.credentials == ["Basic " + base64.b64encode(b"alice:pr0xy-s3cret").decode()]
    assert not any(k.lower().startswith("proxy-") for k in up.requests[0].headers)


@pytest.mark.parametrize("https", [False, True])
async def test_a_proxy_refusing_its_credentials_marks_the_source_dead_without_showing_them(
    monkeypatch: pytest.MonkeyPatch, https: bool,
) -> None:
    """407, for a plain request (the proxy's answer) and a tunnel (httpx's ProxyError
    for the CONNECT): the source is unusable as configured, as after a 401."""
    async with forward_proxy(refuse=407) as proxy:
        monkeypatch.setenv("ALL_PROXY", proxy.url.replace("://", "://alice:pr0xy-s3cret@"))
        url = "https://upstream.test:9/v1" if https else "http://upstream.test:9/v1"
        async with polygate.session(_settings(url)) as s:
            with pytest.raises(polygate.PolygateError) as caught:
                await s.chat(MESSAGES)
    error = caught.value
    assert isinstance(error, polygate.AllSourcesExhausted), repr(error)
    assert all(isinstance(e, polygate.SourceDeadError) for e in error.errors), error.errors
    assert "pr0xy-s3cret" not in repr(error) + str(error) + "".join(map(str, error.errors))


def _proxied(monkeypatch: pytest.MonkeyPatch, urls: list[str], env: dict[str, str]) -> Any:
    """What the environment ``env`` (the proxy variables of this process's, only)
    proxies among ``urls``."""
    with monkeypatch.context() as patched:
        for name in _PROXY_VARS:
            patched.delenv(name, raising=False)
        for name, value in env.items():
            patched.setenv(name, value)
        return environment_proxies(urls)


def test_which_sources_a_proxy_carries(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"HTTPS_PROXY": "proxy:3128", "http_proxy": "http://p2:8080",
           "NO_PROXY": "internal.example,.corp.example,10.0.0.7"}
    urls = ["https://api.openai.com/v1", "http://vllm.internal.example:8000/v1",
            "http://a.corp.example/v1", "http://10.0.0.7:8000/v1", "http://other/v1",
            "http://127.0.0.2:8000/v1", "http://[::1]:8000/v1", "http://localhost:8000/v1"]
    assert _proxied(monkeypatch, urls, env) == {
        ("https", "api.openai.com", 443): "http://proxy:3128",
        ("http", "other", 80): "http://p2:8080",
    }
    assert _proxied(monkeypatch, urls, {**env, "NO_PROXY": "*"}) == {}
    assert _proxied(monkeypatch, urls, {}) == {}
    # A CGI request's HTTP_PROXY is its client's header (httpoxy), never a proxy.
    assert _proxied(monkeypatch, ["http://other/v1"], {"HTTP_PROXY": "p", "REQUEST_METHOD": "GET"}) == {}


async def test_a_socks_proxy_without_its_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import socksio  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("socksio is installed")
    monkeypatch.setenv("ALL_PROXY", "socks5://bob:s0cks-s3cret@127.0.0.1:1080")
    with pytest.raises(polygate.ConfigError, match=r"httpx\[socks\]") as caught:
        async with polygate.session(_settings("http://upstream.test:9/v1")):
            pass
    assert "s0cks-s3cret" not in str(caught.value)


@pytest.mark.parametrize("proxy", [
    "http://alice:Sup3rS3cretPart/x@proxy.example:3128",
    "http://alice:Sup3rS3cretPart#x@proxy.example:3128",
    "http://alice:Sup3rS3cretPart@[::1:3128x",
])
async def test_a_proxy_url_that_cannot_be_read_is_refused_without_its_password(
    monkeypatch: pytest.MonkeyPatch, proxy: str,
) -> None:
    """Review: httpx read a password holding "/" as a port, and its message (quoted)
    showed the password; an unclosed IPv6 bracket was a bare ValueError."""
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    with pytest.raises(polygate.ConfigError) as caught:
        async with polygate.session(_settings("https://upstream.test/v1")):
            pass
    assert "S3cret" not in str(caught.value) and "percent-encode" in str(caught.value)


async def test_a_refused_proxy_sends_nothing_and_so_charges_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a request handed to httpx's transport counted as sent before it was: a
    proxy that refused connections filled the source's rpm and tpm windows (the
    fleet's, on Redis), where a refused direct connect charges nothing."""
    async with forward_proxy() as proxy:
        port = proxy.url.rsplit(":", 1)[1]
    # (the proxy's port, now closed: connections to it are refused)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    settings = polygate.Settings(scopes={"chat": polygate.Scope(sources=[polygate.Source(
        name="a", base_url="http://upstream.test:9/v1", api_key="k", rpm=100)])})
    async with polygate.session(settings) as s:
        with pytest.raises(polygate.AllSourcesExhausted):
            await s.chat(MESSAGES)
        state = (await s.statistics()).governance.sources[0].state
    assert (state.requests_in_window, state.tokens_in_window) == (0, 0)


def test_no_proxy_takes_address_ranges_and_a_loopback_name_with_its_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: NO_PROXY=10.0.0.0/8 (as curl, requests and Go read it; common in
    clusters) was ignored; ``localhost.`` was proxied."""
    env = {"ALL_PROXY": "http://proxy:3128", "NO_PROXY": "10.0.0.0/8, fd00::/8"}
    urls = ["http://10.1.2.3:8000/v1", "http://[fd00::2]:8000/v1", "http://11.0.0.1/v1",
            "http://localhost.:8000/v1"]
    assert _proxied(monkeypatch, urls, env) == {("http", "11.0.0.1", 80): "http://proxy:3128"}


@pytest.mark.parametrize(("message", "dead"), [
    ("407 Proxy Authentication Required", True),
    ("403 Forbidden", True),
    ("Invalid username/password", True),
    # (httpcore's own method names, spaces and all: a proxy wanting credentials none
    # were given for, or refusing those given.)
    ("Requested NO AUTHENTICATION REQUIRED from proxy server, but got NO ACCEPTABLE METHODS.", True),
    ("Requested NO AUTHENTICATION REQUIRED from proxy server, but got USERNAME/PASSWORD.", True),
    ("Requested USERNAME/PASSWORD from proxy server, but got NO AUTHENTICATION REQUIRED.", True),
    ("Proxy Server could not connect: Connection not allowed by ruleset.", True),
    ("Proxy Server could not connect: Host unreachable.", False),
    ("Proxy Server could not connect: Connection refused.", False),
    ("502 Bad Gateway", False),
])
def test_a_proxys_refusal_is_the_configurations_its_failure_the_sources(message: str, dead: bool) -> None:
    """Review: a SOCKS proxy refusing its credentials or the source (httpcore's words)
    was transient, retried and fed the breaker, where an HTTP proxy's 407 or 403
    makes the source dead; a proxy that cannot reach the source is the source's."""
    import httpx

    from polygate._errors import classify_exception

    error = classify_exception(httpx.ProxyError(message), source="a")
    assert isinstance(error, polygate.SourceDeadError) is dead, error
    assert isinstance(error, polygate.TransientUpstreamError) is not dead


async def test_a_proxy_of_a_scheme_no_one_speaks_is_named_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a socks4:// proxy was refused with advice to percent-encode a password."""
    monkeypatch.setenv("ALL_PROXY", "socks4://127.0.0.1:1080")
    with pytest.raises(polygate.ConfigError, match=r"scheme 'socks4'.*http, https, socks5") as caught:
        async with polygate.session(_settings("http://upstream.test:9/v1")):
            pass
    assert "percent-encode" not in str(caught.value)


async def test_a_proxy_without_a_scheme_whose_password_holds_one_is_not_quoted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review: everything before "://" was taken for a scheme, the credentials too,
    and quoted.  A colon is no scheme's: this is http:// with a password (as curl
    reads it), whose "//" leaves it unreadable."""
    monkeypatch.setenv("ALL_PROXY", "alice:s3cr://et@proxy.corp:3128")
    with pytest.raises(polygate.ConfigError) as caught:
        async with polygate.session(_settings("http://upstream.test:9/v1")):
            pass
    assert "s3cr" not in str(caught.value) and "alice" not in str(caught.value)


def test_an_ipv4_mapped_loopback_source_is_never_proxied(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"http_proxy": "http://proxy:3128"}
    assert _proxied(monkeypatch, ["http://[::ffff:127.0.0.1]:8000/v1"], env) == {}


@pytest.mark.parametrize("proxy", ['"http://proxy.corp:3128"', "'http://proxy.corp:3128'",
                                   " http://proxy.corp:3128", "_http://proxy.corp:3128",
                                   "\thttps://proxy.corp:3128", "://proxy.corp:3128"])
async def test_a_proxy_url_with_a_scheme_no_one_speaks_is_refused_at_open(
    monkeypatch: pytest.MonkeyPatch, proxy: str,
) -> None:
    """Review of the scheme fix: a value quoted as some env files keep quotes, or with
    a blank before it, was taken for a URL without a scheme, given http://, and every
    call went to a proxy host named after the scheme."""
    monkeypatch.setenv("ALL_PROXY", proxy)
    with pytest.raises(polygate.ConfigError, match="scheme"):
        async with polygate.session(_settings("http://upstream.test:9/v1")):
            pass
