"""Simulation: time a :class:`Schedule` on a cluster and draw what happened.

``action_costs`` says what each stage's work and transfers cost (from a
profile or a plan); ``simulator`` runs the schedule as discrete events;
``timeline`` draws the events as a PNG, ``chrome_trace`` writes them for
Perfetto. The runtime's measured events are drawn by the same code.
"""

__all__: list[str] = []
