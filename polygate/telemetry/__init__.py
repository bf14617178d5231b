"""Telemetry: every logical call and attempt as a row, written off the call path.

Calls report to a recorder that freezes each call and attempt into an event and
``send_nowait``-s it into a bounded channel; a flusher task in the session's nursery
writes batches to a sink (SQLite, PostgreSQL, or any :class:`Sink`) in a worker
thread.  A slow, full or dead sink costs rows — dropped, counted in
:class:`TelemetryStatistics` and logged — never a call's time.  OpenTelemetry spans
(extra ``otel``) come from the same recorder hook.  See ``docs/telemetry.md``.
"""

from ._events import AttemptEvent as AttemptEvent
from ._events import CallEvent as CallEvent
from ._events import SessionEvent as SessionEvent
from ._open import Telemetry as Telemetry
from ._open import open_sink as open_sink
from ._open import open_telemetry as open_telemetry
from ._schema import SCHEMA_VERSION as SCHEMA_VERSION
from ._sink import Batch as Batch
from ._sink import Pipeline as Pipeline
from ._sink import Sink as Sink
from ._sink import TelemetryStatistics as TelemetryStatistics
from ._sqlite import default_path as default_path

__all__ = [
    "SCHEMA_VERSION",
    "AttemptEvent",
    "Batch",
    "CallEvent",
    "Pipeline",
    "SessionEvent",
    "Sink",
    "Telemetry",
    "TelemetryStatistics",
    "default_path",
    "open_sink",
    "open_telemetry",
]
