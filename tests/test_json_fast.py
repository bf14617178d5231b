"""polygate._json: msgspec's speed, the standard library's answers.

The cache decodes stored answers and hashes canonical keys with msgspec; these
properties hold it to what ``json`` returned before, on the documents where the two
libraries differ (NaN tokens, integers beyond 64 bits, lone surrogates, overflowing
numbers, a byte-order mark)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import example, given
from hypothesis import strategies as st

from polygate._json import dumps, loads, sorted_dumps
from polygate.cache import canonical_json, chat_key, embed_keys
from polygate.transport import _wire
from polygate.transport._wire import Endpoint, chat_body

leaves = (
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: msgspec must read 2**200 as the int it is
    | st.floats(width=64)  # NaN and ±inf included
    | st.text(alphabet=st.characters(), max_size=6)  # lone surrogates included
)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    """Equal as decoded values, types included (1 is not 1.0, NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@given(values, st.booleans(), st.booleans())
def test_loads_returns_what_json_returns(value: Any, ascii_only: bool, as_text: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    document: str | bytes = text if as_text else text.encode("utf-8", "surrogatepass")
    assert same(loads(document), json.loads(document))


@pytest.mark.parametrize("document", [
    b"[18446744073709551617]", b"[-9223372036854775809]", b"[NaN, Infinity, -Infinity]", b"[1e400]",
    b'["\\ud800"]', b'{"a": 1, "a": 2}', b' [1.0, -0.0, 1E2] ', b'"\xed\xa0\x80"',
])
def test_loads_on_the_documents_msgspec_and_json_disagree_on(document: bytes) -> None:
    assert same(loads(document), json.loads(document))


def test_loads_reads_what_json_reads_beyond_utf8() -> None:
    """json.loads sniffs a byte-order mark and UTF-16/32: so does loads (through it)."""
    for document in (b"\xef\xbb\xbf[1]", '["\u00e9"]'.encode("utf-16"), '{"a": 1}'.encode("utf-32-le")):
        assert same(loads(document), json.loads(document))


@pytest.mark.parametrize("document", [
    b"", b"[1,", b"{'a': 1}", b"\xff", b"[1] x", b'"a\tb"', b"01", b'"\\x"', b"\x0c[1]",
    b'"\xf4\x90\x80\x80"',
])
def test_loads_refuses_what_json_refuses(document: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(document)
    with pytest.raises(ValueError):
        loads(document)


def test_loads_too_deep_fails_as_json_does() -> None:
    """Whatever this Python's json does with 5000 levels (3.11 recurses out of its
    stack; 3.13's decoder reads it), loads() does the same."""
    deep = b"[" * 5000 + b"]" * 5000
    try:
        expected: Any = json.loads(deep)
    except RecursionError:
        with pytest.raises(RecursionError):
            loads(deep)
    else:
        assert loads(deep) == expected
    assert loads(b"[" * 900 + b"]" * 900) == json.loads(b"[" * 900 + b"]" * 900)


def test_a_big_integer_stays_exact() -> None:
    """orjson would read 2**64 + 1 as the float 1.8446744073709552e19: a cached answer
    must give back the very integer the upstream sent."""
    assert loads(b'{"seed": 18446744073709551617}') == {"seed": 2**64 + 1}
    assert type(loads(b"[18446744073709551617]")[0]) is int


@given(values)
def test_sorted_dumps_parses_back_to_its_value_or_declines(value: Any) -> None:
    encoded = sorted_dumps(value)
    if encoded is None:  # only for what msgspec cannot write as json would
        text = json.dumps(value)
        assert "NaN" in text or "Infinity" in text or not _utf8(value)
        return
    assert same(json.loads(encoded), json.loads(json.dumps(value, sort_keys=True)))


def _utf8(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def test_sorted_dumps_declines_non_finite_floats_rather_than_write_null() -> None:
    assert sorted_dumps({"t": float("nan")}) is None
    assert sorted_dumps([1, [float("-inf")]]) is None
    assert sorted_dumps({"t": None, "u": "null"}) == b'{"t":null,"u":"null"}'


def test_keys_tell_nan_and_none_apart_and_big_integers_apart() -> None:
    """The cases where a faster encoder would merge two requests into one key."""
    messages = [{"role": "user", "content": "x"}]
    assert chat_key("chat", ["m"], messages, {"p": float("nan")}) != chat_key("chat", ["m"], messages, {"p": None})
    assert chat_key("chat", ["m"], messages, {"p": 2**64 + 1}) != chat_key("chat", ["m"], messages, {"p": 2**64})
    assert chat_key("chat", ["m"], messages, {"p": float("inf")}) != chat_key(
        "chat", ["m"], messages, {"p": float("-inf")})
    assert embed_keys("e", ["m"], ["a\ud800"], {}) != embed_keys("e", ["m"], ["a\ud801"], {})


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert canonical_json({"b": 1.0, "a": ["é", (2, 0.5)]}) == '{"a":["é",[2,0.5]],"b":1}'
    assert canonical_json({"x": float("nan")}) == '{"x":NaN}'


@given(values)
def test_dumps_writes_what_json_writes_or_declines(value: Any) -> None:
    encoded = dumps(value)
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        expected: bytes | None = text.encode()
    except (ValueError, UnicodeEncodeError):  # NaN / ±Infinity; a lone surrogate
        expected = None
    if expected is None:
        assert encoded is None
    else:
        assert encoded is not None and same(json.loads(encoded), json.loads(expected))


def test_dumps_declines_a_non_finite_float_anywhere() -> None:
    """msgspec would write null; a tuple or a float subclass must not slip past."""

    class Ratio(float):
        pass

    class Doc(dict):  # type: ignore[type-arg]
        pass

    class Items(list):  # type: ignore[type-arg]
        pass

    for value in ({"a": [1, (2, float("nan"))]}, (float("inf"),), [Ratio("nan")], {"k": {"x": -math.inf}},
                  [None, Doc(x=float("nan"))], {"k": Items([1, float("inf")]), "n": None}):
        assert dumps(value) is None
    assert dumps({"a": None, "b": [1.5, "null"]}) == b'{"a":null,"b":[1.5,"null"]}'


@pytest.mark.parametrize("document", [
    b'"\xc0\xaf"', b'"\xed\xa0\x80"', b'"\xf8\x88\x80\x80\x80"', b'"\\ud800"', b'{"\\udc00": 1}',
    b'"\\ud83d\\ude00\\udc00"',
])
def test_what_msgspec_reads_is_strict_utf8(document: bytes) -> None:
    """The transport skips its surrogate repair for what msgspec read: so msgspec must
    refuse every byte sequence that is not strict UTF-8, and every lone surrogate
    escape (a pair is one character, and fine)."""
    calls: list[bytes] = []

    def fallback(data: bytes) -> str:
        calls.append(data)
        return "slow"

    assert loads(document, fallback) == "slow" and calls == [document]


# Escapes, controls and lone surrogates drawn often (st.characters() alone rarely does).
tricky = st.characters() | st.sampled_from(["\ud800", "\udfff", "\x00", "\x1f", "\x7f", "\u2028", '"', "\\", "é"])
text_messages = st.lists(
    st.dictionaries(st.text(max_size=5), st.text(alphabet=tricky, max_size=8), max_size=3).map(
        lambda d: {"role": "user", **d}),
    min_size=1, max_size=3,
)


@given(text_messages)
def test_plain_text_messages_encode_byte_for_byte_as_before(messages: list[dict[str, str]]) -> None:
    """The fast path of the session's message check (msgspec, for text-only messages)
    gives the very JSON the standard encoder gave, and refuses what it refused."""
    from polygate._errors import ConfigError
    from polygate._session import _check_messages

    try:
        expected = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
        expected.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: refused, naming the message
        with pytest.raises(ConfigError, match=r"messages\[\d\] is not valid Unicode"):
            _check_messages(messages)
        return
    own, encoded = _check_messages(messages)
    assert encoded == expected
    # The call's own copy (see test_call_arguments.py) is what the JSON says.
    assert own == messages and own is not messages
    assert all(mine is not theirs for mine, theirs in zip(own, messages, strict=True))


# --------------------------------------------------------------------------- found by a differential probe


@pytest.mark.parametrize("key", [float("nan"), b"k", 1e16, 7])
def test_a_message_key_that_is_not_text_takes_the_standard_path(key: Any) -> None:
    """msgspec writes keys json refuses (NaN, bytes) and spells others its own way
    (1e16, not 1e+16): the fast path is for text keys only."""
    from polygate._errors import ConfigError
    from polygate._session import _check_messages

    messages = [{"role": "user", "content": "hi", key: "x"}]
    try:
        expected = json.dumps(messages, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        with pytest.raises(ConfigError):
            _check_messages(messages)
        return
    own, encoded = _check_messages(messages)
    assert encoded == expected
    assert json.dumps(own, ensure_ascii=False, separators=(",", ":")) == expected


def test_a_deep_value_with_a_null_does_not_exhaust_the_stack() -> None:
    """The NaN check after msgspec walked the value recursively: ~400 levels with a null
    raised RecursionError from a cache key that json had written."""
    value: Any = None
    for _ in range(600):
        value = [value]
    encoded = sorted_dumps(value)
    assert encoded is not None and encoded.count(b"[") == 600
    # A key walks the value (canonical()) as it did with json alone: as deep as that
    # walk goes (~500 levels), the null check after msgspec must go too.
    param: Any = None
    for _ in range(400):
        param = [param]
    messages = [{"role": "user", "content": "x"}]
    assert chat_key("chat", ["m"], messages, {"x": param}) != chat_key("chat", ["m"], messages, {"x": [param]})


def _entries() -> list[tuple[bytes, Any]]:
    from polygate._types import CallStats, ChatResponse, Usage
    from polygate.cache._codec import decode_chat, decode_vector, encode_chat, encode_vector

    message = {"role": "assistant", "content": "Paris."}
    choices = [{"index": 0, "message": message, "finish_reason": "stop"}]
    answer = ChatResponse(
        text="Paris.", message=message, choices=choices, usage=Usage(3, 2, 5), source="a", model="m",
        finish_reason="stop", raw={"choices": choices}, call_stats=CallStats(logical_call_id="x"),
    )
    vector = encode_vector([0.5], model="m", source="a", tokens=1, usage_source="upstream")
    return [(encode_chat(answer), decode_chat), (vector, decode_vector)]


@pytest.mark.parametrize(("prefix", "encoding"), [(b"\xef\xbb\xbf", "utf-8"), (b"", "utf-16"), (b"", "utf-32")])
def test_a_cache_entry_not_in_plain_utf8_is_a_bad_entry(prefix: bytes, encoding: str) -> None:
    """Entries are UTF-8 JSON; one another program rewrote with a BOM or in UTF-16/32 is
    not served (json.loads would sniff the encoding and read it)."""
    for data, decode in _entries():
        decode(data)  # as stored: it reads
        with pytest.raises(ValueError):
            decode(prefix + data.decode("utf-8").encode(encoding))


@given(
    st.dictionaries(st.text(max_size=8), values, max_size=5),
    st.lists(st.dictionaries(st.sampled_from(["role", "content"]), st.text(alphabet=tricky, max_size=6)),
             max_size=3),
    st.booleans(), st.booleans(), st.sampled_from([None, "m1"]),
)
def test_a_chat_body_is_the_request_json_would_write(
    params: dict[str, Any], messages: list[dict[str, str]], as_bytes: bool, stream: bool,
    model: str | None,
) -> None:
    """chat_body writes its parameters with msgspec and falls back to json's encoder
    (a non-finite float, a lone surrogate): whichever writes them, the body reads back
    as the request, keys in order, with the source's model, the stream flags and the
    messages last, exactly as they were encoded."""
    endpoint = Endpoint(name="a", url="http://upstream/v1", model=model)
    text = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    messages_json: str | bytes = text.encode("utf-8", "backslashreplace") if as_bytes else text
    body = json.loads(chat_body(endpoint, messages_json, params, stream))  # NaN allowed
    expected = {k: v for k, v in params.items() if k not in ("messages", "stream")}
    if model is not None:
        expected["model"] = model
    if stream:
        expected["stream"] = True
        given_options = expected.get("stream_options")
        expected["stream_options"] = {**(given_options if isinstance(given_options, dict) else {}),
                                      "include_usage": True}
    else:
        expected.pop("stream_options", None)
    expected["messages"] = json.loads(text.encode("utf-8", "backslashreplace"))
    assert same(body, json.loads(json.dumps(expected, ensure_ascii=False).encode("utf-8", "backslashreplace")))


@pytest.mark.parametrize("key", [1e-5, 1e16, 1e22, 2.5, 7, 2**70, True, None])
def test_a_chat_body_writes_a_key_that_is_not_text_as_json_does(key: Any) -> None:
    """json writes a float key with repr (``1e-05``), msgspec otherwise (``0.00001``):
    another key, not another spelling.  Such a body is json's, byte for byte."""
    endpoint = Endpoint(name="a", url="http://upstream/v1", model="m1")
    params = {"logit_bias": {key: 1}, "max_tokens": 8}
    body = chat_body(endpoint, "[]", params, False)
    expected = json.dumps({**params, "model": "m1", "messages": []}, ensure_ascii=False,
                          separators=(",", ":")).encode()
    assert body == expected


class _Count(int):
    pass


_ANY_CHARACTER = st.characters(exclude_categories=())  # lone surrogates included
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(width=64) | st.text(_ANY_CHARACTER, max_size=4)


@given(st.dictionaries(
    st.text(_ANY_CHARACTER, max_size=4),
    _SCALARS | values | st.builds(_Count, st.integers()) | st.builds(set, st.lists(st.integers(), max_size=2)),
    max_size=4,
))
@example({"\ud800": 1})
@example({"SCHE": {1}})  # (found by CI: a near miss of schema=, with a value JSON refuses)
@example({"t": float("nan")})
@example({"t": 0.5, "u": "\udc00"})
@example({"n": _Count(3)})
@example({"s": {1}})
@example({"seed": 10**5000})  # Python writes no int past 4,300 digits
@example({"seed": -(10**30)})
def test_call_parameters_skip_the_encoding_only_where_it_finds_nothing(params: dict[str, Any]) -> None:
    """Session._check_params trusts plain scalars without encoding them: wherever it
    does, the full check passes too; everything else gets the full check."""
    from polygate import ConfigError
    from polygate._session import (
        _NEAR_HEADS,
        _check_encoded,
        _check_params,
        _near_own,
        _plain_scalars,
    )

    if any(key[:4].lower() in _NEAR_HEADS and _near_own(key, "chat") for key in params):
        # A near miss of the call's own arguments ('SCHE' for schema=) is refused first,
        # for what it is, whatever its value (tests/test_call_arguments.py).
        with pytest.raises(ConfigError, match="not one of its own arguments"):
            _check_params(params)
        return
    try:
        _check_encoded(params)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    if _plain_scalars(params):
        assert refused is None
    if refused is None:
        _check_params(params)
    else:
        with pytest.raises(ConfigError) as info:
            _check_params(params)
        assert str(info.value) == refused


@pytest.mark.parametrize("key", ["plain", 1e-5])
async def test_a_calls_parameters_are_walked_once_however_many_attempts_send_them(
    key: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Outside review (polygate serve attacked): a gateway client's vendor parameter
    of millions of nested lists (7.5 MB, under every limit) held the loop 3.4 s on each
    attempt, walked again for its keys every time.  Walked once a call; each attempt
    still writes the body json would (a float key as ``1e-05``)."""
    import polygate._attempt
    from polygate.testing import FakeUpstream, Reply

    walks: list[int] = []
    real = polygate._attempt.plain_keys

    def counted(value: Any) -> bool:
        walks.append(1)
        return real(value)

    monkeypatch.setattr(polygate._attempt, "plain_keys", counted)
    monkeypatch.setattr(_wire, "plain_keys", counted)
    replies = iter([Reply(status=500), Reply(status=500), Reply()])
    upstream = FakeUpstream(lambda request, rng: next(replies))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", model="m1")],
        retry=polygate.Retry(max_attempts=3, same_source_retries=2))})
    params = {"x_vendor": [[[]] * 3] * 3, "logit_bias": {key: 1}}
    async with polygate.session(settings, transport=upstream.transport()) as s:
        await s.chat([{"role": "user", "content": "hi"}], **params)
    assert len(upstream.requests) == 3 and len(walks) == 1
    spelled = "1e-05" if key != "plain" else "plain"  # (msgspec: "0.00001", another key)
    assert all(request.body["logit_bias"] == {spelled: 1} for request in upstream.requests)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
@pytest.mark.parametrize("encode", ["dumps", "sorted_dumps"])
def test_out_of_memory_while_writing_is_a_memory_error_not_a_crash(encode: str) -> None:
    """Outside review (running out of the OS's resources): msgspec's ``encode`` crashed
    the process (SIGSEGV) when its output could not grow, so ``polygate serve`` under a
    memory limit died with every request in it, writing one large answer, instead of
    answering 503.  In a child under RLIMIT_AS, 8 MiB short of a 30 MiB answer."""
    code = textwrap.dedent(f"""
        import resource
        from polygate._json import {encode} as encode
        value = {{"choices": [{{"message": {{"content": "x" * (30 << 20)}}}}]}}
        size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (size + (8 << 20), resource.RLIM_INFINITY))
        try:
            encode(value)
        except MemoryError:
            print("MemoryError")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "MemoryError"), done.stderr[-2000:]
