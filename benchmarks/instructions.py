"""Instructions a request costs, counted by valgrind: a figure the machine's noise
does not move.

On this shared machine wall-clock and CPU times drift by a factor of two within an
hour, so a change of a few per cent cannot be seen in them.  The instructions a
workload executes are nearly the same from run to run (±0.1 %), so they compare two
commits exactly, for the work done (not for waiting: wake-ups, scheduling).  Each
workload runs under ``valgrind --tool=callgrind`` twice, with ``--small`` and
``--large`` repetitions, and the difference over the extra repetitions is the cost of
one: start-up and imports cancel out.  The fake upstream runs in its own process,
outside valgrind, as in the other benchmarks.

Workloads:

* ``serve``: a gateway (``polygate.serve.open_server``) and a raw-socket client in one
  process, sequential chat requests (the client's share is in the figure too);
* ``trio`` / ``asyncio``: sequential ``chat()`` calls from trio, and through
  ``polygate.aio`` on asyncio: their difference is what the bridge costs.

Usage::

    python benchmarks/instructions.py                      # this tree
    python benchmarks/instructions.py --against 7997069    # and a commit, side by side
    python benchmarks/instructions.py --quick              # a smoke run (skipped without valgrind)

Needs valgrind (``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKLOADS = ("serve", "trio", "asyncio")
_KEY = "sk-gw-bench-key-1234"


# --------------------------------------------------------------------------- the workloads


def _child(workload: str, n: int) -> None:
    """Run ``n`` requests of ``workload`` in this process."""
    import trio

    import polygate

    from _common import fake_server

    messages = [{"role": "user", "content": "Say hello."}]
    with fake_server({"text": "hi", "tokens": 8}) as url:
        source = polygate.Source(name="a", base_url=url, model="m1", api_key="sk-upstream")
        settings = polygate.Settings(
            scopes={"chat": polygate.Scope(sources=[source])},
            serve=polygate.Serve(api_keys=(_KEY,)),
        )
        if workload == "serve":
            trio.run(_serve_loop, settings, n)
        elif workload == "trio":

            async def on_trio() -> None:
                async with polygate.session(settings) as s:
                    for _ in range(n):
                        await s.chat(messages, max_tokens=8)

            trio.run(on_trio)
        else:
            import asyncio

            import polygate.aio

            async def on_asyncio() -> None:
                async with polygate.aio.session(settings) as s:
                    for _ in range(n):
                        await s.chat(messages, max_tokens=8)

            asyncio.run(on_asyncio())


async def _serve_loop(settings: Any, n: int) -> None:
    import trio

    from polygate.serve import open_server

    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 8}).encode()
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {_KEY}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    async with open_server(settings, port=0) as server:
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.setblocking(False)
        sock = trio.socket.from_stdlib_socket(raw)
        for _ in range(n):
            await sock.send(request)
            data = b""
            while True:
                data += await sock.recv(65536)
                head, found, rest = data.partition(b"\r\n\r\n")
                if found:
                    length = int(re.search(rb"content-length: (\d+)", head, re.I)[1])  # type: ignore[index]
                    if len(rest) >= length:
                        break
        sock.close()


# --------------------------------------------------------------------------- counting


def _instructions(tree: Path, workload: str, n: int) -> int:
    """Instructions valgrind counted for a whole run of ``workload`` with ``n`` requests,
    importing polygate from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, str(HERE / "instructions.py"), "--child", workload, str(n)],
        env=env, capture_output=True, text=True, check=False,
    )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{workload} under valgrind failed:\n{proc.stderr[-2000:]}")
    return int(found[1])


def per_request(tree: Path, workload: str, small: int, large: int) -> float:
    return (_instructions(tree, workload, large) - _instructions(tree, workload, small)) / (large - small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a git commit (or ref) to count beside this tree")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=700)
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind): nothing counted")
        sys.exit(0 if args.quick else 2)
    if args.quick:
        args.small, args.large = 5, 15
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))} (known: {', '.join(WORKLOADS)})")
    trees = {"this tree": ROOT}
    scratch = None
    if args.against:
        scratch = Path(tempfile.mkdtemp(prefix="polygate-instructions-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(scratch / "tree"), args.against], check=True)
        trees[args.against] = scratch / "tree"
    try:
        counts = {
            name: {w: per_request(tree, w, args.small, args.large) for w in workloads}
            for name, tree in trees.items()
        }
    finally:
        if scratch is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(scratch / "tree")], check=False)
            shutil.rmtree(scratch, ignore_errors=True)
    names = list(trees)
    print(f"instructions per request (callgrind; runs of {args.small} and {args.large})")
    print(f"{'workload':<12}" + "".join(f"{name:>16}" for name in names)
          + (f"{'ratio':>10}" if len(names) == 2 else ""))
    for w in workloads:
        row = [counts[name][w] for name in names]
        ratio = f"{row[0] / row[1]:>10.3f}" if len(row) == 2 and row[1] else ""
        print(f"{w:<12}" + "".join(f"{v:>16,.0f}" for v in row) + ratio)
    if {"trio", "asyncio"} <= set(workloads):
        for name in names:
            bridge = counts[name]["asyncio"] - counts[name]["trio"]
            print(f"the asyncio bridge ({name}): {bridge:+,.0f} instructions a call")


if __name__ == "__main__":
    main()
