"""Coverage-guided fuzzing of everything an upstream's bytes go through: the SSE
decoder, the JSON depth check and decoding, the chat assembler, and the error-body
path (excerpt -> message -> classified error).  Not run in CI (the hypothesis suite
in tests/test_fuzz.py is); for long local runs::

    pip install atheris
    python fuzz/atheris_wire.py -max_total_time=600          # ten minutes
    python fuzz/atheris_wire.py fuzz/corpus -max_len=4096    # keep a corpus

Checked on every input:

* only typed errors (``TransientUpstreamError``) come out;
* the same events, or the same refusal, however the body is cut into pieces;
* no message ever holds the key (raw, or escaped as repr, bytes repr or JSON).

A crash prints the input; ``python fuzz/atheris_wire.py crash-<hash>`` replays it.
"""

from __future__ import annotations

import json
import sys

import atheris

with atheris.instrument_imports(include=["polygate"]):
    import polygate
    from polygate.transport import ChatAssembler, Endpoint
    from polygate.transport._exchange import _error_event
    from polygate.transport._sse import SSEDecoder
    from polygate.transport._wire import _error_detail, check_depth

KEY = "sk-atheris-SECRET-0c2e4a6b"
ENDPOINT = Endpoint("a", "http://h/v1", KEY)
SPELLINGS = (KEY, repr(KEY)[1:-1], repr(KEY.encode())[2:-1], json.dumps(KEY)[1:-1])


def decode(pieces: list[bytes], max_line: int) -> list[tuple[str, bytes]] | None:
    decoder = SSEDecoder(max_body=1 << 20, max_line=max_line, source="a")
    try:
        events = [(e.event, e.data) for p in pieces for e in decoder.feed(p)]
        return events + [(e.event, e.data) for e in decoder.flush()]
    except polygate.TransientUpstreamError:
        return None


def assemble(events: list[tuple[str, bytes]]) -> None:
    assembler = ChatAssembler(max_choices=8, max_tool_calls=8, source="a")
    for name, data in events:
        if name == "error":
            assert not any(s in str(_error_event(data.decode("utf-8", "replace"), ENDPOINT)) for s in SPELLINGS)
            continue
        try:
            check_depth(data, 64, "a")
            chunk = json.loads(data)
        except (ValueError, polygate.TransientUpstreamError):
            continue
        if isinstance(chunk, dict):
            try:
                assembler.add(chunk)
            except polygate.TransientUpstreamError:
                return
    json.dumps(assembler.build(), default=str)


def test_one_input(raw: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(raw)
    max_line = fdp.ConsumeIntInRange(1, 512)
    cuts = sorted({fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 8))})
    insert_key = fdp.ConsumeBool()
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    if insert_key and body:
        at = cuts[0] % len(body) if cuts else 0
        body = body[:at] + KEY.encode() + body[at:]
    whole = decode([body], max_line)
    points = sorted({c % (len(body) + 1) for c in cuts})
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    assert decode(pieces, max_line) == whole, "chunking changed the events"
    if whole is not None:
        assemble(whole)
    for cut in (False, True):
        detail = _error_detail(body[:4096], cut, ENDPOINT.secrets)
        assert not any(s in detail for s in SPELLINGS), detail


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
