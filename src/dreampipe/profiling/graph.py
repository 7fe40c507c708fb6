"""LayerGraph: the per-layer profile every other part plans and simulates on.

A profile is an ordered list of layers (a topological order) with measured
forward/backward times, output activation size and parameter size, all for
the whole minibatch it was measured at, plus the data-flow edges between
layers (a chain for ``nn.Sequential``, a DAG for residual models). It is plain
data: frozen dataclasses that round-trip through JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreampipe.errors import ProfileError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["FORMAT_VERSION", "Layer", "LayerGraph"]

FORMAT_VERSION = 1

#: The figures a profile may leave out.
_OPTIONAL = ("saved_bytes", "weight_grad_ms", "backward_bytes", "deferred_bytes",
             "recorded_bytes", "library_bytes", "largest_parameter_bytes", "loss_bytes")


@dataclass(frozen=True)
class Layer:
    """One profiled layer. Times in milliseconds, sizes in bytes, per minibatch.

    ``saved_bytes`` is what a minibatch in flight keeps of this layer until its
    backward: its output and every tensor autograd saves inside it (a ReLU's
    result, a max-pool's indices), but not its inputs or parameters; None
    where unknown (PipeDream's graph.txt), and then the output alone counts
    (:attr:`stash_bytes`). Each figure must be a finite number >= 0 (``inf`` or ``nan``
    is a broken measurement, which would surface later as a baffling planner error).

    ``weight_grad_ms`` is the part of ``backward_ms`` spent on the weight gradient, timed
    apart from the input gradient; a zero-bubble schedule runs the two as separate
    actions. None where not measured (PipeDream's graph.txt, older profiles): then half
    of the backward counts (:attr:`weight_grad_share`), the two being matrix products of
    the same size in a linear or convolution layer.

    ``backward_bytes`` is the most the layer's backward holds at once besides what
    the forward kept (its upstream gradient, the gradients and temporaries it makes,
    the loss's backward on the last layer), ``deferred_bytes`` what its backward leaves
    alive until the stage's ends when its Linear weight gradients wait,
    ``recorded_bytes`` what a split backward's ``B`` keeps for its ``W`` beyond the kept
    tensors (its Linear outputs' gradients), and ``library_bytes`` what the compute
    library keeps for its kernels once it ran (:mod:`.layer_memory`); None where not
    measured, and then the backward counts ``stash_bytes``, the deferred, the recorded
    and the library nothing. ``largest_parameter_bytes`` is the layer's largest parameter
    (an optimizer's step and a weight's gradient come a parameter at a time); None where
    not measured, and then :attr:`largest_parameter` is the whole layer's. ``loss_bytes``,
    on the last layer, is the part of its kept tensors the loss saved (cross-entropy's
    log-probabilities), which a split backward's ``B`` frees with the loss; None: none.

    ``reused`` names the parameters the layer uses that an earlier one counted in its
    ``parameter_bytes`` (a tied head, a module called twice), each ``(first, k, bytes)``:
    the ``k``-th parameter layer ``first`` counted. A stage holding this layer but not
    ``first`` holds a copy of it (:meth:`LayerGraph.reused_bytes`).

    ``writes_input``: the layer's forward writes a floating input in place (``ReLU(inplace=
    True)``), so a stage it begins runs on a copy of its input, which one process never
    makes (:func:`~dreampipe.planning.memory_terms.input_copies`).
    """

    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int
    parameter_bytes: int
    description: str = ""
    saved_bytes: int | None = None
    weight_grad_ms: float | None = None
    backward_bytes: int | None = None
    deferred_bytes: int | None = None
    library_bytes: int | None = None
    recorded_bytes: int | None = None
    largest_parameter_bytes: int | None = None
    loss_bytes: int | None = None
    reused: tuple[tuple[int, int, int], ...] = ()
    writes_input: bool = False

    def __post_init__(self) -> None:
        for what in ("forward_ms", "backward_ms", "activation_bytes", "parameter_bytes",
                     *_OPTIONAL):
            value = getattr(self, what)
            if value is None and what in _OPTIONAL:
                continue
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ProfileError(
                    f"layer {self.name!r} has {what}={value!r}; "
                    "times and sizes must be finite non-negative numbers"
                )
        if self.weight_grad_ms is not None and self.weight_grad_ms > self.backward_ms:
            raise ProfileError(
                f"layer {self.name!r} has weight_grad_ms={self.weight_grad_ms} above "
                f"backward_ms={self.backward_ms}; the weight gradient is part of the backward"
            )

    @property
    def compute_ms(self) -> float:
        """Forward plus backward time, the planner's ``T_l``."""
        return self.forward_ms + self.backward_ms

    @property
    def weight_grad_share(self) -> float:
        """The weight gradient's share of the backward: measured, else one half."""
        if self.weight_grad_ms is None or self.backward_ms <= 0:
            return 0.5
        return self.weight_grad_ms / self.backward_ms

    @property
    def stash_bytes(self) -> int:
        """Bytes a minibatch in flight keeps of this layer: ``saved_bytes``, else the output."""
        return self.activation_bytes if self.saved_bytes is None else self.saved_bytes

    @property
    def largest_parameter(self) -> int:
        """Bytes of the layer's largest parameter: measured, else the whole layer's (a
        bound), at most the layer's."""
        measured = self.largest_parameter_bytes
        return self.parameter_bytes if measured is None else min(measured,
                                                                 self.parameter_bytes)

    @property
    def working_bytes(self) -> int:
        """What the layer's backward holds besides its kept tensors: ``backward_bytes``,
        else ``stash_bytes`` (its kept tensors' gradients, about as many bytes)."""
        return self.stash_bytes if self.backward_bytes is None else self.backward_bytes

    @property
    def kernel_kind(self) -> tuple[str, int, int, int]:
        """Layers of one kind run the same kernels, whose library memory a process keeps
        once: the description and the sizes of weights, output and kept tensors."""
        return (self.description, self.parameter_bytes, self.activation_bytes,
                self.stash_bytes)

    @property
    def is_input(self) -> bool:
        """An ``Input`` node of a PipeDream profile: its time is data loading, not model work."""
        return self.description.startswith("Input")


@dataclass(frozen=True)
class LayerGraph:
    """Layers in topological order plus edges ``(producer, consumer)`` by index.

    ``batch_size`` is the minibatch the profile was measured at (0 if unknown,
    as in PipeDream's graph.txt).
    """

    layers: tuple[Layer, ...]
    edges: tuple[tuple[int, int], ...] = ()
    batch_size: int = 0
    model: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError("the profile has no layers; profile a model with at least one layer")
        if self.batch_size < 0:
            raise ProfileError(f"batch_size={self.batch_size} is negative")
        n = len(self.layers)
        seen: set[str] = set()
        for layer in self.layers:
            if layer.name in seen:
                raise ProfileError(f"layer name {layer.name!r} appears twice; names must be unique")
            seen.add(layer.name)
        for src, dst in self.edges:
            if not (0 <= src < n and 0 <= dst < n):
                raise ProfileError(
                    f"edge {src}->{dst} names a layer outside 0..{n - 1}; "
                    "every edge must join two profiled layers"
                )
            if src == dst:
                raise ProfileError(f"edge {src}->{dst} is a self-loop on {self.layers[src].name!r}")
            if src > dst:
                raise ProfileError(
                    f"edge {self.layers[src].name!r}->{self.layers[dst].name!r} points backwards "
                    "in the layer order: the graph has a cycle or the layers are not in "
                    "topological order"
                )

        for index, layer in enumerate(self.layers):
            for first, _, size in layer.reused:
                if not 0 <= first < index or size < 0:
                    raise ProfileError(
                        f"layer {layer.name!r} reuses a parameter of layer {first} "
                        f"({size} bytes); it must be an earlier layer's, of >= 0 bytes")

    # ---- construction -------------------------------------------------
    @classmethod
    def chain(cls, layers: Sequence[Layer], batch_size: int = 0, model: str = "") -> LayerGraph:
        """A straight pipeline of ``layers``: each feeds the next."""
        edges = tuple((i, i + 1) for i in range(len(layers) - 1))
        return cls(tuple(layers), edges, batch_size, model)

    @classmethod
    def from_named_edges(cls, layers: Sequence[Layer], edges: Iterable[tuple[str, str]],
                         batch_size: int = 0, model: str = "") -> LayerGraph:
        """Build from edges given by layer name, sorting layers topologically.

        The sort is stable: among ready layers the earliest in ``layers`` goes
        first. A cycle or an unknown name raises :class:`ProfileError`.
        """
        index = {layer.name: i for i, layer in enumerate(layers)}
        if len(index) != len(layers):
            dup = next(n for n in index if sum(1 for x in layers if x.name == n) > 1)
            raise ProfileError(f"layer name {dup!r} appears twice; names must be unique")
        pairs: list[tuple[int, int]] = []
        for src, dst in edges:
            for end in (src, dst):
                if end not in index:
                    raise ProfileError(f"edge {src!r} -> {dst!r} names unknown layer {end!r}")
            pairs.append((index[src], index[dst]))
        order = _topological_order(len(layers), pairs, [x.name for x in layers])
        position = {old: new for new, old in enumerate(order)}
        new_edges = sorted({(position[s], position[d]) for s, d in pairs})
        return cls(tuple(layers[i] for i in order), tuple(new_edges), batch_size, model)

    # ---- queries --------------------------------------------------------
    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_chain(self) -> bool:
        """True when every layer feeds exactly the next one."""
        return set(self.edges) == {(i, i + 1) for i in range(len(self.layers) - 1)}

    def cut_activation_bytes(self, k: int) -> int:
        """Bytes crossing a cut between layers ``k-1`` and ``k`` (prefix ``0..k-1``).

        The sum of the outputs of every layer before the cut that has a
        consumer after it (docs/design.md §2). For a chain that is ``a_{k-1}``.
        """
        if not 0 < k < len(self.layers):
            raise ValueError(f"a cut must lie strictly inside 1..{len(self.layers) - 1}, got {k}")
        crossing = {src for src, dst in self.edges if src < k <= dst}
        return sum(self.layers[i].activation_bytes for i in crossing)

    def cut_bytes(self) -> list[int]:
        """``cut_bytes()[k]`` = :meth:`cut_activation_bytes` for k in 1..n-1; [0] is 0."""
        n = len(self.layers)
        out = [0] * n
        last_consumer: dict[int, int] = {}
        for src, dst in self.edges:
            last_consumer[src] = max(last_consumer.get(src, dst), dst)
        for src, last in last_consumer.items():
            for k in range(src + 1, last + 1):
                out[k] += self.layers[src].activation_bytes
        return out

    def total_ms(self) -> float:
        """Forward plus backward time of the whole model, per minibatch."""
        return sum(layer.compute_ms for layer in self.layers)

    def total_parameter_bytes(self) -> int:
        return sum(layer.parameter_bytes for layer in self.layers)

    def reused_bytes(self, first: int, last: int) -> int:
        """Bytes of the parameters layers ``first..last`` use that an earlier layer counts:
        the copies a stage of them holds beside its own ``parameter_bytes``."""
        held = {(f, k): size for x in self.layers[first:last + 1] for f, k, size in x.reused
                if f < first}
        return sum(held.values())

    def reused_table(self) -> npt.NDArray[np.float64]:
        """``[i, j]``: :meth:`reused_bytes` of ``i..j`` (0 where ``i > j``)."""
        import numpy as np  # the planner's: ``import dreampipe`` leaves NumPy out

        n = len(self.layers)
        table = np.zeros((n, n), dtype=np.float64)
        users: dict[tuple[int, int], tuple[int, list[int]]] = {}
        for index, x in enumerate(self.layers):
            for f, k, size in x.reused:
                users.setdefault((f, k), (size, []))[1].append(index)
        for (f, _), (size, at) in users.items():
            for i in range(f + 1, n):  # from the first user at or after i on, it is held
                later = [u for u in at if u >= i]
                if later:
                    table[i, min(later):] += size
        return table

    def without_library(self) -> LayerGraph:
        """The graph with no compute library's kernel memory (``library_bytes`` None):
        what the tensors alone hold."""
        return replace(self, layers=tuple(replace(x, library_bytes=None) for x in self.layers))

    # ---- JSON -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "dreampipe.layergraph",
            "version": FORMAT_VERSION,
            "model": self.model,
            "batch_size": self.batch_size,
            "layers": [
                {
                    "name": x.name,
                    "description": x.description,
                    "forward_ms": x.forward_ms,
                    "backward_ms": x.backward_ms,
                    "activation_bytes": x.activation_bytes,
                    "parameter_bytes": x.parameter_bytes,
                    **({} if x.saved_bytes is None else {"saved_bytes": x.saved_bytes}),
                    **({} if x.weight_grad_ms is None else {"weight_grad_ms": x.weight_grad_ms}),
                    **{k: getattr(x, k) for k in _OPTIONAL[2:] if getattr(x, k) is not None},
                    **({"reused": [list(r) for r in x.reused]} if x.reused else {}),
                    **({"writes_input": True} if x.writes_input else {}),
                }
                for x in self.layers
            ],
            "edges": [list(e) for e in self.edges],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerGraph:
        if data.get("format") != "dreampipe.layergraph":
            plan = data.get("format") == "dreampipe.plan"
            raise ProfileError(
                f"format={data.get('format')!r}: not a dreampipe profile "
                "(expected 'dreampipe.layergraph'); "
                + ("it is a plan: simulate it (`dreampipe simulate PLAN.json`), or give "
                   "the profile it was planned from" if plan else
                   "give a file from `dreampipe profile` or PipeDream's graph.txt")
            )
        if data.get("version") != FORMAT_VERSION:
            raise ProfileError(
                f"profile format version {data.get('version')!r} is not supported; "
                f"this dreampipe reads version {FORMAT_VERSION}: re-run `dreampipe profile`"
            )
        try:
            layers = tuple(Layer(**{**x, "reused": tuple(
                (int(f), int(k), int(b)) for f, k, b in x.get("reused", ()))})
                for x in data["layers"])
            edges = tuple((int(a), int(b)) for a, b in data["edges"])
            return cls(
                layers, edges, int(data.get("batch_size", 0)), str(data.get("model", "")),
                dict(data.get("meta", {})),
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(
                f"malformed dreampipe profile: {exc!r}; re-run `dreampipe profile` to write it"
            ) from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> LayerGraph:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ProfileError("a profile in JSON must be an object")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def _topological_order(n: int, edges: Sequence[tuple[int, int]], names: Sequence[str]) -> list[int]:
    """Kahn's algorithm, stable in the original order; raises on a cycle."""
    import heapq

    indegree = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for s, d in edges:
        succ[s].append(d)
        indegree[d] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for d in succ[i]:
            indegree[d] -= 1
            if indegree[d] == 0:
                heapq.heappush(ready, d)
    if len(order) != n:
        stuck = [names[i] for i in range(n) if indegree[i] > 0]
        raise ProfileError(
            f"the layer graph has a cycle through {stuck[:5]}; edges must form a DAG"
        )
    return order
