"""Topology: the cluster as a hierarchy of levels, innermost first.

Level k groups ``count`` units of level k-1 joined by links of
``bandwidth`` bytes/s (PipeDream §3.1). ``4x4`` is 4 servers of 4 devices:
``levels = (Level(4, in-server), Level(4, between servers))``. Workers are
numbered so that the devices of one server are consecutive.

Bandwidth figures for the presets (effective, per direction, per link):

========== ===================================== ============ =============
preset     hardware (PipeDream paper, Table 2)    in a server  between
========== ===================================== ============ =============
cluster-a  4 servers x 4 V100 16 GB, PCIe          10 GB/s      10 Gbps
cluster-b  2 servers x 8 V100 16 GB, NVLink        50 GB/s      25 Gbps
cluster-c  4 servers x 1 Titan X 12 GB             --           40 Gbps
========== ===================================== ============ =============

10 GB/s is what a PCIe 3.0 x16 link sustains in practice; 50 GB/s is one
V100 NVLink 2.0 brick pair (2 x 25 GB/s) per direction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dreampipe.errors import TopologyError
from dreampipe.quantities import format_bytes, parse_bandwidth, parse_bytes

__all__ = ["DEFAULT_BANDWIDTHS", "PRESETS", "Level", "Topology"]

#: Used by :meth:`Topology.parse` when no bandwidths are given: innermost level
#: PCIe (10 GB/s), every outer level 10 Gbps Ethernet.
DEFAULT_BANDWIDTHS = ("10GB/s", "10Gbps")


@dataclass(frozen=True)
class Level:
    count: int
    bandwidth: float

    def __post_init__(self) -> None:
        if self.count < 1:
            raise TopologyError(f"a level needs at least 1 unit, got {self.count}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise TopologyError(f"bandwidth {self.bandwidth!r} bytes/s must be positive and finite")


@dataclass(frozen=True)
class Topology:
    levels: tuple[Level, ...]
    memory_bytes: int = 16 * 10**9
    name: str = ""

    def __post_init__(self) -> None:
        if not self.levels:
            raise TopologyError("a topology needs at least one level")
        if self.memory_bytes <= 0:
            raise TopologyError(f"device memory {self.memory_bytes} must be positive")

    @property
    def num_workers(self) -> int:
        return math.prod(level.count for level in self.levels)

    @property
    def shape(self) -> str:
        """``"4x4"`` style, outermost first."""
        return "x".join(str(level.count) for level in reversed(self.levels))

    def bandwidth_between(self, a: int, b: int) -> float:
        """Bandwidth of the slowest link between workers ``a`` and ``b``."""
        if a == b:
            return math.inf
        size = 1
        for level in self.levels:
            size *= level.count
            if a // size == b // size:
                return level.bandwidth
        return self.levels[-1].bandwidth

    def flat(self) -> Topology:
        """One level of all workers at the slowest bandwidth."""
        bw = min(level.bandwidth for level in self.levels)
        return Topology((Level(self.num_workers, bw),), self.memory_bytes, self.name)

    def describe(self) -> str:
        parts = [f"{lv.count} @ {format_bytes(lv.bandwidth)}/s" for lv in reversed(self.levels)]
        label = f"{self.name} " if self.name else ""
        return (f"{label}{self.shape} = {self.num_workers} workers "
                f"({' x '.join(parts)}), {format_bytes(self.memory_bytes)} each")

    @classmethod
    def parse(
        cls,
        spec: str,
        bandwidths: Sequence[str | float] | None = None,
        memory: str | int | None = None,
    ) -> Topology:
        """A preset name, or ``"4x4"`` / ``"16"`` (outermost first).

        ``bandwidths`` lists one figure per level, innermost first; missing
        outer levels take the last default. ``memory`` overrides the device
        memory (``"16GB"``).
        """
        spec = spec.strip()
        if spec in PRESETS:
            topo = PRESETS[spec]
            if bandwidths:
                topo = cls._with_bandwidths([lv.count for lv in topo.levels], bandwidths, topo.name)
                topo = cls(topo.levels, PRESETS[spec].memory_bytes, spec)
        elif re.fullmatch(r"\d+(x\d+)*", spec):
            counts = [int(x) for x in reversed(spec.split("x"))]
            if any(c < 1 for c in counts):
                raise TopologyError(
                    f"topology {spec!r} has a level of 0 workers; every count must be >= 1"
                )
            topo = cls._with_bandwidths(counts, bandwidths or DEFAULT_BANDWIDTHS[: len(counts)], "")
        else:
            raise TopologyError(
                f"unknown topology {spec!r}; use a preset ({', '.join(sorted(PRESETS))}) "
                "or a shape like 16, 4x4 or 2x8"
            )
        if memory is not None:
            try:
                mem = parse_bytes(memory)
            except ValueError as exc:
                raise TopologyError(str(exc)) from None
            topo = cls(topo.levels, mem, topo.name)
        return topo

    @classmethod
    def _with_bandwidths(
        cls, counts: Sequence[int], bandwidths: Sequence[str | float], name: str
    ) -> Topology:
        if len(bandwidths) > len(counts):
            raise TopologyError(
                f"{len(bandwidths)} bandwidths for {len(counts)} levels; give one per level, "
                "innermost first"
            )
        figures = list(bandwidths) + [bandwidths[-1]] * (len(counts) - len(bandwidths))
        try:
            levels = tuple(
                Level(c, parse_bandwidth(b)) for c, b in zip(counts, figures, strict=True)
            )
        except ValueError as exc:
            if isinstance(exc, TopologyError):
                raise
            raise TopologyError(str(exc)) from None
        return cls(levels, name=name)


def _preset(name: str, counts: Sequence[int], bws: Sequence[str], memory: str) -> Topology:
    levels = tuple(Level(c, parse_bandwidth(b)) for c, b in zip(counts, bws, strict=True))
    return Topology(levels, parse_bytes(memory), name)


PRESETS: dict[str, Topology] = {
    "cluster-a": _preset("cluster-a", [4, 4], ["10GB/s", "10Gbps"], "16GB"),
    "cluster-b": _preset("cluster-b", [8, 2], ["50GB/s", "25Gbps"], "16GB"),
    "cluster-c": _preset("cluster-c", [1, 4], ["40Gbps", "40Gbps"], "12GB"),
}
