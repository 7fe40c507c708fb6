"""The commands: whole jobs on this machine, as the CLI runs them, each a user of :class:`Pipeline`.

``train`` profiles, plans, predicts and runs a zoo model (``train_plan`` makes
its plan); ``demo`` does it on real data beside data parallelism; ``bench``
compares dreampipe's schedules with PyTorch's own (``baselines``). This
package stays torch-free at import, so the CLI's parser starts fast.
"""

__all__: list[str] = []
