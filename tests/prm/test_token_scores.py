"""``ClausePRM.token_scores(..., last=n)`` takes the last n positions of the hidden states first and applies
the fp32 head to those only; its scores equal the former computation (the whole [B, T, H] hidden state
cast to fp32, then the last n columns kept)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from caper_jax.models import Qwen35Config
from caper_jax.prm.model import ClausePRM
from caper_jax.rl.step import prm_token_scores


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_last_positions_equal_the_whole_sequence_then_sliced(dtype):
    prm = ClausePRM(Qwen35Config.tiny(vocab_size=64, dtype=dtype, num_hidden_layers=2,
                                      layer_types=("linear_attention", "full_attention")), rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(prm)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 64, (3, 24)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, :7].set(0)          # a left-padded row

    @jax.jit
    def former(params, ids, mask):   # the computation before: all positions in fp32, then the slice
        model = nnx.merge(graphdef, params)
        h = model.backbone.hidden_states(ids, mask)
        return jnp.einsum("bth,h->bt", h.astype(jnp.float32), model.score_head[...])[:, -9:]

    expected = np.asarray(former(params, ids, mask))
    got = np.asarray(prm_token_scores(params, ids, mask, graphdef=graphdef, last=9))
    whole = np.asarray(prm_token_scores(params, ids, mask, graphdef=graphdef))
    assert got.shape == (3, 9) and got.dtype == np.float32 and whole.shape == (3, 24)
    # Both are fp32 dot products of the same compute-dtype hidden states (a bf16 value is exact in fp32)
    # with the fp32 head: only the summation order of 64 terms may differ, a few fp32 ulps of the
    # largest |product| sum (scores are O(1): 1e-6 absolute).
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got, whole[:, -9:], rtol=0, atol=1e-6)
    assert np.abs(expected).max() > 0.05      # the head reads something: a zero score would pass anything
