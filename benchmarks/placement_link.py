"""Where a plan lays its stages, on two nodes joined by a shaped link: measured against predicted.

Two torchrun agents, each in a network namespace of its own (a node of two workers,
``tests/runtime/netns.py``), joined by a veth pair that tbf shapes to ``--rate`` each
way; inside a node the workers talk over loopback. ``dreampipe train --plan`` runs two
plans of the same stages, ``2-2`` of an mlp whose activations outweigh its weights:

- **copied**: stage 0 on workers 0 and 2, stage 1 on 1 and 3, each node holding a whole
  pipeline, so the cuts stay inside the nodes and only the all-reduces cross the link;
- **in rank order**: stage 0 on node 0, stage 1 on node 1, so every cut crosses it.

Each run measures the machine at start-up (no machine file), predicts its rate on the
workers the plan lays, and reports what it measured; the table adds the planner's price
of each plan at the shaped rate. The planner prices the copied plan far faster, which a
run delivers only where the ranks start where the plan lays them; where the link sets
the pace, both stages' all-reduces share it, which the price does not count
(docs/planner.md). Medians over ``--repeat`` runs, with their range. Run as root.

    python benchmarks/placement_link.py [--rate 20MB/s 5MB/s] [--repeat 3] [--write-docs]

Needs root, ``ip netns`` and ``tc``; the namespaces and every process in them are
removed however a run ends.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _docs

import dreampipe
from dreampipe.machine.machine_file import ENV_VAR
from dreampipe.models import get_model
from dreampipe.planning.planner import evaluate_plan
from dreampipe.planning.topology import Topology
from dreampipe.profiling.load import load_graph
from dreampipe.quantities import format_bytes, parse_bandwidth
from dreampipe.runplan.worker_profile import profile_as_worker

__all__ = ["PLANS", "main"]

_ROOT = Path(__file__).resolve().parents[1]
#: An mlp whose cut (a minibatch of 2048 x 256 floats, 2 MB) outweighs a stage's weights
#: (2 x 256^2 floats, 0.5 MB).
LAYERS, WIDTH, BATCH, STEPS = 4, 256, 2048, 48
#: Each stage's workers (two nodes of two), by plan.
PLANS = {"copied": [[0, 2], [1, 3]], "in rank order": [[0, 1], [2, 3]]}
#: Inside a node, for the planner's price: what loopback gives gloo here, about.
INSIDE = 1e9
_PORT = 29513  # inside the namespaces: nothing else listens there


def _load(name: str, path: Path) -> ModuleType:
    """A helper of the tests (not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _plans(folder: Path) -> dict[str, Path]:
    """The profile and each plan's file (the plans' own prices are a stand-in topology's:
    every run predicts on the machine it measures)."""
    graph = profile_as_worker(get_model("mlp", layers=LAYERS, width=WIDTH), BATCH, repeats=3)
    graph.save(folder / "mlp.json")
    stand_in = Topology.parse("2x2", bandwidths=["1GB/s", "20MB/s"])
    cut = len(graph.layers) // 2
    out = {}
    for name, workers in PLANS.items():
        plan = evaluate_plan(graph, stand_in, [0, cut], [2, 2], workers=workers)
        out[name] = folder / f"{name.replace(' ', '-')}.json"
        plan.save(out[name])
    return out


def _train(torchrun: ModuleType, pair: Any, plan: Path, folder: Path, tag: str
           ) -> dict[str, Any]:
    """Both agents' run of ``dreampipe train --plan plan --json``: rank 0's report."""
    train = ["-m", "dreampipe", "train", "mlp", "--model-arg", f"layers={LAYERS}",
             "--model-arg", f"width={WIDTH}", "--batch-size", str(BATCH), "--steps",
             str(STEPS), "--plan", str(plan), "--profile", str(folder / "mlp.json"),
             "--json", "--no-progress", "--timeout", "120"]
    paths = [str(Path(dreampipe.__file__).resolve().parents[1]), str(_ROOT / "tests")]
    envs = [{**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": pair.interfaces[n],
             ENV_VAR: str(folder / "no-machine-file.json"),
             "PYTHONPATH": os.pathsep.join(paths)} for n in (0, 1)]
    cmds = [[*pair.exec_prefix(n), *torchrun.agent_command(
        n, nnodes=2, nproc=2, endpoint=f"{pair.addresses[0]}:{_PORT}",
        run_id=f"{tag}{os.getpid()}", local_addr=pair.addresses[n], target=train)]
        for n in (0, 1)]
    ran = torchrun.run_agents(cmds, envs, folder, timeout_s=300, tag=tag)
    if [code for code, _, _ in ran] != [0, 0]:
        raise SystemExit(f"a run of {plan.name} failed:\n" +
                         "\n".join(err[-3000:] for _, _, err in ran))
    reports = [ln for _, out, _ in ran for ln in out.splitlines() if ln.startswith("{")]
    return dict(json.loads(reports[0]))


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"
            if values else "-")


def _ratio(a: list[float], b: list[float]) -> str:
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _priced(folder: Path, rate: float) -> dict[str, float]:
    """Each plan's samples/s by the planner's price, the link between the nodes at
    ``rate`` and :data:`INSIDE` inside a node."""
    graph = load_graph(folder / "mlp.json")
    topology = Topology.parse("2x2", bandwidths=[INSIDE, rate])
    cut = len(graph.layers) // 2
    return {name: BATCH / evaluate_plan(graph, topology, [0, cut], [2, 2],
                                        workers=workers).time_per_minibatch_s
            for name, workers in PLANS.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", nargs="+", default=["20MB/s", "5MB/s"],
                        help="the links between the nodes, each way, one after the other "
                             "(default 20MB/s 5MB/s)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each plan at each rate, in turn (default 3)")
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    netns = _load("_placement_netns", _ROOT / "tests" / "runtime" / "netns.py")
    torchrun = _load("_placement_torchrun", _ROOT / "tests" / "torchrun.py")
    reason = netns.unavailable()
    if reason is not None:
        raise SystemExit(f"cannot shape a link here: {reason}")
    tee = _docs.capture(args)
    rates = [parse_bandwidth(r, require_unit=True) for r in args.rate]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, netns.veth_pair(
            f"dpp{os.getpid() % 10**6}") as pair:
        folder = Path(tmp)
        plans = _plans(folder)
        for rate in rates:
            pair.shape(rate)
            measured: dict[str, list[float]] = {name: [] for name in PLANS}
            predicted: dict[str, list[float]] = {name: [] for name in PLANS}
            for k in range(args.repeat):
                for name, plan in plans.items():
                    report = _train(torchrun, pair, plan, folder, f"r{k}{len(measured[name])}")
                    measured[name].append(float(report["samples_per_s"]))
                    predicted[name].append(float(report["predicted_samples_per_s"]))
                    print(f"{format_bytes(rate)}/s run {k + 1}, {name}: measured "
                          f"{measured[name][-1]:.0f} samples/s, predicted "
                          f"{predicted[name][-1]:.0f}", file=sys.stderr, flush=True)
            rows.append((rate, _priced(folder, rate), measured, predicted))
    print(f"mlp of {LAYERS} layers of width {WIDTH}, minibatch {BATCH}, plan 2-2 under "
          "pipedream on two nodes of two workers (copied: stage 0 on workers 0, 2 and stage 1 "
          "on 1, 3; in rank order: stage 0 on 0, 1 and stage 1 on 2, 3), the link between "
          f"them shaped each way; samples/s, median (range) of {args.repeat} runs. priced: "
          f"the planner's price at the shaped rate, {format_bytes(INSIDE)}/s inside a node; "
          "predicted: the run's own, on the machine it measured at start-up\n")
    print("| link | plan | priced | predicted | measured | measured / priced "
          "| measured / predicted |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rate, priced, measured, predicted in rows:
        for name in PLANS:
            print(f"| {format_bytes(rate)}/s | {name} | {priced[name]:.0f} | "
                  f"{_spread(predicted[name])} | {_spread(measured[name])} | "
                  f"{_ratio(measured[name], [priced[name]] * len(measured[name]))} | "
                  f"{_ratio(measured[name], predicted[name])} |")
    print()
    for rate, _, measured, _ in rows:
        first, second = (statistics.median(measured[n]) for n in PLANS)
        print(f"{format_bytes(rate)}/s: copied over rank order, measured {first / second:.2f}x")
    _docs.finish(tee, "placement-link", __file__, argv)


if __name__ == "__main__":
    main()
