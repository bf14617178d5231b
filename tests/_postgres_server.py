"""A throwaway PostgreSQL server for tests: ``initdb`` into a temporary folder, a free
port on 127.0.0.1, password authentication, stopped and removed in ``finally``.

PostgreSQL refuses to run as root; CI runs as root, so then the server runs as an
unprivileged user (``pgtest``, created with ``useradd`` when missing; the distribution's
``postgres`` user as a fallback), through ``subprocess``'s ``user=``/``group=``.

Without the binaries (or psycopg) the tests skip with the reason — unless
``POLYGATE_CI=1``, where a missing service is a failure, not a skip.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest

__all__ = ["PgServer", "postgres_server", "require_postgres"]

_TOOLS = ("initdb", "pg_ctl", "postgres")


def _bin_dir() -> Path | None:
    candidates: list[Path] = []
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(os.path.realpath(found)).parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    candidates += [Path(p) for p in sorted(glob.glob("/usr/pgsql-*/bin"), reverse=True)]
    for folder in candidates:
        if all((folder / tool).exists() for tool in _TOOLS):
            return folder
    return None


def require_postgres() -> Path:
    """The folder of the PostgreSQL binaries; skip (fail under ``POLYGATE_CI=1``)
    when they or psycopg are missing."""
    problem = None
    bin_dir = _bin_dir()
    if bin_dir is None:
        problem = "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found"
    else:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            problem = "psycopg is not installed (pip install '.[postgres]')"
    if problem is not None:
        if os.environ.get("POLYGATE_CI") == "1":
            pytest.fail(f"POLYGATE_CI=1 and {problem}")
        pytest.skip(problem)
    assert bin_dir is not None
    return bin_dir


@attrs.frozen
class PgServer:
    host: str
    port: int
    user: str
    password: str = attrs.field(repr=False)
    data: Path

    def url(self, database: str = "postgres", *, password: str | None = None) -> str:
        pw = self.password if password is None else password
        return f"postgresql://{self.user}:{pw}@{self.host}:{self.port}/{database}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_as() -> dict[str, Any]:
    """``subprocess`` keywords that drop root to an unprivileged user (none when not root)."""
    if os.geteuid() != 0:
        return {}
    for name in ("pgtest", "postgres"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            if name == "pgtest" and shutil.which("useradd"):
                subprocess.run(
                    ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                    check=False, capture_output=True,
                )
                try:
                    entry = pwd.getpwnam(name)
                except KeyError:
                    continue
            else:
                continue
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    pytest.fail("running as root and no unprivileged user (pgtest/postgres) to run PostgreSQL")


@contextmanager
def postgres_server(password: str, *, user: str = "polygate") -> Iterator[PgServer]:
    bin_dir = require_postgres()
    root = Path(tempfile.mkdtemp(prefix="polygate-pg-"))
    data = root / "data"
    log = root / "server.log"
    run_as = _run_as()
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "HOME": str(root)}
    try:
        try:
            port = _start(bin_dir, root, data, log, password, user, env, run_as)
        except subprocess.CalledProcessError as exc:
            detail = (exc.stderr or b"").decode(errors="replace")[-2000:]
            if log.exists():
                detail += "\n" + log.read_text(errors="replace")[-2000:]
            pytest.fail(f"could not start PostgreSQL: {exc}\n{detail}")
        try:
            yield PgServer("127.0.0.1", port, user, password, data)
        finally:
            subprocess.run(
                [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                check=False, capture_output=True, cwd=root, env=env, **run_as,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _start(
    bin_dir: Path, root: Path, data: Path, log: Path, password: str, user: str,
    env: dict[str, str], run_as: dict[str, Any],
) -> int:
    (root / "pw").write_text(password + "\n")
    if run_as:
        for path in (root, root / "pw"):
            os.chown(path, run_as["user"], run_as["group"])
    subprocess.run(
        [str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--pwfile", str(root / "pw"),
         "--auth=scram-sha-256", "-E", "UTF8", "--no-sync", "--no-instructions"],
        check=True, capture_output=True, cwd=root, env=env, **run_as,
    )
    port = _free_port()
    options = (
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off"
    )
    subprocess.run(
        [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60",
         "-o", options, "start"],
        check=True, capture_output=True, cwd=root, env=env, **run_as,
    )
    return port
