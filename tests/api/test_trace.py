"""The splitter: units, segments and split points of models as people write them."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dreampipe.api.split import Chain, split_layers
from dreampipe.api.trace import split_bounds, unit_names

from .model_zoo import CASES, ResNet

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
    layers = split_layers(model, x)
    out = Chain(layers[cut:])(Chain(layers[:cut])(x))
    want = model(**x) if isinstance(x, dict) else model(x)
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


def test_a_split_point_at_a_container_begins_at_its_first_block() -> None:
    model = ResNet()
    names = [n for n, _ in split_layers(model)]
    assert split_bounds(names, ["layer2"], model) == [0, 5]
    assert split_bounds(names, ["layer1.1", "fc"], model) == [0, 4, 8]
