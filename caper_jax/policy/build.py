"""A fresh policy for a trainer: HF weights or a random preset, created directly in its sharded layout."""
from __future__ import annotations

from flax import nnx

from caper_jax.models import Qwen35ForCausalLM
from caper_jax.models.presets import model_preset
from caper_jax.parallel import rules as rules_lib
from caper_jax.runs import check_vocab


def build_policy(model_cfg, vocab_size: int, seed: int, mesh, rules) -> Qwen35ForCausalLM:
    """A policy created in its sharded layout: HF weights when ``model_cfg.hf_dir``, else a random preset."""
    runtime = dict(dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype, remat=model_cfg.remat)
    if model_cfg.hf_dir:
        from caper_jax.models import from_hf  # hf_io (safetensors) loads on first use: models.__getattr__

        runtime.pop("dtype")
        model, _ = from_hf(model_cfg.hf_dir, dtype=model_cfg.dtype, mesh=mesh, rules=rules, **runtime)
        check_vocab(model_cfg.hf_dir, model.config.vocab_size, vocab_size)
        return model
    config = model_preset(model_cfg.preset, vocab_size=vocab_size, **runtime)
    return rules_lib.create_sharded(
        lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(seed), mesh=mesh, rules=rules), mesh, rules)
