"""Megatron-LM's interleaved 1F1B order on one worker, and what each of its chunks holds.

Worker ``r`` of ``p``, holding ``v`` chunks, runs ``m v`` chunk forwards and as many
backwards a minibatch (Narayanan et al. 2021): forward ``k`` is on chunk ``(k mod pv) //
p``, backward ``k`` on chunk ``v - 1 - (k mod pv) // p``; :func:`warmup` forwards
first, then one forward and one backward at a time, then the backwards left. The
schedule (:mod:`dreampipe.scheduling.interleave`) runs this order; the synchronous
objective reads :func:`chunk_peaks`, the most microbatches each chunk holds at once, for
its memory (a chunk's activations are kept from its forward to its backward).
"""

from __future__ import annotations

import functools

__all__ = ["chunk_of", "chunk_peaks", "warmup"]


def warmup(rank: int, p: int, v: int, m: int) -> int:
    """The chunk forwards worker ``rank`` runs before its first backward."""
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def chunk_of(k: int, p: int, v: int, forward: bool) -> int:
    """The chunk of the worker's ``k``-th forward (or backward)."""
    c = (k % (p * v)) // p
    return c if forward else v - 1 - c


@functools.lru_cache(maxsize=256)
def chunk_peaks(p: int, v: int, m: int) -> tuple[tuple[int, ...], ...]:
    """``[r][c]``: the most microbatches worker ``r``'s chunk ``c`` holds at once (forwards
    run less backwards run), over the worker's order of ``m`` microbatches."""
    import numpy as np  # only when priced: ``import dreampipe`` stays light

    total, out = m * v, []
    chunks = np.arange(v)

    def done(n: np.ndarray, forward: bool) -> np.ndarray:
        """``[i, c]``: of the first ``n[i]`` forwards (backwards), how many ran on ``c``."""
        own = chunks if forward else v - 1 - chunks
        whole, part = np.divmod(n[:, None], p * v)
        return np.asarray(whole * p + np.clip(part - own[None, :] * p, 0, p))

    for r in range(p):
        w = warmup(r, p, v, m)
        step = np.arange(total - w)  # step i runs forward w + i, then backward i
        held = np.vstack([done(np.array([w]), True),  # the warm-up's forwards
                          done(w + step + 1, True) - done(step, False)])
        out.append(tuple(int(x) for x in held.max(axis=0)))
    return tuple(out)
