"""The OpenAI-compatible wire: request bodies, SSE decoding, message assembly.

Knows nothing of admission, hedging or retries (an import-linter contract keeps it so).
"""

from ._assemble import (
    ChatAssembler,
    TextParts,
    carries_audio,
    carries_extras,
    drop_last,
    has_content,
    message_text,
    shows_call_or_refusal,
)
from ._exchange import END_GRACE_S, OnContent, OnExtra, Timeline, chat_exchange, embeddings_exchange
from ._pool import REPORTS_SENT, SENT_EXTENSION, LeanTransport
from ._proxies import routed
from ._wire import Endpoint, Limits, parse_retry_after

__all__ = [
    "END_GRACE_S",
    "REPORTS_SENT",
    "SENT_EXTENSION",
    "ChatAssembler",
    "Endpoint",
    "LeanTransport",
    "Limits",
    "OnContent",
    "OnExtra",
    "TextParts",
    "drop_last",
    "Timeline",
    "carries_audio",
    "carries_extras",
    "chat_exchange",
    "embeddings_exchange",
    "has_content",
    "message_text",
    "parse_retry_after",
    "routed",
    "shows_call_or_refusal",
]
