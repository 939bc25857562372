"""Helpers shared by the SFT and GRPO trainer tests (tests/sft, tests/policy/test_rollout.py, tests/rl/test_trainer.py)."""
from __future__ import annotations

import contextlib
import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SPECIALS = ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Multi-character tokens, merged in this priority. "e F" straddles the SELECT/FROM boundary of
# "SELECT name FROM ...", so that clause ends INSIDE a token.
WORDS = ("SELECT", "e F", "WHERE", " FROM", "na", "<|im", "user", "Question")


def hand_tokenizer():
    """A char-level BPE with a few hand-written merges (ASCII only), ``<|im_end|>`` as stop/eos token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {s: i for i, s in enumerate(SPECIALS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in WORDS:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                merges.append((word[: i - 1], word[i - 1]))
                vocab[word[:i]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>")


def random_policy(vocab_size: int, seed: int = 0, scale: float = 0.05):
    """The tiny Qwen3.5 (tied embeddings) with N(0, scale) weights drawn by numpy: no init program."""
    from caper_jax.models import Qwen35Config, Qwen35ForCausalLM

    config = Qwen35Config.tiny(vocab_size=vocab_size, tie_word_embeddings=True)
    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, scale, x.shape), x.dtype), nnx.state(model))
    nnx.update(model, state)
    return model


@contextlib.contextmanager
def persistent_compile_cache(directory):
    """XLA's on-disk compilation cache for a block, every program kept however quick its compile:
    reruns of a training loop in one test (run, then resume) compile the same programs, and the rerun
    then loads them instead of compiling again. The test session's cache (tests/conftest.py) is used
    when there is one, so a second session loads them too; ``directory`` otherwise."""
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", old["jax_compilation_cache_dir"] or str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
