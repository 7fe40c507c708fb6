"""``dreampipe bench``: one process set-up and one timing for every run, the report, the CLI."""

from __future__ import annotations

import ctypes
import gc
import json
import time
from typing import Any

import pytest

from dreampipe.cli import main
from dreampipe.commands.bench import BENCH_NAMES, BenchOptions, run_bench
from dreampipe.commands.bench_names import LLAMA_RUN_NAMES
from dreampipe.commands.bench_process import timed_rate
from dreampipe.commands.bench_report import BenchEntry, BenchReport, format_table
from dreampipe.commands.bench_runs import DREAMPIPE_RUNS
from dreampipe.commands.workloads import Workload, WorkloadKind
from dreampipe.errors import BaselineError, DreampipeError, WorkerError
from dreampipe.runtime.processes import HeapPolicy, run_processes

__all__: list[str] = []


def test_timed_rate_counts_the_timed_steps_and_their_drain_only() -> None:
    calls: list[str] = []

    def step() -> None:
        calls.append("step")
        time.sleep(0.5 if len(calls) <= 2 else 0.0)  # slow warm-up steps

    def drain() -> None:
        calls.append("drain")
        time.sleep(0.0 if calls.count("drain") == 1 else 0.1)

    rate = timed_rate(step, steps=3, warmup=2, samples_per_step=8, drain=drain)
    assert calls == ["step", "step", "drain", "step", "step", "step", "drain"]
    assert 3 * 8 / 1.0 < rate <= 3 * 8 / 0.1, "warm-up left out, the timed drain counted"


def _report(rounds: int = 3) -> BenchReport:
    def entry(name: str, rates: tuple[float, ...], size: int, pred: float | None = None
              ) -> BenchEntry:
        return BenchEntry(name, rates[:rounds], size, pred)

    entries = (
        entry("pipedream", (3000.0, 2800.0, 3300.0), 128, 2900.0),
        entry("1f1b-flush", (2400.0, 2000.0, 2500.0), 32, 2500.0),
        entry("1f1b-flush-unfused", (2000.0, 1800.0, 2100.0), 32, 2500.0),
        entry("torch-1f1b", (1600.0, 1500.0, 2000.0), 32),
        entry("torch-1f1b-stock", (1200.0, 1000.0, 1300.0), 32),
        entry("ddp", (2900.0, 2000.0, 2200.0), 128),
    )
    return BenchReport(entries, Workload(steps=5, warmup=1))


def test_report_json_keeps_its_keys_and_adds_rounds_and_spreads() -> None:
    data = json.loads(json.dumps(_report().to_json()))
    assert data["workload"] == "mlp"
    assert (data["steps"], data["warmup"], data["rounds"]) == (5, 1, 3)
    assert data["results"]["ddp"] == {"samples_per_s": 2200.0, "min": 2000.0, "max": 2900.0,
                                      "rounds": [2900.0, 2000.0, 2200.0], "microbatch_size": 128}
    assert data["results"]["pipedream"]["predicted_samples_per_s"] == 2900.0
    assert data["ratios"] == {
        "1f1b-flush/torch-1f1b-stock": pytest.approx(2400.0 / 1200.0),
        "1f1b-flush/torch-1f1b": pytest.approx(2400.0 / 1600.0),
        "1f1b-flush-unfused/torch-1f1b": pytest.approx(2000.0 / 1600.0),
        "pipedream/ddp": pytest.approx(3000.0 / 2200.0),
        "pipedream/torch-1f1b": pytest.approx(3000.0 / 1600.0),
    }
    # each round's own pair: 3000/2900, 2800/2000, 3300/2200
    assert data["ratio_ranges"]["pipedream/ddp"] == pytest.approx([3000 / 2900, 1.5])


def test_table_shows_medians_spreads_and_every_ratio() -> None:
    table = format_table(_report())
    rows = {line.split()[0]: line for line in table.splitlines()}
    assert rows["ddp"].split()[1:4] == ["128", "2200.0", "2000-2900"]
    # rounds' own ratios: 2000/1600, 1800/1500, 2100/2000
    assert "1f1b-flush-unfused / torch-1f1b    1.25x (1.05-1.25)  same kernels" in table
    assert "pipedream / ddp" in table and "gpipe / torch-gpipe" not in table
    assert "median and min-max of 3 interleaved rounds" in table


def test_workloads_cut_their_model_in_two() -> None:
    with pytest.raises(DreampipeError, match="not divisible"):
        Workload(batch=250, microbatches=8)
    mlp = Workload.of(WorkloadKind.MLP)
    assert (mlp.batch, mlp.microbatch, mlp.per_worker) == (256, 32, 128)
    gpt = Workload.of(WorkloadKind.TRANSFORMER, steps=2)
    spec = gpt.spec()
    assert [gpt.stage_range(s) for s in (0, 1)] == [(0, 2), (3, spec.num_layers - 1)]
    assert spec.layer_names[1:5] == ["block0", "block1", "block2", "block3"]
    assert gpt.plan().layer_names == tuple(spec.layer_names)
    chunks = [gpt.stage_range(s, 2) for s in range(4)]
    assert chunks == [(0, 1), (2, 2), (3, 3), (4, spec.num_layers - 1)]
    assert gpt.plan(2).num_stages == 4 and mlp.bounds(2) == (0, 2, 4, 6)
    assert (gpt.batch, gpt.microbatch, gpt.per_worker, gpt.steps) == (16, 2, 8, 2)


def _fails(rank: int, world: int, arg: int) -> int:
    if rank == 1:
        raise ValueError(f"rank {rank} refuses {arg}")
    return rank


def _sleeps(rank: int, world: int, arg: float) -> None:
    time.sleep(arg)


def _rank_times(rank: int, world: int, arg: int) -> int:
    return rank * arg + world


def _mmapped_while_holding(rank: int, world: int, nbytes: int) -> int:
    """Bytes glibc serves by ``mmap`` for a fresh ``nbytes`` tensor in this process."""
    import torch

    class _Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Info
    before = libc.mallinfo2().hblkhd
    held = torch.empty(nbytes, dtype=torch.uint8)
    after = libc.mallinfo2().hblkhd
    del held
    return int(after - before)


def test_processes_return_results_by_rank() -> None:
    assert run_processes(_rank_times, 2, 10, deadline_s=60) == [2, 12]


def test_every_process_gets_the_heap_policy() -> None:
    nbytes = 24 * 2**20  # under both the kept threshold (32 MB) and glibc's dynamic maximum
    kept = run_processes(_mmapped_while_holding, 1, nbytes, deadline_s=60)
    stock = run_processes(_mmapped_while_holding, 1, nbytes, deadline_s=60,
                          heap=HeapPolicy.STOCK)
    assert kept == [0], "dreampipe's heap serves 24 MB from the heap"
    assert stock[0] >= nbytes, "glibc's default maps 24 MB on its own"


def _frozen_and_full_collection_s(_rank: int, _world: int, _arg: None) -> tuple[int, float]:
    start = time.perf_counter()
    gc.collect()
    return gc.get_freeze_count(), time.perf_counter() - start


def test_every_process_but_a_stock_one_keeps_its_start_up_objects_from_the_collector() -> None:
    [(frozen, took)] = run_processes(_frozen_and_full_collection_s, 1, None, deadline_s=60)
    [(stock, stock_took)] = run_processes(_frozen_and_full_collection_s, 1, None,
                                          deadline_s=60, heap=HeapPolicy.STOCK)
    assert frozen > 100_000, "torch's modules and functions are frozen"
    assert stock == 0
    assert took < stock_took, "a full collection walks fewer objects"


def test_child_traceback_is_surfaced() -> None:
    with pytest.raises(BaselineError, match=r"(?s)rank 1.*ValueError: rank 1 refuses 7"):
        run_processes(_fails, 2, 7, deadline_s=60, error=BaselineError)
    with pytest.raises(WorkerError, match=r"(?s)rank 1 failed.*refuses 8"):
        run_processes(_fails, 2, 8, deadline_s=60)


def test_deadline_stops_every_child() -> None:
    start = time.monotonic()
    with pytest.raises(BaselineError, match="deadline"):
        run_processes(_sleeps, 1, 60.0, deadline_s=3, error=BaselineError)
    assert time.monotonic() - start < 20


def test_every_run_starts_with_the_same_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each name is one launch through the one launcher: threads, heap, world, what runs."""
    import dreampipe.commands.bench as bench
    import dreampipe.commands.bench_process as process

    launched: list[dict[str, Any]] = []

    def launch(fn: Any, world: int, arg: Any, **kw: Any) -> list[float]:
        inner_fn, inner = arg
        launched.append({"fn": inner_fn.__name__, "world": world, "arg": inner, **kw})
        return [float(len(launched))] * world

    monkeypatch.setattr(process, "run_processes", launch)
    monkeypatch.setattr(bench, "predict", lambda runs, work: {r: 1.0 for r in runs})
    report = run_bench(BenchOptions(progress=False, rounds=1, timeout_s=50.0))
    assert [e.name for e in report.entries] == list(BENCH_NAMES)
    assert [e.samples_per_s for e in report.entries] == [float(i + 1) for i in
                                                         range(len(BENCH_NAMES))]
    by_name = dict(zip(BENCH_NAMES, launched, strict=True))
    for name, call in by_name.items():
        stock = name == "torch-1f1b-stock"
        assert call["heap"] is (HeapPolicy.STOCK if stock else HeapPolicy.KEEP_FREED), name
        assert call["threads"] == (2 if name == "single-2threads" else 1), name
        assert call["world"] == (1 if name.startswith("single") else 2), name
        assert call["deadline_s"] == 50.0
    assert {by_name[n]["fn"] for n in ("pipedream", "1f1b-flush", "gpipe", "2bw")} == {"_rank"}
    assert [by_name[n]["arg"][0].fused_accumulation for n in ("1f1b-flush",
                                                              "1f1b-flush-unfused")] == [True,
                                                                                         False]
    assert by_name["torch-1f1b-big"]["arg"].microbatch == 128
    assert [by_name[n]["arg"].virtual_stages for n in ("torch-zb", "torch-interleaved-1f1b")
            ] == [1, 2]
    assert by_name["interleaved-1f1b"]["arg"][0].virtual_stages == 2
    assert [(by_name[n]["arg"][0].virtual_stages, by_name[n]["arg"][0].kind.placement.value)
            for n in ("zbv", "dualpipev")] == [(2, "v"), (2, "v")]
    assert [by_name[n]["arg"].stages(0, 2) for n in ("torch-zbv", "torch-dualpipev")
            ] == [(0, 3), (0, 3)], "the same V: chunks 0 and 3 on rank 0"
    assert [by_name[n]["arg"][1] for n in ("ddp", "ddp-no-allreduce")] == [True, False]
    sizes = {e.name: e.microbatch_size for e in report.entries}
    assert sizes["torch-zb"] == sizes["zb-h1"] == sizes["interleaved-1f1b"] == sizes["2bw"] == 32
    assert (sizes["pipedream"], sizes["1f1b-flush"], sizes["torch-1f1b-big"],
            sizes["single-1thread"]) == (128, 32, 128, 256)


def test_the_llama_runs_its_three_pairs_unless_told_and_predicts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dreampipe.commands.bench as bench

    ran: list[str] = []
    monkeypatch.setattr(bench, "run_dreampipe",
                        lambda run, work, timeout_s: ran.append(run.kind.value) or 2.0)
    monkeypatch.setattr(bench, "run_baseline",
                        lambda which, work, timeout_s: ran.append(which.value) or 1.0)
    report = run_bench(BenchOptions(workload=WorkloadKind.LLAMA, progress=False, rounds=1))
    assert ran == list(LLAMA_RUN_NAMES)
    assert all(e.predicted_samples_per_s is None for e in report.entries), "no zoo profile"
    assert {r.key: r.value for r in report.ratios()} == {
        "1f1b-flush/torch-1f1b": 2.0, "zb-h1/torch-zb": 2.0,
        "interleaved-1f1b/torch-interleaved-1f1b": 2.0}
    ran.clear()
    run_bench(BenchOptions(workload=WorkloadKind.LLAMA, progress=False, rounds=1),
              ["zbv", "torch-zbv"])
    assert ran == ["zbv", "torch-zbv"], "--only names any run"


def test_rounds_interleave_and_report_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    import dreampipe.commands.bench as bench

    calls: list[str] = []
    rates = {"ddp": iter([1.0, 5.0, 3.0]), "single-1thread": iter([9.0, 7.0, 8.0])}

    def fake(which: Any, work: object, *, timeout_s: float) -> float:
        calls.append(which.value)
        return next(rates[which.value])

    monkeypatch.setattr(bench, "run_baseline", fake)
    report = run_bench(BenchOptions(progress=False, rounds=3), ["ddp", "single-1thread"])
    assert calls == ["ddp", "single-1thread"] * 3
    assert [(e.name, e.samples_per_s, e.rounds) for e in report.entries] == [
        ("ddp", 3.0, (1.0, 5.0, 3.0)), ("single-1thread", 8.0, (9.0, 7.0, 8.0))]
    assert report.to_json()["rounds"] == 3


def test_each_round_predicts_anew_and_the_report_keeps_the_median(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dreampipe.commands.bench as bench

    log: list[str] = []
    predictions = iter([900.0, 1500.0, 1000.0])

    def predict(runs: Any, work: object) -> dict[Any, float]:
        log.append("predict")
        value = next(predictions)
        return {r: value for r in runs}

    def run(which: Any, work: object, timeout_s: float) -> float:
        log.append("run")
        return 1.0

    monkeypatch.setattr(bench, "predict", predict)
    monkeypatch.setattr(bench, "run_dreampipe", run)
    report = run_bench(BenchOptions(progress=False, rounds=3), ["pipedream"])
    assert log == ["predict", "run"] * 3
    assert report.entries[0].predicted_samples_per_s == 1000.0


def test_bench_cli_rejects_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err


def _cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    status = main(["bench", *args, "--steps", "1", "--warmup", "0", "--json", "--no-progress",
                   "--rounds", "1"])
    assert status == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


@pytest.mark.timeout(240)
def test_bench_cli_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    names = ["torch-1f1b", "ddp", "ddp-no-allreduce", "single-1thread"]
    data = _cli_json(capsys, "--only", *names)
    assert data["workload"] == "mlp"
    assert list(data["results"]) == names
    for name in names:
        assert data["results"][name]["samples_per_s"] > 0


def _one_after_another(rank: int, world: int, jobs: list[tuple[Any, Any]]) -> list[float]:
    """Bench runs' ranks one after another in the same 2 processes (one start-up for all)."""
    return [fn(rank, world, arg) for fn, arg in jobs]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_v_shaped_runs_and_the_llamas_train() -> None:
    """dreampipe's zbv and dualpipev on the mlp; on the Hugging Face llama (passed whole with
    its split points) dreampipe's 1f1b-flush, PyTorch's 1F1B on pipeline()'s stages and
    its interleaved 1F1B on chunks cut by hand: one update each, of the fewest samples that
    fill the schedules, in one launch of 2 processes."""
    import dreampipe.commands.baselines as baselines
    import dreampipe.commands.bench as bench
    from dreampipe.commands.bench_process import _in_group

    mlp = Workload(batch=16, steps=1, warmup=0)
    llama = Workload(WorkloadKind.LLAMA, batch=16, steps=1, warmup=0)
    jobs: list[tuple[Any, Any]] = [(bench._rank, (DREAMPIPE_RUNS[n], w)) for n, w in (
        ("zbv", mlp), ("dualpipev", mlp), ("1f1b-flush", llama))]
    jobs += [(baselines._torch_pipeline, baselines._TorchPipe(llama, b, 2))
             for b in (baselines.Baseline.TORCH_1F1B, baselines.Baseline.TORCH_INTERLEAVED)]
    rates = run_processes(_in_group, 2, (_one_after_another, jobs), deadline_s=200)
    assert all(rate > 0 for rate in rates[0]) and len(rates[0]) == len(jobs), rates


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_cli_transformer(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    import dreampipe.commands.bench_runs as runs

    monkeypatch.setattr(runs, "_REPEATS", 2)  # a prediction, not a precise one
    names = ["pipedream", "torch-1f1b-stock"]
    data = _cli_json(capsys, "--workload", "transformer", "--only", *names)
    assert data["workload"] == "transformer"
    assert [data["results"][n]["microbatch_size"] for n in names] == [8, 2]
    assert all(data["results"][n]["samples_per_s"] > 0 for n in names)
    assert data["results"]["pipedream"]["predicted_samples_per_s"] > 0
    assert data["ratios"] == {}, "no ratio pairs these two"
