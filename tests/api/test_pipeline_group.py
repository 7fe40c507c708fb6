"""A Pipeline in a process group the user made: it leaves the group as it found it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dreampipe
from dreampipe.runtime.processes import free_port

__all__: list[str] = []


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _threads() -> int:
    """The process's threads, C++ ones included (a gloo group runs its own)."""
    return len(os.listdir("/proc/self/task"))


def test_close_destroys_the_subgroups_it_made_and_keeps_the_users_group() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        before, threads = _groups(), []
        for _ in range(2):  # a second Pipeline in the same group starts from the same state
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            pipe = dreampipe.Pipeline(model, example=(x, y), loss_fn=F.cross_entropy,
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                      config=dreampipe.TrainConfig(schedule="1f1b-flush",
                                                                   max_grad_norm=1.0))
            assert _groups() > before  # its links and the clipping group
            during = _threads()
            pipe.step(x, y)
            assert len(pipe.finish()) == 1
            pipe.close()
            assert dist.is_initialized() and _groups() == before
            threads.append((during, _threads()))
            with pytest.raises(dreampipe.ConfigError, match="closed"):
                pipe.step(x, y)
            assert pipe.skipped == [] and pipe.events == []  # still readable
        # the groups' threads end at close(), not at the interpreter's exit, where a gloo
        # worker finishing a collective aborts the process (the first Pipeline may start
        # torch's own pools, so the second is the one compared)
        (_, first_after), (during, after) = threads
        assert after < during and after == first_after, threads
    finally:
        dist.destroy_process_group()
