"""mkdocs hook: the README is the site's front page.

README.md lives at the repository root, outside ``docs/``, and links into ``docs/``
as ``docs/x.md`` (right for GitHub). The site gets it as ``index.md`` with those
links made relative to ``docs/``, so one file serves both and ``--strict`` still
checks every link in it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_ROOT = Path(__file__).resolve().parents[2]


def on_files(files: Files, config: Any) -> Files:
    text = (_ROOT / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"\]\(docs/", "](", text)
    files.append(File.generated(config, "index.md", content=text))
    return files
