"""The names of ``dreampipe bench``'s workloads and runs, without importing torch.

The CLI builds every command's parser, ``bench``'s choices included, before
it runs one; naming them here keeps ``dreampipe --help`` and the commands
that never train (``plan``, ``simulate``) from loading PyTorch first, which
takes seconds. :mod:`~dreampipe.commands.workloads`, :mod:`~dreampipe.commands.baselines`
and :mod:`~dreampipe.commands.bench_runs` build the runs behind these names.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["BENCH_NAMES", "DREAMPIPE_RUN_NAMES", "LLAMA_RUN_NAMES", "Baseline", "WorkloadKind",
           "default_runs"]


class WorkloadKind(Enum):
    """A bench workload: which model (a zoo model, or Hugging Face's Llama), how big, and
    where it is cut."""

    MLP = "mlp"
    TRANSFORMER = "transformer"
    LLAMA = "llama"


class Baseline(Enum):
    """A PyTorch-only run the bench compares dreampipe with."""

    TORCH_1F1B = "torch-1f1b"
    TORCH_1F1B_STOCK = "torch-1f1b-stock"
    TORCH_1F1B_BIG = "torch-1f1b-big"
    TORCH_GPIPE = "torch-gpipe"
    TORCH_ZB = "torch-zb"
    TORCH_INTERLEAVED = "torch-interleaved-1f1b"
    TORCH_ZBV = "torch-zbv"
    TORCH_DUALPIPEV = "torch-dualpipev"
    DDP = "ddp"
    DDP_NO_ALLREDUCE = "ddp-no-allreduce"
    SINGLE_1THREAD = "single-1thread"
    SINGLE_2THREADS = "single-2threads"


#: dreampipe's own runs, in the order the bench runs them.
DREAMPIPE_RUN_NAMES: tuple[str, ...] = ("pipedream", "1f1b-flush", "1f1b-flush-unfused", "gpipe",
                                        "zb-h1", "interleaved-1f1b", "zbv", "dualpipev",
                                        "2bw")
#: Every run ``dreampipe bench`` knows, in the order it runs and prints them.
BENCH_NAMES: tuple[str, ...] = (*DREAMPIPE_RUN_NAMES, *(b.value for b in Baseline))
#: What ``--workload llama`` runs unless told: 1F1B, zero bubble and interleaved 1F1B, each
#: dreampipe's against PyTorch's on the same split (every other run is there to ask for).
LLAMA_RUN_NAMES: tuple[str, ...] = ("1f1b-flush", "zb-h1", "interleaved-1f1b", "torch-1f1b",
                                    "torch-zb", "torch-interleaved-1f1b")


def default_runs(kind: WorkloadKind) -> tuple[str, ...]:
    """The runs ``dreampipe bench --workload kind`` runs when not told which, in order."""
    return LLAMA_RUN_NAMES if kind is WorkloadKind.LLAMA else BENCH_NAMES
