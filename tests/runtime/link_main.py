"""One rank of the shaped-link test, started by ``ip netns exec`` in its own namespace.

The environment is torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) plus GLOO_SOCKET_IFNAME; ``argv[1]`` is a JSON job:

- ``"probe": {"bytes": n, "repeats": k}`` (optional): first, in a process
  group of its own on ``MASTER_PORT + 1``, gloo ``send``s ``n`` bytes from
  rank 1 to rank 0 ``k`` times and times each (the link's real throughput);
- ``"runs"``: a list of :class:`~dreampipe.commands.train_config.TrainRun`'s and
  its TrainConfig's fields (``plan`` as a plan's JSON object), each trained in
  turn as ``dreampipe train`` trains a torchrun rank (one Pipeline, its process
  group on ``MASTER_PORT + 2 k`` for the ``k``-th run, so that no rank meets the
  previous run's store). The runs share the processes: Python and torch start once.

Rank 0 prints one line ``RESULT <json>``: the probe's MB/s, and per run its
throughput and its recorded events.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dreampipe.api import TrainConfig
from dreampipe.commands.train_config import TrainRun
from dreampipe.commands.train_run import TrainJob, train_rank
from dreampipe.planning.plan import Plan

__all__: list[str] = []

MARK = "RESULT "


def probe(nbytes: int, repeats: int) -> list[float]:
    """MB/s of each gloo send of ``nbytes`` from rank 1 to rank 0 (timed on both, between
    barriers)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    rates = []
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 1:
            dist.send(buf, 0)
        else:
            dist.recv(buf, 1)
        dist.barrier()
        if i:  # the first one connects the pair
            rates.append(nbytes / (time.perf_counter() - start) / 1e6)
    dist.destroy_process_group()
    return rates


def train(fields: dict[str, Any]) -> dict[str, Any] | None:
    fields = dict(fields)
    fields["plan"] = Plan.from_dict(fields["plan"])
    fields["model_kwargs"] = tuple(tuple(kv) for kv in fields["model_kwargs"])
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig.from_dict({k: fields.pop(k) for k in list(fields) if k in names})
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = train_rank(rank, world, TrainJob(TrainRun(config=config, **fields)))
    if result is None:
        return None
    return {
        "samples_per_s": result.samples_per_s,
        "elapsed_s": result.elapsed_s,
        "final_loss": result.final_loss,
        "events": [e.to_dict() for e in result.events],
    }


def main() -> None:
    torch.set_num_threads(1)
    job = json.loads(sys.argv[1])
    out: dict[str, Any] = {"runs": []}
    if "probe" in job:
        out["probe_mb_per_s"] = probe(int(job["probe"]["bytes"]), int(job["probe"]["repeats"]))
    port = int(os.environ["MASTER_PORT"])
    for k, fields in enumerate(job["runs"]):
        os.environ["MASTER_PORT"] = str(port + 2 * k)
        out["runs"].append(train(fields))
    if out["runs"][0] is not None:
        print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
