"""Every precision on one rank holding all four stages of a GPT-2 (interleaved, ``v = 4``),
against one process in that precision on the same device, under ``torchrun`` with one
process.

Under ``make gpu-check`` this runs on ``cuda:0`` (NCCL, a group of one): the CUDA
kernels' 16-bit forwards and backwards, autocast on the GPU, fp16's loss scale and
bf16's 32-bit master weights, against one process on ``cuda:0`` (autocast's rules and
kernels differ between the CPU and the GPU, so each device is its own reference). The
tolerances are :mod:`.test_pipeline_precision`'s: fp32 to the suite's, a 16-bit run no
further from the 16-bit process than 3 times that process's distance from fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrun import torchrun_json

from .compare import assert_matches, assert_within_rounding
from .model_zoo import CASES, CaseSpec
from .test_pipeline_models import SEED, assert_tied_equal
from .test_pipeline_precision import (
    _LR,
    _MICRO,
    _MINIBATCH,
    _STEPS,
    _overflowing_scale,
    _reference,
)

__all__: list[str] = []

_PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16-mixed")
#: Where the pipeline's one rank trains (NCCL on the GPU where there is one), and so the
#: references.
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_CUTS = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    jobs = [{"case": "gpt2", "seed": SEED, "schedule": "interleaved-1f1b", "steps": _STEPS,
             "minibatch": _MINIBATCH, "microbatches": _MICRO, "lr": _LR["sgd"],
             "optimizer": "sgd", "precision": precision, "split_points": _CUTS,
             "virtual_stages": 4, "copies": 1,
             **({"loss_scale": _overflowing_scale("gpt2", _DEVICE)}
                if precision == "fp16-mixed" else {})}
            for precision in _PRECISIONS]
    # bf16 at a learning rate of 0: the 32-bit masters must stay the weights given
    jobs.append({**jobs[_PRECISIONS.index("bf16")], "lr": 0.0, "steps": 1})
    out = tmp_path_factory.mktemp("one_rank") / "results.pt"
    got = torchrun_json(Path(__file__).with_name("models_script.py"), str(out),
                        json.dumps(jobs), nproc=1, timeout_s=200.0)
    assert got == {"jobs": len(jobs)}
    runs: list[dict[str, Any]] = torch.load(out, weights_only=False, map_location="cpu")
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", _PRECISIONS)
def test_a_precision_on_one_rank_trains_as_one_process_in_it(runs: list[dict[str, Any]],
                                                             precision: str) -> None:
    got = runs[_PRECISIONS.index(precision)]
    assert got["schedule"] == "interleaved-1f1b"
    assert got["replicas"] == [1, 1, 1, 1]
    scale = _overflowing_scale("gpt2", _DEVICE) if precision == "fp16-mixed" else 2.0**16
    ref = _reference("gpt2", precision, "sgd", scale, device=_DEVICE)
    assert_tied_equal("gpt2", got)
    if precision == "fp32":
        assert_matches(got, ref.losses, ref.state)
        return
    start = {k: v.detach().clone() for k, v in CaseSpec(CASES["gpt2"], SEED).model()
             .state_dict().items()}
    fp32 = _reference("gpt2", "fp32", "sgd", skip=tuple(ref.skipped), device=_DEVICE)
    assert_within_rounding(got, (ref.losses, ref.state), (fp32.losses, fp32.state), start)
    if precision == "fp16-mixed":
        assert ref.skipped == [0]
        assert got["skipped"] == [0]  # the overflowing update skipped, as GradScaler does


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_masters_start_from_the_weights_given_tied_ones_too(
        runs: list[dict[str, Any]]) -> None:
    """Under bf16 every stage keeps 32-bit master weights taken before its cast to 16
    bits; GPT-2's embedding and head, tied across stages, start on every copy from the
    first copy's value before that cast too, so at a learning rate of 0 the state is the
    model's own, bit for bit (a start after the cast gave the tied copies their bf16
    rounding, and updates smaller than it were lost)."""
    got = runs[len(_PRECISIONS)]
    start = CaseSpec(CASES["gpt2"], SEED).model().state_dict()
    tied = [k for k in start if k.endswith(("wte.weight", "lm_head.weight"))]
    assert len(tied) == 2 and not torch.equal(start[tied[0]].bfloat16().float(), start[tied[0]])
    assert sorted(got["state"]) == sorted(start)
    for k, v in start.items():
        assert got["state"][k].dtype == v.dtype, k
        assert torch.equal(got["state"][k].cpu(), v), k
