"""A Pipeline in a process group the user made: it leaves the group as it found it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dreampipe
from dreampipe.runtime.processes import free_port

__all__: list[str] = []


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def test_close_destroys_the_subgroups_it_made_and_keeps_the_users_group() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        before = _groups()
        for _ in range(2):  # a second Pipeline in the same group starts from the same state
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
            pipe = dreampipe.Pipeline(model, example=(x, y), loss_fn=F.cross_entropy,
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                      config=dreampipe.TrainConfig(schedule="1f1b-flush",
                                                                   max_grad_norm=1.0))
            assert _groups() > before  # its links and the clipping group
            pipe.step(x, y)
            assert len(pipe.finish()) == 1
            pipe.close()
            assert dist.is_initialized() and _groups() == before
    finally:
        dist.destroy_process_group()
