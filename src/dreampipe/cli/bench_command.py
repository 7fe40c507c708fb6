"""``dreampipe bench``: dreampipe's schedules against PyTorch's own.

Trains one workload under dreampipe's schedules, PyTorch's pipelining
schedules and DDP, each in its own processes, and prints their measured
throughput side by side. The work is done by :mod:`dreampipe.commands.bench`;
this module parses, checks and prints. Its parser names its choices from
:mod:`dreampipe.commands.bench_names` alone, loading no torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dreampipe.errors import ConfigError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the ``bench`` sub-command."""
    from dreampipe.commands.bench_names import BENCH_NAMES, LLAMA_RUN_NAMES, WorkloadKind

    p = sub.add_parser(
        "bench",
        help="measure dreampipe's schedules against torch.distributed.pipelining and DDP",
        description=(
            "Train one workload, cut into 2 stages with one thread per worker, under "
            "dreampipe's pipedream (minibatches of half an update, one update each), "
            "1f1b-flush with and without fused weight-gradient accumulation, gpipe, zb-h1, "
            "interleaved-1f1b (4 chunks, 2 per worker), zbv and dualpipev (the same 4 "
            "chunks in a V: chunks r and 3-r on worker r) and 2bw; "
            "PyTorch's Schedule1F1B (with dreampipe's process set-up, as PyTorch ships, and "
            "with microbatches of pipedream's minibatch size), ScheduleGPipe, "
            "ScheduleInterleavedZeroBubble on the same 2 stages, ScheduleInterleaved1F1B "
            "on the same 4 chunks, ScheduleZBVZeroBubble (torch-zbv) and ScheduleDualPipeV "
            "(torch-dualpipev) on the same 4 chunks in the same V, DDP on 2 "
            "workers (and without its all-reduce, to show what that costs; not training) "
            "and one process with 1 and 2 threads. Every run in its own processes "
            "with the same set-up, timed by wall clock between barriers on all ranks after "
            "untimed warm-up updates. Prints each run's median samples/s over interleaved "
            "rounds with the min-max, the simulator's prediction for dreampipe's runs "
            "(the median of one per round, each profiled beside a busy twin), and "
            "ratios that separate schedule, kernel and set-up effects."
        ),
    )
    p.add_argument("--workload", choices=[k.value for k in WorkloadKind], default="mlp",
                   help="mlp: 8 Linear layers of 1024, 256 samples per update as 8 "
                        "microbatches of 32; transformer: 4 GPT-style blocks of width 256 "
                        "over 32 tokens, 16 sequences per update as 8 microbatches of 2; "
                        "llama: Hugging Face's LlamaForCausalLM, randomly initialised, 4 "
                        "layers of width 256 over 64 tokens, 16 sequences per update as 8 "
                        "microbatches of 2, passed whole with its split points as a user "
                        "passes it (PyTorch's side split by pipeline() at the same points; "
                        "its 4 chunks by hand from the same slices, as pipeline()'s stages "
                        "send past their neighbour); runs only "
                        f"{', '.join(LLAMA_RUN_NAMES)} unless --only names others; needs "
                        "transformers (default: mlp)")
    p.add_argument("--steps", type=int, default=20,
                   help="timed updates per run; torch-1f1b-big trains as many samples in "
                        "updates 4 times as big (default: 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed updates before timing starts (default: 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="repeat every run this many times, interleaved, and report the "
                        "median and min-max (default: 3)")
    p.add_argument("--only", nargs="+", choices=BENCH_NAMES, metavar="NAME",
                   help=f"run only these: {', '.join(BENCH_NAMES)}")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="hard limit in seconds for each run (default: 300)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object {"workload": ..., "results": {NAME: '
                        '{"samples_per_s": median, ...}}, "ratios": ...} only')
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from dreampipe.commands.bench import BenchOptions, run_bench
    from dreampipe.commands.bench_names import WorkloadKind
    from dreampipe.commands.bench_report import format_table

    if args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout}: use a positive number of seconds")
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds}: use at least 1")
    opts = BenchOptions(workload=WorkloadKind(args.workload), steps=args.steps,
                        warmup=args.warmup, timeout_s=args.timeout,
                        progress=not args.no_progress, rounds=args.rounds)
    names = tuple(args.only) if args.only else None
    report = run_bench(opts, names)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(format_table(report))
    return 0
