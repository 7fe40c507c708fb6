"""``benchmarks/readme_figure.py``: the README's picture is drawn by dreampipe's own commands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from matplotlib.image import imread

__all__: list[str] = []


def test_the_figure_is_a_4_stage_timeline_drawn_from_a_profile(
        import_benchmark: Callable[[str], ModuleType], pipedream_profiles: Path,
        tmp_path: Path) -> None:
    figure = import_benchmark("readme_figure")
    out = tmp_path / "timeline.png"
    assert figure.main(["--profile", str(pipedream_profiles / "gnmt.txt"), "--out", str(out)]) == 0
    height, width, _ = imread(out).shape
    assert width > 2 * height  # four workers' rows under one time axis
