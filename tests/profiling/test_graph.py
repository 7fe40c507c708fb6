"""LayerGraph: JSON round-trip, validation errors, cut sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ProfileError
from dreampipe.profiling.graph import FORMAT_VERSION, Layer, LayerGraph
from dreampipe.profiling.load import load_graph

_times = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
_sizes = st.integers(min_value=0, max_value=2**40)


@st.composite
def graphs(draw: st.DrawFn) -> LayerGraph:
    n = draw(st.integers(min_value=1, max_value=12))
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=n, max_size=n, unique=True))
    layers = [
        Layer(name, draw(_times), draw(_times), draw(_sizes), draw(_sizes), draw(st.text()))
        for name in names
    ]
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    edges = draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    return LayerGraph(
        tuple(layers), tuple(sorted(edges)), draw(st.integers(0, 4096)), draw(st.text(max_size=8))
    )


@settings(max_examples=60, deadline=None)
@given(graphs())
def test_json_round_trip(graph: LayerGraph) -> None:
    back = LayerGraph.from_json(graph.to_json())
    assert back == graph
    assert back.layers == graph.layers
    assert back.edges == graph.edges
    assert back.batch_size == graph.batch_size
    assert back.model == graph.model


@settings(max_examples=60, deadline=None)
@given(graphs())
def test_cut_bytes_sum_outputs_with_a_consumer_after_the_cut(graph: LayerGraph) -> None:
    cuts = graph.cut_bytes()
    for k in range(1, len(graph)):
        crossing = {s for s, d in graph.edges if s < k and d >= k}
        expected = sum(graph.layers[s].activation_bytes for s in crossing)
        assert cuts[k] == expected == graph.cut_activation_bytes(k)


def test_save_and_load_file(tmp_path: Path) -> None:
    graph = LayerGraph.chain(
        [Layer("a", 1.0, 2.0, 10, 20), Layer("b", 0.5, 0.25, 5, 0)], batch_size=8, model="m"
    )
    path = tmp_path / "p.json"
    graph.save(path)
    assert load_graph(path) == graph
    assert load_graph(path).is_chain


def test_chain_cut_is_previous_output() -> None:
    layers = [Layer(f"l{i}", 1.0, 1.0, 100 * (i + 1), 0) for i in range(4)]
    graph = LayerGraph.chain(layers)
    assert [graph.cut_activation_bytes(k) for k in range(1, 4)] == [
        layers[k - 1].activation_bytes for k in range(1, 4)
    ]


def test_from_named_edges_sorts_topologically() -> None:
    layers = [Layer(n, 1.0, 1.0, 1, 1) for n in ("c", "a", "b")]
    graph = LayerGraph.from_named_edges(layers, [("a", "b"), ("b", "c")])
    assert [x.name for x in graph.layers] == ["a", "b", "c"]
    assert graph.edges == ((0, 1), (1, 2))


# ---- bad inputs: each a ProfileError naming the offending value ----------------
@pytest.mark.parametrize(
    ("field", "value"),
    [("forward_ms", -1.0), ("backward_ms", math.nan), ("activation_bytes", -7),
     ("parameter_bytes", "12")],
)
def test_bad_layer_value(field: str, value: Any) -> None:
    with pytest.raises(ProfileError, match=field) as info:
        _layer_with(field, value)
    assert repr(value) in str(info.value)
    assert "conv" in str(info.value)


def _two() -> tuple[Layer, ...]:
    return (Layer("a", 1.0, 1.0, 1, 1), Layer("b", 1.0, 1.0, 1, 1))


def test_edge_to_unknown_layer_index() -> None:
    with pytest.raises(ProfileError, match="0->5"):
        LayerGraph(_two(), ((0, 5),))


def test_edge_to_unknown_layer_name() -> None:
    with pytest.raises(ProfileError, match="'ghost'"):
        LayerGraph.from_named_edges(_two(), [("a", "ghost")])


def test_cycle() -> None:
    with pytest.raises(ProfileError, match="cycle"):
        LayerGraph.from_named_edges(_two(), [("a", "b"), ("b", "a")])
    with pytest.raises(ProfileError, match="'b'->'a'"):
        LayerGraph(_two(), ((1, 0),))


def test_duplicate_names() -> None:
    twice = (Layer("same", 1.0, 1.0, 1, 1), Layer("same", 1.0, 1.0, 1, 1))
    with pytest.raises(ProfileError, match="'same'"):
        LayerGraph(twice)
    with pytest.raises(ProfileError, match="'same'"):
        LayerGraph.from_named_edges(twice, [])


def test_empty_and_negative_batch() -> None:
    with pytest.raises(ProfileError, match="no layers"):
        LayerGraph(())
    with pytest.raises(ProfileError, match="-3"):
        LayerGraph(_two(), batch_size=-3)


def _doc(**changes: Any) -> str:
    data = LayerGraph.chain(list(_two())).to_dict()
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (_doc(format="pipedream"), "'pipedream'"),
        (_doc(version=FORMAT_VERSION + 1), str(FORMAT_VERSION + 1)),
        (_doc(layers=[{"name": "a"}]), "malformed"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be an object"),
        (_doc(edges=[["a", "b"]]), "malformed"),
        (_doc(batch_size="big"), "malformed"),
    ],
    ids=["format", "version", "missing-fields", "syntax", "not-object", "edge-names", "batch"],
)
def test_bad_json(text: str, needle: str) -> None:
    with pytest.raises(ProfileError, match=needle):
        LayerGraph.from_json(text)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match=r"nope\.json"):
        load_graph(missing)


def test_binary_file_is_a_profile_error(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\xd0\xff\xfe")
    with pytest.raises(ProfileError, match=r"model\.bin.*not text"):
        load_graph(binary)


# ---- non-finite figures: rejected where the profile is read, naming layer and field ----
@pytest.mark.parametrize("value", [math.inf, -math.inf, 1e400])
@pytest.mark.parametrize(
    "field", ["forward_ms", "backward_ms", "activation_bytes", "parameter_bytes"]
)
def test_non_finite_layer_value(field: str, value: float) -> None:
    with pytest.raises(ProfileError, match=field) as info:
        _layer_with(field, value)
    assert "'conv'" in str(info.value) and "finite" in str(info.value)


@pytest.mark.parametrize(("field", "token"), [("forward_ms", "Infinity"),
                                               ("activation_bytes", "1e400"),
                                               ("backward_ms", "NaN")])
def test_json_profile_with_a_non_finite_value(field: str, token: str) -> None:
    data = LayerGraph.chain(list(_two())).to_dict()
    data["layers"][1][field] = "PLACEHOLDER"
    text = json.dumps(data).replace('"PLACEHOLDER"', token)
    with pytest.raises(ProfileError, match=f"layer 'b' has {field}="):
        LayerGraph.from_json(text)


def _layer_with(field: str, value: Any) -> Layer:
    """A valid conv layer but for ``field`` set to ``value``."""
    kwargs: dict[str, Any] = dict(
        name="conv", forward_ms=1.0, backward_ms=1.0, activation_bytes=1, parameter_bytes=1
    )
    kwargs[field] = value
    return Layer(**kwargs)


def test_weight_gradient_time_round_trips_and_defaults_to_half() -> None:
    split = Layer("fc", 1.0, 3.0, 8, 8, weight_grad_ms=1.0)
    plain = Layer("relu", 1.0, 2.0, 8, 0)
    graph = LayerGraph.chain([split, plain])
    back = LayerGraph.from_json(graph.to_json())
    assert back.layers == (split, plain)
    assert "weight_grad_ms" not in json.loads(graph.to_json())["layers"][1]
    assert split.weight_grad_share == pytest.approx(1 / 3)
    assert plain.weight_grad_share == 0.5
    with pytest.raises(ProfileError, match=r"weight_grad_ms=4\.0 above backward_ms=3\.0"):
        Layer("fc", 1.0, 3.0, 8, 8, weight_grad_ms=4.0)


def test_a_layers_largest_parameter_round_trips_and_defaults_to_the_layer() -> None:
    """What a step or a gradient cast holds a parameter at a time: measured, else the whole
    layer's bytes, and never more than them."""
    measured = Layer("block", 1.0, 2.0, 8, 1000, largest_parameter_bytes=400)
    unknown = Layer("fc", 1.0, 2.0, 8, 1000)
    graph = LayerGraph.chain([measured, unknown])
    assert LayerGraph.from_json(graph.to_json()).layers == (measured, unknown)
    assert "largest_parameter_bytes" not in json.loads(graph.to_json())["layers"][1]
    assert (measured.largest_parameter, unknown.largest_parameter) == (400, 1000)
    assert Layer("x", 1.0, 2.0, 8, 100, largest_parameter_bytes=400).largest_parameter == 100


def test_a_layer_that_writes_its_input_round_trips_and_older_profiles_write_none() -> None:
    """The flag is written only where set, so a profile written before it loads as one
    whose layers write nothing."""
    writes, plain = Layer("relu", 1.0, 1.0, 8, 0, writes_input=True), Layer("fc", 1.0, 2.0, 8, 8)
    graph = LayerGraph.chain([plain, writes])
    data = json.loads(graph.to_json())
    assert data["layers"][1]["writes_input"] is True and "writes_input" not in data["layers"][0]
    assert LayerGraph.from_json(graph.to_json()).layers == (plain, writes)
    del data["layers"][1]["writes_input"]
    assert [x.writes_input for x in LayerGraph.from_dict(data).layers] == [False, False]


def test_a_file_that_is_no_profile_says_what_to_give() -> None:
    with pytest.raises(ProfileError, match=r"it is a plan: simulate it"):
        LayerGraph.from_dict({"format": "dreampipe.plan"})
    with pytest.raises(ProfileError, match=r"give a file from `dreampipe profile`"):
        LayerGraph.from_dict({})


@st.composite
def reusing(draw: st.DrawFn) -> LayerGraph:
    """Chains whose layers reuse parameters earlier layers counted (ties, modules called
    twice), each parameter ``(first, k)`` of one size wherever it is reused."""
    n = draw(st.integers(min_value=1, max_value=9))
    sizes = {(f, k): draw(st.integers(0, 1000)) for f in range(n) for k in range(2)}
    layers = []
    for i in range(n):
        keys = draw(st.lists(st.sampled_from([key for key in sizes if key[0] < i] or [None]),
                             max_size=3, unique=True))
        reused = tuple((f, k, sizes[f, k]) for f, k in (x for x in keys if x is not None))
        layers.append(Layer(f"l{i}", 1.0, 1.0, 1, draw(st.integers(0, 1000)), reused=reused))
    return LayerGraph.chain(layers)


@settings(max_examples=80, deadline=None)
@given(reusing())
def test_a_range_holds_each_weight_it_shares_with_earlier_layers_once(graph: LayerGraph
                                                                      ) -> None:
    table = graph.reused_table()
    n = len(graph.layers)
    for i in range(n):
        for j in range(n):
            held = {(f, k): b for x in graph.layers[i:j + 1] for f, k, b in x.reused if f < i}
            assert table[i, j] == graph.reused_bytes(i, j) == sum(held.values())
    assert LayerGraph.from_json(graph.to_json()) == graph


def test_a_reuse_of_a_later_layer_is_refused() -> None:
    with pytest.raises(ProfileError, match="reuses a parameter of layer 1"):
        LayerGraph.chain([Layer("a", 1, 1, 1, 1), Layer("b", 1, 1, 1, 1, reused=((1, 0, 4),))])
