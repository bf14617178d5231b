"""polygate.testing: a scripted, seeded, deterministic OpenAI-compatible upstream.

``FakeUpstream(behaviour, seed=…)`` answers chat completions and embeddings as a
:class:`Reply` or a :class:`Profile` says, through two faces that send the same
bytes: ``upstream.transport()`` (an httpx transport in trio time, for
``MockClock`` tests) and ``async with upstream.serve() as base_url`` (a real
HTTP/1.1 server on 127.0.0.1).  ``python -m polygate.testing.serve`` runs the
server face on its own.

The scheduling-aware kit: :class:`EventTransport` answers from the same
FakeUpstreams, but its bodies wake the way sockets do — through events shared by
every path due at one instant, delivering what has already arrived without a
checkpoint — and :class:`Schedule` runs a test under one seeded, reproducible
interleaving of trio's scheduler.  Hypothesis strategies for both live in
:mod:`polygate.testing.strategies` (which needs ``hypothesis``).
"""

from .._public import publish as _publish
from ._events import EventStatistics as EventStatistics
from ._events import EventTransport as EventTransport
from ._schedule import Schedule as Schedule
from ._script import Distribution as Distribution
from ._script import Fault as Fault
from ._script import Profile as Profile
from ._script import Reply as Reply
from ._script import ToolCall as ToolCall
from ._transport import Router as Router
from ._upstream import Behaviour as Behaviour
from ._upstream import FakeUpstream as FakeUpstream
from ._upstream import Outcome as Outcome
from ._upstream import RecordedRequest as RecordedRequest
from ._upstream import UpstreamStatistics as UpstreamStatistics

__all__ = [
    "Behaviour",
    "Distribution",
    "EventStatistics",
    "EventTransport",
    "FakeUpstream",
    "Fault",
    "Outcome",
    "Profile",
    "RecordedRequest",
    "Reply",
    "Router",
    "Schedule",
    "ToolCall",
    "UpstreamStatistics",
]

_publish(globals(), (
    "EventStatistics",
    "EventTransport",
    "FakeUpstream",
    "Profile",
    "RecordedRequest",
    "Reply",
    "Router",
    "Schedule",
    "ToolCall",
    "UpstreamStatistics",
), __name__)  # tracebacks and reprs say polygate.testing.X
del _publish
