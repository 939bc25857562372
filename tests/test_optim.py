"""The optimizer update every trainer shares: applied when finite, refused and counted otherwise."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from caper_jax.utils.optim import guarded_update, init_state, learning_rate, make_optimizer


@pytest.fixture
def state_and_tx():
    tx = optax.sgd(0.5)
    return init_state({"w": jnp.array([1.0, 2.0]), "b": jnp.array(3.0)}, tx), tx


def test_finite_update_is_sgd_and_counts_the_step(state_and_tx):
    state, tx = state_and_tx
    grads = {"w": jnp.array([0.2, -0.4]), "b": jnp.array(1.0)}
    new, m = guarded_update(state, jnp.float32(0.7), grads, tx)
    np.testing.assert_allclose(new.params["w"], [0.9, 2.2])          # w - 0.5 * g, by hand
    np.testing.assert_allclose(new.params["b"], 2.5)
    assert int(new.step) == 1 and int(new.nonfinite) == 0 and float(m["refused"]) == 0.0
    np.testing.assert_allclose(m["grad_norm"], np.sqrt(0.04 + 0.16 + 1.0), rtol=1e-6)
    same_step, _ = guarded_update(state, jnp.float32(0.7), grads, tx, advance_step=False)
    assert int(same_step.step) == 0


@pytest.mark.parametrize("loss, bad_grad", [(np.nan, 0.0), (0.7, np.inf), (np.inf, np.nan)])
def test_non_finite_loss_or_gradient_is_refused_and_counted(state_and_tx, loss, bad_grad):
    state, tx = state_and_tx
    grads = {"w": jnp.array([0.2, bad_grad]), "b": jnp.array(1.0)}
    once, m = guarded_update(state, jnp.float32(loss), grads, tx)
    twice, _ = guarded_update(once, jnp.float32(loss), grads, tx)
    for new in (once, twice):
        jax.tree.map(np.testing.assert_array_equal, new.params, state.params)
    assert float(m["refused"]) == 1.0 and int(once.nonfinite) == 1 and int(twice.nonfinite) == 2
    assert int(twice.step) == 2                       # the batches were consumed
    good, _ = guarded_update(twice, jnp.float32(0.1), {"w": jnp.zeros(2), "b": jnp.array(0.0)}, tx)
    assert int(good.nonfinite) == 0


def test_schedule_warms_up_linearly_then_decays_to_a_tenth():
    optim = ConfigDict(dict(lr=1e-3, warmup_steps=10, total_steps=110, weight_decay=0.1, b1=0.9, b2=0.95,
                            grad_clip=1.0))
    lr = learning_rate(optim)
    np.testing.assert_allclose([lr(0), lr(5), lr(10), lr(60), lr(110)],
                               [0.0, 5e-4, 1e-3, 1e-4 + 0.9e-3 * 0.5, 1e-4], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("updates_per_step", [1, 3])
def test_every_update_of_a_step_applies_that_steps_rate(updates_per_step):
    """GRPO makes update_epochs x num_minibatches updates per step; the schedule counted them as steps,
    so its warmup and cosine ran that many times too fast. With b1 = b2 = 0 Adam's update is
    g / (|g| + eps) = 1 for g = 1, so each update moves the parameter by exactly the rate it applied."""
    optim = ConfigDict(dict(lr=1.0, warmup_steps=2, total_steps=6, weight_decay=0.0, b1=0.0, b2=0.0,
                            grad_clip=1e9))
    tx = make_optimizer(optim, updates_per_step)
    params = {"w": jnp.zeros(())}
    opt_state = tx.init(params)
    applied = []
    for _ in range(6 * updates_per_step):
        updates, opt_state = tx.update({"w": jnp.ones(())}, opt_state, params)
        applied.append(-float(updates["w"]))
        params = optax.apply_updates(params, updates)
    # step s (1-based) applies the schedule at s - 1: warmup 0, 0.5, then cosine from 1 down to 0.1 at step 6
    per_step = [learning_rate(optim)(s - 1) for s in range(1, 7)]
    np.testing.assert_allclose(applied, np.repeat(per_step, updates_per_step), rtol=1e-6, atol=1e-7)
    assert per_step[:3] == pytest.approx([0.0, 0.5, 1.0])


def _optim(**moments):
    return ConfigDict(dict(lr=1e-2, warmup_steps=1, total_steps=50, weight_decay=0.01, b1=0.9, b2=0.95,
                           grad_clip=1.0, **moments))


def test_fp32_moments_are_optax_adamw_exactly():
    from caper_jax.utils.optim import decay_mask, make_optimizer

    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        learning_rate(_optim()), b1=0.9, b2=0.95, weight_decay=0.01, mask=decay_mask))
    tx = make_optimizer(_optim())
    state, ref_state = tx.init(params), ref.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)    # checkpoints stay compatible
    grads = {"w": jnp.linspace(-1, 1, 12).reshape(3, 4), "b": jnp.full(4, 0.3)}
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        jax.tree.map(np.testing.assert_array_equal, updates, ref_updates)


def test_bf16_moments_are_stored_in_bf16_and_track_the_fp32_update():
    from caper_jax.utils.optim import make_optimizer

    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
    low, full = make_optimizer(_optim(mu_dtype="bfloat16", nu_dtype="bfloat16")), make_optimizer(_optim())
    s_low, s_full = low.init(params), full.init(params)
    rng = np.random.default_rng(0)
    for _ in range(5):
        grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
        u_low, s_low = low.update(grads, s_low, params)
        u_full, s_full = full.update(grads, s_full, params)
        adam = s_low[1][0]
        assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u_low))    # the update itself is fp32
        # bf16 has an 8-bit mantissa: the moments agree to ~2^-8, and so do the updates (lr 1e-2 scale).
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-4), u_low, u_full)


def test_unknown_moment_dtype_is_refused():
    from caper_jax.utils.optim import make_optimizer

    with pytest.raises(ValueError, match="mu_dtype"):
        make_optimizer(_optim(mu_dtype="float16"))
