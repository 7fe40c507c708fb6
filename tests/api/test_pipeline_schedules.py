"""Zero-bubble and interleaved schedules through the API equal one process.

Each runs the zoo's mlp or a small transformer (LayerNorm weights take the
split backward's autograd path, Linear ones its held GEMMs, the embedding's
first stage does its whole backward in ``W``) on several processes over gloo,
with momentum or AdamW and gradient clipping, against single-process
gradient accumulation (:func:`schedule_workers.reference`). AdamW trains the
mlp only: the transformer's key bias has a gradient of rounding noise (softmax
ignores it), which AdamW's normalisation turns into whole steps whose sign
differs between any two summation orders, 1f1b-flush's included.
"""

from __future__ import annotations

from typing import Any

import pytest

from dreampipe.runtime.processes import run_processes

from .compare import assert_matches
from .schedule_workers import reference, train_schedule

__all__: list[str] = []

_MLP = ("mlp", {"layers": 4, "width": 16})
_TRANSFORMER = ("transformer", {"vocab": 40, "dim": 16, "heads": 2, "layers": 2, "seq_len": 6})

CASES = [
    ("zb-h1", _MLP, [0, 2], [1, 1], "sgd", 0.5, 4),
    ("zb-h1", _TRANSFORMER, [0, 1, 2], [1, 1, 1], "sgd", 0.1, 4),
    ("zb-h2", _TRANSFORMER, [0, 2], [1, 1], "sgd", None, 4),
    ("zb-h2", _MLP, [0, 1, 2, 3], [1, 1, 1, 1], "adamw", 0.5, 8),
    ("zb-h1", _MLP, [0, 2], [2, 1], "adamw", 0.5, 4),
]


def _id(case: tuple[Any, ...]) -> str:
    return f"{case[0]}-{case[1][0]}-{'-'.join(map(str, case[3]))}-{case[4]}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("schedule", "model", "bounds", "replicas", "optimizer", "clip",
                          "micro"), CASES, ids=[_id(c) for c in CASES])
def test_zero_bubble_equals_one_process(
    schedule: str, model: tuple[str, dict[str, int]], bounds: list[int], replicas: list[int],
    optimizer: str, clip: float | None, micro: int,
) -> None:
    job = {"model": model[0], "model_args": model[1], "schedule": schedule, "bounds": bounds,
           "replicas": replicas, "steps": 3, "minibatch": 16, "microbatches": micro,
           "optimizer": optimizer, "lr": 0.05 if optimizer == "sgd" else 0.01, "clip": clip,
           "seed": 3}
    got = run_processes(train_schedule, sum(replicas), job, deadline_s=120.0)[0]
    assert_matches(got, *reference(job))


INTERLEAVED = [
    (_MLP, [0, 1, 2, 3], 2, "adamw", 0.5),
    (_TRANSFORMER, [0, 1, 2, 3], 2, "sgd", None),
    (_TRANSFORMER, [0, 1, 2, 3], 1, "sgd", 0.1),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("model", "bounds", "workers", "optimizer", "clip"), INTERLEAVED,
                         ids=[f"{c[0][0]}-{c[2]}-workers-{c[3]}" for c in INTERLEAVED])
def test_interleaved_equals_one_process(
    model: tuple[str, dict[str, int]], bounds: list[int], workers: int, optimizer: str,
    clip: float | None,
) -> None:
    """Two stages per worker; on one worker every hand-off stays within the rank."""
    v = len(bounds) // workers
    job = {"model": model[0], "model_args": model[1], "schedule": "interleaved-1f1b",
           "bounds": bounds, "replicas": [1] * len(bounds), "virtual_stages": v, "steps": 3,
           "minibatch": 16, "microbatches": 4, "optimizer": optimizer,
           "lr": 0.05 if optimizer == "sgd" else 0.01, "clip": clip, "seed": 3}
    got = run_processes(train_schedule, workers, job, deadline_s=120.0)[0]
    assert_matches(got, *reference(job))
