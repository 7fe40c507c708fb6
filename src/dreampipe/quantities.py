"""Parse and print human quantities: ``16GB``, ``10Gbps``, ``12GB/s``.

Sizes use powers of 1000 for ``KB``/``MB``/``GB`` and 1024 for ``KiB``/``MiB``/
``GiB``. Bandwidths accept bits (``Gbps``, ``Gb/s``) or bytes (``GB/s``,
``GBps``) per second and are returned in bytes per second. Every result is
finite: ``1e400GB`` is an error, not ``inf``. A bare number is bytes (per
second); :func:`parse_bandwidth` can insist on a unit (``require_unit``), as
user-written text should, since ``10`` could mean bits or bytes.
"""

from __future__ import annotations

import math
import re

from dreampipe.errors import QuantityError

__all__ = ["format_bytes", "format_duration", "parse_bandwidth", "parse_bytes", "parse_duration"]

_NUM = r"(-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _split(text: str) -> tuple[float, str]:
    """The number and the unit of ``text``; a huge exponent reads as ``inf``, never raises."""
    m = re.fullmatch(_NUM + r"\s*([A-Za-z/]*)", text.strip())
    if not m:
        raise QuantityError(f"{text!r} is not a quantity; write e.g. 16GB or 10Gbps")
    return float(m.group(1)), m.group(2)


def parse_bytes(text: str | int | float, *, require_unit: bool = False) -> int:
    """``"16GB"`` -> 16e9, ``"16GiB"`` -> 16*2**30, a bare number is bytes.

    With ``require_unit`` a string without a unit (``"80"``) is an error: a memory
    of 80 bytes is far likelier to be 80 GB mistyped; a Python number is still bytes.
    """
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        value, unit = _split(text)
        if require_unit and not unit:
            raise QuantityError(f"size {text!r} has no unit; write e.g. {text.strip()}GB, "
                                f"{text.strip()}GiB or {text.strip()}B")
    m = re.fullmatch(r"(?i)([kmgt]i?)?b?", unit)
    if not m:
        raise QuantityError(f"{text!r}: unknown size unit {unit!r}; use B, KB, MB, GB, GiB ...")
    if re.fullmatch(r"[KMGT]i?b", unit):  # Gb is gigabits, as bandwidths read it
        raise QuantityError(f"{text!r}: {unit} is bits (as in 10Gbps), and a size is in "
                            f"bytes; write {_split(str(text))[0]:g}{unit[:-1]}B")
    if math.isnan(value):
        raise QuantityError(f"{text!r} is not a finite size; give e.g. 16GB")
    if value < 0:
        raise QuantityError(f"{text!r} is negative; sizes must be >= 0")
    value *= _SCALE[(m.group(1) or "").lower()]
    if not math.isfinite(value):
        raise QuantityError(f"{text!r} is not a finite size; give e.g. 16GB")
    return round(value)


def parse_bandwidth(text: str | int | float, *, require_unit: bool = False) -> float:
    """``"10Gbps"`` -> 1.25e9 bytes/s; ``"12GB/s"`` -> 12e9; a bare number is bytes/s.

    With ``require_unit`` a string without a unit (``"10"``) is an error,
    since it could mean bits or bytes; a Python number is still bytes/s.
    """
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        value, unit = _split(text)
        if require_unit and not unit and not value > 0:
            raise QuantityError(f"bandwidth {text!r} must be positive, e.g. 10GB/s or 10Gbps")
        if require_unit and not unit:
            raise QuantityError(
                f"bandwidth {text!r} has no unit; write e.g. {text.strip()}GB/s (bytes) "
                f"or {text.strip()}Gbps (bits)"
            )
    m = re.fullmatch(r"([kmgtKMGT]i?)?(b|B)?(ps|/s)?", unit)
    if not m or (unit and not m.group(2)):
        raise QuantityError(
            f"{text!r}: unknown bandwidth unit {unit!r}; use e.g. 10Gbps, 25Gb/s or 12GB/s"
        )
    if math.isnan(value) or value <= 0:
        raise QuantityError(f"bandwidth {text!r} must be positive, e.g. 10Gbps")
    scale = _SCALE[(m.group(1) or "").lower()]
    bits = m.group(2) == "b"
    result = value * scale / (8 if bits else 1)
    if not math.isfinite(result) or result <= 0:
        raise QuantityError(
            f"bandwidth {text!r} is not a finite positive number of bytes/s; give e.g. 10Gbps"
        )
    return result


_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: str | int | float, *, require_unit: bool = False) -> float:
    """``"10us"`` -> 1e-5 seconds; ``"0.5ms"``, ``"2s"``, ``"100ns"``; a bare number is seconds.

    Used for link latencies; with ``require_unit`` a unitless string is an
    error, since ``"10"`` could mean any of them.
    """
    if isinstance(text, int | float):
        value, unit = float(text), "s"
    else:
        m = re.fullmatch(_NUM + r"\s*([a-zµ]*)", text.strip())
        if not m:
            raise QuantityError(f"{text!r} is not a duration; write e.g. 10us or 0.5ms")
        value, unit = float(m.group(1)), m.group(2) or ("" if require_unit else "s")
    if unit not in _SECONDS:
        hint = "has no unit" if not unit else f"has unknown unit {unit!r}"
        raise QuantityError(f"duration {text!r} {hint}; use s, ms, us or ns, e.g. 10us")
    seconds = value * _SECONDS[unit]
    if not math.isfinite(seconds) or seconds < 0:
        raise QuantityError(f"duration {text!r} must be finite and >= 0, e.g. 10us")
    return seconds


def format_duration(seconds: float) -> str:
    """Short human duration: ``10 us``, ``1.5 ms``, ``2.0 s``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def format_bytes(n: float) -> str:
    """Short human size: ``1.6 GB``, ``512 B``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
