"""The model zoo: every model builds, trains a step, and splits into identical stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from dreampipe.errors import ConfigError, ProfileError
from dreampipe.models import ZOO, get_model
from dreampipe.models.resolve import ModelSample, resolve, resolve_spec
from dreampipe.models.spec import ModelSpec

ALL = ("mlp", "cnn", "vgg16", "alexnet", "resnet50", "gnmt", "transformer")
BATCH = 3


def test_zoo_has_every_model() -> None:
    assert set(ALL) <= set(ZOO)


@pytest.mark.parametrize("name", ALL)
def test_forward_backward_layer_by_layer(name: str) -> None:
    spec = get_model(name)
    model = spec.build()
    torch.manual_seed(0)
    x, target = spec.sample_input(BATCH), spec.sample_target(BATCH)
    h = x
    for layer in model:
        h = layer(h)
        assert isinstance(h, Tensor), f"{name}: a layer must return one tensor"
        assert h.shape[0] == BATCH
    loss = spec.loss_fn(h, target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    torch.autograd.backward([loss])
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"{name}: parameters without gradient {missing}"
    assert len(model) == spec.num_layers == len(spec.layer_names)


@pytest.mark.parametrize("name", ALL)
def test_stages_rebuild_the_same_weights(name: str) -> None:
    spec = get_model(name)
    full = spec.build(seed=5)
    n = spec.num_layers
    cut = n // 2
    head, tail = spec.build(0, cut - 1, seed=5), spec.build(cut, n - 1, seed=5)
    full_state = full.state_dict()
    parts = {**head.state_dict(), **tail.state_dict()}
    assert parts.keys() == full_state.keys()
    for key, value in parts.items():
        assert torch.equal(value, full_state[key]), key
    other = spec.build(seed=6).state_dict()
    assert any(not torch.equal(other[k], v) for k, v in full_state.items() if v.is_floating_point())

    for module in (full, head, tail):
        module.eval()
    torch.manual_seed(0)
    x = spec.sample_input(BATCH)
    with torch.no_grad():
        assert torch.equal(tail(head(x)), full(x))


@pytest.mark.parametrize("name", ALL)
def test_a_rank_of_far_apart_stages_builds_those_layers_alone(name: str) -> None:
    """``build_only``: the chosen layers as the whole model has them, every other on
    ``meta`` (an interleaved rank's first and last layer, say)."""
    spec = get_model(name)
    n = spec.num_layers
    real = {0, n - 1}
    full, part = spec.build(seed=5), spec.build_only(real, seed=5)
    assert [key for key, _ in part.named_children()] == spec.layer_names
    for i, (layer, whole) in enumerate(zip(part, full, strict=True)):
        for (key, value), (_, expected) in zip(layer.state_dict().items(),
                                               whole.state_dict().items(), strict=True):
            if i in real:
                assert torch.equal(value, expected), (i, key)
            else:
                assert value.is_meta, (i, key)
    with pytest.raises(ValueError, match=rf"layers \[{n}\] are outside 0..{n - 1}"):
        spec.build_only({0, n}, seed=5)


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        ("cnn", {"image_size": 10}, "image_size=10"),
        ("vgg16", {"image_size": 48}, "image_size=48"),
        ("vgg16", {"width_divisor": 3}, "width_divisor=3"),
        ("alexnet", {"image_size": 32}, "image_size=32"),
        ("resnet50", {"image_size": 16}, "image_size=16"),
        ("gnmt", {"hidden": 33}, "hidden=33"),
        ("gnmt", {"layers": 1}, "layers=1"),
        ("transformer", {"dim": 30, "heads": 4}, "dim=30"),
        ("transformer", {"heads": 0}, "heads=0: use at least 1"),
        ("transformer", {"vocab": 0}, "vocab=0: use at least 1"),
        ("transformer", {"seq_len": 0}, "seq_len=0: use at least 1"),
        ("mlp", {"layers": 0}, "layers=0"),
    ],
)
def test_bad_sizes(name: str, kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ProfileError, match=needle):
        get_model(name, **kwargs)


def test_cnn_on_8x8_digits_shape() -> None:
    spec = get_model("cnn", image_size=8)
    out = spec.build()(spec.sample_input(2))
    assert out.shape == (2, 10)


def test_unknown_model_lists_the_zoo() -> None:
    with pytest.raises(ProfileError, match="'resnet51'") as info:
        get_model("resnet51")
    for name in ALL:
        assert name in str(info.value)


_USER_FILE = """
import torch
from torch import nn
from dreampipe.models import get_model

def spec(layers=2):
    return get_model("mlp", layers=layers, width=8)

def sample(batch_size=4):
    return nn.Linear(3, 1), torch.randn(batch_size, 3), lambda out: out.mean()
"""


def test_every_form_resolves_the_same_way(tmp_path: Path) -> None:
    source = tmp_path / "user_models.py"
    source.write_text(_USER_FILE)
    zoo = resolve("mlp", (("layers", 2),))
    module = resolve("dreampipe.models:get_model", (("name", "mlp"), ("layers", 2)))
    from_file = resolve(f"{source}:spec", (("layers", 3),))
    assert isinstance(zoo, ModelSpec) and isinstance(module, ModelSpec)
    assert isinstance(from_file, ModelSpec) and from_file.num_layers == 3
    assert zoo.layer_names == module.layer_names
    sample = resolve(f"{source}:sample", batch_size=5)
    assert isinstance(sample, ModelSample) and sample.sample_input.shape[0] == 5


@pytest.mark.parametrize(
    ("ref", "kwargs", "needle"),
    [
        ("nosuch", (), "unknown model 'nosuch'"),
        ("mlp", (("width", -4),), "model 'mlp' with {'width': -4}"),
        ("no_such_pkg.mod:build", (), "cannot import 'build' from 'no_such_pkg.mod'"),
        ("{dir}/user_models.py:sample", (), "can be profiled but not trained"),
        ("{dir}/user_models.py:missing", (), "no function 'missing'"),
    ],
)
def test_a_spec_for_training_or_one_line(
    tmp_path: Path, ref: str, kwargs: tuple[tuple[str, int], ...], needle: str
) -> None:
    (tmp_path / "user_models.py").write_text(_USER_FILE)
    with pytest.raises(ConfigError, match=needle) as info:
        resolve_spec(ref.format(dir=tmp_path), kwargs)
    assert "\n" not in str(info.value)
