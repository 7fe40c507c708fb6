"""Profiler: a Sequential and a residual torch.fx model, and that nothing is disturbed."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from dreampipe.errors import ProfileError
from dreampipe.models import get_model
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.profiler import profile_model, profile_spec

F = nn.functional


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sequential() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.BatchNorm1d(12), nn.Dropout(0.5),
        nn.Linear(12, 3),
    )


class Residual(nn.Module):
    """``fc3(h + fc2(h))`` with ``h = relu(fc1(x))`` plus a functional weight: a DAG."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.scale = nn.Parameter(torch.ones(8, 4))
        self.fc3 = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc1(x))
        y = h + self.bn(self.fc2(h))
        out: Tensor = self.fc3(torch.matmul(y, self.scale))
        return out


def _assert_untouched(model: nn.Module, before: dict[str, Tensor], rng: Tensor,
                      modes: dict[str, bool]) -> None:
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert {n: m.training for n, m in model.named_modules()} == modes


def test_sequential_profile() -> None:
    model = _sequential()
    model.eval()
    x, target = torch.randn(10, 6), torch.randint(0, 3, (10,))
    before, rng = _state(model), torch.get_rng_state()
    modes = {n: m.training for n, m in model.named_modules()}
    calls: list[tuple[int, int]] = []

    graph = profile_model(model, x, F.cross_entropy, target, warmup=1, repeats=3,
                          progress=lambda done, total: calls.append((done, total)), name="seq")

    _assert_untouched(model, before, rng, modes)
    children = list(model)
    assert [x.name for x in graph.layers] == [name for name, _ in model.named_children()]
    assert graph.is_chain and len(graph.edges) == len(children) - 1
    assert graph.batch_size == 10 and graph.model == "seq"
    outputs, h = [], x
    with torch.no_grad():
        for child in children:
            h = child(h)
            outputs.append(h)
    for layer, child, out in zip(graph.layers, children, outputs, strict=True):
        assert layer.forward_ms > 0
        assert layer.backward_ms > 0
        assert layer.activation_bytes == _nbytes(out)
        assert layer.parameter_bytes == sum(_nbytes(p) for p in child.parameters())
        assert layer.largest_parameter_bytes == max(
            (_nbytes(p) for p in child.parameters()), default=0)
        assert layer.largest_parameter == layer.largest_parameter_bytes
    assert calls == [(i, 4) for i in range(1, 5)]  # warmup + repeats passes
    assert LayerGraph.from_json(graph.to_json()) == graph


def test_a_minimum_time_times_more_passes_until_it_is_reached() -> None:
    model = _sequential()
    x, target = torch.randn(10, 6), torch.randint(0, 3, (10,))
    calls: list[tuple[int, int]] = []
    start = time.perf_counter()
    graph = profile_model(model, x, F.cross_entropy, target, warmup=1, repeats=2,
                          min_time_s=0.2, progress=lambda done, total: calls.append((done, total)))
    took = time.perf_counter() - start
    timed = graph.meta["repeats"]
    assert timed > 2 and took >= 0.2  # a pass of this model takes well under 0.1 s
    assert calls[-1] == (1 + timed, 1 + timed)
    assert [done for done, _ in calls] == list(range(1, 2 + timed))
    quick = profile_model(model, x, F.cross_entropy, target, warmup=1, repeats=2)
    assert quick.meta["repeats"] == 2


class _Sleeps(nn.Module):
    """A layer whose forward waits ``ms`` milliseconds first."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms, self.fc = ms, nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.ms / 1e3)
        out: Tensor = self.fc(x)
        return out


def test_every_timed_pass_is_kept_whole() -> None:
    model = nn.Sequential(_Sleeps(2.0), nn.ReLU(), _Sleeps(3.0), nn.Linear(6, 3))
    x, target = torch.randn(10, 6), torch.randint(0, 3, (10,))
    graph = profile_model(model, x, F.cross_entropy, target, warmup=1, repeats=6)
    passes = graph.meta["pass_ms"]
    assert len(passes) == graph.meta["repeats"] == 6
    assert min(passes) >= 5.0  # each pass holds both sleeps
    assert graph.total_ms() >= 5.0
    assert min(passes) <= 1.5 * graph.total_ms() and graph.total_ms() <= 1.5 * max(passes)


def test_residual_fx_profile() -> None:
    torch.manual_seed(2)
    model = Residual()
    x, target = torch.randn(7, 5), torch.randint(0, 2, (7,))
    before, rng = _state(model), torch.get_rng_state()
    modes = {n: m.training for n, m in model.named_modules()}

    graph = profile_model(model, x, F.cross_entropy, target, warmup=1, repeats=3)

    _assert_untouched(model, before, rng, modes)
    names = [layer.name for layer in graph.layers]
    assert names == ["fc1", "relu", "fc2", "bn", "add", "matmul", "fc3"]
    named_edges = {(names[a], names[b]) for a, b in graph.edges}
    assert named_edges == {
        ("fc1", "relu"), ("relu", "fc2"), ("fc2", "bn"), ("relu", "add"), ("bn", "add"),
        ("add", "matmul"), ("matmul", "fc3"),
    }
    assert not graph.is_chain
    assert all(x.forward_ms > 0 and x.backward_ms > 0 for x in graph.layers)

    with torch.no_grad():
        h = torch.relu(model.fc1(x))
        b = model.bn(model.fc2(h))
        y = h + b
        m = torch.matmul(y, model.scale)
        real = [model.fc1(x), h, model.fc2(h), b, y, m, model.fc3(m)]
    assert [x.activation_bytes for x in graph.layers] == [_nbytes(t) for t in real]
    params = {n: sum(_nbytes(p) for p in getattr(model, n).parameters())
              for n in ("fc1", "fc2", "bn", "fc3")}
    params["matmul"] = _nbytes(model.scale)
    assert [x.parameter_bytes for x in graph.layers] == [params.get(n, 0) for n in names]
    assert graph.total_parameter_bytes() == sum(_nbytes(p) for p in model.parameters())


class _WritesInPlace(nn.Module):
    """A traced graph whose ``relu_`` and ``relu(..., inplace=True)`` write their inputs,
    whose ``add`` writes a new tensor, and whose running mean, a buffer, moves in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 2)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h.relu_()
        y = F.relu(self.bn(h) + h, inplace=True)
        out: Tensor = self.fc2(y)
        return out


def test_a_layer_that_writes_its_input_in_place_is_marked_and_no_other() -> None:
    """The runtime runs a stage that such a layer begins on a copy of its input
    (``runtime/input_writes.py``); one process writes the layer before's output."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 12),
                          nn.ReLU(), nn.BatchNorm1d(12), nn.Linear(12, 3))
    x, target = torch.randn(10, 6), torch.randint(0, 3, (10,))
    graph = profile_model(model, x, F.cross_entropy, target, warmup=0, repeats=1)
    # the batch norm writes its running statistics in place, not its input
    assert [x.writes_input for x in graph.layers] == [False, True, False, False, False, False]
    assert LayerGraph.from_json(graph.to_json()) == graph

    graph = profile_model(_WritesInPlace(), torch.randn(7, 5), F.cross_entropy,
                          torch.randint(0, 2, (7,)), warmup=0, repeats=1)
    assert {x.name: x.writes_input for x in graph.layers} == {
        "fc1": False, "relu_": True, "bn": False, "add": False, "relu": True, "fc2": False}


def test_shared_module_parameters_counted_once() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential()
    model.add_module("a", shared)
    model.add_module("act", nn.Tanh())
    model.add_module("b", shared)
    graph = profile_model(model, torch.randn(3, 4), lambda out: out.square().mean(),
                          warmup=0, repeats=1)
    assert [x.name for x in graph.layers] == ["a", "act", "b"]
    assert [x.parameter_bytes for x in graph.layers] == [_nbytes(shared.weight)
                                                         + _nbytes(shared.bias), 0, 0]
    assert [x.largest_parameter_bytes for x in graph.layers] == [_nbytes(shared.weight), 0, 0]
    # the second call reuses both: a stage holding it and not the first holds copies
    assert graph.layers[2].reused == ((0, 0, _nbytes(shared.weight)),
                                      (0, 1, _nbytes(shared.bias)))
    assert graph.reused_bytes(1, 2) == graph.layers[0].parameter_bytes
    assert graph.reused_bytes(0, 2) == 0 and LayerGraph.from_json(graph.to_json()) == graph


def test_first_layer_backward_without_parameters_is_zero() -> None:
    model = nn.Sequential(nn.ReLU(), nn.Linear(3, 1))
    graph = profile_model(model, torch.randn(2, 3), lambda out: out.sum(), warmup=0, repeats=1)
    assert graph.layers[0].backward_ms == 0
    assert graph.layers[1].backward_ms > 0


def test_weight_and_input_gradients_are_timed_apart() -> None:
    # layers large enough that the input gradient's GEMM takes time beside the weight's
    # on a loaded host (a few-microsecond GEMM measured twice can come out the other way)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256))
    graph = profile_model(model, torch.randn(64, 64), lambda out: out.sum(), warmup=1,
                          repeats=5)
    first, relu, last = graph.layers
    # the first layer's input needs no gradient: its whole backward is the weight gradient
    assert first.weight_grad_ms == first.backward_ms > 0
    assert relu.weight_grad_ms == 0 and relu.backward_ms > 0
    assert last.weight_grad_ms is not None and 0 < last.weight_grad_ms < last.backward_ms


def test_profile_spec_uses_spec_names_and_batch() -> None:
    spec = get_model("cnn", image_size=8)
    rng = torch.get_rng_state()
    graph = profile_spec(spec, batch_size=4, warmup=0, repeats=1)
    assert torch.equal(rng, torch.get_rng_state())
    assert [x.name for x in graph.layers] == spec.layer_names
    assert graph.batch_size == 4 and graph.model == "cnn"
    assert graph.total_parameter_bytes() == sum(_nbytes(p) for p in spec.build().parameters())


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc(x) if x.sum() > 0 else x
        return out


@pytest.mark.parametrize(
    ("model", "kwargs", "needle"),
    [
        (Untraceable(), {}, "Sequential"),
        (nn.Sequential(), {}, "no layers"),
        (nn.Sequential(nn.Linear(2, 2)), {"repeats": 0}, "repeats=0"),
        (nn.Sequential(nn.Linear(2, 2)), {"warmup": -1}, "warmup=-1"),
        (nn.Sequential(nn.Linear(2, 2)), {"min_time_s": -1.0}, "min_time_s=-1"),
        (nn.Sequential(nn.Linear(2, 2)), {"min_time_s": float("nan")}, "min_time_s=nan"),
        (nn.Sequential(nn.Linear(2, 2)), {"loss_fn": lambda out: out}, "scalar"),
    ],
    ids=["untraceable", "empty", "repeats", "warmup", "min-time", "nan-time", "non-scalar-loss"],
)
def test_bad_profile_inputs(model: nn.Module, kwargs: dict[str, Any], needle: str) -> None:
    args: dict[str, Any] = {"loss_fn": lambda out: out.sum(), **kwargs}
    loss_fn = args.pop("loss_fn")
    with pytest.raises(ProfileError, match=needle):
        profile_model(model, torch.randn(3, 2), loss_fn, **args)


def test_bad_batch_size() -> None:
    with pytest.raises(ProfileError, match="0"):
        profile_spec(get_model("mlp", layers=2, width=8), batch_size=0)
