"""The docs name only what exists: files, settings, fields; nothing outside the repo.

mkdocs --strict checks links and anchors, and tests/_docs.py runs every example; this
checks the references that are neither: paths in backticks, the reserved names, every
setting and statistic being documented, and no citation of material the repository
does not hold.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

import polygate
from polygate._config import RESERVED_SEGMENTS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI = sorted((ROOT / "polygate" / "cli").glob("*.py"))


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", PAGES + CLI, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_cited_from_outside_the_repository(path: Path) -> None:
    # The design notes, the specification and the issue tracker are not in the
    # repository: a reader cannot follow "SPEC §5", "seed 000" or "issue #24".
    outside = re.compile(r"\bSPEC\b|§|\bseeds?[ -]0\d\d\b|\bissue[ -]?#\d+")
    found = [m.group(0) for m in outside.finditer(_text(path))]
    assert found == []


SOURCES = sorted((ROOT / "polygate").rglob("*.py"))


@pytest.mark.parametrize("path", PAGES + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_advice_installs_the_other_project(path: Path) -> None:
    """The name ``polygate`` on PyPI is another project's: ``pip install
    'polygate[serve]'`` installed that one (whose 0.3.0 replaced this package under
    ``-U``, with no ``polygate`` command).  Advice installs from the clone, or names
    the dependency itself."""
    assert re.findall(r"pip install [\"']?polygate\b", _text(path)) == []


_PATH = re.compile(r"`((?:polygate|tests|benchmarks|docs)/[\w./-]+\.(?:py|md|json|png))`")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_in_backticks_exist(path: Path) -> None:
    missing = [p for p in _PATH.findall(_text(path)) if not (ROOT / p).exists()]
    assert missing == []


def test_reserved_names_are_all_documented() -> None:
    text = _text(ROOT / "docs" / "configuration.md")
    scopes_row = next(line for line in text.splitlines() if line.startswith("| `scopes` |"))
    name_row = next(line for line in text.splitlines() if line.startswith("| `name` |"))
    for name in RESERVED_SEGMENTS:
        assert f"`{name}`" in scopes_row, name
        assert f"`{name}`" in name_row, name
    for name in ("BACKEND", "TELEMETRY"):
        assert f"`{name}`" in scopes_row


@pytest.mark.parametrize(
    "cls", [polygate.Settings, polygate.Scope, polygate.Source, polygate.Hedge,
            polygate.Retry, polygate.StreamWatch],
)
def test_every_setting_is_documented(cls: type) -> None:
    text = _text(ROOT / "docs" / "configuration.md")
    for field in attrs.fields(cls):
        assert f"| `{field.name}` |" in text, f"{cls.__name__}.{field.name}"


def test_every_statistic_is_documented() -> None:
    text = _text(ROOT / "docs" / "statistics.md")
    for field in attrs.fields(polygate.CallStats):
        assert f"| `{field.name}` |" in text, field.name


_DOC_REF = re.compile(r'docs/([\w-]+\.md)(?:``)?(?:,? (?:section )?"([^"\n]+)")?')


def _headings(page: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", _text(page), re.M)}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_a_comment_points_to_exist(path: Path) -> None:
    """A comment's ``docs/page.md`` exists, and the section it quotes is a heading of
    that page (comments once sent readers to a page never written and to headings
    since renamed)."""
    wrong = []
    for page, section in _DOC_REF.findall(_text(path)):
        target = ROOT / "docs" / page
        if not target.exists():
            wrong.append(page)
        elif section and section not in _headings(target):
            wrong.append(f'{page} "{section}"')
    assert wrong == []
