"""The seeded subset every held-out evaluation, reranker pick and data view draws its examples with."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def seeded_subset(items: Sequence[T], k: int, rng: int | np.random.Generator) -> list[T]:
    """``k`` of ``items`` at the first ``k`` places of a seeded permutation, kept in their original order.

    ``k <= 0`` or ``k >= len(items)``: every item, and nothing is drawn. ``rng`` is a seed or a
    ``Generator``; a caller that draws several subsets from one generator (the Spider verifier's view:
    train, then dev) passes the generator, so each draw continues the stream.
    """
    if k <= 0 or k >= len(items):
        return list(items)
    keep = np.random.default_rng(rng).permutation(len(items))[:k]
    return [items[i] for i in sorted(keep)]
