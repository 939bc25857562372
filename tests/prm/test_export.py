"""Clause-PRM <-> Hugging Face, checked against transformers' PyTorch models.

* A PRM whose backbone is loaded from an untied HF Qwen3.5 checkpoint has the same backbone weights
  and no LM head.
* The exported PRM loads as ``Qwen3_5TextForSequenceClassification``, whose score at the last
  non-pad token equals caper_jax's clause score at that position.
"""
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from caper_jax.parallel.mesh import make_mesh
from caper_jax.parallel.rules import DEFAULT_RULES
from caper_jax.prm.export import export_prm_to_hf, load_prm_backbone
from tests.helpers import build_hf_model

PAD = 0


def test_backbone_from_hf_and_export_round_trip(tmp_path):
    hf_lm = build_hf_model("untied")
    hf_lm.save_pretrained(tmp_path / "lm")
    mesh = make_mesh((1, -1, 1))
    prm = load_prm_backbone(str(tmp_path / "lm"), mesh, DEFAULT_RULES, seed=3)
    assert not hasattr(prm.backbone, "lm_head")
    ours = np.asarray(prm.backbone.embed_tokens[...])
    np.testing.assert_array_equal(ours, hf_lm.model.embed_tokens.weight.detach().numpy())
    # A non-trivial head, so the comparison below is not 0 == 0.
    prm.score_head[...] = jnp.asarray(np.random.default_rng(0).normal(size=prm.config.hidden_size), jnp.float32)

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=__import__("tokenizers").Tokenizer(__import__("tokenizers").models.WordLevel(
            {f"t{i}": i for i in range(prm.config.vocab_size)}, unk_token="t1")), pad_token="t0")
    out = export_prm_to_hf(prm, tmp_path / "prm", tokenizer)
    hf_prm = transformers.Qwen3_5TextForSequenceClassification.from_pretrained(out).eval()
    assert hf_prm.config.num_labels == 1 and hf_prm.config.pad_token_id == PAD
    # transformers' class first, then the name under which vLLM serves it as a per-token pooling model
    assert hf_prm.config.architectures == ["Qwen3_5TextForSequenceClassification", "Qwen3_5ForSequenceClassification"]

    rng = np.random.default_rng(1)
    ids = rng.integers(1, prm.config.vocab_size, size=(2, 40)).astype(np.int32)
    lengths = [40, 27]
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = PAD                                   # right padding: HF reads the last non-pad token
    with torch.no_grad():
        theirs = hf_prm(input_ids=torch.tensor(ids, dtype=torch.long),
                        attention_mask=torch.tensor(mask)).logits[:, 0].numpy()
    every = np.asarray(nnx.jit(lambda m, i, k: m.token_scores(i, k))(prm, jnp.asarray(ids), jnp.asarray(mask)))
    mine = every[np.arange(2), np.asarray(lengths) - 1]
    assert np.abs(mine).max() > 0.1
    np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=1e-4)
    # And the clause-position API gives the same numbers.
    at = np.asarray(prm(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(np.asarray(lengths) - 1, np.int32)))
    # Same weights, two compiled programs (gather at positions vs all positions): XLA may fuse and
    # order the reductions differently, so agreement is to fp32 rounding of scores of order 1,
    # a few hundred eps = 1.2e-7 each (1e-6 was 8 eps: one processor's luck).
    np.testing.assert_allclose(at, mine, atol=1e-5, rtol=1e-5)
