"""Settings from environment keys and TOML files, and a masked description of them.

Both loaders do the same three steps, so the three ways of configuring (Python
objects, a TOML file, ``POLYGATE__…`` keys) share one validation:

1. **parse** — walk the input, reject unknown keys by the name the user wrote, and
   turn each value into the type its attrs field declares (environment strings
   become int/float/bool; TOML values are type-checked, an int is accepted for a
   float);
2. **build** — construct the attrs classes of :mod:`polygate._config`; their
   validators alone decide which values are valid;
3. **re-word** — a validator's :class:`FieldError` knows only the field
   (``timeout_s``), so it is re-raised as a :class:`ConfigError` naming what the user
   wrote: ``POLYGATE__CHAT__A__TIMEOUT_S`` or ``polygate.toml:
   scopes.chat.sources.a.timeout_s``.  Assembly warnings are re-worded the same way.

Which keys exist and what type each has is derived from the attrs classes
(:func:`_schema`), so a field added there is loadable here without a second table to
keep in sync.

No message shows a secret: values of secret fields (those whose attrs ``repr`` hides
them) are never echoed, URLs go through :func:`mask_url`, and as a last line of
defence every message is scrubbed of the secrets seen in the input.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, Union

import attrs

from . import _config as _config_module
from . import _config_serve as _config_serve_module
from ._config import (
    KEY_PROBLEM,
    FieldError,
    Scope,
    Serve,
    Settings,
    Source,
    as_utf8,
    config_warning,
    field_segments,
    gathered_warnings,
    mask_url,
)
from ._errors import ConfigError
from ._secrets import frameless_on, given, is_header_safe, printable, redact, url_secrets

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_FILE",
    "ENV_PREFIX",
    "describe",
    "given_settings",
    "load_settings",
    "locate_config",
    "settings_from_env",
    "settings_from_toml",
]

ENV_PREFIX = "POLYGATE__"
CONFIG_ENV = "POLYGATE_CONFIG"
DEFAULT_CONFIG_FILE = "polygate.toml"

_T = TypeVar("_T")
_Where = Callable[[str], str]
_SCALAR_TYPES: tuple[type, ...] = (bool, int, float, str)
_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_NOTHING_FOUND = (
    "no polygate configuration found: set POLYGATE_CONFIG to a TOML file, create "
    "./polygate.toml, or set environment keys such as "
    "POLYGATE__{SCOPE}__{SOURCE}__BASE_URL"
)


# --------------------------------------------------------------------------- schema


@attrs.frozen
class _Schema:
    """What one attrs settings class accepts, derived from its fields and annotations.

    ``scalars`` maps a field to int/float/bool/str (``X | None`` counts as X);
    ``groups`` maps a field to the nested attrs class it holds (``Scope.hedge``);
    fields of any other type (``Scope.sources``, ``Settings.scopes``) are the
    structure the loaders walk themselves.
    """

    scalars: Mapping[str, type]
    groups: Mapping[str, type]
    secrets: frozenset[str]
    required: frozenset[str]


@functools.cache
def _schema(cls: type) -> _Schema:
    # The classes' __module__ says "polygate" (for tracebacks); their annotations
    # resolve in the module that defines them.
    hints = typing.get_type_hints(
        cls, globalns={**vars(_config_serve_module), **vars(_config_module)}
    )
    scalars: dict[str, type] = {}
    groups: dict[str, type] = {}
    for field in attrs.fields(cls):
        hint = hints[field.name]
        kind = _scalar_kind(hint)
        if kind is not None:
            scalars[field.name] = kind
        elif isinstance(hint, type) and attrs.has(hint):
            groups[field.name] = hint
    return _Schema(
        scalars=scalars,
        groups=groups,
        secrets=frozenset(f.name for f in attrs.fields(cls) if _is_secret(f)),
        required=frozenset(f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING),
    )


def _scalar_kind(hint: Any) -> type | None:
    if hint in _SCALAR_TYPES:
        return typing.cast(type, hint)
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, Ellipsis):
        return tuple  # a list of strings: a TOML array, or comma-separated in the environment
    if typing.get_origin(hint) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SCALAR_TYPES:
            return typing.cast(type, rest[0])
    return None


_PROBE = "polygate-probe-value"


def _is_secret(field: attrs.Attribute[Any]) -> bool:
    """A field is secret when its repr hides the value (``Source.api_key``)."""
    shown = field.repr
    return callable(shown) and _PROBE not in str(shown(_PROBE))


def _source_fields() -> list[str]:
    """Source fields a user sets by key; the name comes from the key itself."""
    return [f for f in _schema(Source).scalars if f != "name"]


def _secret_field_names() -> frozenset[str]:
    return (
        _schema(Source).secrets | _schema(Settings).secrets | _schema(Scope).secrets
        | _schema(Serve).secrets
    )


# --------------------------------------------------------------------------- parsed parts


@attrs.define
class _Part:
    """Parsed values for one attrs object, and how to name each field to the user."""

    where: _Where
    values: dict[str, Any] = attrs.field(factory=dict)
    keys: list[str] = attrs.field(factory=list)  # what the user wrote, for messages
    #: What each of ``keys`` begins with in a file (``polygate.toml: scopes.chat.``),
    #: left out where a message lists them after naming the table; "" for the
    #: environment, whose keys are the names the user wrote.
    prefix: str = ""


@attrs.define
class _ScopePart:
    own: _Part
    label: str  # the scope as a whole, for messages not about one field
    #: How to add a source, in the terms of where the scope was written.
    add_source: str = ""
    groups: dict[str, _Part] = attrs.field(factory=dict)
    sources: dict[str, _Part] = attrs.field(factory=dict)  # unique label → source


@attrs.define
class _SettingsPart:
    own: _Part
    scopes: dict[str, _ScopePart] = attrs.field(factory=dict)
    secrets: set[str] = attrs.field(factory=set)
    serve: _Part | None = None  # [serve] / POLYGATE__SERVE__…: the gateway server


# --------------------------------------------------------------------------- values


_PLAIN_NUMBER = re.compile(r"\A\s*[-+]?[0-9A-Za-z.+-]*\s*\Z", re.ASCII)


def _value_from_text(kind: type, text: str, where: str) -> Any:
    """An environment string → the field's type; the key is named on failure."""
    if kind is str:
        return text
    if kind is tuple:
        items = tuple(item.strip() for item in text.split(","))
        if text.strip() and not all(items):
            raise ConfigError(f"{where}: a comma-separated list with an empty entry, got {given(text)}")
        return tuple(item for item in items if item)
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{where}: expected true/false/1/0/yes/no, got {given(text)}")
    try:
        # Python's int() and float() also read '1_000' and other scripts' digits; a
        # configuration value is plain ASCII.
        if not _PLAIN_NUMBER.match(text):
            raise ValueError(text)
        return int(text) if kind is int else float(text)
    except ValueError:
        wanted = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{where}: expected {wanted}, got {given(text)}") from None


def _value_from_toml(kind: type, value: Any, where: str, *, secret: bool = False) -> Any:
    """A typed TOML value checked against the field's type (ints are fine for floats).
    A ``secret`` field's wrong value is described by its kind alone: a key written as
    a bare number must not be echoed."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is float and is_number:
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits: no float holds it
            raise ConfigError(
                f"{where}: expected a finite number, got an integer too large for one"
            ) from None
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in (bool, str) and isinstance(value, kind):
        return value
    if kind is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    wanted = {float: "a number", int: "a whole number", bool: "true or false", str: "a string",
              tuple: "an array of strings"}
    hint = " (write it without quotes)" if kind in (int, float) and _a_number(value) else ""
    got = _what(value).split(" (", 1)[0] if secret else _what(value)
    raise ConfigError(f"{where}: expected {wanted[kind]}, got {got}{hint}")


def _a_number(value: Any) -> bool:
    """A string that is a TOML number once unquoted (``"30"``, ``"1.5e3"``, ``"0x1F"``,
    ``"inf"``): the quotes are the mistake.  ``"fast"``, ``"30s"``, ``".5"`` or
    ``"Infinity"`` unquoted would not even be TOML."""
    if not isinstance(value, str) or "\n" in value or "#" in value:
        return False
    try:
        number = tomllib.loads(f"x = {value.strip()}")["x"]
    except (tomllib.TOMLDecodeError, ValueError):
        return False
    return isinstance(number, (int, float)) and not isinstance(number, bool)


def _what(value: Any) -> str:
    """A TOML value's kind in words; strings are never echoed (they may be secrets)."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({given(value)})"
    if isinstance(value, float):
        return f"a float ({value})"
    names: dict[type, str] = {str: "a string", dict: "a table", list: "an array"}
    return names.get(type(value), "a date or time")


def _scrub(text: str, secrets: Iterable[str]) -> str:
    """The last line of defence: every form of every secret seen in the input."""
    return redact(text, tuple(secrets))


def _unknown(
    label: str, what: str, known: Iterable[str], typed: str, note: str = ""
) -> ConfigError:
    """``X: unknown key; <what> are A, B, C`` with a did-you-mean when one is close."""
    known = list(known)
    close = difflib.get_close_matches(typed, known, n=1)
    maybe = f" (did you mean {close[0]}?)" if close else ""
    note = f"; {note}" if note else ""
    return ConfigError(
        f"{label}: unknown configuration key{maybe}; {what} are {', '.join(known)}{note}"
    )


# --------------------------------------------------------------------------- build


def _build(cls: type[_T], part: _Part, extra: Mapping[str, Any], secrets: Iterable[str]) -> _T:
    """Construct ``cls``; a validator's FieldError comes back naming the user's key."""
    try:
        return cls(**part.values, **extra)
    except FieldError as exc:
        raise ConfigError(_scrub(f"{part.where(exc.field)}: {exc.problem}", secrets)) from None


_WARNED_FIELD = re.compile(r"^(hedge\.\w+) ")


@contextlib.contextmanager
def _reworded_warnings(scope: _ScopePart, secrets: Iterable[str]) -> Iterator[None]:
    """Re-issue the assembly's ConfigWarnings naming the user's key instead of a field."""
    with gathered_warnings() as gathered:
        yield
    for text in gathered:
        match = _WARNED_FIELD.match(text)
        label = scope.own.where(match.group(1)) if match else scope.label
        config_warning(_scrub(f"{label}: {text}", secrets))


def _build_scope(part: _ScopePart, secrets: Iterable[str]) -> Scope:
    kinds = _schema(Scope).groups
    groups: dict[str, Any] = {
        name: _build(kinds[name], p, {}, secrets) for name, p in part.groups.items()
    }
    sources = [_build(Source, p, {}, secrets) for p in part.sources.values()]
    with _reworded_warnings(part, secrets):
        return _build(Scope, part.own, {**groups, "sources": sources}, secrets)


def _build_settings(part: _SettingsPart) -> Settings:
    _check_complete(part)
    scopes = {name: _build_scope(p, part.secrets) for name, p in part.scopes.items()}
    extra: dict[str, Any] = {"scopes": scopes}
    if part.serve is not None:
        extra["serve"] = _build(Serve, part.serve, {}, part.secrets)
    return _build(Settings, part.own, extra, part.secrets)


def _check_complete(part: _SettingsPart) -> None:
    """What the validators cannot word well: no scopes, sourceless scopes, missing URLs."""
    if not part.scopes:
        found = f" (found only {_listed(part.own)})" if part.own.keys else ""
        raise ConfigError(f"{part.own.where('scopes')}: no scope is configured{found}")
    for name, scope in part.scopes.items():
        if not scope.sources:
            keys = [*scope.own.keys, *(k for g in scope.groups.values() for k in g.keys)]
            given = _listed(attrs.evolve(scope.own, keys=keys)) or "nothing else"
            if scope.add_source:  # a file: the message begins with where, as the others
                raise ConfigError(
                    f"{scope.label}: the scope has no sources (add {scope.add_source}); "
                    f"it sets {given}"
                )
            raise ConfigError(
                f"scope {name!r} has no sources (add {scope.own.where('sources')}); "
                f"it sets {given}"
            )
        for source in scope.sources.values():
            missing = sorted(_schema(Source).required - source.values.keys())
            if not missing:
                continue
            field = missing[0]
            if not source.prefix:  # the environment (where a key named the source)
                told = f"the source is set by {', '.join(source.keys)} but has no {field}"
            elif source.keys:
                told = f"the source sets {_listed(source)} but has no {field}"
            else:  # a file's table with nothing in it but its name
                told = f"the source has no {field}"
            raise ConfigError(f"{source.where(field)} is missing: {told}")


def _listed(part: _Part) -> str:
    """``part``'s keys for a message that has named its table already."""
    return ", ".join(key.removeprefix(part.prefix) for key in part.keys)


# --------------------------------------------------------------------------- environment


@frameless_on(ConfigError)
def settings_from_env(env: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``POLYGATE__…`` keys (default: ``os.environ``).

    Sources are ordered by name (an environment has no order).  An empty value is
    the same as an unset key, except a gateway key's ``MODELS``: left unset, it would
    widen the key to every scope, so an empty one is refused.
    """
    source = os.environ if env is None else _checked_env(env)
    for key, value in source.items():
        if not key.startswith(ENV_PREFIX) and key.upper().startswith(ENV_PREFIX) and value.strip():
            # Silently skipped, a polygate__chat__… key would leave its setting at the
            # default with no word said (the keys after the prefix are checked alike).
            raise ConfigError(f"{key}: configuration keys are upper case ({ENV_PREFIX}…)")
        if key.startswith(_SERVE_ENV + "KEYS__") and key.endswith("__MODELS") and not value.strip():
            # The one key whose unset value widens what it sets: a key's MODELS expanded
            # empty (…__MODELS=$TEAM_MODELS, the variable unset) would bind it to no
            # scope, i.e. give it every scope and the metrics.
            raise ConfigError(f"{key}: {_EMPTY_MODELS}")
    entries = {
        key: as_utf8(value.strip())
        for key, value in source.items()
        if key.startswith(ENV_PREFIX) and value.strip()
    }
    if not entries:
        raise ConfigError(_NOTHING_FOUND)
    return _build_settings(_parse_env(entries))


def _parse_env(entries: Mapping[str, str]) -> _SettingsPart:
    settings = _SettingsPart(own=_Part(where=_env_settings_where), secrets=_env_secrets(entries))
    try:
        _parse_env_keys(settings, entries)
    except ConfigError as exc:
        # A value of the wrong type is quoted, and a deploy script's slip may have put
        # a key there: every secret of the input is scrubbed, as from every message.
        raise ConfigError(_scrub(str(exc), settings.secrets)) from None
    return settings


def _env_secrets(entries: Mapping[str, str]) -> set[str]:
    """Every secret among the keys, found before any key is read: a message about
    one key may quote another's value."""
    secret_names = {name.upper() for name in _secret_field_names()} | {"KEY"}
    secrets: set[str] = set()
    for key, value in entries.items():
        if key.rsplit("__", 1)[-1] in secret_names:
            secrets.add(value)
            secrets.update(item.strip() for item in value.split(","))  # API_KEYS: a list
        secrets.update(url_secrets(value))
    return secrets


def _parse_env_keys(settings: _SettingsPart, entries: Mapping[str, str]) -> None:
    for key in sorted(entries):
        if "" in key[len(ENV_PREFIX):].split("__"):
            # (POLYGATE__CHAT____TIMEOUT_S, a source name left out, was reported as a
            # source "" whose BASE_URL is missing.)
            raise ConfigError(f"{key}: an empty segment (nothing between two '__', or at the end)")
        if key.startswith(_SERVE_ENV):
            _env_serve(settings, key, entries[key])
            continue
        part, field, kind = _route_env_key(settings, key)
        part.values[field] = _value_from_text(kind, entries[key], key)
        if field == "fallback" and isinstance(part.values[field], str):
            # A scope's name, which the environment's keys give in any case and the
            # loader lowers: POLYGATE__CHAT__FALLBACK=LARGE names POLYGATE__LARGE__*.
            part.values[field] = part.values[field].lower()
        _check_key(field, part.values[field], key)
        part.keys.append(key)
    for scope in settings.scopes.values():
        # By name, as documented: the keys' own order (sorted whole) put A-1__… before
        # A__… and GPU10__… before GPU1__…, and Scope.sources is an ordered tuple, so
        # the same sources in a TOML file in name order made unequal Settings.
        scope.sources = dict(sorted(scope.sources.items()))


def _env_settings_where(field: str) -> str:
    if field == "scopes":
        return f"{ENV_PREFIX}{{SCOPE}}__{{SOURCE}}__BASE_URL"
    if field.startswith("scopes."):  # a scope's key (its fallback), or its name
        parts = field_segments(field)[1:]
        return ENV_PREFIX + "__".join(p.upper() for p in parts) + ("" if len(parts) > 1 else "__…")
    return ENV_PREFIX + "__".join(p.upper() for p in field_segments(field))


def _env_key(*segments: str) -> str:
    return ENV_PREFIX + "__".join(s.upper() for s in segments)


def env_segments(rest: str) -> list[str]:
    """A key's segments, split at each ``__``; a third ``_`` goes with the name on its
    left: no name starts with ``_``, and one may end with it (a source ``gpu_`` is
    ``…__GPU___BASE_URL``, which a plain split read as ``GPU`` and ``_BASE_URL``)."""
    return _SEGMENT_SPLIT.split(rest)


_SEGMENT_SPLIT = re.compile(r"__(?=[^_])")


def _route_env_key(settings: _SettingsPart, key: str) -> tuple[_Part, str, type]:
    """Which part and field ``key`` sets, or a ConfigError naming the key."""
    rest = key[len(ENV_PREFIX):]
    if not rest.isascii():
        # ("\u212a", the Kelvin sign, is upper case and lower-cases to "k": API_\u212aEY
        # set api_key, unseen by the secrets' scrub, beside API_KEY.  Written escaped,
        # as it looks like the key it stands in for.)
        raise ConfigError(f"{ascii(key)[1:-1]}: configuration keys are upper case ASCII")
    if rest != rest.upper():
        raise ConfigError(f"{key}: configuration keys are upper case")
    segments = env_segments(rest)
    if len(segments) == 1:
        note = f"scope keys are {ENV_PREFIX}{{SCOPE}}__…"
        return _env_field(settings.own, _schema(Settings), key, segments[0], "top-level keys", note)
    scope = _env_scope(settings, segments[0])
    if len(segments) == 2:
        note = f"source fields are {_env_key(segments[0])}__{{SOURCE}}__{{FIELD}}"
        return _env_field(scope.own, _schema(Scope), key, segments[1], "scope keys", note)
    if len(segments) == 3:
        return _route_env_scope_key(scope, key, segments)
    raise ConfigError(
        f"{key}: unknown configuration key, too many segments "
        f"(a source field is {ENV_PREFIX}{{SCOPE}}__{{SOURCE}}__{{FIELD}})"
    )


def _route_env_scope_key(
    scope: _ScopePart, key: str, segments: list[str]
) -> tuple[_Part, str, type]:
    name, middle, last = segments
    schema = _schema(Scope)
    group = middle.lower()
    if group in schema.groups:
        part = scope.groups.setdefault(group, _Part(where=_env_where(name, middle)))
        note = f"{middle} is reserved: no source may be named so"
        return _env_field(part, _schema(schema.groups[group]), key, last, f"{middle} keys", note)
    if group in schema.scalars:
        raise ConfigError(
            f"{key}: unknown configuration key; {middle} is a scope setting "
            f"({_env_key(name, middle)}) and is reserved: no source may be named so"
        )
    if group not in scope.sources:
        scope.sources[group] = _Part(where=_env_source_where(name, middle, scope))
        scope.sources[group].values["name"] = group
    source = scope.sources[group]
    return _env_field(source, _schema(Source), key, last, "source fields", skip="name")


def _env_field(
    part: _Part, schema: _Schema, key: str, segment: str, what: str, note: str = "",
    skip: str = "",
) -> tuple[_Part, str, type]:
    field = segment.lower()
    if field in schema.scalars and field != skip:
        return part, field, schema.scalars[field]
    known = [f.upper() for f in schema.scalars if f != skip]
    raise _unknown(key, what, known, segment, note)


def _env_scope(settings: _SettingsPart, segment: str) -> _ScopePart:
    name = segment.lower()
    if name not in settings.scopes:
        settings.scopes[name] = _ScopePart(
            own=_Part(where=_env_scope_where(segment)), label=f"{ENV_PREFIX}{segment}__*"
        )
    return settings.scopes[name]


def _env_where(*prefix: str) -> _Where:
    return lambda field: _env_key(*prefix, *field.split("."))


def _env_scope_where(segment: str) -> _Where:
    def where(field: str) -> str:
        if field == "sources":
            return f"{_env_key(segment)}__{{SOURCE}}__BASE_URL"
        return _env_key(segment, *field.split("."))

    return where


def _env_source_where(scope: str, source: str, part: _ScopePart) -> _Where:
    def where(field: str) -> str:
        if field == "name":  # no key holds the name: point at the source's own keys
            mine = part.sources[source.lower()].keys
            return mine[0] if mine else _env_key(scope, source, "*")
        return _env_key(scope, source, field)

    return where


# --------------------------------------------------------------------------- [serve]

_SERVE_ENV = f"{ENV_PREFIX}SERVE__"
#: Serve fields that are not scalars: lists and tables, parsed here.
_SERVE_LISTS = ("api_keys", "models", "keys")
#: The fields of one labelled key, ``[serve.keys.NAME]`` / ``POLYGATE__SERVE__KEYS__NAME__…``.
#: A gateway key's ``models`` written out empty, in TOML or the environment: never
#: "every scope", which leaving it out says.
_EMPTY_MODELS = "is empty: name the scopes this key may call, or leave it out for every scope"
_KEY_FIELDS: dict[str, type] = {
    "key": str, "rpm": int, "tpm": int, "max_in_flight": int, "models": tuple,
}


def _env_serve(settings: _SettingsPart, key: str, text: str) -> None:
    """``POLYGATE__SERVE__{FIELD}``; ``API_KEYS`` is comma-separated, ``MODELS`` is
    ``alias=scope,alias=scope``."""
    part = _serve_part(settings, lambda f: _env_key("serve", *field_segments(f)))
    segment = key[len(_SERVE_ENV):]
    field = segment.lower()
    if segment.startswith("KEYS__") and segment == segment.upper() and segment.isascii():
        _env_serve_key(settings, part, key, env_segments(segment)[1:], text)
        part.keys.append(key)
        return
    if segment != segment.upper() or not segment.isascii() or "__" in segment:
        raise _unknown(key, "serve keys", _serve_keys(upper=True), segment)
    if field == "api_keys":
        keys = _key_list(text, key)
        settings.secrets.update(keys)
        part.values[field] = keys
    elif field == "models":
        part.values[field] = _env_models(key, text)
    elif field in _schema(Serve).scalars:
        part.values[field] = _value_from_text(_schema(Serve).scalars[field], text, key)
    else:
        raise _unknown(key, "serve keys", _serve_keys(upper=True), segment)
    part.keys.append(key)


def _env_serve_key(
    settings: _SettingsPart, part: _Part, key: str, segments: list[str], text: str
) -> None:
    """``POLYGATE__SERVE__KEYS__{NAME}__{KEY|RPM|TPM|MAX_IN_FLIGHT|MODELS}``; the name
    is lower-cased, as scope names are (``MODELS``, comma-separated, as written)."""
    fields = ", ".join(f.upper() for f in _KEY_FIELDS)
    if len(segments) != 2 or not all(segments) or segments[1].lower() not in _KEY_FIELDS:
        raise ConfigError(
            f"{key}: unknown configuration key; a labelled gateway key is set by "
            f"{_SERVE_ENV}KEYS__{{NAME}}__{{FIELD}} with FIELD one of {fields}"
        )
    name, field = segments[0].lower(), segments[1].lower()
    if field == "key":
        settings.secrets.add(text)
    keys = part.values.setdefault("keys", {})
    keys.setdefault(name, {})[field] = _value_from_text(_KEY_FIELDS[field], text, key)


def _env_models(key: str, text: str) -> dict[str, str]:
    models: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        alias, eq, scope = (p.strip() for p in item.partition("="))
        if not eq or not alias or not scope:
            raise ConfigError(f"{key}: expected alias=scope pairs separated by commas, got {given(item)}")
        if alias in models:
            raise ConfigError(f"{key}: alias {given(alias)} appears twice")
        # A scope's name in any case, as the environment's keys give it (the loader
        # lowers them): gpt-4o=LARGE names POLYGATE__LARGE__*.  The alias is the
        # clients' model name: as written.
        models[alias] = scope.lower()
    return models


def _serve_keys(upper: bool = False) -> list[str]:
    names = list(dict.fromkeys([*_schema(Serve).scalars, *_SERVE_LISTS]))  # (api_keys: both)
    return [n.upper() for n in names] if upper else names


def _serve_part(settings: _SettingsPart, where: _Where) -> _Part:
    if settings.serve is None:
        settings.serve = _Part(where=where)
    return settings.serve


def _key_list(text: str, where: str) -> list[str]:
    """Comma-separated gateway keys, from ``POLYGATE__SERVE__API_KEYS`` or the variable
    ``api_keys_env`` names: "," or "a,,b" (a variable expanded empty in a deploy
    script) is refused -- read as fewer keys, the clients of the missing one would
    meet 401s.  (The message quotes nothing: the rest are keys.)"""
    keys = [k.strip() for k in text.split(",")]
    if not all(keys):
        raise ConfigError(f"{where}: an empty key in the comma-separated list")
    return keys


def _toml_serve(settings: _SettingsPart, value: Any, file: str, env: Mapping[str, str]) -> None:
    """The ``[serve]`` table: scalars, ``api_keys`` (a list, or ``api_keys_env`` naming
    an environment variable with comma-separated keys) and ``[serve.models]``."""
    at = _toml_where(file, "serve")
    table = _toml_table(value, f"{file}: serve")
    part = _serve_part(settings, at)
    if "api_keys_env" in table:
        if "api_keys" in table:
            raise ConfigError(f"{at('api_keys_env')}: set api_keys or api_keys_env, not both")
        var = _value_from_toml(str, table.pop("api_keys_env"), at("api_keys_env"), secret=True)
        if not env.get(var, "").strip():
            raise ConfigError(f"{at('api_keys_env')}: {_unset(var, env)}")
        keys = _key_list(env[var], at("api_keys_env"))
        settings.secrets.update(keys)
        part.values["api_keys"] = keys
        part.keys.append(at("api_keys_env"))
    if "api_keys" in table:
        keys = table.pop("api_keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            # Described by its kind alone: a key written as a bare number is a secret.
            got = _what(keys).split(" (", 1)[0]
            raise ConfigError(f"{at('api_keys')}: expected an array of strings, got {got}")
        part.values["api_keys"] = keys
        part.keys.append(at("api_keys"))
    if "models" in table:
        models = _toml_table(table.pop("models"), at("models"))
        for alias, scope in models.items():
            if not isinstance(scope, str):
                where = at(f"models.{alias}") if _BARE_KEY.fullmatch(alias) else at("models")
                raise ConfigError(f"{where}: expected a scope name, got {_what(scope)}")
        part.values["models"] = models
        part.keys.append(at("models"))
    if "keys" in table:
        part.values["keys"] = _toml_serve_keys(table.pop("keys"), at, env, settings.secrets)
        part.keys.append(at("keys"))
    _toml_fields(part, _schema(Serve), table, "serve", "serve keys",
                 extra=[*_SERVE_LISTS, "api_keys_env"])


def _toml_serve_keys(
    value: Any, at: _Where, env: Mapping[str, str], secrets: set[str]
) -> dict[str, dict[str, Any]]:
    """``[serve.keys.NAME]`` tables: ``key`` (or ``key_env`` naming an environment
    variable that holds it), ``rpm``, ``tpm``, ``max_in_flight``, ``models``."""
    out: dict[str, dict[str, Any]] = {}
    for name, raw in _toml_table(value, at("keys")).items():
        where = at(f"keys.{name}") if _BARE_KEY.fullmatch(name) else at("keys")
        # ``NAME = 123456`` where a table belongs is most likely the key itself: not
        # echoed.
        table = dict(_toml_table(raw, where, secret=True))
        key = _env_secret(table, "key", env, f"{where}.key_env")
        if key is not None:
            table["key"] = key
        fields: dict[str, Any] = {}
        for field, item in table.items():
            kind = _KEY_FIELDS.get(field)
            if kind is None:
                known = ", ".join([*_KEY_FIELDS, "key_env"])
                raise ConfigError(f"{where}.{field}: unknown key (a gateway key takes {known})")
            if field == "key" and isinstance(item, str):
                secrets.add(item)
            if field == "models" and item == []:
                raise ConfigError(f"{where}.models: {_EMPTY_MODELS}")
            fields[field] = _value_from_toml(kind, item, f"{where}.{field}", secret=field == "key")
        out[name] = fields
    return out


# --------------------------------------------------------------------------- TOML


@frameless_on(ConfigError)
def settings_from_toml(
    path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
) -> Settings:
    """Settings from a TOML file; ``env`` (default ``os.environ``) serves ``api_key_env``."""
    try:
        label = os.fsdecode(path)
    except TypeError:
        raise ConfigError(f"a configuration file's path must be a str or a path, not "
                          f"{type(path).__name__}") from None
    source = os.environ if env is None else _checked_env(env)
    data = read_toml(label)
    return _build_settings(_parse_toml(data, printable(label), source))


def _checked_env(env: Any) -> Mapping[str, str]:
    """An ``env`` argument: a mapping of strings to strings, as ``os.environ`` is.  A
    wrong one is named by its key alone (a value may be a key)."""
    if not isinstance(env, Mapping):
        raise ConfigError(f"env must be a mapping of names to strings, got {type(env).__name__}")
    for key, value in env.items():
        if not isinstance(key, str):
            raise ConfigError(f"env: names must be strings, got {type(key).__name__}")
        if not isinstance(value, str):
            raise ConfigError(f"env {key}: must be a string, got {type(value).__name__}")
    return env


#: Far past any configuration; a path to a device (``/dev/zero``) is not read for ever.
_MAX_TOML_BYTES = 16 << 20


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # (POSIX)


def read_toml(label: str) -> dict[str, Any]:
    path, label = label, printable(label)  # (shown on one line, whatever the name holds)
    if "\x00" in path:  # (open() raises ValueError for it, as tomllib does for a number)
        raise ConfigError(f"{path!r}: a path cannot hold a NUL character")
    try:
        # Opened without waiting: a named pipe with no writer (which open() would wait
        # on for ever) reads as empty; one with a writer (``--config <(...)``) is read.
        fd = os.open(path, os.O_RDONLY | _NONBLOCK)
        try:
            f = os.fdopen(fd, "rb")
        except BaseException:  # (a directory opens, and fails here: not left open)
            os.close(fd)
            raise
        with f:
            if _NONBLOCK:
                os.set_blocking(fd, True)
            data = f.read(_MAX_TOML_BYTES + 1)
        if len(data) > _MAX_TOML_BYTES:
            raise ConfigError(
                f"{label}: the configuration file is larger than {_MAX_TOML_BYTES >> 20} MiB"
            )
        text = data.decode("utf-8")
        # Windows editors (Notepad) start a UTF-8 file with a byte-order mark, which
        # TOML does not allow and tomllib reports as "invalid statement" at 1:1.
        return tomllib.loads(text[1:] if text.startswith("\ufeff") else text)
    except ConfigError:  # (a ValueError: not the number-too-large case below)
        raise
    except FileNotFoundError:
        raise ConfigError(f"{label}: configuration file not found") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read the file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: invalid TOML ({exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{label}: the configuration file is not UTF-8") from None
    except RecursionError:
        # tomllib reads nested tables and arrays by recursion: past Python's limit
        # (~400 levels) it fails with this.  No setting nests beyond a few levels.
        raise ConfigError(f"{label}: invalid TOML (values nested too deeply)") from None
    except ValueError as exc:
        # Python's cap on an integer's digits (4300), which tomllib meets as it reads
        # one: no setting takes such a number.  (Its message quotes no value.)
        raise ConfigError(f"{label}: invalid TOML (a number too large: {exc})") from None


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _join(path: str, key: str) -> str:
    """A TOML dotted path, quoting keys that are not bare (``scopes."a.b"``)."""
    key = key if _BARE_KEY.fullmatch(key) else json.dumps(key)
    return f"{path}.{key}" if path else key


def _parse_toml(data: dict[str, Any], file: str, env: Mapping[str, str]) -> _SettingsPart:
    at = _toml_where(file, "")
    settings = _SettingsPart(own=_Part(where=at, prefix=f"{file}: "), secrets=_harvest_secrets(data))
    scopes = data.pop("scopes", {})
    if "serve" in data:
        _toml_serve(settings, data.pop("serve"), file, env)
    _toml_fields(
        settings.own, _schema(Settings), data, "", "top-level keys", extra=["scopes", "serve"]
    )
    for name, table in _toml_table(scopes, at("scopes")).items():
        path = _join("scopes", name)
        table = _toml_table(table, at(path))
        settings.scopes[name] = _parse_toml_scope(table, file, path, env, settings)
    return settings


def _parse_toml_scope(
    table: dict[str, Any], file: str, path: str, env: Mapping[str, str], settings: _SettingsPart
) -> _ScopePart:
    scope = _ScopePart(
        own=_Part(where=_toml_where(file, path), prefix=f"{file}: {path}."),
        label=f"{file}: {path}", add_source=f"a [{_join(path, 'sources')}.NAME] table with a base_url",
    )
    schema = _schema(Scope)
    sources = table.pop("sources", {})
    for group in schema.groups.keys() & table.keys():
        gpath = _join(path, group)
        part = scope.groups[group] = _Part(where=_toml_where(file, gpath))
        gtable = _toml_table(table.pop(group), f"{file}: {gpath}")
        _toml_fields(part, _schema(schema.groups[group]), gtable, gpath, f"{group} keys")
    _toml_fields(scope.own, schema, table, path, "scope keys", extra=["sources", *schema.groups])
    for label, spath, stable, by_key in _toml_sources(sources, file, _join(path, "sources")):
        scope.sources[label] = _parse_toml_source(stable, file, spath, by_key, env, settings)
    return scope


def _toml_sources(
    value: Any, file: str, path: str
) -> Iterator[tuple[str, str, dict[str, Any], bool]]:
    """``[scopes.x.sources.NAME]`` tables or ``[[scopes.x.sources]]`` with a ``name`` key.

    Yields (unique label, TOML path, table with ``name``, whether the key names it).
    """
    if isinstance(value, list):
        for i, item in enumerate(value):
            ipath = f"{path}[{i}]"
            table = _toml_table(item, f"{file}: {ipath}")
            if "name" not in table:
                raise ConfigError(f"{file}: {ipath}: a source in an array needs a name")
            yield f"[{i}]", ipath, table, False
        return
    for name, table in _toml_table(value, f"{file}: {path}").items():
        spath = _join(path, name)
        table = _toml_table(table, f"{file}: {spath}")
        if "name" in table:
            where = f"{file}: {_join(spath, 'name')}"
            raise ConfigError(f"{where}: the table key names the source; remove name")
        yield spath, spath, {"name": name, **table}, True


def _parse_toml_source(
    table: dict[str, Any], file: str, path: str, named_by_key: bool,
    env: Mapping[str, str], settings: _SettingsPart,
) -> _Part:
    where = _toml_where(file, path)
    part = _Part(where=lambda f: f"{file}: {path}" if f == "name" and named_by_key else where(f),
                 prefix=f"{file}: {path}.")
    part.values["name"] = table.pop("name")
    for field in sorted(_schema(Source).secrets):
        _secret_from_env(part, table, field, env, settings.secrets, where)
    by_env = [f"{f}_env" for f in sorted(_schema(Source).secrets)]
    _toml_fields(part, _schema(Source), table, path, "source fields", skip="name", extra=by_env)
    return part


def _secret_from_env(
    part: _Part, table: dict[str, Any], field: str, env: Mapping[str, str],
    secrets: set[str], where: _Where,
) -> None:
    """``api_key_env = "NAME"``: read the secret from the environment, not the file."""
    key = f"{field}_env"
    value = _env_secret(table, field, env, where(key))
    if value is None:
        return
    secrets.add(value)
    _check_key(field, value, where(key))
    part.values[field] = value
    part.keys.append(where(key))


def _env_secret(table: dict[str, Any], field: str, env: Mapping[str, str], where: str) -> str | None:
    """The secret a ``{field}_env = "NAME"`` entry of ``table`` names (the entry is
    taken out), or ``None`` when there is none; ``where`` is that entry's path."""
    key = f"{field}_env"
    if key not in table:
        return None
    # (A number here may be a key pasted in place of a variable's name: not echoed.)
    var = _value_from_toml(str, table.pop(key), where, secret=True)
    if field in table:
        raise ConfigError(f"{where}: set {field} or {key}, not both")
    value = env.get(var, "").strip()
    if not value:
        raise ConfigError(f"{where}: {_unset(var, env)}")
    return value


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _named_like_a_variable(var: str) -> bool:
    """How variables are named: one case, words of at most 16 characters between the
    underscores (OPENAI_API_KEY, groq_key).  Many keys are letters, digits and ``_``
    too (hf_…, gsk_…, 32 alphanumerics), but in mixed case or in one long run."""
    return (
        len(var) <= 64 and (var.isupper() or var.islower())
        and all(len(word) <= 16 for word in var.split("_"))
    )


def _unset(var: str, env: Mapping[str, str]) -> str:
    """Why a ``*_env`` entry gave nothing: its variable is not set, or set to nothing
    but blanks (said apart: the operator looks in another place for each).  A value
    that does not look like a variable's name is not quoted: it is most likely the
    secret itself, pasted in the name's place."""
    state = "is set but empty" if var in env else "is not set"
    if _ENV_NAME.fullmatch(var) and _named_like_a_variable(var):
        return f"environment variable {var} {state}"
    if _ENV_NAME.fullmatch(var):
        return (f"names an environment variable that {state} (the name is not shown: it "
                "looks more like a key than a variable's name: was a key pasted in its place?)")
    return ("must name an environment variable (letters, digits and _), which this value "
            "cannot be: was a key pasted in its place? (the value is not shown)")


def _toml_fields(
    part: _Part, schema: _Schema, table: dict[str, Any], path: str, what: str,
    *, skip: str = "", extra: Iterable[str] = (),
) -> None:
    """Type-check each scalar of ``table`` into ``part``; unknown keys name their path."""
    allowed = [f for f in schema.scalars if f != skip]
    for key, value in table.items():
        if key not in allowed:
            raise _unknown(part.where(key), what, list(dict.fromkeys([*allowed, *extra])), key)
        part.values[key] = _value_from_toml(
            schema.scalars[key], value, part.where(key), secret=key in schema.secrets
        )
        _check_key(key, part.values[key], part.where(key))
        part.keys.append(part.where(key))


def _check_key(field: str, value: Any, where: str) -> None:
    """A configured key that cannot be sent is a configuration error here, before
    anything runs (objects built in Python get a warning: Source's validator)."""
    if field == "api_key" and isinstance(value, str) and value and not is_header_safe(value):
        raise ConfigError(f"{where}: {KEY_PROBLEM}")


def _toml_table(value: Any, where: str, *, secret: bool = False) -> dict[str, Any]:
    if not isinstance(value, dict):
        got = _what(value).split(" (", 1)[0] if secret else _what(value)
        raise ConfigError(f"{where}: expected a table, got {got}")
    return dict(value)


def _toml_where(file: str, path: str) -> _Where:
    return lambda field: f"{file}: {_join_dotted(path, field)}"


def _join_dotted(path: str, field: str) -> str:
    for key in field_segments(field):
        path = _join(path, key)
    return path


def _harvest_secrets(node: Any, key: str = "") -> set[str]:
    """Every secret-looking value in a TOML tree: secret fields and URL passwords."""
    found: set[str] = set()
    if isinstance(node, dict):
        for k, v in node.items():
            found |= _harvest_secrets(v, k)
    elif isinstance(node, list):
        for v in node:
            found |= _harvest_secrets(v, key)
    elif isinstance(node, str):
        if key in _secret_field_names():
            found.add(node)
        found.update(url_secrets(node))
    return found


# --------------------------------------------------------------------------- session default


def locate_config(env: Mapping[str, str] | None = None) -> str | None:
    """The TOML file :func:`load_settings` reads, or None when it reads the environment."""
    source = os.environ if env is None else env
    named = source.get(CONFIG_ENV, "").strip()
    if named:
        return named
    return DEFAULT_CONFIG_FILE if _is_file(DEFAULT_CONFIG_FILE) else None


def _is_file(path: str) -> bool:
    """``Path.is_file``, but a path the system cannot look at (a name too long, a
    folder this user may not enter) is a ConfigError saying why, not an OSError."""
    try:
        return Path(path).is_file()
    except OSError as exc:
        raise ConfigError(f"{printable(path)}: cannot look at the file ({exc.strerror})") from None


@frameless_on(ConfigError)
def load_settings(env: Mapping[str, str] | None = None, *, path: str | None = None) -> Settings:
    """What ``polygate.session()`` uses without settings.

    ``path`` (a command's ``--config``) when given, else ``POLYGATE_CONFIG`` (a TOML
    path) when set, else ``./polygate.toml`` when present, else the ``POLYGATE__…``
    keys.  Keys left unused beside a file are warned about, since a user setting both
    probably expects the keys to count.
    """
    source = os.environ if env is None else _checked_env(env)
    if not path:  # (--config "", a variable expanded empty: no file named)
        path = locate_config(source)
        if path is None:
            return settings_from_env(source)
        if source.get(CONFIG_ENV, "").strip() and not _is_file(path):
            raise ConfigError(f"{CONFIG_ENV} names {printable(path)}, which is not a file")
    settings = settings_from_toml(path, env=source)
    ignored = sorted(k for k, v in source.items() if k.upper().startswith(ENV_PREFIX) and v.strip())
    if ignored:
        config_warning(
            f"configuration read from {printable(path)}; "
            f"environment keys {printable(', '.join(ignored))} are ignored"
        )
    return settings


@frameless_on(ConfigError)
def given_settings(settings: Any, env: Mapping[str, str] | None) -> Settings:
    """The settings ``polygate.session()`` and ``open_server()`` run on: ``settings``,
    or, when it is None, the configuration :func:`load_settings` finds.  A wrong type
    of either argument is a :class:`ConfigError`; ``env`` is checked even beside
    settings, which leave it unused (a wrong argument is refused whatever else was
    passed)."""
    if settings is None:
        return load_settings(env)
    if not isinstance(settings, Settings):
        raise ConfigError(f"settings must be a polygate.Settings, got {type(settings).__name__}")
    if env is not None:
        _checked_env(env)
    return settings


# --------------------------------------------------------------------------- describe


def describe(settings: Settings) -> dict[str, Any]:
    """A JSON-able nested dict of the resolved settings, secrets shown as ``"***"``.

    Every field is listed, defaults included, so ``check-config`` shows what a
    session will actually run with.
    """
    return _describe(settings)


def _describe(obj: Any) -> dict[str, Any]:
    """Scalars first, then nested groups, then sources/scopes: reads top-down."""
    fields = sorted(attrs.fields(type(obj)), key=lambda f: _depth(getattr(obj, f.name)))
    return {f.name: _describe_value(f, getattr(obj, f.name)) for f in fields}


def _depth(value: Any) -> int:
    if attrs.has(type(value)):
        return 1
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return 0  # a list of strings is a scalar here (Scope.fallback_on)
    return 2 if isinstance(value, (tuple, Mapping)) else 0


def _describe_value(field: attrs.Attribute[Any], value: Any) -> Any:
    if _is_secret(field):
        return None if not value else "***"  # (no gateway keys: none, not "***")
    if attrs.has(type(value)):
        return _describe(value)
    if isinstance(value, tuple):
        return [_describe(v) if attrs.has(type(v)) else v for v in value]
    if isinstance(value, Mapping):
        return {k: _describe(v) if attrs.has(type(v)) else v for k, v in value.items()}
    if isinstance(value, str) and field.name in _URL_FIELDS:
        return mask_url(value)
    return value


#: The fields that hold a URL or a connection string (a password may be in them).
#: Any other text is shown as the session uses it: masked as if it were a URL, an
#: OCR prompt's "token=…" and a model named "team:llama@v2" came out altered.
_URL_FIELDS = frozenset({"base_url", "backend", "telemetry", "cache"})
