"""The run's plan: profile as a worker computes, plan, choose the schedule, predict.

``worker_profile`` profiles the model as each worker computes (with
``runtime_overhead`` and ``profile_beside``), ``plan_choice`` chooses the
plan and, under ``schedule="auto"``, the schedule (``schedule_choice``),
and ``prediction`` says what the run should reach on this machine.
``Pipeline(plan="auto")``, ``dreampipe train``, ``demo`` and ``bench`` all
go through here.
"""

__all__: list[str] = []
