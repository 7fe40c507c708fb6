"""Turn the per-rank reports gathered on rank 0 into one :class:`RunResult`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dreampipe.models.spec import ModelSpec
from dreampipe.runtime.config import RunConfig, RunResult
from dreampipe.runtime.data import Dataset
from dreampipe.scheduling.events import Event

if TYPE_CHECKING:
    from dreampipe.runtime.memory import MemoryUse

__all__ = ["RankReport", "assemble", "sorted_events", "stage_states"]

_EVAL_BATCH = 256
_log = logging.getLogger(__name__)


@dataclass
class RankReport:
    """What one rank measured; gathered on rank 0 to build the RunResult."""

    rank: int
    stage: int
    replica: int
    loop_s: float
    losses: dict[int, float] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    state: dict[str, Tensor] | None = None
    peak_versions: int = 0
    memory: MemoryUse | None = None


def assemble(
    cfg: RunConfig, spec: ModelSpec, reports: list[RankReport], data: Dataset | None
) -> RunResult:
    """Losses per update, throughput over the slowest rank, accuracy on the test split."""
    unit_losses: dict[int, float] = {}
    for rep in reports:
        unit_losses.update(rep.losses)
        _log.debug("rank %d (stage %d) held at most %d weight versions, loop %.3f s",
                   rep.rank, rep.stage, rep.peak_versions, rep.loop_s)
    per = cfg.layout.units_per_update
    losses = tuple(
        sum(unit_losses[u] for u in range(k * per, (k + 1) * per)) / per
        for k in range(cfg.steps)
    )
    elapsed = max(rep.loop_s for rep in reports)
    states = stage_states(reports, cfg.plan.num_stages)
    accuracy = None
    if cfg.evaluate and data is not None and data.has_test:
        accuracy = _evaluate(cfg, spec, states, data)
    return RunResult(
        samples_per_s=cfg.steps * cfg.minibatch_size / elapsed if elapsed > 0 else 0.0,
        final_loss=losses[-1],
        losses=losses,
        accuracy=accuracy,
        events=sorted_events(reports),
        elapsed_s=elapsed,
        stage_states=tuple(states),
    )


def stage_states(reports: list[RankReport], num_stages: int) -> list[dict[str, Tensor]]:
    """Each stage's final ``state_dict``, from the report of its replica 0."""
    states: list[dict[str, Tensor]] = [{} for _ in range(num_stages)]
    for rep in reports:
        if rep.replica == 0 and rep.state is not None:
            states[rep.stage] = rep.state
    return states


def sorted_events(reports: list[RankReport]) -> tuple[Event, ...]:
    """Every rank's events on the one time line, in start order."""
    return tuple(sorted((e for rep in reports for e in rep.events),
                        key=lambda e: (e.start_s, e.rank)))


def _evaluate(
    cfg: RunConfig, spec: ModelSpec, states: list[dict[str, Tensor]], data: Dataset
) -> float | None:
    """Top-1 accuracy of the trained model (all stages joined on this rank) on the test split."""
    assert data.test_x is not None and data.test_y is not None
    model = spec.build(0, spec.num_layers - 1, cfg.seed)
    merged = {k: v for state in states for k, v in state.items()}
    model.load_state_dict(merged)
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(data.test_y), _EVAL_BATCH):
            out = model(data.test_x[i : i + _EVAL_BATCH])
            y = data.test_y[i : i + _EVAL_BATCH]
            if out.dim() != 2 or out.shape[0] != y.shape[0]:
                return None
            correct += int((out.argmax(dim=1) == y).sum())
    return correct / len(data.test_y)
