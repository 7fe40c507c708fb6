"""Pipelines train in every precision as one process in that precision does, under
``torchrun`` on 3 ranks: a tiny Llama cut ``2-1`` and a GPT-2 with a tied head cut ``1-2``,
so that one stage is replicated, and the Llama interleaved, 2 stages a rank, on 3 ranks
and, as both models are, on a replicated position (``2-1``, ``1-2``); GPT-2 also
clipped by the global norm, its tied head on the replicated stage (sharded or not). On 4
ranks, both run as 2 copies of a pipeline of 2 stages a rank, GPT-2's tie across them.

Tolerances. fp32: the suite's (:mod:`.compare`). 16-bit: the run may differ from one
process in that precision by that precision's rounding, which a pipeline meets in other
places (stage boundaries cross in 16 bits; replicas sum 16-bit gradients); the test
states it as *no further from the 16-bit process than 3 times that process's distance
from fp32* (an fp32 process that skips the same updates), tensor by tensor and over the
losses, with fp32's tolerance added. So that the bound can fail, each compared tensor
must have moved in training by twice it: a weight that lost its gradient is caught.

Zero bubble's ``W`` is checked under both bf16 precisions: under autocast a ``Linear``
takes autograd's path instead of the fused one, and its weight gradient must still reach
``W`` (it was once dropped). fp16-mixed starts its loss scale between 1x and 2x the
scale at which the first update's gradients overflow (found with the reference), so
that update is skipped on every stage and the scale halved, as ``torch.amp.GradScaler``
does in one process.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime.reference import adam, reference_sync, sgd
from runtime.reference_formats import FormatsRun, reference_formats
from torchrun import torchrun_json

from .compare import ATOL, assert_matches, assert_within_rounding, distance
from .model_zoo import CASES, CaseData, CaseSpec
from .test_pipeline_models import SEED, assert_tied_equal

__all__: list[str] = []

_STEPS, _MINIBATCH, _MICRO = 3, 8, 2
_PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16-mixed")
#: Interleaving over 3 ranks takes a multiple of 3 microbatches (as Megatron-LM).
_SIZES = {"interleaved-1f1b": (12, 3)}
_CONFIG = {"llama": "2-1", "gpt2": "1-2"}
_LR = {"sgd": 0.5, "adam": 0.01}
#: (model, schedule, precision, optimizer)
_JOBS = [
    *((name, "1f1b-flush", precision, "sgd") for name in ("llama", "gpt2")
      for precision in _PRECISIONS),
    *((name, schedule, precision, "sgd") for name in ("llama", "gpt2")
      for schedule in ("zb-h1", "zb-h2") for precision in ("bf16-mixed", "bf16")),
    ("llama", "interleaved-1f1b", "bf16", "sgd"),
]
#: Interleaving runs 6 stages, 2 on each rank, one stage a layer.
_INTERLEAVED = {
    "llama": ["model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
}


def _placed(name: str, schedule: str) -> dict[str, Any]:
    """Where a job's stages run: 2 per rank when interleaved, else ``_CONFIG``'s replicas."""
    if schedule == "interleaved-1f1b":
        return {"split_points": _INTERLEAVED[name], "virtual_stages": 2}
    return {"config": _CONFIG[name]}
_IDS = [f"{n}-{s}-{p}-{o}" for n, s, p, o in _JOBS]
#: Jobs that recompute the first block of each stage: (model, schedule, precision).
_RECOMPUTING = [("llama", "1f1b-flush", "fp32"), ("gpt2", "zb-h1", "bf16")]
#: Jobs whose replicated stage shards over its replicas: (model, schedule, precision, level).
#: GPT-2's replicated stage holds the tied head: from level 2 its chunks of the head's
#: gradient are gathered whole to add the embedding's, then cut again.
_SHARDED = [
    *((name, "1f1b-flush", precision, level) for name in ("llama", "gpt2")
      for precision in _PRECISIONS for level in (1, 2, 3)),
    *((name, "zb-h1", "bf16", 1) for name in ("llama", "gpt2")),
]
#: GPT-2's fp32 1f1b-flush jobs clipped by the global norm at this ZeRO level: the tied head
#: on the replicated stage is summed with the embedding first and counted once.
_CLIPPED, _CLIP = (0, 2), 0.5
#: fp32 jobs with Adam at each ZeRO level, whose peaks each level lowers: (model, level).
_ADAM_LEVELS = [(name, level) for name in ("llama", "gpt2") for level in range(4)]
#: Copies of a pipeline (PP x DP), a launch of 4 ranks: the Llama (and GPT-2, its embedding
#: on stage 0 tied to its head on stage 3, the other copy's rank) cut in 4 stages, each on
#: 2 replicas, 2 stages a rank; each copy runs half of every update's microbatches, which
#: interleaving over its 2 ranks takes in pairs. (model, schedule, precision, ZeRO level).
_COPIES = [("llama", "interleaved-1f1b", "bf16", 1), ("llama", "zbv", "fp32", 0),
           ("gpt2", "interleaved-1f1b", "bf16", 1)]
_COPIES_SIZES = (_MINIBATCH, 4)
_COPIES_CUTS = {"llama": ["model.layers.0", "model.layers.1", "model.norm"],
                "gpt2": ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]}
#: Interleaving on a replicated position, in the 3-rank launch: the Llama's stages 0 and 2
#: on ranks 0 and 1 and stages 1 and 3 on rank 2 (positions ``2-1``), GPT-2's the other way
#: (``1-2``, its head on the replicated position, tied to the embedding on rank 0), cut as
#: the copies are; bf16 with ZeRO-1 over the replicated position's ranks. (model, config).
_REPLICATED = [("llama", "2-1"), ("gpt2", "1-2")]
#: The copies' schedule whose (fp32) job is clipped by the global norm to ``_CLIP``: its
#: rank 0 holds stages 0 and 3, whose norm its first ``STEP`` takes, both reduced first.
_COPIES_CLIPPED = "zbv"


def _reference(name: str, precision: str, optimizer: str, loss_scale: float = 2.0**16,
               skip: tuple[int, ...] = (), schedule: str = "",
               sizes: tuple[int, int] | None = None, device: str = "cpu") -> FormatsRun:
    minibatch, micro = sizes or _SIZES.get(schedule, (_MINIBATCH, _MICRO))
    return _one_process(name, precision, optimizer, loss_scale, tuple(skip), minibatch, micro,
                        device)


@cache
def _one_process(name: str, precision: str, optimizer: str, loss_scale: float,
                 skip: tuple[int, ...], minibatch: int, micro: int,
                 device: str = "cpu") -> FormatsRun:
    """:func:`_reference`'s run, computed once a module: the tests only read it, and most
    16-bit jobs compare against the same fp32 run."""
    factory = adam if optimizer == "adam" else sgd
    return reference_formats(CaseSpec(CASES[name], SEED), CaseData(CASES[name]),  # type: ignore[arg-type]
                             steps=_STEPS, minibatch=minibatch, seed=SEED,
                             opt=factory(_LR[optimizer]), microbatches=micro,
                             precision=precision, loss_scale=loss_scale, skip=skip,
                             device=device)


@cache
def _clipped(name: str, minibatch: int, micro: int
             ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One fp32 process with SGD clipped by the global norm to ``_CLIP``, which every
    update's norm exceeds (checked): its losses and final state."""
    case, norms = CASES[name], []
    losses, state = reference_sync(CaseSpec(case, SEED), CaseData(case), steps=_STEPS,  # type: ignore[arg-type]
                                   minibatch=minibatch, seed=SEED, opt=sgd(_LR["sgd"]),
                                   microbatches=micro, max_grad_norm=_CLIP, norms=norms)
    assert min(norms) > _CLIP, norms  # every update clipped
    return losses, state


@cache
def _overflowing_scale(name: str, device: str = "cpu") -> float:
    """A loss scale about sqrt(2) times the least at which the first update overflows in
    fp16 (bisected on the reference's first update on ``device``), so it overflows once
    and its half does not."""
    def skips(scale: float) -> bool:
        return bool(reference_formats(
            CaseSpec(CASES[name], SEED), CaseData(CASES[name]),  # type: ignore[arg-type]
            steps=1, minibatch=_MINIBATCH, seed=SEED, opt=sgd(_LR["sgd"]),
            microbatches=_MICRO, precision="fp16-mixed", loss_scale=scale,
            device=device).skipped)

    low, high = 8.0, 40.0  # log2 of scales that do not and do overflow
    assert not skips(2.0**low) and skips(2.0**high)
    while high - low > 0.1:  # 9 halvings: within 2**0.1 of the least, so 1.41x-1.52x it
        mid = (low + high) / 2
        low, high = (low, mid) if skips(2.0**mid) else (mid, high)
    return float(2.0 ** (high + 0.5))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("precision")
    jobs = [{"case": name, "seed": SEED, "schedule": schedule, "steps": _STEPS, "measure": True,
             **dict(zip(("minibatch", "microbatches"),
                        _SIZES.get(schedule, (_MINIBATCH, _MICRO)), strict=True)),
             "lr": _LR[opt],
             "optimizer": opt, "precision": precision, **_placed(name, schedule),
             **({"loss_scale": _overflowing_scale(name)} if precision == "fp16-mixed" else {})}
            for name, schedule, precision, opt in _JOBS]
    jobs += [{**jobs[_JOBS.index((name, schedule, precision, "sgd"))], "recompute_blocks": 1}
             for name, schedule, precision in _RECOMPUTING]
    jobs += [{**jobs[_JOBS.index((name, schedule, precision, "sgd"))], "zero": level}
             for name, schedule, precision, level in _SHARDED]
    jobs += [{**jobs[_JOBS.index(("gpt2", "1f1b-flush", "fp32", "sgd"))], "zero": level,
              "max_grad_norm": _CLIP} for level in _CLIPPED]
    jobs += [{**jobs[_JOBS.index((name, "1f1b-flush", "fp32", "sgd"))], "zero": level,
              "optimizer": "adam", "lr": _LR["adam"]} for name, level in _ADAM_LEVELS]
    jobs += [{"case": name, "seed": SEED, "schedule": "interleaved-1f1b", "steps": _STEPS,
              "measure": True, "minibatch": _COPIES_SIZES[0],
              "microbatches": _COPIES_SIZES[1], "lr": _LR["sgd"], "optimizer": "sgd",
              "precision": "bf16", "zero": 1, "split_points": _COPIES_CUTS[name],
              "virtual_stages": 2, "copies": _positions(config)}
             for name, config in _REPLICATED]
    out = folder / "results.pt"
    got = torchrun_json(Path(__file__).with_name("models_script.py"), str(out),
                        json.dumps(jobs), nproc=3, timeout_s=280.0)
    assert got == {"jobs": len(jobs)}
    runs: list[dict[str, Any]] = torch.load(out, weights_only=False)
    return runs


def _positions(config: str) -> list[int]:
    """Each of 4 stages' replicas, 2 stages a rank: its position's in ``config``."""
    return [int(r) for r in config.split("-")] * 2


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("copies") / "results.pt"
    jobs = [{"case": name, "seed": SEED, "schedule": schedule, "steps": _STEPS,
             "measure": True, "minibatch": _COPIES_SIZES[0], "microbatches": _COPIES_SIZES[1],
             "lr": _LR["sgd"], "optimizer": "sgd", "precision": precision, "zero": level,
             "split_points": _COPIES_CUTS[name], "virtual_stages": 2, "copies": 2,
             **({"max_grad_norm": _CLIP} if schedule == _COPIES_CLIPPED else {})}
            for name, schedule, precision, level in _COPIES]
    got = torchrun_json(Path(__file__).with_name("models_script.py"), str(out),
                        json.dumps(jobs), nproc=4, timeout_s=200.0)
    assert got == {"jobs": len(jobs)}
    runs: list[dict[str, Any]] = torch.load(out, weights_only=False)
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(_COPIES)), ids=["-".join(map(str, c)) for c in _COPIES])
def test_copies_of_a_pipeline_train_as_one_process(copies: list[dict[str, Any]],
                                                   index: int) -> None:
    """2 copies of a 2-rank pipeline of 2 stages a rank equal one process in the run's
    precision (ZeRO-1 sharding each stage's optimizer state over its 2 replicas), and each
    rank's peak, its two stages', is within 15% of the prediction: interleaving's only, as
    zbv's prediction misses the rank at the V's turn by more, with or without copies.
    GPT-2's tied embedding and head, on ranks of different positions, stay bit-equal and
    train as one process's weight: each position's first replica adds its replicas' sum.
    zbv's job is clipped by the global norm of every update, as one process clips."""
    name, schedule, precision, level = _COPIES[index]
    got = copies[index]
    assert got["schedule"] == schedule and got["replicas"] == [2] * 4
    assert got["sharded"] == [level > 0] * 4
    assert_tied_equal(name, got)
    if schedule == _COPIES_CLIPPED:  # in fp32
        assert precision == "fp32"
        assert_matches(got, *_clipped(name, *_COPIES_SIZES))
    else:  # in 16 bits
        ref = _reference(name, precision, "sgd", sizes=_COPIES_SIZES)
        start = {k: v.detach().clone() for k, v in CaseSpec(CASES[name], SEED).model()
                 .state_dict().items()}
        fp32 = _reference(name, "fp32", "sgd", sizes=_COPIES_SIZES)
        assert_within_rounding(got, (ref.losses, ref.state), (fp32.losses, fp32.state), start)
    assert [stage for stage, _, _ in got["memory"]] == [0, 0, 1, 1]
    if schedule == "interleaved-1f1b":
        for rank, (_, measured, predicted) in enumerate(got["memory"]):
            assert predicted > 10_000, rank
            assert _MEMORY_BOUNDS[0] <= measured / predicted <= _MEMORY_BOUNDS[1], (
                rank, measured, predicted)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(_JOBS)), ids=_IDS)
def test_a_precision_trains_as_one_process_in_it(runs: list[dict[str, Any]],
                                                 index: int) -> None:
    name, schedule, precision, opt = _JOBS[index]
    got = runs[index]
    assert got["schedule"] == schedule
    assert got["replicas"] == ([1] * 6 if schedule == "interleaved-1f1b"
                               else [int(r) for r in _CONFIG[name].split("-")])
    scale = _overflowing_scale(name) if precision == "fp16-mixed" else 2.0**16
    ref = _reference(name, precision, opt, scale, schedule=schedule)
    assert_tied_equal(name, got)
    if precision == "fp32":
        assert_matches(got, ref.losses, ref.state)
        return
    start = {k: v.detach().clone() for k, v in CaseSpec(CASES[name], SEED).model()
             .state_dict().items()}
    fp32 = _reference(name, "fp32", opt, skip=tuple(ref.skipped), schedule=schedule)
    assert_within_rounding(got, (ref.losses, ref.state), (fp32.losses, fp32.state), start)
    if precision == "fp16-mixed":
        assert ref.skipped == [0]
        assert got["skipped"] == [0]  # every stage skipped the overflowing update


def test_the_16_bit_references_differ_from_fp32() -> None:
    """Each 16-bit reference computes in 16 bits (its bound is not fp32's rounding)."""
    fp32 = _reference("llama", "fp32", "adam").state
    for precision in ("bf16-mixed", "bf16", "fp16-mixed"):
        other = _reference("llama", precision, "adam").state
        assert max(distance(other, fp32).values()) > 10 * ATOL, precision


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(_RECOMPUTING)),
                         ids=["-".join(job) for job in _RECOMPUTING])
def test_recomputing_blocks_trains_the_same_weights_bit_for_bit(runs: list[dict[str, Any]],
                                                                index: int) -> None:
    """Each stage recomputes its first block (a stage of none recomputes nothing): the
    same weights as without, bit for bit, in any precision (the same kernels again)."""
    name, schedule, precision = _RECOMPUTING[index]
    again = runs[len(_JOBS) + index]
    plain = runs[_JOBS.index((name, schedule, precision, "sgd"))]
    assert again["recomputes"] == 1 and plain["recomputes"] == 0  # rank 0's stage: 1 block
    assert again["losses"] == plain["losses"]
    for k, v in plain["state"].items():
        torch.testing.assert_close(again["state"][k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(_SHARDED)),
                         ids=["-".join(map(str, job)) for job in _SHARDED])
def test_a_sharded_replicated_stage_trains_as_the_unsharded_one(runs: list[dict[str, Any]],
                                                                index: int) -> None:
    """ZeRO levels 1, 2 and 3 shard the optimizer's state (and the gradients, and the
    weights between updates) of the replicated stage; every chunk is stepped as the whole
    tensor would be and level 3's gathers rebuild the weights exactly, so the weights are
    the unsharded run's bit for bit (which equals one process, above), fp16's skip
    included."""
    name, schedule, precision, _ = _SHARDED[index]
    sharded = runs[len(_JOBS) + len(_RECOMPUTING) + index]
    plain = runs[_JOBS.index((name, schedule, precision, "sgd"))]
    # the replicated stage's ranks: 0 and 1 (Llama 2-1) or 1 and 2 (GPT-2 1-2)
    assert sharded["sharded"] == [name == "llama", True, name == "gpt2"]
    assert not any(plain["sharded"])
    assert sharded["losses"] == plain["losses"] and sharded["skipped"] == plain["skipped"]
    for k, v in plain["state"].items():
        torch.testing.assert_close(sharded["state"][k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(_REPLICATED)),
                         ids=["-".join(job) for job in _REPLICATED])
def test_interleaving_on_a_replicated_position_trains_as_one_process(
        runs: list[dict[str, Any]], index: int) -> None:
    """Interleaved 1F1B on 3 ranks, 2 stages a rank, one position on 2 ranks: each of its
    replicas runs its microbatches of the position's order, ZeRO-1 sharding both its stages'
    optimizer state over them; in bf16 it equals one process within that precision's
    rounding, GPT-2's tied embedding and head (summed once over the head's replicas) too.
    Each rank's peak is checked beside its prediction with the other jobs'."""
    name, config = _REPLICATED[index]
    got = runs[len(runs) - len(_REPLICATED) + index]
    replicated = config.split("-").index("2")  # the replicated position
    assert got["schedule"] == "interleaved-1f1b" and got["replicas"] == _positions(config)
    assert got["sharded"] == [replicated == 0, True, replicated == 1]
    assert [stage for stage, _, _ in got["memory"]] == ([0, 0, 1] if replicated == 0
                                                        else [0, 1, 1])
    assert_tied_equal(name, got)
    ref = _reference(name, "bf16", "sgd", sizes=_COPIES_SIZES)
    fp32 = _reference(name, "fp32", "sgd", sizes=_COPIES_SIZES)
    start = {k: v.detach().clone() for k, v in CaseSpec(CASES[name], SEED).model()
             .state_dict().items()}
    assert_within_rounding(got, (ref.losses, ref.state), (fp32.losses, fp32.state), start)


#: How far a rank's measured peak may be from its prediction in these runs: the issue's
#: 15%, on stages of tens of kilobytes (a tiny Llama's block keeps 28 KB a microbatch) as
#: on stages of megabytes (docs/memory.md). At this size a message's pack header outweighs
#: its data; the prediction counts it exactly.
_MEMORY_BOUNDS = (0.85, 1.15)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_rank_peaks_near_its_prediction(runs: list[dict[str, Any]]) -> None:
    """Each rank's tensors' peak (measured as the run trained) beside its stages'
    prediction, in every run: each precision, schedule (a split backward keeps a
    microbatch's tensors until its ``W``; an interleaved rank runs two stages, one of
    them of a few hundred bytes), sharding level and recomputation; where two ranks run
    one stage, both."""
    jobs = [job[:3] for job in _JOBS] + list(_RECOMPUTING) + [job[:3] for job in _SHARDED] \
        + [("gpt2", "1f1b-flush", "fp32")] * len(_CLIPPED) \
        + [(name, "1f1b-flush", "fp32") for name, _ in _ADAM_LEVELS] \
        + [(name, "interleaved-1f1b", "bf16") for name, _ in _REPLICATED]
    assert len(jobs) == len(runs)
    far, checked = [], 0
    for (name, schedule, precision), run in zip(jobs, runs, strict=True):
        for rank, (stage, measured, predicted) in enumerate(run["memory"]):
            assert predicted > 10_000 and measured > 10_000, (name, rank)
            checked += 1
            ratio = measured / predicted
            if not _MEMORY_BOUNDS[0] <= ratio <= _MEMORY_BOUNDS[1]:
                far.append(f"{name} {schedule} {precision} rank {rank} (stage {stage}): "
                           f"{measured} B measured, {predicted} B predicted ({ratio:.2f}x)")
    assert checked == 3 * len(runs)
    assert not far, "\n".join(far)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("level", _CLIPPED)
def test_clipping_counts_a_tie_on_a_replicated_stage_once(runs: list[dict[str, Any]],
                                                          level: int) -> None:
    """GPT-2 cut ``1-2``: the replicated stage's head (its replicas' sum, or at level 2
    their chunks gathered whole) is added to the embedding's gradient before the global
    norm, which counts the weight once, as ``clip_grad_norm_`` on one process does."""
    got = runs[len(_JOBS) + len(_RECOMPUTING) + len(_SHARDED) + _CLIPPED.index(level)]
    assert got["sharded"] == [False, level > 0, level > 0]
    assert_matches(got, *_clipped("gpt2", _MINIBATCH, _MICRO))
    assert_tied_equal("gpt2", got)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_each_sharding_level_lowers_the_peak_by_the_predicted_amount(
        runs: list[dict[str, Any]], name: str) -> None:
    """fp32 with Adam on the stage replicated 2 ways: between updates it keeps 16 bytes a
    parameter, of which levels 1, 2 and 3 save a quarter, three eighths and a half
    (``tests/runtime/test_zero.py``). At the peak each keeps some of it whole (level 2 a
    bucket on its way and one filling, level 3 the weights in use), as the prediction
    counts: each level lowers every replica's measured peak by its predicted saving,
    within 15% of the unsharded peak. On stages of two layers those whole buckets and
    that layer hold about what the level saves, so only level 1 must save for sure."""
    first = len(runs) - len(_ADAM_LEVELS) - len(_REPLICATED)
    levels = {level: runs[first + _ADAM_LEVELS.index((name, level))] for level in range(4)}
    replicas = [0, 1] if name == "llama" else [1, 2]
    assert [levels[3]["sharded"][r] for r in replicas] == [True, True]
    for rank in replicas:
        _, measured0, predicted0 = levels[0]["memory"][rank]
        for level in (1, 2, 3):
            _, measured, predicted = levels[level]["memory"][rank]
            saved, predicted_saving = measured0 - measured, predicted0 - predicted
            assert predicted_saving > 0 or level > 1, (level, predicted0, predicted)
            assert abs(saved - predicted_saving) <= 0.15 * predicted0, (
                f"level {level}, rank {rank}: saved {saved} B, predicted {predicted_saving} B")
