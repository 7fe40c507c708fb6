"""What one rank of a simulated schedule holds: microbatches in flight, the weight
versions they pin, its weights whole or sharded, and a launched all-reduce's gradients
beside the next update's; its peak is the planner's
:func:`dreampipe.planning.memory_terms.memory_bytes` at the worst of them (docs/design.md
§9).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = ["RankMemory", "stash_shares"]


class RankMemory:
    """Microbatches in flight on one rank and the weight versions they pin; a ZeRO-3 rank
    (``shards`` replicas) holds ``1 / shards`` of the live weights while they are sharded;
    from a launched all-reduce to its ``STEP`` the rank holds the next update's gradients
    beside it, a copy of the weights' bytes more."""

    def __init__(self, shards: int = 1) -> None:
        self.shards = shards
        self.sharded = shards > 1  # until the first UNSHARD
        self.version = 0
        self.microbatch_version: dict[int, int] = {}
        self.share: dict[int, float] = {}  # of each microbatch in flight, :func:`stash_shares`
        self.counts: Counter[int] = Counter()
        self.peak_in_flight = 0
        self.peak_versions = 1
        self.launched = False
        self.samples: set[tuple[int, float, bool, bool]] = {(1, 0.0, self.sharded, False)}

    def forward(self, microbatch: int, version: int, share: float = 1.0) -> None:
        """A forward that runs on ``version`` (:func:`~dreampipe.scheduling.weight_versions.
        runs_on`) pins it until its backward; it holds ``share`` of the rank's largest
        stash."""
        self.microbatch_version[microbatch] = version
        self.share[microbatch] = share
        self.counts[version] += 1
        self._sample()

    def backward(self, microbatch: int) -> None:
        self._sample()
        v = self.microbatch_version.pop(microbatch, None)
        self.share.pop(microbatch, None)
        if v is not None:
            self.counts[v] -= 1
            if not self.counts[v]:
                del self.counts[v]

    def step(self) -> None:
        self.version += 1
        self.launched = False
        self._sample()

    def launch(self) -> None:
        """An all-reduce left in flight until the ``STEP`` (a deferred step)."""
        self.launched = True

    def shard(self, sharded: bool) -> None:
        """The live weights are freed (``RESHARD``) or gathered whole (``UNSHARD``)."""
        self.sharded = sharded
        self._sample()

    def pins_live(self) -> bool:
        """Whether a microbatch in flight holds the live version, which a step then keeps."""
        return self.version in self.counts

    def _sample(self) -> None:
        versions = len(self.counts) + (self.version not in self.counts)
        flight = len(self.microbatch_version)
        self.peak_in_flight = max(self.peak_in_flight, flight)
        self.peak_versions = max(self.peak_versions, versions)
        self.samples.add((versions, sum(self.share.values()), self.sharded, self.launched))

    def peak_memory(self, parameter_bytes: float, stash_bytes: float, sent_bytes: float,
                    held_bytes: float = 0.0) -> float:
        from dreampipe.planning.memory_terms import memory_bytes  # NumPy: only when used

        freed = parameter_bytes * (1 - 1 / self.shards)
        return max(float(memory_bytes(parameter_bytes, stash_bytes * f, v, 1,
                                      sent_bytes=sent_bytes,
                                      working_bytes=held_bytes))
                   - (freed if sharded else 0.0) + (parameter_bytes if launched else 0.0)
                   for v, f, sharded, launched in self.samples)


def stash_shares(stash_bytes: Sequence[float], stages: Iterable[int]) -> dict[int, float]:
    """Each of ``stages``' stash over the largest of them: a rank hosting several holds,
    at any moment, the sum of its microbatches' own stages' stashes, not as many of the
    largest (1 where they are equal or hold nothing)."""
    hosted = list(stages)
    most = max((stash_bytes[st] for st in hosted), default=0.0)
    return {st: stash_bytes[st] / most if most > 0 else 1.0 for st in hosted}
