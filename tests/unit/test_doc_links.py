"""Every relative link in the docs resolves inside the repository: to a file that exists
and, with an anchor, to a heading of that file (GitHub's slugs); and no doc points outside
the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def docs() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md"]
    found += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "deploy").rglob("*.md"))
    return found


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def broken(path: Path, root: Path = ROOT) -> list[str]:
    """The links of the markdown file at `path` that lead nowhere in the repository."""
    found = []
    for target in LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists() or not resolved.is_relative_to(root):
            found.append(f"{path.relative_to(root)}: {target}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            found.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return found


def test_every_link_in_the_docs_resolves_in_the_repository():
    assert [link for path in docs() for link in broken(path)] == []


def test_no_doc_points_outside_the_repository():
    assert [str(p.relative_to(ROOT)) for p in docs() if "../shared" in p.read_text()] == []


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Tandem against TRL\n[a](gone.md) [b](#tandem-against-trl) [c](#nowhere) [d](https://x.org)\n")
    assert [line.split(": ", 1)[1] for line in broken(page, tmp_path)] == ["gone.md", "#nowhere (no such heading)"]
