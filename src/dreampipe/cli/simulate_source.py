"""What ``dreampipe simulate`` simulates: a plan file or a profile, and where it runs.

A plan file runs on the links it was made on (its preset or shape, with ``-b`` and
``--latency`` where it was made with them), with the schedule ``dreampipe plan`` chose
for it unless a flag names another; without its profile its costs are its own
predictions, so another ``--sync`` is an error and another ``--topology`` a note. A
profile is planned for ``--topology`` first. docs/design.md §9.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dreampipe.cli.links import memory_limit, profile_on
from dreampipe.cli.plan_schedule import CHOSEN_KEY
from dreampipe.errors import ConfigError, PlanError, TopologyError
from dreampipe.planning.placement import check_fits
from dreampipe.planning.plan import PLAN_FORMAT, Plan
from dreampipe.planning.sync import DEFAULT_SYNC
from dreampipe.planning.topology import Topology
from dreampipe.profiling.bundled import is_bundled
from dreampipe.profiling.gpt_spec import is_gpt_spec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import parse_bytes
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.simulation.sync_run import SYNC_RUN_KEY, SyncRun

__all__ = ["load_source"]


def load_source(args: argparse.Namespace, default_topology: str
                ) -> tuple[Plan, LayerGraph | None, Topology, str, SyncRun | None]:
    """The plan, its profile if known, the topology, where the plan comes from, and the
    synchronous run it was planned as (None: none recorded)."""
    source = Path(args.source)
    named_profile = is_bundled(args.source) or is_gpt_spec(args.source)
    data = None if named_profile else _json_object(source)
    if data is not None and data.get("format") == PLAN_FORMAT:
        named = f"plan {args.source!r}"
        try:
            plan = Plan.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"{named}: {exc}") from exc
        topology = _plan_topology(plan.topology, args, named, default_topology)
        check_fits(plan, topology, named)
        if args.profile is None:
            _check_unpriced(args, plan, topology, named)
        graph = profile_on(args.profile, topology) if args.profile is not None else None
        recorded = data.get(CHOSEN_KEY)
        if recorded is not None:
            _take_chosen(args, recorded, named)
        run = data.get(SYNC_RUN_KEY)
        return plan, graph, topology, named, None if run is None else SyncRun.from_dict(run)
    if data is not None and "format" not in data and "layers" not in data:
        raise PlanError(f"{str(source)!r} is neither a plan (its 'format' {PLAN_FORMAT!r}) nor "
                        "a profile; give a plan JSON from 'dreampipe plan -o' or a profile "
                        "from 'dreampipe profile'")
    if args.profile is not None:
        raise PlanError(f"--profile goes with a plan JSON, but {str(source)!r} is a profile; "
                        "drop --profile")
    topology = Topology.parse(args.topology or default_topology, args.bandwidth,
                              args.memory, args.latency)
    graph = profile_on(args.source, topology)
    from dreampipe.planning.options import PlanOptions
    from dreampipe.planning.planner import plan_pipeline

    plan = plan_pipeline(graph, topology,
                         PlanOptions(memory_bytes=memory_limit(args.memory, graph, topology)))
    return plan, graph, topology, f"the plan of {args.source!r}", None


def _take_chosen(args: argparse.Namespace, recorded: Any, named: str) -> None:
    """The schedule and microbatches ``dreampipe plan`` chose for the plan, where the flags
    name none: a plan simulates as it was planned to run."""
    kinds = {k.value for k in ScheduleKind}
    if not (isinstance(recorded, dict) and recorded.get("schedule") in kinds
            and type(recorded.get("microbatches")) is int and recorded["microbatches"] >= 1):
        raise PlanError(f"{named}: {CHOSEN_KEY}={recorded!r} is not a schedule and its "
                        "microbatches; write the plan again with 'dreampipe plan -o'")
    if args.schedule is not None or args.schedule_file is not None:
        return
    args.schedule = recorded["schedule"]
    if args.microbatches is None and ScheduleKind(args.schedule) not in (
            ScheduleKind.PIPEDREAM, ScheduleKind.DP):
        args.microbatches = recorded["microbatches"]


def _check_unpriced(args: argparse.Namespace, plan: Plan, topology: Topology,
                    named: str) -> None:
    """Without its profile a plan simulates on its own predictions, made on its own cluster
    and all-reduce: ``--sync`` would change nothing (an error naming the fix), and another
    topology only where its ranks sit (a note on stderr, so no run seems to answer what it
    does not)."""
    made = (f"the plan's own predictions (compute, all-reduce and cut times), made on "
            f"{plan.topology or 'its cluster'}")
    if args.sync != DEFAULT_SYNC.kind.value or args.ps_shards != 1:
        raise ConfigError(
            f"--sync {args.sync} for {named}, which has no profile here: its costs are {made}; "
            "add --profile (the profile it was made from) to price another all-reduce")
    if args.topology and plan.topology and topology.describe() != plan.topology:
        print(f"note: --topology {args.topology} places {named}'s ranks; its costs stay {made}: "
              "add --profile (the profile it was made from) to price it on these links",
              file=sys.stderr)


def _plan_topology(text: str, args: argparse.Namespace, named: str,
                   default_topology: str) -> Topology:
    """The topology a plan was made on (``text``, its description): ``--topology`` and
    the link flags where given, else the preset or shape the description starts with and
    the links the flags give. Without ``--topology``, links other than the plan's are an
    error: a plan simulated on other links than its own would say nothing of it."""
    # parsed here: its error is its own, not a description's that the loop below skips
    memory = None if args.memory is None else parse_bytes(args.memory, require_unit=True)
    flags = (args.bandwidth, memory, args.latency)
    if args.topology:
        return Topology.parse(args.topology, *flags)
    if not text:
        return Topology.parse(default_topology, *flags)
    for spec in (text, *text.split()[:1]):
        try:
            topology = Topology.parse(spec, *flags)
        except TopologyError:
            continue
        if " @ " in text and _links(topology.describe()) != _links(text):
            raise TopologyError(
                f"{named} was made on {text}, but {spec} gives "
                f"{_links(topology.describe())}; give the plan's links with -b and --latency "
                "(one per level, innermost first), or --topology and --profile to simulate "
                "it on another")
        return topology
    raise TopologyError(f"the plan's topology {text!r} is not a preset or shape; "
                        "pass --topology (e.g. cluster-a or 4x4)")


def _links(described: str) -> str:
    """A topology's description up to its levels' links, without its memory or device."""
    return described.split("), ", 1)[0] + ")" if "), " in described else described


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read {str(path)!r}: {exc.strerror}; check the path") from exc
    except UnicodeDecodeError:
        return None  # not a plan; load_graph says what it is not
    if not text.lstrip().startswith("{"):
        if path.suffix.lower() == ".json":
            raise PlanError(f"{str(path)!r} is not a JSON object; give a plan JSON from "
                            "'dreampipe plan -o' or a profile from 'dreampipe profile'")
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else None
