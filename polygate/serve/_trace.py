"""The gateway as one hop of a distributed trace: a request's W3C trace context
(``traceparent``, and what else the application's propagator reads: ``tracestate``,
``baggage``) becomes the current context while its logical call runs, so the call's
span is a child of the client's.  Only when the session traces (the application set
a tracer provider, as ``opentelemetry-instrument polygate serve`` does): otherwise
OpenTelemetry is not imported and nothing is read."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

__all__ = ["Joiner", "joiner"]

#: The context manager a request's call runs in.
Joiner = Callable[[Mapping[str, str]], contextlib.AbstractContextManager[None]]


def joiner() -> Joiner:
    """What joins a request's call to its client's trace (called once per session
    generation, only when that session traces)."""
    from opentelemetry import context, propagate

    textmap = propagate.get_global_textmap()
    fields = frozenset(textmap.fields)  # (lower case, as the request's header names)

    @contextlib.contextmanager
    def join(headers: Mapping[str, str]) -> Iterator[None]:
        if fields.isdisjoint(headers):  # (the common case: a client that does not trace)
            yield
            return
        # A malformed header extracts to an empty context: the call starts a trace.
        token = context.attach(textmap.extract(headers))
        try:
            yield
        finally:
            context.detach(token)

    return join
