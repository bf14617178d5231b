"""What only Python's cyclic collector would free (see test_gc_cycles, test_memory)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def collector_off() -> Iterator[list[Any]]:
    """The objects made in the block that only the cyclic collector would have freed
    (filled when the block ends): the collector is off meanwhile, and what a collection
    then finds is kept for the test to look at (``gc.DEBUG_SAVEALL``)."""
    gc.collect()
    found: list[Any] = []
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found += gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
