"""PipeDream's own profiles, shipped inside the package and named ``pipedream:NAME``.

The PipeDream authors published per-layer profiles of four models measured on
one V100 (``profiles/pipedream/*.txt``, their ``graph.txt`` format, MIT
licence beside them). They are real inputs for the planner and the
simulator, so every place that takes a profile path also takes
``pipedream:vgg16``; the files are read with :mod:`importlib.resources`,
which finds them in a source checkout and in an installed wheel alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from dreampipe.errors import ProfileError

__all__ = ["SCHEME", "BundledProfile", "bundled_profile", "bundled_profiles", "is_bundled"]

SCHEME = "pipedream:"
"""The prefix that names a bundled profile instead of a file: ``pipedream:alexnet``."""


@dataclass(frozen=True)
class BundledProfile:
    """One bundled profile: its ``name`` (the file's stem) and where its text lives."""

    name: str

    @property
    def spec(self) -> str:
        """How a user names it: ``pipedream:NAME``."""
        return SCHEME + self.name

    @property
    def resource(self) -> Traversable:
        """The profile's ``graph.txt`` inside the installed package."""
        return _folder() / f"{self.name}.txt"

    def read_text(self) -> str:
        return self.resource.read_text(encoding="utf-8")


def _folder() -> Traversable:
    return files("dreampipe") / "profiles" / "pipedream"


def bundled_profiles() -> list[BundledProfile]:
    """Every bundled profile, sorted by name (the licence is not a profile)."""
    names = (
        entry.name.removesuffix(".txt")
        for entry in _folder().iterdir()
        if entry.name.endswith(".txt") and entry.name != "LICENSE.txt"
    )
    return [BundledProfile(name) for name in sorted(names)]


def is_bundled(spec: str | Path) -> bool:
    """Whether ``spec`` names a bundled profile (``pipedream:...``) rather than a file."""
    return str(spec).startswith(SCHEME)


def bundled_profile(spec: str | Path) -> BundledProfile:
    """The bundled profile ``pipedream:NAME`` names; an unknown name lists the known ones."""
    text = str(spec)
    if not is_bundled(text):
        raise ProfileError(f"{text!r} does not name a bundled profile; write {SCHEME}NAME")
    name = text.removeprefix(SCHEME)
    known = bundled_profiles()
    for profile in known:
        if profile.name == name:
            return profile
    raise ProfileError(
        f"no bundled profile {text!r}; the bundled ones are "
        f"{', '.join(p.spec for p in known)} (run 'dreampipe show --list')"
    )
