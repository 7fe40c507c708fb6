"""The ``dreampipe`` command: a thin layer over the library.

Each sub-command lives in its own module with a ``register(subparsers)``
function that adds its parser and sets ``func`` to a handler returning the
exit status. Errors a user can cause (:class:`DreampipeError`) are printed
as one line on stderr with exit status 2, never as a traceback; so is a
file the user named that cannot be read or written (an ``OSError`` with a
file name). A :class:`ConfigError` names the library's parameters
(``microbatches=3``); they are printed as the flags that set them
(``--microbatches 3``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from dreampipe.errors import TRACEBACK_HEADER, ConfigError, DreampipeError

__all__ = ["build_parser", "main"]

_COMMANDS = ("profile", "plan", "simulate", "train", "bench", "calibrate")
#: A library parameter as written in a ConfigError, and the flag that sets it.
_FLAGS = {
    "batch_size=": "--batch-size ",
    "checkpoint_every=": "--checkpoint-every ",
    "checkpoint_dir=": "--checkpoint-dir ",
    "config=": "--config ",
    "data_dir=": "--data-dir ",
    "dataset=": "--dataset ",
    "epochs=": "--epochs ",
    "global_batch=": "--global-batch ",
    "layout=": "--layout ",
    "max_stages=": "--max-stages ",
    "lr=": "--lr ",
    "memory_bytes=": "--memory ",
    "microbatch_size=": "--microbatch-size ",
    "microbatches=": "--microbatches ",
    "minibatch_size=": "--batch-size ",
    "minibatches=": "--minibatches ",
    "momentum=": "--momentum ",
    "on_nonfinite=": "--on-nonfinite ",
    "plan_path=": "--plan ",
    "resume=True": "--resume",
    "schedule=": "--schedule ",
    "semantics=": "--semantics ",
    "stages=": "--stages ",
    "stash=False": "--no-stash",
    "steps=": "--steps ",
    "sync=": "--sync ",
    "timeout_s=": "--timeout ",
    "vertical_sync=True": "--vertical-sync",
    "virtual_stages=": "--virtual-stages ",
    "warmup=": "--warmup ",
    "zero_levels=": "--zero-levels ",
    "workers=": "--workers ",
}


#: The unit a flag needs after a bare number the library wrote (sizes are refused without).
_UNITS = {"memory_bytes=": "B"}


def _as_flag(flag: str, unit: str, found: re.Match[str]) -> str:
    """``flag`` with the number written after the parameter, and ``unit`` after it."""
    return flag + found[1] + (unit if found[1] else "")


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors are one line naming the value and where the options are,
    as dreampipe's own are (the sub-commands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dreampipe",
        description=(
            "PipeDream-style pipeline-parallel training for PyTorch: profile a model per "
            "layer, plan stages and replicas for a cluster, simulate any schedule, and train."
        ),
        epilog="Run 'dreampipe COMMAND --help' for the options of each command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"dreampipe.cli.{name}_command").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own options are where to look, not the top level's
        prog = f"{parser.prog} {args.command}"
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)}; "
                       f"see '{prog} --help'\n")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        status: int = args.func(args)
    except DreampipeError as exc:
        print(f"dreampipe {args.command}: error: {_summary(_as_flags(exc), args.verbose)}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (``| head``) went away: stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        if exc.filename is None:
            raise
        print(
            f"dreampipe {args.command}: error: {exc.strerror or exc}: {str(exc.filename)!r}; "
            "check the path and its permissions",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status


def _summary(message: str, verbose: bool) -> str:
    """An error without the workers' tracebacks appended to it, unless ``-v``."""
    head, found, _ = message.partition("\n" + TRACEBACK_HEADER)
    if not found or verbose:
        return message
    return f"{head}\n(run with -v to see each failed rank's traceback)"


def _as_flags(exc: DreampipeError) -> str:
    """The message, with a ConfigError's parameters written as the flags that set them."""
    message = str(exc)
    if not isinstance(exc, ConfigError):
        return message
    for written, flag in _FLAGS.items():
        if written.partition("=")[0] in exc.parameters:
            message = re.sub(rf"\b{re.escape(written)}(\d*)",
                             functools.partial(_as_flag, flag, _UNITS.get(written, "")), message)
    return message
