"""``--seq-lengths``: its parsing and what the throughput line says its prediction is of."""

from __future__ import annotations

import pytest

from dreampipe.commands.seq_lengths import longest_note, parse_lengths
from dreampipe.errors import ConfigError

__all__: list[str] = []


def test_the_prediction_is_said_to_be_of_the_longest_sequences() -> None:
    assert longest_note(None) == ""
    assert longest_note("8:64") == ("; predicted for the longest sequences, 64 tokens, where "
                                    "the steps drew 8 to 64")


@pytest.mark.parametrize("text", ["64:8", "8", "0:4", "a:b", "8:"])
def test_bad_lengths_name_the_form(text: str) -> None:
    with pytest.raises(ConfigError, match=f"--seq-lengths {text}: write MIN:MAX"):
        parse_lengths(text)
    assert parse_lengths("8:64") == (8, 64) and parse_lengths(None) is None
