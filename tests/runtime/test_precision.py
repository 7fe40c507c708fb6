"""The number formats' rules, and the master weights of a 16-bit stage."""

from __future__ import annotations

import torch
from torch import nn

from dreampipe.runtime.precision import MasterWeights, Precision, cast_floating

__all__: list[str] = []


def test_each_precision_says_its_dtypes() -> None:
    table = {p: (p.autocast, p.param_dtype, p.compute_dtype, p.scales_loss, p.master_weights)
             for p in Precision}
    assert table == {
        Precision.FP32: (None, torch.float32, torch.float32, False, False),
        Precision.BF16_MIXED: (torch.bfloat16, torch.float32, torch.bfloat16, False, False),
        Precision.FP16_MIXED: (torch.float16, torch.float32, torch.float16, True, False),
        Precision.BF16: (None, torch.bfloat16, torch.bfloat16, False, True),
    }


def test_sends_cross_in_the_compute_dtype_and_ids_stay_exact() -> None:
    x = torch.randn(3, requires_grad=True)
    sent = Precision.BF16_MIXED.sent(x)
    assert sent.dtype == torch.bfloat16
    sent.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    ids = torch.arange(3)
    assert Precision.BF16.sent(ids) is ids and Precision.FP32.sent(x) is x
    inputs = cast_floating({"ids": ids, "x": x, "pair": (x, ids)}, torch.bfloat16)
    assert inputs["ids"] is ids and inputs["x"].dtype == torch.bfloat16
    assert inputs["pair"][0].dtype == torch.bfloat16 and inputs["pair"][1] is ids


def test_master_weights_keep_an_update_bf16_would_round_away() -> None:
    """1 + 1e-3 is 1 in bf16 (its ulp at 1 is 2**-7): 10 such steps still move the
    masters by 1e-2, and the bf16 weights take their rounding."""
    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0 + 1e-6)  # kept exactly by the masters, not by bf16
    masters = MasterWeights(layer, [layer.weight],
                            lambda p: torch.optim.SGD(p, lr=1e-3), Precision.BF16)
    assert layer.weight.dtype == torch.bfloat16 and masters.masters[0].dtype == torch.float32
    assert float(masters.masters[0].detach()) == torch.tensor(1.0 + 1e-6).item()
    for _ in range(10):
        masters.step([torch.full((1, 1), -1.0, dtype=torch.bfloat16)])
    assert abs(float(masters.masters[0].detach()) - (1.0 + 1e-6 + 1e-2)) < 1e-6
    assert float(layer.weight.detach()) == float(torch.tensor(1.01).to(torch.bfloat16))
    state = masters.state(layer)
    assert state["weight"].dtype == torch.float32
    assert masters.masters[0].grad is None and layer.weight.grad is None


def test_a_parameter_without_a_gradient_is_not_stepped() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    model = nn.Sequential(a, b)
    masters = MasterWeights(model, list(model.parameters()),
                            lambda p: torch.optim.SGD(p, lr=1.0), Precision.FP32)
    before = [p.detach().clone() for p in model.parameters()]
    masters.step([torch.ones(2, 2), None, None, None])
    after = list(model.parameters())
    assert not torch.equal(after[0], before[0])
    assert all(torch.equal(x, y) for x, y in zip(after[1:], before[1:], strict=True))


def test_the_factory_picks_groups_from_the_model_s_own_parameters() -> None:
    """Under bf16 the optimizer steps 32-bit masters; the factory still sees the model's
    parameters, so groups chosen by identity (names) keep the masters of those."""
    model = nn.Linear(3, 4)
    no_decay = {id(model.bias)}

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [{"params": [p for p in params if id(p) not in no_decay]},
             {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0}],
            lr=0.1, weight_decay=0.1)

    master = MasterWeights(model, list(model.parameters()), factory, Precision.BF16)
    assert master.optimizer is not None
    decayed, plain = master.optimizer.param_groups
    assert decayed["params"] == [master.masters[0]] and plain["params"] == [master.masters[1]]
    assert all(p.dtype == torch.float32 for p in master.masters)
    assert model.weight.dtype == torch.bfloat16
