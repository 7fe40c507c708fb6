"""The runtime: one rank's share of a :class:`~dreampipe.scheduling.actions.Schedule`, for real.

:class:`~dreampipe.runtime.engine.RankRunner` runs a rank's actions on its
:class:`~dreampipe.runtime.stage_module.StageModule` over torch.distributed
(:mod:`.comm`); :class:`dreampipe.Pipeline` (``api/``) is the one driver that
builds and feeds it.
"""

__all__: list[str] = []
