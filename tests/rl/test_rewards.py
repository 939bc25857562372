"""Reward layouts of the three variants (hand-computed and a naive loop)."""
import jax.numpy as jnp
import numpy as np
import pytest

from caper_jax.rl import clause_advantages, layout_rewards, rewards

# Two rows of T = 10: a 2-token prompt, then the completion; row 0 is padded after position 7.
PRM = np.tile(np.arange(10, dtype=np.float32) / 10, (2, 1))
TOKEN_MASK = np.array([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]], bool)
CLAUSE_ENDS = np.array([[3, 5, 6], [4, 8, -1]], np.int32)
EXEC = np.array([1.0, 0.0], np.float32)
PARSED = np.array([True, True])


def layout(variant, prm=PRM, ends=CLAUSE_ENDS, exec_rewards=EXEC, mask=TOKEN_MASK, parsed=PARSED, **kw):
    out = layout_rewards(variant, jnp.asarray(prm), jnp.asarray(ends), jnp.asarray(exec_rewards),
                         jnp.asarray(mask), jnp.asarray(parsed), **kw)
    return tuple(np.asarray(x) for x in out)


def test_clause_layout_hand_computed():
    rewards, mask, token_clause = layout("clause")
    # PRM at each clause end; row 0's exec reward 1 lands on its last clause (end 6).
    np.testing.assert_allclose(rewards, [[0.3, 0.5, 1.6], [0.4, 0.8, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 1, 0]])
    # Token 7 of row 0 (after the last clause end, e.g. ';') joins the last clause; row 1's tokens
    # after its last end (9) join clause 1.
    np.testing.assert_array_equal(token_clause, [[-1, -1, 0, 0, 1, 1, 2, 2, -1, -1],
                                                 [-1, -1, 0, 0, 0, 1, 1, 1, 1, 1]])


def test_sparse_layout_is_one_execution_unit():
    rewards, mask, token_clause = layout("sparse", prm_weight=5.0)
    np.testing.assert_array_equal(rewards, [[1.0], [0.0]])
    np.testing.assert_array_equal(mask, [[1], [1]])
    np.testing.assert_array_equal(token_clause, np.where(TOKEN_MASK, 0, -1))


def test_token_layout_scores_every_token():
    rewards, mask, token_clause = layout("token", prm_weight=2.0)
    expected = np.zeros((2, 10), np.float32)
    expected[0, :6] = 2 * PRM[0, 2:8]
    expected[0, 5] += 1.0  # execution reward on the last completion token
    expected[1, :8] = 2 * PRM[1, 2:10]
    np.testing.assert_allclose(rewards, expected, rtol=1e-6)
    np.testing.assert_array_equal(mask, np.arange(10) < np.array([[6], [8]]))
    np.testing.assert_array_equal(token_clause, np.where(TOKEN_MASK, np.arange(10) - 2, -1))


@pytest.mark.parametrize("variant", ["sparse", "clause", "token"])
def test_unparsed_completion_gets_failure_reward_and_no_prm(variant):
    rewards, mask, token_clause = layout(variant, parsed=np.array([False, True]), exec_failure_reward=-1.0,
                                         format_penalty=0.5)
    assert rewards[0, 0] == pytest.approx(-1.5)  # exec 1.0 is replaced: the SQL did not parse
    assert mask[0].sum() == 1 and np.all(rewards[0, 1:] == 0)
    np.testing.assert_array_equal(token_clause[0], np.where(TOKEN_MASK[0], 0, -1))
    # Row 1 is untouched by row 0's fallback.
    np.testing.assert_array_equal(layout(variant)[0][1], rewards[1])


def test_clause_ends_are_sorted_deduplicated_and_kept_inside_the_completion():
    # Unsorted, a duplicate (two clauses ending inside one token), an end on the prompt (1) and one
    # on padding (9): what remains is the sorted unique ends 3, 5, 6.
    ends = np.array([[6, 3, 5, 5, 1, 9], [-1, -1, -1, -1, -1, -1]], np.int32)
    rewards, mask, token_clause = layout("clause", ends=ends, exec_rewards=np.array([1.0, 1.0]))
    np.testing.assert_allclose(rewards[0], [0.3, 0.5, 1.6, 0, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(token_clause[0], [-1, -1, 0, 0, 1, 1, 2, 2, -1, -1])
    # Row 1 parsed but no clause end survived: one unit at its last token keeps its execution reward
    # and gets no PRM reward.
    np.testing.assert_array_equal(rewards[1], [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(mask[1], [1, 0, 0, 0, 0, 0])


def test_empty_completion_has_no_units():
    mask = TOKEN_MASK.copy()
    mask[1] = False
    for variant in ("sparse", "clause", "token"):
        rewards, unit_mask, token_clause = layout(variant, mask=mask)
        assert not unit_mask[1].any() and np.all(rewards[1] == 0) and np.all(token_clause[1] == -1)


def naive_layout(variant, prm, ends, exec_rewards, mask, parsed, prm_weight, failure, penalty):
    """Python lists: unit ends per row, then rewards and owners token by token."""
    batch, length = mask.shape
    width = {"sparse": 1, "clause": ends.shape[1], "token": length}[variant]
    rewards = np.zeros((batch, width))
    unit_mask = np.zeros((batch, width), bool)
    owners = np.full((batch, length), -1)
    for i in range(batch):
        completion = [t for t in range(length) if mask[i, t]]
        if not completion:
            continue
        if variant == "sparse":
            row_ends = [completion[-1]]
        elif variant == "clause":
            row_ends = sorted({e for e in ends[i] if 0 <= e < length and mask[i, e]})
        else:
            row_ends = completion
        structured = bool(parsed[i]) and bool(row_ends)
        if not structured:
            row_ends = [completion[-1]]
        outcome = exec_rewards[i] if parsed[i] else failure - penalty
        for k, end in enumerate(row_ends):
            score = prm_weight * prm[i, end] if structured and variant != "sparse" else 0.0
            rewards[i, k] = score + (outcome if k == len(row_ends) - 1 else 0.0)
            unit_mask[i, k] = True
        for t in completion:
            owners[i, t] = next((k for k, end in enumerate(row_ends) if end >= t), len(row_ends) - 1)
    return rewards, unit_mask, owners


@pytest.mark.parametrize("variant", ["sparse", "clause", "token"])
def test_matches_naive_loop_on_random_batches(variant):
    rng = np.random.default_rng(len(variant))
    batch, length, max_clauses = 16, 24, 7
    starts = rng.integers(0, 6, batch)
    stops = np.minimum(starts + rng.integers(0, length, batch), length)
    mask = (np.arange(length) >= starts[:, None]) & (np.arange(length) < stops[:, None])
    ends = rng.integers(-1, length, (batch, max_clauses)).astype(np.int32)
    prm = rng.normal(size=(batch, length)).astype(np.float32)
    exec_rewards = rng.integers(0, 2, batch).astype(np.float32)
    parsed = rng.random(batch) < 0.75
    kwargs = dict(prm_weight=0.7, exec_failure_reward=-0.5, format_penalty=0.25)
    got = layout(variant, prm, ends, exec_rewards, mask, parsed, **kwargs)
    expected = naive_layout(variant, prm, ends, exec_rewards, mask, parsed, 0.7, -0.5, 0.25)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(got[2], expected[2])


def test_layout_feeds_clause_advantages():
    # Group of the two rows, clause layout, γ = 1: a token's advantage is the sum of the normalised
    # rewards of its clause and all later clauses of its row.
    rewards, mask, token_clause = layout("clause")
    adv = np.asarray(clause_advantages(jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(token_clause),
                                       jnp.asarray(TOKEN_MASK), group_size=2))
    pool = np.array([0.3, 0.5, 1.6, 0.4, 0.8])
    norm = (pool - pool.mean()) / (pool.std() + 1e-6)
    row0 = np.cumsum(norm[:3][::-1])[::-1]
    row1 = np.cumsum(norm[3:][::-1])[::-1]
    expected = np.zeros((2, 10))
    expected[0, 2:8] = row0[[0, 0, 1, 1, 2, 2]]
    expected[1, 2:10] = row1[[0, 0, 0, 1, 1, 1, 1, 1]]
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)


def test_a_registered_variant_is_a_layout(monkeypatch):
    # Units at every second completion token, PRM-free: by hand, row 0 (completion 2..7) ends at
    # 3, 5, 7 and row 1 (2..9) at 3, 5, 7, 9; the execution reward sits on the last unit only.
    def every_second(clause_ends, token_mask):
        positions = jnp.broadcast_to(jnp.arange(token_mask.shape[1], dtype=jnp.int32), token_mask.shape)
        return positions, token_mask & (positions % 2 == 1)

    monkeypatch.setitem(rewards._REGISTRY, "every_second", rewards.RewardVariant("every_second", every_second, False))
    out, mask, token_clause = layout("every_second", prm_weight=5.0)
    np.testing.assert_array_equal(mask.sum(axis=1), [3, 4])
    np.testing.assert_array_equal(out[:, :4], [[0, 0, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(token_clause, [[-1, -1, 0, 0, 1, 1, 2, 2, -1, -1],
                                                 [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3]])
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_variant("clause", uses_prm=True)(every_second)


def test_bad_variant_and_shapes_raise():
    known = r"\('sparse', 'clause', 'token'\)"
    with pytest.raises(ValueError, match=rf"unknown reward variant 'dense'; expected one of {known}"):
        layout("dense")
    with pytest.raises(ValueError, match="prm_scores"):
        layout("clause", prm=PRM[:, :5])
    with pytest.raises(ValueError, match=r"\[B\]"):
        layout("clause", exec_rewards=EXEC[:1])
