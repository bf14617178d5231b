"""``Settings.serve``: the gateway server's own settings (``polygate serve``, SPEC §8.5).

Kept apart from :mod:`polygate._config` so that the server's knobs do not crowd the
library's; :class:`Serve` uses the same validators, so a wrong value is a
:class:`ConfigError` naming the field (and, through the loaders, the TOML path or
environment key).  A gateway key is never shown: not in a repr, not in a message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from ._errors import ConfigError
from ._secrets import frameless_on, given

__all__ = [
    "HOST_NAME_PROBLEM", "Serve", "ServeKey", "check_serve_models", "host_name_ok",
    "reduce_read_only",
]

HOST_NAME_PROBLEM = (
    "its host is not a name that can be looked up: an empty label ('a..b', '.a'), one "
    "over 63 characters, or characters IDNA does not allow in a name"
)


def host_name_ok(host: str) -> bool:
    """Whether ``host`` can be looked up at all: the system's resolver is asked through
    Python's IDNA codec, which refuses an empty label or one over 63 characters (an
    address always passes).  Checked in the settings, not met as a UnicodeError from
    the first connection or the listener."""
    try:
        host.encode("idna")
        if not host.isascii():
            # trio encodes a name that is not ASCII itself, by IDNA 2008 (UTS 46),
            # which refuses more than the codec does (an emoji, mixed directions).
            import idna

            idna.encode(host, uts46=True)
    except UnicodeError:  # (idna's IDNAError is one)
        return False
    return True


def reduce_read_only(inst: Any) -> tuple[Any, ...]:
    """``__reduce__`` for a frozen settings class that holds read-only mappings
    (``MappingProxyType``, which pickle and ``copy.deepcopy`` refuse): they travel as
    dicts and come back read-only, so settings reach a ``spawn`` worker whole."""
    fields = attrs.fields(type(inst))
    state = {f.name: getattr(inst, f.name) for f in fields}
    proxied = tuple(name for name, value in state.items() if isinstance(value, MappingProxyType))
    for name in proxied:
        state[name] = dict(state[name])
    return _rebuilt, (type(inst), state, proxied)


def _rebuilt(cls: type[Any], state: dict[str, Any], proxied: tuple[str, ...]) -> Any:
    # Not through __init__: the values were validated when the original was built.
    inst = object.__new__(cls)
    for name, value in state.items():
        object.__setattr__(inst, name, MappingProxyType(value) if name in proxied else value)
    return inst

#: What a gateway key may contain: a Bearer token (RFC 6750 b64token), so it can be
#: sent in an Authorization header unchanged.
_KEY_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
_ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]*$")
#: A labelled key's name: it is shown (metrics, messages, governance key names), so it
#: is the operator's word for the key, never derived from the key.  No ``__`` (the
#: environment's separator) and no ``:`` (the Redis key separator).
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: The rule above as a message says it (the whole rule: a name it refuses must be
#: told what is wrong with it, not shown a rule it already meets).
NAME_RULE = "must start with a letter or digit, then letters, digits, '_', '-' or '.', without '__'"


def _bad(owner: str, field: str, problem: str) -> ConfigError:
    from ._config import FieldError

    return FieldError(owner, field, problem)


def _keys_repr(value: Any) -> str:
    return f"<{len(value)} key(s)>" if isinstance(value, tuple) else "'***'"


def _to_keys(value: Sequence[str]) -> Any:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return value


def _to_names(value: Sequence[str]) -> Any:
    # (A lone string is not a list of one name: refused by the validator, not split.)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _to_models(value: Mapping[str, str]) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType(dict(value))
    return value


def _to_labelled(value: Mapping[str, ServeKey | Mapping[str, Any]]) -> Any:
    """A mapping of name to :class:`ServeKey` or to its fields (what the loaders build);
    a field's error names its path, ``keys.NAME.FIELD``."""
    if not isinstance(value, Mapping):
        return value
    out: dict[Any, Any] = {}
    for name, key in value.items():
        if isinstance(key, Mapping):
            key = _serve_key(name, key)
        out[name] = key
    return MappingProxyType(out)


def _serve_key(name: Any, fields: Mapping[str, Any]) -> ServeKey:
    from ._config import FieldError

    # (key=str: a name may be of any type from Python, where TOML gives strings only)
    unknown = sorted(set(fields) - {f.name for f in attrs.fields(ServeKey)}, key=str)
    if unknown:
        raise _bad("Serve", f"keys.{name}.{unknown[0]}", "unknown field (key, rpm, tpm, max_in_flight, models)")
    if "key" not in fields:
        raise _bad("Serve", f"keys.{name}.key", "is missing: a labelled gateway key needs its key")
    try:
        return ServeKey(**fields)
    except FieldError as exc:
        raise _bad("Serve", f"keys.{name}.{exc.field}", exc.problem) from None


def _seconds(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    from ._config import _positive

    _positive(inst, attr, value)


def _count(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    from ._config import _pos_int

    _pos_int(inst, attr, value)


def _opt_count(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    from ._config import _opt_pos_int

    _opt_pos_int(inst, attr, value)


def _check_key(owner: str, field: str, key: Any, which: str) -> None:
    # The key itself is never echoed: only which one and what is wrong.
    if not isinstance(key, str) or not key:
        raise _bad(owner, field, f"{which} must be a non-empty string")
    if not _KEY_RE.fullmatch(key):
        raise _bad(owner, field, f"{which} may hold only letters, digits and -._~+/ (a Bearer token)")


@attrs.frozen
class ServeKey:
    """A labelled gateway key and its own quota (``[serve.keys.NAME]``).

    ``key`` is the secret a client sends as ``Authorization: Bearer …``; it is never
    shown.  The limits bound what this key may take, across every replica sharing
    the governance backend: ``rpm`` requests and ``tpm`` tokens in any 60 s window
    (the call's estimate is reserved when it is admitted and settled with the
    answer's usage) and ``max_in_flight`` calls at once.  ``None``: no bound.  A key
    over a limit is answered 429 with ``Retry-After`` at once, without waiting.
    ``models``: the scopes (or aliases of them) this key may call; empty: every one.
    Any name of an allowed scope is allowed (its aliases and its own name); others are
    answered as models that do not exist, and ``/v1/models`` lists only the allowed.
    """

    key: str = attrs.field(repr=lambda _: "'***'")
    rpm: int | None = attrs.field(default=None, validator=_opt_count)
    tpm: int | None = attrs.field(default=None, validator=_opt_count)
    max_in_flight: int | None = attrs.field(default=None, validator=_opt_count)
    models: tuple[str, ...] = attrs.field(default=(), converter=_to_names)

    @models.validator
    def _check_reach(self, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, tuple) or not all(isinstance(m, str) and m for m in value):
            raise _bad("ServeKey", "models", "must be a list of scope names or aliases")
        if len(set(value)) != len(value):
            raise _bad("ServeKey", "models", "names a model twice")

    @key.validator
    def _check_the_key(self, attr: attrs.Attribute[str], value: Any) -> None:
        _check_key("ServeKey", "key", value, "the key")

    @property
    def limited(self) -> bool:
        return (self.rpm, self.tpm, self.max_in_flight) != (None, None, None)


@attrs.frozen
class Serve:
    """How ``polygate serve`` listens, authenticates and protects itself.

    ``api_keys``: the gateway keys clients send as ``Authorization: Bearer …`` (none:
    no authentication, allowed only on a loopback address).  ``models``: aliases a
    request's ``model`` may use besides the scope names (alias → scope).  ``keys``:
    labelled gateway keys (name → :class:`ServeKey`), accepted like ``api_keys``, each
    with its own quota (``docs/serve.md``, "Per-key quotas").  The limits
    bound what one client can hold: ``max_request_bytes`` a request body,
    ``header_timeout_s`` / ``body_timeout_s`` the time to send the request head / body,
    ``idle_timeout_s`` an idle keep-alive connection, ``send_timeout_s`` a write to a
    client that takes nothing of it meanwhile (any byte its side acknowledges starts
    the time again),
    ``max_connections`` open connections.
    ``sse_keepalive_s`` is the interval of ``: keep-alive`` comments on a stream that is
    waiting (admission, a hedge, a slow first token); ``grace_s`` how long SIGTERM lets
    calls in flight finish before cancelling them.
    """

    host: str = attrs.field(default="127.0.0.1")
    port: int = attrs.field(default=8080)
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_to_keys, repr=_keys_repr)
    keys: Mapping[str, ServeKey] = attrs.field(
        # Shown: a ServeKey's own repr hides its key (check-config lists the limits).
        factory=dict, converter=_to_labelled,
        repr=lambda v: repr(dict(v)) if isinstance(v, Mapping) else repr(v),
    )
    models: Mapping[str, str] = attrs.field(
        factory=dict, converter=_to_models,
        repr=lambda v: repr(dict(v)) if isinstance(v, Mapping) else repr(v),
    )
    max_request_bytes: int = attrs.field(default=8 * 1024 * 1024, validator=_count)
    max_connections: int = attrs.field(default=1024, validator=_count)
    header_timeout_s: float = attrs.field(default=10.0, validator=_seconds)
    body_timeout_s: float = attrs.field(default=30.0, validator=_seconds)
    idle_timeout_s: float = attrs.field(default=75.0, validator=_seconds)
    send_timeout_s: float = attrs.field(default=60.0, validator=_seconds)
    sse_keepalive_s: float = attrs.field(default=15.0, validator=_seconds)
    grace_s: float = attrs.field(default=30.0, validator=_seconds)

    __reduce__ = reduce_read_only

    @host.validator
    def _check_host(self, attr: attrs.Attribute[str], value: Any) -> None:
        # (Not printable: a NUL or another control character, shown raw in the start
        # line and the log, is no host a resolver takes either.)
        if not isinstance(value, str) or not value.isprintable() or not value or " " in value:
            raise _bad("Serve", "host", f"must be a host name or address, got {given(value)}")
        if "/" in value or "@" in value or "[" in value or "]" in value or value.count(":") == 1:
            # A URL or "host:port" (an IPv6 address has two colons or more, and is given
            # bare, "::1": "[::1]" and "[::1]:8080" are no address to listen on) can
            # never be listened on; not echoed: a URL may carry a password.
            raise _bad("Serve", "host", "must be a host name or address alone: no scheme, "
                       "user or path, and no ':port' (the port is its own setting)")
        if not host_name_ok(value):
            raise _bad("Serve", "host", f"must be a host name or address: {HOST_NAME_PROBLEM}")

    @port.validator
    def _check_port(self, attr: attrs.Attribute[int], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
            raise _bad("Serve", "port", f"must be a whole number in [0, 65535], got {given(value)}")

    @api_keys.validator
    def _check_keys(self, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, tuple):
            raise _bad("Serve", "api_keys", "must be a list of strings")
        for index, key in enumerate(value):
            _check_key("Serve", "api_keys", key, f"key #{index + 1}")
        if len(set(value)) != len(value):
            raise _bad("Serve", "api_keys", "a key appears twice")

    @keys.validator
    def _check_labelled(self, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, Mapping):
            raise _bad("Serve", "keys", "must be a mapping of key name to ServeKey")
        for name, key in value.items():
            if not isinstance(name, str) or not _LABEL_RE.fullmatch(name) or "__" in name:
                raise _bad("Serve", "keys", f"key name {given(name)} {NAME_RULE}, at most 64 characters")
            if not isinstance(key, ServeKey):
                raise _bad("Serve", "keys", f"key {given(name)} must be a ServeKey or a table")
        secrets = [k.key for k in value.values()]
        if len(set(secrets)) != len(secrets) or set(secrets) & set(self.api_keys):
            raise _bad("Serve", "keys", "a key appears twice (in keys, or in keys and api_keys)")

    @models.validator
    def _check_models(self, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, Mapping):
            raise _bad("Serve", "models", "must be a mapping of alias to scope name")
        for alias, scope in value.items():
            if not isinstance(alias, str) or not _ALIAS_RE.fullmatch(alias):
                raise _bad("Serve", "models", f"alias {given(alias)} must be a model name")
            if not isinstance(scope, str) or not scope:
                raise _bad("Serve", "models", f"alias {given(alias)} must name a scope")

    def __attrs_post_init__(self) -> None:
        if self.sse_keepalive_s < 0.05:
            raise _bad("Serve", "sse_keepalive_s", "must be at least 0.05 s (a floor on its period)")

    @property
    def authenticated(self) -> bool:
        """Whether requests must present a gateway key."""
        return bool(self.api_keys or self.keys)

    def scope_of(self, model: str, scopes: Mapping[str, Any]) -> str | None:
        """The scope a request's ``model`` names (a scope name or an alias)."""
        if model in scopes:
            return model
        return self.models.get(model)


def check_serve_models(serve: Serve, scopes: Mapping[str, Any]) -> None:
    """Every alias names a configured scope, and no alias shadows a scope name."""
    for alias, scope in serve.models.items():
        if scope not in scopes:
            known = ", ".join(sorted(scopes))
            raise _bad(
                "Settings", "serve.models",
                f"alias {alias!r} names scope {given(scope)}, which is not configured (scopes: {known})",
            )
        if alias in scopes and alias != scope:
            raise _bad("Settings", "serve.models", f"alias {alias!r} is also a scope name")
    for name, key in serve.keys.items():
        reach: set[str] = set()
        for model in key.models:
            named = serve.scope_of(model, scopes)
            if named is None:
                known = ", ".join(sorted({*scopes, *serve.models}))
                raise _bad(
                    "Settings", f"serve.keys.{name}.models",
                    f"{given(model)} is no scope or alias (known: {known})",
                )
            reach.add(named)
        for scope in sorted(reach):
            # A call moves along its scope's fallbacks: a key bound to scopes would be
            # answered by (and spend the quotas of) one it may not call, and its errors
            # would name it.
            at, onward = scope, scopes[scope].fallback
            while onward is not None and onward in scopes:
                if onward not in reach:
                    raise _bad(
                        "Settings", f"serve.keys.{name}.models",
                        f"scope {at!r} falls back to {onward!r}, which this key is not "
                        "bound to: bind it too, or give the key scopes without that fallback",
                    )
                at, onward = onward, scopes[onward].fallback


# A construction that fails raises from frames that hold every argument as given: the
# gateway keys.  Raised from above them instead (see polygate._secrets.frameless_on).
for _holder in (ServeKey, Serve):
    setattr(_holder, "__init__", frameless_on(ConfigError)(_holder.__init__))  # noqa: B010
