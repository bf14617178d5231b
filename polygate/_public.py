"""Naming a package's public objects after the package, not their private modules.

``polygate.ChatResponse`` is defined in ``polygate._types``; tracebacks, reprs and
pickles say ``polygate.ChatResponse`` (as trio does), so its ``__module__`` is the
public one.  Its annotations are strings (``from __future__ import annotations``),
which ``typing.get_type_hints``, ``attrs.resolve_types`` and libraries built on them
(cattrs, pydantic's dataclass support) evaluate in the namespace of ``__module__``:
the public package's, which has no ``Any``, ``Mapping`` or ``Outcome``, so they
raised NameError.  They are evaluated here first, in the module that wrote them.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

__all__ = ["publish"]


def publish(namespace: MutableMapping[str, Any], names: Iterable[str], module: str) -> None:
    """Give each of ``names`` in ``namespace`` (a package's globals) ``module`` as its
    ``__module__``, its own annotations evaluated where they were written."""
    for name in names:
        obj = namespace[name]
        defined = getattr(obj, "__module__", "")
        if not defined.startswith(f"{module}._"):
            continue  # (a function re-exported as is, an object of another package)
        if isinstance(obj, type):
            _evaluate_annotations(obj, vars(sys.modules[defined]))
        try:
            obj.__module__ = module
        except (AttributeError, TypeError):
            pass


def _evaluate_annotations(cls: type, namespace: dict[str, Any]) -> None:
    own = inspect.get_annotations(cls)  # (its own, not its bases')
    if not own:
        return
    evaluated = {}
    for key, value in own.items():
        if isinstance(value, str):
            try:
                # The class's own annotation, in the module that wrote it (what
                # typing.get_type_hints would do with the right module).
                value = eval(value, namespace)
            except Exception:  # a name only a type checker imports: left as written
                pass
        evaluated[key] = value
    cls.__annotations__ = evaluated
