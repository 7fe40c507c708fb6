"""Load a layer profile: a file (dreampipe's JSON or PipeDream's ``graph.txt``) or a
bundled profile named ``pipedream:NAME``.

A file's format is told by content, so a user never names it.
"""

from __future__ import annotations

from pathlib import Path

from dreampipe.errors import ProfileError
from dreampipe.profiling.bundled import bundled_profile, bundled_profiles, is_bundled
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.graph_txt import parse_graph_txt

__all__ = ["load_graph"]


def load_graph(path: str | Path) -> LayerGraph:
    """Read a dreampipe JSON profile or a PipeDream ``graph.txt``, by content; or the
    bundled PipeDream profile ``pipedream:NAME`` (``dreampipe show --list`` lists them).

    Every :class:`ProfileError` names the file, so a user with several
    profiles knows which one to fix.
    """
    if is_bundled(path):
        profile = bundled_profile(path)
        return parse_graph_txt(profile.read_text(), model=profile.name)
    p = Path(path)
    if not p.is_file():
        bundled = [b.spec for b in bundled_profiles() if b.name == p.stem]
        hint = f"; the bundled one is {bundled[0]}" if bundled else ""
        raise ProfileError(f"profile {str(p)!r} does not exist or is not a file{hint}")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ProfileError(
            f"profile {str(p)!r} is not text; "
            "give a dreampipe JSON profile or a PipeDream graph.txt"
        ) from None
    try:
        if text.lstrip().startswith("{"):
            return LayerGraph.from_json(text)
        return parse_graph_txt(text, model=p.stem)
    except ProfileError as exc:
        raise ProfileError(f"profile {str(p)!r}: {exc}") from exc
