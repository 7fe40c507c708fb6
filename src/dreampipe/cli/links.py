"""The cluster flags ``plan`` shares: links per level and how replicas synchronise.

``--bandwidth`` and ``--latency`` repeat once per level, innermost first;
``--sync`` picks the all-reduce algorithm the cost model charges
(:mod:`dreampipe.planning.sync`) and ``--ps-shards`` the parameter server's
shards.
"""

from __future__ import annotations

import argparse

from dreampipe.errors import ConfigError
from dreampipe.planning.sync import DEFAULT_SYNC, Sync, SyncKind
from dreampipe.planning.topology import Topology

__all__ = ["add_link_arguments", "sync_from", "topology_from"]


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--bandwidth``, ``--latency``, ``--memory``, ``--sync`` and ``--ps-shards``."""
    p.add_argument("--bandwidth", "-b", action="append", metavar="B",
                   help="bandwidth of one level, innermost first, e.g. 10GB/s then 10Gbps "
                        "(repeat per level; default: the preset's, or PCIe then 10Gbps)")
    p.add_argument("--latency", action="append", metavar="T",
                   help="per-message latency of one level, innermost first, e.g. 10us then "
                        "50us (repeat per level; default 10us inside a server, 50us between)")
    p.add_argument("--memory", metavar="SIZE",
                   help="device memory, e.g. 16GB: reject stages whose stashed weights and "
                        "activations do not fit (default: no limit)")
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


def sync_from(args: argparse.Namespace) -> Sync:
    """The all-reduce algorithm the flags pick."""
    if args.ps_shards < 1:
        raise ConfigError(
            f"--ps-shards {args.ps_shards}: a parameter server needs at least 1 shard, e.g. 4"
        )
    return Sync(SyncKind(args.sync), args.ps_shards)
