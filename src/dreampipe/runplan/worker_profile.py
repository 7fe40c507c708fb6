"""The layer profile a run plans with, as each of its workers computes.

A worker computes on one thread, through the runtime's stage, beside the
other local workers; :func:`profile_as_worker` profiles so (with the
runtime's overhead, :mod:`~dreampipe.runplan.runtime_overhead`, and beside
busy twins, :mod:`~dreampipe.runplan.profile_beside`), and
:func:`saved_profile` reads a profile saved by ``dreampipe profile`` after
checking it is of this model, at this microbatch, on one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dreampipe.errors import ProfileError
from dreampipe.models.spec import ModelSpec
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes
from dreampipe.runtime.precision import Precision
from dreampipe.runtime.processes import pinned_threads

__all__ = ["profile_as_worker", "saved_profile"]


def profile_as_worker(
    spec: ModelSpec, batch_size: int, *, repeats: int = 5, min_time_s: float = 0.0,
    twins: int = 0, crowd: int = 0, ref: str = "",
    model_kwargs: Sequence[tuple[str, Any]] = (), precision: Precision = Precision.FP32,
) -> LayerGraph:
    """Profile ``spec`` at ``batch_size`` on one thread, as each worker runs, in the number
    formats of ``precision``, with the runtime's overhead over the layers
    (:mod:`~dreampipe.runplan.runtime_overhead`).

    With ``twins`` > 0 the profile is taken beside that many busy processes
    training the same model (``ref`` and ``model_kwargs`` name it for them),
    as local workers compute side by side in a run, and ``crowd`` more
    measure how the cores are shared (:func:`dreampipe.runplan.profile_beside.profile_beside`).
    """
    if twins > 0 or crowd > 0:
        from dreampipe.runplan.profile_beside import profile_beside

        return profile_beside(ref, batch_size, twins, crowd=crowd, model_kwargs=model_kwargs,
                              repeats=repeats, min_time_s=min_time_s, precision=precision)
    from dreampipe.profiling.profiler import profile_spec
    from dreampipe.runplan.runtime_overhead import with_runtime_overhead

    with pinned_threads(1):
        graph = profile_spec(spec, batch_size=batch_size, repeats=repeats, min_time_s=min_time_s,
                             autocast=precision.autocast,
                             param_dtype=precision.param_dtype)
        return with_runtime_overhead(graph, spec)


def saved_profile(path: str | Path, spec: ModelSpec, microbatch_size: int, *, ref: str = "",
                  model_kwargs: Sequence[tuple[str, Any]] = ()) -> LayerGraph:
    """The layer profile in ``path`` (``dreampipe profile -o``), checked to be ``spec``'s as
    one worker runs it: its layers and their weights, one thread, batch ``microbatch_size``.

    A job given one plans and predicts with it instead of profiling first. The
    runtime's overhead over the layers is measured now if the profile lacks it
    (:mod:`~dreampipe.runplan.runtime_overhead`). Model arguments that change no weight
    (an image size, a sequence length) are checked only where the profile
    recorded them (``meta["model_kwargs"]``, as ``dreampipe profile`` does).
    """
    from dreampipe.profiling.gpt_spec import is_gpt_spec
    from dreampipe.profiling.layer_memory import new_parameter_bytes
    from dreampipe.profiling.load import load_graph
    from dreampipe.runplan.runtime_overhead import with_runtime_overhead

    args = "".join(f" --model-arg {k}={v}" for k, v in model_kwargs)
    fix = (f"profile it as a worker runs it: OMP_NUM_THREADS=1 dreampipe profile "
           f"{ref or spec.name}{args} --batch-size {microbatch_size} -o {path}")
    if is_gpt_spec(path):
        raise ProfileError(f"profile {str(path)!r} is a profile by shape, for planning studies "
                           f"('dreampipe plan'); a run times the model it trains: {fix}")
    graph = load_graph(path)
    where = f"profile {str(path)!r}"
    if graph.batch_size != microbatch_size:
        measured = (f"is of {graph.batch_size} samples" if graph.batch_size else
                    "does not say its batch size (a PipeDream graph.txt never does)")
        raise ProfileError(f"{where} {measured}, and each microbatch this run computes is "
                           f"{microbatch_size}; {fix}")
    names = [layer.name for layer in graph.layers]
    if names != spec.layer_names or (graph.model and graph.model != spec.name):
        raise ProfileError(
            f"{where} is of {graph.model or 'a model'} with {len(names)} layers "
            f"({_some(names)}), not {spec.name} with {spec.num_layers} "
            f"({_some(spec.layer_names)}); {fix}")
    recorded = graph.meta.get("model_kwargs")
    if recorded is not None and dict(recorded) != dict(model_kwargs):
        raise ProfileError(f"{where} is of {spec.name} sized {dict(recorded)}, and this run "
                           f"sizes it {dict(model_kwargs)}; {fix}")
    counted: dict[int, tuple[int, int]] = {}
    for index, (layer, module) in enumerate(zip(graph.layers, spec.build(), strict=True)):
        size, _ = new_parameter_bytes(module.parameters(), counted, index)  # as profiled
        if size != layer.parameter_bytes:
            raise ProfileError(
                f"{where}: layer {layer.name} holds {format_bytes(layer.parameter_bytes)} of "
                f"weights there and {format_bytes(size)} in {spec.name} here, so it was "
                f"profiled at another size; {fix}")
    threads = graph.meta.get("threads", 1)
    if graph.meta.get("device", "cpu") == "cpu" and threads != 1:
        raise ProfileError(f"{where} was taken on {threads} threads, and a local worker "
                           f"computes on one; {fix}")
    if "runtime_forward" in graph.meta:
        return graph
    with pinned_threads(1):
        return with_runtime_overhead(graph, spec)


def _some(names: Sequence[str]) -> str:
    """The first three ``names``, and ``..`` if there are more."""
    return ", ".join(names[:3]) + (", .." if len(names) > 3 else "")
