"""Structured output: what it costs to import and to validate, side by side.

* **import**: ``python -c "import polygate"`` against the same plus ``from pydantic
  import BaseModel``, ``import jsonschema`` or ``import fastjsonschema``; fresh
  subprocesses, interleaved, median of N — shows why pydantic and jsonschema are an
  extra (``polygate[structured]``) that polygate itself never imports;
* **validation of one 10-field answer**: polygate's check for a pydantic model (fence
  check + ``model_validate_json`` + error mapping) against ``model_validate_json``
  alone; for a JSON Schema dict, polygate's (jsonschema, compiled once) against
  fastjsonschema and against ``json.loads`` alone; valid and invalid answers;
* **a whole call**: ``chat()`` against ``chat(schema=Model)`` through the fake
  transport in-process (no network), alternating blocks: the per-call cost of asking
  for and validating structured output.

    python benchmarks/structured.py            # full counts
    python benchmarks/structured.py --quick    # tiny counts, seconds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import timeit
from typing import Any

import pydantic
import trio

import polygate
from polygate._structured import Invalid, schema_of
from polygate.testing import FakeUpstream, Reply

from _common import machine, median, write_result

try:  # in the bench extra; the CI smoke (test extra only) runs without it
    import fastjsonschema
except ImportError:  # pragma: no cover
    fastjsonschema = None


class TenFields(pydantic.BaseModel):
    name: str
    age: int
    height_m: float
    member: bool
    tags: list[str]
    city: str
    visits: int
    score: float
    ids: list[int]
    note: str


VALID = json.dumps({
    "name": "Ada", "age": 36, "height_m": 1.65, "member": True, "tags": ["math", "engines"],
    "city": "London", "visits": 12, "score": 9.5, "ids": [1, 2, 3], "note": "first programmer",
})
INVALID = json.dumps({
    "name": "Ada", "age": "thirty-six", "height_m": 1.65, "member": True, "tags": ["math"],
    "city": "London", "visits": 12, "score": "high", "ids": [1, "two"], "note": "x",
})
DICT_SCHEMA: dict[str, Any] = json.loads(json.dumps(TenFields.model_json_schema()))

IMPORTS = {
    "polygate": "import polygate",
    "polygate + pydantic": "import polygate; from pydantic import BaseModel",
    "polygate + jsonschema": "import polygate, jsonschema",
}
if fastjsonschema is not None:
    IMPORTS["polygate + fastjsonschema"] = "import polygate, fastjsonschema"


def import_costs(repeats: int) -> dict[str, float]:
    """Median wall milliseconds of a fresh interpreter running each import line."""
    times: dict[str, list[float]] = {k: [] for k in IMPORTS}
    base = [sys.executable, "-c", "pass"]
    bare: list[float] = []
    for _ in range(repeats):  # interleaved: machine noise hits every line alike
        t0 = time.perf_counter()
        subprocess.run(base, check=True)
        bare.append(time.perf_counter() - t0)
        for name, code in IMPORTS.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times[name].append(time.perf_counter() - t0)
    floor = median(bare)
    return {name: (median(t) - floor) * 1000 for name, t in times.items()}


def per_call_us(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def _raises(fn: Any) -> Any:
    expected: tuple[type[Exception], ...] = (Invalid, pydantic.ValidationError)
    if fastjsonschema is not None:
        expected += (fastjsonschema.JsonSchemaValueException,)

    def call() -> None:
        try:
            fn()
        except expected:
            pass
    return call


def validation_costs(number: int) -> dict[str, float]:
    model = schema_of(TenFields)
    dict_schema = schema_of(DICT_SCHEMA)
    model.validate(VALID)
    dict_schema.validate(VALID)
    costs = {
        "pydantic: model_validate_json alone": per_call_us(
            lambda: TenFields.model_validate_json(VALID), number),
        "pydantic: polygate": per_call_us(lambda: model.validate(VALID), number),
        "pydantic: polygate, invalid answer": per_call_us(
            _raises(lambda: model.validate(INVALID)), number),
        "dict: json.loads alone": per_call_us(lambda: json.loads(VALID), number),
        "dict: polygate (jsonschema)": per_call_us(lambda: dict_schema.validate(VALID), number),
        "dict: polygate (jsonschema), invalid answer": per_call_us(
            _raises(lambda: dict_schema.validate(INVALID)), number),
    }
    if fastjsonschema is not None:
        fast = fastjsonschema.compile(DICT_SCHEMA)
        costs["dict: fastjsonschema"] = per_call_us(lambda: fast(json.loads(VALID)), number)
        costs["dict: fastjsonschema, invalid answer"] = per_call_us(
            _raises(lambda: fast(json.loads(INVALID))), number)
    return costs


async def call_costs(calls: int, blocks: int) -> dict[str, float]:
    up = FakeUpstream(Reply(text=VALID))
    settings = polygate.Settings(scopes={"chat": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")])})
    messages = [{"role": "user", "content": "Describe Ada."}]
    times: dict[str, list[float]] = {"chat()": [], "chat(schema=TenFields)": []}
    async with polygate.session(settings, transport=up.transport()) as s:
        async def plain() -> None:
            await s.chat(messages)

        async def structured() -> None:
            r = await s.chat(messages, schema=TenFields)
            assert r.parsed is not None

        for _ in range(blocks):
            for name, call in (("chat()", plain), ("chat(schema=TenFields)", structured)):
                t0 = time.perf_counter()
                for _ in range(calls):
                    await call()
                times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny counts (CI smoke)")
    args = parser.parse_args()
    imports = import_costs(1 if args.quick else 15)
    validation = validation_costs(200 if args.quick else 20_000)
    calls = trio.run(call_costs, 20 if args.quick else 300, 2 if args.quick else 7)

    print("import (ms over a bare interpreter, median):")
    for name, ms in imports.items():
        print(f"  {name:28s} {ms:8.1f} ms   ×{ms / imports['polygate']:.2f} of polygate alone")
    print("validation of one 10-field answer (µs, best of 5):")
    for name, us in validation.items():
        print(f"  {name:45s} {us:8.1f} µs")
    v = validation
    ratio = v["pydantic: polygate"] / v["pydantic: model_validate_json alone"]
    print(f"  polygate / model_validate_json: ×{ratio:.2f}; "
          f"target ≤ 50 µs for the model: {'met' if v['pydantic: polygate'] <= 50 else 'MISSED'}")
    if "dict: fastjsonschema" in v:
        print(f"  jsonschema / fastjsonschema: "
              f"×{v['dict: polygate (jsonschema)'] / v['dict: fastjsonschema']:.1f}")
    print("a whole call through the in-process fake (µs per call, median of blocks):")
    for name, us in calls.items():
        print(f"  {name:28s} {us:8.1f} µs")
    print(f"  structured / plain: ×{calls['chat(schema=TenFields)'] / calls['chat()']:.2f}")
    # (A smoke run, nox's, keeps the full run's figures as they were.)
    write_result("structured-quick" if args.quick else "structured", {
        "machine": machine(), "quick": args.quick, "import_ms": imports,
        "validation_us": validation, "call_us": calls,
    })


if __name__ == "__main__":
    main()
