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
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from .._errors import ConfigError
from ._pool import REPORTS_SENT, SENT_EXTENSION, LeanTransport

__all__ = ["ProxyRouter", "environment_proxies", "routed"]

_DEFAULT_PORTS = {"http": 80, "https": 443}

#: An origin: scheme, host (as the request URL has it: lower case, IDNA), port.
Origin = tuple[str, str, int]


def environment_proxies(
    base_urls: Iterable[str], env: Mapping[str, str] | None = None
) -> dict[Origin, str]:
    """The proxy URL of each origin among ``base_urls`` that the environment's proxies
    carry (``env``: default ``os.environ``, through :mod:`urllib.request`'s reading of
    it: a lower-case name before its upper-case twin; ``HTTP_PROXY`` ignored in a CGI
    request, as there it is a client's header)."""
    proxies = _proxies(env)
    if not proxies:
        return {}
    found: dict[Origin, str] = {}
    for url in base_urls:
        origin = _origin(url)
        scheme, host, port = origin
        proxy = proxies.get(scheme) or proxies.get("all")
        # (urllib's NO_PROXY matching, as curl's: suffixes, "*", an entry's port; not
        # in typeshed, present in every Python polygate runs on.)
        bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
        if not proxy or _loopback(host) or bypass(f"{host}:{port}", proxies):
            continue
        found[origin] = proxy if "://" in proxy else f"http://{proxy}"
    return found


def _loopback(host: str) -> bool:
    """A loopback host: never proxied (as Go's net/http has it), for a proxy
    elsewhere would reach its own loopback, not this machine's."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _proxies(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return urllib.request.getproxies_environment()
    # (getproxies_environment reads os.environ only: the same rules over ``env``.)
    proxies: dict[str, str] = {}
    for name, value in env.items():
        if value and name.lower().endswith("_proxy"):
            proxies.setdefault(name[:-6].lower(), value)  # (either case: the first kept)
    lower = {n[:-6]: v for n, v in env.items() if n.endswith("_proxy") and n[:-6].islower() and v}
    proxies.update(lower)  # the lower-case name wins, as urllib has it
    if "REQUEST_METHOD" in env:
        proxies.pop("http", None)
    return proxies


def _origin(url: str) -> Origin:
    parsed = httpx.URL(url)
    scheme = parsed.scheme
    return scheme, parsed.raw_host.decode("ascii"), parsed.port or _DEFAULT_PORTS.get(scheme, 0)


def routed(
    lean: LeanTransport, base_urls: Iterable[str], env: Mapping[str, str] | None = None
) -> httpx.AsyncBaseTransport:
    """``lean``, or a :class:`ProxyRouter` over it when the environment's proxies carry
    some of ``base_urls``; :class:`ConfigError` for a proxy that cannot be used."""
    found = environment_proxies(base_urls, env)
    if not found:
        return lean
    # (A transport opens nothing until its first request: one refused here leaves
    # nothing to close.)
    through = {proxy: proxy_transport(proxy, lean) for proxy in dict.fromkeys(found.values())}
    return ProxyRouter(lean, {origin: through[proxy] for origin, proxy in found.items()})


def proxy_transport(proxy: str, lean: LeanTransport) -> httpx.AsyncHTTPTransport:
    """httpx's transport through ``proxy``, with ``lean``'s TLS settings (its CAs,
    ``SSL_CERT_FILE`` included, and HTTP/1.1) for the upstream behind it."""
    try:
        parsed = httpx.Proxy(proxy)
    except (ValueError, TypeError, httpx.InvalidURL) as exc:
        raise ConfigError(f"the proxy {shown(proxy)} from the environment cannot be used: {exc}") from None
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
    """A proxy URL without its credentials (``user:password@``), quoted."""
    parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return repr(f"{parts.scheme}://{host}{port}")


class ProxyRouter(httpx.AsyncBaseTransport):
    """polygate's pool for every origin but those a proxy carries, which go through
    that proxy's transport."""

    # (It says when a request is handed over: the pool its own way; for a proxied one,
    # as it is handed to httpx's transport, which cannot say when it writes.)
    polygate_reports_sent = True

    def __init__(self, direct: LeanTransport, proxied: Mapping[Origin, httpx.AsyncBaseTransport]) -> None:
        self.direct = direct
        self._proxied = dict(proxied)

    def __repr__(self) -> str:
        return f"<ProxyRouter proxied={len(self._proxied)} direct={self.direct!r}>"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.scheme, url.raw_host.decode("ascii"), url.port or _DEFAULT_PORTS.get(url.scheme, 0))
        through = self._proxied.get(key)
        if through is None:
            return await self.direct.handle_async_request(request)
        sent: Any = request.extensions.get(SENT_EXTENSION)
        if sent is not None:
            sent()
        return await through.handle_async_request(request)

    async def aclose(self) -> None:
        try:
            for transport in self._proxied.values():
                await transport.aclose()
        finally:
            await self.direct.aclose()


assert REPORTS_SENT == "polygate_reports_sent"  # (the attribute above is that one)
