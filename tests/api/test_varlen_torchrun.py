"""Sequences of changing length under ``torchrun --nproc-per-node 2``: Hugging Face's GPT-2
(tied embeddings, the embedding and the head on different stages) trained on 20
minibatches of 8 to 64 tokens, one length each, the last minibatch short by 3 samples
(``variable_dims=(0, 1)``), equals one process that trains on each whole minibatch,
under 1f1b-flush, zb-h1 and interleaved-1f1b (4 stages, 2 a rank); and packed
documents (positions restarting at each document, an attention mask, which makes
every stage trace the model again for each new length) pass as inputs and train as
one process too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime.reference import reference_sync, sgd
from torchrun import torchrun_json

from .compare import assert_matches
from .model_zoo import SHORT_BY, SHORT_STEP, CaseData, CaseSpec, find_case
from .test_pipeline_models import SEED, assert_tied_equal

__all__: list[str] = []

_SCHEDULES = ("1f1b-flush", "zb-h1", "interleaved-1f1b")
_RUN = {"seed": SEED, "steps": 20, "minibatch": 8, "microbatches": 2, "lr": 0.1,
        "variable_dims": [0, 1]}
_PACKED_STEPS = 8
_UNPADDED_STEPS = 4
_CUT = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]  # 4 stages


def _jobs() -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    for schedule in _SCHEDULES:
        job = {"case": "gpt2-varlen", **_RUN, "schedule": schedule}
        if schedule == "interleaved-1f1b":
            job.update(virtual_stages=2, split_points=_CUT)
        jobs.append(job)
    return [*jobs, {"case": "gpt2-packed", **_RUN, "schedule": "1f1b-flush",
                    "steps": _PACKED_STEPS, "variable_dims": [1]},
            {"case": "gpt2-unpadded", **_RUN, "schedule": "1f1b-flush",
             "steps": _UNPADDED_STEPS, "variable_dims": [1], "evaluate": 2}]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    out = tmp_path_factory.mktemp("varlen") / "results.pt"
    jobs = _jobs()
    got = torchrun_json(Path(__file__).with_name("models_script.py"), str(out),
                        json.dumps(jobs), timeout_s=240.0)
    assert got == {"jobs": len(jobs)}
    runs = torch.load(out, weights_only=False)
    return {(job["case"], job["schedule"]): run for job, run in zip(jobs, runs, strict=True)}


def _one_process(name: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The model trained on each whole minibatch, one update a minibatch (no microbatches)."""
    case = find_case(name)
    return reference_sync(CaseSpec(case, SEED), CaseData(case), steps=steps,  # type: ignore[arg-type]
                          minibatch=_RUN["minibatch"], seed=SEED, opt=sgd(_RUN["lr"]))


def test_the_stream_changes_length_and_its_last_minibatch_is_short() -> None:
    case = find_case("gpt2-varlen")
    shapes = [tuple(case.example(k, 8)[0]["input_ids"].shape) for k in range(_RUN["steps"])]
    assert len({s[1] for s in shapes}) > 10 and all(8 <= s[1] <= 64 for s in shapes)
    assert [s[0] for s in shapes] == [8 - SHORT_BY * (k == SHORT_STEP) for k in range(20)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_random_lengths_train_as_one_process(results: dict[tuple[str, str], Any],
                                             schedule: str) -> None:
    got = results["gpt2-varlen", schedule]
    assert got["schedule"] == schedule
    assert len(got["bounds"]) == (4 if schedule == "interleaved-1f1b" else 2)
    losses, state = _one_process("gpt2-varlen", _RUN["steps"])
    assert_matches(got, losses, state)
    assert_tied_equal("gpt2", got)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packed_documents_with_a_mask_train_as_one_process(
        results: dict[tuple[str, str], Any]) -> None:
    x, _ = find_case("gpt2-packed").example(1, 8)
    assert int((x["position_ids"] == 0).sum()) > 8  # documents restart inside the rows
    losses, state = _one_process("gpt2-packed", _PACKED_STEPS)
    assert_matches(results["gpt2-packed", "1f1b-flush"], losses, state)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_microbatches_without_padding_beside_padded_ones_train_as_one_process(
        results: dict[tuple[str, str], Any]) -> None:
    """Same shapes: the all-ones mask Hugging Face drops changes what a traced stage
    passes on, which variable_dims lets its messages say, in training and evaluation."""
    x, _ = find_case("gpt2-unpadded").example(0, 8)
    assert bool((x["attention_mask"][:4] == 0).any()) and bool(x["attention_mask"][4:].all())
    losses, state = _one_process("gpt2-unpadded", _UNPADDED_STEPS)
    got = results["gpt2-unpadded", "1f1b-flush"]
    assert_matches(got, losses, state)
    # evaluation too: a padded held-out minibatch, then one without padding
    case = find_case("gpt2-unpadded")
    model = case.build()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        held = [case.example(100 + j, _RUN["minibatch"]) for j in range(2)]
        want = sum(float(case.loss_fn(model(**x), y)) for x, y in held) / len(held)
    assert got["evaluated"] == pytest.approx(want, rel=1e-5)
