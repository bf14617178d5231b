"""What ``polygate.session()`` checks before it connects anything, without connecting.

``polygate check-config`` runs :func:`preflight` after building the settings, so it
refuses exactly what a session would refuse before any I/O: the settings' own
validation, the Redis URL's options and the coredis package (through the very
function the session builds its backend with; for a Redis cache too), and the telemetry sink's kind and
driver (through the first step of opening it).  What needs a connection — a Redis
that answers, a database that can be created or reached — is left to the session.
"""

from __future__ import annotations

from ._config import Settings

__all__ = ["preflight"]


def preflight(settings: Settings) -> None:
    """Raise the :class:`~polygate.ConfigError` ``session(settings)`` would raise
    before connecting, or return."""
    from ._session import _backend_for
    from .cache._cache import check_cache
    from .telemetry._open import check_sink

    _backend_for(settings)  # parses the Redis URL and checks coredis; connects nothing
    check_cache(settings.cache)
    check_sink(settings.telemetry)
