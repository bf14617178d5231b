"""Findings of a review of the command line (docs/cli.md), each failing before its fix:
Ctrl-C in any command, the tail share's count, an empty key list shown as a secret,
and the name of a plot written without an extension."""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import polygate
import polygate.cli
from polygate.testing import FakeUpstream, Profile, Router

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


def _make_db(path: Path, calls: int) -> None:
    healthy = {"first_token_s": (0.5, 2.0), "inter_token_s": 1 / 40, "tokens": (10, 30)}
    url = f"sqlite://{path.absolute()}"

    async def main() -> None:
        settings = polygate.Settings(telemetry=url, scopes={"chat": polygate.Scope(
            sources=[polygate.Source(name="a", base_url="http://a/v1")])})
        router = Router({"a": FakeUpstream(Profile(hang_p=0.2, hang_s=(20, 40), **healthy), seed=3)})
        async with polygate.session(settings, transport=router, rng=random.Random(1)) as s:
            async with trio.open_nursery() as nursery:
                for _ in range(calls):
                    nursery.start_soon(s.chat, [{"role": "user", "content": "x"}])

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "polygate", *args], capture_output=True, text=True)


@pytest.mark.parametrize("raised", [
    KeyboardInterrupt(),
    BaseExceptionGroup("trio's nursery", [KeyboardInterrupt()]),
    BaseExceptionGroup("nested", [BaseExceptionGroup("inner", [KeyboardInterrupt()])]),
])
def test_ctrl_c_in_any_command_is_one_line_and_130(
    raised: BaseException, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in `polygate demo` (in trio's nursery, as a group) printed a traceback
    and exited 1; only chat and serve handled it."""
    from polygate.cli import _demo

    def interrupted(args: Any) -> int:
        raise raised

    monkeypatch.setattr(_demo, "run", interrupted)
    assert polygate.cli.main(["demo"]) == 130
    assert capsys.readouterr().err == "polygate demo: interrupted\n"


def test_a_failure_beside_ctrl_c_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    from polygate.cli import _demo

    def failed(args: Any) -> int:
        raise BaseExceptionGroup("both", [KeyboardInterrupt(), ValueError("a bug")])

    monkeypatch.setattr(_demo, "run", failed)
    with pytest.raises(BaseExceptionGroup):
        polygate.cli.main(["demo"])


def test_ctrl_c_while_chat_reads_its_prompt_is_interrupted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md: Ctrl-C gives "polygate chat: interrupted" and 130; with the prompt
    read from standard input (`-`) it was a bare traceback."""
    class Stdin:
        def read(self) -> str:
            raise KeyboardInterrupt

    monkeypatch.setenv("POLYGATE__CHAT__A__BASE_URL", "http://127.0.0.1:1/v1")
    monkeypatch.setattr(sys, "stdin", Stdin())
    assert polygate.cli.main(["chat", "-"]) == 130
    assert capsys.readouterr().err.endswith("polygate chat: interrupted\n")


def test_the_tail_share_counts_the_ceiling_of_its_share(tmp_path: Path) -> None:
    """docs/cli.md: the slowest ⌈x % · calls⌉ calls.  With 100 calls, 7 % was 8 calls
    (7 / 100 * 100 is 7.000000000000001 in floating point)."""
    db = tmp_path / "t.db"
    _make_db(db, 100)
    out = _cli("stats", str(db), "--json", "--tail", "7,14,28")
    assert out.returncode == 0, out.stderr
    got = {t["slowest_pct"]: t["calls"] for t in json.loads(out.stdout)["tail_share"]}
    assert got == {7.0: 7, 14.0: 14, 28.0: 28}


def test_check_config_shows_no_gateway_keys_as_none(tmp_path: Path) -> None:
    """docs/cli.md: secrets as ***, unset values as -.  An empty api_keys was ***,
    as if keys were configured."""
    config = tmp_path / "g.toml"
    config.write_text('[scopes.chat.sources.a]\nbase_url = "http://127.0.0.1:8001/v1"\n')
    out = _cli("check-config", "--config", str(config), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["settings"]["serve"]["api_keys"] is None


def test_a_plot_named_without_an_extension_says_the_file_it_wrote(tmp_path: Path) -> None:
    """matplotlib writes NAME.png for --plot NAME; stats said it wrote NAME."""
    pytest.importorskip("matplotlib")
    db = tmp_path / "t.db"
    _make_db(db, 10)
    out = _cli("stats", str(db), "--plot", str(tmp_path / "myplot"))
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == f"wrote {tmp_path / 'myplot.png'}"
    assert (tmp_path / "myplot.png").is_file()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import polygate
    from polygate.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"polygate {polygate.__version__}"


def test_ctrl_c_while_the_commands_load_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """review: building the parser imports every subcommand, outside the handler
    that turns Ctrl-C into one line and 130: a traceback."""
    import importlib
    import types

    import polygate.cli

    def import_module(name: str, package: str | None = None) -> types.ModuleType:
        if name.endswith("._stats"):
            raise KeyboardInterrupt
        return importlib.import_module(name, package)

    monkeypatch.setattr(polygate.cli, "importlib", types.SimpleNamespace(import_module=import_module))
    try:
        code = polygate.cli.main(["stats"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main(): a traceback for the user")
    assert code == 130
    assert capsys.readouterr().err == "polygate: interrupted\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_an_output_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """review: `polygate … > report.txt` on a full disk died with an OSError traceback;
    only a closed pipe was handled."""
    env = {**os.environ, "POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:9/v1"}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "polygate", "check-config"], env=env,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "polygate check-config: cannot write the output: No space left on device"]


def test_chat_with_its_output_closed_is_no_traceback(tmp_path: Path) -> None:
    """review: `polygate chat "…" >&-` (a service with fd 1 closed) failed with an
    AttributeError traceback: sys.stdout is None there."""
    script = (
        "import subprocess, sys, json\n"
        "srv = subprocess.Popen([sys.executable, '-m', 'polygate.testing.serve', '--port', '0',"
        " '--reply', json.dumps({'text': 'pong'})], stdout=subprocess.PIPE, text=True)\n"
        "url = srv.stdout.readline().split()[-1]\n"
        "import os\n"
        "env = dict(os.environ, POLYGATE__CHAT__A__BASE_URL=url)\n"
        "done = subprocess.run([sys.executable, '-m', 'polygate', 'chat', 'hi'], env=env,"
        " stderr=subprocess.PIPE, text=True,"
        " pass_fds=(), close_fds=True, preexec_fn=lambda: os.close(1))\n"
        "srv.terminate(); srv.wait(10)\n"
        "print(done.returncode); print(done.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    code, _, stderr = done.stdout.partition("\n")
    assert code == "0", done.stdout + done.stderr
    assert "Traceback" not in stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("args", [["--version"], ["chat", "--help"]])
@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_help_and_version_that_cannot_be_written_are_one_line(
    tmp_path: Path, args: list[str], unbuffered: str
) -> None:
    """Review: argparse ignores an error writing its own text, and the interpreter's
    final flush fails in silence: `polygate --version > /dev/full` exited 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "polygate", *args], env=env, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "polygate: cannot write the output: No space left on device"]


@pytest.mark.parametrize(("args", "redirect", "status"), [
    (["--bogus"], "2>&- >/dev/null", 2),  # a usage error with stderr closed: still 2
    (["--version"], ">&-", 0),  # stdout closed: prints nothing, not to stderr instead
    (["chat", "--help"], ">&-", 0),
])
def test_help_version_and_usage_with_a_stream_closed(
    tmp_path: Path, args: list[str], redirect: str, status: int
) -> None:
    """Review: the parser's own writer failed on a stream the process was started with
    closed (an AttributeError: status 1, not argparse's 2); and --version with stdout
    closed printed to stderr."""
    command = " ".join([shlex.quote(sys.executable), "-m", "polygate", *args, redirect])
    done = subprocess.run(["bash", "-c", command], stderr=subprocess.PIPE, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == status
    if "2>&-" not in redirect:
        assert done.stderr == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize(("reader_gone", "status", "said"), [
    (False, 1, "polygate: cannot write the output: No space left on device\n"),
    (True, 141, ""),
])
def test_no_command_whose_help_cannot_be_written(
    tmp_path: Path, reader_gone: bool, status: int, said: str
) -> None:
    """Review: `polygate` alone printed its help outside the handling of output errors:
    a traceback into a full disk, or to a reader that left."""
    if reader_gone:
        read, out = os.pipe()
        os.close(read)  # the reader left before anything was written: EPIPE, always
    else:
        out = os.open("/dev/full", os.O_WRONLY)
    try:
        done = subprocess.run([sys.executable, "-m", "polygate"], stdout=out, stderr=subprocess.PIPE,
                              text=True, timeout=120, cwd=tmp_path)
    finally:
        os.close(out)
    assert (done.returncode, done.stderr) == (status, said)


@pytest.mark.parametrize("args", [["chat", "hi"], ["stats", "missing.db"]])
def test_with_stderr_closed_an_error_does_not_land_in_the_answer(
    tmp_path: Path, args: list[str]
) -> None:
    """Review: `polygate chat "…" > answer.txt 2>&-` wrote its error line to stdout
    (print(..., file=sys.stderr) with sys.stderr None), into the answer's file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATE")}
    env["POLYGATE__CHAT__A__BASE_URL"] = "http://127.0.0.1:9/v1"
    command = " ".join([shlex.quote(sys.executable), "-m", "polygate", *args, "2>&-"])
    done = subprocess.run(["bash", "-c", command], env=env, stdout=subprocess.PIPE, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode in (1, 2)
    assert done.stdout == ""


_TOO_LONG = "/tmp/" + "a" * 300 + ".toml"  # (ENAMETOOLONG; a folder one may not enter: EACCES)


@pytest.mark.parametrize("args", [["check-config"], ["chat", "hi"], ["stats"]])
def test_a_polygate_config_the_system_cannot_look_at_is_one_line(
    tmp_path: Path, args: list[str]
) -> None:
    """Review: Path.is_file() raised OSError for it, a traceback with status 1, where
    `--config` with the same path already said why in one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATE")}
    env["POLYGATE_CONFIG"] = _TOO_LONG
    done = subprocess.run([sys.executable, "-m", "polygate", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.endswith("the file (File name too long)"), line


def test_load_settings_with_a_polygate_config_the_system_cannot_look_at() -> None:
    from polygate._config_load import load_settings

    with pytest.raises(polygate.ConfigError, match="cannot look at the file"):
        load_settings({"POLYGATE_CONFIG": _TOO_LONG})


@pytest.mark.parametrize("argv", [
    ["stats", "--since=--"], ["stats", "--tail=--"], ["demo", "--calls=--"],
    ["chat", "hi", "--scope=--"], ["check-config", "--config=--"],
])
def test_an_option_whose_value_is_two_dashes_is_that_value(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: before Python 3.13 argparse drops a value of ``--`` (``--config=--``) and
    hands the option an empty list: a traceback further on, or the default
    configuration checked in place of the file named ``--``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POLYGATE__CHAT__A__BASE_URL", "http://127.0.0.1:9/v1")
    assert polygate.cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 4, err  # (usage: 2-3)
    if argv[0] == "check-config":
        assert "--: configuration file not found" in err


@pytest.mark.parametrize("argv", [
    ["check-config", "--config", "x\n\x1b[31mforged: ok"],
    ["stats", "x\n\x1b[31mforged: ok"],
])
def test_a_path_with_a_line_break_is_shown_on_its_line(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Outside review (fuzzing the command line): a path was echoed as it was, and a
    line break or an escape sequence in it split the error line, or forged another."""
    monkeypatch.chdir(tmp_path)
    assert polygate.cli.main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert "\x1b" not in err
    assert "x\\n\\x1b[31mforged: ok" in err.splitlines()[0]


_FORGED = "x\n\x1b[31mforged: ok"


@pytest.mark.parametrize("case", ["not-sqlite", "no-calls-table", "plot-dir", "demo-db"])
def test_every_error_line_that_names_a_path_shows_it_escaped(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A second review: after the loaders' messages, four more error lines still
    printed a path as it was (stats on a file that is no database or has no calls
    table, a plot that cannot be written, a --db in a deleted working directory)."""
    import sqlite3

    monkeypatch.chdir(tmp_path)
    if case == "not-sqlite":
        (tmp_path / (_FORGED + ".db")).write_text("not a database " * 100)
        argv = ["stats", _FORGED + ".db"]
    elif case == "no-calls-table":
        conn = sqlite3.connect(tmp_path / (_FORGED + ".db"))
        conn.execute("CREATE TABLE t(x)")
        conn.commit()
        conn.close()
        argv = ["stats", _FORGED + ".db"]
    elif case == "plot-dir":
        pytest.importorskip("matplotlib")
        argv = ["demo", "--calls", "1", "--concurrency", "1", "--plot", _FORGED + "/p.png"]
    else:
        gone = tmp_path / "gone"
        gone.mkdir()
        monkeypatch.chdir(gone)
        gone.rmdir()
        argv = ["demo", "--calls", "1", "--concurrency", "1", "--db", _FORGED]
    assert polygate.cli.main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert "\x1b" not in err, err
    assert "x\\n\\x1b[31mforged: ok" in err.splitlines()[0], err


@pytest.mark.parametrize("command", ["demo", "stats", "chat", "serve", "check-config"])
def test_help_is_whole_under_python_OO(command: str) -> None:
    """Review (interpreter flags): ``python -OO`` (PYTHONOPTIMIZE=2, common in
    container images) drops docstrings, and four commands' help was their module's:
    ``serve --help`` lost its signals and exit statuses, 21 of its 28 lines."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONOPTIMIZE"}

    def help_text(*flags: str) -> str:
        done = subprocess.run([sys.executable, *flags, "-m", "polygate", command, "--help"],
                              capture_output=True, text=True, env=env, timeout=60, check=True)
        return done.stdout

    assert help_text("-OO") == help_text()
