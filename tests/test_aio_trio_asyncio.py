"""trio-asyncio, both ways: the recipe in docs/asyncio.md (a trio application calling
an asyncio-only library, cancellation crossing both ways) and polygate.aio used from
asyncio code on trio-asyncio's loop.  The scenarios are in ``_aio_trio_asyncio.py``;
each runs in a fresh interpreter, since importing trio_asyncio changes what
``asyncio.new_event_loop()`` returns for the rest of the process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.integration

SCENARIOS = [
    "trio_application_calls_an_asyncio_only_library",
    "trio_cancellation_reaches_the_asyncio_library",
    "polygate_aio_on_trio_asyncios_loop",
    "trio_cancels_asyncio_code_waiting_on_polygate_aio",
    "a_trio_session_awaited_from_asyncio_code_is_refused",
]


@pytest.mark.parametrize("name", SCENARIOS)
def test_trio_asyncio(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", "tests._aio_trio_asyncio", name],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_every_scenario_is_run() -> None:
    source = (ROOT / "tests" / "_aio_trio_asyncio.py").read_text()
    assert sorted(SCENARIOS) == sorted(
        line.split("scenario_", 1)[1].split("(", 1)[0]
        for line in source.splitlines() if line.startswith("async def scenario_"))
