"""What a test of the planner holds its plan to where the search's plan was short of whole
rounds (:mod:`dreampipe.planning.whole_rounds`)."""

from __future__ import annotations

from dreampipe.planning.plan import Heuristic, Plan
from dreampipe.planning.whole_rounds import short

__all__ = ["assert_no_slower_than"]


def assert_no_slower_than(got: Plan, time_s: float) -> None:
    """``got`` takes at most ``time_s``, a plan the search holds; or, where a plan of
    whole rounds stood in for the search's (which fit only short of them), it holds whole
    rounds and is at most its stated gap slower."""
    if Heuristic.WHOLE_ROUNDS in got.heuristics:
        assert not short(got.stages)
        assert got.time_per_minibatch_s <= (1 + got.optimality_gap) * time_s * (1 + 1e-9)
    else:
        assert got.time_per_minibatch_s <= time_s * (1 + 1e-9)
