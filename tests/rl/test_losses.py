"""grpo_loss against hand-computed values, a numpy reference, and its gradients where clipped."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from caper_jax.rl import AGGREGATIONS, grpo_loss


def numpy_grpo(logp, old, ref, adv, mask, eps_low, eps_high, beta, agg, norm_len=None, kl_bias_correction=False):
    """float64 reference, written row by row."""
    logp, old, ref, adv = (np.asarray(x, np.float64) for x in (logp, old, ref, adv))
    ratio = np.exp(logp - old)
    per_token = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    if beta:
        k3 = np.exp(ref - logp) - (ref - logp) - 1
        per_token += beta * (ratio * k3 if kl_bias_correction else k3)
    rows = [(per_token[i][mask[i]]) for i in range(len(mask)) if mask[i].any()]
    if agg == "token-mean":
        return np.concatenate(rows).sum() / max(mask.sum(), 1)
    if agg == "sequence-mean-token-mean":
        return np.mean([r.mean() for r in rows])
    if agg == "sequence-mean-token-sum":
        return np.mean([r.sum() for r in rows])
    return np.concatenate(rows).sum() / (mask.shape[0] * (norm_len or mask.shape[1]))


def test_hand_computed_clipping():
    # Ratios 1.5 (A=+1, clipped high at 1.28), 0.5 (A=-1, clipped low at 0.8), 1.1 (A=+2, inside),
    # 0.9 (A=+1, inside: the clip only binds on the side that would increase the objective).
    ratio = np.array([[1.5, 0.5, 1.1, 0.9]])
    adv = np.array([[1.0, -1.0, 2.0, 1.0]])
    logp = jnp.asarray(np.log(ratio), jnp.float32)
    loss, metrics = grpo_loss(logp, jnp.zeros((1, 4)), None, jnp.asarray(adv), jnp.ones((1, 4)),
                              eps_low=0.2, eps_high=0.28, beta=0.0, agg="token-mean")
    assert float(loss) == pytest.approx((-1.28 + 0.8 - 2.2 - 0.9) / 4, rel=1e-6)
    assert float(metrics["clip_frac_high"]) == pytest.approx(0.25)
    assert float(metrics["clip_frac_low"]) == pytest.approx(0.25)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0, rel=1e-6)
    expected_kl = np.mean(ratio - 1 - np.log(ratio))
    assert float(metrics["approx_kl"]) == pytest.approx(expected_kl, rel=1e-5)
    assert "kl_ref" not in metrics


def test_hand_computed_k3_kl():
    # On-policy (ratio 1), A = 0: the loss is β · k3 = β (e^d - d - 1) with d = ref - logp = ln 2.
    logp = jnp.zeros((1, 2))
    ref = jnp.full((1, 2), math.log(2.0))
    loss, metrics = grpo_loss(logp, logp, ref, jnp.zeros((1, 2)), jnp.ones((1, 2)), beta=0.1,
                              agg="token-mean")
    k3 = 2.0 - math.log(2.0) - 1.0
    assert float(loss) == pytest.approx(0.1 * k3, rel=1e-6)
    assert float(metrics["kl_ref"]) == pytest.approx(k3, rel=1e-6)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_matches_numpy_reference(agg, beta):
    rng = np.random.default_rng(7)
    b, t = 6, 9
    logp = rng.normal(-2, 0.3, (b, t))
    old = logp + rng.normal(0, 0.3, (b, t))
    ref = logp + rng.normal(0, 0.3, (b, t))
    adv = rng.normal(size=(b, t))
    mask = rng.random((b, t)) < 0.7
    mask[2] = False  # an empty row: excluded from the sequence means
    expected = numpy_grpo(logp, old, ref, adv, mask, 0.2, 0.28, beta, agg)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, _ = grpo_loss(f32(logp), f32(old), f32(ref), f32(adv), jnp.asarray(mask), eps_low=0.2,
                        eps_high=0.28, beta=beta, agg=agg)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_bias_corrected_kl_hand_computed():
    # On-policy (ρ = 1 in value), A = 0, d = ref - logp = ln 2, k3 = 1 - ln 2: the loss is β·k3 either
    # way, but ρ carries gradient: per token d(k3)/dlogp = 1 - e^d = -1, d(ρ·k3)/dlogp = k3 - 1 = -ln 2.
    logp = jnp.zeros((1, 2))
    ref = jnp.full((1, 2), math.log(2.0))
    k3 = 1.0 - math.log(2.0)
    for corrected, slope in ((False, -1.0), (True, -math.log(2.0))):
        def loss_fn(x, corrected=corrected):
            return grpo_loss(x, None, ref, jnp.zeros((1, 2)), jnp.ones((1, 2)), beta=0.1, agg="token-mean",
                             kl_bias_correction=corrected)[0]
        loss, grad = jax.value_and_grad(loss_fn)(logp)
        assert float(loss) == pytest.approx(0.1 * k3, rel=1e-6)
        np.testing.assert_allclose(np.asarray(grad), [[0.1 * slope / 2] * 2], rtol=1e-6)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_bias_corrected_kl_matches_numpy_loss_and_gradient(agg):
    """Value against the float64 reference, gradient against its central finite differences (the TRL form
    ρ·k3, ρ differentiated through logp)."""
    rng = np.random.default_rng(3)
    b, t = 4, 6
    logp = rng.normal(-2, 0.3, (b, t))
    old = logp + rng.normal(0, 0.3, (b, t))
    ref = logp + rng.normal(0, 0.3, (b, t))
    adv = rng.normal(size=(b, t))
    mask = rng.random((b, t)) < 0.7
    mask[1] = False
    ratio = np.exp(logp - old)
    # Finite differences need every token away from the clip's kinks at 1 - ε_low and 1 + ε_high.
    assert np.abs(ratio[mask] - 0.8).min() > 1e-3 and np.abs(ratio[mask] - 1.28).min() > 1e-3
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def loss_fn(x, corrected):
        return grpo_loss(x, f32(old), f32(ref), f32(adv), jnp.asarray(mask), beta=0.5, agg=agg,
                         kl_bias_correction=corrected)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(f32(logp), True)
    reference = functools.partial(numpy_grpo, old=old, ref=ref, adv=adv, mask=mask, eps_low=0.2, eps_high=0.28,
                                  beta=0.5, agg=agg, kl_bias_correction=True)
    assert float(loss) == pytest.approx(reference(logp), rel=1e-5)
    k3 = np.exp(ref - logp) - (ref - logp) - 1
    assert float(metrics["kl_ref"]) == pytest.approx((ratio * k3)[mask].mean(), rel=1e-5)
    h = 1e-6
    numeric = np.zeros((b, t))
    for index in np.ndindex(b, t):
        step = np.zeros((b, t))
        step[index] = h
        numeric[index] = (reference(logp + step) - reference(logp - step)) / (2 * h)
    np.testing.assert_allclose(np.asarray(grad), numeric, rtol=1e-4, atol=1e-6)
    uncorrected = jax.grad(lambda x: loss_fn(x, False)[0])(f32(logp))
    assert np.abs(np.asarray(grad) - np.asarray(uncorrected)).max() > 1e-3   # the option changes the gradient


def test_default_kl_is_uncorrected():
    rng = np.random.default_rng(4)
    logp, old, ref = (jnp.asarray(rng.normal(-2, 0.3, (3, 5)), jnp.float32) for _ in range(3))
    adv, mask = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32), jnp.ones((3, 5), bool)
    default = jax.value_and_grad(lambda x: grpo_loss(x, old, ref, adv, mask, beta=0.04)[0])(logp)
    off = jax.value_and_grad(lambda x: grpo_loss(x, old, ref, adv, mask, beta=0.04, kl_bias_correction=False)[0])(logp)
    on = grpo_loss(logp, old, ref, adv, mask, beta=0.04, kl_bias_correction=True)[0]
    assert float(default[0]) == float(off[0]) != float(on)
    assert np.array_equal(np.asarray(default[1]), np.asarray(off[1]))
    expected = numpy_grpo(logp, old, ref, adv, np.asarray(mask), 0.2, 0.28, 0.04, "token-mean")
    assert float(default[0]) == pytest.approx(expected, rel=1e-5)


def test_dr_grpo_normaliser_is_a_constant():
    logp = jnp.zeros((2, 4))
    adv = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = adv > 0
    loss, _ = grpo_loss(logp, logp, None, adv, mask, beta=0.0, agg="sequence-mean-token-sum-norm",
                        norm_len=10)
    assert float(loss) == pytest.approx(-6.0 / (2 * 10))


def test_gradient_is_zero_where_clipped_and_exact_elsewhere():
    ratio = np.array([[1.5, 0.5, 1.1, 0.9, 0.7, 1.4]])
    adv = np.array([[1.0, -1.0, 2.0, 1.0, 1.0, -1.0]])
    logp = jnp.asarray(np.log(ratio), jnp.float32)

    def loss_fn(x):
        return grpo_loss(x, jnp.zeros((1, 6)), None, jnp.asarray(adv, jnp.float32), jnp.ones((1, 6)),
                         eps_low=0.2, eps_high=0.28, beta=0.0, agg="token-mean")[0]

    grad = np.asarray(jax.grad(loss_fn)(logp))[0]
    clipped = np.array([True, True, False, False, False, False])
    assert np.all(grad[clipped] == 0.0)
    # Unclipped: d/dlogp of -ρA/N is -ρA/N (ratio 0.7 with A>0 and 1.4 with A<0 are not clipped).
    np.testing.assert_allclose(grad[~clipped], -(ratio * adv)[0, ~clipped] / 6, rtol=1e-6)


def test_on_policy_old_logp_none():
    # old = stop_gradient(logp): ratio 1, loss -mean(A), gradient -A/N, identical to passing it.
    logp = jnp.array([[-0.5, -1.5, -2.5]])
    adv = jnp.array([[1.0, -2.0, 0.5]])
    fn = lambda x, old: grpo_loss(x, old, None, adv, jnp.ones((1, 3)), beta=0.0)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(lambda x: fn(x, None))(logp)
    assert float(loss) == pytest.approx(0.5 / 3)
    np.testing.assert_allclose(np.asarray(grad), -np.asarray(adv) / 3, rtol=1e-6)
    assert float(fn(logp, logp)) == pytest.approx(float(loss))


def test_masked_garbage_stays_out_of_loss_and_gradient():
    logp = jnp.array([[-1.0, jnp.nan, -2.0]])
    mask = jnp.array([[True, False, True]])
    old = jnp.array([[-1.0, jnp.inf, -2.0]])
    fn = lambda x: grpo_loss(x, old, old, jnp.ones((1, 3)), mask, beta=0.1, agg="token-mean")[0]  # noqa: E731
    loss, grad = jax.value_and_grad(fn)(logp)
    assert float(loss) == pytest.approx(-1.0)
    np.testing.assert_allclose(np.asarray(grad), [[-0.5, 0.0, -0.5]])


def test_entropy_metric_and_advantages_are_constants():
    logp = jnp.full((1, 3), -1.0)
    adv = jnp.array([[1.0, 2.0, 3.0]])
    mask = jnp.array([[True, True, False]])
    _, metrics = grpo_loss(logp, logp, None, adv, mask, beta=0.0, entropy=jnp.array([[1.0, 3.0, 99.0]]))
    assert float(metrics["entropy"]) == pytest.approx(2.0)
    grad_adv = jax.grad(lambda a: grpo_loss(logp, logp, None, a, mask, beta=0.0)[0])(adv)
    assert np.all(np.asarray(grad_adv) == 0.0)


def test_bad_input_raises():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        grpo_loss(x, x, x, x, x, agg="mean")
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo_loss(x, x, None, x, x, beta=0.1)
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        grpo_loss(x, x, x, jnp.zeros((2, 4)), x)


def bandit_advantages(variant, tokens, group_size):
    """float64 reference of the bandit's token advantages, from its rules alone: sparse gives every token
    of a row its group-normalised execution reward; clause has two units, rewarded with the PRM score of
    each token's prefix (plus the execution reward on the last), normalised over all units of the group,
    and each token's advantage is the return-to-go (gamma 1) from its own unit."""
    right = tokens == np.array([1, 3])
    exec_reward = right.all(axis=1).astype(np.float64)
    if variant == "sparse":
        units = exec_reward[:, None]
    else:
        units = np.stack([right[:, 0], right.all(axis=1) + exec_reward], axis=1).astype(np.float64)
    grouped = units.reshape(-1, group_size * units.shape[1])
    normalised = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-6)
                  ).reshape(units.shape)
    if variant == "sparse":
        return np.repeat(normalised, 2, axis=1)
    return np.stack([normalised[:, 0] + normalised[:, 1], normalised[:, 1]], axis=1)


@pytest.mark.parametrize("variant", ["sparse", "clause"])  # "token" equals "clause" here
def test_pipeline_learns_a_two_clause_bandit(variant):
    """layout_rewards -> clause_advantages -> token_logprobs -> grpo_loss on a toy policy.

    Two "clauses" of one token each; the query is right when token 0 is 1 and token 1 is 3 (prob 1/16
    under the uniform start). The PRM scores token 0's prefix by whether token 0 is right. The first
    step's advantages are the variant's (``bandit_advantages``: under ``clause`` token 0 of a query whose
    token 1 is wrong is credited for being right), and whatever the variant, GRPO steps must drive the
    success rate from 1/16 to near 1.
    """
    from caper_jax.policy.logprobs import token_logprobs
    from caper_jax.rl import clause_advantages, layout_rewards

    groups, group_size, vocab = 16, 8, 4
    batch = groups * group_size
    hidden = jnp.broadcast_to(jnp.eye(2), (batch, 2, 2))  # position one-hot: logits = head[position]
    mask = jnp.ones((batch, 2), bool)
    clause_ends = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (batch, 2))

    @jax.jit
    def step(head, key):
        logits = jnp.einsum("bth,hv->btv", hidden, head)
        tokens = jax.random.categorical(key, logits)
        right = tokens == jnp.array([1, 3])
        exec_reward = right.all(axis=1).astype(jnp.float32)
        prm = jnp.stack([right[:, 0], right.all(axis=1)], axis=1).astype(jnp.float32)
        rewards, unit_mask, owner = layout_rewards(variant, prm, clause_ends, exec_reward, mask,
                                                   jnp.ones(batch, bool))
        adv = clause_advantages(rewards, unit_mask, owner, mask, group_size=group_size)
        old = jax.lax.stop_gradient(token_logprobs(hidden, head, tokens, 1))

        def loss_fn(w):
            logp = token_logprobs(hidden, w, tokens, 1)
            return grpo_loss(logp, old, old, adv, mask, beta=0.0, agg="token-mean")[0]

        return head - 2.0 * jax.grad(loss_fn)(head), tokens, adv  # plain SGD, lr 2

    head = jnp.zeros((2, vocab))
    for i, key in enumerate(jax.random.split(jax.random.key(0), 25)):
        head, tokens, adv = step(head, key)
        if i == 0:
            expected = bandit_advantages(variant, np.asarray(tokens), group_size)
            np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-4, atol=1e-5)
            half_right = (np.asarray(tokens) == [1, 3]).tolist().count([True, False])
            assert half_right >= 8   # rows where the variants' credit for token 0 differs in sign
    probs = jax.nn.softmax(head, axis=-1)
    assert float(probs[0, 1] * probs[1, 3]) > 0.8


def tis_inputs(seed=11, b=5, t=8):
    """Log-probs where the trainer/sampler weight exp(old - sampler) falls both under and over a cap of 2."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2, 0.3, (b, t))
    old = logp + rng.normal(0, 0.15, (b, t))
    sampler = old - rng.choice([-0.5, 0.05, 1.2], size=(b, t))   # weights e^-0.5, e^0.05, e^1.2 > 2
    adv = rng.normal(size=(b, t))
    mask = rng.random((b, t)) < 0.8
    mask[3] = False
    return logp, old, sampler, adv, mask


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_truncated_importance_weight_matches_numpy(agg, beta):
    """The policy term times min(exp(old - sampler), cap), float64 reference row by row; the KL term unweighted;
    the weight is a constant (the gradient is the weighted unweighted-policy gradient plus the KL's)."""
    logp, old, sampler, adv, mask = tis_inputs()
    ref = logp + np.random.default_rng(2).normal(0, 0.3, logp.shape)
    cap = 2.0
    weight = np.minimum(np.exp(old - sampler), cap)
    assert 0 < (np.exp(old - sampler)[mask] > cap).mean() < 1   # the cap binds on some tokens, not all
    ratio = np.exp(logp - old)
    policy = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.28) * adv) * weight
    k3 = np.exp(ref - logp) - (ref - logp) - 1
    per_token = policy + beta * k3
    rows = [per_token[i][mask[i]] for i in range(len(mask)) if mask[i].any()]
    expected = {"token-mean": np.concatenate(rows).sum() / mask.sum(),
                "sequence-mean-token-mean": np.mean([r.mean() for r in rows]),
                "sequence-mean-token-sum": np.mean([r.sum() for r in rows]),
                "sequence-mean-token-sum-norm": np.concatenate(rows).sum() / mask.size}[agg]
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def loss_fn(x, cap):
        return grpo_loss(x, f32(old), f32(ref), f32(adv), jnp.asarray(mask), beta=beta, agg=agg,
                         sampler_logp=f32(sampler), tis_cap=cap)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(f32(logp), cap)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["tis_weight_mean"]) == pytest.approx(weight[mask].mean(), rel=1e-5)
    assert float(metrics["tis_capped_frac"]) == pytest.approx((np.exp(old - sampler)[mask] > cap).mean())
    assert float(metrics["ratio_min"]) == pytest.approx(ratio[mask].min(), rel=1e-5)
    assert float(metrics["ratio_max"]) == pytest.approx(ratio[mask].max(), rel=1e-5)
    # The gradient: the policy term's without the weight, times the weight, plus the KL term's.
    policy_grad = jax.grad(lambda x: grpo_loss(x, f32(old), None, f32(adv), jnp.asarray(mask), beta=0.0,
                                               agg=agg)[0])(f32(logp))
    kl_grad = jax.grad(lambda x: grpo_loss(x, x, f32(ref), jnp.zeros_like(x), jnp.asarray(mask), beta=beta,
                                           agg=agg)[0])(f32(logp)) if beta else 0.0
    np.testing.assert_allclose(np.asarray(grad), np.asarray(policy_grad) * weight + np.asarray(kl_grad),
                               rtol=1e-5, atol=1e-7)


def test_truncated_importance_weight_single_update_is_a_constant():
    """old_logp None (one update right after sampling): w = min(exp(logp - sampler), cap) in value, and the
    gradient is w times the unweighted one (w carries no gradient)."""
    logp, _, sampler, adv, mask = tis_inputs(seed=5)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    weight = np.minimum(np.exp(logp - sampler), 2.0)

    def loss_fn(x, cap):
        return grpo_loss(x, None, None, f32(adv), jnp.asarray(mask), beta=0.0, sampler_logp=f32(sampler),
                         tis_cap=cap)[0]

    loss, grad = jax.value_and_grad(loss_fn)(f32(logp), 2.0)
    plain_loss, plain_grad = jax.value_and_grad(loss_fn)(f32(logp), None)
    assert float(loss) == pytest.approx(-(adv * weight)[mask].sum() / mask.sum(), rel=1e-5)
    assert float(plain_loss) == pytest.approx(-adv[mask].sum() / mask.sum(), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(plain_grad) * weight, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("cap", [None, 0.0])
def test_tis_off_leaves_loss_and_gradient_bit_identical(cap):
    logp, old, sampler, adv, mask = (jnp.asarray(x, jnp.float32) if x.dtype != bool else jnp.asarray(x)
                                     for x in tis_inputs(seed=9))
    ref = logp + 0.1
    without = jax.value_and_grad(lambda x: grpo_loss(x, old, ref, adv, mask, beta=0.04)[0])(logp)
    off = jax.value_and_grad(lambda x: grpo_loss(x, old, ref, adv, mask, beta=0.04, sampler_logp=sampler,
                                                 tis_cap=cap)[0])(logp)
    on = grpo_loss(logp, old, ref, adv, mask, beta=0.04, sampler_logp=sampler, tis_cap=2.0)[0]
    assert float(without[0]) == float(off[0]) != float(on)
    assert np.array_equal(np.asarray(without[1]), np.asarray(off[1]))
    metrics = grpo_loss(logp, old, ref, adv, mask, beta=0.04, sampler_logp=sampler, tis_cap=cap)[1]
    assert "tis_weight_mean" not in metrics and "tis_capped_frac" not in metrics


def test_tis_needs_sampler_logp():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="needs sampler_logp"):
        grpo_loss(x, x, None, x, x, beta=0.0, tis_cap=2.0)
    with pytest.raises(ValueError, match="needs sampler_logp"):
        grpo_loss(x, x, None, x, x, beta=0.0, tis_cap=2.0, sampler_logp=jnp.zeros((2, 4)))
