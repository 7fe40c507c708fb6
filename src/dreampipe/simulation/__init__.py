"""Simulation: time a :class:`Schedule` on a cluster and draw what happened.

``simulator`` runs the schedule as discrete events; ``timeline`` draws the
events as a PNG, ``trace`` writes them for Perfetto. The runtime's measured
events are drawn by the same code.
"""
