"""The files ``--trace``, ``--timeline`` and ``-o`` name, checked before any work.

A run must not end in a traceback, or write elsewhere than asked, when it has
done its work: a trace names a file in a directory that exists, and a timeline
also one of the image formats the chart is drawn in (matplotlib's, by suffix:
without one it would write ``NAME.png`` beside the path given). Nor may a
training run find only once its workers have started that its data log is a
directory or its checkpoint directory a file.
"""

from __future__ import annotations

from pathlib import Path

from dreampipe.errors import ConfigError

__all__ = ["IMAGE_SUFFIXES", "check_output_file", "check_output_paths", "check_run_paths"]

#: The image formats a timeline is written in, by suffix (matplotlib's common ones).
IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".eps", ".tif", ".tiff")


def check_output_paths(trace: str | Path | None, timeline: str | Path | None) -> None:
    """A ConfigError naming the flag and the fix where ``trace`` or ``timeline`` (None: not
    asked) is a directory, lies in a directory that does not exist, or, for the timeline,
    has no image suffix."""
    for flag, path, example in (("--trace", trace, "trace.json"),
                                ("--timeline", timeline, "timeline.png")):
        if path is None or str(path) == "":
            if path is not None:
                raise ConfigError(f"{flag} ''; name a file, e.g. {flag} {example}")
            continue
        p = _a_file(flag, path, example)
        if not p.resolve().parent.is_dir():
            raise ConfigError(f"{flag} {path}: directory {str(p.parent)!r} does not exist; "
                              "create it or write elsewhere")
        if flag == "--timeline" and p.suffix.lower() not in IMAGE_SUFFIXES:
            raise ConfigError(
                f"--timeline {path}: the chart is an image; end the name in one of "
                f"{', '.join(IMAGE_SUFFIXES)}, e.g. --timeline {p.with_suffix('.png')}")


def check_output_file(flag: str, path: str | Path | None, example: str,
                      inputs: tuple[str | Path, ...] = ()) -> None:
    """A ConfigError naming ``flag`` and the fix where the file it writes (None: not
    asked) is a directory (``''`` is ``.``), lies in a directory that does not exist, or
    is one of the command's ``inputs``, which it would overwrite."""
    if path is None:
        return
    p = _a_file(flag, path, example)
    if not p.resolve().parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {str(p.parent)!r} does not exist; "
                          "create it or write elsewhere")
    if any(Path(x).is_file() and Path(x).resolve() == p.resolve() for x in inputs):
        raise ConfigError(f"{flag} {path} is the command's own input, which it would "
                          f"overwrite; write elsewhere, e.g. {flag} {example}")


def check_run_paths(data_log: str | Path | None, checkpoint_dir: str | Path | None) -> None:
    """A ConfigError naming the flag and the fix where ``data_log`` (None: not asked) is a
    directory, or ``checkpoint_dir`` is a file (missing directories the run makes)."""
    if data_log is not None:
        _a_file("--data-log", data_log, "data.jsonl")
    if checkpoint_dir is not None and Path(checkpoint_dir).exists() and not Path(
            checkpoint_dir).is_dir():
        raise ConfigError(f"--checkpoint-dir {checkpoint_dir}: is a file, not a directory; "
                          "name a directory (it is made if missing)")


def _a_file(flag: str, path: str | Path, example: str) -> Path:
    """``path`` as given to ``flag``, which names a file: a ConfigError where it is a
    directory, naming ``example`` in it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; name a file in it, e.g. {flag} "
                          f"{p / example}")
    return p
