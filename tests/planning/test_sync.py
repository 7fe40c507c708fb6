"""Communication models: each all-reduce algorithm against its closed form, and replica layouts."""

from __future__ import annotations

import pytest

from dreampipe.errors import PlanError
from dreampipe.planning.sync import Sync, SyncKind, allreduce_seconds, replica_groups
from dreampipe.planning.topology import Level, Topology

_IN = Level(4, 1e10, 1e-5)  # 4 devices, 10 GB/s, 10 us
_OUT = Level(4, 1e9, 1e-4)  # 4 servers, 1 GB/s, 100 us
_N = 1e9  # bytes


def _time(kind: SyncKind, groups: tuple[int, ...], shards: int = 1) -> float:
    return float(allreduce_seconds(_N, groups, (_IN, _OUT), Sync(kind, shards)))


def test_one_replica_or_no_weights_costs_nothing() -> None:
    for kind in SyncKind:
        assert _time(kind, (1, 1)) == 0.0
        assert float(allreduce_seconds(0.0, (4, 4), (_IN, _OUT), Sync(kind))) == 0.0


def test_ring_pays_every_hop_at_the_slowest_link() -> None:
    # 16 replicas over 4 servers: 2*15 latencies of 100 us and 2*15/16 of the bytes at 1 GB/s
    assert _time(SyncKind.RING, (4, 4)) == pytest.approx(30 * 1e-4 + 30 / 16 * _N / 1e9)
    # inside one server: its own link
    assert _time(SyncKind.RING, (4, 1)) == pytest.approx(6 * 1e-5 + 1.5 * _N / 1e10)


def test_hierarchical_ring_sums_its_levels() -> None:
    inside = 6 * 1e-5 + 1.5 * _N / 1e10
    across = 6 * 1e-4 + 1.5 * _N / 1e9
    assert _time(SyncKind.HIERARCHICAL, (4, 4)) == pytest.approx(inside + across)
    # cheaper than a flat ring across servers: fewer latencies, fewer bytes on the slow link
    assert _time(SyncKind.HIERARCHICAL, (4, 4)) < _time(SyncKind.RING, (4, 4))
    # one level: the same as a ring
    assert _time(SyncKind.HIERARCHICAL, (4, 1)) == pytest.approx(_time(SyncKind.RING, (4, 1)))


def test_halving_doubling_has_log_latency() -> None:
    assert _time(SyncKind.HALVING_DOUBLING, (4, 4)) == pytest.approx(
        8 * 1e-4 + 30 / 16 * _N / 1e9)
    # 12 replicas: 8 do halving-doubling, 4 fold in and out (one exchange each way)
    assert _time(SyncKind.HALVING_DOUBLING, (4, 3)) == pytest.approx(
        8 * 1e-4 + (14 / 8 + 2) * _N / 1e9)


def test_parameter_server_is_bound_by_its_busiest_link() -> None:
    assert _time(SyncKind.PARAMETER_SERVER, (4, 4), shards=1) == pytest.approx(
        2e-4 + 2 * 16 * _N / 1e9)
    assert _time(SyncKind.PARAMETER_SERVER, (4, 4), shards=16) == pytest.approx(
        2e-4 + 2 * _N / 1e9)
    with pytest.raises(PlanError, match="at least 1 shard"):
        Sync(SyncKind.PARAMETER_SERVER, 0)


def test_latency_wins_for_small_messages_and_bandwidth_for_large() -> None:
    small, large = 1e3, 1e10
    def t(kind: SyncKind, n: float) -> float:
        return float(allreduce_seconds(n, (16,), (Level(16, 1e9, 1e-4),), Sync(kind)))
    assert t(SyncKind.HALVING_DOUBLING, small) < t(SyncKind.RING, small)
    assert t(SyncKind.RING, large) == pytest.approx(t(SyncKind.HALVING_DOUBLING, large), rel=1e-3)


def test_replica_groups_read_the_layout() -> None:
    topo = Topology((Level(4, 1e10), Level(4, 1e9)))
    assert replica_groups(range(16), topo) == (4, 4)
    assert replica_groups([0, 1, 4, 5], topo) == (2, 2)
    assert replica_groups([0, 1, 2, 3], topo) == (4, 1)
    assert replica_groups([0, 4, 8], topo) == (1, 3)
    assert replica_groups(range(15), topo) == (4, 4)  # uneven: the largest group
    with pytest.raises(PlanError, match="one entry per level"):
        allreduce_seconds(1.0, (2,), topo.levels, Sync())
