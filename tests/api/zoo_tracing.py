"""Models whose forward the splitter once could not trace, as people write them:

- Mixtral with ``output_router_logits=True``: Hugging Face collects each block's router
  logits with hooks inside the blocks, and the loss (``out.loss``, or the user's own
  cross-entropy plus ``out.aux_loss``) sums the auxiliary loss over all of them;
- T5 given ``labels`` (not ``decoder_input_ids``): its ``_shift_right`` assigns items, and
  its loss is a ``CrossEntropyLoss()`` built in the forward;
- torch's pipelining example (``ExampleCode`` of torch's
  ``test/distributed/pipelining/model_registry.py``): a default tensor argument, parameters
  read directly on both sides of the cut, and a ``pipe_split()`` left in the forward.

Tiny, randomly initialised, dropout off; each a :class:`~.model_zoo.Case`, trained on
2 ranks by :func:`train_tracing_case`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import pipe_split
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from dreampipe.api import Pipeline, TrainConfig

from .model_zoo import Case, CaseSpec, t5

__all__ = ["AUX_COEF", "TRACING_CASES", "ExampleCode", "mixtral", "qwen2_moe",
           "train_tracing_case"]

AUX_COEF = 0.5
_D, _MICRO = 8, 4
_Y = torch.linspace(-1, 1, _MICRO * _D).view(_MICRO, _D)  # ExampleCode's default y


class ExampleCode(nn.Module):
    """torch's pipelining example, small: ``y`` defaults to a tensor (not zeros, so that
    using it shows), and the buffer ``cval`` read before the cut is used after it."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(_D, _D) / _D**0.5)
        self.mm_param1 = nn.Parameter(torch.randn(_D, _D) / _D**0.5)
        self.register_buffer("cval", torch.randn(_D))
        self.lin0 = nn.Linear(_D, _D)
        self.lin1 = nn.Linear(_D, 3)

    def forward(self, x: Tensor, y: Tensor = _Y) -> Tensor:
        x = torch.mm(x, self.mm_param0)
        x = x + y
        x = torch.relu(x)
        a_constant = self.cval.clone()
        x = self.lin0(x)
        pipe_split()
        x = torch.relu(x) + a_constant
        x = torch.mm(x, self.mm_param1)
        return self.lin1(x)


def mixtral(**config: Any) -> MixtralForCausalLM:
    return MixtralForCausalLM(MixtralConfig(**{
        "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 11,
        "max_position_embeddings": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
        "output_router_logits": True, "router_aux_loss_coef": AUX_COEF, **config}))


def qwen2_moe(**config: Any) -> Qwen2MoeForCausalLM:
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**{
        "num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 16,
        "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 11,
        "max_position_embeddings": 8, "num_experts": 4, "num_experts_per_tok": 2,
        "output_router_logits": True, "router_aux_loss_coef": AUX_COEF, **config}))


_POOL = 64
_g = torch.Generator().manual_seed(200)
_IDS = torch.randint(1, 11, (_POOL, 6), generator=_g)
_ROWS = (torch.randn(_POOL, _D, generator=_g), torch.randint(0, 3, (_POOL,), generator=_g))


def _window(k: int, n: int) -> slice:
    start = k * n % _POOL
    return slice(start, start + n)


def _labelled(k: int, n: int) -> tuple[Any, Tensor]:
    ids = _IDS[_window(k, n)]
    return {"input_ids": ids, "labels": (ids + 1) % 11}, (ids + 1) % 11


def _ids(k: int, n: int) -> tuple[Any, Tensor]:
    ids = _IDS[_window(k, n)]
    return {"input_ids": ids}, (ids + 1) % 11


def _rows(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return _ROWS[0][w], _ROWS[1][w]


def _model_loss(out: Any, y: Tensor) -> Tensor:
    return out.loss  # type: ignore[no-any-return]


def _ce_and_aux(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten()) + AUX_COEF * out.aux_loss


TRACING_CASES: dict[str, Case] = {
    "mixtral_loss": Case(mixtral, _labelled, _model_loss, ["model.layers.1"]),
    "mixtral_aux": Case(mixtral, _ids, _ce_and_aux, ["model.layers.1"]),
    "t5_labels": Case(t5, _labelled, _model_loss, ["decoder.embed_tokens"]),
    "example_code": Case(ExampleCode, _rows, F.cross_entropy, ["lin1"]),
}


def train_tracing_case(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    """Train case ``job["case"]`` split at its split points for ``steps`` minibatches of
    ``minibatch`` in ``microbatches``; rank 0 returns the losses, the full state and the
    stages' bounds."""
    case = TRACING_CASES[job["case"]]
    pipe = Pipeline(
        CaseSpec(case, job["seed"]).model(), example=case.example(0, job["minibatch"]),
        loss_fn=case.loss_fn, optimizer=lambda p: torch.optim.SGD(p, lr=job["lr"]),
        plan=case.split_points, config=TrainConfig(schedule="1f1b-flush",
                                                   microbatches=job["microbatches"],
                                                   timeout_s=30.0))
    for k in range(job["steps"]):
        pipe.step(*case.example(k, job["minibatch"]))
    losses = pipe.finish()
    out = {"losses": losses, "state": pipe.full_state_dict(),
           "bounds": [st.first for st in pipe.plan.stages]}
    pipe.close()
    return out if rank == 0 else None
