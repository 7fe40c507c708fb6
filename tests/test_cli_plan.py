"""``dreampipe plan``: human output, --json, -o, and errors as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_profiles import PROFILES

from dreampipe.cli import main
from dreampipe.cli.plan import layer_label
from dreampipe.planning.plan import Plan
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.load import load_graph

VGG = PROFILES / "vgg16.txt"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, str(VGG), "--topology", "cluster-a")
    assert code == 0
    assert out.startswith("topology: cluster-a 4x4 = 16 workers")
    assert "Conv2d" in out or "Input" in out  # descriptions stand in for bare nodeN names
    assert "config 12-1-1 on 14 of 16 workers" in out
    for label in ("over data parallelism", "over a straight pipeline", "over GPipe"):
        assert label in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]
    assert len(rows) == 3


def test_json_is_one_object(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    code, out, _ = _run(capsys, str(VGG), "-t", "4x4", "-b", "10GB/s", "-b", "10Gbps",
                        "--json", "-o", str(target))
    assert code == 0
    data = json.loads(out)
    assert data["config"] == "12-1-1"
    spans = [(s["first"], s["last"], s["replicas"]) for s in data["stages"]]
    assert spans == [(0, 31, 12), (32, 34, 1), (35, 40, 1)]
    assert data["workers_used"] == 14
    assert data["speedup_over_dp"] > 5
    assert data["speedup_over_straight"] > 1 and data["speedup_over_gpipe"] > 1
    assert data["time_per_minibatch_s"] == pytest.approx(Plan.load(target).time_per_minibatch_s)
    assert Plan.load(target).config == "12-1-1"


def test_straight_and_memory_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, str(VGG), "-t", "cluster-a", "--straight", "--json")
    assert code == 0
    assert all(s["replicas"] == 1 for s in json.loads(out)["stages"])
    code, out, _ = _run(capsys, str(VGG), "-t", "cluster-b", "--memory", "40GB", "--json")
    data = json.loads(out)
    assert code == 0 and all(s["memory_bytes"] <= 40e9 for s in data["stages"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.txt", "-t", "4x4"], "does not exist"),
        ([str(VGG), "-t", "cluster-z"], "unknown topology 'cluster-z'"),
        ([str(VGG), "-t", "4x4", "-b", "fast"], "is not a quantity"),
        ([str(VGG), "-t", "4x4", "--memory", "1GB"], "smallest needs about"),
        ([str(VGG), "-t", "4x4", "--max-stages", "99"], "max_stages=99"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("dreampipe plan: error:") and message in err
    assert err.count("\n") == 1


def test_unwritable_output_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "plan.json"
    code, _, err = _run(capsys, str(VGG), "-t", "4", "-o", str(target))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("dreampipe plan: error:") and str(target) in err


def test_empty_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "graph.txt"
    empty.write_text("\n")
    code, _, err = _run(capsys, str(empty), "-t", "4")
    assert code == 2 and "no node lines" in err


def test_layer_label() -> None:
    graph = load_graph(VGG)
    assert layer_label(graph, 1).startswith("Conv2d(3, 64")
    assert len(layer_label(graph, 1)) <= 26
    named = LayerGraph.chain([Layer("encoder.conv", 1.0, 1.0, 1, 1, "Conv2d(...)")])
    assert layer_label(named, 0) == "encoder.conv"


def test_dreampipe_json_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    layers = [Layer(f"block{i}", 2.0, 4.0, 10**6, 10**5 * (i + 1)) for i in range(6)]
    profile = tmp_path / "toy.json"
    LayerGraph.chain(layers, batch_size=16, model="toy").save(profile)
    code, out, _ = _run(capsys, str(profile), "-t", "2x2")
    assert code == 0
    assert "model: toy, 6 layers, minibatch 16" in out
    assert "block0 .. block" in out and "samples/s" in out


def test_baseline_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    gnmt = VGG.with_name("gnmt.txt")
    code, out, _ = _run(capsys, str(gnmt), "-t", "cluster-b", "--memory", "1GB")
    assert code == 0
    assert "data parallelism: does not fit in memory" in out
    code, out, _ = _run(capsys, str(gnmt), "-t", "cluster-b", "--memory", "1GB", "--json")
    assert json.loads(out)["speedup_over_dp"] is None


def test_simulator_confirms_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, str(VGG), "-t", "cluster-b", "--json")
    data = json.loads(out)
    predicted = data["throughput_minibatches_per_s"]
    assert code == 0 and predicted > 0
    # Start-up makes the simulated run a little slower than the steady state.
    assert 0.85 * predicted < data["simulated_minibatches_per_s"] <= 1.05 * predicted
    assert data["simulated_minibatches"] % 15 == 0  # whole all-reduce rounds of the 15-1 plan
    code, out, _ = _run(capsys, str(VGG), "-t", "cluster-b")
    assert "simulated:" in out and "of the prediction" in out
