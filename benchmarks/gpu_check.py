"""``make gpu-check``: dreampipe's CUDA path on this machine, and its figures, in minutes.

Steps, each with a hard limit, printing its own table:

1. ``cuda``: one GPU. Profile the zoo mlp on ``cuda:0`` (layers timed by CUDA
   events) and measure the peak the CUDA allocator saw over it.
2. ``pipeline``: one GPU. The single-process ``Pipeline`` tests (a group of
   one on NCCL, the model on ``cuda:0``) against plain PyTorch loops,
   checkpoints that resume bit for bit (the CUDA generator included), and every
   precision on one rank against one process in it.
3. ``equivalence``: the multi-process equivalence tests (Pipeline and
   runtime against single-process references), one GPU per rank on NCCL
   (``LOCAL_RANK``). NCCL refuses two ranks on one GPU, so they need 2 GPUs.
4. ``bench``: ``dreampipe bench`` (CPU and gloo by design, one thread per
   worker), the runs behind its first four ratios, 3 short rounds.
5. ``train``: ``benchmarks/train_vs_predicted.py`` on the mlp (pipedream and
   dp, 3 rounds), on the GPUs.
6. ``memory``: ``benchmarks/memory_vs_predicted.py``, the same way.

Without a GPU it runs what the CPU can (3 to 6 on gloo) and says what it
skipped. With GPUs it spends its time on them: the steps that would run on
the CPU there are skipped, with the reason (``make test`` and ``make bench``
cover them). Any step that fails makes the exit status 1. A prediction off
by more than its tolerance is a figure, not a failure: the step reports it
and the check goes on. The steps' limits add up to at most 10 minutes; a
step past its limit is ended with every process it started.

    python benchmarks/gpu_check.py [--only cuda equivalence ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from train_vs_predicted import OUTSIDE_TOLERANCE

__all__ = ["STEPS", "Step", "device_check", "main", "plan_steps"]

_ROOT = Path(__file__).resolve().parents[1]
_PY = sys.executable
_EQUIVALENCE = ("tests/api/test_pipeline_equivalence.py", "tests/runtime/test_equivalence.py",
                "tests/api/test_pipeline_schedules.py")
_ONE_GPU = ("tests/api/test_pipeline_local.py", "tests/api/test_checkpoint.py",
            "tests/api/test_materialise.py", "tests/api/test_pipeline_precision_one_rank.py")
_BENCH_RUNS = ("pipedream", "1f1b-flush", "1f1b-flush-unfused", "torch-1f1b",
               "torch-1f1b-stock", "ddp")
STEPS = ("cuda", "pipeline", "equivalence", "bench", "train", "memory")


@dataclass(frozen=True)
class Step:
    """One step: its command (None: skipped), why it runs where it does, its limit."""

    name: str
    command: tuple[str, ...] | None
    where: str
    timeout_s: float
    hide_gpus: bool = False


def plan_steps(gpus: int) -> list[Step]:
    """The steps for a machine with ``gpus`` CUDA devices."""
    two = gpus >= 2
    on = "on the GPUs (NCCL, one GPU per rank)" if two else "on the CPU (gloo)"
    cpu_only = f"{gpus} GPU, and NCCL needs one GPU per rank (2 ranks); `make test` runs it " \
        "on gloo"
    pytest = (_PY, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider")
    return [
        Step("cuda", (_PY, str(Path(__file__).resolve()), "--cuda-only") if gpus else None,
             "on cuda:0" if gpus else "no CUDA device", 60),
        Step("pipeline", (*pytest, *_ONE_GPU) if gpus else None,
             "on cuda:0 (a group of one on NCCL)" if gpus else "no CUDA device", 150),
        Step("equivalence", (*pytest, *_EQUIVALENCE) if two or not gpus else None,
             on if two or not gpus else cpu_only, 120, hide_gpus=not two),
        Step("bench", None if gpus else (
            _PY, "-m", "dreampipe", "bench", "--steps", "10", "--warmup", "2", "--rounds", "3",
            "--no-progress", "--only", *_BENCH_RUNS),
             "the bench compares CPU pipelines by design: `make bench`" if gpus
             else "on the CPU (gloo): the bench compares CPU pipelines by design", 150,
             hide_gpus=True),
        Step("train", (_PY, "benchmarks/train_vs_predicted.py", "--rounds", "3", "--only",
                       "mlp-pipedream", "mlp-dp") if two or not gpus else None,
             on if two or not gpus else cpu_only, 180, hide_gpus=not two),
        Step("memory", (_PY, "benchmarks/memory_vs_predicted.py", "--steps", "4")
             if two or not gpus else None, on if two or not gpus else cpu_only, 90,
             hide_gpus=not two),
    ]


def device_check(device: torch.device) -> int:
    """Step 1 (on ``cuda:0``), in this process: the profiler's timing of the mlp's layers
    on ``device`` and the peak memory measured over it; 0 if both are positive."""
    from dreampipe.models import get_model
    from dreampipe.profiling.profiler import profile_model
    from dreampipe.quantities import format_bytes
    from dreampipe.runtime.memory_meter import start_measuring

    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    spec = get_model("mlp")
    meter = start_measuring(device)
    with meter.counting():
        model = spec.build(seed=0).to(device)
        x, y = spec.sample_input(256).to(device), spec.sample_target(256).to(device)
        graph = profile_model(model, x, spec.loss_fn, y, warmup=3, repeats=20, name=spec.name)
    use = meter.finish(rank=0, stage=0)
    print(f"{'layer':<12} {'forward ms':>10} {'backward ms':>11}")
    for layer in graph.layers:
        print(f"{layer.name:<12} {layer.forward_ms:>10.4f} {layer.backward_ms:>11.4f}")
    passes = graph.meta["pass_ms"]
    print(f"a whole pass: median {statistics.median(passes):.3f} ms "
          f"({min(passes):.3f}-{max(passes):.3f}) over {len(passes)} passes")
    print(f"peak memory above the baseline ({use.kind}): {format_bytes(use.used)} "
          f"(weights {format_bytes(graph.total_parameter_bytes())})")
    ok = all(layer.forward_ms > 0 for layer in graph.layers) and use.used > 0
    return 0 if ok else 1


def _run(step: Step) -> str:
    """Run one step, streaming its output; its verdict."""
    if step.command is None:
        print(f"\n=== {step.name}: skipped: {step.where}", flush=True)
        return "skipped"
    print(f"\n=== {step.name}: {step.where}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(_ROOT / "src"))
    if step.hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.monotonic()
    proc = subprocess.Popen(step.command, cwd=_ROOT, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the step's worker processes too
        proc.wait()
        return f"FAILED: over {step.timeout_s:g} s"
    took = time.monotonic() - start
    if code == OUTSIDE_TOLERANCE and step.name == "train":  # it ran: its figures say how far
        return f"ran ({took:.0f} s): some run off its prediction, see its table"
    return f"passed ({took:.0f} s)" if code == 0 else f"FAILED: exit {code} ({took:.0f} s)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=STEPS, metavar="STEP",
                        help=f"run only these steps: {', '.join(STEPS)}")
    parser.add_argument("--cuda-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cuda_only:
        return device_check(torch.device("cuda", 0))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"{gpus} CUDA device(s); torch {torch.__version__}; {os.cpu_count()} cores")
    verdicts = {s.name: (_run(s), s.where) for s in plan_steps(gpus)
                if not args.only or s.name in args.only}
    print("\n=== summary")
    for name, (verdict, where) in verdicts.items():
        print(f"{name:<12} {verdict:<24} {where}")
    return 1 if any(v.startswith("FAILED") for v, _ in verdicts.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
