"""Gateway keys by the thousand: a presented key is found by its digest, in time that
does not grow with the number of keys (compared with each key in turn, 10,000
tenants' keys cost ~1 ms a request, twice when keys have quotas).  Ratios within one
run, best of several timings, margins far from the old and new figures."""

from __future__ import annotations

import secrets
import time

import polygate
from polygate.serve._app import Gateway
from polygate.serve._unavailable import UnavailableSession

KEYS = [f"sk-gw-{secrets.token_urlsafe(24)}" for _ in range(10_000)]


def _gateway(api_keys: list[str], labelled: dict[str, str] | None = None) -> Gateway:
    settings = polygate.Settings(
        scopes={"chat": polygate.Scope(sources=[polygate.Source(name="a", base_url="http://a/v1")])},
        serve=polygate.Serve(
            api_keys=tuple(api_keys),
            keys={name: polygate.ServeKey(key=key, models=["chat"]) for name, key in (labelled or {}).items()},
        ),
    )
    return Gateway(settings, UnavailableSession(settings, "not opened"))


def _best(fn: object, repeat: int = 7) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(50):
            fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - started)
    return best


def test_ten_thousand_keys_cost_a_request_what_one_does() -> None:
    one, many = _gateway(KEYS[:1]), _gateway(KEYS)
    presented = {"authorization": f"Bearer {KEYS[-1]}"}
    first = {"authorization": f"Bearer {KEYS[0]}"}
    assert many.authorised(presented) and many.authorised(first) and one.authorised(first)
    assert not many.authorised({"authorization": f"Bearer {KEYS[-1]}x"})
    alone = _best(lambda: one.authorised(first))
    among = _best(lambda: many.authorised(presented))
    assert among < 5 * alone, (alone, among)


def test_labelled_keys_among_many_are_named() -> None:
    gateway = _gateway(KEYS[:5000], {f"team-{n}": KEYS[5000 + n] for n in range(5000)})

    def name(key: str) -> str | None:
        return gateway.key_name({"authorization": f"Bearer {key}"})

    assert name(KEYS[5000]) == "team-0" and name(KEYS[-1]) == "team-4999"
    assert name(KEYS[0]) is None and gateway.authorised({"authorization": f"Bearer {KEYS[0]}"})
    assert name("sk-gw-unknown-key-0000") is None
    assert not gateway.authorised({"authorization": "Bearer sk-gw-unknown-key-0000"})
