"""Models as people write them, trained through the Pipeline on 2 ranks, against the
single-process references: 1f1b-flush equals gradient accumulation, pipedream equals
the delayed-update rule (tests/runtime/reference.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime.reference import reference_pipedream, reference_sync, sgd

from dreampipe.api.checkpoint import load_model_state
from dreampipe.planning.plan import Plan
from dreampipe.runtime.processes import run_processes
from dreampipe.splitter.chain import split_layers

from .compare import assert_matches
from .model_workers import train_case
from .model_zoo import CASES, CaseData, CaseSpec, find_case, gpt2

__all__ = ["SEED", "TIED_KEYS", "assert_tied_equal", "with_aliases"]

SEED = 5
TIED_KEYS = {"tied": [("embed.weight", "head.weight")],
             "gpt2": [("transformer.wte.weight", "lm_head.weight")],
             "t5": [("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")],
             "alias": [("lin1.weight", "lin1.weight"), ("lin1.bias", "lin1.bias")],
             "tied-llama": [("model.embed_tokens.weight", "lm_head.weight")],
             "twice-tied": [("embed.weight", "proj.weight"), ("embed.weight", "head.weight"),
                            ("block0.weight", "block1.weight")]}


def assert_tied_equal(name: str, got: dict[str, Any]) -> None:
    """The copies of each weight tied across the cut, and every name of one tensor of the
    model (T5's ``shared``, an alias), are equal, bit for bit."""
    for a, b in TIED_KEYS.get(name, []):
        torch.testing.assert_close(got["state"][a], got["state"][b], rtol=0, atol=0)
    for keys in _names(name):
        for key in keys[1:]:
            torch.testing.assert_close(got["state"][key], got["state"][keys[0]], rtol=0, atol=0)


def _names(name: str) -> list[list[str]]:
    """The model's state-dict keys grouped by the tensor they name."""
    names: dict[int, list[str]] = {}
    for key, t in find_case(name).build().state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(key)
    return list(names.values())


def with_aliases(name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference's stages' state with each tensor under every name the model gives it."""
    out = dict(state)
    for keys in _names(name):
        held = next((k for k in keys if k in state), None)
        out.update({k: state[held] for k in keys if held is not None})
    return out


def _run(**job: Any) -> dict[str, Any]:
    out = run_processes(train_case, 2, {"seed": SEED, **job}, deadline_s=90.0)
    assert isinstance(out[0], dict)
    return out[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_1f1b_flush_of_a_model_split_at_its_modules_equals_one_process(name: str) -> None:
    got = _run(case=name, schedule="1f1b-flush", steps=3, minibatch=8, microbatches=2, lr=0.1)
    spec = CaseSpec(CASES[name], SEED)
    assert got["bounds"][1] > 0
    losses, state = reference_sync(spec, CaseData(CASES[name]), steps=3,  # type: ignore[arg-type]
                                   minibatch=8, seed=SEED, opt=sgd(0.1), microbatches=2)
    assert_matches(got, losses, state)
    assert_tied_equal(name, got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_pipedream_of_a_model_split_at_its_modules_follows_the_delayed_updates(
    name: str
) -> None:
    got = _run(case=name, schedule="pipedream", steps=4, minibatch=8, lr=0.1, momentum=0.9)
    spec = CaseSpec(CASES[name], SEED, microbatch=8)
    losses, state = reference_pipedream(
        spec, CaseData(CASES[name]), bounds=got["bounds"], replicas=[1, 1],  # type: ignore[arg-type]
        steps=4, minibatch=8, seed=SEED, opt=sgd(0.1, 0.9), compensate=True,
        ties=[[(0, a), (1, b)] for a, b in TIED_KEYS.get(name, [])])
    assert_matches(got, losses, with_aliases(name, state))
    assert_tied_equal(name, got)


@pytest.mark.timeout(120)
def test_a_tied_model_laid_in_reverse_keeps_its_copies_tied() -> None:
    """Stage 0 on worker 1 and stage 1 on worker 0: the tie's group and the copy every
    copy starts from (built on meta, each copy draws its own) follow the workers the plan
    lays the stages on, so the run equals the one in rank order."""
    case = find_case("tied")
    names = [n for n, _ in split_layers(case.build(), case.example(0, 1)[0])]
    plan = Plan.from_config(len(names), [0, names.index(case.split_points[0])], [1, 1])
    laid = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, workers=(1 - s,)) for s, st in enumerate(plan.stages)))
    got, want = (_run(case="tied", plan=p, meta=True, schedule="1f1b-flush", steps=3,
                      minibatch=8, microbatches=2, lr=0.1) for p in (laid, plan))
    assert_matches(got, want["losses"], want["state"])
    assert_tied_equal("tied", got)


@pytest.mark.timeout(120)
def test_a_checkpoint_of_gpt2_resumes_bit_for_bit_and_loads_into_a_fresh_model(
    tmp_path: Path
) -> None:
    got = _run(case="gpt2", schedule="1f1b-flush", steps=3, minibatch=8, lr=0.2,
               save=str(tmp_path))
    saved = load_model_state(got["saved"])
    torch.testing.assert_close(saved["lm_head.weight"], saved["transformer.wte.weight"],
                               rtol=0, atol=0)
    resumed = _run(case="gpt2", schedule="1f1b-flush", steps=1, minibatch=8, lr=0.2,
                   resume=str(tmp_path))
    straight = _run(case="gpt2", schedule="1f1b-flush", steps=4, minibatch=8, lr=0.2)
    assert resumed["losses"] == straight["losses"][3:]
    for k, v in straight["state"].items():
        torch.testing.assert_close(resumed["state"][k], v, rtol=0, atol=0, msg=k)
    loaded, trained, initial = gpt2(), gpt2(), gpt2()
    loaded.load_state_dict(saved, strict=True)
    trained.load_state_dict(got["state"], strict=True)
    x = CASES["gpt2"].example(50, 4)[0]
    with torch.no_grad():
        logits = loaded(**x).logits
        torch.testing.assert_close(logits, trained(**x).logits, rtol=0, atol=0)
        assert not torch.allclose(logits, initial(**x).logits)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["tied", "bert", "pairs"])
def test_plan_auto_profiles_and_plans_a_traced_model(name: str) -> None:
    # whatever the plan, the first minibatch runs on the initial weights (no BatchNorm here)
    got = _run(case=name, plan="auto", schedule="1f1b-flush", steps=2, minibatch=8, lr=0.2)
    assert got["bounds"][0] == 0
    spec = CaseSpec(CASES[name], SEED)
    losses, _ = reference_sync(spec, CaseData(CASES[name]), steps=1,  # type: ignore[arg-type]
                               minibatch=8, seed=SEED, opt=sgd(0.2))
    assert got["losses"][0] == pytest.approx(losses[0], rel=1e-5)
    assert math.isfinite(got["losses"][1])


@pytest.mark.timeout(120)
def test_gpt2_built_on_meta_starts_its_tied_copies_equal_on_both_stages() -> None:
    got = _run(case="gpt2", meta=True, schedule="1f1b-flush", steps=2, minibatch=8, lr=0.2)
    wte, head = got["state"]["transformer.wte.weight"], got["state"]["lm_head.weight"]
    torch.testing.assert_close(head, wte, rtol=0, atol=0)
    assert all(torch.isfinite(v).all() for v in got["state"].values() if v.is_floating_point())
    assert all(math.isfinite(v) for v in got["losses"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_evaluate_runs_the_model_as_it_is_on_held_out_minibatches(name: str) -> None:
    got = _run(case=name, schedule="1f1b-flush", steps=2, minibatch=8, microbatches=2, lr=0.2,
               evaluate=2)
    case = CASES[name]
    model = CaseSpec(case, SEED).model()
    model.load_state_dict(got["state"], strict=True)
    model.eval()
    with torch.no_grad():
        want = [float(case.loss_fn(model(**x), y)) for x, y in
                (case.example(100 + j, 8) for j in range(2))]
    assert got["evaluated"] == pytest.approx(sum(want) / len(want), rel=1e-5)
