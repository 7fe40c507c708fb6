"""Warnings the checks give before training, where one process would train otherwise."""

from __future__ import annotations

import torch
import transformers

from dreampipe.api.checks import packing_warning

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
