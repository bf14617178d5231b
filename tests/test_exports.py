"""The public surface is deliberate: a name appearing or disappearing fails here."""

from __future__ import annotations

import polygate

PUBLIC = {
    # SPEC §1 (pinned)
    "session", "Settings", "Scope", "Source", "Hedge", "Retry", "StreamWatch",
    "PolygateError", "ConfigError", "FatalUpstreamError", "SourceDeadError",
    "TransientUpstreamError", "RateLimitedError", "StreamStalled", "DeadlineExceeded",
    "AllSourcesExhausted", "GovernanceBackendError",
    "ChatResponse", "EmbeddingResponse", "CallStats",
    # additions
    "ConfigWarning", "UpstreamError", "Session", "SessionStatistics", "ChatStream",
    "StreamChunk", "Usage", "Breaker",
    # SPEC §8.1 and §8.2 (pinned)
    "StructuredOutputError", "OcrResponse",
    # additions of the second release
    "Structured", "Ocr", "OcrPage",
    # SPEC §8.5: Settings.serve
    "Serve",
    "ServeKey",
}


def test_public_names() -> None:
    assert set(polygate.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(polygate, name)


def test_module_names_are_public() -> None:
    for name in polygate.__all__:
        obj = getattr(polygate, name)
        assert obj.__module__ == "polygate", name


def test_callstats_fields_pinned() -> None:
    import attrs

    fields = {f.name for f in attrs.fields(polygate.CallStats)}
    assert fields == {
        "logical_call_id", "attempts", "hedges", "hedge_won", "source", "total_latency_ms",
        "generation_ms", "ttft_ms", "stall_ms", "stall_count", "active_generation_ms", "cached",
        # additions of the second release
        "reasks", "scope", "resumes",
    }


def test_settings_fields_pinned() -> None:
    import attrs

    def names(cls: type) -> list[str]:
        return [f.name for f in attrs.fields(cls)]

    assert names(polygate.Settings)[:3] == ["scopes", "backend", "telemetry"]
    assert names(polygate.Scope)[:5] == ["sources", "hedge", "retry", "stream", "call_deadline_s"]
    assert names(polygate.Source)[:11] == [
        "name", "base_url", "api_key", "model", "timeout_s", "ttft_timeout_s", "rpm", "tpm",
        "max_in_flight", "weight", "streaming"]
    assert names(polygate.Hedge)[:8] == [
        "after_s", "max_extra", "stall_after_s", "budget_ratio", "budget_burst",
        "after_quantile", "min_after_s", "max_after_s"]
    assert names(polygate.Retry)[:4] == [
        "max_attempts", "backoff_base_s", "backoff_max_s", "rate_limit_wait_s"]
    assert names(polygate.StreamWatch)[:2] == ["stall_timeout_s", "stall_threshold_ms"]


TESTING_PUBLIC = {
    "Behaviour", "Distribution", "FakeUpstream", "Fault", "Outcome", "Profile",
    "RecordedRequest", "Reply", "Router", "ToolCall", "UpstreamStatistics",
    # the scheduling-aware kit
    "EventStatistics", "EventTransport", "Schedule",
}


def test_testing_public_names() -> None:
    import polygate.testing

    assert set(polygate.testing.__all__) == TESTING_PUBLIC
    for name in TESTING_PUBLIC:
        assert hasattr(polygate.testing, name)
    for name in ("EventStatistics", "EventTransport", "Schedule", "FakeUpstream", "Reply", "ToolCall"):
        assert getattr(polygate.testing, name).__module__ == "polygate.testing", name


def test_testing_strategies_names() -> None:
    """polygate.testing.strategies needs hypothesis; polygate.testing does not import it."""
    import polygate.testing.strategies as strategies

    assert set(strategies.__all__) == {"cancellations", "hedges", "instants", "replies", "schedules"}


def test_the_public_classes_type_hints_resolve() -> None:
    """Review finding (typing angle): with ``__module__`` made public, the classes'
    string annotations were evaluated in the public package's namespace, which has no
    ``Any`` or ``Outcome``: ``typing.get_type_hints``, ``attrs.resolve_types`` and the
    libraries built on them (cattrs) raised NameError on ChatResponse, Settings,
    Reply, StreamStalled and 18 more."""
    import typing

    import attrs

    import polygate.aio
    import polygate.testing

    checked = 0
    for module in (polygate, polygate.testing, polygate.aio):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type):
                hints = typing.get_type_hints(obj)
                assert not any(isinstance(h, str) for h in hints.values()), (name, hints)
                if attrs.has(obj):
                    attrs.resolve_types(obj)
                checked += 1
    assert checked > 40
    hints = typing.get_type_hints(polygate.ChatResponse)
    assert hints["call_stats"] is polygate.CallStats
    assert typing.get_type_hints(polygate.StreamStalled)["call_stats"] is polygate.CallStats
