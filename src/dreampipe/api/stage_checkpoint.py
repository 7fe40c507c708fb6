"""What each stage a rank runs writes into a checkpoint, and how it reads it back.

A rank writes the entries of every stage it holds (several under
``virtual_stages``), each keyed by the original model's names
(:mod:`.checkpoint` lists the keys), so the stages that read them may be cut
otherwise. The weights of a stage split over workers, and their optimizer
state, are DTensors: DCP writes each worker's share once, and a load fills
whatever the reading stage holds, a whole tensor in an unsplit stage or this
worker's share in a split one, from the shares written (resharding). A stage under
ZeRO (:mod:`dreampipe.runtime.zero`) writes its optimizer state whole, gathered over its
replicas, and cuts what it reads to its shard, so any plan or ZeRO level reads it.
Buffers a state dict leaves out (``persistent=False``) are written too, as
``buffer.<fqn>``: a forward may change them (an average it keeps), and a resumed run
must start from them as the run went on; a checkpoint without them leaves them as built.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dreampipe.errors import CheckpointError
from dreampipe.runtime.stage_module import StageModule
from dreampipe.runtime.staleness import Applied, Hyper, carry_over

__all__ = ["StagePart", "load_stages", "placeholder", "restore_rng", "rng_state", "saved_names",
           "stage_state", "targets"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePart:
    """One stage of a rank: its module, its learning-rate scheduler (or None), what
    staleness compensation did to each parameter group of its optimizer, and the delay
    it compensates for (None: none)."""

    module: StageModule
    scheduler: Any
    compensation: Applied
    delay: int | None = None
    #: Whether this rank writes the stage's buffers: its first replica does, whose
    #: statistics full_state_dict and evaluate() take, wherever the plan lays it.
    buffers: bool = True


def _unsaved(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s buffers that its state dict leaves out (``persistent=False``), by name."""
    out: dict[str, Tensor] = {}
    for name, m in module.named_modules():
        for b in sorted(m._non_persistent_buffers_set):
            t = m._buffers.get(b)
            if t is not None:
                out.setdefault(f"{name}.{b}" if name else b, t)
    return out


def stage_state(parts: Sequence[StagePart]) -> dict[str, Any]:
    """The ``model.``, ``buffer.``, ``optim.`` and ``param.`` entries of ``parts``."""
    state: dict[str, Any] = {}
    for part in parts:
        module = part.module
        dropped = set() if part.buffers else {k for k, _ in module.module.named_buffers()}
        state.update({f"model.{k}": v for k, v in module.state_dict().items()
                      if k not in dropped})
        if part.buffers:
            state.update({f"buffer.{k}": v for k, v in _unsaved(module.module).items()})
        opt = module.optimizer
        sched = part.scheduler.state_dict() if part.scheduler is not None else None
        names = dict(zip(map(id, module.optimized), module.module_param_names, strict=True))
        groups = opt.param_groups if opt is not None else []
        index = {id(p): i for i, p in enumerate(module.optimized)}
        for group, applied in zip(groups, part.compensation, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                fqn = names[id(p)]
                per = opt.state.get(p, {}) if opt is not None else {}
                if module.zero is not None:  # whole tensors, gathered over the replicas
                    per = module.zero.gathered_state(index[id(p)], per)
                state.update({f"optim.{fqn}.{k}": v for k, v in per.items()
                              if isinstance(v, Tensor)})
                state[f"param.{fqn}"] = pickle.dumps({
                    "group": hyper, "scheduler": sched, "version": module.version,
                    "optimizer": type(opt).__name__,
                    "state": {k: v for k, v in per.items() if not isinstance(v, Tensor)},
                    "compensation": _plain(applied),
                })
    return state


def saved_names(parts: Sequence[StagePart], meta: dict[str, Any],
                tie_names: Sequence[Sequence[str]]) -> dict[str, str]:
    """The name each trainable parameter of ``parts`` has its optimizer entries under in
    the checkpoint (``meta``: its metadata): its own, or, for a weight tied across stages
    (``tie_names``: each tie's names) that the saving run held on one stage, the name it
    saved the weight under; a CheckpointError naming the fix where there is none."""
    ties = {name: names for names in tie_names for name in names}
    out: dict[str, str] = {}
    for part in parts:
        for fqn in part.module.module_param_names:
            found = [n for n in (fqn, *ties.get(fqn, ())) if f"param.{n}" in meta]
            if not found:
                raise CheckpointError(
                    f"the checkpoint holds no optimizer entry for parameter {fqn!r}: the "
                    "run that saved it froze it; resume with it frozen, or load the "
                    "weights alone (dreampipe.load_model_state) and train with a new "
                    "optimizer")
            out[fqn] = found[0]
    return out


def targets(parts: Sequence[StagePart], meta: dict[str, Any],
            names: dict[str, str]) -> dict[str, Any]:
    """Where DCP loads the saved entries (``meta``: the checkpoint's metadata; ``names``:
    :func:`saved_names`) of ``parts``: a tensor like the stage's own (a DTensor holds
    this worker's share), an empty string for a pickled entry."""
    out: dict[str, Any] = {}
    for part in parts:
        module = part.module
        out.update({f"model.{k}": torch.empty_like(v)
                    for k, v in module.state_dict().items()})
        out.update({f"buffer.{k}": torch.empty_like(v) for k, v in _unsaved(module.module).items()
                    if f"buffer.{k}" in meta and tuple(meta[f"buffer.{k}"].size) == v.shape})
        for p, fqn in zip(module.optimized, module.module_param_names, strict=True):
            out[f"param.{names[fqn]}"] = ""
            prefix = f"optim.{names[fqn]}."
            out.update({k: _like(md, p.detach()) for k, md in meta.items()
                        if k.startswith(prefix)})
    return out


def placeholder(md: Any) -> Any:
    """A whole CPU tensor for a saved entry of metadata ``md``, or "" for a pickled one."""
    size = getattr(md, "size", None)
    return "" if size is None else torch.empty(tuple(size), dtype=md.properties.dtype)


def _like(md: Any, param: Tensor) -> Any:
    """An optimizer state entry's target: shaped like ``param`` (a DTensor too, when
    ``param`` is one) if the saved entry has its shape, else a whole tensor."""
    size = getattr(md, "size", None)
    if size is not None and tuple(size) == tuple(param.shape):
        return torch.empty_like(param, dtype=md.properties.dtype)
    return placeholder(md)


def load_stages(parts: Sequence[StagePart], state: dict[str, Any],
                objects: dict[str, Any], names: dict[str, str]) -> dict[int, Applied]:
    """Put the loaded ``state`` (``objects``: its pickled entries, unpickled; ``names``:
    :func:`saved_names`) into each stage of ``parts``: weights, optimizer state and
    settings, version, scheduler; what staleness compensation did to each stage's groups
    now, by stage."""
    applied = {part.module.stage: part.compensation for part in parts}
    for part in parts:
        module = part.module
        module.load_state_dict({k: state[f"model.{k}"] for k in module.state_dict()})
        with torch.no_grad():
            for k, v in _unsaved(module.module).items():
                if f"buffer.{k}" in state:
                    v.copy_(state[f"buffer.{k}"])
        opt = module.optimizer
        made = type(opt).__name__
        for i, (p, fqn) in enumerate(zip(module.optimized, module.module_param_names,
                                         strict=True)):
            info = objects[f"param.{names[fqn]}"]
            if opt is not None and info.get("optimizer", made) != made:
                raise CheckpointError(
                    f"the checkpoint's {fqn} was trained with {info['optimizer']}, and this "
                    f"run's optimizer factory makes {made}: its state and settings do not "
                    "carry over; resume with the same optimizer, or load the weights alone "
                    "(dreampipe.load_model_state) and train with a new one")
            per: dict[str, Any] = dict(info["state"])
            prefix = f"optim.{names[fqn]}."
            per.update({k[len(prefix):]: v.to(p.device) for k, v in state.items()
                        if k.startswith(prefix)})
            if module.zero is not None:  # this replica's chunks of the whole tensors
                per = module.zero.sharded_state(i, per)
            if opt is not None and per:
                opt.state[p] = per
            module.resume_at(int(info["version"]))
        if opt is not None and module.module_param_names:
            applied[module.stage] = _settings(part, objects, names)
    return applied


def _settings(part: StagePart, objects: dict[str, Any], names: dict[str, str]) -> Applied:
    """Each parameter group takes the settings saved with its first parameter, with this
    run's staleness compensation in place of the saved one; the scheduler the first
    parameter's progress, and each group's own rates (the stage that saved it may have
    held other groups: another plan)."""
    module, opt = part.module, part.module.optimizer
    assert opt is not None
    fqns = {id(p): names[n] for p, n in zip(module.optimized, module.module_param_names,
                                            strict=True)}
    apart = set()  # what each parameter's saving stage had made of its rate and scheduler
    applied = []
    for group, now in zip(opt.param_groups, part.compensation, strict=True):
        saved = objects[f"param.{fqns[id(group['params'][0])]}"]
        for p in group["params"]:
            was = objects[f"param.{fqns[id(p)]}"]
            apart.add((was["group"].get("lr") == saved["group"].get("lr"),
                       (was["scheduler"] or {}).get("last_epoch")))
        group.update(saved["group"])
        if "compensation" in saved:  # in place: lr, initial_lr, the momentum
            now = carry_over(group, _hyper_pair(saved["compensation"]), now, part.delay)
        applied.append(now)
    first = objects[f"param.{names[module.module_param_names[0]]}"]
    sched = part.scheduler
    if sched is not None and first["scheduler"] is not None:
        sched.load_state_dict(first["scheduler"])
        sched.base_lrs = [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
        sched._last_lr = [g["lr"] for g in opt.param_groups]
    if len(apart) > 1:
        _log.warning(
            "stage %d holds parameters saved at other learning rates or scheduler steps than "
            "their group's first (pipedream's replicated stages update once a round of "
            "replicas, and so step their schedulers): each group goes on from its first "
            "parameter's", part.module.stage)
    return tuple(applied)


def _plain(applied: tuple[Hyper, Hyper] | None) -> list[dict[str, Any]] | None:
    """Compensation's ``(given, used)`` settings as plain data for the checkpoint."""
    return None if applied is None else [dataclasses.asdict(h) for h in applied]


def _hyper_pair(saved: list[dict[str, Any]] | None) -> tuple[Hyper, Hyper] | None:
    """:func:`_plain`'s inverse: None for a group compensation left as it was."""
    return None if saved is None else (Hyper(**saved[0]), Hyper(**saved[1]))


def rng_state(device: torch.device) -> dict[str, Tensor | None]:
    """The random state a rank on ``device`` draws from: the CPU generator's, and the CUDA
    generator's of ``device`` when it is a CUDA device (else None)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def restore_rng(objects: dict[str, Any], rank: int, device: torch.device) -> None:
    """Set this rank's generators from a checkpoint's unpickled ``objects``: its own
    ``rng.<rank>`` if saved, else seeded by a number drawn from rank 0's CPU state in
    ``progress`` plus the rank, so that ranks the saving run did not have (a resume on
    more replicas) draw streams of their own, not one shared (their dropout masks would
    repeat each other's). (:mod:`.checkpoint`'s docstring.)"""
    saved = objects.get(f"rng.{rank}")
    if saved is None:
        drawn = torch.Generator()
        drawn.set_state(objects["progress"]["rng"])
        seed = int(torch.randint(0, 2**62, (1,), generator=drawn)) + rank
        torch.manual_seed(seed)  # the CUDA generators too
        return
    torch.set_rng_state(saved["cpu"])
    if device.type == "cuda" and saved["cuda"] is not None:
        torch.cuda.set_rng_state(saved["cuda"], device)
