"""Each rank's peak memory in ``dreampipe train`` against the planner's prediction.

Trains the mlp (8 layers of 2048, minibatches of 64) and the cnn (hidden
2048, minibatches of 256) on 2 local workers, 2 stages each, under
``pipedream`` with and without weight stashing (``--no-stash``), every run
in fresh processes, and prints for every stage the predicted bytes, the
measured peak above the rank's baseline (docs/memory.md) and their ratio,
with PASS when every ratio is within ``--tolerance`` of 1.

    python benchmarks/memory_vs_predicted.py [--steps 6] [--tolerance 0.25] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import _docs

from dreampipe.quantities import format_bytes

__all__ = ["MODELS", "main"]

#: Model arguments of each workload: ``dreampipe train`` flags.
MODELS = {
    "mlp": ("mlp", "--model-arg", "width=2048", "--model-arg", "layers=8", "--stages", "0,4",
            "--batch-size", "64"),
    "cnn": ("cnn", "--model-arg", "hidden=2048", "--stages", "0,2", "--batch-size", "256"),
}


def _train(args: tuple[str, ...], steps: int, timeout_s: float) -> list[dict[str, float]]:
    """The ``memory`` rows of one fresh ``dreampipe train --json``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dreampipe", "train", *args, "--workers", "2", "--config",
           "straight", "--steps", str(steps), "--json", "--no-progress", "--measure-memory"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows: list[dict[str, float]] = json.loads(done.stdout)["memory"]
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="minibatches per run (default 6)")
    parser.add_argument("--tolerance", type=float, default=0.25,
                        help="largest |ratio - 1| that passes (default 0.25)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds each run may take (default 600)")
    _docs.add_argument(parser)
    args = parser.parse_args(argv)
    tee = _docs.capture(args)
    print(f"{'model':<5} {'stashing':<8} {'rank':>4} {'stage':>5} {'predicted':>10} "
          f"{'measured':>10} {'ratio':>6}")
    worst = 0.0
    for model, flags in MODELS.items():
        for stash in (True, False):
            run = flags if stash else (*flags, "--no-stash")
            for row in _train(run, args.steps, args.timeout):
                ratio = float(row["ratio"])
                worst = max(worst, abs(ratio - 1))
                print(f"{model:<5} {'on' if stash else 'off':<8} {int(row['rank']):>4} "
                      f"{int(row['stage']):>5} {format_bytes(row['predicted_bytes']):>10} "
                      f"{format_bytes(row['measured_bytes']):>10} {ratio:>6.2f}", flush=True)
    verdict = "PASS" if worst <= args.tolerance else "FAIL"
    print(f"{verdict}: every ratio within {worst:.2f} of 1 (tolerance {args.tolerance:g})")
    _docs.finish(tee, "memory-vs-predicted", __file__, argv)


if __name__ == "__main__":
    main()
