"""The synchronous search's floors: the stages' reach answers as a plain greedy does."""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.planning.sync_floors import Reach, envelope, least_largest

__all__: list[str] = []


def _greedy(env: np.ndarray, theta: float, most: int) -> float:
    """The fewest stages of envelope at most ``theta`` covering the layers, one row at a
    time (``most + 1`` past ``most``, inf where a layer alone is above ``theta``)."""
    n, i, count = env.shape[0], 0, 0
    while i < n:
        if count == most:
            return most + 1
        k = 0
        while i + k < n and env[i, i + k] <= theta:
            k += 1
        if k == 0:
            return math.inf
        i, count = i + k, count + 1
    return count


def _env(times: list[float], ties: bool) -> np.ndarray:
    """The envelope of a range table of layer times (sums, so it grows with the range),
    their values rounded to few digits where ``ties`` (equal entries across rows)."""
    t = np.round(np.asarray(times), 1) if ties else np.asarray(times)
    prefix = np.concatenate([[0.0], np.cumsum(t)])
    n = len(t)
    table = np.where(np.triu(np.ones((n, n), dtype=bool)),
                     prefix[None, 1:] - prefix[:-1, None], np.inf)
    return envelope([table])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30), st.booleans(),
       st.floats(0.0, 40.0), st.integers(1, 31))
def test_reach_counts_the_stages_as_a_plain_greedy(times: list[float], ties: bool,
                                                     theta: float, most: int) -> None:
    env = _env(times, ties)
    reach = Reach(env)
    assert reach.stages_within(theta, most) == _greedy(env, theta, most)
    for value in np.unique(env[np.isfinite(env)])[:8]:  # exactly at an entry: it counts
        assert reach.stages_within(float(value), most) == _greedy(env, float(value), most)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 5.0), min_size=2, max_size=11), st.integers(1, 11))
def test_least_largest_is_the_least_largest_stage_of_any_cut(times: list[float],
                                                             count: int) -> None:
    """Over every cut of the layers into at most ``count`` stages, the least largest
    stage: the floor is at most it, and within the bisection's precision of it."""
    env = _env(times, False)
    n = len(times)
    floor = least_largest(Reach(env), count, 0.0)
    best = min(max(env[a, b - 1] for a, b in zip((0, *cuts), (*cuts, n), strict=True))
               for k in range(min(count, n)) for cuts in combinations(range(1, n), k))
    assert best - 1e-3 * env[0, -1] - 1e-12 <= floor <= best + 1e-12
