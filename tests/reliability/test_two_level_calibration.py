"""``dreampipe train`` on two nodes with no machine file: it measures both levels, then plans.

Two torchrun agents, each in a network namespace of its own (a node), with
two workers each, joined by a veth pair that tbf shapes to 1 Gbit/s, then to
20 Mbit/s; inside a node the workers talk over loopback, unshaped::

    ┌─ netns <tag>a: node 0 ─────────┐         ┌─ netns <tag>b: node 1 ─────────┐
    │ torchrun agent (c10d host)     │         │ torchrun agent                 │
    │ rank 0, rank 1 (gloo, loopback)│         │ rank 2, rank 3 (gloo, loopback)│
    │     veth 10.77.0.1 ────────────┼── R ──▶ │     veth 10.77.0.2             │
    │                    ◀───────────┼── R ─── │                                │
    └────────────────────────────────┘         └────────────────────────────────┘

With no machine file every rank takes part in the start-up measurement
(:func:`dreampipe.machine.measure.machine_for_run`): inside node 0 between
ranks 0 and 1, and between the nodes between ranks 0 and 2. Rank 0 plans on
the two-level topology those figures make, and ``--json`` reports it: the
link between the nodes must be what tbf lets through, and the plan the
planner's own for that topology and the profile given. The model (five
layers of an mlp of width 1024) is planned differently on the two links; on
the slow one no stage is replicated across it (the all-reduce would cross
it), only one cut's activations do. Four ranks on
two cores is twice the cores: what is measured is the links, and the plan
follows from them, not the compute's pace. Needs root, ``ip netns`` and ``tc``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from runtime import netns
from torchrun import agent_command, run_agents

import dreampipe
from dreampipe.machine.machine_file import ENV_VAR
from dreampipe.models import get_model
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.planner import evaluate_plan, plan_pipeline
from dreampipe.planning.topology import Topology
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import parse_bandwidth, parse_duration
from dreampipe.runplan.worker_profile import profile_as_worker

__all__: list[str] = []

_TESTS = Path(__file__).resolve().parents[1]
_SRC = Path(dreampipe.__file__).resolve().parents[1]
#: The links between the nodes: 1 Gbit/s and 20 Mbit/s, in bytes/s.
FAST, SLOW = 125e6, 2.5e6
#: Steps: whole all-reduce rounds of any plan on 4 workers (replicas 1, 2 or 3).
LAYERS, WIDTH, BATCH, STEPS = 5, 1024, 32, 6
_PORT = 29511  # inside the namespaces: nothing else listens there
_LEVEL = re.compile(r"(\d+) @ ([\d.]+ \w*B)/s(?: ([\d.]+ \w+))?")


@pytest.fixture(scope="module")
def link() -> Any:
    yield from netns.pair_or_skip(f"dpc{os.getpid() % 10**7}")


def _train(link: netns.VethPair, profile: Path, tmp_path: Path, tag: str) -> dict[str, Any]:
    """Both agents' run of ``dreampipe train --json``: rank 0's report, with both stderrs."""
    host = link.addresses[0]
    train = ["-m", "dreampipe", "train", "mlp", "--model-arg", f"layers={LAYERS}",
             "--model-arg", f"width={WIDTH}", "--batch-size", str(BATCH), "--steps",
             str(STEPS), "--profile", str(profile), "--json", "--no-progress",
             "--timeout", "60"]
    envs = [{**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
             "GLOO_SOCKET_IFNAME": link.interfaces[node],
             ENV_VAR: str(tmp_path / "no-machine-file.json"),
             "PYTHONPATH": os.pathsep.join([str(_SRC), str(_TESTS)])} for node in (0, 1)]
    cmds = [[*link.exec_prefix(node), *agent_command(
        node, nnodes=2, nproc=2, endpoint=f"{host}:{_PORT}", run_id=f"{tag}{os.getpid()}",
        local_addr=link.addresses[node], target=train)] for node in (0, 1)]
    ran = run_agents(cmds, envs, tmp_path, timeout_s=60, tag=tag)
    stderr = [err for _, _, err in ran]
    assert [code for code, _, _ in ran] == [0, 0], [s[-3000:] for s in stderr]
    reports = [ln for _, out, _ in ran for ln in out.splitlines() if ln.startswith("{")]
    assert len(reports) == 1, (reports, [s[-2000:] for s in stderr])
    return {**json.loads(reports[0]), "stderr": "".join(stderr)}  # rank 0 on either node


def _topology(described: str) -> Topology:
    """The topology ``Topology.describe`` wrote (outermost level first)."""
    levels = _LEVEL.findall(described)
    assert described.startswith("2x2 = 4 workers") and len(levels) == 2, described
    inner, outer = levels[1], levels[0]
    return Topology.parse("2x2", bandwidths=[parse_bandwidth(inner[1]),
                                             parse_bandwidth(outer[1])],
                          latencies=[parse_duration(lv[2]) if lv[2] else 0.0
                                     for lv in (inner, outer)])


def _bytes_reduced_across_nodes(graph: LayerGraph, stages: list[tuple[int, int, int]]) -> int:
    """Parameter bytes of the stages whose replicas span both nodes (ranks laid in stage
    order, 2 a node): what their all-reduces send over the link between the nodes."""
    crossing, worker = 0, 0
    for first, last, replicas in stages:
        if replicas > 1 and worker // 2 != (worker + replicas - 1) // 2:
            crossing += sum(layer.parameter_bytes for layer in graph.layers[first:last + 1])
        worker += replicas
    return crossing


def _shape(stages: list[list[int]]) -> list[tuple[int, int, int]]:
    return [(first, last, replicas) for first, last, replicas in stages]


@pytest.mark.slow
@pytest.mark.timing  # measured bandwidths: alone on the cores (make test)
@pytest.mark.timeout(170)
def test_train_on_two_nodes_measures_both_levels_and_plans_for_them(
    link: netns.VethPair, tmp_path: Path
) -> None:
    graph: LayerGraph = profile_as_worker(get_model("mlp", layers=LAYERS, width=WIDTH), BATCH,
                                          repeats=3)
    profile = tmp_path / "mlp.json"
    graph.save(profile)
    got = {}
    for name, rate in (("fast", FAST), ("slow", SLOW)):
        link.shape(rate)
        report = _train(link, profile, tmp_path, name)
        assert "no machine file" in report["stderr"], report["stderr"][-2000:]
        topology = _topology(report["topology"])
        inner, outer = topology.levels
        # the link between nodes is what tbf lets through (its bucket lets a little more),
        # inside a node loopback: faster
        assert 0.3 * rate < outer.bandwidth < 2.0 * rate, (name, report["topology"])
        assert inner.bandwidth > 2 * outer.bandwidth, (name, report["topology"])
        # the planner's best on that topology, up to the rounding of the figures reported
        direct = plan_pipeline(graph, topology, PlanOptions(allow_fewer_workers=False))
        stages = _shape(report["stages"])
        ran = evaluate_plan(graph, topology, [first for first, *_ in stages],
                            [replicas for *_, replicas in stages])
        assert ran.time_per_minibatch_s <= 1.02 * direct.time_per_minibatch_s, (
            name, report["topology"], stages, direct)
        got[name] = stages
    assert got["fast"] != got["slow"], got
    # on the slow link the all-reduces that cross it carry at most the head's few weights
    total = sum(layer.parameter_bytes for layer in graph.layers)
    assert _bytes_reduced_across_nodes(graph, got["slow"]) <= 0.05 * total, got
