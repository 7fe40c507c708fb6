"""``dreampipe train`` and ``demo``: argument checks, plan choice, a tiny real run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dreampipe.api import TrainConfig
from dreampipe.cli import main
from dreampipe.cli.train_command import parse_model_args
from dreampipe.commands.train_share import torchrun_world
from dreampipe.errors import ConfigError, PeerTimeoutError
from dreampipe.models import get_model
from dreampipe.models.datasets import steps_for_epochs
from dreampipe.planning.plan import Plan
from dreampipe.runplan.schedule_choice import CANDIDATES, Semantics


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--workers", "0"], "--workers 0"),
        (["--workers", "-3"], "--workers -3"),
        (["--schedule", "gpipe", "--batch-size", "30", "--microbatches", "4"],
         "--batch-size 30 is not divisible by --microbatches 4"),
        (["--microbatches", "2"], "--microbatches 2 with --schedule pipedream"),
        (["--plan", "p.json", "--config", "2-1"],
         "--plan 'p.json' with config/stages: give a plan file or a partition"),
        (["--steps", "0"], "--steps 0"),
        (["--dataset", "mnist"], "--data-dir"),
        (["--timeout", "0"], "--timeout 0"),
        (["--model-arg", "layers"], "KEY=VALUE"),
        (["--model-arg", "width=abc"],
         "model 'mlp': width='abc' is text, but mlp() takes a whole number (int) for width"),
        (["--model-arg", "width=1e9"], "width=1000000000.0 is a float, but mlp() takes a whole "
                                      "number (int) for width; give e.g. width=1000000000"),
        (["--model-arg", "width=-4"], "model 'mlp' with {'width': -4}"),
    ],
)
def test_train_rejects_bad_arguments(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["train", "mlp", *argv], capsys)
    assert err.startswith("dreampipe train: error:")
    assert needle in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--vertical-sync", "--no-stash"], "drop --no-stash or --vertical-sync"),
        (["--schedule", "gpipe", "--vertical-sync"], "apply to the pipedream schedule only"),
        (["--lr", "0"], "--lr 0.0: the learning rate must be positive"),
        (["--momentum=-1"], "--momentum -1.0: SGD's momentum must be 0 or more"),
        (["--dataset", "mnist", "--data-dir", "{tmp}"], "train-images-idx3-ubyte"),
        (["--plan", "{tmp}/missing.json"], "missing.json"),
        (["--workers", "3", "--config", "2-1", "--stages", "0,9"], "--stages '0,9'"),
        (["--timeline", "{tmp}/no/such/dir/x.png"], "no/such/dir"),
        (["--trace", "{tmp}/no/such/dir/t.json"], "no/such/dir"),
        (["--timeline", "{tmp}"], "--timeline {tmp}: is a directory"),
        (["--virtual-stages", "2"], "--virtual-stages 2 with --schedule pipedream; use 1"),
        (["--seq-lengths", "64:8"], "--seq-lengths 64:8: write MIN:MAX, whole numbers with 1 "
                                    "<= MIN <= MAX"),
        (["--seq-lengths", "8:64"], "--seq-lengths 8:64 cuts token sequences of [batch, tokens] "
                                    "integers, 64 tokens at most; model mlp takes torch.float32"),
        (["--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--stages", "0,2"],
         "itself; leave out --stages '0,2', or give a plan"),
        (["--schedule", "zbv", "--virtual-stages", "2", "--config", "2"],
         "the V places its stages otherwise: leave out --config '2'"),
        (["--schedule", "pipedream", "--semantics", "sync"],
         "--schedule pipedream is asynchronous (stale weights), and --semantics sync asks "
         "for the other; drop one of them"),
        (["--schedule", "gpipe", "--semantics", "async"], "--schedule gpipe is synchronous"),
        (["--schedule", "gpipe", "--no-compensation"],
         "--no-compensation with --schedule gpipe, which trains on no stale weights"),
        (["--memory", "80"], "size '80' has no unit; write e.g. 80GB, 80GiB or 80B"),
        (["--data-dir", "{tmp}"], "--data-dir '{tmp}' with --dataset synthetic, which reads no "
                                  "files; give --dataset mnist to read MNIST from it"),
    ],
)
def test_train_rejects_bad_options_before_profiling(
    argv: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_profiling(*_: object, **__: object) -> None:
        raise AssertionError("profiled before checking the options")

    monkeypatch.setattr("dreampipe.commands.train_plan.profile_as_worker", no_profiling)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    err = _fails(["train", "mlp", "--no-progress", *argv], capsys)
    assert err.startswith("dreampipe train: error:")
    assert needle.replace("{tmp}", str(tmp_path)) in err


def test_demo_refuses_an_empty_out_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_demo(*_: object, **__: object) -> None:
        raise AssertionError("ran the demo with an empty --out")

    monkeypatch.setattr("dreampipe.commands.demo.run_demo", no_demo)
    monkeypatch.chdir(tmp_path)
    err = _fails(["demo", "--no-progress", "--out", ""], capsys)
    assert err == ("dreampipe demo: error: --out '': name a directory for the demo's timeline, "
                   "trace and plan, e.g. --out out/demo")
    assert list(tmp_path.iterdir()) == []


def test_train_rejects_mismatched_torchrun_world(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert torchrun_world() == (0, 3)
    err = _fails(["train", "mlp", "--workers", "2", "--no-progress"], capsys)
    assert "torchrun started 3 processes" in err


def test_model_args_are_typed() -> None:
    assert parse_model_args(["layers=4", "scale=0.5", "name=x"]) == (
        ("layers", 4), ("scale", 0.5), ("name", "x"),
    )


def test_steps_cover_the_epochs() -> None:
    assert steps_for_epochs(2, 1000, 32) * 32 >= 2000
    assert (steps_for_epochs(2, 1000, 32) - 1) * 32 < 2000
    with pytest.raises(ConfigError, match="epochs=0"):
        steps_for_epochs(0, 1000, 32)


def test_train_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=64",
            "--workers", "2", "--stages", "0,2", "--steps", "6", "--batch-size", "16",
            "--json", "--no-progress", "--timeout", "60"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    data = json.loads(out[0])
    assert data["samples_per_s"] > 0
    assert data["predicted_samples_per_s"] > 0
    assert data["partition"] == "straight"
    assert len(data["losses"]) == 6
    assert data["final_loss"] == data["losses"][-1]


def test_train_on_changing_sequence_lengths_times_new_ones_against_repeated_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    from dreampipe.commands.seq_lengths import step_length

    argv = ["train", "transformer", "--model-arg", "vocab=32", "--model-arg", "dim=32",
            "--model-arg", "layers=2", "--model-arg", "seq_len=12", "--workers", "2",
            "--stages", "0,2", "--schedule", "1f1b-flush", "--microbatches", "2", "--steps",
            "12", "--batch-size", "4", "--seq-lengths", "4:8", "--json", "--no-progress"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    lengths = [step_length(0, k, (4, 8)) for k in range(12)]
    new = len(set(lengths)) - 1  # the first step counts in neither
    times = data["seq_lengths"]
    assert times["lengths"] == lengths and data["config"]["variable_dims"] == [1]
    assert (times["new_length_steps"], times["repeated_length_steps"]) == (new, 11 - new)
    assert times["new_length_step_s"] > 0 and times["repeated_length_step_s"] > 0
    assert len(data["losses"]) == 12


@pytest.mark.parametrize("schedule", [["zb-h1"], ["zb-h2"],
                                      ["interleaved-1f1b", "--virtual-stages", "2"]],
                         ids=["zb-h1", "zb-h2", "interleaved-1f1b"])
def test_the_newer_schedules_train_end_to_end(
    schedule: list[str], capsys: pytest.CaptureFixture[str],
    mlp_profile: Callable[[int], Path],
) -> None:
    argv = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--workers", "2", "--schedule", *schedule, "--microbatches", "4", "--steps", "3",
            "--batch-size", "16", "--json", "--no-progress", "--timeout", "60",
            "--profile", str(mlp_profile(4))]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    assert data["samples_per_s"] > 0 and data["predicted_samples_per_s"] > 0
    assert len(data["losses"]) == 3


def test_interleaving_on_positions_replicated_2_1_trains_end_to_end(
    capsys: pytest.CaptureFixture[str], mlp_profile: Callable[[int], Path],
) -> None:
    argv = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--workers", "3", "--config", "2-1", "--virtual-stages", "2", "--schedule",
            "interleaved-1f1b", "--microbatches", "4", "--steps", "2", "--batch-size", "16",
            "--json", "--no-progress", "--timeout", "60", "--profile", str(mlp_profile(4)),
            "--dataset", "digits"]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    assert data["partition"] == "2-1-2-1" and data["virtual_stages"] == 2
    assert 0 <= data["accuracy"] <= 1  # a data set with a test split is evaluated
    assert [replicas for *_, replicas in data["stages"]] == [2, 1, 2, 1]
    assert len(data["losses"]) == 2 and all(math.isfinite(x) for x in data["losses"])


def _interleaved_plan_file(tmp_path: Path) -> Path:
    """A plan of mlp (4 layers) as 4 stages, 2 to each of 2 workers."""
    spec = get_model("mlp", layers=4, width=32)
    path = tmp_path / "p.json"
    Plan.from_config(spec.num_layers, [0, 1, 2, 3], [1, 1, 1, 1], model=spec.name,
                     virtual_stages=2).save(path)
    return path


@pytest.mark.parametrize(("argv", "needle"), [
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "1"],
     "--virtual-stages 1 but plan '{path}' runs 2 stages per worker (its virtual_stages is 2); "
     "drop --virtual-stages 1"),
    ([], "--schedule pipedream for plan '{path}', which runs 2 stages per worker"),
    (["--schedule", "auto"], "--schedule auto for plan '{path}', which runs 2 stages per "
                             "worker (its virtual_stages is 2); only interleaved-1f1b"),
])
def test_a_plan_file_of_two_stages_per_worker_refuses_what_contradicts_it(
    argv: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_profiling(*_: object, **__: object) -> None:
        raise AssertionError("profiled before checking the plan")

    monkeypatch.setattr("dreampipe.commands.train_plan.profile_as_worker", no_profiling)
    path = _interleaved_plan_file(tmp_path)
    err = _fails(["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
                  "--no-progress", "--plan", str(path), *argv], capsys)
    assert needle.format(path=path) in err


def test_train_reads_a_settings_file_and_a_flag_given_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mlp_profile: Callable[[int], Path],
) -> None:
    settings = tmp_path / "s.toml"
    settings.write_text('schedule = "1f1b-flush"\nmicrobatches = 4\nseed = 3\n'
                        "timeout_s = 90\nmax_grad_norm = 1.0\n")
    argv = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--workers", "2", "--steps", "5", "--json", "--settings", str(settings),
            "--microbatches", "2", "--no-progress", "--profile", str(mlp_profile(16))]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    want = TrainConfig(schedule="1f1b-flush", microbatches=2, seed=3, timeout_s=90.0,
                       max_grad_norm=1.0, virtual_stages=1)
    assert data["config"] == want.to_dict()
    assert TrainConfig.from_dict(data["config"]) == want
    assert (data["schedule"], data["microbatches"], len(data["losses"])) == ("1f1b-flush", 2, 5)


def test_zero_3_without_a_schedule_trains_a_synchronous_one_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The default schedule (pipedream) keeps a weight version per minibatch in flight,
    which level 3 cannot; a schedule given, by flag or settings file, is kept (or refused)."""
    argv = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--workers", "3", "--config", "2-1", "--zero", "3", "--steps", "2",
            "--batch-size", "16", "--json", "--no-progress", "--timeout", "60"]
    assert main(argv) == 0
    got = capsys.readouterr()
    assert "--zero 3 needs a synchronous schedule; training with --schedule 1f1b-flush" in got.err
    assert json.loads(got.out)["schedule"] == "1f1b-flush"
    settings = tmp_path / "s.toml"
    settings.write_text('schedule = "2bw"\nmicrobatches = 2\n')
    assert "use zero=2" in _fails([*argv, "--settings", str(settings)], capsys)


@pytest.mark.parametrize(("text", "argv", "needle"), [
    ("microbatch = 4\n", [], "settings file '{path}': 'microbatch' is not a TrainConfig field; "
                            "did you mean 'microbatches'?"),
    ("schedule = \"gpipe\"\nvertical_sync = true\n", [],
     "--vertical-sync with --schedule gpipe: vertical sync and turning weight stashing off "
     "apply to the pipedream schedule only"),
    ("schedule = \"gpipe\"\nvertical_sync = true\n", ["--schedule", "pipedream", "--no-stash"],
     "drop --no-stash or --vertical-sync"),
    ("microbatches = \"4\"\n", [], "--microbatches '4': microbatches takes a whole number"),
    ("resume = \"ck\"\n", [], "resumes from --checkpoint-dir DIR with --resume"),
    ("schedule = [\n", [], "settings file '{path}' is not valid TOML"),
])
def test_a_bad_settings_file_names_the_field_before_profiling(
    text: str, argv: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_profiling(*_: object, **__: object) -> None:
        raise AssertionError("profiled before checking the settings")

    monkeypatch.setattr("dreampipe.commands.train_plan.profile_as_worker", no_profiling)
    path = tmp_path / "s.toml"
    path.write_text(text)
    err = _fails(["train", "mlp", "--no-progress", "--settings", str(path), *argv], capsys)
    assert needle.format(path=path) in err


def test_a_plan_file_of_two_stages_per_worker_trains_them_so_without_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mlp_profile: Callable[[int], Path],
) -> None:
    argv = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--workers", "2", "--schedule", "interleaved-1f1b", "--microbatches", "4",
            "--steps", "3", "--batch-size", "16", "--json", "--no-progress", "--timeout", "60",
            "--plan", str(_interleaved_plan_file(tmp_path)), "--profile", str(mlp_profile(4))]
    assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    assert data["virtual_stages"] == 2 and data["predicted_samples_per_s"] > 0
    assert len(data["losses"]) == 3


def test_steps_from_epochs_round_up_to_whole_all_reduce_rounds(
    capsys: pytest.CaptureFixture[str], mlp_profile: Callable[[int], Path],
) -> None:
    # 3/64 of the 2048 synthetic samples in minibatches of 32 is 3 minibatches; two
    # replicas of one stage all-reduce every 2, so the run takes 4
    argv = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--config", "2", "--epochs", "0.046875", "--json", "--no-progress",
            "--profile", str(mlp_profile(32))]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["steps"] == 4


def test_steps_must_fill_whole_all_reduce_rounds(
    capsys: pytest.CaptureFixture[str], mlp_profile: Callable[[int], Path],
) -> None:
    err = _fails(["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
                  "--config", "2", "--steps", "3", "--no-progress",
                  "--profile", str(mlp_profile(32))], capsys)
    assert "--steps 3" in err and "--steps 4" in err, err


@pytest.mark.parametrize("schedule", [[], ["--schedule", "auto", "--microbatches", "2"]],
                         ids=["pipedream", "auto"])
def test_train_under_torchrun_prints_once(tmp_path: Path, schedule: list[str]) -> None:
    """Rank 0 plans (and, with --schedule auto, chooses the schedule) for every rank."""
    exe = Path(sys.executable).parent / "dreampipe"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--no-python", str(exe), "train", "mlp", "--model-arg", "layers=4",
           "--model-arg", "width=32", "--steps", "4", "--batch-size", "8", "--json",
           "--no-progress", *schedule]
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT) prints its Python stacks.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env, check=False)
    err = done.stderr
    if len(err) > 8000:  # the ranks' own errors come first, torchrun's summary last
        err = f"{err[:6000]}\n[... {len(err) - 8000} characters left out ...]\n{err[-2000:]}"
    assert done.returncode == 0, (
        f"exit {done.returncode}\n--- stderr ---\n{err}\n--- stdout ---\n{done.stdout[-4000:]}"
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, done.stdout
    data = json.loads(lines[0])
    assert len(data["losses"]) == 4
    assert sum(r for _, _, r in data["stages"]) == 2
    sync = {k.value for k in CANDIDATES[Semantics.SYNC]}
    assert (data["schedule"] in sync) if schedule else data["schedule"] == "pipedream"


@pytest.mark.parametrize("semantics", list(Semantics))
def test_train_schedule_auto_runs_the_fastest_of_its_semantics(
        semantics: Semantics, capsys: pytest.CaptureFixture[str],
        mlp_profile: Callable[[int], Path]) -> None:
    assert main(["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
                 "--workers", "2", "--steps", "4", "--batch-size", "8", "--microbatches", "2",
                 "--schedule", "auto", "--semantics", semantics.value, "--json",
                 "--no-progress", "--profile", str(mlp_profile(4))]) == 0
    out, err = capsys.readouterr()
    data = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    assert data["schedule"] in {k.value for k in CANDIDATES[semantics]}
    assert data["microbatches"] == (1 if data["schedule"] == "pipedream" else 2)
    assert f"schedule auto ({semantics.value}): {data['schedule']}" in err + out
    assert len(data["losses"]) == 4


def test_train_with_its_progress_bar_leaves_nothing_behind(
    tmp_path: Path, mlp_profile: Callable[[int], Path]
) -> None:
    """The bar's lock is a thread lock: no "leaked semaphore objects" warning at exit."""
    exe = Path(sys.executable).parent / "dreampipe"
    cmd = [str(exe), "train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
           "--workers", "2", "--steps", "4", "--batch-size", "16",
           "--profile", str(mlp_profile(16))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "minibatch" in done.stderr  # the bar ran
    assert "leaked" not in done.stderr, done.stderr[-4000:]


@pytest.mark.parametrize("verbose", [False, True])
def test_worker_tracebacks_are_hidden_unless_verbose(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], verbose: bool
) -> None:
    import dreampipe.commands.train_run

    def fails(*args: object, **kwargs: object) -> None:
        raise PeerTimeoutError(
            "rank 0 (stage 0) failed: waited 3 s for rank 1 in RECV_B0 (minibatch 0)\n"
            "exit codes by rank: {0: 1, 1: -15}\n"
            "--- traceback of rank 0 ---\nTraceback (most recent call last):\n  boom"
        )

    monkeypatch.setattr(dreampipe.commands.train_run, "run_train", fails)
    argv = ["-v"] if verbose else []
    assert main([*argv, "train", "mlp", "--workers", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dreampipe train: error: rank 0 (stage 0) failed: waited 3 s")
    assert "exit codes by rank" in err
    assert ("Traceback (most recent call last)" in err) is verbose
    assert ("run with -v" in err) is not verbose


def test_a_run_split_by_a_checkpoint_ends_with_the_same_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mlp_profile: Callable[[int], Path]
) -> None:
    base = ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32", "--workers",
            "2", "--schedule", "1f1b-flush", "--batch-size", "16", "--json", "--no-progress",
            "--profile", str(mlp_profile(16))]
    ckpt = ["--checkpoint-dir", str(tmp_path)]

    def final(*extra: str) -> dict[str, Any]:
        assert main([*base, *extra]) == 0, capsys.readouterr().err
        result: dict[str, Any] = json.loads(capsys.readouterr().out)
        return result

    straight = final("--steps", "8")
    first = final("--steps", "4", *ckpt, "--checkpoint-every", "4")
    assert (tmp_path / "step-4" / "COMMITTED").is_file()
    resumed = final("--steps", "8", *ckpt, "--resume")
    assert len(first["losses"]) == len(resumed["losses"]) == 4
    assert resumed["losses"] == straight["losses"][4:]
    assert resumed["final_loss"] == straight["final_loss"]
    # killed after its last save, the same command comes back with nothing left to train
    assert main([*base, "--steps", "4", *ckpt, "--resume"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "step-4 already holds all 4 minibatches: nothing left to train" in err
    err = _fails([*base, "--steps", "3", *ckpt, "--resume"], capsys)
    assert "--steps 3 but the checkpoint is at 4 minibatches" in err, err
    err = _fails([*base, "--steps", "4", "--resume"], capsys)
    assert "--resume needs --checkpoint-dir DIR" in err, err
    # the data position counts minibatches of the saved run's data: other data is refused
    err = _fails([*base, "--steps", "8", *ckpt, "--resume", "--batch-size", "8", "--seed",
                  "1"], capsys)
    assert "--batch-size 8 (saved at 16), --seed 1 (saved at 0)" in err, err
    # a run that does not resume would mix its saves with the earlier run's
    err = _fails([*base, "--steps", "8", *ckpt, "--checkpoint-every", "2"], capsys)
    assert "already holds step-4, committed by an earlier run" in err, err
    assert "--resume" in err and sorted(p.name for p in tmp_path.iterdir()) == [
        "step-4", "train-data.json"]


@pytest.mark.parametrize(("argv", "compensate"), [([], True), (["--no-compensation"], False)])
def test_staleness_compensation_is_on_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], compensate: bool
) -> None:
    import dreampipe.commands.train_run

    seen: list[bool] = []

    def record(request: Any, *args: object, **kwargs: object) -> None:
        seen.append(request.run.config.compensate)
        raise PeerTimeoutError("stopped after reading the options")

    monkeypatch.setattr(dreampipe.commands.train_run, "run_train", record)
    assert main(["train", "mlp", "--workers", "2", "--steps", "1", "--schedule", "2bw",
                 *argv]) == 2
    assert seen == [compensate]


def test_train_runs_a_plan_that_mixes_split_and_replicated_stages(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        mlp_profile: Callable[[int], Path]) -> None:
    from api.test_pipeline_mixed import _plan

    _plan("1t2-2r", 32).save(tmp_path / "mixed.json")
    assert main(["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
                 "--plan", str(tmp_path / "mixed.json"), "--workers", "4", "--schedule",
                 "1f1b-flush", "--microbatches", "2", "--steps", "4", "--json",
                 "--no-progress", "--profile", str(mlp_profile(16))]) == 0
    data = json.loads(next(ln for ln in capsys.readouterr().out.splitlines()
                           if ln.startswith("{")))
    assert data["partition"] == "1t2-2r" and len(data["losses"]) == 4


def test_the_precision_flag_offers_every_precision() -> None:
    from dreampipe.cli.train_command import PRECISIONS
    from dreampipe.runtime.precision import Precision

    assert tuple(p.value for p in Precision) == PRECISIONS


def test_the_number_format_and_recompute_flags_set_the_config() -> None:
    from dreampipe.cli import build_parser
    from dreampipe.cli.train_command import _config

    def config(*flags: str) -> Any:
        return _config(build_parser().parse_args(["train", "transformer", *flags]))

    got = config("--precision", "bf16", "--recompute-blocks", "2")
    assert (got.precision, got.recompute_blocks, got.recompute_attention) == ("bf16", 2, False)
    assert config("--recompute", "selective").recompute_attention
    with pytest.raises(SystemExit):
        config("--recompute", "selective", "--recompute-blocks", "1")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--workers", "0"], "--workers 0; use 1 or more"),
    (["--batch-size", "7", "--microbatches", "2", "--schedule", "1f1b-flush"],
     "--batch-size 7 is not divisible by --microbatches 2"),
    (["--stages", "0,99"], "--stages"),
])
def test_a_local_run_fails_on_a_bad_option_before_it_measures_the_machine(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str],
        needle: str) -> None:
    import dreampipe.commands.train_plan as train_plan

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("the machine was measured before the options were checked")

    monkeypatch.setattr(train_plan, "machine_for_run", measured)
    assert main(["train", "mlp", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
