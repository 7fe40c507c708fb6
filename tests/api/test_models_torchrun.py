"""Real models as they are, under ``torchrun --nproc-per-node 2``: Hugging Face's GPT-2
(tied embeddings, dict in, ``ModelOutput`` out, the embedding and the head on different
stages) and a torchvision-style ResNet (not an ``nn.Sequential``; its stem skips across
the cut to the head). 1f1b-flush equals one process, pipedream learns, and
``plan="auto"`` plans each model on its own (a synchronous plan of any shape equals one
process too).

Weights tied across stages train as one weight, against one process: interleaved 1F1B
(4 stages, 2 a rank) on GPT-2 and a Llama with tied embeddings (the tie across the ranks)
and on a model whose ties put two copies on one rank and a whole tie on one rank; and
clipping by the global norm, which must count a tied weight once, after its copies'
gradients are summed, in every schedule (zero bubble's after its ``W``), with a norm the
reference's updates all exceed, so that the clip acts. The V schedules, zbv and dualpipev
(4 stages, the first and the last on rank 0: both tied copies on one rank), on GPT-2 and
the tied Llama; dualpipev once more with each overlapped pair's backward on a thread of
its own while its forward runs."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime.reference import reference_pipedream, reference_sync, reference_two_bw, sgd
from torchrun import torchrun_json

from .compare import assert_matches, distance
from .model_zoo import CASES, ODD_CASES, CaseData, CaseSpec, find_case
from .test_pipeline_models import SEED, TIED_KEYS, assert_tied_equal, with_aliases

__all__: list[str] = []

_MODELS = ("gpt2", "resnet")
_FLUSH = {"schedule": "1f1b-flush", "steps": 3, "minibatch": 8, "microbatches": 2, "lr": 0.1}
_PIPEDREAM = {"schedule": "pipedream", "steps": 12, "minibatch": 8, "lr": 0.05,
              "momentum": 0.9, "cycle": 2}  # two minibatches again and again: learnable
_CLIP = 0.5
_CUT_GPT2 = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]  # 4 stages
#: Weights tied across stages: (case, schedule, clipped).
_TIED = [
    ("gpt2", "interleaved-1f1b", False),
    ("tied-llama", "interleaved-1f1b", False),
    ("twice-tied", "interleaved-1f1b", False),
    ("twice-tied", "interleaved-1f1b", True),
    *(("gpt2", schedule, True) for schedule in ("1f1b-flush", "zb-h1", "gpipe", "pipedream",
                                                 "2bw")),
    *((name, schedule, False) for name in ("gpt2", "tied-llama")
      for schedule in ("zbv", "dualpipev")),
]
#: The schedules of several stages a rank, and each one's microbatches (DualPipeV takes
#: at least one a stage).
_SEVERAL = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 4}


def _tied_job(name: str, schedule: str, clipped: bool) -> dict[str, Any]:
    job: dict[str, Any] = {"case": name, "seed": SEED, **_FLUSH, "schedule": schedule}
    if schedule in _SEVERAL:
        job.update(virtual_stages=2, microbatches=_SEVERAL[schedule],
                   split_points=_CUT_GPT2 if name == "gpt2" else find_case(name).split_points)
    if schedule == "pipedream":
        job.update(microbatches=1, steps=4)
    return {**job, "max_grad_norm": _CLIP} if clipped else job


def _jobs(folder: Path) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    for name in _MODELS:
        jobs += [{"case": name, "seed": SEED, **_FLUSH},
                 {"case": name, "seed": SEED, **_PIPEDREAM},
                 {"case": name, "seed": SEED, **_FLUSH, "plan": "auto"}]
    saved = str(folder / "counter")  # trained 2 minibatches, saved, resumed for 2 more
    jobs += [{"case": "counter", "seed": SEED, **_FLUSH, "steps": 2, "save": saved},
             {"case": "counter", "seed": SEED, **_FLUSH, "steps": 2, "resume": saved}]
    jobs += [job for name in ODD_CASES for job in (
        {"case": name, "seed": SEED, **_FLUSH}, {"case": name, "seed": SEED, **_PIPEDREAM,
                                                 "steps": 4})]
    return jobs + [_tied_job(*tied) for tied in _TIED] + [
        {**_tied_job("gpt2", "dualpipev", False), "at_once": True, "evaluate": 1}]


def _key(job: dict[str, Any]) -> tuple[str, str]:
    suffix = "-auto" if "plan" in job else "-clipped" if "max_grad_norm" in job else (
        "-resumed" if "resume" in job else "-saved" if "save" in job else
        "-at-once" if "at_once" in job else "")
    return job["case"], job["schedule"] + suffix


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    folder = tmp_path_factory.mktemp("models")
    out = folder / "results.pt"
    jobs = _jobs(folder)
    got = torchrun_json(Path(__file__).with_name("models_script.py"), str(out),
                        json.dumps(jobs), timeout_s=240.0)
    assert got == {"jobs": len(jobs)}
    runs = torch.load(out, weights_only=False)
    return {_key(job): run for job, run in zip(jobs, runs, strict=True)}


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    spec = CaseSpec(find_case(name), SEED)
    return reference_sync(spec, CaseData(find_case(name)), steps=_FLUSH["steps"],  # type: ignore[arg-type]
                          minibatch=_FLUSH["minibatch"], seed=SEED,
                          opt=sgd(_FLUSH["lr"]), microbatches=_FLUSH["microbatches"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", _MODELS)
def test_1f1b_flush_split_across_the_tie_or_the_skip_equals_one_process(
        results: dict[tuple[str, str], Any], name: str) -> None:
    got = results[name, "1f1b-flush"]
    assert got["bounds"][1] > 0  # two stages
    losses, state = _reference(name)
    assert_matches(got, losses, state)
    assert_tied_equal(name, got)  # the tie crosses the cut and holds


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(ODD_CASES))
def test_a_float64_model_or_a_stage_with_nothing_to_train_runs_as_one_process(
        results: dict[tuple[str, str], Any], name: str) -> None:
    """fp32 keeps a float64 model's activations float64 across the cut, and a first stage
    whose weights are all frozen runs no backward; 1f1b-flush equals one process, and
    pipedream keeps the weights' dtype and the frozen ones as they were."""
    got = results[name, "1f1b-flush"]
    assert got["bounds"][1] > 0
    losses, state = _reference(name)
    assert_matches(got, losses, state)
    async_run = results[name, "pipedream"]
    assert len(async_run["losses"]) == 4 and all(map(math.isfinite, async_run["losses"]))
    model = CaseSpec(find_case(name), SEED).model()
    for key, value in async_run["state"].items():
        start = model.state_dict()[key]
        assert value.dtype == start.dtype, key
        if name == "frozen" and key.startswith("0."):
            assert torch.equal(value, start), key


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", _MODELS)
def test_pipedream_across_the_cut_learns(results: dict[tuple[str, str], Any],
                                         name: str) -> None:
    got = results[name, "pipedream"]
    assert got["bounds"][1] > 0
    losses = got["losses"]
    assert len(losses) == _PIPEDREAM["steps"] and all(map(torch.isfinite, torch.tensor(losses)))
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    assert last < 0.9 * first, losses
    assert_tied_equal(name, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", _MODELS)
def test_an_auto_plan_of_the_model_as_it_is_trains_as_one_process(
        results: dict[tuple[str, str], Any], name: str) -> None:
    got = results[name, "1f1b-flush-auto"]
    losses, state = _reference(name)
    if max(got["replicas"]) > 1:  # a replicated stage: each replica keeps its own running
        # statistics (BatchNorm's), as under DDP; the weights and losses are one process's
        state = {k: v for k, v in state.items() if v.is_floating_point() and "running" not in k}
        got = {**got, "state": {k: got["state"][k] for k in state}}
    assert_matches(got, losses, state)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_buffers_the_forward_writes_survive_a_save_and_resume(
        results: dict[tuple[str, str], Any]) -> None:
    saved, resumed = results["counter", "1f1b-flush-saved"], results["counter",
                                                                      "1f1b-flush-resumed"]
    losses, state = reference_sync(
        CaseSpec(CASES["counter"], SEED), CaseData(CASES["counter"]), steps=4,  # type: ignore[arg-type]
        minibatch=_FLUSH["minibatch"], seed=SEED, opt=sgd(_FLUSH["lr"]),
        microbatches=_FLUSH["microbatches"])
    assert_matches({**resumed, "losses": saved["losses"] + resumed["losses"]}, losses, state)


def _tied_reference(name: str, schedule: str, clip: float | None, bounds: list[int]
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process's run of ``schedule``'s rule, each update clipped to ``clip`` (which
    every update's norm exceeds under the synchronous rule: checked)."""
    case = find_case(name)
    if schedule == "pipedream":
        return reference_pipedream(
            CaseSpec(case, SEED, microbatch=8), CaseData(case),  # type: ignore[arg-type]
            bounds=bounds, replicas=[1, 1], steps=4, minibatch=8, seed=SEED, opt=sgd(0.1),
            ties=[[(0, a), (1, b)] for a, b in TIED_KEYS[name]], max_grad_norm=clip)
    kw: dict[str, Any] = {"steps": 3, "minibatch": 8, "seed": SEED, "opt": sgd(0.1),
                          "microbatches": _SEVERAL.get(schedule, 2), "max_grad_norm": clip}
    if schedule == "2bw":
        return reference_two_bw(CaseSpec(case, SEED), CaseData(case), **kw)  # type: ignore[arg-type]
    norms: list[float] = []
    losses, state = reference_sync(CaseSpec(case, SEED), CaseData(case), norms=norms, **kw)  # type: ignore[arg-type]
    assert clip is None or min(norms) > clip, norms
    return losses, state


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", _TIED, ids=["-".join((c, s, "clipped" if clip else "plain"))
                                             for c, s, clip in _TIED])
def test_tied_copies_train_as_one_weight(results: dict[tuple[str, str], Any],
                                         tied: tuple[str, str, bool]) -> None:
    name, schedule, clipped = tied
    got = results[_key(_tied_job(*tied))]
    assert got["schedule"] == schedule
    assert len(got["bounds"]) == (4 if schedule in _SEVERAL else 2)
    losses, state = _tied_reference(name, schedule, _CLIP if clipped else None, got["bounds"])
    if clipped and schedule in ("pipedream", "2bw"):  # the clip acts (sync: norms checked)
        _, unclipped = _tied_reference(name, schedule, None, got["bounds"])
        assert max(distance(unclipped, state).values()) > 1e-3
    assert_matches(got, losses, with_aliases(name, state))
    assert_tied_equal(name, got)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dualpipev_with_each_pairs_halves_at_once_equals_one_process(
        results: dict[tuple[str, str], Any]) -> None:
    """The overlap hook runs every pair's backward on a thread while its forward runs; the
    trained model then evaluates a held-out minibatch through the V, as one process does."""
    got = results["gpt2", "dualpipev-at-once"]
    assert got["schedule"] == "dualpipev" and got["overlapped"] > 0
    losses, state = _tied_reference("gpt2", "dualpipev", None, got["bounds"])
    assert_matches(got, losses, with_aliases("gpt2", state))
    assert_tied_equal("gpt2", got)
    model = CaseSpec(CASES["gpt2"], SEED).model()
    model.load_state_dict(got["state"], strict=True)
    model.eval()
    with torch.no_grad():
        x, y = CASES["gpt2"].example(100, _FLUSH["minibatch"])
        want = float(CASES["gpt2"].loss_fn(model(**x), y))
    assert got["evaluated"] == pytest.approx(want, rel=1e-5)
