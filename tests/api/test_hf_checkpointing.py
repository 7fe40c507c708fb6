"""Hugging Face's reentrant gradient checkpointing is refused before anything runs; the
non-reentrant form trains (``api/hf_checkpointing.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dreampipe

transformers = pytest.importorskip("transformers")

__all__: list[str] = []

_VOCAB = 64


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits  # type: ignore[no-any-return]


def _gpt2(kwargs: dict[str, bool] | None) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=_VOCAB, n_positions=16, bos_token_id=0,
        eos_token_id=0))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return _Logits(model)


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, _VOCAB), target.reshape(-1))


def _pipe(model: nn.Module, batch: tuple[Tensor, Tensor]) -> dreampipe.Pipeline:
    return dreampipe.Pipeline(model, example=batch, loss_fn=_loss,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                              config=dreampipe.TrainConfig(schedule="1f1b-flush"))


def test_reentrant_checkpointing_is_refused_naming_the_fix() -> None:
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, _VOCAB, (4, 8), generator=gen),
             torch.randint(0, _VOCAB, (4, 8), generator=gen))
    with pytest.raises(dreampipe.ConfigError, match=r"_Logits.model.transformer runs Hugging "
                       r"Face's gradient checkpointing with use_reentrant=True.*'use_reentrant'"
                       r": False"):
        _pipe(_gpt2({"use_reentrant": True}), batch)


def test_non_reentrant_checkpointing_trains_as_one_process() -> None:
    kwargs = {"use_reentrant": False}
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, _VOCAB, (4, 8), generator=gen),
                torch.randint(0, _VOCAB, (4, 8), generator=gen)) for _ in range(2)]
    pipe = _pipe(_gpt2(kwargs), batches[0])
    try:
        for x, y in batches:
            pipe.step(x, y)
        losses = pipe.finish()
    finally:
        pipe.close()
    model = _gpt2(kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for x, y in batches:
        loss = _loss(model(x), y)
        want.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses == pytest.approx(want, rel=1e-5)
