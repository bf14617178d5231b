"""Coalescing: identical calls in flight at once share one upstream call.

The first call to miss on a key *leads*: it registers a :class:`Flight` and makes the
upstream call in its own task, inside its own call tree, under its own deadline —
there is no background task, so nothing outlives the call that started it.  Calls
that miss on the same key while the flight is open *wait* on it, each under its own
deadline.  A waiter that gives up (cancelled, out of time) just stops waiting: the
leader does not notice.

How a flight ends decides what its waiters do:

* **an answer** — every waiter gets it (decoded afresh, marked ``cached``);
* **a verdict on the request or the upstreams** — a :class:`~polygate.FatalUpstreamError`
  (the request is wrong), :class:`~polygate.AllSourcesExhausted` (every source or
  attempt failed) or :class:`~polygate.GovernanceBackendError` (admission is down):
  every waiter raises the same error as its own (a copy with its own statistics),
  rather than queue up to hear it again; a refusal or an outage with an upstream's
  failure in it only for a waiter that sends the same JSON (``Flight.request``), and
  of an embeddings batch only for a waiter that would send the whole batch itself
  (``Flight.batch``);
* **anything about the leader itself** — its caller cancelled it, its own deadline
  passed, its committed stream stalled (a ``chat()`` waiter would have retried that),
  or a bug: the flight is *abandoned* and handed over.  Every waiter wakes; the first
  to run registers a new flight and leads, the rest wait on it.  A waiter that
  outlived its leader therefore always carries on, never orphaned.

All of it is synchronous bookkeeping between awaits: a flight is registered, settled
and removed with no checkpoint in between, so a call that misses just after a flight
ended either finds the answer stored or leads a new flight — it never waits on a
flight that is already over.
"""

from __future__ import annotations

from typing import Any

import trio

__all__ = ["Coalescer", "Flight"]


class Flight:
    """One key being computed.  ``value``: the encoded answer; ``error``: a shared
    verdict; both ``None`` once ``done``: abandoned, someone else must lead.

    ``batch``: with an ``error``, the keys of the request it is a verdict on when
    that verdict may be about any one of them (an embeddings batch refused): only a
    waiter that would send all of them itself takes it; the others lead anew.

    ``request``: what the leader sends, as given (for a chat: its messages and
    parameters; for an embedding: its parameters).  Equal keys may be different
    requests on the wire (``1`` and ``1.0`` share a key; the key leaves out who asks),
    and an upstream may refuse one and take the other: a refusal
    (``FatalUpstreamError``), or an ``AllSourcesExhausted`` with an upstream's failure in
    it (whose text may quote the leader's ``user``), binds only a waiter that sends the
    same bytes."""

    __slots__ = ("batch", "done", "error", "request", "superseded", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: bytes | None = None
        self.error: BaseException | None = None
        self.batch: frozenset[str] | None = None
        self.request: Any = None
        #: A ``cache="refresh"`` call that began while this flight was open stored its
        #: answer first: this flight's answer, asked for before it, is still its
        #: waiters', but must not replace the refreshed entry.
        self.superseded = False


class Coalescer:
    def __init__(self) -> None:
        self._flights: dict[str, Flight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def claim(self, key: str) -> tuple[Flight, bool]:
        """The flight for ``key`` and whether the caller leads it (it registered it)."""
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = Flight()
            return flight, True
        return flight, False

    def open(self, key: str) -> Flight | None:
        """The flight open for ``key``, if any."""
        return self._flights.get(key)

    def lead_if_free(self, key: str) -> Flight | None:
        """A new flight led by the caller, or None when one is already open (a
        ``cache="refresh"`` call then computes on its own: it must not read)."""
        if key in self._flights:
            return None
        flight = self._flights[key] = Flight()
        return flight

    def settle(
        self, key: str, flight: Flight, value: bytes | None = None,
        error: BaseException | None = None, batch: frozenset[str] | None = None,
    ) -> None:
        """End ``flight`` with an answer, a shared error (``batch``: see
        :class:`Flight`), or neither (abandoned).  Only the first settlement counts:
        a flight never changes its outcome."""
        if flight.done.is_set():
            return
        if self._flights.get(key) is flight:
            del self._flights[key]
        flight.value = value
        flight.error = error
        flight.batch = batch
        flight.done.set()
