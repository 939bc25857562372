"""Qwen3.5 text model in Flax NNX, with transformers-compatible safetensors import/export."""

from caper_jax.models.config import ConfigError, Qwen35Config, qwen35_9b
from caper_jax.models.qwen35 import Qwen35Cache, Qwen35ForCausalLM

__all__ = ["ConfigError", "Qwen35Cache", "Qwen35Config", "Qwen35ForCausalLM", "from_hf", "qwen35_9b", "to_hf"]


def __getattr__(name: str):
    # hf_io pulls in safetensors and the checkpoint plumbing; import it on first use only.
    if name in ("from_hf", "to_hf"):
        from caper_jax.models import hf_io

        return getattr(hf_io, name)
    raise AttributeError(name)
