"""Every script in ``examples/`` runs under ``torchrun --nproc-per-node 2``, with few steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun import torchrun_json

__all__: list[str] = []

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_char_transformer_reports_held_out_loss_of_pipedream_and_dp() -> None:
    out = torchrun_json(EXAMPLES / "char_transformer.py", "--steps", "3", timeout_s=140.0)
    assert out["workers"] == 2 and out["chars"] > 100_000
    for name in ("pipedream", "dp"):
        assert 0 < out[name]["held_out_loss"] < 10, out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_digits_cnn_trains_from_a_dataloader() -> None:
    out = torchrun_json(EXAMPLES / "digits_cnn.py", "--steps", "3")
    assert out["updates"] == 3 and 0 <= out["test_accuracy"] <= 1


@pytest.mark.timeout(120)
def test_checkpoint_roundtrip_predicts_the_same_in_a_plain_module(tmp_path: Path) -> None:
    out = torchrun_json(EXAMPLES / "checkpoint_roundtrip.py", "--steps", "3", "--dir",
                        str(tmp_path))
    assert out["checkpoint"] == str(tmp_path / "step-3")
    assert out["plain_module_accuracy"] == out["pipeline_accuracy"]


@pytest.mark.timeout(120)
def test_hf_gpt2_trains_a_transformers_model_as_it_is_with_its_tied_embeddings() -> None:
    out = torchrun_json(EXAMPLES / "hf_gpt2.py", "--steps", "20")
    assert out["steps"] == 20 and out["tied_equal"]
    assert out["last_loss"] < out["first_loss"]
