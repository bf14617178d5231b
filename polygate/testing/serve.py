"""Run a FakeUpstream as a standalone server: ``python -m polygate.testing.serve``.

Benchmarks and cross-process tests need the fake in its own process.  It prints
exactly one line, ``listening on http://HOST:PORT/v1``, once it accepts
connections (``--port 0`` picks a free port and prints it), and exits with status
0 on SIGINT or SIGTERM.

``--profile JSON`` takes Profile fields (or, when a key exists only on Reply,
Reply fields); ``--reply JSON`` always means Reply fields.  Two-element lists are
``(lo, hi)`` ranges, e.g. ``--profile '{"first_token_s": [0.1, 0.5], "p_429": 0.1}'``;
a tool call is an object of ToolCall fields, e.g.
``--reply '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ._script import Profile, Reply, ToolCall
from ._upstream import FakeUpstream

__all__ = ["main", "parse_behaviour"]

_PROFILE_FIELDS = frozenset(a.name for a in attrs.fields(Profile))
_REPLY_FIELDS = frozenset(a.name for a in attrs.fields(Reply))
_TOOL_CALL_FIELDS = frozenset(a.name for a in attrs.fields(ToolCall))


def parse_behaviour(profile: str | None, reply: str | None) -> Reply | Profile:
    """The behaviour described by the ``--profile`` / ``--reply`` JSON options."""
    if profile is not None and reply is not None:
        raise ValueError("give --profile or --reply, not both")
    if reply is not None:
        return Reply(**_fields(reply, _REPLY_FIELDS, "--reply"))
    if profile is None:
        return Reply()
    data = _object(profile, "--profile")
    if set(data) <= _PROFILE_FIELDS:
        if isinstance(data.get("base"), dict):
            data["base"] = Reply(**_fields(json.dumps(data["base"]), _REPLY_FIELDS, "base"))
        return Profile(**data)
    return Reply(**_fields(profile, _REPLY_FIELDS, "--profile"))


def _object(text: str, option: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{option}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{option}: expected a JSON object")
    return data


def _fields(text: str, allowed: frozenset[str], option: str) -> dict[str, Any]:
    data = _object(text, option)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{option}: unknown field(s) {', '.join(unknown)}")
    calls = data.get("tool_calls")
    if isinstance(calls, list) and allowed is _REPLY_FIELDS:
        # JSON has no ToolCall: each is an object of its fields.
        data["tool_calls"] = [_tool_call(call, option) for call in calls]
    return data


def _tool_call(call: Any, option: str) -> Any:
    if not isinstance(call, dict):
        return call  # (the Reply refuses it, naming it)
    unknown = sorted(set(call) - _TOOL_CALL_FIELDS)
    if unknown:
        raise ValueError(f"{option}: unknown tool call field(s) {', '.join(unknown)}")
    return ToolCall(**call)


async def _serve(upstream: FakeUpstream, host: str, port: int) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with upstream.serve(host, port) as url:
            print(f"listening on {url}", flush=True)
            async for _ in signals:
                return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m polygate.testing.serve",
        description="Serve a scripted OpenAI-compatible fake upstream.",
    )
    parser.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="fake", help="appears in response ids")
    parser.add_argument("--profile", help="JSON object of Profile (or Reply) fields")
    parser.add_argument("--reply", help="JSON object of Reply fields")
    parser.add_argument("--embedding-dim", type=int, default=8)
    parser.add_argument(
        "--history", type=int, default=1000, help="recorded requests kept in memory"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    try:
        behaviour = parse_behaviour(args.profile, args.reply)
        upstream = FakeUpstream(
            behaviour,
            seed=args.seed,
            name=args.name,
            embedding_dim=args.embedding_dim,
            history=args.history,
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if not args.host:
        parser.error("--host must name one address or host")
    try:
        trio.run(_serve, upstream, args.host, args.port)
    except KeyboardInterrupt:  # a signal that arrived before the receiver was installed
        pass
    except OSError as exc:  # the port is taken, the host is not ours: one line, no traceback
        print(f"{parser.prog}: cannot listen on {args.host}:{args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
