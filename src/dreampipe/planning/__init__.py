"""Planning: from a :class:`LayerGraph` and a :class:`Topology` to a :class:`Plan`.

``costs`` holds the cost model's terms, ``dp`` PipeDream's dynamic program
over them, ``planner`` the entry points (``plan_pipeline``, ``evaluate_plan``)
and the baselines, ``plan`` the result as plain data.
"""

__all__: list[str] = []
