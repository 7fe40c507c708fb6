"""Where ``dreampipe train`` starts in its checkpoint folder, and that a resumed run
reads the data the saved run would have read next.

A run that resumes continues from the newest committed checkpoint at its data
position, counted in minibatches: minibatch ``k`` of the dataset stream is
``data.batch(k, minibatch_size)``, shuffled per epoch from the seed. So the
dataset, the minibatch size, the seed and the sequence lengths must be the saved
run's, or the rest of the run would train samples again, skip others, or draw
another order, silently. The folder keeps them in :data:`DATA_FILE`; a resumed
run that asks for other values is refused, naming them. A run that does not
resume refuses a folder that holds committed checkpoints: its saves would mix with
the earlier run's, and a later resume would take whichever is newest.
docs/training.md, "Checkpoints".
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from dreampipe.api import checkpoint
from dreampipe.commands.train_config import TrainOptions
from dreampipe.commands.train_plan import Say
from dreampipe.errors import ConfigError
from dreampipe.planning.plan import Plan

__all__ = ["DATA_FILE", "check_folder", "nothing_left", "resume_point", "tidy"]

_log = logging.getLogger(__name__)

#: The file in a checkpoint folder that records what the run's data position counts.
DATA_FILE = "train-data.json"


def _data(run: TrainOptions) -> dict[str, Any]:
    """What a minibatch number means for ``run``: its data, by the names of the flags."""
    return {"dataset": run.dataset, "batch_size": run.minibatch_size, "seed": run.config.seed,
            "seq_lengths": None if run.seq_lengths is None else "{}:{}".format(*run.seq_lengths)}


def check_folder(directory: Path | None, resume: bool, run: TrainOptions, *,
                 lead: bool) -> None:
    """Refuse a start that would mix two runs in ``directory``, or resume its newest
    checkpoint on other data (every rank, so that all stop alike, before anything is
    profiled); the ``lead`` rank records the data of a run that starts anew."""
    if directory is None:
        return
    record = directory / DATA_FILE
    found = checkpoint.latest(directory) if resume else None
    if found is None:
        done = checkpoint.committed(directory)
        if done:
            names = (", ".join(p.name for p in done) if len(done) < 4
                     else f"{done[0].name} .. {done[-1].name}")
            raise ConfigError(
                f"checkpoint_dir={str(directory)!r} already holds {names}, committed by an "
                "earlier run; continue that run with --resume, or give a new --checkpoint-dir "
                "(or remove them)", "checkpoint_dir")
        if lead:
            directory.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(_data(run)) + "\n")
        return
    if not record.is_file():
        if lead:
            _log.warning("%s records no data settings (an older run's): the resumed run "
                         "cannot check that it reads the data the saved run would have",
                         directory)
        return
    saved, asked = json.loads(record.read_text()), _data(run)
    differ = [f"--{k.replace('_', '-')} {asked[k]} (saved at {saved.get(k)})"
              for k in asked if saved.get(k) != asked[k]]
    if differ:
        raise ConfigError(
            f"resuming {found} at minibatch {checkpoint.minibatches_of(found)} counts its "
            f"data position in minibatches of the saved run's data, but this run asks for "
            f"{', '.join(differ)}: the rest of the epoch would train samples again or skip "
            "them; resume with the saved values, or start a new run in a new --checkpoint-dir",
            "checkpoint_dir")


def nothing_left(found: Path | None, steps: int, say: Say | None) -> bool:
    """Whether the checkpoint a run resumes from, ``found``, already holds all ``steps``.

    A run killed after its last save (evaluating, or exiting) comes back under
    torchrun with the same command: it has nothing left to train, which is
    not an error (exit 0), and saying so is all there is to do.
    """
    if found is None or checkpoint.minibatches_of(found) != steps:
        return False
    line = f"{found} already holds all {steps} minibatches: nothing left to train"
    _log.info("%s", line)
    if say is not None:
        say(line)
    return True


def resume_point(directory: Path | None, resume: bool, steps: int) -> Path | None:
    """The checkpoint a resumed run continues from (None: none yet), not past ``steps``."""
    if not resume or directory is None:
        return None
    found = checkpoint.latest(directory)
    if found is not None and (done := checkpoint.minibatches_of(found)) > steps:
        raise ConfigError(f"steps={steps} but the checkpoint is at {done} minibatches; "
                          f"steps is the total: use more than {done}", "steps")
    return found


def tidy(directory: Path | None, found: Path | None, resume: bool, plan: Plan,
         say: Say | None) -> None:
    """Remove the saves that never committed, and say where the run starts (the lead only)."""
    if directory is None:
        return
    lines = []
    for stale in checkpoint.partial(directory):
        shutil.rmtree(stale, ignore_errors=True)
        lines.append(f"removed {stale}: its save never committed")
    if found is not None:
        lines.append(checkpoint.resume_note(found, plan))
    elif resume:
        lines.append(f"no committed checkpoint in {directory} yet: starting at minibatch 0")
    for line in lines:
        _log.info("%s", line)
        if say is not None:
            say(line)
