"""The Clause-PRM: a Qwen3.5 backbone and a scalar head read at clause-final tokens.

The PRM's input is ``prompt(question, schema) + preceding SQL + clause``; its score for the clause is
the head applied to the hidden state of the clause's last token. Because the backbone is causal, one
forward pass of a whole query scores every clause of it (gather at each clause end), and GRPO's
token-level baseline reads the head at every position.

The backbone is built without an LM head: the PRM never needs the 248k-vocabulary logits, and for the
untied 9B checkpoint that head alone is about 1B parameters (plus their Adam moments). The score head
is a bias-free ``[hidden] -> 1`` projection, exactly ``score.weight`` of transformers'
``Qwen3_5TextForSequenceClassification`` (num_labels=1), which is what the HF export writes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from caper_jax.models import Qwen35Config, Qwen35ForCausalLM


def backbone_config(config: Qwen35Config) -> Qwen35Config:
    """The same architecture without a separate LM head (the tie flag is what drops ``lm_head``)."""
    return config.replace(tie_word_embeddings=True)


class ClausePRM(nnx.Module):
    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, mesh=None, rules=None,
                 backbone: Qwen35ForCausalLM | None = None):
        """``backbone``: an already built (e.g. HF-loaded) model without LM head; default: random init."""
        self.config = config
        if backbone is None:
            backbone = Qwen35ForCausalLM(backbone_config(config), rngs=rngs, mesh=mesh, rules=rules)
        self.backbone = backbone
        init = nnx.initializers.normal(config.hidden_size ** -0.5)
        self.score_head = nnx.Param(init(rngs.params(), (config.hidden_size,), jnp.float32),
                                    out_sharding=("embed",), eager_sharding=False)

    def token_scores(self, input_ids: jax.Array, attention_mask: jax.Array, last: int | None = None) -> jax.Array:
        """fp32 score of every prefix (the value of the partial query ending at each token): [B, T], or
        [B, last] for the last ``last`` positions only (GRPO reads the completion's).

        The positions are taken from the compute-dtype hidden states first and only those meet the fp32
        head (fp32 products and accumulation): no [B, T, H] fp32 copy of the hidden states.
        """
        h = self.backbone.hidden_states(input_ids, attention_mask)
        if last is not None:
            h = h[:, h.shape[1] - last:]
        return jnp.einsum("bth,h->bt", h, self.score_head[...], preferred_element_type=jnp.float32)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, positions: jax.Array) -> jax.Array:
        """Scores at ``positions`` ([B] or [B, K] token indices; negative entries give 0)."""
        return self.scores_at(self.backbone.hidden_states(input_ids, attention_mask), positions)

    def scores_at(self, hidden: jax.Array, positions: jax.Array) -> jax.Array:
        """The head read from backbone ``hidden`` [B, T, H] at ``positions`` ([B] or [B, K]; < 0 gives 0).

        Only the gathered hidden states meet the head, so the cost past the backbone is O(B·K·H).
        """
        squeeze = positions.ndim == 1
        pos = positions[:, None] if squeeze else positions
        picked = jnp.take_along_axis(hidden, jnp.maximum(pos, 0)[..., None], axis=1)      # [B, K, H]
        scores = jnp.einsum("bkh,h->bk", picked.astype(jnp.float32), self.score_head[...])
        scores = jnp.where(pos >= 0, scores, 0.0)
        return scores[:, 0] if squeeze else scores
