"""Every `docs/<name>.md` the code and the README point a reader to exists, and so does each `#section` they name."""

from __future__ import annotations

import re

import pytest

from tests.support import REPO

pytestmark = pytest.mark.unit

WHERE = ["eagle3_ray", "ray_jobs", "bench", "gpu_machine", "scripts", "README.md"]
REFERENCE = re.compile(r"docs/([A-Za-z0-9_./-]+\.md)(?:#([A-Za-z0-9_-]+))?")


def references() -> dict[tuple[str, str | None], list[str]]:
    """(doc file, section anchor or None) -> where it is named, as `path:line`."""
    found: dict[tuple[str, str | None], list[str]] = {}
    for top in WHERE:
        root = REPO / top
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                for m in REFERENCE.finditer(line):
                    found.setdefault((m.group(1), m.group(2)), []).append(f"{path.relative_to(REPO)}:{number}")
    return found


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_docs_file_and_section_the_code_names_exists():
    found = references()
    assert found, "no docs/<name>.md reference found: the pattern or the paths are wrong"
    missing = []
    for (name, anchor), where in sorted(found.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        doc = REPO / "docs" / name
        if not doc.is_file():
            missing.append(f"docs/{name} (named at {', '.join(where[:3])})")
            continue
        headings = re.findall(r"^#+\s+(.+)$", doc.read_text(), re.M)
        if anchor is not None and anchor not in {github_anchor(h) for h in headings}:
            missing.append(f"docs/{name}#{anchor} (named at {', '.join(where[:3])})")
    assert not missing, "dangling docs references:\n  " + "\n  ".join(missing)
