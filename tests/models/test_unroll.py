"""The layer groups unrolled (the CPU's default) and scanned (the accelerators') are one function:
the same loss and gradients on a two-group tiny Qwen3.5, without remat and with remat="layers" (a
group body of checkpointed layers; marked slow, CI runs it)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from caper_jax.models import Qwen35Config, Qwen35ForCausalLM

# Four layers, a period of one DeltaNet and one attention layer: two groups, both layer kinds.
TWO_GROUPS = dict(num_hidden_layers=4, layer_types=("linear_attention", "full_attention") * 2)


def loss_and_grads(unroll: bool, remat: str, ids):
    """The mean next-token loss and its gradients at N(0, 0.05) weights drawn by numpy (the same for
    both programs; no init program to compile)."""
    config = Qwen35Config.tiny(unroll_layers=unroll, remat=remat, **TWO_GROUPS)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.05, x.shape), x.dtype), abstract)

    def loss(state):
        logits = nnx.merge(graphdef, state)(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    loops = jax.jit(loss).lower(state).as_text().count("stablehlo.while")   # the program's loops
    return *jax.jit(jax.value_and_grad(loss))(state), loops


@pytest.mark.parametrize("remat", ["none", pytest.param("layers", marks=pytest.mark.slow)])
def test_unrolled_and_scanned_groups_give_the_same_loss_and_gradients(remat):
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 24)), jnp.int32)
    assert Qwen35Config.tiny(**TWO_GROUPS).num_groups == 2   # else there is nothing to unroll
    (scanned_loss, scanned, scanned_loops), (unrolled_loss, unrolled, unrolled_loops) = (
        loss_and_grads(u, remat, ids) for u in (False, True))
    assert unrolled_loops == scanned_loops - 1   # the group scan's loop is gone (DeltaNet's chunk scan stays)
    np.testing.assert_allclose(float(unrolled_loss), float(scanned_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(unrolled), jax.tree.leaves(scanned)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_unroll_layers_must_be_a_bool_or_none():
    from caper_jax.models.config import ConfigError

    with pytest.raises(ConfigError, match="unroll_layers"):
        Qwen35Config.tiny(unroll_layers="yes")
