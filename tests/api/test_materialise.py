"""Models built on meta, materialised stage by stage with their own initialisation."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import dreampipe
from dreampipe.errors import ConfigError, PlanError
from dreampipe.splitter.chain import build_stage, split_layers

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


class _Nested(nn.Module):
    """Blocks of several modules each, a weight tied between the first and the last."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 6))
            for _ in range(2))
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).mean(1)


def _pipeline_state(model: nn.Module, example: tuple[Any, Tensor],
                    loss_fn: Callable[[Any, Tensor], Tensor], seed: int) -> dict[str, Tensor]:
    pipe = dreampipe.Pipeline(model, example=example, loss_fn=loss_fn,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush", seed=seed))
    state = pipe.full_state_dict()
    pipe.close()
    return state


@pytest.mark.parametrize("name", ["nested", "gpt2"])
def test_a_model_built_on_meta_equals_one_built_on_cpu_and_initialised(name: str) -> None:
    if name == "nested":
        build: Callable[[], nn.Module] = _Nested
        example: tuple[Any, Tensor] = (torch.randint(0, 7, (4, 5)), torch.randint(0, 7, (4,)))
        loss_fn: Callable[[Any, Tensor], Tensor] = torch.nn.functional.cross_entropy
    else:
        case = CASES[name]
        build, example, loss_fn = case.build, case.example(0, 4), case.loss_fn
    got = _pipeline_state(_on_meta(build), example, loss_fn, seed=7)
    plain = build()
    assert dreampipe.initialise(plain, example[0], seed=7) is plain
    want = plain.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    other = dreampipe.initialise(build(), example[0], seed=8).state_dict()
    assert all(not torch.equal(other[k], v) for k, v in want.items()
               if v.is_floating_point() and v.std() > 0)


def test_a_hugging_face_model_is_initialised_children_first_as_its_post_init() -> None:
    model = dreampipe.initialise(gpt2(), {"input_ids": torch.zeros(2, 4, dtype=torch.long)})
    state = model.state_dict()
    # GPT2's _init_weights on an attention block rescales its c_proj (after the Conv1D's own
    # init): std 0.02 / sqrt(2 * n_layer)
    assert 0.0075 < float(state["transformer.h.0.attn.c_proj.weight"].std()) < 0.0125
    assert 0.015 < float(state["transformer.h.0.attn.c_attn.weight"].std()) < 0.025
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def test_a_tied_weight_keeps_the_first_layers_value_on_every_plan() -> None:
    layers = split_layers(_on_meta(_Nested), torch.zeros(2, 5, dtype=torch.long))
    whole = build_stage(layers, 0, len(layers) - 1, CPU, 3).state_dict()
    layers = split_layers(_on_meta(_Nested), torch.zeros(2, 5, dtype=torch.long))
    first = build_stage(layers, 0, 0, CPU, 3).state_dict()
    torch.testing.assert_close(whole["head.weight"], first["embed.weight"], rtol=0, atol=0)


def test_initialise_refuses_a_model_on_meta() -> None:
    with pytest.raises(ConfigError, match=r"Sequential is on the meta device"):
        dreampipe.initialise(_on_meta(lambda: nn.Sequential(nn.Linear(2, 2))))


class _Assigns(nn.Module):
    """A reset_parameters that sets new tensors rather than filling its own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("index", torch.zeros(4, dtype=torch.long))
        self.gain = nn.Parameter(torch.zeros(4))

    def reset_parameters(self) -> None:
        self.index = torch.arange(4)
        self.gain = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain + self.index


def test_an_initialisation_that_sets_new_tensors_is_kept() -> None:
    layers = split_layers(_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), _Assigns())))
    state = build_stage(layers, 0, 1, CPU).state_dict()
    assert torch.equal(state["1.index"], torch.arange(4))
    assert torch.equal(state["1.gain"], torch.full((4,), 2.0))


class _Positions(nn.Module):
    """Integer and bool buffers no initialisation writes: a position table and a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("pos", torch.arange(5))
        self.register_buffer("keep", torch.tensor([True, True, False, True, True]))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.keep[self.pos[: x.shape[-1]]].float()


def test_integer_buffers_keep_their_values_and_on_meta_are_refused() -> None:
    """``initialise`` redraws the weights but keeps what nothing resets (``pos``, ``keep``);
    on meta their values are unknown, which is said, not left as whatever memory held."""
    model = dreampipe.initialise(nn.Sequential(_Positions()), seed=3)
    assert torch.equal(model[0].pos, torch.arange(5))
    assert model[0].keep.tolist() == [True, True, False, True, True]
    layers = split_layers(_on_meta(lambda: nn.Sequential(_Positions())))
    with pytest.raises(PlanError, match=r"module '0' \(_Positions\) was built on meta and has "
                                        r"no way to initialise 'pos' \(torch.int64\)"):
        build_stage(layers, 0, 0, CPU)


class _OwnInit(nn.Module):
    """A model of its own (no ``config``) with nanoGPT's ``_init_weights(module)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 4)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def test_a_model_s_own_init_weights_initialises_it_on_meta() -> None:
    layers = split_layers(_on_meta(_OwnInit), torch.randn(2, 64))
    stage = build_stage(layers, 0, len(layers) - 1, CPU)
    weight = stage.state_dict()["a.weight"]
    assert 0.015 < float(weight.std()) < 0.025  # not nn.Linear's own, about 0.072
    assert not any(float(v.abs().max()) for k, v in stage.state_dict().items()
                   if k.endswith("bias"))
