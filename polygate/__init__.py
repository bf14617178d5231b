"""polygate: a trio-native, structured-concurrency LLM gateway library.

One session fronts several equivalent OpenAI-compatible upstreams and turns each
request into a logical call: admission, retries with a strict error taxonomy,
deadlines, hedged requests, stream watchdogs and honest per-call statistics.
"""

from ._config import Breaker as Breaker
from ._config import ConfigWarning as ConfigWarning
from ._config import Hedge as Hedge
from ._config import Ocr as Ocr
from ._config import Retry as Retry
from ._config import Scope as Scope
from ._config import Serve as Serve
from ._config import ServeKey as ServeKey
from ._config import Settings as Settings
from ._config import Source as Source
from ._config import StreamWatch as StreamWatch
from ._config import Structured as Structured
from ._errors import AllSourcesExhausted as AllSourcesExhausted
from ._errors import ConfigError as ConfigError
from ._errors import DeadlineExceeded as DeadlineExceeded
from ._errors import FatalUpstreamError as FatalUpstreamError
from ._errors import GovernanceBackendError as GovernanceBackendError
from ._errors import PolygateError as PolygateError
from ._errors import RateLimitedError as RateLimitedError
from ._errors import SourceDeadError as SourceDeadError
from ._errors import StreamStalled as StreamStalled
from ._errors import StructuredOutputError as StructuredOutputError
from ._errors import TransientUpstreamError as TransientUpstreamError
from ._errors import UpstreamError as UpstreamError
from ._session import ChatStream as ChatStream
from ._session import Session as Session
from ._session import SessionStatistics as SessionStatistics
from ._session import session as session
from ._types import CallStats as CallStats
from ._types import ChatResponse as ChatResponse
from ._types import EmbeddingResponse as EmbeddingResponse
from ._types import OcrPage as OcrPage
from ._types import OcrResponse as OcrResponse
from ._types import StreamChunk as StreamChunk
from ._types import Usage as Usage

__version__ = "0.1.0"

from ._public import publish as _publish  # (last: see the end of this module)

__all__ = [
    "AllSourcesExhausted",
    "Breaker",
    "CallStats",
    "ChatResponse",
    "ChatStream",
    "ConfigError",
    "ConfigWarning",
    "DeadlineExceeded",
    "EmbeddingResponse",
    "FatalUpstreamError",
    "GovernanceBackendError",
    "Hedge",
    "Ocr",
    "OcrPage",
    "OcrResponse",
    "PolygateError",
    "RateLimitedError",
    "Retry",
    "Scope",
    "Serve",
    "ServeKey",
    "Session",
    "SessionStatistics",
    "Settings",
    "Source",
    "SourceDeadError",
    "StreamChunk",
    "StreamStalled",
    "StreamWatch",
    "Structured",
    "StructuredOutputError",
    "TransientUpstreamError",
    "Usage",
    "UpstreamError",
    "session",
]


# Tracebacks and reprs say polygate.X, not polygate._module.X (as trio does).
_publish(globals(), __all__, __name__)
del _publish
