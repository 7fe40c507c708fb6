"""The cluster flags ``plan`` shares: links per level and how replicas synchronise.

``--bandwidth`` and ``--latency`` repeat once per level, innermost first;
``--sync`` picks the all-reduce algorithm the cost model charges
(:mod:`dreampipe.planning.sync`) and ``--ps-shards`` the parameter server's
shards. A profile by shape (``gpt:...``) is timed on the topology's device
(:func:`profile_on`) and planned under its memory unless ``--memory`` says
otherwise (:func:`memory_limit`): its memory counts are Megatron-LM's, not a
measured profile's, whose limit stays opt-in (docs/planner.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from dreampipe.errors import ConfigError, TopologyError
from dreampipe.planning.sync import DEFAULT_SYNC, Sync, SyncKind
from dreampipe.planning.topology import PRESETS, SERVERS, Topology
from dreampipe.profiling.gpt_spec import OPTIONAL, by_shape, is_gpt_spec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.profiling.load import load_graph
from dreampipe.quantities import format_bytes

__all__ = ["GPT_HELP", "TOPOLOGY_HELP", "add_link_arguments", "memory_limit", "profile_on",
           "sync_from", "topology_from", "unfit_note"]

_SERVER_NAMES = ", ".join(f"{name}:N" for name in SERVERS)
#: What ``--topology`` takes, for every command's help.
TOPOLOGY_HELP = (
    f"a preset ({', '.join(sorted(PRESETS))}), N servers ({_SERVER_NAMES}: "
    "dgx-a100 = 8 A100-80GB, dgx-2h = 16 V100-32GB, p3.16xlarge = 8 V100-16GB) or a shape "
    "like 16, 4x4 (servers x devices); a preset's device times a gpt: profile")
#: How to write a profile by shape, for every command's help.
GPT_HELP = (
    "a GPT-style profile by shape, gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V (optional: "
    f"batch={OPTIONAL['batch']} sequences per minibatch, param_bytes={OPTIONAL['param_bytes']} "
    "bytes per weight and gradient), timed on the topology's device and planned under its "
    "memory")


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--bandwidth``, ``--latency``, ``--memory``, ``--sync`` and ``--ps-shards``."""
    p.add_argument("--bandwidth", "-b", action="append", metavar="B",
                   help="bandwidth of one level, innermost first, e.g. 10GB/s then 10Gbps "
                        "(repeat per level: a shape needs one per level, a preset keeps its "
                        "own for the levels not given; default: the preset's, or PCIe then "
                        "10Gbps)")
    p.add_argument("--latency", action="append", metavar="T",
                   help="per-message latency of one level, innermost first, e.g. 10us then "
                        "50us (repeat per level; default 10us inside a server, 50us between)")
    p.add_argument("--memory", metavar="SIZE",
                   help="device memory, e.g. 16GB: reject stages whose stashed weights and "
                        "activations do not fit (default: no limit; for a gpt: profile by "
                        "shape, the preset's device memory)")
    p.add_argument("--sync", choices=[k.value for k in SyncKind],
                   default=DEFAULT_SYNC.kind.value,
                   help="how replicas all-reduce, priced with a latency and a bandwidth term: "
                        "hierarchical (default; reduce-scatter inside a server, ring across, "
                        "all-gather inside: few slow-link latencies), ring (flat, bandwidth-"
                        "optimal, 2(p-1) latencies), halving-doubling (2 log2 p latencies, "
                        "best for small weights), ps (a parameter server, see --ps-shards)")
    p.add_argument("--ps-shards", type=int, default=1, metavar="K",
                   help="shards of the parameter server for --sync ps (default 1)")


def topology_from(args: argparse.Namespace) -> Topology:
    """The topology the flags describe."""
    return Topology.parse(args.topology, args.bandwidth, args.memory, args.latency)


def profile_on(spec: str | Path, topo: Topology) -> LayerGraph:
    """The profile ``spec`` names; a profile by shape timed on ``topo``'s device."""
    if is_gpt_spec(spec) and topo.device is None:
        named = [*(n for n, t in sorted(PRESETS.items()) if t.device), _SERVER_NAMES]
        raise TopologyError(
            f"topology {topo.name or topo.shape!r} names no device, and profile {str(spec)!r} "
            "is built from its shape, its layers timed at a device's peak rate; use a "
            f"preset that names one: {', '.join(named)}")
    return load_graph(spec, topo.device)


def memory_limit(memory: str | None, graph: LayerGraph, topo: Topology) -> int | None:
    """The memory per worker stages must fit: ``topo``'s where ``--memory`` gave it or
    ``graph`` is by shape (its device's), else none, as PipeDream's optimizer plans."""
    return topo.memory_bytes if memory or by_shape(graph) else None


def unfit_note(memory_bytes: Sequence[float], topo: Topology, limit: int | None) -> str | None:
    """Where a plan was made without ``--memory`` (``limit`` None) and some of its stages,
    needing ``memory_bytes`` each, need more than a worker of ``topo`` has: that it does
    not fit, and the option that holds it to that memory; None otherwise."""
    has = topo.memory_bytes if limit is None else None
    over = [s for s, need in enumerate(memory_bytes) if has and need > has]
    if not has or not over:
        return None
    worst = max(memory_bytes[s] for s in over)
    return (f"stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} "
            f"need{'' if len(over) > 1 else 's'} up to {format_bytes(worst)} per worker, above "
            f"the {format_bytes(has)} a worker has: this plan does not fit; plan with "
            f"--memory {format_bytes(has).replace(' ', '')} to hold the stages to it")


def sync_from(args: argparse.Namespace) -> Sync:
    """The all-reduce algorithm the flags pick."""
    if args.ps_shards < 1:
        raise ConfigError(
            f"--ps-shards {args.ps_shards}: a parameter server needs at least 1 shard, e.g. 4"
        )
    if args.ps_shards != 1 and args.sync != SyncKind.PARAMETER_SERVER.value:
        raise ConfigError(f"--ps-shards {args.ps_shards} with --sync {args.sync}: shards are "
                          f"a parameter server's; add --sync {SyncKind.PARAMETER_SERVER.value} "
                          "or drop --ps-shards")
    return Sync(SyncKind(args.sync), args.ps_shards)
