"""Train a Hugging Face GPT-2, passed as it is, split at its own modules.

    torchrun --nproc-per-node 2 examples/hf_gpt2.py [--steps 200]

The model is ``transformers``' ``GPT2LMHeadModel`` (a tiny random-init config,
nothing downloaded), with its input and output embeddings tied. ``split_points``
names where the second stage begins (``transformer.h.2``, the third block),
so the embedding and the head sit on different stages: each holds a copy of
the tied weight and the copies stay equal. The input is a dict of keyword
arguments (``model(**x)``), the loss reads ``out.logits`` of the model's
``ModelOutput``. The task: continue a repeating pattern of tokens.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel

import dreampipe

VOCAB, LENGTH = 32, 16


def model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64,
                                      n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))


def batch(gen: torch.Generator, size: int = 16) -> tuple[dict[str, Tensor], Tensor]:
    """Sequences that count up from a random start, step 1 to 3; the target is the next."""
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    step = torch.randint(1, 4, (size, 1), generator=gen)
    seq = (start + step * torch.arange(LENGTH + 1)) % VOCAB
    return {"input_ids": seq[:, :-1]}, seq[:, 1:]


def lm_loss(out: object, target: Tensor) -> Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    pipe = dreampipe.Pipeline(
        model(), example=batch(gen), loss_fn=lm_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), plan=["transformer.h.2"],
        config=dreampipe.TrainConfig(schedule="1f1b-flush", microbatches=2),
    )
    for _ in range(args.steps):
        pipe.step(*batch(gen))
    losses = pipe.finish()
    state = pipe.full_state_dict()
    rank = dist.get_rank()
    pipe.close()
    if rank == 0:
        tied = bool(torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]))
        print(json.dumps({"first_loss": losses[0], "last_loss": losses[-1],
                          "tied_equal": tied, "steps": len(losses)}))


if __name__ == "__main__":
    main()
