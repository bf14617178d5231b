"""`polygate demo`: the incident replay runs, in seconds, and hedging shows its effect."""

from __future__ import annotations

import re

import pytest

from polygate.cli import main


def test_demo_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--calls", "60", "--concurrency", "10"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "no hedging" in line and "hedge after" in line)
    assert "deadline 30 s" in header
    p99 = next(line for line in out.splitlines() if line.startswith("p99 latency"))
    values = [float(v) for v in re.findall(r"([\d.]+)s", p99)]
    assert len(values) == 3
    no_hedge, deadline, hedged = values
    assert deadline <= 30.0
    assert hedged < no_hedge  # the hung calls were rescued by a hedge
    failed = next(line for line in out.splitlines() if line.startswith("calls failed")).split()[-3:]
    assert failed[0] == "0" and failed[2] == "0"  # no hedging and hedging lose nothing


def test_demo_rejects_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--calls", "0"]) == 2
    assert "polygate demo: --calls and --concurrency must be > 0" in capsys.readouterr().err
