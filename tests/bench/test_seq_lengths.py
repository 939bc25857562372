"""bench/seq_lengths.py's ladder arithmetic against brute force: the best ladder is the cheapest of every
ladder of its size, padding waste and rollout widths are what padding each length (or rollout) by hand gives."""
import itertools
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from bench import seq_lengths as S  # noqa: E402


def slots(lengths, ladder) -> int:
    """Naive: each length pads to the first width that holds it."""
    return sum(next(w for w in ladder if w >= n) for n in lengths)


@pytest.mark.parametrize("seed, widths, top", [(0, 1, None), (1, 2, None), (2, 3, None), (3, 4, None),
                                               (4, 3, 1280), (5, 5, None)])
def test_best_ladder_is_the_cheapest_of_all_ladders(seed, widths, top):
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, 300, 200), rng.integers(300, 1100, 30)])
    ladder = S.best_ladder(lengths, widths, multiple=64, top=top)
    longest = top or -(-int(lengths.max()) // 64) * 64
    candidates = range(64, longest, 64)
    brute = min((tuple(c) + (longest,) for k in range(widths) for c in itertools.combinations(candidates, k)),
                key=lambda lad: slots(lengths, lad))
    assert ladder[-1] == longest and len(ladder) <= widths and all(w % 64 == 0 for w in ladder)
    assert slots(lengths, ladder) == slots(lengths, brute)


def test_padding_waste_and_widths_hit_by_hand():
    lengths, ladder = np.asarray([10, 64, 65, 200]), (64, 128, 256)
    # slots 64 + 64 + 128 + 256 = 512, tokens 339
    assert S.padding_waste(lengths, ladder) == pytest.approx(1 - 339 / 512)
    assert S.widths_hit(lengths, ladder) == 3 and S.widths_hit(lengths[:2], ladder) == 1
    with pytest.raises(ValueError, match="exceeds"):
        S.bucket_of(np.asarray([300]), ladder)
    with pytest.raises(ValueError, match="multiple"):
        S.best_ladder(lengths, 2, top=100)


def test_rollout_widths_pad_each_rollout_to_its_longest_prompt():
    lengths = np.arange(1, 101)
    widths, waste = S.rollout_widths(lengths, (32, 64, 128), batch=10, seed=3, steps=25)
    assert len(widths) == 25
    order = np.concatenate([np.random.default_rng([3, e]).permutation(100) for e in range(3)])
    rollouts = [lengths[order[i * 10:(i + 1) * 10]] for i in range(25)]
    assert widths.tolist() == [next(w for w in (32, 64, 128) if w >= r.max()) for r in rollouts]
    assert waste == pytest.approx(1 - sum(r.sum() for r in rollouts) / (10 * widths.sum()))
    # Drawn by bucket (the PRM's plan), a rollout mostly holds prompts of one bucket: less padding.
    bucketed, bucketed_waste = S.bucketed_rollout_widths(lengths, (32, 64, 128), batch=10, seed=3, steps=25)
    assert len(bucketed) == 25 and bucketed_waste < waste
