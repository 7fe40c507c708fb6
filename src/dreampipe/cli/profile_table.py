"""Plain-text tables of a :class:`LayerGraph`, shared by ``dreampipe profile`` and ``show``.

::

    model cnn · batch 64 · 5 layers · chain, 4 edges
      #  name   forward ms  backward ms  activation   params  description
      0  conv1       0.412        0.871    262.1 KB   1.7 KB  Sequential()
      …
         total       1.234        2.345    …          1.5 MB
"""

from __future__ import annotations

from dreampipe.profiling.fixed_costs import small_batch_of
from dreampipe.profiling.graph import LayerGraph
from dreampipe.quantities import format_bytes

__all__ = ["format_bundled_list", "format_profile_summary", "format_profile_table"]

_DESCRIPTION_WIDTH = 48


def format_profile_summary(graph: LayerGraph) -> str:
    """One line: model, batch size (and the small one it was timed at too), layer count,
    chain or DAG and the edge count."""
    batch = str(graph.batch_size) if graph.batch_size else "unknown"
    small = small_batch_of(graph)
    if small is not None:
        batch += f" (also timed at {small['batch_size']})"
    shape = "chain" if graph.is_chain else "DAG"
    return (
        f"model {graph.model or '(unnamed)'} · batch {batch} · {len(graph)} layers · "
        f"{shape}, {len(graph.edges)} edges"
    )


def format_profile_table(graph: LayerGraph) -> str:
    """Per-layer table (index, name, forward/backward ms, activation, params) with totals."""
    header = ("#", "name", "forward ms", "backward ms", "activation", "params", "description")
    rows = [
        (
            str(i),
            layer.name,
            f"{layer.forward_ms:.3f}",
            f"{layer.backward_ms:.3f}",
            format_bytes(layer.activation_bytes),
            format_bytes(layer.parameter_bytes),
            _shorten(layer.description),
        )
        for i, layer in enumerate(graph.layers)
    ]
    total = (
        "",
        "total",
        f"{sum(x.forward_ms for x in graph.layers):.3f}",
        f"{sum(x.backward_ms for x in graph.layers):.3f}",
        format_bytes(sum(x.activation_bytes for x in graph.layers)),
        format_bytes(graph.total_parameter_bytes()),
        "",
    )
    table = [header, *rows, total]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    left = {1, 6}
    lines = [
        "  ".join(
            cell.ljust(widths[c]) if c in left else cell.rjust(widths[c])
            for c, cell in enumerate(row)
        ).rstrip()
        for row in table
    ]
    return "\n".join(lines)


def format_bundled_list(profiles: list[tuple[str, LayerGraph]]) -> str:
    """One row per named profile: its name, model, layer count and chain or DAG."""
    header = ("name", "model", "layers", "shape")
    rows = [
        (spec, graph.model, str(len(graph)), "chain" if graph.is_chain else "DAG")
        for spec, graph in profiles
    ]
    table = [header, *rows]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.rjust(widths[c]) if c == 2 else cell.ljust(widths[c]) for c, cell in enumerate(row)
        ).rstrip()
        for row in table
    )


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= _DESCRIPTION_WIDTH:
        return text
    return text[: _DESCRIPTION_WIDTH - 1] + "…"
