"""PipeDream graph.txt import: every bundled profile, checked against the raw text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dreampipe.errors import ProfileError
from dreampipe.profiling.graph_txt import parse_graph_txt
from dreampipe.profiling.load import load_graph

LAYER_COUNTS = {"vgg16": 41, "alexnet": 23, "resnet18": 71, "gnmt": 48}


def _raw_field(line: str, key: str) -> float:
    """The value of ``key=`` on a node line; lists ``[a; b]`` summed."""
    match = re.search(rf"{key}=(\[[^\]]*\]|[^,\s]+)", line)
    assert match, (key, line)
    raw = match.group(1).strip("[]")
    return sum(float(x) for x in raw.split(";"))


def _raw(path: Path) -> tuple[list[str], list[tuple[str, str]]]:
    lines = path.read_text().splitlines()
    nodes = [x for x in lines if x.startswith("node")]
    edges = [tuple(x.strip().split(" -- ")) for x in lines if x.startswith("\t")]
    return nodes, [(a, b) for a, b in edges]


@pytest.mark.parametrize("name", sorted(LAYER_COUNTS))
def test_bundled_profile_matches_file(pipedream_profiles: Path, name: str) -> None:
    path = pipedream_profiles / f"{name}.txt"
    graph = load_graph(path)
    nodes, edges = _raw(path)
    assert len(graph) == LAYER_COUNTS[name] == len(nodes)
    assert graph.model == name
    assert {x.name for x in graph.layers} == {x.split(" -- ")[0] for x in nodes}

    forward = sum(_raw_field(x, "forward_compute_time") for x in nodes)
    backward = sum(_raw_field(x, "backward_compute_time") for x in nodes)
    params = sum(_raw_field(x, "parameter_size") for x in nodes)
    activations = sum(_raw_field(x, "activation_size") for x in nodes)
    assert sum(x.forward_ms for x in graph.layers) == pytest.approx(forward, rel=1e-12)
    assert sum(x.backward_ms for x in graph.layers) == pytest.approx(backward, rel=1e-12)
    assert abs(graph.total_parameter_bytes() - params) <= len(nodes)
    assert abs(sum(x.activation_bytes for x in graph.layers) - activations) <= len(nodes)

    named = {(graph.layers[a].name, graph.layers[b].name) for a, b in graph.edges}
    assert named == set(edges)
    assert len(graph.edges) == len(set(edges))
    assert all(a < b for a, b in graph.edges)


def test_per_layer_values_match_their_line(pipedream_profiles: Path) -> None:
    path = pipedream_profiles / "gnmt.txt"
    graph = load_graph(path)
    by_name = {x.name: x for x in graph.layers}
    for line in _raw(path)[0]:
        layer = by_name[line.split(" -- ")[0]]
        assert layer.forward_ms == _raw_field(line, "forward_compute_time")
        assert layer.backward_ms == _raw_field(line, "backward_compute_time")
        assert layer.activation_bytes == round(_raw_field(line, "activation_size"))
        assert layer.description == line.split(" -- ")[1].strip()


def test_resnet18_is_a_dag_with_fan_out(pipedream_profiles: Path) -> None:
    resnet = load_graph(pipedream_profiles / "resnet18.txt")
    assert not resnet.is_chain
    fan_out = [a for a, _ in resnet.edges]
    assert any(fan_out.count(a) > 1 for a in set(fan_out))


_GOOD = (
    "node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, "
    "activation_size=8.0, parameter_size=0.0\n"
    "node2 -- Linear -- forward_compute_time=1.5, backward_compute_time=2.0, "
    "activation_size=[4.0; 4.0], parameter_size=16.0\n"
    "\tnode1 -- node2\n"
)


def test_small_file_parses() -> None:
    graph = parse_graph_txt(_GOOD, model="tiny")
    assert [x.name for x in graph.layers] == ["node1", "node2"]
    assert graph.layers[1].activation_bytes == 8
    assert graph.edges == ((0, 1),)


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (_GOOD + "this is not a node\n", ["line 4", "this is not a node"]),
        (_GOOD.replace("=1.5", "=abc"), ["line 2", "'abc'"]),
        (_GOOD.replace("=1.5", "=-1.5"), ["line 2", "-1.5"]),
        (_GOOD.replace(", parameter_size=16.0", ""), ["line 2", "parameter_size"]),
        (_GOOD.replace("parameter_size=16.0", "parameter_size=16.0, colour=3"), ["colour"]),
        (_GOOD + "\tnode2 -- node9\n", ["node9"]),
        (_GOOD + "\tnode2 -- node1\n", ["cycle"]),
        (_GOOD + _GOOD.splitlines()[0] + "\n", ["node1", "twice"]),
        ("", ["no node lines"]),
    ],
    ids=["garbage", "not-a-number", "negative", "missing", "unknown-field", "unknown-node",
         "cycle", "duplicate", "empty"],
)
def test_malformed_graph_txt(text: str, needles: list[str]) -> None:
    with pytest.raises(ProfileError) as info:
        parse_graph_txt(text)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", "[1.0; inf]"])
@pytest.mark.parametrize(
    "field", ["forward_compute_time", "backward_compute_time", "activation_size",
              "parameter_size"]
)
def test_non_finite_values_name_the_layer_and_field(field: str, value: str) -> None:
    text = re.sub(rf"{field}=[^,\s]+", f"{field}={value}", _GOOD.splitlines()[0], count=1)
    assert value in text
    with pytest.raises(ProfileError) as info:
        parse_graph_txt(text + "\n")
    message = str(info.value)
    assert "line 1" in message and "node1" in message and f"{field}={value!r}" in message
    assert "finite" in message


def test_non_finite_values_through_load_graph(tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    path.write_text(_GOOD.replace("=1.5", "=inf", 1))
    with pytest.raises(ProfileError, match="not finite"):
        load_graph(path)
