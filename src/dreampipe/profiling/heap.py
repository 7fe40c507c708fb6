"""The process's C library, where it is glibc: its heap is tuned by the runtime's workers
and trimmed before memory is read (the profiler's and the runtime's measurements)."""

from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["glibc"]

_log = logging.getLogger(__name__)


def glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (Linux); else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError as exc:
        _log.debug("no glibc: %s", exc)
        return None
