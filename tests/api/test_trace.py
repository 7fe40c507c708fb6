"""The splitter: units, segments and split points of models as people write them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel, ViTConfig, ViTForImageClassification

import dreampipe
from dreampipe.errors import PlanError
from dreampipe.splitter.chain import Chain, split_layers
from dreampipe.splitter.segments import split_bounds, unit_names

from .model_zoo import CASES, ResNet
from .test_in_place import _Block
from .test_pipeline_errors import _Branchy

__all__: list[str] = []


def test_the_units_are_the_blocks_and_the_modules_between_them() -> None:
    assert unit_names(ResNet()) == ["conv1", "bn1", "relu", "layer1.0", "layer1.1", "layer2.0",
                                    "layer2.1", "avgpool", "fc"]
    gpt2 = CASES["gpt2"].build()
    assert unit_names(gpt2) == ["transformer.wte", "transformer.wpe", "transformer.drop",
                                "transformer.h.0", "transformer.h.1", "transformer.ln_f",
                                "lm_head"]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 3])
def test_two_stages_of_segments_compute_the_model(name: str, cut: int) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().eval()
    x, _ = case.example(0, 4)
    fresh = copy.deepcopy(model)  # as one process runs it: its forward may write buffers
    keywords = isinstance(x, dict) and not isinstance(model, nn.Sequential)
    want = fresh(**x) if keywords else fresh(x)
    layers = split_layers(model, x)
    cut = min(cut, len(layers) - 1)
    first = Chain(layers[:cut])
    out = Chain(layers[cut:])(first(*x) if isinstance(x, tuple) else first(x))
    if isinstance(x, tuple):  # the tuple itself is taken too, as a reference passes it
        torch.testing.assert_close(Chain(layers[cut:])(first(x)), out, rtol=0, atol=0)
    got_logits = out["logits"] if isinstance(out, dict) else out
    want_logits = want["logits"] if isinstance(want, dict) else want
    assert type(out) is type(want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-6, atol=1e-6)


def test_split_gpt2_with_eager_attention_stays_causal() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=11, n_positions=8, bos_token_id=0,
        eos_token_id=0, attn_implementation="eager")).eval()
    ids = torch.randint(0, 11, (2, 6))
    layers = split_layers(model, {"input_ids": ids})
    first, rest = Chain(layers[:4]), Chain(layers[4:])
    out = rest(first({"input_ids": ids})).logits
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11
    later = rest(first({"input_ids": changed})).logits
    torch.testing.assert_close(later[:, :-1], out[:, :-1], rtol=0, atol=0)
    assert not torch.equal(later[:, -1], out[:, -1])


def test_a_model_reading_its_parameters_dtype_between_blocks_splits() -> None:
    """Hugging Face's ViT compares its input's dtype with a weight's between its blocks:
    the weight, read as stored, is known on meta as any parameter is."""
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_channels=3, num_labels=3)).eval()
    x = {"pixel_values": torch.randn(2, 3, 8, 8)}
    layers = split_layers(model, x)
    cut = 2  # the embeddings and the first block, then the second block onwards
    assert layers[cut][0].endswith(".1"), [n for n, _ in layers]
    out = Chain(layers[cut:])(Chain(layers[:cut])(x))
    torch.testing.assert_close(out.logits, model(**x).logits, rtol=1e-6, atol=1e-6)


def test_a_split_point_at_a_container_begins_at_its_first_block() -> None:
    model = ResNet()
    names = [n for n, _ in split_layers(model)]
    assert split_bounds(names, ["layer2"], model) == [0, 5]
    assert split_bounds(names, ["layer1.1", "fc"], model) == [0, 4, 8]


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 8 * 8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        return self.fc(h.view(h.size(0), -1))


def test_a_model_plain_fx_traces_keeps_its_shapes_symbolic() -> None:
    model = _Flat()
    layers = split_layers(model, torch.randn(4, 3, 8, 8))
    x = torch.randn(3, 3, 8, 8)  # a smaller batch than the example's, as a last batch is
    torch.testing.assert_close(Chain(layers[1:])(Chain(layers[:1])(x)), model(x))


class _Probing(nn.Module):
    """Duck-typing probes of an attribute a tensor lacks, as transformers' ``is_jax_jitting``
    does (``hasattr(x, "jax")``, then ``x.jax()`` inside try/except)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        for value in (x, h := self.embed(x)):
            if hasattr(value, "probe"):
                try:  # noqa: SIM105 (the probe as transformers writes it)
                    value.probe()
                except Exception:
                    pass
        h.add_(1.0)  # an in-place method stays
        return self.head(h)


def test_a_duck_typing_probe_is_false_as_on_a_tensor_and_the_model_trains() -> None:
    torch.manual_seed(0)
    model = _Probing()
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]
    layers = split_layers(model, data[0][0])
    methods = [n.target for _, seg in layers for n in seg.graph.nodes  # type: ignore[union-attr]
               if n.op == "call_method"]
    assert methods == ["add_"]
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    pipe = dreampipe.Pipeline(model, example=data[0], loss_fn=F.cross_entropy,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush"))
    for x, y in data:
        pipe.step(x, y)
    torch.testing.assert_close(torch.tensor(pipe.finish()), torch.tensor(want),
                               rtol=1e-6, atol=1e-6)
    got = pipe.full_state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6, msg=k)
    pipe.close()


def test_a_branch_on_a_tensor_value_is_never_taken_silently() -> None:
    # traced with the example's shapes known too: the branch still cannot be traced
    with pytest.raises(PlanError, match=r"cannot split _Branchy: torch.fx cannot trace"):
        split_layers(_Branchy(), torch.randn(4, 6))


class _NamedLikeSegments(nn.Module):
    """Top-level modules and a buffer named as a segment's own fields; its forward branches
    on a shape, so the trace bakes the shapes in and re-traces for other ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs = nn.Linear(6, 6)
        self.graph, self.index, self.count, self.name = _Block(), _Block(), _Block(), _Block()
        self.register_buffer("shapes", torch.linspace(0.5, 1.5, 6))
        self.targets = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inputs(x) * self.shapes
        h = self.name(self.count(self.index(self.graph(h))))
        h = h + self.graph.fc.bias  # an attribute of one read between the units
        return self.targets(h if x.shape[0] > 1 else h * 2)


def test_modules_named_as_a_segment_s_fields_split_and_compute_the_model() -> None:
    torch.manual_seed(0)
    model = _NamedLikeSegments()
    layers = split_layers(model, torch.randn(4, 6))
    assert [n for n, _ in layers] == ["inputs", "graph", "index", "count", "name", "targets"]
    chain = Chain(layers)
    assert list(chain.state_dict()) == list(model.state_dict())
    for batch in (4, 3, 1):  # the example's shapes, then re-traced ones
        x = torch.randn(batch, 6)
        first, rest = Chain(layers[:2]), Chain(layers[2:])
        assert torch.allclose(rest(first(x)), model(x)), batch


class _PlainIndex(nn.Module):
    """A plain tensor attribute, not registered, named as a segment's ``index``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.index = torch.tensor([2.0])

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) * self.index)


def test_a_plain_tensor_named_as_a_segment_s_field_leaves_the_field_be() -> None:
    torch.manual_seed(0)
    model, x = _PlainIndex(), torch.randn(2, 4)
    layers = split_layers(model, x)
    assert [m.index for _, m in layers] == [0, 1]  # type: ignore[attr-defined]
    assert torch.allclose(Chain(layers[1:])(Chain(layers[:1])(x)), model(x))
