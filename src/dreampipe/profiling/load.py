"""Load a layer profile: a file (dreampipe's JSON or PipeDream's ``graph.txt``), a
bundled profile named ``pipedream:NAME``, or a profile by shape ``gpt:...``.

A file's format is told by content, so a user never names it; a ``.json`` file must
hold a JSON object (it is never read as a ``graph.txt``). A profile by
shape is timed on the device it is given (a cluster preset's).
"""

from __future__ import annotations

import json
from pathlib import Path

from dreampipe.errors import ProfileError
from dreampipe.profiling.bundled import bundled_profile, bundled_profiles, is_bundled
from dreampipe.profiling.devices import Device
from dreampipe.profiling.gpt_spec import gpt_spec_profile, is_gpt_spec, parse_gpt_spec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.graph_txt import parse_graph_txt

__all__ = ["load_graph"]


def load_graph(path: str | Path, device: Device | None = None) -> LayerGraph:
    """Read a dreampipe JSON profile or a PipeDream ``graph.txt``, by content; or the
    bundled PipeDream profile ``pipedream:NAME`` (``dreampipe show --list`` lists them);
    or build the profile by shape ``gpt:...`` timed on ``device``, which it needs.

    Every :class:`ProfileError` names the file, so a user with several
    profiles knows which one to fix.
    """
    if is_gpt_spec(path):
        spec = parse_gpt_spec(path)
        if device is None:
            raise ProfileError(
                f"profile {str(path)!r} is built from its shape and needs a device's peak "
                "rate to time its layers; plan it on a cluster preset that names its device, "
                "e.g. --topology dgx-a100:2")
        return gpt_spec_profile(spec, device)
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
        if p.suffix.lower() == ".json":
            raise ProfileError(
                f"holds {_json_kind(text)}, not a dreampipe profile (a JSON object); give a "
                "profile from 'dreampipe profile -o' or a PipeDream graph.txt")
        return parse_graph_txt(text, model=p.stem)
    except ProfileError as exc:
        raise ProfileError(f"profile {str(p)!r}: {exc}") from exc


def _json_kind(text: str) -> str:
    """What a ``.json`` file that is no JSON object holds, in a few words."""
    if not text.strip():
        return "nothing"
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return "no valid JSON"
    if isinstance(data, list):
        return "a JSON list"
    return "JSON null" if data is None else f"the JSON value {text.strip()[:20]}"
