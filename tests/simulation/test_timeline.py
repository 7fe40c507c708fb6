"""Timelines: PNG Gantt charts and Chrome traces of simulated and measured events."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from dreampipe.scheduling.actions import ActionKind, ScheduleKind
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.events import Event, load_events, save_events
from dreampipe.simulation.chrome_trace import chrome_trace, write_chrome_trace
from dreampipe.simulation.simulator import SimCosts, simulate_schedule
from dreampipe.simulation.timeline import draw_timeline

K = ActionKind
_PNG = b"\x89PNG\r\n\x1a\n"


def _simulated() -> list[Event]:
    costs = SimCosts(forward_s=(1e-3, 2e-3, 1e-3), backward_s=(2e-3, 4e-3, 2e-3),
                     activation_bytes=(1e3, 1e3), bandwidth=1e6, allreduce_s=(0.0, 1e-3, 0.0))
    schedule = build_schedule((1, 2, 1), ScheduleKind.PIPEDREAM, 8)
    return list(simulate_schedule(schedule, costs).events)


def _measured() -> list[Event]:
    """Like the runtime's: wall-clock offset, gaps, overlapping communication."""
    t0 = 1_700_000_000.0
    out = []
    for u in range(30):
        out.append(Event(0, 0, K.FORWARD, u, t0 + 0.01 * u, t0 + 0.01 * u + 0.004))
        out.append(Event(0, 0, K.SEND_F, u, t0 + 0.01 * u + 0.004, t0 + 0.01 * u + 0.03))
        out.append(Event(1, 1, K.FORWARD, u, t0 + 0.01 * u + 0.03, t0 + 0.01 * u + 0.035))
    return out


@pytest.mark.parametrize("events", [_simulated(), _measured()], ids=["simulated", "measured"])
def test_draw_timeline_writes_a_png(tmp_path: Path, events: list[Event]) -> None:
    path = tmp_path / "t.png"
    draw_timeline(events, path, title="test", num_ranks=5)
    data = path.read_bytes()
    assert data.startswith(_PNG) and len(data) > 10_000


def test_draw_timeline_window_and_no_comm(tmp_path: Path) -> None:
    events = _simulated()
    path = tmp_path / "w.png"
    draw_timeline(events, path, comm=False, window_s=(0.005, 0.02))
    assert path.read_bytes().startswith(_PNG)


def test_draw_timeline_of_nothing_still_draws(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    draw_timeline([], path, num_ranks=2)
    assert path.read_bytes().startswith(_PNG)


@pytest.mark.parametrize("events", [_simulated(), _measured()], ids=["simulated", "measured"])
def test_chrome_trace_structure(tmp_path: Path, events: list[Event]) -> None:
    path = tmp_path / "t.json"
    write_chrome_trace(events, path)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(events)
    assert {e["pid"] for e in slices} == {e.rank for e in events}
    assert min(e["ts"] for e in slices) == 0
    first = min(events, key=lambda e: e.start_s)
    longest = max(e.end_s - first.start_s for e in events)
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(longest * 1e6, rel=1e-6)
    assert {e["name"] for e in slices} == {e.label for e in events}
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(names) == len({e.rank for e in events})


def test_events_files_say_microbatch_and_read_the_old_unit_key_too(tmp_path: Path) -> None:
    events = _simulated()
    path = tmp_path / "events.json"
    save_events(events, path)
    data = json.loads(path.read_text())
    assert all("microbatch" in d and "unit" not in d for d in data["events"])
    assert load_events(path) == events
    for d in data["events"]:
        d["unit"] = d.pop("microbatch")
    path.write_text(json.dumps(data))
    assert load_events(path) == events
    args = [e["args"] for e in chrome_trace(events)["traceEvents"] if e["ph"] == "X"]
    assert sorted(a["microbatch"] for a in args) == sorted(e.microbatch for e in events)


def test_chrome_trace_lanes_never_overlap() -> None:
    trace = chrome_trace(_measured())
    lanes: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert len({tid for _, tid in lanes}) > 2
    for spans in lanes.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans))
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("F")]
    assert {e["tid"] for e in compute} == {0}


def test_weight_gradients_and_interleaved_workers_are_drawn_and_traced(tmp_path: Path) -> None:
    costs = SimCosts(forward_s=(1e-3,) * 4, backward_s=(2e-3,) * 4)
    zb = simulate_schedule(build_schedule((1,) * 4, ScheduleKind.ZB_H1, 4, 4), costs).events
    assert any(e.kind is K.WEIGHT for e in zb)
    draw_timeline(zb, tmp_path / "zb.png", "zb-h1")
    assert (tmp_path / "zb.png").read_bytes().startswith(_PNG)
    trace = chrome_trace(zb)["traceEvents"]
    assert {x["tid"] for x in trace if x.get("name", "").startswith("W")} == {0}  # compute lane
    inter = simulate_schedule(build_schedule((1,) * 4, ScheduleKind.INTERLEAVED, 4, 4,
                                             virtual_stages=2), costs).events
    names = {x["args"]["name"] for x in chrome_trace(inter)["traceEvents"]
             if x["name"] == "process_name"}
    assert names == {"rank 0 (stages 0, 2)", "rank 1 (stages 1, 3)"}
    draw_timeline(inter, tmp_path / "inter.png", "interleaved", 2)
    assert (tmp_path / "inter.png").read_bytes().startswith(_PNG)
