"""The fuzzing suite: hostile bytes and careless configuration against the SSE
decoder, the assembler, the error classifier and the configuration loaders.

The invariant everywhere: **a typed error or a correct result, in bounded time and
memory, and never the secret in any output.**  ``POLYGATE_FUZZ_EXAMPLES`` sets the
examples per property (default 100: the whole file takes ~20-40 s, time-boxed for
CI); raise it for a longer local run, or use the atheris harness in ``fuzz/`` for
coverage-guided runs of hours (docs/security.md).
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import polygate
from polygate._config import mask_url
from polygate._config_load import describe, settings_from_env, settings_from_toml
from polygate._errors import classify_exception, classify_status, error_message, refusal_hint
from polygate.transport import ChatAssembler, Endpoint, has_content
from polygate.transport._exchange import _classified, _error_event
from polygate.transport._sse import SSEDecoder
from polygate.transport._wire import _error_detail, check_depth

EXAMPLES = int(os.environ.get("POLYGATE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
pytestmark = pytest.mark.timeout(60 + EXAMPLES // 4)  # a longer run gets a longer bound
#: Generous (examples run under tracemalloc, on a shared CI machine): an example that
#: takes this long is a hang.  Growth rates are measured in test_sse_limits.py.
TIME_LIMIT_S = 10.0
SECRET = "sk-fuzz-SECRET-7c1d9e0a5b3f"


def _leaks(secret: str, text: str) -> bool:
    """The secret, or its first 6+ characters, in the text (raw or repr-escaped)."""
    forms = {secret, repr(secret)[1:-1], json.dumps(secret)[1:-1]}
    return any(form[:n] in text for form in forms for n in range(6, len(form) + 1))


class Bounded:
    """Time and memory of one example, checked against the limits on exit."""

    def __init__(self, memory: int) -> None:
        self.memory = memory

    def __enter__(self) -> Bounded:
        tracemalloc.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        took = time.perf_counter() - self.start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert took < TIME_LIMIT_S, f"{took:.2f}s"
        assert peak < self.memory, f"peak {peak} bytes"


# --------------------------------------------------------------------------- SSE

SSE_WORDS = st.sampled_from([
    b"data:", b"data: ", b"event:", b"event: error", b"id: 1", b":", b" ", b"x", b"{}",
    b"[DONE]", b"\n", b"\r", b"\r\n", b"\n\n", b"retry: 5", b"\xff", b"data", b"[", b"]",
])
sse_bodies = st.lists(SSE_WORDS, max_size=60).map(b"".join) | st.binary(max_size=400)


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def _decode(pieces: list[bytes], max_line: int, max_body: int) -> list[tuple[str, bytes]] | str:
    decoder = SSEDecoder(max_body=max_body, max_line=max_line, source="s")
    try:
        events = [(e.event, e.data) for p in pieces for e in decoder.feed(p)]
        return events + [(e.event, e.data) for e in decoder.flush()]
    except polygate.TransientUpstreamError:
        return "refused"


@FUZZ
@given(data=sse_bodies, cuts=st.lists(st.integers(0, 500), max_size=12),
       max_line=st.integers(1, 80), max_body=st.integers(1, 600))
@example(data=b"data: " + b"x" * 100 + b"\n\n", cuts=[], max_line=8, max_body=600)
@example(data=b"data: 12\n\n", cuts=[9], max_line=8, max_body=600)
def test_sse_decoder_is_typed_bounded_and_split_invariant(
    data: bytes, cuts: list[int], max_line: int, max_body: int
) -> None:
    """Whatever the bytes, caps and chunking: the same events, or a typed refusal,
    for every way of cutting the same body."""
    with Bounded(memory=64 * 1024 + 20 * len(data)):
        whole = _decode([data], max_line, max_body)
        assert _decode(_pieces(data, cuts), max_line, max_body) == whole


def _hostile_sse(kind: str, size: int) -> bytes:
    if kind == "lines":
        return b"data: x\n" * (size // 8)
    if kind == "one_line":
        return b"data: " + b"x" * size
    if kind == "blank_runs":
        return b"\n" * size
    return b"data: {}\n\n" * (size // 10)


@FUZZ
@given(kind=st.sampled_from(["lines", "one_line", "blank_runs", "events"]),
       size=st.integers(1, 100_000), piece=st.integers(64, 5000))
def test_sse_decoder_work_is_linear_in_hostile_shapes(kind: str, size: int, piece: int) -> None:
    data = _hostile_sse(kind, size)
    pieces = _pieces(data, list(range(piece, len(data), piece)))
    with Bounded(memory=8 * len(data) + 512 * 1024):
        result = _decode(pieces, 1 << 16, 1 << 30)
    assert result == "refused" or isinstance(result, list)


# --------------------------------------------------------------------------- assembler

KEYS = ["choices", "index", "delta", "content", "reasoning_content", "reasoning", "refusal",
        "tool_calls", "function_call", "function", "name", "arguments", "id", "type", "role",
        "finish_reason", "logprobs", "usage", "prompt_tokens", "completion_tokens", "model",
        "created", "system_fingerprint", "message", "error", "x"]
scalars = (st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True)
           | st.sampled_from(["", "a", "stop", "function", SECRET]))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=5),
    max_leaves=30,
)
chunks = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)


@FUZZ
@given(stream=st.lists(chunks, max_size=12), caps=st.integers(1, 4))
def test_assembler_is_total_bounded_and_consistent(stream: list[dict[str, Any]], caps: int) -> None:
    assembler = ChatAssembler(max_choices=caps, max_tool_calls=caps, source="s")
    try:
        for chunk in stream:
            assert assembler.add(chunk) == has_content(chunk)
    except polygate.TransientUpstreamError as exc:
        refused = str(exc)
        assert "malformed stream" in refused
        return
    body = assembler.build()
    json.dumps(body, default=str)
    assert 1 <= len(body["choices"]) <= caps
    for choice in body["choices"]:
        assert len(choice["message"].get("tool_calls") or []) <= caps
    polygate.Usage.from_wire(body.get("usage"))


# --------------------------------------------------------------------------- errors

ENDPOINT = Endpoint("a", "http://h/v1", SECRET)
texts = st.text(max_size=80) | st.sampled_from(["", SECRET, f"key {SECRET!r}", json.dumps(SECRET)])


def _with_secret(text: str, at: int) -> str:
    at %= len(text) + 1
    return text[:at] + SECRET + text[at:]


@FUZZ
@given(text=texts, at=st.integers(0, 400), status=st.integers(100, 599),
       shape=st.sampled_from(["plain", "json", "nested", "list"]), pad=st.integers(0, 400))
def test_error_messages_never_show_the_key(text: str, at: int, status: int, shape: str, pad: int) -> None:
    assume(not _leaks(SECRET, text))  # the fuzzer's own text may not spell the key
    message = _with_secret("y" * pad + text, at + pad)
    if shape == "plain":
        body = message.encode()
    elif shape == "json":
        body = json.dumps({"error": {"message": message, "code": status}}).encode()
    elif shape == "nested":
        body = json.dumps({"error": {"message": {"detail": [message]}}}).encode()
    else:
        body = json.dumps([message, status]).encode()
    for cut in (False, True):
        detail, code, payload = _error_detail(
            body[: max(1, len(body) - (at % 7))] if cut else body, cut, ENDPOINT.secrets)
        error = classify_status(status, detail, source="a", code=code,
                                hint=refusal_hint(status, payload))
        assert code is None or not _leaks(SECRET, code)
        assert not _leaks(SECRET, str(error) + repr(error))
    event = _error_event(body.decode("utf-8", "replace"), ENDPOINT)
    assert not _leaks(SECRET, str(event) + repr(event))
    assert not _leaks(SECRET, error_message(json.loads(body) if shape != "plain" else message, 50, (SECRET,)))


EXCEPTIONS = [httpx.ReadError, httpx.RemoteProtocolError, httpx.LocalProtocolError, httpx.ConnectError,
              httpx.ReadTimeout, ValueError, UnicodeError, KeyError, TypeError, RecursionError,
              h11.RemoteProtocolError, LookupError, OSError]


@FUZZ
@given(kind=st.sampled_from(EXCEPTIONS), text=texts, at=st.integers(0, 100),
       escape=st.sampled_from(["raw", "repr", "bytes", "json"]))
def test_the_classifier_is_total_and_never_shows_the_key(
    kind: type[BaseException], text: str, at: int, escape: str
) -> None:
    assume(not _leaks(SECRET, text))
    spelled = {"raw": SECRET, "repr": repr(SECRET)[1:-1], "bytes": repr(SECRET.encode())[2:-1],
               "json": json.dumps(SECRET)[1:-1]}[escape]
    message = text[: at % (len(text) + 1)] + spelled + text[at % (len(text) + 1):]
    exc = kind(message)
    assert isinstance(classify_exception(exc), polygate.UpstreamError)

    async def classified() -> polygate.UpstreamError:
        return _classified(exc, ENDPOINT)  # logs a bug's traceback, rate-limited in trio time

    error = trio.run(classified)
    assert isinstance(error, polygate.UpstreamError)
    assert not _leaks(SECRET, str(error) + repr(error))


@FUZZ
@given(depth=st.integers(0, 3000), shape=st.sampled_from([b"[]", b"{}", b'"['])
       , limit=st.integers(1, 200))
def test_the_depth_check_refuses_exactly_what_is_too_deep(depth: int, shape: bytes, limit: int) -> None:
    if shape == b'"[':  # brackets inside a string are not nesting
        data = b'"' + b"[" * depth + b'"'
        nested = 0
    else:
        data = shape[:1] * depth + shape[1:] * depth
        nested = depth
    try:
        check_depth(data, limit, "s")
    except polygate.TransientUpstreamError:
        assert nested > limit
    else:
        assert nested <= limit


# --------------------------------------------------------------------------- configuration

password_chars = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="@:")
passwords = st.text(password_chars, min_size=8, max_size=20)
key_chars = st.characters(min_codepoint=0, max_codepoint=0x2FF)


def _config_texts(exc: BaseException) -> str:
    return str(exc) + repr(exc) + repr(exc.args)


@FUZZ
@given(password=passwords.map(lambda p: "zq9" + p), kind=st.sampled_from(["base_url", "backend", "telemetry"]),
       host=st.sampled_from(["127.0.0.1:5000", "h", "h:99999", "[::1", ""]))
@example(password="zq9Xk9mQ2vL#p", kind="backend", host="127.0.0.1:5000")
@example(password="zq91234/Xk9mQ2v", kind="base_url", host="h")
def test_a_url_password_is_never_in_a_message_or_a_repr(password: str, kind: str, host: str) -> None:
    scheme = {"base_url": "http", "backend": "redis", "telemetry": "postgresql"}[kind]
    url = f"{scheme}://user:{password}@{host}/v1"
    try:
        if kind == "base_url":
            made: Any = polygate.Source(name="a", base_url=url)
        else:
            made = polygate.Settings(scopes={"c": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://h")])}, **{kind: url})
    except polygate.ConfigError as exc:
        message = _config_texts(exc)
        assert not _leaks(password, message), message
    else:
        assert not _leaks(password, repr(made) + json.dumps(describe(made)) if kind != "base_url" else repr(made))
    assert not _leaks(password, mask_url(url))


@FUZZ
@given(tail=st.text(key_chars, min_size=5, max_size=30),
       loader=st.sampled_from(["python", "env", "toml"]))
@example(tail="-SECRET-\x00-abcdef", loader="env")
@example(tail="-SECRET-abcdef\u200b", loader="toml")
def test_a_key_is_accepted_only_if_it_can_be_sent_and_never_echoed(
    tail: str, loader: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    key = "zq9" + tail  # a marker no message or repr spells by chance
    assume(("\r" not in key and "\n" not in key) or loader == "python")
    try:
        if loader == "python":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                settings_ = polygate.Settings(scopes={"c": polygate.Scope(sources=[
                    polygate.Source(name="a", base_url="http://h/v1", api_key=key)])})
            for warning in caught:  # built in Python: announced, never echoed, never sent
                assert not _leaks(key, str(warning.message))
            if caught:
                endpoint = Endpoint("a", "http://h/v1", key)
                assert endpoint.key_problem is not None
                assert all(name != "authorization" for name, _ in endpoint.headers(None))
                return
        elif loader == "env":
            settings_ = settings_from_env({"POLYGATE__C__A__BASE_URL": "http://h/v1",
                                           "POLYGATE__C__A__API_KEY": key})
        else:
            path = Path(tmp_path_factory.mktemp("toml")) / "p.toml"
            path.write_text(f'[scopes.c.sources.a]\nbase_url = "http://h/v1"\napi_key = {json.dumps(key)}\n',
                            encoding="utf-8")
            settings_ = settings_from_toml(str(path))
    except polygate.ConfigError as exc:
        core = key.strip() if loader == "env" else key
        message = _config_texts(exc)
        assert not _leaks(core, message) or len(core) < 6
        return
    sent = settings_.scopes["c"].sources[0].api_key
    assert sent is not None
    ("Bearer " + sent).encode("ascii")  # it can travel in a header ...
    assert h11.Request(method="POST", target="/", headers=[("host", "h"), ("authorization", "Bearer " + sent)])
    assert not _leaks(sent, repr(settings_) + json.dumps(describe(settings_)))  # ... and never shows
