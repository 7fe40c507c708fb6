"""This machine as the planner sees it: its calibration and the machine file.

``machine_file`` is what ``dreampipe calibrate`` measured on a machine (JSON,
per level), ``measure`` measures it (``pingpong``, ``rates`` and ``corun``
with ``timers``: the wall clock, or CUDA events on GPUs), and
``calibration`` turns its figures into the simulator's costs and the
planner's topology; ``link`` prices a run on a shaped link.
"""

__all__: list[str] = []
