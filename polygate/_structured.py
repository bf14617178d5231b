"""Structured output: a schema, the ways of asking a source for it, and the re-ask
loop (SPEC §8.1; seed 000 §4.5: "结构化重问 = 最后一轮", the last round's statistics).

::

    chat(messages, schema=Model | {...})
      └ logical call (one deadline, one id)
          ├ round 1: retry loop (admission, hedging, retries) → answer → validate
          ├ round 2: + assistant answer + user message quoting the problems → validate
          └ … at most Scope.structured.max_reasks re-asks, then StructuredOutputError

A schema is *prepared* once per call, before any I/O (:func:`prepare`): a pydantic v2
model class, or a JSON Schema dict checked against its metaschema and compiled once
(cached by its canonical JSON).  Neither → :class:`ConfigError`.

How a round asks depends on the source (``Source.structured_output``):

* ``"json_schema"`` (default): ``response_format={"type": "json_schema", "json_schema":
  {"name", "schema", "strict": true}}``, messages unchanged;
* ``"json_object"``: ``response_format={"type": "json_object"}`` and the schema in a
  system instruction;
* ``"prompt"``: the instruction alone, for upstreams that reject ``response_format``.

A caller who passed their own ``response_format`` gets it sent unchanged to every
source; polygate then only validates.  The conversation itself (what a re-ask
appends to) is mode-neutral: the instruction is added per attempt, so a round may
fail over between sources of different modes.

pydantic is never imported here: a model class can only come from a program that
has already imported it, so :func:`prepare` looks it up in ``sys.modules``.
``jsonschema`` (polygate's ``structured`` extra) is imported on the first dict
schema.  See ``docs/structured.md`` for why jsonschema and not fastjsonschema.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import trio

from ._config import Source, is_utf8
from ._context import ChatRequest
from ._errors import ConfigError, PolygateError, StructuredOutputError
from ._json import MAX_DEPTH, nested_deeper
from ._schema_bounds import Budget, OverBudget, SlowPattern, bounded_keywords, budget
from ._secrets import printable
from ._threads import NoThread, cpu_limiter, mock_clock, run_sync
from ._types import ChatResponse, encode_compact

__all__ = ["Schema", "StructuredRounds", "prepare", "schema_of"]

_MAX_PROBLEMS = 20
_MAX_PROBLEM_CHARS = 300
_TOO_DEEP_ANSWER = (
    f"$: nested too deeply to be read as JSON (deeper than {MAX_DEPTH} levels of arrays and objects)"
)
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = "$: not valid JSON (an escape of a lone surrogate, which is no Unicode character)"
# One Markdown code fence around the whole answer: three or more backticks or tildes,
# an optional info string (```json, ``` json), closed by the same fence (CommonMark).
# Only the opening line is a regular expression, and one that cannot backtrack (its
# classes do not overlap, its trailing blanks are stripped first): a single pattern
# for the whole answer took quadratic time on a long run of blanks (a 16 KB answer,
# half a second holding the GIL).
_FENCE_OPENING = re.compile(r"(`{3,}|~{3,})[ \t]*[A-Za-z0-9_+.-]*\Z")

INSTRUCTION = (
    "Answer with a single JSON value that matches this JSON Schema, and nothing else "
    "(no prose, no code fences):\n"
)
REASK = (
    "Your previous answer is not valid: it must be only a JSON value that matches the "
    "required JSON Schema.\nProblems:\n{problems}\nAnswer again with the corrected JSON only."
)


class Invalid(Exception):
    """An answer that is not JSON or does not match the schema; ``problems`` is one
    line per problem (``$.path: message``), already bounded in count and length."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class Schema:
    """A prepared schema: what to send (``name``, ``json_schema``) and how to check.

    An answer longer than ``off_loop_chars`` is validated in a worker thread: about
    5 ms of validation at that size (measured, ``benchmarks/structured.py``), so the
    event loop never stalls longer than that on one answer.
    """

    name: str
    json_schema: dict[str, Any]
    off_loop_chars: int
    #: ``json_schema`` in OpenAI's strict form (:func:`strict_form`), for a source that
    #: refused it as it is; None where it is the same, or is the caller's own words.
    strict_json_schema: dict[str, Any] | None = None

    def validate(self, text: str, limit: Budget | None = None, on_loop: bool = True) -> Any:
        """The validated value of ``text``; raises :class:`Invalid`, or
        :class:`OverBudget` once ``limit`` ends, where the validator can tell.
        ``on_loop``: called in the event loop's thread, not a worker thread."""
        raise NotImplementedError

    async def ready(self) -> None:
        """Finish preparing (a big JSON Schema is checked and compiled off the loop,
        inside the call's deadline); :class:`ConfigError` on a bad schema."""


# --------------------------------------------------------------------------- pydantic


class _ModelSchema(Schema):
    """A pydantic model, for one call (it holds the model)."""

    off_loop_chars = 32 * 1024  # pydantic-core: about 6 µs a kilobyte

    def __init__(
        self, model: type[Any], name: str, json_schema: dict[str, Any],
        strict_json_schema: dict[str, Any] | None,
    ) -> None:
        self.name = name
        self.json_schema = json_schema
        self.strict_json_schema = strict_json_schema
        self._validate_json = model.model_validate_json
        self._error_type: type[Exception] = sys.modules["pydantic"].ValidationError

    def validate(self, text: str, limit: Budget | None = None, on_loop: bool = True) -> Any:
        # (pydantic-core checks in Rust, holding the interpreter: no budget reaches it.)
        text = _unfenced(text)
        _refuse_constants(text)
        try:
            return self._validate_json(text)
        except self._error_type as exc:
            errors: Any = exc.errors(include_url=False, include_input=False)  # type: ignore[attr-defined]
            raise Invalid(_bounded(f"{_json_path(e['loc'])}: {e['msg']}" for e in errors)) from None


#: Each model's name and JSON Schema (building one takes milliseconds), for as long as
#: the model lives: nothing in a value refers to its model (a value that did kept
#: every model ever passed alive, a class made per request among them).
_models: weakref.WeakKeyDictionary[
    type[Any], tuple[str, dict[str, Any], dict[str, Any] | None]
] = (
    weakref.WeakKeyDictionary()
)


def _model_schema(model: type[Any]) -> _ModelSchema:
    prepared = _models.get(model)
    if prepared is None:
        prepared = _models[model] = _prepare(model)
    return _ModelSchema(model, *prepared)


def _prepare(model: type[Any]) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    """The model's name as sent, its JSON Schema and that schema's strict form (None
    when the same), or :class:`ConfigError`."""
    try:
        json_schema = model.model_json_schema()
    except Exception as exc:  # pydantic's PydanticUserError and friends
        raise ConfigError(
            f"schema: cannot build a JSON Schema for {model.__name__}: {_first_line(exc)}"
        ) from None
    # Sent upstream as the dict schema is, so checked as one: JSON (an infinite
    # default, an object from json_schema_extra are not) without a lone surrogate.
    try:
        text = json.dumps(json_schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"schema: the JSON Schema of {model.__name__} is not JSON ({_first_line(exc)})"
        ) from None
    _check_text(text)
    strict = strict_form(json_schema)
    return _safe_name(model.__name__), json_schema, (None if strict == json_schema else strict)


#: How many schema nodes the strict form may hold, as a multiple of the model's own
#: schema's: unravelling a ``$ref`` copies what it points to, and a model whose
#: sub-models are each referred to twice with a description would double at every
#: level.  Past it, a ``$ref`` keeps no other keyword (its description goes) instead.
_STRICT_GROWTH = 8
_STRICT_MIN_NODES = 10_000


class _Budget:
    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left


def strict_form(schema: dict[str, Any]) -> dict[str, Any] | None:
    """``schema`` (a pydantic model's) in OpenAI's strict form, as openai-python's
    ``parse()`` sends a model: every object closed (``additionalProperties: false``
    where the schema does not say) and every property in ``required`` (a field with a
    default is asked for too: the model validates it as before); a ``None`` default
    dropped (the field stays nullable); a ``oneOf`` (a discriminated union) as
    ``anyOf``; a ``$ref`` beside other keywords unravelled
    (strict mode refuses the pair) -- or, on a cycle or past a size bound, left alone
    without them; a one-schema ``allOf`` merged.  A copy: the model's own schema is
    left as it is.  None when it cannot be made (too deep to walk)."""
    pristine = json.loads(json.dumps(schema))  # (what a $ref points to, untouched)
    copied: dict[str, Any] = json.loads(json.dumps(schema))
    budget = _Budget(max(_STRICT_MIN_NODES, _STRICT_GROWTH * _count_nodes(pristine)))
    try:
        strict: dict[str, Any] = _strict(copied, pristine, (), budget)
    except RecursionError:
        return None
    return strict


def _count_nodes(value: Any) -> int:
    count, stack = 0, [value]
    while stack:
        node = stack.pop()
        count += 1
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def _strict(node: Any, root: dict[str, Any], path: tuple[str, ...], budget: _Budget) -> Any:
    """``node`` made strict in place; ``path``: the ``$ref`` targets being unravelled
    around it (one met again is a cycle)."""
    if not isinstance(node, dict):
        return node
    budget.left -= 1
    for group in ("$defs", "definitions"):
        defs = node.get(group)
        if isinstance(defs, dict):
            for name, value in defs.items():
                defs[name] = _strict(value, root, path, budget)
    if node.get("type") == "object" and "additionalProperties" not in node:
        node["additionalProperties"] = False
    properties = node.get("properties")
    if isinstance(properties, dict):
        node["required"] = list(properties)
        for name, value in properties.items():
            properties[name] = _strict(value, root, path, budget)
    if isinstance(node.get("items"), dict):
        node["items"] = _strict(node["items"], root, path, budget)
    if isinstance(node.get("oneOf"), list) and "anyOf" not in node:
        # (Strict mode takes no ``oneOf``: pydantic's discriminated union, whose tags
        # tell its branches apart, accepts the same answers as ``anyOf``.)
        node["anyOf"] = node.pop("oneOf")
        node.pop("discriminator", None)
    if isinstance(node.get("anyOf"), list):
        node["anyOf"] = [_strict(v, root, path, budget) for v in node["anyOf"]]
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        if len(all_of) == 1 and isinstance(all_of[0], dict):
            del node["allOf"]
            node.update(_strict(all_of[0], root, path, budget))
        else:
            node["allOf"] = [_strict(v, root, path, budget) for v in all_of]
    if "default" in node and node["default"] is None:
        del node["default"]
    ref = node.get("$ref")
    if isinstance(ref, str) and len(node) > 1:
        target = _local_target(root, ref)
        size = _count_nodes(target) if isinstance(target, dict) and ref not in path else None
        if size is None or size > budget.left:
            return {"$ref": ref}  # (a cycle, or past the bound: the reference alone)
        budget.left -= size
        # (The node's own keywords win over the target's, a description among them.)
        merged = {**json.loads(json.dumps(target)), **node}
        del merged["$ref"]
        return _strict(merged, root, (*path, ref), budget)
    return node


def _local_target(root: dict[str, Any], ref: str) -> Any:
    """The schema a local ``$ref`` ("#/$defs/Name") points to; None for any other."""
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value holds a string with a lone surrogate (a pair
    decodes to one character; one alone is not text)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _is_pydantic_model(obj: Any) -> bool:
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(obj, type):
        return False
    return issubclass(obj, pydantic.BaseModel)


# --------------------------------------------------------------------------- JSON Schema


#: An answer this shallow never exhausts the validator's recursion by its own depth.
_SHALLOW = 16


class _DictSchema(Schema):
    off_loop_chars = 2 * 1024  # jsonschema is pure Python: about 1 ms per 300 bytes

    def __init__(self, text: str) -> None:
        # The caller's dict as given, keys in their order: models generate properties
        # in schema order (OpenAI strict mode, guided decoding), and a schema that asks
        # for its reasoning before its answer means it.
        schema = json.loads(text)
        title = schema.get("title") if isinstance(schema, dict) else None
        self.name = _safe_name(title) if isinstance(title, str) and title else "response"
        self.json_schema = schema
        self._validator: Any = None

    @property
    def compiled(self) -> bool:
        return self._validator is not None

    def compile(self) -> None:
        """Check the schema against its metaschema and compile it: pure Python, ~1 s
        for a few thousand properties, so once per schema whatever its key order."""
        if self._validator is None:
            self._validator = _validator(json.dumps(self.json_schema, sort_keys=True, ensure_ascii=False))

    async def ready(self) -> None:
        if self._validator is None:
            # (Compiles of one schema by calls at once take turns: the first fills
            # _validator's cache, and the others find it there.)
            try:
                await run_sync(self.compile, abandon_on_cancel=True, limiter=cpu_limiter())
            except NoThread as exc:
                # Not compiled on the loop instead: seconds for a big schema (3 s for
                # 1 MB), every other call held meanwhile.
                raise PolygateError(
                    f"{exc}: a schema this large ({len(json.dumps(self.json_schema))} "
                    "characters) is compiled in one"
                ) from None

    def validate(self, text: str, limit: Budget | None = None, on_loop: bool = True) -> Any:
        text = _unfenced(text)
        if nested_deeper(text, MAX_DEPTH):
            raise Invalid([_TOO_DEEP_ANSWER])
        try:
            # (A float's range is looked at only where a number may pass it: rarely.)
            finite = _finite_float if _may_overflow(text) else None
            value = json.loads(text, parse_constant=_no_constant, parse_float=finite)
        except ValueError as exc:
            raise Invalid([f"$: not valid JSON ({exc})"]) from None
        except RecursionError:  # Python's decoder recurses a level per bracket
            raise Invalid(["$: nested too deeply to be read as JSON"]) from None
        if "\\u" in text and _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
            # As a model's answer is judged (pydantic's reader refuses it): the value
            # could be neither encoded nor sent back in the next turn.
            raise Invalid([_LONE_SURROGATE])
        validator = self._validator
        assert validator is not None, "validated before it was ready()"
        try:
            with budget(limit or _UNBOUNDED, on_loop=on_loop):
                if validator.is_valid(value):
                    return value
                errors = sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.path)))
        except OverBudget:
            raise
        except SlowPattern as exc:
            raise Invalid(_bounded([
                f"$: the pattern {exc.pattern!r} took over {exc.seconds:.3g} s on a string "
                "of the answer (it backtracks), so the answer was not checked further"
            ])) from None
        except RecursionError:
            if not nested_deeper(text, _SHALLOW):
                # Not the answer's depth: the schema loops in a way the check before
                # the request could not see.  Never the model's fault, never re-asked.
                raise ConfigError(
                    "schema: validation recursed without end on an answer "
                    f"at most {_SHALLOW} levels deep (the schema leads back to itself)"
                ) from None
            raise Invalid(["$: nested too deeply to be validated"]) from None  # too deep to walk
        except Exception as exc:  # a reference below a nested $id that does not resolve
            raise ConfigError(f"schema: cannot be applied ({_first_line(exc)})") from None
        raise Invalid(_bounded(f"{_json_path(e.absolute_path)}: {e.message}" for e in errors))


def _compile(schema: Any) -> Any:
    try:
        import jsonschema
        import referencing.jsonschema
        from jsonschema_specifications import REGISTRY  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            "schema: a JSON Schema dict needs the jsonschema package "
            "(pip install 'jsonschema>=4.22' 'regex>=2023.12.25': polygate's structured extra)"
        ) from None
    if isinstance(schema, dict) and "$schema" in schema and not isinstance(schema["$schema"], str):
        raise ConfigError("schema: $schema must be a string (the URI of a draft)")
    if isinstance(schema, dict):
        _known_dialects(schema, jsonschema.validators.validator_for)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
        draft = _draft_of(schema, referencing.jsonschema, REGISTRY)
        dangling = _dangling(schema, draft, cls.check_schema)
    except RecursionError:
        # Encodable, but deeper than the metaschema check can follow (~100 levels of
        # properties): no validator could use it either.
        raise ConfigError(
            "schema: nested too deeply to be a JSON Schema (for jsonschema to check)"
        ) from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ConfigError(
            f"schema: not a valid JSON Schema{f' at {where}' if where else ''}: "
            f"{_first_line(exc.message)}"
        ) from None
    if dangling is not None:
        keyword, ref, problem = dangling
        raise ConfigError(f"schema: {keyword} {ref!r} {problem}")
    loop = _in_place_loop(schema, draft, frozenset(cls.VALIDATORS))
    if loop is not None:
        raise ConfigError(
            f"schema: {loop} leads back to a schema it came from without descending "
            "into the answer, so validating any answer would never end"
        )
    # Its patterns matched in bounded time, not by Python's backtracking re.
    bounded = jsonschema.validators.extend(
        cls, bounded_keywords(cls.VALIDATORS, jsonschema.ValidationError)
    )
    # Checked: in a schema of one draft, its "$schema"s have said all they had to.
    # Left in, each would hand the walk below it back to jsonschema's own class (a
    # descent picks its class by the subschema's $schema), its re and its unbounded
    # walk: a root's "$schema" with a {"$ref": "#"} was enough.  A schema that mixes
    # drafts keeps them all: there a $schema also says which draft's rules apply
    # below it (a 2020-12 subschema inside a draft-07 resource), and taken out, the
    # surrounding draft's would (docs/structured.md: such a schema is not bounded).
    declaring = list(_declaring(schema))
    if all(jsonschema.validators.validator_for(node, default=None) is cls for node in declaring):
        for node in declaring:
            del node["$schema"]
    # The registry of the drafts' metaschemas, which never retrieves: without it,
    # jsonschema fetches an unknown URI over the network while validating an answer.
    return bounded(schema, registry=REGISTRY)


def _known_dialects(schema: dict[str, Any], validator_for: Callable[..., Any]) -> None:
    """Every ``$schema`` of a (private, freshly parsed) schema, the root's and its
    embedded resources', made the URI jsonschema knows its draft by, in place.  One it
    does not know is a ConfigError: read as 2020-12 (jsonschema's default, with a
    warning it means to turn into an error), a draft-07 schema's ``dependencies``
    would check nothing, and wrong answers would pass.  A json-schema.org URI with the
    other scheme (http for 2020-12, https for draft-07) is taken as the draft.

    (Walked as :func:`_subschemas` walks, without its resolvers: this runs before the
    root's draft, which they need, is known.)"""
    for node in _declaring(schema):
        node["$schema"] = _known_dialect(node["$schema"], validator_for)


def _declaring(schema: Any) -> Iterator[dict[str, Any]]:
    """The schemas in ``schema`` (itself included) that declare their draft with a
    ``$schema`` string; data (``const``, ``enum``, …) is not walked."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("$schema"), str):
            yield node
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                continue
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                stack.extend(value.values())
            else:
                stack.append(value)


def _known_dialect(dialect: str, validator_for: Callable[..., Any]) -> str:
    if validator_for({"$schema": dialect}, default=None) is not None:
        return dialect
    scheme, sep, rest = dialect.partition("://")
    if sep and rest.startswith("json-schema.org/") and scheme in ("http", "https"):
        other = ("https" if scheme == "http" else "http") + "://" + rest
        if validator_for({"$schema": other}, default=None) is not None:
            return other
    shown = printable(dialect if len(dialect) <= 120 else dialect[:119] + "…")
    raise ConfigError(
        f"schema: $schema {shown!r} names no JSON Schema draft polygate knows "
        "(draft-03, -04, -06, -07, 2019-09 or 2020-12, by their URIs)"
    )


# Keywords whose values are data, not subschemas: a "$ref" key in them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})
# Keywords whose values map names to subschemas: their keys are names, not keywords
# (a property may be called "default").
_NAMED_SCHEMAS = frozenset({
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies",
})


class _Draft(NamedTuple):
    """What both walks of a checked schema read from its root's draft."""

    spec: Any  # referencing's specification of the draft
    drafts: Any  # referencing.jsonschema, whose DRAFT* constants ``spec`` is one of
    legacy: bool  # before 2019-09: a $ref hides its siblings
    root: Any  # a resolver for the root resource


def _draft_of(schema: Any, drafts: Any, metaschemas: Any) -> _Draft:
    """The root's draft (its ``$schema``, else 2020-12, as for jsonschema) and a resolver
    for it, its embedded resources crawled once."""
    dialect = schema.get("$schema") if isinstance(schema, dict) else None
    spec = (
        drafts.specification_with(dialect, default=drafts.DRAFT202012)
        if isinstance(dialect, str) else drafts.DRAFT202012
    )
    legacy = spec in (drafts.DRAFT3, drafts.DRAFT4, drafts.DRAFT6, drafts.DRAFT7)
    return _Draft(spec, drafts, legacy, _root_resolver(spec.create_resource(schema), metaschemas))


def _in_own_resource(spec: Any, node: dict[str, Any], resolver: Any) -> Any:
    """The resolver for ``node``'s references: its own, when it is an embedded resource
    (it has an ``$id``, ``id`` before draft-06)."""
    if isinstance(spec.id_of(node), str):
        return resolver.in_subresource(spec.create_resource(node))
    return resolver


def _dangling(
    schema: Any, draft: _Draft, check: Callable[[Any], None],
) -> tuple[str, str, str] | None:
    """The first reference of a checked schema that does not resolve, or resolves to
    something that is not a valid schema (``check``: the draft's metaschema check), as
    ``(keyword, reference, what is wrong)``, or None.

    Every key is walked but data (a ``$ref`` can point anywhere: ``#/components/...``),
    with an explicit stack (a long chain of references must not exhaust Python's), and
    each reference is resolved as the validator resolves it: against the base of the
    resource it sits in, which an embedded resource sets with its own ``$id`` (``id``
    before draft-06; the root's draft decides, as for jsonschema).  Before 2019-09 a
    ``$ref`` hides its siblings: they are not walked, but what it points to is.  A
    reference that resolves against the root's base instead is let through: jsonschema
    does not take every embedded ``$id`` as a base (one directly under ``not``, say),
    and refusing a schema it uses would be worse than finding the rare dangling one
    when an answer is validated (a ConfigError then too)."""
    spec, root = draft.spec, draft.root
    seen: set[int] = set()
    checked: set[int] = set()  # reference targets checked as schemas (by id)
    # (node, its resolver, whether its keys are names, whether it is the root)
    stack: list[tuple[Any, Any, bool, bool]] = [(schema, root, False, True)]
    while stack:
        node, resolver, names, is_root = stack.pop()
        if isinstance(node, list):
            stack.extend((item, resolver, False, False) for item in reversed(node))
            continue
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if names:
            stack.extend((value, resolver, False, False) for value in reversed(node.values()))
            continue
        if not is_root:
            resolver = _in_own_resource(spec, node, resolver)
        dynamic = node.get("$dynamicRef")
        if spec is draft.drafts.DRAFT202012 and isinstance(dynamic, str):
            # Resolved first as a $ref is: it must resolve, to a schema.
            target = _target(resolver, root, dynamic)
            problem = _unusable(target, check, checked)
            if problem is not None:
                return "$dynamicRef", dynamic, problem
            stack.append((target.contents, target.resolver, False, False))
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _target(resolver, root, ref)
            problem = _unusable(target, check, checked)
            if problem is not None:
                return "$ref", ref, problem
            # What it points to is walked too: it may sit where nothing else walks
            # (inside data, under a key no draft knows), and its references must resolve.
            stack.append((target.contents, target.resolver, False, False))
            if draft.legacy:
                continue
        stack.extend(
            (value, resolver, key in _NAMED_SCHEMAS, False)
            for key, value in reversed(node.items()) if key not in _DATA_KEYWORDS
        )
    return None


# Keywords that apply their subschemas to the instance itself, not to a part of it: a
# cycle through them alone (``{"$ref": "#"}``) never ends, whatever the answer.
# Each with the keyword its draft's validator knows it by (then and else are if's).
_IN_PLACE_ONE = {"not": "not", "if": "if", "then": "if", "else": "if"}
# A list of subschemas, or one.  Draft-3 also applies in place its extends, its
# disallow (its not) and the schemas in a type list (beside type names, which are no
# objects and so never followed; later drafts' metaschemas refuse schemas there).
_IN_PLACE_MANY = ("allOf", "anyOf", "oneOf", "extends", "disallow", "type")
_IN_PLACE_NAMED = ("dependentSchemas", "dependencies")
_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")


def _in_place_loop(schema: Any, draft: _Draft, keywords: frozenset[str]) -> str | None:
    """How a checked schema leads back to itself without descending into the instance,
    as ``"$ref '#'"`` or ``"allOf"``, or None.

    JSON Schema forbids such a schema (its validation never ends); jsonschema takes
    it and then recurses until Python's limit on every answer, which would otherwise
    read as the answer's fault.  References are followed as :func:`_dangling` resolves
    them; a ``$dynamicRef`` is taken as a plain reference (its dynamic target is one
    the same walk reaches).  Before 2019-09 a ``$ref`` hides its siblings.  Only the
    ``keywords`` of the schema's draft are followed (its validator's): ``if`` means
    nothing to draft-04, ``dependencies`` nothing to 2020-12."""
    if not isinstance(schema, dict):
        return None
    spec, root = draft.spec, draft.root

    def steps(node: dict[str, Any], resolver: Any) -> Iterator[tuple[Any, Any, bool, str]]:
        """(subschema, its resolver, whether reached through a reference, keyword)."""
        for keyword in _REFERENCES:
            ref = node.get(keyword)
            if isinstance(ref, str) and keyword in keywords:
                # A $recursiveRef is "#" whatever it says (2019-09; jsonschema reads it
                # so): its loops are those through the root of its resource.
                target = _target(resolver, root, "#" if keyword == "$recursiveRef" else ref)
                if target is not None:
                    yield target.contents, target.resolver, True, f"{keyword} {ref!r}"
                if draft.legacy and keyword == "$ref":
                    return
        for keyword, known_as in _IN_PLACE_ONE.items():
            if keyword in node and known_as in keywords:
                yield node[keyword], resolver, False, keyword
        for keyword in _IN_PLACE_MANY:
            value = node.get(keyword) if keyword in keywords else None
            for item in value if isinstance(value, list) else [value]:
                yield item, resolver, False, keyword
        for keyword in _IN_PLACE_NAMED:
            value = node.get(keyword) if keyword in keywords else None
            if isinstance(value, dict):
                for item in value.values():
                    yield item, resolver, False, keyword

    def enter(node: dict[str, Any], resolver: Any, via_ref: bool) -> Iterator[tuple[Any, Any, bool, str]]:
        if not via_ref and node is not schema:
            resolver = _in_own_resource(spec, node, resolver)
        return steps(node, resolver)

    # A depth-first search over the in-place steps alone, from every subschema (a loop
    # may sit under a property), each subschema searched once.
    done: set[int] = set()
    for start, resolver in _subschemas(schema, spec, root):
        if id(start) in done:
            continue
        on_path = {id(start)}
        path = [(start, steps(start, resolver))]
        while path:
            node, children = path[-1]
            for child, child_resolver, via_ref, keyword in children:
                if not isinstance(child, dict) or id(child) in done:
                    continue
                if id(child) in on_path:
                    return keyword
                on_path.add(id(child))
                path.append((child, enter(child, child_resolver, via_ref)))
                break
            else:
                path.pop()
                on_path.discard(id(node))
                done.add(id(node))
    return None


def _subschemas(schema: Any, spec: Any, root: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    """Every object of a schema that is a schema, with the resolver of the resource it
    sits in (as :func:`_dangling` walks them: data skipped, names not keywords)."""
    stack: list[tuple[Any, Any, bool]] = [(schema, root, False)]
    seen: set[int] = set()
    while stack:
        node, resolver, names = stack.pop()
        if isinstance(node, list):
            stack.extend((item, resolver, False) for item in node)
            continue
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if names:
            stack.extend((value, resolver, False) for value in node.values())
            continue
        if node is not schema:
            resolver = _in_own_resource(spec, node, resolver)
        yield node, resolver
        stack.extend(
            (value, resolver, key in _NAMED_SCHEMAS)
            for key, value in node.items() if key not in _DATA_KEYWORDS
        )


def _root_resolver(root: Any, metaschemas: Any) -> Any:
    """A resolver for ``root``, its embedded resources crawled once (looked up lazily,
    each reference to one crawled the whole schema again: quadratic)."""
    uri = root.id() or ""
    try:
        return metaschemas.with_resource(uri, root).crawl().resolver(base_uri=uri)
    except Exception:  # a shape referencing's walker cannot crawl: looked up lazily
        return metaschemas.resolver_with_root(root)


def _unusable(target: Any, check: Callable[[Any], None], checked: set[int]) -> str | None:
    """What makes a reference's :func:`_target` unusable to a validator, or None.

    A pointer may reach any value of the document (``#/required/0``, ``#/$defs/a/type``,
    a map of property names, an object under a key no draft knows); only a valid schema
    will do.  jsonschema would take such a target and fail on the first answer it
    validates, after the request (and an answer that is not JSON never reaches it: the
    model would be re-asked for the schema's fault).  A target is checked against the
    draft's metaschema once (``checked``: their ids)."""
    if target is None:
        return "does not resolve inside the schema (polygate never fetches remote schemas)"
    contents = target.contents
    if not isinstance(contents, (dict, bool)):
        kind = type(contents).__name__
        return f"points to a value that is not a schema (a {kind}: a schema is an object)"
    if isinstance(contents, dict) and id(contents) not in checked:
        checked.add(id(contents))
        try:
            check(contents)
        except Exception as exc:  # jsonschema's SchemaError (imported where it is used)
            message = getattr(exc, "message", None) or str(exc)
            return f"points to an object that is not a valid schema: {_first_line(message)}"
    return None


def _target(resolver: Any, root: Any, ref: str) -> Any:
    """What ``ref`` resolves to (a ``referencing`` Resolved), against the resource's
    base or else the root's; None if neither."""
    return _resolved(resolver, ref) or _resolved(root, ref)


def _resolved(resolver: Any, ref: str) -> Any:
    """``resolver.lookup(ref)``, or None.  Any failure counts: a pointer through a
    number or past a list's end raises TypeError or ValueError in ``referencing``, and
    a schema ``referencing`` cannot crawl raises what it raises, where validation would
    fail the same way."""
    try:
        return resolver.lookup(ref)
    except RecursionError:
        raise
    except Exception:
        return None


@functools.lru_cache(maxsize=128)
def _validator(canonical: str) -> Any:
    """The compiled validator of a schema, by its canonical JSON (key order does not
    make a new one)."""
    return _compile(json.loads(canonical))


@functools.lru_cache(maxsize=128)
def _dict_schema(text: str) -> _DictSchema:
    """One per schema (the key is its JSON, keys in the caller's order), compiled once
    and kept (LRU)."""
    return _DictSchema(text)


#: A schema up to this much JSON is checked and compiled where it is given, so a bad
#: one is a ConfigError from ``chat()`` itself (a few ms at most); a bigger one off
#: the loop at the start of the call, under its deadline (then the ConfigError comes
#: from the call, still before any I/O; from a stream's first ``__anext__``).
_INLINE_COMPILE_CHARS = 1024


# --------------------------------------------------------------------------- helpers


def _safe_name(name: str) -> str:
    """``json_schema.name`` must match ``^[A-Za-z0-9_-]{1,64}$`` (OpenAI)."""
    return _NAME_UNSAFE.sub("_", name)[:64] or "response"


def _first_line(exc: Any) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: Every digit as ``0``, ``E`` as ``e``: see _may_overflow.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_RUN = b"0" * 210


def _may_overflow(text: str) -> bool:
    """Whether a number in ``text`` may pass a float's range (1.8e308): an exponent of
    three digits or more (``e123``, ``E+123``), or 210 digits in a row (with an
    exponent of two, 1e99, enough).  Then the exact reader looks (rarely).

    Every answer validated is asked, so it is found by bytes' own searches over the
    text with its digits made one, ~3 ns a byte: a regular expression for the same
    took ~22 ns a character (68 µs a kilobyte, 2.5 ms for a 37 KB answer on the
    event loop, three times pydantic's whole validation), and one tried at every
    digit held the loop 1.5 s over 8 MB of them.  (``surrogatepass``: a model's
    answer can hold a lone surrogate, which the exact reader then refuses.)"""
    data = text.encode("utf-8", "surrogatepass").translate(_DIGITS_AS_ZERO)
    return data.find(_LONG_RUN) >= 0 or data.find(b"e000") >= 0 or data.find(b"e+000") >= 0


def _finite_float(text: str) -> float:
    """A JSON number read as a float; one past a float's range (Python reads 1e400 as
    infinity, which JSON cannot carry, nor the answer be sent back) is no JSON."""
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= 24 else text[:23] + "…"
        raise _NotJson(f"{shown} is out of a number's range")
    return value


def _no_constant(name: str) -> Any:
    """NaN, Infinity and -Infinity are no JSON (Python's decoder reads them): an answer
    holding one is not valid JSON, so it is re-asked."""
    raise _NotJson(f"{name} is not JSON")


def _refuse_constants(text: str) -> None:
    """pydantic-core's JSON reader takes NaN and Infinity, which are no JSON, and reads
    a number past a float's range as infinity: an answer holding one outside a string
    is refused as the dict schema's reader refuses it.  The standard reader looks only
    when the words, or such a number, may appear at all (rarely)."""
    overflow = _may_overflow(text)
    if "NaN" not in text and "Infinity" not in text and not overflow:
        return
    try:
        json.loads(text, parse_constant=_no_constant, parse_float=_finite_float if overflow else None)
    except _NotJson as exc:
        raise Invalid([f"$: not valid JSON ({exc})"]) from None
    except (ValueError, RecursionError):
        pass  # not JSON for another reason: pydantic's own message says which


class _NotJson(ValueError):
    pass


def _json_path(loc: Iterable[Any]) -> str:
    """``$.a[0].b``; a key that is no plain name as a JSON string (``$["k\\n…"]``): a
    key of the answer's, holding a line break or an escape sequence, split a problem
    into two lines, forged one, and reached the next round's prompt as such."""
    return "$" + "".join(
        f"[{p}]" if isinstance(p, int) else f".{p}" if _PLAIN_KEY.fullmatch(str(p))
        # (json.dumps escapes what is below U+0020; printable the rest that splits a
        # line or turns text around: U+2028, U+0085, a bidi override)
        else f"[{printable(json.dumps(str(p), ensure_ascii=False))}]"
        for p in loc
    )


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _bounded(lines: Any) -> list[str]:
    """At most ``_MAX_PROBLEMS`` problems, each at most ``_MAX_PROBLEM_CHARS`` long:
    they go back to the model and into the error, so an absurd answer stays small."""
    out: list[str] = []
    extra = 0
    for line in lines:
        if len(out) == _MAX_PROBLEMS:
            extra += 1
            continue
        out.append(line if len(line) <= _MAX_PROBLEM_CHARS else line[:_MAX_PROBLEM_CHARS - 1] + "…")
    if extra:  # the last line says how many more: 20 lines in all
        out[-1] = f"… and {extra + 1} more"
    return out or ["$: does not match the schema"]


def _unfenced(text: str) -> str:
    """The JSON inside a single Markdown code fence (models often add one in the
    prompt modes); anything else unchanged."""
    if "```" not in text and "~~~" not in text:
        return text
    stripped = text.strip()
    newline = stripped.find("\n")
    if newline < 0:
        return text
    line = stripped[:newline]
    opening = _FENCE_OPENING.match((line[:-1] if line.endswith("\r") else line).rstrip(" \t"))
    if opening is None:
        return text
    fence = opening.group(1)
    if not stripped.endswith(fence):
        return text
    # Between the opening line and the closing fence: the blanks before the fence and
    # one line break (CR LF, LF or CR) are not the body's.
    body = stripped[newline + 1 : len(stripped) - len(fence)].rstrip(" \t")
    if body.endswith("\n"):
        body = body[:-1]
    return body[:-1] if body.endswith("\r") else body


def schema_of(schema: Any) -> Schema:
    """A prepared :class:`Schema`, or :class:`ConfigError` (before any I/O)."""
    if _is_pydantic_model(schema):
        if not hasattr(schema, "model_validate_json"):
            raise ConfigError("schema: pydantic v1 models are not supported; use a pydantic v2 model")
        return _model_schema(schema)
    if isinstance(schema, Mapping):
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"schema: a JSON Schema dict must be JSON-serialisable ({exc})") from None
        except RecursionError:
            raise ConfigError("schema: nested too deeply to be a JSON Schema") from None
        if nested_deeper(text, MAX_DEPTH):
            raise ConfigError(
                "schema: nested too deeply to be a JSON Schema "
                f"(deeper than {MAX_DEPTH} levels of arrays and objects)"
            )
        _check_text(text)
        prepared = _dict_schema(text)
        if not prepared.compiled and len(text) <= _INLINE_COMPILE_CHARS:
            prepared.compile()
        return prepared
    what = schema.__name__ if isinstance(schema, type) else type(schema).__name__
    raise ConfigError(
        f"schema must be a pydantic v2 model class or a JSON Schema dict, got {what}"
    )


def _check_text(text: str) -> None:
    """A schema is sent: a lone surrogate in it (no Unicode text) is refused, as in
    the messages."""
    if not is_utf8(text):
        raise ConfigError("schema: holds a lone surrogate (e.g. U+D800), which is not valid Unicode")


# --------------------------------------------------------------------------- the rounds


def _with_instruction(
    messages: Sequence[Mapping[str, Any]], instruction: str
) -> list[Mapping[str, Any]]:
    """The instruction merged into a leading system message, else prepended as one
    (several chat templates accept a single system message, first)."""
    first = messages[0] if messages else None
    if first is not None and first.get("role") == "system":
        content = first.get("content")
        if isinstance(content, str):
            return [{**first, "content": f"{content}\n\n{instruction}"}, *messages[1:]]
        if isinstance(content, list):  # OpenAI's array of content parts
            part = {"type": "text", "text": instruction}
            return [{**first, "content": [*content, part]}, *messages[1:]]
        if content is None:
            return [{**first, "content": instruction}, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


@attrs.define(eq=False)
class StructuredRounds:
    """The :class:`~polygate._call.Rounds` of one structured call.

    ``errors`` collects each invalid round's problems; the loop ends within
    ``max_reasks + 1`` rounds whatever the upstream says: ``after_round`` either
    accepts, asks again (at most ``max_reasks`` times), or raises.
    """

    schema: Schema
    params: Mapping[str, Any]
    max_reasks: int
    errors: list[str] = attrs.field(factory=list)
    _caller_format: bool = attrs.field(init=False)
    _forms: dict[str, ChatRequest] = attrs.field(init=False, factory=dict)
    _round_key: str | None = attrs.field(init=False, default=None)
    #: The characters the schema adds to each request's prompt, in whichever form a
    #: source takes it (its JSON in a ``response_format``, or after the instruction):
    #: reserved with the messages.  0 with the caller's own ``response_format``,
    #: counted in its parameters.
    prompt_chars: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        # ``response_format=None`` is no format of the caller's: polygate's is sent
        # (and in the instruction-only mode, none at all).
        self._caller_format = self.params.get("response_format") is not None
        if "response_format" in self.params and not self._caller_format:
            self.params = {k: v for k, v in self.params.items() if k != "response_format"}
        if not self._caller_format:
            self.prompt_chars = len(INSTRUCTION) + len(encode_compact(self.schema.json_schema))

    def request(
        self, source: Source, messages: Sequence[Mapping[str, Any]], messages_json: str,
        *, strict: bool = False,
    ) -> ChatRequest | None:
        """The round's request to ``source``; ``strict``: the source takes a model's
        schema in strict form only (it refused one that was not)."""
        if self._caller_format:
            return None  # the caller's own response_format: sent as is, only validated
        if messages_json != self._round_key:  # a new round: forms are per round
            self._forms.clear()
            self._round_key = messages_json
        mode = source.structured_output
        strict = strict and mode == "json_schema" and self.schema.strict_json_schema is not None
        key = "json_schema strict" if strict else mode
        form = self._forms.get(key)
        if form is None:
            form = self._forms[key] = self._form(mode, messages, messages_json, strict)
        return form

    def _form(
        self, mode: str, messages: Sequence[Mapping[str, Any]], messages_json: str,
        strict: bool = False,
    ) -> ChatRequest:
        if mode == "json_schema":
            strict_schema = self.schema.strict_json_schema
            response_format = {
                "type": "json_schema",
                "json_schema": {
                    "name": self.schema.name,
                    "schema": strict_schema if strict and strict_schema is not None
                    else self.schema.json_schema,
                    "strict": True,
                },
            }
            return ChatRequest(messages_json, {**self.params, "response_format": response_format},
                               loose_schema=not strict and strict_schema is not None)
        instruction = INSTRUCTION + encode_compact(self.schema.json_schema)
        instructed = encode_compact(_with_instruction(messages, instruction))
        if mode == "json_object":
            return ChatRequest(instructed, {**self.params, "response_format": {"type": "json_object"}})
        return ChatRequest(instructed, self.params)

    async def after_round(
        self, response: ChatResponse, messages: Sequence[Mapping[str, Any]]
    ) -> ChatResponse | list[Mapping[str, Any]]:
        if not_an_answer(response):
            return response
        text = response.text
        try:
            parsed = await self._validated(text)
        except Invalid as exc:
            self.errors.append("\n".join(exc.problems))
            if len(self.errors) > self.max_reasks:
                rounds = len(self.errors)
                raise StructuredOutputError(
                    f"no answer matched the schema {self.schema.name!r} in {rounds} round(s) "
                    f"({rounds - 1} re-ask(s)); see .errors",
                    errors=list(self.errors), text=text, call_stats=response.call_stats,
                ) from None
            problems = "\n".join(f"- {p}" for p in exc.problems)
            return [
                *messages,
                {"role": "assistant", "content": text},
                {"role": "user", "content": REASK.format(problems=problems)},
            ]
        return attrs.evolve(response, parsed=parsed)


    async def ready(self) -> None:
        await self.schema.ready()

    def cache_key(self) -> Any:
        return {"name": self.schema.name, "schema": self.schema.json_schema}

    async def accept(self, response: ChatResponse) -> ChatResponse | None:
        """A cached answer was valid when stored; it is validated again to build
        ``parsed`` (and refused, as a miss, should it not be)."""
        await self.schema.ready()
        if not_an_answer(response):
            return response
        text = response.text
        try:
            parsed = await self._validated(text)
        except Invalid:
            return None
        return attrs.evolve(response, parsed=parsed)

    async def _validated(self, text: str) -> Any:
        """``text`` validated, or :class:`Invalid`.  A short answer is checked on the
        event loop, for at most ``_ON_LOOP_S``; a long one, or one whose check runs
        past that (a recursive union's walk is exponential in the answer's nesting),
        in a worker thread, within the call's time.  Abandoned when the call's deadline
        passes (or the caller cancels), so the call ends on time; the thread then
        stops itself at the same instant, or sooner (the budget: every step of a
        JSON Schema's walk looks at it; a pydantic model's Rust check does not)."""
        schema = self.schema
        if len(text) <= schema.off_loop_chars:
            try:
                return schema.validate(text, Budget(time.monotonic() + _ON_LOOP_S))
            except OverBudget:
                pass  # (the rest in a thread; the loop has waited long enough)
        seconds = _OFF_LOOP_S
        ends = math.inf
        if mock_clock() is None:
            # (Under a MockClock the time left is virtual, and held still while the
            # thread works: no measure of the real seconds it may take.)
            left = trio.current_effective_deadline() - trio.current_time()
            seconds = min(left, seconds)
            ends = time.monotonic() + left

        limit = Budget(ends)

        def check() -> Any:
            # _OFF_LOOP_S of work from the thread's start (a wait for one of the few
            # threads, cpu_limiter's, is no fault of the answer's: judged over budget
            # for it, a paid re-ask), never past the call's deadline.
            limit.until = min(time.monotonic() + _OFF_LOOP_S, ends)
            return schema.validate(text, limit, False)

        try:
            return await run_sync(check, abandon_on_cancel=True, limiter=cpu_limiter())
        except OverBudget:
            raise Invalid([
                f"$: checking the answer against the schema took over {seconds:.3g} s (a "
                "union of shapes that nest is tried shape by shape, and a long answer "
                "takes long), so it was not checked"
            ]) from None
        except NoThread:
            pass  # (checked on the loop, below)
        finally:
            limit.stop()  # (cancelled, the call does not wait for the thread: it stops)
        # No thread can start (the process's thread limit): checked on the loop, within
        # the loop's own budget, not the thread's (a hostile answer held the loop, and
        # every other call, for the thread's 60 s).
        try:
            return schema.validate(text, Budget(time.monotonic() + _ON_LOOP_S))
        except OverBudget:
            raise Invalid([
                f"$: checking the answer against the schema takes over {_ON_LOOP_S:.3g} s, "
                "and this process ran out of threads to check it in (can't start new "
                "thread), so it was not checked"
            ]) from None


#: No bound: a check nobody waits on in bounded time (``validate()`` called directly).
_UNBOUNDED = Budget(math.inf)
#: How long an answer is checked on the event loop before the rest of its check goes
#: to a worker thread: 2 KiB of JSON takes a JSON Schema a few ms (1 ms per 300
#: bytes), where a recursive union's walk can take seconds on 300 characters.
_ON_LOOP_S = 0.03
#: The most one answer is checked in a worker thread when the call has no deadline.
_OFF_LOOP_S = 60.0


def not_an_answer(response: ChatResponse) -> bool:
    """Tool calls (the model chose a tool; a legacy ``function_call`` too) or a refusal,
    and no content: nothing to validate and nothing a re-ask would mend.  The response
    is returned as it is, ``parsed=None``, as the OpenAI SDK's ``parse()`` returns it;
    re-asking would drop the calls or the refusal and pay for rounds the model already
    declined."""
    message = response.message
    # (Blanks are no content: a tool parser may leave "\n\n" before its calls.)
    return not response.text.strip() and bool(
        message.get("tool_calls") or message.get("function_call") or message.get("refusal"))


def prepare(schema: Any, params: Mapping[str, Any], max_reasks: int) -> StructuredRounds:
    """The rounds of one structured call; :class:`ConfigError` on a bad schema."""
    return StructuredRounds(schema_of(schema), params, max_reasks)
