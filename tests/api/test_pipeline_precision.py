"""Every synchronous schedule under ``autocast=torch.bfloat16`` equals one process under
the same autocast, on a tiny Llama (untied) and a GPT-2 with a tied head.

The zero-bubble schedules split each backward into ``B`` and ``W``; under autocast a
``Linear`` takes autograd's path instead of the fused one, and its weight gradient must
still reach ``W`` (it was once dropped). The comparison is at the suite's fp32
tolerance: the pipeline runs the same bf16 kernels on the same values as one process,
and sums each update's fp32 gradients in the same order; only ``dp``'s all-reduce sums
in another order, a difference fp32 rounding bounds. Each job takes 3 updates of SGD
at a learning rate where a lost gradient moves a weight by far more than that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime.reference import reference_sync, sgd

from dreampipe.runtime.processes import run_processes

from .compare import ATOL, assert_matches
from .model_workers import train_cases
from .model_zoo import CASES, CaseData, CaseSpec
from .test_pipeline_models import SEED, assert_tied_equal

__all__: list[str] = []

_STEPS, _MINIBATCH, _MICRO, _LR = 3, 8, 2, 0.5
_JOBS: list[tuple[str, str, dict[str, Any]]] = [
    *((name, schedule, {}) for name in ("llama", "gpt2")
      for schedule in ("1f1b-flush", "gpipe", "zb-h1", "zb-h2", "naive")),
    ("llama", "interleaved-1f1b",
     {"virtual_stages": 2, "split_points": ["model.layers.0", "model.layers.1", "lm_head"]}),
    ("llama", "dp", {"replicated": True}),
    ("gpt2", "dp", {"replicated": True}),
]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    jobs = [{"case": name, "schedule": schedule, "seed": SEED, "steps": _STEPS,
             "minibatch": _MINIBATCH, "microbatches": _MICRO, "lr": _LR,
             "autocast": "bfloat16", **extra} for name, schedule, extra in _JOBS]
    out = run_processes(train_cases, 2, jobs, deadline_s=240.0)[0]
    assert out is not None
    return out


def _reference(name: str, microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_sync(CaseSpec(CASES[name], SEED), CaseData(CASES[name]),  # type: ignore[arg-type]
                          steps=_STEPS, minibatch=_MINIBATCH, seed=SEED, opt=sgd(_LR),
                          microbatches=microbatches, autocast=torch.bfloat16)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(_JOBS)),
                         ids=[f"{name}-{schedule}" for name, schedule, _ in _JOBS])
def test_a_schedule_under_bf16_autocast_equals_one_process(runs: list[dict[str, Any]],
                                                           index: int) -> None:
    name, schedule, _ = _JOBS[index]
    got = runs[index]
    assert got["schedule"] == schedule
    losses, state = _reference(name, _MICRO * 2 if schedule == "dp" else _MICRO)
    assert_matches(got, losses, state)
    assert_tied_equal(name, got)


def test_the_reference_under_bf16_differs_from_fp32() -> None:
    """The bf16 reference is not the fp32 one: autocast reaches the compared weights."""
    bf16 = _reference("llama", _MICRO)[1]
    fp32 = reference_sync(CaseSpec(CASES["llama"], SEED), CaseData(CASES["llama"]),  # type: ignore[arg-type]
                          steps=_STEPS, minibatch=_MINIBATCH, seed=SEED, opt=sgd(_LR),
                          microbatches=_MICRO)[1]
    assert max(float((bf16[k] - fp32[k]).abs().max()) for k in fp32) > 10 * ATOL
