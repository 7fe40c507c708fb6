"""DualPipeV's overlapped pair: one action, a forward and another microbatch's backward.

An ``OVERLAP_F_B`` action runs the forward of one stage's microbatch and the
backward of another stage's (the rank's two stages under the V placement). Its
receives are posted ahead with the rank's others and both its sends go out
together right after it (docs/design.md §7.12). Between them, the pair is
handed to an :data:`OverlapHook`: the model's own ``overlap_pair`` method where it
has one (:func:`model_hook`, as DeepSeek's DualPipe calls a module's
``overlapped_forward_backward``), else :func:`one_after_the_other`. A model whose
layers communicate (an MoE layer's all-to-all, a tensor-parallel all-reduce) gets the
:class:`OverlappedPair`, both stages' modules and two callables, and calls each
exactly once, in either order or at once (on two CUDA streams, or a thread each: the
halves share no state), so that one half's communication runs under the other
half's compute. dreampipe checks that both ran once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from dreampipe.errors import ConfigError

__all__ = ["HOOK", "OverlapHook", "OverlappedPair", "model_hook", "one_after_the_other",
           "run_pair"]

#: The method of a model that runs its overlapped pairs.
HOOK = "overlap_pair"


@dataclass(frozen=True)
class OverlappedPair:
    """One ``OVERLAP_F_B``: the forward of ``forward_microbatch`` on ``forward_stage``
    (its layers ``forward_module``) and the backward of ``backward_microbatch`` on
    ``backward_stage`` (``backward_module``). :attr:`run_forward` and
    :attr:`run_backward` compute them, each to be called exactly once."""

    forward_stage: int
    forward_microbatch: int
    forward_module: nn.Module
    backward_stage: int
    backward_microbatch: int
    backward_module: nn.Module
    run_forward: Callable[[], None]
    run_backward: Callable[[], None]


#: What runs an overlapped pair: calls ``pair.run_forward()`` and ``pair.run_backward()``
#: once each, overlapping them as the model can.
OverlapHook = Callable[[OverlappedPair], None]


def one_after_the_other(pair: OverlappedPair) -> None:
    """The default hook: the forward, then the backward (no overlap)."""
    pair.run_forward()
    pair.run_backward()


def model_hook(model: nn.Module) -> OverlapHook:
    """``model``'s ``overlap_pair`` method, else :func:`one_after_the_other`; a ConfigError
    if the model has an ``overlap_pair`` that is not callable."""
    hook = getattr(model, HOOK, None)
    if hook is None:
        return one_after_the_other
    if not callable(hook):
        raise ConfigError(f"the model's {HOOK} is {hook!r}; give it a method "
                          f"{HOOK}(pair) that calls pair.run_forward() and "
                          "pair.run_backward() once each, or remove it", HOOK)
    return hook  # type: ignore[no-any-return]


def run_pair(hook: OverlapHook, pair: OverlappedPair) -> None:
    """Run ``pair`` through ``hook``; a ConfigError if the hook did not run each half
    exactly once (the schedule counts on both)."""
    calls = [0, 0]

    def forward() -> None:
        calls[0] += 1
        if calls[0] == 1:
            pair.run_forward()

    def backward() -> None:
        calls[1] += 1
        if calls[1] == 1:
            pair.run_backward()

    hook(OverlappedPair(pair.forward_stage, pair.forward_microbatch, pair.forward_module,
                        pair.backward_stage, pair.backward_microbatch, pair.backward_module,
                        forward, backward))
    if calls != [1, 1]:
        raise ConfigError(
            f"the overlap hook {getattr(hook, '__name__', hook)!r} ran the forward of "
            f"microbatch {pair.forward_microbatch} (stage {pair.forward_stage}) {calls[0]} "
            f"time(s) and the backward of microbatch {pair.backward_microbatch} (stage "
            f"{pair.backward_stage}) {calls[1]} time(s); call pair.run_forward() and "
            "pair.run_backward() exactly once each", HOOK)
