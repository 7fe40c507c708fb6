"""Per minibatch, how long the links that a server shares with its other transfers are busy.

Across an outer level a unit (a server) has one link out and one link in, which
every transfer of that unit across that level shares (§3.1 of docs/design.md).
The program prices each cut on its own, so two cuts whose transfers leave one
server are each priced as if the server's link were theirs. This module sums, for
every shared link, what all the cuts of a laid-out pipeline put on it, so that a
cut is never priced faster than the busiest shared link it uses:

- the schedule sends minibatch ``m`` from replica ``m % r`` of a stage to replica
  ``m % r'`` of the next, so over ``lcm(r, r')`` minibatches each pair ``(i, j)``
  with ``i = j (mod gcd(r, r'))`` carries one;
- a transfer across level ``k`` costs ``alpha_k + bytes / B_k`` on the sender's
  link out and on the receiver's link in: activations forward, gradients back.

Links inside a server are each pair's own and are left to the cut's own price.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from dreampipe.planning.topology import Topology

__all__ = ["shared_link_seconds"]

_Link = tuple[int, int, int]


def shared_link_seconds(
    cut_bytes: Sequence[float], senders: Sequence[Sequence[int]], topology: Topology
) -> list[float]:
    """For each cut ``s`` (after stage ``s``), the seconds per minibatch of the busiest
    shared link its transfers use (0 where none crosses a server); ``senders[s]``
    lists stage ``s``'s replicas by the worker each sends from, in replica order."""
    if len(topology.levels) < 2:
        return [0.0] * len(cut_bytes)
    server = topology.levels[0].count
    load: dict[_Link, float] = {}
    used: list[set[_Link]] = []
    for s, size in enumerate(cut_bytes):
        links: set[_Link] = set()
        for (x, y), share in _server_pairs(senders[s], senders[s + 1], server).items():
            k = topology.level_between(x, y)
            level = topology.levels[k]
            cost = share * (level.latency + size / level.bandwidth)
            for link in (*topology.links_between(x, y), *topology.links_between(y, x)):
                load[link] = load.get(link, 0.0) + cost
                links.add(link)
        used.append(links)
    return [max((load[link] for link in links), default=0.0) for links in used]


def _server_pairs(
    left: Sequence[int], right: Sequence[int], server: int
) -> dict[tuple[int, int], float]:
    """The share of minibatches each pair of servers carries, by a worker of each
    (pairs inside one server left out)."""
    r, q = len(left), len(right)
    g = math.gcd(r, q)
    rounds = r * q // g
    out: dict[tuple[int, int], float] = {}
    for c in range(g):
        sent = Counter(left[i] // server for i in range(c, r, g))
        got = Counter(right[j] // server for j in range(c, q, g))
        for a, na in sent.items():
            for b, nb in got.items():
                if a != b:
                    key = (a * server, b * server)
                    out[key] = out.get(key, 0.0) + na * nb / rounds
    return out
