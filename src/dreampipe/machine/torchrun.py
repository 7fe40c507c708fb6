"""The torchrun job this process belongs to: whether there is one, and its nodes.

A job over several nodes is planned on two levels, the nodes as servers; torchrun
says how many processes each node runs (``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import logging
import os

__all__ = ["in_torchrun", "torchrun_nodes"]

_log = logging.getLogger(__name__)


def in_torchrun() -> bool:
    """Whether this process is a rank torchrun (or any env:// launcher) started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def torchrun_nodes(world: int) -> int:
    """The nodes of a torchrun job of ``world`` processes: ``world / LOCAL_WORLD_SIZE``.

    1 when torchrun did not say, or the nodes run different numbers of processes
    (the planner then sees one level).
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 1 or world % local:
        _log.info("LOCAL_WORLD_SIZE=%d does not divide %d workers: planning on one level",
                  local, world)
        return 1
    return world // local
