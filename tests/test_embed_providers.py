"""Embedding endpoints of real providers, each answered as what it means (review,
embeddings across providers: each case below was refused or miscounted)."""

from __future__ import annotations

import json

import httpx
import pytest
import trio.testing

import polygate
from polygate.testing import FakeUpstream, Reply, Router


def _embeddings(vectors: list[list[float]], model: str, tokens: int) -> httpx.Response:
    """An embeddings answer of ``vectors``, in order, reporting ``tokens``."""
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return httpx.Response(200, json={"object": "list", "data": data, "model": model,
                                     "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _settings(name: str, **source: object) -> polygate.Settings:
    return polygate.Settings(scopes={"embed": polygate.Scope(sources=[
        polygate.Source(name=name, base_url=f"http://{name}/v1", **source)])})  # type: ignore[arg-type]


def _jina(request: httpx.Request) -> httpx.Response:
    """Jina's /v1/embeddings: ``embedding_type`` "binary" / "ubinary" packs 8 dimensions
    to a byte (Azure AI Inference's and vLLM's ``encoding_format`` the same)."""
    body = json.loads(request.content)
    dims = body.get("dimensions", 1024)
    packed = body.get("embedding_type") in ("binary", "ubinary") or body.get(
        "encoding_format") in ("binary", "ubinary")
    vector: list[float] = [7] * (dims // 8 if packed else dims)
    return _embeddings([vector] * len(body["input"]), "jina-embeddings-v3", 4)


@pytest.mark.parametrize("asked", [{"embedding_type": "ubinary"}, {"encoding_format": "binary"}])
async def test_packed_binary_embeddings_of_the_asked_dimensions_are_an_answer(
    autojump_clock: trio.testing.MockClock, asked: dict[str, str]
) -> None:
    """Review: 8 numbers for ``dimensions=64`` with a binary encoding is the answer
    asked for, not a source that "does not honour dimensions"."""
    router = Router({"jina": httpx.MockTransport(_jina)})
    async with polygate.session(_settings("jina"), transport=router) as s:
        assert len((await s.embed(["a"], dimensions=64)).vectors[0]) == 64
        assert len((await s.embed(["a"], dimensions=64, **asked)).vectors[0]) == 8


def _lm_studio(request: httpx.Request) -> httpx.Response:
    """LM Studio's /v1/embeddings reports 0 tokens for every request
    (lmstudio-ai/lmstudio-bug-tracker#1546)."""
    return _embeddings([[0.5] * 8] * len(json.loads(request.content)["input"]), "nomic", 0)


async def test_a_usage_of_zero_tokens_for_inputs_is_no_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: believed, 0 settled nothing in the source's TPM window (its ``tpm`` never
    bound) and charged a gateway key nothing.  Inputs are never empty, so 0 is no
    count: the estimate stands, as for a usage not reported."""
    router = Router({"lms": httpx.MockTransport(_lm_studio)})
    async with polygate.session(_settings("lms", tpm=100_000), transport=router) as s:
        r = await s.embed(["x" * 400] * 5)
    assert r.usage.source == "estimated" and r.usage.prompt_tokens > 0


async def test_an_answer_over_the_body_cap_is_not_asked_for_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An embeddings answer's size is its batch's (inputs x dimensions), the same from
    every source.  Review: over ``max_body_bytes`` it was transient, so the batch was
    computed (and billed) ``max_attempts`` times, each a breaker failure of a healthy
    source.  It is the request's error, said with what to change.  (Scaled down: a
    256 KiB cap, 64 inputs of 512 dimensions.)"""
    up = FakeUpstream(Reply(), embedding_dim=512)
    settings = polygate.Settings(
        max_body_bytes=256 * 1024,
        scopes={"embed": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1")], embed_batch_size=64)})
    async with polygate.session(settings, transport=Router({"a": up})) as s:
        with pytest.raises(polygate.FatalUpstreamError, match="lower embed_batch_size"):
            await s.embed([f"chunk {i}" for i in range(64)])
        state = (await s.statistics()).governance.sources[0].state
    assert len(up.requests) == 1 and state.consecutive_failures == 0
    # It was computed and answered (and may be billed): its estimate stands in the
    # source's TPM window, not the nothing of a refusal (review of the fix).
    assert state.tokens_in_window > 0


def _bloated(request: httpx.Request) -> httpx.Response:
    """A 200 whose body runs past any answer to its request (a proxy's runaway page)."""
    return httpx.Response(200, content=b"{" + b" " * (2 * 1024 * 1024),
                          headers={"content-type": "application/json"})


def _healthy(request: httpx.Request) -> httpx.Response:
    return _embeddings([[0.5] * 8] * len(json.loads(request.content)["input"]), "m", 1)


async def test_a_body_larger_than_any_answer_to_its_batch_is_the_sources_fault(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review of the fix above: a source that sends more than one input's answer could
    ever be (8,192 dimensions at most) is broken, not asked too much: transient, and
    the call fails over to a healthy source."""
    settings = polygate.Settings(
        max_body_bytes=1024 * 1024,
        scopes={"embed": polygate.Scope(sources=[
            # The broken source first for certain (a weight of 100 against 1 put the
            # healthy one first once in ~100 runs, and CI caught it).
            polygate.Source(name="broken", base_url="http://broken/v1"),
            polygate.Source(name="ok", base_url="http://ok/v1", weight=1e-9)])})
    router = Router({"broken": httpx.MockTransport(_bloated), "ok": httpx.MockTransport(_healthy)})
    async with polygate.session(settings, transport=router) as s:
        r = await s.embed(["hello"])
    assert r.source == "ok" and r.call_stats.attempts == 2


def _floats_only(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    return _embeddings([[0.5] * body["dimensions"]] * len(body["input"]), "m", 1)


async def test_a_source_that_ignores_a_binary_encoding_is_named_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Review: the refusal named a ``dimensions=8`` nobody asked for."""
    router = Router({"f": httpx.MockTransport(_floats_only)})
    async with polygate.session(_settings("f"), transport=router) as s:
        with pytest.raises(polygate.FatalUpstreamError) as failed:
            await s.embed(["a"], dimensions=64, encoding_format="binary")
    assert str(failed.value).endswith(
        "64 numbers to dimensions=64 packed as binary: it does not honour the binary "
        "encoding asked for")
