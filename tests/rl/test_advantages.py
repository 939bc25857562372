"""clause_advantages against hand-computed values and a naive Python loop."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caper_jax.rl import clause_advantages, normalise_group_rewards
from caper_jax.rl import step as rl_step


def naive_std(pool, ddof):
    mean = sum(pool) / max(len(pool), 1)
    return math.sqrt(sum((x - mean) ** 2 for x in pool) / max(len(pool) - ddof, 1))


def naive_advantages(rewards, clause_mask, token_clause, token_mask, group_size, gamma, eps=1e-6,
                     scale_by_std=True, std_ddof=0, std_scope="group"):
    """Element by element: pooled group statistics, then a discounted sum over later units."""
    batch, units = rewards.shape
    out = np.zeros(token_clause.shape, np.float64)
    everything = [rewards[i, k] for i in range(batch) for k in range(units) if clause_mask[i, k]]
    for g in range(batch // group_size):
        rows = range(g * group_size, (g + 1) * group_size)
        pool = [rewards[i, k] for i in rows for k in range(units) if clause_mask[i, k]]
        mean = sum(pool) / max(len(pool), 1)
        std = naive_std(pool if std_scope == "group" else everything, std_ddof)
        for i in rows:
            norm = [((rewards[i, k] - mean) / (std + eps if scale_by_std else 1.0)) if clause_mask[i, k]
                    else 0.0 for k in range(units)]
            for t in range(token_clause.shape[1]):
                k = token_clause[i, t]
                if token_mask[i, t] and 0 <= k < units:
                    out[i, t] = sum(gamma ** (j - k) * norm[j] for j in range(k, units))
    return out


# One group of two rows; row 1 has two clauses (third is padding), tokens -1 / mask 0 at the edges.
REWARDS = np.array([[1.0, 0.0, 2.0], [0.0, 1.0, 7.0]], np.float32)
CLAUSE_MASK = np.array([[1, 1, 1], [1, 1, 0]], bool)
TOKEN_CLAUSE = np.array([[-1, 0, 0, 1, 2, 2, 2], [0, 0, 1, 1, 1, 0, 0]], np.int32)
TOKEN_MASK = np.array([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]], bool)
# Pool {1, 0, 2, 0, 1}: mean 0.8, population variance 2.8 / 5 = 0.56.
STD = math.sqrt(0.56)


def run(gamma, **kwargs):
    return np.asarray(clause_advantages(jnp.asarray(REWARDS), jnp.asarray(CLAUSE_MASK),
                                        jnp.asarray(TOKEN_CLAUSE), jnp.asarray(TOKEN_MASK),
                                        group_size=2, gamma=gamma, **kwargs))


def test_hand_computed_gamma_one():
    # Normalised: row 0 (.2, -.8, 1.2)/s, row 1 (-.8, .2)/s; return-to-go sums later clauses.
    a0, a1, a2 = 0.6 / STD, 0.4 / STD, 1.2 / STD
    b0, b1 = -0.6 / STD, 0.2 / STD
    expected = np.array([[0, a0, a0, a1, a2, a2, 0], [b0, b0, b1, b1, b1, 0, 0]])
    np.testing.assert_allclose(run(1.0), expected, rtol=1e-5, atol=1e-6)


def test_hand_computed_gamma_half():
    # Row 0: .2 + .5(-.8) + .25(1.2) = .1; -.8 + .5(1.2) = -.2; 1.2.  Row 1: -.8 + .5(.2) = -.7; .2.
    a0, a1, a2 = 0.1 / STD, -0.2 / STD, 1.2 / STD
    b0, b1 = -0.7 / STD, 0.2 / STD
    expected = np.array([[0, a0, a0, a1, a2, a2, 0], [b0, b0, b1, b1, b1, 0, 0]])
    np.testing.assert_allclose(run(0.5), expected, rtol=1e-5, atol=1e-6)


def test_centre_only_drops_the_std_division():
    expected = np.array([[0, 0.6, 0.6, 0.4, 1.2, 1.2, 0], [-0.6, -0.6, 0.2, 0.2, 0.2, 0, 0]])
    np.testing.assert_allclose(run(1.0, scale_by_std=False), expected, rtol=1e-5, atol=1e-6)


def test_sample_std_ddof_one_hand_computed():
    # Same pool {1, 0, 2, 0, 1}: Bessel's variance 2.8 / 4 = 0.7 (TRL's and tunix's convention).
    std = math.sqrt(0.7)
    a0, a1, a2, b0, b1 = 0.6 / std, 0.4 / std, 1.2 / std, -0.6 / std, 0.2 / std
    expected = np.array([[0, a0, a0, a1, a2, a2, 0], [b0, b0, b1, b1, b1, 0, 0]])
    np.testing.assert_allclose(run(1.0, std_ddof=1), expected, rtol=1e-5, atol=1e-6)
    # eps enters as std + eps: 0.5 moves every advantage by the factor std / (std + 0.5).
    np.testing.assert_allclose(run(1.0, std_ddof=1, eps=0.5), expected * std / (std + 0.5), rtol=1e-5, atol=1e-6)


def test_batch_scope_std_hand_computed():
    # Groups {1, 0} and {3, 3}: group means .5 and 3; the std is the batch's around the batch mean 1.75:
    # squares .5625 + 3.0625 + 1.5625 + 1.5625 = 6.75, ddof 1 -> variance 2.25, std 1.5 (TRL's
    # scale_rewards="batch"); the equal-reward group stays at 0.
    rewards = jnp.array([[1.0], [0.0], [3.0], [3.0]])
    out = normalise_group_rewards(rewards, jnp.ones((4, 1), bool), 2, std_ddof=1, std_scope="batch", eps=0.0)
    np.testing.assert_allclose(np.asarray(out)[:, 0], [0.5 / 1.5, -0.5 / 1.5, 0.0, 0.0], rtol=1e-6)
    group = normalise_group_rewards(rewards, jnp.ones((4, 1), bool), 2, std_ddof=1)   # group std sqrt(.5), 0
    np.testing.assert_allclose(np.asarray(group)[:, 0], [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0, 0],
                               rtol=1e-5)


def test_one_valid_unit_gives_zero_under_either_ddof():
    # A group with a single valid reward: ddof 1 would divide 0 by 0; the divisor max(n - ddof, 1) keeps 0.
    rewards = jnp.array([[5.0, 1.0], [2.0, 9.0]])
    mask = jnp.array([[True, False], [False, False]])
    for ddof in (0, 1):
        out = np.asarray(normalise_group_rewards(rewards, mask, 2, std_ddof=ddof))
        assert np.all(out == 0.0), (ddof, out)


def _normalise_before_the_settings(rewards, mask, group_size, eps=1e-6):
    """normalise_group_rewards as it was written before std_ddof/std_scope existed (ddof 0, group std)."""
    batch, units = rewards.shape
    grouped = rewards.astype(jnp.float32).reshape(batch // group_size, group_size * units)
    grouped_valid = mask.astype(bool).reshape(grouped.shape)
    count = jnp.maximum(grouped_valid.sum(axis=1, keepdims=True), 1)
    mean = jnp.where(grouped_valid, grouped, 0.0).sum(axis=1, keepdims=True) / count
    centred = jnp.where(grouped_valid, grouped - mean, 0.0)
    std = jnp.sqrt((centred**2).sum(axis=1, keepdims=True) / count)
    return (centred / (std + eps)).reshape(batch, units)


def test_default_is_the_previous_normalisation_bit_for_bit():
    rng = np.random.default_rng(11)
    rewards = jnp.asarray(rng.normal(size=(16, 5)), jnp.float32)
    mask = jnp.asarray(np.arange(5)[None] < rng.integers(0, 6, 16)[:, None])
    before = jax.jit(_normalise_before_the_settings, static_argnums=2)(rewards, mask, 4)
    now = jax.jit(normalise_group_rewards, static_argnums=2)(rewards, mask, 4)
    assert np.array_equal(np.asarray(now), np.asarray(before))
    assert not np.allclose(np.asarray(jax.jit(normalise_group_rewards, static_argnums=2,
                                              static_argnames="std_ddof")(rewards, mask, 4, std_ddof=1)),
                           np.asarray(before))


@pytest.mark.parametrize("std_ddof,std_scope", [(1, "group"), (0, "batch"), (1, "batch")])
def test_std_conventions_match_naive_loop(std_ddof, std_scope):
    rng = np.random.default_rng(5 + std_ddof)
    batch, units, length, group = 12, 6, 20, 4
    clause_mask = np.arange(units)[None] < rng.integers(0, units + 1, batch)[:, None]
    clause_mask[:group, 1:] = False      # group 0: at most one unit per row
    clause_mask[0, 0] = True
    rewards = rng.normal(size=(batch, units)).astype(np.float32)
    token_clause = rng.integers(-1, units + 2, (batch, length)).astype(np.int32)
    token_mask = rng.random((batch, length)) < 0.8
    out = clause_advantages(jnp.asarray(rewards), jnp.asarray(clause_mask), jnp.asarray(token_clause),
                            jnp.asarray(token_mask), group_size=group, gamma=0.9, eps=1e-3, std_ddof=std_ddof,
                            std_scope=std_scope)
    expected = naive_advantages(rewards, clause_mask, token_clause, token_mask, group, 0.9, eps=1e-3,
                                std_ddof=std_ddof, std_scope=std_scope)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


def test_trainer_step_passes_the_std_conventions():
    # rl/step.py's advantages_from_rewards (the trainer's call) with the sparse layout: TRL's conventions
    # (ddof 1, eps 1e-4) on a group {1, 0, 0, 0}: mean .25, sample std sqrt(.25) = .5.
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0])
    adv, _ = rl_step.advantages_from_rewards(
        jnp.zeros((4, 3)), jnp.full((4, 2), -1, jnp.int32), rewards, jnp.ones((4, 3), bool), jnp.ones(4, bool),
        variant="sparse", group_size=4, gamma=1.0, prm_weight=1.0, exec_failure_reward=0.0, format_penalty=0.0,
        scale_by_std=True, std_ddof=1, std_eps=1e-4, std_scope="group")
    expected = (np.array([1.0, 0.0, 0.0, 0.0]) - 0.25) / (0.5 + 1e-4)
    np.testing.assert_allclose(np.asarray(adv), np.repeat(expected[:, None], 3, 1), rtol=1e-6)


def test_padding_reward_values_are_ignored():
    # The padded clause of row 1 holds 7.0; it must not enter the statistics or any return.
    swapped = REWARDS.copy()
    swapped[1, 2] = -1e6
    out = clause_advantages(jnp.asarray(swapped), jnp.asarray(CLAUSE_MASK), jnp.asarray(TOKEN_CLAUSE),
                            jnp.asarray(TOKEN_MASK), group_size=2)
    np.testing.assert_allclose(np.asarray(out), run(1.0), rtol=1e-6)


def test_equal_rewards_give_zero_not_nan():
    rewards = jnp.full((4, 3), 0.5)
    out = clause_advantages(rewards, jnp.ones((4, 3), bool), jnp.zeros((4, 5), jnp.int32),
                            jnp.ones((4, 5), bool), group_size=2)
    assert np.all(np.asarray(out) == 0.0)


def test_one_unit_per_row_is_outcome_grpo():
    # The sparse layout: every token of a row gets (r - mean_group) / (std_group + eps).
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], np.float32)
    out = clause_advantages(jnp.asarray(rewards[:, None]), jnp.ones((6, 1), bool),
                            jnp.zeros((6, 4), jnp.int32), jnp.ones((6, 4), bool), group_size=3)
    groups = rewards.reshape(2, 3)
    expected = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(out), np.repeat(expected.reshape(6, 1), 4, 1), rtol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.3])
def test_matches_naive_loop_on_random_ragged_batches(gamma):
    rng = np.random.default_rng(int(gamma * 10))
    batch, units, length, group = 12, 6, 20, 4
    counts = rng.integers(0, units + 1, batch)  # includes rows without any unit
    clause_mask = np.arange(units)[None] < counts[:, None]
    rewards = rng.normal(size=(batch, units)).astype(np.float32)
    token_clause = rng.integers(-1, units + 2, (batch, length)).astype(np.int32)  # -1 and out of range
    token_mask = rng.random((batch, length)) < 0.8
    out = clause_advantages(jnp.asarray(rewards), jnp.asarray(clause_mask), jnp.asarray(token_clause),
                            jnp.asarray(token_mask), group_size=group, gamma=gamma)
    expected = naive_advantages(rewards, clause_mask, token_clause, token_mask, group, gamma)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


def test_groups_are_independent():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(4, 3)).astype(np.float32)
    args = (jnp.ones((4, 3), bool), jnp.asarray(rng.integers(0, 3, (4, 5)), jnp.int32), jnp.ones((4, 5)))
    base = clause_advantages(jnp.asarray(rewards), *args, group_size=2)
    shifted = rewards.copy()
    shifted[2:] = shifted[2:] * 10 + 3  # an affine change of group 1 leaves every advantage as it was
    shifted[:2, 0] += 1.0               # while a change in group 0 moves group 0 only
    moved = clause_advantages(jnp.asarray(shifted), *args, group_size=2)
    np.testing.assert_allclose(np.asarray(moved)[2:], np.asarray(base)[2:], rtol=1e-4, atol=1e-5)
    assert not np.allclose(np.asarray(moved)[:2], np.asarray(base)[:2])


@pytest.mark.parametrize("gamma", [0.5, 0.9])
def test_gamma_is_traceable(gamma):
    """A traced gamma (one jitted program for every discount, or a learnt discount) gives the naive loop's
    advantages and their exact derivative in gamma: a central finite difference of the float64 loop."""
    rng = np.random.default_rng(3)
    cases = [(REWARDS, CLAUSE_MASK, TOKEN_CLAUSE, TOKEN_MASK, 2)]
    clause_mask = np.arange(6)[None] < rng.integers(0, 7, 8)[:, None]         # ragged rows
    cases.append((rng.normal(size=(8, 6)).astype(np.float32), clause_mask,
                  rng.integers(-1, 7, (8, 15)).astype(np.int32), rng.random((8, 15)) < 0.8, 4))
    for rewards, mask, token_clause, token_mask, group in cases:
        def advantages(g):
            return clause_advantages(jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(token_clause),
                                     jnp.asarray(token_mask), group_size=group, gamma=g)

        def naive(g):
            return naive_advantages(rewards.astype(np.float64), mask, token_clause, token_mask, group, g)

        np.testing.assert_allclose(np.asarray(jax.jit(advantages)(gamma)), naive(gamma), rtol=2e-5, atol=2e-5)
        derivative = np.asarray(jax.jacfwd(advantages)(gamma))
        h = 1e-5
        expected = (naive(gamma + h) - naive(gamma - h)) / (2 * h)
        assert np.abs(expected).max() > 0.5          # the discount moves these advantages
        np.testing.assert_allclose(derivative, expected, rtol=1e-4, atol=1e-4)


def test_bad_input_raises():
    ok = dict(clause_rewards=jnp.zeros((4, 3)), clause_mask=jnp.ones((4, 3)),
              token_clause=jnp.zeros((4, 5), jnp.int32), token_mask=jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="multiple of group_size"):
        clause_advantages(**ok, group_size=3)
    with pytest.raises(TypeError, match="integer"):
        clause_advantages(**{**ok, "token_clause": jnp.zeros((4, 5))}, group_size=2)
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        clause_advantages(**{**ok, "clause_mask": jnp.ones((4, 2))}, group_size=2)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        clause_advantages(**{**ok, "token_mask": jnp.ones((4, 6))}, group_size=2)
    with pytest.raises(ValueError, match="std_ddof=2"):
        clause_advantages(**ok, group_size=2, std_ddof=2)
    with pytest.raises(ValueError, match="unknown std_scope"):
        clause_advantages(**ok, group_size=2, std_scope="row")
