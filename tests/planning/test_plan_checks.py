"""Plan files read field by field (:mod:`dreampipe.planning.plan_checks`): a wrong type,
a missing field or a config that disagrees with the stages is one line naming them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dreampipe.errors import PlanError
from dreampipe.planning.placement import Placement
from dreampipe.planning.plan import Heuristic, Plan
from dreampipe.planning.splits import Split

__all__: list[str] = []

_REWRITE = "(or write the plan again with 'dreampipe plan -o')"


def _plan() -> Plan:
    return Plan.from_config(8, [0, 4], [2, 1], model="toy", topology="4", batch_size=32,
                            time_per_minibatch_s=0.5, baselines_s={"dp": 1.5},
                            layer_names=tuple(f"l{i}" for i in range(8)))


def _load(tmp_path: Path, data: object) -> Plan:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return Plan.load(path)


def _set(data: dict[str, Any], where: str, value: object) -> None:
    """``data`` with the field at ``where`` (``stages.1.replicas``) set, or removed
    where ``value`` is ``...``."""
    *path, last = where.split(".")
    node: Any = data
    for step in path:
        node = node[int(step)] if isinstance(node, list) else node[step]
    key: Any = int(last) if isinstance(node, list) else last
    if value is ...:
        del node[key]
    else:
        node[key] = value


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("stages.1.replicas", "1", 'stages[1].replicas="1" is text; write a whole number '
                                   f"without quotes, e.g. 1 {_REWRITE}"),
        ("stages.1.replicas", True, "stages[1].replicas=true is a true/false flag; write a "
                                    "whole number"),
        ("stages.0.recompute", "yes", 'stages[0].recompute="yes" is text; write true or false'),
        ("stages.1.first", 4.5, "stages[1].first=4.5 is a fraction; write a whole number "
                                f"{_REWRITE}"),
        ("stages.0.compute_s", "x", 'stages[0].compute_s="x" is text; write a number, e.g. 0.5'),
        ("stages.0.ranks.1", None, "stages[0].ranks[1] is null; write a whole number"),
        ("stages.0.splits", "abc", 'stages[0].splits="abc" is text; write a list [...]'),
        ("stages.0.splits", [{"x": 1}], 'stages[0].splits[0]={"x": 1} is not one of "replica", '
                                        '"batch", "out", "in"; write one of them'),
        ("stages.0.compute_s", ..., f"field stages[0].compute_s is missing; add it {_REWRITE}"),
        ("stages.0", [0, 3], "stages[0]=[0, 3] is a list; write an object {...}"),
        ("stages", ..., f"field stages is missing; add it {_REWRITE}"),
        ("stages", None, f"stages is null; write a list [...] {_REWRITE}"),
        ("stages", "abc", 'stages="abc" is text; write a list [...]'),
        ("topology", ..., "field topology is missing; add it"),
        ("topology", None, "topology is null; write text in quotes"),
        ("virtual_stages", "x", 'virtual_stages="x" is text; write a whole number'),
        ("baselines_s", {"dp": "1.5"}, 'baselines_s.dp="1.5" is text; write a number'),
        ("heuristics", ["fast"], 'heuristics[0]="fast" is not one of "layer-blocks"'),
        ("placement", "w", 'placement="w" is not one of "loop", "v"'),
        ("config", "9-9", "config='9-9' does not match the stages, which make '2-1'; fix "
                          f"config or the stages {_REWRITE}"),
        ("layer_names", ["l0"], "layer_names holds 1 name but num_layers=8; give one name per "
                                "layer or none"),
        ("batch_size", -4, "batch_size=-4; give the minibatch size the plan was made for, or 0"),
        ("version", "1", "version=\"1\": this dreampipe reads plan format version 1; write the "
                         "plan again with 'dreampipe plan -o'"),
    ],
)
def test_a_wrong_field_is_one_line_naming_the_file_the_field_and_the_fix(
    tmp_path: Path, where: str, value: object, message: str
) -> None:
    data = _plan().to_dict()
    _set(data, where, value)
    with pytest.raises(PlanError) as info:
        _load(tmp_path, data)
    assert str(info.value).startswith(f"plan {str(tmp_path / 'plan.json')!r}: {message}")
    assert "\n" not in str(info.value)


def _every_field() -> list[Plan]:
    """Plans with every optional field the project writes set."""
    base = _plan()
    split = dataclasses.replace(base.stages[1], tensor_parallel=2, splits=(Split.OUT,) * 4,
                                recompute=True, zero=1, in_flight=1, shared_link_s=0.25,
                                compute_s=0.5, forward_s=0.2)
    first = dataclasses.replace(base.stages[0], in_flight=2, workers=(0, 1))
    tensor = dataclasses.replace(base, stages=(first, split), optimality_gap=0.1,
                                 heuristics=(Heuristic.LAYER_BLOCKS, Heuristic.SHARED_LINKS))
    v = Plan.from_config(8, [0, 2, 4, 6], [1, 1, 1, 1], virtual_stages=2,
                         placement=Placement.V, model="toy")
    return [base, tensor, v]


@pytest.mark.parametrize("plan", _every_field(), ids=["plain", "split", "v"])
def test_every_plan_the_project_writes_loads_back_the_same(tmp_path: Path, plan: Plan) -> None:
    path = tmp_path / "plan.json"
    plan.save(path, extra={"schedule": "zbv"})
    again = Plan.load(path)
    assert again == plan
    assert again.baselines_s == plan.baselines_s and again.config == plan.config


def test_a_whole_number_written_with_a_point_is_read_as_one(tmp_path: Path) -> None:
    data = _plan().to_dict()
    _set(data, "stages.1.first", 4.0)
    _set(data, "stages.0.memory_bytes", 1024.0)
    loaded = _load(tmp_path, data)
    assert loaded.stages[1].first == 4 and isinstance(loaded.stages[1].first, int)
    assert loaded.stages[0].memory_bytes == 1024


def test_a_file_without_config_or_layer_names_still_loads(tmp_path: Path) -> None:
    data = _plan().to_dict()
    _set(data, "config", ...)
    _set(data, "layer_names", ...)
    assert _load(tmp_path, data).config == "2-1"
