"""Log-probabilities of given tokens without materialising the ``[B, T, V]`` logits.

With Qwen3.5's 248k vocabulary, fp32 logits for one 8 × 1024 micro-batch are 8 GB, and the backward
of a plain ``log_softmax`` keeps them (and a softmax of the same size) alive. Here the sequence is
cut into chunks of ``chunk_size`` positions and ``lax.map`` runs the head one chunk at a time; the
chunk function is wrapped in ``jax.checkpoint`` so the backward recomputes each chunk's logits
instead of saving them. Peak extra memory is then a few ``B · chunk_size · V`` fp32 buffers.

Chunks run along the sequence axis, not the flattened ``B·T`` axis, so a batch sharded over the
``data`` axis stays sharded inside each chunk. The head matmul accumulates in fp32
(``preferred_element_type``) whatever the parameter dtype; the log-sum-exp is fp32.

``sequence_logprobs`` (the confidence baseline) and ``completion_logprobs`` (GRPO's update and reference)
run the policy's forward and feed its final hidden states and head to ``token_logprobs``; SFT's loss
feeds them to ``token_logprobs`` itself, with the batch's own targets.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from caper_jax.models import Qwen35ForCausalLM

Array = jax.Array


def _chunk_logprobs(hidden: Array, targets: Array, head: Array, *, tied: bool, temperature: float,
                    with_entropy: bool) -> tuple[Array, Array | None]:
    """Log-prob of ``targets`` (and entropy) for one ``[B, C, H]`` chunk."""
    equation = "bch,vh->bcv" if tied else "bch,hv->bcv"
    logits = jnp.einsum(equation, hidden, head, preferred_element_type=jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    log_normaliser = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logp = target_logit - log_normaliser
    if not with_entropy:
        return logp, None
    probs = jnp.exp(logits - log_normaliser[..., None])
    return logp, log_normaliser - jnp.sum(probs * logits, axis=-1)


@functools.partial(jax.jit, static_argnames=("chunk_size", "tied", "temperature", "return_entropy"))
def token_logprobs(
    hidden: Array,
    lm_head_w: Array,
    targets: Array,
    chunk_size: int = 128,
    *,
    tied: bool = False,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Array | tuple[Array, Array]:
    """``log softmax(hidden @ W / temperature)[targets]``, fp32 ``[B, T]``, computed chunk by chunk.

    Args:
      hidden: ``[B, T, H]`` final hidden states (after the final norm).
      lm_head_w: ``[H, V]`` output projection, or the ``[V, H]`` embedding table when ``tied``.
      targets: ``[B, T]`` int token ids whose log-probs are wanted (the next tokens).
      chunk_size: sequence positions per chunk (static); T need not be a multiple (padded).
      tied: ``lm_head_w`` is the ``[V, H]`` input embedding (tie_word_embeddings).
      temperature: the sampling temperature, so that log-probs match the sampling distribution.
      return_entropy: also return the ``[B, T]`` entropy of the (tempered) distribution.
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden {hidden.shape} must be [B, T, H] and targets {targets.shape} [B, T]")
    layout = "[V, H]" if tied else "[H, V]"
    if lm_head_w.ndim != 2 or lm_head_w.shape[1 if tied else 0] != hidden.shape[2]:
        raise ValueError(f"lm_head_w {lm_head_w.shape} must be {layout} with H = {hidden.shape[2]}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")

    batch, length, width = hidden.shape
    chunk_size = min(chunk_size, length)
    chunks = -(-length // chunk_size)
    padding = chunks * chunk_size - length
    if padding:
        hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padding)))
    # [B, n·C, ...] -> [n, B, C, ...]: lax.map walks the leading chunk axis, the batch axis stays put.
    hidden = hidden.reshape(batch, chunks, chunk_size, width).swapaxes(0, 1)
    targets = targets.reshape(batch, chunks, chunk_size).swapaxes(0, 1)

    # prevent_cse=False: inside a scan the remat cannot be CSE'd away anyway (jax.checkpoint docs).
    per_chunk = jax.checkpoint(functools.partial(
        _chunk_logprobs, head=lm_head_w, tied=tied, temperature=temperature,
        with_entropy=return_entropy), prevent_cse=False)
    logp, entropy = jax.lax.map(lambda xs: per_chunk(*xs), (hidden, targets))

    def unchunk(values: Array) -> Array:
        return values.swapaxes(0, 1).reshape(batch, chunks * chunk_size)[:, :length]

    if return_entropy:
        return unchunk(logp), unchunk(entropy)
    return unchunk(logp)


def lm_head(model: Qwen35ForCausalLM) -> tuple[jax.Array, bool]:
    """(output projection, tied): the ``[V, H]`` embedding when tied, else the ``[H, V]`` lm_head."""
    if model.config.tie_word_embeddings:
        return model.embed_tokens[...], True
    return model.lm_head[...], False


def sequence_logprobs(model: Qwen35ForCausalLM, input_ids: jax.Array, attention_mask: jax.Array, *,
                      start: int = 0, temperature: float = 1.0, chunk_size: int = 128,
                      return_entropy: bool = False):
    """log p(ids[t] | ids[:t]) for t in ``[start + 1, T)`` -> ``[B, T - start - 1]`` (and entropy)."""
    hidden = model.hidden_states(input_ids, attention_mask)[:, start:-1]
    head, tied = lm_head(model)
    return token_logprobs(hidden, head, input_ids[:, start + 1:], chunk_size, tied=tied,
                          temperature=temperature, return_entropy=return_entropy)


def completion_logprobs(params, input_ids, attention_mask, *, graphdef, completion_len: int,
                        temperature: float, chunk_size: int, return_entropy: bool = False):
    """Log-probs ``[B, N]`` of the last ``completion_len`` tokens under the (tempered) policy."""
    start = input_ids.shape[1] - completion_len - 1
    return sequence_logprobs(nnx.merge(graphdef, params), input_ids, attention_mask, start=start,
                             temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy)
