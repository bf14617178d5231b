"""Egress proxies from the environment: ``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``
and ``NO_PROXY`` (either case), read as curl, httpx and openai-python read them.

polygate's own pool (:class:`LeanTransport`) connects directly.  A source that a
proxy from the environment carries (its scheme's proxy, or ``ALL_PROXY``, and its host
neither in ``NO_PROXY`` nor a loopback one) is reached through httpx's transport with that proxy instead --
``CONNECT`` tunnels for ``https``, absolute-form requests for ``http``, a SOCKS
proxy with ``httpx[socks]`` -- with the pool's TLS settings.  Which sources are
proxied is decided once, when the session opens, from the environment then.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from .._errors import ConfigError
from ._pool import _DEFAULT_PORTS, REPORTS_SENT, SENT_EXTENSION, LeanTransport

__all__ = ["ProxyRouter", "environment_proxies", "routed"]

#: The proxies httpx (httpcore) speaks: HTTP to the proxy, TLS to it, SOCKS5 (with the
#: destination's name resolved by the proxy, either way).
_SCHEMES = ("http", "https", "socks5", "socks5h")

#: An origin: scheme, host (as the request URL has it: lower case, IDNA), port.
Origin = tuple[str, str, int]


def environment_proxies(base_urls: Iterable[str]) -> dict[Origin, str]:
    """The proxy URL of each origin among ``base_urls`` that the environment's proxies
    carry, read by :mod:`urllib.request` (a lower-case name before its upper-case twin;
    ``HTTP_PROXY`` ignored in a CGI request, as there it is a client's header)."""
    proxies = urllib.request.getproxies_environment()
    if not proxies:
        return {}
    # (urllib's NO_PROXY matching, as curl's: suffixes, "*", an entry's port; not in
    # typeshed, present in every Python polygate runs on.)
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    found: dict[Origin, str] = {}
    for url in base_urls:
        origin = _origin(httpx.URL(url))
        scheme, host, port = origin
        proxy = proxies.get(scheme) or proxies.get("all")
        if not proxy:
            continue
        address = _address(host)
        if (_loopback(host, address) or bypass(f"{host}:{port}", proxies)
                or _in_ranges(address, proxies.get("no", ""))):
            continue
        found[origin] = proxy if _scheme(proxy) is not None else f"http://{proxy}"
    return found


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _scheme(proxy: str) -> str | None:
    """What the proxy URL has for a scheme: the text before its "://" (refused unless
    a scheme polygate speaks: a quote or a blank before it is a mistake to say, not a
    host name to try), or None where it has none -- no "://", or a user name and
    password before it (a password may hold "://": curl reads that URL as http)."""
    head, sep, _ = proxy.partition("://")
    if not sep or ":" in head or "@" in head:
        return None
    return head


def _loopback(host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
    """A loopback host: never proxied (as Go's net/http has it), for a proxy
    elsewhere would reach its own loopback, not this machine's."""
    host = host.rstrip(".")  # (``localhost.`` is localhost: a name's root dot)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    if address is None:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # (::ffff:127.0.0.1 is 127.0.0.1)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _in_ranges(address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, no_proxy: str) -> bool:
    """Whether ``address`` is inside one of NO_PROXY's address ranges (``10.0.0.0/8``,
    ``fd00::/8``: as curl, requests and Go read them, where urllib matches only whole
    addresses and names)."""
    if address is None:
        return False
    for entry in no_proxy.split(","):
        entry = entry.strip().strip("[]")
        if "/" not in entry:
            continue
        try:
            if address in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:  # (an entry that is no range: urllib's to read, or nobody's)
            continue
    return False


def _origin(url: httpx.URL) -> Origin:
    return url.scheme, url.raw_host.decode("ascii"), url.port or _DEFAULT_PORTS.get(url.scheme, 0)


def routed(lean: LeanTransport, base_urls: Iterable[str]) -> httpx.AsyncBaseTransport:
    """``lean``, or a :class:`ProxyRouter` over it when the environment's proxies carry
    some of ``base_urls``; :class:`ConfigError` for a proxy that cannot be used."""
    found = environment_proxies(base_urls)
    if not found:
        return lean
    # (A transport opens nothing until its first request: one refused here leaves
    # nothing to close.)
    through = {proxy: proxy_transport(proxy, lean) for proxy in dict.fromkeys(found.values())}
    return ProxyRouter(lean, {origin: through[proxy] for origin, proxy in found.items()})


def proxy_transport(proxy: str, lean: LeanTransport) -> httpx.AsyncHTTPTransport:
    """httpx's transport through ``proxy``, with ``lean``'s TLS settings (its CAs,
    ``SSL_CERT_FILE`` included, and HTTP/1.1) for the upstream behind it."""
    written = _scheme(proxy)
    scheme = "http" if written is None else written.lower()
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"the proxy {shown(proxy)} from the environment has the scheme {scheme!r}, "
            f"which polygate does not speak ({', '.join(_SCHEMES)})"
        )
    try:
        parsed = httpx.Proxy(proxy)
    except (ValueError, TypeError, httpx.InvalidURL):
        # (Not httpx's words: a password holding "/" is read as the port, and quoted.)
        raise ConfigError(
            f"the proxy {shown(proxy)} from the environment is not a URL that can be "
            "read: check it, and percent-encode any of : / ? # @ [ ] in its user name or "
            "password"
        ) from None
    try:
        return httpx.AsyncHTTPTransport(
            proxy=parsed, verify=lean.tls_context(), trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
    except ImportError:  # (a SOCKS proxy without socksio)
        raise ConfigError(
            f"the proxy {shown(proxy)} from the environment is a SOCKS proxy: install "
            "httpx's SOCKS support (pip install 'httpx[socks]'), or leave the source out "
            "of it in NO_PROXY"
        ) from None


def shown(proxy: str) -> str:
    """A proxy URL without its credentials, quoted: its scheme, host and port, read
    after the last "@" (a password may hold "/", "#" or "@" unencoded), or "…" where
    they do not read."""
    written = _scheme(proxy)
    rest = proxy if written is None else proxy[len(written) + 3:]
    scheme = "http" if written is None else written
    authority = re.split(r"[/?#]", rest.rpartition("@")[2], maxsplit=1)[0]
    try:
        parts = urlsplit(f"//{authority}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host:
        return repr(f"{scheme}://…")
    host = f"[{host}]" if ":" in host else host
    return repr(f"{scheme}://{host}{f':{port}' if port else ''}")


class ProxyRouter(httpx.AsyncBaseTransport):
    """polygate's pool for every origin but those a proxy carries, which go through
    that proxy's transport."""

    # (It says when a request is written: the pool its own way; for a proxied one,
    # through httpcore's trace, as its head starts going out -- past the connect to
    # the proxy, its tunnel and the TLS in it, as for a direct connection.)
    polygate_reports_sent = True

    def __init__(self, direct: LeanTransport, proxied: Mapping[Origin, httpx.AsyncBaseTransport]) -> None:
        self.direct = direct
        self._proxied = dict(proxied)

    def __repr__(self) -> str:
        return f"<ProxyRouter proxied={len(self._proxied)} direct={self.direct!r}>"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        through = self._proxied.get(_origin(request.url))
        if through is None:
            return await self.direct.handle_async_request(request)
        sent: Any = request.extensions.get(SENT_EXTENSION)
        if sent is not None:
            request.extensions["trace"] = _on_write(sent, request.extensions.get("trace"))
        return await through.handle_async_request(request)

    async def aclose(self) -> None:
        try:
            for transport in self._proxied.values():
                await transport.aclose()
        finally:
            await self.direct.aclose()


def _on_write(sent: Callable[[], None], earlier: Any) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
    """An httpcore trace that calls ``sent`` as the request's head starts out (not a
    tunnel's ``CONNECT``, which goes first on the same trace), then ``earlier``'s."""
    written = False

    async def trace(event: str, info: dict[str, Any]) -> None:
        nonlocal written
        if event == "http11.send_request_headers.started" and not written:
            head = info.get("request")
            if getattr(head, "method", None) != b"CONNECT":
                written = True
                sent()
        if earlier is not None:
            await earlier(event, info)

    return trace


assert REPORTS_SENT == "polygate_reports_sent"  # (the attribute above is that one)
