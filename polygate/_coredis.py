"""What the Redis governance backend and the Redis cache share about coredis: the lazy
import (coredis is the ``redis`` extra), a connection class that cleans up after
itself when Redis is down, and how a Redis server's words are quoted in a message."""

from __future__ import annotations

from typing import Any

from ._errors import ConfigError
from ._secrets import masked, printable

__all__ = ["closing_connection_class", "import_coredis", "server_words"]


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


def server_words(text: str, password: str | None) -> str:
    """An error's text for a message: the password masked however the server quoted
    it (``_secrets.masked``), and nothing in it a terminal or a log's reader acts on
    (an error reply's CR that overwrites the line, an escape): the server's words
    are its own."""
    return printable(masked(text, password) if password else text)
