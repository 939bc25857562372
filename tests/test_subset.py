"""caper_jax.utils.subset.seeded_subset: the one seeded subset of the evaluations, picks and data views."""
import numpy as np

from caper_jax.utils.subset import seeded_subset


def test_the_subset_is_the_first_k_of_a_seeded_permutation_in_the_original_order():
    items = [f"q{i}" for i in range(10)]
    keep = np.random.default_rng(3).permutation(10)[:4]   # the idiom every caller had written out
    assert seeded_subset(items, 4, 3) == [items[i] for i in sorted(keep)]
    assert seeded_subset(items, 0, 3) == seeded_subset(items, 10, 3) == seeded_subset(items, 25, 3) == items


def test_draws_from_one_generator_continue_its_stream_and_all_items_draw_nothing():
    """The Spider verifier's view draws train, then dev, from one generator: its recorded subsets
    depend on that stream, and on an all-items subset drawing nothing from it."""
    train, dev = list(range(8)), list(range(100, 106))
    rng = np.random.default_rng(0)
    first, second = seeded_subset(train, 3, rng), seeded_subset(dev, 2, rng)
    stream = np.random.default_rng(0)
    assert first == [train[i] for i in sorted(stream.permutation(8)[:3])]
    assert second == [dev[i] for i in sorted(stream.permutation(6)[:2])]
    rng = np.random.default_rng(0)
    assert seeded_subset(train, 0, rng) == train and seeded_subset(dev, 2, rng) == seeded_subset(dev, 2, 0)
