"""``dreampipe plan --global-batch``: the synchronous objective on the command line, a
layout priced with ``--layout``, and the flags' mistakes as one line each."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dreampipe.cli import main
from dreampipe.errors import PlanError
from dreampipe.planning.layout import parse_layout
from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_search import plan_sync
from dreampipe.planning.topology import Topology
from dreampipe.profiling.gpt_shapes import blocks_recomputed
from dreampipe.profiling.load import load_graph
from dreampipe.simulation.sync_run import SYNC_RUN_KEY, SyncRun
from tests.cli.test_cli_gpt import _json

#: Megatron-LM's 1.7B model of SC21's Table 1 (24 layers, 2304 wide, 24 heads).
GPT_1_7B = "gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200"
SMALL = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000"


def test_a_layout_on_dgx_a100_prices_its_update_and_teraflops(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _json(capsys, "plan", GPT_1_7B, "-t", "dgx-a100:4", "--global-batch", "512",
                 "--precision", "bf16", "--optimizer", "adam", "--layout", "t1-p1", "--json")
    assert (data["layout"], data["data_parallel"], data["workers_used"]) == ("t1-p1", 32, 32)
    assert data["global_batch"] == 32 * data["microbatches"] * data["microbatch_size"]
    assert len(data["memory_bytes"]) == 1 and 0 < data["memory_bytes"][0] <= 80e9
    topo = Topology.parse("dgx-a100:4")
    graph = load_graph(GPT_1_7B, topo.device)
    want = plan_sync(graph, topo, SyncOptions(
        global_batch=512, memory_bytes=topo.memory_bytes, training=Training("bf16", "adam"),
        layout=parse_layout("t1-p1"), recompute=True))
    assert data["time_per_update_s"] == pytest.approx(want.time_per_update_s)
    assert data["simulated_time_per_update_s"] <= data["time_per_update_s"] * (1 + 1e-9)
    # Megatron-LM's count of what the plan runs: 72 B s l h^2 (1 + s/6h) + 6 B s h V, and
    # 24 B s h^2 (1 + s/6h) more a recomputed block; over the simulated update
    s, n, h, v, batch = 2048, 24, 2304, 51200, 512
    again = blocks_recomputed(graph, want.recomputed_layers)
    flops = (72 * n + 24 * again) * batch * s * h * h * (1 + s / (6 * h)) + 6 * batch * s * h * v
    assert data["tflops_per_gpu"] == pytest.approx(
        flops / data["simulated_time_per_update_s"] / 32 / 1e12)
    assert 50 < data["tflops_per_gpu"] < 312  # below the A100's dense 16-bit peak


def test_a_layout_that_leaves_workers_idle_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """``t1-p3`` on 8 workers runs 2 copies of 3 and leaves 2 idle: a note says so, and
    that the TFLOP/s count the 6 used; a layout that fills them has no such note."""
    argv = ["plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "64", "--layout"]
    data = _json(capsys, *argv, "t1-p3", "--json")
    assert data["workers_used"] == 6
    (note,) = [x for x in data["notes"] if "idle" in x]
    assert "runs 2 copies of its 3 workers: 2 of the 8 stay idle" in note
    assert "count the 6 used" in note and "divides 8" in note
    assert not _json(capsys, *argv, "t1-p2", "--json")["notes"]


def test_a_layout_whose_t_does_not_divide_the_heads_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SMALL's 4 heads split over t = 8 cannot go by whole heads: a note names the heads
    and the fix; t = 4 divides them and has none."""
    argv = ["plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "64", "--layout"]
    (note,) = _json(capsys, *argv, "t8-p1", "--json")["notes"]
    assert "t = 8 does not divide attention's 4 heads" in note and "divides the heads" in note
    assert not _json(capsys, *argv, "t4-p1", "--json")["notes"]


def test_a_saved_plan_simulates_as_its_synchronous_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    """The plan file keeps the run (schedule, microbatches, blocks recomputed, formats), so
    ``simulate`` runs what the planner checked, not a pipedream pipeline of its stages."""
    saved = tmp_path / "plan.json"
    data = _json(capsys, "plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "32",
                 "--precision", "bf16", "--optimizer", "adam", "--layout", "t1-p2-r1",
                 "--whole-blocks", "-o", str(saved), "--json")
    run = SyncRun.from_dict(json.loads(saved.read_text())[SYNC_RUN_KEY])
    assert run.schedule.value == data["schedule"]
    assert run.microbatches == 32 // data["microbatch_size"]
    assert run.recomputed and run.training == Training("bf16", "adam")
    assert SyncRun.from_dict(run.to_dict()) == run
    sim = _json(capsys, "simulate", str(saved), "--profile", SMALL, "--json")
    assert sim["as_planned"] and sim["schedule"] == data["schedule"]
    update = 32 / sim["throughput_minibatches_per_s"]
    assert update == pytest.approx(data["simulated_time_per_update_s"], rel=1e-9)
    other = _json(capsys, "simulate", str(saved), "--profile", SMALL, "--schedule",
                  "pipedream", "--json")
    assert not other["as_planned"] and other["schedule"] == "pipedream"
    # the prediction is the synchronous run's, and the rates say their units
    assert sim["predicted_schedule"] == other["predicted_schedule"] == data["schedule"]
    assert sim["global_batch"] == 32 and sim["batch_size"] == 1
    assert main(["simulate", str(saved), "--profile", SMALL]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("throughput"))
    samples = sim["throughput_minibatches_per_s"]
    assert f"{samples:.1f} samples/s = {samples / 32:.3f} updates/s" in line
    assert f"its {data['schedule']} run)" in line and "pipedream" not in line
    with pytest.raises(PlanError, match="malformed sync_run"):
        SyncRun.from_dict({"schedule": "zb-h1"})


def test_r0_recomputes_nothing_and_more_blocks_than_a_stage_holds_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``r0`` fixes no recomputation; ``r`` above the blocks a stage holds recomputes all
    of them, priced as the most any stage holds, and a note says so."""
    args = ("plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "32", "--layout")
    none = _json(capsys, *args, "t1-p2-r0", "--json")
    assert none["layout"] == "t1-p2" and none["notes"] == []
    assert [s["option"] for s in none["stages"]] == ["", ""]
    many = _json(capsys, *args, "t1-p2-v1-r100", "--json")
    assert len(many["notes"]) == 1 and "r100" in many["notes"][0], many["notes"]
    most = int(many["notes"][0].rsplit(" as r", 1)[1].split()[0])
    assert 1 <= most < 4
    same = _json(capsys, *args, f"t1-p2-v1-r{most}", "--json")
    assert same["notes"] == []
    assert many["time_per_update_s"] == pytest.approx(same["time_per_update_s"], rel=1e-12)
    assert many["memory_bytes"] == same["memory_bytes"]
    assert none["time_per_update_s"] < same["time_per_update_s"]
    assert main([*args, "t1-p2-r100"]) == 0
    assert "note: --layout t1-p2-r100 recomputes 100 blocks" in capsys.readouterr().out


def test_interleaved_copies_of_split_stages_are_simulated_from_their_terms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The runtime does not run interleaving on split or replicated stages; the check
    simulates one copy from the plan's terms, below the objective's bound."""
    data = _json(capsys, "plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "64",
                 "--layout", "t2-p2-v2", "--json")
    assert data["virtual_stages"] == 2 and data["data_parallel"] == 2
    assert data["check_skipped"] is False
    assert 0 < data["simulated_time_per_update_s"] <= data["time_per_update_s"] * (1 + 1e-9)


def test_global_batch_plans_and_microbatch_size_fixes_b(
    capsys: pytest.CaptureFixture[str],
) -> None:
    free = _json(capsys, "plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "64", "--json")
    fixed = _json(capsys, "plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "64",
                  "--microbatch-size", "4", "--json")
    assert fixed["microbatch_size"] == 4
    assert free["time_per_update_s"] <= fixed["time_per_update_s"] * (1 + 1e-9)
    assert main(["plan", SMALL, "-t", "dgx-a100:1", "--global-batch", "64",
                 "--layout", "t2-p2", "--schedule", "1f1b-flush"]) == 0
    out = capsys.readouterr().out
    assert "layout t2-p2: 2 copies x 2 stages x 2 workers" in out
    assert "TFLOP/s per GPU" in out and "simulated:" in out


def _measured(tmp_path: Path) -> str:
    """PipeDream's AlexNet profile, with a batch it was measured at."""
    path = tmp_path / "alexnet.json"
    dataclasses.replace(load_graph("pipedream:alexnet"), batch_size=128).save(path)
    return str(path)


def test_a_measured_profile_has_no_teraflops(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    data = _json(capsys, "plan", _measured(tmp_path), "-t", "cluster-b", "--global-batch",
                 "64", "--json")
    assert data["tflops_per_gpu"] is None and data["time_per_update_s"] > 0


def test_a_profile_without_its_batch_is_refused_a_global_batch(
        capsys: pytest.CaptureFixture[str]) -> None:
    """PipeDream's bundled profiles do not say the batch they were measured at: priced as
    one sample each, every time and activation came out that many times too large."""
    assert main(["plan", "pipedream:vgg16", "-t", "4x4", "--global-batch", "256"]) == 2
    err = capsys.readouterr().err
    assert "does not say the batch it was measured at" in err and "dreampipe profile" in err


@pytest.mark.parametrize(("argv", "needles"), [
    (["--layout", "t2-p2"], ["--layout", "--global-batch"]),
    (["--microbatch-size", "4"], ["--microbatch-size", "--global-batch"]),
    (["--global-batch", "64", "--layout", "t2-x2"], ["'x2'", "t8-p8-v2-z1-r4"]),
    (["--global-batch", "64", "--layout", "p2-t2"], ["order t, p, v, z, r"]),
    (["--global-batch", "64", "--layout", "t2"], ["misses p"]),
    (["--global-batch", "64", "--layout", ""], ["--layout '' names no layout"]),
    (["--global-batch", "64", "--layout", "t2-p2-z4"], ["z4 is no ZeRO level"]),
    (["--global-batch", "64", "--layout", "t2-p8"], ["needs 16 workers"]),
    (["--global-batch", "64", "--layout", "t16-p1", "-t", "dgx-a100:2"],
     ["t = 16 runs inside one server", "has 8 workers: give t at most 8"]),
    (["--global-batch", "63", "--layout", "t2-p2"], ["do not divide the global batch 63"]),
    (["--global-batch", "64", "--microbatch-size", "65"], ["--microbatch-size 65"]),
    (["--global-batch", "0"], ["--global-batch 0"]),
    (["--global-batch", "7", "--microbatch-size", "2"],
     ["--microbatch-size 2 does not divide the global batch of 7", "(1, 7)", "(6, 8)"]),
    (["--global-batch", "12", "--microbatch-size", "5"], ["(1, 2, 3, 4, 6, 12)", "(10, 15)"]),
    (["--global-batch", "64", "--semantics", "async"], ["--semantics async"]),
    (["--global-batch", "64", "--layout", "t1-p3", "--whole-blocks"],
     ["4 blocks into 3 stages", "drop --whole-blocks"]),
    (["--whole-blocks"], ["--whole-blocks", "--global-batch"]),
    (["--global-batch", "64", "--zero-levels", "0,4"], ["--zero-levels 0,4;", "0 to 3"]),
    (["--global-batch", "64", "--zero-levels", "one"], ["--zero-levels one"]),
    (["--global-batch", "64", "--layout", "t1-p2-z1", "--zero-levels", "0,1"],
     ["fixes level 1", "drop z from the layout"]),
    (["--zero-levels", "0,1"], ["--zero-levels", "--global-batch"]),
    (["--recompute-blocks"], ["--recompute-blocks", "--global-batch"]),
    (["--global-batch", "64", "--recompute-blocks", "--no-recompute"],
     ["recompute_blocks=True with recompute=False", "drop --no-recompute"]),
    *(([*flag, "--global-batch", "64"], [f"{flag[0]} with --global-batch", fix])
      for flag, fix in ((["--straight"], "--layout"), (["--all-workers"], "--layout"),
                        (["--max-stages", "2"], "--layout"),
                        (["--microbatches", "4"], "--microbatch-size instead"),
                        (["--exact"], "drop --exact"),
                        (["--cost-model", "pipedream"], "asynchronous pipeline only"),
                        (["--check-minibatches", "9"], "drop the flag"))),
])
def test_bad_sync_flags_are_one_line_naming_them(
    capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str],
) -> None:
    assert main(["plan", SMALL, "-t", "dgx-a100:1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dreampipe plan: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_plan_says_why_each_stage_runs_as_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=8192", "-t",
            "dgx-a100:1", "--global-batch", "64", "--memory", "1GB", "--precision", "bf16",
            "--optimizer", "adam"]
    data = _json(capsys, *argv, "--json")
    assert len(data["stage_options"]) == len(data["stages"])
    for stage, options in zip(data["stages"], data["stage_options"], strict=True):
        (mine,) = [x for x in options if x["chosen"]]
        assert mine["memory_bytes"] == pytest.approx(stage["memory_bytes"])
    assert main(argv) == 0
    out = capsys.readouterr().out.split("why each stage runs as it does")[1]
    lines = [x for x in out.splitlines() if x.startswith("  stage ")]
    assert len(lines) == len(data["stages"]) and "needs" in out and "of 1.0 GB" in out


@pytest.mark.parametrize("flag", ["--whole-blocks", "--recompute-blocks"])
def test_a_blocks_flag_on_a_profile_without_blocks_says_so(
    capsys: pytest.CaptureFixture[str], flag: str, tmp_path: Path,
) -> None:
    assert main(["plan", _measured(tmp_path), "-t", "cluster-b", "--global-batch", "64",
                 flag]) == 2
    err = capsys.readouterr().err
    assert "has no blocks" in err and f"drop {flag}" in err and err.count("\n") == 1


def test_fp32_on_a_profile_by_shape_says_it_is_priced_in_16_bits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "gpt:layers=4,hidden=512,heads=8,seq=256,vocab=1024", "-t", "dgx-a100:1",
            "--global-batch", "16", "--no-check", "--layout", "t1-p2"]
    assert main(argv) == 0
    # a profile by shape is timed and sized in 16 bits: fp32 would be priced as bf16
    assert main([*argv, "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "16-bit peak" in err and "give bf16" in err and err.count("\n") == 1


def test_zero_levels_let_each_stage_shard_as_it_fits(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """Under a limit that only sharding meets, the default search (every ZeRO level) finds
    a plan where level 0 alone finds none, each stage at its own level; under a looser one
    its plan is no slower than level 0's."""
    argv = ["plan", "gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=8192", "-t",
            "dgx-a100:1", "--global-batch", "64", "--precision", "bf16", "--optimizer",
            "adam", "--no-recompute", "--no-mixed-splits"]
    assert main([*argv, "--memory", "1GB", "--zero-levels", "0"]) == 2
    assert "no synchronous plan" in capsys.readouterr().err
    # a layout's z0 fixes level 0 as its z1 fixes level 1; without z the levels are free
    assert main([*argv, "--memory", "1GB", "--layout", "t1-p1-z0"]) == 2
    assert "as layout t1-p1-z0" in capsys.readouterr().err
    data = _json(capsys, *argv, "--memory", "1GB", "--json")
    levels = [stage["zero"] for stage in data["stages"]]
    assert len(set(levels)) > 1 and data["data_parallel"] > 1, data["layout"]
    every = _json(capsys, *argv, "--memory", "1GB", "--zero-levels", "0,1,2,3", "--json")
    assert every["stages"] == data["stages"]
    assert main([*argv, "--memory", "1GB"]) == 0
    assert "ZeRO levels by stage " + "-".join(map(str, levels)) in capsys.readouterr().out
    loose = [*argv, "--memory", "1.5GB", "--json"]
    alone = _json(capsys, *loose, "--zero-levels", "0")["time_per_update_s"]
    assert _json(capsys, *loose)["time_per_update_s"] <= alone
