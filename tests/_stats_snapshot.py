"""A report read while a session commits a batch: shared by the SQLite and PostgreSQL
tests of ``polygate stats`` (``read_rows`` reads in one snapshot)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from polygate.cli import main
from polygate.telemetry import AttemptEvent, Batch, CallEvent

NOW = time.time()


def _call(i: int) -> CallEvent:
    return CallEvent(
        session_id="s1", logical_call_id=f"c-{i}", scope="chat", kind="chat", stream=0,
        started_at=NOW, outcome="ok", error_class=None, error_message=None,
        total_latency_ms=1000.0, generation_ms=900.0, ttft_ms=100.0, stall_ms=0.0,
        stall_count=0, active_generation_ms=800.0, attempts=1, hedges=0,
        hedge_won=0, source="a", cached=0, prompt_tokens=1, completion_tokens=2,
        usage_source="upstream", content=None,
    )


def _batch(first: int) -> Batch:
    calls = [_call(i) for i in range(first, first + 5)]
    attempts = [AttemptEvent(
        call_id=f"{c.logical_call_id}.1", logical_call_id=c.logical_call_id, scope="chat",
        source="a", role="primary", started_at=NOW, latency_ms=900.0, ttft_ms=100.0,
        status_code=200, streamed=1, error="ok", error_class=None, error_message=None,
        tokens_reserved=10, tokens_settled=3, prompt_tokens=1, completion_tokens=2,
        usage_source="upstream",
    ) for c in calls]
    return Batch(calls, attempts, None)


def report_while_a_batch_lands(
    sink: Any, reader_class: type, db: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> dict[str, Any]:
    """``stats --json`` on ``db`` (5 calls) while ``sink`` commits 5 more calls and their
    attempts right after the report's calls were read."""
    sink.write(_batch(0))
    original = reader_class.query
    landed: list[int] = []

    def query(self: Any, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        rows = original(self, sql, params)
        if sql.startswith("SELECT scope, kind") and not landed:
            landed.append(1)
            sink.write(_batch(5))
        return rows

    monkeypatch.setattr(reader_class, "query", query)
    assert main(["stats", "--json", "--db", db]) == 0
    assert landed == [1]
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report
