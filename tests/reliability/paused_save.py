"""``python paused_save.py STEP dreampipe-args...``: ``dreampipe`` whose checkpoint write to a
folder named ``STEP`` (e.g. ``step-40.tmp``) writes its data and then never returns.

A test launches this under torchrun and kills the writer there, in the
middle of a save; the product has no such hook.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from dreampipe.cli import main

_write = FileSystemWriter.write_data


def _stalled(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
    written = _write(self, plan, planner)
    if str(self.path).endswith(sys.argv[1]):
        written.wait()
        time.sleep(3600)
    return written


if __name__ == "__main__":
    FileSystemWriter.write_data = _stalled
    sys.exit(main(sys.argv[2:]))
