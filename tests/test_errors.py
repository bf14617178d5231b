"""The error taxonomy: every status and exception maps to exactly one class."""

from __future__ import annotations

import errno
import socket
import ssl
import sys

import httpx
import pytest
import trio
import trio.testing

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

import polygate
from polygate._errors import (
    Outcome,
    classify_exception,
    classify_status,
    error_status,
    redact,
)
from polygate.testing import FakeUpstream, Reply, Router

from .conftest import FIRST_A, MESSAGES, two_source_settings

STATUS_TABLE = [
    (400, polygate.FatalUpstreamError, Outcome.FATAL),
    (405, polygate.FatalUpstreamError, Outcome.FATAL),
    (413, polygate.FatalUpstreamError, Outcome.FATAL),
    (422, polygate.FatalUpstreamError, Outcome.FATAL),
    (401, polygate.SourceDeadError, Outcome.DEAD),
    (403, polygate.SourceDeadError, Outcome.DEAD),
    (404, polygate.SourceDeadError, Outcome.DEAD),
    # the source's state, not the request's: out of credit, a proxy wanting credentials
    (402, polygate.SourceDeadError, Outcome.DEAD),
    (407, polygate.SourceDeadError, Outcome.DEAD),
    (429, polygate.RateLimitedError, Outcome.RATE_LIMITED),
    (408, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (409, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (425, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    # servers' own failures sent as a 4xx: TGI's generation error, Groq's flex capacity
    (424, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (498, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (500, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (502, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (503, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (504, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (529, polygate.TransientUpstreamError, Outcome.TRANSIENT),
    (302, polygate.TransientUpstreamError, Outcome.TRANSIENT),
]


@pytest.mark.parametrize(("status", "cls", "outcome"), STATUS_TABLE)
def test_status_table(status: int, cls: type, outcome: Outcome) -> None:
    error = classify_status(status, "detail", source="a")
    assert type(error) is cls
    assert error.outcome is outcome
    assert error.status_code == status
    assert error.source == "a"
    assert isinstance(error, polygate.UpstreamError)
    assert isinstance(error, polygate.PolygateError)


def test_a_402_that_says_when_to_come_back_is_a_wait() -> None:
    """OpenRouter: a 402 with ``Retry-After`` (its in-flight spending budget) says when
    to ask again; one without it is an account out of credit."""
    waited = classify_status(402, "budget", source="a", retry_after_s=2.0)
    assert type(waited) is polygate.RateLimitedError and waited.retry_after_s == 2.0
    assert type(classify_status(402, "no credit", source="a")) is polygate.SourceDeadError


def test_every_status_maps_to_one_class() -> None:
    leaves = (
        polygate.FatalUpstreamError, polygate.SourceDeadError,
        polygate.TransientUpstreamError, polygate.RateLimitedError,
    )
    for status in range(300, 600):
        error = classify_status(status, "")
        assert sum(type(error) is cls for cls in leaves) == 1


EXCEPTION_TABLE = [
    (httpx.ConnectError("refused"), Outcome.TRANSIENT),
    (httpx.ReadError("reset"), Outcome.TRANSIENT),
    (httpx.RemoteProtocolError("peer closed"), Outcome.TRANSIENT),
    (httpx.WriteError("broken pipe"), Outcome.TRANSIENT),
    (httpx.ConnectTimeout("t"), Outcome.TIMEOUT),
    (httpx.ReadTimeout("t"), Outcome.TIMEOUT),
    (httpx.PoolTimeout("t"), Outcome.TIMEOUT),
    (ValueError("Expecting value"), Outcome.TRANSIENT),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), Outcome.TRANSIENT),
    (KeyError("choices"), Outcome.TRANSIENT),
    (RuntimeError("weird"), Outcome.TRANSIENT),
]


@pytest.mark.parametrize(("exc", "outcome"), EXCEPTION_TABLE)
def test_exception_table(exc: Exception, outcome: Outcome) -> None:
    error = classify_exception(exc, source="a")
    assert type(error) is polygate.TransientUpstreamError
    assert error.outcome is outcome


async def test_a_failed_connect_says_why() -> None:
    """An exhaustion review: every failed connect read "all attempts to connect to
    127.0.0.1:PORT failed", so nothing listening could not be told from no route, a
    firewall or IPv6 off; the operating system's reason (trio keeps each attempt's
    error as the cause) is named now, once, without the address again."""
    import socket

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a port where nothing listens
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url=f"http://127.0.0.1:{port}/v1")],
        retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.chat([{"role": "user", "content": "hi"}])
    assert str(caught.value.errors[0]) == (
        f"[a] transport error (ConnectError): all attempts to connect to 127.0.0.1:{port} "
        "failed (Connection refused)"
    )


def test_os_reasons_come_from_causes_and_groups_once() -> None:
    from polygate._sockets import os_reasons

    refused = OSError(errno.ECONNREFUSED, "Error connecting to ('::1', 1): Connection refused")
    unreachable = OSError(errno.ENETUNREACH, "Error connecting to ('10.0.0.1', 1): x")
    outer = OSError("all attempts to connect to h:1 failed")
    outer.__cause__ = BaseExceptionGroup("attempts", [refused, unreachable, OSError(
        errno.ECONNREFUSED, "again")])
    error = httpx.ConnectError(str(outer))
    error.__cause__ = outer
    assert sorted(os_reasons(error)) == ["Connection refused", "Network is unreachable"]
    assert "Network is unreachable" in str(classify_exception(error, source="a"))
    assert os_reasons(httpx.ConnectError("no cause")) == []


@pytest.mark.parametrize("cause", [
    socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
    ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"),
    OSError(-3, "a number of no errno"),
])
def test_a_resolver_or_tls_failure_adds_no_wrong_reason(cause: OSError) -> None:
    """A review of the change above: a resolver's and TLS's OSErrors number their own
    codes, and os.strerror read them as "Unknown error -2" and, for a failed
    certificate check, "Operation not permitted"."""
    error = httpx.ConnectError(str(cause))
    error.__cause__ = cause
    text = str(classify_exception(error, source="a"))
    assert text == f"[a] transport error (ConnectError): {cause}", text


def test_upstream_errors_pass_through() -> None:
    error = polygate.FatalUpstreamError("x")
    assert classify_exception(error) is error


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        ({"error": {"code": 400, "message": "x"}}, 400),
        ({"error": {"code": "tool_use_failed", "status_code": 400}}, 400),
        ({"error": {"code": "429"}}, 429),
        ({"object": "error", "code": 400, "message": "m"}, 400),
        ({"error": {"code": "invalid_api_key"}}, None),
        ({"error": {"code": True}}, None),
        ({"error": "boom"}, None),
        ("not a dict", None),
    ],
)
def test_error_status(payload: object, status: int | None) -> None:
    assert error_status(payload) == status


def test_special_classes() -> None:
    assert issubclass(polygate.StreamStalled, polygate.TransientUpstreamError)
    assert issubclass(polygate.StreamStalled, TimeoutError)
    assert issubclass(polygate.DeadlineExceeded, TimeoutError)
    assert issubclass(polygate.ConfigError, ValueError)
    for name in ("AllSourcesExhausted", "GovernanceBackendError", "DeadlineExceeded", "ConfigError"):
        assert issubclass(getattr(polygate, name), polygate.PolygateError)


def test_redact() -> None:
    assert redact("key sk-abcdef was wrong", ("sk-abcdef",)) == "key *** was wrong"
    assert redact("abc", ("",)) == "abc"


OUT_OF_CREDIT = {"error": {
    "message": "You exceeded your current quota, please check your plan and billing details.",
    "type": "insufficient_quota", "param": None, "code": "insufficient_quota",
}}


@pytest.mark.parametrize("how", ["status", "event"])
async def test_a_429_that_says_the_account_is_out_of_credit_is_a_dead_source(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """OpenAI answers an account out of credit with a 429 whose code is
    ``insufficient_quota`` (in an error event too): the source's state for hours, as a
    402's.  Review: taken for a rate limit, it was asked again about once a second,
    free of ``max_attempts``, for ``rate_limit_wait_s`` (60 s) before the call failed;
    it is a dead source now, asked once, and the call goes to the next one at once."""
    broke = (Reply(status=429, retry_after_s=1, error_body=OUT_OF_CREDIT) if how == "status"
             else Reply(tokens=5, fault="error_event", fault_after=0,
                        error_event_code="insufficient_quota"))
    a, b = FakeUpstream(broke), FakeUpstream(Reply(text="from b"))
    async with polygate.session(two_source_settings(names=("a",)), transport=Router({"a": a})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as failed:
            await s.chat(MESSAGES)
    [error] = failed.value.errors
    assert isinstance(error, polygate.SourceDeadError) and error.code == "insufficient_quota"
    assert error.outcome is Outcome.DEAD and len(a.requests) == 1
    assert trio.current_time() < 1  # no Retry-After waited out
    async with polygate.session(two_source_settings(weights=FIRST_A),
                                transport=Router({"a": FakeUpstream(broke), "b": b})) as s:
        r = await s.chat(MESSAGES)
    assert (r.text, r.source, r.call_stats.attempts) == ("from b", "b", 2)


def test_the_statuses_the_docs_call_never_fatal_are_the_codes() -> None:
    """docs/failover.md lists the statuses ``fallback_on=["status:4NN"]`` refuses as
    never fatal (review: 424 and 498 became transient and the list did not say so)."""
    import re

    from .conftest import ROOT

    text = (ROOT / "docs" / "failover.md").read_text()
    found = re.search(r"a status that is never fatal \(([0-9, ]+)\)", text)
    assert found is not None
    listed = {int(n) for n in found.group(1).split(",")}
    never = {s for s in range(400, 500)
             if not isinstance(classify_status(s, ""), polygate.FatalUpstreamError)}
    assert listed == never
