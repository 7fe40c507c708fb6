"""This machine as the planner sees it: calibration, co-run profiles, local plan choice.

``machine_file`` is what ``dreampipe calibrate`` measured on a machine (JSON,
per level), ``measure`` measures it (``pingpong``, ``rates`` and ``corun``
with ``timers``: the wall clock, or CUDA events on GPUs), and
``calibration`` turns its figures into the simulator's costs and the
planner's topology; ``corun``, ``rates`` and ``overhead`` also measure what
a profile taken beside busy workers needs; ``local_plan`` profiles, plans
and predicts for the workers at hand, which ``Pipeline(plan="auto")`` and
the commands share.
"""

__all__: list[str] = []
