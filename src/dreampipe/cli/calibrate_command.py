"""``dreampipe calibrate``: measure this machine once, for every plan made on it.

The planner and the simulator price a job with figures of the machine it
runs on; without a machine file each job measures a quick subset of them at
start-up. This command measures them all (:mod:`dreampipe.machine.measure`)
and writes the file (:mod:`dreampipe.machine.machine_file`) where jobs look
for it. Under ``torchrun --nnodes N`` it measures inside a node and between
nodes, and rank 0 writes the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dreampipe.errors import ConfigError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``calibrate`` sub-command."""
    p = sub.add_parser(
        "calibrate",
        help="measure this machine's links, step rates and co-run slowdown for the planner",
        description=(
            "Measure the machine dreampipe runs on, as the runtime uses it, and write the "
            "machine file that 'train', 'demo', 'bench' and Pipeline(plan=\"auto\") plan "
            "with: point-to-point latency and bandwidth between workers (a ping-pong at a "
            "few sizes), the all-reduce bandwidth of the runtime's gradient buckets, the "
            "SGD step and weight-stash copy rates and how much slower a worker computes "
            "beside a busy one (NCCL between GPUs, timed with CUDA events, where there are "
            "GPUs; gloo on one thread per worker otherwise). Under 'torchrun --nnodes N "
            "--nproc-per-node M -m dreampipe calibrate' it measures both levels, inside a "
            "node and between nodes, and rank 0 writes the file. Progress goes to stderr."
        ),
        epilog="The file goes to $DREAMPIPE_MACHINE_FILE if set, else "
               "$XDG_CACHE_HOME/dreampipe/machine.json, else ~/.cache/dreampipe/machine.json.",
    )
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes to measure between (default: the GPUs, at "
                        "least 2; 2 on CPUs); under torchrun its processes are used")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the machine file here instead of the default path")
    p.add_argument("--json", action="store_true",
                   help="print the machine file's JSON on stdout (and nothing else there)")
    p.add_argument("--quick", action="store_true",
                   help="the quick subset a job measures at start-up without a machine file "
                        "(fewer sizes and rounds: seconds)")
    p.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:

    from dreampipe.machine.machine_file import default_path
    from dreampipe.machine.measure import (
        FULL,
        QUICK,
        calibrate_local,
        calibrate_torchrun,
    )
    from dreampipe.machine.torchrun import in_torchrun
    from dreampipe.runtime.backend import gpus_here

    if args.output is not None and not args.output.strip():
        raise ConfigError(f"--output {args.output!r} names no file; give one, e.g. --output "
                          "machine.json, or leave --output out for the default path")
    target = Path(args.output) if args.output is not None else default_path()
    if target.is_dir():
        raise ConfigError(f"--output {target}: is a directory; name a file in it, e.g. "
                          f"--output {target / 'machine.json'}")
    probe = QUICK if args.quick else FULL

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if in_torchrun():
        if args.workers is not None:
            raise ConfigError("--workers: under torchrun its processes are measured; leave "
                              "--workers out and set --nproc-per-node")
        found = calibrate_torchrun(probe, progress)
        if found is None:  # not rank 0
            return 0
    else:
        workers = args.workers if args.workers is not None else max(2, gpus_here())
        found = calibrate_local(workers, probe, progress)
    found.save(target)
    if args.json:
        print(json.dumps(found.to_dict()))
    progress(f"wrote {target}")
    return 0
