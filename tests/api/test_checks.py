"""Warnings the checks give before training, where one process would train otherwise."""

from __future__ import annotations

import pytest
import torch
import transformers

from dreampipe.api.checks import packing_warning
from dreampipe.errors import ConfigError

__all__: list[str] = []


def test_packed_documents_without_a_mask_beside_a_cache_name_use_cache() -> None:
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=20))
    ids = torch.randint(0, 20, (2, 6))
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)}
    said = packing_warning(llama, packed)
    assert said is not None and "model.config.use_cache = False" in said
    assert packing_warning(llama, {**packed, "attention_mask": torch.ones(2, 6)}) is None
    assert packing_warning(llama, {"input_ids": ids}) is None
    llama.config.use_cache = False
    assert packing_warning(llama, packed) is None
    assert packing_warning(torch.nn.Linear(2, 2), packed) is None


def test_a_split_stage_of_a_traced_model_is_refused_for_what_it_is() -> None:
    """A traced model's layers are segments that pass packs of values, which a split stage
    (layers each taking one tensor) cannot run: said so, not as a count of splits."""
    from torch import nn

    from dreampipe.api.settled_plan import check_split_stages
    from dreampipe.planning.plan import Plan, Stage
    from dreampipe.planning.splits import Split
    from dreampipe.splitter.chain import split_layers

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + x)

    def split(n: int) -> Plan:  # one stage of n layers over 2 workers, each kept whole
        return Plan(stages=(Stage(first=0, last=n - 1, replicas=1, ranks=(0,),
                                  tensor_parallel=2, splits=(Split.REPLICA,) * n),),
                    num_layers=n)

    layers = split_layers(Net(), torch.randn(2, 4))
    with pytest.raises(ConfigError, match=r"plan .* splits stage 0 over workers, but its layer "
                                          r"'a' is a segment of a traced model"):
        check_split_stages(layers, split(len(layers)))
    check_split_stages(split_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), split(2))
