"""The governance backend interface.

Each method is one atomic operation on shared state — the memory backend runs it
without a checkpoint, the Redis backend as one Lua script — so two processes can never
interleave between a check and its update.  Time is the backend's own: the memory
backend reads ``trio.current_time()`` (so ``MockClock`` drives it), Redis reads
``TIME`` on the server (so skewed client clocks agree).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ._model import Admission, AdmitRequest, Refusal, SettleRequest, SourceSnapshot

__all__ = ["GovernanceBackend"]


@runtime_checkable
class GovernanceBackend(Protocol):
    async def admit(self, request: AdmitRequest) -> Admission | Refusal:
        """Check cooldown, breaker, RPM/TPM and permits; on success reserve
        ``request.tokens`` and take one in-flight permit, all at once."""
        ...

    async def settle(self, request: SettleRequest) -> None:
        """End an admission: record its cost, return its permit, feed the breaker,
        set a cooldown — all at once.  Idempotent per reservation id."""
        ...

    async def snapshot(self, scope: str, source: str) -> SourceSnapshot: ...

    async def budget_take(self, scope: str, burst: float) -> bool:
        """Take one hedge token from the scope's bucket (which starts full at ``burst``)."""
        ...

    async def budget_refill(self, scope: str, amount: float, burst: float) -> None: ...

    async def budget_level(self, scope: str, burst: float) -> float: ...

    def change_mark(self) -> Any:
        """A mark of "now" for :meth:`wait_changed`: take it *before* checking, so a
        change that lands between the check and the wait is not missed."""
        ...

    async def wait_changed(self, deadline: float, mark: Any = None) -> None:
        """Return when some admission may have become possible (a permit came back, a
        settle happened) since ``mark`` (default: since this call), or at ``deadline``
        (trio time), whichever is first."""
        ...

    def now(self) -> float:
        """The backend's notion of the current time, in trio-clock seconds."""
        ...

    async def aclose(self) -> None: ...
