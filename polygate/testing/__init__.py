"""polygate.testing: a scripted, seeded, deterministic OpenAI-compatible upstream.

``FakeUpstream(behaviour, seed=…)`` answers chat completions and embeddings as a
:class:`Reply` or a :class:`Profile` says, through two faces that send the same
bytes: ``upstream.transport()`` (an httpx transport in trio time, for
``MockClock`` tests) and ``async with upstream.serve() as base_url`` (a real
HTTP/1.1 server on 127.0.0.1).  ``python -m polygate.testing.serve`` runs the
server face on its own.
"""

from ._script import Distribution as Distribution
from ._script import Fault as Fault
from ._script import Profile as Profile
from ._script import Reply as Reply
from ._transport import Router as Router
from ._upstream import Behaviour as Behaviour
from ._upstream import FakeUpstream as FakeUpstream
from ._upstream import Outcome as Outcome
from ._upstream import RecordedRequest as RecordedRequest
from ._upstream import UpstreamStatistics as UpstreamStatistics

__all__ = [
    "Behaviour",
    "Distribution",
    "FakeUpstream",
    "Fault",
    "Outcome",
    "Profile",
    "RecordedRequest",
    "Reply",
    "Router",
    "UpstreamStatistics",
]

for _name in (
    "FakeUpstream",
    "Profile",
    "RecordedRequest",
    "Reply",
    "Router",
    "UpstreamStatistics",
):
    globals()[_name].__module__ = __name__  # tracebacks and reprs say polygate.testing.X
del _name
