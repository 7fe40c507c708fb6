"""dreampipe simulate: plan JSON or profile in, report / JSON / timeline / trace out."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dreampipe.cli import main
from dreampipe.planning.placement import Placement, rank_stages
from dreampipe.planning.plan import Plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.scheduling.actions import ScheduleKind as S
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.torch_csv_write import write_torch_csv
from dreampipe.simulation.simulator import costs_from_plan, simulate_schedule

VGG = "pipedream:vgg16"


def _profile(tmp_path: Path) -> Path:
    layers = [Layer(f"l{i}", 2.0 + i, 4.0 + i, 10**6, 10**5) for i in range(6)]
    path = tmp_path / "profile.json"
    LayerGraph.chain(layers, batch_size=16, model="toy").save(path)
    return path


def _plan(tmp_path: Path, replicas: list[int]) -> Path:
    bounds = [0, 2, 4][: len(replicas)]
    path = tmp_path / "plan.json"
    Plan.from_config(6, bounds, replicas, model="toy", topology="4").save(path)
    return path


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


@pytest.mark.parametrize("schedule", ["pipedream", "1f1b-flush", "gpipe", "dp", "naive"])
def test_every_schedule_on_a_plan_with_its_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], schedule: str
) -> None:
    plan, prof = _plan(tmp_path, [2, 1, 1]), _profile(tmp_path)
    data = _json(capsys, ["simulate", str(plan), "--profile", str(prof), "--schedule", schedule,
                          "--minibatches", "6", "--microbatches", "4", "--json"])
    assert data["schedule"] == schedule
    assert float(data["throughput_minibatches_per_s"]) > 0  # type: ignore[arg-type]
    assert 0 <= float(data["bubble_fraction"]) < 1  # type: ignore[arg-type]
    memory = data["peak_memory_bytes"]
    assert isinstance(memory, list) and len(memory) == 4 and min(memory) > 0
    expected_microbatches = {"pipedream": 6, "dp": 8, "naive": 24, "gpipe": 24, "1f1b-flush": 24}
    assert data["num_microbatches"] == expected_microbatches[schedule]


@pytest.mark.parametrize(("schedule", "most"), [("pipedream", 0.9), ("2bw", 0.99),
                                               ("1f1b-flush", None)])
def test_a_clipped_run_holds_the_asynchronous_stages_to_each_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], schedule: str, most: float | None
) -> None:
    """--clipped: every update waits for every stage's backward of it; 2bw's 12
    microbatches an update (4 a stage) pay it once, pipedream's one every minibatch, a
    flushed pipeline not at all."""
    plan, prof = _plan(tmp_path, [1, 1, 1]), _profile(tmp_path)
    argv = ["simulate", str(plan), "--profile", str(prof), "--schedule", schedule,
            "--minibatches", "12", "--json"]
    alone, clipped = (float(_json(capsys, argv + extra)["throughput_minibatches_per_s"])
                      for extra in ([], ["--clipped"]))
    assert clipped == pytest.approx(alone) if most is None else clipped < most * alone


def test_clipped_pipedream_on_unequal_replicas_is_refused_by_its_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stages would update at different rates and never agree (a Pipeline refuses the
    same run): one line naming the flag and the fix, not a simulation left blocked."""
    plan, prof = _plan(tmp_path, [1, 2]), _profile(tmp_path)
    argv = ["simulate", str(plan), "--profile", str(prof), "--clipped"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--clipped with pipedream needs every stage replicated equally (got 1-2)" in err
    assert "validate()" not in err
    assert main([*argv, "--schedule", "2bw", "--json"]) == 0


def test_a_plan_without_its_profile_says_another_topology_does_not_price_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its costs are its own predictions: --sync would change nothing (an error naming
    --profile), another topology only where its ranks sit (a note saying so); with the
    profile the plan is priced anew."""
    out = tmp_path / "g.json"
    assert main(["plan", "pipedream:gnmt", "-t", "2x2", "--no-check", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(out), "--sync", "ring"]) == 2
    err = capsys.readouterr().err
    assert "--sync ring for plan" in err and "add --profile" in err
    own = _json(capsys, ["simulate", str(out), "--json"])
    assert main(["simulate", str(out), "-t", "64", "--json"]) == 0
    moved, err = capsys.readouterr()
    assert "note: --topology 64 places plan" in err and "add --profile" in err
    assert json.loads(moved)["throughput_minibatches_per_s"] == pytest.approx(
        own["throughput_minibatches_per_s"], rel=0.02)  # the plan's times, placed anew
    other = _json(capsys, ["simulate", str(out), "-t", "64", "--profile", "pipedream:gnmt",
                           "--json"])
    assert own["throughput_minibatches_per_s"] != other["throughput_minibatches_per_s"]


def test_no_stages_per_worker_is_refused_for_what_it_is(
    capsys: pytest.CaptureFixture[str]
) -> None:
    for schedule in ("pipedream", "interleaved-1f1b"):
        assert main(["simulate", "pipedream:gnmt", "-t", "4", "--virtual-stages", "0",
                     "--schedule", schedule]) == 2
        assert "--virtual-stages 0; a worker runs 1 stage or more" in capsys.readouterr().err


def test_a_saved_plan_simulates_with_the_schedule_plan_chose_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "g.json"
    assert main(["plan", "pipedream:gnmt", "-t", "4", "--no-check", "--json", "-o",
                 str(out)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["schedule"] not in ("pipedream", "dp")  # a synchronous one, microbatched
    ran = _json(capsys, ["simulate", str(out), "--json"])
    assert (ran["schedule"], ran["microbatches_per_update"]) == (
        planned["schedule"], planned["microbatches"])
    assert ran["throughput_minibatches_per_s"] == pytest.approx(
        planned["schedule_minibatches_per_s"], rel=0.01)
    other = _json(capsys, ["simulate", str(out), "--schedule", "pipedream", "--json"])
    assert other["schedule"] == "pipedream"  # a flag still runs another
    data = json.loads(out.read_text())
    data["chosen_schedule"] = {"schedule": "warp", "microbatches": 4}
    out.write_text(json.dumps(data))
    assert main(["simulate", str(out)]) == 2
    assert "chosen_schedule=" in capsys.readouterr().err


def test_a_long_simulation_says_so_before_it_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dreampipe.cli import simulate_command

    monkeypatch.setattr(simulate_command, "_LONG_MINIBATCHES", 8)
    argv = ["simulate", "pipedream:gnmt", "-t", "4", "--json", "--minibatches"]
    assert main([*argv, "8"]) == 0 and "note: " not in capsys.readouterr().err
    assert main([*argv, "9"]) == 0
    assert "note: simulating 9 minibatches takes" in capsys.readouterr().err


def test_human_report_lists_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(_plan(tmp_path, [1, 1, 1])), "--minibatches", "5"]) == 0
    out = capsys.readouterr().out
    assert "pipedream, config straight on 3 workers" in out
    assert "bubble" in out and "throughput" in out
    rows = [ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert len(rows) == 3
    assert "n/a" in out and "--profile" in out


def test_profile_is_planned_then_drawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, trace = tmp_path / "vgg.png", tmp_path / "vgg.json"
    data = _json(capsys, ["simulate", VGG, "--topology", "cluster-a", "--timeline", str(png),
                          "--trace", str(trace), "--json"])
    assert data["schedule"] == "pipedream" and data["topology"] == "cluster-a"
    assert png.read_bytes().startswith(b"\x89PNG")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"] == "F0" for e in events)


def test_memory_plans_a_profile_under_it_and_flags_a_plan_over_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    free = _json(capsys, ["simulate", "pipedream:gnmt", "-t", "4x4", "--json"])
    limit = 2 * 10**9
    assert max(free["peak_memory_bytes"]) > limit  # type: ignore[type-var]
    held = _json(capsys, ["simulate", "pipedream:gnmt", "-t", "4x4", "--memory", "2GB",
                          "--json"])
    assert max(held["peak_memory_bytes"]) <= limit  # type: ignore[type-var]
    assert held["over_memory_ranks"] == [] and held["memory_limit_bytes"] == limit
    # a plan is simulated as given, and the ranks over the limit are named
    plan, prof = _plan(tmp_path, [2, 1, 1]), _profile(tmp_path)
    argv = ["simulate", str(plan), "--profile", str(prof), "-t", "4", "--memory", "1MB"]
    over = _json(capsys, [*argv, "--json"])
    assert over["over_memory_ranks"] == [0, 1, 2, 3]
    assert main(argv) == 0
    assert "warning: ranks [0, 1, 2, 3] peak above --memory 1.0 MB" in capsys.readouterr().out
    # a plan file taken on its own topology: a size without a unit is named as such
    assert main(["simulate", str(plan), "--memory", "16"]) == 2
    assert "size '16' has no unit; write e.g. 16GB" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["--schedule", "dp"], "pass --profile"),
    (["--minibatches", "0"], "--minibatches 0"),
    (["--topology", "2"], "larger --topology"),
])
def test_user_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], match: str
) -> None:
    plan = _plan(tmp_path, [2, 1, 1])
    extra = ["--profile", str(_profile(tmp_path))] if "--topology" in argv else []
    assert main(["simulate", str(plan), *extra, *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_missing_file_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--trace", "--timeline"])
def test_unwritable_output_is_a_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    plan = _plan(tmp_path, [2, 1, 1])
    target = tmp_path / "no-such-dir" / "out"
    assert main(["simulate", str(plan), option, str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dreampipe simulate: error:") and str(target) in err
    assert err.count("\n") == 1


def test_binary_input_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xd0\xff\xfe\x00")
    assert main(["simulate", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "not text" in err and err.count("\n") == 1



def _chain(tmp_path: Path, layers: int) -> Path:
    """The issue's synthetic chain: F = 10 ms, a backward of 20 ms per layer, no split."""
    path = tmp_path / f"chain{layers}.json"
    LayerGraph.chain([Layer(f"l{i}", 10.0, 20.0, 0, 0) for i in range(layers)]).save(path)
    return path


def _bubble(capsys: pytest.CaptureFixture[str], plan: Path, profile: Path, *extra: str) -> float:
    data = _json(capsys, ["simulate", str(plan), "--profile", str(profile), "--topology", "1x4",
                          "--microbatches", "8", "--minibatches", "1", "--json", *extra])
    return float(str(data["bubble_fraction"]))


def test_zb_h1_leaves_at_most_half_of_1f1b_flush_bubble(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain, plan = _chain(tmp_path, 4), tmp_path / "plan4.json"
    Plan.from_config(4, [0, 1, 2, 3], [1, 1, 1, 1]).save(plan)
    flush = _bubble(capsys, plan, chain, "--schedule", "1f1b-flush")
    zb = _bubble(capsys, plan, chain, "--schedule", "zb-h1")
    assert flush == pytest.approx(0.273, abs=5e-4) and zb == pytest.approx(0.111, abs=5e-4)
    assert zb <= 0.5 * flush


def test_interleaved_on_virtual_stages_leaves_at_most_065_of_flush(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain8, planned = _chain(tmp_path, 8), tmp_path / "plan8.json"
    assert main(["plan", str(chain8), "-t", "1x4", "--virtual-stages", "2", "-o",
                 str(planned)]) == 0
    capsys.readouterr()
    four = tmp_path / "plan4x2.json"
    Plan.from_config(8, [0, 2, 4, 6], [1, 1, 1, 1]).save(four)
    flush = _bubble(capsys, four, chain8, "--schedule", "1f1b-flush")
    inter = _bubble(capsys, planned, chain8, "--schedule", "interleaved-1f1b",
                    "--virtual-stages", "2")
    assert flush == pytest.approx(0.273, abs=5e-4) and inter == pytest.approx(0.158, abs=5e-4)
    assert inter <= 0.65 * flush
    assert main(["simulate", str(planned), "--profile", str(chain8), "--topology", "1x4",
                 "--virtual-stages", "2", "--schedule", "1f1b-flush"]) != 0
    assert "--virtual-stages 2 with --schedule 1f1b-flush; only interleaved-1f1b" in (
        capsys.readouterr().err)


def test_the_v_schedules_leave_a_quarter_of_flush_and_dualpipes_bound_at_most(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's chain (F = 10 ms and a backward of 20 ms a layer, half of it the weight
    gradient: F = B = W) on 4 workers, 8 microbatches: zbv leaves at most a quarter of
    1f1b-flush's bubble on the same layers, dualpipev less than 1f1b-flush and at most its
    bound, (p - 1)(F&B + B - 3W) a worker (DualPipe's, for DualPipeV on p workers; F&B
    costs F + B here: the simulator overlaps communication, not compute). The plan is
    ``dreampipe plan --schedule zbv``'s: 8 stages, stage s and 7 - s on one worker."""
    chain8, v_plan = _chain(tmp_path, 8), tmp_path / "v.json"
    assert main(["plan", str(chain8), "-t", "1x4", "--schedule", "zbv", "-o",
                 str(v_plan)]) == 0
    assert "zbv, 2 stages per worker in a V on 4 workers" in capsys.readouterr().out
    assert [st.ranks for st in Plan.load(v_plan).stages] == [
        (0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,)]
    four = tmp_path / "plan4x2.json"
    Plan.from_config(8, [0, 2, 4, 6], [1, 1, 1, 1]).save(four)
    flush = _bubble(capsys, four, chain8, "--schedule", "1f1b-flush")
    zbv = _bubble(capsys, v_plan, chain8, "--schedule", "zbv")
    dual = _bubble(capsys, v_plan, chain8, "--schedule", "dualpipev")
    f, b, w, ranks, m = 10.0, 20.0, 10.0, 4, 8
    bound = (ranks - 1) * ((f + b) + b - 3 * w)  # ms idle a worker
    busy = 2 * m * (f + b)  # ms computing a worker: 2 stages, m microbatches
    assert flush == pytest.approx(0.273, abs=5e-4)
    assert zbv <= flush / 4
    assert dual < flush and dual <= bound / (busy + bound)
    assert main(["simulate", str(v_plan), "--profile", str(chain8), "--topology", "1x4",
                 "--schedule", "interleaved-1f1b"]) != 0
    assert "only zbv and dualpipev run that: use --schedule zbv or --schedule dualpipev" in (
        capsys.readouterr().err)


def test_a_v_schedule_draws_its_overlapped_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dualpipev's timeline and trace: each OVERLAP_F_B a slice around its forward's and
    backward's, on the worker that holds both stages."""
    chain8, v_plan = _chain(tmp_path, 8), tmp_path / "v.json"
    Plan.from_config(8, list(range(8)), [1] * 8, virtual_stages=2,
                     placement=Placement.V).save(v_plan)
    png, trace = tmp_path / "v.png", tmp_path / "v.trace.json"
    _json(capsys, ["simulate", str(v_plan), "--profile", str(chain8), "--topology", "1x4",
                   "--schedule", "dualpipev", "--microbatches", "8", "--minibatches", "1",
                   "--timeline", str(png), "--trace", str(trace), "--json"])
    assert png.stat().st_size > 10_000
    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    pairs = [e for e in slices if e["args"]["kind"] == "OVERLAP_F_B"]
    assert pairs
    for pair in pairs:
        inside = [e for e in slices if e["pid"] == pair["pid"] and e["tid"] == 0
                  and e is not pair and pair["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= pair["ts"] + pair["dur"] + 1e-6]
        assert sorted(e["args"]["kind"] for e in inside) == ["B", "F"]
        assert {e["args"]["stage"] for e in inside} == set(
            rank_stages(pair["pid"], 8, 2, Placement.V))


def _chain_txt(path: Path, layers: int) -> Path:
    """The issue's chain as a PipeDream graph.txt: F = 10 ms, B = 20 ms, nothing to send."""
    nodes = "".join(f"node{i} -- Linear(l{i}) -- forward_compute_time=10.0, "
                    "backward_compute_time=20.0, activation_size=0.0, parameter_size=0.0\n"
                    for i in range(layers))
    path.write_text(nodes + "".join(f"\tnode{i} -- node{i + 1}\n" for i in range(layers - 1)))
    return path


def _plan_bubble(capsys: pytest.CaptureFixture[str], plan: Path, *extra: str) -> float:
    data = _json(capsys, ["simulate", str(plan), "--schedule", "interleaved-1f1b",
                          "--microbatches", "8", "--minibatches", "1", "--json", *extra])
    return float(str(data["bubble_fraction"]))


def test_a_plan_made_for_virtual_stages_simulates_them_without_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain8, saved = _chain_txt(tmp_path / "chain8.txt", 8), tmp_path / "p.json"
    assert main(["plan", str(chain8), "-t", "4", "--straight", "--virtual-stages", "2",
                 "-o", str(saved)]) == 0
    said = capsys.readouterr().out
    assert "with its schedule, interleaved-1f1b, which 'dreampipe simulate' runs\n" in said
    plan = Plan.load(saved)
    assert plan.virtual_stages == 2 and plan.workers_used == 4
    bare = _plan_bubble(capsys, saved)
    assert bare == _plan_bubble(capsys, saved, "--virtual-stages", "2")
    topo = Topology.parse("4")
    by_hand = simulate_schedule(build_schedule([1] * 8, S.INTERLEAVED, 8, 8, virtual_stages=2),
                                costs_from_plan(plan, topo, 1 / 8)).bubble_fraction
    eight_ranks = simulate_schedule(build_schedule([1] * 8, S.INTERLEAVED, 8, 8),
                                    costs_from_plan(plan, topo, 1 / 8)).bubble_fraction
    assert bare == pytest.approx(by_hand) and bare == pytest.approx(0.158, abs=5e-4)
    assert eight_ranks == pytest.approx(0.467, abs=5e-4)  # what the flag's absence gave
    assert _plan_bubble(capsys, saved, "--profile", str(chain8)) == pytest.approx(bare)


@pytest.mark.parametrize(("argv", "needles"), [
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "1"],
     ["--virtual-stages 1 but plan", "runs 2 stages per worker (its virtual_stages is 2)",
      "drop --virtual-stages 1"]),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "4"],
     ["--virtual-stages 4 but plan", "make the plan with 4 stages per worker"]),
    ([], ["--schedule pipedream for plan", "use --schedule interleaved-1f1b"]),
])
def test_a_count_or_schedule_against_the_plan_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    saved = tmp_path / "p.json"
    Plan.from_config(8, list(range(8)), [1] * 8, topology="4", virtual_stages=2).save(saved)
    assert main(["simulate", str(saved), *argv]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert err.count("\n") == 1


def test_a_plan_with_more_ranks_than_its_topology_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = Plan.from_config(8, list(range(8)), [1] * 8, topology="4").to_dict()
    del data["virtual_stages"]  # a plan file written before it carried the field
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    for extra in ([], ["--virtual-stages", "2"]):
        assert main(["simulate", str(old), "--schedule", "interleaved-1f1b",
                     "--microbatches", "8", *extra]) == 2
        err = capsys.readouterr().err
        assert "needs 8 workers (a rank at position 7) but topology 4 has 4" in err
        assert "dreampipe plan --virtual-stages 2" in err
    assert main(["simulate", str(old), "--topology", "8", "--schedule", "1f1b-flush",
                 "--microbatches", "8", "--minibatches", "1"]) == 0  # loads, on 8 workers


def test_zero_levels_price_the_reduce_scatters_and_gathers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["simulate", "pipedream:vgg16", "--topology", "4x4", "--schedule", "1f1b-flush",
            "--json"]
    rate = {z: _json(capsys, [*base, "--zero", str(z)])["throughput_minibatches_per_s"]
            for z in (0, 1, 2, 3)}
    assert rate[1] < rate[0]  # the updated chunks' all-gather after the step
    assert rate[2] > rate[1]  # reduce-scatters as the backwards end, not an all-reduce after
    assert main(["simulate", "pipedream:vgg16", "--topology", "4x4", "--zero", "3"]) == 2
    assert "use zero=2, or a synchronous schedule" in capsys.readouterr().err


def test_without_the_profile_no_peak_or_fit_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A plan alone says its stages' times, not what its layers keep: the peaks are
    unknown (null), and so is whether they exceed --memory."""
    plan = _plan(tmp_path, [2, 1, 1])
    base = ["simulate", str(plan), "--schedule", "1f1b-flush", "--microbatches", "4"]
    data = _json(capsys, [*base, "--json", "--memory", "16GB"])
    assert data["memory_known"] is False and data["peak_memory_bytes"] is None
    assert data["over_memory_ranks"] is None
    assert _json(capsys, [*base, "--json"])["over_memory_ranks"] == []
    assert main([*base, "--memory", "16GB"]) == 0
    assert "--memory is checked against it" in capsys.readouterr().out


def test_zero_levels_shard_what_a_replicated_stage_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Stage 0 on 2 replicas holds 8 MB of weights: from level 2 each keeps half of their
    gradients (plain SGD keeps no state for level 1 to shard); stage 1, unreplicated,
    holds the same at every level."""
    profile, plan = tmp_path / "chain.json", tmp_path / "plan.json"
    LayerGraph.chain([Layer(f"l{i}", 10.0, 20.0, 1000, 4 * 10**6) for i in range(4)]
                     ).save(profile)
    Plan.from_config(4, [0, 2], [2, 1]).save(plan)
    peak = {z: _json(capsys, ["simulate", str(plan), "--profile", str(profile), "--topology",
                              "3", "--schedule", "1f1b-flush", "--microbatches", "4",
                              "--zero", str(z), "--json"])["peak_memory_bytes"]
            for z in (0, 1, 2, 3)}
    assert peak[1] == peak[0]
    assert peak[2] == peak[3] == [p - 4 * 10**6 for p in peak[0][:2]] + [peak[0][2]]


def test_a_pytorch_schedule_file_simulates_as_the_schedule_it_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One minibatch of interleaved 1F1B (4 stages on 2 workers, 8 microbatches) in
    PyTorch's CSV, repeated 3 times: the run ``--schedule interleaved-1f1b`` builds, without
    importing PyTorch; a V-placed file on a plan of the loop is one line naming both."""
    chain, plan, csv = _chain(tmp_path, 8), tmp_path / "plan.json", tmp_path / "pp.csv"
    Plan.from_config(8, [0, 2, 4, 6], [1] * 4, virtual_stages=2, topology="1x2").save(plan)
    write_torch_csv(build_schedule([1] * 4, S.INTERLEAVED, 8, 8, virtual_stages=2), csv)
    argv = ["simulate", str(plan), "--profile", str(chain), "--minibatches", "3", "--json"]
    code = ("import sys, json\nfrom dreampipe.cli import main\n"
            f"assert main({[*argv, '--schedule-file', str(csv)]!r}) == 0\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'torch']\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    from_file = json.loads(done.stdout)
    built = _json(capsys, [*argv, "--schedule", "interleaved-1f1b", "--microbatches", "8"])
    assert from_file == built
    assert from_file["schedule"] == "interleaved-1f1b" and from_file["num_microbatches"] == 24
    assert 0 < float(from_file["bubble_fraction"]) < 1  # type: ignore[arg-type]
    write_torch_csv(build_schedule([1] * 4, S.ZBV, 1, 1, virtual_stages=2), csv)
    assert main([*argv, "--schedule-file", str(csv), "--microbatches", "1"]) == 2
    err = capsys.readouterr().err
    assert (f"--schedule-file '{csv}' places its 4 stages in the v placement, the plan in the "
            "loop; make the plan with dreampipe plan --schedule zbv") in err
    assert err.count("\n") == 1
    csv.write_text("0F0,0B0\n1F0,1B0\n")
    assert main([*argv, "--schedule-file", str(csv)]) == 2
    assert "runs 2 unreplicated stages but the plan has replicas 1-1-1-1" in (
        capsys.readouterr().err)


def test_a_plan_on_links_of_its_own_simulates_on_them_or_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan made with ``-b`` keeps its links only in its topology's description:
    simulating it on the preset's own links would be another cluster's figure, so that is
    a one-line error naming the flags, and with the plan's links it runs."""
    plan = tmp_path / "plan.json"
    links = ["-b", "10GB/s", "-b", "50GB/s"]
    assert main(["plan", "pipedream:alexnet", "-t", "2x4", *links, "--no-check",
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan), "--minibatches", "16"]) == 2
    err = capsys.readouterr().err
    assert "50.0 GB/s" in err and "-b and --latency" in err and err.count("\n") == 1
    ran = _json(capsys, ["simulate", str(plan), "--minibatches", "16", *links, "--json"])
    assert ran["topology"] == "2x4" and float(str(ran["throughput_minibatches_per_s"])) > 0


@pytest.mark.parametrize(("text", "needle"), [
    ('{"a": 1}', "is neither a plan (its 'format' 'dreampipe.plan') nor a profile"),
    ("not json at all", "is not a JSON object"),
])
def test_a_json_file_that_is_no_plan_nor_profile_names_both(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "other.json"
    path.write_text(text)
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "'dreampipe plan -o'" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("replicas", "2", 'stages[0].replicas="2" is text; write a whole number without quotes'),
    ("recompute", "yes", 'stages[0].recompute="yes" is text; write true or false'),
    ("first", 0.5, "stages[0].first=0.5 is a fraction; write a whole number"),
])
def test_a_plan_with_a_mistyped_field_names_the_file_and_the_field(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, field: str, value: object,
        needle: str) -> None:
    path = _plan(tmp_path, [2, 1, 1])
    data = json.loads(path.read_text())
    data["stages"][0][field] = value
    path.write_text(json.dumps(data))
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dreampipe simulate: error: plan {str(path)!r}: {needle}"), err
    assert err.count("\n") == 1


def test_a_plan_for_virtual_stages_carries_its_cuts_to_a_simulation_without_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Simulated from its JSON alone, an interleaved plan pays its cuts over the slow links
    as the profile says they cost, not nothing."""
    saved = tmp_path / "v2.json"
    assert main(["plan", "pipedream:alexnet", "-t", "2x2", "-b", "10GB/s", "-b", "1Gbps",
                 "--virtual-stages", "2", "-o", str(saved)]) == 0
    capsys.readouterr()
    plan = Plan.load(saved)
    assert all(st.comm_s > 0 for st in plan.stages[:-1]) and plan.stages[-1].comm_s == 0
    argv = ["simulate", str(saved), "--schedule", "interleaved-1f1b", "--microbatches", "8",
            "--minibatches", "2", "-b", "10GB/s", "-b", "1Gbps", "--json"]
    bare = float(str(_json(capsys, argv)["throughput_minibatches_per_s"]))
    profiled = float(str(_json(capsys, [*argv, "--profile", "pipedream:alexnet"])[
        "throughput_minibatches_per_s"]))
    assert bare == pytest.approx(profiled, rel=0.15), (bare, profiled)
    free = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, comm_s=0.0)
                                                  for st in plan.stages))
    free.save(tmp_path / "free.json")
    argv[1] = str(tmp_path / "free.json")
    assert float(str(_json(capsys, argv)["throughput_minibatches_per_s"])) > 1.5 * profiled
