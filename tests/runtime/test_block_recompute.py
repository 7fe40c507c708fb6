"""A stage that recomputes some of its blocks, or their attention (``runtime/block_recompute.py``),
trains bit for bit as one that keeps them: on stashed weight versions across updates, with
Zero Bubble's split backward, under bf16 autocast, with dropout; and it keeps what the
memory model (``planning/costs.py``'s ``blocks_kept_bytes``) says."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, T5Config
from transformers import T5ForConditionalGeneration as T5

from dreampipe.errors import ConfigError
from dreampipe.models.transformer import CausalAttention, TransformerBlock, transformer
from dreampipe.planning.memory_terms import blocks_kept_bytes
from dreampipe.runtime.block_recompute import (
    BlockRecompute,
    attention_modules,
    block_class,
    stage_blocks,
)
from dreampipe.runtime.stage_module import StageModule
from dreampipe.splitter.chain import Chain, split_layers

__all__: list[str] = []

_GEN = torch.Generator().manual_seed(3)
_TOKENS = [torch.randint(0, 11, (2, 6), generator=_GEN) for _ in range(4)]
_TARGETS = [torch.randint(0, 11, (2, 6), generator=_GEN) for _ in range(4)]


@dataclass
class _Model:
    """A model cut in two stages of two blocks each, its loss and optimizer."""

    whole: nn.Module
    first: nn.Module
    second: nn.Module
    loss: Callable[[Any, Tensor], Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    input: Callable[[Tensor], Any]


def _transformer() -> _Model:
    """dreampipe's ``transformer`` with dropout (embed, 4 blocks, head), SGD with momentum."""
    spec = transformer(vocab=11, dim=16, heads=2, layers=4, seq_len=6, dropout=0.2)
    return _Model(spec.build(), spec.build(0, 2), spec.build(3, 5), spec.loss_fn,
                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda t: t)


def _llama() -> _Model:
    """A tiny Hugging Face Llama with attention dropout, traced and cut, and Adam."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8,
        attention_dropout=0.2))
    layers = split_layers(model, {"input_ids": _TOKENS[0]})
    cut = [n for n, _ in layers].index("model.layers.2")

    def loss(out: Any, y: Tensor) -> Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    return _Model(model, Chain(layers[:cut]), Chain(layers[cut:]), loss,
                  lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda t: {"input_ids": t})


_MODELS = {"transformer": _transformer, "llama": _llama}
_SPECS = {"first-block": BlockRecompute(1), "every-block": BlockRecompute(2),
          "attention": BlockRecompute(selective=True)}


def _train(name: str, spec: BlockRecompute | None, split: bool, bf16: bool) -> list[Tensor]:
    """PipeDream's order on the two stages, ``F0 F1 B0 S F2 B1 S F3 B2 S B3 S``: microbatch
    ``u + 1`` runs its forward on the weights ``u``'s update then replaces (two versions
    in flight). Each stage's losses, input gradients and final weights."""
    m = _MODELS[name]()
    spec = spec.for_model(m.whole) if spec is not None else None
    st0 = StageModule(m.first, m.optimizer, stage=0, input_grad=False, blocks=spec)
    st1 = StageModule(m.second, m.optimizer, stage=1, input_grad=True, loss_fn=m.loss,
                      blocks=spec)
    cast = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
    torch.manual_seed(5)
    out: list[Tensor] = []
    for step, u in [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                    ("B", 3)]:
        if step == "F":
            with cast:
                h = st0.forward(u, m.input(_TOKENS[u]))
                out.append(st1.forward(u, h.detach(), target=_TARGETS[u]))
            continue
        if split:
            gx = st1.backward_input(u)
            st1.backward_weight(u)
            assert gx is not None and st0.backward_input(u, gx) is None
            st0.backward_weight(u)
        else:
            gx = st1.backward(u)
            assert gx is not None
            st0.backward(u, gx)
        out.append(gx)
        st0.step()
        st1.step()
    assert st0.peak_versions == st1.peak_versions == 2
    return [*out, *st0.params, *st1.params]


@cache
def _kept(name: str, split: bool, bf16: bool) -> list[Tensor]:
    return _train(name, None, split, bf16)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("split", [False, True], ids=["backward", "b-then-w"])
@pytest.mark.parametrize("spec", list(_SPECS), ids=list(_SPECS))
@pytest.mark.parametrize("name", list(_MODELS))
def test_recomputing_blocks_trains_bit_for_bit_as_keeping_them(
        name: str, spec: str, split: bool, bf16: bool) -> None:
    want = _kept(name, split, bf16)
    got = _train(name, _SPECS[spec], split, bf16)
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _blocks(n: int, dropout: float = 0.2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(TransformerBlock(16, 2, dropout) for _ in range(n)))


@contextlib.contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch, cls: type[nn.Module]) -> Iterator[list[bool]]:
    """``cls``'s forward calls, each noted as run with grad mode on or off."""
    calls: list[bool] = []
    forward = cls.forward

    def counted(self: nn.Module, *args: Any) -> Any:
        calls.append(torch.is_grad_enabled())
        return forward(self, *args)

    monkeypatch.setattr(cls, "forward", counted)
    yield calls


@pytest.mark.parametrize(("spec", "cls", "again", "again_in_w"), [
    (BlockRecompute(2), TransformerBlock, 2, 2),
    (BlockRecompute(0), TransformerBlock, 0, 0),
    (BlockRecompute(selective=True), CausalAttention, 3, 0)])  # no weight in it: W skips it
@pytest.mark.parametrize("split", [False, True], ids=["backward", "b-then-w"])
def test_the_backward_runs_the_recomputed_modules_again_and_w_once_more(
        monkeypatch: pytest.MonkeyPatch, spec: BlockRecompute, cls: type[nn.Module],
        again: int, again_in_w: int, split: bool) -> None:
    with _counting(monkeypatch, cls) as calls:
        st = StageModule(_blocks(3), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=1,
                         input_grad=True, blocks=spec)
        st.forward(0, torch.randn(2, 5, 16))
        assert len(calls) == 3
        if split:
            st.backward_input(0, torch.ones(2, 5, 16))
            assert len(calls) == 3 + again
            st.backward_weight(0)
        else:
            st.backward(0, torch.ones(2, 5, 16))
    # W walks several groups of weights (the LayerNorms'), but recomputes once for all
    assert len(calls) == 3 + again + (again_in_w if split else 0)
    assert all(calls)


def test_the_recomputation_runs_on_the_stashed_version_not_the_live_weights() -> None:
    """``F0 F1 B0 STEP B1``: microbatch 1's gradient is that of the weights it ran on."""
    st = StageModule(_blocks(2, dropout=0.0), lambda ps: torch.optim.SGD(ps, lr=0.5), stage=1,
                     input_grad=True, blocks=BlockRecompute(2))
    plain = _blocks(2, dropout=0.0)
    x0, x1, g = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    st.forward(0, x0)
    st.forward(1, x1)
    st.backward(0, g)
    st.step()
    assert not torch.equal(st.params[0].detach(), plain[0].ln1.weight.detach())
    gx = st.backward(1, g)
    x = x1.detach().clone().requires_grad_(True)
    plain(x).backward(g)  # the weights before the step (kernels may differ: not bit for bit)
    torch.testing.assert_close(gx, x.grad)
    for got, p in zip(st.gradients(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad)


class _EmaBlock(nn.Module):
    """Reads a buffer its forward updates (an EMA it subtracts) and a BatchNorm's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x: Tensor) -> Tensor:
        self.mean.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return x + torch.tanh(self.norm(self.lin(x - self.mean)))


def test_a_recomputed_block_reads_its_buffers_as_its_forward_did_and_moves_them_once() -> None:
    def train(spec: BlockRecompute | None) -> list[Tensor]:
        torch.manual_seed(0)
        st = StageModule(nn.Sequential(_EmaBlock(), _EmaBlock()),
                         lambda ps: torch.optim.SGD(ps, lr=0.1), stage=1, input_grad=True,
                         blocks=spec)
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(4, 6, generator=gen) for _ in range(3)]
        out = [st.forward(u, x) for u, x in enumerate(xs)]
        for u in range(3):
            gx = st.backward(u, torch.ones(4, 6))
            assert gx is not None
            out.append(gx)
        st.step()
        return [*out, *st.params, *st.module.buffers()]

    for a, b in zip(train(None), train(BlockRecompute(2)), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


# ---- memory ------------------------------------------------------------------------
def _saved_bytes(run: Callable[[], object], weights: list[Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``run`` runs,
    weights left out (they are held anyway)."""
    skip = {w.untyped_storage().data_ptr() for w in weights}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _wide(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(TransformerBlock(32, 2, 0.1) for _ in range(n)))


def test_recomputing_blocks_keeps_what_the_memory_model_says() -> None:
    n = 4
    xs = [torch.randn(4, 16, 32) for _ in range(3)]
    kept, inputs, h = [], [], xs[0]
    for b in _wide(n):  # each block alone: what it keeps, and its input
        x = h.detach().requires_grad_(True)
        kept.append(_saved_bytes(lambda b=b, x=x: b(x), list(b.parameters())))
        inputs.append(x.nbytes)
        h = b(x)

    def held(spec: BlockRecompute, m: int) -> int:
        st = StageModule(_wide(n), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=1,
                         input_grad=True, blocks=spec)
        return _saved_bytes(lambda: [st.forward(u, xs[u].clone()) for u in range(m)],
                            st.params)

    for k in (0, 1, n):
        for m in (1, 3):
            again = max(kept[:k], default=0)  # the backward's one recomputed block
            model = blocks_kept_bytes(kept, inputs, k, m)
            assert held(BlockRecompute(k), m) + again == pytest.approx(model, rel=0.15)
    assert held(BlockRecompute(n), 3) < held(BlockRecompute(0), 3) / 4
    assert held(BlockRecompute(selective=True), 3) < held(BlockRecompute(0), 3)


# ---- which blocks ------------------------------------------------------------------
def test_the_block_class_is_the_outermost_repeated_layer_of_a_container() -> None:
    spec = transformer(vocab=11, dim=16, heads=2, layers=3, seq_len=6)
    assert block_class(spec.build()) is TransformerBlock
    assert block_class(*spec.build().children()) is TransformerBlock  # as its layers
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8))
    assert block_class(llama).__name__ == "LlamaDecoderLayer"  # not its attention or MLP
    layers = [m for _, m in split_layers(llama, {"input_ids": _TOKENS[0]})]
    assert block_class(*layers).__name__ == "LlamaDecoderLayer"  # not the traced segments
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=11,
                                      n_positions=8))
    assert block_class(gpt2).__name__ == "GPT2Block"  # not its two Embeddings
    t5 = T5(T5Config(vocab_size=11, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                     num_decoder_layers=2, num_heads=2, decoder_start_token_id=0))
    assert block_class(t5).__name__ == "T5Block"  # not the encoder and decoder stacks
    attention = [type(a).__name__ for a in attention_modules(stage_blocks(t5, "T5Block")[2])]
    assert attention == ["T5LayerSelfAttention", "T5LayerCrossAttention"]
    assert [type(a).__name__ for a in attention_modules(llama.model.layers[0])] == [
        "LlamaAttention"]


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


class _Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)


def test_of_two_repeated_layers_the_one_holding_most_parameters_is_the_block() -> None:
    model = nn.Sequential(_Small(), _Small(), _Small(), nn.Linear(4, 8), _Big(), _Big())
    assert block_class(model) is _Big
    assert stage_blocks(model, _Big) == [model[4], model[5]]
    assert stage_blocks(model, "_Small") == [model[0], model[1], model[2]]


def test_a_model_with_no_repeated_block_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"no repeated block in Sequential.*module of one class"):
        block_class(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)))


def _stage(module: nn.Module, spec: BlockRecompute, **kw: Any) -> StageModule:
    return StageModule(module, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=2,
                       input_grad=True, blocks=spec, **kw)


def test_the_stage_refuses_what_it_cannot_recompute() -> None:
    with pytest.raises(ConfigError, match="blocks=4 but stage 2 holds 3 TransformerBlock"):
        _stage(_blocks(3), BlockRecompute(4))
    with pytest.raises(ConfigError, match=r"recompute=True\) and blocks too"):
        _stage(_blocks(3), BlockRecompute(1), recompute=True)
    with pytest.raises(ConfigError, match="no repeated block in Sequential"):
        _stage(_blocks(1), BlockRecompute(1))  # one block: name the model's class
    _stage(_blocks(1), BlockRecompute(1).for_model(_blocks(3)))
    _stage(_blocks(1), BlockRecompute(1).for_model(*_blocks(3)))  # the model's layers
    named = BlockRecompute(1, block="TransformerBlock")
    assert named.for_model(nn.Linear(2, 2)) is named  # a named class stays
    with pytest.raises(ConfigError, match="selective=True but _EmaBlock has no attention"):
        _stage(nn.Sequential(_EmaBlock(), _EmaBlock()), BlockRecompute(selective=True))


@pytest.mark.parametrize(("kw", "match"), [
    ({}, "blocks=None with selective=False"),
    ({"blocks": 1, "selective": True}, "blocks=1 with selective=True"),
    ({"blocks": -1}, "blocks=-1: give how many")])
def test_a_spec_says_one_thing_to_recompute(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BlockRecompute(**kw)
