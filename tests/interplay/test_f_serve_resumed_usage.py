"""Review finding (failed on main f431ce0, fixed since), Medium-Low: ``polygate serve``
reports a resumed stream's usage as the *last segment's* only.  ``StreamShape.ending``
→ ``_usage`` (polygate/serve/_sse.py:108-111) prefers ``response.raw["usage"]``; for a
resumed stream ``raw`` is the last segment's body (polygate/_callstats.py:100), while
``response.usage`` is the sum over the segments (:101, :119-136).  A client that bills
from ``stream_options.include_usage`` is told 20 completion tokens for the 40 + 20
tokens it received; the gateway's own statistics and telemetry say otherwise.

Run: python -m pytest tests/interplay/test_f_serve_resumed_usage.py -q
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import polygate
from polygate._resume import CONTINUE_PROMPT
from polygate.testing import FakeUpstream, Reply

from .._serve_kit import AUTH, CHAT, gateway, http

pytestmark = pytest.mark.integration

WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)


def _behaviour(request: Any, rng: Any) -> Reply:
    messages = request.body["messages"]
    if messages[-1]["content"] == CONTINUE_PROMPT:  # the continuation: the last 20 words
        return Reply(text=" " + " ".join(WORDS[40:]))
    return Reply(text=ANSWER, fault="truncated", fault_after=40)  # cut after 40 tokens


async def test_usage_of_a_resumed_stream_counts_every_segment() -> None:
    upstream = FakeUpstream(_behaviour)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with gateway(upstream, sources=2, stream=polygate.StreamWatch(resume=True)) as (server, _):
        answer = await http(server, "POST", "/v1/chat/completions", body, AUTH)
    assert answer.status == 200
    events = [json.loads(line[6:]) for line in answer.body.decode().split("\n\n")
              if line.startswith("data: {")]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    assert text == ANSWER  # the stream itself was resumed correctly
    usage = next(e["usage"] for e in events if e.get("usage"))
    # Observed: {'prompt_tokens': ..., 'completion_tokens': 20, ...}: the continuation's alone.
    assert usage["completion_tokens"] >= 40, usage


async def test_a_cache_hit_of_a_resumed_stream_reports_the_same_usage() -> None:
    """Probe finding (third round): a hit of a stored resumed stream lost its usage
    through the gateway (JSON: no usage; stream: usage null), because the relay looked
    for a resume in the hit's own statistics.  A hit reports the usage the answer first
    reported (SPEC §8.3), as the library's ChatResponse.usage already did."""
    upstream = FakeUpstream(_behaviour)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with gateway(upstream, sources=2, stream=polygate.StreamWatch(resume=True),
                       cache="memory", cache_ttl_s=3600) as (server, _):
        first = await http(server, "POST", "/v1/chat/completions", body, AUTH)
        sent = len(upstream.requests)
        streamed_hit = await http(server, "POST", "/v1/chat/completions", body, AUTH)
        json_hit = await http(server, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert len(upstream.requests) == sent  # both were hits (a stream's headers leave before it knows)

    def stream_usage(answer: Any) -> Any:
        events = [json.loads(line[6:]) for line in answer.body.decode().split("\n\n")
                  if line.startswith("data: {")]
        return [e["usage"] for e in events if "usage" in e]

    [usage] = [u for u in stream_usage(first) if u]
    assert usage["completion_tokens"] >= 40
    assert stream_usage(streamed_hit)[-1] == usage
    assert json_hit.headers["x-polygate-cached"] == "true"
    assert {k: json_hit.json()["usage"][k] for k in usage} == usage
