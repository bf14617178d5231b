"""``polygate chat`` (what it does is its help, ``_DESCRIPTION``)."""

from __future__ import annotations

import argparse
import sys
from typing import IO, Any

from .._secrets import printable

# The command's --help: a constant, not the module's docstring, which python -OO
# (PYTHONOPTIMIZE=2) drops.
_DESCRIPTION = """``polygate chat "prompt"``: one real call through your configuration.

For trying a setup by hand: the configuration is the one ``polygate.session()``
would load (``POLYGATE_CONFIG``, ``./polygate.toml``, or ``POLYGATE__…`` keys; or
``--config PATH``), the call is a real ``chat()`` (or ``stream_chat()`` with
``--stream``, printing chunks as they arrive), and ``--stats`` prints the call's
statistics to stderr, so the answer alone goes to stdout.  With telemetry
configured, the call is recorded like any other.

Exit status: 0 answered, 1 the call failed (the polygate error on stderr), 2 the
configuration or the arguments are wrong, 130 interrupted.
"""

__all__ = ["add_parser", "chat_once", "format_stats", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chat",
        help="send one prompt through your configuration and print the answer",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt", help="the user message; '-' reads it from standard input")
    parser.add_argument("--scope", default="chat", help="the scope to call (default: chat)")
    parser.add_argument("--system", metavar="TEXT", help="a system message before the prompt")
    parser.add_argument("--stream", action="store_true", help="stream the answer as it is generated")
    parser.add_argument("--stats", action="store_true", help="print the call's statistics to stderr")
    parser.add_argument("--config", metavar="PATH", help="a TOML file instead of the default configuration")
    return parser


def run(args: argparse.Namespace) -> int:
    import trio

    from .._config import as_utf8, is_utf8
    from .._config_load import load_settings
    from .._errors import ConfigError, PolygateError

    prompt = _read_stdin() if args.prompt == "-" else as_utf8(args.prompt)
    if prompt is None:
        return 2
    system = as_utf8(args.system) if args.system else args.system
    if not all(is_utf8(text) for text in (prompt, system or "")):
        # (An argument in bytes that are not UTF-8 arrives with surrogate escapes.)
        print("polygate chat: the prompt is not UTF-8 text", file=sys.stderr)
        return 2
    if not prompt.strip():
        print("polygate chat: the prompt is empty", file=sys.stderr)
        return 2
    try:
        settings = load_settings(path=args.config)
        settings.scope(args.scope)
    except ConfigError as exc:
        print(f"polygate chat: invalid configuration: {printable(str(exc))}", file=sys.stderr)
        return 2
    messages = [{"role": "user", "content": prompt}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    try:
        response = trio.run(chat_once, settings, messages, args.scope, args.stream, sys.stdout)
    except KeyboardInterrupt:
        print("polygate chat: interrupted", file=sys.stderr)
        return 130
    except ConfigError as exc:  # e.g. a telemetry database that cannot be opened
        print(f"polygate chat: invalid configuration: {printable(str(exc))}", file=sys.stderr)
        return 2
    except PolygateError as exc:
        # The error quotes the upstream's message: escaped, so that no escape sequence
        # or line break in it acts on the terminal or forges a line of ours.
        print(f"polygate chat: the call failed: {type(exc).__name__}: {printable(str(exc))}",
              file=sys.stderr)
        stats = getattr(exc, "call_stats", None)
        if args.stats and stats is not None:
            print(format_stats(stats, None, None), file=sys.stderr)
        return 1
    if args.stats:
        print(format_stats(response.call_stats, response.usage, response.model), file=sys.stderr)
    return 0


def _read_stdin() -> str | None:
    """The prompt from standard input; None (said on stderr) when there is none to
    read (closed: a service, a cron job) or it is not UTF-8."""
    stdin = sys.stdin
    if stdin is None:
        print("polygate chat: no standard input to read the prompt from", file=sys.stderr)
        return None
    try:
        # As the text stream decodes it (its encoding, its newlines): as an argument is,
        # and as one is, UTF-8 bytes that a locale which is not UTF-8 (``LC_ALL=C``)
        # left as surrogate escapes are read as the UTF-8 they are.
        from .._config import as_utf8

        return as_utf8(stdin.read())
    except UnicodeDecodeError:
        encoding = getattr(stdin, "encoding", None) or "its encoding"
        print(f"polygate chat: the prompt on standard input is not valid {encoding} text",
              file=sys.stderr)
    except (OSError, ValueError) as exc:  # (ValueError: a closed stream)
        print(f"polygate chat: cannot read standard input ({exc.strerror or exc})"
              if isinstance(exc, OSError) else "polygate chat: standard input is closed",
              file=sys.stderr)
    return None


async def chat_once(
    settings: Any,
    messages: list[dict[str, Any]],
    scope: str,
    stream: bool,
    out: IO[str],
    transport: Any = None,
) -> Any:
    """One call; the answer is written to ``out`` (chunk by chunk when streaming)."""
    import polygate

    async with polygate.session(settings, transport=transport) as session:
        if not stream:
            response = await session.chat(messages, scope=scope)
            out.write(response.text + "\n")
            out.flush()
            return response
        shown = False
        try:
            async with session.stream_chat(messages, scope=scope) as chunks:
                async for chunk in chunks:
                    if chunk.text:
                        out.write(chunk.text)
                        out.flush()
                        shown = True
        except BaseException:
            if shown:  # the answer's line ends; an error's, or Ctrl-C's, starts its own
                out.write("\n")
                out.flush()
            raise
        out.write("\n")
        out.flush()
        return chunks.response


def format_stats(stats: Any, usage: Any, model: str | None) -> str:
    """The call's statistics in a few lines (``CallStats`` fields, milliseconds)."""

    def ms(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:.0f} ms" if value < 1000 else f"{value / 1000:.2f} s"

    waiting = stats.total_latency_ms - stats.generation_ms
    lines = [
        f"call {stats.logical_call_id}: source {stats.source or '-'}"
        + (f", model {printable(model)}" if model else "")  # (the upstream's word)
        + f", {stats.attempts} attempt(s), {stats.hedges} hedge(s)"
        + (" (won by the hedge)" if stats.hedge_won else ""),
        f"  total {ms(stats.total_latency_ms)} = waiting {ms(waiting)} "
        f"+ generation {ms(stats.generation_ms)}",
        f"  time to first token {ms(stats.ttft_ms)}, stalls {ms(stats.stall_ms)} "
        f"in {stats.stall_count if stats.stall_count is not None else '-'}, "
        f"decoding {ms(stats.active_generation_ms)}",
    ]
    if usage is not None:
        lines.append(
            f"  tokens: {usage.prompt_tokens} prompt, {usage.completion_tokens} completion "
            f"({usage.source})"
        )
    return "\n".join(lines)
