"""Profiles by shape on the command line: ``plan``, ``simulate`` and ``show`` take
``gpt:...`` on a preset with a device, planned under its memory unless ``--memory``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dreampipe.cli import main
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Plan
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.load import load_graph

SMALL = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000"
#: Needs about 31 GB per worker without a limit, under 16 GB planned within it.
WIDE = "gpt:layers=2,hidden=2048,heads=16,seq=1024,vocab=50000,batch=8"


def _library(spec: str, topology: str, memory: int | None) -> Plan:
    """What the library plans, with the CLI's defaults (recompute, mixed splits)."""
    topo = Topology.parse(topology)
    return plan_pipeline(load_graph(spec, topo.device), topo, PlanOptions(
        memory_bytes=memory, recompute=True, mixed_splits=True))


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    data: dict[str, Any] = json.loads(out)
    return data


def test_plan_takes_a_profile_by_shape_on_a_dgx_a100_preset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _json(capsys, "plan", SMALL, "-t", "dgx-a100:2", "--json")
    want = _library(SMALL, "dgx-a100:2", 80 * 10**9)
    assert data["model"] == SMALL and data["num_layers"] == 6 * 4 + 3
    assert data["topology"].startswith("dgx-a100:2 2x8 = 16 workers")
    assert data["config"] == want.config
    assert data["time_per_minibatch_s"] == pytest.approx(want.time_per_minibatch_s)
    assert data["check_skipped"] is False and data["simulated_minibatches_per_s"] > 0
    assert main(["plan", SMALL, "-t", "dgx-a100:2", "--no-check"]) == 0
    out = capsys.readouterr().out
    assert "A100-80GB, 312 TFLOP/s" in out and "of 80.0 GB" in out  # the device's limit


def test_the_devices_memory_limits_a_profile_by_shape_unless_memory_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    free = _library(WIDE, "p3.16xlarge:1", None)
    assert max(s.memory_bytes for s in free.stages) > 16 * 10**9  # the limit binds
    data = _json(capsys, "plan", WIDE, "-t", "p3.16xlarge:1", "--json", "--no-check")
    limited = _library(WIDE, "p3.16xlarge:1", 16 * 10**9)
    assert data["config"] == limited.config
    assert max(s["memory_bytes"] for s in data["stages"]) <= 16 * 10**9
    given = _json(capsys, "plan", WIDE, "-t", "p3.16xlarge:1", "--memory", "64GB", "--json",
                  "--no-check")
    assert given["config"] == free.config


def test_simulate_and_show_take_a_profile_by_shape(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "simulate", SMALL, "-t", "dgx-2h:1", "--json")
    assert data["topology"] == "dgx-2h:1"
    assert data["plan_config"] == _library(SMALL, "dgx-2h:1", 32 * 10**9).config
    assert main(["show", SMALL, "-t", "dgx-a100:1"]) == 0
    out = capsys.readouterr().out
    assert f"model {SMALL}" in out and "b3.fc2" in out and "head" in out


@pytest.mark.parametrize("argv", [
    ["plan", "gpt:layers=4,hidden=256,heads=3,seq=128,vocab=1000", "-t", "dgx-a100:2"],
    ["plan", "gpt:layers=4,hidden=256", "-t", "dgx-a100:2", "--json"],
    ["simulate", "gpt:layers=4,hidden=256,heads=4,seq=0,vocab=1000", "-t", "dgx-a100:1"],
    ["show", SMALL],
    ["show", SMALL, "-t", "cluster-c"],
    ["plan", SMALL, "-t", "dgx-a100:x"],
])
def test_a_bad_spec_or_cluster_is_one_line_without_a_traceback(
    capsys: pytest.CaptureFixture[str], argv: list[str],
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"dreampipe {argv[0]}: error: ")
    assert "Traceback" not in err
