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
