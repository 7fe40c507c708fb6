"""Scheduling: a plan's stages as per-rank action lists (a :class:`Schedule`).

``actions`` is the data and what each action means; ``build`` makes the
schedules and lowers them, with the orders of ``zero_bubble`` (zb-h1,
zb-h2) and ``interleave`` (interleaved 1F1B, several stages per worker) and
the update pass of ``updates``; ``stepping`` runs ranks through their lists
by those meanings (the validator's dry run, the simulator's clock);
``validator`` checks one before anything runs it; ``events`` is what a rank
did, predicted or measured; ``torch_csv`` reads and writes PyTorch
pipelining's schedule files.
"""

__all__: list[str] = []
