"""The PRM pair losses against values computed by hand (log(1 + e^x) written out)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caper_jax.prm.loss import LmAuxConfig, PairLossConfig, lm_nll, pairwise_loss, sql_target_mask

# Two real rows and one padding row whose values must not count.
R_POS = jnp.array([2.0, 0.0, 50.0])
R_NEG = jnp.array([0.0, 1.0, -50.0])
MARGIN = jnp.array([1.0, 0.5, 1.0])
WEIGHT = jnp.array([1.0, 1.0, 0.0])


def softplus(x):
    return math.log1p(math.exp(x))


def test_margin_weighted_bradley_terry():
    loss, metrics = pairwise_loss(R_POS, R_NEG, MARGIN, WEIGHT, PairLossConfig())
    expected = (softplus(-2.0) * 1.0 + softplus(1.0) * 0.5) / 2
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], 0.5)
    np.testing.assert_allclose(metrics["margin_gap"], (2.0 - 1.0) / 2)


def test_alpha_normalises_the_weight():
    loss, _ = pairwise_loss(R_POS, R_NEG, MARGIN, WEIGHT, PairLossConfig(annotation_alpha=2.0))
    expected = (softplus(-2.0) * 0.5 + softplus(1.0) * 0.25) / 2
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_plain_bradley_terry():
    loss, _ = pairwise_loss(R_POS, R_NEG, MARGIN, WEIGHT, PairLossConfig(margin_weight="none"))
    np.testing.assert_allclose(loss, (softplus(-2.0) + softplus(1.0)) / 2, rtol=1e-6)


def test_margin_offset_form():
    loss, _ = pairwise_loss(R_POS, R_NEG, MARGIN, WEIGHT, PairLossConfig(form="offset"))
    np.testing.assert_allclose(loss, (softplus(-1.0) + softplus(1.5)) / 2, rtol=1e-6)


def test_reward_centring():
    cfg = PairLossConfig(center_coef=0.1)
    loss, _ = pairwise_loss(R_POS, R_NEG, MARGIN, WEIGHT, cfg)
    base = (softplus(-2.0) * 1.0 + softplus(1.0) * 0.5) / 2
    np.testing.assert_allclose(loss, base + 0.1 * (4.0 + 1.0) / 2, rtol=1e-6)


def test_gradient_pushes_scores_apart_in_proportion_to_margin():
    grad = jax.grad(lambda rp: pairwise_loss(rp, R_NEG, MARGIN, WEIGHT, PairLossConfig())[0])(R_POS)
    # d/dr+ of -w log sigmoid(r+ - r-) = -w * sigmoid(-(r+ - r-)) / n
    sig = lambda x: 1 / (1 + math.exp(-x))
    np.testing.assert_allclose(grad, [-1.0 * sig(-2.0) / 2, -0.5 * sig(1.0) / 2, 0.0], rtol=1e-6)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="loss form"):
        PairLossConfig(form="hinge")
    with pytest.raises(ValueError, match="margin_weight"):
        PairLossConfig(margin_weight="square")


def test_sql_target_mask_by_hand():
    """Marker id 9; row 0: prompt [5, 9, 6] then SQL [7, 8, 3], scored up to index 4, pad after;
    row 1: two markers (the SQL follows the last), scored up to its end; row 2: no marker."""
    ids = jnp.array([[5, 9, 6, 7, 8, 3, 0],
                     [9, 4, 9, 7, 7, 2, 2],
                     [1, 2, 3, 4, 0, 0, 0]])
    mask = jnp.array([[1, 1, 1, 1, 1, 1, 0],
                      [1, 1, 1, 1, 1, 1, 1],
                      [1, 1, 1, 1, 0, 0, 0]])
    last = jnp.array([4, 6, 3])
    got = np.asarray(sql_target_mask(ids, mask, last, marker_id=9))
    # Column t says whether token t+1 is a target.
    want = np.array([[0, 1, 1, 1, 0, 0],      # tokens 6, 7, 8 (index 2..4); 3 is past `last`
                     [0, 0, 1, 1, 1, 1],      # tokens after the second marker
                     [1, 1, 1, 0, 0, 0]], bool)  # no marker: every real token up to `last` but the first
    np.testing.assert_array_equal(got, want)


def test_lm_nll_averages_target_tokens_of_real_rows():
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.1], [0.5, 0.5, 0.5], [0.9, 0.9, 0.9]]))
    target = jnp.array([[1, 1, 0], [0, 0, 1], [1, 1, 1]], bool)
    weight = jnp.array([1.0, 1.0, 0.0])            # the third row is padding
    want = (math.log(2) + math.log(4) + math.log(2)) / 3
    np.testing.assert_allclose(float(lm_nll(logp, target, weight)), want, rtol=1e-6)
    assert float(lm_nll(logp, jnp.zeros_like(target), weight)) == 0.0


def test_lm_aux_config_is_checked():
    with pytest.raises(ValueError, match=">= 0"):
        LmAuxConfig(coef=-0.1, marker_id=3)
    with pytest.raises(ValueError, match="marker_id"):
        LmAuxConfig(coef=0.5)
