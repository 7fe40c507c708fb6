"""``TrainConfig``: every knob of a training run, in one frozen record that checks itself.

``Pipeline(..., config=TrainConfig(...))`` and ``dreampipe train`` (its flags over
``--settings FILE``) run the same record. Each rule on the knobs alone lives in
``TrainConfig.__post_init__``, once, as one ConfigError naming the value and the fix,
so a bad config fails where it is written, before any process starts; rules that
also need the plan or the model are the Pipeline's (:mod:`.checks`). Values are kept
as JSON writes them (a schedule's name, a dtype's name such as ``"bfloat16"``), so
:meth:`TrainConfig.to_dict` and :meth:`TrainConfig.from_dict` round-trip exactly.
Under ``schedule="auto"`` the rules about a schedule hold for the one chosen
(:meth:`TrainConfig.chosen` checks again) and fail at once if no candidate of
``semantics`` can hold them. See docs/design.md §2.1.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from dreampipe.api.config_values import (
    check_type,
    dimension_indices,
    named_choice,
    precision_of_autocast,
)
from dreampipe.errors import ConfigError
from dreampipe.planning.placement import Placement, check_virtual_count
from dreampipe.runplan.schedule_choice import CANDIDATES, STAND_IN, Semantics
from dreampipe.runtime.block_recompute import BlockRecompute
from dreampipe.runtime.nonfinite import OnNonFinite
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.runner_options import RunnerOptions
from dreampipe.runtime.zero import MAX_LEVEL
from dreampipe.scheduling.actions import ScheduleKind
from dreampipe.scheduling.microbatch_layout import MicrobatchLayout
from dreampipe.scheduling.unshard import ASYNC_REASON, SHARDED_LEVEL

__all__ = ["TrainConfig"]

_AUTO = "auto"
_SCHEDULES = (*(k.value for k in ScheduleKind), _AUTO)


@dataclass(frozen=True, kw_only=True, repr=False)
class TrainConfig:
    """How a model trains, whatever the model, data and optimizer (every rank the same).

    ``schedule``: a :class:`~dreampipe.scheduling.actions.ScheduleKind` name (or
    member: every name field takes its enum's members, and keeps their names), or
    ``"auto"``: profile and simulate the schedules of ``semantics`` (``"sync"``:
    zb-h1, zb-h2, 1f1b-flush, gpipe, training as one process does; ``"async"``: 2bw,
    pipedream) and train with the fastest; ``"any"``: both, and train with the one
    soonest to the target, its rate over the epochs the convergence study measured
    (:mod:`dreampipe.runplan.study_epochs`). ``microbatches`` per minibatch (None: 1, or
    under ``"auto"`` the search's own, whole rounds of replicas; 1 for pipedream).
    ``virtual_stages`` per worker, with interleaved-1f1b, or 2 with zbv and dualpipev,
    which place them in a V (None: the plan's, or 2 for those two).
    ``max_grad_norm`` clips each update by the global norm over all stages (None: no
    clipping). ``precision``: ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"``
    (forwards under ``torch.autocast``), or ``"bf16"`` (16-bit weights with 32-bit master
    weights; :mod:`dreampipe.runtime.precision`); ``loss_scale`` and
    ``loss_scale_window``: fp16-mixed's initial loss scale and the updates without an
    overflow after which it doubles (:mod:`dreampipe.runtime.loss_scaling`).
    ``recompute_blocks``: each stage recomputes its first that many blocks in the
    backward (all it holds where it holds fewer), keeping only their inputs;
    ``recompute_attention``: each block recomputes its attention only (Megatron-LM's
    selective recomputation; :mod:`dreampipe.runtime.block_recompute`). A stage the plan
    recomputes whole (``r``) does that instead. ``zero``: the ZeRO level a replicated
    stage shards at over its replicas, 1 its optimizer state, 2 also its gradients, 3 also
    its weights between uses (:mod:`dreampipe.runtime.zero`, :mod:`dreampipe.runtime.
    zero_params`; synchronous schedules only; a plan's stage may set its own). ``compensate``:
    staleness compensation of the asynchronous schedules
    (:mod:`dreampipe.runtime.staleness`). ``vertical_sync`` runs every stage on the
    weight version its input stage used; ``stash=False`` turns weight stashing off
    (PipeDream's naive pipelining, to show why it matters); both are pipedream's.
    ``fused_accumulation=False`` makes ``nn.Linear`` weight gradients with autograd's
    kernels (:mod:`dreampipe.runtime.fused`). ``seed``: the weights of a model built
    on ``meta``, layer by layer (and ``dreampipe train``'s data order). ``timeout_s``
    bounds every wait for a peer. ``on_nonfinite``: ``"stop"`` or, with a synchronous
    schedule, ``"skip"`` the update of a minibatch with a NaN or inf
    (:mod:`dreampipe.runtime.nonfinite`). ``record_events`` keeps what each rank did,
    with times. ``measure_memory``: each rank measures its peak memory, which
    ``Pipeline.memory()`` reports beside the prediction (:mod:`dreampipe.api.memory_report`;
    on CPU every operation is then counted, which slows training).
    ``resume``: a checkpoint directory to continue from (its newest
    complete checkpoint). ``schedule_file``: a PyTorch pipelining CSV of one minibatch
    (:func:`~dreampipe.scheduling.torch_csv.read_torch_csv`), run every minibatch in
    place of the schedule ``schedule`` would build; ``schedule`` names its synchronous
    kind, ``microbatches`` must be its microbatches and the plan its stages.
    ``variable_dims``: the dimensions of the input and target tensors that may change
    from step to step, e.g. ``(1,)``: the sequence of ``[batch, sequence]`` tokens; ``0``
    in it lets a minibatch have fewer (or more) samples, one a microbatch at least. Any
    other difference from ``example`` is refused; stages then send each microbatch's
    shapes with it (docs/design.md §8.4; docs/training.md). ``ignore_index``: a target
    value the loss ignores (``-100``, as ``F.cross_entropy(..., ignore_index=-100)``):
    each microbatch's mean loss then counts its share of the minibatch's other targets,
    so the update is the mean over all of them, as one process's (docs/training.md).
    """

    schedule: str = "pipedream"
    semantics: str = "sync"
    microbatches: int | None = None
    virtual_stages: int | None = None
    max_grad_norm: float | None = None
    precision: str = "fp32"
    loss_scale: float = 2.0**16
    loss_scale_window: int = 2000
    recompute_blocks: int = 0
    recompute_attention: bool = False
    zero: int = 0
    compensate: bool = True
    vertical_sync: bool = False
    stash: bool = True
    fused_accumulation: bool = True
    seed: int = 0
    timeout_s: float = 60.0
    on_nonfinite: str = "stop"
    record_events: bool = False
    measure_memory: bool = False
    resume: str | os.PathLike[str] | None = None
    schedule_file: str | os.PathLike[str] | None = None
    variable_dims: tuple[int, ...] = ()
    ignore_index: int | None = None
    autocast: InitVar[object] = None  # moved to ``precision``: refused with the new spelling

    def __post_init__(self, autocast: object) -> None:
        if autocast is not None:
            said = precision_of_autocast(autocast)
            raise ConfigError(f"autocast={autocast!r} is precision={said!r} "
                              f"now: TrainConfig(precision={said!r})",
                              "autocast", "precision")
        self._set("schedule", named_choice("schedule", self.schedule, _SCHEDULES))
        self._set("semantics", named_choice("semantics", self.semantics,
                                       tuple(s.value for s in Semantics)))
        self._set("on_nonfinite", named_choice("on_nonfinite", self.on_nonfinite,
                                          tuple(p.value for p in OnNonFinite)))
        self._set("precision", named_choice("precision", self.precision,
                                       tuple(p.value for p in Precision)))
        for name, example in (("resume", "a checkpoint directory, e.g. resume='ckpt'"),
                              ("schedule_file", "a CSV file, e.g. schedule_file='pp.csv'")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | os.PathLike):
                raise ConfigError(f"{name}={value!r}; give {example}", name)
            self._set(name, None if value is None else os.fspath(value))
        for name in ("compensate", "vertical_sync", "stash", "fused_accumulation",
                     "record_events", "recompute_attention", "measure_memory"):
            check_type(name, getattr(self, name), (bool,), "True or False")
        for name in ("microbatches", "seed", "virtual_stages", "loss_scale_window",
                     "recompute_blocks", "zero", "ignore_index"):
            check_type(name, getattr(self, name), (int,), "a whole number",
                   optional=name in ("microbatches", "virtual_stages", "ignore_index"))
        for name in ("timeout_s", "max_grad_norm", "loss_scale"):
            check_type(name, getattr(self, name), (int, float), "a number",
                   optional=name == "max_grad_norm")
        self._set("variable_dims", dimension_indices(self.variable_dims))
        self._check()
        for name in ("timeout_s", "max_grad_norm", "loss_scale"):  # 1 and 1.0 are one config
            value = getattr(self, name)
            self._set(name, None if value is None else float(value))

    def __repr__(self) -> str:
        """The fields that differ from the defaults: ``TrainConfig(microbatches=4)``."""
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"TrainConfig({', '.join(changed)})"

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def _check(self) -> None:
        """The rules between the knobs, each raised once, here."""
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s}; use a positive number of seconds",
                              "timeout_s")
        norm = self.max_grad_norm
        if norm is not None and not 0 < norm < float("inf"):
            raise ConfigError(f"max_grad_norm={norm}; use a positive norm, or None not to clip",
                              "max_grad_norm")
        v = self.virtual_stages
        check_virtual_count(v)
        v_shaped = self.chooses is None and self.kind.placement is Placement.V
        if v is not None and v_shaped and v != 2:
            raise ConfigError(f"virtual_stages={v} with schedule={self.schedule}, which runs 2 "
                              "stages on each worker, in a V; use virtual_stages=2, or leave "
                              "it out", "virtual_stages", "schedule")
        if v is not None and not v_shaped and (
                v < 1 or (v > 1 and self.schedule != "interleaved-1f1b")):
            raise ConfigError(f"virtual_stages={v} with schedule={self.schedule}; use 1, or "
                              "schedule=interleaved-1f1b with 2 or more (zbv and dualpipev: "
                              "2)", "virtual_stages", "schedule")
        file = self.schedule_file
        if file is not None and (self.chooses is not None or not self.kind.synchronous
                                 or self.kind is ScheduleKind.DP):
            raise ConfigError(
                f"schedule_file={file!r} with schedule={self.schedule}: a PyTorch "
                "schedule is one synchronous step of unreplicated stages; name its kind, e.g. "
                "schedule='1f1b-flush' (interleaved-1f1b with several stages per rank, zb-h1 "
                "with I and W actions)", "schedule_file", "schedule")
        if self.chooses is None:
            self._check_schedule(self.kind)
        else:
            self._check_candidates(self.chooses)
        if (self.loss_scale, self.loss_scale_window) != (2.0**16, 2000):
            if self.precision != Precision.FP16_MIXED.value:
                raise ConfigError(f"loss_scale={self.loss_scale}, loss_scale_window="
                                  f"{self.loss_scale_window} with precision={self.precision}: "
                                  "only fp16-mixed scales the loss; use precision='fp16-mixed' "
                                  "or leave them out", "loss_scale", "precision")
            if not (0 < self.loss_scale < float("inf") and self.loss_scale_window >= 1):
                raise ConfigError(f"loss_scale={self.loss_scale}, loss_scale_window="
                                  f"{self.loss_scale_window}; use a positive scale (e.g. 65536) "
                                  "and a window of 1 or more updates", "loss_scale",
                                  "loss_scale_window")
        if not 0 <= self.zero <= MAX_LEVEL:
            raise ConfigError(
                f"zero={self.zero}; give 0 (no sharding), 1 (optimizer state), 2 (also "
                f"gradients) or {MAX_LEVEL} (also the weights between uses)", "zero")
        if self.recompute_blocks < 0:
            raise ConfigError(f"recompute_blocks={self.recompute_blocks}: the blocks each stage "
                              "recomputes, from its first; use 0 (none) or more",
                              "recompute_blocks")
        if self.recompute_blocks and self.recompute_attention:
            raise ConfigError(
                f"recompute_blocks={self.recompute_blocks} with recompute_attention="
                f"{self.recompute_attention}; recompute either each stage's first k >= 1 "
                "blocks or every block's attention, not both (0 and False: neither)",
                "recompute_blocks", "recompute_attention")
        if self.vertical_sync and not self.stash:
            raise ConfigError("vertical_sync=True runs every stage on a stashed weight version, "
                              "so it needs weight stashing; drop stash=False or "
                              "vertical_sync=True", "stash", "vertical_sync")

    def _check_schedule(self, kind: ScheduleKind) -> None:
        """The rules that depend on the schedule run."""
        MicrobatchLayout(kind=kind, microbatches=self.per_minibatch)  # microbatches' rules
        if kind is not ScheduleKind.PIPEDREAM and (self.vertical_sync or not self.stash):
            what = " and ".join(w for w, on in (("vertical_sync=True", self.vertical_sync),
                                                ("stash=False", not self.stash)) if on)
            raise ConfigError(f"{what} with schedule={kind.value}: vertical sync and turning "
                              "weight stashing off apply to the pipedream schedule only; use "
                              f"schedule=pipedream, or drop {what}",
                              "vertical_sync", "stash", "schedule")
        if self.precision == Precision.FP16_MIXED.value and not kind.synchronous:
            raise ConfigError(
                f"precision=fp16-mixed with schedule={kind.value}: a loss scale shared by all "
                "stages needs every stage to update at the same step, which only synchronous "
                "schedules do; use precision='bf16' or 'bf16-mixed' with it, or a synchronous "
                "schedule", "precision", "schedule")
        if SHARDED_LEVEL <= self.zero <= MAX_LEVEL and not kind.synchronous:
            raise ConfigError(
                f"zero={self.zero} with schedule={kind.value}: {ASYNC_REASON}; use zero=2, or a "
                "synchronous schedule (1f1b-flush, gpipe, zb-h1, zb-h2)", "zero", "schedule")
        if self.on_nonfinite == OnNonFinite.SKIP.value and kind is ScheduleKind.PIPEDREAM:
            raise ConfigError(
                "on_nonfinite=skip needs every stage to update at the same step, as every "
                "schedule but pipedream does (1f1b-flush, zb-h1, 2bw, ...); pipedream updates "
                "each stage at its own time: use on_nonfinite=stop with it", "on_nonfinite",
                "schedule")

    def _check_candidates(self, semantics: Semantics) -> None:
        """Under ``auto``: some schedule it may choose must hold the schedule's rules."""
        failed: ConfigError | None = None
        for kind in CANDIDATES[semantics]:
            try:
                self._check_schedule(kind)
                return
            except ConfigError as exc:
                failed = failed or exc
        assert failed is not None
        names = ", ".join(k.value for k in CANDIDATES[semantics])
        raise ConfigError(f"schedule=auto with semantics={semantics.value} chooses among "
                          f"{names}, and none of them can run this: {failed}",
                          *failed.parameters, "semantics")

    # ---- what the knobs mean to the rest of the library -----------------------
    @property
    def chooses(self) -> Semantics | None:
        """The semantics ``schedule="auto"`` chooses a schedule of; None when it is given."""
        return Semantics(self.semantics) if self.schedule == _AUTO else None

    @property
    def per_minibatch(self) -> int:
        """Microbatches per minibatch: ``microbatches``, 1 where left out (under ``"auto"``
        a profile's then, which the search cuts as it chooses)."""
        return 1 if self.microbatches is None else self.microbatches

    @property
    def kind(self) -> ScheduleKind:
        """The schedule; under ``"auto"``, one of the semantics that stands in until the
        choice is made (profiling, sizes), as most candidates split minibatches."""
        chooses = self.chooses
        return ScheduleKind(self.schedule) if chooses is None else STAND_IN[chooses]

    @property
    def stages_per_rank(self) -> int:
        """Stages each rank runs: ``virtual_stages``, else 2 under the V schedules (zbv,
        dualpipev), else 1 (a given plan's own count is read from the plan)."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.chooses is None and self.kind.placement is Placement.V else 1

    @property
    def policy(self) -> OnNonFinite:
        """What a NaN or inf output or loss does."""
        return OnNonFinite(self.on_nonfinite)

    @property
    def number_formats(self) -> Precision:
        """``precision`` as a :class:`~dreampipe.runtime.precision.Precision`."""
        return Precision(self.precision)

    def block_recompute(self) -> BlockRecompute | None:
        """What each stage recomputes of its blocks (None: nothing), its block class to be
        found on the whole model (:meth:`BlockRecompute.for_model`)."""
        if self.recompute_attention:
            return BlockRecompute(selective=True)
        return BlockRecompute(blocks=self.recompute_blocks) if self.recompute_blocks else None

    def runner_options(self) -> RunnerOptions:
        """How every rank's runner runs its actions under this config."""
        return RunnerOptions(timeout_s=self.timeout_s, vertical_sync=self.vertical_sync,
                             record_events=self.record_events, max_grad_norm=self.max_grad_norm,
                             precision=self.number_formats, on_nonfinite=self.policy,
                             loss_scale=self.loss_scale, loss_scale_window=self.loss_scale_window,
                             varying_shapes=bool(self.variable_dims))

    def chosen(self, kind: ScheduleKind, microbatches: int) -> TrainConfig:
        """This config with the schedule ``"auto"`` chose, checked again for it."""
        return dataclasses.replace(self, schedule=kind.value, microbatches=microbatches)

    # ---- as data --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON and TOML write it (None where unset, a list for a tuple)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """The config of ``data``'s fields (the rest default); an unknown key is a
        ConfigError naming it and the nearest field."""
        _known_keys(data)
        return cls(**data)

    def to_json(self) -> str:
        """:meth:`to_dict` as one line of JSON."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        """The config :meth:`to_json` wrote (or any JSON object of its fields)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError(f"a TrainConfig in JSON is an object of its fields, not "
                              f"{type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str],
             overrides: Mapping[str, Any] | None = None) -> TrainConfig:
        """The config of a settings file, TOML (``.toml``, top-level keys) or JSON
        (``.json``), with ``overrides`` (fields, such as the flags given) over it."""
        file = Path(path)
        text = file.read_text()
        try:
            data = tomllib.loads(text) if file.suffix == ".toml" else \
                json.loads(text) if file.suffix == ".json" else None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"settings file {str(file)!r} is not valid "
                              f"{file.suffix[1:].upper()}: {exc}") from None
        if data is None:
            raise ConfigError(f"settings file {str(file)!r}: name a .toml or a .json file")
        if not isinstance(data, dict):
            raise ConfigError(f"settings file {str(file)!r} holds a {type(data).__name__}; "
                              "write an object of TrainConfig fields")
        try:
            _known_keys(data)
        except ConfigError as exc:
            raise ConfigError(f"settings file {str(file)!r}: {exc}", *exc.parameters) from None
        return cls.from_dict({**data, **(overrides or {})})


def _known_keys(data: Mapping[str, Any]) -> None:
    """Every key of ``data`` is a field of TrainConfig (a ConfigError naming the nearest)."""
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    for key in data:
        if key == "autocast":
            TrainConfig(autocast=data[key])  # says what it is now
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"use {', '.join(names)}"
            raise ConfigError(f"{key!r} is not a TrainConfig field; {hint}", str(key))
