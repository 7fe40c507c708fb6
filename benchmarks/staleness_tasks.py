"""The workloads of ``benchmarks/staleness.py``'s delayed-update model, as the study trains them.

Each task is a dict: the model (an ``nn.Sequential`` the stages cut), its loss,
gradient clipping, the optimizer the user gives, a learning-rate scheduler or
None, an epoch's minibatches, the held-out figure and whether higher is
better. The study's two (digits: SGD lr 0.05 momentum 0.9; chars: AdamW 3e-3,
warm-up and clipping, 30 minibatches an epoch) and two held out from the
choice of a compensation (``examples/_workloads.py``): ``mlp``, an 8-layer
ReLU MLP (SGD lr 0.05 momentum 0.9, 150 minibatches of 32 an epoch), and
``gpt2``, a tiny Hugging Face GPT-2 with tied embeddings on Python's
documentation prose (AdamW 3e-3, clipped at norm 1, no warm-up, 40 minibatches
of 32 windows of 64 characters an epoch).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["EPOCHS", "WORKLOADS", "task"]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _workloads as wl

#: Epochs each workload trains for in the model (the study's for digits and chars).
EPOCHS = {"digits": 10, "chars": 4, "mlp": 8, "gpt2": 6}
WORKLOADS = tuple(EPOCHS)


def task(workload: str, seed: int, sgd: tuple[float, float] = (0.05, 0.9),
         blocks: int = 4) -> dict[str, Any]:
    """``workload``'s task for ``seed``; ``sgd``: an SGD workload's lr and momentum;
    ``blocks``: the transformers' depth (chars: 4 in the study, 8 for 8 workers)."""
    if workload == "digits":
        return _classifier(*wl.digits(), wl.cnn, seed, sgd, epochs=EPOCHS["digits"])
    if workload == "mlp":
        return _classifier(*wl.blobs(), wl.mlp, seed, sgd, epochs=EPOCHS["mlp"])
    if workload == "chars":
        corpus = wl.char_corpus(3_000_000)
        return _language(corpus, lambda: wl.gpt(corpus.vocab, context=64, layers=blocks),
                         seed, per_epoch=30, warmup=20, epochs=EPOCHS["chars"])
    corpus = wl.docs_corpus()
    return _language(corpus, lambda: wl.gpt2(corpus.vocab), seed,
                     per_epoch=40, warmup=0, epochs=EPOCHS["gpt2"])


def _classifier(train: Any, test: Any, build: Callable[[], nn.Sequential], seed: int,
                sgd: tuple[float, float], epochs: int) -> dict[str, Any]:
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    held = list(torch.utils.data.DataLoader(test, batch_size=120))

    def evaluate(model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            right = sum(int((model(x).argmax(1) == y).sum()) for x, y in held)
        return right / sum(len(y) for _, y in held)

    lr, momentum = sgd
    return {"model": build(), "loss_fn": F.cross_entropy, "clip": None, "epochs": epochs,
            "optimizer": lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum),
            "lr_scheduler": None, "epoch": lambda: iter(loader), "evaluate": evaluate,
            "higher": True}


def _language(corpus: wl.CharCorpus, build: Callable[[], nn.Sequential], seed: int,
              per_epoch: int, warmup: int, epochs: int) -> dict[str, Any]:
    stream = wl.windows(corpus.train, 32, 64, seed=1000 + seed)
    held_stream = wl.windows(corpus.held_out, 32, 64, seed=2)
    held = [next(held_stream) for _ in range(16)]
    next(stream)  # the study's Pipeline takes one window batch as its example

    def evaluate(model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            return sum(float(wl.token_loss(model(x), y)) for x, y in held) / len(held)

    def epoch() -> Iterator[tuple[Tensor, Tensor]]:
        return itertools.islice(stream, per_epoch)

    def schedule(o: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / warmup))

    torch.manual_seed(seed)
    return {"model": build(), "loss_fn": wl.token_loss, "clip": 1.0, "epochs": epochs,
            "optimizer": lambda p: torch.optim.AdamW(p, lr=3e-3),
            "lr_scheduler": schedule if warmup else None, "epoch": epoch,
            "evaluate": evaluate, "higher": False}
