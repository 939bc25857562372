"""remat="layers" (each layer checkpointed, same-kind runs scanned inside the group) computes the same
loss and gradients as no remat, with its own program structure (a scan over the DeltaNet run)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
from caper_jax.models.qwen35 import _kind_runs


def _loss_and_grads(remat: str):
    config = Qwen35Config.tiny(remat=remat)   # one group: 3 DeltaNet layers + 1 attention
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, config.vocab_size, (2, 24)), jnp.int32)
    mask = jnp.asarray(np.arange(24)[None, :] >= np.array([[0], [5]]), jnp.int32)   # row 1 left-padded
    segments = jnp.asarray(np.repeat([[0] * 14 + [1] * 10], 2, axis=0), jnp.int32)

    def loss_fn(params):
        logits = nnx.merge(graphdef, params)(ids, mask, segments)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0] * mask[:, 1:]).mean()

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    return loss, grads, jax.make_jaxpr(jax.grad(loss_fn))(params)


def test_kind_runs_group_consecutive_layers():
    assert _kind_runs(("linear_attention",) * 3 + ("full_attention",)) == [[0, 1, 2], [3]]
    assert _kind_runs(("full_attention", "linear_attention", "full_attention")) == [[0], [1], [2]]


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_remat_layers_gives_the_gradients_of_no_remat():
    ref_loss, ref_grads, _ = _loss_and_grads("none")
    loss, grads, jaxpr = _loss_and_grads("layers")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6 * scale)
    text = str(jaxpr)   # the DeltaNet run is an inner scan of length 3, under the named-input policy
    assert "length=3" in text and "layer_input" in text
