"""Other projects' schedule formats: the registry of their codecs, by name.

Each codec module (:mod:`.torch_csv`, :mod:`.torch_csv_write`) registers its reader or
writer here when imported, and :class:`~dreampipe.scheduling.actions.Schedule`'s
``from_``/``to_`` methods look them up, so the plain-data schedule module does not
depend on the codecs built on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dreampipe.errors import ScheduleError

__all__ = ["Reader", "Writer", "codec", "register_format"]

#: ``(path, kind or None) -> Schedule`` and ``(schedule, path, comms) -> None``; typed
#: loosely, so that this module needs nothing of the schedules it reads and writes.
Reader = Callable[..., Any]
Writer = Callable[..., None]
_FORMATS: dict[str, tuple[Reader | None, Writer | None]] = {}


def register_format(name: str, read: Reader | None = None, write: Writer | None = None
                    ) -> None:
    """Make ``read`` and/or ``write`` the codec of format ``name`` for :class:`Schedule`'s
    ``from_``/``to_`` methods."""
    old_read, old_write = _FORMATS.get(name, (None, None))
    _FORMATS[name] = (read or old_read, write or old_write)


def codec(name: str) -> tuple[Reader, Writer]:
    """Format ``name``'s reader and writer; a ScheduleError naming the fix when either
    is not loaded."""
    read, write = _FORMATS.get(name, (None, None))
    if read is None or write is None:
        raise ScheduleError(f"no codec of the {name} schedule format is loaded; import "
                            "dreampipe (it loads them) before using it")
    return read, write
