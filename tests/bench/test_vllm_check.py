"""bench/vllm_check.py's comparisons (the parts that run without vLLM): greedy agreement counts tokens only up
to the first divergence, and log-prob deltas of own greedy tokens only over the shared prefix, where both
implementations read the same context (past it they score different tokens)."""
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from bench import vllm_check as V  # noqa: E402


def test_generation_is_cut_after_its_first_stop_token():
    assert V.until_stop([5, 3, 7, 3], {3, 1}) == [5, 3]
    assert V.until_stop(np.array([5, 6, 7]), {3}) == [5, 6, 7]


def test_agreement_counts_tokens_before_the_first_divergence():
    reference = [[1, 2, 3, 4], [4, 5], [7]]
    other = [[1, 2, 9, 4], [4, 5], [8, 7]]      # the 4 after a divergence does not count
    assert V.agreement(reference, other) == {"sequences_equal": 1, "sequences": 3,
                                             "tokens_before_divergence": 4, "tokens": 7}


def test_logprob_deltas_stop_at_the_shared_prefix():
    a = [np.array([-0.5, -1.0, -9.0]), np.array([-0.1])]
    b = [np.array([-0.25, -1.0, -0.1]), np.array([-0.2, -3.0])]
    prefix = [V.common_prefix([1, 2, 3], [1, 2, 4]), 1]
    d = V.logprob_deltas(a, b, prefix)
    assert d["n"] == 3 and np.isclose(d["max"], 0.25) and np.isclose(d["mean"], (0.25 + 0.0 + 0.1) / 3)
    assert V.logprob_deltas(a[:1], b[:1])["max"] > 8     # without lengths: every position of the shorter one
