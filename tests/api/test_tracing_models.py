"""Models the splitter once could not trace (:mod:`.zoo_tracing`), trained on 2 ranks under
1f1b-flush against gradient accumulation in one process; and what it refuses, by message."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from runtime.reference import reference_sync, sgd

from dreampipe.errors import PlanError
from dreampipe.runtime.processes import run_processes
from dreampipe.splitter.chain import Chain, split_layers

from .compare import assert_matches
from .model_zoo import CaseData, CaseSpec
from .zoo_tracing import (
    TRACING_CASES,
    ExampleCode,
    mixtral,
    qwen2_moe,
    train_tracing_case,
)

SEED = 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(TRACING_CASES))
def test_1f1b_flush_of_a_model_once_untraceable_equals_one_process(name: str) -> None:
    job = {"case": name, "seed": SEED, "steps": 3, "minibatch": 8, "microbatches": 2, "lr": 0.1}
    got: dict[str, Any] = run_processes(train_tracing_case, 2, job, deadline_s=90.0)[0]
    assert got["bounds"][1] > 0
    case = TRACING_CASES[name]
    losses, state = reference_sync(CaseSpec(case, SEED), CaseData(case),  # type: ignore[arg-type]
                                   steps=3, minibatch=8, seed=SEED, opt=sgd(0.1), microbatches=2)
    assert_matches(got, losses, state)  # every key, T5's shared.weight included


def _split_run(model: torch.nn.Module, example: Any, at: str) -> Any:
    layers = split_layers(model, example)
    cut = [n for n, _ in layers].index(at)
    return Chain(layers[cut:])(Chain(layers[:cut])(example))


@pytest.mark.parametrize("build", [mixtral, qwen2_moe])
def test_router_logits_of_every_block_reach_the_loss_across_the_cut(build: Any) -> None:
    torch.manual_seed(0)
    model = build(num_hidden_layers=3, output_hidden_states=True)
    ids = torch.randint(0, 11, (2, 6))
    example = {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1] * 6,
                                                                               [0] * 2 + [1] * 4])}
    got, want = _split_run(model, example, "model.layers.1"), model(**example)
    assert len(got.router_logits) == 3 and len(got.hidden_states) == 4
    for key in ("loss", "aux_loss", "logits", "router_logits", "hidden_states"):
        torch.testing.assert_close(got[key], want[key])
    grads = torch.autograd.grad(got.aux_loss, [model.model.layers[i].mlp.gate.weight
                                               for i in range(3)])
    assert all(g.abs().sum() > 0 for g in grads)


def test_what_a_hook_collects_and_the_trace_could_not_know_is_checked_at_run_time() -> None:
    torch.manual_seed(0)
    model = mixtral(output_attentions=True)  # sdpa: no attention weights to collect
    ids = torch.randint(0, 11, (2, 6))
    with pytest.raises(PlanError, match=r"^model\.layers\.1\.self_attn returned None where the "
                       r"trace, which could not run it on the meta device, took a value that "
                       r"Hugging Face's hook collects; turn that output off \("
                       r"output_router_logits=False, output_hidden_states=False, "
                       r"output_attentions=False\) or compute it outside the model\n"):
        _split_run(model, {"input_ids": ids}, "model.layers.1")


def test_a_default_tensor_argument_is_used_unless_given_and_pipe_split_is_no_node() -> None:
    torch.manual_seed(0)
    model = ExampleCode()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    layers = split_layers(model, x)
    assert [n for n, _ in layers] == ["lin0", "lin1"]
    for graph in (seg.graph for _, seg in layers):  # type: ignore[attr-defined]
        assert all("pipe_split" not in str(n.target) for n in graph.nodes)
    assert not hasattr(model, "_tensor_constant0")
    torch.testing.assert_close(Chain(layers)(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(Chain(layers)(x, y), model(x, y), rtol=0, atol=0)


class _Llamaish(torch.nn.Module):
    """Its blocks in a top-level ``layers`` list, as Meta's reference Llama and
    torchtitan's hold them: a name the stage's own container must not take."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def test_a_model_whose_blocks_are_called_layers_splits_into_stages() -> None:
    model, x = _Llamaish(), torch.randn(3, 4)
    layers = split_layers(model, x)
    assert [name for name, _ in layers] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    first, second = Chain(layers[:2]), Chain(layers[2:])
    torch.testing.assert_close(second(first(x)), model(x))
