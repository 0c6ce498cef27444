"""MkDocs hook: the site's home page is README.md itself, its links rewritten for the site.

The README links docs pages as `docs/guide/x.md` (so they work on GitHub); under docs_dir those are
`guide/x.md`. A link out of the repository (`../shared/DESIGN.md`) becomes plain text, since the site
cannot hold it. Wired in mkdocs.yml under `hooks:`; there is no docs/index.md to keep in step.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_OUTSIDE = re.compile(r"\[([^\]]*)\]\(\.\./[^)]*\)")


def for_site(text: str) -> str:
    """README markdown as docs/index.md would read it."""
    text = _OUTSIDE.sub(r"\1", text)
    return re.sub(r"\]\(docs/", "](", text)


def on_files(files, config):
    from mkdocs.structure.files import File

    old = files.get_file_from_path("index.md")
    if old is not None:
        files.remove(old)
    files.append(File.generated(config, "index.md", content=for_site(README.read_text())))
    return files
