"""The bundled PipeDream profiles: named ``pipedream:NAME``, read from the package."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest

import dreampipe
from dreampipe.errors import ProfileError
from dreampipe.profiling.bundled import bundled_profile, bundled_profiles, is_bundled
from dreampipe.profiling.graph_txt import parse_graph_txt
from dreampipe.profiling.load import load_graph

_FOLDER = Path(dreampipe.__file__).parent / "profiles" / "pipedream"
_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
_NAMES = ["alexnet", "gnmt", "resnet18", "vgg16"]


def test_every_profile_file_is_listed_and_nothing_else() -> None:
    on_disk = sorted(p.stem for p in _FOLDER.glob("*.txt") if p.name != "LICENSE.txt")
    assert on_disk == _NAMES
    assert [p.name for p in bundled_profiles()] == on_disk
    assert [p.spec for p in bundled_profiles()] == [f"pipedream:{n}" for n in _NAMES]


@pytest.mark.parametrize("name", _NAMES)
def test_a_name_loads_the_same_graph_as_the_file(name: str) -> None:
    by_name = load_graph(f"pipedream:{name}")
    assert by_name == load_graph(_FOLDER / f"{name}.txt")
    assert by_name == parse_graph_txt((_FOLDER / f"{name}.txt").read_text(), model=name)
    assert by_name.model == name
    assert bundled_profile(f"pipedream:{name}").read_text() == (_FOLDER / f"{name}.txt").read_text()


def test_a_path_object_names_a_bundled_profile_too() -> None:
    assert load_graph(Path("pipedream:alexnet")) == load_graph("pipedream:alexnet")
    assert dreampipe.load_graph("pipedream:alexnet").model == "alexnet"


@pytest.mark.parametrize("spec", ["pipedream:nope", "pipedream:", "pipedream:VGG16",
                                  "pipedream:LICENSE", "pipedream:vgg16.txt"])
def test_an_unknown_name_lists_the_bundled_ones(spec: str) -> None:
    with pytest.raises(ProfileError) as caught:
        load_graph(spec)
    message = str(caught.value)
    assert repr(spec) in message
    for name in _NAMES:
        assert f"pipedream:{name}" in message
    assert "dreampipe show --list" in message


def test_only_the_scheme_names_a_bundled_profile(tmp_path: Path) -> None:
    assert is_bundled("pipedream:vgg16") and is_bundled(Path("pipedream:x"))
    assert not is_bundled("vgg16") and not is_bundled(tmp_path / "pipedream:vgg16")
    with pytest.raises(ProfileError, match="pipedream:NAME"):
        bundled_profile("vgg16")
    with pytest.raises(ProfileError, match="does not exist"):
        load_graph(tmp_path / "vgg16.txt")


@pytest.mark.parametrize("missing", ["vgg16", "vgg16.txt", "profiles/gnmt.txt"])
def test_a_missing_file_named_like_a_bundled_profile_names_it(
    tmp_path: Path, missing: str
) -> None:
    stem = Path(missing).stem
    with pytest.raises(ProfileError, match=rf"does not exist.*bundled one is pipedream:{stem}$"):
        load_graph(tmp_path / missing)
    with pytest.raises(ProfileError) as caught:
        load_graph(tmp_path / "mine.json")
    assert "bundled" not in str(caught.value)


def test_the_licence_and_readme_ship_beside_the_profiles() -> None:
    licence = (_FOLDER / "LICENSE.txt").read_text()
    assert licence.startswith("MIT License") and "Microsoft Corporation" in licence
    readme = (_FOLDER / "README.md").read_text()
    assert all(f"pipedream:{name}" in readme for name in _NAMES)
    assert "../" not in readme


def test_the_wheel_takes_every_bundled_file() -> None:
    """pyproject's package-data globs match every file in the folder, so a wheel has them."""
    config = tomllib.loads(_PYPROJECT.read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["dreampipe"]
    root = Path(dreampipe.__file__).parent
    for path in _FOLDER.iterdir():
        rel = path.relative_to(root).as_posix()
        assert any(fnmatch.fnmatch(rel, pattern) for pattern in patterns), rel
    assert config["dynamic"]["version"] == {"attr": "dreampipe.__version__"}
    assert "version" not in tomllib.loads(_PYPROJECT.read_text())["project"]
