"""Named model sizes the configs refer to (``config.model.preset``).

``tiny`` is the built-in demo backbone: the full Qwen3.5 layout (3 DeltaNet + 1 gated attention
layer, partial RoPE, GQA) at a size that trains in minutes on 2 CPU cores. ``small`` is the ~58M
benchmark config of bench/model.py. ``qwen35_9b`` is the released text model; for real weights
load its config.json instead (``from_hf``), since θ and tying are read from the checkpoint.
"""
from __future__ import annotations

from caper_jax.models.config import Qwen35Config

PRESETS = ("tiny", "small", "qwen35_9b")


def model_preset(name: str, vocab_size: int | None = None, **runtime) -> Qwen35Config:
    """The named architecture; ``vocab_size`` overrides (the demo tokenizer's size), ``runtime`` sets
    dtype, param_dtype, remat."""
    if name == "tiny":
        config = Qwen35Config.tiny(
            hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=True,
            # Delta-rule chunks of 32 (not 64) for 32-wide heads: the policy's train step at the GRPO
            # update's 32 x 256 batch, 1.11/1.19 s -> 0.94/1.02 s on 2 CPU cores (BENCHMARKS.md); the
            # 64-wide heads of `small` are not faster at 32, so the default stays 64.
            chunk_size=32)
    elif name == "small":
        config = Qwen35Config(
            vocab_size=32_000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
            linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
            tie_word_embeddings=True, max_position_embeddings=4096)
    elif name == "qwen35_9b":
        config = Qwen35Config.qwen35_9b()
    else:
        raise ValueError(f"unknown model preset {name!r}; known: {PRESETS}")
    changes = dict(runtime)
    if vocab_size is not None:
        changes["vocab_size"] = vocab_size
    return config.replace(**changes) if changes else config
