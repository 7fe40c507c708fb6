"""Human quantities: sizes and bandwidths in, short sizes out."""

from __future__ import annotations

import math

import pytest

from dreampipe.errors import DreampipeError, QuantityError
from dreampipe.quantities import format_bytes, parse_bandwidth, parse_bytes


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("16GB", 16 * 10**9),
        ("16 GB", 16 * 10**9),
        ("16GiB", 16 * 2**30),
        ("512", 512),
        ("1.5MB", 1_500_000),
        ("2e3KB", 2_000_000),
        ("12gb", 12 * 10**9),
        (1024, 1024),
        (2.5, 2),
    ],
)
def test_parse_bytes(text: str | int | float, expect: int) -> None:
    assert parse_bytes(text) == expect


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("10Gbps", 1.25e9),
        ("25Gb/s", 3.125e9),
        ("12GB/s", 12e9),
        ("12GBps", 12e9),
        ("100Mbps", 12.5e6),
        ("1Gibps", 2**30 / 8),
        ("1e9", 1e9),
        (5e8, 5e8),
    ],
)
def test_parse_bandwidth(text: str | float, expect: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expect)


@pytest.mark.parametrize("text", ["fast", "16XB", "-1GB", "GB", "", math.nan, math.inf])
def test_bad_sizes_name_the_value(text: str | float) -> None:
    with pytest.raises(QuantityError) as info:
        parse_bytes(text)
    assert repr(text) in str(info.value)
    assert isinstance(info.value, DreampipeError) and isinstance(info.value, ValueError)


def test_negative_quantities_say_so() -> None:
    with pytest.raises(QuantityError, match="negative"):
        parse_bytes("-1GB")
    with pytest.raises(QuantityError, match="positive"):
        parse_bandwidth("-1Gbps")


@pytest.mark.parametrize("text", ["fast", "10G", "10GHz", "0Gbps", "-5Gbps", math.nan])
def test_bad_bandwidths_are_rejected(text: str | float) -> None:
    with pytest.raises(QuantityError, match=r"bandwidth|quantity|positive"):
        parse_bandwidth(text)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1_600_000_000) == "1.6 GB"
    assert format_bytes(178_000_000) == "178.0 MB"
    assert format_bytes(2.5e12) == "2.5 TB"
    assert parse_bytes(format_bytes(3_000_000_000).replace(" ", "")) == 3_000_000_000


@pytest.mark.parametrize(
    "text", ["1e400GB/s", "1e99999999999GB/s", "1" + "0" * 400 + "Gbps", math.inf, -math.inf]
)
def test_bandwidths_that_overflow_are_rejected(text: str | float) -> None:
    with pytest.raises(QuantityError, match=r"finite|positive") as info:
        parse_bandwidth(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", ["1e400GB", "1e308TiB", "1e99999999999B"])
def test_sizes_that_overflow_are_rejected(text: str) -> None:
    with pytest.raises(QuantityError, match="not a finite size") as info:
        parse_bytes(text)
    assert repr(text) in str(info.value)


def test_tiny_exponents_read_as_zero() -> None:
    assert parse_bytes("1e-400GB") == 0
    with pytest.raises(QuantityError, match="positive"):
        parse_bandwidth("1e-400GB/s")


@pytest.mark.parametrize("text", ["10", " 10 ", "1e9", "2.5"])
def test_a_bandwidth_text_without_a_unit_can_be_refused(text: str) -> None:
    with pytest.raises(QuantityError, match="has no unit") as info:
        parse_bandwidth(text, require_unit=True)
    message = str(info.value)
    assert repr(text) in message
    assert f"{text.strip()}GB/s" in message and f"{text.strip()}Gbps" in message


@pytest.mark.parametrize("text", ["80", " 16 ", "1e9"])
def test_a_size_text_without_a_unit_can_be_refused(text: str) -> None:
    """``--memory 80`` is 80 GB mistyped far more often than 80 bytes."""
    with pytest.raises(QuantityError, match=f"size {text!r} has no unit; write e.g. "
                                            f"{text.strip()}GB"):
        parse_bytes(text, require_unit=True)
    assert parse_bytes(text) == round(float(text))
    assert parse_bytes(80, require_unit=True) == 80
    assert parse_bytes("80GB", require_unit=True) == 80e9


def test_require_unit_still_takes_numbers_and_units() -> None:
    assert parse_bandwidth(5e8, require_unit=True) == 5e8
    assert parse_bandwidth(100, require_unit=True) == 100.0
    assert parse_bandwidth("10Gbps", require_unit=True) == pytest.approx(1.25e9)
    assert parse_bandwidth("100B/s", require_unit=True) == 100.0


@pytest.mark.parametrize(("text", "fix"), [("16Gb", "16GB"), ("1.5Mb", "1.5MB"),
                                           ("2Tib", "2TiB")])
def test_a_size_in_bits_is_refused_naming_the_bytes(text: str, fix: str) -> None:
    with pytest.raises(QuantityError, match=rf"is bits \(as in 10Gbps\).*write {fix}$"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0", "-1", "0.0"])
def test_a_bandwidth_of_no_bytes_is_refused_before_its_unit_is_asked(text: str) -> None:
    with pytest.raises(QuantityError, match=r"must be positive, e\.g\. 10GB/s") as info:
        parse_bandwidth(text, require_unit=True)
    assert f" {text}GB/s" not in str(info.value)  # no bandwidth of none suggested
