"""Review finding (failed on main f431ce0, fixed since): `polygate serve` hands every body
key except scope/call_deadline_s to Session.chat as keywords, so a client can set the
session-level keywords that arrived in parallel branches: ``schema`` (structured
re-asks: up to max_reasks+1 upstream calls per request, failure mapped to 503
'unavailable') and ``cache`` (False / "refresh": bypass, or overwrite, the shared cache
for every other client).  Neither is documented in docs/serve.md; neither is an
OpenAI parameter; both are refused nowhere.

Run: python -m pytest tests/interplay/test_f_serve_body_keywords.py -q
"""

from __future__ import annotations

import attrs
import pytest

from polygate.serve import open_server
from polygate.testing import FakeUpstream, Reply

from .._serve_kit import AUTH, CHAT, gateway, http, settings_for

pytestmark = pytest.mark.integration


async def test_client_cannot_turn_on_structured_reasks() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with gateway(Reply(text="not json at all")) as (server, upstream):
        answer = await http(server, "POST", "/v1/chat/completions", {**CHAT, "schema": schema}, AUTH)
    sent = [r for r in upstream.requests if r.path.endswith("/chat/completions")]
    # Was: 3 upstream calls (1 + 2 re-asks, polygate's response_format injected) and a
    # 503 "unavailable" for a StructuredOutputError.  Now: a 400 before any upstream call.
    assert (len(sent), answer.status) == (0, 400), (len(sent), answer.status, answer.body[:200])
    assert b"schema" in answer.body


async def test_client_cannot_bypass_or_refresh_the_shared_cache() -> None:
    upstream = FakeUpstream(Reply(text="cached answer"))
    async with upstream.serve() as url:
        settings = attrs.evolve(settings_for(url, cache_ttl_s=60.0), cache="memory")
        async with open_server(settings, port=0) as server:
            first = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
            again = await http(
                server, "POST", "/v1/chat/completions", {**CHAT, "cache": "refresh"}, AUTH
            )
    assert first.status == 200
    # Observed: 200 and a second upstream call (the client refreshed the shared entry).
    assert again.status == 400 or again.headers.get("x-polygate-cached") == "true", (
        again.status, again.headers.get("x-polygate-cached"), len(upstream.requests)
    )
