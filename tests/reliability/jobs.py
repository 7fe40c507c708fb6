"""What the reliability tests share: a small ``dreampipe train`` run and ways to watch it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["effective", "read_log", "tail", "train_argv", "wait_for"]


def train_argv(ck: Path, *extra: str, steps: int, every: int, profile: Path) -> list[str]:
    """``dreampipe train`` of a 4-layer mlp, 1f1b-flush with momentum, saving into ``ck``
    every ``every`` updates, resuming from there, its data log at ``ck/data.jsonl``,
    planned with ``profile`` (the ``mlp_profile`` fixture's, at 16 samples: a
    minibatch of these 1f1b-flush runs unless ``extra`` sets another batch size)."""
    return ["train", "mlp", "--model-arg", "layers=4", "--model-arg", "width=32",
            "--profile", str(profile),
            "--schedule", "1f1b-flush", "--steps", str(steps), "--batch-size", "16",
            "--lr", "0.05", "--momentum", "0.9", "--checkpoint-dir", str(ck),
            "--checkpoint-every", str(every), "--resume", "--data-log", str(ck / "data.jsonl"),
            "--timeout", "30", "--no-progress", "--json", *extra]


def read_log(path: Path) -> list[dict[str, Any]]:
    """The data log's lines (a line cut short by a kill is left out)."""
    if not path.is_file():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


def effective(lines: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(minibatch, hash) of the minibatches that count: each start rolls back to its ``from``.

    Fails when an attempt resumes past what was trained, or trains a minibatch
    out of order (one lost or trained twice).
    """
    kept: list[tuple[int, str]] = []
    for line in lines:
        if line["event"] == "start":
            assert line["from"] <= len(kept), (line, len(kept))
            del kept[line["from"]:]
        else:
            assert line["minibatch"] == len(kept), (line, len(kept))
            kept.append((line["minibatch"], line["sha256"]))
    return kept


def wait_for(what: str, ready: Callable[[], bool], alive: Callable[[], bool],
             timeout_s: float) -> None:
    """Poll ``ready`` every 10 ms; fail if ``alive`` turns false first or time runs out."""
    end = time.monotonic() + timeout_s
    while not ready():
        assert alive(), f"the run ended before {what}"
        assert time.monotonic() < end, f"no {what} in {timeout_s:g} s"
        time.sleep(0.01)


def tail(path: Path, chars: int = 4000) -> str:
    """The end of a file, for a failure message."""
    return path.read_text()[-chars:] if path.is_file() else f"({path} missing)"
