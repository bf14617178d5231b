"""trio-asyncio, both ways: scenarios that ``tests/test_aio_trio_asyncio.py`` runs,
each in a fresh interpreter (``python -m tests._aio_trio_asyncio NAME``), because
importing trio_asyncio changes asyncio for the whole process (``new_event_loop()``
then makes trio-asyncio loops):

* the recipe in docs/asyncio.md: a trio application calling an asyncio-only library
  (here a tiny asyncio-streams HTTP client, as an SDK or a driver would be) inside
  ``trio_asyncio.open_loop()``, with cancellation crossing in both directions;
* polygate.aio used by asyncio code that runs on trio-asyncio's loop: no guest run is
  started (trio already runs in the thread); the sessions live in that trio run.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio

with warnings.catch_warnings():
    # On Python 3.12 and 3.13 trio-asyncio (0.16 too) subclasses asyncio's
    # AbstractChildWatcher, whose subclassing is deprecated: a warning at import that
    # is trio-asyncio's, not ours (the child runs with -W error for everything else).
    warnings.filterwarnings(
        "ignore", message="'AbstractChildWatcher' is deprecated", category=DeprecationWarning
    )
    import trio_asyncio  # (only ever imported in this child process)

import polygate
import polygate.aio
from polygate.testing import FakeUpstream, Reply

from ._aio_support import governance_idle, messages, request_for, settings_for
from .conftest import SECRET


async def asyncio_only_post(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """An asyncio-only client (asyncio streams): what an SDK or a driver looks like."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        body = json.dumps(payload).encode()
        writer.write(
            f"POST {parts.path}/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
            f"authorization: Bearer {SECRET}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        return dict(json.loads(await reader.read()))
    finally:
        writer.close()


async def scenario_trio_application_calls_an_asyncio_only_library() -> None:
    up = FakeUpstream(Reply(text="from the asyncio side"))
    async with up.serve() as url, trio_asyncio.open_loop():
        answer = await trio_asyncio.aio_as_trio(asyncio_only_post)(
            url, {"model": "m", "messages": messages("sdk")})
        assert answer["choices"][0]["message"]["content"] == "from the asyncio side"

        # polygate (trio) and the asyncio library in one program, one scheduler.
        async with polygate.session(settings_for(url)) as s:
            r = await s.chat(messages("native"))
            stored = await trio_asyncio.aio_as_trio(asyncio_only_post)(
                url, {"model": "m", "messages": messages(r.text)})
            assert stored["choices"]


async def scenario_trio_cancellation_reaches_the_asyncio_library() -> None:
    up = FakeUpstream(Reply(headers_delay_s=3600))
    seen: list[str] = []

    async def wrapped(url: str) -> None:
        try:
            await asyncio_only_post(url, {"model": "m", "messages": messages("hang")})
        except asyncio.CancelledError:
            seen.append("asyncio saw the cancellation")
            raise

    async with up.serve() as url, trio_asyncio.open_loop():
        with trio.move_on_after(0.2) as scope:
            await trio_asyncio.aio_as_trio(wrapped)(url)
        assert scope.cancelled_caught
        assert seen == ["asyncio saw the cancellation"]
        with trio.fail_after(10):
            while request_for(up, "hang").outcome is None:  # noqa: ASYNC110 - the fake's record
                await trio.sleep(0.01)
        assert request_for(up, "hang").outcome == "client_closed"


async def scenario_polygate_aio_on_trio_asyncios_loop() -> None:
    up = FakeUpstream(Reply(text="hello"))
    hang = FakeUpstream(Reply(headers_delay_s=3600))

    async def asyncio_application() -> str:
        assert isinstance(asyncio.get_running_loop(), trio_asyncio.TrioEventLoop)
        async with polygate.aio.session(settings_for("http://a/v1"), transport=up.transport()) as s, \
                polygate.aio.session(settings_for("http://a/v1"), transport=hang.transport()) as h:
            r = await s.chat(messages("x"))
            async with s.stream_chat(messages("y")) as stream:
                text = "".join([c.text async for c in stream])
            assert text == r.text
            task = asyncio.ensure_future(h.chat(messages("hang")))
            while hang.in_flight == 0:  # noqa: ASYNC110 - the fake's counter
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert request_for(hang, "hang").outcome == "client_closed"
            await governance_idle(h)
            with pytest.raises(polygate.ConfigError):
                await h.chat(messages("x"), bad=object())
            return r.text

    async with trio_asyncio.open_loop():
        assert await trio_asyncio.aio_as_trio(asyncio_application)() == "hello"
    assert up.in_flight == 0 and hang.in_flight == 0


async def scenario_trio_cancels_asyncio_code_waiting_on_polygate_aio() -> None:
    hang = FakeUpstream(Reply(headers_delay_s=3600))

    async def asyncio_application() -> None:
        async with polygate.aio.session(settings_for("http://a/v1"), transport=hang.transport()) as s:
            await s.chat(messages("hang"))

    async with trio_asyncio.open_loop():
        with trio.move_on_after(0.1) as scope:
            await trio_asyncio.aio_as_trio(asyncio_application)()
        assert scope.cancelled_caught
    assert request_for(hang, "hang").outcome == "client_closed"
    assert hang.in_flight == 0


async def scenario_a_trio_session_awaited_from_asyncio_code_is_refused() -> None:
    """Diff review: asyncio code on trio-asyncio's loop awaiting a trio session (the
    app forgot polygate.aio) passed the run check (trio's run is current there), was
    admitted, died in trio's first checkpoint ("Task got bad yield") and was charged to
    the source as its failure: three such calls, three consecutive failures."""
    up = FakeUpstream(Reply(text="hello"))
    async with polygate.session(settings_for("http://a/v1"), transport=up.transport()) as s:

        async def asyncio_code() -> None:
            await s.chat(messages("x"))

        async with trio_asyncio.open_loop():
            for _ in range(3):
                with pytest.raises(polygate.PolygateError, match=r"polygate\.aio"):
                    await trio_asyncio.aio_as_trio(asyncio_code)()
        assert (await s.chat(messages("y"))).text == "hello"
        state = (await s.statistics()).governance.sources[0].state
    assert (state.admissions, state.consecutive_failures) == (1, 0)
    assert len(up.requests) == 1


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in list(globals().items())
             if name.startswith("scenario_")}

if __name__ == "__main__":
    import sys

    trio.run(SCENARIOS[sys.argv[1]])
    print("ok")
