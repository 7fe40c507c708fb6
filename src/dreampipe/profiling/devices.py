"""Accelerators as a profile by shape sees them: peak rate, memory, memory bandwidth.

A profile built from shapes (:mod:`dreampipe.profiling.gpt_spec`) counts each
layer's floating-point work and bytes moved, not times; a :class:`Device`
turns them into times at its ``sustained_fraction`` of its peaks: matrix products
at that share of the dense 16-bit peak, what moves rather than multiplies at that
share of the memory bandwidth, since one framework's kernels fall short of both
alike (:data:`SUSTAINED_FRACTION` unless measured for the device:
:data:`A100_SUSTAINED_FRACTION`). Cluster presets carry their servers' device
(:mod:`dreampipe.planning.topology`); the figures are the vendors' datasheets
(docs/planner.md, "Profiles by shape").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dreampipe.errors import ProfileError

__all__ = ["A100_80GB", "A100_SUSTAINED_FRACTION", "SUSTAINED_FRACTION", "V100_16GB", "V100_32GB",
           "Device"]

#: The fraction of a device's peaks its kernels sustain in a profile by shape, unless the
#: device has its own: Megatron-LM's 39 TFLOP/s on one V100 of 125
#: (Shoeybi et al. 2019, "30% of the peak"), the one figure published beside its peak for
#: a whole model on one device.
SUSTAINED_FRACTION = 39 / 125
#: The A100's: the rate at which the profile by shape of SC21's 1.7B run (Narayanan et
#: al. 2021, Table 1: data parallel on 32 A100s, no tensor or pipeline term) prices at its
#: published 137 TFLOP/s per GPU under dreampipe's cost model, fitted by
#: ``benchmarks/megatron_sc21.py`` (its test re-fits it: a change to the cost model that
#: moves the fit fails there until this figure follows).
A100_SUSTAINED_FRACTION = 208.37e12 / 312e12


@dataclass(frozen=True)
class Device:
    """One accelerator: ``peak_flops`` dense 16-bit FLOP/s (tensor cores),
    ``memory_bytes`` of device memory, ``memory_bandwidth`` bytes/s to it, and the
    ``sustained_fraction`` of those peaks its kernels sustain (module doc)."""

    name: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float
    sustained_fraction: float = SUSTAINED_FRACTION

    def __post_init__(self) -> None:
        for field, value in (("peak_flops", self.peak_flops),
                             ("memory_bytes", self.memory_bytes),
                             ("memory_bandwidth", self.memory_bandwidth)):
            if not (value > 0 and math.isfinite(value)):
                raise ProfileError(f"device {self.name!r}: {field}={value!r} must be positive "
                                   "and finite; give the datasheet figure")
        if not 0 < self.sustained_fraction <= 1:
            raise ProfileError(f"device {self.name!r}: sustained_fraction="
                               f"{self.sustained_fraction!r} must be in (0, 1]; give the share "
                               "of its peaks its kernels sustain, e.g. 0.3")

    @property
    def sustained_flops(self) -> float:
        """FLOP/s a profile by shape times matrix products at."""
        return self.peak_flops * self.sustained_fraction

    def sustained_bandwidth(self, flops: float | None = None) -> float:
        """Bytes/s a profile by shape moves at: the share of the memory bandwidth that
        the matrix products (at ``flops``, default :attr:`sustained_flops`) take of the
        peak."""
        rate = self.sustained_flops if flops is None else flops
        return self.memory_bandwidth * rate / self.peak_flops

    def describe(self) -> str:
        return f"{self.name}, {self.peak_flops / 1e12:g} TFLOP/s"


#: NVIDIA A100 SXM 80 GB: 312 TFLOP/s dense FP16/BF16, 2,039 GB/s of HBM2e, its products at
#: :data:`A100_SUSTAINED_FRACTION` of the peak.
A100_80GB = Device("A100-80GB", 312e12, 80 * 10**9, 2039e9, A100_SUSTAINED_FRACTION)
#: NVIDIA V100 SXM2 16 GB: 125 TFLOP/s FP16 tensor cores, 900 GB/s of HBM2.
V100_16GB = Device("V100-16GB", 125e12, 16 * 10**9, 900e9)
#: The 32 GB V100 of DGX-2H servers, at V100's 125 TFLOP/s.
V100_32GB = Device("V100-32GB", 125e12, 32 * 10**9, 900e9)
