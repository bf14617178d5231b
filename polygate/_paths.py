"""Where polygate keeps per-user files (the default telemetry and cache databases)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ._errors import ConfigError

__all__ = ["file_path_problem", "state_dir"]


def state_dir(env: Mapping[str, str] | None = None, platform: str = sys.platform) -> Path:
    """Where per-user state lives: ``$XDG_STATE_HOME`` (``~/.local/state``) on Linux,
    ``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows; a
    ``polygate`` folder inside it.  (A few lines instead of a dependency.)"""
    env = os.environ if env is None else env
    if platform == "win32":
        local = env.get("LOCALAPPDATA")
        base = Path(local) if local else _home(env) / "AppData" / "Local"
    elif platform == "darwin":
        base = _home(env) / "Library" / "Application Support"
    else:
        xdg = env.get("XDG_STATE_HOME")
        base = Path(xdg) if xdg and os.path.isabs(xdg) else _home(env) / ".local" / "state"
    return base / "polygate"


def _home(env: Mapping[str, str]) -> Path:
    """``$HOME``, else the user's entry in the password database.  Not ``Path.home()``:
    a HOME set but empty made it the file system's root (``/.local/state``), and a
    user with no entry (a container run as an unnamed uid) a RuntimeError."""
    home = env.get("HOME")
    if not home:
        try:
            import pwd

            home = pwd.getpwuid(os.getuid()).pw_dir
        except (ImportError, KeyError):  # (Windows; a uid with no entry)
            home = env.get("USERPROFILE")
    if not home:
        raise ConfigError(
            "this user has no home directory for polygate's default state folder "
            "(the default telemetry and cache files): set HOME or XDG_STATE_HOME, or "
            "give the file's path"
        )
    return Path(home)


def unencoded_problem(url: str, *, options: bool) -> str | None:
    """Why a ``sqlite:`` URL would name another file than the one written, or None: a
    ``#`` starts its fragment (``run#1.db`` read as ``run``), and so does a ``?`` its
    query where the URL takes no ``options`` (telemetry's)."""
    if "#" in url:
        return "an unencoded '#' in a SQLite URL ends its path there: write it %23"
    if "?" in url and not options:
        return ("an unencoded '?' in a telemetry SQLite URL ends its path there (it takes "
                "no options): write it %3F")
    return None


def sqlite_url(path: str) -> str:
    """The ``sqlite://`` URL of a file's path: its ``%``, ``?`` and ``#`` quoted (a
    name, not a URL's parts), the rest as it is."""
    return "sqlite://" + path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def file_path_problem(path: str) -> str | None:
    """Why ``path`` (a ``sqlite:`` URL's, percent-decoded) can name no file, or None.
    Checked with the settings: the operating system refuses it only when the file is
    opened, and then with a bare ``ValueError`` ("embedded null byte") or a
    ``UnicodeEncodeError`` instead of a ``ConfigError``."""
    if "\0" in path:
        return "a file's path cannot hold a NUL character (%00)"
    try:
        os.fsencode(path)
    except UnicodeError:
        return "the file's path holds a character this file system cannot name (a lone surrogate)"
    return None
