"""What a ``redis://`` URL says, read once for both things polygate keeps in Redis.

The governance backend (``Settings.backend``) and the response cache
(``Settings.cache``) each take a ``redis[s]://[user[:password]@]host[:port][/db]``
URL with options of their own, and three options they share (``prefix``,
``ssl_ca_certs``, ``ssl_cert_reqs``).  The address and the shared options are read
and checked here, so that the two accept and refuse the same URLs with the same
words.  ``say`` is the caller's prefix for its messages (``"backend: "``, or nothing
where the settings validator names the field); no message holds the password.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any
from urllib.parse import SplitResult, unquote

from ._errors import ConfigError

__all__ = ["CERT_REQS", "SHARED_OPTIONS", "client_tls", "redis_address", "shared_option"]

CERT_REQS = ("none", "optional", "required")
#: Options every Redis URL of polygate's takes (each parser adds its own).
SHARED_OPTIONS = ("prefix", "ssl_ca_certs", "ssl_cert_reqs")


def redis_address(shown: str, parts: SplitResult, port: int | None, say: str = "") -> dict[str, Any]:
    """The server a URL names, as fields of the caller's options class.  ``shown`` is
    the masked URL; ``port`` is ``parts.port``, read by the caller (it raises)."""
    if not parts.hostname:
        raise ConfigError(f"{say}{shown!r} has no host")
    path = parts.path.strip("/")
    # ASCII digits only: int() also reads "1_5" as 15 and "\u0661" as 1, so a typo
    # would select another database (another fleet's state) instead of failing.
    if path and not (path.isascii() and path.isdigit()):
        if path.lstrip("-").isascii() and path.lstrip("-").isdigit():
            raise ConfigError(f"{say}the database in {shown!r} must be >= 0")
        raise ConfigError(f"{say}the database in {shown!r} must be a number, got {path!r}")
    db = int(path) if path else 0
    if port == 0:  # (it read as "no port": the default 6379, a server the URL did not name)
        raise ConfigError(f"{say}the port in {shown!r} must be 1 to 65535, got 0")
    return {
        "host": parts.hostname,
        "port": port if port is not None else 6379,
        "db": db,
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "ssl": parts.scheme == "rediss",
    }


def shared_option(options: dict[str, Any], name: str, value: str, say: str = "") -> bool:
    """Check and keep one of :data:`SHARED_OPTIONS`; False for any other name."""
    if name == "prefix":
        # Braces would make a Redis Cluster hash tag of the prefix; blanks break keys.
        if not value or any(c.isspace() or c in "{}" for c in value):
            raise ConfigError(f"{say}option prefix must be a non-empty key prefix, got {value!r}")
    elif name == "ssl_cert_reqs":
        if value not in CERT_REQS:
            raise ConfigError(f"{say}option ssl_cert_reqs must be one of {CERT_REQS}, got {value!r}")
    elif name != "ssl_ca_certs":
        return False
    options[name] = value
    return True


def check_tls_options(scheme: str, options: dict[str, Any], say: str = "") -> None:
    """TLS options on a plain ``redis://`` URL would be ignored: the connection would
    not use TLS while its configuration says how to verify it.  Refused instead."""
    if scheme != "rediss" and ("ssl_ca_certs" in options or "ssl_cert_reqs" in options):
        raise ConfigError(f"{say}options ssl_ca_certs and ssl_cert_reqs need a rediss:// URL")
    ca = options.get("ssl_ca_certs")
    if ca is not None and not os.path.exists(ca):
        # Looked for now, not at the first connection: a missing file is a setting to
        # fix (it surfaced as a bare FileNotFoundError, naming nothing, at session open).
        raise ConfigError(f"{say}option ssl_ca_certs names no file or folder: {ca!r}")
    if ca is not None and not os.path.isdir(ca):
        # Read now as the driver will (it loads the file when the client is built): a
        # file with no certificate in it -- empty, a key, a typo'd path to another
        # file -- surfaced as a bare ssl.SSLError at session open, check-config
        # calling the configuration valid.  (A folder is read lazily, by hash name.)
        try:
            ssl.create_default_context(cafile=ca)
        except (ssl.SSLError, OSError, ValueError) as exc:
            why = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__
            raise ConfigError(
                f"{say}option ssl_ca_certs holds no CA certificate polygate can read: {ca!r} ({why})"
            ) from None


def client_tls(ssl_on: bool, ca: str | None, reqs: str | None, *, log: logging.Logger,
               where: str, exposed: str) -> dict[str, Any]:
    """coredis's TLS keywords for a ``rediss://`` URL's options (none for ``redis://``):
    verified against the system CAs (or ``ssl_ca_certs``) and the host name unless
    ``ssl_cert_reqs=none``, which is said, as a warning, at every connection: anyone
    on the network path can then pose as the server and read ``exposed``."""
    if not ssl_on:
        return {}
    reqs = reqs or "required"
    if reqs == "none":
        log.warning(
            "%s: ssl_cert_reqs=none turns off TLS verification (certificate and host "
            "name): anyone on the network path can pose as the server and read %s",
            where, exposed,
        )
    return {"ssl": True, "ssl_ca_certs": ca, "ssl_cert_reqs": reqs, "ssl_check_hostname": reqs != "none"}
