"""Checkpoints of a Pipeline with ``torch.distributed.checkpoint`` (DCP).

Keys are the original model's names (``model.<fqn>``, ``buffer.<fqn>`` for buffers a
state dict leaves out, ``optim.<fqn>.<name>``, ``param.<fqn>``, ``progress``: the
minibatches, the RNG and fp16-mixed's loss scale, ``rng.<rank>``), so a checkpoint loads
into any plan and into the plain model (:func:`load_model_state`). A rank writes and
reads the entries of every stage it runs (:mod:`.stage_checkpoint`); a run resumed on other
delays takes its own staleness compensation
(:func:`~dreampipe.runtime.staleness.carry_over`).

A save is atomic: a directory without the ``COMMITTED`` marker is never
loaded (:func:`partial` lists them); the marker also records the plan,
schedule and aliases (:func:`saved_plan`, :mod:`.state_keys`). The key
layout and the rules: docs/design.md §8.6.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from dreampipe.api.stage_checkpoint import (
    StagePart,
    load_stages,
    placeholder,
    restore_rng,
    rng_state,
    saved_names,
    stage_state,
    targets,
)
from dreampipe.errors import CheckpointError, PlanError
from dreampipe.planning.plan import Plan
from dreampipe.runtime.engine import RankRunner
from dreampipe.runtime.staleness import Applied
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.splitter.chain import Chain, Layers
from dreampipe.splitter.state_keys import StateKeys


class _PipelineState(Protocol):
    """What a checkpoint reads of a :class:`~dreampipe.api.pipeline.Pipeline` (which
    saves and loads through this module, so it is not imported here)."""

    minibatches: int
    device: torch.device
    kind: ScheduleKind
    plan: Plan
    state_keys: StateKeys
    schedulers: dict[int, Any]
    compensations: dict[int, Applied]
    compensation_delays: dict[int, int | None]
    tie_names: tuple[tuple[str, ...], ...]

    @property
    def runner(self) -> RankRunner: ...


__all__ = [
    "MARKER",
    "check_keys",
    "committed",
    "find",
    "latest",
    "load",
    "load_model_state",
    "minibatches_of",
    "partial",
    "restore_rng",
    "resume_note",
    "rng_state",
    "save",
    "saved_plan",
]

_log = logging.getLogger(__name__)

MARKER = "COMMITTED"
_STEP = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)(\.tmp)?$")
_LIST = 6


def committed(directory: Path) -> list[Path]:
    """The committed ``step-N`` checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir()
             and (m := _STEP.match(p.name)) and (p / MARKER).is_file()]
    return [p for _, p in sorted(found)]


def latest(directory: Path) -> Path | None:
    """The newest committed checkpoint in ``directory`` (checked whole), or None if none is."""
    done = committed(directory)
    if not done:
        return None
    _verify(done[-1])
    return done[-1]


def partial(directory: Path) -> list[Path]:
    """Saves in ``directory`` that never committed (``step-N.tmp``, ``step-N`` without marker)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if p.is_dir() and _PARTIAL.match(p.name) and not (
                      _STEP.match(p.name) and (p / MARKER).is_file()))


def find(path: Path) -> Path:
    """The checkpoint ``path`` names: itself if committed, else its newest committed step."""
    temporary = path.name.endswith(".tmp")
    if (path / MARKER).is_file() and not temporary:
        _verify(path)
        return path
    parent_done = committed(path.parent) if path.parent != path else []
    if path.is_dir() and (_STEP.match(path.name) or temporary):
        last = f"the last complete one is {parent_done[-1]}" if parent_done else (
            "there is no complete one beside it")
        raise CheckpointError(f"checkpoint {path} was never committed (no {MARKER} marker: the "
                              f"save did not finish); {last}")
    done = committed(path)
    if not done:
        raise CheckpointError(f"no complete checkpoint in {path}; save one with pipe.save(DIR) "
                              "(or --checkpoint-dir) first")
    _verify(done[-1])
    return done[-1]


def minibatches_of(path: Path) -> int:
    """The minibatches consumed when the committed checkpoint ``path`` was saved."""
    return int(json.loads((path / MARKER).read_text())["minibatches"])


def saved_plan(path: Path) -> Plan | None:
    """The plan that saved the committed checkpoint ``path`` (None if it did not record one)."""
    recorded = json.loads((path / MARKER).read_text()).get("plan")
    if recorded is None:
        return None
    try:
        return Plan.from_dict(recorded)
    except PlanError as exc:
        raise CheckpointError(f"checkpoint {path} records a plan dreampipe cannot read ({exc}); "
                              "it is damaged: resume from another one") from exc


def _verify(path: Path) -> None:
    sizes: dict[str, int] = json.loads((path / MARKER).read_text())["files"]
    for name, size in sizes.items():
        f = path / name
        got = f.stat().st_size if f.is_file() else None
        if got != size:
            older = [p for p in committed(path.parent) if p != path]
            hint = f"resume from {older[-1]}" if older else "save a new one"
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} is "
                f"{'missing' if got is None else f'{got} bytes'}, the commit recorded {size} "
                f"bytes (truncated or overwritten); {hint}")


def _metadata(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}; "
                              "it is damaged: resume from another one") from exc


def _brief(plan: Plan) -> str:
    stages = ", ".join(f"layers {st.first}..{st.last} x{st.replicas}" for st in plan.stages)
    n = plan.workers_used
    return f"{plan.config} ({stages}) on {n} worker{'s' if n > 1 else ''}"


def resume_note(path: Path, plan: Plan) -> str:
    """One line: where a run resumes, with the plan that saved and the plan that goes on."""
    old = saved_plan(path)
    if old is None:
        was = "saved by a plan it did not record"
    elif (old.num_layers, [(st.first, st.replicas) for st in old.stages]) == (
            plan.num_layers, [(st.first, st.replicas) for st in plan.stages]):
        was = f"on the same plan {_brief(plan)}"
    else:
        was = f"saved by plan {_brief(old)}, re-planned to {_brief(plan)}"
    return f"resuming from {path} at minibatch {minibatches_of(path)}, {was}"


def check_keys(path: Path, layers: Layers) -> None:
    """The checkpoint's weights must be the model's, by name and shape."""
    meta = _metadata(path)
    saved = {k[len("model."):]: v for k, v in meta.items() if k.startswith("model.")}
    model = Chain(layers).state_dict()
    missing = [k for k in model if k not in saved]
    unexpected = [k for k in saved if k not in model]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} is of another model: missing keys {missing[:_LIST]}"
            f"{'...' if len(missing) > _LIST else ''}, unexpected keys {unexpected[:_LIST]}"
            f"{'...' if len(unexpected) > _LIST else ''}; resume from a checkpoint of this model")
    for k, t in model.items():
        if tuple(saved[k].size) != tuple(t.shape):
            raise CheckpointError(f"checkpoint {path} holds {k} of shape {list(saved[k].size)}, "
                                  f"the model's is {list(t.shape)}; resume from a checkpoint of "
                                  "this model")


def _parts(pipe: _PipelineState) -> list[StagePart]:
    """Every stage this rank runs, with its scheduler and compensation."""
    first = pipe.runner.schedule.replica_of_rank(pipe.runner.rank) == 0
    return [StagePart(m, pipe.schedulers.get(m.stage), pipe.compensations[m.stage],
                      pipe.compensation_delays.get(m.stage), buffers=first)
            for m in pipe.runner.modules]


def _warn_newer(directory: Path, minibatches: int) -> None:
    """Warn where ``directory`` holds a committed checkpoint past ``minibatches``: another
    run's, most likely, which a resume from the folder would take over this save."""
    newer = [p.name for p in committed(directory) if int(p.name.split("-")[1]) > minibatches]
    if newer:
        message = (f"saving step-{minibatches} into {directory}, which holds {newer[-1]} "
                   "from another run: resuming from the folder takes the newest, so save "
                   "this run into a folder of its own")
        _log.warning("%s", message)
        warnings.warn(message, stacklevel=4)


def save(directory: Path, pipe: _PipelineState) -> Path:
    """Write ``directory/step-N`` atomically (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    final = directory / f"step-{pipe.minibatches}"
    tmp = directory / f"{final.name}.tmp"
    if dist.get_rank() == 0:
        _warn_newer(directory, pipe.minibatches)
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state = stage_state(_parts(pipe))
    scaler = pipe.runner.scaler  # fp16-mixed's loss scale, one for every rank
    state["progress"] = pickle.dumps({"minibatches": pipe.minibatches,
                                      "rng": torch.get_rng_state(),
                                      **({} if scaler is None else
                                         {"loss_scale": scaler.state_dict()})})
    state[f"rng.{dist.get_rank()}"] = pickle.dumps(rng_state(pipe.device))
    # a key several ranks hold is written by the lowest (rank 0's progress), not whichever
    # rank DCP's balancing of the writes would pick; a stage's buffers (BatchNorm's
    # statistics) only its first replica writes (StagePart.buffers)
    dcp_save(state, checkpoint_id=str(tmp),
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        sizes = {p.name: p.stat().st_size for p in final.iterdir() if p.is_file()}
        marker = final / f"{MARKER}.tmp"
        marker.write_text(json.dumps({"minibatches": pipe.minibatches, "files": sizes,
                                      "schedule": pipe.kind.value,
                                      "plan": pipe.plan.to_dict(),
                                      "keys": pipe.state_keys.to_dict()}))
        marker.rename(final / MARKER)
    dist.barrier()
    _log.info("saved checkpoint %s", final)
    return final


def load(path: Path, pipe: _PipelineState) -> int:
    """Load ``path`` into this rank's stages; the minibatches it had consumed."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    _log.info("%s", resume_note(path, pipe.plan))
    meta = _metadata(path)
    parts = _parts(pipe)
    names = saved_names(parts, meta, pipe.tie_names)
    state = targets(parts, meta, names)
    state["progress"] = ""
    mine = f"rng.{dist.get_rank()}"
    state.update({mine: ""} if mine in meta else {})
    try:
        dcp_load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path}: {type(exc).__name__}: "
                              f"{str(exc)[:300]}; resume from another one") from exc
    objects = {k: pickle.loads(v) for k, v in state.items() if isinstance(v, bytes)}
    pipe.compensations.update(load_stages(parts, state, objects, names))
    restore_rng(objects, dist.get_rank(), pipe.device)
    progress = objects["progress"]
    scaler = pipe.runner.scaler
    if scaler is not None and "loss_scale" in progress:  # else the config's initial scale
        scaler.load_state_dict(progress["loss_scale"])
    return int(progress["minibatches"])


def load_model_state(path: str | Path) -> dict[str, Tensor]:
    """The weights of a checkpoint as a plain ``state_dict`` (no process group needed)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    found = find(Path(path))
    meta = _metadata(found)
    state = {k: placeholder(md) for k, md in meta.items() if k.startswith("model.")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, checkpoint_id=str(found), no_dist=True)
    weights = {k[len("model."):]: v for k, v in state.items()}
    keys = json.loads((found / MARKER).read_text()).get("keys")
    return StateKeys.from_dict(keys).complete(weights) if keys is not None else weights
