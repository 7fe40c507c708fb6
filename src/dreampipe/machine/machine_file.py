"""The machine file: what ``dreampipe calibrate`` measured on a machine, as JSON.

The planner and the simulator price a run with figures of the machine it
runs on (:class:`~dreampipe.machine.calibration.LocalCalibration`): how
fast its workers all-reduce, send to each other and step, and how much
slower they compute side by side. ``dreampipe calibrate`` measures them
once and keeps them here, per level where the level matters::

    node    the workers inside one machine (loopback, NVLink, PCIe)
    nodes   one worker on each of two machines (the network between them)

with who measured them (host, devices, torch, backend, date) and how each
figure was measured. A file read on another machine, or under another
torch, still loads, but is noticed: a warning says to calibrate again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from dreampipe.errors import ConfigError
from dreampipe.machine.calibration import LocalCalibration
from dreampipe.runtime.backend import Backend

__all__ = ["ENV_VAR", "TYPICAL_HOST", "Identity", "LinkFigures", "MachineFile", "default_path",
           "here", "load_machine_file", "typical_how"]

log = logging.getLogger(__name__)

#: Names the machine file instead of the per-user cache path.
ENV_VAR = "DREAMPIPE_MACHINE_FILE"
_VERSION = 1

#: Host figures no calibration measures: a runtime forward's own time, a microbatch's data load
#: and the loss, each a fraction of a millisecond, used only for a profile without its own
#: (every profile dreampipe takes measures the first and the last with it).
TYPICAL_HOST = {"stage_forward_s": 0.06e-3, "batch_load_s": 0.07e-3, "loss_s": 0.06e-3}
_TYPICAL_HOW = "not measured: a typical host figure, used only where the profile lacks its own"


@dataclass(frozen=True)
class Identity:
    """Who measured: the host, its devices (``"cpu x2 cores"``, ``"cuda: 8 x NVIDIA H100"``),
    torch's version and when (ISO 8601, UTC)."""

    hostname: str
    devices: str
    torch_version: str
    made: str

    def differences(self, other: Identity) -> list[str]:
        """What of ``hostname``, ``devices`` and ``torch_version`` differs from ``other``."""
        return [f"{name} {getattr(self, name)!r} (here {getattr(other, name)!r})"
                for name in ("hostname", "devices", "torch_version")
                if getattr(self, name) != getattr(other, name)]


@dataclass(frozen=True)
class LinkFigures:
    """One level's links, measured between ``workers`` workers over ``backend``.

    ``allreduce_bandwidth`` is the bandwidth at which a ring's ``2 (w-1)/w n``
    bytes take the time the runtime's bucketed all-reduce took (what the
    planner's ring term needs); ``p2p_bandwidth`` and ``latency_s`` are the
    fit ``latency + bytes / bandwidth`` of a ping-pong's one-way times.
    """

    workers: int
    backend: Backend
    allreduce_bandwidth: float
    p2p_bandwidth: float
    latency_s: float
    how: str


@dataclass(frozen=True, kw_only=True)
class MachineFile:
    """A machine's measured figures (bytes/s, seconds), and how each was measured (``how``:
    figure name to method)."""

    identity: Identity
    backend: Backend
    #: Inside one node; None when each node ran one worker (nothing to measure there).
    node: LinkFigures | None
    #: Between nodes (a torchrun job over several); None on one node.
    nodes: LinkFigures | None = None
    step_bandwidth: float
    stash_copy_bandwidth: float
    corun_slowdown: float
    send_overhead_s: float
    send_copy_bandwidth: float
    cores: int
    #: A tensor-split layer's fixed cost per forward and backward (inside one node); None
    #: in a file measured before dreampipe measured it.
    split_layer_forward_s: float | None = None
    split_layer_backward_s: float | None = None
    how: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.node is None and self.nodes is None:
            raise ConfigError("a machine file needs the links of one level at least: "
                              "measure them with 'dreampipe calibrate'")

    def calibration(self) -> LocalCalibration:
        """The figures as the planner and the simulator take them."""
        inner = self.node if self.node is not None else self.nodes
        assert inner is not None  # __post_init__
        outer = self.nodes
        return LocalCalibration(
            bandwidth=f"{inner.allreduce_bandwidth:.6g}B/s", latency_s=inner.latency_s,
            outer_bandwidth=None if outer is None else f"{outer.allreduce_bandwidth:.6g}B/s",
            outer_latency_s=0.0 if outer is None else outer.latency_s,
            step_bandwidth=self.step_bandwidth, stash_copy_bandwidth=self.stash_copy_bandwidth,
            corun_slowdown=self.corun_slowdown, send_overhead_s=self.send_overhead_s,
            send_copy_bandwidth=self.send_copy_bandwidth, cores=self.cores,
            overlap=self.backend is Backend.NCCL,
            split_layer_forward_s=self.split_layer_forward_s or 0.0,
            split_layer_backward_s=self.split_layer_backward_s or 0.0, **TYPICAL_HOST)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["how"] = dict(self.how)
        out["backend"] = self.backend.value
        for level in ("node", "nodes"):
            if out[level] is not None:
                out[level]["backend"] = out[level]["backend"].value
        return {"version": _VERSION, **out}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineFile:
        if data.get("version") != _VERSION:
            raise ConfigError(f"machine file version {data.get('version')!r} is not "
                              f"{_VERSION}; measure this machine again with 'dreampipe calibrate'")
        fields = {k: v for k, v in data.items() if k != "version"}
        fields["identity"] = Identity(**fields["identity"])
        fields["backend"] = Backend(fields["backend"])
        for level in ("node", "nodes"):
            if fields.get(level) is not None:
                fields[level] = LinkFigures(**{**fields[level],
                                               "backend": Backend(fields[level]["backend"])})
        fields["how"] = tuple(sorted(dict(fields.get("how", {})).items()))
        return cls(**fields)

    def save(self, path: str | Path) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MachineFile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"machine file {str(path)!r} is not one 'dreampipe calibrate' "
                              f"wrote ({exc}); measure this machine again with "
                              "'dreampipe calibrate'") from None


def default_path() -> Path:
    """``$DREAMPIPE_MACHINE_FILE``, else ``$XDG_CACHE_HOME/dreampipe/machine.json``, else
    ``~/.cache/dreampipe/machine.json``."""
    named = os.environ.get(ENV_VAR)
    if named:
        return Path(named)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dreampipe" / "machine.json"


def here(*, made: datetime | None = None) -> Identity:
    """This host's identity, dated ``made`` (default: now)."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        devices = f"cuda: {count} x {torch.cuda.get_device_name(0)}"
    else:
        devices = f"cpu x{len(os.sched_getaffinity(0))} cores"
    when = (made or datetime.now(UTC)).isoformat(timespec="seconds")
    return Identity(socket.gethostname(), devices, torch.__version__, when)


def load_machine_file(path: str | Path | None = None) -> MachineFile | None:
    """The machine file at ``path`` (default :func:`default_path`), None if there is none.

    A file another machine made (another host, devices or torch) is
    returned with a warning to calibrate this one, as is a file without the split
    layers' figure (its tensor-split plans are priced without it).
    """
    where = default_path() if path is None else Path(path)
    if not where.is_file():
        return None
    found = MachineFile.load(where)
    differs = found.identity.differences(here())
    if differs:
        log.warning("machine file %s was made on another machine: %s; measure this one with "
                    "'dreampipe calibrate'", where, ", ".join(differs))
    if found.node is not None and found.split_layer_forward_s is None:
        log.warning("machine file %s holds no fixed cost of a tensor-split layer: split plans "
                    "are priced without it and look faster than they run; measure it with "
                    "'dreampipe calibrate'", where)
    return found


def typical_how() -> dict[str, str]:
    """How the figures no calibration measures were chosen."""
    return dict.fromkeys(TYPICAL_HOST, _TYPICAL_HOW)
