"""Every relative link in the repository's Markdown (README, docs/, model card) resolves: the
file exists and, for a ``.md`` target with ``#anchor``, a heading with that GitHub slug does.
Docs move between files as the project grows; a link that silently breaks costs a reader the
measurement it pointed to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
SKIP_DIRS = {".venv", ".git", "node_modules", "runs"}


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    in_code = False
    found = set()
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif line.startswith("#") and not in_code:
            found.add(slug(line))
    return found


def broken_links(md: Path) -> list[str]:
    """``'LINK (why)'`` for each relative link of ``md`` that does not resolve."""
    bad = []
    for link in LINK.findall(md.read_text(encoding="utf-8")):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (md.parent / path) if path else md
        if not target.exists():
            bad.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{link} (no heading #{anchor} in {target.name})")
    return bad


def markdown_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts)
                  and not any(part.endswith(".egg-info") for part in p.parts))


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "a.md").write_text("[ok](b.md#real-heading) [gone](c.md) [no](b.md#not-a-heading) "
                                   "[web](https://example.org/x)\n")
    assert broken_links(tmp_path / "a.md") == [
        "c.md (no such file)", "b.md#not-a-heading (no heading #not-a-heading in b.md)"]


def test_the_docs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/minivox.md", "minivox/MODEL_CARD.md"} <= names


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(md):
    assert broken_links(md) == []
