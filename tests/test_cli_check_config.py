"""``polygate check-config``: exit 0 and a masked listing when valid, 2 and a message when not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import polygate
from polygate import ConfigError
from polygate._config_load import describe, settings_from_toml
from polygate.cli import SUBCOMMANDS, main

KEY = "sk-test-SECRET-1234567890"
REDIS_PW = "redis-PASSWORD-42"
URL_PW = "url-PASSWORD-77"
ROOT = Path(__file__).resolve().parent.parent

VALID = f"""
backend = "redis://:{REDIS_PW}@localhost:6379/0"
[scopes.chat]
call_deadline_s = 120
[scopes.chat.hedge]
after_s = 8.0
[scopes.chat.sources.a]
base_url = "http://127.0.0.1:8001/v1"
api_key = "{KEY}"
[scopes.chat.sources.b]
base_url = "http://127.0.0.1:8002/v1"
api_key_env = "CHECK_CONFIG_TEST_KEY"
"""

SINGLE = """
[scopes.chat.hedge]
after_s = 8.0
[scopes.chat.sources.a]
base_url = "http://127.0.0.1:8001/v1"
"""

INVALID = f"""
[scopes.chat.sources.a]
base_url = "http://127.0.0.1:8001/v1"
api_key = "{KEY}"
timeout_s = -1
"""


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty working directory, no polygate keys, the test secret in the env."""
    for key in list(os.environ):
        if key.startswith("POLYGATE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("CHECK_CONFIG_TEST_KEY", KEY)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(directory: Path, text: str, name: str = "polygate.toml") -> str:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in (KEY, REDIS_PW, URL_PW):
            assert secret not in text


def test_valid_file_prints_a_masked_table(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(clean, VALID, "conf.toml")
    assert main(["check-config", "--config", path]) == 0
    out, err = capsys.readouterr()
    assert_no_secret(out, err)
    assert f"configuration from {path}: valid" in out
    assert "scopes.chat.sources.a.api_key" in out
    assert "scopes.chat.hedge.after_s" in out
    assert "redis://:***@localhost:6379/0" in out
    assert err == ""


def test_the_table_has_one_row_a_field_and_no_control_character(
    clean: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Outside review (fuzzing the configuration): a valid multi-line OCR prompt split
    its row in two, and an escape sequence in a model name went raw to the terminal."""
    text = ('[scopes.c.sources.a]\nbase_url = "http://a/v1"\nmodel = "m\\u001b[2Jx"\n'
            '[scopes.c.ocr]\nprompt = "Transcribe.\\nKeep tables."\n')
    path = write(clean, text, "conf.toml")
    assert main(["check-config", "--config", path]) == 0
    out, _ = capsys.readouterr()
    rows = out.splitlines()[1:]
    assert rows and all(row.startswith("  ") for row in rows), out
    assert "\x1b" not in out
    assert "m\\x1b[2Jx" in out and "Transcribe.\\nKeep tables." in out


def test_json_output(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(clean, VALID, "conf.toml")
    assert main(["check-config", "--config", path, "--json"]) == 0
    out, err = capsys.readouterr()
    assert_no_secret(out, err)
    report = json.loads(out)
    assert report["source"] == path
    assert report["warnings"] == []
    assert report["settings"] == describe(settings_from_toml(path))


def test_invalid_exits_2_without_traceback(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(clean, INVALID, "bad.toml")
    assert main(["check-config", "--config", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "scopes.chat.sources.a.timeout_s" in err
    assert "must be a finite number > 0" in err
    assert "Traceback" not in err
    assert_no_secret(out, err)


def test_a_huge_integer_exits_2_without_traceback(
    clean: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: an integer no float holds raised OverflowError out of the loader."""
    path = write(clean, '[scopes.chat.sources.a]\nbase_url = "http://a/v1"\ntimeout_s = 1'
                 + "0" * 400 + "\n", "huge.toml")
    assert main(["check-config", "--config", path]) == 2
    _out, err = capsys.readouterr()
    assert "timeout_s: expected a finite number" in err and "Traceback" not in err


def test_missing_file(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--config", "absent.toml"]) == 2
    assert "absent.toml: configuration file not found" in capsys.readouterr().err


def test_warnings_are_printed(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(clean, SINGLE, "single.toml")
    assert main(["check-config", "--config", path]) == 0
    _, err = capsys.readouterr()
    assert "warning: " in err
    assert "scopes.chat" in err
    assert "single source" in err
    assert main(["check-config", "--config", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["warnings"]) == 1
    assert "single source" in report["warnings"][0]


def test_an_invalid_configurations_warnings_are_printed_before_its_error(
    clean: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """review: the warnings found before the error were dropped, so a fix for the
    error met them only on the next run."""
    path = write(clean, SINGLE + "\n[scopes.other]\nfallback = \"nope\"\n"
                 "[scopes.other.sources.b]\nbase_url = \"http://127.0.0.1:8002/v1\"\n", "both.toml")
    assert main(["check-config", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "warning: " in err and "single source" in err
    assert err.index("warning: ") < err.index("invalid configuration")


def test_default_reads_local_file(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(clean, VALID)
    assert main(["check-config"]) == 0
    out, err = capsys.readouterr()
    assert "configuration from polygate.toml: valid" in out
    assert_no_secret(out, err)


def test_default_reads_polygate_config(
    clean: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(clean, VALID, "elsewhere.toml")
    monkeypatch.setenv("POLYGATE_CONFIG", path)
    assert main(["check-config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == path


@pytest.mark.parametrize("flags", [[], ["--config", ""]], ids=["no-flag", "empty-flag"])
def test_default_reads_environment(
    clean: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    flags: list[str],
) -> None:
    """(An empty --config, a deploy script's variable expanded empty, names no file.)"""
    monkeypatch.setenv("POLYGATE__CHAT__A__BASE_URL", "http://127.0.0.1:8001/v1")
    monkeypatch.setenv("POLYGATE__CHAT__A__API_KEY", KEY)
    monkeypatch.setenv("POLYGATE__BACKEND", f"redis://:{REDIS_PW}@localhost:6379/0")
    assert main(["check-config", *flags]) == 0
    out, err = capsys.readouterr()
    assert "environment" in out
    assert "scopes.chat.sources.a.api_key" in out
    assert_no_secret(out, err)


def test_environment_typo(
    clean: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POLYGATE__CHAT__A__BASE_URL", "http://127.0.0.1:8001/v1")
    monkeypatch.setenv("POLYGATE__CHAT__A__TIMEOUT", "30")
    assert main(["check-config"]) == 2
    err = capsys.readouterr().err
    assert "POLYGATE__CHAT__A__TIMEOUT" in err
    assert "did you mean TIMEOUT_S?" in err


def test_nothing_configured(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config"]) == 2
    err = capsys.readouterr().err
    assert "no polygate configuration found" in err
    assert "POLYGATE_CONFIG" in err


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert "check_config" in SUBCOMMANDS
    assert main([]) == 2
    assert "check-config" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert main(["no-such-command"]) == 2
    assert main(["check-config", "--bogus"]) == 2


def run_module(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATE")}
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "polygate", *args],
        cwd=cwd, env={**base, "PYTHONPATH": pythonpath, **env},
        capture_output=True, text=True, timeout=60, check=False,
    )


def test_python_dash_m(tmp_path: Path) -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://127.0.0.1:8001/v1",
           "POLYGATE__CHAT__A__API_KEY": KEY}
    done = run_module("check-config", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "scopes.chat.sources.a.api_key" in done.stdout
    assert_no_secret(done.stdout, done.stderr)

    bad = run_module("check-config", cwd=tmp_path,
                     env={**env, "POLYGATE__CHAT__A__RPM": "2.5"})
    assert bad.returncode == 2
    assert "POLYGATE__CHAT__A__RPM" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert_no_secret(bad.stdout, bad.stderr)


# check-config validates exactly what session() validates before it connects anything:
# each of these settings builds, and session() refuses it with a ConfigError.
SESSION_ONLY = {
    "coredis missing": ('backend = "redis://localhost:6379/0"', {"coredis": None}),
    "coredis missing for the cache": ('cache = "redis://localhost:6379/0"', {"coredis": None}),
    "psycopg missing": ('telemetry = "postgresql://db.invalid/telemetry"', {"psycopg": None}),
}


# The backend URL's options are checked with the URL itself (they were checked only at
# session start, where no key or TOML path could be named): refused as the file loads.
AT_LOAD = {
    "redis option unknown": ('backend = "redis://localhost:6379/0?bogus=1"', "unknown option 'bogus'"),
    "redis option malformed": ('backend = "redis://localhost:6379/0?timeout_s=soon"', "timeout_s"),
    "redis poll_s against lease_s": ('backend = "redis://localhost:6379/0?poll_s=10"', "poll_s"),
    "redis database not a number": ('backend = "redis://localhost:6379/zero"', "database"),
}


@pytest.mark.parametrize("case", AT_LOAD)
def test_a_bad_backend_option_is_refused_as_the_file_loads(
    case: str, clean: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    top, words = AT_LOAD[case]
    path = write(clean, top + '\n[scopes.chat.sources.a]\nbase_url = "http://127.0.0.1:8001/v1"\n')
    with pytest.raises(ConfigError) as info:
        settings_from_toml(path)
    assert f"{path}: backend: " in str(info.value) and words in str(info.value)
    assert main(["check-config", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err == f"polygate check-config: invalid configuration: {info.value}\n"


@pytest.mark.parametrize("case", SESSION_ONLY)
def test_check_config_is_as_strict_as_session(
    case: str, clean: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    top, missing = SESSION_ONLY[case]
    for module, value in missing.items():
        monkeypatch.setitem(sys.modules, module, value)
    path = write(clean, top + '\n[scopes.chat.sources.a]\nbase_url = "http://127.0.0.1:8001/v1"\n')
    settings = settings_from_toml(path)  # the settings themselves are valid

    async def open_session() -> None:
        async with polygate.session(settings):
            pass

    with pytest.raises(ConfigError) as info:
        trio.run(open_session)
    assert main(["check-config", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err == f"polygate check-config: invalid configuration: {info.value}\n"


def test_a_path_that_is_not_utf8_is_shown_escaped(
    clean: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside review (2026-12-02): a telemetry path holding a byte that is not UTF-8
    (a Latin-1 file name, here from the environment) is a valid setting, but printing
    it to a strict UTF-8 stdout failed with a bare UnicodeEncodeError."""
    import io

    monkeypatch.setenv("POLYGATE__CHAT__A__BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("POLYGATE__TELEMETRY", f"sqlite://{clean}/t\udce9l\udce9.db")
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["check-config"]) == 0
    out.flush()
    assert b"t\\udce9l\\udce9.db" in out.buffer.getvalue()  # type: ignore[attr-defined]


def test_a_config_flag_warns_about_the_environment_keys_it_leaves_unused(
    clean: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """review: with ``--config``, POLYGATE__ keys were dropped without a word (with
    POLYGATE_CONFIG, a ConfigWarning names them): a gateway key set that way was
    silently not in force.  check-config, chat and serve read --config as the session
    reads POLYGATE_CONFIG."""
    import logging

    from polygate.cli import _serve

    path = write(clean, VALID, "valid.toml")
    monkeypatch.setenv("POLYGATE__SERVE__API_KEYS", "sk-gw-123456789")
    assert main(["check-config", "--config", path]) == 0
    _, err = capsys.readouterr()
    assert "warning: " in err and "POLYGATE__SERVE__API_KEYS are ignored" in err
    assert "sk-gw-123456789" not in err
    with caplog.at_level(logging.WARNING, logger="polygate.serve"):
        settings = _serve._load(path)
    assert settings.serve.api_keys == ()
    [record] = [r for r in caplog.records if r.name == "polygate.serve"]
    # (The server's log line says its level: see cli/_serve.py's _Lines.)
    assert _serve._Lines().format(record).startswith(
        "polygate serve: warning: configuration read from ")
    assert "POLYGATE__SERVE__API_KEYS are ignored" in record.getMessage()


def test_the_table_names_every_field_the_json_has(clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Review: the text table left out empty tables (serve.keys, serve.models), which
    --json shows as {}: "every resolved field" said both."""
    path = write(clean, VALID, "conf.toml")
    assert main(["check-config", "--config", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["settings"]

    def paths(node: object, path: str) -> set[str]:
        if isinstance(node, dict) and node:
            return set().union(*(paths(v, f"{path}.{k}" if path else k) for k, v in node.items()))
        if isinstance(node, list) and node and all(isinstance(i, dict) for i in node):
            return set().union(*(paths({k: v for k, v in i.items() if k != "name"},
                                       f"{path}.{i['name']}") for i in node))
        return {path}

    assert main(["check-config", "--config", path]) == 0
    table = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert {"serve.keys", "serve.models"} <= paths(report, "")
    assert paths(report, "") <= table


PUBLIC_NO_KEYS = '[scopes.chat.sources.a]\nbase_url = "http://a/v1"\n\n[serve]\nhost = "0.0.0.0"\n'


def test_serve_refuses_what_polygate_serve_refuses_before_listening(
    clean: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A docs sweep: a start script that ran ``check-config`` before ``polygate serve``
    passed a public [serve] host without gateway keys, which the server then refused
    at launch.  ``--serve`` refuses it too; without it the configuration is a library's,
    whose [serve] table ``polygate.session()`` does not use."""
    path = write(clean, PUBLIC_NO_KEYS, "public.toml")
    assert main(["check-config", "--config", path]) == 0
    capsys.readouterr()
    assert main(["check-config", "--config", path, "--serve"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "refusing to listen on '0.0.0.0' without gateway keys" in err
    keyed = write(clean, PUBLIC_NO_KEYS + 'api_keys = ["sk-gw-0123456789abcdef"]\n', "keyed.toml")
    assert main(["check-config", "--config", keyed, "--serve"]) == 0
    out, err = capsys.readouterr()
    assert "valid" in out and "sk-gw-0123456789abcdef" not in out + err


def test_text_that_is_not_a_url_is_shown_as_the_session_uses_it(
    clean: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding (docs, claim by claim): every string field went through the URL
    masking, so an OCR prompt's ``token=ABC123`` printed as ``token=***`` and a model
    named ``team:llama@v2`` as ``***@v2``: not what the session runs with."""
    prompt = "Write form fields as name=value, e.g. token=ABC123 or key=XYZ."
    model = "team:llama@v2"
    path = write(clean, f'backend = "redis://:{REDIS_PW}@localhost:6379/0"\n'
                        f'[scopes.chat.sources.a]\nbase_url = "http://h/v1"\nmodel = "{model}"\n'
                        f'[scopes.chat.ocr]\nprompt = "{prompt}"\n', "conf.toml")
    scope = describe(settings_from_toml(path))["scopes"]["chat"]
    assert scope["ocr"]["prompt"] == prompt and scope["sources"][0]["model"] == model
    assert main(["check-config", "--config", path]) == 0
    out, err = capsys.readouterr()
    assert prompt in out and model in out
    assert_no_secret(out, err)  # the URL's password is still masked
    assert "***" in out


FORGED = "x\n\x1b[31mforged: ok.toml"


def test_a_configuration_path_is_shown_escaped(
    clean: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding: the header line and the warning about environment keys a file
    leaves unused printed the path raw (a line break splits the line, an escape
    sequence reaches the terminal)."""
    write(clean, VALID, FORGED)
    monkeypatch.setenv("POLYGATE__CHAT__B__BASE_URL", "http://h/v1")
    assert main(["check-config", "--config", FORGED]) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err
    assert out.splitlines()[0] == "configuration from x\\n\\x1b[31mforged: ok.toml: valid"
    [line] = err.strip().splitlines()
    assert "read from x\\n\\x1b[31mforged: ok.toml; environment keys" in line


@pytest.mark.parametrize("host", ["LOCALHOST", "Localhost", "127.0.0.2", "::1"])
def test_a_loopback_host_in_any_spelling_needs_no_keys(host: str) -> None:
    """Review finding (base URLs and addresses as deployments write them): without
    keys, "LOCALHOST" was refused as not loopback, where "localhost" was taken. (Not
    "::ffff:127.0.0.1": no IPv6 listener of trio's can bind a mapped address.)"""
    from polygate.serve._server import is_loopback

    assert is_loopback(host)
    assert not is_loopback("localhost.example.com") and not is_loopback("::ffff:127.0.0.1")


def test_check_config_where_polygate_toml_cannot_be_looked_at_is_a_typed_refusal(
    clean: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Review finding (containers: an arbitrary UID whose working directory is root's
    0700): `check-config` looked for ./polygate.toml outside its error handling, a bare
    traceback and status 1, where `polygate serve` answered with a typed refusal (2)."""
    from polygate import ConfigError
    from polygate.cli import _check_config

    def cannot_look() -> None:
        raise ConfigError("polygate.toml: cannot look at the file (Permission denied)")

    monkeypatch.setattr(_check_config, "locate_config", cannot_look)
    assert main(["check-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "invalid configuration: polygate.toml: cannot look at the file" in err
