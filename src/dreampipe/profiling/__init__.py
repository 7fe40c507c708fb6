"""Profiling: a model's per-layer costs as a :class:`LayerGraph`.

``profiler`` times a PyTorch model layer by layer (``model_steps`` splits it
into layers); ``graph_txt`` reads PipeDream's own profiles; ``bundled`` finds
the PipeDream profiles shipped in the package (``pipedream:NAME``); ``load``
reads any of them. The rest of dreampipe sees only the ``LayerGraph``.
"""

__all__: list[str] = []
