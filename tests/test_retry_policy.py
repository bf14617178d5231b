"""Backoff and Retry-After parsing (pure functions)."""

from __future__ import annotations

import email.utils
import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polygate._backoff import full_jitter
from polygate.transport import parse_retry_after
from polygate.transport._wire import RETRY_AFTER_CAP_S


@given(st.integers(min_value=0, max_value=200), st.floats(0, 10), st.floats(0, 100), st.integers())
def test_full_jitter_bounds(failures: int, base: float, cap: float, seed: int) -> None:
    value = full_jitter(failures, base, max(cap, base), random.Random(seed))
    assert 0 <= value <= max(cap, base)
    if failures == 0:
        assert value == 0


def test_full_jitter_grows() -> None:
    rng = random.Random(1)
    means = [sum(full_jitter(n, 0.25, 8.0, rng) for _ in range(2000)) / 2000 for n in (1, 2, 3, 4)]
    assert means == sorted(means)
    assert means[0] == pytest.approx(0.125, rel=0.1)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        ({"retry-after-ms": "garbage", "retry-after": "9"}, 9.0),
        ({"retry-after": "-4"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "86400"}, RETRY_AFTER_CAP_S),
        ({}, None),
        # Delta-seconds are ASCII digits (RFC 9110): float() also reads these, and
        # "1_000" parked a source for the 600 s cap (an outside review, 2026-12-05).
        ({"retry-after": "1_000"}, None),
        ({"retry-after": "\u0665"}, None),  # an Arabic-Indic five
        ({"retry-after": "1e3"}, None),
        ({"retry-after": "+5"}, None),
        ({"retry-after": " 2 "}, 2.0),
        ({"retry-after-ms": "1_000", "retry-after": "9"}, 9.0),
        ({"retry-after-ms": "-5", "retry-after": "9"}, 9.0),
        ({"retry-after-ms": "inf", "retry-after": "9"}, 9.0),
        # Too many digits for a float: a wait past the cap, not no wait at all.
        ({"retry-after": "9" * 400}, RETRY_AFTER_CAP_S),
        ({"retry-after-ms": "9" * 400}, RETRY_AFTER_CAP_S),
        # ASCII separators, which h11 lets through in a value and str.strip takes: the
        # wait was matched stripped and read unstripped, a ValueError that made a 429
        # "a malformed upstream body" (found by fuzzing, 2026-12-06).
        ({"retry-after-ms": "\x1f2000"}, 2.0),
        ({"retry-after-ms": "\x1e\x1d250\x1f"}, 0.25),
        ({"retry-after": "\x1c3"}, 3.0),
    ],
)
def test_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers) == expected


@pytest.mark.parametrize(("code", "status"), [
    ("429", 429), (429, 429), ("\u00b2", None), ("\u2460", None), ("\u0664\u0662\u0669", None),
])
def test_an_error_code_is_a_status_only_in_ascii_digits(code: object, status: int | None) -> None:
    """``str.isdigit()`` takes "²" and "①", which ``int()`` refuses: the well-formed
    error body was then read as a malformed one, its message lost; and Arabic-Indic
    "٤٢٩" was read as a 429 (an outside review, 2026-12-05)."""
    from polygate._errors import error_status

    assert error_status({"error": {"message": "m", "code": code}}) == status


def test_retry_after_http_date() -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    value = parse_retry_after({"retry-after": when})
    assert value is not None and 25 <= value <= 31
    past = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert parse_retry_after({"retry-after": past}) == 0.0


@pytest.mark.parametrize("skew_s", [-300.0, 0.0, 300.0])
def test_a_retry_after_date_counts_from_the_answers_own_date(
    skew_s: float, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a Date header, the wait is the server's two instants apart, whatever this
    host's clock says.  A replica 5 minutes behind read 305 s (and shared it, through
    Redis, with every replica); 5 minutes ahead, no wait at all (an outside review,
    2026-12-05)."""
    server_now = 1_800_000_000.0
    headers = {
        "date": email.utils.formatdate(server_now, usegmt=True),
        "retry-after": email.utils.formatdate(server_now + 5, usegmt=True),
    }
    monkeypatch.setattr(time, "time", lambda: server_now + skew_s)
    assert parse_retry_after(headers) == 5.0
    # A cache on the way held the answer 300 s (Age): the named instant is past.
    assert parse_retry_after({**headers, "age": "300"}) == 0.0
    assert parse_retry_after({**headers, "age": "2"}) == 3.0
    assert parse_retry_after({**headers, "age": "two"}) == 5.0  # (not a number: no age)
    # No Date, or one that is no date: this host's clock, as before.
    for date in (None, "yesterday"):
        alone = {"retry-after": headers["retry-after"]} | ({"date": date} if date else {})
        assert parse_retry_after(alone) == max(5.0 - skew_s, 0.0)


@pytest.mark.parametrize("tz", ["UTC", "America/Los_Angeles", "Asia/Tokyo"])
def test_retry_after_dates_without_a_zone_are_gmt(tz: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 9110's asctime form and a '-0000' zone (email.utils.formatdate's default)
    carry no zone: they are GMT, not the local time (a probe found a date 40 s ahead
    read as 600 s under Los Angeles time, 0.1 s under Tokyo's)."""
    monkeypatch.setenv("TZ", tz)
    time.tzset()
    try:
        ahead = time.time() + 40
        for when in (time.asctime(time.gmtime(ahead)), email.utils.formatdate(ahead)):
            value = parse_retry_after({"retry-after": when})
            assert value is not None and 35 <= value <= 41, (when, value)
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize(("lines", "expected"), [
    ([("retry-after", "3"), ("retry-after", "3")], 3.0),
    ([("retry-after", "1"), ("retry-after", "7")], 7.0),
    ([("retry-after", "3, 5")], 5.0),
    ([("retry-after", "x"), ("retry-after", "4")], 4.0),
    ([("retry-after-ms", "250"), ("retry-after-ms", "400"), ("retry-after", "9")], 0.4),
    ([("retry-after-ms", "x"), ("retry-after-ms", "y"), ("retry-after", "2")], 2.0),
    ([("retry-after", "x"), ("retry-after", "y")], None),
])
def test_a_retry_after_sent_more_than_once_is_read_line_by_line(
    lines: list[tuple[str, str]], expected: float | None,
) -> None:
    """Review finding (rate-limit signals as providers send them): a proxy on the way
    that adds its own Retry-After beside the upstream's made httpx join the two into
    "3, 3", which no delta-seconds reads: the 1 s default cooldown applied, and the
    source was asked again 2 s before it said. Each line is read; the longest wait."""
    import httpx

    assert parse_retry_after(httpx.Headers(lines)) == expected


def test_a_retry_after_date_beside_seconds_takes_the_longer() -> None:
    import httpx

    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    value = parse_retry_after(httpx.Headers([("retry-after", "2"), ("retry-after", when)]))
    assert value is not None and 25 <= value <= 31
    assert parse_retry_after(httpx.Headers([("retry-after", "9" * 400)])) == RETRY_AFTER_CAP_S
