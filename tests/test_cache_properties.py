"""Hypothesis properties of the cache.

* Two requests get the same key exactly when they are canonically equal (an oracle
  written independently of the canonicaliser decides equality).
* A hit never returns another request's answer.
* Coalescing under random cancellations: a cancelled waiter never cancels the
  leader; a cancelled leader hands over to a waiter (or the waiters fail cleanly);
  every call that was not cancelled gets its own request's answer.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polygate
from polygate.cache import EXCLUDED_PARAMS, ORDERED_PARAMS, chat_key, embed_keys
from polygate.testing import FakeUpstream, RecordedRequest, Reply, Router

# --------------------------------------------------------------------------- values

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False, width=64)
    | st.text(max_size=6)
)
json_values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def canonically_equal(a: Any, b: Any) -> bool:
    """The oracle: equality of JSON values, numbers by value, booleans apart."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(canonically_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(canonically_equal(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is None and b is None
    return type(a) is type(b) and a == b


def variant(value: Any, rnd: random.Random) -> Any:
    """An equal value written differently: keys reordered, tuples, ints as floats."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return float(value) if abs(value) < 2**53 and rnd.random() < 0.5 else value
    if isinstance(value, float):
        return int(value) if value.is_integer() and rnd.random() < 0.5 else value
    if isinstance(value, list):
        items = [variant(v, rnd) for v in value]
        return tuple(items) if rnd.random() < 0.3 else items
    keys = list(value)
    rnd.shuffle(keys)
    return {k: variant(value[k], rnd) for k in keys}


def mutate(value: Any, rnd: random.Random) -> Any:
    """A value that may or may not be equal (a leaf changed, an item added or dropped)."""
    if isinstance(value, dict) and value and rnd.random() < 0.7:
        key = rnd.choice(list(value))
        return {**value, key: mutate(value[key], rnd)}
    if isinstance(value, list) and value and rnd.random() < 0.7:
        i = rnd.randrange(len(value))
        return [*value[:i], mutate(value[i], rnd), *value[i + 1:]]
    return rnd.choice([None, True, False, 0, 1, 1.0, 0.5, -0.0, "", "x", [], {}, [value], {"k": value}])


def _key(messages: Any, params: Any, scope: str = "chat") -> str:
    return chat_key(scope, ["m"], messages, params)


@given(json_values, json_values, st.randoms(use_true_random=False))
def test_equal_requests_share_a_key(content: Any, param: Any, rnd: random.Random) -> None:
    messages = [{"role": "user", "content": content}]
    params = {"temperature": param, "tool_choice": [content]}
    assert _key(messages, params) == _key(variant(messages, rnd), variant(params, rnd))


def equal_in_order(a: Any, b: Any) -> bool:
    """The oracle where key order counts: canonically equal, every object's keys in
    the same order."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(equal_in_order(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal_in_order(x, y) for x, y in zip(a, b, strict=True))
    return canonically_equal(a, b)


@pytest.mark.parametrize("name", sorted(ORDERED_PARAMS))
@given(value=json_values, rnd=st.randoms(use_true_random=False), alike=st.booleans())
def test_inside_schemas_and_tools_key_order_is_part_of_the_key(
    name: str, value: Any, rnd: random.Random, alike: bool,
) -> None:
    """Review: a schema's property order is the order a model writes the properties
    in (a reasoning-first schema gets its reasoning first, and another answer), and
    a tool's definition reaches the model as text in its order; sorting every key,
    two schemas listing their properties in two orders shared a key, and the second
    was served the first's answer.  Inside these parameters two values share a key
    exactly when they are equal with every object's keys in the same order."""
    other = variant(value, rnd) if alike else mutate(value, rnd)
    same = _key([], {name: value}) == _key([], {name: other})
    assert same == equal_in_order(value, other)
    # (An ordered value is never another parameter's value written plainly.)
    assert _key([], {name: value}) != _key([], {name: {"o": value}})


@given(value=json_values, rnd=st.randoms(use_true_random=False), alike=st.booleans())
def test_in_a_schema_key_order_is_part_of_the_key(value: Any, rnd: random.Random, alike: bool) -> None:
    """As inside ORDERED_PARAMS, in a ``schema=`` (the key's own member); and a schema
    is never a parameter, whatever its name."""
    other = variant(value, rnd) if alike else mutate(value, rnd)
    same = chat_key("chat", ["m"], [], {}, schema=value) == chat_key("chat", ["m"], [], {}, schema=other)
    assert same == equal_in_order(value, other)
    keyed = chat_key("chat", ["m"], [], {}, schema=value)
    assert keyed not in {_key([], {name: value}) for name in ("schema", "polygate:schema")}


@given(json_values, st.randoms(use_true_random=False), st.booleans())
def test_same_key_exactly_when_canonically_equal(value: Any, rnd: random.Random, alike: bool) -> None:
    other = variant(value, rnd) if alike else mutate(value, rnd)
    same_key = _key([{"role": "user", "content": value}], {}) == _key([{"role": "user", "content": other}], {})
    assert same_key == canonically_equal(value, other)
    same_params = _key([], {"p": value}) == _key([], {"p": other})
    assert same_params == canonically_equal(value, other)


object_keys = (
    st.text(max_size=4) | st.integers(-3, 3) | st.floats(-3, 3, allow_nan=False).map(lambda f: round(f, 1))
    | st.booleans() | st.none()
)


def _wire_keys(value: dict[Any, Any]) -> dict[str, Any]:
    """The object as it is sent: each key the text the standard library writes for it."""
    return {json.loads(json.dumps({k: None})).popitem()[0]: v for k, v in value.items()}


def _respelt(key: Any, rnd: random.Random) -> Any:
    """A key written as another Python value: maybe the same text on the wire, maybe not."""
    if isinstance(key, bool) or key is None or isinstance(key, str):
        return rnd.choice([key, str(key), json.dumps(key)])
    if isinstance(key, int):
        return rnd.choice([key, float(key), str(key)])
    return rnd.choice([key, int(key), repr(key)])


@given(st.dictionaries(object_keys, leaves, max_size=4), st.randoms(use_true_random=False))
def test_object_keys_are_the_text_they_are_sent_as(value: dict[Any, Any], rnd: random.Random) -> None:
    """Review: ``logit_bias={1.0: 5}`` goes out as ``{"1.0": 5}`` and ``{1: 5}`` as
    ``{"1": 5}``, but both had one cache key (the second was served the first's answer).
    Two objects share a key exactly when they are sent as equal objects."""
    other = {_respelt(k, rnd): v for k, v in value.items()}
    wire, other_wire = _wire_keys(value), _wire_keys(other)
    if len(wire) < len(value) or len(other_wire) < len(other):
        return  # two keys written as one text: not an object JSON can send
    same = _key([], {"logit_bias": value}) == _key([], {"logit_bias": other})
    assert same == canonically_equal(wire, other_wire)


@given(st.sampled_from(sorted(EXCLUDED_PARAMS)), json_values, json_values)
def test_excluded_params_never_change_the_key(name: str, a: Any, b: Any) -> None:
    assert _key([], {"temperature": 0, name: a}) == _key([], {"temperature": 0, name: b}) == _key(
        [], {"temperature": 0})


@given(st.text(max_size=8), st.text(max_size=8), json_values)
def test_scope_kind_and_inputs_are_in_the_key(x: str, y: str, param: Any) -> None:
    one, two = embed_keys("embed", ["m"], [x, y], {"p": param})
    assert (one == two) == (x == y)
    assert one != _key([x], {"p": param})  # another call kind
    assert embed_keys("other", ["m"], [x], {"p": param})[0] != one  # another scope
    assert embed_keys("embed", ["m2"], [x], {"p": param})[0] != one  # another model
    assert _key([x], {}) != _key([x], {}, scope="other")


# --------------------------------------------------------------------------- answers


def _answer(request: RecordedRequest) -> str:
    """The fake's answer names the request it answers (its canonical body)."""
    body = dict(request.body)
    body.pop("stream", None)
    body.pop("stream_options", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _expected(messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    body = {"messages": messages, **params}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


request_strategy = st.tuples(
    st.sampled_from(["hi", "hello", "bye"]),
    st.sampled_from([None, 0, 0.5, 1]),
    st.sampled_from([None, "alice", "bob"]),
)


def _request(choice: tuple[str, Any, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    content, temperature, user = choice
    params: dict[str, Any] = {}
    if temperature is not None:
        params["temperature"] = temperature
    if user is not None:
        params["user"] = user  # not in the key: any user's answer may serve
    return [{"role": "user", "content": content}], params


def _settings() -> polygate.Settings:
    source = polygate.Source(name="a", base_url="http://a/v1")
    return polygate.Settings(scopes={"chat": polygate.Scope(sources=[source], cache_ttl_s=60)}, cache="memory")


@settings(max_examples=60, deadline=None)
@given(st.lists(request_strategy, min_size=1, max_size=12))
def test_a_hit_never_returns_another_requests_answer(requests: list[tuple[str, Any, Any]]) -> None:
    up = FakeUpstream(lambda req, rng: Reply(text=_answer(req)))

    async def main() -> None:
        async with polygate.session(_settings(), transport=Router({"a": up})) as s:
            for choice in requests:
                messages, params = _request(choice)
                r = await s.chat(messages, **params)
                # made for a request equal to this one, but maybe for another `user`
                keyed = {k: v for k, v in params.items() if k != "user"}
                assert r.text in {_expected(messages, {**keyed, **({"user": u} if u else {})})
                                  for u in (None, "alice", "bob")}
                if r.call_stats.cached:
                    hits.append(r.text)

    hits: list[str] = []

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    distinct = {(c, t) for c, t, _ in requests}
    assert len(hits) == len(requests) - len(distinct)  # and every repeat was a hit


# --------------------------------------------------------------------------- coalescing


callers = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0]),              # when it calls
        st.one_of(st.none(), st.sampled_from([0.0, 0.5, 2.0, 6.0])),  # cancelled after
        st.sampled_from(["chat", "chat", "stream"]),
    ),
    min_size=1, max_size=6,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(callers, st.sampled_from([0.0, 1.0, 4.0]), st.booleans())
def test_coalescing_under_cancellation(
    plan: list[tuple[float, float | None, str]], latency: float, fatal: bool,
) -> None:
    """Whoever is cancelled, every caller that is not gets the answer — or, when the
    upstream rejects the request, a clean FatalUpstreamError of its own (never a
    group, never another's cancellation); the upstream is asked at most once per
    cancelled leader, plus once; no task is left."""
    reply = Reply(status=400, headers_delay_s=latency) if fatal else Reply(first_token_s=latency, text="the answer")
    up = FakeUpstream(reply)
    outcomes: list[str] = ["?"] * len(plan)
    errors: list[BaseException] = []

    async def main() -> None:
        async with polygate.session(_settings(), transport=Router({"a": up})) as s:

            async def caller(i: int, start: float, cancel_after: float | None, how: str) -> None:
                await trio.sleep(start)
                with trio.CancelScope() as scope:
                    if cancel_after is not None:
                        scope.deadline = trio.current_time() + cancel_after
                    try:
                        if how == "stream":
                            async with s.stream_chat([{"role": "user", "content": "q"}]) as stream:
                                text = "".join([c.text async for c in stream])
                            assert stream.response is not None
                            assert stream.response.text == text
                        else:
                            text = (await s.chat([{"role": "user", "content": "q"}])).text
                    except polygate.FatalUpstreamError as exc:
                        errors.append(exc)
                        outcomes[i] = "fatal"
                        return
                    assert text == "the answer"
                    outcomes[i] = "answer"
                if scope.cancelled_caught:
                    outcomes[i] = "cancelled"

            async with trio.open_nursery() as nursery:
                for i, (start, cancel_after, how) in enumerate(plan):
                    nursery.start_soon(caller, i, start, cancel_after, how)
            stats = (await s.statistics()).cache
            assert stats.in_flight == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "?" not in outcomes
    expected = "fatal" if fatal else "answer"
    for (_, cancel_after, _), outcome in zip(plan, outcomes, strict=True):
        if cancel_after is None:
            assert outcome == expected  # never cancelled by anyone else's cancellation
        else:
            assert outcome in (expected, "cancelled")
    assert len({id(e) for e in errors}) == len(errors)  # each its own error
    completed = [r for r in up.requests if r.outcome == "complete"]
    closed = [r for r in up.requests if r.outcome == "client_closed"]
    if not fatal:
        assert len(completed) <= 1  # after one complete answer everyone else is served
    assert all(r.outcome is not None for r in up.requests)  # nothing still running
    # every upstream call but the last was abandoned by its cancelled leader
    assert len(closed) <= sum(1 for _, c, _ in plan if c is not None)
