"""The SSE decoder and the chat assembler on normal streams and on hostile shapes,
this tree against an older revision, side by side in one run.

Normal shapes (µs per event, what every token pays): the recorded transcripts and a
200-chunk stream, cut in 4 KiB pieces and one event per piece (a streaming socket's
usual read).  Hostile shapes: one event made of many ``data:`` lines arriving a line
at a time (quadratic before: 4x the bytes cost 16x), and streams that open a new
``choices[].index`` or ``tool_calls[].index`` in every entry (the assembler held
25-60x the body).  Growth is reported as the cost ratio for 4x the bytes.

    python benchmarks/sse_hostile.py                 # against 6b71105 (before issue 16)
    python benchmarks/sse_hostile.py --against HEAD~3
    python benchmarks/sse_hostile.py --quick         # CI smoke: tiny sizes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

from polygate.transport import _assemble as new_assemble
from polygate.transport import _sse as new_sse

from _common import machine, write_result

ROOT = Path(__file__).resolve().parent.parent
TRANSCRIPTS = ROOT / "tests" / "transcripts"
CHUNK = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":'
         b'[{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":null}]}\n\n')
MiB = 1024 * 1024


def load(revision: str, name: str) -> types.ModuleType:
    """``polygate/transport/<name>.py`` as it was at ``revision`` (imports made absolute)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:polygate/transport/{name}.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.replace("from .._errors", "from polygate._errors")
    module = types.ModuleType(f"old{name}")
    exec(compile(source, f"{revision}:{name}.py", "exec"), module.__dict__)
    return module


def cut(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


def per_event(body: bytes) -> list[bytes]:
    """One event a piece, each with its own line ends (LF or CRLF)."""
    end = b"\r\n\r\n" if b"\r\n\r\n" in body else b"\n\n"
    return [e + end for e in body.split(end) if e]


def decode_all(sse: types.ModuleType, bodies: list[list[bytes]]) -> int:
    events = 0
    for parts in bodies:
        decoder = sse.SSEDecoder(max_body=1 << 30, max_line=1 << 30, source="b")
        for part in parts:
            for _ in decoder.feed(part):
                events += 1
        for _ in decoder.flush():
            events += 1
    return events


def best_us_per_event(sse: types.ModuleType, bodies: list[list[bytes]], rounds: int) -> float:
    """CPU time of this process (``process_time``): on a shared machine other
    processes' load moves it far less than wall time."""
    events = decode_all(sse, bodies)
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        decode_all(sse, bodies)
        best = min(best, time.process_time() - start)
    return best / events * 1e6


def many_lines(sse: types.ModuleType, total: int) -> float:
    """Seconds for one event of ``total`` bytes of 1 KiB ``data:`` lines, a line a piece."""
    line = b"data: " + b"x" * 1017 + b"\n"
    decoder = sse.SSEDecoder(max_body=1 << 30, max_line=1 << 30, source="b")
    start = time.perf_counter()
    for _ in range(total // len(line)):
        for _ in decoder.feed(line):
            pass
    return time.perf_counter() - start


def index_flood(asm: types.ModuleType, total: int, shape: str) -> tuple[float, float, str]:
    """(seconds, peak MiB, outcome) for ``total`` bytes of chunks opening new indexes."""
    chunks: list[dict[str, Any]] = []
    size = 0
    i = 0
    while size < total:
        if shape == "empty choices":
            chunk = {"choices": [{"index": i * 100 + j} for j in range(100)]}
        elif shape == "choices":
            chunk = {"choices": [{"index": i * 100 + j, "delta": {"content": "x"}} for j in range(100)]}
        else:
            chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i * 100 + j, "function": {"name": "f"}} for j in range(100)]}}]}
        size += len(json.dumps(chunk)) + 8
        chunks.append(chunk)
        i += 1
    tracemalloc.start()
    start = time.perf_counter()
    outcome = "ok"
    try:
        assembler = asm.ChatAssembler()
        for chunk in chunks:
            assembler.add(chunk)
        assembler.build()
    except Exception as exc:
        outcome = type(exc).__name__
    took = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return took, peak / MiB, outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", default="6b71105", help="the revision to compare with")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    args = parser.parse_args()
    old = {"sse": load(args.against, "_sse"), "asm": load(args.against, "_assemble")}
    new = {"sse": new_sse, "asm": new_assemble}
    rounds = 3 if args.quick else 10
    result: dict[str, Any] = {"machine": machine(), "against": args.against}

    corpus = [p.read_bytes() for p in sorted(TRANSCRIPTS.glob("*.sse"))]
    synthetic = CHUNK * 200 + b"data: [DONE]\n\n"
    normal: dict[str, list[list[bytes]]] = {
        "transcripts, 4 KiB pieces": [cut(b, 4096) for b in corpus],
        "transcripts, an event a piece": [per_event(b) for b in corpus],
        "200-chunk stream, 4 KiB pieces": [cut(synthetic, 4096)],
        "200-chunk stream, an event a piece": [per_event(synthetic)],
    }
    print("normal streams (µs of CPU per event, best of 10 interleaved runs)")
    print(f"{'':<38}{args.against:>10}{'this tree':>11}{'new/old':>9}")
    for label, bodies in normal.items():
        # Interleaved, best of each: a busy machine slows both alike.
        a = b = float("inf")
        for _ in range(2 if args.quick else 10):
            a = min(a, best_us_per_event(old["sse"], bodies, rounds))
            b = min(b, best_us_per_event(new["sse"], bodies, rounds))
        result[label] = {"old_us": a, "new_us": b, "ratio": b / a}
        print(f"{label:<38}{a:>10.3f}{b:>11.3f}{b / a:>9.2f}")

    small, big = (64 * 1024, 256 * 1024) if args.quick else (MiB, 4 * MiB)
    old_small, old_big = (16 * 1024, 64 * 1024) if args.quick else (256 * 1024, MiB)
    print("\none event of many data: lines, a line a piece (seconds; growth for 4x the bytes)")
    o1, o4 = many_lines(old["sse"], old_small), many_lines(old["sse"], old_big)
    n1, n4 = many_lines(new["sse"], small), many_lines(new["sse"], big)
    result["many data: lines"] = {
        "old": {"bytes": [old_small, old_big], "s": [o1, o4], "growth": o4 / o1},
        "new": {"bytes": [small, big], "s": [n1, n4], "growth": n4 / n1},
        "speedup_at_old_big": (o4 / old_big) / (n4 / big),
    }
    print(f"{args.against:<12}{old_small // 1024:>6} KiB {o1:8.3f}s  {old_big // 1024:>6} KiB {o4:8.3f}s  growth {o4 / o1:5.1f}x")
    print(f"{'this tree':<12}{small // 1024:>6} KiB {n1:8.3f}s  {big // 1024:>6} KiB {n4:8.3f}s  growth {n4 / n1:5.1f}x")

    flood = 128 * 1024 if args.quick else MiB
    print(f"\nthe assembler on {flood // 1024} KiB of chunks opening new indexes (seconds, peak MiB)")
    for shape in ("empty choices", "choices", "tool calls"):
        rows = {}
        for label, mods in ((args.against, old), ("this tree", new)):
            took, peak, outcome = index_flood(mods["asm"], flood, shape)
            rows[label] = {"s": took, "peak_mib": peak, "outcome": outcome}
            print(f"{shape:<16}{label:<12}{took:8.3f}s {peak:8.1f} MiB  {outcome}")
        result[f"index flood, {shape}"] = rows
    json.dumps(result)
    if not args.quick:
        print(f"\nresults: {write_result('sse_hostile', result)}")


if __name__ == "__main__":
    sys.exit(main())
