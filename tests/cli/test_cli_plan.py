"""``dreampipe plan``: human output, --json, -o, and errors as one line with exit 2."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dreampipe.cli import main
from dreampipe.cli.plan_command import (
    CHECK_MINIBATCHES,
    CHECK_STAGE_MINIBATCHES,
    check_minibatches,
    confirm_by_simulation,
    layer_label,
)
from dreampipe.cli.plan_why import stage_reasons
from dreampipe.planning.memory_terms import OptimizerTerms
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.plan import Heuristic, Plan, Stage
from dreampipe.planning.planner import evaluate_plan, plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.load import load_graph
from dreampipe.quantities import format_bytes

VGG = "pipedream:vgg16"
_LABELS = (("dp", "data parallelism"), ("straight", "a straight pipeline"),
           ("gpipe", "GPipe at 4 microbatches a stage"))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _expected(
    profile: str, topology: str, bandwidths: list[str] | None = None, memory: str | None = None,
    **options: Any,
) -> tuple[Plan, Topology]:
    """What the library plans for the same profile and topology: the figures the CLI must show."""
    topo = Topology.parse(topology, bandwidths, memory)
    plan = plan_pipeline(load_graph(profile), topo, PlanOptions(
        memory_bytes=topo.memory_bytes if memory else None, **options))
    return plan, topo


def _spans(stages: list[dict[str, Any]] | tuple[Stage, ...]) -> list[tuple[int, int, int]]:
    return [
        (s["first"], s["last"], s["replicas"]) if isinstance(s, dict)
        else (s.first, s.last, s.replicas)
        for s in stages
    ]


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, VGG, "--topology", "cluster-a")
    plan, topo = _expected(VGG, "cluster-a")
    assert code == 0
    # the preset's memory, which no limit held the stages to unless --memory asked
    assert out.startswith(f"topology: {topo.describe()}; planned without a memory limit")
    assert "Conv2d" in out or "Input" in out  # descriptions stand in for bare nodeN names
    assert (
        f"config {plan.config} on {plan.workers_used} of {topo.num_workers} workers: "
        f"{plan.time_per_minibatch_s * 1e3:.2f} ms per minibatch"
    ) in out
    for key, label in _LABELS:
        line = f"{plan.speedup_over(key):6.2f}x over {label} ({plan.baselines_s[key] * 1e3:.2f} ms)"
        assert line in out, line
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\.\.\d+", line)]
    assert [row[1] for row in rows] == [f"{s.first}..{s.last}" for s in plan.stages]
    assert [int(row[-7]) for row in rows] == [s.replicas for s in plan.stages]
    assert [float(row[-3]) for row in rows] == pytest.approx(
        [round(s.time_s * 1e3, 2) for s in plan.stages]
    )


def test_json_is_one_object(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    bandwidths = ["10GB/s", "10Gbps"]
    code, out, _ = _run(capsys, VGG, "-t", "4x4", "-b", bandwidths[0], "-b", bandwidths[1],
                        "--json", "-o", str(target))
    plan, _ = _expected(VGG, "4x4", bandwidths)
    assert code == 0
    data = json.loads(out)
    assert data["config"] == plan.config
    assert _spans(data["stages"]) == _spans(plan.stages)
    assert data["workers_used"] == plan.workers_used
    assert data["time_per_minibatch_s"] == pytest.approx(plan.time_per_minibatch_s)
    assert data["throughput_minibatches_per_s"] == pytest.approx(plan.throughput_minibatches_per_s)
    for key, _ in _LABELS:
        assert data[f"speedup_over_{key}"] == pytest.approx(plan.speedup_over(key)), key
    saved = Plan.load(target)
    assert saved.config == plan.config and _spans(saved.stages) == _spans(plan.stages)
    assert saved.time_per_minibatch_s == pytest.approx(plan.time_per_minibatch_s)


def test_straight_and_memory_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, VGG, "-t", "cluster-a", "--straight", "--json")
    data = json.loads(out)
    plan, _ = _expected(VGG, "cluster-a", straight=True)
    assert code == 0 and all(s["replicas"] == 1 for s in data["stages"])
    assert _spans(data["stages"]) == _spans(plan.stages)
    assert data["time_per_minibatch_s"] == pytest.approx(plan.time_per_minibatch_s)
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b", "--memory", "40GB", "--json")
    data = json.loads(out)
    plan, _ = _expected(VGG, "cluster-b", memory="40GB")
    assert code == 0 and all(s["memory_bytes"] <= 40e9 for s in data["stages"])
    assert _spans(data["stages"]) == _spans(plan.stages)
    assert [s["memory_bytes"] for s in data["stages"]] == [s.memory_bytes for s in plan.stages]


def test_the_optimizers_state_counts_in_the_memory(capsys: pytest.CaptureFixture[str]) -> None:
    # Adam's two moments a weight: every stage holds them, within the limit as planned
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b", "--memory", "40GB", "--optimizer",
                        "adam", "--json")
    data = json.loads(out)
    plan, _ = _expected(VGG, "cluster-b", memory="40GB",
                        optimizer=OptimizerTerms(state_copies=2.0))
    assert code == 0 and all(s["memory_bytes"] <= 40e9 for s in data["stages"])
    assert _spans(data["stages"]) == _spans(plan.stages)
    assert [s["memory_bytes"] for s in data["stages"]] == [s.memory_bytes for s in plan.stages]
    plain, _ = _expected(VGG, "cluster-b", memory="40GB")
    assert [s.memory_bytes for s in plan.stages] != [s.memory_bytes for s in plain.stages]
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b", "--memory", "40GB", "--optimizer",
                        "adam")
    assert code == 0 and format_bytes(plan.stages[0].memory_bytes) in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.txt", "-t", "4x4"], "does not exist"),
        ([VGG, "-t", "cluster-z"], "unknown topology 'cluster-z'"),
        ([VGG, "-t", "4x4", "-b", "fast"], "is not a quantity"),
        ([VGG, "-t", "4x4", "--memory", "1GB"], "smallest needs about"),
        ([VGG, "-t", "4x4", "--memory", "16"], "size '16' has no unit; write e.g. 16GB"),
        ([VGG, "-t", "4x4", "--max-stages", "99"], "--max-stages 99 is impossible"),
        (["pipedream:resnet18", "-t", "cluster-b", "--straight", "--cost-model", "pipedream"],
         "states that hold no layer of resnet18 not already placed"),
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
    code, _, err = _run(capsys, VGG, "-t", "4", "-o", str(target))
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
    plan, topo = _expected(profile, "2x2")
    assert code == 0
    assert "model: toy, 6 layers, minibatch 16" in out
    rate = plan.throughput_minibatches_per_s
    assert (
        f"config {plan.config} on {plan.workers_used} of {topo.num_workers} workers: "
        f"{plan.time_per_minibatch_s * 1e3:.2f} ms per minibatch, {rate:.2f} minibatches/s "
        f"= {rate * 16:.0f} samples/s"
    ) in out
    assert "block0 .. block" in out and "samples/s" in out


def test_baseline_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    gnmt = "pipedream:gnmt"
    plan, _ = _expected(gnmt, "cluster-b", memory="1.5GB")
    assert "dp" not in plan.baselines_s  # the library finds no data-parallel plan in 1.5 GB
    code, out, _ = _run(capsys, gnmt, "-t", "cluster-b", "--memory", "1.5GB")
    assert code == 0
    assert "data parallelism: does not fit in memory" in out
    assert f"config {plan.config} on {plan.workers_used} of 16 workers" in out
    code, out, _ = _run(capsys, gnmt, "-t", "cluster-b", "--memory", "1.5GB", "--json")
    data = json.loads(out)
    assert data["speedup_over_dp"] is None
    assert data["speedup_over_straight"] == pytest.approx(plan.speedup_over("straight"))


def test_simulator_confirms_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b", "--json")
    data = json.loads(out)
    plan, _ = _expected(VGG, "cluster-b")
    predicted = data["throughput_minibatches_per_s"]
    assert code == 0 and predicted == pytest.approx(plan.throughput_minibatches_per_s)
    # The steady state (start-up and drain left out) is what the planner predicts.
    assert 0.95 * predicted < data["simulated_minibatches_per_s"] <= 1.05 * predicted
    assert data["check_skipped"] is False
    assert data["simulated_minibatches"] == check_minibatches(plan) <= CHECK_MINIBATCHES
    assert 0 < data["simulated_steady_minibatches"] < data["simulated_minibatches"]
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b")
    assert "simulated:" in out and "of the prediction" in out and "in the steady state" in out


def test_no_check_skips_the_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b", "--no-check")
    assert code == 0 and "config " in out
    assert "simulated" not in out
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b", "--no-check", "--json")
    data = json.loads(out)
    assert code == 0 and data["check_skipped"] is True
    assert data["simulated_minibatches"] is None and data["simulated_minibatches_per_s"] is None


def test_check_minibatches_caps_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, VGG, "-t", "cluster-b", "--json", "--check-minibatches", "20")
    assert code == 0 and json.loads(out)["simulated_minibatches"] == 20
    with pytest.raises(SystemExit) as info:
        main(["plan", VGG, "-t", "cluster-b", "--check-minibatches", "0"])
    assert info.value.code == 2
    assert "'0' is not a whole number >= 1" in capsys.readouterr().err


def test_coprime_replicas_are_checked_in_bounded_minibatches() -> None:
    # 11-13-17-19 used to force lcm = 46189 minibatches (whole all-reduce rounds).
    graph, replicas = load_graph(VGG), (11, 13, 17, 19)
    topo = Topology.parse("4x16")
    plan = evaluate_plan(graph, topo, [0, 10, 20, 30], replicas)
    sim = confirm_by_simulation(plan, graph, topo)
    assert sim.num_microbatches == check_minibatches(plan) < CHECK_MINIBATCHES
    assert sim.num_microbatches < math.lcm(*replicas) and sim.num_microbatches % math.lcm(*replicas)
    assert sim.steady_microbatches > 0
    assert confirm_by_simulation(plan, graph, topo, cap=50).num_microbatches == 50


@pytest.mark.parametrize(("replicas", "expected"), [
    ((1, 1), 2 * 2 + 4 * 2),                    # warm-up 2, drain 2, 4 per worker
    ((3, 1), 2 * 3 * 3 + 4 * 4),                # 3 replicas admit ceil((4 + 4)/3) = 3 each
    ((1000, 100), CHECK_MINIBATCHES),           # 2 x 2000 + 4 x 1100 > the cap
    ((20,) * 40, CHECK_STAGE_MINIBATCHES // 40),  # deep and wide: the work bound
])
def test_check_minibatches_is_bounded(replicas: tuple[int, ...], expected: int) -> None:
    plan = Plan.from_config(len(replicas), list(range(len(replicas))), replicas)
    assert check_minibatches(plan) == expected
    assert check_minibatches(plan, cap=5) == 5


def test_the_parser_and_plan_never_load_torch() -> None:
    """``dreampipe --help``, ``plan`` and ``simulate`` start without importing PyTorch
    (seconds on a small machine): every command's parser, ``bench``'s choices included,
    is built from names alone, and planning is pure."""
    code = (
        "import sys\n"
        "from dreampipe.cli import main\n"
        f"assert main(['plan', {VGG!r}, '-t', '4x4']) == 0\n"
        "assert main(['plan', 'gpt:layers=2,hidden=64,heads=4,seq=8,vocab=10', '-t', "
        "'dgx-a100:1']) == 0\n"
        "assert main(['plan', 'gpt:layers=2,hidden=64,heads=4,seq=8,vocab=10', '-t', "
        "'dgx-a100:1', '--global-batch', '16', '--layout', 't2-p2-r1']) == 0\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plan" in done.stdout, done.stdout


def _chain_profile(tmp_path: Path, layers: int) -> str:
    path = tmp_path / f"chain{layers}.json"
    LayerGraph.chain([Layer(f"l{i}", 10.0, 20.0, 0, 0) for i in range(layers)]).save(path)
    return str(path)


def test_schedule_auto_reports_every_candidate_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain = _chain_profile(tmp_path, 4)
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--straight")
    assert code == 0
    assert re.search(r"schedule +zb-h\d: the fastest sync schedule, by the simulator", out)
    for kind in ("zb-h1", "zb-h2", "1f1b-flush", "gpipe"):
        assert re.search(rf"^  {kind} +[\d.]+ minibatches/s", out, re.M)
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--straight", "--semantics", "async",
                        "--json")
    data = json.loads(out)
    assert data["schedule"] in ("2bw", "pipedream")
    assert [c["schedule"] for c in data["schedule_candidates"]] == ["2bw", "pipedream"]
    # a schedule asked by name is simulated and reported with its own rate, not the plan's
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--straight", "--schedule", "gpipe",
                        "--json")
    data = json.loads(out)
    assert data["schedule"] == "gpipe"
    (asked,) = data["schedule_candidates"]
    assert asked["schedule"] == "gpipe" and asked["fits"]
    assert asked["minibatches_per_s"] < 0.95 * data["throughput_minibatches_per_s"]
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--straight", "--schedule", "gpipe")
    assert re.search(r"schedule +gpipe: as asked, by the simulator \(16 microbatches", out)
    assert re.search(r"^  gpipe +[\d.]+ minibatches/s, peak .* per worker$", out, re.M)


def test_a_synchronous_schedule_slower_than_data_parallelism_says_so(
    capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan is PipeDream's; the synchronous schedule chosen on it says its own rate in
    one line, and names the fix, with data parallelism's rate where it runs below it."""
    code, out, _ = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--json")
    data = json.loads(out)
    chosen, dp = data["schedule_minibatches_per_s"], 1 / data["baselines_s"]["dp"]
    assert code == 0 and data["schedule"] in ("zb-h1", "zb-h2", "1f1b-flush", "gpipe")
    assert chosen < dp < data["throughput_minibatches_per_s"]
    code, out, _ = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check")
    (note,) = [ln for ln in out.splitlines() if ln.startswith("  note: ")]
    assert f"{chosen:.2f} minibatches/s, below data parallelism's {dp:.2f}" in note
    assert "--global-batch" in note and "--semantics async" in note
    code, out, _ = _run(capsys, "pipedream:gnmt", "-t", "2x4", "--no-check", "--json")
    data = json.loads(out)
    chosen, dp = data["schedule_minibatches_per_s"], 1 / data["baselines_s"]["dp"]
    assert code == 0 and data["schedule"] != "pipedream" and chosen > dp
    code, out, _ = _run(capsys, "pipedream:gnmt", "-t", "2x4", "--no-check")
    (note,) = [ln for ln in out.splitlines() if ln.startswith("  note: ")]
    assert f"{chosen:.2f} minibatches/s; the plan" in note and "below" not in note
    code, out, _ = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--semantics",
                        "async")
    assert code == 0 and "  note: " not in out  # pipedream: the plan's own rate


def test_a_minibatch_splits_into_no_more_microbatches_than_it_has_samples(
    capsys: pytest.CaptureFixture[str]
) -> None:
    shape = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=100"
    code, out, _ = _run(capsys, shape, "-t", "dgx-a100:1", "--no-check", "--json")
    assert code == 0 and json.loads(out)["microbatches"] == 1  # batch=1: one sequence
    code, out, _ = _run(capsys, shape, "-t", "dgx-a100:1", "--no-check")
    assert "a minibatch of 1 (the profile's) splits into at most 1 microbatches" in out
    code, _, err = _run(capsys, shape, "-t", "dgx-a100:1", "--microbatches", "4")
    assert code == 2 and "--microbatches 4 splits a minibatch of 1" in err
    assert "use at most 1, or plan with --global-batch" in err


def test_a_synchronous_schedule_asked_with_async_semantics_is_refused(
    capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--schedule",
                        "zb-h1", "--semantics", "async")
    assert code == 2 and "--schedule zb-h1 is synchronous, and --semantics async" in err
    code, _, err = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--schedule",
                        "2bw", "--semantics", "sync")
    assert code == 2 and "--schedule 2bw is asynchronous (stale weights), and --semantics sync" \
        " asks for the other; drop one of them" in err
    code, _, err = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--schedule",
                        "zbv", "--semantics", "async")  # several stages per worker: the same
    assert code == 2 and "--schedule zbv is synchronous, and --semantics async" in err


def test_the_pipedream_cost_model_refuses_an_all_reduce_it_would_not_price(
    capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--cost-model",
                        "pipedream", "--sync", "ps", "--ps-shards", "2")
    assert code == 2 and "--sync ps: the pipedream cost model prices PipeDream's own" in err


def test_microbatches_asked_of_pipedream_are_refused_as_train_refuses_them(
    capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--schedule",
                        "pipedream", "--microbatches", "4")
    assert code == 2 and "--microbatches 4 with --schedule pipedream" in err
    code, out, _ = _run(capsys, "pipedream:gnmt", "-t", "4", "--no-check", "--schedule",
                        "1f1b-flush", "--microbatches", "4", "--json")
    assert code == 0 and json.loads(out)["microbatches"] == 4


def test_semantics_any_keeps_a_synchronous_schedule_where_the_study_says_async_loses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 straight stages: the study's pipedream never reached the characters' target at 4
    stages, nor its 2bw GPT-2's."""
    chain = _chain_profile(tmp_path, 4)
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--straight", "--semantics", "any",
                        "--microbatches", "4")
    assert code == 0
    assert re.search(r"schedule +(zb-h\d|1f1b-flush|gpipe): the schedule soonest to the "
                     r"target \(effective minibatches/s", out), out
    assert re.search(r"^  pipedream .* never reaches the target \(the study's chars at 4 "
                     r"stages, its worst workload\): 0\.000 effective: no sooner$",
                     out, re.M), out
    assert re.search(r"^  2bw .* never reaches the target \(the study's gpt2 at 4 stages",
                     out, re.M), out
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--straight", "--semantics", "any",
                        "--json")
    weighed = {c["schedule"]: c for c in json.loads(out)["schedule_candidates"]}
    assert weighed["pipedream"]["epochs_vs_dp"] is None
    assert weighed["1f1b-flush"]["epochs_vs_dp"] == 1.0


def test_virtual_stages_place_stage_s_on_worker_s_mod_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain, saved = _chain_profile(tmp_path, 8), tmp_path / "plan.json"
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--virtual-stages", "2", "--microbatches",
                        "8", "-o", str(saved))
    assert code == 0 and "interleaved-1f1b, 2 stages per worker on 4 workers" in out
    assert "bubble 15.8% (1f1b-flush on 4 stages: 27.3%)" in out
    plan = Plan.load(saved)
    assert [(st.first, st.last) for st in plan.stages] == [(i, i) for i in range(8)]
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--virtual-stages", "2", "--json")
    data = json.loads(out)
    assert data["stage_workers"] == [0, 1, 2, 3, 0, 1, 2, 3]
    # no closed form prices it: the plan's time is the simulated one, on the links given
    assert data["time_per_minibatch_s"] == pytest.approx(1 / data["minibatches_per_s"])
    assert data["topology"] == Topology.parse("1x4").describe()


def test_auto_on_two_stages_per_worker_weighs_interleaving_zbv_and_dualpipev(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The chain (F = B = W) on 4 workers: a V schedule leaves the least bubble, and the
    saved plan places its stages in the V the chosen schedule runs."""
    chain, saved = _chain_profile(tmp_path, 8), tmp_path / "plan.json"
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--virtual-stages", "2", "--schedule",
                        "auto", "--microbatches", "8", "-o", str(saved))
    assert code == 0
    kinds = ("interleaved-1f1b", "zbv", "dualpipev")
    lines = [line.split()[0] for line in out.splitlines()
             if line.startswith("  ") and line.split()[0] in kinds]
    assert lines == list(kinds)
    chosen = next(line.split()[0] for line in out.splitlines() if "chosen" in line)
    assert chosen in ("zbv", "dualpipev")
    assert f"with its schedule, {chosen}, which 'dreampipe simulate' runs" in out
    plan = Plan.load(saved)
    assert [st.ranks[0] for st in plan.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    code, out, _ = _run(capsys, chain, "-t", "1x4", "--schedule", "dualpipev", "--json")
    data = json.loads(out)
    assert (data["schedule"], data["placement"], data["stage_workers"]) == (
        "dualpipev", "v", [0, 1, 2, 3, 3, 2, 1, 0])
    assert data["bubble_fraction"] < 0.5 * data["flush_bubble_fraction"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--schedule", "zbv", "--virtual-stages", "3"],
     "--virtual-stages 3 with --schedule zbv, which runs 2 stages per worker in a V"),
    (["--schedule", "1f1b-flush", "--virtual-stages", "2"],
     "--schedule 1f1b-flush with --virtual-stages 2: several stages per worker run under "
     "interleaved-1f1b, zbv, dualpipev"),
])
def test_a_schedule_that_cannot_run_the_stages_per_worker_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = _run(capsys, _chain_profile(tmp_path, 12), "-t", "1x4", *argv)
    assert code == 2 and needle in err


def test_a_plan_searched_in_blocks_says_its_gap(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 120 layers on 128x8 are more than the exact search takes there: the layers are
    # searched in blocks and the output bounds how far the plan may be from the optimum
    layers = [Layer(f"l{i}", 1.0, 2.0, 10**6, 10**5) for i in range(120)]
    profile = tmp_path / "long.json"
    LayerGraph.chain(layers, batch_size=16, model="long").save(profile)
    code, out, _ = _run(capsys, str(profile), "-t", "128x8", "--no-check", "--json")
    assert code == 0
    got = Plan.from_dict(json.loads(out))
    assert got.optimality_gap > 0
    # and on 1,024 workers the stage ranges on a grid of workers
    assert got.heuristics == (Heuristic.LAYER_BLOCKS, Heuristic.WORKER_GRID)
    code, out, _ = _run(capsys, str(profile), "-t", "128x8", "--no-check")
    assert code == 0
    assert (f"heuristic: the layers were searched in blocks and stage ranges were searched "
            f"on a grid of workers; at most {100 * got.optimality_gap:.1f}% slower than the "
            "optimum") in out


def test_plan_recomputes_a_stage_only_memory_makes_fit_and_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # VGG-16 on cluster-a under 18 GB: data parallelism just fits; 15-1 is faster but its
    # first stage holds 3 minibatches, which fit only if it recomputes their activations
    code, out, _ = _run(capsys, "pipedream:vgg16", "-t", "cluster-a", "--memory", "18GB",
                        "--no-check", "--json")
    assert code == 0
    got = Plan.from_dict(json.loads(out))
    assert got.config == "15r-1"
    assert [st.recompute for st in got.stages] == [True, False]
    assert all(st.memory_bytes <= 18e9 for st in got.stages)
    code, out, _ = _run(capsys, "pipedream:vgg16", "-t", "cluster-a", "--memory", "18GB",
                        "--no-check", "--no-recompute", "--json")
    plain = Plan.from_dict(json.loads(out))
    assert not any(st.recompute for st in plain.stages)
    assert got.time_per_minibatch_s < plain.time_per_minibatch_s
    code, out, _ = _run(capsys, "pipedream:vgg16", "-t", "cluster-a", "--memory", "18GB",
                        "--no-check")
    lines = out.splitlines()
    first = next(x for x in lines if x.startswith("stage 0: "))
    stage = got.stages[0]
    assert first.startswith("stage 0: on workers 0-14; 15 replicas (on 14 its round would take")
    assert f"slowest term all-reduce {stage.time_s * 1e3:.2f} ms (100% of" in first
    assert f"memory {format_bytes(stage.memory_bytes)} of 18.0 GB; recomputes:" in first
    assert any(x.startswith("stage 1: on worker 15; 1 replica; slowest term ") for x in lines)


def test_plan_says_where_each_stage_s_workers_sit_on_the_servers() -> None:
    """A stage copied on the same workers of every server is said so; one laid otherwise
    lists its workers in runs, the first four of them."""
    graph = LayerGraph.chain([Layer("a", 16.0, 24.0, 10**6, 10**6),
                              Layer("b", 16.0, 24.0, 10**6, 10**6)])
    topo = Topology.parse("4x4")
    copied = evaluate_plan(graph, topo, [0, 1], [8, 8], workers=[
        [k * 4 + i for k in range(4) for i in (0, 1)],
        [k * 4 + i for k in range(4) for i in (2, 3)]])
    lines = stage_reasons(copied, graph, None, per_server=4)
    assert lines[0].startswith("stage 0: on workers 0-1 of servers 0-3; 8 replicas")
    assert lines[1].startswith("stage 1: on workers 2-3 of servers 0-3; 8 replicas")
    uneven = evaluate_plan(graph, topo, [0, 1], [6, 10], workers=[
        [0, 2, 4, 8, 12, 14], [1, 3, 5, 6, 7, 9, 10, 11, 13, 15]])
    lines = stage_reasons(uneven, graph, None, per_server=4)
    assert lines[0].startswith("stage 0: on workers 0, 2, 4, 8 and 2 more runs; 6 replicas")
    assert lines[1].startswith("stage 1: on workers 1, 3, 5-7, 9-11 and 2 more runs;")
    assert stage_reasons(uneven, graph, None)[0].startswith("stage 0: 6 replicas")


def test_a_mixed_plan_is_printed_saved_and_says_why_a_stage_is_split(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from dreampipe.errors import PlanError
    from dreampipe.profiling.gpt_shapes import GptShape, gpt_profile

    profile, saved = tmp_path / "gpt.json", tmp_path / "plan.json"
    gpt_profile(GptShape("gpt-4x4096", 4, 4096, 16, 1024, 50257, 8), 100e12).save(profile)
    # 6.8 GB: a split stage's recomputed forward runs its all-reduces again, so with
    # 8 GB the best plan recomputes nothing
    argv = [str(profile), "-t", "4x8", "-b", "150GB/s", "-b", "12.5GB/s",
            "--memory", "6.8GB", "--no-check"]
    code, out, _ = _run(capsys, *argv, "-o", str(saved))
    assert code == 0
    plan = Plan.load(saved)
    assert plan.mixes_splits and any(s.recompute for s in plan.stages)
    assert f"config {plan.config} on {plan.workers_used} of 32 workers" in out
    split = next(s for s, st in enumerate(plan.stages) if st.tensor_parallel > 1)
    why = next(line for line in out.splitlines() if line.startswith(f"stage {split}: "))
    assert f"split over {plan.stages[split].tensor_parallel} workers of one server" in why
    assert "unsplit, each of its" in why and "above the limit" in why
    # what the smallest plans need is said of the whole-model split only
    assert "data parallelism: does not fit in memory" in out and "(needs" not in out
    # a plan of several widths has no one width: asked for one, it says to read each stage's
    with pytest.raises(PlanError, match=r"no one tensor_parallel; read each stage's"):
        _ = plan.tensor_parallel
    code, out, _ = _run(capsys, *argv, "--json")
    data = json.loads(out)
    assert data["config"] == plan.config
    assert [s["tensor_parallel"] for s in data["stages"]] == [
        s.tensor_parallel for s in plan.stages]
    code, out, _ = _run(capsys, *argv, "--no-mixed-splits")
    assert code == 0 and "t4" not in out.split("config ")[-1].split(" ")[0]


def test_a_plan_over_the_workers_memory_says_so_and_names_the_fix(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Planned without --memory on workers with a known memory, a stage above it is named."""
    code, out, _ = _run(capsys, VGG, "-t", "4x4", "-b", "10GB/s", "-b", "10Gbps")
    assert code == 0
    plan = plan_pipeline(load_graph(VGG), Topology.parse("4x4", ["10GB/s", "10Gbps"]))
    over = [s for s, st in enumerate(plan.stages) if st.memory_bytes > 16 * 10**9]
    assert over, "the case must have a stage over 16 GB"
    line = next(x for x in out.splitlines() if x.startswith("memory:"))
    assert f"stage {over[0]} " in line and "above the 16.0 GB a worker has" in line
    assert "--memory 16.0GB" in line
    code, out, _ = _run(capsys, VGG, "-t", "4x4", "-b", "10GB/s", "-b", "10Gbps",
                        "--memory", "16.0GB")
    assert code == 0 and not any(x.startswith("memory:") for x in out.splitlines())


def test_an_output_file_is_checked_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``plan -o`` naming the profile it reads would overwrite it with a plan, and one in
    a missing directory would fail only once planned: both are one line before planning;
    ``profile -o`` in a missing directory is refused before profiling."""
    profile = tmp_path / "chain.json"
    LayerGraph.chain([Layer(f"l{i}", 1.0, 2.0, 100, 100) for i in range(4)]).save(profile)
    kept = profile.read_text()

    def no_planning(*_: object, **__: object) -> None:
        raise AssertionError("planned before checking -o")

    monkeypatch.setattr("dreampipe.cli.plan_command.plan_pipeline", no_planning)
    for out, needle in ((profile, "is the command's own input, which it would overwrite"),
                        (tmp_path / "no" / "plan.json", "does not exist")):
        assert main(["plan", str(profile), "-t", "2", "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert profile.read_text() == kept
    monkeypatch.setattr("dreampipe.cli.profile_command._measure", no_planning)
    assert main(["profile", "mlp", "-o", str(tmp_path / "no" / "p.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
