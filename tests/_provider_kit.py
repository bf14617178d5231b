"""Kit of tests/test_provider_answers.py: a provider's recorded or documented bytes,
served through httpx.MockTransport, to the library and through the gateway."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import trio

import polygate
from polygate.serve import open_server

SECRET = "sk-test-SECRET-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "hi"}]


def settings(**source_kw: Any) -> polygate.Settings:
    return polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET, **source_kw)],
        retry=polygate.Retry(max_attempts=1),
    )})


def sse(events: list[Any], done: bool = True, sep: str = "\n\n") -> bytes:
    out = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}{sep}" for e in events)
    if done:
        out += f"data: [DONE]{sep}"
    return out.encode()


def serving(body: bytes, ctype: str = "text/event-stream", seen: list | None = None) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": ctype}, content=body)
    return httpx.MockTransport(handler)


async def chat(body: bytes, ctype: str = "text/event-stream", **kw: Any) -> polygate.ChatResponse:
    async with polygate.session(settings(), transport=serving(body, ctype)) as s:
        return await s.chat(MESSAGES, **kw)


async def stream(body: bytes, **kw: Any):
    async with polygate.session(settings(), transport=serving(body)) as s:
        async with s.stream_chat(MESSAGES, **kw) as st:
            chunks = [c async for c in st]
    return chunks, st.response


class TimedTransport(httpx.AsyncBaseTransport):
    """Serves ``pieces``: (delay_s, bytes) pairs, each sent after trio.sleep(delay)."""

    def __init__(self, pieces: list[tuple[float, bytes]], ctype: str = "text/event-stream") -> None:
        self.pieces = pieces
        self.ctype = ctype

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        pieces = self.pieces

        class Body(httpx.AsyncByteStream):
            async def __aiter__(self):
                for delay, data in pieces:
                    if delay:
                        await trio.sleep(delay)
                    yield data

            async def aclose(self) -> None:
                pass

        return httpx.Response(200, headers={"content-type": self.ctype}, stream=Body())


KEY = "sk-gw-test-0123456789"


def _settings(streaming: bool = True, cache: str = "off") -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1", streaming=streaming)],
            retry=polygate.Retry(max_attempts=1),
            cache_ttl_s=60 if cache != "off" else None)},
        serve=polygate.Serve(api_keys=[KEY]), cache=cache)


def transport(body: bytes, ctype: str = "text/event-stream") -> httpx.MockTransport:
    return httpx.MockTransport(
        lambda request: httpx.Response(200, headers={"content-type": ctype}, content=body))


async def relay(body: bytes, ctype: str = "text/event-stream", *, streaming: bool = True,
                include_usage: bool = True, cache: str = "off", **params: Any) -> dict[str, Any]:
    """What a gateway client gets: the JSON answer (raw dict), the SSE events (dicts),
    and the SDK's stream helper's final completion (dict)."""
    out: dict[str, Any] = {}
    async with open_server(_settings(streaming, cache), port=0, transport=transport(body, ctype)) as server:
        def work() -> None:
            with httpx.Client(timeout=20) as h:
                r = h.post(server.base_url + "/chat/completions",
                           headers={"authorization": f"Bearer {KEY}"},
                           json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], **params})
                out["json"] = r.json()
                out["json_headers"] = dict(r.headers)
                r = h.post(server.base_url + "/chat/completions",
                           headers={"authorization": f"Bearer {KEY}"},
                           json={"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                 "stream": True, "stream_options": {"include_usage": include_usage}, **params})
                events = []
                for line in r.text.split("\n"):
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                out["events"] = events
                out["sse_text"] = r.text
            with openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=20) as client:
                with client.chat.completions.stream(
                        model="chat", messages=[{"role": "user", "content": "hi"}],
                        stream_options={"include_usage": include_usage}, **params) as st:
                    out["sdk"] = st.get_final_completion().model_dump()
        await trio.to_thread.run_sync(work)
    return out
