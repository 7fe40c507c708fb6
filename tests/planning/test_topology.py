"""Topology: parsing shapes and presets, bandwidth between workers, clear errors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dreampipe.errors import DreampipeError, TopologyError
from dreampipe.planning.topology import DEFAULT_BANDWIDTHS, PRESETS, Level, Topology
from dreampipe.quantities import parse_bandwidth


def test_shape_is_outermost_first_levels_innermost_first() -> None:
    topo = Topology.parse("2x8")
    assert [lv.count for lv in topo.levels] == [8, 2]
    assert topo.shape == "2x8" and topo.num_workers == 16
    assert topo.levels[0].bandwidth == parse_bandwidth(DEFAULT_BANDWIDTHS[0])
    assert topo.levels[1].bandwidth == parse_bandwidth(DEFAULT_BANDWIDTHS[1])


def test_flat_and_deep_shapes() -> None:
    assert [lv.count for lv in Topology.parse("16").levels] == [16]
    deep = Topology.parse("2x2x4", ["50GB/s", "10GB/s", "1GB/s"])
    assert [lv.count for lv in deep.levels] == [4, 2, 2]
    assert [lv.bandwidth for lv in deep.levels] == [50e9, 10e9, 1e9]
    # without bandwidths, outer levels beyond the defaults repeat the last default
    default = Topology.parse("2x2x4")
    assert [lv.bandwidth for lv in default.levels] == [
        parse_bandwidth(DEFAULT_BANDWIDTHS[0]), *[parse_bandwidth(DEFAULT_BANDWIDTHS[1])] * 2
    ]


def test_presets_match_the_paper_clusters() -> None:
    a, b, c = PRESETS["cluster-a"], PRESETS["cluster-b"], PRESETS["cluster-c"]
    assert (a.shape, b.shape, c.num_workers) == ("4x4", "2x8", 4)
    assert a.levels[1].bandwidth == pytest.approx(10e9 / 8)  # 10 Gbps
    assert b.levels[1].bandwidth == pytest.approx(25e9 / 8)  # 25 Gbps
    assert a.memory_bytes == b.memory_bytes == 16 * 10**9 and c.memory_bytes == 12 * 10**9
    assert Topology.parse("cluster-a") == a


def test_preset_overrides() -> None:
    topo = Topology.parse("cluster-b", ["100GB/s"], memory="32GB")
    assert topo.name == "cluster-b" and topo.shape == "2x8"
    assert topo.levels[0].bandwidth == 100e9
    assert topo.memory_bytes == 32 * 10**9


def test_bandwidth_between() -> None:
    topo = Topology.parse("4x4", ["10GB/s", "1GB/s"])
    assert math.isinf(topo.bandwidth_between(3, 3))
    assert topo.bandwidth_between(0, 3) == 10e9  # same server
    assert topo.bandwidth_between(3, 4) == 1e9  # neighbours across servers
    assert topo.bandwidth_between(15, 0) == 1e9


def test_links_between_are_a_pairs_own_inside_a_server_and_its_servers_across() -> None:
    topo = Topology((Level(4, 1e10), Level(2, 1e9), Level(2, 1e8)))  # 2 x 2 servers of 4
    assert topo.links_between(1, 2) == ((0, 1, 2),)
    assert topo.links_between(2, 1) == ((0, 2, 1),)
    # servers 0 and 1 meet at level 1: server 0's link out, server 1's link in
    assert topo.links_between(1, 6) == ((1, 0, 0), (1, 1, 1))
    assert topo.links_between(3, 5) == topo.links_between(1, 6)
    # level 2 joins pairs of servers: the units are the level-1 groups 0 and 1
    assert topo.links_between(6, 9) == ((2, 0, 0), (2, 1, 1))
    assert topo.links_between(9, 6) == ((2, 0, 1), (2, 1, 0))


def test_flat_takes_the_slowest_link() -> None:
    flat = Topology.parse("cluster-a").flat()
    assert len(flat.levels) == 1 and flat.num_workers == 16
    assert flat.levels[0].bandwidth == pytest.approx(10e9 / 8)


def test_describe_names_everything() -> None:
    text = Topology.parse("cluster-a").describe()
    assert "cluster-a" in text and "16 workers" in text and "16.0 GB" in text


@pytest.mark.parametrize(
    ("spec", "bandwidths", "message"),
    [
        ("0", None, "level of 0 workers"),
        ("4x0", None, "level of 0 workers"),
        ("cluster-z", None, "cluster-a, cluster-b, cluster-c"),
        ("4 by 4", None, "shape like 16, 4x4"),
        ("4x4", ["1GB/s", "1GB/s", "1GB/s"], "3 bandwidths for 2 levels"),
        ("4x4", ["0Gbps"], "must be positive"),
        ("4x4", ["fast"], "not a quantity"),
    ],
)
def test_nonsense_is_rejected(spec: str, bandwidths: list[str] | None, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology.parse(spec, bandwidths)


def test_direct_construction_is_checked() -> None:
    with pytest.raises(DreampipeError, match="at least 1 unit"):
        Level(0, 1e9)
    with pytest.raises(TopologyError, match="positive and finite"):
        Level(4, -1.0)
    with pytest.raises(TopologyError, match="at least one level"):
        Topology(())
    with pytest.raises(TopologyError, match="must be positive"):
        Topology((Level(2, 1e9),), memory_bytes=0)
    with pytest.raises(TopologyError, match="'-1GB' is negative"):
        Topology.parse("4", memory="-1GB")


# ---- bandwidths: one per level, with a unit, finite ------------------------------
@pytest.mark.parametrize(
    ("spec", "bandwidths", "needles"),
    [
        ("4x4", ["10GB/s"], ["'4x4' has 2 levels", "needs 2 bandwidths", "innermost first",
                             "got 1: ['10GB/s']"]),
        ("2x2x4", ["50GB/s", "10GB/s"], ["has 3 levels", "needs 3 bandwidths", "got 2"]),
        ("4x4", ["10"], ["bandwidth '10' has no unit", "10GB/s", "10Gbps"]),
        ("4x4", ["10GB/s", "1e9"], ["'1e9' has no unit"]),
        ("4x4", ["1e400GB/s", "1GB/s"], ["'1e400GB/s'", "finite"]),
        ("4", ["1e-320B/s"], ["'1e-320B/s'", "below 1 byte/s"]),
        ("cluster-a", ["1GB/s", "1GB/s", "1GB/s"], ["3 bandwidths for 2 levels", "cluster-a"]),
        ("cluster-a", ["10"], ["'10' has no unit"]),
    ],
)
def test_bad_bandwidths_name_the_value_and_the_fix(
    spec: str, bandwidths: list[str], needles: list[str]
) -> None:
    with pytest.raises(TopologyError) as info:
        Topology.parse(spec, bandwidths)
    for needle in needles:
        assert needle in str(info.value)


def test_numbers_from_python_are_bytes_per_second() -> None:
    topo = Topology.parse("4x4", [1e10, 1.25e9])
    assert [lv.bandwidth for lv in topo.levels] == [1e10, 1.25e9]
    with pytest.raises(TopologyError, match="finite"):
        Topology.parse("4", [math.inf])


def test_a_preset_keeps_its_outer_bandwidths() -> None:
    topo = Topology.parse("cluster-b", ["100GB/s"])
    assert topo.levels[0].bandwidth == 100e9
    assert topo.levels[1].bandwidth == PRESETS["cluster-b"].levels[1].bandwidth
    both = Topology.parse("cluster-b", ["100GB/s", "1GB/s"])
    assert [lv.bandwidth for lv in both.levels] == [100e9, 1e9]


def test_one_bandwidth_for_one_level() -> None:
    assert Topology.parse("8", ["1GB/s"]).levels[0].bandwidth == 1e9


def test_a_level_slower_than_one_byte_per_second_is_rejected() -> None:
    with pytest.raises(TopologyError, match="at least 1 byte/s"):
        Level(4, 0.5)
    assert Level(4, 1.0).bandwidth == 1.0


# ---- servers NAME:N and the devices presets carry -----------------------------------
def test_dgx_a100_servers() -> None:
    topo = Topology.parse("dgx-a100:3")
    assert topo.shape == "3x8" and topo.num_workers == 24 and topo.name == "dgx-a100:3"
    assert topo.levels[0].bandwidth == 300e9  # NVSwitch, each way per GPU
    assert topo.levels[1].bandwidth == pytest.approx(8 * 200e9 / 8)  # 8 x 200 Gb/s HDR
    assert topo.device is not None and topo.device.peak_flops == 312e12
    assert topo.memory_bytes == topo.device.memory_bytes == 80 * 10**9
    assert [lv.latency for lv in topo.levels] == pytest.approx([10e-6, 50e-6])
    assert "A100-80GB, 312 TFLOP/s" in topo.describe()


def test_megatrons_dgx_2h_and_pipedreams_v100_servers() -> None:
    dgx = Topology.parse("dgx-2h:4")
    assert dgx.shape == "4x16"
    assert dgx.levels[0].bandwidth == 150e9  # Megatron-LM's 300 GB/s counts both directions
    assert dgx.levels[1].bandwidth == pytest.approx(100e9)  # 8 x 100 Gb/s
    assert dgx.device is not None
    assert (dgx.device.peak_flops, dgx.memory_bytes) == (125e12, 32 * 10**9)
    p3 = Topology.parse("p3.16xlarge:2")
    assert p3.shape == "2x8" and p3.levels[1].bandwidth == pytest.approx(25e9 / 8)
    assert p3.device is not None and p3.memory_bytes == 16 * 10**9
    # PipeDream's cluster-b is two of them; cluster-a's V100s time profiles by shape too
    assert dataclasses.replace(p3, name="cluster-b") == PRESETS["cluster-b"]
    assert PRESETS["cluster-a"].device == p3.device
    assert PRESETS["cluster-c"].device is None and Topology.parse("4x4").device is None


def test_overrides_keep_the_device_and_the_latencies() -> None:
    topo = Topology.parse("dgx-a100:2", ["100GB/s"], memory="40GB", latencies=["1us"])
    assert topo.device == Topology.parse("dgx-a100:1").device
    assert topo.memory_bytes == 40 * 10**9
    assert [lv.bandwidth for lv in topo.levels] == [100e9, 200e9]
    assert [lv.latency for lv in topo.levels] == pytest.approx([1e-6, 50e-6])
    assert Topology.parse("cluster-b", ["1GB/s"]).levels[1].latency == pytest.approx(50e-6)
    assert topo.flat().device == topo.device


@pytest.mark.parametrize(("spec", "needles"), [
    ("dgx-a100", ["needs its number of servers", "dgx-a100:2"]),
    ("dgx-a100:0", ["'0' is not a whole number of servers", "dgx-a100:2"]),
    ("dgx-2h:two", ["'two'"]),
    ("dgx-h100:2", ["unknown topology", "dgx-a100:N, dgx-2h:N, p3.16xlarge:N"]),
])
def test_bad_servers_name_the_value_and_the_fix(spec: str, needles: list[str]) -> None:
    with pytest.raises(TopologyError) as info:
        Topology.parse(spec)
    for needle in needles:
        assert needle in str(info.value)
