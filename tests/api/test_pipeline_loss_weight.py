"""``ignore_index``: a loss averaged over labelled tokens trains, reports and evaluates
as one process taking it over the whole minibatch, whatever tokens each microbatch
holds. Without it each microbatch's mean counts its samples, which a test shows is
another update (so the comparison can fail)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from dreampipe.api import TrainConfig
from dreampipe.api.checks import check_counted_targets
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
    assert weighted["accuracy"] is None  # [B, T, V]: the loss may shift such labels
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


def test_a_causal_models_own_labels_as_the_target_are_refused_with_the_shift() -> None:
    """A causal language model's loss shifts its labels by one and averages over
    ``labels[:, 1:]``: counting the labels themselves weighs each microbatch by one token a
    sequence too many. The fix the error names passes; a masked model does not shift."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=20, bos_token_id=0, eos_token_id=0))
    labels = torch.randint(0, 20, (4, 6))
    labels[:, -2:] = -100
    x = {"input_ids": labels.clamp(min=0), "labels": labels}
    config = TrainConfig(ignore_index=-100)
    with pytest.raises(ConfigError, match=r"give target=labels\[:, 1:\]"):
        check_counted_targets(gpt2, (x, labels), config)
    check_counted_targets(gpt2, (x, labels[:, 1:]), config)  # the count the loss averages
    check_counted_targets(gpt2, (x, labels), TrainConfig())  # a per-sample mean: no count
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8,
        vocab_size=20))
    check_counted_targets(bert, (x, labels), config)


def test_targets_holding_torchs_ignored_index_without_ignore_index_draw_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    x, y = batch(0, 8)
    model = torch.nn.Linear(2, 2)
    with caplog.at_level("WARNING", logger="dreampipe.api.checks"):
        check_counted_targets(model, (x, y), TrainConfig(ignore_index=-100))
        check_counted_targets(model, (x, y.clamp(min=0)), TrainConfig())
        assert not caplog.records
        check_counted_targets(model, (x, y), TrainConfig())
    assert len(caplog.records) == 1
    assert "give TrainConfig(ignore_index=-100)" in caplog.records[0].getMessage()


def test_a_models_own_labels_holding_ignored_tokens_warn_unless_the_target_counts_them(
        caplog: pytest.LogCaptureFixture) -> None:
    """The model's loss averages over its labelled tokens: a target that is not those
    labels (a dummy, or no ignore_index) weighs the microbatches otherwise."""
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=20))
    labels = torch.randint(0, 20, (4, 6))
    labels[:, -2:] = -100
    x = {"input_ids": labels.clamp(min=0), "labels": labels}
    with caplog.at_level("WARNING", logger="dreampipe.api.checks"):
        check_counted_targets(llama, (x, labels[:, 1:]), TrainConfig(ignore_index=-100))
        assert not caplog.records
        check_counted_targets(llama, (x, x["input_ids"]), TrainConfig(ignore_index=-100))
        check_counted_targets(llama, (x, labels[:, 1:]), TrainConfig())
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and sum("the inputs' labels hold -100" in m for m in said) == 2
