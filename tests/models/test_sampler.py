"""Sampler vs an independent reference: a plain Python loop over *full forward* passes.

The reference never touches the cache: it keeps each row's tokens right-padded in a fixed buffer,
runs ``model(buffer)`` (causal, so the padding after a row's end cannot affect its logits), and reads
the logits at the row's last real position. Greedy decoding must reproduce its argmax path, and the
sampler's log-probs must equal ``log_softmax`` of those logits at the sampled tokens.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from caper_jax.models import Qwen35Config, Qwen35ForCausalLM
from caper_jax.models.sampler import SamplingConfig, SamplingError, first_argmax, generate, gumbel_categorical

MAX_NEW = 6
# cached decode vs full forward, fp32 (chunked vs recurrent DeltaNet form): log-probs of order 10
# carry ~10 * eps of rounding per op; ~20 such steps of difference bound it by 2e-5.
LOGPROB_ATOL = 2e-5
NUCLEUS = SamplingConfig(MAX_NEW, temperature=0.7, top_p=0.3)


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen3.5 with N(0, 0.05) weights drawn by numpy (no init program to compile)."""
    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(Qwen35Config.tiny(), rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.05, x.shape), x.dtype), nnx.state(model))
    nnx.update(model, state)
    return model


@pytest.fixture(scope="module")
def prompts():
    """Three left-padded prompts of lengths 5, 7, 3 (pad id 0) and their rows without padding."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 256, n).tolist() for n in (5, 7, 3)]
    width = max(map(len, rows))
    ids = np.array([[0] * (width - len(r)) + r for r in rows], np.int32)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int32)
    return jnp.asarray(ids), jnp.asarray(mask), rows


@pytest.fixture(scope="module")
def full_forward(model):
    return jax.jit(lambda ids: jax.nn.log_softmax(model(ids), axis=-1))


def reference_log_probs(full_forward, rows, generated, temperature=1.0):
    """Per-step [B, n, V] log_softmax(logits / T) from full forwards over prompt + generated[:t]."""
    n = generated.shape[1]
    width = max(map(len, rows)) + MAX_NEW  # one buffer width for every call: one compile
    buffer = np.zeros((len(rows), width), np.int32)
    for b, row in enumerate(rows):
        buffer[b, : len(row)] = row
        buffer[b, len(row) : len(row) + n] = generated[b]
    logits = np.asarray(full_forward(jnp.asarray(buffer)), np.float64)  # log-probs at T = 1
    out = np.stack([logits[b, len(row) - 1 : len(row) - 1 + n] for b, row in enumerate(rows)])
    if temperature != 1.0:
        out = out / temperature
        out = out - np.log(np.exp(out - out.max(-1, keepdims=True)).sum(-1, keepdims=True)) - out.max(-1, keepdims=True)
    return out


def naive_greedy(full_forward, rows, steps):
    generated = np.zeros((len(rows), 0), np.int32)
    for _ in range(steps):
        padded = np.concatenate([generated, np.zeros((len(rows), 1), np.int32)], axis=1)
        log_probs = reference_log_probs(full_forward, rows, padded)
        generated = np.concatenate([generated, log_probs[:, -1].argmax(-1)[:, None].astype(np.int32)], axis=1)
    return generated


@pytest.fixture(scope="module")
def greedy(model, prompts):
    ids, mask, _ = prompts
    return generate(model, ids, mask, jax.random.key(0), SamplingConfig(MAX_NEW, temperature=0.0))


def test_greedy_equals_python_loop_over_full_forward(greedy, prompts, full_forward):
    _, _, rows = prompts
    np.testing.assert_array_equal(np.asarray(greedy.tokens), naive_greedy(full_forward, rows, MAX_NEW))
    np.testing.assert_array_equal(np.asarray(greedy.lengths), [MAX_NEW] * 3)


def test_greedy_log_probs_match_full_forward(greedy, prompts, full_forward):
    tokens = np.asarray(greedy.tokens)
    reference = reference_log_probs(full_forward, prompts[2], tokens)
    expected = np.take_along_axis(reference, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(greedy.log_probs), expected, atol=LOGPROB_ATOL)


def test_scanned_and_copied_layer_weights_decode_alike(model, prompts, full_forward):
    """The CPU's decode (layer weights cut per group once) and the accelerators' (the scan's slices)
    give the reference's greedy path and the same samples."""
    ids, mask, rows = prompts
    reference = naive_greedy(full_forward, rows, MAX_NEW)
    outputs = {}
    for copy in (False, True):
        greedy = generate(model, ids, mask, jax.random.key(0),
                          SamplingConfig(MAX_NEW, temperature=0.0, copy_layer_weights=copy))
        np.testing.assert_array_equal(np.asarray(greedy.tokens), reference)
        sampled = generate(model, ids, mask, jax.random.key(3),
                           SamplingConfig(MAX_NEW, temperature=0.7, top_p=0.3, copy_layer_weights=copy))
        outputs[copy] = (greedy, sampled)
    for scanned, copied in zip(outputs[False], outputs[True]):
        np.testing.assert_array_equal(np.asarray(scanned.tokens), np.asarray(copied.tokens))
        np.testing.assert_allclose(np.asarray(scanned.log_probs), np.asarray(copied.log_probs), atol=LOGPROB_ATOL)


def test_sampled_log_probs_and_top_p_support_match_full_forward(model, prompts, full_forward):
    ids, mask, rows = prompts
    out = generate(model, ids, mask, jax.random.key(1), NUCLEUS)
    tokens = np.asarray(out.tokens)
    reference = reference_log_probs(full_forward, rows, tokens, temperature=0.7)
    expected = np.take_along_axis(reference, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.log_probs), expected, atol=LOGPROB_ATOL)
    # Every sampled token lies in the nucleus: the smallest top set whose mass before it is < top_p.
    for b in range(3):
        for t in range(MAX_NEW):
            probs = np.exp(reference[b, t])
            order = np.argsort(-probs)
            mass_before = np.cumsum(probs[order]) - probs[order]
            nucleus = set(order[mass_before < NUCLEUS.top_p + 1e-6].tolist())  # tolerance: fp32 cumsum
            assert tokens[b, t] in nucleus, (b, t)
            assert len(nucleus) < 256
    assert len(np.unique(tokens)) > 1


def test_same_key_same_samples_and_row_independence(model, prompts):
    ids, mask, _ = prompts
    config = NUCLEUS
    first = generate(model, ids, mask, jax.random.key(7), config)
    again = generate(model, ids, mask, jax.random.key(7), config)
    other = generate(model, ids, mask, jax.random.key(8), config)
    np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(again.tokens))
    assert not np.array_equal(np.asarray(first.tokens), np.asarray(other.tokens))
    # Row b is drawn with fold_in(split(key, B)[b], t): changing row 1's prompt leaves row 0 alone.
    changed = ids.at[1, -1].set((ids[1, -1] + 1) % 256)
    moved = generate(model, changed, mask, jax.random.key(7), config)
    np.testing.assert_array_equal(np.asarray(moved.tokens)[0], np.asarray(first.tokens)[0])


def test_top_k_one_is_greedy(model, prompts, greedy):
    ids, mask, _ = prompts
    out = generate(model, ids, mask, jax.random.key(3), SamplingConfig(MAX_NEW, temperature=1.0, top_k=1))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy.tokens))


def test_stop_tokens_end_each_sequence(model, prompts, greedy):
    ids, mask, _ = prompts
    path = np.asarray(greedy.tokens)
    stops = (int(path[0, 1]), int(path[2, 3]))  # two stop ids, hit at different steps
    config = SamplingConfig(MAX_NEW, temperature=0.0, stop_tokens=stops, pad_id=-1)
    out = generate(model, ids, mask, jax.random.key(0), config)
    tokens, lengths, log_probs = map(np.asarray, out)
    for b in range(3):
        hits = [t for t in range(MAX_NEW) if path[b, t] in stops]
        length = hits[0] + 1 if hits else MAX_NEW
        assert lengths[b] == length
        np.testing.assert_array_equal(tokens[b, :length], path[b, :length])
        assert (tokens[b, length:] == -1).all()
        assert (log_probs[b, length:] == 0).all()
    assert lengths[0] == 2


GROUP = 3  # completions per prompt in the group-prefill tests


@pytest.fixture(scope="module")
def long_prompts():
    """Two left-padded prompts of 64 and 44 tokens (pad id 0): 128 prompt positions, so that every row
    reduction of the prefill (RMSNorms, l2 norms, softmaxes) reads >= 4096 elements for the 2 prompts
    as for their 6 repeated rows (see test_group_prefill_of_short_prompts_within_rounding)."""
    rng = np.random.default_rng(2)
    rows = [rng.integers(1, 256, n).tolist() for n in (64, 44)]
    ids = np.array([[0] * (64 - len(r)) + r for r in rows], np.int32)
    mask = np.array([[0] * (64 - len(r)) + [1] * len(r) for r in rows], np.int32)
    return ids, mask


def _group_and_repeated(model, ids, mask, key, config):
    """(prompts prefilled once, group_size=GROUP; the old path: the prompts repeated GROUP times row by row)."""
    grouped = generate(model, jnp.asarray(ids), jnp.asarray(mask), key, config, group_size=GROUP)
    repeated = generate(model, jnp.asarray(np.repeat(ids, GROUP, axis=0)), jnp.asarray(np.repeat(mask, GROUP, axis=0)),
                        key, config)
    return grouped, repeated


@pytest.mark.parametrize("copy", [True, False], ids=["per-group-cache", "stacked-cache"])
def test_group_prefill_samples_equal_repeated_prompts_bit_for_bit(model, long_prompts, copy):
    """Each prompt prefilled once and its cache repeated to its G rows samples what the prompts repeated
    G times did (the row keys are split over the P x G rows either way): tokens, lengths and log-probs
    equal bit for bit, on the CPU's per-group cache and the accelerators' stacked one."""
    ids, mask = long_prompts
    config = SamplingConfig(MAX_NEW, temperature=1.0, copy_layer_weights=copy)
    grouped, repeated = _group_and_repeated(model, ids, mask, jax.random.key(5), config)
    assert np.asarray(grouped.tokens).shape == (2 * GROUP, MAX_NEW)
    np.testing.assert_array_equal(np.asarray(grouped.tokens), np.asarray(repeated.tokens))
    np.testing.assert_array_equal(np.asarray(grouped.lengths), np.asarray(repeated.lengths))
    np.testing.assert_array_equal(np.asarray(grouped.log_probs), np.asarray(repeated.log_probs))
    # The G rows of a group are different samples of one prompt: not one row copied.
    for group in np.asarray(grouped.tokens).reshape(2, GROUP, MAX_NEW):
        assert len({tuple(row) for row in group}) == GROUP


def test_group_prefill_of_short_prompts_within_rounding(model, prompts):
    """The fixture's 3 prompts of <= 7 tokens: same tokens and lengths; log-probs equal to rounding.
    XLA:CPU (jaxlib 0.10.2) hands a reduction of >= 4096 elements to YNNPACK (``__ynn_fusion``) and
    emits a smaller one itself (a 32-wide reduce-window, then a reduce), summing in another order:
    the 64-wide RMSNorm of 3 x 7 rows falls under that size, of 12 x 7 rows over it, so the two
    prefills' logits and states differ in the last bits (measured: 1-2 ulps of log-probs of order 5).
    Tolerance: a few ulps per reduction of order-1 values, through 4 layers and the LM head, bound
    log-probs of order 10 by 1e-5."""
    ids, mask, _ = prompts
    grouped, repeated = _group_and_repeated(model, ids, mask, jax.random.key(5), NUCLEUS)
    np.testing.assert_array_equal(np.asarray(grouped.tokens), np.asarray(repeated.tokens))
    np.testing.assert_array_equal(np.asarray(grouped.lengths), np.asarray(repeated.lengths))
    np.testing.assert_allclose(np.asarray(grouped.log_probs), np.asarray(repeated.log_probs), rtol=0, atol=1e-5)


def test_invalid_sampling_config_is_a_typed_error():
    with pytest.raises(SamplingError):
        SamplingConfig(0)
    with pytest.raises(SamplingError):
        SamplingConfig(4, top_p=0.0)
    with pytest.raises(SamplingError):
        SamplingConfig(4, temperature=-1.0)
    with pytest.raises(SamplingError, match="group_size"):
        generate(None, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32), jax.random.key(0),
                 SamplingConfig(4), group_size=0)


def test_first_argmax_is_numpy_argmax_with_ties_nans_and_infinities():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (64, 257)).astype(np.float32)   # few distinct values: many ties
    x[1] = 2.0                                              # all equal
    x[2] = -np.inf
    x[3, [5, 9]] = np.inf
    x[4, [7, 100]] = np.nan                                 # NaN wins over a larger number
    x[4, 3] = 1e30
    x[5, 256] = np.nan
    x[6, 0] = np.nan
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got[4] == 7 and got[2] == 0 and got[3] == 5
    # batched leading axes reduce over the last one only
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x.reshape(8, 8, 257)))),
                                  np.argmax(x, axis=-1).reshape(8, 8))


def test_categorical_draw_is_jax_random_categorical():
    """The sampler's Gumbel-max draw is jax.random.categorical's, sample for sample (so the PRNG
    contract's samples did not change with the faster argmax), masked candidates included."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0.0, 2.0, (256, 300)).astype(np.float32)
    logits[:, ::3] = -np.inf                                # filtered-out candidates
    keys = jax.random.split(jax.random.key(3), 256)
    ours = jax.jit(jax.vmap(gumbel_categorical))(keys, jnp.asarray(logits))
    theirs = jax.jit(jax.vmap(jax.random.categorical))(keys, jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert (np.asarray(ours) % 3 != 0).all()


@pytest.fixture(scope="module")
def two_group_model():
    """The tiny architecture with 8 layers: two groups, so the cache has a real group axis."""
    model = nnx.eval_shape(lambda: Qwen35ForCausalLM(Qwen35Config.tiny(num_hidden_layers=8), rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.05, x.shape), x.dtype), nnx.state(model)))
    return model


def test_per_group_cache_steps_like_the_stacked_one(two_group_model, prompts):
    model = two_group_model
    ids, mask, _ = prompts
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda s, c: nnx.merge(graphdef, s).prefill(ids, mask, c))
    step = jax.jit(lambda s, tok, c, groups: nnx.merge(graphdef, s).decode_step(tok, c, groups))
    _, cache = prefill(state, model.init_cache(ids.shape[0], ids.shape[1] + 2))
    grouped = cache.per_group()
    assert grouped.grouped and len(grouped.blocks) == model.config.num_groups
    for a, b in zip(jax.tree.leaves(grouped.stacked()), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    token = jnp.asarray([5, 6, 7], jnp.int32)
    # Two programs (scanned vs unrolled groups) round differently: fp32 states of order 1, a few ulps.
    logits, stepped = step(state, token, cache, None)
    grouped_logits, grouped_stepped = step(state, token, grouped, model.layer_groups())
    np.testing.assert_allclose(np.asarray(grouped_logits), np.asarray(logits), rtol=1e-5, atol=1e-5)
    assert grouped_stepped.grouped
    for a, b in zip(jax.tree.leaves(grouped_stepped.stacked()), jax.tree.leaves(stepped), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="per-group cache"):
        step(state, token, cache, model.layer_groups())
    with pytest.raises(ValueError, match="per-group cache"):
        step(state, token, grouped, None)


def test_cpu_decode_loop_copies_no_stacked_state(two_group_model, prompts):
    """Each step updates every layer's recurrent state and K/V cache in place: the compiled loop holds
    no copy of a group-stacked state (before the per-group cache, XLA:CPU copied every stacked
    recurrent state and K/V cache out and back at each token; BENCHMARKS.md)."""
    from caper_jax.models import sampler

    model = two_group_model
    ids, mask, _ = prompts
    graphdef, state = nnx.split(model)
    groups = sampler._cut_layer_groups(graphdef, state)
    logits, cache = sampler._prefill(graphdef, state, ids, mask, groups, max_len=ids.shape[1] + MAX_NEW,
                                     cache_dtype="float32")
    config = SamplingConfig(MAX_NEW, temperature=0.0, copy_layer_weights=True)
    hlo = sampler._decode.lower(graphdef, state, logits, cache, jax.random.split(jax.random.key(0), 3), groups,
                                config=config).compile().as_text()
    stacked = {",".join(map(str, x.shape)) for block in cache.stacked().blocks for x in block.values()}
    copies = re.findall(r"= f32\[([0-9,]+)\]\{[0-9,]*\} copy\(", hlo)
    assert copies, "expected some copies to look at (the pattern no longer matches XLA's HLO text)"
    assert not stacked & set(copies), (stacked, copies)


def test_prefill_and_decode_share_one_cut_of_the_layer_weights(two_group_model, prompts):
    """generate's CPU path: one program cuts the weights per group, the prefill reads them and
    writes a per-group cache, the decode loop takes both and keeps that layout. Same logits, cache
    and tokens as the stacked prefill followed by the scanned decode (the accelerators' path)."""
    from caper_jax.models import sampler

    model = two_group_model
    ids, mask, _ = prompts
    graphdef, state = nnx.split(model)
    max_len = ids.shape[1] + MAX_NEW
    groups = sampler._cut_layer_groups(graphdef, state)
    assert len(groups) == model.config.num_groups == 2
    logits, cache = sampler._prefill(graphdef, state, ids, mask, max_len=max_len, cache_dtype="float32")
    shared_logits, shared_cache = sampler._prefill(graphdef, state, ids, mask, groups, max_len=max_len,
                                                   cache_dtype="float32")
    assert shared_cache.grouped and not cache.grouped
    # Two programs (scanned vs unrolled groups) round differently: a few ulps of order-1 values.
    np.testing.assert_allclose(np.asarray(shared_logits), np.asarray(logits), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(shared_cache.stacked()), jax.tree.leaves(cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    config = SamplingConfig(MAX_NEW, temperature=0.0, copy_layer_weights=True)
    keys = jax.random.split(jax.random.key(0), ids.shape[0])
    scanned, scanned_cache = sampler._decode(graphdef, state, logits, cache, keys, config=config)
    shared, shared_out = sampler._decode(graphdef, state, shared_logits, shared_cache, keys, groups, config=config)
    assert shared_out.grouped and not scanned_cache.grouped   # each cache leaves in the layout it came in
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(scanned.tokens))
    np.testing.assert_array_equal(np.asarray(generate(model, ids, mask, jax.random.key(0), config).tokens),
                                  np.asarray(shared.tokens))


def test_prefill_group_size_keeps_the_prefilled_rows_over_the_batch_shards():
    from caper_jax.models.sampler import prefill_group_size

    assert prefill_group_size(32, 8, 32) == 8     # v5p-64: one prompt per chip, prefilled once
    assert prefill_group_size(32, 8, 64) == 4     # v6e-64: 64 rows prefilled (each prompt twice), then x4
    assert prefill_group_size(4, 8, 1) == 8       # one device: every group shares one prefill
    assert prefill_group_size(2, 4, 16) == 1      # 8 rows cannot cover 16 shards: the rows as they are
    assert prefill_group_size(6, 8, 16) == 1 and prefill_group_size(6, 8, 12) == 4   # 48 rows; 12 rows
