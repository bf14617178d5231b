"""What the Redis governance backend and the Redis cache share about coredis: the lazy
import (coredis is the ``redis`` extra) and a connection class that cleans up after
itself when Redis is down."""

from __future__ import annotations

from typing import Any

from ._errors import ConfigError

__all__ = ["closing_connection_class", "import_coredis"]


def import_coredis(what: str) -> Any:
    """The coredis module; ConfigError naming ``what`` needs it when it is missing."""
    try:
        import coredis
        import coredis.exceptions
        import coredis.retry
    except ImportError:
        raise ConfigError(f"{what} needs the coredis package: pip install 'coredis>=6.9,<7' (polygate's redis extra)") from None
    return coredis


def closing_connection_class(coredis: Any) -> Any:
    """coredis's TCP connection, closing its in-memory streams when it ends.

    A connection that never connects (Redis down) leaves them open, and each warns
    when collected; during an outage that is one warning per attempted call."""
    from anyio import TASK_STATUS_IGNORED
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    class ClosingTCPConnection(coredis.connection.TCPConnection):  # type: ignore[misc]
        async def run(self, *, task_status: Any = TASK_STATUS_IGNORED) -> None:
            try:
                await super().run(task_status=task_status)
            finally:
                for value in vars(self).values():
                    if isinstance(value, (MemoryObjectSendStream, MemoryObjectReceiveStream)):
                        value.close()

    return ClosingTCPConnection
