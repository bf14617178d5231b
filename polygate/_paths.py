"""Where polygate keeps per-user files (the default telemetry and cache databases)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["state_dir"]


def state_dir(env: dict[str, str] | None = None, platform: str = sys.platform) -> Path:
    """Where per-user state lives: ``$XDG_STATE_HOME`` (``~/.local/state``) on Linux,
    ``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows; a
    ``polygate`` folder inside it.  (A few lines instead of a dependency.)"""
    env = dict(os.environ) if env is None else env
    home = Path(env.get("HOME") or Path.home())
    if platform == "win32":
        base = Path(env["LOCALAPPDATA"]) if env.get("LOCALAPPDATA") else home / "AppData" / "Local"
    elif platform == "darwin":
        base = home / "Library" / "Application Support"
    else:
        xdg = env.get("XDG_STATE_HOME")
        base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".local" / "state"
    return base / "polygate"
