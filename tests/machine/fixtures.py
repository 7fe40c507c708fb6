"""Machine files for tests: the project's 2-core development VM and an 8-GPU NVLink server.

``dev_vm.json`` holds the figures measured on the project's 2-core VM (gloo over
loopback: the runtime's bucketed all-reduce at 572 MB/s, the SGD step at 4.2
GB/s, compute 4.3% slower beside a busy worker); ``nvlink_8gpu.json`` an 8 x H100
server's (NCCL all-reduce at about 150 GB/s over NVLink, 12 us per message,
steps at HBM rates). Tests price plans with them, not with whatever machine
they run on; :func:`here_file` makes one look made here, so loading it warns of nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dreampipe.machine.calibration import LocalCalibration
from dreampipe.machine.machine_file import MachineFile, here

__all__ = ["DEV_FILE", "DEV_MACHINE", "NVLINK_FILE", "NVLINK_MACHINE", "here_file"]

_HERE = Path(__file__).resolve().parent
DEV_FILE = _HERE / "dev_vm.json"
NVLINK_FILE = _HERE / "nvlink_8gpu.json"

#: The development VM's calibration (2 cores), as the planner takes it.
DEV_MACHINE: LocalCalibration = MachineFile.load(DEV_FILE).calibration()
#: The NVLink server's.
NVLINK_MACHINE: LocalCalibration = MachineFile.load(NVLINK_FILE).calibration()


def here_file(source: Path, target: Path) -> Path:
    """``source``'s figures written to ``target`` as if measured on this host now (a file
    made now holds every figure: those ``source`` predates are 0, as it is priced)."""
    found = MachineFile.load(source)
    dataclasses.replace(
        found, identity=here(),
        split_layer_forward_s=found.split_layer_forward_s or 0.0,
        split_layer_backward_s=found.split_layer_backward_s or 0.0).save(target)
    return target
