"""Settings: frozen attrs classes, validated at construction, secrets never in a repr.

Every validator raises :class:`ConfigError` through :func:`_bad`, which records the
field name on the error (``.field``) so the TOML and environment loaders can re-word
the message with the exact key the user wrote (``POLYGATE__CHAT__A__TIMEOUT_S``,
``scopes.chat.sources.a.timeout_s``).  The loaders build these same classes, so the
three ways of configuring share one validation.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import sys
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import attrs
import httpx

from ._config_serve import (
    HOST_NAME_PROBLEM,
    NAME_RULE,
    Serve,
    ServeKey,
    check_serve_models,
    host_name_ok,
    reduce_read_only,
)
from ._errors import ConfigError, FatalUpstreamError, RateLimitedError, classify_status
from ._paths import file_path_problem, unencoded_problem
from ._secrets import (
    DSN_SECRET_PARAM,
    QUOTE_MAX,
    SECRET_PARAM,
    frameless_on,
    given,
    is_header_safe,
    mask_prefixes,
    url_secrets,
)

__all__ = [
    "ConfigWarning",
    "Hedge",
    "Ocr",
    "Retry",
    "Scope",
    "Settings",
    "Source",
    "StreamWatch",
    "Structured",
    "RESERVED_SEGMENTS",
    "STRUCTURED_OUTPUT_MODES",
    "Serve",
    "ServeKey",
    "mask_url",
]

# Scope-level configuration segments: no source may be named so (the environment keys
# POLYGATE__{SCOPE}__{SOURCE}__… and POLYGATE__{SCOPE}__{SETTING}… would collide).
RESERVED_SEGMENTS = frozenset({
    "HEDGE", "RETRY", "STREAM", "BREAKER", "CALL_DEADLINE_S", "EMBED_BATCH_SIZE",
    "COMPLETION_ESTIMATE_TOKENS", "FALLBACK", "FALLBACK_ON", "STRUCTURED", "OCR", "CACHE_TTL_S",
})
# Reserved for sources only: a scope may be named so ("ocr" is Session.ocr's default
# scope), since a scope name is always the first segment and cannot collide.
_SOURCE_ONLY_RESERVED = frozenset({"STRUCTURED", "OCR"})
# What moves a call to its scope's fallback scope (Scope.fallback_on).
FALLBACK_REASONS = frozenset({
    "exhausted", "rate_limited", "context_length", "content_policy", "fatal",
})
_STATUS_REASON = re.compile(r"status:(4[0-9][0-9])")  # (fullmatch: "$" takes a final line break)
# (Matched with fullmatch: "$" would also take a name that ends in a line break.)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


#: What is wrong with an API key that cannot be an HTTP header value (never the key).
KEY_PROBLEM = (
    "must be printable ASCII without blanks or control characters (a copied key can "
    "carry an invisible character, such as a zero-width space)"
)


class ConfigWarning(UserWarning):
    """A configuration that works but probably does not do what was meant."""


#: Where the configuration's warnings go while a loader or the CLI gathers them (see
#: :func:`gathered_warnings`); None: to Python's warnings, as usual.
_GATHERED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "polygate_config_warnings", default=None
)


#: What a ConfigWarning never points at: the settings' own modules and what builds
#: them (attrs' generated ``__init__`` and ``evolve``, the wrappers of frameless_on),
#: and what reads them for the user (a session, a server opened without settings), so
#: that it points at the user's line however the settings were built (``Source(...)``,
#: ``attrs.evolve``, a loader, ``polygate.session(env=...)``).
_INSIDE = frozenset({
    "polygate._config", "polygate._config_serve", "polygate._config_load", "contextlib",
    "attr._make", "attr._funcs", "attrs", "polygate._secrets", "polygate._session",
    "polygate.serve._server",
})


def config_warning(text: str) -> None:
    """Issue a :class:`ConfigWarning` at the first caller outside the settings' code, or
    hand it to the :func:`gathered_warnings` around this context.  (A fixed
    ``stacklevel`` pointed one frame too far for ``Source(...)``, whose validators
    attrs' ``__init__`` calls directly, and right for ``attrs.evolve``.)"""
    gathered = _GATHERED.get()
    if gathered is not None:
        gathered.append(text)
        return
    frame: types.FrameType | None = sys._getframe(1)
    level = 2  # (warnings.warn's stacklevel for that frame)
    while frame is not None and (
        frame.f_globals.get("__name__") in _INSIDE
        or frame.f_code.co_filename.startswith("<attrs generated")
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, ConfigWarning, stacklevel=level)


@contextlib.contextmanager
def gathered_warnings() -> Iterator[list[str]]:
    """The texts of the ConfigWarnings issued in this context meanwhile, not issued.

    Not ``warnings.catch_warnings(record=True)``: that swaps the process's warning
    filters and its ``showwarning``, and two threads building settings at once (two
    sessions opened without settings, each reading the environment) restore each
    other's: the process was left with an "always" filter in front of the user's own
    and every later warning appended to a dead list.  A context variable is per
    thread and per task."""
    gathered: list[str] = []
    token = _GATHERED.set(gathered)
    try:
        yield gathered
    finally:
        _GATHERED.reset(token)


class FieldError(ConfigError):
    """A ConfigError about one field; ``field`` and ``problem`` let loaders re-word it.
    ``secrets``: what the message must not show, even by coincidence (see
    :func:`polygate._secrets.mask_prefixes`)."""

    def __init__(
        self, owner: str, field: str, problem: str, secrets: tuple[str, ...] = ()
    ) -> None:
        super().__init__(mask_prefixes(f"{owner}.{field}: {problem}", secrets))
        self.owner = owner
        self.field = field
        self.problem = mask_prefixes(problem, secrets)
        self.secrets = secrets

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its parts, not from its message alone, which __init__ does not
        # take: unpicklable, a worker process's ConfigError broke a ProcessPoolExecutor
        # and hung a multiprocessing.Pool's result.  The parts are masked already; the
        # secrets they were masked against stay in this process.
        owner = mask_prefixes(self.owner, self.secrets)  # (the message masks it too)
        state = {k: v for k, v in self.__dict__.items() if k != "secrets"} | {"owner": owner}
        return (type(self), (owner, self.field, self.problem), state)


def _bad(instance: Any, field: str, problem: str, *, url: Any = None) -> FieldError:
    """``url``: the value of a URL field the message is about; no run of its password
    (or of its user:password part) shows in the message."""
    owner = type(instance).__name__
    name = getattr(instance, "name", None) if field != "name" else None
    if isinstance(name, str):
        owner = f"{owner}({name!r})"
    return FieldError(owner, field, problem, url_secrets(url) if isinstance(url, str) else ())


# --------------------------------------------------------------------------- validators


#: A field's unit, told by its name's ending.
_UNITS = (("_ms", " of milliseconds"), ("_s", " of seconds"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    """``math.isfinite`` that answers False for ints too big for a float (10**400)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _positive(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not _is_number(value):
        unit = next((u for end, u in _UNITS if attr.name.endswith(end)), "")
        raise _bad(inst, attr.name, f"expected a number{unit}, got {type(value).__name__}")
    if not _finite(value) or value <= 0:
        raise _bad(inst, attr.name, f"must be a finite number > 0, got {given(value)}")


def _opt_positive(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _positive(inst, attr, value)


def _non_negative(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not _is_number(value) or not _finite(value) or value < 0:
        raise _bad(inst, attr.name, f"must be a finite number >= 0, got {given(value)}")


#: The largest whole number a setting takes (a 64-bit signed integer, as TOML's): no
#: count needs more, and past 4,300 digits Python cannot even show one (the settings'
#: repr, a log line, would raise).
MAX_WHOLE = 2**63 - 1


def _within_64_bits(inst: Any, attr: attrs.Attribute[Any], value: int) -> None:
    if value > MAX_WHOLE:
        raise _bad(inst, attr.name, "must be at most 2**63 - 1 (a 64-bit integer)")


def _pos_int(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(inst, attr.name, f"must be a whole number > 0, got {given(value)}")
    if value <= 0:
        raise _bad(inst, attr.name, f"must be > 0, got {given(value)}")
    _within_64_bits(inst, attr, value)


def _non_negative_int(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(inst, attr.name, f"must be a whole number >= 0, got {given(value)}")
    _within_64_bits(inst, attr, value)


def _opt_pos_int(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _pos_int(inst, attr, value)


def _fraction(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not _is_number(value) or not _finite(value) or not 0 <= value <= 1:
        raise _bad(inst, attr.name, f"must be a number in [0, 1], got {given(value)}")


def _bool(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(inst, attr.name, f"must be true or false, got {given(value)}")


def _opt_str(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        # (Blank is no model, and no prompt: a call's own blank prompt is refused too.)
        raise _bad(inst, attr.name, "must be a non-empty string")
    if not is_utf8(value):
        # A lone surrogate is how Python reads a non-UTF-8 byte of an environment
        # value; it would fail every request, as an upstream error, far from here.
        # (Any other character, a NUL included, is sent escaped in the JSON body.)
        raise _bad(inst, attr.name, "must be text: it holds a lone surrogate "
                   "(a byte that is not UTF-8, e.g. in an environment value)")


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (no lone surrogate).

    ``isascii`` settles nearly every call at memchr speed; otherwise one encode whose
    copy is dropped.  (The session checks messages with it, structured output a
    schema, the settings a model name.)
    """
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def as_utf8(text: str) -> str:
    """``text`` as the UTF-8 its bytes are.  Under a locale that is not UTF-8
    (``LC_ALL=C`` with Python's UTF-8 mode off) Python decodes arguments and the
    environment as ASCII and keeps each other byte as a surrogate escape: ``modèle``
    was refused as "not UTF-8".  Bytes that are not UTF-8 stay escaped (and are
    refused where text must be UTF-8)."""
    if is_utf8(text):
        return text
    try:
        return os.fsencode(text).decode("utf-8")
    except UnicodeError:
        return text


def _secret_repr(value: str | None) -> str:
    return "None" if value is None else "'***'"


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (for reprs, logs and messages):
    the ``user:password@`` part's, and the value of every credential-like query
    parameter (``?password=``, ``sslpassword=``, ``api_key=``, ``token=``...).

    Read from the raw text, not a parser: the credentials are everything between
    ``://`` and the *last* ``@`` (an unencoded ``#``, ``/`` or ``?`` in a password
    would make a parser end them early and show the rest).
    """
    masked = SECRET_PARAM.sub(lambda m: m.group("lead") + "***", _mask_userinfo(url))
    if "=" in masked and "://" not in masked:  # (a libpq key=value string, not a URL)
        masked = DSN_SECRET_PARAM.sub(lambda m: m.group("lead") + "***", masked)
    return masked


_AUTHORITY_AND_PATH = re.compile(r"([^/?#]*)([^?#]*)")  # (it matches any text)


def _credentials_end_in_authority(rest: str) -> bool:
    """Whether the URL's part after ``://`` has its one "@" in the authority and none in
    its path: an "@" after it is then the query's, as written.  (One in the path
    too, "app:p@ss/x@host", reads as a password holding "@" and "/".)"""
    authority, path = _AUTHORITY_AND_PATH.match(rest).groups()  # type: ignore[union-attr]
    return authority.count("@") == 1 and "@" not in path


def _mask_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if sep and _credentials_end_in_authority(rest):
        # The credentials end in the authority; an "@" after it is the query's.
        userinfo, _, tail = rest.partition("@")
        if ":" not in userinfo:
            return url
        return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{tail}"
    head, at, tail = url.rpartition("@")
    if not at:
        try:
            urlsplit(url)
        except ValueError:
            return "<unparseable URL>"
        return url
    scheme, sep, userinfo = head.partition("://")
    if ":" not in (userinfo if sep else head):
        return url  # a user name alone is not a secret
    if sep:
        user = userinfo.split(":", 1)[0]
        if any(c in user for c in "/?#"):
            return f"{scheme}://***@{tail}"
        return f"{scheme}://{user}:***@{tail}"
    return f"***@{tail}"


#: The paths of the endpoints polygate adds to a base URL, and of their neighbours: a
#: base that ends in one is most likely a whole endpoint pasted as the base.
_ENDPOINT_PATHS: Final = ("/chat/completions", "/completions", "/embeddings", "/responses")

#: What a host name a resolver looks up is made of, written in ASCII (IDNA): RFC 1123's
#: letters, digits, '-' and '.', and '_', which DNS carries and Docker's and
#: Kubernetes' service names use.
_NAME_CHARS: Final = re.compile(r"[A-Za-z0-9._-]+")


def _not_in_a_name(host: str) -> str | None:
    """The first character of ``host`` that no host name has; ``None`` when there is
    none, or when ``host`` is an address (IPv6, with its zone: ``fe80::1%25eth0``)."""
    if ":" in host:
        return None  # (urlsplit reads a host with ':' only from brackets: an IPv6 address)
    written = host.encode("idna").decode("ascii")  # (host_name_ok has read it so)
    if _NAME_CHARS.fullmatch(written):
        return None
    return next(c for c in written if not _NAME_CHARS.fullmatch(c))


_BAD_URL = (
    "is not a valid URL (bad port, or an unencoded '#', '/', '?' or '@' in the "
    "user:password part; percent-encode it)"
)


#: What a URL starts with: a scheme (at most 20 characters) and "://" (a key that
#: merely holds "://" is none).
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,19}://")


def shown(value: str) -> str:
    """``value`` for a message about a field that wants a URL or a name: a URL masked,
    anything else quoted only when it is short."""
    if _URL_START.match(value) or len(value) <= QUOTE_MAX:
        return repr(mask_url(value))
    return f"a value of {len(value)} characters (not shown: a key pasted here?)"


def _url_problem(value: str) -> str | None:
    """What makes ``value`` unusable as written, in words that never quote it."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "must not contain blanks or control characters"
    if not is_utf8(value):  # a non-UTF-8 byte of an environment value: no client sends it
        return "must be UTF-8 text (it holds a byte that is not)"
    rest = value.partition("://")[2]
    authority = _AUTHORITY_AND_PATH.match(rest)[1]  # type: ignore[index]  # (matches any text)
    if authority.count("@") > 1:
        # "user:pa@ss@host": polygate reads the credentials up to the last "@", libpq up
        # to the first, and then sends "pa" as the password and quotes "ss@host" as the
        # host it cannot resolve, in errors that reach the logs.
        return _BAD_URL
    if _credentials_end_in_authority(rest):
        return None  # an "@" after them is the query's
    # "user:pa/ss@host": a parser ends the authority at the "/" and reads "pa" as
    # the port of host "user" -- the key would go there.  ("host:8080/v1?x=a@b" reads
    # the same way, and is refused with it: which one was meant cannot be told.)
    userinfo = value.rpartition("@")[0].partition("://")[2]
    if ":" in userinfo and any(c in userinfo for c in "/?#"):
        return _BAD_URL
    return None


# --------------------------------------------------------------------------- classes


@attrs.frozen
class Source:
    """One OpenAI-compatible upstream.

    ``timeout_s`` bounds a whole attempt; ``ttft_timeout_s`` the wait for its first
    content token.  ``rpm``/``tpm`` are quotas in any rolling 60 s window;
    ``max_in_flight`` caps concurrent attempts; ``weight`` biases picking;
    ``streaming=False`` says the upstream cannot stream.  ``structured_output`` is
    how a ``schema=`` call asks this source for JSON: ``"json_schema"`` (a
    ``response_format`` of that type), ``"json_object"`` (``{"type": "json_object"}``
    plus the schema in a system instruction) or ``"prompt"`` (the instruction alone,
    for upstreams that reject ``response_format``).  See ``docs/structured.md``.
    """

    name: str = attrs.field()
    base_url: str = attrs.field(repr=lambda v: repr(mask_url(v)))
    api_key: str | None = attrs.field(default=None, repr=_secret_repr)
    model: str | None = attrs.field(default=None, validator=_opt_str)
    timeout_s: float = attrs.field(default=300, validator=_positive)
    ttft_timeout_s: float | None = attrs.field(default=None, validator=_opt_positive)
    rpm: int | None = attrs.field(default=None, validator=_opt_pos_int)
    tpm: int | None = attrs.field(default=None, validator=_opt_pos_int)
    max_in_flight: int | None = attrs.field(default=None, validator=_opt_pos_int)
    weight: float = attrs.field(default=1.0, validator=_positive)
    streaming: bool = attrs.field(default=True, validator=_bool)
    # The upstream continues a trailing assistant message (vLLM's
    # continue_final_message): a resumed stream continues from the delivered text.
    prefill: bool = attrs.field(default=False, validator=_bool)
    structured_output: str = attrs.field(default="json_schema")

    @name.validator
    def _check_name(self, attr: attrs.Attribute[str], value: Any) -> None:
        if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or "__" in value:
            raise _bad(self, "name", f"{NAME_RULE}, got {given(value)}")
        if value.upper() in RESERVED_SEGMENTS:
            raise _bad(self, "name", f"{value!r} is a reserved configuration segment")

    @base_url.validator
    def _check_url(self, attr: attrs.Attribute[str], value: Any) -> None:
        """An http(s) URL the session can use exactly as written.

        Refused: blanks and control characters (a parser drops some silently), a
        query or fragment (``/chat/completions`` is appended to the path, so they
        would change the path), and ``user:password@`` (polygate authenticates with
        ``api_key`` as a Bearer token and would never send them).
        """
        if not isinstance(value, str):
            raise _bad(self, "base_url", url=value, problem=f"must be a string, got {type(value).__name__}")
        problem = _url_problem(value)
        if problem is not None:
            raise _bad(self, "base_url", url=value, problem=problem)
        try:
            parts = urlsplit(value)
            port = parts.port  # raises ValueError on a bad port
        except ValueError:
            raise _bad(self, "base_url", url=value, problem=_BAD_URL) from None
        if port == 0:
            raise _bad(self, "base_url", url=value, problem="port 0 cannot be connected to")
        if "@" in parts.netloc:
            raise _bad(self, "base_url", url=value, problem=
                "must not carry credentials before the host ('…@host'): they are never "
                "sent (the key goes in api_key)",
            )
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # Quoted up to its query at most: a key may ride there (refused below anyway).
            head = re.split(r"[?#]", value, maxsplit=1)[0]
            more = "…" if "?" in value or "#" in value else ""
            got = repr(mask_url(head) + more) if "://" in head else shown(head + more)
            raise _bad(self, "base_url", url=value, problem=
                f"must be an absolute http:// or https:// URL, got {got}",
            )
        if "?" in value or "#" in value:
            raise _bad(self, "base_url", url=value, problem=
                "must not have a query or a fragment ('?', '#'): the request path is the "
                "base URL followed by /chat/completions",
            )
        if not host_name_ok(parts.hostname):
            # Otherwise valid, and every call failed on it as "a malformed upstream
            # body (UnicodeError)", retried, though no upstream ever answered.  Asked
            # first: httpx refuses some such names too, and its refusal was reported
            # as a bad port or credentials.
            raise _bad(self, "base_url", url=value, problem=HOST_NAME_PROBLEM)
        odd = _not_in_a_name(parts.hostname)
        if odd is not None:
            # IDNA lets '$', '{', ';', ',', '%' and the like through, which no resolver
            # looks up: a TOML file's "http://${VLLM_HOST}:8000/v1" (a template left
            # unexpanded), "127.0.0.1;8000" were valid, and every call failed "Name or
            # service not known", retried.  (The character shown, not the URL.)
            raise _bad(self, "base_url", url=value, problem=
                f"its host has {odd!r}, which no host name has (a name is letters, digits, "
                "'-', '_' and '.'; polygate expands no '${VAR}' in a URL)",
            )
        try:
            httpx.URL(value + "/chat/completions")
        except (httpx.InvalidURL, ValueError) as exc:
            # (httpx reads a name by IDNA 2003 without mapping: a fullwidth letter
            # trio would map is refused there, and so here, as a name.)
            problem = HOST_NAME_PROBLEM if "IDNA" in str(exc) else _BAD_URL
            raise _bad(self, "base_url", url=value, problem=problem) from None
        path = parts.path.rstrip("/").lower()
        ending = next((e for e in _ENDPOINT_PATHS if path.endswith(e)), None)
        if ending is not None:
            # The whole endpoint pasted where its base goes (the openai SDK takes it
            # too): every request went to ".../chat/completions/chat/completions", and
            # an upstream's 404 there marked the source dead.  Warned, not refused: a
            # base may end so by chance.
            config_warning(
                f"Source({self.name!r}).base_url ends in {ending!r}, an endpoint: polygate "
                f"adds the endpoint to the base, so chat requests go to "
                f"'…{ending}/chat/completions'; give the base, as 'https://host/v1'"
            )

    @api_key.validator
    def _check_key(self, attr: attrs.Attribute[str | None], value: Any) -> None:
        # The key itself is never echoed, whatever is wrong with it.
        if value is not None and (not isinstance(value, str) or not value):
            raise _bad(self, "api_key", "must be a non-empty string")
        if isinstance(value, str) and ("\r" in value or "\n" in value):
            # A line break could end the header and start another: never accepted.
            raise _bad(self, "api_key", f"must not contain line breaks; it {KEY_PROBLEM}")
        if isinstance(value, str) and not is_header_safe(value):
            # From a file or the environment this is a ConfigError (the loaders and
            # check-config refuse it).  Built here, it is a warning at once, and every
            # call to the source fails as SourceDeadError, typed and redacted, while
            # the other sources carry on.
            config_warning(
                f"Source({self.name!r}).api_key: {KEY_PROBLEM}; every call to this "
                "source fails until it is fixed"
            )

    @structured_output.validator
    def _check_structured(self, attr: attrs.Attribute[str], value: Any) -> None:
        if value not in STRUCTURED_OUTPUT_MODES:
            modes = ", ".join(repr(m) for m in STRUCTURED_OUTPUT_MODES)
            raise _bad(self, "structured_output", f"must be one of {modes}, got {given(value)}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/")


STRUCTURED_OUTPUT_MODES = ("json_schema", "json_object", "prompt")


@attrs.frozen
class Hedge:
    """When to send a second copy of a slow call to another source (off by default)."""

    after_s: float | None = attrs.field(default=None, validator=_opt_positive)
    max_extra: int = attrs.field(default=1)
    stall_after_s: float | None = attrs.field(default=None, validator=_opt_positive)
    budget_ratio: float = attrs.field(default=0.1, validator=_fraction)
    budget_burst: float = attrs.field(default=10, validator=_positive)
    after_quantile: float | None = attrs.field(default=None)
    min_after_s: float | None = attrs.field(default=None, validator=_opt_positive)
    max_after_s: float | None = attrs.field(default=None, validator=_opt_positive)

    @max_extra.validator
    def _check_extra(self, attr: attrs.Attribute[int], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 3:
            raise _bad(self, "max_extra", f"must be a whole number in [1, 3], got {given(value)}")

    @after_quantile.validator
    def _check_q(self, attr: attrs.Attribute[float | None], value: Any) -> None:
        if value is None:
            return
        if not _is_number(value) or not _finite(value) or not 0 < value < 1:
            raise _bad(self, "after_quantile", f"must be a number in (0, 1), got {given(value)}")

    def __attrs_post_init__(self) -> None:
        lo, hi = self.min_after_s, self.max_after_s
        if lo is not None and hi is not None and lo > hi:
            raise _bad(self, "min_after_s", f"({lo}) must not exceed max_after_s ({hi})")

    @property
    def enabled(self) -> bool:
        return self.after_s is not None or self.after_quantile is not None

    @property
    def first_threshold_s(self) -> float | None:
        """The static part of the trigger: ``after_s``, else the adaptive trigger's
        upper bound (the clamps bound only a learnt trigger)."""
        if self.after_s is not None:
            return self.after_s
        return self.max_after_s if self.after_quantile is not None else None


@attrs.frozen
class Retry:
    """Retry budget and backoff (exponential, full jitter)."""

    max_attempts: int = attrs.field(default=3, validator=_pos_int)
    backoff_base_s: float = attrs.field(default=0.25, validator=_non_negative)
    backoff_max_s: float = attrs.field(default=8.0, validator=_non_negative)
    rate_limit_wait_s: float = attrs.field(default=60, validator=_non_negative)
    # 0: fail over at once (the sources of a scope are equivalent, another one is the
    # fastest answer).  N: after a transient failure or a 429, retry the same source up
    # to N times first (waiting out its Retry-After), then fail over — for a scope whose
    # fallback is costlier or weaker.
    same_source_retries: int = attrs.field(default=0, validator=_non_negative_int)

    def __attrs_post_init__(self) -> None:
        if self.backoff_max_s < self.backoff_base_s:
            default_max = attrs.fields(Retry).backoff_max_s.default
            if self.backoff_max_s == default_max:
                # Only the base was set (past the default cap): name the key written.
                raise _bad(
                    self, "backoff_base_s",
                    f"({self.backoff_base_s}) must be <= backoff_max_s ({self.backoff_max_s}, "
                    "the default: set it too)",
                )
            raise _bad(
                self, "backoff_max_s",
                f"({self.backoff_max_s}) must be >= backoff_base_s ({self.backoff_base_s})",
            )


@attrs.frozen
class StreamWatch:
    """Silence watchdog inside streams, and what counts as a stall in the statistics."""

    stall_timeout_s: float | None = attrs.field(default=None, validator=_opt_positive)
    stall_threshold_ms: float = attrs.field(default=2000, validator=_positive)
    # A committed stream_chat() whose path fails (cut, stalled, malformed, an error
    # event) continues the same answer on another source instead of failing.
    resume: bool = attrs.field(default=False, validator=_bool)
    max_resumes: int = attrs.field(default=2, validator=_non_negative_int)


@attrs.frozen
class Breaker:
    """Each source's circuit breaker.  Opens after ``failures`` consecutive failures, or,
    with a ``failure_rate`` (``None``, the default: no such rule), when at least
    ``rate_min_calls`` of the last ``rate_window`` outcomes include a share of failures
    over it.  It stays open ``open_s``, then half-opens: one
    probe at a time, and ``probes`` successes in a row close it.  A failed probe opens it
    again for twice as long as the time before, jittered (× 0.5–1), up to
    ``max_open_s`` (``None``: ``open_s``: no backoff, and no jitter, every opening lasts
    ``open_s``).  The defaults, 5 failures and 30 s, then one probe, give an outage a
    probe every 30 s and a recovered source traffic within ``open_s`` plus the time until
    its next request."""

    failures: int = attrs.field(default=5, validator=_pos_int)
    failure_rate: float | None = attrs.field(default=None)
    rate_window: int = attrs.field(default=20, validator=_pos_int)
    rate_min_calls: int = attrs.field(default=10, validator=_pos_int)
    open_s: float = attrs.field(default=30.0, validator=_positive)
    max_open_s: float | None = attrs.field(default=None, validator=_opt_positive)
    probes: int = attrs.field(default=1, validator=_pos_int)

    @failure_rate.validator
    def _check_rate(self, attr: attrs.Attribute[float | None], value: Any) -> None:
        if value is None:
            return
        if not _is_number(value) or not _finite(value) or not 0 < value <= 1:
            raise _bad(self, "failure_rate", f"must be a number in (0, 1] or None, got {given(value)}")

    def __attrs_post_init__(self) -> None:
        if self.max_open_s is not None and self.max_open_s < self.open_s:
            raise _bad(
                self, "max_open_s", f"({self.max_open_s}) must be >= open_s ({self.open_s})"
            )
        if self.failure_rate is not None and self.rate_min_calls > self.rate_window:
            # Only the last rate_window outcomes are kept: the rule could never trip.
            if self.rate_min_calls == attrs.fields(Breaker).rate_min_calls.default:
                # Only the window was set (under the default minimum): name the key written.
                raise _bad(
                    self, "rate_window",
                    f"({self.rate_window}) must be >= rate_min_calls ({self.rate_min_calls}, "
                    "which is also its default: raise rate_window or lower rate_min_calls) "
                    "when failure_rate is set: only the last rate_window outcomes are kept",
                )
            raise _bad(
                self, "rate_min_calls",
                f"({self.rate_min_calls}) must be <= rate_window ({self.rate_window}) "
                "when failure_rate is set: only the last rate_window outcomes are kept",
            )


def _to_tuple(value: Sequence[str] | AbstractSet[str]) -> Any:
    # (Typed for a type checker's sake, as __init__ takes it; anything else is refused
    # by the validator, with a message.)
    if isinstance(value, (frozenset, set)):
        # (A set has no order; its iteration order is the hash seed's, and would make
        # a Scope's repr, equality and hash differ from one process to the next.  One
        # that is not all strings is the validator's to refuse, as it is.)
        return tuple(sorted(value)) if all(type(v) is str for v in value) else tuple(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def _reasks(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10:
        raise _bad(inst, attr.name, f"must be a whole number in [0, 10], got {given(value)}")


@attrs.frozen
class Structured:
    """Structured output (``chat(..., schema=...)``): how many times an answer that is
    not valid JSON for the schema is re-asked inside the same call (0: never)."""

    max_reasks: int = attrs.field(default=2, validator=_reasks)


def _in_range(lo: float, hi: float, whole: bool) -> Any:
    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        kind = "whole number" if whole else "number"
        ok = (isinstance(value, int) if whole else _is_number(value)) and not isinstance(value, bool)
        if not ok or not _finite(value) or not lo <= value <= hi:
            raise _bad(inst, attr.name, f"must be a {kind} in [{lo:g}, {hi:g}], got {given(value)}")

    return check


#: The largest document OCR takes (``Ocr.max_document_bytes``): PDFium loads from
#: memory with a C ``int`` size, and a renderer's frames carry 32-bit lengths.
MAX_OCR_DOCUMENT_BYTES: Final = 2**31 - 1
#: The longest OCR prompt, in characters: it rides with every page to a renderer, in
#: a request header of at most 1 MiB (four bytes a character at most).
MAX_OCR_PROMPT_CHARS: Final = 200_000


def _document_cap(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    _pos_int(inst, attr, value)
    if value > MAX_OCR_DOCUMENT_BYTES:
        raise _bad(inst, attr.name, f"must be at most {MAX_OCR_DOCUMENT_BYTES:,} (2 GiB - 1), "
                                    f"got {given(value)}")


def _ocr_prompt(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    _opt_str(inst, attr, value)
    if value is not None and len(value) > MAX_OCR_PROMPT_CHARS:
        raise _bad(inst, attr.name, f"must be at most {MAX_OCR_PROMPT_CHARS:,} characters, "
                                    f"got {len(value):,}")


@attrs.frozen
class Ocr:
    """OCR calls (``Session.ocr``): how documents become page images.

    PDF pages are rendered at ``dpi`` and, like input images, scaled down (aspect
    ratio kept) so that their longer side is at most ``max_side_px``; an input PNG or
    JPEG within that size is sent unaltered; any image polygate encodes is
    ``image_format`` (``"jpeg"``, quality 90, or ``"png"``).  A document over
    ``max_document_bytes`` is refused; at most ``max_concurrent_pages`` pages are
    rendered and in flight at once; ``prompt`` replaces the default transcription
    prompt for this scope.  PDF pages are rendered in renderer processes
    (``render_in="process"``, at most one per CPU, kept by the session) so that no
    rendering holds the event loop's GIL, or in worker threads of this process
    (``"thread"``: frozen applications, sandboxes that forbid starting
    ``sys.executable``).
    """

    dpi: float = attrs.field(default=150.0, validator=_in_range(18, 1200, whole=False))
    max_side_px: int = attrs.field(default=2048, validator=_in_range(64, 8192, whole=True))
    max_document_bytes: int = attrs.field(default=50 * 1024 * 1024, validator=_document_cap)
    max_concurrent_pages: int = attrs.field(default=4, validator=_in_range(1, 64, whole=True))
    prompt: str | None = attrs.field(default=None, validator=_ocr_prompt)
    image_format: str = attrs.field(default="jpeg")
    render_in: str = attrs.field(default="process")

    @image_format.validator
    def _check_format(self, attr: attrs.Attribute[str], value: Any) -> None:
        if value not in ("jpeg", "png"):
            raise _bad(self, "image_format", f"must be 'jpeg' or 'png', got {given(value)}")

    @render_in.validator
    def _check_render_in(self, attr: attrs.Attribute[str], value: Any) -> None:
        if value not in ("process", "thread"):
            raise _bad(self, "render_in", f"must be 'process' or 'thread', got {given(value)}")


def _to_sources(value: Sequence[Source]) -> Any:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return value


@attrs.frozen
class Scope:
    """A named group of equivalent sources and the policies of calls made to it."""

    sources: tuple[Source, ...] = attrs.field(converter=_to_sources)
    hedge: Hedge = attrs.field(factory=Hedge)
    retry: Retry = attrs.field(factory=Retry)
    stream: StreamWatch = attrs.field(factory=StreamWatch)
    call_deadline_s: float | None = attrs.field(default=None, validator=_opt_positive)
    breaker: Breaker = attrs.field(factory=Breaker)
    embed_batch_size: int = attrs.field(default=256, validator=_pos_int)
    completion_estimate_tokens: int = attrs.field(default=256, validator=_pos_int)
    structured: Structured = attrs.field(factory=Structured)
    ocr: Ocr = attrs.field(factory=Ocr)
    # The scope a call moves to, inside the same logical call and deadline, when this
    # one fails for one of the ``fallback_on`` reasons; fallbacks chain.
    fallback: str | None = attrs.field(default=None)
    fallback_on: tuple[str, ...] = attrs.field(
        default=("exhausted", "context_length"), converter=_to_tuple
    )
    # None: this scope never caches (docs/cache.md); otherwise answers live this long.
    cache_ttl_s: float | None = attrs.field(default=None, validator=_opt_positive)

    @fallback.validator
    def _check_fallback(self, attr: attrs.Attribute[str | None], value: Any) -> None:
        if value is not None and (not isinstance(value, str) or not _NAME_RE.fullmatch(value)):
            got = shown(value) if isinstance(value, str) else type(value).__name__
            raise _bad(self, "fallback", f"must be a scope name, got {got}")

    @fallback_on.validator
    def _check_fallback_on(self, attr: attrs.Attribute[tuple[str, ...]], value: Any) -> None:
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise _bad(self, "fallback_on", "must be a list of reasons")
        for reason in value:
            if reason not in FALLBACK_REASONS and not _STATUS_REASON.fullmatch(reason):
                known = ", ".join(sorted(FALLBACK_REASONS))
                raise _bad(
                    self, "fallback_on",
                    f"unknown reason {given(reason)} (known: {known}, or status:4NN)",
                )
            status = _STATUS_REASON.fullmatch(reason)
            if status is None:
                continue
            # A status the taxonomy never makes a fatal error (a 429, 401/402/403/404/407,
            # 408/409/425): the reason could never fire; say which one covers it.
            error = classify_status(int(status.group(1)), "")
            if not isinstance(error, FatalUpstreamError):
                instead = "rate_limited" if isinstance(error, RateLimitedError) else "exhausted"
                raise _bad(
                    self, "fallback_on",
                    f"{reason!r} never moves a call: that status is not a fatal error "
                    f"(use {instead!r})",
                )

    @sources.validator
    def _check_sources(self, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, tuple) or not value:
            raise _bad(self, "sources", "must be a non-empty list of Source")
        seen: set[str] = set()
        for source in value:
            if not isinstance(source, Source):
                raise _bad(self, "sources", f"must hold Source objects, got {type(source).__name__}")
            if source.name in seen:
                raise _bad(self, "sources", f"source name {source.name!r} appears twice")
            seen.add(source.name)

    def __attrs_post_init__(self) -> None:
        groups = (
            ("hedge", Hedge), ("retry", Retry), ("stream", StreamWatch), ("breaker", Breaker),
            ("structured", Structured), ("ocr", Ocr),
        )
        for name, cls in groups:
            if not isinstance(getattr(self, name), cls):
                raise _bad(self, name, f"must be a {cls.__name__}")
        check_hedge_assembly(self)

    def source(self, name: str) -> Source:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)


def check_hedge_assembly(scope: Scope) -> None:
    """The assembly guards: impossible hedges are errors, dubious ones warn
    (``docs/configuration.md``, "Assembly guards")."""
    hedge = scope.hedge
    after = hedge.first_threshold_s
    if after is not None:
        _check_hedge_threshold(scope, after, "after_s" if hedge.after_s is not None else "max_after_s")
    if hedge.after_quantile is not None and hedge.min_after_s is not None:
        # Once learnt, the trigger is never below min_after_s: past every timeout, the
        # adaptive hedge could never fire, whatever fires before the sketch is warm.
        _check_hedge_threshold(scope, hedge.min_after_s, "min_after_s")
    if hedge.after_quantile is None and (hedge.min_after_s, hedge.max_after_s) != (None, None):
        # They clamp the learnt trigger, and nothing is learnt without a quantile:
        # "hedge between 2 and 10 s" would silently be "never hedge".
        names = [f"hedge.{n}" for n in ("min_after_s", "max_after_s") if getattr(hedge, n) is not None]
        effect = "the trigger is after_s" if hedge.enabled else "hedging is off"
        config_warning(
            f"{' and '.join(names)} bound only a learnt trigger, and nothing is learnt "
            f"without after_quantile: {effect}"
        )
    if hedge.stall_after_s is not None and not hedge.enabled:
        # (b), the mid-stream trigger, runs inside a hedging round; without (a) no round
        # hedges, so the setting alone would silently do nothing.
        config_warning(
            "hedge.stall_after_s does nothing without after_s or after_quantile: "
            "hedging is off until one of them is set"
        )
    if hedge.enabled and len(scope.sources) < 2:
        # Checked even for adaptive-only hedging (after_quantile without a static bound).
        config_warning(
            "hedging is configured on a scope with a single source: it will never fire"
        )


def _check_hedge_threshold(scope: Scope, after: float, label: str, *, warn: bool = True) -> None:
    min_timeout = min(s.timeout_s for s in scope.sources)
    if after >= min_timeout:
        raise FieldError(
            "Scope", f"hedge.{label}",
            f"({after}) must be below the smallest source timeout_s ({min_timeout}): "
            "the attempt would time out before the hedge could fire",
        )
    if scope.call_deadline_s is not None and after >= scope.call_deadline_s:
        raise FieldError(
            "Scope", f"hedge.{label}",
            f"({after}) must be below call_deadline_s ({scope.call_deadline_s}): "
            "the call would end before the hedge could fire",
        )
    ttfts = [s.ttft_timeout_s for s in scope.sources if s.ttft_timeout_s is not None]
    if warn and ttfts and after >= min(ttfts):
        config_warning(
            f"hedge.{label} ({after}) >= the smallest ttft_timeout_s ({min(ttfts)}): "
            "that source times out before a hedge fires"
        )


def _check_backend(inst: Any, attr: attrs.Attribute[str], value: Any) -> None:
    if not isinstance(value, str):
        raise _bad(inst, attr.name, url=value, problem="must be a string")
    if value == "memory":
        return
    parts = _split_url(inst, attr.name, value)
    if parts.fragment:
        raise _bad(inst, attr.name, url=value, problem=_BAD_URL)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise _bad(inst, attr.name, url=value, problem=
            f"must be 'memory' or a redis://host:port/db URL, got {shown(value)}",
        )
    # Its options too, here rather than at session start: the loaders then name the
    # key or TOML path that set it (SPEC §2), as they do for the cache's URL.
    from .governance._redis import parse_redis_url  # lazy: it imports mask_url from here

    try:
        parse_redis_url(value)
    except ConfigError as exc:
        raise _bad(inst, attr.name, url=value, problem=str(exc).removeprefix("backend: ")) from None


def _check_telemetry(inst: Any, attr: attrs.Attribute[str], value: Any) -> None:
    if not isinstance(value, str):
        raise _bad(inst, attr.name, url=value, problem="must be a string")
    if value == "off":
        return
    # (No port check for PostgreSQL: libpq's multi-host form, postgresql://h1:1,h2:2/db,
    # is no port urlsplit can read.)
    parts = _split_url(inst, attr.name, value, port=not value.startswith(("postgresql:", "postgres:")))
    if parts.scheme == "sqlite":
        if not value.startswith("sqlite:///") and value != "sqlite://":
            raise _bad(inst, attr.name, url=value, problem="a SQLite URL is sqlite:///path/to/file.db")
        problem = (unencoded_problem(value, options=False)
                   or file_path_problem(unquote(parts.path)))
        if problem is not None:
            raise _bad(inst, attr.name, url=value, problem=problem)
        return
    if parts.scheme in ("postgresql", "postgres"):
        # Handed to libpq as it is: no host in the authority is its default (the local
        # socket), and a host may come as a parameter (postgresql:///db?host=/run/pg).
        if parts.fragment:
            raise _bad(inst, attr.name, url=value, problem=_BAD_URL)
        problem = _libpq_problem(value)
        if problem is None and not all(_port_ok(host) for host in parts.netloc.rpartition("@")[2].split(",")):
            problem = _BAD_URL
        if problem is not None:
            raise _bad(inst, attr.name, url=value, problem=problem)
        return
    raise _bad(inst, attr.name, url=value, problem=
        f"must be 'off', sqlite:///path or postgresql://…, got {shown(value)}",
    )


def _port_ok(host: str) -> bool:
    """Whether ``host`` (``name``, ``name:port``, ``[v6]:port``) has no port or a number."""
    port = host.rpartition("]")[2] if host.startswith("[") else host
    _, colon, number = port.rpartition(":")
    return not colon or (number.isascii() and number.isdigit() and int(number) <= 65535)


def _libpq_problem(value: str) -> str | None:
    """What libpq cannot read in a PostgreSQL URL (a misspelt parameter, a bad
    percent-escape), read as libpq reads it, in words that never quote the URL.
    Without psycopg (the postgres extra) nothing is checked here: the session says
    it is missing when it starts."""
    try:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return None
    try:
        conninfo_to_dict(value)
    except (psycopg.ProgrammingError, ValueError) as exc:
        # (ValueError: a percent-escape that decodes to no UTF-8, a UnicodeDecodeError.)
        unknown = re.search(r'invalid URI query parameter: "([A-Za-z_]{1,40})"', str(exc))
        if unknown:
            return f"holds a parameter libpq does not know: {unknown[1]!r}"
        # (libpq's text can quote a part of the password: "invalid percent-encoded
        # token: …".)
        return "cannot be read by libpq (a malformed part, or a bad percent-escape)"
    return None


def _check_cache(inst: Any, attr: attrs.Attribute[str], value: Any) -> None:
    from .cache._url import parse_cache_url  # lazy: it imports mask_url from here

    try:
        parse_cache_url(value)
    except ConfigError as exc:
        raise _bad(inst, attr.name, url=value, problem=str(exc)) from None


def _split_url(inst: Any, field: str, value: str, *, port: bool = True) -> Any:
    """urlsplit, with messages that never quote the URL (a parser's error text can
    hold part of a password)."""
    if not value.startswith("sqlite:"):
        problem = _url_problem(value)
        if problem is not None:
            raise _bad(inst, field, url=value, problem=problem)
    try:
        parts = urlsplit(value)
        if port:
            parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise _bad(inst, field, url=value, problem=_BAD_URL) from None
    return parts


def _to_scopes(value: Mapping[str, Scope]) -> Any:
    # Read-only: the scopes were validated once and must stay as validated.
    if isinstance(value, Mapping):
        return MappingProxyType(dict(value))
    return value


def field_segments(field: str) -> list[str]:
    """A FieldError's ``field`` as its keys.  A scope's name may hold a "." (``qwen2.5``):
    in ``scopes.NAME.fallback`` the name is everything between the first and the last;
    so may a gateway key's (``team.a``), in ``[serve.]keys.NAME.FIELD``."""
    if field.startswith("scopes.") and field.endswith(".fallback"):
        return ["scopes", field[len("scopes."):-len(".fallback")], "fallback"]
    for prefix in ("serve.keys.", "keys."):
        if field.startswith(prefix):
            name, _, last = field[len(prefix):].rpartition(".")
            if name:
                return [*prefix[:-1].split("."), name, last]
    return field.split(".")


def _check_fallback_chains(inst: Any, scopes: Mapping[str, Scope]) -> None:
    """Every fallback names a configured scope, and no chain comes back on itself."""
    for name, scope in scopes.items():
        seen = [name]
        target = scope.fallback
        while target is not None:
            if target not in scopes:
                known = ", ".join(sorted(scopes))
                raise _bad(
                    inst, f"scopes.{seen[-1]}.fallback",
                    f"scope {seen[-1]!r} falls back to {shown(target)}, which is not a scope "
                    f"(configured: {known})",
                )
            if target in seen:
                chain = " -> ".join([*seen, target])
                raise _bad(inst, f"scopes.{name}.fallback", f"fallback chain loops: {chain}")
            seen.append(target)
            target = scopes[target].fallback


@attrs.frozen(hash=False)
class Settings:
    """Everything a session needs: scopes of sources, the governance backend, telemetry.

    ``max_body_bytes`` caps a non-streamed body (and a whole stream);
    ``max_line_bytes`` caps one SSE line.  Both guard memory against a broken upstream.
    """

    scopes: Mapping[str, Scope] = attrs.field(
        converter=_to_scopes, repr=lambda v: repr(dict(v)) if isinstance(v, Mapping) else repr(v)
    )
    backend: str = attrs.field(default="memory", repr=lambda v: repr(mask_url(v)), validator=_check_backend)
    telemetry: str = attrs.field(default="off", repr=lambda v: repr(mask_url(v)), validator=_check_telemetry)
    max_body_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=_pos_int)
    max_line_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_pos_int)
    dead_cooldown_s: float = attrs.field(default=300.0, validator=_positive)
    log_content: bool = attrs.field(default=False, validator=_bool)
    # The telemetry pipeline's bounds: rows queued between calls and the sink (a full
    # queue drops rows, never delays a call), rows per write, and how long one write
    # and the final flush at close may take (real seconds).
    telemetry_queue: int = attrs.field(default=10_000, validator=_pos_int)
    telemetry_batch: int = attrs.field(default=5_000, validator=_pos_int)
    telemetry_write_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    telemetry_close_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    # "off" | "memory" | "sqlite:///path" | "redis://…" (docs/cache.md)
    cache: str = attrs.field(default="off", repr=lambda v: repr(mask_url(v)), validator=_check_cache)
    # The gateway server's settings (polygate serve); unused by the library itself.
    serve: Serve = attrs.field(factory=Serve)

    __reduce__ = reduce_read_only  # (pickle and deepcopy: a spawn worker's settings)

    @scopes.validator
    def _check_scopes(self, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, Mapping) or not value:
            raise _bad(self, "scopes", "must be a non-empty mapping of scope name to Scope")
        for name, scope in value.items():
            if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or "__" in name:
                # (Its path names it only where a message may quote it: see given.)
                named = isinstance(name, str) and "." not in name and len(name) <= QUOTE_MAX
                field = f"scopes.{name}" if named else "scopes"
                raise _bad(self, field, f"scope name {given(name)} {NAME_RULE}")
            reserved = (RESERVED_SEGMENTS - _SOURCE_ONLY_RESERVED) | {"BACKEND", "TELEMETRY", "CACHE", "SERVE"}
            if name.upper() in reserved:
                raise _bad(self, f"scopes.{name}", f"scope name {name!r} is reserved")
            if not isinstance(scope, Scope):
                raise _bad(self, "scopes", f"scope {name!r} must be a Scope, got {type(scope).__name__}")
        _check_fallback_chains(self, value)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.serve, Serve):
            raise _bad(self, "serve", f"must be a Serve, got {type(self.serve).__name__}")
        check_serve_models(self.serve, self.scopes)

    @classmethod
    @frameless_on(ConfigError)
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``POLYGATE__…`` keys (default: ``os.environ``)."""
        from ._config_load import settings_from_env

        return settings_from_env(env)

    @classmethod
    @frameless_on(ConfigError)
    def from_toml(cls, path: str | os.PathLike[str]) -> Settings:
        """Build settings from a TOML file (same validation as the other two ways)."""
        from ._config_load import settings_from_toml

        return settings_from_toml(path)

    def scope(self, name: str) -> Scope:
        try:
            return self.scopes[name]
        except KeyError:
            known = ", ".join(sorted(self.scopes)) or "none"
            raise ConfigError(f"unknown scope {name!r} (configured: {known})") from None

    def secrets(self) -> tuple[str, ...]:
        """Every secret in these settings, for redaction of upstream text."""
        found = [s.api_key for scope in self.scopes.values() for s in scope.sources if s.api_key]
        found += self.serve.api_keys
        found += [k.key for k in self.serve.keys.values()]
        for url in (self.backend, self.telemetry, self.cache):
            found += url_secrets(url)
        return tuple(dict.fromkeys(found))


# A construction that fails raises from frames that hold every argument as given (attrs'
# __init__, the validators'): API keys (a Scope's sources written as dicts, too), and
# URLs with their passwords beside the field that was wrong.  Raised from above them
# instead (see frameless_on).
for _holder in (Source, Scope, Settings):
    setattr(_holder, "__init__", frameless_on(ConfigError)(_holder.__init__))  # noqa: B010
