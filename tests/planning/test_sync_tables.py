"""The synchronous tables share work between options and read the same values as each alone."""

from __future__ import annotations

import numpy as np
import pytest

from dreampipe.planning.state_bytes import Training
from dreampipe.planning.sync_bands import band, edge, pick
from dreampipe.planning.sync_choices import SyncOptions
from dreampipe.planning.sync_levels import LevelFree, at_level
from dreampipe.planning.sync_search import SyncSearch
from dreampipe.planning.sync_tables import StageTables
from dreampipe.planning.topology import Topology
from dreampipe.planning.zero_terms import HALF_ALLREDUCE, zero_times
from dreampipe.profiling.devices import A100_80GB
from dreampipe.profiling.gpt_spec import gpt_spec_profile, parse_gpt_spec

_GPT = "gpt:layers=4,hidden=1024,heads=16,seq=1024,vocab=8192,batch=8"


def _search() -> SyncSearch:
    topo = Topology.parse("dgx-a100:2")
    graph = gpt_spec_profile(parse_gpt_spec(_GPT), A100_80GB)
    return SyncSearch(graph, topo, SyncOptions(global_batch=64, memory_bytes=8e9,
                                               training=Training("bf16", "adam"),
                                               recompute=True, recompute_blocks=True))


def test_pick_reads_what_two_index_arrays_read() -> None:
    table = np.random.default_rng(0).random((9, 9))
    for rows, last in (band(9, 4), band(9, 9), edge(9, 4, False)[:2], edge(9, 4, True)[:2]):
        assert np.array_equal(pick(table, rows, last), table[rows, last])
    assert pick(table, 2, 5) == table[2, 5]


def _reference(forward: np.ndarray, compute: np.ndarray, again: np.ndarray, end: np.ndarray,
               ar: np.ndarray, wgrad: np.ndarray, level: int, d: int, split: bool
               ) -> tuple[np.ndarray, ...]:
    """A level priced alone, as zero_times' rule reads."""
    made = np.minimum(wgrad, compute - forward)
    z = zero_times(level, d, forward=forward, backward=compute - forward + again,
                   weight_grad=made, allreduce=ar, delay=end - ar + again,
                   gather=ar * HALF_ALLREDUCE, splits_backward=split and level >= 2)
    left = np.where(z.allreduce > 0, np.maximum(0.0, end + again - z.backward), 0.0)
    return np.where(np.isfinite(compute), z.forward + z.backward, np.inf), left + z.step, made


@pytest.mark.parametrize("d", [1, 4])
@pytest.mark.parametrize("split", [False, True])
def test_each_zero_level_from_its_twins_figures_is_the_level_priced_alone(d: int, split: bool
                                                                         ) -> None:
    rng = np.random.default_rng(1)
    forward = rng.random((6, 5))
    compute = forward + rng.random((6, 5))
    compute[0, 0] = np.inf
    again = np.where(rng.random((6, 5)) > 0.5, forward, 0.0)
    ar = np.where(rng.random((6, 5)) > 0.3, rng.random((6, 5)), 0.0)
    end = ar + rng.random((6, 5))
    wgrad = rng.random((6, 5))
    shared = LevelFree.of(forward, compute, again, end, ar, wgrad)
    for level in range(4):
        got = at_level(shared, level, d, split)
        want = _reference(forward, compute, again, end, ar, wgrad, level, d, split)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b), level


def _alone(tables: StageTables, x: int) -> StageTables:
    """The same tables with option ``x`` alone: no twin to share with."""
    return StageTables(tables.inputs, [tables.options[x]], tables.t, tables.d,
                       tables.fraction, tables.splits_backward)


@pytest.mark.parametrize(("t", "d"), [(1, 4), (2, 8)])
def test_options_sharing_twins_read_what_each_alone_reads_at_any_width(t: int, d: int
                                                                            ) -> None:
    search = _search()
    tables = search.tables(t, d, 2, False)
    assert len(tables.options) > 4  # ZeRO twins and ways to recompute share their split
    n = tables.n
    for width in (3, 7, n, 5):  # widths in any order read the same entries
        for x in range(len(tables.options)):
            alone = _alone(tables, x)
            for a, b in zip(tables.times(x, 0, width), alone.times(0, 0, width), strict=True):
                assert np.array_equal(a, b)
            assert np.array_equal(tables.capacity(x, 3e9, width), alone.capacity(0, 3e9, width))
            for last in (False, True):
                assert np.array_equal(tables.edge_capacity(x, 3e9, width, last),
                                      alone.edge_capacity(0, 3e9, width, last))
            assert tables.memory_at(x, 2, 1, n - 2) == alone.memory_at(0, 2, 1, n - 2)


def test_a_band_from_a_column_on_is_the_bands_columns_from_it_on() -> None:
    for width, start in ((4, 1), (9, 3), (12, 11)):
        rows, last = band(9, width)
        part = band(9, width, start)
        assert np.array_equal(part[0], rows[:, start:])
        assert np.array_equal(part[1], last[:, start:])


@pytest.mark.parametrize("alone", [False, True])
def test_a_widened_band_reads_what_a_band_made_at_that_width_reads(alone: bool) -> None:
    search = _search()
    tables = search.tables(2, 8, 2, False)
    if alone:  # no twins: each option's band is made without sharing
        tables = _alone(tables, 5)
    n = tables.n
    for width in (2, 3, 7, 5, n, n + 2, 4):  # wider, then narrower: new stages, then a view
        fresh = StageTables(tables.inputs, tables.options, tables.t, tables.d, tables.fraction,
                            tables.splits_backward)
        for x in range(len(tables.options)):
            for a, b in zip(tables.times(x, 0, width), fresh.times(x, 0, width), strict=True):
                assert a.shape == (n, width)
                assert np.array_equal(a, b)
            assert np.array_equal(tables.capacity(x, 3e9, width), fresh.capacity(x, 3e9, width))
            for last in (False, True):  # the edges widen too: columns after, rows before
                for a, b in zip(tables.edge_times(x, 0, width, last),
                                fresh.edge_times(x, 0, width, last), strict=True):
                    assert a.shape == b.shape == ((min(width, n), 1) if last else (1, width))
                    assert np.array_equal(a, b)
                assert np.array_equal(tables.edge_capacity(x, 3e9, width, last),
                                      fresh.edge_capacity(x, 3e9, width, last))
