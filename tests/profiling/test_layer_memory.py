"""``profiling/layer_memory.py``: a backward's working set, deferred Linear operands and
the library's kernel memory, and the stage tables they feed (``planning/held.py``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn

from dreampipe.models import get_model
from dreampipe.planning.held import held_bytes, kinds_sum, range_max
from dreampipe.profiling.graph import Layer, LayerGraph
from dreampipe.profiling.profiler import profile_model, profile_spec
from dreampipe.profiling.tensor_bytes import TensorBytes

__all__: list[str] = []

def test_tensor_bytes_counts_what_ops_make_and_drops_what_dies() -> None:
    x = torch.ones(1000)  # before: not counted
    live = TensorBytes()
    with live.counting():
        x.mul_(2)  # in place: an input's storage, not new
        a = x * 2  # 4000 B
        b = a + 1  # 8000 B at once
        del a
        c = b * 3  # a is gone: 8000 B again
        view = c[:10]  # a view makes nothing
    assert (live.peak, live.now) == (8000, 8000)
    del b, view
    assert live.now == 4000  # c lives on
    c.untyped_storage().resize_(0)  # as ZeRO-3 frees gathered weights
    assert live.now == 0
    live.adopt([x, x[:5]])  # a tensor made before, once
    assert (live.now, live.peak) == (4000, 8000)
    live.close()


def test_the_last_layer_holds_the_loss_backward_in_fp32_whatever_the_formats() -> None:
    """Cross-entropy upcasts 16-bit logits: its backward holds two fp32 logits' worth
    (its gradient and the log-softmax's), more than the head keeps in bf16."""
    spec = get_model("transformer", layers=1)
    logits = 8 * int(spec.sample_input(1).shape[1]) * 1000 * 4  # batch 8, vocab 1000, fp32
    for autocast, param in ((None, torch.float32), (torch.bfloat16, torch.float32),
                            (None, torch.bfloat16)):
        graph = profile_spec(spec, 8, repeats=1, warmup=0, autocast=autocast,
                             param_dtype=param)
        head = graph.layers[-1]
        assert head.backward_bytes is not None and head.backward_bytes >= 2 * logits
        if param == torch.bfloat16:
            assert head.backward_bytes > head.stash_bytes  # the old rule fell short
        block = graph.layers[1]
        assert block.backward_bytes is not None
        assert 0 < block.backward_bytes < 2 * block.stash_bytes
        # a block's Linear layers: 4 outputs' gradients and the inputs inside the block
        assert block.deferred_bytes is not None and block.deferred_bytes > 0
        assert graph.layers[0].deferred_bytes == 0  # the embedding has no Linear
        assert all(x.library_bytes is None or x.library_bytes >= 0 for x in graph.layers)


def test_under_autocast_a_layer_output_crosses_in_the_autocast_dtype() -> None:
    spec = get_model("transformer", layers=1)
    fp32 = profile_spec(spec, 4, repeats=1, warmup=0)
    mixed = profile_spec(spec, 4, repeats=1, warmup=0, autocast=torch.bfloat16)
    assert mixed.layers[1].activation_bytes * 2 == fp32.layers[1].activation_bytes


def test_new_figures_round_trip_and_default_to_the_old_rules() -> None:
    layer = Layer("b", 1.0, 2.0, 100, 10, "Block", saved_bytes=300, backward_bytes=50,
                  deferred_bytes=70, library_bytes=9, recorded_bytes=40)
    graph = LayerGraph((layer,), (), 4)
    again = LayerGraph.from_json(graph.to_json()).layers[0]
    assert again == layer and again.working_bytes == 50
    plain = Layer("b", 1.0, 2.0, 100, 10, "Block", saved_bytes=300)
    assert plain.working_bytes == 300 and "backward_bytes" not in LayerGraph(
        (plain,), (), 4).to_json()
    with pytest.raises(Exception, match="library_bytes"):
        Layer("b", 1.0, 2.0, 100, 10, library_bytes=-1)


def test_a_stage_holds_its_largest_working_set_and_each_kind_of_kernels_once() -> None:
    assert range_max([1.0, 3.0, 2.0]).tolist() == [[1, 3, 3], [0, 3, 3], [0, 0, 2]]
    kinds = ["embed", "block", "block", "block", "head"]
    table = kinds_sum([1.0, 5.0, 0.0, 5.0, 2.0], kinds)
    assert table[0, 4] == 8.0  # embed + block once + head
    assert table[1, 3] == 5.0 and table[2, 2] == 5.0  # any block brings the block's
    assert table[3, 4] == 7.0 and table[4, 4] == 2.0 and table[4, 0] == 0.0
    held = held_bytes([4.0, 1.0, 1.0, 1.0, 9.0], [1.0, 5.0, 5.0, 5.0, 2.0], kinds)
    assert held[0, 3] == 4.0 + 6.0 and held[1, 4] == 9.0 + 7.0
    assert np.all(np.tril(held, -1) == 0.0)


def test_layers_of_one_kind_share_the_library_reading_read_in_16_bits_only() -> None:
    spec = get_model("transformer", layers=3)
    graph = profile_spec(spec, 4, repeats=1, warmup=0, autocast=torch.bfloat16)
    blocks = [x.library_bytes for x in graph.layers if x.description == "TransformerBlock"]
    assert len(blocks) == 3 and len(set(blocks)) == 1
    if sys.platform == "linux":
        assert all(b is not None and b >= 0 for b in blocks)
    fp32 = profile_spec(spec, 4, repeats=1, warmup=0)
    assert all(x.library_bytes is None for x in fp32.layers)


@pytest.mark.parametrize("bias", [True, False])
def test_deferred_bytes_skip_the_layer_input(bias: bool) -> None:
    """A Sequential of Linear layers: each holds its output's gradient; its input is the
    layer before's output, which that one keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=bias), nn.Linear(16, 4, bias=bias))
    graph = profile_model(model, torch.randn(5, 8), lambda y: y.sum(), repeats=1, warmup=0)
    assert [x.deferred_bytes for x in graph.layers] == [5 * 16 * 4, 5 * 4 * 4]


def test_recorded_bytes_are_each_linear_s_output() -> None:
    """A split backward's ``B`` keeps the gradients of the outputs of a layer's modules
    that hold weights for ``W``: a block of two Linears records both outputs, a ReLU
    nothing, a LayerNorm its output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 12)), nn.ReLU(),
                          nn.Linear(12, 4))
    graph = profile_model(model, torch.randn(5, 8), lambda y: y.sum(), repeats=1, warmup=0)
    assert [x.recorded_bytes for x in graph.layers] == [5 * (16 + 12) * 4, 0, 5 * 4 * 4]
    normed = profile_model(nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12)), torch.randn(5, 8),
                           lambda y: y.sum(), repeats=1, warmup=0)
    assert [x.recorded_bytes for x in normed.layers] == [5 * 12 * 4] * 2


class _Tied(nn.Module):
    """An embedding, a block and a head that shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block = nn.Embedding(10, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def test_a_tied_weights_modules_record_on_the_layers_calling_them() -> None:
    """The embedding's output is recorded on the embedding's layer, the head's on the
    head's, though both hold the one weight."""
    graph = profile_model(_Tied(), torch.randint(0, 10, (3, 5)),
                          lambda y: y.float().pow(2).mean(), repeats=1, warmup=0)
    got = {x.name: x.recorded_bytes for x in graph.layers}
    assert got == {"embed": 3 * 5 * 6 * 4, "block": 3 * 5 * 6 * 4, "head": 3 * 5 * 10 * 4}


class _Masked(nn.Module):
    """Multiplies by a mask buffer, which autograd saves for the backward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.register_buffer("mask", torch.tril(torch.ones(n, n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.mask


def test_a_buffer_autograd_saves_is_not_kept_per_microbatch() -> None:
    """A minibatch in flight keeps the layer's output, not the model's mask: every
    microbatch shares that one tensor."""
    n = 64
    model = nn.Sequential(_Masked(n), nn.Flatten(), nn.Linear(n * n, 2))
    graph = profile_model(model, torch.randn(2, n, n), nn.functional.cross_entropy,
                          torch.tensor([0, 1]), warmup=0, repeats=1)
    assert graph.layers[0].saved_bytes == 2 * n * n * 4  # the output alone


class _Attends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x)[0]).mean(1)


def test_a_layer_sends_the_items_of_its_output_that_later_layers_read() -> None:
    """Attention returns its output and its averaged weights; only the output crosses."""
    graph = profile_model(_Attends(), torch.randn(4, 5, 8), nn.functional.cross_entropy,
                          torch.tensor([0, 1, 2, 0]), warmup=0, repeats=1)
    attn = next(x for x in graph.layers if x.name == "attn")
    assert attn.activation_bytes == 4 * 5 * 8 * 4  # not the 4 x 5 x 5 weights beside it


class _ReadsWeights(_Attends):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attn(x, x, x)
        return self.head(out).mean(1) + weights.sum((1, 2))[:, None]


def test_a_minibatch_in_flight_keeps_no_item_of_an_output_nothing_reads() -> None:
    """Attention's averaged weights are dropped once its output is taken from beside them
    (autograd saves none of them): a minibatch in flight keeps them only where a later
    step reads them."""
    kept = []
    for model in (_Attends(), _ReadsWeights()):
        graph = profile_model(model, torch.randn(4, 5, 8), nn.functional.cross_entropy,
                              torch.tensor([0, 1, 2, 0]), warmup=0, repeats=1)
        kept.append(next(x for x in graph.layers if x.name == "attn").saved_bytes)
    assert kept[1] - kept[0] == 4 * 5 * 5 * 4
