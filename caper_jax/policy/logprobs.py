"""Log-probabilities of given tokens without materialising the ``[B, T, V]`` logits.

With Qwen3.5's 248k vocabulary, fp32 logits for one 8 × 1024 micro-batch are 8 GB, and the backward
of a plain ``log_softmax`` keeps them (and a softmax of the same size) alive. Here the sequence is
cut into chunks of ``chunk_size`` positions and ``lax.map`` runs the head one chunk at a time. The
backward is written by hand (a ``custom_vjp`` over all chunks): it recomputes each chunk's logits
instead of saving them, forms their cotangent in closed form and accumulates the head's gradient
chunk by chunk. Peak extra memory is then a few ``B · chunk_size · V`` fp32 buffers.

Where the whole fp32 logits are small (at most ``keep_logits_bytes``, 1 GiB by default: a small
vocabulary, or a short batch), the forward computes them as one GEMM and keeps them, and the backward
reads them chunk by chunk instead of recomputing them: one of the head's four GEMMs fewer (on the
32k-vocabulary bench config the head 20 % faster, the trainers' whole step 4-5 %; BENCHMARKS.md).
The 9B model's 248k vocabulary is far above the bound and recomputes. The bound is on the global
(unsharded) logits, so a sharded batch keeps less than it per device.

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


def _chunk_logits(hidden: Array, head: Array, tied: bool, temperature: float) -> Array:
    """fp32 ``[..., V]`` logits of ``[..., H]`` hidden states (a chunk, or all), divided by the temperature."""
    equation = "...h,vh->...v" if tied else "...h,hv->...v"
    logits = jnp.einsum(equation, hidden, head, preferred_element_type=jnp.float32)
    return logits / temperature if temperature != 1.0 else logits


def _chunk_forward(logits: Array, targets: Array, with_entropy: bool) -> tuple[Array, Array, Array | None]:
    """(log-prob of ``targets``, log-normaliser, entropy or None) from ``[..., V]`` logits."""
    log_normaliser = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_normaliser
    if not with_entropy:
        return logp, log_normaliser, None
    probs = jnp.exp(logits - log_normaliser[..., None])
    return logp, log_normaliser, log_normaliser - jnp.sum(probs * logits, axis=-1)


# The head and its loss as one custom VJP over all chunks, rather than autodiff of a checkpointed
# chunk function: the backward recomputes each chunk's logits once, forms the logit cotangent
# in closed form and feeds it straight to the two GEMMs, accumulating the head's gradient in the
# scan's carry. On CPU that is 1.6x faster than XLA's autodiff of the same chunked function
# (BENCHMARKS.md, "Fused head and cross-entropy"), and the residuals are what remat kept: the chunks'
# inputs and one log-normaliser per position, plus the chunks' logits when ``keep_logits`` (then
# the backward reads them instead of recomputing them).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_logprobs(hidden: Array, head: Array, targets: Array, tied: bool, temperature: float,
                      with_entropy: bool, keep_logits: bool) -> tuple[Array, Array | None]:
    """``[n, B, C]`` log-probs (and entropies) of ``[n, B, C, H]`` chunked hidden states."""
    return _chunked_logprobs_fwd(hidden, head, targets, tied, temperature, with_entropy, keep_logits)[0]


def _chunked_logprobs_fwd(hidden, head, targets, tied, temperature, with_entropy, keep_logits):
    if keep_logits:
        # All chunks' logits as one GEMM, kept whole: a lax.map would zero-fill the stacked buffer and
        # copy each chunk into it (bench config: 67 ms of a 4.1 s step), and the reductions fuse anyway.
        logits = _chunk_logits(hidden, head, tied, temperature)
        logp, log_normaliser, entropy = _chunk_forward(logits, targets, with_entropy)
    else:
        logits = None
        logp, log_normaliser, entropy = jax.lax.map(
            lambda xs: _chunk_forward(_chunk_logits(xs[0], head, tied, temperature), xs[1], with_entropy),
            (hidden, targets))
    return (logp, entropy), (hidden, head, targets, log_normaliser, entropy, logits)


def _chunked_logprobs_bwd(tied, temperature, with_entropy, keep_logits, residuals, cotangents):
    hidden, head, targets, log_normaliser, entropy, kept_logits = residuals
    logp_ct, entropy_ct = cotangents

    def chunk_backward(head_grad, xs):
        hidden_c, targets_c, log_normaliser_c, entropy_c, logp_ct_c, entropy_ct_c, kept_c = xs
        logits = kept_c if keep_logits else _chunk_logits(hidden_c, head, tied, temperature)
        log_probs = logits - log_normaliser_c[..., None]
        probs = jnp.exp(log_probs)
        # d log p[y] / d z = onehot(y) - p
        logits_ct = (jax.nn.one_hot(targets_c, logits.shape[-1], dtype=probs.dtype) - probs) * logp_ct_c[..., None]
        if with_entropy:  # d H / d z_j = -p_j (log p_j + H)
            logits_ct -= (probs * (log_probs + entropy_c[..., None])) * entropy_ct_c[..., None]
        if temperature != 1.0:
            logits_ct = logits_ct / temperature
        logits_ct = logits_ct.astype(head.dtype)
        equation = "bcv,vh->bch" if tied else "bcv,hv->bch"   # tied: logits = h @ W^T, W [V, H]
        hidden_ct = jnp.einsum(equation, logits_ct, head, preferred_element_type=jnp.float32)
        # The head's gradient as [H, V] = h^T @ dz in both layouts: the [V, H] form (dz^T @ h) made
        # XLA:CPU write dz transposed every chunk (a strided B·C·V copy), 20-25 % of a tied
        # miniature-policy head step (BENCHMARKS.md); transposing the [H, V] sum once is cheap.
        step_grad = jnp.einsum("bch,bcv->hv", hidden_c, logits_ct, preferred_element_type=jnp.float32)
        return head_grad + step_grad, hidden_ct.astype(hidden_c.dtype)

    if not with_entropy:  # placeholders the scan can carry; chunk_backward does not read them
        entropy = entropy_ct = jnp.zeros_like(log_normaliser)
    width, vocab = hidden.shape[-1], head.shape[0 if tied else 1]
    head_grad, hidden_ct = jax.lax.scan(
        chunk_backward, jnp.zeros((width, vocab), jnp.float32),
        (hidden, targets, log_normaliser, entropy, logp_ct, entropy_ct, kept_logits))
    return hidden_ct, (head_grad.T if tied else head_grad).astype(head.dtype), None


_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)


KEEP_LOGITS_BYTES = 1 << 30  # token_logprobs' default bound on the fp32 logits kept for the backward


@functools.partial(jax.jit, static_argnames=("chunk_size", "tied", "temperature", "return_entropy",
                                             "keep_logits_bytes"))
def token_logprobs(
    hidden: Array,
    lm_head_w: Array,
    targets: Array,
    chunk_size: int = 128,
    *,
    tied: bool = False,
    temperature: float = 1.0,
    return_entropy: bool = False,
    keep_logits_bytes: int = KEEP_LOGITS_BYTES,
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
      keep_logits_bytes: keep the chunks' fp32 logits for the backward (one GEMM fewer) when all of
        them together, padding included, take at most this many bytes; 0 always recomputes them.
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

    vocab = lm_head_w.shape[0 if tied else 1]
    keep_logits = chunks * batch * chunk_size * vocab * 4 <= keep_logits_bytes
    logp, entropy = _chunked_logprobs(hidden, lm_head_w, targets, tied, float(temperature), return_entropy,
                                      keep_logits)

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
