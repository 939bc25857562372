"""caper_jax.policy.sampling.decode: the one path from prompts to the policy's SQL."""
from __future__ import annotations

import logging

import pytest
from flax import nnx

from caper_jax.models import Qwen35ForCausalLM
from caper_jax.models.presets import model_preset
from caper_jax.policy import sampling

PROMPTS = [f"question {i}: how many singers are older than {20 + i}?" for i in range(5)]


@pytest.fixture(scope="module")
def policy():
    from caper_jax.data.tokenizer import build_demo_tokenizer

    corpus = PROMPTS + ["SELECT count(*) FROM singer WHERE age > 20", "SELECT name FROM singer ORDER BY age"]
    tokenizer = build_demo_tokenizer(None, vocab_size=300, corpus=corpus * 20)
    model = Qwen35ForCausalLM(model_preset("tiny", vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))
    return model, tokenizer


def _decode(policy, **kwargs):
    model, tokenizer = policy
    args = dict(stop_tokens=(tokenizer.eos_token_id,), max_prompt_len=32, max_new_tokens=6, batch_size=2)
    return sampling.decode(model, tokenizer, PROMPTS, **{**args, **kwargs})


def test_one_text_per_prompt_and_k_samples_each_whatever_the_batch_size(policy):
    greedy, samples = _decode(policy, k=3, temperature=1.0, seed=1)
    assert len(greedy) == len(PROMPTS) and [len(s) for s in samples] == [3] * len(PROMPTS)
    # Rows are independent (prompts padded to one length, the last batch padded with its last prompt),
    # so greedy text does not depend on how the prompts were batched.
    assert _decode(policy, batch_size=3)[0] == greedy
    assert _decode(policy, greedy=False, k=0) == ([], [[] for _ in PROMPTS])


def test_a_long_decode_reports_its_progress(policy, caplog, monkeypatch):
    monkeypatch.setattr(sampling, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO):
        _decode(policy)
    lines = [r.getMessage() for r in caplog.records if "decoding" in r.getMessage()]
    assert lines and lines[-1].startswith(f"decoding {len(PROMPTS)} prompts: batch 3/3"), lines
    assert "batches/s" in lines[-1] and "ETA" in lines[-1]


def test_without_a_pad_token_the_prompts_and_the_sampler_share_one_pad_id(policy, monkeypatch):
    """A tokenizer with no pad token pads the prompts with eos (``resolve_pad_id``); the sampler must be
    handed that same id for the rows it finishes, not 0."""
    import copy

    import jax.numpy as jnp
    import numpy as np

    from caper_jax.models.sampler import SampleOutput

    _, tokenizer = policy
    padless = copy.deepcopy(tokenizer)
    padless.pad_token = None
    assert padless.pad_token_id is None and padless.eos_token_id not in (None, 0)
    calls = []

    def recording_sampler(model, prompt_ids, prompt_mask, key, config):
        calls.append((np.asarray(prompt_ids), np.asarray(prompt_mask), config.pad_id))
        rows, new = prompt_ids.shape[0], config.max_new_tokens
        return SampleOutput(jnp.full((rows, new), config.pad_id, jnp.int32), jnp.zeros(rows, jnp.int32),
                            jnp.zeros((rows, new), jnp.float32))

    monkeypatch.setattr(sampling, "generate", recording_sampler)
    sampling.decode(None, padless, PROMPTS, stop_tokens=(padless.eos_token_id,), max_prompt_len=32, max_new_tokens=4,
                    batch_size=len(PROMPTS), k=2)
    assert len(calls) == 3   # greedy, then 2 x 5 samples in two batches
    for ids, mask, pad_id in calls:
        assert pad_id == padless.eos_token_id
        assert (mask == 0).any() and (ids[mask == 0] == pad_id).all()
