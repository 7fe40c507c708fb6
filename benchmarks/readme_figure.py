"""Draw the README's picture: the predicted PipeDream 1F1B timeline of a 4-stage GNMT plan.

Runs the two commands a user would, and nothing else draws it:

    dreampipe plan pipedream:gnmt -t 4 -b 10GB/s --straight --all-workers -o PLAN
    dreampipe simulate PLAN --schedule pipedream --minibatches 12 --timeline PNG

(PipeDream's own V100 profile of GNMT-8, cut into 4 stages, one V100 each;
the simulator's timeline: the pipeline fills, then every worker alternates
one forward and one backward.)

    python benchmarks/readme_figure.py [--profile pipedream:gnmt] [--out docs/pipedream-1f1b.png]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dreampipe.cli import main as dreampipe

__all__ = ["main"]

_OUT = Path(__file__).resolve().parents[1] / "docs" / "pipedream-1f1b.png"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="pipedream:gnmt",
                        help="the profile to plan (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=_OUT, help="the PNG (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        plan = str(Path(tmp) / "plan.json")
        code = dreampipe(["plan", args.profile, "-t", "4", "-b", "10GB/s", "--straight",
                          "--all-workers", "-o", plan])
        if code == 0:
            code = dreampipe(["simulate", plan, "--schedule", "pipedream", "--minibatches", "12",
                              "--timeline", str(args.out)])
    return code


if __name__ == "__main__":
    raise SystemExit(main())
