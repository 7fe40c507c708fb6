"""Models built on meta, materialised stage by stage with their own initialisation."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor, nn

from dreampipe.api.split import build_stage, split_layers
from dreampipe.errors import PlanError

from .model_zoo import CASES, bert, gpt2

__all__: list[str] = []

CPU = torch.device("cpu")


def _on_meta(build: type[nn.Module] | object) -> nn.Module:
    with torch.device("meta"):
        model = build()  # type: ignore[operator]
    assert isinstance(model, nn.Module)
    return model


def _state(name: str, bounds: list[int], seed: int = 3) -> dict[str, Tensor]:
    """The state of case ``name`` built on meta, materialised stage by stage at ``bounds``."""
    case = CASES[name]
    layers = split_layers(_on_meta(case.build), case.example(0, 4)[0])
    edges = [*bounds, len(layers)]
    state: dict[str, Tensor] = {}
    for a, b in itertools.pairwise(edges):
        state.update(build_stage(layers, a, b - 1, CPU, seed).state_dict())
    return state


def test_a_hugging_face_model_gets_its_own_init_on_every_plan() -> None:
    whole, split = _state("bert", [0]), _state("bert", [0, 2])
    assert sorted(whole) == sorted(split)
    for k, v in whole.items():
        assert not v.is_floating_point() or torch.isfinite(v).all(), k
        torch.testing.assert_close(split[k], v, rtol=0, atol=0, msg=k)
    # BertPreTrainedModel._init_weights: LayerNorm ones, biases zero, normal(0.5) weights,
    # the position ids buffer an arange
    assert torch.equal(whole["bert.embeddings.LayerNorm.weight"], torch.ones(16))
    assert torch.equal(whole["classifier.bias"], torch.zeros(3))
    assert 0.4 < float(whole["bert.encoder.layer.0.attention.self.query.weight"].std()) < 0.6
    case = CASES["bert"]
    stage = build_stage(split_layers(_on_meta(case.build), case.example(0, 4)[0]), 0, 0, CPU)
    assert torch.equal(stage.get_buffer("bert.embeddings.position_ids"), torch.arange(8)[None])


def test_gpt2_on_meta_keeps_its_tied_embeddings_in_one_stage() -> None:
    state = _state("gpt2", [0])
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert torch.equal(state["transformer.h.0.attn.c_attn.bias"], torch.zeros(48))
    assert 0.01 < float(state["transformer.h.0.mlp.c_fc.weight"].std()) < 0.03


def test_the_seed_and_the_layer_decide_the_weights() -> None:
    a, b = _state("resnet", [0], seed=3), _state("resnet", [0], seed=4)
    split = _state("resnet", [0, 4], seed=3)
    assert torch.equal(a["layer1.0.conv1.weight"], split["layer1.0.conv1.weight"])
    assert not torch.equal(a["layer1.0.conv1.weight"], b["layer1.0.conv1.weight"])


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


def test_a_module_with_no_way_to_initialise_is_named() -> None:
    layers = split_layers(_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), _Scale())))
    build_stage(layers, 0, 0, CPU)
    with pytest.raises(PlanError, match=r"module '1' \(_Scale\) was built on meta and has no "
                                        r"way to initialise 'gain': give it reset_parameters"):
        build_stage(layers, 1, 1, CPU)


def test_bert_and_gpt2_build_on_meta() -> None:
    for build in (bert, gpt2):
        assert all(p.is_meta for p in _on_meta(build).parameters())
