"""Frozen, forward-only copies of a Qwen3.5 model's parameters held in the compute dtype.

GRPO keeps two models it never trains resident through every step: the reference policy and the
Clause-PRM. Stored in fp32 (the master dtype of a trained model) they cost 4 bytes per parameter,
although every matmul weight is cast to ``config.dtype`` before use (``qwen35._dense``, the conv1d
taps, the embedding rows after the lookup). Holding exactly those weights in ``config.dtype`` gives
bit-identical outputs at half their memory: the rounding the forward did on every call is done once.

What stays as stored: the norms' weights, ``A_log`` and ``dt_bias`` (read in fp32), the PRM's score
head (fp32 dot), and the output projection wherever it is read as one: ``token_logprobs`` contracts
the LM head (or the tied embedding) in fp32, so rounding it would change the reference's log-probs.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Parameters the model casts to its compute dtype at every use.
CAST_AT_USE = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj",                                     # gated attention
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d",  # gated DeltaNet
    "gate_proj", "up_proj", "down_proj",                                        # MLP
    "embed_tokens",                                                             # rows cast after the lookup
})


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def frozen_params(params: Any, dtype: str | jnp.dtype, *, reads_head: bool, tied: bool) -> Any:
    """A copy of ``params`` (an ``nnx.State`` or any pytree of a Qwen3.5 model / Clause-PRM) with the
    weights in ``CAST_AT_USE`` in ``dtype`` and every other leaf copied as stored.

    ``reads_head``: the copy feeds the LM head to ``token_logprobs`` (the reference policy), which
    contracts it in fp32: then a tied embedding (it is the head) keeps its dtype too. Works on arrays
    (new buffers: the source may be donated afterwards) and on ``ShapeDtypeStruct``s (dry runs).
    """
    dtype = jnp.dtype(dtype)

    def convert(path, leaf):
        names = _names(path)
        cast = any(n in CAST_AT_USE for n in names) and not (reads_head and tied and "embed_tokens" in names)
        target = dtype if cast and jnp.issubdtype(leaf.dtype, jnp.floating) else leaf.dtype
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, target, sharding=leaf.sharding)
        return leaf.astype(target) if target != leaf.dtype else jnp.copy(leaf)

    return jax.tree_util.tree_map_with_path(convert, params)
