"""Write a benchmark's table into its section of docs/benchmarks.md (``--write-docs``).

docs/benchmarks.md is generated, never edited by hand: every section sits
between ``<!-- begin NAME -->`` and ``<!-- end NAME -->`` and is replaced
whole by the script that owns it, with the command that ran, the host (CPU,
cores, torch, GPU if any) and the date. The file's header and the order of
the sections come from :data:`SECTIONS`; a missing file is created with
every section empty. The README's benchmark table is a marked block of the
same kind (:func:`replace_block`).

A script adds the flag with :func:`add_argument`, calls :func:`capture`
right after parsing (it tees stdout from then on) and :func:`finish` at the
end of ``main``, which writes what was printed as the section.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import io
import os
import platform
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = [
    "DOCS",
    "README",
    "SECTIONS",
    "Capture",
    "Section",
    "add_argument",
    "capture",
    "finish",
    "host_line",
    "replace_block",
    "write_section",
]

_ROOT = Path(__file__).resolve().parents[1]
DOCS = _ROOT / "docs" / "benchmarks.md"
README = _ROOT / "README.md"


@dataclass(frozen=True)
class Section:
    """One generated section: its marker name, heading and the script that writes it."""

    name: str
    title: str
    command: str


SECTIONS: tuple[Section, ...] = (
    Section("bench-mlp", "dreampipe bench: mlp", "python benchmarks/bench.py --write-docs"),
    Section("bench-transformer", "dreampipe bench: transformer",
            "python benchmarks/bench.py --write-docs"),
    Section("bench-llama", "dreampipe bench: llama", "python benchmarks/bench.py --write-docs"),
    Section("train-vs-predicted", "dreampipe train: measured against predicted",
            "python benchmarks/train_vs_predicted.py --write-docs"),
    Section("memory-vs-predicted", "Peak memory: measured against predicted",
            "python benchmarks/memory_vs_predicted.py --write-docs"),
    Section("memory-options", "Memory options: time and peak memory",
            "python benchmarks/memory_options.py --write-docs"),
    Section("planner", "Planning time", "python benchmarks/bench_planner.py --write-docs"),
    Section("scale", "Planning at 1024 workers", "python benchmarks/bench_scale.py --write-docs"),
    Section("simulator", "Schedule building and simulation",
            "python benchmarks/bench_simulator.py --write-docs"),
    Section("plan-vs-simulated", "The planner's prediction against the simulator",
            "python benchmarks/plan_vs_simulated.py --write-docs"),
    Section("placement-link", "A plan's placement on two nodes: measured against predicted",
            "python benchmarks/placement_link.py --write-docs"),
    Section("schedule-efficiency", "How much of the planner's bound 1F1B-RR reaches",
            "python benchmarks/schedule_efficiency.py --write-docs"),
    Section("operator-search", "Operator search time",
            "python benchmarks/bench_operator_search.py --write-docs"),
)

_HEADER = """\
# Benchmarks

This page is generated: do not edit it. Each section below is written,
whole, by the command named in it (with `--write-docs`), which replaces the
text between its `<!-- begin NAME -->` and `<!-- end NAME -->` markers and
records the host and the date of the run. Timings are medians over repeated
runs with their spread, never a best run; on a shared machine compare the
ratios within one section, not figures across sections or days.
`python benchmarks/paper_table.py` writes [paper-table.md](paper-table.md)
the same way. What the bench measures and how: [training.md](training.md#the-bench).

| section | command |
| --- | --- |
{rows}
"""


def _empty() -> str:
    rows = "\n".join(f"| [{s.title}](#{_anchor(s.title)}) | `{s.command}` |" for s in SECTIONS)
    parts = [_HEADER.format(rows=rows)]
    for s in SECTIONS:
        parts.append(f"## {s.title}\n\n<!-- begin {s.name} -->\nNot generated yet: run "
                     f"`{s.command}`.\n<!-- end {s.name} -->\n")
    return "\n".join(parts)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with what lies between ``name``'s begin and end markers set to ``body``."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no '{begin}' ... '{end}' block; add the two markers first")
    return f"{text[:start + len(begin)]}\n{body.strip()}\n{text[stop:]}"


def host_line() -> str:
    """The CPU model, its cores, torch's version and, once torch is loaded, the GPU."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        cpu = found.group(1).strip() if found else cpu
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    line = f"{cpu}, {os.cpu_count()} cores, torch {torch_version}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        line += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return line


def write_section(name: str, table: str, command: str, *, note: str = "",
                  path: Path | None = None, now: datetime.datetime | None = None) -> None:
    """Replace section ``name`` of ``path`` with ``table`` as a code block, with the
    command that made it, the host and the date (UTC); ``path`` defaults to :data:`DOCS`."""
    path = DOCS if path is None else path
    if name not in {s.name for s in SECTIONS}:
        raise ValueError(f"section {name!r}: add it to SECTIONS in benchmarks/_docs.py")
    when = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d %H:%M UTC")
    body = (f"`{command}` on {host_line()}, {when}.\n"
            + (f"\n{note.strip()}\n" if note else "")
            + f"\n```text\n{table.rstrip()}\n```")
    text = path.read_text() if path.is_file() else _empty()
    path.write_text(replace_block(text, name, body))


class Capture(io.TextIOBase):
    """Everything written to stdout from :func:`capture` on, still printed."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._parts: list[str] = []

    def write(self, s: str) -> int:
        self._parts.append(s)
        return self._out.write(s)

    def flush(self) -> None:
        self._out.flush()

    def text(self) -> str:
        return "".join(self._parts)

    def close(self) -> None:
        sys.stdout = self._out


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--write-docs`` to a benchmark's parser."""
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into its section of docs/benchmarks.md")


def capture(args: argparse.Namespace) -> Capture | None:
    """Tee stdout from now on when ``--write-docs`` was given."""
    if not args.write_docs:
        return None
    tee = Capture(sys.stdout)
    sys.stdout = tee
    return tee


def finish(tee: Capture | None, name: str, script: str, argv: Sequence[str] | None = None,
           *, note: str = "") -> None:
    """Stop teeing and write what was printed as section ``name``; the command shown is
    ``script`` (the caller's ``__file__``) with ``argv`` (default ``sys.argv[1:]``),
    less ``--write-docs``."""
    if tee is None:
        return
    tee.close()
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--write-docs"]
    command = shlex.join(["python", f"benchmarks/{Path(script).name}", *args])
    write_section(name, tee.text(), command, note=note)
    print(f"wrote section {name!r} of {DOCS.relative_to(_ROOT)}", file=sys.stderr)
