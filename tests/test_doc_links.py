"""Every relative link in the README and docs/ resolves to a file (and heading) in the repo."""

from __future__ import annotations

import re
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def _broken(doc: Path, root: Path = _REPO) -> list[str]:
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists() or root not in path.parents:
            broken.append(f"{doc.name}: {target} (no such file in the repo)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{doc.name}: {target} (no such heading)")
    return broken


def _docs() -> list[Path]:
    return [_REPO / "README.md", *sorted((_REPO / "docs").glob("*.md")),
            *sorted((_REPO / "src").rglob("*.md"))]


def test_every_doc_link_resolves_inside_the_repo() -> None:
    broken = [b for doc in _docs() for b in _broken(doc)]
    assert not broken, "\n".join(broken)


def test_the_check_can_fail(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n[ok](#title) [gone](missing.md) [bad](#nope) [web](https://x.org)\n")
    assert _broken(doc, tmp_path) == ["doc.md: missing.md (no such file in the repo)",
                            "doc.md: #nope (no such heading)"]
