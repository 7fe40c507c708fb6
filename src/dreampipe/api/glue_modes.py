"""The modes a traced model's code between its blocks was traced in, held to at each step.

fx reads ``self.training`` of every module whose forward it traces through (the model
itself and the containers around its blocks) as a Python value, so the segments'
graphs keep the modes those modules had when ``Pipeline(...)`` traced them. The blocks
are the user's own modules and follow ``train()`` and ``eval()`` at any time. A switch
of a traced-through module after the trace would leave the code between the blocks in
one mode and the blocks in the other, which no single process computes: a step refuses
it and names the fix (docs/design.md §2.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dreampipe.errors import ConfigError
from dreampipe.splitter.chain import Layers
from dreampipe.splitter.segments import Segment

__all__ = ["GlueModes"]


def _mode(training: bool) -> str:
    return "training" if training else "eval"


@dataclass(frozen=True)
class GlueModes:
    """The traced-through modules of a model (by name, the model itself ``""``) and the
    mode each was traced in; none for a model whose layers are its own modules."""

    model: str
    modules: tuple[tuple[str, nn.Module], ...]
    traced: tuple[bool, ...]

    @classmethod
    def of(cls, model: nn.Module, layers: Layers) -> GlueModes:
        """The modules ``layers``' segments traced through: strict ancestors of what they
        read, not read whole themselves."""
        read = {t for _, layer in layers if isinstance(layer, Segment) for t in layer.targets}
        above = {".".join(parts[:k]) for parts in (t.split(".") for t in read)
                 for k in range(len(parts))}  # every strict prefix, "" the model itself
        modules = tuple((name, m) for name, m in model.named_modules()
                        if name in above and name not in read)
        return cls(type(model).__name__, modules, tuple(m.training for _, m in modules))

    def check(self) -> None:
        """Refuse a step whose traced-through modules are no longer in their traced modes."""
        for (name, module), traced in zip(self.modules, self.traced, strict=True):
            if module.training != traced:
                what = f"{self.model}.{name}" if name else self.model
                raise ConfigError(
                    f"{what} was in {_mode(traced)} mode when Pipeline(...) traced its forward "
                    f"and is in {_mode(module.training)} mode now; the code between its "
                    "blocks keeps the mode it was traced in while the blocks follow the "
                    f"switch: call model.{'train' if module.training else 'eval'}() before "
                    "building the Pipeline (build it again), or switch the model back",
                    "model")
