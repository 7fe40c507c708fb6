"""Models as people write them, for the splitter's tests: a torchvision-style ResNet
(BasicBlocks, a stem, ``flatten``), a model whose skip crosses stages and takes a mask
keyword, an ``nn.Sequential`` of a tuple input whose layers pass tuples on, a model
whose last layer's weight is tied to its first's, and Hugging Face's
GPT-2 (tied embeddings) and BERT (an attention mask), tiny and randomly initialised,
passed as they are (dict inputs, ``ModelOutput`` out), dropout off.

Each comes with a ``case``: how to build it under a seed, its example minibatch, its
loss and its split points for two stages; :class:`CaseSpec` and :class:`CaseData` make a
case look like a zoo model and its data to the single-process references.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from dreampipe.splitter.chain import Chain, split_layers

__all__ = ["CASES", "SHORT_BY", "SHORT_STEP", "TIED_CASES", "VARLEN_CASES", "Case", "CaseData",
           "CaseSpec", "bert", "find_case", "gpt2", "llama", "t5", "tied_llama"]


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                         nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout, small: stem, two stages of BasicBlocks, pool, fc; the
    head also reads the pooled stem (a skip from the first stage to the last)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16 + 8, classes)

    def forward(self, x: Tensor) -> Tensor:
        stem = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(stem))
        skip = torch.flatten(F.adaptive_avg_pool2d(stem, 1), 1)
        return self.fc(torch.cat([torch.flatten(self.avgpool(x), 1), skip], 1))


class SkipNet(nn.Module):
    """A stem whose output skips the middle blocks (across the cut) to the head, a mask
    keyword used after the cut, and a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> dict[str, Tensor]:
        s = self.stem(x)
        h = s
        for block in self.blocks:
            h = block(h)
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return {"logits": self.head(h + s), "hidden": h}


class TiedNet(nn.Module):
    """An embedding whose weight is also the output head's, as GPT-2's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.mid = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.mid(self.embed(ids))).mean(1)


class TwiceTiedNet(nn.Module):
    """Ties that 4 stages on 2 ranks (interleaved) put on one rank and across: the
    embedding is read again by a projection and by the head (stages 0 and 2 on rank 0, 3
    on rank 1), and a block's weight by a later block (stages 1 and 3, both on rank 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.block0 = nn.Linear(6, 6)
        self.proj = nn.Linear(6, 7, bias=False)
        self.back = nn.Linear(7, 6)
        self.block1 = nn.Linear(6, 6)
        self.head = nn.Linear(6, 7, bias=False)
        self.proj.weight = self.head.weight = self.embed.weight
        self.block1.weight = self.block0.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.block0(self.embed(ids)))
        h = torch.tanh(self.back(torch.softmax(self.proj(h), -1)))
        return self.head(torch.tanh(self.block1(h))).mean(1)


class _PairLinear(nn.Module):
    """A linear map of a (features, mask) pair's features, taken as one argument; passes
    the pair on, or only the result (the head)."""

    def __init__(self, cin: int, cout: int, head: bool = False) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(cin, cout), head

    def forward(self, pair: tuple[Tensor, Tensor]) -> Any:
        h = self.lin(pair[0])
        return h if self.head else (h, pair[1])


class _MaskedBlock(_PairLinear):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Any:
        h, mask = pair
        return h + torch.tanh(self.lin(h)) * mask[:, None], mask


class CounterNet(nn.Module):
    """A top-level forward that writes buffers between its blocks, as a one-process model
    may: a call counter, an EMA of its input that it then subtracts, and an unused
    buffer and module (held by no block)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("in_mean", torch.zeros(6))
        self.register_buffer("unused", torch.arange(3.0))
        self.spare = nn.Linear(2, 2)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        self.calls.add_(1)
        self.in_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        x = x - self.in_mean
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class AliasNet(nn.Module):
    """One parameter and one module under two names each, used before and after the cut
    (``self.b = self.a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mm1 = self.mm0 = nn.Parameter(torch.randn(6, 6) / 3)
        self.lin1 = self.lin0 = nn.Linear(6, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.lin0(x @ self.mm0))
        x = torch.relu(self.lin1(x @ self.mm1))
        return self.head(x)


def pair_sequential() -> nn.Sequential:
    """An ``nn.Sequential`` whose input is a tuple and whose layers pass tuples on."""
    return nn.Sequential(_PairLinear(6, 8), _MaskedBlock(8, 8), _MaskedBlock(8, 8),
                         _PairLinear(8, 4, head=True))


def gpt2(positions: int = 8) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=11, n_positions=positions, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert() -> BertForSequenceClassification:
    return BertForSequenceClassification(BertConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=11, max_position_embeddings=8, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.5))


def llama(tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8,
        tie_word_embeddings=tie_word_embeddings))


def tied_llama() -> LlamaForCausalLM:
    """The Llama above with its head tied to its embedding."""
    return llama(tie_word_embeddings=True)


def t5() -> T5ForConditionalGeneration:
    """T5 ties ``shared``, both ``embed_tokens`` and ``lm_head``: a three-way tie."""
    return T5ForConditionalGeneration(T5Config(
        vocab_size=11, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        tie_word_embeddings=True))


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    example: Callable[[int, int], tuple[Any, Tensor]]
    loss_fn: Callable[[Any, Tensor], Tensor]
    split_points: list[str]


_POOL = 256
_g = torch.Generator().manual_seed(100)
_IMAGES = (torch.randn(_POOL, 3, 8, 8, generator=_g), torch.randint(0, 5, (_POOL,), generator=_g))
_ROWS = (torch.randn(_POOL, 6, generator=_g), (torch.rand(_POOL, generator=_g) > 0.2).long(),
         torch.randint(0, 4, (_POOL,), generator=_g))
_TOKENS = (torch.randint(0, 7, (_POOL, 5), generator=_g),
           torch.randint(0, 7, (_POOL,), generator=_g))
_IDS = torch.randint(0, 11, (_POOL, 6), generator=_g)
_TEXT = (_IDS, (_IDS + 1) % 11,  # a next token to learn
         (torch.arange(6) < torch.randint(3, 7, (_POOL, 1), generator=_g)).long(),
         torch.randint(0, 3, (_POOL,), generator=_g))


def _window(k: int, n: int) -> slice:
    """Minibatch ``k`` of size ``n``: samples ``k*n ..`` of a fixed stream, so a minibatch's
    microbatches are the stream's minibatches of the microbatch size (as in the zoo's data)."""
    start = k * n % _POOL
    assert start + n <= _POOL
    return slice(start, start + n)


def _images(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return _IMAGES[0][w], _IMAGES[1][w]


def _masked(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return {"x": _ROWS[0][w], "mask": _ROWS[1][w]}, _ROWS[2][w]


def _pairs(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return (_ROWS[0][w], _ROWS[1][w].float()), _ROWS[2][w]


def _tokens(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return _TOKENS[0][w], _TOKENS[1][w]


def _text(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return {"input_ids": _TEXT[0][w]}, _TEXT[1][w]


def _rows(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return _ROWS[0][w], _ROWS[2][w]


def _rows64(k: int, n: int) -> tuple[Any, Tensor]:
    x, y = _rows(k, n)
    return x.double(), y


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                         nn.Linear(12, 4))


class SpareBlock(nn.Module):
    """A Linear and a registered module its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.spare = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


def spare_blocks() -> nn.Sequential:
    """Blocks that each hold a module their forward never calls: one process gives its
    weights no gradient, so weight decay leaves them be."""
    return nn.Sequential(SpareBlock(), SpareBlock(), nn.Linear(6, 4))


def float64_mlp() -> nn.Sequential:
    """A model in float64, which fp32 training keeps so, across the cut too."""
    return _mlp().double()


def frozen_first() -> nn.Sequential:
    """An MLP whose first Linear is frozen: cut after it, the first stage trains nothing."""
    model = _mlp()
    model[0].requires_grad_(False)
    return model


def _seq2seq(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return {"input_ids": _TEXT[0][w], "decoder_input_ids": _TEXT[1][w]}, _TEXT[0][w]


def _masked_text(k: int, n: int) -> tuple[Any, Tensor]:
    w = _window(k, n)
    return {"input_ids": _TEXT[0][w], "attention_mask": _TEXT[2][w]}, _TEXT[3][w]


def _lm_loss(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _logits_loss(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out.logits, y)


def _dict_loss(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out["logits"], y)


CASES: dict[str, Case] = {
    "resnet": Case(ResNet, _images, F.cross_entropy, ["layer2"]),
    "skip": Case(SkipNet, _masked, _dict_loss, ["blocks.1"]),
    "pairs": Case(pair_sequential, _pairs, F.cross_entropy, ["2"]),
    "tied": Case(TiedNet, _tokens, F.cross_entropy, ["head"]),
    "gpt2": Case(gpt2, _text, _lm_loss, ["transformer.h.1"]),
    "bert": Case(bert, _masked_text, _logits_loss, ["bert.encoder.layer.1"]),
    "llama": Case(llama, _text, _lm_loss, ["model.layers.1"]),
    "t5": Case(t5, _seq2seq, _lm_loss, ["decoder.embed_tokens"]),
    "counter": Case(CounterNet, _rows, F.cross_entropy, ["blocks.2"]),
    "alias": Case(AliasNet, _rows, F.cross_entropy, ["lin1@2"]),
}

#: Cases only the tests of ties train (:mod:`.test_models_torchrun`), cut into 4 stages.
TIED_CASES: dict[str, Case] = {
    "tied-llama": Case(tied_llama, _text, _lm_loss,
                       ["model.layers.0", "model.layers.1", "model.norm"]),
    "twice-tied": Case(TwiceTiedNet, _tokens, F.cross_entropy, ["block0", "proj", "block1"]),
}


#: Models a run must take as they are: float64 weights, a stage with nothing to train.
ODD_CASES: dict[str, Case] = {
    "float64": Case(float64_mlp, _rows64, F.cross_entropy, ["2"]),
    "frozen": Case(frozen_first, _rows, F.cross_entropy, ["2"]),
}

#: Cases of their own tests, outside the loops over the dicts above.
OTHER_CASES: dict[str, Case] = {
    "spare": Case(spare_blocks, _rows, F.cross_entropy, ["1"]),
}


#: The step whose minibatch is short in the cases of sequences of changing length.
SHORT_STEP, SHORT_BY = 19, 3


def _random_length(k: int, n: int) -> tuple[dict[str, Tensor], Tensor]:
    """Minibatch ``k``: ``n`` sequences of 8 to 64 tokens (``SHORT_BY`` fewer at ``SHORT_STEP``)."""
    g = torch.Generator().manual_seed(1000 + k)
    length = int(torch.randint(8, 65, (), generator=g))
    ids = torch.randint(0, 11, (max(n - SHORT_BY * (k == SHORT_STEP), 1), length), generator=g)
    return {"input_ids": ids}, (ids + 1) % 11


def _packed(k: int, n: int) -> tuple[dict[str, Tensor], Tensor]:
    """:func:`_random_length`'s sequences as packed documents: positions restart at each
    document's start, and the mask hides each row's last token (a pad)."""
    x, y = _random_length(k, n)
    ids, length = x["input_ids"], x["input_ids"].shape[1]
    starts = torch.rand(ids.shape, generator=torch.Generator().manual_seed(k)) < 0.2
    starts[:, 0] = True
    index = torch.arange(length).expand_as(ids)
    begun = torch.cummax(torch.where(starts, index, 0), dim=1).values
    mask = torch.ones_like(ids)
    mask[:, -1] = 0
    return {"input_ids": ids, "position_ids": index - begun, "attention_mask": mask}, y


def _sometimes_padded(k: int, n: int) -> tuple[dict[str, Tensor], Tensor]:
    """12 tokens a row; in even minibatches the first half's rows end in 3 pads, in odd
    ones nothing is padded, so a Hugging Face model drops the all-ones mask of some
    microbatches and passes on fewer tensors for them."""
    g = torch.Generator().manual_seed(2000 + k)
    ids = torch.randint(0, 11, (n, 12), generator=g)
    mask = torch.ones_like(ids)
    if k % 2 == 0:
        mask[: n // 2, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask}, (ids + 1) % 11


#: Sequences of 8 to 64 tokens, one length a minibatch (docs/training.md).
VARLEN_CASES: dict[str, Case] = {
    "gpt2-unpadded": Case(lambda: gpt2(64), _sometimes_padded, _lm_loss, ["transformer.h.1"]),
    "gpt2-varlen": Case(lambda: gpt2(64), _random_length, _lm_loss, ["transformer.h.1"]),
    "gpt2-packed": Case(lambda: gpt2(64), _packed, _lm_loss, ["transformer.h.1"]),
}


def find_case(name: str) -> Case:
    """The case ``name`` of :data:`CASES`, :data:`TIED_CASES`, :data:`VARLEN_CASES`,
    :data:`ODD_CASES` or :data:`OTHER_CASES`."""
    return CASES[name] if name in CASES else {**TIED_CASES, **VARLEN_CASES, **ODD_CASES,
                                              **OTHER_CASES}[name]


class CaseSpec:
    """A case as the references' model spec: stages built from a fresh seeded model,
    traced on microbatches of ``microbatch`` samples (the shapes a trace bakes in)."""

    def __init__(self, case: Case, seed: int, microbatch: int = 1) -> None:
        self.case, self.seed, self.microbatch = case, seed, microbatch
        self.loss_fn = case.loss_fn
        self.num_layers = len(split_layers(self.model(), case.example(0, 1)[0]))

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.case.build()

    def build(self, first: int, last: int, seed: int) -> nn.Module:
        """Layers ``first..last``; the whole model as it is, called with its inputs."""
        if (first, last) == (0, self.num_layers - 1):
            return _AsCalled(self.model())
        example = self.case.example(0, self.microbatch)[0]
        return Chain(split_layers(self.model(), example)[first : last + 1])


class _AsCalled(nn.Module):
    """``model`` itself (its modules and names), called with a dict as keyword arguments."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.__dict__.update(_modules=model._modules, _parameters=model._parameters,
                             _buffers=model._buffers, _called=model)

    def forward(self, x: Any) -> Any:
        model = self.__dict__["_called"]
        return model(**x) if isinstance(x, dict) else model(x)


class CaseData:
    """A case's minibatches as the references' data set (``batch(k, size)``)."""

    def __init__(self, case: Case) -> None:
        self.case = case

    def batch(self, k: int, size: int) -> tuple[Any, Tensor]:
        return self.case.example(k, size)
