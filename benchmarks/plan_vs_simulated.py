"""The planner's prediction against the simulator's run of the same plan, case by case.

Each bundled PipeDream profile on PipeDream's clusters and on ``2x8``, ``8x4`` and
``16x8``, with no memory limit and with the topology's memory (recomputation allowed),
and a GPT shape on clusters that name a device (their memory, recomputation allowed),
planned as ``dreampipe plan`` plans and checked as it checks: the plan's PipeDream
schedule through the simulator. Rows are sorted by how far the simulated rate is from
the predicted one (minibatches per second); ``warning`` is the cause ``dreampipe plan``
names when the two part by more than 10% (:mod:`dreampipe.cli.plan_check`).

    python benchmarks/plan_vs_simulated.py [--write-docs]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import _docs

from dreampipe.cli.links import profile_on
from dreampipe.cli.plan_check import check_ratio, check_warning
from dreampipe.cli.plan_command import confirm_by_simulation
from dreampipe.planning.options import PlanOptions
from dreampipe.planning.planner import plan_pipeline
from dreampipe.planning.topology import Topology

__all__ = ["CASES", "main"]

_GPT = "gpt:layers=24,hidden=2048,heads=16,seq=1024,vocab=50257"
#: (profile, topology, planned under the topology's memory)
CASES: tuple[tuple[str, str, bool], ...] = (
    *((f"pipedream:{m}", t, memory) for m in ("alexnet", "gnmt", "resnet18", "vgg16")
      for t in ("cluster-a", "cluster-b", "2x8", "8x4", "16x8") for memory in (False, True)),
    *((_GPT, t, True) for t in ("cluster-a", "cluster-b", "dgx-a100:4")),
)
#: The warning's cause, in a word or two, by a phrase of its text.
_CAUSES = {"rounds whole": "short rounds", "one link": "cut on one link",
           "waits where": "waits"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    rows = []
    for spec, cluster, memory in CASES:
        topo = Topology.parse(cluster)
        graph = profile_on(spec, topo)
        start = time.perf_counter()
        try:
            plan = plan_pipeline(graph, topo, PlanOptions(
                memory_bytes=topo.memory_bytes if memory else None, recompute=memory))
        except Exception as exc:  # a plan that does not fit says so, in its row
            rows.append((spec, cluster, memory, type(exc).__name__, 0.0, 0.0, 0.0, "", 0.0))
            continue
        seconds = time.perf_counter() - start
        sim = confirm_by_simulation(plan, graph, topo)
        warning = check_warning(plan, sim) or ""
        cause = next((v for k, v in _CAUSES.items() if k in warning), "")
        rows.append((spec, cluster, memory, plan.config, plan.throughput_minibatches_per_s,
                     sim.steady_throughput_minibatches_per_s, check_ratio(plan, sim), cause,
                     seconds))
    rows.sort(key=lambda r: -abs(r[6] - 1.0) if r[4] else 0.0)
    print(f"{'profile':<20} {'topology':<11} {'memory':<6} {'config':<28} {'predicted':>9} "
          f"{'simulated':>9} {'ratio':>6}  {'warning':<15} {'plan s':>6}")
    for spec, cluster, memory, config, pred, sim_rate, ratio, cause, seconds in rows:
        name = spec.removeprefix("pipedream:") if spec != _GPT else "gpt 24 layers, 2048"
        mem = "yes" if memory else "no"
        if not pred:
            print(f"{name:<20} {cluster:<11} {mem:<6} {config}")
            continue
        short = config if len(config) <= 28 else config[:25] + "..."
        print(f"{name:<20} {cluster:<11} {mem:<6} {short:<28} {pred:>9.2f} {sim_rate:>9.2f} "
              f"{ratio:>6.3f}  {cause:<15} {seconds:>6.2f}")
    apart = sum(1 for r in rows if r[4] and abs(r[6] - 1.0) > 0.10)
    print(f"\n{apart} of {sum(1 for r in rows if r[4])} plans simulate more than 10% from "
          "their prediction.")
    _docs.finish(tee, "plan-vs-simulated", __file__, argv)


if __name__ == "__main__":
    main()
