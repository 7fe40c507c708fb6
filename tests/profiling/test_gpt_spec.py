"""``gpt:...`` profiles by shape: strict parsing, its text read back, times from a device."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreampipe.errors import ProfileError
from dreampipe.profiling.devices import A100_80GB, A100_SUSTAINED_FRACTION, V100_32GB, Device
from dreampipe.profiling.gpt_shapes import GELU_BYTES, NORM_BYTES, GptShape
from dreampipe.profiling.gpt_spec import GptSpec, by_shape, gpt_spec_profile, parse_gpt_spec
from dreampipe.profiling.load import load_graph

SMALL = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000"


def test_a_spec_gives_its_shape_and_the_defaults() -> None:
    spec = parse_gpt_spec(SMALL)
    s = spec.shape
    assert (s.layers, s.hidden, s.heads, s.seq, s.vocab) == (4, 256, 4, 128, 1000)
    assert (s.batch, spec.param_bytes) == (1, 4)
    assert spec.text == s.name == SMALL
    other = parse_gpt_spec("gpt:vocab=7, param_bytes=2,seq=3,batch=5,heads=2,hidden=8,layers=1")
    assert (other.shape.batch, other.param_bytes, other.shape.vocab) == (5, 2, 7)
    assert other.text == "gpt:layers=1,hidden=8,heads=2,seq=3,vocab=7,batch=5,param_bytes=2"


@pytest.mark.parametrize(("text", "needles"), [
    ("gpt:", ["'' is not KEY=VALUE"]),
    ("gpt:layers=4,hidden=256,heads=4,seq=128", ["misses vocab", "e.g. gpt:layers="]),
    ("gpt:layers=4,hidden=256,heads=4", ["misses seq, vocab"]),
    (SMALL + ",width=3", ["unknown key 'width'", "batch (default 1)", "param_bytes"]),
    (SMALL + ",layers=5", ["gives layers twice"]),
    (SMALL.replace("layers=4", "layers=0"), ["layers='0' is not a whole number >= 1"]),
    (SMALL.replace("seq=128", "seq=-1"), ["seq='-1'"]),
    (SMALL.replace("seq=128", "seq=1.5"), ["seq='1.5'"]),
    (SMALL.replace("vocab=1000", "vocab="), ["vocab=''"]),
    (SMALL.replace("heads=4", "heads"), ["'heads' is not KEY=VALUE"]),
    (SMALL.replace("heads=4", "heads=6"), ["heads=6 does not divide hidden=256", "4 or 8"]),
    (SMALL.replace("hidden=256", "hidden=7"), ["heads=4 does not divide hidden=7", "e.g. 1"]),
    (SMALL + ",param_bytes=3", ["param_bytes=3", "give 4", "or 2"]),
    ("gptx:layers=1", ["not a profile by shape"]),
])
def test_a_bad_spec_names_the_value_and_the_fix(text: str, needles: list[str]) -> None:
    with pytest.raises(ProfileError) as info:
        parse_gpt_spec(text)
    for needle in needles:
        assert needle in str(info.value)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 64), st.integers(1, 64), st.integers(1, 8192),
       st.integers(1, 100_000), st.integers(1, 64), st.sampled_from([2, 4]))
def test_the_text_reads_back_to_the_same_spec(
    layers: int, width: int, heads: int, seq: int, vocab: int, batch: int, param_bytes: int,
) -> None:
    shape = GptShape("", layers, width * heads, heads, seq, vocab, batch)
    spec = GptSpec(shape, param_bytes)
    again = parse_gpt_spec(spec.text)
    assert again.text == spec.text
    assert again.param_bytes == param_bytes
    assert (again.shape.layers, again.shape.hidden, again.shape.heads, again.shape.seq,
            again.shape.vocab, again.shape.batch) == (layers, width * heads, heads, seq, vocab,
                                                      batch)


def test_the_device_times_the_layers() -> None:
    graph = load_graph(SMALL + ",batch=2", A100_80GB)
    assert by_shape(graph) and graph.model == SMALL + ",batch=2" and graph.batch_size == 2
    assert len(graph) == 6 * 4 + 3
    s, b, h = 128, 2, 256
    fc1 = graph.layers[5]
    assert fc1.name == "b0.fc1"
    # fc1 is a (s b, h) x (h, 4h) product: 2 s b h 4h flops at the A100's sustained share of
    # the peak or its 16-bit operands at that share of the memory bandwidth, whichever is
    # longer (here the bytes: a product this small is below the A100's flops per byte),
    # and its bias-GELU's bytes; the product's backward is twice
    per_byte = 1e3 / (2039e9 * A100_SUSTAINED_FRACTION)
    work = 2 * s * b * h * 4 * h / (312e12 * A100_SUSTAINED_FRACTION) * 1e3
    product = 2 * (s * b * h + h * 4 * h + s * b * 4 * h) * per_byte
    assert product > work
    assert fc1.weight_grad_ms == pytest.approx(product)
    assert fc1.forward_ms == pytest.approx(product + GELU_BYTES[0] * s * b * h * per_byte)
    assert fc1.backward_ms == pytest.approx(2 * product + GELU_BYTES[1] * s * b * h * per_byte)
    assert fc1.parameter_bytes == 4 * (4 * h * h + 4 * h)
    ln1 = graph.layers[1]  # the bias-dropout-add and the LayerNorm, at the memory rate
    assert ln1.forward_ms == pytest.approx(NORM_BYTES[0] * s * b * h * per_byte)
    # the same shape on a V100, at Megatron-LM's 39 of its 125 TFLOP/s; 16-bit weights halve
    v100 = load_graph(SMALL + ",batch=2,param_bytes=2", V100_32GB)
    operands = 2 * (s * b * h + h * 4 * h + s * b * 4 * h)
    assert v100.layers[5].weight_grad_ms == pytest.approx(operands * 1e3 / (900e9 * 39 / 125))
    assert v100.layers[5].parameter_bytes == fc1.parameter_bytes // 2
    # a fitted rate replaces the device's share of both peaks
    fitted = gpt_spec_profile(parse_gpt_spec(SMALL + ",batch=2"), A100_80GB, flops=100e12)
    assert fitted.layers[5].weight_grad_ms == pytest.approx(operands * 1e3 / (2039e9 * 100 / 312))
    wide = gpt_spec_profile(parse_gpt_spec(SMALL + ",batch=64"), A100_80GB, flops=100e12)
    assert wide.layers[5].weight_grad_ms == pytest.approx(  # 64 sequences: bound by the work
        2 * s * 64 * h * 4 * h / 100e12 * 1e3)
    assert fitted.layers[1].forward_ms == pytest.approx(
        NORM_BYTES[0] * s * b * h * 1e3 / (2039e9 * 100 / 312))


def test_without_a_device_a_profile_by_shape_says_how_to_give_one() -> None:
    with pytest.raises(ProfileError, match=r"needs a device's peak rate.*dgx-a100:2"):
        load_graph(SMALL)
    with pytest.raises(ProfileError, match="misses vocab"):  # parsed before the device is asked
        load_graph("gpt:layers=1,hidden=8,heads=2,seq=3")


def test_a_device_needs_positive_figures() -> None:
    with pytest.raises(ProfileError, match=r"peak_flops=0\.0 must be positive"):
        Device("broken", 0.0, 10**9, 1e9)
