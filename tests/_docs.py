"""Every code block of README.md and docs/*.md runs as a test (Sybil).

The root ``conftest.py`` hands :func:`sybil` to pytest, so ``python -m pytest`` (whose
``testpaths`` name ``docs`` and ``README.md``) collects each page as a module and each
block as a test, in page order, sharing one namespace per page.  What a block is
decides what happens to it:

``python``
    executed in-process; its standard output is kept for the block after it.
``output``
    must equal what the ``python`` block just before it printed.  ``...`` on a line
    matches any text; a line holding only ``...`` matches any number of lines.
``console``
    each ``$ command`` line runs in ``bash`` in the page's scratch folder, and the
    lines after it must match what it printed (stdout and stderr, as a terminal
    shows them).  A command ending in ``&`` keeps running in the background (a fake
    upstream) until the page is done; only the lines shown under it are read.
    Numbers, durations (``364 ms`` / ``1.20 s``), call ids and runs of spaces may
    differ, since real clocks run there — unless the block is preceded by
    ``<!-- docs: exact -->``.
any block with ``title="NAME"``
    written to the file ``NAME`` in the page's scratch folder (``polygate.toml``,
    ``app.py``), for the console blocks that follow; not executed.
anything else (``sh``, ``toml``, ``text``, ``sql`` …)
    shown, not run: use these for commands that need a network or a real key.

``<!-- docs: timeout=N -->`` before a block gives its test ``N`` seconds instead of
pytest's default.

Fixed ports in a page (``--port 8001``, ``http://127.0.0.1:8001/v1``) are what a
reader types; the test maps each to a free port chosen by the OS, in commands and
files, and maps it back in the output it compares, so pages can run side by side.

``POLYGATE_DOCS_UPDATE=1 python -m pytest docs README.md`` rewrites every
``output`` and ``console`` sample that no longer matches with what the real run
printed, instead of failing: sample output is regenerated, never typed by hand.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

__all__ = ["DocState", "matches", "sybil"]

UPDATE = os.environ.get("POLYGATE_DOCS_UPDATE") == "1"
_INFO = re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE)
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')
_DIRECTIVE = re.compile(r"<!--\s*docs:\s*(?P<options>[^>]*?)\s*-->\s*\Z")
_PORT_IN_TEXT = re.compile(r"(?<=127\.0\.0\.1:)(\d{4,5})\b|(?<=localhost:)(\d{4,5})\b|(?<=--port )(\d{4,5})\b")
_BACKGROUND_WAIT_S = 30.0


# --------------------------------------------------------------------------- matching


def _line_pattern(line: str, tolerant: bool) -> str:
    parts = line.split("...")
    out = []
    for part in parts:
        if tolerant:
            out.append(_tolerant(part))
        else:
            out.append(re.escape(part))
    return ".*?".join(out)


_VOLATILE = re.compile(
    r"(?P<id>[0-9a-f]{16}-[0-9a-f]{8}(?:\.\d+)?)"
    r"|(?P<num>\d[\d,]*(?:\.\d+)?(?: ?(?:ms|s|µs)\b)?)"
    r"|(?P<space> {2,})"
)


def _tolerant(text: str) -> str:
    out = []
    pos = 0
    for m in _VOLATILE.finditer(text):
        out.append(re.escape(text[pos : m.start()]))
        if m.group("id"):
            out.append(r"[0-9a-f]{16}-[0-9a-f]{8}(?:\.\d+)?")
        elif m.group("num"):
            out.append(r"\d[\d,]*(?:\.\d+)?(?: ?(?:ms|s|µs)\b)?")
        else:
            out.append(r" +")
        pos = m.end()
    out.append(re.escape(text[pos:]))
    # a number may change width and take or give up the spaces of its column
    return "".join(out).replace(r"\ ", " ").replace("  ", " +")


def _normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def matches(expected: str, actual: str, *, tolerant: bool = False) -> bool:
    """Whether ``actual`` output fits the ``expected`` sample (see the module doc)."""
    pattern = []
    for line in _normalise(expected):
        if line.strip() == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(_line_pattern(line, tolerant) + r" *\n")
    text = "\n".join(_normalise(actual)) + "\n"
    if tolerant:
        text = re.sub(r"[ \t]+\n", "\n", text)
    return re.fullmatch("".join(pattern), text, re.DOTALL) is not None


# --------------------------------------------------------------------------- page state


@attrs.define
class DocState:
    """What the blocks of one page share: its scratch folder, background processes,
    port map, environment, the last python output, and pending sample rewrites."""

    path: Path
    workdir: Path
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]] = attrs.field(factory=list)
    ports: dict[str, str] = attrs.field(factory=dict)
    last_output: str | None = None
    updates: list[tuple[int, int, str]] = attrs.field(factory=list)

    def map_ports(self, text: str) -> str:
        def free(match: re.Match[str]) -> str:
            wanted = match.group(0)
            if wanted not in self.ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    self.ports[wanted] = str(s.getsockname()[1])
            return self.ports[wanted]

        return _PORT_IN_TEXT.sub(free, text)

    def unmap_ports(self, text: str) -> str:
        """Output as the reader would see it: their ports, ``~`` for the home folder."""
        text = text.replace(str(self.workdir), "~")
        for wanted, real in self.ports.items():
            text = re.sub(rf"(?<=[:\s]){real}\b", wanted, text)
        return text

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.processes.clear()
        if UPDATE and self.updates:
            text = self.path.read_text(encoding="utf-8")
            for start, end, new in sorted(self.updates, reverse=True):
                text = text[:start] + new + text[end:]
            self.path.write_text(text, encoding="utf-8")
        shutil.rmtree(self.workdir, ignore_errors=True)


def _state(example: Example) -> DocState:
    namespace = example.namespace
    state = namespace.get("_docs_state")
    if state is None:
        workdir = Path(tempfile.mkdtemp(prefix="polygate-docs-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATE")}
        env.pop("XDG_STATE_HOME", None)
        env.update(
            HOME=str(workdir),  # the default telemetry file lands in the scratch folder
            PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            COLUMNS="100",
        )
        env.pop("PYTHONWARNINGS", None)
        state = namespace["_docs_state"] = DocState(Path(example.path), workdir, env)
    return state


def _teardown(namespace: dict[str, Any]) -> None:
    state = namespace.get("_docs_state")
    if state is not None:
        state.close()


def _record(state: DocState, region: Region, expected: str, actual: str) -> None:
    """Queue a rewrite of a sample (update mode)."""
    start, end = region.lexemes["span"]
    new = actual if actual.endswith("\n") else actual + "\n"
    if expected != new:
        state.updates.append((start, end, new))


# --------------------------------------------------------------------------- evaluators


@contextlib.contextmanager
def _in(folder: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _run_python(example: Example) -> None:
    state = _state(example)
    source = "\n" * example.line + example.parsed
    code = compile(source, str(example.path), "exec", dont_inherit=True)
    example.namespace.setdefault("__name__", "__docs__")
    buffer = io.StringIO()
    with _in(state.workdir), contextlib.redirect_stdout(buffer):
        exec(code, example.namespace)
    state.last_output = buffer.getvalue()


def _check_output(example: Example) -> None:
    state = _state(example)
    actual = state.last_output
    if actual is None:
        raise AssertionError("an output block must follow a python block")
    state.last_output = None
    expected = example.parsed
    if matches(expected, actual):
        return
    if UPDATE:
        _record(state, example.region, expected, actual)
        return
    raise AssertionError(_diff(expected, actual))


def _write_file(example: Example) -> None:
    state = _state(example)
    name = example.region.lexemes["title"]
    target = state.workdir / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(state.map_ports(example.parsed), encoding="utf-8")


def _commands(block: str) -> Iterable[tuple[str, str, int, int]]:
    """(command, expected output, start, end of the expected text within ``block``)."""
    lines = block.splitlines(keepends=True)
    i = 0
    offset = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            raise AssertionError(f"console block: expected '$ command', got {line!r}")
        command = line[2:].rstrip("\n")
        offset += len(line)
        i += 1
        while command.endswith("\\") and i < len(lines):
            command = command[:-1] + lines[i].strip()
            offset += len(lines[i])
            i += 1
        start = offset
        out = []
        while i < len(lines) and not lines[i].startswith("$ "):
            out.append(lines[i])
            offset += len(lines[i])
            i += 1
        yield command, "".join(out), start, offset


def _run_console(example: Example) -> None:
    state = _state(example)
    region = example.region
    tolerant = "exact" not in region.lexemes["options"]
    block_start = region.lexemes["span"][0]
    failures = []
    for command, expected, start, end in _commands(example.parsed):
        if command.startswith("export "):
            for assignment in shlex.split(command[len("export "):]):
                key, _, value = assignment.partition("=")
                state.env[key] = state.map_ports(value)
            continue
        actual = _run_command(state, command, expected)
        if matches(expected, actual, tolerant=tolerant):
            continue
        if UPDATE:
            state.updates.append((block_start + start, block_start + end, actual))
        else:
            failures.append(f"$ {command}\n{_diff(expected, actual)}")
    if failures:
        raise AssertionError("\n\n".join(failures))


def _run_command(state: DocState, command: str, expected: str) -> str:
    real = state.map_ports(command)
    if real.rstrip().endswith("&"):
        proc = subprocess.Popen(
            ["bash", "-c", "exec " + real.rstrip().rstrip("&")],
            cwd=state.workdir, env=state.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Unbuffered: a buffered readline can take two lines off the pipe at once,
            # and select() then waits for a line that is already in the buffer.
            bufsize=0,
        )
        state.processes.append(proc)
        wanted = len(_normalise(expected))
        got = []
        assert proc.stdout is not None
        for _ in range(wanted):
            line = _readline(proc, _BACKGROUND_WAIT_S)
            if line is None:
                break
            got.append(line)
        return state.unmap_ports("".join(got))
    done = subprocess.run(
        ["bash", "-c", real], cwd=state.workdir, env=state.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=600, check=False,
    )
    return state.unmap_ports(done.stdout.decode("utf-8", "replace"))


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> str | None:
    """One line of a background process's output, or None when it gives none in time."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    line = proc.stdout.readline()
    return line.decode("utf-8", "replace") if line else None


def _diff(expected: str, actual: str) -> str:
    import difflib

    lines = difflib.unified_diff(
        _normalise(expected), _normalise(actual), "documented", "actual", lineterm=""
    )
    return "output differs from the page:\n" + "\n".join(lines)


# --------------------------------------------------------------------------- parser


class _Parser:
    """Turns each fenced block of a page into the example its kind calls for."""

    def __init__(self) -> None:
        self._lexer = RawFencedCodeBlockLexer(info_pattern=_INFO)

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self._lexer(document):
            info = region.lexemes["info"].strip()
            language = info.split(None, 1)[0] if info else ""
            title = _TITLE.search(info)
            before = _DIRECTIVE.search(document.text, 0, region.start)
            options = before.group("options").split() if before else []
            source = region.lexemes["source"]
            span = (region.start + source.offset, region.start + source.offset + len(source))
            lexemes = {"title": title.group("title") if title else None,
                       "options": options, "span": span}
            if "skip" in options:
                continue
            if title is not None:
                evaluator = _write_file
            elif language == "python":
                evaluator = _run_python
            elif language == "output":
                evaluator = _check_output
            elif language == "console":
                evaluator = _run_console
            else:
                continue
            timeout = next((o.split("=", 1)[1] for o in options if o.startswith("timeout=")), None)
            lexemes["timeout"] = float(timeout) if timeout else None
            yield Region(region.start, region.end, source, evaluator, lexemes)


def sybil() -> Sybil:
    """The Sybil that collects README.md and every page under docs/ (the root
    conftest.py hands it to pytest)."""
    return Sybil(
        parsers=[_Parser()],
        patterns=["README.md", "docs/*.md", "docs/*/*.md"],
        path=str(Path(__file__).resolve().parent.parent),
        teardown=_teardown,
    )
