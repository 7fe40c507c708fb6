"""The public API in ``dreampipe/__init__.py``: complete, light, not shadowing modules."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dreampipe


def test_import_is_light() -> None:
    code = (
        "import sys, dreampipe\n"
        "heavy = [m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_public_name_resolves() -> None:
    for name in dreampipe.__all__:
        assert getattr(dreampipe, name) is not None, name
    assert set(dreampipe.__all__) <= set(dir(dreampipe))


def test_lazy_names_are_the_library_functions() -> None:
    from dreampipe.models import get_model
    from dreampipe.planning.planner import evaluate_plan, plan_pipeline
    from dreampipe.profiling.profiler import profile_model

    assert dreampipe.plan_pipeline is plan_pipeline
    assert dreampipe.evaluate_plan is evaluate_plan
    assert dreampipe.profile_model is profile_model
    assert dreampipe.get_model is get_model


def test_modules_are_not_shadowed() -> None:
    for module in ("planning.plan", "planning.planner", "scheduling.validator",
                   "simulation.simulator", "scheduling.build", "simulation.timeline",
                   "simulation.chrome_trace"):
        package, _, name = module.partition(".")
        imported = importlib.import_module(f"dreampipe.{module}")
        assert getattr(getattr(dreampipe, package), name) is imported, module


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        dreampipe.no_such_thing  # noqa: B018
