"""The scripts of ``benchmarks/`` imported as modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def import_benchmark(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """``import_benchmark("gpu_check")``: that script as a module."""
    monkeypatch.syspath_prepend(str(_BENCHMARKS))
    return importlib.import_module
