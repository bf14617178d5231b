"""Redaction at a gateway's scale: a thousand gateway keys (~10,000 spellings), a
100 KB prompt logged with ``log_content``, an upstream's 64 KiB error message.

Each spelling searched for on its own made the work secrets × text, on the event
loop: 0.6 s over one 100 KB prompt with 1,000 keys, 60 ms for every failed attempt
whose upstream echoed a long value.  The costs are compared as ratios within one
run (the best of several timings), with margins far from both the old and the new
figures."""

from __future__ import annotations

import secrets as token
import time
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from polygate import _secrets
from polygate._secrets import MASK, _forms, clip, redact
from polygate.transport import Endpoint

KEYS = tuple(f"sk-gw-{token.token_urlsafe(24)}" for _ in range(1000))
PROMPT = "Summarise the following text, word for word if you must. " * 1800  # ~100 KB


def _best(fn: Callable[[], object], repeat: int = 7) -> float:
    fn()  # (builds what is cached: the spellings, the automaton)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def test_a_thousand_secrets_cost_a_large_text_about_what_one_does() -> None:
    text = PROMPT + KEYS[500] + " and " + KEYS[-1].upper()
    one = _best(lambda: redact(text, KEYS[:1]))
    thousand = _best(lambda: redact(text, KEYS))
    assert redact(text, KEYS) == PROMPT + MASK + " and " + MASK
    # Searched one spelling at a time, a thousand keys cost ~800 times one key's work
    # here; in one pass, a few times it.
    assert thousand < 60 * one + 0.002, (one, thousand)


def test_a_long_error_message_costs_what_is_kept_of_it() -> None:
    echoed = "Invalid content: '" + PROMPT[:60_000] + "'"
    short = _best(lambda: clip(echoed[:400], 300, KEYS))
    long = _best(lambda: clip(echoed, 300, KEYS))
    assert clip(echoed, 300, KEYS) == clip(echoed[:400], 300, KEYS)
    assert long < 8 * short + 0.001, (short, long)


def test_a_source_reads_its_secrets_without_building_them_again() -> None:
    endpoint = Endpoint(name="a", url="http://a/v1", api_key="sk-source-key", others=KEYS)
    assert endpoint.secrets is endpoint.secrets
    assert endpoint.secrets == ("sk-source-key", *KEYS)


# ------------------------------------------------------------- one meaning on both paths

_ALPHABET = "abcAB01-_%'\\\" x"
_secret = st.text(_ALPHABET, min_size=4, max_size=12)


def _many(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """``secrets`` padded with unrelated ones, so that the automaton finds them."""
    return (*secrets, *(f"zq{n:04d}-padding-secret" for n in range(8)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_secret, min_size=1, max_size=4), st.lists(st.one_of(_secret, st.text(_ALPHABET, max_size=8)),
                                                            max_size=10))
def test_both_ways_of_finding_the_spellings_mask_the_same_text(
    secrets: list[str], pieces: list[str],
) -> None:
    """A few secrets are searched for one spelling at a time, many in one pass: the
    two agree, and no spelling of any secret is left in what either gives.
    Overlapping occurrences (a secret that begins where another ends) are masked
    whole, as one run."""
    chosen = _many(tuple(secrets))
    text = "".join(pieces).ljust(_secrets._AUTOMATON_TEXT, "x")  # (long enough for it)
    forms = _forms(chosen)
    assert len(forms) >= _secrets._AUTOMATON_FROM
    by_automaton = redact(text, chosen)
    saved = _secrets._AUTOMATON_FROM
    _secrets._AUTOMATON_FROM = 10**9
    try:
        one_by_one = redact(text, chosen)
    finally:
        _secrets._AUTOMATON_FROM = saved
    assert by_automaton == one_by_one
    # Nothing of a secret survives except where a mask now stands beside text that,
    # joined with it, was never a spelling.
    for piece in by_automaton.split(MASK):
        for form in forms:
            assert form not in piece


def test_overlapping_secrets_are_masked_as_one_run() -> None:
    first, second = "abcd-1234", "1234-wxyz"
    assert redact("<abcd-1234-wxyz>", (first, second)) == "<***>"
    # Side by side (not overlapping): two masks, as before.
    assert redact("abcd-12341234-wxyz", (first, second)) == "******"


@pytest.mark.parametrize("limit", [10, 50, 300])
def test_a_cut_after_masks_still_drops_a_secrets_start(limit: int) -> None:
    """The window redacted is the kept part and the longest spelling after it: masks
    before the cut shorten the text, and the start of a secret that lay past the
    window may then fall before the cut; it goes with the last word."""
    key = KEYS[7]
    text = (key + " ") * 40 + "x" * limit + key
    shown = clip(text, limit, KEYS)
    assert shown.endswith("…")
    assert len(shown) <= limit + 1
    for form in _forms(KEYS[:8]):
        for n in range(6, len(form) + 1):
            assert form[:n] not in shown


def test_every_order_of_the_same_secrets_shares_one_automaton_and_few_are_kept() -> None:
    """Review: each source's tuple (its key first) had an automaton of its own, and
    every generation's stayed cached: 24 reloads of a thousand keys grew the process
    by 674 MB.  Now one per set of secrets, and only the last few sets'."""
    text = PROMPT + KEYS[3]
    first = redact(text, KEYS)
    reordered = (KEYS[5], *KEYS[:5], *KEYS[6:])
    assert _secrets._finder(KEYS)[1] == _secrets._finder(reordered)[1]
    assert redact(text, reordered) == first
    for n in range(40):  # forty reloads, each adding a tenant's key
        redact(text, (*KEYS, f"sk-gw-tenant-{n:04d}-added-by-a-reload"))
    # Review: each set's spellings (1.3 MB for a thousand keys) stayed cached with the
    # last 128 tuples that asked for them.
    assert _secrets._automaton.cache_info().currsize <= 4
    assert _secrets._forms.cache_info().currsize <= 8


def test_a_cut_after_masks_keeps_no_start_of_a_password_with_blanks() -> None:
    """Review: the part redacted ends at ``limit`` plus the longest spelling; masks
    before the cut shortened it, and a password with blanks (no "last word" to drop)
    that the window cut short showed its start ("bad value: correct horse …")."""
    password = "correct horse battery staple"
    secrets = _secrets.url_secrets("redis://:correct%20horse%20battery%20staple@127.0.0.1:6379/0")
    window = 200 + len(_forms(secrets)[0])
    unit = "bad value: " + password + "; "
    for short in range(len(password) + 1):  # wherever the window's end cuts an occurrence
        lead = window - len(unit * 6) - len("bad value: ") - short
        text = "." * lead + unit * 10
        shown = clip(text, 200, secrets)
        assert shown.endswith("…") and len(shown) <= 201
        for n in range(6, len(password) + 1):
            assert password[:n] not in shown, (short, shown)
