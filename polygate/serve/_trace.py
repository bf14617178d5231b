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
    from opentelemetry.propagators.textmap import Getter

    textmap = propagate.get_global_textmap()
    # Header names are compared in lower case, as the request's are (a propagator may
    # name its field otherwise: AWS X-Ray's ``X-Amzn-Trace-Id``).
    fields = frozenset(field.lower() for field in textmap.fields)

    class _Headers(Getter[Mapping[str, str]]):
        """The request's headers, by any case of their names."""

        def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
            value = carrier.get(key.lower())
            return None if value is None else [value]

        def keys(self, carrier: Mapping[str, str]) -> list[str]:
            return list(carrier)

    getter = _Headers()

    @contextlib.contextmanager
    def join(headers: Mapping[str, str]) -> Iterator[None]:
        if fields.isdisjoint(headers):  # (the common case: a client that does not trace)
            yield
            return
        # A malformed header extracts to an empty context: the call starts a trace.  A
        # propagator that raises on one does too: tracing never fails the call.
        try:
            joined = textmap.extract(headers, getter=getter)
        except Exception:
            joined = None
        if joined is None:  # (outside the handler: the call's own errors keep no trace of it)
            yield
            return
        token = context.attach(joined)
        try:
            yield
        finally:
            context.detach(token)

    return join
