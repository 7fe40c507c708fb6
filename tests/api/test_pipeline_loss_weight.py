"""``ignore_index``: a loss averaged over labelled tokens trains, reports and evaluates
as one process taking it over the whole minibatch, whatever tokens each microbatch
holds. Without it each microbatch's mean counts its samples, which a test shows is
another update (so the comparison can fail)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dreampipe.api import TrainConfig
from dreampipe.api.feed import Feed, ignoring
from dreampipe.errors import ConfigError
from dreampipe.runtime.processes import run_processes

from .compare import assert_matches, distance
from .loss_workers import batch, reference, train_tokens

__all__: list[str] = []

_JOB = {"seed": 3, "steps": 3, "minibatch": 8, "microbatches": 4, "held_out": 2}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("schedule", "replicas"), [("1f1b-flush", [1, 1]),
                                                   ("zb-h1", [2, 1])])
def test_a_token_mean_loss_trains_as_one_process_over_the_minibatch(
        schedule: str, replicas: list[int]) -> None:
    jobs = [{**_JOB, "schedule": schedule, "replicas": replicas, "weighted": w}
            for w in (True, False)]
    ranks = sum(replicas)
    weighted, plain = (run_processes(train_tokens, ranks, job, deadline_s=120.0)[0]
                       for job in jobs)
    want = reference(jobs[0])
    assert weighted is not None and plain is not None
    assert_matches(weighted, want["losses"], want["state"])
    assert weighted["held_out"] == pytest.approx(want["held_out"], rel=1e-5)
    # per sample, the microbatches' token means are another update, well past rounding
    assert max(distance(plain["state"], want["state"]).values()) > 1e-3
    assert plain["held_out"] != pytest.approx(want["held_out"], rel=1e-5)


def _feed(**kw: Any) -> Feed:
    return Feed(microbatches_per_update=4, device=torch.device("cpu"),
                wants_inputs=lambda u: False, wants_targets=lambda u: False, **kw)


def test_each_microbatch_counts_its_share_of_the_items() -> None:
    x, y = batch(0, 8)
    feed = _feed(loss_weight=ignoring(-100))
    feed.add(0, (x, y))
    counts = [float((y[2 * j:2 * j + 2] != -100).sum()) for j in range(4)]
    shares = [feed.share(u) for u in range(4)]
    assert shares == pytest.approx([4 * c / sum(counts) for c in counts])
    assert sum(shares) == pytest.approx(4.0)
    plain = _feed()
    plain.add(0, (x, y))
    assert [plain.share(u) for u in range(4)] == [1.0] * 4


def test_a_microbatch_with_every_target_ignored_or_a_bad_index_is_named() -> None:
    x, y = batch(0, 8)
    y[2:4] = -100
    with pytest.raises(ConfigError, match="microbatch 1 of the segment's minibatch 0 has no "
                                          "target to count"):
        _feed(loss_weight=ignoring(-100)).add(0, (x, y))
    _feed().add(0, (x, y))  # counted by samples, it is a microbatch like any other
    with pytest.raises(ConfigError, match="ignore_index='-100'"):
        TrainConfig(ignore_index="-100")  # type: ignore[arg-type]
