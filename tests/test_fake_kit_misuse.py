"""polygate.testing as an application team's own test kit, misused as such kits are
(an outside review): its mistakes are named where they are made, and both faces
answer a failing script alike."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router

HI = [{"role": "user", "content": "hi"}]
BODY = {"model": "m", "messages": HI}


async def test_a_failing_script_is_the_same_500_on_the_transport_as_on_loopback(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """The transport let the script's exception out, which a client takes for the
    upstream's fault (polygate: "malformed upstream body", retried): a test of how an
    app meets a failing upstream passed on its own broken fixture, recorded as a
    ``fault`` where the loopback face records its ``500``."""
    caplog.set_level(logging.CRITICAL)

    def typo(request: Any, _rng: Any) -> Reply:
        return Reply(text=request.body["mesages"][0]["content"])

    upstream = FakeUpstream(typo)
    async with httpx.AsyncClient(transport=upstream.transport(), base_url="http://a/v1") as client:
        answer = await client.post("/chat/completions", json=BODY)
    assert answer.status_code == 500
    assert answer.text.startswith("FakeUpstream script failed: KeyError")
    assert (upstream.requests[0].status, upstream.requests[0].outcome) == (500, "complete")
    assert upstream.statistics().in_flight == 0


def _async_behaviour() -> Any:
    async def behaviour(_request: Any, _rng: Any) -> Reply:  # pragma: no cover
        return Reply()
    return behaviour


@pytest.mark.parametrize(("behaviour", "words"), [
    (Reply, "got the class Reply"),
    (lambda: Reply(), "takes (request, rng)"),
    (_async_behaviour(), "not an async one"),
], ids=["a-class", "no-arguments", "async"])
def test_a_behaviour_mistake_is_named_as_it_is_made(behaviour: Any, words: str) -> None:
    with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        FakeUpstream(behaviour)


async def test_a_router_key_with_a_default_port_matches(autojump_clock: trio.testing.MockClock) -> None:
    """httpx drops a scheme's default port from a URL: "a:80" never matched."""
    router = Router({"a:80": FakeUpstream(Reply()), "b:443": FakeUpstream(Reply()),
                     "[::1]:8000": FakeUpstream(Reply())})
    async with httpx.AsyncClient(transport=router) as client:
        for url in ("http://a:80/v1/chat/completions", "https://b/v1/chat/completions",
                    "http://[::1]:8000/v1/chat/completions"):
            assert (await client.post(url, json=BODY)).status_code == 200


def test_a_router_key_that_can_never_match_is_refused() -> None:
    with pytest.raises(ValueError, match="hosts or host:port"):
        Router({"http://a/v1": FakeUpstream(Reply())})


def test_the_transport_from_asyncio_says_what_to_use() -> None:
    upstream = FakeUpstream(Reply())

    async def main() -> None:
        async with httpx.AsyncClient(transport=upstream.transport(), base_url="http://a/v1") as client:
            await client.post("/chat/completions", json=BODY)

    with pytest.raises(RuntimeError, match=r"polygate\.aio\.session\(transport=\.\.\.\)"):
        asyncio.run(main())
    assert upstream.requests == []


async def test_through_polygate_a_failing_script_is_a_500(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL)

    def broken(_request: Any, _rng: Any) -> Reply:
        raise KeyError("oops")

    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], retry=polygate.Retry(max_attempts=1))})
    async with polygate.session(settings, transport=Router({"a": FakeUpstream(broken)})) as s:
        with pytest.raises(polygate.AllSourcesExhausted) as caught:
            await s.chat(HI)
    (error,) = caught.value.errors
    assert error.status_code == 500 and "script failed" in str(error)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"stream": "yes"}, "stream must be True or False"),
    ({"usage": "no"}, "usage must be True or False"),  # (truthy: the usage was sent)
    ({"done": None}, "done must be True or False"),
    ({"keepalive_s": True}, "keepalive_s must be a number"),
    ({"headers": 5}, "headers must be a mapping or"),
    ({"headers": [(1, 2, 3)]}, "headers must be a mapping or"),
])
def test_a_reply_field_of_the_wrong_kind_is_named(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises((TypeError, ValueError), match=words):
        Reply(**kwargs)


def test_a_profile_field_of_the_wrong_kind_is_named() -> None:
    from polygate.testing import Profile

    with pytest.raises(ValueError, match="streaming must be True or False"):
        Profile(streaming="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="base must be a Reply"):
        Profile(base=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_token_distribution_that_returns_no_number_is_named(value: float) -> None:
    import random

    from polygate.testing import Profile

    with pytest.raises(ValueError, match=r"Profile\.tokens: the distribution returned"):
        Profile(tokens=lambda _rng: value).draw(random.Random(0))


async def test_serve_takes_one_host_and_leaks_nothing() -> None:
    """``host=None`` listened on every address (two ports), then failed on its own
    TypeError with the sockets left open."""
    with pytest.raises(TypeError, match="serve\\(\\) takes one host"):
        async with FakeUpstream(Reply()).serve(host=None):  # type: ignore[arg-type]
            pass  # pragma: no cover


async def test_serve_on_a_name_of_several_addresses_listens_on_one_port() -> None:
    import socket

    upstream = FakeUpstream(Reply())
    async with upstream.serve(host="localhost") as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        for family, *_rest, address in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM):
            async with httpx.AsyncClient() as client:
                host = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                answer = await client.post(f"http://{host}:{port}/v1/chat/completions", json=BODY)
            assert answer.status_code == 200


def test_a_mock_or_a_decorated_function_is_still_a_behaviour() -> None:
    """The signature check refused what worked before: a Mock specced on a function (its
    code flags are mocks) and a decorator's wrapper that takes (request, rng)."""
    import functools
    from unittest import mock

    def answer(_request: Any, _rng: Any) -> Reply:
        return Reply()

    def numbered(_request: Any, _rng: Any, _n: int) -> Reply:
        return Reply()

    @functools.wraps(numbered)
    def wrapper(request: Any, rng: Any) -> Reply:
        return numbered(request, rng, 1)

    for behaviour in (mock.Mock(spec=answer, return_value=Reply()),
                      mock.MagicMock(spec=answer, return_value=Reply()), wrapper):
        FakeUpstream(behaviour)
    with pytest.raises(TypeError, match="not an async one"):
        FakeUpstream(mock.AsyncMock(return_value=Reply()))


@pytest.mark.parametrize("face", ["transport", "events"])
async def test_every_fake_transport_answers_a_failing_script_and_routes_alike(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, face: str,
) -> None:
    from polygate.testing import EventTransport

    caplog.set_level(logging.CRITICAL)

    def broken(_request: Any, _rng: Any) -> Reply:
        raise KeyError("oops")

    upstream = FakeUpstream(broken)
    transport = upstream.transport() if face == "transport" else EventTransport({"a:80": upstream})
    async with httpx.AsyncClient(transport=transport) as client:
        answer = await client.post("http://a/v1/chat/completions", json=BODY)
    assert answer.status_code == 500 and answer.text.startswith("FakeUpstream script failed")
    assert (upstream.requests[0].status, upstream.requests[0].outcome) == (500, "complete")
    with pytest.raises(ValueError, match="hosts or host:port"):
        EventTransport({"http://a/v1": upstream})


def test_the_fake_servers_command_refuses_an_empty_host() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "polygate.testing.serve", "--host", ""],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--host" in done.stderr and "Traceback" not in done.stderr


def test_an_aio_call_with_a_schema_too_deep_to_copy_gets_the_trio_error() -> None:
    import polygate.aio

    schema: dict[str, Any] = {"type": "object"}
    for _ in range(2_000):
        schema = {"type": "object", "properties": {"x": schema}}

    async def main() -> None:
        settings = polygate.Settings(scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1")])})
        async with polygate.aio.session(settings, transport=Router({"a": FakeUpstream(Reply())})) as s:
            await s.chat(HI, schema=schema)

    with pytest.raises(polygate.ConfigError):
        asyncio.run(main())
