from __future__ import annotations

from pathlib import Path
from typing import Any

import polygate

ROOT = Path(__file__).resolve().parent.parent
# A byte-exact copy of ../shared/transcripts (provenance in its INDEX.md).
TRANSCRIPTS = ROOT / "tests" / "transcripts"

SECRET = "sk-test-SECRET-0123456789abcdef"


def one_source_settings(**scope: Any) -> polygate.Settings:
    return polygate.Settings(
        scopes={
            "chat": polygate.Scope(
                sources=[polygate.Source(name="a", base_url="http://a/v1", api_key=SECRET)],
                **scope,
            )
        }
    )
