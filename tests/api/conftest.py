"""In-process Pipelines start a process group of one; none outlives its test. Ranks forked
to train the model zoo find its ``transformers`` models imported already."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from multiprocessing import forkserver

import pytest
import torch.distributed as dist

from dreampipe.runtime import processes


@pytest.fixture(scope="session", autouse=True)
def _zoo_preloaded() -> None:
    """When the tests collected import the zoo (:mod:`.model_zoo`, :mod:`.zoo_tracing`),
    start the forkserver that ``run_processes`` forks ranks from with the ``transformers``
    modules of its classes imported, beside what dreampipe preloads: each launch then
    forks ranks that hold them instead of importing them again (2-3 s a launch on 2
    cores, dozens of launches). By name, since the server's path lacks the tests' folder.
    A server already running (started by an earlier test) is left as it is."""
    zoo = [sys.modules[name] for name in (f"{__package__}.model_zoo",
                                          f"{__package__}.zoo_tracing") if name in sys.modules]
    if not zoo or "forkserver" not in multiprocessing.get_all_start_methods():
        return
    modules = sorted({value.__module__ for module in zoo for value in vars(module).values()
                      if isinstance(value, type) and value.__module__.startswith("transformers.")})
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [*processes._PRELOAD, *modules])
    forkserver.ensure_running()


@pytest.fixture(autouse=True)
def _no_group_left() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
