"""Jobs: the whole flow on this machine, as the CLI's commands run it.

``train`` profiles, plans, predicts and runs a model; ``demo`` does it on
real data beside data parallelism; ``bench`` compares dreampipe's schedules
with PyTorch's own (``baselines``). ``local`` plans and predicts for the
workers at hand, on the topology and calibration of ``machine``.
"""
