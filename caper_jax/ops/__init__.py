"""Sequence-mixing kernels written in plain JAX (gated delta rule, causal depthwise conv)."""

from caper_jax.ops.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
    recurrent_gated_delta_rule,
)

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "gated_delta_step", "l2_normalize", "recurrent_gated_delta_rule"]
