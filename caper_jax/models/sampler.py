"""Batched autoregressive sampling: one jitted prefill, then a ``lax.while_loop`` of decode steps.

Design:
  * Two compiled programs. ``prefill`` (prompt → first-token logits + cache) recompiles per prompt
    length bucket; ``decode`` (the whole generation loop) compiles once per (batch, cache length,
    sampling config) and takes the cache *donated*, so the KV cache and DeltaNet states are updated in
    place and never copied.
  * On the CPU ``generate`` first cuts the stacked layer weights into one copy per group
    (``Qwen35ForCausalLM.layer_groups``, a program of its own) that the prefill and every decode step
    read in place, and the cache is one buffer per layer (``Qwen35Cache.per_group``) from the prefill
    to the end, updated in place; scanning the stacked weights made XLA:CPU copy each group's slice
    out at every token (and once more in the prefill), and a stacked cache made it copy every state
    out and back (``SamplingConfig.copy_layer_weights``).
  * ``generate(..., group_size=G)`` (GRPO's groups) prefills each distinct prompt once and repeats
    its first-token logits, KV cache and DeltaNet conv / recurrent states to G consecutive rows inside
    the prefill program, before the decode loop: the prefill's FLOPs are those of the P prompts, not
    of the P × G rows, and the samples are those of the repeated prompts (the row keys are split
    over the P × G rows either way; docs/grpo.md for when the log-probs are equal bit for bit).
  * The loop is a ``lax.while_loop`` that exits as soon as every sequence has emitted a stop token,
    so short answers cost short time; ``max_new_tokens`` bounds it.
  * Sequences finish independently (done mask). After its stop token a sequence emits ``pad_id``
    with log-prob 0; ``lengths`` counts generated tokens *including* the stop token.

PRNG contract (fixed, so samples are reproducible and independent of batch composition):
  ``row_keys = jax.random.split(key, B)``; the token at output position ``t`` of row ``b`` is drawn
  with ``jax.random.fold_in(row_keys[b], t)``. Same key and prompts → same samples, and row ``b``'s
  samples do not depend on the other rows. Greedy decoding (``temperature == 0``) ignores the key.

Filtering order: temperature, then top-k, then top-p (nucleus, on the top-k survivors), then a
categorical draw. ``log_probs`` are the log-probabilities of the sampled tokens under the *tempered,
unfiltered* model distribution ``log_softmax(logits / T)`` (``T = 1`` for greedy) — the quantity
``caper_jax.policy.logprobs.token_logprobs(..., temperature=T)`` recomputes, so GRPO's importance ratio
starts at exactly 1 for on-policy samples. Truncation by top-k/top-p is not part of it, as is usual
in GRPO/PPO implementations (the ratio would otherwise be undefined for tokens outside the nucleus).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from caper_jax.models.config import on_cpu_unless


class SamplingError(ValueError):
    """Invalid sampling arguments."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling options (hashable: part of the decode program's compile key)."""

    max_new_tokens: int
    temperature: float = 1.0      # 0 → greedy (argmax)
    top_k: int = 0                # 0 → no top-k filter
    top_p: float = 1.0            # 1 → no nucleus filter
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0
    cache_dtype: str = "float32"  # KV-cache dtype (the model keeps DeltaNet states in fp32)
    # Cut the stacked layer weights into per-group copies once per generate() call, read in place by
    # the prefill and the decode loop (one more copy of the layer weights while they run), instead
    # of XLA slicing them out at every token: None = on the CPU only, where the per-token copies were
    # 26 % of a decode (BENCHMARKS.md); accelerators read a scanned slice in place.
    copy_layer_weights: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")


class SampleOutput(NamedTuple):
    tokens: jax.Array     # int32 [B, max_new_tokens]; pad_id after a sequence's stop token
    lengths: jax.Array    # int32 [B]; generated tokens including the stop token
    log_probs: jax.Array  # float32 [B, max_new_tokens]; 0 after the end


def _filtered_logits(logits: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array | None]:
    """(candidate logits [B, K], their token ids [B, K] or None for the full vocabulary)."""
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    k = config.top_k if 0 < config.top_k < vocab else (vocab if config.top_p < 1.0 else 0)
    if not k:
        return logits, None
    values, ids = jax.lax.top_k(logits, k)  # sorted, descending
    if config.top_p < 1.0:
        probs = jax.nn.softmax(values, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        values = jnp.where(mass_before < config.top_p, values, -jnp.inf)  # keeps the top token
    return values, ids


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first maximum; a NaN counts as the maximum) as two plain reductions.

    XLA:CPU runs argmax's (value, index) reduction as a scalar loop: [8, 32000] fp32 takes 0.63 ms
    against 0.18-0.21 ms for this max-then-first-index form, [8, 248320] (Qwen3.5's vocabulary)
    4.7 ms against 0.8-1.1 ms (BENCHMARKS.md). On accelerators the second pass over the logits is
    negligible beside the step's matmuls, so there is one code path.
    """
    vocab = x.shape[-1]
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    # XLA:CPU's max reduction does not propagate NaN, so NaNs get their own rank: index - vocab,
    # below every maximum's index, and the one min picks the first NaN if a row has any.
    rank = jnp.where(x == jnp.max(x, axis=-1, keepdims=True), index, vocab)
    first = jnp.min(jnp.where(jnp.isnan(x), index - vocab, rank), axis=-1)
    return jnp.where(first < 0, first + vocab, first)


def gumbel_categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.random.categorical(key, logits)`` for one row [V]: the same Gumbel-max draw (same
    noise, so the same samples), its argmax by ``first_argmax``."""
    return first_argmax(logits + jax.random.gumbel(key, logits.shape, logits.dtype))


def select_tokens(
    logits: jax.Array, row_keys: jax.Array, step: jax.Array, config: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Sampled token ids [B] and their log-probs [B] from fp32 logits [B, V] (contract: module doc)."""
    logits = logits.astype(jnp.float32)
    if config.temperature == 0.0:
        tokens = first_argmax(logits)
    else:
        candidates, ids = _filtered_logits(logits, config)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
        choice = jax.vmap(gumbel_categorical)(step_keys, candidates)
        tokens = choice if ids is None else jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
        logits = logits / config.temperature
    tokens = tokens.astype(jnp.int32)
    # The sampled token's logit minus the log-normaliser, as token_logprobs computes it, rather than a
    # whole [B, V] log_softmax written out to read B values of it.
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - jax.nn.logsumexp(logits, axis=-1)


def _last_logits(logits: jax.Array) -> jax.Array:
    return logits[:, -1] if logits.ndim == 3 else logits


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _cut_layer_groups(graphdef, state) -> list[nnx.State]:
    return nnx.merge(graphdef, state).layer_groups()


def prefill_group_size(prompts: int, group_size: int, batch_shards: int) -> int:
    """How many of a prompt's ``group_size`` rows share one prefill: the largest divisor k of ``group_size``
    whose prefilled rows, ``prompts × group_size / k``, split evenly over the ``batch_shards`` the mesh splits
    a batch into (1 if none does). Fewer prefilled rows than shards would leave the prefill replicated, every
    chip computing every prompt (32 prompts on a 64-chip v6e: 8× a chip's share, and a replicated cache)."""
    for k in sorted((d for d in range(1, group_size + 1) if group_size % d == 0), reverse=True):
        if prompts * (group_size // k) % batch_shards == 0:
            return k
    return 1


def repeat_rows(first_logits: jax.Array, cache, group_size: int):
    """Each prompt's first-token logits and cache repeated to ``group_size`` consecutive rows
    (row ``p * group_size + i`` continues prompt ``p``), in the cache's layout (``Qwen35Cache``):
    the layer blocks' batch axis is 1 when stacked over groups ([G, B, ...]) and 0 per group; the
    rows' ``positions`` and ``valid`` lead with it; the slot ``index`` is shared by every row."""
    if group_size == 1:
        return first_logits, cache

    def rows(x: jax.Array, axis: int = 0) -> jax.Array:
        return jnp.repeat(x, group_size, axis=axis)

    block_axis = 0 if cache.grouped else 1
    return rows(first_logits), cache.replace(blocks=jax.tree.map(lambda x: rows(x, block_axis), cache.blocks),
                                             positions=rows(cache.positions), valid=rows(cache.valid))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "cache_dtype", "group_size"))
def _prefill(graphdef, state, prompt_ids, prompt_mask, layer_groups=None, *, max_len: int, cache_dtype: str,
             group_size: int = 1):
    """First-token logits and the cache; with ``layer_groups`` the cache comes out per group. The
    prompts [P, T] are read once and their logits and cache leave repeated to P × ``group_size``
    rows (``repeat_rows``): a GRPO group's G completions share one prefill."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(prompt_ids.shape[0], max_len, jnp.dtype(cache_dtype))
    if layer_groups is not None:
        cache = cache.per_group()
    logits, cache = model.prefill(prompt_ids, prompt_mask, cache, layer_groups)
    return repeat_rows(_last_logits(logits).astype(jnp.float32), cache, group_size)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("cache",))
def _decode(graphdef, state, first_logits, cache, row_keys, layer_groups=None, *, config: SamplingConfig):
    """The generation loop. ``layer_groups`` (``_cut_layer_groups``, with the per-group cache
    ``_prefill`` wrote from them) are loop-invariant inputs of the while that every step reads in
    place; without them every step scans the stacked weights. Returns the cache in its layout."""
    model = nnx.merge(graphdef, state)
    batch = first_logits.shape[0]
    stop = jnp.asarray(config.stop_tokens or (-1,), jnp.int32)
    tokens0, log_probs0 = select_tokens(first_logits, row_keys, jnp.int32(0), config)
    done0 = jnp.isin(tokens0, stop)
    out_tokens = jnp.full((batch, config.max_new_tokens), config.pad_id, jnp.int32).at[:, 0].set(tokens0)
    out_log_probs = jnp.zeros((batch, config.max_new_tokens), jnp.float32).at[:, 0].set(log_probs0)
    lengths = jnp.ones((batch,), jnp.int32)

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        step, _, _, done, *_ = carry
        return (step < config.max_new_tokens) & ~jnp.all(done)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        step, cache, previous, done, out_tokens, out_log_probs, lengths = carry
        logits, cache = model.decode_step(previous, cache, layer_groups)
        tokens, log_probs = select_tokens(_last_logits(logits), row_keys, step, config)
        tokens = jnp.where(done, config.pad_id, tokens)
        log_probs = jnp.where(done, 0.0, log_probs)
        out_tokens = jax.lax.dynamic_update_index_in_dim(out_tokens, tokens, step, axis=1)
        out_log_probs = jax.lax.dynamic_update_index_in_dim(out_log_probs, log_probs, step, axis=1)
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(tokens, stop)
        return step + 1, cache, tokens, done, out_tokens, out_log_probs, lengths

    carry = (jnp.int32(1), cache, tokens0, done0, out_tokens, out_log_probs, lengths)
    _, cache, _, _, out_tokens, out_log_probs, lengths = jax.lax.while_loop(cond, body, carry)
    # Returning the cache lets the donated input buffers alias the loop's carry (updated in place).
    return SampleOutput(out_tokens, lengths, out_log_probs), cache


def generate(
    model: nnx.Module,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    config: SamplingConfig,
    group_size: int = 1,
) -> SampleOutput:
    """Samples ``config.max_new_tokens`` continuations of left-padded prompts, ``group_size`` per prompt.

    Args:
      model: a ``Qwen35ForCausalLM`` (anything with ``init_cache`` / ``prefill`` / ``decode_step``, and
        ``layer_groups`` where ``config.copy_layer_weights`` resolves to True).
      prompt_ids: int32 [B, P], left-padded.
      prompt_mask: [B, P], 1 on prompt tokens, 0 on left padding.
      key: a PRNG key (see the module docstring for how it is split).
      config: sampling options.
      group_size: completions per prompt. The output has B = P × ``group_size`` rows, rows
        ``p * group_size`` to ``(p + 1) * group_size - 1`` continuing prompt ``p``; the prompts are
        prefilled once and the cache repeated (``_prefill``). Same samples as ``group_size = 1`` on
        the prompts repeated row by row (``np.repeat(prompt_ids, group_size, axis=0)``): the row keys
        are split over the B output rows either way.
    """
    if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
        raise SamplingError(f"prompt_ids {prompt_ids.shape} and prompt_mask {prompt_mask.shape} must be equal [B, P]")
    if group_size < 1:
        raise SamplingError(f"group_size must be >= 1, got {group_size}")
    graphdef, state = nnx.split(model)
    max_len = prompt_ids.shape[1] + config.max_new_tokens
    layer_groups = _cut_layer_groups(graphdef, state) if on_cpu_unless(config.copy_layer_weights) else None
    first_logits, cache = _prefill(
        graphdef, state, prompt_ids, prompt_mask, layer_groups, max_len=max_len, cache_dtype=config.cache_dtype,
        group_size=group_size,
    )
    row_keys = jax.random.split(key, first_logits.shape[0])
    output, _ = _decode(graphdef, state, first_logits, cache, row_keys, layer_groups, config=config)
    return output
