"""Probe for C40 (the checkpoint after a StructuredOutputError removed)."""
from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

SECRET = "sk-test-SECRET-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "hello there"}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


async def test_a_deadline_passed_during_a_failed_last_validation_is_the_outcome(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation (no checkpoint after a failed last validation): the last round's
    answer is invalid (no re-ask left), and its inline validation ran past the call's
    deadline (10 s of virtual time, on the loop):
    the call's outcome is DeadlineExceeded, as for a valid answer -- the mutant
    raised the StructuredOutputError (no checkpoint between the validation and the
    raise)."""
    from polygate import _structured

    original = _structured._DictSchema.validate

    def validate(self: Any, text: str, *budget: float) -> Any:
        autojump_clock.jump(10)  # the loop is blocked 10 s: a slow inline validation
        return original(self, text, *budget)

    monkeypatch.setattr(_structured._DictSchema, "validate", validate)
    up = FakeUpstream(Reply(text='{"city": "Paris", "population": "lots"}'))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
        structured=polygate.Structured(max_reasks=0), call_deadline_s=5.0)})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.DeadlineExceeded):
            await s.chat(MESSAGES, schema=SCHEMA)
