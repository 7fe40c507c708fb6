"""``dreampipe plan`` on bad bandwidths and broken profiles: one line naming the value, exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dreampipe.cli import main
from dreampipe.profiling.graph import Layer, LayerGraph


def _profile(tmp_path: Path, forward_ms: float = 1.0, name: str = "ok.json") -> Path:
    """A 4-layer chain saved as our JSON; layer ``l2`` gets ``forward_ms``."""
    layers = [Layer(f"l{i}", 1.0, 2.0, 1000, 1000) for i in range(4)]
    path = tmp_path / name
    LayerGraph.chain(layers, batch_size=8).save(path)
    if forward_ms != 1.0:
        data = json.loads(path.read_text())
        data["layers"][2]["forward_ms"] = forward_ms
        path.write_text(json.dumps(data))  # inf is written as the token Infinity
    return path


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2 and out == ""
    assert err.startswith("dreampipe plan: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(
    ("bandwidths", "needles"),
    [
        (["1e400GB/s", "1GB/s"], ["'1e400GB/s'", "finite"]),
        (["1e99999999999GB/s", "1GB/s"], ["'1e99999999999GB/s'", "finite"]),
        (["10"], ["bandwidth '10' has no unit", "10GB/s", "10Gbps"]),
        (["10GB/s", "10"], ["bandwidth '10' has no unit"]),
        (["10GB/s"], ["'4x4' has 2 levels", "needs 2 bandwidths", "innermost first", "got 1"]),
        (["1GB/s", "1GB/s", "1GB/s"], ["3 bandwidths for 2 levels"]),
        (["1e-320B/s", "1GB/s"], ["'1e-320B/s'", "below 1 byte/s"]),
    ],
    ids=["overflow", "huge-exponent", "no-unit", "no-unit-outer", "too-few", "too-many", "tiny"],
)
def test_bad_bandwidths(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, bandwidths: list[str], needles: list[str]
) -> None:
    argv = [str(_profile(tmp_path)), "-t", "4x4"]
    for b in bandwidths:
        argv += ["-b", b]
    _one_line_error(*_plan(capsys, *argv), *needles)


def test_one_bandwidth_for_a_preset_overrides_its_inner_level(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = _plan(capsys, str(_profile(tmp_path)), "-t", "cluster-b", "-b", "100GB/s")
    assert code == 0
    # 25 Gbps kept outside, and each level's latency with it
    assert "2 @ 3.1 GB/s 50 us x 8 @ 100.0 GB/s 10 us" in out.splitlines()[0]


def test_a_bandwidth_per_level_still_plans(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = _plan(capsys, str(_profile(tmp_path)), "-t", "4x4", "-b", "10GB/s",
                         "-b", "10Gbps", "--json")
    assert code == 0
    json.loads(out, parse_constant=_refuse)


def test_huge_memory_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = _plan(capsys, str(_profile(tmp_path)), "-t", "4", "--memory", "1e400GB")
    _one_line_error(code, out, err, "'1e400GB'", "finite")


def test_parameter_server_shards_without_a_parameter_server_are_one_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = _plan(capsys, str(_profile(tmp_path)), "-t", "4", "--ps-shards", "3")
    _one_line_error(code, out, err, "--ps-shards 3 with --sync hierarchical", "--sync ps")
    code, _, _ = _plan(capsys, str(_profile(tmp_path)), "-t", "4", "--ps-shards", "3",
                       "--sync", "ps")
    assert code == 0


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e400])
def test_non_finite_time_in_a_json_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: float
) -> None:
    code, out, err = _plan(capsys, str(_profile(tmp_path, value)), "-t", "4")
    _one_line_error(code, out, err, "layer 'l2'", "forward_ms=", "finite")
    assert "allow fewer workers" not in err


@pytest.mark.parametrize(
    ("field", "value"),
    [("forward_compute_time", "inf"), ("activation_size", "1e400"), ("parameter_size", "nan")],
)
def test_non_finite_value_in_a_graph_txt(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, field: str, value: str
) -> None:
    node2 = ("node2 -- Linear -- forward_compute_time=1.5, backward_compute_time=2.0, "
             "activation_size=4.0, parameter_size=16.0")
    path = tmp_path / "graph.txt"
    path.write_text(
        "node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, "
        f"activation_size=8.0, parameter_size=0.0\n{_set(node2, field, value)}\n"
        "\tnode1 -- node2\n"
    )
    code, out, err = _plan(capsys, str(path), "-t", "2")
    _one_line_error(code, out, err, "line 2", "node2", f"{field}={value!r}", "not finite")


def test_an_all_zero_profile_never_prints_infinity(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "zero.json"
    LayerGraph.chain([Layer(f"l{i}", 0.0, 0.0, 0, 0) for i in range(4)]).save(path)
    code, out, err = _plan(capsys, str(path), "-t", "4", "--json")
    _one_line_error(code, out, err, "0 ms")


def test_errors_come_out_of_the_real_command(tmp_path: Path) -> None:
    """The installed entry point: one line on stderr, exit 2, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "dreampipe", "plan", str(_profile(tmp_path)), "-t", "4x4",
         "-b", "1e400GB/s", "-b", "1GB/s"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "'1e400GB/s'" in proc.stderr


def _set(line: str, field: str, value: str) -> str:
    """``line`` with ``field=...`` set to ``value``."""
    head, _, rest = line.partition(f"{field}=")
    _, comma, tail = rest.partition(",")
    return f"{head}{field}={value}{comma}{tail}"


def _refuse(token: str) -> float:
    raise AssertionError(f"JSON holds {token}")


@pytest.mark.parametrize(("argv", "needles"), [
    (["train", "mlp", "--schedule", "nonsense"],
     ["dreampipe train: error: argument --schedule: invalid choice: 'nonsense'",
      "'1f1b-flush'", "see 'dreampipe train --help'"]),
    (["plan", "pipedream:vgg16"], ["dreampipe plan: error: the following arguments are "
                                   "required: --topology/-t; see 'dreampipe plan --help'"]),
    (["nonsense"], ["dreampipe: error: argument COMMAND: invalid choice: 'nonsense'",
                    "see 'dreampipe --help'"]),
])
def test_an_option_argparse_refuses_is_one_line_too(
        capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "usage:" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("command", ["plan", "simulate", "train", "profile"])
def test_an_unknown_option_names_its_commands_help(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "pipedream:gnmt", "-t", "4", "--no-such-option"] if command == "plan"
             else [command, "pipedream:gnmt", "--no-such-option"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"dreampipe {command}: error: unrecognized arguments: --no-such-option; "
                   f"see 'dreampipe {command} --help'\n")
