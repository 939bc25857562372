"""GRPO's frozen models held in the compute dtype (``frozen_params``): bit-identical outputs to the fp32
weights they were made from, at about half the memory.

The reference policy's log-probs and the Clause-PRM's scores, each computed by the jitted function the
trainer runs, once from the fp32 master weights and once from the frozen copy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
from caper_jax.models.frozen import frozen_params
from caper_jax.prm.model import ClausePRM
from caper_jax.rl.step import jit_completion_logprobs, prm_token_scores


# One DeltaNet and one attention layer: every kind of weight, the least compile time.
TWO_LAYERS = dict(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def batch(vocab: int):
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(1, vocab, (2, 40)), jnp.int32)
    return ids, jnp.ones_like(ids).at[0, :5].set(0)


@pytest.mark.parametrize("tied", [False, True])
def test_reference_log_probs_are_bit_identical_in_bf16(tied):
    config = Qwen35Config.tiny(vocab_size=128, dtype="bfloat16", tie_word_embeddings=tied, **TWO_LAYERS)
    graphdef, params = nnx.split(Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    frozen = frozen_params(params, "bfloat16", reads_head=True, tied=tied)
    ids, mask = batch(128)
    args = dict(graphdef=graphdef, completion_len=20, temperature=0.7, chunk_size=8)
    expected = np.asarray(jit_completion_logprobs(params, ids, mask, **args))
    got = np.asarray(jit_completion_logprobs(frozen, ids, mask, **args))
    np.testing.assert_array_equal(got, expected)
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(frozen)}
    assert flat["layers/0/mlp/gate_proj"].dtype == jnp.bfloat16
    assert flat["layers/0/input_layernorm/weight"].dtype == jnp.float32     # norms are read in fp32
    assert flat["layers/0/linear_attn/A_log"].dtype == jnp.float32
    head = "embed_tokens" if tied else "lm_head"                             # token_logprobs: fp32 head
    assert flat[head].dtype == jnp.float32
    if not tied:
        assert flat["embed_tokens"].dtype == jnp.bfloat16
    assert nbytes(frozen) < 0.6 * nbytes(params)


def test_prm_scores_are_bit_identical_in_bf16():
    prm = ClausePRM(Qwen35Config.tiny(vocab_size=128, dtype="bfloat16", **TWO_LAYERS), rngs=nnx.Rngs(2))
    graphdef, params = nnx.split(prm)
    frozen = frozen_params(params, "bfloat16", reads_head=False, tied=True)
    ids, mask = batch(128)
    expected = np.asarray(prm_token_scores(params, ids, mask, graphdef=graphdef, last=20))
    got = np.asarray(prm_token_scores(frozen, ids, mask, graphdef=graphdef, last=20))
    np.testing.assert_array_equal(got, expected)
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(frozen)}
    assert flat["backbone/embed_tokens"].dtype == jnp.bfloat16 and flat["score_head"].dtype == jnp.float32
    assert nbytes(frozen) < 0.55 * nbytes(params)


def test_fp32_compute_keeps_every_weight_and_copies_it():
    """A run computing in fp32 holds the frozen models in fp32; the copies are new buffers (the trainer
    donates the train state the reference was copied from)."""
    graphdef, params = nnx.split(Qwen35ForCausalLM(Qwen35Config.tiny(vocab_size=64, **TWO_LAYERS), rngs=nnx.Rngs(0)))
    frozen = frozen_params(params, "float32", reads_head=True, tied=False)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(frozen)):
        assert a.dtype == b.dtype and a is not b
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
