"""The model zoo's cases trained through the Pipeline under ``torchrun`` (the user's way).

``python -m torch.distributed.run --nproc-per-node 2 models_script.py OUT JOBS`` runs
every job of the JSON list ``JOBS`` (:func:`api.model_workers.train_case`'s jobs) one
after another in the same process group; rank 0 saves their results to ``OUT`` and
prints ``{"jobs": n}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.model_workers import train_case
from dreampipe.api.group import init_process_group

__all__ = ["main"]


def main(out: str, jobs: str) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = [train_case(rank, world, job) for job in json.loads(jobs)]
    if rank == 0:
        torch.save(results, out)
        print(json.dumps({"jobs": len(results)}), flush=True)


if __name__ == "__main__":
    init_process_group(timeout_s=60.0)  # one group that every job's Pipeline joins
    try:
        main(sys.argv[1], sys.argv[2])
    finally:
        torch.distributed.destroy_process_group()
