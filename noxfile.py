"""Sessions: ``tests-3.10`` … ``tests-3.13``, ``floors``, ``lint``, ``typecheck``, ``bench``.

pyenv's shims fail for the non-default Pythons here, so their ``bin`` folders are put
on PATH directly, and uv (when nox uses it) is told never to download a Python.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


def _put_pyenv_pythons_on_path() -> None:
    root = os.environ.get("PYENV_ROOT")
    if root is None and shutil.which("pyenv"):
        root = subprocess.run(
            ["pyenv", "root"], capture_output=True, text=True, check=False
        ).stdout.strip()
    if not root:
        return
    dirs = [d for v in PYTHONS for d in sorted(glob.glob(f"{root}/versions/{v}*/bin"))]
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")


_put_pyenv_pythons_on_path()
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "typecheck", "tests", "floors"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test,redis,postgres]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python="3.11")
def floors(session: nox.Session) -> None:
    """The tests at the lowest core dependencies pyproject.toml allows (.ci/floors.txt)."""
    session.install("-c", ".ci/floors.txt", "-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("-e", ".", "ruff", "import-linter")
    session.run("ruff", "check", "polygate", "tests", "benchmarks", "noxfile.py")
    session.run("lint-imports")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    # mypy checks the 3.10 branches too (python_version = 3.10): their backports.
    session.install("-e", ".[test]", "mypy", "exceptiongroup", "tomli")
    session.run("mypy")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The benchmarks in quick mode (tiny counts); results go to benchmarks/results/.
    The ``bench`` extra brings the peers that ``peers.py`` measures (openai, litellm)."""
    session.install("-e", ".[bench,serve]")
    for script in ("overhead.py", "tail_replay.py", "peers.py", "scale.py", "structured.py", "ocr.py",
                   "cache.py", "sse_hostile.py", "serve.py", "aio.py", "instructions.py",
                   "large_request.py", "gc_pauses.py"):
        session.run("python", f"benchmarks/{script}", "--quick", *session.posargs)
