"""The range mask is made once per size and shared, so no table may write through it."""

from __future__ import annotations

import numpy as np
import pytest

from dreampipe.planning.triangle import upper


@pytest.mark.parametrize(("n", "k"), [(1, 0), (5, 0), (5, 1), (7, 3)])
def test_upper_marks_the_ranges_at_least_k_layers_apart(n: int, k: int) -> None:
    mask = upper(n, k)
    want = np.array([[j - i >= k for j in range(n)] for i in range(n)])
    assert mask.dtype == bool
    assert np.array_equal(mask, want)


def test_the_shared_mask_is_read_only() -> None:
    assert upper(6) is upper(6)
    with pytest.raises(ValueError, match="read-only"):
        upper(6)[0, 0] = False
