"""Gantt charts of event lists, drawn like the PipeDream paper's figures::

    worker 0 (s0) |[0][1][2][3]    [0][4]  [1][5]  [2][6] ...   blue: forward
    worker 1 (s1) |   [0][1][2]  [0][3]  [1][4]  [2][5] ...     green: backward
    worker 2 (s2) |      [0][1][0][2][1][3][2][4][3] ...        white: idle

One row per rank, forward and backward boxes with the microbatch number written
on them when there is room, hatched on a rank's later stages (interleaving, the
V), an overlapped pair (DualPipeV's ``OVERLAP_F_B``) framed in black around its
two boxes, white where the rank idles; communication (sends, receives,
all-reduces) optionally as thin bars under and over each row. Works for
simulated events and for the runtime's measured ones (any start offset: the
axis is milliseconds from the earliest event).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dreampipe.scheduling.actions import ActionKind
from dreampipe.scheduling.events import Event

__all__ = ["COLOURS", "draw_timeline"]

_K = ActionKind
#: Box colours per action kind (forward blue and backward green, as in the paper).
COLOURS = {
    _K.FORWARD: "#4c72b0",
    _K.BACKWARD: "#55a868",
    _K.WEIGHT: "#8172b3",
    _K.STEP: "#222222",
    _K.ALLREDUCE: "#dd8452",
    _K.SEND_F: "#8c8c8c",
    _K.RECV_F: "#b0b0b0",
    _K.SEND_B: "#8c8c8c",
    _K.RECV_B: "#b0b0b0",
    _K.UNSHARD: "#c44e52",
    _K.RESHARD: "#c44e52",
    _K.OVERLAP: "#000000",
}
_LABELS = {_K.FORWARD: "forward", _K.BACKWARD: "backward", _K.WEIGHT: "weight gradient",
           _K.STEP: "optimizer step",
           _K.ALLREDUCE: "all-reduce", _K.UNSHARD: "weights gathered (ZeRO-3)",
           _K.SEND_F: "send", _K.RECV_F: "receive", _K.OVERLAP: "overlapped F&B"}
# (bottom offset, height) of a kind's bar within a row of height 1.
_BAND = {_K.FORWARD: (0.15, 0.7), _K.BACKWARD: (0.15, 0.7), _K.WEIGHT: (0.15, 0.7),
         _K.STEP: (0.15, 0.7),
         _K.ALLREDUCE: (0.0, 0.12), _K.SEND_F: (0.88, 0.12), _K.SEND_B: (0.88, 0.12),
         _K.RECV_F: (0.88, 0.12), _K.RECV_B: (0.88, 0.12),
         _K.UNSHARD: (0.0, 0.12), _K.RESHARD: (0.0, 0.12), _K.OVERLAP: (0.08, 0.84)}
_COMPUTE = (_K.FORWARD, _K.BACKWARD, _K.WEIGHT, _K.STEP, _K.OVERLAP)
_BOXES = (_K.FORWARD, _K.BACKWARD, _K.WEIGHT)
_MAX_LABELS = 4000
_WIDTH_IN = 14.0


def draw_timeline(
    events: Sequence[Event],
    path: str | Path,
    title: str = "",
    num_ranks: int | None = None,
    *,
    comm: bool = True,
    window_s: tuple[float, float] | None = None,
) -> None:
    """Draw ``events`` as a PNG Gantt chart at ``path``.

    ``num_ranks`` forces the row count (ranks without events stay empty);
    ``comm=False`` leaves communication out; ``window_s`` = ``(start, end)``
    in the events' own seconds draws only that span. Zero-length events
    (free transfers, instant optimizer steps) are not drawn; others are at
    least a pixel wide.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = [e for e in events if e.end_s > e.start_s
             and (comm or e.kind in _COMPUTE)]
    if window_s is not None:
        shown = [e for e in shown if e.end_s > window_s[0] and e.start_s < window_s[1]]
    origin = window_s[0] if window_s else min((e.start_s for e in events), default=0.0)
    end = window_s[1] if window_s else max((e.end_s for e in events), default=origin + 1e-3)
    span_ms = max((end - origin) * 1e3, 1e-6)
    ranks = num_ranks if num_ranks is not None else 1 + max((e.rank for e in events), default=0)
    fig, ax = plt.subplots(figsize=(_WIDTH_IN, 1.2 + 0.42 * ranks))
    px_ms = span_ms / (fig.get_figwidth() * fig.dpi * 0.85)
    firsts = {e.rank: e.stage for e in sorted(events, key=lambda e: -e.stage)}
    bars: dict[tuple[int, ActionKind, bool], list[tuple[float, float]]] = {}
    for e in shown:
        bars.setdefault((e.rank, e.kind, e.stage != firsts[e.rank]), []).append(
            ((e.start_s - origin) * 1e3, max((e.end_s - e.start_s) * 1e3, px_ms)))
    min_edged_ms = 6 * px_ms
    for (rank, kind, later), spans in sorted(bars.items(), key=lambda x: x[0][1] is _K.OVERLAP):
        low, height = _BAND[kind]
        if kind is _K.OVERLAP:  # a frame around the pair's two boxes
            ax.broken_barh(spans, (rank + low, height), facecolors="none",
                           edgecolors=COLOURS[kind], linewidth=1.2)
            continue
        edged = kind in _BOXES
        hatch = "////" if later and edged else None
        wide = [x for x in spans if edged and x[1] >= min_edged_ms]
        narrow = [x for x in spans if not (edged and x[1] >= min_edged_ms)]
        for group, edge in ((wide, "white"), (narrow, "none")):
            if group:
                ax.broken_barh(group, (rank + low, height), facecolors=COLOURS[kind],
                               edgecolors=edge, linewidth=0.5, hatch=hatch)
    _write_microbatches(ax, shown, origin, span_ms, fig.get_figwidth() * fig.dpi * 0.85)
    ax.set_yticks([r + 0.5 for r in range(ranks)])
    ax.set_yticklabels(_row_labels(events, ranks))
    ax.set_ylim(ranks, 0)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)" if origin == 0 else "time (ms from the first event shown)")
    for r in range(1, ranks):
        ax.axhline(r, color="#e0e0e0", linewidth=0.6)
    kinds = {e.kind for e in shown}
    handles = [Patch(facecolor="none" if k is _K.OVERLAP else COLOURS[k],
                     edgecolor=COLOURS[k] if k is _K.OVERLAP else None, label=label)
               for k, label in _LABELS.items()
               if k in kinds or (k is _K.SEND_F and kinds & {_K.SEND_B})
               or (k is _K.RECV_F and kinds & {_K.RECV_B})]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle"))
    if title:
        ax.set_title(title)
    fig.tight_layout(rect=(0.0, 0.3 / fig.get_figheight(), 1.0, 1.0))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
               fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _row_labels(events: Sequence[Event], ranks: int) -> list[str]:
    """``worker 3 (s1.2)``: replica 2 of stage 1; ``worker 1 (s1,s5)`` for interleaved stages."""
    stages: dict[int, set[int]] = {}
    for e in events:
        stages.setdefault(e.rank, set()).add(e.stage)
    first: dict[int, int] = {}
    for rank in sorted(stages):
        for st in stages[rank]:
            first.setdefault(st, rank)
    labels = []
    for r in range(ranks):
        held = sorted(stages.get(r, ()))
        if not held:
            labels.append(f"worker {r}")
        elif len(held) == 1:
            labels.append(f"worker {r} (s{held[0]}.{r - first[held[0]]})")
        else:
            labels.append(f"worker {r} (" + ",".join(f"s{st}" for st in held) + ")")
    return labels


def _write_microbatches(ax: object, events: Sequence[Event], origin: float, span_ms: float,
                        width_px: float) -> None:
    """Write microbatch numbers on compute boxes wide enough to hold them."""
    px_per_ms = width_px / span_ms
    placed = 0
    for e in events:
        if e.kind not in _BOXES:
            continue
        width_ms = (e.end_s - e.start_s) * 1e3
        if width_ms * px_per_ms < 5.5 * len(str(e.microbatch)) + 3:
            continue
        ax.text((e.start_s - origin) * 1e3 + width_ms / 2, e.rank + 0.5,  # type: ignore[attr-defined]
                str(e.microbatch), ha="center", va="center", color="white", fontsize=7,
                clip_on=True)
        placed += 1
        if placed >= _MAX_LABELS:
            return
