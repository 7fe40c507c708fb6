"""Profiling: a model's per-layer costs as a :class:`LayerGraph`.

``profiler`` times a PyTorch model layer by layer (``model_steps`` splits it
into layers); ``graph_txt`` reads PipeDream's own profiles; ``load`` reads
either from a file. The rest of dreampipe sees only the ``LayerGraph``.
"""
