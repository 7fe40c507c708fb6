"""Schedules exchanged with PyTorch's pipelining CSV: round trips, PyTorch's own files
and runtime checks, and every way a file can be wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _PipelineScheduleRuntime,
)

import dreampipe
from dreampipe.errors import ConfigError, ScheduleError
from dreampipe.scheduling.actions import Schedule
from dreampipe.scheduling.actions import ScheduleKind as S
from dreampipe.scheduling.build import build_schedule
from dreampipe.scheduling.torch_csv import check_file_fits, parse_torch_csv, read_torch_csv
from dreampipe.scheduling.torch_csv_write import torch_csv
from dreampipe.simulation.simulator import SimCosts, simulate_schedule

__all__: list[str] = []

#: The kinds PyTorch's format holds: synchronous, one update, unreplicated stages.
_WRITABLE = [S.FLUSH, S.GPIPE, S.NAIVE, S.ZB_H1, S.ZB_H2, S.INTERLEAVED, S.DP, S.ZBV,
             S.DUALPIPEV]


class _Stage:
    """What PyTorch's schedules read of a stage when they only build their order."""

    def __init__(self, index: int, stages: int, ranks: int) -> None:
        self.stage_index, self.num_stages = index, stages
        self.group_size, self.group_rank = ranks, 0
        self.submod = None  # no module, so nothing to check for torch.compile


def _torch_file(tmp_path: Path, cls: Any, stages: tuple[int, ...], ranks: int,
                num_stages: int, microbatches: int, comms: bool = True) -> Path:
    """The CSV PyTorch's ``cls`` writes for rank 0 holding ``stages`` (its own test stubs
    carry no module: the order needs none, nor a process group)."""
    schedule = cls([_Stage(s, num_stages, ranks) for s in stages], microbatches,
                   loss_fn=lambda out, target: out)
    path = tmp_path / f"{cls.__name__}-{comms}.csv"
    schedule._dump_csv(str(path), format="compute_comms" if comms else "compute_only")
    return path


def _torch_runtime(path: Path, stages: int, ranks: int, microbatches: int,
                   comms: bool) -> _PipelineScheduleRuntime:
    runtime = _PipelineScheduleRuntime([_Stage(0, stages, ranks)], microbatches,
                                       loss_fn=lambda out, target: out)
    runtime._load_csv(str(path), format="compute_comms" if comms else "compute_only")
    return runtime


@st.composite
def _writable(draw: st.DrawFn) -> Schedule:
    kind = draw(st.sampled_from(_WRITABLE))
    if kind in (S.ZBV, S.DUALPIPEV):  # 2 stages a rank, in a V
        ranks = draw(st.integers(1, 3))
        m = draw(st.integers(2 * ranks if kind is S.DUALPIPEV else 1, 8))
        return build_schedule([1] * (2 * ranks), kind, m, m, virtual_stages=2)
    if kind is S.INTERLEAVED:
        ranks, v = draw(st.integers(1, 3)), draw(st.integers(2, 3))
        m = ranks * draw(st.integers(1, 3))
        return build_schedule([1] * (ranks * v), kind, m, m, virtual_stages=v)
    stages = 1 if kind is S.DP else draw(st.integers(1, 4))
    m = draw(st.integers(1, 8))
    return build_schedule([1] * stages, kind, m, m)


@settings(max_examples=150, deadline=None)
@given(_writable(), st.booleans())
def test_every_writable_schedule_reads_back_equal(schedule: Schedule, comms: bool) -> None:
    """With its sends, receives and REDUCE_GRAD, or computations alone (read back through
    dreampipe's communication and update passes)."""
    text = torch_csv(schedule, comms)
    assert len(text.splitlines()) == schedule.num_ranks
    assert ("SEND" in text or "RECV" in text) == (comms and schedule.num_ranks > 1)
    assert parse_torch_csv(text, "x.csv", schedule.kind) == schedule


def test_a_written_file_loads_into_pytorch_and_its_lowering_reads_back(tmp_path: Path) -> None:
    """zb-h1 on 2 stages: PyTorch's runtime takes both forms and finds stage s on rank s;
    what its own lowering makes of the computations is dreampipe's schedule again."""
    zb = build_schedule([1, 1], S.ZB_H1, 4, 4)
    for comms in (True, False):
        path = tmp_path / f"zb-{comms}.csv"
        zb.to_torch_csv(path, comms=comms)
        runtime = _torch_runtime(path, 2, 2, 4, comms)
        assert runtime.stage_index_to_group_rank == {0: 0, 1: 1}
        assert read_torch_csv(path, S.ZB_H1) == zb
    lowered = tmp_path / "lowered.csv"
    runtime._dump_csv(str(lowered))  # compute_comms, by PyTorch's passes
    text = lowered.read_text()
    assert "0I0" in text and "1SEND_B0" in text and "0REDUCE_GRAD" in text
    assert read_torch_csv(lowered, S.ZB_H1) == zb


@pytest.mark.parametrize("comms", [True, False])
def test_pytorchs_interleaved_1f1b_is_dreampipes(tmp_path: Path, comms: bool) -> None:
    """2 ranks, 4 stages, 8 microbatches: PyTorch's order (with UNSHARD, RESHARD and
    REDUCE_GRAD, receives posted early) loads as dreampipe's own interleaved-1f1b, and
    simulates alike."""
    path = _torch_file(tmp_path, ScheduleInterleaved1F1B, (0, 2), 2, 4, 8, comms)
    loaded = read_torch_csv(path)
    assert (loaded.kind, loaded.virtual_stages, loaded.num_microbatches) == (
        S.INTERLEAVED, 2, 8)
    ours = build_schedule([1] * 4, S.INTERLEAVED, 8, 8, virtual_stages=2)
    assert loaded == ours
    costs = SimCosts(forward_s=(1.0,) * 4, backward_s=(2.0,) * 4)
    assert simulate_schedule(loaded, costs).summary() == simulate_schedule(ours, costs).summary()


@pytest.mark.parametrize("comms", [True, False])
def test_a_file_of_gpipes_order_reads_as_gpipe_and_one_of_1f1bs_as_1f1b_flush(
    comms: bool,
) -> None:
    """Left unnamed, a file whose ranks each run all their forwards first is GPipe (as
    written from dreampipe's own), 1F1B's order is 1f1b-flush, one microbatch is either
    (1f1b-flush), and a kind the user names is kept."""
    for kind in (S.GPIPE, S.FLUSH):
        built = build_schedule([1] * 3, kind, 6, 6)
        assert parse_torch_csv(torch_csv(built, comms=comms), "x.csv") == built
    one = build_schedule([1] * 3, S.GPIPE, 1, 1)
    assert parse_torch_csv(torch_csv(one, comms=comms), "x.csv").kind is S.FLUSH
    gpipe = torch_csv(build_schedule([1] * 2, S.GPIPE, 4, 4), comms=comms)
    assert parse_torch_csv(gpipe, "x.csv", S.FLUSH).kind is S.FLUSH


def test_pytorchs_interleaved_zero_bubble_loads_and_fills_the_bubble(tmp_path: Path) -> None:
    """I and W make it zero-bubble's split backward; its W fill what 1F1B leaves idle."""
    zb = read_torch_csv(
        _torch_file(tmp_path, ScheduleInterleavedZeroBubble, (0, 2), 2, 4, 8))
    assert (zb.kind, zb.virtual_stages) == (S.ZB_H1, 2)
    one_f_one_b = read_torch_csv(
        _torch_file(tmp_path, ScheduleInterleaved1F1B, (0, 2), 2, 4, 8))
    costs = SimCosts(forward_s=(1.0,) * 4, backward_s=(2.0,) * 4, weight_grad_s=(1.0,) * 4)
    split, whole = simulate_schedule(zb, costs), simulate_schedule(one_f_one_b, costs)
    assert split.makespan_s < whole.makespan_s
    assert split.bubble_fraction < 0.5 * whole.bubble_fraction


@pytest.mark.parametrize("comms", [True, False])
def test_pytorchs_zbv_is_dreampipes_in_the_v_placement(tmp_path: Path, comms: bool) -> None:
    """2 ranks, 4 stages, 8 microbatches: PyTorch's ScheduleZBVZeroBubble (stage s and 3 - s
    on one rank, the turn 1 -> 2 handed over on rank 1 without a transfer) loads as
    dreampipe's own zbv, action for action, and simulates alike."""
    path = _torch_file(tmp_path, ScheduleZBVZeroBubble, (0, 3), 2, 4, 8, comms)
    loaded = read_torch_csv(path)
    ours = build_schedule([1] * 4, S.ZBV, 8, 8, virtual_stages=2)
    assert (loaded.kind, loaded.stages_of_rank(0), loaded.stages_of_rank(1)) == (
        S.ZBV, (0, 3), (1, 2))
    assert loaded == ours
    costs = SimCosts(forward_s=(1.0,) * 4, backward_s=(2.0,) * 4)
    assert simulate_schedule(loaded, costs).summary() == simulate_schedule(ours, costs).summary()
    assert read_torch_csv(path, S.ZBV) == ours == dreampipe.Schedule.from_torch_csv(path, S.ZBV)
    with pytest.raises(ScheduleError, match=r"places its stages in the v placement but kind "
                       r"zb-h1 in the loop; give zbv or dualpipev"):
        read_torch_csv(path, S.ZB_H1)


def test_a_stage_in_neither_placement_names_the_line() -> None:
    with pytest.raises(ScheduleError, match=r"cell 2 '1F0': stage 1 on rank 0 \(line 1\); "
                       r"dreampipe runs stage s on rank s mod 2: move it to line 2, or place "
                       r"every stage in PyTorch's V \(stage s and 3-s on one rank\)"):
        parse_torch_csv("0F0,1F0\n2F0,3F0", "x.csv")


def test_an_overlapped_pair_runs_its_parts_in_order() -> None:
    overlapped = parse_torch_csv("0F0,(0F1;0B0)OVERLAP_F_B,0B1", "x.csv")
    assert overlapped == parse_torch_csv("0F0,0F1,0B0,0B1", "x.csv")


_TWO = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n"


@pytest.mark.parametrize(("text", "kind", "message"), [
    ("0F0,0X0,0B0", None, r"x\.csv:1: cell 2 '0X0' is not a PyTorch action; write e\.g\. 0F1"),
    ("0F0,0F1abc", None, r"x\.csv:1: cell 2 '0F1abc' is not a PyTorch action"),
    ("0F,0B0", None, r"x\.csv:1: cell 1 '0F': give its microbatch, e\.g\. 0F0"),
    ("0F0,0B0,0REDUCE_GRAD0", None, r"cell 3 '0REDUCE_GRAD0': write 0REDUCE_GRAD with no"),
    ("0F0,0B0\n\n1F0,1B0", None, r"x\.csv:2: no actions; .* remove the empty line"),
    ("", None, r"x\.csv holds no actions"),
    ("0UNSHARD,0RESHARD", None, r"x\.csv computes nothing"),
    ("0F0,0B0\n0F1", None, r"x\.csv:2: cell 1 '0F1': stage 0 on rank 1 \(line 2\); dreampipe "
                           r"runs stage s on rank s mod 2: move it to line 1"),
    ("0F0,0B0,2F0,2B0\n1F0,1B0", None, r"x\.csv: stages 0\.\.2 on 2 ranks \(lines\); give "
                                      r"every rank the same number of stages"),
    ("0F0,0I0,0W0,0F1,0B1", None, r"cell 5 '0B1': a whole backward in a file that splits "
                                  r"others .* write 0I1 0W1"),
    ("0F0,0B0,0REDUCE_GRAD,0F1,0B1", None, r"cell 3 '0REDUCE_GRAD': comes before '0B1' .* "
                                           r"after its last backward"),
    ("0F0,0B0,0REDUCE_GRAD,0REDUCE_GRAD", None, r"cell 3 '0REDUCE_GRAD': comes before "
                                                r"'0REDUCE_GRAD'"),
    ("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0", None,
     r"x\.csv:2: cell 2 '1RECV_F0': no 1F0 follows it on this rank; a receive goes before"),
    ("0F0,0SEND_F0,0RECV_B0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0", None,
     r"cell 4 '0RECV_B0': a second receive of the same data"),
    ("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0", None,
     r"x\.csv: .*every SEND_F needs|x\.csv: .*receives it 1 time"),
    ("0F0,0F1,0B0", None, r"x\.csv: B1 of stage 0 is missing"),
    (_TWO, S.PIPEDREAM, r"kind pipedream updates within a step; .* give a synchronous kind"),
    (_TWO, S.ZB_H1, r"runs whole backwards \(B\) but kind zb-h1 does not; give 1f1b-flush"),
    ("0F0,0I0,0W0", S.GPIPE, r"splits its backwards \(I, W\) but kind gpipe does not; give "
                             r"zb-h1 or zb-h2"),
])
def test_a_bad_file_names_the_place_and_the_fix(text: str, kind: S | None, message: str
                                                ) -> None:
    with pytest.raises(ScheduleError, match=message):
        parse_torch_csv(text, "x.csv", kind)


def test_a_file_reads_as_pytorch_reads_it(tmp_path: Path) -> None:
    """Cells may carry spaces and idle steps (empty cells), lines end in CRLF; the file's
    name prefixes the validator's own errors."""
    assert parse_torch_csv(" 0F0 ,,0B0\r\n", "x.csv") == parse_torch_csv("0F0,0B0", "x.csv")
    path = tmp_path / "short.csv"
    path.write_text("0F0,0F1,0B1\n")
    with pytest.raises(ScheduleError, match=rf"^{path}: B0 of stage 0 is missing"):
        read_torch_csv(path)


@pytest.mark.parametrize(("schedule", "message"), [
    (build_schedule([1, 1], S.PIPEDREAM, 2), r"a pipedream schedule updates within a step"),
    (build_schedule([1, 1], S.TWO_BW, 4, 2), r"a 2bw schedule updates within a step"),
    (build_schedule([2, 1], S.FLUSH, 4, 4), r"stage 0 has 2 replicas; PyTorch's schedule runs "
                                            r"one rank per stage"),
    (build_schedule([1, 1], S.FLUSH, 8, 4), r"8 microbatches, 4 per update; a PyTorch "
                                            r"schedule is one step"),
])
def test_what_pytorchs_format_cannot_hold_is_refused(schedule: Schedule, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        torch_csv(schedule)


def test_a_file_must_fit_the_plan() -> None:
    loaded = parse_torch_csv(_TWO, "x.csv")
    check_file_fits(loaded, [1, 1], 1, 1, "x.csv")
    check_file_fits(loaded, [1, 1], 1, None, "x.csv")
    with pytest.raises(ScheduleError, match=r"x\.csv runs 2 unreplicated stages but the plan "
                                            r"has replicas 2-1"):
        check_file_fits(loaded, [2, 1], 1, None, "x.csv")
    with pytest.raises(ConfigError, match=r"puts 1 stages on each of its 2 ranks, the plan 2; "
                                          r"plan with virtual_stages=1"):
        check_file_fits(loaded, [1, 1], 2, None, "x.csv")
    with pytest.raises(ConfigError, match=r"runs 1 microbatches a minibatch, not "
                                          r"microbatches=4; give microbatches=1"):
        check_file_fits(loaded, [1, 1], 1, 4, "x.csv")
