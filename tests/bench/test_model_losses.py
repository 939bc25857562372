"""bench/model.py's two train-step losses compute the same function: full logits then cross-entropy
(transformers' labels= loss) and the trainers' chunked log-probs (policy.logprobs.sequence_logprobs)."""
import jax
import numpy as np
import pytest
from flax import nnx

from caper_jax.models import Qwen35ForCausalLM
from caper_jax.models.presets import model_preset


@pytest.mark.slow   # an end-to-end run or a large compile: CI runs it, `-m "not slow"` skips it
def test_chunked_and_full_logits_losses_agree_with_a_naive_cross_entropy():
    from bench.model import make_train_step

    model = Qwen35ForCausalLM(model_preset("tiny", vocab_size=300), rngs=nnx.Rngs(0))
    ids = jax.numpy.asarray(np.random.default_rng(0).integers(0, 300, (2, 40), dtype=np.int32))
    # Independent reference: per-position cross-entropy written out with numpy from the logits.
    logits = np.asarray(model(ids), np.float64)[:, :-1]
    targets = np.asarray(ids)[:, 1:]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    naive = -np.take_along_axis(log_probs, targets[..., None], -1).mean()

    results = {}
    for loss in ("logits", "chunked"):
        step, state = make_train_step(model, loss, chunk_size=16)   # 39 positions: 3 chunks, one ragged
        value, grads = step(state, ids)
        results[loss] = (float(value), jax.tree.leaves(grads))
        assert float(value) == pytest.approx(naive, rel=1e-5)   # fp32 sums of ~300 terms: ~1e-6 relative
    for a, b in zip(results["logits"][1], results["chunked"][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)   # same math, other fp32 summation order
    with pytest.raises(ValueError, match="expected one of"):
        make_train_step(model, "fused")
