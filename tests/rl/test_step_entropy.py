"""GRPO's update computes the policy's entropy (a metric only) on logging steps alone: the update without
it gives the same new state, bit for bit, has no entropy in its program, and the logged entropy equals an
independent computation from the full softmax.

Both variants compile with XLA:CPU's fusion emitters (its default), whatever the suite's flags: under the older
loop emitters the suite uses for compile speed (tests/conftest.py) the two programs' fusions split differently
and after one Adam step a few parameters came out some float32 ulps apart, more on some processors than on
others (1,193 of 95,608 on a Xeon with AVX-512, none by more than 4e-7); with the fusion emitters, at -O0 or
XLA's default -O2, none differ."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
from caper_jax.rl import step as rl_step
from caper_jax.rl.trainer import is_logging_step
from caper_jax.utils.optim import init_state, make_optimizer
from configs.grpo import get_config

PROMPT, NEW, ROWS = 12, 6, 4


@pytest.fixture(scope="module")
def setup():
    config = get_config()
    config.optim.warmup_steps = 0
    # One DeltaNet and one attention layer: the whole architecture at the least compile time.
    model = Qwen35ForCausalLM(Qwen35Config.tiny(vocab_size=96, num_hidden_layers=2,
                                                layer_types=("linear_attention", "full_attention")), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = make_optimizer(config.optim)
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(1, 96, (ROWS, PROMPT + NEW)), jnp.int32),
             "attention_mask": jnp.ones((ROWS, PROMPT + NEW), jnp.int32),
             "completion_mask": jnp.asarray(rng.integers(0, 2, (ROWS, NEW)).clip(0, 1).astype(np.int32)),
             "old_logp": jnp.asarray(rng.normal(-4.5, 0.1, (ROWS, NEW)), jnp.float32),
             "advantages": jnp.asarray(rng.normal(size=(ROWS, NEW)), jnp.float32),
             "ref_logp": jnp.asarray(rng.normal(-4.5, 0.1, (ROWS, NEW)), jnp.float32)}
    batch["completion_mask"] = batch["completion_mask"].at[:, 0].set(1)
    state = jax.eval_shape(lambda: init_state(params, tx))
    # Each variant compiled once (run below, its cost analysis read), with the fusion emitters (see above).
    step = {flag: jax.jit(functools.partial(
        rl_step.update_step, graphdef=graphdef, tx=tx, beta=0.04, agg="token-mean", eps_low=0.2, eps_high=0.28,
        temperature=0.7, chunk_size=4, kl_bias_correction=False, with_entropy=flag)).lower(state, batch).compile(
        {"xla_cpu_use_fusion_emitters": True}) for flag in (True, False)}
    return dict(config=config, model=model, params=params, tx=tx, batch=batch, step=step)


@pytest.mark.slow   # compiles the tiny policy's update twice (minutes on 2 loaded cores)
def test_the_update_without_entropy_gives_the_same_state_and_no_entropy(setup):
    results = {}
    for flag in (True, False):
        state = init_state(jax.tree.map(jnp.copy, setup["params"]), setup["tx"])
        results[flag] = setup["step"][flag](state, setup["batch"])
    (with_state, with_metrics), (without_state, without_metrics) = results[True], results[False]
    assert "entropy" in with_metrics and "entropy" not in without_metrics
    assert set(with_metrics) - {"entropy"} == set(without_metrics)
    for a, b in zip(jax.tree.leaves(with_state.params), jax.tree.leaves(without_state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for key in without_metrics:
        np.testing.assert_array_equal(np.asarray(with_metrics[key]), np.asarray(without_metrics[key]), err_msg=key)

    # The logged value: the token mean, over the completion mask, of the tempered softmax's entropy.
    logits = np.asarray(nnx.jit(lambda m, ids: m(ids))(setup["model"], setup["batch"]["input_ids"]),
                        np.float64)[:, PROMPT - 1:-1] / 0.7
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    entropy = -(np.exp(logp) * logp).sum(-1)
    mask = np.asarray(setup["batch"]["completion_mask"], bool)
    np.testing.assert_allclose(float(with_metrics["entropy"]), entropy[mask].mean(), rtol=1e-5)


@pytest.mark.slow
def test_the_program_without_entropy_is_smaller(setup):
    """Off, the entropy's [rows, chunk, V] product and reduction (forward and backward) are not in the
    compiled program: fewer FLOPs than with it."""
    flops = {}
    for flag in (True, False):
        analysis = setup["step"][flag].cost_analysis()
        flops[flag] = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    assert flops[False] < flops[True], flops


def test_logging_steps_are_the_ones_the_run_logs():
    config = get_config()
    config.log_every, config.optim.total_steps = 4, 10
    assert [s for s in range(1, 11) if is_logging_step(config, s)] == [4, 8, 10]
