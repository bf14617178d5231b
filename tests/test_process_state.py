"""What polygate leaves process-wide: the warnings machinery, the ids a forked process
draws, settings handed to another process, trio's scheduling state."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest

import polygate

#: Two sources per scope: a configuration without a warning of its own.
_ENV = {
    "POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
    "POLYGATE__CHAT__B__BASE_URL": "http://b/v1",
    "POLYGATE__EMBED__A__BASE_URL": "http://a/v1",
}


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch every microsecond: an unguarded swap of global state shows."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _in_threads(work: Callable[[], object], *, threads: int = 2, rounds: int = 2000) -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            for _ in range(rounds):
                work()
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    started = [threading.Thread(target=body) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(120)
    assert not errors, errors


def _warnings_state() -> tuple[object, ...]:
    return (list(warnings.filters), warnings.showwarning, warnings._showwarnmsg_impl)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fast_switching")
def test_settings_built_in_two_threads_leave_the_warnings_machinery_alone() -> None:
    """Two sessions opened without settings, in two threads, each read the
    environment.  The assembly used ``warnings.catch_warnings``, whose save and
    restore of the process's filters two threads interleave: the process was left
    with an "always" filter before the user's own, and every later warning appended
    to a list nobody reads."""
    before = _warnings_state()
    try:
        _in_threads(lambda: polygate.Settings.from_env(_ENV))
        after = _warnings_state()
    finally:
        warnings.filters[:] = before[0]  # type: ignore[index]
        warnings.showwarning = before[1]  # type: ignore[assignment]
        warnings._showwarnmsg_impl = before[2]  # type: ignore[attr-defined]
        warnings._filters_mutated()  # type: ignore[attr-defined]
    assert after == before


def test_a_settings_warning_still_reaches_python_and_names_the_key() -> None:
    env = {"POLYGATE__CHAT__A__BASE_URL": "http://a/v1", "POLYGATE__CHAT__HEDGE__AFTER_S": "1"}
    with pytest.warns(polygate.ConfigWarning, match=r"^POLYGATE__CHAT__\*: hedging .*single source") as seen:
        polygate.Settings.from_env(env)
    assert [w.filename for w in seen] == [__file__]  # the caller's line, not polygate's


@pytest.mark.usefixtures("fast_switching")
async def test_concurrent_ocr_of_images_leaves_the_warnings_filters_alone(
    autojump_clock: object,
) -> None:
    """Each image is opened on a worker thread under ``catch_warnings`` (Pillow's
    decompression-bomb warning is ignored there, and the image refused by polygate's
    own check): concurrent calls interleaved the save and restore, and the "ignore"
    stayed in the process's filters."""
    image = pytest.importorskip("PIL.Image")
    import io

    import trio

    from polygate.testing import FakeUpstream, Reply, Router

    png = io.BytesIO()
    image.new("RGB", (1200, 1200), "white").save(png, "PNG")
    settings = polygate.Settings(scopes={"ocr": polygate.Scope(
        sources=[polygate.Source(name="a", base_url="http://a/v1")], ocr=polygate.Ocr())})
    before = list(warnings.filters)
    after = before
    try:
        for _ in range(3):  # (an interleaving is likely in a round, not certain)
            async with polygate.session(settings, transport=Router({"a": FakeUpstream(Reply(text="page"))})) as s:
                async with trio.open_nursery() as nursery:
                    for _ in range(150):
                        nursery.start_soon(s.ocr, png.getvalue())
            after = list(warnings.filters)
            if after != before:
                break
    finally:
        warnings.filters[:] = before  # type: ignore[index]
        warnings._filters_mutated()  # type: ignore[attr-defined]
    assert after == before


_FORKED_IDS = """
import os, sys, trio, trio.testing, polygate
from polygate.testing import FakeUpstream, Reply
settings = polygate.Settings(scopes={"chat": polygate.Scope(
    sources=[polygate.Source(name="a", base_url="http://a/v1")])})
def first_id():
    async def main():
        up = FakeUpstream(Reply(text="x"))
        async with polygate.session(settings, transport=up.transport()) as s:
            return (await s.chat([{"role": "user", "content": "hi"}])).call_stats.logical_call_id
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
print(first_id(), flush=True)
for _ in range(2):  # two workers of a pre-forking server, no session open at the fork
    pid = os.fork()
    if pid == 0:
        print(first_id(), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
print(first_id(), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_forked_workers_name_their_calls_apart() -> None:
    """The ids' per-process tag was drawn once, at import: two workers forked after
    ``import polygate`` named their first calls alike, in the telemetry file they may
    share and in the upstream's ``x-polygate-call-id``."""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", _FORKED_IDS],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    parent, child1, child2, parent_again = done.stdout.split()
    tags = {i.split("-")[0] for i in (parent, child1, child2)}
    assert len(tags) == 3, done.stdout
    assert parent_again.split("-")[0] == parent.split("-")[0]  # the parent keeps its own
    assert parent_again != parent


def test_a_seeded_schedule_run_while_another_runs_is_refused_and_trio_is_put_back() -> None:
    """trio's scheduler state is process-wide: two ``Schedule.run`` at once (two
    threads) shuffled with one generator and each put back what the other had
    changed, leaving every later ``trio.run`` of the process shuffled by a seeded
    generator."""
    import trio
    from trio._core import _run

    from polygate.testing import Schedule

    before = (_run._ALLOW_DETERMINISTIC_SCHEDULING, _run._r.getstate())
    inside, go = threading.Event(), threading.Event()

    async def waits() -> None:
        inside.set()
        await trio.to_thread.run_sync(go.wait)

    async def nothing() -> None:
        pass

    first = threading.Thread(target=Schedule(1).run, args=(waits,))
    first.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match=r"another Schedule\.run is in progress"):
            Schedule(2).run(nothing)
    finally:
        go.set()
        first.join(30)
    assert (_run._ALLOW_DETERMINISTIC_SCHEDULING, _run._r.getstate()) == before
    Schedule(3).run(nothing)  # and one at a time still works


def _settings_with_every_read_only_mapping() -> polygate.Settings:
    return polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[
            polygate.Source(name="a", base_url="http://a/v1", api_key="sk-test-key")])},
        serve=polygate.Serve(
            models={"gpt": "chat"}, api_keys=["gw-key"],
            keys={"team": polygate.ServeKey(key="team-key", rpm=10)}),
    )


def test_settings_pickle_and_deepcopy_and_stay_read_only() -> None:
    """Review: ``pickle`` and ``copy.deepcopy`` refused Settings (its scopes, and the
    server's models and keys, are read-only mappings), so settings could not be handed
    to a ``spawn`` worker, which docs/asyncio.md recommends."""
    import copy
    import pickle

    settings = _settings_with_every_read_only_mapping()
    for again in (pickle.loads(pickle.dumps(settings)), copy.deepcopy(settings)):
        assert again == settings and again is not settings
        with pytest.raises(TypeError):
            again.scopes["other"] = again.scopes["chat"]  # type: ignore[index]
        with pytest.raises(TypeError):
            again.serve.models["other"] = "chat"  # type: ignore[index]
        assert "sk-test-key" not in repr(again)


def test_settings_reach_another_process_whole() -> None:
    import pickle

    reader = ("import pickle, sys; s = pickle.load(sys.stdin.buffer); "
              "print(s.scopes['chat'].sources[0].api_key, sorted(s.serve.keys), dict(s.serve.models))")
    done = subprocess.run([sys.executable, "-c", reader], capture_output=True, timeout=60,
                          input=pickle.dumps(_settings_with_every_read_only_mapping()))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split() == ["sk-test-key", "['team']", "{'gpt':", "'chat'}"]


def test_a_settings_error_crosses_a_process_boundary() -> None:
    """Review finding (typing angle): a bad setting's ConfigError (a FieldError) could
    not be unpickled (its __init__ takes the field and the problem, the default pickle
    passed the message), so a worker that failed on its settings broke a
    ProcessPoolExecutor and hung a multiprocessing.Pool.  The secrets it masked against
    do not travel."""
    import pickle

    secret = "pw-0123456789abcdef"
    with pytest.raises(polygate.ConfigError) as info:
        polygate.Settings(scopes={"chat": polygate.Scope(sources=[polygate.Source(
            name="a", base_url="http://a/v1")])}, telemetry=f"postgresql://u:{secret}@h:70000/db")
    exc = info.value
    assert exc.secrets  # type: ignore[attr-defined]  # (what the message was masked against)
    exc.__notes__ = ["from a worker"]  # (add_note: 3.11 and later)
    data = pickle.dumps(exc)
    assert secret.encode() not in data and secret not in str(exc)
    again = pickle.loads(data)
    assert type(again) is type(exc) and str(again) == str(exc)
    assert again.__notes__ == ["from a worker"]
    assert (again.field, again.problem) == (exc.field, exc.problem)  # type: ignore[attr-defined]
    reader = "import pickle, sys; e = pickle.load(sys.stdin.buffer); print(type(e).__name__, e.field)"
    done = subprocess.run([sys.executable, "-c", reader], capture_output=True, timeout=60, input=data)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split() == ["FieldError", "telemetry"]


def test_a_pickled_settings_error_masks_as_the_original_did() -> None:
    """Review of the fix: the copy was rebuilt from its unmasked owner, so a source
    named like the URL's password showed in the copy what the original hid."""
    import pickle

    with pytest.raises(polygate.ConfigError) as caught:
        polygate.Source(name="hunter2hunter2", base_url="http://u:hunter2hunter2@a/v1")
    data = pickle.dumps(caught.value)
    assert "hunter2" not in str(caught.value) and b"hunter2" not in data
    assert str(pickle.loads(data)) == str(caught.value)


def _bad_key_source() -> polygate.Source:
    return polygate.Source(name="a", base_url="http://a/v1", api_key="sk\u200bx")  # line A


def test_a_settings_warning_points_at_the_line_that_built_the_settings() -> None:
    """``Source(api_key=...)``'s warning pointed one frame too far (at the caller of
    the function that built it): its fixed stacklevel counted a frame that attrs'
    ``__init__`` does not have.  Each warning now points at the first line outside
    the settings' code, however they were built."""
    import inspect

    import attrs

    good = polygate.Source(name="a", base_url="http://a/v1")
    line_a = inspect.getsource(_bad_key_source).splitlines()[1]
    assert line_a.endswith("# line A")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _bad_key_source()
        here = sys._getframe().f_lineno
        attrs.evolve(good, api_key="sk\u200by")
        polygate.Scope(sources=[good], hedge=polygate.Hedge(after_s=1))
        polygate.Settings.from_env({"POLYGATE__CHAT__A__BASE_URL": "http://a/v1",
                                    "POLYGATE__CHAT__HEDGE__AFTER_S": "1"})
    assert all(w.filename == __file__ for w in seen), [w.filename for w in seen]
    first_line = _bad_key_source.__code__.co_firstlineno + 1
    assert [w.lineno for w in seen] == [first_line, here + 1, here + 2, here + 3]
