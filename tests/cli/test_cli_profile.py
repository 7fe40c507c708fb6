"""``dreampipe profile`` and ``dreampipe show``, run in-process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dreampipe.cli import main
from dreampipe.models import get_model
from dreampipe.profiling.fixed_costs import small_batch_of
from dreampipe.profiling.load import load_graph

_ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\d+\.\d{3})\s+(\d+\.\d{3})\s")


def _rows(out: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for line in out.splitlines() if (m := _ROW.match(line))]


def test_show_pipedream_vgg16(pipedream_profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(pipedream_profiles / "vgg16.txt")]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [i for i, _ in rows] == list(range(41))
    assert "41 layers" in out and "total" in out and "Conv2d(3, 64" in out
    graph = load_graph(pipedream_profiles / "vgg16.txt")
    assert [name for _, name in rows] == [x.name for x in graph.layers]


@pytest.mark.parametrize("name", ["alexnet", "gnmt", "resnet18", "vgg16"])
def test_show_a_bundled_profile_by_name(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", f"pipedream:{name}"]) == 0
    out = capsys.readouterr().out
    graph = load_graph(f"pipedream:{name}")
    assert [n for _, n in _rows(out)] == [x.name for x in graph.layers]
    assert out.startswith(f"model {name} · batch unknown · {len(graph)} layers · DAG")


def test_show_list_names_every_bundled_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "model", "layers", "shape"]
    listed = [line.split() for line in lines[1:]]
    expected = []
    for name in ("alexnet", "gnmt", "resnet18", "vgg16"):
        graph = load_graph(f"pipedream:{name}")
        shape = "chain" if graph.is_chain else "DAG"
        expected.append([f"pipedream:{name}", name, str(len(graph)), shape])
    assert listed == expected


def test_show_an_unknown_bundled_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "pipedream:nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dreampipe show: error: no bundled profile 'pipedream:nope'")
    assert "pipedream:gnmt" in err and "dreampipe show --list" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv", [["show"], ["show", "--list", "pipedream:gnmt"]])
def test_show_takes_a_profile_or_list(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "PROFILE" in capsys.readouterr().err


def test_show_help_names_the_bundled_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["show", "--help"])
    out = capsys.readouterr().out
    assert "pipedream:NAME" in out and "--list" in out


def test_profile_then_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "cnn.json"
    argv = ["profile", "cnn", "--batch-size", "8", "--repeats", "1", "--warmup", "0",
            "-o", str(out_file)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    names = get_model("cnn").layer_names
    assert [name for _, name in _rows(printed)] == names
    assert f"wrote {out_file}" in printed
    graph = load_graph(out_file)
    assert graph.batch_size == 8 and [x.name for x in graph.layers] == names
    small = small_batch_of(graph)  # an eighth of the batch, timed again
    assert small is not None and small["batch_size"] == 1
    assert len(small["forward_ms"]) == len(names) and all(t > 0 for t in small["backward_ms"])

    assert main(["show", str(out_file)]) == 0
    shown = capsys.readouterr().out
    assert [name for _, name in _rows(shown)] == names
    assert "batch 8 (also timed at 1)" in shown and "chain, 4 edges" in shown


@pytest.mark.parametrize(("small", "kept"), [("0", None), ("3", 3)])
def test_small_batch_names_the_second_timing_or_turns_it_off(
        tmp_path: Path, small: str, kept: int | None) -> None:
    out_file = tmp_path / "mlp.json"
    assert main(["profile", "mlp", "--model-arg", "layers=2", "--batch-size", "8",
                 "--small-batch", small, "--repeats", "1", "-o", str(out_file)]) == 0
    found = small_batch_of(load_graph(out_file))
    assert (None if found is None else found["batch_size"]) == kept


@pytest.mark.parametrize("small", ["8", "-1"])
def test_a_small_batch_not_below_the_batch_is_refused(
        small: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "mlp", "--model-arg", "layers=2", "--batch-size", "8",
                 "--small-batch", small, "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--small-batch {small}" in err and "or 0 to time one batch only" in err


_BATCH_NORM_MODEL = '''
import torch
from torch import nn

def build():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    return model, torch.randn(4, 3), lambda out: out.square().mean()
'''


def test_a_model_that_refuses_the_small_batch_keeps_one_timing_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """BatchNorm1d trains on no fewer than 2 samples; the default small batch of 4 is 1."""
    source, out_file = tmp_path / "bn.py", tmp_path / "bn.json"
    source.write_text(_BATCH_NORM_MODEL)
    assert main(["profile", f"{source}:build", "--repeats", "1", "-o", str(out_file)]) == 0
    assert "note: timing at a batch of 1 failed" in capsys.readouterr().err
    assert small_batch_of(load_graph(out_file)) is None
    assert main(["profile", f"{source}:build", "--repeats", "1", "--small-batch", "2",
                 "-o", str(out_file)]) == 0
    found = small_batch_of(load_graph(out_file))
    assert found is not None and found["batch_size"] == 2


def test_a_profile_sized_by_model_args_is_one_train_accepts(tmp_path: Path) -> None:
    from dreampipe.runplan.worker_profile import saved_profile
    from dreampipe.runtime.processes import pinned_threads

    out_file = tmp_path / "mlp.json"
    with pinned_threads(1):  # as OMP_NUM_THREADS=1 would
        assert main(["profile", "mlp", "--model-arg", "layers=3", "--model-arg", "width=24",
                     "--batch-size", "4", "--repeats", "1", "-o", str(out_file)]) == 0
    spec, sized = get_model("mlp", layers=3, width=24), (("layers", 3), ("width", 24))
    graph = saved_profile(out_file, spec, 4, model_kwargs=sized)
    assert graph.meta["model_kwargs"] == [list(kv) for kv in sized]
    assert [x.name for x in graph.layers] == spec.layer_names == ["fc0", "fc1", "fc2"]
    assert graph.layers[1].parameter_bytes == (24 * 24 + 24) * 4


def test_bad_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "vgg17"]) == 2
    err = capsys.readouterr().err
    assert "'vgg17'" in err and "vgg16" in err and "file.py:function" in err
    assert "Traceback" not in err


_USER_MODEL = '''
import torch
from torch import nn

def build(batch_size=4):
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 1))
    return model, torch.randn(batch_size, 3), lambda out: out.square().mean()

def with_target():
    model = nn.Sequential(nn.Linear(3, 2))
    return model, torch.randn(6, 3), nn.functional.cross_entropy, torch.tensor([0, 1] * 3)

def broken():
    return 42
'''


def test_profile_user_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "mymodel.py"
    source.write_text(_USER_MODEL)
    out_file = tmp_path / "p.json"
    assert main(["profile", f"{source}:build", "--batch-size", "5", "--repeats", "1",
                 "-o", str(out_file)]) == 0
    assert [name for _, name in _rows(capsys.readouterr().out)] == ["0", "1", "2"]
    assert load_graph(out_file).batch_size == 5
    assert main(["profile", f"{source}:with_target", "--repeats", "1"]) == 0
    assert "batch 6 (also timed at 1)" in capsys.readouterr().out  # a sample's first


@pytest.mark.parametrize(
    ("ref", "needle"),
    [("{dir}/mymodel.py:missing", "no function 'missing'"),
     ("{dir}/mymodel.py:broken", "returned int"),
     ("{dir}/absent.py:build", "does not exist"),
     ("{dir}/typo.py:build", "SyntaxError"),
     ("{dir}/mymodel.py:with_target --batch-size 3", "takes no batch_size")],
)
def test_profile_user_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  ref: str, needle: str) -> None:
    (tmp_path / "mymodel.py").write_text(_USER_MODEL)
    (tmp_path / "typo.py").write_text(_USER_MODEL + "\ndef oops(:\n")
    assert main(["profile", *ref.format(dir=tmp_path).split()]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize("ref", [":f", "mlp:", "a..b:f"])
def test_a_malformed_model_reference_is_one_line(
        ref: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", ref]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dreampipe profile: error: model {ref!r} is not a zoo name, "
                          "'package.module:function' or 'path/to/file.py:function'")
    assert err.count("\n") == 1


_TORCH_OOM = ("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate "
              "memory: you tried to allocate 25600000000 bytes. Error code 12")


def test_a_model_too_big_for_memory_is_one_line_naming_its_arguments(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def out_of_memory(*_: object, **__: object) -> None:
        raise RuntimeError(_TORCH_OOM)

    monkeypatch.setattr("dreampipe.profiling.profiler.profile_spec", out_of_memory)
    assert main(["profile", "mlp", "--model-arg", "width=100000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dreampipe profile: error: model 'mlp' with width=100000000 ran out "
                          "of memory (it asked for 25.6 GB at once); give it smaller model "
                          "arguments (--model-arg)")
    assert err.count("\n") == 1


def test_another_runtime_error_while_profiling_is_not_hidden(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr("dreampipe.profiling.profiler.profile_spec", broken)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        main(["profile", "mlp", "--model-arg", "layers=2"])


@pytest.mark.parametrize(("text", "held"), [("[]", "a JSON list"), ("", "nothing"),
                                            ("null", "JSON null"), ("[1", "no valid JSON")])
def test_a_json_file_that_is_no_object_is_not_read_as_a_graph_txt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, held: str) -> None:
    path = tmp_path / "list.json"
    path.write_text(text)
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"dreampipe show: error: profile {str(path)!r}: holds {held}, not a "
                   "dreampipe profile (a JSON object); give a profile from 'dreampipe profile "
                   "-o' or a PipeDream graph.txt\n")


def test_show_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "options"),
    [("profile", ["MODEL", "--batch-size", "--small-batch", "--output", "--repeats",
                  "--warmup", "file.py"]),
     ("show", ["FILE", "graph.txt"])],
)
def test_help(command: str, options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in options:
        assert option in text


def test_profile_plan_simulate_register_without_torch() -> None:
    code = (
        "import argparse, importlib, sys\n"
        "sub = argparse.ArgumentParser().add_subparsers()\n"
        "for name in ('profile', 'plan', 'simulate'):\n"
        "    importlib.import_module(f'dreampipe.cli.{name}_command').register(sub)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_output_into_a_closed_pipe_is_quiet(pipedream_profiles: Path) -> None:
    # The reader exits at once (long before Python has started), so every print fails.
    script = f"{sys.executable} -m dreampipe show {pipedream_profiles / 'vgg16.txt'} | true"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True,
                         text=True, timeout=60)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr
    assert out.returncode == 141


def test_a_profile_piped_into_a_reader_that_stops_is_still_written(tmp_path: Path) -> None:
    out_file = tmp_path / "mlp.json"
    script = (f"{sys.executable} -m dreampipe profile mlp --model-arg layers=2 --repeats 1 "
              f"--small-batch 0 -o {out_file} | true")
    out = subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True,
                         text=True, timeout=120)
    assert "Traceback" not in out.stderr
    assert [x.name for x in load_graph(out_file).layers] == ["fc0", "fc1"]


def test_show_refuses_a_topology_for_a_profile_with_its_own_times(
        capsys: pytest.CaptureFixture[str]) -> None:
    """-t times a profile by shape; a measured or bundled profile would ignore it."""
    assert main(["show", "pipedream:vgg16", "-t", "dgx-a100:1"]) == 2
    assert "holds its own times: drop -t" in capsys.readouterr().err
    assert main(["show", "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=100", "-t",
                 "dgx-a100:1"]) == 0
